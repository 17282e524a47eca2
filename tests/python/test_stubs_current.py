"""The checked-in stubs (client/python/attnd/v1) are what proto/ generates today, and the
package installs with pip from a copy of client/python alone (no proto/, no protoc)."""
import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO

PACKAGE = os.path.join(REPO, "client", "python")
STUBS = ("attnd_pb2.py", "attnd_pb2_grpc.py")


def missing(tool):
    if os.environ.get("CI") == "true":
        pytest.fail(f"{tool} is not installed (scripts/install-deps.sh installs it)")
    pytest.skip(f"{tool} is not installed")


def test_checked_in_stubs_match_the_proto(tmp_path):
    if shutil.which("protoc") is None:
        missing("protoc")
    if shutil.which("grpc_python_plugin") is None and not os.path.exists(
            "/usr/bin/grpc_python_plugin"):
        missing("grpc_python_plugin (protobuf-compiler-grpc)")
    subprocess.run([os.path.join(PACKAGE, "generate_stubs.sh"), str(tmp_path)], check=True)
    for name in STUBS:
        with open(tmp_path / "attnd" / "v1" / name, "rb") as fresh, \
                open(os.path.join(PACKAGE, "attnd", "v1", name), "rb") as checked_in:
            assert fresh.read() == checked_in.read(), (
                f"client/python/attnd/v1/{name} is stale: run client/python/generate_stubs.sh")


def test_pip_installs_the_package_into_a_venv_with_system_site_packages(tmp_path):
    # Debian 12's pip refuses system-wide installs (PEP 668): a venv that sees Debian's grpcio,
    # protobuf and numpy is the supported way. Offline: no index, no build isolation.
    source = tmp_path / "src"
    shutil.copytree(PACKAGE, source, ignore=shutil.ignore_patterns("__pycache__", "build",
                                                                  "*.egg-info"))
    venv = tmp_path / "venv"
    try:
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
                       check=True, capture_output=True, timeout=120)
    except subprocess.CalledProcessError as error:
        missing(f"python3-venv ({error.stderr.decode(errors='replace').strip()[:200]})")
    python = venv / "bin" / "python"
    install = subprocess.run([str(python), "-m", "pip", "install", "--no-index",
                              "--no-build-isolation", "--quiet", str(source)],
                             capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stdout + install.stderr
    probe = subprocess.run(
        [str(python), "-c", "import attnd, attnd.v1.attnd_pb2_grpc; print(attnd.__file__); "
                            "print(attnd.Client, attnd.__version__)"],
        capture_output=True, text=True, cwd=tmp_path, timeout=60,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert probe.returncode == 0, probe.stderr
    assert str(venv) in probe.stdout.splitlines()[0]
