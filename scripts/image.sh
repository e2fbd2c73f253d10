#!/usr/bin/env bash
# The OCI image of the one `faden` binary, built without pulling any base image, and its smoke
# test (docs/deploy.md#the-image).
#
#   scripts/image.sh build   build the binary (release, or FADEN_BIN), assemble a minimal root
#                            filesystem, commit it FROM scratch with buildah as localhost/faden:<version>
#                            and write target/image/faden-<version>.oci.tar
#   scripts/image.sh smoke   start containers of that image (read-only root, uid 65532, no
#                            capabilities) and get streamed answers through them
#   scripts/image.sh size    print the image's size, uncompressed and compressed
#
# Environment:
#   FADEN_BIN=path     put this binary in the image instead of building the release one (CI uses
#                      the dev binary its tests built; its debug info is stripped either way)
#   FADEN_IMAGE=name   the image's name (default localhost/faden); the tag is the version
#   FADEN_RUNTIME=x    the OCI runtime podman uses (default runc: Debian 12's crun refuses this
#                      sandbox's hybrid cgroup hierarchy)
# Needs buildah, podman, skopeo and runc (Debian: apt-get install buildah podman skopeo runc);
# `build` installs them when they are missing and apt-get is there.
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE=${FADEN_IMAGE:-localhost/faden}
RUNTIME=${FADEN_RUNTIME:-runc}
OUT=target/image
# The non-root user the image runs as (distroless' "nonroot" number).
UID_GID=65532

log() { printf '== %s\n' "$*" >&2; }
die() { printf 'image.sh: %s\n' "$*" >&2; exit 1; }

