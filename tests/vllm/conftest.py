"""One real vLLM (CPU build, tiny dummy-weight model: engine.py) per pytest session, and faden in
front of it on every path.

Run with the vLLM venv's python:
    PY=$(scripts/vllm-venv.sh | tail -n1) && FADEN_BIN=target/debug/faden "$PY" -m pytest -q tests/vllm

Fixtures:
- `vllm` (session): an `engine.VllmEngine` serving the model under the names `tiny` (what its
  answers carry) and `tiny-direct`, `tiny-worker`, `tiny-tunnel` (one per faden worker).
- `site` (session): a `faden server`, three `faden worker`s (proxy modes direct, worker and
  tunnel) each serving vLLM's port as model `tiny-<mode>`, and a standalone `faden gateway`
  synced from the server with a data-plane key; `site.key` is an inference key.
- `path` (parametrized over PATHS): one way through faden to vLLM: `.client` (the `openai` SDK),
  `.model`, `.url` (the gateway), `.metrics()` (the gateway's /metrics text).
"""

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

# A missing prerequisite fails the run; it is never skipped.
try:
    if importlib.util.find_spec("vllm") is None:
        raise ImportError("no module named vllm")
    import engine
except ImportError as e:  # pragma: no cover
    raise pytest.UsageError(
        f"tests/vllm needs the vLLM venv ({e}): run it with the python that scripts/vllm-venv.sh prints"
    ) from e

import faden_harness  # noqa: E402

MODES = ("direct", "worker", "tunnel")
PATHS = [*MODES, "gateway-direct", "gateway-worker", "gateway-tunnel"]
# The longest wait for a path to become routable once its worker is ready.
ROUTABLE_TIMEOUT = 20


# How long vLLM took to become healthy, for the summary (CI's log keeps the figure).
_started: dict[str, float] = {}


def pytest_terminal_summary(terminalreporter):
    if "vllm" in _started:
        terminalreporter.write_line(f"vLLM was healthy {_started['vllm']:.0f} s after its start")


@pytest.fixture(scope="session")
def vllm():
    names = ("tiny", *(f"tiny-{m}" for m in MODES))
    with engine.VllmEngine(names=names) as e:
        _started["vllm"] = e.start_seconds
        yield e


class Site:
    def __init__(self, vllm_port: int):
        self.server = faden_harness.FadenServer()
        self.workers, self.gateway, self.routable = [], None, {}
        try:
            cluster = self.server.api("POST", "/v2/clusters", {"name": "vllm"})
            self.key = self.server.api("POST", "/v2/api-keys", {"name": "client"})["value"]
            for mode in MODES:
                self.server.api("POST", "/v2/models", {"name": f"tiny-{mode}"})
                self.workers.append(faden_harness.FadenWorker(
                    self.server.url, cluster["registration_token"], mode, {f"tiny-{mode}": vllm_port},
                    "--disable-worker-metrics"))
            data_plane = self.server.api("POST", "/v2/api-keys", {"name": "gateway", "scope": "data_plane"})
            self.gateway = faden_harness.FadenGateway(self.server.url, data_plane["value"])
        except BaseException:
            self.close()
            raise

    def wait_routable(self, url: str, model: str) -> None:
        """Until a chat for `model` at `url` answers 200; a path that never did fails at once
        the next time."""
        if (url, model) not in self.routable:
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
            try:
                faden_harness.wait_for(
                    lambda: faden_harness.http_json("POST", f"{url}/v1/chat/completions", body, self.key)[0] == 200,
                    ROUTABLE_TIMEOUT, f"{model} routable at {url}", 0.1)
                self.routable[(url, model)] = None
            except TimeoutError as e:
                self.routable[(url, model)] = str(e)
        if self.routable[(url, model)]:
            status, answer = faden_harness.http_json("POST", f"{url}/v1/chat/completions",
                                                     {"model": model, "messages": []}, self.key)
            pytest.fail(f"{self.routable[(url, model)]}; now: {status} {answer}")

    def close(self) -> None:
        for p in [self.gateway, *self.workers, self.server]:
            if p is not None:
                p.close()


@pytest.fixture(scope="session")
def site(vllm):
    s = Site(vllm.port)
    try:
        yield s
    finally:
        s.close()


@dataclass
class Route:
    name: str
    url: str
    model: str
    client: openai.OpenAI

    def metrics(self) -> str:
        status, text = faden_harness.http_json("GET", f"{self.url}/metrics")
        assert status == 200, text
        return text


@pytest.fixture(params=PATHS)
def path(request, site):
    name = request.param
    mode = name.removeprefix("gateway-")
    url = site.gateway.url if name.startswith("gateway-") else site.server.gateway_url
    model = f"tiny-{mode}"
    site.wait_routable(url, model)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=site.key, max_retries=0, timeout=60)
    yield Route(name, url, model, client)
    client.close()
