#!/usr/bin/env bash
# Makes sure a Python venv with a real GPUStack 2.3.0 (plus pytest and openai) exists, for the
# interop tests in tests/gpustack/, and prints the venv's python path as its last line:
#   PY=$(scripts/gpustack-venv.sh | tail -n1) && "$PY" -m pytest -q tests/gpustack
# Idempotent: does nothing when the venv already has gpustack 2.3.0, pytest and openai.
# Needs only PyPI (~80 s, ~900 MB on first run). GPUStack 2.3.0 supports Python 3.10-3.12: set
# FADEN_GPUSTACK_PYTHON (e.g. python3.11) when the default python3 is another version.
set -euo pipefail
VENV="${FADEN_GPUSTACK_VENV:-$HOME/.cache/faden/gpustack-2.3.0}"
PY="$VENV/bin/python"

ready() {
  "$PY" - <<'EOF' 2>/dev/null
import importlib.metadata as m
assert m.version("gpustack") == "2.3.0"
import pytest, openai  # noqa: F401
EOF
}

if ! ready; then
  # A venv that exists but is unusable (other gpustack version, broken python) is made anew.
  [ -x "$PY" ] && "$PY" -c 'import sys' 2>/dev/null || rm -rf "$VENV"
  [ -x "$PY" ] || "${FADEN_GPUSTACK_PYTHON:-python3}" -m venv "$VENV"
  "$PY" -m pip install --quiet --disable-pip-version-check --upgrade pip >&2
  "$PY" -m pip install --quiet --disable-pip-version-check gpustack==2.3.0 "pytest>=8,<10" "openai>=1.40,<3" >&2
  ready || { echo "gpustack-venv.sh: $VENV still lacks gpustack 2.3.0, pytest or openai" >&2; exit 1; }
fi
echo "$PY"
