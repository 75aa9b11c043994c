"""LoRA on real two-rank FSDP2 (gloo, CPU): sharded adapters, PEFT's losses, adapter-only checkpoints that resume.

One set of runs serves every check (tests/job/run_many.py: one start-up per launch):

- launch 1: ``lora`` (the tiny model, LoRA r=4 on every linear layer of the decoder and on the input
  embeddings, 4 steps, checkpoints at 2 and 4), ``full`` (a full fine-tune, 2 steps: a full checkpoint for the
  mismatch case), ``badtarget`` (a target name that matches no module), ``dropout`` and ``dropout_noac``
  (``lora`` with dropout 0.1 for 6 steps, activation checkpointing on and off), and
  tests/job/dropout_gradients.py on ``dropout``'s config (one step's gradients against PEFT's);
- launch 2: ``resumed`` (a copy of ``lora`` cut back to checkpoint-2), and three copies that must be
  refused before anything is loaded: ``lora`` without its lora section, ``full`` with one, ``lora`` with
  another rank;
- the single-process PEFT reference (tests/job/peft_reference.py: transformers + PEFT, no FSDP, the whole
  global batch on one process);
- tests/job/adapter_survival.py, save in launch 1 and load in launch 2: rank-dependent shards through the job's
  save and load.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from .helpers import launch_like_srun, read_metrics, write_run

pytestmark = pytest.mark.train

STEPS, EVERY = 4, 2
DECODER = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
LORA = ["lora.r=4", "lora.alpha=8", f"lora.target_modules=[{', '.join([*DECODER, 'embed_tokens'])}]"]
DROPOUT = [*LORA, "lora.dropout=0.1", "train.max_steps=6", "checkpoint.every_steps=6"]
RUN_ARGS = [f"train.max_steps={STEPS}", f"checkpoint.every_steps={EVERY}", "checkpoint.keep_last=2",
            "data.max_seq_length=128", "train.per_device_batch_size=1"]
HERE = Path(__file__).resolve().parent


def _tree(run: Path) -> dict[str, Any]:
    """Every file under the run's checkpoints with its size and, for markers, its text (to see nothing changed)."""
    out: dict[str, Any] = {}
    for path in sorted((run / "checkpoints").rglob("*")):
        if path.is_file():
            out[str(path.relative_to(run))] = path.read_text() if path.name == "COMPLETE" else path.stat().st_size
    return out


def _copy(run: Path, to: Path, cut_after: int | None = None, edit: Any = None) -> Path:
    ignore = shutil.ignore_patterns(*[f"checkpoint-{s}" for s in range((cut_after or 10**6) + 1, 50)],
                                    "model", "fsdp_report")
    shutil.copytree(run, to, ignore=ignore)
    data = (run / "config.yaml").read_text().replace(str(run), str(to))
    if edit is not None:
        import yaml

        cfg = yaml.safe_load(data)
        edit(cfg)
        data = yaml.safe_dump(cfg, sort_keys=False)
    (to / "config.yaml").write_text(data)
    if cut_after is not None:
        kept = [m for m in read_metrics(run) if m["step"] <= cut_after]
        (to / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in kept))
    return to


