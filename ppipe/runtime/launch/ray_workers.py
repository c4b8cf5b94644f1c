"""The :class:`~ppipe.runtime.launch.handle.WorkerHandle` of a worker that runs as a Ray actor.

:func:`ppipe.runtime.launch.deploy.start_workers` and ``respawn_worker`` hand these out, so
the scheduler's host and plan control reach a Ray worker through the same calls as any
other and never say ``.remote`` or see a Ray error: a call on an actor that died, or whose
node is unreachable, raises :class:`~ppipe.runtime.launch.handle.WorkerGone`. Launch code
that needs the actor's other methods (the start-up ping, NCCL set-up) uses
:attr:`RayWorkerHandle.actor`; :func:`actor_of` takes a handle or a bare actor.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable

from ppipe.runtime.launch.handle import WorkerGone
from ppipe.runtime.memory import trim_heap_periodically, tune_for_serving
from ppipe.runtime.timerslack import tighten_timer_slack
from ppipe.runtime.workers.worker import VgpuWorker, WorkerSpec, pin_cuda_env, undo_ray_niceness
from ppipe.runtime.launch.refs import kill_quietly


class RayWorkerHandle:
    """One vGPU's worker actor (:class:`ppipe.runtime.workers.worker.VgpuWorker`) behind the
    :class:`~ppipe.runtime.launch.handle.WorkerHandle` calls.

    Args:
        vgpu_id: the vGPU the actor serves.
        actor: its Ray actor handle (picklable: a handle passed to another actor, a frontend
            shard, reaches the same worker).
    """

    def __init__(self, vgpu_id: str, actor: Any):
        self.vgpu_id, self.actor = vgpu_id, actor

    async def open_data_path(self, frontend: str, secret: bytes | None = None) -> str:
        return await _gone_on_actor_error(self.actor.open_data_path.remote(frontend, secret))

    async def connect_peers(self, peers: list[str]) -> None:
        await _gone_on_actor_error(self.actor.connect_peers.remote(peers))

    async def lifeline(self) -> None:
        """Ends only when the actor is gone; any Ray error of this call means so (Ray fails it
        as soon as the actor's process or node is gone)."""
        import ray

        try:
            await self.actor.lifeline.remote()
        except ray.exceptions.RayError as exc:  # ActorDiedError, ActorUnavailableError (its node is unreachable), ...
            raise WorkerGone(_first_line(exc)) from exc

    async def drop_peer(self, peer: str, gens: list[int] | None = None) -> int:
        return await _gone_on_actor_error(self.actor.drop_peer.remote(peer, gens))

    async def close_edges(self, edges: list[tuple[str, int]]) -> int:
        return await _gone_on_actor_error(self.actor.close_edges.remote(edges))

    def kill(self) -> None:
        """``ray.kill`` without restart; an actor already gone (its node died) is no error."""
        kill_quietly(self.actor)

    def __repr__(self) -> str:
        return f"RayWorkerHandle({self.vgpu_id!r})"


def actor_of(worker: Any) -> Any:
    """The Ray actor of ``worker``: a :class:`RayWorkerHandle`'s, or ``worker`` itself (an actor)."""
    return worker.actor if isinstance(worker, RayWorkerHandle) else worker


async def _gone_on_actor_error(ref: Awaitable[Any]) -> Any:
    """Await a call's reference; the actor's death (``RayActorError`` and its subclasses
    ``ActorDiedError``, ``ActorUnavailableError``) becomes :class:`WorkerGone`. An error the
    worker's method raised reaches the caller as Ray gives it."""
    import ray

    try:
        return await ref
    except ray.exceptions.RayActorError as exc:
        raise WorkerGone(_first_line(exc)) from exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class VgpuActor(VgpuWorker):
    """A :class:`VgpuWorker` as a Ray actor, in a process of its own, which it sets up: before
    the worker is built it pins the process to the vGPU's GPU and MPS share
    (:func:`~ppipe.runtime.workers.worker.pin_cuda_env`, before the backend loads any CUDA library) and undoes Ray's
    niceness (:func:`~ppipe.runtime.workers.worker.undo_ray_niceness`); after, it freezes the start-up objects out of the
    garbage collector's sight (a worker is on the latency path too: no full-collection
    stalls over them) and tunes the allocator as every serving process's
    (:func:`~ppipe.runtime.memory.tune_for_serving`: feature maps reuse the heap's pages),
    whose trim runs on the data path's loop once it is open, with a tight timer slack
    (:mod:`ppipe.runtime.timerslack`)."""

    def __init__(self, spec: WorkerSpec, backend: str, backend_options: dict[str, Any] | None = None):
        import ray

        from ppipe.runtime.launch.deploy import worker_env
        from ppipe.runtime.memory import freeze_startup_objects

        pin_cuda_env(worker_env(spec, backend))
        undo_ray_niceness()
        super().__init__(spec, backend, backend_options)
        self._node = ray.get_runtime_context().get_node_id()
        freeze_startup_objects()
        tune_for_serving()
        self._trimming: Any = None

    async def open_data_path(self, frontend: str, secret: bytes | None = None) -> str:
        address = await super().open_data_path(frontend, secret)
        if self._trimming is None and self._data_loop is not None:
            self._data_loop.call_soon_threadsafe(tighten_timer_slack)  # the thread its stages wait on
            self._trimming = asyncio.run_coroutine_threadsafe(trim_heap_periodically(), self._data_loop)
        return address


def actor_class():
    """The Ray actor class of a vGPU worker (:class:`VgpuActor`)."""
    import ray

    return ray.remote(VgpuActor)
