"""Containers (slurmft/plan/container.py): the rank step in the image, everything else on the host.

Golden scripts for each runtime on the reference 2x8 EFA allocation, and the boundary's rules checked on
every one of them: no ``#SBATCH --container*``, no ``B:`` on the signal, the rendezvous and the requeue on
the host around the one wrapped step, every variable the script exports passed into the image by name.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from slurmft.config_loading import load_config
from slurmft.errors import ConfigError
from slurmft.plan.container import automatic_mounts, image_problems, resolve
from slurmft.profiles import load_profile
from tests.goldens import assert_matches_golden
from tests.test_render import GOLDEN, GOLDEN_CFG, scripts_for

# The reference allocation, its data and HF cache on the cluster's shared file system, one extra mount.
COMMON = ("data.datasets[0].path=/fsx/data/chat.jsonl", "cluster.env.HF_HOME=/fsx/hf",
          "cluster.container.mounts=[/fsx/cache:/cache]")
RUNTIMES = {
    "pyxis": ("cluster.profile=aws-efa-pyxis", "cluster.container.image=/fsx/images/sft.sqsh"),
    "apptainer": ("cluster.container.runtime=apptainer", "cluster.container.image=/fsx/images/sft.sif"),
    "charliecloud": ("cluster.container.runtime=charliecloud", "cluster.container.image=/fsx/images/sft"),
    "podman": ("cluster.container.runtime=podman", "cluster.container.image=localhost/sft:1"),
}
KINDS = ("prepare", "train", "consolidate")


def container_scripts(runtime: str, *more: str) -> dict[str, str]:
    return scripts_for(GOLDEN_CFG, *COMMON, *RUNTIMES[runtime], *more)


def srun_line(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("srun "))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_matches_golden_and_is_clean_bash(runtime: str, kind: str, tmp_path: Path) -> None:
    text = container_scripts(runtime)[kind]
    assert_matches_golden(text, GOLDEN / f"{kind}-2x8-aws-efa-{runtime}.sbatch")
    script = tmp_path / "s.sh"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    if not shutil.which("shellcheck"):
        if os.environ.get("CI"):
            pytest.fail("shellcheck is not installed but CI is set (.ci/run installs it)")
        pytest.skip("shellcheck not installed (apt-get install shellcheck)")
    out = subprocess.run(["shellcheck", "-S", "warning", str(script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_the_batch_script_stays_on_the_host(runtime: str) -> None:
    """No #SBATCH --container* (a batch script in the image has no scontrol: pyxis#129), no B: on the signal,
    the rendezvous and the requeue run by the host's Python around the one step that enters the image."""
    scripts = container_scripts(runtime)
    for text in scripts.values():
        directives = [line for line in text.splitlines() if line.startswith("#SBATCH")]
        assert not [d for d in directives if "container" in d], directives
        assert not [d for d in directives if "--signal" in d and "B:" in d], directives
        assert len([line for line in text.splitlines() if line.startswith("srun ")]) == 1
    train = scripts["train"].splitlines()
    assert "#SBATCH --signal=USR2@180" in train and "#SBATCH --requeue" in train
    step = next(i for i, line in enumerate(train) if line.startswith("srun "))
    requeue = next(i for i, line in enumerate(train) if "-m slurmft.job.requeue" in line)
    rendezvous = next(i for i, line in enumerate(train) if "-m slurmft.job.rendezvous" in line)
    assert rendezvous < step < requeue
    for host_line in (train[requeue], train[rendezvous]):  # the host's cluster.python, not the image's
        assert "/opt/venv/bin/python -m slurmft.job." in host_line
        assert not re.search(r"container|apptainer|ch-run|podman", host_line), host_line
    # the ranks run the image's python; podman's tasks first run the host's, to pass each its own environment and
    # GPUs (slurmft/job/podman_task.py), then exec podman
    task = "/opt/venv/bin/python -m slurmft.job.podman_task "
    assert (task in srun_line(scripts["train"])) is (runtime == "podman")
    assert "/opt/venv/bin/python" not in srun_line(scripts["train"]).replace(task, "")
    assert " python -u -m slurmft.job.launch --signal=USR2 " in srun_line(scripts["train"])
    for kind in ("prepare", "consolidate"):
        assert " python -u -m submitit.core._submit /shared/runs/golden-2x8/submitit" in srun_line(scripts[kind])


