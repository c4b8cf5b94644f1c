"""What ``ppipe serve`` starts, from its flags: the settings every frontend shard is built
with, the workers and their links, the other shards, the ingress processes of
``--ingress``, the first shard's companions (peer exchange, plan switches, re-planning,
the ingresses' supervisor), and what is stopped at shutdown. ``ppipe.runtime.cli`` parses
and checks the flags and composes these."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets


log = logging.getLogger("ppipe.runtime")

def start_workers_and_links(dep, backend: str, backend_options: dict, transport: str, launcher: str = "ray",
                             only: set[str] | None = None) -> tuple[dict, dict]:
    """Start the plan's vGPU workers (those of ``only``, if given) with ``launcher`` and
    connect them (``--transport``): (workers, edges). The local launcher's edges all go over
    the data path's connections (no edges named). Workers whose links cannot be set up are
    killed before the error goes on."""
    from ppipe.runtime.launch.deploy import setup_transport
    from ppipe.runtime.launch.launchers import start_function

    workers = start_function(launcher)(dep, backend=backend, backend_options=backend_options, only=only)
    if launcher == "local":
        return workers, {}
    try:
        edges = setup_transport(dep, workers, transport)
    except BaseException:
        for h in workers.values():
            h.kill()
        raise
    return workers, edges


def serve_settings(policy, options, dispatch_lead_ms, answer_budget_ms, report_tolerance_ms, transport, token, max_body_mb,
                    body_timeout_s, decode_workers, header_timeout_s, shutdown_timeout_s, backend, backend_options, host, grpc_port,
                    launcher: str = "ray", warm_up: bool = True):
    """What every frontend shard is built with: the runtime's, app's, HTTP server's,
    workers' and gRPC frontend's settings, from ``ppipe serve``'s flags."""
    from ppipe.runtime.launch.deploy import LinkOpener
    from ppipe.runtime.launch.shards import ServeSettings

    return ServeSettings(
        runtime={"policy": policy, "scheduler_options": options, "dispatch_lead_us": dispatch_lead_ms * 1000.0,
                 "data_secret": secrets.token_bytes(32),  # this server's: its data path's connections prove it
                 "links": None if transport == "tcp" or launcher == "local" else LinkOpener(transport),
                 "answer_budget_us": answer_budget_ms * 1000.0,
                 "report_tolerance_us": None if report_tolerance_ms < 0 else report_tolerance_ms * 1000.0,
                 "warm_up": warm_up},
        app={"token": token, "max_body_bytes": int(max_body_mb * 1024 * 1024), "body_timeout_s": body_timeout_s,
             "decode_workers": decode_workers},
        server={"header_timeout_s": header_timeout_s, "shutdown_timeout_s": shutdown_timeout_s,
                "max_body_bytes": int(max_body_mb * 1024 * 1024)},
        workers={"backend": backend, "backend_options": backend_options, "launcher": launcher},
        grpc={} if grpc_port is None else {"host": host, "port": grpc_port, "token": token,
                                           "max_message_bytes": int(max_body_mb * 1024 * 1024)},
    )


