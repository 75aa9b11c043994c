"""`slurmft resume` / `slurmft consolidate` without a cluster: the pure decisions, the manifest, the lock,
and the refusals that must leave everything untouched. The real endings are in tests/slurm/test_slurm_resume.py
and tests/test_resume_local.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_runner import cli

from slurmft.checkpoints import mark_complete, saved_world_size
from slurmft.errors import ConfigError, RunDirError
from slurmft.rundir import RunPaths, acquire_lock, new_manifest, release_lock, write_manifest
from slurmft.slurm_states import words
from slurmft.submit.resume import (
    Phase,
    check_overrides,
    classify,
    ended_how,
    model_ready,
)
from slurmft.watch.status import describe

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "tiny" / "run.yaml"




# ------------------------------------------------------------------ pure decisions
@pytest.mark.parametrize(
    ("live", "step", "ready", "phase"),
    [
        (["7"], 10, False, Phase.LIVE),
        (["7"], 40, True, Phase.LIVE),  # a live train job wins, whatever the disk says
        ([], 40, True, Phase.FINISHED),
        ([], 50, True, Phase.FINISHED),
        ([], 40, False, Phase.TRAINED),
        ([], 39, True, Phase.RESUMABLE),
        ([], None, False, Phase.RESUMABLE),  # no checkpoint: starts again at step 0
    ],
)
def test_classify(live: list[str], step: int | None, ready: bool, phase: Phase) -> None:
    assert classify(live, step, 40, ready) == phase


@pytest.mark.parametrize(
    ("state", "code", "words"),
    [
        ("FAILED", "3:0", "requeue budget (preemption.max_requeues) was used up"),
        ("FAILED", "1:0", "failed (exit code 1)"),
        ("FAILED", "0:9", "failed (signal 9)"),
        ("CANCELLED", "0:15", "cancelled (scancel)"),
        ("TIMEOUT", "0:0", "hit its time limit"),
        ("NODE_FAIL", "0:0", "a node failed"),
        ("OUT_OF_MEMORY", "0:125", "ran out of memory"),
        ("KILLED", "", "killed"),
    ],
)
def test_ended_how(state: str, code: str, words: str) -> None:
    assert words in ended_how(state, code)


@pytest.mark.parametrize("key", ["cluster.time=01:00:00", "cluster.partition=gpu", "preemption.max_requeues=5",
                                 "consolidate.dtype=bfloat16", "checkpoint.keep_last=3",
                                 "resources.cpus_per_task=4", "resources.mem=100G", "resources.exclusive=false",
                                 "resources.nodes=4", "resources.tasks_per_node=2", "resources.gpus_per_node=4",
                                 "train.gradient_accumulation_steps=2", "train.per_device_batch_size=1",
                                 # issue 47: how often and how a save is written, and how often a step is logged,
                                 # change nothing the training computes (the async-failure message names them)
                                 "checkpoint.async=false", "checkpoint.every_steps=50", "checkpoint.max_failed_saves=10",
                                 "train.logging_steps=10"])
def test_allowed_overrides(key: str) -> None:
    check_overrides([key])


def test_a_refused_key_that_changes_no_math_is_refused_with_its_own_reason() -> None:
    with pytest.raises(ConfigError) as info:
        check_overrides(["output_dir=/elsewhere", "train.report_to=[wandb]", "train.seed=3"])
    text = str(info.value)
    assert "train.seed: it would change what the resumed training computes" in text
    assert "output_dir: the run directory is the run" in text and "output_dir: it would change" not in text
    assert "train.report_to: the trackers' packages are checked" in text


def test_forbidden_overrides_are_all_named_with_the_allowed_list() -> None:
    with pytest.raises(ConfigError) as info:
        check_overrides(["cluster.time=01:00:00", "train.learning_rate=1", "model.name_or_path=x", "seed=1"])
    text = info.value.render()
    assert "train.learning_rate, model.name_or_path, seed" in text
    assert "another model cannot continue them" in text
    assert "cluster.*" in text and "checkpoint.keep_last" in text and "resources.exclusive" in text
    assert "cluster.time" not in str(info.value)  # the allowed one is not blamed


def test_model_ready_needs_a_model_newer_than_the_final_checkpoint(tmp_path: Path) -> None:
    paths = RunPaths.of(tmp_path)
    ckpt = paths.checkpoints / "checkpoint-40"
    ckpt.mkdir(parents=True)
    mark_complete(ckpt, step=40, world_size=2)
    assert not model_ready(paths, ckpt)
    paths.model.mkdir()
    index = paths.model / "model.safetensors.index.json"
    index.write_text("{}")
    os.utime(index, (1, 1))  # a model older than the checkpoint was exported from an earlier one
    assert not model_ready(paths, ckpt)
    os.utime(index, None)
    assert model_ready(paths, ckpt)
    assert saved_world_size(ckpt) == 2


def test_words_point_to_resume_and_consolidate() -> None:
    never = describe("PENDING", "DependencyNeverSatisfied", "/runs/x", "consolidate")
    assert "slurmft resume /runs/x" in never and "submit again" not in never
    assert "slurmft resume /runs/x" in describe("CANCELLED", "", "/runs/x", "train", newest_train=True)
    assert "later `slurmft resume`" in describe("FAILED", "", "/runs/x", "train", newest_train=False)
    assert "slurmft consolidate /runs/x" in describe("FAILED", "", "/runs/x", "consolidate")
    # the log to read: `slurmft logs RUN_DIR` alone shows the train job's, not the failed consolidation's
    assert "(see `slurmft logs /runs/x --job consolidate`)" in describe("FAILED", "", "/runs/x", "consolidate")
    assert "(see `slurmft logs /runs/x`)" in describe("FAILED", "", "/runs/x", "train", newest_train=True)
    assert describe("FAILED", "", "/runs/x", "prepare").count("slurmft logs") == 1
    # redone since (`slurmft consolidate` after the failure): the failed one no longer says to redo it
    redone = describe("FAILED", "", "/runs/x", "consolidate", job_id="8", superseded=True)
    assert "redo it" not in redone and "a later consolidate job of the run follows it" in redone
    # and its log is the one named: `--job consolidate` shows the newest consolidation's (tests/test_runs_logs.py
    # runs the command named); the same for an older train, serve, eval or prepare job
    assert "(see `slurmft logs /runs/x --job-id 8`)" in redone and "--job consolidate" not in redone
    for kind in ("train", "serve", "eval", "prepare"):
        older = describe("FAILED", "", "/runs/x", kind, job_id="8", superseded=True)
        assert older.count("slurmft logs") == 1 and "(see `slurmft logs /runs/x --job-id 8`)" in older, older
        assert "slurmft resume" not in older or "a later `slurmft resume`" in older, older
    assert "a later prepare job of the run follows it" in describe("FAILED", "", "/runs/x", "prepare", superseded=True)
    assert "resume" not in describe("COMPLETED", "", "/runs/x", "train", newest_train=True)
    # a reason only explains a pending job: a cancelled one that slurmctld still lists keeps its state
    assert describe("CANCELLED", "DependencyNeverSatisfied", "/runs/x", "consolidate").startswith("cancelled")


def test_a_pending_job_names_the_job_it_waits_on() -> None:
    # each job waits on the one before it: serve and eval on the consolidation (they said "the train job")
    waits = {kind: describe("PENDING", "Dependency", "/runs/x", kind) for kind in ("train", "consolidate", "serve", "eval")}
    assert waits == {"train": "waiting for the prepare job to finish successfully",
                     "consolidate": "waiting for the train job to finish successfully",
                     "serve": "waiting for the consolidation job to finish successfully",
                     "eval": "waiting for the consolidation job to finish successfully"}
    for kind in ("serve", "eval"):
        failed = describe("FAILED", "", "/runs/x", kind)  # its log named once, with the job kind (it was said twice)
        assert failed.count("slurmft logs") == 1 and f"`slurmft logs /runs/x --job {kind}`" in failed, failed
        never = describe("PENDING", "DependencyNeverSatisfied", "/runs/x", kind)
        assert "the consolidation job did not succeed" in never and f"`slurmft {kind} /runs/x`" in never, never
        assert "train job" not in never


def test_words_of_a_suspended_or_held_job_say_what_continues_it() -> None:
    words = describe("SUSPENDED", "None", "/runs/x", "train", newest_train=True, job_id="7")
    assert words.startswith("suspended") and "`scontrol resume 7`" in words and "`slurmft cancel /runs/x`" in words
    assert "slurmft resume" not in words  # it is not dead: nothing to resume
    assert "`scontrol release 7`" in describe("REQUEUE_HOLD", "", "/runs/x", "train", True, "7")
    assert describe("TIMEOUT", "", "/runs/x", "consolidate").startswith("hit its time limit")


# ------------------------------------------------------------------ resume beside a live train job
def _slurm_run(tmp_path: Path) -> RunPaths:
    """A Slurm run directory with train job 7 and its consolidation 8, a complete checkpoint-6 of 12 steps."""
    from slurmft.config_loading import dump_config, load_config

    paths = RunPaths.of(tmp_path / "run")
    cfg = load_config(EXAMPLE, [f"output_dir={paths.root}", "train.max_steps=12", "checkpoint.every_steps=6"])
    paths.root.mkdir()
    paths.config.write_text(dump_config(cfg))
    manifest = new_manifest("tiny", "slurm", paths.run_id)
    manifest["jobs"] += [{"kind": "train", "job_id": "7", "attempt": 1},
                         {"kind": "consolidate", "job_id": "8", "attempt": 1, "dependency": "afterok:7"}]
    write_manifest(paths, manifest)
    ckpt = paths.checkpoints / "checkpoint-6"
    ckpt.mkdir(parents=True)
    mark_complete(ckpt, step=6, world_size=2)
    return paths


def _squeue_says(monkeypatch: pytest.MonkeyPatch, train_state: str | None) -> list[list[str]]:
    """squeue answers with train job 7 in ``train_state`` (None: squeue does not answer); every other Slurm
    command (scancel, sbatch...) is recorded and fails."""
    from slurmft import slurm

    calls: list[list[str]] = []

    def squeue(user: str | None = None) -> dict | None:
        if train_state is None:
            return None
        row = {"reason": "None", "elapsed": "0:10", "restarts": "0", "name": "tiny", "comment": ""}
        return {"7": {**row, "job_id": "7", "state": train_state},
                "8": {**row, "job_id": "8", "state": "PENDING", "reason": "Dependency"}}

    def call(args: list[str], timeout: float = 0) -> slurm.Answer:
        calls.append(args)
        return slurm.Answer(False, problem="not in this test")

    monkeypatch.setattr(slurm, "squeue_jobs", squeue)
    monkeypatch.setattr(slurm, "sacct_jobs", lambda ids: {})
    monkeypatch.setattr(slurm, "call", call)
    monkeypatch.setattr(slurm, "available", lambda cmd: True)
    return calls


@pytest.mark.parametrize("state", ["SUSPENDED", "CONFIGURING", "REQUEUE_HOLD", "STAGE_OUT", "SPECIAL_EXIT",
                                   "FROBNICATED"])
def test_resume_refuses_beside_a_live_train_job_and_submits_nothing(
        state: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    paths = _slurm_run(tmp_path)
    calls = _squeue_says(monkeypatch, state)
    before = paths.manifest.read_text()
    code, _, err = cli(["resume", str(paths.root)], capsys)
    assert code == 2 and "train job(s) 7 still queued or running" in err and "nothing submitted" in err
    assert f"Job 7: {words(state)}" in err.replace("\n", " ")
    assert calls == [] and paths.manifest.read_text() == before  # no scancel of 8, no sbatch, nothing recorded


def test_resume_refuses_when_squeue_does_not_answer(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    paths = _slurm_run(tmp_path)
    calls = _squeue_says(monkeypatch, None)
    before = paths.manifest.read_text()
    code, _, err = cli(["resume", str(paths.root)], capsys)
    assert code == 2 and "squeue did not answer" in err and "train job(s) 7" in err and "nothing is submitted" in err
    assert calls == [] and paths.manifest.read_text() == before


def test_cancel_cancels_a_suspended_train_job(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from slurmft import slurm

    paths = _slurm_run(tmp_path)
    calls = _squeue_says(monkeypatch, "SUSPENDED")
    monkeypatch.setattr(slurm, "call", lambda args, timeout=0: calls.append(args) or slurm.Answer(True, code=0))
    code, out, err = cli(["cancel", str(paths.root)], capsys)
    assert code == 0, err
    assert calls == [["scancel", "7", "8"]]


# ------------------------------------------------------------------ a run a team shares
def test_a_job_slurm_hides_in_a_teammates_run_is_cannot_tell_and_resume_submits_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from slurmft.rundir import read_manifest

    paths = _slurm_run(tmp_path)
    manifest = read_manifest(paths)
    manifest["owner"] = {"uid": 4242, "user": "ann"}
    write_manifest(paths, manifest)
    calls = _squeue_says(monkeypatch, "RUNNING")
    asked: list = []
    from slurmft import slurm

    monkeypatch.setattr(slurm, "squeue_jobs", lambda: asked.append(True) or {})  # PrivateData=jobs
    monkeypatch.setattr(os, "getuid", lambda: 1000)  # we are a teammate, not root (root sees every job)
    before = paths.manifest.read_text()
    code, out, err = cli(["status", str(paths.root)], capsys)
    assert code == 0 and asked == [True]  # one squeue: every job we may see (no user: slurm.squeue_args)
    assert "cannot tell" in out and "PrivateData=jobs" in out and "ask ann" in out
    code, _, err = cli(["resume", str(paths.root)], capsys)
    assert code == 2 and "ann's run" in err and "--force" in err
    code, _, err = cli(["resume", str(paths.root), "--force"], capsys)
    assert code == 2 and "cannot tell whether" in err and "nothing is submitted" in err
    assert calls == [] and paths.manifest.read_text() == before
    code, out, err = cli(["cancel", str(paths.root), "--force"], capsys)  # Slurm decides: tried, refused, said
    assert code == 0 and "not cancelled: train job 7 is ann's (submitted by ann)" in err and "no live jobs" in out
    assert calls == [["scancel", "7"], ["scancel", "8"]] and paths.manifest.read_text() == before


def _teammates_train_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[RunPaths, list[list[str]]]:
    """Ann's run (we are ann, uid 1000): her train job 7 was cancelled, then bob's `resume --force` submitted train
    job 9 and consolidation 10 under his uid. Slurm (PrivateData=jobs) shows ann none of bob's jobs; sacct has her 7.
    Every other Slurm call (scancel, sbatch) is recorded and refused."""
    from slurmft import slurm
    from slurmft.rundir import read_manifest

    paths = _slurm_run(tmp_path)
    manifest = read_manifest(paths)
    manifest["owner"] = {"uid": 1000, "user": "ann"}
    bob = {"uid": 1001, "user": "bob"}
    manifest["jobs"][1]["submitter"] = {"uid": 1000, "user": "ann"}
    manifest["jobs"] += [{"kind": "train", "job_id": "9", "attempt": 2, "submitter": bob},
                         {"kind": "consolidate", "job_id": "10", "attempt": 2, "dependency": "afterok:9",
                          "submitter": bob}]
    write_manifest(paths, manifest)
    calls: list[list[str]] = []

    def call(args: list[str], timeout: float = 0) -> slurm.Answer:
        calls.append(args)
        return slurm.Answer(False, problem="Access/permission denied", code=1)

    monkeypatch.setattr(slurm, "squeue_jobs", lambda *_: {})  # PrivateData=jobs: none of bob's
    monkeypatch.setattr(slurm, "sacct_jobs", lambda ids: {"7": {"state": "CANCELLED", "elapsed": "0:10",
                                                                "exit_code": "0:15", "start": "x", "end": "y"}})
    monkeypatch.setattr(slurm, "call", call)
    monkeypatch.setattr(slurm, "available", lambda cmd: True)
    monkeypatch.setattr(os, "getuid", lambda: 1000)  # we are ann, the owner (not root: root sees every job)
    return paths, calls


def test_the_owner_never_takes_a_teammates_train_job_it_cannot_see_for_ended(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 47, defects 1 and 2: the owner's status, resume, prepare and consolidate judge bob's job by who
    submitted it (the manifest records it), and cancel tries it, then says whose it is."""
    paths, calls = _teammates_train_job(tmp_path, monkeypatch)
    before = paths.manifest.read_text()
    code, out, err = cli(["status", str(paths.root), "--json"], capsys)
    assert code == 0, err
    rows = {r["job_id"]: r for r in json.loads(out)["jobs"]}
    assert rows["7"]["state"] == "CANCELLED"
    assert rows["9"]["state"] == "HIDDEN" and "bob submitted it" in rows["9"]["words"], rows["9"]
    assert rows["9"]["submitter"] == {"uid": 1001, "user": "bob"}
    for command in (["resume"], ["prepare"], ["consolidate"]):
        code, _, err = cli([*command, str(paths.root)], capsys)
        assert code == 2 and "cannot tell whether" in err and "nothing is submitted" in err, (command, err)
        assert "train job 9" in err and "bob" in err, (command, err)
    assert calls == [] and paths.manifest.read_text() == before  # nothing submitted, nothing recorded
    code, out, err = cli(["cancel", str(paths.root)], capsys)
    assert code == 0, err
    assert calls == [["scancel", "9"], ["scancel", "10"]]  # each tried on its own: Slurm decides
    assert "not cancelled: train job 9 is bob's (submitted by bob)" in err and "Access/permission denied" in err
    assert "consolidate job 10 is bob's" in err and "no live jobs to cancel" in out


