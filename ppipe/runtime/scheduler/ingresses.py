"""Requests held by ingress processes: the scheduler's host decides on their metadata alone.

An ingress process (:class:`ppipe.runtime.ingress.remote.IngressRuntime`) holds its clients'
connections and their tensors. The scheduler's host sees only what it decides on:

- an ingress sends, once per loop tick, a :class:`~ppipe.runtime.wire.messages.FromIngress`
  with its new requests (id there, model, arrival) and the ones it withdraws. Each becomes a
  :class:`~ppipe.dataplane.api.Request` of the data plane, whose payload is a
  :class:`RemoteInput` (which ingress, which id) instead of the tensors;
- a dispatch goes to the first worker from here, the stage-0 message with the rows' refs
  into the ingresses' shared memory (or small inputs' bytes) that their arrivals offered
  (:meth:`IngressesMixin._forwarded_inputs`), where every row was offered and every ingress
  with a ref is on the worker's machine; otherwise, for each ingress with requests in the
  batch, it becomes a :class:`~ppipe.runtime.wire.messages.SendInputs`: the stage-0
  message with that ingress's rows (``part``), which the ingress sends to the first
  worker itself. Either way the message holds the batch's ``answers``: the last worker
  answers each ingress with its rows of the outputs. The batch's rows are grouped by
  ingress (each ingress's requests are consecutive rows);
- a request's error (a drop, a failed batch, a timeout, a shutdown) is told to its ingress
  as a :class:`~ppipe.runtime.wire.messages.Refusal`; a request served needs no word from
  here (the last worker answered its ingress);
- which models are ready is told at an ingress's hello and whenever it changes, and the
  plan served (:class:`~ppipe.runtime.wire.messages.ServedPlan`: its models, SLOs and
  manifests, which the ingress validates and times its requests by) at the hello and after
  each plan switch, so that an ingress started before a switch, or restarted after one,
  serves the plan the scheduler serves;
- metrics: each ingress sends its Prometheus text every second; the host answers every
  second with the whole server's (:meth:`IngressesMixin.render_metrics`: its own and every
  ingress's, each sample labelled ``process="scheduler"`` or ``"ingress-i"``), so that a
  scrape that reaches any ingress of the shared port sees every process, at most a second
  or two old.

On a server of several schedulers (``ppipe serve --ingress N --shards K``) every shard's
host takes ingresses, each for its own models (or servers), and every ingress says hello to
each of them. Shard 0's host is also the ingresses' directory (:class:`IngressDirectory`,
which stands where a shard's router stands on a server without ingresses): it tells them
every scheduler's inbox and which schedules each model, at their hello and whenever a shard
goes down, comes back, or a plan switch gives a model an owner.

What the scheduler's host says to one ingress in one tick goes as one
:class:`~ppipe.runtime.wire.messages.ToIngress` message, sent when the loop has run what is
ready (``call_soon``). The rest of the host is unchanged: the same scheduler, reports,
timeouts, failures and plan switches (requests held by ingresses are moved to the new plan's
pools as any others); every request still gets exactly one answer, here
its ingress's (the first of an answer and a refusal that cross wins there).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
from dataclasses import dataclass, field

import msgspec
import numpy as np

from ppipe.dataplane.api import Dispatch
from ppipe.dataplane.split import owner_table
from ppipe.runtime.scheduler.inflight import DroppedError, Pending
from ppipe.runtime.scheduler.metrics import merge_metrics
from ppipe.runtime.wire.datapath import DataPathFull, Inbox
from ppipe.runtime.wire.frames import ForwardedRows, WireError, pack, unpack
from ppipe.runtime.wire.messages import AnswerTo, Arrival, FromIngress, Refusal, RowInput, SendInputs, ServedPlan, StageMsg, ToIngress
from ppipe.runtime.wire.addresses import same_machine

log = logging.getLogger("ppipe.runtime")

REMOTE_TIMEOUT_CHECK_S = 1.0  # how often the ingresses' requests are looked at for their timeout
READINESS_CHECK_S = 0.5  # how often the models' readiness is compared with what the ingresses were told
METRICS_EVERY_S = 1.0  # how often the ingresses are sent the whole server's metrics


@dataclass(frozen=True, slots=True)
class RemoteInput:
    """A request's payload where an ingress holds its inputs: the ingress, the request's id
    there, and the inputs as its arrival offered them (:class:`~ppipe.runtime.wire.messages.RowInput`,
    checked; empty: the ingress sends them)."""

    ingress: int
    rid: int
    inputs: tuple[RowInput, ...] = ()


def _checked(inputs: tuple[RowInput, ...]) -> tuple[RowInput, ...]:
    """An arrival's offered inputs, or () where one is malformed (a dtype NumPy does not
    know or that holds objects, or bytes that are not its shape): the ingress then sends them."""
    for x in inputs:
        n = _row_bytes(x.dtype, x.shape)
        if n is None or (x.ref is None and len(x.data) != n):
            return ()
    return inputs


_ROW_BYTES: dict[tuple[str, tuple[int, ...]], int | None] = {}


def _row_bytes(dtype: str, shape: tuple[int, ...]) -> int | None:
    """Bytes of one row of ``shape`` and ``dtype``, or None where that is not a plain array
    (remembered: a model's inputs have few shapes)."""
    key = (dtype, shape)
    if key in _ROW_BYTES:
        return _ROW_BYTES[key]
    try:
        dt = np.dtype(dtype)
        n = None if dt.hasobject or any(d < 0 for d in shape) else dt.itemsize * math.prod(shape)
    except TypeError:
        n = None
    if len(_ROW_BYTES) < 4096:
        _ROW_BYTES[key] = n
    return n


@dataclass
class _Down:
    """What one ingress is told in the current tick."""

    sends: list[SendInputs] = field(default_factory=list)
    refusals: list[Refusal] = field(default_factory=list)
    ready: tuple[str, ...] | None = None
    metrics: bytes | None = None
    plan: ServedPlan | None = None
    directory: tuple[tuple[str, ...], dict] | None = None  # (schedulers, owner table): shard 0's


class IngressDirectory:
    """A shard's stand-in for its router where ingresses take the requests (``--ingress N
    --shards K``): the same three things a shard's router is told and asked
    (:class:`~ppipe.runtime.control.shard_control.ShardControl`,
    :class:`~ppipe.runtime.launch.shards.PeerExchange`), kept for the ingresses instead.
    ``address`` is the runtime's ingress inbox; ``set_peers`` (every shard's address) and
    ``owner`` (who schedules each model) are told to the ingresses by shard 0's host.

    Args:
        runtime: the shard's :class:`~ppipe.runtime.scheduler.host.Runtime` (``accept_ingresses``).
        index: the shard's number (its messages to the ingresses carry it as ``origin``).
        owner: model -> its shard, or [(shard, weight)] where several schedule it.
    """

    def __init__(self, runtime, index: int, owner):
        self.runtime, self.index = runtime, index
        runtime.shard_index = index
        self._owner = owner_table(owner)
        self._peers: tuple[str, ...] | None = None

    @property
    def address(self) -> str | None:
        return self.runtime.ingress_address

    @property
    def owner(self) -> dict[str, tuple[tuple[int, float], ...]]:
        return self._owner

    @owner.setter
    def owner(self, owner) -> None:
        self._owner = owner_table(owner)
        self._tell()

    def set_peers(self, addresses) -> None:
        """Every shard's ingress inbox by index (None: that shard is down)."""
        self._peers = tuple(a or "" for a in addresses)
        self._tell()

    def _tell(self) -> None:
        if self.index == 0 and self._peers is not None:
            self.runtime.tell_directory(self._peers, self._owner)


class IngressesMixin:
    """The :class:`~ppipe.runtime.scheduler.host.Runtime`'s side of its ingress processes (mixed into it).

    It works on the runtime's state, chiefly ``clock``, ``plan``, ``_outbox``, ``_inflight``
    and ``data_secret``, and calls its ``_submit``, ``_settle``, ``_withdraw``, ``_fail``,
    ``refuse`` and ``model_ready``.
    """

    def _init_ingresses(self) -> None:
        self.ingress_address: str | None = None  # where ingresses send (after start)
        self._ingress_inbox: Inbox | None = None
        self._ingress_addrs: dict[int, str] = {}  # ingress -> its inbox's address
        self._remote: dict[tuple[int, int], Pending] = {}  # (ingress, its id) -> the request
        self.forwarded_batches = 0  # batches whose inputs this host sent the first worker (refs or small bytes)
        self._down: dict[int, _Down] = {}
        self._told_ready: tuple[str, ...] | None = None
        self._ingress_metrics: dict[int, bytes] = {}  # ingress -> the last metrics text it sent
        self.shard_metrics: dict[int, bytes] = {}  # shard 0 of several schedulers: shard -> its last metrics text
        self._served: tuple[object, ServedPlan] | None = None  # (the plan, what the ingresses are told of it)
        self.shard_index = 0  # this host's shard (its messages' origin)
        self._directory: tuple[tuple[str, ...], dict] | None = None  # shard 0's: (schedulers, owner table)
        self.on_switch.append(self._tell_plan)

    def _open_ingress_inbox(self, host: str) -> list[asyncio.Task]:
        """Listen for ingress processes; returns the tasks that keep them told of readiness
        and time out their requests."""
        self._ingress_inbox = Inbox(self._on_ingress, host, self.data_secret, on_refused=lambda why: self.refuse("handshake", why))
        self.ingress_address = self._ingress_inbox.address
        loop = asyncio.get_running_loop()
        return [loop.create_task(self._keep_readiness_told()), loop.create_task(self._time_out_remote())]

    @property
    def ingresses(self) -> dict[int, str]:
        """The ingress processes that said hello: {index: inbox address}."""
        return dict(self._ingress_addrs)

    # ---- from the ingresses ---------------------------------------------------------------
    def _on_ingress(self, message: memoryview | bytes) -> None:
        try:
            m, _ = unpack(message, FromIngress)
        except WireError as exc:
            log.warning("dropped a malformed message from an ingress: %s", exc)
            return
        if m.hello is not None:
            self._ingress_addrs[m.ingress] = m.hello
            down = self._tell(m.ingress)
            down.plan, down.ready, down.directory = self._served_plan(), self._ready_models(), self._directory
        elif m.ingress not in self._ingress_addrs:
            self.refuse("ingress-unknown", f"ingress {m.ingress} sent requests before its hello")
            return
        if m.metrics is not None:
            self._ingress_metrics[m.ingress] = m.metrics
        for a in m.arrivals:
            self._submit_remote(m.ingress, a)
        if m.withdrawn:
            subs = [p for p in (self._remote.get((m.ingress, rid)) for rid in m.withdrawn) if p is not None]
            self._withdraw(subs)

    def _submit_remote(self, ingress: int, a: Arrival) -> None:
        key = (ingress, a.rid)
        if self._warming is not None:  # an ingress that came up before the warm-up ended
            self._tell(ingress).refusals.append(Refusal((a.rid,), "starting", "the server is warming up; retry shortly"))
            return
        try:
            p = self._submit(a.model, RemoteInput(ingress, a.rid, _checked(a.inputs)), self.clock.from_wall_us(a.arrival_us),
                             on_answer=lambda p, exc: self._remote_answered(p, key, exc))
        except DroppedError as exc:  # a model the plan does not serve (any more)
            self._tell(ingress).refusals.append(Refusal((a.rid,), exc.reason, exc.detail))
            return
        if not p.future.done():  # (the scheduler may drop it as it is submitted)
            self._remote[key] = p

    def _remote_answered(self, p: Pending, key: tuple[int, int], exc: BaseException | None) -> None:
        """A remote request's answer here: served (the last worker answered its ingress) or an error to tell it."""
        self._settle(p)
        self._remote.pop(key, None)
        if exc is not None:
            reason, detail = (exc.reason, exc.detail) if isinstance(exc, DroppedError) else ("worker-error", str(exc))
            self._tell(key[0]).refusals.append(Refusal((key[1],), reason, detail))

    def ingress_gone(self, ingress: int) -> None:
        """An ingress process is gone (its launcher saw it die): its requests are answered
        ``ingress-gone`` here (nobody waits for them), and the batches in flight with rows of
        it whose first stage has not reported fail (their first worker waits for rows that
        will not come)."""
        self._ingress_addrs.pop(ingress, None)
        self._down.pop(ingress, None)
        self._ingress_metrics.pop(ingress, None)
        for b in list(self._inflight.values()):
            if 0 in b.unreported and any(isinstance(r.payload, RemoteInput) and r.payload.ingress == ingress for r in b.d.requests):
                self._fail(b, "worker-failed", f"ingress {ingress} went away before the batch's inputs were all sent")
        subs = [p for (i, _), p in list(self._remote.items()) if i == ingress]
        self._withdraw(subs)

    # ---- to the ingresses -----------------------------------------------------------------
    def _answers_to(self, d: Dispatch) -> tuple[AnswerTo, ...]:
        """Where the rows of batch ``d`` are answered: one :class:`AnswerTo` per ingress that
        holds some of them, in the order of their first row (rows of one ingress are kept together).

        Raises:
            DataPathFull: an ingress of the batch has gone.
        """
        if len(d.requests) == 1:  # (the usual batch of one: the same answer, without the grouping)
            p = d.requests[0].payload
            addr = self._ingress_addrs.get(p.ingress)
            if addr is None:
                raise DataPathFull(f"ingress {p.ingress}, which holds inputs of batch {d.batch_id}, has gone")
            return (AnswerTo(addr, 0, (p.rid,)),)
        groups: dict[int, list[int]] = {}
        for r in d.requests:
            groups.setdefault(r.payload.ingress, []).append(r.payload.rid)
        answers, offset = [], 0
        for ingress, rids in groups.items():
            addr = self._ingress_addrs.get(ingress)
            if addr is None:
                raise DataPathFull(f"ingress {ingress}, which holds inputs of batch {d.batch_id}, has gone")
            answers.append(AnswerTo(addr, offset, tuple(rids)))
            offset += len(rids)
        return tuple(answers)

    def _forwarded_inputs(self, d: Dispatch, first_address: str) -> dict[str, ForwardedRows] | None:
        """Batch ``d``'s inputs as the scheduler can send them to its first worker itself, in
        the rows' order of :meth:`_answers_to` (each ingress's requests together), or None
        where it cannot: a request whose arrival offered none, rows that disagree on their
        inputs' names, dtypes or shapes, or a ref of an ingress not on the worker's machine."""
        if len(d.requests) == 1:
            return self._forwarded_row(d.requests[0].payload, first_address)
        rows = [r.payload for r in d.requests]
        ingresses = dict.fromkeys(p.ingress for p in rows)
        if len(ingresses) > 1:
            rows = [p for i in ingresses for p in rows if p.ingress == i]
        first = rows[0].inputs
        if not first or any(len(p.inputs) != len(first) for p in rows):
            return None
        shared = any(x.ref is not None for x in first)
        if shared and not all(self._near(i, first_address) for i in ingresses):
            return None
        out = {}
        for k, x in enumerate(first):
            column = [p.inputs[k] for p in rows]
            if len(column) > 1 and any(c.name != x.name or c.dtype != x.dtype or c.shape != x.shape
                                       or (c.ref is None) != (x.ref is None) for c in column):
                return None
            if x.ref is None:
                out[x.name] = ForwardedRows(x.dtype, x.shape, [], [c.data for c in column])
            else:
                out[x.name] = ForwardedRows(x.dtype, x.shape, [c.ref for c in column], [])
        return out

    def _forwarded_row(self, row: RemoteInput, first_address: str) -> dict[str, ForwardedRows] | None:
        """:meth:`_forwarded_inputs` of a batch of one row (nothing to compare it with)."""
        if not row.inputs or (any(x.ref is not None for x in row.inputs) and not self._near(row.ingress, first_address)):
            return None
        return {x.name: ForwardedRows(x.dtype, x.shape, [], [x.data]) if x.ref is None else ForwardedRows(x.dtype, x.shape, [x.ref], [])
                for x in row.inputs}

    def _near(self, ingress: int, address: str) -> bool:
        """Whether ingress ``ingress`` is on the machine of the peer at ``address``."""
        inbox = self._ingress_addrs.get(ingress)
        return inbox is not None and same_machine(inbox, address)

    def _send_remote_inputs(self, d: Dispatch, message: StageMsg) -> None:
        """Tell each ingress with rows in batch ``d`` to send them: its part of ``message``
        (the batch's stage message with its :meth:`_answers_to`)."""
        ingresses = dict.fromkeys(r.payload.ingress for r in d.requests)
        for ingress, to in zip(ingresses, message.answers):
            self._tell(ingress).sends.append(SendInputs(msgspec.structs.replace(message, part=(to.offset, len(to.rids))), to.rids))

    def _tell(self, ingress: int) -> _Down:
        """What ingress ``ingress`` is told this tick (the tick's flush is armed with the first)."""
        down = self._down.get(ingress)
        if down is None:
            if not self._down:
                asyncio.get_running_loop().call_soon(self._flush_ingresses)
            down = self._down[ingress] = _Down()
        return down

    def _flush_ingresses(self) -> None:
        downs, self._down = self._down, {}
        for ingress, down in downs.items():
            addr = self._ingress_addrs.get(ingress)
            if addr is None:
                continue
            try:
                schedulers, owner = down.directory or (None, None)
                self._outbox.send(addr, pack(ToIngress(tuple(down.sends), tuple(down.refusals), down.ready, down.metrics, down.plan,
                                                       self.shard_index, schedulers, owner)))
            except DataPathFull:
                log.error("ingress %d stopped reading; %d sends and %d refusals to it are lost", ingress, len(down.sends), len(down.refusals))

    def _served_plan(self) -> ServedPlan:
        """The plan served now, as the ingresses are told it (made once per plan)."""
        if self._served is None or self._served[0] is not self.plan:
            manifests = {m.name: self.profiles[m.name].manifest.model_dump_json().encode() for m in self.plan.models}
            self._served = (self.plan, ServedPlan(self.plan.model_dump_json().encode(), manifests))
        return self._served[1]

    def tell_directory(self, schedulers: tuple[str, ...], owner: dict) -> None:
        """Shard 0: every ingress learns the schedulers' inboxes and the owner table."""
        self._directory = (schedulers, owner)
        for ingress in self._ingress_addrs:
            self._tell(ingress).directory = self._directory

    def _tell_plan(self) -> None:
        """After a plan switch: tell every ingress the new plan and the models ready in it."""
        if not self._ingress_addrs:
            return
        plan, ready = self._served_plan(), self._ready_models()
        self._told_ready = ready
        for ingress in self._ingress_addrs:
            down = self._tell(ingress)
            down.plan, down.ready = plan, ready

    def _ready_models(self) -> tuple[str, ...]:
        if self._warming is not None:  # none before the warm-up has ended (warmup)
            return ()
        return tuple(m.name for m in self.plan.models if self.model_ready(m.name))

    async def _keep_readiness_told(self) -> None:
        """Every READINESS_CHECK_S, tell the ingresses the models ready where that changed;
        every METRICS_EVERY_S, the whole server's metrics."""
        ticks_per_metrics = max(1, round(METRICS_EVERY_S / READINESS_CHECK_S))
        for tick in itertools.count(1):
            await asyncio.sleep(READINESS_CHECK_S)
            ready = self._ready_models()
            if ready != self._told_ready:
                self._told_ready = ready
                for ingress in self._ingress_addrs:
                    self._tell(ingress).ready = ready
            if tick % ticks_per_metrics == 0 and self._ingress_addrs and self.shard_index == 0:  # shard 0's merge is the server's
                text = self.render_metrics()
                for ingress in self._ingress_addrs:
                    self._tell(ingress).metrics = text

    async def _time_out_remote(self) -> None:
        """Answer ``timeout`` the ingresses' requests still unanswered at SLO + ``answer_grace_s``
        (as a local request's own timer does), looking every ``REMOTE_TIMEOUT_CHECK_S`` or
        half the grace, whichever is shorter: a timeout is a safety net (the data plane
        dispatches or drops every request, and a batch's report deadline fails it), so one
        sweep of the requests in flight replaces a timer per request."""
        every_s = min(REMOTE_TIMEOUT_CHECK_S, self.answer_grace_s / 2)
        while True:
            await asyncio.sleep(every_s)
            limit_us = self.clock.true_now_us() - self.answer_grace_s * 1e6
            late = [p for p in self._remote.values() if p.slo_deadline_us < limit_us]
            for p in late:
                timeout_s = (p.slo_deadline_us - p.request.arrival_us) / 1e6 + self.answer_grace_s
                self._timed_out(p.request.id, timeout_s)

    def render_metrics(self) -> bytes:
        """This host's Prometheus text, with the last that each ingress and (shard 0 of several
        schedulers) each other scheduler sent, where any did: every sample labelled with its
        ``process`` (``scheduler``, ``scheduler-j``, ``ingress-i``)."""
        own = self.metrics.render()
        if not (self._ingress_metrics or self.shard_metrics):
            return own
        shards, ingresses = sorted(self.shard_metrics), sorted(self._ingress_metrics)
        texts = [own, *(self.shard_metrics[j] for j in shards), *(self._ingress_metrics[i] for i in ingresses)]
        names = ["scheduler", *(f"scheduler-{j}" for j in shards), *(f"ingress-{i}" for i in ingresses)]
        return merge_metrics(texts, names, label="process")