def passed_names(runtime: str, srun: str) -> set[str]:
    """The variable names a rendered step passes into the image, in the runtime's own syntax."""
    if runtime == "pyxis":
        return set(re.search(r"--container-env=(\S+)", srun).group(1).split(","))  # type: ignore[union-attr]
    pattern = {"apptainer": r'"APPTAINERENV_(\w+)=\$\{(\w+)\}"', "charliecloud": r'"--set-env=(\w+)=\$\{(\w+)\}"',
               "podman": r"--env=(\w+)(?=\s)"}[runtime]
    found = re.findall(pattern, srun)
    if runtime != "podman":
        assert all(a == b for a, b in found), found  # NAME=${NAME}: the batch shell's own value
        return {a for a, _ in found}
    return set(found)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_every_exported_variable_is_passed_into_the_image(runtime: str) -> None:
    """An image's ENV beats an inherited value (pyxis#124; NGC images set NCCL_* and MASTER_PORT): every variable
    the script exports, and the rendezvous' MASTER_ADDR/PORT for the ranks, goes in by name."""
    scripts = container_scripts(runtime, "cluster.container.env.TRITON_CACHE_DIR=/tmp/triton")
    for kind, text in scripts.items():
        exported = set(re.findall(r"^export (\w+)=", text, re.MULTILINE))
        assert "SLURM_EXPORT_ENV" in exported
        exported.discard("SLURM_EXPORT_ENV")  # srun's own, read on the host: nothing in the image reads it
        assert {"HF_HOME", "SLURMFT_RUN_DIR", "TRITON_CACHE_DIR", "OMP_NUM_THREADS", "WANDB_PROJECT"} <= exported
        if kind == "train":
            assert {"NCCL_DEBUG", "FI_EFA_USE_HUGE_PAGE", "NCCL_SOCKET_IFNAME"} <= exported
            exported |= {"MASTER_ADDR", "MASTER_PORT"}
        assert passed_names(runtime, srun_line(text)) == exported, kind
    if runtime == "podman":  # the one runtime that starts from the image's environment only
        assert "'--env=SLURM_*'" in srun_line(scripts["train"])


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_the_run_dir_data_and_cache_are_mounted_at_the_same_paths(runtime: str) -> None:
    srun = srun_line(container_scripts(runtime)["train"])
    same = re.findall(r"(?:^|[\s,=])(/[\w./-]*):\1(?=[\s,]|$)", srun)  # SRC:SRC binds
    for path in ("/shared/runs/golden-2x8", "/fsx/data", "/fsx/hf"):  # itself, or a directory above it (pyxis: /fsx)
        assert [m for m in same if path == m or path.startswith(m + "/")], (path, srun)
    assert "/fsx/cache:/cache" in srun
    gpu_flag = {"pyxis": None, "apptainer": "--nv", "charliecloud": None, "podman": "--gpus=exclusive"}
    if gpu_flag[runtime]:
        assert gpu_flag[runtime] in srun
        assert gpu_flag[runtime] not in srun_line(container_scripts(runtime)["consolidate"])  # a CPU job


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_the_batch_script_creates_hf_home_on_the_host_before_the_step(runtime: str, tmp_path: Path) -> None:
    """Issue 47, defect 5: pyxis refuses a step whose mount source does not exist (found with pyxis 0.24 + enroot
    4.1), after the queue wait; so does every runtime. The batch script makes HF_HOME first, on the host, and stops
    with a line naming it when it cannot. Run for real here: the script's own line creates a missing directory."""
    for kind, text in container_scripts(runtime).items():
        lines = text.splitlines()
        made = [i for i, line in enumerate(lines) if line.startswith("mkdir -p -- /fsx/hf ||")]
        assert len(made) == 1 and made[0] < lines.index(srun_line(text)), (kind, text)
        assert "cannot create /fsx/hf (HF_HOME" in lines[made[0]] and "exit 1" in lines[made[0]]
    hf = tmp_path / "not yet" / "hf"
    line = next(line for line in container_scripts(runtime, f"cluster.env.HF_HOME={hf}")["prepare"].splitlines()
                if line.startswith("mkdir -p -- "))
    assert subprocess.run(["bash", "-c", f"set -u; {line}"], capture_output=True).returncode == 0 and hf.is_dir()
    (tmp_path / "file").write_text("")
    line = next(line for line in container_scripts(runtime, f"cluster.env.HF_HOME={tmp_path / 'file' / 'hf'}")[
        "train"].splitlines() if line.startswith("mkdir -p -- "))
    out = subprocess.run(["bash", "-c", f"set -u; {line}; echo went on"], capture_output=True, text=True)
    assert out.returncode == 1 and "went on" not in out.stdout and "[slurmft] cannot create" in out.stderr
    assert not any(line.startswith("mkdir") for text in scripts_for(GOLDEN_CFG, "cluster.env.HF_HOME=/fsx/hf").values()
                   for line in text.splitlines())  # no image: nothing to mount, the libraries make their cache


