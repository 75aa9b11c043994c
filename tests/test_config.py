"""Config schema: defaults, overrides, validation messages."""

from __future__ import annotations

import re
import typing
from pathlib import Path
from typing import Any

import pytest

from slurmft.config import RunConfig
from slurmft.config_loading import apply_overrides, load_config, parse_override, validate
from slurmft.errors import ConfigError

DATA = Path(__file__).parent / "data"


def minimal(**extra: object) -> dict:
    base = {
        "name": "t",
        "output_dir": "/tmp/slurmft-test-run",
        "model": {"name_or_path": "org/model"},
        "data": {"datasets": [{"path": "org/data"}]},
    }
    base.update(extra)
    return base


def test_defaults_are_the_reference_allocation() -> None:
    cfg = validate(minimal())
    assert (cfg.resources.nodes, cfg.resources.gpus_per_node, cfg.resources.ranks_per_node) == (2, 8, 8)
    assert cfg.resources.world_size == 16
    assert cfg.preemption.signal == "USR2" and cfg.consolidate.enabled
    assert cfg.fsdp.enabled and cfg.fsdp.activation_checkpointing


def test_overrides_use_dotted_paths_and_yaml_values() -> None:
    data = apply_overrides(minimal(), ["resources.nodes=4", "train.max_steps=10", "cluster.env.FOO=bar",
                                      "checkpoint.every_steps=5"])
    cfg = validate(data)
    assert cfg.resources.nodes == 4 and cfg.train.max_steps == 10 and cfg.cluster.env == {"FOO": "bar"}
    assert parse_override("a.b=[1, 2]") == (["a", "b"], [1, 2])


@pytest.mark.parametrize("bad", ["novalue", "a..b=1", "=3", "a b=1"])
def test_malformed_override_is_a_config_error(bad: str) -> None:
    with pytest.raises(ConfigError):
        apply_overrides(minimal(), [bad])


def test_every_problem_is_collected_with_its_dotted_field() -> None:
    data = minimal(resources={"nodes": 0, "gpus_per_node": -1}, train={"max_steps": -5, "bogus": 1})
    with pytest.raises(ConfigError) as info:
        validate(data)
    text = info.value.render()
    for field in ("resources.nodes", "resources.gpus_per_node", "train.max_steps", "train.bogus"):
        assert field in text
    assert "valid keys here" in text  # unknown key lists what is allowed


def test_secret_in_env_is_refused_with_the_fix() -> None:
    with pytest.raises(ConfigError) as info:
        validate(minimal(cluster={"env": {"HF_TOKEN": "hf_abc"}}))
    assert re.search(r"cluster.env: HF_TOKEN looks like a secret.*Export HF_TOKEN", info.value.render())
    # a variable that merely contains the word is fine, and so is one that says where a secret is kept
    assert validate(minimal(cluster={"env": {"TOKENIZERS_PARALLELISM": "false"}}))
    assert validate(minimal(cluster={"env": {"HF_TOKEN_PATH": "/shared/.hf_token"}, "setup": [
        "export HF_TOKEN_PATH=/shared/.hf_token"]}))
    with pytest.raises(ConfigError) as info:  # _PATH/_FILE/_DIR at the end only
        validate(minimal(cluster={"env": {"HF_TOKEN_SECRET": "x"}}))
    assert "HF_TOKEN_SECRET looks like a secret" in info.value.render()


def test_local_paths_are_resolved_against_the_config_file(tmp_path: Path) -> None:
    (tmp_path / "d.jsonl").write_text((DATA / "chat.jsonl").read_text())
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "run.yaml").write_text(
        "name: r\noutput_dir: out\nmodel: {name_or_path: ./m}\ndata: {datasets: [{path: d.jsonl}]}\n"
    )
    cfg = load_config(tmp_path / "run.yaml", ["executor=local", "resources.nodes=1"])
    assert cfg.model.name_or_path == str(tmp_path / "m")
    assert cfg.data.datasets[0].path == str(tmp_path / "d.jsonl")
    assert Path(cfg.output_dir).is_absolute()


