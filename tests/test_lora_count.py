"""slurmft estimate's LoRA arithmetic (slurmft/plan/paramcount.py ``adapter_count``) against the job's own adapters:
``slurmft.job.adapters.add_adapters`` (PEFT's ``get_peft_model``) on the meta-device model of each architecture
``python -m slurmft.tiny --arch`` builds, and on the tiny Llama's files through ``slurmft estimate``.

The count must be exact: PEFT adds ``r·(in + out)`` per adapted linear layer; the job adapts no fused expert tensor
or router, nor (on the MoE models PEFT 0.21 converts) a linear layer named like them, such as DeepSeek's dense and
shared MLPs: if a PEFT release changes that, these tests say so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from slurmft.config_loading import validate
from slurmft.plan import estimate as E
from slurmft.plan.paramcount import adapter_count
from slurmft.profiles import ClusterProfile
from slurmft.tiny import _MOE, ARCH_COMMON, ARCHITECTURES

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

# Model types paramcount.FAMILIES knows that slurmft.tiny does not build, at the same tiny size.
MORE: dict[str, dict[str, object]] = {
    "llama": {},
    "qwen2": {},
    "smollm3": {"pad_token_id": 0},
    "phi3": {"pad_token_id": 0},  # fused qkv_proj and gate_up_proj linear layers
    "qwen2_moe": {**_MOE, "num_experts": 4, "shared_expert_intermediate_size": 48},  # PEFT converts nothing here
    "olmoe": {"num_experts": 4, "num_experts_per_tok": 2},
    "deepseek_v2": ARCHITECTURES["deepseek_v3"],
}
ALL = {**ARCHITECTURES, **MORE}


def _config(model_type: str) -> Any:
    return transformers.AutoConfig.for_model(model_type, **{**ARCH_COMMON, **ALL[model_type]}, vocab_size=300)


def _job_trainable(config: Any, lora: dict[str, Any]) -> tuple[int, list[str]]:
    """What the job builds: its add_adapters on the meta-device model (trainable parameters, adapted names)."""
    from slurmft.config import LoraConfig
    from slurmft.job.adapters import add_adapters

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    wrapped, summary = add_adapters(model, LoraConfig(**lora))
    assert summary.trainable == sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    return summary.trainable, summary.target_modules


@pytest.mark.parametrize("model_type", sorted(ALL))
@pytest.mark.parametrize("lora", [{"r": 8}, {"r": 4, "modules_to_save": ["embed_tokens", "lm_head"]}],
                         ids=["all-linear", "modules_to_save"])
def test_all_linear_count_is_the_jobs(model_type: str, lora: dict[str, Any]) -> None:
    config = _config(model_type)
    count = adapter_count(config.to_dict(), lora["r"], "all-linear", lora.get("modules_to_save", []))
    if lora.get("modules_to_save") and config.tie_word_embeddings:  # a copy would untie them: both refuse
        from slurmft.errors import JobSetupError

        with pytest.raises(JobSetupError) as err:
            _job_trainable(config, lora)
        assert "tied input and output embeddings" in err.value.render()
        assert count.unmatched and all("tied embeddings" in u for u in count.unmatched)
        return
    trainable, names = _job_trainable(config, lora)
    assert count.trainable == trainable, (model_type, count.target_modules, names)
    assert set(count.target_modules) <= set(names) and not count.unmatched


LISTS = {"llama": ["q_proj", "v_proj"], "mixtral": ["q_proj", "self_attn.o_proj"], "qwen3_moe": ["k_proj"],
         "deepseek_v3": ["q_a_proj", "kv_b_proj"], "gemma2": ["down_proj", "o_proj"], "phi3": ["qkv_proj"],
         "gpt_oss": ["q_proj", "v_proj"], "qwen2_moe": ["shared_expert_gate", "q_proj"]}


@pytest.mark.parametrize("model_type", sorted(LISTS))
def test_listed_names_count_is_the_jobs(model_type: str) -> None:
    config = _config(model_type)
    trainable, _ = _job_trainable(config, {"r": 16, "target_modules": LISTS[model_type]})
    assert adapter_count(config.to_dict(), 16, LISTS[model_type]).trainable == trainable


@pytest.mark.parametrize("model_type", sorted(ALL))
def test_embedding_and_head_targets_count_as_the_job_adds_them_or_both_refuse_tied_ones(model_type: str) -> None:
    """[o_proj, embed_tokens, lm_head]: an embedding LoRA (A [r, vocab], B [h, r]) and a linear one on the head;
    on a model with tied embeddings the job refuses both names and the count says it does."""
    config = _config(model_type)
    targets = ["o_proj", "embed_tokens", "lm_head"]
    count = adapter_count(config.to_dict(), 4, targets)
    if config.tie_word_embeddings:
        from slurmft.errors import JobSetupError

        with pytest.raises(JobSetupError) as err:
            _job_trainable(config, {"r": 4, "target_modules": targets})
        assert err.value.render().count("tied input and output embeddings") == 2
        assert [u.split(" ")[0] for u in count.unmatched] == ["'embed_tokens'", "'lm_head'"]
        return
    trainable, names = _job_trainable(config, {"r": 4, "target_modules": targets})
    assert {"embed_tokens", "lm_head"} <= set(names)  # the summary (log, marker, fsdp_report) names both
    assert count.trainable == trainable and set(count.target_modules) == set(names) and not count.unmatched


def test_a_name_the_job_refuses_adapts_nothing_and_says_why() -> None:
    count = adapter_count(_config("mixtral").to_dict(), 8, ["q_proj", "w1", "gate_up_proj"])
    assert count.target_modules == ("q_proj",)
    assert count.unmatched[0].startswith("'w1' is no linear layer of this mixtral")
    assert count.unmatched[1].startswith("'gate_up_proj' is a router or fused expert tensor")


def test_estimate_of_the_tiny_llamas_files_counts_the_jobs_adapters(tiny_model: Path) -> None:
    cfg = validate({"name": "t", "output_dir": "/tmp/slurmft-test", "model": {"name_or_path": str(tiny_model)},
                    "data": {"datasets": [{"path": "GAIR/lima"}], "max_seq_length": 256},
                    "lora": {"r": 8, "target_modules": "all-linear"}})
    profile = ClusterProfile(name="a100", description="test", gpu={"type": "A100-80GB", "memory_gb": 80},
                             node_memory_gb=1152)
    result = E.estimate(cfg, profile)
    config = transformers.AutoConfig.from_pretrained(tiny_model)
    trainable, names = _job_trainable(config, {"r": 8})
    assert result["lora"]["trainable_params"] == trainable
    assert result["lora"]["resolved_target_modules"] == sorted(names)
    assert result["lora"]["total_params"] == result["parameters"] + trainable
    assert result["checkpoint_bytes"] == 12 * trainable
