"""The loss plot and the run report, drawn from realistic run directories (tests/runfixture.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_runner import cli
from runfixture import local_run, preempted_run, slurm_rows

from slurmft.cli import main
from slurmft.errors import SlurmftError
from slurmft.watch.plot import DPI, SIZE_INCHES, Marker, marker_steps, plot_run, series, smooth
from slurmft.watch.progress import read_metrics
from slurmft.watch.report import write_report, write_report_safely

Image = pytest.importorskip("PIL.Image")  # matplotlib brings Pillow
np = pytest.importorskip("numpy")



def _red_columns(png: Path) -> set[int]:
    """x pixel columns holding many marker-red pixels (tab:red, a dashed vertical line: > 1/4 of the height)."""
    rgb = np.asarray(Image.open(png).convert("RGB")).astype(int)
    red = (rgb[..., 0] > 150) & (rgb[..., 1] < 120) & (rgb[..., 2] < 120)
    return {int(x) for x in np.nonzero(red.sum(axis=0) > rgb.shape[0] // 4)[0]}


def test_marker_steps_are_where_each_attempt_stopped(tmp_path: Path) -> None:
    records = read_metrics(preempted_run(tmp_path).joinpath("metrics.jsonl")).records
    assert marker_steps(records) == [Marker(12, "requeued (restart 1)"), Marker(25, "requeued (restart 2)")]
    resumed = records + [{**r, "job_id": "200", "restart": 0, "step": r["step"] + 10} for r in records[-3:]]
    assert marker_steps(resumed)[-1] == Marker(36, "resumed (job 200)")
    assert marker_steps(records[:12]) == []


def test_series_keeps_one_point_per_step_the_newest_attempt_wins() -> None:
    records = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0}, {"step": 2, "loss": 1.5},
               {"step": 3, "loss": float("nan")}, {"step": 4}]
    assert series(records, "loss") == ([1, 2], [3.0, 1.5])
    assert smooth([2.0, 2.0, 2.0]) == pytest.approx([2.0, 2.0, 2.0])  # debiased: no ramp from zero
    s = smooth([4.0, 0.0, 4.0, 0.0])
    assert s[0] == 4.0 and min(s) > 0.0 and max(s[1:]) < 4.0


def test_plot_is_a_real_picture_with_a_marker_per_restart(tmp_path: Path) -> None:
    run = preempted_run(tmp_path)
    png = plot_run(run)
    assert png == run / "loss.png"
    img = Image.open(png)
    assert img.format == "PNG" and img.size == (int(SIZE_INCHES[0] * DPI), int(SIZE_INCHES[1] * DPI))
    pixels = np.asarray(img.convert("L")).astype(float)
    assert pixels.std() > 10  # not blank
    cols = _red_columns(png)
    groups = [c for c in sorted(cols) if c - 1 not in cols]  # one group of columns per vertical line
    assert len(groups) == 2, sorted(cols)

    single = local_run(tmp_path)
    assert _red_columns(plot_run(single, tmp_path / "single.png")) == set()  # no restart, no marker


def test_plot_without_metrics_says_why(tmp_path: Path) -> None:
    run = preempted_run(tmp_path)
    (run / "metrics.jsonl").unlink()
    with pytest.raises(SlurmftError) as info:
        plot_run(run)
    assert "no metrics.jsonl yet" in info.value.render()


def test_watch_commands_on_what_is_no_run_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A typo, a file and an empty directory given as RUN_DIR: each command says which (exit 2), none writes a report
    or a plot into a directory that holds no run, none says "the job has not reached its first step"."""
    (tmp_path / "file").write_text("x")
    (tmp_path / "empty").mkdir()
    expect = {"gone": "does not exist", "file": "is a file, not a run directory", "empty": "has no manifest.json"}
    for name, words in expect.items():
        for command in ("status", "plot", "report"):
            if (command, name) == ("plot", "empty"):
                continue  # an empty directory is a run before its first step for plot (test above)
            code, _, err = cli([command, str(tmp_path / name)], capsys)
            assert code == 2 and words in err and "Traceback" not in err, (command, name, err)
    assert list((tmp_path / "empty").iterdir()) == []
    code, _, err = cli(["runs", str(tmp_path / "gone")], capsys)
    assert code == 2 and "does not exist" in err
    # the folder the runs are in (status RUN_DIR's parent): said, with the command that lists them
    preempted_run(tmp_path / "runs", "a")
    preempted_run(tmp_path / "runs", "b")
    code, _, err = cli(["status", str(tmp_path / "runs")], capsys)
    assert code == 2 and f"it holds run directories (a, b): `slurmft runs {tmp_path / 'runs'}` lists them" in err
    code, _, err = cli(["status", str(tmp_path / "empty")], capsys)
    assert "holds run directories" not in err


