"""Shared fixture: a real `faden up` (gateway + embedded worker + mock engine) on ephemeral
ports, stopped with SIGTERM at the end (it must exit cleanly)."""

import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TARGET = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "debug"
BINARY = Path(os.environ.get("FADEN_BIN", TARGET / "faden"))
LOADTEST = Path(os.environ.get("FADEN_LOADTEST_BIN", TARGET / "faden-loadtest"))


@pytest.fixture(scope="session")
def faden():
    data_dir = tempfile.mkdtemp(prefix="faden-py-")
    try:
        yield from _run_faden(data_dir)
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)


def _run_faden(data_dir):
    env = dict(os.environ, FADEN_LOG="info", FADEN_MOCK_ITL="5ms")
    env.pop("FADEN_ADMIN_KEY", None)
    proc = subprocess.Popen(
        [str(BINARY), "up", "--data-dir", data_dir, "--host", "127.0.0.1", "--api-port", "0", "--port", "0", "--proxy-port", "0"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    gateway = None
    log = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        log.append(line)
        if "faden up ready" in line:
            gateway = re.search(r"gateway=(\S+)", line).group(1)
            break
    if gateway is None:
        proc.kill()
        pytest.fail("faden up did not start:\n" + "".join(log))
    key = (Path(data_dir) / "inference.key").read_text().strip()
    yield {"base_url": f"http://{gateway}/v1", "key": key}
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("faden did not exit within 20 s of SIGTERM")
    assert proc.returncode == 0, f"exit code {proc.returncode}"


