"""The GPU check of issue 23, driven by ``scripts/gpu_check.sh`` (see that file for how to run it).

Steps (each prints its result and adds it to the JSON summary):

1. ``profile``: the built-in ResNet-50, Inception-v2 and DenseNet-121 profiled on this GPU
   with the torch backend (their shipped cuts, batches 1-8, levels 1-4 as the spec sheet
   offers them; MPS levels where a daemon runs, else time-sliced, as the provenance says),
   each block latency next to the roofline's estimate for this GPU type: median and p90 of
   the relative error, and a batch-1 / batch-8 table per model. Then the roofline's
   constants fitted for this GPU type on these measurements (``roofline_<gpu>.json`` in
   ``--out``; :func:`~ppipe.profiler.estimate.roofline.fit_measured`), with the error after.
1c. ``serve``: ResNet-50 and Inception-v2 planned on the ``local-gpu`` cluster
   (:mod:`ppipe.spec.local_gpu`) with step 1's profiles (SLO 5x the measured batch-1
   latency, at least 10 ms), the plan served by ``ppipe serve --launcher local --backend
   torch`` (no Ray), one ResNet-50 answer compared with onnxruntime on the CPU, then both
   models driven at once by ``ppipe bench --binary`` at 0.5, 0.8 and 1.0 of the plan's rate
   (``ppipe simulate``'s load factor), each point's SLO attainment next to ``ppipe
   simulate``'s for the same plan, profiles, load, window and seed. The step has its own
   limit (``SERVE_LIMIT_S``). ``--rehearse-serve-on-cpu`` runs it alone on the CPU
   (``local-cpu``, ``--backend ort``, the shipped profiles).
2. ``chain``: each model's blocks chained on the GPU against the whole model in fp32 on the
   CPU (onnxruntime): in fp32 eagerly, and in fp16 as ``ppipe serve --backend torch`` runs
   them (two partitions, CUDA graphs): top-1 agreement and the largest error.
3. ``handoff``: a feature map handed between two processes on one GPU by CUDA IPC
   (:mod:`ppipe.runtime.workers.cuda_ipc`): bytes equal, latency per handoff; then the same maps
   through the staging ring that same-GPU edges are to use (:mod:`ppipe.runtime.workers.ring_link`).

``--dry-run`` does none of the GPU work: it checks what can be checked on any machine (the
packages, the models, the GPU type's spec sheet, the serve step's commands, parsed by the
ppipe CLI) and prints what each step would do and what it skips here. Nothing in this file
fakes a GPU result.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import shutil
import subprocess
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
    """A GPU type name for a device the sheet lacks (``NVIDIA H200`` -> ``H200``), as the
    ``local-gpu`` cluster names it, so that the serve step's plan finds step 1's profiles."""
    from ppipe.spec.local_gpu import sanitized_type

    return sanitized_type(device_name)


def gpu_type_of(device_name: str) -> str | None:
    """The spec sheet's GPU type for a CUDA device name (``NVIDIA H100 80GB HBM3`` -> ``H100``),
    by :func:`ppipe.spec.local_gpu.sheet_type` (whole words: an ``L40S`` is no ``L4``)."""
    from ppipe.profiler.estimate.gpus import known_gpus
    from ppipe.spec.local_gpu import sheet_type

    return sheet_type(device_name, known_gpus())


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


# ---- 1c. serve: the measured profiles planned on local-gpu, served, and driven by ppipe bench ---------------------------------
SERVE_MODELS = ("resnet50", "inception_v2")
SERVE_LOADS = (0.5, 0.8, 1.0)
SERVE_LIMIT_S = 150.0  # the whole step: plan, start, one checked request, three points, stop
SERVE_POINT_S = 8.0  # arrival window of each load point (bench and simulate alike)
SLO_SCALE = 5.0  # SLO = this x the measured batch-1 latency (the paper's rule, on this GPU)
MIN_SLO_MS = 10.0  # room for what the plan does not model: HTTP, the 0.6 MB body, the answer's trip
SERVE_PACKAGES = ("uvicorn", "starlette", "httptools", "msgspec", "orjson", "httpx")


def ppipe_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "ppipe.cli", *args]


def serve_commands(cluster: str, backend: str, model_dirs: dict[str, str], slos: dict[str, str], work: Path,
                   port: int | str, rates: dict[float, dict[str, str]]) -> dict:
    """The step's commands: plan, serve, and per load point one bench per model and one simulate."""
    plan_file = work / "plan.yaml"
    url = f"http://127.0.0.1:{port}"
    slo_args = [a for m in model_dirs for a in ("--slo-ms", f"{m}={slos[m]}")]
    bench = lambda load, m, r: ppipe_command("bench", url, "--model", m, "--rate", r, "--duration-s", f"{SERVE_POINT_S:g}",  # noqa: E731
                                             "--binary", "--seed", "0", "--json-out", str(work / f"bench_{m}_{load:g}.json"))
    return {
        "url": url,
        "plan_file": plan_file,
        "plan": ppipe_command("plan", cluster, *model_dirs.values(), *slo_args, "--time-limit-s", "20", "--quiet", "-o", str(plan_file)),
        "serve": ppipe_command("serve", str(plan_file), "--launcher", "local", "--backend", backend, "--port", str(port)),
        "bench": {load: {m: bench(load, m, r) for m, r in per_model.items()} for load, per_model in rates.items()},
        "simulate": {load: ppipe_command("simulate", str(plan_file), "--load", f"{load:g}", "--duration-s", f"{SERVE_POINT_S:g}",
                                         "--seed", "0", "--json", str(work / f"simulate_{load:g}.json")) for load in rates},
    }


