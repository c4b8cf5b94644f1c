"""A live plan switch: a scheduler for the new plan takes over from the running one, with no pause.

PPipe migrates between plans by pausing ingestion and flushing the pipelines (about one
SLO of downtime). Here nothing pauses, because the data plane knows every reservation the
old plan still holds and can hand them to the new plan's tables:

* **New requests** go to the new scheduler from the switch on.
* **Batches already dispatched** finish on the old topology. Their reports go on to the
  old scheduler, which alone knows them: the driver routes a report by batch id, and the
  new scheduler numbers its batches from :attr:`Handover.first_batch_id` on, so ids never
  repeat and ``id < first_batch_id`` means "the old scheduler's".
* **Queued requests** (arrived, not dispatched) move to the new scheduler with their
  arrival and deadline unchanged; one whose model the new plan does not serve is dropped
  with ``UNKNOWN_MODEL``.
* **Nothing is double-booked.** Every interval the old tables hold after the switch is
  copied into the new tables of the resources it occupies:

  - a *kept* vGPU (:func:`kept_vgpus`: same id, GPU type, level, model and block range;
    its worker stays as it is) keeps its own reservations;
  - a NIC (a server's uplink or downlink) keeps its reservations;
  - a *new* vGPU on a physical GPU (server, GPU index) is busy from the switch until the
    last old reservation of the GPU's *other* old vGPUs (those not kept) ends: the GPU's
    shares are being re-cut, and the new share may not start while an old share that it
    replaces still runs. Kept shares go on independently, as MPS shares do.

  The copies are snapshots: a late old batch that a report delays in the old tables is
  not re-copied; its overrun reaches the new tables as any late stage does, through the
  new batches' own reports (feedback correction).
* **Failures carry over**: a kept vGPU that the old scheduler had marked failed is marked
  failed in the new one.

**Resources that change hands between schedulers** (the shards of one server, each a
scheduler over its own models, :mod:`ppipe.runtime.launch.shards`): a new plan may give a physical
GPU or a NIC that one shard's old plan used to another shard. The taker cannot see the
giver's tables, so its hand-over puts the resource under *embargo*: its new vGPUs on the
GPU (those not kept) and its NIC table are busy from the switch on, without end. The
giver's hand-over reports, per resource it retires, when its last old reservation there
ends (:func:`retired_until`); :func:`lift_embargo` then shortens the taker's block to that
instant. The result is the single scheduler's rule above (a new share waits for the old
shares it replaces), reached in two steps. Between them the taker's scheduler holds every
request it is given, the queued ones it took over included, and submits them, in arrival
order, once its last embargo is lifted: a probe during the embargo would see the resource
busy without end and drop the request, though the wait is a message's round trip.

Pure logic, like the rest of the data plane: the simulator (under its virtual clock) and
the runtime (under the wall clock) call :func:`hand_over` the same way.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ppipe.dataplane.api import Decision, DropReason
from ppipe.dataplane.batching import BatchingScheduler
from ppipe.dataplane.tables import ReservationTable
from ppipe.dataplane.topology import Topology, VGpu
from ppipe.errors import UserError


@dataclass(frozen=True)
class Handover:
    """What :func:`hand_over` did.

    Attributes:
        first_batch_id: the new scheduler's first batch id; lower ids are the old scheduler's.
        kept: vGPUs whose worker serves both plans unchanged.
        moved: requests moved from the old scheduler's queues to the new one.
        decisions: the new scheduler's decisions on the moved requests (and drops of those
            it cannot serve), for the driver to apply.
        retired: :func:`retired_until` of the switch: when the old plan's reservations end
            on each GPU and NIC it gives up (for another scheduler's embargo).
        held: queued requests not yet submitted to ``new``, because a resource is under an
            embargo still to be lifted (:class:`SwitchingScheduler` submits them then).
    """

    first_batch_id: int
    kept: frozenset[str]
    moved: int
    decisions: list[Decision]
    retired: dict[str, float] = field(default_factory=dict)
    held: list = field(default_factory=list)


def vgpu_identity(g: VGpu) -> tuple:
    """What a vGPU's worker is: where it runs, at which share, and which blocks it holds."""
    pool = g.pool
    return (g.server, g.gpu, g.level, g.model, pool.first_block if pool else -1, pool.last_block if pool else -1)


def kept_vgpus(old: Topology, new: Topology) -> frozenset[str]:
    """vGPUs present in both topologies with the same identity: their workers serve both plans."""
    return frozenset(v for v, g in new.vgpus.items() if v in old.vgpus and vgpu_identity(old.vgpus[v]) == vgpu_identity(g))


def physical_gpu(vgpu_id: str) -> str:
    """``"<server>/gpu<i>"`` of a vGPU id ``"<server>/gpu<i>/s<j>"``."""
    return vgpu_id.rsplit("/", 1)[0]


def hand_over(old: BatchingScheduler, new: BatchingScheduler, embargo: Mapping[str, float | None] | Iterable[str] = ()) -> Handover:
    """Make ``new`` (built on the new plan, with the same clock) take over from ``old`` now.

    ``embargo``: physical GPUs (``"<server>/gpu<i>"``) and NICs whose old reservations are
    another scheduler's, each with when they end there, or None (or given as a list)
    where that is not known yet: busy until :func:`lift_embargo` (module doc).

    After the call the driver sends every new request to ``new``; reports and failures of
    batches numbered below ``first_batch_id`` go to ``old`` (failures of a kept vGPU to
    both); ``old`` is done when its ``inflight`` is empty.

    Raises:
        UserError: a policy that does not batch over reservation tables (``reactive-pool``
            keeps requests in its pools between stages: it has no whole-path queue to hand
            over), or a new scheduler that has already taken requests.
    """
    for s in (old, new):
        if not isinstance(s, BatchingScheduler):
            raise UserError(
                f"a live plan switch needs a batching data-plane policy; '{getattr(s, 'policy_name', type(s).__name__)}' is not one",
                fix="serve with --policy reservation (the paper's) or reactive",
            )
    if new.inflight or any(new.queues.values()) or new._next_batch_id:
        raise UserError("the new scheduler has served requests already", fix="build a fresh scheduler for the new plan")
    now = old.clock.now_us()
    kept = kept_vgpus(old.topology, new.topology)
    embargo = embargo if isinstance(embargo, Mapping) else dict.fromkeys(embargo)
    _copy_reservations(old.topology, new.topology, kept, now)
    _embargo(new.topology, kept, embargo, now)
    _refresh_pools(new.topology)
    hold = any(until is None for until in embargo.values())
    first = new._next_batch_id = old._next_batch_id
    out: list[Decision] = []
    for v in old.failed:
        if v in kept:
            out.extend(new.mark_failed(v))
    moved, held = 0, []
    for model, queue in old.queues.items():
        while queue:
            r = queue.popleft()
            moved += 1
            if model not in new.queues:
                out.append(old._drop(r, DropReason.UNKNOWN_MODEL, "the new plan does not serve this model"))
            elif hold:
                held.append(r)
            else:
                out.extend(new.submit(r))
        old.wake_at[model] = None
    held.sort(key=lambda r: (r.arrival_us, r.id))
    return Handover(first_batch_id=first, kept=kept, moved=moved, decisions=out,
                    retired=retired_until(old.topology, new.topology, kept, now), held=held)


def _copy_reservations(old: Topology, new: Topology, kept: frozenset[str], now: float) -> None:
    """Copy the old tables' intervals that end after ``now`` into the new tables (see the module doc)."""
    for res, table in new.nic.items():
        src = old.nic.get(res)
        if src is not None:
            _copy_after(src, table, now)
    released_until: dict[str, float] = {}  # physical GPU -> last end of its old, not kept vGPUs
    for v, g in old.vgpus.items():
        if v not in kept and g.table.ends:
            gpu = physical_gpu(v)
            released_until[gpu] = max(released_until.get(gpu, now), g.table.ends[-1])
    for v, g in new.vgpus.items():
        if v in kept:
            _copy_after(old.vgpus[v].table, g.table, now)
        else:
            until = released_until.get(physical_gpu(v), now)
            if until > now:
                g.table.add(now, until - now, ("handover", v))


def _refresh_pools(topology: Topology) -> None:
    """Rebuild the pools' heaps after their tables changed busy times behind their back."""
    for pipes in topology.pipelines.values():
        for p in pipes:
            for pool in p.pools:
                pool.refresh()


EMBARGO_US = 1e15  # "without end": ~30 years, finite so that interval arithmetic stays finite


def _embargoed_tables(topology: Topology, kept: frozenset[str], resource: str) -> list[ReservationTable]:
    """The tables an embargo on ``resource`` blocks: a NIC's, or those of the new (not kept) vGPUs on a GPU."""
    if resource in topology.nic:
        return [topology.nic[resource]]
    return [g.table for v, g in topology.vgpus.items() if v not in kept and physical_gpu(v) == resource]


def _embargo(topology: Topology, kept: frozenset[str], resources: Mapping[str, float | None], now: float) -> None:
    for res in sorted(resources):
        until = resources[res]
        for table in _embargoed_tables(topology, kept, res):
            start = max(now, table.busy_until())
            if until is None:
                table.add(start, EMBARGO_US, ("embargo", res))
            elif until > start:
                table.add(start, until - start, ("handover", res))


def lift_embargo(topology: Topology, resource: str, until: float) -> None:
    """End the embargo on ``resource`` in ``topology``: it stays busy until ``until`` (the
    other scheduler's last old reservation there, :func:`retired_until`), then is free."""
    changed = False
    for table in [*topology.nic.values(), *(g.table for g in topology.vgpus.values())]:
        key = ("embargo", resource)
        i = table.find(key)
        if i < 0:
            continue
        start = table.starts[i]
        table.remove(key, start)
        if until > start:
            table.add(start, until - start, ("handover", resource))
        changed = True
    if changed:
        _refresh_pools(topology)


def retired_until(old: Topology, new: Topology, kept: frozenset[str], now: float) -> dict[str, float]:
    """Per physical GPU with vGPUs ``old`` has and ``new`` does not keep, and per NIC that
    ``old`` uses and ``new`` does not: the end of ``old``'s last reservation there, where it
    ends after ``now``. What a scheduler that takes the resource over must wait for (module
    doc); a resource not listed is free from ``now``."""
    out: dict[str, float] = {}
    for v, g in old.vgpus.items():
        if v not in kept and g.table.busy_until() > now:
            gpu = physical_gpu(v)
            out[gpu] = max(out.get(gpu, now), g.table.busy_until())
    for res, table in old.nic.items():
        if res not in new.nic and table.busy_until() > now:
            out[res] = table.busy_until()
    return out


def _copy_after(src: ReservationTable, dst: ReservationTable, now: float) -> None:
    for start, end, key in src.intervals():
        if end > now:
            dst.add(start, end - start, ("handover", key))


class SwitchingScheduler:
    """The :class:`~ppipe.dataplane.api.Scheduler` protocol across plan switches.

    Drivers hold this object as their scheduler and call :meth:`switch` to move to a new
    plan; it routes each event to the scheduler it belongs to:

    * ``submit`` and ``mark_recovered``: the current scheduler;
    * ``report``: the scheduler that dispatched the batch (by batch id, see :class:`Handover`);
    * ``mark_failed``: every scheduler still running batches whose topology has the vGPU;
    * ``wake``: every scheduler still running batches (a retiring one has no queue, so
      only its timers of in-flight work may still fire).

    A retiring scheduler is forgotten once it has no batch in flight.
    """

    def __init__(self, scheduler: BatchingScheduler):
        self.current = scheduler
        self._eras: list[tuple[int, BatchingScheduler]] = [(0, scheduler)]  # (first batch id, scheduler), ascending
        self._retired_stats: list[dict] = []
        self.switches: list[Handover] = []
        self._embargoed: set[str] = set()  # resources whose embargo is still to be lifted
        self._held: list = []  # requests taken while one is (submitted at the last lift)

    # the driver contract's attributes are the current policy's
    @property
    def policy_name(self) -> str:
        return self.current.policy_name

    @property
    def partial_dispatches(self) -> bool:
        return self.current.partial_dispatches

    @property
    def executes_as_planned(self) -> bool:
        return self.current.executes_as_planned

    @property
    def tracks_nics(self) -> bool:
        return self.current.tracks_nics

    @property
    def topology(self) -> Topology:
        return self.current.topology

    @property
    def retiring(self) -> list[BatchingScheduler]:
        """Earlier schedulers whose batches are still in flight."""
        return [s for _, s in self._eras[:-1]]

    def switch(self, new: BatchingScheduler, embargo: Mapping[str, float | None] | Iterable[str] = ()) -> Handover:
        """Hand over to ``new`` (see :func:`hand_over`); apply ``.decisions`` of the result.
        Resources under embargo (None in ``embargo``): requests are held until their lift."""
        embargo = embargo if isinstance(embargo, Mapping) else dict.fromkeys(embargo)
        h = hand_over(self.current, new, embargo)
        self._eras.append((h.first_batch_id, new))
        self.current = new
        self.switches.append(h)
        self._embargoed = {res for res, until in embargo.items() if until is None}
        self._held = list(h.held)
        self._forget_idle()
        return h

    def lift_embargo(self, resource: str, until: float) -> list[Decision]:
        """:func:`lift_embargo` in the current scheduler's tables; once none is left, the
        held requests are submitted (their decisions returned, for the driver to apply)."""
        lift_embargo(self.current.topology, resource, until)
        self._embargoed.discard(resource)
        if self._embargoed or not self._held:
            return []
        held, self._held = self._held, []
        out: list[Decision] = []
        for r in held:
            out.extend(self.current.submit(r))
        return out

    def submit(self, request) -> list[Decision]:
        if self._embargoed:
            self._held.append(request)
            return []
        return self.current.submit(request)

    def wake(self) -> list[Decision]:
        if len(self._eras) == 1:
            return self.current.wake()
        out: list[Decision] = []
        for _, s in self._eras:
            out.extend(s.wake())
        self._forget_idle()
        return out

    def report(self, report) -> list[Decision]:
        eras = self._eras
        if len(eras) == 1:
            return self.current.report(report)
        owner = next((s for first, s in reversed(eras) if report.batch_id >= first), None)
        if owner is None:  # a batch of a scheduler retired already (it forgot the batch)
            return []
        out = owner.report(report)
        self._forget_idle()
        return out

    def mark_failed(self, vgpu_id: str, since_batch_id: int = 0, until_batch_id: float = float("inf")) -> list[Decision]:
        """Fail ``vgpu_id`` in the schedulers whose first batch id is in ``[since, until)``.

        A vGPU id that both plans have but that is not kept names two workers: the old
        plan's (eras before the switch) and the new plan's (from it on). A driver that
        knows which of them died passes that worker's range; the default fails the id
        everywhere.
        """
        out: list[Decision] = []
        for first, s in self._eras:
            if since_batch_id <= first < until_batch_id and vgpu_id in s.topology.vgpus:
                out.extend(s.mark_failed(vgpu_id))
        self._forget_idle()
        return out

    def mark_recovered(self, vgpu_id: str) -> list[Decision]:
        return self.current.mark_recovered(vgpu_id)

    def withdraw(self, request_ids) -> list[Decision]:
        ids = set(request_ids)
        self._held = [r for r in self._held if r.id not in ids]
        return self.current.withdraw(request_ids)  # (queued requests are the current scheduler's only)

    def stats(self) -> dict:
        """The counters of every scheduler so far, summed (``switches``: how many)."""
        total: dict = {}
        for st in [*self._retired_stats, *(s.stats() for _, s in self._eras)]:
            _add_counts(total, st)
        if total.get("dispatches"):
            total["probes_per_dispatch"] = total.get("probes", 0) / total["dispatches"]
        total["policy"] = self.policy_name
        total["switches"] = len(self.switches)
        return total

    def _forget_idle(self) -> None:
        """Drop retiring schedulers with nothing in flight (the current one always stays)."""
        keep = [(f, s) for f, s in self._eras[:-1] if s.inflight]
        if len(keep) < len(self._eras) - 1:
            self._retired_stats.extend(s.stats() for f, s in self._eras[:-1] if not s.inflight)
            self._eras = [*keep, self._eras[-1]]


def _add_counts(total: dict, st: dict) -> None:
    for k, v in st.items():
        if isinstance(v, dict):
            _add_counts(total.setdefault(k, {}), v)
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            total[k] = total.get(k, 0) + v
