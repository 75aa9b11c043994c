"""Progress, checkpoint, attempts and time lost, from realistic run directories (tests/runfixture.py)."""

from __future__ import annotations

import json
from pathlib import Path

from runfixture import T0, attempt_records, local_run, preempted_run, record, slurm_rows, write_metrics

from slurmft.rundir import RunPaths
from slurmft.slurm_states import words
from slurmft.watch.progress import (
    PREEMPTED_REQUEUED,
    REQUEUED_BY_SLURM,
    attempts,
    checkpoint_info,
    lost_to_preemption,
    max_steps_of,
    overview,
    overview_lines,
    progress,
    rate,
    read_metrics,
    requeue_markers,
)
from slurmft.watch.results import model_info


def test_progress_of_a_finished_run(tmp_path: Path) -> None:
    paths = RunPaths.of(preempted_run(tmp_path))
    assert max_steps_of(paths) == 36
    p = progress(paths, 36)
    assert p["step"] == 36 and p["max_steps"] == 36
    assert p["loss"] == 3.0 - 36 * 0.05
    # tokens/s: the newest attempt's 16 records (steps 21..36), not the earlier attempts
    assert p["tokens_per_s"] == sum(1000.0 + s for s in range(21, 37)) / 16
    assert p["eta_s"] == 0.0 and p["problem"] is None


def test_mean_tokens_per_s_is_the_tokens_over_the_time() -> None:
    """Each line's rate weighed by the seconds it was measured over (a GRPO step that generates is slow, the one that
    trains on its buffered completions quick: a plain mean of the two rates overstates the throughput); lines
    without interval_s (an older slurmft's) are averaged plainly."""
    from slurmft.watch.progress import mean_tokens_per_s

    generated, reused = {"tokens_per_s": 100.0, "interval_s": 3.0}, {"tokens_per_s": 400.0, "interval_s": 1.0}
    assert mean_tokens_per_s([generated, reused]) == (300 + 400) / 4
    assert mean_tokens_per_s([{"tokens_per_s": 100.0}, {"tokens_per_s": 400.0}]) == 250.0
    assert mean_tokens_per_s([{"loss": 1.0}]) is None


def test_eta_is_at_the_recent_rate_of_the_running_attempt(tmp_path: Path) -> None:
    paths = RunPaths.of(tmp_path)
    slow = [record(s, T0 + 10 * s, "7", 0) for s in range(1, 11)]          # 10 s/step, long ago
    fast = [record(s, T0 + 500 + 0.5 * i, "7", 1) for i, s in enumerate(range(11, 41))]  # 2 steps/s now
    write_metrics(tmp_path, slow + fast)
    p = progress(paths, 100)
    assert p["step"] == 40
    assert p["eta_s"] == 30.0  # 60 steps at 2 steps/s; the slow attempt and the queue gap do not count
    assert rate(fast[:1]) == (None, 1011.0)  # one record: no rate, but its tokens/s


def test_missing_partial_and_garbage_metrics_are_said_in_words(tmp_path: Path) -> None:
    paths = RunPaths.of(tmp_path)
    p = progress(paths, 36)
    assert p["step"] is None and p["eta_s"] is None and p["max_steps"] == 36
    assert "no metrics.jsonl yet" in p["problem"]

    write_metrics(tmp_path, [record(1, T0, "1", 0), record(2, T0 + 1, "1", 0)],
                  tail='not json\n["a list"]\n{"no_step": 1}\n{"step": 3, "time": 17000')
    m = read_metrics(paths.metrics)
    assert [r["step"] for r in m.records] == [1, 2]
    assert any("last line is incomplete" in s for s in m.problems)
    assert any("3 unreadable line(s)" in s for s in m.problems)
    p = progress(paths, 36)
    assert p["step"] == 2 and p["eta_s"] == 34.0 and "incomplete" in p["problem"]

    paths.metrics.write_bytes(b"\xff\xfe\x00garbage\n")  # not even text
    assert progress(paths, None)["step"] is None


