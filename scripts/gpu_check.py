"""The GPU check of issue 23, driven by ``scripts/gpu_check.sh`` (see that file for how to run it).

Steps (each prints its result and adds it to the JSON summary):

1. ``profile``: the built-in ResNet-50, Inception-v2 and DenseNet-121 profiled on this GPU
   with the torch backend (their shipped cuts, batches 1-8, levels 1-4 as the spec sheet
   offers them; MPS levels where a daemon runs, else time-sliced, as the provenance says),
   each block latency next to the roofline's estimate for this GPU type: median and p90 of
   the relative error, and a batch-1 / batch-8 table per model. Then the roofline's
   constants fitted for this GPU type on these measurements (``roofline_<gpu>.json`` in
   ``--out``; :func:`~ppipe.profiler.estimate.roofline.fit_measured`), with the error after.
2. ``chain``: each model's blocks chained on the GPU against the whole model in fp32 on the
   CPU (onnxruntime): in fp32 eagerly, and in fp16 as ``ppipe serve --backend torch`` runs
   them (two partitions, CUDA graphs): top-1 agreement and the largest error.
3. ``handoff``: a feature map handed between two processes on one GPU by CUDA IPC
   (:mod:`ppipe.runtime.workers.cuda_ipc`): bytes equal, latency per handoff; then the same maps
   through the staging ring that same-GPU edges are to use (:mod:`ppipe.runtime.workers.ring_link`).

``--dry-run`` does none of the GPU work: it checks what can be checked on any machine (the
packages, the models, the GPU type's spec sheet) and prints what each step would do and
what it skips here. Nothing in this file fakes a GPU result.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
MODELS = ("resnet50", "inception_v2", "densenet121")
BATCHES = list(range(1, 9))


def say(msg: str = "") -> None:
    print(msg, flush=True)


# ---- environment ---------------------------------------------------------------------------------------------
def environment() -> dict:
    """What this machine has: the packages the check needs and the GPU torch sees."""
    have = {m: importlib.util.find_spec(m) is not None for m in ("torch", "onnxscript", "pydantic", "onnxruntime", "cupy")}
    env = {"packages": have, "cuda": False, "device": None, "gpu_type": None}
    if have["torch"]:
        import torch

        env["torch"] = torch.__version__
        if torch.cuda.is_available():
            env["cuda"] = True
            env["device"] = torch.cuda.get_device_name(0)
            env["gpu_type"] = gpu_type_of(env["device"])
    return env


def short_name(device_name: str) -> str:
    """A GPU type name for a device the sheet lacks (``NVIDIA H200`` -> ``H200``)."""
    import re

    m = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", device_name.upper())
    return m.group(1) if m else re.sub(r"[^A-Za-z0-9]+", "-", device_name).strip("-") or "GPU"


def gpu_type_of(device_name: str) -> str | None:
    """The spec sheet's GPU type for a CUDA device name (``NVIDIA H100 80GB HBM3`` -> ``H100``)."""
    from ppipe.profiler.estimate.gpus import known_gpus

    name = device_name.upper().replace(" ", "")
    hits = [g for g in known_gpus() if g.upper() in name]
    return max(hits, key=len) if hits else None


