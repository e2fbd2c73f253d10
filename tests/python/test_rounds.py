"""benches/tools/rounds.py: the confidence interval it prints beside each median."""

import importlib.util
import math
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("rounds", ROOT / "benches/tools/rounds.py")
rounds = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rounds)


def coverage(n, k):
    return 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2**n


def test_too_few_rounds_have_no_interval():
    # Five rounds: even the extremes cover the median with 1 - 2/32 = 93.75 % only.
    assert rounds.median_interval([1.0, 2.0, 3.0, 4.0, 5.0]) is None


def test_six_rounds_take_the_extremes():
    assert coverage(6, 1) >= 0.95 > coverage(6, 2)
    assert rounds.median_interval([0.9, 1.3, 1.0, 0.8, 1.1, 1.2]) == (0.8, 1.3)


def test_the_widest_k_that_still_covers_is_chosen():
    # Twelve rounds: k = 3 covers 96.1 %, k = 4 only 85.4 %.
    assert coverage(12, 3) >= 0.95 > coverage(12, 4)
    values = [float(v) for v in range(12, 0, -1)]
    assert rounds.median_interval(values) == (3.0, 10.0)


def test_the_interval_holds_the_median():
    values = [0.97, 1.02, 0.88, 1.11, 0.95, 1.05, 0.99, 1.20, 0.91]
    lo, hi = rounds.median_interval(values)
    assert lo <= sorted(values)[4] <= hi
    assert rounds.interval_text(values, "{:.2f}") == f" [{lo:.2f}, {hi:.2f}]"


def test_steal_is_no_ratio_and_disturbed_rounds_are_named(tmp_path, capsys):
    lines = []
    for i, (steal_a, steal_b) in enumerate([(0.1, 0.0), (3.5, 0.4), (0.2, 2.6)]):
        lines.append(f"a c=64 req/s={100 + i} cpu_us/req=10 steal%={steal_a}")
        lines.append(f"b c=64 req/s=100 cpu_us/req=10 steal%={steal_b}")
    path = tmp_path / "rounds.txt"
    path.write_text("\n".join(lines) + "\n")
    import sys

    argv, sys.argv = sys.argv, ["rounds.py", str(path), "a", "b"]
    try:
        rounds.main()
    finally:
        sys.argv = argv
    out = capsys.readouterr().out.splitlines()
    assert "steal" not in out[0]  # no ratio of steal among the medians
    assert "req/s 1.01" in out[0]
    # Per round the larger of the two sides: 0.1, 3.5, 2.6.
    assert out[1] == "c=64: steal time per round, median 2.6 %, max 3.5 %; over 2 % in rounds 2 3"


def run_main(path, *targets, env=None, monkeypatch=None):
    import sys

    if env is not None:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
    argv, sys.argv = sys.argv, ["rounds.py", str(path), *targets]
    try:
        rounds.main()
    finally:
        sys.argv = argv


def test_max_steal_prints_the_medians_again_without_the_disturbed_rounds(
    tmp_path, capsys, monkeypatch
):
    # Six rounds; in rounds 2 and 5 a target (the baseline's in round 5) lost time to the
    # hypervisor, and there faden's CPU ratio is 2.0 instead of 1.0.
    steals = [
        (0.1, 0.0, 0.0),
        (9.0, 0.4, 0.0),
        (0.2, 0.5, 0.0),
        (0.0, 0.0, 0.3),
        (0.1, 0.1, 4.0),
        (0.0, 0.2, 0.1),
    ]
    lines = []
    for i, (sa, sb, sd) in enumerate(steals):
        cpu = 20 if i in (1, 4) else 10
        lines.append(f"direct c=1 p50_us=100 p99_us=200 cpu_us/req=5 steal%={sd}")
        lines.append(f"a c=1 p50_us=150 p99_us=300 cpu_us/req={cpu} steal%={sa}")
        lines.append(f"b c=1 p50_us=140 p99_us=260 cpu_us/req=10 steal%={sb}")
    path = tmp_path / "rounds.txt"
    path.write_text("\n".join(lines) + "\n")
    run_main(path, "a", "b", "direct", env={"MAX_STEAL": "2"}, monkeypatch=monkeypatch)
    out = capsys.readouterr().out.splitlines()
    # All six rounds first, as without MAX_STEAL.
    assert out[0].startswith("c=1 rounds=6: a / b")
    assert "(1.00 2.00 1.00 1.00 2.00 1.00)" in out[0]
    kept = [l for l in out if "with steal <= 2 %" in l]
    assert kept[0].startswith("c=1 rounds=4 with steal <= 2 % (left out: rounds 2 5): a / b")
    assert "cpu_us/req 1.00" in kept[0] and "(1.00 1.00 1.00 1.00)" in kept[0]
    assert "a +50 us" in kept[1] and "b +40 us" in kept[1]


def test_max_steal_says_so_when_no_round_was_disturbed(tmp_path, capsys, monkeypatch):
    lines = [f"a c=64 req/s=100 steal%=0.1\nb c=64 req/s=100 steal%=0.0" for _ in range(3)]
    path = tmp_path / "rounds.txt"
    path.write_text("\n".join(lines) + "\n")
    run_main(path, "a", "b", env={"MAX_STEAL": "2"}, monkeypatch=monkeypatch)
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "c=64: no round over MAX_STEAL=2 %"
