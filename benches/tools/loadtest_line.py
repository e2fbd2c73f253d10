#!/usr/bin/env python3
"""One key=value line of a round-based benchmark script from a faden-loadtest JSON report and
the proxy processes' counters over the run (the lines benches/tools/rounds.py reads).

Usage: loadtest_line.py REPORT TARGET CONNS VOL INVOL USER_TICKS SYS_TICKS HZ [latency|ttft]
                        [EXEC_NS [MIGRATIONS]]

Prints `<target> c=<conns> n= p50_us= p99_us= cpu_us/req= user_us/req= vol/req= invol/req=`:
the percentiles of the whole request's latency, or with `ttft` of the time to first token (and
then `itl_p50_us=` too); CPU and context switches are per request served. With EXEC_NS (the
processes' run time in nanoseconds, benches/tools/lib.sh `proc_stats`), cpu_us/req is that
instead of the user and system ticks, which a short round has too few of to be exact;
user_us/req stays from the ticks. With MIGRATIONS (the processes' moves to another CPU), also
`migr/req=`: at c=1 most of a relay's CPU time is the kernel putting processes to sleep and
waking them, which costs more when the wakee lands on the other CPU.
"""
import json
import sys


def main():
    report, target, conns = sys.argv[1:4]
    vol, invol, user, system, hz = (int(x) for x in sys.argv[4:9])
    what = sys.argv[9] if len(sys.argv) > 9 else "latency"
    exec_ns = int(sys.argv[10]) if len(sys.argv) > 10 else None
    migrations = int(sys.argv[11]) if len(sys.argv) > 11 else None
    d = json.load(open(report))
    n = d["latency"]["count"] or 1
    per_request = lambda ticks: ticks / hz * 1e6 / n
    cpu = exec_ns / 1e3 / n if exec_ns is not None else per_request(user + system)
    m = d[what]
    line = (
        f"{target} c={conns} n={n} p50_us={m['p50_ms'] * 1000:.0f} p99_us={m['p99_ms'] * 1000:.0f} "
        f"cpu_us/req={cpu:.1f} user_us/req={per_request(user):.1f} "
        f"vol/req={vol / n:.2f} invol/req={invol / n:.3f}"
    )
    if migrations is not None:
        line += f" migr/req={migrations / n:.3f}"
    if what == "ttft":
        line += f" itl_p50_us={d['itl']['p50_ms'] * 1000:.0f}"
    if d.get("error_total"):
        line += f" errors={d['error_total']}"
    print(line)


if __name__ == "__main__":
    main()
