"""Pre-partitioning into blocks, block sub-models, and their regeneration.

**Pre-partitioning.** The planner cuts a model only between *blocks* (10 by default, as
in the PPipe paper), so the profile stays small and the MILP fast. :func:`partition`
chooses the block boundaries among the valid cut points (:mod:`ppipe.profiler.graph`) by
dynamic programming over

    cost = Σ_blocks ((t_block − t̄) / t̄)²  +  λ · Σ_cuts bytes(cut) / bytes(input)

where t_block is the block's time from the per-layer timing on a reference device, t̄ the
mean block time and λ (``size_weight``) trades balance for small feature maps at the
cuts. A tensor may not skip over a whole block (every tensor crossing a cut is produced
in the block before it and consumed in the block after it), so each block's inputs are
exactly the previous block's outputs.

**Block sub-models.** :func:`extract_block` builds a runnable ONNX model of one block:
its compute nodes, a copy of the constant nodes and initializers they read, inputs =
the tensors crossing the cut before it, outputs = those crossing the cut after it, batch
dimension symbolic. :func:`run_blocks` runs them in sequence (optionally rounding the cut
tensors to fp16, as they are transmitted).

**Regeneration.** Block files of built-in models are not committed (size).
:func:`ensure_block_models` rebuilds them deterministically from what ``model.yaml``
records (built-in name + weights seed, or the source file; the cuts by node name) into a
cache folder, ``$PPIPE_CACHE/<name>/`` or ``~/.cache/ppipe/<name>/``.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from ppipe.errors import UserError
from ppipe.profiler.graph import BATCH_DIM, GraphInfo, analyze, load_onnx, prepare_model

DEFAULT_BLOCKS = 10
DEFAULT_SIZE_WEIGHT = 0.1  # measured on resnet50/inception_v2/densenet121: 0.25 unbalanced blocks for ~10 % smaller cuts
BLOCK_FORMAT = 1  # bump when extraction changes, to invalidate caches


@dataclass(frozen=True)
class Block:
    """One block: compute positions ``first..last`` (inclusive) of a :class:`GraphInfo`."""

    index: int
    first: int
    last: int
    in_tensors: tuple[str, ...]
    out_tensors: tuple[str, ...]
    out_bytes_per_sample: int
    time_share: float  # fraction of the reference time spent in this block


# ----------------------------------------------------------------------------------------
# partitioning
# ----------------------------------------------------------------------------------------
def partition(
    info: GraphInfo,
    node_times_us: Sequence[float] | None,
    num_blocks: int = DEFAULT_BLOCKS,
    size_weight: float = DEFAULT_SIZE_WEIGHT,
) -> list[Block]:
    """Split the compute nodes into ``num_blocks`` blocks of about equal time.

    Args:
        info: the analyzed model.
        node_times_us: time of each compute node (by compute position) on the reference
            device; ``None`` or all zero: every node counts the same.
        num_blocks: number of blocks wanted.
        size_weight: λ in the module docstring.

    Raises:
        UserError: the model has fewer usable cut points than ``num_blocks - 1``.
    """
    n = len(info.compute_nodes)
    times = np.ones(n) if node_times_us is None else np.asarray(node_times_us, dtype=float)
    if times.shape != (n,):
        raise ValueError(f"node_times_us has {times.shape} entries, the model {n} compute nodes")
    if not np.any(times > 0):
        times = np.ones(n)
    cum = np.concatenate([[0.0], np.cumsum(times)])  # cum[p + 1] = time through position p
    total = cum[-1]
    # candidate boundaries: the virtual cut before node 0, then the valid cuts
    out_cut = info.cuts[-1]
    positions = np.array([-1] + [c.position for c in info.cuts], dtype=int)
    live_until = np.array([info.input_live_until] + [c.live_until for c in info.cuts], dtype=int)
    in_bytes = max(sum(info.tensor_bytes(t) or 0 for t in [info.input_name]), 1)
    size_cost = np.array([0.0] + [size_weight * c.bytes_per_sample / in_bytes for c in info.cuts])
    size_cost[-1] = 0.0  # the model output is not a cut
    k_max = len(positions) - 1
    if num_blocks < 1:
        raise UserError(f"--blocks {num_blocks}: need at least 1 block", fix="give --blocks 1 or more")
    mean = total / num_blocks
    t_at = cum[positions + 1]
    inf = float("inf")
    # dp[k][j]: best cost of k blocks ending at candidate j; parent pointers for the path
    dp = np.full((num_blocks + 1, k_max + 1), inf)
    parent = np.full((num_blocks + 1, k_max + 1), -1, dtype=int)
    dp[0][0] = 0.0
    for k in range(1, num_blocks + 1):
        prev = dp[k - 1]
        ok_prev = np.isfinite(prev)
        if not ok_prev.any():
            break
        for j in range(1, k_max + 1):
            # a block (i, j]: i < j, nothing crossing cut i lives past cut j
            cand = ok_prev[:j] & (live_until[:j] <= positions[j])
            if not cand.any():
                continue
            idx = np.nonzero(cand)[0]
            block_t = t_at[j] - t_at[idx]
            cost = prev[idx] + ((block_t - mean) / mean) ** 2 + size_cost[j]
            b = int(np.argmin(cost))
            dp[k][j] = cost[b]
            parent[k][j] = idx[b]
    if not np.isfinite(dp[num_blocks][k_max]):
        feasible = [k for k in range(1, num_blocks + 1) if np.isfinite(dp[k][k_max])]
        raise UserError(
            f"cannot cut this model into {num_blocks} blocks: it has too few cut points where no tensor skips a block",
            fix=f"use --blocks {max(feasible) if feasible else 1}",
        )
    # walk back
    bounds = [k_max]
    j = k_max
    for k in range(num_blocks, 0, -1):
        j = int(parent[k][j])
        bounds.append(j)
    bounds.reverse()  # candidate indices: 0 (= before node 0), ..., k_max
    blocks = []
    for b in range(num_blocks):
        i, j = bounds[b], bounds[b + 1]
        first = int(positions[i]) + 1
        last = int(positions[j])
        cut_in = None if i == 0 else info.cuts[i - 1]
        cut_out = info.cuts[j - 1]
        blocks.append(
            Block(
                index=b,
                first=first,
                last=last,
                in_tensors=(info.input_name,) if cut_in is None else cut_in.tensors,
                out_tensors=out_cut.tensors if j == k_max else cut_out.tensors,
                out_bytes_per_sample=cut_out.bytes_per_sample,
                time_share=float((t_at[j] - t_at[i]) / total),
            )
        )
    return blocks


def blocks_from_last_nodes(info: GraphInfo, last_nodes: Sequence[str]) -> list[Block]:
    """Rebuild blocks from the names of their last nodes (as model.yaml records them)."""
    blocks, first = [], 0
    prev_tensors: tuple[str, ...] = (info.input_name,)
    for b, name in enumerate(last_nodes):
        pos = info.position_of(name)
        cut = info.cut_at(pos)
        if cut is None or pos < first:
            raise UserError(f"block {b}: node {name!r} is not a valid cut of this model", fix="re-run `ppipe profile` to re-cut it")
        blocks.append(Block(b, first, pos, prev_tensors, cut.tensors, cut.bytes_per_sample, 0.0))
        prev_tensors, first = cut.tensors, pos + 1
    if blocks and blocks[-1].last != len(info.compute_nodes) - 1:
        raise UserError("the last block does not end at the model output", fix="re-run `ppipe profile` to re-cut the model")
    return blocks


# ----------------------------------------------------------------------------------------
# extraction and execution
# ----------------------------------------------------------------------------------------
def _value_info(info: GraphInfo, name: str):
    from onnx import helper

    shape = [BATCH_DIM] + list(info.shapes[name])
    return helper.make_tensor_value_info(name, info.elem_types[name], shape)


def extract_block(info: GraphInfo, block: Block, name: str = "block"):
    """A runnable ``onnx.ModelProto`` of one block (batch dimension symbolic)."""
    from onnx import helper

    g = info.model.graph
    idx = [info.compute_nodes[p] for p in range(block.first, block.last + 1)]
    # constant nodes this block reads, transitively (copied into every block that needs them)
    producer = {o: i for i in info.const_nodes for o in g.node[i].output}
    need: set[int] = set()
    stack = [x for i in idx for x in g.node[i].input]
    while stack:
        t = stack.pop()
        i = producer.get(t)
        if i is not None and i not in need:
            need.add(i)
            stack.extend(g.node[i].input)
    node_ids = sorted(need) + idx  # constant nodes first: they depend on parameters only
    nodes = [g.node[i] for i in node_ids]
    read = {x for n in nodes for x in n.input}
    inits = [t for t in g.initializer if t.name in read]
    produced = {o for n in nodes for o in n.output}
    vis = [v for v in g.value_info if v.name in produced and v.name not in block.out_tensors]
    graph = helper.make_graph(
        nodes,
        f"{name}",
        inputs=[_value_info(info, t) for t in block.in_tensors],
        outputs=[_value_info(info, t) for t in block.out_tensors],
        initializer=inits,
        value_info=vis,
    )
    m = helper.make_model(graph, opset_imports=list(info.model.opset_import), producer_name="ppipe")
    m.ir_version = info.model.ir_version
    return m


def reference_model(info: GraphInfo):
    """The whole prepared fp32 model (the reference the blocks must reproduce)."""
    return info.model


def make_input(info_or_shape, batch: int, seed: int = 0) -> np.ndarray:
    """A seeded random image batch: per-channel offsets plus unit noise (fp32)."""
    shape = list(info_or_shape.input_shape if isinstance(info_or_shape, GraphInfo) else info_or_shape)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal([batch] + shape)
    if len(shape) >= 1:
        x = x + rng.uniform(-2, 2, size=[batch, shape[0]] + [1] * (len(shape) - 1))
    return x.astype(np.float32)


def run_blocks(block_models: Sequence, feeds: dict[str, np.ndarray], fp16_cuts: bool = False, threads: int | None = None) -> dict[str, np.ndarray]:
    """Run block sub-models (paths or ModelProtos) in sequence; return the last block's outputs.

    Args:
        block_models: the blocks in order.
        feeds: the first block's inputs by name.
        fp16_cuts: round every tensor crossing a cut to fp16 (as ppipe transmits it).
        threads: intra-op threads of each session.
    """
    from ppipe.profiler.ort_backend import make_session

    current = dict(feeds)
    for i, bm in enumerate(block_models):
        sess = make_session(bm, threads or 0)
        names = [o.name for o in sess.get_outputs()]
        outs = sess.run(names, {x.name: current[x.name] for x in sess.get_inputs()})
        current = dict(zip(names, outs))
        if fp16_cuts and i < len(block_models) - 1:
            current = {k: (v.astype(np.float16).astype(v.dtype) if v.dtype.kind == "f" else v) for k, v in current.items()}
    return current


# ----------------------------------------------------------------------------------------
# regeneration from model.yaml
# ----------------------------------------------------------------------------------------
def cache_root() -> Path:
    """``$PPIPE_CACHE`` or ``~/.cache/ppipe``."""
    env = os.environ.get("PPIPE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "ppipe"


def load_source(manifest) -> tuple[object, str]:
    """Load the source ONNX model a manifest records (built-in with its seed, or a file).

    Returns:
        ``(prepared-and-analyzed GraphInfo, sha256 or "")``.
    """
    from ppipe.profiler.builtin import DEFAULT_SEED, load_builtin
    from ppipe.profiler.graph import file_sha256

    src = manifest.source
    if src.kind == "builtin":
        if not src.builtin:
            raise UserError("source.builtin is not set", fix="re-run `ppipe profile --builtin NAME`")
        seed = DEFAULT_SEED if src.weights_seed is None else src.weights_seed
        model, path = load_builtin(src.builtin, seed)
    elif src.kind == "onnx":
        if not src.path or not Path(src.path).is_file():
            raise UserError(
                f"the source ONNX file {src.path!r} of model {manifest.name!r} is not here, and neither are its block files",
                fix="copy the model folder with its blocks/ folder, or re-run `ppipe profile` on the ONNX file",
            )
        path = Path(src.path)
        model = load_onnx(path)
    else:
        raise UserError(
            f"model {manifest.name!r} comes from {src.kind!r}: it has no ONNX graph to cut",
            fix="profile the ONNX model with `ppipe profile` to get runnable blocks",
        )
    sha = file_sha256(path)
    # a built-in's file may differ between onnx releases: the per-block structural check
    # in ensure_block_models decides there; a user's file must be the one profiled
    if src.kind == "onnx" and src.sha256 and src.sha256 != sha:
        raise UserError(
            f"the source ONNX file changed since model {manifest.name!r} was profiled (sha256 differs)",
            fix="re-run `ppipe profile` on it",
            file=str(path),
        )
    shape = manifest.input.shape if manifest.input is not None else None
    info = analyze(prepare_model(model, input_shape=shape, source=str(path)))
    return info, sha


def block_fingerprint(manifest) -> str:
    payload = {
        "format": BLOCK_FORMAT,
        "source": manifest.source.model_dump(mode="json"),
        "input": manifest.input.model_dump(mode="json") if manifest.input else None,
        "cuts": [b.last_node for b in manifest.blocks],
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _replace_atomically(path: Path, write) -> None:
    """``write(tmp)`` then rename over ``path``: a reader sees the old file or the new one,
    never half of one (the workers of one model start together and may regenerate its
    blocks at the same time, each loading them as soon as its own call returns)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_blocks(info: GraphInfo, blocks: Sequence[Block], out_dir: Path, name: str) -> list[Path]:
    """Extract and save every block as ``block_XX.onnx`` in ``out_dir`` (each file replaced atomically)."""
    import onnx

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for b in blocks:
        p = out_dir / f"block_{b.index:02d}.onnx"
        model = extract_block(info, b, f"{name}_block_{b.index:02d}")
        _replace_atomically(p, lambda tmp, model=model: onnx.save(model, str(tmp)))
        paths.append(p)
    return paths


