"""The plan over the whole job: share keys from the scan, and the pending rows reordered so each
group's rows meet, within a bounded hold."""

from __future__ import annotations

import json
import random

from conftest import write_jsonl

from batchgen.core.settings import Columns
from batchgen.execution.ray import pending_items, wanted_rows
from batchgen.input.plan import Grouping, share_keys
from batchgen.input.read import NO_SHARE, iter_rows, scan, shard_of
from batchgen.output.resume import Pending

SYSTEM = "You answer questions about pictures in one careful sentence, naming colours. " * 4


def _prompt_major(path, pictures=40, questions=3, extra=()):
    rows = [{"id": f"p{i}-q{k}", "image": f"pic{i}.png", "prompt": f"Question {k}?"}
            for k in range(questions) for i in range(pictures)]  # fmt: skip
    return write_jsonl(path, [*rows, *extra])


def _index(path, columns=None):
    return scan(path, share=share_keys(columns or Columns()))


def _ids(rows):
    return [r.id for r in rows]


def test_prompt_major_rows_come_out_grouped_by_picture_each_once(tmp_path):
    extra = [{"id": "text", "prompt": "alone"}, "{not json",
             {"id": "solo", "image": "only.png", "prompt": "x"}]  # fmt: skip
    path = _prompt_major(tmp_path / "job.jsonl", extra=extra)
    index = _index(path)
    grouping = Grouping(index)
    f = grouping.figures
    assert (f.rows, f.groups, f.grouped, f.largest, f.alone) == (123, 40, 120, 3, 3)
    out = list(grouping.ordered(iter_rows(path), horizon=2**30, chunk=256))
    assert sorted(map(str, _ids(out))) == sorted(map(str, _ids(iter_rows(path))))  # each row once
    seen = [r.id for r in out if str(r.id).startswith("p")]
    for i in range(40):  # each picture's three questions side by side
        at = seen.index(f"p{i}-q0")
        assert seen[at : at + 3] == [f"p{i}-q0", f"p{i}-q1", f"p{i}-q2"]


def test_the_hold_is_bounded_and_a_done_row_is_not_waited_for(tmp_path):
    path = _prompt_major(tmp_path / "job.jsonl", pictures=30)
    index = _index(path)
    # A tiny horizon: groups go as they are once the held rows pass it (the window's order then).
    out = _ids(Grouping(index).ordered(iter_rows(path), horizon=1, chunk=256))
    assert out == _ids(iter_rows(path))
    # chunk 2: a group goes once two of its rows wait.
    out = _ids(Grouping(index).ordered(iter_rows(path), horizon=2**30, chunk=2))
    assert out[:2] == ["p0-q0", "p0-q1"]
    # Rows already done are not waited for: p0's group completes with its second question.
    done = {"p0-q2": None}
    todo = Pending(index, done)
    out = _ids(Grouping(index, done).ordered(todo.rows(), horizon=2**30, chunk=256))
    assert out.index("p0-q1") == out.index("p0-q0") + 1 and "p0-q2" not in out


def test_share_keys_follow_the_media_the_parse_finds(tmp_path):
    rows = [
        {"id": 1, "jpg": "a.png", "prompt": "x"},
        {"id": 2, "jpg": "a.png", "prompt": "y"},
        {"id": 3, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "a.png"}}, {"type": "text", "text": "z"}]}]},
        {"id": 4, "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "q1"}]},
        {"id": 5, "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "q2"}]},
        {"id": 6, "system": "short", "prompt": "q"},
    ]  # fmt: skip
    path = write_jsonl(tmp_path / "job.jsonl", rows)
    index = _index(path, Columns(image=("jpg",)))
    keys = [index.rows.share(i) for i in range(len(index))]
    assert keys[0] == keys[1] == keys[2] != NO_SHARE  # a mapped column and an image part: one picture
    assert keys[3] == keys[4] != keys[0]  # a long system prompt shared
    assert keys[5] == NO_SHARE  # a short one is not worth holding rows for
    unmapped = _index(path)  # without --image-column, `jpg` is data: rows 1 and 2 share nothing
    assert unmapped.rows.share(0) == NO_SHARE


def test_a_shard_holds_every_row_of_its_pictures(tmp_path):
    path = _prompt_major(tmp_path / "job.jsonl", pictures=50)
    shards = []
    for k in range(3):
        index = _index(path).narrow((k, 3))
        shards.append(set(index.ids))
    every = {f"p{i}-q{q}" for i in range(50) for q in range(3)}
    assert sum(map(len, shards)) == 150 and set.union(*shards) == every
    for i in range(50):
        (owner,) = [k for k, ids in enumerate(shards) if f"p{i}-q0" in ids]
        assert all(f"p{i}-q{q}" in shards[owner] for q in range(3))
    assert len({shard_of(f"r{i}", 3) for i in range(30)}) == 3  # rows sharing nothing: by id


def test_ray_items_keep_a_pictures_rows_together(tmp_path):
    rows = [{"id": f"p{i}-q{k}", "image": f"pic{i}.png", "prompt": f"Q{k}"}
            for k in range(3) for i in range(200)]  # fmt: skip
    random.Random(1).shuffle(rows)
    path = write_jsonl(tmp_path / "job.jsonl", rows)
    index = _index(path)
    items = pending_items(Pending(index, {}), per_item=10)
    where = {}
    for n, item in enumerate(items):
        for seg in item["segments"]:
            for i in wanted_rows(seg["first"], seg["want"]):
                where.setdefault(json.loads(json.dumps(index.ids[i])).split("-")[0], set()).add(n)
    assert len(where) == 200 and all(len(items_of) == 1 for items_of in where.values())
    assert sum(len(wanted_rows(s["first"], s["want"])) for it in items for s in it["segments"]) == 600
