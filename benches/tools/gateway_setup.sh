# The gateway's direct path and nginx in front of the same mock engines, for
# benches/quick_vs_nginx.sh and benches/latency_rounds.sh (sourced, after lib.sh). Expects FADEN,
# WORK and the PIDS array. Starts two engines (EP / ENGINE: 8-token answers; SSE_EP / SSE_ENGINE:
# 16 tokens 1 ms apart, for streams), `faden server` with one `direct` worker serving model
# `demo-direct` on the first and `demo-direct-sse` on the second, and nginx (`proxy_pass`,
# upstream keepalive, no buffering, one worker process) with one port per engine. Sets SERVER
# (the server's pid), GW (its gateway address), KEY (an inference key), WORKER (the worker's
# pid), NP / NSP (nginx's ports for the two engines) and NPIDS (nginx's processes).
# TUNNEL=1: also a `tunnel` worker (TUNNEL_WORKER, one runtime thread) serving model
# `demo-tunnel` on the first engine, reached through the server's tunnel.
# PROXY_THREADS=N (default 1): the server's runtime threads and nginx's worker processes, alike;
# every other faden process keeps one runtime thread.
export FADEN_LOG=warn,faden=info FADEN_WORKER_THREADS=1 FADEN_MAX_PENDING_PER_SOURCE=0 FADEN_MAX_PENDING_CONNECTIONS=20000
"$FADEN" mock-engine --port 0 --model demo --tokens 8 > "$WORK/engine.log" 2>&1 & EP=$!; PIDS+=($EP)
ENGINE=$(wait_for "$WORK/engine.log" "mock engine listening" addr)
"$FADEN" mock-engine --port 0 --model demo --tokens 16 --itl 1ms --ttft 0s > "$WORK/sse-engine.log" 2>&1 & SSE_EP=$!; PIDS+=($SSE_EP)
SSE_ENGINE=$(wait_for "$WORK/sse-engine.log" "mock engine listening" addr)
FADEN_WORKER_THREADS=${PROXY_THREADS:-1} "$FADEN" server --data-dir "$WORK/server" --host 127.0.0.1 --api-port 0 --port 0 --proxy-port 0 > "$WORK/server.log" 2>&1 & SERVER=$!; PIDS+=($SERVER)
API=$(wait_for "$WORK/server.log" "faden server ready" api); GW=$(wait_for "$WORK/server.log" "faden server ready" gateway)
ADMIN=$(cat "$WORK/server/admin.key"); api() { curl -sf -H "Authorization: Bearer $ADMIN" "$@"; }
REG=$(api -X POST "http://$API/v2/clusters" -d '{"name":"b"}' | python3 -c 'import json,sys; print(json.load(sys.stdin)["registration_token"])')
MODELS="demo-direct demo-direct-sse$([ "${TUNNEL:-0}" = 1 ] && echo ' demo-tunnel')"
for model in $MODELS; do api -X POST "http://$API/v2/models" -d "{\"name\":\"$model\"}" >/dev/null; done
KEY=$(api -X POST "http://$API/v2/api-keys" -d '{"name":"b"}' | python3 -c 'import json,sys; print(json.load(sys.stdin)["value"])')
"$FADEN" worker --server-url "http://$API" --token "$REG" --name wd --proxy-mode direct --worker-ip 127.0.0.1 --worker-port 0 --disable-worker-metrics --instance "demo-direct=${ENGINE##*:}" --instance "demo-direct-sse=${SSE_ENGINE##*:}" --data-dir "$WORK/wd" --probe-interval 200ms > "$WORK/wd.log" 2>&1 & WORKER=$!; PIDS+=($WORKER)
wait_for "$WORK/wd.log" "faden worker ready" worker_id >/dev/null
if [ "${TUNNEL:-0}" = 1 ]; then
  "$FADEN" worker --server-url "http://$API" --token "$REG" --name wt --proxy-mode tunnel --disable-worker-metrics --instance "demo-tunnel=${ENGINE##*:}" --data-dir "$WORK/wt" --probe-interval 200ms > "$WORK/wt.log" 2>&1 & TUNNEL_WORKER=$!; PIDS+=($TUNNEL_WORKER)
  wait_for "$WORK/wt.log" "faden worker ready" worker_id >/dev/null
fi
for model in $MODELS; do
  for _ in $(seq 1 200); do
    code=$(curl -s -o /dev/null -w '%{http_code}' "http://$GW/v1/chat/completions" -H "Authorization: Bearer $KEY" -d "{\"model\":\"$model\",\"messages\":[]}")
    [ "$code" = 200 ] && break; sleep 0.05
  done
  [ "$code" = 200 ] || { echo "model $model never became routable" >&2; exit 1; }
done
NP=$(free_port); NSP=$(free_port)
cat > "$WORK/nginx.conf" <<NGINX
worker_processes ${PROXY_THREADS:-1};
pid $WORK/nginx.pid;
error_log $WORK/nginx-error.log warn;
events { worker_connections 4096; }
http { access_log off; keepalive_timeout 300s; keepalive_requests 1000000;
  upstream engine { server $ENGINE; keepalive 128; }
  upstream sse_engine { server $SSE_ENGINE; keepalive 128; }
  server { listen 127.0.0.1:$NP backlog=4096; location / { proxy_pass http://engine; proxy_http_version 1.1; proxy_set_header Connection ""; proxy_buffering off; proxy_request_buffering off; } }
  server { listen 127.0.0.1:$NSP backlog=4096; location / { proxy_pass http://sse_engine; proxy_http_version 1.1; proxy_set_header Connection ""; proxy_buffering off; proxy_request_buffering off; } } }
NGINX
nginx -c "$WORK/nginx.conf" -p "$WORK"; sleep 0.3
NPIDS="$(cat "$WORK/nginx.pid") $(pgrep -P "$(cat "$WORK/nginx.pid")" | tr '\n' ' ')"
