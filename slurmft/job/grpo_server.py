"""The train side of ``grpo.rollouts: server``: TRL's ``GRPOTrainer`` generating through the vLLM server that the
batch script started on the allocation's last node (slurmft/plan/grpo_layout.py, slurmft/job/vllm_server.py), its
weight syncs bounded by ``grpo.server.sync_timeout_s``.

What TRL 1.16 does in server mode (trl/generation/vllm_generation.py, trl/generation/vllm_client.py): training rank
0 alone holds a ``VLLMClient``; building the trainer waits for the server's ``/health`` (``vllm_server_timeout``:
a ``ConnectionError`` naming the URL), then ``init_communicator`` opens an NCCL group with the server's workers
(rank 0 joins as one more rank; a CUDA device only: it raises ``NotImplementedError`` on any other). Before each
generation after an optimizer step, ``VLLMGeneration.sync_weights`` walks the FSDP2 parameters on every rank
(``full_tensor()``: an all-gather each, every rank takes part) and rank 0 broadcasts them to the server over that
group. Neither the group's set-up nor a sync has a time limit in TRL: a server that never answers (a wrong port, a
firewall between the nodes, a worker that died inside NCCL) stalls every rank with no error (trl#6797, trl#2923).

What this module adds:

- :func:`server_config`: TRL's ``GRPOConfig`` arguments from the train step's variables
  (:func:`slurmft.grpoopts.server_options`), a missing one named;
- :func:`problems`: what this rank cannot do, before anything loads: no CUDA device (the sync is NCCL only), no
  vLLM, limits that would end after the collectives' time-out (the other ranks wait for rank 0 in one);
- :func:`deadline`: a watchdog thread armed around one call; when the call outlives ``timeout_s`` the job ends with
  an error that names the call, the server and the time (plus every thread's stack, for the hang), never a silent
  stall. It cannot interrupt a thread blocked inside NCCL, so it ends the process (exit 2, the house's exit for a
  failure slurmft names; the batch script does not requeue it). :func:`watch_init` arms it around
  ``VLLMClient.init_communicator`` while the trainer is built, :func:`watch_syncs` around every ``sync_weights``;
- :func:`seed_generation`: a per-generation ``seed`` in vLLM's sampling parameters (below);
- :func:`one_client`: one ``VLLMGeneration`` (one client, one NCCL group) per process. The job builds a second
  trainer when a checkpoint fails to load and it falls back to an older one (slurmft/job/checkpointing/
  fallback.py); TRL would open a second group with the same server on the same port.

Sampling: with vLLM the rollouts are vLLM's, not slurmft's :class:`~slurmft.job.grpo.SeededSampling`. TRL sends no
seed with a request (``VLLMClient.generate`` passes ``generation_kwargs`` only), so the server would draw from its
engine's RNG, whose state lives in the server process and moves with every request: a generation after a requeue
(a fresh server) would draw other completions. :func:`seed_generation` adds ``seed`` = f(``train.seed``, the
generation point); vLLM gives the ``n`` completions of a prompt the seeds ``seed + i`` (vllm/v1/engine/
parallel_sampling.py), each request its own generator. So a generation at the same point draws the same random
numbers on every attempt; the completions are equal as far as the server's logits are (bf16, batched with the other
prompts: not measured). Every prompt of a generation shares the one seed, so their draws are correlated across
prompts (not within a group, whose advantages are what GRPO compares). The rollouts saved in a checkpoint
(slurmft/job/grpo.py ``save_rollouts``) are unaffected: a resume inside a generation continues the same completions.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from slurmft.config import RunConfig
from slurmft.config_grpo import Rollouts
from slurmft.errors import JobSetupError
from slurmft.grpoopts import (
    VLLM_HOST_ENV,
    VLLM_PORT_ENV,
    VLLM_SERVER_ENV,
    VLLM_SYNC_TIMEOUT_ENV,
    VLLM_TIMEOUT_ENV,
    server_options,
)

log = logging.getLogger("slurmft.job")

EXIT_NAMED_FAILURE = 2  # slurmft.job.entrypoint.EXIT_SETUP_ERROR: an error slurmft names, not a traceback
SYNC_FIELD = "grpo.server.sync_timeout_s"


def is_server(cfg: RunConfig) -> bool:
    return cfg.grpo is not None and cfg.grpo.rollouts == Rollouts.SERVER


def problems(cuda_available: bool, environ: dict[str, str], collective_s: int) -> list[str]:
    """Why this rank cannot train with the server (empty: it can), found before the model loads: each of no CUDA
    device, no vLLM, limits that end after the collectives' time-out."""
    import importlib.util

    found = []
    if not cuda_available:
        found.append(f"grpo.rollouts: server pushes the trained weights to the vLLM server over NCCL (TRL's "
                     f"VLLMClient.init_communicator takes a CUDA device only) and this rank ({os.uname().nodename}) "
                     "sees no CUDA device; run it on GPU nodes (resources.gpus_per_node > 0), or set "
                     "grpo.rollouts=transformers")
    if importlib.util.find_spec("vllm") is None:  # TRL's VLLMClient imports vLLM's weight-transfer engine
        found.append(f"grpo.rollouts: server: vLLM is not importable in the job's Python {sys.executable} (TRL's "
                     "client of the server needs it on the training nodes too); install vllm there, or set "
                     "grpo.rollouts=transformers")
    timing = timing_problem(environ, collective_s)
    return [*found, timing] if timing else found


