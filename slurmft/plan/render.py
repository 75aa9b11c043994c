"""Pure rendering: ``build_*_context(config) -> dict`` and ``render(name, context) -> str``.

Every value is validated in :mod:`slurmft.config` and quoted here with :func:`shlex.quote`, so a
template only places strings. Jinja runs with ``StrictUndefined``: a missing variable is an error,
never an empty string.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurmft import __version__
from slurmft.config import RunConfig
from slurmft.config_cluster import ConsolidateResources, PrepareResources
from slurmft.config_model_checks import ModelJobResources
from slurmft.errors import RenderError
from slurmft.grpoopts import VLLM_SERVER_ENV
from slurmft.plan.container import (
    Container,
    created_before_step,
    host_python,
    job_container,
    own_place_jobs,
    rebound,
    resolve,
    step_python,
    tool_python,
    wrap,
)
from slurmft.plan.grpo_layout import server_arguments, server_env, server_layout
from slurmft.profiles import ClusterProfile, runs_on_gpu
from slurmft.resources import data_dir
from slurmft.rundir import RunPaths

TRAIN_TEMPLATE = "train.sbatch.j2"
CONSOLIDATE_TEMPLATE = "consolidate.sbatch.j2"
PREPARE_TEMPLATE = "prepare.sbatch.j2"
#: A sweep's train or consolidation array: task i runs point i's own script (docs/sweeps.md).
ARRAY_TEMPLATE = "array.sbatch.j2"
#: The jobs after consolidation (the ``serve`` and ``eval`` sections), one template each.
MODEL_JOB_TEMPLATES = {"serve": "serve.sbatch.j2", "eval": "eval.sbatch.j2"}

# Always set, whatever the cluster: (name, value, reason)
BASE_ENV = (
    ("PYTHONUNBUFFERED", "1", "ranks' output reaches the log as it happens"),
    ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1", "a failed collective aborts the job instead of hanging it"),
    ("NCCL_DEBUG", "WARN", "NCCL problems are logged, without INFO noise"),
    ("HF_HUB_DISABLE_PROGRESS_BARS", "1", "no progress bars in job logs"),
)


def q(value: object) -> str:
    """Shell-quote one value."""
    return shlex.quote(str(value))


def submitit_command(python: str, folder: Path) -> str:
    """The command submitit runs per task (it unpickles our callable from ``folder``)."""
    return f"{python} -u -m submitit.core._submit {q(folder)}"


SUBMITIT_MODULE = "-m submitit.core._submit "


def launcher_command(command: str, signal_name: str) -> str:
    """submitit's per-task command with our launcher in its place (slurmft/job/launch.py).

    The launcher installs the flag-only handlers for the warning signal and SIGTERM before anything
    else and keeps submitit from replacing them; it then runs submitit's own job processing.
    """
    if SUBMITIT_MODULE not in command:
        raise RenderError(f"unexpected submitit command line {command!r}: expected {SUBMITIT_MODULE.strip()!r} in it")
    return command.replace(SUBMITIT_MODULE, f"-m slurmft.job.launch --signal={q(signal_name)} ", 1)


def python_for(cfg: RunConfig) -> str:
    """The batch shell's interpreter on the host (``container.host_python``), quoted for a script."""
    return q(host_python(cfg))


def rank_python_for(cfg: RunConfig, profile: ClusterProfile) -> str:
    """The ranks' interpreter (``container.rank_python``: the image's in a container), quoted for a script. It is
    the one submitit's per-task command starts, in the train, prepare and consolidation jobs alike."""
    return step_python_for(cfg, profile, "train")


def step_python_for(cfg: RunConfig, profile: ClusterProfile, kind: str) -> str:
    """The interpreter submitit's per-task command starts in job ``kind`` (``container.step_python``: the image's
    when the job runs in one, the serve and eval jobs' own image included), quoted for a script."""
    return q(step_python(cfg, profile, kind))


