"""slurmft/job/podman_task.py: each podman task's own options, decided on the host from the task's environment
(issue 47, defect 3). The real run is tests/slurm/test_lora.py's podman run: a token exported before submit and the
GPUs Slurm gave the job, seen from inside the image."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from slurmft.job.podman_task import GPU_KIND, NO_GPUS_EXIT, UnknownGpus, passed_names, step_gpus, task_options

TASK = {"PATH": "/usr/bin", "HOME": "/home/ann", "PYTHONPATH": "/home/ann/lib", "LD_LIBRARY_PATH": "/opt/x",
        "HF_TOKEN": "hf_secret", "WANDB_MODE": "offline", "FROM_SETUP": "1", "SLURM_PROCID": "3",
        "BASH_FUNC_module%%": "() { :; }", "LMOD_CMD": "/lmod", "CUDA_VISIBLE_DEVICES": "0,1", "TMPDIR": "/scratch/j"}


def test_the_users_variables_go_in_by_name_and_the_hosts_own_stay_out() -> None:
    names = passed_names(TASK)
    assert {"HF_TOKEN", "WANDB_MODE", "FROM_SETUP", "SLURM_PROCID"} <= set(names)
    assert not {"PATH", "HOME", "PYTHONPATH", "LD_LIBRARY_PATH", "BASH_FUNC_module%%", "LMOD_CMD", "TMPDIR",
                "CUDA_VISIBLE_DEVICES"} & set(names)
    options = task_options(TASK, None)
    assert "--env=HF_TOKEN" in options and not any("hf_secret" in o for o in options)  # a name, never the value
    assert not any(o.startswith("--device") for o in options)  # a CPU step: no GPU at all


@pytest.mark.parametrize(("env", "ids"), [
    ({"SLURM_STEP_GPUS": "2,3"}, ["2", "3"]),
    ({"SLURM_STEP_GPUS": "4-6", "SLURM_JOB_GPUS": "0"}, ["4", "5", "6"]),
    ({"SLURM_JOB_GPUS": "0,1", "SLURM_JOB_NUM_NODES": "1"}, ["0", "1"]),  # one node: the batch node's are ours
    ({"SLURM_JOB_GPUS": "0,1", "SLURM_JOB_NUM_NODES": "2"}, None),  # another node's ids may differ
    ({}, None),
])
def test_the_steps_gpus_on_this_node(env: dict[str, str], ids: list[str] | None) -> None:
    assert step_gpus(env) == ids


def test_a_rank_gets_the_gpus_slurm_gave_it_and_no_other() -> None:
    options = task_options({**TASK, "SLURM_STEP_GPUS": "2,3"}, "shared")
    assert [o for o in options if o.startswith("--device")] == [f"--device={GPU_KIND}=2", f"--device={GPU_KIND}=3"]
    assert options[-1] == "--env=CUDA_VISIBLE_DEVICES=0,1"  # counted in the container, where only those exist
    with pytest.raises(UnknownGpus):
        task_options({**TASK, "SLURM_JOB_GPUS": "0,1", "SLURM_JOB_NUM_NODES": "2"}, "shared")
    # the job has its nodes to itself: every GPU of the node is its own
    assert task_options({**TASK, "SLURM_JOB_NUM_NODES": "2"}, "exclusive")[-1] == f"--device={GPU_KIND}=all"


def _run(tmp_path: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m slurmft.job.podman_task ARGS`` with a ``podman`` first on PATH that prints its argv and the
    HF_TOKEN it got: the exec is real."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "podman").write_text('#!/bin/sh\nprintf "%s\\n" "$@"; echo "token=${HF_TOKEN:-}"\n')
    (fake / "podman").chmod(0o755)
    return subprocess.run([sys.executable, "-m", "slurmft.job.podman_task", *args], capture_output=True, text=True,
                          env={**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", **env}, timeout=60)


def test_the_task_execs_podman_with_its_options_after_run(tmp_path: Path) -> None:
    out = _run(tmp_path, {"HF_TOKEN": "hf_secret", "SLURM_STEP_GPUS": "1"}, "--signal=USR2", "--gpus=shared",
               "podman", "run", "--rm", "img:1", "python", "-c", "pass")
    assert out.returncode == 0, out.stderr
    argv = out.stdout.splitlines()
    assert argv[0] == "run" and argv[-5:] == ["img:1", "python", "-c", "pass", "token=hf_secret"]
    assert "--env=HF_TOKEN" in argv and f"--device={GPU_KIND}=1" in argv and "--env=CUDA_VISIBLE_DEVICES=0" in argv
    assert argv.index("--env=HF_TOKEN") < argv.index("--rm")  # the task's options go right after `run`
    refused = _run(tmp_path, {"SLURM_JOB_NUM_NODES": "2", "SLURM_PROCID": "5", "SLURM_STEP_GPUS": ""},
                   "--gpus=shared", "podman", "run", "img:1")
    assert refused.returncode == NO_GPUS_EXIT and refused.stdout == ""  # podman never started
    assert "task 5" in refused.stderr and "cannot tell which GPUs" in refused.stderr
