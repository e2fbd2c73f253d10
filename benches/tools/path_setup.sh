# One request path of the gateway in front of one mock engine, for benches/path_callgrind.sh and
# benches/path_cpu.sh (sourced, after lib.sh). Expects FADEN, WORK, the PIDS array and ROUTE:
#   direct      the server's gateway -> engine (a `direct` worker registers the instance)
#   tunnel      the server's gateway -> in-process tunnel -> `tunnel` worker -> engine
#   proxy-port  a standalone `faden gateway` -> the server's proxy port -> tunnel -> worker ->
#               engine
# RUN_UNDER (an array, may be empty) prefixes the processes on the path (valgrind, say). Every
# faden process runs one runtime thread. Sets URL (the client's base URL), KEY, MODEL, ON_PATH
# (the pids on the path, client side first) and ON_PATH_NAMES (their names, alike). The
# worker does not read the engine's /metrics (FADEN_ENGINE_METRICS_INTERVAL=0), so that no
# reading every 100 ms runs beside the requests; its probes run every 5 s.
RUN_UNDER=("${RUN_UNDER[@]+"${RUN_UNDER[@]}"}")
export FADEN_LOG=warn,faden=info FADEN_WORKER_THREADS=1 FADEN_MAX_PENDING_PER_SOURCE=0 FADEN_MAX_PENDING_CONNECTIONS=20000 FADEN_ENGINE_METRICS_INTERVAL=0
"$FADEN" mock-engine --port 0 --model demo --tokens 8 > "$WORK/engine.log" 2>&1 & EP=$!; PIDS+=($EP)
ENGINE=$(wait_for "$WORK/engine.log" "mock engine listening" addr)
"${RUN_UNDER[@]}" "$FADEN" server --data-dir "$WORK/server" --host 127.0.0.1 --api-port 0 --port 0 --proxy-port 0 > "$WORK/server.log" 2>&1 & SP=$!; PIDS+=($SP)
API=$(wait_for "$WORK/server.log" "faden server ready" api); GW=$(wait_for "$WORK/server.log" "faden server ready" gateway)
ADMIN=$(cat "$WORK/server/admin.key"); api() { curl -sf -H "Authorization: Bearer $ADMIN" "$@"; }
REG=$(api -X POST "http://$API/v2/clusters" -d '{"name":"b"}' | python3 -c 'import json,sys; print(json.load(sys.stdin)["registration_token"])')
MODEL=demo-$ROUTE
api -X POST "http://$API/v2/models" -d "{\"name\":\"$MODEL\"}" >/dev/null
KEY=$(api -X POST "http://$API/v2/api-keys" -d '{"name":"b"}' | python3 -c 'import json,sys; print(json.load(sys.stdin)["value"])')
case $ROUTE in
  direct)
    "$FADEN" worker --server-url "http://$API" --token "$REG" --name wd --proxy-mode direct --worker-ip 127.0.0.1 --worker-port 0 --disable-worker-metrics --instance "$MODEL=${ENGINE##*:}" --data-dir "$WORK/wd" --probe-interval 5s > "$WORK/w.log" 2>&1 & WP=$!; PIDS+=($WP)
    ON_PATH="$SP"; ON_PATH_NAMES="server" ;;
  tunnel|proxy-port)
    # `--worker-ip` names an address nothing listens on: every byte goes through the tunnel.
    "${RUN_UNDER[@]}" "$FADEN" worker --server-url "http://$API" --token "$REG" --name wt --proxy-mode tunnel --worker-ip 10.255.0.7 --worker-port 0 --disable-worker-metrics --instance "$MODEL=${ENGINE##*:}" --data-dir "$WORK/wt" --probe-interval 5s > "$WORK/w.log" 2>&1 & WP=$!; PIDS+=($WP)
    ON_PATH="$SP $WP"; ON_PATH_NAMES="server worker" ;;
  *) echo "unknown path $ROUTE (direct, tunnel or proxy-port)" >&2; exit 2 ;;
esac
wait_for "$WORK/w.log" "faden worker ready" worker_id >/dev/null
URL="http://$GW/v1"
if [ "$ROUTE" = proxy-port ]; then
  "${RUN_UNDER[@]}" "$FADEN" gateway --server-url "http://$API" --token "$ADMIN" --host 127.0.0.1 --port 0 > "$WORK/gateway.log" 2>&1 & GP=$!; PIDS+=($GP)
  URL="http://$(wait_for "$WORK/gateway.log" "faden gateway ready" gateway)/v1"
  ON_PATH="$GP $ON_PATH"; ON_PATH_NAMES="gateway $ON_PATH_NAMES"
fi
for _ in $(seq 1 600); do
  code=$(curl -s -o /dev/null -w '%{http_code}' "$URL/chat/completions" -H "Authorization: Bearer $KEY" -d "{\"model\":\"$MODEL\",\"messages\":[]}")
  [ "$code" = 200 ] && break; sleep 0.1
done
[ "$code" = 200 ] || { echo "model $MODEL never became routable at $URL ($code)" >&2; tail -5 "$WORK"/*.log >&2; exit 1; }
