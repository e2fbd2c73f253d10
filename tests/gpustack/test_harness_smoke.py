"""Smoke tests of the harness itself against a real GPUStack, 2.3.0 or 2.2.3 (no faden involved).

Credentials, as GPUStack (2.3.0 and 2.2.3) checks them:
- management API (`/v2/...`) and GPUStack's own OpenAI endpoint (`/v1/...` on `server.url`):
  `Authorization: Bearer <API key>` (or the `gpustack_session` cookie of /auth/login);
- the server's proxy port (the tunnel's entrance; `worker.proxy_address`): `Proxy-Authorization:
  Bearer <key>` or `Authorization: Bearer <key>`, where key is ANY valid unexpired API key of the
  server (admin key, user key, a worker token, the cluster registration token): see
  gpustack/server/server.py `_start_proxy_servers` -> `authenticate_worker_by_request_headers`
  (gpustack/api/auth.py). Target: origin-form plus `X-GPUStack-Model-Instance:
  model-<model_id>-<instance_id>.static` (routed to that instance's `worker_ip:ports[0]`), or
  absolute-form / CONNECT to an ip:port inside a connected tunnel's `<ip>/32`;
- a worker's port (GPUStack's worker proxy, `worker` proxy mode): `Authorization: Bearer <worker
  token or registration token>` plus `X-GPUStack-Model-Instance`.

GPUStack's own server-side OpenAI endpoint (what a benchmark compares faden against): with
`--gateway-mode disabled` the API server itself serves `POST <server.url>/v1/chat/completions`
(and the other /v1 routes, `GET /v1/models`) for any model with a model route and a running
instance. It forwards to `http://<worker ip>:<worker port>/v1/...` with
`X-GPUStack-Model-Instance` (through the proxy port and tunnel for tunnel workers), i.e. through
the worker's proxy whatever the worker's proxy_mode; the FakeWorker serves GPUStack's own worker
proxy for that. Streaming answers are re-framed by GPUStack's Python code.
"""

import json

import httpx
import pytest

import harness

CHAT = {"model": None, "messages": [{"role": "user", "content": "hi"}]}


def chat(model: str, stream: bool = False) -> dict:
    return {**CHAT, "model": model, "stream": stream}


def sse_contents(text: str) -> str:
    out = []
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in json.loads(line[6:]).get("choices", []):
                out.append(choice.get("delta", {}).get("content") or "")
    return "".join(out)


def test_listens_on_loopback_only(gpustack):
    server = gpustack.server
    sockets = server.listening_sockets()
    ports = {port for _, port in sockets}
    assert {server.api_port, server.proxy_port, server.metrics_port} <= ports, sockets
    assert all(addr == "127.0.0.1" for addr, _ in sockets), sockets


def test_admin_key_lists_workers(gpustack):
    resp = httpx.get(f"{gpustack.server.url}/v2/workers", params={"page": -1},
                     headers={"Authorization": f"Bearer {gpustack.admin.key}"})
    assert resp.status_code == 200, resp.text
    assert isinstance(resp.json()["items"], list)
    assert httpx.get(f"{gpustack.server.url}/v2/workers", params={"page": -1}).status_code == 401


def test_api_key_fields(gpustack):
    admin = gpustack.admin
    key_id, value = admin.create_api_key(gpustack.unique("key"), scope=["inference"], expires_in=3600,
                                         allowed_model_names=["some-model"])
    assert value.startswith("gpustack_")
    listed = next(k for k in admin.api_keys() if k["id"] == key_id)
    assert listed["scope"] == ["inference"] and listed["allowed_model_names"] == ["some-model"]
    assert listed["expires_at"] and listed["value"] is None
    # An inference-scoped key may not use the management API.
    assert httpx.get(f"{gpustack.server.url}/v2/workers", headers={"Authorization": f"Bearer {value}"}).status_code in (401, 403)
    admin.delete_api_key(key_id)
    assert all(k["id"] != key_id for k in admin.api_keys())


def test_direct_worker_instance_running(gpustack, engine):
    admin = gpustack.admin
    worker = gpustack.worker(proxy_mode="direct")
    assert worker.token.startswith("gpustack_") and admin.worker(worker.id)["state"] == "ready"
    eng = engine()
    model = gpustack.unique("direct-model")
    model_id, instance_id = admin.run_instance(model, eng.port, worker)

    listed = next(i for i in admin.instances() if i["id"] == instance_id)
    assert listed["state"] == "running" and listed["port"] == eng.port and listed["ports"] == [eng.port]
    assert listed["worker_id"] == worker.id and listed["worker_ip"] == "127.0.0.1"
    assert listed["model_id"] == model_id and listed["model_name"] == model
    assert admin.worker(worker.id)["proxy_mode"] == "direct"

    # GPUStack's own /v1 (through the fake worker's GPUStack worker proxy to the engine).
    auth = {"Authorization": f"Bearer {admin.key}"}
    models = harness.wait_for(
        lambda: [m["id"] for m in httpx.get(f"{gpustack.server.url}/v1/models", headers=auth).json()["data"]],
        30, "the model in GPUStack's /v1/models")
    assert model in models
    resp = httpx.post(f"{gpustack.server.url}/v1/chat/completions", headers=auth, json=chat(model), timeout=30)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"].startswith(f"mock reply from {eng.name}")
    resp = httpx.post(f"{gpustack.server.url}/v1/chat/completions", headers=auth, json=chat(model, True), timeout=30)
    assert resp.status_code == 200 and sse_contents(resp.text).startswith(f"mock reply from {eng.name}")
    headers = eng.requests[-1][2]
    assert headers[harness.INSTANCE_HEADER.lower()] == f"model-{model_id}-{instance_id}.static"
    # The engine sees the worker token (the server's call to the worker proxy, forwarded as is),
    # not the client's key; GPUStack adds stream_options.include_usage by itself.
    assert headers["authorization"] == f"Bearer {worker.token}"
    assert eng.requests[-1][3]["stream_options"] == {"include_usage": True}
    assert worker.hits.get("/v1/chat/completions") == 2


