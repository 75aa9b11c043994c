"""The prepare array's tasks (slurmft/job/prepare_array.py), run here one after another as the local executor does.

What must hold: ``prepared/`` from N tasks is bitwise ``prepared/`` from one prepare job (the packed rows, their
column types, the record's counts), for a mixture of plain text and chat, packed, and unpacked with TRL's shuffle;
the record covers every shard; shards made from different inputs are refused, not mixed.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from slurmft.errors import JobSetupError

from .helpers import TINY_DATA, write_run

SEQ = 64
WORDS = ["the", "of", "and", "to", "in", "a", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on", "not", "he", "this", "are", "or", "his", "from", "at", "which"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Twelve text files (two longer than SEQ tokens), documents per file."""
    rng = random.Random(3)
    root = tmp_path_factory.mktemp("array-corpus")
    for i in range(12):
        words = rng.choice((6, 30, 90, 200))
        (root / f"doc{i:02d}.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(words)) + "\n")
    return root


def _run(root: Path, name: str, model: Path, corpus: Path, extra: list[str]) -> Path:
    sources = [{"path": str(corpus / "*.txt"), "weight": 1.0}, {"path": str(TINY_DATA / "lima.jsonl"), "weight": 0.1}]
    return write_run(root / name, model, [f"data.max_seq_length={SEQ}", "prepare.enabled=true", *extra],
                     edit=lambda d: d["data"].update(datasets=sources))


def _prepare(run: Path, tasks: int) -> dict:
    from slurmft.job.prepare import prepare_run
    from slurmft.job.prepare_array import run_task

    if tasks == 1:
        return prepare_run(str(run), num_proc=1)
    for k in range(tasks):  # as the local executor runs an array: one after another, the last one packs
        run_task(str(run), k, tasks, "7", num_proc=1)
    from slurmft.prepared import read_record
    from slurmft.rundir import RunPaths

    return read_record(RunPaths.of(run)) or {}


def trained_rows(run: Path):
    """The rows the train job reads from ``run``'s ``prepared/`` (slurmft.job.prepare.read_prepared), in its order."""
    from slurmft.job.prepare import read_prepared
    from slurmft.prepared import read_record
    from slurmft.rundir import RunPaths

    return read_prepared(run / "prepared", read_record(RunPaths.of(run)) or {})


def _same(a: Path, b: Path) -> None:
    from slurmft.job.packing import gathers_when_read

    one, many = trained_rows(a), trained_rows(b)
    if gathers_when_read(many):  # a packed array's plan: each row gathered when read, as the trainer reads them
        assert len(many) == len(one) and many[:] == one[:]  # every token, label, length, in order
        picks = list(range(len(one)))[::-3]
        assert many.__getitems__(picks) == one.__getitems__(picks)  # a batch in a sampler's order (the DataLoader's)
        assert {k: type(v[0]) for k, v in many[:1].items()} == {k: type(v[0]) for k, v in one[:1].items()}
        return
    assert one.features == many.features
    assert one.with_format("arrow")[:].equals(many.with_format("arrow")[:])  # every token, label, length, in order


def _files(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize("tasks,extra", [
    (3, []), (2, ["train.sft.shuffle_dataset=true", "train.sft.packing_strategy=bfd_split"]),
    (2, ["data.packing=false", "train.sft.shuffle_dataset=true"]), (3, ["data.packing=false"])],
    ids=["packed-3-tasks", "packed-bfd-split-shuffled-2-tasks", "unpacked-shuffled-2-tasks", "unpacked-3-tasks"])
def test_array_prepares_what_one_job_prepares(tasks: int, extra: list[str], corpus: Path, tiny_model: Path,
                                              tmp_path: Path) -> None:
    one = _run(tmp_path, "one", tiny_model, corpus, extra)
    many = _run(tmp_path, "many", tiny_model, corpus, extra)
    single, array = _prepare(one, 1), _prepare(many, tasks)
    written = _files(many)
    _same(one, many)
    assert array["result"] | {"seconds": 0} == single["result"] | {"seconds": 0}
    assert array["inputs"] == single["inputs"] and array["settings"]["sources"][0]["path"] == str(corpus / "*.txt")
    assert array["tasks"] == tasks and [s["task"] for s in array["shards"]] == list(range(tasks))
    shares = [s["rows"] for s in array["shards"]]
    assert shares[0][0] == 0 and all(a[1] == b[0] for a, b in zip(shares, shares[1:], strict=False))
    assert shares[-1][1] == single["result"]["conversations"]
    assert all(s["tokens"] > 0 and s["tokens_per_s"] > 0 for s in array["shards"])
    assert not any("files" in s for s in array["shards"]), "two sources: every task reads the whole mixture"
    assert not list(many.glob(".prepared.*")), "the shards are removed once packed, or moved into prepared/"
    files = _files(many / "prepared")
    shuffled = "train.sft.shuffle_dataset=true" in extra
    names = [f"shard-{k:05d}" for k in range(tasks)]
    assert array["shard_files"] == names
    if "data.packing=false" not in extra:  # no packed copy: prepared/ holds the shards, the plan and the record
        assert array["layout"] == "plan" and array["version"] == 2
        assert {f.split("/")[0] for f in files} == {*names, "plan", "slurmft-prepared.json"}
        plan = {f: n for f, n in files.items() if f.startswith("plan/")}
        assert sorted(plan) == sorted(f"plan/{a}.npy" for a in ("source", "start", "stop", "offsets",
                                                                *(["order"] if shuffled else [])))
        packed = sum(n for f, n in _files(one / "prepared").items() if f.endswith(".arrow"))
        assert sum(plan.values()) < 0.25 * packed, (plan, packed)  # 8 bytes a piece's field, not 4 bytes a token
        rows = trained_rows(many)
        assert sum(len(r) for r in rows[:]["input_ids"]) == single["result"]["tokens"]  # read through, every row
        assert _files(many) == written, "gathering the packed rows writes nothing (no cache, no index file)"
    else:  # no concatenated copy: prepared/ holds the shards themselves and the order
        assert array["layout"] == "shards" and array["order"] == ("order.npy" if shuffled else None)
        assert {f.split("/")[0] for f in files} == {*names, "slurmft-prepared.json", *(["order.npy"] if shuffled else [])}
        one_set = _files(one / "prepared")
        shard_bytes = sum(n for f, n in files.items() if f.endswith(".arrow"))
        assert shard_bytes <= 1.1 * sum(n for f, n in one_set.items() if f.endswith(".arrow"))  # the rows once
        rows = trained_rows(many)
        assert sum(len(r["input_ids"]) for r in rows) == single["result"]["tokens"]  # read through, every row
        assert _files(many) == written, "reading the shards writes nothing (no cache, no indices file)"


@pytest.fixture(scope="module")
def blocks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Nine text files, some gzipped, of 1 to 6 blank-line-separated blocks (one blank: dropped), sizes uneven."""
    import gzip

    rng = random.Random(5)
    root = tmp_path_factory.mktemp("array-blocks")
    for i in range(9):
        text = "\n\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.choice((4, 25, 120))))
                           for _ in range(rng.randint(1, 6)))
        text += "\n\n   \n\nend\n" if i == 4 else "\n"
        if i % 3 == 2:
            (root / f"part{i}.txt.gz").write_bytes(gzip.compress(text.encode()))
        else:
            (root / f"part{i}.txt").write_text(text)
    return root


def test_tasks_of_one_text_source_read_only_their_files(blocks: Path, tiny_model: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """One plain-text source of nine files: each of 2 (then 3) tasks reads only its contiguous share of the files (the
    files handed to datasets' ``load_dataset``, seen here), and the set they make is bitwise one job's."""
    import datasets

    read: list[list[str]] = []
    real = datasets.load_dataset

    def seen(*args, **kwargs):  # datasets' own loader, the files it is asked for noted
        read.append([str(f) for f in kwargs.get("data_files") or []])
        return real(*args, **kwargs)

    monkeypatch.setattr(datasets, "load_dataset", seen)
    sources = [{"path": str(blocks / "*.txt*"), "documents": "blank_line"}]
    every = [str(p) for p in sorted(blocks.glob("*.txt*"))]
    one = write_run(tmp_path / "one", tiny_model, [f"data.max_seq_length={SEQ}", "prepare.enabled=true"],
                    edit=lambda d: d["data"].update(datasets=sources))
    single = _prepare(one, 1)
    assert read == [every]
    for tasks in (2, 3):
        read.clear()
        many = write_run(tmp_path / f"many{tasks}", tiny_model, [f"data.max_seq_length={SEQ}", "prepare.enabled=true"],
                         edit=lambda d: d["data"].update(datasets=sources))
        array = _prepare(many, tasks)
        _same(one, many)
        assert array["result"] | {"seconds": 0} == single["result"] | {"seconds": 0}
        assert array["inputs"] == single["inputs"]
        shards = array["shards"]
        assert len(read) == tasks and [f for files in read for f in files] == every  # each file read once, in order
        assert [every[slice(*s["files"])] for s in shards] == read  # the record names the files each task read
        assert all(len(files) < len(every) for files in read)
        assert sum(s["rows"][1] - s["rows"][0] for s in shards) == single["result"]["conversations"]
        assert all(s["sequences"] > 0 and s["load_seconds"] >= 0 for s in shards)


def test_a_share_of_blank_files_is_an_empty_shard(tiny_model: Path, tmp_path: Path) -> None:
    """A ``format: text`` source whose first file holds only blank or null texts: with two tasks the first task's
    share has no document (one job drops them with the others'); its shard is empty and the set is one job's."""
    import json

    corpus = tmp_path / "rows"
    corpus.mkdir()
    (corpus / "a.jsonl").write_text(f"{json.dumps({'body': None})}\n{json.dumps({'body': '  '})}\n")
    (corpus / "b.jsonl").write_text("".join(json.dumps({"body": " ".join(WORDS[i:i + 9])}) + "\n" for i in range(6)))
    sources = [{"path": str(corpus / "*.jsonl"), "format": "text", "columns": {"text": "body"}}]
    runs = [write_run(tmp_path / name, tiny_model, [f"data.max_seq_length={SEQ}", "prepare.enabled=true"],
                      edit=lambda d: d["data"].update(datasets=sources)) for name in ("one", "many")]
    single = _prepare(runs[0], 1)
    record = _prepare(runs[1], 2)
    _same(*runs)
    assert [(s["files"], s["rows"], s["sequences"]) for s in record["shards"]] == [([0, 1], [0, 0], 0),
                                                                                  ([1, 2], [0, 6], 6)]
    assert record["result"] | {"seconds": 0} == single["result"] | {"seconds": 0}


def test_file_shares_cover_the_files_once_by_bytes() -> None:
    from slurmft.job.prepare_array import file_share

    for sizes in ([1] * 12, [5, 1, 1, 1, 1, 1, 1, 9], [100, 1, 1, 1], [1, 1, 1, 100], list(range(1, 20))):
        for tasks in range(1, 5):
            got = [file_share(sizes, k, tasks) for k in range(tasks)]
            assert [i for r in got for i in r] == list(range(len(sizes))) and all(got)
    assert [sum(range(1, 20)[i] for i in file_share(list(range(1, 20)), k, 4)) for k in range(4)] == [45, 46, 45, 54]


def test_array_refuses_shards_of_changed_inputs(corpus: Path, tiny_model: Path, tmp_path: Path) -> None:
    from slurmft.job.prepare_array import run_task

    run = _run(tmp_path, "changed", tiny_model, corpus, [])
    run_task(str(run), 0, 2, "9", num_proc=1)
    doc = corpus / "doc03.txt"
    st = doc.stat()
    try:
        os.utime(doc, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the file "changed" between the two tasks
        with pytest.raises(JobSetupError, match="changed while the prepare array ran"):
            run_task(str(run), 1, 2, "9", num_proc=1)
    finally:
        os.utime(doc, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert not (run / "prepared").exists()
    assert [p.name for p in run.glob(".prepared.*")] == [".prepared.array-9"]  # the failed array's shard 0
    # the next preparation (here one job; an array's packing task does the same) removes what the failed one left
    # (was: kept for ever, up to the size of the tokenized corpus, one more per interrupted array)
    from slurmft.job.prepare import prepare_run

    prepare_run(str(run), num_proc=1)
    assert (run / "prepared").is_dir() and not list(run.glob(".prepared.*"))


def test_shares_cover_the_rows_once() -> None:
    from slurmft.job.prepare_array import share

    for rows in (0, 1, 5, 97):
        for tasks in (1, 2, 4, 7):
            got = [i for k in range(tasks) for i in share(rows, k, tasks)]
            assert got == list(range(rows))


def test_the_local_executor_runs_the_tasks_one_after_another(tiny_model: Path, tmp_path: Path) -> None:
    """``slurmft prepare run.yaml`` with ``prepare.tasks: 2`` on the local executor: two local jobs, one after another,
    each recorded; the set they make is the one one preparation of the same config makes (here, in this process)."""
    import json
    import subprocess
    import sys

    from slurmft.config_loading import load_config
    from slurmft.job.prepare import prepare_run
    from tests.conftest import LOCAL_ARGS, LOCAL_EXAMPLE

    from .helpers import REPO

    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "slurmft.cli", "prepare", str(LOCAL_EXAMPLE), f"output_dir={run}",
                           f"model.name_or_path={tiny_model}", *LOCAL_ARGS, "prepare.tasks=2"],
                          capture_output=True, text=True, timeout=600, cwd=REPO,
                          env={**os.environ, "HF_DATASETS_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "prepare task 1 of 2" in proc.stderr + proc.stdout and "prepare task 2 of 2" in proc.stderr + proc.stdout
    manifest = json.loads((run / "manifest.json").read_text())
    assert [(j["kind"], j.get("task"), j["state"]) for j in manifest["jobs"]] == [
        ("prepare", 0, "COMPLETED"), ("prepare", 1, "COMPLETED")]
    record = json.loads((run / "prepared" / "slurmft-prepared.json").read_text())
    assert record["tasks"] == 2 and len(record["shards"]) == 2
    twin = tmp_path / "twin"
    prepare_run(str(twin), cfg=load_config(LOCAL_EXAMPLE, [f"output_dir={twin}", f"model.name_or_path={tiny_model}",
                                                           *LOCAL_ARGS]))
    assert record["layout"] == "plan"  # the local example packs: the array's plan over its shards
    _same(twin, run)


def test_more_tasks_than_documents_leave_empty_shares_out(tiny_model: Path, tmp_path: Path) -> None:
    """Two documents, four tasks: two shares are empty (no rows to prepare), and the set is still one job's."""
    corpus = tmp_path / "two"
    corpus.mkdir()
    for i, words in enumerate((20, 150)):
        (corpus / f"d{i}.txt").write_text(" ".join(WORDS[(i + n) % len(WORDS)] for n in range(words)) + "\n")
    sources = [{"path": str(corpus / "*.txt")}]
    runs = [write_run(tmp_path / name, tiny_model, [f"data.max_seq_length={SEQ}", "prepare.enabled=true"],
                      edit=lambda d: d["data"].update(datasets=sources)) for name in ("one", "many")]
    _prepare(runs[0], 1)
    record = _prepare(runs[1], 4)
    _same(*runs)
    assert [s["sequences"] > 0 for s in record["shards"]] == [False, True, False, True]


def _steps(run: Path, name: str, until: int | None = None) -> dict[int, dict]:
    import json

    lines = [json.loads(line) for line in (run / name).read_text().splitlines() if line.strip()]
    return {m["step"]: m for m in lines if "step" in m and m.get("event") != "save" and (until is None or m["step"] <= until)}


def _keep_until(run: Path, name: str, step: int) -> None:
    import json

    lines = (run / name).read_text().splitlines()
    (run / name).write_text("".join(f"{line}\n" for line in lines if json.loads(line).get("step", 0) <= step))


@pytest.mark.train
@pytest.mark.parametrize("layout,data", [("shards", ["data.packing=false"]), ("plan", [])],
                         ids=["unpacked", "packed"])
def test_the_train_job_trains_on_the_shards_as_on_one_jobs_set_and_resumes_at_the_next_sequence(
        layout: str, data: list[str], corpus: Path, tiny_model: Path, tmp_path: Path, job_env: dict[str, str]) -> None:
    """Shuffled (TRL's shuffle_dataset), 2 tasks, unpacked or packed (the product's default): the 2-rank train job
    (gloo, FSDP2) reads the shards memory-mapped, through the recorded order (unpacked) or gathering each packed row
    by the recorded plan (packed); its steps' sequences (batches.jsonl's digests) and losses equal those of the run
    prepared by one job. Then its last checkpoint is lost: the relaunch resumes from the one before and trains the
    very next sequences, with the same losses."""
    import shutil

    from .helpers import launch, launch_like_srun

    extra = [*data, "train.sft.shuffle_dataset=true", "train.max_steps=4", "checkpoint.every_steps=2",
             "train.per_device_batch_size=2", "train.gradient_accumulation_steps=1", "train.warmup_ratio=0"]
    one, many = _run(tmp_path, "one", tiny_model, corpus, extra), _run(tmp_path, "many", tiny_model, corpus, extra)
    _prepare(one, 1)
    assert _prepare(many, 2)["layout"] == layout
    for run in (one, many):
        rc, out = launch(run, job_env).wait(timeout=300)
        assert rc == 0, out[-6000:]
    assert "2 shards memory-mapped" in out, out[-3000:]
    want_b, want_m = _steps(one, "batches.jsonl"), _steps(one, "metrics.jsonl")
    got_b = _steps(many, "batches.jsonl")
    assert sorted(want_b) == [1, 2, 3, 4]
    assert [got_b[s]["digest"] for s in want_b] == [want_b[s]["digest"] for s in want_b]  # the same sequences
    assert [_steps(many, "metrics.jsonl")[s]["loss"] for s in want_b] == [want_m[s]["loss"] for s in want_b]

    shutil.rmtree(many / "checkpoints" / "checkpoint-4")  # lost: the relaunch resumes from step 2
    for name in ("batches.jsonl", "metrics.jsonl"):
        _keep_until(many, name, 2)
    rc, out = launch_like_srun(many, job_env, job_id="4343", restart=1).wait(timeout=300)
    assert rc == 0, out[-6000:]
    assert "resuming from checkpoint-2" in out, out[-3000:]
    got_b, got_m = _steps(many, "batches.jsonl"), _steps(many, "metrics.jsonl")
    assert [got_b[s]["digest"] for s in (3, 4)] == [want_b[s]["digest"] for s in (3, 4)]  # the next sequences
    assert [got_m[s]["loss"] for s in (3, 4)] == [want_m[s]["loss"] for s in (3, 4)]
