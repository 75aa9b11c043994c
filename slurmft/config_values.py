"""The rules run.yaml's values follow: a section that rejects unknown keys (:class:`Section`), and the patterns,
types and checks of the values that reach a batch script or a Slurm command.

Every string that can reach a shell script is checked here (and quoted again at render time), so a bad
value fails at ``submit`` with the dotted field name, never inside a job. The schema
(:mod:`slurmft.config`, :mod:`slurmft.config_cluster`) puts these types and checks on its fields; a
cluster profile (:mod:`slurmft.profiles`) checks its variables with the same rules.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict

from slurmft.units import SIZE_RE, slurm_time_seconds


class Section(BaseModel):
    """A section of run.yaml: unknown keys are rejected, and a value set later is checked like one read."""

    # A number where a string is wanted (``mem: 0``, ``cluster.env.X: 1``, ``time: 240``) means its digits.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, coerce_numbers_to_str=True)


# ------------------------------------------------------------------ shell-safe value patterns
NAME_RE = re.compile(r"^[A-Za-z0-9._-]+$")
SLURM_WORD_RE = re.compile(r"^[A-Za-z0-9._-]+$")  # partition, account, qos
CONSTRAINT_RE = re.compile(r"^[A-Za-z0-9._,:&|\[\]*()-]+$")
TIME_RE = re.compile(r"^(\d+-)?\d{1,3}(:\d{2}){0,2}$")  # [D-]HH[:MM[:SS]] or minutes
MEM_RE = re.compile(r"^\d+[KMGT]?$")
ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
PATH_RE = re.compile(r"^[A-Za-z0-9._/~+@=,-]+$")  # no spaces, quotes, $, `, ;, |, &, <, >
#: A variable that holds a secret (HF_TOKEN, WANDB_API_KEY, AWS_SECRET_ACCESS_KEY); one that names where a secret is
#: kept (HF_TOKEN_PATH, ..._FILE, ..._DIR) holds a path and is not one.
SECRET_KEY_RE = re.compile(
    r"(^|_)(TOKEN|SECRET|PASSWORD|PASSWD|API_KEY|ACCESS_KEY|CREDENTIALS?)($|_(?!(PATH|FILE|DIR)$))", re.I)
#: ``NAME=value`` in a shell line (``export NAME=value``, ``NAME=value cmd``); the value is what follows the ``=``.
ASSIGNMENT_RE = re.compile(r"(?:^|[\s;&|(])([A-Za-z_][A-Za-z0-9_]*)=(\S*)")
#: The signals Slurm may send ahead of the end (preemption.signal), without SIG.
SIGNALS = ("USR1", "USR2", "TERM", "INT", "URG")


def check_value(pattern: re.Pattern[str], value: str, what: str) -> str:
    """``value`` when ``pattern`` matches it, else a ValueError naming ``what`` was expected."""
    if not pattern.match(value):
        raise ValueError(f"{value!r} is not a valid {what}")
    return value


def _matching(pattern: re.Pattern[str], what: str) -> AfterValidator:
    """A validator that accepts strings matching ``pattern`` and names ``what`` was expected otherwise."""
    return AfterValidator(lambda v: check_value(pattern, v, what))


# One type per kind of Slurm value, so every field of that kind says the same thing when it is wrong.
SlurmWord = Annotated[str, _matching(SLURM_WORD_RE, "Slurm name (letters, digits, . _ -)")]
SlurmTime = Annotated[str, _matching(TIME_RE, "Slurm time limit (use [D-]HH:MM:SS, e.g. 04:00:00 or 1-12:00:00)")]
SlurmMem = Annotated[str, _matching(MEM_RE, "Slurm memory size (e.g. 0, 64G, 500000M)")]
Size = Annotated[str, _matching(SIZE_RE, "size (e.g. 5GB, 500MB)")]

IFNAME_RE = re.compile(r"^[A-Za-z0-9_.:@-]+$")


def gloo_ifname_problem(value: str) -> str | None:
    """Why ``value`` is not a GLOO_SOCKET_IFNAME gloo can use (None: it is one).

    gloo takes a comma-separated list of interface names and binds one device to each (torch's
    ProcessGroupGloo); NCCL_SOCKET_IFNAME's ``^`` exclusion and ``=`` exact-match prefixes are not
    understood and fail at process-group creation ("Unable to find address for: ^docker").
    """
    names = value.split(",")
    if all(IFNAME_RE.match(n) for n in names):
        return None
    return (f"GLOO_SOCKET_IFNAME={value!r}: gloo takes interface names (e.g. eth0, or ens5,ens6), not NCCL's "
            "'^'/'=' patterns; leave it unset and the job binds gloo to the interface that reaches MASTER_ADDR")


def no_control_chars(value: str, what: str) -> str:
    """``value`` when it holds no newline or control character (a tab is allowed), else a ValueError."""
    if any(ord(c) < 32 and c != "\t" for c in value) or "\x7f" in value:
        raise ValueError(f"{what} must not contain newlines or control characters")
    return value


#: The container runtimes slurmft renders the rank step for (docs/containers.md).
RUNTIMES = ("pyxis", "apptainer", "charliecloud", "podman")
#: An image: a file path or a reference (nvcr.io#nvidia/pytorch:24.05-py3, docker://..., localhost/sft:1).
IMAGE_RE = re.compile(r"^[A-Za-z0-9._/~+@=:#-]+$")
#: One side of a mount: an absolute path without the separators the runtimes split on (',' and ':').
MOUNT_PATH_RE = re.compile(r"^/[A-Za-z0-9._/~+@=-]*$")


def mount_problem(mount: str) -> str | None:
    """Why ``mount`` is not an absolute ``SRC:DST`` (or ``SRC``, bound at the same path) every runtime accepts."""
    parts = mount.split(":")
    if len(parts) > 2:
        return (f"{mount!r}: expected SRC:DST (two absolute paths); pyxis and Apptainer split mounts on ':' and ',', "
                "so neither may appear inside a path")
    for side, path in zip(("the source", "the destination"), parts, strict=False):
        if not path.startswith("/"):
            return (f"{mount!r}: {side} {path!r} is not an absolute path (a mount is bound on every node, where a "
                    f"relative path means nothing); write it from / (e.g. /shared/data:/data)")
        if not MOUNT_PATH_RE.match(path):
            return f"{mount!r}: {side} {path!r} has characters a mount cannot carry (spaces, ',', quotes, $)"
    return None


def runtime_choice(value: str) -> str:
    """``value`` as one of :data:`RUNTIMES`, or a ValueError with a did-you-mean."""
    import difflib

    from slurmft.names import RUNTIME_ALIASES

    name = value.strip().lower()
    if name in RUNTIMES:
        return name
    if name in RUNTIME_ALIASES:
        raise ValueError(f"unknown runtime {value!r}; did you mean {RUNTIME_ALIASES[name]!r}? "
                         f"(use one of {', '.join(RUNTIMES)})")
    close = difflib.get_close_matches(name, RUNTIMES, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise ValueError(f"unknown runtime {value!r}; {hint}use one of {', '.join(RUNTIMES)}")


def checked_env(v: dict[str, str]) -> dict[str, str]:
    """Variable names, no secrets, no control characters (cluster.env and cluster.container.env)."""
    for key, value in v.items():
        check_value(ENV_KEY_RE, key, "environment variable name")
        if SECRET_KEY_RE.search(key):
            raise ValueError(
                f"{key} looks like a secret; do not put secrets in run.yaml (they would be written into "
                f"the sbatch script). Export {key} in the shell that runs 'slurmft submit' instead."
            )
        no_control_chars(str(value), f"env value of {key}")
        if key == "GLOO_SOCKET_IFNAME" and (problem := gloo_ifname_problem(str(value))):
            raise ValueError(problem)
    return v


def secret_in_line(line: str) -> str | None:
    """The name of a secret a shell line sets to a literal value (``export HF_TOKEN=hf_...``), else None.

    cluster.setup is written verbatim into every batch script, so such a value would sit in RUN_DIR/scripts/ for
    anyone who can read the run. A value read at run time (``$HF_TOKEN``, ``$(cat ~/.hf_token)``) holds no secret."""
    for name, value in ASSIGNMENT_RE.findall(line):
        if SECRET_KEY_RE.search(name) and value.lstrip("\"'")[:1] not in ("$", ""):
            return name
    return None




def time_minutes(slurm_time: str) -> int:
    """Minutes in a Slurm time limit, rounded up (submitit's ``timeout_min``)."""
    return -(-slurm_time_seconds(slurm_time) // 60)
