# Helpers shared by the benchmark scripts (sourced).

# A free TCP port on 127.0.0.1.
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# Waits for "marker" in a log file and prints the value of key= on that line. Gives up after
# WAIT_TRIES tenths of a second (default 300), printing the log.
wait_for() {
  local log=$1 marker=$2 key=$3
  for _ in $(seq 1 "${WAIT_TRIES:-300}"); do
    if line=$(grep -m1 "$marker" "$log" 2>/dev/null); then
      sed -n "s/.*$key=\([^ ]*\).*/\1/p" <<<"$line"; return 0
    fi
    sleep 0.1
  done
  echo "timed out waiting for '$marker' in $log" >&2; cat "$log" >&2; exit 1
}

# Summed over the given processes and all their threads: voluntary and involuntary context
# switches, user and system CPU ticks, minor page faults, CPU time in nanoseconds, and the
# scheduler's moves of a thread to another CPU ("vol invol user system minflt exec_ns migr";
# migr from /proc/PID/task/TID/sched, 0 where the kernel does not show it). The ticks come in
# 1/CLK_TCK s (10 ms here): a round with few ticks (a stream-per-round load at c=1 runs about
# 15) is quantised by several per cent. exec_ns is the scheduler's own run time of each live thread (/proc/PID/task/TID/
# schedstat, user and system together), exact to the nanosecond; it misses threads that
# exited between the two reads, which the proxies here do not start during a round.
proc_stats() {
  local v=0 n=0 u=0 s=0 m=0 e=0 g=0 f st run
  for pid in "$@"; do
    for f in /proc/"$pid"/task/*/status; do
      v=$((v + $(awk '/^voluntary_ctxt_switches/ {print $2}' "$f")))
      n=$((n + $(awk '/^nonvoluntary_ctxt_switches/ {print $2}' "$f")))
    done
    for f in /proc/"$pid"/task/*/sched; do
      [ -r "$f" ] && g=$((g + $(awk '/^se.nr_migrations/ {print $3; exit}' "$f")))
    done
    for f in /proc/"$pid"/task/*/schedstat; do
      read -r run _ < "$f"; e=$((e + run))
    done
    read -r -a st < /proc/"$pid"/stat; u=$((u + st[13])); s=$((s + st[14])); m=$((m + st[9]))
  done
  echo "$v $n $u $s $m $e $g"
}

# The host's CPU time so far, in ticks: "steal total" (the `cpu` line of /proc/stat: steal is
# time the hypervisor gave this VM's CPUs to others, total the first eight fields summed).
cpu_ticks() {
  local _ f st=0 total=0 i=0
  read -r _ f < /proc/stat
  # user nice system idle iowait irq softirq steal (guest time is already in user and nice)
  for t in $f; do i=$((i + 1)); [ $i -le 8 ] && total=$((total + t)); [ $i = 8 ] && st=$t; done
  echo "$st $total"
}

# Steal as a per cent of the host's CPU time between two cpu_ticks readings:
# steal_pct "S0 T0" "S1 T1". Shown beside each round, so that a round the hypervisor disturbed
# can be told from a slow proxy.
steal_pct() {
  local s0 t0 s1 t1
  read -r s0 t0 <<<"$1"; read -r s1 t1 <<<"$2"
  python3 -c "print(round(100 * ($s1 - $s0) / max(1, $t1 - $t0), 1))"
}

# Exits with 2, naming it, unless every given command (or executable path) is there.
require_tools() {
  local tool
  for tool in "$@"; do
    command -v "$tool" >/dev/null || { echo "missing $tool" >&2; exit 2; }
  done
}

# A scratch directory WORK (/tmp/NAME.XXXXXX) and an empty PIDS array for the script's
# processes; at exit every process in PIDS (and an nginx whose pid file is in WORK) is killed
# and WORK removed.
start_work() {
  WORK=$(mktemp -d "/tmp/$1.XXXXXX"); PIDS=()
  trap 'for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done; [ -f "$WORK/nginx.pid" ] && kill "$(cat "$WORK/nginx.pid")" 2>/dev/null; wait 2>/dev/null; rm -rf "$WORK"' EXIT
}

# One target of one round in a round-based script: a 1 s warm-up of COMMAND (a faden-loadtest
# command line without --duration), then DUR seconds of it with the given processes' counters
# read before and after; prints the line of benches/tools/loadtest_line.py (WHAT: latency, or
# ttft for streams) with the host's steal time during the run appended (`steal%=`).
# Usage: loadtest_round TARGET CONNS WHAT "PIDS" COMMAND...
loadtest_round() {
  local target=$1 conns=$2 what=$3 pids=$4 v0 n0 u0 s0 e0 g0 v1 n1 u1 s1 e1 g1 _
  shift 4
  "$@" --duration 1s > /dev/null 2>&1
  local k0 k1
  k0=$(cpu_ticks)
  read -r v0 n0 u0 s0 _ e0 g0 <<<"$(proc_stats $pids)"
  "$@" --duration "${DUR}s" --json "$WORK/lt.json" > /dev/null 2>&1
  read -r v1 n1 u1 s1 _ e1 g1 <<<"$(proc_stats $pids)"
  k1=$(cpu_ticks)
  echo "$(python3 benches/tools/loadtest_line.py "$WORK/lt.json" "$target" "$conns" $((v1 - v0)) $((n1 - n0)) \
    $((u1 - u0)) $((s1 - s0)) "$(getconf CLK_TCK)" "$what" $((e1 - e0)) $((g1 - g0))) steal%=$(steal_pct "$k0" "$k1")"
}
