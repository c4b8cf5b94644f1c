"""Ingress processes on every Ray node: ``ppipe serve --ingress N`` under the Ray launcher.

A client reaches the node it is sent to, so each alive Ray node at start runs N ingress
processes on ``--port`` (``SO_REUSEPORT``), the same processes as the local launcher's
(:mod:`ppipe.runtime.launch.local_ingresses`). On each node a small Ray actor, the
:class:`IngressAgent` (no CPU reserved, pinned to the node), starts one ingress process
there over a socket pair and holds that pair: the agent's death (its node lost, ``ray
kill``) ends the pair and so stops the ingress, and the ingress's death ends the agent's
:meth:`IngressAgent.lifeline` call. A request's tensor thus goes from the ingress on the
client's node to its batch's first worker and back from the last one; the scheduler on
the head node sees only each request's metadata.

Addresses. Where every alive node is this host (one machine, or nodes started on one
host), everything binds the loopback address. Otherwise each ingress's inbox binds its
node's Ray address, and so do the scheduler's ingress inbox and its own HTTP API (where
ingresses pass plan switches; it takes the server's ``--token`` as the port does). An
ingress binds ``--host`` (and the gRPC host) where that is a wildcard or loopback address
or the node's own; a node that lacks the named address binds its Ray address instead.

Restarts are the :class:`~ppipe.runtime.launch.local_ingresses.IngressSupervisor`'s, as for
local ingresses: a fresh agent goes to the alive node that is the same machine as before,
by its address and its resources' names (a node restarted after a loss has a new id).

Not built here: ingresses on nodes that join after the start.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import ipaddress
import itertools
import logging
from typing import Any

from ppipe.errors import UserError
from ppipe.runtime.launch.local_ingresses import IngressStart, LocalIngress
from ppipe.runtime.wire.datapath import LOOPBACK

log = logging.getLogger("ppipe.runtime")
_incarnations = itertools.count()  # the agents' names stay unique while Ray releases a dead one's


@dataclasses.dataclass(frozen=True)
class RayNode:
    """An alive Ray node where ingresses run: its id, address and the names of its resources
    (with the address, what says it is the same machine after a restart)."""

    node_id: str
    address: str
    resources: frozenset[str]

    @property
    def machine(self) -> tuple[str, frozenset[str]]:
        return self.address, self.resources


def alive_nodes() -> list[RayNode]:
    """The alive nodes of the Ray cluster this process is connected to, by address and id."""
    import ray

    out = [RayNode(n["NodeID"], n["NodeManagerAddress"], frozenset(k for k in n.get("Resources", {}) if not k.startswith("node:")))
           for n in ray.nodes() if n.get("Alive")]
    return sorted(out, key=lambda n: (n.address, n.node_id))


def bind_host(host: str, node_address: str) -> str:
    """The address an ingress on the node at ``node_address`` binds for ``--host host``:
    ``host`` where it is a wildcard or loopback address, a name, or the node's own address;
    the node's address where ``host`` names another machine's."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host  # a name (localhost): each node resolves its own
    if ip.is_unspecified or ip.is_loopback or host == node_address:
        return host
    return node_address


class IngressAgent:
    """The Ray actor that runs one ingress process on its node (see the module's docstring)."""

    def __init__(self) -> None:
        from ppipe.runtime.workers.worker import undo_ray_niceness

        undo_ray_niceness()  # the ingress it starts inherits it, and is on every request's path
        self._ingress: LocalIngress | None = None

    async def start(self, start: IngressStart) -> tuple[bool, str]:
        """Start the ingress (its hosts fitted to this node) and wait for it to serve:
        ``(True, its inbox address)``, or ``(False, why not)``."""
        import ray

        here = ray.util.get_node_ip_address()
        start = for_node(start, here)
        self._ingress = LocalIngress(start)
        try:
            self._ingress.launch()
            return True, await asyncio.to_thread(self._ingress.wait_started)
        except UserError as exc:
            self._ingress.kill()
            return False, f"{exc.render()} (on node {here})"

    async def lifeline(self) -> int | None:
        """Returns once the ingress process is gone: its exit code."""
        assert self._ingress is not None
        return await self._ingress.lifeline()

    async def terminate(self) -> None:
        if self._ingress is not None:
            self._ingress.terminate()

    async def wait_exit(self, timeout_s: float) -> None:
        if self._ingress is not None and self._ingress.proc is not None:
            await asyncio.to_thread(self._ingress.wait_exit, timeout_s)

    async def kill(self) -> None:
        """Kill the ingress process (its group), then end this actor."""
        import ray

        if self._ingress is not None:
            self._ingress.kill()
        ray.actor.exit_actor()


