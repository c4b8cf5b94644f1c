#!/usr/bin/env python
"""Accuracy of ppipe's latency estimators on the PPipe artifact (real TensorRT timings).

Part 1, cross-GPU model (``ppipe.profiler.estimate.crossgpu``), leave-one-model-out: for
every model of the artifact, fit the cross-GPU model on the OTHER models, then predict the
model's block latencies on each GPU type from its profile on another one (every ordered
pair of L4, P4, T4, V100; all levels and batches the artifact has). The predictor only
sees a copy of the profile that holds the source GPU type (and, unless --blocks-only, its
per-layer latencies on the source GPU type). The fit chooses its own hyper-parameters by
leave-one-model-out among the models it is given, so this is a NESTED cross-validation:
the held-out model never takes part in choosing them, and the figures are out-of-sample.
The script is deterministic (seeded random features, one BLAS thread).

Which path is this for a user? ``ppipe profile --measure L4 --estimate-from L4 --estimate
P4,T4,V100`` writes the L4 per-node timings (TensorRT, ``--trt-layers per-node``, the
default) to ``layers.csv`` and gives them to the same ``cross_gpu_table`` with the same
features: op types from the ONNX graph (they equal those the artifact's node names give),
node -> block from model.yaml's blocks (tests/profiler/test_user_path.py profiles an
artifact model through that path and gets this script's predictions). So the default
figures are what such a user gets, provided TensorRT's per-node timings on their GPU are
like the artifact's per-layer tables (each node its own kernel; checked on the artifact
only, no GPU was at hand to compare). ``--blocks-only`` gives the figures of the other
path: a profile without per-node timings of the source (``--trt-layers fused``, rows
measured elsewhere, an imported profile). Figures:

* block latency: relative error |pred / true - 1| over every (target, level, batch, block);
* latency ratio between the two GPU types of a paper cluster (L4/P4, L4/T4, V100/P4,
  V100/T4), per block and (level, batch) both have, for every source GPU type: when the
  source is one of the two, the ratio's error equals that block's latency error; when it
  is neither (e.g. V100/P4 from an L4 profile), both sides are predicted.

Next to it, the naive predictor: one global ratio per GPU pair (the median whole-model
batch-1 ratio of the training models) times the source latency at the same level and
batch (at level 1 times the training models' median level factor where the source has no
level v, as a P4).

Part 2, roofline (``ppipe.profiler.estimate.roofline``): the artifact has no ONNX files,
but two of its models are public architectures that ``reference_graphs`` rebuilds node for
node (their cut bytes match the artifact's exactly). The roofline is calibrated on one and
evaluated on the other, per block, level and batch; then the per-GPU batch-1 ratios it
gives for onnx's ``light_*.onnx`` networks are printed next to the artifact's measured
ratios for models of the same family.

Usage::

    python scripts/bench_estimator.py --skip-roofline   # the cross-GPU LOMO, ~3-4 min on 2 busy cores
    python scripts/bench_estimator.py                   # everything (the per-layer model: the default path)
    python scripts/bench_estimator.py --models 4        # the first 4 models only
    python scripts/bench_estimator.py --blocks-only     # without the per-layer features
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

# Many small solves: one BLAS thread is several times faster than a pool that fights
# over the cores (set before numpy loads).
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULT_ARTIFACT = REPO.parent / "shared" / "data" / "ppipe-artifact"
CLUSTER_PAIRS = [("L4", "P4"), ("L4", "T4"), ("V100", "P4"), ("V100", "T4")]


def source_only(profile, gpu):
    from ppipe.spec.profile import ModelProfile

    return ModelProfile(manifest=profile.manifest, table={k: v for k, v in profile.table.items() if k[0] == gpu})


def naive_table(train, profile, s, t):
    """One global ratio per pair (median whole-model bs1 ratio) x source latency."""
    ratios = [
        am.profile.model_latency_us(t) / am.profile.model_latency_us(s) for am in train if {s, t} <= set(am.profile.gpus())
    ]
    r = float(np.median(ratios))
    out = {}
    for v in profile.levels(t):
        for b in profile.batches(t, v):
            v_src = v if v in profile.levels(s) else 1
            factor = 1.0
            if v_src != v:
                factor = float(np.median([am.profile.model_latency_us(t, v, b) / am.profile.model_latency_us(t, 1, b) for am in train]))
            for i in range(profile.num_blocks):
                out[(t, v, b, i)] = r * factor * profile.block_latency_us(s, v_src, b, i)
    return out


def pct(errs):
    e = np.abs(np.asarray(errs))
    return f"median {100 * np.median(e):5.1f} %   p90 {100 * np.percentile(e, 90):6.1f} %   (n={len(e)})"


def cross_gpu_part(artifact: Path, n_models: int | None, blocks_only: bool) -> None:
    from ppipe.profiler.estimate.artifact_data import load_all
    from ppipe.profiler.estimate.crossgpu import artifact_layer_inputs, cross_gpu_table, fit_cross_gpu_from_models

    data = load_all(artifact)
    names = sorted(data)[: n_models or None]
    gpus = sorted({g for am in data.values() for g in am.profile.gpus()})
    err = {"model": {}, "naive": {}}  # (s, t) -> list of block errors
    rerr = {"model": {}, "naive": {}}  # (s, hi, lo) -> list of ratio errors
    per_model = {"model": {}, "naive": {}}  # held-out model -> its block errors from L4
    chosen = {}  # (s, t) -> hyper-parameters chosen in each outer fold
    t0 = time.perf_counter()
    for name in names:
        am = data[name]
        prof = am.profile
        fitted = fit_cross_gpu_from_models((a for n, a in data.items() if n != name), with_layers=(not blocks_only,))
        train = [a for n, a in data.items() if n != name]
        for key, sel in fitted.selection.items():
            chosen.setdefault(key[:2], []).append((sel.gamma, sel.rho, sel.lam))
        for s in gpus:
            src = source_only(prof, s)
            kw = {}
            if not blocks_only:
                layer, nodes = artifact_layer_inputs(am, s)
                kw = dict(layer_latency_us=layer, node_blocks=nodes)
            pred = {"model": dict(src.table), "naive": dict(src.table)}
            for t in gpus:
                if t == s:
                    continue
                grid = {v: list(prof.batches(t, v)) for v in prof.levels(t)}
                pred["model"].update(cross_gpu_table(src, s, t, levels=list(grid), batches_by_level=grid, model=fitted, **kw))
                pred["naive"].update(naive_table(train, prof, s, t))
            for kind, table in pred.items():
                for t in gpus:
                    if t == s:
                        continue
                    e = [table[k] / prof.table[k] - 1 for k in prof.table if k[0] == t]
                    err[kind].setdefault((s, t), []).extend(e)
                    if s == "L4":
                        per_model[kind].setdefault(name, []).extend(e)
                for hi, lo in CLUSTER_PAIRS:
                    for v in prof.levels(lo):
                        for b in prof.batches(lo, v):
                            if b not in prof.batches(hi, v):
                                continue
                            for i in range(prof.num_blocks):
                                r_pred = table[(lo, v, b, i)] / table[(hi, v, b, i)]
                                r_true = prof.table[(lo, v, b, i)] / prof.table[(hi, v, b, i)]
                                rerr[kind].setdefault((s, hi, lo), []).append(r_pred / r_true - 1)
        print(f"  {name}: done ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)

    if blocks_only:
        feats = ("BLOCKS-ONLY model: what `ppipe profile --estimate-from GPU` uses when the profile has no per-node "
                 "timings of GPU in layers.csv (--trt-layers fused, rows measured elsewhere, imported profiles)")
    else:
        feats = ("PER-LAYER model: what `ppipe profile --measure GPU --estimate-from GPU` uses by default (TensorRT "
                 "per-node timings of GPU in layers.csv; same features as here, tests/profiler/test_user_path.py)")
    print(f"\n== Cross-GPU model, nested leave-one-model-out over {len(names)} models ==\n   {feats}")
    print("block latency, relative error |pred/true - 1|, per (source -> target):")
    for (s, t) in sorted(err["model"]):
        print(f"  {s:>4} -> {t:<4}  model: {pct(err['model'][(s, t)])}   naive: {pct(err['naive'][(s, t)])}")
    for kind in ("model", "naive"):
        allv = [x for v in err[kind].values() for x in v]
        l4 = [x for (s, _t), v in err[kind].items() if s == "L4" for x in v]
        print(f"  ALL pairs  {kind:5s}: {pct(allv)}")
        print(f"  from L4    {kind:5s}: {pct(l4)}")
    print("\nheld-out models with the largest errors from L4 (block latency, all targets):")
    worst = sorted(per_model["model"], key=lambda n: -np.percentile(np.abs(per_model["model"][n]), 90))
    for n in worst[:8]:
        print(f"  {n[:44]:<44}  model: {pct(per_model['model'][n])}   naive: {pct(per_model['naive'][n])}")
    print("\nhyper-parameters (gamma, rho, lambda) chosen by the inner leave-one-model-out, per pair: most")
    print("frequent choice over the outer folds (count / folds)")
    for (s, t), sels in sorted(chosen.items()):
        best = max(set(sels), key=sels.count)
        print(f"  {s:>4} -> {t:<4}  {best}  {sels.count(best)}/{len(sels)}   distinct: {len(set(sels))}")
    print("\nper-block latency ratio low/high GPU of the paper's clusters, relative error:")
    for key in sorted(rerr["model"]):
        s, hi, lo = key
        print(f"  {lo}/{hi} from {s:<4}  model: {pct(rerr['model'][key])}   naive: {pct(rerr['naive'][key])}")
    for kind in ("model", "naive"):
        allv = [x for v in rerr[kind].values() for x in v]
        l4 = [x for (s, _hi, _lo), v in rerr[kind].items() if s == "L4" for x in v]
        both = [x for (s, hi, lo), v in rerr[kind].items() if s not in (hi, lo) for x in v]
        print(f"  ALL ratios {kind:5s}: {pct(allv)}")
        print(f"  ratios from L4 {kind:5s}: {pct(l4)}")
        print(f"  both sides predicted {kind:5s}: {pct(both)}")


RELATED = [  # light_*.onnx model (224x224) -> artifact models of the same family
    ("resnet50", ["wide_resnet101_2", "resnext152-32x4d_8xb32_in1k"]),
    ("inception_v2", ["googlenet-v3-pytorch"]),
    ("vgg19", ["repvgg-b3"]),
    ("densenet121", []),
]


def roofline_part(artifact: Path) -> None:
    import onnx

    from ppipe.profiler.estimate.artifact_data import load_model
    from ppipe.profiler.estimate.gpus import gpu_spec
    from ppipe.profiler.estimate.reference_graphs import REFERENCE_GRAPHS, block_costs
    from ppipe.profiler.estimate.roofline import BlockWork, block_latency_us, fit_roofline, roofline_params, roofline_table

    gpus = ["L4", "P4", "T4", "V100"]
    names = list(REFERENCE_GRAPHS)
    print("\n== Roofline (ONNX graph + spec sheet) ==")
    print("calibrated on one rebuilt artifact model, evaluated on the other (all levels and batches):")
    works = {n: [BlockWork.from_costs(c) for c in block_costs(n, artifact)] for n in names}
    profs = {n: load_model(artifact, n).profile for n in names}
    for train in names:
        doc = fit_roofline(artifact, models=[train])
        for test in names:
            if test == train:
                continue
            for g in gpus:
                e = [
                    block_latency_us(works[test][blk], gpu_spec(g), doc["gpus"][g], v, b) / lat - 1
                    for (gg, v, b, blk), lat in profs[test].table.items()
                    if gg == g
                ]
                whole = sum(block_latency_us(w, gpu_spec(g), doc["gpus"][g], 1, 1) for w in works[test])
                bs1 = profs[test].manifest.latency_bs1_us.get(g)
                print(
                    f"  fit {train:<16} -> {test:<16} {g:<4} block {pct(e)}   whole model bs1: "
                    f"{whole / 1e3:6.2f} ms vs measured {bs1 / 1e3 if bs1 else float('nan'):6.2f} ms"
                )
    print("\nshipped constants (fitted on both), whole model batch 1 vs model-latency-bs1.csv (in-sample):")
    for n in names:
        row = []
        for g in gpus:
            whole = sum(block_latency_us(w, gpu_spec(g), roofline_params(g), 1, 1) for w in works[n])
            row.append(f"{g} {whole / 1e3:6.2f}/{profs[n].manifest.latency_bs1_us[g] / 1e3:6.2f} ms")
        print(f"  {n:<18} " + "   ".join(row))

    light = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"
    bs1 = {}
    import csv

    with (artifact / "model-latency-bs1.csv").open() as fh:
        for r in csv.DictReader(fh):
            bs1[(r["model"], r["gpu"])] = float(r["latency_us"])
    print("\nper-GPU latency ratio X/L4 at batch 1: roofline on onnx's light_*.onnx (224x224) vs the")
    print("artifact's measured ratio for models of the same family (different depth and resolution):")
    all_gpus = ["P4", "T4", "V100", "A10", "A100", "H100"]
    print("  " + f"{'model':<34}" + "".join(f"{g + '/L4':>9}" for g in all_gpus))
    for lname, related in RELATED:
        path = light / f"light_{lname}.onnx"
        if not path.exists():
            print(f"  light_{lname}: not in this onnx release")
            continue
        t = roofline_table([path], ["L4", *all_gpus], {g: [1] for g in ["L4", *all_gpus]}, {1: [1]})
        print("  " + f"{'roofline light_' + lname:<34}" + "".join(f"{t[(g, 1, 1, 0)] / t[('L4', 1, 1, 0)]:9.2f}" for g in all_gpus))
        for rel in related:
            print(
                "  " + f"{'  measured ' + rel[:22]:<34}"
                + "".join(f"{bs1[(rel, g)] / bs1[(rel, 'L4')]:9.2f}" if (rel, g) in bs1 else f"{'-':>9}" for g in all_gpus)
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", type=Path, default=DEFAULT_ARTIFACT, help="PPipe artifact folder")
    ap.add_argument("--models", type=int, default=None, help="only the first N models (alphabetical)")
    ap.add_argument("--blocks-only", action="store_true", help="cross-GPU model without per-layer features")
    ap.add_argument("--skip-cross-gpu", action="store_true")
    ap.add_argument("--skip-roofline", action="store_true")
    args = ap.parse_args()
    if not (args.artifact / "block-timing").is_dir():
        sys.exit(f"PPipe artifact not found at {args.artifact} (use --artifact)")
    from hostspeed import host_line

    print(host_line(), flush=True)
    if not args.skip_cross_gpu:
        cross_gpu_part(args.artifact, args.models, args.blocks_only)
    if not args.skip_roofline:
        roofline_part(args.artifact)


if __name__ == "__main__":
    main()
