#!/usr/bin/env python
"""Benchmarks of `ppipe serve` on this machine (emulated workers; no GPU needed).

Four figures:

1. **Rehearsal vs simulation.** A PPipe plan for the paper's HC1-S (4 L4 + 12 P4, 16 GPUs)
   of one PPipe-artifact model, served by emulated workers (one process per vGPU, each
   sleeping for the profiled latency; feature maps wait out their planned NIC time), driven
   by `ppipe bench` with Poisson arrivals. Its maximum load factor at 99 % SLO attainment
   next to the simulator's (`ppipe.sim`) for the same plan, the same arrivals (same
   generator and seed) and the same scan (1.0, 0.95, ...; continued above 1.0 while it
   passes). The runtime runs with the defaults of `ppipe serve` (wake lead, dispatch lead,
   answer budget).

   Default: atss_r101_fpn_1x_coco, whose HC1-S plan has 16 vGPUs (4 P4 -> 4 L4 -> 8 P4,
   batch 1, 399 req/s). The workers send the plan's real feature maps (``--maps real``,
   the default: 6.5 and 2.2 MB per atss request), which a small host cannot carry at the
   plan's rate, so the plan is rehearsed k times slower (latencies x k, NIC bandwidths / k,
   so SLO x k and rates / k; the same pipelines, partitions and batches). ``--dilation
   auto`` (the default) picks k from this host's measured data-path rate at the plan's
   largest map (as ``scripts/bench_datapath.py`` measures it): the smallest of 1, 1.5, 2,
   3, 4, ... at which the maps' bytes per second at load 1.0 cost at most
   ``MAP_BYTES_SHARE`` of one core, and prints it. ``--maps capped`` caps the maps at
   4 KiB per sample (each transfer still waits its planned NIC time) for CPU-only figures
   at full speed. Requests carry a 16-float input either way (the artifact's profiles
   have no input spec; emulated workers ignore input values).

   Each runtime point also prints the CPU it cost: the frontend's per request (this
   process: HTTP, decoding, scheduler, data path), the workers' per stage (every worker
   process, all threads; emulated stages compute nothing, so this is the data path's and
   the worker's own cost), how much later than reserved the stages started (p50 and p99,
   from the workers' reports), and the dispatch -> first worker delay. From the frontend's
   cost per request it prints the cores a head node needs for the paper's largest
   per-group rate (HC1-L G2, 4,285 req/s).
2. **Frontend ceiling.** A one-block model with 1 us emulated latency and a 16-float
   input, batch 16 on 2 vGPUs, so that the frontend (HTTP, JSON/binary decoding,
   scheduler, data path) is the bottleneck: the highest offered rate it serves at
   >= 99 % attainment, JSON and binary.
3. **Scale-out.** Two such models at batch 1 behind `ppipe serve --shards N` (started as a
   user starts it), one `ppipe bench` per model: the highest total rate at >= 99 %
   attainment with 1 and with 2 shards.
4. **The HTTP floor.** uvicorn configured as `ppipe serve` configures it, serving a null
   app (metadata, and a fixed answer to every infer) in a process of its own, driven as
   the ceiling is: its CPU per request is what HTTP alone costs on this host, the part of
   the frontend's cost no scheduler or data path can remove.

The load generator runs in its own process (`ppipe bench`), the server (uvicorn, the
scheduler's host) in this one, each worker in its own (``--launcher local``, the default,
as ``ppipe serve`` starts them on one machine; ``--launcher ray``: Ray actors, with Ray's
daemons beside them); all share this machine's cores, so the figures
are a lower bound of what the runtime does on a dedicated host. Traffic goes to 127.0.0.1.
Measured figures, with the host line and the command, are in docs/benchmarks.md.

    python scripts/bench_serve.py                 # both parts
    python scripts/bench_serve.py --part ceiling  # one part
    python scripts/bench_serve.py --part rehearsal                                  # atss, 16 vGPUs, real maps, dilated
    python scripts/bench_serve.py --part rehearsal --maps capped                    # 4 KiB maps, full speed
    python scripts/bench_serve.py --part rehearsal --model rtmdet_x_8xb32-300e_coco
    python scripts/bench_serve.py --part scaleout # 1 vs 2 frontend shards
    python scripts/bench_serve.py --part httpfloor --rates 300,600,1000
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import hostspeed  # noqa: E402  (a script next to this one)
# The paper's largest planned rate of one group (HC1-L, G2), for the head-node sizing line.
HC1_L_G2_RPS = 4285.0
# The ceiling measures throughput: a long SLO keeps the data plane's wait-to-the-last-moment
# (which a late timer turns into a drop, see the report) out of the figure.
CEILING_SLO_MS = 500.0
ARTIFACT = Path(os.environ.get("PPIPE_ARTIFACT", REPO.parent / "shared" / "data" / "ppipe-artifact"))
# the share of one core the rehearsal's feature maps may cost to move at load 1.0 (--dilation auto)
MAP_BYTES_SHARE = 0.25
DILATION_STEPS = (1, 1.5, 2, 3, 4, 5, 6, 8, 10, 12, 15, 20, 25, 30, 40, 50, 60, 80, 100)
CAPPED_MAP_BYTES = 4096


def bench(url: str, model: str, rate: float, duration_s: float, seed: int, binary: bool = False, input_shape: str | None = None,
          worker_pids: list[int] = ()) -> dict:
    """One `ppipe bench` run in a subprocess; returns its JSON figures, with the CPU time
    the frontend (this process), the client and the workers spent in it."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
        out = fh.name
    cmd = [sys.executable, "-m", "ppipe.cli", "bench", url, "--model", model, "--rate", f"{rate:.3f}",
           "--duration-s", str(duration_s), "--seed", str(seed), "--json-out", out, "--binary" if binary else "--json"]
    if input_shape:
        cmd += ["--input-shape", input_shape]
    import resource

    self0, kids0 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    workers0, t0 = sum(process_cpu_s(p) for p in worker_pids), time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    self1, kids1 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    workers1, t1 = sum(process_cpu_s(p) for p in worker_pids), time.perf_counter()
    with open(out) as fh:
        res = json.load(fh)
    # CPU time per request: this process is the frontend (uvicorn + scheduler + data path,
    # and the Ray driver under Ray), the child is the load generator. On a shared machine these say more
    # than req/s do.
    n = max(1, res["sent"])
    res["frontend_cpu_ms_per_request"] = 1e3 * ((self1.ru_utime + self1.ru_stime) - (self0.ru_utime + self0.ru_stime)) / n
    res["client_cpu_ms_per_request"] = 1e3 * ((kids1.ru_utime + kids1.ru_stime) - (kids0.ru_utime + kids0.ru_stime)) / n
    res["workers_cpu_s"] = workers1 - workers0
    res["wall_s"] = t1 - t0
    return res


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and all its threads (Linux /proc); 0 if gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def idle_cpu_rate(pids: list[int], seconds: float = 3.0) -> float:
    """CPU seconds per second that the processes spend with nothing to serve (timers; Ray's own
    threads in each worker under Ray), so that a point's cost per stage can leave it out."""
    c0, t0 = sum(process_cpu_s(p) for p in pids), time.perf_counter()
    time.sleep(seconds)
    return (sum(process_cpu_s(p) for p in pids) - c0) / (time.perf_counter() - t0)