class ShardSet:
    """The frontend shards but the first (the ``ppipe serve`` process is shard 0): local
    processes under the local launcher (:mod:`ppipe.runtime.launch.local_shards`, started
    here, so that they load while shard 0's workers do), Ray actors under Ray
    (:mod:`ppipe.runtime.launch.ray_shards`, started by :meth:`start`). Empty for one shard.
    ``deps[i]``: shard i's deployment, whose plan holds its part (``parts[i]``: its models)."""

    def __init__(self, launcher: str, deps: list, parts: list[list[str]], settings, owner: dict, host: str, port: int):
        self.launcher, self.deps, self.parts, self.settings, self.owner = launcher, deps, parts, settings, owner
        self.host, self.port = host, port
        self.local: list = []  # LocalShard, by index - 1
        self.ray: list = []  # RayShard, by index - 1
        self.addresses: list = []
        if launcher == "local" and len(parts) > 1:
            from ppipe.runtime.launch.local_shards import launch_local_shards

            self.local = launch_local_shards(deps, parts, settings, owner, host, port)

    def first_vgpus(self) -> set[str] | None:
        """The vGPUs whose workers this process starts: shard 0's under the local launcher
        (each other shard starts its own), every one under Ray (the actors get handles)."""
        if not self.local:
            return None
        from ppipe.runtime.control.shard_plan import sub_plan

        return {p.vgpu_id for p in sub_plan(self.deps[0].plan, self.parts[0]).placement}

    def start(self, workers: dict, edges: dict, shutdown) -> None:
        """Wait for the other shards to serve (Ray's are started now, with shard 0's workers'
        handles); their router addresses. On failure, ``shutdown()`` and re-raise."""
        try:
            if self.local:
                from ppipe.runtime.launch.local_shards import wait_local_shards

                self.addresses = wait_local_shards(self.local)
            elif len(self.parts) > 1:
                from ppipe.runtime.launch.ray_shards import start_ray_shards

                self.ray = start_ray_shards(self.deps, self.parts, workers, edges, self.settings, self.owner, self.host, self.port)
                self.addresses = [s.address for s in self.ray]
        except BaseException:
            shutdown()
            raise

    def handles(self) -> list:
        """Each other shard's :class:`~ppipe.runtime.control.shard_control.ShardHandle`, by index - 1."""
        return list(self.local or self.ray)

    def exchange(self, router):
        """Shard 0's companion that tells every shard the routers' addresses and restarts a
        shard that dies (:class:`~ppipe.runtime.launch.shards.ShardSupervisor`)."""
        from ppipe.runtime.launch.shards import ShardSupervisor

        return ShardSupervisor(router, self.handles())

    async def ingress_gone(self, index: int) -> None:
        """Tell every other shard that ingress ``index`` is gone (``--ingress N --shards K``);
        a shard that does not hear it fails that ingress's batches by their report grace."""
        from ppipe.runtime.control.shard_control import IngressGone

        results = await asyncio.gather(*(h.call(IngressGone(index)) for h in self.handles()), return_exceptions=True)
        for i, r in enumerate(results, 1):
            if isinstance(r, BaseException):
                log.warning("shard %d did not hear that ingress %d is gone: %s", i, index, r)

    def stop(self, timeout_s: float) -> None:
        """Stop every other shard: local ones drain within ``timeout_s`` (then are killed), actors are killed."""
        if self.local:
            from ppipe.runtime.launch.local_shards import stop_local_shards

            stop_local_shards(self.local, timeout_s)
        for s in self.ray:
            s.terminate()

    def kill(self) -> None:
        if self.local:
            from ppipe.runtime.launch.local_shards import kill_local_shards

            kill_local_shards(self.local)


def kill_all(shards: ShardSet, workers: dict, switchers: list, shutdown_timeout_s: float) -> None:
    """At shutdown: stop the other shards, kill the plan's workers and those the plan switchers started."""
    shards.stop(shutdown_timeout_s + 5.0)
    for h in [*workers.values(), *(h for sw in switchers for h in sw.started)]:
        h.kill()


def admin_host(ingress: int, launcher: str) -> str:
    """Where the scheduler's own HTTP API listens with ``--ingress N``: loopback, unless
    ingresses on other Ray nodes pass their plan switches to it (this node's Ray address)."""
    from ppipe.runtime.wire.datapath import LOOPBACK, node_host

    return node_host() if ingress and launcher == "ray" else LOOPBACK


