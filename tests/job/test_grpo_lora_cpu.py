"""LoRA-GRPO on real two-rank FSDP2 (gloo, CPU): adapters on the sharded policy, the reference the base with the
adapters disabled (no second model), TRL's losses, rewards and KL, and a preemption inside a generation that ends
bitwise.

One launch trains three runs (tests/job/run_many.py), the micro model with LoRA r=4 on every linear layer (the
product's ``all-linear``), 2 ranks x 2 completions, TRL's default loss (dapo), the rewards of tests/job/
test_grpo_cpu.py, 4 steps:

- ``lora``: beta 0.04, one step per generation, through tests/job/dpo_check.py (which keeps the models the job
  builds): compared with TRL's own ``GRPOTrainer`` on one process (tests/job/grpo_reference.py: PEFT's
  ``get_peft_model`` on transformers' model, TRL's own "ref" adapter copy as its reference);
- ``twin``: beta 0, ``steps_per_generation: 2``, ``lora.dropout: 0.1`` with activation checkpointing (the default):
  the uninterrupted twin of ``preempted``;
- ``noac``: ``twin`` without activation checkpointing: the recompute replays the dropout masks of the forward, so
  both are bitwise equal.

Then ``preempted`` (``twin`` whose reward function sends the warning signal on rank 1 while step 3 generates) and
its requeued attempt. The dropout draws from each rank's global RNG (saved in the checkpoint), so the resume is
only bitwise when the RNG state, the rollouts and the place in them all come back.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from .helpers import launch_like_srun, read_metrics, write_run
from .test_grpo_cpu import MID, RUN_ARGS, STEPS, _check, _final_weights, ended_often, on_prompts

pytestmark = pytest.mark.train

HERE = Path(__file__).resolve().parent
LORA = {"r": 4, "alpha": 8}
KEYS = ("loss", "grad_norm", "reward", "reward_std", "kl", "completions/mean_length")


@pytest.fixture(scope="module")
def lora_grpo(micro_model: Path, job_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("grpo_lora")
    model = ended_often(micro_model, root / "model")

    def compared(cfg: dict) -> None:
        on_prompts(cfg)
        cfg["lora"] = dict(LORA)

    def twin(cfg: dict) -> None:
        compared(cfg)
        cfg["grpo"].update(beta=0.0, steps_per_generation=2)  # one generation of 8 completions for 2 steps
        cfg["lora"]["dropout"] = 0.1

    def no_checkpointing(cfg: dict) -> None:
        twin(cfg)
        cfg["fsdp"]["activation_checkpointing"] = False

    def signaled(cfg: dict) -> None:
        twin(cfg)
        cfg["grpo"]["rewards"][1]["function"] = f"{HERE / 'grpo_rewards.py'}:length_then_signal"

    final_only = [*RUN_ARGS, "checkpoint.every_steps=100"]  # checkpoint-3 can only be the warning signal's
    runs = {"lora": write_run(root / "lora", model, RUN_ARGS, edit=compared),
            "twin": write_run(root / "twin", model, final_only, edit=twin),
            "noac": write_run(root / "noac", model, final_only, edit=no_checkpointing),
            "preempted": write_run(root / "preempted", model, final_only, edit=signaled)}
    check = f"call:tests.job.dpo_check:main:{runs['lora']}:{root}/check"
    _, out = launch_like_srun(root / "first", job_env, program=[str(HERE / "run_many.py")],
                              args=[check, str(runs["twin"]), str(runs["noac"])]).wait(timeout=600)
    for path in sorted(root.glob("*.failed.rank*")):
        pytest.fail(path.read_text()[-4000:])
    signal_env = {**job_env, "GRPO_TEST_SIGNAL_AT": str(MID - 1)}  # rank 1 signals itself while step 3 generates
    _, out2 = launch_like_srun(runs["preempted"], signal_env).wait(timeout=600)
    requeued = sorted(p.name for p in (runs["preempted"] / "requeue").iterdir())
    rc, out3 = launch_like_srun(runs["preempted"], job_env, restart=1).wait(timeout=600)  # the requeued attempt
    assert rc == 0, out3[-4000:]
    reference = subprocess.run([sys.executable, str(HERE / "grpo_reference.py"), str(runs["lora"]),
                                str(root / "reference.json")], env=job_env, capture_output=True, text=True,
                               timeout=600, check=False)
    assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-3000:]
    return {"runs": runs, "root": root, "log": out + "\n" + out2 + "\n" + out3, "requeued": requeued,
            "trl": json.loads((root / "reference.json").read_text())["logs"],
            "trl_adapter": root / "reference.safetensors"}


def test_losses_rewards_and_kl_equal_trls_grpo_trainer_with_a_peft_model(lora_grpo: dict[str, Any]) -> None:
    """beta 0.04: TRL's reference is its "ref" adapter (a copy of the fresh one), ours the adapters disabled; both are
    the base model, so the KL, the losses and the final adapters agree within fp32 tolerance."""
    import torch
    from safetensors.torch import load_file

    ours, theirs = read_metrics(lora_grpo["runs"]["lora"]), lora_grpo["trl"]
    assert len(ours) == len(theirs) == STEPS
    for mine, other in zip(ours, theirs, strict=True):
        assert mine["loss"] == pytest.approx(other["loss"], abs=2e-6), (mine, other)
        assert mine["grad_norm"] == pytest.approx(other["grad_norm"], rel=1e-4), (mine, other)
        for key in KEYS[2:]:
            assert mine[key] == pytest.approx(other[key], rel=1e-5, abs=1e-6), (key, mine, other)
    assert ours[0]["kl"] == 0.0 and all(m["kl"] > 0 for m in ours[1:])  # the adapters moved the policy off the base
    assert all(m["reward_std"] > 0 for m in ours) and len({m["reward"] for m in ours}) == STEPS
    trl_final = load_file(str(lora_grpo["trl_adapter"]))
    saved = _final_weights(lora_grpo["runs"]["lora"])
    ours_final = {k.removeprefix("model.").replace(".default.", "."): v for k, v in saved.items()}  # DCP's names
    assert set(ours_final) == set(trl_final) and trl_final  # PEFT's names: every adapter tensor, nothing else
    for name, tensor in trl_final.items():
        torch.testing.assert_close(ours_final[name], tensor, rtol=1e-4, atol=1e-6, msg=name)


def test_only_the_sharded_adapters_train_and_there_is_no_second_model(lora_grpo: dict[str, Any]) -> None:
    for report in _check(lora_grpo["root"] / "check"):
        assert report["summary"]["status"] == "completed"
        assert len(report["models"]) == 1  # beta 0.04, yet no reference copy: the adapters are disabled instead
        policy = report["models"][0]
        assert policy["all_dtensor"] and 0 < policy["local_numel"] < policy["total_numel"]
        assert policy["requires_grad"] and all("lora_" in n for n in policy["requires_grad"])
        assert set(policy["changed"]) == {n for n in policy["requires_grad"] if "lora_B" in n} | {
            n for n in policy["requires_grad"] if "lora_A" in n}  # the base never moves; every adapter does
        assert not any(".ref." in n for n in policy["names"])  # TRL's "ref" adapter copy was not made
    for rank in (0, 1):
        fsdp = json.loads((lora_grpo["runs"]["lora"] / "fsdp_report" / f"rank{rank}.json").read_text())
        assert not fsdp.get("reference_bytes")
    final = lora_grpo["runs"]["lora"] / "checkpoints" / f"checkpoint-{STEPS}" / "COMPLETE"
    marker = json.loads(final.read_text())
    assert marker["method"] == "grpo" and marker["lora"]["r"] == LORA["r"]


def test_dropout_under_activation_checkpointing_is_bitwise_the_run_without(lora_grpo: dict[str, Any]) -> None:
    import torch

    twin, noac = (read_metrics(lora_grpo["runs"][n]) for n in ("twin", "noac"))
    assert [{k: m.get(k) for k in KEYS} for m in twin] == [{k: m.get(k) for k in KEYS} for m in noac]
    assert "kl" not in twin[0]  # beta 0: no reference at all
    a, b = _final_weights(lora_grpo["runs"]["twin"]), _final_weights(lora_grpo["runs"]["noac"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_lora_run_preempted_inside_a_generation_ends_bitwise_equal_to_its_twin(lora_grpo: dict[str, Any]) -> None:
    import torch

    runs = lora_grpo["runs"]
    assert lora_grpo["requeued"] == ["4242-0"]
    checkpoint = runs["preempted"] / "checkpoints" / f"checkpoint-{MID}"
    assert sorted(p.name for p in checkpoint.glob("grpo_rollouts_*")) == ["grpo_rollouts_0.pt", "grpo_rollouts_1.pt"]
    whole, preempted = read_metrics(runs["twin"]), read_metrics(runs["preempted"])
    assert [m["restart"] for m in preempted] == [0, 0, 0, 1]
    assert [{k: m.get(k) for k in KEYS} for m in preempted] == [{k: m.get(k) for k in KEYS} for m in whole]
    assert "reward" not in whole[-1]  # step 4 trained the second half of step 3's generation
    a, b = _final_weights(runs["twin"]), _final_weights(runs["preempted"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