@pytest.fixture(scope="module")
def lora_runs(tiny_model: Path, job_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("lora")
    runs = {
        "lora": write_run(root / "lora", tiny_model, [*RUN_ARGS, *LORA]),
        "full": write_run(root / "full", tiny_model, [*RUN_ARGS, "train.max_steps=2"]),
        "badtarget": write_run(root / "badtarget", tiny_model, [*RUN_ARGS, *LORA, "lora.target_modules=[q_proj, qproj]"]),
        "dropout": write_run(root / "dropout", tiny_model, [*RUN_ARGS, *DROPOUT]),
        "dropout_noac": write_run(root / "dropout_noac", tiny_model,
                                  [*RUN_ARGS, *DROPOUT, "fsdp.activation_checkpointing=false"]),
    }
    survival = root / "survival"
    survival.mkdir()
    check = "call:tests.job.adapter_survival:main:{phase}:" + f"{runs['lora']}:{survival}"
    gradients = f"call:tests.job.dropout_gradients:main:{runs['dropout']}:{root / 'gradients'}"
    first = [runs["lora"], runs["full"], runs["badtarget"], runs["dropout"], runs["dropout_noac"], gradients,
             check.format(phase="save")]
    _, out = launch_like_srun(root / "first", job_env, program=[str(HERE / "run_many.py")],
                              args=[str(r) for r in first]).wait(timeout=600)
    for path in sorted(root.glob("*.failed.rank*")):
        assert path.name.startswith("badtarget."), path.read_text()[-3000:]

    def no_lora(cfg: dict) -> None:
        cfg.pop("lora")

    def with_lora(cfg: dict) -> None:
        cfg["lora"] = {"r": 4, "alpha": 8}
        cfg["train"]["max_steps"] = STEPS  # the full run stopped at its last step: give it steps to do

    def other_rank(cfg: dict) -> None:
        cfg["lora"]["r"] = 8

    runs["resumed"] = _copy(runs["lora"], root / "resumed", cut_after=EVERY)
    runs["nolora"] = _copy(runs["lora"], root / "nolora", cut_after=EVERY, edit=no_lora)
    runs["fullwithlora"] = _copy(runs["full"], root / "fullwithlora", edit=with_lora)
    runs["otherrank"] = _copy(runs["lora"], root / "otherrank", cut_after=EVERY, edit=other_rank)
    before = {name: _tree(runs[name]) for name in ("nolora", "fullwithlora", "otherrank")}
    second = [*(runs[n] for n in ("resumed", "nolora", "fullwithlora", "otherrank")), check.format(phase="load")]
    _, out2 = launch_like_srun(root / "second", job_env, program=[str(HERE / "run_many.py")],
                               args=[str(r) for r in second]).wait(timeout=600)
    reference = subprocess.run([sys.executable, str(HERE / "peft_reference.py"), str(runs["lora"]),
                                str(root / "reference.json")], env=job_env, capture_output=True, text=True,
                               timeout=600, check=False)
    assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-3000:]
    for path in sorted(root.glob("*.call.failed.rank*")):
        pytest.fail(path.read_text()[-4000:])
    return {"runs": runs, "log": out + "\n" + out2, "before": before, "reference": root / "reference.json",
            "survival": survival, "gradients": root / "gradients" / "gradients.json"}


