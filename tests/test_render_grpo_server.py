"""``grpo.rollouts: server`` rendered (slurmft/plan/grpo_layout.py, slurmft/plan/render.py, templates/train.sbatch.j2):
the allocation's last node runs TRL's vLLM server, the others train.

For 2+1 and 4+1 nodes: the golden script, shellcheck and ``bash -n``; the training step pinned to the first nodes
with its own task count, and each of its tasks' rank, world size and node count as the job reads them
(``JobEnv.from_environ``) from the variables Slurm gives a task of that step; the server step on the last node
with TRL's vllm-serve arguments; the server's address asked from the allocation in the batch shell; the
time-outs. The same layout on the real cluster: tests/slurm/test_grpo_layout.py. What the config refuses, each
with its field and fix, is at the end.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from slurmft.config_loading import load_config
from slurmft.errors import ConfigError
from slurmft.grpoopts import server_options
from slurmft.job.rendezvous import PORT_BASE, PORT_SPAN, JobEnv, port_for_job
from slurmft.job.vllm_server import serve_command
from slurmft.plan.render import render_scripts
from slurmft.profiles import load_profile
from slurmft.rundir import RunPaths
from tests.goldens import assert_matches_golden

HERE = Path(__file__).parent
CFG = HERE / "data" / "golden-grpo-server.yaml"


def train_script(*overrides: str) -> str:
    cfg = load_config(CFG, list(overrides))
    return render_scripts(cfg, load_profile(cfg.cluster.profile), RunPaths.of(cfg.output_dir),
                          "golden-grpo-server.yaml")["train"]


def srun_lines(script: str) -> list[list[str]]:
    """Each ``srun ... &`` line of the script, split as the shell splits it (the trailing ``&`` dropped)."""
    return [shlex.split(line.removesuffix(" &")) for line in script.splitlines() if line.startswith("srun ")]


def options(words: list[str]) -> dict[str, str]:
    return {w.split("=", 1)[0]: w.split("=", 1)[1] if "=" in w else "" for w in words if w.startswith("--")}


def step_task_env(step: dict[str, str], node: int, local: int, job_nodes: int) -> dict[str, str]:
    """The variables Slurm gives task ``local`` on the step's node ``node`` (block distribution, the default):
    SLURM_PROCID counts within the step, SLURM_NTASKS and SLURM_STEP_NUM_NODES are the step's, SLURM_JOB_NUM_NODES
    the allocation's."""
    per_node = int(step["--ntasks-per-node"])
    return {"SLURM_PROCID": str(node * per_node + local), "SLURM_NTASKS": step["--ntasks"],
            "SLURM_STEP_NUM_NODES": step["--nodes"], "SLURM_JOB_NUM_NODES": str(job_nodes),
            "SLURM_NNODES": step["--nodes"], "SLURM_NTASKS_PER_NODE": str(per_node), "SLURM_LOCALID": str(local),
            "SLURM_NODEID": str(node), "SLURM_JOB_ID": "4242", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "24242"}


