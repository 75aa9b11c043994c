"""In-job entry points that submitit pickles: ``run_prepare``, ``run_train`` (every rank), ``run_consolidate``, and
the jobs after it, ``run_serve`` and ``run_eval``.

Importable on the login side (dispatch pickles these functions by reference): nothing heavy is
imported at module level.

Run by hand on each rank, e.g. two CPU ranks on this machine::

    python -m torch.distributed.run --nproc_per_node 2 -m slurmft.job.entrypoint train RUN_DIR

Exit status: 0 when training finished or stopped for preemption (the requeue marker tells the
batch script which), 2 on a bad input (:class:`~slurmft.errors.JobSetupError`, same message on every
rank), anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import os
import sys

from slurmft.job import preemption

EXIT_SETUP_ERROR = 2


#: What each job imports before its work begins (the rest of its imports are its own modules' business): imported by
#: :func:`load_the_stack` with the cyclic garbage collector off.
STACK = {
    "train": ("slurmft.job.train", "datasets", "trl.trainer.sft_trainer"),
    "prepare": ("slurmft.job.prepare", "datasets", "trl"),
    "consolidate": ("slurmft.job.consolidate.job",),
    "serve": ("slurmft.job.serve_check", "slurmft.job.data", "transformers"),
    "eval": ("slurmft.job.evaluate",),
}

_stack_loaded = False  # set by the first load_the_stack of this process


def load_the_stack(run_dir: str, job: str) -> None:
    """Import the job's libraries (:data:`STACK`): the optional packages this job does not use stay out
    (unused_packages), transformers' import structure comes from the cache (import_structure), and the cyclic garbage
    collector is off while they load, after which the objects they made are frozen (``gc.freeze``).

    torch, transformers and TRL create ~700,000 objects that live as long as the process; with the collector on,
    each young collection on the way re-examines the ones made since the last, and the full ones all of them: a
    train rank's imports took 8.0-8.2 CPU-s with it on, 6.6-6.8 with it off (a quiet 2-core machine). Frozen, they are
    left out of every later full collection too (one cost 0.3 s on this heap, ~0 once frozen). What the imports left
    as garbage (~14,000 small objects, ~9 MB) stays: Python's documented pattern (gc.freeze) for a heap that lives
    as long as the process. The collector is on again before the job's work, whatever happened.

    Only the first job body of a process freezes: a later one in the same process (tests/job/run_many.py trains
    several runs in one) would freeze what the earlier run left for the collector, its model among it.
    """
    import gc
    import importlib

    from slurmft.job import import_structure
    from slurmft.job.unused_packages import keep_out

    global _stack_loaded
    first = not _stack_loaded
    was_on = gc.isenabled()
    if first:
        gc.disable()
    try:
        keep_out(run_dir, job)
        import_structure.install()
        for module in STACK[job]:
            importlib.import_module(module)
    finally:
        if first:
            _stack_loaded = True
            gc.freeze()
            if was_on:
                gc.enable()


def _begin(run_dir: str, job: str) -> None:
    """What every job body does first: a local job ends on SIGTERM (``slurmft cancel``), then its stack loads."""
    preemption.end_local_job_on_term()
    load_the_stack(run_dir, job)


def run_train(run_dir: str, signal_name: str = "USR2") -> dict[str, object]:
    """Train job body, run by every rank: FSDP2 supervised fine-tune of the run directory's config.

    Bad input (a :class:`~slurmft.errors.SlurmftError`, agreed on by every rank) is printed without a
    traceback and ends the process with exit status 2; anything else keeps its traceback (our bug).
    """
    # Under Slurm the launcher (slurmft.job.launch) installed these before submitit ran; again here for
    # runs started otherwise (the local executor: warning signal only, SIGTERM still ends the process).
    preemption.install(signal_name, term="SLURM_JOB_ID" in os.environ)
    _begin(run_dir, "train")
    from slurmft.errors import SlurmftError
    from slurmft.job.train import train

    try:
        return train(run_dir)
    except SlurmftError as exc:
        rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
        sys.stderr.write(f"slurmft rank {rank}: setup error: {exc.render()}\n")
        sys.stderr.flush()
        raise SystemExit(EXIT_SETUP_ERROR) from None


def run_prepare(run_dir: str) -> dict[str, object]:
    """Prepare job body (one process, CPUs only): the run's data tokenized and packed into ``RUN_DIR/prepared``.

    Bad input (a row TRL cannot prepare, a missing source) is printed without a traceback, exit status 2.
    """
    _begin(run_dir, "prepare")
    from slurmft.errors import SlurmftError
    from slurmft.job.prepare import prepare_run

    try:
        record = prepare_run(run_dir)
    except SlurmftError as exc:
        sys.stderr.write(f"slurmft prepare: setup error: {exc.render()}\n")
        sys.stderr.flush()
        raise SystemExit(EXIT_SETUP_ERROR) from None
    return dict(record.get("result", {}))


def run_prepare_task(run_dir: str, task: int, tasks: int, group: str) -> dict[str, object]:
    """Prepare array task body (``prepare.tasks``): task ``task`` of array ``group`` tokenizes its share of the mixture
    into its shard; the last task to finish packs them all into ``RUN_DIR/prepared`` (slurmft/job/prepare_array.py).
    Bad input as in :func:`run_prepare`."""
    _begin(run_dir, "prepare")
    from slurmft.errors import SlurmftError
    from slurmft.job.prepare_array import run_task

    try:
        return {k: v for k, v in run_task(run_dir, task, tasks, group).items() if k != "inputs"}
    except SlurmftError as exc:
        sys.stderr.write(f"slurmft prepare: task {task}: setup error: {exc.render()}\n")
        sys.stderr.flush()
        raise SystemExit(EXIT_SETUP_ERROR) from None


def run_prepare_each(run_dirs: list[str]) -> dict[str, object]:
    """A sweep's one prepare job: each distinct prepared set, into the run directory of the first point that reads
    it (the others link to it), one after another; the first that fails ends the job (its error as
    :func:`run_prepare`'s), and the train array, waiting on it, is cancelled."""
    return {run_dir: run_prepare(run_dir) for run_dir in run_dirs}


def run_consolidate(run_dir: str, checkpoint: str | None = None, out: str | None = None) -> dict[str, object]:
    """Consolidation job body (single process): the newest complete checkpoint (or ``checkpoint``) into
    ``RUN_DIR/model`` (or ``out``)."""
    _begin(run_dir, "consolidate")
    from slurmft.job.consolidate.job import consolidate_run
    from slurmft.watch.report import write_report_safely

    summary = consolidate_run(run_dir, checkpoint, out)
    write_report_safely(run_dir)  # report.md + loss.png; a report problem never fails the export
    from slurmft.watch.sweep import refresh_best_safely

    refresh_best_safely(run_dir)  # a sweep's point: SWEEP_DIR/best, now that this point's model exists
    return summary


def _after_model(run_dir: str, kind: str, body: str, *args: object) -> dict[str, object]:
    """A job after consolidation: ``body`` (module:function) on the run; a check that fails (the model does not
    serve, lm-eval failed) is printed without a traceback and ends the job with exit status 2, the model kept."""
    import importlib

    _begin(run_dir, kind)
    from slurmft.errors import SlurmftError
    from slurmft.watch.report import write_report_safely

    module, _, function = body.partition(":")
    try:
        return dict(getattr(importlib.import_module(module), function)(run_dir, *args))
    except SlurmftError as exc:
        sys.stderr.write(f"slurmft {kind}: {exc.render()}\n")
        sys.stderr.flush()
        raise SystemExit(EXIT_SETUP_ERROR) from None
    finally:
        write_report_safely(run_dir)  # report.md: the check's outcome, passed or not


def run_serve(run_dir: str, overrides: list[str] | None = None) -> dict[str, object]:
    """Serve check job body (one process): vLLM on ``RUN_DIR/model`` (and a LoRA run's adapter) against
    transformers (:mod:`slurmft.job.serve_check`); ``RUN_DIR/serve/result.json``. ``overrides``: ``slurmft serve
    RUN_DIR KEY=VALUE``'s (resolved), read onto RUN_DIR/config.yaml."""
    return _after_model(run_dir, "serve", "slurmft.job.serve_check:serve_check_run", overrides)


def run_eval(run_dir: str, overrides: list[str] | None = None) -> dict[str, object]:
    """Evaluation job body (one process): lm-eval on ``RUN_DIR/model`` and the base (:mod:`slurmft.job.evaluate`);
    ``RUN_DIR/eval/``. ``overrides``: ``slurmft eval RUN_DIR KEY=VALUE``'s (resolved), read onto
    RUN_DIR/config.yaml; a job queued by an earlier release passes ``--tasks``'s names here instead, read as the
    override they stand for (:func:`slurmft.eval_tasks.queued_task_list`)."""
    from slurmft.eval_tasks import queued_task_list

    summary = _after_model(run_dir, "eval", "slurmft.job.evaluate:evaluate_run", queued_task_list(overrides))
    from slurmft.watch.sweep import refresh_best_safely

    refresh_best_safely(run_dir)  # a sweep's point ranked by its evaluation: SWEEP_DIR/best, now that it has a score
    return summary


def main(argv: list[str] | None = None) -> int:
    """``python -m slurmft.job.entrypoint {train,prepare} RUN_DIR [--signal USR2]``; ``prepare-task RUN_DIR --task K
    --tasks N --group G``: one prepare array task, as Slurm's array runs it (bench/prepare_array.py runs them so)."""
    ap = argparse.ArgumentParser(prog="python -m slurmft.job.entrypoint")
    ap.add_argument("command", choices=["train", "prepare", "prepare-task"])
    ap.add_argument("run_dir")
    ap.add_argument("--signal", default="USR2", help="warning signal Slurm sends before the end (default USR2)")
    ap.add_argument("--task", type=int, default=0, help="prepare-task: this task's index")
    ap.add_argument("--tasks", type=int, default=1, help="prepare-task: the array's tasks")
    ap.add_argument("--group", default="here", help="prepare-task: the array's id (its tasks' shared directory)")
    args = ap.parse_args(argv)
    if args.command == "prepare":
        sys.stdout.write(f"slurmft prepare: {run_prepare(args.run_dir)}\n")
        return 0
    if args.command == "prepare-task":
        sys.stdout.write(f"slurmft prepare task {args.task}: {run_prepare_task(args.run_dir, args.task, args.tasks, args.group)}\n")
        return 0
    result = run_train(args.run_dir, args.signal)
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
    sys.stdout.write(f"slurmft rank {rank}: {result.get('status')} at step {result.get('global_step')}\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
