"""The train job, per rank, top to bottom: setup -> sharded model -> data -> trainer -> resume -> train -> exit.

:func:`_run` is the job between joining and leaving the process group, one named step a line, in the order every
rank takes them (each step's collectives meet the same step's on the other ranks); the steps follow it in this
file in that order. Every step that can fail because of the user's input (config, model files, tokenizer, data,
SFT options) runs inside :func:`slurmft.job.distributed.guarded` / ``main_first``, so a problem found on any rank
stops every rank with the same :class:`JobSetupError` before a collective can hang.
"""

from __future__ import annotations

import functools
import gc
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurmft import checkpoints
from slurmft.config import RunConfig
from slurmft.config_loading import read_run_config
from slurmft.epochs import plan_steps
from slurmft.errors import JobSetupError, SlurmftError
from slurmft.job import (
    checkpointing,
    cpu_fsdp,
    data,
    distributed,
    dpo,
    dpo_reference_logps,
    elastic,
    grpo,
    loading,
    packing,
    preemption,
    prepare,
    sampler,
    tracking,
    unused_packages,
    versions,
    vllm_rollouts,
)
from slurmft.job.batches import BatchDigest
from slurmft.job.callbacks import MetricsLog, PreemptionStop, StepLog, StopBeforeFirstStep
from slurmft.job.checkpointing import CheckpointManager
from slurmft.job.distributed import DistContext
from slurmft.job.fsdp_report import FsdpReport, local_bytes
from slurmft.job.inputs import (
    base_identity,
    check_sft_keys,
    follow_trained_base,
    load_model_config,
    load_tokenizer,
    resolve_model_dir,
    resolve_tokenizer_dir,
    weight_files,
)
from slurmft.job.rendezvous import JobEnv
from slurmft.precision import resolve as resolve_precision
from slurmft.rundir import RunPaths, atomic_write, planned_max_steps

log = logging.getLogger("slurmft.job")


def train(run_dir: str) -> dict[str, Any]:
    """The train job body on one rank. Returns a summary; raises JobSetupError on bad input."""
    paths = RunPaths.of(run_dir)
    env = JobEnv.from_environ()
    _setup_logging(env.rank)
    cfg = read_config(paths)
    t_start = time.time()

    # --- finished already (e.g. the job was requeued after its last save)?
    max_steps = planned_max_steps(paths, cfg.train.max_steps, cfg.train.epochs)
    latest = checkpoints.latest_complete(paths.checkpoints)
    if latest is not None and max_steps is not None and (checkpoints.step_of(latest) or 0) >= max_steps:
        log.info("%s is at max_steps (%d): nothing to do", latest.name, max_steps)
        return {"status": "completed", "global_step": checkpoints.step_of(latest), "checkpoint": str(latest)}

    ctx = distributed.init(env)
    try:
        return _run(cfg, paths, env, ctx, t_start)
    finally:
        # FSDP state holds the process group: free the trainer and model (``_run``'s frame, plus any
        # reference cycles) before destroying it, not during interpreter shutdown.
        gc.collect()
        vllm_rollouts.close_engines()  # grpo.rollouts: colocate: vLLM leaves the process group itself
        distributed.shutdown()


def _setup_logging(rank: int) -> None:
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(level=level, format=f"[slurmft rank{rank} %(asctime)s] %(message)s", datefmt="%H:%M:%S")
    log.setLevel(level)
    # transformers prints through its own handler; reaching the root handler too would log each line twice.
    logging.getLogger("transformers").propagate = False


def read_config(paths: RunPaths) -> RunConfig:
    """The run config the login side resolved into the run directory (``config.read_run_config``); a missing
    or invalid one is a setup error every rank reports."""
    try:
        return read_run_config(paths.config)
    except SlurmftError as exc:
        raise JobSetupError(exc.render()) from None