def split_for_ingresses(settings, ingress: int, decode_workers: int | None):
    """(the scheduler process's settings, the ingresses'): with ``--ingress N`` the scheduler
    takes requests from ingresses only and serves no gRPC; each ingress gets the gRPC
    frontend and, unless ``--decode-workers`` says, a JSON decode pool of its share of the
    default. Without ingresses: (settings, None)."""
    if not ingress:
        return settings, None
    from ppipe.runtime.ingress.bodies import default_decode_workers

    scheduler = dataclasses.replace(settings, runtime={**settings.runtime, "accept_ingresses": True}, grpc={})
    per_ingress = decode_workers if decode_workers is not None else max(1, default_decode_workers() // ingress)
    return scheduler, dataclasses.replace(settings, app={**settings.app, "decode_workers": per_ingress})


def ingress_companion(ingress: int, dep, settings, host: str, port: int, shutdown_timeout_s: float, admin_url: str,
                      launcher: str = "local"):
    """``f(runtime)``: the :class:`~ppipe.runtime.launch.local_ingresses.IngressSupervisor`
    of ``--ingress N`` (None without): N ingress processes here, or under Ray N on every
    alive node; ``admin_url``: the scheduler's own API, where the ingresses pass plan
    switches."""
    if not ingress:
        return None
    from ppipe.runtime.launch.local_ingresses import IngressStart, IngressSupervisor, LocalIngress
    from ppipe.runtime.wire.datapath import node_host

    data_host = node_host()  # loopback unless Ray has nodes on other hosts (then each ingress binds its node's address)

    def start(scheduler_address: str):
        return lambda index: IngressStart(index, scheduler_address, dep, settings, host, port, admin_url, data_host=data_host)

    def ingresses(scheduler_address: str) -> list:
        if launcher == "ray":
            from ppipe.runtime.launch.ray_ingresses import ray_ingresses

            return ray_ingresses(ingress, start(scheduler_address))
        return [LocalIngress(start(scheduler_address)(i)) for i in range(ingress)]

    return lambda rt, on_gone=None: IngressSupervisor(rt, ingresses, stop_timeout_s=shutdown_timeout_s + 5.0, on_gone=on_gone)


def companions(rt, router, *, dep, layout, shards: ShardSet, switchers, worker_options, plan_file, replan_policy,
                replan_time_limit_s, ingresses=None, started_at: float | None = None) -> list:
    """The first shard's companions (``build_shard(companions=...)``): the peer exchange with
    the other shards, SIGHUP plan reloads, with ``--replan auto`` the re-planning loop, with
    ``--ingress`` (``ingresses``: ``f(runtime)``) the ingress processes' supervisor, and last
    the line that says the server is ready (:class:`ReadyLine`, from ``started_at``).
    It appends the server's plan switcher to ``switchers`` (one that refuses every switch
    where the shards split the plan's servers)."""
    from ppipe.runtime.control.switch import PlanSwitcher, ShardedSwitcher, SighupReload, SplitServersSwitcher
    from ppipe.runtime.control.shard_plan import sub_plan

    out = [] if router is None else [shards.exchange(router)]
    if ingresses is not None:  # --ingress: ingress processes serve the port, and pass plan switches here
        out.append(ingresses(rt, on_gone=shards.ingress_gone if router is not None else None))
        if router is not None:  # several schedulers: the server's /metrics has every one's
            from ppipe.runtime.launch.shards import ShardMetrics

            out.append(ShardMetrics(rt, shards.handles()))
    if router is None:  # one shard
        switchers.append(PlanSwitcher(rt, dep, **worker_options))
    else:
        first = layout.parts[0]
        mine = dataclasses.replace(dep, plan=sub_plan(layout.plans[0], first), profiles={m: dep.profiles[m] for m in first})
        kind = SplitServersSwitcher if layout.by == "servers" else ShardedSwitcher
        switchers.append(kind(PlanSwitcher(rt, mine, **worker_options), dep, layout.owner(), shards.handles(), router))
    out.append(SighupReload(switchers[0], plan_file))  # ppipe apply and SIGHUP switch plans
    if replan_policy is not None:
        from ppipe.runtime.control.replan import ReplanLoop

        out.append(ReplanLoop(switchers[0], replan_policy, replan_time_limit_s))
    if started_at is not None:
        out.append(ReadyLine(rt, started_at))
    return out


class ReadyLine:
    """A companion started after all the others: it prints to stderr how long `ppipe serve`
    took to be ready (``started_at``: its ``time.perf_counter()`` at start) and what the first
    shard's warm-up did."""

    def __init__(self, rt, started_at: float):
        self.rt, self.started_at = rt, started_at

    async def start(self) -> None:
        import time

        import click

        warmed = f" ({self.rt.warmed.describe()})" if self.rt.warmed is not None else " (no warm-up)"
        click.echo(f"ready {time.perf_counter() - self.started_at:.1f} s after start{warmed}", err=True)

    async def stop(self) -> None:
        pass


def serving_line(dep, plan_file, host, port, grpc_port, workers, edges, backend, policy, transport, parts, by: str = "models") -> str:
    """What ``ppipe serve`` prints once it serves: models, addresses, workers (every shard's:
    one per vGPU of the plan), links, shards (by servers: a model on several shards is
    named in each)."""
    return (
        f"serving {', '.join(m.name for m in dep.plan.models)} from {plan_file} on http://{host}:{port}/v2 "
        + (f"and gRPC {host}:{grpc_port} " if grpc_port is not None else "")
        + f"({len(dep.plan.placement)} vGPU workers, backend {backend}, policy {policy}, "
        f"{sum(t == 'nccl' for t, _ in edges.values())} of {len(edges)} worker pairs over NCCL"
        + (f", {sum(t.startswith('ring') for t, _ in edges.values())} through a staging ring" if transport == "ring" else "")
        + (f"; {len(parts)} shards{' by servers' if by == 'servers' else ''}: " + ", ".join("+".join(ms) for ms in parts)
           if len(parts) > 1 else "") + ")"
    )