def test_checkpoint_info_is_the_newest_complete_one(tmp_path: Path) -> None:
    paths = RunPaths.of(preempted_run(tmp_path))
    marker = paths.checkpoints / "checkpoint-36" / "COMPLETE"
    info = checkpoint_info(paths, now=marker.stat().st_mtime + 1000)
    assert info["step"] == 36  # checkpoint-40 has no COMPLETE marker: a torn save
    assert info["path"] == str(paths.checkpoints / "checkpoint-36")
    assert info["bytes"] == 2 * 2000 + marker.stat().st_size
    assert info["age_s"] == 1000.0
    for ckpt in paths.checkpoints.iterdir():
        (ckpt / "COMPLETE").unlink(missing_ok=True)
    assert checkpoint_info(paths) is None
    assert checkpoint_info(RunPaths.of(tmp_path / "nothing")) is None


def test_model_info_once_the_index_exists(tmp_path: Path) -> None:
    paths = RunPaths.of(preempted_run(tmp_path))
    assert model_info(paths) is None
    paths.model.mkdir()
    (paths.model / "model-00001-of-00001.safetensors").write_bytes(b"")
    assert model_info(paths) is None  # half-written: the index comes last
    (paths.model / "model.safetensors.index.json").write_text("{}")
    assert model_info(paths) == str(paths.model)


def test_attempts_of_a_run_preempted_twice(tmp_path: Path) -> None:
    paths = RunPaths.of(preempted_run(tmp_path))
    manifest = json.loads(paths.manifest.read_text())
    records = read_metrics(paths.metrics).records
    rows = attempts(manifest, records, slurm_rows(), markers=requeue_markers(paths))
    assert [(r["job_id"], r["restart"], r["how"], r["state"]) for r in rows] == [
        ("100", 0, "submit", "REQUEUED"), ("100", 1, "requeue", "REQUEUED"), ("100", 2, "requeue", "COMPLETED")]
    assert [r["reason"] for r in rows] == [PREEMPTED_REQUEUED, REQUEUED_BY_SLURM, "completed"]
    assert [(r["first_step"], r["last_step"], r["resumed_from_step"]) for r in rows] == [
        (1, 12, 0), (13, 25, 12), (21, 36, 20)]
    assert rows[0]["start"] == T0 and rows[0]["end"] == T0 + 11.5  # the marker was written after the last step
    assert (rows[2]["start"], rows[2]["end"]) == (T0 + 83, T0 + 98)

    lost = lost_to_preemption(rows)
    assert lost["recomputed_steps"] == 5  # steps 21..25 ran twice; the warning-signal save lost nothing
    assert lost["recomputed_s"] == 5.0
    assert lost["gap_s"] == (41 - 11.5) + (83 - 53)
    assert [b["recomputed_steps"] for b in lost["boundaries"]] == [0, 5]


def test_attempts_while_running_and_without_slurm(tmp_path: Path) -> None:
    paths = RunPaths.of(preempted_run(tmp_path))
    manifest = json.loads(paths.manifest.read_text())
    records = read_metrics(paths.metrics).records
    running = attempts(manifest, records, slurm_rows(state="RUNNING"), markers=requeue_markers(paths))
    assert (running[-1]["state"], running[-1]["reason"], running[-1]["end"]) == ("RUNNING", "running", None)
    # Slurm unreachable: the restarts still come from the metrics and the markers
    blind = attempts(manifest, records, [], markers=requeue_markers(paths))
    assert [r["restart"] for r in blind] == [0, 1, 2]
    assert blind[-1]["state"] == "UNKNOWN" and "unknown" in blind[-1]["reason"]
    assert attempts(manifest, records, [], markers=requeue_markers(paths), max_steps=36)[-1]["state"] == "COMPLETED"
    # requeued but not started again: a row with no steps, waiting in the queue
    pending = attempts(manifest, [r for r in records if r["restart"] < 2], slurm_rows(state="PENDING"),
                       markers=requeue_markers(paths))
    assert (pending[-1]["restart"], pending[-1]["first_step"], pending[-1]["reason"]) == (2, None, "waiting in the queue")
    # suspended, starting, or a state word slurmft does not know: still live (no end), in the one table's words
    for state in ("SUSPENDED", "CONFIGURING", "FROBNICATED"):
        row = attempts(manifest, records, slurm_rows(state=state), markers=requeue_markers(paths))[-1]
        assert (row["state"], row["reason"], row["end"]) == (state, words(state), None)
    timeout = attempts(manifest, records, slurm_rows(state="TIMEOUT"), markers=requeue_markers(paths))[-1]
    assert timeout["reason"] == "hit its time limit" and timeout["end"] is not None  # as `status` says it


