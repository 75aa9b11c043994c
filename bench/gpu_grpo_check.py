"""GPU check of GRPO with vLLM rollouts: a few GRPO steps on the tiny model with TRL's ``colocate`` mode and with
its ``server`` mode started the way slurmft's rendered server step starts it; one JSON and a short text.

    bash bench/gpu_grpo_check.sh [--out DIR] [--steps 3] [--workdir DIR] [--cases colocate,server]

Not run in CI and never run yet: it needs a CUDA GPU (TRL's server mode pushes the weights over NCCL only,
``VLLMClient.init_communicator``) and vLLM in the Python that runs it. The lent GPU machines' image has no vLLM
(bench/gpu_image_packages.txt) and its wheel is far over the 64 MiB a device call carries, so on those machines it
stops at once and says so (exit 2), as it does on a machine without CUDA. What it checks where it can run:

* ``server``: the product's path, as far as one machine without Slurm can run it. ``slurmft validate`` on
  ``examples/tiny/grpo.yaml`` with ``grpo.rollouts=server`` (2 nodes x 1 GPU: one trains, one serves) and
  ``SLURMFT_UNPROVEN_VLLM_SERVER=1`` (validate refuses the server without it: never run on a GPU before this check)
  must pass; the run directory gets the resolved config as ``submit`` writes it; the server is started with the
  rendered server step's command (``python -m slurmft.job.vllm_server --signal=USR2 --`` and
  ``slurmft.plan.grpo_layout.server_arguments``: model, tensor parallel, memory share, dtype, max length), its
  address and time-outs in the variables the batch shell exports (``SLURMFT_VLLM_*``); the trainer is the train
  job's own entrypoint (``python -m slurmft.job.entrypoint train RUN_DIR``) on one rank with the variables srun gives
  a task, so the job builds TRL's ``GRPOConfig`` itself (slurmft/job/grpo_server.py), its weight syncs under the
  watchdog. It needs 2 GPUs: the server on the last one, the trainer on the first (NCCL refuses two ranks of one
  group on one GPU: "Duplicate GPU detected"), so on a one-GPU machine it is skipped, and said. Figures: the
  server's start-up, seconds per step and the rewards from the run's metrics.jsonl, the final checkpoint.
* ``colocate``: TRL's colocate mode (``vllm_gpu_memory_utilization`` 0.3, TRL's default) on the same model and
  prompts: seconds per step and rewards beside the server's.

Each case ends with the losses finite and every step logged (exit 1 names the case that failed). The tiny model is
``python -m slurmft.tiny`` (head_dim 64: vLLM's attention takes it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # slurmft from this checkout

CASES = ("colocate", "server")
GRPO_EXAMPLE = REPO / "examples" / "tiny" / "grpo.yaml"
MAX_LEN = 256


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bash bench/gpu_grpo_check.sh", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("gpu_grpo_check"), help="gpu_grpo_check.json and .txt go here")
    ap.add_argument("--steps", type=int, default=3, help="GRPO steps per case")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/gpu_grpo_check"), help="the tiny model, the runs")
    ap.add_argument("--cases", default=",".join(CASES), help="colocate,server (in this order)")
    ap.add_argument("--server-wait-s", type=int, default=300, help="the server's start-up limit (TRL's timeout)")
    return ap


def missing() -> str | None:
    """Why the check cannot run here (None: it can)."""
    import importlib.util

    for module in ("torch", "trl", "vllm", "datasets"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not importable in {sys.executable}"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device (TRL's vLLM weight sync is NCCL only)"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def reward_length(completions: list[Any], **kwargs: Any) -> list[float]:
    """A verifiable toy reward: shorter completions score higher (enough to move the policy)."""
    return [1.0 / (1 + len(str(c))) for c in completions]


def grpo_args(out: Path, steps: int, extra: dict[str, Any]) -> Any:
    from trl import GRPOConfig

    return GRPOConfig(output_dir=str(out), max_steps=steps, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=32, logging_steps=1, report_to=[], bf16=True, save_strategy="no",
                      seed=42, **extra)


def train(model: Path, out: Path, steps: int, extra: dict[str, Any]) -> dict[str, Any]:
    """``steps`` GRPO steps with ``extra`` GRPOConfig arguments; the logged steps and the time each took."""
    from datasets import Dataset
    from trl import GRPOTrainer

    prompts = Dataset.from_list([{"prompt": f"Count to {i}:"} for i in range(32)])
    started = time.monotonic()
    trainer = GRPOTrainer(model=str(model), reward_funcs=[reward_length], args=grpo_args(out, steps, extra),
                          train_dataset=prompts)
    built = time.monotonic()
    trainer.train()
    done = time.monotonic()
    logs = [r for r in trainer.state.log_history if "loss" in r]
    return {"build_s": built - started, "train_s": done - built, "s_per_step": (done - built) / steps,
            "steps_logged": len(logs), "losses": [r["loss"] for r in logs], "rewards": [r.get("reward") for r in logs]}


def colocate(model: Path, work: Path, steps: int) -> dict[str, Any]:
    # TRL's colocate engine joins torch.distributed (external launcher): one process is rank 0 of 1
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    return train(model, work / "colocate", steps, {"use_vllm": True, "vllm_mode": "colocate",
                                                   "vllm_gpu_memory_utilization": 0.3})


def server_overrides(model: Path, run_dir: Path, steps: int) -> list[str]:
    """``examples/tiny/grpo.yaml`` as a server run here: one training node (GPU 0) + one server node (the last GPU)."""
    return [f"model.name_or_path={model}", f"output_dir={run_dir}", "executor=slurm", "resources.nodes=2",
            "resources.gpus_per_node=1", "resources.tasks_per_node=1", "grpo.rollouts=server",
            "grpo.server.gpu_memory_utilization=0.3", f"train.max_steps={steps}", "train.per_device_batch_size=4",
            f"checkpoint.every_steps={steps}", "prepare.enabled=false", f"data.max_seq_length={MAX_LEN}"]


def validate(overrides: list[str], work: Path) -> None:
    """``slurmft validate`` as a user runs it, with the unproven server let through (the only thing set by hand)."""
    from slurmft.grpoopts import UNPROVEN_SERVER_ENV

    env = {**os.environ, UNPROVEN_SERVER_ENV: "1", "PYTHONPATH": str(REPO)}
    cli = [sys.executable, "-c", "import sys; from slurmft.cli import main; sys.exit(main())"]
    done = subprocess.run([*cli, "validate", str(GRPO_EXAMPLE), *overrides], env=env, capture_output=True, text=True,
                          cwd=work)
    if done.returncode != 0:
        raise RuntimeError(f"slurmft validate refused the server run: {(done.stdout + done.stderr).strip()[-2000:]}")


def wait_for(url: str, wait_s: int, proc: subprocess.Popen[bytes]) -> float:
    """Seconds until ``url`` answers (the server's /health), or a RuntimeError after ``wait_s`` or its exit."""
    import urllib.request

    started = time.monotonic()
    while time.monotonic() - started < wait_s:
        if proc.poll() is not None:
            raise RuntimeError(f"the vLLM server exited ({proc.returncode}) before it answered")
        try:
            with urllib.request.urlopen(url, timeout=5):
                return time.monotonic() - started
        except OSError:
            time.sleep(2)
    raise RuntimeError(f"the vLLM server did not answer {url} in {wait_s} s")


def server(model: Path, work: Path, steps: int, wait_s: int) -> dict[str, Any]:
    from slurmft import grpoopts
    from slurmft.config_loading import dump_config, load_config
    from slurmft.plan.grpo_layout import server_arguments, server_env, server_layout
    from slurmft.rundir import RunPaths

    paths = RunPaths.of(work / "server-run")
    overrides = server_overrides(model, paths.root, steps)
    validate(overrides, work)
    cfg = load_config(GRPO_EXAMPLE, overrides)
    layout = server_layout(cfg)
    assert layout is not None
    paths.root.mkdir(parents=True, exist_ok=True)
    paths.config.write_text(dump_config(cfg))  # what submit writes; the job reads it back
    port = free_port()
    import torch

    last = torch.cuda.device_count() - 1  # the server's GPU; the trainer takes GPU 0 (NCCL: one rank per GPU)
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           grpoopts.VLLM_HOST_ENV: "127.0.0.1", grpoopts.VLLM_PORT_ENV: str(port),
           grpoopts.VLLM_GROUP_PORT_ENV: str(free_port()), **server_env(cfg)}
    env[grpoopts.VLLM_TIMEOUT_ENV] = str(wait_s)  # the trainer's wait for the server, as the check's option says
    rank = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
            "SLURM_STEP_NUM_NODES": "1", "SLURM_JOB_NUM_NODES": "1", "SLURM_NTASKS_PER_NODE": "1",
            "SLURM_JOB_ID": str(os.getpid()), "SLURM_RESTART_COUNT": "0", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port())}
    with (work / "server.log").open("w") as server_log, (work / "train.log").open("w") as train_log:
        command = [sys.executable, "-m", "slurmft.job.vllm_server", "--signal=USR2", "--",
                   *server_arguments(cfg, layout)]
        proc = subprocess.Popen(command, env={**env, "CUDA_VISIBLE_DEVICES": str(last)}, stdout=server_log,
                                stderr=subprocess.STDOUT)
        try:
            up = wait_for(f"http://127.0.0.1:{port}/health", wait_s, proc)
            begun, begun_wall = time.monotonic(), time.time()
            job = subprocess.run([sys.executable, "-m", "slurmft.job.entrypoint", "train", str(paths.root)],
                                 env={**env, **rank, "CUDA_VISIBLE_DEVICES": "0"}, stdout=train_log, stderr=subprocess.STDOUT,
                                 timeout=wait_s + 60 * steps + 600)
            train_s = time.monotonic() - begun
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    if job.returncode != 0:
        raise RuntimeError(f"the train job exited {job.returncode}: {(work / 'train.log').read_text()[-3000:]}")
    logs = [r for r in map(json.loads, paths.metrics.read_text().splitlines()) if r.get("loss") is not None]
    times = [float(r["time"]) for r in logs if isinstance(r.get("time"), (int, float))]
    # build_s: the job's start to its first logged step (the stack's imports, the model, the NCCL group, step 1)
    return {"server_start_s": up, "build_s": times[0] - begun_wall if times else train_s, "train_s": train_s,
            "s_per_step": (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else train_s / max(1, steps),
            "steps_logged": len(logs), "losses": [r["loss"] for r in logs], "rewards": [r.get("reward") for r in logs],
            "final_checkpoint": (paths.checkpoints / f"checkpoint-{steps}" / "COMPLETE").is_file()}


def check(name: str, r: dict[str, Any], steps: int) -> list[str]:
    problems = []
    if r.get("steps_logged") != steps:
        problems.append(f"{name}: {r.get('steps_logged')} of {steps} steps logged")
    if not all(isinstance(x, float) and math.isfinite(x) for x in r.get("losses", [])):
        problems.append(f"{name}: a loss is not finite: {r.get('losses')}")
    if r.get("final_checkpoint") is False:
        problems.append(f"{name}: no complete checkpoint-{steps}")
    return problems


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    why = missing()
    if why:
        print(f"gpu_grpo_check: cannot run here: {why}", file=sys.stderr)
        (args.out / "gpu_grpo_check.json").write_text(json.dumps({"skipped": why}, indent=2))
        return 2
    import torch

    args.workdir.mkdir(parents=True, exist_ok=True)
    model = args.workdir / "model"
    if not (model / "config.json").exists():
        subprocess.run([sys.executable, "-m", "slurmft.tiny", str(model)], check=True, cwd=REPO)
    import trl
    import vllm

    report: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                              "trl": trl.__version__, "vllm": vllm.__version__, "cases": {}}
    problems: list[str] = []
    for name in args.cases.split(","):
        if name == "server" and torch.cuda.device_count() < 2:
            report["cases"][name] = {"skipped": f"server mode needs 2 GPUs (NCCL: one rank per GPU), this machine has "
                                                f"{torch.cuda.device_count()}"}
            continue
        try:
            r = (colocate(model, args.workdir, args.steps) if name == "colocate"
                 else server(model, args.workdir, args.steps, args.server_wait_s))
        except Exception as err:  # noqa: BLE001 - a case that fails is reported, the next one still runs
            r = {"error": f"{type(err).__name__}: {err}"}
            problems.append(f"{name}: {r['error']}")
        else:
            problems += check(name, r, args.steps)
        report["cases"][name] = r
        (args.out / "gpu_grpo_check.json").write_text(json.dumps(report, indent=2))
    lines = [f"{report['device']} torch {report['torch']} trl {report['trl']} vllm {report['vllm']}"]
    for name, r in report["cases"].items():
        if "skipped" in r:
            lines.append(f"{name}: SKIPPED ({r['skipped']})")
            continue
        lines.append(f"{name}: " + (r["error"] if "error" in r else
                     f"{r['s_per_step']:.2f} s/step, built in {r['build_s']:.1f} s"
                     + (f", server up in {r['server_start_s']:.1f} s" if "server_start_s" in r else "")
                     + f", rewards {r['rewards']}"))
    lines += [f"FAILED {p}" for p in problems]
    (args.out / "gpu_grpo_check.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
