"""The reactive baseline, stage by stage: every pool batches on its own (paper §7.4).

Policy name ``reactive-pool``. Closer to the paper's description than ``reactive`` (which
forms a batch once and sends it along a whole path), but it needs a driver that accepts
*partial* dispatches: a :class:`~ppipe.dataplane.api.Dispatch` whose ``stages`` hold one
partition ``k``; its requests then wait where stage ``k`` ran until a later dispatch
takes them on (the simulator does this; the runtime runs whole paths only, so use
``reservation`` or ``reactive`` there). It also needs a report for every stage: a report is
how a pool learns that requests have arrived from upstream and that a vGPU is free.

How a pool decides (each pool of each pipeline independently, no reservations):

* **Queues.** A request enters the first pool of a pipeline chosen by smooth weighted
  round robin over the model's live pipelines (weights: planned throughput; equal if the
  plan gives none). After stage ``k`` is reported, its requests join pool ``k+1``'s queue.
* **Pool deadlines** ("the pool's SLO as determined by the MILP"): the request's SLO is cut
  in proportion to the pipeline's nominal stage times at its planned batch (inference
  plus the transfer into the stage): pool ``k`` must finish it by ``arrival + SLO *
  (stages 0..k) / (all stages)``; the last pool's deadline is the request's own.
* **When a vGPU of the pool is idle** (its queue of work has ended; the one idle longest,
  then lowest id), the pool takes the largest usable batch whose nominal time (transfer at
  nominal bandwidth, no NIC tracking, then inference) meets the oldest queued request's
  pool deadline; drops that request (DEADLINE_UNREACHABLE, "at pool k") if even batch 1
  cannot; waits (WakeAt, until the last moment) if fewer are queued than the batch; else
  dispatches. With no idle vGPU it waits for a report (and a timer at the first vGPU's
  expected end, in case no report comes).
* The transfer of a batch whose requests come from several upstream vGPUs is given the
  slowest of their nominal times.

Failures: a failed vGPU leaves its pool; requests in its running stage, and requests
queued downstream whose feature map sits on it, are dropped (WORKER_FAILED); a pipeline
with an empty pool drops what it holds (NO_PIPELINE) and gets no new requests.
"""

from __future__ import annotations

from collections import deque

from ppipe.dataplane.api import (
    Clock,
    Decision,
    Dispatch,
    Drop,
    DropReason,
    Request,
    Reservation,
    Stage,
    StageReport,
    WakeAt,
    vgpu_resource,
)
from ppipe.dataplane.batching import Counters
from ppipe.dataplane.options import SchedulerOptions
from ppipe.errors import UserError
from ppipe.dataplane.tables import EPS_US
from ppipe.dataplane.topology import Pipeline, Topology, VGpu


class _Item:
    """A request on its way through a pipeline."""

    __slots__ = ("req", "deadlines", "src")

    def __init__(self, req: Request, deadlines: list[float]):
        self.req = req
        self.deadlines = deadlines  # per pool
        self.src: VGpu | None = None  # where its feature map is (None before stage 0)


class _Running:
    __slots__ = ("pipe", "k", "vgpu", "items", "end")

    def __init__(self, pipe: Pipeline, k: int, vgpu: VGpu, items: list[_Item], end: float):
        self.pipe = pipe
        self.k = k
        self.vgpu = vgpu
        self.items = items
        self.end = end


