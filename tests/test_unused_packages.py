"""The optional packages a job process keeps out (slurmft/job/unused_packages.py): which ones each run and job
needs, and, in a fresh interpreter, that a kept-out package is really absent to the libraries' availability
checks (``importlib.util.find_spec``) while the opt-out imports everything."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from slurmft.config_loading import validate
from slurmft.job.unused_packages import OPT_OUT, unused
from tests.runfixture import CONFIG

ALL = ["torchao", "wandb", "peft", "scipy", "boto3"]


def _cfg(**sections: dict):  # noqa: ANN202
    return validate({**CONFIG, "output_dir": "/runs/watch", **{k: {**CONFIG.get(k, {}), **v} for k, v in sections.items()}})


@pytest.mark.parametrize(("sections", "job", "expected"), [
    ({}, "train", ALL),
    ({}, "prepare", ALL),
    ({}, "consolidate", ALL),
    ({"lora": {"r": 4}}, "train", ["torchao", "wandb", "scipy", "boto3"]),
    ({"lora": {"r": 4}}, "consolidate", ["torchao", "wandb", "scipy", "boto3"]),
    ({"lora": {"r": 4}}, "prepare", ALL),  # prepare tokenizes: no model, no adapter
    ({"train": {"report_to": ["wandb"]}}, "train", ["torchao", "peft", "scipy", "boto3"]),
    ({"train": {"report_to": ["wandb"]}}, "consolidate", ALL),
    ({"train": {"report_to": ["tensorboard"]}}, "train", ALL),
    ({"train": {"precision": "bf16-true", "optimizer": "adamw-stochastic-rounding"}, "model": {"dtype": "bfloat16"}},
     "train", ["wandb", "peft", "scipy", "boto3"]),
    ({"train": {"sft": {"optim": "adamw_torch_4bit"}}}, "train", ["wandb", "peft", "scipy", "boto3"]),  # transformers' torchao optimizers
], ids=["sft-train", "sft-prepare", "sft-consolidate", "lora-train", "lora-consolidate", "lora-prepare", "wandb-train",
        "wandb-consolidate", "tensorboard", "stochastic-rounding", "sft-optim"])
def test_each_job_keeps_out_what_its_run_does_not_use(sections: dict, job: str, expected: list[str]) -> None:
    assert unused(_cfg(**sections), job) == expected


PROBE = """
import importlib.util, json, sys
from slurmft.job import unused_packages
kept = unused_packages.keep_out(sys.argv[1], sys.argv[2])
found = {name: importlib.util.find_spec(name) is not None for name in ("torchao", "wandb", "peft", "scipy", "boto3")}
refused = None
if "peft" in kept:  # importing it for real would cost seconds: only the refusal is tried
    try:
        import peft  # noqa: F401
        refused = False
    except ImportError:
        refused = True
print(json.dumps({"kept": list(kept), "found": found, "peft_refused": refused}))
"""


def _probe(run: Path, job: str, env: dict[str, str] | None = None) -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE, str(run), job], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_a_kept_out_package_is_absent_to_find_spec_and_import(tmp_path: Path) -> None:
    plain, lora = tmp_path / "plain", tmp_path / "lora"
    for run, extra in ((plain, {}), (lora, {"lora": {"r": 4}})):
        run.mkdir()
        (run / "config.yaml").write_text(yaml.safe_dump({**CONFIG, "output_dir": str(run), **extra}))

    out = _probe(plain, "train")
    assert out["kept"] == [n for n in ALL if out["found"].get(n) is False]  # only what it kept out is gone
    assert "peft" in out["kept"] and out["peft_refused"]

    out = _probe(lora, "train")
    assert "peft" not in out["kept"] and out["found"]["peft"]

    out = _probe(plain, "train", {OPT_OUT: "1"})
    assert out["kept"] == [] and all(out["found"].values())

    out = _probe(tmp_path / "missing", "train")  # no config.yaml: nothing is touched, the job reports it itself
    assert out["kept"] == [] and all(out["found"].values())
