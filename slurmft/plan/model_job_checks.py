"""Login-side checks of the jobs after consolidation: their interpreters import what they need (no torch here).

vLLM and lm-eval live in interpreters of their own (``serve.python``, ``eval.python``; default the job's). One
child process per interpreter asks ``importlib.util.find_spec`` (slurmft.interpreter: milliseconds, nothing
is imported), so a missing package is refused at ``validate``/``submit`` with the fix, not found by the job after
training.
"""

from __future__ import annotations

from collections.abc import Callable

from slurmft.config import RunConfig
from slurmft.config_loading import format_loc, parse_override
from slurmft.config_model_checks import MODEL_JOB_TOOLS
from slurmft.errors import ConfigError
from slurmft.eval_tasks import resolve_tasks
from slurmft.interpreter import MISSING, NOT_ON_PATH, NoAnswer, finds_modules, in_words, locate
from slurmft.profiles import ClusterProfile

VLLM = MODEL_JOB_TOOLS["serve"]
#: What a serve or eval job's batch script reads of the run's cluster section besides its own section
#: (slurmft/plan/render.py ``_cpu_job_context``: the partition, account and QOS it is queued under, the profile's and
#: the run's environment, setup lines and Python, the image it runs in): where and how that job runs, never what was
#: trained, so ``slurmft serve|eval RUN_DIR KEY=VALUE`` may change them. cluster.time, constraint and master_addr
#: are the train job's alone.
MODEL_JOB_CLUSTER_KEYS = ("cluster.profile", "cluster.partition", "cluster.account", "cluster.qos", "cluster.env",
                          "cluster.setup", "cluster.python", "cluster.container")


def check_model_job_overrides(kind: str, overrides: list[str], run_dir: str) -> None:
    """Refuse the ``key=value`` overrides the ``kind`` job (serve or eval) does not read, each with its fix: the other
    job's section goes to the other command, anything else would not change the trained model (``model/`` stays
    what the run trained) and belongs to a new run."""
    other = "eval" if kind == "serve" else "serve"
    allowed = (kind, *MODEL_JOB_CLUSTER_KEYS)
    problems = []
    for text in overrides:
        key = format_loc(tuple(parse_override(text)[0]))
        if any(key == k or key.startswith((k + ".", k + "[")) for k in allowed):
            continue
        if key == other or key.startswith(other + "."):
            problems.append(f"{key}: the {kind} job does not read it; it is the {other} job's: "
                            f"`slurmft {other} {run_dir} {text}`")
        else:
            problems.append(f"{key}: the {kind} job does not read it, and it would not change the trained model "
                            f"({run_dir}/model stays as the run trained it): to train differently, `slurmft submit` "
                            "a new run (another output_dir)")
    if problems:
        accepted = ", ".join([f"{kind}.*", *(k + (".*" if k in ("cluster.env", "cluster.container") else "")
                                               for k in MODEL_JOB_CLUSTER_KEYS)])
        raise ConfigError(f"slurmft {kind} {run_dir}: {len(problems)} override(s) it cannot take; it takes {accepted}",
                          problems)


def interpreter(python: str | None, cfg: RunConfig, kind: str) -> tuple[str, str]:
    """The interpreter a section runs on the host (:meth:`RunConfig.model_job_python`; the job's step there runs
    cluster.python) and how to name it in a message."""
    return cfg.model_job_python(kind, cfg.cluster.job_python), "" if python else " (not set: the job's Python)"


