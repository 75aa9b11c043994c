"""The evaluation job: lm-eval-harness on the fine-tuned model and, with ``eval.compare_base``, on the base model.

Chained after consolidation. lm-eval only ever runs as a subprocess (``python -m lm_eval``'s command line, through
slurmft/job/lm_eval_run.py: see there why) in the eval interpreter (``eval.python``, default the job's,
``cluster.python``): it pins its own transformers, and a crash in it must not take the job's Python with it. Its
output streams into the job log line by line, and its own files stay as it writes them: RUN_DIR/eval/finetuned/ and RUN_DIR/eval/base/ (``results_<time>.json``, the
samples). What the report and ``runs`` read is RUN_DIR/eval/summary.json (slurmft.eval_results):

    {"lm_eval_version", "backend", "backend_reason", "device", "tasks": {task: {metric: {"finetuned": v,
     "base": v or null}}}, "higher_is_better": {task: {metric: bool}} (lm-eval's directions),
     "seconds": {"finetuned", "base", "total"}, "models": {"finetuned", "base"},
     "results_files": {"finetuned", "base"}, "settings": {the eval section it ran with}, "overrides": [...],
     "base_eval": {a sweep point's only: where its base scores went, or came from}}

Metric names are lm-eval's (``acc,none``); the ``_stderr`` entries stay in lm-eval's files only.

Which model: RUN_DIR/model (a full run, or a LoRA run merged by consolidation); a LoRA run with
``consolidate.merge: false`` has only RUN_DIR/adapter, evaluated as the base plus the adapter (lm-eval's hf
``peft=``, vllm ``lora_local_path=``). The backend: ``auto`` = vllm where the eval Python imports it, else hf
(the summary records which and why). Task files (``eval.tasks`` entries that are YAML files or folders) are
passed as lm-eval's ``--include_path`` (their folder) and their ``task:`` names; lm-eval runs in that folder,
so a relative ``data_files`` resolves against the task file's folder. A failure raises ``EvalError`` with the
last lines lm-eval wrote to stderr; RUN_DIR/model is only ever read.

A sweep point scores its base once per sweep: the first point keeps the base's results in
``SWEEP_DIR/base-eval/KEY/record.json`` and a later point whose base evaluation is identical (the same KEY: what its
lm-eval command and task files are, slurmft.job.base_eval) reads them there instead of running lm-eval again.

By hand: ``slurmft eval RUN_DIR [eval.tasks=[a,b] eval.limit=N ...] --here``.
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from slurmft.config_loading import read_run_config
from slurmft.config_model_checks import EvalConfig
from slurmft.errors import EvalError
from slurmft.eval_tasks import resolve_tasks
from slurmft.job import base_eval
from slurmft.job.lm_eval_run import ONLY_INCLUDED
from slurmft.rundir import ADAPTER_CONFIG, RunPaths, atomic_write, keep_previous

if TYPE_CHECKING:
    from slurmft.config import RunConfig

#: Lines of lm-eval's stderr an ``EvalError`` quotes.
STDERR_TAIL = 15
#: Seconds ``<eval python> -c "import vllm"`` may take (vLLM's import is slow: torch, triton, its kernels).
VLLM_PROBE_S = 300
#: The script ``eval.python`` runs: lm-eval's command line (slurmft.job.lm_eval_run).
LM_EVAL_RUN = Path(__file__).with_name("lm_eval_run.py")
#: The environment lm-eval runs with, on top of the job's.
LM_EVAL_ENV = {"PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}

Say = Callable[[str], None]


def choose_backend(backend: str, python: str) -> tuple[str, str]:
    """``(backend, why)``: ``auto`` is vllm where ``python`` imports it, else hf."""
    if backend != "auto":
        return backend, f"eval.backend: {backend}"
    try:
        probe = subprocess.run([python, "-c", "import vllm"], capture_output=True, text=True, timeout=VLLM_PROBE_S,
                               check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        return "hf", f"auto: {python} -c 'import vllm' failed ({err})"
    if probe.returncode == 0:
        return "vllm", f"auto: {python} imports vllm"
    last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
    return "hf", f"auto: {python} cannot import vllm ({last})"


def no_gpu(gpus: int) -> str | None:
    """Why lm-eval must run on the CPU (``--device cpu``), or None to let it pick: CUDA_VISIBLE_DEVICES set empty,
    an allocation without GPUs (``eval.resources.gpus: 0``), or no NVIDIA device on this node."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1", "NoDevFiles"):
        return f"CUDA_VISIBLE_DEVICES={visible!r}"
    if gpus == 0:
        return "eval.resources.gpus: 0"
    if not any(Path("/dev").glob("nvidia[0-9]*")):
        return "no /dev/nvidia* device on this node"
    return None


