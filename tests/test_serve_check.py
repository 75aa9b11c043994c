"""The serve check's parts that need no vLLM: the comparison rules, the prompts, the config and login-side checks,
the scripts. vLLM itself serves in tests/test_serve_eval_local.py (the served tiny example)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from slurmft.config_loading import load_config
from slurmft.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent
SERVED = REPO / "examples" / "tiny" / "serve-eval.yaml"
RUN = REPO / "examples" / "tiny" / "run.yaml"


def _ref(tokens: list[int], first: dict[int, float], vocab: int = 8) -> dict:
    import torch

    logprobs = torch.full((vocab,), -20.0)
    for tid, lp in first.items():
        logprobs[tid] = lp
    return {"token_ids": tokens, "logprobs": logprobs}


def _served(tokens: list[int], first: dict[int, float], finish: str = "stop") -> dict:
    return {"token_ids": tokens, "first_logprobs": {str(k): v for k, v in first.items()}, "finish_reason": finish}


def test_float32_needs_equal_tokens_and_log_probs() -> None:
    from slurmft.job.serve_check import compare

    first = {4: -0.1, 5: -2.5}
    same = compare({"outputs": [_ref([4, 6, 3], first)]}, {"outputs": [_served([4, 6, 3], first)]}, True, 0.5, [3])
    assert same["problems"] == [] and same["prompts"][0]["agree"] == 3 and same["prompts"][0]["stop_token"] == 3
    differ = compare({"outputs": [_ref([4, 6, 3], first)]}, {"outputs": [_served([4, 7, 3], first)]}, True, 0.5, [3])
    assert len(differ["problems"]) == 1 and "differ at position 1" in differ["problems"][0]
    shifted = {4: -0.1 + 0.01, 5: -2.5}  # 0.01 nats is far beyond float32's rounding
    gap = compare({"outputs": [_ref([4], first)]}, {"outputs": [_served([4], shifted, "length")]}, True, 0.5, [3])
    assert len(gap["problems"]) == 1 and "log-probabilities differ by up to 0.0100" in gap["problems"][0]


def test_half_precision_reports_agreement_and_fails_only_a_gross_gap() -> None:
    from slurmft.job.serve_check import compare

    first = {4: -0.10, 5: -2.5}
    near = {4: -0.13, 5: -2.46}  # kernels differ: the continuation may part ways later
    ok = compare({"outputs": [_ref([4, 6, 9, 3], first)]}, {"outputs": [_served([4, 6, 8, 3], near)]}, False, 0.5, [3])
    assert ok["problems"] == [] and ok["prompts"][0]["agree"] == 2
    assert math.isclose(ok["prompts"][0]["max_first_logprob_gap"], 0.04, abs_tol=1e-6)
    gross = {4: -1.2, 5: -2.5}
    bad = compare({"outputs": [_ref([4], first)]}, {"outputs": [_served([4], gross, "length")]}, False, 0.5, [3])
    assert len(bad["problems"]) == 1 and "tolerance 0.5" in bad["problems"][0]


def test_a_stop_on_a_token_that_is_not_eos_fails() -> None:
    from slurmft.job.serve_check import compare

    first = {4: -0.1}
    out = compare({"outputs": [_ref([4, 5], first)]}, {"outputs": [_served([4, 5], first)]}, True, 0.5, [3])
    assert out["problems"] == ["prompt 0: vLLM stopped on token 5, which the generation config does not call EOS ([3])"]


def test_prompts_come_from_the_runs_own_data_with_the_chat_template(tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    from slurmft.job.serve_check import take_prompts

    cfg = load_config(RUN, [f"model.name_or_path={tiny_model}"])
    tok = AutoTokenizer.from_pretrained(tiny_model)
    texts, ids = take_prompts(cfg, tok, 3)
    first = (REPO / "examples" / "tiny" / "data" / "lima.jsonl").read_text().splitlines()[0]
    import json

    question = json.loads(first)["conversations"][0]
    assert len(texts) == len(ids) == 3 and question in texts[0]
    want = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)
    assert texts[0] == want and ids[0] == tok(want, add_special_tokens=False)["input_ids"]
    assert json.loads(first)["conversations"][1] not in texts[0]  # the reply is what the model must generate


def test_a_grpo_runs_prompts_are_its_prompt_strings_as_user_turns(tiny_model: Path) -> None:
    """A grpo run's data is prompts (strings here): the serve check asks the served model each as a user turn."""
    import json

    from transformers import AutoTokenizer

    from slurmft.job.serve_check import take_prompts

    cfg = load_config(REPO / "examples" / "tiny" / "grpo.yaml", [f"model.name_or_path={tiny_model}"])
    tok = AutoTokenizer.from_pretrained(tiny_model)
    texts, _ = take_prompts(cfg, tok, 2)
    first = json.loads((REPO / "examples" / "tiny" / "data" / "prompts.jsonl").read_text().splitlines()[0])
    want = tok.apply_chat_template([{"role": "user", "content": first["prompt"]}], tokenize=False,
                                   add_generation_prompt=True)
    assert len(texts) == 2 and texts[0] == want and first["answer"] not in texts[0]