def worker_pids(workers) -> list[int]:
    """The workers' process ids: a local worker's handle holds it, a Ray actor says it."""
    if all(hasattr(h, "pid") for h in workers.values()):
        return [h.pid for h in workers.values()]
    import ray

    return [p["pid"] for p in ray.get([h.actor.ping.remote() for h in workers.values()])]


def serve_in_process(plan, profiles, cluster, backend_options=None, dispatch_lead_ms=None, keep_traces=0, answer_budget_ms=None,
                     report_tolerance_ms=None, launcher: str = "ray"):
    """Start emulated workers with ``launcher`` (``local``: processes of this machine, as
    ``ppipe serve`` runs them by default on one; ``ray``: Ray actors, Ray initialised) and
    the frontend (uvicorn thread) with `ppipe serve`'s defaults (an authenticated data path
    and the warm-up included); returns (server, workers, runtime)."""
    from ppipe.runtime.cli import DEFAULT_ANSWER_BUDGET_MS, DEFAULT_DISPATCH_LEAD_MS, DEFAULT_REPORT_TOLERANCE_MS, DEFAULT_WAKE_LEAD_MS
    from ppipe.runtime.launch.deploy import Deployment
    from ppipe.runtime.launch.launchers import start_function
    from ppipe.runtime.scheduler.host import Runtime
    from ppipe.runtime.ingress.http_server import create_app
    from ppipe.runtime.ingress.http_transport import BackgroundServer

    dep = Deployment(plan=plan, cluster=cluster, profiles=profiles)
    workers = start_function(launcher)(dep, backend="emulated", backend_options=backend_options)
    lead = DEFAULT_DISPATCH_LEAD_MS if dispatch_lead_ms is None else dispatch_lead_ms
    budget = DEFAULT_ANSWER_BUDGET_MS if answer_budget_ms is None else answer_budget_ms
    tol = DEFAULT_REPORT_TOLERANCE_MS if report_tolerance_ms is None else report_tolerance_ms
    rt = Runtime(plan, profiles, cluster, workers, scheduler_options={"wake_lead_us": DEFAULT_WAKE_LEAD_MS * 1000.0},
                 dispatch_lead_us=lead * 1000.0, keep_traces=keep_traces, answer_budget_us=budget * 1000.0,
                 report_tolerance_us=None if tol < 0 else tol * 1000.0, data_secret=secrets.token_bytes(32), warm_up=True)
    srv = BackgroundServer(create_app(rt)).__enter__()
    return srv, workers, rt


def stop(srv, workers) -> None:
    srv.__exit__(None, None, None)
    for h in workers.values():
        h.kill()


