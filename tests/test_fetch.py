"""The fetch stage against a real server on 127.0.0.1: caps, timeouts, retries, redirects, SSRF."""

from __future__ import annotations

import base64
import socket
import time

import pytest
from conftest import MEDIA
from mediaserver import MediaServer

import batchgen.fetch as fetch_module
from batchgen.config import MediaConfig
from batchgen.errors import RowError
from batchgen.fetch import Fetcher
from batchgen.records import MediaRef

_real_connect = socket.socket.connect


@pytest.fixture(autouse=True)
def loopback_only(monkeypatch):
    """A guard, not a mock: any connection to a non-loopback address fails the test."""

    def connect(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6):
            host = address[0]
            assert host in ("127.0.0.1", "::1") or host.startswith("127."), f"test tried to reach {host}"
        return _real_connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", connect)


@pytest.fixture
def server():
    with MediaServer(MEDIA) as s:
        yield s


def fetcher(tmp_path, **kw) -> Fetcher:
    config = MediaConfig(**{"allow_private_urls": True, "image_timeout": 1.0, "retries": 3, **kw})
    return Fetcher(config, MEDIA, tmp_path)


def image(url: str) -> MediaRef:
    return MediaRef("image", url)


def fails(f: Fetcher, url: str, *fragments: str, kind: str = "image") -> RowError:
    with pytest.raises(RowError) as e:
        f.fetch(MediaRef(kind, url))
    assert e.value.stage == "fetch"
    for fragment in fragments:
        assert fragment in e.value.message
    return e.value


def test_downloads_an_image_once_per_url(server, tmp_path):
    f = fetcher(tmp_path)
    a = f.fetch(image(f"{server.url}/img/red_circle.png"))
    b = f.fetch(image(f"{server.url}/img/red_circle.png"))
    assert a.read() == (MEDIA / "red_circle.png").read_bytes() and a.path.suffix == ".png"
    assert b is a and server.hits["/img/red_circle.png"] == 1
    assert (f.downloads, f.url_reuses) == (1, 1)


def test_redirects_are_followed_up_to_five(server, tmp_path):
    f = fetcher(tmp_path)
    assert f.fetch(image(f"{server.url}/chain/4")).read()[:4] == b"\x89PNG"  # 5 hops
    fails(f, f"{server.url}/chain/5", "more than 5 redirects")
    fails(f, f"{server.url}/noloc", "without a Location")


def test_oversized_bodies_are_cut_at_the_cap(server, tmp_path):
    f = fetcher(tmp_path, image_bytes=1000)
    fails(f, f"{server.url}/big?cl=true", "Content-Length 4000 is over the image cap of 1000")
    fails(f, f"{server.url}/big?cl=false", "over the image cap of 1000")
    # A Content-Length that lies low never lets more than it announced through.
    item = f.fetch(image(f"{server.url}/big?cl=lie"))
    assert len(item.read()) == 10
    assert f.download_bytes == 10


def test_a_slow_server_times_out_and_a_trickle_meets_the_deadline(server, tmp_path):
    f = fetcher(tmp_path, image_timeout=0.5, retries=1)
    t0 = time.monotonic()
    fails(f, f"{server.url}/slow", "ReadTimeout")
    fails(f, f"{server.url}/trickle", "download took over 0.5 s")
    assert time.monotonic() - t0 < 3


def test_5xx_and_429_are_retried_4xx_is_not(server, tmp_path):
    f = fetcher(tmp_path)
    assert f.fetch(image(f"{server.url}/flaky/a")).read()[:4] == b"\x89PNG"
    assert server.hits["/flaky/a"] == 2
    t0 = time.monotonic()
    assert f.fetch(image(f"{server.url}/ratelimit/a")).read()[:4] == b"\x89PNG"
    assert time.monotonic() - t0 >= 0.2  # Retry-After honoured
    fails(f, f"{server.url}/img/missing.png", "HTTP 404")
    assert server.hits["/img/missing.png"] == 1
    fails(f, f"{server.url}/always503", "HTTP 503", "after 3 attempts")
    assert server.hits["/always503"] == 3
    assert f.retries == 4


