"""The serving processes' allocator (ppipe.runtime.memory): large buffers reuse the heap's
pages, and a trim gives a burst's back. Each case runs in a fresh interpreter (mallopt
changes the whole process)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and malloc_trim: Linux only")

_PROBE = r"""
import json, resource, sys
import numpy as np
from ppipe.runtime import memory

tuned = sys.argv[1] == "tuned"
if tuned:
    memory.tune_for_serving()

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

def rss_mb():
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * 4096 / 2**20

nbytes = 20 * 2**20  # a 20 MB input (atss's is 12.8 MB): above glibc's first mmap threshold
a = np.ones(nbytes, np.uint8); del a  # the first one
f0 = faults()
b = np.ones(nbytes, np.uint8); del b  # the next request's
second = faults() - f0
big = [np.ones(2**20, np.uint8) for _ in range(200)]  # a burst: 200 MB in flight
del big
before = rss_mb()
memory.trim_heap()
print(json.dumps({"second_faults": second, "kept_mb": before, "after_trim_mb": rss_mb()}))
"""


def _probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True, timeout=60)
    return json.loads(out.stdout)


def test_a_large_buffer_reuses_the_heap_pages_of_the_one_before_it_and_a_trim_gives_a_burst_back():
    tuned, plain = _probe("tuned"), _probe("plain")
    # glibc alone: the second buffer is a fresh mapping whose pages fault in again (a few
    # hundred faults here: some pages come huge); tuned: it reuses the first one's pages
    assert plain["second_faults"] > 100, plain
    assert tuned["second_faults"] < 20, tuned
    assert tuned["kept_mb"] - tuned["after_trim_mb"] > 150, tuned  # what the burst freed goes back at the trim
