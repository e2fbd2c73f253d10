"""GPUStack's own OpenAI endpoint against `faden gateway` synced from the same GPUStack 2.3.0
server, side by side in one run, on the same model instance.

Run it through benches/gpustack_front.sh (release build, the GPUStack venv). It starts a private
PostgreSQL and a real GPUStack server (tests/gpustack/harness.py), one fake worker in `direct`
mode whose GPUStack worker proxy runs in this process, and one instance served by
`faden mock-engine`. Then, in interleaved rounds, faden-loadtest drives each target:

- `engine`: the mock engine itself (the floor);
- `gpustack`: `POST <gpustack>/v1/chat/completions`, which GPUStack's server forwards to the
  worker's proxy (its design for every proxy mode) and the worker proxy to the engine;
- `faden`: `faden gateway --server-url <gpustack>`, straight to the instance (`direct`).

Loads: closed loop at c=64 (throughput), c=1 (added p50 / p99 over the engine), c=1 streamed
(time to first token). CPU per request of each proxy process comes from /proc (user + system
ticks over the run): the GPUStack server's processes; this process, which holds GPUStack's
worker proxy (the only thing it runs during a load); the faden gateway. Prints one JSON line per
run and a summary with the medians over rounds.
"""

import argparse
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


def loadtest(url, key, model, conc, duration, stream, out):
    args = [str(RELEASE / "faden-loadtest"), "--url", url, "--model", model, "-c", str(conc),
            "-d", duration, "--warmup", "1s", "--no-progress", "--json", out, "--max-tokens", "16"]
    if key:
        args += ["--api-key", key]
    if stream:
        args.append("--stream")
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300)
    return json.load(open(out))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", default="10s")
    opts = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="faden-gpustack-bench-")
    env = harness.GPUStackEnv()
    engine = gateway = None
    try:
        port = harness.free_port()
        engine = subprocess.Popen([str(RELEASE / "faden"), "mock-engine", "--port", str(port),
                                   "--worker-threads", "1", "--log", "warn"], stdout=subprocess.DEVNULL)
        worker = env.worker(proxy_mode="direct")
        model = "bench"
        env.admin.run_instance(model, port, worker)
        _, key = env.admin.create_api_key("bench-client", scope=["inference"])

        gw_log = open(Path(tmp) / "gateway.log", "w")
        gw_port = harness.free_port()
        gateway = subprocess.Popen(
            [str(RELEASE / "faden"), "gateway", "--server-url", env.server.url, "--token", env.admin.key,
             "--host", "127.0.0.1", "--port", str(gw_port), "--worker-threads", "1"],
            stdout=gw_log, stderr=subprocess.STDOUT, env=dict(os.environ, FADEN_LOG="warn"))
        import httpx

        def faden_serves():
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
            r = httpx.post(f"http://127.0.0.1:{gw_port}/v1/chat/completions", json=body,
                           headers={"Authorization": f"Bearer {key}"}, timeout=5)
            return r.status_code == 200

        def gpustack_serves():
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
            r = httpx.post(f"{env.server.url}/v1/chat/completions", json=body,
                           headers={"Authorization": f"Bearer {key}"}, timeout=5)
            return r.status_code == 200

        harness.wait_for(faden_serves, 60, "faden serving the model")
        harness.wait_for(gpustack_serves, 60, "GPUStack serving the model")

        targets = {
            "engine": (f"http://127.0.0.1:{port}/v1", None, lambda: []),
            "gpustack": (f"{env.server.url}/v1", key, env.server.pids),
            "faden": (f"http://127.0.0.1:{gw_port}/v1", key, lambda: [gateway.pid]),
        }
        loads = [("c64", 64, False), ("c1", 1, False), ("c1_sse", 1, True)]
        results = []
        for rnd in range(opts.rounds):
            for load, conc, stream in loads:
                for name, (url, k, pids) in targets.items():
                    procs = pids()
                    me0, t0 = ticks([os.getpid()]), ticks(procs)
                    r = loadtest(url, k, model, conc, opts.duration, stream, str(Path(tmp) / "r.json"))
                    cpu = ticks(procs) - t0
                    worker_cpu = ticks([os.getpid()]) - me0
                    row = {
                        "round": rnd, "load": load, "target": name, "ok": r["ok"], "errors": r["error_total"],
                        "rps": r["rps"], "p50_ms": (r.get("latency") or {}).get("p50_ms"),
                        "p99_ms": (r.get("latency") or {}).get("p99_ms"),
                        "ttft_p50_ms": (r.get("ttft") or {}).get("p50_ms"),
                        "ttft_p99_ms": (r.get("ttft") or {}).get("p99_ms"),
                        "cpu_us_per_req": cpu * 1e6 / TCK / r["ok"] if r["ok"] and procs else None,
                        # GPUStack's path only: its worker proxy, in this process.
                        "worker_proxy_cpu_us_per_req":
                            worker_cpu * 1e6 / TCK / r["ok"] if name == "gpustack" and r["ok"] else None,
                    }
                    results.append(row)
                    print(json.dumps(row), flush=True)
        summarize(results)
    finally:
        for p in (gateway, engine):
            if p is not None and p.poll() is None:
                p.terminate()
                p.wait(10)
        env.close()


def summarize(rows):
    def med(load, target, field):
        vals = [r[field] for r in rows if r["load"] == load and r["target"] == target and r[field] is not None]
        return statistics.median(vals) if vals else None

    print("\nmedians over rounds")
    for load in ("c64", "c1", "c1_sse"):
        for target in ("engine", "gpustack", "faden"):
            fields = ["rps", "p50_ms", "p99_ms", "ttft_p50_ms", "ttft_p99_ms", "cpu_us_per_req",
                      "worker_proxy_cpu_us_per_req"]
            shown = {f: med(load, target, f) for f in fields}
            print(load, target, json.dumps({k: round(v, 3) for k, v in shown.items() if v is not None}))
    for load, field in (("c1", "p50_ms"), ("c1", "p99_ms"), ("c1_sse", "ttft_p50_ms"), ("c1_sse", "ttft_p99_ms")):
        base = med(load, "engine", field)
        if base is None:
            continue
        for target in ("gpustack", "faden"):
            v = med(load, target, field)
            if v is not None:
                print(f"{load} {target} added {field}: {v - base:.3f} ms")


if __name__ == "__main__":
    main()
