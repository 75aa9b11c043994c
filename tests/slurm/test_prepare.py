"""The prepare job on the real two-node cluster (prepare.enabled; slurmft/job/prepare.py, docs/prepare.md).

* submit chains prepare (one CPU task, no GPU gres) -> train (afterok) -> consolidate: that run (preempted once,
  bitwise equal to the shared in-allocation ``reference`` run) is tests/slurm/test_container.py's, whose three
  jobs run in an image; one run serves both (CI time);
* a row that only TRL's preparation refuses (a chat template that raises on it, past the rows checked up
  front): the prepare job fails, Slurm cancels the train job before it starts and then its consolidation job
  (``--kill-on-invalid-dep``: nothing is left pending in DependencyNeverSatisfied) and ``status`` says why; ``resume`` then prepares again and re-chains the rest, ``cancel`` cancels all three;
  a source changed after ``slurmft prepare``: ``resume`` refuses with the fix and submits nothing; after
  ``slurmft prepare`` again, ``resume`` trains without a prepare job.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slurmft.rundir import RunPaths, read_manifest
from tests.slurm.jobs import sacct_fields, started_jobs

pytestmark = pytest.mark.slurm

PREPARE = {"enabled": True, "resources": {"cpus_per_task": 1, "mem": "2G", "time": "00:10:00"}}


BAD_TEMPLATE = (
    "{% for message in messages %}{% if 'REFUSED' in message['content'] %}"
    "{{ raise_exception('the template refuses this row') }}{% endif %}"
    "{% if message['role'] == 'assistant' %}<|im_start|>assistant\n{% generation %}{{ message['content'] }}"
    "<|im_end|>{% endgeneration %}\n{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_failed_prepare_job_cancels_the_train_job_and_resume_prepares_again(
        slurm_cluster, tiny_model: Path, chat_data: Path, tmp_path: Path, slurmft) -> None:
    rows = chat_data.read_text().splitlines()[:80]
    bad = json.dumps({"conversations": ["Say REFUSED.", "REFUSED."]})
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(rows[:40] + [bad] + rows[40:]) + "\n")  # past the 16 rows checked up front
    template = tmp_path / "template.jinja"
    template.write_text(BAD_TEMPLATE)
    path = slurmft.write_config(tmp_path, tiny_model, data, prepare=PREPARE,
                                train={"max_steps": 2, "sft": {"chat_template_path": str(template)}})
    code, out, err = slurmft.cli(["submit", str(path)])
    assert code == 0, err
    jobs = started_jobs(out)
    run = tmp_path / "run"
    slurm_cluster.wait_state(jobs["prepare"], "FAILED", timeout=240)
    slurm_cluster.wait_state(jobs["train"], "CANCELLED", timeout=60)  # by Slurm, not pending forever
    slurm_cluster.wait_state(jobs["consolidate"], "CANCELLED", timeout=60)  # and so its consolidation (issue 47)
    assert sacct_fields([jobs["train"]], "Start")[jobs["train"]] == ["None"]  # it never started
    log = (run / "logs" / f"prepare-{jobs['prepare']}.out").read_text(errors="replace")
    assert "TRL's preparation failed" in log and "the template refuses this row" in log
    assert not RunPaths.of(run).prepared.exists()
    status = slurmft.status_json(run)
    assert f"prepare job {jobs['prepare']} did not succeed" in status["train"]["words"]
    assert f"slurmft resume {run}" in status["prepare"]["words"]

    data.write_text("\n".join(rows) + "\n")  # the fix
    code, out, err = slurmft.cli(["resume", str(run)])
    assert code == 0, err
    again = started_jobs(out)
    assert list(again) == ["prepare", "train", "consolidate"], out  # prepared again, the rest re-chained
    assert "cancelled" not in err  # Slurm cancelled the train and consolidation jobs already: nothing stale is left
    code, out, err = slurmft.cli(["cancel", str(run)])  # the prepare job is one of the run's live jobs
    assert code == 0, err
    assert set(again.values()) <= set(out.removeprefix("cancelled: ").strip().split(", ")), out
    for job in again.values():
        slurm_cluster.wait_state(job, "CANCELLED", timeout=60)

    code, out, err = slurmft.cli(["prepare", str(run)])  # the data alone, as a job
    assert code == 0, err
    slurm_cluster.wait_state(started_jobs(out)["prepare"], "COMPLETED", timeout=240)
    with open(data, "a") as f:  # a source changed after preparation
        f.write(rows[0] + "\n")
    before = read_manifest(RunPaths.of(run))
    code, out, err = slurmft.cli(["resume", str(run)])
    assert code == 2 and f"data.datasets[0] ({data}): the file changed after preparation" in err, err
    assert f"slurmft prepare {run}" in err
    assert read_manifest(RunPaths.of(run))["jobs"] == before["jobs"]  # nothing submitted

    code, out, err = slurmft.cli(["prepare", str(run)])
    assert code == 0, err
    slurm_cluster.wait_state(started_jobs(out)["prepare"], "COMPLETED", timeout=240)
    code, out, err = slurmft.cli(["resume", str(run)])
    assert code == 0, err
    last = started_jobs(out)
    assert list(last) == ["train", "consolidate"], out  # prepared already: no prepare job
    slurm_cluster.wait_state(last["train"], "COMPLETED", timeout=300)
    slurm_cluster.wait_state(last["consolidate"], "COMPLETED", timeout=240)
    assert (run / "model" / "model.safetensors.index.json").is_file()


def test_prepare_run_yaml_as_a_job_gives_exact_counts_before_any_train_job(
        slurm_cluster, tiny_model: Path, chat_data: Path, tmp_path: Path, slurmft) -> None:
    from slurmft.epochs import steps_per_epoch

    path = slurmft.write_config(tmp_path, tiny_model, chat_data, prepare=PREPARE,
                                train={"max_steps": None, "epochs": 2})
    code, out, err = slurmft.cli(["prepare", str(path)])  # a run directory with its prepare job alone
    assert code == 0, err
    jobs = started_jobs(out)
    assert list(jobs) == ["prepare"] and "slurmft resume" in out, out
    run = tmp_path / "run"
    slurm_cluster.wait_state(jobs["prepare"], "COMPLETED", timeout=240)
    manifest = read_manifest(RunPaths.of(run))
    assert [j["kind"] for j in manifest["jobs"]] == ["prepare"] and manifest["attempts"] == []
    result = json.loads(RunPaths.of(run).prepared_record.read_text())["result"]
    sequences, tokens = result["sequences"], result["tokens"]
    per_epoch = steps_per_epoch(sequences, 2, 2, 1)  # 2 nodes x 1 rank, per-device batch 2, no accumulation

    code, out, err = slurmft.cli(["validate", str(run / "config.yaml")])  # exact, from the prepared count
    assert code == 0, err
    assert f"data: {sequences:,} packed sequences per epoch (prepared, exact) -> {per_epoch} optimizer steps" in out
    assert f"train.epochs 2 -> {2 * per_epoch} steps" in out
    code, out, err = slurmft.cli(["estimate", str(run / "config.yaml"), "--json"])
    assert code == 0, err
    assert json.loads(out)["schedule"] == {"sequences_per_epoch": sequences, "rows": "packed sequences",
                                           "tokens_per_epoch": tokens,
                                           "steps_per_epoch": per_epoch, "max_steps": 2 * per_epoch,
                                           "periodic_saves": 2 * per_epoch // 2}
    code, out, err = slurmft.cli(["submit", str(path)])  # the run exists: its training starts with resume
    assert code == 2 and f"start its training with: slurmft resume {run}" in err, err
    assert read_manifest(RunPaths.of(run))["jobs"] == manifest["jobs"]  # nothing submitted