def test_report_numbers_match_the_metrics(tmp_path: Path) -> None:
    run = preempted_run(tmp_path)
    (run / "model").mkdir()
    (run / "model" / "model.safetensors.index.json").write_text("{}")
    report = write_report(run, slurm_rows=slurm_rows())
    text = report.read_text()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    final = records[-1]
    tokens = sum(r["tokens_per_s"] for r in records) / len(records)
    assert f"| final loss | {final['loss']:.4f} (step 36)" in text
    assert f"| tokens/s | {round(tokens, 2)} (tokens trained over the time of the logged steps)" in text
    # the whole run's loss from each step's newest value (21-25 were trained again by restart 2); restart 1 was
    # killed, so its time is not in the training time, and the report says so
    newest = {r["step"]: r["loss"] for r in records}
    assert (f"| train loss, whole run | {sum(newest.values()) / 36:.4f} over 36 of 36 steps (the step-weighted mean "
            "of the logged losses, 3 attempt(s)) |") in text
    assert "| training time | 27s in the training loops of the attempts, added up |" in text
    assert "> whole-run figures: train_runtime leaves out job 100 restart 1: killed before its end" in text
    assert f"| steps | 36 / 36 ({len(records)} logged) |" in text
    assert "5 step(s) computed again (≈ 5s) and 1m00s between attempts" in text  # 29.5 s + 30 s
    assert text.count("| 100 |") == 3  # three attempts
    assert "preempted (warning signal), requeued" in text and "requeued by Slurm" in text
    assert "| 0 | cpu | 812.5 MiB |" in text and "| 1 | cpu | 640.2 MiB |" in text  # per rank, fsdp_report
    assert f"RSS {max(r['peak_rss_mib'] for r in records):.1f} MiB" in text  # worst rank over the run
    assert f"`{run / 'model'}`" in text
    assert "2 node(s) × 1 rank(s)" in text and "job 100 restart 2: `n1,n2`" in text
    assert "profile `local-test`, partition `debug`, time limit" in text
    config = run / "config.yaml"  # no cluster.partition: sbatch gets none, the cluster's default takes the job
    config.write_text(config.read_text().replace("partition: debug", "partition: null"))
    assert "profile `local-test`, the cluster's default partition, time limit" in write_report(
        run, slurm_rows=slurm_rows()).read_text()
    assert "![loss and learning rate](loss.png)" in text and (run / "loss.png").stat().st_size > 10_000


def test_a_local_runs_report_names_no_partition(tmp_path: Path) -> None:
    """A local run's report said 'local executor, profile `ethernet`, the cluster's default partition' (seen on
    examples/tiny/text.yaml): it ran on this machine, in no partition."""
    text = write_report(local_run(tmp_path)).read_text()
    assert "local executor, on this machine (no partition, no profile's network), time limit" in text, text
    assert "partition`" not in text and "default partition" not in text


def test_report_cli_and_a_report_failure_never_raises(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = local_run(tmp_path)
    main(["report", str(run)])
    assert "wrote" in capsys.readouterr().out
    text = (run / "report.md").read_text()
    assert "None: the run trained in one attempt." in text and "No consolidated model yet" in text
    # not "to preemption": a cancel or failure resumed by hand is counted there too
    assert "## Time lost to restarts" in text and "preemption" not in text.split("## Time lost")[1].split("##")[0]

    assert write_report_safely(tmp_path / "gone") is None
    assert "could not be written (the model is fine)" in capsys.readouterr().err
    (run / "manifest.json").write_text("{torn")  # a corrupt manifest: still a report from the metrics
    assert write_report_safely(run) == run / "report.md"
    assert "manifest:" in (run / "report.md").read_text()


def test_report_names_the_method(tmp_path: Path) -> None:
    run = preempted_run(tmp_path)
    assert "| method | full fine-tuning (every weight trains) |" in write_report(run, slurm_rows=slurm_rows()).read_text()
    marker = run / "checkpoints" / "checkpoint-36" / "COMPLETE"
    lora = {"r": 16, "alpha": 32.0, "dropout": 0.0, "target_modules": ["down_proj", "q_proj"],
            "modules_to_save": ["lm_head"], "trainable_params": 207_093_760, "total_params": 69_183_741_952}
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "lora": lora}))
    text = write_report(run, slurm_rows=slurm_rows()).read_text()
    assert ("| method | LoRA r=16, alpha=32 (scaling 2), dropout 0 on down_proj, q_proj, full copies of lm_head: "
            "207.1M of 69.18B parameters train (0.30 %) |") in text