def for_node(start: IngressStart, node_address: str) -> IngressStart:
    """``start`` as the ingress on the node at ``node_address`` binds it: its inbox on the
    node's address unless the server keeps to loopback, and ``bind_host`` of its ports."""
    grpc = dict(start.settings.grpc)
    if grpc:
        grpc["host"] = bind_host(grpc["host"], node_address)
    settings = dataclasses.replace(start.settings, grpc=grpc)
    data_host = start.data_host if start.data_host == LOOPBACK else node_address
    return dataclasses.replace(start, settings=settings, host=bind_host(start.host, node_address), data_host=data_host)


class RayIngress:
    """One ingress on a Ray node, through its :class:`IngressAgent`: the calls of
    :class:`~ppipe.runtime.launch.local_ingresses.LocalIngress` that the supervisor makes.

    Args:
        start: what the ingress is started with.
        node: where (a restart goes to the alive node that is the same machine).
    """

    def __init__(self, start: IngressStart, node: RayNode):
        self.spec, self.node = start, node
        self.address: str | None = None
        self._agent: Any = None
        self._started: Any = None  # the reference of the agent's start call

    def describe(self) -> str:
        return f"ingress {self.spec.index} (Ray node {self.node.address} {self.node.node_id[:8]})"

    def launch(self) -> None:
        """Create the agent on the node and ask it to start the ingress; returns at once.

        Raises:
            UserError: no alive node is that machine (it was lost and is not back).
        """
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self.node = self._current_node()
        self._agent = agent_class().options(name=f"ppipe-ingress-{self.spec.index}-{next(_incarnations)}",
                                            scheduling_strategy=NodeAffinitySchedulingStrategy(self.node.node_id, soft=False)).remote()
        self._started = self._agent.start.remote(self.spec)

    def _current_node(self) -> RayNode:
        nodes = alive_nodes()
        if any(n.node_id == self.node.node_id for n in nodes):
            return self.node
        for n in nodes:
            if n.machine == self.node.machine:
                return n
        raise UserError(f"{self.describe()}: its Ray node is gone and no alive node is that machine",
                        fix="it starts again there once the node is back (ray start on that machine)")

    def wait_started(self) -> str:
        """Wait for the ingress to serve (blocking); its inbox address.

        Raises:
            UserError: it did not start (its error), in time, or its node is gone.
        """
        import ray

        timeout_s = self.spec.start_timeout_s + 30.0
        try:
            ok, value = ray.get(self._started, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            self._abandon()
            raise UserError(f"{self.describe()} did not start within {timeout_s:.0f} s") from None
        except ray.exceptions.RayError as exc:
            self._abandon()
            raise UserError(f"{self.describe()} did not start: {_first_line(exc)}") from None
        if not ok:
            self._abandon()
            raise UserError(f"{self.describe()} did not start: {value}", fix="see its error above")
        self.address = value
        return value

    async def lifeline(self) -> int | None:
        """Returns once the ingress or its agent or node is gone: the exit code (None: unknown)."""
        import ray

        try:
            return await self._agent.lifeline.remote()
        except ray.exceptions.RayError as exc:
            log.debug("%s: its agent is gone: %s", self.describe(), _first_line(exc))
            return None

    def terminate(self) -> None:
        """SIGTERM the ingress (no wait): it stops taking connections and answers what it holds."""
        if self._agent is not None:
            self._agent.terminate.remote()

    def wait_exit(self, timeout_s: float) -> None:
        """Wait (blocking) up to ``timeout_s`` for the ingress to exit."""
        import ray

        if self._agent is not None:
            try:
                ray.get(self._agent.wait_exit.remote(timeout_s), timeout=timeout_s + 5.0)
            except ray.exceptions.RayError:
                pass  # gone already, or still draining: kill() follows

    def kill(self) -> None:
        """Ask the agent to kill the ingress process and end (no wait). An agent gone
        already took the pair with it, and the ingress stops by itself."""
        if self._agent is not None:
            self._agent.kill.remote()

    def _abandon(self) -> None:
        """``ray.kill`` the agent: one still waiting for its node (gone) is never placed, and
        an ingress it started stops with its pair."""
        from ppipe.runtime.launch.refs import kill_quietly

        kill_quietly(self._agent)

    def again(self) -> "RayIngress":
        """A fresh handle for the same ingress on the same machine (not launched)."""
        return RayIngress(self.spec, self.node)


@functools.cache
def agent_class() -> Any:
    """:class:`IngressAgent` as a Ray actor class (made once per process)."""
    import ray

    return ray.remote(num_cpus=0, max_restarts=0, max_concurrency=8)(IngressAgent)


def ray_ingresses(per_node: int, start: Any) -> list[RayIngress]:
    """``per_node`` ingresses on every alive Ray node, numbered node by node;
    ``start(index)``: ingress ``index``'s :class:`IngressStart`."""
    nodes = alive_nodes()
    return [RayIngress(start(i * per_node + j), node) for i, node in enumerate(nodes) for j in range(per_node)]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
