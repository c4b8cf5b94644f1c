"""One line that says how fast this host runs plain Python, for every benchmark's output.

The benchmarks' timing targets are stated for "this 2-core machine", but the machines
handed out differ: the same commit ran the simulator at 8.8 simulated s per wall s on one
host and 3.9 on another (2026-11-25). Printing a fixed pure-Python workload's time next to
the figures lets a reader compare figures taken on different hosts.
"""

from __future__ import annotations

import os
import platform
import time

LOOP_N = 10_000_000


def loop_seconds(n: int = LOOP_N, repeat: int = 3) -> float:
    """Fastest of ``repeat`` runs of ``for i in range(n): s += i`` (CPython, one core)."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        s = 0
        for i in range(n):
            s += i
        best = min(best, time.perf_counter() - t0)
    return best


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def stolen_s() -> float:
    """CPU seconds that the hypervisor ran other guests while this one's vCPUs were ready to
    run, over all CPUs since boot (``/proc/stat``'s steal column; 0 where it is not reported).

    On a shared VM this is what makes the same run take half again as long minutes later:
    read it before and after a run, and a run with a large difference is not comparable."""
    try:
        with open("/proc/stat") as fh:
            ticks = fh.readline().split()[1:]
        return int(ticks[7]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def host_line() -> str:
    """E.g. ``host: AMD EPYC, 2 cores, Python 3.11.7; 10M-add loop 2.09 s (lower is faster)``."""
    return (f"host: {cpu_model()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
            f"10M-add loop {loop_seconds():.2f} s (lower is faster; compare timings only across similar values)")


if __name__ == "__main__":
    print(host_line())
