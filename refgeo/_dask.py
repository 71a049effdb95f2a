"""The ``dask`` backend: the certified pairwise engine as a Dask task graph.

``row_diameter``, ``closest_pair``, ``distance_ratio``, ``farthest_partners`` and
``knn`` route ``dask.array.Array`` inputs here (:func:`refgeo._backend.select`).  The
graph has one task per pair of row blocks ``(I, J)``, ``I <= J`` (all pairs for k-NN
of ``X`` against another ``Y``), and a tree reduction of their small records:

1. the common float64 mean of the rows, a Dask reduction, is the center of every task;
2. a task centers its two row blocks about that mean, filters their pairs with the
   Gram expansion (:func:`refgeo._tiled._filter`: one GEMM in the filter dtype, the
   rest in float64) and refines, in float64 from the original rows it holds, every
   pair that the a-priori rounding bound (:func:`refgeo._certify.rounding_bound`)
   cannot rule out (:func:`refgeo._tiled._refine`, the canonical summation order of
   :func:`refgeo._certify.canonical_sq`);
3. it returns the extreme of its block pair (value, pair, bound, number of refined
   pairs), or per-row best partners, or per-row top-k lists for k-NN;
4. records merge with the one tie rule (:func:`refgeo._certify.better`: among equal
   values the smallest ``(i, j)``; for k-NN the smaller index), eight at a time.

Every value a task reports is the refined float64 squared distance of two original
rows, and a task never drops a pair that could reach or tie the extreme of its block
pair, so the merged answer is exactly the single-machine engine's answer: the same
value and indices, bit for bit, whatever the chunking, the number of workers or the
order in which tasks finish, and after Dask reruns the tasks of a lost worker (tasks
are pure functions of their blocks).  The reported ``error_bound`` is the largest
bound any task used; it can differ from the single-machine one in its last bits (a
mean computed in another order) and ``n_refined`` counts what the tasks refined.

Memory.  A task holds its two row blocks (``O(b d)``) and a few ``b x b`` float64
filter arrays (``O(b^2)``), with ``b`` at most :data:`MAX_BLOCK_ROWS` rows (larger
row chunks are split, column chunks are merged: a task needs whole rows).  Records
are ``O(1)`` (extreme pairs) or ``O(b k)`` (k-NN); no ``V x V`` array exists and the
caller's process receives only the merged records.  Dask itself is imported only
when a Dask array arrives: it is the optional ``[dask]`` extra.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from ._backend import KernelRun
from ._certify import MAX_NORM2, better, reported_bound, rounding_bound
from ._tiled import _filter, _refine

__all__ = ["MAX_BLOCK_ROWS", "block_rows", "closest", "diameter", "farthest", "knn"]

_BACKEND = "dask"

# Rows per task block at most: one float64 block x block filter array is 32 MiB, and
# a (2048 x d) @ (d x 2048) GEMM runs at the BLAS peak for every d of interest.
MAX_BLOCK_ROWS = 2048
# Records merged per reduction task.
FAN_IN = 8


class _Pair(NamedTuple):
    """Extreme of one block pair: refined squared value, pair, bound, refined count."""

    value: float
    i: int
    j: int
    bound: float
    n_refined: int


class _Rows(NamedTuple):
    """Per-row records of one row block: ``values`` (float64) and ``index`` (int64),
    shape ``(rows,)`` for farthest partners, ``(rows, m)`` sorted for k-NN."""

    values: Any
    index: Any
    bound: float
    n_refined: int


# --------------------------------------------------------------------------- chunking


def block_rows(chunks: tuple[int, ...], cap: int) -> tuple[int, ...]:
    """Row chunks with every chunk above ``cap`` rows split into near-equal parts.

    Examples
    --------
    >>> block_rows((5, 1, 9), 4)
    (3, 2, 1, 3, 3, 3)
    """
    out: list[int] = []
    for c in chunks:
        parts = -(-c // cap)
        q, r = divmod(c, parts)
        out.extend([q + 1] * r + [q] * (parts - r))
    return tuple(out)


def _task_blocks(S, tile_size):
    """``(delayed row blocks, row offsets)`` of a 2-D Dask array, whole rows per block."""
    if any(isinstance(c, float) and math.isnan(c) for c in S.chunks[0]):
        raise ValueError(
            "the Dask array has unknown chunk sizes along its rows; call "
            "x.compute_chunk_sizes() first."
        )
    cap = max(1, min(tile_size or MAX_BLOCK_ROWS, MAX_BLOCK_ROWS))
    rows = block_rows(S.chunks[0], cap)
    if len(S.chunks[1]) > 1 or rows != S.chunks[0]:
        # a task needs whole rows: merge the column chunks (O(b d) per chunk)
        S = S.rechunk({0: rows, 1: -1})
    blocks = list(S.to_delayed()[:, 0])
    offsets = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
    return blocks, [int(o) for o in offsets]


def _mean(arrays):
    """The common float64 mean of the rows of ``arrays``, as one delayed value."""
    total = sum(a.shape[0] for a in arrays)
    s = arrays[0].sum(axis=0, dtype=np.float64)
    for a in arrays[1:]:
        s = s + a.sum(axis=0, dtype=np.float64)
    mu = (s / total).rechunk(-1)
    return mu.to_delayed()[0]


def _tree(parts, merge, *args):
    import dask

    fn = dask.delayed(merge, pure=True)
    while len(parts) > 1:
        parts = [fn(parts[s : s + FAN_IN], *args) for s in range(0, len(parts), FAN_IN)]
    return parts[0]


def _compute(*values):
    import dask

    return dask.compute(*values)


# --------------------------------------------------------------------------- task kernels


def _filter_dtype(*blocks) -> str:
    d = blocks[0].shape[1]
    if all(b.dtype == np.float32 for b in blocks) and math.isfinite(rounding_bound(d, "float32")[0]):
        return "float32"
    return "float64"


def _centered(S64, mu, dt):
    """The centered copy in the filter dtype and its float64 squared norms."""
    X = S64 - mu
    if dt == "float32":
        X = X.astype(np.float32)
        nrm = np.einsum("ij,ij->i", X, X, dtype=np.float64)
    else:
        nrm = np.einsum("ij,ij->i", X, X)
    return X, nrm


def _prepare(SA, SB, mu):
    """Both blocks as float64 originals, centered copies, norms, filter dtype.

    ``SB`` None means the block against itself.  A float32 copy whose norms would
    overflow the float32 GEMM is replaced by a float64 one (as the engines do).
    """
    dt = _filter_dtype(SA) if SB is None else _filter_dtype(SA, SB)
    A64 = np.asarray(SA, dtype=np.float64)
    B64 = A64 if SB is None else np.asarray(SB, dtype=np.float64)
    for _ in range(2):
        XA, nA = _centered(A64, mu, dt)
        XB, nB = (XA, nA) if SB is None else _centered(B64, mu, dt)
        top = max(float(nA.max()), float(nB.max()))
        if dt == "float64" or top <= MAX_NORM2["float32"]:
            break
        dt = "float64"
    if not (math.isfinite(top) and top <= MAX_NORM2["float64"]):
        raise ValueError(
            f"centered squared row norms up to {top:.3g} exceed the float64 GEMM range "
            f"({MAX_NORM2['float64']:.0e}); scale the rows by a power of two first."
        )
    d = A64.shape[1]
    c, eabs = rounding_bound(d, dt)
    return A64, B64, XA, nA, XB, nB, c, eabs, reported_bound(d, dt, top)


def _pair_task(SA, SB, i0, j0, mu, maximize):
    """Certified extreme of the pairs (i in block A, j in block B, i < j)."""
    same = SB is None
    A64, B64, XA, nA, XB, nB, c, eabs, bound = _prepare(SA, SB, mu)
    F, E = _filter(np, XA, nA, XB, nB, c, eabs)
    sign = 1.0 if maximize else -1.0
    if same:
        if A64.shape[0] < 2:
            return None
        valid = np.triu(np.ones(F.shape, dtype=bool), k=1)
        lo = np.where(valid, sign * F - E, -math.inf)
    else:
        lo = sign * F - E
    # every pair with g + e below the best certified lower end is strictly beaten
    thr = float(lo.max())
    cand = sign * F + E >= thr
    if same:
        cand &= valid
    r, q = np.nonzero(cand)  # row-major: the first maximum is the smallest (i, j)
    vals = _refine(np, A64, B64, r, q)
    k = int(np.argmax(sign * vals))
    return _Pair(float(vals[k]), i0 + int(r[k]), j0 + int(q[k]), bound, int(vals.shape[0]))


def _merge_pairs(records, maximize):
    best, bound, n = None, 0.0, 0
    for rec in records:
        if rec is None:
            continue
        bound = max(bound, rec.bound)
        n += rec.n_refined
        if better(rec.value, rec.i, rec.j, None if best is None else best[:3], maximize):
            best = (rec.value, rec.i, rec.j)
    if best is None:
        return None
    return _Pair(best[0], best[1], best[2], bound, n)


def _farthest_task(SA, SB, i0, j0, mu):
    """Farthest partner of every row of A within B and, for B != A, of every row of B
    within A: ``(rows of A, rows of B or None)``."""
    same = SB is None
    A64, B64, XA, nA, XB, nB, c, eabs, bound = _prepare(SA, SB, mu)
    F, E = _filter(np, XA, nA, XB, nB, c, eabs)
    lo = F - E
    hi = F + E
    if same:
        diag = np.eye(F.shape[0], dtype=bool)
        lo[diag] = -math.inf
        hi[diag] = -math.inf
    cand = hi >= lo.max(axis=1, keepdims=True)
    if not same:
        cand |= hi >= lo.max(axis=0, keepdims=True)
    r, q = np.nonzero(cand)
    vals = _refine(np, A64, B64, r, q)
    R = np.full(F.shape, -math.inf)
    R[r, q] = vals
    n = int(vals.shape[0])
    ja = np.argmax(R, axis=1)  # first occurrence: the smallest j among ties
    rows_a = _Rows(R[np.arange(R.shape[0]), ja], ja.astype(np.int64) + j0, bound, n)
    if same:
        return rows_a, None
    ib = np.argmax(R, axis=0)
    rows_b = _Rows(R[ib, np.arange(R.shape[1])], ib.astype(np.int64) + i0, bound, 0)
    return rows_a, rows_b


def _pick(pair, side):
    return pair[side]


def _merge_farthest(records):
    recs = [r for r in records if r is not None]
    v, j = recs[0].values, recs[0].index
    for rec in recs[1:]:
        take = (rec.values > v) | ((rec.values == v) & (rec.index < j))
        v = np.where(take, rec.values, v)
        j = np.where(take, rec.index, j)
    return _Rows(v, j, max(r.bound for r in recs), sum(r.n_refined for r in recs))


def _topk_of(vals, rows, cols, n_rows, m):
    """The ``m`` smallest ``(value, col)`` of every row among candidate triples."""
    order = np.lexsort((cols, vals, rows))
    rs = rows[order]
    start = np.searchsorted(rs, np.arange(n_rows))
    pos = start[:, None] + np.arange(m)[None, :]
    return vals[order][pos], cols[order][pos]


def _knn_task(SA, SB, i0, j0, mu, k, exclude_self, both):
    """Exact top-k of the rows of A among B (and of B among A when ``both``)."""
    same = SB is None
    A64, B64, XA, nA, XB, nB, c, eabs, bound = _prepare(SA, SB, mu)
    F, E = _filter(np, XA, nA, XB, nB, c, eabs)
    lo = F - E
    hi = F + E
    na, nb = F.shape
    if same and exclude_self:
        diag = np.eye(na, dtype=bool)
        lo[diag] = math.inf
        hi[diag] = math.inf
    ma = min(k, nb - int(same and exclude_self))
    if ma < 1:
        return None, None
    # k pairs of the row are certainly within its k-th smallest upper end; a pair whose
    # lower end lies beyond it cannot be among the k nearest, nor tie the k-th
    kth = np.partition(hi, ma - 1, axis=1)[:, ma - 1 : ma]
    cand = lo <= kth
    mb = min(k, na)
    if both:
        kth_b = np.partition(hi, mb - 1, axis=0)[mb - 1 : mb, :]
        cand |= lo <= kth_b
    r, q = np.nonzero(cand)
    vals = _refine(np, A64, B64, r, q)
    n = int(vals.shape[0])
    if both:
        keep = lo[r, q] <= kth[r, 0]
        va, ia = _topk_of(vals[keep], r[keep], q[keep], na, ma)
    else:
        va, ia = _topk_of(vals, r, q, na, ma)
    rows_a = _Rows(va, ia.astype(np.int64) + j0, bound, n)
    if not both:
        return rows_a, None
    keep = lo[r, q] <= kth_b[0, q]
    vb, ib = _topk_of(vals[keep], q[keep], r[keep], nb, mb)
    return rows_a, _Rows(vb, ib.astype(np.int64) + i0, bound, 0)


def _merge_knn(records, k):
    recs = [r for r in records if r is not None]
    v = np.concatenate([r.values for r in recs], axis=1)
    j = np.concatenate([r.index for r in recs], axis=1)
    order = np.lexsort((j, v), axis=1)[:, :k]  # by value, then the smaller index
    return _Rows(
        np.take_along_axis(v, order, axis=1), np.take_along_axis(j, order, axis=1),
        max(r.bound for r in recs), sum(r.n_refined for r in recs),
    )


# --------------------------------------------------------------------------- graphs


def _blocks_and_mean(arrays, tile_size):
    return [_task_blocks(a, tile_size) for a in arrays], _mean(arrays)


def _extreme(S, *, maximize, tile_size) -> KernelRun:
    import dask

    ((blocks, offsets),), mu = _blocks_and_mean([S], tile_size)
    task = dask.delayed(_pair_task, pure=True)
    parts = [
        task(blocks[a], None if a == b else blocks[b], offsets[a], offsets[b], mu, maximize)
        for a in range(len(blocks))
        for b in range(a, len(blocks))
    ]
    (rec,) = _compute(_tree(parts, _merge_pairs, maximize))
    return KernelRun(
        backend=_BACKEND, error_bound=rec.bound, n_refined=rec.n_refined,
        value=math.sqrt(rec.value), i=rec.i, j=rec.j,
    )


def diameter(S, *, tile_size=None, n_threads=None) -> KernelRun:
    """Row diameter of a Dask array (``n_threads`` is the workers' business)."""
    return _extreme(S, maximize=True, tile_size=tile_size)


def closest(S, *, tile_size=None, n_threads=None) -> KernelRun:
    """Closest pair of a Dask array."""
    return _extreme(S, maximize=False, tile_size=tile_size)


def _per_row_blocks(tasks, nblocks, merge, *args):
    """Tree-merge the per-row records of each row block: ``tasks`` maps a block
    to its delayed records."""
    return [_tree(tasks[a], merge, *args) for a in range(nblocks)]


def farthest(S, *, tile_size=None, n_threads=None) -> KernelRun:
    """Each row's farthest other row for a Dask array."""
    import dask

    ((blocks, offsets),), mu = _blocks_and_mean([S], tile_size)
    nb = len(blocks)
    task = dask.delayed(_farthest_task, pure=True, nout=2)
    parts: list[list] = [[] for _ in range(nb)]
    for a in range(nb):
        for b in range(a, nb):
            ra, rb = task(blocks[a], None if a == b else blocks[b], offsets[a], offsets[b], mu)
            parts[a].append(ra)
            if a != b:
                parts[b].append(rb)
    if offsets[-1] < 2:  # pragma: no cover - the public functions need two rows
        raise ValueError("farthest partners need at least two rows")
    recs = _compute(*_per_row_blocks(parts, nb, _merge_farthest))
    return KernelRun(
        backend=_BACKEND, error_bound=max(r.bound for r in recs),
        n_refined=sum(r.n_refined for r in recs),
        indices=np.concatenate([r.index for r in recs]),
        distances=np.sqrt(np.concatenate([r.values for r in recs])),
    )


def knn(X, k, Y, *, exclude_self, tile_size=None, n_threads=None) -> KernelRun:
    """The k nearest rows for Dask arrays (``Y`` None: ``X`` against itself)."""
    import dask

    symmetric = Y is None
    if symmetric:
        ((blocks, offsets),), mu = _blocks_and_mean([X], tile_size)
        yblocks, yoffsets = blocks, offsets
    else:
        ((blocks, offsets), (yblocks, yoffsets)), mu = _blocks_and_mean([X, Y], tile_size)
    task = dask.delayed(_knn_task, pure=True, nout=2)
    nb = len(blocks)
    parts: list[list] = [[] for _ in range(nb)]
    if symmetric:
        for a in range(nb):
            for b in range(a, nb):
                ra, rb = task(blocks[a], None if a == b else blocks[b], offsets[a], offsets[b], mu,
                              k, exclude_self, a != b)
                parts[a].append(ra)
                if a != b:
                    parts[b].append(rb)
    else:
        for a in range(nb):
            for b in range(len(yblocks)):
                ra, _ = task(blocks[a], yblocks[b], offsets[a], yoffsets[b], mu, k, False, False)
                parts[a].append(ra)
    recs = _compute(*_per_row_blocks(parts, nb, _merge_knn, k))
    return KernelRun(
        backend=_BACKEND, error_bound=max(r.bound for r in recs),
        n_refined=sum(r.n_refined for r in recs),
        indices=np.concatenate([r.index for r in recs], axis=0),
        distances=np.sqrt(np.concatenate([r.values for r in recs], axis=0)),
    )
