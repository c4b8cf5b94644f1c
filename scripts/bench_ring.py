#!/usr/bin/env python
"""Feature maps between two processes on this host: the host staging ring against a TCP socket.

``ppipe serve --transport ring`` puts two host workers of one server on a shared-memory
ring (:mod:`ppipe.runtime.workers.ring_link`, kind ``host``) instead of the data path's TCP
connection. This measures, for fp16 maps of a few sizes, the latency from "send" to the
receiver's acknowledgement that the map is complete in its memory:

* ``ring``: an :class:`~ppipe.runtime.workers.transport.EdgeChannel` over a host ``RingLink``
  (header, chunks through the ring, credits), as the workers use it
  (``scripts/gpu_check.py``'s ``ring_handoff`` on the CPU);
* ``tcp``: the same bytes over a localhost TCP socket, received into a preallocated
  buffer: a lower bound for the data path, which also packs a message around them.

Usage::

    python scripts/bench_ring.py                  # 0.8, 3.2 and 12.8 MB, 30 messages each
    python scripts/bench_ring.py --messages 100 --mb 12.8
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "scripts")]


def _tcp_receiver(port: int, n: int, nbytes: int) -> None:
    conn = socket.create_connection(("127.0.0.1", port))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(nbytes)
    view = memoryview(buf)
    for _ in range(n):
        got = 0
        while got < nbytes:
            got += conn.recv_into(view[got:], nbytes - got)
        conn.sendall(b"k")
    conn.close()


def tcp_handoff(n: int, shape: tuple[int, ...]) -> dict:
    """Latency from sendall to the receiver's one-byte acknowledgement, over localhost TCP."""
    nbytes = int(np.prod(shape)) * 2
    server = socket.create_server(("127.0.0.1", 0))
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=_tcp_receiver, args=(server.getsockname()[1], n + 1, nbytes))
    proc.start()
    conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    lat_us = []
    for seq in range(n + 1):  # message 0 warms up both ends
        x = np.random.default_rng(seq).standard_normal(shape).astype(np.float16)
        t0 = time.perf_counter()
        conn.sendall(memoryview(x).cast("B"))
        assert conn.recv(1) == b"k"
        if seq:
            lat_us.append((time.perf_counter() - t0) * 1e6)
    proc.join(timeout=60)
    conn.close(), server.close()
    return {"median_us": float(np.median(lat_us)), "p90_us": float(np.percentile(lat_us, 90))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=30)
    ap.add_argument("--mb", default="0.8,3.2,12.8", help="map sizes in MB (fp16; shapes (8, c, 56, 56))")
    args = ap.parse_args(argv)

    import gpu_check
    from hostspeed import host_line

    print(host_line())
    print(f"{'MB':>6} {'ring median ms':>15} {'ring p90 ms':>12} {'tcp median ms':>14} {'tcp p90 ms':>11}")
    for mb in (float(v) for v in args.mb.split(",")):
        channels = max(1, round(mb * 1e6 / (8 * 56 * 56 * 2)))
        shape = (8, channels, 56, 56)
        ring = gpu_check.ring_handoff(args.messages, shape, "cpu")
        tcp = tcp_handoff(args.messages, shape)
        size = np.prod(shape) * 2 / 1e6
        print(f"{size:>6.1f} {ring['median_us'] / 1e3:>15.2f} {ring['p90_us'] / 1e3:>12.2f} "
              f"{tcp['median_us'] / 1e3:>14.2f} {tcp['p90_us'] / 1e3:>11.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
