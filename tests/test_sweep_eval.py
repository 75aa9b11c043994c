"""A sweep's points evaluated and ranked by their scores (docs/sweeps.md): sweep.select's metric checked before
anything is written, the serve and eval arrays rendered after the consolidation array, and the ranking read from
each point's eval/summary.json. The arrays on the real cluster: tests/slurm/test_sweep_array.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_sweep import check_array_script, refusals, write

from slurmft.profiles import load_profile
from slurmft.rundir import SWEEP_VERSION
from slurmft.sweep import FIXED, load_sweep, select_of
from tests.conftest import REPO_ROOT

TINY_TASK = REPO_ROOT / "examples" / "tiny" / "tasks" / "tiny_choice.yaml"
GRID = {"train.learning_rate": [1e-5, 3e-5], "train.seed": [1, 2]}


def _eval(**more: object) -> dict:
    return {"tasks": [str(TINY_TASK)], "backend": "hf", "compare_base": False, **more}


REFUSALS = [
    ({"grid": GRID, "select": {"metric": "eval/tiny_choice/acc"}}, {},
     ["sweep.select.metric: eval/tiny_choice/acc is an evaluation score, but there is no eval section; add one"]),
    ({"grid": GRID, "select": {"metric": "eval/tiny_choise/acc"}}, {"eval": _eval()},
     ["sweep.select.metric: eval/tiny_choise/acc: eval.tasks has no task 'tiny_choise'; did you mean "
      "eval/tiny_choice/acc?"]),
    ({"grid": GRID, "select": {"metric": "eval/tiny_choice/acc_nrom"}}, {"eval": _eval()},
     ["task tiny_choice declares no metric 'acc_nrom'; did you mean eval/tiny_choice/acc_norm?"]),
    ({"grid": GRID, "select": {"metric": "accuracy"}}, {"eval": _eval()},
     ["sweep.select.metric: 'accuracy' is not a metric: give loss, eval"]),
    ({"grid": {"eval.resources.mem": ["8G", "16G"]}}, {"eval": _eval()},
     ["eval.resources.mem cannot differ between points", FIXED["eval.resources"]]),
    ({"points": [{"eval": None}, {"train.seed": 3}]}, {"eval": _eval()},
     ["sweep: points eval-null have no eval section and the others have one"]),
]


@pytest.mark.parametrize(("sweep", "sections", "expected"), REFUSALS,
                         ids=["no-eval-section", "unknown-task", "unknown-metric", "not-a-metric", "eval-resources",
                              "eval-in-one-point"])
def test_refused_before_anything_is_written(tmp_path: Path, capsys: pytest.CaptureFixture[str], sweep: dict,
                                            sections: dict, expected: list[str]) -> None:
    for err in refusals(tmp_path, capsys, sweep, sections):
        for text in expected:
            assert text in " ".join(err.split()), err


def test_the_ranking_defaults_to_the_evaluation_when_there_is_one(tmp_path: Path) -> None:
    cases = [({}, {}, {"metric": "loss", "mode": "min"}),
             ({}, {"eval": _eval()}, {"metric": "eval", "mode": "max"}),
             ({"metric": "eval/tiny_choice/acc_norm"}, {"eval": _eval()},
              {"metric": "eval/tiny_choice/acc_norm", "mode": "max"}),
             ({"metric": "loss"}, {"eval": _eval()}, {"metric": "loss", "mode": "min"}),
             ({"metric": "eval/tiny_choice/acc", "mode": "min"}, {"eval": _eval()},
              {"metric": "eval/tiny_choice/acc", "mode": "min"})]
    for select, sections, expected in cases:
        sweep = load_sweep(write(tmp_path, {"grid": GRID, "select": select}, **sections))
        assert sweep is not None and select_of(sweep.cfg) == expected, (select, sections)


def test_serve_and_eval_arrays_follow_the_consolidation_array(tmp_path: Path) -> None:
    from slurmft.plan.render import render_sweep_arrays

    sweep = load_sweep(write(tmp_path, {"grid": GRID, "parallel": 2}, eval=_eval(resources={"cpus_per_task": 3}),
                             serve={"resources": {"cpus_per_task": 2}}))
    assert sweep is not None
    scripts = render_sweep_arrays(sweep, load_profile("local-test"), "run.yaml", None)
    assert set(scripts) == {"prepare", "train", "consolidate", "serve", "eval"}
    for kind, cpus in (("serve", 2), ("eval", 3)):
        assert f"#SBATCH --cpus-per-task={cpus}\n" in scripts[kind]
        check_array_script(tmp_path, sweep, kind, scripts[kind])


def _summary(run_dir: Path, acc: float | None, acc_norm: float) -> None:
    (run_dir / "eval").mkdir(parents=True)
    tasks = {"tiny_choice": {"acc,none": {"finetuned": acc, "base": 0.25}, "acc_stderr,none": {"finetuned": 0.1},
                             "acc_norm,none": {"finetuned": acc_norm, "base": 0.25}}}
    (run_dir / "eval" / "summary.json").write_text(json.dumps({"tasks": tasks}))


def test_points_are_ranked_by_their_evaluation_scores(tmp_path: Path) -> None:
    """The score is the summary's (not the loss); max ranks the highest first, ties keep the points' order, a point
    not evaluated yet is not ranked; the best point with a model is linked."""
    from slurmft.watch.sweep import rank, score, update_best

    for name, acc, norm in (("a", 0.5, 0.4), ("b", 0.75, 0.4), ("c", 0.5, 0.9)):
        _summary(tmp_path / name, acc, norm)
    (tmp_path / "d").mkdir()  # trained, not evaluated yet
    done = {"step": 10, "max_steps": 10}
    rows = [{"name": n, **done, "loss": loss, "rank": None, "model": str(tmp_path / n / "model")}
            for n, loss in (("a", 1.0), ("b", 3.0), ("c", 2.0), ("d", 0.5))]
    for metric, expected in (("eval/tiny_choice/acc", [0.5, 0.75, 0.5, None]),
                             ("eval/tiny_choice/acc,none", [0.5, 0.75, 0.5, None]),
                             ("eval", [0.4, 0.4, 0.9, None]),  # the headline: acc_norm before acc
                             ("eval/tiny_choice/exact_match", [None] * 4),
                             ("loss", [1.0, 3.0, 2.0, 0.5])):
        assert [score(r, metric, tmp_path / r["name"]) for r in rows] == expected, metric
    for r in rows:
        r["score"] = score(r, "eval/tiny_choice/acc", tmp_path / r["name"])
    rank(rows, "max")
    assert [r["rank"] for r in rows] == [2, 1, 3, None]  # a and c tie: a first
    assert update_best(tmp_path, rows)["name"] == "b"
    rank(rows, "min")
    assert [r["rank"] for r in rows] == [1, 3, 2, None]


def test_the_table_names_the_score_eval_stands_for_and_the_bases_value_beside_it(tmp_path: Path) -> None:
    """`eval (max)` named no score (which task, which metric?), and a rank among points said nothing of whether a
    point beat the base model: the header names the headline score and a base column shows the base's value."""
    from slurmft.eval_results import named_cell, read_summary
    from slurmft.watch.sweep import format_table, write_sweep_report

    _summary(tmp_path / "a", 0.5, 0.4)
    summary = read_summary(tmp_path / "a")
    assert summary is not None
    assert named_cell(summary, "eval") == ("tiny_choice acc_norm", 0.25, 0.4)
    assert named_cell(summary, "eval/tiny_choice/acc") == ("tiny_choice acc", 0.25, 0.5)
    record = {"name": "s", "executor": "slurm", "select": {"metric": "eval", "mode": "max"}}
    rows = [{"name": "a", "overrides": {"train.seed": 1}, "state": "done", "step": 4, "max_steps": 4, "loss": 1.0,
             "score": 0.4, "rank": 1, "score_name": "tiny_choice acc_norm", "base": 0.25, "model": None},
            {"name": "b", "overrides": {"train.seed": 2}, "state": "training", "step": 2, "max_steps": 4, "loss": 2.0,
             "score": None, "rank": None, "score_name": None, "base": None, "model": None}]
    lines = format_table(tmp_path, record, rows, None)
    assert lines[1].split()[-5:] == ["eval:", "tiny_choice", "acc_norm", "(max)", "base"], lines
    assert lines[2].split()[-3:] == ["0.4000", "(#1)", "0.2500"] and lines[3].split()[-2:] == ["-", "-"], lines
    # without a base (compare_base: false, or ranked by loss) there is no base column
    no_base = format_table(tmp_path, {**record, "select": {"metric": "loss", "mode": "min"}},
                           [{**r, "base": None, "score_name": None} for r in rows], None)
    assert no_base[1].split()[-2:] == ["loss", "(min)"], no_base

    sweep = tmp_path / "sweep"  # the report says the same
    _summary(sweep / "a", 0.5, 0.4)
    (sweep / "sweep.json").write_text(json.dumps({**record, "version": SWEEP_VERSION, "jobs": [], "points": [
        {"index": 0, "name": "a", "dir": str(sweep / "a"), "overrides": {"train.seed": 1}}]}))
    report = write_sweep_report(sweep).read_text()
    assert "ranked by eval: tiny_choice acc_norm (max)." in report and "| score | base | model |" in report, report


