"""slurmft.prepared: the record of RUN_DIR/prepared/ and every way a run's config or files can stop matching it
(login side, no torch, no datasets); the words status uses for a train job whose prepare job failed."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from slurmft import prepared
from slurmft.config_loading import load_config
from slurmft.errors import RunDirError
from slurmft.rundir import RunPaths
from slurmft.watch.status import explain_dependency_failures, prepare_failed_words, train_failed_words

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "examples" / "tiny" / "run.yaml"


@pytest.fixture
def run(tmp_path: Path):  # noqa: ANN201 - (config maker, data file, tokenizer dir, RunPaths)
    data = tmp_path / "chat.jsonl"
    data.write_text((REPO / "examples" / "tiny" / "data" / "lima.jsonl").read_text())
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text('{"version": "1.0"}')
    (tok / "tokenizer_config.json").write_text("{}")
    (tok / "config.json").write_text("{}")  # not a tokenizer file: changing it changes no token
    paths = RunPaths.of(tmp_path / "run")

    def cfg(*overrides: str):  # noqa: ANN202
        return load_config(TINY, [f"model.name_or_path={tok}", f"output_dir={paths.root}", "prepare.enabled=true",
                                  "data.datasets=[{path: " + str(data) + "}]", *overrides])

    return cfg, data, tok, paths


def _prepare(paths: RunPaths, cfg) -> None:  # noqa: ANN001 - what the prepare job leaves (its record)
    paths.prepared.mkdir(parents=True)
    prepared.write_record(paths.prepared_record, {**prepared.expected(cfg), "result": {"sequences": 3}})


def test_no_record_means_not_prepared_and_a_matching_one_is_used(run) -> None:  # noqa: ANN001
    cfg, _, _, paths = run
    assert prepared.check(paths, cfg()) is None
    paths.prepared.mkdir(parents=True)  # a preparation that died before its record: not complete
    assert prepared.check(paths, cfg()) is None
    paths.prepared.rmdir()
    _prepare(paths, cfg())
    assert prepared.check(paths, cfg())["result"] == {"sequences": 3}
    # what changes the training but not the data does not matter
    assert prepared.check(paths, cfg("train.learning_rate=0.5", "train.max_steps=7", "data.num_proc=3"))


def test_a_source_changed_after_preparation_is_refused_with_the_fix(run) -> None:  # noqa: ANN001
    cfg, data, _, paths = run
    _prepare(paths, cfg())
    with open(data, "a") as f:
        f.write(data.read_text().splitlines()[0] + "\n")
    st = data.stat()
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(RunDirError) as err:
        prepared.check(paths, cfg())
    text = err.value.render()
    assert f"data.datasets[0] ({data}): the file changed after preparation" in text
    assert f"slurmft prepare {paths.root}" in text and "does not match" in text


def test_a_touched_source_is_refused_too(run) -> None:  # noqa: ANN001 - same bytes, a newer mtime: cannot tell
    cfg, data, _, paths = run
    _prepare(paths, cfg())
    os.utime(data, (time.time() + 5, time.time() + 5))
    assert prepared.differences(prepared.read_record(paths), prepared.expected(cfg()))


@pytest.mark.parametrize(("override", "words"), [
    ("data.max_seq_length=128", "data.max_seq_length: 256 when prepared, 128 now"),
    ("data.packing=false", "data.packing: True when prepared, False now"),
    ("data.assistant_only_loss=false", "data.assistant_only_loss"),
    ("train.seed=7", "train.seed: 42 when prepared, 7 now"),
    ("train.sft.packing_strategy=wrapped", "train.sft (the keys TRL's preparation reads)"),
    ("dpo.beta=0.1", "the training method (a dpo: section): None when prepared, 'dpo' now"),
])
def test_each_setting_of_the_preparation_is_compared(run, override: str, words: str) -> None:  # noqa: ANN001
    cfg, _, _, paths = run
    _prepare(paths, cfg())
    assert any(words in d for d in prepared.differences(prepared.read_record(paths), prepared.expected(cfg(override))))


def test_preference_pairs_prepared_for_dpo_are_refused_for_sft(run) -> None:  # noqa: ANN001
    cfg, _, _, paths = run
    _prepare(paths, cfg("dpo.beta=0.1"))
    assert prepared.differences(prepared.read_record(paths), prepared.expected(cfg("dpo.beta=0.1"))) == []
    assert prepared.differences(prepared.read_record(paths), prepared.expected(cfg())) == [
        "the training method (a dpo: section): 'dpo' when prepared, None now"]


def test_another_source_or_weight_is_refused(run, tmp_path: Path) -> None:  # noqa: ANN001
    cfg, data, _, paths = run
    _prepare(paths, cfg())
    other = tmp_path / "other.jsonl"
    other.write_text(data.read_text())
    diffs = prepared.differences(prepared.read_record(paths),
                                 prepared.expected(cfg("data.datasets=[{path: " + str(other) + "}]")))
    assert any("data.datasets[0]: path changed" in d for d in diffs), diffs
    two = "data.datasets=[{path: " + str(data) + "}, {path: " + str(other) + "}]"
    assert "data.datasets: 1 source(s) when prepared, 2 now" in prepared.differences(
        prepared.read_record(paths), prepared.expected(cfg(two)))


def test_tokenizer_files_are_hashed_and_other_files_are_not(run) -> None:  # noqa: ANN001
    cfg, _, tok, paths = run
    _prepare(paths, cfg())
    (tok / "config.json").write_text('{"hidden_size": 8}')
    assert prepared.check(paths, cfg()) is not None
    (tok / "tokenizer.json").write_text('{"version": "1.1"}')
    with pytest.raises(RunDirError) as err:
        prepared.check(paths, cfg())
    assert "tokenizer file(s) changed after preparation: tokenizer.json" in err.value.render()


def test_status_says_why_a_train_job_never_started() -> None:
    jobs = [{"kind": "prepare", "job_id": "11"}, {"kind": "train", "job_id": "12", "dependency": "afterok:11"},
            {"kind": "consolidate", "job_id": "13", "dependency": "afterok:12"}]
    rows = [{"kind": "prepare", "job_id": "11", "state": "FAILED", "start": "2026-12-03T15:00:00", "words": "failed"},
            {"kind": "train", "job_id": "12", "state": "CANCELLED", "start": "None", "words": "cancelled"},
            {"kind": "consolidate", "job_id": "13", "state": "PENDING", "start": "", "words": "w"}]
    explain_dependency_failures(rows, jobs, "/runs/x")
    assert rows[1]["words"] == prepare_failed_words("11", "/runs/x")
    assert "prepare job 11 did not succeed" in rows[1]["words"] and "slurmft resume /runs/x" in rows[1]["words"]
    assert rows[2]["words"] == "w"  # still pending: its own words
    rows[2].update(state="CANCELLED", start="None")  # then Slurm cancels the consolidation too (issue 47)
    explain_dependency_failures(rows, jobs, "/runs/x")
    assert rows[2]["words"] == train_failed_words("12", "/runs/x") and "train job 12 did not succeed" in rows[2]["words"]
    # Slurm 22.05's sacct gives a pending job scancel cancelled its End as its Start: no start; and `slurmft cancel`
    # cancelled it (cancels.jsonl), not Slurm
    by = "cancelled by `slurmft cancel` (ann, 2026-12-03 15:02:00)"
    rows[2].update(words="cancelled", start="2026-12-03T15:02:00", end="2026-12-03T15:02:00", cancelled_by=by)
    explain_dependency_failures(rows, jobs, "/runs/x")
    assert rows[2]["words"] == train_failed_words("12", "/runs/x", by) == (
        f"{by} before it started (it waited on train job 12); `slurmft resume /runs/x` continues training from the "
        "newest complete checkpoint and chains a new consolidation")
    del rows[2]["cancelled_by"]
    # a train job cancelled by the user after it started, or one whose prepare job succeeded: its own words
    rows[1].update(words="cancelled", start="2026-12-03T15:01:00")
    explain_dependency_failures(rows, jobs, "/runs/x")
    assert rows[1]["words"] == "cancelled"
    rows[0]["state"], rows[1]["start"] = "COMPLETED", "None"
    explain_dependency_failures(rows, jobs, "/runs/x")
    assert rows[1]["words"] == "cancelled"


def test_status_shows_no_reason_for_a_running_job() -> None:
    """squeue's reason for a running job is the word None: the reason column leaves it empty (it showed "None");
    a pending job keeps Slurm's reason and its words."""
    from slurmft.watch.status import SlurmView, job_rows

    row = {"state": "RUNNING", "reason": "None", "elapsed": "0:05", "restarts": "0", "name": "x-train", "comment": ""}
    view = SlurmView(queued={"5": row, "6": {**row, "state": "PENDING", "reason": "Priority"}})
    manifest = {"executor": "slurm", "jobs": [{"kind": "train", "job_id": "5"}, {"kind": "consolidate", "job_id": "6"}]}
    running, pending = job_rows(manifest, "/runs/x", view)
    assert (running["state"], running["reason"]) == ("RUNNING", "")
    assert (pending["reason"], pending["words"]) == ("Priority", "waiting in the queue (priority)")