@pytest.mark.parametrize(("nodes", "golden"), [(3, "train-grpo-server-2+1.sbatch"), (5, "train-grpo-server-4+1.sbatch")])
def test_train_nodes_and_the_server_node(nodes: int, golden: str, tmp_path: Path) -> None:
    train_nodes = nodes - 1
    text = train_script(f"resources.nodes={nodes}")
    assert_matches_golden(text, HERE / "golden" / golden)
    script = tmp_path / "train.sh"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    if shutil.which("shellcheck"):
        out = subprocess.run(["shellcheck", "-S", "warning", str(script)], capture_output=True, text=True)
        assert out.returncode == 0, out.stdout

    server, train = srun_lines(text)
    # the training step: the first nodes only, 8 ranks each, started before nothing reads a rank in the shell
    step = options(train)
    assert (step["--nodes"], step["--ntasks"], step["--relative"], step["--ntasks-per-node"]) == (
        str(train_nodes), str(8 * train_nodes), "0", "8")
    assert "$SLURM_PROCID" not in text and "${SLURM_PROCID" not in text and "SLURM_NODEID" not in text
    ranks = []
    for node in range(train_nodes):
        for local in range(8):
            env = JobEnv.from_environ(step_task_env(step, node, local, nodes))
            assert (env.world_size, env.num_nodes, env.node_rank, env.local_rank, env.local_world_size) == (
                8 * train_nodes, train_nodes, node, local, 8)
            ranks.append(env.rank)
    assert ranks == list(range(8 * train_nodes))  # every rank once: world size = training nodes x GPUs

    # the server step: one task on the last node, all of its CPUs and GPUs, TRL's vllm-serve for the run's model
    serve = options(server)
    assert (serve["--nodes"], serve["--ntasks"], serve["--relative"], serve["--cpus-per-task"]) == (
        "1", "1", str(train_nodes), str(8 * 12))
    assert "--gpu-bind" in serve
    command = server[server.index("/opt/venv/bin/python"):]
    assert command[:5] == ["/opt/venv/bin/python", "-m", "slurmft.job.vllm_server", "--signal=USR2", "--"]
    assert command[5:] == ["--model", "Qwen/Qwen2.5-7B-Instruct", "--tensor_parallel_size", "8",
                           "--gpu_memory_utilization", "0.9", "--dtype", "bfloat16", "--max_model_len", "1024"]
    # started before the training step, stopped after it, before the requeue decision reads the training's status
    lines = text.splitlines()
    started = [i for i, line in enumerate(lines) if line.startswith("srun ")]
    assert lines[started[0] + 1] == "server_pid=$!" and lines[started[1] + 1] == "srun_pid=$!"
    assert lines.index('kill "$server_pid" 2>/dev/null') < next(i for i, x in enumerate(lines) if "slurmft.job.requeue" in x)
    # the server's address from the allocation: node `train_nodes` (0-based), asked once in the batch shell
    assert f"-m slurmft.job.rendezvous exports --vllm-server-node={train_nodes})" in text
    # the time-outs the trainer gets (TRL's vllm_server_timeout; slurmft's limit on one weight sync)
    assert "export SLURMFT_VLLM_SERVER_TIMEOUT=600" in text and "export SLURMFT_VLLM_SYNC_TIMEOUT=900" in text
    assert f"nodes\n# 0-{train_nodes - 1} train ({8 * train_nodes} ranks); the trainer waits up to 600 s" in text


def test_without_the_server_the_train_step_has_the_whole_allocation() -> None:
    text = train_script("grpo.rollouts=transformers")
    (train,) = srun_lines(text)
    assert "--relative=0" not in train and not any(w.startswith(("--nodes", "--ntasks=")) for w in train)
    assert "exports)" in text and "SLURMFT_VLLM" not in text and "server_pid" not in text


def test_the_server_step_runs_in_the_runs_image_with_the_address_passed_in() -> None:
    text = train_script("cluster.container.runtime=pyxis", "cluster.container.image=/shared/images/trl.sqsh",
                        "cluster.container.python=/usr/bin/python")
    server, train = srun_lines(text)
    for step in (server, train):
        env = options(step)["--container-env"].split(",")
        assert {"MASTER_ADDR", "SLURMFT_VLLM_HOST", "SLURMFT_VLLM_PORT", "SLURMFT_VLLM_GROUP_PORT",
                "SLURMFT_VLLM_SERVER_TIMEOUT", "SLURMFT_VLLM_SYNC_TIMEOUT"} <= set(env), env
        assert options(step)["--container-image"] == "/shared/images/trl.sqsh"
    assert "/usr/bin/python -m slurmft.job.vllm_server --signal=USR2 --" in " ".join(server)