def test_attempts_across_a_resume_by_hand(tmp_path: Path) -> None:
    paths = RunPaths.of(preempted_run(tmp_path))
    manifest = json.loads(paths.manifest.read_text())
    manifest["jobs"].append({"kind": "train", "job_id": "200", "attempt": 2, "submitted": T0 + 200})
    manifest["attempts"].append({"attempt": 2, "how": "resume", "time": T0 + 200, "train_job": "200",
                                 "consolidate_job": None, "resumed_from": "checkpoints/checkpoint-30",
                                 "resumed_from_step": 30,
                                 "previous": {"job_id": "100", "state": "CANCELLED", "exit_code": "0:15",
                                              "ended": "cancelled by the user"}})
    records = [r for r in read_metrics(paths.metrics).records if r["step"] <= 33]  # job 100 cancelled at 33
    records += attempt_records("200", 0, range(31, 37), T0 + 300)
    rows = attempts(manifest, records, [], markers=requeue_markers(paths))  # sacct forgot job 100
    assert [(r["job_id"], r["restart"], r["how"]) for r in rows][-2:] == [("100", 2, "requeue"), ("200", 0, "resume")]
    assert rows[-2]["state"] == "CANCELLED" and rows[-2]["reason"] == "cancelled, resumed by hand"
    assert rows[-1]["resumed_from_step"] == 30  # from the manifest, not guessed from the first step
    assert lost_to_preemption(rows)["boundaries"][-1]["recomputed_steps"] == 3  # 31..33 again

    old = {k: v for k, v in manifest.items() if k != "attempts"}  # a version-1 manifest
    rows = attempts(old, records, [], markers=requeue_markers(paths))
    assert rows[-1]["how"] == "resume" and rows[-2]["reason"] == "unknown (Slurm no longer knows this job), resumed by hand"


def test_attempts_of_a_local_run(tmp_path: Path) -> None:
    paths = RunPaths.of(local_run(tmp_path))
    manifest = json.loads(paths.manifest.read_text())
    rows = attempts(manifest, read_metrics(paths.metrics).records, [])
    assert [(r["job_id"], r["restart"], r["state"], r["reason"], r["last_step"]) for r in rows] == [
        ("4242", 0, "COMPLETED", "completed", 12)]
    assert lost_to_preemption(rows)["boundaries"] == []


def test_overview_has_the_status_json_keys(tmp_path: Path) -> None:
    from slurmft.watch.progress import overview

    paths = RunPaths.of(preempted_run(tmp_path))
    out = overview(paths, json.loads(paths.manifest.read_text()), slurm_rows())
    assert set(out["progress"]) >= {"step", "max_steps", "loss", "tokens_per_s", "eta_s"}
    assert set(out["checkpoint"]) == {"step", "path", "age_s", "bytes"}
    assert all(set(a) >= {"job_id", "restart", "state", "reason", "start", "end", "first_step", "last_step"}
               for a in out["attempts"])
    assert out["progress"]["max_steps"] == 36 and len(out["attempts"]) == 3 and out["model"] is None
    json.dumps(out)  # --json can print it as is


def test_overview_lines_say_it_in_words(tmp_path: Path) -> None:
    from slurmft.watch.progress import overview, overview_lines

    paths = RunPaths.of(preempted_run(tmp_path))
    text = "\n".join(overview_lines(overview(paths, json.loads(paths.manifest.read_text()), slurm_rows())))
    assert "progress: step 36/36, loss 1.2000, 1028 tokens/s, done" in text
    assert "checkpoint: step 36," in text and "3.9 KiB" in text
    assert "1. job 100 restart 0 (submit, from step 0): steps 1-12" in text
    assert "3. job 100 restart 2 (requeue, from step 20): steps 21-36" in text and text.count("job 100") == 3
    assert "lost to restarts: 5 step(s) again, 1m00s between attempts" in text
    assert "model: not consolidated yet" in text
    (paths.metrics).unlink()
    assert "progress: no metrics.jsonl yet" in "\n".join(overview_lines(overview(paths, {"jobs": []}, [])))