def _dcp(directory: Path) -> dict[str, Any]:
    """A DCP directory as one plain state dict (torch's own converter)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = directory.parent / f"{directory.parent.name}-{directory.name}.pt"
    if not out.exists():
        dcp_to_torch_save(str(directory), str(out))
    return torch.load(out, weights_only=False)


def test_base_and_adapters_are_dtensor_shards_and_only_adapters_train(lora_runs: dict[str, Any]) -> None:
    run = lora_runs["runs"]["lora"]
    reports = [json.loads((run / "fsdp_report" / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rep in reports:
        assert rep["distributed_type"] == "DistributedType.FSDP"
        assert rep["param_types"] == ["DTensor"], rep
        assert rep["num_dtensors"] == rep["num_tensors"] > 0
        assert rep["placements"] == ["(Shard(dim=0),)"]
        lora = rep["lora"]
        assert lora["r"] == 4 and lora["alpha"] == 8
        assert lora["target_modules"] == sorted([*DECODER, "embed_tokens"])  # the embedding is named too
        # 4 layers x (q,k,v,o: 256->256; gate, up: 256->688; down: 688->256), r x (in + out) each, and the
        # embedding's lora_embedding_A [r, vocab 4096] and lora_embedding_B [256, r]
        assert lora["trainable_params"] == 4 * 4 * (4 * (256 + 256) + 3 * (256 + 688)) + 4 * (4096 + 256)
    assert "LoRA: r=4, alpha=8, dropout=0 on down_proj, embed_tokens, gate_proj" in lora_runs["log"]
    marker = json.loads((run / "checkpoints" / f"checkpoint-{STEPS}" / "COMPLETE").read_text())
    assert marker["lora"] == reports[0]["lora"]


def test_losses_equal_the_single_process_peft_run(lora_runs: dict[str, Any]) -> None:
    """fp32 on both sides; the sums differ only in order (two ranks' reduce-scatter vs one batch), hence 1e-5.
    The adapters include the input embeddings' (PEFT's LoRA Embedding, initialised as PEFT does: A = 0)."""
    ours = [m["loss"] for m in read_metrics(lora_runs["runs"]["lora"])]
    reference = json.loads(lora_runs["reference"].read_text())["losses"]
    assert len(ours) == len(reference) == STEPS
    assert ours == pytest.approx(reference, rel=1e-5, abs=0), (ours, reference)
    assert ours[-1] < ours[0]  # it trained

    import torch
    from safetensors.torch import load_file

    peft_final = load_file(str(lora_runs["reference"].with_suffix(".safetensors")))
    saved = _dcp(lora_runs["runs"]["lora"] / "checkpoints" / f"checkpoint-{STEPS}" / "pytorch_model_fsdp_0")["model"]
    ours_final = {k.replace(".default.", ".").removesuffix(".default"): v for k, v in saved.items()}
    assert set(ours_final) == set(peft_final)  # PEFT's own names, every adapter tensor and nothing else
    for name, tensor in peft_final.items():
        torch.testing.assert_close(ours_final[name], tensor, rtol=1e-4, atol=1e-6, msg=name)


def test_checkpoints_hold_only_the_adapters(lora_runs: dict[str, Any], tiny_model: Path) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    from slurmft.checkpoints import is_adapter_name

    checkpoint = lora_runs["runs"]["lora"] / "checkpoints" / f"checkpoint-{STEPS}"
    marker = json.loads((checkpoint / "COMPLETE").read_text())
    assert marker["lora"]["r"] == 4 and marker["lora"]["trainable_params"] > 0
    keys = list(FileSystemReader(str(checkpoint / "pytorch_model_fsdp_0")).read_metadata().state_dict_metadata)
    assert keys and all(is_adapter_name(k) for k in keys), keys[:5]
    model_bytes = sum(p.stat().st_size for p in (checkpoint / "pytorch_model_fsdp_0").iterdir())
    base_bytes = (tiny_model / "model.safetensors").stat().st_size
    assert model_bytes < 0.05 * base_bytes, (model_bytes, base_bytes)


def test_a_resumed_lora_run_is_bitwise_the_uninterrupted_one(lora_runs: dict[str, Any]) -> None:
    import torch

    runs = lora_runs["runs"]
    assert not list(runs["resumed"].parent.glob("resumed.failed.rank*"))
    assert [m["step"] for m in read_metrics(runs["resumed"])] == list(range(1, STEPS + 1))
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):
        a = _dcp(runs["lora"] / "checkpoints" / f"checkpoint-{STEPS}" / part)
        b = _dcp(runs["resumed"] / "checkpoints" / f"checkpoint-{STEPS}" / part)
        flat_a, flat_b = _flatten(a), _flatten(b)
        assert flat_a.keys() == flat_b.keys()
        for key, value in flat_a.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, flat_b[key]), f"{part}: {key}"


def test_dropout_under_activation_checkpointing_gives_the_losses_without_it(lora_runs: dict[str, Any]) -> None:
    """LoRA dropout 0.1, the same seed: the recompute of a checkpointed layer replays the forward's masks, so
    with activation checkpointing on the losses are those with it off, over 6 steps (measured: equal to the
    last bit; 1e-6 allows for nothing but reordered sums). With ``preserve_rng_state=False`` this run differed
    from step 3 (4.5e-4 relative by step 6; measured for issue 28)."""
    runs = lora_runs["runs"]
    on = [m["loss"] for m in read_metrics(runs["dropout"])]
    off = [m["loss"] for m in read_metrics(runs["dropout_noac"])]
    assert len(on) == len(off) == 6
    assert on == pytest.approx(off, rel=1e-6, abs=0), (on, off)
    plain = [m["loss"] for m in read_metrics(runs["lora"])]
    # steps 1 and 2 are the dropout-free run's: B = 0 until the first update, and the warm-up's first learning
    # rate is 0; from step 3 on the masks reach the loss: dropout is really on
    assert on[:2] == plain[:2] and all(a != b for a, b in zip(on[2:STEPS], plain[2:STEPS], strict=True))


def test_dropout_gradients_under_checkpointing_equal_pefts_without_it(lora_runs: dict[str, Any]) -> None:
    """One step, fixed seed so fixed masks: 2-rank FSDP2 with checkpointed layers vs PEFT on one process without
    checkpointing (tests/job/dropout_gradients.py); another seed's masks give other gradients (the check can fail)."""
    result = json.loads(lora_runs["gradients"].read_text())
    assert result["checkpoint_wrapped"] == 4 and result["names"] == result["peft_names"]
    assert any("lora_embedding_B" in n for n in result["names"]) and len(result["names"]) == 58
    assert result["loss"] == pytest.approx(result["peft_loss"], rel=1e-6)
    worst = max(result["relative"].values())
    assert worst < 1e-5, sorted(result["relative"].items(), key=lambda kv: -kv[1])[:5]
    assert max(result["other_masks_relative"].values()) > 1e-2


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix: tree}