def test_status_does_not_repeat_the_next_step_for_a_job_a_later_one_replaced() -> None:
    """Cancelled at step 12, then `slurmft resume`d: the first consolidation job (cancelled by Slurm before it started)
    still said "`slurmft resume` continues training ..." beside the resumed run; the train row said the resume was
    done."""
    jobs = [{"kind": "prepare", "job_id": "11"}, {"kind": "train", "job_id": "12", "dependency": "afterok:11"},
            {"kind": "consolidate", "job_id": "13", "dependency": "afterok:12"},
            {"kind": "train", "job_id": "14"}, {"kind": "consolidate", "job_id": "15", "dependency": "afterok:14"}]
    rows = [{"kind": "prepare", "job_id": "11", "state": "COMPLETED", "start": "2026-12-03T15:00:00", "words": "c"},
            {"kind": "train", "job_id": "12", "state": "CANCELLED", "start": "2026-12-03T15:01:00", "words": "t"},
            {"kind": "consolidate", "job_id": "13", "state": "CANCELLED", "start": "None", "words": "cancelled"}]
    rows[1]["state"] = "COMPLETING"  # `slurmft cancel` a second ago: Slurm still ends the train job
    explain_dependency_failures(rows, jobs[:3], "/runs/x")
    assert rows[2]["words"] == ("cancelled before it started; train job 12 has not ended yet, it is finishing (Slurm "
                                "is ending its processes); `slurmft status /runs/x` says what to run once it has")
    rows[1]["state"] = "CANCELLED"
    explain_dependency_failures(rows, jobs[:3], "/runs/x")
    assert rows[2]["words"] == train_failed_words("12", "/runs/x")  # the newest: what to run next
    rows += [{"kind": "train", "job_id": "14", "state": "RUNNING", "start": "2026-12-03T15:05:00", "words": "r"},
             {"kind": "consolidate", "job_id": "15", "state": "PENDING", "start": "", "words": "w"}]
    explain_dependency_failures(rows, jobs, "/runs/x")
    assert rows[2]["words"] == ("cancelled by Slurm before it started: train job 12 did not succeed "
                                "(DependencyNeverSatisfied); consolidate job 15 took its place")
    # a train job that never started after a failed prepare, then resumed with a new prepare job
    jobs = [{"kind": "prepare", "job_id": "21"}, {"kind": "train", "job_id": "22", "dependency": "afterok:21"},
            {"kind": "prepare", "job_id": "23"}, {"kind": "train", "job_id": "24", "dependency": "afterok:23"}]
    rows = [{"kind": "prepare", "job_id": "21", "state": "FAILED", "start": "2026-12-03T15:00:00", "words": "f"},
            {"kind": "train", "job_id": "22", "state": "CANCELLED", "start": "None", "words": "cancelled"},
            {"kind": "prepare", "job_id": "23", "state": "RUNNING", "start": "2026-12-03T15:05:00", "words": "r"},
            {"kind": "train", "job_id": "24", "state": "PENDING", "start": "", "words": "w"}]
    explain_dependency_failures(rows, jobs, "/runs/x")
    assert rows[1]["words"].endswith("prepare job 21 did not succeed (DependencyNeverSatisfied); train job 24 took "
                                     "its place") and "slurmft resume" not in rows[1]["words"]