def timing_problem(environ: dict[str, str], collective_s: int) -> str | None:
    """The server's wait and the sync limit must end before the collectives' time-out: while rank 0 waits for the
    server and sets up the weight-sync group (building the trainer), or streams a sync, the other ranks wait for it in
    a collective, which would otherwise end them first with an unnamed NCCL time-out (and Slurm the rest)."""
    try:
        wait, sync = float(environ[VLLM_TIMEOUT_ENV]), float(environ[VLLM_SYNC_TIMEOUT_ENV])
    except (KeyError, ValueError):
        return None  # server_config names what is missing
    if wait + sync < collective_s:
        return None
    return (f"grpo.server.timeout_s + grpo.server.sync_timeout_s ({wait:g} + {sync:g} s) must stay under the "
            f"collectives' time-out ({collective_s} s, SLURMFT_COLLECTIVE_TIMEOUT): meanwhile the other ranks wait "
            "for rank 0 in a collective, which would stop them first with a time-out that does not name the "
            "server; lower them, or raise SLURMFT_COLLECTIVE_TIMEOUT (cluster.env)")


def server_config(environ: dict[str, str]) -> dict[str, Any]:
    """TRL's GRPOConfig arguments for the server, from the train step's variables; the batch script sets them all
    (a missing one: a script written by hand, or an image that was not passed them)."""
    wanted = (*VLLM_SERVER_ENV, VLLM_TIMEOUT_ENV, VLLM_SYNC_TIMEOUT_ENV)
    missing = [name for name in wanted if not environ.get(name)]
    if missing:
        raise JobSetupError(f"grpo.rollouts: server: {', '.join(missing)} not set in the train step; the rendered "
                            "batch script sets them (python -m slurmft.job.rendezvous exports --vllm-server-node=N, "
                            "and the time-outs from grpo.server): submit with slurmft, or export them")
    try:
        return server_options(environ)
    except ValueError as exc:
        raise JobSetupError(f"grpo.rollouts: server: a server variable is not a number ({exc})") from None


def address(environ: dict[str, str]) -> str:
    return f"http://{environ.get(VLLM_HOST_ENV, '?')}:{environ.get(VLLM_PORT_ENV, '?')}"


def sync_timeout(environ: dict[str, str]) -> float:
    return float(environ[VLLM_SYNC_TIMEOUT_ENV])


def fail_job(message: str) -> None:
    """The watchdog's end: the named error on stderr and in the log, every thread's stack (where it hangs), then
    the process ends with :data:`EXIT_NAMED_FAILURE` (a blocked NCCL call cannot be interrupted)."""
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
    log.error("%s", message)
    sys.stderr.write(f"slurmft rank {rank}: error: {message}\n")
    sys.stderr.flush()
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    os._exit(EXIT_NAMED_FAILURE)


