#!/usr/bin/env bash
# The project's test command (README): every crate's unit and integration tests, doc tests,
# and a compile check of the benchmarks.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! cargo nextest --version >/dev/null 2>&1; then
  cargo install cargo-nextest --locked
fi
cargo nextest run --workspace --locked --profile ci
cargo test --workspace --locked --doc
cargo bench --workspace --locked --no-run