def _scored_sweep(root: Path, select: dict, points: dict[str, tuple[float, float | None]]) -> Path:
    """A sweep directory as its evaluation jobs leave it: sweep.json, and per point (name: (acc, base acc)) a
    consolidated model (its index) and eval/summary.json (base None: evaluated with compare_base false)."""
    from slurmft.rundir import MODEL_INDEX

    entries = []
    for index, (name, (acc, base)) in enumerate(points.items()):
        (root / name / "model").mkdir(parents=True)
        (root / name / "model" / MODEL_INDEX).write_text("{}")
        (root / name / "eval").mkdir()
        (root / name / "eval" / "summary.json").write_text(json.dumps(
            {"tasks": {"tiny_choice": {"acc,none": {"finetuned": acc, "base": base}}}}))
        entries.append({"index": index, "name": name, "dir": str(root / name), "overrides": {"train.seed": index}})
    (root / "sweep.json").write_text(json.dumps({"name": "s", "executor": "slurm", "select": select, "jobs": [],
                                                 "version": SWEEP_VERSION, "points": entries}))
    return root


ACC_MAX = {"metric": "eval/tiny_choice/acc", "mode": "max"}
ACC_MIN = {"metric": "eval/tiny_choice/acc", "mode": "min"}
#: (sweep.select, points: (acc, base acc), the best point, what its line says after `linked as best)`, best_beats_base)
VERSUS_BASE = [
    (ACC_MAX, {"a": (0.5, 0.25), "b": (0.75, 0.25)}, "b",
     "; it beats the base model by +0.5000 (base 0.2500, b 0.7500 on tiny_choice acc, max)", True),
    (ACC_MAX, {"a": (0.5, 0.8), "b": (0.75, 0.8)}, "b",
     " — but no point beats the base model (base 0.8000, b 0.7500 on tiny_choice acc, max)", False),
    (ACC_MIN, {"a": (0.5, 0.6), "b": (0.75, 0.6)}, "a",
     "; it beats the base model by -0.1000 (base 0.6000, a 0.5000 on tiny_choice acc, min)", True),
    (ACC_MIN, {"a": (0.5, 0.4), "b": (0.75, 0.4)}, "a",
     " — but no point beats the base model (base 0.4000, a 0.5000 on tiny_choice acc, min)", False),
    (ACC_MAX, {"a": (0.5, 0.75), "b": (0.75, 0.75)}, "b",  # a tie is not better
     " — but no point beats the base model (base 0.7500, b 0.7500 on tiny_choice acc, max)", False),
    (ACC_MAX, {"a": (0.5, None), "b": (0.75, None)}, "b", "", None),  # compare_base false: nothing is known
    (ACC_MAX, {"a": (0.5, 0.25), "b": (0.75, None)}, "b", "", None),  # the best's own base unknown: nothing said
    (ACC_MAX, {"a": (0.5, 0.25), "b": (0.75, 0.9), "c": (0.6, 0.9)}, "b",  # points of other base models
     " — but it does not beat its base model (base 0.9000, b 0.7500 on tiny_choice acc, max); a beat their own (the "
     "points' base models differ)", False),
    (ACC_MAX, {"a": (0.5, 0.6), "b": (0.75, 0.9)}, "b",
     " — but no point beats its base model (the points' base models differ; base 0.9000, b 0.7500 on tiny_choice "
     "acc, max)", False),
]