#: Set by the rendezvous lookup in the batch shell (partials/rendezvous.j2), passed into an image with the rest.
RENDEZVOUS_ENV = ("MASTER_ADDR", "MASTER_PORT")


def _in_container(cfg: RunConfig, container: Container | None, srun: list[str], command: str,
                  env: list[dict[str, str]], extra_names: tuple[str, ...] = (), gpus: bool = False) -> tuple[str, str]:
    """The step's quoted ``srun`` options and command: as given on the host, or wrapped in the run's image with
    every exported variable (``env``, ``extra_names``) passed in by name (and the GPUs, for a step that has them)."""
    if container is not None:
        names = [e["key"] for e in env] + list(extra_names)
        srun, command = wrap(container, srun, command, names, gpus, q, host_python=python_for(cfg),
                             warning_signal=cfg.preemption.signal.upper().removeprefix("SIG"),
                             exclusive=cfg.resources.exclusive)
    return " ".join(q(a) for a in srun), command


def _made_before_step(cfg: RunConfig, container: Container | None) -> list[dict[str, str]]:
    """The directories the batch script creates before the step (``container.created_before_step``), quoted, each
    with the line it prints when it cannot."""
    if container is None:
        return []
    return [{"path": q(d), "error": q(f"[slurmft] cannot create {d} ({what}), which the {container.runtime} image "
                                      "mounts: create it on the shared file system, or point HF_HOME (cluster.env) at "
                                      "a directory you may write there")}
            for d, what in created_before_step(cfg, container)]


def _flag(name: str, value: object = True) -> str:
    return f"--{name}" if value is True else f"--{name}={q(value)}"


def _env_list(cfg: RunConfig, profile: ClusterProfile, extra: dict[str, str],
              container: Container | None) -> list[dict[str, str]]:
    merged: dict[str, tuple[str, str]] = {k: (v, r) for k, v, r in BASE_ENV}
    merged["OMP_NUM_THREADS"] = (str(cfg.resources.cpus_per_task), "one OpenMP thread per reserved core")
    for key, var in profile.env.items():
        merged[key] = (var.value, f"{var.reason} [profile {profile.name}]")
    for key, value in cfg.cluster.env.items():
        merged[key] = (value, "cluster.env")
    for key, value in (container.env if container else {}).items():
        merged[key] = (value, f"{container.field}.env" if container else "")
    for key, value in extra.items():
        merged[key] = (value, "slurmft")
    return [{"key": k, "value": q(v), "reason": r.replace("\n", " ")} for k, (v, r) in merged.items()]


def _common(cfg: RunConfig, paths: RunPaths, job_kind: str, config_path: str) -> dict[str, Any]:
    return {
        "version": __version__,
        "run_name": cfg.name,
        "job_kind": job_kind,
        "config_path": config_path.replace("\n", " "),
        "resume_hint": f"slurmft resume {q(paths.root)}",
        "consolidate_hint": f"slurmft consolidate {q(paths.root)}",
        "python": python_for(cfg),
        "run_dir": q(paths.root),
        "setup": list(cfg.cluster.setup),
        "rendezvous_args": "",  # a GRPO server layout's train job asks for the server's address too
    }


def _allocation(cfg: RunConfig, profile: ClusterProfile, time: str | int) -> list[str]:
    """The run's allocation as ``#SBATCH`` flags (nodes, ranks, GPUs, CPUs, memory, time, where): the train
    job's, and the doctor's probe's, which must have the run's shape."""
    res = cfg.resources
    directives = [_flag("nodes", res.nodes), _flag("ntasks-per-node", res.ranks_per_node)]
    if res.gpus_per_node and profile.gres_gpu:
        directives.append(_flag("gpus-per-node", res.gpus_per_node))
    directives.append(_flag("cpus-per-task", res.cpus_per_task))
    if res.mem is not None:
        directives.append(_flag("mem", res.mem))
    directives.append(_flag("time", time))
    for name in ("partition", "account", "qos", "constraint"):
        value = getattr(cfg.cluster, name)
        if value:
            directives.append(_flag(name, value))
    return directives


