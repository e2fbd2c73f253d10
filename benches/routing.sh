#!/usr/bin/env bash
# Routing benchmark: the same seeded multi-tenant workload through several routers in front of
# the same mock engines, one router at a time, on 127.0.0.1. The method is in docs/benchmarks.md
# ("Routing by prefix cache").
#
# The workload (faden-loadtest --scenario, `prefix`): TENANTS tenants, each with its own system
# prompt of SYSTEM_TOKENS_MIN..MAX tokens, picked by Zipf(ZIPF_S) popularity; CONVERSATIONS open
# conversations per tenant of TURNS turns that grow turn by turn; streamed chat completions;
# open-loop Poisson arrivals; all drawn from SEED, so request i is the same in every run.
# SESSION_HINT=1 sends each conversation's id in the OpenAI `user` field.
#
# The engines: ENGINES faden-mock-engine processes with the prefix-cache performance model
# (--kv-blocks KV_BLOCKS of BLOCK_TOKENS tokens, LRU; prefill time PREFILL_PER_TOKEN per
# uncached token, one prefill at a time; at most MAX_RUNNING requests running; decode ITL +
# ITL_PER_RUNNING per running request). KV_BLOCKS is sized so that one engine holds about a
# quarter of the tenants' prompts: routing decides the hit rate.
#
# Rows (ROWS, in that order):
#   client-rr        the client alone, round-robin over the engines (no router)
#   client-affinity  the client alone, tenant -> engine by a fixed hash (the hit-rate bound)
#   faden            `faden server` with its default routing (FADEN_ROUTE_POLICY unset, or
#                    FADEN_POLICY when set); its instances come from one `direct` worker
#   faden-p2c        `faden server` with FADEN_ROUTE_POLICY=$FADEN_P2C_POLICY (least-loaded: P2C)
#   faden-2gw        the `faden` row with a second gateway (`faden gateway` following the server):
#                    the client sends round-robin to both, each keeps its own prefix index
#   sglang[-POLICY]  sglang-router $SGLANG_ROUTER_VERSION, --policy POLICY (default cache_aware)
#   vllm[-POLICY]    vllm-router $VLLM_ROUTER_VERSION, --policy POLICY (default cache_aware;
#                    its consistent_hash and sticky_least_loaded hash a session key this
#                    workload does not send, and put every request on one engine)
# The routers are installed from PyPI into venvs under ROUTER_VENVS on first use.
#
# Each (row, rate) run starts fresh engines (empty caches) and a fresh router, offers the rate
# for WARMUP + DURATION seconds and measures the DURATION part: the client's hit rate (sum of
# usage.prompt_tokens_details.cached_tokens / sum of prompt tokens), the engines' own
# (vllm:prefix_cache_hits_total / queries_total over the same window), TTFT p50/p90/p99,
# throughput, errors, and the router's CPU per request (user + system run time of the router's
# processes and their children over the window, from /proc, / successful requests). Every row
# runs at each rate of RATES (ascending; with SWEEP_STOP=1 the rates above the first one whose
# p90 TTFT misses SLO_MS are skipped, unless they are RATE); the table is at RATE, and "req/s at
# SLO" is the highest rate whose p90 TTFT stayed under SLO_MS without errors.
#
# Output in OUT_DIR: results.jsonl (a line per run), results.json, table.txt, table.csv,
# routing.svg and routing.png (benches/plot).
#
# Usage: benches/routing.sh            (about 10 minutes)
#        QUICK=1 benches/routing.sh    (about a minute: one rate, short runs)
# Every parameter above is an environment variable; BIN_DIR=dir runs the binaries found there
# (faden, faden-loadtest, faden-mock-engine, faden-bench-plot) instead of building them
# (PROFILE=release by default). PLAIN_ENGINES=1 runs the mock engine without its cache model
# (when it has none: hit rates are then 0 and only the harness is checked).
# Needs: python3, curl; network access the first time a router's venv is made.
set -euo pipefail
cd "$(dirname "$0")/.."
source benches/tools/lib.sh

if [ "${QUICK:-0}" = 1 ]; then
  : "${TENANTS:=32}" "${RATE:=30}" "${DURATION:=5}" "${WARMUP:=2}"
  : "${RATES:=$RATE}"
