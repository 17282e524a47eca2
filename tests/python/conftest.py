"""Fixtures of the Python client's tests: the package from this checkout, and a real attnd
(CPU backend) on a free loopback port, started once per test session and killed at its end.

`--attnd PATH` (ctest passes the built binary) or ATTND_BIN names the daemon; without either,
build/server/attnd is tried, and tests that need the server skip when none is there.
"""
import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The checkout's package, unless the tests run against an installed one (ATTND_INSTALLED=1).
if os.environ.get("ATTND_INSTALLED") != "1":
    sys.path.insert(0, os.path.join(REPO, "client", "python"))


def pytest_addoption(parser):
    parser.addoption("--attnd", default=os.environ.get("ATTND_BIN"),
                     help="the attnd binary to test against")
    parser.addoption("--backend", default=os.environ.get("ATTND_TEST_BACKEND", "cpu"),
                     help="attnd --backend for the session's server (cpu in CI; cuda on a GPU "
                          "machine runs the CUDA_IPC tests too)")


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _die_with_parent():
    # The kernel kills attnd when the test process dies, even by SIGKILL (ctest's timeout).
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class AttndProcess:
    """attnd (CPU backend unless told) on a free loopback port; `address` is host:port."""

    def __init__(self, binary, extra_args=(), attempts=3, backend="cpu"):
        self.log = tempfile.NamedTemporaryFile(prefix="attnd-py-", suffix=".log", delete=False)
        for _ in range(attempts):
            self.port = free_port()
            self.address = f"127.0.0.1:{self.port}"
            self.process = subprocess.Popen(
                [binary, f"--backend={backend}", f"--listen_address={self.address}",
                 "--metrics_address=", "--kv_memory_bytes=268435456", *extra_args],
                stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                preexec_fn=_die_with_parent)
            if self._wait_listening(timeout_seconds=20):
                return
            self.stop()
            if "cannot listen" not in self.log_tail():  # not a port race: give up
                break
        raise RuntimeError(f"attnd did not come up; its log:\n{self.log_tail()}")

    def _wait_listening(self, timeout_seconds):
        deadline = time.monotonic() + timeout_seconds
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return False
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return True
            except OSError:
                time.sleep(0.05)
        return False

    def log_tail(self, lines=30):
        with open(self.log.name, "rb") as f:
            return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")

    def stop(self, timeout_seconds=10):
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_seconds)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def attnd_binary(config):
    binary = config.getoption("--attnd") or os.path.join(REPO, "build", "server", "attnd")
    return binary if os.path.exists(binary) else None


@pytest.fixture(scope="session")
def attnd_bin(request):
    binary = attnd_binary(request.config)
    if binary is None:
        if os.environ.get("CI") == "true":
            pytest.fail("no attnd binary (--attnd or ATTND_BIN)")
        pytest.skip("no attnd binary (--attnd or ATTND_BIN)")
    return binary


@pytest.fixture(scope="session")
def server(attnd_bin, request):
    process = AttndProcess(attnd_bin, ["--step_ttl=20s", "--drain_grace=1s", "--exit_grace=1s"],
                           backend=request.config.getoption("--backend"))
    yield process
    # attnd must have survived everything the tests sent it, and drain cleanly.
    alive = process.process.poll() is None
    code = process.stop()
    assert alive and code == 0, (f"attnd {'exited ' + str(process.process.returncode) if not alive else 'stopped with ' + str(code)} during the tests; its log:\n"
                                 f"{process.log_tail()}")


@pytest.fixture(scope="session")
def client(server):
    import attnd
    with attnd.Client(server.address, timeout=20) as client:
        client.wait_for_ready(10)
        yield client


@pytest.fixture
def cache_name(client, request):
    """A unique cache name, deleted (forced) after the test."""
    name = f"py-{request.node.name}"[:100].replace("[", "-").replace("]", "")
    yield name
    import attnd
    try:
        client.delete_cache(name, force=True)
    except attnd.AttndError:
        pass


def require_extension(client, extension):
    """Skips a test when attnd lacks `extension`; under CI (where attnd is built from this very
    checkout) that is a failure, so the channel tests cannot go quiet."""
    if extension in client.server_info().extensions:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"attnd lacks extension {extension}")
    pytest.skip(f"this attnd has no {extension}")
