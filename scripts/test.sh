#!/usr/bin/env bash
# The project's test command (README): every crate's unit and integration tests (the API's
# on SQLite and on PostgreSQL), doc tests,
# a compile check of the benchmarks, the official `openai` Python client against `faden up`,
# the GPUStack interop suite against GPUStack 2.3.0 and 2.2.3 (tests/gpustack: a private
# PostgreSQL and GPUStack from PyPI in a cached venv per version, all on 127.0.0.1), and faden in
# front of a real vLLM (tests/vllm: vLLM's CPU build from PyPI in a cached venv, a tiny
# dummy-weight model).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! cargo nextest --version >/dev/null 2>&1; then
  cargo install cargo-nextest --locked
fi
cargo nextest run --workspace --locked --profile ci
# The management API's suite once more with its store on a private PostgreSQL cluster.
FADEN_TEST_STORE=postgres cargo nextest run --locked --profile ci -p control --test api
cargo test --workspace --locked --doc
cargo bench --workspace --locked --no-run

# A real OpenAI client against the real binary, and a short faden-loadtest smoke run.
cargo build --locked -p faden -p faden-loadtest
python3 -m pip install --quiet --disable-pip-version-check -r tests/python/requirements.txt
python3 -m pytest -p no:cacheprovider -q tests/python

# The whole interop suite against each GPUStack release faden supports: 2.3.0, and 2.2.3 for
# clusters whose workers are upgraded unevenly (each venv is made on first use: ~80 s, ~900 MB;
# each run takes 7-8 minutes on 2 cores).
for version in 2.3.0 2.2.3; do
  echo "tests/gpustack against GPUStack $version"
  GPUSTACK_PY=$(FADEN_GPUSTACK_VERSION=$version bash scripts/gpustack-venv.sh | tail -n1)
  FADEN_BIN="$PWD/target/debug/faden" "$GPUSTACK_PY" -m pytest -p no:cacheprovider -q tests/gpustack
done

# faden in front of a real vLLM (CPU build, tiny dummy-weight model; its venv is made on first
# use: ~4 min, ~6.3 GB).
VLLM_PY=$(bash scripts/vllm-venv.sh | tail -n1)
FADEN_BIN="$PWD/target/debug/faden" "$VLLM_PY" -m pytest -p no:cacheprovider -q tests/vllm
