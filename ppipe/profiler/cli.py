"""``ppipe profile``: ONNX model -> ``models/<name>/`` (model.yaml, profile.csv, layers.csv).

A thin layer over :func:`ppipe.profiler.run.profile_model`; see that module for the grid,
the resume rule and what each step does.
"""

from __future__ import annotations

from pathlib import Path

import click


def _split(text: str | None) -> list[str]:
    return [t.strip() for t in (text or "").split(",") if t.strip()]


def _levels(text: str, flag: str) -> tuple[int, ...]:
    from ppipe.errors import UserError

    try:
        vals = tuple(sorted({int(x) for x in _split(text)}))
    except ValueError:
        vals = ()
    if not vals or any(v not in (1, 2, 3, 4) for v in vals):
        raise UserError(f"{flag} {text!r}: levels must be among 1,2,3,4", fix=f"e.g. {flag} 1,2")
    return vals


def _export_torch(spec: str, input_shape: str | None, name: str | None, out_dir: str | None) -> tuple[str, str, str]:
    """``--torch``: export the module to ``<out>/<name>.onnx``; returns (onnx path, name, out)."""
    from ppipe.errors import UserError
    from ppipe.profiler.graph import parse_shape
    from ppipe.profiler.torch_export import export_onnx

    if not input_shape:
        raise UserError("--torch needs --input-shape (the per-sample input, e.g. 3,224,224)", fix="add --input-shape 3,224,224")
    name = name or spec.rpartition(":")[2].replace(".", "_")
    out_dir = out_dir or str(Path("models") / name)
    path = export_onnx(spec, parse_shape(input_shape), Path(out_dir) / f"{name}.onnx")
    click.echo(f"exported {spec} to {path}", err=True)
    return str(path), name, out_dir


