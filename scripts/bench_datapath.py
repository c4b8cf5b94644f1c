#!/usr/bin/env python
"""One feature map between two processes: the data path's classes against a plain socket.

For each size, a float16 map goes from a sender process to a receiver process and the
receiver answers with a small acknowledgement; the time is "send called" to "ack
received" at the sender, median over ``--repeats`` messages (after two warm-ups):

* ``datapath``: :class:`~ppipe.runtime.wire.datapath.Outbox` -> :class:`~ppipe.runtime.wire.datapath.Inbox`,
  each process on its own event loop (``--loop``: stock asyncio, uvloop, or both), the
  message built by :func:`~ppipe.runtime.wire.frames.pack` and decoded by
  :func:`~ppipe.runtime.wire.frames.unpack` on arrival; the ack is a header-only data-path
  message back to an Inbox in the sender.
* ``<loop>+auth`` (``--auth``): the same with the connections authenticated, as ``ppipe
  serve`` runs them (:mod:`ppipe.runtime.wire.handshake`: one challenge-response per
  connection, nothing per message); and the set-up of an authenticated connection against
  a plain one (connect, handshake, a first small message delivered), median of 21.
* ``<loop>+handoff`` (``--handoff``): the map copied into a sealed slot of the sender's
  shared memory and named in the message instead of sent
  (:class:`~ppipe.runtime.wire.handoff.MapHandoff`), its seal checked at the receiver, as
  two workers of one machine hand each other maps; the hold ends with each ack, so its
  slot is reused, as in steady serving.
* ``socket``: the same bytes with ``sendall`` into a blocking socket, received with
  ``recv_into`` into a buffer allocated once; a one-byte ack. Its time is the floor the
  data path is measured against (``ratio`` = socket time / datapath time, i.e. datapath
  GB/s over socket GB/s).

The socket and each loop's data path take turns message by message (all receivers stay
up), so a host that slows down during the run slows every column alike. GB/s is the map's
bytes (1e9) over the median time. Every run prints the host first.

Usage::

    python scripts/bench_datapath.py                      # 64 KiB, 1, 4, 13, 32 MB; 31 repeats
    python scripts/bench_datapath.py --mb 13 --repeats 31 --loop uvloop --auth
    python scripts/bench_datapath.py --mb 1.53,13 --loop uvloop --handoff
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "scripts")]

WARMUP = 2
LEAVES_OUT = """\
left out: a real NIC (loopback TCP only: on a 25 Gb/s link the wire, ~3 GB/s, is the
  bound, not these copies); the fp16 cast and the GPU->host copy before a send; any
  stage's compute; more than one message in flight (each map waits for its ack, so
  nothing overlaps); both processes share this host's cores, and the sender's and the
  receiver's copies compete for them. Both columns include the ack's round trip."""


def _new_loop(kind: str) -> asyncio.AbstractEventLoop:
    if kind == "uvloop":
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


# ---- the data path -------------------------------------------------------------------------------
def _probe_type():
    """The benchmark's message: map number ``i`` of ``nbytes`` bytes, or ``stop``."""
    import msgspec

    class Probe(msgspec.Struct, array_like=True, frozen=True):
        i: int
        nbytes: int = 0
        stop: bool = False
        seals: tuple[tuple[tuple[int, int, int, int], int], ...] = ()

    return Probe


Probe = _probe_type()


def _datapath_receiver(kind: str, ack_addr: str, pipe, secret: bytes | None = None) -> None:
    """Answer every map with ``Probe(i)`` to ``ack_addr``; stop on a probe with ``stop``."""
    from ppipe.runtime.wire.datapath import Inbox, Outbox
    from ppipe.runtime.wire.frames import pack, unpack
    from ppipe.runtime.wire.handoff import check_seals
    from ppipe.runtime.wire.messages import Seal

    async def main() -> None:
        stop = asyncio.Event()
        out = Outbox(secret)

        def on_message(message) -> None:
            header, tensors = unpack(message, Probe)
            if header.stop:
                stop.set()
                return
            assert tensors["x"].nbytes == header.nbytes
            if header.seals:  # a map handed over in shared memory: its seal checked, as a worker does after its stage
                check_seals(tuple(Seal(ref, token) for ref, token in header.seals))
            out.send(ack_addr, pack(Probe(header.i)))

        inbox = Inbox(on_message, secret=secret)
        out.connect(ack_addr)
        pipe.send(inbox.address)
        await stop.wait()
        inbox.close(), out.close()

    loop = _new_loop(kind)
    loop.run_until_complete(main())
    loop.close()