def test_a_job_never_started_after_the_job_it_waited_on_was_run_again() -> None:
    """The job it waited on failed and was run again since (`slurmft prepare`, `slurmft consolidate`, a resume that
    chained no consolidation), but no later job of its own kind: the words named `logs --job prepare`, which shows the
    new prepare job's log, not the failed one's, and told to run again what had been run."""
    jobs = [{"kind": "prepare", "job_id": "31"}, {"kind": "train", "job_id": "32", "dependency": "afterok:31"},
            {"kind": "consolidate", "job_id": "33", "dependency": "afterok:32"},
            {"kind": "serve", "job_id": "34", "dependency": "afterok:33"}]
    rows = [{"kind": "prepare", "job_id": "31", "state": "FAILED", "start": "2026-12-03T15:00:00", "words": "f"},
            *({"kind": j["kind"], "job_id": j["job_id"], "state": "CANCELLED", "start": "None", "words": "c"}
              for j in jobs[1:])]
    explain_dependency_failures(rows, jobs, "/runs/x")
    assert "see `slurmft logs /runs/x --job prepare`" in rows[1]["words"]  # 31 is the newest prepare job
    # its consolidation never ran either (nothing trained): resume, not `slurmft consolidate` (an untrained model)
    assert rows[3]["words"].endswith("which never ran (its train job did not finish); `slurmft resume /runs/x` "
                                     "continues training and chains a new consolidation and serve job"), rows[3]
    jobs.append({"kind": "prepare", "job_id": "35"})  # `slurmft prepare /runs/x`
    rows.append({"kind": "prepare", "job_id": "35", "state": "COMPLETED", "start": "2026-12-03T15:09:00", "words": ""})
    explain_dependency_failures(rows, jobs, "/runs/x")
    assert rows[1]["words"] == prepare_failed_words("31", "/runs/x", redone=True)
    assert "see `slurmft logs /runs/x --job-id 31`, fix the data, then `slurmft resume /runs/x`" in rows[1]["words"]
    # a consolidation failed, `slurmft consolidate` ran another: the serve check waits for that one only
    rows[1:3] = [{**rows[1], "state": "COMPLETED", "start": "2026-12-03T15:01:00"},
                 {**rows[2], "state": "FAILED", "start": "2026-12-03T15:02:00"}]
    jobs.append({"kind": "consolidate", "job_id": "36"})
    rows.append({"kind": "consolidate", "job_id": "36", "state": "RUNNING", "start": "2026-12-03T15:10:00",
                 "words": ""})
    explain_dependency_failures(rows, jobs, "/runs/x")
    assert "slurmft consolidate /runs/x" not in rows[3]["words"], rows[3]["words"]
    assert rows[3]["words"].endswith("a later consolidation job of the run follows it: once it has succeeded, "
                                     "`slurmft serve /runs/x` / `slurmft eval /runs/x`")
    # a train job failed and a resume trained again without a consolidation: its cancelled one says so
    jobs = [{"kind": "train", "job_id": "42"}, {"kind": "consolidate", "job_id": "43", "dependency": "afterok:42"},
            {"kind": "train", "job_id": "44"}]
    rows = [{"kind": "train", "job_id": "42", "state": "FAILED", "start": "2026-12-03T15:00:00", "words": "f"},
            {"kind": "consolidate", "job_id": "43", "state": "CANCELLED", "start": "None", "words": "c"},
            {"kind": "train", "job_id": "44", "state": "RUNNING", "start": "2026-12-03T15:11:00", "words": ""}]
    explain_dependency_failures(rows[:2], jobs[:2], "/runs/x")
    assert rows[1]["words"] == train_failed_words("42", "/runs/x")
    explain_dependency_failures(rows, jobs, "/runs/x")
    assert rows[1]["words"] == ("cancelled by Slurm before it started: train job 42 did not succeed "
                                "(DependencyNeverSatisfied); a later `slurmft resume` continued the run")


