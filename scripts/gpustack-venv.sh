#!/usr/bin/env bash
# Makes sure a Python venv with a real GPUStack (plus pytest and openai) exists, for the interop
# tests in tests/gpustack/, and prints the venv's python path as its last line:
#   PY=$(scripts/gpustack-venv.sh | tail -n1) && "$PY" -m pytest -q tests/gpustack
# FADEN_GPUSTACK_VERSION picks the release: 2.3.0 (default) or 2.2.3; each has its own venv,
# ~/.cache/faden/gpustack-<version> (FADEN_GPUSTACK_VENV overrides the path).
# Idempotent: does nothing when the venv already has that gpustack, pytest and openai.
# Needs only PyPI (~80 s, ~900 MB per version on first run). GPUStack supports Python 3.10-3.12:
# set FADEN_GPUSTACK_PYTHON (e.g. python3.11) when the default python3 is another version.
set -euo pipefail
VERSION="${FADEN_GPUSTACK_VERSION:-2.3.0}"
VENV="${FADEN_GPUSTACK_VENV:-$HOME/.cache/faden/gpustack-$VERSION}"
PY="$VENV/bin/python"

# What a release needs beyond its own requirements. 2.3.0 caps SQLAlchemy below 2.1 itself; 2.2.3
# does not, and with 2.1 a `postgresql://` URL means psycopg 3, which GPUStack does not install:
# its migrations fail with "No module named 'psycopg'".
case "$VERSION" in
  2.2.*) PINS=("sqlalchemy<2.1") ;;
  *) PINS=() ;;
esac

ready() {
  "$PY" - "$VERSION" <<'EOF' 2>/dev/null
import importlib.metadata as m
import sys
assert m.version("gpustack") == sys.argv[1]
assert m.version("sqlalchemy").startswith("2.0.")
import pytest, openai  # noqa: F401
EOF
}

if ! ready; then
  # A venv that exists but is unusable (other gpustack version, broken python) is made anew.
  [ -x "$PY" ] && "$PY" -c 'import sys' 2>/dev/null || rm -rf "$VENV"
  [ -x "$PY" ] || "${FADEN_GPUSTACK_PYTHON:-python3}" -m venv "$VENV"
  "$PY" -m pip install --quiet --disable-pip-version-check --upgrade pip >&2
  "$PY" -m pip install --quiet --disable-pip-version-check "gpustack==$VERSION" ${PINS[@]+"${PINS[@]}"} \
    "pytest>=8,<10" "openai>=1.40,<3" >&2
  ready || { echo "gpustack-venv.sh: $VENV still lacks gpustack $VERSION, SQLAlchemy 2.0, pytest or openai" >&2; exit 1; }
fi
echo "$PY"
