"""The package type-checks clean: mypy with the settings in pyproject.toml, run by the test
command, so `.ci/run` runs it too (a first run takes about 40 s on 2 cores; then its cache)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import ROOT


@pytest.mark.slow  # mypy over the package (2 s)
def test_the_package_type_checks_clean():
    done = subprocess.run(
        [sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "Success: no issues found" in done.stdout
