"""The model's tensors as ``slurmft estimate`` counts them: the decoder's dimensions (:class:`ModelShape`), its
parameters, and the LoRA adapters a ``lora`` section adds (:func:`lora_count`).

Integers from the model's ``config.json`` (or the safetensors headers), no torch: the login node reads
this. The memory arithmetic (``slurmft/plan/estimate.py``) and the collectives (``slurmft/plan/communication.py``)
take their shapes from here; ``docs/estimate.md`` writes the counts out.

Assumptions:

* Parameters: every tensor of the safetensors headers when the weights are at hand (exact), else the
  arithmetic of the model type's family from config.json (slurmft/plan/paramcount.py: dense, Gemma-2/3,
  OLMo-2, MoE with and without shared experts, DeepSeek MLA, gpt-oss); tied embeddings counted once.
* FSDP full shard: each tensor is split along dim 0 into ``world_size`` chunks of ``ceil(d0 / ws)``
  rows (FSDP2's padding); :func:`shard_numel` counts the largest rank's chunk.
* LoRA: the adapters of PEFT's targets on the model's named linear layers, and the ``modules_to_save``
  copies, exact (slurmft/plan/paramcount.py ``adapter_tensors``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from slurmft.errors import ConfigError
from slurmft.plan.paramcount import (
    FAMILIES,
    AdapterCount,
    adapter_tensors,
    family_tensors,
    layer_modules,
    layers_from_headers,
)
from slurmft.plan.settings import LoraSettings

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)  # counted exactly from config.json (slurmft/plan/paramcount.py)


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder config that the arithmetic needs."""

    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    experts: int  # 0 = dense MLP
    experts_per_token: int
    file_dtype: str | None
    layer_list: tuple[tuple[tuple[int, ...], ...], ...] = ()  # every decoder layer's tensors (paramcount.py)
    root_list: tuple[tuple[int, ...], ...] = ()  # embeddings, final norm, untied head
    family: str = "dense"
    count_source: str = "config.json"  # or "safetensors headers"
    expert_intermediate: int = 0  # an expert's MLP width (moe_intermediate_size where the config has one)
    shared_intermediate: int = 0  # the shared experts' MLP width (DeepSeek, Qwen2-MoE), 0 = none
    modules: tuple[tuple[tuple[str, tuple[int, ...], str], ...], ...] = ()  # named linear layers (LoRA targets)

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def layer_tensors(self) -> list[tuple[int, ...]]:
        """Shapes of the largest decoder layer's parameters (dim 0 is the one FSDP shards): the unit FSDP2
        gathers and reduce-scatters at a time."""
        return list(max(self.layer_list, key=lambda t: sum(numel(s) for s in t)))

    def root_tensors(self) -> list[tuple[int, ...]]:
        """Embeddings, final norm and (untied) LM head: the root FSDP module's own parameters."""
        return list(self.root_list)

    def all_tensors(self) -> list[tuple[int, ...]]:
        return [s for layer in self.layer_list for s in layer] + list(self.root_list)


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def shard_numel(shape: tuple[int, ...], world_size: int) -> int:
    """Elements on the largest rank when FSDP2 splits dim 0 into ``world_size`` padded chunks."""
    return math.ceil(shape[0] / world_size) * math.prod(shape[1:])


def model_shape(model_cfg: dict[str, Any], headers: dict[str, tuple[int, ...]] | None = None) -> ModelShape:
    """Read the decoder's dimensions out of a config.json dict; a missing key is a ConfigError.

    ``headers`` (tensor name -> shape from the safetensors headers, when the weights are at hand) give the
    exact tensors; else they come from the family's arithmetic (slurmft/plan/paramcount.py).
    """
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    missing = [k for k in required if not isinstance(model_cfg.get(k), int)]
    if missing:
        kind = model_cfg.get("model_type", "unknown")
        raise ConfigError(
            f"model.name_or_path: config.json (model_type {kind!r}) lacks {', '.join(missing)}; "
            "slurmft estimate understands decoder configs of the families it knows",
            [f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"],
        )
    mtype = str(model_cfg.get("model_type", "llama"))
    heads = model_cfg["num_attention_heads"]
    hidden = model_cfg["hidden_size"]
    kv_heads = model_cfg.get("num_key_value_heads") or heads
    head_dim = model_cfg.get("head_dim") or hidden // heads
    attention_bias = bool(model_cfg.get("attention_bias", False))
    qkv_bias = True if mtype == "qwen2" else attention_bias
    o_bias = False if mtype == "qwen2" else attention_bias
    layer_list, root_list, family = family_tensors(model_cfg)
    source = "config.json"
    if headers:
        layer_list, root_list = layers_from_headers(headers)
        source = "safetensors headers"
    experts = int(model_cfg.get("num_local_experts") or model_cfg.get("num_experts")
                  or model_cfg.get("n_routed_experts") or 0)
    inter = model_cfg["intermediate_size"]
    moe_inter = inter if mtype in ("mixtral", "gpt_oss") else (model_cfg.get("moe_intermediate_size") or inter)
    shared = int(model_cfg.get("n_shared_experts") or 0) * moe_inter or int(
        model_cfg.get("shared_expert_intermediate_size") or 0)
    return ModelShape(
        model_type=mtype,
        hidden=hidden,
        layers=model_cfg["num_hidden_layers"],
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate=inter,
        vocab=model_cfg["vocab_size"],
        tied=bool(model_cfg.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=bool(model_cfg.get("mlp_bias", False)),
        qk_norm=mtype in ("qwen3", "qwen3_moe", "gemma3_text", "gemma3", "olmo2"),
        experts=experts,
        experts_per_token=int(model_cfg.get("num_experts_per_tok") or 2) if experts else 0,
        file_dtype=model_cfg.get("dtype") or model_cfg.get("torch_dtype"),
        layer_list=tuple(tuple(layer) for layer in layer_list),
        root_list=tuple(root_list),
        family=family if mtype in FAMILIES else "dense",
        count_source=source,
        expert_intermediate=moe_inter if experts else 0,
        shared_intermediate=shared,
        modules=tuple(tuple(layer) for layer in layer_modules(model_cfg)),
    )


def count_parameters(model_cfg: dict[str, Any], headers: dict[str, tuple[int, ...]] | None = None) -> int:
    """Parameter count: every tensor of the safetensors headers when given (exact), else the family's
    arithmetic from config.json (slurmft/plan/paramcount.py; docs/estimate.md has the formulas)."""
    return sum(numel(s) for s in model_shape(model_cfg, headers).all_tensors())


@lru_cache(maxsize=64)
def lora_count(shape: ModelShape, lora: LoraSettings) -> LoraTensors:
    """The adapters of ``lora`` on this model (slurmft/plan/paramcount.py: PEFT's targets, exact)."""
    return LoraTensors(adapter_tensors(shape.modules, shape.model_type, shape.hidden, shape.vocab, lora.r,
                                       lora.target_modules, lora.modules_to_save, tied=shape.tied))


@dataclass(frozen=True)
class LoraTensors:
    """:class:`AdapterCount` with the flat views the arithmetic needs."""

    count: AdapterCount

    @property
    def layers(self) -> tuple[tuple[tuple[int, ...], ...], ...]:
        return self.count.layers

    @property
    def root(self) -> tuple[tuple[int, ...], ...]:
        return self.count.root

    def all_tensors(self) -> list[tuple[int, ...]]:
        return [s for layer in self.layers for s in layer] + list(self.root)
