"""Output rows as Arrow tables: the result schema, carried input columns, parts put together.

Input columns are carried beside ours, renamed where they clash and kept as JSON text where
Parquet could not read them back; parts whose column types differ are put together.
"""

from __future__ import annotations

import json
import typing
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from ..core.answers import merge_kinds
from ..core.records import GENERATED, RESULT_COLUMNS, Generation, Result, Values
from ..input.read import JobIndex, id_key

__all__ = [
    "RESULT_SCHEMA",
    "ROW_GROUP_ROWS",
    "ANSWER_PREFIX",
    "is_ours",
    "stage_names",
    "rows_to_table",
    "ordered",
    "concat_tables",
    "dropped_columns",
    "in_order",
]

ROW_GROUP_ROWS = 1024  # readers can stream the output a row group at a time


def _arrow_type(hint: Any) -> pa.DataType:
    """A field's column type from its annotation (`int | None` is a nullable int64)."""
    given = [a for a in typing.get_args(hint) if a is not type(None)]
    hint = given[0] if len(given) == 1 else hint
    return {int: pa.int64(), float: pa.float64(), bool: pa.bool_()}.get(hint, pa.string())


# Our columns typed by their fields' annotations (a row's own, or its Generation's): a new
# metric is one field there and one name in RESULT_COLUMNS.
_HINTS = {
    **typing.get_type_hints(Result),
    **{column: typing.get_type_hints(Generation)[f] for f, column in GENERATED.items()},
}


_TOKEN = [("token", pa.string()), ("id", pa.int64()), ("logprob", pa.float64())]
# `part`: a thinking model's "reasoning" (its markers too) or "answer"; null for other models
LOGPROBS_TYPE = pa.list_(
    pa.struct([*_TOKEN, ("top_logprobs", pa.list_(pa.struct(_TOKEN))), ("part", pa.string())])
)
_SCORED = [("choice", pa.string()), ("logprob", pa.float64()), ("prob", pa.float64()), ("tokens", pa.int64())]
CHOICE_SCORES_TYPE = pa.list_(pa.struct(_SCORED))
MEDIA_FILES_TYPE = pa.list_(
    pa.struct(
        [
            ("kind", pa.string()),
            ("ref", pa.string()),
            ("size", pa.int64()),
            ("mtime_ns", pa.int64()),
            ("sha256", pa.string()),
        ]
    )
)
# OpenAI's tool call: {id, type "function", function: {name, arguments as JSON text}}
TOOL_CALLS_TYPE = pa.list_(
    pa.struct(
        [
            ("id", pa.string()),
            ("type", pa.string()),
            ("function", pa.struct([("name", pa.string()), ("arguments", pa.string())])),
        ]
    )
)
_TYPED = {
    "logprobs": LOGPROBS_TYPE,
    "tool_calls": TOOL_CALLS_TYPE,
    "choice_scores": CHOICE_SCORES_TYPE,
    "media_files": MEDIA_FILES_TYPE,  # core.records.MediaFile
}  # our columns that are not one scalar


RESULT_SCHEMA = pa.schema(  # a Result as Arrow (how Ray's actors hand results back)
    [(name, _TYPED.get(name) or _arrow_type(_HINTS[name])) for name in (*RESULT_COLUMNS[1:], "answer_kinds")]
)
_WRITTEN = [f for f in RESULT_SCHEMA if f.name in RESULT_COLUMNS]


ANSWER_PREFIX = "answer."  # a structured answer's top-level fields: `answer.caption`, `answer.tags`


_SCALAR_TYPES = {"string": pa.string(), "integer": pa.int64(), "number": pa.float64(), "boolean": pa.bool_()}


def _answer_type(kind: str) -> pa.DataType:
    if kind.startswith("list<"):
        return pa.list_(_SCALAR_TYPES[kind[5:-1]])
    return _SCALAR_TYPES.get(kind, pa.string())  # "json": the value as JSON text


def _answers(results: list[Result], union: dict[str, str] | None = None) -> dict[str, pa.Array]:
    """Typed columns of the answers' top-level fields, from each row's schema: the union over
    the job's schemas when the scan found it (`union`: every part and shard of one output
    then types a field alike), else over these rows (a field whose kind differs between
    schemas is kept as JSON text); null where a row's schema lacks the field, its output
    misses it or the row failed."""
    kinds: dict[str, str] = dict(union) if union is not None else {}
    values: list[dict[str, Any]] = []
    for r in results:
        named = dict(json.loads(r.answer_kinds)) if r.answer_kinds else {}
        if union is None:
            merge_kinds(kinds, tuple(named.items()))
        answer = json.loads(r.parsed) if r.parsed and named else None
        values.append({k: v for k, v in answer.items() if k in named} if isinstance(answer, dict) else {})
    columns = {}
    for name, kind in kinds.items():
        cells = [v.get(name) for v in values]
        if kind == "json":
            cells = [None if c is None else json.dumps(c) for c in cells]
        columns[ANSWER_PREFIX + name] = _column(cells, _answer_type(kind))
    return columns


def _jsonish(values: Sequence[object]) -> pa.Array:
    """A column whose values Arrow cannot type as one (mixed types): keep it as JSON text."""
    return pa.array(
        [v if v is None or isinstance(v, str) else json.dumps(v, default=str) for v in values], pa.string()
    )


