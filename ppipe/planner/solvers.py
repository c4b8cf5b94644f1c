"""Solver backends: HiGHS (default, through ``highspy``), CBC (PuLP's bundled binary), Gurobi.

Each backend takes a :class:`~ppipe.planner.milp.Milp` and returns a :class:`SolveResult`;
none prints. The status is read from the solver itself (not from a wrapper's summary) and
mapped to one of ``optimal`` (proven within the gap), ``time_limit`` (the clock stopped it
with a feasible solution), ``feasible`` (a work limit, e.g. HiGHS's node limit, stopped it
with a feasible solution: unlike the clock, at the same point on every machine),
``infeasible``, or an error:

* no solution when the time limit struck: :class:`SolverTimeLimitError` (a UserError: the
  fix is a longer limit);
* the model is infeasible: ``status="infeasible"`` (the planner turns it into an
  :class:`~ppipe.errors.InfeasibleError` that says why);
* anything else: :class:`~ppipe.errors.SolverError`.
"""

from __future__ import annotations

import enum
import math
import time
import warnings
from dataclasses import dataclass, replace

import numpy as np

from ppipe.errors import NotAvailableError, SolverError, UserError
from ppipe.planner.highs_util import new_highs
from ppipe.planner.milp import Milp


class SolverName(str, enum.Enum):
    HIGHS = "highs"
    CBC = "cbc"
    GUROBI = "gurobi"


class SolverTimeLimitError(UserError):
    """The time limit struck before the solver found any plan."""


MIN_SOLVE_S = 0.1  # a solve always gets at least this, even when the time budget is spent


def time_left(deadline: float | None) -> float | None:
    """Seconds a solve may take before ``deadline`` (a ``time.perf_counter()`` value; None: no limit)."""
    return None if deadline is None else max(MIN_SOLVE_S, deadline - time.perf_counter())


@dataclass(frozen=True)
class SolveResult:
    """What a solver returns.

    Attributes:
        solver: backend name.
        status: ``optimal`` | ``time_limit`` | ``feasible`` (stopped by a node limit) | ``infeasible``.
        x: column values (None when infeasible).
        objective: objective value of ``x``.
        gap: relative MIP gap at the end (``inf`` when the backend does not report it).
        seconds: solve time (not counting model building).
        nodes: branch-and-bound nodes (-1 when the backend does not report them).
        lp_iterations: simplex iterations in all (-1 when not reported); with ``nodes``,
            a measure of the work that does not depend on the machine's load.
        method: what proved the status ("" = the backend's own search, e.g. branch and
            bound; else e.g. "highs incumbent + cover bound").
    """

    solver: str
    status: str
    x: np.ndarray | None
    objective: float
    gap: float
    seconds: float
    nodes: int = -1
    lp_iterations: int = -1
    method: str = ""


def get_solver(name: str | SolverName) -> "Solver":
    """The backend for a name: ``highs``, ``cbc`` or ``gurobi``."""
    try:
        key = SolverName(str(name).lower())
    except ValueError:
        raise UserError(
            f"unknown solver '{name}'", fix=f"use one of: {', '.join(s.value for s in SolverName)} (option --solver)"
        ) from None
    return {SolverName.HIGHS: HighsSolver, SolverName.CBC: CbcSolver, SolverName.GUROBI: GurobiSolver}[key]()


class Solver:
    name = "base"

    def solve(self, milp: Milp, *, time_limit_s: float | None = None, gap: float = 1e-4, threads: int | None = None) -> SolveResult:
        raise NotImplementedError

    def tuned_for(self, gpu_rule: str, single_model: bool = False) -> "Solver":
        """This solver with the settings measured best for MILPs of ``gpu_rule`` (and of one
        model alone, ``single_model``) (default: itself)."""
        return self

    def with_node_limit(self, max_nodes: int | None) -> "Solver":
        """This solver stopping its MILPs after about ``max_nodes`` branch-and-bound nodes
        (status ``feasible``); None: no limit. A backend without the option ignores it."""
        return self


def _timeout(name: str, limit: float | None) -> SolverTimeLimitError:
    return SolverTimeLimitError(
        f"{name} found no plan within the time limit of {limit} s",
        fix="raise --time-limit-s (or time_limit_s=), or simplify: fewer models, --max-partitions 2",
    )