def _run(cfg: RunConfig, paths: RunPaths, env: JobEnv, ctx: DistContext, t_start: float) -> dict[str, Any]:
    """Everything between joining and leaving the process group, step by step."""
    _setup(ctx, env)
    checkpointer = CheckpointManager(ctx, paths)
    candidates = checkpointer.resume_candidates()  # newest first; empty: a fresh start
    cfg = _on_trained_base(cfg, candidates)
    inputs: Inputs = distributed.main_first(ctx, "preparing the model files and tokenizer",
                                            lambda: _prepare_inputs(cfg, ctx))
    base = _base_model(cfg, inputs, ctx, candidates)  # LoRA and DPO read the base on every attempt: the same one
    dataset = _dataset(cfg, paths, inputs, ctx)
    args = distributed.guarded(ctx, "building the training options", lambda: training_args(cfg, paths, ctx))
    if packing.gathers_when_read(dataset):  # a prepare array's plan: its one column (a packed row's number) is no model
        args.remove_unused_columns = False  # input, the rows it returns are; the Trainer would drop the column first
    sharded = _sharded_model(cfg, inputs, ctx, candidates)
    reference = _reference_model(cfg, inputs, ctx)
    record = _record(cfg, env, ctx, sharded, reference, base)
    hooks = _callbacks(cfg, paths, env, ctx, checkpointer, sharded, inputs.tokenizer, record)
    optimizer = distributed.guarded(ctx, "choosing the optimizer", lambda: optimizer_cls_and_kwargs(cfg, args))
    new_trainer = Trainers(cfg, paths, ctx, inputs=inputs, dataset=dataset, args=args, optimizer=optimizer,
                           sharded=sharded, reference=reference, hooks=hooks, record=record,
                           checkpointer=checkpointer, resuming=bool(candidates), base=base)
    trainer = new_trainer()
    _warn_packing_attention(cfg, ctx, sharded, trainer)
    if data.has_text(cfg.data):  # plain text: packed documents must not see each other, or the run is refused
        distributed.guarded(ctx, "checking that packed documents stay apart", lambda: _refuse(
            loading.packed_documents_problem(sharded.model, sharded.attn_implementation,
                                             bool(getattr(trainer, "padding_free", False)))))
    max_steps = _max_steps(cfg, paths, ctx, trainer)
    trainer.args.max_steps = max_steps
    if ctx.is_main:
        log.info("resuming from %s" if candidates else "starting from step 0%s",
                 candidates[0].name if candidates else "")
    if distributed.any_rank(ctx, preemption.requested()):  # the flag came during start-up: stop before loading anything more
        step = (checkpoints.step_of(candidates[0]) or 0) if candidates else 0
        return _stopped(paths, env, ctx, step, saved=False, t_start=t_start)
    check = functools.partial(_check_candidate, ctx, cfg, sharded.precision, record.adapters)
    try:  # the newest checkpoint that loads on every rank; older ones when loading fails (slurmft/job/checkpointing/)
        trainer, _ = checkpointer.train(trainer, new_trainer, candidates, check)
    except StopBeforeFirstStep:
        return _stopped(paths, env, ctx, hooks.preempt.stopped_at or 0, saved=False, t_start=t_start)
    return _ended(paths, env, ctx, trainer.state.global_step, hooks.preempt, max_steps, t_start)


def _setup(ctx: DistContext, env: JobEnv) -> None:
    """Rank 0 says where it runs and what it kept out; the libraries quiet; FSDP2 enabled on CPU (gloo)."""
    if ctx.is_main:
        log.info("rank 0 of %d, device %s, backend %s, job %s (restart %d, launcher %s)", ctx.world_size,
                 ctx.device, ctx.backend, env.job_id, env.restart_count, env.launcher)
        if unused_packages.kept_out:
            log.info("not imported, this run does not use them: %s (%s=1 imports them)",
                     ", ".join(unused_packages.kept_out), unused_packages.OPT_OUT)
    _quiet_libraries(ctx)
    if not ctx.on_gpu:
        cpu_fsdp.enable()


def _quiet_libraries(ctx: DistContext) -> None:
    """Progress bars and per-rank chatter make Slurm logs unreadable; rank 0 keeps info logs."""
    import datasets
    import transformers

    datasets.disable_progress_bars()
    if not ctx.is_main:
        transformers.utils.logging.set_verbosity_error()
        datasets.logging.set_verbosity_error()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _on_trained_base(cfg: RunConfig, candidates: list[Path]) -> RunConfig:
    """A resume reads a hub base at the commit the newest checkpoint trained on, not at what its branch is now."""
    if not candidates:
        return cfg
    trained_on = checkpoints.read_marker(candidates[0]).get("base")
    return cfg.model_copy(update={"model": follow_trained_base(cfg.model, trained_on)})


