"""Shared helpers of the e2e tests: free loopback ports, child processes that cannot outlive
the test, bounded waits, and the attnd / Prometheus / buf wrappers.

Every test is a plain script run by ctest (tests/e2e/CMakeLists.txt) with the build tree's
paths as flags; it exits 0 on success, 1 on failure and 77 (ctest's SKIP_RETURN_CODE) only
when a tool cannot be had outside CI. Under CI=true a missing tool is a failure.
"""
import argparse
import atexit
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request

SKIP = 77
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Failure(Exception):
    pass


def check(condition, message):
    if not condition:
        raise Failure(message)


def passed(message):
    print(f"PASS {message}", flush=True)


def skip_or_fail(reason):
    """A tool is missing: fail under CI (the e2e tests must run there), skip elsewhere."""
    banner = "=" * 72
    in_ci = os.environ.get("CI") == "true"
    verdict = "FAILED (CI=true: e2e tools must be installed)" if in_ci else "SKIPPED"
    print(f"{banner}\nE2E TEST {verdict}: {reason}\n"
          f"scripts/test.sh installs the e2e tools (ATTND_E2E_DEPS=1).\n{banner}", flush=True)
    sys.exit(1 if in_ci else SKIP)


def require_yaml():
    try:
        import yaml  # noqa: F401  (Debian python3-yaml; scripts/install-deps.sh installs it)
        return yaml
    except ImportError:
        skip_or_fail(f"{sys.executable} has no PyYAML (Debian package python3-yaml)")


def free_port():
    """A loopback port nobody listens on now. Callers retry if it is taken before use."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(predicate, timeout_seconds, what, interval_seconds=0.2):
    """Polls predicate until it returns a truthy value, which is returned."""
    deadline = time.monotonic() + timeout_seconds
    last_error = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Failure:
            raise
        except Exception as error:  # the thing waited for is not up yet
            last_error = error
        time.sleep(interval_seconds)
    raise Failure(f"timed out after {timeout_seconds}s waiting for {what}"
                  + (f" (last error: {last_error})" if last_error else ""))


# --- child processes -------------------------------------------------------------------------

_children = []
_PR_SET_PDEATHSIG = 1


def _die_with_parent():
    # The kernel kills the child when this test process dies, even by SIGKILL (ctest timeout).
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def spawn(args, log_path, env=None):
    log = open(log_path, "wb")
    process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               env=env, preexec_fn=_die_with_parent)
    process.log_path = log_path
    _children.append(process)
    return process


def stop(process, timeout_seconds=15):
    """SIGTERM, then SIGKILL after the timeout. Returns the exit code."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout_seconds)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode


def tail(path, lines=40):
    try:
        with open(path, "rb") as f:
            return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")
    except OSError:
        return "(no log)"


def _cleanup():
    for process in reversed(_children):
        if process.poll() is None:
            process.kill()
            process.wait()


atexit.register(_cleanup)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))