def _rank_step(cfg: RunConfig, profile: ClusterProfile) -> list[str]:
    """The ``srun`` options that start one process per rank, as the train job and the probe start them."""
    res = cfg.resources
    srun = ["--unbuffered", "--label", f"--ntasks-per-node={res.ranks_per_node}",
            # Since Slurm 22.05 a step no longer inherits the job's --cpus-per-task: without it a rank may
            # be pinned to one core while OMP_NUM_THREADS says cpus_per_task.
            f"--cpus-per-task={res.cpus_per_task}"]
    if res.gpus_per_node and profile.gres_gpu:
        # One rule for every site: each rank sees all of its node's GPUs and takes cuda:LOCAL_RANK, whatever
        # binding the site defaults to (--gpus-per-task, SLURM_GPU_BIND); NCCL then sees the whole node too.
        srun.append("--gpu-bind=none")
    return srun


def build_train_context(
    cfg: RunConfig, profile: ClusterProfile, paths: RunPaths, command: str, config_path: str = ""
) -> dict[str, Any]:
    """Everything the train template places, already quoted."""
    res = cfg.resources
    directives = [_flag("job-name", f"{cfg.name}-train"), _flag("comment", paths.job_tag),
                  *_allocation(cfg, profile, cfg.cluster.time)]
    if res.exclusive:
        directives.append(_flag("exclusive"))
    directives += [
        _flag("requeue"),
        _flag("signal", f"{cfg.preemption.signal}@{cfg.preemption.lead_time_s}"),
        _flag("open-mode", "append"),
        _flag("output", paths.log_pattern("train")),
        _flag("error", paths.log_pattern("train")),
    ]
    extra = {"SUBMITIT_EXECUTOR": "slurm", "SLURMFT_RUN_DIR": str(paths.root)}
    if cfg.cluster.master_addr:
        extra["SLURMFT_MASTER_ADDR"] = cfg.cluster.master_addr
    layout = server_layout(cfg)
    extra |= server_env(cfg) if layout else {}
    srun = ["--kill-on-bad-exit=1", *_rank_step(cfg, profile), *(layout.train_options() if layout else [])]
    container = resolve(cfg, profile)
    env = _env_list(cfg, profile, extra, container)
    step_env = RENDEZVOUS_ENV + (VLLM_SERVER_ENV if layout else ())
    gpus = runs_on_gpu(cfg, profile)
    srun_args, rank_command = _in_container(cfg, container, srun, launcher_command(command, cfg.preemption.signal),
                                            env, step_env, gpus)
    context = {
        **_common(cfg, paths, "train", config_path),
        "directives": directives,
        "env": env,
        "make_dirs": _made_before_step(cfg, container),
        "srun_args": srun_args,
        "command": rank_command,
        "warning_signal": q(cfg.preemption.signal.upper().removeprefix("SIG")),
        "server": None,
    }
    if layout is not None:  # grpo.rollouts: server (slurmft/plan/grpo_layout.py)
        signal = cfg.preemption.signal.upper().removeprefix("SIG")
        serve = (f"{rank_python_for(cfg, profile)} -m slurmft.job.vllm_server --signal={signal} -- "
                 + " ".join(q(a) for a in server_arguments(cfg, layout)))
        server_srun, serve = _in_container(cfg, container, layout.server_options(gpus and profile.gres_gpu), serve,
                                           env, step_env, gpus)
        context["rendezvous_args"] = f" --vllm-server-node={layout.server_node}"
        context["server"] = {"srun_args": server_srun, "command": serve, "node": layout.server_node,
                             "train_nodes": layout.train_nodes, "train_ranks": layout.train_world_size,
                             "timeout_s": cfg.grpo.server.timeout_s if cfg.grpo else 0}
    return context


