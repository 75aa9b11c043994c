"""Trainer callbacks: preemption at a step boundary, metrics, the step log.

The checkpoint callbacks (complete checkpoints, setting unloadable ones aside) are in
slurmft/job/checkpointing/ (complete.py, fallback.py), the FSDP report in slurmft/job/fsdp_report.py.

Every callback method here runs on every rank at the same point of the loop (the Trainer calls
``on_step_end``, ``on_save`` and ``on_log`` everywhere), which is what makes the collectives inside
them safe.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from slurmft.checkpoints import latest_complete, step_of
from slurmft.dpoopts import PREFERENCE_METRICS
from slurmft.grpoopts import GRPO_METRICS, REWARD_METRIC, reward_words
from slurmft.job import preemption
from slurmft.job.distributed import DistContext, any_rank
from slurmft.units import MiB, peak_rss_bytes
from slurmft.watch import run_totals
from slurmft.watch.progress import read_metrics

log = logging.getLogger("slurmft.job")


class StopBeforeFirstStep(Exception):
    """Raised on every rank (after agreeing) when the flag came before this attempt's first step."""


class PreemptionStop(TrainerCallback):
    """The ranks agree (all_reduce MAX) on the flag at step boundaries; if set: save unless needless, stop.

    The signal handlers only set a flag (slurmft/job/preemption.py), so the save is a normal collective
    save at a step boundary on every rank, never a rank-0 save inside a handler. Agreement points:

    - before this attempt's first optimizer step: a flag raised during start-up stops with no save
      (nothing new to save; :class:`StopBeforeFirstStep`);
    - at each step end: save and stop, unless the newest complete checkpoint is at this step already;
    - right after each periodic save: stop without saving again (the flag came during that save).

    Must come after :class:`~slurmft.job.checkpointing.complete.CompleteCheckpoints` in the callback list (its
    ``on_save`` runs first).
    """

    def __init__(self, ctx: DistContext) -> None:
        self.ctx = ctx
        self.stopped_at: int | None = None
        self.saved = False
        self._first_step_checked = False

    def _stop(self, step: int, control: Any, save: bool, why: str) -> None:
        self.stopped_at = step
        self.saved = True  # a checkpoint at this step exists or is being written now
        control.should_save = control.should_save or save
        control.should_training_stop = True
        if self.ctx.is_main:
            log.warning("%s received: stopping at step %d, %s", preemption.received() or "stop signal", step, why)

    def on_step_begin(self, args, state, control, **kwargs):
        if not self._first_step_checked:
            self._first_step_checked = True
            if any_rank(self.ctx, preemption.requested()):
                self.stopped_at = state.global_step
                raise StopBeforeFirstStep(f"stop requested before the first step (at step {state.global_step})")
        return control

    def on_step_end(self, args, state, control, **kwargs):
        if any_rank(self.ctx, preemption.requested()) and self.stopped_at is None:
            latest = latest_complete(Path(args.output_dir))
            if latest is not None and step_of(latest) == state.global_step:
                self._stop(state.global_step, control, False, f"{latest.name} is already complete (no second save)")
            else:
                self._stop(state.global_step, control, True, f"saving checkpoint-{state.global_step}")
        return control

    def on_save(self, args, state, control, **kwargs):
        if self.stopped_at is None and any_rank(self.ctx, preemption.requested()):
            self._stop(state.global_step, control, False, f"checkpoint-{state.global_step} was just saved (no second save)")
        return control


def peak_rss_mib() -> float:
    return peak_rss_bytes() / MiB


