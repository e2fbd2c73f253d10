"""A real GPUStack server on a private PostgreSQL, all on 127.0.0.1, for interop tests.

Plain Python, no faden dependency. Run it with the GPUStack venv's python
(`scripts/gpustack-venv.sh` prints it): the server is started with `sys.executable`, and the fake
worker and the tunnel client are GPUStack's own classes imported from the same venv. That venv
holds GPUStack 2.3.0 or 2.2.3 (`GPUSTACK_VERSION`). Where they differ the harness does what the
running one needs (`offline_args()`), or what both take (`Admin.create_model`'s backend).

    with Postgres() as pg, GPUStackServer(pg.url) as server:
        admin = Admin(server)                       # logs in, makes an admin API key
        cluster = admin.create_cluster("c1")
        worker = FakeWorker(server.url, admin.registration_token(cluster), "w1").start()
        with MockEngine() as engine:
            model_id, instance_id = admin.run_instance("m1", engine.port, worker)

What GPUStack 2.3.0 does, as used here (read from its source, checked against the server; 2.2.3
does the same unless said otherwise):
- Instances: a `Custom`-backend `local_path` model (nothing to download, no container started by
  anyone) is scheduled by GPUStack's scheduler onto a worker whose status reports a GPU
  (`scheduled`, `worker_ip` = the worker's ip). The worker (here: FakeWorker's token, GPUStack's
  `ModelInstanceClient`, like `serve_manager._update_model_instance`) then GETs the instance and
  PUTs the whole object with `state` `starting` + `port`/`ports`, then `running`. Admin keys
  may PUT the same route (`set_instance_state`). (`POST /v2/model-instances` exists too; the
  harness does not use it.) Two model fields are needed: `env.GPUSTACK_MODEL_VRAM_CLAIM` (else
  the scheduler crashes estimating the weight size of a path that exists nowhere) and
  `enable_model_route` (else the server's own /v1 says "Model not found").
- proxy_mode is not in the admin `PUT /v2/workers/{id}` body (only name/labels/maintenance): the
  worker reports it in `POST /v2/worker-status` (`proxy_mode` field), flushed to the DB every 5 s.
- Tunnel: the worker's `MessageClient` dials `ws://<server>/connect` with its worker token; on
  connect the server sets `worker.proxy_address` to `http://<proxy listen address>:<proxy port>`
  (here `http://127.0.0.1:<proxy_port>`), and clears it (null) on disconnect; after a server
  restart the old value is still there (no disconnect was recorded) and the client reconnects
  by itself (backoff 1 s doubling to 60 s; seen back ~5 s after a restart). Only one connected
  tunnel may claim an address (`<ip>/32`, the worker's own ip; 2.2.3 checks no claim and lets
  the newest take it): give tunnel workers distinct loopback ips (127.0.0.2, 127.0.0.3, ...),
  all routed to `lo` on Linux.
- Proxy port credential: `Proxy-Authorization: Bearer <key>` (or `Authorization`), where key is
  ANY valid, unexpired GPUStack API key (admin/user key, worker token; scope not checked).
  Targets: origin-form with `X-GPUStack-Model-Instance: model-<model_id>-<instance_id>.static`
  (routed to that instance's `worker_ip:ports[0]`), absolute-form `http://ip:port/...`, or
  CONNECT ip:port; the target ip must belong to a connected tunnel (else 502). 401 without key.
- GPUStack's own OpenAI endpoint: `POST <server.url>/v1/chat/completions` with
  `Authorization: Bearer <api key>` is served by the API server itself even with
  `--gateway-mode disabled`; it always goes to the worker's port (`http://<worker ip>:<worker
  port>/v1/...` + `X-GPUStack-Model-Instance`, through the tunnel for tunnel workers), whatever
  the worker's proxy_mode. FakeWorker therefore serves GPUStack's own worker proxy route
  (`gpustack.routes.worker.proxy`) and `/healthz` on its port. The engine then sees
  `Authorization: Bearer <worker token>`, and `stream_options.include_usage` added to streams.
- A worker is `ready` only after the server's 5 s status flush: `FakeWorker.start()` takes 5-10 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Optional

import httpx

# The faden processes and the helpers every Python suite shares (tests/faden_harness.py); the
# tests use them through this module too.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import faden_harness  # noqa: E402
from faden_harness import (  # noqa: E402,F401
    Fatal, free_port, free_ports, kill_group, log_tail, wait_for,
)

HERE = Path(__file__).resolve().parent
LAUNCHER = HERE / "launch_gpustack.py"
LOOPBACK = faden_harness.LOOPBACK
# Label the harness puts on every fake worker; models select their worker by it.
WORKER_LABEL = "faden-harness-worker"
INSTANCE_HEADER = "X-GPUStack-Model-Instance"
GIB = 1024**3


# ---------------------------------------------------------------- small helpers


_loopback_ips = itertools.count(2)


def loopback_ip() -> str:
    """A fresh 127.0.0.N (N = 2, 3, ...; Linux routes all of 127/8 to `lo`). GPUStack lets only
    one connected tunnel claim an ip, so each tunnel worker needs its own."""
    n = next(_loopback_ips)
    return f"127.0.{n // 254}.{n % 254 + 1}" if n > 254 else f"127.0.0.{n}"


def _check(resp: httpx.Response) -> httpx.Response:
    if resp.is_error:
        raise RuntimeError(f"{resp.request.method} {resp.request.url} -> {resp.status_code}: {resp.text[:2000]}")
    return resp


def _gpustack_logging() -> None:
    """GPUStack's code logs with `logger.trace(...)`, a level its `setup_logging()` adds to
    `logging.Logger`. Add just that (not its root-logger set-up) before running its classes
    in this process, or e.g. the tunnel client fails on every message and reconnects."""
    import logging

    if not hasattr(logging.Logger, "trace"):
        from gpustack.logging import TRACE_LEVEL, trace

        logging.addLevelName(TRACE_LEVEL, "TRACE")
        logging.Logger.trace = trace


# ---------------------------------------------------------------- PostgreSQL


def _pg_bin(name: str) -> str:
    candidates = [os.environ.get("FADEN_PG_BIN", ""), "/usr/local/bin"]
    candidates += sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)
    for d in candidates:
        if d and (Path(d) / name).exists():
            return str(Path(d) / name)
    found = shutil.which(name)
    if found:
        return found
    raise FileNotFoundError(f"PostgreSQL binary {name} not found (set FADEN_PG_BIN; apt-get install postgresql)")


# Run by a small process next to each Postgres: stops it and removes its directory if the test
# process dies without doing so (SIGKILL), as the launcher does for GPUStack.
_PG_WATCHDOG = """
import os, shutil, subprocess, sys, time
parent, cmd, root = int(sys.argv[1]), sys.argv[2:-1], sys.argv[-1]
while os.getppid() == parent:
    time.sleep(1)
