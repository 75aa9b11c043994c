"""The grpo: section before the queue (slurmft/config_grpo.py, slurmft/plan/grpo_checks.py, slurmft/grpoopts.py):
what `validate` refuses, each naming the field and the fix, and what it accepts (the tiny GRPO example).

Every test runs the real CLI on real files; the reward functions are resolved in a real interpreter (the job's
Python: this venv's), as the job resolves them; the built-in rewards are called on real completions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from cli_runner import cli
from test_checks import jsonl, write_run

from slurmft import rewards
from slurmft.grpoopts import grpo_loss_types, split_reward

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [{"prompt": "What is 2 plus 2?", "answer": "4"}, {"prompt": "What is 3 plus 3?", "answer": "6"}]
GRPO: dict[str, Any] = {"num_generations": 4, "max_completion_length": 8, "rewards": [{"function": "exact_match"}]}


@pytest.fixture(scope="module")
def model_dir(tiny_model: Path) -> Path:
    """The session's tiny model (validate reads its config and tokenizer files only)."""
    return tiny_model


def validate(tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str], rows: list[dict] | None = None,
             **sections: Any) -> tuple[int, str]:
    data = jsonl(tmp_path / "prompts.jsonl", rows or PROMPTS)
    sections.setdefault("grpo", GRPO)
    sections.setdefault("train", {"max_steps": 3, "per_device_batch_size": 2})  # 2 ranks x 2: a group of 4
    code, out, err = cli(["validate", str(write_run(tmp_path, model_dir, data, **sections))], capsys)
    return code, out + err