def test_a_text_runs_prompts_are_its_documents_beginnings_without_a_chat_template(tiny_model: Path) -> None:
    """A plain-text run (continued pretraining) has no user turns: the serve check asks the model to continue each
    document's first half, tokenized as training tokenized it (was: 'no prompt in data.datasets[0]', after the whole
    run had trained)."""
    from transformers import AutoTokenizer

    from slurmft.job.serve_check import DOCUMENT_PROMPT_TOKENS, take_prompts

    cfg = load_config(REPO / "examples" / "tiny" / "text.yaml", [f"model.name_or_path={tiny_model}"])
    tok = AutoTokenizer.from_pretrained(tiny_model)
    texts, ids = take_prompts(cfg, tok, 3)
    corpus = REPO / "examples" / "tiny" / "data" / "corpus"
    first = next(block for block in sorted(corpus.glob("*.txt"))[0].read_text().split("\n\n") if block.strip())
    whole = tok(first)["input_ids"]
    assert len(texts) == len(ids) == 3 and len(whole) > 2
    assert ids[0] == whole[:min(len(whole) // 2, DOCUMENT_PROMPT_TOKENS)]  # a prefix of the training tokens
    assert texts[0] == tok.decode(ids[0]) and "<|im_start|>" not in texts[0] and texts[0] != texts[1]


def test_served_example_trains_what_run_yaml_trains() -> None:
    """serve-eval.yaml is run.yaml's fine-tune plus the two jobs after it: the shared local run (tests/conftest.py)
    stands for both, and test_resume_local compares run.yaml's resumed run with it."""
    a = load_config(SERVED).model_dump(exclude={"name", "output_dir", "serve", "eval"})
    b = load_config(RUN).model_dump(exclude={"name", "output_dir", "serve", "eval"})
    assert a == b


def test_serve_and_eval_need_a_consolidation() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(SERVED, ["consolidate.enabled=false"])
    assert "set consolidate.enabled=true or remove the serve section" in info.value.render()


def test_a_serve_python_without_vllm_is_refused_at_validate(tmp_path: Path) -> None:
    from slurmft.plan.model_job_checks import check_serve

    cfg = load_config(SERVED, [f"serve.python={sys.executable}"])  # the training stack's Python: no vLLM in it
    problems = check_serve(cfg)
    assert len(problems) == 1 and f"serve.python: {sys.executable} cannot import vllm" in problems[0]
    cfg = load_config(SERVED, [f"serve.python={tmp_path}/nothing/bin/python"])
    assert "does not exist on this machine" in check_serve(cfg)[0]


def test_the_jobs_after_consolidation_render_with_their_resources(tmp_path: Path) -> None:
    from slurmft.plan.render import render_scripts
    from slurmft.profiles import load_profile
    from slurmft.rundir import RunPaths

    cfg = load_config(SERVED, ["executor=slurm", "serve.resources.gpus=2", "eval.resources.time=00:30:00",
                               f"output_dir={tmp_path}/run"])
    scripts = render_scripts(cfg, load_profile(cfg.cluster.profile), RunPaths.of(cfg.output_dir))
    assert list(scripts) == ["prepare", "train", "consolidate", "serve", "eval"]
    serve, ev = scripts["serve"], scripts["eval"]
    assert "#SBATCH --job-name=tiny-served-serve" in serve and "#SBATCH --gpus-per-node=2" in serve
    assert "--gpu-bind=none" in serve and "NCCL_" not in serve
    assert "#SBATCH --time=00:30:00" in ev and "gpus-per-node" not in ev
    assert f"#SBATCH --output={tmp_path}/run/logs/eval-%j.out" in ev
