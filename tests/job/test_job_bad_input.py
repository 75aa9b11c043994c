"""Bad input inside the job: a clear JobSetupError on every rank, non-zero exit, no hang, nothing written.

Each case is a real two-rank launch whose config passed the login-side checks (or was edited
after them), so the job itself must catch the problem before any collective could hang.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from .helpers import launch, write_run

pytestmark = pytest.mark.train


def _missing_model(run: Path, model: Path) -> Path:
    def edit(data):
        data["model"]["name_or_path"] = str(run.parent / "no-such-model")

    return write_run(run, model, edit=edit)


def _wrong_columns(run: Path, model: Path) -> Path:
    bad = run.parent / "bad.jsonl"
    bad.write_text("".join(json.dumps({"question": f"q{i}", "answer": f"a{i}"}) + "\n" for i in range(20)))

    def edit(data):
        data["data"]["datasets"][1]["path"] = str(bad)

    return write_run(run, model, edit=edit)


def _no_chat_template(run: Path, model: Path) -> Path:
    plain = run.parent / "model-without-template"
    shutil.copytree(model, plain)
    (plain / "chat_template.jinja").unlink()
    tok_cfg = json.loads((plain / "tokenizer_config.json").read_text())
    tok_cfg.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    return write_run(run, plain)


def _too_long(run: Path, model: Path) -> Path:
    return write_run(run, model, overrides=["data.max_seq_length=1024"])


CASES = {
    "missing-model": (_missing_model, r"model\.name_or_path: local directory .*no-such-model.* does not exist"),
    "wrong-columns": (_wrong_columns, r"data\.datasets\[1\] .*bad\.jsonl.*cannot find a conversation in the columns "
                                      r"\['question', 'answer'\]"),
    "no-chat-template": (_no_chat_template, r"has no chat template"),
    "seq-too-long": (_too_long, r"data\.max_seq_length \(1024\) is larger than the model's "
                                r"max_position_embeddings \(512\)"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_fails_cleanly_on_every_rank(case: str, tiny_model: Path, job_env: dict[str, str],
                                               tmp_path: Path) -> None:
    make, message = CASES[case]
    run = make(tmp_path / "run", tiny_model)
    config_before = (run / "config.yaml").read_text()
    rc, out = launch(run, job_env).wait(timeout=120)
    assert rc != 0, out[-3000:]
    errors = re.findall(r"slurmft rank (\d): setup error: (.*)", out)
    assert sorted(r for r, _ in errors) == ["0", "1"], out[-3000:]  # every rank stops, none hangs
    for _, text in errors:
        assert re.search(message, text), text
    # The ranks exit with the message, not a traceback (torchrun's own ChildFailedError report is fine).
    assert "JobSetupError" not in out and not re.search(r"\[rank\d\]:\s*Traceback", out), out[-3000:]
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())
    assert not (run / "metrics.jsonl").exists()
    assert (run / "config.yaml").read_text() == config_before
