"""ppipe: pool-based pipeline-parallel CNN serving on heterogeneous GPU clusters.

The Python API mirrors the CLI::

    import ppipe
    plan = ppipe.plan("HC2-S", ["models/resnet50"])      # control plane (MILP)

Sub-packages: :mod:`ppipe.spec` (formats), :mod:`ppipe.profiler`, :mod:`ppipe.planner`,
:mod:`ppipe.dataplane`, :mod:`ppipe.sim`, :mod:`ppipe.runtime`.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy so that `import ppipe` stays light (no solver, no ONNX, no Ray).
    if name == "plan":
        from ppipe.planner.api import plan

        return plan
    if name == "Plan":
        from ppipe.spec.plan import Plan

        return Plan
    raise AttributeError(f"module 'ppipe' has no attribute {name!r}")