fi
ENGINES=${ENGINES:-4}
TENANTS=${TENANTS:-64}
SYSTEM_TOKENS_MIN=${SYSTEM_TOKENS_MIN:-1000}
SYSTEM_TOKENS_MAX=${SYSTEM_TOKENS_MAX:-6000}
ZIPF_S=${ZIPF_S:-1.0}
TURNS=${TURNS:-4}
CONVERSATIONS=${CONVERSATIONS:-4}
TURN_BYTES=${TURN_BYTES:-512}
ANSWER_BYTES=${ANSWER_BYTES:-256}
MAX_TOKENS=${MAX_TOKENS:-32}
SESSION_HINT=${SESSION_HINT:-0}
SEED=${SEED:-1}
RATE=${RATE:-30}
RATES=${RATES:-15 30 45 60}
SLO_MS=${SLO_MS:-150}
DURATION=${DURATION:-15}
WARMUP=${WARMUP:-5}
SWEEP_STOP=${SWEEP_STOP:-1}
KV_BLOCKS=${KV_BLOCKS:-4096}
BLOCK_TOKENS=${BLOCK_TOKENS:-16}
MAX_RUNNING=${MAX_RUNNING:-32}
PREFILL_PER_TOKEN=${PREFILL_PER_TOKEN:-40us}
ITL=${ITL:-5ms}
ITL_PER_RUNNING=${ITL_PER_RUNNING:-100us}
PLAIN_ENGINES=${PLAIN_ENGINES:-0}
PLAIN_TTFT=${PLAIN_TTFT:-20ms}
ROWS=${ROWS:-client-rr client-affinity faden faden-p2c sglang vllm}
FADEN_POLICY=${FADEN_POLICY:-}
FADEN_P2C_POLICY=${FADEN_P2C_POLICY:-least-loaded}
SGLANG_ROUTER_VERSION=${SGLANG_ROUTER_VERSION:-0.3.2}
VLLM_ROUTER_VERSION=${VLLM_ROUTER_VERSION:-0.1.17}
ROUTER_VENVS=${ROUTER_VENVS:-$HOME/.cache/faden-bench}
OUT_DIR=${OUT_DIR:-target/bench-routing}
PROFILE=${PROFILE:-release}
MODEL=demo
RUN_LIMIT=$((WARMUP + DURATION + 60)) # seconds: bound on one loadtest process
# The rates in ascending order, RATE among them.
RATES=$(printf '%s\n' $RATES "$RATE" | sort -g -u | tr '\n' ' ')

require_tools python3 curl
for row in $ROWS; do
  case $row in
    client-rr|client-affinity|faden|faden-p2c|faden-2gw|sglang|sglang-*|vllm|vllm-*) ;;
    *) echo "unknown row $row (rows: client-rr client-affinity faden faden-p2c faden-2gw sglang[-POLICY] vllm[-POLICY])" >&2; exit 2 ;;
  esac
done
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)"

