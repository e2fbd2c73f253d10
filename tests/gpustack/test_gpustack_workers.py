"""GPUStack workers (2.3.0 or 2.2.3) joining a `faden server`, driven by GPUStack's own
worker-side code.

These drive the worker's calls one by one with `harness.FakeWorker`, so that a test can tell
each step apart (test_real_worker.py runs GPUStack's whole worker process): GPUStack's client
classes making the worker's calls (registration through
`registration_client`, `WorkerStatusClient`, heartbeats, `ModelInstanceClient` GET + PUT of the
whole instance as `serve_manager` does) and GPUStack's own worker API (`/healthz` and its worker
reverse proxy) on the worker's port, with mock engines as instances. Every answer faden gives is
read through GPUStack's response models (the client classes validate them). No GPUStack server
takes part: these tests need only the venv and the faden binary.
"""

import json
import tempfile
import uuid

import httpx
import openai
import pytest

import harness




def joined(faden, cluster, name, proxy_mode="direct", data_dir=None, ip=harness.LOOPBACK) -> harness.FakeWorker:
    worker = harness.FakeWorker(faden.url, cluster[1], name, proxy_mode=proxy_mode, interval=2,
                                data_dir=data_dir, ip=ip)
    worker.start(timeout=15)
    if proxy_mode == "tunnel":
        # GPUStack's own tunnel client; faden sets proxy_address once the tunnel is up.
        worker.start_tunnel(timeout=15)
    return worker


def model_with_instance(faden, worker: harness.FakeWorker, engine_port: int, name: str) -> int:
    """A model with one instance on `worker`, made by the administrator with GPUStack's source
    fields (what GPUStack's serve manager reads), then served by the worker itself."""
    model = harness._check(faden.http.post("/v2/models", json=harness.gpustack_model(name))).json()
    # The worker reads it as GPUStack's `ModelPublic` (its client validates the answer).
    assert worker.clientset.models.get(id=model["id"]).source == "local_path"
    inst = harness._check(faden.http.post("/v2/model-instances", json={
        "model_id": model["id"], "worker_id": worker.id, "source": "local_path",
        "local_path": f"/models/{name}"})).json()
    served = worker.serve_instance(inst["id"], engine_port)
    assert served["state"] == "running" and served["ports"] == [engine_port], served
    return inst["id"]


def test_registration_answers_gpustacks_models(faden, cluster):
    from gpustack.schemas.workers import WorkerPublic

    worker = joined(faden, cluster, "reg-1")
    try:
        # `start()` went through WorkerRegistrationClient (it validates the answer as
        # WorkerRegistrationPublic) and waited for `ready` through GET /v2/workers/{id}.
        assert uuid.UUID(worker.worker_uuid).version == 4, worker.worker_uuid
        info = worker.info()
        WorkerPublic.model_validate(info)
        assert info["cluster_id"] == cluster[0] and info["ip"] == worker.ip
        assert info["status"]["gpu_devices"][0]["name"] == "NVIDIA A100 (fake)"
        # What the worker sent that faden does not use comes back as sent.
        assert info["system_reserved"] == {"ram": 0, "vram": 0}
    finally:
        worker.stop()


def test_a_restarted_worker_re_registers_with_the_clusters_token(faden, cluster):
    data_dir = tempfile.mkdtemp(prefix="gpustack-worker-")
    first = joined(faden, cluster, "restart-1", data_dir=data_dir)
    first_id, first_uuid, first_token = first.id, first.worker_uuid, first.token
    first.stop()
    # The same data directory: GPUStack's registration_client wraps a registration token that
    # does not start with `gpustack`; faden's have GPUStack's shape, so it goes as it is.
    assert cluster[1].startswith("gpustack_")
    again = harness.FakeWorker(faden.url, cluster[1], "restart-1", interval=2, data_dir=data_dir)
    try:
        again.start(timeout=15)
        assert again.presented_token == f"Bearer {cluster[1]}"
        assert (again.id, again.worker_uuid) == (first_id, first_uuid)
        assert again.token != first_token
        # The old worker token is gone with the re-registration.
        old = httpx.get(f"{faden.url}/v2/workers/{first_id}", headers={"Authorization": f"Bearer {first_token}"})
        assert old.status_code == 401, old.text
        # A wrapped token (how a worker presents one of the `fdnr_` tokens faden issued before)
        # whose inside is not the cluster's is refused.
        bad = httpx.post(f"{faden.url}/v2/workers", json={"name": "x", "ip": "127.0.0.1"},
                         headers={"Authorization": f"Bearer gpustack_{first_uuid}_fdnr_{'0' * 16}_{'0' * 32}"})
        assert bad.status_code == 401, bad.text
    finally:
        again.stop()


