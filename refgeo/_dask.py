"""The ``dask`` backend: the certified pairwise engine as a Dask task graph.

``row_diameter``, ``closest_pair``, ``distance_ratio``, ``farthest_partners`` and
``knn`` route ``dask.array.Array`` inputs here (:func:`refgeo._backend.select`).  The
graph has one task per pair of row blocks ``(I, J)``, ``I <= J`` (all pairs for k-NN
of ``X`` against another ``Y``), and a tree reduction of their small records:

Every task has three engines, with the same answers: where ``refgeo_ext`` is
importable, the compiled engine's two-block kernels (``refgeo_ext._knn_blocks``: the
same tiles, bound and refinement as on one machine; the farthest partners share the
single-machine kernel's tile epilogue, ``src/farthest.h``); the NumPy tasks below
where it is not; and for CuPy chunks the array-API tasks (``_pair_task_xp``,
``_farthest_task_xp``, ``_knn_keys_task_xp``: the GEMM, the filter and the float64
refinement on the GPU, only the records come back to the host).  ``engine=`` of
:func:`diameter`, :func:`closest`, :func:`farthest` and :func:`knn` forces one.

1. the common float64 mean of the rows, a Dask reduction, is the center of every task;
2. a task centers its two row blocks about that mean, filters their pairs with the
   Gram expansion (one GEMM in the filter dtype, formed in place) and refines, in
   float64 from the original rows it holds, every pair that the a-priori rounding
   bound (:func:`refgeo._certify.rounding_bound`) cannot rule out
   (:func:`refine_pairs`, the canonical summation order of
   :func:`refgeo._certify.canonical_sq`);
3. it returns the extreme of its block pair (value, pair, bound, number of refined
   pairs), or for farthest partners on the compiled and array-API engines each row's
   farthest partner within the block pair (every pair that can reach the row's
   certified lower bound over the block pair is refined in the task); k-NN, and
   farthest partners on the NumPy engine, run in two phases, filter tasks returning
   each row's threshold ends and unrefined candidates, refinement tasks (again holding
   both blocks) refining only the candidates that survive the row's threshold over
   all blocks, so that each row refines about as many pairs as on one machine;
4. records merge with the one tie rule (:func:`refgeo._certify.better`: among equal
   values the smallest ``(i, j)``; for k-NN the smaller index), eight at a time.

Every value a task reports is the refined float64 squared distance of two original
rows, and a task never drops a pair that could reach or tie the extreme of its block
pair, so the merged answer is exactly the single-machine engine's answer: the same
value and indices, bit for bit, whatever the chunking, the number of workers or the
order in which tasks finish, and after Dask reruns the tasks of a lost worker (tasks
are pure functions of their blocks).  The reported ``error_bound`` is the largest
bound any task used, and it can differ from the single-machine one: the tasks filter
float64 rows in float32 for the maximum whatever the size (the single-machine engine
only from ``V**2 d / 2 >= 2**26`` multiply-adds), whose bound is about ``2**-24``
relative where the float64 filter's is about ``d 2**-53``, and their means are
computed in another order; ``n_refined`` counts what the tasks refined.

Scale.  The rows arrive prescaled: the public functions of :mod:`refgeo.rows` run
every backend on ``rows * 2**-e`` (:func:`refgeo._certify.scale_exponent`) and scale
the distances back.  The functions here do not prescale; called directly on float64
rows whose largest magnitude lies outside ``[2**-SCALE_FREE_EXPONENT,
2**(SCALE_FREE_EXPONENT + 1))`` their squared distances can overflow or lose bits to
underflow, and the answer need not be the single-machine engine's.

Memory.  A task holds its two row blocks (``O(b d)``) and a few ``b x b`` float64
filter arrays (``O(b^2)``), with ``b`` at most ``tile_size`` or :data:`MAX_BLOCK_ROWS`
rows (larger row chunks are split, column chunks are merged: a task needs whole
rows; smaller row chunks are kept); a worker also keeps the centered copies of up to
16 blocks for its k-NN filter tasks (:func:`_centered_block`).  Records
are ``O(1)`` (extreme pairs) or ``O(b k)`` (k-NN); no ``V x V`` array exists and the
caller's process receives only the merged records.  Dask itself is imported only
when a Dask array arrives: it is the optional ``[dask]`` extra.
"""

from __future__ import annotations

import functools
import math
import os
import threading
import warnings
import weakref
from typing import Any, NamedTuple

import numpy as np
from array_api_compat import array_namespace, is_cupy_array

from . import _backend, _duplicates, _engine
from ._backend import KernelRun
from ._interop import to_host
from ._threads import blas_single_thread
from ._validate import beyond_float64, float64_range_error, outside_stacklevel
from ._filter import (
    error_terms,
    filter_bound,
    filter_values,
    first_per_row,
    pairs_within,
    round_into,
)
from ._certify import (
    MAX_NORM2,
    MIN_NORM2_FLOAT32,
    better,
    canonical_sq,
    f64,
    lowered_key_bound,
    reported_bound,
    rounding_bound,
    scale_exponent_of,
)

__all__ = ["MAX_BLOCK_ROWS", "block_rows", "closest", "diameter", "duplicate_rows", "farthest", "knn", "refine_pairs",
           "take_rows"]

_BACKEND = "dask"

