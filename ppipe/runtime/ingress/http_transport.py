"""The HTTP server under the frontend's ASGI app: uvicorn, held against slow clients, and
a body of declared length handed on whole.

**Slow clients.** The request line and headers must arrive within a header timeout
(:func:`timed_http_protocol`; the body's own timeout is the frontend's, see
:class:`ppipe.runtime.ingress.http_server.Frontend`), an idle keep-alive connection is
closed after a few seconds, and a graceful shutdown waits for in-flight requests only so
long (:func:`uvicorn_config`). :class:`BackgroundServer` runs an app so in a thread.

**Whole bodies.** uvicorn hands a body on in pieces: each read is appended to a
``bytearray``, reading pauses once 64 KiB wait, and each ``receive()`` copies what waits
into new ``bytes``; an app that needs the whole body joins them once more. A request that
declares its length (``Content-Length``, within the server's body limit) is instead kept as
the parser's pieces and joined once, when it is complete, into the one message the app
receives (:class:`_WholeBody`): one copy of the body in Python where there were three, one
wake-up of the app where there was one per 64 KiB, no pause and resume of the socket. The
limit bounds what a connection may hold, as the app's own limit does; a larger or
undeclared body goes uvicorn's way (and the app answers 413 or reads it in pieces).
A binary-extension body (``Inference-Header-Content-Length``) is read into the
process's shared-input arena (:mod:`ppipe.runtime.wire.shared_inputs`), its tensors on a
64-byte boundary, so that a worker on this machine reads them where they are; it is then
handed on as a memoryview of that memory.

uvicorn is imported when a server is configured, not with this module.
"""

from __future__ import annotations

import asyncio
import functools
import json

from ppipe.runtime.wire.shared_inputs import process_arena

# Slow clients: what a connection may take (the body timeout is the frontend's: http_server).
DEFAULT_HEADER_TIMEOUT_S = 10.0  # connection made (or last response sent) -> request line and headers read
DEFAULT_KEEP_ALIVE_S = 5.0  # an idle keep-alive connection is closed after this (uvicorn's timeout_keep_alive)
DEFAULT_SHUTDOWN_TIMEOUT_S = 10.0  # graceful shutdown: in-flight requests get this long, then are cancelled
MAX_HEADER_BYTES = 64 * 1024  # request line + headers; more is a 431
DEFAULT_WHOLE_BODY_BYTES = 64 * 1024 * 1024  # bodies up to this (declared) are handed on whole: the frontend's default body limit

_REASON_PHRASES = {400: "Bad Request", 408: "Request Timeout", 431: "Request Header Fields Too Large"}


def uvicorn_config(
    app,
    host: str,
    port: int,
    *,
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
    keep_alive_s: float = DEFAULT_KEEP_ALIVE_S,
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
    max_body_bytes: int = DEFAULT_WHOLE_BODY_BYTES,
    log_level: str = "warning",
):
    """uvicorn's settings for ``ppipe serve`` (and :class:`BackgroundServer`): no slow client
    holds a connection or the shutdown for long.

    Args:
        header_timeout_s: from the connection (or its last response) to the end of the next
            request's headers; an idle or slowloris connection is closed with a 408.
        keep_alive_s: an idle keep-alive connection is closed after this (uvicorn's ``timeout_keep_alive``).
        shutdown_timeout_s: on SIGTERM, requests in flight get this long to finish; then
            they are cancelled and the server stops (uvicorn's ``timeout_graceful_shutdown``).
        max_body_bytes: the app's body limit; a body declared within it is handed on whole.
    """
    import uvicorn

    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        lifespan="on",
        access_log=False,
        http=timed_http_protocol(header_timeout_s, max_whole_body_bytes=max_body_bytes),
        timeout_keep_alive=keep_alive_s,
        timeout_graceful_shutdown=shutdown_timeout_s,
        proxy_headers=False,  # nothing here reads the client's address: no X-Forwarded-* rewriting per request
    )


