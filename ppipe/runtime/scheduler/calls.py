"""Calls to workers that the scheduler's host does not wait for.

The host tells a live peer of a dead worker to abort their edges, and the kept workers of
a plan switch to close the edges an earlier plan used, and goes on: nothing it decides
waits for the answer, and a worker that is gone (:class:`~ppipe.runtime.launch.handle.WorkerGone`)
has nothing to abort or close; its own lifeline reports its death. So each such call runs
as a task of the loop whose failure is logged at debug level, never left as an exception
nobody retrieved.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Coroutine

log = logging.getLogger("ppipe.runtime")

_tasks: set[asyncio.Task] = set()  # a task is only weakly held by its loop


def call_unawaited(call: Coroutine[Any, Any, Any], what: str) -> asyncio.Task:
    """Run ``call`` (a worker handle's coroutine) in a task of the running loop and drop its
    result; a failure is logged at debug level as ``what``'s. Returns the task (it keeps
    itself alive until done)."""

    async def run() -> None:
        try:
            await call
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the worker is gone or refused: its lifeline says which
            log.debug("%s failed (ignored): %s", what, _first_line(exc))

    task = asyncio.get_running_loop().create_task(run())
    _tasks.add(task)
    task.add_done_callback(_tasks.discard)
    return task


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
