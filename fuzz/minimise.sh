#!/usr/bin/env bash
# Minimises corpus/<target> for committing: a set-cover merge on edge coverage (hit counts
# ignored), then at most $MAX files (the smallest) are kept. Prints the coverage the kept
# corpus reaches. Usage: fuzz/minimise.sh <target>...
set -eu
cd "$(dirname "$0")"
MAX=${MAX:-200}
bin=${CARGO_TARGET_DIR:-target}/x86_64-unknown-linux-gnu/release
for t in "$@"; do
    tmp=$(mktemp -d)
    "$bin/$t" -set_cover_merge=1 -use_counters=0 "$tmp" "corpus/$t" > "logs/minimise-$t.log" 2>&1
    ls -S -r "$tmp" | tail -n +$((MAX + 1)) | sed "s|^|$tmp/|" | xargs -r rm -f
    # Never replace a corpus with a broken merge (say, files cut short by a full disk).
    if [ -z "$(ls "$tmp")" ] || [ -n "$(find "$tmp" -type f -empty)" ]; then
        echo "$t: merge output empty or with empty files, corpus left as it was" >&2
        rm -rf "$tmp"
        continue
    fi
    rm -rf "corpus/$t" && mv "$tmp" "corpus/$t" && chmod 755 "corpus/$t"
    kept=$(ls "corpus/$t" | wc -l)
    cov=$("$bin/$t" -runs=0 "corpus/$t" 2>&1 | grep -E 'INITED' | sed -E 's/.*(cov: [0-9]+ ft: [0-9]+).*/\1/')
    echo "$t: $kept files, $(du -sh "corpus/$t" | cut -f1), replayed: $cov"
done
