"""slurmft.plan.estimate_text.lead_time_warning and its callers: save time against lead time, on the login side: a lead time as long as the job is refused, and a lead
time below the projected checkpoint save time (estimate's checkpoint bytes / (nodes x the profile's
per-node write bandwidth)) is a warning with the numbers, from `validate`, `submit` and `estimate`."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurmft.cli import main
from slurmft.config_loading import validate
from slurmft.config_values import slurm_time_seconds
from slurmft.errors import ConfigError
from slurmft.plan import estimate as E
from slurmft.plan import estimate_text as T
from slurmft.profiles import DEFAULT_CHECKPOINT_WRITE_GB_PER_S, ClusterProfile, load_profile

EXAMPLE_70B = Path(__file__).resolve().parents[1] / "examples" / "llama2-70b-lima-guanaco.yaml"


def _cfg(**preemption: object) -> dict:
    return {"name": "t", "output_dir": "/tmp/slurmft-lead", "model": {"name_or_path": "meta-llama/Llama-2-70b-hf"},
            "data": {"datasets": [{"path": "GAIR/lima"}]}, "cluster": {"time": "00:02:00"},
            "preemption": preemption}


@pytest.mark.parametrize(("text", "seconds"), [("90", 5400), ("2:30", 150), ("00:02:00", 120),
                                               ("1-12", 129600), ("1-00:00:30", 86430)])
def test_slurm_time_in_seconds(text: str, seconds: int) -> None:
    assert slurm_time_seconds(text) == seconds


@pytest.mark.parametrize("lead", [120, 300])
def test_lead_time_not_shorter_than_the_job_is_refused(lead: int) -> None:
    with pytest.raises(ConfigError) as info:
        validate(_cfg(lead_time_s=lead))
    text = info.value.render()
    assert "preemption.lead_time_s" in text and "cluster.time (00:02:00 = 120 s)" in text
    assert validate(_cfg(lead_time_s=60)).preemption.lead_time_s == 60


def sync_checkpoint(cfg):  # noqa: ANN001, ANN201
    return cfg.checkpoint.model_copy(update={"asynchronous": False})


def test_projected_save_time_and_the_warning_with_numbers() -> None:
    profile = load_profile("aws-efa")
    assert profile.checkpoint_write_gb_per_s == DEFAULT_CHECKPOINT_WRITE_GB_PER_S
    cfg = validate({**_cfg(lead_time_s=60), "cluster": {"time": "04:00:00"}})
    result = E.estimate(cfg, profile)
    want = result["checkpoint_bytes"] / (cfg.resources.nodes * 1e9)
    assert result["checkpoint_save_s"] == pytest.approx(want) and 300 < want < 500  # ~830 GB over 2 nodes
    assert result["checkpoint_async"] is True  # checkpoint.async's default: a stop may wait for a save in flight
    warning = T.lead_time_warning(result)
    assert warning is not None
    assert (f"preemption.lead_time_s 60 s is below twice the projected checkpoint save time, {2 * want:.0f} s "
            f"(checkpoint.async: a stop first finishes the save in flight, then saves its own step; each save "
            f"~{want:.0f} s; ") in warning
    assert "2 node(s) x 1 GB/s per node" in warning and f"at least {int(want * 2) + 30} " in warning
    sync = E.estimate(validate({**_cfg(lead_time_s=60), "cluster": {"time": "04:00:00"},
                                "checkpoint": {"async": False}}), profile)
    warning = T.lead_time_warning(sync)
    assert f"preemption.lead_time_s 60 s is below the projected checkpoint save time {want:.0f} s (" in warning
    fast = profile.model_copy(update={"checkpoint_write_gb_per_s": 10.0})
    quick = E.estimate(cfg, fast)  # ~41 s a save: one fits in 60 s, a save in flight and the stop's own do not
    assert "below twice the projected checkpoint save time, 83 s" in T.lead_time_warning(quick)
    assert T.lead_time_warning(E.estimate(cfg.model_copy(update={"checkpoint": sync_checkpoint(cfg)}), fast)) is None


def test_the_filesystems_aggregate_caps_a_many_node_save() -> None:
    """64 nodes at 1 GB/s each would write 64 GB/s; a shared filesystem that takes 5 GB/s in all makes the save
    (and the lead time it needs) 12.8x longer, and the warning says which figure bound it."""
    profile = load_profile("aws-efa")
    assert profile.checkpoint_write_gb_per_s_total is None  # no cap unless the site knows its filesystem
    capped = ClusterProfile.model_validate({**profile.model_dump(), "checkpoint_write_gb_per_s_total": 5})
    cfg = validate({**_cfg(lead_time_s=120), "cluster": {"time": "16:00:00"}, "resources": {"nodes": 64}})
    free, slow = E.estimate(cfg, profile), E.estimate(cfg, capped)
    assert free["checkpoint_save_s"] == pytest.approx(free["checkpoint_bytes"] / 64e9)
    assert slow["checkpoint_save_s"] == pytest.approx(slow["checkpoint_bytes"] / 5e9)
    assert T.lead_time_warning(free) is None
    warning = T.lead_time_warning(slow)
    assert warning is not None and "5 GB/s, the checkpoint filesystem's cap (checkpoint_write_gb_per_s_total), not 64 " \
        "node(s) x 1 GB/s per node" in warning
    roomy = E.estimate(cfg, ClusterProfile.model_validate({**profile.model_dump(), "checkpoint_write_gb_per_s_total": 500}))
    assert roomy["checkpoint_save_s"] == pytest.approx(free["checkpoint_save_s"])  # a cap above 64 x 1 does not bind


def test_estimate_and_validate_show_it(capsys: pytest.CaptureFixture[str]) -> None:
    main(["estimate", str(EXAMPLE_70B), "preemption.lead_time_s=120"])
    out = capsys.readouterr().out
    assert "projected save time" in out and "lead_time_s 120 s" in out
    try:
        main(["validate", str(EXAMPLE_70B), "preemption.lead_time_s=120"])
    except SystemExit as exc:
        assert not exc.code
    err = capsys.readouterr().err
    assert "warning: preemption.lead_time_s 120 s is below twice the projected checkpoint save time" in err
    try:
        main(["validate", str(EXAMPLE_70B), "cluster.time=00:10:00"])  # its lead_time_s is 600
    except SystemExit as exc:
        assert exc.code == 2
    assert "not shorter than cluster.time" in capsys.readouterr().err
