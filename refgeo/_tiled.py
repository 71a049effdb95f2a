"""The certified pairwise engine written against the array API: the ``cupy`` backend.

The same algorithm as ``refgeo_ext`` (center, filter with the Gram expansion, refine
every pair that the a-priori rounding bound cannot rule out), expressed with whole-tile
array operations instead of per-pair C loops, so that it runs unchanged on CuPy
(cuBLAS GEMM, device reductions, float64 refinement on the GPU) and, in the tests, on
NumPy and array-api-strict on the CPU.

Filter.  Rows are centered about their float64 mean and stored in the input dtype,
``x_i``; ``n_i`` are float64 squared norms of the stored copy; the filter value of a
pair is ``f_ij = n_i + n_j - 2 fl(x_i . x_j)``, its GEMM in the stored dtype and the
rest in float64.  ``|f_ij - r_ij| <= e_ij = c (n_i + n_j) + e_abs`` with ``(c, e_abs)``
from :func:`refgeo._certify.rounding_bound` (derived in :func:`refgeo.row_diameter`),
``r_ij`` the refined float64 squared distance of the original rows
(:func:`refgeo._certify.canonical_sq`, the summation order every backend shares, so
values agree bit for bit).  Each kernel returns a :class:`refgeo._backend.KernelRun`
with ``backend="cupy"``; rows arrive prescaled by the public functions, so the GEMM
cannot overflow and nothing falls back to the reference inside a call.

Pruning.  A pair is dropped only when its filter proves it strictly worse than a pair
that is kept: for a maximum, ``f_ij + e_ij < max(best refined so far, max_tile(f - e))``;
for a minimum, ``f_ij - e_ij > min(best so far, min_tile(f + e))``; for k-NN, when
``f_ij - e_ij`` exceeds the k-th smallest ``f + e`` of the row.  Ties are therefore always
refined and broken by the smallest index, so the result does not depend on the tile size.

Precision.  A float32 GEMM on CuPy runs in IEEE float32 unless ``CUPY_TF32=1`` asks
cuBLAS for TF32 tensor cores; TF32 (10-bit mantissa) would void the float32 bound, so
under ``CUPY_TF32=1`` the filter runs in float64 instead (see :func:`matmul_precision`).
"""

from __future__ import annotations

import math
import os

from array_api_compat import array_namespace, is_cupy_array

from ._backend import KernelRun
from ._certify import (
    MAX_NORM2,
    MIN_NORM2_FLOAT32,
    best_pair,
    better,
    canonical_sq,
    f64,
    reported_bound,
    rounding_bound,
)

# Rows per block when no tile size is given: a (block x n) float64 filter block of at
# most 2**22 entries (32 MiB), at least 64 rows.
_BLOCK_ENTRIES = 1 << 22
# Candidate pairs refined per batch: the (batch, d) float64 differences stay small.
_REFINE_BATCH = 1 << 14

_BACKEND = "cupy"


def matmul_precision(dtype_name: str) -> str:
    """Precision of the engine's GEMM for inputs of ``dtype_name`` ("float32"/"float64").

    ``"float64"`` for float64 inputs; ``"float32"`` (IEEE) for float32 inputs unless
    ``CUPY_TF32=1`` is set, in which case the filter runs in float64 (TF32 is never used).
    """
    if dtype_name == "float64" or os.environ.get("CUPY_TF32", "0") == "1":
        return "float64"
    return "float32"


def _prepare(xp, arrays):
    """Originals (float64), centered copies in the filter dtype, float64 norms, dtype name.

    Raises ``ValueError`` when even the float64 GEMM would overflow (rows that were
    not prescaled: the public functions prescale them).
    """
    orig64 = [f64(xp, a) for a in arrays]
    name = "float32" if all(a.dtype == xp.float32 for a in arrays) else "float64"
    d = arrays[0].shape[1]
    if any(is_cupy_array(a) for a in arrays):
        name = matmul_precision(name)
    if name == "float32" and not math.isfinite(rounding_bound(d, "float32")[0]):
        name = "float64"
    total = sum(a.shape[0] for a in arrays)
    mu = sum(xp.sum(a, axis=0) for a in orig64) / total
    fdt = xp.float32 if name == "float32" else xp.float64
    cents = [xp.astype(a - mu, fdt) for a in orig64]
    norms = [xp.sum(f64(xp, c) ** 2, axis=1) for c in cents]
    top = max(float(xp.max(n)) for n in norms)
    # float32 products that overflow, or underflow so far that the bound's absolute term
    # would keep every pair (MIN_NORM2_FLOAT32): filter in float64
    if name == "float32" and not (top <= MAX_NORM2["float32"] and (top == 0.0 or top >= MIN_NORM2_FLOAT32)):
        cents = [xp.astype(a - mu, xp.float64) for a in orig64]
        norms = [xp.sum(c**2, axis=1) for c in cents]
        name, top = "float64", max(float(xp.max(n)) for n in norms)
    if not (math.isfinite(top) and top <= MAX_NORM2["float64"]):
        raise ValueError(
            f"centered squared row norms up to {top:.3g} exceed the float64 GEMM range "
            f"({MAX_NORM2['float64']:.0e}); scale the rows by a power of two first."
        )
    return orig64, cents, norms, name


