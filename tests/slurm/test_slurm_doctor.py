"""``slurmft doctor`` and ``doctor --job`` on the real two-node cluster: every check answered and ok on the
shared test cluster (local-test profile), then a second cluster instance started with settings that must be
caught (KillWait 2 s against a run whose projected save is longer, accounting without job_comment, a run
directory on a node-local filesystem) and a user template that renders ``--signal=B:``. The verdicts on
recorded output, without a cluster: tests/test_doctor.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurmft.job.rendezvous import free_port
from tests.conftest import REPO_ROOT, need_model_job_python, second_cluster

TINY_TASK = REPO_ROOT / "examples" / "tiny" / "tasks" / "tiny_choice.yaml"

pytestmark = pytest.mark.slurm

# The ~1.1 B-parameter Llama shape of the misconfigured run: only config.json exists (estimate and doctor read
# nothing else); its projected fp32 checkpoint (~13 GB over 2 nodes at the profile's write speed) takes ~6.6 s.
BIG_MODEL = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 2048,
             "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4,
             "vocab_size": 32000, "max_position_embeddings": 2048, "tie_word_embeddings": False}
B_SIGNAL_PARTIAL = ('{% for directive in directives %}\n'
                    '#SBATCH {{ directive | replace("--signal=", "--signal=B:") }}\n{% endfor %}\n')
PROBE_CHECKS = {"probe", "slurmft version", "python [n1]", "python [n2]", "profile variables", "run dir [n1]",
                "run dir [n2]", "HF_HOME [n1]", "HF_HOME [n2]", "scontrol in batch", "MASTER_ADDR", "all-reduce",
                "warning signal"}
LOGIN_CHECKS = {"slurm", "accounting", "job_comment", "MinJobAge", "partition", "preemption", "requeue delay", "node memory",
                "MaxTime", "gpus", "lead time", "KillWait"}


@pytest.fixture
def probe_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """MASTER_PORT derives from the job id; a second cluster on this machine starts at job 1 again, so its
    probe would share a port with the first cluster's job 1: a free port of our own (sbatch passes the
    environment on). And HOME in tmp_path: the probe's directory (kept when something is a problem) and the
    ranks' default HF_HOME go there, not into the real home."""
    monkeypatch.setenv("SLURMFT_MASTER_PORT", str(free_port()))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


def doctor_json(slurmft, *args: str) -> tuple[int, dict[str, dict]]:  # noqa: ANN001 - the SlurmftDriver fixture
    code, out, err = slurmft.cli(["doctor", "--json", *args])
    data = json.loads(out)
    assert data["exit_code"] == code, (out, err)
    return code, {line["check"]: line for line in data["lines"]}


def test_doctor_and_its_probe_on_the_test_cluster(slurm_cluster, tiny_model: Path, chat_data: Path, tmp_path: Path,
                                                  slurmft, probe_env: None) -> None:
    path = slurmft.write_config(tmp_path, tiny_model, chat_data)
    code, lines = doctor_json(slurmft, str(path))
    assert code == 0 and set(lines) == LOGIN_CHECKS, lines
    # with the jobs after consolidation: the probe asks their interpreters on every node too
    vllm, lm_eval = need_model_job_python("serve"), need_model_job_python("eval")
    path = slurmft.write_config(tmp_path, tiny_model, chat_data, serve={"python": vllm},
                                eval={"python": lm_eval, "tasks": [str(TINY_TASK)]})
    code, lines = doctor_json(slurmft, "--job", str(path))
    assert set(lines) == LOGIN_CHECKS | PROBE_CHECKS | {"serve.python", "eval.python"}, sorted(lines)
    assert code == 0 and {c: x for c, x in lines.items() if x["level"] != "ok"} == {}, lines
    assert lines["serve.python"]["text"] == f"{vllm} finds vLLM 0.32.0 on n1, n2"
    assert lines["eval.python"]["text"] == f"{lm_eval} finds lm-eval 0.4.13 on n1, n2"
    assert "reached all 2 rank(s)" in lines["warning signal"]["text"]
    assert "shared by every node" in lines["run dir [n2]"]["text"]
    assert "bus bandwidth" in lines["all-reduce"]["text"]
    assert not (tmp_path / "run").exists()  # the probe writes nothing into the output_dir (submit would refuse it)
    assert list((tmp_path / "home" / ".cache" / "slurmft" / "doctor").iterdir()) == []  # removed: all ok
    assert lines["HF_HOME [n1]"]["text"].startswith(str(tmp_path / "home" / ".cache" / "huggingface"))


@pytest.fixture
def misconfigured_cluster(slurm_cluster, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A second two-node cluster (own directory, port +100): KillWait=2, no AccountingStoreFlags, and a
    directory each node sees as its own tmpfs. Its node-local directory is yielded; SLURM_CONF points at it."""
    knobs = {"SLURMFT_CLUSTER_KILLWAIT": "2", "SLURMFT_CLUSTER_STORE_FLAGS": "",
             "SLURMFT_CLUSTER_NODE_LOCAL": "{base}/node-local"}
    with second_cluster("misconfigured", 100, knobs) as base:
        monkeypatch.setenv("SLURM_CONF", str(base / "cluster" / "etc" / "slurm.conf"))
        yield base / "node-local"


def test_doctor_catches_a_misconfigured_cluster_and_a_b_signal(misconfigured_cluster: Path, chat_data: Path,
                                                               tmp_path: Path, slurmft, probe_env: None) -> None:
    model = tmp_path / "big-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(BIG_MODEL))
    templates = tmp_path / "templates" / "partials"
    templates.mkdir(parents=True)
    (templates / "directives.j2").write_text(B_SIGNAL_PARTIAL)
    path = slurmft.write_config(tmp_path, model, chat_data)
    run_dir = misconfigured_cluster / "run"
    code, lines = doctor_json(slurmft, "--job", "--template-dir", str(templates.parent), str(path),
                              f"output_dir={run_dir}")
    problems = {c: x for c, x in lines.items() if x["level"] == "problem"}
    assert code == 1
    assert set(problems) == {"KillWait", "job_comment", "run dir [n1]", "run dir [n2]", "warning signal"}, problems
    assert "2 s after SIGTERM (KillWait)" in problems["KillWait"]["text"]
    assert "KillWait >= " in problems["KillWait"]["fix"]
    assert "job_comment" in problems["job_comment"]["fix"]
    for node, other in (("n1", "n2"), ("n2", "n1")):
        assert f"files written on {other} are not seen on {node}" in problems[f"run dir [{node}]"]["text"]
        assert "every node shares" in problems[f"run dir [{node}]"]["fix"]
    assert "batch shell only" in problems["warning signal"]["text"]
    assert "drop 'B:'" in problems["warning signal"]["fix"]
    # what is right on that cluster stays ok: the probe answered every check
    assert set(lines) >= PROBE_CHECKS and lines["MASTER_ADDR"]["level"] == "ok"
    assert lines["scontrol in batch"]["level"] == "ok" and lines["lead time"]["level"] == "ok"
    kept = list((tmp_path / "home" / ".cache" / "slurmft" / "doctor").glob("it-*/probe.log"))
    assert len(kept) == 1  # a probe with problems keeps its directory and log for a look
