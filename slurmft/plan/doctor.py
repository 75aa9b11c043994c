"""``slurmft doctor``: can this run survive on this cluster? The verdicts, as pure functions of what Slurm
said (:class:`slurmft.slurm.ClusterFacts`) and of the run (:class:`RunFacts`).

Why: docs/preemption.md tells a site what Slurm must be set to for a run to survive a preemption
(KillWait and GraceTime at least one save plus a step, ``job_comment`` in accounting, the warning
signal sent at preemption...), and nothing checked it. A user found out after the queue wait, or at
the first preemption, when a save that takes minutes was SIGKILLed after the default 30 s KillWait and
the run silently lost ``checkpoint.every_steps`` steps. Here every fact becomes one :class:`Line`:
ok, warning or problem, in words, with the fix. The facts are gathered by the one Slurm adapter
(``slurm.cluster_facts``), the save time is the estimate's own figure (``communication.projected_save``
through ``estimate()['checkpoint_save_s']``), and this module only decides, so every decision is
tested on recorded ``scontrol`` output of two Slurm versions without a cluster.

Slurm's timing, from slurm.conf(5): a preempted job gets SIGTERM (or, with
``PreemptParameters=send_user_signal`` / ``SlurmctldParameters=preempt_send_user_signal``, the job's
``--signal`` first) at once, its end moved ``GraceTime`` ahead, then the end sequence SIGTERM, KillWait,
SIGKILL: ``GraceTime + KillWait`` seconds from the first signal to SIGKILL. ``scancel``, ``scontrol
requeue`` and a time limit the warning signal missed give ``KillWait``. A field Slurm does not print
(older or newer versions) is "not reported by this Slurm", never a guess.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from slurmft import __version__
from slurmft.config import RunConfig
from slurmft.config_model_checks import MODEL_JOB_TOOLS
from slurmft.config_values import slurm_time_seconds
from slurmft.plan.container import own_place_jobs, tool_python
from slurmft.plan.estimate_text import lead_time_needed, lead_time_warning, stop_save_s
from slurmft.profiles import ClusterProfile
from slurmft.slurm import UNSET, ClusterFacts, option, seconds

NOT_REPORTED = "not reported by this Slurm"
#: Seconds allowed for the step in flight when a signal lands (the ranks save at the next step boundary).
STEP_ALLOWANCE_S = 30
#: Slurm's default credential lifetime, which is also how long a requeued job waits (slurm.conf(5) cred_expire).
DEFAULT_CRED_EXPIRE_S = 120


class Level(StrEnum):
    OK = "ok"
    WARNING = "warning"
    PROBLEM = "problem"


@dataclass(frozen=True)
class Line:
    """One answer of the doctor: which check, how bad, what was found, and the fix in words."""

    check: str
    level: Level
    text: str
    fix: str = ""

    def as_dict(self) -> dict[str, str]:
        return {**asdict(self), "level": self.level.value}


@dataclass(frozen=True)
class RunFacts:
    """What the checks read of a run config (None when doctor runs without one)."""

    partition: str | None
    time_s: int
    gpus_per_node: int
    requests_gpus: bool  # the profile asks Slurm for GPUs (gres_gpu) and the run wants some
    lead_time_s: int
    every_steps: int
    save_s: float | None  # the estimate's projected save time; None when there is no estimate
    save_why: str = ""  # why there is none
    lead_warning: str | None = None  # estimate_text.lead_time_warning: the lead time is below the save
    asynchronous: bool = False  # checkpoint.async: a stop may first finish a save in flight (two saves' time)
    cpu_ram_bytes: int | None = None  # the estimate's CPU RAM of node 0: the larger of loading and training
    cpu_ram_without_staging: int | None = None  # the same without the asynchronous saves' staging copy


def run_facts(cfg: RunConfig, profile: ClusterProfile, estimate: dict[str, Any] | None, why: str = "") -> RunFacts:
    """The run's side of the checks; ``estimate`` is ``slurmft.plan.estimate.estimate(cfg, profile)``."""
    return RunFacts(
        partition=cfg.cluster.partition,
        time_s=slurm_time_seconds(cfg.cluster.time),
        gpus_per_node=cfg.resources.gpus_per_node,
        requests_gpus=bool(cfg.resources.gpus_per_node and profile.gres_gpu),
        lead_time_s=cfg.preemption.lead_time_s,
        every_steps=cfg.checkpoint.every_steps,
        save_s=None if estimate is None else float(estimate["checkpoint_save_s"]),
        save_why=why,
        lead_warning=None if estimate is None else lead_time_warning(estimate),
        asynchronous=cfg.checkpoint.asynchronous,
        cpu_ram_bytes=None if estimate is None else max(estimate["cpu_ram_per_node"]["slurmft"],
                                                        estimate["cpu_ram_per_node"]["training"]),
        cpu_ram_without_staging=None if estimate is None else max(
            estimate["cpu_ram_per_node"]["slurmft"],
            estimate["cpu_ram_per_node"]["training"] - estimate["cpu_ram_per_node"].get("async_staging", 0)),
    )


def needed_s(save_s: float) -> int:
    """Seconds to ask for: the save plus the step in flight, rounded up to 30 s. (A window shorter than the
    save itself is a problem; this is the fix's figure, with room for the step.)"""
    return int(math.ceil((save_s + STEP_ALLOWANCE_S) / 30.0) * 30)


