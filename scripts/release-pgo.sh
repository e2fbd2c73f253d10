#!/usr/bin/env bash
# Profile-guided release build of the `faden` binary.
#
#   1. build faden instrumented (-Cprofile-generate) in $PGO_DIR/gen;
#   2. train it: benches/compare.sh's http, tiny, relay and sse sections, a few seconds each, run
#      against the instrumented binary: the direct, worker and tunnel paths, plain and streamed
#      answers, the tunnel alone (loopback only, bounded; the mock engines stay uninstrumented so
#      that only faden's own serving is in the profile);
#   3. merge the profiles with the toolchain's own llvm-profdata (rustup component llvm-tools;
#      the system's llvm-profdata reads another LLVM's format);
#   4. build faden again with -Cprofile-use in $PGO_DIR/use.
#
# The result is $PGO_DIR/bin: the profile-guided faden beside the plain release builds of
# faden-loadtest, faden-mock-engine and faden-bench-plot, so that
#   BIN_DIR=$PGO_DIR/bin benches/compare.sh ...
#   FADEN=$PGO_DIR/bin/faden benches/quick_vs_nginx.sh ...
# measure it with the same load generator as the plain build. Profile data changes nothing the
# program does, only where the compiler puts code (hot paths together, cold branches out of
# line) and what it inlines; docs/performance.md has the figures.
#
# Usage: scripts/release-pgo.sh            (about 25 minutes on 2 cores, most of it compiling)
#   PGO_DIR=dir          work and output directory (default: target/pgo)
#   TRAIN_SECONDS=N      seconds per training run (default 3)
# Needs what benches/compare.sh needs (wrk, nginx, haproxy, python3, curl).
set -euo pipefail
cd "$(dirname "$0")/.."
{ # (read whole before running: an edit to this file while it runs does not change the run)
PGO_DIR=$(mkdir -p "${PGO_DIR:-target/pgo}" && cd "${PGO_DIR:-target/pgo}" && pwd)
PLAIN=$(mkdir -p "${CARGO_TARGET_DIR:-target}" && cd "${CARGO_TARGET_DIR:-target}" && pwd)/release
DATA=$PGO_DIR/profiles

HOST=$(rustc -vV | sed -n 's/^host: //p')
PROFDATA=$(rustc --print sysroot)/lib/rustlib/$HOST/bin/llvm-profdata
if [ ! -x "$PROFDATA" ]; then
  echo "== installing llvm-tools (llvm-profdata matching rustc's LLVM)"
  rustup component add llvm-tools
fi

echo "== plain release build (the load generator and the mock engines)"
cargo build --release --locked -p faden -p faden-loadtest -p faden-bench-plot 2>&1 | tail -1

echo "== instrumented build"
RUSTFLAGS="${RUSTFLAGS:-} -Cprofile-generate=$DATA" CARGO_TARGET_DIR=$PGO_DIR/gen \
  cargo build --release --locked -p faden 2>&1 | tail -1
# Build scripts and proc macros are instrumented too and write their own profiles while the
# build runs: only the training's count.
rm -rf "$DATA"

echo "== training"
TRAIN=$PGO_DIR/train
rm -rf "$TRAIN" && mkdir -p "$TRAIN"
cat >"$TRAIN/faden" <<EOF
#!/bin/sh
# The mock engine stays plain; everything else runs instrumented.
[ "\${1:-}" = mock-engine ] && exec "$PLAIN/faden" "\$@"
exec "$PGO_DIR/gen/release/faden" "\$@"
EOF
chmod +x "$TRAIN/faden"
for b in faden-loadtest faden-mock-engine faden-bench-plot; do ln -s "$PLAIN/$b" "$TRAIN/$b"; done
T=${TRAIN_SECONDS:-3}
BIN_DIR=$TRAIN benches/compare.sh -d "$T" -s "$T" -O http,tiny,relay,sse >"$PGO_DIR/train.log" 2>&1 \
  || { tail -20 "$PGO_DIR/train.log" >&2; exit 1; }
ls "$DATA"/*.profraw >/dev/null 2>&1 || { echo "no profiles written to $DATA" >&2; exit 1; }
echo "   $(ls "$DATA"/*.profraw | wc -l) profiles (log: $PGO_DIR/train.log)"
"$PROFDATA" merge -o "$PGO_DIR/merged.profdata" "$DATA"
# cargo does not watch the profile's content, only the flags: a name that changes with the
# content makes a new training rebuild everything that uses it.
PROFILE=$PGO_DIR/faden-$(sha256sum "$PGO_DIR/merged.profdata" | cut -c1-16).profdata
mv "$PGO_DIR/merged.profdata" "$PROFILE"

echo "== profile-guided build"
RUSTFLAGS="${RUSTFLAGS:-} -Cprofile-use=$PROFILE" CARGO_TARGET_DIR=$PGO_DIR/use \
  cargo build --release --locked -p faden 2>&1 | tail -1

mkdir -p "$PGO_DIR/bin"
cp "$PGO_DIR/use/release/faden" "$PGO_DIR/bin/faden"
for b in faden-loadtest faden-mock-engine faden-bench-plot; do ln -sf "$PLAIN/$b" "$PGO_DIR/bin/$b"; done
echo "== done: $PGO_DIR/bin/faden"
exit
}
