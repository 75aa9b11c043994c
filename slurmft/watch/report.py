"""The run report: ``RUN/report.md`` and ``RUN/loss.png``, what a user reads once the run is over.

Everything in it is recomputed from the run directory (config, manifest, ``metrics.jsonl``, requeue
markers, ``fsdp_report/``, ``model/``) plus the job rows Slurm gives, so ``slurmft report RUN_DIR``
can regenerate it at any time and its numbers always match ``metrics.jsonl``. The consolidation job
writes it at its end through :func:`write_report_safely`: a report is a courtesy, so no failure in
it (a missing matplotlib, an unreachable ``sacct``, a torn metrics line) may fail the consolidation.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import yaml

from slurmft import __version__, cancels
from slurmft.methods import recorded_objective
from slurmft.rundir import RunPaths, atomic_write, check_run_dir, is_sweep_dir, read_manifest, unreadable
from slurmft.trackers import read_tracker, sync_command, tracker_lines
from slurmft.units import binary_bytes, fmt_duration, fmt_time
from slurmft.watch.model_results import result_lines
from slurmft.watch.progress import (
    allocation_words,
    attempts,
    checkpoint_info,
    lost_to_preemption,
    max_steps_of,
    mean_tokens_per_s,
    preference_words,
    progress_of,
    read_metrics,
    requeue_markers,
    rollouts_words,
)
from slurmft.watch.results import adapter_info, lora_info, lora_words, model_info, result_info
from slurmft.watch.run_totals import newest_records, read_summaries, totals


def _config(paths: RunPaths) -> dict[str, Any]:
    """The raw config mapping: a report is written even for a run whose config.yaml no longer validates."""
    try:
        data = yaml.safe_load(paths.config.read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def _objective(cfg: dict[str, Any], recorded: dict[str, Any]) -> str:
    """What the run optimises, in words: the method its submit recorded (slurmft/methods.py), with its settings from
    the raw config mapping (the watching commands never build the schema: tests/test_lazy_imports.py)."""
    method = recorded.get("method")
    if method == "dpo":  # config.yaml is the resolved config: every key is there
        dpo = cfg.get("dpo") if isinstance(cfg.get("dpo"), dict) else {}
        loss = dpo.get("loss_type", "-")
        return (f"DPO (beta {dpo.get('beta', '-')}, loss {', '.join(loss) if isinstance(loss, list) else loss}, "
                f"reference {dpo.get('reference', '-')})")
    if method == "grpo":
        grpo = cfg.get("grpo") if isinstance(cfg.get("grpo"), dict) else {}
        return f"GRPO ({grpo.get('num_generations', '-')} completions per prompt, beta {grpo.get('beta', '-')})"
    if method == "text":
        return "continued pretraining on plain text (every token in the loss)"
    return "supervised fine-tuning"


def partition_words(cfg: dict[str, Any]) -> str:
    """``partition `gpu```, or the cluster's default partition where ``cluster.partition`` is unset (null: sbatch
    gets no --partition; the report said ``partition `None```)."""
    partition = _get(cfg, "cluster.partition", None)
    return f"partition `{partition}`" if partition else "the cluster's default partition"


def _get(d: dict[str, Any], dotted: str, default: Any = "-") -> Any:
    for part in dotted.split("."):
        if not isinstance(d, dict) or part not in d:
            return default
        d = d[part]
    return d


def rank_memory(paths: RunPaths) -> list[dict[str, Any]]:
    """Per-rank memory from ``fsdp_report/rank*.json`` (written at the start of the newest attempt)."""
    out = []
    folder = paths.fsdp_report
    for f in sorted(folder.glob("rank*.json"), key=lambda p: int(p.stem[4:]) if p.stem[4:].isdigit() else 0):
        try:
            rep = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        out.append({"rank": rep.get("rank"), "peak_rss_mib": rep.get("peak_rss_mib"),
                    "local_bytes": rep.get("local_bytes"), "device": rep.get("device")})
    return out


def summary(paths: RunPaths, slurm_rows: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Every number the report prints, as data (``slurm_rows``: :func:`slurmft.watch.status.job_rows`; None asks Slurm)."""
    try:
        manifest = read_manifest(paths)
    except Exception as exc:  # noqa: BLE001 - a corrupt manifest still leaves the metrics to report
        manifest, manifest_problem = {"jobs": []}, str(exc)
    else:
        manifest_problem = None
    if slurm_rows is None:
        slurm_rows = _rows(manifest, paths)
    metrics = read_metrics(paths.metrics)
    records = metrics.records
    max_steps = max_steps_of(paths)
    rows = attempts(manifest, records, slurm_rows, markers=requeue_markers(paths), max_steps=max_steps,
                    cancelled=cancels.read(paths))
    # each step once, with its newest value: a step trained again after a resume from an older checkpoint counted twice
    losses = [r["loss"] for r in newest_records(records) if isinstance(r.get("loss"), (int, float))]
    rss = [r["peak_rss_mib"] for r in records if isinstance(r.get("peak_rss_mib"), (int, float))]
    gpu = [r["peak_gpu_mem_mib"] for r in records if isinstance(r.get("peak_gpu_mem_mib"), (int, float))]
    last = records[-1] if records else {}
    return {
        "name": manifest.get("name") or paths.root.name,
        "executor": manifest.get("executor", "-"),
        "manifest_problem": manifest_problem,
        "config": (config := _config(paths)),
        "objective": recorded_objective(manifest, config),
        "progress": progress_of(metrics, max_steps),
        "attempts": rows,
        "lost": lost_to_preemption(rows),
        "final_loss": last.get("loss"),
        "final_step": last.get("step"),
        "mean_loss_last10": round(sum(losses[-10:]) / len(losses[-10:]), 4) if losses else None,
        "whole_run": whole_run(records, paths),
        "tokens_per_s_mean": round(tps, 2) if (tps := mean_tokens_per_s(records)) is not None else None,
        "tokens_seen": last.get("num_input_tokens_seen"),
        "logged_steps": len(records),
        "peak_rss_mib_worst_rank": max(rss) if rss else None,
        "peak_gpu_mem_mib_worst_rank": max(gpu) if gpu else None,
        "ranks": rank_memory(paths),
        "checkpoint": checkpoint_info(paths),
        "model": model_info(paths),
        "adapter": adapter_info(paths),
        "result": result_info(paths),
        "nodes": _nodes_by_attempt(paths),
        "tracker": read_tracker(paths),
        "lora": lora_info(paths),
        "saves": metrics.saves,
        "model_checks": result_lines(paths.root),
    }


