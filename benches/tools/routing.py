#!/usr/bin/env python3
"""Helpers of benches/routing.sh: process CPU, engine metrics, one result row per run, and the
table (text, CSV, JSON) with the throughput at a TTFT SLO.

  routing.py cpu PID...          CPU so far of the processes and all their descendants:
                                 "<exec_ns> <ticks>" (exec_ns: the scheduler's run time of each
                                 live thread, exact; ticks: user + system from /proc/PID/stat in
                                 1/CLK_TCK s, which also keeps the time of threads that exited)
  routing.py scrape ADDR...      the engines' counters (ADDR: host:port), as JSON: "hits" and
                                 "queries" summed (vllm:prefix_cache_hits_total and
                                 vllm:prefix_cache_queries_total, null when an engine lacks them)
                                 and "requests", each engine's first tokens so far
                                 (vllm:time_to_first_token_seconds_count, null when missing)
  routing.py row ...             one JSON line (see `row` below) from a faden-loadtest report
  routing.py table RESULTS.jsonl OUT_DIR RATE SLO_MS
                                 table.txt, table.csv and results.json in OUT_DIR; prints the table
"""
import csv
import json
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from proc_cpu import TCK, ticks  # noqa: E402  (benches/proc_cpu.py)


def descendants(pids):
    """`pids` and every process below them (a router's launcher and its children)."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [int(p) for p in pids]
    while todo:
        p = todo.pop()
        if p not in out:
            out.append(p)
            todo.extend(children.get(p, []))
    return out


def exec_ns(pids):
    total = 0
    for pid in pids:
        for f in Path(f"/proc/{pid}/task").glob("*/schedstat"):
            try:
                total += int(f.read_text().split()[0])
            except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
                pass
    return total


def cmd_cpu(pids):
    procs = descendants(pids)
    print(exec_ns(procs), ticks(procs))


HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
FIRST_TOKENS = "vllm:time_to_first_token_seconds_count"


def metrics(addr):
    """The sums of the wanted counters on one engine's /metrics (labels summed over)."""
    try:
        text = urllib.request.urlopen(f"http://{addr}/metrics", timeout=5).read().decode()
    except OSError:
        return {}
    seen = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in (HITS, QUERIES, FIRST_TOKENS):
            try:
                seen[name] = seen.get(name, 0) + float(line.rsplit(" ", 1)[1])
            except ValueError:
                pass
    return seen


def cmd_scrape(addrs):
    per = [metrics(a) for a in addrs]
    cache = all(HITS in m and QUERIES in m for m in per)
    print(json.dumps({
        "hits": sum(m[HITS] for m in per) if cache else None,
        "queries": sum(m[QUERIES] for m in per) if cache else None,
        "requests": [m.get(FIRST_TOKENS) for m in per],
    }))


def cmd_row(args):
    """row NAME RATE REPORT.json CPU0 CPU1 METRICS0 METRICS1
    CPU0/CPU1: "exec_ns ticks" before/after the measured phase ("" for no router process);
    METRICS0/1: `scrape`'s JSON at both ends of the same window."""
    name, rate, report, cpu0, cpu1, m0, m1 = args
    row = {"row": name, "rate": float(rate)}
    try:
        r = json.load(open(report))
    except (OSError, ValueError) as e:
        row["failed"] = f"no report: {e}"
        print(json.dumps(row))
        return
    ttft = r.get("ttft") or {}
    row.update({
        "ok": r["ok"], "errors": r["error_total"], "unfinished": r["unfinished"],
        "rps": r["rps"], "prompt_tokens_per_s": r.get("prompt_tokens_per_s"),
        "hit_rate": r.get("cache_hit_rate"),
        "cached_reported": (r.get("cache") or {}).get("cached_reported"),
        "ttft_p50_ms": ttft.get("p50_ms"), "ttft_p90_ms": ttft.get("p90_ms"),
        "ttft_p99_ms": ttft.get("p99_ms"), "ttft_cdf": ttft.get("cdf"),
        "latency_p50_ms": (r.get("latency") or {}).get("p50_ms"),
        "targets": [t["share"] for t in r.get("targets") or []],
        "errors_by_class": r.get("errors"),
    })
    if cpu0 and cpu1 and r["ok"]:
        e0, t0 = map(int, cpu0.split())
        e1, t1 = map(int, cpu1.split())
        row["cpu_us_per_req"] = (e1 - e0) / 1000 / r["ok"]
        row["cpu_ticks_us_per_req"] = (t1 - t0) * 1e6 / TCK / r["ok"]
    m0, m1 = json.loads(m0), json.loads(m1)
    if None not in (m0["hits"], m1["hits"]) and m1["queries"] > m0["queries"]:
        row["engine_hit_rate"] = (m1["hits"] - m0["hits"]) / (m1["queries"] - m0["queries"])
    done = [None if None in (a, b) else b - a for a, b in zip(m0["requests"], m1["requests"])]
    if done and None not in done and sum(done) > 0:
        # Each engine's share of the requests it started in the window: the balance.
        row["engine_shares"] = [d / sum(done) for d in done]
    print(json.dumps(row))