def check_model_job(cfg: RunConfig, kind: str, say: Callable[[str], None] | None = None,
                    own: dict[str, str] | None = None) -> tuple[list[str], list[str]]:
    """``(problems, not checked here)`` of the ``kind`` section where its job runs. On the host its interpreter is
    asked here (:func:`check_serve`, :func:`slurmft.plan.eval_checks.check_eval`); in an image (its own
    ``container``, or the run's) the login node cannot run the image's Python: its own image's file and HF_HOME are
    checked, eval's task files read, and the interpreter is left to ``slurmft doctor --job``, which asks it there."""
    from slurmft.plan.container import hf_home_problems, image_problems, job_container, tool_python
    from slurmft.plan.eval_checks import check_eval
    from slurmft.profiles import load_profile

    section = cfg.model_job(kind)
    if section is None:
        return [], []
    try:
        profile = load_profile(cfg.cluster.profile)
    except Exception:  # noqa: BLE001 - render/submit report a bad profile with its own message
        profile = None
    try:
        container = job_container(cfg, profile, kind) if profile is not None else None
    except ConfigError as exc:  # the run's own container's problems are check_container's to report
        return (exc.problems or [str(exc)]) if section.container else [], []
    if container is None or profile is None:
        problems = check_serve(cfg) if kind == "serve" else check_eval(cfg, say, own)
        if section.container is False and profile is not None:
            problems += _host_step_problems(cfg, kind, profile)
        return problems, []
    problems = []
    if container.field != "cluster.container":  # the run's image is check_container's
        problems += image_problems(container) + hf_home_problems(cfg, container)
    if kind == "eval":
        assert cfg.eval is not None
        problems += resolve_tasks(cfg.eval.tasks).problems
    python = tool_python(cfg, profile, kind)
    tool = MODEL_JOB_TOOLS[kind]
    names = " (and the task names in lm-eval's registry)" if kind == "eval" else ""
    skipped = [f"{kind}.python: {python} in the {container.runtime} image {container.image} ({container.field}) and "
               f"{tool.name} there{names} are checked by `slurmft doctor --job`, which asks it in the image on the "
               "nodes, not here"]
    return problems, skipped


def _host_step_problems(cfg: RunConfig, kind: str, profile: ClusterProfile) -> list[str]:
    """``container: false`` beside ranks in an image: the job's slurmft runs cluster.python on the host, which the
    run otherwise needs for the batch script alone (slurmft, no training stack): it must import what the job does."""
    from slurmft.plan.container import resolve

    try:
        if resolve(cfg, profile) is None:
            return []  # the ranks run on the host too: check_job_python asks cluster.python for the training stack
    except ConfigError:
        return []
    needs = MODEL_JOB_TOOLS[kind].step_needs
    python, where = locate(cfg.cluster.job_python)
    if where is not None:
        return []  # check_job_python says what is wrong with cluster.python
    try:
        found = finds_modules(python, needs).modules
    except NoAnswer:
        return []
    missing = [m for m in needs if not found[m]]
    if not missing:
        return []
    return [f"{kind}.container: false runs the {kind} job's slurmft on the host with cluster.python ({python}), which "
            f"cannot import {', '.join(missing)}"
            + (" (the serve check compares vLLM with transformers there)" if kind == "serve" else "")
            + f"; install slurmft{'[train]' if kind == 'serve' else ''} there, or remove {kind}.container (the job then "
            "runs in the ranks' image)"]


def check_serve(cfg: RunConfig) -> list[str]:
    """``serve``: its Python finds vLLM (and peft-free LoRA serving needs nothing more)."""
    if cfg.serve is None:
        return []
    python, how = interpreter(cfg.serve.python, cfg, "serve")
    path, where = locate(python)
    why = None
    if where == NOT_ON_PATH:
        why = in_words(path, where)
    elif where == MISSING:
        why = f"{in_words(path, where)} (the compute nodes need it at the same path)"
    else:
        try:  # a file that may not be run (NOT_EXECUTABLE) answers nothing either
            found = finds_modules(path, (VLLM.module,)).modules
        except NoAnswer:
            why = f"{path} does not run (or is not a Python)"
    if why:
        return [f"serve.python{how}: {why}; set serve.python to the interpreter of a venv with vLLM installed"]
    if not found[VLLM.module]:
        return [f"serve.python{how}: {python} cannot import vllm: the serve check would fail after training; install "
                f"it in its own venv ({VLLM.install}) and set serve.python to its bin/python"]
    return []
