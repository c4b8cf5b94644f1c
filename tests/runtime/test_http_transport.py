"""The HTTP server's body handling (``ppipe.runtime.ingress.http_transport``): a body of
declared length within the limit reaches the app whole, in one message, however many reads
it took; larger and chunked bodies reach it in pieces, unchanged; a binary-extension body
reaches it as shared memory, read there by the socket."""

from __future__ import annotations

import gc
import os
import socket
import time

import pytest

from ppipe.runtime.ingress.http_transport import BackgroundServer
from ppipe.runtime.wire.shared_inputs import process_arena


class RecordingApp:
    """ASGI: reads each request's body message by message, answers with its length, and
    keeps the number of messages and the bodies it read."""

    def __init__(self):
        self.messages: list[int] = []
        self.bodies: list[bytes] = []
        self.kinds: list[type] = []  # of each body's first message

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        pieces = []
        while True:
            msg = await receive()
            pieces.append(msg.get("body", b""))
            if not msg.get("more_body", False):
                break
        self.messages.append(len(pieces))
        self.kinds.append(type(pieces[0]))
        self.bodies.append(b"".join(pieces))
        out = str(len(self.bodies[-1])).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(out)).encode())]})
        await send({"type": "http.response.body", "body": out})


def _post_in_pieces(url: str, head: bytes, pieces: list[bytes], pause_s: float = 0.05) -> bytes:
    """Send the request head, then each piece after a pause (so that the server reads them
    apart); returns the answer's body."""
    host, port = url[len("http://"):].rsplit(":", 1)
    with socket.create_connection((host, int(port))) as s:
        s.sendall(head)
        for p in pieces:
            time.sleep(pause_s)
            s.sendall(p)
        s.settimeout(5.0)
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < int(data.split(b"content-length: ")[1].split(b"\r\n")[0]):
            data += s.recv(65536)
    return data.split(b"\r\n\r\n", 1)[1]


def _head(length: int, tensors_at: int | None = None) -> bytes:
    binary = "" if tensors_at is None else f"inference-header-content-length: {tensors_at}\r\n"
    return f"POST /x HTTP/1.1\r\nhost: x\r\ncontent-length: {length}\r\n{binary}\r\n".encode()


@pytest.fixture
def server():
    app = RecordingApp()
    with BackgroundServer(app, max_body_bytes=1 << 20) as srv:
        yield srv, app


def test_a_declared_body_reaches_the_app_whole_in_one_message(server):
    srv, app = server
    body = os.urandom(600_000)
    pieces = [body[i : i + 150_000] for i in range(0, len(body), 150_000)]
    assert _post_in_pieces(srv.url, _head(len(body)), pieces) == b"600000"
    assert app.bodies == [body] and app.messages == [1]


def test_a_body_over_the_limit_reaches_the_app_in_pieces_unchanged(server):
    srv, app = server
    body = os.urandom((1 << 20) + 300_000)
    pieces = [body[i : i + 300_000] for i in range(0, len(body), 300_000)]
    assert _post_in_pieces(srv.url, _head(len(body)), pieces) == str(len(body)).encode()
    assert app.bodies == [body] and app.messages[0] > 1  # uvicorn's way: a message per read it waited for


def test_a_chunked_body_reaches_the_app_unchanged(server):
    srv, app = server
    body = os.urandom(200_000)
    head = b"POST /x HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
    chunks = [b"%x\r\n" % len(body[i : i + 50_000]) + body[i : i + 50_000] + b"\r\n" for i in range(0, len(body), 50_000)]
    assert _post_in_pieces(srv.url, head, chunks + [b"0\r\n\r\n"]) == b"200000"
    assert app.bodies == [body]


def test_keep_alive_requests_each_get_their_own_whole_body(server):
    srv, app = server
    first, second = os.urandom(70_000), os.urandom(90_000)
    host, port = srv.url[len("http://"):].rsplit(":", 1)
    with socket.create_connection((host, int(port))) as s:
        s.sendall(_head(len(first)) + first + _head(len(second)) + second)  # pipelined on one connection
        s.settimeout(5.0)
        data = b""
        while data.count(b"HTTP/1.1 200") < 2 or not data.endswith(b"90000"):
            data += s.recv(65536)
    assert app.bodies == [first, second] and app.messages == [1, 1]


def test_a_binary_extension_body_reaches_the_app_whole_in_shared_memory(server):
    srv, app = server
    arena = process_arena()
    body = os.urandom(600_000)
    pieces = [body[i : i + 150_000] for i in range(0, len(body), 150_000)]
    lent = arena.lent_bytes
    assert _post_in_pieces(srv.url, _head(len(body), tensors_at=37), pieces) == b"600000"
    assert app.bodies == [body] and app.messages == [1] and app.kinds == [memoryview]
    gc.collect()
    assert arena.lent_bytes == lent  # its slot came back once the app let go of it


