"""Hilbert projective distance between output distributions.

For logits z, z' the Hilbert distance of their softmaxes is the variation seminorm of
the difference, ``d_H(softmax z, softmax z') = max(z' - z) - min(z' - z)``: shift
invariant, free of any epsilon, exact for any finite logits.  Definitions and proofs:
:doc:`/theory/hilbert` (``docs/theory/hilbert.md``).

.. autosummary::

   variation
   hilbert_distance
   hilbert_distance_logits
   funk_distance
   funk_distance_logits
   pdist_hilbert
   cdist_hilbert
   tv_bound
   ce_bound

Tensors in, tensors out
-----------------------
Every function here accepts torch tensors (and CPU JAX arrays) as well as NumPy
arrays.  A CPU tensor, with ``requires_grad`` or not, is viewed zero-copy as a NumPy
array and runs exactly like it, compiled kernels included (:func:`pdist_hilbert` and
:func:`cdist_hilbert` read a contiguous tensor's memory in place; a non-contiguous
one is copied once into contiguous rows); bfloat16 and float16 tensors are upcast to
float32.  Array results come back as tensors on the input's device, and 0-d results
as Python floats.  Integer, boolean and complex tensors are a ``TypeError``;
non-finite ones a ``ValueError`` (except where ``inf`` is a valid distance, in
:func:`tv_bound` and :func:`ce_bound`).  A CUDA tensor goes zero-copy to CuPy (an
error that says what to install when CuPy is missing).  Dask arrays are a
``TypeError``: these functions are not distributed (the row functions of
:mod:`refgeo.rows` are); apply them to the blocks.

Batches may be empty (shape ``(0, V)``: an empty result, as NumPy's reductions over
another axis give); a vector may not (``V >= 1``).
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
from array_api_compat import array_namespace, is_array_api_obj, is_dask_array, is_numpy_array

from . import _backend, _memory, _progress
from ._certify import f64, two_diff
from ._interop import first_origin, from_foreign, to_caller
from ._validate import (
    as_float_array,
    check_axis,
    check_choice,
    check_int,
    check_nonnegative,
    check_same_trailing,
)

__all__ = [
    "cdist_hilbert",
    "ce_bound",
    "funk_distance",
    "funk_distance_logits",
    "hilbert_distance",
    "hilbert_distance_logits",
    "pdist_hilbert",
    "tv_bound",
    "variation",
]

_KINDS: tuple[Literal["logits", "probabilities"], ...] = ("logits", "probabilities")

# Elements per block of partner rows in the reference pdist/cdist: bounds its memory
# to a few tens of MB whatever the number of rows.
_REF_BLOCK_ELEMENTS = 1 << 22


def _difference_range(xp, z, w, axis):
    """``max(w - z) - min(w - z)`` in float64, also when a difference overflows.

    Logits near +-1e308 make ``w - z`` overflow (inf - inf = NaN for a distance that
    is 0); the halves ``w/2 - z/2`` cannot overflow, and doubling their range is exact
    (it overflows only when the distance itself exceeds the float64 range).  The fast
    path is taken whenever it is finite, so ordinary inputs keep their exact values.
    """
    with np.errstate(over="ignore", invalid="ignore"):
        d = w - z
        r = xp.max(d, axis=axis) - xp.min(d, axis=axis)
    if bool(xp.all(xp.isfinite(r))):
        return r
    h = w * 0.5 - z * 0.5
    with np.errstate(over="ignore"):
        r2 = (xp.max(h, axis=axis) - xp.min(h, axis=axis)) * 2.0
    return xp.where(xp.isfinite(r), r, r2)


_LN2 = 0.6931471805599453  # float64 log(2)


def _scaled_logs(xp, p, axis, keep):
    """``(L, E, lt)`` with ``L = log(p / top)`` entrywise on ``keep`` (the entries > 0;
    finite off it, where it means nothing), ``top`` the largest entry of ``keep`` along
    ``axis``, ``E`` its binary exponent and ``lt = log(top / 2**E)`` (``keepdims``; ``top = m 2**E`` with
    ``1/2 <= m < 1`` split exactly by ``frexp``).

    Entries within a factor 2 of ``top``: ``log1p((p - top) / top)``, whose
    subtraction is exact (Sterbenz), so ``L`` has a few ulps of its own size however
    small: with ``log`` of each mantissa (errors of 1e-16, ulps of ``log 2``) two
    distributions 3.7e-17 apart came out at distance 0.  The others: ``log(m) - lt +
    (e - E) log 2`` with ``p = m 2**e``, where ``|L| > log 2``, so again a few ulps of
    ``|L|``.  Why not ``log(p)``: a projective distance cancels a common scale, and
    ``log(p)`` of entries far from 1 is of size up to 745, so its rounding (0.5 ulp of
    745, 6e-14) is left over where the scale cancels: ``hilbert_distance(3 * u, 1e308 *
    u)`` was off by 250 ulps.  Here the scale is an exact integer and each log is of a
    mantissa or a ratio near 1.  (Dividing by ``top`` would flush entries ``2**-1074``
    below the largest to zero and change the support.)  Namespaces without ``frexp``
    get ``log(p) - log(top)`` for the far entries, ``E = 0`` and ``lt = log(top)``.
    """
    one = xp.asarray(1.0, dtype=xp.float64)
    zero = xp.asarray(0.0, dtype=xp.float64)
    top = xp.max(p, axis=axis, keepdims=True)  # p >= 0, and keep is p > 0 (every caller)
    safe_top = xp.where(top > 0, top, one)  # an all-zero vector: nothing is kept
    if not hasattr(xp, "frexp"):
        lt = xp.log(safe_top)
        near = keep & (p >= top * 0.5)
        with np.errstate(divide="ignore", invalid="ignore"):  # log1p(-1) off the support
            L_near = xp.log1p((p - top) / safe_top)
        L_far = xp.log(xp.where(keep, p, one)) - lt
        return xp.where(near, L_near, xp.where(keep, L_far, zero)), xp.zeros_like(top), lt
    m, e = xp.frexp(p)
    mt, E = xp.frexp(safe_top)
    e = xp.astype(e, xp.float64)  # exact: |e| <= 1074
    E = xp.astype(E, xp.float64)
    lt = xp.log(mt)
    # keep &: where the largest entry is 2**-1074, top * 0.5 rounds to 0 and the zeros
    # passed the test (log1p(-1) warned of a division by zero)
    near = keep & (p >= top * 0.5)
    if is_numpy_array(p):
        # log1p on the near entries' indices only (a few per vector in a softmax), the
        # rest in place: computed on every entry, the second transcendental pass doubled
        # the time of hilbert_distance on (200, 50257) probabilities.  Off keep, L is
        # log(1) plus the exponent term: finite, and masked by every caller.
        L = np.log(np.where(keep, m, 1.0))
        e -= E
        e *= _LN2
        e -= lt
        L += e
        idx = np.nonzero(near)
        tb = np.broadcast_to(safe_top, p.shape)[idx]
        L[idx] = np.log1p((p[idx] - tb) / tb)
        return L, E, lt
    with np.errstate(divide="ignore", invalid="ignore"):
        L_near = xp.log1p((p - top) / safe_top)
        L_far = (xp.log(xp.where(keep, m, one)) - lt) + (e - E) * _LN2
    return xp.where(near, L_near, xp.where(keep, L_far, zero)), E, lt


def _log_sum_scaled(xp, p, E, axis):
    """``log(sum(p) / 2**E)`` for non-negative ``p`` whose largest entry along ``axis``
    has binary exponent ``E`` (:func:`_scaled_logs`): the scaled sum lies in
    ``[1/2, V]``, so it cannot overflow; entries that the scaling flushes to zero are
    more than ``2**-1074`` below the largest, below the sum's rounding."""
    if hasattr(xp, "ldexp"):
        return xp.log(xp.sum(xp.ldexp(p, xp.astype(-E, xp.int32)), axis=axis))
    m = xp.max(p, axis=axis, keepdims=True)  # (E = 0 here) the largest entry factored out
    return xp.log(xp.squeeze(m, axis=axis)) + xp.log(xp.sum(p / m, axis=axis))


