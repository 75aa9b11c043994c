"""The job's checkpoints, one concern a file, behind one door (manager.py, :class:`CheckpointManager`).

- writing.py: the Trainer's writes, or the same staged at the step and written in the background; no CRC-32.
- complete.py: a save counts once it is whole: the COMPLETE marker, rotation, the wait for a background write.
- candidates.py: what a resume may start from (verified, newest first) and the checks each must pass.
- fallback.py: loads every rank agrees on, and the fall back to an older checkpoint when one does not load.
- adapter_state.py: a LoRA checkpoint holds the adapters only, every rank's shard.
- failures.py: how a failed read or write is said (one line, once per message).

Discovery (which directories count) is torch-free and shared with the login side: slurmft/checkpoints.py.
"""

from slurmft.job.checkpointing.candidates import (
    check_resume_adapters,
    check_resume_base,
    check_resume_method,
    check_resume_precision,
)
from slurmft.job.checkpointing.manager import CheckpointManager

__all__ = ["CheckpointManager", "check_resume_adapters", "check_resume_base", "check_resume_method",
           "check_resume_precision"]