# Rows per task block at most: one float64 block x block filter array is 32 MiB, and
# a (2048 x d) @ (d x 2048) GEMM runs at the BLAS peak for every d of interest.
MAX_BLOCK_ROWS = 2048
# The compiled k-NN tasks hold no block x block array (per-row heaps of k plus slack
# entries instead), so their blocks may be larger: fewer tasks, less scheduling.
MAX_KNN_BLOCK_ROWS = 8192
# Records merged per reduction task.
FAN_IN = 8
# Block-pair tasks above which small row chunks are warned about (about ten seconds of
# a scheduler's time at a millisecond a task).
SMALL_BLOCK_TASKS = 10_000


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
    """Row chunks with every chunk above ``cap`` rows split into near-equal parts, and
    empty chunks (a boolean mask can leave them) dropped.

    Examples
    --------
    >>> block_rows((5, 1, 0, 9), 4)
    (3, 2, 1, 3, 3, 3)
    """
    out: list[int] = []
    for c in chunks:
        if c == 0:
            continue
        parts = -(-c // cap)
        q, r = divmod(c, parts)
        out.extend([q + 1] * r + [q] * (parts - r))
    return tuple(out)


def _task_blocks(S, tile_size, host=True):
    """``(delayed row blocks, row offsets)`` of a 2-D Dask array, whole rows per block."""
    if any(isinstance(c, float) and math.isnan(c) for c in S.chunks[0]):
        raise ValueError(
            "the Dask array has unknown chunk sizes along its rows; call "
            "x.compute_chunk_sizes() first."
        )
    cap = max(1, tile_size or MAX_BLOCK_ROWS)
    rows = block_rows(S.chunks[0], cap)
    if host and _chunks_on_gpu(S):
        # tasks of an engine that runs on the host (engine= forced): a copy per chunk
        S = S.map_blocks(_host, meta=np.empty((0, 0), dtype=S.dtype))
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


def _tree(parts, merge, *args, fan_in=FAN_IN):
    """Merge ``parts`` with ``merge(records, *args)``, ``fan_in`` records per task."""
    import dask
    from dask.base import tokenize

    fn = dask.delayed(_merge_group, pure=True)
    name = merge.__name__
    while len(parts) > 1:
        groups = [parts[s : s + fan_in] for s in range(0, len(parts), fan_in)]
        parts = [fn(merge, args, *g, dask_key_name=f"{name}-{tokenize(name, args, *g)}") for g in groups]
    return parts[0]


def _merge_group(merge, args, *records):
    """One merge of :func:`_tree`.  The records come as separate task arguments: a list
    of delayed values passed as one argument is finalized by Dask as a collection of
    its own, a pass over the whole graph built so far on every call (0.8 s of graph
    building for the 325 block pairs of a k-NN at 25 row blocks)."""
    return merge(list(records), *args)


def _compute(*values):
    import dask

    return dask.compute(*values)


def _engine_rows(S, name):
    """``S`` with float32 or float64 chunks: other real floating chunks (float16, long
    double) as float64, as NumPy inputs of those dtypes are converted
    (:func:`refgeo._validate.as_float_array`).  The tasks' engines, and the k-NN
    refinement in particular, know only float32 and float64 rows.  Finite long double
    entries beyond the float64 range raise the ``ValueError`` of a NumPy input, naming
    ``name``, before any pairwise task runs (one pass over the chunks)."""
    if S is None or S.dtype in (np.float32, np.float64):
        return S
    if S.dtype.itemsize > 8:
        import dask

        counts = _compute(*[dask.delayed(beyond_float64, pure=True)(b) for b in S.to_delayed().ravel()])
        n = sum(c for c, _ in counts)
        if n:
            raise float64_range_error(name, n, max(t for c, t in counts if c))
    return S.astype(np.float64)


# Bytes of rows that :func:`duplicate_rows` fetches to the caller: one row of each group
# of equal hashes (the tasks compare their own rows with it), and the rows of the rare
# groups that hold several classes (hash collisions).  Beyond it the rows run as they
# are (the same answer, with every pair of identical rows inside the filter's bound).
_DUPLICATE_FETCH_BYTES = 256 << 20


def _hash_task(block):
    """The row hashes (:mod:`refgeo._duplicates`) and the magnitudes of one row block."""
    B = np.asarray(block)
    return _duplicates.row_hashes(B), _duplicates.magnitudes(B)


def _take_task(block, local):
    return np.asarray(block)[local]


def _equal_task(block, local, L, at):
    """Whether each row ``local`` of the block equals the row ``at`` of ``L``."""
    return _duplicates.equal_rows(np.asarray(block), local, L, at)


def _per_block(offsets, rows):
    """``(block, slice of rows)`` for the increasing ``rows`` in each block that holds some."""
    cut = np.searchsorted(rows, offsets)
    return [(b, slice(cut[b], cut[b + 1])) for b in range(len(offsets) - 1) if cut[b + 1] > cut[b]]


def _takes(blocks, offsets, rows):
    """``[(delayed rows, count)]``: the increasing ``rows`` taken from the blocks that
    hold them, one task per block."""
    import dask

    take = dask.delayed(_take_task, pure=True)
    return [(take(blocks[b], rows[sl] - offsets[b]), sl.stop - sl.start) for b, sl in _per_block(offsets, rows)]


def take_rows(S, rows):
    """``S[rows]`` for increasing ``rows``, as a Dask array: one task per block of the
    pairwise tasks (:func:`_task_blocks`) that holds some of them.  The duplicate search
    works on those same blocks: Dask's own fancy indexing builds another graph of the
    chunks, and the scheduler warns when two graphs give one chunk key different tasks."""
    import dask.array as da

    blocks, offsets = _task_blocks(S, None)
    return da.concatenate([da.from_delayed(t, shape=(n, S.shape[1]), dtype=S.dtype, meta=S._meta)
                           for t, n in _takes(blocks, np.asarray(offsets), rows)])


def duplicate_rows(S):
    """``(dup, e)``: the classes of identical rows of a Dask array, where the
    extreme-pair kernels may run on fewer rows (:func:`refgeo._duplicates.duplicate_rows`;
    else None), and the prescaling exponent of the rows
    (:func:`refgeo._certify.scale_exponent`; None for CuPy chunks and fewer than 2 rows).

    One pass over the row chunks hashes every row and takes the magnitudes that
    :func:`refgeo._duplicates.separated` and the prescaling need (for float64 rows the
    prescaling took its own pass before; for float32 rows, which are never prescaled,
    the pass is new).  The caller sorts the V hashes and fetches one row of each group
    of equal hashes; a second pass compares each row of a group with that row, in the
    tasks that hold it, and only the rows of groups that hold several classes (hash
    collisions) are fetched too.  ``dup`` is None when every row differs, when the rows
    are not separated, when the fetched rows would exceed
    :data:`_DUPLICATE_FETCH_BYTES`, and for CuPy chunks (the rows then run as they
    are).  Time O(V d) on the workers, O(V log V + m d) here for m fetched rows.
    """
    import dask

    S = _engine_rows(S, "S")
    if S.shape[0] < 2 or _chunks_on_gpu(S):
        return None, None
    blocks, offsets = _task_blocks(S, None)  # the blocks the pairwise tasks read
    offsets = np.asarray(offsets)
    parts = _compute(*[dask.delayed(_hash_task, pure=True)(b) for b in blocks])
    largest, smallest = max(m[0] for _, m in parts), min(m[1] for _, m in parts)
    e = 0 if S.dtype == np.float32 else scale_exponent_of(largest)
    if not _duplicates.separated_by(largest, smallest):
        return None, e
    runs = _duplicates.hash_runs(np.concatenate([h for h, _ in parts]))
    if runs is None:
        return None, e
    rows, lead = runs
    budget = _DUPLICATE_FETCH_BYTES // (S.shape[1] * S.dtype.itemsize)

    def fetch(idx):
        return np.concatenate(_compute(*[t for t, _ in _takes(blocks, offsets, idx)]))

    leads = np.unique(lead)
    if leads.size > budget:
        return None, e
    L = dask.delayed(fetch(leads), pure=True)
    order = np.argsort(rows, kind="stable")
    rs, at = rows[order], np.searchsorted(leads, lead[order])
    eq = np.empty(rows.size, dtype=bool)
    per = _per_block(offsets, rs)
    done = _compute(*[dask.delayed(_equal_task, pure=True)(blocks[b], rs[sl] - offsets[b], L, at[sl])
                      for b, sl in per])
    for (_, sl), v in zip(per, done):
        eq[order[sl]] = v
    n_mixed = np.count_nonzero(np.isin(lead, lead[~eq]))
    if leads.size + n_mixed > budget:
        return None, e
    return _duplicates.classes(S.shape[0], rows, lead, eq, fetch), e


# --------------------------------------------------------------------------- task kernels


def _filter_dtype(blocks, float32_filter) -> str:
    """float32 for float32 rows, and for float64 rows in the maximum modes
    (``float32_filter``: the band within the float32 bound of the largest distance is
    thin, so few pairs are refined); float64 where float32 gives no useful bound."""
    d = blocks[0].shape[1]
    if not math.isfinite(rounding_bound(d, "float32")[0]):
        return "float64"
    if float32_filter or all(b.dtype == np.float32 for b in blocks):
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


class _Blocks(NamedTuple):
    A64: Any
    B64: Any
    H: Any  # filter values n_i + n_j - 2 x_i . x_j in the filter dtype, (rows of A, rows of B)
    nA: Any
    nB: Any
    c: float  # |H_ij - r_ij| <= c (n_i + n_j) + eabs
    eabs: float
    bound: float  # the reported bound of this task


def _prepare(SA, SB, mu, float32_filter=False) -> _Blocks:
    """Both blocks as float64 originals, the filter values and their rounding bound.

    ``SB`` None means the block against itself.  A float32 copy whose norms would
    overflow the float32 GEMM, or are so small that its products underflow
    (:data:`refgeo._certify.MIN_NORM2_FLOAT32`), is replaced by a float64 one (as the
    engines do).

    The filter values and their bound are :func:`refgeo._filter.filter_values` and
    :func:`refgeo._filter.filter_bound` (``rounding_bound``'s ``c`` plus ``7 u`` for
    the filter dtype's unit roundoff u).
    """
    blocks = [SA] if SB is None else [SA, SB]
    dt = _filter_dtype(blocks, float32_filter)
    A64 = np.asarray(SA, dtype=np.float64)
    B64 = A64 if SB is None else np.asarray(SB, dtype=np.float64)
    for _ in range(2):
        XA, nA = _centered(A64, mu, dt)
        XB, nB = (XA, nA) if SB is None else _centered(B64, mu, dt)
        top = max(float(nA.max()), float(nB.max()))
        if dt == "float64" or (top <= MAX_NORM2["float32"] and not 0.0 < top < MIN_NORM2_FLOAT32):
            break
        dt = "float64"
    if not (math.isfinite(top) and top <= MAX_NORM2["float64"]):
        raise ValueError(
            f"centered squared row norms up to {top:.3g} exceed the float64 GEMM range "
            f"({MAX_NORM2['float64']:.0e}); scale the rows by a power of two first."
        )
    c, eabs = filter_bound(A64.shape[1], dt)
    H = filter_values(XA, XB, nA, nB)
    return _Blocks(A64, B64, H, nA, nB, c, eabs, reported_bound(A64.shape[1], dt, top))


def _widen(t, nrm_rows, nrm_other_max, b: _Blocks, sign):
    """Per-row thresholds ``t +- 2 e_i`` (``e_i = c (n_i + max n) + eabs`` bounds every
    ``e_ij`` of the row), rounded outward into the filter dtype.  ``sign`` +1 widens up."""
    e = (b.c * (nrm_rows + nrm_other_max) + b.eabs) * (1.0 + 2.0**-40)
    w = np.asarray(t, dtype=np.float64) + sign * (2.0 * e + np.abs(t) * 2.0**-50)
    return round_into(w, b.H.dtype, sign)


# Candidate pairs refined per batch: (batch, d) float64 differences.
_REFINE_BATCH = 1 << 12


def refine_pairs(A64, B64, rows, cols):
    """Refined squared distances ``sum_k (A64[rows[t], k] - B64[cols[t], k])**2``, float64.

    The same operations in the same order as :func:`refgeo._certify.canonical_sq`, so
    the same bits: lane ``k mod 8`` accumulates the squared differences in increasing
    ``k``, and the lanes combine as ``((p0+p1)+(p2+p3))+((p4+p5)+(p6+p7))``.  The
    differences of a batch are formed once and the lanes are added in place (a missing
    tail of the last group of eight adds nothing: ``x + 0 = x`` for the non-negative
    partial sums), which is several times faster than slicing each group out of
    freshly gathered rows.

    Examples
    --------
    >>> import numpy as np
    >>> refine_pairs(np.array([[0.0, 0.0]]), np.array([[3.0, 4.0]]), np.array([0]), np.array([0]))
    array([25.])
    """
    n = rows.shape[0]
    d = A64.shape[1]
    out = np.empty(n)
    full = d - d % 8
    for s in range(0, n, _REFINE_BATCH):
        e = min(s + _REFINE_BATCH, n)
        D = A64[rows[s:e]]
        D -= B64[cols[s:e]]
        D *= D
        if full:
            lanes = D[:, 0:8].copy()
            for k0 in range(8, full, 8):
                lanes += D[:, k0 : k0 + 8]
        else:
            lanes = np.zeros((e - s, 8))
        if d > full:
            lanes[:, : d - full] += D[:, full:]
        p = [lanes[:, t] for t in range(8)]
        out[s:e] = ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]))
    return out


def _refined(b: _Blocks, r, q):
    """Refined float64 squared distances of the candidate pairs ``(r[t], q[t])``."""
    return refine_pairs(b.A64, b.B64, r, q)


def _pair_task(SA, SB, i0, j0, mu, maximize):
    """Certified extreme of the pairs (i in block A, j in block B, i < j)."""
    same = SB is None
    if same and SA.shape[0] < 2:
        return None
    if maximize:
        b = _prepare(SA, SB, mu, float32_filter=True)
        H = b.H
        if same:
            H[np.tril_indices(H.shape[0])] = -math.inf
        # the best refined value is at least max H - e_max; a pair with
        # H_ij + e_max below that is strictly beaten (e_max bounds every e_ij)
        t = _widen(np.array([float(H.max())]), np.array([float(b.nA.max())]), float(b.nB.max()), b, -1.0)
        r, q = np.nonzero(H >= t[0])
    else:
        b = _prepare(SA, SB, mu)
        # the closest pair keeps per-pair bounds: near-duplicate clusters would fill a
        # uniform band with candidates
        a = b.nA[:, None] + b.nB[None, :]
        E = b.c * a + b.eabs
        F = b.H.astype(np.float64)
        hi = F + E
        lo = F - E
        if same:
            lo[np.tril_indices(F.shape[0])] = math.inf
            hi[np.tril_indices(F.shape[0])] = math.inf
        # some pair has r <= min hi: a pair whose lower end lies beyond it is beaten
        thr = float(hi.min())
        r, q = np.nonzero(lo <= thr + abs(thr) * 2.0**-50)
    vals = _refined(b, r, q)
    sign = 1.0 if maximize else -1.0
    k = int(np.argmax(sign * vals))  # row-major: the first extreme is the smallest (i, j)
    return _Pair(float(vals[k]), i0 + int(r[k]), j0 + int(q[k]), b.bound, int(vals.shape[0]))


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


_NO_INDEX = np.iinfo(np.int64).max


def _farthest_side(H, nrm, other_max, b: _Blocks, columns=False):
    """Each row's (column's, when ``columns``) best lower end ``max_j H_ij - e_i`` and
    the pairs whose upper end ``H_ij + e_i`` reaches it (``e_i`` as in :func:`_knn_side`)."""
    e = (b.c * (nrm + other_max) + b.eabs) * (1.0 + 2.0**-40)
    m = H.max(axis=0 if columns else 1).astype(np.float64)
    low = m - (e + np.abs(m) * 2.0**-50)
    # H_ij + e_i >= m_i - e_i  <=>  H_ij >= m_i - 2 e_i, rounded down into the filter dtype
    w = _widen(m, nrm, other_max, b, -1.0)
    r, q = _pairs_where(lambda M: M >= (w[None, :] if columns else w[:, None]), H, columns)
    H = H.T if columns else H
    h = H[r, q].astype(np.float64)
    hi = h + (e[r] + np.abs(h) * 2.0**-50)
    return low, _Candidates(r.astype(np.int64), q.astype(np.int64), hi, b.bound)


def _farthest_filter_task(SA, SB, mu):
    """Filter one block pair for farthest partners: ``(low_A, candidates_A, low_B,
    candidates_B)``.  A row's lower ends merge into the largest over all blocks, L_i
    (its farthest partner's refined value is at least L_i); only pairs whose upper end
    reaches L_i can be, or tie, the farthest, and every such pair is among the
    candidates of its block pair (L_i is never below the block pair's own lower end)."""
    same = SB is None
    if same and SA.shape[0] < 2:  # one row: no partner in its own block
        return None, None, None, None
    b = _prepare(SA, SB, mu, float32_filter=True)
    H = b.H
    if same:
        np.fill_diagonal(H, -math.inf)
    low_a, cand_a = _farthest_side(H, b.nA, float(b.nB.max()), b)
    if same:
        return low_a, cand_a, None, None
    low_b, cand_b = _farthest_side(H, b.nB, float(b.nA.max()), b, columns=True)
    return low_a, cand_a, low_b, cand_b


def _merge_lows(parts):
    parts = [p for p in parts if p is not None]
    return np.maximum.reduce(parts) if parts else None


def _farthest_refine_task(SA, SB, cand, low, j0):
    """Refine the candidates whose upper end reaches the row's L_i; each row's best."""
    if cand is None:
        return None
    keep = cand.end >= low[cand.rows]
    r, q = cand.rows[keep], cand.cols[keep]
    if r.shape[0] == 0:
        return None
    A64 = np.asarray(SA, dtype=np.float64)
    B64 = A64 if SB is None else np.asarray(SB, dtype=np.float64)
    vals = refine_pairs(A64, B64, r, q)
    v, j, ok = first_per_row(-vals, vals, r, q, A64.shape[0], 1)  # largest, then smallest j
    return _Rows(np.where(ok[:, 0], v[:, 0], -math.inf), np.where(ok[:, 0], j[:, 0] + j0, _NO_INDEX),
                 cand.bound, int(vals.shape[0]))


