"""slurmft.checkpoints (torch-free): which checkpoints are complete, pruning, damage and set-aside."""

from __future__ import annotations

from pathlib import Path

from slurmft import checkpoints


def test_only_complete_checkpoints_count(tmp_path: Path) -> None:
    for step in (5, 10, 15):
        (tmp_path / f"checkpoint-{step}").mkdir()
    (tmp_path / "checkpoint-x").mkdir()
    checkpoints.mark_complete(tmp_path / "checkpoint-5", restart=0)
    checkpoints.mark_complete(tmp_path / "checkpoint-10", restart=1)
    assert checkpoints.latest_complete(tmp_path) == tmp_path / "checkpoint-10"  # 15 is a torn save
    assert [(s, ok) for s, _, ok in checkpoints.list_checkpoints(tmp_path)] == [(5, True), (10, True), (15, False)]
    assert checkpoints.latest_complete(tmp_path / "missing") is None


def test_prune_keeps_the_newest_complete_and_hides_before_deleting(tmp_path: Path) -> None:
    for step in (2, 4, 6, 8):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "shard").write_text("x")
    for step in (2, 4, 6):
        checkpoints.mark_complete(tmp_path / f"checkpoint-{step}")
    (tmp_path / ".deleting-checkpoint-0").mkdir()  # left over by a rank 0 killed mid-delete
    removed = checkpoints.prune(tmp_path, keep_last=2)
    assert sorted(p.name for p in removed) == ["checkpoint-2", "checkpoint-8"]  # too old; torn
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4", "checkpoint-6"]
    assert checkpoints.prune(tmp_path) == []  # without keep_last every complete checkpoint stays


def test_prune_decides_at_once_and_leaves_the_deleting_to_whom_it_is_given(tmp_path: Path) -> None:
    for step in (2, 4, 6):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "shard").write_text("x")
        checkpoints.mark_complete(tmp_path / f"checkpoint-{step}")
    later: list[Path] = []  # what the train job's background writer would delete
    assert checkpoints.prune(tmp_path, keep_last=2, delete=later.append) == [tmp_path / "checkpoint-2"]
    assert later == [tmp_path / ".deleting-checkpoint-2"] and later[0].is_dir()  # hidden now, deleted later
    assert checkpoints.latest_complete(tmp_path) == tmp_path / "checkpoint-6"
    assert [s for s, _, _ in checkpoints.list_checkpoints(tmp_path)] == [4, 6]  # a hidden one never counts
    checkpoints.prune(tmp_path, keep_last=2)  # the next call deletes what is still there
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4", "checkpoint-6"]


def _saved(root: Path, step: int, shard: bytes = b"x" * 100) -> Path:
    ckpt = root / f"checkpoint-{step}"
    (ckpt / "pytorch_model_fsdp_0").mkdir(parents=True)
    (ckpt / "pytorch_model_fsdp_0" / "__0_0.distcp").write_bytes(shard)
    (ckpt / "trainer_state.json").write_text("{}")
    checkpoints.make_durable(ckpt, 0)
    checkpoints.mark_complete(ckpt, step=step, save_s=0.5)
    return ckpt


def test_complete_lists_every_file_and_a_damaged_checkpoint_is_skipped_saying_why(tmp_path: Path) -> None:
    import json

    older, newer = _saved(tmp_path, 10), _saved(tmp_path, 20)
    marker = json.loads((newer / "COMPLETE").read_text())
    assert marker["files"] == {"pytorch_model_fsdp_0/__0_0.distcp": 100, "trainer_state.json": 2}
    assert marker["bytes"] == 102 and marker["save_s"] == 0.5 and marker["step"] == 20
    assert checkpoints.latest_complete(tmp_path) == newer
    with open(newer / "pytorch_model_fsdp_0" / "__0_0.distcp", "r+b") as f:
        f.truncate(40)
    assert checkpoints.latest_complete(tmp_path) == older
    assert checkpoints.damaged(tmp_path) == [
        (newer, "pytorch_model_fsdp_0/__0_0.distcp is 40 bytes, COMPLETE says 100")]
    (newer / "trainer_state.json").unlink()
    assert checkpoints.problem(newer) == "pytorch_model_fsdp_0/__0_0.distcp is 40 bytes, COMPLETE says 100"
    assert checkpoints.prune(tmp_path, keep_last=2) == [newer]  # a verified one remains: the damaged one goes
    assert checkpoints.latest_complete(tmp_path) == older