def test_status_reports_move_the_worker(faden, cluster):
    worker = joined(faden, cluster, "status-1")
    try:
        assert worker.info()["proxy_mode"] == "direct"
        worker.proxy_mode = "worker"
        worker.advertise_address = "127.0.0.1"
        worker.post_status()
        info = worker.info()
        assert (info["proxy_mode"], info["advertise_address"]) == ("worker", "127.0.0.1"), info
        # A status report is the worker's own: another worker's token cannot send one for it,
        # an administrator's neither.
        refused = faden.http.post("/v2/worker-status", json=json.loads(worker.status().model_dump_json()))
        assert refused.status_code == 403, refused.text
        # An unknown key is still refused, by name.
        bad = worker.clientset.http_client.get_httpx_client().post(
            "/worker-status", json={**json.loads(worker.status().model_dump_json()), "surprise": 1})
        assert bad.status_code == 422 and "surprise" in bad.text, bad.text
    finally:
        worker.stop()


def test_workers_read_and_change_only_their_own(faden, cluster, engine):
    mine = joined(faden, cluster, "own-1")
    other = joined(faden, cluster, "own-2")
    try:
        inst_id = model_with_instance(faden, other, engine().port, "own-model")
        from gpustack.schemas.models import ModelInstancePublic

        ModelInstancePublic.model_validate(other.clientset.model_instances.get(id=inst_id).model_dump())
        http = mine.clientset.http_client.get_httpx_client()
        assert http.get(f"/workers/{other.id}").status_code == 403
        assert http.get(f"/model-instances/{inst_id}").status_code == 404
        stolen = harness.update_instance(other.clientset, inst_id)  # the owner's own read
        stolen["worker_id"] = mine.id
        assert http.put(f"/model-instances/{inst_id}", json=stolen).status_code == 403
        stolen["worker_id"] = other.id
        assert http.put(f"/model-instances/{inst_id}", json=stolen).status_code == 403
    finally:
        mine.stop()
        other.stop()


@pytest.mark.parametrize("mode", ["direct", "worker", "tunnel"])
def test_inference_through_fadens_gateway(faden, cluster, engine, mode):
    # A tunnel worker's instances listen on its own address, which only its tunnel reaches.
    ip = harness.loopback_ip() if mode == "tunnel" else harness.LOOPBACK
    worker = joined(faden, cluster, f"infer-{mode}", proxy_mode=mode, ip=ip)
    eng = engine(host=ip, name=f"engine-{mode}")
    try:
        model = f"gpustack-{mode}"
        inst_id = model_with_instance(faden, worker, eng.port, model)
        assert faden.http.get(f"/v2/model-instances/{inst_id}").json()["state"] == "running"
        harness.wait_routable(faden.gateway_url, faden.admin, model)
        before = worker.hits.get("/v1/chat/completions", 0)
        client = openai.OpenAI(base_url=f"{faden.gateway_url}/v1", api_key=faden.admin, max_retries=0)
        whole = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
        assert whole.choices[0].message.content.startswith(f"mock reply from engine-{mode}")
        stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == f"mock reply from engine-{mode} 1 2"
        # The path the request took: GPUStack's worker proxy saw it only in `worker` mode.
        through_proxy = worker.hits.get("/v1/chat/completions", 0) - before
        assert through_proxy == (2 if mode == "worker" else 0), worker.hits
        if mode == "worker":
            seen = eng.requests[-1][2]
            assert seen.get("authorization") != f"Bearer {faden.admin}"  # the client's key stays
        if mode == "tunnel":
            # The path is the tunnel: without it the model is unreachable, with it back it serves.
            worker.tunnel.stop()
            worker.wait(lambda w: not w.get("proxy_address"), "proxy_address cleared", 10)
            gone = httpx.post(f"{faden.gateway_url}/v1/chat/completions", headers={"Authorization": f"Bearer {faden.admin}"},
                              json={"model": model, "messages": [{"role": "user", "content": "hi"}]})
            assert gone.status_code in (502, 503), gone.text
            worker.start_tunnel(timeout=15)
            back = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
            assert back.choices[0].message.content.startswith(f"mock reply from engine-{mode}")
    finally:
        worker.stop()


def test_a_worker_watches_its_own_instance(faden, cluster, engine):
    """GPUStack's backends wait for `starting` with `model_instances.watch(params={"id": …})`
    (`_until_model_instance_starting`): through faden's filtered watch, with GPUStack's Event."""
    import threading

    worker = joined(faden, cluster, "watch-1")
    try:
        model = harness._check(faden.http.post("/v2/models", json={"name": "watched"})).json()
        inst = harness._check(faden.http.post("/v2/model-instances", json={
            "model_id": model["id"], "worker_id": worker.id, "source": "local_path",
            "local_path": "/models/watched"})).json()
        seen = []

        def watch():
            worker.clientset.model_instances.watch(
                callback=lambda e: seen.append((e.type, e.data["id"], e.data["state"])),
                stop_condition=lambda e: e.data["state"] == "running",
                params={"id": inst["id"]})

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        harness.wait_for(lambda: seen, 10, "the snapshot event")
        worker.serve_instance(inst["id"], engine().port)
        watcher.join(10)
        assert not watcher.is_alive(), seen
        assert [s[1] for s in seen] == [inst["id"]] * len(seen)
        assert [s[2] for s in seen] == ["pending", "starting", "running"], seen
    finally:
        worker.stop()
