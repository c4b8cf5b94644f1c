"""Ray object references that ppipe does not wait for, consumed on purpose.

Ray logs ``Unhandled error (suppress with 'RAY_IGNORE_UNHANDLED_ERRORS=1'): ...`` with a
traceback for every object reference that holds an error and is garbage-collected before
anyone retrieved it (Ray's docs: an error is "handled" once ``ray.get`` or ``await`` has
seen it). ppipe abandons some calls on purpose, e.g. the start-up pings of workers it kills
after one failed. When the callee dies those references hold ``ActorDiedError`` /
``ActorUnavailableError``, and the log fills with tracebacks that say nothing the user
must act on (ppipe logs one line of its own per event: a vGPU lost, a vGPU back).

So every such reference goes through :func:`consume` (on an event loop) or
:func:`settle` (blocking code): its result or error is retrieved and dropped, the error
logged at debug level. Setting ``RAY_IGNORE_UNHANDLED_ERRORS`` would hide real errors too.
The calls the scheduler's host does not wait for need neither: each is a coroutine of a
:class:`~ppipe.runtime.launch.ray_workers.RayWorkerHandle` that awaits its reference.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Iterable

log = logging.getLogger("ppipe.runtime")

_tasks: set[asyncio.Task] = set()  # a task is only weakly held by its loop


def consume(ref: Any, what: str) -> asyncio.Task:
    """Await ``ref`` in a task of the running loop and drop its result; an error is logged
    at debug level as ``what``'s. Returns the task (it keeps itself alive until done)."""

    async def wait() -> None:
        try:
            await ref
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the callee died or raised: expected for these calls
            log.debug("%s failed (ignored): %s", what, _first_line(exc))

    task = asyncio.get_running_loop().create_task(wait())
    _tasks.add(task)
    task.add_done_callback(_tasks.discard)
    return task


def settle(refs: Iterable[Any], timeout_s: float = 10.0) -> int:
    """Retrieve every reference of ``refs`` (blocking up to ``timeout_s`` in all) and drop
    the results and errors; returns how many held an error. References still pending at the
    timeout are left (their callee is being killed, so they end with an error Ray logs
    once at most)."""
    import ray

    refs = list(refs)
    if not refs:
        return 0
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s, fetch_local=False)
    errors = 0
    for r in ready:
        try:
            ray.get(r, timeout=0)
        except Exception:
            errors += 1
    return errors


def kill_quietly(handle: Any) -> None:
    """``ray.kill(handle)``, ignoring an actor that is gone already (its node died)."""
    import ray

    try:
        ray.kill(handle, no_restart=True)
    except Exception as exc:  # pragma: no cover - best effort
        log.debug("ray.kill of a gone worker: %s", _first_line(exc))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