def test_each_podman_task_passes_the_users_environment_and_its_own_gpus() -> None:
    """Issue 47, defect 3: podman gives a container the image's environment and what it is told. Each task runs
    slurmft/job/podman_task.py on the host first (the user's exported variables by name, the GPUs Slurm gave it),
    never ``--device=nvidia.com/gpu=all`` from the script: with shared nodes that was another job's GPUs too."""
    for kind, text in container_scripts("podman", "resources.exclusive=false").items():
        line = srun_line(text)
        assert "nvidia.com/gpu" not in line, (kind, line)
        assert " /opt/venv/bin/python -m slurmft.job.podman_task --signal=USR2 " in line, (kind, line)  # the host's
        assert ("--gpus=shared podman run " in line) is (kind == "train"), (kind, line)  # the CPU jobs: no GPU
    train = srun_line(container_scripts("podman")["train"])  # whole nodes: their every GPU is the job's
    assert "--gpus=exclusive podman run " in train


def test_pyxis_flags_are_the_ones_pyxis_registers() -> None:
    """pyxis's args.c (NVIDIA/pyxis, 2026-05): every --container* option it registers; nothing else renders."""
    registered = {"container-image", "container-mounts", "container-workdir", "container-name", "container-save",
                  "container-mount-home", "no-container-mount-home", "container-remap-root",
                  "no-container-remap-root", "container-entrypoint", "no-container-entrypoint",
                  "container-entrypoint-log", "container-writable", "container-readonly", "container-env",
                  "container-unshare"}
    for writable in ("false", "true"):
        for mount_home in ("false", "true"):
            srun = srun_line(container_scripts("pyxis", f"cluster.container.writable={writable}",
                                               f"cluster.container.mount_home={mount_home}")["train"])
            used = set(re.findall(r"--((?:no-)?container-[a-z-]+)", srun))
            assert used <= registered, used - registered
            assert ("container-writable" in used) is (writable == "true")
            assert ("container-mount-home" in used) is (mount_home == "true")


def test_no_container_renders_todays_scripts() -> None:
    plain = scripts_for(GOLDEN_CFG)
    for kind in KINDS:
        assert plain[kind] == (GOLDEN / f"{kind}-2x8-aws-efa.sbatch").read_text()


def test_the_profile_carries_the_site_defaults_and_the_run_overrides_them() -> None:
    efa, pyxis = load_profile("aws-efa"), load_profile("aws-efa-pyxis")
    assert pyxis.env == efa.env and pyxis.container is not None and pyxis.container.runtime == "pyxis"
    cfg = load_config(GOLDEN_CFG, [*COMMON, *RUNTIMES["pyxis"], "cluster.container.python=/usr/bin/python3"])
    container = resolve(cfg, pyxis)
    assert container is not None and container.python == "/usr/bin/python3"
    assert ("/fsx", "/fsx") in container.mounts and ("/fsx/cache", "/cache") in container.mounts
    assert container.workdir == "/shared/runs/golden-2x8"