def test_prepare_and_consolidate_refuse_while_squeue_does_not_answer(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 47, defect 2: `slurmft prepare RUN_DIR` had its own, weaker liveness (no squeue-answered check, no
    HIDDEN); prepare and consolidate ask the run's one now, as resume does."""
    paths = _slurm_run(tmp_path)
    calls = _squeue_says(monkeypatch, None)
    before = paths.manifest.read_text()
    for command in (["resume"], ["prepare"], ["consolidate"], ["prepare", "--here"], ["consolidate", "--here"]):
        code, _, err = cli([*command[:1], str(paths.root), *command[1:]], capsys)
        assert code == 2 and "squeue did not answer" in err and "nothing is submitted" in err, (command, err)
    assert calls == [] and paths.manifest.read_text() == before and not paths.prepared.exists()


def test_a_pid_on_another_host_is_never_killed(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import signal

    from slurmft.rundir import new_manifest

    paths = RunPaths.of(tmp_path / "run")
    paths.root.mkdir()
    manifest = new_manifest("tiny", "local", paths.run_id)
    manifest["jobs"].append({"kind": "train", "job_id": str(os.getpid()), "attempt": 1, "pid": os.getpid(),
                             "host": "login-9"})  # our pid, but recorded on another host
    write_manifest(paths, manifest)
    killed: list = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: killed.append((pid, sig)) if sig == signal.SIGTERM else None)
    code, out, err = cli(["cancel", str(paths.root)], capsys)
    assert code == 0 and killed == []
    assert "not cancelled: train job" in err and "unknown (running on login-9?)" in err
    code, out, _ = cli(["status", str(paths.root)], capsys)
    assert "unknown (running on login-9?)" in out


def test_two_resumes_at_once_wait_for_the_lock_and_read_the_state_there(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The second resume waits for the first's lock, then decides from what the first left (here: live)."""
    import threading

    from slurmft.submit import resume as resume_mod

    paths = _slurm_run(tmp_path)
    _squeue_says(monkeypatch, "RUNNING")
    acquire_lock(paths, "resume")
    done: list = []

    def second() -> None:
        try:
            resume_mod.resume_run(paths.root)
        except RunDirError as exc:
            done.append(str(exc))

    t = threading.Thread(target=second)
    t.start()
    time.sleep(0.5)
    assert t.is_alive()  # waiting for the lock, not refusing at once
    release_lock(paths)
    t.join(30)
    assert done and "is live" in done[0]


# ------------------------------------------------------------------ the lock
def test_stale_lock_of_a_dead_process_here_is_cleared(tmp_path: Path) -> None:
    paths = RunPaths.of(tmp_path)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    paths.lock.write_text(f"{socket.gethostname()} pid={dead.stdout.strip()} t=0 submit\n")
    said: list[str] = []
    acquire_lock(paths, "resume", said.append)
    assert said and "stale lock" in said[0] and dead.stdout.strip() in said[0]
    holder = json.loads(paths.lock.read_text())  # who holds it: uid, user, host, pid (and its start time)
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname() and holder["uid"] == os.getuid()
    release_lock(paths)
    assert not paths.lock.exists()


def test_lock_of_a_live_process_or_another_host_is_refused_with_the_owner(tmp_path: Path) -> None:
    paths = RunPaths.of(tmp_path)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        paths.lock.write_text(f"{socket.gethostname()} pid={live.pid} t=0 submit\n")
        with pytest.raises(RunDirError, match=f"pid {live.pid} on host {socket.gethostname()}"):
            acquire_lock(paths, "resume")
    finally:
        live.kill()
        live.wait()
    paths.lock.write_text("login-node-7 pid=4242 t=0 submit\n")
    with pytest.raises(RunDirError) as info:
        acquire_lock(paths, "resume")
    assert "pid 4242 on host login-node-7" in str(info.value) and f"remove {paths.lock}" in str(info.value)
    assert paths.lock.read_text().startswith("login-node-7")  # never taken from another host


# ------------------------------------------------------------------ refusals through the CLI
def test_resume_of_a_directory_that_is_not_a_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(["resume", str(tmp_path)], capsys)
    assert code == 2 and "not a slurmft run directory" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []
    code, _, err = cli(["resume", str(tmp_path / "nope")], capsys)
    assert code == 2 and "does not exist" in err


def _finished_local_run(tmp_path: Path, step: int, model: bool) -> RunPaths:
    """A local run directory as submit leaves it, trained to ``step``, with or without a model."""
    from slurmft.config_loading import dump_config, load_config

    paths = RunPaths.of(tmp_path / "run")
    cfg = load_config(EXAMPLE, [f"output_dir={paths.root}", "train.max_steps=12", "checkpoint.every_steps=6"])
    paths.root.mkdir()
    paths.config.write_text(dump_config(cfg))
    manifest = new_manifest("tiny", "local", paths.run_id)
    manifest["jobs"].append({"kind": "train", "job_id": "1", "attempt": 1, "pid": 1, "state": "COMPLETED"})
    write_manifest(paths, manifest)
    ckpt = paths.checkpoints / f"checkpoint-{step}"
    ckpt.mkdir(parents=True)
    mark_complete(ckpt, step=step, world_size=2)
    if model:
        paths.model.mkdir()
        (paths.model / "model.safetensors.index.json").write_text("{}")
    return paths


def test_resume_of_a_finished_run_says_where_the_model_is(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    paths = _finished_local_run(tmp_path, 12, model=True)
    before = paths.manifest.read_text()
    code, out, _ = cli(["resume", str(paths.root)], capsys)
    assert code == 0 and "is finished" in out and f"model: {paths.model}" in out
    assert paths.manifest.read_text() == before  # nothing recorded, nothing submitted


def test_resume_of_a_trained_but_unconsolidated_run_points_to_consolidate(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    paths = _finished_local_run(tmp_path, 12, model=False)
    code, _, err = cli(["resume", str(paths.root)], capsys)
    assert code == 2 and f"slurmft consolidate {paths.root}" in err


def test_forbidden_override_submits_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    paths = _finished_local_run(tmp_path, 6, model=False)
    before = paths.manifest.read_text(), paths.config.read_text()
    code, _, err = cli(["resume", str(paths.root), "train.max_steps=100"], capsys)
    assert code == 2 and err.splitlines()[0].startswith("error: resume cannot change train.max_steps")
    assert (paths.manifest.read_text(), paths.config.read_text()) == before


def test_a_world_size_that_cannot_keep_the_global_batch_is_refused_before_submitting(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    paths = _finished_local_run(tmp_path, 6, model=False)  # 1 node x 2 ranks x 2 sequences: a global batch of 4
    before = paths.manifest.read_text(), paths.config.read_text()
    code, _, err = cli(["resume", str(paths.root), "resources.tasks_per_node=3"], capsys)
    assert code == 2, err
    assert err.splitlines()[0] == ("error: resources: 3 ranks cannot keep the global batch of 4 sequences per "
                                   "optimizer step that the checkpoint was trained with (resources.nodes x ranks per "
                                   "node must divide it, so that every step trains on the same sequences)")
    assert "choose a world size among 1, 2, 4 ranks" in err
    assert (paths.manifest.read_text(), paths.config.read_text()) == before  # nothing recorded, nothing submitted
    assert not paths.script("train").exists()  # nothing rendered either


def test_the_checkpoints_own_record_decides_the_global_batch(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    paths = _finished_local_run(tmp_path, 6, model=False)
    marker = paths.checkpoints / "checkpoint-6" / "COMPLETE"  # saved by 4 ranks x 1 x 2: a global batch of 8
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "world_size": 4, "per_device_batch_size": 1,
                                  "gradient_accumulation_steps": 2, "global_batch": 8}))
    before = paths.manifest.read_text()
    code, _, err = cli(["resume", str(paths.root), "resources.tasks_per_node=3"], capsys)
    assert code == 2 and "3 ranks cannot keep the global batch of 8" in err and "among 1, 2, 4, 8 ranks" in err
    assert paths.manifest.read_text() == before


def test_an_explicit_batch_override_that_changes_the_global_batch_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    paths = _finished_local_run(tmp_path, 6, model=False)
    before = paths.manifest.read_text(), paths.config.read_text()
    code, _, err = cli(["resume", str(paths.root), "train.gradient_accumulation_steps=2"], capsys)
    assert code == 2
    assert err.splitlines()[0].startswith("error: train: the overrides ask for a global batch of 8 sequences per "
                                          "step (2 ranks x 2 x 2 accumulation), but the checkpoint was trained "
                                          "with 4 (2 ranks x 2 x 1 accumulation)")
    assert "slurmft recomputes them for the new allocation" in err
    assert (paths.manifest.read_text(), paths.config.read_text()) == before


def test_a_lora_resume_with_another_rank_is_refused_before_submitting(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    paths = _finished_local_run(tmp_path, 6, model=False)
    before = paths.manifest.read_text(), paths.config.read_text()
    code, _, err = cli(["resume", str(paths.root), "resources.tasks_per_node=1", "lora.r=16"], capsys)
    assert code == 2
    assert err.splitlines()[0].startswith("error: resume cannot change lora.r: it would change what the resumed "
                                          "training computes")
    assert "a resume on another allocation reshards them, it cannot change them" in err
    assert (paths.manifest.read_text(), paths.config.read_text()) == before


def test_consolidate_refuses_a_torn_or_missing_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    paths = _finished_local_run(tmp_path, 6, model=False)
    (paths.checkpoints / "checkpoint-9").mkdir()  # a save that never finished
    code, _, err = cli(["consolidate", str(paths.root), "--checkpoint", "checkpoint-9"], capsys)
    assert code == 2 and "no COMPLETE marker" in err and "checkpoint-6" in err
    code, _, err = cli(["consolidate", str(paths.root), "--checkpoint", "checkpoint-99"], capsys)
    assert code == 2 and "no such checkpoint" in err
    paths.model.write_text("not a directory")
    code, _, err = cli(["consolidate", str(paths.root)], capsys)
    assert code == 2 and "is not a directory" in err


def test_submit_into_an_ended_run_names_the_one_command_that_applies(tmp_path: Path) -> None:
    """A second submit into a finished run said "To continue it ...: slurmft resume RUN", which then said "nothing to
    resume"; a run stopped short of max_steps is the one `resume` continues, a trained one without a model is
    `consolidate`'s."""
    from runfixture import local_run, write_checkpoint

    from slurmft.rundir import MODEL_INDEX
    from slurmft.submit.dispatch import check_run_dir_free

    run = local_run(tmp_path, "ended", state="CANCELLED", steps=36)
    paths = RunPaths.of(run)

    def refusal() -> str:
        with pytest.raises(RunDirError) as err:
            check_run_dir_free(paths)
        return err.value.render()

    assert f"a run that stopped before its first complete checkpoint: `slurmft resume {run}`" in refusal()
    write_checkpoint(run, 20, complete=True)
    assert f"a run that stopped at step 20 of 36: `slurmft resume {run}` continues it" in refusal()
    write_checkpoint(run, 36, complete=True)
    assert f"trained to step 36) without its model: `slurmft consolidate {run}`" in refusal()
    (paths.model).mkdir()
    (paths.model / MODEL_INDEX).write_text("{}")
    text = refusal()
    assert "already holds a finished run (trained to step 36 and consolidated)" in text and "resume" not in text
    assert "another output_dir" in text
    # a name to use as it is, not the placeholder `output_dir=runs/NAME-2`
    assert f"(e.g. output_dir={run.parent / (run.name + '-2')})" in text, text
    (run.parent / (run.name + "-2")).mkdir()
    assert f"(e.g. output_dir={run.parent / (run.name + '-3')})" in refusal()
