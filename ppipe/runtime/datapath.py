"""The per-batch data path: ZeroMQ sockets between the frontend and the vGPU workers.

Ray places the workers, watches their lives and carries the start-up calls; batches travel
on plain sockets, one message per stage::

    frontend --stage 0--> worker(route[0]) --stage 1--> worker(route[1]) --> ...
       ^                        |                           |
       +------- report ---------+---------- report ---------+   (the last report carries the outputs)

Every worker binds one PULL socket (:class:`Inbox`), and so does the frontend, for the
reports. A sender keeps one PUSH socket per peer address (:class:`Outbox`). A stage
message names the whole reserved route and its workers' addresses (:mod:`ppipe.runtime.wire`
gives the format), so a worker forwards its output to the next stage without asking
anyone, and reports to the frontend when the stage is done. Feature maps between two
workers therefore never pass through the frontend, and the frontend's cost per batch is
one message out and one report in per stage, a few tens of microseconds each, instead of
a Ray actor call (about 1 ms of CPU on each side).

Reading: a socket's file descriptor is registered with the asyncio loop
(``loop.add_reader``). ZeroMQ signals it edge-triggered, so each wake-up drains every
queued message with non-blocking reads and hands each to a plain callback on the loop: no
task, no future per message. Sending is non-blocking too: a PUSH socket queues up to
``HWM`` messages for a peer that is slow or reconnecting; past that the send raises
:class:`DataPathFull` and the caller fails that batch instead of blocking the loop.

The sockets carry data only (msgpack and raw tensors, never pickle). They bind the node's
address that Ray uses (the loopback address when every node is this host), so they are
as exposed as Ray's own ports: run the cluster on a private network.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from typing import Any, Awaitable, Callable, Iterable

import zmq

from ppipe.runtime.wire import WireError, pack, unpack

log = logging.getLogger("ppipe.runtime")

HWM = 100_000  # messages queued per peer before a send fails
ZERO_COPY_BYTES = 65536  # frames at least this large are sent without a copy
LOOPBACK = "127.0.0.1"


class DataPathFull(RuntimeError):
    """A peer's queue is full (it stopped reading); the message was not sent."""


def _context() -> zmq.Context:
    return zmq.Context.instance()


def is_loopback_address(addr: str) -> bool:
    """Whether a ``tcp://host:port`` address is on the loopback interface."""
    host = addr.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def node_host() -> str:
    """The address this process's data-path sockets bind: the loopback address when Ray is
    not running or every alive Ray node is this host, else this node's address in Ray."""
    try:
        import ray
    except ImportError:  # pragma: no cover - ray is a dependency
        return LOOPBACK
    if not ray.is_initialized():
        return LOOPBACK
    here = ray.util.get_node_ip_address()
    nodes = {n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}
    return LOOPBACK if nodes <= {here} else here


class Inbox:
    """A bound PULL socket whose messages go to ``on_message(frames)`` on the running loop.

    Args:
        on_message: called once per message with its frames (``zmq.Frame``); an exception
            it raises is logged, and the next messages are still read.
        host: the address to bind; the port is picked by the system.
    """

    def __init__(self, on_message: Callable[[list[Any]], None], host: str = LOOPBACK):
        self.on_message = on_message
        self.sock = _context().socket(zmq.PULL)
        self.sock.setsockopt(zmq.RCVHWM, HWM)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._loop = asyncio.get_running_loop()
        self._fd = self.sock.getsockopt(zmq.FD)
        self._loop.add_reader(self._fd, self._drain)
        self._loop.call_soon(self._drain)  # messages queued before the reader was registered

    def _drain(self) -> None:
        sock = self.sock
        while not sock.closed and sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                self.on_message(frames)
            except Exception:
                log.exception("data path: a message to %s could not be handled", self.address)

    def close(self) -> None:
        if not self.sock.closed:
            self._loop.remove_reader(self._fd)
            self.sock.close(linger=0)


class Outbox:
    """PUSH sockets to peers by address; ``send`` never blocks."""

    def __init__(self) -> None:
        self.socks: dict[str, zmq.Socket] = {}

    def connect(self, addr: str) -> zmq.Socket:
        sock = self.socks.get(addr)
        if sock is None:
            sock = _context().socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, HWM)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(addr)
            self.socks[addr] = sock
        return sock

    def send(self, addr: str, frames: list[Any]) -> None:
        """Queue a message to ``addr`` (connecting on first use).

        Raises:
            DataPathFull: ``HWM`` messages already wait for that peer.
        """
        # small frames are cheaper copied than wrapped (zero-copy frames carry a free callback)
        copy = all(len(f) < ZERO_COPY_BYTES if isinstance(f, bytes) else f.nbytes < ZERO_COPY_BYTES for f in frames)
        try:
            self.connect(addr).send_multipart(frames, zmq.NOBLOCK, copy=copy)
        except zmq.Again:
            raise DataPathFull(f"{HWM} messages already wait for {addr}") from None

    def drop(self, addr: str) -> None:
        sock = self.socks.pop(addr, None)
        if sock is not None:
            sock.close(linger=0)

    def close(self) -> None:
        for addr in list(self.socks):
            self.drop(addr)


