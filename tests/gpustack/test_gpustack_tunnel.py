"""GPUStack's own tunnel client (`gpustack.websocket_proxy.message_client.MessageClient`, as a
GPUStack 2.3 or 2.2 worker in `tunnel` mode runs it) connected to a `faden server`: many sessions at
once over one tunnel, the tunnel going away in the middle of an answer, a new tunnel replacing a
silent one, the proxy port's target forms, and a slow reader beside a fast one."""

import asyncio
import contextlib
import json
import socket
import threading
import time

import httpx
import pytest

import harness
from test_gpustack_workers import joined, model_with_instance
from harness import wait_routable

# A thousand clients from one address: no per-source cap on pending connections (as behind a
# load balancer).
FADEN_ARGS = ("--max-pending-per-source", "0")





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
        gateway.close()
        worker.stop()


def proxy_exchange(port: int, head: str, then: bytes = b"") -> tuple[str, bytes]:
    """Sends `head` to the proxy port (then `then` once a CONNECT is answered 200) and returns
    the status line and what follows, read until the peer closes (or 10 s)."""
    with socket.create_connection((harness.LOOPBACK, port), timeout=10) as s:
        s.sendall(head.encode())
        got = b""
        while b"\r\n\r\n" not in got:
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
        status, _, rest = got.partition(b"\r\n")
        if then and b" 200 " in status + b" ":
            s.sendall(then)
        with contextlib.suppress(socket.timeout):
            while chunk := s.recv(65536):
                rest += chunk
        return status.decode(), rest


