"""slurmft.plan.estimate and slurmft.plan.modelshape: parameter counts, the course-notes sizing rule, the seed
article's 70B setting, config.json discovery, and the estimate checked against real FSDP2 shards and saved
activations on CPU.

Run as a script (``python tests/test_estimate.py fsdp-worker OUT``) this file is also the worker of the
two-process gloo measurement; the tests start it themselves.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from slurmft import modelinfo
from slurmft.config import RunConfig
from slurmft.config_loading import validate
from slurmft.errors import ConfigError
from slurmft.job.rendezvous import free_port
from slurmft.plan import estimate as E
from slurmft.plan import estimate_text as T
from slurmft.plan import modelshape as M
from slurmft.profiles import ClusterProfile

REPO = Path(__file__).resolve().parent.parent

# Published parameter counts (model cards / papers).
PUBLISHED = {
    "llama-2-7b": 6.74e9,
    "llama-2-13b": 13.0e9,
    "llama-2-70b": 68.98e9,
    "llama-3-8b": 8.03e9,
}

TINY = dict(
    model_type="llama",
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=8000,
    tie_word_embeddings=False,
    max_position_embeddings=512,
)
ODD = dict(TINY, vocab_size=7999, intermediate_size=689, num_key_value_heads=2)  # uneven shards: padding
MID = dict(  # ~170M, the model of the load and consolidation memory measurements (docs/design-notes.md)
    model_type="llama",
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=12,
    num_attention_heads=16,
    num_key_value_heads=16,
    vocab_size=8000,
    tie_word_embeddings=False,
    max_position_embeddings=512,
)


def profile(
    gpu_type: str = "A100-80GB", memory_gb: float = 80, node_memory_gb: float = 1152
) -> ClusterProfile:
    return ClusterProfile(
        name="test",
        description="test profile",
        gpu={"type": gpu_type, "memory_gb": memory_gb},
        node_memory_gb=node_memory_gb,
    )


def run_config(model: str, **dotted: Any) -> RunConfig:
    """A minimal valid run config; ``dotted`` keys use __ for dots (fsdp__enabled=False)."""
    data: dict[str, Any] = {
        "name": "t",
        "output_dir": "/tmp/slurmft-test",
        "model": {"name_or_path": model},
        "data": {"datasets": [{"path": "GAIR/lima"}]},
    }
    for key, value in dotted.items():
        node = data
        *parents, leaf = key.split("__")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return validate(data)


def seed_config(**dotted: Any) -> RunConfig:
    """The seed article: Llama-2-70B, 2 nodes x 8 A100-80GB, bf16, FSDP full shard, checkpointing, 2048 x 1."""
    base = dict(
        resources__nodes=2,
        resources__gpus_per_node=8,
        model__dtype="bfloat16",
        fsdp__enabled=True,
        fsdp__activation_checkpointing=True,
        data__max_seq_length=2048,
        train__per_device_batch_size=1,
    )
    return run_config("meta-llama/Llama-2-70b-hf", **{**base, **dotted})


# ====================================================================== the sizing rule
def test_course_notes_numbers_reproduce_exactly():
    fp32 = E.training_state_bytes(7_000_000_000, "fp32")
    assert fp32 == {"weights": 28 * E.GB, "gradients": 28 * E.GB, "optimizer": 56 * E.GB}
    assert sum(fp32.values()) == 112 * E.GB == 16 * 7_000_000_000
    bf16 = E.training_state_bytes(7_000_000_000, "bf16-mixed")
    # FSDP2 mixed precision holds fp32 shards and gradients (measured below): 4 + 4 + 8, the same 16 bytes
    # as the course notes' 2 + 2 + 12 split
    assert bf16 == {"weights": 28 * E.GB, "gradients": 28 * E.GB, "optimizer": 56 * E.GB}


def test_estimate_applies_the_rule_to_a_real_config():
    n = M.count_parameters(modelinfo.read_model_config("llama-2-7b"))
    one_gpu = dict(resources__nodes=1, resources__gpus_per_node=1, fsdp__enabled=False)
    fp32 = E.estimate(run_config("llama-2-7b", model__dtype="float32", **one_gpu), profile())
    g = fp32["per_gpu"]
    assert (g["weights"], g["gradients"], g["optimizer"]) == (4 * n, 4 * n, 8 * n)
    bf16 = E.estimate(run_config("llama-2-7b", **one_gpu), profile())  # dtype auto -> bf16 on GPUs
    assert bf16["setup"]["precision"] == "bf16-mixed"
    g = bf16["per_gpu"]
    assert (g["weights"], g["gradients"], g["optimizer"]) == (4 * n, 4 * n, 8 * n)  # fp32 state, as FSDP2
    assert bf16["consolidated_bytes"] == 2 * n  # ~13.5 GB: the "14 GB in bf16"
    assert bf16["checkpoint_bytes"] == 12 * n


# ====================================================================== parameter counts
@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts_match_published(name):
    n = M.count_parameters(modelinfo.read_model_config(name))
    assert abs(n - PUBLISHED[name]) / PUBLISHED[name] < 0.005, n


def test_exact_llama_2_7b_count():
    assert M.count_parameters(modelinfo.read_model_config("llama-2-7b")) == 6_738_415_616


OTHER_ARCHS = {
    "mistral": dict(
        model_type="mistral",
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=3,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=96,
        vocab_size=5000,
        sliding_window=4096,
        tie_word_embeddings=False,
    ),
    "qwen2": dict(
        model_type="qwen2",
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=3,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=15000,
        tie_word_embeddings=True,
    ),
    "qwen3": dict(
        model_type="qwen3",
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=3,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=15000,
        tie_word_embeddings=True,
    ),
    "mixtral": dict(
        model_type="mixtral",
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=3000,
        num_local_experts=4,
        num_experts_per_tok=2,
    ),
    "llama-bias": dict(
        model_type="llama",
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=3000,
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=True,
    ),
}


def _meta_numel(cfg: dict[str, Any]) -> int:
    return sum(p.numel() for p in _meta_model(cfg).parameters())


def _meta_model(cfg: dict[str, Any]) -> Any:
    """The transformers model of a config.json dict, on the meta device (no memory)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    classes = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "mistral": ("MistralConfig", "MistralForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
        "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    }
    conf_cls, model_cls = (getattr(transformers, n) for n in classes[cfg.get("model_type", "llama")])
    kwargs = {
        k: v for k, v in cfg.items() if not k.startswith("_") and k not in ("model_type", "architectures")
    }
    with torch.device("meta"):
        return model_cls(conf_cls(**kwargs))


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_count_equals_meta_device_model_shipped(name):
    cfg = modelinfo.read_model_config(name)
    assert M.count_parameters(cfg) == _meta_numel(cfg)


@pytest.mark.parametrize("arch", sorted(OTHER_ARCHS))
def test_count_equals_meta_device_model_other_architectures(arch):
    cfg = OTHER_ARCHS[arch]
    assert M.count_parameters(cfg) == _meta_numel(cfg)


def test_config_without_decoder_dimensions_is_a_config_error():
    with pytest.raises(ConfigError, match="model.name_or_path.*hidden_size"):
        M.count_parameters({"model_type": "bert", "vocab_size": 10})


# ====================================================================== the seed article's setting
def test_seed_setting_fits():
    # bf16-true (the example's mode): the bf16-mixed article setting no longer fits once FSDP2's
    # reduce-scatter buffer is counted (tests/test_precision.py)
    r = E.estimate(seed_config(train__precision="bf16-true"), profile())
    g = r["per_gpu"]
    assert r["parameters"] == 68_976_648_192
    assert r["setup"]["world_size"] == 16 and r["setup"]["precision"] == "bf16-true"
    # 8 bytes/param over 16 shards, before the working set and activations
    assert g["weights"] + g["gradients"] + g["optimizer"] == pytest.approx(r["parameters"] / 2, rel=1e-3)
    assert g["total"] == sum(
        g[k] for k in ("weights", "gradients", "optimizer", "comm_buffers", "reduce_scatter", "activations",
                       "overhead")
    )
    assert g["fits"] and r["fits"] and g["total"] <= g["capacity"]
    assert g["capacity"] == 81920 * 2**20  # the A100-80GB's real 80 GiB
    assert T.fit_problems(r) == []
    assert r["verdict"].startswith("fits")


TOTAL_BF16_MIXED_GB = 88.67  # 85.08 before the reduce-scatter buffer was counted (docs/estimate.md)


def test_seed_setting_term_by_term():
    """Every term of the 70B worked example (docs/estimate.md), derived by hand from the published
    dimensions (h 8192, 80 layers, 64 heads / 8 kv of 128, I 28672, V 32000), not from estimate.py."""
    r = E.estimate(seed_config(), profile())
    g, a = r["per_gpu"], r["activations"]
    P, ws, c, s = 68_976_648_192, 16, 2, 2048  # parameters, ranks, compute bytes (bf16), tokens
    h, L, q, kv, inter, V = 8192, 80, 64 * 128, 8 * 128, 28672, 32000
    layer = 2 * q * h + 2 * kv * h + 3 * h * inter + 2 * h  # q, o, k, v, SwiGLU, two norms
    assert layer == 855_654_400
    root = 2 * V * h + h  # embeddings, LM head, final norm
    # FSDP2 keeps sharded parameters and gradients in fp32 (cast to bf16 only while gathered), AdamW 2 fp32 states.
    assert (g["weights"], g["gradients"], g["optimizer"]) == (4 * P // ws, 4 * P // ws, 8 * P // ws)
    # Gathered: 2 layers' bf16 parameters (current + prefetched) + 1 layer's bf16 gradients, the root, LM-head grad.
    assert g["comm_buffers"] == c * (3 * layer + root + V * h) == 6_706_806_784
    # Activations per token of one layer: 2 RMSNorms (fp32 input, bf16 normalised, bf16 output), q/k/v,
    # attention output + o_proj input, SDPA's log-sum-exp (fp32 per head), SwiGLU gate/silu/up/product.
    per_token = 2 * (4 + 2 * c) * h + c * (q + 2 * kv) + 2 * c * q + 4 * 64 + 4 * c * inter
    assert per_token == 413_952
    layer_full = s * per_token
    assert a["per_layer_full"] == layer_full
    # Checkpointing: each layer's bf16 input kept, plus ONE layer recomputed during backward.
    assert a["decoder_layers"] == L * s * c * h + layer_full
    # Head: final norm + fp32 log-softmax saved; transient: bf16 logits with their fp32 upcast.
    saved, transient = s * ((4 + 2 * c) * h + 4 * V), s * (c + 4) * V
    assert (a["logits_saved"], a["logits_and_loss"]) == (saved, saved + transient)
    assert g["activations"] == L * s * c * h + layer_full + saved + transient
    # FSDP2's reduce-scatter input: one decoder layer's gradients, unsharded, in the fp32 reduce dtype.
    assert g["reduce_scatter"] == 4 * layer
    allocated = 16 * P // ws + g["comm_buffers"] + g["activations"] + 4 * layer
    # 1 GiB CUDA context / cuBLAS workspaces / NCCL, plus 5 % of what is allocated for fragmentation.
    assert g["overhead"] == 2**30 + int(0.05 * allocated)
    assert g["total"] == allocated + g["overhead"]
    assert round(g["total"] / 1e9, 2) == TOTAL_BF16_MIXED_GB


@pytest.mark.parametrize("arch", ["llama-untied", "llama-bias", "qwen2", "mistral"])
@pytest.mark.parametrize("fsdp_on", [True, False])
def test_comm_buffers_from_the_module_tree(arch, fsdp_on):
    """Under FSDP2 the gathered set is 2 decoder layers + 1 layer's gradients + the root's parameters +
    the LM head's gradient (counted from a real transformers model on the meta device); without FSDP,
    DDP's buckets are one more copy of the gradients."""
    cfg = TINY if arch == "llama-untied" else OTHER_ARCHS[arch]
    model = _meta_model(cfg)
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    root = sum(p.numel() for p in model.parameters()) - len(model.model.layers) * layer  # dedups a tied head
    head = model.lm_head.weight.numel()
    n = sum(p.numel() for p in model.parameters())
    r = E.estimate(run_config("unused", resources__nodes=1, resources__gpus_per_node=8, fsdp__enabled=fsdp_on,
                              data__max_seq_length=512), profile(), model_cfg=cfg)
    if fsdp_on:
        assert r["per_gpu"]["comm_buffers"] == 2 * (3 * layer + root + head)  # bf16 on a GPU
    else:
        assert r["per_gpu"]["comm_buffers"] == 4 * n  # fp32 gradients, once more


def test_cpu_rank_allowance():
    """CPU ranks: 0.5 GiB runtime (no CUDA context) + the same 5 %."""
    cfg = run_config("llama-2-7b", resources__nodes=1, resources__gpus_per_node=0, resources__tasks_per_node=2)
    g = E.estimate(cfg, profile("fake-gpu", 80, node_memory_gb=24))["per_gpu"]
    assert g["overhead"] == 2**29 + int(0.05 * (g["total"] - g["overhead"]))


def test_seed_setting_without_fsdp_does_not_fit_with_reason():
    r = E.estimate(seed_config(fsdp__enabled=False, train__precision="bf16-true"), profile())
    assert not r["per_gpu"]["fits"] and not r["fits"]
    assert r["per_gpu"]["weights"] == 2 * r["parameters"]  # one GPU holds everything (bf16 weights in bf16-true)
    problems = T.fit_problems(r)
    assert len(problems) == 2
    assert "GPU memory" in problems[0] and "fsdp.enabled=false" in problems[0]
    assert "set fsdp.enabled=true" in problems[0]  # the fix, with its estimate
    # unsharded, every rank's asynchronous staging copy is the whole checkpoint: 8 x 414 GB on a node
    assert problems[1].startswith("CPU RAM") and "staging copy" in problems[1]
    assert r["verdict"].startswith("does not fit")


def test_seed_setting_without_checkpointing_does_not_fit_and_says_so():
    r = E.estimate(seed_config(fsdp__activation_checkpointing=False, train__precision="bf16-true"), profile())
    assert not r["fits"]
    assert r["activations"]["without_checkpointing"] > 10 * r["activations"]["with_checkpointing"]
    assert any("activation_checkpointing=true" in p for p in T.fit_problems(r))


def test_eager_attention_adds_the_quadratic_term():
    flash = E.estimate(seed_config(), profile())["activations"]
    eager = E.estimate(seed_config(model__attn_implementation="eager"), profile())["activations"]
    assert eager["total"] > flash["total"]
    assert flash["eager"] == eager["total"] and eager["flash_or_sdpa"] == flash["total"]


def test_gradient_accumulation_adds_no_gradient_memory():
    """The job reduce-scatters every micro-batch (sync_each_batch; tests/job/test_accumulation_cpu.py
    measures it): accumulation keeps the sharded gradients only, never full ones, so per-GPU memory
    does not depend on it, and trading micro-batch size for accumulation is a real remedy."""
    one = E.estimate(seed_config(), profile())
    many = E.estimate(seed_config(train__gradient_accumulation_steps=16), profile())
    assert many["per_gpu"] == one["per_gpu"]
    assert many["per_gpu"]["gradients"] == 4 * many["parameters"] // 16  # fp32 shard of 1/16, not a full copy
    assert many["setup"]["gradient_accumulation_steps"] == 16
    assert any("gradient accumulation (16 micro-batch(es) per step) adds no memory" in a for a in many["assumptions"])
    big = E.estimate(seed_config(train__per_device_batch_size=16, train__precision="bf16-true"), profile())
    assert not big["fits"]
    remedy = [r for r in big["remedies"] if "gradient_accumulation_steps" in r]
    assert remedy and "gradients stay sharded between micro-batches" in remedy[0], big["remedies"]


def test_one_node_suggests_how_many_nodes():
    r = E.estimate(seed_config(resources__nodes=1), profile())
    assert not r["fits"]
    assert any("resources.nodes=" in x for x in r["remedies"])


def test_cpu_ram_at_load_three_strategies():
    c = E.estimate(seed_config(), profile())["cpu_ram_per_node"]
    # the seed article's "~2 TB of CPU RAM" for 70B loaded by every one of 8 ranks (fp32)
    assert 2.0e12 < c["every_rank_loads"] < 2.4e12
    assert c["every_rank_loads"] > c["capacity"] > c["rank0_broadcast"] > c["slurmft"]
    assert c["slurmft"] < 0.6 * c["rank0_broadcast"]  # bf16 file mmapped vs an fp32 copy
    assert c["fits"]


def test_checkpoint_and_consolidated_sizes():
    r = E.estimate(seed_config(consolidate__dtype="float32"), profile())
    assert r["checkpoint_bytes"] == 12 * r["parameters"]
    assert r["consolidated_bytes"] == 4 * r["parameters"]


def test_json_contract():
    r = E.estimate(seed_config(), profile())
    back = json.loads(E.to_json(r))
    assert isinstance(back["parameters"], int)
    for key in ("weights", "gradients", "optimizer", "activations", "overhead", "total", "capacity"):
        assert isinstance(back["per_gpu"][key], int), key
    assert isinstance(back["per_gpu"]["fits"], bool)
    for key in ("every_rank_loads", "rank0_broadcast", "slurmft", "capacity"):
        assert isinstance(back["cpu_ram_per_node"][key], int), key
    assert isinstance(back["checkpoint_bytes"], int) and isinstance(back["consolidated_bytes"], int)
    assert back["assumptions"] and all(isinstance(a, str) for a in back["assumptions"])


def test_gpu_capacity_from_profile():
    assert E.gpu_capacity_bytes(profile("A100-80GB", 80))[0] == 81920 * 2**20
    assert E.gpu_capacity_bytes(profile("H200-141GB", 141))[0] == 143771 * 2**20
    assert E.gpu_capacity_bytes(profile("A100-80GB", 75))[0] == 75 * E.GB  # the profile's own number wins
    assert E.gpu_capacity_bytes(profile("L4", 24)) == (24 * E.GB, None)


def test_llama_3_8b_on_one_h100_node():
    node = dict(resources__nodes=1, resources__gpus_per_node=8, data__max_seq_length=8192)
    assert E.estimate(run_config("meta-llama/Meta-Llama-3-8B", **node), profile("H100-80GB", 80))["fits"]
    one_gpu = dict(resources__nodes=1, resources__gpus_per_node=1, fsdp__enabled=False)
    r = E.estimate(run_config("meta-llama/Meta-Llama-3-8B", **one_gpu), profile("H200-141GB", 141))
    assert not r["fits"]  # 8.03B x 16 bytes = 128 GB of state alone, plus DDP buckets and activations


# ====================================================================== HSDP (fsdp.replicate_across_nodes)
def eight_b(**dotted: Any) -> RunConfig:
    """Llama-3-8B on 2 nodes x 8 GPUs, bf16-mixed, seq 4096: fits one node, so HSDP is the better layout."""
    base = dict(resources__nodes=2, resources__gpus_per_node=8, data__max_seq_length=4096)
    return run_config("meta-llama/Meta-Llama-3-8B", **{**base, **dotted})


def test_hsdp_per_gpu_memory_is_one_node_of_fsdp():
    hsdp = E.estimate(eight_b(fsdp__replicate_across_nodes=True), profile())
    one_node = E.estimate(eight_b(resources__nodes=1), profile())
    fsdp = E.estimate(eight_b(), profile())
    assert hsdp["setup"]["shards"] == 8 and hsdp["setup"]["replicas"] == 2 and hsdp["setup"]["replicate_across_nodes"]
    assert fsdp["setup"]["shards"] == 16 and fsdp["setup"]["replicas"] == 1
    # sharded over the 8 ranks of a node: exactly what FSDP on one node holds per GPU
    assert hsdp["per_gpu"] == one_node["per_gpu"]
    assert hsdp["per_gpu"]["weights"] > 1.9 * fsdp["per_gpu"]["weights"]
    assert hsdp["layouts"]["hsdp"]["per_gpu_total"] == hsdp["per_gpu"]["total"]
    assert hsdp["layouts"]["fsdp"]["per_gpu_total"] == fsdp["per_gpu"]["total"]
    assert any("HSDP" in a for a in hsdp["assumptions"])


def test_inter_node_bytes_per_step_both_layouts():
    r = E.estimate(eight_b(), profile())
    n = r["parameters"]
    # FSDP over 16 ranks (ring): 15/16 x (bf16 all-gather in forward + again in backward + fp32 reduce-scatter)
    assert r["layouts"]["fsdp"]["inter_node_bytes_per_step"] == math.ceil(15 / 16 * n * (2 + 2 + 4))
    # HSDP: all-gathers and reduce-scatters inside the node; one fp32 all-reduce across 2 nodes: 2 x 1/2 x 4 bytes
    assert r["layouts"]["hsdp"]["inter_node_bytes_per_step"] == math.ceil(n * 4)
    assert r["inter_node_bytes_per_step"] == r["layouts"]["fsdp"]["inter_node_bytes_per_step"]  # this run's layout
    bf16 = E.estimate(eight_b(fsdp__reduce_dtype="bfloat16", fsdp__replicate_across_nodes=True), profile())
    assert bf16["inter_node_bytes_per_step"] == bf16["layouts"]["hsdp"]["inter_node_bytes_per_step"] == n * 2
    keep = E.estimate(eight_b(fsdp__reshard_after_forward=False), profile())["layouts"]["fsdp"]
    assert keep["inter_node_bytes_per_step"] == math.ceil(15 / 16 * n * (2 + 4))  # gathered once per micro-batch
    accum = E.estimate(eight_b(train__gradient_accumulation_steps=4), profile())["layouts"]
    # sync_each_batch: every micro-batch gathers twice and reduce-scatters (FSDP) / all-reduces (HSDP)
    assert accum["fsdp"]["inter_node_bytes_per_step"] == math.ceil(15 / 16 * n * 4 * (2 + 2 + 4))
    assert accum["hsdp"]["inter_node_bytes_per_step"] == 4 * n * 4
    four = E.estimate(eight_b(resources__nodes=4), profile())["layouts"]
    assert four["hsdp"]["inter_node_bytes_per_step"] == math.ceil(2 * 3 / 4 * n * 4)
    one = E.estimate(eight_b(resources__nodes=1), profile())
    assert one["layouts"]["fsdp"]["inter_node_bytes_per_step"] == one["layouts"]["hsdp"]["inter_node_bytes_per_step"] == 0


def test_recommends_hsdp_when_the_model_fits_one_node():
    r = E.estimate(eight_b(), profile())
    assert r["fits"] and "set fsdp.replicate_across_nodes=true" in r["recommendation"]
    assert "fits one node" in r["recommendation"]
    assert E.estimate(eight_b(fsdp__replicate_across_nodes=True), profile())["recommendation"] is None
    assert E.estimate(eight_b(resources__nodes=1), profile())["recommendation"] is None  # nothing crosses nodes
    # 70B in bf16-true: FSDP over 16 ranks fits (50.7 GB per GPU), one node does not (86.9 GB)
    seventy = E.estimate(seed_config(train__precision="bf16-true"), profile())
    assert seventy["fits"] and not seventy["layouts"]["hsdp"]["fits"] and seventy["recommendation"] is None


def test_hsdp_that_does_not_fit_a_node_says_to_shard_over_all_ranks():
    r = E.estimate(seed_config(train__precision="bf16-true", fsdp__replicate_across_nodes=True), profile())
    assert not r["fits"]
    assert any("set fsdp.replicate_across_nodes=false" in x for x in r["remedies"]), r["remedies"]
    # more nodes do not help HSDP (each node keeps a full replica): the nodes remedy switches it off too
    nodes = [x for x in r["remedies"] if "resources.nodes=" in x]
    assert len(nodes) == 1 and "fsdp.replicate_across_nodes=false" in nodes[0], r["remedies"]


def test_hsdp_on_one_node_is_plain_fsdp():
    one = dict(resources__nodes=1)
    hsdp = E.estimate(eight_b(fsdp__replicate_across_nodes=True, **one), profile())
    fsdp = E.estimate(eight_b(**one), profile())
    assert hsdp["per_gpu"] == fsdp["per_gpu"] and hsdp["setup"]["replicas"] == 1
    assert any("replicate_across_nodes on one node is the same" in a for a in hsdp["assumptions"])


def test_render_table_shows_both_layouts_and_the_recommendation():
    from rich.console import Console

    console = Console(record=True, width=200)
    console.print(T.render_table(E.estimate(eight_b(), profile())))
    text = console.export_text()
    assert "Layouts across nodes" in text and "FSDP (this run)" in text and "HSDP" in text
    assert "recommended: set fsdp.replicate_across_nodes=true" in text


def test_cpu_run_uses_fp32_and_node_ram_per_rank():
    cfg = run_config(
        "llama-2-7b", resources__nodes=1, resources__gpus_per_node=0, resources__tasks_per_node=2
    )
    r = E.estimate(cfg, profile("fake-gpu", 80, node_memory_gb=24))
    assert r["setup"]["device"] == "cpu" and r["setup"]["precision"] == "fp32"
    assert r["per_gpu"]["capacity"] == 12 * E.GB
    assert not r["fits"] and "CPU memory per rank" in T.fit_problems(r)[0]


def test_render_table():
    """The table's text (the command's speed is bench/cli_latency.py's, run by tests/test_bench_quick.py)."""
    from rich.console import Console

    r = E.estimate(seed_config(resources__nodes=1), profile())
    console = Console(record=True, width=140)
    console.print(T.render_table(r))
    text = console.export_text()
    assert "Per GPU" in text and "every rank loads" in text and "does not fit" in text


def test_import_pulls_no_torch():
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import slurmft.plan.estimate"],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=True,
    )
    modules = {line.split("|")[-1].strip().split(".")[0] for line in out.stderr.splitlines() if "|" in line}
    assert "slurmft" in modules
    assert not modules & {"torch", "transformers", "numpy", "safetensors", "rich"}, modules & {
        "torch",
        "rich",
    }


def test_estimate_reads_config_via_run_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    cfg = run_config(str(tmp_path), resources__nodes=1, resources__gpus_per_node=1, data__max_seq_length=512)
    r = E.estimate(cfg, profile())
    assert r["model"]["config_source"] == str(tmp_path / "config.json")
    assert r["parameters"] == M.count_parameters(TINY)


# ====================================================================== activations vs saved tensors
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_activation_formula_matches_saved_tensors(attn, dtype):
    """Per-layer activations = bytes autograd saves for backward (measured with saved_tensors_hooks)."""
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig, LlamaForCausalLM

    base = dict(TINY, num_key_value_heads=2)
    seq, mb = 128, 2

    def saved_bytes(layers: int) -> int:
        torch.manual_seed(0)
        kwargs = {k: v for k, v in base.items() if k != "model_type"}
        kwargs["num_hidden_layers"] = layers
        model = LlamaForCausalLM(LlamaConfig(**kwargs, attn_implementation=attn))
        model = model.to(getattr(torch, dtype)).train()
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen: dict[int, int] = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        ids = torch.randint(0, base["vocab_size"], (mb, seq))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=ids, labels=ids)
        return sum(n for ptr, n in seen.items() if ptr not in params)

    two, four = saved_bytes(2), saved_bytes(4)
    per_layer = (four - two) / 2
    head = two - 2 * per_layer
    est = E.activation_bytes(
        M.model_shape(base), seq, mb, 4 if dtype == "float32" else 2, False, attn == "eager"
    )
    assert est["per_layer_full"] == pytest.approx(per_layer, rel=0.10)
    assert est["logits_saved"] == pytest.approx(head, rel=0.10)