def ensure_block_models(profile, cache_dir: Path | None = None) -> list[Path]:
    """Runnable ONNX files of a profile's blocks, regenerating them if needed.

    If ``model.yaml`` lists block files that exist, those are returned. Otherwise the
    blocks are rebuilt from the recorded source (built-in name + weights seed, or the
    source file) and cuts, into ``cache_dir`` (default ``$PPIPE_CACHE/<name>`` or
    ``~/.cache/ppipe/<name>``); a stamp file makes later calls free.

    Args:
        profile: a :class:`ppipe.spec.profile.ModelProfile`.
        cache_dir: where to write the files.

    Returns:
        One path per block, in order.

    Raises:
        UserError: the source is not available, changed, or no longer cuts the same way.
    """
    listed = [profile.block_onnx_path(i) for i in range(profile.num_blocks)]
    if all(p is not None and p.is_file() for p in listed):
        return [Path(p) for p in listed]
    manifest = profile.manifest
    out = Path(cache_dir) if cache_dir is not None else cache_root() / manifest.name
    stamp = out / "blocks.stamp.json"
    fp = block_fingerprint(manifest)
    paths = [out / f"block_{i:02d}.onnx" for i in range(profile.num_blocks)]
    if stamp.is_file() and all(p.is_file() for p in paths):
        try:
            if json.loads(stamp.read_text()).get("fingerprint") == fp:
                return paths
        except ValueError:
            pass
    info, _sha = load_source(manifest)
    blocks = blocks_from_last_nodes(info, [b.last_node for b in manifest.blocks])
    for b, spec in zip(blocks, manifest.blocks):
        if list(b.out_tensors) != list(spec.out_tensors) or b.out_bytes_per_sample != spec.out_bytes_per_sample:
            raise UserError(
                f"block {b.index} of {manifest.name!r} regenerates with outputs {list(b.out_tensors)} "
                f"({b.out_bytes_per_sample} B), model.yaml says {spec.out_tensors} ({spec.out_bytes_per_sample} B)",
                fix="re-run `ppipe profile` for this model (the onnx package or the source changed)",
            )
    written = write_blocks(info, blocks, out, manifest.name)
    _replace_atomically(stamp, lambda tmp: tmp.write_text(json.dumps({"fingerprint": fp, "model": manifest.name})))
    return written


