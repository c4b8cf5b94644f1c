"""``ppipe simulate``: a plan under a virtual clock -- one load factor, or a sweep.

A thin layer over :mod:`ppipe.sim.sweep`: reads plan.yaml (profiles from each model's
``profile`` path, relative to plan.yaml; the cluster from ``--cluster``, the plan's
``cluster_file`` or the built-in named by ``cluster``), runs, prints a summary, and
optionally writes JSON and PNG figures.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from ppipe.dataplane.margins import DEFAULT_ANSWER_BUDGET_US, DEFAULT_DISPATCH_LEAD_US, DEFAULT_WAKE_LEAD_US
from ppipe.dataplane.feedback import DEFAULT_REPORT_TOLERANCE_US, EXACT_US
from ppipe.errors import UserError


def _policies() -> list[str]:
    try:
        from ppipe.dataplane import POLICIES
    except ImportError:  # the data plane sub-package is absent: the simulator will say so when it runs
        return []
    return sorted(POLICIES)


def _serving_margins(plan, profiles, spec, policy: str, lead_ms: float, budget_ms: float, wake_ms: float) -> dict:
    """The data-plane options of the runtime's margins and wake lead (none when both margins
    are 0: the paper's data plane); warns where a model's plan cannot hold them (`ppipe
    serve` refuses such a plan)."""
    from ppipe.dataplane.margins import check_margins, service_margins, simulated_serving_options
    from ppipe.dataplane.options import SchedulerOptions

    if lead_ms < 0 or budget_ms < 0 or wake_ms < 0:
        raise UserError(f"--dispatch-lead-ms, --answer-budget-ms and --wake-lead-ms must be >= 0, got {lead_ms}, {budget_ms} and {wake_ms}",
                        fix="use 0 (the paper's data plane) or a few ms")
    if lead_ms == 0 and budget_ms == 0:
        return {}
    if policy == "reactive-pool":
        click.echo("note: the reactive-pool baseline runs without the runtime's margins (it is not served)", err=True)
        return {}
    options = simulated_serving_options(lead_ms * 1e3, budget_ms * 1e3, wake_ms * 1e3)
    try:
        check_margins(service_margins(plan, profiles, spec, SchedulerOptions(**options)))
    except UserError as err:
        click.echo(f"warning: {err.message}; `ppipe serve` refuses this plan with these margins", err=True)
    return options



def _decode_setup(decode_ms: float, workers: int):
    """``--decode-ms`` and ``--decode-workers``: the run's decode stage (None: no decoding)."""
    from ppipe.sim.decoding import DecodeSetup

    if decode_ms < 0:
        raise UserError(f"--decode-ms must be >= 0, got {decode_ms}", fix="use 0 (no decoding) or a decode's time, e.g. 5")
    if workers < 1:
        raise UserError(f"--decode-workers must be >= 1, got {workers}", fix="e.g. --decode-workers 2")
    return DecodeSetup(decode_ms * 1e3, workers) if decode_ms > 0 else None


@click.command("simulate")
@click.argument("plan_file", metavar="PLAN.yaml", type=click.Path(dir_okay=False))
@click.option("--cluster", default=None, help="Cluster YAML or built-in name (overrides plan.yaml 'cluster_file' / 'cluster').")
@click.option("--load", type=float, default=None, help="Load factor: 1.0 = the plan's max-min throughput (plan.yaml solver.objective) x each model's weight; for other objectives each model's models[].throughput_rps. Default 1.0.")
@click.option("--sweep", is_flag=True, help="Find each model's largest load factor with attainment >= --target (1.0 down by 0.05, as the paper).")
@click.option("--search", type=click.Choice(["scan", "bisect", "guided"]), default="scan", show_default=True,
              help="Sweep order: 'scan' 1.0 down by 0.05 (the paper); 'bisect'/'guided' over the same grid "
              "(fewer runs; assume attainment falls as load rises).")
@click.option("--bisect-steps", type=int, default=0, show_default=True, help="After the sweep, halve the 0.05 step above each answer this many times.")
@click.option("--target", type=float, default=0.99, show_default=True, help="Attainment target of the sweep.")
@click.option("--full-points", is_flag=True,
              help="Run every sweep point to its end (default: a point stops once every model is certain to miss --target: the same pass or fail at every point, faster; with --search scan, the same answers).")