def test_a_lora_run_says_so_from_its_checkpoint_marker_else_its_config(tmp_path: Path) -> None:
    import yaml

    from slurmft.watch.progress import overview, overview_lines
    from slurmft.watch.results import lora_info, lora_words

    paths = RunPaths.of(preempted_run(tmp_path))
    assert lora_info(paths) is None and lora_words(None) == "full fine-tuning (every weight trains)"
    assert "method:" not in "\n".join(overview_lines(overview(paths, json.loads(paths.manifest.read_text()), [])))

    cfg = yaml.safe_load(paths.config.read_text())
    paths.config.write_text(yaml.safe_dump({**cfg, "lora": {"r": 8, "target_modules": ["q_proj", "v_proj"]}}))
    asked = lora_info(paths)  # before a checkpoint or fsdp_report: what the config asks, no counts
    assert asked == {"r": 8, "alpha": 32.0, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"],
                     "modules_to_save": [], "source": "config"}
    assert lora_words(asked) == "LoRA r=8, alpha=32 (scaling 4), dropout 0 on q_proj, v_proj"
    assert lora_words({**asked, "use_rslora": True}).startswith("LoRA r=8, alpha=32 (rsLoRA, scaling 11.3137), ")

    marker = paths.checkpoints / "checkpoint-36" / "COMPLETE"
    built = {"r": 8, "alpha": 16.0, "dropout": 0.05, "target_modules": ["q_proj", "v_proj"], "modules_to_save": [],
             "trainable_params": 4_194_304, "total_params": 6_742_609_920}
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "lora": built}))
    info = lora_info(paths)
    assert info == {**built, "source": "checkpoint"}
    text = "\n".join(overview_lines(overview(paths, json.loads(paths.manifest.read_text()), slurm_rows())))
    assert ("method: LoRA r=8, alpha=16 (scaling 2), dropout 0.05 on q_proj, v_proj: 4.2M of 6.74B parameters "
            "train (0.06 %)") in text
    assert "(adapters and their optimizer state only)" in text
    assert overview(paths, {"jobs": []}, [])["lora"]["trainable_params"] == 4_194_304  # status --json

    marker.unlink()  # no complete checkpoint at step 36: fsdp_report of the running attempt
    for ckpt in paths.checkpoints.glob("checkpoint-*"):
        (ckpt / "COMPLETE").unlink(missing_ok=True)
    paths.fsdp_report.mkdir(exist_ok=True)
    (paths.fsdp_report / "rank0.json").write_text(json.dumps({"rank": 0, "lora": built}))
    assert lora_info(paths) == {**built, "source": "fsdp_report"}


def test_a_lora_run_without_merge_names_its_adapter_as_the_result(tmp_path: Path) -> None:
    import yaml

    from slurmft.rundir import ADAPTER_CONFIG
    from slurmft.watch.progress import overview, overview_lines
    from slurmft.watch.results import result_info

    paths = RunPaths.of(preempted_run(tmp_path))
    cfg = yaml.safe_load(paths.config.read_text())
    paths.config.write_text(yaml.safe_dump({**cfg, "lora": {"r": 8}, "consolidate": {"merge": False}}))

    def text() -> str:
        return "\n".join(overview_lines(overview(paths, json.loads(paths.manifest.read_text()), slurm_rows())))

    def state() -> str:  # `slurmft runs`, its jobs all COMPLETED
        from slurmft.watch.runs import run_lines

        return run_lines(tmp_path, query=lambda ids: {i: {"state": "COMPLETED", "reason": ""} for i in ids})[0]["state"]

    assert "model: not consolidated yet" in text() and "adapter:" not in text()
    assert result_info(paths) is None and state() == "trained"
    paths.adapter.mkdir()
    (paths.adapter / ADAPTER_CONFIG).write_text("{}")
    assert f"adapter: {paths.adapter}" in text()
    assert "model: not written (consolidate.merge is false: the adapter is the result)" in text()
    # the adapter is the result: the run is done (was 'trained' for ever), and a sweep point's `best` links to it
    # (was: no best ever) while `slurmft consolidate SWEEP_DIR` leaves it alone (was: consolidated it every time)
    assert result_info(paths) == str(paths.adapter) and state() == "done"
    from slurmft.watch.report import write_report  # the report says so too (was: 'No consolidated model yet')

    report = write_report(paths.root, slurm_rows=slurm_rows()).read_text()
    assert (f"Adapter: `{paths.adapter}` (`PeftModel.from_pretrained(base, adapter)` loads it).\n\n"
            "No merged model: consolidate.merge is false, the adapter is the result.") in report, report


