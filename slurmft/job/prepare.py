"""The prepare job: the training data loaded, tokenized, masked and packed once, on CPUs, before any GPU waits.

Without it (``prepare.enabled: false``) the train job prepares the data inside its allocation: rank 0 loads
and converts every source and TRL's ``SFTTrainer`` applies the chat template, tokenizes, builds the
assistant masks and packs, while every other rank waits (past the collective time-out a wait becomes an
NCCL time-out: axolotl#2684, LlamaFactory#9091), and every requeue and resume pays it again.

Here the same two steps run in a job of their own: :func:`slurmft.job.data.load_mixture` (the sources,
converted to ``messages`` and mixed by weight, the chat template checked), then TRL's own
``SFTTrainer._prepare_dataset``, the very function the trainer runs, called on :class:`TrlPreparation`, which
holds the three attributes ``SFTTrainer.__init__`` gives it (the tokenizer, the training chat template,
``completion_only_loss``; tests/job/test_prepare.py checks against TRL's source that these are all it
reads). The result is saved with ``datasets.Dataset.save_to_disk`` into a staging directory, the record
(:mod:`slurmft.prepared`) is written last inside it, and it replaces ``RUN_DIR/prepared/`` by a rename.
The train job loads it with ``load_from_disk`` and passes ``dataset_kwargs={"skip_prepare_dataset": True}``,
so TRL prepares nothing there; a record that no longer matches the config is refused, never reused.

Packing is not TRL's own: TRL packs each 1,000-row batch of each process's shard, so the packs depended on
``num_proc``. TRL prepares the rows unpacked (in parallel) and :mod:`slurmft.job.packing` plans the packs in one
pass over the whole set, so the prepared set is the same whatever the number of CPUs. The train job preparing in
its allocation (``prepare.enabled: false``) runs this same :func:`prepare_rows`, so both train bitwise the same.
Measured with ``bench/prepare_first_step.py``: the numbers are in docs/prepare.md.
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from slurmft import prepared
from slurmft.config import RunConfig
from slurmft.config_loading import read_run_config
from slurmft.errors import JobSetupError, RunDirError, SlurmftError
from slurmft.rundir import PREPARED_RECORD, RunPaths

log = logging.getLogger("slurmft.job")
#: Seconds between two progress lines of a preparation step (tqdm's mininterval, read from TQDM_MININTERVAL).
PROGRESS_EVERY_S = "10"


def num_proc_for(cfg: RunConfig) -> int | None:
    """``data.num_proc``, else the CPUs Slurm gave this job, else None (one process)."""
    if cfg.data.num_proc:
        return cfg.data.num_proc
    cpus = os.environ.get("SLURM_CPUS_PER_TASK", "")
    return int(cpus) if cpus.isdigit() and int(cpus) > 1 else None


def prepare_args(cfg: RunConfig, num_proc: int | None, workdir: Path) -> Any:
    """TRL's SFTConfig with what its dataset preparation reads, as the train job's ``sft_config`` sets it."""
    from trl import SFTConfig

    from slurmft.job.versions import no_trainer_checkpointing

    kwargs: dict[str, Any] = {
        "output_dir": str(workdir), "report_to": "none", "use_cpu": True, "seed": cfg.train.seed,
        "max_length": cfg.data.max_seq_length, "packing": cfg.data.packing,
        "assistant_only_loss": cfg.assistant_masks, "dataset_num_proc": num_proc,
        # TRL's default (gradient_checkpointing=True) made every prepare log warn "`gradient_checkpointing` is
        # deprecated ... Use `activation_checkpointing`", of an option no preparation reads: off, as the train job sets it
        **no_trainer_checkpointing(SFTConfig),
    }
    kwargs.update({k: cfg.train.sft[k] for k in prepared.PREPARE_SFT_KEYS if k in cfg.train.sft})
    try:
        return SFTConfig(**kwargs)
    except (TypeError, ValueError) as exc:
        raise JobSetupError(f"train.sft: TRL rejected the preparation options: {exc}") from None


class TrlPreparation:
    """What ``SFTTrainer._prepare_dataset`` reads from its trainer, set as ``SFTTrainer.__init__`` sets it
    for a text model and the ``messages`` data slurmft builds."""

    def __init__(self, tokenizer: Any, args: Any, sample: dict[str, Any]) -> None:
        from trl.chat_template_utils import get_training_chat_template, has_generation_markers

        self._tokenizer = tokenizer
        if args.eos_token is not None:
            if args.eos_token not in tokenizer.get_vocab():
                raise JobSetupError(f"train.sft.eos_token: {args.eos_token!r} is not in the tokenizer's vocabulary")
            tokenizer.eos_token = args.eos_token
        if args.assistant_only_loss and not has_generation_markers(tokenizer.chat_template):
            self.chat_template = get_training_chat_template(tokenizer)
        else:
            self.chat_template = None
        if args.completion_only_loss is None:
            self.completion_only_loss = "prompt" in sample and "completion" in sample
        else:
            self.completion_only_loss = args.completion_only_loss

    def run(self, dataset: Any, args: Any) -> Any:
        """TRL's preparation of ``dataset`` (convert, tokenize, labels from the masks, truncate, shuffle); packed by
        :func:`slurmft.job.packing.pack` when ``args.packing``: :meth:`rows`, then :func:`finish`."""
        return finish(self.rows(dataset, args), args)

    def rows(self, dataset: Any, args: Any) -> Any:
        """TRL's preparation of ``dataset`` row by row, unpacked and unshuffled: each row depends on its own source row
        only, so contiguous shares of a mixture prepared apart (a prepare array's tasks) and concatenated are these
        rows (slurmft/job/prepare_array.py).

        Packing: TRL's preparation runs with ``packing=False`` and no ``max_length`` (TRL's packing path neither
        truncates nor drops a row before packing: the pack cuts each sequence); TRL's own final shuffle
        (``shuffle_dataset``: ``dataset.shuffle(seed=args.seed)``, its last step) is left to :func:`finish`. A mixture
        holding plain text goes through :meth:`_with_text` instead."""
        from trl import SFTTrainer

        quiet = copy.copy(args)
        quiet.shuffle_dataset = False
        if TEXT in dataset.column_names:
            return self._with_text(dataset, quiet)
        if args.packing:
            quiet.max_length = None
        return SFTTrainer._prepare_dataset(self, dataset, self._tokenizer, quiet, False, None, "train")

    def _with_text(self, dataset: Any, args: Any) -> Any:
        """A mixture holding plain-text documents: each kind through TRL's own preparation, back in the mixture's order.

        TRL decides per data set, from its first row, whether it holds conversations (the chat template) or text
        (language modelling: the tokenizer's specials around the text, EOS appended, labels = every token). So the
        conversations go through it alone, as before (truncated to ``max_length`` when not packing), and the
        documents alone, untruncated; each document longer than ``max_length`` is then cut into consecutive pieces of
        ``max_length`` tokens and a shorter last one (TRL's ``bfd`` would cut it to ``max_length`` and drop the rest),
        and the rows are put back in the mixture's order; TRL's final shuffle (``shuffle_dataset``) comes after."""
        from datasets import concatenate_datasets
        from trl import SFTTrainer

        order = dataset.add_column(ROW, np.arange(len(dataset), dtype=np.int64))
        is_text = np.concatenate([b[TEXT].is_valid().to_numpy(zero_copy_only=False) for b in
                                  dataset.select_columns([TEXT]).with_format("arrow").iter(batch_size=1000)])
        parts = []
        quiet = copy.copy(args)
        quiet.shuffle_dataset = False
        quiet.max_length = None if args.packing else args.max_length
        if not is_text.all():
            chat = order.select(np.flatnonzero(~is_text)).remove_columns([TEXT])
            chat = SFTTrainer._prepare_dataset(self, chat, self._tokenizer, quiet, False, None, "train")
            chat = chat.select_columns([*ROW_COLUMNS, ROW])
            parts.append(chat.add_column(PIECE, np.zeros(len(chat), dtype=np.int64)))
        if is_text.any():
            if self._tokenizer.eos_token is None:
                raise JobSetupError("model.tokenizer: the tokenizer has no EOS token, which plain text needs after each "
                                    "document (the model learns where one ends); set train.sft.eos_token to one of its "
                                    "tokens (e.g. '</s>'), or use a tokenizer that defines one")
            text = order.select(np.flatnonzero(is_text)).remove_columns([MESSAGES])
            lm = copy.copy(quiet)
            lm.max_length, lm.dataset_text_field = None, TEXT
            text = SFTTrainer._prepare_dataset(self, text, self._tokenizer, lm, False, None, "train")
            parts.append(text.select_columns([*ROW_COLUMNS, ROW]).map(
                _pieces, batched=True, fn_kwargs={"size": args.max_length}, num_proc=args.dataset_num_proc,
                desc="Cutting documents longer than max_length into pieces"))
        parts = [part.cast(parts[0].features) for part in parts]
        return concatenate_datasets(parts).sort([ROW, PIECE]).flatten_indices().remove_columns([ROW, PIECE])


def finish(rows: Any, args: Any) -> Any:
    """The prepared rows as the trainer reads them: TRL's shuffle (``shuffle_dataset``), then, when ``args.packing``,
    one packing plan over the whole set (:func:`slurmft.job.packing.pack`) and TRL's shuffle after packing."""
    from slurmft.job import packing

    if args.shuffle_dataset:
        rows = rows.shuffle(seed=args.seed)
    if not args.packing:
        return rows
    packed = packing.pack(rows, args.max_length, args.packing_strategy, args.dataset_num_proc)
    return packed.shuffle(seed=args.seed) if args.shuffle_dataset else packed


def finish_plan(rows: Any, args: Any) -> Any:
    """:func:`finish`'s packed set (``args.packing``) as a :class:`slurmft.job.packing.Plan` over ``rows``, nothing
    gathered: the same plan over the same lengths, its pieces' rows mapped back through TRL's shuffle before packing
    (so they index ``rows`` itself), and TRL's shuffle after packing as the packed rows' order, each shuffle asked of
    datasets itself (:func:`shuffled_order`). Gathered (:func:`slurmft.job.packing.gathered`), row ``i`` is row ``i``
    of :func:`finish`'s set (tests/job/test_prepare_array.py)."""
    from slurmft.job import packing

    lengths = packing.lengths_of(rows)
    before = shuffled_order(len(rows), args.seed) if args.shuffle_dataset else None
    source, start, stop, offsets = packing.plan(lengths if before is None else lengths[before], args.max_length,
                                                args.packing_strategy)
    after = shuffled_order(len(offsets) - 1, args.seed) if args.shuffle_dataset else None
    return packing.Plan(source if before is None else before[source], start, stop, offsets, args.packing_strategy,
                        after)


def shuffled_order(rows: int, seed: int) -> Any:
    """The order ``Dataset.shuffle(seed=seed)`` puts ``rows`` rows in (it depends on the number of rows and the seed
    only), asked of datasets itself on a column of row numbers: the indices TRL's shuffle would map."""
    from datasets import Dataset

    numbers = Dataset.from_dict({"i": np.arange(rows, dtype=np.int64)})
    # read as Arrow: one take through the indices (the numpy format took 22 s for 100k rows, this 0.2 s)
    shuffled = numbers.shuffle(seed=seed, keep_in_memory=True).with_format("arrow")[:]
    return shuffled["i"].to_numpy().astype(np.int64)


#: the columns of a prepared (tokenized, unpacked) row
ROW_COLUMNS = ("input_ids", "labels")
#: where a prepared row came from: the mixture's row, and the piece of it (0 for a conversation)
ROW, PIECE = "slurmft_row", "slurmft_piece"
MESSAGES, TEXT = "messages", "text"


def _pieces(batch: dict[str, list[Any]], size: int) -> dict[str, list[Any]]:
    """Each tokenized document as consecutive pieces of ``size`` tokens (the last one shorter), none dropped."""
    out: dict[str, list[Any]] = {"input_ids": [], "labels": [], ROW: [], PIECE: []}
    for ids, labels, row in zip(batch["input_ids"], batch["labels"], batch[ROW], strict=True):
        for k, start in enumerate(range(0, len(ids), size)):
            out["input_ids"].append(ids[start:start + size])
            out["labels"].append(labels[start:start + size])
            out[ROW].append(row)
            out[PIECE].append(k)
    return out


def dpo_prepare_args(cfg: RunConfig, num_proc: int | None, workdir: Path) -> Any:
    """TRL's DPOConfig with what its dataset preparation reads, as the train job's ``dpo.dpo_config`` sets it."""
    from trl import DPOConfig

    from slurmft.job.versions import no_trainer_checkpointing

    try:
        return DPOConfig(output_dir=str(workdir), report_to="none", use_cpu=True, seed=cfg.train.seed,
                         max_length=cfg.data.max_seq_length, dataset_num_proc=num_proc,
                         **no_trainer_checkpointing(DPOConfig))  # no deprecation warning in the log (prepare_args)
    except (TypeError, ValueError) as exc:
        raise JobSetupError(f"dpo: TRL rejected the preparation options: {exc}") from None


class TrlDpoPreparation:
    """What ``DPOTrainer._prepare_dataset`` reads from its trainer (the tokenizer, for the EOS of string data)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def run(self, dataset: Any, args: Any) -> Any:
        """TRL's DPO preparation of ``dataset`` (prompt/chosen/rejected token ids; prompts that fill max_length
        dropped)."""
        from trl import DPOTrainer

        return DPOTrainer._prepare_dataset(self, dataset, self._tokenizer, args, "train")


def dpo_counts(ds: Any) -> dict[str, Any]:
    """Pairs, and tokens in both sequences of every pair (prompt + chosen, prompt + rejected), before truncation."""
    import pyarrow.compute as pc

    table = ds.with_format("arrow")[:]
    length = {c: pc.list_value_length(table[f"{c}_ids"]) for c in ("prompt", "chosen", "rejected")}
    tokens = int(pc.sum(pc.add(pc.multiply(length["prompt"], 2), pc.add(length["chosen"], length["rejected"])))
                 .as_py() or 0)
    return {"sequences": len(ds), "tokens": tokens, "loss_tokens": None, "fill": None}


def counts(ds: Any, max_length: int) -> dict[str, Any]:
    """Sequences, tokens, tokens in the loss, and how full the packed slots are."""
    import pyarrow.compute as pc

    table = ds.with_format("arrow")[:]
    lengths = pc.list_value_length(table["input_ids"])
    tokens = int(pc.sum(lengths).as_py() or 0)
    loss = None
    if "labels" in table.column_names:
        flat = pc.list_flatten(table["labels"])
        loss = int(pc.sum(pc.not_equal(flat, -100).cast("int64")).as_py() or 0)
    return result_counts(len(ds), tokens, loss, max_length)


def result_counts(sequences: int, tokens: int, loss: int | None, max_length: int) -> dict[str, Any]:
    """The record's counts: sequences, tokens, tokens in the loss, and how full the packed slots are."""
    return {"sequences": sequences, "tokens": tokens, "loss_tokens": loss,
            "fill": round(tokens / (sequences * max_length), 4) if sequences else 0.0}


def prepare_rows(cfg: RunConfig, tokenizer: Any, mixed: Any, num_proc: int | None, workdir: Path,
                 paths: RunPaths) -> Any:
    """The mixed conversations (or preference pairs) as the trainer reads them: TRL's preparation, packed by
    slurmft (``TrlPreparation.run``). The prepare job and the train job preparing in its allocation both call this,
    so they train on the same sequences. ``workdir``: the output_dir of a TRL config that writes nothing there.
    GRPO's prompts stay as they are: TRL's GRPOTrainer renders and tokenizes them at every generation."""
    if cfg.grpo is not None:
        return mixed
    if cfg.dpo is not None:
        args = dpo_prepare_args(cfg, num_proc, workdir)
        trl: TrlPreparation | TrlDpoPreparation = TrlDpoPreparation(tokenizer)
    else:
        args = prepare_args(cfg, num_proc, workdir)
        trl = TrlPreparation(tokenizer, args, mixed[0])
    return trl_said(cfg, paths, lambda: trl.run(mixed, args))


def trl_said(cfg: RunConfig, paths: RunPaths, work: Callable[[], Any]) -> Any:
    """``work()``, TRL's preparation: a row it cannot prepare is the user's data, named without a traceback."""
    try:
        return work()
    except SlurmftError:
        raise
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0]
        fix = (f"then `slurmft prepare {paths.root}` (or `slurmft resume {paths.root}`)" if cfg.prepare.enabled
               else f"then `slurmft resume {paths.root}`")
        raise JobSetupError(f"data: TRL's preparation failed ({type(exc).__name__}: {first}); fix the data or the chat "
                            f"template, {fix}") from None


