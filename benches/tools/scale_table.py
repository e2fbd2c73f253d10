#!/usr/bin/env python3
"""The table of benches/scale.sh from its rounds files (DIR/rounds-n<N>.txt): per core count,
the medians over the rounds of req/s and CPU per request of faden's direct path, nginx and
faden's tunnel path, the median per-round ratios faden / nginx, and faden's CPU per request
against its own at the smallest N. Usage: scale_table.py DIR"""
import pathlib
import re
import statistics
import sys


def rounds(path):
    """target -> list of {key: float} per round, in order."""
    out = {}
    for line in path.read_text().splitlines():
        parts = line.split()
        if not parts or "=" in parts[0]:
            continue
        vals = {}
        for kv in parts[1:]:
            k, _, v = kv.partition("=")
            m = re.fullmatch(r"([0-9.]+)(us|ms|s)?", v)
            if m:
                scale = {"us": 1, "ms": 1e3, "s": 1e6, None: 1}[m.group(2)]
                vals[k] = float(m.group(1)) * scale
        out.setdefault(parts[0], []).append(vals)
    return out


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def main():
    d = pathlib.Path(sys.argv[1])
    files = sorted(d.glob("rounds-n*.txt"), key=lambda p: int(p.stem.split("n")[-1]))
    print("| N | faden req/s | nginx req/s | throughput faden/nginx | faden CPU µs/req | nginx CPU µs/req | CPU faden/nginx | faden CPU vs N=%s | tunnel req/s | tunnel CPU µs/req |" % files[0].stem.split("n")[-1])
    print("|---|---|---|---|---|---|---|---|---|---|")
    base = None
    for f in files:
        n = f.stem.split("n")[-1]
        r = rounds(f)
        fd, ng, tu = r.get("faden-direct", []), r.get("nginx", []), r.get("faden-tunnel", [])
        tput = med([a["req/s"] / b["req/s"] for a, b in zip(fd, ng)])
        cpu = med([a["cpu_us/req"] / b["cpu_us/req"] for a, b in zip(fd, ng)])
        fcpu = med([a["cpu_us/req"] for a in fd])
        base = base or fcpu
        print(f"| {n} | {med([a['req/s'] for a in fd]):,.0f} | {med([b['req/s'] for b in ng]):,.0f} | "
              f"{tput:.2f} | {fcpu:.1f} | {med([b['cpu_us/req'] for b in ng]):.1f} | {cpu:.2f} | "
              f"{fcpu / base:.2f} | {med([t['req/s'] for t in tu]):,.0f} | {med([t['cpu_us/req'] for t in tu]):.1f} |")


if __name__ == "__main__":
    main()
