"""transformers' import structure from the cache (slurmft/job/import_structure.py): in fresh interpreters, the table a
process reads is the one transformers computes, and a process that read it imports and builds models; a damaged,
stale or unwritable cache falls back to transformers' own computation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from slurmft.job import import_structure
from slurmft.job.import_structure import ENV, _installation_key, _read, _table_name, _write
from slurmft.modelinfo import CACHE_DIR_ENV

PROBE = """
import json, os, sys
from slurmft.job import import_structure
import_structure.install()
import transformers
import transformers.models
at_import = list(import_structure.tables)  # the tables transformers' own import asked for
from transformers.utils import import_utils
models = os.path.join(os.path.dirname(transformers.__file__), "models")

def canonical(table):
    return sorted([sorted(k), sorted((m, sorted(n)) for m, n in v.items())] for k, v in table.items())

define = import_utils.define_import_structure
own = getattr(define, "__wrapped__", define)  # transformers' own function, never the cache
tables = {"used": [canonical(define(models, prefix="models")), canonical(define(models + "/__init__.py"))],
          "own": [canonical(own(models, prefix="models")), canonical(own(models + "/__init__.py"))]}
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig  # names the lazy module serves
model = AutoModelForCausalLM.from_config(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                     num_attention_heads=2, num_key_value_heads=1, vocab_size=64))
print(json.dumps({"outcome": import_structure.outcome, "at_import": at_import, "tables": tables, "model": type(model).__name__,
                  "names": sorted(dir(transformers)), "models": sorted(dir(transformers.models))}))
"""


def _probe(cache: Path) -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300,
                          env={**os.environ, CACHE_DIR_ENV: str(cache)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_cached_table_is_transformers_own_and_a_process_reading_it_builds_models(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = _probe(cache)  # empty cache: computed by transformers and stored
    assert first["outcome"] == "installed" and first["at_import"] == ["computed", "computed"], first
    assert sorted(p.name.split("-")[3] for p in cache.iterdir()) == ["models", "none"]  # both of import's tables
    second = _probe(cache)  # what every later process does
    assert second["at_import"] == ["read", "read"], second["at_import"]
    assert second["tables"]["used"] == second["tables"]["own"] == first["tables"]["own"]
    assert second["tables"]["used"][0] and second["model"] == "LlamaForCausalLM"
    assert second["names"] == first["names"] and second["models"] == first["models"]
    assert "AutoModelForCausalLM" in second["names"]


def _fake_models(root: Path) -> Path:
    (root / "transformers" / "models" / "llama").mkdir(parents=True)
    (root / "transformers" / "__init__.py").write_text("")
    (root / "transformers" / "models" / "llama" / "modeling_llama.py").write_text("__all__ = []\n")
    return root / "transformers" / "models"


def test_a_model_directory_added_or_changed_is_a_new_table(tmp_path: Path) -> None:
    models = _fake_models(tmp_path)
    before = _installation_key(models)
    assert before is not None and before == _installation_key(models)
    assert _table_name(before, "models") != _table_name(before, None)  # each prefix its own table
    (models / "llama" / "modeling_llama_new.py").write_text("__all__ = ['New']\n")  # the directory's mtime moves
    os.utime(models / "llama", ns=(1, 1))  # as a new mtime would, whatever the file system's resolution
    changed = _installation_key(models)
    (models / "qwen").mkdir()
    added = _installation_key(models)
    assert len({before, changed, added}) == 3
    assert _installation_key(tmp_path / "nowhere") is None  # cannot list: no cache


def test_a_damaged_or_unwritable_cache_falls_back_to_computing(tmp_path: Path) -> None:
    table = {frozenset(): {"llama.configuration_llama": {"LlamaConfig"}},
             frozenset({"torch"}): {"llama.modeling_llama": {"LlamaModel", "LlamaForCausalLM"}}}
    file = tmp_path / "t.json"
    assert _write(file, table) == "computed" and _read(file) == table
    file.write_text(file.read_text()[:100])  # a half-written file from a process that died
    assert _read(file) is None
    file.write_text('{"not": "rows"}')
    assert _read(file) is None
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    assert _write(blocked / "t.json", table).startswith("computed (not saved")
    assert sorted(tmp_path.iterdir()) == sorted([file, blocked])  # no temporary file left behind


def test_install_does_nothing_when_turned_off_or_once_transformers_is_imported(monkeypatch) -> None:  # noqa: ANN001
    import transformers  # noqa: F401  # this test process has it, like a process that imported it first

    finders = list(sys.meta_path)
    assert import_structure.install() is False and import_structure.outcome == "already imported"
    monkeypatch.setenv(ENV, "0")
    assert import_structure.install() is False and import_structure.outcome == "off"
    assert sys.meta_path == finders
