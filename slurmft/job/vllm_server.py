"""The vLLM server step of ``grpo.rollouts: server``: TRL's ``vllm-serve`` on the allocation's last node.

``python -m slurmft.job.vllm_server --signal=USR2 -- ARGS`` ignores Slurm's warning signal and then becomes
``python -m trl.scripts.vllm_serve ARGS --host 0.0.0.0 --port PORT`` (``exec``: the same process, so Slurm's
SIGTERM still reaches it). Why the wrapper: ``--signal=USR2@N`` signals every task of the job, and SIGUSR2's
default action ends a process, so an unwrapped server would die at the warning while the training ranks, inside a
generation, still need it to reach their save; an ignored signal stays ignored across ``exec``. The port is read
here, from the batch shell's rendezvous exports (:data:`slurmft.grpoopts.VLLM_PORT_ENV`), so the script never
expands a variable into the command. Light: no torch, no TRL import before the ``exec``.
"""

from __future__ import annotations

import os
import signal
import sys

from slurmft.grpoopts import VLLM_HOST_ENV, VLLM_PORT_ENV

TRL_SERVE_MODULE = "trl.scripts.vllm_serve"


def serve_command(argv: list[str], environ: dict[str, str], python: str = sys.executable) -> tuple[str, list[str]]:
    """(the warning signal's name, the command that serves): ``argv`` is ``--signal=NAME -- TRL ARGS``."""
    name = "USR2"
    if argv and argv[0].startswith("--signal="):
        name, argv = argv[0].split("=", 1)[1], argv[1:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    port = environ.get(VLLM_PORT_ENV)
    if not port:
        raise SystemExit(f"[slurmft] {VLLM_PORT_ENV} is not set: the batch script's rendezvous lookup sets it "
                         "(python -m slurmft.job.rendezvous exports --vllm-server-node=N)")
    return name, [python, "-m", TRL_SERVE_MODULE, *argv, "--host", "0.0.0.0", "--port", port]


def main(argv: list[str] | None = None) -> int:
    name, command = serve_command(sys.argv[1:] if argv is None else argv, dict(os.environ))
    signal.signal(getattr(signal, f"SIG{name.upper().removeprefix('SIG')}"), signal.SIG_IGN)
    print(f"[slurmft] vLLM server for the GRPO trainer at {os.environ.get(VLLM_HOST_ENV, '?')}:{command[-1]} "
          f"({name} ignored): {' '.join(command)}", flush=True)
    os.execv(command[0], command)
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
