"""Certification algebra shared by every pairwise backend (see :doc:`/theory/rows`).

Everything a backend needs to return the *same* certified answer as every other:

* unit roundoffs :data:`UNIT_ROUNDOFF`, smallest normal numbers :data:`ETA`,
  :func:`gamma` (:math:`\\gamma_m = m u / (1 - m u)`);
* the a-priori rounding bound of the Gram-expansion filter, :func:`rounding_bound`,
  and the bound a result reports, :func:`reported_bound`;
* :func:`canonical_sq`, the refined float64 squared distance in its one fixed
  summation order (shared bit for bit with ``refgeo_ext/src/refine.h``);
* :func:`better`, the one tie rule;
* the power-of-two prescaling that brings every finite input into the range where
  squared distances neither overflow nor underflow (:func:`scale_exponent`,
  :func:`scale_rows`, :func:`unscale`).

This module imports nothing from refgeo: the reference, the compiled-engine wrappers
and the array-API engine all build on it, and it on none of them.
"""

from __future__ import annotations

import contextlib
import math
import sys

import numpy as np
from array_api_compat import is_cupy_array

__all__ = [
    "ETA",
    "MAX_NORM2",
    "MIN_NORM2_FLOAT32",
    "SCALE_FREE_EXPONENT",
    "U64",
    "UNIT_ROUNDOFF",
    "best_pair",
    "better",
    "canonical_sq",
    "compensated_sums",
    "dtype_name",
    "f64",
    "float32_bits_to_float64",
    "gamma",
    "lowered_key_bound",
    "reported_bound",
    "rounding_bound",
    "scale_exponent",
    "scale_exponent_of",
    "scale_rows",
    "scale_rows_inplace",
    "scaled_row_norms",
    "unscale",
    "unscale_array",
]

U64 = 2.0**-53
# unit roundoff u and smallest *normal* number eta of the dtype the centered copy is
# stored in.  With gradual underflow an underflowing operation errs by at most half the
# smallest subnormal; a library elsewhere in the process may switch on flush-to-zero
# (torch.set_flush_denormal, code built with fast-math flags, a GPU's SGEMM), and then
# it errs by up to the smallest normal.  Using the latter keeps the certificate valid
# in both modes, at no measurable cost.
UNIT_ROUNDOFF = {"float64": 2.0**-53, "float32": 2.0**-24}
ETA = {"float64": 2.0**-1022, "float32": 2.0**-126}
# Largest centered squared norm the GEMM may see: |x.y| <= max n, far from overflow.
MAX_NORM2 = {"float64": 1e300, "float32": 1e36}
# Rows whose largest centered squared norm lies below this are filtered in float64 even
# where float32 was asked for: the float32 products underflow there, and the absolute
# term of the float32 bound (32 d 2**-126) grows past its relative term (about
# d 2**-24 times the norm) near 2**-97, so the filter would prune nothing and every pair
# would be refined.  At 2**-70 the absolute term is still 2**-28 of the relative one.
MIN_NORM2_FLOAT32 = 2.0**-70

# float64 rows whose largest magnitude lies in [2**-64, 2**65) are used as given;
# others are scaled by a power of two first (see scale_exponent).  Inside this band
# every squared difference of relative size above 2**-447 is a normal float64 and no
# sum of squares can overflow, so ordinary data never pays for a scaled copy.
SCALE_FREE_EXPONENT = 64


def f64(xp, x, *, exact=True):
    """``x`` as float64 (no copy when it already is), exactly on every device.

    CuPy compiles its elementwise kernels with flush-to-zero for float32
    (``-ftz=true``), and its ``astype`` flushes float32 subnormal inputs too: a
    float32 row ``[3.9e-42]`` became ``[0.0]`` in float64 on an H200, so the
    "original" rows that certified results are refined from were not the input
    (k-NN returned another row as the nearest, at distance 0).  Float32 CuPy arrays
    are therefore widened from their bits (:func:`float32_bits_to_float64`), which
    needs only integer and float64 operations, which no flag flushes.
    ``exact=False`` is the plain cast, flushes included, for the filter's GEMM
    products: ``e_abs`` of :func:`rounding_bound` covers a flushed product, and the
    widening from bits would cost several kernels and temporaries per tile.
    """
    if x.dtype == xp.float64:
        return x
    if exact and x.dtype == xp.float32 and is_cupy_array(x):
        return float32_bits_to_float64(sys.modules["cupy"], x)
    return xp.astype(x, xp.float64)


