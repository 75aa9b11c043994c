"""Every architecture docs/first-run.md names, through the whole job: a tiny model of each, built by transformers
itself (slurmft.tiny.build_arch: ``AutoConfig.for_model``, ``save_pretrained``), trained by two CPU ranks with
FSDP2 (4 steps, a checkpoint at step 2), resumed from checkpoint-2 into a copy of the run, and consolidated.

Per architecture (one pair of runs, shared by the checks): the parameters are DTensor shards on both ranks; the
resumed run's checkpoint-4 (model and optimizer) is bitwise the uninterrupted run's; the export loads with
``from_pretrained`` with no missing or unexpected keys, its state dict bitwise the checkpoint's (transformers'
own load-time conversion turns the per-expert tensors back into the fused ones: not our code checking our
code); its tensor names are exactly those ``save_pretrained`` wrote for the base model. MoE layouts: Mixtral
(renamed ``block_sparse_moe``, w1/w3 fused), Qwen3-MoE and DeepSeek-V3 (``qwen2_moe`` conversion; MLA and a
shared expert), gpt-oss (fused on disk already); tied embeddings: Gemma, Gemma-2, Gemma-3.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from slurmft.tiny import ARCHITECTURES

from .helpers import launch_like_srun, read_metrics, write_run

pytestmark = pytest.mark.train

STEPS, EVERY = 4, 2
RUN_ARGS = [f"train.max_steps={STEPS}", f"checkpoint.every_steps={EVERY}", "checkpoint.keep_last=2",
            "data.max_seq_length=128", "train.per_device_batch_size=1", "fsdp.activation_checkpointing=false"]
RUN_MANY = Path(__file__).resolve().parent / "run_many.py"


@pytest.fixture(scope="module")
def arch_runs(job_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path, Path]]:
    """model type -> (base model dir, uninterrupted run, run resumed from checkpoint-2 and consolidated).

    Two launches for all of them (tests/job/run_many.py: one start-up per rank, not one per run): the
    uninterrupted runs, then the copies cut back to checkpoint-2, which resume.
    """
    from slurmft.job.consolidate.job import consolidate_run
    from slurmft.tiny import SIZES, build_arch, build_tokenizer

    root = tmp_path_factory.mktemp("arch")
    tokenizer = build_tokenizer(SIZES["tiny"].vocab_size)
    runs = {}
    for arch in ARCHITECTURES:
        model = build_arch(root / arch / "model", arch, tokenizer)
        runs[arch] = (model, write_run(root / arch / "run", model, RUN_ARGS), root / arch / "resumed")
    _, out = launch_like_srun(root / "first", job_env, program=[str(RUN_MANY)],
                               args=[str(r) for _, r, _ in runs.values()]).wait(timeout=900)
    for _, run, resumed in runs.values():
        if list(run.parent.glob("run.failed.rank*")):
            continue
        shutil.copytree(run, resumed, ignore=shutil.ignore_patterns(f"checkpoint-{STEPS}", "model", "fsdp_report"))
        (resumed / "config.yaml").write_text((run / "config.yaml").read_text().replace(str(run), str(resumed)))
        kept = [m for m in read_metrics(run) if m["step"] <= EVERY]
        (resumed / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in kept))
    second = [str(r) for _, _, r in runs.values() if r.is_dir()]
    _, out2 = launch_like_srun(root / "second", job_env, program=[str(RUN_MANY)], args=second).wait(timeout=900)
    (root / "launch.log").write_text(out + out2)
    for _, _, resumed in runs.values():
        if resumed.is_dir() and not list(resumed.parent.glob("resumed.failed.rank*")):
            consolidate_run(str(resumed))
    return runs


@pytest.fixture(params=sorted(ARCHITECTURES))
def arch_run(request: pytest.FixtureRequest, arch_runs: dict[str, tuple[Path, Path, Path]]
             ) -> tuple[str, Path, Path, Path]:
    arch = request.param
    model, run, resumed = arch_runs[arch]
    for path in sorted(run.parent.glob("*.failed.rank*")):
        pytest.fail(f"{arch}: {path.name}: {path.read_text()[-4000:]}")
    log = (run.parent.parent / "launch.log").read_text()
    assert log.count(f"resuming from checkpoint-{EVERY}") == len(ARCHITECTURES), log[-3000:]
    return arch, model, run, resumed


def _dcp(root: Path) -> dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    out: dict[str, Any] = {}
    for sub in ("pytorch_model_fsdp_0", "optimizer_0"):
        md = FileSystemReader(str(root / sub)).read_metadata()
        sd = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()
              if hasattr(v, "size")}
        dcp.load(sd, checkpoint_id=str(root / sub), no_dist=True)
        out.update({f"{sub}/{k}": t for k, t in sd.items()})
    return out


def _keys(directory: Path) -> set[str]:
    from safetensors import safe_open

    index = directory / "model.safetensors.index.json"
    files = set(json.loads(index.read_text())["weight_map"].values()) if index.is_file() else {"model.safetensors"}
    keys: set[str] = set()
    for name in files:
        with safe_open(str(directory / name), framework="pt") as f:
            keys |= set(f.keys())
    return keys


def test_architecture_trains_sharded_resumes_bitwise_and_exports_what_save_pretrained_writes(
        arch_run: tuple[str, Path, Path, Path]) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    arch, model_dir, run, resumed = arch_run
    for rank in (0, 1):
        rep = json.loads((run / "fsdp_report" / f"rank{rank}.json").read_text())
        assert rep["param_types"] == ["DTensor"] and rep["num_dtensors"] == rep["num_tensors"] > 0, rep
        assert rep["local_bytes"] < rep["full_bytes"], rep
    steps = [m["step"] for m in read_metrics(resumed)]
    assert steps == list(range(1, STEPS + 1)), steps  # 1-2 copied, 3-4 after the resume (a fresh start repeats 1-2)

    a = _dcp(run / "checkpoints" / f"checkpoint-{STEPS}")
    b = _dcp(resumed / "checkpoints" / f"checkpoint-{STEPS}")
    assert a.keys() == b.keys() and a
    for key in a:
        assert torch.equal(a[key], b[key]), f"{arch}: {key} differs after the resume"
    base = {k.split("/", 1)[1].removeprefix("model."): t for k, t in b.items() if k.startswith("pytorch_model")}

    exported, info = AutoModelForCausalLM.from_pretrained(resumed / "model", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], (arch, info)
    state = exported.state_dict()
    tied = {"lm_head.weight"} if exported.config.get_text_config().tie_word_embeddings else set()
    assert set(base) <= set(state) and set(state) - set(base) <= tied, (arch, set(state) ^ set(base))
    for name, tensor in base.items():
        assert torch.equal(state[name], tensor), f"{arch}: {name} in the export differs from checkpoint-{STEPS}"
    initial = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    assert any(not torch.equal(initial[n], t) for n, t in base.items()), f"{arch}: the export is the base model"
    assert _keys(resumed / "model") == _keys(model_dir), arch


def test_parameter_count_from_headers_and_from_config_json(arch_run: tuple[str, Path, Path, Path], tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """``slurmft estimate``'s count: from the safetensors headers, every tensor the instantiated model saves;
    from config.json alone (the family's arithmetic), within 0.5 % of its parameters (exact for these)."""
    from cli_runner import cli
    from transformers import AutoModelForCausalLM

    from slurmft.plan.paramcount import FAMILIES

    arch, model_dir, run, _ = arch_run
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    params = sum(p.numel() for p in model.parameters())  # a tied head once
    saved = sum({id(t): t.numel() for t in model.state_dict(keep_vars=True).values()}.values())  # + buffers saved

    code, out, err = cli(["estimate", str(run / "config.yaml"), "--json"], capsys)
    assert code == 0, err
    result = json.loads(out)
    assert result["model"]["parameters_from"] == "safetensors headers" and result["parameters"] == saved, arch
    assert "parameters counted from the safetensors headers of the weights (exact)" in result["assumptions"]

    config_only = tmp_path / "config-only"
    config_only.mkdir()
    shutil.copy(model_dir / "config.json", config_only / "config.json")
    code, out, err = cli(["estimate", str(run / "config.yaml"), f"model.name_or_path={config_only}", "--json"], capsys)
    assert code == 0, err
    result = json.loads(out)
    assert arch in FAMILIES and result["model"]["parameters_from"] == "config.json"
    assert result["model"]["family"] == FAMILIES[arch]
    assert abs(result["parameters"] - params) <= 0.005 * params, (arch, result["parameters"], params)
    if model.config.to_dict().get("num_experts_per_tok"):
        assert any(line.startswith("MoE activations:") for line in result["assumptions"]), result["assumptions"]


def test_an_moe_model_of_the_zoo_serves_on_vllm_as_transformers_generates(
        arch_runs: dict[str, tuple[Path, Path, Path]], tmp_path: Path) -> None:
    """The serve check (slurmft.job.serve_check, what the serve job runs) on the zoo's Qwen3-MoE after training,
    resume and consolidation: vLLM's CPU build loads the exported experts with no missing or unexpected weight, and
    its greedy tokens and first-token log-probabilities equal transformers' (float32: exact tokens, log-probs within
    1e-3). Its consolidated model is copied into a run directory whose config gains a serve section, as a user adds
    one before ``slurmft serve RUN_DIR``."""
    import yaml

    from slurmft.job.serve_check import serve_check_run
    from tests.conftest import need_model_job_python

    python = need_model_job_python("serve")
    _, _, resumed = arch_runs["qwen3_moe"]
    assert (resumed / "model" / "config.json").is_file(), "the resumed Qwen3-MoE run was not consolidated"
    run = tmp_path / "run"
    run.mkdir()
    shutil.copytree(resumed / "model", run / "model")
    config = yaml.safe_load((resumed / "config.yaml").read_text())
    config.update(output_dir=str(run), serve={"python": python, "prompts": 2, "max_new_tokens": 8,
                                              "resources": {"gpus": 0, "time": "00:10:00"}})
    (run / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    summary = serve_check_run(str(run))
    record = json.loads((run / "serve" / "result.json").read_text())
    engine = record["engines"]["model"]
    assert summary["ok"] and record["ok"] and engine["ok"] and engine["exact"], record
    assert engine["dtype"] == "float32" and engine["loading"] == {k: [] for k in engine["loading"]}
    assert len(engine["prompts"]) == 2 and engine["vllm_version"]
    for prompt in engine["prompts"]:  # every greedy token equal, up to 8 or an EOS both stopped at
        assert 0 < prompt["agree"] == len(prompt["transformers"]) == len(prompt["vllm"]) <= 8, prompt
