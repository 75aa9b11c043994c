"""LoRA adapters on the meta-device model: added before sharding, initialised the same on every rank.

What PEFT does (0.21, ``get_peft_model``): it wraps every target ``nn.Linear`` in a LoRA layer whose
``base_layer`` is the original module and whose ``lora_A``/``lora_B`` are new linear layers, and it
initialises them as they are created (A Kaiming-uniform from the global RNG, B zero). What TRL does
with ``SFTTrainer(peft_config=...)``: the same on a model transformers already loaded in full.

Why that is not enough here: the model is on the ``meta`` device until FSDP2 has sharded it
(slurmft/job/parallelize.py), so an initial value made at creation is lost, and a value drawn from
the global RNG depends on what ran before it on that rank.

What we do (:func:`add_adapters`, :func:`init_adapters`):

1. the target names are checked against the model's modules first, each one on its own (PEFT
   silently ignores a name that matches nothing as long as another name matches), and a name that
   is a fused mixture-of-experts tensor (a parameter, not a linear layer) is refused by name;
2. ``all-linear`` becomes the names of the model's linear layers but the output head
   (:func:`linear_targets`: in a mixture-of-experts model the fused expert tensors and the router stay
   frozen, where PEFT 0.21's own ``all-linear`` would give them its per-expert ``ParamWrapper``);
   ``get_peft_model(..., low_cpu_mem_usage=True)`` adds the adapters on the meta device; the base
   parameters stay frozen in their dtype, the adapter parameters are float32 (their training state is
   0.3 % of the model's at r=16, so fp32 costs nothing and keeps small updates);
3. once the shards are allocated, every adapter tensor is drawn whole from a generator seeded by
   ``train.seed`` and the tensor's checkpoint name, and each rank keeps its own part: the same
   initial adapter on every rank, for any number of ranks and any order of construction, and for the
   single-process PEFT reference of the tests. The draw is PEFT's default (``init_lora_weights=True``,
   ``LoraLayer.reset_lora_parameters`` in 0.21) for each layer kind we accept: a linear layer's
   A ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (Kaiming-uniform with a=sqrt(5)) and B = 0; an embedding's
   ``lora_embedding_A`` = 0 and ``lora_embedding_B`` ~ N(0, 1). Either way the product B·A is 0, so the
   model starts exactly at the base model. Any other adapter tensor (DoRA's magnitude, a LoRA bias, a
   layer kind PEFT initialises otherwise) is refused by name rather than drawn some other way.

Tied embeddings (``tie_word_embeddings``: Gemma, Qwen2-0.5B, Llama-3.2-1B): PEFT trains an adapter on the
tied ``lm_head`` (or ``embed_tokens``) as a change of that one use of the shared matrix, which a merged
model (one matrix) cannot hold, and a trained full copy would untie them; both are refused before the
job (:func:`target_problems`, and ``slurmft validate`` from config.json).

The base weights are read into the wrapped layers by slurmft/job/weights.py under their checkpoint
names: PEFT's ``base_model.model.`` prefix and ``base_layer`` segment are wrapper segments to
:func:`slurmft.checkpoints.strip_wrappers`; the adapter tensors are not in the base checkpoint
(:func:`slurmft.checkpoints.is_adapter_name`). ``modules_to_save`` copies are trained in full and read
from the base weights of the module they copy.
"""

from __future__ import annotations

import contextlib
import logging
import math
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from slurmft.checkpoints import is_adapter_name, strip_wrappers
from slurmft.config import LoraConfig
from slurmft.errors import JobSetupError
from slurmft.lora import ALL_LINEAR, tied_target_problem

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdapterSummary:
    """What the adapters are: written into every checkpoint's COMPLETE marker and the run's reports."""

    r: int
    alpha: float
    dropout: float
    use_rslora: bool  # scaling alpha / sqrt(r) instead of alpha / r
    target_modules: list[str]  # resolved: the module names (last segments) that got an adapter
    modules_to_save: list[str]
    trainable: int  # parameters that train (adapters and modules_to_save copies)
    total: int  # every parameter of the adapted model

    def marker(self) -> dict[str, Any]:
        """The ``lora`` entry of a checkpoint's COMPLETE marker (and of fsdp_report)."""
        return {"r": self.r, "alpha": self.alpha, "use_rslora": self.use_rslora, "dropout": self.dropout,
                "target_modules": self.target_modules,
                "modules_to_save": self.modules_to_save, "trainable_params": self.trainable,
                "total_params": self.total}


def _linear_names(model: torch.nn.Module) -> list[str]:
    """The last segments of the model's linear layers (what ``target_modules`` names), sorted."""
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)})


