"""`slurmft runs` and `slurmft logs --rank/--attempt` on realistic run directories (tests/runfixture.py).

How many times `runs` and `status` ask the real Slurm is counted in tests/slurm/test_watching.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from runfixture import local_run, preempted_run

from slurmft.cli import main
from slurmft.errors import RunDirError
from slurmft.watch.logs import log_attempts, log_files, rank_lines, select_lines, split_attempts
from slurmft.watch.runs import find_runs, run_lines, run_word


def test_find_runs_searches_a_few_levels_and_skips_run_internals(tmp_path: Path) -> None:
    a = preempted_run(tmp_path / "proj" / "exp1", "a")
    b = local_run(tmp_path / "proj", "b")
    local_run(a / "checkpoints", "hidden")  # never searched inside a run
    local_run(a / "evals", "nested")
    local_run(tmp_path / "x" / "y" / "z", "too-deep")  # depth 4
    (tmp_path / "proj" / ".cache").mkdir()
    local_run(tmp_path / "proj" / ".cache", "dot")
    assert find_runs(tmp_path) == [b, a]  # sorted by path: proj/b before proj/exp1/a
    assert find_runs(a) == [a]


def test_run_word() -> None:
    def jobs(train: str, cons: str | None = None, reason: str = "") -> list[dict[str, str]]:
        out = [{"kind": "train", "state": train, "reason": ""}]
        return out + ([{"kind": "consolidate", "state": cons, "reason": reason}] if cons else [])

    assert run_word(jobs("RUNNING", "PENDING", "Dependency"), False) == "training"
    assert run_word(jobs("PENDING", "PENDING"), False) == "queued"
    assert run_word(jobs("REQUEUED"), False) == "requeued"
    assert run_word(jobs("COMPLETED", "RUNNING"), False) == "consolidating"
    assert run_word(jobs("FAILED", "PENDING", "DependencyNeverSatisfied"), False) == "stuck"
    assert run_word(jobs("COMPLETED", "COMPLETED"), True) == "done"
    assert run_word(jobs("CANCELLED", "CANCELLED"), False) == "cancelled"
    assert run_word(jobs("UNKNOWN", "UNKNOWN"), True) == "done"  # Slurm forgot, the model is there
    # every live state of slurmft.slurm_states counts, not only RUNNING/PENDING
    assert run_word(jobs("SUSPENDED", "PENDING", "Dependency"), False) == "suspended"
    assert run_word(jobs("CONFIGURING", "PENDING", "Dependency"), False) == "starting"
    assert run_word(jobs("REQUEUE_HOLD", "PENDING", "Dependency"), False) == "held"
    assert run_word(jobs("STAGE_OUT", "PENDING", "Dependency"), False) == "training"
    assert run_word(jobs("FROBNICATED", "PENDING", "Dependency"), False) == "training"  # unknown: live
    assert run_word(jobs("COMPLETED", "SUSPENDED"), False) == "consolidation suspended"
    assert run_word([], False) == "not started"  # a sweep's point its local sweep never reached (was "unknown")
    prepare = [{"kind": "prepare", "state": "COMPLETED", "reason": ""}]
    assert run_word(prepare, False) == "prepared"  # `slurmft prepare run.yaml`: no train job yet (was "unknown")
    assert run_word([{**prepare[0], "state": "KILLED"}], False) == "prepare killed"
    # after consolidation: which check runs or failed (was "checking model" / "done (a check failed)" for both)
    checked = jobs("COMPLETED", "COMPLETED")
    assert run_word([*checked, {"kind": "eval", "state": "RUNNING", "reason": ""}], True) == "evaluating"
    assert run_word([*checked, {"kind": "serve", "state": "PENDING", "reason": ""}], True) == "serve check"
    assert run_word([*checked, {"kind": "serve", "state": "COMPLETED", "reason": ""},
                     {"kind": "eval", "state": "FAILED", "reason": ""}], True) == "done (the evaluation failed)"
    assert run_word([*checked, {"kind": "serve", "state": "FAILED", "reason": ""},
                     {"kind": "eval", "state": "COMPLETED", "reason": ""}], True) == "done (the serve check failed)"


def test_runs_without_an_answer_from_slurm_still_lists_every_run(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    preempted_run(root, "a")
    preempted_run(root, "b")
    local_run(root, "c")
    (root / "d").mkdir()
    (root / "d" / "manifest.json").write_text("{torn")
    data = run_lines(root, query=lambda ids: {})  # Slurm unreachable: still a line per run
    assert [r["state"] for r in data] == ["unknown", "unknown", "trained", "broken"]


def test_runs_on_an_empty_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main(["runs", str(tmp_path)])
    assert "no run directories" in capsys.readouterr().out


LABELLED = """\
[slurmft] job=100 restart=0 nodes=n[1-2] master=10.0.0.1:20100
0: [slurmft rank0 12:00:00] step 1/36  loss 2.9500
 1: rank one warns