def _merge_farthest(records):
    recs = [r for r in records if r is not None]
    if not recs:
        return None
    v, j = recs[0].values, recs[0].index
    for rec in recs[1:]:
        take = (rec.values > v) | ((rec.values == v) & (rec.index < j))
        v = np.where(take, rec.values, v)
        j = np.where(take, rec.index, j)
    return _Rows(v, j, max(r.bound for r in recs), sum(r.n_refined for r in recs))


class _Candidates(NamedTuple):
    """Candidates of one block pair after the filter, not yet refined."""

    rows: Any  # local row of the query block
    cols: Any  # local row of the candidate block
    end: Any  # float64 lower (k-NN) or upper (farthest) ends of the refined squared distances
    bound: float


def _smallest(M, m):
    """The ``m`` smallest entries of every row of ``M`` (any order within a row).

    A transposed view is partitioned in strips of 64 of its rows copied contiguous:
    partitioning along the strided axis directly is several times slower.
    """
    if M.flags.c_contiguous:
        return np.partition(M, m - 1, axis=1)[:, :m]
    out = np.empty((M.shape[0], m), dtype=M.dtype)
    for s in range(0, M.shape[0], 64):
        out[s : s + 64] = np.partition(np.ascontiguousarray(M[s : s + 64]), m - 1, axis=1)[:, :m]
    return out


def _pairs_where(mask_of, H, columns):
    """``(rows, cols)`` of the side's pairs where ``mask_of(H)`` holds; for the column
    side (``columns``) the mask is taken on ``H`` itself, in its memory order."""
    if not columns:
        return np.nonzero(mask_of(H))
    q, r = np.nonzero(mask_of(H))
    return r, q


# Rows of a block side filtered at once in :func:`_knn_side`: (strip, block) temporaries.
_SIDE_STRIP = 256


def _knn_side(H, nrm, other_nrm, b: _Blocks, m, columns=False):
    """Upper ends and candidates of the rows of ``H`` (of its columns when ``columns``).

    Each pair is bounded by its own norms, ``e_ij <= a_i + b_j``
    (:func:`refgeo._filter.error_terms`; 16.0 million of 16.8 million pairs were refined
    at 4096 x 256 with the block's largest norm).  The keys ``H_ij - b_j`` are formed in
    the filter dtype, with ``b_j`` rounded up into it, and the ``m`` smallest of each
    row get their upper ends ``H_ij + e_ij + 2**-50 |H_ij|`` in float64; ``hi`` holds
    them, ``t_i`` is their largest, and :func:`refgeo._filter.pairs_within` returns the
    pairs whose lower end is at most ``t_i``.
    """
    Hr = H.T if columns else H
    n_rows = Hr.shape[0]
    a, bj, b_up, slack = error_terms(b.c, b.eabs, nrm, other_nrm, H.dtype)
    hi = np.empty((n_rows, m))
    rows, cols, ends = [], [], []
    for s in range(0, n_rows, _SIDE_STRIP):
        K = np.array(Hr[s : s + _SIDE_STRIP], order="C")  # a contiguous strip of the keys
        K -= b_up
        part = np.argpartition(K, m - 1, axis=1)[:, :m]
        r0 = np.arange(s, s + K.shape[0])[:, None]
        h = Hr[r0, part].astype(np.float64)
        # finite: an excluded self pair (inf) is never among the m smallest keys
        ends_hi = h + ((a[r0] + bj[part]) + np.abs(h) * 2.0**-50)
        hi[s : s + K.shape[0]] = ends_hi
        r, q, lo = pairs_within(Hr[s : s + _SIDE_STRIP], K, a[s : s + K.shape[0]], bj, slack,
                                    ends_hi.max(axis=1))
        rows.append(r + s)
        cols.append(q)
        ends.append(lo)
    return hi, _Candidates(np.concatenate(rows).astype(np.int64), np.concatenate(cols).astype(np.int64),
                           np.concatenate(ends), b.bound)


def _knn_filter_task(SA, SB, mu, k, exclude_self, both):
    """Filter one block pair for k-NN: ``(hi_A, candidates_A, hi_B, candidates_B)``.

    The ``hi`` of all block pairs of a row merge into its k-th smallest upper end T_i
    (:func:`_merge_ends`); a pair is among the k nearest of row i, or ties the k-th,
    only if its lower end is at most T_i, and every such pair is among the candidates
    of its block pair (T_i never exceeds the block pair's own k-th smallest upper end).
    """
    same = SB is None
    b = _prepare(SA, SB, mu)
    H = b.H
    na, nb = H.shape
    if same and exclude_self:
        np.fill_diagonal(H, math.inf)
    ma = min(k, nb - int(same and exclude_self))
    if ma < 1:
        return None, None, None, None
    hi_a, cand_a = _knn_side(H, b.nA, b.nB, b, ma)
    if not both:
        return hi_a, cand_a, None, None
    hi_b, cand_b = _knn_side(H, b.nB, b.nA, b, min(k, na), columns=True)
    return hi_a, cand_a, hi_b, cand_b


def _merge_ends(parts, k):
    """The ``k`` smallest upper ends of every row among ``parts`` (None entries skipped)."""
    parts = [p for p in parts if p is not None]
    if not parts:  # a group of the tree with only empty block pairs (one-row blocks)
        return None
    v = np.concatenate(parts, axis=1)
    m = min(k, v.shape[1])
    return np.partition(v, m - 1, axis=1)[:, :m]


def _knn_refine_task(SA, SB, cand, ends, j0, k):
    """Refine the candidates whose lower end is within the row's k-th smallest upper end;
    the best (at most k) of each row, padded with ``inf``."""
    if cand is None:
        return None
    T = ends.max(axis=1)  # the k-th smallest upper end of each row, over all blocks
    keep = cand.end <= T[cand.rows]
    r, q = cand.rows[keep], cand.cols[keep]
    if r.shape[0] == 0:
        return None
    A64 = np.asarray(SA, dtype=np.float64)
    B64 = A64 if SB is None else np.asarray(SB, dtype=np.float64)
    vals = refine_pairs(A64, B64, r, q)
    n_rows = A64.shape[0]
    m = int(min(k, np.bincount(r, minlength=n_rows).max()))
    v, j, ok = first_per_row(vals, vals, r, q, n_rows, m)
    return _Rows(np.where(ok, v, math.inf), np.where(ok, j + j0, _NO_INDEX), cand.bound, int(vals.shape[0]))


def _merge_knn(records, k):
    recs = [r for r in records if r is not None]
    if not recs:
        return None
    v = np.concatenate([r.values for r in recs], axis=1)
    j = np.concatenate([r.index for r in recs], axis=1)
    order = np.lexsort((j, v), axis=1)[:, :k]  # by value, then the smaller index
    return _Rows(
        np.take_along_axis(v, order, axis=1), np.take_along_axis(j, order, axis=1),
        max(r.bound for r in recs), sum(r.n_refined for r in recs),
    )


# --------------------------------------------------------------------------- graphs