# HiGHS options for the planner's MILPs (small models, hundreds to a few thousand columns):
# presolve removes almost nothing there while its reductions steer the search worse, and
# the RINS/RENS sub-MIPs cost time without finding better plans than the other heuristics.
# None of these settings changes the optimum (tests/planner/test_solver_options.py); the
# figures that chose them come from scripts/bench_planner.py.
HIGHS_MIP_OPTIONS: dict[str, object] = {
    "presolve": "off",
    "mip_heuristic_run_rins": False,
    "mip_heuristic_run_rens": False,
}
# Under physical packing (the default formulation) RENS finds better first plans and halves
# the nodes; under the paper's rule it does not pay.
HIGHS_RULE_OPTIONS: dict[str, dict[str, object]] = {"physical": {"mip_heuristic_run_rens": True}, "paper": {}}
# One model alone under the paper's rule with three partitions (1-19 k columns with the
# authors' templates) is where HiGHS's own presolve and sub-MIPs pay: without them some
# such models get no plan at all within 20 s.
HIGHS_SINGLE_PAPER_OPTIONS: dict[str, object] = {"presolve": "on", "mip_heuristic_run_rins": True, "mip_heuristic_run_rens": True}


# The LP relaxation of the planner's MILPs (relaxation()): primal simplex without presolve
# solves it several times faster than HiGHS's default (dual simplex after presolve).
HIGHS_RELAXATION_OPTIONS: dict[str, object] = {"presolve": "off", "simplex_strategy": 4}