def _secs(value: float) -> str:
    """Seconds as a reader wants them: 0.03 s, 8.5 s, 85 s."""
    return f"{value:.2g} s" if value < 10 else f"{value:.0f} s"


def _value(fields: dict[str, str] | None, key: str) -> str | None:
    """A field as Slurm printed it; None when it is not printed at all."""
    return None if fields is None else fields.get(key)


# ------------------------------------------------------------------ Slurm itself
def check_versions(facts: ClusterFacts) -> list[Line]:
    if facts.config is None:
        return [Line("slurm", Level.PROBLEM, f"scontrol show config failed: {facts.config_problem}",
                     "run doctor on a login node of the cluster (scontrol on PATH, SLURM_CONF or configless set up)")]
    ctld = facts.config.get("SLURM_VERSION")
    client = facts.client_version
    text = f"client commands {client or NOT_REPORTED}, slurmctld {ctld or NOT_REPORTED}"
    if client and ctld and _version(client) > _version(ctld):
        return [Line("slurm", Level.WARNING, text + ": the client commands are newer than slurmctld",
                     "use the client commands of the controller's version (Slurm supports older clients, not newer)")]
    return [Line("slurm", Level.OK, text)]


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split("-")[0].split(".") if p.isdigit())


def check_accounting(facts: ClusterFacts) -> list[Line]:
    cfg = facts.config
    lines = []
    storage = _value(cfg, "AccountingStorageType")
    if facts.accounting_problem is not None or storage == "accounting_storage/none":
        why = facts.accounting_problem or "AccountingStorageType=accounting_storage/none"
        lines.append(Line("accounting", Level.PROBLEM, f"sacct does not answer ({why})",
                          "ask for accounting (slurmdbd): without it a job that left squeue has no final state "
                          "and `slurmft status` shows it as unknown"))
    else:
        lines.append(Line("accounting", Level.OK, f"sacct answers ({storage or NOT_REPORTED})"))
    flags = _value(cfg, "AccountingStoreFlags")
    legacy = _value(cfg, "AccountingStoreJobComment")  # before 21.08
    if cfg is None:
        pass
    elif flags is None and legacy is None:
        lines.append(Line("job_comment", Level.WARNING, f"AccountingStoreFlags: {NOT_REPORTED}",
                          "ask the admin whether AccountingStoreFlags includes job_comment"))
    elif "job_comment" in (flags or "").split(",") or (legacy or "").lower() == "yes":
        lines.append(Line("job_comment", Level.OK, "accounting keeps job comments (slurmft's run tag)"))
    else:
        lines.append(Line("job_comment", Level.PROBLEM,
                          f"AccountingStoreFlags={flags if flags is not None else '(legacy ' + str(legacy) + ')'}: "
                          "accounting drops --comment, so a tagged job that left squeue cannot be found "
                          "after a killed submit",
                          "ask the admin for AccountingStoreFlags=job_comment in slurm.conf"))
    age = seconds(_value(cfg, "MinJobAge"))
    if cfg is not None:
        if age is None:
            lines.append(Line("MinJobAge", Level.WARNING, f"MinJobAge: {NOT_REPORTED}"))
        elif age < 60:
            lines.append(Line("MinJobAge", Level.WARNING,
                              f"MinJobAge {age} s: squeue forgets a finished job after {age} s, then only sacct knows it",
                              "keep accounting working (status falls back to sacct), or ask for MinJobAge >= 300"))
        else:
            lines.append(Line("MinJobAge", Level.OK, f"squeue keeps finished jobs {age} s"))
    return lines


# ------------------------------------------------------------------ the partition and preemption
def partition_fields(facts: ClusterFacts, run: RunFacts | None) -> tuple[str | None, dict[str, str] | None, list[Line]]:
    """The partition the run asks for (or the default one), its fields, and a line when it is missing."""
    name = (run.partition if run else None) or facts.partition
    if facts.partitions is None:
        return name, None, [Line("partition", Level.PROBLEM, f"scontrol show partition failed: {facts.partitions_problem}",
                                 "run doctor on a login node of the cluster")]
    if name is None:
        return None, None, [Line("partition", Level.PROBLEM, "no cluster.partition and no default partition",
                                 f"set cluster.partition to one of: {', '.join(facts.partitions) or '(none)'}")]
    if name not in facts.partitions:
        return name, None, [Line("partition", Level.PROBLEM, f"partition {name!r} does not exist",
                                 f"set cluster.partition to one of: {', '.join(facts.partitions)}")]
    return name, facts.partitions[name], [Line("partition", Level.OK, f"partition {name} ({facts.partitions[name].get('State', '?')})")]


def preempt_mode(facts: ClusterFacts, part: dict[str, str] | None) -> str | None:
    """The mode that applies to the partition: its own PreemptMode, else the cluster's."""
    mode = (part or {}).get("PreemptMode")
    return mode if mode not in (None, *UNSET) else _value(facts.config, "PreemptMode")


def preemption_on(facts: ClusterFacts, part: dict[str, str] | None) -> bool:
    ptype = _value(facts.config, "PreemptType") or ""
    mode = (preempt_mode(facts, part) or "OFF").upper()
    return ptype not in ("", "preempt/none", *UNSET) and mode != "OFF"