def test_every_ranks_part_of_every_adapter_survives_a_checkpoint(lora_runs: dict[str, Any]) -> None:
    results = [json.loads((lora_runs["survival"] / f"rank{r}.json").read_text()) for r in (0, 1)]
    for res in results:
        assert res["tensors"] == 58 and res["frozen"] > 0  # 28 linear layers' A and B, the embedding's A and B
        assert res["equal_before_load"] == 0  # a fresh model differs: the load really put the values back
        assert res["mismatches"] == [], res
    assert all(r["local_elements"] > 0 for r in results)  # both ranks held a part


@pytest.mark.parametrize(("run", "words"), [
    ("badtarget", [r"lora\.target_modules: 'qproj' matches no module of LlamaForCausalLM; its linear layers are: "
                   r"down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"]),
    ("nolora", [r"lora: checkpoint-2 is a LoRA adapter checkpoint \(r=4, alpha=8\.0", "no lora section"]),
    ("fullwithlora", [r"lora: checkpoint-2 is a full fine-tuning checkpoint", "has a lora section"]),
    ("otherrank", [r"lora: checkpoint-2 was trained with other adapters", r"r: 4 in the checkpoint, 8 now"]),
])
def test_bad_lora_input_stops_every_rank_with_a_clear_error_and_loses_nothing(
        lora_runs: dict[str, Any], run: str, words: list[str]) -> None:
    path = lora_runs["runs"][run]
    for rank in (0, 1):  # tests/job/run_many.py keeps what each rank printed for a run that failed
        text = path.with_name(f"{path.name}.failed.rank{rank}").read_text()
        assert f"slurmft rank {rank}: setup error" in text, text[-3000:]
        for pattern in words:
            assert re.search(pattern, text), (pattern, text[-3000:])
    assert not read_metrics(path) if run == "badtarget" else True  # it stopped before the first step
    if run in lora_runs["before"]:
        assert _tree(path) == lora_runs["before"][run]  # not a file of the checkpoints changed
        assert max(m["step"] for m in read_metrics(path)) == EVERY  # no step logged after the copy's checkpoint


@pytest.fixture(scope="module")
def lora_on_one_rank(lora_runs: dict[str, Any], job_env: dict[str, str]) -> tuple[Path, str]:
    """The LoRA run's checkpoint-2 (2 ranks x 1 x 1) resumed on 1 rank, as `slurmft resume RUN
    resources.tasks_per_node=1` configures it (accumulation 2: the global batch of 2 kept)."""
    from slurmft.config_loading import dump_config
    from slurmft.rundir import RunPaths
    from slurmft.submit.resume import resume_config

    from .helpers import launch

    run = _copy(lora_runs["runs"]["lora"], lora_runs["runs"]["lora"].parent / "onerank", cut_after=EVERY)
    (run / "batches.jsonl").unlink()
    cfg = resume_config(RunPaths.of(run), ["resources.tasks_per_node=1"], "local",
                        run / "checkpoints" / f"checkpoint-{EVERY}")
    assert (cfg.resources.world_size, cfg.train.per_device_batch_size, cfg.train.gradient_accumulation_steps) == (1, 1, 2)
    (run / "config.yaml").write_text(dump_config(cfg))
    rc, out = launch(run, job_env, nproc=1).wait(timeout=600)
    assert rc == 0, out[-6000:]
    return run, out


