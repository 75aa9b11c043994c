"""A checkpoint whose sizes match its marker but whose bytes do not load: every rank falls back together.

One real two-rank FSDP2 run (gloo) of 10 steps with a checkpoint every 4 gets the warning signal a
few steps in, so it saves at step S and stops with two complete checkpoints: the periodic one before
S and checkpoint-S. Then a shard of checkpoint-S is overwritten in place with the same number of
bytes (discovery's size check cannot see it):

1. with the older checkpoint's ``rng_state_1.pth`` damaged the same way too (read by rank 1 alone,
   after the model and optimizer loaded: rank 0 would walk into the first step), the requeued job
   loads neither and stops on both ranks with an error naming both (it does not train from step 0
   and does not hang), moving nothing;
2. with that file restored, the next attempt logs the failed load of checkpoint-S, falls back to the
   older one, repeats the steps after it with the same losses as the first attempt (bitwise: a
   strict load of the older checkpoint, nothing of the failed one left), sets checkpoint-S aside and
   finishes, and rotation keeps the checkpoint it fell back to.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from .helpers import launch_like_srun, read_metrics, write_run

MAX_STEPS = 10
EVERY = 4
SETTINGS = [f"train.max_steps={MAX_STEPS}", f"checkpoint.every_steps={EVERY}", "checkpoint.keep_last=2",
            "data.max_seq_length=64"]


def _overwrite_in_place(path: Path) -> bytes:
    """Same length, other bytes (a torn page, a bad disk block): what the marker's sizes cannot catch."""
    original = path.read_bytes()
    with open(path, "r+b") as f:
        f.write(b"\xff" * len(original))
    assert path.stat().st_size == len(original)
    return original


def test_load_errors_read_in_one_line() -> None:
    import pickle

    from torch.distributed.checkpoint.api import CheckpointException

    from slurmft.job.checkpointing.failures import reason

    garbage = pickle.UnpicklingError("Weights only load failed. In PyTorch 2.6, we changed the default value ...\n"
                                     "WeightsUnpickler error: \n\nUnsupported operand 255\n\nCheck the documentation")
    exc = CheckpointException("read", {1: (garbage, None)})
    assert reason(exc) == "rank 1: UnpicklingError: Unsupported operand 255"
    long = RuntimeError("PytorchStreamReader failed reading zip archive: failed finding central directory. This is an "
                        "internal miniz error. If you are seeing this error, there is a high likelihood that your "
                        "checkpoint file is corrupted.")
    assert reason(long) == ("RuntimeError: PytorchStreamReader failed reading zip archive: failed finding central "
                            "directory.")