def _matches(module_name: str, target: str) -> bool:
    """PEFT's rule for a list of names: the module's full name is the target or ends with ``.target``."""
    return module_name == target or module_name.endswith("." + target)


def target_problems(model: torch.nn.Module, lora: LoraConfig) -> list[str]:
    """Why ``lora.target_modules`` / ``lora.modules_to_save`` do not fit this model (empty: they do)."""
    modules = dict(model.named_modules())
    linear = _linear_names(model)
    problems = []
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = embed is not None and head is not None and (
        getattr(embed, "weight", None) is getattr(head, "weight", 0)
        or bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False)))
    targets = [] if lora.target_modules == ALL_LINEAR else list(lora.target_modules)
    for target in targets:
        hits = [m for name, m in modules.items() if _matches(name, target)]
        if tied and any(m is embed or m is head for m in hits):
            problems.append(tied_target_problem(target, type(model).__name__))
            continue
        if any(isinstance(m, torch.nn.Linear | torch.nn.Embedding) for m in hits):
            continue
        fused = sorted({f"{type(m).__name__}.{p}" for name, m in modules.items() for p, t in
                        m.named_parameters(recurse=False)
                        if t.dim() >= 3 and (_matches(f"{name}.{p}", target) or _matches(name, target))})
        if fused:
            problems.append(
                f"lora.target_modules: {target!r} is a fused tensor ({', '.join(fused[:2])}: the experts of a "
                "mixture-of-experts layer, one 3-D parameter), not a linear layer; LoRA on fused expert tensors is "
                f"not supported. Adapt the attention and shared layers instead (all-linear, or some of: "
                f"{', '.join(linear)})")
        elif hits:
            problems.append(f"lora.target_modules: {target!r} is a {type(hits[0]).__name__}, not a linear layer; "
                            f"linear layers of this model: {', '.join(linear)}")
        else:
            problems.append(f"lora.target_modules: {target!r} matches no module of {type(model).__name__}; its "
                            f"linear layers are: {', '.join(linear)}")
    for name in lora.modules_to_save:
        hits = [m for n, m in modules.items() if _matches(n, name)]
        if tied and any(m is embed or m is head for m in hits):
            problems.append(f"lora.modules_to_save: {name!r} is one of the tied input and output embeddings of "
                            f"{type(model).__name__} (tie_word_embeddings); a trained copy would untie them, which "
                            "neither the merged model nor PEFT's adapter can express. Leave it out")
        elif not hits:
            children = sorted({n.rsplit(".", 1)[-1] for n, m in modules.items()
                               if n and next(m.parameters(recurse=False), None) is not None})
            problems.append(f"lora.modules_to_save: {name!r} matches no module of {type(model).__name__}; modules "
                            f"with their own weights: {', '.join(children)}")
    return problems