@click.option("--arrivals", type=click.Choice(["poisson", "bursty", "trace", "shifting"]), default=None,
              help="Arrival process (default poisson; 'trace' with --trace FILE; 'shifting': the models' total rate, "
                   "shared by a sinusoidal mix of period --period-s: share_i = 1/n + (0.6/n) sin(2 pi t/P + 2 pi i/n)).")
@click.option("--period-s", type=float, default=600.0, show_default=True, help="Period of the shifting mix (--arrivals shifting).")
@click.option("--replan", type=click.Choice(["off", "auto"]), default="off", show_default=True,
              help="auto: re-plan when the mix shifts (ppipe.control.replan) and switch plans live, under the virtual clock. "
                   "Needs a plan made with the max-min objective and the reservation or reactive policy.")
@click.option("--replan-time-limit-s", type=float, default=1.5, show_default=True, help="Planner time limit of each re-plan (--replan auto).")
@click.option("--replan-load-delay-s", type=float, default=10.0, show_default=True,
              help="Virtual time from a re-plan decision to the switch (planning and loading the new workers; the old plan serves meanwhile).")
@click.option("--replan-min-interval-s", type=float, default=60.0, show_default=True, help="Least time between two plan switches.")
@click.option("--replan-window-s", type=float, default=60.0, show_default=True, help="Window over which the controller estimates each model's rate and trend.")
@click.option("--replan-curvature-window-s", type=float, default=120.0, show_default=True,
              help="Window over which the controller estimates each rate's curvature (longer: a curvature is noisy over few bins).")
@click.option("--trace", "trace_file", type=click.Path(dir_okay=False), default=None,
              help="Trace to replay: Azure Functions 2021 CSV (end_timestamp,duration) or one timestamp (s) per line; implies --arrivals trace.")
@click.option("--cv", type=float, default=2.0, show_default=True, help="Coefficient of variation of the gaps for --arrivals bursty.")
@click.option("--duration-s", type=float, default=30.0, show_default=True, help="Arrival window per load point, in s (the paper: 30).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of arrivals and jitter.")
@click.option("--policy", default="reservation", show_default=True, help="Data-plane policy: reservation (the paper's) or reactive (per-pool baseline).")
@click.option("--jitter-cv", type=float, default=0.0, show_default=True, help="CV of lognormal jitter on inference times (0 = exactly the profile).")
@click.option("--dispatch-lead-ms", type=float, default=DEFAULT_DISPATCH_LEAD_US / 1e3, show_default=True,
              help="The runtime's dispatch lead, as `ppipe serve` applies it: every decision is planned this far (plus the "
              "input's transfer to the first pool) after now. 0 with --answer-budget-ms 0: the paper's data plane.")
@click.option("--answer-budget-ms", type=float, default=DEFAULT_ANSWER_BUDGET_US / 1e3, show_default=True,
              help="The runtime's answer budget, as `ppipe serve` applies it (without its adaptive part): every batch is "
              "planned to end this long before the SLO.")
@click.option("--wake-lead-ms", type=float, default=DEFAULT_WAKE_LEAD_US / 1e3, show_default=True,
              help="The runtime's wake lead, as `ppipe serve --wake-lead-ms` applies it: a batch waiting for more requests "
              "is dispatched this long before its last feasible moment (without the runtime's widening when its timers "
              "fire late). Not applied with the paper's data plane (both margins 0).")
@click.option("--feedback", type=click.Choice(["all", "changed", "none"]), default=None,
              help="Which stages workers report to the scheduler: all, changed (only those further than --report-tolerance-ms from "
                   "their reservation: what `ppipe serve` feeds the reservation policy), none. Default: changed for the reservation "
                   "policy, all for the others.")
@click.option("--report-tolerance-ms", type=float, default=DEFAULT_REPORT_TOLERANCE_US / 1e3, show_default=True,
              help="With --feedback changed: a stage this close to its reservation sends no report, as `ppipe serve "
                   "--report-tolerance-ms` (ppipe.dataplane.feedback). Matters only with --jitter-cv > 0.")
