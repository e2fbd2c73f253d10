#!/usr/bin/env bash
# The cost of exporting spans on the gateway's direct path: two `faden server`s, each with one
# `direct` worker in front of the same mock engine (8-token answers), one without exporting and
# one with `--otlp-endpoint` to an OTLP sink on loopback (a Python HTTP server that answers 200
# to every POST and counts the bytes). wrk POSTs chat completions (keep-alive, with a client
# `traceparent` on every request when TRACEPARENT=1) against each in turn, round after round;
# per round: requests/s and the server process's CPU (user + system, /proc/PID/stat) per
# request; then the medians and the median of the per-round ratios (on / off).
#
# Usage: benches/otel_overhead.sh [SECONDS] [ROUNDS] [CONNS]   (default: 5 s, 3 rounds, c=16)
#   FADEN=path   binary (default target/release/faden; build it first)
#   BASE=path    also a third server of another build (say, the commit before), without
#                exporting: the cost of what is always on (trace context, the GenAI histograms)
# Loopback only; everything started is killed on exit. The server's default sampler
# (parentbased_always_on) exports every request's span.
set -u
cd "$(dirname "$0")/.."
DUR=${1:-5}; ROUNDS=${2:-3}; CONNS=${3:-16}
FADEN=${FADEN:-${CARGO_TARGET_DIR:-target}/release/faden}
source benches/tools/lib.sh
start_work otel
export FADEN_LOG=warn,faden=info FADEN_WORKER_THREADS=1 FADEN_MAX_PENDING_PER_SOURCE=0
unset OTEL_EXPORTER_OTLP_ENDPOINT OTEL_EXPORTER_OTLP_TRACES_ENDPOINT

"$FADEN" mock-engine --port 0 --model demo --tokens 8 > "$WORK/engine.log" 2>&1 & PIDS+=($!)
ENGINE=$(wait_for "$WORK/engine.log" "mock engine listening" addr)

SINK_PORT=$(free_port)
cat > "$WORK/sink.py" <<'PY'
import http.server, sys
class Sink(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    requests = 0
    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        Sink.requests += 1
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Sink).serve_forever()
PY
python3 "$WORK/sink.py" "$SINK_PORT" & PIDS+=($!)

# start_server NAME BINARY [EXTRA ARGS...]: sets SERVER_<NAME> (pid), GW_<NAME>, KEY_<NAME>.
start_server() {
  local name=$1 FADEN=$2; shift 2
  local dir="$WORK/$name"
  "$FADEN" server --data-dir "$dir" --host 127.0.0.1 --api-port 0 --port 0 --proxy-port 0 "$@" > "$dir.log" 2>&1 & PIDS+=($!)
  local pid=$!
  local api gw admin reg key
  api=$(wait_for "$dir.log" "faden server ready" api); gw=$(wait_for "$dir.log" "faden server ready" gateway)
  admin=$(cat "$dir/admin.key")
  reg=$(curl -sf -H "Authorization: Bearer $admin" -X POST "http://$api/v2/clusters" -d '{"name":"b"}' | python3 -c 'import json,sys; print(json.load(sys.stdin)["registration_token"])')
  curl -sf -H "Authorization: Bearer $admin" -X POST "http://$api/v2/models" -d '{"name":"demo-direct"}' > /dev/null
  key=$(curl -sf -H "Authorization: Bearer $admin" -X POST "http://$api/v2/api-keys" -d '{"name":"b"}' | python3 -c 'import json,sys; print(json.load(sys.stdin)["value"])')
  "$FADEN" worker --server-url "http://$api" --token "$reg" --name "w$name" --proxy-mode direct --worker-ip 127.0.0.1 --worker-port 0 --disable-worker-metrics --instance "demo-direct=${ENGINE##*:}" --data-dir "$dir-worker" --probe-interval 200ms > "$dir-worker.log" 2>&1 & PIDS+=($!)
  wait_for "$dir-worker.log" "faden worker ready" worker_id > /dev/null
  local code
  for _ in $(seq 1 200); do
    code=$(curl -s -o /dev/null -w '%{http_code}' "http://$gw/v1/chat/completions" -H "Authorization: Bearer $key" -d '{"model":"demo-direct","messages":[]}')
    [ "$code" = 200 ] && break; sleep 0.05
  done
  [ "$code" = 200 ] || { echo "server $name: model never became routable" >&2; exit 1; }
  printf -v "SERVER_$name" %s "$pid"; printf -v "GW_$name" %s "$gw"; printf -v "KEY_$name" %s "$key"
}
[ -n "${BASE:-}" ] && start_server base "$BASE"
start_server off "$FADEN"
start_server on "$FADEN" --otlp-endpoint "http://127.0.0.1:$SINK_PORT"

