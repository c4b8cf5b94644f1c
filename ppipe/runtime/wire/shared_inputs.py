"""Inputs handed to a worker on the same machine through shared memory instead of a socket.

A request's input reaches its first worker through the process that holds it (the
frontend, or an ingress). Over a loopback socket that costs the sender the kernel's copy
into the socket and its loopback processing, and the worker the copy out; at detection
sizes (12.8 MB a request) that is most of the sender's CPU per request. Here the sender's
HTTP body is copied into shared memory as it comes, where it was joined into a fresh
``bytes`` (the same one copy), its tensors are views of it, and a stage message to a worker on this machine names where
each row lies instead of carrying its bytes; the worker maps that memory once and reads
the rows in place.

**Sender: :class:`InputArena`.** Memory comes from ``memfd`` segments of
:data:`SEGMENT_BYTES` cut into slots of one size class (a power of two up to 1 MiB, whole
MiB above), each class with a free list. :meth:`InputArena.take` hands out a slot as a
writable ``uint8`` array; the slot goes back to its free list when the last view of that
array is gone (``weakref.finalize``: NumPy views, and the memoryviews and arrays made
from them, keep their base alive), so the lifetime needs no bookkeeping on any path: a
body answered 400, a request dropped, one served. :meth:`InputArena.locate` names where
an array lies, ``(pid, fd, serial, offset)``, or None when it is not in the arena. A
segment's pages fault in once, when a slot is first written, and are reused after that.
The arena holds at most ``limit_bytes`` of segments; past that, and for bodies under
``min_bytes``, :meth:`take` gives None and the caller uses ordinary memory (inline
tensors on the wire).

**Receiver: :class:`SharedMaps`.** A worker opens a segment through
``/proc/<pid>/fd/<fd>`` of the sender (no name in ``/dev/shm``, so nothing is left behind
when a process dies) and maps it read-only, once per segment. It maps only memfds that
this module made, of the serial named (the memfd's name holds it), so a ref cannot point
a worker at another file of the process. A segment whose sender has ended is unmapped the
next time a segment is mapped.

**Why this is safe with no message back.** A slot is reused only when the sender holds
no view of it; the sender holds a request's input until the request is answered (its
HTTP handler does), and a request is answered after its last stage ran, long after the
first worker read its input. A request answered early (dropped on a deadline, its batch
failed) lets its slot go while the worker may still read it; what that worker computes
then is for a request that already has its answer, so nothing reaches a client.

Where a worker is on another machine, or the arena is off (``PPIPE_SHARED_INPUTS_MB=0``:
also for workers that cannot open the sender's ``/proc`` entries, e.g. in another PID
namespace), inputs travel on the socket as before. The same switch turns off the feature
maps that workers hand each other through memory of this kind (:mod:`ppipe.runtime.wire.handoff`).
"""

from __future__ import annotations

import bisect
import logging
import mmap
import os
import secrets
import threading
import weakref
from collections import deque
from typing import NamedTuple

import numpy as np

from ppipe.runtime.wire.addresses import on_this_machine

log = logging.getLogger("ppipe.runtime")

SEGMENT_BYTES = 64 * 1024 * 1024  # memory of one memfd (a slot larger than this gets a segment of its own)
DEFAULT_LIMIT_MB = 1024  # segments one process may hold (PPIPE_SHARED_INPUTS_MB; 0 turns shared inputs off)
DEFAULT_MIN_BYTES = 64 * 1024  # smaller bodies are plain bytes: a socket moves them as cheaply
KEEP_RESIDENT = 4  # free slots of each size class a trim leaves resident (those taken next)
MEMFD_PREFIX = "ppipe-inputs-"
ALIGN = 64  # a body is placed so that its tensors start on this boundary
PAGE = 4096


class SharedRef(NamedTuple):
    """Where a row lies: segment ``fd`` of process ``pid`` (its memfd named with ``serial``), at ``offset``."""

    pid: int
    fd: int
    serial: int
    offset: int


class SharedInputError(ValueError):
    """A ref this process cannot map (not a segment of this module, gone, or out of its bounds)."""


