"""A real HTTP server on 127.0.0.1 serving the sample media and misbehaving on request."""

from __future__ import annotations

import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

TYPES = {".png": "image/png", ".jpg": "image/jpeg", ".webp": "image/webp", ".mp4": "video/mp4"}


class MediaServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # a run opens many connections at once; the default 5 drops SYNs

    def __init__(self, media: Path):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.media = media
        self.hits: Counter[str] = Counter()
        self.delay = 0.0  # seconds before every answer (latency)
        self.down = False  # every answer a 503, as from a server being restarted
        self.hosts: list[str | None] = []  # the Host header of every request

    def handle_error(self, request, client_address):  # clients that hang up early are expected
        pass

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_port}"

    def __enter__(self):
        threading.Thread(target=self.serve_forever, args=(0.02,), daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    server: MediaServer
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # keep pytest output clean
        pass

    def _send(self, status: int, body: bytes = b"", ctype: str = "application/octet-stream", headers=None):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        headers = {"Content-Length": str(len(body)), **(headers or {})}
        for k, v in headers.items():
            if v is not None:
                self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        parts = urlsplit(self.path)
        path, query = parts.path, parse_qs(parts.query)
        self.server.hits[path] += 1
        self.server.hosts.append(self.headers.get("Host"))
        hits = self.server.hits[path]
        time.sleep(self.server.delay)
        if self.server.down:
            return self._send(503, b"down for maintenance")
        if path.startswith("/img/") or path == "/video":
            name = "moving_dot.mp4" if path == "/video" else path[len("/img/") :]
            file = self.server.media / name
            if not file.is_file():
                return self._send(404, b"no such file")
            return self._send(200, file.read_bytes(), TYPES.get(file.suffix, "application/octet-stream"))
        if path == "/redirect":
            return self._send(302, headers={"Location": query["to"][0]})
        if path == "/noloc":
            return self._send(302)
        if path.startswith("/chain/"):
            n = int(path.rsplit("/", 1)[1])
            target = f"/chain/{n - 1}" if n > 0 else "/img/red_circle.png"
            return self._send(302, headers={"Location": target})
        if path == "/slow":
            time.sleep(3)
            return self._send(200, b"late")
        if path == "/trickle":
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", "400")
            self.end_headers()
            for _ in range(400):
                try:
                    self.wfile.write(b"x")
                    self.wfile.flush()
                except OSError:
                    return
                time.sleep(0.05)
            return
        if path == "/big":  # 4000 bytes (or ?size=N) against the tests' caps
            body = b"\x89PNG" + b"0" * (int(query.get("size", ["4000"])[0]) - 4)
            mode = query.get("cl", ["true"])[0]
            if mode == "true":
                return self._send(200, body, "image/png")
            if mode == "lie":
                return self._send(200, body, "image/png", {"Content-Length": "10"})
            self.send_response(200)  # no Content-Length: close-delimited body
            self.send_header("Content-Type", "image/png")
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)
            self.close_connection = True
            return
        if path.startswith("/flaky/"):  # 503 the first time, then the image
            if hits == 1:
                return self._send(503, b"busy")
            return self._send(200, (self.server.media / "red_circle.png").read_bytes(), "image/png")
        if path.startswith("/ratelimit/"):
            if hits == 1:
                return self._send(429, b"slow down", headers={"Retry-After": "0.2"})
            return self._send(200, (self.server.media / "red_circle.png").read_bytes(), "image/png")
        if path.startswith("/retry-after/"):  # 503 with a Retry-After of ?v= the first time
            if hits == 1:
                return self._send(503, b"busy", headers={"Retry-After": query["v"][0]})
            return self._send(200, (self.server.media / "red_circle.png").read_bytes(), "image/png")
        if path == "/always503":
            return self._send(503, b"down")
        if path == "/html-as-png":
            return self._send(200, b"<html><body>not an image</body></html>", "image/png")
        return self._send(404, b"not found")
