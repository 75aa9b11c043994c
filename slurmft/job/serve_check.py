"""The serve check: the consolidated model served by vLLM, compared with transformers on the same prompts.

The job after consolidation (``serve`` section) proves what a deployer needs before the allocation is gone:

1. the prompts: the first rows of the run's own data, up to the first assistant turn, with the chat template
   applied as the tokenizer defines it (``add_generation_prompt``) -- a plain-text run's documents by their first
   half instead, with no template -- tokenized once here so both engines see the same ids;
2. transformers (the training stack) loads ``model/`` and reports missing, unexpected or mismatched weights, then
   gives each prompt's first-token log-probabilities and its greedy continuation (stopping where the generation
   config says);
3. vLLM, in ``serve.python`` (its own venv: it pins its own transformers), starts its engine on ``model/`` and
   generates greedily (:mod:`slurmft.job.serve_vllm`, run as a script); for a LoRA run a second engine serves
   the base with ``adapter/`` through vLLM's LoRA support, which must equal the merged model;
4. the comparison: in float32 the greedy tokens must be equal and the first-token log-probabilities agree to
   ``FP32_LOGPROB_TOLERANCE``; in bf16/fp16 kernels legitimately differ, so the agreement length and the largest
   log-probability gap are reported and only a gap over ``serve.logprob_tolerance`` fails; a stop on a token the
   generation config does not call EOS fails.

``RUN_DIR/serve/result.json`` records it all (vLLM's version, engine start-up, tokens/s, per prompt); a failed
check raises :class:`ServeCheckError` naming the cause and never touches ``model/``.
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from slurmft.config import RunConfig
from slurmft.errors import SlurmftError
from slurmft.rundir import RunPaths, atomic_write, keep_previous


def say(line: str) -> None:
    """A line of the job's own in its log (stdout, where vLLM's output streams too), in order with vLLM's."""
    print(line, flush=True)


#: float32: the first-token log-probabilities of the two engines agree to this (nats); their greedy tokens must be
#: equal. Summation order differs between vLLM's kernels and torch's, so bit equality is not asked for.
FP32_LOGPROB_TOLERANCE = 1e-3
#: The top-K log-probabilities vLLM returns for the first generated token.
TOP_K = 5
#: A plain-text document's prompt: its first half, at most this many tokens (the rest is what the model continues).
DOCUMENT_PROMPT_TOKENS = 32
SCRIPT = Path(__file__).with_name("serve_vllm.py")


class ServeCheckError(SlurmftError):
    """The model does not serve as trained: what vLLM refused, or where it disagrees with transformers."""


# ------------------------------------------------------------------------------------------------ the prompts
def _prompt_turns(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """A conversation up to (not including) its first assistant turn."""
    out = []
    for m in messages:
        if m["role"] == "assistant":
            break
        out.append(m)
    return out


def _document_start(document: str, tokenizer: Any) -> list[int]:
    """A plain-text document's first half (at most :data:`DOCUMENT_PROMPT_TOKENS` tokens), tokenized as the run
    trained on it (TRL tokenizes a plain-text row with the tokenizer's special tokens; no chat template)."""
    ids = tokenizer(document)["input_ids"]
    return ids[:max(1, min(len(ids) // 2, DOCUMENT_PROMPT_TOKENS))]


def take_prompts(cfg: RunConfig, tokenizer: Any, n: int) -> tuple[list[str], list[list[int]]]:
    """The first ``n`` usable rows of the run's first data source as prompts: (texts, token ids). Chat rows up to
    their first reply, with the chat template; plain-text documents (continued pretraining: the model never saw a
    chat template) by their beginning, which the model continues."""
    from slurmft.config import Method
    from slurmft.job.data import TEXT, load_source

    with_prompt = cfg.method in (Method.DPO, Method.GRPO)  # a prompt column (a GRPO prompt may be a string)
    ds = load_source(cfg.data.datasets[0], 0, None, cfg.method.value)
    if not with_prompt and TEXT in ds.column_names:
        starts = [_document_start(doc, tokenizer) for doc in ds.select(range(min(len(ds), n)))[TEXT]]
        return [tokenizer.decode(ids) for ids in starts], starts
    texts: list[str] = []
    for row in ds.select(range(min(len(ds), 4 * n))):
        prompt = row["prompt"] if with_prompt else None
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        turns = list(prompt) if with_prompt else _prompt_turns(list(row["messages"]))
        if not turns or turns[-1]["role"] != "user":
            continue
        texts.append(tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True))
        if len(texts) == n:
            break
    if not texts:
        raise ServeCheckError(f"serve.prompts: no prompt in data.datasets[0] ({cfg.data.datasets[0].path}): no row "
                              "has a user turn before its first reply")
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    return texts, ids


# ------------------------------------------------------------------------------------------------ transformers
def eos_ids(model_dir: Path, tokenizer: Any) -> list[int]:
    """The ids that end a generation: the generation config's eos_token_id, else the tokenizer's."""
    found: list[int] = []
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        found = [eos] if isinstance(eos, int) else list(eos or [])
    if not found and tokenizer.eos_token_id is not None:
        found = [tokenizer.eos_token_id]
    return found


def reference(model_dir: Path, dtype: str, prompts: list[list[int]], max_new_tokens: int,
              adapter: Path | None = None) -> dict[str, Any]:
    """transformers on the same model: loading problems, and per prompt the first-token log-probabilities (all of
    the vocabulary) and the greedy continuation (generation config's stopping rules)."""
    import torch
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, info = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype),
                                                       output_loading_info=True)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    model.to(device).eval()
    loading = {k: sorted(str(x) for x in (info.get(k) or [])) for k in ("missing_keys", "unexpected_keys",
                                                                         "mismatched_keys", "error_msgs")}
    rows = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids], device=device)
            logits = model(x).logits[0, -1].float()
            logp = torch.log_softmax(logits, dim=-1)
            out = model.generate(x, max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                                 attention_mask=torch.ones_like(x))
            rows.append({"token_ids": out[0, len(ids):].tolist(), "logprobs": logp.cpu()})
    del model
    return {"loading": loading, "outputs": rows}


