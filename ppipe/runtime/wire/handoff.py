"""Feature maps handed to the next stage's worker on this machine through shared memory.

Between two workers on one machine without an NCCL or ring edge, a stage's output went
to the next stage on a local socket: the sender's copy into the kernel, then the
receiver's copy out, a few hundred microseconds of CPU per megabyte on both sides, and the
next stage starts that much later. Here the sender
writes the map once into a slot of shared memory of its own (an
:class:`~ppipe.runtime.wire.shared_inputs.InputArena` kept for maps), the stage message
names where it lies as a shared input is named, and the receiver reads it in place: one
copy in all, no bytes on the socket.

**Lifetime without a message back.** The sender holds a slot until the receiving stage's
reserved end plus :data:`HOLD_GRACE_US` (:meth:`MapHandoff.place`); after that the slot
may carry another map. A receiver that runs later than that must not compute on a
reused slot, so every slot begins with a seal: 8 bytes that are zero while a map is
written and a random nonzero token once it is (:class:`~ppipe.runtime.wire.messages.Seal`,
named in the stage message). The receiver checks its seals after its stage ran
(:func:`check_seals`): a seal that changed means a writer began on the slot, and the
stage fails (an error report; its batch's requests are answered ``worker-error``), so a
reused slot never becomes an answer. (A trim that gave a free slot's pages back reads as
zero, so it fails the check too.) Token collisions aside (2**-63), a seal equal to its
token after the stage means no new writer had started when the stage ended. That
argument needs each core's stores seen in order: x86-64 keeps them so (and glibc's
``memcpy`` fences its non-temporal stores); elsewhere (ARM's weaker order) the handoff is
off and maps go on the socket (:meth:`MapHandoff.for_this_process`).

Maps under :data:`MIN_MAP_BYTES`, where a socket moves them as cheaply as the copy and
the seals cost (``scripts/bench_datapath.py --handoff``), or where the arena is full or
off (``PPIPE_SHARED_INPUTS_MB=0``), travel on the socket as before.
"""

from __future__ import annotations

import heapq
import itertools
import platform
import secrets
from typing import Any

import numpy as np

from ppipe.runtime.wire.messages import Seal
from ppipe.runtime.wire.shared_inputs import (InputArena, SharedInputError, SharedMaps, SharedRef, new_arena, process_maps,
                                              trim_with_process_arena)

SEAL_BYTES = 64  # the slot's first bytes: the seal (8 bytes), then padding that keeps the map aligned
HOLD_GRACE_US = 200e3  # a slot is held this long past its receiving stage's reserved end
MIN_MAP_BYTES = 512 * 1024  # smaller maps go on the socket


class MapReused(RuntimeError):
    """A stage's input map lay in a slot that its sender began to reuse before the stage ended."""


class MapHandoff:
    """The sender's side: slots for the maps this worker sends to workers on its machine.

    Args:
        arena: where the slots come from (:meth:`for_this_process`: an arena of its own,
            sized as the shared inputs' are, trimmed with them).
    """

    def __init__(self, arena: InputArena):
        self.arena = arena
        self._held: list[tuple[float, int, np.ndarray]] = []  # (until, order, slot): a heap by until
        self._order = itertools.count()

    @classmethod
    def for_this_process(cls) -> "MapHandoff | None":
        """A handoff with an arena of its own, or None where shared memory is off or the
        machine does not keep stores in order (not x86-64: see the module's docstring)."""
        if platform.machine().lower() not in ("x86_64", "amd64"):
            return None
        arena = new_arena(min_bytes=SEAL_BYTES + MIN_MAP_BYTES)
        if arena is None:
            return None
        trim_with_process_arena(arena)  # a burst's slots give their pages back on the process's timer
        return cls(arena)

    def place(self, tensors: dict[str, Any], hold_until_us: float, now_us: float) -> tuple[dict[str, np.ndarray], tuple[Seal, ...]] | None:
        """Copy each tensor into a sealed slot, held until ``hold_until_us`` (wall clock):
        ``(the tensors where they now lie, their seals)``, or None where one of them has no
        slot (too small, or the arena is full): then they all go on the socket."""
        self._let_go(now_us)
        placed: dict[str, np.ndarray] = {}
        seals: list[Seal] = []
        slots: list[np.ndarray] = []
        for name, arr in tensors.items():
            arr = np.asarray(arr)
            slot = None if arr.dtype.hasobject else self.arena.take(SEAL_BYTES + arr.nbytes)
            if slot is None:
                return None  # (the slots taken so far go back as they are dropped)
            seal = slot[:8].view(np.uint64)
            seal[0] = 0
            data = slot[SEAL_BYTES:].view(arr.dtype).reshape(arr.shape)
            np.copyto(data, arr)
            token = secrets.randbits(63) + 1
            seal[0] = token
            placed[name] = data
            seals.append(Seal(tuple(self.arena.locate(slot)), token))
            slots.append(slot)
        for slot in slots:
            heapq.heappush(self._held, (hold_until_us, next(self._order), slot))
        return placed, tuple(seals)

    def prefault(self, nbytes: int) -> int:
        """Write ahead the slots that maps of ``nbytes`` take first
        (:meth:`~ppipe.runtime.wire.shared_inputs.InputArena.prefault`); how many."""
        return self.arena.prefault(SEAL_BYTES + nbytes) if SEAL_BYTES + nbytes >= self.arena.min_bytes else 0

    def _let_go(self, now_us: float) -> None:
        """Drop the slots whose hold has ended (each goes back to the arena with its last view)."""
        held = self._held
        while held and held[0][0] < now_us:
            heapq.heappop(held)

    @property
    def held(self) -> int:
        """Slots held now."""
        return len(self._held)


def check_seals(seals: tuple[Seal, ...], maps: SharedMaps | None = None) -> None:
    """Raise :class:`MapReused` where a seal no longer holds its token (see the module's docstring)."""
    maps = maps or process_maps()
    for s in seals:
        try:
            now = int(maps.array(SharedRef(*s.ref), 8).view(np.uint64)[0])
        except SharedInputError as exc:
            raise MapReused(f"cannot read the seal of an input map: {exc}") from None
        if now != s.token:
            raise MapReused(f"the input map's slot in process {s.ref[0]} was reused before this stage ended: the stage ran more "
                            f"than {HOLD_GRACE_US / 1e3:.0f} ms past its reservation, so its output is not used")