@dataclass
class Inputs:
    """What setup resolved on this rank."""

    model_dir: Path
    config: Any
    tokenizer: Any


def _prepare_inputs(cfg: RunConfig, ctx: DistContext) -> Inputs:
    """Model files, config, tokenizer: all checked.

    Rank 0 (run first by ``main_first``) downloads the weights of a hub id; the other ranks fetch only the
    config files, so a shared HF_HOME gives them rank 0's snapshot, weights included (they then read their
    own slices), and a node-local cache is never filled with the whole checkpoint once per node (rank 0
    then scatters the slices: weights.load_weights).
    """
    check_sft_keys(cfg)
    dpo.check_loss_types(cfg)
    grpo.check_options(cfg)
    model_dir = resolve_model_dir(cfg.model, with_weights=ctx.is_main)
    if ctx.is_main:
        weight_files(model_dir)  # fail on missing weights before anything else waits
    config = load_model_config(model_dir, cfg.model, cfg.data.max_seq_length)
    tokenizer = load_tokenizer(resolve_tokenizer_dir(cfg.model, model_dir), cfg)
    return Inputs(model_dir=model_dir, config=config, tokenizer=tokenizer)


def _base_model(cfg: RunConfig, inputs: Inputs, ctx: DistContext, candidates: list[Path]) -> dict[str, Any] | None:
    """The identity of the base model's files (``inputs.base_identity``), on every rank, for the runs that read the
    base on every attempt: LoRA (the frozen weights under the adapters) and DPO (the reference: a copy, or the
    values computed from it); None for the others (a resumed full fine-tune reads only its checkpoint). A resume
    onto another base than the checkpoint's is refused here, before anything is loaded."""
    if cfg.lora is None and cfg.dpo is None and not grpo.uses_reference_copy(cfg):
        return None
    base = distributed.from_main(ctx, "identifying the base model's files",  # rank 0 sees the weight files
                                 lambda: base_identity(cfg.model, inputs.model_dir))
    if candidates:
        distributed.guarded(ctx, "checking the base model",
                            lambda: checkpointing.check_resume_base(candidates[0], base))
    return base


def _dataset(cfg: RunConfig, paths: RunPaths, inputs: Inputs, ctx: DistContext) -> Any:
    """The training rows, tokenized and packed: read from the prepare job's files, or prepared here by its code."""
    if cfg.prepare.enabled:  # the prepare job tokenized and packed it: every rank reads the same files
        return distributed.guarded(ctx, "reading the prepared data", lambda: prepare.load_prepared(paths, cfg))
    if ctx.is_main:  # prepared here, by the prepare job's own code
        log.info("data: loading and converting here; TRL tokenizes, slurmft packs, before the trainer is built")
    mixed = distributed.main_first(ctx, "loading the data",  # rank 0 first: the others read its dataset caches
                                   lambda: data.load_mixture(cfg.data, cfg.train.seed, inputs.tokenizer,
                                                             method=cfg.method.value))
    # every rank at once: TRL's preparation orders the ranks itself (rank 0 first, a barrier between)
    return distributed.guarded(ctx, "preparing the data",
                               lambda: prepare.prepare_rows(cfg, inputs.tokenizer, mixed, cfg.data.num_proc,
                                                            paths.checkpoints, paths))


def training_args(cfg: RunConfig, paths: RunPaths, ctx: DistContext) -> Any:
    """The run's TRL config: SFTConfig, DPOConfig for a dpo: run (slurmft/job/dpo.py), GRPOConfig for grpo:."""
    if cfg.dpo is not None:
        return dpo.dpo_config(cfg, common_args(cfg, paths, ctx))
    if cfg.grpo is not None:
        return grpo.grpo_config(cfg, common_args(cfg, paths, ctx))
    return sft_config(cfg, paths, ctx)


