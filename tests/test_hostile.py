"""A corpus of hostile inputs: every one becomes an error row with the right stage and a
one-line reason, and the run goes on around them."""

from __future__ import annotations

import base64
import json

import cv2
import numpy as np
import pytest
from conftest import MEDIA, MODELS, read, run_cli
from mediaserver import MediaServer
from PIL import Image


pytestmark = pytest.mark.usefixtures("network")  # loopback only; a fake public DNS name


def _files(folder):
    """Media files that are broken in every way a decoder can meet."""
    jpeg = folder / "ok.jpg"
    Image.new("RGB", (64, 64), "red").save(jpeg)
    (folder / "truncated.jpg").write_bytes(jpeg.read_bytes()[:300])
    (folder / "empty.png").write_bytes(b"")
    Image.new("1", (9000, 9000)).save(folder / "bomb.png")  # 81 Mpx in a small file
    (folder / "page.jpg").write_bytes(b"<!doctype html><html><body>hello</body></html>")
    (folder / "noise.mp4").write_bytes(np.random.default_rng(0).bytes(5000))
    writer = cv2.VideoWriter(str(folder / "zero.mp4"), cv2.VideoWriter_fourcc(*"mp4v"), 8, (32, 32))
    writer.release()


def _data_url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def _corpus(server, folder):
    port = server.server_port
    local = f"http://127.0.0.1:{port}"
    img = "media/red_circle.png"
    q = {"prompt": "What is it?"}
    big_data_url = _data_url("image/png", b"\x89PNG" + bytes(300_000))
    cases = [
        ("{not json", "read", "invalid JSON"),
        ('["a", "list"]', "read", "expected a JSON object, got list"),
        ('"just a string"', "read", "expected a JSON object, got str"),
        (b'{"prompt": "caf\xe9"}', "read", "not valid UTF-8"),
        ({"prompt": "x", "max_tokens": "ten"}, "read", "max_tokens: expected a positive integer"),
        ({"prompt": "x", "temperature": -1}, "read", "temperature: expected a number >= 0"),
        ({"prompt": "x", "images": 5}, "read", "images: expected a non-empty string"),
        ({"prompt": "x", "image": ""}, "read", "image: expected a non-empty string"),
        ({"source": "no prompt"}, "read", "prompt: missing"),
        ({"messages": [{"role": "user", "content": [{"type": "sticker"}]}]}, "read",
         "unknown content part type"),
        ({"messages": "hello"}, "read", "messages: expected a non-empty list"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "read", "role in"),
        ({"prompt": "x", "id": 1.5}, "read", "id: expected a string or an integer"),
        ({"prompt": "x", "top_p": 0}, "read", "top_p"),
        ({"prompt": "x", "stop": [""]}, "read", "stop"),
        ({"prompt": "x", "seed": "x"}, "read", "seed"),
        ({"prompt": "x", "video": "media/moving_dot.mp4", "video_fps": 0}, "read", "video_fps"),
        ({"prompt": "word " * 2_000_000}, "generate", "cannot fit the model's context"),
        ({"image": "truncated.jpg", **q}, "decode", "corrupt image"),
        ({"image": "empty.png", **q}, "decode", "not an image"),
        ({"image": "bomb.png", **q}, "decode", "9000x9000 image is over the"),
        ({"image": "page.jpg", **q}, "decode", "not an image"),
        ({"video": "zero.mp4", **q}, "frames", "video"),
        ({"video": "noise.mp4", **q}, "frames", "not a video"),
        ({"image": "data:image/png;base64,@@@@", **q}, "fetch", "invalid base64"),
        ({"image": big_data_url, **q}, "fetch", "over the image cap"),
        ({"image": _data_url("video/mp4", b"0000"), **q}, "fetch", "given as image"),
        ({"image": "missing.png", **q}, "fetch", "no such file"),
        ({"image": "/etc/hostname", **q}, "fetch", "outside the media root"),
        ({"image": f"{local}/img/red_circle.png", **q}, "fetch", "non-public address 127.0.0.1"),
        ({"image": f"http://localhost:{port}/img/red_circle.png", **q}, "fetch", "localhost is local"),
        ({"image": f"http://[::1]:{port}/img/red_circle.png", **q}, "fetch", "non-public address ::1"),
        ({"image": f"http://[::ffff:127.0.0.1]:{port}/x.png", **q}, "fetch",
         "non-public address ::ffff:127.0.0.1"),
        ({"image": "http://10.0.0.1/a.png", **q}, "fetch", "non-public address 10.0.0.1"),
        ({"image": "http://169.254.169.254/latest/meta-data", **q}, "fetch",
         "non-public address 169.254.169.254"),
        ({"image": f"http://0.0.0.0:{port}/a.png", **q}, "fetch", "non-public address 0.0.0.0"),
        ({"image": "http://private.test/a.png", **q}, "fetch", "non-public address 10.1.2.3"),
        ({"image": f"http://public.test:{port}/redirect?to={local}/img/red_circle.png", **q}, "fetch",
         "non-public address 127.0.0.1"),
        ({"image": "file:///etc/passwd", **q}, "fetch", "unsupported scheme 'file'"),
        ({"image": "ftp://example.com/a.png", **q}, "fetch", "unsupported scheme 'ftp'"),
        ({"image": "gopher://example.com/1", **q}, "fetch", "unsupported scheme 'gopher'"),
        ({"audio": "tone.wav", **q}, "generate", "no audio encoder"),
    ]  # fmt: skip
    remote = f"http://public.test:{port}"  # looks public, lands on the loopback server
    cases += [
        (
            {"image": f"{remote}/big?cl=true&size=300000", **q},
            "fetch",
            "Content-Length 300000 is over the image cap",
        ),
        ({"image": f"{remote}/big?cl=false&size=300000", **q}, "fetch", "body over the image cap"),
        ({"image": f"{remote}/big?cl=lie", **q}, "decode", "big?cl=lie"),
        ({"image": f"{remote}/slow", **q}, "fetch", "ReadTimeout"),
        ({"image": f"{remote}/trickle", **q}, "fetch", "download took over"),
        ({"image": f"{remote}/chain/9", **q}, "fetch", "more than 5 redirects"),
        ({"image": f"{remote}/img/missing.png", **q}, "fetch", "HTTP 404"),
        ({"image": f"{remote}/always503", **q}, "fetch", "HTTP 503"),
        ({"image": f"{remote}/html-as-png", **q}, "decode", "not an image"),
    ]
    good = [({"image": img, "prompt": "Fine?"}, None, None), ({"prompt": "Also fine."}, None, None)]
    return good[:1] + cases + good[1:]