def _rows(manifest: dict[str, Any], paths: RunPaths | None = None) -> list[dict[str, Any]]:
    """Slurm's view of the jobs (a job another user submitted that Slurm hides from us is 'cannot tell', judged
    against the run's owner for entries that name no submitter); on any failure (no Slurm here, a busy controller)
    none."""
    try:
        from slurmft.rundir import run_owner
        from slurmft.watch.status import job_rows

        return job_rows(manifest, owner=run_owner(paths, manifest) if paths else None,
                        cancelled=cancels.read(paths) if paths else None)
    except Exception:  # noqa: BLE001 - the report falls back to the run directory alone
        return []


def _nodes_by_attempt(paths: RunPaths) -> dict[tuple[str, int], str]:
    """Node list of each (job id, restart), from the batch script's ``[slurmft] job=...`` lines."""
    try:
        from slurmft.watch.logs import log_attempts

        return {(a.job_id, a.restart): a.nodes for a in log_attempts(paths.root, "train")
                if a.nodes and a.restart is not None}
    except Exception:  # noqa: BLE001 - no logs, no node list
        return {}


def render(s: dict[str, Any], plot_name: str | None) -> str:
    """The Markdown text of the report."""
    cfg = s["config"]
    objective, packed = _objective(cfg, s["objective"]), s["objective"].get("packed")
    res = cfg.get("resources", {}) if isinstance(cfg.get("resources"), dict) else {}
    nodes, gpus = res.get("nodes", "-"), res.get("gpus_per_node", "-")
    ranks = res.get("tasks_per_node") or gpus or "-"
    datasets = ", ".join(f"{d.get('path')} (weight {d.get('weight', 1)})" for d in _get(cfg, "data.datasets", [])
                         if isinstance(d, dict)) or "-"
    L: list[str] = [f"# Run report: {s['name']}", "",
                    f"Written {fmt_time(time.time())} by slurmft {__version__} from the run directory "
                    "(`slurmft report RUN_DIR` writes it again).", ""]
    if s["manifest_problem"]:
        L += [f"> manifest: {s['manifest_problem']}", ""]
    L += ["## Config", "", "| field | value |", "|---|---|",
          f"| model | `{_get(cfg, 'model.name_or_path')}` ({_get(cfg, 'model.dtype')}) |",
          f"| objective | {objective} |",
          f"| method | {lora_words(s.get('lora'))} |",
          f"| data | {datasets}; max_seq_length {_get(cfg, 'data.max_seq_length')}, "
          f"packing {_dash(packed)} |",
          f"| steps | {_get(cfg, 'train.max_steps')} × per-device batch {_get(cfg, 'train.per_device_batch_size')} "
          f"× gradient accumulation {_get(cfg, 'train.gradient_accumulation_steps')} |",
          f"| optimizer | lr {_get(cfg, 'train.learning_rate')}, {_get(cfg, 'train.lr_scheduler')} schedule, "
          f"warm-up {_get(cfg, 'train.warmup_ratio')} |",
          f"| checkpoints | every {_get(cfg, 'checkpoint.every_steps')} steps, keep {_get(cfg, 'checkpoint.keep_last')} |",
          f"| preemption | signal {_get(cfg, 'preemption.signal')} {_get(cfg, 'preemption.lead_time_s')} s before the end, "
          f"max {_get(cfg, 'preemption.max_requeues')} requeues |", ""]
    L += ["## Allocation", "",
          ("local executor, on this machine (no partition, no profile's network)" if s["executor"] == "local" else
           f"{s['executor']} executor, profile `{_get(cfg, 'cluster.profile')}`, {partition_words(cfg)}")
          + f", time limit {_get(cfg, 'cluster.time')}: "
          f"{nodes} node(s) × {ranks} rank(s), {gpus} GPU(s) per node.", ""]
    if s["nodes"]:
        L += ["Nodes per attempt: " + "; ".join(f"job {j} restart {r}: `{n}`"
                                                 for (j, r), n in s["nodes"].items()), ""]
    L += ["## Attempts", "", "| # | job | restart | how | first step at | last step at | steps | resumed from | "
          "how it ended |", "|---|---|---|---|---|---|---|---|---|"]
    for k, a in enumerate(s["attempts"], start=1):
        steps = f"{a['first_step']}–{a['last_step']}" if a["first_step"] is not None else "none logged"
        L.append(f"| {k} | {a['job_id']} | {a['restart']} | {a['how']}{allocation_words(a)} | {fmt_time(a['start'])} | "
                 f"{fmt_time(a['end'])} | {steps} | {_dash(a['resumed_from_step'])} | {a['reason']} |")
    lost = s["lost"]
    # a cancel or a failure resumed by hand costs as a preemption does, and its gap holds the wait for the resume
    L += ["", "## Time lost to restarts", ""]
    if lost["boundaries"]:
        L += [f"{lost['recomputed_steps']} step(s) computed again (≈ {fmt_duration(lost['recomputed_s'])}) and "
              f"{fmt_duration(lost['gap_s'])} between attempts (queue wait and start-up; before a resume by hand, the wait "
              "for it too): "
              f"{fmt_duration(lost['total_s'])} in all.", ""]
        for b in lost["boundaries"]:
            L.append(f"- before job {b['job_id']} restart {b['restart']}: {b['recomputed_steps']} step(s) again "
                     f"(≈ {fmt_duration(b['recomputed_s'])}), {fmt_duration(b['gap_s'])} between attempts")
        L.append("")
    else:
        L += ["None: the run trained in one attempt.", ""]
    p = s["progress"]
    L += ["## Results", "", "| | |", "|---|---|",
          f"| steps | {_dash(p['step'])} / {_dash(p['max_steps'])} ({s['logged_steps']} logged) |",
          f"| final loss | {_loss(s['final_loss'])} (step {_dash(s['final_step'])}); "
          f"mean of the last 10 logged: {_loss(s['mean_loss_last10'])} |",
          *whole_run_rows(s["whole_run"]),
          f"| tokens/s | {_dash(s['tokens_per_s_mean'])} (tokens trained over the time of the logged steps); "
          f"{_dash(s['tokens_seen'])} tokens seen |"]
    if p.get("preference"):
        L.append(f"| DPO, final step | {preference_words(p['preference'])} |")
    if p.get("rollouts"):
        L.append(f"| GRPO, last rollouts | {rollouts_words(p['rollouts'])} |")
    L.append("")
    if p["problem"]:
        L += [f"> metrics: {p['problem']}", ""]
    L += [f"> whole-run figures: {gap}" for gap in s["whole_run"]["gaps"]] + ([""] if s["whole_run"]["gaps"] else [])
    if s["tracker"]:
        L += [tracker_lines(s["tracker"])[0], ""]
        sync = sync_command(s["tracker"])
        if sync:
            L += [f"Upload the offline attempts into that one W&B run: `{sync}`", ""]
    L += ["## Memory", "",
          f"Peak over the run, worst rank (from metrics.jsonl): RSS {_mib(s['peak_rss_mib_worst_rank'])}, "
          f"GPU {_mib(s['peak_gpu_mem_mib_worst_rank'])}.", ""]
    if s["ranks"]:
        L += ["Per rank, at the start of training of the newest attempt (fsdp_report/):", "",
              "| rank | device | peak RSS | parameters held |", "|---|---|---|---|"]
        L += [f"| {r['rank']} | {r['device'] or '-'} | {_mib(r['peak_rss_mib'])} | {binary_bytes(r['local_bytes'])} |"
              for r in s["ranks"]]
        L.append("")
    L += save_lines(s["saves"])
    ck = s["checkpoint"]
    L += ["## Model", "",
          *([f"Adapter: `{s['adapter']}` (`PeftModel.from_pretrained(base, adapter)` loads it).", ""]
            if s.get("adapter") else []),
          f"Consolidated model: `{s['model']}` (`AutoModelForCausalLM.from_pretrained` loads it)." if s["model"]
          else "No merged model: consolidate.merge is false, the adapter is the result." if s.get("result")
          else "No consolidated model yet (`model/model.safetensors.index.json` is missing).", "",
          f"Newest complete checkpoint: `{ck['path']}` (step {ck['step']}, {binary_bytes(ck['bytes'])})." if ck
          else "No complete checkpoint.", ""]
    if s.get("model_checks"):  # the serve check and the evaluation (the jobs after consolidation)
        L += ["## Served and scored", "", "```", *s["model_checks"], "```", ""]
    if plot_name:
        L += [f"![loss and learning rate]({plot_name})", ""]
    return "\n".join(L)