def sft_config(cfg: RunConfig, paths: RunPaths, ctx: DistContext) -> Any:
    """TRL's SFTConfig from the run config; ``train.sft`` keys pass through."""
    from trl import SFTConfig

    kwargs = common_args(cfg, paths, ctx)
    kwargs.update({
        "max_length": cfg.data.max_seq_length,
        "packing": cfg.data.packing,
        "assistant_only_loss": cfg.data.assistant_only_loss,
        **versions.no_trainer_checkpointing(SFTConfig),  # FSDP-level activation checkpointing is applied at load
    })
    kwargs.update(cfg.train.sft)
    # the data is prepared already (slurmft/job/prepare.py, by the prepare job or in this allocation): TRL's own
    # preparation, packed by slurmft, its labels masked
    kwargs["dataset_kwargs"] = {**(kwargs.get("dataset_kwargs") or {}), "skip_prepare_dataset": True}
    # TRL checks assistant_only_loss against the first row, which holds token ids now, not messages; the assistant
    # mask is in the labels already (-100 elsewhere)
    kwargs["assistant_only_loss"] = False
    try:
        return SFTConfig(**kwargs)
    except (TypeError, ValueError) as exc:
        raise JobSetupError(f"train.sft: TRL rejected the training options: {exc}") from None


def common_args(cfg: RunConfig, paths: RunPaths, ctx: DistContext) -> dict[str, Any]:
    """The Trainer options every method shares (TrainingArguments'), from the run config."""
    t = cfg.train
    kwargs: dict[str, Any] = {
        "output_dir": str(paths.checkpoints),
        "run_name": cfg.name,
        "max_steps": t.max_steps or 1,  # train.epochs: replaced once the packed data is counted (plan_steps)
        "per_device_train_batch_size": t.per_device_batch_size,
        "gradient_accumulation_steps": t.gradient_accumulation_steps,
        "learning_rate": t.learning_rate,
        "lr_scheduler_type": t.lr_scheduler,
        "warmup_steps": float(t.warmup_ratio),  # a float < 1 is a ratio of max_steps
        "weight_decay": t.weight_decay,
        "max_grad_norm": t.max_grad_norm,
        "seed": t.seed,
        "logging_steps": t.logging_steps,
        "report_to": list(t.report_to) or "none",
        "save_strategy": "steps",
        "save_steps": cfg.checkpoint.every_steps,
        "save_total_limit": None,  # rotated after COMPLETE by CompleteCheckpoints
        "save_only_model": False,
        "dataset_num_proc": cfg.data.num_proc,
        # autocast only for the mixed modes; bf16-true parameters are bf16 already (slurmft/precision.py)
        "bf16": resolve_precision(cfg.train.precision, ctx.on_gpu).name == "bf16-mixed",
        "fp16": resolve_precision(cfg.train.precision, ctx.on_gpu).name == "fp16-mixed",
        "use_cpu": not ctx.on_gpu,
        "ddp_timeout": ctx.collective_timeout_s,
        "include_num_input_tokens_seen": "non_padding",
        # Every micro-batch reduce-scatters its gradients into the sharded ones. The Trainer's default
        # (accelerate's no_sync on all but the last micro-batch) makes FSDP2 keep a full, unsharded
        # gradient of every parameter on every rank until the last one: ~280 GB per GPU for 70B.
        "accelerator_config": {"gradient_accumulation_kwargs": {"sync_each_batch": True}},
        "disable_tqdm": True,
        "log_level": "info",
        "log_level_replica": "error",
        "fsdp": True,
        "fsdp_config": {
            "version": 2,
            "state_dict_type": "SHARDED_STATE_DICT",
            "reshard_after_forward": cfg.fsdp.reshard_after_forward,
            "cpu_offload": cfg.fsdp.cpu_offload,
            # The model arrives already wrapped per decoder layer, checkpointed and loaded
            # (slurmft/job/loading.py): accelerate must not wrap or load it a second time.
            "auto_wrap_policy": "NO_WRAP",
            "activation_checkpointing": False,
            "cpu_ram_efficient_loading": False,
        },
    }
    if "tensorboard" in t.report_to:  # one directory for every attempt: TensorBoard shows one run
        os.environ.setdefault("TENSORBOARD_LOGGING_DIR", str(paths.tensorboard))
    if "wandb" in t.report_to:  # one W&B run for every attempt (slurmft/job/tracking.py)
        tracking.use_one_wandb_run(paths, cfg.name)
        kwargs["run_name"] = os.environ["WANDB_NAME"]  # WandbCallback passes it to wandb.init, over WANDB_NAME
    return kwargs