MODE_WORDS = {
    "REQUEUE": (Level.OK, "a preempted run gets SIGTERM, saves, and Slurm requeues the same job id; the "
                          "consolidation job keeps waiting for it; nothing to run"),
    "CANCEL": (Level.WARNING, "a preempted run gets SIGTERM, saves, and ends CANCELLED/PREEMPTED; it is not "
                              "requeued and its consolidation job waits forever"),
    "SUSPEND": (Level.WARNING, "a preempted run is paused in place, GPUs' memory held, nothing saved; it goes "
                               "on only when the preemptor ends (GANG scheduling)"),
}
MODE_FIX = {
    "CANCEL": "after a preemption run `slurmft resume RUN_DIR` (new job id, consolidation re-chained); or use a "
              "partition with PreemptMode=REQUEUE",
    "SUSPEND": "nothing to do for the run; a suspended run shows as `suspended` in `slurmft status`; use a partition "
               "with PreemptMode=REQUEUE for runs that must keep going",
}


def check_preemption(facts: ClusterFacts, name: str | None, part: dict[str, str] | None) -> list[Line]:
    if facts.config is None:
        return []
    ptype = _value(facts.config, "PreemptType")
    mode = preempt_mode(facts, part)
    if ptype is None or mode is None:
        return [Line("preemption", Level.WARNING, f"PreemptType/PreemptMode: {NOT_REPORTED}",
                     "ask the admin what a preemption does to a job on this partition")]
    if not preemption_on(facts, part):
        return [Line("preemption", Level.OK, f"no preemption on {name} (PreemptType={ptype}, PreemptMode={mode}): "
                                             "a run ends only at its time limit, a failure or scancel")]
    words = next((w for key, w in MODE_WORDS.items() if key in mode.upper().split(",")), None)
    if words is None:
        return [Line("preemption", Level.WARNING, f"PreemptType={ptype}, PreemptMode={mode} on {name}: a mode slurmft "
                                                  "does not know", "ask the admin what a preemption does to a job")]
    level, text = words
    key = next(k for k in MODE_WORDS if k in mode.upper().split(","))
    if ptype == "preempt/qos":  # the preemptor's QOS may set its own mode: not visible from scontrol
        text += "; with preempt/qos a QOS may set another PreemptMode (`sacctmgr show qos format=name,preemptmode`)"
    return [Line("preemption", level, f"PreemptType={ptype}, PreemptMode={mode} on {name}: {text}", MODE_FIX.get(key, ""))]


def check_user_signal(facts: ClusterFacts, part: dict[str, str] | None) -> list[Line]:
    cfg = facts.config
    if cfg is None or not preemption_on(facts, part):
        return []
    preempt_params = cfg.get("PreemptParameters")  # 23.02 and later; 22.05 does not print it
    ctld_params = cfg.get("SlurmctldParameters")
    if option(preempt_params, "send_user_signal") is not None or option(ctld_params, "preempt_send_user_signal") is not None:
        return [Line("preempt signal", Level.OK, "a preemption sends the run's warning signal first (send_user_signal)")]
    if ctld_params is None and preempt_params is None:
        return [Line("preempt signal", Level.WARNING, f"SlurmctldParameters/PreemptParameters: {NOT_REPORTED}")]
    return [Line("preempt signal", Level.WARNING,
                 "a preemption sends SIGTERM, not the warning signal: the ranks still save on SIGTERM, but only "
                 "within GraceTime + KillWait",
                 "ask for PreemptParameters=send_user_signal (SlurmctldParameters=preempt_send_user_signal before 23.02)")]


def check_requeue_delay(facts: ClusterFacts) -> list[Line]:
    cfg = facts.config
    if cfg is None:
        return []
    delay = seconds(option(cfg.get("SchedulerParameters"), "requeue_delay"))  # 25.11 and later
    source = "SchedulerParameters requeue_delay"
    if delay is None:
        auth = cfg.get("AuthInfo")
        if auth is None:
            return [Line("requeue delay", Level.WARNING, f"AuthInfo (cred_expire): {NOT_REPORTED}")]
        delay = seconds(option(auth, "cred_expire"))
        source = "AuthInfo cred_expire" if delay is not None else "cred_expire, Slurm's default"
        delay = DEFAULT_CRED_EXPIRE_S if delay is None else delay
    return [Line("requeue delay", Level.OK, f"a requeued attempt waits {delay} s before it may start again ({source})")]


def check_time_limit(run: RunFacts | None, name: str | None, part: dict[str, str] | None) -> list[Line]:
    if run is None or part is None:
        return []
    raw = part.get("MaxTime")
    if raw is None:
        return [Line("MaxTime", Level.WARNING, f"MaxTime of {name}: {NOT_REPORTED}")]
    if raw.upper() in ("UNLIMITED", "INFINITE"):
        return [Line("MaxTime", Level.OK, f"{name} has no time limit; cluster.time {run.time_s} s")]
    limit = slurm_time_seconds(raw)
    if run.time_s > limit:
        return [Line("MaxTime", Level.PROBLEM, f"cluster.time ({run.time_s} s) is above MaxTime={raw} of {name}: "
                                               "the job would stay pending (PartitionTimeLimit) or be refused",
                     f"set cluster.time to at most {raw}; the run requeues itself at each time limit")]
    return [Line("MaxTime", Level.OK, f"cluster.time {run.time_s} s fits MaxTime={raw} of {name}")]