# ------------------------------------------------------------------------------------------------ vLLM
#: An error line in vLLM's output (its engine core and workers log the root cause; the exception the script gets
#: from the engine is often only "EngineDeadError: EngineCore encountered an issue").
_ERROR_LINE = re.compile(r"\b((?:[A-Z]\w*)?(?:Error|Exception)): (.+)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def root_causes(lines: list[str], limit: int = 3) -> list[str]:
    """The distinct error lines of vLLM's output, the generic engine-died one left out, oldest first."""
    found: list[str] = []
    for line in lines:
        m = _ERROR_LINE.search(_ANSI.sub("", line))
        if m and m.group(1) != "EngineDeadError" and m.group(0) not in found:
            found.append(m.group(0).strip())
    return found[:limit]


def run_vllm(python: str, request: dict[str, Any], workdir: Path, label: str, timeout_s: float) -> dict[str, Any]:
    """``python serve_vllm.py`` on ``request``; its output streams into the job's log (and its end is kept, for the
    root cause of a refusal); returns its result file."""
    req_path, res_path = workdir / f"{label}.request.json", workdir / f"{label}.vllm.json"
    atomic_write(req_path, json.dumps(request, indent=1))
    res_path.unlink(missing_ok=True)
    env = dict(os.environ)
    if not request.get("gpu"):
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on the CPU: a check, not a server
    sys.stdout.flush()
    tail: collections.deque[str] = collections.deque(maxlen=400)
    try:
        proc = subprocess.Popen([python, str(SCRIPT), str(req_path), str(res_path)], env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, errors="replace")
    except FileNotFoundError:
        raise ServeCheckError(f"serve.python: {python} does not exist (an interpreter with vLLM installed)") from None
    timer = threading.Timer(timeout_s, proc.kill)
    timer.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            tail.append(line.rstrip("\n"))
        proc.wait()
    finally:
        timed_out = not timer.is_alive()
        timer.cancel()
    sys.stdout.flush()
    if timed_out:
        raise ServeCheckError(f"vLLM ({label}) did not finish within {timeout_s:.0f} s: its engine hung or is far "
                              "too slow here (see the job's log)")
    if not res_path.is_file():
        raise ServeCheckError(f"vLLM ({label}) ended with exit status {proc.returncode} and wrote no result: "
                              f"{python} may lack vLLM (`{python} -m pip install vllm`); see the job's log",
                              root_causes(list(tail)))
    result = json.loads(res_path.read_text())
    if "error" in result:
        causes = root_causes(list(tail)) or [line for line in result.get("traceback", "").splitlines()[-3:]
                                             if line.strip()]
        raise ServeCheckError(f"vLLM refused the model ({label}): {result['error']}", causes)
    return result


# ------------------------------------------------------------------------------------------------ comparison
def compare(ref: dict[str, Any], served: dict[str, Any], exact: bool, tolerance: float,
            eos: list[int]) -> dict[str, Any]:
    """Per prompt: how many greedy tokens agree, the largest first-token log-prob gap over vLLM's top-K, the stop;
    and the problems (an empty list passes)."""
    problems: list[str] = []
    rows = []
    for i, (r, s) in enumerate(zip(ref["outputs"], served["outputs"], strict=True)):
        a, b = r["token_ids"], s["token_ids"]
        agree = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        gaps = [abs(float(r["logprobs"][int(tid)]) - lp) for tid, lp in s["first_logprobs"].items()]
        gap = max(gaps) if gaps else float("nan")
        stop = b[-1] if b and s["finish_reason"] == "stop" else None
        rows.append({"prompt": i, "transformers": a, "vllm": b, "agree": agree, "max_first_logprob_gap": gap,
                     "finish_reason": s["finish_reason"], "stop_token": stop})
        if exact and a != b:
            problems.append(f"prompt {i}: greedy tokens differ at position {agree} (float32 must agree exactly): "
                            f"transformers {a[:agree + 3]}..., vLLM {b[:agree + 3]}...")
        if not gap <= (FP32_LOGPROB_TOLERANCE if exact else tolerance):
            problems.append(f"prompt {i}: first-token log-probabilities differ by up to {gap:.4f} nats (tolerance "
                            f"{FP32_LOGPROB_TOLERANCE if exact else tolerance})")
        if stop is not None and eos and stop not in eos:
            problems.append(f"prompt {i}: vLLM stopped on token {stop}, which the generation config does not call EOS "
                            f"({eos})")
    return {"prompts": rows, "problems": problems}


# ------------------------------------------------------------------------------------------------ the job
def _served_dtype(cfg: RunConfig, model_dir: Path) -> str:
    if cfg.serve is not None and cfg.serve.dtype != "auto":
        return cfg.serve.dtype
    config = json.loads((model_dir / "config.json").read_text())
    return str(config.get("dtype") or config.get("torch_dtype") or "float32")


def _loading_problems(loading: dict[str, list[str]]) -> list[str]:
    names = {"missing_keys": "missing", "unexpected_keys": "unexpected", "mismatched_keys": "mismatched"}
    return [f"transformers found {len(v)} {names[k]} weight(s) in the model: {', '.join(v[:5])}"
            for k, v in loading.items() if k in names and v]


def serve_check_run(run_dir: str, overrides: list[str] | None = None) -> dict[str, Any]:
    """The serve check of a run (the ``serve`` section of RUN_DIR/config.yaml with ``overrides``: ``slurmft serve
    RUN_DIR KEY=VALUE``'s, resolved): writes ``RUN_DIR/serve/result.json`` (passed or not, with the section it ran
    with), raises :class:`ServeCheckError` when the model does not serve as trained; ``model/`` is only read."""
    from slurmft.config_loading import read_run_config

    paths = RunPaths.of(run_dir)
    cfg = read_run_config(paths.config, overrides)
    if cfg.serve is None:
        raise ServeCheckError(f"{paths.config} has no serve section: nothing to check (give one: `slurmft serve "
                              f"{paths.root} serve.python=/path/to/vllm-venv/bin/python`)")
    out_dir = paths.root / "serve"
    out_dir.mkdir(exist_ok=True)
    record: dict[str, Any] = {"ok": False, "engines": {}, "problems": [],
                              "settings": cfg.serve.model_dump(mode="json"), "overrides": list(overrides or [])}
    try:
        _check(cfg, paths, out_dir, record)
    except ServeCheckError as exc:
        record["problems"] = [str(exc), *exc.problems]
        raise
    finally:
        keep_previous(out_dir / "result.json")  # the verdict it replaces stays readable
        atomic_write(out_dir / "result.json", json.dumps(record, indent=1, default=str))
    from slurmft.watch.model_results import serve_lines

    for line in serve_lines(record):  # the job's log says the verdict as status does (a failure: the error says it)
        say(line)
    return {"ok": True, "engines": {k: {"agree": [p["agree"] for p in v["prompts"]], "startup_s": v["startup_s"]}
                                    for k, v in record["engines"].items()}}


def _tokenizer(tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(tokenizer_dir))
    except Exception as exc:  # noqa: BLE001 - a tokenizer that does not load is what a deployer would meet
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ServeCheckError(f"the tokenizer in {tokenizer_dir} does not load ({type(exc).__name__}: {first}): a "
                              "server could not load it either; consolidate again (`slurmft consolidate`) or copy "
                              "the base's tokenizer files there") from None


def _check(cfg: RunConfig, paths: RunPaths, out_dir: Path, record: dict[str, Any]) -> None:
    """Each engine (model/; a LoRA run's adapter on the base) served, compared, recorded in ``record``."""
    from slurmft.config_values import slurm_time_seconds
    from slurmft.job.inputs import resolve_model_dir

    serve = cfg.serve
    assert serve is not None
    python = cfg.model_job_python("serve", sys.executable)  # default: the interpreter running this step
    record["python"] = python
    engines: list[tuple[str, Path, Path | None]] = []  # label, model dir, adapter served on it
    if (paths.model / "config.json").is_file():
        engines.append(("model", paths.model, None))
    if cfg.lora is not None and (paths.adapter / "adapter_config.json").is_file():
        engines.append(("adapter", resolve_model_dir(cfg.model, with_weights=True), paths.adapter))
    if not engines:
        raise ServeCheckError(f"nothing to serve: {paths.model} has no config.json (did the consolidation finish? "
                              f"`slurmft status {paths.root}`)")
    tokenizer_dir = paths.model if paths.model.is_dir() else engines[0][1]
    tokenizer = _tokenizer(tokenizer_dir)
    texts, prompts = take_prompts(cfg, tokenizer, serve.prompts)
    record["prompts"] = texts
    timeout_s = max(60.0, slurm_time_seconds(serve.resources.time) - 60.0)
    failed: list[str] = []
    for label, model_dir, adapter in engines:
        merged = adapter is not None and (paths.model / "config.json").is_file()
        dtype = _served_dtype(cfg, paths.model if merged else model_dir)
        eos = eos_ids(model_dir, tokenizer)
        request = {
            "model": str(model_dir), "tokenizer": str(tokenizer_dir), "prompts": prompts,
            "max_new_tokens": serve.max_new_tokens, "logprobs": TOP_K, "dtype": dtype,
            "enforce_eager": serve.enforce_eager,
            "max_model_len": serve.max_model_len or cfg.data.max_seq_length + serve.max_new_tokens,
            "tensor_parallel_size": max(1, serve.resources.gpus), "gpu": serve.resources.gpus > 0,
            "gpu_memory_utilization": serve.gpu_memory_utilization,
            "lora": {"path": str(adapter), "rank": cfg.lora.r} if adapter is not None and cfg.lora else None,
        }
        t0 = time.perf_counter()
        # the job's log said nothing of its own between the prompts and the verdict (a logger no handler printed)
        say(f"serve check ({label}): vLLM in {python} on {model_dir}{f' + {adapter}' if adapter else ''}, "
            f"{len(prompts)} prompt(s), {dtype}; at most {timeout_s:.0f} s")
        served = run_vllm(python, request, out_dir, label, timeout_s)
        # the adapter served on the base must equal the merged model (model/) where there is one
        ref_dir, ref_adapter = (paths.model, None) if merged else (model_dir, adapter)
        say(f"serve check ({label}): vLLM {served['vllm_version']} started in {served['startup_s']:.1f} s, "
            f"{served.get('tokens_per_s')} tokens/s; now transformers on {ref_dir}"
            f"{f' + {ref_adapter}' if ref_adapter else ''}")
        ref = reference(ref_dir, dtype, prompts, serve.max_new_tokens, ref_adapter)
        exact = dtype == "float32"
        verdict = compare(ref, served, exact, serve.logprob_tolerance, eos)
        problems = _loading_problems(ref["loading"]) + verdict["problems"]
        if not eos:
            problems.append("no EOS token: neither generation_config.json nor the tokenizer names one, so a server "
                            "never stops a reply")
        record["engines"][label] = {
            "model": str(model_dir), "adapter": str(adapter) if adapter else None, "dtype": dtype, "exact": exact,
            "compared_with": str(ref_dir) + (f" + {ref_adapter}" if ref_adapter else ""),
            "vllm_version": served["vllm_version"], "startup_s": served["startup_s"],
            "tokens_per_s": served.get("tokens_per_s"), "generated_tokens": served["generated_tokens"],
            "loading": ref["loading"], "eos": eos, "prompts": verdict["prompts"], "problems": problems,
            "ok": not problems, "seconds": round(time.perf_counter() - t0, 1),
        }
        record["vllm_version"] = served["vllm_version"]
        failed += [f"{label}: {p}" for p in problems]
    if failed:
        raise ServeCheckError(f"the model does not serve as trained ({out_dir / 'result.json'}); {paths.model} is "
                              "left as it is", failed)
    record["ok"] = True
