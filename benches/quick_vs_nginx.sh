#!/usr/bin/env bash
# A quick same-host side by side of the gateway's direct path and nginx (the `http` section of
# benches/compare.sh without the other targets): the mock engine, `faden server` with one
# `direct` worker, nginx `proxy_pass` with upstream keepalive; wrk POST chat completion against
# the engine, faden and nginx in turn, per concurrency. Prints req/s, p50/p99 and, per request,
# CPU (user + system), user CPU, voluntary and involuntary context switches and minor page
# faults of the proxy process, and the host's steal time during the run (`steal%`).
#
# Usage: benches/quick_vs_nginx.sh [SECONDS] [CONNS...]      (default: 5 s, c=64 then c=1)
#   WRKT=2       wrk threads (default 1; compare.sh uses 2 at c>1)
#   FADEN=path   binary (default target/release/faden; build it first)
#   ROUNDS=N     N interleaved faden / nginx rounds (without the engine-alone row), then the
#                median of the per-round ratios
#   MAX_STEAL=PCT  also print the medians without the rounds where a target lost more than PCT %
#                of the host's CPU time to the hypervisor (benches/tools/rounds.py)
#   PIN=1        the proxies (faden server, nginx) on CPU 0, wrk, the engine and the faden worker
#                on CPU 1: the proxy's CPU per request without the load generator preempting it
#   PIN_CPUS=LIST LOAD_CPUS=LIST  the same with CPU lists (taskset syntax): the proxies on
#                PIN_CPUS, everything else on LOAD_CPUS (benches/scale.sh on a bigger host)
#   ROUNDS_OUT=FILE  keep the rounds' lines there
#   TUNNEL=1     also the tunnel path (`faden-tunnel`: the server's gateway to a `tunnel` worker
#                with one runtime thread; CPU per request of both)
#   BATCH=1      unpinned, but wrk and the mock engines run under SCHED_BATCH (`chrt -b 0`), whose
#                wake-ups never preempt the running task: the harness shares the CPUs with the
#                proxy without taking them from it at each response the proxy sends (see
#                docs/performance.md, "Why the unpinned rounds trail")
#   PROXY_THREADS=N  the faden server's runtime threads and nginx's worker processes (default
#                1 each; N=2 on these 2-CPU VMs is both proxies' shipped default: one per core)
# Loopback only; everything started is killed on exit.
set -u
cd "$(dirname "$0")/.."
DUR=${1:-5}; shift || true
CONNS=${*:-64 1}
FADEN=${FADEN:-${CARGO_TARGET_DIR:-target}/release/faden}
source benches/tools/lib.sh
start_work quick
source benches/tools/gateway_setup.sh
LOADCPU=()
[ "${PIN:-0}" = 1 ] && PIN_CPUS=0 LOAD_CPUS=1
if [ -n "${PIN_CPUS:-}" ]; then
  for p in $SERVER $NPIDS; do taskset -a -p -c "$PIN_CPUS" $p >/dev/null; done
  for p in "${PIDS[@]}"; do [ $p = $SERVER ] || taskset -a -p -c "$LOAD_CPUS" $p >/dev/null; done
  LOADCPU=(taskset -c "$LOAD_CPUS")
fi
if [ "${BATCH:-0}" = 1 ]; then
  for p in $EP $SSE_EP; do chrt -b -a -p 0 $p >/dev/null; done
  LOADCPU+=(chrt -b 0)
fi
cat > $WORK/post.lua <<'EOF'
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer " .. os.getenv("BENCH_KEY")
wrk.body = '{"model": "' .. os.getenv("BENCH_MODEL") .. '", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}'
EOF
HZ=$(getconf CLK_TCK)
run() { # name url conns pids...
  local name=$1 url=$2 c=$3; shift 3
  local c0 i0 u0 s0 m0 e0 g0 c1 i1 u1 s1 m1 e1 g1
  local k0=$(cpu_ticks)
  read -r c0 i0 u0 s0 m0 e0 g0 <<<"$(proc_stats "$@")"
  local out=$(BENCH_KEY=$KEY BENCH_MODEL=${MODEL:-demo-direct} "${LOADCPU[@]}" wrk -t${WRKT:-1} -c$c -d${DUR}s --latency -s ${LUA:-$WORK/post.lua} $url${URLPATH:-/v1/chat/completions})
  read -r c1 i1 u1 s1 m1 e1 g1 <<<"$(proc_stats "$@")"
  local k1=$(cpu_ticks)
  local reqs=$(awk '/requests in/ {print $1}' <<<"$out")
  local rps=$(awk '/Requests\/sec/ {print $2}' <<<"$out")
  local p50=$(awk '$1=="50%" {print $2}' <<<"$out"); local p99=$(awk '$1=="99%" {print $2}' <<<"$out")
  echo "$name c=$c req/s=$rps p50=$p50 p99=$p99 cpu_us/req=$(python3 -c "print(round(($e1-$e0)/1e3/$reqs,1))") user_us/req=$(python3 -c "print(round(($u1-$u0)/$HZ*1e6/$reqs,1))") ctxsw/req=$(python3 -c "print(round(($c1-$c0)/$reqs,3))") ictxsw/req=$(python3 -c "print(round(($i1-$i0)/$reqs,3))") minflt/req=$(python3 -c "print(round(($m1-$m0)/$reqs,4))") migr/req=$(python3 -c "print(round(($g1-$g0)/$reqs,3))") steal%=$(steal_pct "$k0" "$k1")"
}
echo "load: $(cut -d' ' -f1-3 /proc/loadavg) wrk -t${WRKT:-1}$([ -n "${PIN_CPUS:-}" ] && echo ", proxies pinned to CPUs $PIN_CPUS, load to CPUs $LOAD_CPUS")$([ "${BATCH:-0}" = 1 ] && echo ', wrk and engines SCHED_BATCH')$([ "${PROXY_THREADS:-1}" = 1 ] || echo ", proxies with $PROXY_THREADS threads / workers")"
for round in $(seq 1 ${ROUNDS:-1}); do
  for c in $CONNS; do
    [ ${ROUNDS:-1} = 1 ] && run direct http://$ENGINE $c $EP
    run faden-direct http://$GW $c $SERVER
    run nginx http://127.0.0.1:$NP $c $NPIDS
    [ "${TUNNEL:-0}" = 1 ] && MODEL=demo-tunnel run faden-tunnel http://$GW $c $SERVER $TUNNEL_WORKER
  done
done | tee $WORK/rounds.txt
[ -n "${ROUNDS_OUT:-}" ] && cp "$WORK/rounds.txt" "$ROUNDS_OUT"
# With several rounds: per concurrency, the median of the per-round faden / nginx ratios.
[ "${ROUNDS:-1}" -le 1 ] || python3 benches/tools/rounds.py "$WORK/rounds.txt" faden-direct nginx
[ "${ROUNDS:-1}" -le 1 ] || [ "${TUNNEL:-0}" != 1 ] || python3 benches/tools/rounds.py "$WORK/rounds.txt" faden-tunnel nginx
