"""The probe job of ``slurmft doctor --job``: what the run's nodes say about themselves, from inside an
allocation shaped like the run's (its nodes, ranks, profile variables, ``cluster.setup``, ``cluster.python``).

Why a job: the login node cannot see what a rank sees. The job's Python and its training stack, the
profile variables after ``cluster.setup``, whether the run directory and ``HF_HOME`` are one filesystem on
every node, whether ``scontrol`` answers from the batch script (the requeue needs it), whether
``MASTER_ADDR`` reaches every node, and whether Slurm's warning signal reaches the ranks: each of these
failed a real run only after its queue wait. The probe asks them in about a minute.

Two sides, each writing one JSON file into the probe directory (slurmft.probe_paths.ProbePaths):

- ``rank``: started by ``srun`` on every rank. Its first statements point the warning signal and SIGTERM
  at the train job's own flag-only handler (slurmft.job.preemption), so the probe tests that handler.
  Then versions, profile variables, a token file written into the run directory's and HF_HOME's
  filesystems and read back by the other nodes, a gloo (CPU) or NCCL (GPU) process group on
  MASTER_ADDR, one all-reduce bandwidth figure, whether ``serve.python``/``eval.python`` find vLLM/lm-eval there;
  then it waits for the warning signal.
- ``tool``: a job after consolidation that runs somewhere else than the ranks (``serve.container`` /
  ``eval.container``: its own image, or the host) is asked there, by one task per node started before the ranks
  in that place's image with that image's Python: whether its ``serve.python`` / ``eval.python`` is there and finds
  vLLM / lm-eval. Nothing heavy is imported (slurmft itself must be in that image: the job's entrypoint needs it).
- ``batch``: started by the batch shell beside ``srun``. Once every rank is ready it asks ``scontrol show
  job`` (the same call the requeue decision makes) and shortens the job's own time limit so the
  remaining time falls below the lead time of the run's ``--signal``: Slurm then sends the warning
  signal exactly as the train job's directive asks for it (to the ranks, or with ``B:`` to the batch
  shell only: the ranks then report that it never came).

The verdicts are made on the login side (slurmft.plan.doctor.probe_lines) from these files.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any

from slurmft.job import preemption
from slurmft.job.rendezvous import JobEnv
from slurmft.probe_paths import ProbePaths

#: Packages whose versions each node reports (None when not installed).
STACK = ("torch", "transformers", "accelerate", "trl", "datasets", "flash-attn", "safetensors", "peft")
#: Seconds the ranks wait for the warning signal once the batch side has shortened the time limit
#: (Slurm checks warning signals about every 30 s).
SIGNAL_WAIT_S = 75
#: Seconds the ranks keep waiting after the batch shell got the signal (a ``B:`` directive).
AFTER_BATCH_S = 5
#: Seconds the batch side waits for every rank to be ready.
READY_WAIT_S = 240


def _paths(root: str) -> ProbePaths:
    return ProbePaths(Path(root))


def _write(path: Path, data: dict[str, Any]) -> None:
    from slurmft.rundir import atomic_write

    atomic_write(path, json.dumps(data, indent=1, sort_keys=True))


def _versions() -> dict[str, str | None]:
    from importlib import metadata

    out: dict[str, str | None] = {}
    for name in STACK:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _nccl_net_plugin() -> str | None:
    """The NCCL network plugin this process would load (aws-ofi-nccl's ``libnccl-net*.so``): NCCL_NET_PLUGIN's
    library, else the first one on LD_LIBRARY_PATH or in the usual places; None when there is none."""
    env = os.environ
    names = [f"libnccl-net-{env['NCCL_NET_PLUGIN']}.so", f"libnccl-net_{env['NCCL_NET_PLUGIN']}.so"] \
        if env.get("NCCL_NET_PLUGIN") else []
    dirs = [d for d in env.get("LD_LIBRARY_PATH", "").split(":") if d]
    dirs += ["/opt/amazon/ofi-nccl/lib", "/opt/amazon/ofi-nccl/lib64", "/opt/aws-ofi-nccl/lib", "/usr/local/lib",
             "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu"]
    for d in dirs:
        for found in sorted(Path(d).glob("libnccl-net*.so*")) if Path(d).is_dir() else ():
            if not names or found.name in names:
                return str(found)
    return None


def _has_efa() -> bool | None:
    """``fi_info -p efa`` succeeds (libfabric sees EFA: a profile suggestion); None without fi_info."""
    import subprocess

    fi = shutil.which("fi_info")
    if fi is None:
        return None
    try:
        return subprocess.run([fi, "-p", "efa"], capture_output=True, timeout=20, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _token_write(directory: Path, job_id: str, node: str, make: bool) -> dict[str, Any]:
    """Write this node's token into ``directory``; its path, free bytes, or the error."""

    fact: dict[str, Any] = {"path": str(directory)}
    try:
        if make:
            directory.mkdir(parents=True, exist_ok=True)
        ProbePaths.token(directory, job_id, node).write_text(node)
        fact["free_bytes"] = shutil.disk_usage(directory).free
    except OSError as exc:
        fact["error"] = f"{type(exc).__name__}: {exc}"
    return fact


def _token_read(fact: dict[str, Any], job_id: str, nodes: list[str]) -> None:

    directory = Path(fact["path"])
    fact["saw"] = sorted(n for n in nodes if ProbePaths.token(directory, job_id, n).is_file())


def _model_job_python(python: str, kind: str) -> dict[str, Any]:
    """Whether ``python`` (``serve.python`` / ``eval.python``) is here and finds its tool, without importing it."""
    from slurmft.config_model_checks import MODEL_JOB_TOOLS
    from slurmft.interpreter import NoAnswer, finds_modules, in_words, locate

    tool = MODEL_JOB_TOOLS[kind]  # the first of its distributions installed gives the version
    module = tool.module
    path, problem = locate(python)
    fact: dict[str, Any] = {"python": python, "module": module, "found": False, "version": None, "problem": None}
    if problem is not None:
        fact["problem"] = in_words(path, problem)
        return fact
    try:
        found = finds_modules(path, (module,), tool.distributions)
    except NoAnswer as exc:
        fact["problem"] = f"{path} does not run (or is not a Python): {exc}"
        return fact
    fact.update(found=found.modules[module], version=next((v for v in found.versions.values() if v), None))
    return fact


def _allreduce(dist: Any, torch: Any, device: str, mib: int, world: int) -> dict[str, Any]:  # noqa: ANN401
    """One all-reduce bus bandwidth figure, as nccl-tests counts it: 2(n-1)/n x bytes / time."""
    x = torch.ones(mib * 2**20 // 4, dtype=torch.float32, device=device)
    dist.all_reduce(x)  # warm-up: connections and buffers
    times = []
    for _ in range(3):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(x)
        if device != "cpu":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    seconds = sorted(times)[1]
    nbytes = x.numel() * 4
    return {"bytes": nbytes, "seconds": round(seconds, 4),
            "busbw_gb_s": round(2 * (world - 1) / world * nbytes / seconds / 1e9, 3) if world > 1 else None}


def rank_main(args: argparse.Namespace) -> int:
    """Every rank: facts, then wait for the warning signal; writes rank-<rank>.json."""
    preemption.install(args.signal)  # first: the train job's own handler, before anything slow
    env = os.environ
    paths = _paths(args.probe_dir)
    job = JobEnv.from_environ()  # as the train job's ranks read their place (MASTER_* from the batch script)
    rank, local, world, job_id = job.rank, job.local_rank, job.world_size, job.job_id
    node = env.get("SLURMD_NODENAME") or socket.gethostname()
    from slurmft import __version__

    report: dict[str, Any] = {
        "rank": rank, "local_rank": local, "node": node, "python": sys.executable,
        "python_version": sys.version.split()[0], "slurmft": __version__, "nccl_net_plugin": _nccl_net_plugin(),
        "vars": {k: env.get(k) for k in args.vars.split(",") if k},
        "handler_installed": preemption.installed(args.signal),
    }
    if local == 0:
        report["versions"] = _versions()
        report["run_dir"] = _token_write(Path(args.run_dir), job_id, node, make=False)
        hf_home = Path(env.get("HF_HOME") or Path.home() / ".cache" / "huggingface")
        report["hf_home"] = _token_write(hf_home, job_id, node, make=True)
        report["fi_info_efa"] = _has_efa()
        report["model_jobs"] = {kind: _model_job_python(python, kind) for kind, python in
                                (("serve", args.serve_python), ("eval", args.eval_python)) if python}

    from datetime import timedelta

    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    report["cuda"] = {"available": cuda, "version": torch.version.cuda,
                      "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
                      "devices": torch.cuda.device_count() if cuda else 0}
    addr, port = job.master_addr, str(job.master_port)
    report["master"] = {"addr": addr, "port": port}
    nodes = [node]
    try:
        backend = "nccl" if cuda else "gloo"
        if cuda:
            torch.cuda.set_device(local)
        dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=args.rendezvous_s))
        report["master"]["ok"] = True
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, node)
        nodes = sorted(set(gathered))
        report["allreduce"] = {"backend": backend, "world": world,
                               **_allreduce(dist, torch, f"cuda:{local}" if cuda else "cpu", args.mib, world)}
        dist.barrier()  # every token is written before any node reads
    except Exception as exc:  # noqa: BLE001 - the probe reports what failed, it never dies of it
        report["master"]["ok"] = False
        report["master"]["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        from slurmft import slurm

        with contextlib.suppress(slurm.SlurmCallError):
            nodes = slurm.hostnames(env.get("SLURM_JOB_NODELIST", node))
        time.sleep(5)  # no barrier without a process group: give the other nodes' tokens time to appear
    if local == 0:
        for key in ("run_dir", "hf_home"):
            if "error" not in report[key]:
                _token_read(report[key], job_id, nodes)
    if dist.is_initialized():
        dist.barrier()  # every node has read before anyone removes its token
        dist.destroy_process_group()
        if local == 0:  # without that barrier the tokens stay; the login side removes those it can see

            for key in ("run_dir", "hf_home"):
                ProbePaths.token(Path(report[key]["path"]), job_id, node).unlink(missing_ok=True)

    paths.ready(rank).write_text(node)
    ready_at = time.time()
    batch_seen = 0.0
    while not preemption.requested() and time.time() - ready_at < args.wait_s:
        if paths.batch_signal.exists():
            batch_seen = batch_seen or time.time()
            if time.time() - batch_seen > AFTER_BATCH_S:
                break
        time.sleep(0.2)
    report["signal"] = {"got": preemption.received().removeprefix("SIG") or None,
                        "after_ready_s": round(preemption.received_at() - ready_at, 1) if preemption.requested() else None,
                        "batch_got": paths.batch_signal.exists(), "waited_s": round(time.time() - ready_at, 1)}
    _write(paths.rank_report(rank), report)
    return 0


def tool_main(args: argparse.Namespace) -> int:
    """One task per node where a job after consolidation runs (its own image, or the host): its interpreter's
    facts, written to tool-<kind>-<node>.json."""
    import importlib.util

    from slurmft.config_model_checks import MODEL_JOB_TOOLS

    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    fact = _model_job_python(args.python, args.kind)
    fact["step_python"] = sys.executable  # slurmft's own, which runs the job's entrypoint there
    fact["step_missing"] = [m for m in MODEL_JOB_TOOLS[args.kind].step_needs if importlib.util.find_spec(m) is None]
    _write(_paths(args.probe_dir).tool_report(args.kind, node), fact)
    return 0


def batch_main(args: argparse.Namespace) -> int:
    """The batch shell's side: scontrol from the batch script, then bring the warning signal's time."""
    from slurmft import slurm
    from slurmft.config_values import slurm_time_seconds

    paths = _paths(args.probe_dir)
    job_id = os.environ.get("SLURM_JOB_ID", "")
    world = int(os.environ.get("SLURM_NTASKS", "1"))
    deadline = time.time() + READY_WAIT_S
    while time.time() < deadline and not all(paths.ready(r).exists() for r in range(world)):
        time.sleep(0.5)
    report: dict[str, Any] = {"ready": sum(paths.ready(r).exists() for r in range(world)), "world": world}
    answer = slurm.show_job(job_id, timeout=slurm.BATCH_TIMEOUT_S)
    report["scontrol"] = {"ok": answer.ok, "problem": answer.problem}
    if answer.ok:
        fields = slurm.parse_show(answer.stdout)
        elapsed = slurm_time_seconds(fields.get("RunTime", "0:0"))
        minutes = max((elapsed + args.lead) // 60, elapsed // 60 + 1)
        update = slurm.set_time_limit(job_id, minutes, timeout=slurm.BATCH_TIMEOUT_S)
        report["time_limit"] = {"ok": update.ok, "minutes": minutes, "elapsed_s": elapsed, "problem": update.problem}
    _write(paths.batch_report, report)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slurmft.job.probe", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="side", required=True)
    rank = sub.add_parser("rank")
    rank.add_argument("probe_dir")
    rank.add_argument("--signal", default="USR2")
    rank.add_argument("--run-dir", required=True, help="the directory whose sharing is checked")
    rank.add_argument("--vars", default="", help="comma-separated variables to report")
    rank.add_argument("--mib", type=int, default=64, help="all-reduce size")
    rank.add_argument("--wait-s", type=float, default=SIGNAL_WAIT_S)
    rank.add_argument("--rendezvous-s", type=float, default=60)
    rank.add_argument("--serve-python", help="serve.python: does it find vLLM on the nodes")
    rank.add_argument("--eval-python", help="eval.python: does it find lm-eval on the nodes")
    tool = sub.add_parser("tool")
    tool.add_argument("probe_dir")
    tool.add_argument("--kind", choices=("serve", "eval"), required=True)
    tool.add_argument("--python", required=True, help="serve.python / eval.python as that job would run it")
    batch = sub.add_parser("batch")
    batch.add_argument("probe_dir")
    batch.add_argument("--lead", type=int, required=True, help="the lead time of the run's --signal")
    args = parser.parse_args(argv)
    return {"rank": rank_main, "tool": tool_main, "batch": batch_main}[args.side](args)


if __name__ == "__main__":
    sys.exit(main())
