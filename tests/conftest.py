from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchgen.cli import main

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "sample_data"
MODELS = SAMPLE / "models"
MEDIA = SAMPLE / "media"


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A job folder holding a copy of the sample media, so relative paths resolve."""
    shutil.copytree(MEDIA, tmp_path / "media")
    return tmp_path


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def run_cli(*args: str) -> tuple[int, str]:
    """`batchgen ARGS` in-process; returns (exit code, stderr + stdout)."""
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result.exit_code, result.output


def batch(job: Path, out: Path, *extra: str) -> tuple[int, str]:
    """A greedy, short, quiet run on the bundled tiny checkpoints."""
    return run_cli(
        "run", str(job), "-o", str(out),
        "--model", str(MODELS / "tiny-vlm"), "--text-model", str(MODELS / "tiny-lm"),
        "--temperature", "0", "--max-tokens", "8", "--quiet", *extra,
    )  # fmt: skip


def read(out: Path) -> list[dict]:
    return pq.read_table(out).to_pylist()
