"""``slurmft estimate`` on GRPO runs (slurmft/plan/estimate_grpo.py): the rollouts' memory by ``grpo.rollouts``,
every figure checked against a number worked out by hand in the test (the formulas: docs/grpo.md).

A100-80GB: the device's real total, 81,920 MiB = 85,899,345,920 bytes (slurmft/plan/estimate.py KNOWN_GPUS).
"""

from __future__ import annotations

from typing import Any

import pytest
from rich.console import Console
from test_estimate import MID, profile, run_config, seed_config

from slurmft.plan import estimate as E
from slurmft.plan import estimate_text as T

A100 = 81920 * 2**20  # bytes
REWARDS = [{"function": "exact_match"}]


def mid_grpo(**grpo: Any) -> dict[str, Any]:
    """MID (12 layers, 16 heads of 64, 16 KV heads, vocab 8000) on 1 node x 8 A100s, bf16, 512 tokens, 4 completions
    per micro-step, 8 steps per generation: 32 completions generated at once per rank."""
    cfg = run_config("mid", resources__nodes=1, resources__gpus_per_node=8, model__dtype="bfloat16",
                     data__max_seq_length=512, train__per_device_batch_size=4, train__max_steps=10,
                     grpo={"num_generations": 8, "steps_per_generation": 8, "rewards": REWARDS, **grpo})
    return E.estimate(cfg, profile(), model_cfg=MID)


def allocated(g: dict[str, Any]) -> int:
    """What the estimate's per-GPU total is built from (estimate.py _per_gpu), phase by phase."""
    return (g["weights"] + g["gradients"] + g["optimizer"] + g["comm_buffers"]
            + max(g["reduce_scatter"] + g["activations"], g["generation"]))


def test_transformers_rollouts_count_the_generations_kv_cache() -> None:
    r = mid_grpo()
    g = r["per_gpu"]
    # K and V: 2 x 12 layers x 16 KV heads x 64 x 2 bytes (bf16) = 49,152 bytes per token; x 512 tokens x 32
    # completions = 805,306,368; plus one step's fp32 logits, 32 x 8000 x 4 = 1,024,000
    assert g["generation"] == 805_306_368 + 1_024_000
    assert r["grpo"]["generation_sequences_per_rank"] == 32 and r["grpo"]["generation_batch"] == 256
    # generation and backward never at once: here the generation is the larger phase and the one counted
    assert g["generation"] > g["reduce_scatter"] + g["activations"]
    assert g["total"] == allocated(g) + 2**30 + int(0.05 * allocated(g)) and g["vllm_colocate"] == 0
    # fewer completions at once: the backward is the larger phase again, and the generation adds nothing
    small = mid_grpo(steps_per_generation=1)["per_gpu"]
    assert small["generation"] == 4 * 512 * 49_152 + 4 * 8000 * 4
    assert small["generation"] < small["reduce_scatter"] + small["activations"]
    assert small["total"] == allocated(small) + 2**30 + int(0.05 * allocated(small))


def test_colocate_adds_vllms_share_of_every_training_gpu() -> None:
    r = mid_grpo(rollouts="colocate")
    g, v = r["per_gpu"], r["grpo"]["vllm_colocate"]
    assert g["generation"] == 0 and g["vllm_colocate"] == int(0.3 * A100) == 25_769_803_776  # TRL's default 0.3
    assert g["total"] == allocated(g) + 2**30 + int(0.05 * allocated(g)) + 25_769_803_776
    assert v["weights"] == r["parameters"] * 2  # bf16, tensor parallel 1
    # KV per sequence: 512 x 49,152 = 25,165,824 bytes; what the share holds beside the weights
    assert v["kv_per_sequence"] == 25_165_824
    assert v["sequences_in_kv"] == (25_769_803_776 - r["parameters"] * 2) // 25_165_824
    assert r["fits"] and not r["grpo"]["problems"]
    higher = mid_grpo(rollouts="colocate", vllm_gpu_memory_utilization=0.5)["per_gpu"]
    assert higher["vllm_colocate"] - g["vllm_colocate"] == int(0.5 * A100) - int(0.3 * A100)


def test_colocate_refuses_a_share_that_cannot_hold_the_model() -> None:
    """Llama-2-70B in bf16 is ~138 GB; 0.3 of an 80 GB GPU is 25.8 GB."""
    r = E.estimate(seed_config(grpo={"rollouts": "colocate", "rewards": REWARDS}), profile())
    assert not r["fits"]
    assert any(p.startswith("grpo.vllm_gpu_memory_utilization: vLLM's share of each training GPU (0.3 x 85.9 GB = "
                            "25.8 GB) does not hold its copy of the model (138.0 GB)") and "grpo.rollouts=server" in p
               for p in r["problems"]), r["problems"]
    assert "grpo.vllm_gpu_memory_utilization" in r["verdict"]


