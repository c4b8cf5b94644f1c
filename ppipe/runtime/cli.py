"""``ppipe serve`` and ``ppipe bench``."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import ipaddress
import json
import os
import socket
import time

import click

from ppipe.dataplane.margins import DEFAULT_ANSWER_BUDGET_US, DEFAULT_DISPATCH_LEAD_US, DEFAULT_WAKE_LEAD_US
from ppipe.dataplane.feedback import DEFAULT_REPORT_TOLERANCE_US
from ppipe.errors import UserError
from ppipe.runtime.launch import serving


# Defaults of `ppipe serve` (also used by scripts/bench_serve.py, so that a rehearsal runs
# the runtime as users do). The dispatch lead covers the dispatch message's delivery and the
# first worker's wake-up on a busy host (p99 2.5-3 ms here); see ppipe.runtime.clock.
DEFAULT_WAKE_LEAD_MS = DEFAULT_WAKE_LEAD_US / 1e3
DEFAULT_DISPATCH_LEAD_MS = DEFAULT_DISPATCH_LEAD_US / 1e3
DEFAULT_ANSWER_BUDGET_MS = DEFAULT_ANSWER_BUDGET_US / 1e3
DEFAULT_REPORT_TOLERANCE_MS = DEFAULT_REPORT_TOLERANCE_US / 1e3
# Slow clients: the same values as the defaults of ppipe.runtime.ingress.http_transport (header,
# shutdown) and ppipe.runtime.ingress.http_server (body) (a test checks), written out here so that
# the CLI does not import the server (and the scheduler's host) to show its help.
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_SHUTDOWN_TIMEOUT_S = 10.0


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def init_ray(ray_address: str | None, num_cpus: int | None, loopback_only: bool) -> None:
    """Join the Ray cluster at ``ray_address``, or start a local Ray instance.

    With ``loopback_only`` (``ppipe serve --host`` is a loopback address), the local
    instance's GCS, raylet and workers listen on 127.0.0.1 only: a server that is not
    exposed must not expose its Ray instance either. ``ray.init(_node_ip_address=
    "127.0.0.1")`` does not do it (Ray replaces a loopback address with the host's
    reachable IP); Ray's single-host mode, the one it uses on macOS and Windows, does.
    A joined cluster (``ray_address``) keeps its own addresses.

    The local instance starts its workers at niceness 0 (``RAY_worker_niceness``, unless
    the environment sets it): Ray's default of 15 lets every other process on the machine
    (the frontend, a load generator, a batch job) run before a vGPU worker whose stage is
    reserved to start now, and a worker can lower its niceness itself only with root or
    ``RLIMIT_NICE`` (``ppipe.runtime.workers.worker.undo_ray_niceness``). A joined cluster's
    workers have the niceness of its ``ray start`` (the README says how to set it there).
    Ray is the extra ``ppipe[ray]``: without it, a clear refusal.
    """
    try:
        import ray
    except ImportError:
        raise UserError("Ray is not installed: serving with Ray (--launcher ray, --ray-address, a cluster with ray_resource) "
                        "needs the extra ppipe[ray]",
                        fix="pip install 'ppipe[ray]', or serve on this machine without Ray (--launcher local)") from None

    if ray_address:
        ray.init(address=ray_address, include_dashboard=False)
        return
    if loopback_only:
        from ray._private import ray_constants

        if not hasattr(ray_constants, "ENABLE_RAY_CLUSTER"):
            raise UserError(
                f"this Ray ({ray.__version__}) has no single-host mode to keep it on loopback",
                fix="install the Ray version of setup.cfg, or pass --ray-address of a Ray you started with --node-ip-address",
            )
        ray_constants.ENABLE_RAY_CLUSTER = False  # read when ray.init picks the node's IP: 127.0.0.1
    os.environ.setdefault("RAY_worker_niceness", "0")  # the raylet it starts reads it
    # address="local": a new instance even when another Ray runs on this machine (without it,
    # ray.init joins that one, and ignores or refuses --num-cpus)
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False)


class _NullClock:
    """A clock for building a throw-away scheduler (validation only; never waits)."""

    def now_us(self) -> float:
        return 0.0

    def call_at(self, t_us, fn):  # pragma: no cover - never called while validating
        raise RuntimeError("validation clock cannot wait")


@click.command("serve")
@click.argument("plan_file", type=click.Path(dir_okay=False))
@click.option("--cluster", default=None, help="Cluster YAML or built-in name; overrides the plan's 'cluster_file'/'cluster'.")
@click.option("--launcher", type=click.Choice(["auto", "local", "ray"]), default="auto", show_default=True,
              help="What runs the workers and the frontend shards: local processes of this machine (no Ray), or Ray actors "
              "(several machines). auto: Ray when --ray-address is given or the cluster names Ray nodes (ray_resource); "
              "local otherwise.")
@click.option("--ray-address", default=None, help="Ray cluster to join ('auto' or HOST:PORT); default (--launcher ray): start a local Ray instance.")
@click.option(
    "--backend",
    type=click.Choice(["auto", "ort", "tensorrt", "torch", "emulated"]),
    default="auto",
    show_default=True,
    help="How workers run partitions: onnxruntime, TensorRT, PyTorch (pip install ppipe[torch]), or emulated (sleep for the "
    "profiled latency). auto: onnxruntime for CPU pools; for GPU pools the best GPU backend installed (TensorRT, PyTorch "
    "on CUDA, onnxruntime's CUDA provider), and a refusal naming the extra to install when there is none.",
)
@click.option(
    "--transport",
    type=click.Choice(["auto", "tcp", "nccl", "ring"]),
    default="auto",
    show_default=True,
    help="How feature maps go between workers: NCCL between GPU workers when both can (auto), always the data path's TCP connections, "
    "NCCL required (an error if some worker cannot), or auto plus a staging ring in the GPU's memory between two shares of one GPU, "
    "which NCCL cannot connect (experimental: the ring has not yet run on a GPU).",
)
@click.option("--policy", default="reservation", show_default=True, help="Data-plane policy (reservation | reactive).")
@click.option("--max-queue", type=int, default=None, help="Admission control: bound on queued requests per model (data-plane option max_queue).")
@click.option("--wake-lead-ms", default=DEFAULT_WAKE_LEAD_MS, show_default=True, type=float,
              help="Wake a waiting batch this long before its last feasible moment, so a late wall-clock timer does not turn it into a deadline drop (data-plane option wake_lead_us).")
@click.option("--dispatch-lead-ms", default=DEFAULT_DISPATCH_LEAD_MS, show_default=True, type=float,
              help="Plan every decision this far (plus the input's transfer to the first pool) ahead of now: the time a "
              "dispatch takes to reach its first worker, so reserved stages do not all start late. `ppipe simulate` "
              "applies the same lead (data-plane option dispatch_lead_us; no YAML field).")
@click.option("--answer-budget-ms", default=DEFAULT_ANSWER_BUDGET_MS, show_default=True, type=float,
              help="The scheduler must end every batch this long before the SLO: the time its answer still needs to reach "
              "the client (last report to the frontend, HTTP reply). It grows by the 95th percentile of how late the last "
              "batches' answers came after their planned end, never so far that a model can no longer be served. Lateness "
              "is still judged at arrival + SLO. A plan whose slack cannot hold the lead and this budget is refused, with "
              "the margin it needs. `ppipe simulate` applies the same budget (data-plane option answer_budget_us; no YAML field).")
@click.option("--report-tolerance-ms", default=DEFAULT_REPORT_TOLERANCE_MS, show_default=True, type=float,
              help="A stage that starts and ends within this of its reservation sends no report of its own; its report "
              "rides on with the batch's next one (fewer messages per batch), and the reservation policy is not fed it: "
              "`ppipe simulate --report-tolerance-ms` runs the same rule. -1: every stage reports at once, and every "
              "report is fed (no YAML field).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind; use 0.0.0.0 to expose (with --token). On a loopback address the local Ray instance "
              "listens on loopback only, too.")
@click.option("--port", default=8000, show_default=True, type=int, help="Port to bind.")
@click.option("--grpc-port", default=None, type=int,
              help="Also serve the KServe v2 gRPC API (tritonclient.grpc, KServe clients) on this port of --host, with the "
              "same token and size limit; Triton's is 8001. Default: off (no YAML field).")
@click.option("--token", default=None, envvar="PPIPE_TOKEN",
              help="Bearer token (Authorization: Bearer TOKEN) required on every HTTP endpoint except GET /v2/health/live and "
              "/v2/health/ready: infer, /v2, /v2/models/NAME, /v2/models/NAME/ready and /metrics (env PPIPE_TOKEN).")
@click.option("--max-body-mb", default=64.0, show_default=True, type=float, help="Largest request body accepted (413 above).")
@click.option("--header-timeout-s", default=DEFAULT_HEADER_TIMEOUT_S, show_default=True, type=float,
              help="A connection must send its request line and headers within this (from connecting, or from its previous "
              "answer); else 408 and closed (slow or idle clients; no YAML field).")
@click.option("--body-timeout-s", default=DEFAULT_BODY_TIMEOUT_S, show_default=True, type=float,
              help="An infer request's body must arrive within this after its headers; else 408 and closed (no YAML field).")
@click.option("--shutdown-timeout-s", default=DEFAULT_SHUTDOWN_TIMEOUT_S, show_default=True, type=float,
              help="On SIGTERM/Ctrl-C, requests in flight get this long to be answered; then they are cut and the server "
              "stops (no YAML field).")
@click.option("--decode-workers", default=None, type=click.IntRange(min=0),
              help="Processes that decode large JSON infer bodies off the event loop (0: decode on the loop). "
              "Default: a quarter of the CPUs, 1 to 4 (no YAML field).")
@click.option("--shards", "shards", default="auto", show_default=True,
              help="Frontend processes on the port, each scheduling its own part of the plan (--shard-by): a count, or auto "
              "(as many as the plan's planned rate needs, at most the cores but one). With --ingress N, scheduler processes "
              "behind the ingresses (auto: sized by a scheduler's cost per request, on the cores the ingresses leave). No YAML field.")
@click.option("--shard-by", "shard_by", type=click.Choice(["models", "servers"]), default="models", show_default=True,
              help="What each shard gets: whole models (groups of models that share no NIC), or a group of the plan's servers "
              "and every model's vGPUs there, so that one model's requests are spread over several shards by their "
              "capacity for it (a split that loses capacity or loads one shard more is refused; no live plan switches).")
@click.option("--ingress", "ingress", default=0, show_default=True, type=click.IntRange(min=0),
              help="N > 0: N ingress processes on --port (and --grpc-port) hold the clients' connections and tensors (read, "
              "authenticate, validate, decode, answer), and this process only schedules: it sees each request's metadata, "
              "and the tensors go from an ingress to the first worker and from the last worker back. Under Ray, N on every "
              "alive node (a Ray actor per node starts them). With "
              "--shards K, K scheduler processes (each its models, or its servers with --shard-by servers), and the ingresses send "
              "each request to its model's. Plan switches (ppipe apply on the port, SIGHUP, --replan auto) are made by the "
              "schedulers. 0: this process does it all.")
@click.option("--replan", type=click.Choice(["off", "auto"]), default="off", show_default=True,
              help="auto: watch each model's arrival rate, re-plan when the mix shifts (a model past 90 % of its capacity and a "
              "new plan >= 10 % better) and switch plans live (ppipe.control.replan; needs a max-min plan).")
@click.option("--replan-time-limit-s", type=float, default=1.5, show_default=True, help="Planner time limit of each re-plan (--replan auto).")
@click.option("--replan-min-interval-s", type=float, default=60.0, show_default=True, help="Least time between two plan switches (--replan auto).")
@click.option("--replan-window-s", type=float, default=60.0, show_default=True, help="Window of the arrival-rate estimate (--replan auto).")
@click.option("--replan-curvature-window-s", type=float, default=120.0, show_default=True,
              help="Window of the arrival rate's curvature, longer than --replan-window-s: a curvature is noisy over few bins (--replan auto).")
@click.option("--num-cpus", default=None, type=int, help="CPUs of the local Ray instance (when no --ray-address).")
@click.option("--warm-up/--no-warm-up", default=True, show_default=True,
              help="Before the server is ready, send every model requests of zeros until each vGPU has run a batch "
              "(a vGPU's first batches are slower); none of them shows in /metrics or moves the answer budgets.")
@click.option("--emulated-max-bytes", default=None, type=int,
              help="Emulated backend: cap the bytes per sample of emitted feature maps (transfers still take the planned NIC time).")
def serve(plan_file, cluster, launcher, ray_address, backend, transport, policy, max_queue, wake_lead_ms, dispatch_lead_ms, answer_budget_ms, report_tolerance_ms, host, port, grpc_port, token, max_body_mb,
          header_timeout_s, body_timeout_s, shutdown_timeout_s, decode_workers, shards, shard_by, ingress, replan, replan_time_limit_s,
          replan_min_interval_s, replan_window_s, replan_curvature_window_s, num_cpus, warm_up, emulated_max_bytes):
    """Serve PLAN_FILE behind an Open Inference Protocol (KServe v2) HTTP API.

    The workers and the frontend shards (--shards) run as local processes (--launcher
    local) or as Ray actors (--launcher ray). Without --ray-address, the local Ray instance it starts listens on loopback only
    when --host is a loopback address (the default), on all interfaces otherwise.
    """
    import uvicorn

    t0 = time.perf_counter()

    from ppipe.runtime.ingress.http_transport import uvicorn_config
    from ppipe.runtime.launch.deploy import load_deployment
    from ppipe.runtime.control.shard_plan import parse_shards, shard_layout
    from ppipe.runtime.launch.shards import build_shard, reuseport_socket

    _check_serve_flags(transport, backend, dispatch_lead_ms, answer_budget_ms,
                       {"--header-timeout-s": header_timeout_s, "--body-timeout-s": body_timeout_s, "--shutdown-timeout-s": shutdown_timeout_s})
    dep = load_deployment(plan_file, cluster)
    backend = _backend_for(backend, dep.plan)
    options = _scheduler_options(max_queue, wake_lead_ms)
    _check_plan_serves(dep, policy, options, dispatch_lead_ms, answer_budget_ms)
    n_shards = parse_shards(shards, dep.plan, os.cpu_count() or 1, by=shard_by, ingress=ingress)
    launcher, n_shards = _choose_launcher(launcher, ray_address, dep.cluster, shards, n_shards, transport)
    layout = shard_layout(dep.plan, n_shards, shard_by)  # a split the plan does not take well is refused here
    if layout.by == "servers" and replan == "auto":
        raise UserError("--replan auto cannot run with --shard-by servers: a server whose shards split the plan's servers "
                        "does not switch plans live", fix="use --shard-by models with --replan auto, or leave --replan off")
    replan_policy = _replan_policy(dep, replan_time_limit_s, replan_min_interval_s, replan_window_s,
                                   replan_curvature_window_s) if replan == "auto" else None
    if grpc_port is not None:
        _check_grpc_port(host, port, grpc_port)
    if not _is_loopback(host) and not token:
        click.echo(f"warning: serving on {host} without --token: anyone who reaches this port can use it", err=True)
    if emulated_max_bytes is not None and backend != "emulated":
        raise UserError("--emulated-max-bytes applies to --backend emulated only")
    if launcher == "ray":
        init_ray(ray_address, num_cpus, loopback_only=_is_loopback(host))
    opts = {} if emulated_max_bytes is None else {"max_bytes_per_sample": emulated_max_bytes}
    settings = serving.serve_settings(policy, options, dispatch_lead_ms, answer_budget_ms, report_tolerance_ms, transport, token, max_body_mb,
                               body_timeout_s, decode_workers, header_timeout_s, shutdown_timeout_s, backend, opts, host, grpc_port,
                               launcher, warm_up)
    settings, ingress_settings = serving.split_for_ingresses(settings, ingress, decode_workers)
    parts = layout.parts
    owner = layout.routes if layout.by == "servers" else layout.owner()
    deps = [dep if p is dep.plan else dataclasses.replace(dep, plan=p) for p in layout.plans]  # each shard's plan holds its part
    if len(parts) > 1:
        click.echo(f"{len(parts)} shards by {layout.by}:\n  " + "\n  ".join(layout.describe()), err=True)
    # with ingresses the port is theirs, and the scheduler's own API listens where they reach it
    sock = reuseport_socket(host, port) if not ingress else socket.create_server((serving.admin_host(ingress, launcher), 0))
    admin_url = "http://%s:%d" % sock.getsockname()[:2]
    shard_set = serving.ShardSet(launcher, deps, parts, settings, owner, host, port)  # the other shards start while shard 0's workers load
    try:
        workers, edges = serving.start_workers_and_links(dep, backend, opts, transport, launcher, only=shard_set.first_vgpus())
    except BaseException:
        shard_set.kill()
        raise
    switchers: list = []  # the server's plan switcher (the workers it starts are stopped at shutdown too)
    shutdown = functools.partial(serving.kill_all, shard_set, workers, switchers, shutdown_timeout_s)
    shard_set.start(workers, edges, shutdown)
    companions = functools.partial(serving.companions, dep=dep, layout=layout, shards=shard_set,
                                   switchers=switchers, worker_options=settings.workers,
                                   plan_file=plan_file, replan_policy=replan_policy, replan_time_limit_s=replan_time_limit_s,
                                   started_at=t0,
                                   ingresses=serving.ingress_companion(ingress, dep, ingress_settings, host, port, shutdown_timeout_s,
                                                                      admin_url, launcher))
    app, _, router = build_shard(deps[0], parts[0], workers, edges, settings, 0, owner, companions=companions, on_shutdown=shutdown)
    (router.app if hasattr(router, "app") else app).fe.switcher = switchers[0]  # (with ingresses, no router: the shard's own app)
    click.echo(serving.serving_line(dep, plan_file, host, port, grpc_port, workers, edges, backend, policy, transport, parts, layout.by)
               + f"; {launcher} launcher, workers up {time.perf_counter() - t0:.1f} s after start"
               + (f"; {ingress} ingress processes{' on every Ray node' if launcher == 'ray' else ''}, "
                  f"the scheduler's own API on {admin_url}/v2" if ingress else ""))
    uvicorn.Server(uvicorn_config(app, host, port, **settings.server)).run(sockets=[sock])


def _check_serve_flags(transport: str, backend: str, dispatch_lead_ms: float, answer_budget_ms: float, timeouts: dict[str, float]) -> None:
    """Refuse flags that cannot serve, before anything is loaded; ``timeouts``: {flag: seconds}."""
    if transport == "nccl" and backend == "emulated":
        raise UserError("--transport nccl needs GPU workers; emulated workers have no GPU tensors",
                        fix="use --backend tensorrt (or ort with the CUDA execution provider), or --transport auto")
    if dispatch_lead_ms < 0:
        raise UserError(f"--dispatch-lead-ms must be >= 0, got {dispatch_lead_ms}", fix="use 0 (no lead) or a few ms")
    if answer_budget_ms < 0:
        raise UserError(f"--answer-budget-ms must be >= 0, got {answer_budget_ms}", fix="use 0 (none) or a few ms")
    for flag, value in timeouts.items():
        if not value > 0:
            raise UserError(f"{flag} must be > 0, got {value}", fix="use a few seconds; a slow client is cut after it")


def _scheduler_options(max_queue: int | None, wake_lead_ms: float) -> dict:
    """The data-plane options that ``--max-queue`` and ``--wake-lead-ms`` set."""
    options: dict = {} if max_queue is None else {"max_queue": max_queue}
    if wake_lead_ms:
        options["wake_lead_us"] = wake_lead_ms * 1000.0
    return options


def _check_plan_serves(dep, policy: str, options: dict, dispatch_lead_ms: float, answer_budget_ms: float) -> None:
    """Build the scheduler once and the runtime's budgets before starting anything: a bad
    policy, option or a plan that does not fit its profiles is a UserError now, not after
    the workers are up, and so is a plan whose slack cannot hold the runtime's margins
    (it would drop every request)."""
    from ppipe.runtime.scheduler.budgets import ServiceBudgets
    from ppipe.runtime.scheduler.host import check_whole_paths, default_scheduler_factory

    check_whole_paths(default_scheduler_factory(dep.plan, dep.profiles, dep.cluster, _NullClock(), policy=policy, **options), policy)
    ServiceBudgets(dispatch_lead_ms * 1e3, answer_budget_ms * 1e3).for_plan(dep.plan, dep.profiles, dep.cluster)


def _check_grpc_port(host: str, port: int, grpc_port: int) -> None:
    """Refuse a ``--grpc-port`` that is --port, out of range, or taken on ``host``."""
    from ppipe.runtime.ingress.grpc_server import check_port_free

    if grpc_port == port or not 0 < grpc_port < 65536:
        raise UserError(f"--grpc-port {grpc_port} must be a free port other than --port {port}", fix="e.g. --grpc-port 8001")
    why = check_port_free(host, grpc_port)
    if why:
        raise UserError(f"cannot bind the gRPC frontend to {host}:{grpc_port}: {why}", fix="choose another --grpc-port")


def _backend_for(requested: str, plan) -> str:
    """``--backend``, ``auto`` resolved (:mod:`ppipe.runtime.workers.backend_choice`); a GPU plan
    that ort would run on the CPU gets a warning."""
    from ppipe.runtime.workers.backend_choice import choose_backend, pool_types

    backend, warning = choose_backend(requested, pool_types(plan))
    if warning:
        click.echo(warning, err=True)
    return backend


def _choose_launcher(requested: str, ray_address: str | None, cluster, shards_flag: str, n_shards: int,
                     transport: str) -> tuple[str, int]:
    """``--launcher``: (launcher, shard count). ``auto`` is Ray where Ray is asked for (an
    address, a cluster that names Ray nodes) and the local launcher otherwise; either runs
    any number of shards (``shards_flag``, ``n_shards``: ``--shards`` as given and counted).
    Refuses what the local launcher cannot do: NCCL or ring edges, a Ray address, Ray nodes."""
    needs_ray = [why for why, yes in (("--ray-address", ray_address is not None),
                                      ("the cluster's ray_resource", any(g.ray_resource for g in cluster.servers))) if yes]
    launcher = requested if requested != "auto" else ("ray" if needs_ray else "local")
    if launcher == "ray":
        return launcher, n_shards
    if needs_ray:
        raise UserError(f"--launcher local cannot serve with {' and '.join(needs_ray)}: that takes Ray",
                        fix="use --launcher ray (or auto), or leave those out")
    if transport in ("nccl", "ring"):
        raise UserError(f"--transport {transport} needs --launcher ray: the local launcher's edges go over the data path (TCP)",
                        fix="use --transport auto or tcp, or --launcher ray")
    return launcher, n_shards


def _replan_policy(dep, time_limit_s: float, min_interval_s: float, window_s: float, curvature_window_s: float):
    """``--replan auto``'s controller policy, checked before anything starts."""
    from ppipe.control.replan import ReplanPolicy, planner_replan

    if not time_limit_s > 0:
        raise UserError(f"--replan-time-limit-s must be > 0, got {time_limit_s}", fix="e.g. --replan-time-limit-s 1.5")
    replan = planner_replan(dep.plan, dep.profiles, dep.cluster, time_limit_s=time_limit_s)  # a plan it cannot re-make is refused here
    _warm_up_replanner(replan, dep.plan)
    # the new workers' load time, for the controller's look-ahead (what a plan must last)
    return ReplanPolicy(window_s=window_s, curvature_window_s=curvature_window_s, min_interval_s=min_interval_s, load_delay_s=10.0)


