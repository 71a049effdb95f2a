"""Compiled-engine wrappers: the ``cython`` backend of the pairwise row geometry.

The kernels in ``refgeo_ext._extreme_pairs`` and ``refgeo_ext._knn`` filter pairs with
the Gram expansion on centered rows and refine candidates with the same canonical
float64 sum as :func:`refgeo._certify.canonical_sq` (``refgeo_ext/src/refine.h``).
The wrappers here prepare what the kernels need and never validate user input (the
public functions in :mod:`refgeo.rows` did): they center the rows, compute the
rounding bound (:func:`refgeo._certify.rounding_bound`), seed the diameter, choose
the tile size, the thread count and the filter dtype (the thresholds below), pin BLAS
to one thread while OpenMP runs the tiles, and merge the per-thread results with the
tie rule.  Each returns a :class:`refgeo._backend.KernelRun`; none falls back to the
reference inside a call (the rows arrive prescaled into the range the GEMM can hold).
``progress`` is None or a :class:`refgeo._progress.Progress`: each kernel run is
announced to it with its task count (tile pairs, plus row blocks for k-NN), and the
kernel's tile driver reports between tiles; k-NN's float64 redo pass is one more run, as
is the closest pair's float64 run after a float32 run past its budget.

All thresholds change only the speed, never the result: tests set them to 0 or to a
huge value to exercise both sides.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from . import _backend, _memory, _progress
from ._backend import KernelRun
from ._certify import (
    MAX_NORM2,
    MIN_NORM2_FLOAT32,
    best_pair,
    better,
    canonical_sq,
    lowered_key_bound,
    reported_bound,
    rounding_bound,
)
from ._filter import first_per_row
from ._threads import blas_single_thread

# Every kernel call pins BLAS to one thread, whatever ``n_eff`` is: with OpenMP tiles a
# threaded BLAS would oversubscribe the cores, and with one tile thread (small inputs,
# ``n_threads=1``, a forked child) the tile GEMMs are too small for BLAS threads to pay
# (knn 10000 x 768 with n_threads=1: 5.8 s of CPU with threaded BLAS, 0.87 s pinned).

__all__ = ["closest", "diameter", "farthest", "knn"]

_BACKEND = "cython"

# Rows per tile: a float64 256 x 256 cross-term block is 512 KiB (fits in L2), and a
# (256 x d) @ (d x 256) GEMM already runs near the BLAS peak.
DEFAULT_TILE = 256
# Rows per tile of the diameter and the closest pair through a float32 filter: a
# 512 x 512 float32 block is 1 MiB, and the larger GEMM packs its operands less often
# per pair: 4 to 12% faster than 256 rows here (2 MiB of L2 per core; 20,000 x 64 to
# 20,000 x 768), where 1024 rows gained nothing more.
DEFAULT_TILE_F32 = 512
# k-NN tiles are larger: BLAS packs both operands of every tile GEMM, and at 256 rows
# the packing is about 8% of the GEMM time (a single-threaded float32 GEMM of
# 256 x 768 by 768 x 256 runs at 0.93 of the rate of a 2048 x 2048 one, 512 x 512 at
# 0.97).  The epilogue reads the block once, streaming, so it need not fit in L2,
# and the heaps it updates are walked in cache-sized blocks of tile pairs.
KNN_DEFAULT_TILE = 1024
# Bytes of one thread's k-NN heaps per block of rows that the tile pairs are walked in
# (0: row-major order): the row and column blocks of both threads (4 x 3 MiB) stay in
# a shared last-level cache of 16 MiB or more, next to the GEMM operands.
KNN_HEAP_BLOCK_BYTES = 3 << 20
# Below this many multiply-adds (V^2 d / 2) a call runs on one thread: waking an
# OpenMP team costs more than the work (tests set it to 0 to exercise the merge).
MIN_PARALLEL_WORK = 1 << 20

# k-NN of float64 rows filters in float32 (half the GEMM time) from this many
# multiply-adds on; rows the float32 certificate cannot settle are redone in float64.
KNN_MIXED_MIN_WORK = 1 << 26
# The same for the maximum modes (diameter, farthest partners) of float64 rows: the band
# of pairs within the float32 bound of the largest distance is thin, so few pairs are
# refined.
MAX_MIXED_MIN_WORK = 1 << 26
# The closest pair of float64 rows filters in float32 from this many multiply-adds on,
# and every float32 filter of the closest pair runs with a budget: near-duplicate
# clusters put many pairs inside the float32 band (all pairs of a cluster whose spread
# is below about 1e-3 of the norms at d = 64), and each costs a refinement, O(d)
# outside the GEMM.  A thread that has refined (or buffered) more than
# max(MIN_MIXED_BUDGET, V^2 / (MIN_MIXED_BUDGET_DIVISOR * threads)) pairs stops the
# run, which is done again with the float64 filter (on float64 copies of float32 rows).
# V^2 / 32 refinements cost about as much as the float64 run (8,000 x 64 with a cluster
# of near-duplicates, 1e-6 apart, at the end: 30% of the rows took 0.07 s in float32
# without a budget, 0.06 s in float64).  So: a third to a half less time than the
# float64 filter on every input whose near-duplicates stay under the budget (clusters
# of up to a fifth of the rows here: 0.043 and 0.052 s, against 0.063 and 0.065 s; a
# cluster of a fraction f of the rows trips it near f = 1/4), up to about twice where
# they fill it (a third to a half of the rows: 0.11 to 0.12 s against 0.06 s; a
# divisor of 256 tripped at a tenth of the rows, 0.10 s against 0.063 s).
MIN_MIXED_MIN_WORK = 1 << 26
MIN_MIXED_BUDGET = 1 << 16
MIN_MIXED_BUDGET_DIVISOR = 32

# The farthest partners through a float32 filter give up, and run again through a
# float64 filter, once more than V^2 / FARTHEST_BUDGET_DIVISOR pairs are refined and
# more than max(FARTHEST_MIN_HEAVY_ROWS, V / FARTHEST_HEAVY_SHARE) rows have each had
# more than max(FARTHEST_MIN_CAP, V / FARTHEST_CAP_SHARE) refinements that came out
# below the row's best so far (on the thread that refined them: whether a run gives up
# can depend on the threads and tiles, its answer never does).  Rows whose farthest
# partners lie in a cluster of near-copies that float32 cannot tell apart refine the
# whole cluster and keep one (half of 20,000 float32 rows of R^64 within 1e-5 of one
# point: 83 million refinements and 2.4 s on one thread, 0.80 s for Gaussian rows),
# and they are many.  An exact tie with the best is not counted: a float64 filter
# refines it too, and in a code every row has hundreds to thousands (the Kerdock code
# of R^64: about 900 a row among 2,112 rows), so the cap can be small: clusters of a
# few hundred rows qualify (a cap of V / 4 missed a cluster of 4,800 among 20,000:
# 72 million refinements, 2.5 s, against 1.0 s for the float64 filter).
FARTHEST_BUDGET_DIVISOR = 128
FARTHEST_CAP_SHARE = 64
FARTHEST_MIN_CAP = 256
FARTHEST_HEAVY_SHARE = 64
FARTHEST_MIN_HEAVY_ROWS = 64

# Pair slots (int64 columns) the rows of one compiled threshold pass may fill
# (_settle): 32 MB, so that a strip of rows against 50,000 candidates is thousands of
# rows, one efficient GEMM, while a cluster of near-copies, whose rows all fill their
# slots, stays within it.
WITHIN_SLOTS = 1 << 22

# A row the k-NN threshold pass finds with more than max(k, N / share) pairs within
# reach of its bound (N candidates) is not answered from them: in a float32 filter it
# goes through the float64 filter (near-copies that float32 cannot tell apart: half of
# 20,000 rows within 1e-5 of one point), in a float64 filter it is refined against
# every candidate.  The float64 share is larger because nothing finer follows: rows of
# the Delsarte-Goethals code (2,000 to 5,000 exact ties at the 16-th distance among
# 20,000) refined every pair at N / 16, 400 million refinements and 7.2 s for
# knn(X, 16), and 38 million and 3.1 s at N / 4.  (The pair slots of a strip of rows
# stay within WITHIN_SLOTS either way: larger shares only make the strips shorter.)
SETTLE_DENSE_SHARE_F32 = 16
SETTLE_DENSE_SHARE_F64 = 4

# The rows the k-NN threshold pass settles are first grouped around anchors (_anchor_groups):
# ANCHOR_BATCH anchors a round, while a round assigns at least ANCHOR_MIN_GAIN rows per
# anchor; a group whose candidates are more than N / ANCHOR_MAX_SHARE of the N
# candidates runs against all of them.
# A row joins an anchor within ANCHOR_REACH times its own reach: near-copies in high
# dimension are about equally far apart, so an anchor of the row's cluster is rarely
# within its reach itself (the reach is the distance to its nearest rows).
ANCHOR_BATCH = 64
ANCHOR_MIN_GAIN = 2
ANCHOR_MAX_SHARE = 4
ANCHOR_REACH = 2.0
# A group runs on its own only if it spares the threshold pass this many multiply-adds
# (its rows times the candidates left out times d): each group is a kernel call of its
# own, about a millisecond of fixed cost, and the many groups of two to ten copies
# (tokens seen a few times) cost more than their rows in the strips (knn of 8,000 such
# rows of R^128: 0.26 s in strips, 0.61 s in groups of every size).
ANCHOR_MIN_WORK = 1 << 26
ANCHOR_UNION_SHARE = 16
# Consecutive groups run as one, against the union of their candidates, while that
# costs at most this many times the work of the groups apart (_merge_groups).
ANCHOR_MERGE_GROWTH = 1.25

# The float64 filter of rows the float32 filter leaves with too many pairs within reach
# first runs its heaps on KNN_TIE_PROBE of them; if they defer at least
# KNN_TIE_PROBE_SHARE of those, the ties are exact (rows of a code), and the other rows
# skip it: a float32 threshold pass again, keeping up to N / SETTLE_DENSE_SHARE_F64 pairs
# a row.  The float64 heaps and threshold pass were two GEMM passes over every candidate
# that separated nothing (knn(X, 16) of 20,000 Delsarte-Goethals rows of R^64: 3 of 5.3 s).
# Only for at least KNN_TIE_PROBE_MIN_ROWS rows: the probe splits the heaps into two
# passes, whose fixed cost showed on the many small groups of hidden states (+10%).
KNN_TIE_PROBE = 64
KNN_TIE_PROBE_SHARE = 0.9
KNN_TIE_PROBE_MIN_ROWS = 1024

# Rows per task of the k-NN kernel's second phase (the kernel's ROW_BLOCK): only to
# announce the task count to a progress reporter, which adopts the kernel's own count.
KNN_ROW_BLOCK = 64

# A group of deferred rows (_settle) first runs the k-NN heaps against its candidates in
# its own frame, centered at the median of its rows, when the rounding bound there (with
# the median norms) is at most 1 / LOCAL_FRAME_GAIN of the one in the common frame.
# Why: the filter's bound grows with the centered norms, and near-copies far from the
# common mean tie within it (hidden states of one frequent token of R^256: squared
# distances of about 5e-4 against a bound of about 8e-3 in the common frame, 8e-9 about
# their own center), so each of them refined every pair of its group within reach or
# ran through the float64 filter; in their own frame float32 heaps certify most of
# them (knn(X, 1) of 20,000 hidden states of R^256: 2.6 million pairs refined before,
# 62,000 after).  Groups whose frame gains too little (batches of small groups, rows
# whose nearest rows are far, copies of one row) skip it: the pass would certify
# nothing.
# The median is taken over at most LOCAL_FRAME_SAMPLE rows, evenly spaced.
LOCAL_FRAME_GAIN = 16
LOCAL_FRAME_SAMPLE = 1024


def _suffix(a) -> str:
    return "32" if a.dtype == np.float32 else "64"


def _kernel_suffix(X, S) -> str:
    """Kernel variant for a centered copy X of the original rows S."""
    return "32s64" if X.dtype == np.float32 and S.dtype == np.float64 else _suffix(X)


def _center(arrays, n_threads, float32_filter=False, mu=None):
    """Centered copies of ``arrays`` about their common float64 mean (or about ``mu``,
    float64 of shape (d,): any center gives a valid rounding bound, which depends on
    the centered copies' norms only).

    Returns ``(originals, centered, norms, dtype_name)``: the originals share one dtype
    (float64 if any input is), and the centered copies are stored in that dtype, or in
    float32 for float64 originals when ``float32_filter`` asks for it; ``dtype_name`` is
    the dtype of the centered copies (the one the rounding bound is for).  float64 is
    used where float32 would overflow, where its products would underflow
    (:data:`refgeo._certify.MIN_NORM2_FLOAT32`) or where d is too large for a useful float32 bound.
    """
    ext = _backend.extension()
    arrays = [np.ascontiguousarray(a) for a in arrays]
    dt = np.float64 if any(a.dtype == np.float64 for a in arrays) else np.float32
    d = arrays[0].shape[1]
    f32_ok = math.isfinite(rounding_bound(d, "float32")[0])
    if dt == np.float32 and not f32_ok:
        dt = np.float64
    arrays = [np.ascontiguousarray(a, dtype=dt) for a in arrays]
    total = sum(a.shape[0] for a in arrays)
    if total * d < MIN_PARALLEL_WORK:
        n_threads = 1
    if mu is None:
        mu = sum(np.sum(a, axis=0, dtype=np.float64) for a in arrays) / total
    mixed = float32_filter and dt == np.float64 and f32_ok
    out = []
    for a in arrays:
        X = np.empty(a.shape, dtype=np.float32 if mixed else a.dtype)
        nrm = np.empty(a.shape[0])
        getattr(ext._common, "center" + _kernel_suffix(X, a))(a, mu, X, nrm, n_threads)
        out.append((X, nrm))
    name = "float32" if mixed or dt == np.float32 else "float64"
    if name == "float32":
        top = max(float(n.max()) for _, n in out)
        # Too large: the float32 GEMM would overflow.  Too small: its products underflow,
        # the absolute term of the bound swamps every distance and each pair is refined.
        if top > MAX_NORM2["float32"] or 0.0 < top < MIN_NORM2_FLOAT32:
            return _center([a.astype(np.float64) for a in arrays], n_threads, mu=mu)
    return arrays, [X for X, _ in out], [n for _, n in out], name


def _check_range(norms, dtype) -> None:
    """The GEMM must not overflow: the callers prescale the rows so that it cannot."""
    top = max(float(n.max()) for n in norms)
    if not (math.isfinite(top) and top <= MAX_NORM2[dtype]):
        raise ValueError(
            f"centered squared row norms up to {top:.3g} exceed the {dtype} GEMM range "
            f"({MAX_NORM2[dtype]:.0e}); scale the rows by a power of two first."
        )


def _refine_pair(S, i, j) -> float:
    A = np.asarray(S[i], dtype=np.float64)
    B = np.asarray(S[j], dtype=np.float64)
    return float(canonical_sq(np, A, B))


def _diameter_seed(S, X, nrm) -> float:
    """A refined squared distance near the diameter: iterated farthest points, O(V d)."""
    a = int(np.argmax(nrm))
    best = 0.0
    for _ in range(4):
        # Only a candidate pair comes out of these products, and it is refined: any
        # pair gives a valid seed.  So a floating-point flag that BLAS raises on finite
        # rows is no error here (CI saw one "invalid value encountered in matmul" on
        # 5 x 5 float32 rows near 1e4, once, not reproducible: from the BLAS kernel,
        # not from the rows).
        with np.errstate(invalid="ignore", over="ignore"):
            da = nrm - 2.0 * (X @ X[a]).astype(np.float64)
        b = int(np.argmax(da))
        if b == a:
            break
        best = max(best, _refine_pair(S, a, b))
        a = b
    return best


def _tiles(V, tile_size, float32=False, n_threads=1):
    """``(tile, tiles)``: ``tile_size``, else DEFAULT_TILE, or for a float32 filter
    DEFAULT_TILE_F32 halved (down to DEFAULT_TILE) until there are at least 32 tile
    pairs per thread to balance."""
    tile = tile_size or DEFAULT_TILE
    if tile_size is None and float32:
        tile = DEFAULT_TILE_F32
        while tile > DEFAULT_TILE and (-(-V // tile)) * (-(-V // tile) + 1) // 2 < 32 * n_threads:
            tile //= 2
    tile = max(1, min(V, tile))
    nt = -(-V // tile)
    return tile, nt


def _effective_threads(n_threads, n_tasks, work):
    if work < MIN_PARALLEL_WORK:
        return 1
    return max(1, min(n_threads, n_tasks))


def _hook(progress, n_tasks):
    """The kernel's ``progress(done, total)`` for a :class:`refgeo._progress.Progress`, or None."""
    return None if progress is None else progress.kernel_hook(n_tasks)


def _compiled_extreme_pair(S, *, maximize, tile_size, n_threads, progress=None, float32_filter=True) -> KernelRun:
    ext = _backend.extension()
    n = _backend.resolve_n_threads(n_threads)
    V, d = S.shape
    work = V * V * d // 2
    mixed = float32_filter and work >= (MAX_MIXED_MIN_WORK if maximize else MIN_MIXED_MIN_WORK)
    (Sc,), (X,), (nrm,), dt = _center([S], n, float32_filter=mixed)
    _check_range([nrm], dt)
    V, d = Sc.shape
    cp, eabs = rounding_bound(d, dt)
    tile, nt = _tiles(V, tile_size, X.dtype == np.float32, n)
    n_eff = _effective_threads(n, nt * (nt + 1) // 2, work)
    tile_rmax = np.sqrt(np.maximum.reduceat(nrm, np.arange(0, V, tile)))
    out_r = np.empty(n_eff)
    out_ij = np.empty((n_eff, 2), dtype=np.int64)
    out_nref = np.zeros(n_eff, dtype=np.int64)
    suffix = _kernel_suffix(X, Sc)
    fn = getattr(ext._extreme_pairs, "extreme_pair" + suffix)
    # a closest pair through a float32 filter (of float64 or float32 rows) gives up where
    # too many pairs fall within that filter's wider band (near-copies): a float64 run
    # follows
    budget = 0
    if not maximize and X.dtype == np.float32:
        budget = max(MIN_MIXED_BUDGET, V * V // (MIN_MIXED_BUDGET_DIVISOR * n_eff))
    with blas_single_thread():
        # The seed's matrix-vector products run under the one-thread limit too: a
        # multi-threaded BLAS call just before the kernel leaves BLAS worker threads
        # spinning, and they steal cores from the OpenMP tiles (15% of samples in perf).
        bound0 = _diameter_seed(Sc, X, nrm) if maximize else math.inf
        over = fn(X, nrm, tile_rmax, Sc, maximize, cp, eabs, bound0, tile, n_eff, out_r, out_ij, out_nref,
                  progress=_hook(progress, nt * (nt + 1) // 2), budget=budget)
    if over:  # float64 copies of float32 rows refine to the same bits
        del X, nrm, tile_rmax  # the float32 copy is no longer needed during the rerun
        run = _compiled_extreme_pair(np.asarray(S, dtype=np.float64), maximize=maximize, tile_size=tile_size,
                                     n_threads=n_threads, progress=progress, float32_filter=False)
        return dataclasses.replace(run, n_refined=run.n_refined + int(out_nref.sum()))
    best: tuple[float, int, int] | None = None
    for t in range(n_eff):
        i, j = int(out_ij[t, 0]), int(out_ij[t, 1])
        if i < V and better(float(out_r[t]), i, j, best, maximize):
            best = (float(out_r[t]), i, j)
    v, i, j = best_pair(best)
    return KernelRun(
        backend=_BACKEND, error_bound=reported_bound(d, dt, float(nrm.max())),
        n_refined=int(out_nref.sum()), value=math.sqrt(v), i=i, j=j,
    )


def diameter(S, *, tile_size=None, n_threads=None, progress=None) -> KernelRun:
    """Row diameter of NumPy float32/float64 rows on the compiled engine."""
    return _compiled_extreme_pair(S, maximize=True, tile_size=tile_size, n_threads=n_threads, progress=progress)


def closest(S, *, tile_size=None, n_threads=None, progress=None) -> KernelRun:
    """Closest pair of NumPy float32/float64 rows on the compiled engine."""
    return _compiled_extreme_pair(S, maximize=False, tile_size=tile_size, n_threads=n_threads, progress=progress)


def farthest(S, *, tile_size=None, n_threads=None, progress=None, float32_filter=True) -> KernelRun:
    """Each row's farthest other row on the compiled engine."""
    ext = _backend.extension()
    n = _backend.resolve_n_threads(n_threads)
    V, d = S.shape
    mixed = float32_filter and V * V * d // 2 >= MAX_MIXED_MIN_WORK
    (Sc,), (X,), (nrm,), dt = _center([S], n, float32_filter=mixed)
    _check_range([nrm], dt)
    V, d = Sc.shape
    cp, eabs = rounding_bound(d, dt)
    tile, nt = _tiles(V, tile_size)
    n_eff = _effective_threads(n, nt * (nt + 1) // 2, V * V * d // 2)
    L = np.full((n_eff, V), -np.inf)
    B = np.full((n_eff, V), -np.inf)
    Bj = np.full((n_eff, V), V, dtype=np.int64)
    nref = np.zeros(n_eff, dtype=np.int64)
    fn = getattr(ext._extreme_pairs, "farthest_partners" + _kernel_suffix(X, Sc))
    # a float32 filter gives up where rows' farthest partners tie within its band by
    # the thousand (near-copies it cannot tell apart); a float64 run follows
    cap = max(FARTHEST_MIN_CAP, V // FARTHEST_CAP_SHARE) if X.dtype == np.float32 else 0
    with blas_single_thread():
        over = fn(X, nrm, Sc, cp, eabs, tile, n_eff, L, B, Bj, nref, progress=_hook(progress, nt * (nt + 1) // 2),
                  cap=cap, budget=V * V // FARTHEST_BUDGET_DIVISOR,
                  heavy_rows=max(FARTHEST_MIN_HEAVY_ROWS, V // FARTHEST_HEAVY_SHARE))
    if over:  # float64 copies of float32 rows refine to the same bits
        del X, nrm, L, B, Bj
        run = farthest(np.asarray(S, dtype=np.float64), tile_size=tile_size, n_threads=n_threads,
                       progress=progress, float32_filter=False)
        return dataclasses.replace(run, n_refined=run.n_refined + int(nref.sum()))
    r, j = B[0].copy(), Bj[0].copy()
    for t in range(1, n_eff):
        better = (B[t] > r) | ((B[t] == r) & (Bj[t] < j))
        r = np.where(better, B[t], r)
        j = np.where(better, Bj[t], j)
    return KernelRun(
        backend=_BACKEND, error_bound=reported_bound(d, dt, float(nrm.max())),
        n_refined=int(nref.sum()), indices=j, distances=np.sqrt(r),
    )


def _knn_tile(nA, nB, symmetric, tile_size, n_threads) -> int:
    """Rows per k-NN tile: ``tile_size``, else KNN_DEFAULT_TILE halved (down to
    DEFAULT_TILE) until there are at least 32 tile pairs per thread to balance."""
    tile = tile_size or KNN_DEFAULT_TILE
    while tile_size is None and tile > DEFAULT_TILE:
        ntA, ntB = -(-nA // tile), -(-nB // tile)
        if (ntA * (ntA + 1) // 2 if symmetric else ntA * ntB) >= 32 * max(1, n_threads):
            break
        tile //= 2
    return max(1, min(max(nA, nB), tile))


def _heap_size(n_cand: int, k: int) -> int:
    """k plus slack, so that the certificate usually holds from the heap alone."""
    return min(n_cand, k + max(8, k // 2))


def _knn_plan(nA, nB, d, symmetric, tile_size, n_threads) -> tuple[int, int, int]:
    """``(tile, tile pairs, threads)`` of a k-NN pass of nA rows against nB."""
    tile = _knn_tile(nA, nB, symmetric, tile_size, n_threads)
    ntA, ntB = -(-nA // tile), -(-nB // tile)
    npairs = ntA * (ntA + 1) // 2 if symmetric else ntA * ntB
    return tile, npairs, _effective_threads(n_threads, npairs, nA * nB * d // (2 if symmetric else 1))


def _knn_pass(fn, XA, nA, SA, XB, nB, SB, *, symmetric, exclude_self, self_idx, defer, k, dt,
              tile_size, n, progress=None, K=None):
    """One run of a compiled k-NN kernel with heaps of K keys (default :func:`_heap_size`);
    returns (indices, distances, stats)."""
    nA_rows, d = SA.shape
    nB_rows = SB.shape[0]
    excluded = int(symmetric and exclude_self) if symmetric else int(np.any(self_idx >= 0))
    n_cand = nB_rows - excluded
    cp, eabs = rounding_bound(d, dt)
    K = _heap_size(n_cand, k) if K is None else min(n_cand, K)
    tile, npairs, n_eff = _knn_plan(nA_rows, nB_rows, d, symmetric, tile_size, n)
    out_idx = np.empty((nA_rows, k), dtype=np.int64)
    out_dist = np.empty((nA_rows, k))
    stats = np.zeros(2, dtype=np.int64)
    with blas_single_thread():
        fn(XA, nA, SA, XB, nB, SB, symmetric, exclude_self, self_idx, defer, k, lowered_key_bound(cp), eabs,
           tile, n_eff, K, KNN_HEAP_BLOCK_BYTES, out_idx, out_dist, stats,
           progress=_hook(progress, npairs + -(-nA_rows // KNN_ROW_BLOCK)))
    return out_idx, out_dist, stats


def _within(XA, nA, XB, nB, dt, T, self_cols, cap, n_threads, tile_size=None, progress=None):
    """``(counts, cols)``: the pairs of rows ``XA`` (against every row of ``XB``) whose
    lower end, as the k-NN kernel bounds it, is at most the row's squared threshold
    ``T[r]``: ``cols[r, :counts[r]]``, complete for the rows with at most ``cap`` of
    them (``counts[r] > cap`` flags the others).  ``self_cols[r]`` (or None) is the
    column of row r itself, left out.  One compiled pass (``refgeo_ext._knn.within*``):
    a GEMM of the rows against every candidate on the tile driver, the lower ends
    tested in its epilogue, so that nothing of size rows x candidates is ever held.
    """
    nP, d = XA.shape
    fn = getattr(_backend.extension()._knn, "within" + _suffix(XA))
    cp, eabs = rounding_bound(d, dt)
    counts = np.zeros(nP, dtype=np.int64)
    # one slot more than cap: a row that fills its slots has more than cap pairs
    cols = np.empty((nP, cap + 1), dtype=np.int64)
    own = np.full(nP, -1, dtype=np.int64) if self_cols is None else np.asarray(self_cols, dtype=np.int64)
    tile, npairs, n_eff = _knn_plan(nP, XB.shape[0], d, False, tile_size, n_threads)
    with blas_single_thread():
        fn(XA, nA, XB, nB, T, own, lowered_key_bound(cp), eabs, tile, n_eff, counts, cols,
           progress=_hook(progress, npairs))
    return counts, cols


def _anchor_groups(F, T, XA, nA, XB, nB, dt):
    """``(groups, rest)``: rows ``F`` of ``XA`` (squared thresholds ``T``) in groups that
    share a small candidate set, and the positions (into ``F``) of the rest.

    Each group is ``(positions into F, candidate rows of XB)``, and its candidates hold
    every row of ``XB`` within ``sqrt(T)`` of each of its rows: by the triangle
    inequality, a candidate j within reach of row i is within ``sqrt(T_i) + |x_i - a|``
    of the group's anchor a, so the candidates are the rows whose certified lower
    bound on ``|x_j - a|^2`` (the filter's rounding bound, as the kernels bound it)
    is at most the square of the largest such radius of the group.  A row joins the
    nearest anchor within ANCHOR_REACH times its own reach (``|x_i - a| <= 2
    sqrt(T_i)`` by the upper bound; an anchor is in its own group whatever its reach),
    so a group's radius is at most three times the largest reach of its rows (plus the
    anchor's own rounding bound).  The triangle inequality holds for the refined
    distances up to their rounding, which the factor 1 + 2^-30 on the radii and the
    absolute term of the rounding bound cover.  The groups' candidate lists together
    hold at most WITHIN_SLOTS entries (rows past that go to the rest).  Anchors are taken from the rows
    not yet grouped, ANCHOR_BATCH at a time (one GEMM of those rows against them, and
    one of every candidate against them), while a round groups at least
    ANCHOR_MIN_GAIN rows per anchor; groups with more than N / ANCHOR_MAX_SHARE
    candidates, and the rows left, go to the rest; groups that spare less than
    ANCHOR_MIN_WORK multiply-adds run together, against the union of their candidates,
    in batches whose union holds about N / ANCHOR_UNION_SHARE candidates (at most
    N / ANCHOR_UNION_SHARE + N / ANCHOR_MAX_SHARE, the last group's added); consecutive
    groups with nearly the same candidates are then merged (:func:`_merge_groups`).

    Why: near-copies in high dimension are nearly equidistant (hidden states of one
    token in similar contexts), so the float32 filter ties them beyond any heap and the
    threshold pass ran each of them against every candidate: 9,746 of 20,000 hidden
    states of R^256 with Zipf token counts, a GEMM as large as the first pass, where
    their candidates are their token's other rows.
    """
    d = XA.shape[1]
    cp, eabs = rounding_bound(d, dt)
    wide = 1.0 + 2.0**-30  # covers the rounding of the float64 arithmetic below
    nBtot = XB.shape[0]
    left = np.arange(F.size)
    rT = np.sqrt(np.maximum(T, 0.0))
    groups, rest, small = [], [], []
    union = np.zeros(nBtot, dtype=bool)
    held = 0  # candidate entries the groups hold (at most WITHIN_SLOTS)
    while left.size:
        # anchors spread over the rows left: rows in order (sorted by token, or
        # repeated in blocks) put a whole batch of consecutive anchors into one cluster
        at = np.unique(np.linspace(0, left.size - 1, min(ANCHOR_BATCH, left.size)).astype(np.intp))
        anc = left[at]
        A = XA[F[anc]]
        na = nA[F[anc]]
        # upper bounds on |x_i - a| for the rows left against the anchors, formed in
        # place: (1 + c)(n_i + n_a) - 2 g + e_abs, widened
        with np.errstate(over="ignore", invalid="ignore"):
            ra = (XA[F[left]] @ A.T).astype(np.float64)
        ra *= -2.0
        ra += (1.0 + cp) * (nA[F[left]][:, None] + na[None, :])
        ra += eabs
        ra *= wide
        np.maximum(ra, 0.0, out=ra)
        np.sqrt(ra, out=ra)
        with np.errstate(invalid="ignore"):  # a reach of 0 times an infinite threshold joins nothing
            ok = ra <= ANCHOR_REACH * rT[left][:, None]
        ok[at, np.arange(anc.size)] = True  # an anchor is in its own group
        ra = np.where(ok, ra, np.inf)
        near = np.argmin(ra, axis=1)
        has = np.isfinite(ra[np.arange(left.size), near])
        if has.sum() < ANCHOR_MIN_GAIN * anc.size:
            rest.append(left)
            break
        # candidates of this round's anchors: every row of XB against them
        sel = np.flatnonzero(has)
        q_of = near[sel]
        R = np.full(anc.size, -1.0)
        np.maximum.at(R, q_of, (rT[left[sel]] + ra[sel, q_of]) * wide)
        # lower bounds on |x_j - a|^2 for every candidate, in place: (1 - c)(n_j + n_a)
        # - 2 g - e_abs, narrowed
        with np.errstate(over="ignore", invalid="ignore"):
            low = (XB @ A.T).astype(np.float64)
        low *= -2.0
        low += (1.0 - cp) * (nB[:, None] + na[None, :])
        low -= eabs
        low /= wide
        inside = low <= np.where(R >= 0.0, R * R * wide, -np.inf)[None, :]
        del low
        n_cand = inside.sum(axis=0)
        order = np.argsort(q_of, kind="stable")
        bounds = np.searchsorted(q_of[order], np.arange(anc.size + 1))
        for q in range(anc.size):
            members = left[sel[order[bounds[q] : bounds[q + 1]]]]
            if members.size == 0:
                continue
            if n_cand[q] * ANCHOR_MAX_SHARE > nBtot or held + n_cand[q] > WITHIN_SLOTS:
                rest.append(members)
            elif members.size * (nBtot - n_cand[q]) * d >= ANCHOR_MIN_WORK:
                groups.append((members, np.flatnonzero(inside[:, q])))
                held += int(n_cand[q])
            else:
                # too small to run alone: with other small groups, against the union of
                # their candidates, once that holds N / ANCHOR_UNION_SHARE of them
                small.append(members)
                union |= inside[:, q]
                n_union = np.count_nonzero(union)
                if n_union * ANCHOR_UNION_SHARE >= nBtot:
                    if held + n_union > WITHIN_SLOTS:
                        rest.extend(small)
                    else:
                        groups.append((np.sort(np.concatenate(small)), np.flatnonzero(union)))
                        held += n_union
                    small, union = [], np.zeros(nBtot, dtype=bool)
        left = left[~has]
    if small:
        if held + np.count_nonzero(union) > WITHIN_SLOTS:
            rest.extend(small)
        else:
            groups.append((np.sort(np.concatenate(small)), np.flatnonzero(union)))
    rest_pos = np.concatenate(rest) if rest else np.zeros(0, dtype=np.intp)
    return _merge_groups(groups, nBtot), np.sort(rest_pos)


def _merge_groups(groups, n):
    """Consecutive groups (``(positions, candidates)``, candidates among ``n`` rows) as
    one group against the union of their candidates, while that does at most
    ANCHOR_MERGE_GROWTH times the work of the groups apart (rows times candidates) and
    the union holds at most ``n / ANCHOR_MAX_SHARE`` rows.

    Why: the anchors of one round are often rows of one cluster, which split the
    cluster's rows among them with nearly the same candidates, each group a pass of its
    own (400 near-copies of 2,000 rows, merged never: 64 float64 passes of a few rows
    against the same 400).  Merged, the work is about the same and the passes are one.
    The union is a superset of each group's candidates, so it holds every row within
    reach.
    """
    out = []  # (positions, candidates) of the merged groups
    mask = np.zeros(n, dtype=bool)  # the candidates of the group being merged
    parts: list = []
    n_mask = rows = work = 0

    def close():
        C = np.flatnonzero(mask)
        out.append((np.sort(np.concatenate(parts)), C))
        mask[C] = False

    for pos, C in groups:
        if parts:
            n_union = n_mask + int(np.count_nonzero(~mask[C]))
            if n_union * ANCHOR_MAX_SHARE <= n and (rows + pos.size) * n_union <= ANCHOR_MERGE_GROWTH * (
                    work + pos.size * C.size):
                parts.append(pos)
                mask[C] = True
                n_mask, rows, work = n_union, rows + pos.size, work + pos.size * C.size
                continue
            close()
        parts = [pos]
        mask[C] = True
        n_mask, rows, work = C.size, pos.size, pos.size * C.size
    if parts:
        close()
    return out


def _refined_pairs(SA, SB, r, q) -> np.ndarray:
    """Refined squared distances of the pairs ``(SA[r[t]], SB[q[t]])``: the compiled
    ``refgeo_ext._knn_blocks.refine_pairs*`` (the canonical summation order of
    ``src/refine.h``; no copies of the rows).  The Dask tasks refine with it too."""
    vals = np.empty(r.shape[0])
    getattr(_backend.extension()._knn_blocks, "refine_pairs" + _suffix(SA))(
        SA, SB, np.ascontiguousarray(r, dtype=np.int64), np.ascontiguousarray(q, dtype=np.int64), vals)
    return vals


def _pick_fewer(SA, SB, P, counts, cols, idx, dist) -> int:
    """Rows ``P`` of ``SA`` with fewer pairs within reach than the outputs' k columns,
    ``cols[t, :counts[t]]`` of ``SB``: each pair refined (:func:`_refined_pairs`), the
    row's pairs by (value, column) into ``idx[P]`` and ``dist[P]``
    (:func:`refgeo._filter.first_per_row`), the rest padded with -1 and inf.  Returns
    the number of pairs refined."""
    r = np.repeat(np.arange(P.size), counts)
    c = cols[np.arange(cols.shape[1])[None, :] < counts[:, None]]  # row by row, as r
    v = _refined_pairs(SA, SB, P[r], c)
    v, j, ok = first_per_row(v, v, r, c, P.size, idx.shape[1])
    idx[P] = np.where(ok, j, -1)
    dist[P] = np.where(ok, np.sqrt(v), math.inf)
    return int(v.size)


def _settle(F, idx, dist, XA, nA, XB, nB, dt, SA, SB, k, self_cols, n_threads, dense, tile_size=None,
            progress=None, dense_share=None, fewer=False) -> int:
    """Rows ``F`` that no heap certified, against the pairs that can reach their U.

    A deferred row's ``dist[i, 0]`` holds U, the k-th smallest squared upper bound of
    its heap (``refgeo_ext._knn``): an upper bound on its k-th smallest squared
    distance.  A group's rows first run the heaps in the group's own frame (``local``
    below, :data:`LOCAL_FRAME_GAIN`).  The rows left are filtered again against the
    candidates within reach of their group (:func:`_anchor_groups`; every candidate
    for the rows not grouped; :func:`_within`,
    on the centered copies ``XA``, ``XB`` in the filter dtype ``dt``, with the
    kernel's own lower ends), the pairs whose lower end is at most U are refined from
    the original rows ``SA``, ``SB`` as the kernel refines, and the k smallest by
    (value, index) are written to ``idx[F]`` and ``dist[F]`` (``refgeo_ext._knn.pick*``).
    Rows with more than ``max(k, N / 16)`` candidates within reach in a float32 filter,
    or ``max(k, N / 4)`` in a float64 filter (``N`` candidate rows;
    :data:`SETTLE_DENSE_SHARE_F32`; ``max(k, N / dense_share)`` where ``dense_share``
    is given), go to ``dense(rows, C)`` instead, with ``C`` their group's candidates
    (sorted rows of ``XB``, a superset of every row's k nearest) or None (every row):
    the float64 filter, or the kernel, which refines them against every candidate; it
    counts its own refinements.  Why: where more rows tie than any heap holds
    (near-copies within the filter's bound: clusters of 50 and k = 1), each row was
    refined against every candidate, O(N d) outside the GEMM per row (knn(X, 1) of
    20,000 such float32 rows of R^64: 6.1 s, 0.2 s for Gaussian rows).  Returns the
    number of pairs refined here (not those of ``dense``).
    ``tile_size`` and ``progress`` as in :func:`knn` (each threshold pass is a kernel run
    that nobody announced: the total grows).  With ``fewer``, U is a threshold from
    elsewhere (:func:`knn`'s ``thresholds``) that may hold fewer than k pairs of a row:
    such a row gets those pairs (:func:`_pick_fewer`), without it that is an internal
    error.
    """
    T = dist[F, 0].copy()
    pick = getattr(_backend.extension()._knn, "pick" + _suffix(SA))
    if dense_share is None:
        dense_share = SETTLE_DENSE_SHARE_F32 if dt == "float32" else SETTLE_DENSE_SHARE_F64
    dense_at = max(k, XB.shape[0] // dense_share)
    n_ref = 0
    many_rows: dict[int, tuple[list[np.ndarray], np.ndarray | None]] = {}  # group: (rows for dense, candidates)

    def own_positions(pos, C):
        """The positions in C of rows F[pos] themselves (to be left out)."""
        own = np.searchsorted(C, self_cols[pos])
        # a row is always among its group's candidates (it is within reach of itself)
        if (own >= C.size).any() or (C[np.minimum(own, C.size - 1)] != self_cols[pos]).any():
            raise RuntimeError("internal error: a k-NN row is missing from its group's candidates")
        return own.astype(np.int64)

    def settle(pos, C, group):
        """Rows F[pos] of ``group`` against the candidates C (None: every row of XB)."""
        nonlocal n_ref
        P = F[pos]
        if fewer and C is not None and C.size == 0:  # no row within reach of the group
            n_ref += _pick_fewer(SA, SB, P, np.zeros(P.size, np.int64), np.zeros((P.size, 1), np.int64), idx, dist)
            return
        XBc, nBc = (XB, nB) if C is None else (np.ascontiguousarray(XB[C]), np.ascontiguousarray(nB[C]))
        own = None
        if self_cols is not None:
            own = self_cols[pos] if C is None else own_positions(pos, C)
        counts, cols = _within(np.ascontiguousarray(XA[P]), np.ascontiguousarray(nA[P]), XBc, nBc, dt,
                               T[pos], own, dense_at, n_threads, tile_size, progress)
        if C is not None:  # candidates' positions in C back to rows of XB (unused slots: 0)
            used = np.arange(cols.shape[1])[None, :] < counts[:, None]
            cols = np.where(used, C[np.clip(cols, 0, C.size - 1)], 0)
        # U is the k-th smallest upper bound: at least k pairs of each row reach it
        few = counts < k
        if few.any():
            if not fewer:
                raise RuntimeError("internal error: a k-NN row has fewer than k pairs within its bound")
            n_ref += _pick_fewer(SA, SB, P[few], counts[few], cols[few], idx, dist)
            P, counts, cols = P[~few], counts[~few], cols[~few]
        many_rows.setdefault(group, ([], C))[0].append(P[counts > dense_at])
        # a small pick on one thread: an OpenMP team for a few thousand refinements cost
        # 7 ms a call on two busy cores
        n_pick = _effective_threads(n_threads, -(-P.size // KNN_ROW_BLOCK), int(counts.sum()) * SA.shape[1])
        n_ref += int(pick(SA, SB, P.astype(np.int64), counts, cols, k, n_pick, idx, dist))

    def local(pos, C):
        """Rows F[pos] against their group's candidates C (sorted rows of XB) through the
        k-NN heaps in the group's own frame (:data:`LOCAL_FRAME_GAIN`): copies of the
        rows and the candidates centered at the coordinate-wise median of (up to
        LOCAL_FRAME_SAMPLE of) the rows, with that frame's rounding bound; the certified
        rows are written to ``idx``, ``dist``.  Returns the positions the heaps defer
        (all of them where the frame gains too little), which keep their U: the heaps'
        own U would be no help to the threshold pass that follows, whose lower ends
        come from the common frame (the same pairs passed with either on hidden states
        and clusters of near-copies).  The median, not the mean: groups merged by
        :func:`_merge_groups` can hold a few rows of another cluster, which pull the
        mean off every row (two tokens in one group of hidden states: squared norms of
        2.6 about the mean, 2.6e-4 about the median, and no row certified)."""
        nonlocal n_ref
        P = F[pos]
        own = None if self_cols is None else own_positions(pos, C)
        if C.size - int(own is not None) < k:  # (a threshold that holds fewer than k rows)
            return pos
        rows = SA[P]
        mu = np.median(rows[:: -(-P.size // LOCAL_FRAME_SAMPLE)], axis=0).astype(np.float64)
        origs, cents, norms, ldt = _center([rows, SB[C]], n_threads, float32_filter=dt == "float32", mu=mu)
        d = SA.shape[1]
        # medians: a few far rows among the candidates only widen their own pairs' bounds
        cl = rounding_bound(d, ldt)[0]
        here = cl * (np.median(norms[0]) + np.median(norms[1]))
        if here == 0.0:  # most rows are exact copies of the center: the mean norms
            here = cl * (norms[0].mean() + norms[1].mean())
        common = rounding_bound(d, dt)[0] * (np.median(nA[P]) + np.median(nB[C]))
        # here == 0: every row and candidate is a copy of one row, tied in any frame
        if here == 0.0 or here * LOCAL_FRAME_GAIN > common:
            return pos
        fn = getattr(_backend.extension()._knn, "knn" + _kernel_suffix(cents[0], origs[0]))
        sub_idx, sub_dist, stats = _knn_pass(
            fn, cents[0], norms[0], origs[0], cents[1], norms[1], origs[1], symmetric=False,
            exclude_self=False, self_idx=np.full(P.size, -1, np.int64) if own is None else own,
            defer=True, k=k, dt=ldt, tile_size=tile_size, n=n_threads, progress=progress)
        n_ref += int(stats[1])
        done = sub_idx[:, 0] >= 0
        idx[P[done]] = C[sub_idx[done]]  # positions in C back to rows of XB
        dist[P[done]] = sub_dist[done]
        return pos[~done]

    groups, rest_pos = _anchor_groups(F, T, XA, nA, XB, nB, dt)
    groups = [(local(pos, C), C) for pos, C in groups]
    # rows that share a small set of candidates (near-copies) run against it alone, the
    # others against every candidate; in strips of rows, so that their pair slots
    # (dense_at + 1 per row) stay within WITHIN_SLOTS: a cluster of 10,000 near-copies
    # passes every pair of the cluster
    strip = max(1, WITHIN_SLOTS // (dense_at + 1))
    for group, (pos, C) in enumerate([*groups, (rest_pos, None)]):
        for s in range(0, pos.size, strip):
            settle(pos[s : s + strip], C, group)
    # a group's rows with too many pairs within reach go to the dense path against the
    # group's candidates alone: the states of frequent tokens (3,039 of 20,000 rows for one)
    # ran through a float64 filter against every row, a third of the call (1.0 of 3.0 s)
    for parts, C in many_rows.values():
        rows = np.concatenate(parts)
        if rows.size:
            dense(rows, C)  # counts its own refinements
    return n_ref


def knn_memory(nA, nB, d, k, *, symmetric, exclude_self, itemsize, tile_size, n_threads) -> dict:
    """Bytes the compiled k-NN allocates, by part: its first pass, and the passes over
    the rows it defers: the threshold pass's pair slots (:data:`WITHIN_SLOTS`) and
    copies of those rows, and for the rows it hands to a float64 filter, float64
    copies and heap passes with at most as many heap records per thread, on at most as
    many threads.

    Sizes as in :func:`_knn_pass`: the (nA, k) outputs, one (nA, K) heap of keys and
    indices per thread, and the centered copies with their norms.
    """
    n_cand = nB - int(exclude_self) if symmetric else nB
    K = _heap_size(n_cand, k)
    n_eff = _knn_plan(nA, nB, d, symmetric, tile_size, n_threads)[2]
    rows = nA if symmetric else nA + nB
    parts = {
        f"indices and distances ({nA}, {k})": 16.0 * nA * k,
        f"heaps ({n_eff} threads, {nA}, K={K})": 16.0 * n_eff * nA * K,
        f"centered copies ({rows}, {d})": float(rows) * (d * itemsize + 8),
        # the kernel's lowered norms of the heap keys (refgeo_ext/_knn.pyx.tp)
        f"lowered norms ({nA} + {nB})": 8.0 * (nA + nB),
        # a redo pass copies its deferred rows (centered, with norms, and original):
        # all of them where ties defer every row (groups of near-copies)
        f"copies of deferred rows (up to {nA}, {d})": float(nA) * (2 * d * itemsize + 8),
    }
    if itemsize == 8 and nA * nB * d >= KNN_MIXED_MIN_WORK:
        # float64 rows filtered through float32: rows that filter cannot settle are
        # redone with a float64 centered copy of every row, made then
        parts[f"float64 centered copies for the last redo ({rows}, {d})"] = float(rows) * (8 * d + 8)
    elif itemsize == 4:
        # float32 rows with more ties than a heap holds and too many pairs within
        # reach are redone through a float64 filter: float64 copies, centered and not
        parts[f"float64 copies for the last redo ({rows}, {d})"] = float(rows) * (16 * d + 8)
    # the rows no heap settles are first grouped around anchors (_anchor_groups): a copy
    # of those rows, the GEMM of them and of every candidate against a batch of anchors
    # (in the filter dtype, then float64, with a float64 temporary and a mask), and the
    # groups' candidate lists (at most WITHIN_SLOTS entries), of up to three nested
    # threshold passes (the first, the one after a probe of the float64 heaps, the
    # float64 filter's)
    parts[f"anchor rounds ({ANCHOR_BATCH} anchors, {nA} + {nB} rows)"] = (
        float(nA) * d * itemsize + (itemsize + 8.0 + 8.0 + 1.0) * ANCHOR_BATCH * (nA + nB) + 3 * 8.0 * WITHIN_SLOTS)
    # a group's candidates (at most nB / ANCHOR_MAX_SHARE rows, or a batch of small groups'
    # union, up to nB / ANCHOR_UNION_SHARE more) copied for its threshold pass (centered,
    # with norms) and for its float64 heaps or its refinement against every candidate
    # (float64 centered and original rows, with norms)
    n_group = int(nB // ANCHOR_MAX_SHARE + nB // ANCHOR_UNION_SHARE)
    parts[f"a group's candidates ({n_group}, {d})"] = float(n_group) * ((itemsize + 16.0) * d + 16.0)
    # the rows no heap settles are filtered again in strips (_settle): the strip's pair
    # slots (int64 columns), and each thread's refined pairs of one row
    slots = max(k, nB // min(SETTLE_DENSE_SHARE_F32, SETTLE_DENSE_SHARE_F64)) + 1
    parts[f"pair slots ({WITHIN_SLOTS}, and {slots} a row per thread)"] = 8.0 * WITHIN_SLOTS + 16.0 * n_threads * slots
    return parts


def knn(X, k, Y, *, exclude_self, tile_size=None, n_threads=None, progress=None, thresholds=None) -> KernelRun:
    """The k nearest rows on the compiled engine (``Y`` None: ``X`` against itself).

    ``thresholds`` (float64, one per row of ``X``, or None): squared distances; each
    row then gets its k nearest among the rows of ``Y`` within its threshold only
    (fewer where fewer are, padded with index -1 and distance inf), and the first pass
    is skipped: every row goes to the threshold pass of :func:`_settle` at once.  For
    the Dask tasks, whose rows overflowed their heaps and whose threshold comes from
    every block (the pairs beyond it cannot be among the row's k nearest).
    """
    ext = _backend.extension()
    n = _backend.resolve_n_threads(n_threads)
    symmetric = Y is None
    nA, d = X.shape
    nB = nA if symmetric else Y.shape[0]
    _memory.check_memory(
        f"knn of {nA} x {d} rows against {nB} (k={k})",
        knn_memory(nA, nB, d, k, symmetric=symmetric, exclude_self=exclude_self,
                   itemsize=X.dtype.itemsize, tile_size=tile_size, n_threads=n),
        "Pass a smaller k, fewer n_threads (each thread keeps its own heaps), or query the "
        "rows of X in chunks (knn(X[a:b], k, Y) for Y the candidate rows).",
    )
    arrays = [X] if symmetric else [X, Y]
    # float64 rows with enough work are filtered through a float32 centered copy (half
    # the GEMM time); _center falls back to float64 where float32 cannot hold them.
    # The float64 centered copy is then made only if some row needs it (below): at
    # N = 50000, d = 768 it is 300 MB that the common case never reads.
    want_mixed = (
        any(a.dtype == np.float64 for a in arrays)
        and X.shape[0] * arrays[-1].shape[0] * X.shape[1] >= KNN_MIXED_MIN_WORK
    )
    origs, cents, norms, dt = _center(arrays, n, float32_filter=want_mixed)
    _check_range(norms, dt)
    SA = origs[0]
    SB = SA if symmetric else origs[1]
    d = SA.shape[1]
    XA, nA = cents[0], norms[0]
    XB, nB = (XA, nA) if symmetric else (cents[1], norms[1])
    no_self = np.full(SA.shape[0], -1, dtype=np.int64)
    fn = getattr(ext._knn, "knn" + _kernel_suffix(XA, SA))
    n_cand = SB.shape[0] - int(symmetric and exclude_self)
    K = _heap_size(n_cand, k)
    if thresholds is None:
        # the first pass defers the rows its heaps cannot certify (idx[i, 0] = -1)
        idx, dist, stats = _knn_pass(
            fn, XA, nA, SA, XB, nB, SB, symmetric=symmetric, exclude_self=exclude_self,
            self_idx=no_self, defer=True, k=k, dt=dt, tile_size=tile_size, n=n, progress=progress,
        )
        n_refined = int(stats[1])
        F = np.flatnonzero(idx[:, 0] < 0)
    else:  # every row deferred, with its threshold as U
        thresholds = np.asarray(thresholds, dtype=np.float64)
        if thresholds.shape != (SA.shape[0],) or not np.all(thresholds >= 0.0):  # (NaN fails too)
            raise ValueError(f"thresholds must hold one squared distance >= 0 (or inf) per row of X "
                             f"({SA.shape[0]}), got shape {thresholds.shape}"
                             + ("" if thresholds.shape != (SA.shape[0],) else " with a NaN or negative entry"))
        idx = np.full((SA.shape[0], k), -1, dtype=np.int64)
        dist = np.full((SA.shape[0], k), math.inf)
        dist[:, 0] = thresholds
        n_refined = 0
        F = np.arange(SA.shape[0])
    fewer = thresholds is not None
    # redo passes run on at most the first pass's threads: with at most its heap records
    # per thread (below), they stay within the knn_memory estimate checked above
    n_redo = _knn_plan(SA.shape[0], SB.shape[0], d, symmetric, tile_size, n)[2]
    heap_rows = K * SA.shape[0]

    def self_cols(F):
        return F if (symmetric and exclude_self) else None

    def redo(fn, F, XA, nA, XB, nB, K, dt, defer, SA=SA, SB=SB, C=None):
        """Rows F against every candidate with heaps of K, in passes of at most
        ``heap_rows // K`` rows; returns the rows still deferred.  ``C`` (sorted rows of
        XB, or None for all): the candidates, a superset of each row's k nearest."""
        nonlocal n_refined
        if C is not None:
            XB, nB, SB = (np.ascontiguousarray(a[C]) for a in (XB, nB, SB))
            K = min(K, _heap_size(C.size - int(symmetric and exclude_self), k))
        left = []
        per = max(1, heap_rows // K)
        for a in range(0, F.size, per):
            P = F[a : a + per]
            self_idx = np.full(P.size, -1, np.int64)
            if symmetric and exclude_self:
                self_idx = (P if C is None else np.searchsorted(C, P)).astype(np.int64)
            sub_idx, sub_dist, sub_stats = _knn_pass(
                fn, np.ascontiguousarray(XA[P]), np.ascontiguousarray(nA[P]),
                np.ascontiguousarray(SA[P]), XB, nB, SB, symmetric=False, exclude_self=False,
                self_idx=self_idx, defer=defer, k=k, dt=dt, tile_size=tile_size, n=n_redo,
                progress=progress, K=K,
            )
            if C is not None:  # positions in C back to rows (a deferred row holds -1 and U only)
                done = sub_idx[:, 0] >= 0
                sub_idx[done] = C[sub_idx[done]]
            idx[P] = sub_idx
            dist[P] = sub_dist
            n_refined += int(sub_stats[1])
            left.append(P[sub_idx[:, 0] < 0])
        return np.concatenate(left) if left else F

    def refine_all(fn, R, XA, nA, XB, nB, K, dt, SA=SA, SB=SB, C=None):
        """Rows R refined against every candidate of C (``redo`` counts the pairs)."""
        redo(fn, R, XA, nA, XB, nB, K, dt, defer=False, SA=SA, SB=SB, C=C)

    copies64: list[tuple] = []  # the float64 copies, made once, by the first float64 filter

    def float64_filter(R, C=None, probe=True):
        """Rows R that the float32 filter cannot settle, through a float64 filter (the
        same mean, so the same centered rows; float64 copies of float32 rows refine to
        the same bits): its heaps against the candidates C (None: every row), then, for
        the rows they defer, the pairs that can reach their float64 U (a threshold pass
        of its own, grouped anew, against every row), then every candidate of their new
        group (or every row) for the rows with too many of those (counted in
        n_refined).

        With ``probe`` and at least KNN_TIE_PROBE_MIN_ROWS rows, the heaps first run on
        KNN_TIE_PROBE rows spread over R; if they defer at least KNN_TIE_PROBE_SHARE of
        them, the ties are exact, which no filter separates, and the other rows skip the
        float64 filter: a float32 threshold pass again, which keeps up to
        ``max(k, N / SETTLE_DENSE_SHARE_F64)`` pairs a row (as a float64 filter would),
        and a row with more comes back here without the probe."""
        nonlocal n_refined
        if not copies64:
            copies64.append(_center([np.asarray(a, dtype=np.float64) for a in arrays], n))
        o64, c64, n64, _ = copies64[0]
        A64, B64 = o64[0], o64[0 if symmetric else 1]
        XB64, nB64 = (c64[0], n64[0]) if symmetric else (c64[1], n64[1])
        args = (c64[0], n64[0], XB64, nB64, K, "float64")
        skip = R[:0]
        if probe and R.size >= KNN_TIE_PROBE_MIN_ROWS:
            # rows spread over R: its first rows may all be of one kind (the standard
            # basis that opens a code)
            at = np.zeros(R.size, dtype=bool)
            at[np.linspace(0, R.size - 1, KNN_TIE_PROBE).astype(np.intp)] = True
            head, rest = R[at], R[~at]
            R = redo(ext._knn.knn64, head, *args, defer=True, SA=A64, SB=B64, C=C)
            if R.size >= KNN_TIE_PROBE_SHARE * head.size:
                skip = rest
            else:
                R = np.concatenate([R, redo(ext._knn.knn64, rest, *args, defer=True, SA=A64, SB=B64, C=C)])
        else:
            R = redo(ext._knn.knn64, R, *args, defer=True, SA=A64, SB=B64, C=C)
        # the refinements of the dense paths are counted as they run: add _settle's after
        # it returns (`n_refined += _settle(...)` would read n_refined before the call)
        if R.size:
            # (it groups these rows around anchors of its own, against every row)
            own = _settle(R, idx, dist, c64[0], n64[0], XB64, nB64, "float64", A64, B64, k, self_cols(R), n,
                          lambda D, C2: refine_all(ext._knn.knn64, D, *args, SA=A64, SB=B64, C=C2),
                          tile_size, progress, fewer=fewer)
            n_refined += own
        if skip.size:
            own = _settle(skip, idx, dist, XA, nA, XB, nB, dt, SA, SB, k, self_cols(skip), n,
                          lambda D, C2: float64_filter(D, C2, probe=False), tile_size, progress,
                          dense_share=SETTLE_DENSE_SHARE_F64, fewer=fewer)
            n_refined += own

    # deferred rows (more ties near their k-th distance than the heap's slack, as in
    # sign rows and clusters of near-copies): only their pairs that can reach U, found by
    # one compiled threshold pass against every candidate (_settle); rows with too many
    # of those go through the float64 filter (float32-filtered rows: it separates
    # near-copies that float32 cannot) or are refined against every candidate (float64
    # rows).  Each row's answer is certified either way: only the work differs.  (Before,
    # the rows were redone with heaps up to 4 times larger first, which cost the same
    # GEMM plus the heaps' insertions and settled only the rows whose ties fit: knn of
    # 20,000 sign rows of R^64 at k = 16 took 0.75 s, now 0.52 s, against 0.30 s for
    # Gaussian rows.)
    if F.size:
        crowded = float64_filter if dt == "float32" else (lambda R, C: refine_all(fn, R, XA, nA, XB, nB, K, dt, C=C))

        def heaps_first(R, C):
            """(With thresholds.) Rows R through this call's own heaps against C first,
            then ``crowded`` for those they defer: the thresholds come from another
            filter, and this call's centering can be far better (rows of one cluster,
            centered near it, certify from float32 heaps where a float64 filter ran
            before: Dask blocks with half of their rows within 1e-5 of one point, 12% of
            the call)."""
            left = redo(fn, R, XA, nA, XB, nB, K, dt, defer=True, C=C)
            if left.size:
                crowded(left, C)

        dense = heaps_first if fewer else crowded
        # dense() counts its refinements as it runs: add _settle's own after it returns
        own = _settle(F, idx, dist, XA, nA, XB, nB, dt, SA, SB, k, self_cols(F), n, dense, tile_size, progress,
                      fewer=fewer)
        n_refined += own
    return KernelRun(
        backend=_BACKEND, error_bound=reported_bound(d, dt, float(max(nA.max(), nB.max()))),
        n_refined=n_refined, indices=idx, distances=dist,
    )