@click.option("--rates-from", type=click.Path(dir_okay=False), default=None,
              help="Base rates (load 1.0) from this plan instead of PLAN.yaml (drive systems at the same rates).")
@click.option("--plot", "plot_dir", type=click.Path(file_okay=False), default=None, help="Write PNG figures into this folder.")
@click.option("--records", "records_out", type=click.Path(dir_okay=False), default=None,
              help="Write one CSV row per request (arrival, dispatch, stages, completion or drop reason/place) of the run shown.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None, help="Write the results as JSON here.")
@click.option("--schedulers", type=int, default=1, show_default=True,
              help="Decide the plan with this many schedulers, each over a disjoint group of its servers (ppipe.dataplane.split): "
              "what a split for a rate beyond one scheduler core costs. Prints what the groups keep.")
@click.option("--decode-ms", type=float, default=0.0, show_default=True,
              help="Each request's decode before the scheduler (a JSON body, encoded images), on a pool of --decode-workers, "
              "admitted by the decode rule `ppipe serve`'s ingresses apply (ppipe.dataplane.decode). 0: none (binary tensors).")
@click.option("--decode-workers", type=int, default=1, show_default=True, help="Workers of the decode pool (--decode-ms).")
def simulate(plan_file, cluster, load, sweep, search, bisect_steps, target, full_points, arrivals, period_s, replan,
             replan_time_limit_s, replan_load_delay_s, replan_min_interval_s, replan_window_s, replan_curvature_window_s, trace_file, cv, duration_s, seed,
             policy, jitter_cv, dispatch_lead_ms, answer_budget_ms, wake_lead_ms, feedback, report_tolerance_ms, rates_from, plot_dir, records_out, json_out, schedulers,
             decode_ms, decode_workers) -> None:
    """Simulate PLAN.yaml: SLO attainment, drops, latency, utilization; or a load sweep."""
    from ppipe.sim.arrivals import ArrivalKind, read_trace
    from ppipe.sim.simulator import SimConfig, default_feedback
    from ppipe.sim.sweep import Workload, base_rates, check_rates, load_inputs, run_point
    from ppipe.sim.sweep import sweep as run_sweep
    from ppipe.spec.plan import load_plan

    if sweep and load is not None:
        raise UserError("--load and --sweep exclude each other", fix="give --load F for one point, or --sweep")
    if not (0 < target <= 1):
        raise UserError(f"--target must be in (0, 1], got {target}", fix="e.g. --target 0.99")
    known = _policies()
    if known and policy not in known:
        raise UserError(f"unknown --policy '{policy}'", fix=f"use one of: {', '.join(known)}")
    if trace_file and arrivals not in (None, "trace"):
        raise UserError(f"--trace goes with --arrivals trace, not '{arrivals}'", fix="drop --trace, or use --arrivals trace")
    kind = ArrivalKind(arrivals or ("trace" if trace_file else "poisson"))
    if kind is ArrivalKind.TRACE and not trace_file:
        raise UserError("--arrivals trace needs --trace FILE", fix="give the trace file with --trace")
    if period_s <= 0:
        raise UserError(f"--period-s must be > 0, got {period_s}", fix="e.g. --period-s 600")
    workload = Workload(kind=kind, cv=cv, trace_s=read_trace(trace_file) if trace_file else None, period_s=period_s)

    plan, profiles, spec = load_inputs(plan_file, cluster)
    rates = None
    if rates_from:
        if not Path(rates_from).is_file():
            raise UserError("reference plan not found", fix="give a plan.yaml for --rates-from", file=rates_from)
        rates = check_rates(plan, base_rates(load_plan(rates_from)), f"--rates-from {rates_from}")
    if feedback is None:
        feedback = default_feedback(policy)
    setup = _replan_setup(plan, profiles, spec, replan_time_limit_s, replan_load_delay_s, replan_min_interval_s, replan_window_s,
                          replan_curvature_window_s) if replan == "auto" else None
    margins = _serving_margins(plan, profiles, spec, policy, dispatch_lead_ms, answer_budget_ms, wake_lead_ms)
    if report_tolerance_ms < 0:
        raise UserError(f"--report-tolerance-ms must be >= 0, got {report_tolerance_ms}", fix="e.g. --report-tolerance-ms 1")
    config = SimConfig(duration_s=duration_s, seed=seed, jitter_cv=jitter_cv, feedback=feedback, policy=policy, replan=setup,
                       scheduler_options=margins, report_tolerance_us=max(report_tolerance_ms * 1e3, EXACT_US),
                       decode=_decode_setup(decode_ms, decode_workers))
    base = rates or base_rates(plan)
    factory = _split_factory(plan, schedulers, policy, margins, replan) if schedulers != 1 else None

    if sweep:
        def progress(f, res):
            parts = "  ".join(f"{m}={100 * mm.attainment:.2f}%" for m, mm in res.models.items())
            cut = f", stopped at {res.stopped_at_s:.2f} s: every model below target" if res.stopped_at_s is not None else ""
            click.echo(f"load {f:.3f}: {parts}  ({res.wall_s:.1f} s{cut})")

        result = run_sweep(plan, profiles, spec, rates_rps=rates, workload=workload, config=config, target=target,
                           search=search, bisect_steps=bisect_steps, progress=progress, early_stop=not full_points,
                           scheduler_factory=factory)
        _print_sweep(result, base)
        payload = {"plan": str(plan_file), "policy": policy, "arrivals": kind.value, "base_rates_rps": base, **result.to_dict()}
        # the figures of one point: the highest load at which every model still met the target
        passed = [v for v in result.max_load.values() if v is not None]
        key = round(min(passed), 6) if passed else min(result.points)
        shown = result.points.get(key, result.points[min(result.points)])
    else:
        f = 1.0 if load is None else load
        shown = run_point(plan, profiles, spec, f, rates_rps=rates, workload=workload, config=config, scheduler_factory=factory)
        _print_point(shown, f, base)
        _print_switches(shown.switches)
        payload = {"plan": str(plan_file), "policy": policy, "arrivals": kind.value, "load": f, "base_rates_rps": base, **shown.to_dict()}
        result = None

    if records_out and shown is not None:
        from ppipe.sim.records import write_records_csv

        write_records_csv(records_out, shown.records, shown.batches)
        click.echo(f"wrote {records_out}")
    if json_out:
        Path(json_out).write_text(json.dumps(payload, indent=2, default=str))
        click.echo(f"wrote {json_out}")
    if plot_dir:
        from ppipe.sim import plots

        d = Path(plot_dir)
        d.mkdir(parents=True, exist_ok=True)
        written = []
        if result is not None:
            written.append(plots.plot_attainment(result, d / "attainment_vs_load.png"))
        if shown is not None:
            written.append(plots.plot_timeline(shown, d / "timeline.png"))
            written.append(plots.plot_utilization(shown, d / "utilization.png"))
        for p in written:
            click.echo(f"wrote {p}")


def _split_factory(plan, k: int, policy: str, options: dict, replan: str):
    """``--schedulers K``: the scheduler factory of K server groups, after printing what they keep."""
    from ppipe.dataplane.split import build_split_scheduler, split_report, split_servers

    if k < 1:
        raise UserError(f"--schedulers must be >= 1, got {k}", fix="e.g. --schedulers 2")
    if replan == "auto" or policy == "reactive-pool":
        what = "--replan auto" if replan == "auto" else "--policy reactive-pool"
        raise UserError(f"--schedulers {k} does not go with {what}", fix=f"leave out one of --schedulers and {what}")
    report = split_report(plan, split_servers(plan, k))
    shares = " / ".join(f"{x:.2f}" for x in report["shares"])
    kept = ", ".join(f"{m} {100 * v:.1f} %" for m, v in report["kept"].items())
    click.echo(f"{k} schedulers over disjoint server groups: shares {shares}{'' if report['balanced'] else ' (not balanced)'}; "
               f"capacity kept: {kept}")
    return lambda p, pr, cl, clock: build_split_scheduler(p, pr, cl, clock, k, policy=policy, **options)


def _replan_setup(plan, profiles, spec, time_limit_s: float, load_delay_s: float, min_interval_s: float, window_s: float,
                  curvature_window_s: float):
    """``--replan auto``: the planner with the plan's settings behind the controller (ppipe.control.replan)."""
    from ppipe.control.replan import ReplanPolicy, planner_replan
    from ppipe.sim.simulator import ReplanSetup

    if not (time_limit_s > 0):
        raise UserError(f"--replan-time-limit-s must be > 0, got {time_limit_s}", fix="e.g. --replan-time-limit-s 1.5")
    policy = ReplanPolicy(window_s=window_s, curvature_window_s=curvature_window_s, min_interval_s=min_interval_s, load_delay_s=load_delay_s)
    return ReplanSetup(planner_replan(plan, profiles, spec, time_limit_s=time_limit_s), policy, load_delay_s=load_delay_s)


def _print_switches(switches: list[dict]) -> None:
    if not switches:
        return
    click.echo(f"plan switches: {len(switches)}")
    for s in switches:
        w = " ".join(f"{m}={v:.2f}" for m, v in s["weights"].items())
        click.echo(f"  decided {s['decided_s']:.1f} s, switched {s['switched_s']:.1f} s: planner {s['planner_s']:.2f} s, "
                   f"{s['kept']}/{s['vgpus']} vGPUs kept, Z {s['z_old']:.2f} -> {s['z_new']:.2f} (trigger {s['trigger']}), weights {w}")


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _console():
    from rich.console import Console

    con = Console()
    # piped or captured output: do not squeeze tables into 80 columns
    return con if con.is_terminal else Console(width=140)


def _print_point(res, load: float, base: dict[str, float]) -> None:
    from rich.table import Table

    t = Table(title=f"load factor {load:g}, {res.duration_s:g} s of arrivals")
    for col in ("model", "offered/s", "requests", "attainment", "goodput/s", "dropped", "late", "p50 ms", "p99 ms"):
        t.add_column(col, overflow="fold")
    rows = list(res.models.values()) + [res.overall]
    extra = []
    for mm in rows:
        rate = sum(base.values()) * load if mm.model == "all" else base.get(mm.model, 0.0) * load
        t.add_row(
            mm.model, f"{rate:.1f}", str(mm.requests), _pct(mm.attainment), f"{mm.goodput_rps:.1f}", _pct(mm.drop_rate),
            _pct(mm.late_rate), _ms(mm.p50_latency_ms), _ms(mm.p99_latency_ms),
        )
        if mm.model != "all":
            hist = " ".join(f"{b}:{n}" for b, n in mm.batch_histogram.items()) or "-"
            drops = " ".join(f"{k}:{v}" for k, v in mm.drops_by_reason.items()) or "-"
            where = " ".join(f"{k}:{v}" for k, v in mm.drops_by_where.items()) or "-"
            extra.append(f"{mm.model}: batches (size:count) {hist}; drops {drops} (where: {where})")
    con = _console()
    con.print(t)
    for line in extra:
        con.print(line, highlight=False)
    util = "  ".join(f"{g}: {100 * u:.1f}% ({100 * res.utilization_used.get(g, 0):.1f}% of used)" for g, u in res.utilization.items())
    con.print(f"utilization  {util}")
    ppd = "-" if res.probes_per_dispatch is None else f"{res.probes_per_dispatch:.2f}"
    spd = "-" if res.scheduler_us_per_dispatch is None else f"{res.scheduler_us_per_dispatch:.1f}"
    con.print(f"dispatches {res.dispatches}, probes/dispatch {ppd}, scheduler {spd} us/dispatch, "
              f"{res.events} events ({res.execution} execution), {res.wall_s:.1f} s wall ({res.sim_s_per_wall_s:.1f} simulated s per wall s, {res.sim_s_per_cpu_s:.1f} per CPU s)")
    if res.anomaly_count:
        con.print(f"[yellow]{res.anomaly_count} scheduler anomalies, e.g. {res.anomalies[:3]}[/yellow]")


def _print_sweep(result, base: dict[str, float]) -> None:
    from rich.table import Table

    t = Table(title=f"largest load factor with attainment >= {100 * result.target:g} %")
    t.add_column("model")
    t.add_column("base rate req/s")
    t.add_column("max load factor")
    for m, v in result.max_load.items():
        t.add_row(m, f"{base.get(m, 0):.1f}", "< 0.05" if v is None else f"{v:.3f}")
    t.add_row("mean", "", f"{result.mean_max_load:.3f}")
    _console().print(t)
