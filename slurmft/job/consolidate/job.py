"""The consolidation job: a run's checkpoint becomes a Hugging Face model directory, read top to bottom.

:func:`consolidate_run` is the whole job, in the order it happens: the run's config -> which checkpoint
(checkpoint.py) -> the plan: what is written, where from, in which dtype and files (plan.py; lora.py and
merge.py for a LoRA checkpoint) -> a LoRA run's adapter directory (lora.py) -> the model directory (shards.py,
model_files.py), each filled beside its place and put there once complete (output_dir.py) -> the summary.

Why plan everything first: a consolidation that fails halfway has written gigabytes for nothing and, worse,
could leave a half-written ``model/`` that looks finished. So every check that can fail (a torn checkpoint,
keys or shapes that do not match the architecture, a missing tokenizer, a base model other than the one the
adapters trained on, a full disk) runs before the first byte is written, and the writing itself only streams
what was planned, in memory for about the largest tensor (read_dcp.py says why, and what was measured).

The job's stdout is its log file: its progress lines go there (``[slurmft.job.consolidate] ...``, from every
module of the package: :func:`log_to_stdout`), and the summary is returned (``python -m slurmft.job.consolidate``
prints it as JSON).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurmft.config import RunConfig
from slurmft.config_loading import read_run_config
from slurmft.errors import CheckpointError
from slurmft.job.consolidate.checkpoint import resolve_checkpoint
from slurmft.job.consolidate.lora import LoraLayout, lora_layout, lora_of, write_adapter
from slurmft.job.consolidate.merge import MergedSource, plan_merged_model
from slurmft.job.consolidate.model_files import (
    config_for_export,
    tokenizer_for_export,
    verify_tokenizer,
    write_model_config,
    write_tokenizer,
)
from slurmft.job.consolidate.output_dir import new_directory
from slurmft.job.consolidate.plan import (
    ModelLayout,
    ShardPlan,
    TensorPlan,
    model_layout,
    output_dtype,
    plan_export,
    plan_shards,
    plan_tensors,
)
from slurmft.job.consolidate.read_dcp import CachedMetadataReader, TensorSource, open_model_checkpoint
from slurmft.job.consolidate.shards import verify_output, write_index, write_shard
from slurmft.job.dtypes import DTYPES
from slurmft.rundir import ADAPTER_CONFIG, ADAPTER_WEIGHTS, RunPaths
from slurmft.units import decimal_bytes, parse_size, peak_rss_bytes

log = logging.getLogger(__name__)


@dataclass
class ModelOutput:
    """The model directory: its place, the dtype, the tensors in their files, where they are read from, the config."""

    out_dir: Path
    dtype_name: str
    tensors: list[TensorPlan]
    shards: list[ShardPlan]
    source: TensorSource
    config: Any  # written as config.json
    config_source: str
    architecture: str

    @property
    def nbytes(self) -> int:
        return sum(s.file_size for s in self.shards)

    def describe(self) -> str:
        """``147 tensors, 170,000,000 parameters, 341.00 MB in 1 file(s)``."""
        return (f"{len(self.tensors)} tensors, {sum(t.numel for t in self.tensors):,} parameters, "
                f"{decimal_bytes(self.nbytes)} in {len(self.shards)} file(s)")


@dataclass
class AdapterOutput:
    """A LoRA run's adapter directory: its place and the adapter read off the checkpoint."""

    out_dir: Path
    lora: LoraLayout

    @property
    def nbytes(self) -> int:
        return self.lora.file.file_size


@dataclass
class Export:
    """What one consolidation writes, and where from, decided (and checked) before the first byte is written."""

    ckpt: Path
    reader: CachedMetadataReader
    tokenizer: str  # where the tokenizer is copied from (model_files.tokenizer_for_export)
    model: ModelOutput | None  # None: a LoRA run with consolidate.merge: false
    adapter: AdapterOutput | None  # None: a full fine-tune

    @property
    def output(self) -> Path:
        """The directory that is the job's result: the model's, else (no merge) the adapter's."""
        return (self.model or self.adapter).out_dir  # type: ignore[union-attr]  # one of them always is

    @property
    def total_bytes(self) -> int:
        return sum(part.nbytes for part in (self.model, self.adapter) if part is not None)