@pytest.mark.parametrize(("select", "points", "best", "words", "beats"), VERSUS_BASE,
                         ids=["max-beats", "max-worse", "min-beats", "min-worse", "tie", "no-base", "best-no-base",
                              "bases-differ", "bases-differ-none-beats"])
def test_the_best_line_says_whether_the_best_point_beats_the_base_model(
        tmp_path: Path, select: dict, points: dict, best: str, words: str, beats: bool | None) -> None:
    """`best: b (...; linked as best)` beside a base column read as "it got better" even when the base scored higher:
    status, --json and report.md say whether the best point beats its base model (by sweep.select.mode; a tie does
    not), and by how much, only where both values are known. `best` is linked either way: it is the ranking's best."""
    from slurmft.watch.sweep import status_lines, write_sweep_report

    root = _scored_sweep(tmp_path / "sweep", select, points)
    lines = status_lines(root)
    assert f"best: {best} ({root / best / 'model'}; linked as best){words}" in lines, lines
    assert (root / "best").resolve() == (root / best / "model").resolve()
    data = json.loads(status_lines(root, as_json=True)[0])
    assert data["best"] == best and data["best_beats_base"] is beats, data
    assert [p["beats_base"] for p in data["points"]] == [
        None if base is None else (acc < base if select["mode"] == "min" else acc > base) for acc, base in points.values()]
    if beats is not None:
        acc, base = points[best]
        assert data["best_vs_base"]["base"] == base and data["best_vs_base"]["score"] == acc
        assert data["best_vs_base"]["by"] == pytest.approx(acc - base)
    else:
        assert data["best_vs_base"] is None
    report = write_sweep_report(root).read_text()
    assert f"**Best:** {best} (`{root / best / 'model'}`, linked as `best`){words}\n" in report, report


