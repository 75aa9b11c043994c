"""Fixtures for the in-job tests: the environment of a launched job (tiny_model is in tests/conftest.py)."""

from __future__ import annotations

import os

import pytest

from .helpers import REPO


@pytest.fixture(scope="session")
def job_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Environment of a launched job: offline, private dataset cache, no Slurm variables leaking in."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_", "TORCHELASTIC_"))}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_DATASETS_CACHE=str(tmp_path_factory.mktemp("hf_datasets")),
        PYTHONUNBUFFERED="1",
        PYTHONFAULTHANDLER="1",  # a crash in a rank prints every thread's stack
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1",
        SLURMFT_RENDEZVOUS_TIMEOUT="60",
        SLURMFT_COLLECTIVE_TIMEOUT="120",
        PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    return env