# ---- 1. profile with the torch backend, next to the roofline -------------------------------------------------------
def profile_models(out_dir: Path, gpu: str, reps: int, levels: list[int], on_sheet: bool, budget_s: float) -> dict:
    """Profile each model (until ``budget_s`` is spent) and compare with the roofline where the sheet has ``gpu``."""
    from ppipe.profiler.blocks import ensure_block_models
    from ppipe.profiler.estimate import roofline_table
    from ppipe.profiler.estimate.gpus import gpu_spec
    from ppipe.profiler.run import ProfileRequest, batch_grid, profile_model

    if on_sheet:
        levels = [v for v in levels if v in gpu_spec(gpu).mps_levels]
    else:
        say(f"  {gpu} is not on the spec sheet: no roofline to compare with (give --gpu-type to compare with another type's sheet)")
    result: dict = {}
    t_start = time.perf_counter()
    for name in MODELS:
        if time.perf_counter() - t_start > budget_s:
            say(f"{name}: skipped, the profile step's budget of {budget_s:.0f} s is spent")
            result[name] = {"skipped": f"budget of {budget_s:.0f} s spent"}
            continue
        d = out_dir / name
        d.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / "models" / name / "model.yaml", d / "model.yaml")  # the shipped cuts
        t0 = time.perf_counter()
        req = ProfileRequest(builtin=name, out_dir=d, measure=gpu, backend="torch", batches=BATCHES, gpu_levels=tuple(levels), reps=reps)
        prof = profile_model(req, progress=False, echo=lambda m: say(f"  {m}"))
        seconds = time.perf_counter() - t0
        blocks = [str(p) for p in ensure_block_models(prof)]
        est = roofline_table(blocks, [gpu], {gpu: levels}, batch_grid(BATCHES, levels)) if on_sheet else {}
        result[name] = _compare(prof, est, gpu, seconds)
        _print_model(name, prof, est, gpu, result[name])
    return result


def _compare(prof, est: dict, gpu: str, seconds: float) -> dict:
    """Relative error of the roofline per measured (level, batch, block): median, p90."""
    pairs = [(lat, est[k]) for k, lat in prof.table.items() if k[0] == gpu and k in est]
    err = np.array([abs(e - m) / m for m, e in pairs if m > 0])
    ratio = np.array([e / m for m, e in pairs if m > 0])
    return {
        "measured": sum(1 for k in prof.table if k[0] == gpu),
        "points": len(pairs),
        "seconds": round(seconds, 1),
        "median_rel_error": float(np.median(err)) if err.size else None,
        "p90_rel_error": float(np.percentile(err, 90)) if err.size else None,
        "median_estimate_over_measured": float(np.median(ratio)) if ratio.size else None,
        "provenance": prof.manifest.provenance.get(gpu, ""),
    }


def calibrate(profiles_dir: Path, gpu: str, out_dir: Path) -> dict:
    """Fit the roofline's constants for ``gpu`` on what step 1 measured (:func:`fit_measured`).

    Writes ``roofline_<gpu>.json`` to ``out_dir`` (not the shipped file) and prints the
    constants and the error after calibration, in sample, next to the shipped constants' error.
    """
    from ppipe.profiler.estimate.roofline import fit_measured

    dirs = [profiles_dir / m for m in MODELS if (profiles_dir / m / "profile.csv").is_file()]
    path = out_dir / f"roofline_{gpu}.json"
    out_dir.mkdir(parents=True, exist_ok=True)
    fitted = fit_measured(gpu, dirs, out=path)["gpus"][gpu]
    before, after = _roofline_errors(dirs, gpu, None), _roofline_errors(dirs, gpu, fitted)
    constants = {k: round(fitted[k], 4) for k in ("eff", "eff_mem", "launch_us", "gamma")}
    say(f"calibrated the roofline for {gpu} on {fitted['measured_on']['points']} points: {constants}")
    say(f"  error, in sample: median {_pct(after[0])}, p90 {_pct(after[1])} (shipped constants: median {_pct(before[0])}, p90 {_pct(before[1])})")
    say(f"  to ship it: python -m ppipe.profiler.estimate fit-measured {gpu} <the profile folders>, and calibration: {gpu} in gpus.yaml")
    return {"constants": constants, "file": str(path), "median_rel_error": after[0], "p90_rel_error": after[1],
            "shipped_median_rel_error": before[0], "shipped_p90_rel_error": before[1]}