class HighsSolver(Solver):
    """HiGHS through highspy, the matrix passed directly (no modelling layer).

    Args:
        options: HiGHS options set before solving MILPs (default
            :data:`HIGHS_MIP_OPTIONS`); LPs (no integer column) use HiGHS defaults.
    """

    name = "highs"
    accepts_prover = True
    accepts_start = True

    def __init__(self, options: dict[str, object] | None = None):
        self.options = dict(HIGHS_MIP_OPTIONS if options is None else options)
        self._default = options is None

    def tuned_for(self, gpu_rule: str, single_model: bool = False) -> "HighsSolver":
        """With the default options, those of :data:`HIGHS_RULE_OPTIONS` for ``gpu_rule`` on
        top (and :data:`HIGHS_SINGLE_PAPER_OPTIONS` for one model under the paper's rule);
        options given by the caller stay as they are."""
        extra = dict(HIGHS_RULE_OPTIONS.get(gpu_rule, {}))
        if single_model and gpu_rule == "paper":
            extra.update(HIGHS_SINGLE_PAPER_OPTIONS)
        if not self._default or not extra:
            return self
        return HighsSolver({**self.options, **extra})

    def with_node_limit(self, max_nodes: int | None) -> "HighsSolver":
        """This solver with HiGHS's ``mip_max_nodes``: a stop at the same point of the search
        on every machine, which the clock is not."""
        if max_nodes is None:
            return self
        return HighsSolver({**self.options, "mip_max_nodes": int(max_nodes)})

    def relaxation(self, milp: Milp, *, time_limit_s: float | None = None) -> SolveResult:
        """The LP relaxation of ``milp`` (integrality dropped), solved with
        :data:`HIGHS_RELAXATION_OPTIONS`; ``objective`` bounds the MILP's optimum."""
        relaxed = replace(milp, col_int=[np.zeros_like(a) for a in milp.col_int])
        return HighsSolver(HIGHS_RELAXATION_OPTIONS).solve(relaxed, time_limit_s=time_limit_s, lp_options=True)

    def solve(self, milp, *, time_limit_s=None, gap=1e-4, threads=None, prover=None, prover_after_polls=0, start=None, stop=None,
              lp_options=False):
        """Solve ``milp``.

        Args:
            start: optional column values of a feasible solution (a MIP start), e.g. the
                split search's plan (:mod:`ppipe.planner.split_search`).
            prover: optional ``prover(T, bound) -> bool`` for a maximization: True means
                it is proven that no solution reaches objective ``T`` (``bound`` is HiGHS's
                current upper bound on the optimum). Asked about each better incumbent
                with ``T = incumbent * (1 + gap)``; a True answer stops the search with the
                incumbent, proven optimal within ``gap``. Column values the prover leaves
                in its ``solution`` attribute (a better plan it found instead of a proof)
                are handed to HiGHS as a new incumbent, and the attribute is cleared. A
                prover whose ``timed_out`` attribute is True (the wall clock stopped it)
                stops the solve, which then ends as a time limit does.
            prover_after_polls: HiGHS's interrupt checks before the prover is first asked,
                so that models HiGHS proves at once pay nothing. The checks come at the
                same points of the search in every run, unlike the clock, so the plan
                does not depend on the machine's speed.
            stop: optional ``stop() -> bool``, asked during branch and bound (without a
                ``prover``): True interrupts the solve, which then ends as a time limit does
                (the price bound's workers stop each other's solves this way).
            lp_options: apply this solver's options to a model without integer columns
                too (by default an LP runs with HiGHS's defaults).
        """
        import highspy

        t0 = time.perf_counter()
        lp, integ = _highs_lp(milp)
        h = new_highs()
        h.setOptionValue("mip_rel_gap", float(gap))
        if time_limit_s is not None:
            h.setOptionValue("time_limit", float(time_limit_s))
        if threads is not None:
            h.setOptionValue("threads", int(threads))
        if integ.any() or lp_options:
            for key, val in self.options.items():
                h.setOptionValue(key, val)
        h.passModel(lp)
        if start is not None and integ.any():
            sol = highspy.HighsSolution()
            sol.col_value = [float(a) for a in start]
            sol.value_valid = True
            h.setSolution(sol)
        if prover is not None and stop is not None:
            raise ValueError("HighsSolver.solve: give a prover or a stop, not both")
        proof = _attach_prover(h, prover, prover_after_polls, gap, milp.sense) if (prover is not None and integ.any()) else None
        if stop is not None and integ.any():
            _attach_stop(h, stop)
        h.run()
        if proof is not None and proof["error"] is not None:
            raise proof["error"]
        st = h.getModelStatus()
        info = h.getInfo()
        secs = time.perf_counter() - t0
        MS = highspy.HighsModelStatus
        has_sol = info.primal_solution_status == 2  # kSolutionStatusFeasible
        work = dict(nodes=int(max(info.mip_node_count, 0)), lp_iterations=int(max(info.simplex_iteration_count, 0)))
        if st == MS.kInfeasible:
            return SolveResult(self.name, "infeasible", None, math.nan, math.inf, secs, **work)
        if st in (MS.kUnbounded, MS.kUnboundedOrInfeasible):
            raise SolverError(f"HiGHS: the model is {h.modelStatusToString(st)} (a planner bug: every variable is bounded)")
        if st == MS.kModelEmpty:
            return SolveResult(self.name, "optimal", np.zeros(milp.num_cols), 0.0, 0.0, secs)
        x = np.array(h.getSolution().col_value) if has_sol else None
        if st == MS.kOptimal and x is not None:
            g = info.mip_gap if integ.any() else 0.0
            return SolveResult(self.name, "optimal", x, float(info.objective_function_value), max(0.0, float(g)), secs, **work)
        if st == MS.kInterrupt and proof is not None and proof["target"] is not None and x is not None:
            # Stopped by the prover: nothing reaches proof["target"] = incumbent (1 + gap).
            obj = float(info.objective_function_value)
            g = max(0.0, proof["target"] / obj - 1.0) if obj > 0 else math.inf
            return SolveResult(self.name, "optimal", x, obj, g, secs, method=proof["method"], **work)
        if st == MS.kSolutionLimit and x is not None:
            # mip_max_nodes (with_node_limit): a work limit, reached at the same point on every machine.
            g = float(info.mip_gap)
            return SolveResult(self.name, "feasible", x, float(info.objective_function_value), g if math.isfinite(g) else math.inf, secs, **work)
        # kObjectiveTarget: stopped at the option objective_target (the price bound sets it).
        if st in (MS.kTimeLimit, MS.kInterrupt, MS.kIterationLimit, MS.kSolutionLimit, MS.kObjectiveBound, MS.kObjectiveTarget):
            if x is None:
                raise _timeout("HiGHS", time_limit_s)
            g = float(info.mip_gap)
            return SolveResult(
                self.name, "time_limit", x, float(info.objective_function_value), g if math.isfinite(g) else math.inf, secs, **work
            )
        raise SolverError(f"HiGHS ended with status '{h.modelStatusToString(st)}'")