def test_report_shows_each_save_and_status_is_not_confused_by_them(tmp_path: Path) -> None:
    """Save lines in metrics.jsonl (what the job's CompleteCheckpoints appends after each marker) land in the
    report's save table and nowhere else: progress, plot and the step count still see only the steps."""
    run = preempted_run(tmp_path)
    steps = len(read_metrics(run / "metrics.jsonl").records)
    saves = [{"event": "save", "step": 10, "time": 1.0, "mode": "async", "blocked_s": 0.05, "durable_s": 0.7,
              "bytes": 3 * 2**20, "job_id": "100", "restart": 0},
             {"event": "save", "step": 36, "time": 2.0, "mode": "sync", "blocked_s": 0.62, "durable_s": 0.62,
              "bytes": 3 * 2**20, "job_id": "100", "restart": 2}]
    with open(run / "metrics.jsonl", "a") as f:
        f.writelines(json.dumps(s) + "\n" for s in saves)
    metrics = read_metrics(run / "metrics.jsonl")
    assert len(metrics.records) == steps and metrics.saves == saves and not metrics.problems
    text = write_report(run, slurm_rows=slurm_rows()).read_text()
    assert "2 complete save(s); training waited 0.67 s for them in all." in text
    assert "| 10 | async | 0.05 s | 0.7 s | 3.0 MiB | 100 | 0 |" in text
    assert "| 36 | sync | 0.62 s | 0.62 s | 3.0 MiB | 100 | 2 |" in text
    assert f"({steps} logged)" in text


def test_a_grpo_runs_rewards_kl_and_lengths_are_in_status_plot_and_report(tmp_path: Path) -> None:
    """TRL's GRPO metrics in metrics.jsonl as the job keeps them (tests/job/test_grpo_cpu.py checks the job writes
    them): the reward and the completion length only on steps that generated (here every other step), the KL on
    every step; status and the report say the last generation's and the last step's KL, the plot draws the rewards
    and the KL in a panel of their own under the loss."""
    from slurmft.rundir import RunPaths
    from slurmft.watch.progress import overview, overview_lines

    run = preempted_run(tmp_path)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for r in records:
        r["kl"] = 0.001 * r["step"]
        if r["step"] % 2:  # steps_per_generation 2: TRL logs the rollouts at the step that generated them
            r.update({"reward": 0.5 + 0.01 * r["step"], "reward_std": 0.25, "rewards/exact_match/mean": 0.25,
                      "rewards/think_format/mean": 0.5, "completions/mean_length": 12.0})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    last = records[-1]["step"]
    scored = max(r["step"] for r in records if "reward" in r)
    words = (f"reward {0.5 + 0.01 * scored:.4f} ± 0.2500 (exact_match 0.2500, think_format 0.5000) at step {scored}, "
             f"KL {0.001 * last:.4f}, completions 12.0 tokens")
    paths = RunPaths.of(run)
    status = "\n".join(overview_lines(overview(paths, json.loads(paths.manifest.read_text()), slurm_rows())))
    assert f"  GRPO: {words}" in status, status
    assert f"| GRPO, last rollouts | {words} |" in write_report(run, slurm_rows=slurm_rows()).read_text()
    assert "GRPO" not in write_report(preempted_run(tmp_path, "sft"), slurm_rows=slurm_rows()).read_text()
    from slurmft.watch.runs import run_lines

    # runs: the reward is a GRPO run's score (its loss says nothing of the policy)
    scores = {r["name"]: r["score"] for r in run_lines(tmp_path, query=lambda ids: {})}
    assert scores == {"watch": ("reward", 0.5 + 0.01 * scored), "sft": None}, scores

    img = Image.open(plot_run(run))
    assert img.size[1] > int(SIZE_INCHES[1] * DPI * 1.5)  # a second panel under the loss
    rgb = np.asarray(img.convert("RGB")).astype(int)
    for color in ((44, 160, 44), (148, 103, 189)):  # tab:green (the reward), tab:purple (the KL)
        found = (abs(rgb[..., 0] - color[0]) < 30) & (abs(rgb[..., 1] - color[1]) < 30) & (
            abs(rgb[..., 2] - color[2]) < 30)
        rows = np.nonzero(found.sum(axis=1))[0]
        assert rows.size and rows.min() > 0.45 * img.size[1], color  # in the lower panel only


