"""A minimal asyncio HTTP/1.1 client for the load generator.

Why not httpx: its connection pool costs several ms of CPU per request once a hundred
requests are in flight (measured here: 6-8 ms per request at 100-200 concurrent, against
~2 ms at 10), so at the rates an open-loop benchmark needs the generator, not the server,
would be the bottleneck. This client keeps idle keep-alive connections on a stack and opens
a new one whenever all are busy; it speaks just enough HTTP/1.1 for `ppipe serve`
(Content-Length or chunked bodies). ``ppipe bench --client httpx`` uses httpx instead.
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit


class HttpError(Exception):
    """The connection failed or the answer was not HTTP/1.1."""


class RawHttpClient:
    """POST/GET over a growing pool of keep-alive connections to one host.

    Args:
        base_url: ``http://host:port`` (https is not supported).
        headers: sent with every request (e.g. authorization).
    """

    def __init__(self, base_url: str, headers: dict[str, str] | None = None, timeout_s: float = 60.0):
        u = urlsplit(base_url)
        if u.scheme != "http":
            raise ValueError(f"only http:// URLs are supported by the raw client, got {base_url}")
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self.timeout_s = timeout_s
        self._extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self.opened = 0

    async def request(self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        """Send one request; returns (status, lower-cased headers, body)."""
        head = (
            f"{method} {path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\ncontent-length: {len(body)}\r\n"
            + self._extra
            + "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
            + "\r\n"
        ).encode()
        for attempt in (0, 1):  # an idle keep-alive connection may have been closed by the server
            # the retry always opens a new connection: the other idle ones may be stale too
            fresh = attempt > 0 or not self._idle
            if fresh:
                reader, writer = await asyncio.open_connection(self.host, self.port)
                self.opened += 1
            else:
                reader, writer = self._idle.pop()
            try:
                writer.write(head)  # two writes, not head + body: that would copy the body (12.8 MB for atss)
                if body:
                    writer.write(body)
                status, hdrs, data = await asyncio.wait_for(self._read(reader), self.timeout_s)
            except (ConnectionError, asyncio.IncompleteReadError, HttpError) as exc:
                writer.close()
                if fresh or attempt:
                    raise HttpError(str(exc) or type(exc).__name__) from None
                continue
            except BaseException:
                writer.close()
                raise
            if hdrs.get("connection", "").lower() == "close":
                writer.close()
            else:
                self._idle.append((reader, writer))
            return status, hdrs, data
        raise HttpError("unreachable")  # pragma: no cover

    async def warm(self, connections: int) -> None:
        """Open ``connections`` keep-alive connections now (those a long-running client holds),
        so that the first requests do not each wait for a connection of their own."""
        opened = await asyncio.gather(*(asyncio.open_connection(self.host, self.port) for _ in range(connections)))
        self.opened += len(opened)
        self._idle.extend(opened)

    async def _read(self, reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
        line = await reader.readline()
        if not line:
            raise HttpError("connection closed")
        parts = line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
            raise HttpError(f"bad status line {line[:80]!r}")
        status = int(parts[1])
        hdrs: dict[str, str] = {}
        while True:
            h = await reader.readline()
            if h in (b"\r\n", b"\n", b""):
                break
            k, _, v = h.decode("latin-1").partition(":")
            hdrs[k.strip().lower()] = v.strip()
        if "content-length" in hdrs:
            data = await reader.readexactly(int(hdrs["content-length"]))
        elif hdrs.get("transfer-encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int((await reader.readline()).split(b";")[0], 16)
                if size == 0:
                    await reader.readline()
                    break
                chunks.append(await reader.readexactly(size))
                await reader.readline()
            data = b"".join(chunks)
        else:
            data = b""
        return status, hdrs, data

    async def aclose(self) -> None:
        for _, w in self._idle:
            w.close()
        self._idle.clear()


def wait_until_ready(url: str, process=None, timeout_s: float = 120.0) -> None:
    """Block until ``url``'s ``/v2/health/ready`` answers 200 (a server that just started).

    Raises:
        RuntimeError: ``process`` (a ``subprocess.Popen``) ended, or ``timeout_s`` passed.
    """
    import time

    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url + "/v2/health/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server at {url} exited with code {process.returncode} before it was ready")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server at {url} was not ready within {timeout_s:g} s")
        time.sleep(0.5)
