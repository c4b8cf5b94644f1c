"""Frontend shards as Ray actors on this node: the Ray launcher's shards, restarted when they die.

Under ``--launcher ray``, ``ppipe serve --shards N`` runs shards 1..N-1 each as a
:class:`~ppipe.runtime.launch.shards.ShardServer` actor on the node of ``ppipe serve`` (they
share its port, ``SO_REUSEPORT``), at the driver's priority. Shard 0 reaches one through a
:class:`RayShard`: its requests are actor calls to :meth:`ShardServer.control`, and the
handle keeps what the shard serves as they commit
(:class:`~ppipe.runtime.control.shard_control.ServedPart`).

A shard that dies (its process killed, a crash) is restarted by shard 0's
:class:`~ppipe.runtime.launch.shards.ShardSupervisor`, as a local shard is: a pending call
of the actor's :meth:`ShardServer.lifeline` fails once Ray knows the actor is gone;
meanwhile every router has the shard down, so its models' requests get an explicit 503.
What a dead actor leaves:

* the workers it started itself (a plan switch's, a failed worker's replacement) are its
  own actors, and Ray ends them with their owner (an actor's fate is shared with the
  process that created it);
* the workers shard 0 started for it at first are shard 0's: the handle kills them.

So the new actor starts every worker of the part it last served itself
(:func:`~ppipe.runtime.launch.serving.start_workers_and_links`, on its own node), and
those die with it in turn.
"""

from __future__ import annotations

import logging
from typing import Any

from ppipe.runtime.control.shard_control import LogArrivals, ServedPart, ShardRequest
from ppipe.runtime.launch.refs import kill_quietly
from ppipe.runtime.launch.shards import ShardServer, ShardStart

log = logging.getLogger("ppipe.runtime")


def here_strategy():
    """Ray scheduling on this process's node (shards share its port)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)


class _RayShardServer(ShardServer):
    """A :class:`ShardServer` as Ray starts it: at the driver's priority, not Ray's worker
    niceness; :meth:`lifeline` for shard 0 to await."""

    def __init__(self, *args: Any):
        from ppipe.runtime.workers.worker import undo_ray_niceness

        undo_ray_niceness()  # on every request's path, like the workers
        super().__init__(*args)

    async def lifeline(self) -> None:
        """Never returns: shard 0 awaits it, and Ray fails the call when this actor dies."""
        import asyncio

        await asyncio.Event().wait()


def shard_actor_class():
    """:class:`ShardServer` as a Ray actor class."""
    import ray

    return ray.remote(num_cpus=0, max_concurrency=16)(_RayShardServer)


class RayShard(ServedPart):
    """Shard 0's handle on one shard actor: its requests, its lifeline and its restart
    (a :class:`~ppipe.runtime.launch.shards.RestartableShard`).

    Args:
        start: what the shard serves at first (its index, deployment, models, owners, the
            shared address; the settings of every shard).
        workers: the handles of its part's workers, which shard 0 started (killed when the
            shard dies: the next actor starts its own).
        edges: their NCCL or ring edges.
    """

    def __init__(self, start: ShardStart, workers: dict[str, Any], edges: dict):
        self.spec, self.index = start, start.index
        self._given: dict[str, Any] | None = dict(workers)
        self._edges = dict(edges)
        self.actor: Any = None
        self.address: str | None = None
        self.why_gone: str | None = None
        self.down: str | None = None  # why requests are refused: the actor is gone and not yet restarted
        self.generation = 0  # actors started so far

    def describe(self) -> str:
        return f"shard {self.index} ({', '.join(self.spec.models)}; Ray actor {self.generation})"

    def launch(self) -> None:
        """Create the shard's actor (returns at once): with shard 0's workers the first
        time, starting its own after a restart."""
        s = self.spec
        workers, edges = (self._given, self._edges) if self._given is not None else (None, {})
        self.actor = shard_actor_class().options(scheduling_strategy=here_strategy()).remote(
            s.index, s.dep, s.models, workers, edges, s.settings, s.owner, s.host, s.port)
        self.generation += 1
        self.why_gone = None

    def wait_started(self, timeout_s: float | None = None) -> str:
        """Wait for the actor to serve (blocking); its router address."""
        import ray

        timeout_s = self.spec.start_timeout_s + 60.0 if timeout_s is None else timeout_s
        self.address = ray.get(self.actor.start.remote(), timeout=timeout_s)
        if self.spec.log_arrivals:
            ray.get(self.actor.control.remote(LogArrivals(True)), timeout=timeout_s)
        return self.address

    async def call(self, request: ShardRequest) -> Any:
        if self.down is not None:
            raise ConnectionError(self.down)
        answer = await self.actor.control.remote(request)
        self._note(request)
        return answer

    async def lifeline(self) -> None:
        """Returns once the actor is gone (:attr:`why_gone` says how)."""
        import ray

        try:
            await self.actor.lifeline.remote()
        except ray.exceptions.RayError as exc:  # ActorDiedError, ActorUnavailableError, ...
            text = str(exc).strip()
            self.why_gone = self.down = f"{self.describe()} is gone: {text.splitlines()[0] if text else type(exc).__name__}"

    def reset(self) -> None:
        """Forget the gone actor (the shard stays :attr:`down` until :meth:`up`): kill the
        workers shard 0 gave it, drop a switch it had prepared."""
        for h in (self._given or {}).values():
            h.kill()
        self._given = None
        self._prepared = None
        kill_quietly(self.actor)

    def restart(self) -> str:
        """Start the shard anew, as it served last; its new router address (blocking)."""
        self.launch()
        return self.wait_started()

    def up(self) -> None:
        self.down = None

    def terminate(self) -> None:
        """Stop the actor (its own workers end with it)."""
        if self.actor is not None:
            kill_quietly(self.actor)

    def __repr__(self) -> str:
        return f"RayShard({self.index}, actor {self.generation})"


def start_ray_shards(deps: list[Any], parts: list[list[str]], workers: dict[str, Any], edges: dict, settings: Any,
                     owner: dict[str, Any], host: str, port: int, start_timeout_s: float = 300.0) -> list[RayShard]:
    """Start the frontend shards but the first (the calling process is shard 0) as Ray actors
    on this node and wait for them to serve; ``deps[i]``: shard i's deployment (its plan
    holds its part). Each is given the handles of its part's workers among ``workers``."""
    from ppipe.runtime.control.shard_plan import sub_plan

    shards = []
    try:
        for i, models in enumerate(parts):
            if i > 0:
                mine = {p.vgpu_id for p in sub_plan(deps[i].plan, models).placement}
                start = ShardStart(i, deps[i], list(models), settings, dict(owner), host, port, start_timeout_s=start_timeout_s)
                shards.append(RayShard(start, {v: h for v, h in workers.items() if v in mine},
                                       {e: t for e, t in edges.items() if e[0] in mine}))
                shards[-1].launch()
        for s in shards:
            s.wait_started()
    except BaseException:
        for s in shards:
            s.terminate()
        raise
    return shards