WORK=$(mktemp -d /tmp/faden-routing.XXXXXX)
RUN_PIDS=()
# Stops the processes of the current run (and their children), then waits for them.
stop_run() {
  local all=() p
  [ ${#RUN_PIDS[@]} -gt 0 ] || return 0
  for p in "${RUN_PIDS[@]}"; do all+=($(python3 -c 'import sys; sys.path.insert(0, "benches/tools"); import routing; print(*routing.descendants(sys.argv[1:]))' "$p" 2>/dev/null || echo "$p")); done
  for p in "${all[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${RUN_PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  RUN_PIDS=()
}
LOADGEN="" # the load generator while it runs
trap '[ -n "$LOADGEN" ] && kill "$LOADGEN" 2>/dev/null; stop_run; rm -rf "$WORK"' EXIT
# A signal sent to the script alone (not to its process group) ends it too, after the command
# in the foreground (a few seconds at most); the EXIT trap then stops what it started.
trap 'exit 130' INT
trap 'exit 143' TERM

if [ -n "${BIN_DIR:-}" ]; then
  BIN=$BIN_DIR
  echo "== binaries from $BIN (not building)"
else
  echo "== building ($PROFILE)"
  cargo build --profile "$PROFILE" --locked -p faden -p faden-loadtest -p mock-engine -p faden-bench-plot 2>&1 | tail -1
  BIN=${CARGO_TARGET_DIR:-target}/$([ "$PROFILE" = dev ] && echo debug || echo "$PROFILE")
fi
FADEN=$BIN/faden LOADTEST=$BIN/faden-loadtest MOCK=$BIN/faden-mock-engine PLOT=$BIN/faden-bench-plot
require_tools "$FADEN" "$LOADTEST" "$MOCK"

# The engines' cache model is what makes routing matter: refuse to run without it unless asked.
ENGINE_FLAGS=(--kv-blocks "$KV_BLOCKS" --block-tokens "$BLOCK_TOKENS" --max-running "$MAX_RUNNING"
  --prefill-per-token "$PREFILL_PER_TOKEN" --itl "$ITL" --itl-per-running "$ITL_PER_RUNNING")
if [ "$PLAIN_ENGINES" = 1 ]; then
  ENGINE_FLAGS=(--ttft "$PLAIN_TTFT" --itl "$ITL")
  echo "note: PLAIN_ENGINES=1: mock engines without a cache model (fixed TTFT $PLAIN_TTFT): hit rates are 0, only the harness is checked" >&2
else
  help=$("$MOCK" --help)
  for flag in --kv-blocks --block-tokens --max-running --prefill-per-token --itl-per-running; do
    grep -q -- "$flag" <<<"$help" || {
      echo "$MOCK has no $flag: this benchmark needs the mock engine's prefix-cache model (--kv-blocks ...)." >&2
      echo "Build faden-mock-engine from a tree that has it, or run PLAIN_ENGINES=1 to check the harness only." >&2
      exit 2
    }
  done
fi
HAVE_POLICY_FLAG=0
"$FADEN" server --help | grep -q -- --route-policy && HAVE_POLICY_FLAG=1
if [ $HAVE_POLICY_FLAG = 0 ] && [[ " $ROWS " == *" faden-p2c "* ]]; then
  echo "note: this faden has no --route-policy: the faden and faden-p2c rows run the same routing" >&2
fi

# A router's venv, made on first use: venv NAME PACKAGE==VERSION (prints the venv's path).
venv() {
  local dir=$ROUTER_VENVS/$1
  if [ ! -x "$dir/bin/python" ] || ! "$dir/bin/pip" show -q "${2%%==*}" >/dev/null 2>&1; then
    echo "== installing $2 into $dir" >&2
    mkdir -p "$ROUTER_VENVS"
    python3 -m venv "$dir" >&2
    "$dir/bin/pip" install -q "$2" >&2 || { echo "cannot install $2 (ROWS without it skip it)" >&2; exit 2; }
  fi
  echo "$dir"
}
for row in $ROWS; do
  case $row in
    sglang*) SGLANG_VENV=$(venv "sglang-router-$SGLANG_ROUTER_VERSION" "sglang-router==$SGLANG_ROUTER_VERSION") ;;
    vllm*) VLLM_VENV=$(venv "vllm-router-$VLLM_ROUTER_VERSION" "vllm-router==$VLLM_ROUTER_VERSION") ;;
  esac
done

cat >"$WORK/scenario.yaml" <<EOF
prefix:
  tenants: $TENANTS
  system_tokens_min: $SYSTEM_TOKENS_MIN
  system_tokens_max: $SYSTEM_TOKENS_MAX
  zipf_s: $ZIPF_S
  turns: $TURNS
  conversations_per_tenant: $CONVERSATIONS
  turn_bytes: $TURN_BYTES
  answer_bytes: $ANSWER_BYTES
  max_tokens: $MAX_TOKENS
  stream: true
  session_hint: $([ "$SESSION_HINT" = 1 ] && echo true || echo false)
EOF

# Starts ENGINES mock engines; sets ENGINE_ADDRS.
start_engines() {
  local i
  ENGINE_ADDRS=()
  for i in $(seq 1 "$ENGINES"); do
    "$MOCK" --port 0 --model "$MODEL" --seed "$i" "${ENGINE_FLAGS[@]}" >"$RUN/engine-$i.log" 2>&1 &
    RUN_PIDS+=($!)
  done
  for i in $(seq 1 "$ENGINES"); do
    ENGINE_ADDRS+=("$(wait_for "$RUN/engine-$i.log" "mock engine listening" addr)")
  done
}

