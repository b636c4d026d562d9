"""The suite is hermetic: every test may connect to loopback only (pytest-socket, from the
pytest settings in pyproject.toml, so a bare `pytest` has it too) and resolve no public name
(conftest's guard), so a URL policy that breaks fails a test instead of sending a packet."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading

import pytest
from conftest import ROOT, PublicNameRefused
from pytest_socket import SocketConnectBlockedError


@pytest.mark.parametrize(
    "address", ["10.0.0.1", "169.254.169.254", "93.184.216.34", "192.168.1.1", "fe80::1"]
)
def test_a_connection_past_loopback_is_refused_by_the_guard_not_the_network(address):
    with pytest.raises(SocketConnectBlockedError):
        socket.create_connection((address, 80), timeout=5)


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_a_loopback_server_is_reached(host):
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        server = socket.socket(family, socket.SOCK_STREAM)
        server.bind((host, 0))
    except OSError:
        pytest.skip(f"no {host} on this machine")
    server.listen(1)
    accepted = threading.Thread(target=lambda: server.accept()[0].close(), daemon=True)
    accepted.start()
    with socket.create_connection((host, server.getsockname()[1]), timeout=5):
        pass
    accepted.join(5)
    server.close()


@pytest.mark.parametrize("name", ["example.com", "huggingface.co", "pypi.org."])
def test_a_public_name_is_never_resolved(name):
    with pytest.raises(PublicNameRefused, match="resolves no public name"):
        socket.getaddrinfo(name, 443)
    assert socket.getaddrinfo("localhost", 80) and socket.getaddrinfo("127.0.0.1", 80)


def test_a_bare_pytest_run_of_a_probe_has_the_guard(tmp_path):
    """The settings travel with the project: a probe test outside tests/, run by pytest with the
    project's configuration, is refused past loopback by the guard's error."""
    probe = tmp_path / "test_probe.py"
    probe.write_text(
        "import socket\n\n"
        "def test_private():\n"
        "    socket.create_connection(('10.0.0.1', 80), timeout=5)\n\n"
        "def test_loopback_server():\n"
        "    s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(1)\n"
        "    socket.create_connection(s.getsockname(), timeout=5).close(); s.close()\n"
    )
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c",
                           str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path), str(probe)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert "SocketConnectBlockedError" in done.stdout, done.stdout[-2000:]
    assert "1 failed, 1 passed" in done.stdout, done.stdout[-2000:]


def test_the_fake_network_sits_on_top_of_both_guards(network):
    """The hostile-fetch tests' fake DNS and routing answer only their own `.test` names and one
    routed address; everything else goes through the guards underneath."""
    assert network._connect.__name__ == "guarded_connect"  # pytest-socket's
    assert network._resolve.__name__ == "guarded"  # conftest's name guard
    with pytest.raises(PublicNameRefused):
        socket.getaddrinfo("example.com", 80)
    with socket.socket() as sock, pytest.raises(AssertionError, match="test tried to reach 10.1.2.3"):
        sock.connect(("10.1.2.3", 80))
