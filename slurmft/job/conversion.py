"""Checkpoint layout <-> model layout, by transformers' own conversion mapping (the one home for it).

What transformers does (5.24): a model class may keep its weights in a different layout from the
checkpoint it loads. Mixture-of-experts layers are the common case: ``MixtralForCausalLM`` has one
fused ``mlp.experts.gate_up_proj`` of shape ``(experts, 2 x intermediate, hidden)`` per layer, while
the checkpoint on disk (and what ``save_pretrained`` writes) keeps one tensor per expert and
projection, ``block_sparse_moe.experts.3.w1.weight``. ``from_pretrained`` converts at load and
``save_pretrained`` converts back, both from data: ``transformers.conversion_mapping.
get_model_conversion_mapping(model)`` lists ``WeightRenaming`` (a key rename) and ``WeightConverter``
(source key patterns -> target key, plus a list of operations such as ``MergeModulelist(dim=0)``
then ``Concatenate(dim=1)``, each with a ``reverse_op``); ``core_model_loading.rename_source_key``
groups checkpoint keys by the model key they feed, and ``revert_weight_conversion`` applies the
reversed list to a state dict. Qwen2/3-MoE, DeepSeek-V2/V3, OLMoE and more share the ``qwen2_moe``
entry; gpt-oss is stored fused already and has none. Why that is not enough for us: those functions
work on whole state dicts, and our loader reads only each rank's slice of each tensor
(slurmft/job/weights.py) while consolidation streams one tensor at a time (slurmft/job/consolidate/).

What we do: use that mapping and its operations unchanged (no table of our own, so every
architecture transformers converts is converted the same way), and choose only *what to read*:

- loading (:func:`plan_loading`): every checkpoint key is grouped as ``from_pretrained`` groups it
  (renamings, then at most one converter); each model tensor gets a :class:`Sources` naming the
  checkpoint keys it is built from, per source pattern, in transformers' order (``dot_natural_key``:
  expert 0, 1, 2...). The header check runs the converter on ``meta`` tensors of the header shapes,
  so a missing expert is a shape mismatch named before anything is read. A rank's ``Shard(0)`` slice
  of a fused expert tensor is a contiguous range of experts when the converter starts with
  ``MergeModulelist(dim=0)`` and only concatenates along later dimensions, so :func:`read_region`
  reads just those experts' tensors and runs the converter on them (each rank of 2 reads half the
  experts); any other converter is read whole and sliced (correct, not bounded).
- export (:func:`export_groups`, :func:`export_tensors`): the model's state dict is grouped by the
  reversed converters, and ``revert_weight_conversion`` runs on one group at a time (one layer's
  fused tensor -> its per-expert tensors), so consolidation still holds about one tensor in memory
  and writes the names ``save_pretrained`` writes.

LoRA (issue 20) builds on the same two entry points: adapters are not in the mapping, so their keys
pass through as renamings of themselves.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

Region = tuple[tuple[int, int], ...]  # (start, stop) per dimension of the full tensor


def model_conversions(model: torch.nn.Module, legacy: bool = True) -> list[Any]:
    """transformers' ``WeightRenaming``/``WeightConverter`` list for ``model`` (as ``from_pretrained`` uses it;
    ``legacy=False`` as ``save_pretrained`` reverses it)."""
    from transformers.conversion_mapping import get_model_conversion_mapping

    return get_model_conversion_mapping(model, add_legacy=legacy)


def _split(conversions: list[Any]) -> tuple[list[Any], list[Any]]:
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    return ([c for c in conversions if isinstance(c, WeightRenaming)],
            [c for c in conversions if isinstance(c, WeightConverter)])


# ----------------------------------------------------------------------------- loading
@dataclass(frozen=True)
class Sources:
    """What one model tensor is read from: one checkpoint key, or a converter's keys per source pattern."""

    keys: tuple[tuple[str, ...], ...]  # per source pattern, in transformers' order (one pattern, one key: a copy)
    converter: Any = None  # a transformers WeightConverter (its own copy), None for a plain (maybe renamed) copy
    group: str = ""  # the converter's first target key: the name transformers expands its outputs from
    expert_rows: bool = False  # a Shard(0) slice is a contiguous range of each pattern's key list

    @property
    def all_keys(self) -> list[str]:
        return [k for keys in self.keys for k in keys]


@dataclass
class LoadingPlan:
    """Model tensor name -> its sources; checkpoint keys no model tensor uses; what does not fit."""

    sources: dict[str, Sources] = field(default_factory=dict)
    unused: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def _expert_rows(converter: Any) -> bool:
    """True when a Shard(0) slice of the converter's output is the same slice of every source list: the
    first operation stacks each list along dim 0 and every later one only concatenates along dim >= 1."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = list(converter.operations)
    return (bool(ops) and type(ops[0]) is MergeModulelist and ops[0].dim == 0
            and all(type(op) is Concatenate and op.dim >= 1 for op in ops[1:]))


def run_converter(sources: Sources, tensors: dict[str, list[torch.Tensor]], model: Any) -> dict[str, torch.Tensor]:
    """The converter's own operations on ``tensors`` (source pattern -> tensors in order): target name -> tensor."""
    converter = copy.deepcopy(sources.converter)
    for pattern, values in tensors.items():
        for value in values:
            converter.add_tensor(sources.group, "", pattern, (lambda v=value: v))
    config = getattr(model, "config", None)
    out = converter.convert(sources.group, model=model, config=config)
    return {name: (value[0] if isinstance(value, list) else value) for name, value in out.items()}


