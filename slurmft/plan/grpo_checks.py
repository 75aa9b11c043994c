"""``validate``'s checks of a ``grpo:`` section that need the job's Python: each reward function imports there and
takes the arguments TRL passes it, and the rollouts' generator is there.

A reward is resolved by the code the job itself runs (:data:`slurmft.grpoopts.REWARD_CHECK`), in the job's
interpreter (``cluster.python``), once for all rewards: a module that does not import, a missing function or a
signature that cannot take TRL's keyword arguments (``prompts``, ``completions``, ``completion_ids``,
``trainer_state``, ``log_extra``, ``log_metric`` and every extra column of the prompt data) would otherwise fail
after the queue wait, the model load and the first generation.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from slurmft.config import RunConfig
from slurmft.config_grpo import Rollouts
from slurmft.config_paths import is_program_path
from slurmft.grpoopts import NOT_PASSED, REWARD_ARGUMENTS, REWARD_CHECK, UNPROVEN_SERVER_ENV, split_reward
from slurmft.interpreter import NOT_ON_PATH, NoAnswer, finds_modules, in_words, locate, run_json


def reward_names(columns: list[list[str]]) -> list[str]:
    """The keyword arguments every reward gets: TRL's own and the first local source's extra columns."""
    extra = [c for c in (columns[0] if columns else []) if c not in NOT_PASSED]
    return [*REWARD_ARGUMENTS, *extra]


def reward_problems(cfg: RunConfig, python: str, names: list[str]) -> list[str]:
    """Each reward that does not import or cannot take ``names`` in ``python``, with its fix."""
    assert cfg.grpo is not None
    specs = [split_reward(r.function) for r in cfg.grpo.rewards]
    try:
        answers: Any = run_json(python, REWARD_CHECK, json.dumps([specs, names]))
    except NoAnswer as why:
        return [f"grpo.rewards: {python} could not check the reward functions ({why})"]
    problems = []
    for i, (reward, answer) in enumerate(zip(cfg.grpo.rewards, answers, strict=True)):
        where = f"grpo.rewards[{i}].function"
        if answer.get("error"):
            fix = ("check the path and that the file runs on its own (python FILE)" if specs[i][0].endswith(".py")
                   else "install it in that Python or put its folder on PYTHONPATH (cluster.env.PYTHONPATH)")
            problems.append(f"{where}: {reward.function!r} does not load in the job's Python {python} "
                            f"({answer['error']}); {fix}")
        elif (missing := _missing_column(answer.get("signature"))) is not None:
            problems.append(f"{where}: {reward.function!r} reads a column {missing!r}, which the prompt data does not "
                            f"have (its columns reach the rewards: {', '.join(names[len(REWARD_ARGUMENTS):]) or 'none'}"
                            f"); add it to the data (or map yours: data.datasets[].columns), or choose another reward")
        elif answer.get("signature"):
            problems.append(f"{where}: {reward.function!r} cannot take the arguments TRL's GRPOTrainer passes "
                            f"({', '.join(names)}): {answer['signature']}; give it these keyword parameters or end its "
                            "parameters with **kwargs (def f(completions, **kwargs) -> list[float])")
    return problems


def _missing_column(signature: str | None) -> str | None:
    """The data column a reward's required parameter names (``missing a required argument: 'answer'``), or None."""
    match = re.search(r"missing a required argument: '([^']+)'", signature or "")
    return match.group(1) if match and match.group(1) not in REWARD_ARGUMENTS else None


def rollouts_problem(cfg: RunConfig, python: str | None) -> str | None:
    """``rollouts: colocate``/``server``: vLLM is needed in the job's Python (colocate runs where it imports, or
    where that Python cannot be asked here: the job checks again); server is wired but unproven on a GPU (passed
    only with :data:`~slurmft.grpoopts.UNPROVEN_SERVER_ENV` = 1), and not with LoRA (colocate is)."""
    assert cfg.grpo is not None
    rollouts = cfg.grpo.rollouts
    if rollouts == Rollouts.TRANSFORMERS:
        return None
    has_vllm = None
    if python is not None:
        try:
            has_vllm = finds_modules(python, ["vllm"]).modules.get("vllm")
        except NoAnswer:
            has_vllm = None
    if has_vllm is False:
        return (f"grpo.rollouts: {rollouts.value} generates with vLLM, which the job's Python {python} cannot import; "
                "set grpo.rollouts=transformers (transformers' generate on the FSDP2-sharded policy: works on CPUs "
                "and GPUs without vLLM), or install vllm there")
    if rollouts == Rollouts.COLOCATE:  # LoRA too: the syncs merge the adapters (tests/job/test_grpo_vllm_cpu.py)
        return None
    if cfg.lora is not None:  # untested: the adapters' sync to a server (no GPU to run it)
        return ("grpo.rollouts: server with lora: is not supported yet (no test has synced adapters to a vLLM "
                "server); set grpo.rollouts=colocate (the syncs merge the adapters into the engine's weights) or "
                "grpo.rollouts=transformers, or drop the lora: section")
    if rollouts == Rollouts.SERVER and os.environ.get(UNPROVEN_SERVER_ENV) != "1":
        # rendered, checked on Slurm, wired into the job; never run on a GPU (TRL's weight sync is NCCL only)
        return ("grpo.rollouts: server renders (`slurmft render` writes the vLLM server's step and the training "
                "step on the other nodes) and its job side is wired (TRL's server mode, weight syncs under "
                "grpo.server.sync_timeout_s), but it has never run on a GPU (no GPU with vLLM was available to "
                "prove it), so slurmft does not submit it; set grpo.rollouts=transformers (transformers' generate "
                f"on the FSDP2-sharded policy). {UNPROVEN_SERVER_ENV}=1 lets it through for the prepared GPU check "
                "(bench/gpu_grpo_check.sh)")
    return None


def check_grpo(cfg: RunConfig, report: Any, columns: list[list[str]], job_python: bool = True) -> None:
    """The rewards and the rollouts in the job's Python (skipped, and said so, where it cannot be asked)."""
    python: str | None = cfg.cluster.job_python
    if not job_python or (not is_program_path(python) and cfg.cluster.setup):
        report.skipped.append("grpo.rewards: not imported here (the job's Python is in an image or comes from "
                              "cluster.setup); the job resolves them before loading the model")
        python = None
    else:
        python, where = locate(python)
        if where is not None:  # check_job_python reports it
            report.skipped.append(f"grpo.rewards: not checked ({in_words(python, where)})" if where != NOT_ON_PATH
                                  else "grpo.rewards: not checked (the job's Python is not on PATH here)")
            python = None
    if python is not None:
        report.problems += reward_problems(cfg, python, reward_names(columns))
    problem = rollouts_problem(cfg, python)
    if problem:
        report.problems.append(problem)
