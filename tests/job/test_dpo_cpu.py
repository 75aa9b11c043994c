"""DPO on real two-rank FSDP2 (gloo, CPU): TRL's losses, a frozen sharded reference never saved, resume, refusals.

One set of runs serves every check (tests/job/run_many.py: one start-up per launch):

- launch 1: ``dpo`` (full fine-tuning, the reference a second sharded copy; 4 steps, checkpoints at 2 and 4) and
  ``lora`` (LoRA-DPO: the reference is the base with the adapters disabled), both through
  tests/job/dpo_check.py, which keeps the models the job builds and reports on them after training;
- launch 2: ``resumed`` (a copy of ``dpo`` cut back to checkpoint-2, through dpo_check.py too), and two copies
  that must be refused before anything is loaded: ``dpo``'s checkpoint under an SFT config, and an SFT
  checkpoint (``dpo``'s with the marker an SFT run writes) under the DPO config;
- ``precomputed`` (launch 1, through dpo_check.py): ``dpo`` with ``dpo.reference: precomputed``, no reference model;
  in launch 2 a copy cut back to checkpoint-2 resumes from the values it kept; a copy without them computes them
  again from the model files (its policy's shards hold nothing before the checkpoint loads); a copy whose pairs
  were fixed (chosen and rejected swapped) computes them again for the new pairs (issue 45: they were reused);
  ``lora_precomputed`` (launch 1, through dpo_check.py): ``lora`` with the values precomputed;
- ``bf16`` (launch 1, through dpo_check.py): ``dpo`` with ``train.precision: bf16-mixed``: the reference stored in
  bf16, the policy's fp32 master weights;
- ``prepared``: ``precomputed`` with ``prepare.enabled``, its pairs tokenized by the prepare job first (in launch
  1), so the values are computed over the prepared rows;
- the single-process TRL references (tests/job/dpo_reference.py: transformers + TRL's DPOTrainer with its own
  reference model, no FSDP, the whole global batch on one process), of ``dpo`` and, with PEFT's LoRA layers and
  TRL's adapters-disabled reference, of ``lora``.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from .helpers import REPO, launch_like_srun, preference_data, read_metrics, write_run
from .test_lora_cpu import _copy, _tree

pytestmark = pytest.mark.train

STEPS, EVERY = 4, 2
RUN_ARGS = [f"train.max_steps={STEPS}", f"checkpoint.every_steps={EVERY}", "checkpoint.keep_last=2",
            "checkpoint.async=false", "data.max_seq_length=128", "train.per_device_batch_size=1"]
LORA = ["lora.r=4", "lora.alpha=8"]
HERE = Path(__file__).resolve().parent
LIMA = REPO / "examples" / "tiny" / "data" / "lima.jsonl"


def _check(where: Path) -> list[dict[str, Any]]:
    return [json.loads((where / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.fixture(scope="module")
def dpo_runs(tiny_model: Path, job_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("dpo")
    pairs = preference_data(root / "pairs.jsonl")

    def on_pairs(cfg: dict) -> None:
        cfg["data"]["datasets"] = [{"path": str(pairs)}]
        cfg["dpo"] = {"beta": 0.1}

    def on_pairs_precomputed(cfg: dict) -> None:
        on_pairs(cfg)
        cfg["dpo"]["reference"] = "precomputed"

    runs = {"dpo": write_run(root / "dpo", tiny_model, RUN_ARGS, edit=on_pairs),
            "precomputed": write_run(root / "precomputed", tiny_model, RUN_ARGS, edit=on_pairs_precomputed),
            "lora": write_run(root / "lora", tiny_model, [*RUN_ARGS, *LORA], edit=on_pairs),
            "lora_precomputed": write_run(root / "lora_precomputed", tiny_model, [*RUN_ARGS, *LORA],
                                          edit=on_pairs_precomputed),
            "bf16": write_run(root / "bf16", tiny_model, [*RUN_ARGS, "train.precision=bf16-mixed"], edit=on_pairs),
            "prepared": write_run(root / "prepared", tiny_model, [*RUN_ARGS, "prepare.enabled=true"],
                                  edit=on_pairs_precomputed)}
    prepare = subprocess.run([sys.executable, "-m", "slurmft.job.entrypoint", "prepare", str(runs["prepared"])],
                             env=job_env, capture_output=True, text=True, timeout=600, check=False)
    assert prepare.returncode == 0, prepare.stdout[-3000:] + prepare.stderr[-3000:]
    check = "call:tests.job.dpo_check:main:{run}:" + str(root) + "/check-{name}"
    first = [*(check.format(run=runs[n], name=n) for n in ("dpo", "lora", "precomputed", "lora_precomputed", "bf16")),
             str(runs["prepared"])]
    _, out = launch_like_srun(root / "first", job_env, program=[str(HERE / "run_many.py")],
                              args=first).wait(timeout=600)
    for path in sorted(root.glob("*.failed.rank*")):
        pytest.fail(path.read_text()[-4000:])

    def as_sft(cfg: dict) -> None:
        cfg.pop("dpo")
        cfg["data"]["datasets"] = [{"path": str(LIMA)}]

    runs["resumed"] = _copy(runs["dpo"], root / "resumed", cut_after=EVERY)
    runs["sftondpo"] = _copy(runs["dpo"], root / "sftondpo", cut_after=EVERY, edit=as_sft)
    runs["dpoonsft"] = _copy(runs["dpo"], root / "dpoonsft", cut_after=EVERY)
    marker = runs["dpoonsft"] / "checkpoints" / f"checkpoint-{EVERY}" / "COMPLETE"
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "method": "sft"}))  # what an SFT run writes
    runs["precomputed_resumed"] = _copy(runs["precomputed"], root / "precomputed_resumed", cut_after=EVERY)
    runs["precomputed_lost"] = _copy(runs["precomputed"], root / "precomputed_lost", cut_after=EVERY)
    (runs["precomputed_lost"] / "reference_logps.safetensors").unlink()
    swapped = root / "pairs-swapped.jsonl"  # the same rows, chosen and rejected swapped: the data fixed
    swapped.write_text("".join(json.dumps({**row, "chosen": row["rejected"], "rejected": row["chosen"]}) + "\n"
                               for row in map(json.loads, pairs.read_text().splitlines())))

    def on_swapped(cfg: dict) -> None:
        cfg["data"]["datasets"] = [{"path": str(swapped)}]

    runs["precomputed_swapped"] = _copy(runs["precomputed"], root / "precomputed_swapped", cut_after=EVERY,
                                        edit=on_swapped)
    before = {name: _tree(runs[name]) for name in ("sftondpo", "dpoonsft")}
    second = [check.format(run=runs["resumed"], name="resumed"), str(runs["sftondpo"]), str(runs["dpoonsft"]),
              str(runs["precomputed_resumed"]), str(runs["precomputed_lost"]), str(runs["precomputed_swapped"])]
    _, out2 = launch_like_srun(root / "second", job_env, program=[str(HERE / "run_many.py")],
                               args=second).wait(timeout=600)
    for name in ("dpo", "lora"):
        reference = subprocess.run([sys.executable, str(HERE / "dpo_reference.py"), str(runs[name]),
                                    str(root / "reference" / f"{name}.json")], env=job_env, capture_output=True,
                                   text=True, timeout=600, check=False)
        assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-3000:]
    for path in sorted(root.glob("*.call.failed.rank*")):
        pytest.fail(path.read_text()[-4000:])
    return {"runs": runs, "root": root, "log": out + "\n" + out2, "before": before,
            **{f"trl_{name}": json.loads((root / "reference" / f"{name}.json").read_text())["logs"]
               for name in ("dpo", "lora")}}


def _stored(run: Path) -> tuple[dict[str, str], dict[str, Any]]:
    """A run's reference_logps.safetensors: its metadata (what the values were computed for) and its tensors."""
    from safetensors import safe_open

    with safe_open(str(run / "reference_logps.safetensors"), framework="pt") as f:
        return f.metadata(), {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (not a dict)


def _same_as_trl(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> None:
    """fp32 on both sides; the sums differ only in order (two ranks' reduce-scatter vs one batch)."""
    assert len(ours) == len(theirs) == STEPS
    for mine, other in zip(ours, theirs, strict=True):
        assert mine["loss"] == pytest.approx(other["loss"], abs=2e-6), (mine, other)
        assert mine["grad_norm"] == pytest.approx(other["grad_norm"], rel=1e-4), (mine, other)
        assert mine["rewards/margins"] == pytest.approx(other["rewards/margins"], abs=1e-5), (mine, other)


def test_losses_equal_trls_own_dpo_trainer_and_step_one_is_ln2(dpo_runs: dict[str, Any]) -> None:
    ours = read_metrics(dpo_runs["runs"]["dpo"])
    assert [m["step"] for m in ours] == list(range(1, STEPS + 1))
    # step 1: the policy is the reference, both log-ratios are 0, and the sigmoid loss is -log(sigmoid(0)) = ln 2
    assert ours[0]["loss"] == pytest.approx(math.log(2), abs=1e-7), ours[0]["loss"]
    assert ours[0]["rewards/margins"] == 0.0 and ours[0]["rewards/chosen"] == 0.0
    _same_as_trl(ours, dpo_runs["trl_dpo"])
    assert ours[-1]["loss"] != pytest.approx(math.log(2), abs=1e-3)  # it trained: the policy left the reference


def test_policy_and_reference_are_fsdp2_shards_and_the_reference_never_changes(dpo_runs: dict[str, Any]) -> None:
    for name in ("dpo", "resumed"):
        for r, rank in enumerate(_check(dpo_runs["root"] / f"check-{name}")):
            policy, reference = rank["models"]
            assert not policy["frozen"] and reference["frozen"]
            for model in (policy, reference):
                assert model["all_dtensor"] and model["local_numel"] < 0.6 * model["total_numel"], model["total_numel"]
            assert reference["names"] == policy["names"]
            assert reference["requires_grad"] == [] and reference["with_grad"] == []
            assert reference["changed"] == [], f"{name}: the reference changed: {reference['changed'][:5]}"
            assert len(policy["changed"]) > 0.9 * len(policy["names"])  # the policy trained (the test can fail)
            # the job's own report of the copy's shards (what bench/dpo_memory.py holds to the estimate): fp32 here
            report = json.loads((dpo_runs["runs"][name] / "fsdp_report" / f"rank{r}.json").read_text())
            assert report["reference_bytes"] == 4 * reference["local_numel"] > 0


def test_the_checkpoint_holds_the_policy_only(dpo_runs: dict[str, Any]) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    checkpoint = dpo_runs["runs"]["dpo"] / "checkpoints" / f"checkpoint-{STEPS}"
    keys = set(FileSystemReader(str(checkpoint / "pytorch_model_fsdp_0")).read_metadata().state_dict_metadata)
    policy = _check(dpo_runs["root"] / "check-dpo")[0]["models"][0]["names"]
    assert len(keys) == len(policy) and not any("ref" in k for k in keys), sorted(keys)[:5]
    assert json.loads((checkpoint / "COMPLETE").read_text())["method"] == "dpo"


def test_a_resumed_dpo_run_continues_bitwise(dpo_runs: dict[str, Any]) -> None:
    full, resumed = (read_metrics(dpo_runs["runs"][n]) for n in ("dpo", "resumed"))
    assert [m["step"] for m in resumed] == list(range(1, STEPS + 1))
    for a, b in zip(full[EVERY:], resumed[EVERY:], strict=True):
        assert (a["loss"], a["grad_norm"], a["rewards/margins"]) == (b["loss"], b["grad_norm"], b["rewards/margins"])
    assert "resuming from checkpoint-2" in dpo_runs["log"]


def test_lora_dpo_uses_the_base_with_adapters_disabled_and_saves_the_adapters_only(dpo_runs: dict[str, Any]) -> None:
    metrics = read_metrics(dpo_runs["runs"]["lora"])
    assert metrics[0]["loss"] == pytest.approx(math.log(2), abs=1e-7)  # adapters start at B = 0: policy = base
    assert metrics[-1]["loss"] != pytest.approx(math.log(2), abs=1e-4)
    # TRL + PEFT on one process: PEFT's LoRA layers, TRL's reference = the PEFT model with its adapters disabled
    _same_as_trl(metrics, dpo_runs["trl_lora"])
    for r, rank in enumerate(_check(dpo_runs["root"] / "check-lora")):
        (policy,) = rank["models"]  # no second model: the reference is the policy with its adapters disabled
        assert json.loads((dpo_runs["runs"]["lora"] / "fsdp_report" / f"rank{r}.json").read_text())["reference_bytes"] == 0
        assert policy["all_dtensor"] and not any(".ref." in n for n in policy["names"])
        assert policy["requires_grad"] and all("lora_" in n for n in policy["requires_grad"])
        assert set(policy["changed"]) <= set(policy["requires_grad"]) and policy["changed"]  # the base never moved
    marker = json.loads((dpo_runs["runs"]["lora"] / "checkpoints" / f"checkpoint-{STEPS}" / "COMPLETE").read_text())
    assert marker["method"] == "dpo" and marker["lora"]["r"] == 4


@pytest.mark.parametrize(("name", "expected"), [
    ("sftondpo", "dpo: checkpoint-2 is a DPO checkpoint and this run trains SFT; put the dpo: section back"),
    ("dpoonsft", "dpo: checkpoint-2 is an SFT checkpoint and this run trains DPO; start DPO from it in a new run"),
])
def test_dpo_and_sft_checkpoints_do_not_resume_each_other(dpo_runs: dict[str, Any], name: str, expected: str) -> None:
    run = dpo_runs["runs"][name]
    failures = sorted(run.parent.glob(f"{run.name}.failed.rank*"))
    assert len(failures) == 2, f"{name} was not refused on every rank"
    for path in failures:
        assert expected in path.read_text(), path.read_text()[-2000:]
    assert _tree(run) == dpo_runs["before"][name]  # nothing in the run directory changed


def test_the_prepare_job_gives_the_same_training(dpo_runs: dict[str, Any]) -> None:
    from slurmft import prepared
    from slurmft.rundir import RunPaths

    run = dpo_runs["runs"]["prepared"]
    record = prepared.read_record(RunPaths.of(str(run)))
    assert record["settings"]["method"] == "dpo" and record["result"]["sequences"] > 0
    # the reference values computed over the prepared rows are those computed over the rows tokenized in the job
    (meta, values), (meta_in_job, values_in_job) = (_stored(r) for r in (run, dpo_runs["runs"]["precomputed"]))
    assert meta == meta_in_job and values.keys() == values_in_job.keys()
    assert all(values[k].equal(values_in_job[k]) for k in values)
    assert [(m["loss"], m["grad_norm"], m["rewards/margins"]) for m in read_metrics(run)] == [
        (m["loss"], m["grad_norm"], m["rewards/margins"]) for m in read_metrics(dpo_runs["runs"]["precomputed"])]


def test_trl_dpo_preparation_reads_only_what_the_prepare_job_sets() -> None:
    """The prepare job calls DPOTrainer._prepare_dataset on TrlDpoPreparation: it must need nothing else."""
    from trl import DPOTrainer

    from .test_prepare import _attributes

    assert _attributes(DPOTrainer._prepare_dataset, "self") == {"_tokenizer"}
    assert _attributes(DPOTrainer._prepare_dataset, "args") <= {"dataset_num_proc", "max_length", "truncation_mode"}


def test_precomputed_reference_log_probs_train_as_trl_without_a_reference_model(dpo_runs: dict[str, Any]) -> None:
    from safetensors import safe_open

    run = dpo_runs["runs"]["precomputed"]
    ours = read_metrics(run)
    assert [m["step"] for m in ours] == list(range(1, STEPS + 1))
    # step 1: the stored values are the policy's own, so both log-ratios are 0 and the sigmoid loss is ln 2
    assert ours[0]["loss"] == pytest.approx(math.log(2), abs=1e-7), ours[0]["loss"]
    _same_as_trl(ours, dpo_runs["trl_dpo"])
    _same_as_trl(ours, read_metrics(dpo_runs["runs"]["dpo"]))  # the run with a reference copy
    assert ours[-1]["loss"] != pytest.approx(math.log(2), abs=1e-3)  # it trained
    for r, rank in enumerate(_check(dpo_runs["root"] / "check-precomputed")):
        (policy,) = rank["models"]  # the policy only: no reference copy was built
        assert not policy["frozen"] and policy["all_dtensor"] and policy["changed"]
        assert json.loads((run / "fsdp_report" / f"rank{r}.json").read_text())["reference_bytes"] == 0
    with safe_open(str(run / "reference_logps.safetensors"), framework="pt") as f:
        meta, chosen, rejected = f.metadata(), f.get_tensor("ref_chosen_logps"), f.get_tensor("ref_rejected_logps")
    rows = int(meta["rows"])
    assert chosen.shape == rejected.shape == (rows,) and rows > 2 * STEPS  # every pair, not only the ones trained
    assert bool((chosen < 0).all()) and bool((rejected < 0).all()) and not chosen.equal(rejected)
    assert "dpo: reference log-probabilities of" in dpo_runs["log"] and "computed in" in dpo_runs["log"]


def test_a_resumed_precomputed_run_reads_its_values_and_continues_bitwise(dpo_runs: dict[str, Any]) -> None:
    full, resumed = (read_metrics(dpo_runs["runs"][n]) for n in ("precomputed", "precomputed_resumed"))
    assert not sorted(dpo_runs["root"].glob("precomputed_resumed.failed.rank*"))
    assert [m["step"] for m in resumed] == list(range(1, STEPS + 1))
    for a, b in zip(full[EVERY:], resumed[EVERY:], strict=True):
        assert (a["loss"], a["grad_norm"], a["rewards/margins"]) == (b["loss"], b["grad_norm"], b["rewards/margins"])
    assert f"read from {dpo_runs['runs']['precomputed_resumed'] / 'reference_logps.safetensors'}" in dpo_runs["log"]


def test_a_resumed_precomputed_run_that_lost_its_values_computes_them_again_from_the_model_files(
        dpo_runs: dict[str, Any]) -> None:
    """Resuming from checkpoint-2 without the values: the starting model is read from the model files into the
    policy's (still empty) shards, the values computed again are the first attempt's, bitwise, and the steps after
    the checkpoint train as the uninterrupted run's."""
    runs = dpo_runs["runs"]
    run = runs["precomputed_lost"]
    assert not sorted(run.parent.glob(f"{run.name}.failed.rank*"))
    (meta, values), (meta_first, first) = (_stored(r) for r in (run, runs["precomputed"]))
    assert meta == meta_first and all(values[k].equal(first[k]) for k in first)
    full, resumed = (read_metrics(runs[n]) for n in ("precomputed", "precomputed_lost"))
    assert [(m["loss"], m["grad_norm"]) for m in resumed[EVERY:]] == [(m["loss"], m["grad_norm"]) for m in full[EVERY:]]
    assert "the starting model read from its files to compute the values" in dpo_runs["log"]


def test_fixed_pairs_get_their_values_computed_again_never_the_old_ones(dpo_runs: dict[str, Any]) -> None:
    """The data fixed under a paused run (chosen and rejected swapped, the same rows): the values kept for the old
    pairs no longer match the pairs' token ids, so the resumed job computes them again from the starting model: the
    new chosen values are the old rejected ones and the reverse (the same sequences, the same model)."""
    runs = dpo_runs["runs"]
    run = runs["precomputed_swapped"]
    assert not sorted(run.parent.glob(f"{run.name}.failed.rank*"))
    (meta, values), (meta_old, old) = (_stored(r) for r in (run, runs["precomputed"]))
    assert meta["data_sha256"] != meta_old["data_sha256"] and meta["rows"] == meta_old["rows"]
    assert {k: v for k, v in meta.items() if k != "data_sha256"} == {k: v for k, v in meta_old.items()
                                                                      if k != "data_sha256"}
    import torch

    assert torch.allclose(values["ref_chosen_logps"], old["ref_rejected_logps"], rtol=0, atol=1e-5)
    assert torch.allclose(values["ref_rejected_logps"], old["ref_chosen_logps"], rtol=0, atol=1e-5)
    assert f"{run / 'reference_logps.safetensors'} was computed from other data or another model (the pairs' token " \
           "ids changed since): computing the values again" in dpo_runs["log"]


def test_lora_dpo_with_precomputed_values_trains_as_trl_and_peft(dpo_runs: dict[str, Any]) -> None:
    """LoRA's reference is the unchanged base, so its values are the adapters-disabled model's at any step."""
    run = dpo_runs["runs"]["lora_precomputed"]
    ours = read_metrics(run)
    assert ours[0]["loss"] == pytest.approx(math.log(2), abs=1e-7), ours[0]["loss"]
    _same_as_trl(ours, dpo_runs["trl_lora"])
    for rank in _check(dpo_runs["root"] / "check-lora_precomputed"):
        (policy,) = rank["models"]
        assert set(policy["changed"]) <= set(policy["requires_grad"]) and policy["changed"]  # the base never moved
    (meta, mine), (meta_full, full) = (_stored(r) for r in (run, dpo_runs["runs"]["precomputed"]))
    assert mine.keys() == full.keys() and meta == {**meta_full, "lora": "yes"}
    for name, values in full.items():  # the base with its adapters disabled is the full fine-tune's starting model
        assert mine[name].equal(values), (name, (mine[name] - values).abs().max())


def test_bf16_mixed_dpo_keeps_its_reference_in_bf16_and_never_changes_it(dpo_runs: dict[str, Any]) -> None:
    """train.precision: bf16-mixed: the reference copy is stored in the compute dtype (half the fp32 copy's bytes),
    the policy keeps fp32 master weights; at step 1 both forwards run on the same bf16 weights (ln 2)."""
    run = dpo_runs["runs"]["bf16"]
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert metrics[0]["loss"] == pytest.approx(math.log(2), abs=1e-6), metrics[0]["loss"]
    assert all(math.isfinite(m["loss"]) for m in metrics) and metrics[-1]["loss"] != pytest.approx(math.log(2), abs=1e-3)
    for r, rank in enumerate(_check(dpo_runs["root"] / "check-bf16")):
        policy, reference = rank["models"]
        assert policy["dtypes"] == ["torch.float32"] and reference["dtypes"] == ["torch.bfloat16"]
        assert reference["changed"] == [] and policy["changed"]
        report = json.loads((run / "fsdp_report" / f"rank{r}.json").read_text())
        assert report["reference_bytes"] == 2 * reference["local_numel"] > 0
