"""Data-path addresses, which machine they are on, and the local socket beside each port.

An address is ``tcp://host:port``: a listener (:class:`~ppipe.runtime.wire.datapath.Inbox`)
listens on TCP there, and, on Linux, also on an abstract Unix socket named by that host
and port (:func:`local_name`; only processes of this machine's network namespace can reach it, and
nothing is left in the file system; TCP's own binding keeps a name to one listener). A connector on the same machine (a loopback address,
or this node's) connects there first (:func:`connect_local`): no TCP segment is built,
checksummed and acknowledged, so a small message costs its writer less and a large one
moves faster. It uses the socket only if the listener runs as the same user
(``SO_PEERCRED``): another user's process cannot stand in for a port by taking its name
first. Where the local socket is missing or refused, the connector uses TCP.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
import struct
import sys
from typing import Any, Callable

LOOPBACK = "127.0.0.1"
LOCAL_BUFFER_BYTES = 4 << 20
"""A local socket's send buffer: large enough that a megabyte write goes in at once (the
default, ~200 kB, makes the two ends take turns on a feature map)."""


def split_address(addr: str) -> tuple[str, int]:
    """``tcp://host:port`` -> ``(host, port)``."""
    host, _, port = addr.split("://", 1)[-1].rpartition(":")
    return host.strip("[]"), int(port)


def is_loopback_address(addr: str) -> bool:
    """Whether a ``tcp://host:port`` address is on the loopback interface."""
    host = split_address(addr)[0]
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def node_host() -> str:
    """The address this process's data-path sockets bind: the loopback address when Ray is
    not running or every alive Ray node is this host, else this node's address in Ray.

    A process that has not imported Ray cannot have joined a Ray session, so Ray is looked
    up in ``sys.modules`` rather than imported: every process of the local launcher would
    otherwise pay Ray's import time at start for nothing."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return LOOPBACK
    here = ray.util.get_node_ip_address()
    nodes = {n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}
    return LOOPBACK if nodes <= {here} else here


_machine_of: dict[str, str] = {}


def machine_of(addr: str) -> str:
    """The host that names the machine of the peer at ``addr``: this node's for a loopback
    address, else the address's own (remembered per address)."""
    host = _machine_of.get(addr)
    if host is None:
        if len(_machine_of) > 4096:  # peers of plans long gone
            _machine_of.clear()
        host = _machine_of[addr] = node_host() if is_loopback_address(addr) else split_address(addr)[0]
    return host


_here: dict[str, bool] = {}


def on_this_machine(addr: str) -> bool:
    """Whether the peer at ``addr`` is on this machine: a loopback address, or this node's
    (remembered per address: :func:`node_host` asks Ray)."""
    here = _here.get(addr)
    if here is None:
        if len(_here) > 4096:
            _here.clear()
        here = _here[addr] = machine_of(addr) == node_host()
    return here


def same_machine(a: str, b: str) -> bool:
    """Whether the peers at ``a`` and ``b`` are on one machine (so that one may read the
    other's shared memory)."""
    return machine_of(a) == machine_of(b)


def local_sockets_enabled() -> bool:
    """Local sockets are used on Linux unless ``PPIPE_LOCAL_SOCKETS=0``."""
    return sys.platform.startswith("linux") and os.environ.get("PPIPE_LOCAL_SOCKETS", "1") != "0"


def local_name(host: str, port: int) -> str:
    """The abstract Unix socket name beside TCP ``host:port`` (the host too: two processes
    may hold one port number on two addresses of a machine)."""
    return f"\0ppipe-data-path-{host}:{port}"


def listen_local(host: str, port: int) -> socket.socket | None:
    """A non-blocking abstract Unix socket listening beside TCP ``host:port``, or None where
    local sockets are off or the name is taken."""
    if not local_sockets_enabled():
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(local_name(host, port))
    except OSError:
        sock.close()
        return None
    sock.listen(1024)
    sock.setblocking(False)
    return sock


def _credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket (``SO_PEERCRED``)."""
    return struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))


def local_peer(transport: Any) -> str:
    """Who is at the other end of an accepted local socket, for a log line."""
    try:
        pid, uid, _ = _credentials(transport.get_extra_info("socket"))
    except (OSError, AttributeError, TypeError):
        return "a process of this machine (a local socket)"
    return f"process {pid} (user {uid}) of this machine (a local socket)"


async def connect_local(factory: Callable[[], asyncio.Protocol], addr: str) -> tuple[Any, Any]:
    """Connect ``factory()``'s protocol to the local socket beside ``addr``'s port.

    Raises:
        OSError: there is none (or local sockets are off), or its listener runs as another user.
    """
    if not local_sockets_enabled():
        raise ConnectionRefusedError("local sockets are off (PPIPE_LOCAL_SOCKETS=0)")
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, LOCAL_BUFFER_BYTES)
        sock.setblocking(False)
        await loop.sock_connect(sock, local_name(*split_address(addr)))
        _, uid, _ = _credentials(sock)
        if uid != os.getuid():
            raise PermissionError(f"the local socket of {addr} is held by user {uid}, not this process's")
    except BaseException:
        sock.close()
        raise
    return await loop.create_unix_connection(factory, sock=sock)