def test_worker_mode_worker_instance_running(gpustack, engine):
    admin = gpustack.admin
    worker = gpustack.worker(proxy_mode="worker")
    eng = engine()
    model_id, instance_id = admin.run_instance(gpustack.unique("worker-model"), eng.port, worker)
    mi = admin.instance(instance_id)
    assert (mi["state"], mi["port"], mi["worker_id"]) == ("running", eng.port, worker.id)
    assert admin.worker(worker.id)["proxy_mode"] == "worker"

    # The worker's port serves GPUStack's worker proxy (what `worker` proxy mode targets).
    url = f"http://{worker.ip}:{worker.port}/v1/chat/completions"
    header = {harness.INSTANCE_HEADER: f"model-{model_id}-{instance_id}.static"}
    resp = httpx.post(url, json=chat("m"), headers={**header, "Authorization": f"Bearer {worker.token}"}, timeout=30)
    assert resp.status_code == 200 and eng.name in resp.text
    resp = httpx.post(url, json=chat("m"), headers={harness.INSTANCE_HEADER: "model-1-999999.static",
                                                     "Authorization": f"Bearer {worker.token}"})
    assert resp.status_code == 404
    assert httpx.post(url, json=chat("m"), headers=header).status_code == 401


def test_tunnel_worker(gpustack, engine):
    admin, server = gpustack.admin, gpustack.server
    ip = harness.loopback_ip()  # one tunnel per ip
    worker = gpustack.worker(proxy_mode="tunnel", ip=ip)
    eng = engine(host=ip)
    model = gpustack.unique("tunnel-model")
    model_id, instance_id = admin.run_instance(model, eng.port, worker)
    assert admin.worker(worker.id).get("proxy_address") is None

    tunnel = worker.start_tunnel()
    w = admin.worker(worker.id)
    assert w["proxy_mode"] == "tunnel" and w["proxy_address"] == server.proxy_url

    proxy = f"http://127.0.0.1:{server.proxy_port}"
    route = {harness.INSTANCE_HEADER: f"model-{model_id}-{instance_id}.static"}
    resp = httpx.post(f"{proxy}/v1/chat/completions", json=chat(model),
                      headers={**route, "Proxy-Authorization": f"Bearer {admin.key}"}, timeout=30)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"].startswith(f"mock reply from {eng.name}")
    resp = httpx.post(f"{proxy}/v1/chat/completions", json=chat(model, True),
                      headers={**route, "Authorization": f"Bearer {worker.token}"}, timeout=30)
    assert resp.status_code == 200 and sse_contents(resp.text).startswith(f"mock reply from {eng.name}")
    assert httpx.post(f"{proxy}/v1/chat/completions", json=chat(model), headers=route).status_code == 401
    # Absolute-form through the proxy to an address inside the tunnel's <ip>/32.
    with httpx.Client(proxy=httpx.Proxy(proxy, headers={"Proxy-Authorization": f"Bearer {admin.key}"})) as c:
        assert c.get(f"http://{ip}:{eng.port}/v1/models", timeout=30).json()["data"][0]["id"] == eng.name
    # GPUStack's own /v1 reaches a tunnel worker through the same proxy.
    resp = httpx.post(f"{server.url}/v1/chat/completions", json=chat(model),
                      headers={"Authorization": f"Bearer {admin.key}"}, timeout=30)
    assert resp.status_code == 200 and eng.name in resp.text

    tunnel.stop()
    admin.wait_worker(worker.id, lambda w: w.get("proxy_address") is None, "proxy_address cleared", 20)
    resp = httpx.post(f"{proxy}/v1/chat/completions", json=chat(model),
                      headers={**route, "Proxy-Authorization": f"Bearer {admin.key}"}, timeout=30)
    assert resp.status_code == 502


def test_proxy_mode_instance_state_and_deletes(gpustack, engine):
    admin = gpustack.admin
    worker = gpustack.worker(proxy_mode="worker")
    eng = engine()
    model_id, instance_id = admin.run_instance(gpustack.unique("state-model"), eng.port, worker)

    assert admin.set_worker_proxy_mode(worker, "direct")["proxy_mode"] == "direct"

    assert admin.set_instance_state(instance_id, "error", "boom")["state"] == "error"
    mi = admin.instance(instance_id)
    assert (mi["state"], mi["state_message"], mi["port"]) == ("error", "boom", eng.port)
    assert admin.set_instance_state(instance_id, "running")["state"] == "running"

    admin.delete_instance(instance_id)
    replacement = harness.wait_for(
        lambda: next((i for i in admin.instances(model_id) if i["id"] != instance_id), None),
        30, "a replacement instance")
    assert replacement["port"] is None and replacement["state"] in ("pending", "analyzing", "scheduled")
    assert all(i["id"] != instance_id for i in admin.instances(model_id))

    admin.delete_model(model_id)
    harness.wait_for(lambda: not admin.instances(model_id), 30, "the model's instances gone")
