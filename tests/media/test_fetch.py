"""The fetch stage against a real server on 127.0.0.1: caps, timeouts, retries, redirects, SSRF."""

from __future__ import annotations

import base64
import time
import urllib.parse

import conftest
import pytest
from conftest import MEDIA
from mediaserver import MediaServer

from batchgen.core.errors import RowError
from batchgen.core.records import MediaRef
from batchgen.core.settings import MediaConfig
from batchgen.media.fetch import Fetcher

pytestmark = pytest.mark.usefixtures("network")  # loopback only; a fake public DNS name


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
    from batchgen.media.images import decode_image

    item = fetcher(tmp_path).fetch(image(f"{server.url}/html-as-png"))
    with pytest.raises(RowError) as e:
        decode_image(item.read(), 10**8)
    assert e.value.stage == "decode" and "not an image" in e.value.message


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


def test_a_redirect_to_a_private_address_is_refused(server, tmp_path):
    f = fetcher(tmp_path, allow_private_urls=False)
    public = f"http://public.test:{server.server_port}"  # looks public, lands on the loopback server
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


def test_the_host_checked_is_the_host_connected_to(server, tmp_path, network):
    f = fetcher(tmp_path, allow_private_urls=False)
    port = server.server_port
    # urlsplit reads example.com here, urllib3 127.0.0.1: refused before any connection.
    fails(f, f"http://127.0.0.1:{port}\\@example.com/img/red_circle.png", "refused", "'\\\\'")
    fails(f, f"http://public.test:{port}/a b.png", "refused", "' '")
    fails(f, f"http://u:p@public.test:{port}/img/red_circle.png", "credentials")
    fails(f, "http://[::1/a.png", "malformed URL")
    fails(f, "http://1.2.3.4:99999/a.png", "malformed URL")
    assert network.connects == [] and sum(server.hits.values()) == 0


def test_a_rebinding_dns_answer_is_never_connected_to(server, tmp_path, network):
    """The name resolves public for the check, private afterwards: the connection goes to
    the checked address, and the server sees the URL's host."""
    network.dns["rebind.test"] = [conftest.PUBLIC_IP, "10.1.2.3"]
    f = fetcher(tmp_path, allow_private_urls=False)
    url = f"http://rebind.test:{server.server_port}"
    assert f.fetch(image(f"{url}/img/red_circle.png")).read()[:4] == b"\x89PNG"
    assert network.lookups["rebind.test"] == 1 and network.connects == [conftest.PUBLIC_IP]
    assert server.hosts == [f"rebind.test:{server.server_port}"]
    # Every redirect hop is resolved and checked again: the next answer is private.
    fails(f, f"{url}/redirect?to=/img/red_circle.png", "non-public address 10.1.2.3")


@pytest.mark.parametrize(
    "host",
    ["[::127.0.0.1]", "[64:ff9b::7f00:1]", "[2002:7f00:1::]", "[::ffff:0:7f00:1]", "[64:ff9b::a9fe:a9fe]",
     "[2002:a9fe:a9fe::]", "[64:ff9b:1::a00:1]", "[2001:0:4136:e378:8000:63bf:80ff:fffe]"],
)  # fmt: skip
def test_ipv6_forms_of_private_ipv4_addresses_are_refused(tmp_path, host, network):
    fails(fetcher(tmp_path, allow_private_urls=False), f"http://{host}/a.png", "non-public address")
    assert network.connects == []


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "1e400", "soon", "Wed, 21 Oct 2015 07:28:00 GMT"])
def test_a_nonsense_retry_after_is_a_short_wait_not_a_crash(server, tmp_path, value):
    f = fetcher(tmp_path)
    t0 = time.monotonic()
    url = f"{server.url}/retry-after/{len(value)}?v={urllib.parse.quote(value)}"
    assert f.fetch(image(url)).read()[:4] == b"\x89PNG"
    assert time.monotonic() - t0 < 5 and f.retries == 1


def test_a_redirect_to_a_malformed_url_is_a_fetch_error(server, tmp_path):
    fails(fetcher(tmp_path), f"{server.url}/redirect?to=http://[::1", "malformed")


def test_a_stop_request_ends_a_trickling_download(server, tmp_path):
    import threading

    f = fetcher(tmp_path, image_timeout=30.0)
    threading.Timer(0.3, f.stop.set).start()
    t0 = time.monotonic()
    fails(f, f"{server.url}/trickle", "stopped")
    assert time.monotonic() - t0 < 2 and not list(tmp_path.glob("download-*.part"))


def test_a_dns_failure_is_retried_and_counted_transient(server, tmp_path, network):
    from conftest import PUBLIC_IP

    network.dns["flaky.test"] = [None, PUBLIC_IP]  # the first lookup fails, the next one answers
    f = fetcher(tmp_path, allow_private_urls=False)
    port = server.url.rsplit(":", 1)[1]
    assert f.fetch(image(f"http://flaky.test:{port}/img/red_circle.png")).read()[:4] == b"\x89PNG"
    assert f.retries == 1 and network.lookups["flaky.test"] == 2
    network.dns["down.test"] = [None]  # never answers: a transient failure, for a rerun to retry
    error = fails(
        f, f"http://down.test:{port}/img/red_circle.png", "cannot resolve down.test", "after 3 attempts"
    )
    assert error.transient
