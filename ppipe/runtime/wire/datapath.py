"""The per-batch data path: connections between the frontend and the vGPU workers.

Ray places the workers, watches their lives and carries the start-up calls; batches travel
on plain connections, one message per stage (:mod:`ppipe.runtime.wire.frames` gives the format)::

    frontend --stage 0--> worker(route[0]) --stage 1--> worker(route[1]) --> ...
       ^                        |                           |
       +------- report ---------+---------- report ---------+   (the last report carries the outputs)

Every worker listens on one port (:class:`Inbox`), and so does the frontend, for the
reports. A sender keeps one connection per peer address (:class:`Outbox`). A stage message
names the whole reserved route and its workers' addresses, so a worker forwards its output
to the next stage without asking anyone, and reports to the frontend when the stage is
done. Feature maps between two workers therefore never pass through the frontend, and the
frontend's cost per batch is one message out and one report in per stage, a small fraction
of a Ray actor call's.

Both ends are asyncio protocols on the process's event loop: a small message is one
``send`` system call from the loop's thread and one read where the loop already waits; a
feature map goes out a megabyte at a time as the socket takes it, as views of its array
(:class:`_Sender`), and is read in place into a buffer of its own (:class:`_Receiver`), so
neither end copies it. There is no transport thread on purpose: a messaging library with
an I/O thread of its own (ZeroMQ's) pays a cross-thread wake-up per message, which on
small VMs costs several times the send itself. Sending never blocks: a connection that is
not up yet queues its messages, and a peer that stops reading lets them wait up to
``MAX_BUFFERED_BYTES``, past which the send raises :class:`DataPathFull` and the caller
fails that batch.

Connections carry data only (typed MessagePack headers and raw tensors, never pickle). They listen on the
node's address that Ray uses (the loopback address when every node is this host), by TCP,
and beside each port on a local socket that a peer on this machine connects to instead
(:mod:`ppipe.runtime.wire.addresses`). Given the
server's secret, a connection is authenticated before any of its messages is read, by an
HMAC challenge-response (:mod:`ppipe.runtime.wire.handshake`): the listener sends a fresh 16-byte nonce, the
connector answers ``HMAC-SHA256(secret, DOMAIN + nonce)``, and a connection that answers
wrong, or not within ``AUTH_TIMEOUT_S``, is closed unread. A fresh nonce per connection
makes a recorded answer useless on another; the cost is one round trip per connection
(they live as long as the server), nothing per message. It authenticates the connector
only, and encrypts nothing: what a connection carries can still be read on the network.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections import deque
from typing import Any, Callable

import numpy as np

from ppipe.runtime.wire.addresses import LOOPBACK, connect_local, listen_local, local_peer, on_this_machine, split_address
from ppipe.runtime.wire.addresses import is_loopback_address, node_host  # noqa: F401  (imported from here too)
from ppipe.runtime.wire.frames import LENGTH, MAX_MESSAGE_BYTES
from ppipe.runtime.wire.handshake import AUTH_TIMEOUT_S, NONCE_BYTES, Handshake

log = logging.getLogger("ppipe.runtime")

MAX_BUFFERED_BYTES = 1 << 30  # bytes queued for one peer before a send fails


class DataPathFull(RuntimeError):
    """A peer's queue is full (it stopped reading, or cannot be reached); nothing was sent."""


SMALL_READ_BYTES = 256 * 1024  # a connection's shared buffer for length prefixes and small messages