def _model_args(pairs: dict[str, Any]) -> str:
    """lm-eval's ``--model_args`` ``k=v,k2=v2`` (None values left out)."""
    for key, value in pairs.items():
        if value is not None and ("," in str(value) or "=" in str(value)):
            raise EvalError(f"the model argument {key}={value!r} holds ',' or '=', which lm-eval's --model_args "
                            "cannot carry; use a path without them")
    return ",".join(f"{k}={v}" for k, v in pairs.items() if v is not None)


def _bools(pairs: dict[str, Any]) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, bool) else v) for k, v in pairs.items()}


def model_specs(cfg: RunConfig, ev: EvalConfig, paths: RunPaths, backend: str) -> dict[str, dict[str, Any]]:
    """``{"finetuned": {...}, "base": {...}}`` (base only with ``ev.compare_base``): each lm-eval's model arguments
    and a display name. Raises ``EvalError`` when consolidation left no model to evaluate."""
    dtype = cfg.consolidate.dtype
    trust = cfg.model.trust_remote_code or None
    base_args: dict[str, Any] = {"pretrained": cfg.model.name_or_path, "revision": cfg.model.revision,
                                 "tokenizer": cfg.model.tokenizer, "dtype": dtype, "trust_remote_code": trust}
    if backend == "vllm":
        base_args["tensor_parallel_size"] = max(1, ev.resources.gpus)
    specs: dict[str, dict[str, Any]] = {}
    if (paths.model / "config.json").is_file():
        args = {"pretrained": str(paths.model), "dtype": dtype, "trust_remote_code": trust}
        if backend == "vllm":
            args["tensor_parallel_size"] = base_args["tensor_parallel_size"]
        specs["finetuned"] = {"args": args, "name": str(paths.model)}
    elif cfg.lora is not None and (paths.adapter / ADAPTER_CONFIG).is_file():
        key = "lora_local_path" if backend == "vllm" else "peft"
        args = dict(base_args, **{key: str(paths.adapter)})
        if backend == "vllm":
            args["enable_lora"] = True
            args["max_lora_rank"] = max(16, cfg.lora.r)
        specs["finetuned"] = {"args": args, "name": f"{cfg.model.name_or_path} + {paths.adapter}"}
    else:
        where = f"{paths.model}/config.json" + (f" nor {paths.adapter}/{ADAPTER_CONFIG}" if cfg.lora else "")
        raise EvalError(f"nothing to evaluate: no {where}; run consolidation first (slurmft consolidate)")
    if ev.compare_base:
        specs["base"] = {"args": base_args, "name": cfg.model.name_or_path}
    for spec in specs.values():
        spec["args"] = _bools(spec["args"])
    return specs


def lm_eval_command(python: str, backend: str, model_args: str, names: list[str], include_path: str | None,
                    ev: EvalConfig, out: Path, device: str | None, only_included: bool = False) -> list[str]:
    """The lm-eval command line of one model: ``python -m lm_eval``'s, through :data:`LM_EVAL_RUN`, which with
    ``only_included`` (every task a file of the user's) indexes the include path alone."""
    cmd = [python, str(LM_EVAL_RUN), *([ONLY_INCLUDED] if only_included else []), "--model", backend,
           "--model_args", model_args, "--tasks", ",".join(names),
           "--batch_size", str(ev.batch_size), "--output_path", str(out), "--log_samples"]
    if include_path:
        cmd += ["--include_path", include_path]
    if ev.num_fewshot is not None:
        cmd += ["--num_fewshot", str(ev.num_fewshot)]
    if ev.limit is not None:
        cmd += ["--limit", str(int(ev.limit)) if ev.limit >= 1 and ev.limit == int(ev.limit) else str(ev.limit)]
    if device:
        cmd += ["--device", device]
    return cmd


