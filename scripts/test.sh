#!/usr/bin/env bash
# The project's test command (README): every crate's unit and integration tests, doc tests,
# a compile check of the benchmarks, and the official `openai` Python client against `faden up`.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! cargo nextest --version >/dev/null 2>&1; then
  cargo install cargo-nextest --locked
fi
cargo nextest run --workspace --locked --profile ci
cargo test --workspace --locked --doc
cargo bench --workspace --locked --no-run

# A real OpenAI client against the real binary, and a short faden-loadtest smoke run.
cargo build --locked -p faden -p faden-loadtest
python3 -m pip install --quiet --disable-pip-version-check -r tests/python/requirements.txt
python3 -m pytest -p no:cacheprovider -q tests/python
