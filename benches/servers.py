"""Three `faden server` processes on one PostgreSQL: the cost of the proxy-port hop, and of 1,000
heartbeating workers spread over the servers.

Run it through benches/servers.sh (release build). It starts a private PostgreSQL, three servers
on it (A, B, C), `faden mock-engine` and one tunnel `faden worker` whose tunnel ends on A.

- hop: faden-loadtest through A's gateway (the owner: the tunnel in process) and through B's
  (one hop: B's gateway to A's proxy port, then the tunnel), in interleaved rounds, at c=1 and
  c=16 with kept-alive connections (POST chat completion, 8 tokens). CPU per request of A and B
  comes from /proc (user + system ticks over the run).
- heartbeats: 1,000 workers registered through the three servers in turn, each heartbeating its
  own server every --heartbeat-interval over one kept-alive connection, for --heartbeat-window.
  Reports the CPU of each server and of PostgreSQL (every process of the cluster) over the
  window, and the heartbeats answered.

Prints one JSON line per run and the medians over rounds.
"""

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "gpustack"))

import harness  # noqa: E402
from proc_cpu import TCK, ticks  # noqa: E402

RELEASE = ROOT / "target" / "release"
LOADS = [("c=1", 1), ("c=16", 16)]


def loadtest(url, key, conc, duration, out):
    args = [str(RELEASE / "faden-loadtest"), "--url", url, "--model", "bench", "--api-key", key,
            "-c", str(conc), "-d", duration, "--warmup", "1s", "--no-progress", "--json", out,
            "--max-tokens", "8"]
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300)
    return json.load(open(out))


def cluster_pids(pg) -> list:
    """The postmaster of `pg` and every process it started."""
    master = int((pg.root / "data" / "postmaster.pid").read_text().split()[0])
    pids = [master]
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == master:
            pids.append(int(stat.parent.name))
    return pids


async def heartbeat_worker(host, port, token, interval, until, counts, offset):
    """One worker: a kept-alive connection, a heartbeat every `interval`, first after `offset`."""
    request = (f"POST /v2/worker-heartbeat HTTP/1.1\r\nHost: {host}:{port}\r\n"
               f"Authorization: Bearer {token}\r\nContent-Type: application/json\r\n"
               "Content-Length: 2\r\n\r\n{}").encode()
    await asyncio.sleep(offset)
    reader, writer = await asyncio.open_connection(host, port)
    try:
        while time.monotonic() < until:
            started = time.monotonic()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value.strip())
            if length:
                await reader.readexactly(length)
            counts["ok" if head.startswith(b"HTTP/1.1 204") else "failed"] += 1
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))
    finally:
        writer.close()


