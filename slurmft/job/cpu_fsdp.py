"""The one adjustment that makes accelerate (and so the Trainer and TRL) run real FSDP2 on CPU.

Why it exists: accelerate decides the distributed type before it looks at the FSDP plugin. On a
machine without an accelerator it picks ``MULTI_CPU`` and silently drops the plugin, so the Trainer
runs DDP (or, single process, every rank trains alone and they race on one checkpoint folder).
docs/design-notes.md records that switching the type to ``FSDP`` on both ``AcceleratorState`` and the
``PartialState`` shared state makes accelerate, the Trainer and ``SFTTrainer`` run FSDP2 with gloo,
write sharded DCP checkpoints and resume bitwise identically.

Applied only when there is no CUDA device (the job calls :func:`enable` then, and logs it), so a
GPU run never goes through it. The CPU tests assert that parameters really are DTensor shards
holding ~1/world_size of the model each, which fails loudly should a future accelerate change the
state classes this relies on.
"""

from __future__ import annotations

import functools
import logging

log = logging.getLogger("slurmft.job")

_applied = False


def enable() -> bool:
    """Patch ``AcceleratorState.__init__`` so an FSDP plugin on MULTI_CPU means FSDP. Idempotent.

    Returns True the first time it patches.
    """
    global _applied
    if _applied:
        return False
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    original_init = AcceleratorState.__init__

    @functools.wraps(original_init)
    def init_honouring_fsdp_on_cpu(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        plugin = kwargs.get("fsdp_plugin")
        if plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            self.fsdp_plugin = plugin

    AcceleratorState.__init__ = init_honouring_fsdp_on_cpu
    _applied = True
    log.info("no CUDA device: FSDP2 on CPU with gloo (accelerate's MULTI_CPU fallback overridden, "
             "see slurmft/job/cpu_fsdp.py)")
    return True
