from __future__ import annotations

from batchgen.core.params import GenParams
from batchgen.core.records import MediaRef
from batchgen.input.parse import check_params, parse_row
from batchgen.input.read import RawRow


def parse(value, defaults=None):
    return parse_row(RawRow(index=0, line=1, value=value), defaults or GenParams())


def test_flat_media_come_first_in_the_user_turn():
    job, problems = parse({"prompt": "What?", "image": "a.png", "video": ["v.mp4"], "system": "Short."})
    assert problems == []
    assert job.media == [MediaRef("image", "a.png"), MediaRef("video", "v.mp4")]
    assert job.messages == [
        {"role": "system", "content": "Short."},
        {
            "role": "user",
            "content": [
                {"type": "image", "media": 0},
                {"type": "video", "media": 1},
                {"type": "text", "text": "What?"},
            ],
        },
    ]


def test_message_parts_keep_their_order_and_all_reference_forms():
    content = [
        {"type": "text", "text": "A"},
        {"type": "image_url", "image_url": {"url": "http://x/1.png"}},
        {"type": "image_url", "image_url": "data:image/png;base64,AAAA"},
        {"type": "image", "image": "local.jpg"},
        {"type": "video_url", "video_url": {"url": "clip.mp4"}},
        {"type": "audio", "audio": "speech.wav"},
        {"type": "text", "text": "B"},
    ]
    job, problems = parse({"messages": [{"role": "user", "content": content}]})
    assert problems == []
    assert [p["type"] for p in job.messages[0]["content"]] == [
        "text",
        "image",
        "image",
        "image",
        "video",
        "audio",
        "text",
    ]
    assert [m.source for m in job.media] == [
        "http://x/1.png",
        "data:image/png;base64,AAAA",
        "local.jpg",
        "clip.mp4",
        "speech.wav",
    ]


def test_row_parameters_overlay_run_defaults():
    defaults = GenParams(max_tokens=100, temperature=0.0, stop=("END",))
    job, problems = parse({"prompt": "x", "max_tokens": 5, "stop": "\n", "top_k": 3}, defaults)
    assert problems == []
    assert (job.params.max_tokens, job.params.temperature, job.params.stop, job.params.top_k) == (
        5,
        0.0,
        ("\n",),
        3,
    )


def test_null_values_count_as_absent():
    # Parquet rows carry every column, null where a row has no value.
    job, problems = parse({"prompt": "x", "messages": None, "image": None, "max_tokens": None})
    assert problems == [] and job.media == [] and job.params.max_tokens == 256


def test_problems_name_the_field():
    _, problems = parse({"prompt": "x", "prompt_extra": 1, "top_p": 0, "seed": 1.5, "stop": [""], "id": 1.5})
    fields = {f for f, _ in problems}
    assert fields == {"top_p", "seed", "stop", "id"}
    _, problems = parse({"prompt": "x", "messages": [{"role": "user", "content": "y"}]})
    assert problems == [("prompt", "give either 'prompt' or 'messages', not both")]
    _, problems = parse({"messages": [{"role": "robot", "content": "y"}]})
    assert problems[0][0] == "messages[0]"


def test_check_params_rejects_booleans_as_numbers():
    problems, _ = check_params({"max_tokens": True, "temperature": float("nan")}, GenParams())
    assert [f for f, _ in problems] == ["max_tokens", "temperature"]


def test_scoring_and_logprob_fields_are_checked_and_bounded():
    cases = {
        "top_logprobs": (10**9, "expected an integer in [0, 20]"),
        "logprobs": ("yes", "expected true or false"),
        "choices_to_score": ([""], "expected up to 64 non-empty strings"),
        "score_text": (5, "expected a string"),
        "score_only": (1, "expected true or false"),
    }
    for field, (value, message) in cases.items():
        job, problems = parse({"prompt": "x", field: value})
        assert any(f == field and message in m for f, m in problems), (field, problems)
        assert job.error
    job, problems = parse({"prompt": "x", "choices_to_score": [f"c{i}" for i in range(65)]})
    assert problems and "up to 64" in problems[0][1]
    job, problems = parse({"prompt": "x", "score_only": True})
    assert problems == [
        ("score_only", "nothing to score: give choices_to_score, guided_choice or score_text")
    ]
    job, problems = parse({"prompt": "x", "guided_choice": [f"c{i}" for i in range(100)]})
    assert problems == [] and job.scoring is None  # a long list constrains, unscored
    job, problems = parse({"prompt": "x", "guided_choice": ["a", "b"], "score_text": "t"})
    assert job.scoring.choices == ("a", "b") and job.scoring.text == "t" and job.scoring.asked
    job, problems = parse({"prompt": "x", "guided_choice": ["a", "b"]})
    assert job.scoring.choices == ("a", "b") and not job.scoring.asked  # scored where a lane can
    job, _ = parse({"prompt": "x", "top_logprobs": 3})
    assert job.params.wants_logprobs and not GenParams().wants_logprobs


def test_a_template_reads_dotted_columns_whole_and_never_an_objects_insides():
    """A stage's template names an earlier stage's value by its dotted column
    (`{caption.generated_text}`); a field that walks into a value's `_` attributes is the row's
    error, not a look inside the interpreter."""
    row = {"id": "a", "caption.generated_text": "A red circle.", "title": "x", "tags": ["red", "round"]}

    def filled(template: str):
        return parse_row(RawRow(index=0, line=1, value=row), GenParams(), template)

    job, problems = filled("Does '{caption.generated_text}' fit {title}? First tag: {tags[0]}.")
    assert not problems and job.messages == [
        {"role": "user", "content": "Does 'A red circle.' fit x? First tag: red."}
    ]
    for hostile in ("{title.__class__.__mro__}", "{tags.__len__}", "{title._x}"):
        job, problems = filled(hostile)
        assert problems[:1] == [
            (
                "prompt_template",
                f"cannot fill it (field {hostile[1:-1]!r}: no part of a field starts with '_')",
            )
        ], problems
    job, problems = filled("{caption.missing}")
    assert problems[:1] == [("prompt_template", "missing column 'caption'")]