def _sharded_model(cfg: RunConfig, inputs: Inputs, ctx: DistContext, candidates: list[Path]) -> Any:
    """The model to train, sharded by FSDP2 (slurmft/job/loading.py), after the newest checkpoint's kind was checked.

    Resuming a full fine-tune: the weights come from the checkpoint, the base weights are not read; an adapter
    checkpoint holds only the adapters, so the base weights are read as on a fresh start.
    """
    if candidates:  # a full fine-tune's checkpoint cannot fill an adapter model, nor the other way round
        distributed.guarded(ctx, "checking the checkpoint's kind",
                            lambda: checkpointing.check_resume_method(candidates[0], cfg.lora is not None,
                                                                      cfg.method.value))
    t_load = time.time()
    sharded = loading.build_sharded_model(cfg, inputs.config, inputs.model_dir, ctx,
                                          weights=not candidates or cfg.lora is not None)
    mesh = _mesh(sharded)
    if ctx.is_main:
        how = {"sliced": "every rank read its own slice", "scatter": "rank 0 read and scattered",
               "checkpoint": "weights from the checkpoint"}[sharded.load_method]
        log.info("model: %.1fM parameters, %s, FSDP2 mesh %s over %d ranks in %.1fs (%s; rank 0 read %.0f MiB)",
                 sharded.num_params / 1e6, str(sharded.dtype).removeprefix("torch."), tuple(mesh.shape),
                 ctx.world_size, time.time() - t_load, how, sharded.bytes_read / 2**20)
        if sharded.lora is not None:
            lora = sharded.lora
            log.info("LoRA: r=%d, alpha=%g%s, dropout=%g on %s%s; %.2fM of %.1fM parameters train (%.2f%%), the "
                     "base is frozen in %s", lora.r, lora.alpha,
                     f" (rsLoRA: scaling {cfg.lora.scaling:g})" if lora.use_rslora else "", lora.dropout,
                     ", ".join(lora.target_modules),
                     f", full copies of {', '.join(lora.modules_to_save)}" if lora.modules_to_save else "",
                     lora.trainable / 1e6, lora.total / 1e6, 100 * lora.trainable / lora.total,
                     str(sharded.base_dtype).removeprefix("torch."))
    return sharded


def _mesh(sharded: Any) -> Any:
    """The sharded model's device mesh (HSDP: (replicas, shards))."""
    return next(sharded.model.parameters()).device_mesh


def _reference_model(cfg: RunConfig, inputs: Inputs, ctx: DistContext) -> Any:
    """DPO, full fine-tuning: the frozen starting model, built from the model files on every start; None otherwise
    (LoRA-DPO disables the adapters, a precomputed reference keeps only its values: no second copy)."""
    reference = None
    if grpo.uses_reference_copy(cfg):  # the same frozen, sharded starting model as DPO's
        reference = dpo.reference_model(cfg, inputs.config, inputs.model_dir, ctx)
        if ctx.is_main:
            log.info("grpo: reference model (frozen, sharded like the policy) for the KL term, beta %g",
                     cfg.grpo.beta)
    elif dpo.uses_reference_copy(cfg):
        t_ref = time.time()
        reference = dpo.reference_model(cfg, inputs.config, inputs.model_dir, ctx)
        if ctx.is_main:
            log.info("dpo: reference model (frozen, %s, no gradients or optimizer state) sharded like the policy in "
                     "%.1fs; beta %g, loss %s", str(reference.dtype).removeprefix("torch."), time.time() - t_ref,
                     cfg.dpo.beta, "+".join(cfg.dpo.loss_type))
    elif cfg.dpo is not None and ctx.is_main:
        log.info("dpo: the reference is %s; beta %g, loss %s",
                 "precomputed (its log-probabilities computed once, before step 1; no second copy)"
                 if dpo.precomputed(cfg) else "the base model with the adapters disabled (no second copy)",
                 cfg.dpo.beta, "+".join(cfg.dpo.loss_type))
    return reference


@dataclass
class Record:
    """What this attempt writes down beside training: ``info`` in every save and log record, ``marker`` in every
    checkpoint's COMPLETE marker (what a resume, a fallback and the consolidation check against), ``report`` in
    fsdp_report.json."""

    info: dict[str, Any]
    marker: dict[str, Any]
    report: dict[str, Any]
    adapters: dict[str, Any] | None  # LoRA: what the adapters are
    global_batch: int