def test_a_torn_or_damaged_checkpoint_is_never_deleted_while_it_is_the_only_one(tmp_path: Path) -> None:
    only = _saved(tmp_path, 10)
    (only / "trainer_state.json").unlink()
    torn = tmp_path / "checkpoint-15"
    torn.mkdir()
    assert checkpoints.latest_complete(tmp_path) is None
    assert checkpoints.prune(tmp_path, keep_last=1) == [] and only.is_dir() and torn.is_dir()
    good = [_saved(tmp_path, s) for s in (20, 30, 40)]
    assert checkpoints.prune(tmp_path, keep_last=2) == [only, torn, good[0]]  # keep_last *verified* ones
    assert [p.name for p in checkpoints.verified(tmp_path)] == ["checkpoint-30", "checkpoint-40"]


def test_a_checkpoint_that_failed_to_load_is_set_aside_and_the_one_fallen_back_to_is_kept(tmp_path: Path) -> None:
    import json

    older, bad = _saved(tmp_path, 10), _saved(tmp_path, 20)
    aside = checkpoints.set_aside(bad, ["the model (pytorch_model_fsdp_0/): rank 1: UnpicklingError"], restart=1)
    assert aside.name == "unloadable-checkpoint-20" and not bad.exists()
    note = json.loads((aside / checkpoints.LOAD_FAILED_NOTE).read_text())
    assert note["problems"] == ["the model (pytorch_model_fsdp_0/): rank 1: UnpicklingError"] and note["restart"] == 1
    assert checkpoints.verified(tmp_path) == [older] and checkpoints.unloadable(tmp_path) == [aside]
    newer = [_saved(tmp_path, s) for s in (20, 30)]  # the fallback saved step 20 again: a fresh directory
    assert checkpoints.prune(tmp_path, keep_last=2, protect=(older,)) == [aside]  # keep_last 2 would take older
    assert checkpoints.verified(tmp_path) == [older, *newer]
    assert checkpoints.prune(tmp_path, keep_last=2) == [older]  # a later attempt protects nothing


def test_old_markers_without_a_file_list_are_still_trusted(tmp_path: Path) -> None:
    ckpt = tmp_path / "checkpoint-5"
    ckpt.mkdir()
    (ckpt / "COMPLETE").write_text('{"t": 1, "step": 5}\n')
    assert checkpoints.latest_complete(tmp_path) == ckpt
    (ckpt / "COMPLETE").write_text("not json")
    assert "unreadable" in checkpoints.problem(ckpt)


def test_each_rank_makes_only_its_own_files_durable_and_rank_0_the_rest(tmp_path: Path) -> None:
    """Two ranks' checkpoint: a rank fsyncs its DCP shards and rng state; rank 0 also the shared files and the
    directories. The count is what the save costs in fsync calls (every file on every rank before)."""
    ckpt = tmp_path / "checkpoint-4"
    for sub in ("pytorch_model_fsdp_0", "optimizer_0"):
        (ckpt / sub).mkdir(parents=True)
        for name in (".metadata", "__0_0.distcp", "__1_0.distcp"):
            (ckpt / sub / name).write_bytes(b"x")
    for name in ("rng_state_0.pth", "rng_state_1.pth", "scheduler.pt", "trainer_state.json", "config.json"):
        (ckpt / name).write_bytes(b"x")
    assert [checkpoints.owner(n) for n in ("__1_0.distcp", "__12_3.distcp", "rng_state_7.pth", ".metadata",
                                           "rng_state.pth", "scheduler.pt")] == [1, 12, 7, 0, 0, 0]
    assert checkpoints.make_durable(ckpt, 1) == 3  # two shards, one rng state
    assert checkpoints.make_durable(ckpt, 0) == 3 + 2 + 3 + 3  # its own, the .metadata files, shared files, dirs
