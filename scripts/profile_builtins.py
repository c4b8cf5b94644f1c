#!/usr/bin/env python3
"""(Re)generate the built-in model profiles shipped in models/.

For each built-in CNN (onnx's backend test models with seeded weights, see
ppipe/profiler/builtin.py): time every layer on this machine's CPU with onnxruntime
(written to models/<name>/layers.csv, method ``ort-optimized``), cut it into 10 blocks,
measure every block on the CPU (type ``cpu``, levels 1-2, batches 1-8 / 1-4) and add
roofline estimates for the GPU types of the paper's clusters and a few more. Prints the
wall time of each model's profiling (the CPU measurement dominates it; timing the layers
takes about a second).

Re-running resumes (rows already in models/<name>/profile.csv are kept, and so are the
per-layer rows of layers.csv; a profile without them gets them timed); pass --fresh to
re-measure from scratch, --refresh-estimates to recompute only the estimates.

    python scripts/profile_builtins.py                       # resnet50, inception_v2, densenet121
    python scripts/profile_builtins.py --models resnet50 --reps 5
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODELS = ["resnet50", "inception_v2", "densenet121"]
DEFAULT_ESTIMATE = ["L4", "T4", "P4", "V100", "A10", "A100", "H100"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS), help="comma-separated built-in names")
    ap.add_argument("--estimate", default=",".join(DEFAULT_ESTIMATE), help="GPU types to estimate ('' for none)")
    ap.add_argument("--out", default=str(REPO / "models"), help="folder that receives <name>/")
    ap.add_argument("--batches", default="1-8")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--stat", default="min", choices=["median", "min"], help="min damps a shared machine (default)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--fresh", action="store_true", help="delete the model folders first")
    ap.add_argument("--refresh-estimates", action="store_true")
    ap.add_argument("--no-measure", action="store_true", help="only estimates (cuts from an unmeasured layer timing)")
    args = ap.parse_args(argv)

    from ppipe.errors import UserError
    from ppipe.profiler.run import ProfileRequest, parse_batches, profile_model

    estimate = [g for g in args.estimate.split(",") if g]
    for name in [m for m in args.models.split(",") if m]:
        out = Path(args.out) / name
        if args.fresh and out.exists():
            shutil.rmtree(out)
        req = ProfileRequest(
            builtin=name,
            out_dir=out,
            batches=parse_batches(args.batches),
            measure=None if args.no_measure else "cpu",
            estimate=estimate,
            threads=args.threads,
            reps=args.reps,
            statistic=args.stat,
            refresh_estimates=args.refresh_estimates,
        )
        t0 = time.perf_counter()
        try:
            prof = profile_model(req, progress=sys.stderr.isatty(), echo=lambda m: print(f"  {m}", file=sys.stderr))
        except UserError as exc:
            print(f"error: {exc.render()}", file=sys.stderr)
            return 2
        wall = time.perf_counter() - t0
        bs1 = ", ".join(f"{g} {v / 1000:.2f} ms" for g, v in sorted(prof.manifest.latency_bs1_us.items()))
        print(f"{name}: {len(prof.table)} rows in {wall:.1f} s wall ({prof.num_blocks} blocks); batch-1 latency: {bs1}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