@click.command("profile")
@click.argument("model", required=False, type=click.Path(dir_okay=False))
@click.option("--builtin", "builtin", metavar="NAME", help="Profile a built-in model (onnx's backend test CNNs: resnet50, inception_v2, densenet121, vgg19, ...) instead of a file.")
@click.option("-o", "--out", "out_dir", type=click.Path(file_okay=False), help="Output folder (model.yaml, profile.csv, layers.csv). Default: models/<name>.")
@click.option("--name", help="Model name (model.yaml 'name'). Default: the built-in name or the file's stem.")
@click.option("--blocks", "num_blocks", type=int, default=10, show_default=True, help="Number of blocks to pre-partition into (model.yaml 'blocks').")
@click.option("--size-weight", type=float, default=0.1, show_default=True, help="When cutting: weight of the cut's feature-map size (relative to the input's) against block balance; 0 = balance only (model.yaml 'blocks').")
@click.option("--batches", default="1-8", show_default=True, help="Batch sizes at vGPU level 1 (e.g. 1-8 or 1,2,4,8); level 2 keeps those <= 4, levels 3-4 those <= 2 (profile.csv 'batch').")
@click.option("--measure", default="cpu", show_default=True, help="Device type to measure on here: 'cpu' (onnxruntime) or a GPU type name such as L4 (TensorRT on the local NVIDIA GPU); 'none' to only estimate (profile.csv 'gpu').")
@click.option("--estimate", default="", help="Comma-separated GPU types to add roofline estimates for, e.g. L4,T4,P4,V100,A10,A100,H100 (profile.csv 'gpu').")
@click.option("--estimate-from", metavar="GPU", help="Estimate the --estimate types from this GPU type's timings in the profile (cross-GPU model learned from real TensorRT profiles; e.g. --measure T4 --estimate-from T4 --estimate L4,V100) instead of the roofline model. Uses the per-layer features where layers.csv has per-node timings of that type, else block timings alone; model.yaml 'provenance' says which.")
@click.option("--trt-layers", "trt_layers", type=click.Choice(["per-node", "fused"]), default="per-node", show_default=True, help="How TensorRT times the layers of a measured GPU: 'per-node' (every activation an engine output, no fusion across nodes: comparable with the artifact the cross-GPU model learned from) or 'fused' (the deployed engine; fused layers split over their nodes) (model.yaml 'layers.gpus.<GPU>.method', layers.csv).")
@click.option("--precision", type=click.Choice(["tf32", "fp16"]), default="tf32", show_default=True, help="TensorRT precision of a measured GPU; tf32 is what the PPipe artifact and the cross-GPU model describe (model.yaml 'provenance').")
@click.option("--backend", type=click.Choice(["auto", "torch"]), default="auto", show_default=True, help="What runs the blocks: 'auto' (onnxruntime on the CPU, TensorRT on a GPU) or 'torch' (PyTorch on either; pip install 'ppipe[torch]') (model.yaml 'provenance').")
@click.option("--torch", "torch_factory", metavar="MODULE:FACTORY", help="Profile a PyTorch model instead of an ONNX file: FACTORY() in the importable MODULE returns an nn.Module, exported to ONNX (needs --input-shape; pip install 'ppipe[torch]').")
@click.option("--cpu-levels", default="1,2", show_default=True, help="vGPU levels measured on a CPU (level v = 1/v of the threads).")
@click.option("--gpu-levels", default="1,2,3,4", show_default=True, help="vGPU levels measured (MPS) or estimated on GPU types.")
@click.option("--input-shape", help="Per-sample input shape without the batch (e.g. 3,224,224); required when the ONNX input has dynamic dimensions (model.yaml 'input.shape').")
@click.option("--threads", type=int, help="Intra-op threads of the whole CPU (level 1). Default: the cores this process may use.")
@click.option("--reps", type=int, default=10, show_default=True, help="Timed runs per measurement (the median is kept).")
@click.option("--stat", "statistic", type=click.Choice(["median", "min"]), default="median", show_default=True, help="Statistic of the timed runs kept per measurement; 'min' damps a machine shared with other work (model.yaml 'provenance').")
@click.option("--refresh-estimates", is_flag=True, help="Recompute the --estimate types even where profile.csv has rows for them.")
@click.option("--seed", type=int, default=0, show_default=True, help="Weights seed of built-in models (model.yaml 'source.weights_seed').")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def profile(model, builtin, out_dir, name, num_blocks, size_weight, batches, measure, estimate, estimate_from, trt_layers, precision, backend, torch_factory, cpu_levels, gpu_levels, input_shape, threads, reps, statistic, refresh_estimates, seed, no_progress):
    """Cut MODEL (an ONNX file) into blocks and profile them per GPU type x vGPU level x batch.

    \b
    Examples:
      ppipe profile --builtin resnet50 --estimate L4,T4,P4,V100,A10,A100,H100
      ppipe profile my.onnx -o models/my --input-shape 3,224,224 --batches 1-4
      ppipe profile --torch mypkg.nets:resnet --input-shape 3,224,224 --backend torch
    Re-running the same command resumes: rows already measured are kept.
    """
    from ppipe.errors import UserError
    from ppipe.profiler.graph import parse_shape
    from ppipe.profiler.run import ProfileRequest, parse_batches, profile_model

    if sum(x is not None for x in (model, builtin, torch_factory)) != 1:
        raise UserError("give one model: an ONNX file, --builtin NAME or --torch MODULE:FACTORY", fix="e.g. --builtin resnet50")
    if torch_factory is not None:
        model, name, out_dir = _export_torch(torch_factory, input_shape, name, out_dir)
    if num_blocks < 1:
        raise UserError(f"--blocks {num_blocks}: need at least 1", fix="e.g. --blocks 10")
    if size_weight < 0:
        raise UserError(f"--size-weight {size_weight}: must be >= 0", fix="e.g. --size-weight 0.1")
    if reps < 1:
        raise UserError(f"--reps {reps}: need at least 1", fix="e.g. --reps 10")
    if threads is not None and threads < 1:
        raise UserError(f"--threads {threads}: need at least 1", fix="e.g. --threads 2")
    req = ProfileRequest(
        onnx_path=Path(model) if model else None,
        builtin=builtin,
        out_dir=Path(out_dir) if out_dir else None,
        name=name,
        num_blocks=num_blocks,
        size_weight=size_weight,
        batches=parse_batches(batches),
        measure=None if measure.strip().lower() in ("", "none") else measure.strip(),
        estimate=_split(estimate),
        estimate_from=estimate_from,
        cpu_levels=_levels(cpu_levels, "--cpu-levels"),
        gpu_levels=_levels(gpu_levels, "--gpu-levels"),
        input_shape=parse_shape(input_shape) if input_shape else None,
        threads=threads,
        reps=reps,
        seed=seed,
        statistic=statistic,
        refresh_estimates=refresh_estimates,
        trt_layers=trt_layers,
        precision=precision,
        backend=backend,
    )
    prof = profile_model(req, progress=not no_progress, echo=lambda m: click.echo(m, err=True))
    out = prof.directory
    gpus = ", ".join(f"{g} ({prof.manifest.latency_bs1_us.get(g, float('nan')) / 1000:.2f} ms at batch 1)" for g in prof.gpus())
    layers = f", layers.csv ({', '.join(prof.layers.gpus())})" if prof.layers is not None else ""
    click.echo(f"wrote {out}/model.yaml, profile.csv{layers}: {prof.num_blocks} blocks, {len(prof.table)} rows; {gpus}")
