"""A bounded fuzz run: 2,000 mutated images, videos and JSON lines from a fixed seed go
through one real run; none of them may stop it. Every line comes back as a row, ok or
failed with a known stage and a one-line error."""

from __future__ import annotations

import base64
import io
import json
import random
import shutil

import pytest
from conftest import MEDIA, MODELS, SAMPLE, read, run_cli
from PIL import Image

from batchgen.core.records import STAGES

pytestmark = pytest.mark.slow  # 2,000 mutated inputs through one run

SEED = 20261201
IMAGES, VIDEOS, LINES = 1100, 150, 750


def _mutate(data: bytes, r: random.Random) -> bytes:
    """Byte flips, a cut, an inserted run or a repeated chunk: what broken files look like."""
    b = bytearray(data)
    for _ in range(r.randint(1, 3)):
        choice = r.random()
        if choice < 0.5 and b:
            for _ in range(r.randint(1, 8)):
                b[r.randrange(len(b))] = r.randrange(256)
        elif choice < 0.7 and len(b) > 1:
            del b[r.randrange(1, len(b)) :]
        elif choice < 0.85:
            at = r.randrange(len(b) + 1)
            b[at:at] = r.randbytes(r.randint(1, 64))
        elif b:
            at, size = r.randrange(len(b)), r.randint(1, 256)
            b[at:at] = b[at : at + size] * r.randint(2, 20)
    return bytes(b)


_VALUES = [None, True, -1, 0, 2**64, 1e308, float("nan"), "", "\ud800", "x" * 5000, [], {}, [[[[]]]],
           {"": {"": None}}, "../../etc/passwd", "data:image/png;base64,!!", "http://[::1",
           "~nobody/x"]  # fmt: skip
_KEYS = ["prompt", "image", "images", "video", "messages", "system", "max_tokens", "temperature", "top_p",
         "top_k", "stop", "seed", "chat_template_kwargs", "video_fps", "video_max_frames", "status",
         "body"]  # fmt: skip


def _mutate_line(line: str, r: random.Random) -> bytes:
    """Half the time a value swapped for a hostile one, else the line's bytes mutated."""
    if r.random() < 0.5:
        row = json.loads(line)
        row[r.choice(_KEYS)] = r.choice(_VALUES)
        return json.dumps(row).encode()
    return _mutate(line.encode(), r)


def _seeds() -> dict[str, bytes]:
    out = {name: (MEDIA / name).read_bytes() for name in ("red_circle.png", "green_triangle_rotated.jpg")}
    out["blue_square.webp"] = (MEDIA / "blue_square.webp").read_bytes()
    buf = io.BytesIO()
    frames = [Image.new("P", (24, 24), i) for i in (1, 2, 3)]
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:])
    out["anim.gif"] = buf.getvalue()
    return out


def test_two_thousand_mutated_inputs_never_stop_a_run(tmp_path):
    r = random.Random(SEED)
    for folder in ("shapes", "media"):  # what the sample's rows refer to
        shutil.copytree(SAMPLE / folder, tmp_path / folder)
    media = tmp_path / "m"
    media.mkdir()
    seeds = _seeds()
    video = (MEDIA / "moving_dot.mp4").read_bytes()
    questions = ["What is it?", "Describe it.", "Colour?"]
    lines: list[bytes] = []
    for i in range(IMAGES):
        name = r.choice(sorted(seeds))
        data = _mutate(seeds[name], r)
        if i % 5 == 0:  # some arrive as data URLs
            ref = "data:image/png;base64," + base64.b64encode(data).decode()
        else:
            ref = f"m/{i}{name[name.rindex('.') :]}"
            (tmp_path / ref).write_bytes(data)
        lines.append(json.dumps({"id": f"img-{i}", "image": ref, "prompt": r.choice(questions)}).encode())
    for i in range(VIDEOS):
        (media / f"{i}.mp4").write_bytes(_mutate(video, r))
        lines.append(json.dumps({"id": f"vid-{i}", "video": f"m/{i}.mp4", "prompt": "What moves?"}).encode())
    templates = [line for line in (SAMPLE / "jobs.jsonl").read_text().splitlines() if line.strip()]
    for i in range(LINES):
        row = json.loads(r.choice(templates))
        row["id"] = f"line-{i}-{r.randrange(10**9)}"
        lines.append(_mutate_line(json.dumps(row), r))
    r.shuffle(lines)
    lines = [line.replace(b"\n", b" ") for line in lines]
    job = tmp_path / "fuzz.jsonl"
    job.write_bytes(b"\n".join(lines) + b"\n")
    expected = sum(1 for line in lines if line.strip())
    config = tmp_path / "fuzz.yaml"
    config.write_text(json.dumps({
        "model": str(MODELS / "tiny-vlm"), "text_model": str(MODELS / "tiny-lm"),
        "generation": {"temperature": 0, "max_tokens": 1},
        "media": {"media_root": str(tmp_path), "video_max_frames": 8},
    }))  # fmt: skip

    code, output = run_cli("run", str(job), "-o", str(tmp_path / "out.parquet"), "-c", str(config), "-q")
    if code == 2 and "duplicate id" in output:  # a mutation can make two ids equal: a run-stopper by design
        raise AssertionError(f"seed {SEED} made duplicate ids; pick another seed: {output}")
    assert code in (0, 1), output
    rows = read(tmp_path / "out.parquet")
    assert len(rows) == expected
    failed = [row for row in rows if row["status"] == "error"]
    assert all(row["error_stage"] in STAGES for row in failed)
    assert all("\n" not in row["error"] and len(row["error"]) < 400 for row in failed)
    stages = {row["error_stage"] for row in failed}
    assert {"read", "decode"} <= stages and len(rows) - len(failed) > 100  # the fuzz reached every stage