@pytest.mark.train
def test_a_local_sweeps_base_is_scored_once_and_every_point_holds_its_scores(
        tmp_path: Path, micro_model: Path, chat_data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two points with the default eval.compare_base: the first point's evaluation scores the base and keeps it in
    SWEEP_DIR/base-eval/KEY/record.json, the second's reads it from there (one lm-eval run fewer); both summaries hold
    the same base scores, and status shows them as before."""
    from cli_runner import cli

    from slurmft.eval_results import read_summary
    from tests.conftest import need_model_job_python

    path = write(tmp_path, {"grid": {"train.learning_rate": [1e-3, 3e-3]}, "select": {"metric": "loss"}},
                 executor="local",
                 resources={"nodes": 1, "tasks_per_node": 1, "gpus_per_node": 0, "cpus_per_task": 1},
                 model={"name_or_path": str(micro_model), "dtype": "float32", "attn_implementation": "sdpa"},
                 data={"datasets": [{"path": str(chat_data)}], "max_seq_length": 64},
                 train={"max_steps": 1, "per_device_batch_size": 2, "warmup_ratio": 0.0},
                 consolidate={"dtype": "float32"},
                 eval={"python": need_model_job_python("eval"), "tasks": [str(TINY_TASK)], "backend": "hf", "limit": 4,
                       "resources": {"gpus": 0}})
    code, _, err = cli(["submit", str(path)], capsys)
    assert code == 0, err[-3000:]
    root = tmp_path / "out"
    first, second = root / "learning_rate-0.001", root / "learning_rate-0.003"
    records = sorted((root / "base-eval").glob("*/record.json"))
    assert len(records) == 1, records
    record = json.loads(records[0].read_text())
    assert record["point"] == first.name and record["key"] == records[0].parent.name
    assert record["inputs"]["lm_eval_version"] == "0.4.13" and record["inputs"]["model"]  # the micro model's files

    summaries = [read_summary(p) for p in (first, second)]
    assert all(s is not None for s in summaries)
    bases = [{t: {m: c["base"] for m, c in ms.items()} for t, ms in s["tasks"].items()} for s in summaries]
    assert bases[0] == bases[1] and bases[0]["tiny_choice"]["acc,none"] is not None, bases
    assert bases[0]["tiny_choice"]["acc,none"] == record["results"]["results"]["tiny_choice"]["acc,none"]
    assert summaries[0]["base_eval"] == {"reused": False, "kept_in": str(records[0]), "key": record["key"]}
    assert summaries[1]["base_eval"] == {"reused": True, "from": str(records[0]), "point": first.name,
                                         "key": record["key"], "seconds": record["seconds"]}
    assert summaries[0]["seconds"]["base"] > 0 and summaries[1]["seconds"]["base"] == 0.0
    assert summaries[1]["models"]["base"] == str(micro_model)

    def eval_log(point: Path) -> str:
        jobs = json.loads((point / "manifest.json").read_text())["jobs"]
        return "".join(Path(f).read_text() for j in jobs if j["kind"] == "eval" for f in j["logs"])

    logs = [eval_log(p) for p in (first, second)]
    # lm-eval ran twice for the first point (fine-tuned, base), once for the second (fine-tuned)
    assert [log.count("lm-eval: ") for log in logs] == [2, 1], logs[1][-3000:]
    assert f"eval: base: scored here; kept in {records[0]} for the sweep's other points" in logs[0]
    assert f"eval: base: reused from {records[0]} (scored by point {first.name}); lm-eval not run" in logs[1]
    assert (first / "eval" / "base").is_dir() and not (second / "eval" / "base").exists()
    code, out, err = cli(["status", str(root), "--json"], capsys)
    assert code == 0, err
    assert [r["name"] for r in json.loads(out)["points"]] == [first.name, second.name]


def test_the_base_key_changes_with_what_the_bases_lm_eval_run_depends_on(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A task file's content, eval.limit, the base model (a local directory's files; a Hub id's cached commit) each
    change the key; the output path (each point's own) does not."""
    import shutil
    import sys

    from slurmft.config_model_checks import EvalConfig
    from slurmft.job.base_eval import base_inputs, base_key
    from slurmft.job.evaluate import LM_EVAL_ENV, LM_EVAL_RUN, lm_eval_command

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    shutil.copy(TINY_TASK, tasks / TINY_TASK.name)
    (tasks / "data.jsonl").write_text('{"q": 1}\n')
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    ref = tmp_path / "hub" / "models--org--base" / "refs" / "main"
    ref.parent.mkdir(parents=True)
    ref.write_text("a" * 40)

    def key(name: str = str(model), out: str = "run-a/eval/base", **ev: object) -> str:
        cfg = EvalConfig(tasks=[str(tasks / TINY_TASK.name)], **ev)
        args = {"pretrained": name, "dtype": "float32"}
        cmd = lm_eval_command(sys.executable, "hf", f"pretrained={name},dtype=float32", ["tiny_choice"], str(tasks),
                              cfg, tmp_path / out, "cpu")
        return base_key(base_inputs(cmd, tmp_path / out, str(tasks), LM_EVAL_ENV, sys.executable, args, LM_EVAL_RUN))

    before = key()
    assert key(out="run-b/eval/base") == before  # another point's output folder: the same evaluation
    assert key(limit=4) != before and key(limit=4) == key(limit=4.0) and key(limit=8) != key(limit=4)
    assert key(num_fewshot=1) != before and key(batch_size=4) != before
    (tasks / "data.jsonl").write_text('{"q": 2}\n')  # the task's data, same size
    assert key() != before
    before = key()
    (tasks / TINY_TASK.name).write_text((tasks / TINY_TASK.name).read_text().replace("acc_norm", "acc"))
    assert key() != before
    before = key()
    (model / "model.safetensors").write_bytes(b"0" * 8)  # the base's files changed
    assert key() != before
    hub = key("org/base")
    assert hub != key() and key("org/other") != hub
    ref.write_text("b" * 40)  # main moved to another commit
    assert key("org/base") != hub


def test_a_base_record_is_kept_whole_first_writer_first_and_only_for_sweep_points(tmp_path: Path) -> None:
    """Two points that scored the base at once: the first record stays whole, the second is not written over it; a
    torn or foreign record reads as none (the point scores the base itself); a run alone has no place for one."""
    from slurmft.job.base_eval import keep_record, read_record, records_dir

    sweep = tmp_path / "sweep"
    (sweep / "p1").mkdir(parents=True)
    (sweep / "sweep.json").write_text("{}")
    (tmp_path / "alone").mkdir()
    assert records_dir(tmp_path / "alone") is None and records_dir(sweep) is None
    folder = records_dir(sweep / "p1")
    assert folder == sweep.resolve() / "base-eval"
    path = folder / "k1" / "record.json"
    results = {"results": {"tiny_choice": {"acc,none": 0.25}}}
    assert keep_record(path, "k1", {"command": []}, "p1", 3.0, results)
    assert not keep_record(path, "k1", {"command": []}, "p2", 4.0, {"results": {}})
    record = read_record(path, "k1")
    assert record is not None and record["point"] == "p1" and record["results"] == results
    assert [p.name for p in path.parent.iterdir()] == ["record.json"]  # no temporary file left behind
    assert read_record(path, "k2") is None
    path.write_text(path.read_text()[:40])  # torn (not something keep_record writes; read as none all the same)
    assert read_record(path, "k1") is None
