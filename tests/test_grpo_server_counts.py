"""``grpo.rollouts: server`` counted on the login side: every place that derives a world size from the allocation
uses the training ranks (``RunConfig.train_world_size``: the server node's GPUs are vLLM's), because that is what the
job trains with and what its checkpoints record (``world_size`` in COMPLETE: the step's ranks). Pure, no torch.
"""

from __future__ import annotations

from pathlib import Path

from slurmft.checkpoints import mark_complete
from slurmft.config_loading import dump_config, load_config
from slurmft.plan.elastic import BatchShape, allocation
from slurmft.rundir import RunPaths
from slurmft.submit.resume import resume_config, saved_shape
from slurmft.watch.progress import allocation_words

HERE = Path(__file__).parent
SERVER = HERE / "data" / "golden-grpo-server.yaml"  # 3 nodes x 8 GPUs: 2 train (16 ranks), 1 serves
EXAMPLE = HERE.parent / "examples" / "tiny" / "run.yaml"


def test_an_attempt_records_the_training_ranks_and_the_server_node() -> None:
    record = allocation(load_config(SERVER))
    assert record == {"nodes": 3, "ranks_per_node": 8, "world_size": 16, "server_nodes": 1,
                      "per_device_batch_size": 4, "gradient_accumulation_steps": 1}
    assert allocation_words(record) == " on 2 training nodes x 8 ranks + 1 vLLM server node"
    plain = allocation(load_config(EXAMPLE))  # no server: as before, no server_nodes key
    assert plain["world_size"] == 2 and "server_nodes" not in plain
    assert allocation_words(plain) == " on 1 node x 2 ranks"


def test_a_resume_of_a_server_run_compares_training_ranks(tmp_path: Path) -> None:
    """On the same allocation nothing is reshaped (the checkpoint says 16 ranks; counting the allocation's 24 would
    call it another world size and refit the batch); on 5 nodes the 32 training ranks keep the global batch."""
    paths = RunPaths.of(tmp_path / "run")
    cfg = load_config(SERVER, [f"output_dir={paths.root}"])
    assert saved_shape(cfg, None) == BatchShape(16, 4, 1)
    paths.root.mkdir()
    paths.config.write_text(dump_config(cfg))
    ckpt = paths.checkpoints / "checkpoint-10"
    ckpt.mkdir(parents=True)
    mark_complete(ckpt, step=10, world_size=16, per_device_batch_size=4, gradient_accumulation_steps=1,
                  global_batch=64)
    said: list[str] = []
    same = resume_config(paths, [], "slurm", ckpt, said.append)
    assert said == [] and (same.train.per_device_batch_size, same.train.gradient_accumulation_steps) == (4, 1)
    bigger = resume_config(paths, ["resources.nodes=5"], "slurm", ckpt, said.append)
    assert (bigger.train_world_size, bigger.train.per_device_batch_size, bigger.train.gradient_accumulation_steps) \
        == (32, 2, 1)
    assert said == ["checkpoint-10 was trained on 16 ranks, this attempt runs on 32: global batch of 64 sequences "
                    "per step kept (16 ranks x 4 x 1 accumulation -> 32 ranks x 2 x 1 accumulation); the model and "
                    "optimizer are resharded at load"]


def test_validate_counts_the_batch_on_the_training_ranks() -> None:
    from slurmft.plan.checks import batch_notes

    lines = batch_notes(load_config(SERVER), [], None)
    assert lines[0].startswith("batch: 16 rank(s) x 4 x 1 steps per generation = 64 completions per generation "
                               "(8 prompts x 8)")


def test_the_servers_lines_are_not_training_rank_0s() -> None:
    """The server step is not labelled (srun would number its lines 0:, as training rank 0's): ``slurmft logs
    --rank 0`` shows the rank's lines only, the whole log both."""
    from slurmft.plan.render import render_scripts
    from slurmft.profiles import load_profile
    from slurmft.watch.logs import rank_lines

    cfg = load_config(SERVER)
    script = render_scripts(cfg, load_profile(cfg.cluster.profile), RunPaths.of(cfg.output_dir), "x.yaml")["train"]
    server_step = next(line for line in script.splitlines() if "slurmft.job.vllm_server" in line)
    train_step = next(line for line in script.splitlines() if "slurmft.job.launch" in line)
    assert "--label" not in server_step and "--label" in train_step
    log = ["[slurmft] job=7 restart=0 nodes=n[1-3]", " 0: [slurmft rank0] rank 0 of 16", "INFO: vLLM API server up",
           " 1: step 1/100"]
    assert rank_lines(log, 0) == ["[slurmft] job=7 restart=0 nodes=n[1-3]", " 0: [slurmft rank0] rank 0 of 16"]
