"""The one interface through which the scheduler's host and plan control reach a worker.

A launcher (:mod:`ppipe.runtime.launch.inproc` in one process, Ray across machines) starts
a plan's workers and hands back one :class:`WorkerHandle` per vGPU; nothing outside the
launchers knows how a worker runs or how a call reaches it. The calls are few and small:
they set the data path up and watch the worker's life. Batches never pass through them
(they go over :mod:`ppipe.runtime.wire`).
"""

from __future__ import annotations

from typing import Protocol


class WorkerGone(RuntimeError):
    """The worker behind a handle is gone: its process died, was killed, or its node left."""


class WorkerHandle(Protocol):
    """One vGPU worker, wherever it runs. Every call is a coroutine except :meth:`kill`.

    A call on a gone worker raises :class:`WorkerGone`.
    """

    vgpu_id: str

    async def open_data_path(self, frontend: str, secret: bytes | None = None) -> str:
        """Bind the worker's inbox and connect it to the frontend's ``frontend``; returns the inbox's address.

        ``secret``: the server's data-path secret: the worker's connections prove it, and
        its inbox reads only connections that do (:mod:`ppipe.runtime.wire.handshake`)."""

    async def connect_peers(self, peers: list[str]) -> None:
        """Connect to the next stages' workers (data-path addresses) before the first batch."""

    async def lifeline(self) -> None:
        """Returns, or raises :class:`WorkerGone`, only when the worker is gone; the host awaits it to learn so."""

    async def drop_peer(self, peer: str, gens: list[int] | None = None) -> int:
        """``peer`` died: abort the worker's NCCL and ring edges with it (``gens``: only those
        generations); returns how many were aborted."""

    async def close_edges(self, edges: list[tuple[str, int]]) -> int:
        """Tear down the edges ``(peer, generation)`` an earlier plan used; returns how many."""

    def kill(self) -> None:
        """Stop the worker now, without waiting (its lifeline then ends)."""