def _swap_in(staging: Path, target: Path, tag: str) -> None:
    """``staging`` becomes ``target``; an older ``target`` is moved aside first and removed after."""
    old = target.parent / f".prepared.{tag}.old"
    if target.exists():
        os.replace(target, old)
    os.replace(staging, target)
    shutil.rmtree(old, ignore_errors=True)


@dataclass
class Loaded:
    """A preparation's start: the run, its tokenizer and mixture, and the inputs' identity when it began."""

    paths: RunPaths
    cfg: RunConfig
    tokenizer: Any
    mixed: Any
    before: dict[str, Any]
    num_proc: int | None
    t0: float


def load_run(run_dir: str, num_proc: int | None = None, cfg: RunConfig | None = None,
             files: Callable[[RunConfig, dict[str, Any]], list[Path] | None] | None = None) -> Loaded:
    """The config (``RUN_DIR/config.yaml``, or ``cfg``), the tokenizer and the mixed sources, with the log set up
    and the inputs' identity (:func:`slurmft.prepared.expected`, hub commits pinned) taken first. ``files(cfg,
    inputs' identity)``: the files of the one plain-text source to read instead of all of them (a prepare array task's
    share, slurmft/job/prepare_array.py), or None for the whole mixture; ``mixed`` then holds that share's rows."""
    os.environ.setdefault("TQDM_MININTERVAL", PROGRESS_EVERY_S)  # datasets' bars: rows/s and an ETA, now and then
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=logging.INFO, format="[slurmft prepare %(asctime)s] %(message)s", datefmt="%H:%M:%S")
    log.setLevel(logging.INFO)
    logging.getLogger("transformers").propagate = False
    paths = RunPaths.of(run_dir)
    if cfg is None:
        try:
            cfg = read_run_config(paths.config)
        except SlurmftError as exc:
            raise JobSetupError(exc.render()) from None
    paths.root.mkdir(parents=True, exist_ok=True)
    import datasets

    from slurmft.job import data
    from slurmft.job.inputs import check_sft_keys, load_tokenizer, resolve_model_dir, resolve_tokenizer_dir

    datasets.enable_progress_bars()
    t0 = time.time()
    check_sft_keys(cfg)
    num_proc = num_proc or num_proc_for(cfg)
    before = prepared.expected(cfg)  # the inputs as they were when preparation began
    commits = prepared.pin_hub_commits(cfg, before["inputs"], log.warning)  # hub sources: the commit read
    sources = [s.model_copy(update={"revision": c}) if c else s for s, c in zip(cfg.data.datasets, commits,
                                                                                    strict=True)]
    model_dir = resolve_model_dir(cfg.model, with_weights=False)
    tokenizer = load_tokenizer(resolve_tokenizer_dir(cfg.model, model_dir), cfg)
    mixed = data.load_mixture(cfg.data.model_copy(update={"num_proc": num_proc, "datasets": sources}),
                              cfg.train.seed, tokenizer, method=cfg.method.value,
                              files=files(cfg, before) if files else None)
    t_loaded = time.time()
    log.info("loaded %d %s in %.1f s (%.0f rows/s); TRL's preparation next (%s, max_length %d, "
             "num_proc %s)", len(mixed), prepared.row_words(before.get("settings", {})), t_loaded - t0, len(mixed) / max(t_loaded - t0, 1e-9),
             "DPO pairs" if cfg.dpo else "GRPO prompts, not tokenized" if cfg.grpo else "packing" if cfg.data.packing else "no packing", cfg.data.max_seq_length,
             num_proc or 1)
    return Loaded(paths, cfg, tokenizer, mixed, before, num_proc, t0)