def test_status_says_the_saves_from_metrics_save_lines(tmp_path: Path) -> None:
    """The job's save lines (one per complete save) are counted per mode with the mean wait and durability."""
    from slurmft.rundir import SAVE_EVENT
    from slurmft.watch.progress import overview, overview_lines, saves_info

    paths = RunPaths.of(preempted_run(tmp_path))
    manifest = json.loads(paths.manifest.read_text())
    assert overview(paths, manifest, slurm_rows())["saves"] is None  # no save line: nothing said
    assert not any(line.startswith("saves:") for line in overview_lines(overview(paths, manifest, slurm_rows())))
    lines = [{"event": SAVE_EVENT, "step": 10, "mode": "async", "blocked_s": 0.1, "durable_s": 2.0, "bytes": 4096},
             {"event": SAVE_EVENT, "step": 20, "mode": "async", "blocked_s": 0.3, "durable_s": 3.0, "bytes": 4096},
             {"event": SAVE_EVENT, "step": 24, "mode": "sync", "blocked_s": 0.9, "durable_s": 0.9, "bytes": 8192}]
    with open(paths.metrics, "a") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)
    info = saves_info(read_metrics(paths.metrics).saves)
    assert info == {"count": 3, "last": {"step": 24, "mode": "sync", "blocked_s": 0.9, "durable_s": 0.9, "bytes": 8192},
                    "by_mode": {"async": {"count": 2, "blocked_s": 0.2, "durable_s": 2.5},
                                "sync": {"count": 1, "blocked_s": 0.9, "durable_s": 0.9}}}
    ov = overview(paths, manifest, slurm_rows())
    assert ov["saves"] == info and ov["progress"]["step"] == 36  # the save lines are not steps
    text = "\n".join(overview_lines(ov))
    assert ("saves: 2 asynchronous (training waited 0.20 s, durable after 2.50 s, mean), 1 synchronous (training "
            "waited 0.90 s, durable after 0.90 s, mean); newest checkpoint-24 (sync, 8.0 KiB)") in text


def test_a_run_whose_train_job_ended_early_has_no_eta(tmp_path: Path) -> None:
    """Cancelled at step 36 of 100: status said "ETA ..." at the dead attempt's rate; only a live train job has one."""
    paths = RunPaths.of(preempted_run(tmp_path))
    manifest = json.loads(paths.manifest.read_text())
    live = overview(paths, manifest, slurm_rows(state="RUNNING"), max_steps=100)
    assert live["progress"]["eta_s"] > 0
    assert ", ETA " in "\n".join(overview_lines(live))
    for state in ("CANCELLED", "FAILED", "TIMEOUT"):
        dead = overview(paths, manifest, slurm_rows(state=state), max_steps=100)
        assert dead["progress"]["eta_s"] is None and dead["progress"]["step"] == 36
        text = "\n".join(overview_lines(dead))
        assert "progress: step 36/100, loss" in text and "ETA" not in text and ", done" not in text
    assert overview(paths, manifest, slurm_rows(state="CANCELLED"), max_steps=36)["progress"]["eta_s"] == 0.0  # done


def _cancelled_after_saving(tmp_path: Path) -> tuple[RunPaths, dict, list[dict]]:
    """The preempted run with its second attempt cancelled (scancel or `slurmft cancel`) after saving step 24: its
    paths, manifest and the metrics of its first two attempts."""
    paths = RunPaths.of(preempted_run(tmp_path))
    manifest = json.loads(paths.manifest.read_text())
    records = [r for r in read_metrics(paths.metrics).records if r["restart"] < 2]
    (paths.requeue_marker_dir / "100-2").unlink(missing_ok=True)
    (paths.requeue_marker_dir / "100-1").write_text(json.dumps({"step": 24, "job_id": "100", "restart": 1,
                                                               "saved": True, "ended": "cancelled"}))
    return paths, manifest, records