def linear_targets(model: torch.nn.Module) -> list[str]:
    """``all-linear`` as module names: every ``nn.Linear`` but the output head, by its last name segment (by its
    full name where that segment also names something else: a mixture-of-experts router called ``gate``, or the
    fused ``down_proj`` expert tensor beside a shared expert's ``down_proj`` layer).

    Not PEFT's own ``all-linear``: PEFT 0.21 also puts its per-expert LoRA (``ParamWrapper``) on the fused
    expert tensors and the router of a mixture-of-experts layer, which slurmft neither shards by expert nor
    merges; here those stay frozen and the attention (and shared-expert) layers train.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    modules = dict(model.named_modules())
    linear = [n for n, m in modules.items() if isinstance(m, torch.nn.Linear) and m is not head]
    # PEFT 0.21 reads a target name that is also the name of a fused expert tensor (``down_proj``) as that tensor
    fused = {p for m in modules.values() for p, t in m.named_parameters(recurse=False) if t.dim() >= 3}
    names = []
    for leaf in sorted({n.rsplit(".", 1)[-1] for n in linear}):
        matches = [n for n in modules if _matches(n, leaf)]
        whole = leaf not in fused and all(n in linear for n in matches)
        names += [leaf] if whole else sorted(n for n in matches if n in linear)
    return names


def expert_remapped(config: Any, model: torch.nn.Module) -> set[str]:
    """The target names PEFT would move onto a mixture-of-experts model's fused expert tensors.

    PEFT 0.21 rewrites the targets of an MoE model whose layout transformers 5 changed (Mixtral, the
    Qwen2-MoE family: ``gate_proj``/``up_proj``/``down_proj``/``w1``-``w3``/``gate`` become its per-expert
    ``ParamWrapper`` LoRA on ``gate_up_proj``/``down_proj``), even for a shared expert's linear layer of the
    same name. Found by running PEFT's own rewrite on a copy of the config.
    """
    import copy

    try:
        from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers
    except ImportError:
        return set()
    if isinstance(config.target_modules, str):
        return set()
    probe = copy.deepcopy(config)
    convert_peft_config_for_transformers(probe, model=model, conversions=None)
    return set(config.target_modules) - set(probe.target_modules or [])


def peft_config(lora: LoraConfig, model: torch.nn.Module) -> Any:
    """PEFT's ``LoraConfig`` for this section (CAUSAL_LM; our init, so PEFT's own is switched off)."""
    from peft import LoraConfig as PeftLoraConfig

    targets = linear_targets(unwrap(model)) if lora.target_modules == ALL_LINEAR else list(lora.target_modules)
    return PeftLoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets,
                          modules_to_save=list(lora.modules_to_save) or None, task_type="CAUSAL_LM",
                          init_lora_weights=True, bias="none", use_rslora=lora.use_rslora)


def add_adapters(model: torch.nn.Module, lora: LoraConfig) -> tuple[torch.nn.Module, AdapterSummary]:
    """The meta-device ``model`` wrapped by PEFT with LoRA adapters (float32, trainable) on a frozen base.

    Raises :class:`JobSetupError` naming the field when a target does not fit the model.
    """
    problems = target_problems(model, lora)
    if problems:
        raise JobSetupError(f"lora: the adapters do not fit {type(model).__name__}", problems=problems)
    try:
        from peft import get_peft_model
    except ImportError as exc:
        raise JobSetupError(f"lora: needs the peft package ({type(exc).__name__}: {exc}); pip install -e '.[train]' "
                            "(or 'peft>=0.21.2') in the job's Python (cluster.python), or remove the lora section to "
                            "fine-tune every weight") from None
    config = peft_config(lora, model)
    remapped = expert_remapped(config, model)
    if remapped and lora.target_modules != ALL_LINEAR:
        raise JobSetupError(f"lora: the adapters do not fit {type(model).__name__}", problems=[
            f"lora.target_modules: {name!r} names the fused expert tensors of this mixture-of-experts model for "
            "PEFT (it maps the name onto them); LoRA on fused expert tensors is not supported. Adapt the attention "
            f"layers instead: all-linear, or some of {', '.join(n for n in linear_targets(model) if n not in remapped)}"
            for name in sorted(remapped)])
    if remapped:  # all-linear: the experts' names stay frozen (they are fused tensors to PEFT)
        config.target_modules = sorted(set(config.target_modules) - remapped)
        log.info("lora: all-linear in a mixture-of-experts model adapts %s; the experts, the router and the layers "
                 "named like them (%s) stay frozen", ", ".join(config.target_modules), ", ".join(sorted(remapped)))
    try:
        wrapped = get_peft_model(model, config, low_cpu_mem_usage=True)
    except ValueError as exc:
        raise JobSetupError(f"lora: PEFT refused the adapters: {exc}") from None
    for name, param in wrapped.named_parameters():
        if param.requires_grad and is_adapter_name(strip_wrappers(name)) and ".modules_to_save." not in name:
            _init_kind(strip_wrappers(name))  # refused now, before anything is loaded, if not initialised like PEFT
    for param in wrapped.parameters():
        if param.requires_grad and param.dtype != torch.float32:
            param.data = param.data.float()  # meta: no copy; adapters and modules_to_save train in fp32
    adapted = sorted({n.rsplit(".", 1)[-1] for n, m in wrapped.named_modules()  # linear and embedding layers
                      if any(True for d in ("lora_A", "lora_embedding_A") if hasattr(m, d)
                             for _ in getattr(m, d).parameters())})
    trainable = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    total = sum(p.numel() for p in wrapped.parameters())
    summary = AdapterSummary(lora.r, lora.alpha, lora.dropout, lora.use_rslora, adapted, list(lora.modules_to_save),
                             trainable, total)
    return wrapped, summary


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a PEFT wrapper (the model itself when there is none)."""
    get = getattr(type(model), "get_base_model", None)
    return model.get_base_model() if get is not None else model


