"""The reward of tests/slurm/test_grpo.py: the completion's length, and in a run submitted with
``SLURMFT_TEST_GRPO_HOLD`` set, a place to preempt inside a generation.

There, on the first attempt, each rank scoring the completions of the generation made at step 3 (``global_step``
2) leaves ``$SLURMFT_TEST_GRPO_HOLD/holding-<rank>`` and waits until the warning signal has raised its own flag
(slurmft/job/preemption.py), at most two minutes: the test sends the signal when it sees the files. So the
signal lands inside a generation on every machine, however fast the steps are; the run it is compared with has
the same reward without the variable, and waits for nothing.
"""

import os
import time
from pathlib import Path


def length(completions, trainer_state, **kwargs):
    """The completion's length in characters, scaled to about 1."""
    hold = os.environ.get("SLURMFT_TEST_GRPO_HOLD")
    if hold and trainer_state.global_step == 2 and os.environ.get("SLURM_RESTART_COUNT", "0") == "0":
        from slurmft.job import preemption

        (Path(hold) / f"holding-{os.environ['SLURM_PROCID']}").touch()
        deadline = time.monotonic() + 120
        while not preemption.requested() and time.monotonic() < deadline:
            time.sleep(0.05)
    return [len(c) / 40 for c in completions]
