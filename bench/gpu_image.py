"""What the lent GPU machine's image holds, and what the job needs that must travel to it as wheels.

    python bench/gpu_image.py carry          # NAME==VERSION of every wheel that must travel (bench/gpu_wheels.sh)
    python bench/gpu_image.py image-needs    # the image's packages the job needs, pinned where recorded
                                             # (bench/gpu_image_env.sh installs them here)
    python bench/gpu_image.py check          # in the job's Python: the versions found, what is missing or unmet

The lent machine (the device tool's 'cuda' image) has Python 3.12, torch 2.11, transformers 5.17, accelerate
and much more, but not every package the job imports, and nothing can be fetched there: what it lacks travels as
wheels with the working tree. Which ones is derived, never kept by hand, from two sources:

- the image's package list, ``bench/gpu_image_packages.txt`` (names, and versions where recorded);
- what the job imports: every ``import`` statement (function-level ones too) of ``slurmft/`` and of
  ``bench/gpu_smoke.py``, mapped to the distribution that provides the module in the Python running this
  (the project's own environment, ``pip install -e '.[train]'``). Of those, the ones that pyproject's base
  dependencies and its ``train`` extra need (their requirement closure) are the job's; a module that only an
  optional extra provides (``torchao``: ``sr``, ``wandb``, ``flash_attn``: ``flash``) is an optional feature the
  smoke does not use, and an import that no requirement provides at all is an error (declare it).

The wheels to carry are the job's distributions the image lacks, plus everything they require that the image
lacks too (their ``Requires-Dist``, markers evaluated for the image's Python on Linux x86-64; the requirements of
packages the image already has are the image's business, except the extras a carried package asks of them), each
at the version installed here: the version the project's tests ran with.
"""

from __future__ import annotations

import argparse
import ast
import functools
import platform
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
IMAGE_LIST = REPO / "bench" / "gpu_image_packages.txt"
#: What runs on the GPU machine: the package and the smoke that starts it.
JOB_SOURCES = (REPO / "slurmft", REPO / "bench" / "gpu_smoke.py")
#: Files of slurmft that another interpreter runs, never the job's: the serve check's vLLM half, run as a script by
#: ``serve.python``, and lm-eval's command line, by ``eval.python`` (each in a venv of its own; docs/serve-eval.md).
#: Their imports are not the job's.
OTHER_INTERPRETERS = frozenset({REPO / "slurmft" / "job" / "serve_vllm.py", REPO / "slurmft" / "job" / "lm_eval_run.py"})
#: pyproject's extras the smoke's job needs beside the base dependencies.
JOB_EXTRAS = ("train",)
#: Test tools the CPU lane with the image's versions runs (bench/gpu_image_env.sh); the image has them.
LANE_TOOLS = ("pytest", "pytest-xdist")


def canonical(name: str) -> str:
    """A distribution name as pip compares it (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Image:
    """The image's interpreter version and its packages (canonical name -> version, None where unrecorded)."""

    python: str
    packages: dict[str, str | None]

    def has(self, name: str) -> bool:
        return canonical(name) in self.packages

    def marker_env(self, extra: str = "") -> dict[str, str]:
        """What a requirement's marker sees on the image: its Python, Linux on x86-64."""
        return {"python_version": ".".join(self.python.split(".")[:2]), "python_full_version": self.python,
                "implementation_name": "cpython", "platform_python_implementation": "CPython",
                "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix",
                "platform_machine": "x86_64", "extra": extra}


def read_image(path: Path = IMAGE_LIST) -> Image:
    """Parse the image's package list (one ``NAME`` or ``NAME==VERSION`` a line; ``python==`` the interpreter)."""
    python, packages = None, {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, _, version = line.partition("==")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name.strip()):
            raise ValueError(f"{path}:{number}: {raw!r} is not NAME or NAME==VERSION")
        if canonical(name) == "python":
            python = version.strip()
        else:
            packages[canonical(name)] = version.strip() or None
    if not python:
        raise ValueError(f"{path} names no interpreter (a python==X.Y.Z line)")
    return Image(python, packages)


