"""slurmft/config_paths.py: the one home of "does this value look like a path", and its readers agreeing with it."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurmft.config_loading import load_config
from slurmft.config_paths import is_local, is_profile_file, is_program_path, local_dir, looks_like_path
from slurmft.errors import ConfigError
from slurmft.modelinfo import locate_model_config
from slurmft.plan.container import Container


@pytest.mark.parametrize("value", ["/data/m", "./m", "../m", "~/m", "~", ".", ".."])
def test_a_value_written_as_a_path_looks_like_one(value: str) -> None:
    assert looks_like_path(value)


@pytest.mark.parametrize("value", ["meta-llama/Llama-2-7b-hf", "gpt2", "data/train.jsonl", "nvcr.io#nvidia/pytorch:24.05-py3",
                                   "docker://ubuntu:22.04", "localhost/sft:1", ".hidden"])
def test_a_hub_id_a_reference_or_a_bare_relative_name_does_not(value: str) -> None:
    assert not looks_like_path(value)


def test_is_local_also_counts_what_exists_relative_to_the_base(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "name").mkdir()
    assert is_local("org/name", base=tmp_path)  # a directory here wins over the hub id it resembles
    assert not is_local("org/other", base=tmp_path)
    monkeypatch.chdir(tmp_path)
    assert is_local("org/name") and not is_local("org/other")  # default base: the current directory
    assert is_local("./org/other")  # written as a path: local even when missing (validate says it is missing)


def test_profiles_and_programs_have_their_own_rule() -> None:
    assert not is_profile_file("aws-efa") and is_profile_file("site.yaml") and is_profile_file("site.yml")
    assert is_profile_file("profiles/site")  # a slash makes it a file, whatever its suffix
    assert not is_program_path("python3") and is_program_path("venv/bin/python") and is_program_path("/usr/bin/python3")


def test_local_dir_is_an_existing_directory(tmp_path: Path) -> None:
    (tmp_path / "f.txt").write_text("x")
    assert local_dir(str(tmp_path)) == tmp_path
    assert local_dir(str(tmp_path / "f.txt")) is None and local_dir("org/name") is None
    assert local_dir("~") == Path.home()


def test_the_readers_ask_the_same_question(tmp_path: Path) -> None:
    """A value written as a path is a path everywhere: the config reader makes it absolute, estimate's model lookup
    says it is missing (never asks the hub), and a pyxis image written so is a file enroot imports."""
    (tmp_path / "run.yaml").write_text(
        "name: r\noutput_dir: out\nexecutor: local\nresources: {nodes: 1}\n"
        "model: {name_or_path: ~/no-such-model-dir}\ndata: {datasets: [{path: org/name}]}\n")
    cfg = load_config(tmp_path / "run.yaml")
    assert cfg.model.name_or_path == str(Path.home() / "no-such-model-dir")
    assert cfg.data.datasets[0].path == "org/name"  # a hub id stays one
    with pytest.raises(ConfigError, match="local path '~/no-such-model-dir' does not exist"):
        locate_model_config("~/no-such-model-dir")
    assert Container(runtime="pyxis", image="./sft.sqsh", python="python", mounts=()).image_is_path
    assert not Container(runtime="pyxis", image="nvcr.io#nvidia/pytorch:24.05-py3", python="python", mounts=()).image_is_path
