"""HiGHS's banner never reaches stdout (ppipe.planner.highs_util)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest

from ppipe.planner.highs_util import _construct_silenced

BANNER = "Running HiGHS"


def _fresh_python(code: str) -> subprocess.CompletedProcess:
    # HiGHS prints its banner once per process, so only a new process shows whether it leaks.
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)


def test_plain_highspy_prints_the_banner():
    # What the helper guards against; if a highspy release stops printing it, this says so.
    out = _fresh_python("import highspy; highspy.Highs(); print('after')").stdout
    assert BANNER in out


def test_a_plan_in_a_fresh_process_prints_no_banner():
    code = (
        "import sys; sys.path.insert(0, %r)\n"
        "from planner_synth import cluster, profile\n"
        "import ppipe\n"
        "L = {'A': [1, 2], 'B': [1]}\n"
        "cl = cluster({'A': 2, 'B': 2}, L)\n"
        "m = profile('m1', {'A': [2000.0, 3000.0, 1000.0], 'B': [3000.0, 9000.0, 1500.0]}, [200_000, 100_000], L)\n"
        "plan = ppipe.plan(cl, [m], slo_ms=30.0, max_partitions=2, formulation='ppipe-atc25', batch_build=False, place=False)\n"
        "print('objective', plan.solver.objective)\n"
    ) % os.path.dirname(__file__)
    out = _fresh_python(code).stdout
    assert BANNER not in out and "Copyright" not in out
    assert out.startswith("objective ")


def test_silenced_construction_drops_fd_and_c_buffered_output(capfd):
    libc = ctypes.CDLL(None)

    def noisy():
        os.write(1, b"raw fd write\n")
        libc.printf(b"buffered C printf without newline")  # sits in the C buffer until flushed
        return 42

    print("before", flush=True)
    assert _construct_silenced(noisy) == 42
    print("after", flush=True)
    libc.fflush(None)
    out = capfd.readouterr().out
    assert out == "before\nafter\n"


@pytest.mark.parametrize("bad", [ValueError("boom")])
def test_stdout_comes_back_when_construction_fails(capfd, bad):
    def fails():
        raise bad

    with pytest.raises(ValueError, match="boom"):
        _construct_silenced(fails)
    print("still here", flush=True)
    assert capfd.readouterr().out == "still here\n"