def test_status_reads_the_prepare_jobs_newest_progress_line() -> None:
    from slurmft.watch.progress import last_progress

    log = ("[slurmft prepare 14:56:13] loaded 809 conversations\n"
           "Tokenizing train dataset (num_proc=1):   0%|          | 0/809 [00:00<?, ? examples/s]"
           "\rTokenizing train dataset (num_proc=1):  49%|████▉     | 400/809 [00:10<00:10, 40.10 examples/s]")
    assert last_progress(log) == "Tokenizing train dataset (num_proc=1): 400/809 rows, 40.10 examples/s, ETA 00:10"
    assert last_progress("[slurmft prepare] nothing yet\n") is None


def test_runs_says_when_a_run_is_preparing_or_its_prepare_job_failed() -> None:
    from slurmft.watch.runs import run_word

    def jobs(prepare: str, train: str | None = None, reason: str = "") -> list[dict]:
        out = [{"kind": "prepare", "state": prepare, "reason": ""}]
        if train:
            out.append({"kind": "train", "state": train, "reason": reason})
        return out

    assert run_word(jobs("RUNNING", "PENDING", "Dependency"), False) == "preparing"
    assert run_word(jobs("PENDING", "PENDING", "Dependency"), False) == "prepare queued"
    assert run_word(jobs("FAILED", "CANCELLED"), False) == "prepare failed"
    assert run_word(jobs("COMPLETED", "RUNNING"), False) == "training"
    assert run_word(jobs("CANCELLED", "CANCELLED"), False) == "cancelled"  # `slurmft cancel`: the user's doing