def save_lines(saves: list[dict[str, Any]]) -> list[str]:
    """The "Checkpoint saves" section: per complete save how long training waited (``blocked_s``), how long
    until its COMPLETE marker (``durable_s``, staging to marker) and its size, from metrics.jsonl."""
    L = ["## Checkpoint saves", ""]
    if not saves:
        return [*L, "No save recorded (metrics.jsonl has no save line).", ""]
    blocked = [r["blocked_s"] for r in saves if isinstance(r.get("blocked_s"), (int, float))]
    L += [f"{len(saves)} complete save(s); training waited {sum(blocked):.2f} s for them in all.", "",
          "| step | mode | training waited | to COMPLETE | size | job | restart |", "|---|---|---|---|---|---|---|"]
    for r in saves:
        size = binary_bytes(r["bytes"]) if isinstance(r.get("bytes"), int) else "-"
        L.append(f"| {r['step']} | {r.get('mode', '-')} | {_dash(r.get('blocked_s'))} s | {_dash(r.get('durable_s'))} s "
                 f"| {size} | {_dash(r.get('job_id'))} | {_dash(r.get('restart'))} |")
    return [*L, ""]


def whole_run(records: list[dict[str, Any]], paths: RunPaths) -> dict[str, Any]:
    """The run's train_loss and train_runtime over every attempt (slurmft/watch/run_totals.py), what they leave out."""
    run = totals(records, read_summaries(paths.train_summary))
    return {**run.figures(), "of_steps": run.last_step, "gaps": run.gaps()}


