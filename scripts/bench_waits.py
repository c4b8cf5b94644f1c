"""What an emulated stage's timed waits cost in CPU: the wait for the reserved start and the
inference's as two waits (as a real backend's stage waits), or as one (the emulated
backend's, which starts itself: :meth:`ppipe.runtime.workers.backends.EmulatedBackend.run`).

Each case runs ``--n`` stage-like rounds on uvloop (asyncio's loop where uvloop is absent)
and prints the process's CPU per round. A round of two waits uses
:func:`ppipe.runtime.clock.sleep_until` twice; a round of one uses
:func:`~ppipe.runtime.clock.sleep_near` to the start and one ``sleep_until`` to its end, as
a worker with the emulated backend does. What it leaves out: everything else a stage does
(messages in and out, the maps), and other processes on the cores.

    python scripts/bench_waits.py [--n 300] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import hostspeed  # noqa: E402
from ppipe.runtime.clock import sleep_near, sleep_until, wall_us  # noqa: E402

CASES = [(900.0, 3000.0), (2500.0, 3000.0)]  # (to the reserved start, the inference) in us


async def split(to_start_us: float, infer_us: float) -> None:
    await sleep_until(wall_us() + to_start_us)
    await sleep_until(wall_us() + infer_us)


async def merged(to_start_us: float, infer_us: float) -> None:
    start = wall_us() + to_start_us
    await sleep_near(start)
    await sleep_until(max(wall_us(), start) + infer_us)


async def cpu_per_round(stage, to_start_us: float, infer_us: float, n: int) -> float:
    c0 = time.process_time()
    for _ in range(n):
        await stage(to_start_us, infer_us)
    return (time.process_time() - c0) / n * 1e6


async def main(n: int, rounds: int) -> None:
    for r in range(rounds):
        for to_start, infer in CASES:
            two = await cpu_per_round(split, to_start, infer, n)
            one = await cpu_per_round(merged, to_start, infer, n)
            print(f"round {r + 1}: {to_start / 1e3:.1f} ms to the start, {infer / 1e3:.1f} ms inference: "
                  f"two waits {two:.0f} us of CPU per stage, one wait {one:.0f} us")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=300, help="stage-like rounds per case")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    print(hostspeed.host_line())
    stolen = hostspeed.stolen_s()
    try:
        import uvloop

        run = uvloop.run
    except ImportError:
        run = asyncio.run
    t0 = time.perf_counter()
    run(main(args.n, args.rounds))
    print(f"cores stolen by the hypervisor over the run: {(hostspeed.stolen_s() - stolen) / (time.perf_counter() - t0):.2f}")