def run(args, timeout_seconds=120, check_exit=True, input_text=None, env=None):
    """Runs a command to completion; returns CompletedProcess with text stdout/stderr."""
    try:
        result = subprocess.run(args, capture_output=True, text=True, timeout=timeout_seconds,
                                input=input_text, env=env,
                                stdin=None if input_text is not None else subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise Failure(f"{' '.join(args)} did not finish in {timeout_seconds}s")
    if check_exit and result.returncode != 0:
        raise Failure(f"{' '.join(args)} exited {result.returncode}\n"
                      f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}")
    return result


def http_get(url, timeout_seconds=5):
    with urllib.request.urlopen(url, timeout=timeout_seconds) as response:
        return response.read().decode()


# --- attnd -----------------------------------------------------------------------------------

class Attnd:
    """The built attnd on loopback ports picked at run time (CPU backend)."""

    def __init__(self, binary, attnctl, work_dir, extra_args=(), env=None, argv_prefix=None):
        self.binary = binary
        self.attnctl = attnctl
        self.work_dir = work_dir
        self.extra_args = list(extra_args)
        self.env = env
        self.argv_prefix = argv_prefix
        self.process = None

    def start(self, attempts=3):
        for attempt in range(attempts):
            self.grpc_port, self.metrics_port = free_port(), free_port()
            args = [self.binary] if self.argv_prefix is None else list(self.argv_prefix)
            args += self.extra_args + [
                f"--listen_address=127.0.0.1:{self.grpc_port}",
                f"--metrics_address=127.0.0.1:{self.metrics_port}",
            ]
            log = os.path.join(self.work_dir, f"attnd-{attempt}.log")
            self.process = spawn(args, log, env=self.env)
            try:
                wait_until(self._up, 30, f"attnd on ports {self.grpc_port}/{self.metrics_port}")
                print(f"attnd up: grpc 127.0.0.1:{self.grpc_port}, "
                      f"metrics 127.0.0.1:{self.metrics_port}", flush=True)
                return self
            except Failure:
                exited = self.process.poll() is not None
                stop(self.process)
                # A port taken between free_port() and attnd's bind: try new ports.
                if exited and "cannot listen" in tail(log) and attempt + 1 < attempts:
                    continue
                raise Failure(f"attnd did not come up; its log:\n{tail(log)}")
        raise Failure("attnd did not come up")

    def _up(self):
        if self.process.poll() is not None:
            raise Failure(f"attnd exited with {self.process.returncode}")
        http_get(self.metrics_url())
        with socket.create_connection(("127.0.0.1", self.grpc_port), timeout=1):
            return True

    @property
    def address(self):
        return f"127.0.0.1:{self.grpc_port}"

    def metrics_url(self):
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def metrics(self):
        """Parses the exposition into {(name, frozenset(labels)): value}."""
        samples = {}
        for line in http_get(self.metrics_url()).splitlines():
            if not line or line.startswith("#"):
                continue
            series, value = line.rsplit(" ", 1)
            name, _, labels = series.partition("{")
            pairs = frozenset()
            if labels:
                pairs = frozenset(tuple(p.split("=", 1)) for p in _split_labels(labels.rstrip("}")))
            samples[(name, pairs)] = float(value)
        return samples

    def exported_names(self):
        """Every series name /metrics can carry, from its # TYPE lines and its samples."""
        names = set()
        for line in http_get(self.metrics_url()).splitlines():
            if line.startswith("# TYPE "):
                _, _, name, kind = line.split(" ", 3)
                names.add(name)
                if kind.strip() in ("histogram", "summary"):
                    names.update({f"{name}_bucket", f"{name}_sum", f"{name}_count"})
            elif line and not line.startswith("#"):
                names.add(line.split("{", 1)[0].split(" ", 1)[0])
        return names

    def attnctl_run(self, *args, timeout_seconds=120, check_exit=True):
        return run([self.attnctl, *args, f"--server={self.address}"], timeout_seconds,
                   check_exit=check_exit)

    def stop(self):
        return stop(self.process) if self.process else None


def _split_labels(text):
    parts, current, quoted = [], "", False
    for char in text:
        if char == '"' and not current.endswith("\\"):
            quoted = not quoted
        if char == "," and not quoted:
            parts.append(current)
            current = ""
        else:
            current += char
    if current:
        parts.append(current)
    return [p.replace('"', "") for p in parts]


# --- Prometheus ------------------------------------------------------------------------------

class Prometheus:
    """A real Prometheus (Debian's package) with deploy/prometheus.yml retargeted to attnd."""

    def __init__(self, work_dir):
        self.work_dir = work_dir
        self.binary = shutil.which("prometheus")
        self.promtool = shutil.which("promtool")
        if not self.binary:
            skip_or_fail("prometheus is not installed (Debian package prometheus)")

    def write_config(self, metrics_port):
        """deploy/prometheus.yml with the attnd job pointed at 127.0.0.1:metrics_port."""
        yaml = require_yaml()
        with open(os.path.join(REPO, "deploy", "prometheus.yml")) as f:
            config = yaml.safe_load(f)
        jobs = [job for job in config.get("scrape_configs", []) if job.get("job_name") == "attnd"]
        check(len(jobs) == 1, "deploy/prometheus.yml has no scrape job named 'attnd'")
        job = jobs[0]
        check(job.get("metrics_path", "/metrics") == "/metrics",
              f"the attnd job scrapes {job.get('metrics_path')}, attnd serves /metrics")
        check(len(job.get("static_configs", [])) == 1, "the attnd job has one static_configs entry")
        job["static_configs"][0]["targets"] = [f"127.0.0.1:{metrics_port}"]
        # Scrape fast so the test waits seconds, not the deployment's interval.
        config.setdefault("global", {})["scrape_interval"] = "1s"
        config["global"]["evaluation_interval"] = "1s"
        job.pop("scrape_interval", None)
        path = os.path.join(self.work_dir, "prometheus.yml")
        with open(path, "w") as f:
            json.dump(config, f, indent=2)  # JSON is YAML
        return path

    def start(self, metrics_port, attempts=3):
        config = self.write_config(metrics_port)
        if self.promtool:
            run([self.promtool, "check", "config", config])
        for attempt in range(attempts):
            self.port = free_port()
            data_dir = tempfile.mkdtemp(prefix="tsdb-", dir=self.work_dir)
            log = os.path.join(self.work_dir, f"prometheus-{attempt}.log")
            self.process = spawn([
                self.binary, f"--config.file={config}", f"--storage.tsdb.path={data_dir}",
                f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn",
            ], log)
            try:
                wait_until(self._ready, 60, f"Prometheus ready on 127.0.0.1:{self.port}")
                print(f"prometheus up: 127.0.0.1:{self.port}, scraping 127.0.0.1:{metrics_port}",
                      flush=True)
                return self
            except Failure:
                exited = self.process.poll() is not None
                stop(self.process)
                if exited and "address already in use" in tail(log) and attempt + 1 < attempts:
                    continue
                raise Failure(f"Prometheus did not come up; its log:\n{tail(log)}")
        raise Failure("Prometheus did not come up")

    def _ready(self):
        if self.process.poll() is not None:
            raise Failure(f"prometheus exited with {self.process.returncode}:\n"
                          f"{tail(self.process.log_path)}")
        return "Ready" in http_get(f"http://127.0.0.1:{self.port}/-/ready")

    def query(self, promql):
        """Instant query; returns the result list. Raises Failure on a PromQL error."""
        url = (f"http://127.0.0.1:{self.port}/api/v1/query?"
               + urllib.parse.urlencode({"query": promql}))
        try:
            body = json.loads(http_get(url, timeout_seconds=10))
        except urllib.error.HTTPError as error:
            body = json.loads(error.read().decode() or "{}")
        if body.get("status") != "success":
            raise Failure(f"Prometheus rejected {promql!r}: {body.get('errorType')}: "
                          f"{body.get('error')}")
        return body["data"]["result"]

    def scalar(self, promql):
        """The single sample's value of an instant query, or None when it has no sample."""
        result = self.query(promql)
        if not result:
            return None
        check(len(result) == 1, f"{promql!r} returned {len(result)} series, expected 1")
        return float(result[0]["value"][1])

    def stop(self):
        return stop(self.process)


# --- buf -------------------------------------------------------------------------------------

class Buf:
    """buf from the npm package @bufbuild/buf, installed by tests/e2e/setup-tools.sh."""

    def __init__(self, tools_dir):
        self.binary = os.path.join(tools_dir, "node_modules", ".bin", "buf")
        if not os.access(self.binary, os.X_OK):
            skip_or_fail(f"buf is not installed in {tools_dir} (tests/e2e/setup-tools.sh)")

    def run(self, *args, **kwargs):
        return run([self.binary, *args], **kwargs)

    def curl(self, url, data=None, expect_ok=True, extra=()):
        """buf curl over plaintext HTTP/2 with the gRPC protocol and reflection v1alpha (gRPC
        1.51 serves no v1). Returns parsed JSON of the response (or of the error)."""
        args = ["curl", "--http2-prior-knowledge", "--protocol", "grpc",
                "--reflect-protocol", "grpc-v1alpha", "--timeout", "60s", *extra]
        if data is not None:
            args += ["-d", data if isinstance(data, str) else json.dumps(data)]
        result = self.run(*args, url, check_exit=False)
        if expect_ok:
            check(result.returncode == 0,
                  f"buf curl {url} exited {result.returncode}: {result.stderr.strip()}")
            return json.loads(result.stdout) if result.stdout.strip() else {}
        check(result.returncode != 0, f"buf curl {url} succeeded, expected an error: "
                                      f"{result.stdout.strip()}")
        return json.loads(result.stderr[result.stderr.index("{"):]) if "{" in result.stderr else {}


# --- main ------------------------------------------------------------------------------------

def parse_args(extra=()):
    parser = argparse.ArgumentParser()
    parser.add_argument("--attnd", help="the built attnd binary")
    parser.add_argument("--attnctl", help="the built attnctl binary")
    parser.add_argument("--tools", help="directory with the npm-installed tools (buf)")
    parser.add_argument("--build-dir", help="the CMake build tree")
    for name in extra:
        parser.add_argument(name)
    return parser.parse_args()


def main(test):
    """Runs test(work_dir); prints the children's logs on failure."""
    work_dir = tempfile.mkdtemp(prefix="attnd-e2e-")
    try:
        test(work_dir)
    except Failure as failure:
        print(f"FAIL {failure}", flush=True)
        for process in _children:
            print(f"--- {process.args[0]} log ({process.log_path}) ---\n{tail(process.log_path)}")
        _cleanup()
        sys.exit(1)
    _cleanup()
    shutil.rmtree(work_dir, ignore_errors=True)
