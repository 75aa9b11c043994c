"""The model's tensors before any job: exact from the safetensors headers, else per family from config.json.

Why: ``estimate`` used to count every model as a Llama-style decoder. Against thirteen architectures
built by transformers 5.24 that was exact for 7 and off by 20 % for gpt-oss (expert biases, sinks),
8 % for Qwen3-MoE (``moe_intermediate_size``), 7 % for DeepSeek-V3 (MLA, a dense first layer, shared
experts) and a little for Gemma-2/3 and OLMo-2 (their extra norms): at real sizes tens of GB per GPU.

What we do, torch-free (the login side must not import torch):

1. when the weights are local or in the hub cache (``HF_HOME``), :func:`header_shapes` reads only the
   safetensors headers (an 8-byte length and a JSON object per file: a few KB) and counts every tensor
   stored: exact, whatever the architecture (a tied head is not stored, and not counted twice);
2. otherwise :func:`family_tensors` does the arithmetic from config.json for the family the
   ``model_type`` belongs to (:data:`FAMILIES`), and says which; a model type outside every family is
   counted as a Llama-style decoder and the result says so.

The layers are kept apart (DeepSeek-V3's first ``first_k_dense_replace`` layers are dense, the rest
MoE; Qwen3-MoE's ``mlp_only_layers``), so the per-unit figures (reduce-scatter buffers, gathered
layers) use the largest layer.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurmft.modelinfo import hub_snapshot

Shape = tuple[int, ...]

#: model_type -> the family whose arithmetic counts it (tests/test_paramcount.py checks each against transformers).
FAMILIES: dict[str, str] = {
    **dict.fromkeys(("llama", "mistral", "qwen2", "qwen3", "granite", "phi3", "smollm3", "gemma"), "dense"),
    **dict.fromkeys(("gemma2", "gemma3_text", "gemma3"), "gemma2"),
    "olmo2": "olmo2",
    **dict.fromkeys(("mixtral", "qwen3_moe", "qwen2_moe", "olmoe"), "moe"),
    **dict.fromkeys(("deepseek_v3", "deepseek_v2"), "mla_moe"),
    "gpt_oss": "gpt_oss",
}

FAMILY_WORDS = {
    "dense": "dense decoder (Llama-style)",
    "gemma2": "Gemma-2/3 (four norms per layer)",
    "olmo2": "OLMo-2 (q/k norms over all heads, norms after attention and MLP)",
    "moe": "mixture of experts (fused experts, router; Qwen2-MoE's shared expert)",
    "mla_moe": "DeepSeek MLA attention with routed and shared experts",
    "gpt_oss": "gpt-oss (experts with biases, attention sinks)",
}

_HEADER_LIMIT = 100 * 2**20  # a header larger than this is not a safetensors file (the format caps it at 100 MB)


# ----------------------------------------------------------------------------- from the headers
def _read_header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > _HEADER_LIMIT:
            raise ValueError(f"{path}: header length {length} is not a safetensors header")
        return json.loads(f.read(length))


def header_shapes(model_dir: Path) -> dict[str, Shape] | None:
    """Every tensor's shape from the safetensors headers of ``model_dir`` (None: no safetensors weights there).

    Reads only the headers: the index, then 8 bytes plus the JSON header of each file.
    """
    index = model_dir / "model.safetensors.index.json"
    try:
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (model_dir / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            return None
        shapes: dict[str, Shape] = {}
        for name in files:
            header = _read_header(model_dir / name)
            shapes.update((k, tuple(v["shape"])) for k, v in header.items() if k != "__metadata__")
        return shapes
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None


def layers_from_headers(shapes: dict[str, Shape]) -> tuple[list[list[Shape]], list[Shape]]:
    """The header's tensors split into decoder layers (``...layers.<i>.``) and the rest."""
    layers: dict[int, list[Shape]] = {}
    root: list[Shape] = []
    for name, shape in shapes.items():
        m = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
        if m:
            layers.setdefault(int(m.group(1)), []).append(shape)
        else:
            root.append(shape)
    return [layers[i] for i in sorted(layers)], root


