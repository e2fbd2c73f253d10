"""CPU time of processes from /proc, for the side-by-side scripts in benches/."""

import os
from pathlib import Path

# Clock ticks per second: the unit of /proc/<pid>/stat's times.
TCK = os.sysconf("SC_CLK_TCK")


def ticks(pids) -> int:
    """User + system ticks of `pids` so far (processes that are gone count 0)."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total
