"""W&B in the job: one W&B run across every attempt, each step logged once, and a tracker that never stops training.

What transformers does: with ``report_to: [wandb]`` the Trainer's ``WandbCallback`` calls ``wandb.init``
at train begin (it reads ``WANDB_RUN_ID``/``WANDB_RESUME``/``WANDB_DIR`` from the environment and passes
``name=run_name``), then ``wandb.log(logs)`` at every log, letting W&B number the rows itself.

Why that is not enough across attempts:

- each attempt is a new process, so a new W&B run (fixed by the id and ``resume=allow``:
  :func:`slurmft.trackers.use_one_wandb_run`, shared with the evaluation job);
- W&B numbers rows from its own counter, which restarts at 0 in every offline attempt (it cannot ask
  the server where the run stopped), so a second attempt's rows would be numbered below the first's,
  and W&B's steps only go up (``log(step=s)`` below the current step is dropped: measured in one
  process). We log every row at ``step=global_step``, so the attempts' rows line up in one run;
- a fallback to an older checkpoint (the newest one was damaged) trains some steps again, and W&B
  would be sent them twice (offline, W&B cannot know). We skip every step at or below the last step
  an earlier attempt logged (the last line of ``metrics.jsonl``: ``MetricsLog`` writes each step
  before this callback sends it). Training is deterministic on resume (the tests compare
  the models bitwise), so the skipped steps' values equal the ones W&B already has;
- Slurm's SIGTERM (time limit, ``scontrol requeue``, ``scancel``, preemption with GraceTime) reaches
  every process of the step, wandb's service process ``wandb-core`` included, and it exits at once:
  the next ``wandb.log`` raises ``ConnectionResetError`` (measured, wandb 0.31), which inside the
  Trainer's ``on_log`` would kill rank 0 before the preemption save. Every W&B call here is guarded:
  the first failure is logged once, W&B is torn down, training and the save go on (the rows the service
  had not written and the steps after the SIGTERM are missing from W&B: ``scancel`` at step 21 left
  steps 1..17 on the test cluster; ``metrics.jsonl`` keeps them all). The warning signal
  (USR2) does not stop ``wandb-core`` (measured): a run stopped by it keeps every step in W&B.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from typing import Any

from transformers.integrations import WandbCallback
from transformers.integrations.integration_utils import rewrite_logs

from slurmft.rundir import RunPaths
from slurmft.trackers import record_wandb_run, recorded_wandb_id
from slurmft.trackers import use_one_wandb_run as use_one_wandb_run  # train.py's call, here with the callback
from slurmft.watch import run_totals
from slurmft.watch.progress import read_metrics

log = logging.getLogger("slurmft.job")

#: Trainer log keys that are one value per run (W&B's summary, not a point of the curve): at the end of training the
#: whole run's under transformers' names and the attempt's own under ``last_attempt/`` (``MetricsLog`` relabels them
#: before this callback gets them; slurmft/watch/run_totals.py)
SUMMARY_KEYS = run_totals.SUMMARY_KEYS


def last_logged_step(paths: RunPaths) -> int:
    """The last step an earlier attempt logged (0 before the first)."""
    return max((r["step"] for r in read_metrics(paths.metrics).records), default=0)


class OneWandbRun(WandbCallback):
    """transformers' ``WandbCallback`` (setup, config, model watching and artifacts stay its own) with rows at
    ``step=global_step``, steps an earlier attempt logged skipped, the run recorded in ``tracker.json``,
    and every W&B call guarded (see the module docstring)."""

    def __init__(self, paths: RunPaths, info: dict[str, Any]) -> None:
        super().__init__()
        self.paths = paths
        self.info = info  # job id and restart of this attempt
        self.broken = False
        # Steps already in the W&B run: only when an earlier attempt logged to this very id.
        same = recorded_wandb_id(paths) == os.environ.get("WANDB_RUN_ID")
        self.floor = last_logged_step(paths) if same else 0

    def _guard(self, what: str, call: Callable[[], Any]) -> None:
        if self.broken:
            return
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - a tracker must never stop training
            self.broken = True
            log.warning("W&B: %s failed (%s: %s); no more W&B logging in this attempt, training goes on "
                        "(metrics.jsonl keeps every step)", what, type(exc).__name__, exc)
            with contextlib.suppress(Exception):  # the service is gone already
                self._wandb.teardown()  # or its exit hook raises the same error again at exit

    def setup(self, args: Any, state: Any, model: Any, **kwargs: Any) -> None:
        self._guard("starting the W&B run", lambda: super(OneWandbRun, self).setup(args, state, model, **kwargs))
        self._initialized = True  # a failed start is not retried at every log
        if state.is_world_process_zero and not self.broken and self._wandb.run is not None:
            self._guard("recording the W&B run", self._record)

    def _record(self) -> None:
        run = self._wandb.run
        offline = record_wandb_run(self.paths, run, self.info, first_step=self.floor + 1)
        log.info("W&B run %s (%s), logging from step %d into %s", run.id, "offline" if offline else run.url,
                 self.floor + 1, run.settings.sync_dir)

    def on_log(self, args: Any, state: Any, control: Any, model: Any = None, logs: Any = None, **kwargs: Any) -> None:
        if not self._initialized:
            self.setup(args, state, model)
        step = state.global_step
        if self.broken or not state.is_world_process_zero or not logs or step <= self.floor:
            return

        def send() -> None:
            run = self._wandb.run
            for key in SUMMARY_KEYS & logs.keys():
                run.summary[key] = logs[key]
            curve = rewrite_logs({k: v for k, v in logs.items() if k not in SUMMARY_KEYS})
            run.log({**curve, "train/global_step": step}, step=step)  # same step: merged into that row

        self._guard(f"logging step {step}", send)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._guard("logging the checkpoint", lambda: super(OneWandbRun, self).on_save(args, state, control, **kwargs))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._guard("ending the W&B run", lambda: super(OneWandbRun, self).on_train_end(args, state, control, **kwargs))
        if state.is_world_process_zero and self._wandb.run is not None:
            # Finished here, not by wandb's exit hook: the attempt's records are complete on disk
            # before the batch script requeues the job, whatever way the process then exits.
            self._guard("finishing the W&B run", self._wandb.finish)


def attach(trainer: Any, callback: OneWandbRun | None) -> None:
    """Put ``callback`` in the place of the Trainer's own ``WandbCallback`` (``report_to`` made one)."""
    if callback is None:
        return
    trainer.remove_callback(WandbCallback)
    trainer.add_callback(callback)