_MAX_DEPTH = 32  # Parquet levels a carried column may take; readers refuse schemas nested ~100 deep


def _depth(type_: pa.DataType) -> int:
    """Parquet nesting levels of a type (a list takes two); an empty struct, which Parquet
    cannot store at all, counts as too deep."""
    if pa.types.is_struct(type_):
        if type_.num_fields == 0:
            return _MAX_DEPTH + 1
        return 1 + max(_depth(type_.field(i).type) for i in range(type_.num_fields))
    if pa.types.is_map(type_):
        return 3 + max(_depth(type_.key_type), _depth(type_.item_type))
    if pa.types.is_list(type_) or pa.types.is_large_list(type_) or pa.types.is_fixed_size_list(type_):
        return 2 + _depth(type_.value_type)
    return 0


def _column(values: Sequence[object], type_: pa.DataType | None) -> pa.Array:
    """Typed as Arrow infers (or as the input schema says) when Parquet can store and read
    that type back; otherwise the values are kept as JSON text."""
    try:
        array = pa.array(values, type=type_)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OverflowError, RecursionError):
        return _jsonish(values)
    return array if _depth(array.type) <= _MAX_DEPTH else _jsonish(values)


_OURS = set(RESULT_COLUMNS) - {"id"}


def is_ours(name: str) -> bool:
    """A result column (or a structured answer's), not one carried from the job."""
    return name in _OURS or name.startswith(ANSWER_PREFIX)


def stage_names(columns: list[str]) -> list[str]:
    """A staged job's output's stages, in order, from its columns (`caption.status`, …, then
    `dropped_at`); none for a one-stage run's output."""
    if "dropped_at" not in columns:
        return []
    return [c[: -len(".status")] for c in columns if c.endswith(".status") and c.count(".") == 1]


def _output_name(name: str) -> str:
    """An input column named like one of ours (or an answer's) is kept under `input_<name>`;
    one already named `input_<ours>` gains another prefix, so two input columns never meet
    under one name."""
    bare = name
    while bare.startswith("input_"):
        bare = bare[len("input_") :]
    return f"input_{name}" if is_ours(bare) else name


def dropped_columns(index: JobIndex, keep: tuple[str, ...] = (), drop: tuple[str, ...] = ()) -> set[str]:
    """Input columns the output does not carry: those holding bytes (a dataset's images would
    be copied into every output otherwise) unless kept, and those asked to be dropped."""
    return (index.binary - set(keep)) | set(drop)


def rows_to_table(
    rows: list[tuple[Values, Result]],
    schema: pa.Schema | None,
    skip: set[str] | frozenset[str] = frozenset(),
    answers: dict[str, str] | None = None,
) -> pa.Table:
    """Input columns but `skip` (typed by the input schema when there is one), then our
    columns, with `answers` (the job's answer columns and their kinds) when known."""
    input_names: dict[str, None] = {}
    for raw, _ in rows:
        input_names.update(dict.fromkeys(k for k in raw if k != "id" and k not in skip))
    ids = [r.id for _, r in rows]
    columns: dict[str, pa.Array] = {"id": _column(ids, None) if ids else pa.array([], pa.int64())}
    for name in input_names:
        type_ = schema.field(name).type if schema is not None and name in schema.names else None
        columns[_output_name(name)] = _column([raw.get(name) for raw, _ in rows], type_)
    results = [r.columns() for _, r in rows]
    for field in _WRITTEN:
        columns[field.name] = pa.array([r[field.name] for r in results], field.type)
    columns.update(_answers([r for _, r in rows], answers))
    return pa.table(columns)


def ordered(names: list[str]) -> list[str]:
    """An output's columns in their order: the id, the input columns, ours, with the answer
    columns right after `parsed`."""
    answers = [n for n in names if n.startswith(ANSWER_PREFIX)]
    ours: list[str] = []
    for name in RESULT_COLUMNS[1:]:
        ours += [name, *answers] if name == "parsed" else [name]
    return ["id", *[n for n in names if n not in ours and n not in answers and n != "id"], *ours]


def concat_tables(tables: list[pa.Table]) -> pa.Table:
    try:
        return pa.concat_tables(tables, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        # Parts typed a column differently (e.g. int in one, text in another): text wins.
        types: dict[str, set[pa.DataType]] = {}
        for t in tables:
            for f in t.schema:
                types.setdefault(f.name, set()).add(f.type)
        clash = {n for n, ts in types.items() if len({t for t in ts if t != pa.null()}) > 1}
        fixed = []
        for t in tables:
            for name in clash & set(t.column_names):
                i = t.column_names.index(name)
                t = t.set_column(i, name, _jsonish(t.column(name).to_pylist()))
            fixed.append(t)
        return pa.concat_tables(fixed, promote_options="permissive")


def in_order(table: pa.Table, position: dict[str, int]) -> pa.Table:
    """The rows whose ids have a position, each id once (a later row, a retried one, wins), in
    that order."""
    latest: dict[str, int] = {}
    for row, i in enumerate(table.column("id").to_pylist()):
        if id_key(i) in position:
            latest[id_key(i)] = row
    rows = [latest[k] for k in sorted(latest, key=position.__getitem__)]
    if rows != list(range(table.num_rows)):  # usually already in order: no copy then
        table = table.take(pa.array(rows, pa.int64()))
    return table