class DatapathPair:
    """This process's Outbox and Inbox on a loop of ``kind``, and a receiver process; with
    ``secret``, every connection between them authenticated."""

    def __init__(self, kind: str, secret: bytes | None = None, handoff: bool = False):
        from ppipe.runtime.wire.handoff import MapHandoff
        from ppipe.runtime.wire.shared_inputs import InputArena

        self.secret = secret
        self.handoff = MapHandoff(InputArena(min_bytes=0)) if handoff else None  # (every size, to find where it pays)
        self.loop = _new_loop(kind)
        self.acks: dict[int, asyncio.Future] = {}
        self.i = 0
        self.loop.run_until_complete(self._open(kind))

    async def _open(self, kind: str) -> None:
        from ppipe.runtime.wire.datapath import Inbox, Outbox
        from ppipe.runtime.wire.frames import unpack

        self.inbox = Inbox(lambda m: self.acks.pop(unpack(m, Probe)[0].i).set_result(None), secret=self.secret)
        self.out = Outbox(self.secret)
        parent, child = mp.Pipe()
        self.proc = mp.get_context("spawn").Process(target=_datapath_receiver, args=(kind, self.inbox.address, child, self.secret))
        self.proc.start()
        self.addr = await asyncio.to_thread(parent.recv)

    async def _one(self, x: np.ndarray) -> float:
        from ppipe.runtime.wire.frames import pack

        self.i += 1
        ack = self.acks[self.i] = self.loop.create_future()
        t0 = time.perf_counter()
        if self.handoff is None:
            self.out.send(self.addr, pack(Probe(self.i, x.nbytes), {"x": x}))
        else:  # as a worker sends a map to one on its machine: copied into a sealed slot, named by where it lies
            placed, seals = self.handoff.place({"x": x}, hold_until_us=0.0, now_us=1.0)  # (the ack ends each hold)
            probe = Probe(self.i, x.nbytes, seals=tuple((s.ref, s.token) for s in seals))
            self.out.send(self.addr, pack(probe, placed, self.handoff.arena))
        await ack
        return time.perf_counter() - t0

    def time_one(self, x: np.ndarray) -> float:
        """Seconds from ``send`` to the receiver's ack for map ``x``."""
        return self.loop.run_until_complete(self._one(x))

    def close(self) -> None:
        from ppipe.runtime.wire.frames import pack

        async def stop() -> None:
            self.out.send(self.addr, pack(Probe(0, stop=True)))
            await asyncio.to_thread(self.proc.join, 30)
            self.out.close(), self.inbox.close()
            if self.proc.is_alive():
                self.proc.terminate()

        self.loop.run_until_complete(stop())
        self.loop.close()


def connection_setup_s(kind: str, secret: bytes | None, repeats: int = 21) -> float:
    """Median seconds from a new connection's ``send`` to its first small message's delivery,
    both ends on one loop in this process (with ``secret``: the handshake included)."""
    from ppipe.runtime.wire.datapath import Inbox, Outbox
    from ppipe.runtime.wire.frames import pack

    async def one() -> float:
        got = asyncio.get_running_loop().create_future()
        inbox = Inbox(lambda m: got.set_result(None), secret=secret)
        out = Outbox(secret)
        t0 = time.perf_counter()
        out.send(inbox.address, pack(Probe(1)))
        await got
        dt = time.perf_counter() - t0
        out.close(), inbox.close()
        return dt

    loop = _new_loop(kind)
    try:
        return statistics.median(loop.run_until_complete(one()) for _ in range(repeats))
    finally:
        loop.close()


# ---- a plain socket ---------------------------------------------------------------------------------
def _socket_receiver(port: int, sizes: list[int]) -> None:
    conn = socket.create_connection(("127.0.0.1", port))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    view = memoryview(bytearray(max(sizes)))
    for nbytes in sizes:
        got = 0
        while got < nbytes:
            got += conn.recv_into(view[got:nbytes])
        conn.sendall(b"k")
    conn.close()


class SocketPair:
    """A blocking socket to a receiver process that takes maps of ``sizes`` bytes, in that order."""

    def __init__(self, sizes: list[int]):
        server = socket.create_server(("127.0.0.1", 0))
        self.proc = mp.get_context("spawn").Process(target=_socket_receiver, args=(server.getsockname()[1], sizes))
        self.proc.start()
        self.conn, _ = server.accept()
        self.conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        server.close()

    def time_one(self, x: np.ndarray) -> float:
        t0 = time.perf_counter()
        self.conn.sendall(memoryview(x).cast("B"))
        assert self.conn.recv(1) == b"k"
        return time.perf_counter() - t0

    def close(self) -> None:
        self.proc.join(timeout=30)
        self.conn.close()
        if self.proc.is_alive():
            self.proc.terminate()