def _scalar_or_array(xp, out):
    """0-d NumPy results become NumPy scalars (like numpy reductions)."""
    if is_numpy_array(out) and out.ndim == 0:
        return out[()]
    return out


def _out(xp, out, origin):
    """A result for the caller: NumPy scalars/arrays for NumPy input; for a tensor, a
    tensor on its device (a Python float for a 0-d result)."""
    if origin is None:
        return _scalar_or_array(xp, out)
    return to_caller(out, origin)


def _from_caller(x, name):
    """:func:`refgeo._interop.from_foreign`, refusing Dask arrays by name: the checks
    and the overflow guards here run eagerly (each forced a compute, 40 graphs for a
    40-row pdist) while the arithmetic stayed lazy, outside ``np.errstate`` (its
    overflow warnings reached the caller's ``compute()``)."""
    if is_dask_array(x):
        blocks = f"{name}.map_blocks(...)" + (", with the vector axis in one chunk" if name != "d" else "")
        raise TypeError(
            f"{name} must be a NumPy, torch, JAX or CuPy array, got a Dask array instead; the "
            f"Hilbert functions are not distributed: apply them to the blocks ({blocks}) or "
            "compute first."
        )
    return from_foreign(x, name)


def _foreign_pair(a, b, names):
    """Both arguments through :func:`refgeo._interop.from_foreign`, and a ``TypeError``
    naming both when they are arrays of two libraries (a CuPy and a NumPy array:
    array_api_compat's "Multiple namespaces" error named neither).  Lists and other
    non-arrays become NumPy arrays later, so they count as NumPy here."""
    a, oa = _from_caller(a, names[0])
    b, ob = _from_caller(b, names[1])
    kinds = [array_namespace(x) if is_array_api_obj(x) else None for x in (a, b)]
    numpy_like = [k is None or is_numpy_array(x) for k, x in zip(kinds, (a, b))]
    if numpy_like[0] != numpy_like[1] or (not any(numpy_like) and kinds[0] is not kinds[1]):
        raise TypeError(
            f"{names[0]} and {names[1]} must be arrays of one kind, got {type(a).__module__}."
            f"{type(a).__name__} and {type(b).__module__}.{type(b).__name__} instead; move one to the "
            "other's library first."
        )
    return a, b, first_origin(oa, ob)


def _broadcast_pair(xp, a, b, names):
    try:
        a2, b2 = xp.broadcast_arrays(a, b)
    except ValueError:
        raise ValueError(
            f"{names[0]} and {names[1]} must have broadcastable shapes, got "
            f"{tuple(a.shape)} and {tuple(b.shape)} instead."
        ) from None
    return a2, b2


def variation(x: Any, /, *, axis: int = -1):
    r"""Variation seminorm :math:`\lVert x \rVert_{var} = \max_i x_i - \min_i x_i`.

    Parameters
    ----------
    x : array_like of shape (..., V)
        Finite real values.
    axis : int, default=-1
        Axis along which the range is taken; other axes are batch axes.

    Returns
    -------
    v : float or ndarray of shape (...)
        float64 range along ``axis``.

    Notes
    -----
    .. math:: \lVert x \rVert_{var} = \max_i x_i - \min_i x_i

    A seminorm on :math:`\mathbb{R}^V` that vanishes exactly on constant vectors, so it
    is a norm on :math:`\mathbb{R}^V / \mathbb{R}\mathbf{1}`.  Time O(V) per vector, no
    extra memory.  Computed in float64: the maximum and minimum are exact and the
    result has one rounding (``inf`` where the range exceeds the largest float64).

    Examples
    --------
    >>> import refgeo
    >>> float(refgeo.variation([3.0, -1.0, 2.0]))
    4.0
    """
    x, origin = _from_caller(x, "x")
    # max - min is exact in any memory order: the input is read where it is
    x = as_float_array(x, "x", min_ndim=1, contiguous=False, allow_empty=True)
    xp = array_namespace(x)
    axis = _vector_axis(axis, x, "x")
    x = f64(xp, x)
    with np.errstate(over="ignore"):  # a range beyond the float64 maximum is inf
        v = xp.max(x, axis=axis) - xp.min(x, axis=axis)
    return _out(xp, v, origin)


