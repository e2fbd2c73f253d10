"""`faden gateway` in front of a real GPUStack server (2.3.0 or 2.2.3): synced routing over the
three proxy modes, GPUStack API keys checked with GPUStack, and what happens when GPUStack stops
and returns. Clients are the real `openai` SDK and plain HTTP.

One GPUStack server per session (conftest.py); this module adds three fake workers (direct,
worker, tunnel through GPUStack's own tunnel client), one model with a running instance on each,
and one `faden gateway` synced from GPUStack with an admin key. The outage test stops GPUStack
and must run last.
"""

import time

import httpx
import openai
import pytest

import harness

MODES = ("direct", "worker", "tunnel")
# The key verdict lifetimes the gateway runs with (its defaults).
ALLOWED_TTL = 5.0
REFUSED_TTL = 1.0
# Bound of "a change in GPUStack reaches routing": the requirement, plus the poll step.
ROUTING_BOUND = 1.0


class Gateway(harness.faden_harness.FadenGateway):
    """A `faden gateway` process on 127.0.0.1:0 synced from a GPUStack server, its log in a file."""

    def __init__(self, server_url: str, token: str, *extra: str):
        super().__init__(server_url, token, "--sync-retry-max", "1s", *extra,
                         env={"FADEN_LOG": "info,control=debug"})

    def ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def chat(self, key: str, model: str, stream: bool = False, timeout: float = 10) -> httpx.Response:
        body = {"model": model, "stream": stream, "messages": [{"role": "user", "content": "hi"}]}
        return httpx.post(f"{self.url}/v1/chat/completions", json=body, timeout=timeout,
                          headers={"Authorization": f"Bearer {key}"})


def poll(check, timeout: float, what: str, interval: float = 0.05):
    """(value, seconds) once `check()` is truthy; fails after `timeout`."""
    start = time.monotonic()
    value = harness.wait_for(check, timeout, what, interval=interval)
    return value, time.monotonic() - start


@pytest.fixture(scope="module")
def site(gpustack, engine):
    """Workers in the three modes, a model with a running instance on each, an inference key,
    and the gateway synced from GPUStack."""
    admin = gpustack.admin
    s = type("Site", (), {})()
    s.models, s.engines, s.workers, s.instances = {}, {}, {}, {}
    for mode in MODES:
        ip = harness.loopback_ip() if mode == "tunnel" else "127.0.0.1"
        worker = gpustack.worker(proxy_mode=mode, ip=ip)
        if mode == "tunnel":
            worker.start_tunnel()
        eng = engine(host=ip)
        model = gpustack.unique(f"{mode}-model")
        model_id, instance_id = admin.run_instance(model, eng.port, worker)
        s.models[mode], s.engines[mode], s.workers[mode] = model, eng, worker
        s.instances[mode] = (model_id, instance_id)
    _, s.key = admin.create_api_key(gpustack.unique("client"), scope=["inference"])
    s.gateway = Gateway(gpustack.server.url, admin.key)
    try:
        harness.wait_for(s.gateway.ready, 30, "the gateway ready")
        yield s
    finally:
        s.gateway.close()


def client(site, key=None) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{site.gateway.url}/v1", api_key=key or site.key, max_retries=0, timeout=20)


def test_gateway_is_ready_after_syncing_from_gpustack(site):
    assert site.gateway.ready()
    assert httpx.get(f"{site.gateway.url}/healthz").status_code == 200


@pytest.mark.parametrize("mode", MODES)
def test_chat_streamed_and_not_with_a_gpustack_key(site, mode):
    model, eng = site.models[mode], site.engines[mode]
    answer = client(site).chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
    assert answer.choices[0].message.content.startswith(f"mock reply from {eng.name}")
    stream = client(site).chat.completions.create(model=model, stream=True,
                                                  messages=[{"role": "user", "content": "hi"}])
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text.startswith(f"mock reply from {eng.name}")
    # The client's key never goes upstream; the worker path names the instance.
    _, _, headers, _ = eng.requests[-1]
    assert site.key not in headers.get("authorization", "")
    assert all(site.key not in v for v in headers.values())
    if mode == "worker":
        model_id, instance_id = site.instances[mode]
        assert headers[harness.INSTANCE_HEADER.lower()] == f"model-{model_id}-{instance_id}.static"
        assert site.workers[mode].hits.get("/v1/chat/completions", 0) >= 2


@pytest.mark.parametrize("mode", MODES)
def test_embeddings(site, mode):
    answer = client(site).embeddings.create(model=site.models[mode], input=["a", "b"])
    assert len(answer.data) == 2 and all(d.embedding for d in answer.data)