# ====================================================================== estimate vs real FSDP2 shards
MEASURED = {"tiny": TINY, "odd": ODD, "mid": MID}
MEASURED_BF16 = ("tiny", "odd")  # also sharded with bf16 mixed precision (FSDP2 MixedPrecisionPolicy, as the job)


def _fsdp_worker(out_dir: str) -> None:
    """One rank: FSDP2-shard each MEASURED model on a CPU mesh, one AdamW step in fp32 (and with bf16
    mixed precision for MEASURED_BF16, the policy slurmft.job.loading uses), report local bytes."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    report: dict[str, Any] = {}
    runs = [(name, cfg, None) for name, cfg in MEASURED.items()]
    runs += [(f"{name}-bf16", MEASURED[name], torch.bfloat16) for name in MEASURED_BF16]
    for name, cfg, compute in runs:
        torch.manual_seed(0)
        with torch.device("meta"):
            model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in cfg.items() if k != "model_type"}))
        mp = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32) if compute else MixedPrecisionPolicy()
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        model.to_empty(device="cpu")
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().normal_(0.0, 0.02)
            rot = model.model.rotary_emb
            inv_freq, _ = rot.compute_default_rope_parameters(rot.config)
            rot.inv_freq.copy_(inv_freq)
            rot.original_inv_freq.copy_(inv_freq)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ids = torch.randint(0, cfg["vocab_size"], (1, 16))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()

        def nbytes(t) -> int:
            local = t.to_local() if isinstance(t, DTensor) else t
            return local.numel() * local.element_size()

        params = list(model.parameters())
        report[name] = {
            "all_dtensor": all(isinstance(p, DTensor) and isinstance(p.grad, DTensor) for p in params),
            "dtypes": sorted({str(p.dtype) for p in params}),
            "grad_dtypes": sorted({str(p.grad.dtype) for p in params}),
            "state_dtypes": sorted({str(opt.state[p][k].dtype) for p in params for k in ("exp_avg", "exp_avg_sq")}),
            "weights": sum(nbytes(p) for p in params),
            "gradients": sum(nbytes(p.grad) for p in params),
            "optimizer": sum(nbytes(opt.state[p][k]) for p in params for k in ("exp_avg", "exp_avg_sq")),
        }
        del model, opt
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


@pytest.mark.train
def test_estimate_matches_measured_fsdp2_shards(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
            PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, "fsdp-worker", str(tmp_path)],
                env=env,
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outputs)

    runs = [(name, cfg, "float32") for name, cfg in MEASURED.items()]
    runs += [(f"{name}-bf16", MEASURED[name], "bfloat16") for name in MEASURED_BF16]
    for name, cfg, dtype in runs:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
        run = run_config(
            str(tmp_path / name),
            executor="local",
            resources__nodes=1,
            resources__gpus_per_node=0,
            resources__tasks_per_node=2,
            model__dtype=dtype,
            data__max_seq_length=512,
        )
        r = E.estimate(run, profile("fake-gpu", 80, node_memory_gb=24))
        assert r["setup"]["precision"] == ("fp32" if dtype == "float32" else "bf16-mixed")
        assert r["setup"]["shards"] == 2
        g = r["per_gpu"]
        expected = g["weights"] + g["gradients"] + g["optimizer"]
        for rank in range(2):
            m = json.loads((tmp_path / f"rank{rank}.json").read_text())[name]
            assert m["all_dtensor"]
            # bf16 mixed precision too: the sharded state FSDP2 keeps is fp32 (bf16 only while gathered)
            assert m["dtypes"] == m["grad_dtypes"] == m["state_dtypes"] == ["torch.float32"], m
            measured = m["weights"] + m["gradients"] + m["optimizer"]
            assert abs(measured - expected) / measured < 0.05, (name, rank, measured, expected)
            assert m["weights"] == pytest.approx(g["weights"], rel=0.05)
            assert m["optimizer"] == pytest.approx(g["optimizer"], rel=0.05)
            print(f"{name} rank{rank}: measured {measured:,} B, estimated {expected:,} B")
        # the estimate is the largest rank, exactly (FSDP2 gives rank 0 the ceil(d0 / ws) rows)
        ranks = [json.loads((tmp_path / f"rank{i}.json").read_text())[name] for i in range(2)]
        assert max(m["weights"] + m["gradients"] + m["optimizer"] for m in ranks) == expected
        for part in ("weights", "gradients", "optimizer"):  # the displayed split, not only the total
            assert max(m[part] for m in ranks) == g[part], (name, part)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "fsdp-worker":
        sys.path.insert(0, str(REPO))
        _fsdp_worker(sys.argv[2])
    else:
        sys.exit("usage: python tests/test_estimate.py fsdp-worker OUT_DIR")


# ====================================================================== LoRA
def test_lora_70b_on_one_node_the_issues_numbers():
    """Llama-2-70B, r=16 on every linear layer: 207M adapter parameters (0.3 %), one node of 8 x 80 GB, a
    checkpoint of ~2.5 GB instead of ~414 GB (bf16-true) / ~828 GB (fp32 master weights)."""
    r = E.estimate(seed_config(resources__nodes=1, train__precision="bf16-mixed", lora={}),
                   profile())
    lora = r["lora"]
    # per layer: r x (in + out) of q, k, v, o, gate, up, down = 16 x (16384 + 2 x 9216 + 16384 + 3 x 36864)
    assert lora["trainable_params"] == 80 * 16 * (16384 + 2 * 9216 + 16384 + 3 * 36864) == 207_093_760
    assert lora["resolved_target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj",
                                               "v_proj"]
    assert 0.0029 < lora["trainable_share"] < 0.0031 and lora["base_dtype"] == "bfloat16"
    assert r["fits"] and r["setup"]["world_size"] == 8
    assert r["checkpoint_bytes"] == 12 * 207_093_760  # 2.49 GB: adapters + 2 AdamW states in fp32, no base
    assert lora["full_finetune"]["checkpoint_bytes"] == 12 * r["parameters"] and not lora["full_finetune"]["fits"]
    true = E.estimate(seed_config(resources__nodes=1, train__precision="bf16-true", lora={}), profile())
    assert true["lora"]["full_finetune"]["checkpoint_bytes"] == 6 * r["parameters"]  # ~414 GB, the issue's figure
    g = r["per_gpu"]
    base_local = sum(M.shard_numel(s, 8) for s in M.model_shape(modelinfo.read_model_config(
        "meta-llama/Llama-2-70b-hf")).all_tensors())
    trained_local = g["gradients"] // 4
    assert g["weights"] == 2 * base_local + 4 * trained_local  # frozen bf16 base + fp32 adapters
    assert g["optimizer"] == 8 * trained_local and trained_local >= 207_093_760 // 8
    assert g["reduce_scatter"] < 20e6  # only an adapter layer's gradients are reduced
    assert r["consolidated_bytes"] == 2 * r["parameters"] and lora["adapter_bytes"] == 2 * 207_093_760
    assert any(a.startswith("LoRA (r=16, alpha=32 on all-linear") for a in r["assumptions"])


def test_full_finetune_that_does_not_fit_offers_lora_with_its_figures():
    r = E.estimate(seed_config(resources__nodes=1, train__precision="bf16-mixed"), profile())
    assert not r["fits"] and r["lora"] is None
    offer = [x for x in r["remedies"] if x.startswith("add a lora: section")]
    assert offer and "207.1M trainable parameters, 0.30 % of the model" in offer[0], r["remedies"]
    assert "checkpoint 2.5 GB instead of 827.7 GB" in offer[0] and "28.9 GB per GPU" in offer[0]
    assert "add a lora: section" in r["verdict"]


def test_a_grpo_kl_run_that_does_not_fit_is_offered_lora_without_the_reference_copy():
    """GRPO with beta > 0 on a full fine-tune holds a reference copy; with LoRA the reference is the base with the
    adapters disabled (no copy): the LoRA fix's figure is what the estimate of the same run with a lora: section says,
    and that run's full fine-tune comparison counts the copy again."""
    grpo = {"beta": 0.04, "rewards": [{"function": "exact_match"}]}
    full = E.estimate(seed_config(resources__nodes=1, grpo=grpo), profile())
    lora = E.estimate(seed_config(resources__nodes=1, grpo=grpo, lora={}), profile())
    assert not full["fits"] and lora["per_gpu"]["reference_weights"] == 0
    (offer,) = [x for x in full["remedies"] if x.startswith("add a lora: section")]
    assert f"{lora['per_gpu']['total'] / 1e9:.1f} GB per GPU" in offer, (offer, lora["per_gpu"]["total"])
    assert lora["lora"]["full_finetune"]["per_gpu_total"] == full["per_gpu"]["total"]


