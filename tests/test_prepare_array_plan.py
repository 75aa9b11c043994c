"""The login side of a prepare array (``prepare.tasks``): the config's refusals, and the array as one job of the run in
``status`` (slurmft/watch/status.py ``fold_array``) with its total so far (slurmft/prepared.py ``array_progress``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slurmft.config_loading import load_config
from slurmft.errors import ConfigError
from slurmft.prepared import SHARD_RECORD, array_progress, shard_dir
from slurmft.watch.status import SlurmView, fold_array

HERE = Path(__file__).parent
EXAMPLE = HERE.parent / "examples" / "tiny" / "run.yaml"


def test_prepare_tasks_default_to_one_and_dpo_is_refused_an_array(tmp_path: Path) -> None:
    assert load_config(EXAMPLE, [f"output_dir={tmp_path / 'run'}"]).prepare.tasks == 1
    assert load_config(EXAMPLE, [f"output_dir={tmp_path / 'run'}", "prepare.tasks=3"]).prepare.tasks == 3
    with pytest.raises(ConfigError) as low:
        load_config(EXAMPLE, [f"output_dir={tmp_path / 'run'}", "prepare.tasks=0"])
    assert "prepare.tasks" in low.value.render()
    with pytest.raises(ConfigError) as dpo:
        load_config(EXAMPLE, [f"output_dir={tmp_path / 'run'}", "prepare.tasks=2", "dpo={}"])
    assert "prepare.tasks: an array splits SFT's tokenization; a dpo run prepares in one job" in dpo.value.render()


def _q(state: str) -> dict[str, str]:
    return {"state": state, "reason": "", "elapsed": "0:01", "restarts": "0", "name": "x-prepare", "comment": ""}


def _a(state: str) -> dict[str, str]:
    return {"state": state, "elapsed": "0:01", "exit_code": "0:0", "start": "", "end": ""}


def test_an_array_is_live_while_a_task_is_and_completed_only_when_every_task_is() -> None:
    view = SlurmView()
    fold_array(view, "7", [None, _q("PENDING"), _q("RUNNING")], [_a("COMPLETED"), None, None])
    assert view.queued["7"]["state"] == "RUNNING"
    view = SlurmView()
    fold_array(view, "7", [None, None], [_a("COMPLETED"), _a("COMPLETED")])
    assert view.acct["7"]["state"] == "COMPLETED" and "7" not in view.queued
    view = SlurmView()
    fold_array(view, "7", [None, None], [_a("COMPLETED"), _a("FAILED")])
    assert view.acct["7"]["state"] == "FAILED"
    view = SlurmView()
    fold_array(view, "7", [None, None], [_a("COMPLETED"), None])  # one task not in accounting (yet): cannot tell
    assert "7" not in view.acct


def test_status_totals_the_shards_done_so_far(tmp_path: Path) -> None:
    assert array_progress(tmp_path, 3) == "0 of 3 tasks done: 0 tokens"
    for k, tokens in ((0, 1_000_000), (2, 2_500_000)):
        shard_dir(tmp_path, k).mkdir()
        (shard_dir(tmp_path, k) / SHARD_RECORD).write_text(json.dumps({"tokens": tokens, "tokens_per_s": 50_000}))
    assert array_progress(tmp_path, 3) == "2 of 3 tasks done: 3,500,000 tokens (100,000 tokens/s together)"


def test_an_evaluation_with_its_own_tasks_is_one_job_not_an_array(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """`slurmft eval RUN --tasks hellaswag` records its lm-eval tasks under the manifest's ``tasks`` key, where a
    prepare array records its task count: status counted the list and crashed (TypeError, a traceback) on every
    later call. Only a prepare array's count makes array tasks."""
    from cli_runner import cli
    from runfixture import preempted_run

    run = preempted_run(tmp_path)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["jobs"].append({"kind": "eval", "job_id": "102", "attempt": 1, "tasks": ["hellaswag", "arc_easy"]})
    (run / "manifest.json").write_text(json.dumps(manifest))
    for args in (["status", str(run)], ["status", str(run), "--json"]):
        code, out, err = cli(args, capsys)
        assert code == 0 and "102" in out, err
    from slurmft.slurm import task_count

    assert task_count({"kind": "prepare", "job_id": "7", "tasks": 3}) == 3
    assert task_count({"kind": "eval", "job_id": "8", "tasks": ["hellaswag"]}) == 1
    assert task_count({"kind": "prepare", "job_id": "9", "tasks": 3, "pid": 42}) == 1  # run here, one task at a time