def _warn_small_blocks(blocks, cap, names):
    """Warn (``dask.array.PerformanceWarning``) when small row chunks make many more
    block-pair tasks than chunks of ``cap`` rows would.

    ``blocks`` is the ``(blocks, offsets)`` of one matrix (pairs within it) or of two
    (pairs across), ``names`` the names of their arguments.  Each task costs the
    scheduler about a millisecond and a worker a few; with 512-row chunks a million rows
    make 1.9 million tasks, with 2048-row chunks 120,000.  The warning names the
    matrices whose chunks are small (those that alone would at least halve the number of
    tasks if merged: for ``X`` against ``Y`` the small chunks may be either's) and the
    size of their largest chunk.  The result does not depend on the chunks, so the fix
    is the user's rechunk; it is not done here because merging chunks moves data between
    workers and the chunks may be what the user laid out on purpose.
    """
    sizes = [len(b) for b, _ in blocks]
    merged = [-(-o[-1] // cap) for _, o in blocks]
    if len(blocks) == 1:
        now, then = sizes[0] * (sizes[0] + 1) // 2, merged[0] * (merged[0] + 1) // 2
    else:
        now, then = sizes[0] * sizes[1], merged[0] * merged[1]
    if now <= SMALL_BLOCK_TASKS or now < 4 * then:
        return
    from dask.array.core import PerformanceWarning

    # now >= 4 then: the ratio sizes / merged of one of at most two matrices is >= 2
    small = [t for t in range(len(blocks)) if sizes[t] >= 2 * merged[t]]
    largest = max(int(max(np.diff(blocks[t][1]))) for t in small)
    rechunk = " and ".join(f"{names[t]}.rechunk({{0: {cap}, 1: -1}})" for t in small)
    warnings.warn(
        f"the row chunks of {' and '.join(names[t] for t in small)} (at most {largest} rows each) make "
        f"{now:,} block-pair tasks; chunks of {cap} rows would make {then:,}. Rechunk the rows before "
        f"the call, e.g. {rechunk} (the result does not depend on the chunks).",
        PerformanceWarning,
        stacklevel=outside_stacklevel(),
    )


def _blocks_and_mean(arrays, tile_size, host=True, names=("S",)):
    """``([(blocks, offsets) per array], mean)``: the task blocks of each array
    (:func:`_task_blocks`, at most ``tile_size`` or :data:`MAX_BLOCK_ROWS` rows) and the
    mean of their rows together, warning where the chunks are needlessly small
    (:func:`_warn_small_blocks`; ``names``: the arguments' names)."""
    blocks = [_task_blocks(a, tile_size, host) for a in arrays]
    _warn_small_blocks(blocks, max(1, tile_size or MAX_BLOCK_ROWS), names)
    return blocks, _mean(arrays)


def _host_blocks_and_mean(S, tile_size, host):
    """:func:`_blocks_and_mean` of one matrix; with ``host`` (an engine that runs on the
    host) the mean of CuPy chunks is copied to the host as well as the blocks."""
    import dask

    ((blocks, offsets),), mu = _blocks_and_mean([S], tile_size, host=host)
    if host and _chunks_on_gpu(S):
        mu = dask.delayed(_host, pure=True)(mu)
    return ((blocks, offsets),), mu


def _pair_engine(engine, *arrays) -> str:
    """The engine of the extreme-pair and farthest-partner tasks: ``engine``, or for
    None ``"array"`` for CuPy chunks, else ``"compiled"`` where ``refgeo_ext`` is
    importable, else ``"numpy"``."""
    if engine is None:
        if _chunks_on_gpu(*arrays):
            return "array"
        return "compiled" if _backend_ext() is not None else "numpy"
    if engine not in ("compiled", "numpy", "array"):
        raise ValueError(f"engine must be 'compiled', 'numpy', 'array' or None, got {engine!r} instead.")
    return engine


def _extreme(S, *, maximize, tile_size, engine=None) -> KernelRun:
    import dask

    engine = _pair_engine(engine, S)
    ((blocks, offsets),), mu = _host_blocks_and_mean(S, tile_size, engine != "array")
    fn = {"compiled": _pair_task_compiled, "numpy": _pair_task, "array": _pair_task_xp}[engine]
    task = dask.delayed(fn, pure=True)
    # the compiled tasks of the diameter start from a seed (_diameter_seed)
    seed = (_diameter_seed(blocks, offsets, mu),) if engine == "compiled" and maximize else ()
    parts = [
        task(blocks[a], None if a == b else blocks[b], offsets[a], offsets[b], mu, maximize, *seed)
        for a in range(len(blocks))
        for b in range(a, len(blocks))
    ]
    (rec,) = _compute(_tree(parts, _merge_pairs, maximize))
    return KernelRun(
        backend=_BACKEND, error_bound=rec.bound, n_refined=rec.n_refined,
        value=math.sqrt(rec.value), i=rec.i, j=rec.j,
    )


def diameter(S, *, tile_size=None, n_threads=None, engine=None) -> KernelRun:
    """Row diameter of a Dask array (``n_threads`` is the workers' business).

    ``engine``: ``"compiled"`` (``refgeo_ext._knn_blocks.block_pair_extreme*``),
    ``"numpy"`` or ``"array"`` (the array-API tasks, on the GPU for CuPy chunks); None
    picks ``"array"`` for CuPy chunks, else the compiled one when the extension is
    importable, else ``"numpy"``.  All three give the same answer.
    """
    return _extreme(_engine_rows(S, "S"), maximize=True, tile_size=tile_size, engine=engine)


def closest(S, *, tile_size=None, n_threads=None, engine=None) -> KernelRun:
    """Closest pair of a Dask array (``engine`` as for :func:`diameter`)."""
    return _extreme(_engine_rows(S, "S"), maximize=False, tile_size=tile_size, engine=engine)


def _per_row_blocks(tasks, nblocks, merge, *args):
    """Tree-merge the per-row records of each row block: ``tasks`` maps a block
    to its delayed records."""
    return [_tree(tasks[a], merge, *args) for a in range(nblocks)]


def _farthest_run(recs) -> KernelRun:
    """The farthest partners' result from the merged records of every row block."""
    return KernelRun(
        backend=_BACKEND, error_bound=max(r.bound for r in recs),
        n_refined=sum(r.n_refined for r in recs),
        indices=np.concatenate([r.index for r in recs]),
        distances=np.sqrt(np.concatenate([r.values for r in recs])),
    )


def farthest(S, *, tile_size=None, n_threads=None, engine=None) -> KernelRun:
    """Each row's farthest other row for a Dask array (``engine`` as for :func:`diameter`).

    The compiled and the array-API tasks run in one phase (:func:`_farthest_task_compiled`):
    a block-pair task refines every pair that can reach its row's farthest value within
    the block pair, and the per-row bests merge.  The NumPy tasks run in two phases
    (:func:`_farthest_numpy`).
    """
    S = _engine_rows(S, "S")
    engine = _pair_engine(engine, S)
    if engine == "numpy":
        return _farthest_numpy(S, tile_size=tile_size)
    return _farthest_fused(S, tile_size=tile_size, array_api=engine == "array")


def _farthest_numpy(S, *, tile_size=None) -> KernelRun:
    """:func:`farthest` on NumPy tasks: filter, per-row threshold, refinement."""
    import dask

    ((blocks, offsets),), mu = _host_blocks_and_mean(S, tile_size, True)
    nb = len(blocks)
    filt = dask.delayed(_farthest_filter_task, pure=True, nout=4)
    refine = dask.delayed(_farthest_refine_task, pure=True)
    # phase 1: filter every block pair; each row's lower ends merge per row block
    lows: list[list] = [[] for _ in range(nb)]
    pairs = []
    for a in range(nb):
        for b in range(a, nb):
            low_a, ca, low_b, cb = filt(blocks[a], None if a == b else blocks[b], mu)
            lows[a].append(low_a)
            pairs.append((a, None if a == b else blocks[b], ca, offsets[b]))
            if a != b:
                lows[b].append(low_b)
                pairs.append((b, blocks[a], cb, offsets[a]))
    L = [_tree(lows[a], _merge_lows) for a in range(nb)]
    # phase 2: refine the survivors where both rows are, merge per row block
    parts: list[list] = [[] for _ in range(nb)]
    for a, other, cand, off in pairs:
        parts[a].append(refine(blocks[a], other, cand, L[a], off))
    return _farthest_run(_compute(*_per_row_blocks(parts, nb, _merge_farthest)))


# --------------------------------------------------------------------------- compiled k-NN tasks

# Rows per GEMM tile inside a task (the compiled engine's default tile).
_TASK_TILE = 256
# ... and for the k-NN filter of two distinct blocks: larger tiles pack less per flop
# (4096-row blocks, float32, d = 768: 258 ms a task against 276 ms with 256-row tiles).
_KNN_TASK_TILE = 1024


# Per-row records merged per k-NN reduction task: a row block's records (b k entries of
# 16 bytes per block pair, 2 MiB at b = 4096, k = 32) are small next to its blocks, so
# one task merges those of up to 32 block pairs, in one level for up to 32 row blocks
# (fewer tasks: the scheduler's and the workers' time per task is a few percent here).
_KNN_FAN_IN = 32


def _heap_size(k, n_cand):
    """Heap entries kept per row and block pair: ``k`` plus the engine's slack."""
    return min(n_cand, k + max(8, k // 2))


def _pair_task_compiled(SA, SB, i0, j0, mu, maximize, seed=None):
    """:func:`_pair_task` on the compiled engine (``block_pair_extreme``): the GEMM tiles
    of the two blocks with the refinement fused into the tile loop, as on one machine.
    float64 rows are filtered in float32 in the maximum mode (the band within the
    float32 bound of the largest distance is thin).

    ``seed`` (maximum mode, or None): a lower bound on the diameter's squared value
    (:func:`_diameter_seed`); the task refines only the pairs that can reach it, and
    skips the tile pairs whose norms cannot, as the engine does with its seed.  In the
    minimum mode a float32 filter gives up past ``max(MIN_MIXED_BUDGET, pairs /
    MIN_MIXED_BUDGET_DIVISOR)`` refinements (:mod:`refgeo._engine`) and the task runs
    again through a float64 filter: near-copies within the float32 bound of each
    other put every pair of their blocks in the band (half of 20,000 float32 rows
    within 1e-5 of one point: all 5e7 pairs of the cluster were refined)."""
    same = SB is None
    if same and SA.shape[0] < 2:
        return None
    n_pairs = SA.shape[0] * (SA.shape[0] - 1) // 2 if same else SA.shape[0] * SB.shape[0]

    def call(fn, parts, cp, eabs):
        A, B, XA, XB, nA, nB, dt, _ = parts
        budget = 0
        if not maximize and dt == "float32":
            budget = max(_engine.MIN_MIXED_BUDGET, n_pairs // _engine.MIN_MIXED_BUDGET_DIVISOR)
        return fn(XA, nA, A, XB, nB, B, same, maximize, cp, eabs, _TASK_TILE,
                  math.nan if seed is None else seed, budget)

    (v, i, j, n, _), parts, n_before = _block_kernel_runs(SA, SB, mu, "block_pair_extreme", maximize, call)
    if i < 0:
        return None
    return _Pair(float(v), i0 + int(i), j0 + int(j), reported_bound(SA.shape[1], parts[6], parts[7]),
                 int(n) + n_before)


def _block_kernel_runs(SA, SB, mu, kernel, float32_filter, call):
    """Run the compiled block kernel ``kernel`` (a name of ``refgeo_ext._knn_blocks``
    without its dtype suffix) on the centered pair of ``SA`` and ``SB`` (None: ``SA``
    against itself), through a float32 filter where :func:`_centered_pair` gives one,
    again through a float64 filter if that gives up.

    ``call(fn, parts, cp, eabs)`` calls the kernel ``fn`` on ``parts`` (the tuple of
    :func:`_centered_pair`) with the rounding bound ``cp``, ``eabs`` of its filter
    dtype, under one BLAS thread, and returns the kernel's tuple, whose last two
    entries are the refined pairs and whether the float32 filter gave up.  Returns
    ``(that tuple, parts, pairs refined by the run that gave up)``.  float64 copies of
    float32 rows refine to the same bits, so the float64 run answers the same pairs."""
    same = SB is None
    d = SA.shape[1]
    parts = _centered_pair(SA, SB, mu, float32_filter=float32_filter)
    n_before = 0
    while True:
        A, dt = parts[0], parts[6]
        cp, eabs = rounding_bound(d, dt)
        name = ("32" if A.dtype == np.float32 else "32s64") if dt == "float32" else "64"
        fn = getattr(_task_ext()._knn_blocks, kernel + name)
        with blas_single_thread():
            out = call(fn, parts, cp, eabs)
        if not out[-1] or dt != "float32":
            return out, parts, n_before
        n_before += int(out[-2])
        parts = _centered_pair(np.asarray(SA, dtype=np.float64),
                               None if same else np.asarray(SB, dtype=np.float64), mu)


# Sweeps of the diameter's seed search over the blocks (farthest point from the row
# farthest from the mean, then from that one, ...), each O(V d).
SEED_SWEEPS = 2


def _far_row_task(S, i0, mu, ref):
    """The row of block ``S`` (its first at ``i0``) farthest from the row ``ref[2]``, or
    for ``ref`` None from the mean ``mu``: ``(squared distance, index, row)``, float64
    (any pair is a valid seed: the distances only pick the candidates)."""
    S64 = np.asarray(S, dtype=np.float64)
    D = S64 - (mu if ref is None else ref[2])
    with np.errstate(over="ignore", invalid="ignore"):
        dist = np.einsum("ij,ij->i", D, D)
    a = int(np.argmax(dist))
    return float(dist[a]), i0 + a, S64[a].copy()


def _merge_far(records):
    """The record of the largest distance (the smallest index among equal ones)."""
    return max(records, key=lambda r: (r[0], -r[1]))


def _seed_value(*ends):
    """A lower bound on the squared diameter from the rows found by the sweeps: the
    largest refined squared distance of two consecutive ones, lowered
    (:func:`_refined_low`)."""
    best = 0.0
    for a, b in zip(ends[:-1], ends[1:]):
        best = max(best, float(_refined_low(a[2][None, :], b[2][None, :])[0]))
    return best


def _refined_low(S64, row):
    """The refined squared distances of the rows of ``S64`` to ``row`` (one row), lowered
    by 2^-40 of themselves: lower bounds compared with refined values of the same pairs,
    which the tasks must still refine (equal values tie).  Rows beyond the prescaled
    range (a direct call) may overflow: such a distance gives 0, no bound, and the
    task's own range check names the problem."""
    n = S64.shape[0]
    with np.errstate(over="ignore", invalid="ignore"):
        r = refine_pairs(S64, row, np.arange(n, dtype=np.int64), np.zeros(n, np.int64))
    return np.where(np.isfinite(r), r * (1.0 - 2.0**-40), 0.0)


def _seed_rows(blocks, offsets, mu):
    """The delayed records ``(squared distance, index, row)`` of the rows the seed
    sweeps find: the row farthest from the mean, then :data:`SEED_SWEEPS` times the
    row farthest from the last one (one task per block and sweep, each O(b d))."""
    import dask

    far = dask.delayed(_far_row_task, pure=True)
    ends = [None]
    for _ in range(SEED_SWEEPS + 1):
        ends.append(_tree([far(b, o, mu, ends[-1]) for b, o in zip(blocks, offsets)], _merge_far))
    return ends[1:]


def _diameter_seed(blocks, offsets, mu):
    """A delayed lower bound on the squared row diameter (:func:`_seed_value`) from the
    rows of :func:`_seed_rows`, as the engine seeds its search
    (:func:`refgeo._engine._diameter_seed`).  Without it each task began at -1 and
    refined every pair that could reach its own running best: half of 20,000 float32
    rows within 1e-5 of one point refined the 5e7 pairs of the cluster (2 s against
    0.16 s on one machine), and the mostly tiny rows of an LM head's gradient did GEMMs
    that a seed rules out by the norms alone."""
    import dask

    return dask.delayed(_seed_value, pure=True)(*_seed_rows(blocks, offsets, mu))


def _row_lows_task(S, *ends):
    """Lower bounds on the farthest value of each row of block ``S``: its largest
    refined squared distance to the rows of the seed sweeps (:func:`_seed_rows`),
    lowered (:func:`_refined_low`; a row of the sweeps is its own partner at 0: any
    partner is at least that far)."""
    S64 = np.ascontiguousarray(S, dtype=np.float64)
    low = np.zeros(S64.shape[0])
    for e in ends:
        np.maximum(low, _refined_low(S64, e[2][None, :]), out=low)
    return low


def _centered_pair(SA, SB, mu, float32_filter=False):
    """Originals, centered copies, float64 norms and the filter dtype of a block pair.

    As the compiled engine centers (``refgeo_ext._common.center*``, one thread): the
    originals share one dtype (float64 if either block is), float32 rows are filtered in
    float32 unless ``d`` is too large for a useful float32 bound or their norms leave
    the range where the float32 GEMM neither overflows nor underflows.
    """
    ext = _task_ext()
    blocks = [SA] if SB is None else [SA, SB]
    d = SA.shape[1]
    f32_ok = math.isfinite(rounding_bound(d, "float32")[0])
    odt = np.float32 if f32_ok and all(b.dtype == np.float32 for b in blocks) else np.float64
    origs = [np.ascontiguousarray(b, dtype=odt) for b in blocks]
    # the filter dtype: float32 for float32 rows, and for float64 rows when asked
    dt = np.float32 if odt == np.float32 or (float32_filter and f32_ok) else np.float64
    for _ in range(2):
        cents = []
        for o in origs:
            X = np.empty(o.shape, dtype=dt)
            nrm = np.empty(o.shape[0])
            suffix = "64" if dt == np.float64 else ("32" if o.dtype == np.float32 else "32s64")
            getattr(ext._common, "center" + suffix)(o, mu, X, nrm, 1)
            cents.append((X, nrm))
        top = max(float(n.max()) for _, n in cents)
        if dt == np.float64 or (top <= MAX_NORM2["float32"] and not 0.0 < top < MIN_NORM2_FLOAT32):
            break
        dt = np.float64
        origs = [np.ascontiguousarray(o, dtype=np.float64) for o in origs]
    if not (math.isfinite(top) and top <= MAX_NORM2["float64"]):
        raise ValueError(
            f"centered squared row norms up to {top:.3g} exceed the float64 GEMM range "
            f"({MAX_NORM2['float64']:.0e}); scale the rows by a power of two first."
        )
    name = "float32" if dt == np.float32 else "float64"
    if SB is None:
        origs, cents = origs * 2, cents * 2
    return origs[0], origs[1], cents[0][0], cents[1][0], cents[0][1], cents[1][1], name, top


# Centered copies of the row blocks a worker process holds, for its k-NN filter tasks:
# id(block) -> (weak reference to the block, to the mean, filter dtype, copy, norms,
# top norm).  A block takes part in one filter task per other block, so without the
# memo each task would center both of its blocks again (13 ms of a 250 ms task at
# 4096 x 768).  An entry is valid while the weak references still point to the very
# objects the task received (an id is not reused while its object lives).  An entry
# goes when its block or mean is collected (a finalizer: the mean is the call's, so
# the copies go when the call ends; purged only at the next insertion, they held a
# copy of the whole input after the call, up to 16 blocks), and at most _CENTERED_MAX
# entries are kept (the oldest go first).
_CENTERED: dict = {}
_CENTERED_LOCK = threading.Lock()
_CENTERED_MAX = 16


def _drop_centered(key) -> None:
    # run when a block or mean dies, in whatever thread drops it, possibly inside the
    # lock's holder (a garbage collection): no lock, dict.pop is atomic.  The entry's
    # other finalizer is detached: a block that lives on (persisted) would keep one
    # per call otherwise
    ent = _CENTERED.pop(key, None)
    for f in ent[5] if ent is not None else ():
        f.detach()


def _centered_block(S, mu, odt, dt):
    """``(centered copy in dt, float64 norms, largest norm)`` of block ``S`` (its rows
    in ``odt``), centered as :func:`_centered_pair` centers, memoized per process."""
    key = (id(S), id(mu), np.dtype(odt).char, np.dtype(dt).char)
    with _CENTERED_LOCK:
        ent = _CENTERED.get(key)
    if ent is not None and ent[0]() is S and ent[1]() is mu:
        return ent[2], ent[3], ent[4]
    o = np.ascontiguousarray(S, dtype=odt)
    X = np.empty(o.shape, dtype=dt)
    nrm = np.empty(o.shape[0])
    suffix = "64" if dt == np.float64 else ("32" if o.dtype == np.float32 else "32s64")
    getattr(_task_ext()._common, "center" + suffix)(o, mu, X, nrm, 1)
    top = float(nrm.max()) if nrm.shape[0] else 0.0
    try:
        refs = (weakref.ref(S), weakref.ref(mu))
    except TypeError:  # not weakly referenceable: no memo
        return X, nrm, top
    fins = tuple(weakref.finalize(o, _drop_centered, key) for o in (S, mu))
    with _CENTERED_LOCK:
        # evicted from a snapshot (list() of a dict is atomic): a finalizer may pop an
        # entry in another thread meanwhile, which iterating the dict itself would see
        for q in list(_CENTERED)[: max(0, len(_CENTERED) - _CENTERED_MAX + 1)] + [key]:
            old = _CENTERED.pop(q, None)
            for f in old[5] if old is not None else ():
                f.detach()  # its block may live on: no finalizer left behind
        _CENTERED[key] = (*refs, X, nrm, top, fins)
    return X, nrm, top


def _knn_centered_pair(SA, SB, mu):
    """:func:`_centered_pair` for the k-NN filter tasks (float32 filter for float32
    rows, the same dtype rules), from the per-process memo of centered blocks:
    ``(XA, XB, nA, nB, filter dtype name, top)``."""
    blocks = [SA] if SB is None else [SA, SB]
    f32_ok = math.isfinite(rounding_bound(SA.shape[1], "float32")[0])
    dt = np.float32 if f32_ok and all(b.dtype == np.float32 for b in blocks) else np.float64
    for _ in range(2):
        cents = [_centered_block(b, mu, dt, dt) for b in blocks]
        top = max(c[2] for c in cents)
        if dt == np.float64 or (top <= MAX_NORM2["float32"] and not 0.0 < top < MIN_NORM2_FLOAT32):
            break
        dt = np.float64
    if not (math.isfinite(top) and top <= MAX_NORM2["float64"]):
        raise ValueError(
            f"centered squared row norms up to {top:.3g} exceed the float64 GEMM range "
            f"({MAX_NORM2['float64']:.0e}); scale the rows by a power of two first."
        )
    if SB is None:
        cents = cents * 2
    return cents[0][0], cents[1][0], cents[0][1], cents[1][1], "float32" if dt == np.float32 else "float64", top


class _HeapCandidates(NamedTuple):
    """The heap of every row of one side of a block pair, as certified ends."""

    lo: Any  # (rows, K) float64 lower ends of the kept pairs (+inf: empty slot)
    ids: Any  # (rows, K) int32 local rows of the other block (-1: empty slot)
    out: Any  # (rows,) float64 lower end of every pair the heap dropped (+inf: none)
    bound: float


class _Seeds(NamedTuple):
    """Pruning thresholds of a row block's heaps in one key space (see :func:`_knn_keys_task`)."""

    dtype: str  # the filter dtype of the keys ("float32" or "float64")
    keys: Any  # (rows,) float64: the K-th smallest key of the row in one block (+inf: none)


def _full_heap(k):
    """Heap entries of a row against a block of many candidates (:func:`_heap_size`)."""
    return k + max(8, k // 2)


def _seed_keys(seeds, dt):
    """The rows' thresholds of ``seeds`` if they are in the key space of filter dtype
    ``dt``, else None (keys of another dtype are refused)."""
    if seeds is None or seeds.dtype != dt or not np.isfinite(seeds.keys).any():
        return None
    return seeds.keys


def _heap_tops(keys, ids, k, dt):
    """The seeds an unseeded task's heaps give (:class:`_Seeds`): the K-th smallest key
    of each row whose heap is full at the full size ``K = k + slack``, else +inf."""
    if keys.shape[1] != _full_heap(k):
        return None
    return _Seeds(dt, np.where((ids >= 0).all(axis=1), keys.max(axis=1), math.inf))


def _key_ends(keys, ids, nI, nJ, n_cand, k, cl, eabs, bound, seeded=None):
    """Upper ends (the ``k`` smallest) and candidates of one side, from its heaps.

    The keys are taken on lowered norms, ``m_j - 2 G_ij`` with ``m_j = (1 - c') n_j``
    and ``c' = cl`` (:func:`refgeo._certify.lowered_key_bound`), as in the compiled
    engine (``refgeo_ext/_knn.pyx.tp``): the upper end of a pair is
    ``key + (1 + c') n_i + 2 c' n_j + eabs``, its lower end ``key + (1 - c') n_i - eabs``,
    and for a heap that may have dropped pairs (a full heap, or a seeded one:
    ``seeded[i]`` true when row i's heap started from finite sentinel keys),
    ``max key + (1 - c') n_i - eabs`` bounds the lower end of every dropped pair, whatever
    its norm.  (With keys ``n_j - 2 G_ij`` that bound needed the largest norm of the
    block, and LM-gradient rows, whose norms span nine decades, refined every pair.)
    The maximum runs over the sentinels left in the heap too: a key is dropped only
    when it is not below the heap's top at that time, and the top never increases, so
    every dropped key is at least the final top, the largest key the heap holds.
    """
    K = keys.shape[1]
    empty = ids < 0
    base = nI * (1.0 - cl)
    # up = (key + (1 + c') n_i) + 2 c' n_j + eabs, lo = (key + (1 - c') n_i) - eabs, in
    # place (a task's heaps are a few MB: every temporary is a pass over memory)
    up = nJ[np.where(empty, 0, ids)]
    up *= 2.0 * cl
    up += keys
    up += (nI * (1.0 + cl))[:, None]
    up += eabs
    up[empty] = math.inf
    lo = keys + base[:, None]
    lo -= eabs
    lo[empty] = math.inf
    m = min(k, K)
    ends = up if m == K else np.partition(up, m - 1, axis=1)[:, :m]
    if K < n_cand or seeded is not None:
        out = (keys.max(axis=1) + base) - eabs
        if K >= n_cand:  # room for every candidate: only a seeded row may drop pairs
            out = np.where(seeded, out, math.inf)
    else:
        out = np.full(keys.shape[0], math.inf)
    return ends, _HeapCandidates(lo, ids.astype(np.int32), out, bound)


def _heaps(rows, K, seed):
    """Empty heaps ``(keys, ids)`` of ``rows`` rows: every entry (+inf, -1), or with
    ``seed`` (float64, one per row) K sentinel entries (seed_i, -1) in row i."""
    keys = np.full((rows, K), math.inf) if seed is None else np.repeat(seed[:, None], K, axis=1)
    return keys, np.full((rows, K), -1, dtype=np.int64)


def _knn_keys_task(SA, SB, mu, k, exclude_self, both, seeds_a=None, seeds_b=None):
    """Filter one block pair on the compiled engine:
    ``(ends_A, ends_B, (cand_A, cand_B), seeds_A)`` (the candidates of both sides go to
    one refinement task: one output, so one fewer task in the graph).

    ``ends`` are each row's ``k`` smallest upper ends over this block pair; they merge
    into the row's k-th smallest over all blocks, T_i (:func:`_merge_ends`).  A pair can
    be among the k nearest of row i, or tie the k-th, only if its lower end is at most
    T_i; such a pair is either in the row's heap (``cand.lo``) or, when the heap's
    dropped pairs reach T_i (``cand.out <= T_i``), the row is filtered again against
    the whole block and the pairs that can reach T_i are refined
    (:func:`_whole_block_pairs`), as the engine redoes a row its heap cannot certify.

    Seeds.  ``seeds_A`` (:class:`_Seeds`, from an unseeded task) is the K-th smallest
    key of each of A's rows in this block pair.  Passed to the other block pairs of the
    same rows (``seeds_a``, ``seeds_b`` for B's rows), it starts each heap at K
    sentinel entries of that key instead of +inf: the heap then takes only keys below
    the row's threshold, about K of them per block instead of ``K ln(b / K)`` for a
    heap that starts empty (the shared threshold of the engine's thread heaps, across
    tasks).  Any seed gives the exact answer: the dropped pairs' bound ``cand.out``
    comes from the heap's final top, sentinels included, so a seed that is too low
    only sends rows to the whole-block refinement; the K-th key of another block lies
    above the row's k-th upper end by the heap's slack, so almost no row goes there.
    A row whose heap here may have dropped a pair within its k-th upper end (ties
    beyond the heap) gives no seed.
    Seeds of another filter dtype (a block pair whose norms need the float64 GEMM)
    are ignored.
    """
    ext = _task_ext()
    same = SB is None
    XA, XB, nA, nB, dt, top = _knn_centered_pair(SA, SB, mu)
    na, nb = XA.shape[0], XB.shape[0]
    cand_a = nb - int(same and exclude_self)
    if cand_a < 1:
        return None, None, (None, None), None
    d = XA.shape[1]
    cp, eabs = rounding_bound(d, dt)
    cl = lowered_key_bound(cp)
    bound = reported_bound(d, dt, top)
    # the keys' lowered norms (_key_ends); the ends use the norms themselves
    mA, mB = nA * (1.0 - cl), nB * (1.0 - cl)
    two = both and not same
    sa = _seed_keys(seeds_a, dt)
    sb = _seed_keys(seeds_b, dt) if two else None
    KA = _heap_size(k, cand_a)
    KB = _heap_size(k, na) if two else 0
    suffix = "32" if dt == "float32" else "64"
    # one BLAS thread per task whatever the worker's environment: Dask runs the tasks
    # in parallel, and a threaded BLAS under tile-sized GEMMs on busy cores spins
    with blas_single_thread():
        if two and KA == KB:
            # two distinct blocks with heaps of one size: the engine's vectorized
            # epilogue, on record heaps (A's rows, then B's)
            keys_a, ids_a, keys_b, ids_b = _records_pair(ext, suffix, XA, mA, XB, mB, KA, sa, sb)
        else:
            keys_a, ids_a = _heaps(na, KA, sa)
            keys_b, ids_b = _heaps(nb if two else 0, KB, sb)
            fn = getattr(ext._knn_blocks, "block_pair_keys" + suffix)
            fn(XA, mA, XB, mB, same, exclude_self, two, _TASK_TILE, keys_a, ids_a, keys_b, ids_b)
    ends_a, c_a = _key_ends(keys_a, ids_a, nA, nB, cand_a, k, cl, eabs, bound,
                            None if sa is None else np.isfinite(sa))
    tops = _heap_tops(keys_a, ids_a, k, dt) if sa is None else None
    if tops is not None:
        # a row whose heap may have dropped a pair within its k-th upper end here has
        # its K-th key inside a band of ties (clusters of near-copies): a heap seeded
        # with it would keep no pair of another block and report that it may have
        # dropped some within the row's threshold, sending the row to the whole-block
        # refinement in every block pair.  Such rows start their other heaps empty.
        tops = tops._replace(keys=np.where(c_a.out <= ends_a.max(axis=1), math.inf, tops.keys))
    if not two:
        return ends_a, None, (c_a, None), tops
    ends_b, c_b = _key_ends(keys_b, ids_b, nB, nA, na, k, cl, eabs, bound,
                            None if sb is None else np.isfinite(sb))
    return ends_a, ends_b, (c_a, c_b), tops


def _records_pair(ext, suffix, XA, nA, XB, nB, K, seed_a=None, seed_b=None):
    """The heaps of ``block_pair_keys`` with ``both`` for two distinct blocks, through
    ``block_pair_records`` (``K`` records per row of A and of B), as key and id arrays;
    ``seed_a``, ``seed_b``: the rows' sentinel keys as in :func:`_heaps` (None: +inf)."""
    na = XA.shape[0]
    rec = np.empty((na + XB.shape[0], 2 * K))
    rec[:na, 0::2] = math.inf if seed_a is None else seed_a[:, None]
    rec[na:, 0::2] = math.inf if seed_b is None else seed_b[:, None]
    ids = rec.view(np.int64)[:, 1::2]
    ids[...] = -1
    getattr(ext._knn_blocks, "block_pair_records" + suffix)(XA, XB, np.concatenate([nA, nB]), _KNN_TASK_TILE, rec)
    ids_a = ids[:na]
    ids_a[ids_a >= 0] -= na  # A's records name B's rows from na on
    # strided views of the records: the callers only read them
    return rec[:na, 0::2], ids_a, rec[na:, 0::2], ids[na:]


# Elements per strip of the rows that their heaps could not certify, against the whole
# block: the filter values of :func:`_whole_block_pairs_xp`.
_WHOLE_STRIP_ELEMENTS = 1 << 20


def _whole_block_pairs(P, Q, rows, T, skip_self, k):
    """``(r, q, n)``: the pairs of ``rows`` of ``P`` with rows of ``Q`` that the task
    must refine, where the row's heap dropped candidates; ``n`` counts the pairs the
    single-machine engine refined on the way (see below).

    Why: refining every pair of such a row with the block (its heap overflowed with
    ties, as in clusters of near-copies within the filter's bound of each other) cost
    O(d) per pair outside the GEMM, 70 times the single-machine time.  The rows go to
    the single-machine engine's k-NN on one thread (:func:`refgeo._engine.knn`, ``k +
    1`` with the row itself left out), with ``T`` as their thresholds: it skips its
    first pass and filters the rows again against the block's rows within reach of
    ``T`` only (its threshold pass, :func:`refgeo._engine._settle`: near-copies
    grouped around anchors, each group against the rows within reach of its anchor;
    a GEMM whose epilogue keeps the pairs that can reach ``T``), refines those pairs,
    and sends the rows with too many of them (near-copies that float32 cannot tell
    apart) through its float64 filter.  Each row gets the block's ``k`` best within
    ``T`` (the pairs beyond ``T`` cannot be among the row's ``k`` nearest), which is
    all the merge keeps; they are refined again here.  (Before, the rows were filtered
    again against the whole block in strips, and the rows with too many pairs passed
    the engine's first pass as well: hidden states with Zipf token counts, 20,000 x 256,
    4 chunks, k = 16, spent half of the call there.)  Time O(r c d) of GEMM for ``r``
    rows against the ``c`` rows of the block within their reach (the whole block, ``b``
    rows, at most), memory O((r + b) d) for the engine's centered copies (and float64
    copies of float32 rows) and its pair slots.
    """
    kk = min(k + int(skip_self), Q.shape[0])
    run = _engine.knn(np.ascontiguousarray(P[rows]), kk, Q, exclude_self=False, n_threads=1,
                      thresholds=np.ascontiguousarray(T[rows], dtype=np.float64))
    keep = run.indices >= 0  # a row with fewer than kk pairs within T: padded with -1
    if skip_self:
        keep &= run.indices != rows[:, None]
    return np.repeat(rows, keep.sum(axis=1)), run.indices[keep].astype(np.int64), run.n_refined


def _refine_side(P, Q, cand, ends, q0, k, skip_self, refine, whole_pairs):
    """Refine the pairs of one side that survive the rows' thresholds; each row's best
    (at most k, sorted by value then index), padded with ``inf``.  ``refine(P, Q, r, q)``
    returns the refined values as a NumPy array.  A row whose heap may have dropped a
    candidate is refined against the pairs ``whole_pairs(P, Q, rows, T, skip_self, k)``
    returns (with the number of pairs refined to find them): the block's ``k`` best
    within its threshold (:func:`_whole_block_pairs`), or those of the whole block that
    can reach it (:func:`_whole_block_pairs_xp`)."""
    if cand is None:
        return None
    T = ends.max(axis=1)  # the k-th smallest upper end of each row, over all blocks
    whole = cand.out <= T  # the heap may have dropped a candidate: the whole block
    keep = cand.lo <= T[:, None]
    keep[whole] = False
    r, c = np.nonzero(keep)
    q = cand.ids[r, c].astype(np.int64)
    r = r.astype(np.int64)
    n_found = 0
    if whole.any():
        rr, qq, n_found = whole_pairs(P, Q, np.flatnonzero(whole), T, skip_self, k)
        r, q = np.concatenate([r, rr]), np.concatenate([q, qq])
    if r.shape[0] == 0:
        return None
    vals = refine(P, Q, r, q)
    n_rows = P.shape[0]
    m = int(min(k, np.bincount(r, minlength=n_rows).max()))
    v, j, ok = first_per_row(vals, vals, r, q, n_rows, m)
    return _Rows(np.where(ok, v, math.inf), np.where(ok, j + q0, _NO_INDEX), cand.bound,
                 int(vals.shape[0]) + int(n_found))


def _knn_refine_pair_task(SA, SB, cands, ends_a, ends_b, i0, j0, k, exclude_self, mu):
    """Refine both sides of one block pair in float64 from the original rows it holds
    (``cands``: the filter task's candidates of both sides; ``mu``, the filter tasks'
    mean, is the array-API task's, :func:`_knn_refine_pair_task_xp`: the engine
    centers the rows its heaps could not certify itself)."""
    cand_a, cand_b = cands
    same = SB is None
    blocks = [SA] if same else [SA, SB]
    dt = np.float64 if any(b.dtype == np.float64 for b in blocks) else np.float32
    A = np.ascontiguousarray(SA, dtype=dt)
    B = A if same else np.ascontiguousarray(SB, dtype=dt)
    refine, whole = _engine._refined_pairs, _whole_block_pairs
    rec_a = _refine_side(A, B, cand_a, ends_a, j0, k, same and exclude_self, refine, whole)
    rec_b = None if same else _refine_side(B, A, cand_b, ends_b, i0, k, False, refine, whole)
    return rec_a, rec_b


def _backend_ext():
    return _backend._ext


def _task_ext():
    """``refgeo_ext`` in a compiled-engine task, or an ``ImportError`` that says why.

    The engine is chosen in the calling process (where the extension is importable),
    and the graph runs its kernels on the workers: a worker whose refgeo lacks them
    failed with ``AttributeError: 'NoneType' object has no attribute '_common'``."""
    ext = _backend._ext
    if ext is None:
        import socket

        raise ImportError(
            f"refgeo_ext (the compiled extension) is not importable on the Dask worker at "
            f"{socket.gethostname()} ({_backend._ext_error or 'not installed'}), and the client, which "
            f"has it, chose the compiled engine: install refgeo with its extension on every "
            f"worker (the same version as the client)."
        )
    return ext


# --------------------------------------------------------------------------- array-API (CuPy) k-NN tasks


# a NumPy array with the contents of a chunk (a CuPy array is copied to the host)
_host = to_host


def _smallest_keys(xp, M, K):
    """The ``K`` smallest entries of every row of the device matrix ``M`` and their
    columns, as host arrays (any order among equal keys: the certificate of
    :func:`_key_ends` covers every entry left out)."""
    order = xp.argsort(M, axis=1, stable=True)[:, :K]
    return _host(xp.take_along_axis(M, order, axis=1)), _host(order).astype(np.int64)


def _prepare_xp(xp, arrays, mu=None):
    """Centered copies in the filter dtype, their float64 norms and the dtype name, for
    the array-API tasks; as ``refgeo._tiled`` prepares its blocks (the same rules for
    the filter dtype, including float64 under ``CUPY_TF32=1``: TF32 would void the
    float32 bound).  The center is ``mu`` (the mean of all rows) where given, else the
    blocks' own mean: any center gives a valid filter, but the k-NN filter is sharpest
    about the global mean (LM-gradient rows about a block's mean, which its few large
    rows dominate, refined most pairs)."""
    orig64 = [f64(xp, a) for a in arrays]
    name = "float32" if all(a.dtype == xp.float32 for a in arrays) else "float64"
    if name == "float32" and (
        os.environ.get("CUPY_TF32", "0") == "1" or not math.isfinite(rounding_bound(arrays[0].shape[1], "float32")[0])
    ):
        name = "float64"
    if mu is None:
        mu = sum(xp.sum(a, axis=0) for a in orig64) / sum(a.shape[0] for a in arrays)
    else:
        mu = xp.asarray(np.asarray(_host(mu), dtype=np.float64))
    for _ in range(2):
        fdt = xp.float32 if name == "float32" else xp.float64
        cents = [xp.astype(a - mu, fdt) for a in orig64]
        norms = [xp.sum(f64(xp, c) ** 2, axis=1) for c in cents]
        top = max(float(xp.max(n)) for n in norms)
        if name == "float64" or (top <= MAX_NORM2["float32"] and not 0.0 < top < MIN_NORM2_FLOAT32):
            break
        name = "float64"
    if not (math.isfinite(top) and top <= MAX_NORM2["float64"]):
        raise ValueError(
            f"centered squared row norms up to {top:.3g} exceed the float64 GEMM range "
            f"({MAX_NORM2['float64']:.0e}); scale the rows by a power of two first."
        )
    return cents, norms, name, top


def _knn_keys_task_xp(SA, SB, mu, k, exclude_self, both, seeds_a=None, seeds_b=None):
    """:func:`_knn_keys_task` on the array-API engine (``refgeo._tiled``): for CuPy
    chunks, the GEMM and the selection of each row's smallest keys run on the GPU
    (a sort, not heaps: no seeds taken or given, the last output is None).

    The keys are the compiled kernel's, ``m_j - 2 x_i . y_j`` (lowered norms, see
    :func:`_key_ends`) in float64 from the GEMM in the filter dtype, so the same
    certified ends follow; the task centers its blocks about ``mu``, the mean of all
    rows, as the compiled task does (the refined values come from the original rows).
    """
    xp = array_namespace(SA)
    same = SB is None
    cents, norms, name, top = _prepare_xp(xp, [SA] if same else [SA, SB], mu)
    XA, nA = cents[0], norms[0]
    XB, nB = (XA, nA) if same else (cents[1], norms[1])
    na, nb = XA.shape[0], XB.shape[0]
    cand_a = nb - int(same and exclude_self)
    if cand_a < 1:
        return None, None, (None, None), None
    d = XA.shape[1]
    cp, eabs = rounding_bound(d, name)
    cl = lowered_key_bound(cp)
    bound = reported_bound(d, name, top)
    G2 = 2.0 * f64(xp, XA @ xp.permute_dims(XB, (1, 0)), exact=False)  # flushes covered by e_abs
    keys = xp.expand_dims(nB * (1.0 - cl), axis=0) - G2
    if same and exclude_self:
        eye = xp.expand_dims(xp.arange(na), axis=1) == xp.expand_dims(xp.arange(na), axis=0)
        keys = xp.where(eye, xp.asarray(math.inf, dtype=xp.float64), keys)
    keys_a, ids_a = _smallest_keys(xp, keys, _heap_size(k, cand_a))
    nA_h, nB_h = _host(nA), _host(nB)
    ends_a, c_a = _key_ends(keys_a, ids_a, nA_h, nB_h, cand_a, k, cl, eabs, bound)
    if not (both and not same):
        return ends_a, None, (c_a, None), None
    mirror = xp.permute_dims(xp.expand_dims(nA * (1.0 - cl), axis=1) - G2, (1, 0))
    keys_b, ids_b = _smallest_keys(xp, mirror, _heap_size(k, na))
    ends_b, c_b = _key_ends(keys_b, ids_b, nB_h, nA_h, na, k, cl, eabs, bound)
    return ends_a, ends_b, (c_a, c_b), None


def _refine_xp(P, Q, r, q):
    """Refined squared distances of float64 rows with any array library (on the GPU for
    CuPy rows), in batches, in the canonical order of :func:`refgeo._certify.canonical_sq`."""
    xp = array_namespace(P)
    out = []
    for s in range(0, r.shape[0], _REFINE_BATCH):
        rr = xp.asarray(r[s : s + _REFINE_BATCH])
        qq = xp.asarray(q[s : s + _REFINE_BATCH])
        out.append(_host(canonical_sq(xp, xp.take(P, rr, axis=0), xp.take(Q, qq, axis=0))))
    return np.concatenate(out).astype(np.float64)


def _whole_block_pairs_xp(P, Q, rows, T, skip_self, k, mu):
    """The pairs of :func:`_whole_block_pairs` on the array-API engine (on the GPU for
    CuPy rows), which has no threshold pass of its own: the
    keys of :func:`_knn_keys_task_xp` for ``rows`` of ``P`` against every row of ``Q``,
    their lower ends as :func:`_key_ends` forms them, compared with ``T`` on the
    device; only the pairs that pass come to the host.  ``P`` and ``Q`` are the float64
    rows of the refinement, so the filter is float64 (and ``k``, the compiled tasks'
    limit for a float32 filter, plays no part)."""
    xp = array_namespace(P)
    (XA, XB), (nA, nB), name, _ = _prepare_xp(xp, [xp.take(P, xp.asarray(rows), axis=0), Q], mu)
    cp, eabs = rounding_bound(P.shape[1], name)
    cl = lowered_key_bound(cp)
    mB = xp.expand_dims(nB * (1.0 - cl), axis=0)
    XBt = xp.permute_dims(XB, (1, 0))
    rr, qq = [], []
    strip = max(1, _WHOLE_STRIP_ELEMENTS // max(Q.shape[0], 1))
    for s in range(0, rows.shape[0], strip):
        e = min(s + strip, rows.shape[0])
        keys = mB - 2.0 * f64(xp, XA[s:e, ...] @ XBt, exact=False)
        lo = keys + xp.expand_dims(nA[s:e] * (1.0 - cl), axis=1)
        lo = lo - eabs
        r, q = (_host(v).astype(np.int64) for v in xp.nonzero(lo <= xp.expand_dims(xp.asarray(T[rows[s:e]]), axis=1)))
        ur = rows[s:e]
        if skip_self:  # the row itself
            r, q = r[ur[r] != q], q[ur[r] != q]
        rr.append(ur[r])
        qq.append(q)
    return np.concatenate(rr), np.concatenate(qq), 0


def _knn_refine_pair_task_xp(SA, SB, cands, ends_a, ends_b, i0, j0, k, exclude_self, mu):
    """:func:`_knn_refine_pair_task` with the refinement on the array-API engine."""
    cand_a, cand_b = cands
    xp = array_namespace(SA)
    same = SB is None
    A = f64(xp, SA)
    B = A if same else f64(xp, SB)
    whole = functools.partial(_whole_block_pairs_xp, mu=mu)
    rec_a = _refine_side(A, B, cand_a, ends_a, j0, k, same and exclude_self, _refine_xp, whole)
    rec_b = None if same else _refine_side(B, A, cand_b, ends_b, i0, k, False, _refine_xp, whole)
    return rec_a, rec_b


def _knn_compiled(X, k, Y, *, exclude_self, tile_size, array_api=False) -> KernelRun:
    import dask

    tile_size = tile_size or MAX_KNN_BLOCK_ROWS
    symmetric = Y is None
    if symmetric:
        ((blocks, offsets),), mu = _blocks_and_mean([X], tile_size, host=not array_api, names=("X",))
        yblocks, yoffsets = blocks, offsets
    else:
        ((blocks, offsets), (yblocks, yoffsets)), mu = _blocks_and_mean([X, Y], tile_size, host=not array_api,
                                                                         names=("X", "Y"))
    filt = dask.delayed(_knn_keys_task_xp if array_api else _knn_keys_task, pure=True, nout=4)
    refine = dask.delayed(_knn_refine_pair_task_xp if array_api else _knn_refine_pair_task, pure=True, nout=2)
    nb = len(blocks)
    # phase 1: filter every block pair; the upper ends merge per row block.  One
    # unseeded block pair per row block runs first (X against X: the diagonal one; X
    # against Y: the first block of Y) and seeds the heaps of that row block in all
    # its other block pairs (see _knn_keys_task).
    pairs = []  # (query block, other block, other block or None, candidates of both sides)
    ends: list[list] = [[] for _ in range(nb)]
    seeds = []
    for a in range(nb):
        first = None if symmetric else yblocks[0]
        hi_a, _, cands, tops = filt(blocks[a], first, mu, k, exclude_self and symmetric, False)
        seeds.append(tops)
        ends[a].append(hi_a)
        pairs.append((a, a if symmetric else 0, first, cands))
    if symmetric:
        for a in range(nb):
            for b in range(a + 1, nb):
                hi_a, hi_b, cands, _ = filt(blocks[a], blocks[b], mu, k, exclude_self, True, seeds[a], seeds[b])
                ends[a].append(hi_a)
                ends[b].append(hi_b)
                pairs.append((a, b, blocks[b], cands))
    else:
        for a in range(nb):
            for b in range(1, len(yblocks)):
                hi_a, _, cands, _ = filt(blocks[a], yblocks[b], mu, k, False, False, seeds[a])
                ends[a].append(hi_a)
                pairs.append((a, b, yblocks[b], cands))
    T = [_tree(ends[a], _merge_ends, k, fan_in=_KNN_FAN_IN) for a in range(nb)]
    # phase 2: one refinement task per block pair, holding both blocks again
    parts: list[list] = [[] for _ in range(nb)]
    for a, b, other, cands in pairs:
        two = symmetric and a != b
        ra, rb = refine(blocks[a], other, cands, T[a], T[b] if two else None,
                        offsets[a], yoffsets[b], k, exclude_self, mu)
        parts[a].append(ra)
        if two:
            parts[b].append(rb)
    # optimize_graph=False: the graph holds only what the results need, and Dask's
    # optimization culls the whole graph once per result (row block): 1.3 s here for
    # 25 row blocks, before the first task can start
    recs = dask.compute(*[_tree(p, _merge_knn, k, fan_in=_KNN_FAN_IN) for p in parts], optimize_graph=False)
    return KernelRun(
        backend=_BACKEND, error_bound=max(r.bound for r in recs),
        n_refined=sum(r.n_refined for r in recs),
        indices=np.concatenate([r.index for r in recs], axis=0),
        distances=np.sqrt(np.concatenate([r.values for r in recs], axis=0)),
    )


def _chunks_on_gpu(*arrays) -> bool:
    """Whether the chunks of the Dask arrays are CuPy arrays (their ``_meta``)."""
    return any(a is not None and is_cupy_array(getattr(a, "_meta", None)) for a in arrays)


def knn(X, k, Y, *, exclude_self, tile_size=None, n_threads=None, engine=None) -> KernelRun:
    """The k nearest rows for Dask arrays (``Y`` None: ``X`` against itself).

    ``engine`` None picks the tasks' engine: ``"array"`` (``refgeo._tiled``, the GPU)
    for CuPy chunks, else ``"compiled"`` (the two-block kernel of
    ``refgeo_ext._knn_blocks``) when the extension is importable here, else ``"numpy"``.
    All three give the same answer.
    """
    X, Y = _engine_rows(X, "X"), _engine_rows(Y, "Y")
    if engine is None:
        if _chunks_on_gpu(X, Y):
            engine = "array"
        else:
            engine = "compiled" if _backend_ext() is not None else "numpy"
    if engine == "numpy":
        return _knn_numpy(X, k, Y, exclude_self=exclude_self, tile_size=tile_size)
    return _knn_compiled(X, k, Y, exclude_self=exclude_self, tile_size=tile_size, array_api=engine == "array")


def _knn_numpy(X, k, Y, *, exclude_self, tile_size=None) -> KernelRun:
    import dask

    symmetric = Y is None
    if symmetric:
        ((blocks, offsets),), mu = _blocks_and_mean([X], tile_size, names=("X",))
        yblocks, yoffsets = blocks, offsets
    else:
        ((blocks, offsets), (yblocks, yoffsets)), mu = _blocks_and_mean([X, Y], tile_size, names=("X", "Y"))
    filt = dask.delayed(_knn_filter_task, pure=True, nout=4)
    refine = dask.delayed(_knn_refine_task, pure=True)
    nb = len(blocks)
    # phase 1: filter every block pair; the upper ends merge per row block
    pairs = []  # (query block, candidate block or None for itself, candidates, offset, side)
    ends: list[list] = [[] for _ in range(nb)]
    if symmetric:
        for a in range(nb):
            for b in range(a, nb):
                hi_a, ca, hi_b, cb = filt(blocks[a], None if a == b else blocks[b], mu, k, exclude_self, a != b)
                ends[a].append(hi_a)
                pairs.append((a, None if a == b else blocks[b], ca, offsets[b]))
                if a != b:
                    ends[b].append(hi_b)
                    pairs.append((b, blocks[a], cb, offsets[a]))
    else:
        for a in range(nb):
            for b in range(len(yblocks)):
                hi_a, ca, _, _ = filt(blocks[a], yblocks[b], mu, k, False, False)
                ends[a].append(hi_a)
                pairs.append((a, yblocks[b], ca, yoffsets[b]))
    T = [_tree(ends[a], _merge_ends, k) for a in range(nb)]
    # phase 2: refine the surviving candidates where both rows are, merge per row block
    parts: list[list] = [[] for _ in range(nb)]
    for a, other, cand, off in pairs:
        parts[a].append(refine(blocks[a], other, cand, T[a], off, k))
    recs = _compute(*_per_row_blocks(parts, nb, _merge_knn, k))
    return KernelRun(
        backend=_BACKEND, error_bound=max(r.bound for r in recs),
        n_refined=sum(r.n_refined for r in recs),
        indices=np.concatenate([r.index for r in recs], axis=0),
        distances=np.sqrt(np.concatenate([r.values for r in recs], axis=0)),
    )


# --------------------------------------------------------------------------- one-phase farthest partners


def _farthest_fused(S, *, tile_size=None, array_api=False) -> KernelRun:
    """:func:`farthest` on the compiled (or the array-API) block-pair tasks.

    One task per block pair ``(I, J)``, ``I <= J``, returns the farthest partner of
    every row of I within J and of every row of J within I; a tree reduction per row
    block merges them with the tie rule (the larger value, then the smaller index).
    A row's farthest partner ``j*`` in block J is refined by the task ``(I, J)``: its
    upper bound ``f + e`` is at least ``r_ij* >= r_ij >= f_ij - e_ij`` for every
    ``j`` of J, the row's certified lower bound over the block pair, and so is every
    pair that ties it.  The blocks travel once (no second phase holding them again);
    each row refines at least one pair per block, ``V n`` pairs in all for ``n``
    blocks, against the ``V^2 d / 2`` multiply-adds of the GEMMs.
    """
    import dask

    ((blocks, offsets),), mu = _host_blocks_and_mean(S, tile_size, not array_api)
    nb = len(blocks)
    task = dask.delayed(_farthest_task_xp if array_api else _farthest_task_compiled, pure=True, nout=2)
    lows: list = [()] * nb
    if not array_api:
        # each row's lower bound from the rows of the seed sweeps (_row_lows_task)
        ends = _seed_rows(blocks, offsets, mu)
        low = dask.delayed(_row_lows_task, pure=True)
        lows = [(low(blocks[a], *ends),) for a in range(nb)]
    parts: list[list] = [[] for _ in range(nb)]
    for a in range(nb):
        for b in range(a, nb):
            ra, rb = task(blocks[a], None if a == b else blocks[b], offsets[a], offsets[b], mu, *lows[a], *lows[b])
            parts[a].append(ra)
            if a != b:
                parts[b].append(rb)
    return _farthest_run(_compute(*_per_row_blocks(parts, nb, _merge_farthest)))


def _partner_rows(vals, ids, offset, bound, n_refined) -> _Rows:
    """Per-row farthest partners of one side with global indices (``_NO_INDEX`` and
    ``-inf`` where the row has no partner in the block pair)."""
    ids = np.asarray(ids, dtype=np.int64)
    return _Rows(np.asarray(vals, dtype=np.float64), np.where(ids == _NO_INDEX, _NO_INDEX, ids + offset),
                 bound, int(n_refined))


def _farthest_task_compiled(SA, SB, i0, j0, mu, lows_a=None, lows_b=None):
    """Farthest partners within one block pair on the compiled engine
    (``block_pair_farthest``, the single-machine kernel's tile epilogue): ``(rows of A,
    rows of B)`` as :class:`_Rows`, B's None when ``SB`` is None (the block against
    itself).  float64 rows are filtered in float32, as in the maximum mode of the
    extreme pairs.

    ``lows_a``, ``lows_b`` (or None): lower bounds on the rows' farthest values over
    every block (:func:`_row_lows_task`); a pair that cannot reach its row's is not
    refined, and a tile pair that reaches none needs no GEMM.  A float32 filter gives
    up as the engine's does (:data:`refgeo._engine.FARTHEST_BUDGET_DIVISOR` and the
    rest, over the task's pairs and rows) and the task runs again through a float64
    filter: rows whose farthest partners lie in a cluster of near-copies refine the
    whole cluster (half of 20,000 float32 rows within 1e-5 of one point: 1.4e8 refined
    pairs, 5.4 s against 1.2 s on one machine)."""
    same = SB is None
    if same and SA.shape[0] < 2:  # one row: no partner in its own block
        return None, None
    rows = SA.shape[0] + (0 if same else SB.shape[0])
    n_pairs = SA.shape[0] * (SA.shape[0] - 1) // 2 if same else SA.shape[0] * SB.shape[0]
    runs = []

    def call(fn, parts, cp, eabs):
        A, B, XA, XB, nA, nB, dt, _ = parts
        va, ia = np.full(A.shape[0], -math.inf), np.full(A.shape[0], _NO_INDEX, dtype=np.int64)
        vb, ib = (va, ia) if same else (np.full(B.shape[0], -math.inf), np.full(B.shape[0], _NO_INDEX, dtype=np.int64))
        runs.append((va, ia, vb, ib))
        cap = max(_engine.FARTHEST_MIN_CAP, rows // _engine.FARTHEST_CAP_SHARE) if dt == "float32" else 0
        return fn(XA, nA, A, XB, nB, B, same, cp, eabs, _TASK_TILE, va, ia, vb, ib, lows_a,
                  None if same else lows_b, cap, n_pairs // _engine.FARTHEST_BUDGET_DIVISOR,
                  max(_engine.FARTHEST_MIN_HEAVY_ROWS, rows // _engine.FARTHEST_HEAVY_SHARE))

    (n, _), parts, n_before = _block_kernel_runs(SA, SB, mu, "block_pair_farthest", True, call)
    va, ia, vb, ib = runs[-1]
    bound = reported_bound(SA.shape[1], parts[6], parts[7])
    rec_a = _partner_rows(va, ia, j0, bound, n + n_before)
    return rec_a, (None if same else _partner_rows(vb, ib, i0, bound, 0))


# --------------------------------------------------------------------------- array-API (CuPy) extreme-pair and farthest tasks


def _filter_xp(SA, SB):
    """The filter of one block pair on the array-API engine (on the GPU for CuPy
    chunks): ``(xp, A64, B64, F, E, valid, bound)`` with ``F = n_i + n_j - 2 x_i . y_j``
    (float64 from the GEMM in the filter dtype), ``E = c (n_i + n_j) + e_abs`` its
    rounding bound and ``valid`` the pairs of the task (``i != j`` for the block
    against itself, None for two blocks: every pair), as ``refgeo._tiled`` filters;
    the blocks are centered about their own mean (any center gives a valid filter:
    the refined values come from the original rows)."""
    xp = array_namespace(SA)
    same = SB is None
    cents, norms, name, top = _prepare_xp(xp, [SA] if same else [SA, SB])
    XA, nA = cents[0], norms[0]
    XB, nB = (XA, nA) if same else (cents[1], norms[1])
    d = XA.shape[1]
    c, eabs = rounding_bound(d, name)
    G = f64(xp, XA @ xp.permute_dims(XB, (1, 0)))
    a = xp.expand_dims(nA, axis=1) + xp.expand_dims(nB, axis=0)
    F = a - 2.0 * G
    E = c * a + eabs
    valid = None
    if same:
        n = XA.shape[0]
        valid = xp.expand_dims(xp.arange(n), axis=1) != xp.expand_dims(xp.arange(n), axis=0)
    A64 = f64(xp, SA)
    B64 = A64 if same else f64(xp, SB)
    return xp, A64, B64, F, E, valid, reported_bound(d, name, top)


def _refined_on_device(xp, P, Q, r, q):
    """Refined squared distances of the pairs ``(r[t], q[t])`` (device index arrays),
    in batches, in the canonical order of :func:`refgeo._certify.canonical_sq`; stays
    on the device."""
    n = r.shape[0]
    if n == 0:
        return xp.zeros((0,), dtype=xp.float64)
    out = []
    for s in range(0, n, _REFINE_BATCH):
        e = min(s + _REFINE_BATCH, n)
        out.append(canonical_sq(xp, xp.take(P, r[s:e], axis=0), xp.take(Q, q[s:e], axis=0)))
    return xp.concat(out) if len(out) > 1 else out[0]


def _pair_task_xp(SA, SB, i0, j0, mu, maximize):
    """:func:`_pair_task` on the array-API engine: for CuPy chunks the GEMM, the filter
    and the float64 refinement run on the GPU; only the record comes back.

    The pairs are those with ``i < j`` for the block against itself.  In signed form
    (``g = f`` for the maximum, ``-f`` for the minimum: larger is better) a pair is kept
    when ``g + e`` reaches the largest ``g - e``, a value some pair certainly attains,
    so every pair that attains or ties the extreme is refined (as ``refgeo._tiled``).
    """
    same = SB is None
    if same and SA.shape[0] < 2:
        return None
    xp, A64, B64, F, E, valid, bound = _filter_xp(SA, SB)
    if same:
        n = SA.shape[0]
        valid = xp.expand_dims(xp.arange(n), axis=1) < xp.expand_dims(xp.arange(n), axis=0)
    sign = 1.0 if maximize else -1.0
    g = sign * F
    lo = g - E
    if valid is not None:
        lo = xp.where(valid, lo, xp.asarray(-math.inf, dtype=xp.float64))
    cand = (g + E) >= xp.max(lo)
    if valid is not None:
        cand = cand & valid
    r, q = xp.nonzero(cand)  # row-major: the first extreme below is the smallest (i, j)
    vals = _refined_on_device(xp, A64, B64, r, q)
    k = int(xp.argmax(sign * vals))
    return _Pair(float(vals[k]), i0 + int(r[k]), j0 + int(q[k]), bound, int(vals.shape[0]))


def _farthest_task_xp(SA, SB, i0, j0, mu):
    """:func:`_farthest_task_compiled` on the array-API engine (on the GPU for CuPy
    chunks): the same records, from the filter of ``refgeo._tiled``.

    A pair is kept when its upper end ``f + e`` reaches the largest lower end
    ``f - e`` of its row (or, for two blocks, of its column), a value the row's
    farthest partner within the block pair certainly attains; the refined values are
    scattered into the block-pair matrix, whose first maximum per row (per column) is
    the partner with the smallest index among equal values.
    """
    same = SB is None
    if same and SA.shape[0] < 2:
        return None, None
    xp, A64, B64, F, E, valid, bound = _filter_xp(SA, SB)
    ninf = xp.asarray(-math.inf, dtype=xp.float64)
    lo = F - E
    hi = F + E
    if same:
        lo = xp.where(valid, lo, ninf)
    cand = hi >= xp.expand_dims(xp.max(lo, axis=1), axis=1)
    if same:
        cand = cand & valid
    else:
        cand = cand | (hi >= xp.expand_dims(xp.max(lo, axis=0), axis=0))
    r, q = xp.nonzero(cand)
    vals = _refined_on_device(xp, A64, B64, r, q)
    R = xp.full(cand.shape, -math.inf, dtype=xp.float64)
    R[cand] = vals  # row-major, the order of nonzero
    n = int(vals.shape[0])
    rec_a = _partner_rows(_host(xp.max(R, axis=1)), _host(xp.argmax(R, axis=1)), j0, bound, n)
    if same:
        return rec_a, None
    return rec_a, _partner_rows(_host(xp.max(R, axis=0)), _host(xp.argmax(R, axis=0)), i0, bound, 0)