def test_lora_without_merge_writes_no_model_and_lists_are_counted():
    r = E.estimate(seed_config(lora={"r": 8, "target_modules": ["q_proj", "v_proj"]}, consolidate__merge=False),
                   profile())
    assert r["lora"]["trainable_params"] == 80 * 8 * ((8192 + 8192) + (8192 + 1024))
    assert r["consolidated_bytes"] == 0 and r["lora"]["merge"] is False
    bad = E.estimate(seed_config(lora={"target_modules": ["q_proj", "experts"]}), profile())
    assert bad["lora"]["unmatched"] and any("'experts'" in a for a in bad["assumptions"])


def test_grpo_counts_the_reference_copy_only_when_beta_is_positive():
    """GRPO with beta > 0 holds DPO's kind of copy (slurmft/job/grpo.py builds it the same way); beta 0 none; one
    sequence per completion (no chosen/rejected pair); the assumptions say how the generation is counted."""
    sft = E.estimate(seed_config(), profile())
    rewards = [{"function": "exact_match"}]
    kl = E.estimate(seed_config(grpo={"beta": 0.04, "rewards": rewards}), profile())
    plain = E.estimate(seed_config(grpo={"beta": 0.0, "rewards": rewards}), profile())
    n, g = sft["parameters"], sft["per_gpu"]
    assert kl["per_gpu"]["reference_weights"] == pytest.approx(2 * n / 16, rel=0.01)
    assert kl["per_gpu"]["weights"] == g["weights"] + kl["per_gpu"]["reference_weights"]
    assert plain["per_gpu"]["reference_weights"] == 0 and plain["per_gpu"]["weights"] == g["weights"]
    assert plain["per_gpu"]["activations"] == g["activations"]
    assert any("the generation (transformers' generate, one call over the rank's 1 completions) as its KV cache" in a
               for a in kl["assumptions"])  # counted: tests/test_estimate_grpo.py
    assert not any("GRPO" in a for a in sft["assumptions"])
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(T.render_table(kl))
    text = console.export_text()  # GRPO's KL reference is not DPO's: a GRPO table once said "+ DPO reference"
    weights = next(line for line in text.splitlines() if "│ weights" in line)
    assert "+ GRPO KL reference" in weights and "DPO" not in weights, weights