@pytest.mark.parametrize("mode", MODES)
def test_sse_arrives_byte_for_byte(site, mode):
    eng = site.engines[mode]
    body = {"model": site.models[mode], "stream": True, "messages": [{"role": "user", "content": "hi"}],
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{site.gateway.url}/v1/chat/completions", json=body, timeout=20,
                      headers={"Authorization": f"Bearer {site.key}"}) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        received = b"".join(resp.iter_raw())
    assert received == eng.sent[-1]


@pytest.mark.parametrize("mode", MODES)
def test_sse_is_not_buffered(site, mode):
    """Each event reaches the client as the engine sends it, not with the end of the answer."""
    eng = site.engines[mode]
    eng.delay = 0.3  # after each event; read by the engine per request
    try:
        body = {"model": site.models[mode], "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        arrivals = []
        start = time.monotonic()
        with httpx.stream("POST", f"{site.gateway.url}/v1/chat/completions", json=body, timeout=20,
                          headers={"Authorization": f"Bearer {site.key}"}) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    arrivals.append(time.monotonic() - start)
    finally:
        eng.delay = 0.0
    # 4 events and [DONE], 0.3 s apart at the engine: the first arrives long before the last.
    assert len(arrivals) >= 5, arrivals
    assert arrivals[-1] - arrivals[0] >= 0.9, arrivals


def test_models_lists_every_synced_model(site):
    ids = {m.id for m in client(site).models.list().data}
    assert set(site.models.values()) <= ids


def test_unknown_and_malformed_keys_are_refused_with_401(site, gpustack):
    model = site.models["direct"]
    unknown = "gpustack_0123456789abcdef_0123456789abcdef0123456789abcdef"
    for key in (unknown, "not-a-key"):
        resp = site.gateway.chat(key, model)
        assert resp.status_code == 401, resp.text
        assert resp.json()["error"]["type"] == "authentication_error"
    assert httpx.post(f"{site.gateway.url}/v1/chat/completions", json={"model": model}).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        client(site, unknown).models.list()


def test_a_key_revoked_in_gpustack_is_refused_within_the_allowed_lifetime(site, gpustack):
    key_id, key = gpustack.admin.create_api_key(gpustack.unique("revoked"), scope=["inference"])
    model = site.models["direct"]
    assert site.gateway.chat(key, model).status_code == 200
    gpustack.admin.delete_api_key(key_id)
    _, took = poll(lambda: site.gateway.chat(key, model).status_code == 401, ALLOWED_TTL + 5,
                   "the revoked key refused")
    print(f"measured: revoked key refused {took:.2f} s after its deletion")
    assert took <= ALLOWED_TTL + 0.5, took


def test_an_expired_key_is_refused(site, gpustack):
    _, key = gpustack.admin.create_api_key(gpustack.unique("expiring"), scope=["inference"], expires_in=3)
    model = site.models["direct"]
    assert site.gateway.chat(key, model).status_code == 200
    poll(lambda: site.gateway.chat(key, model).status_code == 401, 3 + ALLOWED_TTL + 5, "the expired key refused")


def test_per_key_model_restriction_and_scope_are_honoured(site, gpustack):
    admin = gpustack.admin
    allowed, other = site.models["direct"], site.models["worker"]
    _, limited = admin.create_api_key(gpustack.unique("limited"), scope=["inference"], allowed_model_names=[allowed])
    assert site.gateway.chat(limited, allowed).status_code == 200
    resp = site.gateway.chat(limited, other)
    assert resp.status_code == 403, resp.text
    assert resp.json()["error"]["code"] == "model_not_allowed"
    assert [m.id for m in client(site, limited).models.list().data] == [allowed]
    _, management = admin.create_api_key(gpustack.unique("management"), scope=["management"])
    assert site.gateway.chat(management, allowed).status_code == 403


def test_a_new_key_works_without_restarting_anything(site, gpustack):
    _, key = gpustack.admin.create_api_key(gpustack.unique("fresh"), scope=["inference"])
    assert site.gateway.chat(key, site.models["tunnel"]).status_code == 200


def test_instance_state_changes_reach_routing_within_a_second(site, gpustack, engine):
    admin = gpustack.admin
    worker = site.workers["direct"]
    eng = engine()
    model = gpustack.unique("lifecycle")
    model_id, instance_id = admin.run_instance(model, eng.port, worker)
    _, took = poll(lambda: site.gateway.chat(site.key, model).status_code == 200, 10, "a new instance routed")
    print(f"measured: new instance reached routing in {took:.2f} s")
    assert took <= ROUTING_BOUND, f"new instance: {took:.2f} s"

    worker.set_instance_state(instance_id, "error", state_message="engine crashed")
    _, took = poll(lambda: site.gateway.chat(site.key, model).status_code == 503, 10, "an errored instance withdrawn")
    print(f"measured: error reached routing in {took:.2f} s")
    assert took <= ROUTING_BOUND, f"error: {took:.2f} s"

    worker.set_instance_state(instance_id, "running")
    _, took = poll(lambda: site.gateway.chat(site.key, model).status_code == 200, 10, "a running instance routed again")
    print(f"measured: running again reached routing in {took:.2f} s")
    assert took <= ROUTING_BOUND, f"running again: {took:.2f} s"

    admin.delete_instance(instance_id)
    _, took = poll(lambda: site.gateway.chat(site.key, model).status_code == 503, 10, "a deleted instance withdrawn")
    print(f"measured: deleted reached routing in {took:.2f} s")
    assert took <= ROUTING_BOUND, f"deleted: {took:.2f} s"
    admin.delete_model(model_id)


def test_a_worker_that_changes_proxy_mode_is_reached_the_new_way(site, gpustack, engine):
    admin = gpustack.admin
    worker = gpustack.worker(proxy_mode="direct")
    eng = engine()
    model = gpustack.unique("switching")
    model_id, _ = admin.run_instance(model, eng.port, worker)
    poll(lambda: site.gateway.chat(site.key, model).status_code == 200, 10, "the direct instance routed")
    assert worker.hits.get("/v1/chat/completions", 0) == 0
    admin.set_worker_proxy_mode(worker, "worker")  # returns once GPUStack's API shows it

    def through_worker_proxy():
        before = worker.hits.get("/v1/chat/completions", 0)
        return site.gateway.chat(site.key, model).status_code == 200 and worker.hits.get("/v1/chat/completions", 0) > before

    # GPUStack itself stores reported statuses every 5 s: count from when its API shows the mode.
    seen = time.monotonic()
    poll(through_worker_proxy, 10, "requests through the worker proxy")
    took = time.monotonic() - seen
    print(f"measured: proxy_mode change reached routing in {took:.2f} s")
    assert took <= ROUTING_BOUND + 0.5
    admin.delete_model(model_id)


def test_a_dead_engine_fails_over_to_the_other_instance(site, gpustack, engine):
    """Two instances of one model on two workers; one engine dies: no client sees it."""
    admin = gpustack.admin
    pair = gpustack.unique("pair")
    # Room for one instance per worker (each claims 1 GiB of VRAM).
    workers = {w.id: w for w in (gpustack.worker(labels={"faden-pair": pair}, gpu_memory=3 * harness.GIB // 2)
                                 for _ in range(2))}
    engines = [engine(), engine()]
    model = gpustack.unique("failover")
    model_id = admin.create_model(model, cluster_id=gpustack.cluster_id, replicas=2,
                                  worker_selector={"faden-pair": pair})

    def placed():
        listed = admin.instances(model_id)
        on = {i.get("worker_id") for i in listed}
        return listed if len(listed) == 2 and on == set(workers) else None

    for inst, eng in zip(harness.wait_for(placed, 60, "one instance on each worker"), engines):
        workers[inst["worker_id"]].serve_instance(inst["id"], eng.port)

    def both_serve():
        site.gateway.chat(site.key, model)
        return all(e.requests for e in engines)

    poll(both_serve, 20, "both instances routed")
    engines[0].stop()
    statuses = [site.gateway.chat(site.key, model).status_code for _ in range(20)]
    assert statuses == [200] * 20, statuses
    admin.delete_model(model_id)


def test_gpustack_stopped_then_restarted(site, gpustack):
    """Last: stops GPUStack. Keys checked recently keep working, new keys get 503, routing stays
    on the last snapshot; after GPUStack returns the gateway converges again."""
    admin = gpustack.admin
    model = site.models["direct"]
    _, fresh = admin.create_api_key(gpustack.unique("after-outage"), scope=["inference"])
    assert site.gateway.chat(site.key, model).status_code == 200

    gpustack.server.stop()
    try:
        # Past the allowed lifetime: the verdict must be re-checked, and cannot be.
        time.sleep(ALLOWED_TTL + 0.5)
        for mode in ("direct", "worker"):
            resp = site.gateway.chat(site.key, site.models[mode])
            assert resp.status_code == 200, (mode, resp.text)
        resp = site.gateway.chat(fresh, model)
        assert resp.status_code == 503, resp.text
        assert resp.json()["error"]["code"] == "auth_unavailable"
        assert "cannot verify" in resp.json()["error"]["message"]
    finally:
        gpustack.server.start()

    # Converged: the new key is checked with GPUStack again, and a change made after the
    # restart reaches routing.
    poll(lambda: site.gateway.chat(fresh, model).status_code == 200, 30, "the new key accepted after the restart")
    harness.wait_for(site.gateway.ready, 60, "the gateway ready after the restart")
    _, instance_id = site.instances["direct"]
    site.workers["direct"].set_instance_state(instance_id, "error", state_message="after restart")
    poll(lambda: site.gateway.chat(site.key, model).status_code == 503, 10, "a change after the restart")
    site.workers["direct"].set_instance_state(instance_id, "running")
    poll(lambda: site.gateway.chat(site.key, model).status_code == 200, 10, "routed again")