def _seed_of(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63


#: PEFT 0.21's default init (``init_lora_weights=True``) per adapter tensor, by the name segment that holds it:
#: a linear layer's ``lora_A.<adapter>.weight`` [r, in] and ``lora_B.<adapter>.weight`` [out, r], an embedding's
#: ``lora_embedding_A.<adapter>`` [r, vocab] and ``lora_embedding_B.<adapter>`` [dim, r].
INITS = {"lora_A": "kaiming_uniform", "lora_B": "zeros", "lora_embedding_A": "zeros", "lora_embedding_B": "normal"}


def _init_kind(name: str) -> str:
    parts = name.split(".")
    kinds = [INITS[p] for p in parts if p in INITS]
    linear = bool(kinds) and parts[-1] == "weight" and any(p in ("lora_A", "lora_B") for p in parts)
    embedding = bool(kinds) and any(p in ("lora_embedding_A", "lora_embedding_B") for p in parts)
    if len(kinds) != 1 or not (linear or embedding):
        raise JobSetupError(f"lora: adapter tensor {name!r} is not one slurmft initialises as PEFT does (a linear "
                            "layer's lora_A/lora_B weight, an embedding's lora_embedding_A/B); adapt linear and "
                            "embedding layers only")
    return kinds[0]


def initial_value(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The whole initial value of adapter tensor ``name`` (checkpoint name): PEFT's default init, seeded
    (:data:`INITS`; JobSetupError for a tensor PEFT would initialise otherwise)."""
    kind = _init_kind(name)
    if kind == "zeros":
        return torch.zeros(shape, dtype=torch.float32)
    generator = torch.Generator().manual_seed(_seed_of(seed, name))
    if kind == "normal":  # nn.init.normal_: N(0, 1)
        return torch.empty(shape, dtype=torch.float32).normal_(0.0, 1.0, generator=generator)
    fan_in = shape[1] if len(shape) > 1 else shape[0]
    bound = 1.0 / math.sqrt(fan_in)  # kaiming_uniform_(a=sqrt(5)): gain sqrt(1/3) x sqrt(3 / fan_in)
    return torch.empty(shape, dtype=torch.float32).uniform_(-bound, bound, generator=generator)


@torch.no_grad()
def init_adapters(model: torch.nn.Module, seed: int) -> int:
    """Fill every LoRA tensor (DTensor shard or plain tensor) with its part of :func:`initial_value`.

    Returns how many tensors were set. ``modules_to_save`` copies are not touched: they are read from
    the base weights (slurmft/job/weights.py).
    """
    from slurmft.job.weights import local_part

    count = 0
    for full_name, param in model.named_parameters():
        name = strip_wrappers(full_name)
        if not is_adapter_name(name) or ".modules_to_save." in f".{name}.":
            continue
        value = initial_value(name, tuple(param.shape), seed)
        target, region = local_part(param)
        if region is not None:
            value = value[tuple(slice(a, b) for a, b in region)]
        target.copy_(value.to(target.dtype))
        count += 1
    return count


@torch.no_grad()
def copy_saved_modules(model: torch.nn.Module) -> int:
    """Start every ``modules_to_save`` copy from the base weights it copies (local shards, same placements).

    Returns how many tensors were copied.
    """
    from slurmft.job.weights import local_part

    count = 0
    for module in model.modules():
        original, copies = getattr(module, "original_module", None), getattr(module, "modules_to_save", None)
        if original is None or not isinstance(copies, torch.nn.ModuleDict):
            continue
        sources = dict(original.named_parameters())
        for copy in copies.values():
            for name, param in copy.named_parameters():
                target, _ = local_part(param)
                target.copy_(local_part(sources[name])[0].to(target.dtype))
                count += 1
    return count


@contextlib.contextmanager
def no_reference_adapter(model: Any, method: str) -> Iterator[None]:
    """While TRL's ``DPOTrainer``/``GRPOTrainer.__init__`` runs on a PEFT model (``method``: dpo, grpo): its "ref"
    adapter copy is not made.

    TRL (1.16, both trainers, the GRPO one when ``beta > 0``) adds an adapter named "ref" and copies the trained one
    into it (``model.get_parameter`` of each ``.ref.`` name). On an FSDP2-sharded model that adapter would be
    unsharded plain tensors, and for a fresh adapter (B = 0) it only reproduces the base. Without it TRL computes
    the reference with the adapters disabled (``use_adapter(model, None)``): the frozen base. The two bound methods
    are restored after.
    """
    if not hasattr(model, "peft_config"):
        yield
        return

    def skip_ref(adapter_name: str, *args: Any, **kwargs: Any) -> Any:
        if adapter_name != "ref":
            return type(model).add_adapter(model, adapter_name, *args, **kwargs)
        return None

    def same_parameter(target: str) -> Any:
        return type(model).get_parameter(model, target.replace(".ref.", ".default."))

    model.add_adapter, model.get_parameter = skip_ref, same_parameter
    try:
        yield
    finally:
        del model.add_adapter, model.get_parameter
    if "ref" in model.peft_config:
        raise JobSetupError(f"{method}: TRL added a reference adapter to the sharded model; this TRL is not supported")
