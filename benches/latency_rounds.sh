#!/usr/bin/env bash
# The gateway's latency targets in interleaved rounds: what the direct path and nginx add to the
# mock engine alone at concurrency 1, for a whole answer (POST chat completion, 64-byte prompt,
# 8 tokens: added p50 and p99) and for a stream (16 tokens 1 ms apart: added time to first token
# p50 and p99, and the inter-token gap, which stays the engine's when nothing coalesces). One
# load generator (faden-loadtest, one connection, keep-alive) drives every target; each round
# runs the engine alone, faden, then nginx, for both loads. A single run's p99 at c=1 moves by a
# millisecond on these shared VMs; the median of the per-round differences is the figure.
#
# Usage: benches/latency_rounds.sh [SECONDS]                  (default: 5 s per target and round)
#   ROUNDS=N     rounds (default 10)
#   MAX_STEAL=PCT  also print the medians without the rounds where a target lost more than PCT %
#                of the host's CPU time to the hypervisor (benches/tools/rounds.py)
#   SSE_TOKENS=N tokens per stream (default 16, 1 ms apart): fewer make more streams per round,
#                so each round's TTFT p99 rests on more of them
#   FADEN=path   binary (default $CARGO_TARGET_DIR or target, release/faden; build it first,
#                with faden-loadtest beside it)
#   PROXY_THREADS=N  the faden server's runtime threads and nginx's worker processes (default 1)
# Prints one line per round and target (benches/tools/loadtest_line.py: p50_us / p99_us are the
# answer's latency, or the time to first token on the sse-* lines; CPU per request of the
# proxy), then the medians (benches/tools/rounds.py). Loopback only; everything started is
# killed on exit. About ROUNDS x 6 x (SECONDS + 1) seconds.
set -u
cd "$(dirname "$0")/.."
DUR=${1:-5}
ROUNDS=${ROUNDS:-10}
FADEN=${FADEN:-${CARGO_TARGET_DIR:-target}/release/faden}
LT=$(dirname "$FADEN")/faden-loadtest
source benches/tools/lib.sh
require_tools "$FADEN" "$LT" nginx python3 curl
start_work latency
source benches/tools/gateway_setup.sh

echo "load: $(cut -d' ' -f1-3 /proc/loadavg), $ROUNDS rounds of ${DUR} s, c=1"
for round in $(seq 1 "$ROUNDS"); do
  for load in answer sse; do
    for who in direct faden-direct nginx; do
      case $who in
        direct) url=http://$([ $load = sse ] && echo "$SSE_ENGINE" || echo "$ENGINE"); pids=$([ $load = sse ] && echo $SSE_EP || echo $EP) ;;
        faden-direct) url=http://$GW; pids=$SERVER ;;
        nginx) url=http://127.0.0.1:$([ $load = sse ] && echo $NSP || echo $NP); pids=$NPIDS ;;
      esac
      if [ $load = sse ]; then
        model=demo-direct-sse; extra=(--stream --max-tokens "${SSE_TOKENS:-16}"); what=ttft; name=sse-$who
      else
        model=demo-direct; extra=(--max-tokens 8); what=latency; name=$who
      fi
      loadtest_round "$name" 1 $what "$pids" "$LT" --url "$url/v1" --api-key "$KEY" --model "$model" --prompt-bytes 64 --concurrency 1 --no-progress "${extra[@]}"
    done
  done
done | tee "$WORK/rounds.txt"
python3 benches/tools/rounds.py "$WORK/rounds.txt" faden-direct nginx direct
python3 benches/tools/rounds.py "$WORK/rounds.txt" sse-faden-direct sse-nginx sse-direct
