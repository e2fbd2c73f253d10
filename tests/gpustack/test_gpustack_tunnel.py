"""GPUStack's own tunnel client (`gpustack.websocket_proxy.message_client.MessageClient`, as a
GPUStack 2.3 worker in `tunnel` mode runs it) connected to a `faden server`: many sessions at
once over one tunnel, and the tunnel going away in the middle of an answer."""

import asyncio
import time

import httpx
import pytest

import harness
from test_gpustack_workers import joined, model_with_instance, wait_routable


@pytest.fixture(scope="module")
def faden():
    # A thousand clients from one address: no per-source cap on pending connections (as behind
    # a load balancer).
    with harness.FadenServer("--max-pending-per-source", "0") as server:
        yield server


@pytest.fixture(scope="module")
def cluster(faden):
    return faden.cluster("gpustack-tunnel")


def test_a_thousand_sessions_at_once_over_one_tunnel(faden, cluster, engine):
    ip = harness.loopback_ip()
    worker = joined(faden, cluster, "many-1", proxy_mode="tunnel", ip=ip)
    eng = engine(host=ip, name="many", chunks=3, delay=10)
    try:
        model = "gpustack-many"
        model_with_instance(faden, worker, eng.port, model)
        wait_routable(faden.gateway_url, faden.admin, model)
        n = 1000
        body = {"model": model, "stream": True, "messages": [{"role": "user", "content": "hi"}]}

        async def one(client: httpx.AsyncClient) -> str:
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200, await r.aread()
                return (await r.aread()).decode()

        async def run() -> list:
            limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
            async with httpx.AsyncClient(base_url=faden.gateway_url, limits=limits, timeout=60,
                                         headers={"Authorization": f"Bearer {faden.admin}"}) as client:
                return await asyncio.gather(*(one(client) for _ in range(n)), return_exceptions=True)

        started = time.monotonic()
        results = asyncio.run(run())
        elapsed = time.monotonic() - started
        failed = [r for r in results if not isinstance(r, str) or "[DONE]" not in r]
        assert not failed, f"{len(failed)} of {n} failed, e.g. {failed[:3]}"
        # Each answer takes 20 s at the engine: they ran side by side, one session each (the
        # Python end, GPUStack's client beside 1,000 engine threads and clients, needs time to open
        # them all).
        assert eng.max_in_flight == n, (eng.max_in_flight, elapsed)
        print(f"{n} streams over one GPUStack tunnel in {elapsed:.1f} s, "
              f"{eng.max_in_flight} at once at the engine")
    finally:
        worker.stop()


def test_the_tunnel_going_away_mid_answer_fails_it_at_once(faden, cluster, engine):
    ip = harness.loopback_ip()
    worker = joined(faden, cluster, "cut-1", proxy_mode="tunnel", ip=ip)
    eng = engine(host=ip, name="cut", chunks=20, delay=0.5)
    try:
        model = "gpustack-cut"
        model_with_instance(faden, worker, eng.port, model)
        wait_routable(faden.gateway_url, faden.admin, model)
        body = {"model": model, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        with httpx.Client(base_url=faden.gateway_url, timeout=30,
                          headers={"Authorization": f"Bearer {faden.admin}"}) as client:
            with client.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                chunks = r.iter_raw()
                assert b"mock reply" in next(chunks)
                worker.tunnel.stop()
                cut = time.monotonic()
                with pytest.raises(httpx.HTTPError):
                    for _ in chunks:
                        pass
                # The answer had 9 s to go: it ended with the tunnel, not with the engine.
                assert time.monotonic() - cut < 2.0
        # Back at once: the first request once the tunnel is up again succeeds.
        worker.start_tunnel(timeout=15)
        again = httpx.post(f"{faden.gateway_url}/v1/chat/completions", timeout=30,
                           json={**body, "stream": False}, headers={"Authorization": f"Bearer {faden.admin}"})
        assert again.status_code == 200, again.text
    finally:
        worker.stop()


def test_a_standalone_gateway_reaches_it_through_the_proxy_port(faden, cluster, engine):
    """`faden gateway` synced from the faden server reaches a GPUStack-dialect tunnel worker
    through the server's proxy port (origin-form with `X-GPUStack-Model-Instance`)."""
    from test_faden_gateway import Gateway

    ip = harness.loopback_ip()
    worker = joined(faden, cluster, "standalone-1", proxy_mode="tunnel", ip=ip)
    eng = engine(host=ip, name="standalone")
    gateway = Gateway(faden.url, faden.admin)
    try:
        model = "gpustack-standalone"
        model_with_instance(faden, worker, eng.port, model)
        assert worker.info()["proxy_address"] == f"http://127.0.0.1:{faden.proxy_port}"
        wait_routable(gateway.url, faden.admin, model)
        whole = gateway.chat(faden.admin, model)
        assert whole.status_code == 200 and "mock reply from standalone" in whole.text, whole.text
        streamed = gateway.chat(faden.admin, model, stream=True)
        assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n"), streamed.text
        # The engine saw neither the client's key nor a worker credential.
        assert "authorization" not in eng.requests[-1][2], eng.requests[-1][2]
        assert "x-gpustack-model-instance" not in eng.requests[-1][2]
    finally:
        gateway.stop()
        worker.stop()