def build_consolidate_context(
    cfg: RunConfig, profile: ClusterProfile, paths: RunPaths, command: str, config_path: str = ""
) -> dict[str, Any]:
    """Everything the consolidation template places, already quoted. One CPU task (``consolidate.resources``)."""
    return _cpu_job_context(cfg, profile, paths, command, config_path, "consolidate", cfg.consolidate.resources)


def build_prepare_context(
    cfg: RunConfig, profile: ClusterProfile, paths: RunPaths, command: str, config_path: str = ""
) -> dict[str, Any]:
    """Everything the prepare template places, already quoted: one task on CPUs (``prepare.resources``), no
    GPU gres, no collective settings; with ``prepare.tasks`` > 1 an array of such tasks (slurmft/job/prepare_array.py),
    task k logging into ``prepare-<array>_<k>.out``, the id slurmft records it by."""
    ctx = _cpu_job_context(cfg, profile, paths, command, config_path, "prepare", cfg.prepare.resources)
    if cfg.prepare.tasks > 1:
        log = array_log_pattern(paths, "prepare")
        ctx["directives"] = [*(d for d in ctx["directives"] if not d.startswith(("--output", "--error"))),
                             _flag("array", f"0-{cfg.prepare.tasks - 1}"), _flag("output", log), _flag("error", log)]
    return ctx


def one_prepare_job(cfg: RunConfig) -> Any:
    """``cfg.prepare`` as one job: a sweep's shared prepare job prepares every point's set, one after another."""
    return cfg.prepare.model_copy(update={"tasks": 1})


def build_model_job_context(
    cfg: RunConfig, profile: ClusterProfile, paths: RunPaths, command: str, kind: str, config_path: str = ""
) -> dict[str, Any]:
    """Everything a job after consolidation places (``kind``: serve or eval), already quoted: one task with the
    section's resources, its GPUs (``resources.gpus``) when the profile has GPU gres."""
    section = cfg.model_job(kind)
    if section is None:
        raise RenderError(f"no {kind} section: there is no {kind} job to render")
    res = section.resources
    return _cpu_job_context(cfg, profile, paths, command, config_path, kind, res,
                            gpus=res.gpus if profile.gres_gpu else 0)


def _cpu_job_context(cfg: RunConfig, profile: ClusterProfile, paths: RunPaths, command: str, config_path: str,
                     kind: str, res: ConsolidateResources | PrepareResources | ModelJobResources,
                     gpus: int = 0) -> dict[str, Any]:
    """One task on one node's CPUs with ``res`` (partition: the train job's unless ``res`` names one), no GPU gres
    unless ``gpus``, the collective (NCCL/EFA) variables left out and OMP_NUM_THREADS set to its CPUs."""
    directives = [
        _flag("job-name", f"{cfg.name}-{kind}"),
        _flag("comment", paths.job_tag),
        _flag("nodes", 1),
        _flag("ntasks-per-node", 1),
        _flag("cpus-per-task", res.cpus_per_task),
    ]
    if gpus:
        directives.append(_flag("gpus-per-node", gpus))
    if res.mem is not None:
        directives.append(_flag("mem", res.mem))
    directives.append(_flag("time", res.time))
    partition = res.partition or cfg.cluster.partition
    if partition:
        directives.append(_flag("partition", partition))
    if cfg.cluster.account:
        directives.append(_flag("account", cfg.cluster.account))
    if cfg.cluster.qos:
        directives.append(_flag("qos", cfg.cluster.qos))
    directives += [
        _flag("open-mode", "append"),
        _flag("output", paths.log_pattern(kind)),
        _flag("error", paths.log_pattern(kind)),
    ]
    extra = {"SUBMITIT_EXECUTOR": "slurm", "SLURMFT_RUN_DIR": str(paths.root)}
    container = job_container(cfg, profile, kind)  # a serve or eval job may have an image of its own
    env = [e for e in _env_list(cfg, profile, extra, container)
           if not e["key"].startswith(("NCCL_", "FI_", "TORCH_NCCL"))]
    for e in env:
        if e["key"] == "OMP_NUM_THREADS":
            e["value"] = q(res.cpus_per_task)
    srun = ["--unbuffered", "--ntasks=1", f"--cpus-per-task={res.cpus_per_task}"]
    if gpus:
        srun.append("--gpu-bind=none")
    srun_args, task_command = _in_container(cfg, container, srun, command, env, gpus=bool(gpus))
    return {
        **_common(cfg, paths, kind, config_path),
        "directives": directives,
        "env": env,
        "make_dirs": _made_before_step(cfg, container),
        "srun_args": srun_args,
        "command": task_command,
    }