async def heartbeats(servers, tokens, interval, window):
    counts = {"ok": 0, "failed": 0}
    until = time.monotonic() + window
    tasks = []
    for i, token in enumerate(tokens):
        server = servers[i % len(servers)]
        offset = interval * i / len(tokens)
        tasks.append(heartbeat_worker(harness.LOOPBACK, server.api_port, token, interval, until, counts,
                                      offset))
    await asyncio.gather(*tasks)
    return counts


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", default="10s")
    ap.add_argument("--workers", type=int, default=1000)
    ap.add_argument("--heartbeat-interval", type=float, default=5.0,
                    help="seconds between a worker's heartbeats (faden worker's default is 30)")
    ap.add_argument("--heartbeat-window", type=float, default=30.0)
    opts = ap.parse_args()

    os.environ.setdefault("FADEN_BIN", str(RELEASE / "faden"))
    tmp = Path(tempfile.mkdtemp(prefix="faden-servers-bench-"))
    pg = harness.Postgres(database="faden").start()
    servers, procs = [], []
    try:
        for _ in range(3):
            servers.append(harness.FadenServer("--database-url", pg.url, "--worker-threads", "1"))
        a, b = servers[0], servers[1]
        _, reg = a.cluster("bench")
        harness._check(a.http.post("/v2/models", json={"name": "bench"}))
        key = harness._check(a.http.post("/v2/api-keys", json={"name": "bench"})).json()["value"]
        port = harness.free_port(harness.LOOPBACK)
        procs.append(subprocess.Popen([str(RELEASE / "faden"), "mock-engine", "--host", harness.LOOPBACK,
                                       "--port", str(port), "--worker-threads", "1", "--log", "warn"],
                                      stdout=subprocess.DEVNULL))
        procs.append(subprocess.Popen(
            [str(RELEASE / "faden"), "worker", "--server-url", a.url, "--token", reg, "--proxy-mode",
             "tunnel", "--worker-ip", harness.LOOPBACK, "--worker-port", "0", "--disable-worker-metrics",
             "--instance", f"bench={port}", "--data-dir", str(tmp / "worker"), "--worker-threads", "1",
             "--log", "warn"], stdout=subprocess.DEVNULL))
        targets = {"owner (A)": a, "one hop (B -> A)": b}
        for name, server in targets.items():
            harness.wait_for(lambda: loadtest(server.gateway_url + "/v1", key, 1, "1s",
                                              str(tmp / "w.json"))["ok"] > 0, 60, f"{name} serving")
        rows = []
        for rnd in range(opts.rounds):
            for load, conc in LOADS:
                for name, server in targets.items():
                    pids_a, pids_b = [a.proc.pid], [b.proc.pid]
                    a0, b0 = ticks(pids_a), ticks(pids_b)
                    r = loadtest(server.gateway_url + "/v1", key, conc, opts.duration, str(tmp / "r.json"))
                    cpu_a, cpu_b, ok = ticks(pids_a) - a0, ticks(pids_b) - b0, r["ok"]
                    per = (lambda t: t * 1e6 / TCK / ok if ok else None)
                    row = {"round": rnd, "load": load, "path": name, "ok": ok, "errors": r["error_total"],
                           "rps": r["rps"], "p50_ms": (r.get("latency") or {}).get("p50_ms"),
                           "p99_ms": (r.get("latency") or {}).get("p99_ms"),
                           "a_cpu_us_per_req": per(cpu_a), "b_cpu_us_per_req": per(cpu_b),
                           "servers_cpu_us_per_req": per(cpu_a + cpu_b)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        summarize(rows)

        tokens = []
        for i in range(opts.workers):
            server = servers[i % 3]
            w = harness._check(server.http.post("/v2/workers", headers={"Authorization": f"Bearer {reg}"},
                                                json={"name": f"hb-{i}", "ip": "127.0.0.2",
                                                      "proxy_mode": "direct"})).json()
            tokens.append(w["token"])
        pids = [[s.proc.pid] for s in servers] + [cluster_pids(pg)]
        before = [ticks(p) for p in pids]
        started = time.monotonic()
        counts = asyncio.run(heartbeats(servers, tokens, opts.heartbeat_interval, opts.heartbeat_window))
        elapsed = time.monotonic() - started
        used = [(ticks(p) - t0) / TCK for p, t0 in zip(pids, before)]
        print(json.dumps({
            "heartbeats": counts, "workers": opts.workers, "interval_s": opts.heartbeat_interval,
            "window_s": round(elapsed, 1), "per_s": round(counts["ok"] / elapsed, 1),
            "cpu_percent": {name: round(100 * u / elapsed, 2)
                            for name, u in zip(["A", "B", "C", "postgres"], used)},
        }))
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
        for s in servers:
            s.close()
        pg.stop()


def summarize(rows):
    def med(load, path, field):
        vals = [r[field] for r in rows if r["load"] == load and r["path"] == path and r[field] is not None]
        return statistics.median(vals) if vals else None

    print("\nmedians over rounds")
    fields = ["rps", "p50_ms", "p99_ms", "a_cpu_us_per_req", "b_cpu_us_per_req", "servers_cpu_us_per_req",
              "errors"]
    for load, _ in LOADS:
        for path in ("owner (A)", "one hop (B -> A)"):
            shown = {f: med(load, path, f) for f in fields}
            print(load, path, json.dumps({k: round(v, 3) for k, v in shown.items() if v is not None}))
        owner, hop = (med(load, p, "p50_ms") for p in ("owner (A)", "one hop (B -> A)"))
        co, ch = (med(load, p, "servers_cpu_us_per_req") for p in ("owner (A)", "one hop (B -> A)"))
        if owner and hop and co and ch:
            print(f"{load} the hop adds {hop - owner:.3f} ms at p50 and {ch - co:.0f} us of server CPU per request")


if __name__ == "__main__":
    main()