def _pump(stream: IO[str], say: Say, tail: collections.deque[str] | None) -> None:
    """Each line of ``stream`` to ``say``; a progress bar's ``\\r`` updates become their last state."""
    for raw in stream:
        line = raw.rstrip("\n").split("\r")[-1].rstrip()
        if not line:
            continue
        say(line)
        if tail is not None:
            tail.append(line)


def run_lm_eval(cmd: list[str], cwd: Path, say: Say) -> list[str]:
    """Run one lm-eval command, its stdout and stderr streamed to ``say``; returns the tail of its stderr. Raises
    ``EvalError`` (with that tail) when it fails."""
    say("lm-eval: " + " ".join(cmd))
    env = {**os.environ, **LM_EVAL_ENV}
    tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL)
    try:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                errors="replace", bufsize=1)
    except OSError as err:
        raise EvalError(f"cannot start lm-eval ({cmd[0]}): {err}; set eval.python to an interpreter with lm-eval "
                        "installed") from None
    assert proc.stdout is not None and proc.stderr is not None
    lock = threading.Lock()

    def locked(line: str) -> None:
        with lock:
            say(line)

    pumps = [threading.Thread(target=_pump, args=(proc.stdout, locked, None), daemon=True),
             threading.Thread(target=_pump, args=(proc.stderr, locked, tail), daemon=True)]
    for t in pumps:
        t.start()
    rc = proc.wait()
    for t in pumps:
        t.join()
    if rc != 0:
        raise EvalError(f"lm-eval exited with {rc} ({' '.join(cmd[:3])} ...); the last lines of its stderr:",
                        (list(tail) or ["(no output on stderr)"]) + offline_hints(list(tail)))
    return list(tail)


#: datasets' words for a data set it could not download: ``Couldn't reach 'Rowan/hellaswag' on the Hub
#: (OfflineModeIsEnabled)`` (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE set, as cluster profiles for offline nodes do), or
#: ``(LocalEntryNotFoundError)`` and the like where the Hub cannot be reached.
_UNREACHED = re.compile(r"Couldn't reach '([^']+)' on the Hub \((\w+)\)")


def offline_hints(tail: list[str]) -> list[str]:
    """The fix for a registry task whose data set is not in the cache of a job that cannot download it, said after
    lm-eval's own lines (which end in datasets' ConnectionError and name no fix)."""
    for line in reversed(tail):
        if m := _UNREACHED.search(line):
            why = ("the job runs offline (HF_HUB_OFFLINE=1)" if m.group(2) == "OfflineModeIsEnabled"
                   else f"the Hub cannot be reached from where the job runs ({m.group(2)})")
            return [f"the fix: {why} and {m.group(1)} is not in the datasets cache of HF_HOME "
                    f"({os.environ.get('HF_HOME', '~/.cache/huggingface')}): load it once where the network is "
                    f"reachable, with the same HF_HOME and eval.python (`python -c \"import datasets; "
                    f"datasets.load_dataset('{m.group(1)}')\"`), or give a task file of your own (docs/serve-eval.md)"]
    return []


def _newest_results(out: Path, before: set[Path]) -> Path:
    fresh = [p for p in out.rglob("results_*.json") if p not in before]
    if not fresh:
        raise EvalError(f"lm-eval exited 0 but wrote no results_*.json under {out}; see its output in the job log")
    return max(fresh, key=lambda p: p.stat().st_mtime_ns)