def plan_loading(model: torch.nn.Module, shapes: dict[str, tuple[int, ...]],
                 targets: dict[str, tuple[int, ...]]) -> LoadingPlan:
    """Group the checkpoint's keys (``shapes``: key -> shape from the headers) onto the model's tensors
    (``targets``: name -> shape) as ``from_pretrained`` would, and check every resulting shape."""
    from transformers.core_model_loading import dot_natural_key, rename_source_key

    renamings, converters = _split(model_conversions(model))
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    prefix = getattr(model, "base_model_prefix", None) or None
    plan = LoadingPlan()
    groups: dict[str, tuple[Any, dict[str, list[str]]]] = {}  # group key -> (converter, pattern -> keys)
    for key in sorted(shapes, key=dot_natural_key):
        name, pattern = rename_source_key(key, renamings, converters, prefix, targets)
        if name not in targets and key in targets:  # renamed by mistake, as from_pretrained re-checks
            name, pattern = key, None
        if pattern is None:
            if name in targets:
                plan.sources[name] = Sources(((key,),))
            else:
                plan.unused.append(key)
            continue
        converter, keys = groups.setdefault(name, (by_pattern[pattern], {}))
        keys.setdefault(pattern, []).append(key)
    for group, (converter, keys) in groups.items():
        ordered = tuple(tuple(keys.get(p, ())) for p in converter.source_patterns)
        sources = Sources(ordered, copy.deepcopy(converter), group, _expert_rows(converter))
        if sources.expert_rows and group in targets:
            missing = _missing_experts(converter.source_patterns, ordered, targets[group][0])
            if missing:
                plan.problems += [f"{key}: missing from the checkpoint (it is part of {group})" for key in missing]
                continue
        try:
            fake = {p: [torch.empty(shapes[k], device="meta") for k in ks] for p, ks in zip(
                converter.source_patterns, ordered, strict=True) if ks}
            produced = run_converter(sources, fake, model)
        except Exception as exc:  # noqa: BLE001 - a converter that cannot combine these shapes
            plan.problems.append(f"{group}: transformers' {type(converter).__name__} cannot build it from "
                                 f"{len(sources.all_keys)} checkpoint tensor(s) ({type(exc).__name__}: {exc})")
            continue
        for name, tensor in produced.items():
            if name not in targets:
                plan.unused.extend(sources.all_keys)
                continue
            if tuple(tensor.shape) != tuple(targets[name]):
                plan.problems.append(
                    f"{name}: built from {len(sources.all_keys)} checkpoint tensor(s) "
                    f"({', '.join(p.strip('.') for p in converter.source_patterns)}) with shape "
                    f"{tuple(tensor.shape)} != model shape {tuple(targets[name])}")
                continue
            plan.sources[name] = Sources(ordered, sources.converter, group,
                                         sources.expert_rows and len(produced) == 1)
    return plan


def _missing_experts(patterns: list[str], keys: tuple[tuple[str, ...], ...], experts: int) -> list[str]:
    """The per-expert checkpoint keys a fused tensor of ``experts`` rows needs and the checkpoint lacks,
    named after the keys that are there (``...experts.2.w1.weight``)."""
    missing = []
    for pattern, found in zip(patterns, keys, strict=True):
        if not found:
            missing.append(f"every {pattern.strip('.')}")
            continue
        index = re.compile(re.escape(pattern.strip(".")).replace(r"\*", r"(\d+)"))
        match = index.search(found[0])
        if match is None:
            continue
        have = {int(m.group(1)) for k in found if (m := index.search(k))}
        start, end = match.span(1)
        missing += [found[0][:start] + str(i) + found[0][end:] for i in range(experts) if i not in have]
    return missing


def read_region(sources: Sources, name: str, region: Region | None,
                read: Callable[[str, Region | None], torch.Tensor], model: Any) -> torch.Tensor:
    """``region`` of model tensor ``name`` (all of it for None) built from its checkpoint tensors.

    ``read(key, region)`` reads a region of one checkpoint tensor (None: all of it). A plain copy reads
    its own region; a fused expert tensor whose slice covers experts a..b reads only their tensors.
    """
    if sources.converter is None:
        return read(sources.keys[0][0], region)
    whole_rows = region is not None and sources.expert_rows
    if whole_rows:
        (a, b), rest = region[0], region[1:]
        picked = {p: [read(k, None) for k in ks[a:b]]
                  for p, ks in zip(sources.converter.source_patterns, sources.keys, strict=True) if ks}
        out = run_converter(sources, picked, model)[name]
        return out[(slice(None), *(slice(s, e) for s, e in rest))] if rest else out
    everything = {p: [read(k, None) for k in ks]
                  for p, ks in zip(sources.converter.source_patterns, sources.keys, strict=True) if ks}
    out = run_converter(sources, everything, model)[name]
    return out if region is None else out[tuple(slice(s, e) for s, e in region)].contiguous()


# ----------------------------------------------------------------------------- export
def export_groups(model: torch.nn.Module, names: list[str]) -> list[list[str]]:
    """The model tensor ``names`` grouped as ``save_pretrained`` converts them: a group of model names is
    turned into checkpoint tensors together (usually one name each; a reversed many-to-one converter
    gathers its inputs), in the order given."""
    from transformers.core_model_loading import rename_source_key

    reverse = [c.reverse_transform() for c in model_conversions(model, legacy=False)[::-1]]
    _, converters = _split(reverse)
    groups: dict[str, list[str]] = {}
    for name in names:
        # at most one converter renames it (5.24's apply_converters, which 5.17 lacks, is this call without renamings)
        renamed, pattern = rename_source_key(name, [], converters)
        groups.setdefault(renamed if pattern is not None else "\0" + name, []).append(name)
    return list(groups.values())


def export_tensors(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Model tensors of one :func:`export_groups` group -> the tensors ``save_pretrained`` writes for them,
    by transformers' ``revert_weight_conversion`` (meta tensors give the names and shapes for nothing)."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, dict(tensors))