def consolidate_run(
    run_dir: str, checkpoint: str | None = None, out: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Consolidate a run's newest complete checkpoint (or ``checkpoint``) into a Hugging Face model
    directory at ``<run_dir>/model`` (or ``out``); returns a summary of what was written.

    A LoRA checkpoint (its COMPLETE marker has ``lora``) becomes ``<run_dir>/adapter`` (``<out>-adapter``
    with ``out``) and, unless ``consolidate.merge`` is false, the merged model at ``<run_dir>/model``.
    ``progress(done_bytes, total_bytes)`` is called as tensors are written (a progress bar in a terminal).
    """
    started = time.monotonic()
    log_to_stdout()
    paths = RunPaths.of(run_dir)
    cfg = read_run_config(paths.config)
    ckpt = resolve_checkpoint(paths, checkpoint)
    export = plan_run(cfg, paths, ckpt, out)  # every check that can fail, before the first byte is written
    advance = _bytes_written(progress, export.total_bytes)
    try:
        if export.adapter is not None:
            write_adapter_dir(export, export.adapter, cfg, advance)
        if export.model is not None:
            write_model_dir(export, export.model, cfg, advance)
    finally:
        if export.model is not None:
            export.model.source.close()
    return summarize(export, started)


def plan_run(cfg: RunConfig, paths: RunPaths, ckpt: Path, out: str | None) -> Export:
    """What consolidating ``ckpt`` writes (into ``out``, else the run's ``model/``) and where from."""
    out_dir = Path(out).expanduser().resolve() if out else paths.model
    if out_dir.exists() and not out_dir.is_dir():
        raise CheckpointError(f"output {out_dir} exists and is not a directory")
    lora = lora_of(ckpt)
    # `slurmft consolidate RUN_DIR` (job or --here) passes the run's own model/ as out: its adapter is the run's
    # adapter/ (status, serve and eval read it there), not model-adapter/ beside it
    default = out_dir == paths.model.expanduser().resolve()
    adapter_dir = paths.adapter if default else out_dir.with_name(out_dir.name + "-adapter")
    max_shard_bytes = parse_size(cfg.consolidate.max_shard_size)
    reader = open_model_checkpoint(ckpt)
    config, config_source = config_for_export(cfg, ckpt)
    layout = model_layout(config, cfg.model.trust_remote_code)
    adapter = None if lora is None else plan_adapter(cfg, ckpt, reader, config, lora, adapter_dir)
    model = plan_model_dir(cfg, ckpt, out_dir, reader, layout, adapter, max_shard_bytes, config, config_source)
    export = Export(ckpt, reader, tokenizer_for_export(cfg, ckpt), model, adapter)
    if model is not None:
        log.info("%s; config from %s, tokenizer from %s", model.describe(), config_source, export.tokenizer)
    return export


def plan_adapter(
    cfg: RunConfig, ckpt: Path, reader: CachedMetadataReader, config: Any, lora: dict[str, Any], adapter_dir: Path
) -> AdapterOutput:
    """A LoRA checkpoint's adapter, matched onto PEFT's model of the marker's ``lora`` entry."""
    adapter = AdapterOutput(adapter_dir, lora_layout(config, cfg, lora, reader.read_metadata(), ckpt))
    to_save = ", modules_to_save " + ", ".join(lora["modules_to_save"]) if lora.get("modules_to_save") else ""
    log.info("LoRA checkpoint %s (r=%s, alpha=%s, %s%s) -> adapter %s: %d tensors, %s", ckpt, lora["r"],
             lora["alpha"], ", ".join(lora["target_modules"]), to_save, adapter_dir, len(adapter.lora.adapter),
             decimal_bytes(adapter.nbytes))
    return adapter


def plan_model_dir(
    cfg: RunConfig, ckpt: Path, out_dir: Path, reader: CachedMetadataReader, layout: ModelLayout,
    adapter: AdapterOutput | None, max_shard_bytes: int, config: Any, config_source: str,
) -> ModelOutput | None:
    """The model directory: a full fine-tune's model, or a LoRA run's merged model (none with consolidate.merge:
    false)."""
    if adapter is None:
        dtype_name, tensors, source = plan_model(cfg, ckpt, out_dir, reader, layout)
    elif cfg.consolidate.merge:
        dtype_name, tensors, source = plan_merged_model(cfg, ckpt, out_dir, reader, layout, adapter.lora)
    else:
        log.info("consolidate.merge is false: only the adapter is written, no merged model in %s", out_dir)
        return None
    return ModelOutput(out_dir, dtype_name, tensors, plan_shards(tensors, max_shard_bytes), source, config,
                       config_source, layout.architecture)


def plan_model(
    cfg: RunConfig, ckpt: Path, out_dir: Path, reader: CachedMetadataReader, layout: ModelLayout
) -> tuple[str, list[TensorPlan], TensorSource]:
    """A full fine-tune's model: every checkpoint tensor matched onto the model, in ``consolidate.dtype``."""
    dtype_name = output_dtype(cfg, ckpt)
    log.info("checkpoint %s -> %s (%s, shards <= %s)", ckpt, out_dir, dtype_name, cfg.consolidate.max_shard_size)
    tensors = plan_export(plan_tensors(reader.read_metadata(), layout.expected, layout.aliases, DTYPES[dtype_name]),
                          layout.model)
    return dtype_name, tensors, TensorSource(reader, tensors, layout.model)


def write_adapter_dir(export: Export, adapter: AdapterOutput, cfg: RunConfig, advance: Callable[[int], None]) -> None:
    """The adapter directory, put in place once complete (the disk checked for the model too, if it goes beside)."""
    t0 = time.monotonic()
    model = export.model
    model_bytes = model.nbytes if model is not None and model.out_dir.parent == adapter.out_dir.parent else 0
    with new_directory(adapter.out_dir, adapter.nbytes + model_bytes) as tmp:
        write_adapter(export.reader, adapter.lora, tmp, export.tokenizer, cfg, advance)
    log.info("wrote %s: %s, %s (%s) and the tokenizer in %.1f s", adapter.out_dir, ADAPTER_CONFIG, ADAPTER_WEIGHTS,
             decimal_bytes(adapter.nbytes), time.monotonic() - t0)


def write_model_dir(export: Export, model: ModelOutput, cfg: RunConfig, advance: Callable[[int], None]) -> None:
    """The model directory, put in place once complete (and, for a merge, once every update went in)."""
    with new_directory(model.out_dir, model.nbytes) as tmp:
        write_model(tmp, export, model, cfg, advance)
        if isinstance(model.source, MergedSource):
            model.source.check_all_applied()  # before the directory is put in place


def write_model(
    directory: Path, export: Export, model: ModelOutput, cfg: RunConfig, progress: Callable[[int], None] | None = None,
) -> None:
    """Fill ``directory`` with the model as save_pretrained lays it out: config, tokenizer, the shards
    (tensors streamed from the model's source), the index last; then re-read and check what was written."""
    write_model_config(model.config, directory, model.dtype_name, model.architecture, [export.ckpt, model.config_source])
    tokenizer_files = write_tokenizer(export.tokenizer, directory, cfg)
    tensors = [t for s in model.shards for t in s.tensors]
    read_budget = max(t.source_nbytes for t in tensors)
    for shard in model.shards:
        t0 = time.monotonic()
        write_shard(model.source, shard, directory / shard.filename, read_budget, progress)
        log.info("wrote %s: %d tensors, %s in %.1f s", shard.filename, len(shard.tensors),
                 decimal_bytes(shard.file_size), time.monotonic() - t0)
    write_index(directory, model.shards)
    verify_output(directory, model.shards, {t.name: t.shape for t in tensors})
    verify_tokenizer(directory, cfg, tokenizer_files)


def summarize(export: Export, started: float) -> dict[str, Any]:
    """What was written (the job's result, printed as JSON by hand), and the line that says it."""
    model, adapter = export.model, export.adapter
    tensors = model.tensors if model is not None else []
    summary: dict[str, Any] = {
        "output": str(export.output),
        "model": str(model.out_dir) if model is not None else None,
        "checkpoint": str(export.ckpt),
        "dtype": model.dtype_name if model is not None else None,
        "files": sorted(os.listdir(model.out_dir)) if model is not None else [],
        "shards": [s.filename for s in model.shards] if model is not None else [],
        "total_bytes": export.total_bytes,
        "tensors": len(tensors),
        "parameters": sum(t.numel for t in tensors),
    }
    if adapter is not None:
        summary["adapter"] = {
            "output": str(adapter.out_dir), "files": sorted(os.listdir(adapter.out_dir)),
            "tensors": len(adapter.lora.adapter), "parameters": sum(t.numel for t in adapter.lora.adapter),
            "bytes": adapter.nbytes, "merged_weights": len(adapter.lora.deltas) if model is not None else 0,
        }
        if model is None:
            summary["parameters"] = summary["adapter"]["parameters"]
    summary["seconds"] = round(time.monotonic() - started, 2)
    summary["peak_rss_bytes"] = peak_rss_bytes()
    wrote = [f"adapter {adapter.out_dir} ({decimal_bytes(adapter.nbytes)})"] if adapter is not None else []
    if model is not None:
        wrote.append(f"{model.out_dir} ({decimal_bytes(model.nbytes)}, {summary['parameters']:,} parameters)")
    log.info("done: %s in %s s, peak RSS %s", ", ".join(wrote), summary["seconds"],
             decimal_bytes(summary["peak_rss_bytes"]))
    return summary


def _bytes_written(progress: Callable[[int, int], None] | None, total_bytes: int) -> Callable[[int], None]:
    """``advance(nbytes)``, called as tensors are written: ``progress(done_bytes, total_bytes)``."""
    done = 0

    def advance(nbytes: int) -> None:
        nonlocal done
        done += nbytes
        if progress is not None:
            progress(done, total_bytes)

    return advance


class _StdoutLines(logging.Handler):
    """Each record as one line on the stdout of the moment (the job's log file, a terminal, a test's capture)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stdout.write(self.format(record) + "\n")
            sys.stdout.flush()
        except Exception:  # as logging's own handlers: a broken stream never stops the job
            self.handleError(record)


def log_to_stdout() -> None:
    """The consolidation's lines (every module of this package logs under it) go to stdout, prefixed, and
    nowhere else: the job's stdout is its log file, and ``slurmft consolidate --here`` prints them."""
    logger = logging.getLogger(__package__)
    if not any(isinstance(h, _StdoutLines) for h in logger.handlers):
        handler = _StdoutLines()
        handler.setFormatter(logging.Formatter("[slurmft.job.consolidate] %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
