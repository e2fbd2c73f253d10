"""GPUStack's own worker process (`gpustack start --server-url … --token …`, 2.3.0 or 2.2.3)
joining a `faden server`, in each proxy mode.

The worker runs as it would on a GPU host (`harness.RealWorker`), except that this host has no
container runtime: it deploys nothing (its serve manager logs "No available deployer"), so the
administrator records each instance as `running` on a mock engine, in GPUStack's shape (`port`
and `ports`), where the worker's serve manager, its reverse proxy and its tunnel client pick it up
from the watch. Everything else is the worker's own doing: registration, status reports,
heartbeats, its watches and reads of models, instances and the resources faden does not manage,
its reverse proxy (`worker` mode) and its tunnel client (`tunnel` mode). The worker's log must
show no refused call and no answer its schemas rejected.
"""

import re
import signal
import time
import uuid

import httpx
import openai
import pytest

import harness

# What the worker logs on this host whatever the server: it has no container runtime, and no
# fastfetch (launch_gpustack.py skips the tool downloads).
EXPECTED_ERRORS = ("No available deployer", "Failed to detect system info")





def record(faden, name: str) -> dict:
    found = [w for w in harness._check(faden.http.get("/v2/workers")).json()["items"] if w["name"] == name]
    return found[0] if found else {}


def wait_joined(faden, worker: harness.RealWorker) -> dict:
    def joined():
        w = record(faden, worker.name)
        up = w.get("state") == "ready" and (worker.proxy_mode != "tunnel" or w.get("proxy_address"))
        return w if up else None

    return harness.wait_for(joined, 30, f"{worker.name} ready in faden", 0.1)


def running_instance(faden, worker_id: int, model: str, port: int) -> None:
    """A model with GPUStack's fields and one instance of it on `worker_id`, recorded `running`
    on the engine at `port` in GPUStack's shape (`port` and `ports`: this host deploys nothing),
    then waits until faden's gateway routes it."""
    created = harness._check(faden.http.post("/v2/models", json=harness.gpustack_model(model))).json()
    harness._check(faden.http.post("/v2/model-instances", json={
        "model_id": created["id"], "worker_id": worker_id, "state": "running", "port": port,
        "ports": [port], "source": "local_path", "local_path": f"/models/{model}"}))
    harness.wait_routable(faden.gateway_url, faden.admin, model)


def unexpected_errors(worker: harness.RealWorker) -> list[str]:
    log = worker.log_path.read_text(errors="replace")  # every run
    lines = [line for line in log.splitlines() if re.search(r" - (ERROR|CRITICAL) - ", line)]
    return [line for line in lines if not any(e in line for e in EXPECTED_ERRORS)]


def chat_both_ways(faden, model: str, engine_name: str) -> None:
    client = openai.OpenAI(base_url=f"{faden.gateway_url}/v1", api_key=faden.admin, max_retries=0)
    messages = [{"role": "user", "content": "hi"}]
    whole = client.chat.completions.create(model=model, messages=messages)
    assert whole.choices[0].message.content.startswith(f"mock reply from {engine_name}")
    stream = client.chat.completions.create(model=model, messages=messages, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == f"mock reply from {engine_name} 1 2"


@pytest.mark.parametrize("mode", ["direct", "worker", "tunnel"])
def test_gpustacks_worker_process_joins_and_serves(faden, cluster, engine, mode):
    # A tunnel worker's instances listen on an address only its tunnel reaches.
    ip = harness.loopback_ip() if mode == "tunnel" else harness.LOOPBACK
    worker = harness.RealWorker(faden.url, cluster[1], f"real-{mode}", proxy_mode=mode, ip=ip)
    eng = engine(host=ip, name=f"real-engine-{mode}")
    with worker:
        joined = wait_joined(faden, worker)
        assert str(uuid.UUID(joined["worker_uuid"])) == joined["worker_uuid"]
        assert joined["proxy_mode"] == mode and joined["ip"] == ip and joined["port"] == worker.port
        assert joined["metrics_port"] == -1  # --disable-worker-metrics, as GPUStack writes it
        # Its status report is kept (GPUStack's `status` object), and it heartbeats.
        harness.wait_for(lambda: record(faden, worker.name).get("status"), 30, "status reported", 0.2)

        model = f"real-{mode}"
        running_instance(faden, joined["id"], model, eng.port)
        before = len(eng.requests)
        chat_both_ways(faden, model, f"real-engine-{mode}")
        assert len(eng.requests) - before == 2
        if mode == "worker":
            # Through GPUStack's worker proxy, which the client's key does not reach.
            assert eng.requests[-1][2].get("authorization") != f"Bearer {faden.admin}"

        # A restart on the same data directory: the same worker, serving again.
        worker.stop()
        worker.start()
        again = wait_joined(faden, worker)
        assert (again["id"], again["worker_uuid"]) == (joined["id"], joined["worker_uuid"])
        harness.wait_routable(faden.gateway_url, faden.admin, model)
        chat_both_ways(faden, model, f"real-engine-{mode}")
        assert unexpected_errors(worker) == []


def test_the_worker_killed_mid_answer_and_restarted_at_once(faden, cluster, engine):
    """`kill -9` of GPUStack's worker process in the middle of a streamed answer over its tunnel:
    the client's stream fails at once; the worker started again at once serves every request
    from the moment its tunnel is back."""
    ip = harness.loopback_ip()
    worker = harness.RealWorker(faden.url, cluster[1], "real-killed", proxy_mode="tunnel", ip=ip)
    eng = engine(host=ip, name="real-engine-killed", chunks=20, delay=0.5)
    with worker:
        joined = wait_joined(faden, worker)
        model = "real-killed"
        running_instance(faden, joined["id"], model, eng.port)
        headers = {"Authorization": f"Bearer {faden.admin}"}
        body = {"model": model, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        with httpx.Client(base_url=faden.gateway_url, timeout=30, headers=headers) as client:
            with client.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                chunks = r.iter_raw()
                assert b"mock reply" in next(chunks)
                worker.stop(signal.SIGKILL)
                killed = time.monotonic()
                with pytest.raises(httpx.HTTPError):
                    for _ in chunks:
                        pass
                # The answer had 9 s to go: it ended with the worker.
                assert time.monotonic() - killed < 2.0
            worker.start()
            wait_joined(faden, worker)
            answers = [client.post("/v1/chat/completions", json={**body, "stream": False}) for _ in range(10)]
        assert [a.status_code for a in answers] == [200] * 10, [a.text[:200] for a in answers]
        assert unexpected_errors(worker) == []
