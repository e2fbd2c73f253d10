#!/usr/bin/env python3
"""One wrk --latency output -> one JSON line (used by benches/compare.sh).

Usage: parse_wrk.py SECTION TARGET CONNS CPU_TICKS CLK_TCK RSS_KIB WRK_OUTPUT
CPU_TICKS is the user+system time of the proxy's processes during the run (0: not measured).
"""
import json
import re
import sys

section, name, conns, ticks, tck, rss, path = sys.argv[1:]
text = open(path).read()


def dur(v, unit):
    return float(v) * {"us": 1, "ms": 1e3, "s": 1e6}[unit]


m = re.search(r"(\d+) requests in", text)
if not m:
    print(json.dumps({"section": section, "target": name, "connections": int(conns),
                      "failed": text.strip()[-300:]}))
    sys.exit(0)
req = int(m.group(1))
rps = float(re.search(r"Requests/sec:\s+([\d.]+)", text).group(1))
lat = {p: dur(v, u) for p, v, u in re.findall(r"^\s+(50|75|90|99)%\s+([\d.]+)(us|ms|s)\s*$", text, re.M)}
errors = sum(int(x) for x in re.findall(r"Non-2xx or 3xx responses: (\d+)", text))
sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
if sock:
    errors += sum(int(x) for x in sock.groups())
cpu_us = int(ticks) * 1e6 / int(tck) / req if int(ticks) and req else None
print(json.dumps({"section": section, "target": name, "connections": int(conns), "requests": req,
                  "rps": rps, "p50_us": lat.get("50"), "p90_us": lat.get("90"), "p99_us": lat.get("99"),
                  "errors": errors, "cpu_us_per_req": cpu_us,
                  "rss_mib": int(rss) / 1024 if int(rss) else None}))
