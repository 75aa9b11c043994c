"""The local two-node Slurm cluster does what slurmft's tests rely on (docs/design-notes.md)."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from slurmft import slurm
from slurmft.plan.doctor import check_requeue_delay

pytestmark = pytest.mark.slurm

ALL_GPUS = "0,1,2,3,4,5,6,7"


def wait_reason(cluster, job_id: str, reason: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while (seen := cluster.squeue_reason(job_id)) != reason:
        assert time.monotonic() < deadline, (
            f"job {job_id} pending reason {seen!r}, expected {reason!r}\n{cluster.describe(job_id)}"
        )
        time.sleep(0.2)


def test_two_nodes_with_eight_gpus_each(slurm_cluster):
    """The default partition ``debug``, where every test's jobs run unless they name another, is n1 and n2; the
    partition ``wide`` adds n3-n5 for the layouts that need more nodes (tests/slurm/test_grpo_layout.py)."""
    out = slurm_cluster.slurm("sinfo", "-h", "-N", "-o", "%N %P %c %m %G")
    assert sorted(out.splitlines()) == sorted(
        [f"{node} debug* 32 128000 gpu:8" for node in ("n1", "n2")]
        + [f"{node} wide 32 128000 gpu:8" for node in ("n1", "n2", "n3", "n4", "n5")]), out


def test_srun_reaches_both_nodes(slurm_cluster, tmp_path):
    out = tmp_path / "tasks.out"
    job = slurm_cluster.sbatch(
        "-N2", "--ntasks-per-node=2", "-o", str(out),
        "--wrap", "srun bash -c 'echo $SLURM_PROCID $SLURMD_NODENAME'",
    )  # fmt: skip
    slurm_cluster.wait_state(job, "COMPLETED", timeout=30)
    tasks = [line.split() for line in out.read_text().splitlines()]
    assert sorted(int(rank) for rank, _ in tasks) == [0, 1, 2, 3], tasks
    assert Counter(node for _, node in tasks) == {"n1": 2, "n2": 2}, tasks


def test_gpus_per_node_sets_cuda_visible_devices(slurm_cluster, tmp_path):
    out = tmp_path / "gpus.out"
    job = slurm_cluster.sbatch(
        "-N2", "--ntasks-per-node=1", "--gpus-per-node=8", "-o", str(out),
        "--wrap", "srun bash -c 'echo $SLURMD_NODENAME $CUDA_VISIBLE_DEVICES'",
    )  # fmt: skip
    slurm_cluster.wait_state(job, "COMPLETED", timeout=30)
    seen = dict(line.split() for line in out.read_text().splitlines())
    assert seen == {"n1": ALL_GPUS, "n2": ALL_GPUS}


def test_afterok_waits_for_dependency_then_runs(slurm_cluster, tmp_path):
    first = slurm_cluster.sbatch("-N1", "-o", "/dev/null", "--wrap", "sleep 3")
    out = tmp_path / "second.out"
    second = slurm_cluster.sbatch(
        "-N1", "-o", str(out), f"--dependency=afterok:{first}", "--wrap", "echo second ran"
    )
    wait_reason(slurm_cluster, second, "Dependency")
    assert slurm_cluster.squeue_state(second) == "PENDING"
    slurm_cluster.wait_state(first, "COMPLETED", timeout=30)
    slurm_cluster.wait_state(second, "COMPLETED", timeout=30)
    assert out.read_text() == "second ran\n"


def test_afterok_of_failed_job_is_never_satisfied(slurm_cluster, tmp_path):
    failing = slurm_cluster.sbatch("-N1", "-o", "/dev/null", "--wrap", "exit 3")
    dependent = slurm_cluster.sbatch(
        "-N1", "-o", str(tmp_path / "never.out"), f"--dependency=afterok:{failing}", "--wrap", "true"
    )
    slurm_cluster.wait_state(failing, "FAILED", timeout=30)
    wait_reason(slurm_cluster, dependent, "DependencyNeverSatisfied")
    assert slurm_cluster.squeue_state(dependent) == "PENDING"
    slurm_cluster.slurm("scancel", dependent)
    slurm_cluster.wait_state(dependent, "CANCELLED", timeout=30)
    assert not (tmp_path / "never.out").exists()


@pytest.mark.every_slurm
def test_requeue_keeps_job_id_and_bumps_restart_count(slurm_cluster, tmp_path):
    out = tmp_path / "requeue.out"
    # The first run waits to be requeued; the second one finishes at once.
    job = slurm_cluster.sbatch(
        "-N2", "--requeue", "--open-mode=append", "-o", str(out),
        "--wrap", 'echo "job=$SLURM_JOB_ID restart=${SLURM_RESTART_COUNT:-0}"; '
                  '[ "${SLURM_RESTART_COUNT:-0}" -gt 0 ] || sleep 120',
    )  # fmt: skip
    slurm_cluster.wait_state(job, "RUNNING", timeout=30)
    deadline = time.monotonic() + 20
    while not (out.exists() and "restart=0" in out.read_text()):
        assert time.monotonic() < deadline, f"the first run printed nothing\n{slurm_cluster.describe(job)}"
        time.sleep(0.2)
    # A requeued job waits before it may start again: cred_expire (10 s here) up to 25.05, requeue_delay
    # from 25.11 on; `slurmft doctor` reads whichever the live cluster's configuration has.
    [line] = check_requeue_delay(slurm.cluster_facts(None))
    assert line.text.startswith("a requeued attempt waits 10 s before it may start again (AuthInfo cred_expire)")
    slurm_cluster.slurm("scontrol", "requeue", job)
    slurm_cluster.wait_state(job, "COMPLETED", timeout=45)
    # slurmstepd also writes "*** JOB N ON n1 CANCELLED ... DUE TO JOB REQUEUE ***" there
    runs = [line for line in out.read_text().splitlines() if line.startswith("job=")]
    assert runs == [f"job={job} restart=0", f"job={job} restart=1"], out.read_text()
    assert "Restarts=1" in slurm_cluster.slurm("scontrol", "show", "job", job)


def test_sacct_reports_completed(slurm_cluster):
    job = slurm_cluster.sbatch("-N1", "-o", "/dev/null", "--wrap", "true")
    slurm_cluster.wait_state(job, "COMPLETED", timeout=30)
    assert slurm_cluster.wait_state(job, "COMPLETED", timeout=15, via="sacct") == "COMPLETED"
    exit_code = slurm_cluster.slurm("sacct", "-n", "-X", "-P", "-j", job, "-o", "ExitCode").strip()
    assert exit_code == "0:0"