class _Receiver(asyncio.BufferedProtocol):
    """One accepted connection: cuts the byte stream into messages for the inbox.

    The socket reads straight into buffers this class hands out (``get_buffer``), so the
    bytes of a message are copied at most once after the kernel's copy, however many reads
    bring them. Between messages, reads go to one shared buffer of ``SMALL_READ_BYTES``:
    whole messages found there are delivered as copies (``bytes``; they are smaller than
    that buffer, which the next read overwrites), and a message that does not end there
    gets a buffer of its own, sized from its length prefix, holding the part that came
    and then filled in place by the following reads, each asked for exactly what the
    message still lacks. Once full, it is delivered as a read-only memoryview of that
    buffer, which nothing here touches again, so views of it (the tensors
    :func:`~ppipe.runtime.wire.frames.unpack` makes) stay valid as long as they live.

    A message of ``m`` bytes arriving in ``k`` reads thus costs at most ``min(m,
    SMALL_READ_BYTES)`` bytes of copying, not ``O(k m)``. A length prefix that no message
    can have (over :data:`~ppipe.runtime.wire.frames.MAX_MESSAGE_BYTES`, or under a header length
    field), or one this process has no memory for, closes the connection with a warning.

    Where the inbox has a :class:`Handshake`, the connection first gets a nonce, and its
    first ``Handshake.MAC_BYTES`` are the connector's answer: nothing after them is read
    (no message buffer allocated, nothing delivered) until it is right.
    """

    def __init__(self, inbox: "Inbox"):
        self.inbox = inbox
        self.transport: asyncio.Transport | None = None
        self.small = memoryview(bytearray(SMALL_READ_BYTES))
        self.small_end = 0  # small[:small_end]: received, not yet cut (under a length prefix)
        self.message: memoryview | None = None  # the message being filled, if any
        self.filled = 0  # bytes of ``message`` received
        self.nonce: bytes | None = None  # set while the connection has not proved the secret
        self._auth_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.inbox.conns.add(self)
        if self.inbox.handshake is not None:
            self.nonce = Handshake.nonce()
            transport.write(self.nonce)
            self._auth_timer = asyncio.get_running_loop().call_later(AUTH_TIMEOUT_S, self._auth_timed_out)

    def connection_lost(self, exc) -> None:
        self.inbox.conns.discard(self)
        self.message = None
        if self._auth_timer is not None:
            self._auth_timer.cancel()

    def _auth_timed_out(self) -> None:
        if self.nonce is not None:
            self.inbox.refuse(self, f"no answer to the handshake within {AUTH_TIMEOUT_S:g} s")

    def _authenticate(self) -> bool:
        """Check the answer once it has all come; True once the connection is authenticated."""
        n = Handshake.MAC_BYTES
        if self.small_end < n:
            return False
        if not self.inbox.handshake.verify(self.nonce, bytes(self.small[:n])):
            self.small_end = 0
            self.inbox.refuse(self, "a wrong answer to the handshake (it does not hold the server's secret)")
            return False
        self.nonce = None
        self._auth_timer.cancel()
        rest = self.small_end - n
        self.small[:rest] = self.small[n : self.small_end]
        self.small_end = rest
        return True

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.message is not None:
            return self.message[self.filled :]
        return self.small[self.small_end :]

    def buffer_updated(self, nbytes: int) -> None:
        if self.message is None:
            self.small_end += nbytes
            if self.nonce is None or self._authenticate():
                self._cut()
            return
        self.filled += nbytes
        if self.filled == len(self.message):
            message, self.message = self.message, None
            self.inbox.deliver(message.toreadonly())

    def _cut(self) -> None:
        """Deliver the whole messages in the shared buffer; start the one that does not end there."""
        view, pos, end = self.small, 0, self.small_end
        while end - pos >= LENGTH:
            n = int.from_bytes(view[pos : pos + LENGTH], "little")
            if n > MAX_MESSAGE_BYTES or n < LENGTH:
                self._refuse(f"a message of {n} bytes is malformed")
                return
            body = pos + LENGTH
            if end - body < n:
                self.small_end = 0
                self._start_message(n, view[body:end])
                return
            self.inbox.deliver(bytes(view[body : body + n]))
            pos = body + n
        view[: end - pos] = view[pos:end]  # a partial length prefix, under LENGTH bytes
        self.small_end = end - pos

    def _start_message(self, n: int, head: memoryview) -> None:
        """Allocate an ``n``-byte message holding ``head``, its first bytes."""
        try:
            self.message = memoryview(np.empty(n, np.uint8))  # not zeroed: every byte is received into it
        except MemoryError:
            self._refuse(f"no memory for a message of {n} bytes")
            return
        self.message[: len(head)] = head
        self.filled = len(head)

    def _refuse(self, why: str) -> None:
        log.warning("data path: %s to %s; closing its connection", why, self.inbox.address)
        self.small_end = 0
        self.transport.close()


