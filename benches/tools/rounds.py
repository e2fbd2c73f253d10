#!/usr/bin/env python3
"""Medians of per-round ratios between two targets, from the key=value lines that the
round-based benchmark scripts print (benches/quick_vs_nginx.sh, benches/relay_vs_rathole.sh).

Usage: rounds.py FILE A B [BASELINE]

Each line reads `<target> c=<conns> key=value ...`; the lines of A and B pair up in order per
concurrency. For every key whose values are plain numbers on both sides, prints the median of
A / B over the rounds (for `cpu_us/req`, each round's ratio too). With BASELINE, the name of a
target run in the same rounds (the engine alone), also prints the median p50 and p99 each of A
and B adds over it (keys `p50_us`, `p99_us`), with each round's figure.

With six rounds or more, the CPU ratio, the throughput ratio and the added latencies also get a
95 % confidence interval for their median, `[lo, hi]`: the distribution-free one of the sign
test (two order statistics of the rounds, chosen from the binomial distribution), which assumes
nothing about the noise but that rounds are independent. A target "at most the other's" is
shown when the interval's upper end is below 1 (or below the latency target), not when the
median is.

Lines may carry `steal%=` (the host's CPU time the hypervisor took during that target's run,
from /proc/stat): it is no ratio, but each concurrency gets a line with its median and maximum
over the rounds and the rounds where it passed 2 %. With MAX_STEAL=PCT in the environment,
the medians are printed a second time without the rounds where any of the round's targets
(A, B, BASELINE) lost more than PCT % to the hypervisor, with the rounds left out named: on a
shared VM a neighbour's burst can take a quarter of the host for a few rounds, and those
rounds measure the neighbour. Both sets are printed, so that nothing is hidden.
"""
import math
import os
import re
import statistics
import sys


def median_interval(values, level=0.95):
    """The distribution-free interval for the median of `values`: `(lo, hi)`, the k-th smallest
    and k-th largest values for the largest k whose coverage, 1 - 2 P(Binomial(n, 1/2) < k),
    is at least `level`; None when even k = 1 covers less (fewer than six values at 95 %)."""
    xs = sorted(values)
    n = len(xs)
    best = None
    below = 0.0  # P(X < k) for X ~ Binomial(n, 1/2)
    for k in range(1, n // 2 + 1):
        below += math.comb(n, k - 1) / 2**n
        if 1 - 2 * below < level:
            break
        best = (xs[k - 1], xs[n - k])
    return best


def interval_text(values, fmt):
    found = median_interval(values)
    return "" if found is None else " [" + ", ".join(fmt.format(v) for v in found) + "]"


def number(text):
    try:
        return float(text)
    except ValueError:
        return None


STEAL = "steal%"
# A round whose targets lost more of the host's CPU time than this to the hypervisor is named.
STEAL_NOTED = 2.0


def round_steal(*sides):
    """Per round, the largest `steal%` of any of the sides' lines (None when none has one)."""
    out = []
    for lines in zip(*sides):
        values = [v for v in (number(x.get(STEAL, "")) for x in lines) if v is not None]
        out.append(max(values) if values else None)
    return out


def print_steal(c, ra, rb):
    """The steal time the rounds saw (the scripts print `steal%` per target and round, a per
    cent of the host's CPU time), and which rounds lost more than STEAL_NOTED: their figures
    say more about the VM's neighbours than about the proxies."""
    per_round = round_steal(ra, rb)
    seen = [v for v in per_round if v is not None]
    if not seen:
        return
    noted = [str(i + 1) for i, v in enumerate(per_round) if v is not None and v > STEAL_NOTED]
    text = f"c={c}: steal time per round, median {statistics.median(seen):.1f} %, max {max(seen):.1f} %"
    text += f"; over {STEAL_NOTED:.0f} % in rounds {' '.join(noted)}" if noted else ""
    print(text)


def report(c, a, b, baseline, ra, rb, base, label=""):
    """The medians of the ratios between A's and B's rounds (and what each adds to BASELINE)."""
    parts = []
    for key in ra[0] if ra else []:
        if key in ("c", "target", STEAL):
            continue
        pairs = [(number(x.get(key, "")), number(y.get(key, ""))) for x, y in zip(ra, rb)]
        if not pairs or any(p is None or q is None or q == 0 for p, q in pairs):
            continue
        ratios = [p / q for p, q in pairs]
        text = f"{key} {statistics.median(ratios):.2f}"
        if key in ("cpu_us/req", "req/s", "n"):
            text += interval_text(ratios, "{:.2f}")
        if key == "cpu_us/req":
            text += " (" + " ".join(f"{r:.2f}" for r in ratios) + ")"
        parts.append(text)
    print(f"c={c} rounds={min(len(ra), len(rb))}{label}: {a} / {b}, medians of the ratios: " + ", ".join(parts))
    if not label:
        print_steal(c, ra, rb)
    if baseline:
        for key in ("p50_us", "p99_us"):
            if not all(key in r for r in ra + rb + base):
                continue
            added = lambda rs: [float(x[key]) - float(y[key]) for x, y in zip(rs, base)]
            print(
                f"c={c}{label}: added {key[:3]} over {baseline} (median of rounds): "
                f"{a} {statistics.median(added(ra)):+.0f} us{interval_text(added(ra), '{:+.0f}')}, "
                f"{b} {statistics.median(added(rb)):+.0f} us{interval_text(added(rb), '{:+.0f}')}"
                f" (per round: {a} " + " ".join(f"{v:+.0f}" for v in added(ra))
                + f"; {b} " + " ".join(f"{v:+.0f}" for v in added(rb)) + ")"
            )


def main():
    path, a, b = sys.argv[1:4]
    baseline = sys.argv[4] if len(sys.argv) > 4 else None
    max_steal = number(os.environ.get("MAX_STEAL", ""))
    rows = []
    for line in open(path):
        if "=" in line:
            row = dict(re.findall(r"(\S+)=(\S+)", line))
            row["target"] = line.split()[0]
            rows.append(row)
    for c in dict.fromkeys(r["c"] for r in rows):
        side = lambda name: [r for r in rows if r["c"] == c and r["target"] == name]
        ra, rb = side(a), side(b)
        base = side(baseline) if baseline else []
        report(c, a, b, baseline, ra, rb, base)
        if max_steal is None:
            continue
        steal = round_steal(ra, rb, *([base] if baseline else []))
        keep = [i for i, v in enumerate(steal) if v is None or v <= max_steal]
        dropped = [str(i + 1) for i, v in enumerate(steal) if i not in keep]
        if not dropped:
            print(f"c={c}: no round over MAX_STEAL={max_steal:g} %")
            continue
        if not keep:
            print(f"c={c}: every round over MAX_STEAL={max_steal:g} %")
            continue
        pick = lambda rs: [rs[i] for i in keep]
        label = f" with steal <= {max_steal:g} % (left out: rounds {' '.join(dropped)})"
        report(c, a, b, baseline, pick(ra), pick(rb), pick(base) if baseline else [], label)


if __name__ == "__main__":
    main()