def test_the_proxy_port_takes_gpustacks_target_forms(faden, cluster, engine):
    """GPUStack's proxy port takes `CONNECT <worker ip>:<port>` and absolute-form
    `http://<worker ip>:<port>/…`; faden's takes them for a GPUStack worker's running instances
    only (GPUStack's takes any port in the worker's ranges)."""
    ip = harness.loopback_ip()
    worker = joined(faden, cluster, "forms-1", proxy_mode="tunnel", ip=ip)
    eng = engine(host=ip, name="forms")
    try:
        model = "gpustack-forms"
        model_with_instance(faden, worker, eng.port, model)
        wait_routable(faden.gateway_url, faden.admin, model)
        auth = f"Proxy-Authorization: Bearer {faden.admin}\r\n"
        body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]})
        request = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {ip}:{eng.port}\r\nConnection: close\r\n"
                   f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}")
        absolute = request.replace("POST /v1/", f"POST http://{ip}:{eng.port}/v1/", 1).replace(
            "Connection: close\r\n", "Connection: close\r\n" + auth, 1)
        status, rest = proxy_exchange(faden.proxy_port, absolute)
        assert " 200 " in status and b"mock reply from forms" in rest, (status, rest)
        assert "proxy-authorization" not in eng.requests[-1][2]
        status, rest = proxy_exchange(
            faden.proxy_port, f"CONNECT {ip}:{eng.port} HTTP/1.1\r\nHost: {ip}:{eng.port}\r\n{auth}\r\n",
            request.encode())
        assert " 200 " in status and b"mock reply from forms" in rest, (status, rest)
        # Not an instance's port (the worker's own API port, a free port), not the worker, no key.
        for target in (f"{ip}:{worker.port}", f"{ip}:{harness.free_port()}", f"127.0.0.1:{eng.port}"):
            status, _ = proxy_exchange(faden.proxy_port, f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n{auth}\r\n")
            assert " 403 " in status, (target, status)
        status, _ = proxy_exchange(faden.proxy_port, f"CONNECT {ip}:{eng.port} HTTP/1.1\r\nHost: x\r\n\r\n")
        assert " 407 " in status, status
    finally:
        worker.stop()


def test_a_new_tunnel_replaces_a_silent_one_without_failed_requests(faden, cluster, engine):
    """The worker's tunnel client comes back while the server still holds its old tunnel (a
    restarted worker whose old connection nobody has seen die): the new tunnel takes over at
    once and every request from then on is served, none through the old one."""
    ip = harness.loopback_ip()
    worker = joined(faden, cluster, "replace-1", proxy_mode="tunnel", ip=ip)
    eng = engine(host=ip, name="replace")
    old = worker.tunnel
    try:
        model = "gpustack-replace"
        model_with_instance(faden, worker, eng.port, model)
        wait_routable(faden.gateway_url, faden.admin, model)
        headers = {"Authorization": f"Bearer {faden.admin}"}
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
        with httpx.Client(base_url=faden.gateway_url, timeout=10, headers=headers) as client:
            # Warm the gateway's pool: idle sessions on the old tunnel.
            for _ in range(4):
                assert client.post("/v1/chat/completions", json=body).status_code == 200
            # The old client stops reading and answering, its connection open.
            old.loop.call_soon_threadsafe(time.sleep, 8)
            replaced = faden.log_path.read_text().count("tunnel replaced by a new one")
            new = harness.Tunnel(worker).start()
            worker.tunnel = new
            harness.wait_for(lambda: faden.log_path.read_text().count("tunnel replaced by a new one") > replaced,
                             10, "the new tunnel up", 0.02)
            answers = [client.post("/v1/chat/completions", json=body) for _ in range(20)]
            with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
                answers.append(r)
                r.read()
        failed = [(a.status_code, a.text[:200]) for a in answers if a.status_code != 200]
        assert not failed, f"{len(failed)} of {len(answers)} failed: {failed[:3]}"
        # The old client is cancelled before it wakes, so it does not come back in its turn.
        old.stop(timeout=15)
    finally:
        worker.stop()


def test_a_slow_reader_ends_its_own_session_and_nothing_else(faden, cluster, engine):
    """A client that stops reading a large answer relayed over GPUStack's tunnel: GPUStack's
    client keeps sending (its protocol has no flow control), faden's server queues at most 1 MiB
    for that session, then ends it; a fast client of the same tunnel is served all along, and
    the server's memory does not grow with the answer."""
    ip = harness.loopback_ip()
    worker = joined(faden, cluster, "slow-1", proxy_mode="tunnel", ip=ip)
    fast = engine(host=ip, name="fast")
    size = 64 * 1024 * 1024
    big = BigAnswer(ip, size)
    try:
        model_with_instance(faden, worker, fast.port, "gpustack-fast")
        big_model = "gpustack-big"
        model_with_instance(faden, worker, big.port, big_model)
        wait_routable(faden.gateway_url, faden.admin, "gpustack-fast")
        rss_before = rss_kib(faden.proc.pid)
        auth = f"Proxy-Authorization: Bearer {faden.admin}\r\n"
        slow = socket.create_connection((harness.LOOPBACK, faden.proxy_port), timeout=10)
        # The smallest receive buffer: the client stops reading after the 200.
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        slow.sendall(f"CONNECT {ip}:{big.port} HTTP/1.1\r\nHost: x\r\n{auth}\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            head += slow.recv(1)
        assert head.startswith(b"HTTP/1.1 200"), head
        slow.sendall(f"GET /big HTTP/1.1\r\nHost: {ip}:{big.port}\r\n\r\n".encode())
        headers = {"Authorization": f"Bearer {faden.admin}"}
        body = {"model": "gpustack-fast", "messages": [{"role": "user", "content": "hi"}]}
        with httpx.Client(base_url=faden.gateway_url, timeout=5, headers=headers) as client:
            # Until the big answer is all sent by the engine end (the worker dropped it or faden
            # ended the session), the fast model keeps answering.
            served = 0
            while not big.done.is_set() and served < 2000:
                assert client.post("/v1/chat/completions", json=body).status_code == 200
                served += 1
            assert big.done.wait(30), "the big answer never finished"
            for _ in range(20):
                assert client.post("/v1/chat/completions", json=body).status_code == 200
        # The slow session was ended: what the client can still read is far short of the answer.
        slow.settimeout(10)
        got = 0
        with contextlib.suppress(ConnectionError):
            while chunk := slow.recv(1 << 20):
                got += len(chunk)
        slow.close()
        assert got < size // 4, got
        grown = rss_kib(faden.proc.pid) - rss_before
        assert grown < 32 * 1024, f"the server grew {grown} KiB for a {size >> 20} MiB answer"
        print(f"served {served} fast requests meanwhile; the slow client got {got} of {size} bytes; "
              f"server RSS +{grown} KiB")
    finally:
        big.stop()
        worker.stop()


def rss_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


class BigAnswer:
    """An HTTP/1.1 server on `ip` whose every answer is `size` bytes, sent as fast as the peer
    takes them; `done` is set once a send ends (completed or cut)."""

    def __init__(self, ip: str, size: int):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.done = threading.Event()
        outer = self
        block = b"x" * (1 << 20)

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                try:
                    self.send_response(200)
                    self.send_header("Content-Length", str(size))
                    self.end_headers()
                    for _ in range(size // len(block)):
                        self.wfile.write(block)
                except OSError:
                    pass
                finally:
                    outer.done.set()

        self.httpd = ThreadingHTTPServer((ip, 0), Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()
