"""From a plan to running workers: resolve profiles, map servers to Ray nodes, start actors.

:func:`start_workers` and :func:`respawn_worker` hand each actor out as a
:class:`~ppipe.runtime.launch.ray_workers.RayWorkerHandle` (the
:class:`~ppipe.runtime.launch.handle.WorkerHandle` the scheduler's host and plan control
use); the NCCL and ring set-up here (:func:`connect_edges`, :class:`LinkOpener`) takes those
handles and calls their actors.

Servers map to Ray nodes through custom resources named in the cluster YAML
(``ServerGroup.ray_resource``): server ``<group>-<i>`` goes to a node that offers resource
``<ray_resource>-<i>`` if any node does, else to any node offering ``<ray_resource>``.
Groups without ``ray_resource`` are placed wherever Ray likes, which on a single local
node is that node. Start the nodes with e.g.
``ray start --address=HEAD:6379 --resources='{"l4": 1, "l4-0": 1}'``.

On GPUs, each worker is pinned to the plan's GPU (``CUDA_VISIBLE_DEVICES``) and a worker
of vGPU level v > 1 runs under MPS with ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100/v``; the
MPS control daemon must run on every GPU server (``nvidia-cuda-mps-control -d``); a worker
refuses to start without it where its profile was measured under MPS
(:func:`~ppipe.runtime.workers.worker.check_gpu_sharing`). Ray's
own GPU accounting is bypassed (``num_gpus=0``) because the plan, not Ray, decides which
vGPU shares which GPU.

Each worker is a named actor (:func:`actor_name`: ``ppipe-vgpu-<vGPU id>``, in the job's
namespace), so ``ray list actors`` shows which vGPU is which. One vGPU id may have two live
actors at once: a worker re-created after a failure while Ray has not yet released the old
one's name, or a new worker started for a vGPU whose blocks changed while the old one
drains. Each actor of a vGPU is therefore an *incarnation*: 0 is the first, and every
re-creation takes the next number (``ppipe-vgpu-<id>-<n>``).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ppipe.errors import UserError
from ppipe.runtime.launch.ray_workers import RayWorkerHandle, actor_class, actor_of
from ppipe.runtime.launch.refs import settle
from ppipe.runtime.workers.worker import WorkerSpec
from ppipe.spec.cluster import ClusterSpec, load_cluster
from ppipe.spec.plan import Plan, load_plan
from ppipe.spec.profile import ModelProfile, load_profile_ref, profile_ref

log = logging.getLogger("ppipe.runtime")

# A worker asks for this much of its server's custom resource: enough to pin it to the
# node, small enough that any number of vGPUs fit on a node offering 1 unit.
RESOURCE_SHARE = 0.001

ACTOR_PREFIX = "ppipe-vgpu-"
NAME_TRIES = 3  # names tried (the next incarnations) before a name Ray still holds is an error


def actor_name(vgpu_id: str, incarnation: int = 0) -> str:
    """The Ray actor name of incarnation ``incarnation`` of vGPU ``vgpu_id``'s worker:
    ``ppipe-vgpu-<id>`` for the first, ``ppipe-vgpu-<id>-<n>`` for the n-th re-creation."""
    if incarnation < 0:
        raise ValueError(f"incarnation must be >= 0, got {incarnation}")
    return f"{ACTOR_PREFIX}{vgpu_id}" if incarnation == 0 else f"{ACTOR_PREFIX}{vgpu_id}-{incarnation}"


_incarnations: dict[str, int] = {}  # vGPU id -> the last incarnation this process created
_incarnations_lock = threading.Lock()  # respawns run in threads (asyncio.to_thread)


def next_incarnation(vgpu_id: str) -> int:
    """Reserve the next incarnation number of ``vgpu_id`` in this process (1 after the
    first worker, then 2, ...): a re-created worker never reuses a name Ray may still hold."""
    with _incarnations_lock:
        n = _incarnations[vgpu_id] = _incarnations.get(vgpu_id, 0) + 1
        return n


def _note_incarnation(vgpu_id: str, incarnation: int) -> None:
    with _incarnations_lock:
        _incarnations[vgpu_id] = max(_incarnations.get(vgpu_id, 0), incarnation)


@dataclass(frozen=True)
class Deployment:
    """Everything ``serve`` needs, loaded and checked."""

    plan: Plan
    cluster: ClusterSpec
    profiles: dict[str, ModelProfile]
    plan_file: str | None = None
    cluster_file: str | None = None


def load_deployment(plan_path: str | Path, cluster_ref: str | Path | None = None) -> Deployment:
    """Load plan.yaml, its cluster (``--cluster`` or the plan's own) and its model profiles."""
    plan_path = Path(plan_path)
    plan = load_plan(plan_path)
    base = plan_path.resolve().parent
    if cluster_ref is None:
        if plan.cluster_file:
            cand = Path(plan.cluster_file)
            cluster_ref = cand if cand.is_absolute() or not (base / cand).exists() else base / cand
        else:
            cluster_ref = plan.cluster
    cluster = load_cluster(cluster_ref)
    if cluster.name != plan.cluster:
        raise UserError(
            f"plan is for cluster '{plan.cluster}' but the cluster file describes '{cluster.name}'",
            fix="pass the cluster the plan was made for with --cluster",
            file=str(plan_path),
        )
    profiles = {}
    for m in plan.models:
        profiles[m.name] = load_profile_ref(m.profile, base)
    return Deployment(plan=plan, cluster=cluster, profiles=profiles, plan_file=str(plan_path), cluster_file=str(cluster_ref))


def worker_specs(dep: Deployment) -> list[WorkerSpec]:
    """One spec per vGPU of the placement; checks the placement covers every pool."""
    plan, file = dep.plan, dep.plan_file
    if not plan.placement:
        raise UserError(
            "the plan has no placement (which vGPU runs on which GPU of which server)",
            fix="re-run `ppipe plan`, which writes 'placement'",
            file=file,
        )
    gpus_of = {name: group.gpus_per_server for name, group in dep.cluster.server_names()}
    servers = set(gpus_of)
    specs: list[WorkerSpec] = []
    seen: dict[str, str] = {}
    for k, p in enumerate(plan.placement):
        where = f"placement[{k}]"
        try:
            mp = plan.model(p.model)
            pp = mp.pipelines[p.pipeline].partitions[p.partition]
        except (KeyError, IndexError):
            raise UserError(
                f"{where} names model '{p.model}' pipeline {p.pipeline} partition {p.partition}, which the plan lacks",
                fix="re-run `ppipe plan`",
                file=file,
            ) from None
        if p.server not in servers:
            raise UserError(
                f"{where}.server '{p.server}' is not a server of cluster '{dep.cluster.name}' ({', '.join(sorted(servers))})",
                fix="serve with the cluster file the plan was made for (--cluster)",
                file=file,
            )
        if p.gpu_index >= gpus_of[p.server]:
            raise UserError(
                f"{where}.gpu_index {p.gpu_index}: server '{p.server}' of cluster '{dep.cluster.name}' has {gpus_of[p.server]} GPU(s)",
                fix="serve with the cluster file the plan was made for (--cluster), or re-run `ppipe plan` for this cluster",
                file=file,
            )
        if p.vgpu_id in seen:
            raise UserError(f"{where}: vGPU {p.vgpu_id} is placed twice (also {seen[p.vgpu_id]})", fix="re-run `ppipe plan`", file=file)
        seen[p.vgpu_id] = where
        prof = dep.profiles[p.model]
        specs.append(
            WorkerSpec(
                vgpu_id=p.vgpu_id,
                server=p.server,
                gpu_index=p.gpu_index,
                model=p.model,
                pipeline=p.pipeline,
                partition=p.partition,
                first_block=pp.first_block,
                last_block=pp.last_block,
                gpu=pp.gpu,
                vgpu=pp.vgpu,
                profile=profile_ref(prof),
                batch=mp.pipelines[p.pipeline].batch,
            )
        )
    for mp in plan.models:
        for i, pl in enumerate(mp.pipelines):
            for j, part in enumerate(pl.partitions):
                n = len(plan.placements_of(mp.name, i, j))
                if n != part.count:
                    raise UserError(
                        f"model '{mp.name}' pipeline {i} partition {j} plans {part.count} vGPU(s), the placement has {n}",
                        fix="re-run `ppipe plan`",
                        file=file,
                    )
    return specs


def node_resources_for(spec: WorkerSpec, cluster: ClusterSpec, offered: set[str], cluster_file: str | None = None) -> dict[str, float]:
    """The custom resources that pin ``spec``'s worker to its server's Ray node.

    Args:
        offered: the custom resource names some alive Ray node offers.
    """
    group = next(g for name, g in cluster.server_names() if name == spec.server)
    if group.ray_resource is None:
        return {}
    index = spec.server.rsplit("-", 1)[-1]
    specific = f"{group.ray_resource}-{index}"
    if specific in offered:
        return {specific: RESOURCE_SHARE}
    if group.ray_resource in offered:
        return {group.ray_resource: RESOURCE_SHARE}
    k = cluster.servers.index(group)
    raise UserError(
        f"no Ray node offers resource '{group.ray_resource}' (or '{specific}') for server {spec.server}",
        fix=f"start that server's Ray node with --resources='{{\"{group.ray_resource}\": 1}}', "
        f"or fix servers[{k}].ray_resource",
        file=cluster_file,
    )


def worker_env(spec: WorkerSpec, backend: str) -> dict[str, str]:
    """Environment of a worker process: its GPU and, for vGPU levels > 1, its MPS share."""
    if spec.gpu == "cpu" or backend == "emulated":
        return {}
    env = {"CUDA_VISIBLE_DEVICES": str(spec.gpu_index)}
    if spec.vgpu > 1:
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(100 // spec.vgpu)
    return env


def offered_resources() -> set[str]:
    import ray

    names: set[str] = set()
    for node in ray.nodes():
        if node.get("Alive"):
            names.update(node.get("Resources", {}))
    return names


def start_workers(
    dep: Deployment, backend: str = "ort", backend_options: dict[str, Any] | None = None, start_timeout_s: float = 300.0,
    only: set[str] | None = None, incarnation: int = 0,
) -> dict[str, RayWorkerHandle]:
    """Start one actor per vGPU (of ``only``, if given) on its server's node; returns
    {vgpu_id: :class:`~ppipe.runtime.launch.ray_workers.RayWorkerHandle`}.

    Ray must be initialised. Waits until every worker has built its backend (a backend
    error, e.g. a missing sub-model, is raised here, not at the first request); on an
    error, the workers started are stopped. The actors are named :func:`actor_name`
    ``(vgpu_id, incarnation)``, or a later incarnation where Ray still holds that name (a
    plan switch starts a vGPU's new worker while the old one finishes its batches).
    """
    import ray

    specs = [s for s in worker_specs(dep) if only is None or s.vgpu_id in only]
    offered = offered_resources()
    actors = {s.vgpu_id: _create_worker(dep, s, backend, backend_options, offered, incarnation) for s in specs}
    pings = [a.ping.remote() for a in actors.values()]
    try:
        ray.get(pings, timeout=start_timeout_s)
    except ray.exceptions.RayActorError as exc:
        cause = getattr(exc, "cause", None) or exc
        for a in actors.values():
            ray.kill(a)
        settle(pings)  # the other workers' pings fail with the kill: not errors to report
        _reraise_user_error(cause)
        raise
    except ray.exceptions.GetTimeoutError:
        for a in actors.values():
            ray.kill(a)
        raise UserError(f"{len(actors)} worker(s) did not load their blocks within {start_timeout_s:.0f} s",
                        fix="check that the nodes named by the cluster's ray_resource are up (ray status)") from None
    return {v: RayWorkerHandle(v, a) for v, a in actors.items()}


def _create_worker(dep: Deployment, spec: WorkerSpec, backend: str, backend_options: dict[str, Any] | None, offered: set[str],
                   incarnation: int = 0) -> Any:
    """Create the actor of one vGPU on its server's node (not waiting for it), named
    :func:`actor_name` ``(spec.vgpu_id, incarnation)``."""
    resources = node_resources_for(spec, dep.cluster, offered, dep.cluster_file)
    _note_incarnation(spec.vgpu_id, incarnation)
    opts: dict[str, Any] = {
        "name": actor_name(spec.vgpu_id, incarnation),
        "num_cpus": 0,
        "num_gpus": 0,
        "resources": resources,
        "max_concurrency": 1000,
        "max_restarts": 0,  # a dead vGPU is marked failed and re-created by the runtime (respawn_worker)
    }
    env = worker_env(spec, backend)
    if env:
        opts["runtime_env"] = {"env_vars": env}
    for _ in range(NAME_TRIES):
        try:
            return actor_class().options(**opts).remote(spec, backend, backend_options)
        except ValueError as exc:  # the name is still held: a killed actor Ray has not released yet
            if "already taken" not in str(exc):
                raise
            opts["name"] = actor_name(spec.vgpu_id, next_incarnation(spec.vgpu_id))
    return actor_class().options(**opts).remote(spec, backend, backend_options)


def respawn_worker(dep: Deployment, vgpu_id: str, backend: str = "ort", backend_options: dict[str, Any] | None = None,
                   start_timeout_s: float = 60.0, incarnation: int | None = None) -> RayWorkerHandle:
    """Create vGPU ``vgpu_id``'s worker anew and wait until it has loaded its blocks;
    returns its :class:`~ppipe.runtime.launch.ray_workers.RayWorkerHandle`. Blocks (run it
    in a thread from a loop).

    Args:
        incarnation: the new actor's number (its name: :func:`actor_name`); None takes
            :func:`next_incarnation`, one more than the last this process created.

    Raises:
        RuntimeError: its server's node is not back (no node offers its resource), or the
            worker did not start within ``start_timeout_s`` (the pending actor is killed).
    """
    import ray

    spec = next(s for s in worker_specs(dep) if s.vgpu_id == vgpu_id)
    try:
        offered = offered_resources()
        try:
            node_resources_for(spec, dep.cluster, offered, dep.cluster_file)  # before a name is taken
        except UserError:
            note_server(spec.server, offered=False)
            raise
        note_server(spec.server, offered=True)
        actor = _create_worker(dep, spec, backend, backend_options, offered,
                               next_incarnation(vgpu_id) if incarnation is None else incarnation)
    except UserError as exc:
        raise RuntimeError(str(exc)) from None
    except ValueError as exc:  # the name is still held (an incarnation number used twice)
        raise RuntimeError(f"worker {vgpu_id} could not be created: {str(exc).splitlines()[0]}") from None
    ping = actor.ping.remote()
    try:
        ray.get(ping, timeout=start_timeout_s)
    except Exception as exc:
        ray.kill(actor)
        settle([ping], timeout_s=5.0)
        raise RuntimeError(f"worker {vgpu_id} did not start: {type(exc).__name__}") from None
    return RayWorkerHandle(vgpu_id, actor)


_servers_gone: set[str] = set()  # servers whose Ray node a re-creation found missing
_servers_lock = threading.Lock()


def note_server(server: str, offered: bool) -> bool:
    """Log once when a re-creation finds no Ray node for ``server`` (its node left the
    cluster) and once when one is there again (the node is back), however many of its vGPUs
    are re-created and however often; returns whether this call logged."""
    with _servers_lock:
        if not offered and server not in _servers_gone:
            _servers_gone.add(server)
            log.warning("server %s: no Ray node offers its resource now (its node left the cluster); "
                        "waiting for it to join again", server)
            return True
        if offered and server in _servers_gone:
            _servers_gone.discard(server)
            log.warning("server %s: its Ray node is back; re-creating its workers", server)
            return True
    return False


def _reraise_user_error(cause: BaseException) -> None:
    """A UserError raised in a worker's constructor reaches the user as itself."""
    text = str(cause)
    if isinstance(cause, UserError):
        raise cause
    for line in text.splitlines():
        if "NotAvailableError" in line or "UserError" in line:
            raise UserError(f"a worker failed to start: {text.strip().splitlines()[-1]}")


def connect_edges(
    workers: dict[str, Any], edges: list[tuple[str, str]], link_factory: Any = None, unique_ids: list[Any] | None = None,
    timeout_s: float = 300.0, gen: int = 0,
) -> None:
    """Open the two-rank communicator of every edge, of generation ``gen``: both ends join at once.

    Args:
        workers: {vGPU id: :class:`~ppipe.runtime.launch.ray_workers.RayWorkerHandle` or actor}.
        edges: (sender, receiver) pairs to connect.
        link_factory: ``f(unique_id, rank) -> Link`` run in the workers; None means NCCL
            (:func:`ppipe.runtime.workers.transport.nccl_link`). Tests inject a fake here.
        unique_ids: one per edge; by default each sender makes its edge's NCCL unique id.
        gen: 0 at start-up; a plan switch opens its new edges as a generation of its own
            (:func:`ppipe.runtime.workers.transport.relink`).
    """
    import ray

    if not edges:
        return
    actors = {v: actor_of(workers[v]) for e in edges for v in e}
    if unique_ids is None:
        unique_ids = ray.get([actors[a].nccl_unique_id.remote() for a, _ in edges], timeout=timeout_s)
    calls = []
    for (a, b), uid in zip(edges, unique_ids):
        calls.append(actors[a].connect.remote(b, uid, 0, link_factory, gen))
        calls.append(actors[b].connect.remote(a, uid, 1, link_factory, gen))
    ray.get(calls, timeout=timeout_s)


@dataclass(frozen=True)
class LinkOpener:
    """How a server's feature maps travel (``ppipe serve --transport``), at start-up and at
    every plan switch: :meth:`choose` picks each edge's transport from what its two workers
    report, :meth:`open` opens the NCCL edges' communicators.

    Attributes:
        requested: ``auto``, ``tcp`` or ``nccl`` (:func:`ppipe.runtime.workers.transport.choose_edge`).
        timeout_s: for the workers' answers and the communicators' set-up.
        link_factory, unique_id: tests only: ``link_factory(unique_id, rank)`` replaces NCCL
            in the workers and ``unique_id()`` makes each edge's id here (a fake link's).
    """

    requested: str = "auto"
    timeout_s: float = 300.0
    link_factory: Any = None
    unique_id: Callable[[], Any] | None = None

    def choose(self, plan: Plan, cluster: ClusterSpec, profiles: dict[str, ModelProfile],
               workers: dict[str, Any]) -> dict[tuple[str, str], tuple[str, str]]:
        """``{(sender, receiver): (transport, reason)}`` for every edge of ``plan``.

        Raises:
            UserError: ``requested == "nccl"`` and some worker of a multi-stage pipeline cannot use it.
        """
        import ray

        from ppipe.runtime.workers.transport import Capability, pipeline_edges, select_transports

        specs = worker_specs(Deployment(plan, cluster, profiles))
        involved = sorted({v for e in pipeline_edges(specs) for v in e})
        caps_raw = ray.get([actor_of(workers[v]).transport_caps.remote() for v in involved], timeout=self.timeout_s) if involved else []
        return select_transports(self.requested, specs, {v: Capability(**c) for v, c in zip(involved, caps_raw)})

    def open(self, workers: dict[str, Any], edges: list[tuple[str, str]], gen: int = 0,
             kinds: dict[tuple[str, str], str] | None = None) -> None:
        """Open the links of ``edges`` (generation ``gen``): an NCCL communicator, or a staging
        ring where ``kinds`` names ``ring-cuda``/``ring-host`` (its address made by the sender).

        Raises:
            UserError: a pair could not open its link (named with the underlying message).
        """
        import ray

        from ppipe.runtime.workers.ring_link import ring_link
        from ppipe.runtime.workers.transport import NCCL, RING_CUDA

        kinds = kinds or {}
        nccl = [e for e in edges if kinds.get(e, NCCL) == NCCL]
        rings = [e for e in edges if kinds.get(e, NCCL) != NCCL]
        try:
            uids = None if self.unique_id is None else [self.unique_id() for _ in nccl]
            connect_edges(workers, nccl, self.link_factory, uids, timeout_s=self.timeout_s, gen=gen)
            if rings:
                addresses = ray.get([actor_of(workers[a]).ring_address.remote("cuda" if kinds[(a, b)] == RING_CUDA else "host")
                                     for a, b in rings], timeout=self.timeout_s)
                connect_edges(workers, rings, ring_link, addresses, timeout_s=self.timeout_s, gen=gen)
        except (ray.exceptions.RayError, TimeoutError) as exc:
            first = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            what = "NCCL communicators" if not rings else "links"
            raise UserError(
                f"opening the {what} of {len(edges)} worker pair(s) failed: {first}",
                fix="check that NCCL can reach between the GPU servers (run with NCCL_DEBUG=INFO), "
                "or serve with --transport tcp",
            ) from None


def setup_transport(
    dep: Deployment, workers: dict[str, Any], requested: str = "auto", timeout_s: float = 300.0
) -> dict[tuple[str, str], tuple[str, str]]:
    """Choose each edge's transport from what the workers report, and open the NCCL and ring
    edges (:class:`LinkOpener` at start-up).

    Returns ``{(sender, receiver): (transport, reason)}`` for :class:`~ppipe.runtime.scheduler.host.Runtime`.

    Raises:
        UserError: ``requested == "nccl"`` and some worker of a multi-stage pipeline cannot
            use it, or a communicator could not open.
    """
    from ppipe.runtime.workers.transport import LINKED

    links = LinkOpener(requested, timeout_s)
    choice = links.choose(dep.plan, dep.cluster, dep.profiles, workers)
    linked = {e: t for e, (t, _) in choice.items() if t in LINKED}
    links.open(workers, sorted(linked), kinds=linked)
    return choice
