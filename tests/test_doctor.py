"""slurmft.plan.doctor and the parsers it reads (slurmft.slurm), without a cluster: recorded Slurm 22.05.8 output
of the test cluster, the same cluster recorded on 24.11.5, and a 25.11 sample written from Slurm's source
(tests/data/slurm/README.md says which is which). The same checks against the real cluster, healthy and
misconfigured: tests/slurm/test_slurm_doctor.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from slurmft import slurm
from slurmft.plan.doctor import (
    NOT_REPORTED,
    Level,
    ProbeExpect,
    RunFacts,
    diagnose,
    exit_code,
    format_lines,
    probe_lines,
)

DATA = Path(__file__).parent / "data" / "slurm"


def facts(version: str, partition: str | None = None, **changes: object) -> slurm.ClusterFacts:
    """ClusterFacts as ``slurm.cluster_facts`` builds them, from the recorded files of one version."""
    parts = slurm.parse_partitions((DATA / version / "show-partition.txt").read_text())
    default = next(n for n, f in parts.items() if f.get("Default") == "YES")
    base = slurm.ClusterFacts(
        client_version=version + ".0", config=slurm.parse_config((DATA / version / "show-config.txt").read_text()),
        config_problem="", partitions=parts, partitions_problem="", partition=partition or default,
        gpus_per_node=slurm.parse_gres_gpus((DATA / version / "sinfo-gres.txt").read_text()), accounting_problem=None)
    return dataclasses.replace(base, **changes)


def run(**changes: object) -> RunFacts:
    base = RunFacts(partition=None, time_s=3600, gpus_per_node=8, requests_gpus=True, lead_time_s=300,
                    every_steps=50, save_s=85.0)
    return dataclasses.replace(base, **changes)


def by_check(lines: list) -> dict:
    return {line.check: line for line in lines}


# ------------------------------------------------------------------ verdicts
def test_the_test_cluster_without_a_run_is_all_ok() -> None:
    lines = diagnose(facts("22.05"), None)
    assert [line.level for line in lines] == [Level.OK] * len(lines), format_lines(lines)
    assert "waits 10 s" in by_check(lines)["requeue delay"].text
    assert exit_code(lines) == 0


def test_a_short_kill_wait_is_a_problem_with_its_fix() -> None:
    lines = by_check(diagnose(facts("22.05"), run(save_s=85.0)))
    kill = lines["KillWait"]
    assert kill.level is Level.PROBLEM
    assert "5 s after SIGTERM" in kill.text and "~85 s" in kill.text and "up to 50 steps" in kill.text
    assert "KillWait >= 120" in kill.fix
    assert lines["lead time"].level is Level.OK
    assert exit_code(list(lines.values())) == 1


def test_with_async_saves_a_stop_may_save_twice() -> None:
    """checkpoint.async: a stop first finishes the save in flight, then saves its own step, so KillWait must cover
    two saves: 30 s covers one 20 s save, not a stop's 40 s."""
    f = dataclasses.replace(facts("22.05"), config={**facts("22.05").config, "KillWait": "30 sec"})
    assert by_check(diagnose(f, run(save_s=20.0)))["KillWait"].level is Level.OK
    kill = by_check(diagnose(f, run(save_s=20.0, asynchronous=True)))["KillWait"]
    assert kill.level is Level.PROBLEM and "this run's stop saves for (a save in flight, then its own) ~40 s" in kill.text
    assert "KillWait >= 90" in kill.fix
    lead = by_check(diagnose(f, run(save_s=20.0, asynchronous=True)))["lead time"]
    assert lead.level is Level.OK and "covers the stop (a save in flight, then its own) (~40 s)" in lead.text


def test_a_save_that_fits_is_ok() -> None:
    lines = by_check(diagnose(facts("22.05"), run(save_s=3.0)))
    assert lines["KillWait"].level is Level.OK and lines["lead time"].level is Level.OK