def test_server_counts_the_server_node_and_trains_on_the_others() -> None:
    """Llama-2-70B (80 layers, 64 heads, 8 KV heads of 128) on 4 training nodes + 1 server node of 8 A100s."""
    rewards = {"rollouts": "server", "rewards": REWARDS}
    r = E.estimate(seed_config(resources__nodes=5, grpo=rewards), profile())
    four = E.estimate(seed_config(resources__nodes=4, grpo={"rewards": REWARDS}), profile())
    s, g = r["grpo"]["server"], r["per_gpu"]
    # the training ranks: 4 nodes x 8, as a 4-node run's, without any generation memory
    assert (r["setup"]["nodes"], r["setup"]["world_size"], r["setup"]["shards"]) == (4, 32, 32)
    assert g["generation"] == 0 and g["vllm_colocate"] == 0
    assert g["weights"] == four["per_gpu"]["weights"] and g["activations"] == four["per_gpu"]["activations"]
    # the server: tensor parallel 8 (the node's GPUs), 0.9 of each GPU (trl vllm-serve's default)
    assert (s["tensor_parallel_size"], s["budget"]) == (8, int(0.9 * A100)) == (8, 77_309_411_328)
    assert s["weights"] == -(-r["parameters"] * 2 // 8)
    # one KV head per GPU (8 heads over 8): 2 x 80 x 1 x 128 x 2 = 40,960 bytes per token, x 2048 = 83,886,080
    assert s["kv_per_sequence"] == 83_886_080
    assert s["sequences_in_kv"] == (77_309_411_328 - s["weights"]) // 83_886_080
    assert s["fits"] and r["fits"]
    console = Console(width=160, record=True)
    console.print(T.render_table(r))
    text = console.export_text()
    assert "vLLM server node (GRPO), per GPU of 8" in text and f"{s['sequences_in_kv']} sequences at once" in text
    # 2 training nodes + the server do not fit the training state: the fix counts the server's node in
    small = E.estimate(seed_config(resources__nodes=3, grpo=rewards), profile())
    assert not small["fits"] and "use resources.nodes=4 (64.6 GB per GPU)" in small["problems"][0]


@pytest.mark.parametrize(("server", "expected"), [
    ({"tensor_parallel_size": 3}, "grpo.server.tensor_parallel_size: vLLM splits the model's 64 attention heads over "
                                  "the tensor-parallel GPUs, and 3 does not divide them; set it to one of 1, 2, 4, 8"),
    ({"tensor_parallel_size": 1}, "grpo.server: vLLM's share of each server GPU (0.9 x 85.9 GB = 77.3 GB) does not "
                                  "hold its part of the model (138.0 GB on each of 1 GPUs)"),
])
def test_server_layouts_vllm_cannot_start_are_refused(server: dict[str, Any], expected: str) -> None:
    r = E.estimate(seed_config(resources__nodes=3, grpo={"rollouts": "server", "server": server, "rewards": REWARDS}),
                   profile())
    assert not r["fits"] and any(p.startswith(expected) for p in r["problems"]), r["problems"]


def test_table_rows_for_the_rollouts() -> None:
    for rollouts, row in (("transformers", "generation (GRPO)"), ("colocate", "vLLM colocated (GRPO)")):
        console = Console(width=160, record=True)
        console.print(T.render_table(mid_grpo(rollouts=rollouts)))
        assert row in console.export_text()


def test_the_kl_terms_reference_is_said_as_counted() -> None:
    """beta > 0 with full fine-tuning counts a sharded copy; with LoRA the reference is the base with the adapters
    disabled (slurmft/job/adapters.py no_reference_adapter): no copy, and the assumptions line says so."""
    def line(r: dict[str, Any]) -> str:
        return next(a for a in r["assumptions"] if a.startswith("GRPO:"))

    full = mid_grpo(beta=0.04)
    assert "one more sharded copy" in line(full) and full["per_gpu"]["reference_weights"] > 0
    cfg = run_config("mid", resources__nodes=1, resources__gpus_per_node=8, model__dtype="bfloat16",
                     data__max_seq_length=512, train__per_device_batch_size=4, train__max_steps=10, lora={},
                     grpo={"num_generations": 8, "steps_per_generation": 8, "rewards": REWARDS, "beta": 0.04})
    lora = E.estimate(cfg, profile(), model_cfg=MID)
    assert "adapters disabled" in line(lora) and lora["per_gpu"]["reference_weights"] == 0
    assert "no reference model (beta 0)" in line(mid_grpo(beta=0.0))