def test_a_lora_checkpoint_resumes_on_another_number_of_ranks(lora_runs: dict[str, Any],
                                                               lora_on_one_rank: tuple[Path, str]) -> None:
    """The adapters (and their optimizer state) reshard from 2 ranks to 1; the later steps train on the same
    sequences with the same losses (rel 5e-5) and end on the same adapters (atol 1e-6), as a full fine-tune does
    (tests/job/test_elastic_cpu.py)."""
    import torch

    ref_run = lora_runs["runs"]["lora"]
    run, out = lora_on_one_rank
    assert f"checkpoint-{EVERY} was saved by 2 ranks (2 x 1 x 1), resuming on 1 (1 x 1 x 2)" in out
    ref = {m["step"]: m for m in read_metrics(ref_run)}
    new = [m for m in read_metrics(run) if m["step"] > EVERY]
    assert [m["step"] for m in new] == list(range(EVERY + 1, STEPS + 1))
    for m in new:
        assert m["loss"] == pytest.approx(ref[m["step"]]["loss"], rel=5e-5), (m, ref[m["step"]])
    batches = [json.loads(line) for line in (run / "batches.jsonl").read_text().splitlines()]
    ref_batches = {b["step"]: b for b in map(json.loads, (ref_run / "batches.jsonl").read_text().splitlines())}
    assert [b["step"] for b in batches] == list(range(EVERY + 1, STEPS + 1))
    assert all(b["digest"] == ref_batches[b["step"]]["digest"] for b in batches)
    a = _dcp(ref_run / "checkpoints" / f"checkpoint-{STEPS}" / "pytorch_model_fsdp_0")
    b = _dcp(run / "checkpoints" / f"checkpoint-{STEPS}" / "pytorch_model_fsdp_0")
    flat_a, flat_b = _flatten(a), _flatten(b)
    assert flat_a.keys() == flat_b.keys() and any("lora_" in k for k in flat_a)
    for key, value in flat_a.items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(flat_b[key], value, rtol=1e-4, atol=1e-6, msg=key)


# ---------------------------------------------------------------------------------------------------------- served
@pytest.fixture(scope="module")
def served_lora(lora_runs: dict[str, Any]) -> Path:
    """The LoRA run (adapters on every decoder linear layer and the input embeddings), consolidated (model/ merged,
    adapter/), then the serve check (docs/serve-eval.md) with vLLM's CPU build (examples/tiny/envs.sh; CI builds it)."""
    from tests.conftest import need_model_job_python

    vllm = need_model_job_python("serve")
    import yaml

    from slurmft.job.consolidate.job import consolidate_run

    run = _copy(lora_runs["runs"]["lora"], lora_runs["runs"]["lora"].parent / "served")  # its checkpoints too
    consolidate_run(str(run))
    spec = yaml.safe_load((run / "config.yaml").read_text())
    spec["serve"] = {"python": vllm, "prompts": 2, "max_new_tokens": 12}
    (run / "config.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    from slurmft.job.serve_check import serve_check_run

    serve_check_run(str(run))  # raises when a check fails
    return run


def test_the_adapter_served_by_vllm_equals_the_merged_model(served_lora: Path, tiny_model: Path) -> None:
    """vLLM serves the base with the run's adapter (its LoRA support, as users serve adapters): the same greedy
    tokens and first-token log-probabilities as transformers on the merged model consolidation wrote, which vLLM
    serves too."""
    record = json.loads((served_lora / "serve" / "result.json").read_text())
    assert record["ok"] and set(record["engines"]) == {"model", "adapter"}
    merged, adapter = record["engines"]["model"], record["engines"]["adapter"]
    assert adapter["model"] == str(tiny_model) and adapter["adapter"] == str(served_lora / "adapter")
    assert adapter["compared_with"] == str(served_lora / "model")  # the merged model consolidation wrote
    for engine in (merged, adapter):
        assert engine["exact"] and engine["dtype"] == "float32" and engine["problems"] == []
        for p in engine["prompts"]:
            assert p["vllm"] == p["transformers"] and p["max_first_logprob_gap"] <= 1e-3
    assert [p["vllm"] for p in adapter["prompts"]] == [p["vllm"] for p in merged["prompts"]]
    sent = json.loads((served_lora / "serve" / "adapter.request.json").read_text())
    assert sent["lora"] == {"path": str(served_lora / "adapter"), "rank": 4} and sent["model"] == str(tiny_model)
    # not a no-op adapter: the merged model's first-token log-probabilities are not the base's
    from slurmft.job.serve_check import reference

    base = reference(tiny_model, "float32", sent["prompts"], 1)
    tuned = reference(served_lora / "model", "float32", sent["prompts"], 1)
    gaps = [float((a["logprobs"] - b["logprobs"]).abs().max()) for a, b in zip(base["outputs"], tuned["outputs"],
                                                                                 strict=True)]
    assert max(gaps) > 1e-3, gaps
