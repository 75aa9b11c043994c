"""The serve check of a LoRA run: vLLM serves the base with the run's adapter (its LoRA support, as users serve
adapters) and must equal the merged model that consolidation wrote; vLLM also serves that merged model/.

A 4-step LoRA run (2 CPU ranks, FSDP2, plain LoRA on every linear layer of the decoder), consolidated, then
``serve_check_run`` with vLLM's CPU build (examples/tiny/envs.sh's venv; CI builds it). The adapter is trained
from B = 0 for 4 steps at lr 1e-3: the test checks that it moved the greedy tokens or the log-probabilities, so
that "equal to the merged model" is not "equal to the base".
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.conftest import need_model_job_python

from .helpers import launch_like_srun, write_run

pytestmark = pytest.mark.train


@pytest.fixture(scope="module")
def served_lora(tiny_model: Path, job_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    vllm = need_model_job_python("serve")
    run = write_run(tmp_path_factory.mktemp("served-lora") / "run", tiny_model,
                    ["train.max_steps=4", "checkpoint.every_steps=4", "lora.r=8", "lora.alpha=16",
                     "data.max_seq_length=64"])
    rc, out = launch_like_srun(run, job_env).wait(timeout=600)
    assert rc == 0, out[-6000:]
    from slurmft.job.consolidate.job import consolidate_run

    consolidate_run(str(run))
    spec = yaml.safe_load((run / "config.yaml").read_text())
    spec["serve"] = {"python": vllm, "prompts": 2, "max_new_tokens": 12}
    (run / "config.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    from slurmft.job.serve_check import serve_check_run

    serve_check_run(str(run))  # raises when a check fails
    return run


def test_the_adapter_served_by_vllm_equals_the_merged_model(served_lora: Path, tiny_model: Path) -> None:
    record = json.loads((served_lora / "serve" / "result.json").read_text())
    assert record["ok"] and set(record["engines"]) == {"model", "adapter"}
    merged, adapter = record["engines"]["model"], record["engines"]["adapter"]
    assert adapter["model"] == str(tiny_model) and adapter["adapter"] == str(served_lora / "adapter")
    assert adapter["compared_with"] == str(served_lora / "model")  # the merged model consolidation wrote
    for engine in (merged, adapter):
        assert engine["exact"] and engine["dtype"] == "float32" and engine["problems"] == []
        for p in engine["prompts"]:
            assert p["vllm"] == p["transformers"] and p["max_first_logprob_gap"] <= 1e-3
    # vLLM's LoRA and the merged model give the same tokens (both equal transformers' on model/)
    assert [p["vllm"] for p in adapter["prompts"]] == [p["vllm"] for p in merged["prompts"]]
    sent = json.loads((served_lora / "serve" / "adapter.request.json").read_text())
    assert sent["lora"] == {"path": str(served_lora / "adapter"), "rank": 8} and sent["model"] == str(tiny_model)


def test_the_adapter_changed_what_the_base_says(served_lora: Path, tiny_model: Path) -> None:
    """The served adapter is not a no-op: the merged model's first-token log-probabilities differ from the base's."""
    import torch

    from slurmft.job.serve_check import reference

    request = json.loads((served_lora / "serve" / "model.request.json").read_text())
    base = reference(tiny_model, "float32", request["prompts"], 1)
    merged = reference(served_lora / "model", "float32", request["prompts"], 1)
    gaps = [float((a["logprobs"] - b["logprobs"]).abs().max()) for a, b in zip(base["outputs"], merged["outputs"],
                                                                                 strict=True)]
    assert max(gaps) > 1e-3, gaps
    assert torch.isfinite(torch.tensor(gaps)).all()