def _shown(cmd: list[str]) -> str:
    return "ppipe " + " ".join(cmd[3:])


def check_commands(cmds: dict) -> None:
    """Parse every command's options with the ppipe CLI itself (nothing runs): a flag that
    ``ppipe plan``, ``serve``, ``bench`` or ``simulate`` does not take fails here, in the dry run."""
    import click

    from ppipe.cli import main

    ctx = click.Context(main)
    flat = [cmds["plan"], cmds["serve"], *(c for per in cmds["bench"].values() for c in per.values()), *cmds["simulate"].values()]
    for cmd in flat:
        args = cmd[3:]
        main.get_command(ctx, args[0]).make_context(args[0], list(args[1:]))


def serve_slos(profiles: dict[str, object], gpu: str) -> dict[str, float]:
    """Each model's SLO in ms: SLO_SCALE x its measured batch-1 latency on ``gpu``, at least MIN_SLO_MS."""
    return {m: round(max(SLO_SCALE * p.model_latency_us(gpu, 1, 1) / 1e3, MIN_SLO_MS), 2) for m, p in profiles.items()}


def serve_models(profiles_dir: Path, gpu: str, work: Path, cluster: str = "local-gpu", backend: str = "torch",
                 limit_s: float = SERVE_LIMIT_S) -> dict:
    """Plan the measured profiles on ``cluster``, serve the plan, check one answer against
    onnxruntime on the CPU, and drive it at SERVE_LOADS of the plan's rate next to ``ppipe simulate``
    (run meanwhile, in processes of their own)."""
    from ppipe.sim.sweep import base_rates

    deadline = time.monotonic() + limit_s
    work.mkdir(parents=True, exist_ok=True)
    profiles = _measured_profiles(profiles_dir, gpu)
    slos, port = serve_slos(profiles, gpu), _free_port()
    commands = lambda rates: serve_commands(cluster, backend, {m: str(profiles_dir / m) for m in profiles},  # noqa: E731
                                            {m: f"{v:g}" for m, v in slos.items()}, work, port, rates)
    base = base_rates(_make_plan(commands({}), deadline))
    cmds = commands({load: {m: f"{load * r:.3f}" for m, r in base.items()} for load in SERVE_LOADS})
    sims = [subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for c in cmds["simulate"].values()]
    try:
        result = {"cluster": cluster, "backend": backend, "slo_ms": slos, "rate_at_load_1_rps": base}
        result |= _drive(cmds, profiles[next(iter(profiles))], work, deadline, limit_s)
        for proc in sims:
            _wait(proc, deadline, "simulate")
    finally:
        for proc in sims:
            if proc.poll() is None:
                proc.kill()
    for load, point in result["points"].items():
        point["simulate"] = json.loads((work / f"simulate_{float(load):g}.json").read_text())["models"]
        _print_point(float(load), point, base)
    return result