def array_log_pattern(paths: RunPaths, kind: str) -> Path:
    """Slurm ``--output`` of a sweep's array job in the sweep directory (%A = the array's id, %a = the task): what
    a task prints before it hands over to its point's script, which appends to the point's own log."""
    return paths.logs / f"{kind}-%A_%a.out"


def build_array_context(cfg: RunConfig, profile: ClusterProfile, sweep: RunPaths, kind: str, run_dirs: list[Path],
                        parallel: int | None = None, config_path: str = "") -> dict[str, Any]:
    """A sweep's ``train``, ``consolidate``, ``serve`` or ``eval`` array (``--array=0-(N-1)%P``): the allocation of
    one point's job (``cfg``: every point has the same, slurmft.sweep.FIXED) and, per task, the point whose script
    it runs."""
    if kind in MODEL_JOB_TEMPLATES:
        command = submitit_command(step_python_for(cfg, profile, kind), sweep.submitit)
        single = build_model_job_context(cfg, profile, sweep, command, kind, config_path)
    else:
        build = build_train_context if kind == "train" else build_consolidate_context
        single = build(cfg, profile, sweep, submitit_command(rank_python_for(cfg, profile), sweep.submitit), config_path)
    n = len(run_dirs)
    directives = [d for d in single["directives"] if not d.startswith(("--output", "--error"))]
    directives += [_flag("array", f"0-{n - 1}%{min(n, parallel or n)}"),
                   _flag("output", array_log_pattern(sweep, kind)), _flag("error", array_log_pattern(sweep, kind))]
    return {
        **_common(cfg, sweep, kind, config_path),
        "directives": directives,
        "points": [{"index": i, "run_dir": q(d)} for i, d in enumerate(run_dirs)],
        "script": q(RunPaths.of(run_dirs[0]).script(kind).name),
    }


def render_sweep_arrays(sweep: Any, profile: ClusterProfile, config_path: str = "",
                        template_dir: str | Path | None = None) -> dict[str, str]:
    """A sweep's prepare script (one job for every point), train array script, consolidation array's and those of
    the jobs after it (serve, eval), named after the sweep, with the allocation of its first point (every point has
    the same: slurmft.sweep.FIXED, slurmft.submit.sweep.check_one_allocation)."""
    first = sweep.configs[0].model_copy(update={"name": sweep.cfg.name, "prepare": one_prepare_job(sweep.configs[0])})
    dirs = [Path(c.output_dir) for c in sweep.configs]
    root = RunPaths.of(sweep.cfg.output_dir)
    kinds = ["train", *(["consolidate"] if first.consolidate.enabled else []),
             *(k for k in MODEL_JOB_TEMPLATES if model_job_enabled(first, k))]
    scripts = {}
    if first.prepare.enabled:  # one prepare job for the sweep (not an array)
        command = submitit_command(rank_python_for(first, profile), root.submitit)
        scripts["prepare"] = render(PREPARE_TEMPLATE, build_prepare_context(first, profile, root, command, config_path),
                                    template_dir)
    return scripts | {kind: render(ARRAY_TEMPLATE, build_array_context(
        first, profile, root, kind, dirs, sweep.cfg.sweep.parallel, config_path), template_dir) for kind in kinds}


