"""Running the real `faden` binary from the Python suites (tests/python, tests/gpustack,
tests/vllm): free ports, bounded waits, and `faden server`, `faden worker` and `faden gateway`
processes on 127.0.0.1, each in its own process group, its output in a log file, stopped by
`close()` and killed with the test run if that dies first. Standard library only: every suite's
python can import it (`sys.path` gets `tests/`).

    with FadenServer() as server:
        cluster = server.api("POST", "/v2/clusters", {"name": "c"})
        server.api("POST", "/v2/models", {"name": "m"})
        with FadenWorker(server.url, cluster["registration_token"], "direct", {"m": port}):
            ...  # server.gateway_url/v1 serves model m
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_ports(n: int, host: str = LOOPBACK) -> list[int]:
    ports: list[int] = []
    while len(ports) < n:
        p = free_port(host)
        if p not in ports:
            ports.append(p)
    return ports


class Fatal(Exception):
    """Raised by a `wait_for` predicate to stop waiting at once."""


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.2) -> Any:
    """Polls `predicate` until it returns something truthy (returned), or raises TimeoutError.
    Exceptions raised by `predicate` count as "not yet" (the last one is reported), except
    `Fatal`, which is raised through."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            value = predicate()
            if value:
                return value
            last = value
        except Fatal:
            raise
        except Exception as e:  # noqa: BLE001
            last = e
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")
        time.sleep(interval)


def built_binary(name: str, env_var: str) -> Path:
    """$env_var, else target/debug/<name> of this checkout ($CARGO_TARGET_DIR honoured)."""
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    return Path(os.environ.get(env_var) or target / "debug" / name)


def faden_bin() -> Optional[Path]:
    """The faden binary ($FADEN_BIN, else target/debug/faden of this checkout) if it exists."""
    path = built_binary("faden", "FADEN_BIN")
    return path if path.exists() else None