def test_preemption_grace_time_against_the_save() -> None:
    # gpu: REQUEUE, GraceTime 120 + KillWait 30 = 150 s
    ok = by_check(diagnose(facts("25.11"), run(partition="gpu", save_s=85.0)))
    assert ok["GraceTime"].level is Level.OK and "150 s" in ok["GraceTime"].text
    assert ok["preemption"].level is Level.OK and "requeues the same job id" in ok["preemption"].text
    assert ok["preempt signal"].level is Level.OK
    # lowprio: CANCEL, GraceTime 0 -> 30 s after SIGTERM, the sentence
    bad = by_check(diagnose(facts("25.11", "lowprio"), run(partition="lowprio", save_s=85.0)))
    grace = bad["GraceTime"]
    assert grace.level is Level.PROBLEM
    assert "a preemption on partition lowprio kills the job 30 s after SIGTERM" in grace.text
    assert "~85 s" in grace.text and "up to 50 steps" in grace.text
    assert "GraceTime >= 90 on lowprio" in grace.fix  # 120 s needed, KillWait gives 30
    assert bad["preemption"].level is Level.WARNING and "CANCELLED" in bad["preemption"].text
    assert "slurmft resume" in bad["preemption"].fix


def test_suspend_mode_says_what_it_means() -> None:
    f = facts("25.11")
    f.partitions["gpu"]["PreemptMode"] = "GANG,SUSPEND"
    line = by_check(diagnose(f, run(partition="gpu", save_s=1.0)))["preemption"]
    assert line.level is Level.WARNING and "paused" in line.text


def test_accounting_without_job_comment_is_a_problem() -> None:
    lines = by_check(diagnose(facts("25.11"), run(partition="gpu", save_s=1.0)))
    assert lines["job_comment"].level is Level.PROBLEM
    assert "AccountingStoreFlags=job_script,job_env" in lines["job_comment"].text
    assert "job_comment" in lines["job_comment"].fix


def test_accounting_that_does_not_answer_is_a_problem() -> None:
    line = by_check(diagnose(facts("22.05", accounting_problem="sacct is not on PATH"), None))["accounting"]
    assert line.level is Level.PROBLEM and "sacct is not on PATH" in line.text


def test_requeue_delay_from_each_source() -> None:
    assert "waits 60 s" in by_check(diagnose(facts("25.11"), None))["requeue delay"].text  # requeue_delay
    f = facts("25.11")
    f.config["SchedulerParameters"] = "bf_continue"
    assert "waits 120 s" in by_check(diagnose(f, None))["requeue delay"].text  # AuthInfo=(null): the default


def test_time_and_gpus_beyond_the_partition() -> None:
    lines = by_check(diagnose(facts("25.11", "lowprio"), run(partition="lowprio", time_s=8 * 3600, gpus_per_node=16)))
    assert lines["MaxTime"].level is Level.PROBLEM and "04:00:00" in lines["MaxTime"].fix
    assert lines["gpus"].level is Level.PROBLEM and "at most 8" in lines["gpus"].fix


def test_a_partition_that_does_not_exist() -> None:
    lines = by_check(diagnose(facts("25.11"), run(partition="nope")))
    assert lines["partition"].level is Level.PROBLEM and "gpu, lowprio" in lines["partition"].fix
    # nothing is said of a partition that does not exist (was: "ok  preemption: no preemption on nope ...")
    assert not [line for line in lines.values() if "nope" in line.text and line.check != "partition"]
    assert "preemption" not in lines


def test_fields_this_slurm_does_not_print_are_said_so() -> None:
    f = facts("22.05")
    for key in ("KillWait", "AccountingStoreFlags", "MinJobAge", "AuthInfo"):
        del f.config[key]
    del f.partitions["debug"]["MaxTime"]
    lines = by_check(diagnose(f, run(save_s=85.0)))
    for check in ("KillWait", "job_comment", "MinJobAge", "requeue delay", "MaxTime"):
        assert lines[check].level is Level.WARNING and NOT_REPORTED in lines[check].text, check


def test_send_user_signal_missing_is_a_warning_with_the_version_spelling() -> None:
    f = facts("25.11")
    f.config["PreemptParameters"] = "(null)"
    line = by_check(diagnose(f, run(partition="gpu", save_s=1.0)))["preempt signal"]
    assert line.level is Level.WARNING and "PreemptParameters=send_user_signal" in line.fix