def hang_message(call: str, server: str, timeout_s: float) -> str:
    return (f"{SYNC_FIELD}: {call} with the vLLM server at {server} did not finish in {timeout_s:g} s; the "
            "server's step log (the `vllm_server` lines of the train job's log) says whether it is alive; a firewall "
            "between the nodes, a wrong port or a server that died inside NCCL hang here. If a sync of this model "
            f"really takes longer, raise {SYNC_FIELD}")


@contextlib.contextmanager
def deadline(call: str, server: str, timeout_s: float,
             on_expiry: Callable[[str], None] = fail_job) -> Iterator[None]:
    """Run the body under a watchdog: past ``timeout_s`` it calls ``on_expiry`` with :func:`hang_message` (by
    default :func:`fail_job`). The thread is joined on the way out: a call that returns leaves none behind."""
    done = threading.Event()

    def watch() -> None:
        if not done.wait(timeout_s):
            on_expiry(hang_message(call, server, timeout_s))

    watcher = threading.Thread(target=watch, name=f"slurmft-watchdog {call}", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


def watched(call: str, server: str, timeout_s: float, function: Callable[..., Any],
            on_expiry: Callable[[str], None] = fail_job) -> Callable[..., Any]:
    """``function`` that runs under :func:`deadline` at every call."""
    def run(*args: Any, **kwargs: Any) -> Any:
        with deadline(call, server, timeout_s, on_expiry):
            return function(*args, **kwargs)

    run.__wrapped__ = function  # type: ignore[attr-defined]
    return run


@contextlib.contextmanager
def watch_init(environ: dict[str, str]) -> Iterator[None]:
    """While the trainer is built: TRL's ``VLLMClient.init_communicator`` (the NCCL group's set-up, rank 0) under
    the watchdog. The wait for the server before it is TRL's own (``vllm_server_timeout``)."""
    from trl.generation.vllm_client import VLLMClient

    original = VLLMClient.init_communicator
    VLLMClient.init_communicator = watched("VLLMClient.init_communicator (the weight-sync NCCL group's set-up)",
                                           address(environ), sync_timeout(environ), original)
    try:
        yield
    finally:
        VLLMClient.init_communicator = original


def watch_syncs(trainer: Any, environ: dict[str, str]) -> None:
    """Every weight sync of ``trainer`` (``VLLMGeneration.sync_weights``, on every rank) under the watchdog (once:
    a trainer built again reuses the first one's, :func:`one_client`)."""
    generation = trainer.vllm_generation
    if hasattr(generation.sync_weights, "__wrapped__"):
        return
    generation.sync_weights = watched("VLLMGeneration.sync_weights (a weight sync)", address(environ),
                                      sync_timeout(environ), generation.sync_weights)


_generation: list[Any] = []  # the process's one VLLMGeneration (:func:`one_client`)


@contextlib.contextmanager
def one_client() -> Iterator[None]:
    """While a trainer is built: TRL's ``VLLMGeneration`` made once per process, the same one handed to every later
    trainer (its client and NCCL group with the server stay; its model is the same sharded policy object, and the
    accelerator state it reads is the process's, shared by every Accelerator)."""
    import trl.trainer.grpo_trainer as grpo_trainer

    original = grpo_trainer.VLLMGeneration

    def first_or_made(*args: Any, **kwargs: Any) -> Any:
        if not _generation:
            _generation.append(original(*args, **kwargs))
        return _generation[0]

    grpo_trainer.VLLMGeneration = first_or_made
    try:
        yield
    finally:
        grpo_trainer.VLLMGeneration = original


def seed_generation(trainer: Any, seed: int) -> None:
    """vLLM's sampling seed for the generation about to be requested (``seed`` from the generation point; the
    module's docstring says what it makes reproducible)."""
    generation = trainer.vllm_generation
    generation.generation_kwargs = {**generation.generation_kwargs, "seed": seed}


def log_layout(environ: dict[str, str], started: float) -> None:
    log.info("grpo: rollouts from the vLLM server at %s (weight syncs limited to %g s, %s); trainer built in %.1f s",
             address(environ), sync_timeout(environ), SYNC_FIELD, time.time() - started)
