"""The small error hierarchy: a ``SlurmftError`` is the user's to fix, anything else is our bug."""

from __future__ import annotations


class SlurmftError(Exception):
    """Base class for errors that the CLI prints without a traceback (exit code 2)."""

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems = problems or []

    def render(self) -> str:
        """All problems, one per line, under the headline."""
        lines = [str(self)]
        lines += [f"  - {p}" for p in self.problems]
        return "\n".join(lines)


class ConfigError(SlurmftError):
    """The run config (or an override, or a cluster profile) is invalid."""


class RenderError(SlurmftError):
    """A template could not be rendered (missing template, missing variable)."""


class SubmissionError(SlurmftError):
    """sbatch/submitit refused the job, or the run directory is busy."""


class Cancelled(SubmissionError):
    """A job this process ran here (the local executor) was cancelled with ``slurmft cancel``: a local sweep's
    ``submit`` or ``resume`` starts no further point."""


class RunDirError(SlurmftError):
    """The run directory is missing, locked by a live run, or malformed."""


class LockError(RunDirError):
    """A lock is held by another live process, or cannot be taken safely in this directory."""


class CheckpointError(SlurmftError):
    """A checkpoint is missing, incomplete or unreadable."""


class JobSetupError(SlurmftError):
    """Inside the allocation: a bad model path, dataset, tokenizer or length, found before any collective."""


class EvalError(SlurmftError):
    """The evaluation job: lm-eval failed or wrote no results (the model directory is left as it is)."""
