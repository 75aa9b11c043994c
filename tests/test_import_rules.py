"""The wings keep their arrows pointing one way, and no import circle is left (every import counts,
function-local ones included: a circle through a local import is still two rooms leaning on each other).

- plan/ (pure, before any job) imports neither submit/ nor watch/;
- watch/ (reads a run directory) does not import submit/;
- job/ (inside the allocation) imports none of cli, plan/, submit/;
- the ground floor (slurmft/*.py but cli and its parts, cli_*.py) imports no wing and not the job;
- no module imports itself back through others.

The rules are checked on the source (an AST walk), so they hold for code paths no test runs. Imports
under ``if TYPE_CHECKING:`` do not count: they are read by type checkers only, never run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "slurmft"
WINGS = ("plan", "submit", "watch", "job")

#: (importing area, imported area) pairs that must never occur.
NEVER = {
    ("plan", "submit"), ("plan", "watch"),
    ("watch", "submit"),
    ("job", "cli"), ("job", "plan"), ("job", "submit"),
    *(("ground", area) for area in ("cli", *WINGS)),
}


def module_name(path: Path, package: Path) -> str:
    rel = path.relative_to(package.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking_only(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of the tree except the bodies of ``if TYPE_CHECKING:`` (annotations only, never run)."""
    out, todo = [], [tree]
    while todo:
        node = todo.pop()
        out.append(node)
        if _type_checking_only(node):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))
    return out


def imports_of(path: Path, package: Path) -> set[str]:
    """Every slurmft module ``path`` imports, at any depth of the file (``from slurmft import x`` -> slurmft.x)."""
    name = module_name(path, package)
    is_pkg = path.name == "__init__.py"
    known = {module_name(p, package) for p in package.rglob("*.py")}
    found: set[str] = set()
    for node in runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == package.name}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != package.name:
                continue
            found.add(mod)
            found |= {f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in known}
    return {m for m in found if m in known and m != name and m != package.name}


def area(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 2 or (len(parts) == 2 and parts[1] in WINGS):
        return parts[1]
    return "cli" if len(parts) == 2 and (parts[1] == "cli" or parts[1].startswith("cli_")) else "ground"


def graph(package: Path) -> dict[str, set[str]]:
    return {module_name(p, package): imports_of(p, package) for p in sorted(package.rglob("*.py"))}


def broken_rules(package: Path) -> list[str]:
    return sorted(f"{a} ({area(a)}) imports {b} ({area(b)})" for a, deps in graph(package).items() for b in deps
                  if (area(a), area(b)) in NEVER)


def circles(package: Path) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    g = graph(package)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in g:
        if v not in index:
            visit(v)
    return out


def test_the_wings_exist_and_hold_their_modules() -> None:
    g = graph(PACKAGE)
    assert {area(m) for m in g} == {"ground", "cli", *WINGS}
    assert {"slurmft.plan.checks", "slurmft.submit.dispatch", "slurmft.watch.status", "slurmft.job.train"} <= set(g)
    # slurmft doctor: the verdicts are plan (pure), the probe's submission submit, its ranks the job
    assert (area("slurmft.plan.doctor"), area("slurmft.submit.probe"), area("slurmft.job.probe")) == ("plan", "submit", "job")
    assert {"slurmft.plan.doctor", "slurmft.submit.probe", "slurmft.job.probe"} <= set(g)


def test_no_arrow_runs_the_wrong_way() -> None:
    assert broken_rules(PACKAGE) == []


def test_no_import_circle() -> None:
    assert circles(PACKAGE) == []


def test_job_never_imports_login_checks() -> None:
    g = graph(PACKAGE)
    offenders = {m: sorted(d for d in deps if d.startswith(("slurmft.plan", "slurmft.cli", "slurmft.submit")))
                 for m, deps in g.items() if m.startswith("slurmft.job")}
    assert not any(offenders.values()), offenders


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    pkg = tmp_path / "slurmft"
    for rel, text in files.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    for d in [pkg, *(p for p in pkg.rglob("*") if p.is_dir())]:
        (d / "__init__.py").touch()
    return pkg


@pytest.mark.parametrize(("files", "broken"), [
    ({"plan/checks.py": "def f():\n    from slurmft.submit import dispatch\n", "submit/dispatch.py": ""},
     "slurmft.plan.checks (plan) imports slurmft.submit.dispatch (submit)"),
    ({"watch/status.py": "from slurmft.submit.cancel import x\n", "submit/cancel.py": ""},
     "slurmft.watch.status (watch) imports slurmft.submit.cancel (submit)"),
    ({"job/train.py": "from slurmft.plan import checks\n", "plan/checks.py": ""},
     "slurmft.job.train (job) imports slurmft.plan.checks (plan)"),
    ({"job/train.py": "import slurmft.cli\n", "cli.py": ""},
     "slurmft.job.train (job) imports slurmft.cli (cli)"),
    ({"config.py": "from .watch.status import x\n", "watch/status.py": ""},
     "slurmft.config (ground) imports slurmft.watch.status (watch)"),
])
def test_the_checker_sees_a_broken_rule(tmp_path: Path, files: dict[str, str], broken: str) -> None:
    assert broken in broken_rules(_tree(tmp_path, files))


def test_a_type_checking_import_is_no_arrow(tmp_path: Path) -> None:
    pkg = _tree(tmp_path, {"plan/checks.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                             "    from slurmft.submit.dispatch import x\nelse:\n    import slurmft.watch.status\n",
                           "submit/dispatch.py": "", "watch/status.py": ""})
    assert broken_rules(pkg) == ["slurmft.plan.checks (plan) imports slurmft.watch.status (watch)"]


def test_the_checker_sees_a_circle_through_a_local_import(tmp_path: Path) -> None:
    pkg = _tree(tmp_path, {"plan/checks.py": "from slurmft.plan.estimate import f\n",
                           "plan/estimate.py": "def f():\n    from slurmft.plan import checks\n"})
    assert circles(pkg) == [["slurmft.plan.checks", "slurmft.plan.estimate"]]
