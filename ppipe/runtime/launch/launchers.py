"""The two launchers of a served plan's workers, by name: ``local`` and ``ray``.

* ``local`` (:mod:`ppipe.runtime.launch.local`): a process per vGPU on this machine, no
  Ray; the default of ``ppipe serve`` on one machine. Its frontend shards are local
  processes too (:mod:`ppipe.runtime.launch.local_shards`), each starting its own workers.
* ``ray`` (:mod:`ppipe.runtime.launch.deploy`): a Ray actor per vGPU, on the node of its
  server; needed for several machines (and for NCCL edges). Its frontend shards are Ray
  actors (:mod:`ppipe.runtime.launch.shards`).

Both hand back :class:`~ppipe.runtime.launch.handle.WorkerHandle` objects; the host, plan
switches and re-creation after a failure take the launcher's two functions from here and
never ask which one runs.
"""

from __future__ import annotations

from typing import Any, Callable

LAUNCHERS = ("local", "ray")


def start_function(launcher: str) -> Callable[..., dict[str, Any]]:
    """``start(dep, backend, backend_options, start_timeout_s, only)``: the launcher's start of a plan's workers."""
    if launcher == "local":
        from ppipe.runtime.launch.local import start_local_workers

        return start_local_workers
    if launcher == "ray":
        from ppipe.runtime.launch.deploy import start_workers

        return start_workers
    raise ValueError(f"launcher must be one of {', '.join(LAUNCHERS)}, got {launcher!r}")


def respawn_function(launcher: str) -> Callable[..., Any]:
    """``respawn(dep, vgpu_id, backend, backend_options)``: the launcher's re-creation of one worker."""
    if launcher == "local":
        from ppipe.runtime.launch.local import respawn_local_worker

        return respawn_local_worker
    if launcher == "ray":
        from ppipe.runtime.launch.deploy import respawn_worker

        return respawn_worker
    raise ValueError(f"launcher must be one of {', '.join(LAUNCHERS)}, got {launcher!r}")
