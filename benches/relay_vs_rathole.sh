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
for tool in "$FADEN" "$LT" rathole python3 curl; do
  command -v "$tool" >/dev/null || { echo "missing $tool" >&2; exit 2; }
done
WORK=$(mktemp -d /tmp/relay.XXXXXX); PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; rm -rf "$WORK"; }
trap cleanup EXIT
source benches/tools/lib.sh

export FADEN_LOG=warn,faden=info FADEN_WORKER_THREADS=1 FADEN_MAX_PENDING_PER_SOURCE=0 FADEN_MAX_PENDING_CONNECTIONS=20000
"$FADEN" mock-engine --port 0 --model demo --tokens 8 > "$WORK/engine.log" 2>&1 & EP=$!; PIDS+=($EP)
ENGINE=$(wait_for "$WORK/engine.log" "mock engine listening" addr)
PP=$(free_port)
"$FADEN" server --data-dir "$WORK/server" --host 127.0.0.1 --api-port 0 --port 0 --proxy-port "$PP" > "$WORK/server.log" 2>&1 & SP=$!; PIDS+=($SP)
API=$(wait_for "$WORK/server.log" "faden server ready" api)
ADMIN=$(cat "$WORK/server/admin.key"); api() { curl -sf -H "Authorization: Bearer $ADMIN" "$@"; }
REG=$(api -X POST "http://$API/v2/clusters" -d '{"name":"b"}' | python3 -c 'import json,sys; print(json.load(sys.stdin)["registration_token"])')
api -X POST "http://$API/v2/models" -d '{"name":"demo-tunnel"}' >/dev/null
# `--worker-ip` names an address nothing listens on: every byte goes through the tunnel.
"$FADEN" worker --server-url "http://$API" --token "$REG" --name wt --proxy-mode tunnel --worker-ip 10.255.0.7 --worker-port 0 --disable-worker-metrics --instance "demo-tunnel=${ENGINE##*:}" --data-dir "$WORK/wt" --probe-interval 1s > "$WORK/wt.log" 2>&1 & TP=$!; PIDS+=($TP)
wait_for "$WORK/wt.log" "faden worker ready" worker_id >/dev/null
TARGET=
for _ in $(seq 1 100); do
  TARGET=$(api "http://$API/v2/model-instances?perPage=-1" | python3 -c "import json,sys; i=[i for i in json.load(sys.stdin)['items'] if i['state']=='running']; print('model-%d-%d.static:0' % (i[0]['model_id'], i[0]['id']) if i else '')")
  [ -n "$TARGET" ] && break; sleep 0.1
done
[ -n "$TARGET" ] || { echo "the tunnel instance never ran" >&2; exit 1; }

RH_CTRL=$(free_port); RP=$(free_port)
printf '[server]\nbind_addr = "127.0.0.1:%s"\ndefault_token = "t"\n[server.transport]\ntype = "tcp"\n[server.transport.tcp]\nnodelay = true\n[server.services.engine]\nbind_addr = "127.0.0.1:%s"\nnodelay = true\n' "$RH_CTRL" "$RP" > "$WORK/rs.toml"
printf '[client]\nremote_addr = "127.0.0.1:%s"\ndefault_token = "t"\n[client.transport]\ntype = "tcp"\n[client.transport.tcp]\nnodelay = true\n[client.services.engine]\nlocal_addr = "%s"\nnodelay = true\n' "$RH_CTRL" "$ENGINE" > "$WORK/rc.toml"
rathole --server "$WORK/rs.toml" > "$WORK/rs.log" 2>&1 & RS=$!; PIDS+=($RS)
sleep 0.3; rathole --client "$WORK/rc.toml" > "$WORK/rc.log" 2>&1 & RC=$!; PIDS+=($RC)
sleep 1

HZ=$(getconf CLK_TCK)
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
      "${cmd[@]}" --duration 1s > /dev/null 2>&1
      read -r v0 n0 u0 s0 _ <<<"$(proc_stats $pids)"
      "${cmd[@]}" --duration "${DUR}s" --json "$WORK/lt.json" > /dev/null 2>&1
      read -r v1 n1 u1 s1 _ <<<"$(proc_stats $pids)"
      python3 - "$WORK/lt.json" "$who" "$c" $((v1 - v0)) $((n1 - n0)) $((u1 - u0)) $((s1 - s0)) "$HZ" <<'PY'
import json, sys
d = json.load(open(sys.argv[1])); who, c = sys.argv[2], sys.argv[3]
vol, invol, user, system, hz = (int(x) for x in sys.argv[4:9])
n = d["latency"]["count"] or 1
us = lambda ticks: ticks / hz * 1e6 / n
print(f"{who} c={c} n={n} p50_us={d['latency']['p50_ms'] * 1000:.0f} p99_us={d['latency']['p99_ms'] * 1000:.0f} "
      f"cpu_us/req={us(user + system):.1f} user_us/req={us(user):.1f} vol/req={vol / n:.2f} invol/req={invol / n:.3f}")
PY
    done
  done
done | tee "$WORK/rounds.txt"
python3 benches/tools/rounds.py "$WORK/rounds.txt" faden-relay rathole direct