def test_lora_table_says_what_trains():
    from rich.console import Console

    r = E.estimate(seed_config(resources__nodes=1, lora={}), profile())
    console = Console(width=140, record=True)
    console.print(T.render_table(r))
    text = console.export_text()
    assert "LoRA r=16, alpha=32 on down_proj, gate_proj" in text and "207,093,760 trainable parameters" in text
    assert "frozen base bfloat16 + adapters fp32" in text and "adapters only, 2 fp32 states" in text
    assert "sharded checkpoint (adapters + optimizer, no base), each" in text and "merged model/ (bfloat16)" in text


def test_dpo_inter_node_bytes_count_the_reference_forwards_all_gather():
    """Each DPO micro-batch forwards the reference too (the FSDP2 copy; with LoRA the policy, adapters disabled): one
    more all-gather of the parameters across the nodes, which FSDP's bytes left out (HSDP's stay inside a node)."""
    sft = E.estimate(eight_b(), profile())
    n = sft["parameters"]
    for extra, (dpo, lora) in ((1, ({"beta": 0.1}, None)), (1, ({"beta": 0.1}, {"r": 16})),
                               (0, ({"reference": "precomputed"}, None))):
        r = E.estimate(eight_b(dpo=dpo, **({"lora": lora} if lora else {})), profile())
        t = r["lora"]["trainable_params"] if lora else n
        gathered = n + t if lora else n
        assert r["layouts"]["fsdp"]["inter_node_bytes_per_step"] == math.ceil(
            15 / 16 * (gathered * (2 + extra) * 2 + t * 4)), (dpo, lora)
        assert r["layouts"]["hsdp"]["inter_node_bytes_per_step"] == math.ceil(t * 4)