def _highs_lp(milp: Milp):
    """(HighsLp, integrality mask) for a Milp: the matrix is passed as is, column-wise."""
    import highspy

    col_lb, col_ub, integ, row_lb, row_ub, cost = milp.arrays()
    start, index, value = milp.csc()
    inf = highspy.kHighsInf
    lp = highspy.HighsLp()
    lp.num_col_ = milp.num_cols
    lp.num_row_ = milp.num_rows
    lp.col_cost_ = cost
    lp.col_lower_ = col_lb
    lp.col_upper_ = np.where(np.isinf(col_ub), inf, col_ub)
    lp.row_lower_ = np.where(np.isinf(row_lb), -inf, row_lb)
    lp.row_upper_ = np.where(np.isinf(row_ub), inf, row_ub)
    lp.sense_ = highspy.ObjSense.kMaximize if milp.sense == "max" else highspy.ObjSense.kMinimize
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = start
    lp.a_matrix_.index_ = index
    lp.a_matrix_.value_ = value
    lp.a_matrix_.num_col_ = milp.num_cols
    lp.a_matrix_.num_row_ = milp.num_rows
    lp.integrality_ = [highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous for i in integ]
    return lp, integ


def _attach_stop(h, stop) -> None:
    """Register a HiGHS callback that interrupts the MIP solve once ``stop()`` is True."""
    import highspy

    cb = highspy.cb

    def callback(kind, _msg, _out, inp, _data):
        if kind == cb.HighsCallbackType.kCallbackMipInterrupt and stop():
            inp.user_interrupt = True

    h.setCallback(callback, None)
    h.startCallback(cb.HighsCallbackType.kCallbackMipInterrupt)


PROVER_MAX_GAP = 0.10  # ask the prover only about incumbents within 10 % of HiGHS's bound


def _attach_prover(h, prover, after_polls: int, gap: float, sense: str) -> dict:
    """Register HiGHS callbacks that ask ``prover`` about each better incumbent (see HighsSolver.solve).

    Every decision here follows HiGHS's search (its incumbents, bounds and interrupt
    checks), never the clock, so that the same model gives the same plan on any machine.
    """
    import highspy

    if sense != "max":
        raise ValueError("a prover needs a maximization")
    cb = highspy.cb
    state = {"target": None, "best": -math.inf, "tried": -math.inf, "polls": 0, "error": None,
             "method": "highs incumbent + " + getattr(prover, "method", "prover")}

    def callback(kind, _msg, out, inp, _data):
        # An exception raised inside HiGHS's callback would end the solve as a bare "Solve
        # error": it is kept, the search stopped, and HighsSolver.solve raises it after run().
        if state["error"] is None:
            try:
                on_event(kind, out, inp)
            except Exception as e:  # noqa: BLE001 - re-raised by the caller
                state["error"] = e
        if state["error"] is not None and kind == cb.HighsCallbackType.kCallbackMipInterrupt:
            inp.user_interrupt = True

    def on_event(kind, out, inp):
        if kind == cb.HighsCallbackType.kCallbackMipImprovingSolution:
            state["best"] = max(state["best"], float(out.objective_function_value))
        elif kind == cb.HighsCallbackType.kCallbackMipUserSolution:
            # A better plan the prover found (it then reports no improving solution: the
            # incumbent is read from the primal bound below).
            if getattr(prover, "solution", None) is not None:
                inp.setSolution(prover.solution)
                prover.solution = None
        elif kind == cb.HighsCallbackType.kCallbackMipInterrupt:
            state["polls"] += 1
            if math.isfinite(out.mip_primal_bound):
                state["best"] = max(state["best"], float(out.mip_primal_bound))
            # Asked here (HiGHS polls this often) rather than on the improvement itself, so
            # that an incumbent found before after_polls is still tried once they have passed.
            # Incumbents more than PROVER_MAX_GAP below HiGHS's bound are not worth a try.
            bound = float(out.mip_dual_bound)
            if (
                state["target"] is None
                and state["best"] > state["tried"]
                and state["best"] > 0
                and state["polls"] > after_polls
                and math.isfinite(bound)
                and bound <= state["best"] * (1.0 + PROVER_MAX_GAP)
            ):
                state["tried"] = state["best"]
                T = state["best"] * (1.0 + gap)
                if prover(T, bound):
                    state["target"] = T
                    state["method"] = "highs incumbent + " + getattr(prover, "method", "prover")
            if state["target"] is not None or getattr(prover, "timed_out", False):
                inp.user_interrupt = True

    h.setCallback(callback, None)
    h.startCallback(cb.HighsCallbackType.kCallbackMipImprovingSolution)
    h.startCallback(cb.HighsCallbackType.kCallbackMipInterrupt)
    h.startCallback(cb.HighsCallbackType.kCallbackMipUserSolution)
    return state


