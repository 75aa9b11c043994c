"""Shared pytest fixtures.

``slurm_cluster`` is the real two-node Slurm cluster of ``tests/slurm/cluster.sh`` (n1 and n2 on this
machine, 8 fake GPUs each, slurmdbd so ``sacct`` works). Tests that use it are marked
``@pytest.mark.slurm``. Every such test runs on Slurm 22.05 (this Debian 12 machine's); the ones also
marked ``@pytest.mark.every_slurm`` run on Slurm 24.11 (Debian 13's, in a root file system) too, as
``test_x[slurm22.05]`` and ``test_x[slurm24.11]``. The two clusters have their own ports and may run side
by side.

Who stops a cluster: only whoever owns its whole lifetime. A cluster that was already up when a test
needed it (``.ci/run`` starts both before pytest and its EXIT trap stops them; a developer's
``cluster.sh up``) is never stopped by pytest. A cluster that this pytest run started (the fixture
found it down) is stopped once, by the run's main process (the xdist controller, or the only process
with ``-n 0``) after every worker has finished, unless ``SLURMFT_KEEP_CLUSTER=1`` (handy while
iterating: the next session then finds it healthy and starts in well under a second). No worker ever
stops a cluster: the other worker may still be using it (issue 35: the fixture's teardown on the switch
from 22.05 to 24.11 stopped the 22.05 cluster under the other worker's tests).

There is no skip: if Slurm cannot be installed or started, every test that needs it fails with the
daemon logs, because CI requires the real cluster.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

# As a job process does while its libraries load (slurmft/job/entrypoint.py load_the_stack): the cyclic garbage
# collector is off while pytest imports the test modules (torch, transformers, TRL, datasets: most of a worker's
# ~22 CPU-s of collection), then what they made is frozen and the collector runs again (pytest_collection).
# Measured: `pytest --collect-only` 21.6-21.9 CPU-s with it on, 18.5-19.7 off.
gc.disable()

REPO_ROOT = Path(__file__).resolve().parent.parent
CLUSTER_SH = REPO_ROOT / "tests" / "slurm" / "cluster.sh"
# The Slurm versions tested, oldest first, and the Debian suite whose packages give each
# (cluster.sh's SLURMFT_CLUSTER_SUITE).
SLURM_VERSIONS = {"22.05": "bookworm", "24.11": "trixie"}

# A job in one of these states will not change again by itself.
TERMINAL_STATES = frozenset(
    {"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "TIMEOUT"}
)


# Set by the run's main process (pytest_configure) before xdist starts its workers, which inherit it: a
# directory where the slurm_cluster fixture, in any process, records each cluster it started
# (``started-<suite>``) and which worker used which cluster (``used-<suite>-<worker>``).
CLUSTER_RECORD_ENV = "SLURMFT_TEST_CLUSTER_RECORD"
_RECORD_KEY = pytest.StashKey[Path]()
_USERS_KEY = pytest.StashKey[dict[str, set[str]]]()  # suite -> the processes whose tests used it


def _run(args: list[str], timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)


@dataclass
class SlurmCluster:
    """Handle on the running test cluster; ``SLURM_CONF`` (and for 24.11 ``PATH``) already in ``os.environ``."""

    conf: Path
    dir: Path
    version: str  # "22.05", "24.11": which of SLURM_VERSIONS

    def slurm(self, *args: str, timeout: float = 30) -> str:
        """Run a Slurm command; return its stdout, raise with its stderr when it fails."""
        proc = _run(list(args), timeout=timeout)
        if proc.returncode != 0:
            raise AssertionError(f"{shlex.join(args)} exited {proc.returncode}: {proc.stderr.strip()}")
        return proc.stdout

    def sbatch(self, *args: str) -> str:
        """``sbatch --parsable ARGS``; return the job id."""
        return self.slurm("sbatch", "--parsable", *args).strip().split(";")[0]

    def squeue_state(self, job_id: str) -> str | None:
        """State as slurmctld has it (it keeps finished jobs for MinJobAge=300 s); None if unknown."""
        proc = _run(["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T"])
        if proc.returncode != 0:
            return None
        return proc.stdout.strip() or None

    def squeue_reason(self, job_id: str) -> str | None:
        """Why a job is pending (``Dependency``, ``DependencyNeverSatisfied``, ``None``...)."""
        proc = _run(["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%r"])
        if proc.returncode != 0:
            return None
        return proc.stdout.strip() or None

    def sacct_state(self, job_id: str) -> str | None:
        """State as accounting has it (lags slurmctld by up to a second or so); None if not there yet.

        Only the first word: ``CANCELLED by 0`` gives ``CANCELLED``.
        """
        proc = _run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"])
        lines = [line.strip() for line in proc.stdout.splitlines() if line.strip()]
        if proc.returncode != 0 or not lines:
            return None
        return lines[-1].split()[0]

    def wait_state(
        self, job_id: str, states: str | Iterable[str], timeout: float = 60, *, via: str = "squeue"
    ) -> str:
        """Poll until the job is in one of ``states``; return that state.

        ``via="squeue"`` asks slurmctld (falling back to sacct once it has forgotten the job);
        ``via="sacct"`` asks accounting only, e.g. to check what ``sacct`` reports. Fails at once if
        the job ends in another state, else after ``timeout`` seconds, with the job's details.
        """
        wanted = {states} if isinstance(states, str) else set(states)
        if via not in ("squeue", "sacct"):
            raise ValueError(f"via must be 'squeue' or 'sacct', not {via!r}")
        deadline = time.monotonic() + timeout
        state = None
        while True:
            if via == "squeue":
                state = self.squeue_state(job_id) or self.sacct_state(job_id)
            else:
                state = self.sacct_state(job_id)
            if state in wanted:
                return state
            if state in TERMINAL_STATES and via == "squeue":
                raise AssertionError(
                    f"job {job_id} ended {state}, expected {sorted(wanted)}\n{self.describe(job_id)}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"job {job_id} still {state} after {timeout:.0f}s, expected {sorted(wanted)}\n"
                    f"{self.describe(job_id)}"
                )
            time.sleep(0.2)

    def describe(self, job_id: str) -> str:
        """What to print when a job misbehaves: scontrol, sacct and the end of slurmctld's log."""
        parts = []
        for args in (
            ["scontrol", "show", "job", job_id],
            ["sacct", "-j", job_id, "-o", "JobID,State,ExitCode,Reason,NodeList,Start,End"],
        ):
            proc = _run(args)
            parts.append(f"$ {shlex.join(args)}\n{proc.stdout}{proc.stderr}")
        log = self.dir / "log" / "slurmctld.log"
        if log.exists():
            parts.append(f"--- {log} (tail) ---\n" + "\n".join(log.read_text().splitlines()[-20:]))
        return "\n".join(parts)