def timed_http_protocol(header_timeout_s: float, max_header_bytes: int = MAX_HEADER_BYTES,
                        max_whole_body_bytes: int = DEFAULT_WHOLE_BODY_BYTES):
    """uvicorn's httptools protocol with what it lacks against slow clients: a deadline for
    the request line and headers (from the connection, or from the previous response), and
    a bound on their size. uvicorn arms its keep-alive timer only after a response, so a
    connection that never completes its headers would otherwise stay open for good.

    At the deadline, a connection that has sent part of a request gets a 408 and is closed;
    one that has sent nothing is closed silently (a client's pooled connection must not
    read a 408 as the answer to the request it sends next). See :class:`_HeaderDeadline`.
    Bodies declared up to ``max_whole_body_bytes`` are handed on whole (:class:`_WholeBody`)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    return type("TimedHttpToolsProtocol", (_HeaderDeadline, _WholeBody, HttpToolsProtocol),
                {"_header_timeout_s": header_timeout_s, "_max_header_bytes": max_header_bytes,
                 "_max_whole_body_bytes": max_whole_body_bytes})


class _WholeBody:
    """What :func:`timed_http_protocol` adds to uvicorn's ``HttpToolsProtocol`` for bodies
    of declared length: the parser's pieces (``bytes`` of their own) are kept in a list and
    joined when the message is complete, then set as the request cycle's body, which its
    ``receive()`` hands on as it is (``bytes()`` of ``bytes`` copies nothing). Until then the
    app, waiting in ``receive()``, is not woken. A body within one read is handed on with no
    copy at all.

    A binary-extension body instead goes into a slot of the shared-input arena taken when
    the headers are read, and is handed on as a memoryview (:func:`_receive_whole`). What
    came with the headers is copied in (while it is still in the cache); the rest is read by
    the socket straight into the slot (:class:`_BodyInto`), with no read buffer of the loop's
    and no parser's copy in between: the body's bytes are copied once, by the kernel."""

    _max_whole_body_bytes: int
    _pieces: list[bytes] | None = None
    _slot: memoryview | None = None  # the shared body being filled
    _filled = 0

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self._pieces, self._slot = None, None
        if self.parser.should_upgrade():
            return
        self.cycle.transport = _OneWriteResponse(self.transport)
        declared = _digits(next((v for k, v in self.headers if k == b"content-length"), None))
        if declared is None or declared > self._max_whole_body_bytes:
            return
        self._pieces = []
        tensors_at = _digits(next((v for k, v in self.headers if k == b"inference-header-content-length"), None))
        arena = process_arena() if tensors_at is not None else None
        self._slot = arena.body(declared, tensors_at) if arena is not None else None
        if self._slot is not None:
            self._filled = 0
            cycle = self.cycle
            cycle.receive = functools.partial(_receive_whole, cycle, cycle.receive)  # (looked up when the app starts)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        slot = self._slot
        if slot is not None and self._filled < len(slot) and not self.flow.read_paused and not self.transport.is_closing():
            _BodyInto(self).take_over()

    def body_read(self) -> None:
        """:class:`_BodyInto` is done: the parser, which counts a body it has not seen, is
        replaced by a fresh one for the connection's next request, and the message completes."""
        from httptools import HttpRequestParser

        self.parser = HttpRequestParser(self)
        self.on_message_complete()

    def on_body(self, body: bytes) -> None:
        if self._pieces is None:
            super().on_body(body)
        elif self.cycle.response_complete:  # an app that answered early reads no more of it
            pass
        elif self._slot is not None:
            end = self._filled + len(body)
            self._slot[self._filled : end] = body  # (the parser stops at the declared length)
            self._filled = end
        else:
            self._pieces.append(bytes(body))

    def on_response_complete(self) -> None:
        transport = getattr(self.cycle, "transport", None)
        if isinstance(transport, _OneWriteResponse):
            transport.flush()  # a response with no body write (HEAD) has its head still held
        super().on_response_complete()

    def on_message_complete(self) -> None:
        pieces, slot, self._pieces, self._slot = self._pieces, self._slot, None, None
        if pieces is not None and not self.cycle.response_complete:
            if slot is not None:
                self.cycle.body = slot[: self._filled]
            elif pieces:
                self.cycle.body = b"".join(pieces)
        super().on_message_complete()


class _OneWriteResponse:
    """The transport as one request's cycle sees it. uvicorn writes a response's status
    line and headers, then each body part, with a write each: two system calls, and two
    segments for the client to read, per response. Here the head is held until the first
    body part, and both go out in one ``writelines`` (one ``writev`` on uvloop). Every other
    write passes through at once, the ``100 Continue`` that a client may wait for before
    sending its body among them. A head still held is written when the response completes
    (uvicorn writes no body for HEAD) or the connection closes."""

    __slots__ = ("_transport", "_head", "_headed")

    def __init__(self, transport):
        self._transport, self._head, self._headed = transport, None, False

    def write(self, data) -> None:
        if self._head is not None:
            head, self._head = self._head, None
            self._transport.writelines((head, data))
        elif not self._headed and data.startswith(b"HTTP/1.1 ") and not data.startswith(b"HTTP/1.1 100 "):
            self._head, self._headed = data, True
        else:
            self._transport.write(data)

    def flush(self) -> None:
        """Write a head still held (a response that ended without a body write: HEAD)."""
        if self._head is not None:
            head, self._head = self._head, None
            self._transport.write(head)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


class _BodyInto(asyncio.BufferedProtocol):
    """The connection's protocol while the rest of a shared body comes: each read goes
    straight into the slot, asked for exactly what the body still lacks (so a next request's
    bytes stay in the socket); once it is full, the HTTP protocol is put back and told
    (:meth:`_WholeBody.body_read`). Reading is paused around each switch so that the loop
    takes up the new protocol's way of reading (uvloop chooses it when reading starts)."""

    def __init__(self, http: "_WholeBody"):
        self.http = http
        self.transport = http.transport

    def take_over(self) -> None:
        self._switch_to(self)

    def _switch_to(self, protocol) -> None:
        self.transport.pause_reading()
        self.transport.set_protocol(protocol)
        self.transport.resume_reading()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.http._slot[self.http._filled :]

    def buffer_updated(self, nbytes: int) -> None:
        http = self.http
        http._filled += nbytes
        if http._filled == len(http._slot):
            self._switch_to(http)
            http.body_read()

    def eof_received(self):
        return self.http.eof_received()

    def connection_lost(self, exc) -> None:
        self.http.connection_lost(exc)

    def pause_writing(self) -> None:
        self.http.pause_writing()

    def resume_writing(self) -> None:
        self.http.resume_writing()


