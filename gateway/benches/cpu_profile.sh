#!/usr/bin/env bash
# CPU per request of the gateway's `direct` path, and optionally a profile of it.
#
# Starts the mock engine, `faden server` and one `direct` worker (as benches/compare.sh does),
# warms up, then drives non-streamed chat completions with wrk and reads the server's CPU time
# (user + system from /proc) over the run.
#
# Usage: gateway/benches/cpu_profile.sh [-d SECONDS] [-c CONNS] [-r ROUNDS] [-p perf|callgrind]
#   -p perf       perf record (cpu-clock, call graphs) of the server during the first round
#   -p callgrind  run the server under callgrind, collect only during the measured rounds
#                 and print instructions per request (steady on a noisy machine);
#                 CALLGRIND_CACHE=1 adds simulated cache misses per request
#   -p hold       set up, write /tmp/faden-hold.env (URL, SERVER_PID, LUA) and wait
# SERVER_TOKIO_WORKERS=N sets the server's runtime worker threads (--worker-threads; 1 is the
# current-thread scheduler, as the side-by-side benchmarks run it); the others keep the default.
# Binary: $FADEN (default: $CARGO_TARGET_DIR or target, release/faden; build it first).
set -euo pipefail
cd "$(dirname "$0")/../.."
DURATION=5 CONNS=64 ROUNDS=3 PROFILE=""
while getopts "d:c:r:p:" opt; do
  case $opt in
    d) DURATION=$OPTARG ;; c) CONNS=$OPTARG ;; r) ROUNDS=$OPTARG ;; p) PROFILE=$OPTARG ;;
    *) exit 2 ;;
  esac
