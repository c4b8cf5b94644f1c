"""``ppipe plan``: a thin click layer over :func:`ppipe.planner.api.plan`.

Each flag overrides one field of the written plan.yaml (``settings.*`` or
``models[].slo_ms`` / ``models[].weight``); its help names the field.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from pathlib import Path

import click

from ppipe.errors import UserError


def _parse_per_model(values: tuple[str, ...], flag: str):
    """``--flag 50`` (all models), ``--flag a=50 --flag b=30`` or ``--flag 0.3,0.33,0.37`` (in model order)."""
    if not values:
        return None
    items = [x for v in values for x in v.split(",") if x.strip()]
    try:
        if all("=" in x for x in items):
            return {k.strip(): float(v) for k, v in (x.split("=", 1) for x in items)}
        if any("=" in x for x in items):
            raise ValueError
        nums = [float(x) for x in items]
    except ValueError:
        raise UserError(
            f"{flag}: cannot read {' '.join(values)!r}",
            fix=f"write {flag} VALUE, {flag} MODEL=VALUE (repeatable) or {flag} V1,V2,... (one per model, in order)",
        ) from None
    return nums[0] if len(nums) == 1 else nums


@click.command("plan")
@click.argument("cluster", required=False)
@click.argument("model_dirs", nargs=-1)
@click.option("--slo-ms", multiple=True, help="SLO in ms: one value, MODEL=MS (repeatable) or MS1,MS2,... Overrides models[].slo_ms (and model.yaml's slo_ms).")
@click.option("--slo-scale", type=float, default=None, help="SLO = this x batch-1 latency on the L4 (else the cluster's fastest type). Overrides models[].slo_ms. Default when neither this, --slo-ms nor model.yaml's slo_ms is given: 5.")
@click.option("--weights", multiple=True, help="Workload weights: W1,W2,... in model order or MODEL=W (repeatable). Overrides models[].weight (default 1 each).")
@click.option("--margin", type=float, default=None, help="Share of the SLO the planner keeps free. Overrides settings.margin (default 0.4).")
@click.option("--max-partitions", type=int, default=None, help="At most this many partitions per pipeline. Overrides settings.max_partitions (default 3).")
@click.option("--planner", "planner", type=click.Choice(["ppipe", "np", "dart-r"]), default="ppipe", show_default=True, help="ppipe (MILP), np (no partitioning, no MPS) or dart-r. Sets settings.planner.")
@click.option("--solver", type=click.Choice(["highs", "cbc", "gurobi"]), default="highs", show_default=True, help="MILP solver. Sets solver.name.")
@click.option("--formulation", type=click.Choice(["ppipe", "ppipe-atc25"]), default="ppipe", show_default=True, help="ppipe-atc25 = the authors' MILP (ilp_v4.py: paper GPU rule, one configuration per template of D GPU types, margin 0.4 in whole us, their batch-build estimate, SLO 5 x L4). Sets settings.formulation.")
@click.option("--gpu-rule", type=click.Choice(["physical", "paper"]), default=None, help="GPU counting rule. Overrides settings.gpu_rule (default from --formulation).")
@click.option("--configs-per-template", type=click.Choice(["many", "one"]), default=None, help="Overrides settings.configs_per_template (default from --formulation).")
@click.option("--batch-build/--no-batch-build", default=None, help="Batch-gathering estimate beta(b) from the NP plan. Overrides settings.batch_build (default on).")
@click.option("--objective", type=click.Choice(["max-min", "total", "min-cost"]), default=None, help="Overrides settings.objective (default max-min; min-cost when --required-rps is given).")
@click.option("--required-rps", multiple=True, help="For --objective min-cost: RPS for all models or MODEL=RPS (repeatable).")
@click.option("--time-limit-s", type=float, default=60.0, show_default=True, help="Time budget of the whole planning in s (NP estimate, split search and solver share it); the best plan found by then is kept, with its gap.")
@click.option("--gap", type=float, default=1e-4, show_default=True, help="Relative MIP gap at which the solver stops. Reported in solver.gap.")
@click.option("--headroom/--no-headroom", default=None, help="Give pools busier than --headroom-util extra vGPUs from GPUs the plan leaves idle (the objective does not change). Sets settings.headroom_util (default: on for --planner ppipe with max-min/total, in both formulations: the plan stays an optimal solution of the paper's MILP; off for the baselines).")
@click.option("--headroom-util", type=float, default=None, help="Utilization target of the headroom pass, in [0, 1): pools are grown until they are at or below it at the planned load (0 = use every idle GPU a pool can take). Sets settings.headroom_util (default 0.8); implies --headroom.")
@click.option("--column-generation/--no-column-generation", default=None, help="Price pipeline configurations against the LP's duals and solve the MILP over the generated ones (max-min, physical packing, several configurations per template), the gap then being to the LP bound of every configuration. Reported in solver.method and solver.columns (default: where the MILP over all configurations would exceed 5,000 columns).")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default="plan.yaml", show_default=True, help="Where to write the plan.")
@click.option("--quiet", is_flag=True, help="Do not print the summary.")
def plan(cluster, model_dirs, slo_ms, slo_scale, weights, margin, max_partitions, planner, solver, formulation, gpu_rule,
         configs_per_template, batch_build, objective, required_rps, time_limit_s, gap, headroom, headroom_util, column_generation,
         output, quiet):
    """Plan pooled pipelines: CLUSTER (file, built-in name or local-gpu: this machine's GPUs; default HC2-S) and MODEL_DIRs
    (profile folders or built-in model names, default every built-in model) -> plan.yaml."""
    from ppipe.planner.api import plan as make_plan

    with one_line_warnings():
        result = make_plan(
            cluster or "HC2-S",
            list(model_dirs) or None,
            objective=objective,
            planner=planner,
            formulation=formulation,
            solver=solver,
            slo_ms=_parse_per_model(slo_ms, "--slo-ms"),
            slo_scale=slo_scale,
            weights=_parse_per_model(weights, "--weights"),
            margin=margin,
            max_partitions=max_partitions,
            gpu_rule=gpu_rule,
            configs_per_template=configs_per_template,
            batch_build=batch_build,
            required_rps=_parse_per_model(required_rps, "--required-rps"),
            time_limit_s=time_limit_s,
            gap=gap,
            headroom=(False if headroom is False else (headroom_util if headroom_util is not None else headroom)),
            column_generation=column_generation,
        )
    out = Path(output)
    result = relative_profiles(result, out.parent)
    result.save(out)
    if not quiet:
        from ppipe.planner.summary import print_summary

        print_summary(result)
    click.echo(f"wrote {out}")


@contextlib.contextmanager
def one_line_warnings():
    """Show warnings raised inside as one ``warning: ...`` line on stderr (no file and source line)."""
    old = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        click.echo(f"warning: {message}", err=True)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = old


def relative_profiles(plan, base: Path):
    """The plan with each folder ``profile`` written relative to ``base`` (plan.yaml's folder)."""
    models = []
    for m in plan.models:
        ref = m.profile
        if ref and os.path.isabs(ref) and ":" not in ref.split(os.sep)[0]:
            ref = os.path.relpath(ref, base.resolve())
        models.append(m.model_copy(update={"profile": ref}))
    return plan.model_copy(update={"models": models})
