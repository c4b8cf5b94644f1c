"""Add estimated GPU types to a model profile."""

from __future__ import annotations

from typing import Mapping, Sequence

from ppipe.errors import UserError
from ppipe.spec.profile import ModelProfile

# The levels and batches of the PPipe artifact (and of the paper's planner runs).
DEFAULT_GRID: dict[int, list[int]] = {1: list(range(1, 9)), 2: [1, 2, 3, 4], 3: [1, 2], 4: [1, 2]}


def _pick_source(profile: ModelProfile, target: str, known: list[str]) -> str | None:
    # the measured type with the most table rows: more levels -> same-level features
    cands = [g for g in profile.gpus() if g in known and g != target and 8 in profile.batches(g, 1)]
    if not cands:
        return None
    return max(cands, key=lambda g: (sum(len(profile.batches(g, v)) for v in profile.levels(g)), g))


def estimate_profile(
    profile: ModelProfile,
    targets: Sequence[str],
    *,
    source_gpu: str | None = None,
    method: str = "auto",
    batches_by_level: Mapping[int, Sequence[int]] | None = None,
    layer_latency_us: Mapping[str, float] | None = None,
    node_blocks: Mapping[str, int] | None = None,
) -> ModelProfile:
    """A copy of ``profile`` with estimated timings for the ``targets`` GPU types.

    Args:
        profile: the measured profile.
        targets: GPU types to add (existing rows of these types are replaced).
        source_gpu: measured GPU type to start from (cross-GPU method); default: the one
            with the most rows that the cross-GPU model knows.
        method: ``"cross-gpu"`` (learned ratios from a measured GPU type), ``"roofline"``
            (block ONNX graphs + spec sheet) or ``"auto"`` (cross-GPU where the profile has
            a GPU type the model knows and the target is one it knows, else roofline).
        batches_by_level: levels -> batches to estimate (default: the artifact's grid,
            1-8 at level 1, 1-4 at level 2, 1-2 at levels 3 and 4, limited to the levels
            the spec sheet lists for the target).
        layer_latency_us, node_blocks: optional per-layer source timings for the
            cross-GPU method (see :func:`~ppipe.profiler.estimate.crossgpu.cross_gpu_table`);
            default: those of the profile's ``layers.csv`` where it has per-node timings of
            the source (:func:`ppipe.profiler.layers.cross_gpu_layer_inputs`), else none
            (the blocks-only model). The provenance says which model was used.

    Returns:
        A new :class:`ModelProfile`; ``manifest.provenance`` says how each target was made.

    Raises:
        UserError: an unknown method or GPU type, or no way to estimate a target (no usable
            source GPU type and no block ONNX files).
    """
    from ppipe.profiler.estimate.crossgpu import cross_gpu_table, default_cross_gpu_model
    from ppipe.profiler.estimate.gpus import gpu_spec
    from ppipe.profiler.estimate.roofline import provenance as roofline_provenance
    from ppipe.profiler.estimate.roofline import roofline_table

    if method not in ("auto", "cross-gpu", "roofline"):
        raise UserError(f"unknown estimate method '{method}'", fix="use auto, cross-gpu or roofline")
    table = {k: v for k, v in profile.table.items() if k[0] not in set(targets)}
    prov = dict(profile.manifest.provenance)
    for t in targets:
        spec = gpu_spec(t)  # unknown type -> UserError naming the known ones
        grid = {v: list(bs) for v, bs in (batches_by_level or DEFAULT_GRID).items() if v in spec.mps_levels}
        use_cross = False
        src = source_gpu
        if method in ("auto", "cross-gpu"):
            cross = default_cross_gpu_model()
            known = cross.gpus()
            if src is None:
                src = _pick_source(profile, t, known)
            use_cross = src is not None and t in known and src in known
            if method == "cross-gpu" and not use_cross:
                raise UserError(
                    f"no cross-GPU estimate for {t} from this profile (measured: {', '.join(profile.gpus()) or 'none'}); "
                    f"the cross-GPU model knows {', '.join(known)}",
                    fix="use method='roofline', or profile the model on one of those GPU types",
                )
        if use_cross:
            from ppipe.profiler.layers import cross_gpu_layer_inputs

            fitted = default_cross_gpu_model().grid(src, t)
            grid = {v: [b for b in bs if b in fitted.get(v, [])] for v, bs in grid.items()}
            grid = {v: bs for v, bs in grid.items() if bs}
            if layer_latency_us is not None and node_blocks is not None:
                kwargs, how = dict(layer_latency_us=layer_latency_us, node_blocks=node_blocks), "per-layer model (the per-layer timings given)"
            else:
                kwargs, how = cross_gpu_layer_inputs(profile, src)
            table.update(cross_gpu_table(profile, src, t, levels=list(grid), batches_by_level=grid, **kwargs))
            prov[t] = (
                f"estimated: cross-GPU ratios from the measured {src} profile (ppipe.profiler.estimate.crossgpu, "
                f"fitted on PPipe-artifact TensorRT timings), {how}; not measured"
            )
            continue
        paths = [profile.block_onnx_path(i) for i in range(profile.num_blocks)]
        if any(p is None or not p.exists() for p in paths):
            raise UserError(
                f"cannot estimate {t} for model '{profile.name}': no measured GPU type the cross-GPU model knows, "
                "and the profile has no block ONNX files for the roofline",
                fix="profile with `ppipe profile` (it writes the block ONNX files), or measure one of L4, P4, T4, V100",
            )
        table.update(roofline_table([p for p in paths if p is not None], [t], {t: list(grid)}, grid))
        prov[t] = roofline_provenance(t)
    manifest = profile.manifest.model_copy(update={"provenance": prov})
    return ModelProfile(manifest=manifest, table=table, directory=profile.directory, layers=profile.layers)
