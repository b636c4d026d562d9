"""A corpus of hostile inputs: every one becomes an error row with the right stage and a
one-line reason, and the run goes on around them."""

from __future__ import annotations

import base64
import codecs
import io
import json
import os
import random
import struct

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
    # Round two.
    (folder / "fuzzed.dds").write_bytes(_fuzzed_dds())
    (folder / "page.eps").write_bytes(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n")
    for name in ("broken_a.jpg", "broken_b.jpg"):  # the same bytes under two names
        (folder / name).write_bytes(jpeg.read_bytes()[:300])
    (folder / "loop1").symlink_to("loop2")
    (folder / "loop2").symlink_to("loop1")
    for i in range(3):
        Image.new("RGB", (300, 300), (80 * i, 0, 0)).save(folder / f"big{i}.png")
    frames = []
    for i in range(8):
        buf = io.BytesIO()
        Image.new("RGB", (32, 32), (30 * i, 0, 0)).save(buf, "JPEG")
        frames.append(buf.getvalue())
    (folder / "stream.mjpeg").write_bytes(b"".join(frames))  # raw MJPEG: no frame count in a header


def _fuzzed_dds() -> bytes:
    """A 192-byte DDS whose pixel format makes Pillow raise NotImplementedError."""
    r = random.Random(7)
    header = bytearray(r.randbytes(124))
    struct.pack_into("<I", header, 0, 124)
    struct.pack_into("<II", header, 8, r.choice([1, 4, 16, 64]), r.choice([1, 4, 16, 64]))
    struct.pack_into("<I", header, 72, 32)
    return b"DDS " + bytes(header) + r.randbytes(64)


def _nested(depth: int, leaf, key: str | None = None):
    for _ in range(depth):
        leaf = {key: leaf} if key else [leaf]
    return leaf


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
        ({"prompt": "x", "images": 5}, "read", "images: expected a URL, path, data URL, bytes"),
        ({"prompt": "x", "image": ""}, "read", "image: expected a URL, path, data URL, bytes"),
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
    # Round two: parser confusion and rebinding, IPv6 forms of private IPv4, rows that used
    # to stop the run, values no reader could read back, memory bounds, naming.
    cases += [
        ({"image": f"http://127.0.0.1:{port}\\@example.com/img/red_circle.png", **q}, "fetch", "refused"),
        ({"image": f"http://127.0.0.1:{port}\\@public.test/img/red_circle.png", **q}, "fetch", "refused"),
        ({"image": f"http://u:p@public.test:{port}/img/red_circle.png", **q}, "fetch", "credentials"),
        ({"image": "http://public.test:0/img/red_circle.png", **q}, "fetch", "refused"),
        ({"image": f"http://rebind.test:{port}/img/red_circle.png", **q}, None, None),
        ({"image": f"HTTP://PUBLIC.TEST:{port}/img/red_circle.png#top", **q}, None, None),
        ({"image": "http://[::1/a.png", **q}, "fetch", "malformed URL"),
        ({"image": f"{remote}/redirect?to=http://[::1", **q}, "fetch", "malformed"),
        ({"image": f"{remote}/redirect?to={local}\\@public.test/", **q}, "fetch", "refused"),
        ({"image": f"{remote}/redirect?to=file:///etc/passwd", **q}, "fetch", "only http and https"),
        ({"image": f"{remote}/retry-after/a?v=-1", **q}, None, None),
        ({"image": f"{remote}/retry-after/b?v=nan", **q}, None, None),
        ({"image": f"{remote}/retry-after/c?v=inf", **q}, None, None),
        ({"image": f"{remote}/retry-after/d?v=Wed,%2021%20Oct%202015%2007:28:00%20GMT", **q}, None, None),
        ({"image": "http://[::127.0.0.1]/a.png", **q}, "fetch", "non-public address"),
        ({"image": "http://[64:ff9b::7f00:1]/a.png", **q}, "fetch", "non-public address"),
        ({"image": "http://[2002:7f00:1::]/a.png", **q}, "fetch", "non-public address"),
        ({"image": "http://[::ffff:0:7f00:1]/a.png", **q}, "fetch", "non-public address"),
        ({"image": "http://[::169.254.169.254]/a.png", **q}, "fetch", "non-public address"),
        ({"image": "http://[64:ff9b::a9fe:a9fe]/a.png", **q}, "fetch", "non-public address"),
        ({"image": "http://[2002:a9fe:a9fe::]/a.png", **q}, "fetch", "non-public address"),
        ({"image": "http://[::ffff:0:a00:1]/a.png", **q}, "fetch", "non-public address"),
        ({"prompt": "x", "chat_template_kwargs": {}}, None, None),
        ({"prompt": "caf\ud800"}, "read", "lone surrogate"),
        ({"prompt": "x", "note": ["\udcff"]}, "read", "lone surrogate"),
        ({"prompt": "x", "meta": {"\udfff": 1}}, "read", "lone surrogate"),
        ("[" * 100_000 + "]" * 100_000, "read", "nested deeper"),
        ({"prompt": "x", "tree": _nested(63, 1, "k")}, None, None),  # 64 levels with the row: the most
        ({"prompt": "x", "deep_list": _nested(50, 1)}, None, None),
        ({"prompt": "x", "deep_dict": _nested(99, 1, "k")}, "read", "nested deeper than 64 levels"),
        ({"image": "~nosuchuser/a.png", **q}, "fetch", "cannot use this path"),
        ({"image": "a\u0000b.png", **q}, "fetch", "cannot use this path"),
        ({"image": "loop1", **q}, "fetch", "cannot use this path"),
        ({"image": "bad\nname.png", **q}, "fetch", "bad\\nname.png"),
        ({"image": "fuzzed.dds", **q}, "decode", "not an image in an accepted format"),
        ({"image": "page.eps", **q}, "decode", "not an image in an accepted format"),
        ({"image": "broken_a.jpg", **q}, "decode", "broken_a.jpg: corrupt image"),
        ({"image": "broken_b.jpg", **q}, "decode", "broken_b.jpg: corrupt image"),
        ({"images": ["big0.png", "big1.png", "big2.png"], **q}, "decode", "big2.png: 300x300 image is over"),
        ({"images": ["big0.png", "big1.png"], "video": "media/moving_dot.mp4", **q}, "frames",
         "moving_dot.mp4: 6 frames of"),
        ({"video": "stream.mjpeg", **q}, None, None),
        ({"prompt": "x", "id": True}, "read", "id: expected a string or an integer"),
        ({"prompt": "x", "id": {"a": 1}}, "read", "id: expected a string or an integer"),
        ({"prompt": "x", "id": [1]}, "read", "id: expected a string or an integer"),
        ({"prompt": "x", "seed": -1}, "read", "seed: expected an integer in [0, 2**64)"),
        ({"prompt": "x", "seed": 10**23}, "read", "seed: expected an integer in [0, 2**64)"),
        ({"prompt": "x", "status": "mine", "input_status": "also mine"}, None, None),
    ]  # fmt: skip
    good = [({"image": img, "prompt": "Fine?"}, None, None), ({"prompt": "Also fine."}, None, None)]
    return good[:1] + cases + good[1:]


def test_every_hostile_row_is_a_clear_row_error_and_the_run_goes_on(workdir, network, monkeypatch):
    import wave

    _files(workdir)
    (workdir / "media" / "x").mkdir()
    with wave.open(str(workdir / "tone.wav"), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000)
        w.writeframes(b"\0\0" * 1600)
    # A `gs` first on PATH leaves a mark if anything runs Ghostscript on the job's EPS.
    bin_dir = workdir / "bin"
    bin_dir.mkdir()
    (bin_dir / "gs").write_text(f"#!/bin/sh\ntouch {workdir / 'gs-ran'}\nexit 1\n")
    (bin_dir / "gs").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    network.rebinding.add("rebind.test")  # public for the check, private if resolved again
    config = workdir / "hostile.yaml"
    config.write_text(
        json.dumps(
            {
                "model": str(MODELS / "tiny-vlm"),
                "text_model": str(MODELS / "tiny-lm"),
                "generation": {"temperature": 0, "max_tokens": 4},
                "media": {"image_bytes": 200_000, "image_timeout": 0.5, "retries": 2,
                          "media_root": str(workdir), "max_row_pixels": 190_000},
            }
        )
    )  # fmt: skip
    with MediaServer(MEDIA) as server:
        corpus = _corpus(server, workdir)
        assert len(corpus) >= 99  # 54 in round one, 47 in round two
        lines = []
        for i, (row, _, _) in enumerate(corpus):
            if isinstance(row, dict):
                lines.append(json.dumps({"id": f"case-{i}", **row}).encode())
            else:
                lines.append(row.encode() if isinstance(row, str) else row)
        job = workdir / "jobs.jsonl"
        job.write_bytes(codecs.BOM_UTF8 + b"\n".join(lines) + b"\n")  # a BOM before the first row
        code, output = run_cli(
            "run", str(job), "-o", str(workdir / "out.parquet"), "--config", str(config), "-q"
        )
    assert code == 1, output
    rows = read(workdir / "out.parquet")
    assert len(rows) == len(corpus)
    for n, (row, (case, stage, fragment)) in enumerate(zip(rows, corpus, strict=True), start=1):
        if isinstance(case, dict) and "id" in case and not isinstance(case["id"], str):
            assert row["id"] == f"line-{n}"  # an id of another type: named by its line, kept
        if stage is None:
            assert row["status"] == "ok", (row["id"], row["error"])
            continue
        assert row["status"] == "error", (row["id"], fragment)
        assert (row["error_stage"], fragment in row["error"]) == (stage, True), (row["id"], row["error"])
        assert "\n" not in row["error"] and len(row["error"]) < 400
    assert not (workdir / "gs-ran").exists()
    by_id = {r["id"]: r for r in rows}
    both = by_id[f"case-{len(corpus) - 2}"]  # `status` and `input_status` both survive
    assert (both["input_status"], both["input_input_status"], both["status"]) == ("mine", "also mine", "ok")
    deep = by_id[
        f"case-{next(i for i, c in enumerate(corpus) if isinstance(c[0], dict) and 'deep_list' in c[0])}"
    ]
    assert json.loads(deep["deep_list"]) == _nested(50, 1)  # kept, as JSON text Parquet can hold
    # validate runs the reader's checks: it names exactly the rows that fail in `read`, and
    # those whose local media is no file there (they fail in `fetch`).
    code, report = run_cli("validate", str(job))
    named = {int(line.split(":")[1]) for line in report.splitlines() if line.startswith(str(job))}
    paths = ("no such file", "not a regular file", "cannot use this path")
    absent = {
        n
        for n, r in enumerate(rows, start=1)
        if r["error_stage"] == "fetch" and any(p in r["error"] for p in paths)
    }
    assert named == {n for n, r in enumerate(rows, start=1) if r["error_stage"] == "read"} | absent, [
        (n, rows[n - 1]["error"]) for n in named ^ absent if rows[n - 1]["error_stage"] != "read"
    ]
