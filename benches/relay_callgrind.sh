#!/usr/bin/env bash
# Instructions per request of the tunnel's two processes beside rathole's, under callgrind.
#
# The setup of benches/relay_vs_rathole.sh (the tunnel alone: proxy port CONNECT -> yamux over
# WebSocket -> tunnel worker splice -> mock engine; rathole server -> client -> the same engine),
# with the faden server, the tunnel worker and both rathole processes run under
# `valgrind --tool=callgrind`, collecting only while faden-loadtest drives them (POST chat
# completion, 64-byte prompt, 8 tokens). Prints, per process, the instructions counted divided
# by the requests the load generator completed. callgrind counts instructions, not time: the
# figure repeats for the same binary whatever else the machine runs (wake-ups per request can
# still move it a little), where CPU seconds on a shared two-core machine do not.
#
# Usage: benches/relay_callgrind.sh [SECONDS] [CONNS]   (default: 5 s, c=1)
#   FADEN=path   binary (default $CARGO_TARGET_DIR or target, release/faden; faden-loadtest
#                beside it)
#   CALLGRIND_CACHE=1  simulate the caches too: L1 instruction misses per request beside
#   OUT=dir      keep the callgrind files there (callgrind_annotate them; default: deleted)
# Needs valgrind and rathole. Loopback only; everything started is killed on exit.
set -u
cd "$(dirname "$0")/.."
DUR=${1:-5}; CONNS=${2:-1}
FADEN=${FADEN:-${CARGO_TARGET_DIR:-target}/release/faden}
LT=$(dirname "$FADEN")/faden-loadtest
source benches/tools/lib.sh
require_tools "$FADEN" "$LT" rathole valgrind callgrind_control python3 curl
start_work relay-cg
WAIT_TRIES=600 # slow starts under valgrind
RUN_UNDER=(valgrind --tool=callgrind --instr-atstart=no "--callgrind-out-file=$WORK/callgrind.%p")
[ "${CALLGRIND_CACHE:-0}" = 1 ] && RUN_UNDER+=(--cache-sim=yes)
source benches/tools/relay_setup.sh

common=(--model demo --max-tokens 8 --prompt-bytes 64 --no-progress --concurrency "$CONNS")
# Instructions (and L1i misses with the cache model) of process $1 per $2 requests.
per_request() {
  local f
  f=$(ls "$WORK/callgrind.$1".*) # the dump callgrind_control asked for
  awk -v n="$2" '/^events:/ {for (i = 2; i <= NF; i++) name[i] = $i}
    /^totals:/ {for (i = 2; i <= NF; i++) t[i] += $i}
    END {printf "%.0f", t[2] / n; for (i in name) if (name[i] == "I1mr") printf " (L1i misses %.0f)", t[i] / n}' "$f"
}
for who in faden rathole; do
  if [ $who = faden ]; then
    pids=("$SP" "$TP")
    cmd=(env "FADEN_PROXY_AUTH=$ADMIN" "$LT" --url "http://$ENGINE/v1" "${common[@]}" --connect-proxy "127.0.0.1:$PP" --connect-target "$TARGET")
  else
    pids=("$RS" "$RC")
    cmd=("$LT" --url "http://127.0.0.1:$RP/v1" "${common[@]}")
  fi
  "${cmd[@]}" --duration 2s > /dev/null 2>&1 # warm-up, not counted
  for p in "${pids[@]}"; do callgrind_control -i on "$p" >/dev/null 2>&1; done
  "${cmd[@]}" --duration "${DUR}s" --json "$WORK/lt.json" > /dev/null 2>&1
  for p in "${pids[@]}"; do callgrind_control -i off "$p" >/dev/null 2>&1; done
  n=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["latency"]["count"])' "$WORK/lt.json")
  for p in "${pids[@]}"; do callgrind_control -d "$p" >/dev/null 2>&1; done
  sleep 1
  echo "$who c=$CONNS requests=$n instructions/request: server $(per_request "${pids[0]}" "$n"), worker/client $(per_request "${pids[1]}" "$n")"
  if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    cp "$WORK/callgrind.${pids[0]}".* "$OUT/$who.server.out"; cp "$WORK/callgrind.${pids[1]}".* "$OUT/$who.worker.out"
  fi
done