def _warm_up_replanner(replan, plan) -> None:
    """Re-plan the served weights once before serving: the planner's first use in a process
    (its lazy imports, HiGHS) is slow and allocates, which would otherwise come out of the
    first re-plan's time limit and show as memory that grows while serving."""
    t0 = time.perf_counter()
    try:
        replan({m.name: m.weight for m in plan.models})
    except UserError as exc:
        click.echo(f"warning: the re-planner's warm-up found no plan ({exc}); re-plans may still find one", err=True)
        return
    click.echo(f"re-planner warmed up in {time.perf_counter() - t0:.1f} s", err=True)


@click.command("bench")
@click.argument("url")
@click.option("--model", required=True, help="Model name on the server.")
@click.option("--rate", "rate_rps", required=True, type=float, help="Mean request rate, req/s.")
@click.option("--duration-s", default=10.0, show_default=True, type=float, help="Length of the arrival window, s.")
@click.option("--arrivals", type=click.Choice(["poisson", "bursty", "trace"]), default="poisson", show_default=True, help="Arrival process.")
@click.option("--trace", type=click.Path(dir_okay=False), default=None, help="Trace file for --arrivals trace (Azure Functions CSV or timestamps).")
@click.option("--cv", default=2.0, show_default=True, type=float, help="Coefficient of variation of gaps for --arrivals bursty.")
@click.option("--binary/--json", default=False, show_default=True, help="Binary tensor extension or JSON tensors.")
@click.option("--slo-ms", type=float, default=None, help="SLO to judge answers by (default: the model's, from its metadata).")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the arrivals and the input.")
@click.option("--token", default=None, envvar="PPIPE_TOKEN", help="Bearer token of the server.")
@click.option("--json-out", type=click.Path(dir_okay=False), default=None, help="Also write the figures as JSON to this file.")
@click.option("--client", type=click.Choice(["raw", "httpx"]), default="raw", show_default=True,
              help="HTTP client: a minimal asyncio HTTP/1.1 client, or httpx (slower under high concurrency).")