def fmt(v, f="{:.1f}"):
    return "-" if v is None else f.format(v)


def cmd_table(path, out_dir, rate, slo_ms):
    rate, slo_ms = float(rate), float(slo_ms)
    meta, runs = {}, []
    for line in open(path):
        r = json.loads(line)
        if r.get("meta"):
            meta = r
        else:
            runs.append(r)
    names = list(dict.fromkeys(r["row"] for r in runs))
    table = []
    for name in names:
        mine = sorted((r for r in runs if r["row"] == name), key=lambda r: r["rate"])
        main = next((r for r in mine if r["rate"] == rate), None) or {}
        # The highest offered rate whose p90 TTFT met the SLO without errors (rates above a
        # failing one that did not run count as failing).
        good = [r for r in mine if "failed" not in r and r.get("errors") == 0
                and r.get("ttft_p90_ms") is not None and r["ttft_p90_ms"] <= slo_ms]
        best = max(good, key=lambda r: r["rate"]) if good else None
        table.append({
            "row": name, "rate": rate,
            "hit_rate": main.get("hit_rate"), "engine_hit_rate": main.get("engine_hit_rate"),
            "ttft_p50_ms": main.get("ttft_p50_ms"), "ttft_p90_ms": main.get("ttft_p90_ms"),
            "ttft_p99_ms": main.get("ttft_p99_ms"), "rps": main.get("rps"),
            "errors": main.get("errors"), "cpu_us_per_req": main.get("cpu_us_per_req"),
            "max_share": max(main.get("engine_shares") or main.get("targets") or [0]) or None,
            "slo_rate": best["rate"] if best else None,
            "slo_rps": best["rps"] if best else None,
            "failed": main.get("failed"),
        })
    out = Path(out_dir)
    cols = ["row", "hit_rate", "engine_hit_rate", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms",
            "rps", "errors", "max_share", "cpu_us_per_req", "slo_rate", "slo_rps"]
    with open(out / "table.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        w.writerows(table)
    pct = lambda v: fmt(None if v is None else 100 * v)
    lines = [
        f"offered {rate:g} req/s; throughput at SLO: the highest offered rate of "
        f"{meta.get('rates', '?')} req/s with TTFT p90 <= {slo_ms:g} ms and no errors",
        "",
        f"| routed by | hit rate % (client / engines) | TTFT p50 / p90 / p99 ms | req/s | errors "
        f"| busiest engine % | router CPU µs/req | req/s at TTFT p90 <= {slo_ms:g} ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in table:
        if t["failed"]:
            lines.append(f"| {t['row']} | failed: {t['failed']} | | | | | | |")
            continue
        lines.append(
            f"| {t['row']} | {pct(t['hit_rate'])} / {pct(t['engine_hit_rate'])} "
            f"| {fmt(t['ttft_p50_ms'])} / {fmt(t['ttft_p90_ms'])} / {fmt(t['ttft_p99_ms'])} "
            f"| {fmt(t['rps'])} | {fmt(t['errors'], '{}')} | {pct(t['max_share'])} "
            f"| {fmt(t['cpu_us_per_req'], '{:.0f}')} "
            f"| {fmt(t['slo_rate'], '{:g}')} |")
    text = "\n".join(lines) + "\n"
    (out / "table.txt").write_text(text)
    doc = {"meta": meta, "table": table, "runs": runs, "slo_ms": slo_ms, "rate": rate}
    (out / "results.json").write_text(json.dumps(doc, indent=1) + "\n")
    sys.stdout.write(text)


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "cpu":
        cmd_cpu(args)
    elif cmd == "scrape":
        cmd_scrape(args)
    elif cmd == "row":
        cmd_row(args)
    elif cmd == "table":
        cmd_table(*args)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
