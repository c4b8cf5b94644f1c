"""Refit the estimators' shipped parameters from a PPipe artifact folder.

    python -m ppipe.profiler.estimate fit-cross-gpu ../shared/data/ppipe-artifact
    python -m ppipe.profiler.estimate fit-roofline ../shared/data/ppipe-artifact
"""

from __future__ import annotations

import argparse
import os
import sys

# Hundreds of small solves: one BLAS thread is faster than a contended pool.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")


def main(argv: list[str] | None = None) -> int:
    from ppipe.errors import UserError
    from ppipe.profiler.estimate.crossgpu import DATA_FILE, fit_cross_gpu
    from ppipe.profiler.estimate.roofline import PARAMS_FILE, fit_roofline

    ap = argparse.ArgumentParser(prog="python -m ppipe.profiler.estimate", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("fit-cross-gpu", help="fit the cross-GPU model (writes cross_gpu.npz)")
    c.add_argument("artifact")
    c.add_argument("--out", default=str(DATA_FILE))
    r = sub.add_parser("fit-roofline", help="fit the roofline constants (writes roofline_params.json)")
    r.add_argument("artifact")
    r.add_argument("--out", default=str(PARAMS_FILE))
    args = ap.parse_args(argv)
    try:
        if args.cmd == "fit-cross-gpu":
            m = fit_cross_gpu(args.artifact, out=args.out)
            print(f"fitted {len(m.regressors)} regressors on {len(m.models)} models -> {args.out}")
        else:
            doc = fit_roofline(args.artifact, out=args.out)
            for g, p in doc["gpus"].items():
                print(g, {k: round(v, 4) for k, v in p.items()})
            print(f"-> {args.out}")
    except UserError as exc:
        print(exc.render(), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
