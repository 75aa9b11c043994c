"""The train side of ``grpo.rollouts: server`` (slurmft/job/grpo_server.py) on this machine, which has no GPU and no
vLLM: the watchdog of ``grpo.server.sync_timeout_s`` around calls that really block (a thread waiting on an Event, and
TRL's own ``VLLMClient.init_communicator`` against a server that accepts the connection and never answers), TRL's
``GRPOConfig`` taking the server's arguments, and the job refusing to start where there is no CUDA device. What
needs a GPU (the NCCL group, a sync, a generation through the server) is the prepared check bench/gpu_grpo_check.sh.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from slurmft.errors import JobSetupError
from slurmft.grpoopts import (
    VLLM_GROUP_PORT_ENV,
    VLLM_HOST_ENV,
    VLLM_PORT_ENV,
    VLLM_SYNC_TIMEOUT_ENV,
    VLLM_TIMEOUT_ENV,
)
from slurmft.job import grpo_server

from .helpers import REPO, launch_like_srun, write_run

ENV = {VLLM_HOST_ENV: "10.1.2.3", VLLM_PORT_ENV: "29617", VLLM_GROUP_PORT_ENV: "29117",
       VLLM_TIMEOUT_ENV: "600", VLLM_SYNC_TIMEOUT_ENV: "900"}


def watchdogs() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("slurmft-watchdog")]


def test_a_blocked_call_ends_in_an_error_that_names_the_call_the_server_and_the_time() -> None:
    """The body blocks on an Event (as a thread inside NCCL does); at the time-out the watchdog reports, here by
    recording the message and releasing the body (the job's own end, fail_job, is the next test)."""
    release, seen = threading.Event(), []

    def expired(message: str) -> None:
        seen.append((time.monotonic(), message))
        release.set()

    started = time.monotonic()
    with grpo_server.deadline("VLLMGeneration.sync_weights (a weight sync)", "http://10.1.2.3:29617", 0.3, expired):
        assert release.wait(30), "the watchdog never fired"
    assert len(seen) == 1
    fired_at, message = seen[0]
    assert fired_at - started >= 0.3
    assert message.startswith("grpo.server.sync_timeout_s: VLLMGeneration.sync_weights (a weight sync) with the "
                              "vLLM server at http://10.1.2.3:29617 did not finish in 0.3 s")
    assert message.endswith("raise grpo.server.sync_timeout_s")
    assert not watchdogs()


def test_a_fast_call_leaves_no_thread_and_no_error_behind() -> None:
    seen: list[str] = []
    before = threading.active_count()
    wrapped = grpo_server.watched("VLLMGeneration.sync_weights", "http://h:1", 0.2, lambda x: x * 2, seen.append)
    assert [wrapped(i) for i in range(3)] == [0, 2, 4]
    assert not watchdogs() and threading.active_count() == before
    time.sleep(0.3)  # past the time-out: nothing fires once the call has returned
    assert seen == []


def test_the_watchdog_ends_the_job_with_exit_2_and_every_stack() -> None:
    """The default end (fail_job): the named error on stderr as the job's errors are written, the stacks of every
    thread (where it hangs), exit 2; the blocked main thread never returns by itself."""
    code = textwrap.dedent("""
        import threading
        from slurmft.job.grpo_server import deadline
        with deadline("VLLMGeneration.sync_weights (a weight sync)", "http://10.1.2.3:29617", 0.5):
            threading.Event().wait(60)
        print("returned")
    """)
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "SLURM_PROCID": "3"})
    assert proc.returncode == 2, proc.stderr
    assert time.monotonic() - started < 30
    assert "returned" not in proc.stdout
    assert ("slurmft rank 3: error: grpo.server.sync_timeout_s: VLLMGeneration.sync_weights (a weight sync) with the "
            "vLLM server at http://10.1.2.3:29617 did not finish in 0.5 s") in proc.stderr
    assert "most recent call first" in proc.stderr and "wait" in proc.stderr  # the stacks, the Event's wait among them


