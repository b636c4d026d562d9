"""A structured answer's top-level fields as typed output columns: typed from each row's
schema, the union over rows with different schemas, JSON text where kinds clash or the
schema gives no simple type, nothing for schemas whose names could not be columns."""

from __future__ import annotations

import json

import pyarrow as pa

from batchgen.core.answers import answer_kinds
from batchgen.core.params import Constraint
from batchgen.core.records import Generation, Result
from batchgen.output.tables import rows_to_table


def _result(row_id: str, schema: dict, answer: dict | None) -> Result:
    kinds = answer_kinds(Constraint("json_schema", json.dumps(schema)))
    return Result(id=row_id, status="ok" if answer is not None else "error",
                  parsed=json.dumps(answer) if answer is not None else None,
                  answer_kinds=json.dumps(kinds) if kinds else None)  # fmt: skip


CAPTION = {"type": "object", "properties": {
    "caption": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
    "score": {"type": "integer"}, "nsfw": {"type": ["boolean", "null"]},
    "colour": {"enum": ["red", "blue"]}, "box": {"type": "array", "items": {"type": "number"}},
    "extra": {"type": "object"}}}  # fmt: skip
RATING = {"type": "object", "properties": {"score": {"type": "string"}, "reason": {"type": "string"}}}


def test_answer_columns_are_typed_by_the_schema_and_unioned_over_rows():
    rows = [
        ({}, _result("a", CAPTION, {"caption": "a cat", "tags": [], "score": 3, "nsfw": False,
                                     "colour": "red", "box": [1, 2.5], "extra": {"k": [1]}})),
        ({}, _result("b", CAPTION, None)),  # failed: nulls
        ({}, _result("c", RATING, {"score": "high", "reason": "sharp"})),
        ({}, Result(id="d", generation=Generation(text="free text", finish_reason="stop",
                                                  prompt_tokens=2, completion_tokens=2))),  # no schema
    ]  # fmt: skip
    table = rows_to_table(rows, None)
    types = {n: table.schema.field(n).type for n in table.column_names if n.startswith("answer.")}
    assert types == {
        "answer.caption": pa.string(), "answer.tags": pa.list_(pa.string()), "answer.score": pa.string(),
        "answer.nsfw": pa.bool_(), "answer.colour": pa.string(), "answer.box": pa.list_(pa.float64()),
        "answer.extra": pa.string(), "answer.reason": pa.string(),
    }  # fmt: skip
    got = {r["id"]: r for r in table.to_pylist()}
    assert got["a"]["answer.tags"] == [] and got["a"]["answer.box"] == [1.0, 2.5]
    assert json.loads(got["a"]["answer.score"]) == 3  # integer in one schema, string in another: JSON text
    assert json.loads(got["a"]["answer.extra"]) == {"k": [1]}
    assert got["c"]["answer.score"] == '"high"' and got["c"]["answer.reason"] == "sharp"
    assert all(got[k][f] is None for k in "bd" for f in types)
    assert "answer_kinds" not in table.column_names


def test_schemas_whose_names_could_not_be_columns_give_none():
    def kinds(schema):
        return answer_kinds(Constraint("json_schema", json.dumps(schema)))

    assert kinds({"type": "object", "properties": {f"p{i}": {} for i in range(65)}}) == ()
    assert kinds({"type": "object", "properties": {"a\nb": {"type": "string"}}}) == ()
    assert kinds({"type": "object", "properties": {"x" * 101: {"type": "string"}}}) == ()
    assert kinds({"type": "array", "items": {"type": "string"}}) == ()
    assert kinds(
        {"type": "object", "properties": {"n": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}}
    ) == (("n", "integer"),)
    assert answer_kinds(Constraint("regex", "a+")) == ()


def test_an_input_column_named_like_an_answer_column_is_kept_apart():
    rows = [({"answer.caption": "given"}, _result("a", CAPTION, {"caption": "made"}))]
    got = rows_to_table(rows, None).to_pylist()[0]
    assert (got["input_answer.caption"], got["answer.caption"]) == ("given", "made")
