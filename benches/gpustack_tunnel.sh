#!/usr/bin/env bash
# GPUStack's tunnel client on a GPUStack 2.3.0 server against the same client on a faden
# server, through each server's proxy port, in interleaved rounds (benches/gpustack_tunnel.py
# says what is measured). Needs PyPI once for the GPUStack venv and PostgreSQL's server
# binaries; a few minutes.
#   benches/gpustack_tunnel.sh [--rounds N] [--duration 10s]
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked -p faden -p faden-loadtest
PY=$(bash scripts/gpustack-venv.sh | tail -n1)
exec "$PY" benches/gpustack_tunnel.py "$@"
