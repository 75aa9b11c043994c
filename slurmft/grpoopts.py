"""GRPO's facts that both sides need, read without importing TRL (nor torch): the loss types the installed
``GRPOTrainer`` computes, how a reward function is named and found, and the metrics it logs.

TRL 1.16 checks ``GRPOConfig.loss_type`` nowhere: an unknown name runs generation and the rewards, then falls
through every branch of ``GRPOTrainer._compute_loss`` (a ``ValueError`` on every rank, after the first rollout).
The accepted names are those branches (``loss_type == "dapo"``, ``loss_type in ["grpo", ...]``), read from the
installed source as :mod:`slurmft.dpoopts` reads DPO's.

A reward is ``module:function`` (importable in the job's Python), ``/path/file.py:function`` (a file of the
user's; a relative path in run.yaml is made absolute against its folder), or the bare name of a built-in of
:mod:`slurmft.rewards`. :data:`REWARD_CHECK` resolves one exactly the way the job does and binds the arguments
TRL passes (``prompts``, ``completions``, ``completion_ids``, ``trainer_state``, ``log_extra``, ``log_metric`` and
every extra data column), in the job's Python: ``validate`` runs it there (slurmft/plan/grpo_checks.py), the job
imports :func:`load_reward` from here.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from slurmft.dpoopts import read_trl_file

GRPO_TRAINER_FILE = "trainer/grpo_trainer.py"  # trl.trainer.grpo_trainer, inside the trl package
_EQ_RE = re.compile(r"""loss_type\s*==\s*["']([A-Za-z0-9_]+)["']""")
_IN_RE = re.compile(r"""loss_type\s+in\s+[\[(]([^\])]*)[\])]""")
_NAME_RE = re.compile(r"""["']([A-Za-z0-9_]+)["']""")

#: the keyword arguments TRL 1.16's GRPOTrainer passes every reward function besides the data's extra columns
REWARD_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")
#: columns of a prompt row that are not passed to the rewards (TRL drops them before the call)
NOT_PASSED = ("prompt", "completion", "completion_ids")
BUILTIN_MODULE = "slurmft.rewards"

#: ``rollouts: server``: where the train step finds TRL's vLLM server, set in the batch shell from the allocation
#: (``python -m slurmft.job.rendezvous exports --vllm-server-node=N``) and by the template from the config
VLLM_HOST_ENV = "SLURMFT_VLLM_HOST"  # the server node's NodeAddr
VLLM_PORT_ENV = "SLURMFT_VLLM_PORT"  # its HTTP port (trl vllm-serve --port)
VLLM_GROUP_PORT_ENV = "SLURMFT_VLLM_GROUP_PORT"  # the weight-sync group's port, opened by training rank 0
VLLM_TIMEOUT_ENV = "SLURMFT_VLLM_SERVER_TIMEOUT"  # grpo.server.timeout_s
VLLM_SYNC_TIMEOUT_ENV = "SLURMFT_VLLM_SYNC_TIMEOUT"  # grpo.server.sync_timeout_s
VLLM_SERVER_ENV = (VLLM_HOST_ENV, VLLM_PORT_ENV, VLLM_GROUP_PORT_ENV)
#: ``=1`` lets ``validate`` pass ``rollouts: server``, which is wired but has never run on a GPU: the gate of the
#: prepared GPU check (bench/gpu_grpo_check.sh), not a user setting
UNPROVEN_SERVER_ENV = "SLURMFT_UNPROVEN_VLLM_SERVER"


def server_options(environ: dict[str, str]) -> dict[str, Any]:
    """The ``GRPOConfig`` arguments of ``rollouts: server`` from the train step's environment (the hook the job's
    GRPOConfig takes; TRL's names). A missing variable is a KeyError naming it: the batch script sets them all."""
    return {
        "use_vllm": True,
        "vllm_mode": "server",
        "vllm_server_host": environ[VLLM_HOST_ENV],
        "vllm_server_port": int(environ[VLLM_PORT_ENV]),
        "vllm_group_port": int(environ[VLLM_GROUP_PORT_ENV]),
        "vllm_server_timeout": float(environ[VLLM_TIMEOUT_ENV]),
    }


#: what GRPOTrainer logs that status, plot and the report show (besides the loss): the weighted reward's mean and
#: spread, the KL to the reference (beta > 0), the mean completion length and the clipped share
GRPO_METRICS = ("reward", "reward_std", "kl", "completions/mean_length", "clip_ratio/region_mean")
#: per reward function: ``rewards/<name>/mean`` (TRL's names)
REWARD_METRIC = re.compile(r"^rewards/[^/]+/mean$")


def reward_words(logs: dict[str, Any]) -> str | None:
    """``reward 0.1000 ± 0.1069`` for a step's log (TRL's log dict, or its metrics.jsonl record) that holds GRPO's
    reward, else None: the line a GRPO run's log prints per step, beside a loss that says nothing of how good the
    policy is (advantage-weighted, near 0 whatever the rewards). TRL logs the rewards only at the steps that
    generate, so the other steps' lines have none."""
    reward = logs.get("reward")
    if not isinstance(reward, int | float) or isinstance(reward, bool):
        return None
    spread = logs.get("reward_std")
    return f"reward {reward:.4f}" + (f" ± {spread:.4f}" if isinstance(spread, int | float) else "")


@functools.cache
def grpo_loss_types() -> tuple[tuple[str, ...] | None, str]:
    """(the loss types the installed GRPOTrainer computes; TRL's version), or (None, why not)."""
    source, trl_version = read_trl_file(GRPO_TRAINER_FILE)
    if source is None:
        return None, trl_version
    body = source[source.find("def _compute_loss"):] if "def _compute_loss" in source else source
    names = list(_EQ_RE.findall(body))
    for group in _IN_RE.findall(body):
        names += _NAME_RE.findall(group)
    found = tuple(dict.fromkeys(names))
    if not found:
        return None, f"no loss types found in TRL {trl_version}'s GRPOTrainer (a new layout?)"
    return found, trl_version


def loss_type_problem(name: str, where: str = "grpo.loss_type") -> str | None:
    """``grpo.loss_type`` against the installed TRL (None when TRL is absent here: the job checks)."""
    import difflib

    known, trl_version = grpo_loss_types()
    if known is None or name in known:
        return None
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"{where}: {name!r} is not a loss type of TRL {trl_version}'s GRPOTrainer; {hint}one of {', '.join(known)}"


def split_reward(spec: str) -> tuple[str, str]:
    """``(module or file, function)`` of a reward spec; a bare name is a built-in of :mod:`slurmft.rewards`."""
    where, sep, function = spec.rpartition(":")
    if not sep:
        return BUILTIN_MODULE, spec
    return where, function


# Runs in the job's Python (validate) and is imported by the job: resolve a reward and bind TRL's arguments.
# Self-contained (no slurmft import) so that ``validate`` can run it with ``python -c`` in any interpreter.
REWARD_CHECK = r'''
import importlib, importlib.util, inspect, json, sys

def load_reward(where, function):
    """The callable ``function`` of a module name or a .py file; raises with why not."""
    if where.endswith(".py"):
        spec = importlib.util.spec_from_file_location("slurmft_reward_" + str(abs(hash(where))), where)
        if spec is None or spec.loader is None:
            raise ImportError("cannot load " + where)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    found = getattr(module, function, None)
    if found is None:
        raise AttributeError(where + " has no " + repr(function))
    if not callable(found):
        raise TypeError(where + ":" + function + " is a " + type(found).__name__ + ", not a function")
    return found

def binding_problem(func, names):
    """Why TRL's call (every name in ``names`` as a keyword) cannot bind, or None."""
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(**{n: None for n in names})
    except TypeError as err:
        return str(err)
    return None

if __name__ == "__main__":
    answers = []
    specs, names = json.loads(sys.argv[1])
    for where, function in specs:
        try:
            func = load_reward(where, function)
        except BaseException as err:
            answers.append({"error": type(err).__name__ + ": " + str(err).strip().splitlines()[0][:300]
                            if str(err).strip() else type(err).__name__})
            continue
        answers.append({"signature": binding_problem(func, names)})
    print(json.dumps(answers))
'''


def _checker() -> dict[str, Any]:
    namespace: dict[str, Any] = {"__name__": "slurmft_reward_check"}
    exec(compile(REWARD_CHECK, "slurmft/grpoopts.py:REWARD_CHECK", "exec"), namespace)  # noqa: S102 - our own code
    return namespace


def load_reward(spec: str) -> Any:
    """The reward function ``spec`` names, resolved as ``validate`` resolved it (in the job)."""
    return _checker()["load_reward"](*split_reward(spec))


def binding_problem(func: Any, names: list[str]) -> str | None:
    """Why TRL's keyword call with ``names`` cannot bind to ``func``, or None."""
    return _checker()["binding_problem"](func, names)