def medians(pairs: dict[str, Any], maps: list[np.ndarray], repeats: int) -> dict[str, list[float]]:
    """Median seconds per map for each pair; the pairs take turns message by message, so
    that a change in the host's speed during the run touches every column alike, in an
    order that rotates every round, so that no column always follows the same one (a
    receiver still freeing its last map slows the next column's message)."""
    times: dict[str, list[list[float]]] = {k: [[] for _ in maps] for k in pairs}
    keys = list(pairs)
    for j, x in enumerate(maps):
        for r in range(WARMUP + repeats):
            for k in keys[r % len(keys):] + keys[: r % len(keys)]:
                t = pairs[k].time_one(x)
                if r >= WARMUP:
                    times[k][j].append(t)
    return {k: [statistics.median(t) for t in ts] for k, ts in times.items()}


# ---- the table ----------------------------------------------------------------------------------------
def _sizes(spec: str) -> list[int]:
    """``"0.0625,1,13"`` (MB, 1 MB = 2**20 bytes) -> even byte counts."""
    return [int(float(v) * 2**20) // 2 * 2 for v in spec.split(",")]


def _label(nbytes: int) -> str:
    return f"{nbytes // 1024} KiB" if nbytes < 2**20 else f"{nbytes / 2**20:g} MB"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", default="0.0625,1,4,13,32", help="map sizes in MB (2**20 bytes), comma-separated")
    ap.add_argument("--repeats", type=int, default=31, help="timed messages per size (median reported)")
    ap.add_argument("--loop", choices=["asyncio", "uvloop", "both"], default="both")
    ap.add_argument("--auth", action="store_true", help="also authenticated connections, as ppipe serve runs them")
    ap.add_argument("--handoff", action="store_true",
                    help="also each loop's map handed over in shared memory (ppipe.runtime.wire.handoff), as between workers of one machine")
    args = ap.parse_args(argv)

    from hostspeed import host_line

    load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    print(f"{host_line()}; load average {load}", flush=True)
    loops = ["asyncio", "uvloop"] if args.loop == "both" else [args.loop]
    secret = os.urandom(32)
    rng = np.random.default_rng(0)
    maps = [rng.standard_normal(n // 2).astype(np.float16) for n in _sizes(args.mb)]
    pairs: dict[str, Any] = {"socket": SocketPair([x.nbytes for x in maps for _ in range(WARMUP + args.repeats)])}
    pairs.update((k, DatapathPair(k)) for k in loops)
    if args.auth:
        pairs.update((f"{k}+auth", DatapathPair(k, secret)) for k in loops)
    if args.handoff:
        pairs.update((f"{k}+handoff", DatapathPair(k, handoff=True)) for k in loops)
    kinds = [k for k in pairs if k != "socket"]
    try:
        got = medians(pairs, maps, args.repeats)
    finally:
        for pair in pairs.values():
            pair.close()
    plain = got["socket"]
    head = f"{'size':>9} {'socket ms':>10} {'GB/s':>6}" + "".join(f" {k + ' ms':>11} {'GB/s':>6} {'ratio':>6}" for k in kinds)
    print(head)
    for j, x in enumerate(maps):
        row = f"{_label(x.nbytes):>9} {plain[j] * 1e3:>10.2f} {x.nbytes / plain[j] / 1e9:>6.2f}"
        for k in kinds:
            t = got[k][j]
            row += f" {t * 1e3:>11.2f} {x.nbytes / t / 1e9:>6.2f} {plain[j] / t:>6.2f}"
        print(row, flush=True)
    print(f"(median of {args.repeats} messages each, the columns taking turns; ratio = socket time / datapath time)")
    if args.auth:
        for k in loops:
            plain_s, auth_s = connection_setup_s(k, None), connection_setup_s(k, secret)
            print(f"connection set-up ({k}): plain {plain_s * 1e3:.2f} ms, authenticated {auth_s * 1e3:.2f} ms "
                  f"(+{(auth_s - plain_s) * 1e3:.2f} ms once per connection; a connection lives as long as the server)")
    print(LEAVES_OUT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
