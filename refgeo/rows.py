"""Row geometry of an LM-head update (SPEC §2): certified extreme pairs and k-NN.

For an update :math:`S \\in \\mathbb{R}^{V \\times d}` with rows :math:`s_i`, the row
diameter :math:`D(S) = \\max_{i<j} \\lVert s_i - s_j \\rVert_2` is the operator norm
from :math:`\\ell_2` to :math:`(\\mathbb{R}^V/\\mathbb{R}\\mathbf{1}, \\lVert\\cdot\\rVert_{var})`:
it is the largest Hilbert distance a step can cause for a hidden state of unit norm.

.. autosummary::

   row_diameter
   closest_pair
   distance_ratio
   farthest_partners
   knn
   covering_radius
   jung_constant
   worst_case_hidden_state
   hilbert_rms
   backward_bound

Exact means certified
---------------------
Every distance this module reports is the *refined* float64 value

.. math:: r_{ij} = \\mathrm{fl}\\Big(\\sum_k \\mathrm{fl}(s_{ik} - s_{jk})^2\\Big)

computed by direct differences in float64 in one fixed summation order (eight
interleaved partial sums, lane ``k mod 8``, combined as
``((p0+p1)+(p2+p3))+((p4+p5)+(p6+p7))``), so the reference and the compiled backend
agree bit for bit.  The compiled backend filters pairs with the Gram expansion and
refines, in float64, every pair whose filtered value lies within an a-priori rounding
bound of the running extreme (see :func:`row_diameter`, Notes); the reference
evaluates every pair directly.  CuPy arrays run the same filter and refinement with
whole-tile array operations (cuBLAS GEMM in IEEE float32/float64, never TF32; float64
refinement on the device), written against the array API.  Ties go to the
lexicographically smallest ``(i, j)`` (for k-NN: the smaller index), so every backend,
tile size and thread count returns the same value and the same indices.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
from array_api_compat import array_namespace, is_numpy_array

from . import _backend
from ._threads import blas_single_thread
from ._validate import (
    as_float_array,
    check_bool,
    check_int,
    check_min_rows,
    check_real,
    check_same_trailing,
)

__all__ = [
    "EnclosingBall",
    "ExtremePair",
    "FarthestPartners",
    "KNNResult",
    "WorstCaseHiddenState",
    "backward_bound",
    "closest_pair",
    "covering_radius",
    "distance_ratio",
    "farthest_partners",
    "hilbert_rms",
    "jung_constant",
    "knn",
    "row_diameter",
    "worst_case_hidden_state",
]

# Pairs per block of the reference scans: the (rows, rows, 8) float64 lane buffer of
# one block is 8 * 8 * 2**16 bytes = 4 MiB, whatever V.
_REF_BLOCK_PAIRS = 1 << 16
# float64 elements of one row block of distances in the reference k-NN / farthest scans.
_REF_ROW_ELEMENTS = 1 << 20


# --------------------------------------------------------------------------- results


@dataclasses.dataclass(frozen=True, slots=True)
class ExtremePair:
    """A certified extreme pair of rows (diameter or closest pair).

    Attributes
    ----------
    value : float
        The distance :math:`\\lVert s_i - s_j \\rVert_2` of the pair, the square root of
        the refined float64 squared distance (module docstring).
    i, j : int
        The pair, ``i < j``; among equal values the lexicographically smallest.
    error_bound : float
        The a-priori bound on ``|filtered - refined|`` (squared distances) used to
        select the candidate pairs that were refined; ``0.0`` when every pair was
        evaluated directly (reference backend).
    backend : str
        Backend that computed the result (``"reference"``, ``"cython"``, ``"cupy"``).
    dtype : str
        dtype of the input after conversion (``"float64"`` or ``"float32"``).
    n_refined : int
        Number of pairs evaluated by direct float64 differences.
    """

    value: float
    i: int
    j: int
    error_bound: float
    backend: str
    dtype: str
    n_refined: int


@dataclasses.dataclass(frozen=True, slots=True)
class FarthestPartners:
    """Per-row farthest partner.

    Attributes
    ----------
    indices : ndarray of shape (V,)
        int64; ``indices[i]`` is the ``j != i`` maximising ``||s_i - s_j||`` (ties: the
        smallest ``j``).
    distances : ndarray of shape (V,)
        float64 refined distances ``||s_i - s_{indices[i]}||``.
    """

    indices: Any
    distances: Any


@dataclasses.dataclass(frozen=True, slots=True)
class KNNResult:
    """k nearest neighbours of every query row.

    Attributes
    ----------
    indices : ndarray of shape (n, k)
        int64 indices into the candidate rows, sorted by increasing distance; equal
        squared distances are ordered by the smaller index.
    distances : ndarray of shape (n, k)
        float64 refined distances, ascending along each row.
    """

    indices: Any
    distances: Any


@dataclasses.dataclass(frozen=True, slots=True)
class EnclosingBall:
    """A (near-)minimum enclosing ball of the rows with a certificate.

    Attributes
    ----------
    radius : float
        ``max_i ||s_i - centre||``: an upper bound on the covering radius, attained by
        ``centre``.
    centre : ndarray of shape (d,)
        float64 centre of the ball.
    lower_bound : float
        Certified lower bound on the covering radius, from the dual weights:
        :math:`\\sum_i w_i \\lVert s_i - \\bar s_w \\rVert^2 \\le \\mathrm{rad}^2` with
        :math:`\\bar s_w = \\sum_i w_i s_i`.
    weights : ndarray of shape (V,)
        Dual weights (a probability vector; positive only on the support points).
    n_iter : int
        Iterations of the solver.
    """

    radius: float
    centre: Any
    lower_bound: float
    weights: Any
    n_iter: int


@dataclasses.dataclass(frozen=True, slots=True)
class WorstCaseHiddenState:
    """The hidden state of norm ``H`` that moves the output distribution most.

    Attributes
    ----------
    value : float
        :math:`\\sup_{\\lVert h \\rVert \\le H} \\lVert S h \\rVert_{var} = H \\cdot D(S)`.
    h : ndarray of shape (d,)
        float64 :math:`h^* = H (s_a - s_b) / \\lVert s_a - s_b \\rVert` for the diameter pair
        (the zero vector when ``D(S) = 0``: then every h attains 0).
    i, j : int
        The diameter pair ``(a, b)``.
    """

    value: float
    h: Any
    i: int
    j: int


# --------------------------------------------------------------------------- helpers


def _f64(xp, x):
    return xp.astype(x, xp.float64) if x.dtype != xp.float64 else x


def _dtype_name(x) -> str:
    return "float32" if "float32" in str(x.dtype) else "float64"


def _readonly(a):
    if is_numpy_array(a):
        a.setflags(write=False)
    return a


def _canonical_sq(xp, A, B):
    """Refined squared distances ``sum_k (a_k - b_k)**2`` of broadcast rows, float64.

    The fixed summation order (module docstring) is shared with ``refgeo_ext``: eight
    lanes ``k mod 8`` accumulated in increasing ``k``, then combined pairwise.
    """
    d = A.shape[-1]
    lanes = None
    for k0 in range(0, d, 8):
        w = min(8, d - k0)
        t = A[..., k0 : k0 + w] - B[..., k0 : k0 + w]
        sq = t * t
        if w < 8:
            pad = xp.zeros(sq.shape[:-1] + (8 - w,), dtype=xp.float64)
            sq = xp.concat([sq, pad], axis=-1)
        lanes = sq if lanes is None else lanes + sq
    p = [lanes[..., r] for r in range(8)]
    return ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]))


def _block_size(V: int) -> int:
    return max(1, min(V, math.isqrt(_REF_BLOCK_PAIRS)))


def _better(v, i, j, best, maximise: bool) -> bool:
    """The one tie rule: strictly better value, or equal value and smaller ``(i, j)``."""
    if best is None:
        return True
    bv, bi, bj = best
    if maximise:
        return v > bv or (v == bv and (i, j) < (bi, bj))
    return v < bv or (v == bv and (i, j) < (bi, bj))


def _extreme_pair_reference(S, *, maximise: bool, tile_size=None, n_threads=None):
    """Brute force over all pairs ``i < j`` with refined distances, block by block."""
    xp = array_namespace(S)
    X = _f64(xp, S)
    V = X.shape[0]
    b = _block_size(V)
    fill = -math.inf if maximise else math.inf
    best = None
    for i0 in range(0, V, b):
        i1 = min(i0 + b, V)
        A = xp.expand_dims(X[i0:i1, :], axis=1)
        for j0 in range(i0, V, b):
            j1 = min(j0 + b, V)
            if j1 - 1 <= i0:  # no pair j > i in this block
                continue
            D2 = _canonical_sq(xp, A, xp.expand_dims(X[j0:j1, :], axis=0))
            ii = xp.expand_dims(xp.arange(i0, i1), axis=1)
            jj = xp.expand_dims(xp.arange(j0, j1), axis=0)
            vals = xp.reshape(xp.where(jj > ii, D2, xp.asarray(fill, dtype=xp.float64)), (-1,))
            k = int(xp.argmax(vals)) if maximise else int(xp.argmin(vals))
            bj = j1 - j0
            cand = (float(vals[k]), i0 + k // bj, j0 + k % bj)
            if _better(*cand, best, maximise):
                best = cand
    v, i, j = best
    return math.sqrt(v), i, j, 0.0, V * (V - 1) // 2


def _diameter_reference(S, *, tile_size=None, n_threads=None):
    return _extreme_pair_reference(S, maximise=True)


def _closest_reference(S, *, tile_size=None, n_threads=None):
    return _extreme_pair_reference(S, maximise=False)


def _row_distances_block(xp, A, B, self_offset, exclude_self, fill):
    """Refined squared distances of the rows of ``A`` to all rows of ``B``, shape (a, n_B).

    With ``exclude_self`` the entry (r, self_offset + r) is replaced by ``fill``.
    """
    nA = A.shape[0]
    nB = B.shape[0]
    bj = max(1, _REF_BLOCK_PAIRS // max(nA, 1))
    Ae = xp.expand_dims(A, axis=1)
    parts = []
    for j0 in range(0, nB, bj):
        j1 = min(j0 + bj, nB)
        parts.append(_canonical_sq(xp, Ae, xp.expand_dims(B[j0:j1, :], axis=0)))
    D2 = xp.concat(parts, axis=1) if len(parts) > 1 else parts[0]
    if exclude_self:
        ii = xp.expand_dims(xp.arange(self_offset, self_offset + nA), axis=1)
        jj = xp.expand_dims(xp.arange(0, nB), axis=0)
        D2 = xp.where(ii == jj, xp.asarray(fill, dtype=xp.float64), D2)
    return D2


def _farthest_reference(S, *, tile_size=None, n_threads=None):
    xp = array_namespace(S)
    X = _f64(xp, S)
    V = X.shape[0]
    bi = max(1, min(V, _REF_ROW_ELEMENTS // V))
    idx, dist = [], []
    for i0 in range(0, V, bi):
        i1 = min(i0 + bi, V)
        D2 = _row_distances_block(xp, X[i0:i1, :], X, i0, True, -math.inf)
        j = xp.argmax(D2, axis=1)  # first occurrence: the smallest j among ties
        idx.append(xp.astype(j, xp.int64))
        dist.append(xp.sqrt(xp.max(D2, axis=1)))
    return xp.concat(idx), xp.concat(dist), 0.0, V * (V - 1)


def _knn_reference(X, k, Y, *, exclude_self, tile_size=None, n_threads=None):
    xp = array_namespace(X) if Y is None else array_namespace(X, Y)
    A = _f64(xp, X)
    B = A if Y is None else _f64(xp, Y)
    nA, nB = A.shape[0], B.shape[0]
    self_pairs = Y is None and exclude_self
    bi = max(1, min(nA, _REF_ROW_ELEMENTS // nB))
    idx, dist = [], []
    for i0 in range(0, nA, bi):
        i1 = min(i0 + bi, nA)
        D2 = _row_distances_block(xp, A[i0:i1, :], B, i0, self_pairs, math.inf)
        order = xp.argsort(D2, axis=1, stable=True)[:, :k]  # ties: smaller index first
        idx.append(xp.astype(order, xp.int64))
        dist.append(xp.sqrt(xp.take_along_axis(D2, order, axis=1)))
    return xp.concat(idx, axis=0), xp.concat(dist, axis=0), 0.0, nA * (nB - int(self_pairs))


# --------------------------------------------------------------------------- compiled engine
#
# The cython backend (refgeo_ext._extreme_pairs, refgeo_ext._knn) filters pairs with
# the Gram expansion on centred rows and refines candidates with the same canonical
# float64 sum as `_canonical_sq` (refgeo_ext/src/refine.h).  The wrappers below
# centre the rows, compute the rounding bound, seed the diameter, pin BLAS to one
# thread while OpenMP runs the tiles, and merge per-thread results with the tie rule.

_U64 = 2.0**-53
# unit roundoff u and smallest *normal* number eta of the dtype the centred copy is
# stored in.  With gradual underflow an underflowing operation errs by at most half the
# smallest subnormal; a library elsewhere in the process may switch on flush-to-zero
# (torch.set_flush_denormal, code built with fast-math flags, a GPU's SGEMM), and then
# it errs by up to the smallest normal.  Using the latter keeps the certificate valid
# in both modes, at no measurable cost.
_UNIT_ROUNDOFF = {"float64": 2.0**-53, "float32": 2.0**-24}
_ETA = {"float64": 2.0**-1022, "float32": 2.0**-126}
# Rows per tile: a float64 256 x 256 cross-term block is 512 KiB (fits in L2), and a
# (256 x d) @ (d x 256) GEMM already runs near the BLAS peak.
_DEFAULT_TILE = 256
# Largest centred squared norm the GEMM may see: |x.y| <= max n, far from overflow.
_MAX_NORM2 = {"float64": 1e300, "float32": 1e36}

# Below this many multiply-adds (V^2 d / 2) a call runs on one thread: waking an
# OpenMP team costs more than the work (tests set it to 0 to exercise the merge).
_MIN_PARALLEL_WORK = 1 << 20

# k-NN of float64 rows filters in float32 (half the GEMM time) from this many
# multiply-adds on; rows the float32 certificate cannot settle are redone in float64.
_KNN_MIXED_MIN_WORK = 1 << 26
# The same for the maximum modes (diameter, farthest partners) of float64 rows: the band
# of pairs within the float32 bound of the largest distance is thin, so few pairs are
# refined.  The minimum mode keeps the float64 filter: near-duplicate clusters would
# put many pairs inside the wider float32 band.
_MAX_MIXED_MIN_WORK = 1 << 26

def _gamma(m: int, u: float) -> float:
    return m * u / (1.0 - m * u)


def _rounding_bound(d: int, dtype: str) -> tuple[float, float]:
    """``(c, e_abs)`` with ``|f_ij - r_ij| <= c (n_i + n_j) + e_abs`` (SPEC.md §2).

    ``f_ij = n_i + n_j - 2 fl(x_i . x_j)`` is the filtered squared distance of the
    centred copy stored in ``dtype`` (unit roundoff u), ``n`` its float64 squared
    norms and ``r_ij`` the refined float64 value of the original rows.  Terms:
    GEMM ``gamma_d(u) a`` (any summation order, FMA or not), float64 norms
    ``gamma_d(u64) a``, the epilogue's float64 operations ``4 u64 a``, the
    rounding of the centred copy ``4.01 (u + u64) a`` and of the refined value
    ``2.01 gamma_{d+2}(u64) a``; 1.01 covers second-order terms.  ``16 u64`` more
    covers the rounding of the comparisons in the kernels, and ``e_abs`` (32 d eta,
    eta the smallest normal number) covers underflow in products and the centring,
    with or without flush-to-zero.
    """
    u = _UNIT_ROUNDOFF[dtype]
    if d * u >= 0.1:
        return math.inf, math.inf
    c = 1.01 * (
        _gamma(d, u) + _gamma(d, _U64) + 4 * _U64 + 4.01 * (u + _U64) + 2.01 * _gamma(d + 2, _U64)
    )
    return c + 16 * _U64, 32.0 * d * _ETA[dtype]


def _reported_bound(d: int, dtype: str, max_norm: float) -> float:
    """The certificate's ``error_bound``: ``c * 2 max n + e_abs`` (largest a_ij)."""
    c, eabs = _rounding_bound(d, dtype)
    return c * 2.0 * max_norm + eabs