subprocess.run(cmd, capture_output=True, timeout=60)
shutil.rmtree(root, ignore_errors=True)
"""


class Postgres:
    """A private PostgreSQL cluster: trust auth, 127.0.0.1 on a free port, unix socket in its temp
    dir, database `gpustack`. When run as root, the server runs as user `postgres`."""

    def __init__(self, user: str = "root", database: str = "gpustack", timeout: float = 60):
        self.user, self.database, self.timeout = user, database, timeout
        self.port: Optional[int] = None
        self.root: Optional[Path] = None
        self._watchdog: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"postgresql://{self.user}@{LOOPBACK}:{self.port}/{self.database}?sslmode=disable"

    @staticmethod
    def _prefix() -> list[str]:
        return ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []

    def _run(self, args: list[str], **kw) -> subprocess.CompletedProcess:
        res = subprocess.run(self._prefix() + args, capture_output=True, text=True, timeout=self.timeout, **kw)
        if res.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
        return res

    def start(self) -> "Postgres":
        self.root = Path(tempfile.mkdtemp(prefix="faden-gpustack-pg-"))
        self.root.chmod(0o755)
        data, run = self.root / "data", self.root / "run"  # run: unix socket + log
        for d in (data, run):
            d.mkdir(mode=0o700)
            if os.geteuid() == 0:
                shutil.chown(d, "postgres", "postgres")
        try:
            self._run([_pg_bin("initdb"), "-D", str(data), "-U", self.user, "-A", "trust", "-E", "UTF8", "--no-sync"])
            # No psql/createdb on these machines: create the database in single-user mode.
            self._run([_pg_bin("postgres"), "--single", "-D", str(data), "postgres"],
                      input=f'CREATE DATABASE "{self.database}";\n')
            self.port = free_port()
            opts = (f"-p {self.port} -k {run} -c listen_addresses={LOOPBACK} -c fsync=off "
                    "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200")
            self._run([_pg_bin("pg_ctl"), "-D", str(data), "-l", str(run / "postgres.log"), "-o", opts,
                       "-w", "-t", str(int(self.timeout)), "start"])
            stop = self._prefix() + [_pg_bin("pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"]
            self._watchdog = subprocess.Popen([sys.executable, "-c", _PG_WATCHDOG, str(os.getpid()), *stop,
                                               str(self.root)], stdin=subprocess.DEVNULL, start_new_session=True)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self._watchdog is not None:
            self._watchdog.kill()
            self._watchdog.wait()
            self._watchdog = None
        if self.root is None:
            return
        data = self.root / "data"
        if (data / "postmaster.pid").exists():
            with contextlib.suppress(Exception):
                self._run([_pg_bin("pg_ctl"), "-D", str(data), "-m", "fast", "-w", "-t", "30", "stop"])
        shutil.rmtree(self.root, ignore_errors=True)
        self.root = None

    def __enter__(self) -> "Postgres":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ---------------------------------------------------------------- GPUStack server


def gpustack_version() -> tuple[int, ...]:
    """The release of the GPUStack package in this venv, e.g. (2, 2, 3)."""
    from importlib.metadata import version

    return tuple(int(p) for p in re.match(r"\d+(?:\.\d+)*", version("gpustack")).group().split("."))


GPUSTACK_VERSION = gpustack_version()


def offline_args() -> list[str]:
    """`gpustack start` flags without which GPUStack reaches for the internet at start-up.
    `--ota-server-url` (where 2.3 reads its official content sources) is new in 2.3: 2.2's
    argument parser refuses it."""
    args = ["--disable-builtin-observability", "--disable-update-check",
            "--system-default-container-registry", "docker.io"]
    if GPUSTACK_VERSION >= (2, 3):
        args += ["--ota-server-url", "http://127.0.0.1:9"]
    return args



def gpustack_env(extra: Optional[dict] = None) -> dict:
    """The environment of a GPUStack process: offline, no proxies, loopback exempt, killed with
    the test run (launch_gpustack.py watches FADEN_HARNESS_PARENT)."""
    env = dict(os.environ)
    for k in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        env.pop(k, None)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               NO_PROXY="127.0.0.0/8,localhost", no_proxy="127.0.0.0/8,localhost",
               PYTHONUNBUFFERED="1", FADEN_HARNESS_PARENT=str(os.getpid()))
    env.update(extra or {})
    return env


class GPUStackServer:
    """`gpustack start` (server only, no embedded worker) through launch_gpustack.py, so that the
    API, proxy and metrics ports all bind 127.0.0.1. `stop()` then `start()` reuses the same ports,
    data dir and database (restart tests). Log: `log_path` (appended across restarts)."""

    def __init__(self, database_url: str, data_dir: Optional[str] = None, python: Optional[str] = None,
                 extra_args: tuple[str, ...] = (), env: Optional[dict] = None, start_timeout: float = 180):
        self.database_url = database_url
        self.python = python or sys.executable
        self.root = Path(tempfile.mkdtemp(prefix="faden-gpustack-"))
        self.data_dir = Path(data_dir) if data_dir else self.root / "data"
        self.log_path = self.root / "gpustack.log"
        self.api_port, self.proxy_port, self.metrics_port = free_ports(3)
        self.extra_args, self.extra_env, self.start_timeout = tuple(extra_args), env or {}, start_timeout
        self.proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.api_port}"

    @property
    def proxy_url(self) -> str:
        """What GPUStack writes into a tunnel worker's `proxy_address`."""
        return f"http://{LOOPBACK}:{self.proxy_port}"

    def command(self) -> list[str]:
        return [
            self.python, str(LAUNCHER), "start",
            "--data-dir", str(self.data_dir),
            "--api-port", str(self.api_port),
            "--proxy-port", str(self.proxy_port),
            "--metrics-port", str(self.metrics_port),
            "--advertise-address", LOOPBACK,
            "--database-url", self.database_url,
            "--gateway-mode", "disabled",
            *offline_args(),
            *self.extra_args,
        ]

    def env(self) -> dict:
        return gpustack_env(self.extra_env)

    def is_running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> "GPUStackServer":
        if self.is_running():
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"\n==== harness: starting {' '.join(self.command())}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, env=self.env(), cwd=self.root,
                                         start_new_session=True)
        try:
            wait_for(self._healthy, self.start_timeout, "GPUStack /healthz", interval=0.5)
        except BaseException as e:
            self._terminate(timeout=10)
            raise RuntimeError(f"GPUStack did not start ({e}); log tail:\n{log_tail(self.log_path)}") from None
        return self

    def _healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise Fatal(f"GPUStack exited with {self.proc.returncode}")
        try:
            return httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def _terminate(self, timeout: float) -> Optional[int]:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            kill_group(self.proc, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                kill_group(self.proc, signal.SIGKILL)
                self.proc.wait(timeout=10)
        kill_group(self.proc, signal.SIGKILL)  # stragglers of the process group
        return self.proc.returncode

    def stop(self, timeout: float = 30) -> Optional[int]:
        """SIGTERM to the process group, wait (SIGKILL after `timeout`). Returns the exit code:
        -9 is GPUStack's normal answer to SIGTERM (its handler cancels its tasks, then kills its
        own process tree, itself included), in ~3 s."""
        code = self._terminate(timeout)
        self.proc = None
        return code

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)

    def admin_password(self) -> str:
        return (self.data_dir / "initial_admin_password").read_text().strip()

    def pids(self) -> list[int]:
        """Every process of the server's process group (the server and its children)."""
        if not self.is_running():
            return []
        out = subprocess.run(["ps", "-o", "pid=", "-g", str(self.proc.pid)], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def listening_sockets(self) -> list[tuple[str, int]]:
        """(address, port) of every TCP listening socket owned by the server's processes (`ss`)."""
        pids = set(self.pids())
        out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
        found = []
        for line in out.splitlines():
            fields = line.split()
            if len(fields) < 6 or not any(f"pid={p}," in fields[5] for p in pids):
                continue
            addr, _, port = fields[3].rpartition(":")
            found.append((addr.strip("[]"), int(port)))
        return sorted(set(found))

    def __enter__(self) -> "GPUStackServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------- admin / bootstrap


class Admin:
    """The bootstrap admin. `login()` gives a cookie session (`gpustack_session`); the admin then
    makes itself an API key and uses `Authorization: Bearer` from there on, so an `Admin` keeps
    working across server restarts. `key` is that admin API key (scope `*`)."""

    def __init__(self, server: GPUStackServer, username: str = "admin", password: Optional[str] = None):
        self.server = server
        self.username, self.password = username, password or server.admin_password()
        session = self.login()
        try:
            self.key_id, self.key = self._create_api_key(session, f"harness-admin-{uuid.uuid4().hex[:8]}")
        finally:
            session.close()
        self.http = httpx.Client(base_url=server.url, timeout=30, headers={"Authorization": f"Bearer {self.key}"})
        self._clientset = None

    def login(self) -> httpx.Client:
        """POST /auth/login (form fields username, password) -> a client holding the session cookie."""
        session = httpx.Client(base_url=self.server.url, timeout=30)
        _check(session.post("/auth/login", data={"username": self.username, "password": self.password}))
        return session

    @property
    def clientset(self):
        """GPUStack's own `ClientSet` with the admin key."""
        if self._clientset is None:
            from gpustack.client import ClientSet

            self._clientset = ClientSet(base_url=self.server.url, api_key=self.key)
        return self._clientset

    def get(self, path: str, **kw) -> Any:
        return _check(self.http.get(path, **kw)).json()

    def post(self, path: str, body: Any = None, **kw) -> Any:
        resp = _check(self.http.post(path, json=body, **kw))
        return resp.json() if resp.content else None

    def delete(self, path: str) -> None:
        _check(self.http.delete(path))

    # -- API keys (gpustack/routes/api_keys.py, gpustack/schemas/api_keys.py)

    @staticmethod
    def _create_api_key(http: httpx.Client, name: str, **fields) -> tuple[int, str]:
        body = {"name": name, **{k: v for k, v in fields.items() if v is not None}}
        key = _check(http.post("/v2/api-keys", json=body)).json()
        return key["id"], key["value"]

    def create_api_key(self, name: str, scope: Optional[list[str]] = None, expires_in: Optional[int] = None,
                       allowed_model_names: Optional[list[str]] = None, description: Optional[str] = None,
                       custom: Optional[str] = None) -> tuple[int, str]:
        """POST /v2/api-keys -> (id, value). GPUStack's fields (2.2.3 and 2.3.0):
        - scope: list of "*" (default, everything), "management" (/v2 API), "inference" (/v1);
        - expires_in: seconds from now (None or <= 0: never expires; answer has `expires_at`);
        - allowed_model_names: list of model names the key may call on /v1 (None: all);
        - custom: a caller-chosen key value instead of `gpustack_<16 hex>_<32 hex>`.
        Names are unique per user."""
        return self._create_api_key(self.http, name, scope=scope, expires_in=expires_in,
                                    allowed_model_names=allowed_model_names, description=description,
                                    custom=custom)

    def api_keys(self) -> list[dict]:
        return self.get("/v2/api-keys", params={"page": -1})["items"]

    def delete_api_key(self, key_id: int) -> None:
        self.delete(f"/v2/api-keys/{key_id}")

    # -- clusters

    def create_cluster(self, name: str, provider: str = "Docker") -> int:
        return self.post("/v2/clusters", {"name": name, "provider": provider})["id"]

    def registration_token(self, cluster_id: int) -> str:
        return self.get(f"/v2/clusters/{cluster_id}/registration-token")["token"]

    # -- workers

    def worker(self, worker_id: int) -> dict:
        return self.get(f"/v2/workers/{worker_id}")

    def workers(self) -> list[dict]:
        return self.get("/v2/workers", params={"page": -1})["items"]

    def wait_worker(self, worker_id: int, predicate: Callable[[dict], bool], what: str, timeout: float = 30) -> dict:
        def check():
            w = self.worker(worker_id)
            return w if predicate(w) else None

        return wait_for(check, timeout, f"worker {worker_id}: {what}", interval=0.5)

    def delete_worker(self, worker_id: int) -> None:
        self.delete(f"/v2/workers/{worker_id}")

    def set_worker_proxy_mode(self, worker: "FakeWorker", mode: str, timeout: float = 30) -> dict:
        """GPUStack (2.2.3, 2.3.0) has no admin field for it: the worker reports `proxy_mode` in
        its status (`POST /v2/worker-status`); the server flushes statuses every 5 s."""
        worker.proxy_mode = mode
        worker.post_status()
        return self.wait_worker(worker.id, lambda w: w.get("proxy_mode") == mode, f"proxy_mode {mode}", timeout)

    # -- models and instances

    def create_model(self, name: str, worker: Optional["FakeWorker"] = None, cluster_id: Optional[int] = None,
                     replicas: int = 1, **fields) -> int:
        """A model that needs no download and no container: backend `Custom`, source `local_path`
        (a path that does not exist; nobody reads it). With `worker`, the model selects that worker
        by its harness label. `restart_on_error` defaults to False so that an instance set to
        `error` stays there (GPUStack would reschedule it)."""
        body = {
            "name": name,
            "source": "local_path",
            "local_path": f"/nonexistent/faden-harness/{name}",
            "replicas": replicas,
            "cluster_id": cluster_id if cluster_id is not None else (worker.cluster_id if worker else None),
            # GPUStack's own custom backend (`BackendEnum.CUSTOM`, spelled "Custom"): the scheduler
            # looks for no runner image for it. Any other name is a backend of its own, whose
            # runners 2.2 looks up for the worker's GPU and finds none ("No backend versions are
            # available"); 2.3 skips the lookup for any model with an `image_name`.
            "backend": "Custom",
            "run_command": "faden-harness-never-run {{port}}",
            "image_name": "faden-harness/none:0",
            "categories": ["llm"],
            "restart_on_error": False,
            # A model route of the same name (what the UI creates): without it the server's own
            # /v1 answers 404 "Model not found" and /v1/models does not list the model.
            "enable_model_route": True,
            # GPUStack's documented override of its VRAM estimate. Without it the scheduler asks the
            # workers for the weight size of local_path and, as the path exists nowhere, fails with
            # "unsupported operand type(s) for +: 'NoneType' and 'int'" (a GPUStack 2.3.0 bug).
            "env": {"GPUSTACK_MODEL_VRAM_CLAIM": str(GIB)},
        }
        if worker is not None:
            body["worker_selector"] = {WORKER_LABEL: worker.name}
        body.update(fields)
        return self.post("/v2/models", body)["id"]

    def delete_model(self, model_id: int) -> None:
        self.delete(f"/v2/models/{model_id}")

    def model(self, model_id: int) -> dict:
        return self.get(f"/v2/models/{model_id}")

    def instance(self, instance_id: int) -> dict:
        return self.get(f"/v2/model-instances/{instance_id}")

    def instances(self, model_id: Optional[int] = None) -> list[dict]:
        params: dict = {"page": -1}
        if model_id is not None:
            params["model_id"] = model_id
        items = self.get("/v2/model-instances", params=params)["items"]
        return [i for i in items if model_id is None or i.get("model_id") == model_id]

    def wait_instance(self, instance_id: int, predicate: Callable[[dict], bool], what: str, timeout: float = 30) -> dict:
        def check():
            mi = self.instance(instance_id)
            return mi if predicate(mi) else None

        return wait_for(check, timeout, f"instance {instance_id}: {what}", interval=0.3)

    def run_instance(self, model_name: str, port: int, worker: "FakeWorker", timeout: float = 60,
                     **model_fields) -> tuple[int, int]:
        """Creates a model with one replica pinned to `worker`, waits for GPUStack's scheduler to
        place its instance there, then, as the worker, moves it to `running` on `port`
        (`port` and `ports: [port]`). Returns (model_id, instance_id) once
        GET /v2/model-instances/{id} shows it running with that port."""
        model_id = self.create_model(model_name, worker=worker, **model_fields)
        try:
            mi = wait_for(lambda: next((i for i in self.instances(model_id) if i.get("worker_id") == worker.id), None),
                          timeout, f"an instance of model {model_name} scheduled on worker {worker.name}", interval=0.3)
            worker.serve_instance(mi["id"], port)
            self.wait_instance(mi["id"], lambda m: m["state"] == "running" and m.get("port") == port,
                               f"running on port {port}", timeout)
        except BaseException:
            with contextlib.suppress(Exception):
                self.delete_model(model_id)
            raise
        return model_id, mi["id"]

    def set_instance_state(self, instance_id: int, state: str, state_message: Optional[str] = None, **fields) -> dict:
        """GET + PUT of the whole instance with `state` (e.g. "error", "running", "unreachable")
        changed, through GPUStack's `ModelInstanceClient` with the admin key."""
        return update_instance(self.clientset, instance_id, state=state,
                               state_message=state_message if state_message is not None else "", **fields)

    def delete_instance(self, instance_id: int) -> None:
        """DELETE /v2/model-instances/{id}. The model controller then creates a replacement
        (replicas stays 1), which the scheduler places again (state `scheduled`, no port)."""
        self.delete(f"/v2/model-instances/{instance_id}")

    def close(self) -> None:
        self.http.close()


def update_instance(clientset, instance_id: int, **fields) -> dict:
    """What GPUStack's worker does (`ServeManager._update_model_instance`): GET the instance, set
    the fields on a `ModelInstanceUpdate`, PUT it back. Returns the answer as a dict."""
    from gpustack.schemas.models import ModelInstanceStateEnum, ModelInstanceUpdate

    current = clientset.model_instances.get(id=instance_id)
    update = ModelInstanceUpdate(**current.model_dump())
    for key, value in fields.items():
        setattr(update, key, ModelInstanceStateEnum(value) if key == "state" else value)
    return clientset.model_instances.update(id=instance_id, model_update=update).model_dump(mode="json")


# ---------------------------------------------------------------- fake worker


def fake_status(gpu_memory: int = 80 * GIB, memory: int = 256 * GIB) -> dict:
    """A worker status with one fake NVIDIA GPU (shape from gpustack-samples/fake-gpu)."""
    return {
        "cpu": {"total": 2, "utilization_rate": 3.5},
        "memory": {"total": memory, "utilization_rate": 1.0, "is_unified_memory": False, "used": 2 * GIB, "allocated": 0},
        "swap": {"total": 0, "utilization_rate": 0.0, "used": 0},
        "filesystem": [{"name": "vda", "mount_point": "/", "mount_from": "/dev/vda", "total": 270 * GIB,
                        "used": 13 * GIB, "free": 250 * GIB, "available": 250 * GIB}],
        "os": {"name": "Debian GNU/Linux", "version": "12"},
        "kernel": {"name": "Linux", "release": "6.1.0", "version": "#1 SMP", "architecture": "x86_64"},
        "uptime": {"uptime": 1000.0, "boot_time": "2026-01-01 00:00:00"},
        "gpu_devices": [{
            "vendor": "nvidia", "type": "cuda", "index": 0, "device_index": 0, "device_chip_index": 0,
            "arch_family": "ampere", "name": "NVIDIA A100 (fake)", "uuid": f"GPU-{uuid.uuid4()}",
            "driver_version": "550.54.15", "runtime_version": "12.4", "compute_capability": "8.0",
            "core": {"total": 6912, "utilization_rate": 0.0},
            "memory": {"total": gpu_memory, "utilization_rate": 0.0, "is_unified_memory": False, "used": 0, "allocated": 0},
            "temperature": 35.0,
        }],
    }


class _UvicornThread:
    """A uvicorn server in a daemon thread (no signal handlers: not the main thread)."""

    def __init__(self, app, host: str, port: int):
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                                    access_log=False, lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, name=f"uvicorn-{host}:{port}", daemon=True)

    def start(self, timeout: float = 15) -> None:
        self.thread.start()
        wait_for(lambda: self.server.started or not self.thread.is_alive(), timeout, "uvicorn start", 0.05)
        if not self.server.started:
            raise RuntimeError("uvicorn did not start (port taken?)")

    def stop(self, timeout: float = 10) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)


