"""slurmft/job/inputs.py: the base model a run reads on every attempt stays the one it trained on (issue 45, item 5).

- A hub id resolves, on a resume, to the commit the checkpoint was trained on (its marker's ``base.revision``), not
  to what the branch points at now: a hub cache with two snapshots of one repository, ``refs/main`` moved to the
  newer, read offline by huggingface_hub itself.
- A local base replaced under a checkpoint (the same names, other bytes) is refused in words by the train job's
  base check, before anything is loaded; the same files are not.
- The tokenizer consolidation exports from the hub is the one the train job read: the model's own at
  ``model.revision``, a ``model.tokenizer`` as found, also when it names the model's own hub id again
  (``modelinfo.tokenizer_revision``, the one rule; consolidation applied ``model.revision`` to it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from slurmft.checkpoints import mark_complete
from slurmft.config import ModelConfig
from slurmft.errors import JobSetupError
from slurmft.job.checkpointing import check_resume_base
from slurmft.job.inputs import base_identity, follow_trained_base

from .helpers import REPO

OLD, NEW = "a" * 40, "b" * 40
REPO_ID = "someorg/tiny-base"

RESOLVE = """
import json, sys
from slurmft.config import ModelConfig
from slurmft.job.inputs import base_identity, follow_trained_base, resolve_model_dir

trained = json.loads(sys.argv[1])
model = ModelConfig(name_or_path=sys.argv[2])
now = resolve_model_dir(model, with_weights=True)
followed = resolve_model_dir(follow_trained_base(model, trained), with_weights=True)
print(json.dumps({"now": now.name, "followed": followed.name,
                  "identity": base_identity(follow_trained_base(model, trained), followed)["revision"]}))
"""


def _hub_cache(root: Path, model: Path) -> Path:
    """``root`` as an HF hub cache holding ``model`` twice: commit OLD, and NEW (another config) that main points at."""
    repo = root / f"models--{REPO_ID.replace('/', '--')}"
    for commit in (OLD, NEW):
        snap = repo / "snapshots" / commit
        shutil.copytree(model, snap)
    cfg = json.loads((repo / "snapshots" / NEW / "config.json").read_text())
    (repo / "snapshots" / NEW / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 1e-5}))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(NEW)
    return root


def test_a_resumed_hub_base_is_read_at_the_commit_it_trained_on(tiny_model: Path, tmp_path: Path) -> None:
    cache = _hub_cache(tmp_path / "hub", tiny_model)
    trained = {"name_or_path": REPO_ID, "revision": OLD}
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", RESOLVE, json.dumps(trained), REPO_ID], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out == {"now": NEW, "followed": OLD, "identity": OLD}  # main moved; the resume reads the trained commit

    model = ModelConfig(name_or_path=REPO_ID)
    assert follow_trained_base(model, trained).revision == OLD
    assert follow_trained_base(model, None) == model  # a fresh start: the config's revision
    assert follow_trained_base(model, {"name_or_path": "other/model", "revision": OLD}) == model
    pinned = ModelConfig(name_or_path=REPO_ID, revision=NEW)  # the user pinned another commit: left for the check
    assert follow_trained_base(pinned, trained).revision == NEW
    local = ModelConfig(name_or_path=str(tiny_model))
    assert follow_trained_base(local, {"name_or_path": str(tiny_model), "revision": None}) == local


def test_a_replaced_local_base_is_refused_before_anything_loads(tiny_model: Path, tmp_path: Path) -> None:
    base = shutil.copytree(tiny_model, tmp_path / "base")
    model = ModelConfig(name_or_path=str(base))
    ckpt = tmp_path / "checkpoints" / "checkpoint-4"
    ckpt.mkdir(parents=True)
    mark_complete(ckpt, step=4, base=base_identity(model, base))
    check_resume_base(ckpt, base_identity(model, base))  # the same files: resumes
    check_resume_base(ckpt, None)  # a run that does not read its base on resume (a full fine-tune's SFT)

    weights = base / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-8:] = bytes(8) if data[-8:] != bytes(8) else b"\x01" * 8  # the last weights: another fine-tune, same shapes
    weights.write_bytes(bytes(data))
    with pytest.raises(JobSetupError) as refused:
        check_resume_base(ckpt, base_identity(model, base))
    text = refused.value.render()
    assert "the base model is not the one checkpoint-4 was trained on" in text
    assert "model.safetensors:" in text and "Put that base back" in text and "nothing was changed" in text


TOKENIZERS = """
import json, sys
from pathlib import Path
from slurmft.config_loading import validate
from slurmft.job.consolidate.model_files import tokenizer_for_export, write_tokenizer
from slurmft.job.inputs import resolve_model_dir, resolve_tokenizer_dir

out = Path(sys.argv[2])
cfg = validate({"name": "t", "output_dir": str(out / "run"), "model": json.loads(sys.argv[1]),
                "data": {"datasets": [{"path": "x.jsonl"}]}})
(out / "checkpoint").mkdir(parents=True)  # saved without a tokenizer: the run's own is exported
written = out / "model"
written.mkdir()
write_tokenizer(tokenizer_for_export(cfg, out / "checkpoint"), written, cfg)
read = resolve_tokenizer_dir(cfg.model, resolve_model_dir(cfg.model, with_weights=False))
def length(d):
    return json.loads((d / "tokenizer_config.json").read_text()).get("model_max_length")
print(json.dumps({"written": length(written), "read": length(read)}))
"""


@pytest.mark.parametrize(("tokenizer", "expected"), [(None, "old"), (REPO_ID, "new")],
                         ids=["the-models-own", "model.tokenizer-the-same-id"])
def test_consolidation_exports_the_tokenizer_the_train_job_read(tiny_model: Path, tmp_path: Path, tokenizer: str | None,
                                                               expected: str) -> None:
    cache = _hub_cache(tmp_path / "hub", tiny_model)
    marks = {"old": 1111, "new": 2222}  # the two commits' tokenizers told apart
    for commit, mark in ((OLD, marks["old"]), (NEW, marks["new"])):
        conf = cache / f"models--{REPO_ID.replace('/', '--')}" / "snapshots" / commit / "tokenizer_config.json"
        conf.write_text(json.dumps({**json.loads(conf.read_text()), "model_max_length": mark}))
    model = {"name_or_path": REPO_ID, "revision": OLD, **({"tokenizer": tokenizer} if tokenizer else {})}
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", TOKENIZERS, json.dumps(model), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out == {"written": marks[expected], "read": marks[expected]}
