#!/usr/bin/env python3
"""Hold N idle HTTP/1.1 keep-alive connections open against one server (stdlib asyncio).

Each connection sends one GET request with keep-alive and reads the whole answer, so the server
has seen a complete request and holds a real, idle keep-alive connection (not just an accepted
socket). Once all are open it creates --ready-file (the caller reads the server's RSS then),
holds them --hold seconds, counts how many the server closed meanwhile, prints one JSON line and
closes them all.

Usage: idle_conns.py --port P [--host H] [-n 10000] [--path /v1/models]
                     [--header 'Authorization: Bearer K'] [--hold 5] [--ready-file F]
Needs an fd limit above N (ulimit -n).
"""
import argparse
import asyncio
import json
import os
import resource
import sys
import time


async def open_one(host, port, request, timeout):
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    writer.write(request)
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip().lower()
    if "content-length" in headers:
        await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), timeout)
    elif headers.get("transfer-encoding") == "chunked":
        while True:
            size = int((await asyncio.wait_for(reader.readline(), timeout)).split(b";")[0], 16)
            await asyncio.wait_for(reader.readexactly(size + 2), timeout)
            if size == 0:
                break
    keep_alive = headers.get("connection") != "close"
    return reader, writer, status, keep_alive


async def main():
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("-n", type=int, default=10000)
    p.add_argument("--path", default="/")
    p.add_argument("--header", action="append", default=[])
    p.add_argument("--hold", type=float, default=5.0)
    p.add_argument("--ready-file")
    p.add_argument("--parallel", type=int, default=256, help="connections being opened at once")
    p.add_argument("--timeout", type=float, default=20.0)
    a = p.parse_args()

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < a.n + 64:
        print(f"warning: fd limit {soft} is below {a.n} connections", file=sys.stderr)
    extra = "".join(f"{h}\r\n" for h in a.header)
    request = (f"GET {a.path} HTTP/1.1\r\nHost: {a.host}:{a.port}\r\n{extra}"
               "Connection: keep-alive\r\n\r\n").encode()

    conns, failures, statuses, not_keep_alive = [], {}, {}, 0
    sem = asyncio.Semaphore(a.parallel)

    async def guarded():
        nonlocal not_keep_alive
        async with sem:
            try:
                r, w, status, ka = await open_one(a.host, a.port, request, a.timeout)
            except Exception as e:  # noqa: BLE001 - counted and reported
                name = type(e).__name__
                failures[name] = failures.get(name, 0) + 1
                return
            statuses[status] = statuses.get(status, 0) + 1
            not_keep_alive += 0 if ka else 1
            conns.append((r, w))

    t0 = time.monotonic()
    await asyncio.gather(*(guarded() for _ in range(a.n)))
    open_s = time.monotonic() - t0
    if a.ready_file:
        with open(a.ready_file, "w") as f:
            f.write(f"{len(conns)}\n")
    await asyncio.sleep(a.hold)
    still_open = sum(1 for r, w in conns if not r.at_eof() and not w.is_closing())
    print(json.dumps({
        "mode": "one GET per connection, then idle keep-alive",
        "requested": a.n, "opened": len(conns), "statuses": statuses, "failures": failures,
        "not_keep_alive": not_keep_alive, "still_open_after_hold": still_open,
        "hold_s": a.hold, "open_s": round(open_s, 2), "client_fd_limit": soft,
    }))
    sys.stdout.flush()
    for _, w in conns:
        w.close()
    # Do not wait for every close handshake; the process exit closes the rest.
    os._exit(0)


if __name__ == "__main__":
    asyncio.run(main())