done
FADEN=${FADEN:-${CARGO_TARGET_DIR:-target}/release/faden}
WORK=$(mktemp -d /tmp/faden-cpu.XXXXXX)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
source benches/tools/lib.sh
WAIT_TRIES=600 # the server starts slowly under callgrind
ticks() { read -r -a f < "/proc/$1/stat"; echo $((f[13] + f[14])); }
export FADEN_LOG=warn,faden=info
"$FADEN" mock-engine --port 0 --model demo --tokens 8 >"$WORK/engine.log" 2>&1 &
PIDS+=($!)
ENGINE=$(wait_for "$WORK/engine.log" "mock engine listening" addr)
export FADEN_WORKER_CREDENTIAL=bench-credential-0123456789
PREFIX=()
if [ "$PROFILE" = callgrind ]; then
  PREFIX=(valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$WORK/callgrind.out")
  # CALLGRIND_CACHE=1: simulate the caches too (valgrind's model of one core's L1 and last
  # level, the server alone) and print misses per request beside the instructions.
  [ "${CALLGRIND_CACHE:-0}" = 1 ] && PREFIX+=(--cache-sim=yes)
fi
SERVER_ENV=()
# SERVER_TOKIO_WORKERS=N: runtime worker threads of the server only.
[ -n "${SERVER_TOKIO_WORKERS:-}" ] && SERVER_ENV=(env FADEN_WORKER_THREADS="$SERVER_TOKIO_WORKERS")
"${SERVER_ENV[@]}" "${PREFIX[@]}" "$FADEN" server --data-dir "$WORK/server" --host 127.0.0.1 --api-port 0 --port 0 >"$WORK/server.log" 2>&1 &
SERVER_PID=$!
PIDS+=($SERVER_PID)
API=$(wait_for "$WORK/server.log" "faden server ready" api)
GATEWAY=$(wait_for "$WORK/server.log" "faden server ready" gateway)
ADMIN=$(cat "$WORK/server/admin.key")
api() { curl -sf -H "Authorization: Bearer $ADMIN" "$@"; }
REG=$(api -X POST "http://$API/v2/clusters" -d '{"name":"bench"}' | python3 -c 'import json,sys; print(json.load(sys.stdin)["registration_token"])')
api -X POST "http://$API/v2/models" -d '{"name":"demo-direct"}' >/dev/null
KEY=$(api -X POST "http://$API/v2/api-keys" -d '{"name":"bench"}' | python3 -c 'import json,sys; print(json.load(sys.stdin)["value"])')
"$FADEN" worker --server-url "http://$API" --token "$REG" --name w-direct --proxy-mode direct \
  --worker-ip 127.0.0.1 --worker-port 0 --disable-worker-metrics --instance "demo-direct=${ENGINE##*:}" \
  --data-dir "$WORK/w" --probe-interval 200ms >"$WORK/w.log" 2>&1 &
PIDS+=($!)
wait_for "$WORK/w.log" "faden worker ready" worker_id >/dev/null
for _ in $(seq 1 300); do
  code=$(curl -s -o /dev/null -w '%{http_code}' "http://$GATEWAY/v1/chat/completions" \
    -H "Authorization: Bearer $KEY" -d '{"model":"demo-direct","messages":[]}')
  [ "$code" = 200 ] && break
  sleep 0.1
done
[ "$code" = 200 ] || { echo "not routable ($code)" >&2; exit 1; }
cat >"$WORK/post.lua" <<LUA
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer $KEY"
wrk.body = '{"model": "demo-direct", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}'
LUA
URL="http://$GATEWAY/v1/chat/completions"
THREADS=1; [ "$CONNS" -gt 1 ] && THREADS=2
wrk -t1 -c"$CONNS" -d2s -s "$WORK/post.lua" "$URL" >/dev/null 2>&1 || true
TCK=$(getconf CLK_TCK)
if [ "$PROFILE" = hold ]; then
  # Keep the setup running for manual profiling: source the printed file for URL, KEY, PIDs.
  printf 'URL=%s\nSERVER_PID=%s\nLUA=%s\nENGINE=%s\n' "$URL" "$SERVER_PID" "$WORK/post.lua" "$ENGINE" >/tmp/faden-hold.env
  echo "holding; see /tmp/faden-hold.env"
  while kill -0 "$SERVER_PID" 2>/dev/null; do sleep 1; done
  exit 0
fi
reqs() { sed -n 's/^ *\([0-9]*\) requests in.*/\1/p' "$WORK/wrk.out"; }
if [ "$PROFILE" = callgrind ]; then
  callgrind_control -i on "$SERVER_PID" >/dev/null
  callgrind_control -z "$SERVER_PID" >/dev/null
  wrk -t"$THREADS" -c"$CONNS" -d"${DURATION}s" -s "$WORK/post.lua" "$URL" >"$WORK/wrk.out" 2>&1
  callgrind_control -i off "$SERVER_PID" >/dev/null
  callgrind_control -d "$SERVER_PID" >/dev/null
  sleep 1
  N=$(reqs)
  OUTF=$(ls -S "$WORK"/callgrind.out* | head -1)
  IR=$(awk '/^totals:/ {s += $2} END {print s}' "$OUTF")  # 'summary:' can wrap after callgrind_control -z
  echo "requests=$N instructions=$IR per_request=$((IR / N))"
  if [ "${CALLGRIND_CACHE:-0}" = 1 ]; then
    awk -v n="$N" '/^events:/ {for (i = 2; i <= NF; i++) name[i] = $i}
      /^totals:/ {for (i = 2; i <= NF; i++) t[i] += $i}
      END {for (i = 3; i in name; i++) printf "%s=%.1f ", name[i], t[i] / n; print "(per request)"}' "$OUTF"
  fi
  cp "$OUTF" /tmp/callgrind.faden.out
  echo "callgrind file: /tmp/callgrind.faden.out"
  exit 0
fi
for r in $(seq 1 "$ROUNDS"); do
  if [ "$PROFILE" = perf ] && [ "$r" = 1 ]; then
    perf record -e cpu-clock -F 2000 -g -p "$SERVER_PID" -o /tmp/perf.faden.data -- sleep "$DURATION" >/dev/null 2>&1 &
    PERF=$!
  fi
  before=$(ticks "$SERVER_PID")
  wrk -t"$THREADS" -c"$CONNS" -d"${DURATION}s" --latency -s "$WORK/post.lua" "$URL" >"$WORK/wrk.out" 2>&1
  after=$(ticks "$SERVER_PID")
  [ -n "${PERF:-}" ] && { wait "$PERF" || true; PERF=""; }
  N=$(reqs)
  RPS=$(sed -n 's/^Requests\/sec: *\([0-9.]*\).*/\1/p' "$WORK/wrk.out")
  P99=$(sed -n 's/^ *99% *\(.*\)$/\1/p' "$WORK/wrk.out")
  NON2XX=$(sed -n 's/.*Non-2xx or 3xx responses: \([0-9]*\).*/\1/p' "$WORK/wrk.out")
  python3 -c "print(f'round $r: req/s=$RPS p99=$P99 cpu_us_per_req={($after-$before)*1e6/$TCK/$N:.1f} non2xx=${NON2XX:-0}')"
done
