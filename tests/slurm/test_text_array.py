"""Plain text prepared by a prepare job array on the real two-node cluster (``prepare.tasks``; docs/text.md).

Two runs of one continued-pretraining config (a globbed .txt corpus, packed), submitted side by side: one prepared by
a 2-task prepare array and preempted once by the warning signal, one prepared by one prepare job and left alone.
They must end with bitwise-equal models. With the rows the train job reads from the two ``prepared/`` sets also equal
(asserted: the array's packed rows gathered from its shards by the packing plan, as its train job read them), the
second run is the first one's uninterrupted twin as well: a 2-task twin would train on the very same rows. So one
pair of runs shows both: the array changes nothing that trains, and the preemption changes nothing either. A second
pair, submitted with them, does the same unpacked (``data.packing: false``, TRL's shuffle on), where the array's
shards stay as ``prepared/``'s files and both nodes read them memory-mapped through the recorded order.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest
import yaml

from slurmft.rundir import RunPaths
from tests.slurm import jobs

pytestmark = pytest.mark.slurm

TRAIN = {"max_steps": 8}
#: the unpacked pair: the array's shards stay as prepared/'s files, read through TRL's shuffle as an order
UNPACKED = {"packing": False}
CHECKPOINT = {"every_steps": 2, "keep_last": 2}
RESOURCES = {"cpus_per_task": 1, "mem": "2G", "time": "00:10:00"}
WORDS = ["the", "of", "and", "to", "in", "a", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on", "not",
         "he", "this", "are", "or", "his", "from", "at", "which", "node", "rank", "shard", "token", "signal"]


def _corpus(root: Path) -> Path:
    """Thirty documents, one a file, some longer than max_seq_length (cut into pieces)."""
    rng = random.Random(11)
    root.mkdir()
    for i in range(30):
        words = rng.choice((8, 25, 60, 140))
        (root / f"doc{i:02d}.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(words)) + "\n")
    return root


@pytest.fixture(scope="module")
def text_runs(slurm_cluster, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, config_writer) -> dict:
    tmp = tmp_path_factory.mktemp("text-array")
    corpus = _corpus(tmp / "corpus")
    started, runs = {}, {}
    for name, tasks, data in (("array", 2, {}), ("one", 1, {}), ("array-unpacked", 2, UNPACKED), ("one-unpacked", 1, UNPACKED)):
        (tmp / name).mkdir()
        path = config_writer.write_config(tmp / name, tiny_model, corpus / "*.txt", train=TRAIN, checkpoint=CHECKPOINT,
                                          prepare={"tasks": tasks, "resources": RESOURCES}, data=data)
        if data:  # TRL's shuffle on: the order the shards are read in matters
            cfg = yaml.safe_load(path.read_text())
            cfg["train"]["sft"] = {"shuffle_dataset": True}
            path.write_text(yaml.safe_dump(cfg))
        runs[name] = tmp / name / "run"
        started[name] = jobs.started_here(["submit", str(path)])
    pending, deadline = ["array", "array-unpacked"], time.time() + 300
    while pending and time.time() < deadline:  # each array's run preempted once, as soon as it has trained step 2
        for name in [n for n in pending if any(m["step"] >= 2 for m in jobs.metrics(runs[n]))]:
            jobs.signal_rank_steps(started[name]["train"])
            pending.remove(name)
        time.sleep(0.5)
    assert not pending, f"no step 2 within 300 s: {pending}"
    for name in ("array", "array-unpacked"):
        jobs.wait_for("restart 1", lambda n=name: jobs.restarts(started[n]["train"]) >= 1, timeout=120)
    for ids in started.values():
        slurm_cluster.wait_state(ids["train"], "COMPLETED", timeout=400)
        slurm_cluster.wait_state(ids["consolidate"], "COMPLETED", timeout=240)
    return {"runs": runs, "jobs": started}


def test_a_text_run_prepared_by_a_2_task_array_and_preempted_equals_one_prepared_by_one_job(
        text_runs: dict, slurm_cluster, slurmft) -> None:
    from slurmft.job.prepare import read_prepared

    runs, started = text_runs["runs"], text_runs["jobs"]
    array = started["array"]["prepare"]
    for k in range(2):  # the array's tasks, each with its own log: its share, its tokens/s
        slurm_cluster.wait_state(f"{array}_{k}", "COMPLETED", timeout=30, via="sacct")
        log = (runs["array"] / "logs" / f"prepare-{array}_{k}.out").read_text(errors="replace")
        assert f"task {k} of 2:" in log and "tokens/s" in log, log[-2000:]
    script = (runs["array"] / "scripts" / "prepare.sbatch").read_text()
    assert "#SBATCH --array=0-1" in script
    manifest = json.loads(RunPaths.of(runs["array"]).manifest.read_text())
    train = next(j for j in manifest["jobs"] if j["kind"] == "train")
    assert train["dependency"] == f"afterok:{array}"  # the whole array
    record = json.loads(RunPaths.of(runs["array"]).prepared_record.read_text())
    assert record["tasks"] == 2 and [s["task"] for s in record["shards"]] == [0, 1]
    assert {s["job_id"] for s in record["shards"]} == {f"{array}_0", f"{array}_1"}
    one = json.loads(RunPaths.of(runs["one"]).prepared_record.read_text())
    assert record["result"] | {"seconds": 0} == one["result"] | {"seconds": 0}
    assert record["layout"] == "plan" and record["shard_files"] == ["shard-00000", "shard-00001"]
    a = read_prepared(RunPaths.of(runs["array"]).prepared, record)  # the shards, packed by the plan when read
    b = read_prepared(RunPaths.of(runs["one"]).prepared, one)  # the packed rows one prepare job wrote
    assert len(a) == len(b) and a[:] == b[:]  # the packs the train jobs read, row for row, in their order
    assert not list(RunPaths.of(runs["array"]).prepared.glob("*.arrow"))  # no packed copy: the shards and the plan
    assert not list(runs["array"].glob(".prepared.*"))  # the shards moved into prepared/

    steps = jobs.metrics(runs["array"])
    assert sorted(m["step"] for m in steps) == list(range(1, TRAIN["max_steps"] + 1))
    assert {m["restart"] for m in steps} == {0, 1}  # preempted between two steps it logged
    rows = slurmft.status_json(runs["array"])
    assert rows["prepare"]["job_id"] == array and rows["prepare"]["state"] == "COMPLETED"
    slurmft.assert_same_model(RunPaths.of(runs["array"]).model, RunPaths.of(runs["one"]).model)


def test_unpacked_the_array_s_shards_train_preempted_as_one_job_s_set(text_runs: dict, slurmft) -> None:
    """Unpacked (``data.packing: false``, TRL's shuffle on): the array's shards are prepared/'s own files, read
    memory-mapped through the order on both nodes; preempted once, the run ends bitwise equal to the one prepared by
    one job."""
    from slurmft.job.prepare import read_prepared

    runs = text_runs["runs"]
    paths = {n: RunPaths.of(runs[n]) for n in ("array-unpacked", "one-unpacked")}
    record = json.loads(paths["array-unpacked"].prepared_record.read_text())
    assert record["layout"] == "shards" and record["shard_files"] == ["shard-00000", "shard-00001"]
    assert record["order"] == "order.npy" and not list(paths["array-unpacked"].prepared.glob("*.arrow"))
    one = json.loads(paths["one-unpacked"].prepared_record.read_text())
    a = read_prepared(paths["array-unpacked"].prepared, record)
    b = read_prepared(paths["one-unpacked"].prepared, one)
    assert a.with_format("arrow")[:].equals(b.with_format("arrow")[:])  # the rows the trainer reads, in its order
    steps = jobs.metrics(runs["array-unpacked"])
    assert sorted(m["step"] for m in steps) == list(range(1, TRAIN["max_steps"] + 1))
    assert {m["restart"] for m in steps} == {0, 1}
    train_log = "".join(p.read_text(errors="replace") for p in (runs["array-unpacked"] / "logs").glob("train-*.out"))
    assert "2 shards memory-mapped" in train_log, train_log[-2000:]
    slurmft.assert_same_model(paths["array-unpacked"].model, paths["one-unpacked"].model)