def test_no_answer_from_scontrol_is_one_problem_not_a_traceback() -> None:
    f = facts("22.05", config=None, config_problem="scontrol is not on PATH", partitions=None,
              partitions_problem="scontrol is not on PATH", gpus_per_node=None)
    lines = diagnose(f, run(save_s=85.0))
    assert exit_code(lines) == 1
    assert any("scontrol is not on PATH" in line.text for line in lines)


@pytest.mark.parametrize("version", ["22.05", "25.11"])
def test_every_line_has_a_level_and_every_problem_a_fix(version: str) -> None:
    for line in diagnose(facts(version), run(save_s=500.0, lead_time_s=60)):
        assert line.level in Level
        assert line.level is Level.OK or line.fix, line


# ------------------------------------------------------------------ doctor --job: the probe's verdicts
PROBE = Path(__file__).parent / "data" / "probe" / "b-signal"


def probe_files() -> tuple[dict[int, dict], dict]:
    import json

    ranks = {r: json.loads((PROBE / f"rank-{r}.json").read_text()) for r in (0, 1)}
    return ranks, json.loads((PROBE / "batch.json").read_text())


def expect(**changes: object) -> ProbeExpect:
    base = ProbeExpect(nodes=2, world=2, vars={"GLOO_SOCKET_IFNAME": "lo", "HF_HUB_OFFLINE": "1",
                                               "TOKENIZERS_PARALLELISM": "false"},
                       signal_name="USR2", signal_text="--signal=B:USR2@300", batch_only=True, run_dir="/tmp/doc",
                       run_dir_bytes=10**8, model_bytes=10**7, wants_gpus=False, profile="local-test")
    return dataclasses.replace(base, **changes)


def probe_by_check(ranks: dict, batch: dict | None, exp: ProbeExpect) -> dict:
    return by_check(probe_lines(ranks, batch, exp, "7", "COMPLETED", "/x/probe.log"))


def test_probe_of_a_b_signal_render_fails_on_the_signal_only() -> None:
    ranks, batch = probe_files()
    lines = probe_by_check(ranks, batch, expect())
    sig = lines.pop("warning signal")
    assert sig.level is Level.PROBLEM and "batch shell only" in sig.text and "drop 'B:'" in sig.fix
    assert {c: line.level for c, line in lines.items() if line.level is not Level.OK} == {}
    assert {"probe", "python [n1]", "python [n2]", "profile variables", "run dir [n1]", "run dir [n2]", "HF_HOME [n1]",
            "HF_HOME [n2]", "scontrol in batch", "MASTER_ADDR", "all-reduce"} <= set(lines)
    assert "bus bandwidth 0.163 GB/s" in lines["all-reduce"].text


def test_probe_where_every_rank_got_the_signal_passes() -> None:
    ranks, batch = probe_files()
    for r in ranks.values():
        r["signal"].update(got="USR2", after_ready_s=12.0, batch_got=False)
    lines = probe_lines(ranks, batch, expect(signal_text="--signal=USR2@300", batch_only=False), "7", "COMPLETED", "l")
    assert exit_code(lines) == 0, format_lines(lines)
    assert "reached all 2 rank(s)" in by_check(lines)["warning signal"].text


def test_probe_catches_an_unshared_run_dir_an_unreached_master_and_a_missing_stack() -> None:
    ranks, batch = probe_files()
    ranks[1]["run_dir"]["saw"] = ["n2"]  # n2 does not see n1's file
    ranks[0]["master"].update(ok=False, error="RuntimeError: connection refused")
    ranks[0]["versions"]["trl"] = None
    lines = probe_by_check(ranks, batch, expect())
    assert lines["run dir [n2]"].level is Level.PROBLEM and "not seen on n2" in lines["run dir [n2]"].text
    assert "every node shares" in lines["run dir [n2]"].fix
    assert lines["run dir [n1]"].level is Level.OK
    assert lines["MASTER_ADDR"].level is Level.PROBLEM and "connection refused" in lines["MASTER_ADDR"].text
    assert lines["python [n1]"].level is Level.PROBLEM and "missing: trl" in lines["python [n1]"].text