def _record(cfg: RunConfig, env: JobEnv, ctx: DistContext, sharded: Any, reference: Any,
            base: dict[str, Any] | None) -> Record:
    """This attempt's records (:class:`Record`), from the config and what the sharded model turned out to be."""
    info = {"job_id": env.job_id, "restart": env.restart_count}
    adapters = sharded.lora.marker() if sharded.lora is not None else None  # LoRA: what the adapters are
    t = cfg.train  # what a resume on another allocation keeps (slurmft/plan/elastic.py, slurmft/job/elastic.py)
    global_batch = ctx.world_size * t.per_device_batch_size * t.gradient_accumulation_steps
    marker = {**info, "method": cfg.method.value,  # a dpo run never resumes an SFT checkpoint, nor the reverse
              "precision": sharded.precision,  # consolidate.dtype=auto and resume read it
              "global_batch": global_batch, "per_device_batch_size": t.per_device_batch_size,
              "gradient_accumulation_steps": t.gradient_accumulation_steps, "mesh": list(_mesh(sharded).shape)}
    if adapters is not None:  # an adapter checkpoint: consolidation merges it onto its base
        marker["lora"] = adapters
    if base is not None:  # every later attempt and the consolidation check the base against it
        marker["base"] = base
    report = {"dtype": str(sharded.dtype).removeprefix("torch."), "precision": sharded.precision,
              "reduce_dtype": str(sharded.reduce_dtype).removeprefix("torch."),
              "compute_dtype": str(sharded.compute_dtype).removeprefix("torch."),
              "attn_implementation": sharded.attn_implementation,  # what transformers really set up
              "attn_requested": cfg.model.attn_implementation, "wrap_class": sharded.wrap_class,
              "num_params": sharded.num_params,
              "lora": adapters,
              # DPO: the frozen reference copy's local bytes (0: LoRA-DPO, no copy), what estimate's
              # reference_weights predicts for the largest rank (bench/dpo_memory.py compares them)
              "reference_bytes": (local_bytes(reference.model.parameters()) if reference is not None
                                  else 0 if cfg.dpo is not None or cfg.grpo is not None else None)}
    return Record(info=info, marker=marker, report=report, adapters=adapters, global_batch=global_batch)


@dataclass
class Callbacks:
    """The Trainer's callbacks in their order, and the ones the job reads or hands on by name."""

    ordered: list[Any]
    preempt: PreemptionStop
    batches: BatchDigest
    wandb_run: Any  # tracking.OneWandbRun, or None without W&B


def _callbacks(cfg: RunConfig, paths: RunPaths, env: JobEnv, ctx: DistContext, checkpointer: CheckpointManager,
               sharded: Any, tokenizer: Any, record: Record) -> Callbacks:
    """What watches the loop: the checkpoint saver and set-aside, the preemption stop, metrics, the FSDP report,
    the batches; every rank at once (an asynchronous saver creates its process group here)."""
    preempt = PreemptionStop(ctx)
    saving = checkpointer.callbacks(sharded.model.config, getattr(sharded.model, "generation_config", None),
                                    tokenizer, cfg.checkpoint.keep_last, record.info, record.marker,
                                    lead_time_s=cfg.preemption.lead_time_s if env.launcher == "slurm" else None,
                                    asynchronous=cfg.checkpoint.asynchronous,
                                    max_failed_saves=cfg.checkpoint.max_failed_saves)
    batches = BatchDigest(ctx, paths.batches, record.info)
    ordered = [*saving, preempt,  # saving before preempt: its on_save first
               MetricsLog(ctx, paths.metrics, record.info, paths.train_summary),
               FsdpReport(ctx, paths.fsdp_report, record.report), batches]
    # after MetricsLog: a step is in metrics.jsonl before W&B gets it (what the next attempt skips)
    wandb_run = tracking.OneWandbRun(paths, record.info) if "wandb" in cfg.train.report_to else None
    return Callbacks(ordered=ordered, preempt=preempt, batches=batches, wandb_run=wandb_run)