cat > "$WORK/post.lua" <<'EOF'
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer " .. os.getenv("BENCH_KEY")
if os.getenv("TRACEPARENT") == "1" then
  wrk.headers["traceparent"] = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
end
wrk.body = '{"model": "demo-direct", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}'
EOF
HZ=$(getconf CLK_TCK)
# run NAME: one wrk run against server NAME; prints "rps cpu_us_per_request".
run() {
  local pid gw key u0 s0 u1 s1 st out reqs rps
  pid=$(eval echo "\$SERVER_$1"); gw=$(eval echo "\$GW_$1"); key=$(eval echo "\$KEY_$1")
  read -r -a st < /proc/"$pid"/stat; u0=${st[13]}; s0=${st[14]}
  out=$(BENCH_KEY=$key wrk -t1 -c"$CONNS" -d"${DUR}s" -s "$WORK/post.lua" "http://$gw/v1/chat/completions")
  read -r -a st < /proc/"$pid"/stat; u1=${st[13]}; s1=${st[14]}
  reqs=$(awk '/requests in/ {print $1}' <<<"$out"); rps=$(awk '/Requests\/sec/ {print $2}' <<<"$out")
  python3 -c "print(f'{$rps:.0f} {($u1-$u0+$s1-$s0)/$HZ/$reqs*1e6:.2f}')"
}
echo "round  [base: req/s  CPU µs/req  |]  off: req/s  CPU µs/req  |  on: req/s  CPU µs/req"
RES=()
for r in $(seq 1 "$ROUNDS"); do
  rps_base=0; cpu_base=0
  [ -n "${BASE:-}" ] && read -r rps_base cpu_base <<<"$(run base)"
  read -r rps_off cpu_off <<<"$(run off)"
  read -r rps_on cpu_on <<<"$(run on)"
  echo "$r      ${BASE:+$rps_base  $cpu_base  |  }$rps_off  $cpu_off  |  $rps_on  $cpu_on"
  RES+=("$cpu_off $cpu_on $rps_off $rps_on $cpu_base")
done
printf '%s\n' "${RES[@]}" | python3 -c '
import statistics, sys
rows = [list(map(float, l.split())) for l in sys.stdin if l.strip()]
off = statistics.median(r[0] for r in rows); on = statistics.median(r[1] for r in rows)
ratio = statistics.median(r[1] / r[0] for r in rows)
print(f"median CPU per request: off {off:.2f} µs, on {on:.2f} µs, on/off {ratio:.3f}")
print(f"median req/s: off {statistics.median(r[2] for r in rows):.0f}, on {statistics.median(r[3] for r in rows):.0f}")
if rows[0][4] > 0:
    base = statistics.median(r[4] for r in rows)
    print(f"base {base:.2f} µs; off/base {statistics.median(r[0] / r[4] for r in rows):.3f}, on/base {statistics.median(r[1] / r[4] for r in rows):.3f}")'
grep -h "spans" "$WORK"/on.log | tail -2
curl -s "http://$GW_on/metrics" | grep -E "^faden_otel_spans_(exported|dropped)_total"