class ReactivePoolScheduler:
    """Per-pool reactive batching with partial (one-stage) dispatches."""

    policy_name = "reactive-pool"
    partial_dispatches = True  # drivers that run whole paths only must refuse this policy

    def __init__(self, topology: Topology, clock: Clock, options: SchedulerOptions | None = None):
        self.topology = topology
        self.clock = clock
        self.options = options or SchedulerOptions()
        if self.options.dispatch_lead_us or self.options.input_transfer_lead or any(self.options.budget_us(m) for m in topology.pipelines):
            raise UserError("the reactive-pool baseline does not apply the runtime's margins (a dispatch lead, an answer budget)",
                            fix="simulate it with --dispatch-lead-ms 0 --answer-budget-ms 0")
        self.counters = Counters()
        self.models = list(topology.pipelines)
        self.queues: dict[tuple[str, int, int], deque[_Item]] = {}
        self.wake_at: dict[tuple[str, int, int], float | None] = {}
        self.fractions: dict[tuple[str, int], list[float]] = {}
        self.inflight: dict[int, _Running] = {}
        self._credit: dict[tuple[str, int], float] = {}
        self._next_batch_id = 0
        for m, pipes in topology.pipelines.items():
            for p in pipes:
                for k in range(len(p.pools)):
                    self.queues[(m, p.index, k)] = deque()
                    self.wake_at[(m, p.index, k)] = None
                self.fractions[(m, p.index)] = self._pool_fractions(p)
                self._credit[(m, p.index)] = 0.0

    # ---- setup ---------------------------------------------------------------------
    @staticmethod
    def _pool_fractions(p: Pipeline) -> list[float]:
        """Cumulative share of the SLO by the end of each pool (nominal times at the planned batch)."""
        b = p.batches[0]
        times = []
        for k, pool in enumerate(p.pools):
            t = pool.infer_us[b]
            if k > 0:
                prev = p.pools[k - 1]
                bw = min(min(g.bw_gbps for g in prev.vgpus), min(g.bw_gbps for g in pool.vgpus))
                t += b * prev.out_bits * 1e-3 / bw
            times.append(t)
        total = sum(times) or 1.0
        acc, out = 0.0, []
        for t in times:
            acc += t
            out.append(acc / total)
        out[-1] = 1.0
        return out

    def _live(self, model: str) -> list[Pipeline]:
        return [p for p in self.topology.pipelines[model] if p.alive]

    def _route(self, model: str) -> Pipeline:
        """Smooth weighted round robin over live pipelines (deterministic)."""
        pipes = self._live(model)
        weights = [p.planned_rps for p in pipes]
        if not any(w > 0 for w in weights):
            weights = [1.0] * len(pipes)
        total = sum(weights)
        best = None
        for p, w in zip(pipes, weights):
            key = (model, p.index)
            self._credit[key] += w
            if best is None or self._credit[key] > self._credit[(model, best.index)] + 1e-12:
                best = p
        self._credit[(model, best.index)] -= total
        return best

    # ---- Scheduler protocol --------------------------------------------------------
    def submit(self, request: Request) -> list[Decision]:
        now = self.clock.now_us()
        if request.model not in self.topology.pipelines:
            return [self._drop(request, DropReason.UNKNOWN_MODEL, f"models served: {', '.join(self.models)}")]
        if not self._live(request.model):
            return [self._drop(request, DropReason.NO_PIPELINE, "every pipeline of the model has a failed pool")]
        bound = self.options.queue_bound(request.model)
        if bound is not None:
            queued = sum(len(self.queues[(request.model, p.index, 0)]) for p in self.topology.pipelines[request.model])
            if queued >= bound:
                return [self._drop(request, DropReason.QUEUE_FULL, f"queue bound {bound}")]
        p = self._route(request.model)
        slo = request.deadline_us - request.arrival_us
        item = _Item(request, [request.arrival_us + slo * f for f in self.fractions[(p.model, p.index)]])
        self._enqueue(p, 0, item)
        return self._run_pool(p, 0, now)

    def wake(self) -> list[Decision]:
        now = self.clock.now_us()
        out: list[Decision] = []
        for (m, pi, k), t in list(self.wake_at.items()):
            if t is not None and t <= now + EPS_US:
                p = self.topology.pipelines[m][pi]
                out.extend(self._run_pool(p, k, now))
        return out

    def report(self, report: StageReport) -> list[Decision]:
        now = self.clock.now_us()
        self.counters.corrections += 1
        g = self.topology.vgpus.get(report.vgpu_id)
        if g is not None:
            self.counters.cascaded += g.table.correct((report.batch_id, report.partition, "i"), report.start_us, report.end_us, now=now)
            if g.alive and g.pool is not None:
                g.pool.touch(g)
        run = self.inflight.pop(report.batch_id, None)
        out: list[Decision] = []
        if run is None:
            return out
        p, k = run.pipe, run.k
        if k + 1 < len(p.pools) and p.alive:
            for it in run.items:
                it.src = run.vgpu
                self._enqueue(p, k + 1, it)
        if p.alive:
            out.extend(self._run_pool(p, k, now))  # the vGPU is free again
            if k + 1 < len(p.pools):
                out.extend(self._run_pool(p, k + 1, now))
        return out

    def mark_failed(self, vgpu_id: str) -> list[Decision]:
        g = self.topology.vgpus.get(vgpu_id)
        if g is None or not g.alive:
            return []
        g.alive = False
        p = self.topology.pipelines[g.model][g.pipeline]
        pool = p.pools[g.partition]
        pool.vgpus.remove(g)
        pool.refresh()
        out: list[Decision] = []
        for bid in list(self.inflight):
            run = self.inflight[bid]
            if run.vgpu is g:
                del self.inflight[bid]
                out.extend(self._drop(it.req, DropReason.WORKER_FAILED, f"vGPU {vgpu_id} failed") for it in run.items)
        for k in range(1, len(p.pools)):
            q = self.queues[(p.model, p.index, k)]
            lost = [it for it in q if it.src is g]
            if lost:
                keep = [it for it in q if it.src is not g]
                q.clear()
                q.extend(keep)
                out.extend(self._drop(it.req, DropReason.WORKER_FAILED, f"its feature map was on vGPU {vgpu_id}") for it in lost)
        if not pool.vgpus:
            p.alive = False
            for k in range(len(p.pools)):
                q = self.queues[(p.model, p.index, k)]
                while q:
                    out.append(self._drop(q.popleft().req, DropReason.NO_PIPELINE, f"pipeline {p.index} lost pool {g.partition}"))
                self.wake_at[(p.model, p.index, k)] = None
            for bid in list(self.inflight):
                run = self.inflight[bid]
                if run.pipe is p and run.k < len(p.pools) - 1:
                    del self.inflight[bid]
                    out.extend(self._drop(it.req, DropReason.NO_PIPELINE, f"pipeline {p.index} lost pool {g.partition}") for it in run.items)
        return out

    def mark_recovered(self, vgpu_id: str) -> list[Decision]:
        """A failed vGPU's worker runs again: it rejoins its pool; a pipeline whose pools
        all have a live vGPU again takes work again (from the next arrival on)."""
        g = self.topology.vgpus.get(vgpu_id)
        if g is None or g.alive:
            return []
        g.alive = True
        p = self.topology.pipelines[g.model][g.pipeline]
        pool = p.pools[g.partition]
        pool.vgpus.append(g)
        pool.vgpus.sort(key=lambda v: v.id)
        pool.refresh()
        if all(q.vgpus for q in p.pools):
            p.alive = True
        return []

    def stats(self) -> dict:
        d = self.counters.as_dict()
        d["policy"] = self.policy_name
        d["queued"] = {m: sum(len(q) for (mm, _p, _k), q in self.queues.items() if mm == m) for m in self.models}
        d["inflight"] = len(self.inflight)
        return d

    # ---- one pool ------------------------------------------------------------------
    def _enqueue(self, p: Pipeline, k: int, item: _Item) -> None:
        q = self.queues[(p.model, p.index, k)]
        if not q or item.deadlines[k] >= q[-1].deadlines[k]:
            q.append(item)
        else:
            items = sorted([*q, item], key=lambda it: (it.deadlines[k], it.req.arrival_us, it.req.id))
            q.clear()
            q.extend(items)

    def _estimate(self, p: Pipeline, k: int, g: VGpu, items, bs: int) -> tuple[float, float]:
        """Nominal (transfer, inference) time of a batch of ``bs`` of ``items`` on ``g``."""
        self.counters.probes += 1
        l_i = p.pools[k].infer_us[bs]
        if k == 0:
            return 0.0, l_i
        bits = p.pools[k - 1].out_bits * bs
        l_n = 0.0
        for it in items:
            src = it.src
            if src is None or src.server == g.server:
                continue
            t = bits * 1e-3 / min(src.bw_gbps, g.bw_gbps)
            if t > l_n:
                l_n = t
        return l_n, l_i

    def _run_pool(self, p: Pipeline, k: int, now: float) -> list[Decision]:
        key = (p.model, p.index, k)
        q = self.queues[key]
        self.wake_at[key] = None
        out: list[Decision] = []
        pool = p.pools[k]
        while q:
            g = pool.longest_idle()
            if g is None:
                break
            free = g.table.busy_until()
            if free > now + EPS_US:
                self.wake_at[key] = free  # a report should come first; the timer is a safety net
                out.append(WakeAt(free))
                break
            head = q[0]
            dl = head.deadlines[k]
            chosen = None
            for bs in p.batches:
                items = [q[i] for i in range(min(bs, len(q)))]
                l_n, l_i = self._estimate(p, k, g, items, bs)
                if now + l_n + l_i <= dl + EPS_US:
                    chosen = (bs, l_n, l_i)
                    break
            if chosen is None:
                out.append(self._drop(q.popleft().req, DropReason.DEADLINE_UNREACHABLE, f"at pool {k} of pipeline {p.index} (reactive-pool)"))
                continue
            bs, l_n, l_i = chosen
            if len(q) < bs:
                now_choice = None
                for b in p.batches:
                    if b > len(q):
                        continue
                    items = list(q)[:b]
                    ln2, li2 = self._estimate(p, k, g, items, b)
                    if now + ln2 + li2 <= dl + EPS_US:
                        now_choice = (b, ln2, li2)
                        break
                if now_choice is None:
                    out.append(self._drop(q.popleft().req, DropReason.DEADLINE_UNREACHABLE, f"at pool {k}: no batch <= {len(q) + 1} fits"))
                    continue
                slack = dl - (now + now_choice[1] + now_choice[2])
                if slack > EPS_US:
                    self.wake_at[key] = now + slack
                    self.counters.waits += 1
                    out.append(WakeAt(now + slack))
                    break
                bs, l_n, l_i = now_choice
            items = [q.popleft() for _ in range(bs)]
            out.append(self._dispatch(p, k, g, items, now, l_n, l_i))
        return out

    def _dispatch(self, p: Pipeline, k: int, g: VGpu, items: list[_Item], now: float, l_n: float, l_i: float) -> Dispatch:
        bid = self._next_batch_id
        self._next_batch_id += 1
        start = now + l_n
        pool = p.pools[k]
        g.table.add(start, l_i, (bid, k, "i"))
        self.inflight[bid] = _Running(p, k, g, items, start + l_i)
        self.counters.dispatches += 1
        if k == 0:
            self.counters.dispatched_requests += len(items)
        stage = Stage(
            partition=k,
            vgpu_id=g.id,
            server=g.server,
            first_block=pool.first_block,
            last_block=pool.last_block,
            transfer_start_us=None if k == 0 else now,
            transfer_us=l_n,
            start_us=start,
            infer_us=l_i,
        )
        return Dispatch(
            batch_id=bid,
            model=p.model,
            pipeline=p.index,
            requests=tuple(it.req for it in items),
            stages=(stage,),
            reservations=(Reservation(vgpu_resource(g.id), start, l_i),),
        )

    def _drop(self, request: Request, reason: DropReason, detail: str = "") -> Drop:
        self.counters.drops[reason.value] = self.counters.drops.get(reason.value, 0) + 1
        return Drop(request, reason, detail)