@functools.cache
def imported_modules(sources: tuple[Path, ...] = JOB_SOURCES) -> dict[str, list[str]]:
    """Top-level modules of every absolute import in ``sources`` (files or folders), the standard library's and this
    checkout's own (slurmft, bench/) left out, with the files that import each."""
    files = [f for s in sources for f in (sorted(s.rglob("*.py")) if s.is_dir() else [s]) if f not in OTHER_INTERPRETERS]
    found: dict[str, set[str]] = {}
    for file in files:
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                local = top == "slurmft" or (REPO / "bench" / f"{top}.py").is_file()  # this checkout's own
                if top not in sys.stdlib_module_names and not local:
                    found.setdefault(top, set()).add(str(file.relative_to(REPO)))
    return {module: sorted(files) for module, files in sorted(found.items())}


def _requirements(dist: str, extras: Iterable[str], image: Image) -> list[Requirement]:
    """``dist``'s requirements that apply on the image, for its base (``""`` in ``extras``) and the extras named."""
    out = []
    for text in metadata.requires(dist) or []:
        req = Requirement(text)
        if req.marker is None:
            applies = "" in extras
        else:
            applies = any(req.marker.evaluate(image.marker_env(e)) for e in extras)
        if applies:
            out.append(req)
    return out


def _closure(roots: Iterable[Requirement], image: Image, through_image: bool) -> dict[str, set[str]]:
    """Every distribution ``roots`` need (canonical name -> the extras asked of it), read from the metadata
    installed here; with ``through_image`` False the image's packages add only the extras asked of them."""
    need: dict[str, set[str]] = {}
    todo = list(roots)
    while todo:
        req = todo.pop()
        name = canonical(req.name)
        asked = {""} | set(req.extras)
        new = asked - need.get(name, set())
        if not new:
            continue
        need.setdefault(name, set()).update(new)
        try:
            metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # not installed here: reported by the caller when it matters
        expand = new if through_image or not image.has(name) else new - {""}
        todo.extend(_requirements(name, expand, image))
    return need


@functools.cache
def _providers() -> dict[str, list[str]]:
    return dict(metadata.packages_distributions())


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def job_distributions(image: Image) -> tuple[dict[str, str], dict[str, str]]:
    """(the distributions the job imports and needs -> a module it imports from each,
    the optional ones it may import -> why they do not travel)."""
    project = _pyproject()
    base = [Requirement(r) for r in project["dependencies"]]
    for extra in JOB_EXTRAS:
        base += [Requirement(r) for r in project["optional-dependencies"][extra]]
    needed = _closure(base, image, through_image=True)
    optional: dict[str, str] = {}
    for extra, reqs in project["optional-dependencies"].items():  # the first extra that names it (dev comes last)
        for r in reqs:
            if extra not in JOB_EXTRAS:
                optional.setdefault(canonical(Requirement(r).name), extra)
    providers = _providers()
    job: dict[str, str] = {}
    skipped: dict[str, str] = {}
    undeclared = []
    for module, files in imported_modules().items():
        dists = [canonical(d) for d in providers.get(module, [])] or [canonical(module)]
        hit = [d for d in dists if d in needed]
        if hit:
            job.setdefault(hit[0], module)
        elif any(d in optional for d in dists):
            dist = next(d for d in dists if d in optional)
            skipped[dist] = f"optional (pyproject extra {optional[dist]!r}), not used by the smoke"
        else:
            undeclared.append(f"{module} (imported by {', '.join(files)})")
    if undeclared:
        raise SystemExit("the job imports modules that no requirement of pyproject.toml provides: "
                         + "; ".join(undeclared) + ". Declare them (dependencies or an extra), then run again")
    return job, skipped


def carried(image: Image) -> list[tuple[str, str]]:
    """(name, version installed here) of every wheel the job needs on the image and the image lacks."""
    job, _ = job_distributions(image)
    roots = [Requirement(d) for d in job]
    need = _closure(roots, image, through_image=False)
    missing_here = []
    out = []
    for name in sorted(need):
        if image.has(name):
            continue
        try:
            out.append((name, metadata.version(name)))
        except metadata.PackageNotFoundError:
            missing_here.append(name)
    if missing_here:
        raise SystemExit(f"not installed here, so no version to carry: {', '.join(missing_here)}; run this with "
                         "the project's environment (pip install -e '.[train]')")
    return out


