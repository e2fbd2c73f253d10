#!/usr/bin/env bash
# The tunnel alone beside rathole, in interleaved rounds: the `relay` section of
# benches/compare.sh, repeated, with the median of the per-round ratios.
#
# faden-relay: faden-loadtest -> the server's proxy port (CONNECT) -> yamux over WebSocket ->
# tunnel worker (byte splice) -> mock engine. rathole: faden-loadtest -> rathole server -> rathole
# client (plain TCP transport, nodelay) -> the same engine. The same load generator drives both
# (POST chat completion, 64-byte prompt, 8 tokens), and the engine alone is the latency baseline
# (its CPU column is the engine's). Per round and target: requests, p50 / p99,
# CPU per request of the tunnel's two processes (user + system, and user alone), voluntary and
# involuntary context switches per request; then the medians of the faden / rathole ratios.
#
# Usage: benches/relay_vs_rathole.sh [SECONDS] [CONNS...]   (default: 5 s, c=1)
#   ROUNDS=N     rounds (default 5); each runs the engine alone, faden, then rathole, after a
#                1 s warm-up each
#   MAX_STEAL=PCT  also print the medians without the rounds where a target lost more than PCT %
#                of the host's CPU time to the hypervisor (benches/tools/rounds.py)
#   FADEN=path   binary (default $CARGO_TARGET_DIR or target, release/faden; build it first,
#                with faden-loadtest beside it)
# Needs rathole (`cargo install rathole --no-default-features --features server,client`).
# Loopback only; everything started is killed on exit.
set -u
cd "$(dirname "$0")/.."
DUR=${1:-5}; shift || true
CONNS=${*:-1}
ROUNDS=${ROUNDS:-5}
FADEN=${FADEN:-${CARGO_TARGET_DIR:-target}/release/faden}
LT=$(dirname "$FADEN")/faden-loadtest
source benches/tools/lib.sh
require_tools "$FADEN" "$LT" rathole python3 curl
start_work relay
source benches/tools/relay_setup.sh

common=(--model demo --max-tokens 8 --prompt-bytes 64 --no-progress)
echo "load: $(cut -d' ' -f1-3 /proc/loadavg), $ROUNDS rounds of ${DUR} s"
for round in $(seq 1 "$ROUNDS"); do
  for c in $CONNS; do
    for who in direct faden-relay rathole; do
      if [ $who = direct ]; then
        pids=$EP
        cmd=("$LT" --url "http://$ENGINE/v1" "${common[@]}" --concurrency "$c")
      elif [ $who = faden-relay ]; then
        pids="$SP $TP"
        cmd=(env "FADEN_PROXY_AUTH=$ADMIN" "$LT" --url "http://$ENGINE/v1" "${common[@]}" --connect-proxy "127.0.0.1:$PP" --connect-target "$TARGET" --concurrency "$c")
      else
        pids="$RS $RC"
        cmd=("$LT" --url "http://127.0.0.1:$RP/v1" "${common[@]}" --concurrency "$c")
      fi
      loadtest_round "$who" "$c" latency "$pids" "${cmd[@]}"
    done
  done
done | tee "$WORK/rounds.txt"
python3 benches/tools/rounds.py "$WORK/rounds.txt" faden-relay rathole direct
