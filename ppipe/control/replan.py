"""Re-planning as a control loop: when the model mix shifts, make and hand over a better plan.

A max-min plan made for weights ``w`` gives model ``m`` a capacity ``x_m`` (req/s,
``ModelPlan.throughput_rps``) with ``x_m >= w_m z``. When the mix moves, the capacity sits
in the wrong pools: one model's queue overflows while other pools idle. The controller
watches the arrivals and decides when a new plan is worth a switch; the driver (simulator
or runtime) builds the new plan's workers and scheduler and hands over
(:class:`ppipe.dataplane.handover.SwitchingScheduler`).

Estimate
--------
Arrivals are counted per model in bins of ``bin_s`` seconds. At a check at time ``t`` the
complete bins of the last ``window_s`` seconds -- fewer in the first ``window_s`` seconds:
those since the controller started -- give a least-squares fit through the counts (bin
centres ``tau``, ``x = tau - tau_bar``)

    ``c(tau) = alpha + beta x + gamma (x^2 - m_2)``,   ``m_2 = S_xx / n``,

in orthogonal terms (the centres are symmetric about ``tau_bar``, so ``1``, ``x`` and
``x^2 - m_2`` are orthogonal over them and each coefficient is a plain projection:
``alpha`` the mean count, ``beta = sum x c / S_xx``, ``gamma = sum (x^2 - m_2) c / S_qq``
with ``S_xx = sum x^2`` and ``S_qq = sum (x^2 - m_2)^2``). The curvature term ``gamma`` is
fitted only once the bins span ``curvature_min_s`` seconds (else ``gamma = 0``: a line).
With ``d = t - tau_bar`` this gives

* the current rate   ``r_m = (alpha + beta' d + gamma' (d^2 - m_2)) / bin_s``,
* its trend          ``g_m = (beta' + 2 gamma' d) / bin_s``   (req/s per s),
* its curvature      ``k_m = 2 gamma' / bin_s``   (req/s per s^2),
* the rate to plan for, the peak over the coming ``horizon_s = H`` (a plan has to last at
  least until the next switch is allowed):
  ``p_m = max(max_{0 <= u <= H} r_m + g_m u + k_m u^2 / 2, 0)`` (with ``k_m = 0``:
  ``max(r_m, r_m + g_m H, 0)``),

where ``beta'`` is the slope shrunk towards 0 by ``confidence_z`` standard errors,
``beta' = sign(beta) max(|beta| - confidence_z se(beta), 0)`` (0 unless significant), and
``gamma'`` the curvature shrunk likewise by ``curvature_z`` standard errors.
Counts are Poisson, so ``var(c) ~ alpha``, ``se(beta) = sqrt(alpha / S_xx)`` and
``se(gamma) = sqrt(alpha / S_qq)``. ``S_xx`` grows as ``n^3`` and ``S_qq`` as ``n^5``:
over a few seconds the slope is mostly noise, and ``H`` would multiply that noise into the
plan's weights (the curvature's noise by ``H^2``, hence its longer least span). ``p_m`` is
the fit's value at the ``u`` where the peak is reached (``u = t`` for a falling or flat
rate), with the standard error
``e_m = sqrt(alpha (1 / n + (u - tau_bar)^2 / S_xx + ((u - tau_bar)^2 - m_2)^2 / S_qq)) / bin_s``
(the second term only where the slope is used, the third only where the curvature is).

The curvature has its own, longer window, ``curvature_window_s`` (``W_c``, 120 s; ``None``:
``window_s``): ``gamma`` is then the same projection over the complete bins of the last
``W_c`` seconds (its own ``tau_bar``, ``m_2`` and ``S_qq``), while ``alpha`` and ``beta``
stay the window's. As ``x^2 - m_2`` is orthogonal to ``1`` and ``x`` over the window, the
window's ``alpha`` and ``beta`` are those of a fit with any ``gamma``, so the composite is
the window's fit with the longer window's curvature. The reason is the noise: ``S_qq``
grows as ``n^5``, so twice the span cuts ``se(gamma)`` by ~5.7 and the curvature's share
of ``e_m`` (``((u - tau_bar)^2 - m_2)^2 se(gamma)^2``) by ~32; over 60 s the curvature of a
rate that turns within minutes is about as large as its own ``2 se``, so shrinking by
``curvature_z`` leaves little of it. The price is the curvature's lag: it is the average
over ``W_c``, which lags a curvature that itself changes (a rate that turns over minutes,
not seconds). ``e_m``'s third term then uses ``se(gamma)`` of the longer window and the
window's ``m_2`` (the windows overlap; their covariance is neglected).

Why a curvature: a line extrapolates the slope at the window's centre, which lags a
turning rate. A model at the bottom of its share has a flat line but will rise: over the
issue's shifting mix (share ``1/3 + 0.2 sin(2 pi t / 10 min + ...)``, ``H = 70 s``) a
model leaving its trough rises by ~40 % of its rate within one plan's life, which a line
plans as ~0 and the plan then misses at its end.

The first check runs ``warmup_s`` (at most ``window_s``) after the start, on the bins
since the start, so that a mix the starting plan does not fit is re-planned from the first
observations rather than after a whole window. Few bins give a noisy level, hence the
trigger's confidence rule below: at a high rate a few seconds suffice; at a low one the
trigger waits for more.

A fit over the window, rather than the window's mean, removes the mean's lag of
``window_s / 2`` behind a moving rate; ``H`` looks ahead as far as the plan must hold.

Decide
------
With ``p`` as weights, the value of a plan is ``Z(plan) = min_m x_m / p_m``: the factor by
which every model's planned-for rate could grow before one exceeds its capacity (the
max-min objective under the observed weights; ``Z >= 1``: every model fits). A check

1. **triggers** when some model's planned-for rate passes ``trigger_load`` (90 %) of its
   capacity, with confidence: ``Z_lo(current) < 1 / trigger_load``, ``Z_lo`` being ``Z``
   under ``max(p_m - confidence_z e_m, 0)`` (noise alone seldom triggers a re-plan);
2. is **allowed** when ``min_interval_s`` (60 s) have passed since the last switch, and
   the mix moved by ``retry_shift`` (in share, max over models) since the last re-plan
   that was not applied, or ``min_interval_s`` passed since it (hysteresis: a mix the
   planner could not improve on is not re-planned at every check; a re-plan that came
   back worse than the current plan, a time-limited solve on a busy host, sets none);
3. **re-plans** through the injected ``replan(weights) -> Plan`` (the planner with a time
   limit) with ``weights = p / sum(p)`` (each floored at ``min_share`` of the total so
   that a model with no traffic for a while keeps some capacity), and, where ``replan``
   takes a ``warm_start`` keyword (:func:`planner_replan`'s does), the plan being served
   as its warm start: the planner then starts from that plan's configurations and pools
   (:func:`ppipe.planner.api.plan`, ``warm_start``), and
4. **switches** when ``Z(new) >= (1 + min_gain) Z(current)`` (10 %): the driver applies
   the returned :class:`ReplanDecision`.

The controller takes the decision's plan as current at once (the driver may start it
after a load delay; the old plan serves meanwhile).

Determinism: the decisions are a function of the arrivals fed, the check times and the
plans ``replan`` returns (a warm start is one more input of the planner: the same served
plan and weights give the same new plan). The planner's time limit is the one wall-clock dependence: a
MILP stopped by its limit may return a different plan on a slower or busier host (then
so may the decisions after it). :attr:`ReplanDecision.planner_s` is measured on the wall
clock for the report and is never read by a decision.
"""

