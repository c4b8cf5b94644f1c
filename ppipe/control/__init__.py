"""Control loops above the data plane: pure logic on an injected clock, driven alike by the
simulator (virtual time) and the runtime (wall time).

* :mod:`ppipe.control.replan`: re-plan when the model mix shifts (issue 21).
"""

from ppipe.control.replan import ReplanController, ReplanDecision, ReplanPolicy, kept_placements, planner_replan

__all__ = ["ReplanController", "ReplanDecision", "ReplanPolicy", "kept_placements", "planner_replan"]