def prepare_run(run_dir: str, num_proc: int | None = None, cfg: RunConfig | None = None) -> dict[str, Any]:
    """Prepare the run's data into ``RUN_DIR/prepared/`` (the config: ``RUN_DIR/config.yaml``, or ``cfg`` for a
    run not submitted yet) in this one process; returns the record written there. ``prepare.tasks`` does not
    matter here: the array's tasks (slurmft/job/prepare_array.py) make the same data."""
    run = load_run(run_dir, num_proc, cfg)
    t_loaded = time.time()
    return save_prepared(run, lambda workdir: prepare_rows(run.cfg, run.tokenizer, run.mixed, run.num_proc, workdir,
                                                           run.paths), t_loaded, {})


def save_prepared(run: Loaded, make: Callable[[Path], Any], t_start: float, extra: dict[str, Any],
                  save: Callable[[Any, Path], None] | None = None,
                  count: Callable[[Any], dict[str, Any]] | None = None) -> dict[str, Any]:
    """``make(staging)``'s prepared set saved into a staging directory with its record (``extra`` added), then
    swapped in as ``RUN_DIR/prepared/``; returns the record. ``save(ready, staging)``: how the set's files get there
    (default: ``save_to_disk``; a prepare array's shards are moved there instead, slurmft/job/prepare_array.py);
    the counts are taken from ``ready`` before it is saved (``count(ready)``: by the caller's own means)."""
    paths, cfg, mixed = run.paths, run.cfg, run.mixed
    tag = f"{os.environ.get('SLURM_JOB_ID', 'here')}-{os.getpid()}"
    staging = paths.prepared_staging(tag)
    shutil.rmtree(staging, ignore_errors=True)
    try:
        ready = make(staging)
        t_ready = time.time()
        log.info("TRL prepared %d %s into %d sequences in %.1f s (%.0f rows/s)", len(mixed),
                 prepared.row_words(run.before.get("settings", {})), len(ready), t_ready - t_start, len(mixed) / max(t_ready - t_start, 1e-9))
        result = {"conversations": len(mixed),
                  **(count(ready) if count is not None else dpo_counts(ready) if cfg.dpo is not None
                     else {"sequences": len(ready), "tokens": 0, "loss_tokens": None, "fill": None} if cfg.grpo
                     else counts(ready, cfg.data.max_seq_length))}
        if save is None:
            ready.save_to_disk(str(staging))
        else:
            save(ready, staging)
        result["seconds"] = round(time.time() - run.t0, 1)
        record = {**run.before, "result": result, "num_proc": run.num_proc, "job_id": os.environ.get("SLURM_JOB_ID"),
                  "host": socket.gethostname(), "time": time.time(),
                  "versions": {m: _version(m) for m in ("trl", "datasets", "transformers", "slurmft")}, **extra}
        prepared.write_record(staging / PREPARED_RECORD, record)  # last: its presence means complete
        _swap_in(staging, paths.prepared, tag)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    for left in paths.prepared_leftovers():  # no other preparation of this run is live (submit's check_not_live)
        log.info("removing %s (a preparation's temporary files: this one's shards, or an interrupted one's)", left)
        if left.is_dir():
            shutil.rmtree(left, ignore_errors=True)
        else:
            left.unlink(missing_ok=True)
    log.info("prepared data in %s: %s", paths.prepared, prepared.summary_line(prepared.read_record(paths) or {}))
    return prepared.read_record(paths) or {}