def local_header_shapes(name_or_path: str, revision: str | None = None) -> dict[str, Shape] | None:
    """:func:`header_shapes` of the weights the job will load, when they are here: the local directory, or
    the hub-cache snapshot (``HF_HOME``) that holds them; None when only config.json is at hand."""
    local = Path(name_or_path).expanduser()
    if local.is_dir():
        return header_shapes(local)
    if name_or_path.count("/") != 1 or local.exists():
        return None
    for marker in ("model.safetensors.index.json", "model.safetensors"):
        snapshot = hub_snapshot(name_or_path, revision, marker)
        if snapshot is not None:
            return header_shapes(snapshot)
    return None


# ----------------------------------------------------------------------------- from config.json
def family_of(model_cfg: dict[str, Any]) -> str | None:
    """The family of a config.json's model_type (None: not one we model; counted as dense)."""
    return FAMILIES.get(str(model_cfg.get("model_type", "llama")))


def _mlp(h: int, inter: int, bias: bool = False) -> list[Shape]:
    return [(inter, h), (inter, h), (h, inter)] + ([(inter,), (inter,), (h,)] if bias else [])


def _experts(c: dict[str, Any]) -> int:
    return int(c.get("num_local_experts") or c.get("num_experts") or c.get("n_routed_experts") or 0)


def _is_moe_layer(c: dict[str, Any], i: int) -> bool:
    """Whether decoder layer ``i`` has routed experts (DeepSeek's first dense layers, Qwen-MoE's sparse step and
    ``mlp_only_layers`` are dense)."""
    mtype = str(c.get("model_type", "llama"))
    family = FAMILIES.get(mtype, "dense")
    sparse_step = int(c.get("decoder_sparse_step") or 1)
    return bool(_experts(c)) and family in ("moe", "mla_moe", "gpt_oss") and (
        i >= int(c.get("first_k_dense_replace") or 0)) and i not in set(c.get("mlp_only_layers") or []) and (
        family != "moe" or mtype == "mixtral" or (i + 1) % sparse_step == 0)


def family_tensors(model_cfg: dict[str, Any]) -> tuple[list[list[Shape]], list[Shape], str]:
    """(tensors of each decoder layer, embeddings/final norm/head, family) from config.json alone."""
    c = model_cfg
    mtype = str(c.get("model_type", "llama"))
    family = FAMILIES.get(mtype, "dense")
    h, n_layers, vocab = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    heads = c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads") or heads
    d = c.get("head_dim") or h // heads
    q, kv = heads * d, kv_heads * d
    bias = bool(c.get("attention_bias", family == "gpt_oss"))
    qkv_bias = True if mtype == "qwen2" else bias
    o_bias = False if mtype == "qwen2" else bias
    inter = c["intermediate_size"]
    experts = int(c.get("num_local_experts") or c.get("num_experts") or c.get("n_routed_experts") or 0)
    moe_inter = c.get("moe_intermediate_size") or inter

    def attention() -> list[Shape]:
        if family == "mla_moe":
            nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
            kv_rank, q_rank = c["kv_lora_rank"], c.get("q_lora_rank")
            t: list[Shape] = ([(q_rank, h), (q_rank,), (heads * (nope + rope), q_rank)] if q_rank
                              else [(heads * (nope + rope), h)])
            return t + [(kv_rank + rope, h), (kv_rank,), (heads * (nope + v), kv_rank), (h, heads * v)]
        t = [(q, h), (kv, h), (kv, h), (h, q)]
        t += [(q,), (kv,), (kv,)] if qkv_bias else []
        t += [(h,)] if o_bias else []
        if family == "olmo2":
            t += [(q,), (kv,)]
        elif mtype in ("qwen3", "qwen3_moe", "gemma3_text", "gemma3"):
            t += [(d,), (d,)]
        if family == "gpt_oss":
            t.append((heads,))  # sinks
        return t

    norms = {"gemma2": 4}.get(family, 2)

    def dense_layer(width: int) -> list[Shape]:
        return attention() + _mlp(h, width, bool(c.get("mlp_bias", False))) + [(h,)] * norms

    def moe_layer() -> list[Shape]:
        t = attention() + [(h,)] * norms
        if family == "gpt_oss":
            return t + [(experts, h), (experts,), (experts, h, 2 * inter), (experts, 2 * inter),
                        (experts, inter, h), (experts, h)]
        width = inter if mtype == "mixtral" else moe_inter
        t += [(experts, h), (experts, 2 * width, h), (experts, h, width)]
        shared = int(c.get("n_shared_experts") or 0)
        if shared:
            t += _mlp(h, moe_inter * shared)
        if c.get("shared_expert_intermediate_size"):
            t += _mlp(h, c["shared_expert_intermediate_size"]) + [(1, h)]
        return t

    layers = [moe_layer() if _is_moe_layer(c, i) else dense_layer(inter) for i in range(n_layers)]
    tied = bool(c.get("tie_word_embeddings", False))
    root: list[Shape] = [(vocab, h), (h,)] + ([] if tied else [(vocab, h)])
    return layers, root, family if mtype in FAMILIES else "dense"