def _roofline_errors(dirs: list[Path], gpu: str, params) -> tuple[float, float]:
    """Median and p90 relative error of the roofline (``params``, or the shipped ones) over the measured rows."""
    from ppipe.profiler.blocks import ensure_block_models
    from ppipe.profiler.estimate.gpus import gpu_spec
    from ppipe.profiler.estimate.roofline import block_latency_us, block_work_from_onnx, roofline_params
    from ppipe.spec.profile import load_profile

    params = params or roofline_params(gpu)
    err = []
    for d in dirs:
        prof = load_profile(d)
        works = block_work_from_onnx(ensure_block_models(prof))
        err += [abs(block_latency_us(works[b], gpu_spec(gpu), params, v, n) - lat) / lat for (g, v, n, b), lat in prof.table.items() if g == gpu]
    return float(np.median(err)), float(np.percentile(err, 90))


def _print_model(name: str, prof, est: dict, gpu: str, r: dict) -> None:
    ratio = r["median_estimate_over_measured"]
    say(f"{name}: {r['measured']} points measured in {r['seconds']} s; roofline vs measured over {r['points']} points: median error "
        f"{_pct(r['median_rel_error'])}, p90 {_pct(r['p90_rel_error'])}, median estimate/measured {'n/a' if ratio is None else f'{ratio:.2f}'}")
    say(f"  provenance: {r['provenance']}")
    say(f"  {'block':>5} {'b1 meas us':>11} {'b1 est us':>10} {'b8 meas us':>11} {'b8 est us':>10}")
    for blk in range(prof.num_blocks):
        row = [prof.table.get((gpu, 1, b, blk)) for b in (1, 8)]
        e = [est.get((gpu, 1, b, blk)) for b in (1, 8)]
        say(f"  {blk:>5} {_us(row[0]):>11} {_us(e[0]):>10} {_us(row[1]):>11} {_us(e[1]):>10}")


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.0f}%"


def _us(x) -> str:
    return "-" if x is None else f"{x:.0f}"


# ---- 2. blocks chained on the GPU vs the whole model on the CPU -----------------------------------------------------
def chain_models(batch: int, models=MODELS, device: str = "cuda") -> dict:
    """Each model's blocks on the GPU against the whole model in fp32 on the CPU (onnxruntime).

    Two ways: ``fp32`` runs the blocks eagerly one after another (the chain itself, no
    precision loss); ``served`` is how ``ppipe serve --backend torch`` runs them: two
    partitions (:class:`~ppipe.runtime.workers.torch_backend.TorchBackend`; fp16 and CUDA graphs on
    the GPU, fp32 on the CPU) with the feature maps handed over on the host, run twice so
    that the second run replays the captured graphs.
    """
    import onnxruntime as ort

    from ppipe.profiler.blocks import ensure_block_models, ensure_reference_model
    from ppipe.profiler.torch_backend import load_block
    from ppipe.runtime.workers.torch_backend import TorchBackend
    from ppipe.spec.profile import load_profile

    result = {}
    for name in models:
        prof = load_profile(REPO / "models" / name)
        sess = ort.InferenceSession(str(ensure_reference_model(prof)), providers=["CPUExecutionProvider"])
        inp, out = sess.get_inputs()[0].name, sess.get_outputs()[0].name
        x = np.random.default_rng(0).standard_normal((batch, *prof.manifest.input.shape)).astype(np.float32)
        want = sess.run(None, {inp: x})[0].reshape(batch, -1)
        env: dict = {inp: x}
        for path in ensure_block_models(prof):
            env.update(load_block(path, device, "fp32")(env))
        runs = {"fp32": env[out].float().cpu().numpy()}
        served = "fp16" if device == "cuda" else "fp32"  # fp16 runs on CUDA only
        cut, gpu = prof.num_blocks // 2, "gpu" if device == "cuda" else "cpu"
        up = TorchBackend(prof, gpu, 1, 0, cut - 1, precision=served)
        down = TorchBackend(prof, gpu, 1, cut, prof.num_blocks - 1, precision=served)
        first = down.run_sync(up.run_sync({inp: x}))[out]
        runs["served"] = down.run_sync(up.run_sync({inp: x}))[out]
        result[name] = {"batch": batch, "cuda_graphs": up.graphs is not None, "served_precision": served,
                        "replay_equals_first_run": bool(np.array_equal(first, runs["served"]))}
        for how in ("fp32", "served"):
            result[name][how] = r = _agreement(runs[how].reshape(batch, -1), want)
            what = "fp32 blocks one after another" if how == "fp32" else f"{served} served as two partitions"
            say(f"{name}: {what} on {device} vs fp32 whole model on the CPU (onnxruntime), batch {batch}: top-1 agreement "
                f"{100 * r['top1_agreement']:.0f}%, max |error| {r['max_abs_error']:.3g} ({100 * r['max_error_over_max_output']:.2g}% "
                f"of max |output|), output std {r['output_std']:.3g}")
        say(f"  served with CUDA graphs {'on' if result[name]['cuda_graphs'] else 'off'}; the second run equals the first: "
            f"{result[name]['replay_equals_first_run']}")
    return result


