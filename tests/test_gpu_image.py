"""bench/gpu_image.py: the lent GPU machine's package list against what the job imports, in this environment
(no download: bench/gpu_wheels.sh does that with the list this derives)."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import pytest
from bench_module import load_bench
from packaging.requirements import Requirement


@pytest.fixture(scope="module")
def gi():
    return load_bench("gpu_image")


@pytest.fixture(scope="module")
def image(gi):
    return gi.read_image()


def test_the_image_list_records_its_python_and_the_versions_we_plan_around(image) -> None:
    assert image.python.startswith("3.12.")
    assert (image.packages["torch"], image.packages["transformers"], image.packages["accelerate"]) == \
        ("2.11.0", "5.17.0", "1.15.0")
    assert image.packages["peft"] is None and image.has("PyYAML")  # a name without a version; names as pip compares
    assert not any(image.has(n) for n in ("trl", "datasets", "submitit", "pydantic"))  # the missing four


def test_a_malformed_line_is_named(gi, tmp_path: Path) -> None:
    bad = tmp_path / "list.txt"
    bad.write_text("python==3.12.3\ntorch>=2.11\n")
    with pytest.raises(ValueError, match=r"list.txt:2: 'torch>=2.11' is not NAME or NAME==VERSION"):
        gi.read_image(bad)
    bad.write_text("torch==2.11.0\n")
    with pytest.raises(ValueError, match="names no interpreter"):
        gi.read_image(bad)


def test_the_job_imports_are_read_from_the_source(gi) -> None:
    imports = gi.imported_modules()
    assert "slurmft/job/train.py" in imports["datasets"] and "bench/gpu_smoke.py" in imports["torch"]
    assert "trl" in imports and "submitit" in imports and "pydantic" in imports
    assert not {"os", "json", "slurmft", "gpu_image"} & imports.keys()  # stdlib, this checkout's own


def test_the_carried_wheels_are_what_the_image_lacks_with_everything_they_need(gi, image) -> None:
    carried = dict(gi.carried(image))
    assert {"trl", "datasets", "submitit", "pydantic", "pydantic-core"} <= carried.keys()
    assert not any(image.has(name) for name in carried)  # nothing the image has travels
    assert "torchao" not in carried  # imported only for an optional extra (sr) the smoke does not use
    for name, version in carried.items():
        assert metadata.version(name) == version  # the version this environment's tests ran with
        for text in metadata.requires(name) or []:  # closed: each need is on the image or travels too
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate(image.marker_env()):
                assert image.has(req.name) or gi.canonical(req.name) in carried, (name, text)


def test_optional_imports_are_named_with_their_extra(gi, image) -> None:
    _, skipped = gi.job_distributions(image)
    assert "sr" in skipped["torchao"] and "plot" in skipped["matplotlib"]


def test_an_import_that_no_requirement_provides_is_refused(gi, image, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gi, "imported_modules", lambda: {"leftpad": ["slurmft/job/train.py"]})
    with pytest.raises(SystemExit, match=r"leftpad \(imported by slurmft/job/train.py\)"):
        gi.job_distributions(image)


def test_the_image_needs_are_pinned_where_recorded_and_bounded_by_the_carried_wheels(gi, image) -> None:
    lines, conflicts = gi.image_needs(image)
    assert {"torch==2.11.0", "transformers==5.17.0", "accelerate==1.15.0", "pytest"} <= set(lines)
    pyarrow = next(line for line in lines if line.startswith("pyarrow"))
    assert Requirement(pyarrow).specifier.contains("24.0.0") and not Requirement(pyarrow).specifier.contains("20.0")
    assert conflicts == []  # trl wants transformers >= 4.56.2, the image has 5.17.0
    assert not any(line.split("=")[0].split(">")[0] in ("trl", "datasets") for line in lines)


def test_this_environment_meets_the_jobs_needs(gi, image) -> None:
    """What the smoke records on the device (versions, missing, unmet), here: CI's set has everything."""
    found, missing, _unmet = gi.job_environment(image)
    assert missing == [] and found["trl"] == metadata.version("trl") and "torch" in found


def test_what_is_installed_but_not_listed_is_named(gi) -> None:
    """On the lent machine this names the packages the image's list lacks: here, a list of everything installed
    but pytest names pytest alone."""
    installed = {gi.canonical(d.metadata["Name"]): d.version for d in metadata.distributions() if d.metadata["Name"]}
    listed = gi.Image("3.12.3", {name: version for name, version in installed.items() if name != "pytest"})
    assert gi.unlisted(listed) == ["pytest"]
