#!/usr/bin/env bash
# Side-by-side proxy benchmark on loopback, bounded in time.
#
# Targets, all in front of the same mock engine (non-streamed chat completion, ~330-byte answer):
#   direct        the mock engine itself
#   faden-direct  faden gateway, `direct` path (gateway -> engine)
#   faden-worker  faden gateway, `worker` path (gateway -> worker reverse proxy -> engine)
#   faden-tunnel  faden gateway, `tunnel` path (gateway -> in-process tunnel -> worker -> engine)
#   nginx         nginx proxy_pass with upstream keepalive
#   haproxy       HAProxy with connection reuse
#   rathole       rathole server + client (plain TCP transport) exposing the engine's port
#                 with TCP_NODELAY on every socket (`nodelay = true`; rathole leaves the visitor
#                 and local sockets alone by default, and SSE through it then comes in bursts)
#                 (skipped when `rathole` is not installed: cargo install rathole)
#
# Sections (each bounded; the whole run takes about 22 x DURATION + 2 x SSE_DURATION x 6 + ~60 s):
#   http        wrk POST chat completion at 1 and 64 connections. CPU per request is the user +
#               system time of the proxy's processes during the run (from /proc) divided by the
#               requests served: the steadiest figure on a shared machine. RSS after the run.
#   tiny        wrk at 1 connection, 64-byte POST /v1/moderations (the mock engine answers a
#               ~80-byte JSON echo): the latency a proxy adds to a small request/response.
#   relay       the tunnel alone beside rathole, one client for both (faden-loadtest, POST chat
#               completion, c=1 and c=64): faden-relay is `--connect-proxy <proxy port>
#               --connect-target model-<m>-<i>.static:0`, so the proxy port relays each load
#               connection over the tunnel and the tunnel worker splices it to the engine (no
#               gateway, no HTTP work in faden per request); CPU of the server + tunnel worker
#               against both rathole processes, the engine itself as the baseline.
#   sse         faden-loadtest --stream -c 1 against a second mock engine (16 tokens, 1 ms apart,
#               TTFT 0): TTFT p50/p99 and inter-token latency (coalesced chunks show as ITL ~0).
#   idle_conns  N idle HTTP/1.1 keep-alive client connections (one GET each, then idle) to the
#               faden gateway (the server process) and to nginx: RSS before and while held. Runs
#               after the load sections so that their RSS column is not inflated by it.
#   idle_tunnels  RSS of the server before and after T more tunnel workers connect and sit idle,
#               and the RSS of one idle tunnel worker process.
#   streams     M concurrent SSE streams (a mock engine streaming 40 tokens 500 ms apart) through
#               the tunnel path (RSS of the server, then of the tunnel worker, at the largest
#               stream count seen on the gateway's faden_gateway_active_streams) and through the direct
#               path (server RSS; capped so that two sockets per stream fit the fd limit).
#   body        a 100 MB POST body (/v1/moderations) through each path, 3 times, median seconds.
#   reconnect   kill -9 the server, restart it on the same ports and data directory, time until
#               the tunnel worker serves a request through the gateway again (3 rounds).
#
# Usage: benches/compare.sh [-d SECONDS] [-s SSE_SECONDS] [-n IDLE_CONNS] [-t IDLE_TUNNELS]
#                           [-b BODY_MB] [-m STREAMS] [-o results.json] [-p PLOT_DIR]
#                           [-O SECTION,...]   (only these sections; default: all)
# BIN_DIR=dir runs the binaries found there (faden, faden-loadtest, faden-mock-engine,
# faden-bench-plot) instead of building them, e.g. target/pgo/bin from scripts/release-pgo.sh.
# Needs: wrk, nginx, haproxy (apt-get install -y wrk nginx-light haproxy), python3, curl;
# optional: rathole.
set -euo pipefail
cd "$(dirname "$0")/.."

DURATION=10
SSE_DURATION=10
IDLE_CONNS=10000
IDLE_TUNNELS=20
STREAMS=10000
BODY_MB=100
OUT=""
PLOTS=""
ONLY=""
while getopts "d:s:n:t:b:m:o:p:O:" opt; do
  case $opt in
    d) DURATION=$OPTARG ;;
    s) SSE_DURATION=$OPTARG ;;
    n) IDLE_CONNS=$OPTARG ;;
    t) IDLE_TUNNELS=$OPTARG ;;
    b) BODY_MB=$OPTARG ;;
    m) STREAMS=$OPTARG ;;
    o) OUT=$OPTARG ;;
    p) PLOTS=$OPTARG ;;
    O) ONLY=$OPTARG ;;
    *) echo "usage: $0 [-d s] [-s sse_s] [-n idle_conns] [-t idle_tunnels] [-b body_mb] [-m streams] [-o results.json] [-p plot_dir] [-O section,...]" >&2; exit 2 ;;
  esac