def hilbert_distance_logits(z: Any, w: Any, /, *, axis: int = -1):
    r"""Hilbert distance between ``softmax(z)`` and ``softmax(w)``, from logits.

    Parameters
    ----------
    z, w : array_like of shape (..., V)
        Finite logits; broadcast against each other.
    axis : int, default=-1
        Vocabulary axis.

    Returns
    -------
    d : float or ndarray of shape (...)
        float64 distances.

    Notes
    -----
    .. math:: d_H(\operatorname{softmax} z, \operatorname{softmax} w) = \lVert w - z \rVert_{var}

    Probabilities are never formed, so the result is exact (to one float64 rounding of
    each difference) for any finite logits, including values of size 1e4 whose
    softmax underflows; a distance beyond the float64 range (differences of logits
    near 1e308) is ``inf``.  Invariant under adding a constant to ``z`` or ``w``;
    symmetric; satisfies the triangle inequality.  Time O(V) per pair.  Proof of the
    identity: :doc:`/theory/hilbert`, "The logit identity".

    References
    ----------
    .. [1] LM-head update geometry, arXiv:2608.22253.

    Examples
    --------
    >>> import numpy as np, refgeo
    >>> float(refgeo.hilbert_distance_logits(np.array([0.0, 1.0, 2.0]),
    ...                                      np.array([5.0, 5.0, 5.0])))
    2.0
    """
    z, w, origin = _foreign_pair(z, w, ("z", "w"))
    # differences, maxima and minima are exact in any memory order: no copies
    z = as_float_array(z, "z", min_ndim=1, contiguous=False, allow_empty=True)
    w = as_float_array(w, "w", min_ndim=1, contiguous=False, allow_empty=True)
    xp = array_namespace(z, w)
    z, w = _broadcast_pair(xp, z, w, ("z", "w"))
    axis = _vector_axis(axis, z, "z", w, "w")
    return _out(xp, _difference_range(xp, f64(xp, z), f64(xp, w), axis), origin)


def _vector_axis(axis, a, name, b=None, b_name=None):
    """The normalized vector axis of ``a`` (and of ``b``, of the same shape after
    broadcasting), which must hold at least one entry; batch axes may be empty (no
    vectors: an empty result, as NumPy's reductions over another axis give)."""
    given = axis
    axis = check_axis(axis, a.ndim)
    for x, n in ((a, name), (b, b_name)):
        if x is not None and x.shape[axis] == 0:
            raise ValueError(f"{n} must have at least one entry along axis {given}, "
                             f"got shape {tuple(x.shape)} instead.")
    return axis


def _check_probabilities(p, name, axis, where, noun="vector"):
    """Non-negative entries and a positive one in every vector along ``axis``; ``where``
    and ``noun`` name the vectors as the caller knows them ("along axis -1", "in each
    row")."""
    xp = array_namespace(p)
    check_nonnegative(p, name)
    ok = xp.any(p > 0, axis=axis)
    if not bool(xp.all(ok)):
        at = ""
        if is_numpy_array(ok) and ok.ndim >= 1:
            first = tuple(int(i[0]) for i in np.nonzero(~ok))
            at = f" at index {first[0] if len(first) == 1 else first}"
        raise ValueError(
            f"{name} must have at least one positive entry {where}, "
            f"got an all-zero {noun}{at} instead."
        )


def _log_ratio_on_support(xp, p, q, axis):
    """``(r, sp, sq, (Ep, ltp), (Eq, ltq))``: ``r = log(p / max p) - log(q / max q)``
    (float64, :func:`_scaled_logs`), the masks of the two supports, and each vector's
    top exponent and log mantissa; ``r`` means nothing off the common support."""
    p = f64(xp, p)
    q = f64(xp, q)
    sp = p > 0
    sq = q > 0
    lp, Ep, ltp = _scaled_logs(xp, p, axis, sp)
    lq, Eq, ltq = _scaled_logs(xp, q, axis, sq)
    # the logs as the pairwise kernels get them (_as_kernel_input), so that
    # pdist_hilbert on probabilities agrees bitwise with this function
    return lp - lq, sp, sq, (Ep, ltp), (Eq, ltq)