def test_grpo_inter_node_bytes_count_the_reference_and_old_policy_forwards_all_gathers():
    """GRPO with beta > 0 forwards the reference over every generation batch (TRL's ref_per_token_logps, in
    steps_per_generation chunks of the micro-batch: one per micro-batch on average), the sharded copy or with LoRA the
    policy with its adapters disabled: one more all-gather across the nodes, as DPO's; beta 0 none. The old policy's
    log-probabilities are one more forward where TRL computes them: accumulation not a multiple of
    steps_per_generation, or rollouts: server (its importance-sampling correction)."""
    n = E.estimate(eight_b(), profile())["parameters"]
    rewards = [{"function": "exact_match"}]
    # (reference forward, old-policy forward), beta, lora, steps_per_generation, the rest; accumulation 2
    for (ref, old), beta, lora, spg, more in (
            ((1, 0), 0.04, None, None, {}), ((1, 0), 0.04, {"r": 16}, None, {}), ((0, 0), 0.0, None, None, {}),
            ((1, 1), 0.04, None, 4, {}), ((0, 1), 0.0, None, 4, {}), ((0, 0), 0.0, None, 1, {}),
            ((0, 1), 0.0, None, None, {"resources__nodes": 3, "rollouts": "server"})):
        grpo = {"beta": beta, "rewards": rewards, **({"steps_per_generation": spg} if spg else {}),
                **({"rollouts": more["rollouts"]} if "rollouts" in more else {})}
        dotted = {k: v for k, v in more.items() if k != "rollouts"} | ({"lora": lora} if lora else {})
        r = E.estimate(eight_b(grpo=grpo, train__gradient_accumulation_steps=2, **dotted), profile())
        assert r["setup"]["world_size"] == 16  # a server's node does not train
        t = r["lora"]["trainable_params"] if lora else n
        gathered = n + t if lora else n
        case = (beta, lora, spg, more)
        assert r["layouts"]["fsdp"]["inter_node_bytes_per_step"] == math.ceil(
            15 / 16 * (gathered * 2 * (2 + ref + old) * 2 + 2 * t * 4)), case
        assert r["layouts"]["hsdp"]["inter_node_bytes_per_step"] == math.ceil(2 * t * 4)  # the gathers stay inside
        line = next(a for a in r["assumptions"] if a.startswith("inter-node bytes"))
        assert ("+1 for the reference's forward" in line) is bool(ref), (case, line)
        assert ("+1 for the old policy's log-probabilities (GRPO)" in line) is bool(old), (case, line)
    # what the bytes leave out is said where they cross the nodes only
    grpo = {"beta": 0.04, "rewards": rewards}
    for dotted, said in (({}, True), ({"fsdp__replicate_across_nodes": True}, False), ({"resources__nodes": 1}, False)):
        line = next(a for a in E.estimate(eight_b(grpo=grpo, **dotted), profile())["assumptions"]
                    if a.startswith("GRPO:"))
        assert ("inter-node bytes leave out the generation's all-gathers" in line) is said, (dotted, line)


