"""Two faden binaries on the gateway's tunnel path, in interleaved rounds: a no-regression check.

Each round starts, for each binary in turn, a `faden server` (SQLite), a tunnel `faden worker`
and `faden mock-engine` (one runtime thread each), and drives the server's gateway with
faden-loadtest (keep-alive, POST chat completion, 8 tokens) at each concurrency. CPU per request
is the server's and the worker's user + system ticks over the run (/proc). Prints one JSON line
per run, then the medians and the median of the per-round ratios (B / A).

  "$(bash scripts/gpustack-venv.sh | tail -n1)" benches/ab_tunnel.py A_BINARY B_BINARY \
      [--rounds 6] [--duration 5s] [--conc 1,16]

(the harness it shares with tests/gpustack needs httpx, which that venv has). The load generator
is target/release/faden-loadtest. Loopback only.
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

LOADTEST = ROOT / "target" / "release" / "faden-loadtest"


def loadtest(url, key, conc, duration, out):
    args = [str(LOADTEST), "--url", url, "--model", "demo", "--api-key", key, "-c", str(conc), "-d", duration,
            "--warmup", "1s", "--no-progress", "--json", out, "--max-tokens", "8"]
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300)
    return json.load(open(out))


def run_binary(binary, concs, duration, tmp):
    """One binary's runs: a fresh server, worker and engine, each concurrency once."""
    os.environ["FADEN_BIN"] = str(binary)
    one = ["--worker-threads", "1"]
    server = harness.FadenServer(*one)
    procs = []
    try:
        _, reg = server.cluster("bench")
        harness._check(server.http.post("/v2/models", json={"name": "demo"}))
        key = harness._check(server.http.post("/v2/api-keys", json={"name": "bench"})).json()["value"]
        port = harness.free_port()
        procs.append(subprocess.Popen([str(binary), "mock-engine", "--host", harness.LOOPBACK, "--port", str(port),
                                       *one, "--log", "warn"], stdout=subprocess.DEVNULL))
        worker = subprocess.Popen(
            [str(binary), "worker", "--server-url", server.url, "--token", reg, "--proxy-mode", "tunnel",
             "--worker-ip", harness.LOOPBACK, "--worker-port", "0", "--disable-worker-metrics",
             "--instance", f"demo={port}", "--data-dir", str(tmp / f"worker-{time.monotonic_ns()}"), *one,
             "--log", "warn"], stdout=subprocess.DEVNULL)
        procs.append(worker)
        url = server.gateway_url + "/v1"
        harness.wait_for(lambda: loadtest(url, key, 1, "1s", str(tmp / "w.json"))["ok"] > 0, 60, "serving")
        rows = {}
        for conc in concs:
            pids = [server.proc.pid, worker.pid]
            t0 = ticks(pids)
            r = loadtest(url, key, conc, duration, str(tmp / "r.json"))
            ok = r["ok"]
            rows[conc] = {"ok": ok, "errors": r["error_total"], "rps": r["rps"],
                          "p50_ms": (r.get("latency") or {}).get("p50_ms"),
                          "cpu_us_per_req": (ticks(pids) - t0) * 1e6 / TCK / ok if ok else None}
        return rows
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
        server.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--duration", default="5s")
    ap.add_argument("--conc", default="1,16")
    opts = ap.parse_args()
    concs = [int(c) for c in opts.conc.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="faden-ab-"))
    rows = []
    for rnd in range(opts.rounds):
        # Alternate which binary goes first, so neither always runs on a warmer machine.
        order = [("A", opts.a), ("B", opts.b)] if rnd % 2 == 0 else [("B", opts.b), ("A", opts.a)]
        for name, binary in order:
            for conc, row in run_binary(Path(binary), concs, opts.duration, tmp).items():
                row.update(round=rnd, binary=name, conc=conc)
                rows.append(row)
                print(json.dumps(row), flush=True)
    print("\nmedians over rounds; ratio: median of the per-round B / A")
    for conc in concs:
        for field in ("rps", "p50_ms", "cpu_us_per_req"):
            per = {n: {r["round"]: r[field] for r in rows if r["binary"] == n and r["conc"] == conc}
                   for n in ("A", "B")}
            ratios = [per["B"][k] / per["A"][k] for k in per["A"] if per["A"][k] and per["B"].get(k)]
            print(f"c={conc} {field}: A {statistics.median(per['A'].values()):.3f}  "
                  f"B {statistics.median(per['B'].values()):.3f}  B/A {statistics.median(ratios):.3f} "
                  f"[{min(ratios):.3f}-{max(ratios):.3f}]")


if __name__ == "__main__":
    main()