StageRunner = Callable[..., Awaitable[tuple[dict[str, Any], Any]]]


class StageServer:
    """A worker's end of the data path: run each stage message, forward, report.

    Args:
        vgpu_id: the worker's vGPU (in error reports).
        run: ``await run(batch_id, index, vgpu_id, payload, batch, timing, link)`` ->
            ``(report, output)``, as :meth:`ppipe.runtime.worker.VgpuWorker.run_stage`.

    A stage message's header holds ``b`` (batch id), ``k`` (stage index), ``route`` (vGPU
    ids), ``addr`` (their data-path addresses), ``n`` (batch size), ``timing`` (per stage,
    the reservation in wall-clock us), ``links`` (per stage, its NCCL edges or None) and
    ``sent`` (wall-clock us when the tensors left their sender). After stage k, the output
    goes to ``addr[k+1]`` as stage k+1's message, unless that edge is NCCL (then the
    frontend has posted stage k+1 itself and the tensors go over the edge). The report goes
    to the frontend: the stage's wall-clock stamps, with the outputs for the last stage, or
    ``err`` when the stage failed.
    """

    def __init__(self, vgpu_id: str, run: StageRunner):
        self.vgpu_id, self.run = vgpu_id, run
        self.inbox: Inbox | None = None
        self.outbox = Outbox()
        self.frontend: str | None = None
        self._tasks: set[asyncio.Task] = set()

    def open(self, frontend: str, host: str | None = None) -> str:
        """Bind this worker's inbox (on the loopback address when the frontend is on it) and
        connect to the frontend's; returns the inbox's address."""
        if self.inbox is None:
            self.inbox = Inbox(self._on_message, host or (LOOPBACK if is_loopback_address(frontend) else node_host()))
        self.frontend = frontend
        self.outbox.connect(frontend)
        return self.inbox.address

    def connect(self, peers: Iterable[str]) -> None:
        """Connect to the next stage's workers ahead of the first batch."""
        for addr in peers:
            self.outbox.connect(addr)

    def close(self) -> None:
        if self.inbox is not None:
            self.inbox.close()
        self.outbox.close()
        for t in list(self._tasks):
            t.cancel()

    def _on_message(self, frames: list[Any]) -> None:
        try:
            header, tensors = unpack(frames)
            k = header["k"]
            header["route"][k], header["addr"], header["b"]  # noqa: B018 - the fields every stage needs
        except (WireError, KeyError, IndexError, TypeError) as exc:
            log.warning("%s: dropped a malformed stage message: %s", self.vgpu_id, exc)
            return
        task = asyncio.get_running_loop().create_task(self._stage(header, tensors))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _stage(self, h: dict[str, Any], tensors: dict[str, Any]) -> None:
        k, route = h["k"], h["route"]
        links = h.get("links") or [None] * len(route)
        link = links[k]
        payload = {"tensors": tensors or None, "sent_wall_us": h.get("sent")}
        try:
            report, output = await self.run(h["b"], k, route[k], payload, h["n"], h.get("timing"), link)
        except Exception as exc:
            self._report({"batch_id": h["b"], "partition": k, "vgpu_id": self.vgpu_id, "err": f"{type(exc).__name__}: {exc}"})
            return
        if k + 1 < len(route) and not (link and "send" in link):
            try:
                self.outbox.send(h["addr"][k + 1], pack({**h, "k": k + 1, "sent": output["sent_wall_us"]}, output["tensors"]))
            except DataPathFull as exc:
                report["err"] = f"DataPathFull: {exc}"
        outputs = report.pop("outputs", None)
        self._report(report, outputs)

    def _report(self, report: dict[str, Any], outputs: dict[str, Any] | None = None) -> None:
        try:
            self.outbox.send(self.frontend, pack(report, outputs))
        except DataPathFull:
            log.error("%s: the frontend stopped reading reports; batch %s's report is lost", self.vgpu_id, report.get("batch_id"))