need_tools() {
  local missing=()
  for t in buildah podman skopeo runc objcopy; do command -v "$t" >/dev/null || missing+=("$t"); done
  [ ${#missing[@]} -eq 0 ] && return
  command -v apt-get >/dev/null || die "missing: ${missing[*]}"
  log "installing buildah podman skopeo runc binutils"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq buildah podman skopeo runc binutils >/dev/null
}

binary() {
  if [ -n "${FADEN_BIN:-}" ]; then
    [ -x "$FADEN_BIN" ] || die "FADEN_BIN=$FADEN_BIN is not an executable"
    printf '%s\n' "$FADEN_BIN"
  else
    log "cargo build --release -p faden"
    cargo build --release --locked -p faden >&2
    printf '%s\n' target/release/faden
  fi
}

version() { "$1" --version | awk '{print $2}'; }

# The root filesystem: the binary (debug info stripped, symbols kept for backtraces), the shared
# libraries it links (glibc, libm, libgcc_s and the loader, as ldd lists them), the CA bundle
# for https:// server URLs and sslmode=require, a passwd/group with the non-root user, an empty
# /tmp, and the data directory owned by that user.
assemble_rootfs() {
  local bin=$1 root=$2
  rm -rf "$root"
  mkdir -p "$root"/usr/local/bin "$root"/etc/ssl/certs "$root"/tmp "$root"/var/lib/faden
  objcopy --strip-debug "$bin" "$root/usr/local/bin/faden"
  local lib
  for lib in $(ldd "$bin" | grep -o '/[^ ]*'); do
    mkdir -p "$root$(dirname "$lib")"
    cp -L "$lib" "$root$lib"
  done
  cp -L /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
  printf 'root:x:0:0:root:/root:/sbin/nologin\nfaden:x:%s:%s:faden:/var/lib/faden:/sbin/nologin\n' \
    "$UID_GID" "$UID_GID" >"$root/etc/passwd"
  printf 'root:x:0:\nfaden:x:%s:\n' "$UID_GID" >"$root/etc/group"
  # Host names resolve through /etc/hosts, then DNS (glibc's files and dns are built in).
  printf 'hosts: files dns\n' >"$root/etc/nsswitch.conf"
  chmod 1777 "$root/tmp"
  chown "$UID_GID:$UID_GID" "$root/var/lib/faden"
  chmod 0700 "$root/var/lib/faden"
  # Reproducible layer: every file dated at the commit.
  local epoch
  epoch=$(git log -1 --format=%ct 2>/dev/null || echo 0)
  find "$root" -exec touch -h -d "@$epoch" {} +
}

cmd_build() {
  need_tools
  local bin ver root ctr mnt epoch rev
  bin=$(binary)
  ver=$(version "$bin")
  root=$OUT/rootfs
  mkdir -p "$OUT"
  log "root filesystem from $bin (faden $ver)"
  assemble_rootfs "$bin" "$root"
  epoch=$(git log -1 --format=%ct 2>/dev/null || echo 0)
  rev=$(git rev-parse HEAD 2>/dev/null || echo unknown)

  # FROM scratch: the container's root is empty until the root filesystem is copied in as it
  # is (owners and modes kept, which `buildah copy` would reset).
  ctr=$(buildah from scratch)
  trap 'buildah rm "$ctr" >/dev/null 2>&1 || true' EXIT
  mnt=$(buildah mount "$ctr")
  cp -a "$root/." "$mnt/"
  buildah umount "$ctr" >/dev/null
  buildah config \
    --entrypoint '["/usr/local/bin/faden"]' --cmd '[]' \
    --user "$UID_GID:$UID_GID" --workingdir /var/lib/faden --volume /var/lib/faden \
    --env PATH=/usr/local/bin --env SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt \
    --port 8080/tcp --port 30080/tcp --port 30079/tcp --port 10150/tcp --port 10151/tcp \
    --stop-signal SIGTERM \
    --label org.opencontainers.image.title=faden \
    --label "org.opencontainers.image.description=faden: the data plane for GPU inference clusters (gateway, tunnel, control plane)" \
    --label "org.opencontainers.image.version=$ver" \
    --label "org.opencontainers.image.revision=$rev" \
    --label org.opencontainers.image.licenses=Apache-2.0 \
    --label "org.opencontainers.image.created=$(date -u -d "@$epoch" +%Y-%m-%dT%H:%M:%SZ)" \
    "$ctr"
  local old new
  old=$(podman image inspect --format '{{.Id}}' "$IMAGE:$ver" 2>/dev/null || true)
  new=$(buildah commit --quiet --format oci --timestamp "$epoch" --rm "$ctr" "$IMAGE:$ver")
  trap - EXIT
  # The image this tag named before, now untagged: not kept (one per build would pile up).
  if [ -n "$old" ] && [ "$old" != "$new" ]; then podman rmi "$old" >/dev/null 2>&1 || true; fi
  rm -f "$OUT/faden-$ver.oci.tar"
  buildah push --quiet "$IMAGE:$ver" "oci-archive:$OUT/faden-$ver.oci.tar:$IMAGE:$ver"
  log "built $IMAGE:$ver and $OUT/faden-$ver.oci.tar"
  cmd_size "$ver"
}

current_version() {
  local ref
  ref=$(podman images --format '{{.Tag}}' --filter "reference=$IMAGE" | head -n1)
  [ -n "$ref" ] || die "no $IMAGE image: run scripts/image.sh build first"
  printf '%s\n' "$ref"
}

# Uncompressed: the layer as unpacked; compressed: the gzip layer as a registry stores it (the
# OCI archive's blobs).
cmd_size() {
  local ver=${1:-$(current_version)} raw gz
  raw=$(podman image inspect --format '{{.Size}}' "$IMAGE:$ver")
  gz=$(tar -tvf "$OUT/faden-$ver.oci.tar" | awk '$6 ~ /^blobs\// {s += $3} END {print s}')
  awk -v i="$IMAGE:$ver" -v r="$raw" -v g="$gz" 'BEGIN {
    printf "image %s: %.1f MB uncompressed, %.1f MB compressed (gzip layer, config and manifest)\n", i, r / 1e6, g / 1e6 }'
}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# Containers of the smoke test share the host's network (no bridge is needed, each process
# listens on its own free port of 127.0.0.1) and run as hardened as Kubernetes runs them:
# read-only root, not even a /tmp, no capabilities, no new privileges. This sandbox forbids
# raising resource limits (no CAP_SYS_RESOURCE), so the limits are set at or below the current
# ones.
SMOKE_NAMES=()
run_container() {
  local name=$1 data=$2
  shift 2
  SMOKE_NAMES+=("$name")
  podman --runtime "$RUNTIME" run -d --name "$name" --network host \
    --read-only --read-only-tmpfs=false --cap-drop all --security-opt no-new-privileges \
    --ulimit "nofile=$(ulimit -Hn):$(ulimit -Hn)" --ulimit nproc=4096:4096 \
    -v "$data:/var/lib/faden" "$IMAGE:$VER" "$@" >/dev/null
}

# Waits (up to 60 s) for `pattern` in a container's log.
wait_log() {
  local name=$1 pattern=$2
  for _ in $(seq 600); do
    podman logs "$name" 2>&1 | grep -q -- "$pattern" && return 0
    [ "$(podman inspect -f '{{.State.Running}}' "$name")" = true ] || break
    sleep 0.1
  done
  podman logs "$name" >&2 || true
  die "$name: no '$pattern' in its log"
}

# Waits (up to 60 s) until `url` answers 200.
wait_http() {
  for _ in $(seq 600); do
    curl -fsS -o /dev/null --max-time 2 "$1" 2>/dev/null && return 0
    sleep 0.1
  done
  die "$1 never answered 200"
}

# Waits (up to 60 s) until `gateway` answers a chat completion for model demo: its snapshot has
# the worker's running instance.
wait_routable() {
  for _ in $(seq 600); do
    curl -fsS -o /dev/null --max-time 10 "http://$1/v1/chat/completions" -H "Authorization: Bearer $2" \
      -d '{"model": "demo", "messages": [{"role": "user", "content": "hello"}]}' 2>/dev/null && return 0
    sleep 0.1
  done
  die "$1 never routed model demo"
}

# A streamed chat completion through `gateway` with `key`: several SSE chunks, then [DONE].
stream_check() {
  local gateway=$1 key=$2 what=$3 body chunks
  body=$(curl -fsS -N --max-time 30 "http://$gateway/v1/chat/completions" \
    -H "Authorization: Bearer $key" \
    -d '{"model": "demo", "stream": true, "messages": [{"role": "user", "content": "hello"}]}')
  chunks=$(grep -c '^data: {' <<<"$body" || true)
  grep -q '^data: \[DONE\]' <<<"$body" || die "$what: no [DONE] in the stream: $body"
  [ "$chunks" -ge 2 ] || die "$what: $chunks chunks, expected a stream: $body"
  log "$what: streamed answer, $chunks chunks then [DONE]"
}

# The process in the container runs as 65532:65532, with no capabilities.
check_hardening() {
  local name=$1 pid
  pid=$(podman inspect -f '{{.State.Pid}}' "$name")
  grep -q "^Uid:[[:space:]]*$UID_GID[[:space:]]" "/proc/$pid/status" || die "$name does not run as uid $UID_GID"
  grep -q '^CapEff:[[:space:]]*0000000000000000$' "/proc/$pid/status" || die "$name has capabilities"
  grep -q '^NoNewPrivs:[[:space:]]*1$' "/proc/$pid/status" || die "$name may gain privileges"
}

# SIGTERM drains and exits 0.
stop_check() {
  local name=$1 code
  podman stop -t 20 "$name" >/dev/null
  code=$(podman inspect -f '{{.State.ExitCode}}' "$name")
  [ "$code" = 0 ] || { podman logs "$name" >&2; die "$name exited $code on SIGTERM"; }
}

smoke_cleanup() {
  local n
  for n in "${SMOKE_NAMES[@]}"; do podman rm -f -t 0 "$n" >/dev/null 2>&1 || true; done
  if [ -n "${PG_DIR:-}" ] && [ -d "$PG_DIR" ]; then
    runuser -u postgres -- "$PG_BIN/pg_ctl" -D "$PG_DIR/data" -m immediate stop >/dev/null 2>&1 || true
  fi
  [ -n "${SMOKE_DIR:-}" ] && rm -rf "$SMOKE_DIR"
}

# `faden up` in one container: management API, gateway, embedded worker and mock engine.
smoke_up() {
  local data="$SMOKE_DIR/up" name="faden-smoke-up-$$" gateway api key
  mkdir -p "$data" && chown "$UID_GID:$UID_GID" "$data"
  run_container "$name" "$data" up --host 127.0.0.1 --port 0 --api-port 0 --proxy-port 0
  wait_log "$name" 'faden is up'
  gateway=$(podman logs "$name" 2>&1 | sed -n 's/.*faden up ready api=[^ ]* gateway=\([^ ]*\).*/\1/p' | head -n1)
  api=$(podman logs "$name" 2>&1 | sed -n 's/.*faden up ready api=\([^ ]*\).*/\1/p' | head -n1)
  key=$(podman logs "$name" 2>&1 | sed -n 's/^API key: \(fdn_[0-9a-f_]*\).*/\1/p' | head -n1)
  [ -n "$gateway" ] && [ -n "$api" ] && [ -n "$key" ] || die "cannot read the addresses and key from the log"
  check_hardening "$name"
  curl -fsS "http://$gateway/healthz" >/dev/null
  curl -fsS "http://$gateway/readyz" | grep -q ready
  curl -fsS "http://$api/healthz" | grep -q ok
  # What compose's health checks run: `faden probe` inside the container.
  podman exec "$name" faden probe "http://$gateway/readyz"
  if podman exec "$name" /usr/local/bin/faden probe "http://$gateway/no-such-path" 2>/dev/null; then
    die "faden probe passed on a 404"
  fi
  stream_check "$gateway" "$key" "faden up"
  stop_check "$name"
  log "faden up: /healthz and /readyz 200, API /healthz 200, faden probe inside, exit 0 on SIGTERM"
}

# The compose file's topology from separate containers: two servers on one PostgreSQL (a private
# cluster on 127.0.0.1), the mock engine, a tunnel worker and a standalone gateway listing both
# servers; streamed answers through the second server's gateway (the proxy-port hop to the
# tunnel's owner) and through the standalone gateway.
smoke_cluster() {
  PG_BIN=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n1)
  [ -x "$PG_BIN/initdb" ] || die "PostgreSQL server binaries missing (apt-get install postgresql)"
  PG_DIR="$SMOKE_DIR/pg"
  mkdir -p "$PG_DIR" && chown postgres "$PG_DIR"
  local pg_port
  pg_port=$(free_port)
  runuser -u postgres -- "$PG_BIN/initdb" -D "$PG_DIR/data" -U faden -A trust -E UTF8 --locale=C --no-sync >/dev/null
  runuser -u postgres -- "$PG_BIN/pg_ctl" -D "$PG_DIR/data" -l "$PG_DIR/log" -w \
    -o "-h 127.0.0.1 -p $pg_port -k $PG_DIR" start >/dev/null
  runuser -u postgres -- "$PG_BIN/createdb" -h 127.0.0.1 -p "$pg_port" -U faden faden
  local db="postgres://faden@127.0.0.1:$pg_port/faden?sslmode=disable"

  # Admin key: any key of the documented form (deploy/ makes one with openssl rand).
  local admin a1 g1 p1 a2 g2 p2
  admin="fdn_$(od -An -N8 -tx1 /dev/urandom | tr -d ' \n')_$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')"
  a1=$(free_port) g1=$(free_port) p1=$(free_port) a2=$(free_port) g2=$(free_port) p2=$(free_port)
  local n
  for n in 1 2; do
    local a=a$n g=g$n p=p$n
    mkdir -p "$SMOKE_DIR/server-$n" && chown "$UID_GID:$UID_GID" "$SMOKE_DIR/server-$n"
    run_container "faden-smoke-server-$n-$$" "$SMOKE_DIR/server-$n" \
      server --host 127.0.0.1 --api-port "${!a}" --port "${!g}" --proxy-port "${!p}" \
      --server-url "http://127.0.0.1:${!a}" --database-url "$db" --admin-key "$admin"
  done
  wait_http "http://127.0.0.1:$a1/healthz"
  wait_http "http://127.0.0.1:$a2/healthz"

  # What docs/deploy.md has an operator do once: a cluster, a model, keys.
  local api="http://127.0.0.1:$a1" auth="Authorization: Bearer $admin" reg inference dataplane
  reg=$(curl -fsS -H "$auth" -d '{"name": "default"}' "$api/v2/clusters" | python3 -c 'import json,sys; print(json.load(sys.stdin)["registration_token"])')
  curl -fsS -H "$auth" -d '{"name": "demo"}' "$api/v2/models" >/dev/null
  inference=$(curl -fsS -H "$auth" -d '{"name": "smoke", "scope": "inference"}' "$api/v2/api-keys" | python3 -c 'import json,sys; print(json.load(sys.stdin)["value"])')
  dataplane=$(curl -fsS -H "$auth" -d '{"name": "gateways", "scope": "data_plane"}' "$api/v2/api-keys" | python3 -c 'import json,sys; print(json.load(sys.stdin)["value"])')

  local engine gw
  engine=$(free_port) gw=$(free_port)
  mkdir -p "$SMOKE_DIR/engine" "$SMOKE_DIR/worker" "$SMOKE_DIR/gateway"
  chown "$UID_GID:$UID_GID" "$SMOKE_DIR/engine" "$SMOKE_DIR/worker" "$SMOKE_DIR/gateway"
  run_container "faden-smoke-engine-$$" "$SMOKE_DIR/engine" mock-engine --port "$engine" --model demo
  wait_http "http://127.0.0.1:$engine/healthz"
  # The worker dials server 1 first, so its tunnel ends there: server 2 reaches it through
  # server 1's proxy port.
  run_container "faden-smoke-worker-$$" "$SMOKE_DIR/worker" \
    worker --server-url "http://127.0.0.1:$a1,http://127.0.0.1:$a2" --token "$reg" \
    --proxy-mode tunnel --instance "demo=$engine" --worker-metrics-port 0 --name smoke-worker
  run_container "faden-smoke-gateway-$$" "$SMOKE_DIR/gateway" \
    gateway --server-url "http://127.0.0.1:$a2,http://127.0.0.1:$a1" --token "$dataplane" \
    --host 127.0.0.1 --port "$gw"
  wait_log "faden-smoke-worker-$$" 'tunnel up'
  wait_http "http://127.0.0.1:$gw/readyz"
  wait_http "http://127.0.0.1:$g2/readyz"
  for n in "faden-smoke-server-1-$$" "faden-smoke-worker-$$" "faden-smoke-gateway-$$"; do check_hardening "$n"; done

  local owner
  owner=$(curl -fsS -H "$auth" "$api/v2/workers" | python3 -c 'import json,sys; print(json.load(sys.stdin)["items"][0]["proxy_address"])')
  [ "$owner" = "http://127.0.0.1:$p1" ] || die "the worker's tunnel owner is $owner, expected server 1 (http://127.0.0.1:$p1)"
  local target
  for target in "127.0.0.1:$g1" "127.0.0.1:$g2" "127.0.0.1:$gw"; do wait_routable "$target" "$inference"; done
  stream_check "127.0.0.1:$g1" "$inference" "server 1's gateway (tunnel owner)"
  stream_check "127.0.0.1:$g2" "$inference" "server 2's gateway (through server 1's proxy port)"
  stream_check "127.0.0.1:$gw" "$inference" "standalone gateway"
  for n in "faden-smoke-gateway-$$" "faden-smoke-worker-$$" "faden-smoke-server-2-$$" "faden-smoke-server-1-$$"; do
    stop_check "$n"
  done
  log "cluster: two servers on PostgreSQL, tunnel worker, standalone gateway; exit 0 on SIGTERM"
}

cmd_smoke() {
  need_tools
  VER=$(current_version)
  SMOKE_DIR=$(mktemp -d /tmp/faden-image-smoke.XXXXXX)
  chmod 0755 "$SMOKE_DIR"
  trap smoke_cleanup EXIT
  smoke_up
  smoke_cluster
  log "smoke test of $IMAGE:$VER passed"
}

case "${1:-}" in
  build) cmd_build ;;
  smoke) cmd_smoke ;;
  size) cmd_size "${2:-}" ;;
  *) die "usage: scripts/image.sh build|smoke|size" ;;
esac
