"""LoRA adapters on the meta-device model (slurmft/job/adapters.py), without a process group: which modules get
an adapter on every tested architecture, which target names are refused and how, the seeded initial values,
and the names the base weights are read under."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from slurmft.checkpoints import is_adapter_name, strip_wrappers
from slurmft.config import LoraConfig
from slurmft.errors import JobSetupError
from slurmft.job import adapters
from slurmft.tiny import ARCH_COMMON, ARCHITECTURES


def _meta(model_type: str) -> Any:
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **{**ARCH_COMMON, **ARCHITECTURES[model_type]}, vocab_size=300)
    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_all_linear_adapts_every_linear_layer_but_the_head_on_every_architecture(arch: str) -> None:
    """all-linear: every nn.Linear except the output head; fused expert tensors stay frozen, and so do the
    linear layers PEFT would move onto them by name (DeepSeek-V3's dense and shared-expert MLP: gate_proj, ...)."""
    model = _meta(arch)
    linear = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)} - {"lm_head"}
    if arch == "deepseek_v3":
        linear = {n for n in linear if ".mlp." not in n}
    wrapped, summary = adapters.add_adapters(model, LoraConfig(r=4))
    adapted = {n.removeprefix("base_model.model.") for n, m in wrapped.named_modules() if hasattr(m, "lora_A")}
    assert adapted == linear
    trainable = {n: p for n, p in wrapped.named_parameters() if p.requires_grad}
    assert trainable and all(is_adapter_name(n) for n in trainable)
    assert all(p.dtype == torch.float32 for p in trainable.values())  # adapters in fp32
    built = {n: p.dtype for n, p in _meta(arch).named_parameters()}
    assert {strip_wrappers(n): p.dtype for n, p in wrapped.named_parameters() if not p.requires_grad} == built
    assert summary.trainable == sum(p.numel() for p in trainable.values())
    expected = sum(4 * (m.in_features + m.out_features) for n, m in model.named_modules() if n in linear)
    assert summary.trainable == expected
    # the base tensors keep their checkpoint names and dtypes under PEFT's wrapper (the frozen tensors are the base)


def test_a_fused_expert_tensor_is_refused_by_name() -> None:
    with pytest.raises(JobSetupError) as err:
        adapters.add_adapters(_meta("mixtral"), LoraConfig(target_modules=["q_proj", "gate_up_proj"]))
    text = err.value.render()
    assert "lora.target_modules: 'gate_up_proj' is a fused tensor (MixtralExperts.gate_up_proj" in text
    assert "LoRA on fused expert tensors is not supported" in text
    assert "all-linear, or some of: k_proj, lm_head, o_proj, q_proj, v_proj" in text


def test_a_name_peft_moves_onto_the_experts_is_refused() -> None:
    with pytest.raises(JobSetupError) as err:
        adapters.add_adapters(_meta("deepseek_v3"), LoraConfig(target_modules=["q_a_proj", "down_proj"]))
    text = err.value.render()
    assert "lora.target_modules: 'down_proj' names the fused expert tensors of this mixture-of-experts model" in text
    assert "LoRA on fused expert tensors is not supported" in text


def test_every_target_name_must_match_a_linear_layer() -> None:
    model = _meta("qwen3")
    problems = adapters.target_problems(model, LoraConfig(target_modules=["q_proj", "qproj", "norm"],
                                                          modules_to_save=["embed", "lm_head"]))
    assert problems == [
        "lora.target_modules: 'qproj' matches no module of Qwen3ForCausalLM; its linear layers are: down_proj, "
        "gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj",
        "lora.target_modules: 'norm' is a Qwen3RMSNorm, not a linear layer; linear layers of this model: down_proj, "
        "gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj",
        "lora.modules_to_save: 'embed' matches no module of Qwen3ForCausalLM; modules with their own weights: "
        "down_proj, embed_tokens, gate_proj, input_layernorm, k_norm, k_proj, lm_head, norm, o_proj, "
        "post_attention_layernorm, q_norm, q_proj, up_proj, v_proj",
    ]


def test_initial_values_are_peft_defaults_seeded_by_name_and_seed() -> None:
    a = adapters.initial_value("model.layers.0.self_attn.q_proj.lora_A.default.weight", (4, 64), seed=42)
    again = adapters.initial_value("model.layers.0.self_attn.q_proj.lora_A.default.weight", (4, 64), seed=42)
    other = adapters.initial_value("model.layers.1.self_attn.q_proj.lora_A.default.weight", (4, 64), seed=42)
    reseeded = adapters.initial_value("model.layers.0.self_attn.q_proj.lora_A.default.weight", (4, 64), seed=7)
    assert torch.equal(a, again) and not torch.equal(a, other) and not torch.equal(a, reseeded)
    assert a.abs().max() <= 1 / 64**0.5 and a.std() > 0.5 / 64**0.5 / 3**0.5  # U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    b = adapters.initial_value("model.layers.0.self_attn.q_proj.lora_B.default.weight", (64, 4), seed=42)
    assert torch.equal(b, torch.zeros(64, 4))  # B = 0: the adapted model starts as the base model


def test_the_peft_wrapper_names_are_wrapper_segments() -> None:
    assert strip_wrappers("base_model.model.model.layers.0._checkpoint_wrapped_module.self_attn.q_proj.base_layer"
                          ".weight") == "model.layers.0.self_attn.q_proj.weight"
    assert strip_wrappers("base_model.model.lm_head.original_module.weight") == "lm_head.weight"
    assert is_adapter_name("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight")
    assert is_adapter_name("base_model.model.lm_head.modules_to_save.default.weight")
    assert not is_adapter_name("model.layers.0.self_attn.q_proj.weight")


def test_a_copy_of_tied_embeddings_is_refused() -> None:
    problems = adapters.target_problems(_meta("gemma"), LoraConfig(modules_to_save=["embed_tokens"]))
    assert problems == ["lora.modules_to_save: 'embed_tokens' is one of the tied input and output embeddings of "
                        "GemmaForCausalLM (tie_word_embeddings); a trained copy would untie them, which neither the "
                        "merged model nor PEFT's adapter can express. Leave it out"]
    assert adapters.target_problems(_meta("qwen3"), LoraConfig(modules_to_save=["embed_tokens", "lm_head"])) == []