def _measured_profiles(profiles_dir: Path, gpu: str) -> dict:
    """Step 1's profiles of SERVE_MODELS that time ``gpu`` at level 1, batch 1."""
    from ppipe.spec.profile import load_profile

    profiles = {m: load_profile(profiles_dir / m) for m in SERVE_MODELS if (profiles_dir / m / "profile.csv").is_file()}
    profiles = {m: p for m, p in profiles.items() if p.batches(gpu, 1)}
    if not profiles:
        raise RuntimeError(f"no measured profile of {', '.join(SERVE_MODELS)} on {gpu} in {profiles_dir}")
    return profiles


def _make_plan(cmds: dict, deadline: float):
    """Run ``ppipe plan``; print each model's SLO, rates and pipelines; the plan.

    The load points are fractions of ``ppipe simulate``'s load 1.0 (the rate the max-min
    plan promises every model), so that both are driven at the same rates; a model's
    pools can carry more (``throughput_rps``, with the headroom pass's extra vGPUs)."""
    from ppipe.sim.sweep import base_rates
    from ppipe.spec.plan import load_plan

    _run(cmds["plan"], deadline, "plan")
    plan = load_plan(cmds["plan_file"])
    base = base_rates(plan)
    for m in plan.models:
        parts = "; ".join(" -> ".join(f"blocks {p.first_block}-{p.last_block} on {p.count} x {p.gpu}/{p.vgpu}" for p in pl.partitions)
                          + f" at batch {pl.batch}" for pl in m.pipelines)
        say(f"  plan: {m.name}: SLO {m.slo_ms:g} ms, load 1.0 = {base[m.name]:.1f} req/s (pools' capacity "
            f"{m.throughput_rps:.1f}): {parts}")
    return plan


def _drive(cmds: dict, checked, work: Path, deadline: float, limit_s: float) -> dict:
    """Serve the plan; one answer of ``checked`` against onnxruntime, then the load points
    while the step's limit leaves room for them."""
    out: dict = {"points": {}}
    with _server(cmds["serve"], cmds["url"], work / "serve.log", deadline):
        out["answer_vs_onnxruntime"] = _step(_answer_check, cmds["url"], checked)
        for load in SERVE_LOADS:
            if time.monotonic() > deadline - SERVE_POINT_S - 10:
                say(f"  load {load:g}: skipped, the step's limit of {limit_s:.0f} s is near")
                continue
            out["points"][str(load)] = {"bench": _bench_point(cmds["bench"][load], deadline)}
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list[str], deadline: float, what: str) -> None:
    """Run one ppipe command to its end within the step's deadline; its error output is shown on failure."""
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=max(1.0, deadline - time.monotonic()))
    for line in r.stderr.splitlines():
        say(f"  {what}: {line}")
    if r.returncode:
        raise RuntimeError(f"`ppipe {what}` exited with {r.returncode}")


def _wait(proc: subprocess.Popen, deadline: float, what: str) -> None:
    try:
        _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        raise RuntimeError(f"`ppipe {what}` did not end within the step's limit") from None
    if proc.returncode:
        raise RuntimeError(f"`ppipe {what}` exited with {proc.returncode}: {err.strip()[-500:]}")


class _server:
    """``ppipe serve`` in a subprocess for a ``with`` block: ready on entry, stopped (as Ctrl-C
    stops it) on exit; its log goes to a file, whose end is shown when it fails to start."""

    def __init__(self, cmd: list[str], url: str, log: Path, deadline: float):
        self.cmd, self.url, self.log, self.deadline = cmd, url, log, deadline

    def __enter__(self):
        from ppipe.runtime.client.httpclient import wait_until_ready

        self.fh = self.log.open("w")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, stdout=self.fh, stderr=subprocess.STDOUT)
        try:
            wait_until_ready(self.url, self.proc, timeout_s=max(1.0, self.deadline - time.monotonic() - 3 * SERVE_POINT_S))
        except RuntimeError:
            self.__exit__()
            for line in self.log.read_text().splitlines()[-15:]:
                say(f"  serve: {line}")
            raise
        say(f"  serve: ready at {self.url} in {time.perf_counter() - t0:.1f} s ({_shown(self.cmd)})")
        return self

    def __exit__(self, *exc) -> None:
        import signal

        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.fh.close()


