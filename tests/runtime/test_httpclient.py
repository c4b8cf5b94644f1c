"""The load generator's raw HTTP client against a server that closes idle keep-alive
connections (as uvicorn does after 5 s): a request must not fail because the pool held
more than one stale connection."""

from __future__ import annotations

import asyncio

from ppipe.runtime.client.httpclient import RawHttpClient


async def _serve_once_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    # answer one request, keep-alive style (no "connection: close"), then drop the socket
    while (await reader.readline()) not in (b"\r\n", b""):
        pass
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
    await writer.drain()
    await asyncio.sleep(0.05)
    writer.close()


def test_retry_opens_a_fresh_connection_when_every_idle_one_is_stale():
    async def main() -> int:
        server = await asyncio.start_server(_serve_once_then_close, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = RawHttpClient(f"http://127.0.0.1:{port}", timeout_s=5)
        try:
            # two concurrent requests leave two pooled connections...
            assert [r[0] for r in await asyncio.gather(client.request("GET", "/"), client.request("GET", "/"))] == [200, 200]
            assert len(client._idle) == 2
            await asyncio.sleep(0.2)  # ...which the server has closed since
            status, _, body = await client.request("GET", "/")
            return status if body == b"ok" else -1
        finally:
            await client.aclose()
            server.close()
            await server.wait_closed()

    assert asyncio.run(main()) == 200


async def _answer_each(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:  # keep-alive: every request on this connection answered
        line = await reader.readline()
        if not line:
            return
        while (await reader.readline()) not in (b"\r\n", b""):
            pass
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()


def test_warm_connections_serve_the_first_requests_with_no_new_connection():
    async def main() -> tuple[int, int, list[int]]:
        server = await asyncio.start_server(_answer_each, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = RawHttpClient(f"http://127.0.0.1:{port}", timeout_s=5)
        try:
            await client.warm(3)
            warmed = client.opened
            statuses = [r[0] for r in await asyncio.gather(*(client.request("GET", "/") for _ in range(3)))]
            return warmed, client.opened, statuses
        finally:
            await client.aclose()
            server.close()
            await server.wait_closed()

    assert asyncio.run(main()) == (3, 3, [200, 200, 200])
