#!/usr/bin/env python
"""Write your own planner objective: the fewest watts that carry a rate per model.

An objective is a function ``fn(milp, v)`` (or an object with ``name`` and ``apply``)
that ``ppipe.plan(objective=...)`` calls after building the constraints. It sees:

* ``milp`` (:class:`ppipe.planner.milp.Milp`): ``add_col(lb, ub, integer, name)``,
  ``add_row({col: coef}, lb=, ub=, name=)`` and ``set_objective({col: coef}, "max"|"min")``.
* ``v`` (:class:`ppipe.planner.formulation.PlanVariables`), the documented columns:
    - ``v.x_model[m]``  throughput of model m in req/s (continuous);
    - ``v.gpus[k]``     physical GPUs of type k in use (integer, at most the cluster's);
    - ``v.g[i]``        per model i, a (configurations x slots) array of vGPU-count columns;
    - ``v.x_config[i]`` per model i, each configuration's throughput column (-1 for
      single-partition ones, whose throughput is X * g);
    - ``v.configs[i]``  the configurations themselves (types, levels, blocks, X, batch);
    - ``v.models``, ``v.types``, ``v.weight[m]``, ``v.price[k]``.

Usage::

    python examples/custom_objective.py [CLUSTER] MODEL_DIR...   # e.g. HC2-S models/resnet50
    python examples/custom_objective.py                           # PPipe artifact models, if present
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import ppipe

# Board power per GPU type in W (vendor TDPs); a type not listed counts 200 W.
WATTS = {"L4": 72.0, "T4": 70.0, "P4": 75.0, "V100": 300.0, "A100": 400.0}


def fewest_watts(rate_rps: float):
    """Objective factory: every model carries ``rate_rps``; minimize the GPUs' power."""

    def fewest_watts(milp, v) -> None:
        for m in v.models:
            milp.add_row({v.x_model[m]: 1.0}, lb=rate_rps, name="required_rate")
        milp.set_objective({v.gpus[k]: WATTS.get(k, 200.0) for k in v.types}, "min")

    return fewest_watts


def main(argv: list[str]) -> int:
    cluster = argv[0] if argv else "HC2-S"
    models: list = argv[1:]
    if not models:
        art = Path(os.environ.get("PPIPE_ARTIFACT", Path(__file__).resolve().parents[2] / "shared" / "data" / "ppipe-artifact"))
        if not (art / "block-timing").is_dir():
            print("give MODEL_DIRs (made by `ppipe profile` or `ppipe import-ppipe`)", file=sys.stderr)
            return 2
        from ppipe.spec.artifact import load_artifact_model

        models = [load_artifact_model(art, n) for n in ("repvgg-b3", "googlenet-v3-pytorch")]
    best = ppipe.plan(cluster, models)  # max-min throughput: what the cluster can carry
    rate = 0.5 * min(m.throughput_rps for m in best.models)
    plan = ppipe.plan(cluster, models, objective=fewest_watts(rate))
    watts = sum(WATTS.get(k, 200.0) * n for k, n in plan.gpus_used.items())
    print(f"max-min plan: {best.gpus_used} GPUs, {[round(m.throughput_rps) for m in best.models]} req/s")
    print(f"{rate:.0f} req/s per model with the fewest watts: {plan.gpus_used} GPUs = {watts:.0f} W, "
          f"{[round(m.throughput_rps) for m in plan.models]} req/s ({plan.solver.status})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