def optimizer_cls_and_kwargs(cfg: RunConfig, args: Any) -> tuple[type, dict[str, Any]] | None:
    """None for the Trainer's own AdamW; torchao's AdamW with bf16 stochastic rounding when asked for.

    Why offer it: with bf16-true an update smaller than half a bf16 ulp of the weight is lost to
    round-to-nearest; stochastic rounding keeps it in expectation (torchao ``_AdamW``).
    """
    if cfg.train.optimizer == "adamw":
        return None
    try:
        from torchao.optim import _AdamW
    except ImportError as exc:
        raise JobSetupError(
            f"train.optimizer=adamw-stochastic-rounding needs torchao ({type(exc).__name__}: {exc}); "
            "pip install torchao, or set train.optimizer=adamw"
        ) from None
    return _AdamW, {"lr": args.learning_rate, "betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon,
                    "weight_decay": args.weight_decay, "bf16_stochastic_round": True}



@dataclass
class Trainers:
    """Makes the Trainer on the sharded model, called once for the first and once more for each older checkpoint a
    fallback tries (slurmft/job/checkpointing/fallback.py): a fresh optimizer, scheduler and state each time, on the
    same model, data, options and callbacks."""

    cfg: RunConfig
    paths: RunPaths
    ctx: DistContext
    inputs: Inputs
    dataset: Any
    args: Any
    optimizer: tuple[type, dict[str, Any]] | None
    sharded: Any
    reference: Any
    hooks: Callbacks
    record: Record
    checkpointer: CheckpointManager
    resuming: bool
    base: dict[str, Any] | None
    # dpo.reference: precomputed: the values, obtained by the first call (None: the warning signal came first)
    reference_logps: Any = field(default=None, init=False)
    obtained: bool = field(default=False, init=False)

    def __call__(self) -> Any:
        cfg, ctx = self.cfg, self.ctx
        if cfg.grpo is not None:
            trainer = grpo.new_trainer(cfg, self.sharded.model, self.reference.model if self.reference else None,
                                       self.args, self.dataset, self.inputs.tokenizer, self.hooks.ordered,
                                       self.optimizer, self.inputs.model_dir)
        elif cfg.dpo is not None:
            trainer = dpo.new_trainer(self.sharded.model, self.reference.model if self.reference else None, self.args,
                                      self.dataset, self.inputs.tokenizer, self.hooks.ordered, self.optimizer,
                                      precomputed=dpo.precomputed(cfg))
            if dpo.precomputed(cfg):  # read, or computed before step 1 (None: the warning signal came first)
                if not self.obtained:
                    self.reference_logps = dpo_reference_logps.obtain(
                        trainer, cfg, self.paths, ctx, self.resuming, self.base,
                        starting_weights=lambda: loading.read_base_weights(self.sharded, self.inputs.model_dir, ctx))
                    self.obtained = True
                if self.reference_logps is not None:
                    dpo_reference_logps.attach(trainer, self.reference_logps)
        else:
            from trl import SFTTrainer

            trainer = SFTTrainer(model=self.sharded.model, args=self.args, train_dataset=self.dataset,
                                 processing_class=self.inputs.tokenizer, callbacks=self.hooks.ordered,
                                 optimizer_cls_and_kwargs=self.optimizer)
        _one_log_line(trainer, ctx)
        tracking.attach(trainer, self.hooks.wandb_run)
        if cfg.grpo is None:  # GRPO: TRL's own sampler (each prompt num_generations times), prompt rows, not tokens
            self.hooks.batches.watch(trainer)  # what every step trains on (batches.jsonl)
            sampler.use_whole_global_batches(trainer, self.record.global_batch)  # the same sequences on every shape
        elastic.reseed_on_change(trainer, ctx.rank, ctx.world_size, cfg.train.seed)  # before the loads are guarded
        self.checkpointer.attach(trainer)  # saves timed, checkpoint loads agreed by every rank
        return trainer


def _refuse(problem: str | None) -> None:
    if problem:
        raise JobSetupError(problem)


