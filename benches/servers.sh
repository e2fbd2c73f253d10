#!/usr/bin/env bash
# Three faden servers on one PostgreSQL: a request through the tunnel's owner against one hop
# through another server's gateway, and 1,000 heartbeating workers over the three servers
# (benches/servers.py says what is measured). Needs PostgreSQL's server binaries; a few minutes.
#   benches/servers.sh [--rounds N] [--duration 10s] [--workers 1000] [--heartbeat-interval 5]
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked -p faden -p faden-loadtest
PY=$(bash scripts/gpustack-venv.sh | tail -n1)
exec "$PY" benches/servers.py "$@"
