"""Shared fixture: a real `faden up` (gateway + embedded worker + mock engine) on ephemeral
ports, stopped with SIGTERM at the end (it must exit cleanly)."""

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import faden_harness  # noqa: E402

BINARY = faden_harness.built_binary("faden", "FADEN_BIN")
LOADTEST = faden_harness.built_binary("faden-loadtest", "FADEN_LOADTEST_BIN")


@pytest.fixture(scope="session")
def faden():
    data_dir = Path(tempfile.mkdtemp(prefix="faden-py-"))
    env = dict(os.environ, FADEN_LOG="info", FADEN_MOCK_ITL="5ms")
    env.pop("FADEN_ADMIN_KEY", None)
    up = faden_harness.Process(
        [BINARY, "up", "--data-dir", data_dir / "data", "--host", "127.0.0.1", "--api-port", "0", "--port", "0",
         "--proxy-port", "0"],
        data_dir / "up.log", env=env)
    try:
        line = up.wait_line("faden up ready", 60, "faden up")
        gateway = faden_harness.log_field(line, "gateway")
        key = (data_dir / "data" / "inference.key").read_text().strip()
        yield {"base_url": f"http://{gateway}/v1", "key": key}
        code = up.stop(timeout=20)
        assert code is not None, "faden did not exit within 20 s of SIGTERM"
        assert code == 0, f"exit code {code}:\n{up.log_tail()}"
    finally:
        up.stop()
        shutil.rmtree(data_dir, ignore_errors=True)