from __future__ import annotations

import inspect
import math
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol

from ppipe.errors import UserError


class Clock(Protocol):
    """Time source (us): the data plane's clock has this method."""

    def now_us(self) -> float: ...


@dataclass(frozen=True)
class ReplanPolicy:
    """Tunables of :class:`ReplanController` (module docstring: "Estimate", "Decide").

    Attributes:
        window_s: estimation window.
        bin_s: arrival-count bin width.
        warmup_s: time from the start to the first check (its estimate uses the bins since
            the start); ``None`` or more than ``window_s``: ``window_s``.
        confidence_z: the slope is shrunk towards 0, and the trigger's rates are lowered, by
            this many standard errors; 0 = neither.
        curvature_min_s: the least span of bins (s) whose fit has a curvature term;
            ``None``: a line always.
        curvature_z: the curvature is shrunk towards 0 by this many standard errors.
        curvature_window_s: the window of the curvature's fit (the bins since the start while
            fewer); ``None``: ``window_s``.
        horizon_s: look-ahead ``H`` of the planned-for rate; ``None`` = ``min_interval_s``
            plus ``load_delay_s``.
        check_every_s: how often a check runs.
        trigger_load: a model whose planned-for rate passes this share of its capacity triggers.
        min_gain: a new plan is applied if it raises ``Z`` by at least this share.
        min_interval_s: least time between two switches.
        retry_shift: after a re-plan that was not applied, the shift in share (max over
            models) that allows another before ``min_interval_s``.
        min_share: floor of each model's weight, as a share of the total.
        load_delay_s: time the driver needs to load a new plan's workers (for ``H`` only).
    """

    window_s: float = 60.0
    bin_s: float = 1.0
    warmup_s: float | None = 5.0
    confidence_z: float = 2.0
    curvature_min_s: float | None = 30.0
    curvature_z: float = 2.0
    curvature_window_s: float | None = 120.0
    horizon_s: float | None = None
    check_every_s: float = 5.0
    trigger_load: float = 0.9
    min_gain: float = 0.10
    min_interval_s: float = 60.0
    retry_shift: float = 0.03
    min_share: float = 0.01
    load_delay_s: float = 0.0

    def __post_init__(self):
        checks = [
            (self.window_s >= 2 * self.bin_s > 0, "window_s must be >= 2 x bin_s > 0", "e.g. window_s=60, bin_s=1"),
            (self.check_every_s > 0, "check_every_s must be > 0", "e.g. check_every_s=5"),
            (0 < self.trigger_load <= 1, "trigger_load must be in (0, 1]", "e.g. trigger_load=0.9"),
            (self.min_gain >= 0, "min_gain must be >= 0", "e.g. min_gain=0.1"),
            (self.min_interval_s >= 0 and self.load_delay_s >= 0, "min_interval_s and load_delay_s must be >= 0", "e.g. 60 and 0"),
            (0 <= self.min_share < 1, "min_share must be in [0, 1)", "e.g. min_share=0.01"),
            (self.horizon_s is None or self.horizon_s >= 0, "horizon_s must be >= 0", "or None (the default)"),
            (self.warmup_s is None or self.warmup_s >= 2 * self.bin_s, "warmup_s must be >= 2 x bin_s", "e.g. warmup_s=5, or None (= window_s)"),
            (self.confidence_z >= 0, "confidence_z must be >= 0", "e.g. confidence_z=2"),
            (self.curvature_z >= 0, "curvature_z must be >= 0", "e.g. curvature_z=2"),
            (self.curvature_window_s is None or self.curvature_window_s >= 3 * self.bin_s, "curvature_window_s must be >= 3 x bin_s",
             "e.g. curvature_window_s=120, or None (= window_s)"),
            (self.curvature_min_s is None or self.curvature_min_s >= 3 * self.bin_s, "curvature_min_s must be >= 3 x bin_s",
             "e.g. curvature_min_s=30, or None (a line)"),
        ]
        for ok, what, fix in checks:
            if not ok:
                raise UserError(f"re-plan policy: {what}", fix=fix)

    @property
    def curvature_window(self) -> float:
        return self.window_s if self.curvature_window_s is None else self.curvature_window_s

    @property
    def horizon(self) -> float:
        return self.min_interval_s + self.load_delay_s if self.horizon_s is None else self.horizon_s