def whole_run_rows(w: dict[str, Any]) -> list[str]:
    """The report's rows of :func:`whole_run`."""
    loss = (f"{_loss(w['train_loss'])} over {w['train_loss_steps']} of {w['of_steps']} steps (the step-weighted mean "
            f"of the logged losses, {w['train_attempts']} attempt(s))" if "train_loss" in w else "-")
    runtime = (f"{fmt_duration(w['train_runtime'])} in the training loops of the attempts, added up"
               if "train_runtime" in w else "- (no attempt recorded its end)")
    return [f"| train loss, whole run | {loss} |", f"| training time | {runtime} |"]


def _dash(v: Any) -> str:
    return "-" if v is None else str(v)


def _loss(v: Any) -> str:
    """A loss as the console prints it (four decimals); metrics.jsonl keeps the full value."""
    return f"{v:.4f}" if isinstance(v, (int, float)) else _dash(v)


def _mib(v: float | None) -> str:
    return "-" if v is None else binary_bytes(v * 2**20)


def write_report(run_dir: str | Path, slurm_rows: list[dict[str, Any]] | None = None) -> Path:
    """Write ``RUN/report.md`` and the plot ``RUN/loss.png`` beside it; return the report's path.

    A plot that cannot be drawn (no matplotlib, no metrics) is said in the report, not raised.
    """
    if is_sweep_dir(run_dir):  # a sweep's directory: its points ranked (slurmft/watch/sweep.py)
        from slurmft.watch.sweep import write_sweep_report

        return write_sweep_report(Path(run_dir))
    paths = RunPaths.of(run_dir)
    check_run_dir(paths)
    if not os.access(paths.root, os.R_OK | os.X_OK):  # nothing in it can be read: say whose it is and the fix
        raise unreadable(paths)
    if not any(p.exists() for p in (paths.manifest, paths.config, paths.metrics)):
        read_manifest(paths)  # nothing a run writes: not a run directory, said as every command says it
    s = summary(paths, slurm_rows)
    plot_name: str | None = None
    problem = None
    if s["logged_steps"]:
        try:
            from slurmft.watch.plot import plot_run

            plot_run(paths.root, paths.loss_plot)
            plot_name = paths.loss_plot.name
        except Exception as exc:  # noqa: BLE001 - the text report stands without its picture
            problem = f"no plot: {exc}"
    text = render(s, plot_name)
    if problem:
        text += f"\n> {problem}\n"
    target = paths.report
    atomic_write(target, text)
    return target


def write_report_safely(run_dir: str | Path) -> Path | None:
    """:func:`write_report` for the consolidation job: any failure is printed, never raised."""
    try:
        return write_report(run_dir)
    except Exception:  # noqa: BLE001 - a report must never fail a consolidation that succeeded
        sys.stderr.write("[slurmft] warning: the run report could not be written (the model is fine):\n"
                         + traceback.format_exc())
        sys.stderr.flush()
        return None
