# The tunnel alone and rathole in front of one mock engine, for benches/relay_vs_rathole.sh and
# benches/relay_callgrind.sh (sourced, after lib.sh). Expects FADEN, WORK and the PIDS array;
# RUN_UNDER (an array, may be empty) prefixes the four tunnel processes: faden server, tunnel
# worker, rathole server and client (valgrind, say). Sets EP / ENGINE (the engine's pid and
# address), SP / TP (faden server and tunnel worker), PP (the proxy port), API, ADMIN, TARGET
# (the CONNECT target of the tunnel's instance), RS / RC (rathole server and client) and RP
# (rathole's service port).
RUN_UNDER=("${RUN_UNDER[@]+"${RUN_UNDER[@]}"}")
export FADEN_LOG=warn,faden=info FADEN_WORKER_THREADS=1 FADEN_MAX_PENDING_PER_SOURCE=0 FADEN_MAX_PENDING_CONNECTIONS=20000
"$FADEN" mock-engine --port 0 --model demo --tokens 8 > "$WORK/engine.log" 2>&1 & EP=$!; PIDS+=($EP)
ENGINE=$(wait_for "$WORK/engine.log" "mock engine listening" addr)
PP=$(free_port)
"${RUN_UNDER[@]}" "$FADEN" server --data-dir "$WORK/server" --host 127.0.0.1 --api-port 0 --port 0 --proxy-port "$PP" > "$WORK/server.log" 2>&1 & SP=$!; PIDS+=($SP)
API=$(wait_for "$WORK/server.log" "faden server ready" api)
ADMIN=$(cat "$WORK/server/admin.key"); api() { curl -sf -H "Authorization: Bearer $ADMIN" "$@"; }
REG=$(api -X POST "http://$API/v2/clusters" -d '{"name":"b"}' | python3 -c 'import json,sys; print(json.load(sys.stdin)["registration_token"])')
api -X POST "http://$API/v2/models" -d '{"name":"demo-tunnel"}' >/dev/null
# `--worker-ip` names an address nothing listens on: every byte goes through the tunnel.
"${RUN_UNDER[@]}" "$FADEN" worker --server-url "http://$API" --token "$REG" --name wt --proxy-mode tunnel --worker-ip 10.255.0.7 --worker-port 0 --disable-worker-metrics --instance "demo-tunnel=${ENGINE##*:}" --data-dir "$WORK/wt" --probe-interval 1s > "$WORK/wt.log" 2>&1 & TP=$!; PIDS+=($TP)
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
"${RUN_UNDER[@]}" rathole --server "$WORK/rs.toml" > "$WORK/rs.log" 2>&1 & RS=$!; PIDS+=($RS)
sleep 0.3; "${RUN_UNDER[@]}" rathole --client "$WORK/rc.toml" > "$WORK/rc.log" 2>&1 & RC=$!; PIDS+=($RC)
sleep 1
