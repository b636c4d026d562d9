"""A stage's keep_if: the rule language keeps the rows it says, and a hostile rule is a clear
error before any work, in bounded time."""

from __future__ import annotations

import time

import pytest

from batchgen.core.errors import ConfigError
from batchgen.core.keep import KeepIf

KNOWN = {"caption", "score", "tags", "width", "title", "w"}
ROW = {
    "caption.generated_text": "A red circle on white.",
    "caption.status": "ok",
    "score.choice_scores.yes": 0.82,
    "score.choice_scores.no": 0.18,
    "width": 640,
    "title": None,
}


@pytest.mark.parametrize(
    ("rule", "kept"),
    [
        ("score.choice_scores.yes > 0.5", True),
        ("score.choice_scores.yes > 0.9", False),
        ("0.5 < score.choice_scores.yes <= 0.9", True),
        ("0.5 < score.choice_scores.yes <= 0.8", False),
        ('"red" in caption.generated_text and caption.status == "ok"', True),
        ('"blue" in caption.generated_text or width >= 1024', False),
        ('not "blue" in caption.generated_text', True),
        ('"blue" not in caption.generated_text', True),
        ("title == null", True),
        ("title != None", False),
        ("title > 3", False),  # null cannot be ordered: not kept, no error
        ('width > "a"', False),  # a number against a text: not kept
        ("tags.answer.tags == null", True),  # a value the row does not have is null
        ("width == -640 or width == 640", True),
        ("width", True),
        ("score.choice_scores.missing", False),
        ("(width > 100) and (width < 1000) and not (score.choice_scores.no > 0.5)", True),
        ("true", True),
        ("false or null", False),
    ],
)
def test_rules_keep_the_rows_they_say(rule, kept):
    assert KeepIf.parse(rule, KNOWN).keeps(ROW) is kept


@pytest.mark.parametrize(
    ("rule", "says"),
    [
        ("caption.__class__.__init__.__globals__", "a name is words joined by dots"),
        ("__import__('os').system('true')", "Call is not part of the rule language"),
        ("width.bit_length()", "Call is not part of the rule language"),
        ("caption[0]", "Subscript is not part of the rule language"),
        ("10 ** 100000 > width", "BinOp is not part of the rule language"),
        ("width > 1" + "0" * 400, "numbers up to"),
        ("width > 1e400", "numbers up to"),
        ("[x for x in width]", "ListComp is not part of the rule language"),
        ("lambda: 1", "Lambda is not part of the rule language"),
        ("width := 3", "is not a rule"),
        ("not " * 40 + "width", "too large a rule"),
        ("(" * 300 + "width" + ")" * 300, "is not a rule (too many nested parentheses)"),
        ("w > 1 and " * 90 + "w > 1", "too large a rule"),
        ("x" * 1001, "a rule holds at most 1000"),
        ("colour > 3", "unknown name(s) colour (known: caption, score, tags, title, w, width)"),
        ("-width > 3", "a minus sign goes before a number only"),
        ("width > 'x' * 3", "BinOp"),
        ("", "a rule is a non-empty text"),
        ("width >", "is not a rule"),
        ("b'bytes' == width", "bytes values are not part of the rule language"),
    ],
)
def test_hostile_rules_are_clear_errors_before_any_work(rule, says):
    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as e:
        KeepIf.parse(rule, KNOWN, where="stage score: keep_if")
    assert says in str(e.value) and str(e.value).startswith("stage score: keep_if: "), str(e.value)
    assert time.perf_counter() - t0 < 1.0


def test_deep_nesting_past_the_parser_is_an_error_not_a_crash():
    with pytest.raises(ConfigError, match="too large a rule|is not a rule"):
        KeepIf.parse("(" * 900 + "1" + ")" * 99, KNOWN)
    with pytest.raises(ConfigError, match="a rule holds at most"):
        KeepIf.parse("-" * 5000 + "1", KNOWN)
