#!/usr/bin/env python3
"""Tables (stdout) and one JSON document from benches/compare.sh's results.jsonl.

Usage: report.py RESULTS.jsonl [OUT.json]
"""
import json
import statistics
import sys


def load(path):
    doc = {"meta": {}, "limits": {}, "server_peak": {}, "idle_tunnels": {}}
    for line in open(path):
        r = json.loads(line)
        s = r.pop("section")
        if s in ("meta", "limits", "server_peak", "idle_tunnels"):
            doc[s] = r
        else:
            doc.setdefault(s, []).append(r)
    return doc


def fmt(v, f="{:.0f}"):
    return "-" if v is None else f.format(v)


def table(title, header, rows):
    if not rows:  # a section that did not run (compare.sh -O)
        return
    print(f"\n## {title}")
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(str(h))
              for i, h in enumerate(header)]
    print("  ".join(str(h).rjust(w) for h, w in zip(header, widths)))
    for r in rows:
        print("  ".join(str(c).rjust(w) for c, w in zip(r, widths)))


def derive(doc):
    """Adds ratios and 'added' figures relative to direct, in place."""
    for section in ("http", "tiny", "relay"):
        rows = doc.get(section, [])
        base = {r["connections"]: r for r in rows if r["target"] == "direct" and "rps" in r}
        for r in rows:
            b = base.get(r["connections"])
            if not b or "rps" not in r:
                continue
            r["rps_ratio"] = r["rps"] / b["rps"] if b["rps"] else None
            for p in ("p50", "p99"):
                a, d = r.get(f"{p}_us"), b.get(f"{p}_us")
                r[f"added_{p}_us"] = a - d if a is not None and d is not None else None
    sse = doc.get("sse", [])
    base = next((r for r in sse if r["target"] == "direct" and "ttft" in r), None)
    for r in sse:
        if base and r.get("ttft"):
            r["added_ttft_p50_us"] = (r["ttft"]["p50_ms"] - base["ttft"]["p50_ms"]) * 1000
            r["added_ttft_p99_us"] = (r["ttft"]["p99_ms"] - base["ttft"]["p99_ms"]) * 1000
    for r in doc.get("body", []):
        ok = [t for t in r["seconds"] if t is not None]
        r["median_s"] = statistics.median(ok) if ok else None
    rc = [r["serving_s"] for r in doc.get("reconnect", []) if r.get("serving_s") is not None]
    doc["reconnect_summary"] = {"rounds": len(doc.get("reconnect", [])), "served": len(rc),
                                "median_serving_s": statistics.median(rc) if rc else None,
                                "max_serving_s": max(rc) if rc else None}


