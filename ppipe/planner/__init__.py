"""The control plane: cluster + model profiles -> pooled pipelines (a MILP).

* :mod:`ppipe.planner.api` -- ``plan(...)`` (also ``ppipe.plan``), input resolution, defaults.
* :mod:`ppipe.planner.configs` -- SLO-feasible configurations (columns), dominance pruning.
* :mod:`ppipe.planner.formulation` -- the MILP's math (docstring) and build/extract.
* :mod:`ppipe.planner.colgen` -- columns on demand: the max-min plan at fleet scale.
* :mod:`ppipe.planner.objectives` -- max-min (default), total, min-cost, custom objectives.
* :mod:`ppipe.planner.solvers` -- HiGHS, CBC, Gurobi backends.
* :mod:`ppipe.planner.baselines` -- NP and DART-r.
* :mod:`ppipe.planner.placement` -- vGPUs onto servers' GPU slots.
"""