def test_probe_reports_peft_and_needs_it_for_a_lora_run() -> None:
    ranks, batch = probe_files()
    for r in ranks.values():
        r["versions"]["peft"] = None  # recorded before the probe reported peft: a node without it
    full = probe_by_check(ranks, batch, expect())
    assert full["python [n1]"].level is Level.OK and "peft -" in full["python [n1]"].text  # reported, not needed
    lora = probe_by_check(ranks, batch, expect(lora=True))
    assert lora["python [n1]"].level is Level.PROBLEM and "missing: peft" in lora["python [n1]"].text
    assert ".[train]" in lora["python [n1]"].fix
    for r in ranks.values():
        r["versions"]["peft"] = "0.21.2"
    lora = probe_by_check(ranks, batch, expect(lora=True))
    assert lora["python [n1]"].level is Level.OK and "peft 0.21.2" in lora["python [n1]"].text


def test_probe_with_a_missing_rank_or_no_rank_is_a_problem() -> None:
    ranks, batch = probe_files()
    del ranks[1]
    assert probe_by_check(ranks, batch, expect())["probe"].level is Level.PROBLEM
    only = probe_lines({}, None, expect(), "7", "FAILED", "/x/probe.log")
    assert len(only) == 1 and only[0].level is Level.PROBLEM and "/x/probe.log" in only[0].text


def test_probe_variables_the_ranks_see_otherwise_and_too_little_space() -> None:
    ranks, batch = probe_files()
    ranks[1]["vars"]["GLOO_SOCKET_IFNAME"] = "eth0"
    lines = probe_by_check(ranks, batch, expect(run_dir_bytes=10**15))
    assert lines["profile variables"].level is Level.WARNING and "'eth0' on n2" in lines["profile variables"].text
    assert lines["run dir [n1]"].level is Level.PROBLEM and "keep_last" in lines["run dir [n1]"].fix


def test_the_recorded_24_11_config_of_the_test_cluster_reads_like_its_22_05_one() -> None:
    """The same two-node test cluster recorded on both versions (tests/slurm/record.py): every check gives the
    same level, and where the figures are the cluster's (KillWait 5 s, cred_expire 10 s, MinJobAge 300 s)
    the same words; 24.11 prints an unset PreemptType as ``(null)``, which still means no preemption."""
    config = slurm.parse_config((DATA / "24.11" / "show-config.txt").read_text())
    assert config["SLURM_VERSION"] == "24.11.5" and config["PreemptType"] == "(null)"
    old = by_check(diagnose(facts("22.05"), run(save_s=3.0)))
    new = by_check(diagnose(facts("22.05", config=config), run(save_s=3.0)))
    assert list(new) == list(old)
    assert {k: line.level for k, line in new.items()} == {k: line.level for k, line in old.items()}
    assert all(line.level is Level.OK for line in new.values()), [line for line in new.values() if line.level is not Level.OK]
    for check in ("KillWait", "requeue delay", "MinJobAge", "job_comment", "lead time"):
        assert new[check].text == old[check].text, check
    assert new["preemption"].text.startswith("no preemption on debug (PreemptType=(null), PreemptMode=OFF)")


