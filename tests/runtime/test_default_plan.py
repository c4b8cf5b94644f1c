"""The README's default plan served as a new user serves it: every model served at a low load.

``ppipe plan``'s default (HC2-S, the three built-in models) on emulated workers with the
real inputs and feature maps (the profiled latencies emulate the GPUs), the frontend with
`ppipe serve`'s defaults, driven by ``ppipe bench --binary`` from its own process. The
simulator, with the same margins, runs the same rates. Before the runtime's margins were
data-plane rules, resnet50 (6.15 ms of slack in a 15.26 ms SLO) was dropped whole.

The workers are Ray actors, a process each, as `ppipe serve` starts them. Not the
in-process launcher (:mod:`ppipe.runtime.launch.inproc`): there the workers' timed waits
and the frontend's work take turns on one loop, one core, so resnet50's 15 ms SLO is the
launcher's, not the runtime's (it served 126 of 141 requests in process on a quiet host).

What is checked: every model is served (at least nine in ten of its requests answered with
outputs, at most a tenth dropped), where the old budgets answered every resnet50 request
with a drop. The share on time is the host's: resnet50's median latency sits near its SLO on
a 2-core host with two dozen worker processes, the frontend and the load generators on it,
so it swings from run to run; the 99 % target is a benchmark figure
(``scripts/bench_default_plan.py``, docs/benchmarks.md), not asserted here.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from ppipe.dataplane.margins import serving_options
from ppipe.runtime.cli import DEFAULT_REPORT_TOLERANCE_MS, DEFAULT_WAKE_LEAD_MS
from ppipe.runtime.launch.deploy import load_deployment, start_workers
from ppipe.runtime.scheduler.host import Runtime
from ppipe.runtime.ingress.http_server import create_app
from ppipe.runtime.ingress.http_transport import BackgroundServer
from ppipe.sim.simulator import SimConfig
from ppipe.sim.sweep import run_point

pytestmark = pytest.mark.ray

LOAD = 0.03  # of each model's planned rate: ~40 req/s each
SERVED = 0.9  # answered with outputs (on time or late), per model (see the module's docstring)
MAX_DROPS = 0.1  # dropped, per model
DURATION_S = 4.0


@pytest.fixture(scope="module")
def served(ray_cluster, tmp_path_factory):
    from ppipe.planner.api import plan as make_plan

    path = tmp_path_factory.mktemp("default") / "plan.yaml"
    make_plan().save(path)
    dep = load_deployment(path)
    with frontend(dep) as url:
        bench(url, {m.name: 5.0 for m in dep.plan.models}, 1.5, tmp_path_factory.mktemp("warm"))  # connections, first batches
        yield url, dep


@contextlib.contextmanager
def frontend(dep):
    """The frontend's URL, the plan served with `ppipe serve`'s defaults on emulated Ray
    workers (real-size feature maps: no byte cap; an authenticated data path)."""
    opts = serving_options()
    settings = dict(scheduler_options={"wake_lead_us": DEFAULT_WAKE_LEAD_MS * 1e3}, dispatch_lead_us=opts["dispatch_lead_us"],
                    answer_budget_us=opts["answer_budget_us"], report_tolerance_us=DEFAULT_REPORT_TOLERANCE_MS * 1e3,
                    data_secret=secrets.token_bytes(32))
    workers = start_workers(dep, backend="emulated")
    try:
        with BackgroundServer(create_app(Runtime(dep.plan, dep.profiles, dep.cluster, workers, **settings))) as srv:
            yield srv.url
    finally:
        for h in workers.values():
            h.kill()


def bench(url: str, rates: dict[str, float], duration_s: float, out: Path) -> dict[str, dict]:
    """``ppipe bench --binary`` per model, all at once, each in its own process."""
    exe = str(Path(sys.executable).with_name("ppipe"))
    procs = [subprocess.Popen([exe, "bench", url, "--model", m, "--rate", f"{r}", "--duration-s", f"{duration_s}", "--binary",
                               "--seed", str(i), "--json-out", str(out / f"{m}.json")], stdout=subprocess.DEVNULL)
             for i, (m, r) in enumerate(rates.items())]
    assert all(p.wait() == 0 for p in procs)
    return {m: json.loads((out / f"{m}.json").read_text()) for m in rates}


def simulated(dep, rates: dict[str, float]) -> dict[str, float]:
    full = {m.name: rates.get(m.name, 0.0) for m in dep.plan.models}
    res = run_point(dep.plan, dep.profiles, dep.cluster, 1.0, rates_rps=full,
                    config=SimConfig(duration_s=DURATION_S, scheduler_options=serving_options()))
    return {m: res.models[m].attainment for m in rates}


@pytest.mark.parametrize("alone", ["resnet50", "inception_v2", "densenet121", None])
def test_every_model_of_the_default_plan_is_served_at_a_low_load(served, alone, tmp_path):
    url, dep = served
    planned = {m.name: m.throughput_rps for m in dep.plan.models}
    # together, a third of the load each: the same total rate through the one frontend and
    # three load generators on the same two cores
    rates = {m: LOAD * r for m, r in planned.items() if m == alone} if alone else {m: LOAD / 3 * r for m, r in planned.items()}
    got = bench(url, rates, DURATION_S, tmp_path)
    sim = simulated(dep, rates)
    for m, r in got.items():
        assert r["sent"] >= 0.6 * rates[m] * DURATION_S  # (Poisson arrivals of a fixed seed)
        assert r["ok"] >= SERVED * r["sent"], (m, r["ok"], r["sent"], r["slo_attainment"], r["drops"], r["p50_ms"], r["p99_ms"])
        assert sum(r["drops"].values()) <= MAX_DROPS * r["sent"], (m, r["drops"], r["sent"])
        assert sim[m] >= 0.99, (m, sim[m])