def main():
    doc = load(sys.argv[1])
    derive(doc)
    m = doc["meta"]
    print(f"\n# faden compare.sh  {m.get('date')}  commit {m.get('commit')}  "
          f"load {m.get('load_start')} -> {m.get('load_end')}  ({m.get('cpus')} CPUs, {m.get('cpu_model')})")

    rows = []
    for r in doc.get("http", []):
        if "rps" not in r:
            rows.append([r["target"], r["connections"], "failed", *["-"] * 7])
            continue
        rows.append([r["target"], r["connections"], fmt(r["rps"]), fmt(r.get("rps_ratio"), "{:.2f}"),
                     fmt(r["p50_us"]), fmt(r["p99_us"]), fmt(r.get("added_p99_us"), "{:+.0f}"),
                     fmt(r["cpu_us_per_req"], "{:.1f}"), fmt(r["rss_mib"], "{:.1f}"), r["errors"]])
    table(f"http: POST chat completion (8 tokens, ~330 B answer), wrk {m.get('duration_s')} s",
          ["target", "conns", "req/s", "ratio", "p50 us", "p99 us", "+p99 us", "cpu us/req", "rss MiB", "errors"], rows)

    rows = []
    for r in doc.get("tiny", []):
        if "rps" not in r:
            rows.append([r["target"], "failed", *["-"] * 6])
            continue
        rows.append([r["target"], fmt(r["rps"]), fmt(r["p50_us"]), fmt(r["p99_us"]),
                     fmt(r.get("added_p50_us"), "{:+.0f}"), fmt(r.get("added_p99_us"), "{:+.0f}"),
                     fmt(r["cpu_us_per_req"], "{:.1f}"), r["errors"]])
    table("tiny: 64-byte POST /v1/moderations, ~80-byte answer, c=1",
          ["target", "req/s", "p50 us", "p99 us", "+p50 us", "+p99 us", "cpu us/req", "errors"], rows)

    rows = []
    for r in doc.get("relay", []):
        if "rps" not in r:
            rows.append([r["target"], r["connections"], "failed", *["-"] * 8])
            continue
        rows.append([r["target"], r["connections"], fmt(r["rps"]), fmt(r.get("rps_ratio"), "{:.2f}"),
                     fmt(r["p50_us"]), fmt(r["p99_us"]), fmt(r.get("added_p50_us"), "{:+.0f}"),
                     fmt(r.get("added_p99_us"), "{:+.0f}"), fmt(r["cpu_us_per_req"], "{:.1f}"),
                     fmt(r["rss_mib"], "{:.1f}"), r["errors"]])
    table(f"relay: the tunnel alone (faden-relay: proxy port CONNECT -> tunnel -> worker splice ->"
          f" engine) beside rathole, faden-loadtest POST chat completion, {m.get('duration_s')} s;"
          f" cpu = server + tunnel worker, or both rathole processes",
          ["target", "conns", "req/s", "ratio", "p50 us", "p99 us", "+p50 us", "+p99 us",
           "cpu us/req", "rss MiB", "errors"], rows)

    rows = []
    for r in doc.get("sse", []):
        if "ttft" not in r or not r["ttft"]:
            rows.append([r["target"], "failed", *["-"] * 8])
            continue
        t, i = r["ttft"], r["itl"] or {}
        us = lambda v: fmt(v * 1000 if v is not None else None)
        rows.append([r["target"], r["ok"], us(t["p50_ms"]), us(t["p99_ms"]),
                     fmt(r.get("added_ttft_p50_us"), "{:+.0f}"), fmt(r.get("added_ttft_p99_us"), "{:+.0f}"),
                     us(i.get("min_ms")), us(i.get("p50_ms")), us(i.get("p90_ms")), r["errors"]])
    table(f"sse: faden-loadtest --stream -c 1, 16 tokens 1 ms apart, TTFT 0, {m.get('sse_duration_s')} s",
          ["target", "streams", "ttft p50 us", "ttft p99 us", "+p50 us", "+p99 us", "itl min us",
           "itl p50 us", "itl p90 us", "errors"], rows)

    rows = []
    for r in doc.get("idle_conns", []):
        rows.append([r["target"], r.get("opened", "-"), r.get("still_open_after_hold", "-"),
                     fmt(r["rss_before_kib"] / 1024, "{:.1f}"), fmt(r["rss_after_kib"] / 1024, "{:.1f}"),
                     fmt(r.get("per_conn_bytes")), json.dumps(r.get("statuses", {})),
                     json.dumps(r.get("failures", r.get("error", {})))])
    lim = doc["limits"]
    table(f"idle_conns: {m.get('idle_conns')} idle HTTP/1.1 keep-alive connections (one GET each, then idle);"
          f" fd limit script {lim.get('script_nofile')}, server {lim.get('server_nofile')}",
          ["target", "opened", "open after hold", "rss before MiB", "rss held MiB", "bytes/conn",
           "statuses", "failures"], rows)

    rows = []
    for r in doc.get("streams", []):
        mib = lambda k: fmt(r[k] / 1024, "{:.1f}") if r.get(k) is not None else "-"
        lat = r.get("latency") or {}
        rows.append([r["target"], r["streams"], r["active_seen"], r.get("ok", "-"), r.get("errors", "-"),
                     mib("rss_before_kib"), mib("rss_held_kib"), fmt(r.get("per_stream_bytes")),
                     mib("worker_rss_before_kib"), mib("worker_rss_held_kib"),
                     fmt(r.get("worker_per_stream_bytes")), fmt(lat.get("p50_ms"), "{:.0f}"),
                     r.get("failed", "")[:60]])
    table("streams: concurrent SSE streams held open (40 tokens 500 ms apart), RSS at the largest count seen",
          ["target", "streams", "active seen", "ok", "errors", "server before MiB", "server held MiB",
           "server bytes/stream", "worker before MiB", "worker held MiB", "worker bytes/stream",
           "latency p50 ms", "failed"], rows)

    t = doc["idle_tunnels"]
    if t:
        print(f"\n## idle tunnels: server RSS {t['server_rss_before_kib'] / 1024:.1f} -> "
              f"{t['server_rss_after_kib'] / 1024:.1f} MiB with {t['tunnels']} more idle tunnel workers: "
              f"{t['per_tunnel_kib']:.1f} KiB per tunnel (includes each worker's control-plane state); "
              f"one idle tunnel worker process: {t['worker_rss_median_kib'] / 1024:.1f} MiB RSS (median)")

    rows = [[r["target"], r["bytes"], " ".join(fmt(s, "{:.3f}") for s in r["seconds"]),
             fmt(r["median_s"], "{:.3f}"), r["answer"][:60]] for r in doc.get("body", [])]
    table(f"body: {m.get('body_mb')} MB POST /v1/moderations (3 runs; the gateway buffers the whole body)",
          ["target", "bytes", "seconds", "median s", "answer"], rows)
    if doc["server_peak"]:
        print(f"server peak RSS (VmHWM) after the body runs: {doc['server_peak']['vmhwm_kib'] / 1024:.1f} MiB")

    rows = [[r["round"], fmt(r["server_ready_s"], "{:.3f}"), fmt(r["serving_s"], "{:.3f}")]
            for r in doc.get("reconnect", [])]
    table("reconnect: kill -9 + restart the server; seconds from the restart",
          ["round", "server ready s", "tunnel serving s"], rows)

    if len(sys.argv) > 2 and sys.argv[2]:
        with open(sys.argv[2], "w") as f:
            json.dump(doc, f, indent=1)
        print(f"\nwritten: {sys.argv[2]}")


if __name__ == "__main__":
    main()