def _cluster_env(environ: dict[str, str]) -> dict[str, str]:
    proc = subprocess.run(["bash", str(CLUSTER_SH), "env"], capture_output=True, text=True, timeout=30,
                          check=False, env=environ)
    env = {}
    for line in proc.stdout.splitlines():
        words = shlex.split(line)
        if len(words) == 2 and words[0] == "export" and "=" in words[1]:
            key, value = words[1].split("=", 1)
            env[key] = value
    return env


@pytest.hookimpl(wrapper=True)
def pytest_collection(session: pytest.Session) -> Iterator[object]:
    """After the collection (a worker's, or the xdist controller's, which collects nothing): the collector on again,
    the test modules' objects frozen (see ``gc.disable()`` above)."""
    try:
        return (yield)
    finally:
        gc.freeze()
        gc.enable()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Groups for pytest-xdist's ``--dist loadgroup`` (pyproject's addopts run two workers).

    The Slurm tests of one version run one after another on one worker: they share that version's
    cluster and its uninterrupted reference run, and several time what the ranks do. Each version is
    its own group, so the few 24.11 tests can go to the other worker, beside the 22.05 ones (two
    clusters, one user each; the 22.05 group alone is the longest piece of work, and a 24.11 group
    tied to it only made that worker's share longer). The CPU tests fill both workers around them.
    The local-executor tests share one uninterrupted run (``local_tiny_run``), and the tests of a module with a
    module-scoped fixture stay on one worker, so its shared runs are made once; a Slurm test that needs no cluster
    but shares such a fixture with its module's cluster tests joins their group (test_shared_rundir's ``teammate``
    creates and deletes a user: built on both workers, one deleted it under the other, CI70).
    """
    def version_of(item: pytest.Item) -> str | None:
        callspec = getattr(item, "callspec", None)
        return callspec.params.get("slurm_cluster") if callspec else None

    cluster_group: dict[str, str] = {}  # a module's first Slurm version group
    for item in items:
        if item.get_closest_marker("slurm") and version_of(item):
            cluster_group.setdefault(item.nodeid.split("::")[0], f"slurm{version_of(item)}")
    for item in items:
        if "slurm_cluster" in getattr(item, "fixturenames", ()) and not item.get_closest_marker("slurm"):
            raise pytest.UsageError(f"{item.nodeid} uses slurm_cluster but is not marked slurm")
        if item.get_closest_marker("slurm"):
            version = version_of(item)
            module = item.nodeid.split("::")[0]
            group = f"slurm{version}" if version else (
                cluster_group.get(module, "slurm") if _uses_a_module_fixture(item) else "slurm")
            item.add_marker(pytest.mark.xdist_group(group))
        elif "local_tiny_run" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("local-tiny"))
        elif _uses_a_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


def _uses_a_module_fixture(item: pytest.Item) -> bool:
    """Whether ``item`` uses a module-scoped fixture (its module's shared runs). xdist builds such a fixture once
    per worker that gets one of the module's tests: ungrouped, a module's tests went to both workers and its shared
    training runs were made twice (CI61: test_precision_cpu's 2 minutes of runs, test_train_cpu's and
    test_lora_cpu's)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(defs[-1].scope == "module" for defs in info.name2fixturedefs.values() if defs)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """``slurm_cluster`` (and every fixture built on it) once per Slurm version the test runs on."""
    if "slurm_cluster" in metafunc.fixturenames:
        every = metafunc.definition.get_closest_marker("every_slurm") is not None
        versions = list(SLURM_VERSIONS) if every else [next(iter(SLURM_VERSIONS))]
        metafunc.parametrize("slurm_cluster", versions, indirect=True, scope="session",
                             ids=[f"slurm{v}" for v in versions])


# Outcomes of the tests that run on every Slurm version: {test name: {version id: outcome}}.
_EVERY_SLURM: dict[str, dict[str, str]] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Note each every_slurm test's outcome per version (on the xdist controller too: reports travel)."""
    if "every_slurm" not in report.keywords or "[slurm" not in report.nodeid:
        return
    if report.when == "call" or report.outcome != "passed":  # a failed setup or teardown counts too
        # xdist's --dist loadgroup appends "@<group>" to the node id
        name, _, version = report.nodeid.partition("@")[0].rpartition("[")
        version = version.rstrip("]")
        outcomes = _EVERY_SLURM.setdefault(name, {})
        if outcomes.get(version) in (None, "passed"):
            outcomes[version] = report.outcome


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Which processes used each Slurm cluster (one each is the plan: pytest_collection_modifyitems), and one
    line per test that runs on every Slurm version: its outcome on each (the CI log must show them)."""
    users = terminalreporter.config.stash.get(_USERS_KEY, {})
    if users:
        where = "; ".join(f"{suite}: {', '.join(sorted(names))}" for suite, names in sorted(users.items()))
        shared = sorted(suite for suite, names in users.items() if len(names) > 1)
        note = f" (more than one process used {', '.join(shared)}: its tests were not kept together)" if shared else ""
        terminalreporter.write_line(f"Slurm clusters used by: {where}{note}")
    if not _EVERY_SLURM:
        return
    terminalreporter.section("tests on every Slurm version")
    for name, outcomes in sorted(_EVERY_SLURM.items()):
        cells = "  ".join(f"{v}: {outcomes.get(f'slurm{v}', 'not run'):7}" for v in SLURM_VERSIONS)
        terminalreporter.write_line(f"{cells}  {name}")


def _is_main_process(config: pytest.Config) -> bool:
    """The xdist controller, or the only process with ``-n 0``: not an xdist worker."""
    return not hasattr(config, "workerinput")


def pytest_configure(config: pytest.Config) -> None:
    """The main process makes the run's cluster record before any worker starts (workers inherit it)."""
    if _is_main_process(config):
        record = Path(tempfile.mkdtemp(prefix="slurmft-test-clusters-"))
        os.environ[CLUSTER_RECORD_ENV] = str(record)
        config.stash[_RECORD_KEY] = record



def suite_env(suite: str) -> dict[str, str]:
    return {**os.environ, "SLURMFT_CLUSTER_SUITE": suite}


def pytest_sessionfinish(session: pytest.Session) -> None:
    """After every worker has finished: stop the clusters that this run started, and only those."""
    record = session.config.stash.get(_RECORD_KEY, None)
    if record is None or not _is_main_process(session.config):
        return
    users: dict[str, set[str]] = {}
    for marker in record.glob("used-*"):
        suite, _, worker = marker.name.removeprefix("used-").partition("-")
        users.setdefault(suite, set()).add(worker)
    session.config.stash[_USERS_KEY] = users
    for marker in sorted(record.glob("started-*")):
        suite = marker.name.removeprefix("started-")
        if os.environ.get("SLURMFT_KEEP_CLUSTER") == "1":
            print(f"\nSLURMFT_KEEP_CLUSTER=1: the {suite} cluster this run started stays up")
            continue
        down = subprocess.run(["bash", str(CLUSTER_SH), "down"], capture_output=True, text=True, timeout=120,
                              check=False, env=suite_env(suite))
        if down.returncode != 0:
            warnings.warn(f"{CLUSTER_SH} down ({suite}) exited {down.returncode}: {down.stderr}", stacklevel=1)
    shutil.rmtree(record, ignore_errors=True)



def cluster_healthy(suite: str) -> bool:
    """``cluster.sh status``: every daemon up and both nodes idle or in use."""
    return subprocess.run(["bash", str(CLUSTER_SH), "status"], capture_output=True, text=True, timeout=60,
                          check=False, env=suite_env(suite)).returncode == 0


def ensure_cluster(suite: str) -> None:
    """Start the cluster of ``suite`` if it is not up, and record that this run started it (so that the
    run's main process stops it at the end); a cluster that was up is left to whoever started it."""
    if cluster_healthy(suite):
        return
    # One `up` at a time in this run, whatever the suite: the two workers may each start a version at once,
    # and on a fresh machine both would install Debian packages (apt's lock). cluster.sh's own lock covers one
    # suite: a second process asking for the same one waits and then finds it healthy.
    with open(Path(os.environ[CLUSTER_RECORD_ENV]) / "up.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not cluster_healthy(suite):
            _start_cluster(suite)


def _start_cluster(suite: str) -> None:
    # Recorded before `up`, so that a half-started cluster is stopped at the end too.
    (Path(os.environ[CLUSTER_RECORD_ENV]) / f"started-{suite}").touch()
    try:
        # A fresh machine installs the Debian packages first (24.11: builds its root file system): allow
        # for apt.
        up = subprocess.run(["bash", str(CLUSTER_SH), "up"], capture_output=True, text=True, timeout=1200,
                            check=False, env=suite_env(suite))
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{CLUSTER_SH} up timed out after {exc.timeout}s\n{exc.stdout}\n{exc.stderr}", pytrace=False)
    if up.returncode != 0:
        pytest.fail(
            f"the local Slurm cluster did not start ({CLUSTER_SH} up exited {up.returncode}):\n"
            f"{up.stdout}\n{up.stderr}",
            pytrace=False,
        )
    print(up.stdout, end="")


@contextlib.contextmanager
def second_cluster(name: str, port_offset: int, knobs: dict[str, str]) -> Iterator[Path]:
    """A second 22.05 cluster beside the shared one, for a test that needs another configuration (cluster.sh's
    knobs): its own directory and ports (the shared cluster's + ``port_offset``), started here and stopped
    here, since this test owns its whole lifetime. Yields the directory that holds ``cluster/``; the caller
    points SLURM_CONF at ``cluster/etc/slurm.conf``. Not under pytest's tmp_path: munged wants every
    directory above its socket searchable by all (0700 is not)."""
    base = Path(tempfile.mkdtemp(prefix=f"slurmft-{name}-", dir="/tmp"))
    base.chmod(0o755)
    env = {**os.environ, "SLURMFT_CLUSTER_DIR": str(base / "cluster"),
           "SLURMFT_CLUSTER_PORT": str(int(os.environ.get("SLURMFT_CLUSTER_PORT", "16817")) + port_offset),
           **{key: value.format(base=base) for key, value in knobs.items()}}
    env.pop("SLURM_CONF", None)
    up = subprocess.run(["bash", str(CLUSTER_SH), "up"], env=env, capture_output=True, text=True, timeout=300,
                        check=False)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        yield base
    finally:
        subprocess.run(["bash", str(CLUSTER_SH), "down"], env=env, capture_output=True, text=True, timeout=120,
                       check=False)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def slurm_cluster(request: pytest.FixtureRequest) -> Iterator[SlurmCluster]:
    """The real local two-node Slurm cluster of one version (the parameter): started if it is not up, and
    never stopped here (see the module docstring: the run's main process stops what the run started)."""
    version = request.param
    suite = SLURM_VERSIONS[version]
    environ = suite_env(suite)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    (Path(os.environ[CLUSTER_RECORD_ENV]) / f"used-{suite}-{worker}").touch()
    ensure_cluster(suite)

    env = _cluster_env(environ)
    if "SLURM_CONF" not in env:
        pytest.fail(f"{CLUSTER_SH} env printed no SLURM_CONF: {env}", pytrace=False)
    conf = Path(env["SLURM_CONF"])
    cluster = SlurmCluster(conf=conf, dir=conf.parent.parent, version=version)
    applied = {key: env[key] for key in ("SLURM_CONF", "PATH") if key in env}
    previous = {key: os.environ.get(key) for key in applied}
    os.environ.update(applied)
    try:
        sinfo = cluster.slurm("sinfo", "--version").strip()
        if sinfo.split()[-1].rsplit(".", 1)[0] != version:
            pytest.fail(f"asked for Slurm {version}, `sinfo --version` says {sinfo!r}", pytrace=False)
        yield cluster
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama + locally trained tokenizer (slurmft.tiny), built once per session."""
    from slurmft.tiny import build

    return build(tmp_path_factory.mktemp("tiny-assets") / "model", "tiny", "float32")


@pytest.fixture(scope="session")
def micro_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """slurmft.tiny's ``micro`` preset (the tiny preset's tokenizer, a quarter of its width): for tests whose checks
    (endings, saves, resumes, fallbacks) do not depend on the width; its steps are 2.6x faster than tiny's."""
    from slurmft.tiny import build

    return build(tmp_path_factory.mktemp("micro-assets") / "model", "micro", "float32")


@pytest.fixture(scope="session")
def chat_data() -> Path:
    """A small LIMA-style chat dataset shipped with the tiny example."""
    return REPO_ROOT / "examples" / "tiny" / "data" / "lima.jsonl"


# The tiny example on the local executor, uninterrupted: tests/test_dispatch_local.py checks it, tests/test_resume_local.py
# compares its killed-and-resumed run against it (one reference run per session, not one per test). It is the served
# and scored example (serve-eval.yaml: run.yaml's fine-tune, then vLLM's serve check and lm-eval after its
# consolidation; tests/test_serve_eval_local.py) wherever the two venvs exist (examples/tiny/envs.sh; CI builds them),
# run.yaml's otherwise (test_examples_cpu checks that both files train the same model).
LOCAL_EXAMPLE = REPO_ROOT / "examples" / "tiny" / "run.yaml"
SERVED_EXAMPLE = REPO_ROOT / "examples" / "tiny" / "serve-eval.yaml"
LOCAL_ARGS = ["train.max_steps=18", "checkpoint.every_steps=6", "data.max_seq_length=64"]  # 64: a step 4x cheaper
#: Where the tests look for the serve check's and the evaluation's interpreters (examples/tiny/envs.sh's venvs): the
#: variables first (CI sets them), then CI's cache, then the repository's .venvs/.
VENV_ROOTS = (Path("/var/cache/slurmft/venvs"), REPO_ROOT / ".venvs")


def model_job_python(kind: str) -> str | None:
    """The vLLM (``serve``) or lm-eval (``eval``) interpreter for the tests, or None when this machine has none."""
    var = {"serve": "SLURMFT_TEST_VLLM_PYTHON", "eval": "SLURMFT_TEST_EVAL_PYTHON"}[kind]
    if os.environ.get(var):
        return os.environ[var]
    name = {"serve": "vllm", "eval": "lm-eval"}[kind]
    return next((str(r / name / "bin" / "python") for r in VENV_ROOTS if (r / name / "bin" / "python").is_file()),
                None)


def need_model_job_python(kind: str) -> str:
    """The interpreter, or a skip that says how to get it (a failure under CI, which builds both)."""
    python = model_job_python(kind)
    if python is None:
        why = f"no {'vLLM' if kind == 'serve' else 'lm-eval'} venv here: bash examples/tiny/envs.sh builds it"
        if os.environ.get("CI"):
            pytest.fail(f"{why} (.ci/run does, before the tests)")
        pytest.skip(why)
    return python


def served_args() -> list[str]:
    """The overrides that point serve-eval.yaml at this machine's venvs (empty when there are none)."""
    vllm, lm_eval = model_job_python("serve"), model_job_python("eval")
    if vllm is None or lm_eval is None:
        if os.environ.get("CI"):
            pytest.fail("CI builds the vLLM and lm-eval venvs (.ci/run: examples/tiny/envs.sh): not found")
        return []
    return [f"serve.python={vllm}", f"eval.python={lm_eval}"]


@pytest.fixture(scope="session")
def local_tiny_run(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run directory of ``slurmft submit examples/tiny/serve-eval.yaml`` (local executor, 18 steps of 64-token
    rows; served by vLLM and scored by lm-eval after its consolidation), finished; run.yaml's fine-tune alone where
    this machine has no vLLM/lm-eval venvs."""
    run = tmp_path_factory.mktemp("local-tiny") / "run"
    served = served_args()
    proc = subprocess.run(
        [sys.executable, "-m", "slurmft.cli", "submit", str(SERVED_EXAMPLE if served else LOCAL_EXAMPLE),
         f"output_dir={run}", f"model.name_or_path={tiny_model}", *LOCAL_ARGS, *served],
        capture_output=True, text=True, timeout=900, cwd=REPO_ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run.parent / "submit.err").write_text(proc.stderr)
    return run