@dataclass(frozen=True)
class ReplanDecision:
    """A switch to apply (or, in :attr:`ReplanController.attempts`, a re-plan not applied).

    Attributes:
        at_us: the check's time.
        plan: the new plan.
        weights: the weights given to the planner (sum 1).
        rate_rps: each model's estimated current rate ``r_m``.
        planned_for_rps: each model's planned-for rate ``p_m``.
        z_old: ``Z(current plan)`` under ``p``.
        z_new: ``Z(new plan)`` under ``p``.
        trigger: the model furthest over ``trigger_load`` of its capacity.
        planner_s: wall time of the ``replan`` call (report only).
        kept: vGPUs of the new plan that the current one has unchanged
            (:func:`kept_placements`); ``total``: the new plan's vGPUs.
        applied: whether it is a switch.
    """

    at_us: float
    plan: Any
    weights: dict[str, float]
    rate_rps: dict[str, float]
    planned_for_rps: dict[str, float]
    z_old: float
    z_new: float
    trigger: str
    planner_s: float
    kept: int
    total: int
    applied: bool


def _basis(ks: range, b: float) -> tuple[int, float, list[float], float, float, list[float], float]:
    """Over the bins ``ks`` of width ``b``: ``(n, tau_bar, x, S_xx, m_2, q, S_qq)`` with ``x = tau - tau_bar``
    and ``q = x^2 - m_2`` per bin (module docstring, "Estimate")."""
    n = len(ks)
    tau_bar = (ks.start + ks.stop) / 2 * b  # the mean of the bin centres (k + 0.5) b
    xs = [(k + 0.5) * b - tau_bar for k in ks]
    sxx = sum(x * x for x in xs)
    m2 = sxx / n
    qs = [x * x - m2 for x in xs]  # (orthogonal to 1 and x: the centres are symmetric about tau_bar)
    return n, tau_bar, xs, sxx, m2, qs, sum(q * q for q in qs)


