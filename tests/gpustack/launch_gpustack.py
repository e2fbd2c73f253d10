"""Runs `gpustack start ...` (GPUStack 2.3.0 or 2.2.3) with every listening socket on 127.0.0.1.

With `--gateway-mode disabled` GPUStack binds its API and metrics servers (uvicorn) and its tunnel
proxy port (asyncio.start_server) to 0.0.0.0 and has no `--host` flag. This launcher patches the
two places that choose the address, then calls `gpustack.main.main()` with the arguments it was
given:
- `uvicorn.Config`: a wildcard host becomes 127.0.0.1 (API port, metrics port);
- `Config.get_proxy_listen_address`: 127.0.0.1 (proxy port; the tunnel's `proxy_address` that the
  server writes into `worker.proxy_address` is derived from it: `http://127.0.0.1:<proxy port>`).

It skips `ToolsManager.prepare_tools`, which downloads gguf-parser and fastfetch from GitHub
before a worker starts (offline here; the worker uses them to size GGUF models and to describe
its host, neither of which these tests need).

It also exits (kills its process group) when the process named by $FADEN_HARNESS_PARENT dies.

Usage: python launch_gpustack.py start --data-dir D --api-port P ... (as `gpustack`).
"""

import sys

LOOPBACK = "127.0.0.1"
WILDCARDS = {None, "", "0.0.0.0", "::", "[::]"}


def patch():
    import uvicorn
    import uvicorn.config

    original_init = uvicorn.Config.__init__

    def init(self, app, *args, **kwargs):
        if kwargs.get("host") in WILDCARDS or "host" not in kwargs:
            kwargs["host"] = LOOPBACK
        original_init(self, app, *args, **kwargs)

    uvicorn.Config.__init__ = init
    uvicorn.config.Config.__init__ = init

    from gpustack.config.config import Config

    Config.get_proxy_listen_address = lambda self, default="0.0.0.0": LOOPBACK

    from gpustack.worker.tools_manager import ToolsManager

    ToolsManager.prepare_tools = lambda self: None


def watch_parent():
    """With FADEN_HARNESS_PARENT=<pid> (set by harness.GPUStackServer): when that process dies
    (pytest killed, say), kill this process group, so no GPUStack outlives its test run."""
    import os
    import signal
    import threading
    import time

    parent = int(os.environ.get("FADEN_HARNESS_PARENT") or 0)
    if not parent:
        return

    def watch():
        while os.getppid() == parent:
            time.sleep(1)
        os.killpg(os.getpgid(0), signal.SIGKILL)

    threading.Thread(target=watch, name="faden-harness-parent-watch", daemon=True).start()


def main():
    watch_parent()
    patch()
    from multiprocessing import freeze_support

    import gpustack.main

    freeze_support()
    sys.argv = ["gpustack", *sys.argv[1:]]
    gpustack.main.main()


if __name__ == "__main__":
    main()