def test_the_prepared_count_is_the_exact_one_and_a_stale_or_missing_one_is_none(run) -> None:  # noqa: ANN001
    from slurmft.epochs import steps_per_epoch
    from slurmft.plan.checks import batch_notes

    cfg, data, _, paths = run
    assert prepared.sequences(cfg()) is None
    _prepare(paths, cfg())  # 3 packed sequences
    assert prepared.sequences(cfg()) == 3
    epochs = cfg("train.max_steps=null", "train.epochs=2", "train.per_device_batch_size=1")
    notes = "\n".join(batch_notes(epochs, [], None))  # no samples read: the count comes from the record alone
    per_epoch = steps_per_epoch(3, epochs.resources.world_size, 1, epochs.train.gradient_accumulation_steps)
    assert f"data: 3 packed sequences per epoch (prepared, exact) -> {per_epoch} optimizer steps per epoch" in notes
    assert f"train.epochs 2 -> {2 * per_epoch} steps" in notes
    with open(data, "a") as f:
        f.write(data.read_text().splitlines()[0] + "\n")
    assert prepared.sequences(cfg()) is None  # stale: never counted as this run's data
    assert "(prepared, exact)" not in "\n".join(batch_notes(epochs, [], None))


def test_a_dpo_runs_prepared_count_is_said_in_preference_pairs(run) -> None:  # noqa: ANN001
    """A DPO run's epoch is its pairs (the prepared count is the data set's rows; each is two sequences): validate
    said 'data: 63 sequences per epoch' of the tiny DPO example."""
    from slurmft.plan.checks import batch_notes

    _, _, tok, paths = run
    dpo = load_config(REPO / "examples" / "tiny" / "dpo.yaml", [f"model.name_or_path={tok}", f"output_dir={paths.root}"])
    _prepare(paths, dpo)  # 3 pairs
    notes = "\n".join(batch_notes(dpo, [], None))
    assert "data: 3 preference pairs per epoch (prepared, exact)" in notes and "sequences per epoch" not in notes