def _peak(r: float, g: float, k: float, h: float) -> tuple[float, float]:
    """``(max, argmax)`` over ``u`` in ``[0, h]`` of ``r + g u + k u^2 / 2`` (ties: the earliest ``u``)."""
    best, at = r, 0.0
    end = r + g * h + 0.5 * k * h * h
    if end > best:
        best, at = end, h
    if k < 0.0 and 0.0 < -g / k < h:
        u = -g / k
        top = r + g * u + 0.5 * k * u * u
        if top > best:
            best, at = top, u
    return best, at


def plan_value(plan: Any, rates: Mapping[str, float]) -> float:
    """``Z = min_m x_m / p_m`` over the models with ``p_m > 0`` (``inf`` if none; 0 if a model lacks capacity)."""
    cap = {m.name: m.throughput_rps for m in plan.models}
    return min((cap.get(m, 0.0) / p for m, p in rates.items() if p > 0), default=math.inf)


def _identity(plan: Any) -> dict[str, tuple]:
    """vGPU id -> what its worker is (server, GPU, slot, level, model, blocks): as the data plane's ``vgpu_identity``."""
    out = {}
    for p in plan.placement:
        part = plan.model(p.model).pipelines[p.pipeline].partitions[p.partition]
        out[p.vgpu_id] = (p.server, p.gpu_index, p.slot, p.vgpu, p.model, part.first_block, part.last_block)
    return out


def kept_placements(old: Any, new: Any) -> tuple[int, int]:
    """``(kept, total)``: the new plan's vGPUs whose worker the old plan has unchanged, and all of them."""
    a, b = _identity(old), _identity(new)
    return sum(1 for v, ident in b.items() if a.get(v) == ident), len(b)


@dataclass
class _Attempt:
    at_us: float
    shares: dict[str, float]