def check_gpus(facts: ClusterFacts, run: RunFacts | None, name: str | None, part: dict[str, str] | None) -> list[Line]:
    if run is None or not run.requests_gpus or part is None:  # no partition: already a problem
        return []
    if facts.gpus_per_node is None:
        return [Line("gpus", Level.WARNING, f"GPUs per node of {name}: {NOT_REPORTED} (sinfo -o %G)")]
    most = max(facts.gpus_per_node, default=0)
    if run.gpus_per_node > most:
        return [Line("gpus", Level.PROBLEM, f"resources.gpus_per_node={run.gpus_per_node}, but the nodes of {name} "
                                            f"have at most {most} (gres)",
                     f"set resources.gpus_per_node to at most {most}, or choose another partition")]
    return [Line("gpus", Level.OK, f"resources.gpus_per_node={run.gpus_per_node}; nodes of {name} have {most} (gres)")]


def check_node_memory(facts: ClusterFacts, run: RunFacts | None, name: str | None,
                      part: dict[str, str] | None) -> list[Line]:
    """The estimate's CPU RAM of node 0 (loading, or training with the asynchronous saves' staging copy) against
    the memory Slurm reports for the partition's nodes (``sinfo -o %m``: RealMemory), not the profile's figure."""
    if run is None or run.cpu_ram_bytes is None or part is None:
        return []
    if not facts.node_memory_mb:
        return [Line("node memory", Level.WARNING, f"memory per node of {name}: {NOT_REPORTED} (sinfo -o %m)")]
    have = min(facts.node_memory_mb) * 10**6
    need, bare = run.cpu_ram_bytes, run.cpu_ram_without_staging or run.cpu_ram_bytes
    text = f"node 0 needs ~{need / 1e9:.0f} GB of CPU RAM; nodes of {name} have {have / 1e9:.0f} GB (RealMemory)"
    if need <= have:
        return [Line("node memory", Level.OK, text)]
    if bare <= have:
        return [Line("node memory", Level.PROBLEM,
                     text + f", of which ~{(need - bare) / 1e9:.0f} GB is the asynchronous saves' staging copy (each "
                     "rank's model and optimizer shards, kept for the whole job)",
                     "set checkpoint.async: false (each periodic save then holds training for its write), or use "
                     "more nodes")]
    return [Line("node memory", Level.PROBLEM, text, "use more nodes, or a partition whose nodes have more memory")]


# ------------------------------------------------------------------ the save against the time Slurm gives
def check_save(facts: ClusterFacts, run: RunFacts | None, name: str | None, part: dict[str, str] | None) -> list[Line]:
    """The run's projected save against KillWait, GraceTime + KillWait and preemption.lead_time_s, in words."""
    if run is None:
        return []
    if run.save_s is None:
        return [Line("save time", Level.WARNING, f"no projected save time ({run.save_why})",
                     "make model.name_or_path readable here so `slurmft estimate` works")]
    # what a stop may save for: with checkpoint.async, the rest of a save in flight, then its own
    save = stop_save_s(run.save_s, run.asynchronous)
    need = needed_s(save)
    takes = "stop saves for (a save in flight, then its own)" if run.asynchronous else "save takes"
    covers = "stop (a save in flight, then its own)" if run.asynchronous else "save"
    lost = f"up to {run.every_steps} steps (checkpoint.every_steps)"
    lines = []
    if run.lead_warning:
        lines.append(Line("lead time", Level.PROBLEM, run.lead_warning + f"; the run loses {lost}",
                          f"set preemption.lead_time_s to at least {lead_time_needed(run.save_s)}"))
    else:
        lines.append(Line("lead time", Level.OK, f"preemption.lead_time_s {run.lead_time_s} s covers the {covers} "
                                                 f"(~{_secs(save)})"))
    kill_wait = seconds(_value(facts.config, "KillWait"))
    if facts.config is not None and kill_wait is None:
        lines.append(Line("KillWait", Level.WARNING, f"KillWait: {NOT_REPORTED}"))
    elif kill_wait is not None and kill_wait < save:
        lines.append(Line("KillWait", Level.PROBLEM,
                          f"scancel, scontrol requeue and a time limit the warning signal missed kill the job "
                          f"{kill_wait} s after SIGTERM (KillWait); this run's {takes} ~{_secs(save)}: such an ending "
                          f"loses {lost}",
                          f"ask for KillWait >= {need}, or lower checkpoint.every_steps"))
    elif kill_wait is not None:
        lines.append(Line("KillWait", Level.OK, f"KillWait {kill_wait} s covers the {covers} (~{_secs(save)})"))
    if part is None or not preemption_on(facts, part):
        return lines
    grace = seconds(part.get("GraceTime"))
    if grace is None:
        lines.append(Line("GraceTime", Level.WARNING, f"GraceTime of {name}: {NOT_REPORTED}"))
        return lines
    window = grace + (kill_wait or 0)
    if window < save:
        lines.append(Line("GraceTime", Level.PROBLEM,
                          f"a preemption on partition {name} kills the job {window} s after SIGTERM (GraceTime {grace} "
                          f"+ KillWait {kill_wait}); this run's {takes} ~{_secs(save)}: a preemption loses {lost}",
                          f"ask for GraceTime >= {max(need - (kill_wait or 0), 0)} on {name}, or lower "
                          "checkpoint.every_steps"))
    else:
        lines.append(Line("GraceTime", Level.OK, f"a preemption on {name} leaves {window} s (GraceTime {grace} + KillWait "
                                                 f"{kill_wait}) for the {covers} (~{_secs(save)})"))
    return lines


