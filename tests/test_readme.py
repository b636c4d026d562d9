"""The README's Python API example, run as written (from a copy of the checkout's sample)."""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import pyarrow.parquet as pq
from conftest import ROOT, run_cli


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


def test_the_readme_offline_captioning_walkthrough_runs_as_written(tmp_path, monkeypatch):
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("The same steps offline") :]
    script = re.search(r"```bash\n(.*?)```", section, re.S).group(1).replace("\\\n", " ")
    shutil.copytree(ROOT / "sample_data", tmp_path / "sample_data")
    monkeypatch.chdir(tmp_path)
    for line in script.splitlines():
        args = shlex.split(line)
        if args[:2] == ["cp", "-r"]:
            shutil.copytree(args[2], args[3])
            continue
        assert args[0] == "batchgen", line
        code, output = run_cli(*args[1:])
        assert code == 0, (line, output)
    pictures = sorted(p.stem for p in (tmp_path / "dataset").glob("*.png"))
    captions = {p.stem: p.read_text() for p in (tmp_path / "dataset").glob("*.txt")}
    assert sorted(captions) == pictures and len(pictures) == 6
    for stem, caption in captions.items():  # red_circle.png → "ohwx, a red circle"
        assert caption == f"ohwx, a {stem.replace('_', ' ')}\n", (stem, caption)
    metadata = (tmp_path / "dataset-hf" / "metadata.jsonl").read_text().splitlines()
    assert len(metadata) == 6 and (tmp_path / "gallery.html").exists()
    # the filtered export: the pictures the caption's VQAScore kept, and only those
    curated = pq.read_table(tmp_path / "dataset.curated.parquet").to_pylist()
    kept = sorted(Path(r["image"]).name for r in curated if r["dropped_at"] is None)
    assert 0 < len(kept) < 6 and all(r["dropped_at"] in (None, "score") for r in curated)
    metadata = (tmp_path / "dataset-curated" / "metadata.jsonl").read_text().splitlines()
    lines = [json.loads(line) for line in metadata]
    assert sorted(line["file_name"] for line in lines) == kept
    assert sorted(p.name for p in (tmp_path / "dataset-curated").glob("*.png")) == kept
