"""The package's structure holds its rules (docs/design/structure.py): no import circle, no
import up a layer, no unlisted function-local import, and docs/design/structure.md is current."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_structure_rules_hold_and_the_drawing_is_current():
    result = subprocess.run([sys.executable, str(ROOT / "docs" / "design" / "structure.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
