"""The package's structure holds its rules (docs/design/structure.py): no import circle, no
import up a layer, no unlisted function-local import, and docs/design/structure.md is current;
and what a distribution of it ships beside the code: py.typed and the license."""
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_structure_rules_hold_and_the_drawing_is_current():
    result = subprocess.run([sys.executable, str(ROOT / "docs" / "design" / "structure.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_package_ships_py_typed_and_the_mit_license():
    """Type checkers read the hints of a package with py.typed (PEP 561), which package-data
    must ship; the license is MIT, as LICENSE says and the metadata declares (PEP 639)."""
    tomllib = pytest.importorskip("tomllib")
    assert resources.files("epifuse").joinpath("py.typed").is_file()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["epifuse"]
    assert project["project"]["license"] == "MIT" and project["project"]["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License") and "Copyright (c) 2026 the epifuse authors" in text