class Inbox:
    """A listening port whose messages go to ``on_message(message)`` on the running loop.

    Args:
        on_message: called once per message with its bytes (without the length prefix);
            an exception it raises is logged, and the next messages are still read.
        host: the address to listen on; the port is picked by the system.
        secret: the server's data-path secret: every connection must prove it holds it
            before a message of it is read (None: connections are not authenticated).
        on_refused: called with the reason each time a connection is refused for failing
            the handshake (a metric's counter); the first refusal of each peer host is
            logged as a warning, the repeats at debug level.
    """

    def __init__(self, on_message: Callable[[memoryview | bytes], None], host: str = LOOPBACK,
                 secret: bytes | None = None, on_refused: Callable[[str], None] | None = None):
        self.on_message = on_message
        self.handshake = Handshake(secret) if secret is not None else None
        self.on_refused = on_refused
        self.refused = 0
        self._refused_hosts: set[str] = set()
        self.conns: set[_Receiver] = set()
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((host, 0))
        sock.listen(1024)
        sock.setblocking(False)
        port = sock.getsockname()[1]
        self.address = f"tcp://{host}:{port}"
        loop = asyncio.get_running_loop()
        # the port listens from here on; peers that connect before the server runs wait in the backlog
        self._servers = [loop.create_task(loop.create_server(lambda: _Receiver(self), sock=sock))]
        local = listen_local(host, port)  # beside it, the local socket that peers on this machine use
        if local is not None:
            self._servers.append(loop.create_task(loop.create_unix_server(lambda: _Receiver(self), sock=local)))

    def refuse(self, conn: _Receiver, why: str) -> None:
        """Close an unauthenticated connection unread, count it, and log it (once per peer host)."""
        peer = conn.transport.get_extra_info("peername")
        host = str(peer[0]) if isinstance(peer, tuple) and peer else local_peer(conn.transport)
        level = logging.DEBUG if host in self._refused_hosts else logging.WARNING
        self._refused_hosts.add(host)
        log.log(level, "data path: refused a connection from %s to %s: %s", host, self.address, why)
        self.refused += 1
        conn.transport.abort()
        if self.on_refused is not None:
            self.on_refused(why)

    def deliver(self, message: memoryview | bytes) -> None:
        try:
            self.on_message(message)
        except Exception:
            log.exception("data path: a message to %s could not be handled", self.address)

    def close(self) -> None:
        """Stop listening and drop every connection (as a process that died would)."""
        for server in self._servers:
            if server.done() and not server.cancelled() and server.exception() is None:
                server.result().close()
            else:
                server.cancel()
        for r in list(self.conns):
            r.transport.abort()
        self.conns.clear()


WRITE_CHUNK_BYTES = 1024 * 1024  # the most one write hands the transport
COALESCE_BYTES = 128 * 1024  # pieces under this size are small: a transport that joins gets runs of them joined
HEAD_START_BYTES = COALESCE_BYTES  # of a large piece, what a write that starts with small pieces (a header) takes