def _answer_check(url: str, prof) -> dict:
    """One request of seeded input to the server, its answer against the whole model in fp32
    on the CPU (onnxruntime)."""
    import httpx
    import onnxruntime as ort

    from ppipe.profiler.blocks import ensure_reference_model

    meta = httpx.get(f"{url}/v2/models/{prof.name}", timeout=10).json()
    x = np.random.default_rng(0).standard_normal((1, *prof.manifest.input.shape)).astype(np.float32)
    body = {"inputs": [{"name": meta["inputs"][0]["name"], "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]}
    answer = httpx.post(f"{url}/v2/models/{prof.name}/infer", json=body, timeout=30)
    answer.raise_for_status()
    sess = ort.InferenceSession(str(ensure_reference_model(prof)), providers=["CPUExecutionProvider"])
    want_out = sess.get_outputs()[0].name
    outputs = {o["name"]: o for o in answer.json()["outputs"]}
    got = np.asarray(outputs.get(want_out, next(iter(outputs.values())))["data"], dtype=np.float32).reshape(1, -1)
    want = sess.run(None, {sess.get_inputs()[0].name: x})[0].reshape(1, -1)
    r = _agreement(got, want)
    say(f"  {prof.name}: one served request vs the fp32 whole model on the CPU (onnxruntime): top-1 "
        f"{'equal' if r['top1_agreement'] == 1 else 'DIFFERENT'}, max |error| {r['max_abs_error']:.3g} "
        f"({100 * r['max_error_over_max_output']:.2g}% of max |output|)")
    return r


def _bench_point(cmds: dict[str, list[str]], deadline: float) -> dict:
    """One ``ppipe bench`` per model at once (each model's own arrivals); their JSON figures."""
    procs = {m: subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for m, c in cmds.items()}
    for p in procs.values():
        _wait(p, deadline, "bench")
    return {m: json.loads(Path(c[c.index("--json-out") + 1]).read_text()) for m, c in cmds.items()}


def _print_point(load: float, point: dict, base: dict[str, float]) -> None:
    for m, b in point["bench"].items():
        s = point["simulate"][m]
        say(f"  load {load:.2f} ({load * base[m]:.1f} req/s) {m}: served {100 * b['slo_attainment']:.1f} % on time "
            f"(p50 {_ms(b['p50_ms'])} / p99 {_ms(b['p99_ms'])} ms, drops {sum(b['drops'].values())}); "
            f"ppipe simulate {100 * s['attainment']:.1f} % (p50 {_ms(s['p50_latency_ms'])} ms)")


def _ms(x) -> str:
    return "-" if x is None else f"{x:.1f}"


# ---- dry run ----------------------------------------------------------------------------------------------------------
def dry_run(env: dict, gpu: str | None, levels: list[int], work: Path, dry: bool = True) -> dict:
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
    serve = dry_serve(work)
    say("would chain each model's blocks on the GPU in fp16 against the whole model on the CPU (onnxruntime fp32)")
    say("would hand fp16 feature maps between two processes on one GPU by CUDA IPC (bytes equal, latency)")
    say("would send them through the CUDA staging ring of ppipe.runtime.workers.ring_link too (bytes equal, latency)")
    why = "; ".join(w for w, on in (("dry run", dry), ("no CUDA device", not env["cuda"])) if on)
    say(f"skipped here ({why}): every step above" + (f"; missing packages: {', '.join(missing)}" if missing else ""))
    return {"dry_run": True, "gpu_type": gpu, "levels": lv, "points_per_model": points, "missing": missing, "skipped_because": why,
            "serve": serve}


def dry_serve(work: Path) -> dict:
    """The serve step's commands, built as the step builds them and parsed by the ppipe CLI, with
    placeholders where the step reads a measurement; and the packages ``ppipe serve`` needs."""
    dirs = {m: str(work / "profiles" / m) for m in SERVE_MODELS}
    slos = {m: f"<{SLO_SCALE:g}x-measured-batch-1-ms,min-{MIN_SLO_MS:g}>" for m in SERVE_MODELS}
    rates = {load: {m: f"<{load:g}x-planned-rps>" for m in SERVE_MODELS} for load in SERVE_LOADS}
    cmds = serve_commands("local-gpu", "torch", dirs, slos, work / "serve", "<free-port>", rates)
    # the same commands with sample values where a measurement goes, for the CLI to parse
    check_commands(serve_commands("local-gpu", "torch", dirs, {m: str(MIN_SLO_MS) for m in SERVE_MODELS}, work / "serve", 8000,
                                  {load: {m: "1.0" for m in SERVE_MODELS} for load in SERVE_LOADS}))
    say(f"would plan local-gpu for {', '.join(SERVE_MODELS)} with step 1's profiles: {_shown(cmds['plan'])}")
    say(f"would serve the plan and wait for {cmds['url']}/v2/health/ready: {_shown(cmds['serve'])}")
    say(f"would send one {SERVE_MODELS[0]} request and compare its answer with onnxruntime on the CPU")
    for load in SERVE_LOADS:
        for m, c in cmds["bench"][load].items():
            say(f"would bench {m} at load {load:g}: {_shown(c)}")
        say(f"would simulate load {load:g} for the same plan and profiles: {_shown(cmds['simulate'][load])}")
    missing = [m for m in SERVE_PACKAGES if importlib.util.find_spec(m) is None]
    if missing:
        say(f"missing for the serve step (ppipe serve): {', '.join(missing)}: carry their wheels (see the top of gpu_check.sh)")
    return {"commands_parsed": True, "loads": list(SERVE_LOADS), "models": list(SERVE_MODELS), "missing": missing}


# ---- main ---------------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("gpu_check_out"), help="where gpu_check.json goes")
    ap.add_argument("--work", type=Path, default=Path("/tmp/ppipe-gpu-check"), help="where the profiles go")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--levels", default="1,2,3,4")
    ap.add_argument("--steps", default="profile,serve,chain,handoff")
    ap.add_argument("--gpu-type", help="the spec sheet's name of this GPU (default: from the device name)")
    ap.add_argument("--profile-budget-s", type=float, default=150.0, help="start no further model after this long in step 1")
    ap.add_argument("--rehearse-serve-on-cpu", action="store_true",
                    help="run the serve step alone on this machine's CPU (cluster local-cpu, backend ort, the shipped profiles): no GPU")
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
    if args.rehearse_serve_on_cpu:
        say("== 1c. serve, rehearsed on the CPU: the shipped profiles planned on local-cpu, served with --backend ort")
        summary["serve"] = _step(serve_models, REPO / "models", "cpu", args.work / "serve-cpu", "local-cpu", "ort")
        return _finish(summary, args.out, ok="error" not in summary["serve"])
    if args.dry_run or not env["cuda"]:
        summary["plan"] = dry_run(env, gpu, levels, args.work, dry=args.dry_run)
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
    if "serve" in steps:
        say(f"== 1c. serve: {', '.join(SERVE_MODELS)} planned on local-gpu with step 1's profiles, served (--launcher local --backend torch), "
            f"driven at {', '.join(map(str, SERVE_LOADS))} of the plan's rate next to ppipe simulate")
        local = gpu_type_of(env["device"]) or short_name(env["device"])
        if gpu == local:
            summary["serve"] = _step(serve_models, args.work / "profiles", gpu, args.work / "serve")
        else:  # local-gpu names this GPU by its device name: the plan would find no profile under --gpu-type's name
            say(f"  skipped: step 1 measured as --gpu-type {gpu}, and local-gpu calls this GPU {local}; run without --gpu-type")
            summary["serve"] = {"skipped": f"--gpu-type {gpu} is not local-gpu's {local}"}
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