def template_env(template_dir: str | Path | None = None) -> Any:
    """A Jinja environment over the user's template dir (if any) first, then the shipped templates."""
    import jinja2

    search = [str(template_dir)] if template_dir else []
    search.append(str(data_dir("templates")))
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(search),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


def render(template: str, context: dict[str, Any], template_dir: str | Path | None = None, env: Any = None) -> str:
    """Render one template; a missing template or variable is a RenderError. ``env``: the :func:`template_env` of
    ``template_dir`` to render in (one environment compiles the partials the scripts share once, not per script)."""
    import jinja2

    try:
        text = (env or template_env(template_dir)).get_template(template).render(**context)
    except jinja2.TemplateNotFound as exc:
        raise RenderError(f"template {exc.name!r} not found (looked in {template_dir or 'shipped templates'})") from None
    except jinja2.UndefinedError as exc:
        raise RenderError(f"template {template!r} uses an undefined variable: {exc.message}") from None
    except jinja2.TemplateSyntaxError as exc:
        raise RenderError(f"template {exc.filename or template}:{exc.lineno}: {exc.message}") from None
    if "{{" in text or "{%" in text:
        raise RenderError(f"template {template!r} left unrendered Jinja markers in its output")
    return text


def render_scripts(
    cfg: RunConfig, profile: ClusterProfile, paths: RunPaths, config_path: str = "",
    template_dir: str | Path | None = None,
) -> dict[str, str]:
    """Render the job scripts (prepare, train, consolidate) exactly as ``submit`` will write them."""
    command = submitit_command(rank_python_for(cfg, profile), paths.submitit)
    env = template_env(template_dir)
    scripts = {}
    if cfg.prepare.enabled:
        ctx = build_prepare_context(cfg, profile, paths, command, config_path)
        scripts["prepare"] = render(PREPARE_TEMPLATE, ctx, template_dir, env)
    scripts["train"] = render(TRAIN_TEMPLATE, build_train_context(cfg, profile, paths, command, config_path),
                              template_dir, env)
    if cfg.consolidate.enabled:
        ctx = build_consolidate_context(cfg, profile, paths, command, config_path)
        scripts["consolidate"] = render(CONSOLIDATE_TEMPLATE, ctx, template_dir, env)
    for kind, template in MODEL_JOB_TEMPLATES.items():
        if model_job_enabled(cfg, kind):
            own = submitit_command(step_python_for(cfg, profile, kind), paths.submitit)  # its image's, if its own
            ctx = build_model_job_context(cfg, profile, paths, own, kind, config_path)
            scripts[kind] = render(template, ctx, template_dir, env)
    return scripts


def model_job_enabled(cfg: RunConfig, kind: str) -> bool:
    """A job after consolidation is chained when its section is there (and there is a consolidation to follow)."""
    return cfg.consolidate.enabled and cfg.model_job(kind) is not None


# ------------------------------------------------------------------ the doctor's probe job
PROBE_TEMPLATE = "probe.sbatch.j2"
_SIGNAL_DIRECTIVE = re.compile(r"^#SBATCH\s+(--signal[= ]\S+)", re.MULTILINE)


@dataclass(frozen=True)
class SignalDirective:
    """The ``--signal`` a rendered train script asks Slurm for, as written (the last one wins in sbatch)."""

    text: str  # the directive itself, already quoted as the script has it
    batch_only: bool  # ``B:``: Slurm signals the batch shell only, never the ranks
    name: str  # USR2
    lead_s: int


