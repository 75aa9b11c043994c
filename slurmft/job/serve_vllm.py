"""The vLLM half of the serve check: run as a script by ``serve.python`` (an interpreter with vLLM), never imported.

vLLM pins its own transformers (its CPU build 0.32: ``transformers<5.20``; training pins 5.24), so this file
imports nothing but the standard library and vLLM, and slurmft need not be installed beside it. The training side
(:mod:`slurmft.job.serve_check`) writes a request, starts ``serve.python serve_vllm.py REQUEST RESULT``, and
compares what comes back with transformers on the same model and prompts.

The request (JSON): ``model``, ``tokenizer``, ``prompts`` (token id lists: the chat template is applied once, by the
training side, so both engines see the same ids), ``max_new_tokens``, ``logprobs`` (top-K of the first generated
token), ``dtype``, ``enforce_eager``, ``max_model_len``, ``tensor_parallel_size``, ``gpu_memory_utilization`` and
``lora`` (``{"path": ADAPTER_DIR, "rank": r}`` or null: the adapter served on the base through vLLM's LoRA
support, as users serve adapters). The result (JSON): ``vllm_version``, ``startup_s``, ``outputs`` (per prompt:
``token_ids``, ``first_logprobs`` {token id: log-prob}, ``finish_reason``, ``stop_reason``), ``generate_s``,
``generated_tokens``; or ``error`` (what vLLM raised, its last lines) when the engine refused the model.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback


def _write(path: str, record: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, path)


def _outputs(results: list) -> list[dict]:
    rows = []
    for res in results:
        out = res.outputs[0]
        first = out.logprobs[0] if out.logprobs else {}
        rows.append({
            "token_ids": list(out.token_ids),
            "first_logprobs": {str(tid): float(lp.logprob) for tid, lp in first.items()},
            "finish_reason": out.finish_reason,
            "stop_reason": out.stop_reason if isinstance(out.stop_reason, int | str | None) else str(out.stop_reason),
        })
    return rows


def serve(req: dict) -> dict:
    """Start the engine on the request's model, generate greedily, return what the result file records.

    On one device (``tensor_parallel_size`` 1: one GPU, or the CPU) the engine core and its worker run in this
    process: vLLM's default layout starts two more processes, each importing torch and vLLM again, which made most
    of a check's time (the zoo's Qwen3-MoE on a loaded 2-core machine: 74 s with them, 30 s without, the same
    tokens). This is a check, not a server: nothing here needs the engine apart from the caller.
    """
    t0 = time.perf_counter()
    one_process = req["tensor_parallel_size"] == 1
    if one_process:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # read when vLLM is imported
    import vllm
    from vllm import LLM, SamplingParams

    lora = req.get("lora")
    engine_args = {
        "model": req["model"], "tokenizer": req["tokenizer"], "dtype": req["dtype"],
        "enforce_eager": req["enforce_eager"], "max_model_len": req["max_model_len"],
        "tensor_parallel_size": req["tensor_parallel_size"], "seed": 0,
    }
    if one_process:
        engine_args["distributed_executor_backend"] = "uni"
    if req.get("gpu"):
        engine_args["gpu_memory_utilization"] = req["gpu_memory_utilization"]
    if lora:
        engine_args.update(enable_lora=True, max_lora_rank=max(8, int(lora["rank"])), max_loras=1)
    llm = LLM(**engine_args)
    startup_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=req["max_new_tokens"], logprobs=req["logprobs"])
    prompts = [{"prompt_token_ids": ids} for ids in req["prompts"]]
    kwargs = {}
    if lora:
        from vllm.lora.request import LoRARequest

        kwargs["lora_request"] = LoRARequest("adapter", 1, lora["path"])
    t1 = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False, **kwargs)
    generate_s = time.perf_counter() - t1
    outputs = _outputs(results)
    generated = sum(len(o["token_ids"]) for o in outputs)
    return {"vllm_version": getattr(vllm, "__version__", "unknown"), "startup_s": round(startup_s, 2),
            "generate_s": round(generate_s, 3), "generated_tokens": generated,
            "tokens_per_s": round(generated / generate_s, 1) if generate_s > 0 else None, "outputs": outputs,
            "engine_args": {k: v for k, v in engine_args.items() if k not in ("model", "tokenizer")}}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        sys.stderr.write("usage: python serve_vllm.py REQUEST.json RESULT.json\n")
        return 2
    with open(argv[0]) as f:
        req = json.load(f)
    try:
        record = serve(req)
    except BaseException as exc:  # noqa: BLE001 - what vLLM refused is the check's answer, written for the caller
        lines = traceback.format_exception(exc)
        _write(argv[1], {"error": f"{type(exc).__name__}: {exc}".strip(), "traceback": "".join(lines[-12:])})
        traceback.print_exc()
        return 1
    _write(argv[1], record)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