def _filter(xp, XA, nA, XB, nB, c, eabs):
    """Filter values ``f`` and their bounds ``e`` for all pairs of two blocks (float64)."""
    G = f64(xp, XA @ xp.permute_dims(XB, (1, 0)), exact=False)  # flushes covered by e_abs
    a = xp.expand_dims(nA, axis=1) + xp.expand_dims(nB, axis=0)
    return a - 2.0 * G, c * a + eabs


def _refine(xp, SA, SB, rows, cols):
    """Refined squared distances of the pairs ``(rows[t], cols[t])`` of ``SA`` x ``SB``."""
    out = []
    n = rows.shape[0]
    for s in range(0, n, _REFINE_BATCH):
        e = min(s + _REFINE_BATCH, n)  # array-API slices may not run past the end
        r = rows[s:e]
        q = cols[s:e]
        out.append(canonical_sq(xp, xp.take(SA, r, axis=0), xp.take(SB, q, axis=0)))
    return xp.concat(out) if len(out) > 1 else out[0]


def _const(xp, value):
    return xp.asarray(value, dtype=xp.float64)


def _scatter(xp, mask, values, fill):
    """A float64 array shaped like ``mask``: ``values`` (row-major order) where True."""
    R = xp.full(mask.shape, fill, dtype=xp.float64)
    R[mask] = values
    return R


def _row_blocks(xp, XA, nA, XB, nB, c, eabs, b):
    """Per block of ``b`` rows of A against all rows of B: ``(i0, F, E, diagonal)``,
    ``diagonal`` marking the entries with equal row and column index."""
    n_a = XA.shape[0]
    jj = xp.expand_dims(xp.arange(0, XB.shape[0]), axis=0)
    for i0 in range(0, n_a, b):
        i1 = min(i0 + b, n_a)
        F, E = _filter(xp, XA[i0:i1, :], nA[i0:i1], XB, nB, c, eabs)
        yield i0, F, E, xp.expand_dims(xp.arange(i0, i1), axis=1) == jj


