"""Consolidation of a real LoRA run (2 CPU ranks, FSDP2, adapter-only DCP checkpoint) into PEFT's adapter
directory and the merged model, checked against PEFT itself: ``PeftModel.from_pretrained`` loads the
adapter, ``merge_and_unload`` gives the merged model, ``save_pretrained`` gives the names.

One 4-step run (rsLoRA adapters on every linear layer of the decoder and on the input embeddings, ``lm_head``
trained in full as a ``modules_to_save`` copy) and one consolidation are shared by every test here.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from .helpers import launch_like_srun, write_run

pytestmark = pytest.mark.train

R, ALPHA = 4, 8.0  # use_rslora: scaling alpha / sqrt(r) = 4 (plain LoRA's would be 2)
DECODER = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


@pytest.fixture(scope="module")
def lora_run(tiny_model: Path, job_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 4-step LoRA run with one complete checkpoint (checkpoint-4), not yet consolidated."""
    run = write_run(tmp_path_factory.mktemp("lora") / "run", tiny_model,
                    ["train.max_steps=4", "checkpoint.every_steps=4", f"lora.r={R}", f"lora.alpha={ALPHA}",
                     "lora.use_rslora=true", f"lora.target_modules=[{', '.join([*DECODER, 'embed_tokens'])}]",
                     "lora.modules_to_save=[lm_head]"])
    rc, out = launch_like_srun(run, job_env).wait(timeout=600)
    assert rc == 0, out[-6000:]
    return run


@pytest.fixture(scope="module")
def consolidated(lora_run: Path) -> dict[str, Any]:
    """``consolidate_run`` on the run, with its log and every read of the base model's files recorded."""
    from slurmft.job.consolidate import merge
    from slurmft.job.consolidate.job import consolidate_run

    readers: list[merge.BaseWeights] = []

    class Recorded(merge.BaseWeights):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            readers.append(self)

    log = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(log):
        mp.setattr(merge, "BaseWeights", Recorded)
        summary = consolidate_run(str(lora_run))
    assert len(readers) == 1
    return {"summary": summary, "log": log.getvalue(), "reads": readers[0].reads}


def _checkpoint_tensors(run: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the run's final DCP model checkpoint, by DCP key (the adapter is small)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    path = run / "checkpoints/checkpoint-4/pytorch_model_fsdp_0"
    md = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    tensors = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in md.items()}  # type: ignore[union-attr]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(tensors, storage_reader=FileSystemReader(str(path)), no_dist=True)
    return tensors


def _safetensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def _base(tiny_model: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)