def test_probe_holds_serve_and_eval_python_to_what_each_node_finds() -> None:
    """``doctor --job`` of a run with serve and eval sections: each node's answer on serve.python / eval.python (the
    probe's find_spec, slurmft/job/probe.py), a node where one is missing or lacks its tool named with the fix."""
    ranks, batch = probe_files()
    vllm, lm_eval = "/shared/venvs/vllm/bin/python", "/shared/venvs/lm-eval/bin/python"
    for r in ranks.values():
        r["model_jobs"] = {"serve": {"python": vllm, "module": "vllm", "found": True, "version": "0.32.0",
                                     "problem": None},
                           "eval": {"python": lm_eval, "module": "lm_eval", "found": True, "version": "0.4.13",
                                    "problem": None}}
    exp = expect(model_jobs={"serve": vllm, "eval": lm_eval})
    lines = probe_by_check(ranks, batch, exp)
    assert lines["serve.python"].level is Level.OK and lines["serve.python"].text == (
        f"{vllm} finds vLLM 0.32.0 on n1, n2")
    assert lines["eval.python"].level is Level.OK and "finds lm-eval 0.4.13 on n1, n2" in lines["eval.python"].text
    ranks[1]["model_jobs"]["serve"].update(found=False, problem=f"{vllm} does not exist on this machine")
    ranks[0]["model_jobs"]["eval"].update(found=False)
    lines = probe_by_check(ranks, batch, exp)
    serve, ev = lines["serve.python"], lines["eval.python"]
    assert serve.level is Level.PROBLEM and f"n2: {vllm} does not exist on this machine" in serve.text
    assert "n1" not in serve.text and "pip install vllm" in serve.fix and "every node shares" in serve.fix
    assert ev.level is Level.PROBLEM and f"n1: {lm_eval} cannot import lm_eval" in ev.text and "lm-eval" in ev.fix
    assert "serve.python" not in probe_by_check(ranks, batch, expect())  # a run without the sections: no line


