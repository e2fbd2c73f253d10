#!/usr/bin/env bash
# Renders the worker manifests of a Kubernetes cluster through the management API, for every GPU
# vendor alone, all of them together and CPU only, on a plain cluster and on one with every
# option (namespace, node selector, volume mounts, image credentials, helmValues), and validates
# each file against the Kubernetes schemas with `kubernetes-validate --strict` (from PyPI; its
# schemas ship with it, nothing is fetched). The test is control's
# `join::every_rendered_manifest_validates`; here it may not skip the validator.
#   scripts/validate-join.sh [DIR]    # DIR keeps the rendered files
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${FADEN_KUBERNETES_VALIDATE_VENV:-$HOME/.cache/faden/kubernetes-validate}"
if ! "$VENV/bin/kubernetes-validate" --version >/dev/null 2>&1; then
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check "kubernetes-validate>=1.31,<2"
fi
export PATH="$VENV/bin:$PATH" FADEN_REQUIRE_KUBERNETES_VALIDATE=1
if [ $# -gt 0 ]; then export FADEN_JOIN_MANIFESTS_DIR="$1"; fi
if ! cargo nextest --version >/dev/null 2>&1; then
  cargo install cargo-nextest --locked
fi
cargo nextest run --locked -p control --test api --no-capture \
  -E 'test(=join::every_rendered_manifest_validates)'
