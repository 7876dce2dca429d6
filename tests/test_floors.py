"""tools/floors.py, the exact `==floor` pins CI's floors step installs, and that step's smoke subset."""

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tools.floors import floor_pin, floor_pins

ROOT = Path(__file__).resolve().parent.parent
DEPENDENCIES = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]


def test_every_dependency_is_pinned_at_its_floor_which_its_range_allows():
    pins = [Requirement(p) for p in floor_pins()]
    assert [p.name for p in pins] == [Requirement(d).name for d in DEPENDENCIES]
    for pin, dependency in zip(pins, DEPENDENCIES, strict=True):
        [exact] = pin.specifier
        assert exact.operator == "=="
        assert exact.version in Requirement(dependency).specifier, f"{pin} is outside {dependency}"


@pytest.mark.parametrize("requirement, pin", [
    ("torchdata>=0.10.0,<0.12", "torchdata==0.10.0"),
    ("mlflow[extras] >= 3.9.0, <4", "mlflow[extras]==3.9.0"),
    ("pywin32>=306; sys_platform == 'win32'", "pywin32==306; sys_platform == 'win32'"),
])
def test_the_pin_keeps_extras_and_markers(requirement, pin):
    assert floor_pin(requirement) == pin


@pytest.mark.parametrize("requirement", ["torch", "torch<3", "torch~=2.3", "torch>=2.3,>=2.4"])
def test_a_dependency_without_one_floor_is_refused_with_one_line(tmp_path, requirement):
    (tmp_path / "pyproject.toml").write_text(f'[project]\ndependencies = ["numpy>=1.24.0", "{requirement}"]\n')
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "floors.py"), str(tmp_path / "pyproject.toml")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert r.stdout == ""  # no partial pin list for pip to install
    assert r.stderr == f"floors: error: {requirement!r}: needs exactly one '>=' floor, so CI can install and test it\n"


def smoke_subset() -> list[str]:
    """The node ids in .ci/run's FLOORS_SMOKE array (comments dropped)."""
    text = (ROOT / ".ci" / "run").read_text()
    body = re.search(r"^FLOORS_SMOKE=\(\n(.*?)^\)", text, re.S | re.M).group(1)
    return [line.split("#")[0].strip() for line in body.splitlines() if line.split("#")[0].strip()]


def test_the_floors_smoke_subset_names_tests_that_exist():
    """A renamed test would fail only CI's floors step, late: this says so before a commit."""
    ids = smoke_subset()
    assert len(ids) >= 10
    for node in ids:
        path, _, name = node.partition("::")
        assert (ROOT / path).is_file(), node
        if name:
            defined = {f.name for f in ast.parse((ROOT / path).read_text()).body if isinstance(f, ast.FunctionDef)}
            assert name in defined, f"{node}: no such test in {path}"