def image_needs(image: Image) -> tuple[list[str], list[str]]:
    """The image's packages the job needs (its imports and what they require through the image) and the lane's
    test tools, as requirements to install elsewhere: ``NAME==VERSION`` where the list records a version, else
    ``NAME`` with what the carried wheels ask of it (``pyarrow>=24.0.0``); and each recorded version that a
    carried wheel's requirement excludes, in words."""
    job, _ = job_distributions(image)
    need = _closure([Requirement(d) for d in job] + [Requirement(t) for t in LANE_TOOLS], image, through_image=True)
    asked: dict[str, list[tuple[str, Requirement]]] = {}
    for name, _version in carried(image):
        for req in _requirements(name, [""], image):
            if image.has(req.name) and req.specifier:
                asked.setdefault(canonical(req.name), []).append((name, req))
    lines, conflicts = [], []
    for name in sorted(n for n in need if image.has(n)):
        version = image.packages[name]
        if version:
            lines.append(f"{name}=={version}")
            conflicts += [f"{by} needs {req}; the image has {name} {version}" for by, req in asked.get(name, [])
                          if not req.specifier.contains(Version(version), prereleases=True)]
        else:
            lines.append(name + ",".join(str(req.specifier) for _, req in asked.get(name, [])))
    return lines, conflicts


def job_environment(image: Image) -> tuple[dict[str, str], list[str], list[str]]:
    """In the running Python: the version of every distribution the job needs (its imports and what they
    require, through the image's packages too), the ones not installed, and each requirement among them that the
    installed versions do not meet, in words."""
    here = Image(platform.python_version(), image.packages)  # markers as this interpreter sees them
    job, _ = job_distributions(here)
    names = sorted(_closure([Requirement(d) for d in job], here, through_image=True))
    found = {n: metadata.version(n) for n in names if _installed(n)}
    problems = []
    for name in found:
        for req in _requirements(name, [""], here):
            if not _installed(req.name):
                continue  # in names too, so reported as not installed
            have = metadata.version(req.name)
            if req.specifier and not req.specifier.contains(Version(have), prereleases=True):
                problems.append(f"{name} {found[name]} needs {req}: {req.name} {have} is installed")
    return found, [n for n in names if n not in found], problems


def unlisted(image: Image) -> list[str]:
    """Distributions installed in the running Python that the image's list does not name, the carried wheels
    apart (on the lent machine: names the list lacks; here: what this set has that the image may not)."""
    carried_here = {canonical(Path(p).name.split("-")[0]) for p in (REPO / ".whl").glob("*.whl")}
    names = {canonical(d.metadata["Name"]) for d in metadata.distributions() if d.metadata["Name"]}
    return sorted(n for n in names if not image.has(n) and n not in carried_here)


def _installed(name: str) -> bool:
    try:
        metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["carry", "image-needs", "check"])
    ap.add_argument("--image", type=Path, default=IMAGE_LIST, help="the image's package list")
    args = ap.parse_args(argv)
    image = read_image(args.image)
    if args.what == "carry":
        for name, version in carried(image):
            print(f"{name}=={version}")
        _, skipped = job_distributions(image)
        for name, why in sorted(skipped.items()):
            print(f"# {name}: {why}", file=sys.stderr)
    elif args.what == "image-needs":
        lines, conflicts = image_needs(image)
        print("\n".join(lines))
        for conflict in conflicts:
            print(f"conflict: {conflict}", file=sys.stderr)
        return 1 if conflicts else 0
    else:  # in the job's Python (the wheels on PYTHONPATH): what it finds, for the image's list, and what is amiss
        found, missing, unmet = job_environment(image)
        print("versions: " + ", ".join(f"{n} {v}" for n, v in found.items()))
        for name in missing:
            print(f"not installed: {name}")
        for problem in unmet:
            print(f"unmet: {problem}")
        print(f"installed, not in the image's list: {', '.join(unlisted(image)) or 'none'}")
        return 1 if missing or unmet else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
