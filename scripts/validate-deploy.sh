#!/usr/bin/env bash
# Validates every file under deploy/ offline (docs/deploy.md#how-deploy-is-checked):
#   - the Kubernetes manifests against the Kubernetes API schemas (kubernetes-validate --strict:
#     an unknown or misspelt field is an error), for 1.30 (the oldest supported: preStop `sleep`)
#     and for the newest the validator knows;
#   - the ServiceMonitor (a Prometheus Operator CRD, not in those schemas) against
#     deploy/schemas/servicemonitor.schema.json;
#   - the compose file against the compose specification's schema (check-jsonschema's copy);
#   - the systemd units with `systemd-analyze verify` and `systemd-analyze security --offline`
#     (exposure at most 2.0), with the faden binary at the path the units name
#     (/usr/local/bin/faden, in a private mount namespace);
#   - what the schemas cannot see (scripts/validate-deploy.py): selectors, port names, probes,
#     hardening, grace periods, and every faden flag and variable against the binary's --help.
# Usage: scripts/validate-deploy.sh [FADEN_BINARY]   (default: target/debug/faden)
set -euo pipefail
cd "$(dirname "$0")/.."

BIN=$(realpath "${1:-${FADEN_BIN:-target/debug/faden}}")
[ -x "$BIN" ] || { echo "validate-deploy.sh: no faden binary at $BIN (cargo build -p faden)" >&2; exit 1; }

if ! command -v systemd-analyze >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq systemd >/dev/null
fi
python3 -m pip install --quiet --disable-pip-version-check -r scripts/validate-deploy.requirements.txt

mapfile -t manifests < <(find deploy/kubernetes -name '*.yaml' -not -path '*/monitoring/*' | sort)
for k in 1.30.0 ""; do
  kubernetes-validate --strict --quiet ${k:+-k "$k"} "${manifests[@]}"
done
echo "Kubernetes schemas (1.30 and newest): ${#manifests[@]} files passed"

check-jsonschema --schemafile deploy/schemas/servicemonitor.schema.json deploy/kubernetes/monitoring/*.yaml
check-jsonschema --builtin-schema vendor.compose-spec deploy/compose/compose.yaml

# systemd-analyze verify checks that ExecStart's binary exists: put it there in a mount namespace
# of its own, so that nothing is installed on this machine. Warnings count as failures.
out=$(unshare --mount --propagation private bash -c '
  mount -t tmpfs tmpfs /usr/local/bin && ln -s "$1" /usr/local/bin/faden
  systemd-analyze verify deploy/systemd/*.service 2>&1
  # The hardening, scored as on a host: 0 (locked down) to 10 (unprotected); above 2 fails.
  for unit in deploy/systemd/*.service; do
    systemd-analyze security --offline=true --threshold=20 --no-pager "$unit" >/dev/null 2>&1 ||
      systemd-analyze security --offline=true --no-pager "$unit" 2>&1 | tail -n 1
  done' _ "$BIN") || { echo "$out" >&2; exit 1; }
if [ -n "$out" ]; then echo "$out" >&2; exit 1; fi
echo "systemd-analyze verify: $(ls deploy/systemd/*.service | wc -l) units passed"

python3 scripts/validate-deploy.py "$BIN"