def _agreement(got: np.ndarray, want: np.ndarray) -> dict:
    return {
        "top1_agreement": float((got.argmax(1) == want.argmax(1)).mean()),
        "max_abs_error": float(np.abs(got - want).max()),
        "max_error_over_max_output": float(np.abs(got - want).max() / max(1e-30, np.abs(want).max())),
        "output_std": float(want.std()),
    }


# ---- 3. two workers on one GPU: CUDA IPC ------------------------------------------------------------------------------
def _ipc_receiver(inbox, acks, digests, n: int) -> None:
    from ppipe.runtime.workers.cuda_ipc import IpcReceiver

    rx = IpcReceiver(inbox, acks)
    for _ in range(n):
        _, got = rx.recv()
        digests.put(hashlib.sha256(got["fmap"].cpu().numpy().tobytes()).hexdigest())


def handoff(n: int, shape: tuple[int, ...], device: str = "cuda") -> dict:
    import torch
    import torch.multiprocessing as mp

    from ppipe.runtime.workers.cuda_ipc import IpcSender

    ctx = mp.get_context("spawn")
    inbox, acks, digests = ctx.Queue(), ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_ipc_receiver, args=(inbox, acks, digests, n + 1))
    proc.start()
    tx = IpcSender(inbox, acks)
    lat_us, equal = [], []
    for i in range(n + 1):  # message 0 warms up the receiver (its CUDA context, the IPC mapping)
        x = torch.randn(*shape, device=device).half()
        want = hashlib.sha256(x.cpu().numpy().tobytes()).hexdigest()
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        seq = tx.send(i, {"fmap": x})
        tx.release(wait_for=seq)  # the receiver has its own copy
        if i:
            lat_us.append((time.perf_counter() - t0) * 1e6)
        equal.append(digests.get(timeout=60) == want)
    proc.join(timeout=60)
    nbytes = int(np.prod(shape)) * 2
    r = {"device": device, "messages": n, "bytes": nbytes, "all_equal": all(equal), "median_us": float(np.median(lat_us)), "p90_us": float(np.percentile(lat_us, 90))}
    how = "on one GPU by CUDA IPC" if device == "cuda" else "in host shared memory (not CUDA IPC)"
    say(f"handoff: {n} fp16 feature maps of {nbytes / 1e6:.1f} MB between two processes {how}: bytes equal "
        f"{r['all_equal']}, latency (send to ack, copy included) median {r['median_us']:.0f} us, p90 {r['p90_us']:.0f} us")
    return r


def _ring_receiver(address, n: int, acks, digests) -> None:
    import asyncio

    from ppipe.runtime.workers.ring_link import ring_link
    from ppipe.runtime.workers.transport import EdgeChannel

    link = ring_link(address, 1)
    channel = EdgeChannel(link, "up", "recv")
    xp = link.xp

    async def go():
        for seq in range(n):
            tensors, _ = await channel.recv(seq, seq)
            acks.put(seq)  # the map is complete in this process's memory
            host = xp.asnumpy(tensors["fmap"]) if hasattr(xp, "asnumpy") else tensors["fmap"]
            digests.put(hashlib.sha256(host.tobytes()).hexdigest())

    asyncio.run(go())
    link.close()