def test_local_executor_needs_one_node() -> None:
    with pytest.raises(ConfigError) as info:
        validate(minimal(executor="local"))
    assert "resources.nodes" in info.value.render()


def _sections(annotation: Any) -> list[type]:
    """The pydantic models an annotation holds: ``X``, ``list[X]``, ``X | None``, ``dict[str, X]``..."""
    if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _sections(arg)]


def test_schema_has_a_description_on_every_field() -> None:
    seen: list[str] = []

    def walk(model: type) -> None:
        seen.append(model.__name__)
        for name, field in model.model_fields.items():
            ann = field.annotation
            if not (isinstance(ann, type) and hasattr(ann, "model_fields")):  # a section documents itself
                assert field.description, f"{model.__name__}.{name} has no description"
            for section in _sections(ann):
                walk(section)

    walk(RunConfig)
    assert "DatasetSource" in seen  # reached through data.datasets: list[DatasetSource]


def test_config_reference_doc_is_current() -> None:
    from slurmft.plan.configdoc import reference

    doc = Path(__file__).parent.parent / "docs" / "config.md"
    assert doc.read_text() == reference(), "regenerate: python -m slurmft.plan.configdoc > docs/config.md"


def test_replicate_across_nodes_needs_fsdp_and_is_suggested_for_foreign_spellings() -> None:
    base = {"name": "t", "output_dir": "/tmp/t", "model": {"name_or_path": "org/m"},
            "data": {"datasets": [{"path": "org/d"}]}}
    assert validate({**base, "fsdp": {"replicate_across_nodes": True}}).fsdp.replicate_across_nodes
    one_node = validate({**base, "resources": {"nodes": 1}, "fsdp": {"replicate_across_nodes": True}})
    assert one_node.fsdp.replicate_across_nodes  # accepted: one replica is plain FSDP (a 1-node smoke test)
    with pytest.raises(ConfigError) as err:
        validate({**base, "fsdp": {"enabled": False, "replicate_across_nodes": True}})
    assert "fsdp.replicate_across_nodes: shards inside each node, which needs fsdp.enabled=true" in err.value.render()
    for key in ("hybrid_shard", "sharding_strategy", "dp_replicate_size"):
        with pytest.raises(ConfigError) as err:
            validate({**base, "fsdp": {key: True}})
        assert "did you mean fsdp.replicate_across_nodes?" in err.value.render(), key


def test_lora_section_defaults_and_bad_values_name_the_field_and_the_fix() -> None:
    assert validate(minimal()).lora is None  # absent: full fine-tuning
    lora = validate(minimal(lora={})).lora
    assert lora is not None and (lora.r, lora.alpha, lora.dropout, lora.target_modules) == (16, 32.0, 0.0, "all-linear")
    assert lora.scaling == 2.0 and lora.modules_to_save == []
    assert validate(minimal(lora={"target_modules": "q_proj"})).lora.target_modules == ["q_proj"]
    with pytest.raises(ConfigError) as err:
        validate(minimal(lora={"r": 0, "dropout": 1.5, "target_modules": [], "modules_to_save": ["a b"]}))
    text = err.value.render()
    assert "lora.r: the adapter rank must be at least 1 (typical: 8 to 64; got 0); set lora.r=16" in text
    assert "lora.dropout: Input should be less than 1" in text
    assert "lora.target_modules: an empty list adapts nothing" in text
    assert "lora.modules_to_save: 'a b' is not a module name" in text


@pytest.mark.parametrize(("where", "key", "ours"), [
    ("", "adapter", "lora"), ("", "use_peft", "lora"), ("", "lora_r", "lora.r"), ("", "lora_alpha", "lora.alpha"),
    ("", "lora_dropout", "lora.dropout"), ("", "lora_target_modules", "lora.target_modules"),
    ("", "lora_target_linear", "lora.target_modules"), ("lora", "lora_alpha", "lora.alpha"),
    ("lora", "lora_dropout", "lora.dropout"), ("lora", "rank", "lora.r"), ("consolidate", "merge_lora", "consolidate.merge"),
])
def test_lora_spellings_from_axolotl_trl_and_torchtune_get_a_did_you_mean(where: str, key: str, ours: str) -> None:
    data = minimal(**({where: {key: 1}} if where else {key: 1}))
    with pytest.raises(ConfigError) as err:
        validate(data)
    assert f"did you mean {ours}?" in err.value.render()