def test_trls_init_communicator_against_a_server_that_never_answers(tmp_path: Path) -> None:
    """TRL's real ``VLLMClient.init_communicator`` under :func:`watch_init`, its server a socket that accepts and
    never replies (a hung server: requests has no time-out there), ends the job naming the call and the server.
    In the same process (one TRL import): TRL 1.16's GRPOConfig takes :func:`server_config`'s arguments, and
    :func:`one_client` hands a second trainer the first one's generation backend, its syncs watched once."""
    code = textwrap.dedent(f"""
        import os, socket
        server = socket.create_server(("127.0.0.1", 0))
        port = server.getsockname()[1]
        os.environ.update({ENV!r})
        os.environ.update({{"{VLLM_HOST_ENV}": "127.0.0.1", "{VLLM_PORT_ENV}": str(port),
                            "{VLLM_SYNC_TIMEOUT_ENV}": "2"}})
        from trl import GRPOConfig
        from trl.generation.vllm_client import VLLMClient
        from slurmft.job import grpo_server
        args = GRPOConfig(output_dir={str(tmp_path)!r}, use_cpu=True, report_to=[],
                          **grpo_server.server_config(dict(os.environ)))
        print("config", args.use_vllm, args.vllm_mode, args.vllm_server_host, args.vllm_server_port,
              args.vllm_group_port, args.vllm_server_timeout, flush=True)
        # one_client: a trainer built again (a checkpoint fallback) gets the first VLLMGeneration, not a second
        # NCCL group; TRL's class needs vLLM to be built, so a stand-in takes its place in TRL's module here
        import trl.trainer.grpo_trainer as grpo_trainer
        class StandIn:
            made = 0
            def __init__(self, **kwargs):
                StandIn.made += 1
                self.sync_weights = lambda: "synced"
        trl_class, grpo_trainer.VLLMGeneration = grpo_trainer.VLLMGeneration, StandIn
        with grpo_server.one_client():
            first, second = grpo_trainer.VLLMGeneration(model=1), grpo_trainer.VLLMGeneration(model=1)
        assert grpo_trainer.VLLMGeneration is StandIn and first is second and StandIn.made == 1
        grpo_trainer.VLLMGeneration = trl_class
        holder = type("Trainer", (), {{"vllm_generation": first}})()
        grpo_server.watch_syncs(holder, dict(os.environ))
        wrapped = first.sync_weights
        grpo_server.watch_syncs(holder, dict(os.environ))  # the second trainer: no second watchdog
        assert first.sync_weights is wrapped and wrapped() == "synced"
        print("one client", flush=True)
        original = VLLMClient.init_communicator
        with grpo_server.watch_init(dict(os.environ)):
            assert VLLMClient.init_communicator.__wrapped__ is original
            import requests
            client = VLLMClient.__new__(VLLMClient)  # as TRL's __init__ leaves it once the server was up
            client.base_url, client.session, client.group_port = f"http://127.0.0.1:{{port}}", requests.Session(), 1
            client.init_communicator(device="cuda:0")
        print("returned")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "config True server 127.0.0.1" in proc.stdout and " 29117 600.0" in proc.stdout, proc.stdout
    assert "one client" in proc.stdout
    assert "returned" not in proc.stdout
    assert ("error: grpo.server.sync_timeout_s: VLLMClient.init_communicator (the weight-sync NCCL group's set-up) "
            "with the vLLM server at http://127.0.0.1:") in proc.stderr, proc.stderr
    assert "did not finish in 2 s" in proc.stderr
    assert "get_server_info" in proc.stderr  # the stack: TRL's request that never came back


def test_server_config_names_what_is_missing() -> None:
    assert grpo_server.server_config(ENV) == {
        "use_vllm": True, "vllm_mode": "server", "vllm_server_host": "10.1.2.3", "vllm_server_port": 29617,
        "vllm_group_port": 29117, "vllm_server_timeout": 600.0}
    with pytest.raises(JobSetupError) as err:
        grpo_server.server_config({k: v for k, v in ENV.items() if k not in (VLLM_HOST_ENV, VLLM_SYNC_TIMEOUT_ENV)})
    assert str(err.value).startswith(f"grpo.rollouts: server: {VLLM_HOST_ENV}, {VLLM_SYNC_TIMEOUT_ENV} not set in "
                                     "the train step")
    with pytest.raises(JobSetupError, match="not a number"):
        grpo_server.server_config({**ENV, VLLM_PORT_ENV: "http"})


def test_the_job_refuses_a_server_run_without_cuda(micro_model: Path, job_env: dict[str, str],
                                                   tmp_path: Path) -> None:
    """The product path: the train entrypoint on one rank with a ``rollouts: server`` run and the batch script's
    variables; without a CUDA device it stops before loading the model, naming why (exit 2), and every other reason
    it would not run (here also the collectives' short time-out of the test's environment)."""
    from .test_grpo_cpu import on_prompts

    def server_run(cfg: dict) -> None:
        on_prompts(cfg)
        cfg["grpo"]["rollouts"] = "server"

    run = write_run(tmp_path / "run", micro_model, ["executor=slurm", "resources.nodes=2", "resources.gpus_per_node=1",
                                                    "resources.tasks_per_node=1", "train.per_device_batch_size=4",
                                                    "train.max_steps=1"], server_run)
    rc, out = launch_like_srun(run, {**job_env, **ENV}, ntasks=1).wait(timeout=300)
    assert rc == 2, out
    assert "grpo.rollouts: server pushes the trained weights to the vLLM server over NCCL" in out, out
    assert "sees no CUDA device; run it on GPU nodes (resources.gpus_per_node > 0)" in out
    # the test's job_env sets SLURMFT_COLLECTIVE_TIMEOUT=120: the server's limits (600 + 900 s) end after it
    assert "(600 + 900 s) must stay under the collectives' time-out (120 s, SLURMFT_COLLECTIVE_TIMEOUT)" in out
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())


def test_each_reason_a_rank_cannot_serve_is_named() -> None:
    import importlib.util

    no_vllm = importlib.util.find_spec("vllm") is None
    found = grpo_server.problems(True, ENV, 1800)
    assert len(found) == int(no_vllm)
    if no_vllm:
        assert found[0].startswith(f"grpo.rollouts: server: vLLM is not importable in the job's Python {sys.executable}")
    found = grpo_server.problems(False, ENV, 1200)
    assert len(found) == 2 + int(no_vllm)
    assert "sees no CUDA device" in found[0] and "(600 + 900 s) must stay under" in found[-1]


def test_the_limits_must_end_before_the_collectives_time_out() -> None:
    """While rank 0 waits for the server and sets up the group, or streams a sync, the other ranks wait in a
    collective: the named error must come before their time-out (600 + 900 < 1800, the defaults)."""
    assert grpo_server.timing_problem(ENV, 1800) is None
    slow = {**ENV, VLLM_SYNC_TIMEOUT_ENV: "1200"}
    problem = grpo_server.timing_problem(slow, 1800)
    assert problem is not None and problem.startswith(
        "grpo.server.timeout_s + grpo.server.sync_timeout_s (600 + 1200 s) must stay under the collectives' time-out "
        "(1800 s, SLURMFT_COLLECTIVE_TIMEOUT)")
    assert grpo_server.problems(True, slow, 1800)[-1] == problem
    assert grpo_server.timing_problem(slow, 3600) is None
