#!/usr/bin/env bash
# Runs every fuzz target in turn for $SECS seconds (default 600), one at a time (minimise the
# corpora afterwards with minimise.sh). Logs go to fuzz/logs/<target>.log.
# Usage: fuzz/run-all.sh [target...]
set -u
cd "$(dirname "$0")"
SECS=${SECS:-600}
mkdir -p logs
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    mapfile -t targets < <(cargo +nightly fuzz list)
fi
for t in "${targets[@]}"; do
    echo "== $t ($(date -u +%H:%M:%S))"
    cargo +nightly fuzz run "$t" -- -max_total_time="$SECS" -jobs=1 -workers=1 -rss_limit_mb=2048 \
        -print_final_stats=1 > "logs/$t.log" 2>&1
    echo "   exit $? ($(date -u +%H:%M:%S))"
    # With -jobs, libFuzzer runs the fuzzing in a child process that logs to fuzz-0.log.
    [ -f fuzz-0.log ] && mv fuzz-0.log "logs/$t.job.log" && cat "logs/$t.job.log" >> "logs/$t.log"
    grep -E '^#[0-9]+.*(DONE|pulse|NEW|REDUCE)' "logs/$t.log" | tail -1
    grep -E 'stat::|Done [0-9]+ runs' "logs/$t.log"
done
