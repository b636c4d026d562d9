from __future__ import annotations

from batchgen.core.records import GenParams, MediaRef
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
        {"role": "user", "content": [
            {"type": "image", "media": 0}, {"type": "video", "media": 1}, {"type": "text", "text": "What?"},
        ]},
    ]  # fmt: skip


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
    assert [m.source for m in job.media] == ["http://x/1.png", "data:image/png;base64,AAAA", "local.jpg",
                                             "clip.mp4", "speech.wav"]  # fmt: skip


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
