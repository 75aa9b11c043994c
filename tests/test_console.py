"""slurmft.submit.console: the local executor's console follows metrics.jsonl one line per step."""

from __future__ import annotations

import json
from pathlib import Path

from slurmft.submit.console import MetricsFollower, step_line


def test_every_step_once_in_order_and_a_partial_line_waits(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    follow = MetricsFollower(path)
    assert follow.new_lines() == []  # no file yet
    rec = {"step": 1, "loss": 2.5, "learning_rate": 1e-4, "grad_norm": 0.5}
    with path.open("w") as f:
        f.write(json.dumps(rec) + "\n" + json.dumps({**rec, "step": 2}) + "\n" + '{"step": 3, "lo')
    assert follow.new_lines() == [step_line(rec), step_line({**rec, "step": 2})]
    assert follow.new_lines() == []
    with path.open("a") as f:  # the job finishes the line, logs two more steps and a non-step record
        f.write('ss": 2.0}\n' + json.dumps({**rec, "step": 4}) + "\n" + "garbage\n" + json.dumps({"eval": 1}) + "\n"
                + json.dumps({**rec, "step": 5}) + "\n")
    assert [line.split()[1] for line in follow.new_lines()] == ["3", "4", "5"]
    assert step_line(rec) == "step 1 loss=2.5 learning_rate=0.0001 grad_norm=0.5"
    # a GRPO step that generated: the reward beside the loss (which says nothing of the policy's quality)
    assert step_line({**rec, "reward": 0.1, "reward_std": 0.10690450668334961}) == (
        "step 1 loss=2.5 learning_rate=0.0001 grad_norm=0.5 reward=0.1 reward_std=0.1069")


def test_a_save_line_is_said_as_a_save_not_as_a_second_step(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    follow = MetricsFollower(path)
    save = {"event": "save", "step": 6, "mode": "async", "blocked_s": 0.123, "durable_s": 0.91, "bytes": 64 * 2**20}
    path.write_text(json.dumps({"step": 6, "loss": 2.0}) + "\n" + json.dumps(save) + "\n"
                    + json.dumps({"step": 7, "loss": 1.9}) + "\n")
    assert follow.new_lines() == ["step 6 loss=2", "saved checkpoint-6 (async: training waited 0.12 s, durable after "
                                  "0.9 s, 64.0 MiB)", "step 7 loss=1.9"]