# Waits (up to 60 s) until a small chat completion through URL (base, with /v1) answers 200:
# routable <url> [key]
routable() {
  local code=000 auth=() end=$((SECONDS + 60))
  [ -n "${2:-}" ] && auth=(-H "Authorization: Bearer $2")
  while [ $SECONDS -lt $end ]; do
    code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 5 "$1/chat/completions" "${auth[@]}" \
      -H 'Content-Type: application/json' -d "{\"model\":\"$MODEL\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":1}")
    [ "$code" = 200 ] && return 0
    sleep 0.1
  done
  echo "$1 never answered 200 (last: $code)" >&2
  return 1
}

# faden server and one direct worker serving every engine as an instance of $MODEL; sets
# URL, KEY and ROUTER_PIDS. $1: the route policy (empty: the default).
start_faden() {
  local policy=$1 env=(env -u FADEN_ROUTE_POLICY) inst=() a api gw admin reg
  [ -n "$policy" ] && env=(env FADEN_ROUTE_POLICY="$policy")
  FADEN_LOG=warn,faden=info FADEN_MAX_PENDING_PER_SOURCE=0 FADEN_MAX_PENDING_CONNECTIONS=20000 \
    "${env[@]}" "$FADEN" server --data-dir "$RUN/server" --host 127.0.0.1 --api-port 0 --port 0 --proxy-port 0 \
    >"$RUN/server.log" 2>&1 &
  local server=$!
  RUN_PIDS+=($server)
  api=$(wait_for "$RUN/server.log" "faden server ready" api)
  gw=$(wait_for "$RUN/server.log" "faden server ready" gateway)
  admin=$(cat "$RUN/server/admin.key")
  FADEN_API=$api FADEN_ADMIN=$admin
  reg=$(curl -sf -H "Authorization: Bearer $admin" -X POST "http://$api/v2/clusters" -d '{"name":"routing"}' |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["registration_token"])')
  curl -sf -H "Authorization: Bearer $admin" -X POST "http://$api/v2/models" -d "{\"name\":\"$MODEL\"}" >/dev/null
  KEY=$(curl -sf -H "Authorization: Bearer $admin" -X POST "http://$api/v2/api-keys" -d '{"name":"routing"}' |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["value"])')
  for a in "${ENGINE_ADDRS[@]}"; do inst+=(--instance "$MODEL=${a##*:}"); done
  FADEN_LOG=warn,faden=info "$FADEN" worker --server-url "http://$api" --token "$reg" --name routing \
    --proxy-mode direct --worker-ip 127.0.0.1 --worker-port 0 --disable-worker-metrics "${inst[@]}" \
    --data-dir "$RUN/worker" --probe-interval 200ms >"$RUN/worker.log" 2>&1 &
  local worker=$!
  RUN_PIDS+=($worker)
  wait_for "$RUN/worker.log" "faden worker ready" worker_id >/dev/null
  URL="http://$gw/v1"
  # The router is the server (its gateway); the direct worker is off the request path.
  ROUTER_PIDS=$server
  # Routable once one instance is; wait until every instance is in the gateway's snapshot.
  routable "$URL" "$KEY"
  for _ in $(seq 1 100); do
    [ "$(curl -sf -H "Authorization: Bearer $admin" "http://$api/v2/model-instances?page=-1" |
      python3 -c 'import json,sys; print(sum(1 for i in json.load(sys.stdin)["items"] if i.get("state") == "running"))')" -ge "$ENGINES" ] && break
    sleep 0.1
  done
}

# A second gateway beside start_faden's server: `faden gateway` following the server's routing,
# sharing nothing else with it; URL becomes both gateways (the client alternates) and
# ROUTER_PIDS both processes. $1: the route policy (empty: the default).
start_second_gateway() {
  local policy=$1 env=(env -u FADEN_ROUTE_POLICY) gw
  [ -n "$policy" ] && env=(env FADEN_ROUTE_POLICY="$policy")
  FADEN_LOG=warn,faden=info FADEN_MAX_PENDING_PER_SOURCE=0 FADEN_MAX_PENDING_CONNECTIONS=20000 \
    "${env[@]}" "$FADEN" gateway --server-url "http://$FADEN_API" --token "$FADEN_ADMIN" --host 127.0.0.1 --port 0 \
    >"$RUN/gateway.log" 2>&1 &
  RUN_PIDS+=($!)
  ROUTER_PIDS="$ROUTER_PIDS $!"
  gw=$(wait_for "$RUN/gateway.log" "faden gateway ready" gateway)
  routable "http://$gw/v1" "$KEY"
  URL="$URL,http://$gw/v1"
}

