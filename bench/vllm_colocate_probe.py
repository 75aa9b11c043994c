"""What vLLM's colocate rollouts need, probed in one process without TRL (run it with an interpreter that has vLLM;
slurmft on PYTHONPATH): ``PYTHONPATH=. VLLM_CPU_KVCACHE_SPACE=1 $VLLM_PYTHON bench/vllm_colocate_probe.py [OUT.json]``.

On CPUs and GPUs alike (``--device`` follows ``torch.cuda.is_available()``):

1. the micro/tiny model (slurmft.tiny, built here, fp32), vLLM started as TRL's colocate mode starts it
   (``external_launcher``, in this process), greedy completions vs transformers' greedy ``generate``;
2. the same prompts sampled by slurmft's seeded sampler on both engines (vLLM: the logits processor of
   slurmft/job/vllm_rollouts.py on greedy requests; transformers: SeededSampling), completion ids compared;
3. a weight update: every tensor moved (seeded noise), pushed into the engine the way TRL's colocate sync pushes it
   (``model.load_weights([(name, tensor)])``, one at a time): its error, if any, is recorded; then through vLLM's
   in-place reload (``worker.reload_weights``); after each, greedy and seeded completions vs transformers on the
   updated weights, and the first token's top log-probs (the weights vLLM generates with).

Prints and writes a JSON record of what matched; exits 1 when the reload path does not give transformers' completions.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517"}.items():
    os.environ.setdefault(k, v)

PROMPTS = [[5, 77, 301, 12], [9, 1000, 33, 45, 46, 120, 7], [400, 401]]
NEW = 12
SEED, POINT = 1234, 3


def hf_generate(model, prompts, processor_for=None):
    import torch
    from transformers import GenerationConfig, LogitsProcessorList

    out = []
    for row, ids in enumerate(prompts):  # one at a time: no padding, the same positions as vLLM's
        x = torch.tensor([ids])
        procs = LogitsProcessorList([processor_for(row, len(ids))] if processor_for else [])
        cfg = GenerationConfig(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, eos_token_id=None,
                               pad_token_id=0, disable_compile=True)
        with torch.no_grad():
            y = model.generate(x, attention_mask=torch.ones_like(x), generation_config=cfg, logits_processor=procs)
        out.append(y[0, len(ids):].tolist())
    return out


def hf_first_logprobs(model, prompts, k=5):
    import torch

    rows = []
    for ids in prompts:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
        lp = torch.log_softmax(logits, -1)
        top = torch.topk(lp, k)
        rows.append({int(i): float(v) for i, v in zip(top.indices, top.values, strict=True)})
    return rows


def vllm_generate(llm, prompts, seeded: bool):
    from vllm import SamplingParams

    from slurmft.job.vllm_rollouts import request_key

    params = [SamplingParams(temperature=0.0, max_tokens=NEW, min_tokens=NEW, ignore_eos=True, logprobs=5,
                             extra_args=request_key(SEED, POINT, row, 1.0, 1.0) if seeded else None)
              for row in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ids = [list(o.outputs[0].token_ids) for o in outs]
    first = [{int(t): float(lp.logprob) for t, lp in o.outputs[0].logprobs[0].items()} for o in outs]
    return ids, first


def max_gap(a, b):
    gaps = [abs(a_row[t] - b_row[t]) for a_row, b_row in zip(a, b, strict=True) for t in a_row if t in b_row]
    return max(gaps) if gaps else None


def main(out_path: str | None) -> int:
    import torch
    import vllm
    from transformers import AutoModelForCausalLM
    from vllm import LLM

    from slurmft.job.seeded_sampling import SeededSampling
    from slurmft.job.vllm_rollouts import driver_worker, seeded_processor
    from slurmft.tiny import build

    record: dict = {"vllm": vllm.__version__, "torch": torch.__version__}
    import transformers

    record["transformers"] = transformers.__version__
    size = os.environ.get("PROBE_SIZE", "micro")
    path = build(Path(tempfile.mkdtemp(prefix="vllm-probe-")) / "model", size, "float32")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def seeded_for(row, prompt_length):
        return SeededSampling(SEED, POINT, row, prompt_length, 1.0, 1.0)

    t0 = time.perf_counter()
    # as TRL's VLLMGeneration._init_vllm (colocate) builds it, plus the model's dtype and the seeded processor
    llm = LLM(model=str(path), tensor_parallel_size=1, max_model_len=128, enforce_eager=True, dtype="float32",
              distributed_executor_backend="external_launcher", seed=0, max_num_batched_tokens=4096,
              logprobs_mode="processed_logprobs", logits_processors=[seeded_processor()])
    record["startup_s"] = round(time.perf_counter() - t0, 1)

    def compare(label):
        hf_greedy, vl_greedy = hf_generate(hf, PROMPTS), vllm_generate(llm, PROMPTS, False)
        hf_seeded, vl_seeded = hf_generate(hf, PROMPTS, seeded_for), vllm_generate(llm, PROMPTS, True)
        rec = {"greedy_equal": hf_greedy == vl_greedy[0], "seeded_equal": hf_seeded == vl_seeded[0],
               "seeded_differs_from_greedy": hf_seeded != hf_greedy,
               "first_logprob_max_gap": max_gap(hf_first_logprobs(hf, PROMPTS), vl_greedy[1]),
               "hf_greedy": hf_greedy, "vllm_greedy": vl_greedy[0], "hf_seeded": hf_seeded,
               "vllm_seeded": vl_seeded[0]}
        record[label] = rec
        print(label, {k: v for k, v in rec.items() if not k.startswith(("hf_", "vllm_"))}, flush=True)
        return rec

    compare("loaded")

    # the update: every tensor moved by seeded noise, the transformers copy first
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for _, p in hf.named_parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05 * p.float().std().clamp_min(1e-3))
        # and a sharper output layer: a random model's next-token distribution is nearly flat, where the Gumbel
        # noise alone picks the token and a weight update would leave the seeded completions as they were
        hf.lm_head.weight.mul_(40.0)
    updated = {n: p.detach().clone() for n, p in hf.named_parameters()}
    model = driver_worker(llm).model_runner.model
    try:  # TRL's colocate sync: vllm_generation.py sync_weights
        for name, tensor in updated.items():
            model.load_weights([(name, tensor)])
        llm.reset_prefix_cache()
        record["trl_sync"] = "ok"
    except Exception as exc:  # the answer to record
        record["trl_sync"] = f"{type(exc).__name__}: {exc}"
        record["trl_sync_traceback"] = traceback.format_exc()[-2000:]
    print("TRL's load_weights sync:", record["trl_sync"], flush=True)
    if record["trl_sync"] == "ok":
        compare("after_trl_sync")

    t1 = time.perf_counter()
    # slurmft's CPU sync (slurmft/job/vllm_rollouts.py cpu_sync): vLLM's in-place reload
    driver_worker(llm).reload_weights(weights_iterator=iter(updated.items()), is_checkpoint_format=True)
    llm.reset_prefix_cache()
    record["reload_s"] = round(time.perf_counter() - t1, 2)
    after = compare("after_reload")
    record["device"] = str(next(model.parameters()).device)
    text = json.dumps(record, indent=1)
    if out_path:
        Path(out_path).write_text(text)
    before = record["loaded"]
    record["update_changed"] = {"greedy": before["hf_greedy"] != after["hf_greedy"],
                                "seeded": before["hf_seeded"] != after["hf_seeded"]}
    print("the update changed transformers' completions:", record["update_changed"], flush=True)
    ok = (before["greedy_equal"] and before["seeded_equal"] and after["greedy_equal"] and after["seeded_equal"]
          and all(record["update_changed"].values()))
    print("PROBE", "OK" if ok else "MISMATCH", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else None))
