"""GPUStack's own tunnel client connected to a GPUStack 2.3.0 server against the same client
connected to a `faden server`, side by side in one run, to the same engine.

Run it through benches/gpustack_tunnel.sh (release build, the GPUStack venv). It starts a private
PostgreSQL and a real GPUStack server, a `faden server`, and `faden mock-engine` on a loopback
address of its own. Two fake workers (tests/gpustack/harness.py) claim that address, one
registered with each server, each running GPUStack's `MessageClient` in this process. Then, in
interleaved rounds, faden-loadtest drives each target with keep-alive requests through a
`CONNECT` tunnel of the server's proxy port:

- `engine`: the mock engine itself (the floor);
- `gpustack`: GPUStack's proxy port, `CONNECT <engine ip>:<port>`, relayed over GPUStack's
  server end of the tunnel;
- `faden`: faden's proxy port, the same `CONNECT`, relayed over faden's server end of GPUStack's
  dialect.

Loads: closed loop at c=1 and c=16 over kept-alive tunnels, and at c=16 with a new connection
and `CONNECT` (so a new session) per request, as callers that keep nothing alive pay (POST chat
completion, 8 tokens). CPU per request of each
server process comes from /proc (user + system ticks over the run): GPUStack's server processes,
or the faden server. The worker side (GPUStack's tunnel client, in this process) is the same code
for both and is reported apart. Prints one JSON line per run and the medians over rounds.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "gpustack"))

import harness  # noqa: E402
from proc_cpu import TCK, ticks  # noqa: E402

RELEASE = ROOT / "target" / "release"
# (label, connections, a new connection per request)
LOADS = [("c=1", 1, False), ("c=16", 16, False), ("c=16, a connection per request", 16, True)]


def loadtest(url, conc, duration, out, proxy=None, target=None, proxy_key=None, per_request=False):
    args = [str(RELEASE / "faden-loadtest"), "--url", url, "--model", "bench", "-c", str(conc),
            "-d", duration, "--warmup", "1s", "--no-progress", "--json", out, "--max-tokens", "8"]
    if per_request:
        args.append("--connection-per-request")
    env = dict(os.environ)
    if proxy:
        args += ["--connect-proxy", proxy, "--connect-target", target]
        env["FADEN_PROXY_AUTH"] = proxy_key
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300,
                   env=env)
    return json.load(open(out))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", default="10s")
    opts = ap.parse_args()

    os.environ.setdefault("FADEN_BIN", str(RELEASE / "faden"))
    tmp = tempfile.mkdtemp(prefix="faden-gpustack-tunnel-bench-")
    env = harness.GPUStackEnv()
    faden = engine = None
    try:
        ip = harness.loopback_ip()
        port = harness.free_port(ip)
        engine = subprocess.Popen([str(RELEASE / "faden"), "mock-engine", "--host", ip, "--port", str(port),
                                   "--worker-threads", "1", "--log", "warn"], stdout=subprocess.DEVNULL)
        # GPUStack: a tunnel worker on that address, and an instance on the engine.
        g_worker = env.worker(proxy_mode="tunnel", ip=ip)
        g_worker.start_tunnel()
        env.admin.run_instance("bench", port, g_worker)

        faden = harness.FadenServer("--worker-threads", "1")
        _, reg = faden.cluster("bench")
        f_worker = harness.FakeWorker(faden.url, reg, "bench-worker", ip=ip, proxy_mode="tunnel").start()
        f_worker.start_tunnel()
        model = harness._check(faden.http.post("/v2/models", json=harness.gpustack_model("bench"))).json()
        inst = harness._check(faden.http.post("/v2/model-instances", json={
            "model_id": model["id"], "worker_id": f_worker.id, "source": "local_path",
            "local_path": "/models/bench"})).json()
        f_worker.serve_instance(inst["id"], port)

        url = f"http://{ip}:{port}/v1"
        targets = {
            "engine": (dict(), lambda: [engine.pid]),
            "gpustack": (dict(proxy=f"127.0.0.1:{env.server.proxy_port}", target=f"{ip}:{port}",
                              proxy_key=env.admin.key), env.server.pids),
            "faden": (dict(proxy=f"127.0.0.1:{faden.proxy_port}", target=f"{ip}:{port}",
                           proxy_key=faden.admin), lambda: [faden.proc.pid]),
        }
        # Both paths answer before the rounds start.
        for name, (via, _) in targets.items():
            harness.wait_for(lambda: loadtest(url, 1, "1s", str(Path(tmp) / "w.json"), **via)["ok"] > 0,
                             60, f"{name} serving")
        results = []
        for rnd in range(opts.rounds):
            for load, conc, per_request in LOADS:
                for name, (via, pids) in targets.items():
                    procs = pids()
                    me0, t0 = ticks([os.getpid()]), ticks(procs)
                    r = loadtest(url, conc, opts.duration, str(Path(tmp) / "r.json"), **via,
                                 per_request=per_request)
                    cpu, client_cpu = ticks(procs) - t0, ticks([os.getpid()]) - me0
                    ok = r["ok"]
                    row = {
                        "round": rnd, "load": load, "target": name, "ok": ok, "errors": r["error_total"],
                        "rps": r["rps"], "p50_ms": (r.get("latency") or {}).get("p50_ms"),
                        "p99_ms": (r.get("latency") or {}).get("p99_ms"),
                        "server_cpu_us_per_req": cpu * 1e6 / TCK / ok if ok and name != "engine" else None,
                        "engine_cpu_us_per_req": cpu * 1e6 / TCK / ok if ok and name == "engine" else None,
                        # GPUStack's tunnel client (this process), for both servers.
                        "tunnel_client_cpu_us_per_req": client_cpu * 1e6 / TCK / ok if ok and name != "engine" else None,
                    }
                    results.append(row)
                    print(json.dumps(row), flush=True)
        summarize(results)
    finally:
        if faden is not None:
            faden.close()
        if engine is not None and engine.poll() is None:
            engine.terminate()
            engine.wait(10)
        env.close()


def summarize(rows):
    def med(load, target, field):
        vals = [r[field] for r in rows if r["load"] == load and r["target"] == target and r[field] is not None]
        return statistics.median(vals) if vals else None

    print("\nmedians over rounds")
    fields = ["rps", "p50_ms", "p99_ms", "server_cpu_us_per_req", "engine_cpu_us_per_req",
              "tunnel_client_cpu_us_per_req", "errors"]
    for c, _, _ in LOADS:
        for target in ("engine", "gpustack", "faden"):
            shown = {f: med(c, target, f) for f in fields}
            print(c, target, json.dumps({k: round(v, 3) for k, v in shown.items() if v is not None}))
        base = {f: med(c, "engine", f) for f in ("p50_ms", "p99_ms")}
        for target in ("gpustack", "faden"):
            added = {f: round(med(c, target, f) - b, 3) for f, b in base.items() if b is not None}
            print(f"{c} {target} added over the engine (ms): {json.dumps(added)}")
        g, f = med(c, "gpustack", "server_cpu_us_per_req"), med(c, "faden", "server_cpu_us_per_req")
        if g and f:
            print(f"{c} server CPU per request, gpustack / faden: {g / f:.1f}x")


if __name__ == "__main__":
    main()
