#!/usr/bin/env python3
"""One faden-loadtest --json report -> one JSON line shaped like parse_wrk.py's (used by
benches/compare.sh).

Usage: parse_loadtest.py SECTION TARGET CONNS CPU_TICKS CLK_TCK RSS_KIB REPORT.json STDERR_FILE
CPU_TICKS is the user+system time of the measured processes during the run (0: not measured).
"""
import json
import sys

section, name, conns, ticks, tck, rss, path, err = sys.argv[1:]
try:
    r = json.load(open(path))
except Exception:
    print(json.dumps({"section": section, "target": name, "connections": int(conns),
                      "failed": open(err).read().strip()[-300:]}))
    sys.exit(0)
ok = r["ok"]
lat = r.get("latency") or {}
us = lambda k: lat[k] * 1000 if k in lat else None
cpu_us = int(ticks) * 1e6 / int(tck) / ok if int(ticks) and ok else None
print(json.dumps({"section": section, "target": name, "connections": int(conns), "requests": ok,
                  "rps": r["rps"], "p50_us": us("p50_ms"), "p90_us": us("p90_ms"),
                  "p99_us": us("p99_ms"), "errors": r["error_total"], "cpu_us_per_req": cpu_us,
                  "rss_mib": int(rss) / 1024 if int(rss) else None}))