def _version(module: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(module)
    except PackageNotFoundError:
        return None


def load_prepared(paths: RunPaths, cfg: RunConfig) -> Any:
    """The prepared data when its record matches ``cfg``; a JobSetupError with the fix otherwise."""
    try:
        record = prepared.check(paths, cfg)
    except RunDirError as exc:
        raise JobSetupError(exc.render()) from None
    if record is None:
        raise JobSetupError(
            f"prepare.enabled is true but {paths.prepared} holds no complete preparation (did the prepare job "
            f"fail?): prepare it with `slurmft prepare {paths.root}`, then `slurmft resume {paths.root}`")
    ds = read_prepared(paths.prepared, record)
    layout = record.get("layout")
    shards = (f", {len(record['shard_files'])} shards memory-mapped" if layout == prepared.SHARDS_LAYOUT
              else f", packed rows gathered from {len(record['shard_files'])} shards memory-mapped by the plan"
              if layout == prepared.PLAN_LAYOUT else "")
    log.info("data: %d prepared sequences read from %s (prepared by %s%s; TRL prepares nothing here)", len(ds),
             paths.prepared, f"job {record['job_id']}" if record.get("job_id") else record.get("host", "?"), shards)
    return ds


def read_prepared(where: Path, record: dict[str, Any]) -> Any:
    """``prepared/`` (``where``, its record ``record``) as the trainer reads it: the saved set, memory-mapped; or, when a
    prepare array left its shards there (slurmft/job/prepare_array.py), the shards' memory-mapped concatenation
    (``concatenate_datasets`` of ``load_from_disk``: no row copied), read unpacked in the recorded order (``layout:
    shards``; ``select``: an indices mapping in memory, 8 bytes a row, nothing written) or packed by the recorded plan
    (``layout: plan``; :func:`slurmft.job.packing.gathered`: each packed row gathered when it is read, nothing
    written). Every layout gives the same rows as one prepare job's set; an unknown one is refused
    (:func:`slurmft.prepared.check`)."""
    from datasets import concatenate_datasets, load_from_disk

    from slurmft.job import packing

    layout = record.get("layout")
    if layout is None:
        return load_from_disk(str(where))
    rows = concatenate_datasets([load_from_disk(str(where / name)) for name in record["shard_files"]])
    if layout == prepared.PLAN_LAYOUT:
        return packing.gathered(rows, packing.Plan.load(where / record["plan"], record["packing_strategy"]))
    order = record.get("order")
    return rows.select(np.load(where / order)) if order else rows
