r"""Steepest descent under the row diameter: RowNorm, bounds, the exact LMO.

The mathematics is in :doc:`/theory/lmo` (docs/theory/lmo.md).  For a centered
gradient :math:`G \in \mathbb{R}^{V \times d}` (:math:`\mathbf{1}^\top G = 0`, as for
cross-entropy) the linear minimization oracle of the row diameter is

.. math:: \min \{ \langle G, S \rangle : D(S) \le \eta,\ \mathbf{1}^\top S = 0 \}
          = -\eta\, T(G),

where the *tension* :math:`T` is the dual norm of :math:`D` on centered matrices,

.. math:: T(G) = \min \Big\{ \sum_{i<j} \lVert y_{ij} \rVert :
                 \sum_{j \ne i} y_{ij} = g_i,\ y_{ji} = -y_{ij} \Big\}
               = \max \{ \langle G, \Phi \rangle : D(\Phi) \le 1 \}.

.. autosummary::

   center_rows
   row_normalize
   projected_rownorm
   rescaled_rownorm
   tension_bounds
   diameter_lmo

Projected RowNorm costs O(Vd) and achieves at least :math:`\sqrt{(k+1)/(2k)}` of the
optimal decrease (k = rank G); :func:`diameter_lmo` computes the optimum itself, with a
certified bracket: nearly collinear rows are merged under a certified bound on the cost,
and the merged min-tension flow problem is solved by a barrier method, reweighted
electrical flows or ADMM over a working set, by size.

Every function accepts torch tensors (CPU tensors viewed without a copy, ``requires_grad``
and non-contiguous ones included; bfloat16 and float16 computed as float32; integer,
boolean and complex tensors are a ``TypeError``) and JAX arrays, and returns its arrays
in the caller's framework; scalars are Python floats.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import scipy.linalg as _sla
import scipy.sparse as _sp
from array_api_compat import array_namespace, is_numpy_array

from ._validate import (
    as_float_array,
    check_bool,
    check_callable,
    check_centered_rows,
    check_int,
    check_min_rows,
    check_open_unit_interval,
    check_real,
)
from . import _progress
from ._certify import f64
from ._interop import fields_to_caller, from_foreign, input_eps, to_caller, to_host
from ._threads import blas_single_thread
from .rows import _engine_is_compiled, row_diameter

__all__ = [
    "LMOResult",
    "TensionBounds",
    "center_rows",
    "diameter_lmo",
    "projected_rownorm",
    "rescaled_rownorm",
    "row_normalize",
    "tension_bounds",
]

# ``||sum_i g_i|| <= _CENTERED_RTOL * sum_i ||g_i||`` is accepted as a centered gradient,
# and the small remainder is removed exactly (the LMO's constraint 1^T S = 0 makes
# <G, S> = <PG, S>).  The tolerance is bfloat16's unit roundoff: a cross-entropy gradient
# computed under bfloat16 autocast and stored in float32 (the usual mixed precision) has
# rows summing to zero only to that rounding (measured up to 1.2e-3 of the row norms:
# V = 64 to 32768, Zipf targets, hidden states with a common component, accumulated
# micro-batches), and 1e-4 refused it at every seed at V = 512.  A gradient that is not
# centered by mistake (a tied embedding's, a weight for a gradient) is off by a fraction
# of its rows' size and is still refused.
_CENTERED_RTOL = 2.0**-8


def _centered_rtol(eps: float) -> float:
    """The centering tolerance for a gradient whose values had precision ``eps``
    (:func:`refgeo._interop.input_eps`): a bfloat16 array's rounding alone moves the sum
    of its rows by up to its eps (typically eps/2 / sqrt(V) of the row norms, more where
    a few rows dominate)."""
    return max(_CENTERED_RTOL, eps)

_EPS64 = float(np.finfo(np.float64).eps)
_TINY64 = float(np.finfo(np.float64).tiny)
_MAX64 = float(np.finfo(np.float64).max)
# Relative gap below which the solver's float64 estimates are rounding noise.
_GAP_FLOOR = 16.0 * _EPS64
# A lower bound may exceed an upper bound from a different formula by rounding only:
# both are float64 sums of at most 2**53 nonnegative terms (pairwise summation, error
# <= log2(n) eps relative) of norms rounded to a few eps.  Beyond this many units of
# roundoff a crossed bracket is a bug, never rounding.
_BRACKET_ULPS = 64.0


def _checked_bracket(lower: float, upper: float, what: str) -> tuple[float, float]:
    """``(lower, upper)`` with ``upper`` raised to ``lower`` when they cross by rounding.

    A crossing by more than ``_BRACKET_ULPS`` units of roundoff of the larger value
    means one of the two is not a bound: raise instead of hiding it.
    """
    if upper >= lower:
        return lower, upper
    if lower - upper > _BRACKET_ULPS * _EPS64 * max(abs(lower), abs(upper)):
        raise RuntimeError(
            f"internal error in {what}: the lower bound {lower!r} exceeds the upper bound "
            f"{upper!r} by {lower - upper:.3e}, more than rounding can explain; please report "
            "this with the input that produced it."
        )
    return lower, lower


def _readonly(a):
    if is_numpy_array(a):
        a.setflags(write=False)
    return a


def _check_eta(eta, name: str = "eta") -> float:
    eta = check_real(eta, name, min_value=0.0, strict=True)
    if eta < _TINY64:
        # a subnormal budget cannot carry the step: eta * S rounds to a few subnormal
        # values whose diameter no longer respects eta
        raise ValueError(f"{name} == {eta!r}, must be >= {_TINY64!r} (the smallest normal float64).")
    return eta


def _check_gradient(G, name="G"):
    G = as_float_array(G, name, ndim=2, shape_hint="2-D array of shape (V, d)")
    check_min_rows(G, name, 2)
    return G


# --------------------------------------------------------------------------- RowNorm


def center_rows(A: Any, /):
    r"""Subtract the mean row: :math:`PA` with :math:`P = I - \mathbf{1}\mathbf{1}^\top/V`.

    Parameters
    ----------
    A : array_like of shape (V, d)
        Finite rows.

    Returns
    -------
    C : ndarray of shape (V, d)
        ``A`` minus its mean row, float32 for float32 ``A``, float64 otherwise (the
        mean is accumulated in float64).

    Raises
    ------
    ValueError
        If a centered entry is beyond the range of that dtype (rows of both signs
        near its maximum): there is no representable answer.

    Notes
    -----
    .. math:: PA = A - \tfrac{1}{V}\mathbf{1}\mathbf{1}^\top A

    Time O(Vd), one extra array.  The row diameter, the tension and every update of
    this module are unchanged by a common row shift, so centering changes no result;
    it only removes the component on which :math:`\langle G, S \rangle` does not
    depend when :math:`\mathbf{1}^\top S = 0`.  Two passes: the second subtracts the
    mean of the centered rows, which removes the rounding of the first mean (a shift
    common to every row, about ``eps max |a|``) to the rounding of the centered rows
    themselves, so that the output passes the centering check of :func:`diameter_lmo`
    and the other functions that make one; rows that are all equal become exactly 0.

    Examples
    --------
    >>> import numpy as np, refgeo
    >>> refgeo.center_rows(np.array([[1.0, 2.0], [3.0, 6.0]])).tolist()
    [[-1.0, -2.0], [1.0, 2.0]]
    """
    A, origin = from_foreign(A, "A")
    A = as_float_array(A, "A", ndim=2, shape_hint="2-D array of shape (V, d)")
    xp = array_namespace(A)
    # rows of both signs near the top of the range have centered values beyond it
    # (1.7e308 - (-0.57e308)): no representable answer, so an error rather than inf
    with np.errstate(over="ignore"):
        C = _cast_finite(xp, _centered_unchecked(xp, f64(xp, A)), A.dtype)
    if C is None:
        raise ValueError(
            f"A must have centered rows inside the range of {A.dtype} (max "
            f"{float(xp.finfo(A.dtype).max)!r}), got rows whose "
            "difference from the mean row overflows instead; scale A down."
        )
    return to_caller(C, origin)


def _cast_finite(xp, X, dtype):
    """``X`` (float64) in ``dtype``, or None when an entry is beyond that dtype's range
    (or was already beyond float64's): the callers raise under their argument's name."""
    with np.errstate(over="ignore"):
        Y = xp.astype(X, dtype) if dtype != xp.float64 else X
    return Y if bool(xp.all(xp.isfinite(Y))) else None


def _mean_row(xp, Af):
    """The mean row of ``Af`` (float64), free of overflow in the column sums near 1e308."""
    V = Af.shape[0]
    mx = float(xp.max(xp.abs(Af))) if Af.size else 0.0
    if mx * V < _MAX64 / 2:
        return xp.mean(Af, axis=0, keepdims=True)
    # the column sums could overflow (rows near 1e308): average the scaled rows
    k = 8 + math.frexp(float(V))[1]
    return _pow2_scaled(xp, xp.mean(_pow2_scaled(xp, Af, -k), axis=0, keepdims=True), k)


def _centered_unchecked(xp, Af):
    """``Af`` (float64) minus its mean row, centered to the rounding of its own entries;
    an entry of the result is inf where the centered value is beyond the float64 range.

    The computed mean is off by about ``eps max |a|``, a shift common to every centered
    row: where the centered rows are small next to ``Af`` (a large common component),
    their sum was that shift times V, and the LMO functions refused the output of
    :func:`center_rows` as not centered (rows of one value: every time).  A second pass
    takes the mean of the centered rows, whose error is ``eps`` of their own size.  Rows
    that are all equal after it come from rows that were all equal, whose centered
    value is exactly 0 (``P 1 r^T = 0``).
    """
    C = Af - _mean_row(xp, Af)
    if C.shape[0] == 0 or not bool(xp.all(xp.isfinite(C))):
        return C  # beyond the range: the caller reports it
    C = C - _mean_row(xp, C)
    if bool(xp.all(C == C[:1, :])):
        C = xp.zeros_like(C)
    return C


def row_normalize(A: Any, /, *, eps: float = 0.0):
    r"""Divide every row by its Euclidean norm (plus ``eps``); zero rows stay zero.

    Parameters
    ----------
    A : array_like of shape (V, d)
        Finite rows.
    eps : float, default=0.0
        Added to every norm, ``>= 0`` (the RowNorm optimizer's :math:`\varepsilon`).

    Returns
    -------
    N : ndarray of shape (V, d)
        :math:`a_i / (\lVert a_i \rVert + \varepsilon)`, or 0 where that denominator is 0;
        float32 for float32 ``A``, float64 otherwise (float16, long double and integer
        rows are read as float64, as everywhere in refgeo); norms in float64.

    Notes
    -----
    .. math:: \mathrm{RN}_\varepsilon(A)_i = \frac{a_i}{\lVert a_i \rVert_2 + \varepsilon}

    Time O(Vd).  Every row of the result has norm at most 1 up to rounding (a few
    units of roundoff of the result's dtype: ``< 1`` in exact arithmetic when
    ``eps > 0``, ``= 1`` when ``eps = 0`` and the row is nonzero), so
    :math:`D(\mathrm{RN}(A)) \le 2` up to that rounding.
    Equivariant under row permutations and right-orthogonal transforms, invariant
    under positive row scaling when ``eps = 0``.

    Examples
    --------
    >>> import numpy as np, refgeo
    >>> refgeo.row_normalize(np.array([[3.0, 4.0], [0.0, 0.0]])).tolist()
    [[0.6, 0.8], [0.0, 0.0]]
    """
    A, origin = from_foreign(A, "A")
    A = as_float_array(A, "A", ndim=2, shape_hint="2-D array of shape (V, d)")
    eps = check_real(eps, "eps", min_value=0.0)
    xp = array_namespace(A)
    Af = f64(xp, A)
    # a_i / (m_i v_i + eps) with m_i = max |a_ij| and v_i = ||a_i / m_i|| in [1, sqrt d],
    # evaluated as (a_i / m_i) / (v_i + eps / m_i): no norm overflows (rows near 1e308)
    # or underflows, and with eps = 0 a power-of-two scaling of A changes no bit.
    # Where eps / m_i overflows (m_i below eps / 1.8e308) the norm is negligible
    # next to eps and the plain a_i / (m_i v_i + eps) is safe.
    m = xp.max(xp.abs(Af), axis=1, keepdims=True)
    nonzero = m > 0
    safe = xp.where(nonzero, m, xp.ones_like(m))
    scaled = Af / safe
    v = xp.linalg.vector_norm(scaled, axis=1, keepdims=True)
    # both branches are evaluated for every row, and each overflows on the rows of the
    # other (eps / m_i for tiny rows, a_i / eps for large ones): those values are
    # discarded, so their overflow is not reported
    with np.errstate(over="ignore"):
        q = eps / safe
        fine = q <= _MAX64
        den = xp.where(fine, v + xp.where(fine, q, xp.zeros_like(q)), xp.ones_like(v))
        den = xp.where(den > 0, den, xp.ones_like(den))  # zero rows (set to zero below)
        den_tiny = xp.where(fine, xp.zeros_like(m), m) * v + eps
        N = xp.where(fine, scaled / den, Af / xp.where(den_tiny > 0, den_tiny, xp.ones_like(den_tiny)))
    N = xp.where(nonzero, N, xp.zeros_like(N))
    return to_caller(xp.astype(N, A.dtype) if A.dtype != xp.float64 else N, origin)


def _pow2_scaled(xp, A, k: int):
    """``A * 2**k`` for an integer ``-2098 <= k <= 2046``, rounded once (exact unless a
    result is subnormal): a scale outside the float64 range is applied in two steps."""
    if k == 0:
        return A
    if k >= 1024:  # upscaling is exact while nothing overflows
        h = k // 2
        return (A * math.ldexp(1.0, h)) * math.ldexp(1.0, k - h)
    if k < -1074:
        return (A * math.ldexp(1.0, -1074)) * math.ldexp(1.0, k + 1074)
    return A * math.ldexp(1.0, k)


def _pow2_exponent(A: np.ndarray) -> int:
    """``e`` with ``max |A| * 2**-e`` in [0.5, 1): the exact rescaling that keeps the
    solvers' sums of squares inside the float64 range (0 for a zero array)."""
    m = float(np.max(np.abs(A))) if A.size else 0.0
    return math.frexp(m)[1] if 0.0 < m < math.inf else 0


def projected_rownorm(G: Any, /, *, eta: float = 1.0):
    r"""Projected RowNorm step :math:`S_{RN} = -\tfrac{\eta}{2}\,P\,\mathrm{RN}(PG)`.

    Parameters
    ----------
    G : array_like of shape (V, d)
        Gradient of the head weight.  It is centered first (the formula's inner
        :math:`P`), so any finite ``G`` is accepted.
    eta : float, default=1.0
        Diameter budget, ``> 0``.

    Returns
    -------
    S : ndarray of shape (V, d)
        The step, float32 for float32 ``G``, float64 otherwise;
        :math:`D(S) \le \eta` and :math:`\mathbf{1}^\top S = 0`
        up to rounding: the computed D(S) can exceed η by a few units of roundoff of
        the dtype (the row norms and a float32 cast round).  :func:`rescaled_rownorm`
        returns a step shrunk to stay strictly inside the budget.

    Raises
    ------
    ValueError
        If ``eta`` is below the smallest normal number of ``G``'s dtype (2.2e-308
        for float64, 1.2e-38 for float32: the step's entries would be subnormal and
        its diameter no longer within ``eta``), or if the entries of the step (up to
        ``eta``) do not fit float32 for a float32 ``G`` (``eta`` above about 3.4e38).

    Notes
    -----
    .. math:: S_{RN} = -\frac{\eta}{2} P\, \mathrm{RN}(PG), \qquad
              -\langle G, S_{RN} \rangle = \frac{\eta}{2} \sum_i \lVert (PG)_i \rVert

    It solves the LMO over the radius balls :math:`\max_i \lVert s_i - c \rVert \le \eta/2`
    (any center c; the projection P moves the origin's optimum to a centered step of the
    same decrease) exactly, which lie inside the diameter ball, and achieves at least
    :math:`\sqrt{(k+1)/(2k)} \ge 1/\sqrt{2}` of the optimal decrease
    :math:`\eta\,T(G)` (k = rank G); it is optimal when rank G = 1, and the bound is
    attained by regular-simplex gradients.  Time O(Vd).  Equivariant under row
    permutations and right-orthogonal transforms; invariant under positive scaling of
    ``G`` and a common row shift.

    References
    ----------
    .. [1] LM-head update geometry, arXiv:2608.22253 (v2).

    Examples
    --------
    >>> import numpy as np, refgeo
    >>> refgeo.projected_rownorm(np.array([[2.0, 1.0], [-2.0, -1.0]]), eta=2.0).round(6).tolist()
    [[-0.894427, -0.447214], [0.894427, 0.447214]]
    """
    G, origin = from_foreign(G, "G")
    G = as_float_array(G, "G", ndim=2, shape_hint="2-D array of shape (V, d)")
    eta = _check_eta(eta)
    xp = array_namespace(G)
    tiny = float(xp.finfo(G.dtype).smallest_normal)
    if eta < tiny:
        # as for float64 below its smallest normal: the float32 step's entries would
        # round to a few subnormal values, whose diameter exceeded eta (1.02 eta at 1e-44)
        raise ValueError(
            f"eta == {eta!r}, must be >= {tiny!r} (the smallest normal {G.dtype}) for a {G.dtype} G, "
            "whose dtype the step takes; pass a float64 G for a smaller eta."
        )
    Gf = f64(xp, G)
    # S does not depend on the scale of G: G * 2**-e (max magnitude in [0.5, 1)) keeps
    # the mean from overflowing near 1e308, and a power-of-two scaling of G changes no
    # bit of S
    mx = float(xp.max(xp.abs(Gf))) if Gf.size else 0.0
    Gf = _pow2_scaled(xp, Gf, -math.frexp(mx)[1]) if mx > 0.0 else Gf
    Gc = Gf - xp.mean(Gf, axis=0, keepdims=True)
    N = row_normalize(Gc)
    # the textbook formula, not shrunk: it is the oracle user kernels are compared with
    # (refgeo.testing), so D(S) <= eta holds up to rounding, as documented
    S = (-eta / 2.0) * (N - xp.mean(N, axis=0, keepdims=True))
    # entries up to eta do not fit float32 above 3.4e38: an error, not inf
    S32 = _cast_finite(xp, S, G.dtype)
    if S32 is None:
        raise ValueError(
            f"eta must be small enough for the step to fit the dtype of G ({G.dtype}, max "
            f"{float(np.finfo(np.float32).max)!r}), got {eta!r} instead; pass a smaller eta "
            "or a float64 G."
        )
    return to_caller(S32, origin)


def rescaled_rownorm(G: Any, /, *, eta: float = 1.0):
    r"""RowNorm direction rescaled to the full diameter budget: :math:`-\eta\,\hat G / D(\hat G)`.

    Parameters
    ----------
    G : array_like of shape (V, d)
        Centered gradient (rows summing to about zero; see :func:`diameter_lmo`).
    eta : float, default=1.0
        Diameter budget, ``> 0``.

    Returns
    -------
    S : ndarray of shape (V, d), float64
        :math:`D(S) = \eta` up to rounding (never above it); zero when ``G = 0``.

    Notes
    -----
    .. math:: \hat G = P\,\mathrm{RN}(PG), \qquad
              S = -\eta \frac{\hat G}{D(\hat G)}, \qquad
              -\langle G, S \rangle = \eta \frac{\sum_i \lVert g_i \rVert}{D(\hat G)}
              \ge \frac{\eta}{2} \sum_i \lVert g_i \rVert

    The RowNorm step uses the radius ball, so its diameter :math:`\eta D(\hat G)/2`
    is usually below the budget; rescaling spends the whole budget for one certified
    diameter computation (time O(V^2 d), see :func:`refgeo.row_diameter`).  On
    synthetic cross-entropy gradients it recovers part of the gap between RowNorm and
    the exact LMO, less on larger ones (34% at V = 200, d = 16; 9% at V = 1000, d = 64:
    :doc:`/theory/lmo`).  Equivariant under row permutations and right-orthogonal
    transforms; invariant under positive scaling of ``G`` (G must be centered).

    References
    ----------
    .. [1] LM-head update geometry, arXiv:2608.22253 (v2).

    Examples
    --------
    >>> import numpy as np, refgeo
    >>> G = np.array([[1.0, 0.0], [0.0, 1.0], [-1.0, -1.0]])
    >>> S = refgeo.rescaled_rownorm(G, eta=1.0)
    >>> round(refgeo.row_diameter(S).value, 12)
    1.0
    """
    G, origin = from_foreign(G, "G", host=True)  # NumPy code: a host copy of a CUDA tensor
    rtol_c = _centered_rtol(input_eps(G, origin))
    G = _check_gradient(G)
    eta = _check_eta(eta)
    Gc, _ = _centered_float64(G, rtol_c)  # the direction does not depend on the scale
    N = row_normalize(Gc)
    N = N - N.mean(axis=0, keepdims=True)
    D = row_diameter(N).value
    if D == 0.0:
        return to_caller(np.zeros_like(N), origin)
    return to_caller(_scale_to_budget(N, D, -eta), origin)


def _centered_float64(G, rtol: float = _CENTERED_RTOL) -> tuple[np.ndarray, int]:
    """Checked, centered float64 NumPy copy of a gradient, times ``2**-e``; returns it and ``e``.

    The LMO step does not depend on the scale of G and every bound is positively
    homogeneous, so the solvers work on the rescaled copy (max magnitude in [0.5, 1))
    and multiply values by ``2**e`` at the end: no sum of squares underflows or
    overflows, whatever the scale of G.
    """
    xp = array_namespace(G)
    if not is_numpy_array(G):
        G = np.asarray(G)  # the solver is NumPy code (device arrays are copied)
    del xp
    Gf = np.asarray(G, dtype=np.float64)
    e = _pow2_exponent(Gf)
    if e:
        Gf = np.ldexp(Gf, -e)
    check_centered_rows(Gf, "G", rtol, e)
    return Gf - Gf.mean(axis=0, keepdims=True), e


def _unscaled(values: dict[str, float], e: int, what: str, to_inf: tuple[str, ...] = (),
              down: tuple[str, ...] = ()) -> dict[str, float]:
    """``{name: v * 2**e}``; a ``ValueError`` naming the range when one leaves float64.

    The results are positively homogeneous in G, so a G whose bounds exceed
    ``1.8e308`` has no representable answer: the error says by how much to scale it.
    The values named in ``to_inf`` are upper bounds next to a finite best one: they
    become inf (still an upper bound) instead.  Every value is a bound: those named in
    ``down`` are lower bounds, the others upper bounds, and a product that rounds (in
    the subnormal range, where ``2**e`` drops bits) is rounded the bound's way: to
    nearest, the bracket of a G of about 1e-320 was [5, 5] units where T is 4.63.
    """
    out = {}
    for name, v in values.items():
        if math.isnan(v) or v == 0.0:
            out[name] = v
            continue
        m, ex = math.frexp(v)
        if ex + e > 1024 and name in to_inf:
            out[name] = math.inf
            continue
        if ex + e > 1024:
            raise ValueError(
                f"{what}: {name} == 2**{math.log2(abs(m)) + ex + e:.2f} for this G, beyond the float64 "
                f"range (max {_MAX64!r}); scale G down by 2**{ex + e - 1023} or more (the result is "
                "positively homogeneous in G)."
            )
        r = math.ldexp(v, e)
        if math.ldexp(r, -e) != v:  # rounded (subnormal): ldexp(r, -e) is exact
            if name in down and math.ldexp(r, -e) > v:
                r = math.nextafter(r, -math.inf)
            elif name not in down and math.ldexp(r, -e) < v:
                r = math.nextafter(r, math.inf)
        out[name] = r
    return out


def _scale_to_budget(S: np.ndarray, D: float, factor: float) -> np.ndarray:
    """``factor * S / D`` shrunk by a few ulps so that the certified diameter of the
    result never exceeds ``|factor|`` (the division and product each round once)."""
    return S * ((factor / D) * (1.0 - 8.0 * _EPS64))


# --------------------------------------------------------------------------- bounds


@dataclasses.dataclass(frozen=True, slots=True)
class TensionBounds:
    r"""Closed-form bounds on the tension :math:`T(G)` (the optimal LMO decrease per unit η).

    Attributes
    ----------
    half_sum : float
        :math:`\tfrac12 \sum_i \lVert g_i \rVert` (lower bound; RowNorm's decrease).
    jung : float
        :math:`J_k \sum_i \lVert g_i \rVert` with :math:`J_k = \sqrt{k/(2(k+1))}`
        (upper bound), plus :math:`J_m \sqrt V (\sum_{j > k} \sigma_j^2)^{1/2}`,
        :math:`m = \min(V - 1, d)`, for the singular values of G below the threshold
        of its numerical rank ``k`` (zero when ``k = m``).
    product : float
        :math:`\sqrt{\sum_{i<j} \lVert g_i \rVert \lVert g_j \rVert}` (upper bound).
    pairwise_flow : float
        :math:`\sum_{i<j} \lVert g_i - g_j \rVert / V` (upper bound; ``nan`` when not
        computed).  ``jung``, ``product`` and ``pairwise_flow`` are ``inf`` when they
        are beyond the float64 range while ``upper`` is not.
    lower, upper : float
        The best lower and upper bound; equal to rounding when a closed form applies
        (for ``"rank1"``, up to the part of G below its numerical rank, about
        ``V eps`` relative).
    rank : int
        k, the numerical rank of G (see :func:`tension_bounds`, Notes).
    closed_form : str or None
        ``"zero"``, ``"rank1"`` or ``"two_rows"`` when :math:`T(G)` is known in closed
        form (then ``lower == upper`` to rounding), None otherwise.
    """

    half_sum: float
    jung: float
    product: float
    pairwise_flow: float
    lower: float
    upper: float
    rank: int
    closed_form: str | None


def _numerical_rank(s: np.ndarray, shape: tuple[int, int]) -> int:
    """numpy.linalg.matrix_rank's rule: singular values above max(V, d) * eps * s_max."""
    if s.size == 0 or s[0] == 0.0:
        return 0
    tol = s[0] * max(shape) * _EPS64
    return int(np.count_nonzero(s > tol))


def _jung(k: int) -> float:
    return math.sqrt(k / (2.0 * (k + 1))) if k > 0 else 0.0


def _row_norm_sum_bounds(norms: np.ndarray) -> tuple[float, float]:
    """(sum of norms, product bound) from the row norms, float64."""
    s1 = float(np.sum(norms))
    s2 = float(np.dot(norms, norms))
    return s1, math.sqrt(max(0.0, (s1 * s1 - s2) / 2.0))


def _pairwise_flow(Gc: np.ndarray) -> float:
    """sum_{i<j} ||g_i - g_j|| / V by direct differences, in row blocks (O(V^2 d))."""
    V, d = Gc.shape
    block = max(1, (1 << 22) // max(V * d, 1))
    total = 0.0
    for i0 in range(0, V, block):
        i1 = min(V, i0 + block)
        diff = Gc[i0:i1, None, :] - Gc[None, :, :]
        n = np.sqrt(np.einsum("abk,abk->ab", diff, diff))
        total += float(np.sum(n))
    return total / (2.0 * V)


def _upper_bound_cheap(R: np.ndarray) -> float:
    """O(Vd) upper bound on T(R) for a centered R: min(Σ||r_i||/√2, product bound)."""
    s1, prod = _row_norm_sum_bounds(np.sqrt(np.einsum("ij,ij->i", R, R)))
    return min(s1 / math.sqrt(2.0), prod)


def tension_bounds(G: Any, /, *, pairwise: bool = True) -> TensionBounds:
    r"""Lower and upper bounds on the tension :math:`T(G)`, and its closed forms.

    Parameters
    ----------
    G : array_like of shape (V, d)
        Centered gradient (``||sum_i g_i|| <= 2**-8 * sum_i ||g_i||``, or the eps of
        bfloat16; the remainder is removed, see :func:`diameter_lmo`).
    pairwise : bool, default=True
        Compute the pairwise-flow bound (time O(V^2 d)); when False it is ``nan``.

    Returns
    -------
    bounds : TensionBounds

    Raises
    ------
    ValueError
        If ``G`` is not 2-D with at least 2 rows, has non-finite values, or its rows do
        not sum to about zero.

    Notes
    -----
    .. math::

        \tfrac12 \sum_i \lVert g_i \rVert \le T(G) \le
        \min\Big\{ J_k \sum_i \lVert g_i \rVert,\
        \sqrt{\textstyle\sum_{i<j} \lVert g_i \rVert \lVert g_j \rVert},\
        \tfrac1V \textstyle\sum_{i<j} \lVert g_i - g_j \rVert \Big\}

    with :math:`J_k = \sqrt{k/(2(k+1))} \le 1/\sqrt2`.  The half-sum is exact iff the
    direction measure :math:`\sum_i \lVert g_i \rVert \delta_{\hat g_i}` is antipodally
    symmetric; Jung's bound is exact iff all pairwise row cosines are
    :math:`\ge -1/k` (e.g. regular-simplex rows).  Closed forms are used automatically:
    :math:`G = 0` gives 0, rank 1 (:math:`G = ab^\top`) gives
    :math:`\tfrac12 \lVert a \rVert_1 \lVert b \rVert`, and two rows give
    :math:`\lVert g_1 \rVert`.

    The rank k is numerical: the number of singular values of G above
    ``max(V, d) * eps * s_max`` (NumPy's ``matrix_rank`` rule, eps = 2**-52).  Time
    O(Vd min(V, d)) for the singular values plus O(V^2 d) for the pairwise bound;
    all sums in float64 on G rescaled by a power of two (results exact to a few ulps
    at any scale).  Invariant under row permutations and right-orthogonal
    transforms; positively homogeneous.  A common row shift is not accepted (G must
    be centered, see :func:`diameter_lmo`).

    References
    ----------
    .. [1] LM-head update geometry, arXiv:2608.22253 (v2).

    Examples
    --------
    >>> import numpy as np, refgeo
    >>> b = refgeo.tension_bounds(np.array([[2.0, 0.0], [-1.0, 0.0], [-1.0, 0.0]]))
    >>> b.lower, b.upper, b.closed_form  # rank 1: (1/2) * ||(2, -1, -1)||_1 * 1
    (2.0, 2.0, 'rank1')
    """
    G, origin = from_foreign(G, "G", host=True)  # the result holds floats only
    rtol_c = _centered_rtol(input_eps(G, origin))
    G = _check_gradient(G)
    pairwise = check_bool(pairwise, "pairwise")
    Gc, e = _centered_float64(G, rtol_c)
    V, d = Gc.shape
    norms = np.sqrt(np.einsum("ij,ij->i", Gc, Gc))
    s1, prod = _row_norm_sum_bounds(norms)
    if s1 == 0.0:
        return TensionBounds(0.0, 0.0, 0.0, 0.0 if pairwise else math.nan, 0.0, 0.0, 0, "zero")
    s = np.linalg.svd(Gc, compute_uv=False)
    k = _numerical_rank(s, (V, d))
    half = s1 / 2.0
    jung = _jung(k) * s1
    full = min(V - 1, d)
    if k < full:
        # G has numerical rank k, not rank k: T is a norm, so T(G) <= T(G_k) + T(R) with
        # G_k its rank-k part (row norms no larger than G's: J_k s1 bounds T(G_k)) and
        # R the rest below the rank threshold, T(R) <= J_full sum ||r_i|| <= J_full
        # sqrt(V) ||R||_F.  Dropping R undercut T by 5e-12 on a rank-one G with
        # 3,000 rows of 2e-14 in a plane at 120 degrees (a certified upper bound below T).
        jung += _jung(full) * math.sqrt(V) * float(np.sqrt(np.sum(s[k:] ** 2)))
    pw = _pairwise_flow(Gc) if pairwise else math.nan
    lower, upper = half, min(jung, prod, pw) if pairwise else min(jung, prod)
    closed = None
    exact = _closed_form_value(Gc, k)
    if exact is not None:
        closed, value, residual = exact
        # T is a norm: |T(G) - T(a b^T)| <= T(G - a b^T) <= residual (the part of G
        # below the numerical-rank threshold, zero for an exactly rank-one G)
        lower = max(lower, value - residual)
        upper = min(upper, value + residual)
    lower, upper = _checked_bracket(lower, upper, "tension_bounds")
    names = ("half_sum", "jung", "product", "pairwise_flow", "lower", "upper")
    # a jung, product or pairwise bound beyond the range is inf when the best upper
    # bound is finite (rows near 1e308 raised for a representable T)
    values = _unscaled(dict(zip(names, (half, jung, prod, pw, lower, upper))), e, "tension_bounds",
                       to_inf=("jung", "product", "pairwise_flow"), down=("half_sum", "lower"))
    return TensionBounds(
        half_sum=values["half_sum"], jung=values["jung"], product=values["product"],
        pairwise_flow=values["pairwise_flow"], lower=values["lower"], upper=values["upper"],
        rank=k, closed_form=closed,
    )


def _closed_form_value(Gc: np.ndarray, k: int) -> tuple[str, float, float] | None:
    """(kind, T of the closed-form part, upper bound on T of what the form leaves out)."""
    V = Gc.shape[0]
    if k == 0:
        return "zero", 0.0, 0.0
    if V == 2:
        return "two_rows", float(np.linalg.norm(Gc[0])), 0.0
    if k == 1:
        # G = a b^T with ||b|| = 1: a = G b, b = the top right singular vector.  G has
        # numerical rank one, not rank one: the rest G - a b^T is bounded, not dropped.
        b = _top_right_singular_vector(Gc)
        a = Gc @ b
        R = Gc - np.outer(a, b)
        R -= R.mean(axis=0, keepdims=True)
        return "rank1", 0.5 * float(np.sum(np.abs(a))), _upper_bound_cheap(R)
    return None


def _top_right_singular_vector(Gc: np.ndarray) -> np.ndarray:
    _, _, vt = np.linalg.svd(Gc, full_matrices=False)
    return vt[0]


# --------------------------------------------------------------------------- exact LMO


@dataclasses.dataclass(frozen=True, slots=True)
class LMOResult:
    r"""The steepest-descent step under the row diameter, with a certified bracket.

    Attributes
    ----------
    update : ndarray of shape (V, d)
        The step S (float64, read-only): :math:`D(S) \le \eta` (certified),
        :math:`\mathbf{1}^\top S = 0`.  For a solve stopped above ``rtol`` (by
        ``max_time``, ``max_iter`` or a stalled gap), never a smaller decrease than the
        projected RowNorm step's.
    decrease : float
        :math:`-\langle G, S \rangle` (float64), equal to ``eta * lower_bound``.
    lower_bound, upper_bound : float
        Certified bracket of the tension: ``lower_bound <= T(G) <= upper_bound``.  The
        optimal decrease is ``eta * T(G)``.
    gap : float
        Relative gap ``(upper_bound - lower_bound) / upper_bound`` (0 when both are 0):
        ``decrease >= (1 - gap) * eta * T(G)``.
    pairs : ndarray of shape (m, 2)
        int64 pairs ``(i, j)``, ``i < j``, carrying flow in the returned flow
        (complementary slackness: ``||s_i - s_j|| ~ eta`` on them); for merged rows,
        the largest row of each cluster stands for it.
    flows : ndarray of shape (m,)
        float64 flow magnitudes :math:`\lVert y_{ij} \rVert` on ``pairs``; their sum is
        the flow part of ``upper_bound``.
    iterations : int
        Newton steps, IRLS reweightings or ADMM iterations (0 for a closed form).
    rounds : int
        Separation rounds (working-set updates).
    eta : float
        The budget.
    method : str
        ``"zero"``, ``"rank1"``, ``"two_rows"`` (closed forms), ``"barrier"``,
        ``"irls"`` or ``"admm"`` (see :func:`diameter_lmo`, Notes), or ``"rownorm"``:
        the projected RowNorm step, returned where a solve stopped above ``rtol``
        (``max_time``, ``max_iter``, a stalled gap) decreased less, or where
        ``max_time`` had passed before a solver started (the step may then be
        optimal: ``converged`` says so).  ``pairs`` and ``flows`` are then the flow
        certifying the upper bound (the stopped solver's, or the star flow into the
        longest row where that costs less); complementary slackness does not hold on
        them.
    converged : bool
        ``gap <= rtol`` was reached (closed forms too: the certified gap of ``"zero"``
        and ``"two_rows"`` is a few units of roundoff, that of ``"rank1"`` also holds
        the part of G below its numerical rank, about ``V eps``; an ``rtol`` below
        those is not reached).  For merged rows (see :func:`diameter_lmo`, Notes) the
        method is the merged problem's, and the gap holds the merging bound.
    elapsed : float
        Wall time in seconds.
    """

    update: Any
    decrease: float
    lower_bound: float
    upper_bound: float
    gap: float
    pairs: Any
    flows: Any
    iterations: int
    rounds: int
    eta: float
    method: str
    converged: bool
    elapsed: float


def _relative_gap(lower: float, upper: float) -> float:
    if upper <= 0.0:
        return 0.0
    return max(0.0, (upper - lower) / upper)


def _closed_form_result(Gc, kind, t0, rtol) -> LMOResult:
    """Closed-form LMO for budget 1 (rescaled by :func:`_for_budget`)."""
    V, d = Gc.shape
    if kind == "zero":
        S = np.zeros((V, d))
        value = 0.0
        pairs = np.zeros((0, 2), dtype=np.int64)
        flows = np.zeros(0)
    else:
        b = _top_right_singular_vector(Gc)
        a = Gc @ b
        # Phi = sign(a) b / 2 (D(Phi) = 1 unless a has one sign, impossible for 1^T a = 0);
        # the optimal flow sends mass from the positive to the negative rows.
        Phi = 0.5 * np.sign(a)[:, None] * b[None, :]
        Phi -= Phi.mean(axis=0, keepdims=True)
        D = row_diameter(Phi).value
        S = _scale_to_budget(Phi, D, -1.0)
        pos = np.flatnonzero(a > 0)
        neg = np.flatnonzero(a < 0)
        # a transport plan (north-west corner rule) between the positive and negative parts
        pairs_l, flows_l = [], []
        ap = a[pos].copy()
        an = -a[neg].copy()
        p = q = 0
        while p < len(pos) and q < len(neg):
            m = min(ap[p], an[q])
            if m > 0:
                i, j = int(pos[p]), int(neg[q])
                pairs_l.append((min(i, j), max(i, j)))
                flows_l.append(m)
            ap[p] -= m
            an[q] -= m
            if ap[p] <= an[q]:
                p += 1
            else:
                q += 1
        pairs = np.asarray(pairs_l, dtype=np.int64).reshape(-1, 2)
        flows = np.asarray(flows_l, dtype=np.float64)
        form = _closed_form_value(Gc, 1)  # "two_rows" if V == 2, else "rank1"
        if form is None:
            raise RuntimeError("internal error: no closed form for a rank-one gradient")
        _, value, residual = form
        value += residual
    decrease = -float(np.sum(Gc * S)) + 0.0  # + 0.0: no -0.0 for a zero gradient
    lower, upper = _checked_bracket(decrease, value, f"diameter_lmo ({kind} closed form)")
    gap = _relative_gap(lower, upper)
    return LMOResult(
        update=_readonly(S),
        decrease=decrease,
        lower_bound=lower,
        upper_bound=upper,
        gap=gap,
        pairs=_readonly(pairs),
        flows=_readonly(flows),
        iterations=0,
        rounds=0,
        eta=1.0,
        method=kind,
        # exact in exact arithmetic, but the certified gap is a few ulps: an rtol below
        # it is not reached (as for the iterative solvers, see diameter_lmo's rtol)
        converged=gap <= rtol,
        elapsed=time.perf_counter() - t0,
    )


def _incidence(E: np.ndarray, V: int, dtype=np.float64):
    m = E.shape[0]
    rows = np.concatenate([np.arange(m), np.arange(m)])
    cols = np.concatenate([E[:, 0], E[:, 1]])
    vals = np.concatenate([np.ones(m, dtype=dtype), -np.ones(m, dtype=dtype)])
    return _sp.csr_matrix((vals, (rows, cols)), shape=(m, V))


def _connect(E: np.ndarray, V: int) -> np.ndarray:
    """Add one edge per extra connected component so that the working set is connected
    (extra edges only add constraints: the restricted problem stays a relaxation)."""
    from scipy.sparse.csgraph import connected_components

    A = _sp.coo_matrix((np.ones(len(E)), (E[:, 0], E[:, 1])), shape=(V, V))
    n, labels = connected_components(A, directed=False)
    if n <= 1:
        return E
    reps = np.array([np.flatnonzero(labels == c)[0] for c in range(n)])
    extra = np.stack([np.minimum(reps[:-1], reps[1:]), np.maximum(reps[:-1], reps[1:])], axis=1)
    return np.concatenate([E, extra])


def _unique_pairs(E: np.ndarray) -> np.ndarray:
    E = np.sort(E, axis=1)
    E = E[E[:, 0] != E[:, 1]]
    return np.unique(E, axis=0) if len(E) else E.reshape(0, 2).astype(np.int64)


def _far_pairs(X: np.ndarray, m: int, threshold2: float | None,
               deadline: float | None = None) -> tuple[np.ndarray, float]:
    """Up to ``m`` farthest partners per row (squared distance above ``threshold2`` when
    given), found with the Gram expansion in row blocks, and the largest squared
    distance seen.  A heuristic filter for separation only: every certificate uses the
    certified :func:`refgeo.row_diameter`.  Past ``deadline`` (a ``perf_counter``
    time) the blocks left are skipped: the pairs and the distance are then those of the
    rows seen (O(V^2 r) in all, seconds at V = 8000, which ``max_time`` must cover)."""
    V = X.shape[0]
    m = min(m, V - 1)
    n2 = np.einsum("ij,ij->i", X, X)
    block = max(1, min(V, (1 << 22) // max(V, 1)))
    found = []
    best = 0.0
    for i0 in range(0, V, block):
        i1 = min(V, i0 + block)
        D2 = n2[i0:i1, None] + n2[None, :] - 2.0 * (X[i0:i1] @ X.T)
        D2[np.arange(i1 - i0), np.arange(i0, i1)] = -np.inf
        best = max(best, float(D2.max()))
        idx = np.argpartition(-D2, m - 1, axis=1)[:, :m]
        rows = np.repeat(np.arange(i0, i1), m)
        cols = idx.ravel()
        if threshold2 is not None:
            keep = D2[rows - i0, cols] > threshold2
            rows, cols = rows[keep], cols[keep]
        found.append(np.stack([rows, cols], axis=1))
        if deadline is not None and time.perf_counter() >= deadline:
            break
    E = np.concatenate(found) if found else np.zeros((0, 2), dtype=np.int64)
    return _unique_pairs(E.astype(np.int64)), best


def _max_sq_distance(X: np.ndarray) -> float:
    """Largest squared row distance by the Gram expansion in row blocks (an estimate;
    certificates use :func:`refgeo.row_diameter`)."""
    V = X.shape[0]
    n2 = np.einsum("ij,ij->i", X, X)
    block = max(1, min(V, (1 << 22) // max(V, 1)))
    best = 0.0
    for i0 in range(0, V, block):
        i1 = min(V, i0 + block)
        D2 = n2[i0:i1, None] + n2[None, :] - 2.0 * (X[i0:i1] @ X.T)
        best = max(best, float(D2.max()))
    return best


class _LaplacianSolver:
    """Solves (B^T B + 11^T/V) z = b for centered right-hand sides.

    Dense Cholesky for small V; block preconditioned CG (Jacobi, warm-started) above.
    """

    def __init__(self, B, V: int, dense_limit: int):
        self.B = B
        self.V = V
        self.dense = V <= dense_limit
        L = (B.T @ B).tocsr()
        if self.dense:
            M = L.toarray() + 1.0 / V
            self.cf = _sla.cho_factor(M, lower=True, check_finite=False)
        else:
            self.L = L
            self.dinv = 1.0 / (L.diagonal() + 1.0 / V)

    def solve(self, b: np.ndarray, x0: np.ndarray | None, tol: float, max_cg: int = 200) -> np.ndarray:
        if self.dense:
            return _sla.cho_solve(self.cf, b, check_finite=False)
        L, dinv = self.L, self.dinv
        x = np.zeros_like(b) if x0 is None else x0.copy()
        r = b - (L @ x) - x.mean(axis=0, keepdims=True)
        z = dinv[:, None] * r
        p = z.copy()
        rz = np.einsum("ij,ij->j", r, z)
        bn = max(float(np.abs(b).sum()), 1e-300)
        for _ in range(max_cg):
            if float(np.abs(r).sum()) <= tol * bn:
                break
            Ap = (L @ p) + p.mean(axis=0, keepdims=True)
            pAp = np.einsum("ij,ij->j", p, Ap)
            alpha = np.where(pAp > 0, rz / np.where(pAp > 0, pAp, 1.0), 0.0)
            x += alpha * p
            r -= alpha * Ap
            z = dinv[:, None] * r
            rz_new = np.einsum("ij,ij->j", r, z)
            beta = np.where(rz > 0, rz_new / np.where(rz > 0, rz, 1.0), 0.0)
            p = z + beta * p
            rz = rz_new
        return x


# --------------------------------------------------------------------------- progress

class _GapProgress:
    """Progress of a solve, measured by the certified-gap estimate on a log scale.

    A :class:`refgeo._progress.Progress` over a total of 1.0: ``done`` goes from 0 (the
    first estimate) to 1 (``rtol``) and never back; the reporter throttles a callable
    to 4 calls a second from the calling thread and reports the end once.
    """

    def __init__(self, progress: Any) -> None:
        self.bar = _progress.Progress(progress, 1.0, desc="diameter_lmo", unit="")
        self.first: float | None = None

    def update(self, gap: float, rtol: float, pairs: int) -> None:
        gap = max(gap, rtol * 1e-3)
        if self.first is None:
            self.first = max(gap, rtol)
        span = math.log(self.first / rtol)
        done = 1.0 if gap <= rtol else (math.log(self.first / gap) / span if span > 0 else 0.0)
        self.bar.postfix(gap=f"{gap:.2e}", pairs=pairs)
        self.bar.update_to(min(1.0, max(done, 0.0)))

    def close(self) -> None:
        # the end is reported once, with done == total, also when the solve stops short
        # of rtol (max_iter, max_time, the callback): a callable heard only the start, or
        # a last fraction no different from a report in passing, and a bar stayed open
        self.bar.finish()
        self.bar.close()


# --------------------------------------------------------------------------- aggregation


@dataclasses.dataclass(frozen=True, slots=True)
class _Aggregation:
    """Rows merged into clusters: ``labels`` (V,), the merged rows ``rows`` (V', d) =
    cluster sums, a representative row per cluster (its largest), and ``error``, an
    upper bound on what merging can cost in T (see :func:`_aggregate`)."""

    labels: np.ndarray
    rows: np.ndarray
    reps: np.ndarray
    error: float


def _aggregate(Gc: np.ndarray, budget: float, deadline: float | None = None) -> _Aggregation | None:
    r"""Merge nearly collinear rows while the bound on the cost stays within ``budget``.

    For a partition of the rows into clusters C with sums :math:`g_C` and weights
    :math:`w_i = \lVert g_i \rVert / \sum_{j \in C} \lVert g_j \rVert`, let
    :math:`\tilde G` have rows :math:`w_i g_C`.  Then
    :math:`T(\tilde G) = T(G_{\text{merged}})` (the V' rows :math:`g_C`: a convex
    combination of points at pairwise distance <= 1 keeps that distance), the merged
    potentials repeated over each cluster are feasible for G, and

    .. math:: T_{\text{merged}} \le T(G) \le T_{\text{merged}} + \sum_C U(G_C - \tilde G_C)

    with U the cheap bound on the centered residual of each cluster (exactly zero for
    collinear rows and duplicates).  Clusters are split top-down (the one with the
    largest bound first, along the principal direction of its unit rows' deviations)
    until the bound is below ``budget``.  Returns None when no two rows merge, or
    when the splitting is still running at ``deadline`` (a ``perf_counter`` time): the
    rows are then solved unmerged.  Time O(V r log V') for V' clusters.
    """
    V, d = Gc.shape
    n = np.sqrt(np.einsum("ij,ij->i", Gc, Gc))
    live = np.flatnonzero(n > 0)
    Un = Gc[live] / n[live, None]
    w_all = n[live]

    def bound(pos):  # cluster positions into live -> (estimate of U(G_C - G~_C), deviations)
        w = w_all[pos]
        m = (w @ Un[pos]) / w.sum()
        dev = Un[pos] - m
        return float(w @ np.sqrt(np.einsum("ij,ij->i", dev, dev))) / math.sqrt(2.0), dev

    import heapq

    root = np.arange(len(live))
    e0, dev0 = bound(root)
    heap = [(-e0, 0, root, dev0)]
    total, counter, done = e0, 0, []
    while heap and total > budget:
        if deadline is not None and time.perf_counter() >= deadline:
            return None
        neg, _, pos, dev = heapq.heappop(heap)
        if len(pos) == 1:
            done.append(pos)
            continue
        w = w_all[pos]
        p = dev[int(np.argmax(w * np.einsum("ij,ij->i", dev, dev)))].copy()
        for _ in range(2):  # a few power steps towards the principal deviation
            p = (w[:, None] * dev).T @ (dev @ p)
            pn = float(np.linalg.norm(p))
            if pn == 0.0:
                break
            p /= pn
        side = dev @ p > 0
        a, b = pos[side], pos[~side]
        if len(a) == 0 or len(b) == 0:  # identical directions with a positive bound: rounding
            a, b = pos[: len(pos) // 2], pos[len(pos) // 2:]
        total += neg
        for part in (a, b):
            ep, dp = bound(part)
            total += ep
            counter += 1
            # the heap's clusters partition the rows: their cached deviations take
            # one (V, d) array in all
            heapq.heappush(heap, (-ep, counter, part, dp))
    clusters = done + [h[2] for h in heap]
    del heap
    n_clusters = len(clusters) + (1 if len(live) < V else 0)
    if n_clusters >= V:
        return None
    labels = np.empty(V, dtype=np.int64)
    for c, pos in enumerate(clusters):
        labels[live[pos]] = c
    if len(live) < V:
        labels[n <= 0] = len(clusters)  # zero rows: one cluster of their own, at no cost
    Vm = n_clusters
    rows = np.zeros((Vm, d))
    np.add.at(rows, labels, Gc)
    # the certified cost, from the rows themselves: U of each centered residual
    # G_C - w g_C (the heap's values are estimates from the unit rows)
    Nc = np.bincount(labels, weights=n, minlength=Vm)
    wi = np.where(Nc[labels] > 0, n / np.where(Nc[labels] > 0, Nc[labels], 1.0), 0.0)
    R = Gc - wi[:, None] * rows[labels]
    rn = np.sqrt(np.einsum("ij,ij->i", R, R))
    s1 = np.bincount(labels, weights=rn, minlength=Vm)
    s2 = np.bincount(labels, weights=rn * rn, minlength=Vm)
    prod = np.sqrt(np.maximum(0.0, (s1 * s1 - s2) / 2.0))
    error = float(np.sum(np.minimum(s1 / math.sqrt(2.0), prod)))
    order = np.lexsort((-n, labels))  # within each cluster, the largest row first
    first = np.ones(V, dtype=bool)
    first[1:] = labels[order][1:] != labels[order][:-1]
    reps = np.empty(Vm, dtype=np.int64)
    reps[labels[order][first]] = order[first]
    return _Aggregation(labels=labels, rows=rows, reps=reps, error=error)


def _merged_warm_start(warm: LMOResult, agg: _Aggregation) -> LMOResult:
    """A full-size warm start mapped to the clusters (representative rows' steps,
    inter-cluster pairs with their flows summed)."""
    upd = np.asarray(warm.update, dtype=np.float64)[agg.reps]
    P = agg.labels[np.asarray(warm.pairs, dtype=np.int64).reshape(-1, 2)]
    f = np.asarray(warm.flows, dtype=np.float64).reshape(-1)
    if len(f) != len(P):
        f = np.zeros(len(P))
    P, f = _canonical_pairs(P, f)
    return dataclasses.replace(warm, update=upd, pairs=P, flows=f)


def _canonical_pairs(P: np.ndarray, f: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pairs ``(i, j)`` as ``i < j``, sorted and unique, with the flows of repeated pairs
    summed and self-pairs dropped: the form of the ADMM's working set, in which a warm
    start's flows are looked up (a pair given as ``(j, i)`` fell outside it, or onto
    another pair's flow)."""
    keep = P[:, 0] != P[:, 1]
    P, f = np.sort(P[keep], axis=1), f[keep]
    if len(P):
        P, inv = np.unique(P, axis=0, return_inverse=True)
        f = np.asarray(np.bincount(inv.reshape(-1), weights=f, minlength=len(P)), dtype=np.float64)
    return P.reshape(-1, 2).astype(np.int64), f


def _lifted(res: LMOResult, agg: _Aggregation, Gc: np.ndarray, t0: float, rtol: float) -> LMOResult:
    """The merged problem's result as a result for G: each row takes its cluster's
    step (same diameter), the decrease is evaluated on G, and the merging bound is
    added to the upper bound."""
    S = np.asarray(res.update)[agg.labels]
    # Repeating each cluster's step over its rows keeps D but not 1^T S = 0 (clusters
    # have different sizes): remove the mean row.  A common shift of all rows changes
    # D by rounding only, D(1 + eps) at most, inside the margin of _scale_to_budget.
    S = S - S.mean(axis=0, keepdims=True)
    decrease = -float(np.sum(Gc * S))
    lower, upper = _checked_bracket(decrease, res.upper_bound + agg.error, "diameter_lmo (merged rows)")
    P = agg.reps[np.asarray(res.pairs, dtype=np.int64).reshape(-1, 2)]
    P = np.sort(P, axis=1)
    order = np.lexsort((P[:, 1], P[:, 0]))
    gap = _relative_gap(lower, upper)
    return dataclasses.replace(
        res,
        update=_readonly(S),
        decrease=decrease,
        lower_bound=lower,
        upper_bound=upper,
        gap=gap,
        pairs=_readonly(np.ascontiguousarray(P[order])),
        flows=_readonly(np.asarray(res.flows)[order]),
        converged=gap <= rtol,
        elapsed=time.perf_counter() - t0,
    )


# --------------------------------------------------------------------------- IRLS


class _IRLS:
    r"""Reweighted electrical flows on the complete graph of a small problem (V' rows).

    Conductances :math:`c_e > 0` on all pairs give the potentials
    :math:`X = L_c^{-1} H` (L_c the weighted Laplacian) and the flow
    :math:`y_e = c_e (x_i - x_j)`, whose divergence is H: both halves of a
    certificate from one dense solve,

    .. math:: \frac{\langle H, X \rangle}{D(X)} \le T \le \sum_e c_e \lVert x_i - x_j \rVert .

    The update :math:`c_e \leftarrow c_e (d_e / D)^2` (with momentum in
    :math:`\log c`) is alternating minimization of the jointly convex
    :math:`\sum_e \lVert y_e \rVert^2 / (2 c_e) + c_e / 2`, sped up; its fixed points
    stretch every flowing pair to the diameter (complementary slackness).
    """

    def __init__(self, H, Q, Gm, scale, rtol, max_time, max_iter, warm, callback, bar, t0):
        self.H, self.Q, self.Gm, self.scale = H, Q, Gm, scale
        self.rtol, self.max_time, self.max_iter = rtol, max_time, max_iter
        self.callback, self.bar, self.t0 = callback, bar, t0
        self.V, self.r = H.shape
        V = self.V
        self.lc = np.zeros((V, V))  # log-conductances: all pairs alike to start
        del warm  # cold start (see _solve)
        self.iterations = 0
        self.rounds = 0
        self.cert_time = None
        self.iter_time = 0.0

    def _elapsed(self):
        return time.perf_counter() - self.t0

    def seed(self, C) -> None:
        """Go on from the conductances ``C`` (a symmetric (V', V') matrix), the barrier
        method's multipliers where it stopped short.  Their potentials are not quite
        the barrier's iterate (the multipliers span nine orders of magnitude, and the
        small residual of their divergence moves the potentials: the first gap was
        5.3e-3 where the barrier's was 1.7e-4, at isotropic (400, 2)), but the
        reweighting converges from them: rtol 1e-4 in about 220 iterations, against
        940 from the probe's own conductances."""
        C = np.array(C, dtype=np.float64)
        np.fill_diagonal(C, 0.0)
        top = float(C.max()) if C.size else 0.0
        if not (top > 0.0 and math.isfinite(top)):
            return  # nothing to go on from: the solver keeps its own conductances
        with np.errstate(divide="ignore"):
            lc = np.log(np.maximum(C, 0.0) / top)  # pairs without flow: -inf, floored
        self.lc = np.maximum(lc, _IRLS_LOG_FLOOR)

    def _out_of_budget(self):
        if self.max_time is not None:
            # keep time for one certification (its last cost; before the first, three
            # of the fastest iterations' worth)
            reserve = self.cert_time if self.cert_time is not None else 3.0 * self.iter_time
            if self._elapsed() + reserve >= self.max_time:
                return True
        return self.max_iter is not None and self.iterations >= self.max_iter

    def _solve(self, lc):
        """(potentials X, conductances C) for log-conductances lc."""
        V = self.V
        C = np.exp(lc - lc.max())
        np.fill_diagonal(C, 0.0)
        L = np.diag(C.sum(axis=1)) - C + 1.0 / V
        X = _sla.cho_solve(_sla.cho_factor(L, lower=True, check_finite=False), self.H, check_finite=False)
        return X - X.mean(axis=0, keepdims=True), C

    def _certify_lower(self, X):
        """Certified lower bound (unscaled) from potentials X, with its step S."""
        Phi = X @ self.Q.T
        Phi -= Phi.mean(axis=0, keepdims=True)
        D = row_diameter(Phi).value
        S = _scale_to_budget(Phi, D, -1.0)
        return -float(np.sum(self.Gm * S)), S

    def _certify_upper(self, X, C):
        """Certified upper bound (unscaled) from the flow y_e = c_e (x_i - x_j): its cost
        plus the cheap bound on G minus its divergence L X.

        The cost uses the Gram expansion of the squared distances (one GEMM) raised by
        its rounding bound: ``|fl(n_i + n_j - 2 x_i.x_j) - d_ij^2| <= (r + 2) eps
        (n_i + n_j + 2 |x_i||x_j|) <= 2 (r + 2) eps (n_i + n_j)``, doubled for margin.
        """
        n2 = np.einsum("ij,ij->i", X, X)
        D2 = n2[:, None] + n2[None, :] - 2.0 * (X @ X.T)
        slack = (4.0 * (self.r + 2) * _EPS64) * (n2[:, None] + n2[None, :])
        Dup = np.sqrt(np.maximum(D2, 0.0) + slack)
        np.fill_diagonal(Dup, 0.0)
        cost = 0.5 * float(np.sum(C * Dup)) * (1.0 + 4.0 * _EPS64 * self.V) * self.scale
        div = (C.sum(axis=1)[:, None] * X - C @ X) @ self.Q.T * self.scale
        R = self.Gm - div
        R -= R.mean(axis=0, keepdims=True)
        return cost + _upper_bound_cheap(R)

    def run(self) -> LMOResult:
        best_lo, best_up = -np.inf, np.inf
        best_X = best_C = best_CX = None
        lc_prev = self.lc
        cert_trigger = max(0.9 * self.rtol, 2.0 * _GAP_FLOOR)
        certified = None
        stop = False
        iu = np.triu_indices(self.V, 1)
        evaluations = 0
        while True:
            ti = time.perf_counter()
            X, C = self._solve(self.lc)
            Dm = np.sqrt(_sq_distances(X))
            dmax = float(Dm.max())
            lo = float(np.sum(self.H * X)) / dmax if dmax > 0 else 0.0
            up = float(np.sum(C[iu] * Dm[iu]))
            if lo > best_lo:
                best_lo, best_X = lo, X
            if up < best_up:
                best_up, best_C, best_CX = up, C, X
            gap_est = _relative_gap(best_lo, best_up)
            evaluations += 1
            # the fastest iteration: one slowed by other work must not end the solve
            dt = time.perf_counter() - ti
            self.iter_time = dt if evaluations == 1 else min(self.iter_time, dt)
            budget_out = self._out_of_budget()
            if evaluations % _IRLS_ROUND == 1 or gap_est <= cert_trigger or budget_out:
                self.rounds += 1
                info = dict(iteration=self.iterations, rounds=self.rounds, pairs=len(iu[0]),
                            lower=best_lo * self.scale, upper=best_up * self.scale, gap=gap_est,
                            elapsed=self._elapsed())
                if self.bar is not None:
                    self.bar.update(gap_est, self.rtol, len(iu[0]))
                if self.callback is not None and bool(self.callback(info)):
                    stop = True
            if gap_est <= cert_trigger or stop or budget_out:
                tc = time.perf_counter()
                lower, S = self._certify_lower(best_X)
                upper = self._certify_upper(best_CX, best_C)
                certified = (lower, upper, S)
                self.cert_time = time.perf_counter() - tc
                if _relative_gap(lower, upper) <= self.rtol or stop or budget_out:
                    break
                cert_trigger = min(cert_trigger, gap_est) / 2.0
                if cert_trigger < _GAP_FLOOR:
                    break
            step = _IRLS_POWER * np.log(np.maximum(Dm, _TINY64) / dmax)
            new = self.lc + step + _IRLS_MOMENTUM * (self.lc - lc_prev)
            lc_prev = self.lc
            self.lc = np.maximum(new - new.max(), _IRLS_LOG_FLOOR)
            self.iterations += 1
        lower, upper, S = certified
        lower, upper = _checked_bracket(lower, upper, "diameter_lmo")
        if best_C is None or best_CX is None:
            raise RuntimeError("internal error: IRLS certified no iterate")
        return self._flow_result(lower, upper, S, best_C, best_CX, iu, "irls")

    def _flow_result(self, lower, upper, S, C, X, pairs_ij, method):
        """The LMOResult of a certified bracket, with the flows c_e ||x_i - x_j|| of the
        multipliers C at the iterate X over the pairs ``pairs_ij`` = (I, J), the
        negligible ones (below a fraction of the largest) left out."""
        I, J = pairs_ij
        fl = C[I, J] * np.sqrt(_sq_distances(X)[I, J]) * self.scale
        keep = fl > _IRLS_FLOW_CUT * fl.max() if fl.size and fl.max() > 0 else np.zeros(fl.shape, dtype=bool)
        gap = _relative_gap(lower, upper)
        return LMOResult(
            update=_readonly(S),
            decrease=lower,
            lower_bound=lower,
            upper_bound=upper,
            gap=gap,
            pairs=_readonly(np.stack([I[keep], J[keep]], axis=1).astype(np.int64)),
            flows=_readonly(fl[keep]),
            iterations=self.iterations,
            rounds=self.rounds,
            eta=1.0,
            method=method,
            converged=gap <= self.rtol,
            elapsed=self._elapsed(),
        )


class _Barrier(_IRLS):
    r"""Primal barrier (interior-point) method for small problems (V' r up to a few hundred).

    Maximizes :math:`t \langle H, X \rangle + \sum_{i<j} \log(1 - \lVert x_i - x_j \rVert^2)`
    by damped Newton steps (dense Hessian, O((V' r)^3) per step) for t growing by 4
    per stage (by 2 once a stage has not centered; two such stages in a row end it).
    Its multipliers :math:`c_e = 2 / (t (1 - d_e^2))` define the flow
    :math:`y_e = c_e (x_i - x_j)` with divergence H at the central point, so it is
    certified exactly as the IRLS flows are; the central-path gap is m / t.  It
    converges in a few dozen Newton steps where first-order methods crawl on
    degenerate (collinear, duplicated) rows.
    """

    multipliers: np.ndarray | None = None  # those of the result, for the IRLS after it

    def run(self) -> LMOResult:
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            return self._run()

    def _run(self) -> LMOResult:
        V, r = self.V, self.r
        H = self.H
        I, J = np.triu_indices(V, 1)
        m = len(I)
        nh = np.sqrt(np.einsum("ij,ij->i", H, H))
        X = 0.45 * H / np.where(nh > 0, nh, 1.0)[:, None]
        X -= X.mean(axis=0, keepdims=True)
        t = float(m)
        # Newton steps per stage: in low dimension a stage can take a long damped
        # phase of full steps whose decrement stays near 3 (isotropic (300, 2): 69 and
        # 198 steps at t = 1.8e8 and 7.3e8), after which the next stages center in a
        # few dozen; cut at 50 such stages "did not center", and the solve ended
        # unconverged (rtol 1e-5 in 19.7 s; with 200 steps converged in 13.7 s).  The
        # cap is 50 steps or the steps that fit 2 s by the cost model, up to 200: a
        # stage that does not center costs that much at most
        step_s = _BARRIER_NEWTON_S_PER_VR3 * float(V * r) ** 3
        newton = _BARRIER_NEWTON_MAX if not step_s > 0.0 else int(
            min(_BARRIER_NEWTON_MAX, max(_BARRIER_NEWTON, _BARRIER_STAGE_S / step_s)))
        eye = np.eye(r)
        certified = None
        stop = False
        best = None

        D = X[I] - X[J]
        s = 1.0 - np.einsum("ij,ij->i", D, D)
        growth = _BARRIER_GROWTH
        uncentered = 0  # stages in a row that did not center
        stage = (np.inf, None, None)  # the stage of least estimated gap: (gap, X, C)
        while True:
            dec_prev = np.inf
            centered = False
            for _ in range(newton):
                if self._out_of_budget():
                    break
                ti = time.perf_counter()
                g, Hm = self._newton_system(t, X, D, s, I, J)
                step = -_ridge_solve(Hm, g.reshape(-1)).reshape(V, r)
                step -= step.mean(axis=0, keepdims=True)
                dec = -float(np.sum(g * step))
                if not dec > 0.0:
                    break
                # the change of the barrier function from differences (its value is of
                # order t and would drown late decreases in rounding)
                DS = step[I] - step[J]
                dd = np.einsum("ij,ij->i", D, DS)
                ss = np.einsum("ij,ij->i", DS, DS)
                hs = float(np.sum(H * step))
                a = 1.0
                while a >= 1e-12:
                    ds = -(2.0 * a * dd + a * a * ss)  # s_new - s
                    if np.all(s + ds > 0.0):
                        df = -t * a * hs - float(np.sum(np.log1p(ds / s)))
                        if df <= -0.25 * a * dec:
                            break
                    a *= 0.5
                if a < 1e-12:
                    break
                X = X + a * step
                D = X[I] - X[J]
                s = 1.0 - np.einsum("ij,ij->i", D, D)
                self.iterations += 1
                # the fastest step: the reserve kept for the certificate (about two steps)
                dt = time.perf_counter() - ti
                self.iter_time = dt if self.iter_time == 0.0 else min(self.iter_time, dt)
                # centered: the Newton decrement has converged quadratically, or it
                # stalls at the rounding noise of the slacks (it grows as (eps / s)^2:
                # about 1e-12 with slacks near 1e-10, 1e-6 near 1e-13), where further
                # steps only cost time
                if dec <= _BARRIER_CENTERED or (dec <= 1e-2 and dec >= 0.25 * dec_prev):
                    centered = True
                    break
                dec_prev = dec
            C = self._polished_flow(X, D, s, t, I, J)
            dmax = math.sqrt(max(0.0, float(np.max(1.0 - s))))
            lo = float(np.sum(H * X)) / dmax if dmax > 0 else 0.0
            # the flow's cost and what its residual divergence costs, as the certificate
            # charges it (so that the reported gap is not below the certified one)
            R = H - (C.sum(axis=1)[:, None] * X - C @ X)
            R -= R.mean(axis=0, keepdims=True)
            up = float(np.sum(C[I, J] * np.sqrt(np.maximum(1.0 - s, 0.0)))) + _upper_bound_cheap(R)
            gap_est = _relative_gap(lo, up)
            if gap_est < stage[0]:
                stage = (gap_est, X, C)
            self.rounds += 1
            info = dict(iteration=self.iterations, rounds=self.rounds, pairs=m, lower=lo * self.scale,
                        upper=up * self.scale, gap=gap_est, elapsed=self._elapsed())
            if self.bar is not None:
                self.bar.update(gap_est, self.rtol, m)
            if self.callback is not None and bool(self.callback(info)):
                stop = True
            budget_out = self._out_of_budget()
            # the last stage float64 can follow: slacks 1 - d^2 near rounding
            floor = m / t < _GAP_FLOOR * max(lo, _TINY64) or float(s.min()) < _BARRIER_MIN_SLACK
            if gap_est <= 0.5 * self.rtol or stop or budget_out or floor:
                lower, S = self._certify_lower(X)
                upper = self._certify_upper(X, C)
                if best is None or _relative_gap(lower, upper) < _relative_gap(*best[:2]):
                    best = (lower, upper, S, C, X)
                if _relative_gap(lower, upper) <= self.rtol or stop or budget_out or floor:
                    break
            # A stage that does not center within its Newton steps leaves the path, and
            # a long step of t from there did not come back (isotropic (200, 3) at rtol
            # 1e-4: stages of 50 steps from a gap of 1.2e-4 on, 6 times as long as with
            # shorter steps); the slack floor and the Hessian's conditioning can also
            # keep every later stage off the path (isotropic (500, 2) at rtol 1e-4, with
            # its 90 steps), where the other solver takes over
            uncentered = 0 if centered else uncentered + 1
            if uncentered >= _BARRIER_GIVE_UP:
                lower, S = self._certify_lower(X)
                upper = self._certify_upper(X, C)
                if best is None or _relative_gap(lower, upper) < _relative_gap(*best[:2]):
                    best = (lower, upper, S, C, X)
                break
            if not centered:
                growth = _BARRIER_SLOW_GROWTH
            t *= growth
        if stage[1] is not None and (best is None or (stage[1] is not best[4]
                                                     and stage[0] < _relative_gap(*best[:2]))):
            # a stage that left the path ends worse than one before it (isotropic
            # (400, 2) at rtol 1e-4: 1.7e-4, then 3.9e-3 at the stage that gave up):
            # the best stage is certified too
            lower, S = self._certify_lower(stage[1])
            upper = self._certify_upper(stage[1], stage[2])
            if best is None or _relative_gap(lower, upper) < _relative_gap(*best[:2]):
                best = (lower, upper, S, stage[2], stage[1])
        lower, upper, S, C, X = best
        self.multipliers = C
        lower, upper = _checked_bracket(lower, upper, "diameter_lmo")
        return self._flow_result(lower, upper, S, C, X, (I, J), "barrier")

    def _newton_system(self, t, X, D, s, I, J):
        r"""Gradient (V, r) and Hessian (V r, V r) of the barrier objective's negative
        at X, with the translations' null space fixed by adding 11^T / V.

        Pair e = (i, j) contributes :math:`a_e (x_i - x_j)` to the gradient and
        :math:`a_e I + b_e D_e D_e^\top` (a Laplacian block) to the Hessian, with
        :math:`a_e = 2 / s_e`, :math:`b_e = 4 / s_e^2`.
        """
        A = np.zeros((self.V, self.V))
        A[I, J] = A[J, I] = 2.0 / s
        g = A.sum(axis=1)[:, None] * X - A @ X - t * self.H  # the Laplacian of A on X
        return g, _block_laplacian(A, I, J, (2.0 / s)[:, None] * D)

    def _polished_flow(self, X, D, s, t, I, J):
        r"""Multipliers (a symmetric (V, V) matrix) with divergence H at X to rounding.

        The central multipliers :math:`c_e = 2 / (t s_e)` miss H by the centering
        residual, and their divergence, a sum of terms of size 1 / s_e, carries the
        slacks' rounding (eps / s_e relative): the certified upper bound stalled near
        a gap of 1e-7 however far the stages went.  They are corrected by the least
        change :math:`\sum_e c_e u_e^2` with :math:`\operatorname{div}(c (1 + u)) = H`,
        i.e. :math:`u_e = (\lambda_i - \lambda_j) \cdot D_e` with
        :math:`K \lambda = H - \operatorname{div} c`, K the stiffness matrix of all
        pairs weighted by c (rigid: the graph is complete): one factorization of the
        Newton system's size, refined by repeated solves for what is left (K is
        ill-conditioned late; one solve left 1e-11 of H).  The correction is of the
        order of the residual, so the multipliers stay positive; any clipped to zero
        leave a residual that the certificate charges.
        """
        V, r = self.V, self.r
        c = 2.0 / (t * s)
        A = np.zeros((V, V))
        A[I, J] = A[J, I] = c
        solve = _ridge_factor(_block_laplacian(None, I, J, np.sqrt(c)[:, None] * D, V=V))
        u = np.zeros_like(c)
        best, best_res = c, np.inf
        for _ in range(_POLISH_STEPS):
            # the residual of the current multipliers and the least change removing it;
            # repeated with the same factor (iterative refinement: one solve left about
            # 1e-11 of H where K is ill-conditioned)
            R = self.H - (A.sum(axis=1)[:, None] * X - A @ X)
            res = float(np.max(np.abs(R)))
            if not res < best_res:
                break
            best, best_res = A[I, J].copy(), res
            lam = solve(R.reshape(-1)).reshape(V, r)
            du = np.einsum("ij,ij->i", lam[I] - lam[J], D)
            if not np.all(np.isfinite(du)):
                break
            u += du
            A[I, J] = A[J, I] = np.maximum(c * (1.0 + u), 0.0)
        R = self.H - (A.sum(axis=1)[:, None] * X - A @ X)
        if not float(np.max(np.abs(R))) < best_res:
            A[I, J] = A[J, I] = best
        return A


def _block_laplacian(A, I, J, W, V=None):
    r"""The (V r, V r) matrix :math:`\sum_e (a_e I_r + w_e w_e^\top) \otimes
    (e_i - e_j)(e_i - e_j)^\top` over the pairs (I, J) (each unordered pair once),
    plus :math:`(1 1^\top / V) \otimes I_r`, which fixes the translations (its null
    space otherwise) without changing a solution orthogonal to them.

    A is the symmetric (V, V) matrix of the scalar weights a_e (None for zero) and W
    the (m, r) rank-one parts.  The off-diagonal blocks are assigned and the diagonal
    ones summed from them: a dense (V, r, V, r) product instead of scattered
    additions (which took half of a Newton step's time).
    """
    V = A.shape[0] if V is None else V
    r = W.shape[1]
    Wf = np.zeros((V, V, r))
    Wf[I, J] = Wf[J, I] = W
    M = np.einsum("ijp,ijq->ipjq", Wf, Wf)
    idx = np.arange(r)
    if A is not None:
        M[:, idx, :, idx] += A
    M = -M
    rows = np.arange(V)
    M[rows, :, rows, :] = -M.sum(axis=2)  # minus the sum of the row's off-diagonal blocks
    M[:, idx, :, idx] += 1.0 / V
    return M.reshape(V * r, V * r)


def _ridge_solve(A: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Solve the symmetric positive (semi)definite A x = b (see :func:`_ridge_factor`)."""
    return _ridge_factor(A)(b)


def _ridge_factor(A: np.ndarray):
    """A solver of the symmetric positive (semi)definite A x = b: Cholesky of the
    diagonally scaled matrix (late barrier stages spread the diagonal over many orders
    of magnitude), adding a growing ridge when it is numerically singular (a damped
    Newton step stays a descent direction); if even that fails, a solver that returns
    zeros (no step: the caller's stage ends as centered, its certificate unchanged)."""
    dg = np.sqrt(np.maximum(np.diag(A), _TINY64))
    As = A / dg[:, None] / dg[None, :]
    ridge = 0.0
    for _ in range(8):
        try:
            cf = _sla.cho_factor(As + ridge * np.eye(len(As)) if ridge else As, lower=True, check_finite=False)
            return lambda b: _sla.cho_solve(cf, b / dg, check_finite=False) / dg
        except np.linalg.LinAlgError:
            ridge = 1e-14 if ridge == 0.0 else 100.0 * ridge
    return _no_step


def _no_step(b: np.ndarray) -> np.ndarray:
    """The solver :func:`_ridge_factor` returns when no factorization succeeds."""
    return np.zeros_like(b)


_BARRIER_LIMIT = 400  # V' * r up to which the dense barrier method is used
_BARRIER_TIGHT_LIMIT = 2500  # V' * r (a Newton step: about 0.2 s on one core at 2000)
_FALLBACK = "fallback"  # the budget of the first-order solver after the barrier method:
_FALLBACK_MIN_S = 1.0  # this many seconds or
_FALLBACK_FACTOR = 2.0  # this times the call's time so far, whichever is longer
_BARRIER_PROBE_S = 2.0  # the probe's seconds at V' r <= 1000, growing as the square: half
# the barrier method's time, measured (4 s at 960, 16 s at 2000 on one core)
# one Newton step of the barrier method, seconds per (V' r)^3: 0.17 s at 2000 on one
# core (measured); after the probe it starts only where three such steps fit the budget
_BARRIER_NEWTON_S_PER_VR3 = 2.2e-11
_BARRIER_MIN_SLACK = 1e-14  # stop the stages when a slack 1 - d^2 falls below
_BARRIER_NEWTON = 50  # Newton steps per stage at most, or as many as fit
_BARRIER_STAGE_S = 2.0  # this many seconds by the estimate above, up to
_BARRIER_NEWTON_MAX = 200  # this many steps
_BARRIER_CENTERED = 1e-9  # Newton decrement (squared) at which a stage is centered
_POLISH_STEPS = 4  # solves (one factor) correcting the multipliers' divergence
_BARRIER_GROWTH = 4.0  # t grows by this factor per stage
_BARRIER_SLOW_GROWTH = 2.0  # and by this one after a stage that did not center
_BARRIER_GIVE_UP = 2  # stages in a row that do not center, after which it stops


def _sq_distances(X: np.ndarray) -> np.ndarray:
    """All squared row distances by the Gram expansion (estimates; certificates use
    direct differences or :func:`refgeo.row_diameter`)."""
    n2 = np.einsum("ij,ij->i", X, X)
    D2 = n2[:, None] + n2[None, :] - 2.0 * (X @ X.T)
    np.maximum(D2, 0.0, out=D2)
    np.fill_diagonal(D2, 0.0)
    return D2


_MERGE_WORTH = 0.8  # merged rows are solved instead of G when at most this share of V
_IRLS_LIMIT = 1500  # merged rows up to which the dense complete-graph IRLS is used
_IRLS_MIN_RTOL = 1e-6  # below, ADMM (IRLS converges sublinearly)
_IRLS_POWER = 2.0  # c_e <- c_e (d_e / D)^power
_IRLS_MOMENTUM = 0.5  # heavy-ball term in log c
_IRLS_LOG_FLOOR = -30.0  # conductances stay above e^-30 of the largest (L stays definite)
_IRLS_ROUND = 10  # iterations per reported round
_IRLS_FLOW_CUT = 1e-9  # reported pairs: flow above this share of the largest
# one reweighting (a Cholesky factor of the V' x V' Laplacian) and its certificate,
# seconds per V'^3: 0.14 to 0.35 s at V' = 1400 on one core (measured); IRLS
# starts only where that fits the budget left
_IRLS_FIRST_S_PER_V3 = 8e-11

# Solver constants (measured on synthetic cross-entropy gradients, V = 500..8000):
_INITIAL_PARTNERS = 20  # farthest partners per row in the first working set
_SEPARATION_PARTNERS = 10  # violated pairs added per row and round
_RHO_FACTOR = 0.3  # ADMM penalty rho = factor * (pairs) for gradients scaled to sum ||g|| = 1
_CHECK_EVERY = 25  # ADMM iterations between separation rounds
_RELAXATION = 1.0  # ADMM over-relaxation alpha in [1, 2)
_AVERAGE = True  # also try the average potentials of each round as a lower-bound candidate
_DENSE_LIMIT = 1500  # dense Cholesky up to this many rows, block CG above
_STALL_ROUNDS = 1000  # ADMM rounds without progress after which the solve stops
_STALL_PROGRESS = 1e-3  # progress: the estimated gap falls by this share of itself


def diameter_lmo(
    G: Any,
    /,
    *,
    eta: float = 1.0,
    rtol: float = 1e-4,
    max_time: float | None = None,
    max_iter: int | None = None,
    warm_start: LMOResult | None = None,
    callback: Callable[[dict], Any] | None = None,
    progress: Any = False,
) -> LMOResult:
    r"""Exact steepest descent under the row diameter, with a certified optimality gap.

    Solves :math:`\min \{\langle G, S\rangle : D(S) \le \eta,\ \mathbf{1}^\top S = 0\}`
    (the diameter LMO) and returns the step with a certified bracket of the optimal
    value :math:`-\eta\,T(G)`.

    Parameters
    ----------
    G : array_like of shape (V, d)
        Centered gradient: ``||sum_i g_i|| <= 2**-8 * sum_i ||g_i||`` (about 3.9e-3,
        bfloat16's unit roundoff: cross-entropy gradients satisfy
        :math:`\mathbf{1}^\top G = 0`, to the rounding of bfloat16 where they were
        computed under bfloat16 autocast, up to 1.2e-3 measured; for bfloat16 tensors
        the tolerance is their eps, 7.8e-3); the small remainder is removed, which
        changes nothing because :math:`\mathbf{1}^\top S = 0` (so a small term of the
        gradient that no centered step can follow passes and is dropped).  Use
        :func:`center_rows` to pass a non-centered matrix on purpose.
    eta : float, default=1.0
        Diameter budget, ``> 0``.
    rtol : float, default=1e-4
        Stop when the certified relative gap ``(upper - lower) / upper <= rtol``.  A
        gap near float64 rounding (below about ``16 eps``) cannot be certified: the
        solver then stops there and returns ``converged=False`` instead of looping.
        So does the ADMM when its gap estimate stops improving above ``rtol`` (1000
        rounds of 25 iterations with less than 0.1% progress and no new pair), as on
        nearly rank-one gradients at an ``rtol`` of about 1e-12.
    max_time : float, default=None
        Wall-time limit in seconds, ``>= 0`` (None: no limit).  The best certified
        answer so far is returned (``converged=False`` if the gap is above ``rtol``); a
        stopped solve whose step decreases less than the projected RowNorm step
        (:func:`projected_rownorm`: half the sum of the centered row norms, up to
        rounding) returns that step instead, its decrease as the lower bound.  The
        limit is checked between iterations and inside the setup (merging rows, the
        first working set); once it has passed, no solver starts and the RowNorm step
        is returned with the upper bound of a star flow (``method="rownorm"``, a gap of
        at most 1/2; ``max_time=0`` asks for exactly that).  What runs past the limit
        is a stage already started (the SVD of G, O(V d^2), a solver's setup, one
        row-block pass of the working set, or the round in which the limit passes:
        its step, separation pass and certificate, one :func:`row_diameter` of the
        step's rows).  A stopped solve never certifies less than the star flow.
    max_iter : int, default=None
        Limit on iterations (Newton steps, IRLS reweightings or ADMM iterations;
        None: no limit); 0 certifies the starting point (or returns the projected
        RowNorm step, where that decreases more, see ``max_time``).
    warm_start : LMOResult, default=None
        A previous result (e.g. the last optimizer step): for the ADMM, its step and
        flowing pairs start the working set, the potentials and the flows (the other
        solvers start cold; see Notes).  Its ``update`` must have the shape of ``G``
        and be finite, ``pairs`` be integer rows of ``G`` and ``flows`` one finite
        value ``>= 0`` per pair.
    callback : callable, default=None
        Called after each separation round with a dict (``iteration``, ``rounds``,
        ``pairs``, ``lower``, ``upper``, ``gap``, ``elapsed``; ``lower``/``gap`` are
        estimates from the Gram filter, certified only in the result).  Returning a true
        value stops the solver.
    progress : bool or callable, default=False
        True: a tqdm bar (a ``UserWarning``, once, when tqdm is not installed).  A
        callable is called from the calling thread, at the start, at most 4 times a
        second and once at the end, with a dict ``done`` (0..1, the gap's progress from its first
        estimate to ``rtol`` on a log scale), ``total`` (1.0), ``elapsed`` and ``eta``
        (seconds, extrapolated; nan before any progress).  The end is reported with
        ``done == total`` also when the solve stops short of ``rtol`` (``max_iter``,
        ``max_time``, ``callback``; ``result.converged`` says which).

    Returns
    -------
    result : LMOResult
        ``update`` with certified :math:`D \le \eta`, ``decrease``, the certified
        bracket ``lower_bound <= T(G) <= upper_bound``, ``gap``, flowing ``pairs``.

    Raises
    ------
    ValueError
        Bad shapes, non-finite values, rows not summing to about zero, ``eta <= 0``,
        ``rtol`` outside (0, 1).

    Notes
    -----
    Min-tension duality (see :doc:`/theory/lmo`):

    .. math::

        T(G) = \min \Big\{ \sum_{i<j} \lVert y_{ij} \rVert : \operatorname{div} Y = G \Big\}
             = \max \{ \langle G, \Phi \rangle : D(\Phi) \le 1 \},
        \qquad S^* = -\eta \Phi^*.

    *Method: aggregation, then a solver chosen by size.*  Gradients of real LM heads
    have Zipf-distributed token frequencies and hidden states with a large common
    component, so most rows are tiny and point almost the same way; the flow problem
    is then massively degenerate.  First-order methods on the full problem crawl there
    (ADMM did not reach a gap of 1e-3 in 300 s at V = 2000), while a few hundred
    clusters of nearly collinear rows carry all of its structure.  So, in this order:

    1. *Aggregation.*  Rows are clustered top-down by direction and each cluster is
       replaced by its sum (see :func:`_aggregate`): with
       :math:`\tilde g_i = w_i g_C` (:math:`w_i = \lVert g_i \rVert / \sum_C
       \lVert g_j \rVert`), :math:`T_{\text{merged}} \le T(G) \le T_{\text{merged}}
       + \sum_C U(G_C - \tilde G_C)`, U the cheap bound below.  Clusters split until
       that cost is at most ``rtol / 4`` of the half-sum (exactly zero for collinear
       rows and duplicates); merging is used when it leaves at most 80% of the rows.
       On LM-like gradients V = 2000..50257 becomes 350-400 rows at rtol 1e-3..1e-2;
       isotropic gradients do not merge.
    2. *Barrier method* when V'·r <= 400 (small problems, the test cases), any rtol,
       with the solver below taking over where it stops short of rtol (its floor near
       a gap of 1e-12, or rows it cannot center: isotropic (500, 2)) for at most
       max(1 s, twice the time so far): Newton steps on
       :math:`t\langle H, X\rangle + \sum_{i<j} \log(1 - \lVert x_i - x_j \rVert^2)`
       over all pairs, t growing 4x per stage until a stage does not center within
       its Newton steps (50, or up to 200 where the cost model fits them in 2 s:
       V'·r <= 768; low-dimensional rows need up to 200 in a stage, then center
       again) and 2x from then on, stopping after two such stages in a row
       (from there, long steps of t did not come back to the central path: isotropic
       (200, 3) at rtol 1e-4 went from 2 s to 13-37 s with 8x steps);
       fast and accurate on degenerate rows.
       At each stage's end its multipliers are corrected to divergence exactly H
       (one factorization, refined), so the certificate follows it to gaps near
       1e-12; where a stage that left the central path ends worse than one before it,
       the best stage is the result, and the IRLS after it starts from that stage's
       multipliers.  Also
       when V'·r <= 2500 (any rtol), after the solver below has had a probe of
       2 s x max(1, V'·r / 1000)^2 (half the barrier method's time) without
       converging, and with the first-order solver again (IRLS from where its probe
       left it), bounded as above, where it stops short: the first-order solvers
       finish well-spread gradients in moments but crawl on LM-like and
       low-dimensional ones (rtol 1e-6 at (250, 8): IRLS did
       not converge in 120 s, the probe and the barrier method took 28 s; rtol 1e-10
       at (40, 6): the ADMM stopped at a gap of 4e-8 after 30 s, the barrier method
       took 0.2 s; rtol 1e-4 on isotropic (250, 4): IRLS 15-20 s, the probe and the
       barrier method 6 s).
       ``iterations`` and ``rounds`` then count those of every solver run, and the
       result is the best certified one.
    3. *IRLS* (reweighted electrical flows) on the complete graph when V' <= 1500
       and rtol >= 1e-6 (below, the ADMM): conductances :math:`c_e` give potentials
       :math:`X = L_c^{-1} H` and the flow :math:`y_e = c_e (x_i - x_j)` with
       divergence exactly H, i.e. both halves of the certificate from one dense
       Laplacian solve; :math:`c_e \leftarrow c_e (d_e / D)^2` with momentum in
       :math:`\log c`.  Chosen over ADMM on the merged rows after measurement:
       16x faster at V = 2000 (ADMM on the 353 merged rows: 89 s; IRLS: 5.5 s).
    4. *ADMM over a working set* otherwise (V' > 1500, or rtol < 1e-6; also as the
       probe or the fallback above).  G is reduced to its row space,
       :math:`G = HQ^\top` (rank r), and scaled to
       :math:`\sum \lVert h_i \rVert = 1`.  On a working set E of pairs the flow
       problem :math:`\min \sum_{e \in E} \lVert y_e \rVert` s.t.
       :math:`B^\top Y = H` (B the incidence matrix) is solved by ADMM: a projection
       onto the affine constraint (one Laplacian solve with :math:`B^\top B`,
       factorized once per working set: dense Cholesky up to 1500 rows, warm-started
       block CG above), a group soft-threshold, and a multiplier update whose value is
       the potential X.  Every 25 iterations up to 10 farthest partners per row with
       :math:`\lVert x_i - x_j \rVert > 1 + \mathrm{rtol}/4` join E (separation).

    Warm starts serve the ADMM (the previous step and flowing pairs, mapped onto the
    clusters); the barrier method and IRLS start cold, since a warm-started IRLS
    reached larger gaps in the same time on the demo's consecutive momentum gradients
    (measured).  The
    engine's certified farthest partners were not needed as a separation oracle: the
    merged problems are solved on the complete graph.  The solver runs in float64
    NumPy with BLAS on one thread (other array types are copied to NumPy).

    *Certificate.*  For any potentials X, :math:`\langle G, XQ^\top\rangle /
    D(XQ^\top) \le T(G)`, with D from the certified :func:`refgeo.row_diameter`
    (merged potentials are repeated over their clusters, which keeps D); for any flow
    Y, :math:`T(G) \le \sum_e \lVert y_e \rVert + U(R)` where
    :math:`R = G - \operatorname{div}(Y) Q^\top` and U is the cheaper of
    :math:`\sum_i \lVert r_i \rVert/\sqrt2` and the product bound
    (:func:`tension_bounds`), plus the aggregation bound.  Both are evaluated in
    float64 on G itself (flow costs by direct differences), so the bracket holds up
    to float64 rounding of these sums (relative ~1e-15); a lower bound above an upper
    bound by more than that raises ``RuntimeError``.  Closed forms (G = 0, rank 1,
    V = 2) are used automatically.

    *Cost.*  Aggregation O(V r log V'); a barrier step O((V' r)^3 + V'^2 r^2), about
    0.17 s at V' r = 2000 on one core, and about a hundred of them for rtol 1e-6; an
    IRLS iteration O(V'^2 r + V'^3); an ADMM iteration :math:`O(|E| r)` plus the Laplacian solve; a
    certification one certified diameter of the V' merged rows.  Memory
    O(V d + V'^2) (+ :math:`O(|E| r)` for ADMM).  Measured (one BLAS thread, two cores shared
    with other work, min of runs) on the LM-like generator at rtol 1e-3: V = 2000,
    d = 64 in about 6 s (the ADMM alone stopped at 300 s with a gap of 6e-3);
    V = 8000, d = 128 in about 2 s; at rtol 1e-2, V = 50257, d = 768 in about
    1 minute (2.3 GB peak with the generator).
    Isotropic gradients do not merge and run the ADMM as before (V = 2000: 17 s).

    Invariant under row permutations and right-orthogonal transforms; positively
    homogeneous (the update is scale-invariant; G is rescaled by a power of two
    internally, so any finite scale works).  A common row shift is not accepted: G
    must be centered (see ``G`` above).

    References
    ----------
    .. [1] LM-head update geometry, arXiv:2608.22253 (v2).

    Examples
    --------
    >>> import numpy as np, refgeo
    >>> G = np.array([[1.0, 0.0], [-0.5, 0.5], [-0.5, -0.5]])
    >>> r = refgeo.diameter_lmo(G, eta=1.0, rtol=1e-8)
    >>> bool(r.gap <= 1e-8), round(r.lower_bound, 6)  # T(G) = (1 + sqrt 3)/2
    (True, 1.366025)
    >>> round(refgeo.row_diameter(r.update).value, 12)
    1.0
    """
    t0 = time.perf_counter()
    G, origin = from_foreign(G, "G", host=True)  # the solver is NumPy code
    rtol_c = _centered_rtol(input_eps(G, origin))
    G = _check_gradient(G)
    eta = _check_eta(eta)
    rtol = check_open_unit_interval(rtol, "rtol")
    if max_time is not None:
        max_time = check_real(max_time, "max_time", min_value=0.0)
    max_iter = check_int(max_iter, "max_iter", min_value=0, allow_none=True)
    if callback is not None:
        check_callable(callback, "callback")
    if warm_start is not None and not isinstance(warm_start, LMOResult):
        raise TypeError(
            f"warm_start must be an LMOResult or None, got {type(warm_start).__name__} instead."
        )
    if warm_start is not None:  # a result of a tensor call: its arrays back to NumPy
        warm_start = dataclasses.replace(
            warm_start, update=to_host(warm_start.update), pairs=to_host(warm_start.pairs),
            flows=to_host(warm_start.flows),
        )
    progress = _progress.check_progress(progress)
    Gc, e = _centered_float64(G, rtol_c)
    V, d = Gc.shape
    if warm_start is not None:
        warm_start = _checked_warm_start(warm_start, V, d)
    # Solved for eta = 1 on G * 2**-e, then rescaled: the bounds never depend on how
    # eta rounds the step (eta = 1e300 or 1e-320 gave inf or crossed bounds), and no
    # sum of squares leaves the float64 range.
    if warm_start is not None and e:
        f = np.asarray(warm_start.flows)
        with np.errstate(over="ignore"):
            fe = np.ldexp(f, -e)
        if not bool(np.all(np.isfinite(fe))):  # absurd for this G: the proportions (_warm_flows sizes them)
            fe = f / np.max(f)
        warm_start = dataclasses.replace(warm_start, flows=fe)
    if callback is not None and e:
        user_callback = callback

        def callback(info):
            return user_callback({**info, "lower": math.ldexp(info["lower"], e), "upper": math.ldexp(info["upper"], e)})

    scale = float(np.sum(np.sqrt(np.einsum("ij,ij->i", Gc, Gc))))
    bar = _GapProgress(progress) if progress is not False else None
    with blas_single_thread():  # small dense solves and GEMMs: BLAS threads only spin
        agg = None
        if scale > 0.0 and V > 2 and not _spent(max_time, t0):
            # merging may cost at most a quarter of the gap (measured against the
            # half-sum, a lower bound on T): see _aggregate
            agg = _aggregate(Gc, 0.25 * rtol * 0.5 * scale, _deadline(max_time, t0))
            # Two merged rows (or one: a zero problem) are a closed form, lifted with the
            # merging bound.  Only a G of numerical rank one does better unmerged (its
            # own closed form, exact, with a flow on every row); the merged rows were
            # once dropped for every G, and a float32 gradient of one token, or rank one
            # plus noise of 1e-10, went to the first-order solvers, which crawl there
            # (no end in 150 s at (4000, 16), gap 0.5 at max_time=5 at (1600, 4);
            # 0.02 s and converged now).
            if agg is not None and agg.rows.shape[0] < 3 and _numerical_rank(
                    np.linalg.svd(Gc / scale, compute_uv=False), Gc.shape) == 1:
                agg = None
            elif agg is not None and agg.rows.shape[0] > _MERGE_WORTH * V:
                agg = None  # too few merges to pay for the looser bound
        if agg is None:
            res = _solve(Gc, scale, rtol, max_time, max_iter, warm_start, callback, bar, t0)
        else:
            eps_m = agg.error
            # T_merged >= T(G) - error >= scale / 2 - error: the merged gap that keeps
            # the whole gap within rtol
            rtol_m = rtol - eps_m / max(0.5 * scale - eps_m, _TINY64)
            # mapped only if the ADMM runs (the other solvers start cold, see _solve)
            warm_m = (lambda: _merged_warm_start(warm_start, agg)) if warm_start is not None else None
            cb = callback
            if callback is not None:
                def cb(info):
                    return callback({**info, "upper": info["upper"] + eps_m})
            Gm = agg.rows
            scale_m = float(np.sum(np.sqrt(np.einsum("ij,ij->i", Gm, Gm))))
            res_m = _solve(Gm, scale_m, rtol_m, max_time, max_iter, warm_m, cb, bar, t0)
            res = _lifted(res_m, agg, Gc, t0, rtol)
    if not res.converged and scale > 0.0:
        res = _no_worse_than_rownorm(res, Gc, scale, rtol)
    if bar is not None:
        bar.close()
    return fields_to_caller(_for_budget(res, eta, e, rtol), origin)


def _deadline(max_time: float | None, t0: float) -> float | None:
    return None if max_time is None else t0 + max_time


def _spent(max_time: float | None, t0: float) -> bool:
    return max_time is not None and time.perf_counter() - t0 >= max_time


def _budget_spent_result(Gc: np.ndarray, scale: float, rtol: float, t0: float) -> LMOResult:
    """The unit-budget result when ``max_time`` runs out before a solver starts: the
    projected RowNorm step, certified from above by the star flow into the longest row.

    Sending each row ``g_i`` (``i != h``) along the pair ``(i, h)`` is a flow whose
    divergence is G (the rows sum to zero, so the hub receives ``g_h``), of cost
    ``sum_{i != h} |g_i|``; every flow's cost bounds ``T(G)`` from above (weak
    duality).  With ``h`` the longest row the bracket is at worst
    ``[scale / 2, scale]``: a relative gap of 1/2 (RowNorm's own guarantee is
    ``>= 1/sqrt 2`` of the optimum).  O(V d).
    """
    V, d = Gc.shape
    upper, pairs, flows = _star_flow(Gc)
    start = LMOResult(
        update=np.zeros((V, d)), decrease=0.0, lower_bound=0.0, upper_bound=upper,
        gap=_relative_gap(0.0, upper), pairs=_readonly(pairs), flows=_readonly(flows),
        iterations=0, rounds=0, eta=1.0, method="rownorm", converged=False,
        elapsed=time.perf_counter() - t0,
    )
    return _no_worse_than_rownorm(start, Gc, scale, rtol)


def _star_flow(Gc: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
    """``(cost, pairs, flows)`` of the star flow into the longest row (see
    :func:`_budget_spent_result`), its cost rounded up: an upper bound on T(G).  O(V d)."""
    V, d = Gc.shape
    n = np.sqrt(np.einsum("ij,ij->i", Gc, Gc))
    hub = int(np.argmax(n))
    others = np.flatnonzero((n > 0) & (np.arange(V) != hub))
    # each norm within (d + 2) eps of |g_i|, and the sum within V eps of theirs
    upper = math.fsum(n[others]) * (1.0 + (d + V + 4) * _EPS64)
    pairs, flows = _canonical_pairs(np.stack([others, np.full(others.size, hub)], axis=1), n[others])
    return upper, pairs, flows


def _with_star_bound(res: LMOResult, Gc: np.ndarray) -> LMOResult:
    """``res`` with the star flow's upper bound, pairs and flows where that costs less
    than the stopped solver's flow (a solve stopped early can certify less than the
    sum of the row norms: 2.4e4 against 1.2e4 at (1700, 32), clustered rows)."""
    upper, pairs, flows = _star_flow(Gc)
    if upper >= res.upper_bound:
        return res
    lower, upper = _checked_bracket(res.lower_bound, upper, "diameter_lmo (star flow)")
    return dataclasses.replace(res, upper_bound=upper, gap=_relative_gap(lower, upper),
                               pairs=_readonly(pairs), flows=_readonly(flows))


def _no_worse_than_rownorm(res: LMOResult, Gc: np.ndarray, scale: float, rtol: float) -> LMOResult:
    """A stopped solve's unit-budget result, with the projected RowNorm step where that
    decreases more (half the sum ``scale`` of the row norms, up to rounding; its
    decrease is then the lower bound, and the flows still certify the upper bound).

    Stopped by ``max_time`` or ``max_iter`` after a few iterations, the solver's step
    decreased about half as much as RowNorm's on LM gradients (0.059 against 0.121 at
    600 x 8 under max_time=0.01).  The RowNorm step costs O(V d) and is certified by
    construction: its rows have norm at most ``(1 - delta) / 2`` before centering, and
    centering moves every distance by at most ``2 eps``, so the diameter is at most 1.
    """
    res = _with_star_bound(res, Gc)
    if res.decrease >= 0.5 * scale:
        return res  # the RowNorm step decreases at most half the sum
    V, d = Gc.shape
    # fl(g / ||g||) has norm at most 1 + (d + 3) eps; the margin covers it and the
    # centering's rounding with room to spare
    shrink = 0.5 * (1.0 - 4.0 * (d + 16) * _EPS64)
    S = row_normalize(Gc) * -shrink
    S -= S.mean(axis=0, keepdims=True)
    S += 0.0  # no -0.0 entries (zero rows)
    decrease = -float(np.sum(Gc * S))
    if decrease <= res.decrease:
        return res
    lower, upper = _checked_bracket(decrease, res.upper_bound, "diameter_lmo (RowNorm step)")
    gap = _relative_gap(lower, upper)
    return dataclasses.replace(res, update=_readonly(S), decrease=decrease, lower_bound=lower,
                               upper_bound=upper, gap=gap, converged=gap <= rtol, method="rownorm")


def _checked_warm_start(warm: LMOResult, V: int, d: int) -> LMOResult:
    """``warm`` with its update, pairs, flows and eta checked against a (V, d) gradient.

    An LMOResult can be built or ``dataclasses.replace``-d by hand: without these
    checks, pairs outside [0, V) or NaN entries failed deep in the solver (a SciPy
    index error, an AttributeError), and float pairs were truncated silently.
    """
    upd = np.asarray(warm.update)
    if tuple(upd.shape) != (V, d):
        raise ValueError(
            f"warm_start must come from a gradient of shape {(V, d)}, got an update of "
            f"shape {tuple(upd.shape)} instead."
        )
    as_float_array(upd, "warm_start.update", ndim=2, shape_hint="2-D array of shape (V, d)")
    pairs = np.asarray(warm.pairs)
    flows = np.asarray(warm.flows)
    if (pairs.dtype.kind not in "iu" or pairs.ndim != 2 or pairs.shape[1] != 2
            or (pairs.size and (int(pairs.min()) < 0 or int(pairs.max()) >= V))):
        raise ValueError(
            f"warm_start.pairs must be an integer array of shape (m, 2) with rows in [0, {V - 1}], "
            f"got {pairs.dtype} pairs of shape {pairs.shape}"
            + (f" with values in [{pairs.min()}, {pairs.max()}]" if pairs.size and pairs.dtype.kind in "iuf" else "")
            + " instead."
        )
    if (flows.dtype.kind not in "iuf" or flows.shape != (pairs.shape[0],)
            or not bool(np.all(np.isfinite(flows) & (flows >= 0)))):
        raise ValueError(
            f"warm_start.flows must be {pairs.shape[0]} finite flow magnitudes >= 0 (one per "
            f"pair), got {flows.dtype} flows of shape {flows.shape} instead."
        )
    eta = _check_eta(warm.eta, "warm_start.eta")
    top = float(np.max(np.abs(upd), initial=0.0))
    if not math.isfinite(top / eta):
        # the solver starts from update / eta, whose inf became NaN potentials (and an
        # AttributeError once no iterate was left)
        raise ValueError(
            f"warm_start.update / warm_start.eta must be finite, got entries up to {top!r} for "
            f"warm_start.eta == {eta!r} instead (an LMO step has entries of at most its eta)."
        )
    pairs, flows = _canonical_pairs(pairs.astype(np.int64), flows.astype(np.float64))
    return dataclasses.replace(warm, update=upd, pairs=pairs, flows=flows, eta=eta)


def _solve(Gc, scale, rtol, max_time, max_iter, warm_start, callback, bar, t0) -> LMOResult:
    """The unit-budget LMO of a centered ``Gc`` (rescaled by a power of two): a closed
    form, the complete-graph IRLS for a few rows, or ADMM over a working set."""
    V, d = Gc.shape
    if scale == 0.0:
        return _closed_form_result(Gc, "zero", t0, rtol)
    if V == 2:
        return _closed_form_result(Gc, "two_rows", t0, rtol)
    if _spent(max_time, t0):  # the SVD and a solver's setup cost O(V d^2) and more
        return _budget_spent_result(Gc, scale, rtol, t0)
    U_, s, Vt = np.linalg.svd(Gc / scale, full_matrices=False)
    r = _numerical_rank(s, (V, d))
    if r == 1:
        return _closed_form_result(Gc, "rank1", t0, rtol)
    Q = Vt[:r].T  # (d, r), orthonormal columns
    H = U_[:, :r] * s[:r]  # (V, r), sum of row norms ~ 1
    H -= H.mean(axis=0, keepdims=True)
    # The barrier method and IRLS start cold: started from the previous step's
    # potentials, IRLS needed more time for the same gap on consecutive momentum
    # gradients of the demo's training (measured), and the barrier's Newton steps
    # need a central start.
    # Up to a few thousand unknowns: the first-order solvers converge in moments on
    # well-spread gradients but crawl on LM-like ones at tight tolerances (IRLS did
    # not reach 1e-6 in 120 s at (250, 8), the ADMM took 764 s for 1e-7) and on
    # low-dimensional ones at any (IRLS 15-20 s for 1e-4 on isotropic (250, 4)), where
    # the barrier method takes a steady hundred Newton steps (16 s; 4 s).  So they get a
    # probe of half the barrier method's expected time, and the barrier method the
    # rest: at most 1.5 times the barrier method's time, and the first-order
    # solver's where it is fast.  On small problems the barrier method goes first,
    # and the first-order solver takes over where it stops short of rtol (its floor
    # near a gap of 1e-12, or rows it cannot center, as isotropic (500, 2)).
    small = V * r <= _BARRIER_LIMIT
    probe = None
    if not small and V * r <= _BARRIER_TIGHT_LIMIT:
        probe = (time.perf_counter() - t0) + _BARRIER_PROBE_S * max(1.0, V * r / 1000.0) ** 2
        if max_time is not None and probe >= max_time:
            probe = None  # the budget is the probe's
    asked_stop = []
    watched = callback
    if callback is not None:
        def watched(info):  # a stop asked of the first solver is not the second's cue
            stop = bool(callback(info))
            if stop:
                asked_stop.append(True)
            return stop

    irls = V <= _IRLS_LIMIT and rtol >= _IRLS_MIN_RTOL
    resumed: list[_IRLS] = []

    def first_order(budget):
        if irls:
            if resumed:
                # after the barrier method: IRLS goes on from the probe's conductances
                # (restarted cold it repeated the probe's work: isotropic (400, 2) at
                # rtol 1e-4 took 19 s against 6 s before the probe ran at this rtol)
                resumed[0].max_time = budget
                return resumed[0]
            resumed.append(_IRLS(H, Q, Gc, scale, rtol, budget, max_iter, None, watched, bar, t0))
            return resumed[0]
        warm = warm_start() if callable(warm_start) else warm_start
        return _ADMM(H, Q, Gc, scale, rtol, budget, max_iter, warm, watched, bar, t0)

    def barrier(budget):
        return _Barrier(H, Q, Gc, scale, rtol, budget, max_iter, None, watched, bar, t0)

    if small:
        # the first-order solver after the barrier method: bounded, since where the
        # barrier method stopped at float64's floor (gaps of 1e-12..1e-14) the ADMM's
        # estimates keep shrinking slowly and it ran for minutes to the same result
        plan = [(barrier, max_time), (first_order, _FALLBACK)]
    elif probe is not None:
        # and the first-order solver again, bounded as above, where the barrier method
        # stops short (rows it cannot center: isotropic (500, 2) at rtol 1e-4)
        plan = [(first_order, probe), (barrier, max_time), (first_order, _FALLBACK)]
    else:
        plan = [(first_order, max_time)]
    best = None
    counts = (0, 0)
    gaps = {}  # the last certified gap of each solver
    multipliers = None  # the barrier method's, where it stopped short
    for make, budget in plan:
        if best is not None and _spent(max_time, t0):
            break
        if (best is not None and make is barrier and max_time is not None
                and time.perf_counter() - t0 + 3.0 * _BARRIER_NEWTON_S_PER_VR3 * float(V * r) ** 3 > max_time):
            # a budget just above the probe: the barrier method's first step and its
            # certificate (a factorization of the same size) ran over it (by 8%)
            break
        if (make is first_order and irls and max_time is not None
                and time.perf_counter() - t0 + _IRLS_FIRST_S_PER_V3 * float(V) ** 3 > max_time):
            # IRLS runs one reweighting and certifies it whatever the budget: started
            # late (after the SVD, at 0.18 s of 0.3 s at V' = 1400) the call took 0.67 s
            if best is None:
                return _budget_spent_result(Gc, scale, rtol, t0)
            break
        if budget is _FALLBACK:
            elapsed = time.perf_counter() - t0
            budget = elapsed + max(_FALLBACK_MIN_S, _FALLBACK_FACTOR * elapsed)
            if max_time is not None:
                budget = min(budget, max_time)
        solver = make(budget)
        solver.iterations, solver.rounds = counts  # the counts go on across solvers
        if best is None and make is first_order and _spent(max_time, t0):
            # the setup took the budget: its first round would overrun it
            return _budget_spent_result(Gc, scale, rtol, t0)
        if (make is first_order and irls and multipliers is not None
                and gaps[barrier] < gaps.get(first_order, np.inf)):
            # IRLS goes on from where the barrier method stopped, where that is ahead
            # of its own probe
            solver.seed(multipliers)
        res = solver.run()
        gaps[make] = res.gap
        if make is barrier:
            multipliers = solver.multipliers
        counts = (solver.iterations, solver.rounds)
        if best is None or res.gap < best.gap:
            best = res
        if res.converged or asked_stop or (max_iter is not None and solver.iterations >= max_iter):
            break
    if best is None:
        raise RuntimeError("internal error: diameter_lmo ran no solver")
    if len(plan) == 1:
        return best
    return dataclasses.replace(best, iterations=counts[0], rounds=counts[1], elapsed=time.perf_counter() - t0)


def _for_budget(res: LMOResult, eta: float, e: int, rtol: float) -> LMOResult:
    """The unit-budget result on ``G * 2**-e`` as the result for budget eta on G (the
    gap of bounds rounded outwards in the subnormal range is theirs, and ``converged``
    says whether it is within ``rtol``)."""
    S = res.update * eta if eta != 1.0 else res.update
    v = _unscaled({"upper_bound": res.upper_bound, "lower_bound": res.lower_bound}, e, "diameter_lmo",
                  down=("lower_bound",))
    # decrease * eta * 2**e as (mantissa * eta) * 2**(exponent + e): one rounding, as
    # before, and an out-of-range product is caught by the range check, not inf
    m, ex = math.frexp(res.decrease)
    dm = m * eta  # |m| < 1 and eta <= 1.8e308: finite
    dec = _unscaled({"decrease": dm}, ex + e, "diameter_lmo", down=("decrease",))["decrease"]
    gap = max(res.gap, _relative_gap(v["lower_bound"], v["upper_bound"]))
    return dataclasses.replace(
        res,
        update=_readonly(S),
        decrease=dec,
        lower_bound=v["lower_bound"],
        upper_bound=v["upper_bound"],
        gap=gap,
        converged=res.converged and gap <= rtol,
        flows=_readonly(np.ldexp(res.flows, e)),
        eta=eta,
    )


def _warm_flows(flows: np.ndarray, scale: float, value: float | None = None) -> np.ndarray:
    """A warm start's flows as flows of this gradient, in the solver's units (over
    ``scale``, the sum of its row norms).

    The flows are in the units of the gradient they were solved for, and a gradient's
    size moves between optimizer steps.  An optimal flow of ``G`` sums to the value
    ``T(G)``, which lies in ``[scale / 2, scale]`` (``s_i = g_i / (2 |g_i|)`` is
    feasible, and ``<G, S> <= sum |g_i|`` for any S of diameter 1 since the rows of G
    sum to zero).  The flows keep their proportions and are sized to sum to ``value``,
    the warm step's decrease on this gradient per unit budget in the solver's units
    (into ``[1/2, 1]``): for a gradient ``c G`` the step of ``G`` is optimal, with the
    value ``c T(G)``, and sized by their own sum the flows of ``G`` were ``c`` times off
    (a warm start that took 25 ADMM iterations on ``G`` took 3,975 on ``1.1 G``; 5,375
    cold).  Without a positive ``value``, flows whose sum falls outside the range are
    sized into it and flows that fit are only divided by ``scale``: seeded 1e5 times too
    large (a gradient that shrank by 1e-5), the ADMM returned a step that raised the
    loss, at a gap above 1.  Computed from ``flows / max(flows)``: no sum overflows.
    """
    top = float(np.max(flows)) if flows.size else 0.0
    if not (top > 0.0 and scale > 0.0):
        return np.zeros_like(flows)
    f = flows / top
    total = float(np.sum(f))  # >= 1
    ratio = total * (top / scale)  # sum(flows) / scale, inf where it overflows
    if value is not None and value > 0.0:
        ratio = value
    return f * (min(max(ratio, 0.5), 1.0) / total)


class _ADMM:
    """State of one diameter_lmo solve in the reduced, scaled coordinates."""

    def __init__(self, H, Q, Gc, scale, rtol, max_time, max_iter, warm, callback, bar, t0):
        self.H, self.Q, self.Gc, self.scale = H, Q, Gc, scale
        self.rtol, self.max_time, self.max_iter = rtol, max_time, max_iter
        self.callback, self.t0 = callback, t0
        self.V, self.r = H.shape
        # Large problems at a loose tolerance iterate in float32 (half the memory
        # traffic); separation uses a margin of rtol/4 >> float32 rounding, and every
        # certificate is evaluated in float64 on G itself.
        self.wdt = np.float32 if (self.V > _DENSE_LIMIT and rtol >= 5e-4) else np.float64
        self.Hw = H.astype(self.wdt)
        self.bar = bar
        # initial potentials and flows
        X0 = None
        Ewarm = np.zeros((0, 2), dtype=np.int64)
        wflows = None
        if warm is not None and warm.eta > 0:
            X0 = (-np.asarray(warm.update, dtype=np.float64) / warm.eta) @ Q
            X0 -= X0.mean(axis=0, keepdims=True)
            # the warm step's decrease on this gradient (per unit budget, over scale)
            warm_value = float(np.sum(H * X0))
            X0 = X0.astype(self.wdt)
            Ewarm = np.asarray(warm.pairs, dtype=np.int64).reshape(-1, 2)
            wflows = np.asarray(warm.flows, dtype=np.float64)
        N = self.Hw / np.maximum(np.linalg.norm(self.Hw, axis=1, keepdims=True), 1e-30)
        # a heuristic start: cut short at the deadline, the working set is only smaller
        ts = time.perf_counter()
        E0, _ = _far_pairs(N, _INITIAL_PARTNERS, None, _deadline(max_time, t0))
        # what one separation pass costs, until one is measured: the reserve for the
        # final certificate (_out_of_budget) was 0 before the first, and 1 s budgets
        # ran 30% over
        first_pass = time.perf_counter() - ts
        parts = [E0, Ewarm]
        if X0 is not None:
            Ex, _ = _far_pairs(X0, _SEPARATION_PARTNERS, None, _deadline(max_time, t0))
            parts.append(Ex)
        E = _connect(_unique_pairs(np.concatenate(parts)), self.V)
        self._set_working_set(E)
        m = len(self.E)
        self.Y = np.zeros((m, self.r), dtype=self.wdt)
        self.U = np.zeros((m, self.r), dtype=self.wdt)
        if X0 is not None:
            Lam = X0[self.E[:, 0]] - X0[self.E[:, 1]]
            nl = np.linalg.norm(Lam, axis=1, keepdims=True)
            Lam = Lam / np.maximum(nl, 1.0)
            self.U = Lam / self.rho
            if len(Ewarm) and wflows is not None and len(wflows) == len(Ewarm):
                pos = self._positions(Ewarm)
                dirs = Lam[pos] / np.maximum(np.linalg.norm(Lam[pos], axis=1, keepdims=True), 1e-30)
                self.Y[pos] = _warm_flows(wflows, scale, warm_value)[:, None] * dirs
        self.W = self.Y.copy()
        self.zeta = None
        self.iterations = 0
        self.rounds = 0
        self.best_X = None
        self.best_lower_est = -np.inf
        self.best_upper = np.inf
        self.best_Y = None
        self.best_E = None
        self.cg_floor = 1e-5 if self.wdt == np.float32 else 1e-12
        self.cg_tol = max(1e-6, self.cg_floor)
        self.cert_time = None
        self.sep_time = first_pass
        self.step_time = 0.0
        # a certificate before one is measured: the NumPy reference's diameter costs
        # about 8 separation passes, the compiled engine's less than one
        self.cert_guess = (1.0 if _engine_is_compiled(Gc) else 8.0) * first_pass
        self.cert_trigger = max(0.9 * rtol, 2.0 * _GAP_FLOOR)

    # ---------------------------------------------------------------- working set
    def _set_working_set(self, E):
        self.E = E
        self.B = _incidence(E, self.V, self.wdt)
        self.BT = self.B.T.tocsr()
        self.lin = _LaplacianSolver(self.B, self.V, _DENSE_LIMIT)
        self.rho = _RHO_FACTOR * len(E)

    def _positions(self, Esub):
        key = self.E[:, 0] * self.V + self.E[:, 1]
        ks = Esub[:, 0] * self.V + Esub[:, 1]
        return np.searchsorted(key, ks)  # E is sorted and contains Esub

    def _grow(self, Enew):
        old = self.E
        E = _unique_pairs(np.concatenate([old, Enew]))
        if len(E) == len(old):
            return False
        rho_old = self.rho
        Y, W, U = self.Y, self.W, self.U
        self._set_working_set(E)
        pos = self._positions(old)
        m = len(E)
        self.Y = np.zeros((m, self.r), dtype=self.wdt)
        self.W = np.zeros((m, self.r), dtype=self.wdt)
        self.U = np.zeros((m, self.r), dtype=self.wdt)
        self.Y[pos], self.W[pos] = Y, W
        self.U[pos] = U * (rho_old / self.rho)  # keep the multiplier rho * U
        return True

    # ---------------------------------------------------------------- iteration
    def _step(self):
        B, H = self.B, self.Hw
        V0 = self.W - self.U
        rhs = self.BT @ V0 - H
        self.zeta = self.lin.solve(rhs, self.zeta, self.cg_tol)
        self.zeta -= self.zeta.mean(axis=0, keepdims=True)
        self.Y = V0 - B @ self.zeta
        a = _RELAXATION
        Yr = self.Y if a == 1.0 else a * self.Y + (1.0 - a) * self.W
        Z = Yr + self.U
        nz = np.sqrt(np.einsum("ij,ij->i", Z, Z))
        thr = 1.0 / self.rho
        shrink = np.where(nz > thr, 1.0 - thr / np.where(nz > 0, nz, 1.0), 0.0)
        self.W = Z * shrink[:, None]
        self.U = Z - self.W
        self.iterations += 1

    def _elapsed(self):
        return time.perf_counter() - self.t0

    def _out_of_budget(self):
        # keep time for one certification (its last measured cost, or cert_guess
        # before the first)
        if self.max_time is not None:
            # and for what runs after the check: one more step, and the round's end (the
            # averaged potentials' diameter and one separation pass, each about a pass)
            reserve = self.cert_time if self.cert_time is not None else self.cert_guess
            reserve += self.step_time + 2.0 * self.sep_time
            if self._elapsed() + reserve >= self.max_time:
                return True
        return self.max_iter is not None and self.iterations >= self.max_iter

    def _flow_upper(self):
        """Flow cost + residual bound, in the scaled reduced coordinates (estimate)."""
        R = (self.Hw - self.BT @ self.Y).astype(np.float64)
        R -= R.mean(axis=0, keepdims=True)
        Y = self.Y.astype(np.float64)
        cost = float(np.sum(np.sqrt(np.einsum("ij,ij->i", Y, Y))))
        return cost + _upper_bound_cheap(R)

    # ---------------------------------------------------------------- certificate
    def _certify(self, X, Y, E):
        """Certified (lower, upper) on T(G) (unscaled) and the potentials in R^{V x d}."""
        X = X.astype(np.float64)
        Y = Y.astype(np.float64)
        Phi = X @ self.Q.T
        Phi -= Phi.mean(axis=0, keepdims=True)
        D = row_diameter(Phi).value
        S = _scale_to_budget(Phi, D, -1.0)
        decrease = -float(np.sum(self.Gc * S))
        lower = decrease
        B = _incidence(E, self.V)
        div = (B.T @ Y) @ self.Q.T * self.scale
        R = self.Gc - div
        R -= R.mean(axis=0, keepdims=True)
        cost = float(np.sum(np.sqrt(np.einsum("ij,ij->i", Y, Y)))) * self.scale
        upper = cost + _upper_bound_cheap(R)
        return lower, upper, S, decrease

    def run(self) -> LMOResult:
        sep_tol = self.rtol / 4.0
        certified = None
        stop_requested = False
        stall_best, stall_rounds, grew = math.inf, 0, False
        while True:
            Xsum, n_avg = None, 0
            for _ in range(_CHECK_EVERY):
                if self._out_of_budget():
                    break
                ts = time.perf_counter()
                self._step()
                self.step_time = time.perf_counter() - ts
                if _AVERAGE:
                    Xsum = -self.rho * self.zeta if Xsum is None else Xsum - self.rho * self.zeta
                    n_avg += 1
            if self.zeta is None:  # max_iter == 0: certify the initial guess
                self._step()
                self.iterations -= 1  # a projection onto the constraints, not an iteration
            X = -self.rho * self.zeta
            if n_avg > 1 and Xsum is not None:
                # the average of the round's potentials oscillates less than the last one
                Xa = Xsum / n_avg
                ina = float(np.sum(self.Hw * Xa, dtype=np.float64))
                da = _max_sq_distance(Xa)
                if da > 0 and ina / math.sqrt(da) > self.best_lower_est:
                    self.best_lower_est, self.best_X = ina / math.sqrt(da), Xa
            upper_est = self._flow_upper()
            if upper_est < self.best_upper:
                self.best_upper, self.best_Y, self.best_E = upper_est, self.Y.copy(), self.E
            ts = time.perf_counter()
            # cut short at the deadline: the pairs of the rows seen, and an estimate of
            # the lower bound from their distances (the certificate measures the diameter)
            Enew, d2max = _far_pairs(X, _SEPARATION_PARTNERS, (1.0 + sep_tol) ** 2,
                                     _deadline(self.max_time, self.t0))
            self.sep_time = time.perf_counter() - ts
            inner = float(np.sum(self.Hw * X, dtype=np.float64))
            lower_est = inner / math.sqrt(d2max) if d2max > 0 else 0.0
            if lower_est > self.best_lower_est:
                self.best_lower_est, self.best_X = lower_est, X.copy()
            gap_est = _relative_gap(self.best_lower_est, self.best_upper)
            self.rounds += 1
            info = dict(
                iteration=self.iterations,
                rounds=self.rounds,
                pairs=len(self.E),
                lower=self.best_lower_est * self.scale,
                upper=self.best_upper * self.scale,
                gap=gap_est,
                elapsed=self._elapsed(),
            )
            if self.bar is not None:
                self.bar.update(gap_est, self.rtol, len(self.E))
            if self.callback is not None and bool(self.callback(info)):
                stop_requested = True
            # A plateau above rtol (an rtol tighter than float64 allows on this G, e.g.
            # a nearly rank-one one): no estimate improved and no pair joined for
            # _STALL_ROUNDS rounds.  It looped forever without max_time.
            if gap_est < (1.0 - _STALL_PROGRESS) * stall_best or grew:
                stall_best, stall_rounds = gap_est, 0
            else:
                stall_rounds += 1
            stalled = stall_rounds >= _STALL_ROUNDS
            if gap_est <= self.cert_trigger or stop_requested or stalled or self._out_of_budget():
                tc = time.perf_counter()
                certified = self._certify(self.best_X, self.best_Y, self.best_E)
                self.cert_time = time.perf_counter() - tc
                if _relative_gap(certified[0], certified[1]) <= self.rtol:
                    break
                if stop_requested or stalled or self._out_of_budget():
                    break
                # the estimate was optimistic: certify again only after it halves, and
                # measure stalling afresh (an optimistic low must not make later,
                # honest progress look like a plateau)
                self.cert_trigger = min(self.cert_trigger, gap_est) / 2.0
                stall_best, stall_rounds = math.inf, 0
                if self.cert_trigger < _GAP_FLOOR:
                    # the estimates are at rounding level: an rtol below what float64
                    # can certify would loop forever; return the best certificate
                    break
                self.cg_tol = max(self.cg_tol * 0.1, self.cg_floor)
            grew = bool(len(Enew)) and self._grow(Enew)
            if not len(Enew):
                self.cg_tol = max(self.cg_tol * 0.1, self.cg_floor)
        lower, upper, S, decrease = certified
        lower, upper = _checked_bracket(lower, upper, "diameter_lmo")
        E, Y = self.best_E, self.best_Y
        fl = np.sqrt(np.einsum("ij,ij->i", Y, Y)) * self.scale
        keep = fl > 0
        gap = _relative_gap(lower, upper)
        return LMOResult(
            update=_readonly(S),
            decrease=decrease,
            lower_bound=lower,
            upper_bound=upper,
            gap=gap,
            pairs=_readonly(np.ascontiguousarray(E[keep])),
            flows=_readonly(fl[keep]),
            iterations=self.iterations,
            rounds=self.rounds,
            eta=1.0,
            method="admm",
            converged=gap <= self.rtol,
            elapsed=self._elapsed(),
        )
