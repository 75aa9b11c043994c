"""Run the train entrypoint on a CPU-only machine as if ``SLURMFT_FAKE_GPU_COUNT`` CUDA devices were visible.

For tests/job/test_distributed.py only. This torch build has no CUDA and no NCCL, so three things are
replaced: ``torch.cuda.is_available``/``device_count`` (what a rank would see), ``torch.cuda.set_device``
(nothing to select), and the GPU backend string (gloo instead of NCCL). The device choice, the
rendezvous, the agreement on errors and the exit path are slurmft's real code.

    python tests/job/fake_gpus.py train RUN_DIR
"""

from __future__ import annotations

import os
import sys

import torch

count = int(os.environ["SLURMFT_FAKE_GPU_COUNT"])
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: count
torch.cuda.set_device = lambda device: None

from slurmft.job import distributed  # noqa: E402
from slurmft.job.entrypoint import main  # noqa: E402

distributed.GPU_BACKEND = "gloo"

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
