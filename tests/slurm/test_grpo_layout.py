"""``grpo.rollouts: server`` on the real two-node cluster: the rendered train script, 1 training node + 1 server
node (the largest split two nodes allow; 2+1 and 4+1 are rendered and checked in tests/test_render_grpo_server.py).

``sbatch --test-only`` accepts the script as rendered. Then the same script runs for real with only the two
commands swapped for a probe that records what each task sees: its node, its rank and world size as the job reads
them (``JobEnv.from_environ``), and the server's address the batch shell looked up from the allocation. So the
``srun`` options of both steps, the rendezvous lookup and the wait/stop of the server step run as rendered, on
Slurm's own task placement. Neither vLLM nor TRL's server runs here: the server's weight sync needs CUDA and NCCL
(docs/grpo.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

PROBE = """\
import json, os, sys
from slurmft.job.rendezvous import JobEnv

kind, out = sys.argv[1], sys.argv[2]
env = JobEnv.from_environ()
seen = {"kind": kind, "node": os.environ["SLURMD_NODENAME"], "rank": env.rank, "world_size": env.world_size,
        "num_nodes": env.num_nodes, "local_rank": env.local_rank, "vllm_host": os.environ.get("SLURMFT_VLLM_HOST"),
        "vllm_port": os.environ.get("SLURMFT_VLLM_PORT"), "group_port": os.environ.get("SLURMFT_VLLM_GROUP_PORT"),
        "master_port": os.environ.get("MASTER_PORT"), "timeout": os.environ.get("SLURMFT_VLLM_SERVER_TIMEOUT"),
        "argv": sys.argv[3:]}
with open(os.path.join(out, f"{kind}-{env.rank}.json"), "w") as f:
    json.dump(seen, f)
"""


def test_server_layout_on_the_real_cluster(slurm_cluster, config_writer, tiny_model: Path, tmp_path: Path) -> None:
    from slurmft.config_loading import load_config
    from slurmft.plan.render import render_scripts
    from slurmft.profiles import load_profile
    from slurmft.rundir import RunPaths

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "What is 2 plus 2?", "answer": "4"}) + "\n")
    grpo = {"num_generations": 4, "max_completion_length": 8, "rollouts": "server",
            "rewards": [{"function": "exact_match"}]}
    path = config_writer.write_config(tmp_path, tiny_model, prompts, grpo=grpo,
                                      resources={"tasks_per_node": 2, "gpus_per_node": 2},
                                      train={"max_steps": 2, "per_device_batch_size": 2})
    cfg = load_config(path)
    text = render_scripts(cfg, load_profile(cfg.cluster.profile), RunPaths.of(cfg.output_dir))["train"]
    script = tmp_path / "train.sbatch"
    script.write_text(text)
    out = subprocess.run(["sbatch", "--test-only", str(script)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "to start at" in out.stderr, out.stderr

    # the same script, run: the ranks' and the server's commands swapped for the probe, no requeue decision
    (tmp_path / "probe.py").write_text(PROBE)
    marks = tmp_path / "marks"
    marks.mkdir()
    probe = f"{sys.executable} {tmp_path / 'probe.py'}"
    lines = []
    for line in text.splitlines():
        if line.startswith("srun ") and " -m slurmft.job.vllm_server " in line:
            options, _, args = line.partition(f"{sys.executable} -m slurmft.job.vllm_server ")
            line = f"{options}{probe} server {marks} {args}"
        elif line.startswith("srun ") and " -m slurmft.job.launch " in line:
            line = f"{line.partition(sys.executable)[0]}{probe} train {marks} &"
        elif "slurmft.job.requeue" in line:
            line = 'exit "$rc"'
        lines.append(line)
    run = "\n".join(lines) + "\n"
    assert run.count(probe) == 2, run
    (tmp_path / "run" / "logs").mkdir(parents=True)
    script.write_text(run)
    job = slurm_cluster.sbatch(str(script))
    assert slurm_cluster.wait_state(job, "COMPLETED", timeout=120) == "COMPLETED"

    seen = {p.stem: json.loads(p.read_text()) for p in marks.glob("*.json")}
    assert set(seen) == {"train-0", "train-1", "server-0"}, seen
    train = [seen["train-0"], seen["train-1"]]
    server = seen["server-0"]
    # the training step: both ranks on the first node, world size 2 (that node's 2 ranks), one node
    assert [(t["node"], t["rank"], t["local_rank"], t["world_size"], t["num_nodes"]) for t in train] == [
        ("n1", 0, 0, 2, 1), ("n1", 1, 1, 2, 1)]
    # the server step: one task on the last node, TRL's arguments for the run's model after the probe's own
    assert (server["node"], server["world_size"]) == ("n2", 1)
    assert server["argv"][:3] == ["--signal=USR2", "--", "--model"] and str(tiny_model) in server["argv"]
    # every task got the server's address from the allocation: n2's NodeAddr (tests/slurm/cluster.sh: 127.0.0.1)
    host = slurm_cluster.slurm("scontrol", "show", "node", "n2").split("NodeAddr=")[1].split()[0]
    for task in [*train, server]:
        assert (task["vllm_host"], task["vllm_port"], task["timeout"]) == (host, task["master_port"], "600"), task
        assert task["group_port"] not in (None, task["master_port"])