def test_probe_holds_a_job_in_its_own_image_to_what_its_step_there_found(tmp_path: Path) -> None:
    """serve.container: the serve job's interpreter is asked by the probe's own step in that image (tool-serve-NODE.json,
    written by slurmft/job/probe.py's tool side, run here for real on the lm-eval venv when it is built), not by the
    ranks; a node that did not report, or whose slurmft there lacks what the serve check imports, is a problem."""
    import json
    import subprocess
    import sys

    from slurmft.probe_paths import ProbePaths
    from tests.conftest import model_job_python

    ranks, batch = probe_files()
    vllm, image = "/opt/vllm/bin/python", "pyxis image /fsx/vllm.sqsh (serve.container)"
    exp = expect(model_jobs={"serve": vllm}, model_job_places={"serve": image})
    fact = {"python": vllm, "module": "vllm", "found": True, "version": "0.32.0", "problem": None,
            "step_python": "/usr/bin/python3", "step_missing": []}
    tools = {"serve": {"n1": dict(fact), "n2": dict(fact)}}
    lines = by_check(probe_lines(ranks, batch, exp, "7", "COMPLETED", "/x/probe.log", tools))
    assert lines["serve.python"].level is Level.OK
    assert lines["serve.python"].text == f"{vllm} in the {image} finds vLLM 0.32.0 on n1, n2"
    del tools["serve"]["n2"]
    tools["serve"]["n1"]["step_missing"] = ["transformers"]
    lines = by_check(probe_lines(ranks, batch, exp, "7", "COMPLETED", "/x/probe.log", tools))
    assert lines["serve.python"].level is Level.PROBLEM and "did not report from n2" in lines["serve.python"].text
    assert "install slurmft[train] in that image" in lines["serve.python"].fix
    step = lines["serve.container"]
    assert step.level is Level.PROBLEM and "n1: /usr/bin/python3 (slurmft's own there) cannot import transformers" \
        in step.text and "slurmft[train]" in step.fix
    lm_eval = model_job_python("eval")
    if lm_eval is None:
        return
    paths = ProbePaths(tmp_path)
    out = subprocess.run([sys.executable, "-m", "slurmft.job.probe", "tool", str(tmp_path), "--kind=eval",
                          f"--python={lm_eval}"], capture_output=True, text=True, env={"SLURMD_NODENAME": "n9",
                                                                                         "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert list(paths.tool_reports("eval")) == ["n9"]
    found = json.loads(paths.tool_report("eval", "n9").read_text())
    assert found["found"] is True and found["python"] == lm_eval and found["step_missing"] == []


def test_probe_in_an_image_names_it_and_holds_slurmft_to_the_login_nodes_version() -> None:
    ranks, batch = probe_files()
    for r in ranks.values():
        r["slurmft"] = "0.0.9"
    exp = expect(image="charliecloud image /scratch/sft", slurmft_version="0.1.0")
    lines = probe_by_check(ranks, batch, exp)
    version = lines["slurmft version"]
    assert version.level is Level.PROBLEM and "0.0.9" in version.text and "0.1.0" in version.text
    assert "in the image" in version.fix
    assert "in the charliecloud image /scratch/sft" in lines["python [n1]"].text
    for r in ranks.values():
        r["slurmft"] = "0.1.0"
    ranks[0]["versions"]["torch"] = None
    lines = probe_by_check(ranks, batch, exp)
    assert lines["slurmft version"].level is Level.OK
    assert lines["python [n1]"].level is Level.PROBLEM and "rebuild" in lines["python [n1]"].fix


def test_probe_on_efa_gpus_without_the_nccl_plugin_warns() -> None:
    ranks, batch = probe_files()
    for r in ranks.values():
        r["cuda"] = {"available": True, "version": "12.4", "nccl": "2.21.5", "devices": 8}
        r["nccl_net_plugin"] = None
    lines = probe_by_check(ranks, batch, expect(profile="aws-efa", image="pyxis image /fsx/sft.sqsh"))
    assert lines["NCCL net plugin"].level is Level.WARNING and "in the image" in lines["NCCL net plugin"].fix
    ranks[0]["nccl_net_plugin"] = ranks[1]["nccl_net_plugin"] = "/opt/amazon/ofi-nccl/lib/libnccl-net.so"
    lines = probe_by_check(ranks, batch, expect(profile="aws-efa"))
    assert "NCCL net plugin" not in lines and "libnccl-net.so" in lines["python [n1]"].text


def test_the_estimates_cpu_ram_against_the_nodes_real_memory() -> None:
    """The nodes' RealMemory (sinfo -o %m) against the estimate's node-0 CPU RAM: the asynchronous saves' staging
    copy that only just does not fit is named with checkpoint.async: false as the fix (issue 45); a need beyond the
    node even without it gets more nodes; without a figure from Slurm a warning, not a guess."""
    from slurmft.slurm import parse_node_memory

    assert parse_node_memory("128000\n1024000+\n") == [128000, 1024000]
    nodes = dataclasses.replace(facts("22.05"), node_memory_mb=[parse_node_memory("128000")[0]])
    ok = by_check(diagnose(nodes, run(cpu_ram_bytes=100 * 10**9, cpu_ram_without_staging=20 * 10**9)))["node memory"]
    assert ok.level is Level.OK and "needs ~100 GB" in ok.text and "have 128 GB" in ok.text
    staging = by_check(diagnose(nodes, run(cpu_ram_bytes=224 * 10**9, cpu_ram_without_staging=20 * 10**9)))
    assert staging["node memory"].level is Level.PROBLEM and "~204 GB is the asynchronous saves' staging copy" in \
        staging["node memory"].text and "checkpoint.async: false" in staging["node memory"].fix
    assert exit_code(list(staging.values())) == 1
    over = by_check(diagnose(nodes, run(cpu_ram_bytes=300 * 10**9, cpu_ram_without_staging=200 * 10**9)))
    assert over["node memory"].level is Level.PROBLEM and "more nodes" in over["node memory"].fix
    unknown = by_check(diagnose(facts("22.05"), run(cpu_ram_bytes=10**9)))["node memory"]
    assert unknown.level is Level.WARNING and "sinfo -o %m" in unknown.text
    assert "node memory" not in by_check(diagnose(nodes, run()))  # no estimate: nothing to compare


def test_too_little_room_names_the_fix_of_the_directory_that_lacks_it() -> None:
    """HF_HOME without room for the model was told to 'lower checkpoint.keep_last' (the run directory's fix: HF_HOME
    holds no checkpoint); each directory now says its own (CI73 met it on a nearly full disk)."""
    ranks, batch = probe_files()
    lines = probe_by_check(ranks, batch, expect(run_dir_bytes=10**16, model_bytes=10**16))
    hf, run = lines["HF_HOME [n1]"], lines["run dir [n1]"]
    assert hf.level is Level.PROBLEM and run.level is Level.PROBLEM, (hf, run)
    assert "checkpoint.keep_last" not in hf.fix and "set HF_HOME (cluster.env) to a directory with room" in hf.fix
    assert "lower checkpoint.keep_last" in run.fix
