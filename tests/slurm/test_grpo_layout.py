"""``grpo.rollouts: server`` on the real Slurm cluster (tests/slurm/cluster.sh): the rendered train script at 1+1
nodes in the default two-node partition ``debug``, and at 2+1 and 4+1 in the five-node partition ``wide`` (the
layouts tests/test_render_grpo_server.py renders and checks without Slurm).

``sbatch --test-only`` accepts each script as rendered. Then the 1+1 and the 2+1 scripts run for real with only
the two commands swapped for a probe that records what each task sees: its node, its rank and world size as the
job reads them (``JobEnv.from_environ``), and the server's address the batch shell looked up from the allocation.
So the ``srun`` options of both steps, the rendezvous lookup and the wait/stop of the server step run as rendered,
on Slurm's own task placement. Neither vLLM nor TRL's server runs here: the server's weight sync needs CUDA and NCCL
(docs/grpo.md). 4+1 is accepted by ``--test-only`` but not run: a run at 2+1 already has training ranks on more than
one node and the server on a node of its own, and 4+1 would only add two more probe tasks' start-up.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from slurmft import slurm

pytestmark = pytest.mark.slurm

PROBE = """\
import json, os, sys
from slurmft.job.rendezvous import JobEnv

kind, out = sys.argv[1], sys.argv[2]
env = JobEnv.from_environ()
seen = {"kind": kind, "node": os.environ["SLURMD_NODENAME"], "job_nodes": os.environ["SLURM_JOB_NODELIST"],
        "rank": env.rank, "world_size": env.world_size, "num_nodes": env.num_nodes, "node_rank": env.node_rank,
        "local_rank": env.local_rank, "vllm_host": os.environ.get("SLURMFT_VLLM_HOST"),
        "vllm_port": os.environ.get("SLURMFT_VLLM_PORT"), "group_port": os.environ.get("SLURMFT_VLLM_GROUP_PORT"),
        "master_port": os.environ.get("MASTER_PORT"), "timeout": os.environ.get("SLURMFT_VLLM_SERVER_TIMEOUT"),
        "argv": sys.argv[3:]}
with open(os.path.join(out, f"{kind}-{env.rank}.json"), "w") as f:
    json.dump(seen, f)
