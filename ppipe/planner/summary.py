"""A readable summary of a plan (rich tables): pipelines, GPUs, solver."""

from __future__ import annotations

from ppipe.spec.plan import Plan


def partition_text(p) -> str:
    blocks = f"b{p.first_block}" if p.first_block == p.last_block else f"b{p.first_block}-{p.last_block}"
    extra = f" (+{p.headroom} headroom)" if p.headroom else ""
    return f"{blocks} {p.gpu}/{p.vgpu}x{p.count}{extra}"


def print_summary(plan: Plan, console=None) -> None:
    """Print per model its pipelines (block ranges on type/level x count, batch, req/s), GPUs and solver."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title=f"plan for {plan.cluster} ({plan.settings.planner}, {plan.settings.formulation})")
    for col in ("model", "SLO ms", "weight", "pipeline", "partitions (blocks GPU/level x vGPUs)", "batch", "req/s"):
        table.add_column(col, justify="right" if col in ("SLO ms", "weight", "batch", "req/s") else "left")
    for m in plan.models:
        first = True
        for i, p in enumerate(m.pipelines):
            table.add_row(
                m.name if first else "",
                f"{m.slo_ms:.1f}" if first else "",
                f"{m.weight:g}" if first else "",
                str(i),
                " | ".join(partition_text(x) for x in p.partitions),
                str(p.batch),
                f"{p.throughput_rps:.1f}",
            )
            first = False
        if not m.pipelines:
            table.add_row(m.name, f"{m.slo_ms:.1f}", f"{m.weight:g}", "-", "(no pipeline)", "", "0.0")
        table.add_row("", "", "", "", f"[b]total {m.name}[/b]", "", f"[b]{m.throughput_rps:.1f}[/b]", end_section=True)
    console.print(table)
    used = ", ".join(f"{k} {n}" for k, n in plan.gpus_used.items())
    s = plan.solver
    console.print(f"GPUs used: {used}")
    console.print(
        f"solver {s.name}: {s.status}, objective {s.objective:.3f} ({plan.settings.objective}), gap {s.gap:.2%}, "
        f"{s.seconds:.2f} s, {s.columns} columns" + (f"; {'proven' if s.status == 'optimal' else 'gap proven'} by {s.method}" if s.method else "")
    )