def test_dpo_counts_the_reference_copy_and_two_sequences_per_example():
    sft = E.estimate(seed_config(), profile())
    dpo = E.estimate(seed_config(dpo={}), profile())
    n, g, d = sft["parameters"], sft["per_gpu"], dpo["per_gpu"]
    ws = 16
    # the reference: the model once more in the compute dtype (bf16), sharded over the 16 ranks
    assert d["reference_weights"] == pytest.approx(2 * n / ws, rel=0.01) and g["reference_weights"] == 0
    assert d["weights"] == g["weights"] + d["reference_weights"]
    assert (d["gradients"], d["optimizer"]) == (g["gradients"], g["optimizer"])  # no training state for it
    assert d["activations"] == E.estimate(seed_config(train__per_device_batch_size=2), profile())["per_gpu"][
        "activations"]  # chosen and rejected in one forward: twice the micro-batch
    assert d["comm_buffers"] > g["comm_buffers"]  # its layers are gathered too
    lora = E.estimate(seed_config(dpo={}, lora={"r": 16}), profile())["per_gpu"]
    assert lora["reference_weights"] == 0  # the base with adapters disabled: no copy
    precomputed = E.estimate(seed_config(dpo={"reference": "precomputed"}), profile())["per_gpu"]
    assert precomputed["reference_weights"] == 0  # only the values, kept in the run directory
    assert (precomputed["weights"], precomputed["comm_buffers"]) == (g["weights"], g["comm_buffers"])
    assert precomputed["activations"] == d["activations"]  # still two sequences per example