def diagnose(facts: ClusterFacts, run: RunFacts | None) -> list[Line]:
    """Every login-side line, in the order a reader needs them: Slurm, accounting, partition, then the run."""
    name, part, part_lines = partition_fields(facts, run)
    unknown = part is None and facts.partitions is not None  # no such partition: nothing to say of its preemption
    return [
        *check_versions(facts),
        *check_accounting(facts),
        *part_lines,
        *([] if unknown else check_preemption(facts, name, part)),
        *check_user_signal(facts, part),
        *check_requeue_delay(facts),
        *check_time_limit(run, name, part),
        *check_gpus(facts, run, name, part),
        *check_node_memory(facts, run, name, part),
        *check_save(facts, run, name, part),
    ]


def exit_code(lines: list[Line]) -> int:
    """0 when nothing is a problem, 1 otherwise."""
    return int(any(line.level is Level.PROBLEM for line in lines))


def format_lines(lines: list[Line]) -> list[str]:
    """One line per check, and the fix indented under it."""
    out = []
    for line in lines:
        out.append(f"{line.level.value:<8} {line.check}: {line.text}")
        if line.fix and line.level is not Level.OK:
            out.append(f"{'':<8} fix: {line.fix}")
    return out


# ------------------------------------------------------------------ doctor --job: what the probe job found
@dataclass(frozen=True)
class ProbeExpect:
    """What the probe's answers are held against (from the run config, its profile and its estimate)."""

    nodes: int
    world: int
    vars: dict[str, str]  # every profile / cluster.env variable and the value the script exports
    signal_name: str
    signal_text: str  # the train script's --signal directive as rendered
    batch_only: bool
    run_dir: str
    run_dir_bytes: int | None  # checkpoints kept plus the consolidated model
    model_bytes: int | None  # the consolidated model, what HF_HOME holds of it
    wants_gpus: bool
    profile: str
    lora: bool = False  # the run has a lora section: the nodes need peft too
    image: str | None = None  # "RUNTIME image IMAGE" when the ranks run in a container (slurmft/plan/container.py)
    slurmft_version: str = ""  # the login node's slurmft, which wrote the run dir the job reads
    model_jobs: dict[str, str] = field(default_factory=dict)  # serve/eval -> the interpreter its job runs its tool in
    # serve/eval -> where it runs when that is not where the ranks run ("the pyxis image X", "the host"): the probe's
    # own step there reports it (tool-<kind>-<node>.json), not its ranks
    model_job_places: dict[str, str] = field(default_factory=dict)


def probe_expect(cfg: RunConfig, profile: ClusterProfile, estimate: dict[str, Any] | None, signal_name: str,
                 signal_text: str, batch_only: bool, run_dir: str) -> ProbeExpect:
    ckpt = estimate["checkpoint_bytes"] if estimate else None
    model = estimate["consolidated_bytes"] if estimate else None
    return ProbeExpect(
        nodes=cfg.resources.nodes, world=cfg.resources.nodes * cfg.resources.ranks_per_node,
        vars={**{k: v.value for k, v in profile.env.items()}, **cfg.cluster.env},
        signal_name=signal_name, signal_text=signal_text, batch_only=batch_only, run_dir=run_dir,
        run_dir_bytes=None if ckpt is None else ckpt * (cfg.checkpoint.keep_last + 1) + (model or 0),
        model_bytes=model, wants_gpus=bool(cfg.resources.gpus_per_node and profile.gres_gpu and profile.name != "local-test"),
        profile=profile.name, lora=cfg.lora is not None, image=_image_of(cfg, profile), slurmft_version=__version__,
        model_jobs={kind: tool_python(cfg, profile, kind) for kind in MODEL_JOB_TOOLS if cfg.model_job(kind)},
        model_job_places={kind: f"{place.runtime} image {place.image} ({kind}.container)" if place else
                          f"host ({kind}.container: false)" for kind, place in own_place_jobs(cfg, profile).items()},
    )


TRAINING_STACK = ("torch", "transformers", "accelerate", "trl", "datasets")
LORA_STACK = ("peft",)  # needed by a run with a lora section; reported for every run