# ---- part 1: rehearsal vs simulator -------------------------------------------------------------------
def map_bytes_per_request(plan, profile) -> tuple[float, int]:
    """Feature-map bytes one request sends worker to worker (the model's pipelines weighted
    by their planned rates), and the largest single map per sample."""
    mp = plan.models[0]
    total, largest = 0.0, 0
    for pl in mp.pipelines:
        cuts = [profile.cut_bytes(p.last_block) for p in pl.partitions[:-1]]
        total += pl.throughput_rps / mp.throughput_rps * sum(cuts)
        largest = max([largest, *cuts])
    return total, largest


def datapath_gbps(nbytes: int) -> float:
    """This host's data-path rate (GB/s) for one map of ``nbytes`` between two processes, as
    ``scripts/bench_datapath.py`` measures it (median of 5, after one warm-up), the way the
    rehearsal's local workers send it: handed over in shared memory from
    :data:`~ppipe.runtime.wire.handoff.MIN_MAP_BYTES` up (where it is on), else on the socket."""
    from bench_datapath import DatapathPair

    from ppipe.runtime.wire.handoff import MIN_MAP_BYTES, MapHandoff

    try:
        import uvloop  # noqa: F401  (the workers' and the frontend's loop where installed)

        kind = "uvloop"
    except ImportError:
        kind = "asyncio"
    pair = DatapathPair(kind, handoff=nbytes >= MIN_MAP_BYTES and MapHandoff.for_this_process() is not None)
    try:
        x = np.zeros(max(1, nbytes // 2), np.float16)
        pair.time_one(x)
        seconds = float(np.median([pair.time_one(x) for _ in range(5)]))
    finally:
        pair.close()
    return nbytes / seconds / 1e9


def auto_dilation(planned_rps: float, bytes_per_request: float, gbps: float) -> float:
    """The smallest step k at which the maps' bytes at load 1.0, ``planned_rps / k *
    bytes_per_request`` per second, cost at most ``MAP_BYTES_SHARE`` of a core at ``gbps``."""
    need = planned_rps * bytes_per_request / (MAP_BYTES_SHARE * gbps * 1e9)
    return next((float(k) for k in DILATION_STEPS if k >= need), float(np.ceil(need)))


def dilate(profile, cluster, k: float, out_dir: Path):
    """The same plan problem k times slower (:mod:`ppipe.spec.dilation`), the profile saved
    in ``out_dir``. A plan for it has the same pipelines, partitions and batches, and k
    times lower rates."""
    from ppipe.spec.dilation import dilated_cluster, dilated_profile
    from ppipe.spec.profile import load_profile

    dilated_profile(profile, k).save(out_dir)
    return load_profile(out_dir), dilated_cluster(cluster, k)


def lateness(rt, since: int) -> dict[str, float]:
    """How much later than reserved the stages of the batches traced since ``since`` started (ms)."""
    late: dict[int, list[float]] = {}
    call: list[float] = []  # dispatch -> the first stage's message reaching its worker
    for t in rt.traces[since:]:
        for k, (rep, (start, _)) in enumerate(zip(t.reports, t.reserved_us)):
            late.setdefault(k, []).append((rt.clock.from_wall_us(rep.start_us) - start) / 1e3)
        if t.reports and t.reports[0].stage == 0:
            call.append((rt.clock.from_wall_us(t.reports[0].received_us) - t.dispatched_us) / 1e3)
    out = {}
    if call:
        out["call_delay_p50_ms"] = float(np.percentile(call, 50))
        out["call_delay_p99_ms"] = float(np.percentile(call, 99))
    for k, xs in sorted(late.items()):
        out[f"stage{k}_start_late_p50_ms"] = float(np.percentile(xs, 50))
        out[f"stage{k}_start_late_p99_ms"] = float(np.percentile(xs, 99))
    return out


def rehearsal(model: str, duration_s: float, seed: int, tmp: Path, dilation: float | str, dispatch_lead_ms: float | None = None,
              answer_budget_ms: float | None = None, report_tolerance_ms: float | None = None, binary: bool = False,
              loads: list[float] | None = None, maps: str = "real", launcher: str = "local") -> dict:
    from ppipe.planner.api import plan as make_plan
    from ppipe.sim.simulator import SimConfig
    from ppipe.sim.sweep import run_point
    from ppipe.spec.artifact import import_artifact
    from ppipe.spec.cluster import load_cluster
    from ppipe.spec.profile import load_profile

    if not (ARTIFACT / "block-timing").is_dir():
        print(f"rehearsal: skipped, PPipe artifact not found at {ARTIFACT} (set PPIPE_ARTIFACT)")
        return {}
    (d,) = import_artifact(ARTIFACT, tmp / "profiles", [model])
    base_cluster = load_cluster("HC1-S")
    base_plan = make_plan(base_cluster, [str(d)], time_limit_s=60)
    prof, cluster = load_profile(d), base_cluster
    per_request, largest = map_bytes_per_request(base_plan, prof)
    if maps == "capped":
        dilation = 1.0 if dilation == "auto" else dilation
        print(f"   feature maps capped at {CAPPED_MAP_BYTES} B per sample (the plan's: {per_request / 1e6:.1f} MB per request)")
    else:
        gbps = datapath_gbps(largest)
        auto = auto_dilation(base_plan.models[0].throughput_rps, per_request, gbps)
        print(f"   real feature maps: {per_request / 1e6:.1f} MB per request, {base_plan.models[0].throughput_rps * per_request / 1e9:.2f} GB/s "
              f"at the planned rate; this host's data path moves {gbps:.2f} GB/s at {largest / 1e6:.1f} MB; at most "
              f"{MAP_BYTES_SHARE:g} core for the maps needs a dilation of x{auto:g}")
        dilation = auto if dilation == "auto" else float(dilation)
    if dilation != 1:
        prof, cluster = dilate(prof, base_cluster, dilation, tmp / "dilated" / model)
    plan = make_plan(cluster, [str(prof.directory)], time_limit_s=60)
    profiles = {model: prof}
    mp, bp = plan.models[0], base_plan.models[0]
    shape = lambda m: [(pl.batch, [(p.first_block, p.last_block, p.gpu, p.vgpu, p.count) for p in pl.partitions]) for pl in m.pipelines]
    print(f"\n== rehearsal: {model} on HC1-S, {len(base_plan.placement)} vGPUs, planned {bp.throughput_rps:.1f} req/s, SLO {bp.slo_ms:.1f} ms")
    for i, pl in enumerate(bp.pipelines):
        parts = ", ".join(f"blocks {p.first_block}-{p.last_block} on {p.count}x {p.gpu}/{p.vgpu}" for p in pl.partitions)
        print(f"   pipeline {i}: batch {pl.batch}: {parts}")
    if dilation != 1:
        same = shape(mp) == shape(bp)
        print(f"   time dilation x{dilation:g} (this host cannot carry the real rate, see --dilation): latencies x{dilation:g}, "
              f"NICs /{dilation:g}: planned {mp.throughput_rps:.1f} req/s, SLO {mp.slo_ms:.1f} ms, same pipelines: {same}")

    def scan(attainment, label: str) -> tuple[float | None, dict[str, float]]:
        """The paper's scan (1.0, 0.95, ... down to the first load at >= 99 %), continued
        upwards past 1.0 (1.05, 1.10, ... up to 1.5) while it still passes, so that a
        system that carries more than the plan is told apart from one that just makes it; then
        refined at steps of 0.01 (:func:`refine`)."""
        seen: dict[str, float] = {}
        load, best = 1.0, None
        while 0.04 < load <= 1.5:
            a = attainment(load)
            seen[f"{load:.2f}"] = a
            print(f"   {label} load {load:.2f}: attainment {100 * a:.2f} %")
            if a >= 0.99:
                best = load
                if load < 1.0:
                    break
                load = round(load + 0.05, 2)
            elif best is not None:
                break
            else:
                load = round(load - 0.05, 2)
        return refine(attainment, best, seen, label), seen

    def refine(attainment, best: float | None, seen: dict[str, float], label: str) -> float | None:
        """Between the highest load that held and the next step of 0.05 that did not, the
        highest that holds at steps of 0.01 (a gap of a few points is finer than the
        paper's step)."""
        if best is None or best >= 1.5:
            return best
        for load in [round(best + 0.01 * k, 2) for k in range(1, 5)]:
            if f"{load:.2f}" in seen:
                break
            a = seen[f"{load:.2f}"] = attainment(load)
            print(f"   {label} load {load:.2f}: attainment {100 * a:.2f} %")
            if a < 0.99:
                break
            best = load
        return best

    def sim_attainment(load: float) -> float:
        return run_point(plan, profiles, cluster, load, config=SimConfig(duration_s=duration_s, seed=seed)).models[model].attainment

    t0 = time.perf_counter()
    sim_best, sim_points = scan(sim_attainment, "simulator")
    print(f"   simulator: max load factor at 99 % = {sim_best}  ({time.perf_counter() - t0:.1f} s)")

    # capped maps: 4 KiB per sample; each transfer still waits its planned NIC time either way
    backend_options = {"max_bytes_per_sample": CAPPED_MAP_BYTES} if maps == "capped" else {}
    srv, workers, rt = serve_in_process(plan, profiles, cluster, backend_options, dispatch_lead_ms, keep_traces=10**6,
                                        answer_budget_ms=answer_budget_ms, report_tolerance_ms=report_tolerance_ms, launcher=launcher)
    print(f"   runtime: {launcher} workers, report tolerance {rt.report_tolerance_us} us, requests {'binary' if binary else 'JSON'}")
    pids = worker_pids(workers)
    idle_rate, fe_idle_rate = idle_cpu_rate(pids), idle_cpu_rate([os.getpid()])
    print(f"   runtime idle: the {len(pids)} workers spend {idle_rate:.3f} CPU-s per s with nothing to serve ("
          f"left out of the per-stage figures below); the frontend process {fe_idle_rate:.3f} (timers, and its Ray driver under Ray; "
          f"shown apart below)")
    points: dict[str, dict] = {}

    def rt_attainment(load: float) -> float:
        # artifact profiles carry no input spec; emulated workers ignore input values and
        # the first stage has no transfer, so a 16-float input stands in for the image
        since, messages, stolen = len(rt.traces), rt.report_messages, hostspeed.stolen_s()
        r = bench(srv.url, model, load * mp.throughput_rps, duration_s, seed, binary=binary, input_shape="16", worker_pids=pids)
        r.update(lateness(rt, since))
        stages = sum(len(t.reports) for t in rt.traces[since:])
        r["report_messages_per_stage"] = (rt.report_messages - messages) / max(1, stages)
        r["stolen_cores"] = (hostspeed.stolen_s() - stolen) / r["wall_s"]  # by the hypervisor: a run with many is not comparable
        r["frontend_cpu_ms_per_request_beyond_idle"] = (r["frontend_cpu_ms_per_request"]
                                                        - 1e3 * fe_idle_rate * r["wall_s"] / max(1, r["sent"]))
        r["worker_cpu_ms_per_stage"] = 1e3 * (r["workers_cpu_s"] - idle_rate * r["wall_s"]) / max(1, stages)
        points[f"{load:.2f}"] = r
        late = "  ".join(f"stage {k[5]} starts late p50/p99 {r[k]:.1f}/{r[k.replace('p50', 'p99')]:.1f} ms"
                         for k in r if k.startswith("stage") and k.endswith("p50_ms"))
        held = (f"  held within the SLO at the server {100 * r['server_on_time'] / max(1, r['sent']):.2f} %"
                if r.get("server_on_time") is not None else "")
        print(f"   runtime   load {load:.2f}: attainment {100 * r['slo_attainment']:.2f} %{held}  goodput {r['goodput_rps']:.1f} req/s  p50 {r['p50_ms'] or 0:.1f} ms  "
              f"p99 {r['p99_ms'] or 0:.1f} ms  drops {r['drops']}  client lag p99 {r['client_lag_p99_ms']:.1f} ms  "
              f"CPU: frontend {r['frontend_cpu_ms_per_request']:.2f} ms/request ({r['frontend_cpu_ms_per_request_beyond_idle']:.2f} "
              f"beyond its idle cost), workers {r['worker_cpu_ms_per_stage']:.2f} ms/stage, "
              f"client {r['client_cpu_ms_per_request']:.2f} ms/request  report messages per stage {r['report_messages_per_stage']:.2f}  "
              f"dispatch->worker p50/p99 {r.get('call_delay_p50_ms', 0):.1f}/{r.get('call_delay_p99_ms', 0):.1f} ms  {late}  "
              f"cores stolen by the hypervisor {r['stolen_cores']:.2f}")
        return r["slo_attainment"]

    try:
        if loads:
            best = max((x for x in loads if rt_attainment(x) >= 0.99), default=None)
        else:
            best, _ = scan(rt_attainment, "runtime  ")
    finally:
        stop(srv, workers)
    print(f"   runtime:   max load factor at 99 % = {best}")
    if best is not None and sim_best is not None:
        print(f"   difference: {100 * (best - sim_best):+.0f} points (target: within 3)")
    if points:
        fe = float(np.median([p["frontend_cpu_ms_per_request"] for p in points.values()]))
        fe_beyond = float(np.median([p["frontend_cpu_ms_per_request_beyond_idle"] for p in points.values()]))
        wk = float(np.median([p["worker_cpu_ms_per_stage"] for p in points.values()]))
        print(f"   CPU, median over the points: frontend {fe:.3f} ms per request, {fe_beyond:.3f} beyond its idle cost (target <= 0.25), "
              f"workers {wk:.3f} ms per stage (target <= 0.25 beyond the compute, which emulated stages do not spend)")
        print(f"   a head node at this cost needs {HC1_L_G2_RPS * fe_beyond / 1e3 + fe_idle_rate:.1f} cores for HC1-L G2's "
              f"{HC1_L_G2_RPS:.0f} req/s (the frontend alone: {fe_beyond:.3f} ms per request plus its idle "
              f"{fe_idle_rate:.2f} core; target <= 2)")
    return {"model": model, "vgpus": len(plan.placement), "planned_rps": mp.throughput_rps, "slo_ms": mp.slo_ms, "dilation": dilation,
            "maps": maps, "plan_map_bytes_per_request": per_request,
            "duration_s": duration_s, "sim_max_load": sim_best, "sim_attainment": sim_points,
            "runtime_max_load": best, "runtime_points": points}


# ---- part 2: frontend ceiling ------------------------------------------------------------------------------
def ceiling(duration_s: float, seed: int, tmp: Path, rates: list[float], batch: int = 16, stages: int = 1,
            launcher: str = "local") -> dict:
    from ppipe.spec.cluster import load_cluster

    cluster = load_cluster("local-cpu")
    plan, profiles = null_plan(tmp, cluster, ["null"], batch=batch, vgpus=2 if stages == 1 else 1, stages=stages)
    prof = profiles["null"]
    print(f"\n== frontend ceiling: {stages}-block model, 1 us emulated latency per stage, 16-float input, batch {batch}, "
          f"{len(plan.placement)} vGPUs, SLO {CEILING_SLO_MS:g} ms")
    srv, workers, rt = serve_in_process(plan, {"null": prof}, cluster, launcher=launcher)
    out: dict[str, dict] = {}
    try:
        for binary in (False, True):
            kind = "binary" if binary else "json"
            out[kind] = {}
            best = None
            for rate in rates:
                r = bench(srv.url, "null", rate, duration_s, seed, binary=binary)
                out[kind][str(rate)] = r
                print(f"   {kind:6s} {rate:6.0f} req/s offered: attainment {100 * r['slo_attainment']:.2f} %  goodput {r['goodput_rps']:.0f} req/s  "
                      f"p50 {r['p50_ms'] or 0:.1f} ms  p99 {r['p99_ms'] or 0:.1f} ms  errors {r['errors'] or r['drops'] or 0}  client lag p99 {r['client_lag_p99_ms']:.1f} ms  "
                      f"CPU/request: frontend {r['frontend_cpu_ms_per_request']:.2f} ms, client {r['client_cpu_ms_per_request']:.2f} ms")
                if r["slo_attainment"] < 0.99:
                    break
                best = rate
            out[kind]["ceiling_rps"] = best
            print(f"   {kind}: highest offered rate at >= 99 % attainment: {best} req/s (target >= 1000)")
    finally:
        stop(srv, workers)
    return out


# ---- part 4: the HTTP floor ---------------------------------------------------------------------------------
_NULL_META = json.dumps({"name": "null", "versions": ["1"], "platform": "null", "parameters": {"slo_ms": CEILING_SLO_MS},
                         "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, 16]}],
                         "outputs": [{"name": "output", "datatype": "FP32", "shape": [-1, 4]}]}).encode()
_NULL_ANSWER = json.dumps({"model_name": "null", "outputs": [{"name": "output", "datatype": "FP32", "shape": [1, 4],
                                                               "data": [0.0] * 4}]}).encode()


async def null_app(scope, receive, send) -> None:
    """ASGI: the model metadata on GET, a fixed answer to every POST (the body read in full)."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    more = True
    while more:
        more = (await receive()).get("more_body", False)
    body = _NULL_META if scope["method"] == "GET" else _NULL_ANSWER
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def http_floor(duration_s: float, seed: int, rates: list[float]) -> dict:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    code = ("import sys, uvicorn; sys.path[:0] = [sys.argv[1], sys.argv[2]]; import bench_serve; "
            "from ppipe.runtime.ingress.http_transport import uvicorn_config; "
            "uvicorn.Server(uvicorn_config(bench_serve.null_app, '127.0.0.1', int(sys.argv[3]))).run()")
    proc = subprocess.Popen([sys.executable, "-c", code, str(REPO / "scripts"), str(REPO), str(port)])
    url = f"http://127.0.0.1:{port}"
    print("\n== HTTP floor: uvicorn as `ppipe serve` runs it, a null app, its own process; JSON requests of 16 floats")
    out = {}
    try:
        for _ in range(100):
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        for rate in rates:
            c0 = process_cpu_s(proc.pid)
            r = bench(url, "null", rate, duration_s, seed)
            per_request = 1e3 * (process_cpu_s(proc.pid) - c0) / max(1, r["sent"])
            out[str(rate)] = {"server_cpu_ms_per_request": per_request, "answered": r["ok"], "sent": r["sent"]}
            print(f"   {rate:6.0f} req/s offered: {r['ok']} of {r['sent']} answered; server CPU {per_request:.3f} ms per request")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return out


# ---- part 3: scale-out over frontend shards ------------------------------------------------------------------
def null_plan(tmp: Path, cluster, names: list[str], batch: int, vgpus: int, stages: int = 1, input_shape: tuple[int, ...] = (16,)):
    """A plan of models of ``stages`` blocks with 1 us emulated latency each and a 16-float
    input (or one of ``input_shape``), each stage on ``vgpus`` CPU vGPUs of ``cluster`` at ``batch`` (one stage: level 2;
    several: level 4, so that they share the cluster's GPUs): the frontend is the bottleneck.
    Returns ``(plan, profiles)``; the profiles are written under ``tmp``."""
    from ppipe.planner.placement import place
    from ppipe.spec.plan import ModelPlan, PartitionPlan, PipelinePlan, Plan, PlanSettings, SolverReport
    from ppipe.spec.profile import BlockSpec, ModelManifest, ModelProfile, SourceSpec, TensorSpec

    models, profiles = [], {}
    for name in names:
        manifest = ModelManifest(
            name=name, source=SourceSpec(kind="synthetic", note="frontend benchmark: 1 us per batch"),
            input=TensorSpec(name="input", shape=list(input_shape)), outputs=[TensorSpec(name="output", shape=[4])],
            blocks=[BlockSpec(index=k, out_bytes_per_sample=16) for k in range(stages)], slo_ms=CEILING_SLO_MS,
        )
        level = 2 if stages == 1 else 4
        table = {("cpu", v, b, k): 1.0 for v in (1, 2, 4) for b in (1, 2, 4, 8, 16, 32) for k in range(stages)}
        profiles[name] = ModelProfile(manifest=manifest, table=table, directory=tmp / name)
        profiles[name].save(tmp / name)
        parts = [PartitionPlan(first_block=k, last_block=k, gpu="cpu", vgpu=level, count=vgpus, infer_us=1.0, throughput_rps=1e6)
                 for k in range(stages)]
        models.append(ModelPlan(name=name, profile=str(tmp / name), slo_ms=CEILING_SLO_MS, weight=1.0, throughput_rps=1e6,
                                pipelines=[PipelinePlan(batch=batch, throughput_rps=1e6, latency_us=1.0 * stages, partitions=parts)]))
    settings = PlanSettings(planner="hand", formulation="ppipe", gpu_rule="physical", objective="none", margin=0.0, max_partitions=stages)
    plan = Plan(cluster=cluster.name, settings=settings, solver=SolverReport(name="none", status="heuristic", seconds=0, objective=0),
                models=models, placement=place(models, cluster))
    return plan, profiles


def scaleout(duration_s: float, seed: int, tmp: Path, rates: list[float], shard_counts: tuple[int, ...] = (1, 2)) -> dict:
    """The highest total rate two batch-1 models (1 us emulated stages) get at >= 99 %
    attainment from `ppipe serve --shards N`, as a user runs it, for each N: the frontend is
    the bottleneck, so this is what sharding buys. Each model has its own `ppipe bench`."""
    from ppipe.runtime.client.httpclient import wait_until_ready
    from ppipe.spec.base import dump_yaml
    from ppipe.spec.cluster import load_cluster

    base = load_cluster("local-cpu")
    cluster = base.model_copy(update={"servers": [base.servers[0].model_copy(update={"gpus_per_server": 2})]})
    cluster_file = tmp / "local-cpu-2.yaml"
    dump_yaml(cluster.model_dump(mode="json", exclude_none=True), cluster_file)
    plan, _ = null_plan(tmp, cluster, ["null-a", "null-b"], batch=1, vgpus=2)
    plan = plan.model_copy(update={"cluster_file": str(cluster_file)})
    models = plan.models
    plan.save(tmp / "scaleout.yaml")
    print(f"\n== scale-out: two models (batch 1, 1 us emulated stages, SLO {CEILING_SLO_MS:g} ms), `ppipe serve --shards N`, "
          f"half the rate to each model")
    out: dict[str, dict] = {}
    for n in shard_counts:
        port = 18000 + n
        proc = subprocess.Popen([sys.executable, "-m", "ppipe.cli", "serve", str(tmp / "scaleout.yaml"), "--backend", "emulated",
                                 "--shards", str(n), "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env={**os.environ, "RAY_ADDRESS": ""})
        url = f"http://127.0.0.1:{port}"
        try:
            wait_until_ready(url, proc, timeout_s=180)
            best, points = None, {}
            for rate in rates:
                results = parallel_bench(url, [m.name for m in models], rate / len(models), duration_s, seed)
                att = min(r["slo_attainment"] for r in results)
                good = sum(r["goodput_rps"] for r in results)
                points[str(rate)] = {"attainment": att, "goodput_rps": good}
                print(f"   {n} shard(s): {rate:6.0f} req/s offered: attainment {100 * att:.2f} % (worse model)  goodput {good:.0f} req/s")
                if att < 0.99:
                    break
                best = rate
            out[str(n)] = {"max_rps": best, "points": points}
            print(f"   {n} shard(s): highest total rate at >= 99 %: {best} req/s")
        finally:
            stop_server(proc)
    one, two = out.get("1", {}).get("max_rps"), out.get("2", {}).get("max_rps")
    if one and two:
        print(f"   2 shards / 1 shard: {two / one:.2f}x (target >= 1.7 on a host whose cores are not also the load generator's)")
    return out


def stop_server(proc: subprocess.Popen) -> None:
    """Stop a `ppipe serve` subprocess as Ctrl-C does (it answers what is in flight), or kill it after 60 s."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def parallel_bench(url: str, models: list[str], rate_each: float, duration_s: float, seed: int) -> list[dict]:
    """One `ppipe bench` per model, at once; their JSON figures."""
    procs, files = [], []
    for i, m in enumerate(models):
        fh = tempfile.NamedTemporaryFile(suffix=".json", delete=False)
        fh.close()
        files.append(fh.name)
        procs.append(subprocess.Popen([sys.executable, "-m", "ppipe.cli", "bench", url, "--model", m, "--rate", f"{rate_each:.3f}",
                                       "--duration-s", str(duration_s), "--seed", str(seed + i), "--json-out", fh.name, "--binary"],
                                      stdout=subprocess.DEVNULL))
    for p in procs:
        p.wait()
    return [json.loads(Path(f).read_text()) for f in files]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["all", "rehearsal", "ceiling", "scaleout", "httpfloor"], default="all")
    ap.add_argument("--model", default="atss_r101_fpn_1x_coco", help="PPipe-artifact model for the rehearsal (see above)")
    ap.add_argument("--duration-s", type=float, default=10.0, help="arrival window per load point (the paper: 30)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dilation", default="auto",
                    help="rehearse the plan k times slower (latencies x k, NICs / k, rates / k), for a host too small "
                         "for the plan's real rate; auto (the default): what this host's data path needs for the maps "
                         "(1 with --maps capped)")
    ap.add_argument("--maps", choices=["real", "capped"], default="real",
                    help="rehearsal: the plan's real feature maps (default), or capped at 4 KiB per sample")
    ap.add_argument("--dispatch-lead-ms", type=float, default=None, help="the runtime's dispatch lead (default: ppipe serve's)")
    ap.add_argument("--answer-budget-ms", type=float, default=None, help="the runtime's answer budget (default: ppipe serve's)")
    ap.add_argument("--report-tolerance-ms", type=float, default=None,
                    help="the runtime's report tolerance (default: ppipe serve's; -1: every stage reports at once)")
    ap.add_argument("--binary", action="store_true", help="rehearsal: send binary-tensor requests instead of JSON")
    ap.add_argument("--loads", default=None, help="rehearsal: run the runtime at these load factors only (e.g. 0.6,0.7) instead of the scan")
    ap.add_argument("--ceiling-batch", type=int, default=16, help="ceiling: the batch of the null model's pipeline")
    ap.add_argument("--ceiling-stages", type=int, default=1,
                    help="ceiling: stages of the null model's route (e.g. --ceiling-batch 1 --ceiling-stages 3: the issue's batch-1, 3-stage route)")
    ap.add_argument("--rates", default="500,1000,1500,2000,3000", help="offered rates of the ceiling part")
    ap.add_argument("--scaleout-rates", default="300,450,600,800,1000,1200,1500,1800,2200", help="total offered rates of the scale-out part")
    ap.add_argument("--launcher", choices=["local", "ray"], default="local",
                    help="rehearsal and ceiling: the workers as local processes (the default, as `ppipe serve` runs them on "
                         "one machine) or as Ray actors")
    ap.add_argument("--json-out", default=None, help="write all figures to this JSON file")
    args = ap.parse_args()
    sys.stdout.reconfigure(line_buffering=True)
    from hostspeed import host_line

    print(host_line())

    if args.launcher == "ray" and args.part not in ("httpfloor", "scaleout"):  # (those two start no workers here)
        import ray

        os.environ.setdefault("RAY_worker_niceness", "0")  # as `ppipe serve` starts its Ray (ppipe.runtime.cli.init_ray)
        ray.init(include_dashboard=False, log_to_driver=False)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        if args.part in ("all", "ceiling"):
            results["ceiling"] = ceiling(args.duration_s, args.seed, Path(tmp), [float(x) for x in args.rates.split(",")],
                                         args.ceiling_batch, args.ceiling_stages, args.launcher)
        if args.part in ("all", "httpfloor"):
            results["httpfloor"] = http_floor(args.duration_s, args.seed, [float(x) for x in args.rates.split(",")])
        if args.part in ("all", "scaleout"):
            results["scaleout"] = scaleout(args.duration_s, args.seed, Path(tmp), [float(x) for x in args.scaleout_rates.split(",")])
        if args.part in ("all", "rehearsal"):
            dilation = args.dilation if args.dilation == "auto" else float(args.dilation)
            results["rehearsal"] = rehearsal(args.model, args.duration_s, args.seed, Path(tmp), dilation, args.dispatch_lead_ms,
                                             args.answer_budget_ms, args.report_tolerance_ms, args.binary,
                                             [float(x) for x in args.loads.split(",")] if args.loads else None, args.maps,
                                             args.launcher)
    if args.launcher == "ray" and "ray" in sys.modules and sys.modules["ray"].is_initialized():
        sys.modules["ray"].shutdown()
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))
    print("\n" + json.dumps({k: ({kk: vv.get("ceiling_rps") for kk, vv in v.items()} if k == "ceiling" else
                                 {kk: vv.get("max_rps") for kk, vv in v.items()} if k == "scaleout" else
                                 {kk: round(vv["server_cpu_ms_per_request"], 3) for kk, vv in v.items()} if k == "httpfloor" else
                                 {kk: v.get(kk) for kk in ("model", "vgpus", "dilation", "planned_rps", "sim_max_load", "runtime_max_load")})
                             for k, v in results.items()}, indent=2))


if __name__ == "__main__":
    main()