def test_the_dpo_copys_load_adds_cpu_ram_only_where_shards_live_in_cpu_ram():
    """The copy loads after the policy, the same way: on GPUs its load's transient is the policy's (not added);
    with fsdp.cpu_offload both models' shards are in RAM while the copy loads."""
    sft, dpo = (E.estimate(seed_config(**kw), profile())["cpu_ram_per_node"] for kw in ({}, {"dpo": {}}))
    assert dpo["reference_shards"] == 0 and dpo["slurmft"] == sft["slurmft"]
    off_sft, off_dpo = (E.estimate(seed_config(fsdp__cpu_offload=True, **kw), profile())
                        for kw in ({}, {"dpo": {}}))
    shards = off_dpo["cpu_ram_per_node"]["reference_shards"]
    assert shards == 8 * off_dpo["per_gpu"]["reference_weights"] > 0  # 8 ranks on node 0, bf16 copies
    assert off_dpo["cpu_ram_per_node"]["slurmft"] == off_sft["cpu_ram_per_node"]["slurmft"] + shards
    precomputed = E.estimate(seed_config(fsdp__cpu_offload=True, dpo={"reference": "precomputed"}), profile())
    assert precomputed["cpu_ram_per_node"]["reference_shards"] == 0


def test_a_dpo_run_whose_copy_does_not_fit_is_offered_precomputed_reference_log_probs():
    small = profile(memory_gb=100)  # the seed's DPO needs ~106 GB a GPU with its copy, ~93 GB without
    r = E.estimate(seed_config(dpo={}), small)
    assert not r["per_gpu"]["fits"]
    (offer,) = [m for m in r["remedies"] if m.startswith("set dpo.reference=precomputed")]
    per_gpu = E.estimate(seed_config(dpo={"reference": "precomputed"}), small)["per_gpu"]
    assert per_gpu["fits"] and f"{per_gpu['total'] / 1e9:.1f} GB per GPU" in offer, offer
    assert not [m for m in E.estimate(seed_config(dpo={"reference": "precomputed"}, train__per_device_batch_size=8),
                                      small)["remedies"] if "dpo.reference" in m]  # nothing left to drop


