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


def test_initial_values_follow_peft_for_every_layer_kind_accepted() -> None:
    """PEFT's own default init (init_lora_weights=True) of a linear and an embedding target, tensor by tensor,
    against ours: the same zeros (linear B; embedding A, where PEFT differs from the linear case), the same
    distributions (linear A uniform within 1/sqrt(fan_in), embedding B standard normal), so both start at the
    base model; and ours is a function of the seed and the name only."""
    from peft import get_peft_model

    torch.manual_seed(0)
    model = _meta_free("qwen3")
    peft = get_peft_model(model, adapters.peft_config(LoraConfig(r=8, target_modules=["q_proj", "embed_tokens"]),
                                                      model))
    theirs = {strip_wrappers(n): p.detach() for n, p in peft.named_parameters() if p.requires_grad}
    kinds = {n.split(".")[-3] if n.endswith(".weight") else n.split(".")[-2] for n in theirs}
    assert kinds == {"lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B"}
    for name, value in theirs.items():
        ours = adapters.initial_value(name, tuple(value.shape), seed=3)
        assert ours.shape == value.shape and ours.dtype == torch.float32
        assert torch.equal(ours == 0, value == 0) or (ours != 0).all() == (value != 0).all(), name
        if (value == 0).all():
            assert torch.equal(ours, torch.zeros_like(ours)), name
        elif ".lora_A." in name:  # U(-b, b), b = 1/sqrt(fan_in): both fill the interval
            bound = 1 / value.shape[1] ** 0.5
            for t in (ours, value):
                assert t.abs().max() <= bound and t.abs().max() > 0.9 * bound, name
        else:  # lora_embedding_B: N(0, 1)
            assert ".lora_embedding_B." in f"{name}." or name.endswith("lora_embedding_B"), name
            for t in (ours, value):
                assert abs(t.mean()) < 0.2 and 0.85 < t.std() < 1.15, (name, t.mean(), t.std())
    # our values in the model: the adapted model's logits are the base model's, bitwise
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if param.requires_grad:
                param.copy_(adapters.initial_value(strip_wrappers(name), tuple(param.shape), seed=3))
        ids = torch.arange(12).reshape(2, 6)
        adapted = peft(input_ids=ids).logits
        with peft.disable_adapter():
            base = peft(input_ids=ids).logits
    assert torch.equal(adapted, base)
    assert torch.equal(adapters.initial_value("model.embed_tokens.lora_embedding_B.default", (32, 8), 3),
                       adapters.initial_value("model.embed_tokens.lora_embedding_B.default", (32, 8), 3))


def test_an_adapter_tensor_not_initialised_like_peft_is_refused() -> None:
    for name in ("model.layers.0.self_attn.q_proj.lora_magnitude_vector.default.weight",  # DoRA
                 "model.layers.0.self_attn.q_proj.lora_B.default.bias"):  # a LoRA bias
        with pytest.raises(JobSetupError) as err:
            adapters.initial_value(name, (4, 4), seed=0)
        assert repr(name) in err.value.render() and "not one slurmft initialises as PEFT does" in err.value.render()


def test_embedding_targets_are_in_the_summary() -> None:
    _, summary = adapters.add_adapters(_meta("qwen3"), LoraConfig(r=4, target_modules=["q_proj", "embed_tokens"]))
    assert summary.target_modules == ["embed_tokens", "q_proj"]
    assert summary.marker()["target_modules"] == ["embed_tokens", "q_proj"] and summary.marker()["use_rslora"] is False


def test_an_adapter_on_tied_embeddings_is_refused_with_the_fix() -> None:
    """Gemma ties lm_head to embed_tokens: an adapter on either is one use of a shared matrix, which no merged model
    holds; refused by name (the same words as slurmft validate, slurmft/lora.py tied_target_problem)."""
    problems = adapters.target_problems(_meta("gemma"), LoraConfig(target_modules=["q_proj", "lm_head", "embed_tokens"]))
    assert [p.split(" is ")[0] for p in problems] == ["lora.target_modules: 'lm_head'", "lora.target_modules: 'embed_tokens'"]
    assert all("tied input and output embeddings of GemmaForCausalLM" in p and "Leave it out" in p for p in problems)
    assert adapters.target_problems(_meta("qwen3"), LoraConfig(target_modules=["q_proj", "lm_head", "embed_tokens"])) == []


def test_rslora_scales_by_alpha_over_sqrt_r_and_dora_is_refused_by_name() -> None:
    from pydantic import ValidationError

    wrapped, summary = adapters.add_adapters(_meta("qwen3"), LoraConfig(r=16, alpha=8, use_rslora=True,
                                                                         target_modules=["q_proj"]))
    scalings = {m.scaling["default"] for m in wrapped.modules() if hasattr(m, "lora_A")}
    assert scalings == {8 / 16**0.5} == {LoraConfig(r=16, alpha=8, use_rslora=True).scaling}
    assert summary.marker()["use_rslora"] is True
    with pytest.raises(ValidationError) as err:
        LoraConfig(use_dora=True)
    assert "use_dora" in str(err.value) and "DoRA is not supported" in str(err.value)


def _meta_free(model_type: str) -> Any:
    """A real (not meta) small model of ``model_type``, for PEFT's own init to act on."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **{**ARCH_COMMON, **ARCHITECTURES[model_type]}, vocab_size=300)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def test_resume_refuses_another_scaling_rule_and_reads_an_older_marker_as_plain_lora(tmp_path: Any) -> None:
    import json

    from slurmft.job.checkpointing import check_resume_adapters

    _, summary = adapters.add_adapters(_meta("qwen3"), LoraConfig(r=4, alpha=8, target_modules=["q_proj"]))
    now = summary.marker()
    old = {k: v for k, v in now.items() if k != "use_rslora"}  # a marker from before use_rslora was recorded
    (tmp_path / "COMPLETE").write_text(json.dumps({"step": 2, "lora": old}))
    check_resume_adapters(tmp_path, now)  # the same adapters: plain LoRA then and now
    with pytest.raises(JobSetupError) as err:
        check_resume_adapters(tmp_path, {**now, "use_rslora": True})
    assert "use_rslora: False in the checkpoint, True now" in err.value.render()