def test_adapter_loads_in_peft_with_the_checkpoint_tensors(
    lora_run: Path, consolidated: dict[str, Any], tiny_model: Path
) -> None:
    from peft import PeftModel

    adapter = lora_run / "adapter"
    assert consolidated["summary"]["adapter"]["output"] == str(adapter)
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {p.name for p in adapter.iterdir()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = PeftModel.from_pretrained(_base(tiny_model), str(adapter))
    complaints = [str(w.message) for w in caught if "key" in str(w.message).lower()]
    assert not complaints, complaints  # PEFT warns about missing or unexpected adapter keys

    # Every checkpoint tensor is in the loaded model, bitwise: lora_A/lora_B (fp32, as trained) and lm_head's copy.
    checkpoint = _checkpoint_tensors(lora_run)
    loaded = model.state_dict()
    assert checkpoint and all(k.startswith("model.") for k in checkpoint)
    for key, tensor in checkpoint.items():
        mine = loaded[key.removeprefix("model.")]
        assert mine.dtype == tensor.dtype == torch.float32 and torch.equal(mine, tensor), key
    assert any(".lora_B." in k and v.abs().sum() > 0 for k, v in checkpoint.items())  # it trained: B moved off 0
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (R, ALPHA, str(tiny_model))
    assert config["use_rslora"] is True and config["use_dora"] is False
    assert config["task_type"] == "CAUSAL_LM" and config["modules_to_save"] == ["lm_head"]


def test_adapter_is_what_peft_save_pretrained_writes(lora_run: Path, consolidated: dict[str, Any], tiny_model: Path,
                                                     tmp_path: Path) -> None:
    """Same file names, tensor names, shapes and dtypes, and config, as PEFT's own save of this configuration,
    with ``save_embedding_layers=False``: PEFT's default ("auto") would also copy the frozen base embedding
    (vocab x hidden) into the adapter because an embedding is a target; slurmft leaves it in the base model,
    which is unchanged (no new tokens), and PeftModel.from_pretrained loads it without a missing key (above)."""
    from peft import LoraConfig, get_peft_model

    ours = json.loads((lora_run / "adapter/adapter_config.json").read_text())
    reference = get_peft_model(_base(tiny_model), LoraConfig(
        r=R, lora_alpha=ALPHA, target_modules=ours["target_modules"], modules_to_save=["lm_head"],
        task_type="CAUSAL_LM", use_rslora=True))
    reference.save_pretrained(str(tmp_path), save_embedding_layers=False)
    theirs = json.loads((tmp_path / "adapter_config.json").read_text())
    differ = {k for k in theirs.keys() | ours.keys() if theirs.get(k) != ours.get(k)}
    assert differ <= {"target_modules", "base_model_name_or_path"}, differ  # a set, written in any order
    assert sorted(theirs["target_modules"]) == sorted(ours["target_modules"])
    assert sorted(ours["target_modules"]) == sorted([*DECODER, "embed_tokens"])

    a, b = _safetensors(lora_run / "adapter"), _safetensors(tmp_path)
    assert {k: (v.shape, v.dtype) for k, v in a.items()} == {k: (v.shape, v.dtype) for k, v in b.items()}
    assert "base_model.model.lm_head.weight" in a and "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in a
    assert "base_model.model.model.embed_tokens.lora_embedding_A" in a


def test_merged_model_equals_peft_merge_and_unload(lora_run: Path, consolidated: dict[str, Any],
                                                  tiny_model: Path) -> None:
    """Bitwise: both compute W + scaling * (B @ A) in float32 in the same order (PEFT's get_delta_weight, then
    ``+=``), so on this fp32 model there is no rounding difference to allow for (measured: max |diff| 0); with
    rsLoRA's scaling (alpha / sqrt(r), from adapter_config.json's use_rslora for PEFT) and for the embedding's
    update (B @ A transposed)."""
    from peft import PeftModel

    reference = PeftModel.from_pretrained(_base(tiny_model), str(lora_run / "adapter")).merge_and_unload()
    expected = reference.state_dict()
    merged = _safetensors(lora_run / "model")
    assert set(merged) == set(expected)
    for name, tensor in merged.items():
        assert tensor.dtype == expected[name].dtype == torch.float32
        assert torch.equal(tensor, expected[name]), (name, (tensor - expected[name]).abs().max().item())

    base = _safetensors(tiny_model)
    changed = {n for n in merged if not torch.equal(merged[n], base[n])}
    adapted = {n for n in merged if n.endswith(("_proj.weight",))} | {"model.embed_tokens.weight"}
    assert changed == adapted | {"lm_head.weight"}  # every adapted weight moved, lm_head is the trained copy, the rest is the base
    assert consolidated["summary"]["adapter"]["merged_weights"] == len(adapted) == 29


def test_merged_model_loads_cleanly_with_save_pretrained_names(
    lora_run: Path, consolidated: dict[str, Any], tiny_model: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    out = lora_run / "model"
    assert consolidated["summary"]["model"] == str(out) and (out / "model.safetensors.index.json").is_file()
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                records.append(record.getMessage())

    handler = Collect()
    hf_logging.get_logger("transformers").addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model, info = AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    finally:
        hf_logging.get_logger("transformers").removeHandler(handler)
    assert not any(info.values()), info  # missing, unexpected, mismatched keys, errors
    assert not records, records
    assert not [str(w.message) for w in caught if "deprecated" not in str(w.message)]
    assert model.dtype == torch.float32  # auto = the base model's file dtype

    _base(tiny_model).save_pretrained(str(tmp_path))
    theirs = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"] if (
        tmp_path / "model.safetensors.index.json").is_file() else dict.fromkeys(_safetensors(tmp_path))
    ours = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(ours) == sorted(theirs)
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "float32" and config["architectures"] == ["LlamaForCausalLM"]
    assert (out / "generation_config.json").is_file() and (out / "tokenizer.json").is_file()


def test_merge_streams_the_base_model_one_tensor_at_a_time(consolidated: dict[str, Any], tiny_model: Path) -> None:
    """Bounded memory, on the real reads: every base tensor is read once, by itself (never more than the
    largest tensor at once), and lm_head, replaced by its trained copy, is not read from the base at all."""
    from safetensors import safe_open

    with safe_open(str(tiny_model / "model.safetensors"), framework="pt") as f:
        sizes = {k: f.get_slice(k).get_shape() for k in f.keys()}  # noqa: SIM118
    nbytes = {k: 4 * int(torch.Size(s).numel()) for k, s in sizes.items()}  # fp32 base
    reads = consolidated["reads"]
    assert sorted(reads) == sorted(v for k, v in nbytes.items() if k != "lm_head.weight")
    assert max(reads) <= max(nbytes.values())
    assert sum(nbytes.values()) > 4 * max(reads)  # the bound means something: the model is much larger than one read
    log = consolidated["log"]
    assert "W + 4 * B @ A for 29 weights, 1 replaced by trained modules_to_save copies" in log  # rsLoRA: 8 / sqrt(4)


def test_merge_false_writes_the_adapter_only(lora_run: Path, consolidated: dict[str, Any], tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    from slurmft.cli import _echo_jobs
    from slurmft.job.consolidate.job import consolidate_run
    from slurmft.rundir import RunPaths
    from slurmft.submit.resume import model_ready
    from slurmft.watch.results import model_info

    run = tmp_path / "run"
    run.mkdir()
    cfg = yaml.safe_load((lora_run / "config.yaml").read_text())
    cfg["consolidate"]["merge"] = False
    cfg["output_dir"] = str(run)
    (run / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    shutil.copytree(lora_run / "checkpoints", run / "checkpoints")

    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        summary = consolidate_run(str(run))
    paths = RunPaths.of(run)
    assert sorted(p.name for p in run.iterdir() if not p.name.startswith(".")) == ["adapter", "checkpoints", "config.yaml"]
    assert summary["model"] is None and summary["output"] == str(paths.adapter) and summary["shards"] == []
    assert "consolidate.merge is false: only the adapter is written" in log.getvalue()
    assert "no merged model" in log.getvalue() and str(paths.model) + " (" not in log.getvalue()
    assert _safetensors(paths.adapter).keys() == _safetensors(lora_run / "adapter").keys()
    assert model_info(paths) is None  # status and the report do not claim a model
    capsys.readouterr()
    _echo_jobs(run, "local", {"train": "1", "consolidate": "2"})  # the end of a local submit or resume
    assert capsys.readouterr().out.splitlines()[-2:] == [  # was: "model: RUN/model  (... loads it)", no adapter
        f"adapter: {paths.adapter}  (PeftModel.from_pretrained(base, adapter) loads it)",
        "model: not written (consolidate.merge is false: the adapter is the result)"]
    _echo_jobs(lora_run, "local", {"consolidate": "2"})  # merged: both, each with how to load it
    assert capsys.readouterr().out.splitlines()[-2:] == [
        f"adapter: {lora_run / 'adapter'}  (PeftModel.from_pretrained(base, adapter) loads it)",
        f"model: {lora_run / 'model'}  (AutoModelForCausalLM.from_pretrained loads it)"]
    final = paths.checkpoints / "checkpoint-4"
    assert model_ready(paths, final, adapter_only=True) and not model_ready(paths, final)  # resume: finished


def test_merged_weight_is_peft_merge_for_linear_and_embedding_layers() -> None:
    """The update rule on its own, against PEFT's merge of a linear and an embedding layer (whose B @ A is
    stored transposed): bitwise in float32."""
    from peft import LoraConfig, get_peft_model

    from slurmft.job.consolidate.lora import LoraDelta
    from slurmft.job.consolidate.merge import merged_weight

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(11, 6)
            self.proj = torch.nn.Linear(6, 5, bias=False)

    torch.manual_seed(0)
    model = Tiny()
    base = {k: v.clone() for k, v in model.state_dict().items()}
    peft = get_peft_model(model, LoraConfig(r=3, lora_alpha=5, target_modules=["embed", "proj"]))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.normal_()
    lora = {k: v.clone() for k, v in peft.state_dict().items() if "lora_" in k}
    merged = peft.merge_and_unload().state_dict()
    s = 5 / 3
    proj = merged_weight(base["proj.weight"].clone(), lora["base_model.model.proj.lora_A.default.weight"],
                         lora["base_model.model.proj.lora_B.default.weight"], LoraDelta("a", "b", s, False))
    embed = merged_weight(base["embed.weight"].clone(), lora["base_model.model.embed.lora_embedding_A.default"],
                          lora["base_model.model.embed.lora_embedding_B.default"], LoraDelta("a", "b", s, True))
    assert torch.equal(proj, merged["proj.weight"]) and torch.equal(embed, merged["embed.weight"])
    assert not torch.equal(proj, base["proj.weight"])


def test_the_marker_records_the_base_and_a_replaced_base_is_refused(
        lora_run: Path, consolidated: dict[str, Any], tiny_model: Path, tmp_path: Path) -> None:
    """The COMPLETE marker names the base's files (sizes, sha256 of header and data samples); consolidation onto a
    base replaced by another model of the same shapes (every weight moved by 1e-3: same header) is refused before
    anything is written, naming both; a moved copy of the same files is the same base."""
    from safetensors.torch import load_file, save_file

    from slurmft.errors import CheckpointError
    from slurmft.job.consolidate.job import consolidate_run
    from slurmft.job.inputs import base_differences, base_identity

    marker = json.loads((lora_run / "checkpoints/checkpoint-4/COMPLETE").read_text())
    base = marker["base"]
    assert base["name_or_path"] == str(tiny_model) and base["revision"] is None
    assert set(base["files"]) == {"model.safetensors", "config.json"}
    assert base["files"]["model.safetensors"]["bytes"] == (tiny_model / "model.safetensors").stat().st_size
    assert "the base model is not the one" not in consolidated["log"]

    moved = tmp_path / "moved"
    shutil.copytree(tiny_model, moved)
    from slurmft.config import ModelConfig

    assert base_differences(base, base_identity(ModelConfig(name_or_path=str(moved)), moved)) == []

    other = tmp_path / "other"
    shutil.copytree(tiny_model, other)
    weights = load_file(str(other / "model.safetensors"))
    save_file({k: v + 1e-3 for k, v in weights.items()}, str(other / "model.safetensors"), metadata={"format": "pt"})
    assert (other / "model.safetensors").stat().st_size == base["files"]["model.safetensors"]["bytes"]

    run = tmp_path / "run"
    run.mkdir()
    cfg = yaml.safe_load((lora_run / "config.yaml").read_text())
    cfg["output_dir"], cfg["model"]["name_or_path"] = str(run), str(other)
    (run / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    shutil.copytree(lora_run / "checkpoints", run / "checkpoints")
    with pytest.raises(CheckpointError) as err, contextlib.redirect_stdout(io.StringIO()):
        consolidate_run(str(run))
    text = err.value.render()
    assert "the base model is not the one checkpoint-4 was trained on" in text
    assert f"trained on {tiny_model}" in text and f"found {other}" in text
    was, now = base["files"]["model.safetensors"]["sha256"][:16], base_identity(ModelConfig(name_or_path=str(other)), other)
    assert f"model.safetensors: {base['files']['model.safetensors']['bytes']:,} bytes, sha256 {was} at training" in text
    assert f"sha256 {now['files']['model.safetensors']['sha256'][:16]} now" in text
    assert "consolidate.merge: false" in text
    assert not (run / "model").exists() and not (run / "adapter").exists()  # nothing written


def test_a_trained_update_the_merged_model_has_no_tensor_for_is_refused() -> None:
    """A delta on a tied head (lm_head, stored as embed_tokens): the export has no lm_head tensor, so the update
    would be left out; the merge plan refuses, naming it and its alias."""
    from types import SimpleNamespace

    from torch.distributed.checkpoint.metadata import Metadata

    from slurmft.errors import CheckpointError
    from slurmft.job.consolidate.lora import LoraDelta, LoraLayout
    from slurmft.job.consolidate.merge import plan_merge
    from slurmft.job.consolidate.plan import ModelLayout

    layout = ModelLayout("GemmaForCausalLM", {"model.embed_tokens.weight": (10, 4)},
                         {"lm_head.weight": "model.embed_tokens.weight"}, None)
    lora = LoraLayout(None, [], {"lm_head.weight": LoraDelta("a", "b", 2.0, False)}, {}, [])
    entries = {"model.embed_tokens.weight": SimpleNamespace(dtype="F32")}
    with pytest.raises(CheckpointError) as err:
        plan_merge(layout, lora, entries, Metadata(state_dict_metadata={}), torch.float32)
    assert ("lm_head.weight: the adapters trained an update of it, but the merged model has no such tensor (it is "
            "model.embed_tokens.weight, tied") in err.value.render()


def test_consolidate_of_the_run_writes_its_adapter_into_adapter_dir(lora_run: Path, consolidated: dict[str, Any],
                                                                    tmp_path: Path) -> None:
    """`slurmft consolidate RUN_DIR` (redoing a failed consolidation) gives the job out=RUN_DIR/model explicitly; the
    adapter went to RUN_DIR/model-adapter, where status, serve and eval never look. It goes to RUN_DIR/adapter, as the
    chained job's does; only another --out gets OUT-adapter beside it."""
    from slurmft.job.consolidate.job import consolidate_run

    run = tmp_path / "run"
    run.mkdir()
    cfg = yaml.safe_load((lora_run / "config.yaml").read_text())
    cfg["output_dir"] = str(run)
    (run / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    shutil.copytree(lora_run / "checkpoints", run / "checkpoints")
    with contextlib.redirect_stdout(io.StringIO()):
        summary = consolidate_run(str(run), out=str(run / "model"))
        consolidate_run(str(run), out=str(tmp_path / "elsewhere"))
    assert sorted(p.name for p in run.iterdir() if not p.name.startswith(".")) == [
        "adapter", "checkpoints", "config.yaml", "model"]
    assert summary["adapter"]["output"] == str(run / "adapter")
    assert _safetensors(run / "adapter").keys() == _safetensors(lora_run / "adapter").keys()
    assert (tmp_path / "elsewhere-adapter" / "adapter_config.json").is_file()
