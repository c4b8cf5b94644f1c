"""PNG figures of simulation results (matplotlib, Agg backend; imported only when plotting).

* :func:`plot_attainment` -- SLO attainment vs load factor per model (the paper's Fig. 7),
  with the target line and each model's maximum load factor.
* :func:`plot_timeline` -- per-vGPU timeline of batches over a short window (the paper's
  Fig. 12): one row per vGPU, one bar per stage run, coloured by model, labelled by batch size.
* :func:`plot_utilization` -- temporal utilization per GPU type (over the cluster's GPUs
  and over the GPUs the plan uses).
"""

from __future__ import annotations

from pathlib import Path

from ppipe.sim.metrics import SimResult
from ppipe.sim.sweep import SweepResult


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_attainment(sweep: SweepResult, path: str | Path, title: str = "") -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    models = list(sweep.max_load)
    for i, m in enumerate(models):
        pts = sweep.attainment(m)
        line, = ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o", ms=3, label=m)
        if sweep.max_load[m] is not None:
            ax.axvline(sweep.max_load[m], color=line.get_color(), ls=":", lw=1)
    ax.axhline(100 * sweep.target, color="grey", ls="--", lw=1, label=f"{100 * sweep.target:g} % target")
    ax.set_xlabel("load factor")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_title(title or f"SLO attainment (mean max load factor {sweep.mean_max_load:.3f})")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_timeline(result: SimResult, path: str | Path, start_us: float | None = None, span_us: float | None = None,
                  max_rows: int = 64) -> Path:
    """Per-vGPU timeline over ``[start_us, start_us + span_us)`` (default: 50 ms in mid-window)."""
    plt = _plt()
    span_us = span_us if span_us is not None else 50e3
    start_us = start_us if start_us is not None else max(0.0, result.duration_s * 1e6 / 2 - span_us / 2)
    end_us = start_us + span_us
    vgpus = sorted(result.vgpus.values(), key=lambda v: (v.gpu, v.vgpu_id))
    if len(vgpus) > max_rows:  # keep a share of every GPU type
        by_type: dict[str, list] = {}
        for v in vgpus:
            by_type.setdefault(v.gpu, []).append(v)
        keep = []
        for vs in by_type.values():
            keep += vs[: max(1, round(max_rows * len(vs) / len(vgpus)))]
        vgpus = keep
    row = {v.vgpu_id: i for i, v in enumerate(vgpus)}
    models = sorted({b.model for b in result.batches})
    cmap = plt.get_cmap("tab10")
    colour = {m: cmap(i % 10) for i, m in enumerate(models)}
    fig, ax = plt.subplots(figsize=(10, 1.0 + 0.22 * len(vgpus)))
    for b in result.batches:
        for st in b.stages:
            if st.start_us < 0 or st.end_us <= start_us or st.start_us >= end_us or st.vgpu_id not in row:
                continue
            y = row[st.vgpu_id]
            # clip to the window so that bars and labels at its edges stay inside the axes
            x0 = (max(st.start_us, start_us) - start_us) / 1e3
            w = (min(st.end_us, end_us) - max(st.start_us, start_us)) / 1e3
            ax.broken_barh([(x0, w)], (y - 0.4, 0.8), facecolors=colour[b.model], edgecolors="black", linewidth=0.3)
            if w > span_us / 1e3 / 80:
                ax.text(x0 + w / 2, y, str(b.batch), ha="center", va="center", fontsize=5)
    ax.set_yticks(range(len(vgpus)))
    ax.set_yticklabels([f"{v.gpu} 1/{v.level} {v.vgpu_id}" for v in vgpus], fontsize=5)
    ax.set_xlim(0, span_us / 1e3)
    ax.set_ylim(-1, len(vgpus))
    ax.invert_yaxis()
    ax.set_xlabel(f"time (ms) from t = {start_us / 1e3:.1f} ms")
    ax.set_title("batches per vGPU (label: batch size)")
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color=colour[m], label=m) for m in models], fontsize=6, loc="upper right")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return out


def plot_utilization(result: SimResult, path: str | Path) -> Path:
    plt = _plt()
    types = sorted(result.utilization)
    fig, ax = plt.subplots(figsize=(2.5 + 1.2 * len(types), 4.2))
    x = range(len(types))
    ax.bar([i - 0.2 for i in x], [100 * result.utilization[t] for t in types], width=0.4, label="over all GPUs of the type")
    ax.bar([i + 0.2 for i in x], [100 * result.utilization_used.get(t, 0.0) for t in types], width=0.4, label="over GPUs the plan uses")
    ax.set_xticks(list(x))
    ax.set_xticklabels(types)
    ax.set_ylabel("temporal utilization (%)")
    ax.set_ylim(0, 100)
    # below the axes: bars near 100 % would hide a legend inside them
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=1, frameon=False)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
