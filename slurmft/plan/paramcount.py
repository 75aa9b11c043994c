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
import re
import struct
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

    layers: list[list[Shape]] = []
    sparse_step = int(c.get("decoder_sparse_step") or 1)
    dense_only = set(c.get("mlp_only_layers") or [])
    first_dense = int(c.get("first_k_dense_replace") or 0)
    for i in range(n_layers):
        is_moe = bool(experts) and family in ("moe", "mla_moe", "gpt_oss") and i >= first_dense and (
            i not in dense_only) and (family != "moe" or mtype == "mixtral" or (i + 1) % sparse_step == 0)
        layers.append(moe_layer() if is_moe else dense_layer(inter))
    tied = bool(c.get("tie_word_embeddings", False))
    root: list[Shape] = [(vocab, h), (h,)] + ([] if tied else [(vocab, h)])
    return layers, root, family if mtype in FAMILIES else "dense"