def _suffix(a) -> str:
    return "32" if a.dtype == np.float32 else "64"


def _kernel_suffix(X, S) -> str:
    """Kernel variant for a centred copy X of the original rows S."""
    return "32s64" if X.dtype == np.float32 and S.dtype == np.float64 else _suffix(X)


def _center(arrays, n_threads, float32_filter=False):
    """Centred copies of ``arrays`` about their common float64 mean.

    Returns ``(originals, centred, norms, dtype_name)``: the originals share one dtype
    (float64 if any input is), and the centred copies are stored in that dtype, or in
    float32 for float64 originals when ``float32_filter`` asks for it; ``dtype_name`` is
    the dtype of the centred copies (the one the rounding bound is for).  float64 is
    used where float32 would overflow or where d is too large for a useful float32 bound.
    """
    ext = _backend.extension()
    arrays = [np.ascontiguousarray(a) for a in arrays]
    dt = np.float64 if any(a.dtype == np.float64 for a in arrays) else np.float32
    d = arrays[0].shape[1]
    f32_ok = math.isfinite(_rounding_bound(d, "float32")[0])
    if dt == np.float32 and not f32_ok:
        dt = np.float64
    arrays = [np.ascontiguousarray(a, dtype=dt) for a in arrays]
    total = sum(a.shape[0] for a in arrays)
    if total * d < _MIN_PARALLEL_WORK:
        n_threads = 1
    mu = sum(np.sum(a, axis=0, dtype=np.float64) for a in arrays) / total
    mixed = float32_filter and dt == np.float64 and f32_ok
    out = []
    for a in arrays:
        X = np.empty(a.shape, dtype=np.float32 if mixed else a.dtype)
        nrm = np.empty(a.shape[0])
        getattr(ext._common, "center" + _kernel_suffix(X, a))(a, mu, X, nrm, n_threads)
        out.append((X, nrm))
    name = "float32" if mixed or dt == np.float32 else "float64"
    if name == "float32" and max(float(n.max()) for _, n in out) > _MAX_NORM2["float32"]:
        return _center([a.astype(np.float64) for a in arrays], n_threads)
    return arrays, [X for X, _ in out], [n for _, n in out], name