@click.option("--input-shape", default=None, help="Per-sample input shape, e.g. 3,224,224, for models whose metadata has none.")
@click.option("--grpc", "grpc_address", default=None, metavar="HOST:PORT",
              help="Send the requests over the KServe v2 gRPC API to HOST:PORT (`ppipe serve --grpc-port`) instead of REST; "
              "--binary sends raw_input_contents, --json typed contents. The model's metadata still comes from URL.")
@click.option("--records-out", type=click.Path(dir_okay=False), default=None,
              help="Also write every request's (send offset s, outcome, latency ms) as a JSON list to this file.")
@click.option("--images", "images_dir", type=click.Path(file_okay=False), default=None,
              help="Send the image files (JPEG, PNG, ...) of this folder in turn, as BYTES inputs, instead of a random tensor "
              "(models whose model.yaml declares a preprocess).")
@click.option("--start-at", "start_at", type=float, default=None, metavar="UNIX_S",
              help="Begin the arrivals at this wall-clock time (seconds since the epoch) rather than at once, the connections "
              "already open: several benches started together then send together, each once it has loaded.")
def bench(url, model, rate_rps, duration_s, arrivals, trace, cv, binary, slo_ms, seed, token, json_out, client, input_shape, grpc_address,
          records_out, images_dir, start_at):
    """Open-loop load against URL (a `ppipe serve`): SLO attainment, goodput, p50/p99, drops."""
    from ppipe.runtime.client.bench import format_table, load_images, run_bench, to_json

    if rate_rps <= 0 or duration_s <= 0:
        raise UserError("--rate and --duration-s must be positive")
    shape = None
    if input_shape:
        try:
            shape = [int(d) for d in input_shape.split(",")]
        except ValueError:
            raise UserError(f"--input-shape '{input_shape}' is not a comma-separated list of integers", fix="e.g. --input-shape 3,224,224") from None
    records: list | None = [] if records_out else None
    res = asyncio.run(
        run_bench(url, model, rate_rps, duration_s, arrivals=arrivals, trace=trace, binary=binary, seed=seed, slo_ms=slo_ms, token=token, cv=cv,
                  client=client, input_shape=shape, grpc=grpc_address, records=records,
                  images=load_images(images_dir) if images_dir else None, start_at=start_at)
    )
    if records_out:
        with open(records_out, "w") as fh:
            json.dump(sorted(records), fh)
    click.echo(format_table(res))
    text = to_json(res)
    click.echo(text)
    if json_out:
        with open(json_out, "w") as fh:
            fh.write(text + "\n")


