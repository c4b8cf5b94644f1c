"""Discrete-event simulator: the data plane's scheduler under a virtual clock.

Entry points: :func:`simulate` (one run on given arrivals), :func:`run_point` (one load
factor), :func:`sweep` (largest load factor at a target attainment), and the
``ppipe simulate`` command (:mod:`ppipe.sim.cli`). The event ordering is defined once in
:mod:`ppipe.sim.clock`; the execution model in :mod:`ppipe.sim.simulator`; metric
definitions in :mod:`ppipe.sim.metrics`.
"""

from ppipe.sim.arrivals import ArrivalKind, make_arrivals, read_trace
from ppipe.sim.clock import EventLoop, Priority, VirtualClock
from ppipe.sim.metrics import ModelMetrics, SimResult
from ppipe.sim.simulator import SimConfig, Simulator, simulate
from ppipe.sim.sweep import SweepResult, Workload, base_rates, load_inputs, run_point, sweep

__all__ = [
    "ArrivalKind",
    "EventLoop",
    "ModelMetrics",
    "Priority",
    "SimConfig",
    "SimResult",
    "Simulator",
    "SweepResult",
    "VirtualClock",
    "Workload",
    "base_rates",
    "load_inputs",
    "make_arrivals",
    "read_trace",
    "run_point",
    "simulate",
    "sweep",
]
