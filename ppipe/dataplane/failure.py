"""Which batches a failure takes with it: the failure cut and the report deadline.

Both drivers apply these rules, so the simulator decides as ``ppipe serve`` does:

* **The failure cut.** When the worker of vGPU ``v`` dies, an in-flight batch with route
  ``r_0 .. r_{n-1}`` (the vGPU of each stage), whose first stage not known done is ``f``,
  is lost at stage

      cut = f                                   if f > 0 and r_{f-1} = v
      cut = min { j >= f : r_j = v }            otherwise (none: the batch goes on)

  The first case is a dead *sender*: stage ``f - 1`` ended on ``v``, but its feature map
  may not have left the dead worker, so stage ``f`` may never get its input. A batch whose
  stages on ``v`` are all done and whose next stage has its input is untouched. The
  scheduler (:meth:`~ppipe.dataplane.batching.BatchingScheduler.mark_failed`) releases the
  lost batch's reservations from the cut on; the runtime's host answers its requests
  ``worker-failed`` at once (its own record of which stages are done can be ahead of the
  scheduler's, which is fed only the reports outside the report tolerance).
* **The report deadline.** A dispatched batch whose reports stop coming (a connection
  between two workers broke and took a message with it) is failed once the time passes
  its planned end plus ``max(grace, SLO)``: a batch that is merely late (a slow GPU, a
  long queue at a worker) reports within its SLO of its plan, or it missed the deadline
  anyway. The simulator loses no message, so in it the deadline never passes.

Pure logic: no clock, no I/O.
"""

from __future__ import annotations

from typing import Sequence


def failure_cut(route: Sequence[str], done: Sequence[bool], vgpu_id: str) -> int | None:
    """The stage at which the death of ``vgpu_id`` loses a batch (None: the batch goes on).

    Args:
        route: the vGPU of each of the batch's stages, in order.
        done: per stage, whether it is known to have ended (its report, or a later one's).
    """
    first_open = next((i for i, d in enumerate(done) if not d), None)
    if first_open is None:
        return None
    if first_open > 0 and route[first_open - 1] == vgpu_id:
        return first_open
    return next((j for j in range(first_open, len(route)) if route[j] == vgpu_id), None)


def report_deadline_us(planned_end_us: float, grace_us: float, slo_us: float) -> float:
    """When a batch still missing reports is failed: its planned end plus ``max(grace, SLO)``."""
    return planned_end_us + max(grace_us, slo_us)