def hilbert_distance(p: Any, q: Any, /, *, axis: int = -1):
    r"""Hilbert projective distance between non-negative vectors.

    Parameters
    ----------
    p, q : array_like of shape (..., V)
        Probability vectors or any non-negative vectors with a positive entry
        (normalization is irrelevant); broadcast against each other.
    axis : int, default=-1
        Axis holding the vector entries.

    Returns
    -------
    d : float or ndarray of shape (...)
        float64 distances; ``inf`` where the supports differ.

    Raises
    ------
    ValueError
        On negative, NaN or infinite entries, or an all-zero vector.

    Notes
    -----
    .. math::

        d_H(p, q) = \log \max_i \frac{p_i}{q_i} - \log \min_i \frac{p_i}{q_i}
                  = \max_{i,j} \left| \log\frac{p_i}{p_j} - \log\frac{q_i}{q_j} \right|

    Zeros: on a common support (zeros in the same places) the distance is the one on
    that face of the simplex; different supports give ``+inf``.  Projective:
    :math:`d_H(\alpha p, \beta q) = d_H(p, q)`, also in floating point: the logs are
    of each entry relative to its vector's largest (the binary exponents split off
    exactly), so scaling by powers of two leaves the same float, and vectors far
    from 1 (entries of 1e300) lose no digits to their scale.  Each entry's log
    relative to its vector's largest carries a few ulps of its own size (entries within
    a factor 2 of the largest go through ``log1p`` of their exact difference), so the
    error is a few ulps of the largest such log on the common support, however close the
    vectors (two at distance 3.7e-17 are), and 1.4e-14 for
    ``hilbert_distance(p, 3 * p)`` (exactly 0) with ``p`` a softmax whose entries
    reach 4e-44, where that log is -100; the logits form
    (:func:`hilbert_distance_logits`) has the same error on logits of that spread.
    (This rounding is the pairwise kernels', so that :func:`pdist_hilbert` on
    probabilities agrees with this function bit for bit.)  Time O(V) per pair; logs
    in float64.
    For logits use :func:`hilbert_distance_logits`, which is exact where
    probabilities underflow.

    Examples
    --------
    >>> import refgeo
    >>> float(refgeo.hilbert_distance([0.5, 0.25, 0.25], [0.25, 0.25, 0.5]))  # log 4
    1.3862943611198906
    >>> float(refgeo.hilbert_distance([1.0, 0.0], [0.5, 0.5]))
    inf
    """
    p, q, origin = _foreign_pair(p, q, ("p", "q"))
    p = as_float_array(p, "p", min_ndim=1, keep_zeros=True, allow_empty=True)
    q = as_float_array(q, "q", min_ndim=1, keep_zeros=True, allow_empty=True)
    xp = array_namespace(p, q)
    p, q = _broadcast_pair(xp, p, q, ("p", "q"))
    user_axis = axis
    axis = _vector_axis(axis, p, "p", q, "q")
    _check_probabilities(p, "p", axis, f"along axis {user_axis}")
    _check_probabilities(q, "q", axis, f"along axis {user_axis}")
    r, sp, sq, _, _ = _log_ratio_on_support(xp, p, q, axis)
    both = sp & sq
    inf = xp.asarray(float("inf"), dtype=xp.float64)
    hi = xp.max(xp.where(both, r, -inf), axis=axis)
    lo = xp.min(xp.where(both, r, inf), axis=axis)
    mismatch = xp.any(sp != sq, axis=axis)
    return _out(xp, xp.where(mismatch, inf, hi - lo), origin)


def funk_distance(p: Any, q: Any, /, *, axis: int = -1):
    r"""Funk (one-sided Hilbert) metric :math:`\log \max_i \hat p_i / \hat q_i`.

    Parameters
    ----------
    p, q : array_like of shape (..., V)
        Non-negative vectors with a positive entry; normalized internally
        (:math:`\hat p = p / \sum p`).
    axis : int, default=-1
        Axis holding the vector entries.

    Returns
    -------
    f : float or ndarray of shape (...)
        float64, ``>= 0``; ``inf`` if ``p`` has mass where ``q`` has none.

    Notes
    -----
    .. math:: F(p, q) = \log \max_{i:\, p_i > 0} \frac{\hat p_i}{\hat q_i}

    Not symmetric.  On a common support
    :math:`d_H(p, q) = F(p, q) + F(q, p)`.  It is non-negative because
    :math:`\sum \hat p = \sum \hat q = 1`; the float64 result is clamped at 0 against
    rounding.  Time O(V).

    Examples
    --------
    >>> import refgeo
    >>> round(float(refgeo.funk_distance([0.5, 0.5], [0.25, 0.75])), 12)  # log 2, to an ulp
    0.69314718056
    """
    p, q, origin = _foreign_pair(p, q, ("p", "q"))
    p = as_float_array(p, "p", min_ndim=1, keep_zeros=True, allow_empty=True)
    q = as_float_array(q, "q", min_ndim=1, keep_zeros=True, allow_empty=True)
    xp = array_namespace(p, q)
    p, q = _broadcast_pair(xp, p, q, ("p", "q"))
    user_axis = axis
    axis = _vector_axis(axis, p, "p", q, "q")
    _check_probabilities(p, "p", axis, f"along axis {user_axis}")
    _check_probabilities(q, "q", axis, f"along axis {user_axis}")
    r, sp, sq, (Ep, ltp), (Eq, ltq) = _log_ratio_on_support(xp, p, q, axis)
    inf = xp.asarray(float("inf"), dtype=xp.float64)
    hi = xp.max(xp.where(sp, r, -inf), axis=axis)
    # the tops cancel between r and the sums: log(sum / top) = log(sum / 2**E) - lt
    shift = ((_log_sum_scaled(xp, f64(xp, q), Eq, axis) - xp.squeeze(ltq, axis=axis))
             - (_log_sum_scaled(xp, f64(xp, p), Ep, axis) - xp.squeeze(ltp, axis=axis)))
    f = xp.maximum(hi + shift, xp.asarray(0.0, dtype=xp.float64))
    escape = xp.any(sp & ~sq, axis=axis)
    return _out(xp, xp.where(escape, inf, f), origin)


def _logsumexp_parts(xp, x, axis):
    """``(m, s)`` with ``lse(x) = m + s``: the largest entry and ``log sum exp(x - m)``,
    ``0 <= s <= log V`` (``x - m`` may overflow to ``-inf`` for logits spanning more
    than the float64 range: those entries weigh ``exp(-inf) = 0``, as they should)."""
    m = xp.max(x, axis=axis, keepdims=True)
    with np.errstate(over="ignore"):
        s = xp.log(xp.sum(xp.exp(x - m), axis=axis))
    return xp.squeeze(m, axis=axis), s


def _funk_max(xp, z, w, Mz, Mw, axis):
    """``max_i ((z_i - w_i) - (M_z - M_w))``, each term accurate to a rounding of its own
    size: both differences are carried with their exact rounding errors, so neither a
    common offset of the logits (which rounds ``z_i - w_i`` at its size) nor a masked
    entry equal in ``z`` and ``w`` (which rounds ``z_i - M_z`` at the mask's size)
    leaves its rounding in the result."""
    a, ea = two_diff(z, w)
    b, eb = two_diff(Mz, Mw)
    return xp.max((a - b) + (ea - eb), axis=axis)