def test_a_non_image_body_is_fetched_and_left_to_decode(server, tmp_path):
    from batchgen.decode import decode_image

    item = fetcher(tmp_path).fetch(image(f"{server.url}/html-as-png"))
    with pytest.raises(RowError) as e:
        decode_image(item, 10**8)
    assert e.value.stage == "decode" and "/html-as-png" in e.value.message


@pytest.mark.parametrize(
    "url, reason",
    [
        ("http://127.0.0.1:{port}/img/red_circle.png", "non-public address 127.0.0.1"),
        ("http://localhost:{port}/img/red_circle.png", "localhost is local"),
        ("http://[::1]:{port}/img/red_circle.png", "non-public address ::1"),
        ("http://[::ffff:127.0.0.1]:{port}/img/red_circle.png", "non-public address ::ffff:127.0.0.1"),
        ("http://10.0.0.1/a.png", "non-public address 10.0.0.1"),
        ("http://169.254.169.254/latest/meta-data/", "non-public address 169.254.169.254"),
        ("http://0.0.0.0:{port}/img/red_circle.png", "non-public address 0.0.0.0"),
        ("http://printer.localhost/a.png", "printer.localhost is local"),
        ("file:///etc/passwd", "unsupported scheme 'file'"),
        ("ftp://example.com/a.png", "unsupported scheme 'ftp'"),
        ("gopher://example.com/", "unsupported scheme 'gopher'"),
        ("http:///nohost.png", "URL without a host"),
    ],
)
def test_ssrf_targets_are_refused_by_default(server, tmp_path, url, reason):
    f = fetcher(tmp_path, allow_private_urls=False)
    fails(f, url.format(port=server.server_port), reason)
    assert sum(server.hits.values()) == 0


def test_a_redirect_to_a_private_address_is_refused(server, tmp_path, monkeypatch):
    # Make `public.test` look public to the policy while the connection lands on loopback.
    real_resolve, real_getaddrinfo = fetch_module._resolve, socket.getaddrinfo
    monkeypatch.setattr(
        fetch_module, "_resolve", lambda h, p: ["93.184.216.34"] if h == "public.test" else real_resolve(h, p)
    )
    loopback = {"public.test": "127.0.0.1"}
    monkeypatch.setattr(
        socket, "getaddrinfo", lambda h, *a, **k: real_getaddrinfo(loopback.get(h, h), *a, **k)
    )
    f = fetcher(tmp_path, allow_private_urls=False)
    public = f"http://public.test:{server.server_port}"
    assert f.fetch(image(f"{public}/img/red_circle.png")).read()[:4] == b"\x89PNG"  # allowed
    fails(f, f"{public}/redirect?to={server.url}/img/red_circle.png", "non-public address 127.0.0.1")
    assert server.hits["/redirect"] == 1 and server.hits["/img/red_circle.png"] == 1


def test_media_cache_keeps_downloads_across_runs(server, tmp_path):
    cache = tmp_path / "cache"
    url = f"{server.url}/img/red_circle.png"
    first = fetcher(tmp_path / "run1", media_cache=str(cache))
    (tmp_path / "run1").mkdir()
    digest = first.fetch(image(url)).digest
    assert (cache / "blobs" / digest).read_bytes() == (MEDIA / "red_circle.png").read_bytes()
    (tmp_path / "run2").mkdir()
    second = fetcher(tmp_path / "run2", media_cache=str(cache))
    assert second.fetch(image(url)).digest == digest
    assert server.hits["/img/red_circle.png"] == 1 and second.cache_hits == 1 and second.downloads == 0


def test_data_urls_and_their_errors(tmp_path):
    f = fetcher(tmp_path)
    png = (MEDIA / "red_circle.png").read_bytes()
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    assert f.fetch(image(url)).read() == png
    fails(f, "data:image/png;base64,@@@", "invalid base64")
    fails(f, "data:image/png,plain", "only base64 data URLs")
    fails(fetcher(tmp_path, image_bytes=100), url, "data URL over the image cap of 100 bytes")
    fails(f, "data:video/mp4;base64,AAAA", "a video/mp4 data URL given as image")


def test_local_paths_resolve_against_the_job_folder_and_the_media_root(tmp_path):
    f = fetcher(tmp_path, media_root=str(MEDIA))
    assert f.fetch(image("red_circle.png")).path == MEDIA / "red_circle.png"
    fails(f, "../jobs.jsonl", "outside the media root")
    fails(f, "nope.png", "no such file")