def test_dpo_section_defaults_and_method() -> None:
    assert validate(minimal()).method == "sft" and validate(minimal()).dpo is None
    cfg = validate(minimal(dpo={}))
    assert cfg.method == "dpo"
    assert (cfg.dpo.beta, cfg.dpo.loss_type, cfg.dpo.label_smoothing, cfg.dpo.reference) == (0.1, ["sigmoid"], 0.0,
                                                                                              "auto")
    assert validate(minimal(dpo={"loss_type": "ipo"})).dpo.loss_type == ["ipo"]  # one name without brackets


def test_dpo_loss_type_is_checked_against_the_installed_trl() -> None:
    from slurmft.dpoopts import dpo_loss_types

    known, _ = dpo_loss_types()
    if known is None:
        pytest.skip("trl is not installed here")
    assert {"sigmoid", "ipo", "hinge"} <= set(known)
    with pytest.raises(ConfigError) as err:
        validate(minimal(dpo={"loss_type": ["sigmoid", "sigmod"]}))
    (problem,) = err.value.problems
    assert problem.startswith("dpo.loss_type: 'sigmod' is not a loss type of TRL") and "did you mean 'sigmoid'" in problem


@pytest.mark.parametrize(("extra", "fragment"), [
    ({"dpo": {"reference": "copy"}, "lora": {}}, "dpo.reference: copy loads a second model"),
    ({"dpo": {}, "train": {"sft": {"packing_strategy": "wrapped"}}}, "train.sft: passes options to TRL's SFTConfig"),
    ({"dpo": {"label_smoothing": 0.5}}, "dpo.label_smoothing"),
])
def test_dpo_refusals_name_the_field_and_the_fix(extra: dict, fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        validate(minimal(**extra))
    assert any(p.startswith(fragment) for p in err.value.problems), err.value.problems


@pytest.mark.parametrize(("where", "key", "ours"), [
    ((), "rl", "dpo"), ((), "stage", "dpo"), ((), "rlhf_type", "dpo"), ((), "pref_beta", "dpo.beta"),
    (("dpo",), "dpo_beta", "dpo.beta"), (("dpo",), "pref_loss", "dpo.loss_type"),
    (("dpo",), "precompute_ref_log_probs", "dpo.reference"),
])
def test_dpo_spellings_from_axolotl_llamafactory_and_trl_get_a_did_you_mean(where: tuple, key: str, ours: str) -> None:
    data = minimal(dpo={}) if where else minimal()
    node = data
    for part in where:
        node = node[part]
    node[key] = "dpo" if not where else 0.1
    with pytest.raises(ConfigError) as err:
        validate(data)
    assert f"did you mean {ours}?" in err.value.problems[0]


def test_a_setup_line_may_read_a_secret_at_run_time_but_not_hold_one() -> None:
    """cluster.setup is written verbatim into the scripts: a literal token there is refused, a token read at run time
    (or any other variable) is the user's own command and passes."""
    from slurmft.config_values import secret_in_line

    for line in ("export HF_TOKEN=hf_abc", 'WANDB_API_KEY="k" python x.py', "module load a; export MY_PASSWORD='p'"):
        assert secret_in_line(line), line
    for line in ("export HF_TOKEN=$(cat ~/.hf_token)", 'export HF_TOKEN="$HF_TOKEN"', "export HF_HOME=/scratch/hf",
                 "source /venv/bin/activate", "export PATH=/opt/bin:$PATH", "unset HF_TOKEN"):
        assert secret_in_line(line) is None, line