def _funk_logits(xp, z, w, axis):
    """``max(z - w) - lse(z) + lse(w)`` in float64, also for large offsets, masked logits
    and when a difference overflows.

    Evaluated as ``max_i ((z_i - w_i) - (m_z - m_w)) - s_z + s_w`` (``m``, ``s``: the
    parts of :func:`_logsumexp_parts`) with the differences carried exactly
    (:func:`_funk_max`), so that the large parts cancel before the log-sums are added.
    Summed as ``max(z - w) - (m_z + s_z) + (m_w + s_w)``, ``s_z`` (up to log V) was
    rounded away next to a large ``m_z``: logits ``z = 1e17`` against ``w = 0`` gave
    log V for two equal distributions, and an offset of 1e10 an error of 1e-6.  As
    ``max_i ((z_i - m_z) - (w_i - m_w))`` a masked logit (``-1e20`` in both) lost the
    rest.  Where a difference overflows (logits spanning more than the float64 range)
    the same runs in halves, which cannot overflow, and the result is ``inf`` only
    where the distance itself exceeds the float64 range.
    """
    mz, sz = _logsumexp_parts(xp, z, axis)
    mw, sw = _logsumexp_parts(xp, w, axis)
    Mz, Mw = xp.expand_dims(mz, axis=axis), xp.expand_dims(mw, axis=axis)
    with np.errstate(over="ignore", invalid="ignore"):
        f = _funk_max(xp, z, w, Mz, Mw, axis) - sz + sw
    if bool(xp.all(xp.isfinite(f))):
        return f
    h = _funk_max(xp, z * 0.5, w * 0.5, Mz * 0.5, Mw * 0.5, axis)
    with np.errstate(over="ignore"):
        f2 = 2.0 * h - (sz - sw)
    return xp.where(xp.isfinite(f), f, f2)


def funk_distance_logits(z: Any, w: Any, /, *, axis: int = -1):
    r"""Funk metric between ``softmax(z)`` and ``softmax(w)``, from logits.

    Parameters
    ----------
    z, w : array_like of shape (..., V)
        Finite logits; broadcast against each other.
    axis : int, default=-1
        Vocabulary axis.

    Returns
    -------
    f : float or ndarray of shape (...)
        float64, ``>= 0``.

    Notes
    -----
    .. math::

        F(\operatorname{softmax} z, \operatorname{softmax} w)
            = \max_i (z_i - w_i) - \operatorname{lse}(z) + \operatorname{lse}(w)

    with a max-shifted, float64 log-sum-exp; clamped at 0 against rounding.  The
    largest logits cancel first, so adding a constant to ``z`` or ``w`` does not change
    the result beyond the rounding of the logits relative to their spread (not to
    their size).  Logits whose differences overflow float64 (near ``1e308``) give the
    representable distance, computed in halves; ``inf`` only where the distance itself
    exceeds the float64 range.
    ``funk_distance_logits(z, w) + funk_distance_logits(w, z)`` equals
    :func:`hilbert_distance_logits` up to rounding.  Time O(V).

    Examples
    --------
    >>> import numpy as np, refgeo
    >>> z = np.log(np.array([0.5, 0.5])); w = np.log(np.array([0.25, 0.75]))
    >>> round(float(refgeo.funk_distance_logits(z, w)), 12)
    0.69314718056
    """
    z, w, origin = _foreign_pair(z, w, ("z", "w"))
    z = as_float_array(z, "z", min_ndim=1, allow_empty=True)
    w = as_float_array(w, "w", min_ndim=1, allow_empty=True)
    xp = array_namespace(z, w)
    z, w = _broadcast_pair(xp, z, w, ("z", "w"))
    axis = _vector_axis(axis, z, "z", w, "w")
    z = f64(xp, z)
    w = f64(xp, w)
    f = _funk_logits(xp, z, w, axis)
    return _out(xp, xp.maximum(f, xp.asarray(0.0, dtype=xp.float64)), origin)


# --------------------------------------------------------------------------- pairwise


