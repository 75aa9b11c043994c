"""slurmft/methods.py: what a run trains by, decided once at submit and recorded in its manifest, read back by the
report (which never builds the schema)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from cli_runner import cli

REPO = Path(__file__).resolve().parents[1]


def test_submit_records_the_objective_and_the_report_reads_it_back(tmp_path: Path, micro_model: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A continued-pretraining run whose corpus is a glob without a suffix (``corpus/*``): plain text by the files it
    matched at submit. Its manifest records ``text``, packed; once the files are gone (moved, cleaned up) the
    report still says continued pretraining, where deciding again from config.yaml would say supervised
    fine-tuning. ``slurmft prepare`` is the cheapest real submit (submit_run, the local prepare job alone)."""
    corpus = tmp_path / "corpus"
    shutil.copytree(REPO / "examples" / "tiny" / "data" / "corpus", corpus)  # notes-00.txt ...; the glob: corpus/*
    run = tmp_path / "run"
    cfg = {"name": "text", "executor": "local", "output_dir": str(run),
           "resources": {"nodes": 1, "gpus_per_node": 0, "tasks_per_node": 1, "cpus_per_task": 1, "exclusive": False},
           "model": {"name_or_path": str(micro_model), "dtype": "float32"},
           "data": {"datasets": [{"path": str(corpus / "*"), "documents": "blank_line"}], "max_seq_length": 64,
                    "packing": True},
           "train": {"max_steps": 2}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    code, _, err = cli(["prepare", str(path)], capsys)
    assert code == 0, err
    assert json.loads((run / "manifest.json").read_text())["objective"] == {"method": "text", "packed": True}
    shutil.rmtree(corpus)
    code, _, err = cli(["report", str(run)], capsys)
    assert code == 0, err
    text = (run / "report.md").read_text()
    assert "| objective | continued pretraining on plain text (every token in the loss) |" in text, text
    assert "max_seq_length 64, packing True |" in text, text