class CbcSolver(Solver):
    """CBC, the binary bundled with PuLP (the model is rebuilt as a PuLP problem)."""

    name = "cbc"

    def solve(self, milp, *, time_limit_s=None, gap=1e-4, threads=None):
        import pulp

        t0 = time.perf_counter()
        col_lb, col_ub, integ, row_lb, row_ub, cost = milp.arrays()
        prob = pulp.LpProblem("ppipe", pulp.LpMaximize if milp.sense == "max" else pulp.LpMinimize)
        # PuLP >= 3.3 attaches variables to the problem (LpVariable(...) alone is deprecated
        # there and goes in 4.0); older PuLP has only the free-standing constructor.
        new_var = getattr(prob, "add_variable", None) or pulp.LpVariable
        xs = [
            new_var(
                f"x{j}",
                None if math.isinf(col_lb[j]) else col_lb[j],
                None if math.isinf(col_ub[j]) else col_ub[j],
                cat=pulp.LpInteger if integ[j] else pulp.LpContinuous,
            )
            for j in range(milp.num_cols)
        ]
        prob += pulp.LpAffineExpression([(xs[j], cost[j]) for j in np.nonzero(cost)[0]])
        r, c, v = milp.coo()
        order = np.argsort(r, kind="stable")
        r, c, v = r[order], c[order], v[order]
        bounds = np.searchsorted(r, np.arange(milp.num_rows + 1))
        for i in range(milp.num_rows):
            a, b = bounds[i], bounds[i + 1]
            expr = pulp.LpAffineExpression([(xs[c[k]], v[k]) for k in range(a, b)])
            if row_lb[i] == row_ub[i]:
                prob += expr == row_lb[i]
                continue
            if not math.isinf(row_lb[i]):
                prob += expr >= row_lb[i]
            if not math.isinf(row_ub[i]):
                prob += expr <= row_ub[i]
        cmd = pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, gapRel=gap, threads=threads)
        prob.solve(cmd)
        secs = time.perf_counter() - t0
        # sol_status: 1 optimal, 2 feasible (stopped early), 0 none found, -1 infeasible, -2 unbounded.
        ss = prob.sol_status
        if ss == pulp.LpSolutionInfeasible or prob.status == pulp.LpStatusInfeasible:
            return SolveResult(self.name, "infeasible", None, math.nan, math.inf, secs)
        if ss == pulp.LpSolutionNoSolutionFound:
            raise _timeout("CBC", time_limit_s)
        if ss not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
            raise SolverError(f"CBC ended with status '{pulp.LpStatus.get(prob.status, prob.status)}'")
        x = np.array([xj.varValue or 0.0 for xj in xs])
        obj = float(cost @ x)
        if ss == pulp.LpSolutionOptimal:
            return SolveResult(self.name, "optimal", x, obj, 0.0, secs)
        # PuLP does not pass CBC's bound back, so the gap of an early stop is unknown.
        return SolveResult(self.name, "time_limit", x, obj, math.inf, secs)


