"""GRPO on the real two-node cluster (docs/grpo.md): a full fine-tune (its frozen sharded reference, beta 0.04) and
LoRA-GRPO (the reference the base with the adapters disabled), each preempted once by the warning signal inside a
generation beside its uninterrupted twin. The product's defaults: a prepare job first, consolidation after.

All four runs are submitted at once (2 ranks on one node each, the micro model, 4 steps, ``steps_per_generation:
2``: steps 3 and 4 train the two halves of the generation made at step 3). The preempted runs' reward
(tests/slurm/grpo_rewards.py) holds step 3's generation until the warning signal, sent by ``scancel --signal=USR2``
as Slurm sends it, has reached every rank; the ranks stop after step 3 and save checkpoint-3 with their rollouts,
the batch script requeues the job under the same id, the next attempt trains step 4 on the second half of those
rollouts, and the run ends bitwise equal to its twin: every step's loss, gradient norm, rewards and KL, the
consolidated model, and for LoRA the adapter too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.slurm.jobs import metrics, restarts, signal_rank_steps, wait_for

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ROOT / "examples" / "tiny" / "data" / "prompts.jsonl"
REWARDS = [{"function": f"{ROOT / 'tests' / 'job' / 'grpo_rewards.py'}:shared_letters", "weight": 1.0},
           {"function": f"{Path(__file__).resolve().parent / 'grpo_rewards.py'}:length", "weight": 0.5}]
SECTIONS = {
    "train": {"max_steps": 4, "per_device_batch_size": 2},
    "checkpoint": {"every_steps": 2, "keep_last": 2},  # checkpoint-3 can only be the warning signal's
    "resources": {"nodes": 1, "gpus_per_node": 2},  # 2 ranks on one node: the four runs share the two nodes
    "grpo": {"num_generations": 4, "max_completion_length": 8, "beta": 0.04, "steps_per_generation": 2,
             "rewards": REWARDS},
}
VARIANTS = {"full": {}, "lora": {"lora": {"r": 4, "alpha": 8}}}
#: what each step logs that must be the same bit for bit (TRL's names)
KEYS = ("loss", "grad_norm", "reward", "reward_std", "rewards/shared_letters/mean", "rewards/length/mean", "kl",
        "completions/mean_length")


@pytest.fixture(scope="module")
def grpo_runs(slurm_cluster, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory,
              config_writer) -> dict[str, Any]:
    """{variant: {"twin": run, "preempted": run, "jobs": the preempted run's jobs, "hold": its hold folder}}."""
    from slurmft.config_loading import load_config
    from slurmft.profiles import load_profile
    from slurmft.submit.dispatch import submit_run

    root = tmp_path_factory.mktemp("grpo")
    runs: dict[str, Any] = {}
    with pytest.MonkeyPatch.context() as env:
        for variant, sections in VARIANTS.items():
            runs[variant] = {}
            for name in ("twin", "preempted"):
                where = root / variant / name
                where.mkdir(parents=True)
                if name == "preempted":  # sbatch passes the submitting shell's variables on (--export=ALL)
                    (where / "hold").mkdir()
                    env.setenv("SLURMFT_TEST_GRPO_HOLD", str(where / "hold"))
                else:
                    env.delenv("SLURMFT_TEST_GRPO_HOLD", raising=False)
                path = config_writer.write_config(where, tiny_model, PROMPTS, **SECTIONS, **sections)
                cfg = load_config(path)
                jobs = submit_run(cfg, load_profile(cfg.cluster.profile), str(path)).jobs
                assert "prepare" in jobs  # the product's default
                runs[variant][name] = where / "run"
                runs[variant][f"{name}_jobs"] = jobs
                runs[variant][f"{name}_hold"] = where / "hold"
    waiting = set(VARIANTS)

    def signal_the_holding() -> bool:
        """Each preempted run gets the signal as soon as both its ranks hold step 3's generation (they wait 2 min)."""
        for variant in sorted(waiting):
            if len(list(runs[variant]["preempted_hold"].glob("holding-*"))) == 2:
                signal_rank_steps(runs[variant]["preempted_jobs"]["train"])
                waiting.discard(variant)
        return not waiting

    wait_for("both preempted runs generating at step 3", signal_the_holding, timeout=400)
    for variant in VARIANTS:
        job = runs[variant]["preempted_jobs"]["train"]
        wait_for(f"{variant}: restart 1", lambda j=job: restarts(j) >= 1, timeout=120)
        for name in ("twin", "preempted"):
            jobs = runs[variant][f"{name}_jobs"]
            slurm_cluster.wait_state(jobs["train"], "COMPLETED", timeout=400)
            slurm_cluster.wait_state(jobs["consolidate"], "COMPLETED", timeout=240)
    return runs


def _steps(run: Path) -> list[dict[str, Any]]:
    return sorted(metrics(run), key=lambda m: m["step"])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_grpo_preempted_inside_a_generation_ends_bitwise_equal_to_its_uninterrupted_twin(
        grpo_runs: dict[str, Any], variant: str, slurmft) -> None:
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader

    from slurmft.checkpoints import is_adapter_name, read_marker

    runs = grpo_runs[variant]
    run, twin = runs["preempted"], runs["twin"]
    job = runs["preempted_jobs"]["train"]
    requeued = json.loads((run / "requeue" / f"{job}-0").read_text())
    assert requeued["step"] == 3 and requeued["saved"]  # inside the generation made at step 3
    checkpoint = run / "checkpoints" / "checkpoint-3"
    assert sorted(p.name for p in checkpoint.glob("grpo_rollouts_*")) == ["grpo_rollouts_0.pt", "grpo_rollouts_1.pt"]
    steps, expected = _steps(run), _steps(twin)
    assert [(m["step"], m["restart"]) for m in steps] == [(1, 0), (2, 0), (3, 0), (4, 1)]
    assert [{k: m.get(k) for k in KEYS} for m in steps] == [{k: m.get(k) for k in KEYS} for m in expected]
    assert "reward" in steps[2] and "reward" not in steps[3]  # step 4 trained the saved rollouts, generated nothing
    assert all(m["kl"] > 0 for m in steps[1:])  # beta 0.04: the reference (a copy, or the adapters disabled) is used

    slurmft.assert_same_model(run / "model", twin / "model")
    for path in sorted((run / "checkpoints").glob("checkpoint-*")):
        assert read_marker(path)["method"] == "grpo"
        keys = FileSystemReader(str(path / "pytorch_model_fsdp_0")).read_metadata().state_dict_metadata
        assert keys and (all(is_adapter_name(k) for k in keys) if variant == "lora" else
                         not any(is_adapter_name(k) for k in keys)), sorted(keys)[:4]
    if variant == "lora":
        adapter, same = (load_file(str(r / "adapter" / "adapter_model.safetensors")) for r in (run, twin))
        assert adapter.keys() == same.keys() and adapter
        assert all(adapter[k].equal(t) for k, t in same.items())
