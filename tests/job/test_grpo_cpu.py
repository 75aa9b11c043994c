"""GRPO on real two-rank FSDP2 (gloo, CPU): TRL's losses, rewards and KL, completions sampled the same on every
world size, a frozen sharded reference.

One launch serves every check (tests/job/run_many.py through tests/job/dpo_check.py, which keeps the models the
job builds and reports on them): ``grpo``, the micro model, 2 ranks x 2 completions, 4 completions of one prompt
per step (num_generations 4), beta 0.04 (the reference a second sharded copy), TRL's default loss (dapo), two
rewards of the tests' own (tests/job/grpo_rewards.py: one reads the data's ``answer`` column) with weights, 4
steps. Then the single-process TRL reference (tests/job/grpo_reference.py: transformers + TRL's GRPOTrainer with
its own reference copy, no FSDP, the whole generation batch on one process).

What is compared, exactly: both sides sample through slurmft's seeded sampler (slurmft/job/grpo.py: Gumbel-max
keyed by seed, step, the completion's place in the global generation batch and the token position), so the same
prompts get the same completions on 2 ranks and on 1 process; TRL's own sampling (each rank's RNG stream) would
give others. steps_per_generation is 1, so each step trains on its whole generation batch (TRL shuffles a
generation batch per rank before splitting it into steps: with more than one step per generation the steps' halves
differ between shapes, not the sums). Rewards, advantages, loss, KL and the logged metrics are TRL's on both sides.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from .helpers import REPO, launch_like_srun, read_metrics, write_run
from .test_lora_cpu import _copy

pytestmark = pytest.mark.train

STEPS, EVERY, MID = 4, 2, 3
HERE = Path(__file__).resolve().parent
PROMPTS = REPO / "examples" / "tiny" / "data" / "prompts.jsonl"
RUN_ARGS = [f"train.max_steps={STEPS}", f"checkpoint.every_steps={EVERY}", "checkpoint.keep_last=2",
            "checkpoint.async=false", "data.max_seq_length=64", "train.per_device_batch_size=2",
            "train.learning_rate=1e-3", "train.warmup_ratio=0.0"]
REWARDS = [{"function": f"{HERE / 'grpo_rewards.py'}:shared_letters", "weight": 1.0},
           {"function": f"{HERE / 'grpo_rewards.py'}:length", "weight": 0.5}]
#: the metrics compared with TRL's (TRL's names)
COMPARED = ("reward", "reward_std", "rewards/shared_letters/mean", "rewards/length/mean", "kl",
            "completions/mean_length")


def ended_often(model: Path, to: Path) -> Path:
    """The micro model with one token in six an end of completion (its generation_config.json's eos_token_id, as
    instruct models list their end-of-turn tokens there): completions of different lengths, so ranks finish
    generating at different times (transformers' synced_gpus keeps them in step) and EOS is masked as TRL masks it."""
    import shutil

    shutil.copytree(model, to)
    gen = json.loads((to / "generation_config.json").read_text())
    vocab = json.loads((to / "config.json").read_text())["vocab_size"]
    gen["eos_token_id"] = [gen["eos_token_id"], *range(6, vocab, 6)]
    (to / "generation_config.json").write_text(json.dumps(gen))
    return to


def on_prompts(cfg: dict) -> None:
    """The tests' grpo: section (beta 0.04) on the example's prompts (tests/job/test_grpo_lora_cpu.py too)."""
    cfg["data"]["datasets"] = [{"path": str(PROMPTS)}]
    cfg["grpo"] = {"num_generations": 4, "max_completion_length": 8, "beta": 0.04, "rewards": REWARDS}


@pytest.fixture(scope="module")
def grpo_runs(micro_model: Path, job_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("grpo")
    model = ended_often(micro_model, root / "model")

    def two_steps_per_generation(cfg: dict) -> None:
        on_prompts(cfg)
        cfg["grpo"]["steps_per_generation"] = 2  # one generation of 8 completions (2 prompts) for 2 steps

    def signaled(cfg: dict) -> None:
        two_steps_per_generation(cfg)
        cfg["grpo"]["rewards"][1]["function"] = f"{HERE / 'grpo_rewards.py'}:length_then_signal"

    runs = {"grpo": write_run(root / "grpo", model, RUN_ARGS, edit=on_prompts),
            "spg2": write_run(root / "spg2", model, [*RUN_ARGS, f"checkpoint.every_steps={MID}"],
                              edit=two_steps_per_generation),
            # no periodic save before the end: its checkpoint-3 can only be the warning signal's
            "preempted": write_run(root / "preempted", model, [*RUN_ARGS, "checkpoint.every_steps=100"],
                                   edit=signaled)}
    check = "call:tests.job.dpo_check:main:{run}:" + str(root) + "/check-{name}"
    _, out = launch_like_srun(root / "first", job_env, program=[str(HERE / "run_many.py")],
                              args=[check.format(run=runs["grpo"], name="grpo"), str(runs["spg2"])]).wait(timeout=600)
    for path in sorted(root.glob("*.failed.rank*")):
        pytest.fail(path.read_text()[-4000:])
    # checkpoint-3 is inside a generation (steps 3 and 4 train the halves of the second one): what a warning signal
    # at step 3 saves. "resumed" continues from it; "regenerated" lost its rollouts files (what TRL alone keeps)
    runs["resumed"] = _copy(runs["spg2"], root / "resumed", cut_after=MID)
    runs["regenerated"] = _copy(runs["spg2"], root / "regenerated", cut_after=MID)
    cut = runs["regenerated"] / "checkpoints" / f"checkpoint-{MID}"
    for path in cut.glob("grpo_rollouts_*.pt"):  # as a checkpoint written without them (and its marker)
        path.unlink()
    marker = json.loads((cut / "COMPLETE").read_text())
    marker["files"] = {k: v for k, v in marker["files"].items() if not k.startswith("grpo_rollouts_")}
    (cut / "COMPLETE").write_text(json.dumps(marker))
    # the preempted run last (the warning signal's flag stays raised in that process): rank 1 signals itself while
    # step 3 generates (global_step 2); every rank stops after step 3, saves it and leaves the requeue marker
    signal_env = {**job_env, "GRPO_TEST_SIGNAL_AT": str(MID - 1)}
    _, out2 = launch_like_srun(root / "second", signal_env, program=[str(HERE / "run_many.py")],
                               args=[str(runs["resumed"]), str(runs["regenerated"]), str(runs["preempted"])],
                               ).wait(timeout=600)
    for path in sorted(root.glob("*.failed.rank*")):
        pytest.fail(path.read_text()[-4000:])
    requeued = sorted(p.name for p in (runs["preempted"] / "requeue").iterdir())
    rc, out3 = launch_like_srun(runs["preempted"], job_env, restart=1).wait(timeout=600)  # the requeued attempt
    assert rc == 0, out3[-4000:]
    runs["elastic"], elastic_notes = _on_one_rank(runs["grpo"], root / "elastic")
    rc, out4 = launch_like_srun(runs["elastic"], job_env, ntasks=1).wait(timeout=600)
    assert rc == 0, out4[-4000:]
    reference = subprocess.run([sys.executable, str(HERE / "grpo_reference.py"), str(runs["grpo"]),
                                str(root / "reference.json")], env=job_env, capture_output=True, text=True,
                               timeout=600, check=False)
    assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-3000:]
    return {"runs": runs, "root": root, "log": out + "\n" + out2, "requeued": requeued, "log3": out3,
            "elastic_log": out4, "elastic_notes": elastic_notes,
            "trl": json.loads((root / "reference.json").read_text())["logs"]}


def _on_one_rank(run: Path, to: Path) -> tuple[Path, list[str]]:
    """``run``'s checkpoint-EVERY (a generation boundary: one generation per step) in a fresh run directory whose
    config is what ``slurmft resume RUN resources.tasks_per_node=1`` makes of it (1 rank x 2 x 2 accumulation: the
    global batch, and the generation batch, of 4 kept)."""
    import shutil

    from slurmft.config_loading import dump_config
    from slurmft.rundir import RunPaths
    from slurmft.submit.resume import resume_config

    (to / "checkpoints").mkdir(parents=True)
    shutil.copy(run / "config.yaml", to / "config.yaml")
    ckpt = shutil.copytree(run / "checkpoints" / f"checkpoint-{EVERY}", to / "checkpoints" / f"checkpoint-{EVERY}")
    notes: list[str] = []
    cfg = resume_config(RunPaths.of(to), ["resources.tasks_per_node=1", f"output_dir={to}"], "local", ckpt,
                        notes.append)
    (to / "config.yaml").write_text(dump_config(cfg))
    return to, notes


def _check(where: Path) -> list[dict[str, Any]]:
    return [json.loads((where / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_losses_rewards_and_kl_equal_trls_own_grpo_trainer_on_one_process(grpo_runs: dict[str, Any]) -> None:
    ours, theirs = read_metrics(grpo_runs["runs"]["grpo"]), grpo_runs["trl"]
    assert len(ours) == len(theirs) == STEPS
    for mine, other in zip(ours, theirs, strict=True):
        assert mine["loss"] == pytest.approx(other["loss"], abs=2e-6), (mine, other)
        assert mine["grad_norm"] == pytest.approx(other["grad_norm"], rel=1e-4), (mine, other)
        for key in COMPARED:
            assert mine[key] == pytest.approx(other[key], rel=1e-5, abs=1e-6), (key, mine, other)
    assert ours[0]["kl"] == 0.0  # step 1: the policy is the reference
    assert all(m["kl"] > 0 for m in ours[1:])  # it moved (lr 1e-3): the KL term is measured, not zero by construction
    assert len({m["reward"] for m in ours}) == STEPS  # other prompts and completions every step
    assert all(1 < m["completions/mean_length"] < 8 for m in ours)  # ended early, at different lengths
    assert all(m["reward_std"] > 0 for m in ours)  # the groups' rewards differ: the advantages are not all zero


def test_the_policy_and_the_reference_are_fsdp2_shards_and_the_reference_never_moves(
        grpo_runs: dict[str, Any]) -> None:
    reports = _check(grpo_runs["root"] / "check-grpo")
    for report in reports:
        assert report["summary"]["status"] == "completed"
        policy, reference = (next(m for m in report["models"] if m["frozen"] is f) for f in (False, True))
        for model in (policy, reference):
            assert model["all_dtensor"], model
            assert 0 < model["local_numel"] < model["total_numel"]  # each rank holds a part
        assert policy["changed"] and not reference["changed"]
        assert not reference["requires_grad"] and not reference["with_grad"]
    for r, report in enumerate(reports):  # what estimate's reference_weights predicts (tests/test_estimate.py)
        fsdp = json.loads((grpo_runs["runs"]["grpo"] / "fsdp_report" / f"rank{r}.json").read_text())
        reference = next(m for m in report["models"] if m["frozen"])
        assert fsdp["reference_bytes"] == 4 * reference["local_numel"] > 0  # fp32 here
    final = grpo_runs["runs"]["grpo"] / "checkpoints" / f"checkpoint-{STEPS}"
    assert json.loads((final / "COMPLETE").read_text())["method"] == "grpo"
    # the model files' generation config (its EOS ids), which consolidation exports: not one derived from config.json
    model = Path(yaml.safe_load((grpo_runs["runs"]["grpo"] / "config.yaml").read_text())["model"]["name_or_path"])
    saved, given = (json.loads((d / "generation_config.json").read_text())["eos_token_id"] for d in (final, model))
    assert saved == given and len(saved) > 100


def _final_weights(run: Path, steps: int = STEPS) -> dict[str, Any]:
    """The model state of the run's last checkpoint (``checkpoint-<steps>``), read from its DCP files (no process
    group)."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    folder = run / "checkpoints" / f"checkpoint-{steps}" / "pytorch_model_fsdp_0"
    meta = FileSystemReader(str(folder)).read_metadata()
    state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in meta.state_dict_metadata.items()
             if hasattr(v, "size")}
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": no_dist, as asked
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=FileSystemReader(str(folder)), no_dist=True)
    return state


def test_a_resume_inside_steps_per_generation_continues_the_saved_rollouts_bitwise(
        grpo_runs: dict[str, Any]) -> None:
    """checkpoint-3 holds each rank's buffered rollouts and its place in them: step 4 trains the second half of the
    generation made at step 3, as the uninterrupted run did, bit for bit (loss, grad norm, rewards, final weights).
    Without the rollouts files the next attempt generates again at step 4: another step (the check can fail)."""
    import torch

    runs = grpo_runs["runs"]
    whole, resumed, regenerated = (read_metrics(runs[n]) for n in ("spg2", "resumed", "regenerated"))
    assert [m["step"] for m in whole] == [1, 2, 3, 4] and [m["step"] for m in resumed] == [1, 2, 3, 4]
    keys = ("loss", "grad_norm", "reward", "kl", "completions/mean_length")  # reward: logged at generation steps
    assert [{k: m.get(k) for k in keys} for m in resumed] == [{k: m.get(k) for k in keys} for m in whole]
    assert "reward" not in whole[-1] and "reward" in regenerated[-1]  # step 4 generated nothing, or again
    a, b = _final_weights(runs["spg2"]), _final_weights(runs["resumed"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert regenerated[-1]["loss"] != whole[-1]["loss"] or regenerated[-1]["grad_norm"] != whole[-1]["grad_norm"]
    assert "holds no rollouts for 2 ranks: the next step generates again" in grpo_runs["log"]


def test_the_warning_signal_inside_a_generation_saves_the_rollouts_and_the_next_attempt_ends_bitwise(
        grpo_runs: dict[str, Any]) -> None:
    """The signal lands while step 3 generates; the ranks agree to stop after it and save checkpoint-3 (inside a
    generation: step 4 trains its second half); the next attempt (SLURM_RESTART_COUNT 1) continues from it and ends
    bitwise equal to the uninterrupted twin: every step's loss, grad norm, reward and KL, and the final weights."""
    import torch

    runs = grpo_runs["runs"]
    assert grpo_runs["requeued"] == ["4242-0"]
    marker = json.loads((runs["preempted"] / "requeue" / "4242-0").read_text())
    assert marker["step"] == MID and marker["saved"]  # written by rank 0, which saw the flag through the agreement
    assert sorted(p.name for p in (runs["preempted"] / "checkpoints").glob("checkpoint-*")) == [
        f"checkpoint-{MID}", f"checkpoint-{STEPS}"]
    assert sorted(p.name for p in (runs["preempted"] / "checkpoints" / f"checkpoint-{MID}").glob("grpo_rollouts_*")) \
        == ["grpo_rollouts_0.pt", "grpo_rollouts_1.pt"]
    whole, preempted = read_metrics(runs["spg2"]), read_metrics(runs["preempted"])
    assert [m["step"] for m in preempted] == [1, 2, 3, 4] and [m["restart"] for m in preempted] == [0, 0, 0, 1]
    keys = ("loss", "grad_norm", "reward", "kl", "completions/mean_length")
    assert [{k: m.get(k) for k in keys} for m in preempted] == [{k: m.get(k) for k in keys} for m in whole]
    a, b = _final_weights(runs["spg2"]), _final_weights(runs["preempted"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_metrics_jsonl_keeps_the_reward_per_function_kl_and_completion_length(grpo_runs: dict[str, Any]) -> None:
    for record in read_metrics(grpo_runs["runs"]["grpo"]):
        assert {"loss", "grad_norm", *COMPARED, "clip_ratio/region_mean"} <= set(record), record


def test_a_resume_on_one_rank_generates_the_same_completions_at_the_next_generation(
        grpo_runs: dict[str, Any]) -> None:
    """checkpoint-2 of the 2-rank run (2 x 2 x 1, one generation per step) resumed on 1 rank (1 x 2 x 2, the global
    and the generation batch of 4 kept; steps_per_generation follows accumulation, its default): the next
    generations are keyed by the completions trained on before them, not by micro-steps, so steps 3 and 4 sample
    the same completions as the uninterrupted run (their rewards and lengths bit for bit) from weights equal within
    fp32 (DCP resharded them); the losses and gradient norms within fp32 reduction order. The saved rollouts
    (2 ranks' shares, spent at this boundary anyway) are not used, and the log says so."""
    whole = {m["step"]: m for m in read_metrics(grpo_runs["runs"]["grpo"])}
    elastic = read_metrics(grpo_runs["runs"]["elastic"])
    assert grpo_runs["elastic_notes"] and "global batch of 4 sequences per step kept" in grpo_runs["elastic_notes"][0]
    assert [m["step"] for m in elastic] == [EVERY + 1, STEPS]
    exact = [k for k in COMPARED if k != "kl"]
    assert [{k: m[k] for k in exact} for m in elastic] == [{k: whole[m["step"]][k] for k in exact} for m in elastic]
    for m in elastic:
        ref = whole[m["step"]]
        assert m["loss"] == pytest.approx(ref["loss"], rel=1e-4, abs=1e-6), (m, ref)
        assert m["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-3), (m, ref)
        # TRL logs the KL as the mean of each micro-batch's token mean: 2 ranks' shares and one rank's 2 shuffled
        # micro-steps partition the same completions otherwise (measured: 4% apart at step 3), so it is not compared;
        # the loss (dapo: normalized by the whole batch's tokens) and the gradient norm, which hold its term, are
        assert m["kl"] > 0
    log = grpo_runs["elastic_log"]
    assert f"checkpoint-{EVERY} holds no rollouts for 1 ranks: the next step generates again" in log
    assert "resuming on 1 (1 x 2 x 2)" in log


def test_tokens_per_s_counts_what_every_step_trains_on(grpo_runs: dict[str, Any]) -> None:
    """TRL counts a generation batch's tokens at the step that generates it: with steps_per_generation 2 the steps
    that train on the buffered rest logged 0 tokens/s, and the report's mean over steps was about half the truth.
    Each step counts the prompt and completion tokens it trains on (slurmft/job/grpo.py ``trained_tokens``): with one
    generation per step that is TRL's own count at every step (the single-process reference's ``num_tokens``); with
    two, every step trains some; the report's tokens/s is the tokens trained over the time it took."""
    from slurmft.rundir import RunPaths
    from slurmft.watch.report import summary

    runs = grpo_runs["runs"]
    ours, theirs = read_metrics(runs["grpo"]), grpo_runs["trl"]
    assert [m["num_input_tokens_seen"] for m in ours] == [int(t["num_tokens"]) for t in theirs]
    spg2 = read_metrics(runs["spg2"])
    seen = [m["num_input_tokens_seen"] for m in spg2]
    assert all(after > before for before, after in zip([0, *seen[:-1]], seen, strict=True)), seen
    assert all(m["tokens_per_s"] > 0 and m["interval_s"] > 0 for m in spg2), spg2
    mean = summary(RunPaths.of(runs["spg2"]), slurm_rows=[])["tokens_per_s_mean"]
    assert mean == pytest.approx(seen[-1] / sum(m["interval_s"] for m in spg2), rel=1e-3)