class GurobiSolver(Solver):
    """Gurobi through gurobipy's matrix API; falls back to HiGHS if the licence refuses the model.

    The pip wheel of gurobipy carries a size-limited licence (at most 2000 variables and
    2000 constraints): small plans (e.g. one model on two GPU types, or the NP plan) run on
    Gurobi, larger ones are refused (error 10010) and solved by :class:`HighsSolver`
    instead, with one warning. Without any licence (10009) the same happens.
    """

    name = "gurobi"
    accepts_prover = True  # passed on to HiGHS when the licence refuses the model
    accepts_start = True

    def __init__(self, fallback: HighsSolver | None = None, node_limit: int | None = None):
        self.fallback = fallback or HighsSolver()
        self.node_limit = node_limit

    def tuned_for(self, gpu_rule: str, single_model: bool = False) -> "GurobiSolver":
        """Gurobi with its defaults; the HiGHS fallback tuned for ``gpu_rule``."""
        return GurobiSolver(self.fallback.tuned_for(gpu_rule, single_model), self.node_limit)

    def with_node_limit(self, max_nodes: int | None) -> "GurobiSolver":
        """Gurobi's ``NodeLimit`` (and the fallback's node limit)."""
        return GurobiSolver(self.fallback.with_node_limit(max_nodes), max_nodes)

    def solve(self, milp, *, time_limit_s=None, gap=1e-4, threads=None, prover=None, prover_after_polls=0, start=None):
        """Solve ``milp``; ``start`` is a MIP start, ``prover``/``prover_after_polls`` only serve the HiGHS fallback (see :meth:`HighsSolver.solve`)."""
        try:
            import gurobipy as gp
            from gurobipy import GRB
        except ImportError:
            raise NotAvailableError(
                "the Gurobi solver needs gurobipy, which is not installed",
                fix="pip install 'ppipe[gurobi]' (and a Gurobi licence), or use --solver highs",
            ) from None
        import scipy.sparse as sp

        t0 = time.perf_counter()
        col_lb, col_ub, integ, row_lb, row_ub, cost = milp.arrays()
        r, c, v = milp.coo()
        A = sp.csr_matrix((v, (r, c)), shape=(milp.num_rows, milp.num_cols))
        env = m = None
        try:
            # OutputFlag in the Env's own parameters keeps its licence banner off stdout too.
            env = gp.Env(params={"OutputFlag": 0})
            m = gp.Model("ppipe", env=env)
            x = m.addMVar(milp.num_cols, lb=col_lb, ub=col_ub, vtype=np.where(integ, GRB.INTEGER, GRB.CONTINUOUS))
            has_ub = ~np.isinf(row_ub)
            has_lb = ~np.isinf(row_lb)
            if has_ub.any():
                m.addMConstr(A[has_ub], x, GRB.LESS_EQUAL, row_ub[has_ub])
            if has_lb.any():
                m.addMConstr(A[has_lb], x, GRB.GREATER_EQUAL, row_lb[has_lb])
            m.setObjective(cost @ x, GRB.MAXIMIZE if milp.sense == "max" else GRB.MINIMIZE)
            m.Params.MIPGap = gap
            if time_limit_s is not None:
                m.Params.TimeLimit = time_limit_s
            if threads is not None:
                m.Params.Threads = threads
            if self.node_limit is not None:
                m.Params.NodeLimit = self.node_limit
            if start is not None and integ.any():
                x.Start = np.asarray(start, dtype=float)
            m.optimize()
            secs = time.perf_counter() - t0
            st = m.Status
            is_mip = bool(integ.any())
            work = dict(
                nodes=int(m.NodeCount) if is_mip else 0,
                lp_iterations=int(m.IterCount),
            )
            if st in (GRB.INFEASIBLE, GRB.INF_OR_UNBD):
                return SolveResult(self.name, "infeasible", None, math.nan, math.inf, secs, **work)
            if st == GRB.OPTIMAL:
                g = float(m.MIPGap) if is_mip else 0.0
                return SolveResult(self.name, "optimal", np.array(x.X), float(m.ObjVal), max(0.0, g), secs, **work)
            if st in (GRB.TIME_LIMIT, GRB.INTERRUPTED, GRB.SOLUTION_LIMIT, GRB.NODE_LIMIT):
                if m.SolCount == 0:
                    raise _timeout("Gurobi", time_limit_s)
                g = float(m.MIPGap) if is_mip else 0.0
                return SolveResult(self.name, "feasible" if st == GRB.NODE_LIMIT else "time_limit", np.array(x.X), float(m.ObjVal), g if math.isfinite(g) else math.inf, secs, **work)
            raise SolverError(f"Gurobi ended with status code {st}")
        except gp.GurobiError as exc:
            if getattr(exc, "errno", None) in (GUROBI_NO_LICENSE, GUROBI_SIZE_LIMIT):
                warnings.warn(f"Gurobi refused the model ({exc}); solving with HiGHS instead", stacklevel=2)
                return self.fallback.solve(
                    milp, time_limit_s=time_limit_s, gap=gap, threads=threads, prover=prover, prover_after_polls=prover_after_polls, start=start
                )
            raise SolverError(f"Gurobi failed: {exc}") from None
        finally:
            # Free the licence token and the model now rather than at garbage collection.
            if m is not None:
                m.dispose()
            if env is not None:
                env.dispose()


GUROBI_NO_LICENSE = 10009
GUROBI_SIZE_LIMIT = 10010