def test_every_hostile_row_is_a_clear_row_error_and_the_run_goes_on(workdir):
    import wave

    _files(workdir)
    (workdir / "media" / "x").mkdir()
    with wave.open(str(workdir / "tone.wav"), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000)
        w.writeframes(b"\0\0" * 1600)
    config = workdir / "hostile.yaml"
    config.write_text(
        json.dumps(
            {
                "model": str(MODELS / "tiny-vlm"),
                "text_model": str(MODELS / "tiny-lm"),
                "generation": {"temperature": 0, "max_tokens": 4},
                "media": {"image_bytes": 200_000, "image_timeout": 0.5, "retries": 2,
                          "media_root": str(workdir)},
            }
        )
    )  # fmt: skip
    with MediaServer(MEDIA) as server:
        corpus = _corpus(server, workdir)
        assert len(corpus) >= 45
        lines = []
        for i, (row, _, _) in enumerate(corpus):
            if isinstance(row, dict):
                lines.append(json.dumps({"id": f"case-{i}", **row}).encode())
            else:
                lines.append(row.encode() if isinstance(row, str) else row)
        job = workdir / "jobs.jsonl"
        job.write_bytes(b"\n".join(lines) + b"\n")
        code, output = run_cli(
            "run", str(job), "-o", str(workdir / "out.parquet"), "--config", str(config), "-q"
        )
    assert code == 1, output
    rows = read(workdir / "out.parquet")
    assert len(rows) == len(corpus)
    for row, (_, stage, fragment) in zip(rows, corpus, strict=True):
        if stage is None:
            assert row["status"] == "ok", row["error"]
            continue
        assert row["status"] == "error", (row["id"], fragment)
        assert (row["error_stage"], fragment in row["error"]) == (stage, True), (row["id"], row["error"])
        assert "\n" not in row["error"] and len(row["error"]) < 400
