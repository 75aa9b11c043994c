"""Rendering: golden scripts, bash -n, directives, quoting, secrets, user templates."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from slurmft.config_loading import load_config
from slurmft.errors import RenderError
from slurmft.plan.render import render, render_scripts
from slurmft.profiles import load_profile
from slurmft.rundir import RunPaths
from tests.goldens import assert_matches_golden

HERE = Path(__file__).parent
GOLDEN_CFG = HERE / "data" / "golden-2x8-aws-efa.yaml"
GOLDEN = HERE / "golden"


def scripts_for(path: Path, *overrides: str, template_dir: str | None = None) -> dict[str, str]:
    cfg = load_config(path, list(overrides))
    return render_scripts(cfg, load_profile(cfg.cluster.profile), RunPaths.of(cfg.output_dir),
                          "golden-2x8-aws-efa.yaml", template_dir)


@pytest.mark.parametrize("kind", ["prepare", "train", "consolidate"])
def test_matches_golden(kind: str) -> None:
    text = scripts_for(GOLDEN_CFG)[kind]
    assert_matches_golden(text, GOLDEN / f"{kind}-2x8-aws-efa.sbatch")


@pytest.mark.parametrize("kind", ["prepare", "train", "consolidate"])
def test_bash_syntax_and_no_jinja_left(kind: str, tmp_path: Path) -> None:
    text = scripts_for(GOLDEN_CFG)[kind]
    script = tmp_path / "s.sh"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    assert "{{" not in text and "{%" not in text


def test_train_script_has_every_directive_and_the_profile_env() -> None:
    text = scripts_for(GOLDEN_CFG)["train"]
    for directive in ("--nodes=2", "--ntasks-per-node=8", "--gpus-per-node=8", "--cpus-per-task=12", "--mem=0",
                      "--time=12:00:00", "--partition=p4d", "--account=ml-team", "--qos=high",
                      "--constraint='a100&efa'", "--exclusive", "--requeue", "--signal=USR2@180",
                      "--open-mode=append", "--output=/shared/runs/golden-2x8/logs/train-%j.out",
                      "--error=/shared/runs/golden-2x8/logs/train-%j.out"):
        assert f"#SBATCH {directive}\n" in text, directive
    profile = load_profile("aws-efa")
    for key, var in profile.env.items():
        assert f"export {key}=" in text and var.reason in text
    assert "srun --kill-on-bad-exit=1" in text
    assert "-m slurmft.job.rendezvous exports" in text  # MASTER_ADDR/PORT from the allocation
    assert "export WANDB_PROJECT='llama 70b'" in text  # values with spaces are quoted


def test_srun_passes_cpus_per_task_and_turns_gpu_binding_off() -> None:
    """Slurm >= 22.05 steps do not inherit --cpus-per-task; every rank sees its node's GPUs (cuda:LOCAL_RANK)."""
    scripts = scripts_for(GOLDEN_CFG)
    srun = next(line for line in scripts["train"].splitlines() if line.startswith("srun "))
    assert "--cpus-per-task=12 " in srun and "--gpu-bind=none " in srun, srun
    srun = next(line for line in scripts["consolidate"].splitlines() if line.startswith("srun "))
    assert "--cpus-per-task=4 " in srun and "--gpu-bind" not in srun, srun
    cpu = scripts_for(GOLDEN_CFG, "resources.gpus_per_node=0", "resources.tasks_per_node=2")["train"]
    srun = next(line for line in cpu.splitlines() if line.startswith("srun "))
    assert "--cpus-per-task=12 " in srun and "--gpu-bind" not in srun, srun  # no GPUs requested: nothing to bind


def test_consolidate_script_is_one_cpu_task_without_network_tuning() -> None:
    text = scripts_for(GOLDEN_CFG)["consolidate"]
    assert "#SBATCH --nodes=1\n" in text and "--gpus-per-node" not in text
    assert "NCCL_" not in text and "FI_EFA" not in text
    assert "--dependency" not in text  # added on the sbatch command line at submit time


def test_disabled_consolidation_renders_only_train() -> None:
    assert set(scripts_for(GOLDEN_CFG, "consolidate.enabled=false")) == {"prepare", "train"}
    assert set(scripts_for(GOLDEN_CFG, "consolidate.enabled=false", "prepare.enabled=false")) == {"train"}


