"""Cross-GPU latency model: a model's block latencies on a GPU type it was not profiled on.

Learned from real timings (the PPipe artifact: 28 CNNs, TensorRT, on L4, P4, T4, V100).
For an ordered pair of GPU types (source s, target t), a target vGPU level v and a batch
b, the latency of block i on the target is the measured source latency times a learned
ratio::

    T(t, v, b, i) = S(s, v', b, i) * exp(f_{s,t,v,b,v'}(x_i))

where v' = v if the source profile has level v (else 1: e.g. a P4, which has no MPS
levels in the artifact) and x_i are features of block i that the source profile alone
gives (no target timing is ever used).

Features of a block (:func:`static_features`, :func:`dynamic_feature`):

* from the block timings: ``log S(1,1)`` (size); ``log S(1,b)/S(1,1)`` for b = 2, 4, 8
  and ``log S(v',b)/S(1,1)`` (how the block scales with batch and MPS share on the
  source: compute-bound vs launch- or memory-bound); feature-map bytes per microsecond at
  its cuts; its position in the model;
* when the source's per-layer (per ONNX node, batch 1) latencies and the node-to-block
  mapping are given: the share of the block's per-layer time in each op class and in a few
  op types, ``log (sum of per-layer latencies) / S(1,1)`` (how much it gains from
  fusion), and, per other GPU type g, the block's **per-layer predicted ratio**
  ``log sum_j S_j exp(r_{s,g}(j)) / sum_j S_j`` where ``r_{s,g}`` is a layer-level model
  (:class:`LayerRatioModel`) of the log latency ratio g/s of one node from its op type and
  its source latency, fitted on every node of the training models. It carries what the op
  mix means for this GPU pair (a large memory-bound ``Relu`` runs 5x slower on a P4 than
  on an L4, a tiny one about as fast), which the op shares alone leave to the block
  regressor to learn from ~270 blocks.

``f`` is a kernel ridge regression (scikit-learn's ``KernelRidge`` on the precomputed
kernel) with the kernel ``c + z.z' + rho * k_gamma(z, z')`` on the standardized features z
(linear part + RBF part, the RBF part approximated by random Fourier features,
scikit-learn's ``RBFSampler``, so that the fitted parameters are weights, not training
samples), penalty ``lambda``. One ``f`` per (s, t, v, b, v', feature set). Optionally (off by default, see
:func:`fit_cross_gpu_from_models`), ``f`` takes the per-layer predicted ratio to t as its
prior mean (an offset: it fits the difference and, for a block unlike the training
blocks, shrinks towards that physically derived ratio instead of the training mean),
chosen or not like the hyper-parameters.

Hyper-parameters (gamma, rho, lambda) are chosen by **leave-one-model-out on the
training models** every time the model is fitted (:func:`fit_cross_gpu_from_models`),
per GPU pair and feature set, from :data:`HYPER_GRID`, by the median + 90th percentile of
the held-out block errors. The folds are scikit-learn's ``LeaveOneGroupOut`` over the
models; the held-out predictions come from the exact closed form of kernel ridge
regression with a group of rows deleted (:func:`_group_loo_errors`, no refit per fold),
so the selection costs little. An evaluation that holds a model out and fits on the others
therefore runs a nested cross-validation: the held-out model never takes part in
choosing the hyper-parameters (``scripts/bench_estimator.py`` reports that figure). Two
approximations inside the inner loop, both free of target timings of the inner held-out
model's blocks except as noted: the feature standardization uses all training models
(features only), and the layer-ratio features of the other inner-training models come
from layer models that saw the inner held-out model's nodes (the held-out model's own
layer features are cross-fitted without it).

Each prediction is clipped to the range of its training log ratios (a block unlike any
training block otherwise extrapolates far beyond any ratio ever measured). The fitted
parameters are stored in ``cross_gpu.npz`` next to this module (weights only, no
training data) and produced by :func:`fit_cross_gpu` from an artifact folder.

**What a user gets.** ``ppipe profile --measure L4 --estimate-from L4`` times every ONNX
node of the model on the L4 with TensorRT (``per-node`` mode: each node its own kernel,
like the artifact's per-layer tables), keeps them in ``layers.csv`` with the op types of
the graph, and passes them here with node -> block from model.yaml
(:func:`ppipe.profiler.layers.cross_gpu_layer_inputs`): the per-layer model. A profile
without per-node timings of the source (``--trt-layers fused``, timings measured
elsewhere, an imported profile) gets the blocks-only model; the provenance of each
estimated GPU type says which. A ``fused`` profile's per-node times are not used as
features: element-wise nodes get almost nothing there, unlike the artifact's.
``tests/profiler/test_user_path.py`` profiles an artifact model through that path and gets
the benchmark's predictions.

Accuracy: ``scripts/bench_estimator.py`` (nested leave-one-model-out over the artifact's
models); its figures, and how the design was chosen, are in ``docs/benchmarks.md``
("Cross-GPU estimator").
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np
from sklearn.kernel_approximation import RBFSampler
from sklearn.kernel_ridge import KernelRidge
from sklearn.model_selection import LeaveOneGroupOut

from ppipe.errors import UserError
from ppipe.spec.profile import ModelProfile

from ppipe.profiler.estimate.artifact_data import ArtifactModel, load_all, op_type_of

DATA_FILE = Path(__file__).with_name("cross_gpu.npz")
FORMAT_VERSION = 7  # 7: random Fourier features drawn by scikit-learn's RBFSampler

# Candidate hyper-parameters (gamma: RBF width factor, the squared distance is divided by
# 2 * gamma * n_features; rho: weight of the RBF part against the linear part; lambda:
# ridge penalty). Chosen per fit by inner leave-one-model-out, never by the test set.
GAMMAS = (0.5, 1.0, 2.0)
RHOS = (1.0, 3.0, 10.0, 30.0, 100.0)
LAMBDAS = (1.0, 3.0, 10.0, 30.0, 100.0)
# The selection scores the variants of these batches only (half the work; the chosen
# values apply to every batch of the pair).
SELECT_BATCHES = (1, 2, 4, 8)
HYPER_GRID: tuple[tuple[float, float, float], ...] = tuple((g, r, l) for g in GAMMAS for r in RHOS for l in LAMBDAS)
# Prior variance of the intercept (large: it is practically not shrunk).
INTERCEPT_PRIOR = 1e3
# Random Fourier features approximating the RBF kernel (their count and seed).
RFF_FEATURES = 256
RFF_SEED = 20250701
# Predicted log ratios are clipped to the training targets' range widened by this
# fraction of it (see _Regressor).
CLIP_MARGIN = 0.0

# Layer-level ratio model: ridge penalty on everything but the intercept (each training
# model's nodes carry a total weight of 1, so an op type seen in a tenth of a model's time
# is shrunk about halfway to its op class), op types kept as their own term when the
# training models have at least this many such nodes in at least two models, and the
# centre of log latency (about 20 us).
LAYER_RIDGE = 0.1
LAYER_MIN_NODES = 20
LAYER_LOG_CENTER = 3.0

# The batches of level 1 that the features read on the source.
FEATURE_BATCHES = (1, 2, 4, 8)

OP_CLASSES = ("conv", "matmul", "pool", "reduce", "eltwise", "move", "shape", "other")
_OP_CLASS = {
    **dict.fromkeys(["Conv", "ConvTranspose", "ConvInteger", "QLinearConv"], "conv"),
    **dict.fromkeys(["MatMul", "Gemm", "MatMulInteger", "Einsum"], "matmul"),
    **dict.fromkeys(["MaxPool", "AveragePool", "LpPool", "MaxUnpool"], "pool"),
    **dict.fromkeys(
        ["GlobalAveragePool", "GlobalMaxPool", "ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceL2",
         "ReduceL1", "ReduceProd", "Softmax", "LogSoftmax", "InstanceNormalization", "LayerNormalization",
         "GroupNormalization", "LRN", "ArgMax", "ArgMin", "TopK", "GatherTopk", "CumSum"],
        "reduce",
    ),
    **dict.fromkeys(
        ["Relu", "Add", "Mul", "Sigmoid", "Sub", "Div", "Pow", "Sqrt", "Erf", "Clip", "Tanh", "Exp", "Log",
         "HardSigmoid", "HardSwish", "LeakyRelu", "PRelu", "Elu", "Selu", "Where", "Equal", "Greater", "Less",
         "Not", "And", "Or", "Sin", "Cos", "Abs", "Neg", "Reciprocal", "Floor", "Ceil", "Round", "Min", "Max",
         "BatchNormalization", "Softplus", "Mish", "Gelu", "Identity", "Dropout"],
        "eltwise",
    ),
    **dict.fromkeys(
        ["Concat", "Transpose", "Slice", "Pad", "Resize", "Upsample", "Expand", "Tile", "Split", "GatherElements",
         "ScatterND", "ScatterElements", "DepthToSpace", "SpaceToDepth"],
        "move",
    ),
    **dict.fromkeys(
        ["Reshape", "Gather", "Unsqueeze", "Squeeze", "Shape", "Flatten", "Cast", "Range", "ConstantOfShape",
         "Constant", "NonZero", "Size"],
        "shape",
    ),
}


# Op types whose own share separates families the classes lump together (SiLU = Sigmoid +
# Mul in EfficientNets, LayerNorm's ReduceMean in ConvNeXt, plain ReLU ResNets).
SHARE_OPS = ("Sigmoid", "Mul", "Relu", "Add", "ReduceMean", "Transpose")
# Per-layer predicted ratio features: one per other GPU type of the model, in sorted order.
N_LAYER_RATIOS = 3


def op_class(op_type: str) -> str:
    """The op class (one of :data:`OP_CLASSES`) of an ONNX op type."""
    return _OP_CLASS.get(op_type, "other")


def _stat_feature_names(with_layers: bool) -> list[str]:
    names = ["log_s11", "log_s18", "log_s12", "log_s14", "log_in_bytes_per_us", "log_out_bytes_per_us", "position"]
    if with_layers:
        names += [f"share_{c}" for c in OP_CLASSES] + ["log_layer_sum_over_block"] + [f"share_op_{o}" for o in SHARE_OPS]
        names += [f"log_layer_ratio_{k}" for k in range(N_LAYER_RATIOS)]
    return names


N_STATIC_BLOCKS_ONLY = len(_stat_feature_names(False))
N_STATIC_FULL = len(_stat_feature_names(True))


# ---------------------------------------------------------------------------------
# layer-level ratio model
# ---------------------------------------------------------------------------------
def _layer_design(op_types: Sequence[str], lat_us: np.ndarray, ops: Sequence[str]) -> np.ndarray:
    """Rows: [1, l, l^2, class one-hot, class one-hot * l, op one-hot, op one-hot * l] with
    l the centred log source latency. Op terms sit on top of their class's terms, which sit
    on top of the global ones, so the ridge shrinks a rare op towards its class."""
    n = len(op_types)
    ll = np.log(np.maximum(lat_us, 0.1)) - LAYER_LOG_CENTER
    cls = np.zeros((n, len(OP_CLASSES)))
    cls[np.arange(n), [OP_CLASSES.index(op_class(o)) for o in op_types]] = 1.0
    index = {o: k for k, o in enumerate(ops)}
    one = np.zeros((n, len(ops)))
    for r, o in enumerate(op_types):
        k = index.get(o)
        if k is not None:
            one[r, k] = 1.0
    return np.concatenate([np.ones((n, 1)), ll[:, None], ll[:, None] ** 2, cls, cls * ll[:, None], one, one * ll[:, None]], axis=1)


@dataclass
class LayerRatioModel:
    """Log latency ratio target/source of one ONNX node (batch 1, whole GPU) from its op
    type and source latency: a weighted ridge regression on :func:`_layer_design` rows.

    Attributes:
        ops: op types with their own terms (the others use their op class's terms).
        coef: regression weights.
    """

    ops: tuple[str, ...]
    coef: np.ndarray

    def predict(self, op_types: Sequence[str], lat_us: np.ndarray) -> np.ndarray:
        return _layer_design(op_types, lat_us, self.ops) @ self.coef

    def block_log_ratios(self, op_types: Sequence[str], lat_us: np.ndarray, blocks: np.ndarray, nb: int) -> np.ndarray:
        """Per block, ``log sum_j S_j exp(r(j)) / sum_j S_j`` over the block's nodes."""
        pred = lat_us * np.exp(self.predict(op_types, lat_us))
        num = np.bincount(blocks, weights=pred, minlength=nb)
        den = np.bincount(blocks, weights=lat_us, minlength=nb)
        return np.log(np.maximum(num, 1e-9) / np.maximum(den, 1e-9))


def _layer_stats(op_types: Sequence[str], src_us: np.ndarray, tgt_us: np.ndarray, ops: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """(X'WX, X'Wy) of one model's nodes; weights = the node's share of the model's source
    time, so every model counts once and, inside it, the nodes that make the time."""
    ok = np.isfinite(src_us) & np.isfinite(tgt_us) & (src_us > 0) & (tgt_us > 0)
    x = _layer_design([o for o, k in zip(op_types, ok) if k], src_us[ok], ops)
    y = np.log(tgt_us[ok] / src_us[ok])
    w = src_us[ok] / src_us[ok].sum()
    xw = x * w[:, None]
    return xw.T @ x, xw.T @ y


def _layer_solve(xtx: np.ndarray, xty: np.ndarray) -> np.ndarray:
    reg = LAYER_RIDGE * np.eye(len(xtx))
    reg[0, 0] = 0.0
    return np.linalg.solve(xtx + reg, xty)


def _layer_vocabulary(models: Sequence[ArtifactModel]) -> tuple[str, ...]:
    count: dict[str, int] = {}
    in_models: dict[str, int] = {}
    for am in models:
        types = am.op_types
        for o in set(types):
            in_models[o] = in_models.get(o, 0) + 1
        for o in types:
            count[o] = count.get(o, 0) + 1
    return tuple(sorted(o for o, c in count.items() if c >= LAYER_MIN_NODES and in_models[o] >= 2))


# ---------------------------------------------------------------------------------
# features
# ---------------------------------------------------------------------------------
def _source_latency(profile: ModelProfile, gpu: str, v: int, b: int) -> np.ndarray:
    return np.array([profile.block_latency_us(gpu, v, b, i) for i in range(profile.num_blocks)], dtype=float)


def _check_source(profile: ModelProfile, gpu: str) -> None:
    have = set(profile.batches(gpu, 1))
    missing = [b for b in FEATURE_BATCHES if b not in have]
    if missing:
        raise UserError(
            f"model '{profile.name}': the source profile on {gpu} lacks level-1 batches {missing} "
            f"(has {sorted(have) or 'none'})",
            fix=f"profile the model on {gpu} at level 1 with batches {list(FEATURE_BATCHES)} (e.g. --batches 1-8), "
            "or estimate from another GPU type the profile has: " + ", ".join(profile.gpus()),
        )


def static_features(
    profile: ModelProfile,
    source_gpu: str,
    *,
    layer_latency_us: Mapping[str, float] | None = None,
    node_blocks: Mapping[str, int] | None = None,
    layer_models: Sequence[LayerRatioModel] | None = None,
    node_op_types: Mapping[str, str] | None = None,
) -> np.ndarray:
    """Per-block features that depend on the source profile but not on (v, b).

    Args:
        profile: the model's profile (only ``source_gpu`` is read).
        source_gpu: the measured GPU type.
        layer_latency_us: per ONNX node, batch-1 latency on the source, us.
        node_blocks: node name -> block index.
        node_op_types: node name -> ONNX op type (a profile's ``layers.csv`` has them from
            the graph); a node without one gets :func:`op_type_of` its name (the artifact
            has names only; for the exporters' names both agree, see the tests).
        layer_models: the layer ratio models from ``source_gpu`` to each other GPU type
            of the cross-GPU model, sorted by target (:data:`N_LAYER_RATIOS` for the
            artifact's four GPU types).

    Returns:
        Array (num_blocks, n_features): the blocks-only features, followed by the
        per-layer features when ``layer_latency_us``, ``node_blocks`` and
        ``layer_models`` are given.
    """
    _check_source(profile, source_gpu)
    nb = profile.num_blocks
    s11 = np.maximum(_source_latency(profile, source_gpu, 1, 1), 1.0)
    cols = [np.log(s11)]
    for b in (8, 2, 4):
        cols.append(np.log(np.maximum(_source_latency(profile, source_gpu, 1, b), 1.0) / s11))
    cuts = np.array([max(profile.cut_bytes(i), 1) for i in range(nb - 1)], dtype=float)
    if nb == 1:
        in_b = out_b = np.ones(1)
    else:
        # the artifact does not give the model input or output size: the outer blocks
        # use their one known cut on both sides
        in_b = np.concatenate([[cuts[0]], cuts])
        out_b = np.concatenate([cuts, [cuts[-1]]])
    cols += [np.log(in_b / s11), np.log(out_b / s11), np.arange(nb) / max(nb - 1, 1)]
    if layer_latency_us is not None and node_blocks is not None and layer_models is not None:
        ops, lats, blks = [], [], []
        for node, blk in node_blocks.items():
            lat = layer_latency_us.get(node)
            if lat is None or not np.isfinite(lat) or lat < 0 or not (0 <= blk < nb):
                continue
            ops.append((node_op_types or {}).get(node) or op_type_of(node))
            lats.append(float(lat))
            blks.append(int(blk))
        lat_a = np.asarray(lats, dtype=float)
        blk_a = np.asarray(blks, dtype=int)
        cls_a = np.array([OP_CLASSES.index(op_class(o)) for o in ops], dtype=int)
        share = np.zeros((nb, len(OP_CLASSES)))
        np.add.at(share, (blk_a, cls_a), lat_a)
        op_share = np.zeros((nb, len(SHARE_OPS)))
        for k, o in enumerate(SHARE_OPS):
            sel = np.array([x == o for x in ops], dtype=bool)
            op_share[:, k] = np.bincount(blk_a[sel], weights=lat_a[sel], minlength=nb)
        tot = share.sum(axis=1)
        if np.any(tot <= 0):
            empty = [int(i) for i in np.flatnonzero(tot <= 0)]
            raise UserError(
                f"model '{profile.name}': no per-layer latency on {source_gpu} for any node of blocks {empty}",
                fix="give layer_latency_us for the nodes that node_blocks maps to those blocks, or pass neither "
                "(the blocks-only model is used then)",
            )
        cols += [share[:, k] / tot for k in range(len(OP_CLASSES))]
        cols.append(np.log(tot / s11))
        cols += [op_share[:, k] / tot for k in range(len(SHARE_OPS))]
        cols += [lm.block_log_ratios(ops, lat_a, blk_a, nb) for lm in layer_models]
    return np.stack(cols, axis=1)


def dynamic_feature(profile: ModelProfile, source_gpu: str, v_src: int, batch: int) -> np.ndarray:
    """``log S(v', b) / S(1, 1)`` per block."""
    s11 = np.maximum(_source_latency(profile, source_gpu, 1, 1), 1.0)
    return np.log(np.maximum(_source_latency(profile, source_gpu, v_src, batch), 1.0) / s11)


# ---------------------------------------------------------------------------------
# regression
# ---------------------------------------------------------------------------------
@lru_cache(maxsize=64)
def _rbf_sampler(n_feat: int, gamma: float) -> RBFSampler:
    """The random Fourier features of the RBF part of the kernel for ``n_feat`` features.

    The kernel is exp(-|z - z'|^2 / (2 * gamma * n_feat)), scikit-learn's RBF kernel with
    its gamma = 1 / (2 * gamma * n_feat). The seed is fixed: the projection is part of the
    fitted model and is drawn again, identically, when the parameters are loaded (the
    draws for one n_feat are the same for every gamma, only scaled).
    """
    sampler = RBFSampler(gamma=1.0 / (2.0 * gamma * n_feat), n_components=RFF_FEATURES, random_state=RFF_SEED)
    return sampler.fit(np.zeros((1, n_feat)))


def _rff(z: np.ndarray, gamma: float) -> np.ndarray:
    """Random Fourier features phi(z), phi(z).phi(z') ~ exp(-|z - z'|^2 / (2 * gamma * n_features))."""
    return _rbf_sampler(z.shape[1], float(gamma)).transform(z)


def _kernel(z: np.ndarray, phi: np.ndarray, rho: float) -> np.ndarray:
    """The regression's kernel matrix ``c + z z' + rho phi phi'`` (c = :data:`INTERCEPT_PRIOR`)."""
    return INTERCEPT_PRIOR + z @ z.T + rho * (phi @ phi.T)


def _dual_coef(kernel: np.ndarray, y: np.ndarray, lam: float) -> np.ndarray:
    """Kernel ridge regression's dual coefficients ``(K + lam I)^-1 y`` (every column of y)."""
    return KernelRidge(alpha=lam, kernel="precomputed").fit(kernel, y).dual_coef_


@dataclass
class _Regressor:
    """Kernel ridge regression in its parametric (primal) form: the prediction for
    standardized features z = (x - mu) / sd is ``b0 + z.w + phi_gamma(z).beta``, clipped to
    the range of the training targets (``ylo``, ``yhi``, widened by :data:`CLIP_MARGIN`
    times that range): a block unlike any training block can drive the linear part or the
    kernel part far outside what any GPU pair ratio ever was, and the clip bounds that
    extrapolation."""

    b0: float
    w: np.ndarray
    mu: np.ndarray
    sd: np.ndarray
    beta: np.ndarray
    gamma: float
    ylo: float
    yhi: float
    offset_col: int = -1

    @staticmethod
    def fit(
        x: np.ndarray, y: np.ndarray, *, gamma: float = 1.0, rho: float = 10.0, lam: float = 10.0, offset_col: int = -1
    ) -> "_Regressor":
        """Fit on raw features ``x`` (rows = blocks, no intercept column) and targets ``y``;
        with ``offset_col`` >= 0, that raw feature is the prior mean of the target (the
        regression fits ``y - x[:, offset_col]``)."""
        mu, sd = _standardizer(x)
        z = (x - mu) / sd
        phi = _rff(z, gamma)
        y_fit = y - x[:, offset_col] if offset_col >= 0 else y
        dual = _dual_coef(_kernel(z, phi, rho), y_fit, lam)
        return _Regressor.from_dual(dual, z, phi, y, mu=mu, sd=sd, gamma=gamma, rho=rho, offset_col=offset_col)

    @staticmethod
    def from_dual(
        dual: np.ndarray, z: np.ndarray, phi: np.ndarray, y: np.ndarray, *, mu: np.ndarray, sd: np.ndarray,
        gamma: float, rho: float, offset_col: int = -1,
    ) -> "_Regressor":
        """The primal weights of dual coefficients ``dual`` (fitted to ``y`` minus the
        offset column, if any); ``y`` are the full targets, whose range is the clip."""
        # K = c 11' + z z' + rho phi phi' and f = K dual, so the primal weights are:
        span = float(y.max() - y.min())
        return _Regressor(
            b0=float(INTERCEPT_PRIOR * dual.sum()), w=z.T @ dual, mu=mu, sd=sd,
            beta=rho * (phi.T @ dual), gamma=float(gamma),
            ylo=float(y.min() - CLIP_MARGIN * span), yhi=float(y.max() + CLIP_MARGIN * span), offset_col=int(offset_col),
        )

    def predict_unclipped(self, x: np.ndarray) -> np.ndarray:
        z = (x - self.mu) / self.sd
        f = self.b0 + z @ self.w + _rff(z, self.gamma) @ self.beta
        return f + x[:, self.offset_col] if self.offset_col >= 0 else f

    def predict(self, x: np.ndarray) -> np.ndarray:
        return np.clip(self.predict_unclipped(x), self.ylo, self.yhi)

    def pack(self) -> np.ndarray:
        head = [self.b0, self.gamma, self.ylo, self.yhi, self.offset_col]
        return np.concatenate([head, self.w, self.mu, self.sd, self.beta]).astype(np.float32)

    @staticmethod
    def unpack(a: np.ndarray) -> "_Regressor":
        a = a.astype(float)
        h = 5
        d = (len(a) - h - RFF_FEATURES) // 3
        return _Regressor(
            b0=float(a[0]), gamma=float(a[1]), ylo=float(a[2]), yhi=float(a[3]), offset_col=int(round(a[4])),
            w=a[h : h + d], mu=a[h + d : h + 2 * d], sd=a[h + 2 * d : h + 3 * d], beta=a[h + 3 * d :],
        )


def _standardizer(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return x.mean(axis=0), x.std(axis=0) + 1e-9


def _model_groups(models: Sequence[ArtifactModel]) -> list[np.ndarray]:
    """Row indices of each model's blocks in the stacked training rows: the held-out sets of
    leave-one-model-out, in model order."""
    labels = np.repeat(np.arange(len(models)), [am.profile.num_blocks for am in models])
    return [test for _train, test in LeaveOneGroupOut().split(labels, groups=labels)]


def _group_index(groups: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Groups stacked by size: a list of (n_groups_of_that_size, size) index arrays."""
    by_size: dict[int, list[np.ndarray]] = {}
    for g in groups:
        by_size.setdefault(len(g), []).append(g)
    return [np.stack(gs) for _size, gs in sorted(by_size.items())]


def _rest_bounds(y: np.ndarray, stacked: Sequence[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per stacked group, the min and max of the targets of all OTHER rows (the clip range
    a fit without that group would have)."""
    out = []
    for idx in stacked:
        lo = np.empty((len(idx), y.shape[1]))
        hi = np.empty((len(idx), y.shape[1]))
        for k, g in enumerate(idx):
            rest = np.ones(len(y), dtype=bool)
            rest[g] = False
            lo[k], hi[k] = y[rest].min(axis=0), y[rest].max(axis=0)
        out.append((lo, hi))
    return out


def _group_loo_errors(
    u: np.ndarray, d: np.ndarray, lam: float, y: np.ndarray, stacked: Sequence[np.ndarray],
    bounds: Sequence[tuple[np.ndarray, np.ndarray]], offset: np.ndarray | None = None,
) -> np.ndarray:
    """Relative latency errors exp(f_{-g} - y) - 1 of kernel ridge predictions for every
    row, each predicted by the fit WITHOUT its group (model), all targets (columns of y) at
    once, from the eigendecomposition ``M = u diag(d) u'`` of the kernel.

    With A = M / lam + I and alpha = A^-1 y, deleting group g gives the residuals
    ``y_g - f_{-g}(x_g) = (A^-1)_gg^-1 alpha_g`` (exact for kernel ridge regression). This
    replaces one refit per held-out model (scikit-learn's ``KernelRidge`` on each
    ``LeaveOneGroupOut`` fold, as ``tests/profiler/test_crossgpu_model.py`` does to check
    it): one eigendecomposition per (gamma, rho) then serves every lambda and every fold,
    where refits would cost a solve per fold, setting and design, in every outer fold of
    the benchmark.
    Predictions are clipped to the range of the other groups' targets (``bounds``, from
    :func:`_rest_bounds`), as a fit would be. ``stacked`` comes from :func:`_group_index`.
    With ``offset`` (same shape as y), the regression fits ``y - offset`` and predicts
    ``offset + f``.
    """
    y_fit = y if offset is None else y - offset
    h = 1.0 / (d / lam + 1.0)
    alpha = u @ (h[:, None] * (u.T @ y_fit))
    uh = u * h
    out = np.empty_like(y)
    for idx, (lo, hi) in zip(stacked, bounds):
        a_gg = np.matmul(uh[idx], u[idx].transpose(0, 2, 1))
        resid = np.linalg.solve(a_gg, alpha[idx])
        pred = y[idx] - resid  # = y_fit - resid + offset
        pred = np.clip(pred, lo[:, None, :], hi[:, None, :])
        out[idx] = np.exp(pred - y[idx]) - 1.0
    return out


# ---------------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------------
VariantKey = tuple[str, str, int, int, int, bool]  # (source, target, v, b, v_src, with_layers)


@dataclass
class Selection:
    """The hyper-parameters chosen for one (source, target, feature set), with the inner
    leave-one-model-out errors that chose them (over the training models only)."""

    gamma: float
    rho: float
    lam: float
    inner_median: float
    inner_p90: float
    offset: bool = False  # the per-layer predicted ratio to the target is the prior mean

    def as_list(self) -> list[float]:
        return [self.gamma, self.rho, self.lam, self.inner_median, self.inner_p90, float(self.offset)]


@dataclass
class CrossGpuModel:
    """Fitted cross-GPU ratios: one regressor per variant.

    Attributes:
        regressors: per (source, target, v, b, v_src, with_layers), the regressor of
            ``log T(target, v, b) - log S(source, v_src, b)`` per block.
        models: names of the artifact models it was fitted on.
        layer_models: per (source, target), the layer-level ratio model behind the
            per-layer predicted-ratio features.
        selection: per (source, target, with_layers), the chosen hyper-parameters.
    """

    regressors: dict[VariantKey, _Regressor]
    models: list[str]
    layer_models: dict[tuple[str, str], LayerRatioModel] = field(default_factory=dict)
    selection: dict[tuple[str, str, bool], Selection] = field(default_factory=dict)

    # ---- what it covers -----------------------------------------------------------
    def gpus(self) -> list[str]:
        return sorted({k[0] for k in self.regressors} | {k[1] for k in self.regressors})

    def grid(self, source: str, target: str) -> dict[int, list[int]]:
        """Target levels -> batches this model predicts for the pair."""
        out: dict[int, set[int]] = {}
        for (s, t, v, b, _vs, _wl) in self.regressors:
            if s == source and t == target:
                out.setdefault(v, set()).add(b)
        return {v: sorted(bs) for v, bs in sorted(out.items())}

    def has(self, source: str, target: str, v: int, b: int, v_src: int, with_layers: bool = False) -> bool:
        return (source, target, v, b, v_src, with_layers) in self.regressors

    def source_layer_models(self, source: str) -> list[LayerRatioModel] | None:
        """The layer ratio models from ``source`` to every other GPU type (sorted), or None
        when the model was fitted without per-layer features."""
        others = sorted(t for (s, t) in self.layer_models if s == source)
        return [self.layer_models[(source, g)] for g in others] if others else None

    def predict_log_ratio(
        self, source: str, target: str, v: int, b: int, v_src: int, static: np.ndarray, dyn: np.ndarray,
        *, with_layers: bool,
    ) -> np.ndarray:
        reg = self.regressors.get((source, target, v, b, v_src, with_layers))
        if reg is None:
            raise UserError(
                f"the cross-GPU model has no fit for {source} -> {target} at level {v}, batch {b}"
                + (f" from source level {v_src}" if v_src != v else "")
                + (" with per-layer features" if with_layers else " from block timings alone"),
                fix=f"ask for levels/batches in {self.grid(source, target)}, or refit with fit_cross_gpu() on data that has them",
            )
        return reg.predict(np.concatenate([static, dyn[:, None]], axis=1))

    # ---- I/O ----------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write the parameters (weights only, no training data) to an ``.npz`` file."""
        p = Path(path)
        arrays = {
            "reg|" + "|".join(str(int(x)) if isinstance(x, (bool, int)) else x for x in k): r.pack()
            for k, r in self.regressors.items()
        }
        ops = sorted({o for lm in self.layer_models.values() for o in lm.ops})
        for (s, t), lm in self.layer_models.items():
            if list(lm.ops) != ops:
                raise ValueError("layer models with different op vocabularies cannot be saved together")
            arrays[f"layer|{s}|{t}"] = lm.coef.astype(np.float32)
        meta = {
            "format_version": FORMAT_VERSION,
            "models": self.models,
            "static_features": _stat_feature_names(True),
            "rff_features": RFF_FEATURES,
            "rff_seed": RFF_SEED,
            "layer_ops": ops,
            "selection": {f"{s}|{t}|{int(wl)}": sel.as_list() for (s, t, wl), sel in self.selection.items()},
        }
        arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
        np.savez_compressed(p, **arrays)
        return p

    @staticmethod
    def load(path: str | Path = DATA_FILE) -> "CrossGpuModel":
        p = Path(path)
        if not p.exists():
            raise UserError(
                "cross-GPU model parameters not found",
                fix="run `python -m ppipe.profiler.estimate fit-cross-gpu <artifact folder>` to fit them",
                file=str(p),
            )
        with np.load(p) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            same = (
                meta.get("format_version"), meta.get("rff_features"), meta.get("rff_seed"), meta.get("static_features"),
            ) == (FORMAT_VERSION, RFF_FEATURES, RFF_SEED, _stat_feature_names(True))
            if not same:
                raise UserError(
                    "cross-GPU parameters were fitted by another version of this model "
                    f"(format {meta.get('format_version')}, this ppipe reads {FORMAT_VERSION})",
                    fix="refit with `python -m ppipe.profiler.estimate fit-cross-gpu <artifact folder>`",
                    file=str(p),
                )
            regs: dict[VariantKey, _Regressor] = {}
            layers: dict[tuple[str, str], LayerRatioModel] = {}
            ops = tuple(meta.get("layer_ops", []))
            for k in z.files:
                parts = k.split("|")
                if parts[0] == "reg":
                    s, t, v, b, vs, wl = parts[1:]
                    regs[(s, t, int(v), int(b), int(vs), wl == "1")] = _Regressor.unpack(z[k])
                elif parts[0] == "layer":
                    layers[(parts[1], parts[2])] = LayerRatioModel(ops=ops, coef=z[k].astype(float))
        selection = {}
        for key, vals in meta.get("selection", {}).items():
            s, t, wl = key.split("|")
            selection[(s, t, wl == "1")] = Selection(*vals[:5], offset=bool(vals[5]))
        return CrossGpuModel(regressors=regs, models=list(meta["models"]), layer_models=layers, selection=selection)


_DEFAULT: CrossGpuModel | None = None


def default_cross_gpu_model() -> CrossGpuModel:
    """The parameters shipped with ppipe (fitted on the PPipe artifact), loaded once."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = CrossGpuModel.load(DATA_FILE)
    return _DEFAULT


# ---------------------------------------------------------------------------------
# fitting
# ---------------------------------------------------------------------------------
def artifact_layer_inputs(am: ArtifactModel, gpu: str) -> tuple[dict[str, float], dict[str, int]]:
    """(layer_latency_us, node_blocks) of an artifact model on one GPU type."""
    lat = am.layer_us.get(gpu)
    if lat is None:
        raise UserError(f"model '{am.name}' has no per-layer latencies on {gpu}", fix="use a GPU type of the artifact")
    layer = {n: float(x) for n, x in zip(am.nodes, lat) if np.isfinite(x)}
    return layer, {n: int(b) for n, b in zip(am.nodes, am.node_block)}


@dataclass
class _Design:
    """Rows (blocks of every training model) of the variants that share one source, one
    source level and one batch: same features, one target column per (target, level)."""

    source: str
    v_src: int
    batch: int
    dyn: list[np.ndarray] = field(default_factory=list)
    columns: list[tuple[str, int]] = field(default_factory=list)  # (target, v)
    ys: list[list[np.ndarray]] = field(default_factory=list)  # per column, per model


def fit_cross_gpu_from_models(
    models: Iterable[ArtifactModel],
    *,
    pairs: Iterable[tuple[str, str]] | None = None,
    with_layers: Iterable[bool] = (False, True),
    hyper_grid: Sequence[tuple[float, float, float]] = HYPER_GRID,
    offsets: Iterable[bool] = (False,),
) -> CrossGpuModel:
    """Fit the cross-GPU model on artifact models already read (see :func:`fit_cross_gpu`).

    The hyper-parameters (gamma, rho, lambda) of each (source, target, feature set) are
    chosen from ``hyper_grid`` by leave-one-model-out over ``models`` (exact closed form,
    no refits): the median + 90th percentile of the held-out block latency errors, pooled
    over that pair's levels and batches, is minimized.

    Args:
        models: the training models.
        pairs: only these (source, target) GPU pairs (default: every ordered pair).
        with_layers: which feature sets to fit (False: block timings alone; True: with
            the per-layer features).
        hyper_grid: candidate (gamma, rho, lambda).
        offsets: with the per-layer features, whether the per-layer predicted log ratio to
            the target is used as the prior mean of the block's log ratio (the regression
            then fits the difference, and shrinks towards that physically derived ratio
            rather than towards the training mean): the candidates, chosen like the
            hyper-parameters. One grid entry and one offset option skip the selection.
            Default: no offset (as a candidate it moved the benchmark by noise only, at a
            third more fitting time; ``docs/benchmarks.md``).
    """
    feature_sets = sorted(set(with_layers))
    t = _Training.of(list(models), pairs)
    # 1. layer ratio models (per-layer feature set only)
    layer_full, layer_wo = _fit_layer_models(t) if True in feature_sets else ({}, {})
    # 2. static features of every training block, per source
    t.static = {s: _training_features(t, s, layer_wo if True in feature_sets else None) for s in t.sources}
    # 3. one design per (source, source level, batch)
    designs = _designs(t)
    # 4. hyper-parameters per (source, target, feature set) by leave-one-model-out
    grid, offset_options = list(hyper_grid), sorted(set(offsets))
    if len(grid) == 1 and len(offset_options) == 1:
        g0, r0, l0 = grid[0]
        chosen = {
            (s, tg, wl): Selection(g0, r0, l0, float("nan"), float("nan"), offset=offset_options[0] and wl)
            for s, tg in t.wanted for wl in feature_sets
        }
    else:
        chosen = _select_hyper_parameters(t, designs, feature_sets, grid, offset_options)
    # 5. final fits on every training model
    regs = _final_fits(t, designs, feature_sets, chosen)
    return CrossGpuModel(regressors=regs, models=[am.name for am in t.models], layer_models=layer_full, selection=chosen)


@dataclass
class _Training:
    """The training rows: the usable models (every GPU type, per-layer timings on each),
    the (source, target) pairs to fit, and, once computed, each source's static features
    of every training block (rows stacked in model order)."""

    models: list[ArtifactModel]
    gpus: list[str]
    wanted: list[tuple[str, str]]
    static: dict[str, np.ndarray] = field(default_factory=dict)

    @staticmethod
    def of(models: list[ArtifactModel], pairs: Iterable[tuple[str, str]] | None) -> "_Training":
        only = set(pairs) if pairs is not None else None
        gpus = sorted({g for am in models for g in am.profile.gpus()})
        # Only models with every GPU type are used, so that every variant has the same rows.
        usable = [am for am in models if set(am.profile.gpus()) == set(gpus) and all(g in am.layer_us for g in gpus)]
        if len(usable) < 3:
            raise UserError(
                "fitting the cross-GPU model needs at least three models with every GPU type "
                "(the hyper-parameters are chosen by leave-one-model-out among them)",
                fix="point at the full artifact folder",
            )
        wanted = [(s, t) for s in gpus for t in gpus if s != t and (only is None or (s, t) in only)]
        return _Training(models=usable, gpus=gpus, wanted=wanted)

    @property
    def sources(self) -> list[str]:
        return sorted({s for s, _ in self.wanted})

    def design_matrix(self, d: "_Design", with_layers: bool) -> tuple[np.ndarray, np.ndarray]:
        """(x, y) of a design: static features (all, or the blocks-only ones) and its
        dynamic feature; one target column per (target, level)."""
        feats = self.static[d.source] if with_layers else self.static[d.source][:, :N_STATIC_BLOCKS_ONLY]
        x = np.concatenate([feats, np.concatenate(d.dyn)[:, None]], axis=1)
        y = np.stack([np.concatenate(c) for c in d.ys], axis=1)
        return x, y

    def offset_col(self, source: str, target: str, with_layers: bool) -> int:
        """Column of the per-layer predicted log ratio source -> target (the offset), or -1."""
        if not with_layers:
            return -1
        others = [g for g in self.gpus if g != source]
        return self.static[source].shape[1] - len(others) + others.index(target)


def _fit_layer_models(
    t: _Training,
) -> tuple[dict[tuple[str, str], LayerRatioModel], dict[tuple[str, str], list[LayerRatioModel]]]:
    """Layer ratio models for every ordered pair out of a source: the full fit (used on new
    models) and, per training model, one fitted without it (its own training features)."""
    ops = _layer_vocabulary(t.models)
    full: dict[tuple[str, str], LayerRatioModel] = {}
    without: dict[tuple[str, str], list[LayerRatioModel]] = {}
    for s in t.sources:
        for g in t.gpus:
            if g == s:
                continue
            st = [_layer_stats(am.op_types, am.layer_us[s], am.layer_us[g], ops) for am in t.models]
            xtx = sum(a for a, _ in st)
            xty = sum(b for _, b in st)
            full[(s, g)] = LayerRatioModel(ops=ops, coef=_layer_solve(xtx, xty))
            without[(s, g)] = [LayerRatioModel(ops=ops, coef=_layer_solve(xtx - a, xty - b)) for a, b in st]
    return full, without


def _training_features(
    t: _Training, source: str, layer_wo: dict[tuple[str, str], list[LayerRatioModel]] | None
) -> np.ndarray:
    """Static features on ``source`` of every training block; with ``layer_wo`` the
    per-layer ones too, each model's from layer models fitted without it."""
    rows = []
    for m, am in enumerate(t.models):
        if layer_wo is None:
            rows.append(static_features(am.profile, source))
            continue
        layer, nodes = artifact_layer_inputs(am, source)
        lms = [layer_wo[(source, g)][m] for g in t.gpus if g != source]
        rows.append(static_features(am.profile, source, layer_latency_us=layer, node_blocks=nodes, layer_models=lms))
    return np.concatenate(rows)


def _designs(t: _Training) -> dict[tuple[str, int, int], "_Design"]:
    """One design per (source, source level, batch), with a target column for every
    (target, level) at that batch that every training model has."""
    designs: dict[tuple[str, int, int], _Design] = {}
    p0 = t.models[0].profile
    for s, tg in t.wanted:
        for v in p0.levels(tg):
            for b in p0.batches(tg, v):
                for vs in sorted({1, v} if v in p0.levels(s) else {1}):
                    if not all(
                        v in am.profile.levels(tg) and b in am.profile.batches(tg, v)
                        and vs in am.profile.levels(s) and b in am.profile.batches(s, vs)
                        for am in t.models
                    ):
                        continue  # some training model lacks this (level, batch): no fit for it
                    d = designs.get((s, vs, b))
                    if d is None:
                        dyn = [dynamic_feature(am.profile, s, vs, b) for am in t.models]
                        d = designs[(s, vs, b)] = _Design(s, vs, b, dyn=dyn)
                    d.columns.append((tg, v))
                    d.ys.append([
                        np.log(np.maximum(_source_latency(am.profile, tg, v, b), 1.0))
                        - np.log(np.maximum(_source_latency(am.profile, s, vs, b), 1.0))
                        for am in t.models
                    ])
    return designs


def _select_hyper_parameters(
    t: _Training,
    designs: Mapping[tuple[str, int, int], "_Design"],
    feature_sets: Sequence[bool],
    grid: Sequence[tuple[float, float, float]],
    offset_options: Sequence[bool],
) -> dict[tuple[str, str, bool], Selection]:
    """Per (source, target, feature set), the (gamma, rho, lambda, offset) whose
    leave-one-model-out block errors, pooled over the pair's designs at
    :data:`SELECT_BATCHES`, have the least median + 90th percentile."""
    errs: dict[tuple[str, str, bool], dict[tuple[float, float, float, bool], list[np.ndarray]]] = {}
    stacked = _group_index(_model_groups(t.models))
    for wl in feature_sets:
        for d in designs.values():
            if d.batch in SELECT_BATCHES:
                _score_design(t, d, wl, grid, offset_options if wl else [False], stacked, errs)
    chosen: dict[tuple[str, str, bool], Selection] = {}
    for key, per_setting in errs.items():
        stats = []
        for setting, parts in per_setting.items():
            e = np.concatenate(parts)
            med, p90 = float(np.median(e)), float(np.percentile(e, 90))
            stats.append((med + p90, setting, med, p90))
        _score, (g, r, lam, off), med, p90 = min(stats)
        chosen[key] = Selection(g, r, lam, med, p90, offset=off)
    return chosen


def _score_design(
    t: _Training,
    d: "_Design",
    wl: bool,
    grid: Sequence[tuple[float, float, float]],
    opts: Sequence[bool],
    stacked: Sequence[np.ndarray],
    errs: dict[tuple[str, str, bool], dict[tuple[float, float, float, bool], list[np.ndarray]]],
) -> None:
    """Add one design's held-out errors, per setting and target, to ``errs``."""
    src_levels = t.models[0].profile.levels(d.source)
    # A column at a level the source has, fitted from source level 1, is only the
    # fallback for sources without that level: it does not score.
    scored = [c for c, (_t, v) in enumerate(d.columns) if not (d.v_src != v and v in src_levels)]
    if not scored:
        return
    x, y = t.design_matrix(d, wl)
    y = y[:, scored]
    mu, sd = _standardizer(x)
    z = (x - mu) / sd
    off_cols = [t.offset_col(d.source, d.columns[c][0], wl) for c in scored]
    # every offset option as more columns of one problem: the kernel, and so the held-out
    # blocks' solves, are the same for all of them
    n_y = y.shape[1]
    offset = np.concatenate([x[:, off_cols] if o else np.zeros_like(y) for o in opts], axis=1)
    y = np.concatenate([y] * len(opts), axis=1)
    bounds = _rest_bounds(y, stacked)
    for gamma in sorted({g for g, _, _ in grid}):
        phi = _rff(z, gamma)
        for rho in sorted({r for g, r, _ in grid if g == gamma}):
            evals, evecs = np.linalg.eigh(_kernel(z, phi, rho))
            evals = np.maximum(evals, 0.0)
            for lam in [lam for g, r, lam in grid if (g, r) == (gamma, rho)]:
                e = np.abs(_group_loo_errors(evecs, evals, lam, y, stacked, bounds, offset)).astype(np.float32)
                for k, off in enumerate(opts):
                    for j, c in enumerate(scored):
                        per = errs.setdefault((d.source, d.columns[c][0], wl), {})
                        per.setdefault((gamma, rho, lam, off), []).append(e[:, k * n_y + j])


def _final_fits(
    t: _Training,
    designs: Mapping[tuple[str, int, int], "_Design"],
    feature_sets: Sequence[bool],
    chosen: Mapping[tuple[str, str, bool], Selection],
) -> dict[VariantKey, _Regressor]:
    """One regressor per variant, fitted on every training model with its pair's chosen
    hyper-parameters (the columns that share a setting share one kernel)."""
    regs: dict[VariantKey, _Regressor] = {}
    for wl in feature_sets:
        for d in designs.values():
            x, y = t.design_matrix(d, wl)
            mu, sd = _standardizer(x)
            z = (x - mu) / sd
            by_setting: dict[tuple[float, float, float], list[int]] = {}
            for c, (tg, _v) in enumerate(d.columns):
                sel = chosen[(d.source, tg, wl)]
                by_setting.setdefault((sel.gamma, sel.rho, sel.lam), []).append(c)
            for (gamma, rho, lam), cols in by_setting.items():
                phi = _rff(z, gamma)
                cols_off = [
                    t.offset_col(d.source, d.columns[c][0], wl) if chosen[(d.source, d.columns[c][0], wl)].offset else -1
                    for c in cols
                ]
                y_fit = np.stack([y[:, c] - (x[:, oc] if oc >= 0 else 0.0) for c, oc in zip(cols, cols_off)], axis=1)
                dual = _dual_coef(_kernel(z, phi, rho), y_fit, lam)
                for j, (c, oc) in enumerate(zip(cols, cols_off)):
                    tg, v = d.columns[c]
                    regs[(d.source, tg, v, d.batch, d.v_src, wl)] = _Regressor.from_dual(
                        dual[:, j], z, phi, y[:, c], mu=mu, sd=sd, gamma=gamma, rho=rho, offset_col=oc
                    )
    return regs


def fit_cross_gpu(artifact_dir: str | Path, *, exclude: Iterable[str] = (), out: str | Path | None = None) -> CrossGpuModel:
    """Fit the cross-GPU model on the PPipe artifact (all models but ``exclude``).

    Args:
        artifact_dir: the artifact's root folder (block-timing/, layer-latency/, block-mapping/).
        exclude: model names left out (leave-one-model-out evaluation).
        out: where to save the parameters (``.npz``); ``None`` keeps them in memory. The
            file shipped with ppipe is :data:`DATA_FILE`.
    """
    skip = set(exclude)
    data = load_all(artifact_dir)
    model = fit_cross_gpu_from_models(am for n, am in data.items() if n not in skip)
    if out is not None:
        model.save(out)
    return model


# ---------------------------------------------------------------------------------
# prediction
# ---------------------------------------------------------------------------------
def cross_gpu_table(
    profile: ModelProfile,
    source_gpu: str,
    target_gpu: str,
    *,
    levels: Iterable[int] | None = None,
    batches_by_level: Mapping[int, Iterable[int]] | None = None,
    layer_latency_us: Mapping[str, float] | None = None,
    node_blocks: Mapping[str, int] | None = None,
    node_op_types: Mapping[str, str] | None = None,
    model: CrossGpuModel | None = None,
) -> dict[tuple[str, int, int, int], float]:
    """Estimate a model's block latencies on ``target_gpu`` from its profile on ``source_gpu``.

    Args:
        profile: the model's measured profile; it must hold ``source_gpu`` at level 1 with
            batches 1, 2, 4 and 8 (and, for target level v > 1, level v of the source if
            the source GPU type has MPS levels; else level 1 is used).
        source_gpu: GPU type the profile was measured on (one the cross-GPU model knows).
        target_gpu: GPU type to estimate.
        levels: target vGPU levels (default: every level the model was fitted for).
        batches_by_level: target batches per level (default: every batch fitted).
        layer_latency_us: optional per-ONNX-node batch-1 latency on the source GPU, us.
        node_blocks: optional node name -> block index; with ``layer_latency_us`` it adds
            the op-class features (more accurate, see ``scripts/bench_estimator.py``).
            The per-layer latencies must be *per-node* timings like the artifact's (each
            node its own kernel); :func:`ppipe.profiler.layers.cross_gpu_layer_inputs`
            gives all three from a profile's ``layers.csv`` where they are.
        node_op_types: optional node name -> ONNX op type (default: from the node names).
        model: fitted parameters (default: the ones shipped with ppipe).

    Returns:
        {(target_gpu, v, b, block): latency_us}.

    Raises:
        UserError: unknown GPU type, a source profile without the needed batches, or a
            level/batch the model has no fit for.
    """
    m = model or default_cross_gpu_model()
    known = m.gpus()
    for role, g in (("source", source_gpu), ("target", target_gpu)):
        if g not in known:
            raise UserError(
                f"cross-GPU model: unknown {role} GPU type '{g}'; known: {', '.join(known)}",
                fix="use one of those, or the roofline estimate (roofline_table) for other GPU types",
            )
    if source_gpu == target_gpu:
        raise UserError(f"source and target are both {source_gpu}", fix="the profile already holds that GPU type")
    if source_gpu not in profile.gpus():
        raise UserError(
            f"model '{profile.name}' has no timings on {source_gpu} (has {', '.join(profile.gpus()) or 'none'})",
            fix="pick a source GPU type the profile was measured on",
        )
    grid = m.grid(source_gpu, target_gpu)
    want_levels = sorted(set(levels)) if levels is not None else list(grid)
    with_layers = layer_latency_us is not None and node_blocks is not None
    layer_models = m.source_layer_models(source_gpu) if with_layers else None
    if with_layers and layer_models is None:
        raise UserError(
            "this cross-GPU model was fitted without per-layer features",
            fix="leave out layer_latency_us and node_blocks, or refit with with_layers=(False, True)",
        )
    static = static_features(
        profile, source_gpu, layer_latency_us=layer_latency_us, node_blocks=node_blocks, layer_models=layer_models,
        node_op_types=node_op_types,
    )
    src_levels = profile.levels(source_gpu)
    out: dict[tuple[str, int, int, int], float] = {}
    for v in want_levels:
        if batches_by_level is not None:
            if v not in batches_by_level:
                raise UserError(f"no batches given for level {v}", fix="add the level to batches_by_level")
            want_b = sorted(set(batches_by_level[v]))
        else:
            want_b = grid.get(v, [])
        for b in want_b:
            v_src = v if (v in src_levels and b in profile.batches(source_gpu, v)) else 1
            if b not in profile.batches(source_gpu, v_src):
                raise UserError(
                    f"model '{profile.name}': no source timing on {source_gpu} at level {v_src}, batch {b}",
                    fix=f"profile {source_gpu} at that batch, or ask for batches {list(profile.batches(source_gpu, v_src))}",
                )
            if not m.has(source_gpu, target_gpu, v, b, v_src, with_layers) and v_src != 1:
                v_src = 1  # the fit has no same-level variant: fall back on level 1 of the source
            dyn = dynamic_feature(profile, source_gpu, v_src, b)
            log_r = m.predict_log_ratio(source_gpu, target_gpu, v, b, v_src, static, dyn, with_layers=with_layers)
            src = np.maximum(_source_latency(profile, source_gpu, v_src, b), 1.0)
            for i, lat in enumerate(src * np.exp(log_r)):
                out[(target_gpu, v, b, i)] = float(lat)
    return out
