#!/usr/bin/env bash
# Side-by-side proxy benchmark on loopback, bounded in time.
#
# Targets, all in front of the same mock engine (non-streamed chat completion, ~330-byte answer):
#   direct        the mock engine itself
#   faden-direct  faden gateway, `direct` path (gateway -> engine)
#   faden-worker  faden gateway, `worker` path (gateway -> worker reverse proxy -> engine)
#   nginx         nginx proxy_pass with upstream keepalive
#   haproxy       HAProxy with connection reuse
# at concurrency 1 and 64 with wrk. For every proxy it reads the CPU time (user + system, from
# /proc) its processes spent during the run and divides it by the requests served: the steadiest
# figure on a shared machine. RSS is read after the run.
#
# Usage: benches/compare.sh [-d SECONDS] [-o results.json]
# Needs: wrk, nginx, haproxy (apt-get install -y wrk nginx-light haproxy), python3.
set -euo pipefail
cd "$(dirname "$0")/.."

DURATION=10
OUT=""
while getopts "d:o:" opt; do
  case $opt in
    d) DURATION=$OPTARG ;;
    o) OUT=$OPTARG ;;
    *) echo "usage: $0 [-d seconds] [-o results.json]" >&2; exit 2 ;;
  esac
done
for tool in wrk nginx haproxy python3; do
  command -v "$tool" >/dev/null || { echo "missing $tool (apt-get install -y wrk nginx-light haproxy)" >&2; exit 2; }
done

WORK=$(mktemp -d /tmp/faden-bench.XXXXXX)
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  [ -f "$WORK/nginx.pid" ] && kill "$(cat "$WORK/nginx.pid")" 2>/dev/null || true
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
# Waits for "marker" in a log file and prints the value of key= on that line.
wait_for() {
  local log=$1 marker=$2 key=$3
  for _ in $(seq 1 300); do
    if line=$(grep -m1 "$marker" "$log" 2>/dev/null); then
      sed -n "s/.*$key=\([^ ]*\).*/\1/p" <<<"$line"; return 0
    fi
    sleep 0.1
  done
  echo "timed out waiting for '$marker' in $log" >&2; cat "$log" >&2; exit 1
}
# CPU ticks (user+system) of the given PIDs and their threads.
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

echo "== building (release)"
cargo build --release --locked -p faden 2>&1 | tail -1
FADEN=target/release/faden
export FADEN_LOG=warn,faden=info

echo "== starting the mock engine, faden and two workers"
"$FADEN" mock-engine --port 0 --model demo --tokens 8 >"$WORK/engine.log" 2>&1 &
PIDS+=($!)
ENGINE=$(wait_for "$WORK/engine.log" "mock engine listening" addr)
ENGINE_PORT=${ENGINE##*:}

export FADEN_WORKER_CREDENTIAL=bench-credential-0123456789
"$FADEN" server --data-dir "$WORK/server" --host 127.0.0.1 --api-port 0 --port 0 --proxy-port 0 >"$WORK/server.log" 2>&1 &
SERVER_PID=$!
PIDS+=($SERVER_PID)
API=$(wait_for "$WORK/server.log" "faden server ready" api)
GATEWAY=$(wait_for "$WORK/server.log" "faden server ready" gateway)
ADMIN=$(cat "$WORK/server/admin.key")
api() { curl -sf -H "Authorization: Bearer $ADMIN" "$@"; }
REG=$(api -X POST "http://$API/v2/clusters" -d '{"name":"bench"}' | python3 -c 'import json,sys; print(json.load(sys.stdin)["registration_token"])')
api -X POST "http://$API/v2/models" -d '{"name":"demo-direct"}' >/dev/null
api -X POST "http://$API/v2/models" -d '{"name":"demo-worker"}' >/dev/null
KEY=$(api -X POST "http://$API/v2/api-keys" -d '{"name":"bench"}' | python3 -c 'import json,sys; print(json.load(sys.stdin)["value"])')

start_worker() { # name mode model
  "$FADEN" worker --server-url "http://$API" --token "$REG" --name "$1" --proxy-mode "$2" \
    --worker-ip 127.0.0.1 --worker-port 0 --disable-worker-metrics --instance "$3=$ENGINE_PORT" \
    --data-dir "$WORK/$1" --probe-interval 200ms >"$WORK/$1.log" 2>&1 &
  PIDS+=($!)
  echo $!
}
start_worker w-direct direct demo-direct >/dev/null
WORKER_PID=$(start_worker w-worker worker demo-worker)
wait_for "$WORK/w-direct.log" "faden worker ready" worker_id >/dev/null
wait_for "$WORK/w-worker.log" "faden worker ready" worker_id >/dev/null
for model in demo-direct demo-worker; do
  for _ in $(seq 1 100); do
    code=$(curl -s -o /dev/null -w '%{http_code}' "http://$GATEWAY/v1/chat/completions" \
      -H "Authorization: Bearer $KEY" -d "{\"model\":\"$model\",\"messages\":[]}")
    [ "$code" = 200 ] && break
    sleep 0.1
  done
  [ "$code" = 200 ] || { echo "$model not routable ($code)" >&2; exit 1; }
done

echo "== starting nginx and haproxy"
NGINX_PORT=$(free_port)
cat >"$WORK/nginx.conf" <<EOF
worker_processes 1;
pid $WORK/nginx.pid;
error_log $WORK/nginx-error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  upstream engine { server $ENGINE; keepalive 128; }
  server {
    listen 127.0.0.1:$NGINX_PORT;
    location / {
      proxy_pass http://engine;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
    }
  }
}
EOF
nginx -c "$WORK/nginx.conf" -p "$WORK"
sleep 0.3
NGINX_PIDS=$(pgrep -f "nginx.*$WORK/nginx.conf" | tr '\n' ' ')
NGINX_PIDS="$NGINX_PIDS $(pgrep -P "$(cat "$WORK/nginx.pid")" | tr '\n' ' ')"

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
sleep 0.3