def float32_bits_to_float64(mod, x):
    r"""The float64 values of the float32 array ``x``, from its bit patterns.

    ``mod`` is NumPy or CuPy (``x.view``, ``mod.maximum``, ``mod.ldexp``).  A finite
    float32 is :math:`(-1)^s\, m\, 2^{e - 150}` with the 24-bit significand
    :math:`m = 2^{23} + f` for a biased exponent :math:`e \ge 1`, and
    :math:`f\, 2^{-149}` for :math:`e = 0` (zero and the subnormals); both products
    are exact in float64.  Inputs are finite (the public functions check them first).

    Examples
    --------
    >>> x = np.array([1.5, -0.0, 2.0**-149, -3.0 * 2.0**-140, 3.4e38], dtype=np.float32)
    >>> bool(np.array_equal(float32_bits_to_float64(np, x), x.astype(np.float64)))
    True
    """
    # uint32 and int32 temporaries: 24 bytes an entry at the peak, the result's 8
    # included (tracemalloc, NumPy); int64 ones took 58, and a float32 head of
    # 128256 x 4096 rows is 2 GB
    b = x.view(mod.uint32)
    biased = (b >> 23) & 0xFF
    # the significand, with the implicit bit of the normal numbers
    significand = (b & 0x7FFFFF) | ((biased != 0).astype(mod.uint32) << 23)
    # the exponent: biased - 150 for normal numbers, -149 for subnormals and zero
    exponent = mod.maximum(biased, 1).astype(mod.int32)
    del biased
    exponent -= 150
    out = mod.ldexp(significand.astype(mod.float64), exponent)
    del significand, exponent
    # the sign bit, last (-0.0 keeps its sign: 0.0 * -1 is -0.0)
    out *= 1 - 2 * (b >> 31).astype(mod.int8)
    return out


def dtype_name(x) -> str:
    """``"float32"`` or ``"float64"``: the name reported in results."""
    return "float32" if "float32" in str(x.dtype) else "float64"


def gamma(m: int, u: float) -> float:
    """:math:`\\gamma_m(u) = m u / (1 - m u)`, the classical bound of m roundings."""
    return m * u / (1.0 - m * u)