@click.command("apply")
@click.argument("plan_file", type=click.Path(dir_okay=False))
@click.option("--url", default="http://127.0.0.1:8000", show_default=True, help="The running `ppipe serve`.")
@click.option("--token", default=None, envvar="PPIPE_TOKEN", help="The server's bearer token (env PPIPE_TOKEN); plan switches need one.")
@click.option("--timeout-s", default=600.0, show_default=True, type=float, help="How long to wait for the switch (new workers load their blocks first).")
@click.option("--as-placed", is_flag=True, default=False,
              help="Serve the plan's placement as written. Default: the server renames the plan's GPUs within each server group "
              "(equal GPUs, equal NICs) so that vGPUs the running plan has keep their workers.")
def apply(plan_file, url, token, timeout_s, as_placed):
    """Switch a running `ppipe serve` to PLAN_FILE, live: no request is paused, lost or answered twice.

    The server starts the workers the new plan needs while the old plan serves, then moves
    new requests to the new plan; batches already sent finish on the old one. A plan the
    running cluster cannot take is refused, and the old plan keeps serving. Relative
    profile folders are sent as absolute ones when they exist here.
    """
    import json

    import httpx
    import yaml

    from ppipe.spec.plan import load_plan

    if not token:
        raise UserError("plan switches need the server's token", fix="pass --token (or set PPIPE_TOKEN); the server must run with --token")
    plan = load_plan(plan_file)  # a malformed file is refused here, with its field
    base = os.path.dirname(os.path.abspath(plan_file))
    data = plan.model_dump(mode="json")
    for m in data["models"]:
        local = os.path.join(base, m["profile"])
        if ":" not in m["profile"] and not os.path.isabs(m["profile"]) and os.path.isdir(local):
            m["profile"] = local
    try:
        r = httpx.post(url.rstrip("/") + "/v2/admin/plan" + ("?as_placed=1" if as_placed else ""), content=yaml.safe_dump(data, sort_keys=False),
                       headers={"authorization": f"Bearer {token}", "content-type": "application/yaml"}, timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise UserError(f"cannot reach {url}: {exc}", fix="check --url and that `ppipe serve` runs") from None
    try:
        body = r.json()
    except ValueError:
        body = {"error": r.text[:500]}
    if r.status_code != 200:
        raise UserError(f"{url} refused the plan in {plan_file} (HTTP {r.status_code}): {body.get('error', body)}")
    click.echo(f"{url} now serves {', '.join(body['models'])} from {plan_file}: {body['kept']} vGPUs kept, "
               f"{body['started']} started, {body['retiring']} finishing their batches; {body['moved']} queued requests moved; "
               f"{body['seconds']:.2f} s (loading {body['load_s']:.2f} s, switch {body['switch_us'] / 1e3:.2f} ms)")
    click.echo(json.dumps(body))