def log_tail(path: Path, lines: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"<no log: {e}>"


def kill_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def http_json(method: str, url: str, body: Any = None, token: Optional[str] = None,
              timeout: float = 10) -> tuple[int, Any]:
    """(status, parsed JSON body or text) of one request; HTTP errors are answers, not raised."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


# Run beside each process: kills its process group when the test process dies without stopping
# it (pytest killed by a CI timeout, say), so that nothing outlives its test run.
_WATCHDOG = """
import os, signal, sys, time
parent, group = int(sys.argv[1]), int(sys.argv[2])
while os.getppid() == parent:
    time.sleep(0.5)
try:
    os.killpg(group, signal.SIGKILL)
except OSError:
    pass
"""


class Process:
    """`argv` in its own session (one process group with whatever it spawns), stdout and stderr
    in `log_path`; `wait_line(marker)` waits for a log line. `stop()` sends SIGTERM to the group,
    then SIGKILL after `timeout`; a watchdog kills the group if the test process dies first."""

    def __init__(self, argv: list[str], log_path: Path, env: Optional[dict] = None,
                 cwd: Optional[Path] = None):
        self.argv, self.log_path = [str(a) for a in argv], log_path
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                         start_new_session=True)
        self._watchdog = subprocess.Popen(
            [sys.executable, "-c", _WATCHDOG, str(os.getpid()), str(self.proc.pid)],
            stdin=subprocess.DEVNULL, start_new_session=True)

    def wait_line(self, marker: str, timeout: float, what: str) -> str:
        """The first log line containing `marker`; fails at once if the process exits."""

        def line():
            if self.proc.poll() is not None:
                raise Fatal(f"{what}: exited {self.proc.returncode}:\n{self.log_tail()}")
            text = self.log_path.read_text(errors="replace")
            return next((l for l in text.splitlines() if marker in l), None)

        try:
            return wait_for(line, timeout, what, 0.05)
        except TimeoutError as e:
            raise TimeoutError(f"{e}\n{self.log_tail()}") from None

    def log_tail(self, lines: int = 60) -> str:
        return log_tail(self.log_path, lines)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> Optional[int]:
        """Stops the group; the main process's exit code (None if it had to be killed)."""
        code = self.proc.poll()
        if code is None:
            kill_group(self.proc, sig)
            try:
                code = self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                code = None
        # Whatever else is left in the group (children of an engine).
        kill_group(self.proc, signal.SIGKILL)
        if code is None:
            self.proc.wait(10)
        if self._watchdog.poll() is None:
            self._watchdog.kill()
            self._watchdog.wait()
        return code


def log_field(line: str, key: str) -> str:
    """The value of `key=` on a log line of faden's."""
    # Log fields are `key=value`; tracing may colour them, so escape codes are dropped first.
    found = re.search(rf"\b{key}=(\S+)", re.sub(r"\x1b\[[0-9;]*m", "", line))
    if found is None:
        raise Fatal(f"no {key}= on the line: {line}")
    return found.group(1)


class _FadenProcess:
    """A faden subcommand in a temporary directory (its data and its log), removed by `close()`
    unless FADEN_KEEP_LOGS is set."""

    kind = "faden"

    def __init__(self, args: list[str], marker: str, env: Optional[dict] = None, timeout: float = 30):
        binary = faden_bin()
        if binary is None:
            raise Fatal("no faden binary: build it (cargo build -p faden) or set FADEN_BIN")
        self.dir = Path(tempfile.mkdtemp(prefix=f"faden-{self.kind}-"))
        self.log_path = self.dir / f"{self.kind}.log"
        self.process: Optional[Process] = None
        try:
            env = {**os.environ, "FADEN_LOG": "info", **(env or {})}
            env.pop("FADEN_ADMIN_KEY", None)
            self.process = Process([binary, *args], self.log_path, env=env, cwd=self.dir)
            self.proc = self.process.proc
            self.ready_line = self.process.wait_line(marker, timeout, marker)
        except BaseException:
            self.close()
            raise

    def log_tail(self, lines: int = 60) -> str:
        return log_tail(self.log_path, lines)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> Optional[int]:
        return self.process.stop(sig, timeout) if self.process is not None else None

    def close(self) -> None:
        self.stop()
        if os.environ.get("FADEN_KEEP_LOGS"):
            print(f"{self.kind} log kept: {self.log_path}")
        else:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class FadenServer(_FadenProcess):
    """`faden server` on 127.0.0.1 (API, gateway and proxy port: the given ports, 0 = free ones,
    read back from its ready line), a fresh data dir. `admin` is its bootstrap admin key; `api()`
    calls the management API with it."""

    kind = "server"

    def __init__(self, *extra: str, ports: tuple[int, int, int] = (0, 0, 0), env: Optional[dict] = None,
                 timeout: float = 30):
        super().__init__(
            ["server", "--data-dir", "data", "--host", LOOPBACK, "--api-port", str(ports[0]),
             "--port", str(ports[1]), "--proxy-host", LOOPBACK, "--proxy-port", str(ports[2]), *extra],
            "faden server ready", env, timeout)
        api, gateway, proxy = (log_field(self.ready_line, k) for k in ("api", "gateway", "proxy"))
        self.api_port, self.port, self.proxy_port = (int(a.rsplit(":", 1)[1]) for a in (api, gateway, proxy))
        self.url, self.gateway_url = f"http://{api}", f"http://{gateway}"
        self.admin = (self.dir / "data" / "admin.key").read_text().strip()

    def api(self, method: str, path: str, body: Any = None) -> Any:
        """A management API call with the admin key; its JSON answer (raises on an error)."""
        status, answer = http_json(method, f"{self.url}{path}", body, self.admin)
        if status >= 400:
            raise RuntimeError(f"{method} {path} -> {status}: {answer}")
        return answer


class FadenWorker(_FadenProcess):
    """`faden worker` in `mode` (direct, worker or tunnel) serving `instances` ({model: port} on
    127.0.0.1), worker port and metrics port free ones, probing every 200 ms. `id` is its
    worker id."""

    kind = "worker"

    def __init__(self, server_url: str, token: str, mode: str, instances: dict[str, int],
                 *extra: str, name: Optional[str] = None, env: Optional[dict] = None, timeout: float = 30):
        args = ["worker", "--server-url", server_url, "--token", token, "--proxy-mode", mode,
                "--worker-ip", LOOPBACK, "--worker-port", "0", "--worker-metrics-port", "0",
                "--data-dir", "data", "--probe-interval", "200ms", "--name", name or f"worker-{mode}"]
        for model, port in instances.items():
            args += ["--instance", f"{model}={port}"]
        super().__init__([*args, *extra], "faden worker ready", env, timeout)
        self.id = int(log_field(self.ready_line, "worker_id"))


class FadenGateway(_FadenProcess):
    """A standalone `faden gateway` on 127.0.0.1:0 synced from `server_url` with `token`.
    `url` is its address."""

    kind = "gateway"

    def __init__(self, server_url: str, token: str, *extra: str, env: Optional[dict] = None,
                 timeout: float = 30):
        super().__init__(["gateway", "--server-url", server_url, "--token", token, "--host", LOOPBACK,
                          "--port", "0", *extra], "faden gateway ready", env, timeout)
        self.addr = log_field(self.ready_line, "gateway")
        self.url = f"http://{self.addr}"