# ------------------------------------------------------------------ bad input: each names its field and fix
def problems(*overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        cfg = load_config(GOLDEN_CFG, list(overrides))
        resolve(cfg, load_profile(cfg.cluster.profile))
    return err.value.render()


@pytest.mark.parametrize(("runtime", "hint"), [("singularity", "did you mean 'apptainer'"),
                                               ("pyxsi", "did you mean 'pyxis'"),
                                               ("docker", "use one of pyxis, apptainer, charliecloud, podman")])
def test_an_unknown_runtime_says_which_it_meant(runtime: str, hint: str) -> None:
    text = problems(f"cluster.container.runtime={runtime}", "cluster.container.image=x")
    assert "cluster.container.runtime" in text and hint in text


@pytest.mark.parametrize("mount", ["data:/data", "/data:data", "/a b:/c", "/a:/b:/c", "/a,/b"])
def test_a_mount_must_be_two_absolute_paths(mount: str) -> None:
    text = problems("cluster.container.runtime=pyxis", "cluster.container.image=x", f"cluster.container.mounts=['{mount}']")
    assert "cluster.container.mounts" in text and mount in text


@pytest.mark.parametrize("mount", ["/scratch/x:/shared/runs", "/scratch/x:/shared", "/tmp/y:/shared/runs/golden-2x8"])
def test_a_mount_that_hides_the_run_dir_is_refused(mount: str) -> None:
    text = problems("cluster.container.runtime=pyxis", "cluster.container.image=x", f"cluster.container.mounts=[{mount}]")
    assert "hides /shared/runs/golden-2x8" in text and "the run directory" in text


def test_a_mount_of_the_same_path_above_the_run_dir_is_fine() -> None:
    cfg = load_config(GOLDEN_CFG, ["cluster.container.runtime=pyxis", "cluster.container.image=x",
                                   "cluster.container.mounts=[/shared]"])
    assert resolve(cfg, load_profile("aws-efa")) is not None


def test_the_image_is_required_somewhere() -> None:
    text = problems("cluster.profile=aws-efa-pyxis")
    assert "cluster.container.image: required" in text and "aws-efa-pyxis" in text


def test_an_image_file_must_exist_and_be_readable(tmp_path: Path) -> None:
    missing = tmp_path / "nope.sqsh"
    cfg = load_config(GOLDEN_CFG, ["cluster.profile=aws-efa-pyxis", f"cluster.container.image={missing}"])
    container = resolve(cfg, load_profile("aws-efa-pyxis"))
    assert container is not None and "does not exist" in image_problems(container)[0]
    missing.write_text("squashfs")
    assert image_problems(container) == []
    registry = resolve(load_config(GOLDEN_CFG, ["cluster.profile=aws-efa-pyxis",
                                                "cluster.container.image=nvcr.io#nvidia/pytorch:25.01-py3"]),
                       load_profile("aws-efa-pyxis"))
    assert registry is not None and not registry.image_is_path and image_problems(registry) == []


def test_an_image_path_is_resolved_like_every_other_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 47, defect 4: cluster.container.image against run.yaml's folder (an override: the current directory),
    ``~`` expanded; validate checks that file, and the script names it absolutely. A registry reference stays."""
    from slurmft.plan.checks import Report, check_container

    folder, elsewhere, home = tmp_path / "project", tmp_path / "elsewhere", tmp_path / "home"
    for d in (folder / "images", elsewhere, home):
        d.mkdir(parents=True)
    (folder / "images" / "sft.sif").write_text("sif")
    (home / "sft.sif").write_text("sif")
    run_yaml = folder / "run.yaml"
    run_yaml.write_text(GOLDEN_CFG.read_text() + "\n")
    cfg_text = run_yaml.read_text()
    assert "container" not in cfg_text and "\ncluster:\n" in cfg_text  # the run's own section goes in there
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(elsewhere)  # validate runs from anywhere
    for image, expected in (("./images/sft.sif", folder / "images" / "sft.sif"), ("~/sft.sif", home / "sft.sif"),
                            ("images/sft.sif", folder / "images" / "sft.sif")):
        run_yaml.write_text(cfg_text.replace("cluster:\n", f"cluster:\n  container: {{runtime: apptainer, image: "
                                                          f"'{image}'}}\n", 1))
        cfg = load_config(run_yaml, ["cluster.env.HF_HOME=/shared/hf"])
        assert cfg.cluster.container is not None and cfg.cluster.container.image == str(expected), image
        report = Report()
        assert check_container(cfg, report) is not None and report.problems == [], (image, report.problems)
        train = scripts_for(run_yaml, "cluster.env.HF_HOME=/shared/hf")["train"]
        assert f" {expected} " in srun_line(train), image
    (elsewhere / "other.sif").write_text("sif")
    cfg = load_config(run_yaml, ["cluster.container.image=./other.sif"])  # the command line's: the current directory
    assert cfg.cluster.container is not None and cfg.cluster.container.image == str(elsewhere / "other.sif")
    for reference in ("docker://nvcr.io/nvidia/pytorch:25.01-py3", "localhost/sft:1", "nvcr.io#nvidia/pytorch:25.01"):
        cfg = load_config(run_yaml, [f"cluster.container.image={reference}"])
        assert cfg.cluster.container is not None and cfg.cluster.container.image == reference


def test_the_local_executor_refuses_a_container() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(GOLDEN_CFG, ["executor=local", "resources.nodes=1", "cluster.container.runtime=pyxis"])
    assert "cluster.container: the local executor runs the job on this machine" in err.value.render()


def test_automatic_mounts_are_the_outermost_directories(tmp_path: Path) -> None:
    cfg = load_config(GOLDEN_CFG, ["model.name_or_path=/shared/models/llama", "output_dir=/shared/runs/x",
                                   "data.datasets[0].path=/shared/runs/x/data.jsonl", "cluster.env.HF_HOME=/shared"])
    assert automatic_mounts(cfg) == ["/shared"]


def test_validate_names_a_missing_image_and_leaves_the_image_to_doctor(tmp_path: Path) -> None:
    from slurmft.plan.checks import Report, check_container

    image = tmp_path / "sft.sif"
    cfg = load_config(GOLDEN_CFG, ["cluster.container.runtime=apptainer", f"cluster.container.image={image}",
                                   "cluster.env.HF_HOME=/shared/hf"])
    report = Report()
    assert check_container(cfg, report) is not None  # still the run's container: the host checks follow it
    assert [p for p in report.problems if p.startswith(f"cluster.container.image: {image} does not exist")]
    image.write_text("sif")
    report = Report()
    assert check_container(cfg, report) is not None and report.problems == []
    assert any("slurmft doctor --job" in line for line in report.skipped)
    report = Report()
    bad = load_config(GOLDEN_CFG, ["cluster.container.runtime=apptainer", f"cluster.container.image={image}",
                                   "cluster.container.mounts=[/elsewhere:/shared/runs]"])
    assert check_container(bad, report) is None and "hides /shared/runs/golden-2x8" in report.problems[0]


def test_the_configs_in_docs_containers_md_render(tmp_path: Path) -> None:
    import yaml

    from slurmft.plan.render import render_scripts
    from slurmft.rundir import RunPaths

    doc = (Path(__file__).resolve().parent.parent / "docs" / "containers.md").read_text()
    blocks = re.findall(r"^```yaml\n(.*?)^```", doc, flags=re.S | re.M)
    assert len(blocks) == 5
    marker = {"pyxis": "--container-image=", "apptainer": " apptainer exec ", "charliecloud": " ch-run ",
              "podman": " podman run "}
    seen = set()
    for i, block in enumerate(blocks):
        data = yaml.safe_load(GOLDEN_CFG.read_text())
        data["cluster"].update(yaml.safe_load(block)["cluster"])
        data["data"]["datasets"][0]["path"] = str(GOLDEN_CFG.parent / "chat.jsonl")
        path = tmp_path / f"doc-{i}.yaml"
        path.write_text(yaml.safe_dump(data))
        cfg = load_config(path)
        profile = load_profile(cfg.cluster.profile)
        container = resolve(cfg, profile)
        assert container is not None
        train = render_scripts(cfg, profile, RunPaths.of(cfg.output_dir))["train"]
        assert marker[container.runtime] in srun_line(train), block
        seen.add(container.runtime)
    assert seen == set(RUNTIMES)


def test_validate_asks_for_a_writable_hf_home_in_an_image(tmp_path: Path) -> None:
    """The crossing with the Hugging Face caches, found on the real cluster: datasets writes ~/.cache, which in a
    read-only image without the user's home fails with 'Read-only file system'."""
    from slurmft.plan.checks import Report, check_container

    image = tmp_path / "sft"
    image.mkdir()
    base = ["cluster.container.runtime=charliecloud", f"cluster.container.image={image}"]
    report = Report()
    check_container(load_config(GOLDEN_CFG, base), report)
    assert [p for p in report.problems if p.startswith("cluster.env.HF_HOME: needed when the ranks run in an image")]
    for fix in ("cluster.env.HF_HOME=/shared/hf", "cluster.container.env.HF_HOME=/shared/hf",
                "cluster.container.mount_home=true"):
        report = Report()
        check_container(load_config(GOLDEN_CFG, [*base, fix]), report)
        assert report.problems == [], fix


def test_the_doctors_probe_runs_its_ranks_in_the_image_and_its_batch_side_on_the_host() -> None:
    """The probe runs before the run directory exists: it binds the nearest existing parent (the one it writes its
    token into) and its own directory instead, and no mount of the missing run dir (a bind's source must exist)."""
    from slurmft.plan.render import PROBE_TEMPLATE, build_probe_context, render, signal_directive

    overrides = [*COMMON, *RUNTIMES["charliecloud"]]
    cfg = load_config(GOLDEN_CFG, overrides)
    signal = signal_directive(scripts_for(GOLDEN_CFG, *overrides)["train"])
    assert signal is not None
    probe_dir = Path("/shared/home/.cache/slurmft/doctor/golden")
    ctx = build_probe_context(cfg, load_profile(cfg.cluster.profile), probe_dir, signal, Path("/shared/runs"))
    text = render(PROBE_TEMPLATE, ctx)
    step = srun_line(text)
    assert " ch-run " in step and " python -m slurmft.job.probe rank " in step
    assert f"--bind={probe_dir}:{probe_dir}" in step and "--bind=/shared/runs:/shared/runs" in step
    assert "/shared/runs/golden-2x8" not in step and "--cd=/shared/runs " in step
    assert passed_names("charliecloud", step) >= {"MASTER_ADDR", "MASTER_PORT", "NCCL_SOCKET_IFNAME", "HF_HOME"}
    batch = next(line for line in text.splitlines() if "-m slurmft.job.probe batch" in line)
    assert batch.startswith("/opt/venv/bin/python -m slurmft.job.probe batch")
    assert not [line for line in text.splitlines() if line.startswith("#SBATCH") and "container" in line]


# ------------------------------------------------------------------ the jobs after consolidation: where they run
SERVE_EVAL = ("serve.python=/opt/vllm/bin/python", "eval.tasks=[/shared/tasks/mine.yaml]", "eval.backend=hf")


def test_a_job_after_consolidation_in_the_runs_image_runs_its_tool_with_the_images_python() -> None:
    """The latent bug of issue 48: with the ranks in an image and no serve.python/eval.python, the tool ran
    cluster.python (a host path) inside the image. Its default is the interpreter of wherever the job's step runs:
    the image's (cluster.container.python), on the host cluster.python; serve.python, given, wins."""
    from slurmft.plan.container import step_python, tool_python

    cfg = load_config(GOLDEN_CFG, [*COMMON, *RUNTIMES["charliecloud"], "cluster.container.python=/opt/sft/bin/python",
                                   "eval.tasks=[hellaswag]", "serve.prompts=2"])
    profile = load_profile(cfg.cluster.profile)
    assert cfg.cluster.job_python == "/opt/venv/bin/python"  # the host's, for the batch script
    for kind in ("serve", "eval"):
        assert step_python(cfg, profile, kind) == tool_python(cfg, profile, kind) == "/opt/sft/bin/python", kind
    host = load_config(GOLDEN_CFG, ["eval.tasks=[hellaswag]"])
    assert tool_python(host, load_profile(host.cluster.profile), "eval") == "/opt/venv/bin/python"
    given = load_config(GOLDEN_CFG, [*COMMON, *RUNTIMES["charliecloud"], *SERVE_EVAL])
    assert tool_python(given, load_profile(given.cluster.profile), "serve") == "/opt/vllm/bin/python"
    # the job itself takes the interpreter it runs in (sys.executable) when the section names none
    assert cfg.model_job_python("eval", "/usr/bin/python3.11") == "/usr/bin/python3.11"
    assert given.model_job_python("serve", "/usr/bin/python3.11") == "/opt/vllm/bin/python"


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_serve_in_its_own_image_and_eval_on_the_host_beside_a_run_in_an_image(runtime: str, tmp_path: Path) -> None:
    """serve.container: its own image, the run's container's mounts and env carried over, its own added; the
    submitit command starts that image's python; eval.container: false runs the eval job on the host (cluster.python,
    no wrapping) while the ranks stay in the run's image."""
    image = {"pyxis": "/fsx/images/vllm.sqsh", "apptainer": "/fsx/images/vllm.sif",
             "charliecloud": "/fsx/images/vllm", "podman": "localhost/vllm:1"}[runtime]
    scripts = container_scripts(runtime, *SERVE_EVAL, f"serve.container={{image: {image}, python: /opt/v/bin/python, "
                                "mounts: [/opt/venvs], env: {VLLM_CPU_KVCACHE_SPACE: '1'}}", "eval.container=false")
    serve, ev, train = srun_line(scripts["serve"]), srun_line(scripts["eval"]), srun_line(scripts["train"])
    run_image = RUNTIMES[runtime][1].split("=", 1)[1] if runtime != "pyxis" else "/fsx/images/sft.sqsh"
    assert f"{image} " in serve or f"={image} " in serve, serve
    assert run_image not in serve and run_image in train and image not in train
    assert "/opt/v/bin/python -u -m submitit.core._submit" in serve and "serve.container.python" in serve
    for mount in ("/fsx/cache", "/opt/venvs", "/shared/runs/golden-2x8"):  # the run's, its own, the automatic
        assert mount in serve, (mount, serve)
    assert "VLLM_CPU_KVCACHE_SPACE" in passed_names(runtime, serve)
    assert "export VLLM_CPU_KVCACHE_SPACE=1  # serve.container.env" in scripts["serve"]
    assert "VLLM_CPU_KVCACHE_SPACE" not in scripts["train"]
    assert ev == "srun --unbuffered --ntasks=1 --cpus-per-task=4 /opt/venv/bin/python -u -m submitit.core._submit " \
                 "/shared/runs/golden-2x8/submitit"
    for kind in ("serve", "eval"):
        script = tmp_path / f"{kind}.sh"
        script.write_text(scripts[kind])
        assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
        if shutil.which("shellcheck"):
            out = subprocess.run(["shellcheck", "-S", "warning", str(script)], capture_output=True, text=True)
            assert out.returncode == 0, out.stdout


def test_serve_in_its_own_image_matches_golden() -> None:
    """A site whose ranks run in one pyxis image and vLLM in another: the serve job's whole script."""
    text = container_scripts("pyxis", *SERVE_EVAL, "serve.container.image=/fsx/images/vllm.sqsh")["serve"]
    assert_matches_golden(text, GOLDEN / "serve-2x8-aws-efa-pyxis-own-image.sbatch")


def test_an_own_image_without_a_run_container_and_the_eval_tasks_mounted() -> None:
    """No container for the ranks: serve.container alone puts the serve job in an image (the ranks stay on the host);
    the eval job in the run's image mounts its task files' folder (lm-eval's include path)."""
    scripts = scripts_for(GOLDEN_CFG, *COMMON[:2], *SERVE_EVAL, "serve.container={runtime: charliecloud, image: /x/v}")
    assert "ch-run" in srun_line(scripts["serve"]) and " python -u -m submitit" in srun_line(scripts["serve"])
    assert "ch-run" not in scripts["train"] and "ch-run" not in scripts["eval"]
    ev = srun_line(container_scripts("charliecloud", *SERVE_EVAL)["eval"])
    assert "--bind=/shared/tasks:/shared/tasks" in ev and " python -u -m submitit" in ev


def container_problems(*overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        from slurmft.plan.container import job_container

        cfg = load_config(GOLDEN_CFG, ["eval.tasks=[hellaswag]", *overrides])
        job_container(cfg, load_profile(cfg.cluster.profile), "serve" if "serve" in " ".join(overrides) else "eval")
    return err.value.render()


@pytest.mark.parametrize(("overrides", "expected"), [
    (["serve.container=true"], "serve.container: True is not a container: give a mapping"),
    (["eval.container=host"], "eval.container: 'host' is not a container"),
    (["serve.container={imag: /x}"], "serve.container.imag: unknown key; did you mean serve.container.image?"),
    (["eval.container.runtime=docker"], "eval.container.runtime: unknown runtime 'docker'"),
    (["serve.container.mounts=[data:/x]"], "serve.container.mounts: 'data:/x': the source 'data' is not an absolute"),
    (["serve.container.image=/x"], "serve.container.runtime: required (not in the run's serve.container, nor in "
                                   "cluster.container nor in cluster profile 'aws-efa')"),
    (["serve.container={runtime: pyxis, mounts: ['/tmp/x:/shared/runs']}", "cluster.profile=aws-efa-pyxis",
      "cluster.container.image=/fsx/sft.sqsh"], "serve.container.mounts: /tmp/x:/shared/runs hides"),
    (["executor=local", "resources.nodes=1", "serve.container.image=/x"],
     "serve.container: the local executor runs the job on this machine"),
])
def test_bad_model_job_containers_name_their_field(overrides: list[str], expected: str) -> None:
    assert expected in container_problems(*overrides)


def test_validate_leaves_an_interpreter_in_an_image_to_doctor_and_checks_the_host_one(tmp_path: Path) -> None:
    """In an image (its own or the run's) the login node cannot ask serve.python: validate says doctor --job does,
    and checks what it can (its own image's file, eval's task files). On the host beside a run in an image
    (container: false), cluster.python must import what the serve job's slurmft imports."""
    from slurmft.plan.model_job_checks import check_model_job

    image = tmp_path / "vllm.sqsh"
    base = [*COMMON, *RUNTIMES["pyxis"], "serve.python=/opt/vllm/bin/python", f"eval.tasks=[{tmp_path}/no.yaml]"]
    cfg = load_config(GOLDEN_CFG, [*base, f"serve.container.image={image}"])
    problems, skipped = check_model_job(cfg, "serve")
    assert problems == [f"serve.container.image: {image} does not exist (pyxis reads it from the nodes' file system: "
                        "give a path on the shared file system, or a registry reference the runtime pulls; "
                        "docs/containers.md shows how to build one)"]
    assert skipped == [f"serve.python: /opt/vllm/bin/python in the pyxis image {image} (serve.container) and vLLM there "
                       "are checked by `slurmft doctor --job`, which asks it in the image on the nodes, not here"]
    image.write_text("squashfs")
    assert check_model_job(cfg, "serve")[0] == []
    problems, skipped = check_model_job(cfg, "eval")  # in the run's image: the task file is still read here
    assert len(problems) == 1 and "eval.tasks[0]" in problems[0] and "no.yaml" in problems[0]
    assert "in the pyxis image /fsx/images/sft.sqsh (cluster.container)" in skipped[0] and "doctor --job" in skipped[0]
    bare = tmp_path / "bare" / "bin" / "python"  # a Python without torch/transformers, as the host's cluster.python
    subprocess.run(["python3", "-m", "venv", "--without-pip", str(bare.parent.parent)], check=True)
    host = load_config(GOLDEN_CFG, [*base, f"cluster.python={bare}", "serve.container=false", "serve.python=" + str(bare)])
    problems, _ = check_model_job(host, "serve")
    assert any(p.startswith(f"serve.container: false runs the serve job's slurmft on the host with cluster.python "
                            f"({bare}), which cannot import slurmft, torch, transformers") for p in problems), problems


def test_the_doctors_probe_asks_a_job_in_its_own_place_in_a_step_there() -> None:
    """doctor --job: a serve job in its own image is asked by one task per node in that image (before the ranks), an
    eval job on the host (container: false) by one on the host; the ranks ask neither."""
    from slurmft.plan.render import PROBE_TEMPLATE, build_probe_context, render, signal_directive

    overrides = [*COMMON, *RUNTIMES["charliecloud"], *SERVE_EVAL, "serve.container.image=/scratch/vllm",
                 "eval.container=false"]
    cfg = load_config(GOLDEN_CFG, overrides)
    signal = signal_directive(scripts_for(GOLDEN_CFG, *overrides)["train"])
    assert signal is not None
    probe_dir = Path("/shared/home/.cache/slurmft/doctor/golden")
    text = render(PROBE_TEMPLATE, build_probe_context(cfg, load_profile(cfg.cluster.profile), probe_dir, signal,
                                                      Path("/shared/runs")))
    steps = [line for line in text.splitlines() if line.startswith("srun ")]
    assert len(steps) == 3 and "-m slurmft.job.probe rank" in steps[2] and "--serve-python" not in steps[2]
    assert "/scratch/vllm" in steps[0] and "--ntasks-per-node=1" in steps[0] and "/fsx/images/sft " not in steps[0]
    assert f"python -m slurmft.job.probe tool {probe_dir} --kind=serve --python=/opt/vllm/bin/python" in steps[0]
    assert f"--bind={probe_dir}:{probe_dir}" in steps[0]
    assert "ch-run" not in steps[1] and steps[1].endswith(
        f"/opt/venv/bin/python -m slurmft.job.probe tool {probe_dir} --kind=eval --python=/opt/venv/bin/python "
        "|| echo \"[slurmft] the eval job's probe step failed (exit $?)\" >&2")