@pytest.mark.train
def test_a_checkpoint_that_does_not_load_falls_back_to_the_previous_one(micro_model: Path, job_env: dict[str, str],
                                                                       tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", micro_model, SETTINGS)
    root = run / "checkpoints"
    job = launch_like_srun(run, job_env, job_id="77", restart=0)
    deadline = time.time() + 180
    while time.time() < deadline and job.running():
        if any(m["step"] > EVERY for m in read_metrics(run)):
            break
        time.sleep(0.1)
    assert job.running(), job.log_path.read_text()[-4000:]
    for pid in job.ranks():
        os.kill(pid, signal.SIGUSR2)
    rc, out = job.wait(timeout=120)
    assert rc == 0, out[-4000:]
    first = read_metrics(run)
    newest = first[-1]["step"]
    assert EVERY < newest < MAX_STEPS, out[-3000:]
    names = sorted((p.name for p in root.glob("checkpoint-*")), key=lambda n: int(n.split("-")[1]))
    assert len(names) == 2 and names[-1] == f"checkpoint-{newest}", names
    previous = int(names[0].split("-")[1])
    bad_shard = root / f"checkpoint-{newest}" / "pytorch_model_fsdp_0" / "__1_0.distcp"
    _overwrite_in_place(bad_shard)

    # 1. nothing loads: a clear error on every rank, no step trained, every checkpoint left where it is
    rng_file = root / f"checkpoint-{previous}" / "rng_state_1.pth"
    saved_bytes = _overwrite_in_place(rng_file)
    rc, out = launch_like_srun(run, job_env, job_id="77", restart=1).wait(timeout=120)
    assert rc == 2, out[-4000:]
    assert len(re.findall(r"slurmft rank \d: setup error: no checkpoint in \S+ could be loaded", out)) == 2, out[-3000:]
    assert re.search(rf"  - checkpoint-{newest}: the model \(pytorch_model_fsdp_0/\): rank 1: UnpicklingError", out)
    assert re.search(rf"  - checkpoint-{previous}: the random generator state \(rng_state_<rank>.pth\): .+ "
                     r"\(on rank 1\)\n", out), out[-3000:]
    assert read_metrics(run) == first
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == sorted(names)

    # 2. the older one loads: fall back to it, repeat its steps exactly, finish
    rng_file.write_bytes(saved_bytes)
    rc, out = launch_like_srun(run, job_env, job_id="77", restart=2).wait(timeout=180)
    assert rc == 0, out[-4000:]
    assert re.search(rf"could not load checkpoint-{newest}: the model \(pytorch_model_fsdp_0/\): rank 1: "
                     r"UnpicklingError", out), out[-3000:]
    assert f"falling back to checkpoint-{previous}" in out
    assert f"set checkpoint-{newest} aside as unloadable-checkpoint-{newest}" in out
    assert len(re.findall(rf"slurmft rank \d: completed at step {MAX_STEPS}", out)) == 2, out[-3000:]
    resumed = [m for m in read_metrics(run) if m["restart"] == 2]
    assert [m["step"] for m in resumed] == list(range(previous + 1, MAX_STEPS + 1))
    before = {m["step"]: m for m in first}
    for m in resumed:
        if m["step"] in before:  # done twice: from the live state, then from the checkpoint fallen back to
            ref = before[m["step"]]
            assert (m["loss"], m["grad_norm"], m["learning_rate"]) == (ref["loss"], ref["grad_norm"],
                                                                       ref["learning_rate"]), m["step"]
    left = sorted(p.name for p in root.iterdir() if p.is_dir())
    assert f"checkpoint-{previous}" in left  # rotation keeps the one it fell back to (keep_last is 2)
    assert f"checkpoint-{MAX_STEPS}" in left and not [n for n in left if "unloadable" in n], left
    assert (root / f"checkpoint-{MAX_STEPS}" / "COMPLETE").is_file()
    shutil.rmtree(run / "checkpoints")  # the shards: do not leave them in the temp dir


# A CompleteCheckpoints on a one-rank gloo group in a fresh interpreter: the script's body has ``root`` (the test's
# tmp_path), ``saver(**kwargs)`` (a saver with those CompleteCheckpoints arguments) and ``failed_write(step)`` (a Save
# whose background write failed with ENOSPC, as a DCP CheckpointException carried by the write's future).
ONE_RANK_SAVER = """
import json, time
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
import torch, torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from slurmft.errors import CheckpointError
from slurmft.job.checkpointing.complete import CompleteCheckpoints
from slurmft.job.checkpointing.writing import Save
from slurmft.job.distributed import DistContext
from slurmft.job.rendezvous import JobEnv

root = Path(ROOT)
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
env = JobEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0, num_nodes=1, job_id="1",
             restart_count=0, master_addr="127.0.0.1", master_port=0, launcher="local")
ctx = DistContext(env=env, device=torch.device("cpu"), backend="gloo", collective_timeout_s=30)


def saver(**kwargs):
    return CompleteCheckpoints(ctx, kwargs.pop("model_config", None), None, kwargs.pop("tokenizer", None),
                               keep_last=2, info={}, asynchronous=True, **kwargs)


def failed_write(step):
    future = Future()
    future.set_exception(CheckpointException("write", {0: (OSError(28, "No space left on device"), None)}))
    return Save(step=step, directory=root / f"checkpoint-{step}", started=time.time(), future=future)
"""


def _one_rank_saver(root: Path, body: str) -> subprocess.CompletedProcess[str]:
    """Run ``body`` after :data:`ONE_RANK_SAVER` in a fresh interpreter; its process group is left at the end."""
    script = ONE_RANK_SAVER.replace("ROOT", repr(str(root))) + textwrap.dedent(body) + "\ndist.destroy_process_group()\n"
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})


def test_asynchronous_saves_failing_in_a_row_stop_the_run(tmp_path: Path) -> None:
    """The counting rule of ``checkpoint.max_failed_saves`` on a one-rank gloo group: a failed background write
    (a DCP CheckpointException carried by the write's future) is logged and training goes on; the N-th failure
    in a row raises CheckpointError naming the field and the cause.
    (Two ranks with a failing write: test_train_cpu.py's reference run.)"""
    proc = _one_rank_saver(tmp_path, """
        checkpoints = saver(max_failed_saves=2)

        def failed(step):
            checkpoints.pending = failed_write(step)
            return checkpoints.finish_pending()

        assert failed(10) is False and checkpoints.failed_in_a_row == 1
        try:
            failed(20)
        except CheckpointError as exc:
            print(exc.render())
        else:
            raise SystemExit("no CheckpointError")
        checkpoints.close()
    """)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 asynchronous saves in a row failed (checkpoint.max_failed_saves=2)" in proc.stdout, proc.stdout
    assert "checkpoint-20: rank 0: OSError: [Errno 28] No space left on device" in proc.stdout, proc.stdout
    assert "slurmft resume RUN_DIR checkpoint.async=false" in proc.stdout  # which resume accepts (issue 47)
    assert "asynchronous save of checkpoint-10 failed (1 in a row" in proc.stderr, proc.stderr