@pytest.mark.parametrize("example, rows", [("dpo", "preference pairs"), ("grpo", "prompts"), ("run", "packed sequences")])
def test_estimate_says_what_the_prepared_rows_are(run, example: str, rows: str) -> None:  # noqa: ANN001
    """estimate's disk table said 'prepared data: 3 sequences' of a DPO run's pairs and a GRPO run's prompts."""
    from rich.console import Console
    from test_estimate import MID, profile

    from slurmft.plan import estimate as E
    from slurmft.plan import estimate_text as T

    _, _, tok, paths = run
    cfg = load_config(REPO / "examples" / "tiny" / f"{example}.yaml",
                      [f"model.name_or_path={tok}", f"output_dir={paths.root}", "prepare.enabled=true",
                       "checkpoint.every_steps=1", "train.max_steps=2"])
    _prepare(paths, cfg)  # 3 rows
    result = E.estimate(cfg, profile(), model_cfg=MID)
    assert result["schedule"]["rows"] == rows
    console = Console(record=True, width=300)
    console.print(T.render_table(result))
    assert f"(prepared data: 3 {rows}, " in console.export_text()


def test_prepare_run_yaml_as_a_job_refuses_a_config_whose_train_job_would_not_read_it(
        run, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    import yaml

    from slurmft.cli import main

    cfg, _, _, paths = run
    config = paths.root.parent / "run.yaml"
    config.write_text(yaml.safe_dump(cfg("prepare.enabled=false").model_dump(mode="json")))
    with pytest.raises(SystemExit) as info:
        main(["prepare", str(config)])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "prepare.enabled is false" in err and "--here" in err, err
    assert not paths.root.exists()  # nothing written


def test_a_hub_source_is_recorded_at_its_commit_and_a_new_push_is_refused(run) -> None:  # noqa: ANN001
    # the hub cannot be reached from here: a dictionary of commits stands in for it (prepared.hub_commit's answer)
    cfg, data, _, paths = run
    hub = {("org/chat", None): "a" * 40, ("org/chat", "v1"): "b" * 40}

    def resolve(repo: str, revision: str | None) -> str:
        return hub[(repo, revision)]

    def offline(repo: str, revision: str | None) -> str:
        raise ConnectionError("no network")

    two = cfg(f"data.datasets=[{{path: {data}}}, {{path: org/chat}}, {{path: org/chat, revision: v1}}]")
    record = prepared.expected(two)
    said: list[str] = []
    assert prepared.pin_hub_commits(two, record["inputs"], said.append, resolve) == [None, "a" * 40, "b" * 40]
    assert [e.get("sha") for e in record["inputs"]["sources"]] == [None, "a" * 40, "b" * 40] and not said
    assert prepared.differences(record, prepared.expected(two)) == []  # the job's own comparison needs no hub
    assert prepared.hub_changes(record, resolve) == ([], [])

    hub[("org/chat", None)] = "c" * 40  # a new push to the default branch; v1 stays where it was
    changes, unchecked = prepared.hub_changes(record, resolve)
    assert changes == ["data.datasets[1] (org/chat): the hub has a new commit since preparation (aaaaaaaaaaaa when "
                       "prepared, cccccccccccc now)"] and unchecked == []
    assert prepared.hub_changes(record, offline) == ([], ["org/chat (ConnectionError)", "org/chat (ConnectionError)"])

    pinned = cfg(f"data.datasets=[{{path: org/chat, revision: {'a' * 40}}}]")  # a commit cannot move: not asked
    rec = prepared.expected(pinned)
    prepared.pin_hub_commits(pinned, rec["inputs"], said.append, lambda repo, rev: rev or "")
    assert prepared.hub_changes(rec, offline) == ([], [])
    offline_rec = prepared.expected(two)
    assert prepared.pin_hub_commits(two, offline_rec["inputs"], said.append, offline) == [None, None, None]
    assert "cannot ask the hub which commit 'org/chat' is at (ConnectionError)" in said[0]
    assert prepared.hub_changes(offline_rec, resolve) == ([], [])  # nothing recorded, nothing to compare
    assert "data.datasets[0]: revision changed" in "\n".join(
        prepared.differences(rec, prepared.expected(cfg("data.datasets=[{path: org/chat, revision: v2}]"))))


def test_a_grpo_preparation_is_summarised_as_prompts() -> None:
    """A grpo run's prepare job keeps its prompts as they are: status says prompts, not sequences of 0 tokens."""
    from slurmft.prepared import summary_line

    record = {"settings": {"method": "grpo", "max_seq_length": 128}, "result": {"conversations": 32, "sequences": 32,
                                                                              "tokens": 0, "seconds": 6.9}}
    assert summary_line(record) == "32 prompts (not tokenized: GRPO renders them at every generation), prepared in 6.9 s"


def test_a_preparation_is_summarised_in_what_its_rows_are() -> None:
    """Records as the prepare job writes them (the tiny examples'): a text run's rows are documents and a dpo run's
    preference pairs (status said '240 conversations -> 37 sequences' and '63 conversations -> 63 sequences')."""
    from slurmft.prepared import summary_line

    corpus = {"path": "corpus/*.txt", "format": "auto", "documents": "blank_line"}
    chat = {"path": "lima.jsonl", "format": "auto"}
    counts = {"conversations": 240, "sequences": 37, "tokens": 9161, "loss_tokens": 9161, "fill": 0.9672}
    text = {"settings": {"sources": [corpus], "max_seq_length": 256, "packing": True}, "result": counts}
    assert summary_line(text).startswith("240 documents -> 37 sequences of <= 256 tokens, 9,161 tokens, 9,161 in the "
                                         "loss, packing fills 97% of the slots")
    both = {**text, "settings": {**text["settings"], "sources": [corpus, chat]}}
    assert summary_line(both).startswith("240 documents and conversations -> 37 sequences")
    assert summary_line({**text, "settings": {**text["settings"], "sources": [chat]}}).startswith(
        "240 conversations -> 37 sequences")
    dpo = {"settings": {"sources": [{"path": "pairs.jsonl"}], "max_seq_length": 128, "packing": True, "method": "dpo"},
           "result": {"conversations": 63, "sequences": 63, "tokens": 3599, "loss_tokens": None, "fill": None}}
    assert summary_line(dpo) == ("63 preference pairs (each a chosen and a rejected sequence of <= 128 tokens), 3,599 "
                                 "tokens")  # not '63 pairs -> 63 sequences': each pair is two


def test_a_plan_layout_is_read_and_an_unknown_layout_is_refused_with_the_fix(run) -> None:  # noqa: ANN001
    """A packed prepare array's record (``layout: plan``) says version 2, so a slurmft that reads only version 1 finds
    no complete preparation (and prepares again) instead of opening the plan as a saved data set; this slurmft reads
    it, and refuses a layout it does not know (a newer slurmft's) with the fix, never reading it as another layout."""
    cfg, _, _, paths = run
    paths.prepared.mkdir(parents=True)
    record = {**prepared.expected(cfg()), "result": {"sequences": 3}}
    prepared.write_record(paths.prepared_record, {**record, "version": 2, "layout": "plan"})
    assert prepared.check(paths, cfg())["layout"] == "plan"
    prepared.write_record(paths.prepared_record, {**record, "layout": "tiles"})
    with pytest.raises(RunDirError) as exc:
        prepared.check(paths, cfg())
    assert "newer slurmft (layout 'tiles'" in exc.value.render() and "slurmft prepare" in exc.value.render()
    prepared.write_record(paths.prepared_record, {**record, "version": 3})
    assert prepared.check(paths, cfg()) is None  # a version this slurmft does not know: no preparation it can read


def test_the_elapsed_column_says_every_job_s_time_in_one_format() -> None:
    """squeue's ``0:08``, sacct's ``00:00:08`` and a local process's ``8.3`` seconds were shown as they came, mixed in
    one column: one format now (slurmft.units.fmt_duration), a day included."""
    from slurmft.watch.status import SlurmView, job_rows

    queued = {"state": "RUNNING", "reason": "None", "elapsed": "0:08", "restarts": "0", "name": "x", "comment": ""}
    acct = {"state": "COMPLETED", "elapsed": "00:00:08", "exit_code": "0:0", "start": "", "end": ""}
    view = SlurmView(queued={"5": queued}, acct={"6": acct, "7": {**acct, "elapsed": "1-02:03:04"}})
    manifest = {"executor": "slurm", "jobs": [{"kind": "prepare", "job_id": "6"}, {"kind": "train", "job_id": "5"},
                                              {"kind": "consolidate", "job_id": "7"}]}
    assert [r["elapsed"] for r in job_rows(manifest, "/runs/x", view)] == ["8s", "8s", "26h03m"]
    local = {"executor": "local", "jobs": [{"kind": "train", "job_id": "9", "pid": 1, "host": "elsewhere",
                                            "state": "COMPLETED", "elapsed_s": 8.3}]}
    assert job_rows(local, "/runs/x")[0]["elapsed"] == "8s"


def test_status_says_to_resume_not_consolidate_for_a_serve_check_whose_train_job_was_cancelled() -> None:
    """`slurmft cancel` mid-training on a run with serve: and eval:: the serve and eval rows said "`slurmft consolidate
    RUN_DIR`, then `slurmft serve` / `slurmft eval`", which would export the half-trained checkpoint as the model.
    Their consolidation never ran: `slurmft resume` chains all three again. After a completed train job whose
    consolidation was cancelled, `slurmft consolidate` stays the advice."""
    from slurmft.watch.status import consolidation_failed_words

    jobs = [{"kind": "train", "job_id": "12"}, {"kind": "consolidate", "job_id": "13", "dependency": "afterok:12"},
            {"kind": "serve", "job_id": "14", "dependency": "afterok:13"},
            {"kind": "eval", "job_id": "15", "dependency": "afterok:13"}]
    by = "cancelled by `slurmft cancel` (ann, 2026-12-03 15:02:00)"
    cancelled = {"state": "CANCELLED", "start": "2026-12-03T15:02:00", "end": "2026-12-03T15:02:00", "cancelled_by": by}
    rows = [{"kind": "train", "job_id": "12", "state": "CANCELLED", "start": "2026-12-03T15:01:00", "words": "t"},
            *({"kind": j["kind"], "job_id": j["job_id"], "words": "c", **cancelled} for j in jobs[1:])]
    explain_dependency_failures(rows, jobs, "/runs/x")
    for row in rows[2:]:
        assert "slurmft consolidate" not in row["words"], row["words"]
        assert row["words"] == (f"{by} before it started (it waited on consolidation job 13), which never ran (its "
                                f"train job did not finish); `slurmft resume /runs/x` continues training and chains a "
                                f"new consolidation and {row['kind']} job")
    # a second before: Slurm has not cancelled the serve job yet (pending, DependencyNeverSatisfied)
    rows[2].update(state="PENDING", reason="DependencyNeverSatisfied", words="w", start="", end="")
    explain_dependency_failures(rows, jobs, "/runs/x")
    assert "slurmft consolidate" not in rows[2]["words"] and rows[2]["words"].startswith(
        "will never start: its consolidation job 13 never ran"), rows[2]["words"]
    assert rows[2]["words"].endswith("`slurmft resume /runs/x` continues training and chains a new consolidation and "
                                     "serve job")
    rows[2].update(cancelled, words="c")
    rows[0]["state"] = "COMPLETED"
    explain_dependency_failures(rows, jobs, "/runs/x")
    assert rows[2]["words"] == consolidation_failed_words("13", "/runs/x", by)