# A Python router: start_pyrouter <sglang|vllm> <policy>; sets URL and ROUTER_PIDS.
start_pyrouter() {
  local kind=$1 policy=$2 port metrics urls=() a cmd
  port=$(free_port); metrics=$(free_port)
  for a in "${ENGINE_ADDRS[@]}"; do urls+=("http://$a"); done
  case $kind in
    sglang) cmd=("$SGLANG_VENV/bin/python" -m sglang_router.launch_router --log-level warn) ;;
    vllm) cmd=("$VLLM_VENV/bin/vllm-router" --log-level warning) ;;
  esac
  "${cmd[@]}" --host 127.0.0.1 --port "$port" --worker-urls "${urls[@]}" --policy "$policy" \
    --prometheus-host 127.0.0.1 --prometheus-port "$metrics" >"$RUN/router.log" 2>&1 &
  RUN_PIDS+=($!)
  ROUTER_PIDS=$!
  URL="http://127.0.0.1:$port/v1"
  routable "$URL" || { tail -20 "$RUN/router.log" >&2; URL=""; return 1; }
}

# One run: run_one ROW RATE; appends a line to results.jsonl and prints a summary.
run_one() {
  local row=$1 rate=$2 route=round-robin key="" cpu0="" cpu1="" m0 m1 lt a
  RUN=$WORK/$row-$rate
  mkdir -p "$RUN"
  ROUTER_PIDS=""
  start_engines
  case $row in
    client-rr|client-affinity)
      URL=$(printf 'http://%s/v1,' "${ENGINE_ADDRS[@]}"); URL=${URL%,}
      [ "$row" = client-affinity ] && route=affinity
      for a in "${ENGINE_ADDRS[@]}"; do routable "http://$a/v1"; done ;;
    faden) start_faden "$FADEN_POLICY"; key=$KEY ;;
    faden-p2c) start_faden "$FADEN_P2C_POLICY"; key=$KEY ;;
    faden-2gw) start_faden "$FADEN_POLICY"; start_second_gateway "$FADEN_POLICY"; key=$KEY ;;
    sglang) start_pyrouter sglang cache_aware || URL="" ;;
    sglang-*) start_pyrouter sglang "${row#sglang-}" || URL="" ;;
    vllm) start_pyrouter vllm cache_aware || URL="" ;;
    vllm-*) start_pyrouter vllm "${row#vllm-}" || URL="" ;;
  esac
  if [ -z "$URL" ]; then # a router that did not start: a failed row, and on to the next
    stop_run
    LINE=$(python3 -c 'import json, sys; print(json.dumps({"row": sys.argv[1], "rate": float(sys.argv[2]), "failed": "the router did not start"}))' "$row" "$rate")
    echo "$LINE" >>"$OUT_DIR/results.jsonl"
    echo "  $row $rate req/s: the router did not start"
    return 0
  fi
  local auth=()
  [ -n "$key" ] && auth=(--api-key "$key")
  local warm=()
  [ "$WARMUP" != 0 ] && warm=(--warmup "${WARMUP}s")
  # The readiness probes above were counted by the engines: the window below starts later.
  timeout "$RUN_LIMIT" "$LOADTEST" --url "$URL" --route "$route" "${auth[@]}" --model "$MODEL" \
    --scenario "$WORK/scenario.yaml" --seed "$SEED" --rate "$rate" --arrivals poisson \
    --max-outstanding 4096 "${warm[@]}" --duration "${DURATION}s" --timeout 30s --no-progress \
    --json "$RUN/lt.json" >"$RUN/lt.txt" 2>&1 &
  lt=$!
  LOADGEN=$lt
  # The measured phase starts WARMUP seconds after the load generator (its start-up takes
  # milliseconds): the counters are read then and at its end.
  sleep "$WARMUP"
  [ -n "$ROUTER_PIDS" ] && cpu0=$(python3 benches/tools/routing.py cpu $ROUTER_PIDS)
  m0=$(python3 benches/tools/routing.py scrape "${ENGINE_ADDRS[@]}")
  wait "$lt" || echo "  faden-loadtest exited with $? (see below)" >&2
  LOADGEN=""
  [ -n "$ROUTER_PIDS" ] && cpu1=$(python3 benches/tools/routing.py cpu $ROUTER_PIDS)
  m1=$(python3 benches/tools/routing.py scrape "${ENGINE_ADDRS[@]}")
  stop_run
  LINE=$(python3 benches/tools/routing.py row "$row" "$rate" "$RUN/lt.json" "$cpu0" "$cpu1" "$m0" "$m1")
  echo "$LINE" >>"$OUT_DIR/results.jsonl"
  python3 - "$LINE" <<'PY' || { echo "  (no report)"; cat "$RUN/lt.txt" >&2; }