# ----------------------------------------------------------------------------- the LoRA adapters
#: A module or parameter of a decoder layer: (path inside the layer, weight shape, kind), kind one of
#: "linear" (an ``nn.Linear``, [out, in]), "router" (a MoE router's 2-D weight, not an ``nn.Linear`` in
#: transformers 5) or "experts" (a fused 3-D expert tensor, [experts, a, b]).
Module = tuple[str, Shape, str]

#: PEFT 0.21 on transformers 5 (``peft/utils/transformers_weight_conversion.py``, ``_convert_peft_config_moe``):
#: for MoE models whose experts transformers fused, a target with one of these per-expert names is moved onto the
#: fused expert tensor (or the router), even where it also names a shared expert's or a dense layer's linear layer
#: (DeepSeek). The job adapts no fused tensor (slurmft/job/adapters.py): ``all-linear`` leaves these names out,
#: and a listed one is refused. The model types are those transformers' ``_MODEL_TO_CONVERSION_PATTERN`` maps
#: (plus PEFT's mixtral). tests/test_lora_count.py compares these counts with the job's adapters.
PEFT_MOE_RENAMES: dict[str, dict[str, str]] = {
    "mixtral": {"gate": "router", "w1": "gate_up_proj", "w3": "gate_up_proj", "w2": "down_proj"},
    "qwen2_moe": {"gate": "router", "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"},
}
PEFT_MOE_PATTERN: dict[str, str] = {
    "mixtral": "mixtral", **dict.fromkeys(("qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3"), "qwen2_moe")}
ROOT_MODULES = ("embed_tokens", "lm_head", "norm")  # modules_to_save names outside the decoder layers