def signal_directive(train_script: str) -> SignalDirective | None:
    """The train script's ``#SBATCH --signal=[{R|B}:]SIG[@TIME]`` (None when it has none)."""
    found = _SIGNAL_DIRECTIVE.findall(train_script)
    if not found:
        return None
    text = found[-1]
    value = shlex.split(text.replace("--signal", "", 1).lstrip("= "))[0]
    flags, _, rest = value.rpartition(":")
    name, _, lead = rest.partition("@")
    return SignalDirective(text, "B" in flags.upper(), name.upper().removeprefix("SIG"), int(lead or 60))


def build_probe_context(
    cfg: RunConfig, profile: ClusterProfile, probe_root: Path, signal: SignalDirective, run_dir_target: Path,
    config_path: str = "",
) -> dict[str, Any]:
    """Everything the probe template places, already quoted: the run's nodes, ranks, GPUs, profile
    variables, setup and Python, the train script's own ``--signal``, and a time limit a few minutes past
    its lead time (the probe shortens it once its ranks are ready; slurmft/job/probe.py)."""
    from slurmft.probe_paths import ProbePaths

    probe = ProbePaths(probe_root)
    directives = [_flag("job-name", f"{cfg.name}-doctor"), *_allocation(cfg, profile, signal.lead_s // 60 + 3),
                  signal.text, _flag("output", probe.log), _flag("error", probe.log)]
    env_keys = [*profile.env, *cfg.cluster.env]
    extra = {"SLURMFT_MASTER_ADDR": cfg.cluster.master_addr} if cfg.cluster.master_addr else {}
    python = python_for(cfg)
    run_container = resolve(cfg, profile)
    own_place = own_place_jobs(cfg, profile)
    rank = [f"--signal={signal.name}", f"--run-dir={run_dir_target}", f"--vars={','.join(env_keys)}"]
    rank += [f"--{kind}-python={tool_python(cfg, profile, kind)}" for kind in MODEL_JOB_TEMPLATES
             if cfg.model_job(kind) and kind not in own_place]
    paths = RunPaths.of(cfg.output_dir)

    def bound(container: Container | None) -> Container | None:
        # the run dir may not exist yet: its nearest existing parent, and the probe's own dir
        return container and rebound(container, cfg.output_dir, [str(run_dir_target), str(probe.root)])

    env = _env_list(cfg, profile, extra, run_container)
    container = bound(run_container)
    rank_command = (f"{rank_python_for(cfg, profile)} -m slurmft.job.probe rank {q(probe.root)} "
                    + " ".join(q(a) for a in rank))
    srun_args, rank_command = _in_container(cfg, container, _rank_step(cfg, profile), rank_command, env, RENDEZVOUS_ENV,
                                            runs_on_gpu(cfg, profile))
    make_dirs = _made_before_step(cfg, container)
    tool_steps = []
    for kind, place in own_place.items():  # a serve/eval job in a place of its own: one task per node asks there
        place = bound(place)
        command = (f"{step_python_for(cfg, profile, kind)} -m slurmft.job.probe tool {q(probe.root)} "
                   f"--kind={kind} --python={q(tool_python(cfg, profile, kind))}")
        step_env = _env_list(cfg, profile, extra, place)
        args, command = _in_container(cfg, place, ["--unbuffered", "--ntasks-per-node=1", "--cpus-per-task=1"],
                                      command, step_env)
        tool_steps.append({"kind": kind, "srun_args": args, "command": command})
        make_dirs += [d for d in _made_before_step(cfg, place) if d not in make_dirs]
    return {
        **_common(cfg, paths, "doctor probe", config_path),
        "directives": directives,
        "env": env,
        "make_dirs": make_dirs,
        "tool_steps": tool_steps,
        "srun_args": srun_args,
        "rank_command": rank_command,
        "batch_command": f"{python} -m slurmft.job.probe batch {q(probe.root)} --lead={signal.lead_s}",
        "batch_signal_file": q(probe.batch_signal),
        "warning_signal": q(signal.name),
    }