def _engine_usable(norms, dtype) -> bool:
    return all(math.isfinite(float(n.max())) and float(n.max()) <= _MAX_NORM2[dtype] for n in norms)


def _refine_pair(S, i, j) -> float:
    A = np.asarray(S[i], dtype=np.float64)
    B = np.asarray(S[j], dtype=np.float64)
    return float(_canonical_sq(np, A, B))


def _diameter_seed(S, X, nrm) -> float:
    """A refined squared distance near the diameter: iterated farthest points, O(V d)."""
    a = int(np.argmax(nrm))
    best = 0.0
    for _ in range(4):
        da = nrm - 2.0 * (X @ X[a]).astype(np.float64)
        b = int(np.argmax(da))
        if b == a:
            break
        best = max(best, _refine_pair(S, a, b))
        a = b
    return best


def _tiles(V, tile_size):
    tile = max(1, min(V, tile_size or _DEFAULT_TILE))
    nt = -(-V // tile)
    return tile, nt


def _effective_threads(n_threads, n_tasks, work):
    if work < _MIN_PARALLEL_WORK:
        return 1
    return max(1, min(n_threads, n_tasks))


def _extreme_pair_cython(S, *, maximise, tile_size, n_threads):
    ext = _backend.extension()
    n = _backend.resolve_n_threads(n_threads)
    V, d = S.shape
    mixed = maximise and V * V * d // 2 >= _MAX_MIXED_MIN_WORK
    (Sc,), (X,), (nrm,), dt = _center([S], n, float32_filter=mixed)
    if not _engine_usable([nrm], dt):
        return _extreme_pair_reference(S, maximise=maximise)
    V, d = Sc.shape
    cp, eabs = _rounding_bound(d, dt)
    tile, nt = _tiles(V, tile_size)
    n_eff = _effective_threads(n, nt * (nt + 1) // 2, V * V * d // 2)
    tile_rmax = np.sqrt(np.maximum.reduceat(nrm, np.arange(0, V, tile)))
    out_r = np.empty(n_eff)
    out_ij = np.empty((n_eff, 2), dtype=np.int64)
    out_nref = np.zeros(n_eff, dtype=np.int64)
    fn = getattr(ext._extreme_pairs, "extreme_pair" + _kernel_suffix(X, Sc))
    with blas_single_thread(n_eff):
        # The seed's matrix-vector products run under the one-thread limit too: a
        # multi-threaded BLAS call just before the kernel leaves BLAS worker threads
        # spinning, and they steal cores from the OpenMP tiles (15% of samples in perf).
        bound0 = _diameter_seed(Sc, X, nrm) if maximise else math.inf
        fn(X, nrm, tile_rmax, Sc, maximise, cp, eabs, bound0, tile, n_eff, out_r, out_ij, out_nref)
    best = None
    for t in range(n_eff):
        i, j = int(out_ij[t, 0]), int(out_ij[t, 1])
        if i < V and _better(float(out_r[t]), i, j, best, maximise):
            best = (float(out_r[t]), i, j)
    v, i, j = best
    return math.sqrt(v), i, j, _reported_bound(d, dt, float(nrm.max())), int(out_nref.sum())


def _diameter_cython(S, *, tile_size=None, n_threads=None):
    return _extreme_pair_cython(S, maximise=True, tile_size=tile_size, n_threads=n_threads)


def _closest_cython(S, *, tile_size=None, n_threads=None):
    return _extreme_pair_cython(S, maximise=False, tile_size=tile_size, n_threads=n_threads)


def _farthest_cython(S, *, tile_size=None, n_threads=None):
    ext = _backend.extension()
    n = _backend.resolve_n_threads(n_threads)
    V, d = S.shape
    (Sc,), (X,), (nrm,), dt = _center([S], n, float32_filter=V * V * d // 2 >= _MAX_MIXED_MIN_WORK)
    if not _engine_usable([nrm], dt):
        return _farthest_reference(S)
    V, d = Sc.shape
    cp, eabs = _rounding_bound(d, dt)
    tile, nt = _tiles(V, tile_size)
    n_eff = _effective_threads(n, nt * (nt + 1) // 2, V * V * d // 2)
    L = np.full((n_eff, V), -np.inf)
    B = np.full((n_eff, V), -np.inf)
    Bj = np.full((n_eff, V), V, dtype=np.int64)
    nref = np.zeros(n_eff, dtype=np.int64)
    fn = getattr(ext._extreme_pairs, "farthest_partners" + _kernel_suffix(X, Sc))
    with blas_single_thread(n_eff):
        fn(X, nrm, Sc, cp, eabs, tile, n_eff, L, B, Bj, nref)
    r, j = B[0].copy(), Bj[0].copy()
    for t in range(1, n_eff):
        better = (B[t] > r) | ((B[t] == r) & (Bj[t] < j))
        r = np.where(better, B[t], r)
        j = np.where(better, Bj[t], j)
    return j, np.sqrt(r), _reported_bound(d, dt, float(nrm.max())), int(nref.sum())


def _knn_pass(fn, XA, nA, SA, XB, nB, SB, *, symmetric, exclude_self, self_idx, defer, k, dt,
              tile_size, n):
    """One run of a compiled k-NN kernel; returns (indices, distances, stats)."""
    nA_rows, d = SA.shape
    nB_rows = SB.shape[0]
    excluded = int(symmetric and exclude_self) if symmetric else int(np.any(self_idx >= 0))
    n_cand = nB_rows - excluded
    cp, eabs = _rounding_bound(d, dt)
    # heap size: k plus slack, so that the certificate usually holds from the heap alone
    K = min(n_cand, k + max(8, k // 2))
    tile = max(1, min(max(nA_rows, nB_rows), tile_size or _DEFAULT_TILE))
    ntA, ntB = -(-nA_rows // tile), -(-nB_rows // tile)
    npairs = ntA * (ntA + 1) // 2 if symmetric else ntA * ntB
    n_eff = _effective_threads(n, npairs, nA_rows * nB_rows * d // (2 if symmetric else 1))
    keys = np.full((n_eff, nA_rows, K), np.inf)
    ids = np.full((n_eff, nA_rows, K), -1, dtype=np.int64)
    out_idx = np.empty((nA_rows, k), dtype=np.int64)
    out_dist = np.empty((nA_rows, k))
    stats = np.zeros(2, dtype=np.int64)
    with blas_single_thread(n_eff):
        fn(XA, nA, SA, XB, nB, SB, symmetric, exclude_self, self_idx, defer, k, cp, eabs, tile,
           n_eff, keys, ids, out_idx, out_dist, stats)
    return out_idx, out_dist, stats


def _knn_cython(X, k, Y, *, exclude_self, tile_size=None, n_threads=None):
    ext = _backend.extension()
    n = _backend.resolve_n_threads(n_threads)
    symmetric = Y is None
    arrays = [X] if symmetric else [X, Y]
    # float64 rows with enough work are filtered through a float32 centred copy (half
    # the GEMM time); _center falls back to float64 where float32 cannot hold them.
    # The float64 centred copy is then made only if some row needs it (below): at
    # N = 50000, d = 768 it is 300 MB that the common case never reads.
    want_mixed = (
        any(a.dtype == np.float64 for a in arrays)
        and X.shape[0] * arrays[-1].shape[0] * X.shape[1] >= _KNN_MIXED_MIN_WORK
    )
    origs, cents, norms, dt = _center(arrays, n, float32_filter=want_mixed)
    if not _engine_usable(norms, dt):
        return _knn_reference(X, k, Y, exclude_self=exclude_self)
    SA = origs[0]
    SB = SA if symmetric else origs[1]
    d = SA.shape[1]
    XA, nA = cents[0], norms[0]
    XB, nB = (XA, nA) if symmetric else (cents[1], norms[1])
    mixed = SA.dtype == np.float64 and XA.dtype == np.float32
    no_self = np.full(SA.shape[0], -1, dtype=np.int64)
    idx, dist, stats = _knn_pass(
        getattr(ext._knn, "knn" + _kernel_suffix(XA, SA)), XA, nA, SA, XB, nB, SB,
        symmetric=symmetric, exclude_self=exclude_self, self_idx=no_self, defer=mixed, k=k,
        dt=dt, tile_size=tile_size, n=n,
    )
    n_refined = int(stats[1])
    if mixed and stats[0] > 0:
        # rows the float32 certificate cannot settle are redone against every
        # candidate with a float64 filter (same mean, so the same centred rows)
        _, cents64, norms64, _ = _center(arrays, n)
        F = np.flatnonzero(idx[:, 0] < 0)
        XB64, nB64 = (cents64[0], norms64[0]) if symmetric else (cents64[1], norms64[1])
        self_idx = F.astype(np.int64) if (symmetric and exclude_self) else np.full(F.size, -1, np.int64)
        sub_idx, sub_dist, sub_stats = _knn_pass(
            ext._knn.knn64, np.ascontiguousarray(cents64[0][F]), np.ascontiguousarray(norms64[0][F]),
            np.ascontiguousarray(SA[F]), XB64, nB64, SB, symmetric=False, exclude_self=False,
            self_idx=self_idx, defer=False, k=k, dt="float64", tile_size=tile_size, n=n,
        )
        idx[F] = sub_idx
        dist[F] = sub_dist
        n_refined += int(sub_stats[1])
    return idx, dist, _reported_bound(d, dt, float(max(nA.max(), nB.max()))), n_refined


# --------------------------------------------------------------------------- dispatch

# CuPy arrays run the same certified algorithm written against the array API.
from . import _tiled  # noqa: E402  (needs the helpers above)

_DIAMETER = _backend.KernelInfo(
    name="row_diameter", reference=_diameter_reference, cython=_diameter_cython, cupy=_tiled.diameter
)
_CLOSEST = _backend.KernelInfo(
    name="closest_pair", reference=_closest_reference, cython=_closest_cython, cupy=_tiled.closest
)
_FARTHEST = _backend.KernelInfo(
    name="farthest_partners", reference=_farthest_reference, cython=_farthest_cython, cupy=_tiled.farthest
)
_KNN = _backend.KernelInfo(name="knn", reference=_knn_reference, cython=_knn_cython, cupy=_tiled.knn)


def _check_rows(S, name="S", min_rows=2):
    S = as_float_array(S, name, ndim=2, shape_hint="2-D array of shape (V, d)")
    check_min_rows(S, name, min_rows)
    return S


def _tile_option(tile_size):
    return check_int(tile_size, "tile_size", min_value=1, allow_none=True)


def _threads_option(n_threads):
    return check_int(n_threads, "n_threads", min_value=1, allow_none=True)


def _extreme_pair(info, S, tile_size, n_threads) -> ExtremePair:
    S = _check_rows(S)
    tile_size = _tile_option(tile_size)
    n_threads = _threads_option(n_threads)
    backend, fn = _backend.dispatch(info, S)
    value, i, j, bound, n_refined = fn(S, tile_size=tile_size, n_threads=n_threads)
    return ExtremePair(
        value=float(value),
        i=int(i),
        j=int(j),
        error_bound=float(bound),
        backend=backend,
        dtype=_dtype_name(S),
        n_refined=int(n_refined),
    )


# --------------------------------------------------------------------------- public API


def row_diameter(S: Any, /, *, tile_size: int | None = None, n_threads: int | None = None) -> ExtremePair:
    r"""Certified row diameter :math:`D(S) = \max_{i<j} \lVert s_i - s_j \rVert_2`.

    Parameters
    ----------
    S : array_like of shape (V, d)
        Finite rows, ``V >= 2``.  float32 and float64 are kept; integer and boolean
        inputs are converted to float64.
    tile_size : int, default=None
        Rows per tile of the compiled engine (chosen from ``d`` and the cache when
        None).  Never changes the value or the pair.
    n_threads : int, default=None
        Threads of the compiled engine (all OpenMP threads when None).  Never changes
        the value or the pair.

    Returns
    -------
    pair : ExtremePair
        ``value`` = D(S), the pair ``(i, j)`` (``i < j``; the lexicographically
        smallest among ties), the rounding bound used and the number of refined pairs.

    Notes
    -----
    .. math:: D(S) = \max_{i<j} \lVert s_i - s_j \rVert_2

    A seminorm: :math:`D(S + \mathbf{1}a^\top) = D(S)`, :math:`D(\alpha S) = |\alpha| D(S)`,
    :math:`D(SQ) = D(S)` for orthogonal Q, invariant to row permutations, and
    :math:`D(S) \le \sqrt{2}\lVert S \rVert_2`.  By the forward-size theorem,
    :math:`\sup_{\lVert h \rVert \le H} \lVert S h \rVert_{var} = H D(S)`.

    Time O(V^2 d); the compiled engine uses one BLAS GEMM per tile pair (extra memory
    O(b^2 p) for tile size b and p threads, never V x V); the reference evaluates every
    pair by direct differences in blocks of bounded memory.

    Certification (compiled engine).  Rows are centred, :math:`x_i = s_i - \mu`, and
    stored in the input dtype with unit roundoff u (:math:`2^{-53}` or :math:`2^{-24}`);
    the filter value is :math:`f_{ij} = n_i + n_j - 2\,\mathrm{fl}(x_i^\top x_j)` with
    float64 norms :math:`n_i`.  With :math:`\gamma_m = m u/(1 - m u)` and
    :math:`a_{ij} = n_i + n_j`, the a-priori bound

    .. math:: |f_{ij} - r_{ij}| \le c(d, u)\, a_{ij}, \quad
              c = 1.01\,[\gamma_d(u) + \gamma_d(u_{64}) + 4 u_{64} + 4.01 (u + u_{64})
              + 2.01\,\gamma_{d+2}(u_{64})]

    covers the GEMM (:math:`2\gamma_d \lvert x_i\rvert^\top\lvert x_j\rvert \le \gamma_d a_{ij}`,
    for any summation order, with or without FMA), the norms, the epilogue's float64
    operations, the rounding of the centred copy and the rounding of the refined value
    itself (SPEC.md §2, "Exact means certified"); the kernels add :math:`16 u_{64}` to
    c for the rounding of their own comparisons and an absolute
    :math:`32\, d\, \eta` (:math:`\eta` the smallest normal number of the dtype, so that
    the bound also holds when another library has switched on flush-to-zero) for
    underflow.  A pair is dropped only when its filtered value proves it cannot reach
    or tie an already certified value; every other pair is refined, so the result
    equals the reference's for every tile size and thread count.  The reported
    ``error_bound`` is :math:`c \cdot \max_{ij} a_{ij} + 32 d \eta`.  A float32 input
    whose squared norms would overflow the GEMM is filtered in float64.  Large float64
    inputs (:math:`V^2 d / 2 \ge 2^{26}`) are filtered through a float32 centred copy
    (float32 GEMM at about twice the float64 rate, the float32 bound) and refined from
    the float64 rows: the same certified value and pair in about half the time.  The
    closest pair keeps the float64 filter (near-duplicate clusters would fill the wider
    float32 band with candidates).

    Exact means: equal to the refined float64 values of the rows as given.  Rows whose
    squared differences leave the normal float64 range (entries below about 1e-154 or
    above about 1e154) have refined values that underflow or overflow, and every
    backend reports those; rescale such rows by a power of two first (exact, and D
    scales back exactly).  :func:`refgeo.spread` does this for its ``eta``.

    References
    ----------
    .. [1] LM-head update geometry, arXiv:2608.22253.

    Examples
    --------
    >>> import numpy as np, refgeo
    >>> S = np.array([[0.0, 0.0], [3.0, 4.0], [1.0, 1.0]])
    >>> r = refgeo.row_diameter(S)
    >>> r.value, r.i, r.j
    (5.0, 0, 1)
    """
    return _extreme_pair(_DIAMETER, S, tile_size, n_threads)


def closest_pair(S: Any, /, *, tile_size: int | None = None, n_threads: int | None = None) -> ExtremePair:
    r"""Certified closest pair :math:`m(S) = \min_{i<j} \lVert s_i - s_j \rVert_2`.

    Parameters
    ----------
    S : array_like of shape (V, d)
        Finite rows, ``V >= 2`` (float32/float64 kept, integers converted to float64).
    tile_size : int, default=None
        Rows per tile of the compiled engine; never changes the result.
    n_threads : int, default=None
        Threads of the compiled engine; never changes the result.

    Returns
    -------
    pair : ExtremePair
        ``value`` = m(S) (0 for duplicate rows), the pair ``(i, j)``, ``i < j``, the
        lexicographically smallest among ties.

    Notes
    -----
    .. math:: m(S) = \min_{i<j} \lVert s_i - s_j \rVert_2

    Invariant under translation, orthogonal maps and row permutation; scales with
    :math:`|\alpha|`.  Time O(V^2 d).  Certified exactly as :func:`row_diameter`: the
    filter keeps every pair within the rounding bound of the running minimum, so near
    duplicates (relative distance 1e-12) and exact duplicates are resolved by float64
    direct differences; on pathological clusters many pairs are refined (slow, still
    exact).

    References
    ----------
    .. [1] LM-head update geometry, arXiv:2608.22253.

    Examples
    --------
    >>> import numpy as np, refgeo
    >>> r = refgeo.closest_pair(np.array([[0.0, 0.0], [3.0, 4.0], [3.0, 5.0]]))
    >>> r.value, r.i, r.j
    (1.0, 1, 2)
    """
    return _extreme_pair(_CLOSEST, S, tile_size, n_threads)


def distance_ratio(S: Any, /, *, tile_size: int | None = None, n_threads: int | None = None) -> float:
    r"""Distance ratio :math:`\rho(S) = m(S) / D(S) \in [0, 1]`.

    Parameters
    ----------
    S : array_like of shape (V, d)
        Finite rows with at least two distinct rows.
    tile_size, n_threads : int, default=None
        Passed to :func:`closest_pair` and :func:`row_diameter`.

    Returns
    -------
    rho : float
        ``closest_pair(S).value / row_diameter(S).value`` (both certified).

    Raises
    ------
    ValueError
        When all rows coincide (``D(S) = 0``: the ratio is undefined).

    Notes
    -----
    .. math:: \rho(S) = \frac{\min_{i<j} \lVert s_i - s_j \rVert}{\max_{i<j} \lVert s_i - s_j \rVert}

    Its inverse is the condition number of the row cloud.  Invariant under
    translation, scaling, orthogonal maps and permutations.  Time O(V^2 d).  The
    regular simplex attains 1.

    References
    ----------
    .. [1] LM-head update geometry, arXiv:2608.22253.

    Examples
    --------
    >>> import numpy as np, refgeo
    >>> refgeo.distance_ratio(np.array([[0.0], [1.0], [3.0]]))
    0.3333333333333333
    """
    S = _check_rows(S)
    D = row_diameter(S, tile_size=tile_size, n_threads=n_threads).value
    if D == 0.0:
        raise ValueError(
            "S must have at least two distinct rows for the distance ratio, got all rows equal instead."
        )
    return closest_pair(S, tile_size=tile_size, n_threads=n_threads).value / D


def farthest_partners(
    S: Any, /, *, tile_size: int | None = None, n_threads: int | None = None
) -> FarthestPartners:
    r"""For every row, the farthest other row.

    Parameters
    ----------
    S : array_like of shape (V, d)
        Finite rows, ``V >= 2``.
    tile_size, n_threads : int, default=None
        Engine options; never change the result.

    Returns
    -------
    fp : FarthestPartners
        ``indices`` (int64, shape (V,)): :math:`\arg\max_{j \ne i} \lVert s_i - s_j \rVert`
        with ties to the smallest ``j``; ``distances`` (float64, shape (V,)).

    Notes
    -----
    .. math:: \phi(i) = \arg\max_{j \ne i} \lVert s_i - s_j \rVert_2

    The maximum of ``distances`` is :math:`D(S)`.  The Frank-Wolfe vertex of the
    min-tension LMO (SPEC §3) is a farthest pair.  Time O(V^2 d); distances are refined
    float64 values, certified as in :func:`row_diameter` (large float64 inputs are
    filtered in float32 there too).

    References
    ----------
    .. [1] LM-head update geometry, arXiv:2608.22253.

    Examples
    --------
    >>> import numpy as np, refgeo
    >>> fp = refgeo.farthest_partners(np.array([[0.0], [1.0], [3.0]]))
    >>> fp.indices.tolist(), fp.distances.tolist()
    ([2, 2, 0], [3.0, 2.0, 3.0])
    """
    S = _check_rows(S)
    tile_size = _tile_option(tile_size)
    n_threads = _threads_option(n_threads)
    _, fn = _backend.dispatch(_FARTHEST, S)
    idx, dist, _bound, _n = fn(S, tile_size=tile_size, n_threads=n_threads)
    return FarthestPartners(indices=_readonly(idx), distances=_readonly(dist))


def knn(
    X: Any,
    k: int,
    /,
    Y: Any = None,
    *,
    exclude_self: bool = True,
    tile_size: int | None = None,
    n_threads: int | None = None,
) -> KNNResult:
    r"""Exact k nearest neighbours (Euclidean) of every row of ``X`` among the rows of ``Y``.

    Parameters
    ----------
    X : array_like of shape (n, d)
        Query rows (finite; float32/float64 kept, integers converted to float64).
    k : int
        Number of neighbours, ``1 <= k <= number of candidates`` (``n_Y``, or ``n - 1``
        when ``Y`` is None and ``exclude_self``).
    Y : array_like of shape (n_Y, d), default=None
        Candidate rows; None means ``X`` itself.
    exclude_self : bool, default=True
        When ``Y`` is None, row ``i`` is not its own neighbour (leave-one-out; exact
        duplicates of row ``i`` still are).  Ignored when ``Y`` is given.
    tile_size, n_threads : int, default=None
        Engine options; never change the result.

    Returns
    -------
    result : KNNResult
        ``indices`` (int64, shape (n, k)) and ``distances`` (float64, shape (n, k)),
        ascending; equal squared distances are ordered by the smaller index.

    Notes
    -----
    .. math:: N_k(i) = \operatorname{arg\,min}^{(k)}_{j} \lVert x_i - y_j \rVert_2

    Time O(n n_Y d) (half of it for X against X: each pair's GEMM entry serves both
    rows), extra memory O(n K p + b^2 p) in the compiled engine for K = k + max(8, k/2)
    heap entries per row and thread.  Per-row heaps of filtered values are kept in
    the GEMM epilogue; a row is certified when every pair left out of its heap has a
    filtered value beyond the rounding bound (see :func:`row_diameter`) of its k-th
    upper bound, and then every kept pair within that bound is refined in float64;
    an uncertified row is redone against all candidates.  So the answer is the exact
    one even where a float32 Gram-trick answer is wrong.  Large float64 inputs are
    filtered in float32 (half the GEMM time; the float32 bound is used) and the rows
    it cannot certify are redone with a float64 filter.  Invariant under a common
    translation, orthogonal maps and scaling of ``X`` and ``Y``.

    References
    ----------
    .. [1] Tokenwise decomposition of layer updates, arXiv:2604.02459.

    Examples
    --------
    >>> import numpy as np, refgeo
    >>> r = refgeo.knn(np.array([[0.0], [1.0], [3.0]]), 1)
    >>> r.indices.tolist(), r.distances.tolist()
    ([[1], [0], [1]], [[1.0], [1.0], [2.0]])
    """
    X = as_float_array(X, "X", ndim=2, shape_hint="2-D array of shape (n, d)")
    if Y is not None:
        Y = as_float_array(Y, "Y", ndim=2, shape_hint="2-D array of shape (n_Y, d)")
        check_same_trailing(X, Y, ("X", "Y"))
    exclude_self = check_bool(exclude_self, "exclude_self")
    n_cand = (X.shape[0] - int(exclude_self)) if Y is None else Y.shape[0]
    if n_cand < 1:
        raise ValueError(
            f"X must have at least 2 rows for k-NN with exclude_self=True, got shape {tuple(X.shape)} instead."
        )
    k = check_int(k, "k", min_value=1, max_value=n_cand)
    tile_size = _tile_option(tile_size)
    n_threads = _threads_option(n_threads)
    _, fn = _backend.dispatch(_KNN, X, Y)
    idx, dist, _bound, _n = fn(X, k, Y, exclude_self=exclude_self, tile_size=tile_size, n_threads=n_threads)
    return KNNResult(indices=_readonly(idx), distances=_readonly(dist))


# --------------------------------------------------------------------------- covering radius


def _to_numpy(x):
    """A NumPy view/copy of an array-API array (DLPack; CuPy goes through the host)."""
    if is_numpy_array(x):
        return x
    if hasattr(x, "get"):  # CuPy
        return x.get()
    return np.from_dlpack(x)


def _meb_eval(X, lam):
    """Centre, squared distances to it and the dual value for weights ``lam``."""
    c = lam @ X
    r2 = np.sum((X - c) ** 2, axis=1)
    return c, r2, float(lam @ r2)


def covering_radius(S: Any, /, *, tol: float = 1e-10, max_iter: int = 100_000) -> EnclosingBall:
    r"""Minimum enclosing ball of the rows, with a certified lower bound.

    Parameters
    ----------
    S : array_like of shape (V, d)
        Finite rows, ``V >= 1``.
    tol : float, default=1e-10
        Relative gap at which to stop: ``radius - lower_bound <= tol * radius``.
    max_iter : int, default=100000
        Iteration cap of the Frank-Wolfe solver (the certificate holds at any stop).

    Returns
    -------
    ball : EnclosingBall
        ``radius`` (upper bound, attained by ``centre``), ``lower_bound`` (certified by
        the dual ``weights``), ``centre``, ``weights`` and ``n_iter``.

    Notes
    -----
    .. math:: \mathrm{rad}(S) = \min_c \max_i \lVert s_i - c \rVert_2
              = \max_{w \in \Delta} \Big(\sum_i w_i \lVert s_i - \bar s_w \rVert^2\Big)^{1/2}

    Solved on the dual by Frank-Wolfe with away steps on the simplex (Yildirim) in
    float64 on centred rows, polished every 50 iterations by solving for the
    circumcentre of the support set in its affine hull (accepted only when its
    barycentric weights are non-negative and no point lies outside).  Any weights give
    the lower bound and any centre the upper bound, so ``lower_bound <= rad(S) <=
    radius`` whenever the solver stops (up to the float64 rounding of the two
    evaluations).  Bounds: :math:`D/2 \le \mathrm{rad} \le J_k D`
    (:func:`jung_constant`, k the rank of the centred rows), the regular simplex
    attaining the upper end.  Time O(V d) per iteration, extra memory O(V d) (a
    float64 copy).  Invariant under translation (the centre moves along), orthogonal
    maps and permutations; scales with :math:`|\alpha|`.  Computed with NumPy for
    every input namespace; the centre and weights are returned in the input's.

    References
    ----------
    .. [1] LM-head update geometry, arXiv:2608.22253.
    .. [2] E. A. Yildirim, Two algorithms for the minimum enclosing ball problem,
       SIAM J. Optim. 19 (2008).

    Examples
    --------
    >>> import numpy as np, refgeo
    >>> ball = refgeo.covering_radius(np.array([[0.0, 0.0], [2.0, 0.0], [1.0, 0.5]]))
    >>> ball.radius, ball.centre.tolist()
    (1.0, [1.0, 0.0])
    """
    S = _check_rows(S, min_rows=1)
    tol = check_real(tol, "tol", min_value=0.0)
    max_iter = check_int(max_iter, "max_iter", min_value=0)
    xp = array_namespace(S)
    X0 = np.asarray(_to_numpy(S), dtype=np.float64)
    V = X0.shape[0]
    mu = X0.mean(axis=0)
    X = X0 - mu
    # start: the point a farthest from the mean and the point b farthest from a
    a = int(np.argmax(np.sum(X * X, axis=1)))
    b = int(np.argmax(np.sum((X - X[a]) ** 2, axis=1)))
    lam = np.zeros(V)
    lam[a] += 0.5
    lam[b] += 0.5
    c, r2, phi = _meb_eval(X, lam)
    n_iter = 0
    while n_iter < max_iter:
        far = int(np.argmax(r2))
        R2 = float(r2[far])
        if R2 == 0.0 or math.sqrt(R2) - math.sqrt(max(phi, 0.0)) <= tol * math.sqrt(R2):
            break
        n_iter += 1
        if n_iter % 50 == 0:
            pol = _meb_polish(X, lam)
            if pol is not None:
                lam = pol
                c, r2, phi = _meb_eval(X, lam)
                continue
        # Frank-Wolfe step toward `far`, or away step from the support point `near`,
        # with exact line search on the concave dual phi(w) = sum w_i |x_i|^2 - |X^T w|^2.
        near = int(np.argmin(np.where(lam > 0, r2, np.inf)))
        gap_fw = R2 - phi
        gap_aw = phi - float(r2[near])
        if gap_fw >= gap_aw:
            u = X[far] - c
            uu = float(u @ u)
            t = 1.0 if uu == 0.0 else min(1.0, gap_fw / (2.0 * uu))
            lam *= 1.0 - t
            lam[far] += t
        else:
            u = c - X[near]
            uu = float(u @ u)
            t_max = lam[near] / (1.0 - lam[near]) if lam[near] < 1.0 else 0.0
            t = t_max if uu == 0.0 else min(t_max, gap_aw / (2.0 * uu))
            lam *= 1.0 + t
            lam[near] -= t
            if t == t_max:
                lam[near] = 0.0
        lam = np.maximum(lam, 0.0)
        lam /= lam.sum()
        c, r2, phi = _meb_eval(X, lam)
    pol = _meb_polish(X, lam)
    if pol is not None:
        lam = pol
        c, r2, phi = _meb_eval(X, lam)
    R = math.sqrt(float(r2.max()))
    lower = min(math.sqrt(max(phi, 0.0)), R)
    centre = c + mu
    if not is_numpy_array(S):
        centre = xp.asarray(centre, dtype=xp.float64)
        lam = xp.asarray(lam, dtype=xp.float64)
    return EnclosingBall(radius=R, centre=_readonly(centre), lower_bound=lower, weights=_readonly(lam), n_iter=n_iter)


def _meb_polish(X, lam):
    """Weights of the circumcentre of the support set, if valid; otherwise None."""
    supp = np.flatnonzero(lam > 1e-14 * lam.max())
    P = X[supp]
    m = supp.size
    # centre c = P^T w with 1^T w = 1 and |p_t - c|^2 equal for all t:
    # 2 G w + z 1 = diag(G), 1^T w = 1, with G = P P^T and z a free offset.
    G = P @ P.T
    A = np.zeros((m + 1, m + 1))
    A[:m, :m] = 2.0 * G
    A[:m, m] = 1.0
    A[m, :m] = 1.0
    rhs = np.concatenate([np.diag(G), [1.0]])
    sol = np.linalg.lstsq(A, rhs, rcond=None)[0]
    w = sol[:m]
    if not np.all(np.isfinite(w)) or np.any(w < -1e-12) or w.sum() <= 0:
        return None
    w = np.maximum(w, 0.0)
    w /= w.sum()
    lam2 = np.zeros_like(lam)
    lam2[supp] = w
    c, r2, phi = _meb_eval(X, lam2)
    if float(r2.max()) > phi * (1.0 + 1e-12):
        return None  # a point lies outside: the support set is not final
    return lam2


# --------------------------------------------------------------------------- small identities


def jung_constant(k: int) -> float:
    r"""Jung's constant :math:`J_k = \sqrt{k / (2(k+1))}`.

    Parameters
    ----------
    k : int
        Dimension (rank of the centred rows), ``k >= 0``.

    Returns
    -------
    J : float
        The smallest J with :math:`\mathrm{rad}(S) \le J\, D(S)` for every S of rank k.

    Notes
    -----
    .. math:: J_k = \sqrt{\frac{k}{2(k+1)}}

    Increases from 0 (k = 0) to :math:`1/\sqrt{2}`; attained by the regular simplex.
    O(1).

    References
    ----------
    .. [1] LM-head update geometry, arXiv:2608.22253.

    Examples
    --------
    >>> import refgeo
    >>> refgeo.jung_constant(1), refgeo.jung_constant(3)
    (0.5, 0.6123724356957945)
    """
    k = check_int(k, "k", min_value=0)
    return math.sqrt(k / (2.0 * (k + 1)))


def worst_case_hidden_state(S: Any, /, *, H: float = 1.0) -> WorstCaseHiddenState:
    r"""The hidden state of norm H that maximises :math:`\lVert S h \rVert_{var}`.

    Parameters
    ----------
    S : array_like of shape (V, d)
        Finite update rows, ``V >= 2``.
    H : float, default=1.0
        Radius of the hidden-state ball, ``H >= 0``.

    Returns
    -------
    worst : WorstCaseHiddenState
        ``value`` = H D(S), ``h`` (float64, shape (d,)) and the diameter pair.

    Notes
    -----
    .. math:: \sup_{\lVert h \rVert \le H} d_H(\mathrm{softmax}(Wh), \mathrm{softmax}((W+S)h))
              = \sup_{\lVert h \rVert \le H} \lVert S h \rVert_{var} = H\, D(S),

    attained at :math:`h^* = H (s_a - s_b)/\lVert s_a - s_b \rVert`, independently of W.
    Time O(V^2 d) (one certified diameter).

    References
    ----------
    .. [1] LM-head update geometry, arXiv:2608.22253.

    Examples
    --------
    >>> import numpy as np, refgeo
    >>> w = refgeo.worst_case_hidden_state(np.array([[0.0, 0.0], [3.0, 4.0]]), H=5.0)
    >>> w.value, w.h.tolist()
    (25.0, [-3.0, -4.0])
    """
    S = _check_rows(S)
    H = check_real(H, "H", min_value=0.0)
    pair = row_diameter(S)
    xp = array_namespace(S)
    X = _f64(xp, S)
    if pair.value == 0.0:
        h = xp.zeros((X.shape[1],), dtype=xp.float64)
    else:
        h = (X[pair.i, :] - X[pair.j, :]) * (H / pair.value)
    return WorstCaseHiddenState(value=H * pair.value, h=_readonly(h), i=pair.i, j=pair.j)


def hilbert_rms(S: Any, hidden: Any, /) -> float:
    r"""Hilbert RMS of a step over a panel of hidden states.

    Parameters
    ----------
    S : array_like of shape (V, d)
        Update rows.
    hidden : array_like of shape (N, d) or (d,)
        Hidden states :math:`h_1, \dots, h_N`.

    Returns
    -------
    rms : float
        :math:`\sqrt{\tfrac1N \sum_t \delta_t^2}` with :math:`\delta_t = \lVert S h_t \rVert_{var}`.

    Notes
    -----
    .. math:: \mathrm{RMS} = \Big(\frac1N \sum_{t=1}^N \lVert S h_t \rVert_{var}^2\Big)^{1/2}
              \le \max_t \lVert h_t \rVert \, D(S)

    :math:`\delta_t` is the Hilbert distance between the output distributions before and
    after the step at :math:`h_t`, for any W.  Products and squared ranges accumulate in
    float64; time O(N V d), extra memory O(V b) for blocks of b hidden states.
    Invariant under a common shift of the rows of S.

    References
    ----------
    .. [1] LM-head update geometry, arXiv:2608.22253.

    Examples
    --------
    >>> import numpy as np, refgeo
    >>> S = np.array([[0.0, 0.0], [3.0, 4.0]])
    >>> refgeo.hilbert_rms(S, np.array([[1.0, 0.0], [0.0, 1.0]]))
    3.5355339059327378
    """
    S = as_float_array(S, "S", ndim=2, shape_hint="2-D array of shape (V, d)")
    hidden = as_float_array(hidden, "hidden", ndim=(1, 2))
    xp = array_namespace(S, hidden)
    Hm = _f64(xp, hidden)
    if Hm.ndim == 1:
        Hm = xp.expand_dims(Hm, axis=0)
    check_same_trailing(S, Hm, ("S", "hidden"), "number of columns (hidden width d)")
    X = _f64(xp, S)
    N, V = Hm.shape[0], X.shape[0]
    b = max(1, _REF_ROW_ELEMENTS // max(V, 1))
    total = 0.0
    for t0 in range(0, N, b):
        Z = Hm[t0 : t0 + b, :] @ xp.permute_dims(X, (1, 0))
        delta = xp.max(Z, axis=1) - xp.min(Z, axis=1)
        total += float(xp.sum(delta * delta))
    return math.sqrt(total / N)


def backward_bound(S: Any, r: Any, /):
    r"""Bound on the backward signal: :math:`\lVert S^\top r \rVert_2 \le \tfrac12 D(S) \lVert r \rVert_1`.

    Parameters
    ----------
    S : array_like of shape (V, d)
        Update rows, ``V >= 2``.
    r : array_like of shape (V,) or (n, V)
        Residual vectors with zero sum (e.g. ``p - e_c`` for cross-entropy).

    Returns
    -------
    bound : float or ndarray of shape (n,)
        :math:`\tfrac12 D(S) \lVert r \rVert_1` per residual.

    Raises
    ------
    ValueError
        When a residual does not sum to zero (relative tolerance 1e-10 of its
        :math:`\ell_1` norm): the bound needs :math:`\mathbf{1}^\top r = 0`.

    Notes
    -----
    .. math:: \lVert S^\top r \rVert_2 \le \frac{D(S)}{2} \lVert r \rVert_1
              \quad (\mathbf{1}^\top r = 0),

    with equality at :math:`r = e_a - e_b` for a diameter pair (a, b); for
    cross-entropy :math:`r = p - e_c` it reads :math:`D(S)(1 - p_c)`.  Time O(V^2 d)
    for the certified diameter plus O(n V).

    References
    ----------
    .. [1] LM-head update geometry, arXiv:2608.22253.

    Examples
    --------
    >>> import numpy as np, refgeo
    >>> S = np.array([[0.0, 0.0], [3.0, 4.0]])
    >>> refgeo.backward_bound(S, np.array([1.0, -1.0]))
    5.0
    """
    S = _check_rows(S)
    r = as_float_array(r, "r", ndim=(1, 2))
    if r.shape[-1] != S.shape[0]:
        raise ValueError(
            f"r must have {S.shape[0]} entries per residual (one per row of S), got shape "
            f"{tuple(r.shape)} instead."
        )
    xp = array_namespace(S, r)
    r64 = _f64(xp, r)
    l1 = xp.sum(xp.abs(r64), axis=-1)
    tot = xp.abs(xp.sum(r64, axis=-1))
    if bool(xp.any(tot > 1e-10 * l1)):
        worst = float(xp.max(tot))
        raise ValueError(
            f"r must sum to zero along its last axis (1^T r = 0), got |sum| up to {worst:.3e} instead."
        )
    D = row_diameter(S).value
    out = 0.5 * D * l1
    if out.ndim == 0:
        return float(out)
    return out