0: [slurmft rank0 12:00:01] step 2/36  loss 2.9000
[slurmft] 12:00:02 requeueing job 100 (restart 0 -> 1)
[slurmft] job=100 restart=1 nodes=n[1-2] master=10.0.0.1:20100
0: [slurmft rank0 12:01:00] resuming from checkpoint-2
1: rank one again
"""


def test_split_attempts_and_rank_lines() -> None:
    parts = split_attempts(LABELLED.splitlines(), "100")
    assert [(p.job_id, p.restart, p.nodes, len(p.lines)) for p in parts] == [("100", 0, "n[1-2]", 5),
                                                                          ("100", 1, "n[1-2]", 3)]
    assert rank_lines(parts[0].lines, 1) == [parts[0].lines[0], " 1: rank one warns"]
    assert all("loss" not in line for line in rank_lines(LABELLED.splitlines(), 1))
    assert split_attempts(["no header here"], "7")[0].restart is None  # an old log: one attempt


def test_logs_rank_and_attempt(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = preempted_run(tmp_path)
    (run / "logs" / "train-100.out").write_text(LABELLED)
    assert [(a.job_id, a.restart) for a in log_attempts(run)] == [("100", 0), ("100", 1)]
    main(["logs", str(run), "--attempt", "2"])
    out = capsys.readouterr().out
    assert "==> attempt 2: job 100 restart 1 <==" in out and "resuming from checkpoint-2" in out
    assert "step 1/36" not in out
    main(["logs", str(run), "--rank", "1"])
    out = capsys.readouterr().out
    assert "rank one warns" in out and "rank one again" in out and "loss" not in out
    main(["logs", str(run), "--rank", "0", "--attempt", "1"])
    out = capsys.readouterr().out
    assert "step 2/36" in out and "rank one" not in out and "resuming" not in out
    with pytest.raises(RunDirError, match="the run has 2 train attempt"):
        select_lines(run, attempt=3)
    with pytest.raises(SystemExit):
        main(["logs", str(run), "--rank", "0", "-f"])
    assert "-f cannot be combined" in capsys.readouterr().err


def test_logs_rank_of_a_local_run_reads_that_rank_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = local_run(tmp_path)
    main(["logs", str(run), "--rank", "1"])
    out = capsys.readouterr().out
    assert "slurmft rank 1: completed" in out and "rank 1 stderr" in out and "rank 0" not in out
    with pytest.raises(RunDirError, match="ran 2 rank"):
        select_lines(run, rank=2)


@pytest.mark.parametrize(("kind", "why"), [("eval", "no eval: section"), ("serve", "no serve: section"),
                                           ("consolidate", "consolidate.enabled was false"),
                                           ("prepare", "prepare.enabled was false")])
def test_logs_of_a_job_the_run_never_had_says_why_for_that_kind(kind: str, why: str, tmp_path: Path) -> None:
    """Each kind's own reason, in both ways logs reads (newest job, --rank/--attempt), not 'was consolidation
    disabled?' for every kind."""
    run = local_run(tmp_path)
    for read in (lambda: log_files(run, kind), lambda: log_attempts(run, kind)):
        with pytest.raises(RunDirError, match=f"has no {kind} job .*{why}"):
            read()