def layer_modules(model_cfg: dict[str, Any]) -> list[list[Module]]:
    """The linear layers, routers and fused expert tensors of each decoder layer, as transformers 5.24 names them.

    The same arithmetic as :func:`family_tensors` (without norms and biases), with names, because an adapter
    is added per named linear layer. The output head is not in a decoder layer (``all-linear`` skips it).
    """
    c = model_cfg
    mtype = str(c.get("model_type", "llama"))
    family = FAMILIES.get(mtype, "dense")
    h = c["hidden_size"]
    heads = c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads") or heads
    d = c.get("head_dim") or h // heads
    q, kv = heads * d, kv_heads * d
    inter = c["intermediate_size"]
    experts = _experts(c)
    moe_inter = c.get("moe_intermediate_size") or inter

    def attention() -> list[Module]:
        if family == "mla_moe":
            nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
            kv_rank, q_rank = c["kv_lora_rank"], c.get("q_lora_rank")
            t: list[Module] = ([("self_attn.q_a_proj", (q_rank, h), "linear"),
                                ("self_attn.q_b_proj", (heads * (nope + rope), q_rank), "linear")] if q_rank
                               else [("self_attn.q_proj", (heads * (nope + rope), h), "linear")])
            return t + [("self_attn.kv_a_proj_with_mqa", (kv_rank + rope, h), "linear"),
                        ("self_attn.kv_b_proj", (heads * (nope + v), kv_rank), "linear"),
                        ("self_attn.o_proj", (h, heads * v), "linear")]
        if mtype == "phi3":  # fused q/k/v and gate/up linear layers
            return [("self_attn.qkv_proj", (q + 2 * kv, h), "linear"), ("self_attn.o_proj", (h, q), "linear")]
        return [(f"self_attn.{n}_proj", s, "linear") for n, s in (("q", (q, h)), ("k", (kv, h)), ("v", (kv, h)),
                                                                   ("o", (h, q)))]

    def mlp(prefix: str, width: int) -> list[Module]:
        if mtype == "phi3":
            return [(f"{prefix}gate_up_proj", (2 * width, h), "linear"), (f"{prefix}down_proj", (h, width), "linear")]
        return [(f"{prefix}gate_proj", (width, h), "linear"), (f"{prefix}up_proj", (width, h), "linear"),
                (f"{prefix}down_proj", (h, width), "linear")]

    def moe() -> list[Module]:
        width = inter if mtype in ("mixtral", "gpt_oss") else moe_inter
        t: list[Module] = [("mlp.gate.weight" if family != "gpt_oss" else "mlp.router.weight", (experts, h), "router"),
                           ("mlp.experts.gate_up_proj", (experts, 2 * width, h), "experts"),
                           ("mlp.experts.down_proj", (experts, h, width), "experts")]
        shared = int(c.get("n_shared_experts") or 0)
        if shared:
            t += mlp("mlp.shared_experts.", moe_inter * shared)
        if c.get("shared_expert_intermediate_size"):
            t += mlp("mlp.shared_expert.", c["shared_expert_intermediate_size"])
            t.append(("mlp.shared_expert_gate", (1, h), "linear"))
        return t

    return [attention() + (moe() if _is_moe_layer(c, i) else mlp("mlp.", inter)) for i in range(c["num_hidden_layers"])]


def _ends(path: str, target: str) -> bool:
    """PEFT's rule for a listed name: the module's name is the target or ends with ``.target``."""
    return path == target or path.endswith("." + target)


@dataclass(frozen=True)
class AdapterCount:
    """The trainable tensors a ``lora`` section adds, per decoder layer and outside them."""

    layers: tuple[tuple[Shape, ...], ...]  # every decoder layer's adapter tensors (lora_A, lora_B) and saved copies
    root: tuple[Shape, ...]  # modules_to_save copies outside the decoder layers (embeddings, head, final norm)
    target_modules: tuple[str, ...]  # resolved: last segments of what got an adapter (as the job's marker lists)
    unmatched: tuple[str, ...] = ()  # why a listed name adapts nothing here (the job refuses such a name)

    @property
    def trainable(self) -> int:
        return sum(math.prod(s) for layer in self.layers for s in layer) + sum(math.prod(s) for s in self.root)


def adapter_count(model_cfg: dict[str, Any], r: int, target_modules: str | list[str] | tuple[str, ...],
                  modules_to_save: list[str] | tuple[str, ...] = ()) -> AdapterCount:
    """:func:`adapter_tensors` of a config.json's decoder."""
    return adapter_tensors(layer_modules(model_cfg), str(model_cfg.get("model_type", "llama")),
                           model_cfg["hidden_size"], model_cfg["vocab_size"], r, target_modules, modules_to_save,
                           tied=bool(model_cfg.get("tie_word_embeddings", False)))