def test_binary_bodies_read_into_shared_memory_leave_the_connection_in_step(server):
    srv, app = server
    bodies = [os.urandom(300_000), os.urandom(200_000), os.urandom(1000)]
    host, port = srv.url[len("http://"):].rsplit(":", 1)
    with socket.create_connection((host, int(port))) as s:
        for b in bodies:  # the first two shared (the second pipelined right behind), the small one plain
            s.sendall(_head(len(b), tensors_at=10) + b[:50_000])
            time.sleep(0.05)  # the server takes up the body's rest in its own reads
            s.sendall(b[50_000:])
        s.settimeout(5.0)
        data = b""
        while data.count(b"HTTP/1.1 200") < 3 or not data.endswith(b"1000"):
            data += s.recv(65536)
    assert app.bodies == bodies and app.kinds == [memoryview, memoryview, bytes]


def test_a_client_gone_in_the_middle_of_a_shared_body_leaves_the_server_serving(server):
    srv, app = server
    host, port = srv.url[len("http://"):].rsplit(":", 1)
    lent = process_arena().lent_bytes
    with socket.create_connection((host, int(port))) as s:
        s.sendall(_head(500_000, tensors_at=10) + os.urandom(100_000))
        time.sleep(0.1)
    body = os.urandom(400_000)
    assert _post_in_pieces(srv.url, _head(len(body), tensors_at=10), [body]) == b"400000"
    assert app.bodies[-1] == body
    gc.collect()
    assert process_arena().lent_bytes == lent  # the abandoned body's slot came back too


class _Recorder:
    """A transport that records what is written to it."""

    def __init__(self):
        self.calls: list[tuple] = []

    def write(self, data):
        self.calls.append(("write", bytes(data)))

    def writelines(self, pieces):
        self.calls.append(("writelines", [bytes(p) for p in pieces]))

    def close(self):
        self.calls.append(("close",))

    def is_closing(self):
        return False


def test_a_responses_head_goes_out_with_its_first_body_part_in_one_write():
    from ppipe.runtime.ingress.http_transport import _OneWriteResponse

    t = _Recorder()
    w = _OneWriteResponse(t)
    w.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # what a client waits for before its body: at once
    head = b"HTTP/1.1 200 OK\r\ncontent-length: 24\r\n\r\n"
    w.write(head)
    assert t.calls == [("write", b"HTTP/1.1 100 Continue\r\n\r\n")]
    w.write(b"HTTP/1.1 is in the body")  # a body that begins like a status line is still the body
    w.write(b"!")
    assert t.calls[1:] == [("writelines", [head, b"HTTP/1.1 is in the body"]), ("write", b"!")]
    assert w.is_closing() is False  # everything else is the transport's


def test_a_head_still_held_is_written_before_the_connection_closes():
    from ppipe.runtime.ingress.http_transport import _OneWriteResponse

    t = _Recorder()
    w = _OneWriteResponse(t)
    w.write(b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 0\r\n\r\n")
    w.close()  # (an app that failed between its response's start and its body)
    assert t.calls == [("write", b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 0\r\n\r\n"), ("close",)]


def test_a_client_that_expects_100_continue_gets_it_then_its_answer(server):
    srv, app = server
    host, port = srv.url[len("http://"):].rsplit(":", 1)
    body = os.urandom(5000)
    with socket.create_connection((host, int(port))) as s:
        s.settimeout(5.0)
        s.sendall(f"POST /x HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\nexpect: 100-continue\r\n\r\n".encode())
        assert s.recv(65536).startswith(b"HTTP/1.1 100 Continue")  # before any byte of the body was sent
        s.sendall(body)
        data = b""
        while not data.endswith(b"5000"):
            data += s.recv(65536)
    assert data.startswith(b"HTTP/1.1 200") and app.bodies == [body]


def test_a_head_request_gets_its_answer_and_the_connection_serves_on(server):
    """uvicorn writes no body for HEAD: the head held for the body must go when the response ends."""
    srv, app = server
    host, port = srv.url[len("http://"):].rsplit(":", 1)
    with socket.create_connection((host, int(port))) as s:
        s.settimeout(5.0)
        s.sendall(b"HEAD /x HTTP/1.1\r\nhost: x\r\n\r\n")
        data = b""
        while b"\r\n\r\n" not in data:
            data += s.recv(65536)
        assert data.startswith(b"HTTP/1.1 200") and data.endswith(b"\r\n\r\n")
        s.sendall(_head(3) + b"abc")  # the same connection, a request with a body next
        data = b""
        while not data.endswith(b"\r\n\r\n3"):
            data += s.recv(65536)
    assert app.bodies == [b"", b"abc"]
