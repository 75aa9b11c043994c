"""slurmft/watch/run_totals.py: the whole run's train_loss and train_runtime from what the attempts recorded (pure;
the real resumed runs that check them end to end are tests/test_resume_local.py and tests/slurm/test_watching.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slurmft.watch.run_totals import LAST_ATTEMPT, loss_over_steps, read_summaries, relabel, totals


def _rec(step: int, loss: float, n: int | None, restart: int, job: str = "7") -> dict:
    rec = {"step": step, "loss": loss, "job_id": job, "restart": restart}
    if n is not None:
        rec["loss_steps"] = n
    return rec


def test_one_attempt_is_transformers_train_loss_its_loss_sum_over_its_steps() -> None:
    # logging every 4 steps, the last at 10 (logged whatever logging_steps says): 4 + 4 + 2 steps
    records = [_rec(4, 2.0, 4, 0), _rec(8, 1.0, 4, 0), _rec(10, 0.5, 2, 0)]
    assert loss_over_steps(records) == (pytest.approx((2.0 * 4 + 1.0 * 4 + 0.5 * 2) / 10), 10)


def test_a_resume_from_an_older_checkpoint_counts_each_step_once_with_its_newest_value() -> None:
    # attempt 0 logged 1..6 and was killed; attempt 1 resumed from checkpoint-4: steps 5 and 6 trained again
    records = [_rec(s, 10.0 + s, 1, 0) for s in range(1, 7)] + [_rec(s, 20.0 + s, 1, 1) for s in range(5, 9)]
    loss, steps = loss_over_steps(records)
    assert steps == 8
    assert loss == pytest.approx((sum(10.0 + s for s in range(1, 5)) + sum(20.0 + s for s in range(5, 9))) / 8)


def test_a_mean_over_steps_trained_again_in_part_is_left_out_and_said() -> None:
    # attempt 0 logged a mean over 1-4 and one over 5-8, then died; attempt 1 resumed from checkpoint-6 (an older
    # slurmft saved off the logging steps): the mean over 5-8 cannot be split, steps 5 and 6 have no loss of their own
    records = [_rec(4, 2.0, 4, 0), _rec(8, 1.0, 4, 0), _rec(8, 0.9, 2, 1), _rec(12, 0.5, 4, 1)]
    run = totals(records, [{"step": 12, "from_step": 6, "train_runtime": 3.0, "train_loss": 0.63,
                            "train_samples_per_second": 8.0, "job_id": "7", "restart": 1}])
    assert (run.loss_steps, run.last_step) == (10, 12)
    assert run.loss == pytest.approx((2.0 * 4 + 0.9 * 2 + 0.5 * 4) / 10)
    assert run.gaps() == ["train_loss covers 10 of the 12 steps (the others were logged only inside a mean with "
                          "steps trained again later, or not at all)",
                          "train_runtime leaves out job 7 restart 0: killed before its end, its time was not recorded"]
    assert run.runtime_s == 3.0 and run.attempts == 2  # the killed attempt's seconds are not guessed


def test_records_of_an_older_slurmft_without_loss_steps_add_no_weight() -> None:
    assert loss_over_steps([_rec(1, 3.0, None, 0), _rec(2, 1.0, 1, 0)]) == (1.0, 1)
    assert loss_over_steps([]) == (None, 0)


def test_runtime_and_rates_add_up_over_the_attempts_and_relabel_keeps_the_last_attempts_own(tmp_path: Path) -> None:
    ends = [{"step": 15, "from_step": 0, "train_runtime": 10.0, "train_samples_per_second": 6.0, "train_loss": 1.0,
             "job_id": "7", "restart": 0},
            {"step": 30, "from_step": 15, "train_runtime": 5.0, "train_samples_per_second": 12.0, "train_loss": 0.5,
             "job_id": "7", "restart": 1}]
    path = tmp_path / "train_summary.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in ends) + '{"torn')
    assert read_summaries(path) == ends and read_summaries(tmp_path / "none.jsonl") == []
    records = [_rec(s, 1.0 if s <= 15 else 0.5, 1, 0 if s <= 15 else 1) for s in range(1, 31)]
    run = totals(records, ends)
    assert run.gaps() == []
    logs = {"train_runtime": 5.0, "train_samples_per_second": 12.0, "train_steps_per_second": 3.0,
            "train_loss": 0.5, "total_flos": 99.0, "epoch": 1.0}
    relabel(logs, run)
    assert logs == {"train_loss": 0.75, "train_loss_steps": 30, "train_runtime": 15.0,
                    "train_steps_per_second": 2.0, "train_samples_per_second": 8.0, "train_attempts": 2,
                    f"{LAST_ATTEMPT}train_runtime": 5.0, f"{LAST_ATTEMPT}train_samples_per_second": 12.0,
                    f"{LAST_ATTEMPT}train_steps_per_second": 3.0, f"{LAST_ATTEMPT}train_loss": 0.5,
                    "total_flos": 99.0, "epoch": 1.0}