def ensure_reference_model(profile, cache_dir: Path | None = None) -> Path:
    """The whole fp32 model (prepared like the blocks) as an ONNX file, for correctness checks."""
    import onnx

    manifest = profile.manifest
    out = Path(cache_dir) if cache_dir is not None else cache_root() / manifest.name
    p = out / "reference.onnx"
    stamp = out / "reference.stamp.json"
    fp = block_fingerprint(manifest)
    if p.is_file() and stamp.is_file():
        try:
            if json.loads(stamp.read_text()).get("fingerprint") == fp:
                return p
        except ValueError:
            pass
    info, _sha = load_source(manifest)
    out.mkdir(parents=True, exist_ok=True)
    model = reference_model(info)
    _replace_atomically(p, lambda tmp: onnx.save(model, str(tmp)))
    _replace_atomically(stamp, lambda tmp: tmp.write_text(json.dumps({"fingerprint": fp, "model": manifest.name})))
    return p


def input_spec(profile):
    """The model input (name, per-sample shape, dtype) as recorded in model.yaml."""
    if profile.manifest.input is None:
        raise UserError(f"model {profile.name!r} records no input", fix="re-run `ppipe profile` for it")
    return profile.manifest.input


__all__ = [
    "Block",
    "DEFAULT_BLOCKS",
    "blocks_from_last_nodes",
    "cache_root",
    "ensure_block_models",
    "ensure_reference_model",
    "extract_block",
    "input_spec",
    "make_input",
    "partition",
    "reference_model",
    "run_blocks",
    "write_blocks",
]
