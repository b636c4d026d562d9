"""The README's Python API example, run as written (from a copy of the checkout's sample)."""

from __future__ import annotations

import re
import shutil

import pyarrow.parquet as pq
from conftest import ROOT


def test_the_readme_python_example_runs_as_written(tmp_path, monkeypatch, capsys):
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Python API") : readme.index("## Architecture")]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    shutil.copytree(ROOT / "sample_data", tmp_path / "sample_data")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    rows = pq.read_table(tmp_path / "api-results.parquet").to_pylist()
    summary = namespace["summary"]
    assert len(rows) == summary.rows == summary.ok + summary.failed and summary.complete
    assert namespace["code"] == (1 if summary.failed_now else 0)
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith(f"0/{len(rows)} rows, 0 failed, 0 done before")
    assert printed[-1] == f"{summary.ok} ok, {summary.failed} failed, complete: True"
