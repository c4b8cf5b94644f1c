"""The data path's local sockets: a peer on this machine is reached by the abstract Unix
socket beside its port, or by TCP where that socket is off, missing or another user's."""

from __future__ import annotations

import asyncio
import os
import socket
import sys

import msgspec
import numpy as np
import pytest

from ppipe.runtime.wire import addresses
from ppipe.runtime.wire.datapath import Inbox, Outbox
from ppipe.runtime.wire.frames import pack, unpack

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract Unix sockets are Linux's")


class Probe(msgspec.Struct, array_like=True, frozen=True):
    i: int


def _send_and_see(x: np.ndarray, secret: bytes | None = None) -> tuple[np.ndarray, int]:
    """Send ``x`` from an outbox to an inbox on loopback; (what came, the family of the outbox's socket)."""

    async def main():
        got = asyncio.get_running_loop().create_future()
        inbox = Inbox(lambda m: got.set_result(unpack(m, Probe)[1]["x"].copy()), secret=secret)
        out = Outbox(secret)
        out.send(inbox.address, pack(Probe(1), {"x": x}))
        came = await asyncio.wait_for(got, 20)
        family = out.peers[inbox.address].raw.get_extra_info("socket").family
        out.close(), inbox.close()
        return came, family

    return asyncio.run(main())


@pytest.mark.parametrize("mb", [0.001, 9])
@pytest.mark.parametrize("secret", [None, b"k" * 32], ids=["open", "authenticated"])
def test_a_peer_on_this_machine_is_reached_by_its_local_socket(mb, secret):
    x = np.random.default_rng(3).standard_normal(int(mb * 2**20) // 4).astype(np.float32)
    came, family = _send_and_see(x, secret)
    assert family == socket.AF_UNIX
    assert came.tobytes() == x.tobytes()


def test_with_local_sockets_off_the_peer_is_reached_by_tcp(monkeypatch):
    monkeypatch.setenv("PPIPE_LOCAL_SOCKETS", "0")
    x = np.arange(1000, dtype=np.float32)
    came, family = _send_and_see(x)
    assert family in (socket.AF_INET, socket.AF_INET6)
    assert came.tobytes() == x.tobytes()


def test_a_local_socket_held_by_another_user_is_not_used(monkeypatch):
    """``SO_PEERCRED`` names the listener's user; another's is refused, and TCP carries the message."""
    monkeypatch.setattr(addresses.os, "getuid", lambda: os.geteuid() + 1)
    x = np.arange(1000, dtype=np.float32)
    came, family = _send_and_see(x)
    assert family in (socket.AF_INET, socket.AF_INET6)
    assert came.tobytes() == x.tobytes()


def test_a_taken_name_leaves_the_port_to_tcp():
    where = ("127.0.0.1", 1)  # a TCP port no data path binds; its local name is free until taken here
    first = addresses.listen_local(*where)
    assert first is not None
    try:
        assert addresses.listen_local(*where) is None
    finally:
        first.close()
    again = addresses.listen_local(*where)
    assert again is not None  # an abstract name is gone with its socket: nothing to clean up
    again.close()


def test_a_listener_without_a_local_socket_is_reached_by_tcp(monkeypatch):
    """A listener that made none (local sockets off in its process, or its name taken):
    the connector finds nothing there and connects by TCP."""
    x = np.arange(1000, dtype=np.float32)

    async def main():
        got = asyncio.get_running_loop().create_future()
        monkeypatch.setenv("PPIPE_LOCAL_SOCKETS", "0")
        inbox = Inbox(lambda m: got.set_result(unpack(m, Probe)[1]["x"].copy()))
        monkeypatch.delenv("PPIPE_LOCAL_SOCKETS")
        out = Outbox()
        out.send(inbox.address, pack(Probe(1), {"x": x}))
        came = await asyncio.wait_for(got, 20)
        family = out.peers[inbox.address].raw.get_extra_info("socket").family
        out.close(), inbox.close()
        return came, family

    came, family = asyncio.run(main())
    assert family in (socket.AF_INET, socket.AF_INET6)
    assert came.tobytes() == x.tobytes()