def test_logs_follow_ends_when_the_job_has_ended(tmp_path: Path) -> None:
    """`logs -f` of a finished job printed its log and then waited for ever (first-run.md's smoke test ends with it);
    now it says what became of the job and returns. While the job lives it keeps following."""
    import json
    import subprocess
    import sys
    import threading

    from slurmft.watch.logs import ended_words, tail

    done = local_run(tmp_path, "done", state="COMPLETED")
    cmd = [sys.executable, "-c", "from slurmft.cli import main; main()", "logs", str(done), "-f"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout
    assert "slurmft rank 0: completed at step 12" in out
    assert out.splitlines()[-1].startswith("[slurmft logs] train job 4242 has ended: completed")
    assert "next:" not in out.splitlines()[-1]  # nothing after it

    with subprocess.Popen(["sleep", "60"]) as later:  # its consolidation still runs: -f names where to look next
        manifest = json.loads((done / "manifest.json").read_text())
        manifest["jobs"].append({**manifest["jobs"][0], "kind": "consolidate", "job_id": "4243", "pid": later.pid,
                                 "state": None})
        (done / "manifest.json").write_text(json.dumps(manifest))
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout
        later.kill()
    assert f"; next: consolidate job 4243, running: `slurmft logs {done} --job consolidate -f`" in out.splitlines()[-1]

    run = local_run(tmp_path, "live")
    with subprocess.Popen(["sleep", "60"]) as job:
        manifest = json.loads((run / "manifest.json").read_text())
        manifest["jobs"][0].update(pid=job.pid, state=None)  # a local run still training: its process is alive
        (run / "manifest.json").write_text(json.dumps(manifest))
        seen: list[str] = []
        follower = threading.Thread(target=tail, args=(log_files(run, "train"), 5, True, seen.append,
                                                       ended_words(run, "train"), 0.2), daemon=True)
        follower.start()
        with open(log_files(run, "train")[0], "a") as f:
            f.write("step 13\n")
        for _ in range(100):
            if "step 13" in seen:
                break
            follower.join(0.1)
        assert "step 13" in seen and follower.is_alive()  # alive job: still following
        job.kill()
    follower.join(30)
    assert not follower.is_alive()
    assert seen[-1].startswith("[slurmft logs] train job 4242 has ended: ended without recording a state (killed")


def _consolidated_twice(root: Path) -> Path:
    """A local run whose first consolidation failed and whose `slurmft consolidate RUN_DIR` then succeeded: two
    consolidate jobs in the manifest, each with its submitit logs (stdout, and the stderr beside it)."""
    import json

    run = local_run(root, "twice")
    manifest = json.loads((run / "manifest.json").read_text())
    for jid, state, said in (("5001", "FAILED", "OSError: [Errno 28] No space left on device"),
                             ("5002", "COMPLETED", "wrote model/ (2 shards)")):
        out = run / "submitit" / f"{jid}_0_log.out"
        out.write_text(f"consolidate {jid} stdout\n")
        out.with_suffix(".err").write_text(f"[slurmft consolidate {jid}] {said}\n")
        manifest["jobs"].append({"kind": "consolidate", "job_id": jid, "attempt": len(manifest["jobs"]),
                                 "submitted": 0.0, "pid": int(jid), "state": state, "logs": [str(out)]})
    (run / "manifest.json").write_text(json.dumps(manifest))
    return run


def test_logs_job_id_shows_an_older_job_that_status_points_at(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """`logs --job consolidate` shows the newest consolidation only; the first, failed one was out of reach, and
    status told the user to read it with that very command. Status now names its id, and the command it names shows
    that job's log (followed with -f: it has ended, so -f returns with what became of it)."""
    import shlex

    from slurmft.rundir import RunPaths
    from slurmft.watch.status import run_state

    run = _consolidated_twice(tmp_path)
    main(["logs", str(run), "--job", "consolidate"])
    assert "[slurmft consolidate 5002] wrote model/" in capsys.readouterr().out  # the newest, as before
    words = {r["job_id"]: r["words"] for r in run_state(RunPaths.of(run), adopt=False).rows}
    assert f"(see `slurmft logs {run} --job-id 5001`)" in words["5001"], words["5001"]
    assert "a later consolidate job of the run follows it" in words["5001"]
    shown = words["5001"].split("(see `")[1].split("`")[0]
    main(shlex.split(shown)[1:])
    out = capsys.readouterr().out
    assert "No space left on device" in out and "consolidate 5001 stdout" in out and "5002" not in out
    main([*shlex.split(shown)[1:], "-f"])
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("[slurmft logs] consolidate job 5001 has ended: failed"), last
    main(["logs", str(run), "--job-id", "5001", "--rank", "0"])  # the other options apply to that job
    assert "No space left on device" in capsys.readouterr().out
    main(["logs", str(run), "--job", "consolidate", "--job-id", "5001"])  # a --job that agrees is no mistake
    assert "No space left on device" in capsys.readouterr().out


def test_logs_job_id_that_the_run_does_not_have_names_the_ids_it_has(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    run = _consolidated_twice(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["logs", str(run), "--job-id", "5003"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert "Invalid value for '--job-id'" in err and "no job 5003; its jobs: train 4242; consolidate 5001, 5002" in err
    with pytest.raises(SystemExit) as exit_:  # --job of another kind than the id's: which did the user mean?
        main(["logs", str(run), "--job", "train", "--job-id", "5001"])
    assert exit_.value.code == 2 and "job 5001 is the run's consolidate job" in capsys.readouterr().err


def test_logs_job_id_keeps_the_run_wide_attempt_numbers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A Slurm run (one log per job, cut at each restart): --job-id shows one job's attempts under the numbers
    --attempt counts them by across the run, and --attempt of another job's attempt is refused naming the job's."""
    import json

    run = preempted_run(tmp_path)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["jobs"].append({"kind": "train", "job_id": "104", "attempt": 2, "submitted": 0.0})  # a resume
    (run / "manifest.json").write_text(json.dumps(manifest))
    (run / "logs" / "train-104.out").write_text("[slurmft] job=104 restart=0 nodes=n3 master=127.0.0.1:20100\n"
                                                "0: resumed from checkpoint-36\n")
    main(["logs", str(run), "--job-id", "104"])
    assert capsys.readouterr().out.splitlines() == ["[slurmft] job=104 restart=0 nodes=n3 master=127.0.0.1:20100",
                                                    "0: resumed from checkpoint-36"]
    main(["logs", str(run), "--job-id", "104", "--rank", "0"])
    assert capsys.readouterr().out.splitlines()[0] == "==> attempt 4: job 104 restart 0 <=="
    main(["logs", str(run), "--job-id", "100", "--attempt", "2"])
    out = capsys.readouterr().out
    assert "==> attempt 2: job 100 restart 1 <==" in out and "resumed" not in out
    with pytest.raises(RunDirError, match=r"--attempt 2: the run has 4 train attempt\(s\) in its logs \(job 104's: "
                                          r"attempt 4\)"):
        select_lines(run, attempt=2, job_id="104")


def test_logs_of_a_job_run_in_a_terminal_says_where_its_output_went(tmp_path: Path) -> None:
    """`slurmft consolidate --here` records a job without a log file: logs said KeyError: 'log'."""
    import json

    run = preempted_run(tmp_path)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["jobs"].append({"kind": "consolidate", "job_id": "here-7-8", "attempt": 2, "here": True, "pid": 7,
                             "state": "FAILED"})
    (run / "manifest.json").write_text(json.dumps(manifest))
    for read in (lambda: log_files(run, "consolidate"), lambda: log_files(run, "train", "here-7-8")):
        with pytest.raises(RunDirError, match="ran in the terminal that started it .`slurmft consolidate --here`."):
            read()
    assert "ran in the terminal" in select_lines(run, "consolidate", attempt=2)[-1]


def test_status_says_a_local_prepare_arrays_tasks_as_tasks_not_attempts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The local executor runs a prepare array (``prepare.tasks: 2``, examples/tiny/text.yaml) as one local job per
    task, each recorded as slurmft/submit/arrays.py records it. ``status`` once showed the second task as the prepare
    job's attempt 2 (a retry, to a reader); a later preparation (a resume's) is the prepare job's attempt 2."""
    from slurmft.rundir import RunPaths, read_manifest, record_job, write_manifest

    run = local_run(tmp_path)
    paths = RunPaths.of(run)
    manifest = read_manifest(paths)
    manifest["jobs"] = []
    for k, job_id in enumerate(("100", "101")):  # as run_local_array records them
        record_job(manifest, "prepare", job_id, task=k, tasks=2, state="COMPLETED", elapsed_s=5.0)
    record_job(manifest, "train", "4242", state="COMPLETED", pid=4242, elapsed_s=17.0)
    again = record_job(manifest, "prepare", "102", state="COMPLETED", elapsed_s=5.0)
    write_manifest(paths, manifest)
    assert [j["attempt"] for j in manifest["jobs"]] == [1, 1, 1, 2] and again["attempt"] == 2
    main(["status", str(run)])
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("│")]
    cells = [[c.strip() for c in line.strip("│").split("│")][:3] for line in table]
    assert cells[:2] == [["prepare 1/2", "100", "1"], ["prepare 2/2", "101", "1"]], table
    assert ["prepare", "102", "2"] in cells, table


def test_status_says_how_long_a_running_local_job_has_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A local job's elapsed time is written when it ends; while it runs, status said nothing in the elapsed column
    (seen on examples/tiny/text.yaml's train job): now the time since it started. This process stands in for it."""
    import json
    import os
    import time

    from slurmft.rundir import RunPaths, process_record, read_manifest, write_manifest

    run = local_run(tmp_path)
    paths = RunPaths.of(run)
    manifest = read_manifest(paths)
    job = manifest["jobs"][0]
    job.pop("state")
    job.update(process_record(os.getpid()), submitted=time.time() - 125)
    write_manifest(paths, manifest)
    main(["status", str(run), "--json"])
    row = json.loads(capsys.readouterr().out)["jobs"][0]
    assert row["state"] == "RUNNING" and row["elapsed"] in ("2m05s", "2m06s", "2m07s"), row


def test_logs_of_a_job_run_with_here_say_it_kept_no_log_file(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """`slurmft logs RUN_DIR --job eval` after `slurmft eval RUN_DIR --here` (and --job consolidate after
    `consolidate --here`) died with a KeyError traceback: such a job printed to its terminal and recorded no log
    file. Said now, exit 2; --rank and --attempt show the same words as that attempt's."""
    from cli_runner import cli

    from slurmft.rundir import RunPaths, read_manifest, record_job, write_manifest

    run = local_run(tmp_path)
    paths = RunPaths.of(run)
    manifest = read_manifest(paths)
    record_job(manifest, "eval", "here-1-2", here=True, state="COMPLETED")
    write_manifest(paths, manifest)
    said = (f"eval job here-1-2 of {run} ran in the terminal that started it (`slurmft eval --here`), which keeps "
            "no log file")
    for extra in ([], ["-f"]):
        code, out, err = cli(["logs", str(run), "--job", "eval", *extra], capsys)
        assert code == 2 and "Traceback" not in err, (extra, err)
        assert said in err, (extra, err)
    for extra in (["--rank", "0"], ["--attempt", "1"]):  # a snapshot of the attempts: this one's is these words
        code, out, err = cli(["logs", str(run), "--job", "eval", *extra], capsys)
        assert code == 0 and said in out and "Traceback" not in err, (extra, out, err)
    code, out, err = cli(["logs", str(run), "--job", "train", "--attempt", "1"], capsys)
    assert code == 0 and "rank 1: completed" in out, err


def test_status_of_a_local_prepare_shows_its_progress_from_the_err_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A local prepare job's datasets progress bars go to submitit's ``<id>_0_log.err`` (its stderr), and status
    read only the ``.out``: `preparing (job J): starting` for the whole preparation. This process stands in for the
    live job; the bar is one datasets writes."""
    import json
    import os
    import time

    from slurmft.rundir import RunPaths, process_record, read_manifest, record_job, write_manifest

    run = local_run(tmp_path)
    paths = RunPaths.of(run)
    manifest = read_manifest(paths)
    manifest["jobs"] = []
    out = run / "submitit" / "77_0_log.out"
    out.write_text("submitit INFO - Starting\n")
    out.with_suffix(".err").write_text(
        "[slurmft prepare 12:00:00] loaded 809 conversations\n"
        "Tokenizing train dataset (num_proc=1):  49%|████▉     | 400/809 [00:10<00:10, 40.10 examples/s]\r")
    record_job(manifest, "prepare", "77", **process_record(os.getpid()), submitted=time.time(), logs=[str(out)])
    write_manifest(paths, manifest)
    main(["status", str(run), "--json"])
    running = json.loads(capsys.readouterr().out)["prepared"]["running"]
    assert running == {"job_id": "77", "progress": "Tokenizing train dataset (num_proc=1): 400/809 rows, "
                                                   "40.10 examples/s, ETA 00:10"}, running


def test_every_run_word_is_in_the_docs() -> None:
    """`slurmft runs` showed `checking model` (a serve check or evaluation running) and `done (a check failed)`,
    words docs/watching.md's list of states did not have (now `evaluating`, `serve check`, `done (the evaluation
    failed)`...): every fixed word run_word returns is listed there."""
    import ast
    import inspect

    from slurmft.watch import runs

    tree = ast.parse(inspect.getsource(runs.run_word))
    returned = [n.value for n in ast.walk(tree) if isinstance(n, ast.Return)]  # a word, or `a if ... else b`
    said = {v.value for r in returned for v in ([r.body, r.orelse] if isinstance(r, ast.IfExp) else [r])
            if isinstance(v, ast.Constant)}
    said |= set(runs.TRAIN_WORD.values()) | {runs.NOT_STARTED}
    assert {"evaluating", "serve check", "done (the evaluation failed)", "done (the serve check failed)", "stuck",
            "queued"} <= said
    docs = (Path(__file__).parents[1] / "docs" / "watching.md").read_text()
    assert [w for w in sorted(said) if f"`{w}`" not in docs] == []


def test_the_help_names_every_kind_of_job_logs_shows() -> None:
    """`slurmft logs --help` said "the newest train (or consolidation, or prepare) job", and `slurmft --help`'s summary
    "submit train + consolidation jobs", on a run whose serve check and evaluation `--job serve|eval` shows."""
    from slurmft.cli import cli, logs

    kinds = next(p for p in logs.params if p.name == "kind").type.choices
    assert {"serve", "eval"} <= set(kinds)
    first = (logs.help or "").split("\n\n")[0]
    assert [k for k in kinds if k not in first] == [], first
    summary = cli.help or ""
    assert "slurmft logs RUN_DIR" in summary and "slurmft cancel RUN_DIR" in summary
    assert "(-> serve, eval)" in summary and "slurmft serve|eval RUN_DIR" in summary


def test_logs_of_a_job_without_a_log_yet_says_what_it_waits_for(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """`slurmft logs RUN_DIR -f` on a train job queued behind its prepare job said "(no log yet: ... — the job may
    still be pending)" and then nothing for as long as it waited: it now says what status says of the job."""
    from slurmft.watch.logs import job_now

    run = local_run(tmp_path, state="PENDING")
    for f in (run / "submitit").glob("4242_*"):
        f.unlink()
    assert job_now(run, "train")() == "train job 4242: waiting in the queue"
    main(["logs", str(run)])
    out = capsys.readouterr().out
    assert f"(no log yet: {run / 'submitit' / '4242_0_log.out'} — train job 4242: waiting in the queue)" in out, out


def test_a_result_a_newer_job_replaces_is_kept(tmp_path: Path) -> None:
    """`slurmft eval RUN_DIR eval.limit=4 eval.compare_base=false` replaced eval/summary.json, the run's whole
    evaluation (and its base comparison) with it: the evaluation and the serve check keep the file they replace."""
    import os

    from slurmft.job import evaluate, serve_check
    from slurmft.rundir import keep_previous

    summary = tmp_path / "eval" / "summary.json"
    assert keep_previous(summary) is None
    summary.parent.mkdir()
    summary.write_text('{"tasks": {"t": {"acc": {"finetuned": 0.5, "base": 0.25}}}}\n')
    os.utime(summary, (1_800_000_000, 1_800_000_000))
    kept = keep_previous(summary)
    assert kept == tmp_path / "eval" / "previous" / "summary-20270115-080000.json"
    assert kept.read_text() == summary.read_text()
    # both jobs call it before they write their result (the jobs themselves run lm-eval and vLLM)
    assert "keep_previous(root / \"summary.json\")" in Path(evaluate.__file__).read_text()
    assert "keep_previous(out_dir / \"result.json\")" in Path(serve_check.__file__).read_text()


def test_a_local_submit_names_every_task_of_its_prepare_array(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """A local submit of a prepare array (examples/tiny/text.yaml) closed with ``prepare job: 101``, the last task's
    id alone, as if task 1 had not run: now every task's, as slurmft/submit/arrays.py recorded them."""
    from slurmft.cli import _echo_jobs
    from slurmft.rundir import RunPaths, read_manifest, record_job, write_manifest

    run = local_run(tmp_path)
    paths = RunPaths.of(run)
    manifest = read_manifest(paths)
    manifest["jobs"] = []
    for k, job_id in enumerate(("100", "101")):  # as run_local_array records them
        record_job(manifest, "prepare", job_id, task=k, tasks=2, state="COMPLETED")
    record_job(manifest, "train", "4242", state="COMPLETED", pid=4242)
    write_manifest(paths, manifest)
    _echo_jobs(run, "local", {"prepare": "101", "train": "4242"})
    out = capsys.readouterr().out.splitlines()
    assert out[1:] == ["prepare job: 100, 101 (the 2 tasks of its array, run here one after another)",
                       "train job: 4242"], out


def test_logs_follow_of_a_local_prepare_array_follows_every_task(tmp_path: Path) -> None:
    """`logs --job prepare -f` of a local prepare array (examples/tiny/text.yaml: the local executor runs task 1, then
    task 2, each a job of its own) followed the task running when it started, then said the array had ended and never
    showed task 2's log. Now it follows task 2's log once the submit that runs the array records it, and ends with the
    last task. A `sleep` stands in for task 2's process; this process holds the run's lock as that submit does."""
    import subprocess
    import threading

    from slurmft.rundir import (
        RunPaths,
        acquire_lock,
        process_record,
        read_manifest,
        record_job,
        release_lock,
        write_manifest,
    )
    from slurmft.watch.logs import ended_words, tail

    run = local_run(tmp_path)
    paths = RunPaths.of(run)
    manifest = read_manifest(paths)
    manifest["jobs"] = []
    logs = [run / "submitit" / f"{job_id}_0_log.out" for job_id in ("100", "101")]
    logs[0].write_text("[slurmft prepare] task 0 of 2: done\n")
    record_job(manifest, "prepare", "100", task=0, tasks=2, state="COMPLETED", pid=4242, logs=[str(logs[0])])
    write_manifest(paths, manifest)
    acquire_lock(paths, "submit")
    seen: list[str] = []
    follower = threading.Thread(target=tail, args=(log_files(run, "prepare"), 5, True, seen.append,
                                                   ended_words(run, "prepare"), 0.2),
                                kwargs={"more": lambda: log_files(run, "prepare")}, daemon=True)
    try:
        follower.start()
        follower.join(1.0)
        assert follower.is_alive() and "[slurmft prepare] task 0 of 2: done" in seen, seen  # task 2 is to come
        with subprocess.Popen(["sleep", "60"]) as task:
            record_job(manifest, "prepare", "101", task=1, tasks=2, logs=[str(logs[1])], **process_record(task.pid))
            write_manifest(paths, manifest)
            logs[1].write_text("[slurmft prepare] task 1 of 2: packing 2 shards\n")
            for _ in range(100):
                if "[slurmft prepare] task 1 of 2: packing 2 shards" in seen:
                    break
                follower.join(0.1)
            assert "[slurmft prepare] task 1 of 2: packing 2 shards" in seen and follower.is_alive(), seen
            task.kill()
        manifest["jobs"][-1]["state"] = "COMPLETED"
        write_manifest(paths, manifest)
    finally:
        release_lock(paths)
    follower.join(30)
    assert not follower.is_alive()
    assert seen[-1].startswith("[slurmft logs] prepare task 2 of 2 (job 101) of the local array has ended: "
                               "completed"), seen
    assert f"==> {logs[1]} <==" in seen, seen


@pytest.mark.parametrize("kind", ["consolidate", "eval", "prepare"])
def test_status_of_a_failed_job_run_with_here_says_where_its_output_went(
        kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`slurmft status` of a failed `slurmft consolidate RUN_DIR --here` said to see `slurmft logs ... --job
    consolidate`, which only says such a job keeps no log file: status says where its output went instead."""
    import json

    from slurmft.rundir import RunPaths, read_manifest, record_job, write_manifest

    run = local_run(tmp_path)
    paths = RunPaths.of(run)
    manifest = read_manifest(paths)
    record_job(manifest, kind, "here-7-8", here=True, pid=7, state="FAILED")
    write_manifest(paths, manifest)
    main(["status", str(run), "--json"])
    words = next(r for r in json.loads(capsys.readouterr().out)["jobs"] if r["job_id"] == "here-7-8")["words"]
    assert "slurmft logs" not in words, words
    assert f"it ran in the terminal that started it (`slurmft {kind} --here`), which keeps no log file: what it " \
           "printed there says why" in words, words
