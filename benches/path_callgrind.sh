#!/usr/bin/env bash
# Instructions per request of each process on one of the gateway's request paths, under
# callgrind.
#
# The setup of benches/tools/path_setup.sh (direct: the server's gateway -> engine; tunnel: the
# server's gateway -> in-process tunnel -> tunnel worker -> engine; proxy-port: a standalone
# `faden gateway` -> the server's proxy port -> tunnel -> worker -> engine), with every faden
# process on the path run under `valgrind --tool=callgrind`, collecting only while
# faden-loadtest sends exactly REQUESTS requests one at a time after a warm-up (keep-alive, POST
# chat completion, 64-byte prompt, 8 tokens, not streamed). Prints, per process, the
# instructions counted divided by the requests. callgrind counts instructions, not time: the
# figure repeats for the same binary whatever else the machine runs.
#
# Usage: benches/path_callgrind.sh direct|tunnel|proxy-port [REQUESTS]   (default 1000)
#   FADEN=path   binary (default $CARGO_TARGET_DIR or target, release/faden); the load generator
#                is LOADTEST, default faden-loadtest beside it
#   OUT=dir      keep the callgrind files there as PATH.PROCESS.out, with PATH.requests (for
#                benches/tools/callgrind_path.py and callgrind_annotate)
#   FRESH=1      every request on new connections instead: REQUESTS runs of one request, each
#                after the pools' idle connections have expired (4 s), so that the window
#                holds what a connection's setup runs as well (client, pool and tunnel stream)
# Needs valgrind. Loopback only; everything started is killed on exit.
set -u
cd "$(dirname "$0")/.."
ROUTE=${1:?direct, tunnel or proxy-port}; N=${2:-1000}
FADEN=${FADEN:-${CARGO_TARGET_DIR:-target}/release/faden}
LT=${LOADTEST:-$(dirname "$FADEN")/faden-loadtest}
source benches/tools/lib.sh
require_tools "$FADEN" "$LT" valgrind callgrind_control python3 curl
start_work path-cg
WAIT_TRIES=1200 # slow starts under valgrind
RUN_UNDER=(valgrind --tool=callgrind --instr-atstart=no "--callgrind-out-file=$WORK/callgrind.%p")
source benches/tools/path_setup.sh

cmd=("$LT" --url "$URL" --model "$MODEL" --api-key "$KEY" --max-tokens 8 --prompt-bytes 64 --no-progress --concurrency 1)
"${cmd[@]}" --requests 50 > /dev/null 2>&1 # warm-up, not counted
window() { # instrumented: one load generator run with the given arguments
  for p in $ON_PATH; do callgrind_control -i on "$p" >/dev/null 2>&1; done
  "${cmd[@]}" "$@" > /dev/null 2>&1
  for p in $ON_PATH; do callgrind_control -i off "$p" >/dev/null 2>&1; done
}
ok=0 errors=0
count() { # adds up a run's answers
  read -r o e < <(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d["ok"], d["error_total"])' "$WORK/lt.json")
  ok=$((ok + o)); errors=$((errors + e))
}
if [ "${FRESH:-0}" = 1 ]; then
  for _ in $(seq 1 "$N"); do sleep 4; window --requests 1 --json "$WORK/lt.json"; count; done
else
  window --requests "$N" --json "$WORK/lt.json"; count
fi
for p in $ON_PATH; do callgrind_control -d "$p" >/dev/null 2>&1; done
sleep 1
line="$ROUTE${FRESH:+ fresh=$FRESH} c=1 requests=$ok errors=$errors instructions/request:"
set -- $ON_PATH_NAMES
total=0
[ -n "${OUT:-}" ] && { mkdir -p "$OUT"; echo "$ok" > "$OUT/$ROUTE.requests"; }
for p in $ON_PATH; do
  f=$(ls "$WORK/callgrind.$p".*) # the dump callgrind_control asked for
  ir=$(awk '/^totals:/ {s += $2} END {printf "%.0f", s}' "$f")
  line="$line $1 $((ir / ok))"; total=$((total + ir))
  [ -n "${OUT:-}" ] && cp "$f" "$OUT/$ROUTE.$1.out"
  shift
done
echo "$line total $((total / ok))"