def ring_handoff(n: int, shape: tuple[int, ...], device: str = "cuda") -> dict:
    """fp16 feature maps between two processes through the staging ring of :mod:`ppipe.runtime.workers.ring_link`.

    The sender posts each map on an :class:`~ppipe.runtime.workers.transport.EdgeChannel` over a
    ``RingLink`` (``cuda``: device memory and CUDA IPC events; ``cpu``: the host ring) and
    waits for the receiver's acknowledgement (the map complete in its memory): latency from
    send to that acknowledgement. The receiver's digests of what it got are compared after.
    """
    import asyncio
    import multiprocessing as mp

    from ppipe.runtime.workers.ring_link import ring_address, ring_link
    from ppipe.runtime.workers.transport import EdgeChannel

    kind = "cuda" if device == "cuda" else "host"
    address = ring_address(kind)
    ctx = mp.get_context("spawn")
    acks, digests = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_ring_receiver, args=(address, n + 1, acks, digests))
    proc.start()
    link = ring_link(address, 0)
    channel = EdgeChannel(link, "down", "send")
    xp = link.xp
    lat_us, wants = [], []

    async def go():
        loop = asyncio.get_running_loop()
        for seq in range(n + 1):  # message 0 warms up both ends
            x = xp.asarray(np.random.default_rng(seq).standard_normal(shape).astype(np.float16))
            wants.append(hashlib.sha256((xp.asnumpy(x) if hasattr(xp, "asnumpy") else x).tobytes()).hexdigest())
            t0 = time.perf_counter()
            await channel.send(seq, seq, {"fmap": x}, 0.0)
            await loop.run_in_executor(None, lambda: acks.get(timeout=60))
            if seq:
                lat_us.append((time.perf_counter() - t0) * 1e6)

    asyncio.run(go())
    equal = [digests.get(timeout=60) == want for want in wants]
    proc.join(timeout=60)
    link.close()
    nbytes = int(np.prod(shape)) * 2
    r = {"device": device, "ring": kind, "messages": n, "bytes": nbytes, "all_equal": all(equal),
         "median_us": float(np.median(lat_us)), "p90_us": float(np.percentile(lat_us, 90))}
    say(f"ring: {n} fp16 feature maps of {nbytes / 1e6:.1f} MB between two processes through the {kind} staging ring "
        f"(ppipe.runtime.workers.ring_link): bytes equal {r['all_equal']}, latency (send to the receiver's ack) "
        f"median {r['median_us']:.0f} us, p90 {r['p90_us']:.0f} us")
    return r


# ---- dry run ----------------------------------------------------------------------------------------------------------
def dry_run(env: dict, gpu: str | None, levels: list[int], dry: bool = True) -> dict:
    """What each step would do, what is missing here, and what is skipped; no GPU work."""
    from ppipe.profiler.estimate.gpus import gpu_spec
    from ppipe.profiler.run import batch_grid

    missing = [m for m in ("torch", "onnxscript", "pydantic", "onnxruntime") if not env["packages"][m]]
    assumed = "" if gpu else " (this GPU's type is unknown here: H100 assumed for the plan)"
    gpu = gpu or "H100"
    lv = [v for v in levels if v in gpu_spec(gpu).mps_levels]
    points = sum(len(b) for b in batch_grid(BATCHES, lv).values()) * 10
    for name in MODELS:
        if not (REPO / "models" / name / "model.yaml").is_file():
            raise SystemExit(f"dry run: models/{name}/model.yaml is missing")
    say(f"would profile {', '.join(MODELS)} on {gpu} with the torch backend: levels {lv}, batches 1-8, {points} points per model, "
        f"next to the roofline for {gpu} ({gpu_spec(gpu).source}){assumed}")
    say("would chain each model's blocks on the GPU in fp16 against the whole model on the CPU (onnxruntime fp32)")
    say("would hand fp16 feature maps between two processes on one GPU by CUDA IPC (bytes equal, latency)")
    say("would send them through the CUDA staging ring of ppipe.runtime.workers.ring_link too (bytes equal, latency)")
    why = "; ".join(w for w, on in (("dry run", dry), ("no CUDA device", not env["cuda"])) if on)
    say(f"skipped here ({why}): every step above" + (f"; missing packages: {', '.join(missing)}" if missing else ""))
    return {"dry_run": True, "gpu_type": gpu, "levels": lv, "points_per_model": points, "missing": missing, "skipped_because": why}