class MetricsLog(TrainerCallback):
    """Rank 0 appends one JSON line per logging step: loss (and the ``loss_steps`` it is the mean of), lr, grad
    norm, tokens/s (the tokens trained since the previous line, over the ``interval_s`` seconds since it), peak
    memory; and at the end of the attempt's training loop, one line of ``train_summary.jsonl``: transformers'
    figures for this attempt, and the whole run's (slurmft/watch/run_totals.py), which then replace the plain
    names in the log dict every later callback gets (the step log, TensorBoard, W&B's summary)."""

    def __init__(self, ctx: DistContext, path: Path, info: dict[str, Any], summary: Path) -> None:
        self.ctx = ctx
        self.path = path
        self.summary = summary
        self.info = info
        self._last: tuple[float, int] | None = None
        self._from_step = 0  # the step this attempt started at (the checkpoint's)
        self._logged_step = 0  # the step of this attempt's previous logged loss

    def on_train_begin(self, args, state, control, **kwargs):
        self._last = (time.time(), state.num_input_tokens_seen or 0)
        self._from_step = self._logged_step = state.global_step

    def on_step_end(self, args, state, control, **kwargs):
        # the last step is logged whatever train.logging_steps says (the Trainer logs multiples of it only): the run's
        # final loss is that step's, and status, runs and a sweep's ranking count a run done at max_steps. A save or
        # a stop is logged too: a resume then starts right after a logged step, so every step the run keeps has its
        # loss in metrics.jsonl, in a mean of its own attempt's steps (the run's train_loss, run_totals.py)
        if state.global_step >= state.max_steps or control.should_save or control.should_training_stop:
            control.should_log = True

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "train_loss" in logs:  # transformers' end-of-training figures, of this attempt alone
            if self.ctx.is_main:
                self._end(state, logs)
            return
        logs = logs or {}
        if "loss" not in logs:
            return
        loss_steps, self._logged_step = state.global_step - self._logged_step, state.global_step
        gpu = torch.cuda.max_memory_allocated(self.ctx.device) / 2**20 if self.ctx.on_gpu else 0.0
        peaks = torch.tensor([peak_rss_mib(), gpu], dtype=torch.float64, device=self.ctx.device)
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)  # the worst rank is what sizes a node
        if not self.ctx.is_main:
            return
        now, tokens = time.time(), state.num_input_tokens_seen or 0
        last_t, last_tokens = self._last or (now, tokens)
        self._last = (now, tokens)
        record = {
            "step": state.global_step,
            "time": round(now, 3),
            "epoch": logs.get("epoch"),
            "loss": logs.get("loss"),
            "loss_steps": loss_steps,  # the optimizer steps the loss is the mean of (transformers' divisor)
            "learning_rate": logs.get("learning_rate"),
            "grad_norm": logs.get("grad_norm"),
            "tokens_per_s": round((tokens - last_tokens) / (now - last_t), 2) if now > last_t else None,
            # what tokens_per_s is measured over: a mean over steps weighs each step by it (slurmft/watch/progress.py)
            "interval_s": round(now - last_t, 6),  # 1 ms of rounding was 0.2 % of a 0.3 s step
            "num_input_tokens_seen": tokens,
            "peak_rss_mib": round(float(peaks[0]), 1),
            "peak_gpu_mem_mib": round(float(peaks[1]), 1) if self.ctx.on_gpu else None,
            "world_size": self.ctx.world_size,  # a resume may run on another allocation (the plot marks it)
            **{k: logs[k] for k in PREFERENCE_METRICS if k in logs},  # DPO's own (TRL's names)
            **{k: v for k, v in logs.items() if k in GRPO_METRICS or REWARD_METRIC.match(k)},  # GRPO's (TRL's names)
            **self.info,
        }
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def _end(self, state: Any, logs: dict[str, Any]) -> None:
        """Record this attempt's end-of-training figures and the run's, then relabel ``logs`` (rank 0)."""
        end = {"step": state.global_step, "from_step": self._from_step, "time": round(time.time(), 3),
               **{k: logs[k] for k in run_totals.ATTEMPT_KEYS if k in logs}, **self.info}
        run = run_totals.totals(read_metrics(self.path).records, [*run_totals.read_summaries(self.summary), end])
        with open(self.summary, "a") as f:
            f.write(json.dumps({**end, "run": run.figures()}) + "\n")
        run_totals.relabel(logs, run)
        for gap in run.gaps():
            log.warning("whole-run figures: %s", gap)


def step_line(logs: dict[str, Any], step: int, max_steps: int) -> str:
    """One readable line for a Trainer log dict: ``step 12/36  loss 2.3456  lr 8.00e-04  grad_norm 1.23``."""
    if "loss" in logs:
        parts = [f"step {step}/{max_steps}", f"loss {logs['loss']:.4f}"]
        if logs.get("learning_rate") is not None:
            parts.append(f"lr {logs['learning_rate']:.2e}")
        if logs.get("grad_norm") is not None:
            parts.append(f"grad_norm {float(logs['grad_norm']):.3f}")
        if reward := reward_words(logs):  # GRPO: what the loss does not say
            parts.append(reward)
        if logs.get("epoch") is not None:
            parts.append(f"epoch {logs['epoch']:.2f}")
        return "  ".join(parts)
    words = [f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in logs.items()]
    return f"step {step}/{max_steps}  " + " ".join(words)


class StepLog(TrainerCallback):
    """Global rank 0 logs each Trainer log dict as one line; every other rank stays quiet.

    Replaces transformers' PrinterCallback, which prints the raw dict on every node's *local*
    rank 0, so a two-node log held each step twice (docs/design-notes.md).
    """

    def __init__(self, ctx: DistContext) -> None:
        self.ctx = ctx
        self.resumed_at = 0

    def on_train_begin(self, args, state, control, **kwargs):
        self.resumed_at = state.global_step  # the checkpoint's step once a requeue or resume loaded it; else 0

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.ctx.is_main and logs:
            line = step_line(logs, state.global_step, state.max_steps)
            if any(k.startswith(run_totals.LAST_ATTEMPT) for k in logs):  # relabelled by MetricsLog
                line += (f"  (train_*: the whole run, {logs.get('train_attempts')} attempt(s), train_loss the "
                         f"step-weighted mean of the logged losses; {run_totals.LAST_ATTEMPT}*: this attempt alone, "
                         f"steps {self.resumed_at + 1}-{state.global_step})")
            log.info("%s", line)