def test_secrets_from_the_environment_never_reach_a_script(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_SECRETSECRET123")
    monkeypatch.setenv("WANDB_API_KEY", "wandb_SECRET456")
    for text in scripts_for(GOLDEN_CFG).values():
        assert "SECRET" not in text and "HF_TOKEN" not in text and "WANDB_API_KEY" not in text


def test_user_template_dir_takes_precedence(tmp_path: Path) -> None:
    (tmp_path / "train.sbatch.j2").write_text("#!/bin/bash\n# mine {{ run_name }}\n{{ command }}\n")
    text = scripts_for(GOLDEN_CFG, template_dir=str(tmp_path))["train"]
    assert text.startswith("#!/bin/bash\n# mine golden-2x8\n")
    assert "#SBATCH" in scripts_for(GOLDEN_CFG, template_dir=str(tmp_path))["consolidate"]  # falls back


def test_undefined_variable_is_an_error_not_an_empty_string(tmp_path: Path) -> None:
    (tmp_path / "x.j2").write_text("echo {{ no_such_value }}\n")
    with pytest.raises(RenderError, match="no_such_value"):
        render("x.j2", {}, tmp_path)


def test_shellcheck_clean(tmp_path: Path) -> None:
    if not shutil.which("shellcheck"):
        if os.environ.get("CI"):  # .ci/run installs it: a missing shellcheck there is a broken CI, not a skip
            pytest.fail("shellcheck is not installed but CI is set (.ci/run installs it: apt-get install shellcheck)")
        pytest.skip("shellcheck not installed (apt-get install shellcheck)")
    for kind, text in scripts_for(GOLDEN_CFG).items():
        script = tmp_path / f"{kind}.sh"
        script.write_text(text)
        out = subprocess.run(["shellcheck", "-S", "warning", str(script)], capture_output=True, text=True)
        assert out.returncode == 0, out.stdout


# ------------------------------------------------------------------ the doctor's probe job (slurmft doctor --job)
def probe_for(template_dir: str | None = None) -> str:
    from slurmft.plan.render import PROBE_TEMPLATE, build_probe_context, signal_directive

    cfg = load_config(GOLDEN_CFG)
    signal = signal_directive(scripts_for(GOLDEN_CFG, template_dir=template_dir)["train"])
    assert signal is not None
    ctx = build_probe_context(cfg, load_profile(cfg.cluster.profile), Path("/shared/home/.cache/slurmft/doctor/golden"),
                              signal, Path("/shared/runs"), "golden-2x8-aws-efa.yaml")
    return render(PROBE_TEMPLATE, ctx)


def test_probe_matches_golden_and_is_clean_bash(tmp_path: Path) -> None:
    text = probe_for()
    golden = GOLDEN / "probe-2x8-aws-efa.sbatch"
    if os.environ.get("SLURMFT_UPDATE_GOLDEN"):
        golden.write_text(text)
        pytest.fail(f"SLURMFT_UPDATE_GOLDEN is set: wrote {golden}; review the diff, then run again without it")
    assert text == golden.read_text(), f"rendered probe differs from {golden} (SLURMFT_UPDATE_GOLDEN=1 to refresh)"
    script = tmp_path / "probe.sh"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    if shutil.which("shellcheck"):  # test_shellcheck_clean says when a missing shellcheck is a failure
        out = subprocess.run(["shellcheck", "-S", "warning", str(script)], capture_output=True, text=True)
        assert out.returncode == 0, out.stdout


def test_probe_has_the_runs_shape_and_its_train_signal(tmp_path: Path) -> None:
    text = probe_for()
    for directive in ("--nodes=2", "--ntasks-per-node=8", "--gpus-per-node=8", "--cpus-per-task=12", "--partition=p4d",
                      "--account=ml-team", "--signal=USR2@180", "--time=6"):
        assert f"#SBATCH {directive}\n" in text, directive
    assert "module load cuda/12.1" in text and "export FI_EFA_USE_HUGE_PAGE=0" in text
    assert "/opt/venv/bin/python -m slurmft.job.probe rank" in text and "--lead=180" in text
    # a user template that renders --signal=B: reaches the probe as written (the probe then shows it failing)
    (tmp_path / "partials").mkdir()
    (tmp_path / "partials" / "directives.j2").write_text(
        '{% for directive in directives %}\n#SBATCH {{ directive | replace("--signal=", "--signal=B:") }}\n{% endfor %}\n')
    assert "#SBATCH --signal=B:USR2@180\n" in probe_for(str(tmp_path))


@pytest.mark.parametrize(("script", "expected"), [
    ("#SBATCH --signal=USR2@300\n", ("USR2", 300, False)),
    ("#SBATCH --signal=B:SIGUSR1@90\n", ("USR1", 90, True)),
    ("#SBATCH --signal=R:USR2\n", ("USR2", 60, False)),
    ("#SBATCH --signal=USR2@300\n#SBATCH --signal=B:USR2@120\n", ("USR2", 120, True)),  # the last one wins
])
def test_signal_directive(script: str, expected: tuple[str, int, bool]) -> None:
    from slurmft.plan.render import signal_directive

    found = signal_directive("#!/bin/bash\n" + script + "srun x\n")
    assert found is not None and (found.name, found.lead_s, found.batch_only) == expected
    assert signal_directive("#!/bin/bash\n# --signal=USR2@1 in a comment\n") is None


def test_prepare_script_asks_for_cpus_only_and_is_valid_bash(tmp_path: Path) -> None:
    """prepare.enabled: a third script, one task on prepare.resources' CPUs, no GPU gres, no NCCL settings."""
    scripts = scripts_for(GOLDEN_CFG, "prepare.enabled=true", "prepare.resources.cpus_per_task=16",
                          "prepare.resources.mem=64G", "prepare.resources.time=01:30:00",
                          "prepare.resources.partition=cpu")
    assert list(scripts) == ["prepare", "train", "consolidate"]
    text = scripts["prepare"]
    for directive in ("--job-name=golden-2x8-prepare", "--nodes=1", "--ntasks-per-node=1", "--cpus-per-task=16",
                      "--mem=64G", "--time=01:30:00", "--partition=cpu", "--account=ml-team",
                      "--output=/shared/runs/golden-2x8/logs/prepare-%j.out"):
        assert f"#SBATCH {directive}\n" in text, directive
    sbatch = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert not [line for line in sbatch if "gpu" in line or "gres" in line], sbatch
    assert "--gpu" not in text and "--gres" not in text
    assert "NCCL_" not in text and "export OMP_NUM_THREADS=16" in text
    script = tmp_path / "prepare.sh"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    if shutil.which("shellcheck"):
        check = subprocess.run(["shellcheck", "-S", "warning", str(script)], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout
    # the train and consolidation scripts are the same as without a prepare job (the chaining is submit's)
    plain = scripts_for(GOLDEN_CFG, "prepare.enabled=false")
    assert scripts["train"] == plain["train"] and scripts["consolidate"] == plain["consolidate"]


def test_prepare_is_on_by_default_and_off_renders_no_prepare_script() -> None:
    assert list(scripts_for(GOLDEN_CFG)) == ["prepare", "train", "consolidate"]
    assert "prepare" not in scripts_for(GOLDEN_CFG, "prepare.enabled=false")


def test_prepare_tasks_render_an_array_logging_per_task(tmp_path: Path) -> None:
    """prepare.tasks: the prepare script is an array of the same CPU task, task k logging into prepare-<array>_<k>;
    the train and consolidation scripts do not change (the train job's afterok on the array is submit's)."""
    scripts = scripts_for(GOLDEN_CFG, "prepare.tasks=4")
    text = scripts["prepare"]
    for directive in ("--array=0-3", "--output=/shared/runs/golden-2x8/logs/prepare-%A_%a.out",
                      "--error=/shared/runs/golden-2x8/logs/prepare-%A_%a.out", "--ntasks-per-node=1"):
        assert f"#SBATCH {directive}\n" in text, directive
    assert "prepare-%j.out" not in text
    script = tmp_path / "prepare.sh"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    one = scripts_for(GOLDEN_CFG)
    assert scripts["train"] == one["train"] and scripts["consolidate"] == one["consolidate"]
    assert "--array" not in one["prepare"]