class ReplanController:
    """Watches arrivals; on :meth:`poll`, returns a :class:`ReplanDecision` when a switch is due.

    Args:
        plan: the plan being served.
        replan: ``replan(weights) -> Plan``: plans the same models and cluster for the weights
            (``{model: w}``, sum 1), e.g. :func:`planner_replan`. It may raise
            :class:`~ppipe.errors.UserError` (e.g. infeasible): the check then keeps the plan.
        clock: ``now_us()``; the simulator's virtual clock or the runtime's wall clock.
        policy: tunables.
        estimator: ``estimator(now_us) -> (r, g, e)`` in place of the arrival counts'
            :meth:`estimate_with_error` (``None``, the default). For a bound only: a
            benchmark's oracle that knows the workload's true rates (``e`` all 0).

    Where ``replan`` takes a ``warm_start`` keyword, each re-plan passes the plan being
    served (:attr:`plan`) as that warm start.

    Drivers call :meth:`observe` for every arrival (its time may precede ``now``) and
    :meth:`poll` often (each arrival is fine: it returns at once between checks). A check
    that re-plans calls ``replan`` synchronously (up to its time limit): a driver on an
    event loop runs :meth:`poll` off it when ``clock.now_us() >= next_check_us``. A
    decision is taken as applied; :meth:`refused` undoes it.
    """

    def __init__(self, plan: Any, replan: Callable[[dict[str, float]], Any], clock: Clock, policy: ReplanPolicy = ReplanPolicy(),
                 estimator: Callable[[float], tuple[dict, dict, dict]] | None = None):
        self.plan = plan
        self._estimator = estimator or self.estimate_all
        self.models = [m.name for m in plan.models]
        self._replan = replan
        self._warm = takes_warm_start(replan)
        self.clock = clock
        self.policy = policy
        self._bins: dict[str, dict[int, int]] = {m: defaultdict(int) for m in self.models}
        self._start_us = clock.now_us()
        self._first_bin = math.ceil(self._start_us / (policy.bin_s * 1e6))  # the first complete bin
        self._seen_traffic = False  # (observe: an idle lead-in before the first arrival is not counted)
        self.next_check_us = self._start_us + min(policy.window_s, policy.warmup_s or math.inf) * 1e6
        self._last_switch_us = -math.inf
        self._last_attempt: _Attempt | None = None
        self._previous: Any = None  # the plan before the last decision (refused() restores it)
        self.decisions: list[ReplanDecision] = []
        self.attempts: list[ReplanDecision] = []

    def observe(self, model: str, t_us: float) -> None:
        """One arrival of ``model`` at ``t_us`` (models the plan does not serve are ignored).

        The first arrival later than the controller's first bin starts the estimate anew:
        a server that waited idle before its traffic began has seen no trend, and counting
        its empty bins would read the start of the traffic as a steep rise (the warm-up's
        first check would then plan for a multiple of the real rate).
        """
        bins = self._bins.get(model)
        if bins is None:
            return
        if not self._seen_traffic:
            self._seen_traffic = True
            bin_us = self.policy.bin_s * 1e6
            if t_us >= (self._first_bin + 1) * bin_us:
                self._start_us = t_us
                self._first_bin = math.ceil(t_us / bin_us)
                self.next_check_us = max(self.next_check_us,
                                         t_us + min(self.policy.window_s, self.policy.warmup_s or math.inf) * 1e6)
        bins[int(t_us // (self.policy.bin_s * 1e6))] += 1

    def estimate(self, now_us: float) -> tuple[dict[str, float], dict[str, float]]:
        """``(r, g)``: each model's current rate (req/s) and trend (req/s per s) (module docstring)."""
        rate, trend, _ = self.estimate_with_error(now_us)
        return rate, trend

    def estimate_with_error(self, now_us: float) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
        """``(r, g, e)``: :meth:`estimate` and the standard error ``e_m`` (req/s) of each
        planned-for rate :meth:`planned_for` makes of them (module docstring)."""
        rate, trend, err, _ = self.estimate_all(now_us)
        return rate, trend, err

    def estimate_all(self, now_us: float) -> tuple[dict[str, float], dict[str, float], dict[str, float], dict[str, float]]:
        """``(r, g, e, k)``: :meth:`estimate_with_error` and each model's curvature ``k_m``
        (req/s per s^2; 0 where the window is shorter than ``curvature_min_s`` or the
        curvature is not significant) (module docstring, "Estimate")."""
        p = self.policy
        b = p.bin_s
        z = p.confidence_z
        last = int(now_us // (b * 1e6))  # the bin now filling: not complete
        first = min(self._first_bin, last - 2)
        ks = range(max(last - int(round(p.window_s / b)), first), last)
        n, tau_bar, xs, sxx, m2, _, _ = _basis(ks, b)
        kc = range(max(last - int(round(p.curvature_window / b)), first), last)  # the curvature's bins
        nc, _, _, _, _, qs, sqq = _basis(kc, b)
        curved = p.curvature_min_s is not None and nc * b >= p.curvature_min_s and sqq > 0
        d = now_us / 1e6 - tau_bar
        h = p.horizon
        rate, trend, err, curv = {}, {}, {}, {}
        for m, bins in self._bins.items():
            counts = [bins.get(k, 0) for k in ks]
            alpha = sum(counts) / n
            var = max(alpha, 1.0)  # Poisson counts
            beta = sum(x * c for x, c in zip(xs, counts)) / sxx
            beta = math.copysign(max(abs(beta) - z * math.sqrt(var / sxx), 0.0), beta)  # shrunk (module docstring)
            gamma = 0.0
            if curved:
                cc = [bins.get(k, 0) for k in kc]
                var_c = max(sum(cc) / nc, 1.0)
                gamma = sum(q * c for q, c in zip(qs, cc)) / sqq
                gamma = math.copysign(max(abs(gamma) - p.curvature_z * math.sqrt(var_c / sqq), 0.0), gamma)
            r = max(0.0, (alpha + beta * d + gamma * (d * d - m2)) / b)
            g = (beta + 2.0 * gamma * d) / b
            k = 2.0 * gamma / b
            rate[m], trend[m], curv[m] = r, g, k
            lead = d + _peak(r, g, k, h)[1]  # where the planned-for rate is read, from tau_bar
            e2 = 1.0 / n
            if beta != 0.0:
                e2 += lead * lead / sxx
            err2 = var * e2
            if gamma != 0.0:
                err2 += var_c * (lead * lead - m2) ** 2 / sqq
            err[m] = math.sqrt(err2) / b
            for k_old in [k_old for k_old in bins if k_old < min(ks.start, kc.start)]:
                del bins[k_old]  # older than both windows: never read again
        return rate, trend, err, curv

    def planned_for(self, rate: Mapping[str, float], trend: Mapping[str, float],
                    curvature: Mapping[str, float] | None = None) -> dict[str, float]:
        """``p_m = max(max_{0 <= u <= H} r_m + g_m u + k_m u^2 / 2, 0)`` (``k_m = 0`` if not given:
        ``max(r_m, r_m + g_m H, 0)``)."""
        h = self.policy.horizon
        return {m: max(_peak(rate[m], trend[m], curvature.get(m, 0.0) if curvature else 0.0, h)[0], 0.0) for m in rate}

    def poll(self) -> ReplanDecision | None:
        """Run a check if one is due; a decision to apply, or None."""
        now = self.clock.now_us()
        if now < self.next_check_us:
            return None
        self.next_check_us = now + self.policy.check_every_s * 1e6
        est = self._estimator(now)
        rate, trend, err = est[0], est[1], est[2]
        peak = self.planned_for(rate, trend, est[3] if len(est) > 3 else None)
        total = sum(peak.values())
        if total <= 0:
            return None
        sure = {m: max(v - self.policy.confidence_z * err[m], 0.0) for m, v in peak.items()}
        if plan_value(self.plan, sure) >= 1.0 / self.policy.trigger_load or not self._allowed(now, peak, total):
            return None
        z_old = plan_value(self.plan, peak)
        return self._replan_and_decide(now, rate, peak, total, z_old)

    def _allowed(self, now: float, peak: Mapping[str, float], total: float) -> bool:
        """Minimum interval since the last switch; hysteresis after a re-plan that was not applied."""
        p = self.policy
        if now - self._last_switch_us < p.min_interval_s * 1e6:
            return False
        a = self._last_attempt
        if a is None or now - a.at_us >= p.min_interval_s * 1e6:
            return True
        return max(abs(peak[m] / total - a.shares.get(m, 0.0)) for m in peak) >= p.retry_shift

    def weights(self, peak: Mapping[str, float], total: float) -> dict[str, float]:
        """``max(p_m, min_share x total)``, normalized to sum 1."""
        w = {m: max(v, self.policy.min_share * total) for m, v in peak.items()}
        s = sum(w.values())
        return {m: v / s for m, v in w.items()}

    def _replan_and_decide(self, now: float, rate, peak, total: float, z_old: float) -> ReplanDecision | None:
        weights = self.weights(peak, total)
        t0 = time.perf_counter()  # report only (module docstring, "Determinism")
        try:
            new = self._replan(weights, warm_start=self.plan) if self._warm else self._replan(weights)
        except UserError:
            new = None
        planner_s = time.perf_counter() - t0
        self._last_attempt = _Attempt(now, {m: v / total for m, v in peak.items()})
        if new is None:
            return None
        z_new = plan_value(new, peak)
        kept, n = kept_placements(self.plan, new)
        trigger = min(peak, key=lambda m: (self._capacity(m) / peak[m]) if peak[m] > 0 else math.inf)
        applied = z_new >= (1.0 + self.policy.min_gain) * z_old
        d = ReplanDecision(now, new, weights, dict(rate), dict(peak), z_old, z_new, trigger, planner_s, kept, n, applied)
        self.attempts.append(d)
        if z_new < z_old:
            # Worse than the plan being served, which is itself a plan for these rates: a
            # solve stopped by its time limit on a poor incumbent (a busy host), not a mix
            # the planner cannot improve on. No hysteresis: the next check may try again.
            self._last_attempt = None
        if not applied:
            return None
        self._previous = self.plan
        self.plan, self._last_switch_us, self._last_attempt = new, now, None
        self.decisions.append(d)
        return d

    def refused(self, decision: ReplanDecision) -> None:
        """The driver could not apply ``decision`` (e.g. the plan does not fit the running
        cluster): the plan before it is current again. The minimum interval still counts
        from the decision, so a refused plan is not retried at the next check."""
        if self.decisions and self.decisions[-1] is decision and self._previous is not None:
            self.plan, self._previous = self._previous, None
            self.decisions.pop()

    def _capacity(self, model: str) -> float:
        return self.plan.model(model).throughput_rps


# The relative gap of a re-plan's MILP. A plan is switched to only where it raises Z by
# ReplanPolicy.min_gain (10 %), so a plan proven within 1 % of the best loses at most
# 1 % of Z, while proving 0.01 % (the planner's default) costs a 1,000-GPU fleet thousands
# of branch-and-bound nodes.
REPLAN_GAP = 0.01


def takes_warm_start(replan: Callable) -> bool:
    """Whether ``replan`` accepts a ``warm_start`` keyword (then the controller passes it)."""
    try:
        params = inspect.signature(replan).parameters
    except (TypeError, ValueError):  # a callable without a signature (a builtin)
        return False
    return "warm_start" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def planner_replan(plan: Any, profiles: Mapping[str, Any], cluster: Any, *, time_limit_s: float = 1.5,
                   gap: float = REPLAN_GAP) -> Callable[..., Any]:
    """``replan(weights, warm_start=plan)`` that calls the planner with ``plan``'s settings,
    SLOs and models, new weights, and ``warm_start`` as the served plan.

    The planner's ``time_limit_s`` bounds each call, ``gap`` is its MILP's relative gap
    (:data:`REPLAN_GAP`). Headroom is as ``plan`` had it (``settings.headroom_util``).
    ``warm_start`` defaults to ``plan`` itself: a driver that makes a ``planner_replan``
    from the served plan for each re-plan gets that plan as the warm start without passing
    it; :class:`ReplanController` passes the plan it holds as served. The planner uses it
    where it plans by column generation (:mod:`ppipe.planner.colgen`: its configurations
    start the pricing, its pools are a start of the MILP); elsewhere it changes nothing.
    The new plan's GPUs are then renamed to keep as many of ``warm_start``'s workers as
    can stay (:func:`ppipe.planner.placement.keep_live_plan`), the renaming ``ppipe
    serve``'s plan switches do: ``ppipe simulate --replan auto`` keeps the same vGPUs.

    Raises:
        UserError: ``plan`` was not made with the max-min objective (weights mean nothing to
            another objective).
    """
    s = plan.settings
    if s.objective != "max-min":
        raise UserError(
            f"re-planning needs a plan made with the max-min objective; this one used '{s.objective}'",
            fix="plan with --objective max-min, or serve without --replan",
        )
    models = [profiles[m.name] for m in plan.models]
    slo = {m.name: m.slo_ms for m in plan.models}
    headroom = s.headroom_util if s.headroom_util is not None else False

    def replan(weights: dict[str, float], warm_start: Any = plan):
        from ppipe.planner.api import plan as make_plan
        from ppipe.planner.placement import keep_live_plan

        new = make_plan(
            cluster, models, objective="max-min", planner=s.planner, formulation=s.formulation, gpu_rule=s.gpu_rule,
            configs_per_template=s.configs_per_template, batch_build=s.batch_build, slo_ms=slo,
            weights={m: weights[m] for m in slo}, margin=s.margin, max_partitions=s.max_partitions,
            time_limit_s=time_limit_s, gap=gap, headroom=headroom, warm_start=warm_start,
        )
        return keep_live_plan(new, warm_start, cluster) if warm_start is not None else new

    return replan
