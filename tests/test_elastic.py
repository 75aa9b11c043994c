"""slurmft/plan/elastic.py: the batch shape a resume on another number of ranks trains with (pure, no torch)."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurmft.checkpoints import mark_complete
from slurmft.config_loading import load_config
from slurmft.errors import ConfigError
from slurmft.plan.elastic import BatchShape, allocation, refit, reshape, world_sizes_for
from slurmft.submit.resume import saved_shape

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "tiny" / "run.yaml"


@pytest.mark.parametrize(
    ("global_batch", "world", "per_device", "expected"),
    [
        (4, 1, 2, BatchShape(1, 2, 2)),  # fewer ranks: more accumulation, the per-device batch kept
        (4, 4, 2, BatchShape(4, 1, 1)),  # one sequence per rank: the per-device batch shrinks
        (16, 2, 2, BatchShape(2, 2, 4)),
        (16, 8, 2, BatchShape(8, 2, 1)),
        (12, 4, 2, BatchShape(4, 1, 3)),  # 3 per rank: 2 does not divide it, 1 does
        (24, 4, 4, BatchShape(4, 3, 2)),  # 6 per rank: the largest per-device batch <= 4 that divides it
        (128, 16, 8, BatchShape(16, 8, 1)),
    ],
)
def test_refit_keeps_the_global_batch(global_batch: int, world: int, per_device: int, expected: BatchShape) -> None:
    shape = refit(global_batch, world, per_device)
    assert shape == expected and shape.global_batch == global_batch


def test_a_world_size_that_does_not_divide_the_global_batch_is_refused_with_the_ones_that_do() -> None:
    with pytest.raises(ConfigError) as info:
        refit(16, 3, 2)
    text = info.value.render()
    assert "resources: 3 ranks cannot keep the global batch of 16 sequences" in text
    assert "choose a world size among 1, 2, 4, 8, 16 ranks" in text
    assert world_sizes_for(128)[-1] == 128 and len(world_sizes_for(5040)) == 12


def test_reshape_at_the_same_world_size_changes_nothing_and_an_explicit_batch_must_keep_it() -> None:
    saved = BatchShape(2, 2, 1)
    assert reshape(saved, 2) is saved
    assert reshape(saved, 1, BatchShape(1, 4, 1)) == BatchShape(1, 4, 1)  # spelled out, same global batch
    with pytest.raises(ConfigError) as info:
        reshape(saved, 1, BatchShape(1, 2, 1))
    assert "global batch of 2 sequences per step" in info.value.render()


def test_the_saved_shape_comes_from_the_marker_then_the_config(tmp_path: Path) -> None:
    cfg = load_config(EXAMPLE, [f"output_dir={tmp_path / 'run'}"])  # 1 node x 2 ranks x 2 x 1
    assert saved_shape(cfg, None) == BatchShape(2, 2, 1)
    old = tmp_path / "checkpoint-6"  # a marker from before the record: only world_size
    old.mkdir()
    mark_complete(old, step=6, world_size=4)
    assert saved_shape(cfg, old) == BatchShape(4, 2, 1)
    new = tmp_path / "checkpoint-8"
    new.mkdir()
    mark_complete(new, step=8, world_size=1, per_device_batch_size=2, gradient_accumulation_steps=4, global_batch=8)
    assert saved_shape(cfg, new) == BatchShape(1, 2, 4)


def test_an_attempt_records_its_allocation(tmp_path: Path) -> None:
    cfg = load_config(EXAMPLE, [f"output_dir={tmp_path / 'run'}", "resources.tasks_per_node=4"])
    assert allocation(cfg) == {"nodes": 1, "ranks_per_node": 4, "world_size": 4, "per_device_batch_size": 2,
                               "gradient_accumulation_steps": 1}


def test_status_and_the_plot_say_where_each_attempt_ran() -> None:
    from slurmft.watch.plot import marker_steps
    from slurmft.watch.progress import allocation_words

    assert allocation_words({"nodes": 2, "ranks_per_node": 1}) == " on 2 nodes x 1 rank"
    assert allocation_words({"nodes": 1, "ranks_per_node": 8}) == " on 1 node x 8 ranks"
    assert allocation_words({"nodes": None, "ranks_per_node": None}) == ""  # a manifest from before the record
    records = [{"step": s, "job_id": "7", "restart": 0, "world_size": 2} for s in (1, 2, 3)]
    records += [{"step": s, "job_id": "9", "restart": 0, "world_size": 1} for s in (4, 5)]
    records += [{"step": 6, "job_id": "9", "restart": 1, "world_size": 1}]
    assert [(m.step, m.label) for m in marker_steps(records)] == [(3, "resumed (job 9)\n2 -> 1 ranks"),
                                                                  (5, "requeued (restart 1)")]


def test_validate_and_estimate_check_a_new_allocation_before_anything_is_queued(
        tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from cli_runner import cli

    from slurmft.config_loading import dump_config
    from slurmft.rundir import RunPaths, new_manifest, write_manifest

    paths = RunPaths.of(tmp_path / "run")
    cfg = load_config(EXAMPLE, [f"output_dir={paths.root}", f"model.name_or_path={tiny_model}",
                                "train.max_steps=12", "checkpoint.every_steps=6"])
    paths.root.mkdir()
    paths.config.write_text(dump_config(cfg))
    write_manifest(paths, new_manifest("tiny", "local", paths.run_id))
    ckpt = paths.checkpoints / "checkpoint-6"
    ckpt.mkdir(parents=True)
    mark_complete(ckpt, step=6, world_size=2, per_device_batch_size=2, gradient_accumulation_steps=1, global_batch=4)
    before = paths.config.read_text(), paths.manifest.read_text()
    note = ("note: checkpoint-6 was trained on 2 ranks, this attempt runs on 1: global batch of 4 sequences per "
            "step kept (2 ranks x 2 x 1 accumulation -> 1 rank x 2 x 2 accumulation)")

    code, out, err = cli(["validate", str(paths.config), "resources.tasks_per_node=1"], capsys)
    assert code == 0, err
    assert note in err and "1 node(s) x 1 rank(s)" in out
    code, out, err = cli(["estimate", str(paths.config), "resources.tasks_per_node=1", "--json"], capsys)
    assert code == 0 and note in err, err
    code, _, err = cli(["estimate", str(paths.config), "resources.tasks_per_node=3"], capsys)
    assert code == 2 and "3 ranks cannot keep the global batch of 4" in err
    code, _, err = cli(["validate", str(paths.config), "train.learning_rate=1"], capsys)  # not what a resume may change
    assert code == 2 and "resume cannot change train.learning_rate" in err
    assert (paths.config.read_text(), paths.manifest.read_text()) == before


def test_a_grpo_run_resumes_on_fewer_ranks_with_its_batch_refitted_first(tmp_path: Path) -> None:
    """A GRPO run of 2 ranks x 2 x 1 (one generation of 4 completions, one group, per step) resumed on 1 rank: the
    refit (1 x 2 x 2) is what the config is checked with. Checking the new allocation with the old batch first
    refused it: 1 x 2 x 1 = 2 completions cannot hold a group of 4 (tests/job/test_grpo_cpu.py resumes it)."""
    from slurmft.config_loading import dump_config
    from slurmft.rundir import RunPaths
    from slurmft.submit.resume import resume_config

    run = tmp_path / "run"
    run.mkdir()
    cfg = load_config(EXAMPLE.parent / "grpo.yaml", [f"output_dir={run}", "grpo.steps_per_generation=null"])
    (run / "config.yaml").write_text(dump_config(cfg))
    notes: list[str] = []
    resumed = resume_config(RunPaths.of(run), ["resources.tasks_per_node=1"], "local", None, notes.append)
    assert (resumed.train_world_size, resumed.train.per_device_batch_size,
            resumed.train.gradient_accumulation_steps) == (1, 2, 2)
    assert resumed.grpo is not None and resumed.grpo.generations_per_step(2) == 2  # the generation batch: 4, kept
    assert "global batch of 4 sequences per step kept" in notes[0]
    with pytest.raises(ConfigError) as refused:  # a batch named by hand is checked as given
        resume_config(RunPaths.of(run), ["resources.tasks_per_node=1", "train.gradient_accumulation_steps=1"],
                      "local", None)
    assert "grpo.num_generations: 4 does not divide the generation batch" in str(refused.value.problems)