done
SECTIONS="idle_tunnels http tiny relay sse idle_conns streams body reconnect"
for s in ${ONLY//,/ }; do
  [[ " $SECTIONS " == *" $s "* ]] || { echo "unknown section $s (sections: $SECTIONS)" >&2; exit 2; }
done
want() { [ -z "$ONLY" ] || [[ ",$ONLY," == *",$1,"* ]]; }
for tool in wrk nginx haproxy python3 curl; do
  command -v "$tool" >/dev/null || { echo "missing $tool (apt-get install -y wrk nginx-light haproxy)" >&2; exit 2; }
done
HAVE_RATHOLE=0
if command -v rathole >/dev/null; then HAVE_RATHOLE=1; else
  echo "note: rathole not installed (cargo install rathole --locked): skipping the rathole target" >&2
fi
# 10k idle connections need ~10k descriptors in the client and in the server: raise the soft
# limit as far as the hard limit allows (children inherit it).
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)"

WORK=$(mktemp -d /tmp/faden-bench.XXXXXX)
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for f in "$WORK"/nginx*.pid; do [ -f "$f" ] && kill "$(cat "$f")" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

source benches/tools/lib.sh
# CPU ticks (user+system, all threads) of the given PIDs.
cpu_ticks() {
  local total=0
  for pid in "$@"; do
    read -r -a f < "/proc/$pid/stat"
    total=$((total + f[13] + f[14]))
  done
  echo "$total"
}
rss_kib() {
  local total=0
  for pid in "$@"; do total=$((total + $(awk '/VmRSS/ {print $2}' "/proc/$pid/status"))); done
  echo "$total"
}
load_avg() { cut -d' ' -f1-3 /proc/loadavg; }
now() { date +%s.%N; }
TOOLS=benches/tools
RESULTS="$WORK/results.jsonl"
: >"$RESULTS"
emit() { echo "$1" >>"$RESULTS"; }
LOAD_START=$(load_avg)
echo "== load average at start: $LOAD_START"

if [ -n "${BIN_DIR:-}" ]; then
  BIN=$BIN_DIR
  echo "== binaries from $BIN (not building)"
else
  echo "== building (release)"
  cargo build --release --locked -p faden -p faden-loadtest -p faden-bench-plot 2>&1 | tail -1
  BIN=${CARGO_TARGET_DIR:-target}/release
fi
FADEN=$BIN/faden
LOADTEST=$BIN/faden-loadtest
export FADEN_LOG=warn,faden=info