import json, sys
r = json.loads(sys.argv[1])
if "failed" in r: sys.exit(1)
f = lambda v, s="{:.1f}": "-" if v is None else s.format(v)
print(f"  {r['row']:<16} {r['rate']:>5g} req/s  hit {f(r['hit_rate'] and 100 * r['hit_rate'])}%"
      f" (engines {f(r.get('engine_hit_rate') and 100 * r['engine_hit_rate'])}%)"
      f"  ttft p50/p90/p99 {f(r['ttft_p50_ms'])}/{f(r['ttft_p90_ms'])}/{f(r['ttft_p99_ms'])} ms"
      f"  {f(r['rps'])} req/s  errors {r['errors']}  cpu {f(r.get('cpu_us_per_req'), '{:.0f}')} us/req")
PY
}

mkdir -p "$OUT_DIR"
: >"$OUT_DIR/results.jsonl"
python3 - "$OUT_DIR/results.jsonl" <<PY
import json, subprocess, sys, time
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
meta = {"meta": True, "date": time.strftime("%Y-%m-%d %H:%M"), "commit": commit,
        "nproc": $(nproc), "load_start": open("/proc/loadavg").read().split()[0],
        "engines": $ENGINES, "rates": "$RATES".split(), "rate": $RATE, "slo_ms": $SLO_MS,
        "duration_s": $DURATION, "warmup_s": $WARMUP, "seed": $SEED,
        "scenario": open("$WORK/scenario.yaml").read(),
        "engine_flags": "${ENGINE_FLAGS[*]}", "plain_engines": $PLAIN_ENGINES == 1,
        "faden_route_policy_flag": $HAVE_POLICY_FLAG == 1,
        "sglang_router": "$SGLANG_ROUTER_VERSION", "vllm_router": "$VLLM_ROUTER_VERSION"}
open(sys.argv[1], "a").write(json.dumps(meta) + "\n")
PY

echo "== $ENGINES engines (${ENGINE_FLAGS[*]}), $TENANTS tenants, rates $RATES(table at $RATE), ${WARMUP}s + ${DURATION}s per run"
for row in $ROWS; do
  for rate in $RATES; do
    if [ "$SWEEP_STOP" = 1 ] && [ "${MISSED:-}" = "$row" ] && python3 -c "import sys; sys.exit(0 if $rate > $RATE else 1)"; then
      echo "  $row $rate req/s: skipped (p90 TTFT above ${SLO_MS} ms at a lower rate)"
      continue
    fi
    run_one "$row" "$rate"
    python3 -c "
import json, sys
r = json.loads(sys.argv[1])
sys.exit(0 if r.get('ttft_p90_ms') is not None and r['ttft_p90_ms'] <= $SLO_MS and r.get('errors') == 0 else 1)" "$LINE" || MISSED=$row
  done
done

echo
python3 benches/tools/routing.py table "$OUT_DIR/results.jsonl" "$OUT_DIR" "$RATE" "$SLO_MS"
if [ -x "$PLOT" ]; then
  "$PLOT" routing "$OUT_DIR/results.json" "$OUT_DIR" || echo "note: the plot failed" >&2
fi
echo "== results in $OUT_DIR (results.json, table.txt, table.csv, routing.png)"