cat >"$WORK/post.lua" <<'EOF'
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer " .. os.getenv("BENCH_KEY")
wrk.body = '{"model": "' .. os.getenv("BENCH_MODEL") .. '", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}'
EOF
export BENCH_KEY=$KEY

RESULTS="$WORK/results.jsonl"
: >"$RESULTS"
TICK=$(getconf CLK_TCK)
run() { # name url model conns pids...
  local name=$1 url=$2 model=$3 conns=$4; shift 4
  local threads=1; [ "$conns" -gt 1 ] && threads=2
  BENCH_MODEL=$model wrk -t1 -c"$conns" -d2s -s "$WORK/post.lua" "$url/v1/chat/completions" >/dev/null 2>&1 || true # warm-up
  local before=0; [ $# -gt 0 ] && before=$(cpu_ticks "$@")
  BENCH_MODEL=$model wrk -t"$threads" -c"$conns" -d"${DURATION}s" --latency -s "$WORK/post.lua" \
    "$url/v1/chat/completions" >"$WORK/wrk.out" 2>&1
  local after=0; [ $# -gt 0 ] && after=$(cpu_ticks "$@")
  local rss=0; [ $# -gt 0 ] && rss=$(rss_kib "$@")
  python3 - "$name" "$conns" "$((after - before))" "$TICK" "$rss" "$WORK/wrk.out" >>"$RESULTS" <<'EOF'
import json, re, sys
name, conns, ticks, tck, rss, path = sys.argv[1:]
text = open(path).read()
def dur(v, unit):
    return float(v) * {"us": 1, "ms": 1e3, "s": 1e6}[unit]
req = int(re.search(r"(\d+) requests in", text).group(1))
rps = float(re.search(r"Requests/sec:\s+([\d.]+)", text).group(1))
lat = {p: dur(v, u) for p, v, u in re.findall(r"^\s+(50|99)%\s+([\d.]+)(us|ms|s)\s*$", text, re.M)}
errors = sum(int(x) for x in re.findall(r"Non-2xx or 3xx responses: (\d+)", text))
cpu_us = int(ticks) * 1e6 / int(tck) / req if int(ticks) and req else None
print(json.dumps({"target": name, "connections": int(conns), "requests": req, "rps": rps,
                  "p50_us": lat.get("50"), "p99_us": lat.get("99"), "errors": errors,
                  "cpu_us_per_req": cpu_us, "rss_mib": int(rss) / 1024 if int(rss) else None}))
EOF
}

echo "== running (${DURATION}s per target and concurrency)"
for conns in 1 64; do
  run direct "http://$ENGINE" demo-direct "$conns"
  run faden-direct "http://$GATEWAY" demo-direct "$conns" "$SERVER_PID"
  run faden-worker "http://$GATEWAY" demo-worker "$conns" "$SERVER_PID" "$WORKER_PID"
  # shellcheck disable=SC2086
  run nginx "http://127.0.0.1:$NGINX_PORT" demo-direct "$conns" $NGINX_PIDS
  run haproxy "http://127.0.0.1:$HAPROXY_PORT" demo-direct "$conns" "$HAPROXY_PID"
done

python3 - "$RESULTS" "$OUT" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
base = {r["connections"]: r for r in rows if r["target"] == "direct"}
fmt = lambda v, f="{:.0f}": "-" if v is None else f.format(v)
print(f"\n{'target':<14}{'conns':>6}{'req/s':>10}{'ratio':>7}{'p50 us':>9}{'p99 us':>9}{'+p99 us':>9}{'cpu us/req':>12}{'rss MiB':>9}{'errors':>8}")
for r in rows:
    b = base[r["connections"]]
    r["rps_ratio"] = r["rps"] / b["rps"] if b["rps"] else None
    r["added_p99_us"] = r["p99_us"] - b["p99_us"] if r["p99_us"] is not None and b["p99_us"] is not None else None
    print(f"{r['target']:<14}{r['connections']:>6}{r['rps']:>10.0f}{fmt(r['rps_ratio'], '{:.2f}'):>7}{fmt(r['p50_us']):>9}{fmt(r['p99_us']):>9}"
          f"{fmt(r['added_p99_us']):>9}{fmt(r['cpu_us_per_req'], '{:.1f}'):>12}{fmt(r['rss_mib'], '{:.1f}'):>9}{r['errors']:>8}")
if sys.argv[2]:
    json.dump(rows, open(sys.argv[2], "w"), indent=1)
    print(f"\nwritten: {sys.argv[2]}")
EOF