def _one_log_line(trainer: Any, ctx: DistContext) -> None:
    """Per-step logs: one readable line from global rank 0 only (StepLog), not a dict per node."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(StepLog(ctx))


def _warn_packing_attention(cfg: RunConfig, ctx: DistContext, sharded: Any, trainer: Any) -> None:
    """Rank 0 warns when packed sequences meet an attention that cannot keep them apart (loading.py says when)."""
    note = loading.packing_attention_note(sharded.attn_implementation,
                                          bool(getattr(trainer, "padding_free", False)),
                                          cfg.train.per_device_batch_size * cfg.data.max_seq_length, ctx.on_gpu)
    if note and ctx.is_main:
        log.warning("%s", note)


def _max_steps(cfg: RunConfig, paths: RunPaths, ctx: DistContext, trainer: Any) -> int:
    """``train.max_steps``; with ``train.epochs`` the steps the packed data makes, counted at the first start (rank 0
    writes plan.json) and read back from plan.json on every later one."""
    max_steps = planned_max_steps(paths, cfg.train.max_steps, cfg.train.epochs)
    if max_steps is None:  # train.epochs, first start: count the packed data
        plan = plan_steps(cfg, len(trainer.train_dataset), ctx.world_size)
        max_steps = plan["max_steps"]
        if ctx.is_main:
            atomic_write(paths.plan, json.dumps(plan, indent=2) + "\n")
            log.info("train.epochs %g: %d sequences, %d per step -> %d steps per epoch, max_steps %d (%s)",
                     plan["epochs"], plan["sequences"], plan["sequences_per_step"], plan["steps_per_epoch"],
                     plan["max_steps"], paths.plan)
    return max_steps


def _check_candidate(ctx: DistContext, cfg: RunConfig, precision: str, adapters: dict[str, Any] | None,
                     checkpoint: Path) -> None:
    """Before each checkpoint is tried: it was saved in this precision, with these adapters, and its data position
    fits this attempt's global batch (a resume on another number of ranks says how it continues)."""
    t = cfg.train
    distributed.guarded(ctx, "checking the checkpoint's precision",
                        lambda: checkpointing.check_resume_precision(checkpoint, precision))
    distributed.guarded(ctx, "checking the checkpoint's adapters",
                        lambda: checkpointing.check_resume_adapters(checkpoint, adapters))
    change = distributed.guarded(ctx, "checking the checkpoint's data position", lambda: elastic.describe(
        checkpoint, ctx.world_size, t.per_device_batch_size, t.gradient_accumulation_steps))
    if change and ctx.is_main:
        log.info("%s", change)


def _write_requeue_marker(paths: RunPaths, env: JobEnv, step: int, saved: bool) -> Path:
    """``requeue/<job>-<restart>``: the ranks stopped for a signal at ``step`` (the batch script decides)."""
    marker = paths.requeue_marker(env.job_id, env.restart_count)
    atomic_write(marker, json.dumps({"step": step, "job_id": env.job_id, "restart": env.restart_count,
                                     "saved": saved, "signal": preemption.received(),
                                     "signal_t": round(preemption.received_at(), 3), "t": time.time()}) + "\n")
    return marker


def _stopped(paths: RunPaths, env: JobEnv, ctx: DistContext, step: int, saved: bool,
             t_start: float) -> dict[str, Any]:
    """Every rank stopped for a signal: rank 0 leaves the requeue marker; exit 0 for the batch script."""
    distributed.barrier()
    marker = _write_requeue_marker(paths, env, step, saved) if ctx.is_main else None
    if ctx.is_main:
        what = f"saved at step {step}" if saved else f"before the first step (resumable from step {step}, no save)"
        log.warning("stopped for %s: %s; requeue marker %s", preemption.received() or "a signal", what, marker)
    return {"status": "preempted", "global_step": step, "saved": saved, "seconds": round(time.time() - t_start, 1)}


def _ended(paths: RunPaths, env: JobEnv, ctx: DistContext, step: int, preempt: PreemptionStop, max_steps: int,
           t_start: float) -> dict[str, Any]:
    """Training returned at ``step``: stopped for a signal before ``max_steps`` (saved), or complete."""
    if preempt.stopped_at is not None and step < max_steps:
        return _stopped(paths, env, ctx, step, saved=True, t_start=t_start)
    final = checkpoints.latest_complete(paths.checkpoints)
    if ctx.is_main:
        log.info("training complete at step %d; final checkpoint %s", step, final)
    return {"status": "completed", "global_step": step, "checkpoint": str(final) if final else None,
            "seconds": round(time.time() - t_start, 1)}