async def _receive_whole(cycle, receive):
    """uvicorn's ``receive()`` for a body handed on whole, less its ``bytes(body)``: that
    copies nothing of ``bytes`` but all of a memoryview of shared memory, so such a body
    is handed on as it is. The same steps otherwise: the ``100 Continue`` a client may
    wait for, then the wait for the whole body (reading is never paused for one)."""
    if cycle.waiting_for_100_continue and not cycle.transport.is_closing():
        cycle.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        cycle.waiting_for_100_continue = False
    if not cycle.disconnected and not cycle.response_complete:
        await cycle.message_event.wait()
    body = cycle.body
    if not isinstance(body, memoryview) or cycle.disconnected or cycle.response_complete:
        return await receive()  # (the event is still set: it returns at once)
    cycle.message_event.clear()
    cycle.body = bytearray()
    return {"type": "http.request", "body": body, "more_body": cycle.more_body}


def _digits(value: bytes | None) -> int | None:
    """A header's value as a whole number (at most 20 digits), else None."""
    return int(value) if value is not None and value.isdigit() and len(value) <= 20 else None


class _HeaderDeadline:
    """What :func:`timed_http_protocol` adds to uvicorn's ``HttpToolsProtocol`` (this class
    comes first in the subclass's bases, so its methods run and then call uvicorn's): a
    timer from the connection, or from each response, to the end of the next request's
    headers, and a count of the headers' bytes."""

    _header_timeout_s: float
    _max_header_bytes: int
    _header_timer: asyncio.TimerHandle | None = None
    _header_bytes = 0
    _too_large = False
    _begun = False  # a byte of the next request has come

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_header_timer()

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_bytes, self._begun = 0, False
        self._header_timer = self.loop.call_later(self._header_timeout_s, self._header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self._begun:  # a slow (slowloris) request: say why
            self._reject(408, f"no complete request line and headers within {self._header_timeout_s:g} s; the connection is closed")
        else:  # an idle connection: closed silently, as uvicorn closes an idle keep-alive one
            self.transport.close()

    def on_message_begin(self) -> None:
        self._begun = True
        super().on_message_begin()

    def _reject(self, status: int, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        self.transport.write(
            f"HTTP/1.1 {status} {_REASON_PHRASES[status]}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n\r\n".encode() + body
        )
        self.transport.close()

    def _count(self, n: int) -> None:
        self._header_bytes += n
        if self._header_bytes > self._max_header_bytes:
            self._too_large = True
            raise ValueError("headers too large")  # httptools stops parsing; uvicorn calls send_400_response

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._cancel_header_timer()
        super().on_headers_complete()

    def send_400_response(self, msg: str) -> None:
        if self._too_large:
            self._reject(431, f"the request line and headers exceed {self._max_header_bytes} bytes")
        else:
            self._reject(400, f"{msg.rstrip('.')}: not an HTTP/1.1 request")

    def on_response_complete(self) -> None:
        pipelined = bool(self.pipeline)
        super().on_response_complete()
        if not pipelined and not self.transport.is_closing():
            self._arm_header_timer()  # the next request's headers (uvicorn's keep-alive timer closes an idle one sooner)

    def connection_lost(self, exc) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)


class BackgroundServer:
    """Run an ASGI app with uvicorn in a thread (tests, ``scripts/bench_serve.py``, frontend shards).

    Args:
        app: the app (its lifespan runs on the thread's loop).
        host, port: where to bind; port 0 picks a free port (see :attr:`url`).
        sockets: already bound and listening (e.g. a shard's SO_REUSEPORT socket), instead of host and port.
        timeouts: ``header_timeout_s``, ``keep_alive_s``, ``shutdown_timeout_s`` (and ``max_body_bytes``) of :func:`uvicorn_config`.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning", sockets=None, **timeouts: float):
        import uvicorn

        self.config = uvicorn_config(app, host, port, log_level=log_level, **timeouts)
        self.server = uvicorn.Server(self.config)
        self.sockets = sockets
        self.thread = None
        self.loop = None
        self.url = ""

    def __enter__(self) -> "BackgroundServer":
        import threading
        import time

        def run() -> None:
            factory = self.config.get_loop_factory()  # uvloop's where installed, as uvicorn.run would
            self.loop = factory() if factory else asyncio.new_event_loop()
            try:
                self.loop.run_until_complete(self.server.serve(sockets=self.sockets))
            finally:
                self.loop.close()

        self.thread = threading.Thread(target=run, name="ppipe-frontend", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the frontend did not start (see the log above)")
            time.sleep(0.02)
        sock = self.server.servers[0].sockets[0]
        host, port = sock.getsockname()[:2]
        self.url = f"http://{host}:{port}"
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout=30)
