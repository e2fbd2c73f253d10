"""A short smoke run of `faden-loadtest` against `faden up`: bounded in time, every request
answered, the JSON report readable."""

import json
import subprocess
import tempfile
from pathlib import Path

from conftest import LOADTEST


def run(faden, *extra):
    with tempfile.TemporaryDirectory(prefix="faden-lt-") as tmp:
        out = Path(tmp) / "report.json"
        proc = subprocess.run(
            [str(LOADTEST), "--url", faden["base_url"], "--api-key", faden["key"], "--model", "demo",
             "--duration", "3s", "--json", str(out), "--no-progress", *extra],
            capture_output=True, text=True, timeout=60,
        )
        assert proc.returncode == 0, proc.stderr + proc.stdout
        return json.loads(out.read_text()), proc.stdout


def test_closed_loop_streaming_smoke(faden):
    report, text = run(faden, "--concurrency", "4", "--stream")
    assert "ttft" in text, text
    assert report["ok"] > 0 and report["error_total"] == 0, report
    assert report["output_tokens"] > 0


def test_open_loop_smoke(faden):
    report, _ = run(faden, "--rate", "50")
    assert report["ok"] > 0 and report["error_total"] == 0, report
    assert report["sent"] <= 50 * 3 + 5
