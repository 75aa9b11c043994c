"""Helpers for the tests that drive `slurmft` against the real cluster (see tests/conftest.py for it)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from cli_runner import cli

from tests.export_check import assert_same_model
from tests.slurm import images, jobs

# The config of the shared uninterrupted reference run (``reference``): every interrupted run of it
# must end with a bitwise-equal consolidated model.
REFERENCE_TRAIN = {"max_steps": 40}
REFERENCE_CHECKPOINT = {"every_steps": 10, "keep_last": 2}
# 64-token rows: what the cluster tests check (endings, saves, resumes bitwise) does not depend on the row length,
# and a micro-model step on 64 is ~20% cheaper than on 128 (the train-time test keeps 128, test_endings.py).
SEQ = 64
# The runs here prepare their data in a prepare job first, the product's default (prepare.resources too: 8 CPUs, so
# the shared reference run packs with 8 processes). A test whose runs check what data preparation does not meet
# (how a job ends, saves, resumes, what status shows) passes ``prepare=IN_ALLOCATION`` and says so where it does: the
# train job then prepares in its allocation, which saves each run a job start and a Python start-up with datasets
# and TRL imported. Those runs that are compared bitwise with the reference are also the check that both paths, and
# any number of CPUs, pack the same sequences (issue 45: they did not).
IN_ALLOCATION = {"enabled": False}


@pytest.fixture(scope="session")
def tiny_model(micro_model: Path) -> Path:
    """The cluster tests' model, in place of tests/conftest.py's ``tiny_model`` for every test under tests/slurm: the
    ``micro`` preset. What these tests check, the jobs' endings, their saves and resumes bitwise, does not depend on
    the width."""
    return micro_model


@pytest.fixture(scope="session")
def sft_image() -> Path:
    """The cached container test image (tests/slurm/images.py; built on first use, .ci/run builds it first)."""
    return Path(images.built())


@pytest.fixture(scope="session")
def podman_image(sft_image: Path) -> str:
    """The same image in podman's storage (Debian's podman installed and the image imported on first use)."""
    return images.built("podman")


class SlurmftDriver:
    """Writes run configs for the test cluster, runs the CLI in-process, and watches runs."""

    def __init__(self, capsys: pytest.CaptureFixture[str] | None) -> None:
        self.capsys = capsys

    def write_config(self, tmp_path: Path, model: Path, dataset: Path, /, **sections: dict) -> Path:
        cfg = {
            "name": "it",
            "output_dir": str(tmp_path / "run"),
            "executor": "slurm",
            "cluster": {"profile": "local-test", "time": "00:15:00"},
            "resources": {"nodes": 2, "gpus_per_node": 1, "cpus_per_task": 1, "exclusive": False},
            "model": {"name_or_path": str(model), "dtype": "float32", "attn_implementation": "sdpa"},
            "data": {"datasets": [{"path": str(dataset)}], "max_seq_length": SEQ},
            "train": {"max_steps": 4, "per_device_batch_size": 2, "learning_rate": 1e-3, "warmup_ratio": 0.0},
            "checkpoint": {"every_steps": 2, "keep_last": 2},
            "consolidate": {"dtype": "float32", "resources": {"cpus_per_task": 1, "mem": "2G", "time": "00:10:00"}},
        }
        for key, value in sections.items():
            cfg.setdefault(key, {}).update(value)
        path = tmp_path / "run.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return path

    def cli(self, args: list[str]) -> tuple[int, str, str]:
        return cli(args, self.capsys)

    def started(self, args: list[str]) -> dict[str, str]:
        """Run a command that starts a train and a consolidation job, and a prepare job before them when the data is
        not prepared yet (submit, resume); their ids."""
        code, out, err = self.cli(args)
        assert code == 0, err
        started = jobs.started_jobs(out)
        # serve and eval: the jobs after consolidation, when the config has those sections (docs/serve-eval.md)
        assert {"train", "consolidate"} <= set(started) <= {"prepare", "train", "consolidate", "serve", "eval"}, out
        return started

    def submit(self, path: Path, *overrides: str) -> dict[str, str]:
        return self.started(["submit", str(path), *overrides])

    def status_json(self, run: Path) -> dict[str, dict]:
        code, out, err = self.cli(["status", str(run), "--json"])
        assert code == 0, err
        return {row["kind"]: row for row in json.loads(out)["jobs"]}

    def resume(self, run: Path, *overrides: str) -> dict[str, str]:
        """``slurmft resume RUN``; the new train and consolidation job ids."""
        return self.started(["resume", str(run), *overrides])

    # --- watching a run (tests/slurm/jobs.py, tests/export_check.py) ----------------------
    metrics = staticmethod(jobs.metrics)
    wait_for = staticmethod(jobs.wait_for)
    complete = staticmethod(jobs.complete)
    rank_pids = staticmethod(jobs.rank_pids)
    rank_pid = staticmethod(jobs.rank_pid)
    assert_same_model = staticmethod(assert_same_model)


@pytest.fixture
def slurmft(capsys: pytest.CaptureFixture[str]) -> SlurmftDriver:
    """The CLI driver for one test."""
    return SlurmftDriver(capsys)


@pytest.fixture(scope="session")
def config_writer() -> SlurmftDriver:
    """A driver for fixtures wider than one test: ``write_config`` only (it captures no output)."""
    return SlurmftDriver(None)


@pytest.fixture(scope="session")
def reference(slurm_cluster, tiny_model: Path, chat_data: Path, tmp_path_factory: pytest.TempPathFactory,
              config_writer: SlurmftDriver) -> Path:
    """The uninterrupted run (REFERENCE_TRAIN/REFERENCE_CHECKPOINT) every interrupted one must equal: its
    consolidated model directory. One per session, shared by every test file that needs it. Its data is prepared
    by a prepare job with the default resources (8 CPUs: 8 processes tokenize and pack); the runs compared with it
    prepare in their allocation (one process) or in a prepare job of one CPU (test_container.py)."""
    from slurmft.config_loading import load_config
    from slurmft.profiles import load_profile
    from slurmft.submit.dispatch import submit_run

    tmp = tmp_path_factory.mktemp("reference")
    path = config_writer.write_config(tmp, tiny_model, chat_data, train=REFERENCE_TRAIN,
                                      checkpoint=REFERENCE_CHECKPOINT)
    cfg = load_config(path)
    jobs = submit_run(cfg, load_profile(cfg.cluster.profile), str(path)).jobs
    slurm_cluster.wait_state(jobs["prepare"], "COMPLETED", timeout=300)
    assert json.loads((tmp / "run" / "prepared" / "slurmft-prepared.json").read_text())["num_proc"] == 8
    slurm_cluster.wait_state(jobs["train"], "COMPLETED", timeout=300)
    slurm_cluster.wait_state(jobs["consolidate"], "COMPLETED", timeout=240)
    return tmp / "run" / "model"


@pytest.fixture
def slurm_calls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``squeue``/``sacct``/``scontrol`` first on PATH log each call to the returned file, then exec the real
    command: the answers are the real cluster's, the calls are counted."""
    import shutil

    bin_dir, calls = tmp_path / "counting-bin", tmp_path / "slurm-calls.txt"
    bin_dir.mkdir()
    calls.touch()
    for name in ("squeue", "sacct", "scontrol"):
        real = shutil.which(name)
        assert real, f"{name} not on PATH"
        exe = bin_dir / name
        # Jobs submitted from the test inherit PATH; their own calls (inside an allocation) do not count.
        exe.write_text(f'#!/bin/sh\n[ -n "${{SLURM_JOB_ID:-}}" ] || echo "{name} $*" >> "{calls}"\n'
                       f'exec "{real}" "$@"\n')
        exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return calls