def refined_distance_error(d: int) -> float:
    """Bound on the relative error of a refined float64 distance, ``sqrt`` of
    :func:`canonical_sq`, against the exact distance of the same float64 rows.

    Along each term of the squared distance: the rounding of the difference (which
    the square takes twice) and of the square, at most ``ceil(d/8) - 1`` additions in
    its lane and the three levels of the final tree, all of non-negative terms, so the
    sum is within ``gamma_m`` with ``m = ceil(d/8) + 5``; the square root halves that
    relative error (to first order) and adds one rounding, which ``gamma(ceil(d/8) +
    5, 2**-53)`` covers: 6.7e-16 for ``d <= 8``."""
    return gamma(-(-int(d) // 8) + 5, 2.0**-53)


def two_diff(a, b):
    """``(s, e)`` with ``s = fl(a - b)`` and ``a - b = s + e`` exactly (Knuth's TwoSum on
    ``a`` and ``-b``; elementwise, any array namespace; ``e`` is NaN where ``s`` or an
    input is infinite)."""
    s = a - b
    bb = s - a
    return s, (a - (s - bb)) - (b + bb)


def _two_sum_tree(xp, s, c):
    """Top of the pairwise TwoSum tree over the last axis of ``s`` (carried errors ``c``).

    Returns ``(s, c, rounded, levels)``: ``s + c`` at the top (shape ``(..., 1)`` each,
    ``c`` not yet added; ``None`` for no errors), whether any step rounded, and the
    number of levels.
    """
    rounded = xp.zeros(s.shape[:-1], dtype=xp.bool)
    levels = 0
    while s.shape[-1] > 1:
        m = s.shape[-1]
        h = m // 2
        # entry k pairs with entry k + h (halves, not neighbours: contiguous slices)
        a, b = s[..., :h], s[..., h : 2 * h]
        t = a + b
        bb = t - a
        e = (a - (t - bb)) + (b - bb)
        rounded = xp.logical_or(rounded, xp.any(e != 0.0, axis=-1))
        cc = e if c is None else (c[..., :h] + c[..., h : 2 * h]) + e
        if m % 2:
            # the odd one out moves up a level as it is, with its carried error
            t = xp.concat([t, s[..., m - 1 :]], axis=-1)
            last = xp.zeros_like(s[..., m - 1 :]) if c is None else c[..., m - 1 :]
            cc = xp.concat([cc, last], axis=-1)
        s, c = t, cc
        levels += 1
    return s, c, rounded, levels


def compensated_sums(xp, x):
    """Sums of float64 ``x`` along its last axis, and a bound on each one's error.

    Returns ``(sums, err, l1)`` with ``|sums - exact| <= err``, where ``err`` is ``0`` for
    a sum no step rounded (then ``sums`` is exact) and otherwise
    ``u |sums| + 3 (L + 1)**2 u**2 ||x||_1 + 4 n eta`` (``L``: the tree's levels, at
    most ``ceil(log2 n) + 1``): the accuracy of a sum taken in twice the working
    precision, whatever the cancellation; ``l1`` is the float ``||x||_1`` of each sum
    (taken on the way, block by block).

    A pairwise tree of error-free additions (TwoSum: ``a + b = s + e`` exactly for
    ``s = fl(a + b)``, six flops, no FMA) adds the two halves level by level; the errors
    ``e`` ride up a second, plain pairwise tree beside the sums and join them once at
    the top.  Each level's errors are at most ``u`` times its sums, whose total is at
    most ``||x||_1``, and the plain tree rounds each of them up to ``2 L`` times (two
    additions a level): hence ``L**2 u**2``.  The ``eta`` term covers flush-to-zero mode, where an error below the
    smallest normal number is lost.  On the host the tree runs on blocks of ``2**16``
    entries (a row, a piece of a row or a few rows) that stay in cache, then on the
    blocks' tops: 3 to 8 times faster than :func:`math.fsum` over ``tolist()``, which
    also needs a Python float (24 bytes) an entry (asv:
    ``extreme_pairs.BackwardBoundResiduals``).  The caller
    guarantees that no partial sum overflows.
    """
    n = x.shape[-1]
    lead = x.shape[:-1]
    if n < 2 or math.prod(lead) == 0:
        # nothing to add: exact (an empty sum is 0)
        sums = x[..., 0] if n == 1 else xp.sum(x, axis=-1)
        return sums, xp.zeros_like(sums), xp.abs(sums)
    rows = xp.reshape(x, (-1, n))
    block = 2**16 if getattr(xp, "__name__", "").endswith("numpy") else 2**24
    cols = -(-n // block)  # blocks per row
    width = -(-n // cols)
    step = max(1, block // width)  # rows per call
    tops_s, tops_c, flags, norms, levels = [], [], [], [], 0
    for i in range(0, rows.shape[0], step):
        part_s, part_c, part_r = [], [], []
        norm = None
        for j in range(0, n, width):
            # slice ends within the array (the array API does not clip them as NumPy does)
            piece = rows[i : min(i + step, rows.shape[0]), j : min(j + width, n)]
            ts, tc, tr, depth = _two_sum_tree(xp, piece, None)
            levels = max(levels, depth)  # the last piece of a row may be shorter
            part_s.append(ts)
            part_c.append(tc)
            part_r.append(tr)
            # |x| while the piece is in cache: a separate pass over x costs as much
            # as the tree (an (n, V) temporary, page faults)
            a = xp.sum(xp.abs(piece), axis=-1)
            norm = a if norm is None else norm + a
        if len(part_s) == 1:
            ts, tc, tr, top = part_s[0], part_c[0], part_r[0], 0
        else:
            both = xp.concat(part_s, axis=-1), xp.concat(part_c, axis=-1)
            ts, tc, tr, top = _two_sum_tree(xp, *both)
            for r in part_r:
                tr = xp.logical_or(tr, r)
        tops_s.append(ts[:, 0] + tc[:, 0])
        flags.append(tr)
        norms.append(norm)
    levels += top
    sums = xp.reshape(xp.concat(tops_s), lead)
    rounded = xp.reshape(xp.concat(flags), lead)
    u = U64
    l1 = xp.reshape(xp.concat(norms), lead)
    # the float l1 is itself low by up to gamma_n; (1 + 2 gamma_n) covers it
    slack = (u * xp.abs(sums) + (3.0 * (levels + 1) ** 2 * u * u) * l1 + 4.0 * n * 2.0**-1022) * (
        1.0 + 2.0 * gamma(n + 2, u)
    )
    return sums, xp.where(rounded, slack, xp.zeros_like(sums)), l1


def rounding_bound(d: int, dtype: str) -> tuple[float, float]:
    """``(c, e_abs)`` with ``|f_ij - r_ij| <= c (n_i + n_j) + e_abs`` (docs/theory/rows.md).

    ``f_ij = n_i + n_j - 2 fl(x_i . x_j)`` is the filtered squared distance of the
    centered copy stored in ``dtype`` (unit roundoff u), ``n`` its float64 squared
    norms and ``r_ij`` the refined float64 value of the original rows.  Terms:
    GEMM ``gamma_d(u) a`` (any summation order, FMA or not), float64 norms
    ``gamma_d(u64) a``, the epilogue's float64 operations ``4 u64 a``, the
    rounding of the centered copy ``4.01 (u + u64) a`` and of the refined value
    ``2.01 gamma_{d+2}(u64) a``; 1.01 covers second-order terms.  ``16 u64`` more
    covers the rounding of the comparisons in the kernels, and ``e_abs`` (32 d eta,
    eta the smallest normal number) covers underflow in products and the centering,
    with or without flush-to-zero.  ``(inf, inf)`` when ``d u >= 0.1`` (no useful
    bound: the filter must not run in that dtype).
    """
    u = UNIT_ROUNDOFF[dtype]
    if d * u >= 0.1:
        return math.inf, math.inf
    c = 1.01 * (
        gamma(d, u) + gamma(d, U64) + 4 * U64 + 4.01 * (u + U64) + 2.01 * gamma(d + 2, U64)
    )
    return c + 16 * U64, 32.0 * d * ETA[dtype]


def lowered_key_bound(c: float) -> float:
    """``c' = c + 8 u64``: the k-NN heap keys ``m_j - 2 fl(x_i . x_j)`` use the lowered
    norms ``m_j = (1 - c') n_j``, so that ``key + (1 - c') n_i - e_abs`` is a lower and
    ``key + (1 + c') n_i + 2 c' n_j + e_abs`` an upper end of the pair's filtered distance
    (the margin covers the rounding of ``m_j`` and of the key; docs/theory/rows.md).
    The compiled k-NN (``refgeo_ext/_knn.pyx.tp``) and the Dask k-NN tasks use it."""
    return c + 8 * U64


def reported_bound(d: int, dtype: str, max_norm: float) -> float:
    """The certificate's ``error_bound``: ``c * 2 max n + e_abs`` (largest a_ij)."""
    c, eabs = rounding_bound(d, dtype)
    return c * 2.0 * max_norm + eabs


def canonical_sq(xp, A, B):
    """Refined squared distances ``sum_k (a_k - b_k)**2`` of broadcast float64 rows.

    The fixed summation order is shared with ``refgeo_ext``: eight lanes ``k mod 8``
    accumulated in increasing ``k``, then combined as
    ``((p0+p1)+(p2+p3))+((p4+p5)+(p6+p7))``, so every backend gets the same bits.
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


def better(v, i, j, best, maximize: bool) -> bool:
    """The one tie rule: strictly better value, or equal value and smaller ``(i, j)``.

    ``best`` is ``(value, i, j)`` or None (anything beats nothing).
    """
    if best is None:
        return True
    bv, bi, bj = best
    if maximize:
        return v > bv or (v == bv and (i, j) < (bi, bj))
    return v < bv or (v == bv and (i, j) < (bi, bj))



def best_pair(best: tuple[float, int, int] | None) -> tuple[float, int, int]:
    """The winner of a scan that merged candidates with :func:`better`.

    Every caller passes at least two rows, so some pair was examined; ``None`` here is
    an internal error, never an answer.
    """
    if best is None:
        raise RuntimeError("internal error: no pair of rows was examined")
    return best


# --------------------------------------------------------------------------- prescaling
#
# Multiplying by a power of two is exact in binary floating point unless the result
# leaves the normal range, and sqrt, sums of squares and differences all commute with
# it.  So rows scaled by 2**-e have refined squared distances exactly 2**-2e times
# those of the rows, wherever neither set leaves the normal range, and the distance
# scales back exactly.  Every backend sees the same scaled rows, so the reference and
# the engines still agree bit for bit.


def scale_exponent(xp, arrays) -> int:
    """The ``e`` for which the rows ``arrays`` are used as ``rows * 2**-e``.

    ``0`` when every array is float32 (squares of float32 values never leave the
    float64 range), when the largest magnitude ``m`` lies in
    ``[2**-SCALE_FREE_EXPONENT, 2**(SCALE_FREE_EXPONENT + 1))`` or when all rows are zero;
    otherwise the binary exponent of ``m``, which brings ``m`` into ``[1/2, 1)``: then
    no difference of two rows exceeds 2 and no sum of squares can overflow.
    """
    if all(a.dtype == xp.float32 for a in arrays):
        return 0
    # two reductions instead of max(abs(a)): no temporary of the size of the input
    return scale_exponent_of(max(max(float(xp.max(a)), -float(xp.min(a))) for a in arrays))


def scale_exponent_of(m: float) -> int:
    """:func:`scale_exponent` of float64 rows whose largest magnitude is ``m`` (known
    already, e.g. from a pass over the chunks of a Dask array)."""
    if m == 0.0:
        return 0
    e = math.frexp(m)[1]
    if -SCALE_FREE_EXPONENT < e <= SCALE_FREE_EXPONENT + 1:
        return 0
    return e


def _factors(e: int):
    """Powers of two, each a normal float64, whose product is ``2**e``."""
    out = []
    while e:
        step = max(-1000, min(1000, e))
        out.append(math.ldexp(1.0, step))
        e -= step
    return out


def scale_rows_inplace(x: np.ndarray, e: int) -> np.ndarray:
    """:func:`scale_rows` of a float64 NumPy array of the caller's own, in place (the
    same products, bit for bit, without a second array)."""
    for f in _factors(-e):
        x *= f
    return x


def scale_rows(xp, x, e: int):
    """float64 ``x * 2**-e`` (``x`` itself when ``e == 0``).

    Exact except for entries more than ``2**1022`` times smaller than the largest,
    which become subnormal (or zero) when ``e > 0``.
    """
    if e == 0:
        return x
    y = f64(xp, x)
    for f in _factors(-e):
        y = y * f
    return y


def unscale(value: float, e: int) -> float:
    """A distance of the scaled rows, scaled back: ``value * 2**e`` (one rounding).

    ``inf`` when the result exceeds the float64 range (the callers raise on it).
    """
    if e == 0:
        return value
    try:
        return math.ldexp(value, e)
    except OverflowError:
        return math.inf


def scaled_row_norms(A: np.ndarray) -> np.ndarray:
    """Euclidean norms of the rows of the float64 NumPy array ``A`` (shape (n, d)), each
    from the row scaled by the power of two that brings its largest entry into
    [1/2, 1): a plain sum of squares overflows from about 1e154 and vanishes below about
    1e-162.  ``inf`` only where a norm itself is beyond the float64 range."""
    top = np.max(np.abs(A), axis=1) if A.shape[1] else np.zeros(A.shape[0])
    e = np.frexp(np.where(top > 0, top, 1.0))[1]
    scaled = np.ldexp(A, -e[:, None])
    with np.errstate(over="ignore"):
        return np.ldexp(np.sqrt(np.einsum("ij,ij->i", scaled, scaled)), e)


def unscale_array(xp, a, e: int):
    """:func:`unscale` elementwise for a float64 array (``a`` itself when ``e == 0``)."""
    if e == 0:
        return a
    # NumPy, CuPy: one rounding (inf beyond the range); torch.ldexp, for one, takes no
    # Python int exponent, so other namespaces multiply by normal powers of two
    if getattr(xp, "__name__", "").endswith(("numpy", "cupy")) and hasattr(xp, "ldexp"):
        with _quiet_overflow(xp):
            return xp.ldexp(a, e)
    for f in _factors(e):
        a = a * f
    return a


def _quiet_overflow(xp):
    return np.errstate(over="ignore") if xp.__name__.endswith("numpy") else contextlib.nullcontext()