# ====================================================================== asynchronous saves' staging copy
def test_the_async_staging_copy_is_counted_in_cpu_ram_and_refused_when_it_does_not_fit():
    """checkpoint.async (the default) keeps each rank's checkpoint share in CPU RAM for the whole job (issue 45):
    the seed article's 70B on 2 x 8 GPUs holds 207 GB of it per node in bf16-true and twice that in bf16-mixed.
    A node with 200 GB fits the load (156 GB) and the training without the copy, not with it: the estimate says so
    and offers checkpoint.async: false with its cost; with it the run fits."""
    n = M.count_parameters(modelinfo.read_model_config("meta-llama/Llama-2-70b-hf"))
    for precision, bytes_per_param in (("bf16-true", 6), ("bf16-mixed", 12)):
        r = E.estimate(seed_config(train__precision=precision, **(
            {"model__dtype": "bfloat16"} if precision == "bf16-true" else {"model__dtype": "auto"})), profile())
        c = r["cpu_ram_per_node"]
        assert r["checkpoint_bytes"] == bytes_per_param * n
        assert c["async_staging"] == 8 * math.ceil(r["checkpoint_bytes"] / 16)  # node 0's eight ranks' shares
        assert c["training"] == c["runtime_allowance"] + c["async_staging"]  # no shards in CPU RAM on GPUs
    assert abs(E.estimate(seed_config(train__precision="bf16-true"), profile())["cpu_ram_per_node"]["async_staging"]
               / 1e9 - 207) < 1

    small = profile(node_memory_gb=200)
    r = E.estimate(seed_config(train__precision="bf16-true"), small)
    assert not r["fits"] and r["per_gpu"]["fits"]
    (problem,) = r["problems"]
    assert "asynchronous saves' staging copy" in problem and "set checkpoint.async: false" in problem, problem
    assert f"about {r['checkpoint_save_s']:.0f} s" in problem
    sync = E.estimate(seed_config(train__precision="bf16-true", checkpoint__async=False), small)
    assert sync["fits"] and sync["cpu_ram_per_node"]["async_staging"] == 0
    hsdp = E.estimate(seed_config(fsdp__replicate_across_nodes=True), profile())  # a node's 8 ranks hold it all
    assert hsdp["cpu_ram_per_node"]["async_staging"] == 8 * math.ceil(hsdp["checkpoint_bytes"] / 8)
