"""One real GPUStack server (on a private PostgreSQL, all on 127.0.0.1) per pytest session.

Run with the GPUStack venv's python; the suite runs against the GPUStack of that venv, 2.3.0 or
2.2.3 (`harness.GPUSTACK_VERSION`; pytest's header names it):
    PY=$(scripts/gpustack-venv.sh | tail -n1) && "$PY" -m pytest -q tests/gpustack
    PY=$(FADEN_GPUSTACK_VERSION=2.2.3 scripts/gpustack-venv.sh | tail -n1) && "$PY" -m pytest -q tests/gpustack
The first start runs GPUStack's migrations and imports ~20 s of Python: ~30-40 s on 2 cores.

Fixtures:
- `gpustack` (session): a `harness.GPUStackEnv`: `.pg` (Postgres), `.server` (GPUStackServer:
  `.url`, `.proxy_port`, `.proxy_url`, `.stop()`/`.start()`), `.admin` (Admin: `.key` and the
  bootstrap helpers), `.cluster_id`, `.registration_token`, `.worker(...)` (a started FakeWorker,
  stopped at session end).
- `faden` (module): a `harness.FadenServer` with the module's `FADEN_ARGS` (if any) as extra
  flags; `cluster` (module): a cluster of it named after the module, `(id, registration token)`.
- `engine` (session): a factory of MockEngines (`engine(host="127.0.0.1", name=None, chunks=3,
  delay=0.0)`), each new, all stopped at the end of the session.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

# The harness needs gpustack (and httpx): only the GPUStack venv has them. A missing
# prerequisite fails the run; it is never skipped.
try:
    import gpustack as _gpustack_package  # noqa: F401

    import harness
except ImportError as e:  # pragma: no cover
    raise pytest.UsageError(
        f"tests/gpustack needs a GPUStack venv ({e}): run it with the python that "
        "scripts/gpustack-venv.sh prints"
    ) from e


def pytest_report_header():
    return f"GPUStack {'.'.join(map(str, harness.GPUSTACK_VERSION))} ({sys.prefix})"


@pytest.fixture(scope="session")
def gpustack():
    env = harness.GPUStackEnv()
    try:
        yield env
    finally:
        env.close()


@pytest.fixture(scope="session")
def engine():
    # Session-scoped so that fixtures of any scope may use it; each call makes a fresh engine
    # (its own port and `requests`), all stopped at the end of the session.
    engines = []

    def make(host: str = "127.0.0.1", **kw) -> "harness.MockEngine":
        e = harness.MockEngine(host=host, **kw)
        engines.append(e)
        return e

    try:
        yield make
    finally:
        for e in engines:
            e.stop()


@pytest.fixture(scope="module")
def faden(request):
    with harness.FadenServer(*getattr(request.module, "FADEN_ARGS", ())) as server:
        yield server


@pytest.fixture(scope="module")
def cluster(faden, request):
    return faden.cluster(request.module.__name__.removeprefix("test_"))
