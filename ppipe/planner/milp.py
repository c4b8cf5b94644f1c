"""A MILP held as arrays, so that it can be built with numpy and handed to any solver.

Columns have bounds and an integrality flag; rows are ``lb <= A x <= ub`` with ``A``
kept as coordinate triples until :meth:`Milp.csc` assembles it. Columns and rows are
added in named blocks (``"g"``, ``"c2a_level_gpus"``, ...) so that tests and error
messages can point at a constraint by the name the planner's docstring gives it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

import numpy as np

INF = float("inf")


@dataclass
class Milp:
    """Columns, rows and a linear objective. Build it, then pass it to a solver."""

    col_lb: list[np.ndarray] = field(default_factory=list)
    col_ub: list[np.ndarray] = field(default_factory=list)
    col_int: list[np.ndarray] = field(default_factory=list)
    row_lb: list[np.ndarray] = field(default_factory=list)
    row_ub: list[np.ndarray] = field(default_factory=list)
    _ri: list[np.ndarray] = field(default_factory=list)
    _ci: list[np.ndarray] = field(default_factory=list)
    _vals: list[np.ndarray] = field(default_factory=list)
    col_blocks: dict[str, tuple[int, int]] = field(default_factory=dict)
    row_blocks: dict[str, tuple[int, int]] = field(default_factory=dict)
    num_cols: int = 0
    num_rows: int = 0
    objective: dict[int, float] = field(default_factory=dict)
    sense: str = "max"

    # ---- columns -------------------------------------------------------------------
    def add_cols(self, n: int, *, lb=0.0, ub=INF, integer: bool = False, name: str = "") -> np.ndarray:
        """Add ``n`` columns; returns their indices. ``lb``/``ub`` are scalars or arrays."""
        start = self.num_cols
        self.col_lb.append(np.broadcast_to(np.asarray(lb, float), (n,)).copy())
        self.col_ub.append(np.broadcast_to(np.asarray(ub, float), (n,)).copy())
        self.col_int.append(np.full(n, integer, bool))
        self.num_cols += n
        if name:
            self._extend(self.col_blocks, name, start, self.num_cols)
        return np.arange(start, self.num_cols)

    def add_col(self, *, lb=0.0, ub=INF, integer: bool = False, name: str = "") -> int:
        return int(self.add_cols(1, lb=lb, ub=ub, integer=integer, name=name)[0])

    def set_col_bounds(self, cols, lb, ub) -> None:
        """Change the bounds of existing columns (by index); ``lb``/``ub`` scalars or arrays."""
        cols = np.atleast_1d(np.asarray(cols, int))
        lb = np.broadcast_to(np.asarray(lb, float), cols.shape)
        ub = np.broadcast_to(np.asarray(ub, float), cols.shape)
        starts = np.cumsum([0] + [a.size for a in self.col_lb])
        for c, lo, hi in zip(cols, lb, ub):
            b = int(np.searchsorted(starts, c, side="right")) - 1
            self.col_lb[b][c - starts[b]] = lo
            self.col_ub[b][c - starts[b]] = hi

    # ---- rows ----------------------------------------------------------------------
    def add_rows(self, n: int, rows, cols, vals, *, lb=-INF, ub=INF, name: str = "") -> np.ndarray:
        """Add ``n`` rows given as triples (row within this block, column, coefficient)."""
        start = self.num_rows
        rows = np.asarray(rows, int)
        self._ri.append(rows + start)
        self._ci.append(np.asarray(cols, int))
        self._vals.append(np.asarray(vals, float))
        self.row_lb.append(np.broadcast_to(np.asarray(lb, float), (n,)).copy())
        self.row_ub.append(np.broadcast_to(np.asarray(ub, float), (n,)).copy())
        self.num_rows += n
        if name:
            self._extend(self.row_blocks, name, start, self.num_rows)
        return np.arange(start, self.num_rows)

    def add_row(self, coefs: Mapping[int, float], *, lb=-INF, ub=INF, name: str = "") -> int:
        """Add one row ``lb <= sum(coef * x[col]) <= ub``."""
        cols = list(coefs)
        return int(self.add_rows(1, [0] * len(cols), cols, [coefs[c] for c in cols], lb=lb, ub=ub, name=name)[0])

    # ---- objective -----------------------------------------------------------------
    def set_objective(self, coefs: Mapping[int, float] | Iterable[tuple[int, float]], sense: str = "max") -> None:
        """Replace the objective: ``sense`` is ``"max"`` or ``"min"``."""
        if sense not in ("max", "min"):
            raise ValueError(f"sense must be 'max' or 'min', got {sense!r}")
        items = coefs.items() if isinstance(coefs, Mapping) else coefs
        self.objective = {}
        for c, v in items:
            self.objective[int(c)] = self.objective.get(int(c), 0.0) + float(v)
        self.sense = sense

    # ---- assembly ------------------------------------------------------------------
    def arrays(self):
        """(col_lb, col_ub, integrality, row_lb, row_ub, cost) as flat numpy arrays."""
        cost = np.zeros(self.num_cols)
        for c, v in self.objective.items():
            cost[c] += v
        cat = lambda xs, dt: np.concatenate(xs).astype(dt) if xs else np.zeros(0, dt)  # noqa: E731
        return (
            cat(self.col_lb, float),
            cat(self.col_ub, float),
            cat(self.col_int, bool),
            cat(self.row_lb, float),
            cat(self.row_ub, float),
            cost,
        )

    def coo(self):
        cat = lambda xs, dt: np.concatenate(xs).astype(dt) if xs else np.zeros(0, dt)  # noqa: E731
        return cat(self._ri, int), cat(self._ci, int), cat(self._vals, float)

    def csc(self):
        """The constraint matrix column-wise: (start, index, value)."""
        r, c, v = self.coo()
        order = np.lexsort((r, c))
        r, c, v = r[order], c[order], v[order]
        start = np.zeros(self.num_cols + 1, dtype=np.int64)
        np.add.at(start, c + 1, 1)
        start = np.cumsum(start)
        return start, r, v

    def rows_named(self, name: str) -> range:
        a, b = self.row_blocks.get(name, (0, 0))
        return range(a, b)

    @staticmethod
    def _extend(blocks: dict[str, tuple[int, int]], name: str, start: int, stop: int) -> None:
        # Blocks of one name added one after another are merged (e.g. per-model rows).
        if name in blocks and blocks[name][1] == start:
            blocks[name] = (blocks[name][0], stop)
        elif name in blocks:
            i = 2
            while f"{name}#{i}" in blocks:
                i += 1
            blocks[f"{name}#{i}"] = (start, stop)
        else:
            blocks[name] = (start, stop)
