#!/usr/bin/env bash
# GPUStack's own OpenAI endpoint against `faden gateway` synced from it, on the same instance,
# in interleaved rounds (benches/gpustack_front.py says what is measured). Needs PyPI once for
# the GPUStack venv and PostgreSQL's server binaries; a few minutes.
#   benches/gpustack_front.sh [--rounds N] [--duration 10s]
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked -p faden -p faden-loadtest
PY=$(bash scripts/gpustack-venv.sh | tail -n1)
exec "$PY" benches/gpustack_front.py "$@"
