#!/usr/bin/env python
"""What the HTTP server under ``ppipe serve`` costs to take in one large request body.

uvicorn as ``ppipe serve`` runs it (:func:`ppipe.runtime.ingress.http_transport.uvicorn_config`:
httptools, the whole-body hand-on, the serving allocator of
:func:`ppipe.runtime.memory.tune_for_serving`) in its own process, serving a null app that
reads each body with the frontend's :func:`~ppipe.runtime.ingress.bodies.read_body` and
answers its length. A client here posts bodies one at a time (ResNet-50's input, 0.6 MB,
and atss's, 12.8 MB, by default) over one keep-alive connection. Per size it prints the
server's CPU per request (``/proc``, user + system, over the measured requests) and the
round trip's median.

What it leaves out: decoding, scheduling and sending the tensor on (``bench_ingress.py``
measures a whole ingress); one request at a time, so no two bodies compete; the client
shares this host's cores.

    python scripts/bench_http_body.py [--sizes 602112,12845056] [--requests 2000,120]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import hostspeed  # noqa: E402
from bench_serve import process_cpu_s  # noqa: E402

SERVER = """
import sys
import uvicorn
from ppipe.runtime.ingress.bodies import read_body
from ppipe.runtime.ingress.http_transport import uvicorn_config
from ppipe.runtime.memory import tune_for_serving

async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    async def pieces():
        while True:
            msg = await receive()
            yield msg.get("body", b"")
            if not msg.get("more_body", False):
                return
    length = dict(scope["headers"]).get(b"content-length")
    body = await read_body(length.decode() if length else None, pieces(), 64 << 20, 30.0)
    out = str(len(body)).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(out)).encode())]})
    await send({"type": "http.response.body", "body": out})

tune_for_serving()
uvicorn.Server(uvicorn_config(app, "127.0.0.1", int(sys.argv[1]))).run()
"""


async def measure(url: str, pid: int, size: int, requests: int) -> tuple[float, float]:
    """(server CPU ms per request, round trip p50 ms) over ``requests`` posts of ``size`` bytes."""
    from ppipe.runtime.client.httpclient import RawHttpClient

    client, body = RawHttpClient(url), os.urandom(size)
    for _ in range(5):  # the connection, the allocator's first pages
        await client.request("POST", "/x", body)
    cpu0, rtts = process_cpu_s(pid), []
    for _ in range(requests):
        t0 = time.perf_counter()
        status, _, answer = await client.request("POST", "/x", body)
        rtts.append(time.perf_counter() - t0)
        if status != 200 or int(answer) != size:
            raise SystemExit(f"the server answered {status} {answer[:80]!r} to a body of {size} bytes")
    rtts.sort()
    return 1e3 * (process_cpu_s(pid) - cpu0) / requests, 1e3 * rtts[len(rtts) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="602112,12845056", help="body sizes, bytes")
    ap.add_argument("--requests", default="2000,120", help="measured requests per size")
    args = ap.parse_args()
    sizes, counts = [int(x) for x in args.sizes.split(",")], [int(x) for x in args.requests.split(",")]
    print(f"{hostspeed.host_line()}; load average {os.getloadavg()[0]:.2f}")
    from ppipe.runtime.client.httpclient import wait_until_ready

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(url, server, timeout_s=60)  # (the null app answers any path)
        for size, n in zip(sizes, counts):
            cpu_ms, rtt_ms = asyncio.run(measure(url, server.pid, size, n))
            print(f"{size / 1e6:6.2f} MB: server CPU {cpu_ms:.2f} ms per request ({size / cpu_ms / 1e6:.2f} GB/s of one core), "
                  f"round trip p50 {rtt_ms:.2f} ms, {n} requests")
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
