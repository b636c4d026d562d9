"""The scheduler on plain records: groups together, lanes apart, solo rows alone."""

from __future__ import annotations

from dataclasses import dataclass

from batchgen.generate.schedule import schedule


@dataclass
class Row:
    lane: str
    group: tuple
    solo: bool = False
    span: int = 16
    adapter: str | None = None


def test_rows_of_a_group_run_back_to_back_in_first_seen_order():
    rows = [
        Row("vlm", ("a",)),
        Row("vlm", ("b",)),
        Row("vlm", ("a",)),
        Row("vlm", ("b",)),
        Row("vlm", ("c",)),
    ]
    assert schedule(rows, 8) == [[0, 2, 1, 3, 4]]


def test_batches_are_cut_at_batch_size_and_lanes_never_mix():
    rows = [Row("lm", ("p",)) for _ in range(5)] + [Row("vlm", ("i",)) for _ in range(3)]
    rows.insert(2, Row("vlm", ("i",)))
    batches = schedule(rows, 2)
    assert sorted(i for b in batches for i in b) == list(range(len(rows)))
    assert all(len(b) <= 2 for b in batches)
    assert all(len({rows[i].lane for i in b}) == 1 for b in batches)


def test_solo_rows_run_alone_and_keep_their_place_among_their_group():
    rows = [Row("lm", ("p",)), Row("lm", ("p",), solo=True), Row("lm", ("p",))]
    assert schedule(rows, 4) == [[1], [0, 2]]
    assert schedule([], 4) == []


def test_continuous_runs_put_the_longest_spans_first_and_keep_groups_together():
    rows = [
        Row("lm", ("a",), span=8),
        Row("lm", ("b",), span=64),
        Row("lm", ("a",), span=256),
        Row("lm", ("b",), span=64),
        Row("lm", ("c",), span=8),
    ]
    assert schedule(rows, None) == [[2, 0, 1, 3, 4]]  # group a holds the longest; ties keep their order
    assert schedule(rows, 8) == [[0, 2, 1, 3, 4]]  # static batches keep the window's order


def test_rows_of_different_adapters_never_share_a_run_and_each_adapter_runs_in_one_stretch():
    rows = [Row("lm", ("p",), adapter=a) for a in ("x", None, "x", "y", None, "y", "x")]
    runs = schedule(rows, None, applied="x")
    assert [[rows[i].adapter for i in run] for run in runs] == [["x", "x", "x"], [None, None], ["y", "y"]]
    assert schedule(rows, 2, applied="x") == [[0, 2], [6], [1, 4], [3, 5]]  # x's runs, the base's, y's


def test_the_adapter_the_model_carries_runs_first():
    """A window that goes on with the adapter the last window ended on switches once fewer."""
    rows = [Row("lm", ("p",), adapter=a) for a in ("x", None, "y", "x")]
    runs = schedule(rows, 4, applied="y")
    assert [[rows[i].adapter for i in run] for run in runs] == [["y"], ["x", "x"], [None]]
    assert schedule(rows, 4, applied="z") == [[0, 3], [1], [2]]  # one no row names: as first seen
    assert schedule(rows, 4) == [[1], [0, 3], [2]]  # the model bare: the base's rows first
