#!/usr/bin/env bash
# CPU per request of two faden binaries on the gateway's tunnel path and the proxy-port path, in
# interleaved rounds: a no-regression check between an old and a new build.
#
# Sets up, for each binary, its own engine and processes for each path of
# benches/tools/path_setup.sh (tunnel: the server's gateway -> in-process tunnel -> tunnel worker
# -> engine; proxy-port: a standalone `faden gateway` -> the server's proxy port -> tunnel ->
# worker -> engine), all at once and idle between runs, then drives each in turn, round after
# round (the binary that goes first alternates), with faden-loadtest: one connection, keep-alive,
# POST chat completion, 64-byte prompt, 8 tokens, not streamed, a 1 s warm-up then SECONDS.
# CPU per request is the user + system time of the faden processes on the path (not the
# engine, not the load generator) divided by the requests: `cpu_us/req` from the scheduler's
# run time of each thread (/proc/PID/task/*/schedstat), `stat_cpu_us/req` from the
# /proc/PID/stat ticks. Prints one line per run, then the medians of the per-round ratios
# new / old (benches/tools/rounds.py).
#
# Usage: benches/path_cpu.sh OLD_FADEN NEW_FADEN [SECONDS]   (default 5 s per run)
#   ROUNDS=N     rounds (default 8)
#   PATHS="..."  paths to run (default "tunnel proxy-port"; direct works too)
#   MAX_STEAL=PCT  also print the medians without the rounds that lost more than PCT % of the
#                host's CPU time to the hypervisor
# The load generator is faden-loadtest beside NEW_FADEN. Loopback only; everything started is
# killed on exit.
set -u
cd "$(dirname "$0")/.."
OLD=${1:?old binary}; NEW=${2:?new binary}; DUR=${3:-5}
ROUNDS=${ROUNDS:-8}; PATHS=${PATHS:-tunnel proxy-port}
LT=$(dirname "$NEW")/faden-loadtest
source benches/tools/lib.sh
require_tools "$OLD" "$NEW" "$LT" python3 curl
start_work path-cpu
BASE=$WORK
declare -A url key model pids
for who in old new; do
  FADEN=$OLD; [ $who = new ] && FADEN=$NEW
  for ROUTE in $PATHS; do
    WORK=$BASE/$who-$ROUTE; mkdir -p "$WORK"
    source benches/tools/path_setup.sh
    url[$who-$ROUTE]=$URL; key[$who-$ROUTE]=$KEY; model[$who-$ROUTE]=$MODEL; pids[$who-$ROUTE]=$ON_PATH
  done
done
WORK=$BASE

# One run of lib.sh's loadtest_round, with the /proc/PID/stat ticks' CPU per request appended.
round() {
  local name=$1 v0 n0 u0 s0 e0 g0 v1 n1 u1 s1 e1 g1 k0 k1 n _
  local cmd=("$LT" --url "${url[$name]}" --api-key "${key[$name]}" --model "${model[$name]}" --max-tokens 8
    --prompt-bytes 64 --concurrency 1 --no-progress)
  "${cmd[@]}" --duration 1s > /dev/null 2>&1
  k0=$(cpu_ticks)
  read -r v0 n0 u0 s0 _ e0 g0 <<<"$(proc_stats ${pids[$name]})"
  "${cmd[@]}" --duration "${DUR}s" --json "$WORK/lt.json" > /dev/null 2>&1
  read -r v1 n1 u1 s1 _ e1 g1 <<<"$(proc_stats ${pids[$name]})"
  k1=$(cpu_ticks)
  n=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["latency"]["count"] or 1)' "$WORK/lt.json")
  echo "$(python3 benches/tools/loadtest_line.py "$WORK/lt.json" "$name" 1 $((v1 - v0)) $((n1 - n0)) \
    $((u1 - u0)) $((s1 - s0)) "$(getconf CLK_TCK)" latency $((e1 - e0)) $((g1 - g0))) steal%=$(steal_pct "$k0" "$k1")" \
    "stat_cpu_us/req=$(python3 -c "print(round($((u1 + s1 - u0 - s0)) * 1e6 / $(getconf CLK_TCK) / $n, 1))")"
}

echo "load: $(cut -d' ' -f1-3 /proc/loadavg), $ROUNDS rounds of ${DUR} s, c=1, $(nproc) CPUs"
for r in $(seq 1 "$ROUNDS"); do
  for ROUTE in $PATHS; do
    order="old new"; [ $((r % 2)) = 0 ] && order="new old"
    for who in $order; do round "$who-$ROUTE"; done
  done
done | tee "$WORK/rounds.txt"
echo "load: $(cut -d' ' -f1-3 /proc/loadavg)"
for ROUTE in $PATHS; do
  echo "== $ROUTE: new / old"
  python3 benches/tools/rounds.py "$WORK/rounds.txt" "new-$ROUTE" "old-$ROUTE"
done
