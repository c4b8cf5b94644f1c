"""The README's default plan served as a new user serves it, next to the simulator.

Plans HC2-S for the three built-in models (``ppipe plan``'s default), then for each model
alone, and for all three together, at ``--load`` of each model's planned rate:

* ``ppipe simulate``'s figures for that load (the runtime's margins and wake lead applied, as by default);
* ``ppipe serve``'s: emulated workers with the profiled latencies and the real inputs
  and feature maps (no byte cap), driven open loop by ``ppipe bench --binary`` over HTTP.
  By default the frontend runs in this process on local worker processes (as `ppipe serve`
  starts them on one machine), and the script prints
  where each model's time went at the scheduler, from the batches' traces
  (:func:`latency_parts`). With ``--command`` it is the real command a user runs (``ppipe
  serve plan.yaml --backend emulated``, local worker processes, ``--ingress N`` ingress
  processes), without the traces.

Prints a host line and a table per run: on time at the client, and ``at server``, the
share the server held within the SLO (from arrival to answer, its ``Server-Timing``
header); the rest of the client's latency is its own lag, the HTTP hops and the reply.
What it leaves out: the GPUs (compute is emulated by sleeping), a network (every byte
crosses loopback), and the client's own CPU on the same cores.

    python scripts/bench_default_plan.py [--load 0.1] [--duration-s 10] [--plan plan.yaml]
                                         [--command [--ingress N]]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

import hostspeed  # noqa: E402
from bench_serve import process_cpu_s, serve_in_process, stop, stop_server, worker_pids  # noqa: E402  (a script next to this one)


def host_line() -> str:
    la = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"{hostspeed.host_line()}; load average {la}"


def default_plan(plan_file: str | None):
    """The plan (``ppipe plan``'s default unless a file is given), its profiles, cluster and file."""
    from ppipe.runtime.launch.deploy import load_deployment

    if plan_file is None:
        import tempfile

        from ppipe.planner.api import plan as make_plan

        plan_file = str(Path(tempfile.mkdtemp()) / "plan.yaml")
        make_plan().save(plan_file)
    dep = load_deployment(plan_file, None)
    return dep.plan, dep.profiles, dep.cluster, plan_file


def simulate(plan, profiles, cluster, rates: dict[str, float], duration_s: float) -> dict[str, tuple[float, float | None]]:
    """Attainment and p50 (ms) per model of ``ppipe simulate`` at these rates, with its default margins and wake lead."""
    from ppipe.dataplane.margins import simulated_serving_options
    from ppipe.sim.simulator import SimConfig
    from ppipe.sim.sweep import run_point

    full = {m.name: rates.get(m.name, 0.0) for m in plan.models}
    res = run_point(plan, profiles, cluster, 1.0, rates_rps=full,
                    config=SimConfig(duration_s=duration_s, scheduler_options=simulated_serving_options()))
    return {m: (res.models[m].attainment, res.models[m].p50_latency_ms) for m in rates}


CLIENT_START_S = 1.5  # what one `ppipe bench` may take to load on a loaded 2-core host


def drive(url: str, rates: dict[str, float], duration_s: float, nice: int = 0, meter=None) -> dict[str, dict]:
    """``ppipe bench --binary`` per model, all at once, each in its own process (a client
    in the server's process would share its interpreter lock), at niceness ``nice`` (above 0:
    the server's processes take the cores first, as if the clients ran elsewhere; their own
    lag, printed, grows instead); returns their figures. Their arrivals begin together
    (``--start-at``), once every client has loaded: a client that began at once would send
    its first second beside the others' start-up. ``meter()`` (optional) is read when the
    arrivals begin and when the clients are done: ``figures["meter"]`` is the pair."""
    import json
    import subprocess
    import tempfile
    import time

    out = Path(tempfile.mkdtemp())
    start_at = time.time() + CLIENT_START_S * len(rates)
    procs = [subprocess.Popen([str(Path(sys.executable).with_name("ppipe")), "bench", url, "--model", m, "--rate", f"{r}", "--duration-s",
                               f"{duration_s}", "--binary", "--seed", str(i), "--json-out", str(out / f"{m}.json"), "--start-at", f"{start_at:.3f}"],
                              stdout=subprocess.DEVNULL, preexec_fn=(lambda: os.nice(nice)) if nice else None)
             for i, (m, r) in enumerate(rates.items())]
    if meter is not None:
        time.sleep(max(0.0, start_at - time.time()))
        before = meter()
    for p in procs:
        if p.wait() != 0:
            raise SystemExit(f"ppipe bench exited with {p.returncode}")
    figures = {m: json.loads((out / f"{m}.json").read_text()) for m in rates}
    if meter is not None:
        figures["meter"] = (before, meter())
    return figures


def serve_command(plan_file: str, ingress: int):
    """``ppipe serve plan_file --backend emulated`` as a user starts it (local workers,
    ``ingress`` ingress processes), ready; returns the process and its URL."""
    import socket
    import subprocess

    from ppipe.runtime.client.httpclient import wait_until_ready

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "ppipe.cli", "serve", plan_file, "--backend", "emulated", "--launcher", "local",
                             "--port", str(port), "--ingress", str(ingress)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    wait_until_ready(url, proc, timeout_s=120)
    return proc, url


def descendants(pid: int) -> list[int]:
    """The process ids below ``pid`` in the process tree (Linux /proc)."""
    parent: dict[int, int] = {}
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/stat") as fh:
                parent[int(d)] = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue
    found, todo = [], [pid]
    while todo:
        kids = [p for p, pp in parent.items() if pp == todo[-1]]
        todo.pop()
        found += kids
        todo += kids
    return found


STOLEN_NOTED = 0.05  # cores stolen over a run past which its line says it is not comparable


class HostCpu:
    """What the host's CPUs did over one run, from counters read before and after it:
    CPU seconds of the server's process, of its workers and of the clients (children this
    script waited for: ``RUSAGE_CHILDREN``), the cores busy (``/proc/stat``) and the share of
    the time some runnable task waited for a CPU (``/proc/pressure/cpu``, "some"). Divided by
    the run's length they are cores; the waiting share is what late starts come from when it
    is not near zero. The busy cores include those the hypervisor stole (ran other guests on,
    :func:`hostspeed.stolen_s`), shown apart: a run with a large share stolen is not
    comparable with one without."""

    def __init__(self, server_pid: int, worker_ids: list[int]):
        self.server_pid, self.worker_ids = server_pid, worker_ids

    def read(self) -> tuple[float, ...]:
        import resource
        import time

        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        with open("/proc/stat") as fh:
            ticks = [int(x) for x in fh.readline().split()[1:]]
        busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
        try:
            with open("/proc/pressure/cpu") as fh:
                waited = int(fh.readline().rsplit("total=", 1)[1]) / 1e6
        except (OSError, IndexError, ValueError):
            waited = float("nan")
        return (time.perf_counter(), process_cpu_s(self.server_pid), sum(process_cpu_s(p) for p in self.worker_ids),
                kids.ru_utime + kids.ru_stime, busy, waited, hostspeed.stolen_s())

    def line(self, before: tuple[float, ...], after: tuple[float, ...], requests: int) -> str:
        wall, server, workers, clients, busy, waited, stolen = (b - a for a, b in zip(before, after))
        per_req = 1e3 * (server + workers) / max(requests, 1)
        return (f"  host CPU over the {wall:.1f} s run (cores): server {server / wall:.2f}, {len(self.worker_ids)} other server processes {workers / wall:.2f}, "
                f"clients {clients / wall:.2f}; busy {busy / wall:.2f} of {os.cpu_count()} (stolen by the hypervisor {stolen / wall:.2f}); "
                f"a task waited for a CPU {100 * waited / wall:.0f} % of the time; server + workers {per_req:.2f} ms of CPU per request"
                + (f"; not comparable with a run on a quiet host (more than {STOLEN_NOTED:.2f} cores stolen)" if stolen / wall > STOLEN_NOTED else ""))


def _at_server(r: dict) -> str:
    """The share of the sent requests that the server held within the SLO (its Server-Timing)."""
    held = r.get("server_on_time")
    return "-" if held is None or not r["sent"] else f"{100 * held / r['sent']:.2f}%"


def latency_parts(rt, since: int) -> tuple[dict[str, dict[str, tuple[float, float]]], dict[str, list[float]]]:
    """Per model, where its served requests' time went, from the batches' traces, as
    (p50, p95) ms over its requests: ``queue`` (arrival at the scheduler to the dispatch),
    ``lead`` (the dispatch to the first stage's reserved start), per stage ``sK late`` (its
    start after its reserved start) and ``sK over`` (its run beyond its reserved length),
    ``answer`` (the last stage's end to its report taken by the scheduler), and ``total``
    (arrival to that report). The client's figure adds its HTTP hops and the reply.
    Also returns every request's ``total`` per model."""
    parts: dict[str, dict[str, list[float]]] = {}
    wall = rt.clock.from_wall_us
    for t in rt.traces[since:]:
        if t.error is not None or t.answered_us is None or len(t.reports) != len(t.route):
            continue
        xs = parts.setdefault(t.model, {})
        rows = [("lead", t.reserved_us[0][0] - t.dispatched_us)]
        for k, (rep, (start, end)) in enumerate(zip(t.reports, t.reserved_us)):
            rows += [(f"s{k} late", wall(rep.start_us) - start), (f"s{k} over", (rep.end_us - rep.start_us) - (end - start))]
        rows.append(("answer", t.answered_us - wall(t.reports[-1].end_us)))
        for a in t.arrivals_us:
            for name, v in [("queue", t.dispatched_us - a), *rows, ("total", t.answered_us - a)]:
                xs.setdefault(name, []).append(v / 1e3)
    return ({m: {k: (float(np.percentile(v, 50)), float(np.percentile(v, 95))) for k, v in xs.items()} for m, xs in parts.items()},
            {m: xs["total"] for m, xs in parts.items()})


def print_parts(parts: dict[str, dict[str, tuple[float, float]]], totals: dict[str, list[float]], slo_ms: dict[str, float]) -> None:
    for m, xs in parts.items():
        within = 100.0 * float(np.mean(np.asarray(totals[m]) <= slo_ms[m]))
        print(f"  {m} (p50/p95 ms): " + ", ".join(f"{k} {a:.2f}/{b:.2f}" for k, (a, b) in xs.items())
              + f"; {within:.2f} % answered at the scheduler within the SLO")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--load", type=float, default=0.1, help="Share of each model's planned rate.")
    ap.add_argument("--duration-s", type=float, default=10.0)
    ap.add_argument("--plan", default=None, help="A plan.yaml (default: plan HC2-S with the built-in models).")
    ap.add_argument("--command", action="store_true", help="Serve with the real `ppipe serve` command (local workers), not in this process.")
    ap.add_argument("--ingress", type=int, default=0, help="With --command: ingress processes (`ppipe serve --ingress N`).")
    ap.add_argument("--client-nice", type=int, default=0, help="Run the clients at this niceness (e.g. 19: the server first).")
    args = ap.parse_args()
    print(host_line())
    plan, profiles, cluster, plan_file = default_plan(args.plan)
    planned = {m.name: m.throughput_rps for m in plan.models}
    runs = [{m: args.load * r} for m, r in planned.items()] + [{m: args.load * r for m, r in planned.items()}]
    rt = None
    if args.command:
        proc, url = serve_command(plan_file, args.ingress)
        print(f"served by `ppipe serve {plan_file} --backend emulated --launcher local --ingress {args.ingress}`")
    else:  # local workers, as `ppipe serve` starts them on one machine
        srv, workers, rt = serve_in_process(plan, profiles, cluster, keep_traces=10**6, launcher="local")
        url = srv.url
    cpu = HostCpu(proc.pid if rt is None else os.getpid(), descendants(proc.pid) if rt is None else worker_pids(workers))
    try:
        drive(url, {m: 5.0 for m in planned}, 2.0)  # warm-up: connections, first batches
        for rates in runs:
            sim = simulate(plan, profiles, cluster, rates, args.duration_s)
            since = len(rt.traces) if rt is not None else 0
            loop_s = hostspeed.loop_seconds(repeat=1)  # the host's speed may change between runs (a VM's neighbours)
            served = drive(url, rates, args.duration_s, args.client_nice, meter=cpu.read)
            before, after = served.pop("meter")
            label = "all three" if len(rates) > 1 else "alone"
            print(f"\n{label} at {args.load:g} of the planned rate" + (f", clients at nice {args.client_nice}" if args.client_nice else "")
                  + f" (10M-add loop {loop_s:.2f} s just before)")
            print(f"{'model':14} {'rate':>7} {'serve on time':>13} {'p50 ms':>7} {'p99 ms':>7} {'at server':>9} {'srv p50':>7} {'sim on time':>11} {'sim p50':>7} {'lag p99':>7}  drops")
            for m, r in served.items():
                sa, sp = sim[m]
                print(f"{m:14} {rates[m]:7.1f} {100 * r['slo_attainment']:12.2f}% {r['p50_ms'] or float('nan'):7.2f} "
                      f"{r['p99_ms'] or float('nan'):7.2f} {_at_server(r):>9} {r.get('server_p50_ms') or float('nan'):7.2f} {100 * sa:10.2f}% {sp or float('nan'):7.2f} {r['client_lag_p99_ms'] or float('nan'):7.2f}  {r['drops'] or '-'}")
            print(cpu.line(before, after, sum(r["sent"] for r in served.values())))
            if rt is not None:
                print("  where the time went at the scheduler (traces):")
                print_parts(*latency_parts(rt, since), {m.name: m.slo_ms for m in plan.models})
    finally:
        if rt is not None:
            stop(srv, workers)
        else:
            stop_server(proc)


if __name__ == "__main__":
    main()
