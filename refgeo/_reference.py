"""Brute-force reference kernels of the pairwise row geometry: the oracle.

Every pair is evaluated by :func:`refgeo._certify.canonical_sq` (direct float64
differences in the canonical summation order), block by block so that memory stays
bounded whatever the number of rows, and the winner is chosen by the one tie rule
(:func:`refgeo._certify.better`).  Written against the array API, so the same code runs
on NumPy, CuPy and array-api-strict.  Each kernel returns a
:class:`refgeo._backend.KernelRun` with ``error_bound = 0`` (nothing was filtered) and
``n_refined`` = every pair.

The compiled engine (``refgeo._engine``) and the array-API engine (``refgeo._tiled``)
must return exactly these values and indices.
"""

from __future__ import annotations

import math

from array_api_compat import array_namespace

from ._backend import KernelRun
from ._certify import best_pair, better, canonical_sq, f64

__all__ = ["closest", "diameter", "farthest", "knn"]

# Pairs per block of the scans: the (rows, rows, 8) float64 lane buffer of one block
# is 8 * 8 * 2**16 bytes = 4 MiB, whatever V.
BLOCK_PAIRS = 1 << 16
# float64 elements of one row block of distances in the k-NN / farthest scans.
ROW_ELEMENTS = 1 << 20

_BACKEND = "reference"


def _block_size(V: int) -> int:
    return max(1, min(V, math.isqrt(BLOCK_PAIRS)))


def _scan_extreme_pair(S, *, maximize: bool) -> KernelRun:
    """Brute force over all pairs ``i < j`` with refined distances, block by block."""
    xp = array_namespace(S)
    X = f64(xp, S)
    V = X.shape[0]
    b = _block_size(V)
    fill = -math.inf if maximize else math.inf
    best: tuple[float, int, int] | None = None
    for i0 in range(0, V, b):
        i1 = min(i0 + b, V)
        A = xp.expand_dims(X[i0:i1, :], axis=1)
        for j0 in range(i0, V, b):
            j1 = min(j0 + b, V)
            if j1 - 1 <= i0:  # no pair j > i in this block
                continue
            D2 = canonical_sq(xp, A, xp.expand_dims(X[j0:j1, :], axis=0))
            ii = xp.expand_dims(xp.arange(i0, i1), axis=1)
            jj = xp.expand_dims(xp.arange(j0, j1), axis=0)
            vals = xp.reshape(xp.where(jj > ii, D2, xp.asarray(fill, dtype=xp.float64)), (-1,))
            k = int(xp.argmax(vals)) if maximize else int(xp.argmin(vals))
            bj = j1 - j0
            cand = (float(vals[k]), i0 + k // bj, j0 + k % bj)
            if better(*cand, best, maximize):
                best = cand
    v, i, j = best_pair(best)
    return KernelRun(
        backend=_BACKEND, error_bound=0.0, n_refined=V * (V - 1) // 2, value=math.sqrt(v), i=i, j=j
    )


def diameter(S, *, tile_size=None, n_threads=None) -> KernelRun:
    """Row diameter by brute force (``tile_size``/``n_threads`` are engine options)."""
    return _scan_extreme_pair(S, maximize=True)


def closest(S, *, tile_size=None, n_threads=None) -> KernelRun:
    """Closest pair by brute force."""
    return _scan_extreme_pair(S, maximize=False)


def _row_distances_block(xp, A, B, self_offset, exclude_self, fill):
    """Refined squared distances of the rows of ``A`` to all rows of ``B``, shape (a, n_B).

    With ``exclude_self`` the entry (r, self_offset + r) is replaced by ``fill``.
    """
    nA = A.shape[0]
    nB = B.shape[0]
    bj = max(1, BLOCK_PAIRS // max(nA, 1))
    Ae = xp.expand_dims(A, axis=1)
    parts = []
    for j0 in range(0, nB, bj):
        j1 = min(j0 + bj, nB)
        parts.append(canonical_sq(xp, Ae, xp.expand_dims(B[j0:j1, :], axis=0)))
    D2 = xp.concat(parts, axis=1) if len(parts) > 1 else parts[0]
    if exclude_self:
        ii = xp.expand_dims(xp.arange(self_offset, self_offset + nA), axis=1)
        jj = xp.expand_dims(xp.arange(0, nB), axis=0)
        D2 = xp.where(ii == jj, xp.asarray(fill, dtype=xp.float64), D2)
    return D2


def farthest(S, *, tile_size=None, n_threads=None) -> KernelRun:
    """Each row's farthest other row (ties: the smallest index)."""
    xp = array_namespace(S)
    X = f64(xp, S)
    V = X.shape[0]
    bi = max(1, min(V, ROW_ELEMENTS // V))
    idx, dist = [], []
    for i0 in range(0, V, bi):
        i1 = min(i0 + bi, V)
        D2 = _row_distances_block(xp, X[i0:i1, :], X, i0, True, -math.inf)
        j = xp.argmax(D2, axis=1)  # first occurrence: the smallest j among ties
        idx.append(xp.astype(j, xp.int64))
        dist.append(xp.sqrt(xp.max(D2, axis=1)))
    return KernelRun(
        backend=_BACKEND, error_bound=0.0, n_refined=V * (V - 1),
        indices=xp.concat(idx), distances=xp.concat(dist),
    )


def knn(X, k, Y, *, exclude_self, tile_size=None, n_threads=None) -> KernelRun:
    """The k nearest rows of ``Y`` (``X`` itself when None) for every row of ``X``."""
    xp = array_namespace(X) if Y is None else array_namespace(X, Y)
    A = f64(xp, X)
    B = A if Y is None else f64(xp, Y)
    nA, nB = A.shape[0], B.shape[0]
    self_pairs = Y is None and exclude_self
    bi = max(1, min(nA, ROW_ELEMENTS // nB))
    idx, dist = [], []
    for i0 in range(0, nA, bi):
        i1 = min(i0 + bi, nA)
        D2 = _row_distances_block(xp, A[i0:i1, :], B, i0, self_pairs, math.inf)
        order = xp.argsort(D2, axis=1, stable=True)[:, :k]  # ties: smaller index first
        idx.append(xp.astype(order, xp.int64))
        dist.append(xp.sqrt(xp.take_along_axis(D2, order, axis=1)))
    return KernelRun(
        backend=_BACKEND, error_bound=0.0, n_refined=nA * (nB - int(self_pairs)),
        indices=xp.concat(idx, axis=0), distances=xp.concat(dist, axis=0),
    )