"""

TASKS_PER_NODE = 2


def rendered(config_writer, tiny_model: Path, tmp_path: Path, nodes: int, partition: str | None = None) -> str:
    """The train script of a 2-ranks-per-node server run on ``nodes`` nodes (the last one serves), as written into
    the run directory. Not through ``validate``: it refuses ``rollouts: server`` until the layout has run on a GPU
    (docs/grpo.md), and what is checked here is the script."""
    from slurmft.config_loading import load_config
    from slurmft.plan.render import render_scripts
    from slurmft.profiles import load_profile
    from slurmft.rundir import RunPaths

    tmp_path.mkdir(exist_ok=True)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "What is 2 plus 2?", "answer": "4"}) + "\n")
    grpo = {"num_generations": 4, "max_completion_length": 8, "rollouts": "server",
            "rewards": [{"function": "exact_match"}]}
    cluster = {"partition": partition} if partition else {}
    path = config_writer.write_config(tmp_path, tiny_model, prompts, grpo=grpo, cluster=cluster,
                                      resources={"nodes": nodes, "tasks_per_node": TASKS_PER_NODE,
                                                 "gpus_per_node": TASKS_PER_NODE},
                                      train={"max_steps": 2, "per_device_batch_size": 2})
    cfg = load_config(path)
    return render_scripts(cfg, load_profile(cfg.cluster.profile), RunPaths.of(cfg.output_dir))["train"]


def accepted_by_test_only(text: str, tmp_path: Path) -> tuple[list[str], str]:
    """``sbatch --test-only`` of the script accepts it: the nodes and the partition Slurm says it would start on."""
    script = tmp_path / "train.sbatch"
    script.write_text(text)
    out = subprocess.run(["sbatch", "--test-only", str(script)], capture_output=True, text=True, timeout=60)
    # "sbatch: Job 3 to start at 2026-12-06T13:34:15 using 6 processors on nodes n[3-5] in partition wide"
    assert out.returncode == 0 and "to start at" in out.stderr, out.stderr
    nodes, _, partition = out.stderr.split(" on nodes ")[1].partition(" in partition ")
    return slurm.hostnames(nodes), partition.strip()


def probe_run(slurm_cluster, text: str, tmp_path: Path) -> dict[str, dict]:
    """Run the script with the ranks' and the server's commands swapped for the probe and no requeue decision; what
    each task saw, by ``train-RANK`` and ``server-0``."""
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
    script = tmp_path / "probe.sbatch"
    script.write_text(run)
    job = slurm_cluster.sbatch(str(script))
    assert slurm_cluster.wait_state(job, "COMPLETED", timeout=120) == "COMPLETED", slurm_cluster.describe(job)
    return {p.stem: json.loads(p.read_text()) for p in marks.glob("*.json")}


def assert_layout(seen: dict[str, dict], train_nodes: int, model: Path) -> None:
    """Each training rank once, on the allocation's first ``train_nodes`` nodes in rank order with the training
    step's world size and node count; the server alone on the last node with TRL's arguments; every task given the
    last node's NodeAddr and the ports from the allocation."""
    world = train_nodes * TASKS_PER_NODE
    assert set(seen) == {f"train-{r}" for r in range(world)} | {"server-0"}, sorted(seen)
    server = seen["server-0"]
    hosts = slurm.hostnames(server["job_nodes"])
    assert len(hosts) == train_nodes + 1, hosts
    train = [seen[f"train-{r}"] for r in range(world)]
    assert [(t["node"], t["rank"], t["local_rank"], t["node_rank"], t["world_size"], t["num_nodes"]) for t in train] \
        == [(hosts[r // TASKS_PER_NODE], r, r % TASKS_PER_NODE, r // TASKS_PER_NODE, world, train_nodes)
            for r in range(world)]
    assert (server["node"], server["world_size"], server["num_nodes"]) == (hosts[-1], 1, 1)
    assert server["argv"][:3] == ["--signal=USR2", "--", "--model"] and str(model) in server["argv"]
    host = slurm.node_addr(hosts[-1])
    assert host
    for task in [*train, server]:
        assert (task["vllm_host"], task["vllm_port"], task["timeout"]) == (host, task["master_port"], "600"), task
        assert task["group_port"] not in (None, task["master_port"])


def test_server_layout_on_the_two_node_partition(slurm_cluster, config_writer, tiny_model: Path,
                                                 tmp_path: Path) -> None:
    """1+1 in the default partition, as every other cluster test runs: both ranks on n1, the server on n2 (whose
    NodeAddr, 127.0.0.1 in tests/slurm/cluster.sh, every task gets)."""
    text = rendered(config_writer, tiny_model, tmp_path, nodes=2)
    assert "--partition" not in text
    assert accepted_by_test_only(text, tmp_path) == (["n1", "n2"], "debug")
    seen = probe_run(slurm_cluster, text, tmp_path)
    assert_layout(seen, 1, tiny_model)
    assert (seen["train-0"]["node"], seen["server-0"]["node"], seen["server-0"]["vllm_host"]) == (
        "n1", "n2", "127.0.0.1")


@pytest.mark.every_slurm
def test_server_layout_at_2_plus_1_and_4_plus_1(slurm_cluster, config_writer, tiny_model: Path,
                                                tmp_path: Path) -> None:
    """2+1 and 4+1 in the partition ``wide`` (n1-n5): ``--test-only`` accepts both, on 3 and on 5 nodes; 2+1 runs.
    Which 3 nodes Slurm picks depends on what n1 and n2 are busy with (a job still completing there sends it to
    n3-n5), so the layout is checked against the allocation's own node list."""
    wide = {}
    for nodes in (3, 5):
        wide[nodes] = rendered(config_writer, tiny_model, tmp_path / f"{nodes}", nodes=nodes, partition="wide")
        assert "#SBATCH --partition=wide" in wide[nodes] and f"#SBATCH --nodes={nodes}" in wide[nodes]
        hosts, partition = accepted_by_test_only(wide[nodes], tmp_path / f"{nodes}")
        assert (len(set(hosts)), partition) == (nodes, "wide"), hosts
    seen = probe_run(slurm_cluster, wide[3], tmp_path / "3")
    assert_layout(seen, 2, tiny_model)
