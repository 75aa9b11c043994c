"""How a failed checkpoint read or write is said: one line per error, each message once with the ranks that had it.

Why: DCP raises one ``CheckpointException`` that carries every rank's own error (it shares a read or write error
among the ranks, so each rank sees all of them), and torch's messages come with a long preamble or paragraphs of
advice after the first sentence. A log line, or a problem of a :class:`~slurmft.errors.CheckpointError`, should
name the cause in one line, and say a cause once even when every rank had it. The marker's wait for a background
write (complete.py) and the load guards (fallback.py) both say their failures this way.
"""

from __future__ import annotations

from torch.distributed.checkpoint.api import CheckpointException

_MAX_REASON = 300


def reason(exc: BaseException) -> str:
    """One line for a load or write error; a DCP error names the ranks whose read or write failed and their own
    errors."""
    if isinstance(exc, CheckpointException):
        return "; ".join(f"rank {rank}: {reason(inner)}" for rank, (inner, _) in sorted(exc.failures.items()))
    text = str(exc)
    if "WeightsUnpickler error:" in text:  # torch.load of garbage: the useful line follows a long preamble
        text = text.split("WeightsUnpickler error:", 1)[1]
    text = next((line.strip() for line in text.splitlines() if line.strip()), "(no message)")
    if len(text) > _MAX_REASON // 2 and ". " in text:  # torch appends paragraphs of advice to the first sentence
        text = text.split(". ", 1)[0] + "."
    return f"{type(exc).__name__}: {text[:_MAX_REASON]}"


def per_message(failed: list[tuple[int, str]], world_size: int) -> list[str]:
    """Each rank's error once (:func:`slurmft.job.distributed.gather_errors`), in the order first seen, with the
    ranks that had it unless every rank did (DCP gives every rank the same error)."""
    ranks_of: dict[str, list[int]] = {}
    for rank, msg in failed:
        ranks_of.setdefault(msg, []).append(rank)
    return [msg if len(ranks) == world_size else f"{msg} (on rank {', '.join(map(str, ranks))})"
            for msg, ranks in ranks_of.items()]
