"""Did the trained weights reach the exported model? One check shared by the end-to-end tests.

``assert_export_matches_checkpoint(run_dir, base_model_dir)`` compares ``RUN/model`` (what
consolidation exported) with the newest complete DCP checkpoint of the run, tensor by tensor and bit
for bit, and asserts that the export is not simply the base model. It deliberately re-derives
everything (which checkpoint is newest, the key mapping, the dtype cast) with its own few lines
instead of calling slurmft.job.consolidate, so a bug there cannot hide behind the same bug here.

    from tests.export_check import assert_export_matches_checkpoint
    report = assert_export_matches_checkpoint(run_dir, tiny_model)
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any

import yaml

# consolidate.dtype -> torch dtype name; floating tensors are cast to it, others are stored as they are.
_DTYPE_NAMES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
_WRAPPERS = frozenset({"_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_orig_mod"})  # never in HF names
_STEP = re.compile(r"^checkpoint-(\d+)$")


def newest_complete_checkpoint(run_dir: Path) -> Path:
    """``RUN/checkpoints/checkpoint-<largest step>`` among those with a COMPLETE marker and a DCP model."""
    root = Path(run_dir) / "checkpoints"
    found = []
    for child in root.iterdir() if root.is_dir() else []:
        m = _STEP.match(child.name)
        if m and (child / "COMPLETE").is_file() and (child / "pytorch_model_fsdp_0" / ".metadata").is_file():
            found.append((int(m.group(1)), child))
    assert found, f"no complete checkpoint under {root}: {sorted(p.name for p in root.iterdir())}"
    return max(found)[1]


def load_checkpoint_tensors(checkpoint: Path) -> dict[str, Any]:
    """Every model tensor of ``checkpoint/pytorch_model_fsdp_0`` under its Hugging Face name (one process)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    model_dir = str(Path(checkpoint) / "pytorch_model_fsdp_0")
    metadata = FileSystemReader(model_dir).read_metadata()
    state = {key: torch.empty(tuple(md.size), dtype=md.properties.dtype)
             for key, md in metadata.state_dict_metadata.items()
             if key.startswith("model.") and isinstance(md, TensorStorageMetadata)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=FileSystemReader(model_dir), no_dist=True)
    return {".".join(p for p in key[len("model."):].split(".") if p not in _WRAPPERS): tensor
            for key, tensor in state.items()}


def load_safetensors_dir(directory: Path) -> dict[str, Any]:
    """All tensors of a Hugging Face model directory (sharded with an index, or one model.safetensors)."""
    from safetensors.torch import load_file

    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else [
        "model.safetensors"]
    tensors: dict[str, Any] = {}
    for name in files:
        part = load_file(str(directory / name))
        assert not set(part) & set(tensors), f"{name} repeats {sorted(set(part) & set(tensors))[:4]}"
        tensors.update(part)
    return tensors


def assert_export_matches_checkpoint(run_dir: str | Path, base_model_dir: str | Path,
                                     export_dir: str | Path | None = None) -> dict[str, Any]:
    """Assert that ``export_dir`` (default ``RUN/model``) holds the newest complete checkpoint's weights.

    - every tensor of the export equals the checkpoint's tensor of the same name, bit for bit, after
      casting floating tensors to ``consolidate.dtype`` of ``RUN/config.yaml`` (its dtype must be that);
    - every model tensor of the checkpoint is exported, except ``lm_head.weight`` when the embeddings
      are tied (then it must equal the exported embeddings);
    - at least one exported tensor differs from the base model's (cast the same way): training
      changed something, and that change is what shipped.

    Returns ``{"checkpoint", "tensors", "differ_from_base"}`` for further asserts or messages.
    """
    import torch

    run_dir = Path(run_dir)
    export = Path(export_dir) if export_dir is not None else run_dir / "model"
    config = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    dtype_name = (config.get("consolidate") or {}).get("dtype", "bfloat16")
    dtype = getattr(torch, _DTYPE_NAMES[dtype_name])

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() else t

    checkpoint = newest_complete_checkpoint(run_dir)
    want = load_checkpoint_tensors(checkpoint)
    got = load_safetensors_dir(export)
    tied = bool(json.loads((export / "config.json").read_text()).get("tie_word_embeddings"))

    missing = sorted(set(want) - set(got) - ({"lm_head.weight"} if tied else set()))
    extra = sorted(set(got) - set(want))
    assert not missing and not extra, f"export {export} vs {checkpoint}: missing {missing[:8]}, extra {extra[:8]}"
    if tied and "lm_head.weight" in want:
        assert torch.equal(cast(want["lm_head.weight"]), got["model.embed_tokens.weight"]), "tied head"
    wrong_dtype = sorted(n for n, t in got.items() if t.dtype != cast(want[n]).dtype)
    assert not wrong_dtype, f"not stored as {dtype_name}: {wrong_dtype[:8]}"
    different = sorted(n for n, t in got.items() if not torch.equal(t, cast(want[n])))
    assert not different, f"export {export} differs from {checkpoint.name} in {len(different)} tensors: {different[:8]}"

    base = load_safetensors_dir(Path(base_model_dir))
    changed = [n for n, t in got.items() if n not in base or not torch.equal(t, cast(base[n]))]
    assert changed, f"every exported tensor equals the base model {base_model_dir}: no trained weight reached the export"
    return {"checkpoint": checkpoint, "tensors": len(got), "differ_from_base": len(changed)}


def model_bytes(model_dir: Path) -> dict[str, bytes]:
    """Every tensor of a consolidated model directory as raw bytes (for bitwise comparisons)."""
    import torch
    from safetensors.torch import load_file

    out: dict[str, bytes] = {}
    for shard in sorted(Path(model_dir).glob("model-*.safetensors")):
        for name, tensor in load_file(shard).items():
            out[name] = tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    assert out, f"no model-*.safetensors in {model_dir}"
    return out


def assert_same_model(got: Path, want: Path) -> None:
    """Two consolidated models hold the same tensor names with the same bytes (e.g. a resumed run and an
    uninterrupted one)."""
    a, b = model_bytes(got), model_bytes(want)
    assert sorted(a) == sorted(b)
    differ = [name for name in a if a[name] != b[name]]
    assert not differ, f"{len(differ)} tensors differ from the uninterrupted run, e.g. {differ[:3]}"
