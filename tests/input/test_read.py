"""The reader: marks let reading start anywhere the scan noted, with the same rows as from the top."""

from __future__ import annotations

import csv
import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.execution.ray import pending_items, wanted_rows
from batchgen.input.read import RowPicker, iter_rows, scan
from batchgen.output.resume import Pending


def _jsonl(path):
    lines = [json.dumps({"id": f"r{i}", "prompt": "é" * i}) for i in range(300)]
    body = "".join(line + "\n" + ("\n" if i % 7 == 0 else "") for i, line in enumerate(lines))
    path.write_bytes(b"\xef\xbb\xbf" + body.encode() + b"{broken\n")
    return path


def _csv(path, terminator):
    buf = io.StringIO(newline="")
    writer = csv.writer(buf, lineterminator=terminator, quoting=csv.QUOTE_ALL)
    writer.writerow(["id", "prompt", "max_tokens"])
    for i in range(200):
        writer.writerow([f"r{i}", "two\nlines" if i % 5 == 0 else f"p{i}", i])
    path.write_bytes(b"\xef\xbb\xbf" + buf.getvalue().encode())
    return path


def _parquet(path):
    pq.write_table(
        pa.table({"id": [f"r{i}" for i in range(230)], "n": list(range(230))}), path, row_group_size=70
    )
    return path


FILES = {
    "jsonl": lambda d: _jsonl(d / "a.jsonl"),
    "csv-crlf": lambda d: _csv(d / "a.csv", "\r\n"),
    "csv-cr": lambda d: _csv(d / "b.csv", "\r"),
    "parquet": lambda d: _parquet(d / "a.parquet"),
}


def _key(rows):
    return [(r.index, r.line, r.value, r.error) for r in rows]


@pytest.mark.parametrize("kind", FILES)
def test_reading_from_any_mark_gives_the_rest_of_the_file(tmp_path, kind):
    path = FILES[kind](tmp_path)
    index = scan(path)
    rows = list(iter_rows(path, index.format))
    assert len(rows) == len(index.ids) and len(index.marks) > 3
    assert rows[0].value["id"] == "r0" and all(r.error is None for r in rows[:-1])
    for mark in index.marks:
        assert _key(iter_rows(path, index.format, mark)) == _key(rows[mark.index :])
    if kind.startswith("csv"):
        assert rows[5].value == {"id": "r5", "prompt": "two\nlines", "max_tokens": 5}
        assert rows[5].line == 9  # the record's last line, as the csv module counts them
    if kind == "jsonl":
        assert rows[-1].error.startswith("invalid JSON") and rows[-1].line == 300 + 43 + 1


def test_items_carry_exactly_the_pending_rows_and_the_picker_reads_them(tmp_path):
    path = _jsonl(tmp_path / "a.jsonl")
    index = scan(path)
    done = {f"r{i}": None for i in range(300) if i % 3 == 0 or 100 <= i < 250}
    todo = Pending(index, done)
    items = pending_items(todo, per_item=10)
    segments = [seg for item in items for seg in item["segments"]]
    picked = [wanted_rows(seg["first"], seg["want"]) for seg in segments]
    assert sum(picked, []) == list(todo.indices()) == [r.index for r in todo.rows()]
    assert all(sum(len(wanted_rows(s["first"], s["want"])) for s in item["segments"]) <= 10 for item in items)
    assert all(b - a <= 64 for p in picked for a, b in zip(p, p[1:], strict=False))
    picker = RowPicker(index.source)
    from batchgen.input.read import Mark

    rows = [
        r for seg, want in zip(segments, picked, strict=True) for r in picker.pick(Mark(*seg["mark"]), want)
    ]
    assert _key(rows) == _key(todo.rows())