def _pairwise_logits_reference(XA, XB, *, triangle: bool):
    """Direct max-minus-min of float64 differences; chunked over partner rows."""
    xp = array_namespace(XA, XB)
    A = f64(xp, XA)
    B = f64(xp, XB)
    nA, V = A.shape
    nB = B.shape[0]
    block = max(1, _REF_BLOCK_ELEMENTS // max(V, 1))
    rows = []
    for i in range(nA):
        start = i + 1 if triangle else 0
        parts = []
        for j0 in range(start, nB, block):
            parts.append(_difference_range(xp, A[i : i + 1, :], B[j0 : min(j0 + block, nB), :], 1))
        if parts:
            rows.append(xp.concat(parts) if len(parts) > 1 else parts[0])
    if triangle:
        if not rows:
            return xp.zeros((0,), dtype=xp.float64)
        return xp.concat(rows)
    return xp.stack(rows, axis=0)


def _pairwise_probabilities_reference(XA, XB, *, triangle: bool):
    xp = array_namespace(XA, XB)
    nA = XA.shape[0]
    nB = XB.shape[0]
    rows = []
    for i in range(nA):
        start = i + 1 if triangle else 0
        if start < nB:
            rows.append(hilbert_distance(XA[i : i + 1, :], XB[start:, :], axis=-1))
    if triangle:
        return xp.concat(rows) if rows else xp.zeros((0,), dtype=xp.float64)
    return xp.stack(rows, axis=0)


def _pdist_reference(X, *, kind, tile_size, n_threads, progress=None):
    if kind == "logits":
        return _pairwise_logits_reference(X, X, triangle=True)
    return _pairwise_probabilities_reference(X, X, triangle=True)


def _cdist_reference(XA, XB, *, kind, tile_size, n_threads, progress=None):
    if XA.shape[0] == 0 or XB.shape[0] == 0:
        xp = array_namespace(XA, XB)
        return xp.zeros((XA.shape[0], XB.shape[0]), dtype=xp.float64)
    if kind == "logits":
        return _pairwise_logits_reference(XA, XB, triangle=False)
    return _pairwise_probabilities_reference(XA, XB, triangle=False)


# Tile of rows per OpenMP task and column chunk of the tropical kernel.  Results do not
# depend on either (max/min are exact); they only set the cache footprint.
_DEFAULT_TILE_ROWS = 64
_DEFAULT_CHUNK = 1024


def _as_kernel_input(X, kind):
    """C-contiguous array for refgeo_ext: logits as they are, probabilities as float64 logs."""
    if kind == "probabilities":
        # each row's scale taken out exactly (it cancels in the distance): log(X) of
        # rows far from 1 left 6e-14 of rounding in every distance
        X = np.asarray(X, dtype=np.float64)
        keep = X > 0
        L, _, _ = _scaled_logs(np, X, 1, keep)
        return np.ascontiguousarray(np.where(keep, L, -np.inf))
    return np.ascontiguousarray(X)


def _kernel_suffix(X):
    return "32" if X.dtype == np.float32 else "64"


def _tropical_tasks(nA, nB, tile):
    """Tasks of the tropical kernel: row tiles x blocks of 8 row tiles."""
    return -(-nA // tile) * -(-nB // (8 * tile))


def _tropical_hook(progress, nA, nB, tile):
    """The kernel's ``progress(done, total)`` (one step per task), or None."""
    return None if progress is None else progress.kernel_hook(_tropical_tasks(nA, nB, tile))


def _tropical_threads(n_threads, nA, nB, tile):
    """Threads for the kernel: at most one per task.  The kernel takes a C int, so a
    valid but huge ``n_threads`` (beyond 2**31) raised OverflowError there; more
    threads than tasks would idle anyway (the tile driver drops them too)."""
    return max(1, min(_backend.resolve_n_threads(n_threads), _tropical_tasks(nA, nB, tile)))


def _pdist_cython(X, *, kind, tile_size, n_threads, progress=None):
    from refgeo_ext import _tropical

    Z = _as_kernel_input(X, kind)
    n = Z.shape[0]
    out = np.empty(n * (n - 1) // 2, dtype=np.float64)
    if out.size == 0:  # fewer than two rows: no pairs (and a tile of 0 rows)
        return out
    fn = getattr(_tropical, "pdist_logits" + _kernel_suffix(Z))
    # at most n rows per tile: a larger tile_size only over-allocates the tile buffers
    tile = min(tile_size or _DEFAULT_TILE_ROWS, n)
    fn(Z, out, tile, _DEFAULT_CHUNK, _tropical_threads(n_threads, n, n, tile),
       progress=_tropical_hook(progress, n, n, tile))
    if kind == "logits" and not np.all(np.isfinite(out)):
        # a difference overflowed in the kernel's dtype (float32 logits near 3e38, or
        # float64 near 1e308): those pairs take the float64 reference
        k = np.flatnonzero(~np.isfinite(out))
        # condensed index k -> (i, j): row i's pairs start at i n - i (i + 1) / 2
        rows = np.arange(n, dtype=np.int64)
        i = np.searchsorted(rows * n - rows * (rows + 1) // 2, k, side="right") - 1
        _overflowed_pairs(out, k, X, i, X, k - (i * n - i * (i + 1) // 2) + i + 1)
    return out


def _overflowed_pairs(out, k, XA, ia, XB, ib):
    """``out[k] = d(XA[ia], XB[ib])`` by the float64 reference (the halves where a
    difference overflows), in blocks of a few MB.  Only those pairs: recomputing
    the whole result made every other float32 value depend on the rest of the rows
    (differenced in float64 when one unrelated pair overflowed), and 9x slower."""
    A = np.asarray(XA, dtype=np.float64)
    B = np.asarray(XB, dtype=np.float64)
    block = max(1, _REF_BLOCK_ELEMENTS // max(A.shape[1], 1))
    for s in range(0, k.size, block):
        sl = slice(s, s + block)
        out[k[sl]] = _difference_range(np, A[ia[sl]], B[ib[sl]], 1)


def _cdist_cython(XA, XB, *, kind, tile_size, n_threads, progress=None):
    from refgeo_ext import _tropical

    A = _as_kernel_input(XA, kind)
    B = _as_kernel_input(XB, kind)
    if A.dtype != B.dtype:
        A = A.astype(np.float64)
        B = B.astype(np.float64)
    out = np.empty((A.shape[0], B.shape[0]), dtype=np.float64)
    if out.size == 0:  # no rows on one side: no pairs (and a tile of 0 rows)
        return out
    fn = getattr(_tropical, "cdist_logits" + _kernel_suffix(A))
    tile = min(tile_size or _DEFAULT_TILE_ROWS, A.shape[0])
    fn(A, B, out, tile, _DEFAULT_CHUNK, _tropical_threads(n_threads, A.shape[0], B.shape[0], tile),
       progress=_tropical_hook(progress, A.shape[0], B.shape[0], tile))
    if kind == "logits" and not np.all(np.isfinite(out)):
        ia, ib = np.nonzero(~np.isfinite(out))  # see _pdist_cython
        flat = out.reshape(-1)  # a view: out is C-contiguous
        _overflowed_pairs(flat, ia * out.shape[1] + ib, XA, ia, XB, ib)
    return out


def _all_positive(*arrays):
    # Zeros need the support-aware reference (log 0 = -inf has no tropical meaning).
    return all(bool(np.all(np.asarray(a) > 0)) for a in arrays)


_PDIST = _backend.KernelInfo(
    name="pdist_hilbert",
    reference=_pdist_reference,
    cython=_pdist_cython,
)
_CDIST = _backend.KernelInfo(
    name="cdist_hilbert",
    reference=_cdist_reference,
    cython=_cdist_cython,
)


def _check_pairwise_input(X, name, kind):
    X = as_float_array(X, name, ndim=2, shape_hint="2-D array of shape (n, V)",
                       keep_zeros=kind == "probabilities", allow_empty=True)
    if X.shape[1] == 0:  # no rows is no pairs (an empty result, as SciPy's pdist)
        raise ValueError(f"{name} must have at least one column (V >= 1), got shape {tuple(X.shape)} instead.")
    if kind == "probabilities":
        _check_probabilities(X, name, 1, "in each row", "row")
    return X


def _tile_option(tile_size):
    return check_int(tile_size, "tile_size", min_value=1, allow_none=True)


def _threads_option(n_threads):
    # checked here, not in the kernel, so every backend rejects the same bad values
    return check_int(n_threads, "n_threads", min_value=1, allow_none=True)


def _check_output_memory(what, nA, form, nB=None):
    """MemoryError before any work when the float64 output cannot fit."""
    if nB is None:
        pairs = nA * (nA - 1) // 2
        parts = {f"condensed output ({pairs} pairs)": 8.0 * pairs}
        if form == "square":
            parts[f"square output ({nA}, {nA})"] = 8.0 * nA * nA
        shape = f"n={nA}"
        advice = "Pass fewer rows, or compute blocks of rows with cdist_hilbert(X[a:b], X)."
    else:
        parts = {f"output ({nA}, {nB})": 8.0 * nA * nB}
        shape = f"nA={nA}, nB={nB}"
        advice = "Pass XA in chunks of rows (cdist_hilbert(XA[a:b], XB)) and reduce each block as it comes."
    _memory.check_memory(f"{what}({shape})", parts, advice)


def pdist_hilbert(
    X: Any,
    /,
    *,
    kind: Literal["logits", "probabilities"] = "logits",
    form: Literal["condensed", "square"] = "condensed",
    tile_size: int | None = None,
    n_threads: int | None = None,
    progress: Any = False,
):
    r"""Pairwise Hilbert distances between the rows of ``X`` (like ``scipy.spatial.distance.pdist``).

    Parameters
    ----------
    X : array_like of shape (n, V)
        Rows are logit vectors (``kind="logits"``) or non-negative vectors
        (``kind="probabilities"``).  float32 or float64.
    kind : {"logits", "probabilities"}, default="logits"
        How rows are read.
    form : {"condensed", "square"}, default="condensed"
        Condensed vector of length n(n-1)/2 in ``pdist`` order (pairs (i, j), i < j,
        row by row) or the symmetric (n, n) matrix.
    tile_size : int, default=None
        Rows per parallel task in the compiled kernel (64 when None).  Does not
        change any result.
    n_threads : int, default=None
        OpenMP threads for the compiled kernel (all when None).
    progress : bool or callable, default=False
        Report progress: True shows a tqdm bar, a callable receives ``{"done",
        "total", "elapsed", "eta"}`` (tasks of row tiles by column blocks) from the
        calling thread between tiles, at most four times a second and once at the end
        (as in :func:`refgeo.row_diameter`); the reference backend reports only the
        end.  Never changes the result.

    Returns
    -------
    d : ndarray of shape (n*(n-1)//2,) or (n, n)
        float64 distances (a tensor on ``X``'s device for a tensor ``X``; a
        contiguous float32/float64 CPU tensor is read in place, without a copy).

    Raises
    ------
    MemoryError
        Before any work, when the output (8 bytes per pair; the square form also
        holds the condensed vector) exceeds the available memory.

    Notes
    -----
    .. math:: d_{ij} = \max_k (x_{jk} - x_{ik}) - \min_k (x_{jk} - x_{ik})

    A max-minus-min ("tropical") reduction: no GEMM identity applies, so time is
    O(n^2 V) with extra memory O(tile_size * n) per thread.  The cython backend
    streams row tiles and column chunks through a vectorized C kernel (see
    :doc:`/theory/hilbert`, "Batched and pairwise forms").

    Precision: float64 input gives exactly the reference's values (each difference is
    rounded once, max and min are exact).  float32 input is differenced in float32:
    each returned value is within ``2**-24 * (|max_k d_k| + |min_k d_k|)`` of the
    float64 reference (pairs whose float32 difference overflows, near 3e38, are
    differenced in float64; the other pairs keep their float32 values).
    Probabilities are turned into float64 logs first; rows with zeros use the
    support-aware reference.

    Examples
    --------
    >>> import numpy as np, refgeo
    >>> Z = np.array([[0.0, 0.0, 0.0], [0.0, 1.0, 2.0], [5.0, 5.0, 6.0]])
    >>> refgeo.pdist_hilbert(Z)
    array([2., 1., 1.])
    """
    kind = check_choice(kind, "kind", _KINDS)
    form = check_choice(form, "form", ("condensed", "square"))
    X, origin = _from_caller(X, "X")
    X = _check_pairwise_input(X, "X", kind)
    tile_size = _tile_option(tile_size)
    n_threads = _threads_option(n_threads)
    info = _PDIST
    if kind == "probabilities" and not _all_positive(X):
        info = _backend.KernelInfo(name=_PDIST.name, reference=_PDIST.reference)
    _check_output_memory("pdist_hilbert", X.shape[0], form)
    _, fn = _backend.dispatch(info, X)
    out = _progress.call_with_progress(fn, X, kind=kind, tile_size=tile_size, n_threads=n_threads,
                                       progress=progress, desc="pdist_hilbert")
    if form == "square":
        out = _squareform(out, X.shape[0])
    return to_caller(out, origin)


def _squareform(condensed, n):
    """Symmetric (n, n) matrix from a condensed vector, in the vector's namespace."""
    xp = array_namespace(condensed)
    # Gather index of every (i, j) into [condensed..., 0]; the diagonal reads the 0.
    i, j = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    a, b = np.minimum(i, j), np.maximum(i, j)
    idx = np.where(a == b, n * (n - 1) // 2, n * a - a * (a + 1) // 2 + b - a - 1)
    padded = xp.concat([condensed, xp.zeros((1,), dtype=condensed.dtype)])
    flat = xp.take(padded, xp.asarray(idx.reshape(-1)), axis=0)
    return xp.reshape(flat, (n, n))


def cdist_hilbert(
    XA: Any,
    XB: Any,
    /,
    *,
    kind: Literal["logits", "probabilities"] = "logits",
    tile_size: int | None = None,
    n_threads: int | None = None,
    progress: Any = False,
):
    r"""Hilbert distances between every row of ``XA`` and every row of ``XB``.

    Parameters
    ----------
    XA : array_like of shape (nA, V)
    XB : array_like of shape (nB, V)
        Logits or non-negative vectors, as ``kind`` says.
    kind : {"logits", "probabilities"}, default="logits"
    tile_size : int, default=None
        Rows of ``XA`` per parallel task (does not change results).
    n_threads : int, default=None
        OpenMP threads (all when None).
    progress : bool or callable, default=False
        As in :func:`pdist_hilbert`.

    Returns
    -------
    d : ndarray of shape (nA, nB)
        float64, ``d[i, j] = d_H(XA[i], XB[j])`` (a tensor when ``XA`` or ``XB`` is one).

    Raises
    ------
    MemoryError
        Before any work, when the (nA, nB) output exceeds the available memory.

    Notes
    -----
    .. math:: d_{ij} = \max_k (b_{jk} - a_{ik}) - \min_k (b_{jk} - a_{ik})

    Time O(nA nB V).  Precision as in :func:`pdist_hilbert`; mixed float32/float64
    inputs are computed in float64.

    Examples
    --------
    >>> import numpy as np, refgeo
    >>> refgeo.cdist_hilbert(np.zeros((1, 3)), np.array([[0.0, 1.0, 2.0], [1.0, 1.0, 1.0]]))
    array([[2., 0.]])
    """
    kind = check_choice(kind, "kind", _KINDS)
    XA, XB, origin = _foreign_pair(XA, XB, ("XA", "XB"))
    XA = _check_pairwise_input(XA, "XA", kind)
    XB = _check_pairwise_input(XB, "XB", kind)
    check_same_trailing(XA, XB, ("XA", "XB"), "number of columns (vocabulary size)")
    tile_size = _tile_option(tile_size)
    n_threads = _threads_option(n_threads)
    info = _CDIST
    if kind == "probabilities" and not _all_positive(XA, XB):
        info = _backend.KernelInfo(name=_CDIST.name, reference=_CDIST.reference)
    _check_output_memory("cdist_hilbert", XA.shape[0], None, XB.shape[0])
    _, fn = _backend.dispatch(info, XA, XB)
    return to_caller(
        _progress.call_with_progress(fn, XA, XB, kind=kind, tile_size=tile_size, n_threads=n_threads,
                                     progress=progress, desc="cdist_hilbert"),
        origin,
    )


# --------------------------------------------------------------------------- bounds


def _check_distance(d):
    d, origin = _from_caller(d, "d")
    d = as_float_array(d, "d", allow_empty=True, finite=False)
    xp = array_namespace(d)
    if bool(xp.any(xp.isnan(d))) or bool(xp.any(d < 0)):
        raise ValueError("d must be a Hilbert distance (>= 0, not NaN), got negative or NaN entries instead.")
    return xp, f64(xp, d), origin


def tv_bound(d: Any, /):
    r"""Sharp bound on total variation from the Hilbert distance: ``tanh(d / 4)``.

    Parameters
    ----------
    d : float or array_like
        Hilbert distances (``>= 0``; ``inf`` allowed).

    Returns
    -------
    b : float or ndarray
        Upper bound on :math:`TV(p, q) = \tfrac12 \lVert p - q \rVert_1`.

    Notes
    -----
    .. math:: TV(p, q) \le \tanh\!\left(\frac{d_H(p, q)}{4}\right)

    Sharp: two points with likelihood ratios :math:`e^{\mp d/2}` attain it (proof:
    :doc:`/theory/hilbert`, "What the distance controls").

    Examples
    --------
    >>> import refgeo
    >>> float(refgeo.tv_bound(0.0)), float(refgeo.tv_bound(float("inf")))
    (0.0, 1.0)
    """
    xp, d, origin = _check_distance(d)
    return _out(xp, xp.tanh(d / 4.0) + 0.0, origin)  # + 0.0: tanh(-0.0) is -0.0


def ce_bound(d: Any, /):
    r"""Bound on the change of any token's cross-entropy: ``|log p_c - log q_c| <= d_H``.

    Parameters
    ----------
    d : float or array_like
        Hilbert distances (``>= 0``; ``inf`` allowed).

    Returns
    -------
    b : float or ndarray
        Upper bound on :math:`\max_c |\log p_c - \log q_c|`: the bound is ``d`` itself.

    Notes
    -----
    For normalized p, q, :math:`\log(p_c/q_c)` lies between the minimum and the maximum
    of the log-ratios, and the minimum is <= 0 <= the maximum, so
    :math:`|\log p_c - \log q_c| \le \max - \min = d_H(p, q)`.  Equality needs the
    minimum or the maximum log-ratio to be 0, which forces p = q; for p != q the bound
    is approached, not attained: two-point distributions :math:`p = (1-\varepsilon,
    \varepsilon)`, :math:`q = (1-\delta, \delta)` with :math:`\varepsilon/\delta` fixed
    and :math:`\delta \to 0`.  See :doc:`/theory/hilbert`.

    Examples
    --------
    >>> import refgeo
    >>> float(refgeo.ce_bound(0.25))
    0.25
    """
    xp, d, origin = _check_distance(d)
    return _out(xp, d + 0.0, origin)