def _gb(n: int | None) -> str:
    return "?" if n is None else f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def _node_reports(ranks: dict[int, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """One report per node: its local rank 0's (which checked the node's files and versions)."""
    return {r["node"]: r for r in sorted(ranks.values(), key=lambda r: r["rank"]) if r.get("local_rank") == 0}


def _image_of(cfg: RunConfig, profile: ClusterProfile) -> str | None:
    from slurmft.plan.container import resolve

    container = resolve(cfg, profile)
    return f"{container.runtime} image {container.image}" if container else None


def _probe_stack(nodes: dict[str, dict[str, Any]], expect: ProbeExpect) -> list[Line]:
    lines = []
    needed = (*TRAINING_STACK, *(LORA_STACK if expect.lora else ()))
    where = f" in the {expect.image}" if expect.image else ""
    install = ("install slurmft[train] (peft included) in the image and rebuild it, or point cluster.container.python "
               "at the image's interpreter that has it (docs/containers.md)" if expect.image else
               "point cluster.python at the environment that has slurmft's training stack (pip install -e "
               "'.[train]': peft included), or activate it in cluster.setup")
    versions = {r.get("slurmft") for r in nodes.values()} - {None}
    if expect.slurmft_version and versions and versions != {expect.slurmft_version}:
        lines.append(Line("slurmft version", Level.PROBLEM,
                          f"the ranks{where} run slurmft {', '.join(sorted(versions))}, this login node "
                          f"{expect.slurmft_version} (one writes the run directory the other reads)",
                          f"install slurmft {expect.slurmft_version} {'in the image' if expect.image else 'in cluster.python'}"
                          " (or this login node's slurmft at the ranks' version)"))
    elif expect.slurmft_version and versions:
        lines.append(Line("slurmft version", Level.OK, f"the ranks{where} run slurmft {expect.slurmft_version}, as here"))
    seen = set()
    for node, r in nodes.items():
        v = r.get("versions", {})
        stack = ", ".join(f"{k} {v.get(k) or '-'}" for k in (*TRAINING_STACK, *LORA_STACK, "flash-attn"))
        cuda = r.get("cuda", {})
        gpu = f"; CUDA {cuda.get('version')}, NCCL {cuda.get('nccl')}, {cuda.get('devices')} GPU(s)" if cuda.get("available") else ""
        missing = [k for k in needed if not v.get(k)]
        plugin = f"; NCCL net plugin {r.get('nccl_net_plugin') or 'none'}" if cuda.get("available") else ""
        text = f"{r.get('python')}{where} (Python {r.get('python_version')}): {stack}{gpu}{plugin}"
        if missing:
            lines.append(Line(f"python [{node}]", Level.PROBLEM, text + f"; missing: {', '.join(missing)}", install))
        else:
            lines.append(Line(f"python [{node}]", Level.OK, text))
        seen.add((r.get("python"), tuple(sorted((k, str(x)) for k, x in v.items()))))
    if len(seen) > 1:
        lines.append(Line("python", Level.WARNING, "the nodes run different Pythons or package versions",
                          "use one environment on a shared filesystem (cluster.python)"))
    return lines


def _probe_model_jobs(nodes: dict[str, dict[str, Any]], expect: ProbeExpect,
                      tools: dict[str, dict[str, dict[str, Any]]] | None = None) -> list[Line]:
    """``serve.python`` / ``eval.python`` as the nodes see them: there, and finding their tool (docs/serve-eval.md).
    A job in a place of its own (``expect.model_job_places``) is told by ``tools`` (kind -> node -> the probe's
    step there), the others by the ranks' reports."""
    lines = []
    for kind, python in expect.model_jobs.items():
        tool = MODEL_JOB_TOOLS[kind]
        place = expect.model_job_places.get(kind)
        in_image = place is not None and "image" in place
        if place is None:
            where = f" in the {expect.image}" if expect.image else ""
            facts = {node: (r.get("model_jobs") or {}).get(kind) for node, r in nodes.items()}
        else:
            where = f" in the {place}" if in_image else " on the host"
            found = (tools or {}).get(kind, {})
            facts = {node: found.get(node) for node in sorted({*nodes, *found})}
        fix = (f"set {kind}.python to the bin/python of a venv with {tool.name} ({tool.install}) on a filesystem "
               "every node shares" + (f", mounted into the image ({kind}.container.mounts), or an interpreter the "
                                      "image has" if in_image else ""))
        own = (f"install slurmft{'[train]' if kind == 'serve' else ''} in that image, or set {kind}.container.python to "
               "its interpreter that has it" if in_image else "install slurmft[train] in cluster.python")
        silent = sorted(node for node, fact in facts.items() if fact is None)
        bad = {node: fact["problem"] or f"{fact['python']} cannot import {tool.module}"
               for node, fact in facts.items() if fact is not None and not fact["found"]}
        lacking = {node: f"{fact.get('step_python')} (slurmft's own there) cannot import {', '.join(fact['step_missing'])}"
                   for node, fact in facts.items() if fact is not None and fact.get("step_missing")}
        if lacking:
            lines.append(Line(f"{kind}.container", Level.PROBLEM, f"the {place}: " + "; ".join(
                f"{node}: {why}" for node, why in sorted(lacking.items())) + f" (the {kind} job's entrypoint runs "
                "there" + (", and compares vLLM with transformers there)" if kind == "serve" else ")"), own))
        if bad:
            text = "; ".join(f"{node}: {why}" for node, why in sorted(bad.items()))
            lines.append(Line(f"{kind}.python", Level.PROBLEM, f"{python}{where}: {text} (the {kind} job after "
                                                               "consolidation would fail there)", fix))
        elif silent and place is not None:
            lines.append(Line(f"{kind}.python", Level.PROBLEM,
                              f"the probe's step in the {place} did not report from {', '.join(silent)}: slurmft's "
                              "own Python did not start there (the probe log says why)", own))
        elif silent:
            lines.append(Line(f"{kind}.python", Level.WARNING, f"{', '.join(silent)} did not report on {python} "
                                                               "(a probe of another slurmft version?)"))
        else:
            versions = sorted({str(fact["version"]) for fact in facts.values() if fact})
            lines.append(Line(f"{kind}.python", Level.OK, f"{python}{where} finds {tool.name} {', '.join(versions)} on "
                                                          f"{', '.join(sorted(facts))}"))
    return lines


def _probe_vars(ranks: dict[int, dict[str, Any]], expect: ProbeExpect) -> list[Line]:
    wrong = sorted({(k, str(r["vars"].get(k)), r["node"]) for r in ranks.values() for k, v in expect.vars.items()
                    if r.get("vars", {}).get(k) != v})
    if not expect.vars:
        return [Line("profile variables", Level.OK, f"profile {expect.profile} sets none")]
    if wrong:
        shown = "; ".join(f"{k}={v!r} on {n} (profile: {expect.vars[k]!r})" for k, v, n in wrong[:6])
        return [Line("profile variables", Level.WARNING, f"ranks see other values: {shown}",
                     "cluster.setup or the site's environment overrides them; set them in cluster.env if the run "
                     "needs the profile's value")]
    return [Line("profile variables", Level.OK, f"every rank sees the profile's {', '.join(expect.vars)}")]


def _probe_shared(nodes: dict[str, dict[str, Any]], key: str, label: str, need: tuple[int | None, str],
                  level_unshared: Level, fix: str, space_fix: str) -> list[Line]:
    """Each node's token in ``key``'s directory, read by the others, and its free space against ``need``
    (bytes, and what they are for); ``space_fix`` (``{path}`` in it) says what to do when it has too little."""
    names = sorted(nodes)
    lines = []
    for node, r in nodes.items():
        fact = r.get(key) or {}
        path = fact.get("path", "?")
        if "error" in fact:
            lines.append(Line(f"{label} [{node}]", Level.PROBLEM, f"cannot write into {path} on {node}: {fact['error']}", fix))
            continue
        unseen = [n for n in names if n not in fact.get("saw", [])]
        free = fact.get("free_bytes")
        space = f"{_gb(free)} free" + (f", {need[1]} ~{_gb(need[0])}" if need[0] else "")
        if unseen and len(names) > 1:
            lines.append(Line(f"{label} [{node}]", level_unshared,
                              f"{path}: files written on {', '.join(unseen)} are not seen on {node}: not one shared "
                              f"filesystem ({space})", fix))
        elif need[0] and free is not None and free < need[0]:
            lines.append(Line(f"{label} [{node}]", Level.PROBLEM, f"{path}: {space}",
                              space_fix.format(path=path)))
        else:
            shared = "shared by every node" if len(names) > 1 else "one node: sharing not tested"
            lines.append(Line(f"{label} [{node}]", Level.OK, f"{path}: {shared}; {space}"))
    return lines


def _probe_signal(ranks: dict[int, dict[str, Any]], batch: dict[str, Any] | None, expect: ProbeExpect) -> list[Line]:
    got = {r["rank"]: (r.get("signal") or {}).get("got") for r in ranks.values()}
    missed = sorted(r for r, name in got.items() if name != expect.signal_name)
    batch_got = any((r.get("signal") or {}).get("batch_got") for r in ranks.values())
    limit = (batch or {}).get("time_limit") or {}
    if not missed:
        after = max(((r.get("signal") or {}).get("after_ready_s") or 0) for r in ranks.values())
        return [Line("warning signal", Level.OK, f"{expect.signal_text} reached all {len(got)} rank(s), sent by Slurm "
                                                 f"{after:.0f} s after the ranks were ready")]
    if batch_got:
        return [Line("warning signal", Level.PROBLEM,
                     f"{expect.signal_text} reached the batch shell only, not rank(s) {missed}: the ranks never save "
                     "before the time limit, and the job dies at SIGKILL",
                     "drop 'B:' from the --signal directive of your train template (Slurm then signals the ranks)"
                     if expect.batch_only else "let Slurm signal the job steps (a --signal directive without B:)")]
    if limit and not limit.get("ok"):
        return [Line("warning signal", Level.WARNING, f"the probe could not bring its warning signal forward "
                                                      f"(scontrol update TimeLimit: {limit.get('problem')}); not tested",
                     "ask the admin whether users may lower their jobs' time limit, or test with a short cluster.time")]
    waited = max(((r.get("signal") or {}).get("waited_s") or 0) for r in ranks.values())
    return [Line("warning signal", Level.PROBLEM,
                 f"{expect.signal_text}: rank(s) {missed} got no {expect.signal_name} within {waited:.0f} s "
                 f"(they got: {sorted({str(v) for v in got.values()})})",
                 "check that srun starts the ranks directly (no wrapper that swallows signals) and that "
                 "preemption.signal is a signal Slurm may send")]


def probe_lines(ranks: dict[int, dict[str, Any]], batch: dict[str, Any] | None, expect: ProbeExpect,
                job: str, state: str, log: str, tools: dict[str, dict[str, dict[str, Any]]] | None = None) -> list[Line]:
    """Every line of ``doctor --job`` from the probe's files (``rank-N.json``, ``batch.json``, and ``tools``: kind ->
    node -> ``tool-<kind>-<node>.json`` for a serve/eval job in a place of its own)."""
    missing = [r for r in range(expect.world) if r not in ranks]
    nodes = _node_reports(ranks)
    head = f"probe job {job} ({state}) on {', '.join(sorted(nodes)) or 'no node that reported'}"
    if not ranks:
        return [Line("probe", Level.PROBLEM, f"{head}: no rank reported (log: {log})",
                     "read the log: cluster.setup or cluster.python may fail on the nodes")]
    lines = [Line("probe", Level.PROBLEM if missing else Level.OK,
                  head + (f": no report from rank(s) {missing} (log: {log})" if missing else ""),
                  "read the log: the missing ranks failed or were killed" if missing else "")]
    lines += _probe_stack(nodes, expect)
    lines += _probe_model_jobs(nodes, expect, tools)
    if expect.wants_gpus and not any((r.get("cuda") or {}).get("available") for r in nodes.values()):
        lines.append(Line("gpus", Level.PROBLEM, "no rank sees a GPU (torch.cuda.is_available() is False)",
                          "check the job's CUDA setup (cluster.setup: module load cuda) and that torch is a CUDA build"))
    gpu_nodes = [n for n, r in nodes.items() if (r.get("cuda") or {}).get("available")]
    no_plugin = [n for n in gpu_nodes if not nodes[n].get("nccl_net_plugin")]
    if "efa" in expect.profile and no_plugin:
        lines.append(Line("NCCL net plugin", Level.WARNING, f"no libnccl-net*.so (aws-ofi-nccl) found on "
                                                            f"{', '.join(no_plugin)}{' in the ' + expect.image if expect.image else ''}: "
                          "NCCL falls back to sockets over EFA's TCP", "install aws-ofi-nccl "
                          + ("in the image (the AWS and NGC images carry it)" if expect.image else "on the nodes")
                          + " or put its lib directory on LD_LIBRARY_PATH"))
    lines += _probe_vars(ranks, expect)
    lines += _probe_shared(nodes, "run_dir", "run dir", (expect.run_dir_bytes, "checkpoints and model need"), Level.PROBLEM,
                           "set output_dir to a path on a filesystem every node shares (not /tmp or a node-local disk)",
                           "free space on {path}, or lower checkpoint.keep_last")
    lines += _probe_shared(nodes, "hf_home", "HF_HOME", (expect.model_bytes, "the model needs"), Level.WARNING,
                           "set HF_HOME (cluster.env) to a shared directory, or every node downloads on its own",
                           "free space on {path}, or set HF_HOME (cluster.env) to a directory with room for the model")
    sc = (batch or {}).get("scontrol")
    if sc is None:
        lines.append(Line("scontrol in batch", Level.WARNING, "the batch side did not report (see the log)"))
    elif sc.get("ok"):
        lines.append(Line("scontrol in batch", Level.OK, "scontrol show job answers inside the batch script"))
    else:
        lines.append(Line("scontrol in batch", Level.PROBLEM, f"scontrol failed inside the batch script: {sc.get('problem')}",
                          "the requeue needs scontrol in the batch script: make it reachable there (cluster.setup)"))
    bad = {r["node"]: (r.get("master") or {}).get("error") for r in ranks.values() if not (r.get("master") or {}).get("ok")}
    master = next(iter(ranks.values())).get("master") or {}
    if bad:
        lines.append(Line("MASTER_ADDR", Level.PROBLEM, f"{master.get('addr')}:{master.get('port')} not reached from "
                                                        f"{', '.join(sorted(bad))}: {next(iter(bad.values()))}",
                          "set cluster.master_addr to an address every node reaches, or the profile's interface "
                          "variables (NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME)"))
    else:
        lines.append(Line("MASTER_ADDR", Level.OK, f"{master.get('addr')}:{master.get('port')} reached from every node"))
    ar = next((r.get("allreduce") for r in ranks.values() if r.get("rank") == 0 and r.get("allreduce")), None)
    if ar:
        bw = ar.get("busbw_gb_s")
        lines.append(Line("all-reduce", Level.OK, f"{ar['backend']}, {ar['world']} ranks, {_gb(ar['bytes'])}: "
                                                  f"{ar['seconds']} s" + (f", bus bandwidth {bw} GB/s" if bw else "")))
    lines += _probe_signal(ranks, batch, expect)
    efa = [n for n, r in nodes.items() if r.get("fi_info_efa")]
    if expect.profile == "local-test" and any((r.get("cuda") or {}).get("available") for r in nodes.values()):
        lines.append(Line("profile", Level.WARNING, "the nodes have GPUs but the profile is local-test (CPU ranks)",
                          "set cluster.profile to your network's profile (`slurmft profiles`)"))
    elif efa and "efa" not in expect.profile:
        lines.append(Line("profile", Level.WARNING, f"{', '.join(efa)} have EFA (fi_info -p efa)",
                          "set cluster.profile to aws-efa"))
    return lines
