"""What shard 0 asks the other frontend shards: one message type per request.

A server of several frontend shards switches plans from shard 0
(:class:`ppipe.runtime.control.switch.ShardedSwitcher`), which asks every shard to prepare,
commit, abort, lift an embargo, log or hand over its arrivals, and follow new model owners
(and, where ingress processes take the requests, forget an ingress that died);
and shard 0 tells every shard where the others' routers are (:class:`SetPeers`, at start
and whenever a shard's process is replaced). Each request is a message below, sent through
a :class:`ShardHandle`: the other shards' handles cross a process
(:class:`ppipe.runtime.launch.local_shards.LocalShard` over a private socket pair,
:class:`ppipe.runtime.launch.ray_shards.RayShard` as a Ray actor call), shard 0's is this
process's :class:`ShardControl`. Every shard answers with its :class:`ShardControl`, which
dispatches on the message's type to that shard's
:class:`~ppipe.runtime.control.switch.PlanSwitcher` and router, so a shard runs only these
requests, never a method named by the caller.

Both channels pickle the messages (both ends are this program); a :class:`Prepare` carries
a :class:`~ppipe.runtime.launch.deploy.Deployment` as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Protocol, Union


@dataclass(frozen=True)
class Prepare:
    """Start the workers of ``deployment`` (the shard's part of the new plan) that are not kept;
    answered with ``{"kept": n, "started": n}``."""

    deployment: Any


@dataclass(frozen=True)
class Commit:
    """Switch to the prepared plan, holding each resource of ``embargo`` until the given
    wall-clock us (None: until a :class:`Lift`); answered with the switch's record."""

    embargo: dict[str, float | None]


@dataclass(frozen=True)
class Abort:
    """Stop the workers a :class:`Prepare` started; the old plan serves on."""


@dataclass(frozen=True)
class Lift:
    """End the embargo on ``resource``: the old plan's reservations there end at ``until_us``."""

    resource: str
    until_us: float


@dataclass(frozen=True)
class LogArrivals:
    """Start (``on``) or stop logging each request's (model, arrival) for the re-plan loop."""

    on: bool


@dataclass(frozen=True)
class TakeArrivals:
    """Hand over the arrivals logged since the last one: a list of (model, arrival us)."""


@dataclass(frozen=True)
class SetOwner:
    """Pass each model's requests to the shard ``owner`` names from now on."""

    owner: dict[str, int]


@dataclass(frozen=True)
class SetPeers:
    """Every shard's router address, by index (None: that shard is down); see
    :meth:`ppipe.runtime.ingress.shard_router.ShardRouter.set_peers`."""

    addresses: tuple[str | None, ...]


@dataclass(frozen=True)
class IngressGone:
    """Ingress process ``index`` is gone (``--ingress N --shards K``: shard 0's supervisor saw
    it die): answer its requests ``ingress-gone`` and fail the batches waiting for its rows
    (:meth:`ppipe.runtime.scheduler.ingresses.IngressesMixin.ingress_gone`)."""

    index: int


@dataclass(frozen=True)
class Scrape:
    """The shard's Prometheus text (``--ingress N --shards K``: shard 0 merges every
    scheduler's into the server's ``/metrics``)."""


ShardRequest = Union[Prepare, Commit, Abort, Lift, LogArrivals, TakeArrivals, SetOwner, SetPeers, IngressGone, Scrape]


class ShardHandle(Protocol):
    """One shard, as the switch sees it: ``await call(request)`` is that shard's answer."""

    async def call(self, request: ShardRequest) -> Any: ...


class ServedPart:
    """What a shard serves, kept by shard 0's handle on it as the requests through it are
    answered, so that a shard that dies is started again as it last served: a
    :class:`Prepare`'s deployment once its :class:`Commit` succeeds (never an aborted
    one), the owners of :class:`SetOwner`, the arrival log of :class:`LogArrivals`.

    ``spec``: the shard's start (:class:`~ppipe.runtime.launch.shards.ShardStart`: its
    ``dep``, ``models``, ``owner`` and ``log_arrivals`` are replaced here)."""

    spec: Any
    _prepared: Any = None

    def _note(self, request: ShardRequest) -> None:
        match request:
            case Prepare(deployment):
                self._prepared = deployment
            case Commit() if self._prepared is not None:
                dep, self._prepared = self._prepared, None
                self.spec = replace(self.spec, dep=dep, models=[m.name for m in dep.plan.models])
            case Abort():
                self._prepared = None
            case SetOwner(owner):
                self.spec = replace(self.spec, owner=dict(owner))
            case LogArrivals(on):
                self.spec = replace(self.spec, log_arrivals=on)


class ShardControl:
    """A shard's answers to :data:`ShardRequest`\\ s, on its own loop: each request to its
    handler on the shard's plan switcher (``switcher``) or router (``router``, None where
    the shard passes no requests). Shard 0's :class:`ShardHandle` as it is."""

    def __init__(self, switcher: Any, router: Any = None):
        self.switcher, self.router = switcher, router

    async def call(self, request: ShardRequest) -> Any:
        sw = self.switcher
        match request:
            case Prepare(deployment):
                return await sw.prepare(deployment)
            case Commit(embargo):
                return await sw.commit(embargo)
            case Abort():
                return await sw.abort()
            case Lift(resource, until_us):
                return await sw.lift(resource, until_us)
            case LogArrivals(on):
                return await sw.log_arrivals(on)
            case TakeArrivals():
                return await sw.take_arrivals()
            case SetOwner(owner):
                if self.router is not None:
                    self.router.owner = dict(owner)
                return None
            case SetPeers(addresses):
                if self.router is not None:
                    self.router.set_peers(list(addresses))
                return None
            case IngressGone(index):
                sw.runtime.ingress_gone(index)
                return None
            case Scrape():
                return sw.runtime.render_metrics()
        raise TypeError(f"not a shard request: {request!r}")