def adapter_tensors(modules: Sequence[Sequence[Module]], mtype: str, h: int, vocab: int, r: int,
                    target_modules: str | list[str] | tuple[str, ...],
                    modules_to_save: list[str] | tuple[str, ...] = (), tied: bool = False) -> AdapterCount:
    """The adapter tensors of a ``lora`` section on this model, as PEFT 0.21 creates them.

    A linear layer of weight ``[out, in]`` gets ``lora_A [r, in]`` and ``lora_B [out, r]``: ``r·(in + out)``
    parameters. ``all-linear`` = every linear layer of the decoder (not the output head); a list = the linear
    layers whose name is or ends with a listed name, and ``embed_tokens`` (PEFT's embedding LoRA: A [r, vocab],
    B [h, r]) and ``lm_head`` when the embeddings are not ``tied`` (the job refuses them on tied ones). Fused
    expert tensors and routers are never adapted, nor, in MoE models PEFT converts (:data:`PEFT_MOE_RENAMES`),
    the linear layers named like them.
    ``modules_to_save``: a full trainable copy (not of ``tied`` embeddings: the job refuses those).
    """
    linear_leaves = sorted({p.rsplit(".", 1)[-1] for layer in modules for p, _, kind in layer if kind == "linear"})
    renames = PEFT_MOE_RENAMES.get(PEFT_MOE_PATTERN.get(mtype, ""), {})
    unmatched: list[str] = []
    if target_modules == "all-linear":
        module_names = {leaf for leaf in linear_leaves if leaf not in renames}
    else:
        module_names = set()
        for t in target_modules:  # the job accepts a listed name only when it names a linear (or embedding) layer
            if t.rsplit(".", 1)[-1] in ("embed_tokens", "lm_head"):
                if tied:
                    unmatched.append(f"{t!r} is one of the tied embeddings (tie_word_embeddings): the merged model "
                                     "cannot hold an adapter on one use of a shared matrix")
                continue
            if any(_ends(p, t) for layer in modules for p, _, kind in layer if kind == "linear"):
                if any(_ends(t, old) for old in renames):
                    unmatched.append(f"{t!r} names the fused expert tensors of this {mtype} for PEFT, which the job "
                                     f"refuses (its linear layers: {', '.join(linear_leaves)})")
                else:
                    module_names.add(t)
            else:
                fused = any(_ends(p, t) or p.endswith("." + t + ".weight")
                            for layer in modules for p, _, kind in layer if kind != "linear")
                unmatched.append(f"{t!r} is {'a router or fused expert tensor' if fused else 'no linear layer'} of "
                                 f"this {mtype} (its linear layers: {', '.join(linear_leaves)})")
    layers: list[tuple[Shape, ...]] = []
    adapted: set[str] = set()
    for layer in modules:
        tensors: list[Shape] = []
        for path, shape, kind in layer:
            leaf = path.removesuffix(".weight").rsplit(".", 1)[-1]
            if kind == "linear" and any(_ends(path, t) for t in module_names):  # [out, in] -> A [r, in], B [out, r]
                tensors += [(r, shape[1]), (shape[0], r)]
                adapted.add(leaf)
            if kind == "linear" and any(path.endswith(m) for m in modules_to_save):  # PEFT: a plain suffix
                tensors.append(shape)
        layers.append(tuple(tensors))
    root_shapes = {"embed_tokens": (vocab, h), "lm_head": (vocab, h), "norm": (h,)}
    root: list[Shape] = []
    if not tied and target_modules != "all-linear":
        leaves = {t.rsplit(".", 1)[-1] for t in target_modules}
        if "embed_tokens" in leaves:  # PEFT's LoRA embedding: lora_embedding_A [r, vocab], lora_embedding_B [h, r]
            root += [(r, vocab), (h, r)]
            adapted.add("embed_tokens")
        if "lm_head" in leaves:  # a linear layer [vocab, h]: A [r, h], B [vocab, r]
            root += [(r, h), (vocab, r)]
            adapted.add("lm_head")
    for name in modules_to_save:
        leaf = name.rsplit(".", 1)[-1]
        if tied and leaf in ("embed_tokens", "lm_head"):  # the job refuses a copy that would untie them
            unmatched.append(f"modules_to_save {leaf!r} is one of the tied embeddings (tie_word_embeddings), which "
                             "the job refuses: a trained copy would untie them")
        elif leaf in root_shapes:
            root.append(root_shapes[leaf])
            if leaf == "norm":  # PEFT matches modules_to_save by plain suffix: every *_layernorm too
                unmatched.append("modules_to_save 'norm' also copies each layer's *norm modules (PEFT matches a plain "
                                 "suffix): those few parameters per layer are not counted")
        elif not any(_ends(p, name) for layer in modules for p, _, kind in layer if kind == "linear"):
            unmatched.append(f"modules_to_save {name!r}: not counted (slurmft estimate knows {', '.join(ROOT_MODULES)} "
                             "and the linear layers)")
    return AdapterCount(tuple(layers), tuple(root), tuple(sorted(adapted)), tuple(unmatched))