def test_prompt_data_with_extra_columns_validates(tmp_path: Path, model_dir: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """2 ranks x 2 x 1 step = 4 completions per generation: one prompt's group of 4."""
    chat = [{"prompt": [{"role": "user", "content": "What is 2 plus 2?"}], "answer": "4"}]
    for rows in (PROMPTS, chat):
        code, text = validate(tmp_path, model_dir, capsys, rows, train={"max_steps": 3, "per_device_batch_size": 2})
        assert code == 0, text
        assert "4 completions per generation (1 prompts x 4)" in text


def test_the_tiny_grpo_example_validates(capsys: pytest.CaptureFixture[str], tiny_model: Path) -> None:
    """Its own reward file (a relative file.py:function) and the built-in exact_match on its answer column."""
    code, out, err = cli(["validate", str(REPO / "examples/tiny/grpo.yaml"), f"model.name_or_path={tiny_model}"],
                         capsys)
    assert code == 0, err
    assert "8 completions per generation (2 prompts x 4)" in out + err


@pytest.mark.parametrize(("override", "expected"), [
    ({"num_generations": 3}, "grpo.num_generations: 3 does not divide the generation batch, 2 rank(s) x "
                             "train.per_device_batch_size 2 x steps_per_generation 1 = 4 completions"),
    ({"loss_type": "grpoo"}, "'grpoo' is not a loss type of TRL"),
    ({"num_generations": 1}, "grpo.num_generations"),
])
def test_bad_grpo_options_are_refused_naming_the_field(override: dict, expected: str, tmp_path: Path,
                                                       model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, text = validate(tmp_path, model_dir, capsys, grpo={**GRPO, **override},
                          train={"max_steps": 3, "per_device_batch_size": 2})
    assert code == 2 and expected in text, text


def test_num_generations_refusal_names_the_divisors(tmp_path: Path, model_dir: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    code, text = validate(tmp_path, model_dir, capsys, grpo={**GRPO, "num_generations": 3, "steps_per_generation": 2},
                          train={"max_steps": 3, "per_device_batch_size": 2})
    assert code == 2 and "= 8 completions" in text and "a divisor (2, 4, 8)" in text


def test_grpo_with_dpo_sft_options_or_epochs_is_refused_lora_is_not(tmp_path: Path, model_dir: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    code, text = validate(tmp_path, model_dir, capsys, dpo={})
    assert code == 2 and "grpo and dpo: a run trains with one method" in text
    code, text = validate(tmp_path, model_dir, capsys, train={"max_steps": 3, "sft": {"max_length": 9}})
    assert code == 2 and "a grpo run trains with TRL's GRPOTrainer; remove train.sft (max_length)" in text
    code, text = validate(tmp_path, model_dir, capsys, train={"max_steps": None, "epochs": 1})
    assert code == 2 and "with train.max_steps" in text
    code, text = validate(tmp_path, model_dir, capsys, lora={"r": 8})  # LoRA-GRPO (tests/job/test_grpo_lora_cpu.py)
    assert code == 0, text


def test_a_prompt_set_with_completions_is_refused(tmp_path: Path, model_dir: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    rows = [{"prompt": "What is 2 plus 2?", "completion": "4", "answer": "4"}]
    code, text = validate(tmp_path, model_dir, capsys, rows)
    assert code == 2 and "grpo: generates the completions itself, but the rows hold a 'completion'" in text
    code, text = validate(tmp_path, model_dir, capsys, [{"messages": [{"role": "user", "content": "hi"}]}])
    assert code == 2 and "grpo: trains on prompts" in text
    code, text = validate(tmp_path, model_dir, capsys, [{"prompt": " ", "answer": "4"}])
    assert code == 2 and "row 0 has an empty prompt" in text
    code, text = validate(tmp_path, model_dir, capsys, grpo=None)  # prompts without a grpo section
    assert code == 2 and "hold prompts without replies, which sft cannot train on: add a grpo: section" in text


def test_rewards_that_do_not_import_or_cannot_take_trls_arguments_are_refused(
        tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Resolved in the job's Python (this venv's interpreter), every problem at once, each with its index."""
    (tmp_path / "mine.py").write_text("def good(completions, **kwargs):\n    return [1.0] * len(completions)\n"
                                      "def narrow(completions):\n    return [0.0] * len(completions)\n"
                                      "broken = 3\n")
    (tmp_path / "crash.py").write_text("raise RuntimeError('no GPU here')\n")
    specs = [f"{tmp_path}/mine.py:good", f"{tmp_path}/mine.py:narrow", f"{tmp_path}/mine.py:missing",
             "no_such_reward_module:f", f"{tmp_path}/crash.py:f", f"{tmp_path}/mine.py:broken", "think_format"]
    grpo = {**GRPO, "rewards": [{"function": s} for s in specs]}
    code, text = validate(tmp_path, model_dir, capsys, grpo=grpo)
    assert code == 2
    assert "grpo.rewards[0]" not in text and "grpo.rewards[6]" not in text
    assert ("grpo.rewards[1].function: " in text and "cannot take the arguments TRL's GRPOTrainer passes" in text
            and "unexpected keyword argument" in text and "**kwargs" in text)
    assert "grpo.rewards[2].function: " in text and "has no 'missing'" in text
    assert ("grpo.rewards[3].function: 'no_such_reward_module:f' does not load in the job's Python" in text
            and "No module named 'no_such_reward_module'" in text and "PYTHONPATH" in text)
    assert "grpo.rewards[4].function: " in text and "RuntimeError: no GPU here" in text
    assert "grpo.rewards[5].function: " in text and "is a int, not a function" in text


def test_a_reward_reading_a_column_the_data_lacks_is_refused(tmp_path: Path, model_dir: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    code, text = validate(tmp_path, model_dir, capsys, [{"prompt": "What is 2 plus 2?"}])
    assert code == 2 and "grpo.rewards[0].function: 'exact_match' reads a column 'answer'" in text


def test_a_bad_reward_name_is_refused_by_the_schema(tmp_path: Path, model_dir: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    for spec, expected in (("accuracy", "is not a built-in reward (exact_match, think_format); name yours as"),
                           ("exact_mach", "is not a built-in reward (exact_match, think_format); did you mean "
                                          "exact_match?"),
                           ("my rewards:f", "is neither a module name"), ("mod:1f", "is not a function name")):
        code, text = validate(tmp_path, model_dir, capsys, grpo={**GRPO, "rewards": [{"function": spec}]})
        assert code == 2 and expected in text, text


def test_vllm_rollouts_without_vllm_point_at_transformers(tmp_path: Path, model_dir: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """This machine's job Python has no vLLM (CPU only): colocate and server are refused with the way that works."""
    for rollouts in ("colocate", "server"):
        # server: a layout that can work (a training node and the server's, with GPUs): only vLLM is missing
        layout = {"resources": {"nodes": 2, "gpus_per_node": 2}} if rollouts == "server" else {}
        code, text = validate(tmp_path, model_dir, capsys, grpo={**GRPO, "rollouts": rollouts}, **layout)
        assert code == 2 and f"grpo.rollouts: {rollouts} generates with vLLM, which the job's Python" in text
        assert "set grpo.rollouts=transformers" in text


def test_colocate_validates_where_the_jobs_python_imports_vllm(tmp_path: Path, model_dir: Path,
                                                              capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The vLLM venv (examples/tiny/envs.sh: vLLM's CPU build beside the training stack) as cluster.python:
    colocate is accepted there (with LoRA too), server is still refused (unproven), and with LoRA even through the
    gate."""
    from tests.conftest import need_model_job_python

    python = need_model_job_python("serve")
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # slurmft itself, from this checkout, in that Python
    cluster = {"profile": "local-test", "python": python}
    code, text = validate(tmp_path, model_dir, capsys, grpo={**GRPO, "rollouts": "colocate"}, cluster=cluster)
    assert code == 0, text
    code, text = validate(tmp_path, model_dir, capsys, grpo={**GRPO, "rollouts": "server"}, cluster=cluster,
                          resources={"nodes": 2, "gpus_per_node": 2})
    assert code == 2 and "grpo.rollouts: server renders" in text, text
    # LoRA with colocate validates (its syncs merge the adapters: tests/job/test_grpo_vllm_cpu.py); with server it
    # is refused, with the gate open too, naming the ways that work
    code, text = validate(tmp_path, model_dir, capsys, grpo={**GRPO, "rollouts": "colocate"}, cluster=cluster,
                          lora={})
    assert code == 0, text
    monkeypatch.setenv("SLURMFT_UNPROVEN_VLLM_SERVER", "1")
    code, text = validate(tmp_path, model_dir, capsys, grpo={**GRPO, "rollouts": "server"}, cluster=cluster,
                          resources={"nodes": 2, "gpus_per_node": 2}, lora={})
    assert code == 2 and "grpo.rollouts: server with lora: is not supported yet" in text, text
    assert "set grpo.rollouts=colocate" in text


def test_loss_types_are_read_from_the_installed_trl() -> None:
    known, version = grpo_loss_types()
    assert known is not None, version
    assert {"grpo", "dapo", "dr_grpo", "bnpo"} <= set(known)


def test_builtin_rewards_score_strings_and_conversations() -> None:
    assert split_reward("exact_match") == ("slurmft.rewards", "exact_match")
    assert split_reward("/x/r.py:f") == ("/x/r.py", "f")
    done = [{"role": "assistant", "content": "<think>2+2</think> <answer> 4 </answer>"}]
    assert rewards.exact_match(["4", " 4 ", "5", done], answer=["4", "4", "4", "4"]) == [1.0, 1.0, 0.0, 1.0]
    assert rewards.think_format([done, "4", "<think>x</think><answer>4</answer> and more"]) == [1.0, 0.0, 0.0]
