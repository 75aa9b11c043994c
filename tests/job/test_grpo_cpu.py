"""GRPO on real two-rank FSDP2 (gloo, CPU): TRL's losses, rewards and KL, completions sampled the same on every
world size, a frozen sharded reference.

One launch serves every check (tests/job/run_many.py through tests/job/dpo_check.py, which keeps the models the
job builds and reports on them): ``grpo``, the micro model, 2 ranks x 2 completions, 4 completions of one prompt
per step (num_generations 4), beta 0.04 (the reference a second sharded copy), TRL's default loss (dapo), two
rewards of the tests' own (tests/job/grpo_rewards.py: one reads the data's ``answer`` column) with weights, 4
steps. Then the single-process TRL reference (tests/job/grpo_reference.py: transformers + TRL's GRPOTrainer with
its own reference copy, no FSDP, the whole generation batch on one process).

What is compared, exactly: both sides sample through slurmft's seeded sampler (slurmft/job/grpo.py: Gumbel-max
keyed by seed, step, the completion's place in the global generation batch and the token position), so the same
prompts get the same completions on 2 ranks and on 1 process; TRL's own sampling (each rank's RNG stream) would
give others. steps_per_generation is 1, so each step trains on its whole generation batch (TRL shuffles a
generation batch per rank before splitting it into steps: with more than one step per generation the steps' halves
differ between shapes, not the sums). Rewards, advantages, loss, KL and the logged metrics are TRL's on both sides.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from .helpers import REPO, launch_like_srun, read_metrics, write_run

pytestmark = pytest.mark.train

STEPS, EVERY = 4, 2
HERE = Path(__file__).resolve().parent
PROMPTS = REPO / "examples" / "tiny" / "data" / "prompts.jsonl"
RUN_ARGS = [f"train.max_steps={STEPS}", f"checkpoint.every_steps={EVERY}", "checkpoint.keep_last=2",
            "checkpoint.async=false", "data.max_seq_length=64", "train.per_device_batch_size=2",
            "train.learning_rate=1e-3", "train.warmup_ratio=0.0"]
REWARDS = [{"function": f"{HERE / 'grpo_rewards.py'}:shared_letters", "weight": 1.0},
           {"function": f"{HERE / 'grpo_rewards.py'}:length", "weight": 0.5}]
#: the metrics compared with TRL's (TRL's names)
COMPARED = ("reward", "reward_std", "rewards/shared_letters/mean", "rewards/length/mean", "kl",
            "completions/mean_length")


@pytest.fixture(scope="module")
def grpo_runs(micro_model: Path, job_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("grpo")

    def on_prompts(cfg: dict) -> None:
        cfg["data"]["datasets"] = [{"path": str(PROMPTS)}]
        cfg["grpo"] = {"num_generations": 4, "max_completion_length": 8, "beta": 0.04, "rewards": REWARDS}

    runs = {"grpo": write_run(root / "grpo", micro_model, RUN_ARGS, edit=on_prompts)}
    check = "call:tests.job.dpo_check:main:{run}:" + str(root) + "/check-{name}"
    _, out = launch_like_srun(root / "first", job_env, program=[str(HERE / "run_many.py")],
                              args=[check.format(run=runs["grpo"], name="grpo")]).wait(timeout=600)
    for path in sorted(root.glob("*.failed.rank*")):
        pytest.fail(path.read_text()[-4000:])
    reference = subprocess.run([sys.executable, str(HERE / "grpo_reference.py"), str(runs["grpo"]),
                                str(root / "reference.json")], env=job_env, capture_output=True, text=True,
                               timeout=600, check=False)
    assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-3000:]
    return {"runs": runs, "root": root, "log": out,
            "trl": json.loads((root / "reference.json").read_text())["logs"]}


def _check(where: Path) -> list[dict[str, Any]]:
    return [json.loads((where / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_losses_rewards_and_kl_equal_trls_own_grpo_trainer_on_one_process(grpo_runs: dict[str, Any]) -> None:
    ours, theirs = read_metrics(grpo_runs["runs"]["grpo"]), grpo_runs["trl"]
    assert len(ours) == len(theirs) == STEPS
    for mine, other in zip(ours, theirs, strict=True):
        assert mine["loss"] == pytest.approx(other["loss"], abs=2e-6), (mine, other)
        assert mine["grad_norm"] == pytest.approx(other["grad_norm"], rel=1e-4), (mine, other)
        for key in COMPARED:
            assert mine[key] == pytest.approx(other[key], rel=1e-5, abs=1e-6), (key, mine, other)
    assert ours[0]["kl"] == 0.0  # step 1: the policy is the reference
    assert all(m["kl"] > 0 for m in ours[1:])  # it moved (lr 1e-3): the KL term is measured, not zero by construction
    assert len({m["reward"] for m in ours}) == STEPS  # other prompts and completions every step
    assert all(m["reward_std"] > 0 for m in ours)  # the groups' rewards differ: the advantages are not all zero


def test_the_policy_and_the_reference_are_fsdp2_shards_and_the_reference_never_moves(
        grpo_runs: dict[str, Any]) -> None:
    reports = _check(grpo_runs["root"] / "check-grpo")
    for report in reports:
        assert report["summary"]["status"] == "completed"
        policy, reference = (next(m for m in report["models"] if m["frozen"] is f) for f in (False, True))
        for model in (policy, reference):
            assert model["all_dtensor"], model
            assert 0 < model["local_numel"] < model["total_numel"]  # each rank holds a part
        assert policy["changed"] and not reference["changed"]
        assert not reference["requires_grad"] and not reference["with_grad"]
    marker = json.loads((grpo_runs["runs"]["grpo"] / "checkpoints" / f"checkpoint-{STEPS}" / "COMPLETE").read_text())
    assert marker["method"] == "grpo"


def test_metrics_jsonl_keeps_the_reward_per_function_kl_and_completion_length(grpo_runs: dict[str, Any]) -> None:
    for record in read_metrics(grpo_runs["runs"]["grpo"]):
        assert {"loss", "grad_norm", *COMPARED, "clip_ratio/region_mean"} <= set(record), record