# ---- main ---------------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("gpu_check_out"), help="where gpu_check.json goes")
    ap.add_argument("--work", type=Path, default=Path("/tmp/ppipe-gpu-check"), help="where the profiles go")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--levels", default="1,2,3,4")
    ap.add_argument("--steps", default="profile,chain,handoff")
    ap.add_argument("--gpu-type", help="the spec sheet's name of this GPU (default: from the device name)")
    ap.add_argument("--profile-budget-s", type=float, default=200.0, help="start no further model after this long in step 1")
    ap.add_argument("--merge", action="store_true", help="add this run's steps to the summary already in --out")
    args = ap.parse_args(argv)
    levels = [int(v) for v in args.levels.split(",")]
    env = environment()
    gpu = args.gpu_type or env["gpu_type"]
    say(f"environment: python {sys.version.split()[0]}, torch {env.get('torch', 'missing')}, device {env['device'] or 'none'} "
        f"(spec-sheet type {gpu or 'unknown'}), packages {env['packages']}")
    summary: dict = {"environment": env}
    if args.merge and (args.out / "gpu_check.json").is_file():
        summary = json.loads((args.out / "gpu_check.json").read_text()) | summary
    if args.dry_run or not env["cuda"]:
        summary["plan"] = dry_run(env, gpu, levels, dry=args.dry_run)
        return _finish(summary, args.out, ok=args.dry_run)
    on_sheet = gpu is not None
    gpu = gpu or short_name(env["device"])
    steps = set(args.steps.split(","))
    if "profile" in steps:
        say(f"== 1. profile on {gpu} with the torch backend, next to the roofline")
        summary["profile"] = _step(profile_models, args.work / "profiles", gpu, args.reps, levels, on_sheet, args.profile_budget_s)
        _write(summary, args.out)
        if on_sheet and "error" not in summary["profile"]:
            say(f"== 1b. the roofline calibrated for {gpu} on these measurements")
            summary["calibration"] = _step(calibrate, args.work / "profiles", gpu, args.out)
            _write(summary, args.out)
    if "chain" in steps:
        say("== 2. blocks chained on the GPU (fp32 eager; fp16 served as two partitions) vs the whole model on the CPU")
        summary["chain"] = _step(chain_models, 8)
        _write(summary, args.out)
    if "handoff" in steps:
        say("== 3. two workers on one GPU: CUDA IPC handoff")
        summary["handoff"] = _step(handoff, 20, (8, 256, 56, 56))
        summary["ring"] = _step(ring_handoff, 20, (8, 256, 56, 56))
    return _finish(summary, args.out, ok=not any("error" in v for v in summary.values() if isinstance(v, dict)))


def _step(fn, *args) -> dict:
    """Run one step; a failure is reported (and kept in the summary), the next steps still run."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - the check reports every step
        import traceback

        traceback.print_exc()
        say(f"FAILED: {type(exc).__name__}: {exc}")
        return {"error": f"{type(exc).__name__}: {exc}"}


def _write(summary: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=1, default=str))


def _finish(summary: dict, out: Path, ok: bool) -> int:
    _write(summary, out)
    say(f"summary: {out / 'gpu_check.json'}")
    return 0 if ok else 3


if __name__ == "__main__":
    sys.exit(main())