class FakeWorker:
    """A GPUStack worker without GPUStack's worker process, driven by GPUStack's own client
    classes: `WorkerRegistrationClient` (POST /v2/workers with the registration token),
    `WorkerStatusClient` (POST /v2/worker-status), `ClientSet` (worker token) for heartbeats
    (POST /v2/worker-heartbeat) and instance updates, `MessageClient` for the tunnel.

    Its worker API on `ip:port` is GPUStack's own: `/healthz` (the server's reachability check)
    and the worker proxy (`gpustack.routes.worker.proxy`: a request carrying
    `X-GPUStack-Model-Instance: model-<m>-<i>.static` and `Bearer <worker or registration token>`
    goes to `ip:<port of instance i>`; 404 JSON for an unknown instance). Instance ports are the
    ones given to `serve_instance`. `hits` counts the requests it received by path.

    `start()` registers, serves, posts a status with one fake GPU, heartbeats, and keeps
    heartbeating and posting the status every `interval` s in a background thread."""

    def __init__(self, server_url: str, registration_token: str, name: str, ip: str = LOOPBACK,
                 port: Optional[int] = None, proxy_mode: str = "direct", advertise_address: Optional[str] = None,
                 labels: Optional[dict] = None, interval: float = 10, gpu_memory: int = 80 * GIB,
                 data_dir: Optional[str] = None):
        _gpustack_logging()
        self.server_url, self.registration_token, self.name = server_url, registration_token, name
        self.ip, self.port = ip, port or free_port(ip)
        self.proxy_mode, self.advertise_address = proxy_mode, advertise_address
        self.labels = {"os": "linux", "arch": "amd64", WORKER_LABEL: name, **(labels or {})}
        self.interval, self.gpu_memory = interval, gpu_memory
        # With a data dir, registration goes through GPUStack's `registration_client` and leaves
        # `worker_name` / `worker_uuid` there, as the real worker does: a second FakeWorker on
        # the same dir is that worker restarted (it presents the registration token wrapped).
        self.data_dir = data_dir
        self.worker_uuid = str(uuid.uuid4())  # replaced by the server's at registration
        self.id: Optional[int] = None
        self.cluster_id: Optional[int] = None
        self.token: Optional[str] = None
        self.clientset = None
        self.instance_ports: dict[int, int] = {}
        self.hits: dict[str, int] = {}
        self.tunnel: Optional["Tunnel"] = None
        self._status = fake_status(gpu_memory)
        self._api: Optional[_UvicornThread] = None
        self._app = None
        self._stop = threading.Event()
        self._loop_thread: Optional[threading.Thread] = None
        self.errors: list[str] = []

    @property
    def uuid(self) -> str:
        return self.worker_uuid

    def status(self):
        from gpustack.schemas.workers import WorkerStatusPublic

        return WorkerStatusPublic.model_validate({
            "hostname": self.name, "ip": self.ip, "ifname": "lo", "port": self.port,
            "advertise_address": self.advertise_address, "worker_uuid": self.worker_uuid,
            "status": self._status, "state_message": None, "proxy_mode": self.proxy_mode,
            # Without it the scheduler fails ("unsupported operand type(s) for +: 'NoneType' and 'int'").
            "system_reserved": {"ram": 0, "vram": 0},
        })

    def register(self) -> dict:
        """POST /v2/workers (registration token). Sets id, token (the worker token), worker_uuid,
        cluster_id and `clientset` (GPUStack's ClientSet with the worker token)."""
        from gpustack.client import ClientSet
        from gpustack.client.worker_manager_clients import WorkerRegistrationClient
        from gpustack.extension import resolve_version_info
        from gpustack.schemas.workers import WorkerCreate

        to_register = WorkerCreate.model_validate({
            **self.status().model_dump(), "name": self.name, "labels": self.labels,
            "worker_version": resolve_version_info()[0],
        })
        if self.data_dir is None:
            reg = ClientSet(base_url=self.server_url, api_key=self.registration_token)
            created = WorkerRegistrationClient(reg.http_client).create(to_register)
        else:
            from gpustack.config.registration import registration_client
            from gpustack.utils.uuid import get_legacy_uuid, set_legacy_uuid, set_worker_name

            self.worker_uuid = get_legacy_uuid(self.data_dir) or self.worker_uuid
            to_register.worker_uuid = self.worker_uuid
            client = registration_client(self.data_dir, self.server_url, self.registration_token)
            self.presented_token = client._client.get_httpx_client().headers.get("authorization")
            created = client.create(to_register)
            set_worker_name(self.data_dir, created.name)
            set_legacy_uuid(self.data_dir, created.worker_uuid)
        self.id, self.token, self.worker_uuid = created.id, created.token, created.worker_uuid
        self.cluster_id = created.cluster_id
        self.clientset = ClientSet(base_url=self.server_url, api_key=self.token)
        if self._app is not None:
            self._app.state.token = self.token
        return created.model_dump(mode="json")

    def post_status(self) -> None:
        from gpustack.client.worker_manager_clients import WorkerStatusClient

        WorkerStatusClient(self.clientset.http_client).create(self.status())

    def heartbeat(self) -> None:
        resp = self.clientset.http_client.get_httpx_client().post("/worker-heartbeat", json={})
        if resp.status_code != 204:
            raise RuntimeError(f"heartbeat: {resp.status_code} {resp.text}")

    def info(self) -> dict:
        """GET /v2/workers/{id} with the worker token."""
        resp = self.clientset.http_client.get_httpx_client().get(f"/workers/{self.id}")
        return _check(resp).json()

    def wait(self, predicate: Callable[[dict], bool], what: str, timeout: float = 30) -> dict:
        return wait_for(lambda: (lambda w: w if predicate(w) else None)(self.info()), timeout,
                        f"worker {self.name}: {what}", interval=0.5)

    def start(self, wait_ready: bool = True, timeout: float = 30) -> "FakeWorker":
        self._serve_api()
        self.register()
        self.post_status()
        self.heartbeat()
        self._stop.clear()
        self._loop_thread = threading.Thread(target=self._keepalive, name=f"fake-worker-{self.name}", daemon=True)
        self._loop_thread.start()
        if wait_ready:
            self.wait(lambda w: w["state"] == "ready", "state ready", timeout)
        return self

    def _keepalive(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.heartbeat()
                self.post_status()
            except Exception as e:  # noqa: BLE001 (server restarting, say): try again next round
                self.errors.append(repr(e))

    def _serve_api(self) -> None:
        if self._api is not None:
            return
        import aiohttp
        from contextlib import asynccontextmanager
        from fastapi import FastAPI, Request
        from starlette.middleware.base import BaseHTTPMiddleware

        from gpustack.api import exceptions
        from gpustack.routes import probes
        from gpustack.routes.worker import proxy

        @asynccontextmanager
        async def lifespan(app):  # as gpustack.worker.worker.Worker._serve_apis
            connector = aiohttp.TCPConnector(force_close=True)
            app.state.http_client = aiohttp.ClientSession(connector=connector, trust_env=True)
            app.state.http_client_no_proxy = aiohttp.ClientSession(connector=connector)
            yield
            await app.state.http_client.close()
            await app.state.http_client_no_proxy.close()

        app = FastAPI(title="faden harness fake GPUStack worker", lifespan=lifespan)
        app.state.config = SimpleNamespace(token=self.registration_token, get_server_url=lambda: self.server_url)
        app.state.token = self.token
        app.state.worker_ip_getter = lambda: self.ip
        app.state.get_instance_port_by_model_instance_id = self.instance_ports.get
        app.state.record_successful_inference = None

        async def count(request: Request, call_next):
            self.hits[request.url.path] = self.hits.get(request.url.path, 0) + 1
            return await call_next(request)

        app.add_middleware(BaseHTTPMiddleware, dispatch=proxy.set_port_from_model_name)
        app.add_middleware(BaseHTTPMiddleware, dispatch=count)
        app.include_router(probes.router)
        app.include_router(proxy.router)
        exceptions.register_handlers(app)
        self._app = app
        self._api = _UvicornThread(app, self.ip, self.port)
        self._api.start()

    def serve_instance(self, instance_id: int, port: int) -> dict:
        """Moves a scheduled instance to `starting` with port/ports set, then to `running`, by
        GET + PUT like GPUStack's serve_manager. (The real worker goes through `initializing` and
        `downloading` first; the harness skips them: in those two states GPUStack's model-file
        controller also rewrites the instance, and would race with the harness' next PUT.)"""
        self.instance_ports[instance_id] = port
        update_instance(self.clientset, instance_id, state="starting", port=port, ports=[port],
                        state_message="")
        return update_instance(self.clientset, instance_id, state="running", state_message="")

    def set_instance_state(self, instance_id: int, state: str, state_message: str = "", **fields) -> dict:
        return update_instance(self.clientset, instance_id, state=state, state_message=state_message, **fields)

    def start_tunnel(self, timeout: float = 30) -> "Tunnel":
        return start_tunnel(self, timeout)

    def stop(self) -> None:
        """Stops the tunnel, the keep-alive thread and the worker API (the worker stays
        registered; GPUStack marks it not_ready after 150 s without heartbeat)."""
        if self.tunnel is not None:
            self.tunnel.stop()
        self._stop.set()
        if self._loop_thread is not None:
            self._loop_thread.join(10)
            self._loop_thread = None
        if self._api is not None:
            self._api.stop()
            self._api = self._app = None

    def __enter__(self) -> "FakeWorker":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ---------------------------------------------------------------- tunnel


class Tunnel:
    """GPUStack's own tunnel client (`gpustack.websocket_proxy.message_client.MessageClient`,
    configured as gpustack/worker/worker.py does for proxy_mode tunnel) in a thread with its own
    event loop: `ws://<server>/connect`, `Authorization: Bearer <worker token>`,
    `x-client-id: <worker_uuid>`, `x-cidrs: <worker ip>/32`. It reconnects by itself (1 s
    doubling to 60 s) until `stop()`."""

    def __init__(self, worker: FakeWorker):
        from gpustack.api.auth import BearerTokenAuthenticator
        from gpustack.websocket_proxy.message_client import MessageClient

        _gpustack_logging()
        self.worker = worker
        self.client = MessageClient(
            server_endpoint=worker.server_url,
            client_id=uuid.UUID(worker.worker_uuid),
            cidrs=[f"{worker.ip}/32"],
            unix_sockets=[],
            authenticator=BearerTokenAuthenticator(headers=worker.clientset.headers),
        )
        self.loop = asyncio.new_event_loop()
        self._task: Optional[asyncio.Task] = None
        self.thread = threading.Thread(target=self._run, name=f"tunnel-{worker.name}", daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self._task = self.loop.create_task(self.client.run())
        with contextlib.suppress(BaseException):
            self.loop.run_until_complete(self._task)
        with contextlib.suppress(BaseException):
            ws = self.client._websocket
            if ws is not None:
                self.loop.run_until_complete(asyncio.wait_for(ws.close(), 5))
        with contextlib.suppress(BaseException):
            pending = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
            for t in pending:
                t.cancel()
            self.loop.run_until_complete(asyncio.wait_for(asyncio.gather(*pending, return_exceptions=True), 5))
        self.loop.close()

    def start(self) -> "Tunnel":
        self.thread.start()
        return self

    def stop(self, timeout: float = 10) -> None:
        if self.thread.is_alive():
            def cancel():
                if self._task is not None:
                    self._task.cancel()

            with contextlib.suppress(RuntimeError):
                self.loop.call_soon_threadsafe(cancel)
            self.thread.join(timeout)
        if self.worker.tunnel is self:
            self.worker.tunnel = None

    def __enter__(self) -> "Tunnel":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_tunnel(worker: FakeWorker, timeout: float = 30) -> Tunnel:
    """Starts GPUStack's tunnel client for `worker` and waits until GPUStack reports the worker's
    `proxy_address` (`http://127.0.0.1:<proxy port>`). The worker should report proxy_mode
    `tunnel` for GPUStack itself to route through it (not needed for the tunnel to connect)."""
    if worker.tunnel is not None:
        worker.tunnel.stop()
    tunnel = Tunnel(worker).start()
    worker.tunnel = tunnel
    try:
        worker.wait(lambda w: w.get("proxy_address"), "proxy_address set", timeout)
    except BaseException:
        tunnel.stop()
        raise
    return tunnel


# ---------------------------------------------------------------- mock engine


class MockEngine:
    """A tiny OpenAI-compatible engine on `host`:0 (threaded http.server, HTTP/1.1 keep-alive):
    GET /v1/models, GET /health(z), POST /v1/embeddings, POST /v1/chat/completions and
    /v1/completions (JSON, or SSE with chunked transfer encoding when `"stream": true`, `chunks`
    content events `delay` s apart; usage in the last event when `stream_options.include_usage`).
    `sent` holds the body bytes of each answer (for SSE: the event bytes without the chunked
    framing, growing while it streams). `requests` records (method, path, headers with lower-case
    names, body) of each request; the reply text names `name` so a test can tell engines apart."""

    def __init__(self, host: str = LOOPBACK, name: Optional[str] = None, chunks: int = 3, delay: float = 0.0):
        self.host, self.chunks, self.delay = host, chunks, delay
        self.requests: list[tuple[str, str, dict, Any]] = []
        # Streamed answers being sent now, and the most at once.
        self.in_flight = self.max_in_flight = 0
        self.sent: list[bytes] = []  # the body of each answer (SSE: the event bytes, unchunked)
        self._lock = threading.Lock()
        engine = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _body(self) -> Any:
                n = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(n) if n else b""
                try:
                    return json.loads(raw) if raw else None
                except ValueError:
                    return raw.decode(errors="replace")

            def _record(self, body) -> None:
                with engine._lock:
                    engine.requests.append((self.command, self.path, {k.lower(): v for k, v in self.headers.items()}, body))

            def _json(self, status: int, obj: Any) -> None:
                data = json.dumps(obj).encode()
                with engine._lock:
                    engine.sent.append(data)
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._record(None)
                path = self.path.split("?")[0]
                if path in ("/health", "/healthz", "/v1/health"):
                    self._json(200, {"status": "ok"})
                elif path == "/v1/models":
                    self._json(200, {"object": "list", "data": [
                        {"id": engine.name, "object": "model", "created": 0, "owned_by": "faden-harness"}]})
                else:
                    self._json(404, {"error": {"message": f"no route {path}", "type": "not_found", "code": 404}})

            def do_POST(self):
                body = self._body()
                self._record(body)
                path = self.path.split("?")[0]
                if path == "/v1/embeddings" and isinstance(body, dict):
                    inputs = body.get("input")
                    inputs = inputs if isinstance(inputs, list) else [inputs]
                    data = [{"object": "embedding", "index": i, "embedding": [0.1 * (i + 1), 0.2, 0.3]}
                            for i in range(len(inputs))]
                    self._json(200, {"object": "list", "data": data, "model": body.get("model", engine.name),
                                     "usage": {"prompt_tokens": len(inputs), "total_tokens": len(inputs)}})
                    return
                if path not in ("/v1/chat/completions", "/v1/completions") or not isinstance(body, dict):
                    self._json(404, {"error": {"message": f"no route {path}", "type": "not_found", "code": 404}})
                    return
                chat = path.endswith("chat/completions")
                model = body.get("model", engine.name)
                rid = f"cmpl-{uuid.uuid4().hex[:12]}"
                words = [f"mock reply from {engine.name}"] + [f" {i}" for i in range(1, engine.chunks)]
                usage = {"prompt_tokens": 5, "completion_tokens": len(words), "total_tokens": 5 + len(words)}
                if not body.get("stream"):
                    text = "".join(words)
                    choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
                              if chat else {"index": 0, "text": text, "finish_reason": "stop"})
                    self._json(200, {"id": rid, "object": "chat.completion" if chat else "text_completion",
                                     "created": int(time.time()), "model": model, "choices": [choice], "usage": usage})
                    return
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("cache-control", "no-cache")
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                obj = "chat.completion.chunk" if chat else "text_completion"
                events = []
                for i, w in enumerate(words):
                    delta = {"role": "assistant", "content": w} if i == 0 else {"content": w}
                    choice = {"index": 0, "delta": delta, "finish_reason": None} if chat else \
                        {"index": 0, "text": w, "finish_reason": None}
                    events.append({"id": rid, "object": obj, "created": 0, "model": model, "choices": [choice]})
                last = {"index": 0, "delta": {}, "finish_reason": "stop"} if chat else \
                    {"index": 0, "text": "", "finish_reason": "stop"}
                events.append({"id": rid, "object": obj, "created": 0, "model": model, "choices": [last]})
                if (body.get("stream_options") or {}).get("include_usage"):
                    events.append({"id": rid, "object": obj, "created": 0, "model": model, "choices": [], "usage": usage})
                sent = bytearray()
                with engine._lock:
                    engine.sent.append(b"")
                    slot = len(engine.sent) - 1
                    engine.in_flight += 1
                    engine.max_in_flight = max(engine.max_in_flight, engine.in_flight)
                try:
                    for data in [f"data: {json.dumps(ev)}\n\n".encode() for ev in events] + [b"data: [DONE]\n\n"]:
                        self._chunk(data)
                        sent += data
                        with engine._lock:
                            engine.sent[slot] = bytes(sent)
                        if engine.delay:
                            time.sleep(engine.delay)
                    self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True
                finally:
                    with engine._lock:
                        engine.in_flight -= 1

            def _chunk(self, data: bytes) -> None:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()

        class Server(ThreadingHTTPServer):
            # socketserver's default listen backlog (5) drops connections that arrive together.
            request_queue_size = 1024

        self.httpd = Server((host, 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.name = name or f"mock-{self.port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, name=f"mock-engine-{self.port}", daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)

    def __enter__(self) -> "MockEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# ---------------------------------------------------------------- faden server


def wait_routable(url: str, key: str, model: str, timeout: float = 15) -> None:
    """Until a chat for `model` through the gateway at `url` answers 200."""
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    wait_for(lambda: httpx.post(f"{url}/v1/chat/completions", json=body,
                                headers={"Authorization": f"Bearer {key}"}).status_code == 200,
             timeout, f"{model} routable through faden's gateway", 0.05)


def gpustack_model(name: str) -> dict:
    """A model body with GPUStack's source fields: what GPUStack's `ModelPublic` requires and its
    worker reads (faden keeps them as sent)."""
    return {"name": name, "source": "local_path", "local_path": f"/models/{name}", "backend": "custom"}


class RealWorker:
    """GPUStack's own worker process (`gpustack start --server-url … --token …`) through
    launch_gpustack.py: its API on 127.0.0.1:`port`, metrics off, no tool downloads. Without a
    container runtime it deploys nothing, but it registers, reports, heartbeats, watches, serves
    its worker proxy and runs its tunnel client as it would on a GPU host. `stop()` then `start()`
    is a restart on the same data directory. Log: `log_path` (appended across restarts)."""

    def __init__(self, server_url: str, token: str, name: str, proxy_mode: str = "worker",
                 ip: str = LOOPBACK):
        self.server_url, self.token, self.name, self.proxy_mode, self.ip = server_url, token, name, proxy_mode, ip
        self.root = Path(tempfile.mkdtemp(prefix="faden-gpustack-worker-"))
        self.data_dir = self.root / "data"
        self.log_path = self.root / "worker.log"
        self.port = free_port()
        self.proc: Optional[subprocess.Popen] = None

    def command(self) -> list[str]:
        return [
            sys.executable, str(LAUNCHER), "start",
            "--server-url", self.server_url, "--token", self.token,
            "--data-dir", str(self.data_dir),
            "--worker-name", self.name, "--worker-ip", self.ip, "--worker-port", str(self.port),
            "--proxy-mode", self.proxy_mode,
            "--disable-worker-metrics",
            *offline_args(),
        ]

    def start(self, timeout: float = 90) -> "RealWorker":
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._started_at = log.tell()
            log.write(f"\n==== harness: starting {' '.join(self.command())}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, env=gpustack_env(), cwd=self.root,
                                         start_new_session=True)
        try:
            wait_for(self._started, timeout, "GPUStack worker startup", interval=0.2)
        except BaseException as e:
            self.stop(timeout=10)
            raise RuntimeError(f"GPUStack's worker did not start ({e}); log tail:\n{log_tail(self.log_path)}") from None
        return self

    def log(self) -> str:
        """The log of the current run."""
        with open(self.log_path, "rb") as f:
            f.seek(self._started_at)
            return f.read().decode(errors="replace")

    def _started(self) -> bool:
        if self.proc.poll() is not None:
            raise Fatal(f"GPUStack's worker exited with {self.proc.returncode}")
        return "GPUStack worker startup completed" in self.log()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            kill_group(self.proc, sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                kill_group(self.proc, signal.SIGKILL)
                self.proc.wait(timeout=10)
        kill_group(self.proc, signal.SIGKILL)
        self.proc = None

    def close(self) -> None:
        self.stop()
        if os.environ.get("FADEN_KEEP_LOGS"):
            print(f"GPUStack worker log kept: {self.log_path}")
        else:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "RealWorker":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


class FadenServer(faden_harness.FadenServer):
    """`faden server` on 127.0.0.1 (faden_harness.FadenServer: API, gateway and proxy port on
    free ports, a fresh data dir, its log in a file): the server GPUStack workers join. `admin` is
    its bootstrap admin key, `http` an httpx client of its API with that key; `cluster()` makes a
    cluster and returns (id, registration token)."""

    def __init__(self, *extra: str, timeout: float = 30):
        super().__init__(*extra, timeout=timeout)
        self.http = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.admin}"},
                                 timeout=10)

    def cluster(self, name: str) -> tuple[int, str]:
        cluster_id = _check(self.http.post("/v2/clusters", json={"name": name})).json()["id"]
        token = _check(self.http.get(f"/v2/clusters/{cluster_id}/registration-token")).json()["token"]
        return cluster_id, token

    def close(self) -> None:
        self.http.close()
        super().close()


# ---------------------------------------------------------------- everything at once


class GPUStackEnv:
    """Postgres + GPUStackServer + Admin + one cluster: what conftest.py's session fixture holds.
    Fake workers made by `worker()` are stopped by `close()`."""

    _names = itertools.count(1)

    def __init__(self, start_timeout: float = 180):
        self.pg = Postgres().start()
        try:
            self.server = GPUStackServer(self.pg.url, start_timeout=start_timeout).start()
            self.admin = Admin(self.server)
            self.cluster_id = self.admin.create_cluster("faden-harness")
            self.registration_token = self.admin.registration_token(self.cluster_id)
        except BaseException:
            self.close()
            raise
        self.workers: list[FakeWorker] = []

    def unique(self, prefix: str) -> str:
        return f"{prefix}-{next(self._names)}"

    def worker(self, name: Optional[str] = None, proxy_mode: str = "direct", ip: str = LOOPBACK, **kw) -> FakeWorker:
        w = FakeWorker(self.server.url, self.registration_token, name or self.unique("worker"), ip=ip,
                       proxy_mode=proxy_mode, **kw)
        self.workers.append(w)
        return w.start()

    def close(self) -> None:
        for w in getattr(self, "workers", []):
            with contextlib.suppress(Exception):
                w.stop()
        if getattr(self, "admin", None) is not None:
            self.admin.close()
        if getattr(self, "server", None) is not None:
            self.server.close()
        self.pg.stop()