class _Sender(asyncio.Protocol):
    """One outgoing connection: hands its queued pieces to the transport as the socket takes them.

    A message's pieces (a header, then the tensors' memoryviews) wait in ``queue``,
    uncopied, until the transport's buffer is empty. Then they go to the transport one
    write at a time (:meth:`_next_write`: small pieces together, a large one
    ``WRITE_CHUNK_BYTES`` at a time) until a write leaves bytes in its buffer (the socket
    is full): the transport's high-water mark is 0, so it then pauses this protocol, and
    resumes it once the socket has taken everything.

    How a write is handed over depends on the transport's ``writelines``. Where the
    transport has its own (uvloop's, CPython >= 3.12's), it writes the pieces with one
    ``writev``/``sendmsg`` and keeps references to what the socket did not take, without
    copying: a write is ``writelines`` of a run of small pieces and the next slice of a
    large one (a header and the start of its tensor: one system call). CPython 3.11's
    selector transport inherits the base class's, which joins the pieces (a copy of the
    whole message), and its ``write`` copies what the socket did not take into a
    bytearray, whose tail is copied again each time it halves. There a write is either a
    run of small pieces joined (a header and its small tensors: one system call) or one
    slice of a large piece: each time the socket fills up, at most ``WRITE_CHUNK_BYTES``
    are copied, and nothing when it takes the write whole.

    A write that gathers small pieces (a message's header) takes only ``HEAD_START_BYTES``
    of the large piece after them: one ``writev`` of a whole megabyte over loopback returns
    before the receiver reads a byte of it, whereas after a short first write the receiver
    copies those bytes out on its core while this one writes the rest, so the two copies
    of a message overlap instead of following each other.

    Either way the queued views refer to the senders' arrays: an array must not change
    once sent (stage outputs and batch inputs are fresh arrays).

    Where the outbox has a :class:`Handshake`, the connection is usable (``transport`` set,
    the queue flushed) only once the listener's nonce has come and the answer is written;
    until then messages queue as on a connection not yet up.
    """

    def __init__(self, outbox: "Outbox", addr: str):
        self.outbox, self.addr = outbox, addr
        self.raw: asyncio.Transport | None = None  # the connection, from the moment it is up
        self.transport: asyncio.Transport | None = None  # the same, once usable (authenticated)
        self.nonce = b""
        self._auth_timer: asyncio.TimerHandle | None = None
        self.gathers = False  # whether the transport's writelines writes pieces without joining them
        self.queue: deque[memoryview | bytes] = deque()
        self.queued_bytes = 0
        self.paused = False
        self.lost = False

    def connection_made(self, transport) -> None:
        self.raw = transport
        if self.outbox.handshake is None:
            self._usable(transport)
        else:
            self._auth_timer = asyncio.get_running_loop().call_later(AUTH_TIMEOUT_S, self._no_nonce)

    def data_received(self, data: bytes) -> None:
        """The listener's nonce (nothing else comes this way): answer it, then send."""
        if self.transport is not None or self.outbox.handshake is None:
            return
        self.nonce += data
        if len(self.nonce) >= NONCE_BYTES:
            self._auth_timer.cancel()
            self.raw.write(self.outbox.handshake.answer(self.nonce[:NONCE_BYTES]))
            self._usable(self.raw)

    def _no_nonce(self) -> None:
        log.warning("data path: %s sent no handshake within %g s (does it hold no secret?); "
                    "%d queued bytes dropped", self.addr, AUTH_TIMEOUT_S, self.queued_bytes)
        self.raw.abort()

    def _usable(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.gathers = type(transport).writelines is not asyncio.WriteTransport.writelines
        transport.set_write_buffer_limits(high=0)
        self._flush()

    def connection_lost(self, exc) -> None:
        if self._auth_timer is not None:
            self._auth_timer.cancel()
        self.lost = True
        self.queue.clear()
        self.queued_bytes = 0
        self.outbox.forget(self)

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self._flush()

    def waiting_bytes(self) -> int:
        """Bytes sent to this peer that the socket has not taken yet."""
        return self.queued_bytes + (self.transport.get_write_buffer_size() if self.transport is not None else 0)

    def send(self, pieces: list[Any]) -> None:
        views = [p if type(p) is bytes else memoryview(p).cast("B") for p in pieces]
        size = sum(map(len, views))
        waiting = self.waiting_bytes()
        if waiting and waiting + size > MAX_BUFFERED_BYTES:  # a message to an idle peer always goes
            state = "is not connected" if self.transport is None else "stopped reading"
            raise DataPathFull(f"{waiting} bytes already wait for {self.addr}, which {state}")
        t = self.transport
        if size < COALESCE_BYTES and not waiting and t is not None and not t.is_closing():
            # a small message (a report, an ack) on an idle connection: one write, no queue
            if len(views) == 1:
                t.write(views[0])
            elif self.gathers:
                t.writelines(views)
            else:
                t.write(b"".join(views))
            return
        self.queue.extend(v for v in views if len(v))
        self.queued_bytes += size
        self._flush()

    def _flush(self) -> None:
        t = self.transport
        while self.queue and not self.paused and t is not None and not t.is_closing():
            unit = self._next_write()
            self.queued_bytes -= sum(len(p) for p in unit)
            if self.gathers:
                t.writelines(unit)
            else:
                t.write(unit[0] if len(unit) == 1 else b"".join(unit))

    def _next_write(self) -> list[memoryview | bytes]:
        """Take the pieces of the next write off the queue: a run of small pieces (under
        ``COALESCE_BYTES``, at most ``WRITE_CHUNK_BYTES`` in all), then, for a transport that
        gathers, the first ``HEAD_START_BYTES`` of a larger piece; or, alone, the next
        ``WRITE_CHUNK_BYTES`` of a larger piece."""
        queue, unit, small = self.queue, [], 0
        while queue:
            piece = queue[0]
            if len(piece) < COALESCE_BYTES:
                if unit and small + len(piece) > WRITE_CHUNK_BYTES:
                    break
                unit.append(queue.popleft())
                small += len(piece)
                continue
            if unit and not self.gathers:
                break
            cut = HEAD_START_BYTES if unit else WRITE_CHUNK_BYTES  # after a header: a short first write
            if len(piece) > cut:
                queue[0], piece = piece[cut:], piece[:cut]
            else:
                queue.popleft()
            unit.append(piece)
            break
        return unit


async def _open(peer: "_Sender", addr: str) -> tuple[Any, Any]:
    """Connect ``peer`` to ``addr``: by the local socket beside its port where it is on this
    machine and has one (:mod:`ppipe.runtime.wire.addresses`), else by TCP."""
    if on_this_machine(addr):
        try:
            return await connect_local(lambda: peer, addr)
        except OSError:
            pass
    host, port = split_address(addr)
    return await asyncio.get_running_loop().create_connection(lambda: peer, host, port)


class Outbox:
    """Connections to peers by address; ``send`` never blocks (see the module's docstring).

    Args:
        secret: the server's data-path secret, with which every connection answers its
            listener's handshake (None: the listeners do not authenticate).
    """

    def __init__(self, secret: bytes | None = None) -> None:
        self.handshake = Handshake(secret) if secret is not None else None
        self.peers: dict[str, _Sender] = {}
        self._connecting: set[asyncio.Task] = set()
        self._unreachable: set[str] = set()  # addresses whose last connect failed (logged once until one succeeds)

    def connect(self, addr: str) -> _Sender:
        """The connection to ``addr``, opened (asynchronously) on first use."""
        peer = self.peers.get(addr)
        if peer is None:
            peer = self.peers[addr] = _Sender(self, addr)
            task = asyncio.get_running_loop().create_task(_open(peer, addr))
            self._connecting.add(task)
            task.add_done_callback(lambda t: self._connected(t, peer))
        return peer

    def _connected(self, task: asyncio.Task, peer: _Sender) -> None:
        self._connecting.discard(task)
        if task.cancelled() or task.exception() is not None:
            why = "cancelled" if task.cancelled() else task.exception()
            # a dead peer is tried once per message sent to it: one warning, the repeats at debug level
            level = logging.DEBUG if peer.addr in self._unreachable else logging.WARNING
            self._unreachable.add(peer.addr)
            log.log(level, "data path: cannot connect to %s (%s); %d queued bytes dropped", peer.addr, why, peer.queued_bytes)
            peer.lost = True
            self.forget(peer)
        else:
            self._unreachable.discard(peer.addr)

    def forget(self, peer: _Sender) -> None:
        """A lost connection: the next send to its address connects anew."""
        if self.peers.get(peer.addr) is peer:
            del self.peers[peer.addr]

    def send(self, addr: str, pieces: list[Any]) -> None:
        """Queue a message (:func:`ppipe.runtime.wire.frames.pack`'s pieces) to ``addr``.

        Raises:
            DataPathFull: ``MAX_BUFFERED_BYTES`` already wait for that peer.
        """
        self.connect(addr).send(pieces)

    def drop(self, addr: str) -> None:
        peer = self.peers.pop(addr, None)
        if peer is not None and peer.raw is not None:
            peer.raw.abort()

    def close(self) -> None:
        for t in list(self._connecting):
            t.cancel()
        for addr in list(self.peers):
            self.drop(addr)
