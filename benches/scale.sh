#!/usr/bin/env bash
# faden's gateway as cores are added, beside nginx: for each N, the server's request-serving
# cores (`--worker-threads N`) and nginx's worker processes (`worker_processes N`) in front of
# the same mock engine, wrk POST chat completion at 256 connections, faden's direct path,
# nginx and faden's tunnel path in interleaved rounds (benches/quick_vs_nginx.sh with
# PROXY_THREADS=N TUNNEL=1). Then one table: per N, the medians of req/s and CPU per request,
# faden / nginx ratios, and faden's CPU per request against its own at the smallest N.
#
# Usage: benches/scale.sh [SECONDS]        (default 5 s per target and round)
#   NS="1 2 4 6"  core counts (default: 1 2, and 4 6 where the host has 16 CPUs or more)
#   ROUNDS=N      rounds per core count (default 4)
#   CONNS=C       wrk connections (default 256)
#   OUT=dir       where the rounds and the table go (default a new /tmp/scale.XXXXXX)
#   FADEN=path    binary (default target/release/faden)
# Where the host has at least N + 4 CPUs the proxies are pinned to CPUs 0..N-1 and everything
# else (wrk with 4 threads, the engines, the workers) to the rest; on a smaller host nothing is
# pinned and wrk runs one thread, so the proxies share the CPUs with the load: the table says
# which. Loopback only; everything started is killed on exit. About NS x ROUNDS x 3 x (SECONDS
# + 1) seconds plus 5 s of setup per N.
set -u
cd "$(dirname "$0")/.."
DUR=${1:-5}
CPUS=$(nproc)
NS=${NS:-$([ "$CPUS" -ge 16 ] && echo "1 2 4 6" || echo "1 2")}
OUT=${OUT:-$(mktemp -d /tmp/scale.XXXXXX)}; mkdir -p "$OUT"
echo "host: $CPUS CPUs,$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2); $( "${FADEN:-target/release/faden}" --version 2>&1 | head -1)" | tee "$OUT/host.txt"
for n in $NS; do
  if [ "$CPUS" -ge $((n + 4)) ]; then
    export PIN_CPUS=0-$((n - 1)) LOAD_CPUS=$n-$((CPUS - 1)) WRKT=4
  else
    unset PIN_CPUS LOAD_CPUS; export WRKT=1
  fi
  echo "== N=$n"
  PROXY_THREADS=$n TUNNEL=1 ROUNDS=${ROUNDS:-4} ROUNDS_OUT="$OUT/rounds-n$n.txt" \
    benches/quick_vs_nginx.sh "$DUR" "${CONNS:-256}" > "$OUT/n$n.log" 2>&1 || { cat "$OUT/n$n.log"; exit 1; }
  tail -n +2 "$OUT/n$n.log" | head -n $((${ROUNDS:-4} * 3))
done
python3 benches/tools/scale_table.py "$OUT" | tee "$OUT/table.md"