def test_an_attempt_cancelled_by_slurmft_cancel_says_so_not_scancel(tmp_path: Path) -> None:
    """`slurmft cancel` mid-training: the ranks save and the job ends CANCELLED. The job's line named who
    (cancels.jsonl) while the attempt's said "cancelled (scancel) after saving": the attempt now says it as the job
    does; without cancels.jsonl (a plain scancel) it stays "cancelled (scancel)"."""
    from slurmft import cancels

    paths, manifest, records = _cancelled_after_saving(tmp_path)
    rows = slurm_rows(state="CANCELLED", restarts=1)
    plain = attempts(manifest, records, rows, markers=requeue_markers(paths))[-1]["reason"]
    assert plain.startswith("cancelled (scancel) after saving")
    cancels.record(paths, ["100"])
    said = attempts(manifest, records, rows, markers=requeue_markers(paths), cancelled=cancels.read(paths))[-1]
    assert said["reason"].startswith("cancelled by `slurmft cancel` (") and "after saving" in said["reason"], said
    assert "scancel" not in said["reason"]
    assert said["reason"].endswith("`slurmft resume` continues from that step"), said


def test_an_attempt_cancelled_after_saving_and_resumed_no_longer_says_to_resume(tmp_path: Path) -> None:
    """`slurmft cancel` mid-training, then `slurmft resume`: the cancelled attempt said "... after saving; `slurmft
    resume` continues from that step, resumed by hand", a command already run. Once resumed it says what happened."""
    paths, manifest, records = _cancelled_after_saving(tmp_path)
    manifest["jobs"].append({"kind": "train", "job_id": "200", "attempt": 2, "submitted": T0 + 200})
    manifest["attempts"].append({"attempt": 2, "how": "resume", "time": T0 + 200, "train_job": "200",
                                 "resumed_from_step": 24})
    rows = slurm_rows(state="CANCELLED", restarts=1)
    cancelled = [r for r in attempts(manifest, records, rows, markers=requeue_markers(paths)) if r["job_id"] == "100"]
    assert cancelled[-1]["reason"] == "cancelled (scancel) after saving, resumed by hand", cancelled[-1]


def test_an_attempt_waiting_on_its_prepare_job_says_so_not_the_queue(tmp_path: Path) -> None:
    """A train job pending on its prepare job (reason Dependency): its job line said "waiting for the prepare job to
    finish successfully" and its attempt line "waiting in the queue"; both say the first now."""
    paths = RunPaths.of(preempted_run(tmp_path))
    manifest = json.loads(paths.manifest.read_text())
    rows = slurm_rows(state="PENDING", restarts=0)
    rows[0].update(reason="Dependency", words="waiting for the prepare job to finish successfully")
    row = attempts(manifest, [], rows, markers={})[-1]
    assert (row["state"], row["reason"]) == ("PENDING", "waiting for the prepare job to finish successfully")
    rows[0].update(reason="", words="waiting in the queue")
    assert attempts(manifest, [], rows, markers={})[-1]["reason"] == "waiting in the queue"


def test_an_attempt_without_a_step_leaves_out_what_it_does_not_have() -> None:
    """A train job not started yet said `(submit, from step -): no step on 1 node x 2 ranks, - .. -: waiting in the
    queue`: placeholders for what it has not got."""
    from slurmft.watch.progress import attempt_line

    waiting = {"job_id": "11", "restart": 0, "how": "submit", "state": "PENDING", "reason": "waiting in the queue",
               "start": None, "end": None, "first_step": None, "last_step": None, "resumed_from_step": None,
               "nodes": 1, "ranks_per_node": 2}
    line = attempt_line(1, waiting)
    assert line == "  1. job 11 restart 0 (submit): no step yet on 1 node x 2 ranks: waiting in the queue", line
    ended = {**waiting, "state": "FAILED", "reason": "failed", "end": T0, "resumed_from_step": 0}
    assert attempt_line(1, ended).startswith("  1. job 11 restart 0 (submit, from step 0): no step on 1 node x 2 "
                                             "ranks, - .. ")