def slot_bytes(nbytes: int) -> int:
    """The size class of a slot for ``nbytes``: a power of two up to 1 MiB, whole MiB above."""
    if nbytes <= 1 << 20:
        return max(PAGE, 1 << (nbytes - 1).bit_length())
    return -(-nbytes // (1 << 20)) << 20


class _Segment:
    def __init__(self, slot: int, slots: int):
        self.serial = secrets.randbits(62)
        self.fd = os.memfd_create(f"{MEMFD_PREFIX}{self.serial}", os.MFD_CLOEXEC)
        self.size = slot * slots
        os.ftruncate(self.fd, self.size)
        self.map = mmap.mmap(self.fd, self.size)
        self.array = np.frombuffer(self.map, np.uint8)
        self.base = self.array.ctypes.data


class InputArena:
    """Slots of shared memory for inputs (see the module's docstring). Thread-safe: bodies
    are filled on the event loop, and slots come back from whichever thread drops the last view."""

    def __init__(self, limit_bytes: int = DEFAULT_LIMIT_MB << 20, min_bytes: int = DEFAULT_MIN_BYTES, keep_resident: int = KEEP_RESIDENT):
        self.limit_bytes, self.min_bytes, self.keep_resident = limit_bytes, min_bytes, keep_resident
        self.pid = os.getpid()
        self.held_bytes = 0  # of segments
        self._lent = 0  # bytes of slots handed out, less those on their free lists again
        self.located = 0  # arrays named by where they lie (sent, or offered to a scheduler, without their bytes)
        self._segments: list[_Segment] = []  # by base address
        self._bases: list[int] = []
        self._free: dict[int, list[tuple[_Segment, int]]] = {}  # slot size -> free (segment, offset)
        self._written: set[tuple[_Segment, int]] = set()  # free slots whose pages may be resident (trim gives them back)
        self._returned: deque[tuple[int, _Segment, int]] = deque()  # slots given back, not yet on their free lists
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray | None:
        """A writable ``uint8`` array of ``nbytes`` in a slot, or None (too small to share, or
        the arena is full): the slot comes back when the last view of the array is gone."""
        if nbytes < self.min_bytes or nbytes <= 0:
            return None
        size = slot_bytes(nbytes)
        with self._lock:
            self._take_returned()
            free = self._free.setdefault(size, [])
            if not free and not self._grow(size, free):
                return None
            seg, offset = free.pop()
            self._written.discard((seg, offset))
            self._lent += size
        # an array on the mmap itself, not a view of seg.array: NumPy points a view's base at
        # the first array up the chain whose own base is not an array, so views of this one
        # (and arrays on memoryviews of them) keep *it* alive, and its finalizer is the slot's end
        arr = np.frombuffer(seg.map, np.uint8, count=nbytes, offset=offset)
        weakref.finalize(arr, self._give_back, size, seg, offset)
        return arr

    def _grow(self, size: int, free: list) -> bool:
        slots = max(1, SEGMENT_BYTES // size)
        if self.held_bytes + size * slots > self.limit_bytes:
            slots = (self.limit_bytes - self.held_bytes) // size
            if slots < 1:
                return False
        try:
            seg = _Segment(size, slots)
        except OSError as exc:  # no memory for tmpfs, or out of descriptors: inputs go on the socket
            log.warning("shared inputs: no new segment of %d bytes (%s); inputs go on the socket", size * slots, exc)
            return False
        self.held_bytes += seg.size
        i = bisect.bisect(self._bases, seg.base)
        self._bases.insert(i, seg.base)
        self._segments.insert(i, seg)
        free.extend((seg, k * size) for k in reversed(range(slots)))
        return True

    def _give_back(self, size: int, seg: _Segment, offset: int) -> None:
        """A slot's last view is gone. This runs wherever that happens: where a reference
        drops, or inside any allocation that sets off the cyclic collector, on any thread,
        and so also inside this arena's own locked sections. It therefore takes no lock
        (waiting for one that its own thread holds would stop that thread for good):
        ``deque.append`` is atomic, and the next :meth:`take`, :meth:`trim` or
        :attr:`lent_bytes` puts the slot back on its free list."""
        self._returned.append((size, seg, offset))

    def _take_returned(self) -> None:
        """Put the slots given back on their free lists (the lock held; a slot given back
        meanwhile is appended to ``_returned`` and taken by this same loop)."""
        while self._returned:
            size, seg, offset = self._returned.popleft()
            self._free[size].append((seg, offset))
            self._written.add((seg, offset))
            self._lent -= size

    @property
    def lent_bytes(self) -> int:
        """Bytes of the slots handed out and not given back yet."""
        with self._lock:
            self._take_returned()
            return self._lent

    def trim(self) -> int:
        """Give back the pages of the free slots written since they were last trimmed
        (``MADV_REMOVE``: the memfd's pages are freed, a slot reads zeros until written
        again), but for the ``keep_resident`` of each size class that are taken next;
        returns the bytes given back. Called every few seconds, it bounds what the arena
        holds by what is in use, not by its largest burst (as ``malloc_trim`` does the
        heap's), while the next few bodies of each size find their pages in place (a page
        written for the first time costs a fault, dear on a VM)."""
        freed = 0
        with self._lock:
            self._take_returned()
            for size, free in self._free.items():
                for seg, offset in free[: max(0, len(free) - self.keep_resident)]:  # (the list's end is taken next)
                    if (seg, offset) in self._written:
                        seg.map.madvise(mmap.MADV_REMOVE, offset, size)
                        self._written.discard((seg, offset))
                        freed += size
        return freed

    def prefault(self, nbytes: int, count: int | None = None) -> int:
        """Write the pages of ``count`` slots of ``nbytes``' size class now (default:
        ``keep_resident``, which a trim leaves in place), so that the first bodies or maps of
        that size do not fault their pages in on a request's path; returns how many."""
        slots = [s for s in (self.take(nbytes) for _ in range(self.keep_resident if count is None else count)) if s is not None]
        for slot in slots:
            slot[:] = 0
        return len(slots)

    def locate(self, arr: np.ndarray) -> SharedRef | None:
        """Where a C-contiguous array lies in the arena, or None (elsewhere, or not contiguous)."""
        if not self._bases or not arr.flags.c_contiguous:
            return None
        addr = arr.ctypes.data
        i = bisect.bisect(self._bases, addr) - 1
        if i < 0:
            return None
        seg = self._segments[i]
        if addr + arr.nbytes > seg.base + seg.size:
            return None
        self.located += 1
        return SharedRef(self.pid, seg.fd, seg.serial, addr - seg.base)

    def share(self, arr: np.ndarray) -> np.ndarray | None:
        """``arr`` where it lies in the arena: itself where it does already, else a copy in a
        slot (which lives as long as the copy); None where it cannot (an array of objects, too
        small to share, or the arena is full)."""
        if self.locate(arr) is not None:
            return arr
        if arr.dtype.hasobject:
            return None
        slot = self.take(arr.nbytes)
        if slot is None:
            return None
        copy = slot.view(arr.dtype).reshape(arr.shape)
        np.copyto(copy, arr)
        return copy

    def body(self, nbytes: int, lead: int = 0) -> memoryview | None:
        """A writable view of ``nbytes`` in a slot, placed so that its byte ``lead`` (where a
        body's tensors start) lies on an :data:`ALIGN` boundary; None where :meth:`take` gives none."""
        pad = -lead % ALIGN
        slot = self.take(nbytes + pad)
        return None if slot is None else memoryview(slot)[pad:]


class SharedMaps:
    """The segments of other processes that this process has mapped (see the module's docstring)."""

    def __init__(self) -> None:
        self._maps: dict[tuple[int, int], tuple[int, np.ndarray]] = {}  # (pid, fd) -> (serial, the segment's bytes)
        self._lock = threading.Lock()

    def array(self, ref: SharedRef, nbytes: int) -> np.ndarray:
        """A read-only ``uint8`` view of ``nbytes`` at ``ref``.

        Raises:
            SharedInputError: the segment cannot be mapped, or the bytes lie outside it.
        """
        seg = self._segment(ref)
        if ref.offset < 0 or nbytes < 0 or ref.offset + nbytes > len(seg):
            raise SharedInputError(f"{nbytes} bytes at offset {ref.offset} lie outside the {len(seg)}-byte segment of process {ref.pid}")
        return seg[ref.offset : ref.offset + nbytes]

    def _segment(self, ref: SharedRef) -> np.ndarray:
        with self._lock:
            have = self._maps.get((ref.pid, ref.fd))
            if have is not None and have[0] == ref.serial:
                return have[1]
            seg = _map(ref)
            self._let_go_of_ended_senders()
            self._maps[(ref.pid, ref.fd)] = (ref.serial, seg)
            return seg

    def _let_go_of_ended_senders(self) -> None:
        for key in [k for k in self._maps if not _alive(k[0])]:
            del self._maps[key]


def _map(ref: SharedRef) -> np.ndarray:
    path = f"/proc/{ref.pid}/fd/{ref.fd}"
    try:
        name = os.readlink(path)
        if not name.startswith(f"/memfd:{MEMFD_PREFIX}{ref.serial} "):
            raise SharedInputError(f"{path} is {name!r}, not the shared-input segment {ref.serial}")
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise SharedInputError(f"cannot open the sender's segment {path} ({exc.strerror}); a worker in another PID "
                               "namespace or of another user cannot: start the server with PPIPE_SHARED_INPUTS_MB=0") from None
    try:
        size = os.fstat(fd).st_size
        mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    return np.frombuffer(mapped, np.uint8)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # (a PermissionError: alive, another user's)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


_arena: InputArena | None = None
_arena_made = False
_maps = SharedMaps()


def process_arena() -> InputArena | None:
    """This process's arena (made on first use, sized by ``PPIPE_SHARED_INPUTS_MB``), or None
    when shared inputs are off or the system has no memfd. A forked child makes its own."""
    global _arena, _arena_made
    if not _arena_made:
        _arena, _arena_made = new_arena(), True
    return _arena


def _forget_arena_in_child() -> None:
    """A forked child's arena is its own (the parent's slots are the parent's to hand out);
    forgetting it here keeps ``os.getpid()``, a system call, off every request."""
    global _arena, _arena_made
    _arena, _arena_made = None, False


os.register_at_fork(after_in_child=_forget_arena_in_child)


def new_arena(min_bytes: int = DEFAULT_MIN_BYTES) -> InputArena | None:
    """A new arena sized by ``PPIPE_SHARED_INPUTS_MB`` (giving no slot under ``min_bytes``), or
    None when shared memory is off or the system has no memfd."""
    raw = os.environ.get("PPIPE_SHARED_INPUTS_MB", str(DEFAULT_LIMIT_MB))
    try:
        limit_mb = int(raw)
    except ValueError:
        log.warning("PPIPE_SHARED_INPUTS_MB=%r is not a whole number of MB; shared inputs are off", raw)
        return None
    if limit_mb <= 0 or not hasattr(os, "memfd_create"):
        return None
    return InputArena(limit_mb << 20, min_bytes)


_more_arenas: weakref.WeakSet[InputArena] = weakref.WeakSet()  # this process's other arenas (feature maps')


def trim_with_process_arena(arena: InputArena) -> None:
    """Trim ``arena`` whenever the process's own is trimmed (:func:`trim_process_arena`), for as long as it lives."""
    _more_arenas.add(arena)


BODY_HEAD_BYTES = 4096  # room for a binary body's JSON header beside its tensors


def prefault_input_slots(input_bytes: list[int]) -> int:
    """Write ahead the slots this process's arena gives bodies of these inputs' sizes
    (:meth:`InputArena.prefault`), so that a fresh server's first requests find their pages
    in place; returns the slots written (0 where shared inputs are off)."""
    arena = process_arena()
    if arena is None:
        return 0
    return sum(arena.prefault(n + BODY_HEAD_BYTES) for n in sorted(set(input_bytes)) if n + BODY_HEAD_BYTES >= arena.min_bytes)


def trim_process_arena() -> int:
    """:meth:`InputArena.trim` of this process's arena, if it has made one, and of the arenas
    given to :func:`trim_with_process_arena`; the bytes given back."""
    own = _arena.trim() if _arena is not None else 0
    return own + sum(a.trim() for a in list(_more_arenas))


def shared_arena_for(addr: str) -> InputArena | None:
    """This process's arena where the peer at ``addr`` (a data-path address) is on this
    machine (a loopback address, or this node's), else None."""
    return process_arena() if on_this_machine(addr) else None


def process_maps() -> SharedMaps:
    """The segments this process has mapped from its senders."""
    return _maps