def test_the_final_save_comes_before_the_failed_saves_limit(tmp_path: Path) -> None:
    """A stop (or max_steps) right after a background write failed for the ``max_failed_saves``-th time in a row:
    the stop's own synchronous save is made first and, having succeeded, ends the streak; nothing raises and the
    work since the last checkpoint is kept (before issue 45 the limit raised before the stop's save was tried)."""
    proc = _one_rank_saver(tmp_path, """
        from transformers import LlamaConfig

        tokenizer = SimpleNamespace(save_pretrained=lambda d: (Path(d) / "tokenizer.json").write_text("{}"))
        checkpoints = saver(model_config=LlamaConfig(), tokenizer=tokenizer, max_failed_saves=1)

        def write(model, trial):  # what the Trainer's _save_checkpoint leaves: some files in checkpoint-<step>
            out = root / f"checkpoint-{trainer.state.global_step}"
            out.mkdir(parents=True)
            (out / "trainer_state.json").write_text(json.dumps({"global_step": trainer.state.global_step}))

        trainer = SimpleNamespace(state=SimpleNamespace(global_step=11), args=SimpleNamespace(output_dir=str(root)),
                                  control=SimpleNamespace(should_training_stop=True), _save_checkpoint=write)
        checkpoints.watch(trainer)
        checkpoints.pending = failed_write(10)
        trainer._save_checkpoint(None, None)  # the stop's save, with the failure pending
        checkpoints.on_save(trainer.args, trainer.state, trainer.control)
        print("complete:", (root / "checkpoint-11" / "COMPLETE").is_file(), "streak:", checkpoints.failed_in_a_row)
        checkpoints.close()
    """)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "complete: True streak: 0" in proc.stdout, proc.stdout
    assert "asynchronous save of checkpoint-10 failed (1 in a row" in proc.stderr, proc.stderr
    assert "the final save is made synchronously first" in proc.stderr, proc.stderr


def test_dcp_never_checks_the_crc32_it_writes_so_saves_skip_it(tmp_path: Path) -> None:
    """Why :func:`skip_unchecked_crc32` loses nothing: with the CRC written (torch's default), a flipped byte in a
    DCP shard still loads, silently wrong; only sizes (the COMPLETE marker) and fsyncs protect a save. Without
    the CRC, a save loads back equal."""
    import struct

    import torch
    import torch.distributed.checkpoint as dcp
    import torch.utils.serialization.config as serialization

    from slurmft.job.checkpointing.writing import skip_unchecked_crc32

    state = {"w": torch.full((1024,), 1234.5), "b": torch.arange(16, dtype=torch.float32)}
    was = serialization.save.compute_crc32
    try:
        serialization.save.compute_crc32 = True
        dcp.save(state, checkpoint_id=tmp_path / "with-crc")
        shard = next((tmp_path / "with-crc").glob("*.distcp"))
        data = bytearray(shard.read_bytes())
        at = data.find(struct.pack("<f", 1234.5))
        assert at >= 0
        data[at + 3] ^= 0x01  # one bit of the first value's exponent: 1234.5 becomes another number
        shard.write_bytes(bytes(data))
        loaded = {"w": torch.zeros(1024), "b": torch.zeros(16)}
        dcp.load(loaded, checkpoint_id=tmp_path / "with-crc")  # no error: the CRC-32 is never checked
        assert loaded["w"][0].item() != 1234.5 and torch.equal(loaded["w"][1:], state["w"][1:])

        skip_unchecked_crc32()
        assert serialization.save.compute_crc32 is False
        dcp.save(state, checkpoint_id=tmp_path / "without-crc")
        loaded = {"w": torch.zeros(1024), "b": torch.zeros(16)}
        dcp.load(loaded, checkpoint_id=tmp_path / "without-crc")
        assert all(torch.equal(loaded[k], state[k]) for k in state)
    finally:
        serialization.save.compute_crc32 = was