echo "== starting the mock engines, faden and three workers"
"$FADEN" mock-engine --port 0 --model demo --tokens 8 >"$WORK/engine.log" 2>&1 &
PIDS+=($!)
ENGINE=$(wait_for "$WORK/engine.log" "mock engine listening" addr)
ENGINE_PORT=${ENGINE##*:}
"$BIN/faden-mock-engine" --port 0 --model demo --tokens 16 --itl 1ms --ttft 0s >"$WORK/sse-engine.log" 2>&1 &
PIDS+=($!)
SSE_ENGINE=$(wait_for "$WORK/sse-engine.log" "mock engine listening" addr)
SSE_PORT=${SSE_ENGINE##*:}

# Fixed ports (picked free now) so that the reconnect test can restart the server on them.
API_PORT=$(free_port); GW_PORT=$(free_port); PROXY_PORT=$(free_port)
export FADEN_WORKER_CREDENTIAL=bench-credential-0123456789
# One runtime thread per faden process, as nginx runs `worker_processes 1` and HAProxy
# `nbthread 1` here (override: FADEN_WORKER_THREADS=2 benches/compare.sh).
export FADEN_WORKER_THREADS=${FADEN_WORKER_THREADS:-1}
# Every load generator connects from 127.0.0.1 and opens up to 10,000 connections at once: the
# per-source cap on connections still before their first request (128 by default) would refuse
# most of them (429), and the total cap (1024) too (503). A load balancer in front needs the
# same settings (docs/security.md).
export FADEN_MAX_PENDING_PER_SOURCE=0 FADEN_MAX_PENDING_CONNECTIONS=20000
BODY_LIMIT=$(( (BODY_MB + 16) * 1024 * 1024 ))
start_server() {
  "$FADEN" server --data-dir "$WORK/server" --host 127.0.0.1 --api-port "$API_PORT" --port "$GW_PORT" \
    --proxy-port "$PROXY_PORT" --max-body-size "$BODY_LIMIT" >"$WORK/server.log" 2>&1 &
  SERVER_PID=$!
  PIDS+=($SERVER_PID)
}
start_server
API=$(wait_for "$WORK/server.log" "faden server ready" api)
GATEWAY=$(wait_for "$WORK/server.log" "faden server ready" gateway)
ADMIN=$(cat "$WORK/server/admin.key")
api() { curl -sf -H "Authorization: Bearer $ADMIN" "$@"; }
REG=$(api -X POST "http://$API/v2/clusters" -d '{"name":"bench"}' | python3 -c 'import json,sys; print(json.load(sys.stdin)["registration_token"])')
for model in demo-direct demo-worker demo-tunnel demo-direct-sse demo-worker-sse demo-tunnel-sse demo-idle; do
  api -X POST "http://$API/v2/models" -d "{\"name\":\"$model\"}" >/dev/null
done
KEY=$(api -X POST "http://$API/v2/api-keys" -d '{"name":"bench"}' | python3 -c 'import json,sys; print(json.load(sys.stdin)["value"])')

start_worker() { # name mode instances... (sets LAST_PID; not in $(...), so that PIDS keeps it)
  local name=$1 mode=$2 ip=127.0.0.1; shift 2
  [ "$mode" = tunnel ] && ip=10.255.0.7 # a tunnel worker never dials or listens on its IP
  local inst=(); for i in "$@"; do inst+=(--instance "$i"); done
  "$FADEN" worker --server-url "http://$API" --token "$REG" --name "$name" --proxy-mode "$mode" \
    --worker-ip "$ip" --worker-port 0 --disable-worker-metrics "${inst[@]}" \
    --data-dir "$WORK/$name" --probe-interval 200ms >"$WORK/$name.log" 2>&1 &
  LAST_PID=$!
  PIDS+=($LAST_PID)
}
start_worker w-direct direct "demo-direct=$ENGINE_PORT" "demo-direct-sse=$SSE_PORT"
start_worker w-worker worker "demo-worker=$ENGINE_PORT" "demo-worker-sse=$SSE_PORT"
WORKER_PID=$LAST_PID
start_worker w-tunnel tunnel "demo-tunnel=$ENGINE_PORT" "demo-tunnel-sse=$SSE_PORT"
TUNNEL_PID=$LAST_PID
for w in w-direct w-worker w-tunnel; do wait_for "$WORK/$w.log" "faden worker ready" worker_id >/dev/null; done
routable() { # model [seconds]: waits until the gateway answers 200 for the model
  local code=000
  for _ in $(seq 1 $(( ${2:-10} * 50 ))); do
    code=$(curl -s -o /dev/null -w '%{http_code}' "http://$GATEWAY/v1/chat/completions" \
      -H "Authorization: Bearer $KEY" -d "{\"model\":\"$1\",\"messages\":[],\"max_tokens\":1}")
    [ "$code" = 200 ] && return 0
    sleep 0.02
  done
  echo "$1 not routable ($code)" >&2; return 1
}
for model in demo-direct demo-worker demo-tunnel demo-direct-sse demo-worker-sse demo-tunnel-sse; do
  routable "$model"
done

echo "== starting nginx, haproxy and rathole"
start_nginx() { # name port worker_connections upstream
  cat >"$WORK/$1.conf" <<EOF
worker_processes 1;
worker_rlimit_nofile $(ulimit -n);
pid $WORK/$1.pid;
error_log $WORK/$1-error.log warn;
events { worker_connections $3; }
http {
  access_log off;
  keepalive_timeout 300s;
  keepalive_requests 1000000;
  upstream engine { server $4; keepalive 128; }
  server {
    listen 127.0.0.1:$2 backlog=4096;
    location / {
      proxy_pass http://engine;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering off;
      client_max_body_size 0;
    }
  }
}
EOF
  nginx -c "$WORK/$1.conf" -p "$WORK"
  for _ in $(seq 1 50); do [ -s "$WORK/$1.pid" ] && break; sleep 0.1; done
  echo "$(cat "$WORK/$1.pid") $(pgrep -P "$(cat "$WORK/$1.pid")" | tr '\n' ' ')"
}
NGINX_PORT=$(free_port)
NGINX_PIDS=$(start_nginx nginx "$NGINX_PORT" 4096 "$ENGINE")
NGINX_SSE_PORT=$(free_port)
start_nginx nginx-sse "$NGINX_SSE_PORT" 4096 "$SSE_ENGINE" >/dev/null

HAPROXY_PORT=$(free_port)
cat >"$WORK/haproxy.cfg" <<EOF
global
  nbthread 1
  maxconn 4096
defaults
  mode http
  timeout connect 5s
  timeout client 60s
  timeout server 60s
  http-reuse always
frontend fe
  bind 127.0.0.1:$HAPROXY_PORT
  default_backend be
backend be
  server engine $ENGINE
EOF
haproxy -f "$WORK/haproxy.cfg" >"$WORK/haproxy.log" 2>&1 &
HAPROXY_PID=$!
PIDS+=($HAPROXY_PID)

RATHOLE_PIDS=""
if [ $HAVE_RATHOLE = 1 ]; then
  RH_CTRL=$(free_port); RATHOLE_PORT=$(free_port); RATHOLE_SSE_PORT=$(free_port)
  cat >"$WORK/rathole-server.toml" <<EOF
[server]
bind_addr = "127.0.0.1:$RH_CTRL"
default_token = "bench-rathole-token"
[server.transport]
type = "tcp"
[server.transport.tcp]
nodelay = true
[server.services.engine]
bind_addr = "127.0.0.1:$RATHOLE_PORT"
nodelay = true
[server.services.sse]
bind_addr = "127.0.0.1:$RATHOLE_SSE_PORT"
nodelay = true
EOF
  cat >"$WORK/rathole-client.toml" <<EOF
[client]
remote_addr = "127.0.0.1:$RH_CTRL"
default_token = "bench-rathole-token"
[client.transport]
type = "tcp"
[client.transport.tcp]
nodelay = true
[client.services.engine]
local_addr = "$ENGINE"
nodelay = true
[client.services.sse]
local_addr = "$SSE_ENGINE"
nodelay = true
EOF
  rathole --server "$WORK/rathole-server.toml" >"$WORK/rathole-server.log" 2>&1 &
  RH_SERVER=$!; PIDS+=($RH_SERVER)
  sleep 0.2
  rathole --client "$WORK/rathole-client.toml" >"$WORK/rathole-client.log" 2>&1 &
  RH_CLIENT=$!; PIDS+=($RH_CLIENT)
  RATHOLE_PIDS="$RH_SERVER $RH_CLIENT"
  ok=0
  for _ in $(seq 1 100); do
    curl -sf -m 1 -o /dev/null "http://127.0.0.1:$RATHOLE_PORT/health" && curl -sf -m 1 -o /dev/null "http://127.0.0.1:$RATHOLE_SSE_PORT/health" && { ok=1; break; }
    sleep 0.1
  done
  if [ $ok = 0 ]; then
    echo "note: rathole did not come up, skipping it" >&2; cat "$WORK"/rathole-*.log >&2
    kill $RATHOLE_PIDS 2>/dev/null || true; HAVE_RATHOLE=0; RATHOLE_PIDS=""
  fi
fi
sleep 0.3
SERVER_LIMIT=$(awk '/Max open files/ {print $4}' "/proc/$SERVER_PID/limits")
echo "   fd limit: script $(ulimit -n), faden server $SERVER_LIMIT"

# ---------------------------------------------------------------------------------------------
if want idle_tunnels; then
echo "== idle tunnels: server RSS before and after $IDLE_TUNNELS more idle tunnel workers"
RSS0=$(rss_kib "$SERVER_PID")
IDLE_PIDS=()
for i in $(seq 1 "$IDLE_TUNNELS"); do
  start_worker "idle-$i" tunnel "demo-idle=$ENGINE_PORT"
  IDLE_PIDS+=("$LAST_PID")
done
for i in $(seq 1 "$IDLE_TUNNELS"); do wait_for "$WORK/idle-$i.log" "faden worker ready" worker_id >/dev/null; done
sleep 3
RSS1=$(rss_kib "$SERVER_PID")
TUNNELS_OPEN=$(ls -l "/proc/$SERVER_PID/fd" 2>/dev/null | grep -c socket || true)
WORKER_RSS=$(for p in "${IDLE_PIDS[@]}"; do rss_kib "$p"; done | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')
emit "{\"section\":\"idle_tunnels\",\"tunnels\":$IDLE_TUNNELS,\"server_rss_before_kib\":$RSS0,\"server_rss_after_kib\":$RSS1,\"per_tunnel_kib\":$(python3 -c "print(round(($RSS1-$RSS0)/$IDLE_TUNNELS,1))"),\"worker_rss_median_kib\":$WORKER_RSS,\"server_sockets_after\":$TUNNELS_OPEN}"
kill "${IDLE_PIDS[@]}" 2>/dev/null || true
fi

# ---------------------------------------------------------------------------------------------
cat >"$WORK/post.lua" <<'EOF'
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer " .. os.getenv("BENCH_KEY")
wrk.body = '{"model": "' .. os.getenv("BENCH_MODEL") .. '", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}'
EOF
# 64-byte request body; the mock engine answers POST /v1/moderations with a ~80-byte JSON echo.
cat >"$WORK/tiny.lua" <<'EOF'
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer " .. os.getenv("BENCH_KEY")
local head = '{"model":"' .. os.getenv("BENCH_MODEL") .. '","input":"'
local tail = '"}'
wrk.body = head .. string.rep("x", 64 - #head - #tail) .. tail
EOF
export BENCH_KEY=$KEY
TICK=$(getconf CLK_TCK)
run() { # section name url path lua model conns pids...
  local section=$1 name=$2 url=$3 path=$4 lua=$5 model=$6 conns=$7; shift 7
  local threads=1; [ "$conns" -gt 1 ] && threads=2
  BENCH_MODEL=$model wrk -t1 -c"$conns" -d2s -s "$WORK/$lua" "$url$path" >/dev/null 2>&1 || true # warm-up
  local before=0; [ $# -gt 0 ] && before=$(cpu_ticks "$@")
  BENCH_MODEL=$model wrk -t"$threads" -c"$conns" -d"${DURATION}s" --latency -s "$WORK/$lua" \
    "$url$path" >"$WORK/wrk.out" 2>&1 || true
  local after=0; [ $# -gt 0 ] && after=$(cpu_ticks "$@")
  local rss=0; [ $# -gt 0 ] && rss=$(rss_kib "$@")
  python3 "$TOOLS/parse_wrk.py" "$section" "$name" "$conns" "$((after - before))" "$TICK" "$rss" "$WORK/wrk.out" >>"$RESULTS"
}
each_target() { # section path lua conns: every target in front of the non-streaming engine
  local s=$1 p=$2 l=$3 c=$4
  run "$s" direct "http://$ENGINE" "$p" "$l" demo-direct "$c"
  run "$s" faden-direct "http://$GATEWAY" "$p" "$l" demo-direct "$c" "$SERVER_PID"
  run "$s" faden-worker "http://$GATEWAY" "$p" "$l" demo-worker "$c" "$SERVER_PID" "$WORKER_PID"
  run "$s" faden-tunnel "http://$GATEWAY" "$p" "$l" demo-tunnel "$c" "$SERVER_PID" "$TUNNEL_PID"
  # shellcheck disable=SC2086
  run "$s" nginx "http://127.0.0.1:$NGINX_PORT" "$p" "$l" demo-direct "$c" $NGINX_PIDS
  run "$s" haproxy "http://127.0.0.1:$HAPROXY_PORT" "$p" "$l" demo-direct "$c" "$HAPROXY_PID"
  # shellcheck disable=SC2086
  [ $HAVE_RATHOLE = 1 ] && run "$s" rathole "http://127.0.0.1:$RATHOLE_PORT" "$p" "$l" demo-direct "$c" $RATHOLE_PIDS
  return 0
}

if want http; then
  echo "== http: chat completion, ${DURATION}s per target and concurrency"
  for conns in 1 64; do each_target http /v1/chat/completions post.lua "$conns"; done
fi

if want tiny; then
  echo "== tiny: 64-byte POST /v1/moderations at c=1, ${DURATION}s per target"
  each_target tiny /v1/moderations tiny.lua 1
fi

# ---------------------------------------------------------------------------------------------
if want relay; then
  echo "== relay: the tunnel alone (proxy port -> tunnel -> worker splice -> engine) vs rathole, ${DURATION}s per target and concurrency"
  # The demo-tunnel instance, as the proxy port's CONNECT target.
  api "http://$API/v2/models?perPage=-1" >"$WORK/models.json"
  api "http://$API/v2/model-instances?perPage=-1" >"$WORK/instances.json"
  RELAY_TARGET=$(python3 - "$WORK/models.json" "$WORK/instances.json" <<'EOF'
import json, sys
models = {m["name"]: m["id"] for m in json.load(open(sys.argv[1]))["items"]}
items = json.load(open(sys.argv[2]))["items"]
i = next(i for i in items if i["model_id"] == models["demo-tunnel"])
print("model-%d-%d.static:0" % (i["model_id"], i["id"]))
EOF
)
  relay_run() { # name conns url connect_target(or -) pids...
    local name=$1 conns=$2 url=$3 target=$4; shift 4
    # The proxy port's key goes in the environment (FADEN_PROXY_AUTH), not on the command line.
    local lt=(env "$LOADTEST" --url "$url/v1" --model demo --max-tokens 8 --prompt-bytes 64 --no-progress)
    if [ "$target" != - ]; then
      lt=(env "FADEN_PROXY_AUTH=$ADMIN" "${lt[@]:1}" --connect-proxy "127.0.0.1:$PROXY_PORT" --connect-target "$target")
    fi
    "${lt[@]}" --concurrency "$conns" --duration 2s >/dev/null 2>&1 || true # warm-up
    local before=0; [ $# -gt 0 ] && before=$(cpu_ticks "$@")
    "${lt[@]}" --concurrency "$conns" --duration "${DURATION}s" \
      --json "$WORK/relay.json" >/dev/null 2>"$WORK/relay.err" || true
    local after=0; [ $# -gt 0 ] && after=$(cpu_ticks "$@")
    local rss=0; [ $# -gt 0 ] && rss=$(rss_kib "$@")
    python3 "$TOOLS/parse_loadtest.py" relay "$name" "$conns" "$((after - before))" "$TICK" "$rss" \
      "$WORK/relay.json" "$WORK/relay.err" >>"$RESULTS"
    rm -f "$WORK/relay.json"
  }
  for conns in 1 64; do
    relay_run direct "$conns" "http://$ENGINE" -
    relay_run faden-relay "$conns" "http://$ENGINE" "$RELAY_TARGET" "$SERVER_PID" "$TUNNEL_PID"
    # shellcheck disable=SC2086
    if [ $HAVE_RATHOLE = 1 ]; then relay_run rathole "$conns" "http://127.0.0.1:$RATHOLE_PORT" - $RATHOLE_PIDS; fi
  done
fi

# ---------------------------------------------------------------------------------------------
sse() { # name base_url model
  "$LOADTEST" --url "$2/v1" --api-key "$KEY" --model "$3" --stream --concurrency 1 \
    --duration "${SSE_DURATION}s" --warmup 1s --max-tokens 16 --no-progress --json "$WORK/sse.json" >/dev/null 2>"$WORK/sse.err" || true
  python3 - "$1" "$WORK/sse.json" "$WORK/sse.err" >>"$RESULTS" <<'EOF'
import json, sys
name, path, err = sys.argv[1:]
try:
    r = json.load(open(path))
    out = {"section": "sse", "target": name, "ok": r["ok"], "errors": r["error_total"],
           "ttft": r["ttft"], "itl": r["itl"], "latency": r["latency"]}
except Exception:
    out = {"section": "sse", "target": name, "failed": open(err).read()[-500:]}
print(json.dumps(out))
EOF
  rm -f "$WORK/sse.json"
}
if want sse; then
  echo "== sse: faden-loadtest --stream -c 1, ${SSE_DURATION}s per target"
  sse direct "http://$SSE_ENGINE" demo
  sse faden-direct "http://$GATEWAY" demo-direct-sse
  sse faden-worker "http://$GATEWAY" demo-worker-sse
  sse faden-tunnel "http://$GATEWAY" demo-tunnel-sse
  sse nginx "http://127.0.0.1:$NGINX_SSE_PORT" demo
  [ $HAVE_RATHOLE = 1 ] && sse rathole "http://127.0.0.1:$RATHOLE_SSE_PORT" demo
fi

# ---------------------------------------------------------------------------------------------
idle_test() { # name port path pids...
  local name=$1 port=$2 path=$3; shift 3
  local before after
  before=$(rss_kib "$@")
  rm -f "$WORK/idle.ready"
  python3 "$TOOLS/idle_conns.py" --port "$port" -n "$IDLE_CONNS" --path "$path" \
    --header "Authorization: Bearer $KEY" --hold 5 --ready-file "$WORK/idle.ready" >"$WORK/idle.json" 2>"$WORK/idle.err" &
  local tool=$!
  PIDS+=($tool)
  for _ in $(seq 1 1200); do [ -f "$WORK/idle.ready" ] && break; kill -0 $tool 2>/dev/null || break; sleep 0.1; done
  sleep 2
  after=$(rss_kib "$@")
  wait $tool || true
  python3 - "$name" "$before" "$after" "$WORK/idle.json" "$WORK/idle.err" >>"$RESULTS" <<'EOF'
import json, sys
name, before, after, path, err = sys.argv[1:]
try:
    r = json.load(open(path))
except Exception:
    r = {"error": open(err).read()[-500:]}
r.update(section="idle_conns", target=name, rss_before_kib=int(before), rss_after_kib=int(after))
n = r.get("opened") or 0
r["per_conn_bytes"] = round((int(after) - int(before)) * 1024 / n) if n else None
print(json.dumps(r))
EOF
  sleep 1
}
if want idle_conns; then
  echo "== idle connections: $IDLE_CONNS keep-alive connections (one GET each, then idle)"
  idle_test faden-gateway "$GW_PORT" /v1/models "$SERVER_PID"
  NGINX_IDLE_PORT=$(free_port)
  NGINX_IDLE_PIDS=$(start_nginx nginx-idle "$NGINX_IDLE_PORT" $((IDLE_CONNS + 1024)) "$ENGINE")
  # shellcheck disable=SC2086
  idle_test nginx "$NGINX_IDLE_PORT" /health $NGINX_IDLE_PIDS
  kill "$(cat "$WORK/nginx-idle.pid")" 2>/dev/null || true
fi
emit "{\"section\":\"limits\",\"script_nofile\":$(ulimit -n),\"server_nofile\":\"$SERVER_LIMIT\"}"

# ---------------------------------------------------------------------------------------------
if want streams; then
echo "== streams: $STREAMS concurrent SSE streams held open (tunnel), and through the direct path"
# A third engine whose streams last ~20 s (40 tokens, 500 ms apart), and two workers serving it.
"$BIN/faden-mock-engine" --port 0 --model demo --tokens 40 --itl 500ms --ttft 0s >"$WORK/streams-engine.log" 2>&1 &
STREAMS_ENGINE_PID=$!
PIDS+=($STREAMS_ENGINE_PID)
STREAMS_ENGINE=$(wait_for "$WORK/streams-engine.log" "mock engine listening" addr)
for model in demo-streams-direct demo-streams-tunnel; do
  api -X POST "http://$API/v2/models" -d "{\"name\":\"$model\"}" >/dev/null
done
start_worker w-streams-direct direct "demo-streams-direct=${STREAMS_ENGINE##*:}"
start_worker w-streams-tunnel tunnel "demo-streams-tunnel=${STREAMS_ENGINE##*:}"
STREAMS_TUNNEL_PID=$LAST_PID
for w in w-streams-direct w-streams-tunnel; do wait_for "$WORK/$w.log" "faden worker ready" worker_id >/dev/null; done
routable demo-streams-direct 20 && routable demo-streams-tunnel 20
active_streams() { curl -s "http://$GATEWAY/metrics" | awk '/^faden_gateway_active_streams / {print $2}'; }
streams_test() { # name model n server_pid [worker_pid]
  local name=$1 model=$2 n=$3 spid=$4 wpid=${5:-}
  local before wbefore=0 after=0 wafter=0 active=0 a start
  before=$(rss_kib "$spid"); [ -n "$wpid" ] && wbefore=$(rss_kib "$wpid")
  "$LOADTEST" --url "http://$GATEWAY/v1" --api-key "$KEY" --model "$model" --stream --concurrency "$n" \
    --requests "$n" --duration 90s --timeout 80s --max-tokens 40 --no-progress --json "$WORK/streams.json" \
    >/dev/null 2>"$WORK/streams.err" &
  local tool=$!
  PIDS+=($tool)
  # Sample while the streams are open: the figure is the RSS at the largest stream count seen.
  start=$(date +%s)
  while kill -0 $tool 2>/dev/null && [ $(( $(date +%s) - start )) -lt 25 ]; do
    a=$(active_streams); a=${a%.*}; a=${a:-0}
    if [ "$a" -gt 0 ] && [ "$a" -ge "$active" ]; then
      active=$a; after=$(rss_kib "$spid"); [ -n "$wpid" ] && wafter=$(rss_kib "$wpid")
    fi
    [ "$active" -ge "$n" ] && break
    sleep 0.5
  done
  sleep 1
  a=$(active_streams); a=${a%.*}; a=${a:-0}
  if [ "$a" -gt 0 ] && [ "$a" -ge "$active" ]; then
    active=$a; after=$(rss_kib "$spid"); [ -n "$wpid" ] && wafter=$(rss_kib "$wpid")
  fi
  wait $tool || true
  python3 - "$name" "$n" "$before" "$after" "$active" "$WORK/streams.json" "$WORK/streams.err" "$wbefore" "$wafter" >>"$RESULTS" <<'EOF'
import json, sys
name, n, before, after, active, path, err, wbefore, wafter = sys.argv[1:]
out = {"section": "streams", "target": name, "streams": int(n), "active_seen": int(active),
       "rss_before_kib": int(before), "rss_held_kib": int(after)}
if int(wbefore):
    out.update(worker_rss_before_kib=int(wbefore), worker_rss_held_kib=int(wafter),
               worker_per_stream_bytes=round((int(wafter) - int(wbefore)) * 1024 / int(active)) if int(active) else None)
try:
    r = json.load(open(path))
    out.update(ok=r["ok"], errors=r["error_total"], latency=r.get("latency"))
except Exception:
    out["failed"] = open(err).read()[-500:]
out["per_stream_bytes"] = round((int(after) - int(before)) * 1024 / int(active)) if int(active) else None
print(json.dumps(out))
EOF
  rm -f "$WORK/streams.json"
  sleep 2
}
# The direct path holds two sockets per stream in the server (client + engine): stay within
# its descriptor limit.
DIRECT_STREAMS=$(( STREAMS < (SERVER_LIMIT - 1000) / 2 ? STREAMS : (SERVER_LIMIT - 1000) / 2 ))
streams_test faden-tunnel demo-streams-tunnel "$STREAMS" "$SERVER_PID" "$STREAMS_TUNNEL_PID"
streams_test faden-direct demo-streams-direct "$DIRECT_STREAMS" "$SERVER_PID"
kill "$STREAMS_ENGINE_PID" 2>/dev/null || true
fi

# ---------------------------------------------------------------------------------------------
if want body; then
echo "== body: ${BODY_MB} MB POST /v1/moderations, 3 times per target"
make_body() { # model file
  python3 - "$1" "$2" "$BODY_MB" <<'EOF'
import sys
model, path, mb = sys.argv[1], sys.argv[2], int(sys.argv[3])
head = ('{"model":"%s","input":"' % model).encode()
n = mb * 1000 * 1000 - len(head) - 2
with open(path, "wb") as f:
    f.write(head)
    chunk = b"x" * (1 << 20)
    while n > 0:
        f.write(chunk[:min(n, len(chunk))]); n -= len(chunk)
    f.write(b'"}')
EOF
}
make_body demo-direct "$WORK/body-direct.json"
make_body demo-tunnel "$WORK/body-tunnel.json"
body() { # name url file
  local times=() code t
  for _ in 1 2 3; do
    read -r code t < <(curl -s -o "$WORK/body.out" -w '%{http_code} %{time_total}\n' -H "Authorization: Bearer $KEY" \
      -H 'Content-Type: application/json' --data-binary "@$3" "$2/v1/moderations")
    [ "$code" = 200 ] || { t=null; echo "   $1: HTTP $code $(head -c 120 "$WORK/body.out" | tr '\n' ' ')" >&2; }
    times+=("$t")
  done
  emit "{\"section\":\"body\",\"target\":\"$1\",\"bytes\":$(stat -c %s "$3"),\"seconds\":[$(IFS=,; echo "${times[*]}")],\"answer\":$(python3 -c 'import json,sys; print(json.dumps(open(sys.argv[1]).read()[:200]))' "$WORK/body.out")}"
}
body direct "http://$ENGINE" "$WORK/body-direct.json"
body faden-direct "http://$GATEWAY" "$WORK/body-direct.json"
body faden-tunnel "http://$GATEWAY" "$WORK/body-tunnel.json"
body nginx "http://127.0.0.1:$NGINX_PORT" "$WORK/body-direct.json"
[ $HAVE_RATHOLE = 1 ] && body rathole "http://127.0.0.1:$RATHOLE_PORT" "$WORK/body-direct.json"
HWM=$(awk '/VmHWM/ {print $2}' "/proc/$SERVER_PID/status")
emit "{\"section\":\"server_peak\",\"vmhwm_kib\":$HWM}"
rm -f "$WORK"/body-*.json
fi

# ---------------------------------------------------------------------------------------------
if want reconnect; then
echo "== reconnect: kill -9 the server, restart it, time until the tunnel worker serves again"
for round in 1 2 3; do
  kill -9 "$SERVER_PID"; wait "$SERVER_PID" 2>/dev/null || true
  t0=$(now)
  start_server
  wait_for "$WORK/server.log" "faden server ready" api >/dev/null
  t1=$(now)
  served=null
  for _ in $(seq 1 1500); do # 30 s at most
    code=$(curl -s -o /dev/null -m 1 -w '%{http_code}' "http://$GATEWAY/v1/chat/completions" \
      -H "Authorization: Bearer $KEY" -d '{"model":"demo-tunnel","messages":[],"max_tokens":1}')
    [ "$code" = 200 ] && { served=$(now); break; }
    sleep 0.02
  done
  [ "$served" = null ] && echo "   round $round: the tunnel did not serve within 30 s" >&2
  python3 -c "import json,sys; t0,t1,s=sys.argv[1:4]; print(json.dumps({'section':'reconnect','round':int(sys.argv[4]),'server_ready_s':round(float(t1)-float(t0),3),'serving_s':None if s=='null' else round(float(s)-float(t0),3)}))" \
    "$t0" "$t1" "$served" "$round" >>"$RESULTS"
  sleep 1
done
fi

LOAD_END=$(load_avg)
emit "{\"section\":\"meta\",\"date\":\"$(date -u +%FT%TZ)\",\"commit\":\"$(git rev-parse --short HEAD)\",\"load_start\":\"$LOAD_START\",\"load_end\":\"$LOAD_END\",\"duration_s\":$DURATION,\"sse_duration_s\":$SSE_DURATION,\"idle_conns\":$IDLE_CONNS,\"idle_tunnels\":$IDLE_TUNNELS,\"body_mb\":$BODY_MB,\"streams\":$STREAMS,\"cpus\":$(nproc),\"cpu_model\":\"$(awk -F': ' '/model name/ {print $2; exit}' /proc/cpuinfo)\",\"kernel\":\"$(uname -r)\",\"rathole\":\"$(rathole --version 2>/dev/null | awk '/Build Version/ {print $3}')\",\"nginx\":\"$(nginx -v 2>&1 | sed 's/.*\///')\",\"haproxy\":\"$(haproxy -v 2>/dev/null | head -1 | awk '{print $3}')\"}"
echo "== load average at end: $LOAD_END"

MERGED=${OUT:-$WORK/results.json}
python3 "$TOOLS/report.py" "$RESULTS" "$MERGED"
if [ -n "$PLOTS" ]; then
  "$BIN/faden-bench-plot" "$MERGED" "$PLOTS"
fi
