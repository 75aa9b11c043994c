"""slurmft.job.versions: each difference between the supported library versions, checked on whichever version set
runs the tests (CI's torch 2.13 + transformers 5.24; bench/gpu_image_env.sh's torch 2.11 + transformers 5.17 on the
lent GPU machine's image). Before these fixes each test failed on the 2.11/5.17 set and passed on CI's."""

from __future__ import annotations

from pathlib import Path

import torch


def test_the_trainers_own_checkpointing_is_off_under_the_name_this_transformers_has(tmp_path: Path) -> None:
    """5.17 rejected ``activation_checkpointing`` (the name from 5.23 on): every SFT job failed at its config."""
    from trl import SFTConfig

    from slurmft.job.versions import no_trainer_checkpointing

    off = no_trainer_checkpointing(SFTConfig)
    args = SFTConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, **off)
    assert not getattr(args, "activation_checkpointing", None) and not getattr(args, "gradient_checkpointing", None)


def test_the_prepare_jobs_trl_configs_warn_of_no_deprecated_option(tmp_path: Path) -> None:
    """Every prepare job's log said "`gradient_checkpointing` is deprecated and will be removed in v6" (TRL's default
    True, under the name transformers 5.23 deprecated), of an option no preparation reads."""
    import warnings

    import yaml

    from slurmft.config_loading import load_config
    from slurmft.job.prepare import dpo_prepare_args, prepare_args

    spec = yaml.safe_load((Path(__file__).parents[2] / "examples" / "tiny" / "run.yaml").read_text())
    spec["output_dir"] = str(tmp_path / "run")
    source = tmp_path / "run.yaml"
    source.write_text(yaml.safe_dump(spec))
    cfg = load_config(source)
    for make in (prepare_args, dpo_prepare_args):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            make(cfg, None, tmp_path)
        assert [str(w.message) for w in caught if "checkpointing" in str(w.message)] == [], make


def test_one_stager_stages_again_into_the_same_cpu_buffer() -> None:
    """torch 2.11's DefaultStager broke on its second stage (KeyError: <class 'type'>; pytorch#183413): a
    checkpoint's optimizer stage after its model stage, so every asynchronous save failed. The stager reuses its
    CPU copy: a second stage of the same tensor lands in the first stage's buffer, with the new values."""
    from torch.distributed.checkpoint.staging import StagingOptions

    from slurmft.job.versions import reusable_stager

    weight = torch.arange(6, dtype=torch.float32)
    state = {"model": {"w": weight}, "step": 3, "kind": torch.float32, "cls": torch.nn.Linear}
    stager = reusable_stager(StagingOptions(False, False, False, False))
    try:
        first = stager.stage(state)
        weight.add_(1)
        second = stager.stage(state)
        assert second["model"]["w"].data_ptr() == first["model"]["w"].data_ptr()  # no new allocation
        assert torch.equal(second["model"]["w"], torch.arange(1, 7, dtype=torch.float32))
        assert second["step"] == 3 and second["kind"] is torch.float32 and second["cls"] is torch.nn.Linear
    finally:
        stager.close()