def test_a_dpo_runs_own_metrics_are_in_status_plot_and_report(tmp_path: Path) -> None:
    """TRL's DPO metrics in metrics.jsonl (what the job's MetricsLog keeps): status says the last step's, the plot
    draws them in a panel of their own under the loss (markers there too), the report lists them."""
    import math

    from slurmft.rundir import RunPaths
    from slurmft.watch.progress import overview, overview_lines

    run = preempted_run(tmp_path)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for r in records:
        margin = 0.01 * r["step"]
        r.update({"loss": math.log(1 + math.exp(-margin)), "rewards/chosen": margin / 2,
                  "rewards/rejected": -margin / 2, "rewards/margins": margin,
                  "rewards/accuracies": min(1.0, r["step"] / 36)})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    paths = RunPaths.of(run)
    status = "\n".join(overview_lines(overview(paths, json.loads(paths.manifest.read_text()), slurm_rows())))
    assert "  DPO: reward margin 0.3600, accuracy 1.00 (rewards: chosen 0.1800, rejected -0.1800)" in status, status

    png = plot_run(run)
    img = Image.open(png)
    assert img.size[1] > int(SIZE_INCHES[1] * DPI * 1.5)  # a second panel under the loss
    rgb = np.asarray(img.convert("RGB")).astype(int)
    green = (abs(rgb[..., 0] - 44) < 30) & (abs(rgb[..., 1] - 160) < 30) & (abs(rgb[..., 2] - 44) < 30)  # tab:green
    rows = np.nonzero(green.sum(axis=1))[0]
    assert rows.size and rows.min() > 0.45 * img.size[1]  # the margins (and their axis label) in the lower panel
    cols = _red_columns(png)
    assert len([c for c in sorted(cols) if c - 1 not in cols]) == 2  # each restart marked (in both panels)

    text = write_report(run, slurm_rows=slurm_rows()).read_text()
    assert "| DPO, final step | reward margin 0.3600, accuracy 1.00 (rewards: chosen 0.1800, rejected -0.1800) |" in text
    sft = write_report(preempted_run(tmp_path, "sft"), slurm_rows=slurm_rows()).read_text()
    assert "DPO" not in sft


@pytest.mark.parametrize(("section", "objective", "packing"), [
    ({"grpo": {"num_generations": 2, "beta": 0.04, "rewards": [{"function": "exact_match"}]}},
     "GRPO (2 completions per prompt, beta 0.04)", False),
    ({"dpo": {"beta": 0.2, "loss_type": ["sigmoid"], "reference": "auto"}},
     "DPO (beta 0.2, loss sigmoid, reference auto)", False),
    ({"data": {"datasets": [{"path": "/data/corpus/*.txt"}], "max_seq_length": 256, "packing": True}},
     "continued pretraining on plain text (every token in the loss)", True),
    ({}, "supervised fine-tuning", True),
], ids=["grpo", "dpo", "text", "sft"])
def test_the_report_names_what_the_run_optimised_and_packs_only_what_is_packed(tmp_path: Path, section: dict,
                                                                                objective: str, packing: bool) -> None:
    """The config table of a DPO or GRPO run did not say DPO or GRPO, and said 'packing True' (the config's
    data.packing, which DPO and GRPO ignore): it names the objective and the packing the job used."""
    import yaml

    run = preempted_run(tmp_path)
    config = yaml.safe_load((run / "config.yaml").read_text())
    (run / "config.yaml").write_text(yaml.safe_dump({**config, **section}))
    text = write_report(run, slurm_rows=slurm_rows()).read_text()
    assert f"| objective | {objective} |\n| method | full fine-tuning (every weight trains) |" in text, text
    assert f"max_seq_length 256, packing {packing} |" in text, text


def test_the_mean_of_the_last_logged_losses_counts_each_step_once(tmp_path: Path) -> None:
    """A resume from an older checkpoint trains steps again: the report's "mean of the last 10 logged" counted steps
    9-12 twice (the first attempt's values and the resumed one's). Each step once, its newest value, as the whole
    run's loss does (slurmft.watch.run_totals.newest_records)."""
    from runfixture import T0, record, write_metrics

    run = local_run(tmp_path, steps=12)
    first = [record(s, T0 + s, "4242", 0, loss=float(s)) for s in range(1, 13)]  # killed after step 12's log
    again = [record(s, T0 + 100 + s, "4243", 0, loss=1.0) for s in range(9, 13)]  # resumed from checkpoint-8
    write_metrics(run, first + again)
    text = write_report(run).read_text()
    # steps 3-8 at 3.0..8.0, 9-12 at 1.0: 37 / 10 (counted twice: 7.0..12.0 and 1.0 x 4, 61 / 10)
    assert "mean of the last 10 logged: 3.7000 |" in text, [line for line in text.splitlines() if "mean of" in line]