def metrics_of(results: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """``{task: {metric: value}}`` from an lm-eval results JSON: every ``name,filter`` entry but the stderrs."""
    table: dict[str, dict[str, float | None]] = {}
    for task, entries in results.get("results", {}).items():
        table[task] = {k: (v if isinstance(v, (int, float)) else None) for k, v in entries.items()
                       if "," in k and "_stderr," not in k}
    return table


def directions_of(results: dict[str, Any]) -> dict[str, dict[str, bool]]:
    """``{task: {metric: higher is better}}`` from an lm-eval results JSON (its ``higher_is_better``, metric names
    without the filter); a direction lm-eval left undecided (None: a group whose tasks disagree) is left out. Kept in
    the summary so the login side can say whether the fine-tune beat the base without knowing every metric."""
    declared = results.get("higher_is_better")
    if not isinstance(declared, dict):
        return {}
    return {task: {m: h for m, h in metrics.items() if isinstance(h, bool)} for task, metrics in declared.items()
            if isinstance(metrics, dict)}


def _shared_base(paths: RunPaths, cmd: list[str], out: Path, include_path: str | None, python: str,
                 args: dict[str, Any]) -> tuple[Path, str, dict[str, Any]] | None:
    """``(record path, key, key inputs)`` of a sweep point's base evaluation (slurmft.job.base_eval), None for a run
    alone (nothing computed for it)."""
    folder = base_eval.records_dir(paths.root)
    if folder is None:
        return None
    inputs = base_eval.base_inputs(cmd, out, include_path, LM_EVAL_ENV, python, args, LM_EVAL_RUN)
    key = base_eval.base_key(inputs)
    return folder / key / base_eval.RECORD, key, inputs


def evaluate_run(run_dir: str, overrides: list[str] | None = None, say: Say = print) -> dict[str, Any]:
    """Score a consolidated run with lm-eval (the eval section of RUN_DIR/config.yaml with ``overrides``: ``slurmft
    eval RUN_DIR KEY=VALUE``'s, resolved) and write RUN_DIR/eval/summary.json; returns the summary."""
    start = time.monotonic()
    paths = RunPaths.of(run_dir)
    cfg = read_run_config(paths.config, overrides)
    if cfg.eval is None:
        raise EvalError(f"{paths.config} has no eval: section: give one, e.g. `slurmft eval {paths.root} "
                        "eval.tasks=[hellaswag]`")
    ev = cfg.eval
    resolved = resolve_tasks(ev.tasks)
    if resolved.problems:
        raise EvalError("eval.tasks: the task files cannot be used", resolved.problems)
    python = cfg.model_job_python("eval", sys.executable)  # default: the interpreter running this step
    backend, why = choose_backend(ev.backend, python)
    say(f"eval: backend {backend} ({why}); tasks {', '.join(resolved.names)}; interpreter {python}")
    cpu_reason = no_gpu(ev.resources.gpus) if backend == "hf" else None
    device = "cpu" if cpu_reason else None
    if cpu_reason:
        say(f"eval: --device cpu ({cpu_reason})")
    specs = model_specs(cfg, ev, paths, backend)
    root = paths.root / "eval"
    cwd = Path(resolved.include_path) if resolved.include_path else root
    scores: dict[str, dict[str, dict[str, float | None]]] = {}
    directions: dict[str, dict[str, bool]] = {}
    seconds: dict[str, float] = {}
    files: dict[str, str] = {}
    version: str | None = None
    base_eval_note: dict[str, Any] | None = None  # a sweep point's: where its base scores come from or went
    for which, spec in specs.items():
        out = root / which
        cmd = lm_eval_command(python, backend, _model_args(spec["args"]), resolved.names, resolved.include_path, ev,
                              out, device, only_included=not resolved.registry_names)
        say(f"eval: {which} model {spec['name']}")
        shared = _shared_base(paths, cmd, out, resolved.include_path, python, spec["args"]) if which == "base" else None
        if shared and (record := base_eval.read_record(shared[0], shared[1])):
            base_eval_note = {"reused": True, "from": str(shared[0]), "point": record["point"], "key": shared[1],
                              "seconds": record["seconds"]}
            say(f"eval: base: reused from {shared[0]} (scored by point {record['point']}); lm-eval not run")
            seconds[which], files[which], data = 0.0, str(shared[0]), record["results"]
        else:
            out.mkdir(parents=True, exist_ok=True)
            before = set(out.rglob("results_*.json"))
            t0 = time.monotonic()
            run_lm_eval(cmd, cwd, say)
            seconds[which] = round(time.monotonic() - t0, 1)
            result_file = _newest_results(out, before)
            files[which] = str(result_file.relative_to(paths.root))
            data = json.loads(result_file.read_text())
            if shared:
                kept = base_eval.keep_record(shared[0], shared[1], shared[2], paths.root.name, seconds[which], data)
                base_eval_note = {"reused": False, "kept_in": str(shared[0]), "key": shared[1]}
                say("eval: base: scored here; " + (f"kept in {shared[0]} for the sweep's other points" if kept
                                                      else f"{shared[0]} was written meanwhile by another point"))
        version = version or data.get("lm_eval_version")
        for task, declared in directions_of(data).items():  # the fine-tuned run's first; the base's fill its gaps
            directions[task] = {**declared, **directions.get(task, {})}
        for task, metrics in metrics_of(data).items():
            for metric, value in metrics.items():
                cell = scores.setdefault(task, {}).setdefault(metric, {"finetuned": None, "base": None})
                cell[which] = value
    seconds["total"] = round(time.monotonic() - start, 1)
    summary = {
        "lm_eval_version": version,
        "backend": backend,
        "backend_reason": why,
        "device": device or "auto",
        "tasks": scores,
        "higher_is_better": {task: directions[task] for task in scores if task in directions},
        "seconds": seconds,
        "models": {"finetuned": specs["finetuned"]["name"], "base": specs["base"]["name"] if "base" in specs else None},
        "results_files": {"finetuned": files.get("finetuned"), "base": files.get("base")},
        "settings": ev.model_dump(mode="json"),  # the section it ran with: config.yaml's, or with the overrides
        "overrides": list(overrides or []),
    }
    if base_eval_note is not None:
        summary["base_eval"] = base_eval_note
    if kept := keep_previous(root / "summary.json"):  # the scores it replaces stay readable
        say(f"eval: the previous summary is kept as {kept}")
    atomic_write(root / "summary.json", json.dumps(summary, indent=2) + "\n")
    say(f"eval: wrote {root / 'summary.json'} in {seconds['total']} s")
    from slurmft.watch.model_results import eval_lines

    for line in eval_lines(paths.root):  # the job's log ends with the scores as status says them (it did not)
        say(line)
    if "wandb" in cfg.train.report_to:
        send_to_wandb(paths, cfg.name, summary, say)
    return summary


def wandb_summary(summary: dict[str, Any]) -> dict[str, float]:
    """The scores as W&B summary keys: ``eval/TASK/METRIC`` (the fine-tuned model) and ``.../base``."""
    out: dict[str, float] = {}
    for task, metrics in summary.get("tasks", {}).items():
        for metric, cell in metrics.items():
            key = f"eval/{task}/{metric.removesuffix(',none')}"
            if isinstance(cell.get("finetuned"), int | float):
                out[key] = cell["finetuned"]
            if isinstance(cell.get("base"), int | float):
                out[f"{key}/base"] = cell["base"]
    return out


def send_to_wandb(paths: RunPaths, name: str, summary: dict[str, Any], say: Say) -> str | None:
    """The scores into the run's one W&B run (the train job's: slurmft/trackers.py), as summary values; recorded in
    ``tracker.json`` as an attempt of its own (an offline one is synced with the others). Never raises: the scores
    are in ``eval/summary.json`` whatever W&B does. Returns the W&B run id (None when nothing was sent)."""
    from slurmft.trackers import record_wandb_run, use_one_wandb_run

    try:
        import wandb
    except ImportError:
        say("eval: W&B: wandb is not installed in the job's Python; the scores are in eval/summary.json only")
        return None
    use_one_wandb_run(paths, name)
    try:
        run = wandb.init(id=os.environ["WANDB_RUN_ID"], resume=os.environ["WANDB_RESUME"], name=os.environ["WANDB_NAME"],
                         dir=os.environ["WANDB_DIR"])
        run.summary.update(wandb_summary(summary))
        record_wandb_run(paths, run, {"job": "eval"})
        run_id = run.id
        wandb.finish()
    except Exception as exc:  # noqa: BLE001 - a tracker never fails an evaluation that succeeded
        say(f"eval: W&B: sending the scores failed ({type(exc).__name__}: {exc}); they are in eval/summary.json")
        return None
    say(f"eval: W&B run {run_id}: the scores are in its summary (eval/TASK/METRIC, .../base)")
    return str(run_id)