def test_the_servers_ports_differ_from_the_rendezvous_port() -> None:
    """HTTP on the server node (the job's rendezvous port: free there), the weight-sync group on training node 0
    beside MASTER_PORT, so half the span away; both inside the rendezvous range."""
    for job in ("1", "20001", "6001", "12767", "99999"):
        master, group = port_for_job(job), port_for_job(job, PORT_SPAN // 2)
        assert group != master and abs(group - master) == PORT_SPAN // 2
        assert PORT_BASE <= group < PORT_BASE + PORT_SPAN


def test_the_trainer_and_the_server_read_the_same_address() -> None:
    env = {"SLURMFT_VLLM_HOST": "10.0.0.9", "SLURMFT_VLLM_PORT": "24242", "SLURMFT_VLLM_GROUP_PORT": "30626",
           "SLURMFT_VLLM_SERVER_TIMEOUT": "600"}
    assert server_options(env) == {"use_vllm": True, "vllm_mode": "server", "vllm_server_host": "10.0.0.9",
                                   "vllm_server_port": 24242, "vllm_group_port": 30626, "vllm_server_timeout": 600.0}
    with pytest.raises(KeyError, match="SLURMFT_VLLM_HOST"):
        server_options({})
    name, command = serve_command(["--signal=USR1", "--", "--model", "m"], env, python="/py")
    assert name == "USR1"
    assert command == ["/py", "-m", "trl.scripts.vllm_serve", "--model", "m", "--host", "0.0.0.0", "--port", "24242"]
    with pytest.raises(SystemExit, match="SLURMFT_VLLM_PORT is not set"):
        serve_command(["--", "--model", "m"], {})


@pytest.mark.parametrize(("overrides", "expected"), [
    (["resources.nodes=1"], "grpo.rollouts: server takes the allocation's last 1 node(s) for vLLM and trains on the "
                            "others, but resources.nodes is 1; set resources.nodes to at least 2"),
    (["resources.gpus_per_node=0", "resources.tasks_per_node=8"],
     "grpo.rollouts: server syncs the trained weights to vLLM over NCCL, which needs GPUs"),
    (["grpo.server.tensor_parallel_size=16"], "grpo.server.tensor_parallel_size: 16 GPUs, but the server node has 8 "
                                              "(resources.gpus_per_node); set it to at most 8"),
    (["grpo.server.nodes=2", "resources.nodes=4"], "vLLM spreads one model over several nodes only through Ray"),
    # the generation batch holds whole groups on the training ranks only: 2 nodes x 8 x 4 = 64, not 3 x 8 x 4 = 96
    (["grpo.num_generations=48"], "grpo.num_generations: 48 does not divide the generation batch, 16 rank(s)"),
])
def test_layouts_that_cannot_work_are_refused(overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(CFG, overrides)
    assert expected in err.value.render(), err.value.render()


def test_the_training_ranks_are_counted_without_the_server_node() -> None:
    cfg = load_config(CFG, ["resources.nodes=5"])
    assert (cfg.train_nodes, cfg.train_world_size, cfg.resources.world_size) == (4, 32, 40)
    assert re.search(r"--ntasks=32\b", train_script("resources.nodes=5"))


def test_validate_refuses_the_server_with_what_is_built_and_what_is_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the job's Python is not asked (an image; None here) or has vLLM: the server renders and is wired but
    has never run on a GPU, so validate refuses it; SLURMFT_UNPROVEN_VLLM_SERVER=1 (the GPU check's gate) passes
    it, and only "1" does."""
    from slurmft.grpoopts import UNPROVEN_SERVER_ENV
    from slurmft.plan.grpo_checks import rollouts_problem

    monkeypatch.delenv(UNPROVEN_SERVER_ENV, raising=False)
    cfg = load_config(CFG)
    problem = rollouts_problem(cfg, None)
    assert problem is not None and problem.startswith(
        "grpo.rollouts: server renders (`slurmft render` writes the vLLM server's step and the training step on the "
        "other nodes) and its job side is wired (TRL's server mode, weight syncs under grpo.server.sync_timeout_s), "
        "but it has never run on a GPU")
    assert "set grpo.rollouts=transformers" in problem
    assert problem.endswith("SLURMFT_UNPROVEN_VLLM_SERVER=1 lets it through for the prepared GPU check "
                            "(bench/gpu_grpo_check.sh)")
    monkeypatch.setenv(UNPROVEN_SERVER_ENV, "yes")
    assert rollouts_problem(cfg, None) == problem
    monkeypatch.setenv(UNPROVEN_SERVER_ENV, "1")
    assert rollouts_problem(cfg, None) is None
