"""The type checker passes on autoplan/ (issue 25): `mypy`, configured in pyproject.toml.

Run as a test so the README's one test command (and .ci/run) covers it. Its cache
(.mypy_cache, ignored by git) makes a second run take seconds.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # the whole pipeline
def test_mypy_is_clean_on_autoplan() -> None:
    pytest.importorskip("mypy")  # the test extra installs it
    done = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Success: no issues found" in done.stdout


def test_no_module_of_autoplan_is_excused_from_a_check() -> None:
    """The per-module exceptions of issue 25 are gone; only packages without types are let off."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 and newer
    overrides = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"].get("overrides", [])
    modules = [name for override in overrides
               for name in ([override["module"]] if isinstance(override["module"], str) else override["module"])]
    assert "transformers.*" in modules  # the read found the overrides
    assert [name for name in modules if name.startswith("autoplan")] == []