def _block_rows(n_rows, n_cols, tile_size):
    """Rows per block of a (block x n_cols) filter: ``tile_size``, or _BLOCK_ENTRIES entries."""
    if tile_size:
        return max(1, min(n_rows, tile_size))
    return max(1, min(n_rows, max(64, _BLOCK_ENTRIES // max(n_cols, 1))))


def _tile_side(n_rows, tile_size):
    """Rows per side of a square (b x b) tile of the extreme-pair scan: ``tile_size``, or
    b^2 = _BLOCK_ENTRIES.  (Sized as a (b x n) row block, b was 83 at V = 50257: 183,000
    tiles of 83 x 83, each a few kernel launches and a host synchronization, and a
    row_diameter with a closest_pair of 50257 x 768 float32 rows did not end within
    150 s on an H200; 2048 x 2048 tiles are 325 there.)"""
    if tile_size:
        return max(1, min(n_rows, tile_size))
    return max(1, min(n_rows, math.isqrt(_BLOCK_ENTRIES)))


def _tiled_extreme_pair(S, *, maximize, tile_size=None) -> KernelRun:
    xp = array_namespace(S)
    (S64,), (X,), (nrm,), dt = _prepare(xp, [S])
    V, d = S64.shape
    c, eabs = rounding_bound(d, dt)
    b = _tile_side(V, tile_size)
    sign = 1.0 if maximize else -1.0
    best: tuple[float, int, int] | None = None  # (refined squared value, i, j)
    n_refined = 0
    for i0 in range(0, V, b):
        i1 = min(i0 + b, V)
        for j0 in range(i0, V, b):
            j1 = min(j0 + b, V)
            if j1 - 1 <= i0:
                continue
            F, E = _filter(xp, X[i0:i1, :], nrm[i0:i1], X[j0:j1, :], nrm[j0:j1], c, eabs)
            ii = xp.expand_dims(xp.arange(i0, i1), axis=1)
            jj = xp.expand_dims(xp.arange(j0, j1), axis=0)
            valid = jj > ii
            # signed so that "larger is better" in both modes: g = sign f, g +- e
            lo = xp.where(valid, sign * F - E, _const(xp, -math.inf))
            thr = float(xp.max(lo))
            if best is not None:
                thr = max(thr, sign * best[0])
            cand = valid & (sign * F + E >= thr)
            r, q = xp.nonzero(cand)
            if r.shape[0] == 0:  # every pair is beaten by the best so far
                continue
            vals = _refine(xp, S64, S64, r + i0, q + j0)
            n_refined += int(vals.shape[0])
            key = sign * vals
            k = int(xp.argmax(key))  # first occurrence: smallest (i, j) in row-major order
            cand_best = (float(vals[k]), i0 + int(r[k]), j0 + int(q[k]))
            if better(*cand_best, best, maximize):
                best = cand_best
    v, i, j = best_pair(best)
    return KernelRun(
        backend=_BACKEND, error_bound=reported_bound(d, dt, float(xp.max(nrm))), n_refined=n_refined,
        value=math.sqrt(v), i=i, j=j,
    )


def diameter(S, *, tile_size=None, n_threads=None) -> KernelRun:
    """The row diameter (``value, i, j``)."""
    return _tiled_extreme_pair(S, maximize=True, tile_size=tile_size)


def closest(S, *, tile_size=None, n_threads=None) -> KernelRun:
    """The closest pair (``value, i, j``)."""
    return _tiled_extreme_pair(S, maximize=False, tile_size=tile_size)


def farthest(S, *, tile_size=None, n_threads=None) -> KernelRun:
    """Each row's farthest other row (``indices, distances``)."""
    xp = array_namespace(S)
    (S64,), (X,), (nrm,), dt = _prepare(xp, [S])
    V, d = S64.shape
    c, eabs = rounding_bound(d, dt)
    b = _block_rows(V, V, tile_size)
    idx, dist, n_refined = [], [], 0
    for i0, F, E, diagonal in _row_blocks(xp, X, nrm, X, nrm, c, eabs, b):
        valid = ~diagonal
        thr = xp.max(xp.where(valid, F - E, _const(xp, -math.inf)), axis=1)
        cand = valid & (F + E >= xp.expand_dims(thr, axis=1))
        r, q = xp.nonzero(cand)
        vals = _refine(xp, S64, S64, r + i0, q)
        n_refined += int(vals.shape[0])
        R = _scatter(xp, cand, vals, -math.inf)
        idx.append(xp.astype(xp.argmax(R, axis=1), xp.int64))  # ties: smallest j
        dist.append(xp.sqrt(xp.max(R, axis=1)))
    return KernelRun(
        backend=_BACKEND, error_bound=reported_bound(d, dt, float(xp.max(nrm))), n_refined=n_refined,
        indices=xp.concat(idx), distances=xp.concat(dist),
    )


def knn(X, k, Y, *, exclude_self, tile_size=None, n_threads=None) -> KernelRun:
    """The k nearest rows (``indices, distances``)."""
    xp = array_namespace(X) if Y is None else array_namespace(X, Y)
    symmetric = Y is None
    origs, cents, norms, dt = _prepare(xp, [X] if symmetric else [X, Y])
    SA, XA, nA = origs[0], cents[0], norms[0]
    SB, XB, nB = (SA, XA, nA) if symmetric else (origs[1], cents[1], norms[1])
    n_a, d = SA.shape
    n_b = SB.shape[0]
    c, eabs = rounding_bound(d, dt)
    b = _block_rows(n_a, n_b, tile_size)
    idx, dist, n_refined = [], [], 0
    for i0, F, E, diagonal in _row_blocks(xp, XA, nA, XB, nB, c, eabs, b):
        hi = F + E
        if symmetric and exclude_self:
            hi = xp.where(diagonal, _const(xp, math.inf), hi)
            F = xp.where(diagonal, _const(xp, math.inf), F)
        # the k-th smallest upper bound: k pairs are certainly within it
        kth = xp.sort(hi, axis=1)[:, k - 1]
        cand = (F - E) <= xp.expand_dims(kth, axis=1)
        r, q = xp.nonzero(cand)
        vals = _refine(xp, SA, SB, r + i0, q)
        n_refined += int(vals.shape[0])
        R = _scatter(xp, cand, vals, math.inf)
        order = xp.argsort(R, axis=1, stable=True)[:, :k]  # ties: smaller index first
        idx.append(xp.astype(order, xp.int64))
        dist.append(xp.sqrt(xp.take_along_axis(R, order, axis=1)))
    return KernelRun(
        backend=_BACKEND, error_bound=reported_bound(d, dt, max(float(xp.max(nA)), float(xp.max(nB)))),
        n_refined=n_refined, indices=xp.concat(idx, axis=0), distances=xp.concat(dist, axis=0),
    )
