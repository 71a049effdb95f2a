r"""Upper bounds on the distance ratio of V points in R^d.

For any configuration :math:`X = (x_1, \dots, x_V)` of distinct points in
:math:`\mathbb{R}^d`, the distance ratio :math:`\rho(X) = m(X)/D(X)` (closest pair over
diameter) is at most a number that depends on :math:`(V, d)` alone.  Four bounds are
implemented, each valid for *every* configuration (spherical or not), and
:func:`ratio_upper_bound` returns the best of them with the one that binds.  The
full proofs are on the theory page :doc:`/theory/spreading` (``docs/theory/spreading.md``).

.. autosummary::

   simplex_bound
   welch_bound
   hadamard_power_bound
   volume_bound
   ratio_upper_bound

Proof sketches (the docstrings carry the formulas).  Write
:math:`s = (m^2 + D^2)/2`, :math:`u = (D^2 - m^2)/(D^2 + m^2)` and
:math:`A = \mathbf{1}\mathbf{1}^T - E/s` with :math:`E` the squared-distance matrix.
:math:`A` has unit diagonal and :math:`|A_{ij}| \le u` off it, and
:math:`\rho^2 = (1 - u)/(1 + u)`, so every lower bound on :math:`u` is an upper bound on
:math:`\rho`.  On :math:`\mathbf{1}^\perp` the form of :math:`A` is :math:`2/s` times the
Gram matrix of the centered points (positive semidefinite, rank :math:`\le d`), hence
:math:`A` has at most :math:`d + 1` positive eigenvalues and
:math:`\operatorname{rank} A \le d + 2`.
"""

from __future__ import annotations

import dataclasses
import fractions
import math

from ._validate import check_int

__all__ = [
    "RatioBound",
    "hadamard_power_bound",
    "ratio_upper_bound",
    "simplex_bound",
    "volume_bound",
    "welch_bound",
]


def _check_vd(V, d) -> tuple[int, int]:
    # up to 2^53: the bounds are float64 formulas in V and d, exact for such integers
    V = check_int(V, "V", min_value=2, max_value=2**53)
    d = check_int(d, "d", min_value=1, max_value=2**53)
    return V, d


# Every bound is rounded outward by this relative amount (a few ulps), so that the
# returned float is itself a valid bound and never falls below an attained optimum.
_OUTWARD = 8.0 * 2.0**-52


def _up(x: float) -> float:
    return min(1.0, x * (1.0 + _OUTWARD))


def _rho_from_u(u: float) -> float:
    """Invert ``u = (D^2 - m^2)/(D^2 + m^2)``: ``rho = sqrt((1 - u)/(1 + u))``."""
    if u <= 0.0:
        return 1.0
    if u >= 1.0:
        return 0.0
    return _up(math.sqrt((1.0 - u) / (1.0 + u)))


def simplex_bound(V: int, d: int, /) -> float:
    r"""B0, the simplex bound: 1 for :math:`V \le d + 1`, else :math:`\sqrt{d/(d+1)}`.

    Parameters
    ----------
    V : int
        Number of points, ``V >= 2``.
    d : int
        Dimension, ``d >= 1``.

    Returns
    -------
    bound : float
        An upper bound on :math:`\rho = m/D` for every configuration of ``V`` points
        in :math:`\mathbb{R}^d`.

    Notes
    -----
    .. math::

       \rho \le \begin{cases} 1, & V \le d + 1 \text{ (attained: regular simplex)},\\
       \sqrt{2}\,J_d = \sqrt{d/(d+1)}, & V \ge d + 2. \end{cases}

    Proof: let :math:`c` be the center of the minimum enclosing ball, of radius
    :math:`R \le J_d D` by Jung's theorem, :math:`J_d = \sqrt{d/(2(d+1))}`.  If every
    pair had :math:`\lVert x_i - x_j \rVert > \sqrt{2} R`, the vectors
    :math:`y_i = x_i - c` (:math:`\lVert y_i \rVert \le R`) would have pairwise
    negative inner products, and at most :math:`d + 1` vectors of
    :math:`\mathbb{R}^d` do (Rankin's simplex bound).  So :math:`m \le \sqrt{2} R`.
    Always dominated by :func:`welch_bound`; kept as the elementary baseline.  O(1).

    References
    ----------
    .. [1] LM-head update geometry (v1, max-min spreading), arXiv:2608.22253.

    Examples
    --------
    >>> import refgeo
    >>> refgeo.simplex_bound(4, 3), round(refgeo.simplex_bound(5, 3) ** 2, 12)
    (1.0, 0.75)
    """
    V, d = _check_vd(V, d)
    if V <= d + 1:
        return 1.0
    return _up(math.sqrt(d / (d + 1.0)))


def welch_bound(V: int, d: int, /) -> float:
    r"""B1, a Welch-type bound one dimension up.

    Parameters
    ----------
    V : int
        Number of points, ``V >= 2``.
    d : int
        Dimension, ``d >= 1``.

    Returns
    -------
    bound : float
        Upper bound on :math:`\rho`; 1 for :math:`V \le d + 1`.

    Notes
    -----
    .. math::

       w^2 = \frac{V - d - 1}{(d + 1)(V - 1)}, \qquad \rho^2 \le \frac{1 - w}{1 + w}.

    Proof: with :math:`A` as in the module notes, let :math:`\lambda_+` be its
    positive eigenvalues (at most :math:`d + 1` of them).  Then
    :math:`V = \operatorname{tr} A \le \sum \lambda_+`, and Cauchy-Schwarz gives
    :math:`V^2 \le (d+1) \sum \lambda_+^2 \le (d+1) \lVert A \rVert_F^2
    \le (d+1)(V + V(V-1)u^2)`, i.e. :math:`u \ge w`.  Tight at :math:`V = d + 2` for
    even :math:`d` (two orthogonal regular simplices, :math:`\rho^2 = d/(d+2)`), and at
    :math:`(V, d) = (10, 4)` and :math:`(16, 5)` (:math:`\rho = 1/\sqrt{2}`).  For
    :math:`V \gg d`, :math:`\rho \le 1 - 1/\sqrt{d+1} + O(1/d)`.  O(1).

    References
    ----------
    .. [1] LM-head update geometry (v1, max-min spreading), arXiv:2608.22253.

    Examples
    --------
    >>> import refgeo
    >>> round(refgeo.welch_bound(10, 4) ** 2, 12)
    0.5
    """
    V, d = _check_vd(V, d)
    if V <= d + 1:
        return 1.0
    w = math.sqrt((V - d - 1.0) / ((d + 1.0) * (V - 1.0)))
    return _rho_from_u(w)


def _comb_below(n: int, k: int, limit: int) -> int | None:
    """``comb(n, k)`` when it is below ``limit``, else None, in O(log limit) steps.

    The partial products ``comb(n, i)``, i <= min(k, n - k), increase and at least double
    per step, so they pass ``limit`` (at most 2**53) within about 53 steps; the full
    ``math.comb`` took 41 s for ``hadamard_power_bound(100, 10**6, k=10**6)`` (a number of
    600,000 digits, to say 1.0) and longer for larger k.
    """
    k = min(k, n - k)
    r = 1
    for i in range(1, k + 1):
        r = r * (n - k + i) // i  # comb(n - k + i, i), exact
        if r >= limit:
            return None
    return r if r < limit else None


def _hadamard_terms(V: int, d: int, k: int) -> float | None:
    r"""The rho bound of the k-th Hadamard power (None when it says nothing).

    With :math:`u = x^{1/(2k)}`, :math:`x = (V - r)/(r (V - 1))`, the bound
    :math:`\sqrt{(1-u)/(1+u)}` equals :math:`\sqrt{\tanh(-\ln(x) / (4k))}`.  The
    second form has a few roundings of relative size each; the first loses the
    relative accuracy of ``1 - u`` when u is near 1 (large k: it fell up to 1e-14
    below the exact value, more than the outward rounding covers).
    """
    r = _comb_below(d + k + 1, k, V)
    if r is None:
        return None
    x = (V - r) / (r * (V - 1.0))
    return _up(math.sqrt(math.tanh(-math.log(x) / (4.0 * k))))


_HADAMARD_PATIENCE = 16
# Largest power tried: only d = 1 or 2 with huge V reach it (their best k grows like
# sqrt(V)), where the volume bound is far tighter anyway.
_HADAMARD_MAX_K = 4096


def _best_hadamard(V: int, d: int, k: int | None) -> tuple[float, int]:
    if k is not None:
        rho = _hadamard_terms(V, d, k)
        return (1.0 if rho is None else rho), k
    # Scan k upward; stop after _HADAMARD_PATIENCE powers without improvement or at
    # _HADAMARD_MAX_K (every k gives a valid bound; on 2 <= d <= 40 and d = 512,
    # V <= 1e7, the result equals the exhaustive scan, which grows like sqrt(V) for d = 1
    # and took minutes near V = 2^53; at d = 1 the cap binds from V near 9.3e6, where
    # B3 is the binding bound anyway).
    best, best_k = 1.0, 1
    kk, since = 1, 0
    while _comb_below(d + kk + 1, kk, V) is not None and since < _HADAMARD_PATIENCE and kk <= _HADAMARD_MAX_K:
        rho = _hadamard_terms(V, d, kk)
        if rho is None:  # not reached: the loop condition is the power's r < V
            break
        if rho < best:
            best, best_k, since = rho, kk, 0
        else:
            since += 1
        kk += 1
    return best, best_k


def hadamard_power_bound(V: int, d: int, /, *, k: int | None = None) -> float:
    r"""B2, Hadamard powers and Alon's rank lemma.

    Parameters
    ----------
    V : int
        Number of points, ``V >= 2``.
    d : int
        Dimension, ``d >= 1``.
    k : int, default=None
        Hadamard power to use; ``None`` takes the best :math:`k \ge 1` of an upward
        scan that stops after 16 powers without improvement or at k = 4096.

    Returns
    -------
    bound : float
        Upper bound on :math:`\rho`; 1 when :math:`V \le r_k` for every usable
        :math:`k`.

    Notes
    -----
    .. math::

       r_k = \binom{d + k + 1}{k}, \qquad
       u^{2k} \ge \frac{V - r_k}{r_k (V - 1)}, \qquad \rho^2 \le \frac{1-u}{1+u}.

    Proof: the entrywise power :math:`A^{\circ k}` has unit diagonal, off-diagonal
    entries at most :math:`u^k` in modulus and rank at most
    :math:`\binom{\operatorname{rank} A + k - 1}{k} \le r_k`; for any real symmetric
    matrix :math:`(\operatorname{tr} B)^2 \le \operatorname{rank}(B) \lVert B \rVert_F^2`.
    With :math:`k = 2` it applies once :math:`V > \binom{d+3}{2}` and beats
    :func:`welch_bound` once :math:`V` exceeds about twice that, :math:`(d+2)(d+3)`
    (first at V = 372 for d = 16, 4498 for d = 64; e.g. :math:`(V, d) = (50000, 64)`:
    0.865).  Time O(k) for the best
    :math:`k` (the loop stops when :math:`r_k \ge V`).

    References
    ----------
    .. [1] LM-head update geometry (v1, max-min spreading), arXiv:2608.22253.
    .. [2] N. Alon, Perturbed identity matrices have high rank, Combin. Probab.
       Comput. 18 (2009).

    Examples
    --------
    >>> import refgeo
    >>> round(refgeo.hadamard_power_bound(50000, 64), 3)
    0.865
    """
    V, d = _check_vd(V, d)
    k = check_int(k, "k", min_value=1, allow_none=True)
    return _best_hadamard(V, d, k)[0]


def volume_bound(V: int, d: int, /) -> float:
    r"""B3, the volume (isodiametric) bound :math:`\rho \le 1/(V^{1/d} - 1)`.

    Parameters
    ----------
    V : int
        Number of points, ``V >= 2``.
    d : int
        Dimension, ``d >= 1``.

    Returns
    -------
    bound : float
        Upper bound on :math:`\rho`, capped at 1.

    Notes
    -----
    .. math:: \rho \le \frac{1}{V^{1/d} - 1}

    Proof: the balls of radius :math:`m/2` around the points are disjoint and their
    union has diameter at most :math:`D + m`; by the isodiametric inequality its
    volume is at most that of a ball of radius :math:`(D + m)/2`, so
    :math:`V m^d \le (D + m)^d`.  Computed with :math:`d = 1` in closed form; otherwise
    the root :math:`V^{1/d}` is rounded down to a float whose :math:`d`-th power is checked
    not to exceed :math:`V` in exact rational arithmetic, so the returned float is never
    below the formula.  Exact for :math:`d = 1` (equally spaced points,
    :math:`1/(V - 1)`); only matters when :math:`V` is exponential in :math:`d`.  O(1).

    References
    ----------
    .. [1] LM-head update geometry (v1, max-min spreading), arXiv:2608.22253.

    Examples
    --------
    >>> import refgeo
    >>> round(refgeo.volume_bound(5, 1), 12)
    0.25
    """
    V, d = _check_vd(V, d)
    if d == 1:
        return _up(1.0 / (V - 1.0))
    if d >= V.bit_length() or V <= 1 << d:  # V^(1/d) <= 2: the bound says nothing
        return 1.0
    # exp(log(V) / d) is off by about (1 + log(V)/d) ulps, more than the outward
    # rounding covers for large V (it fell 1.3e-16 below the formula at V ~ 2^52,
    # d = 2): lower it to a float whose d-th power is certified (in exact rational
    # arithmetic, d < 53) not to exceed V
    root = math.exp(math.log(V) / d)
    while fractions.Fraction(root) ** d > V:
        root = math.nextafter(root, 0.0)
    return _up(1.0 / (root - 1.0))  # root >= 2: root - 1 is exact


@dataclasses.dataclass(frozen=True, slots=True)
class RatioBound:
    """The best upper bound on the distance ratio for ``(V, d)``.

    Attributes
    ----------
    value : float
        ``min(b0, b1, b2, b3)``.
    binding : str
        Which bound attains the minimum: ``"B0"``, ``"B1"``, ``"B2"`` or ``"B3"``
        (the first in that order on ties).
    b0, b1, b2, b3 : float
        :func:`simplex_bound`, :func:`welch_bound`, :func:`hadamard_power_bound`,
        :func:`volume_bound`.
    k : int
        The Hadamard power used by ``b2``.
    V, d : int
        The arguments.
    """

    value: float
    binding: str
    b0: float
    b1: float
    b2: float
    b3: float
    k: int
    V: int
    d: int

    def as_dict(self) -> dict[str, float]:
        """The four bound values by name."""
        return {"B0": self.b0, "B1": self.b1, "B2": self.b2, "B3": self.b3}


def ratio_upper_bound(V: int, d: int, /) -> RatioBound:
    r"""Best upper bound on :math:`\rho = m/D` over configurations of V points in R^d.

    Parameters
    ----------
    V : int
        Number of points, ``V >= 2``.
    d : int
        Dimension, ``d >= 1``.

    Returns
    -------
    bound : RatioBound
        ``value`` (the minimum of B0-B3), ``binding`` (which one), the four values and
        the Hadamard power ``k`` of B2.

    Notes
    -----
    .. math:: \rho(X) \le \min(B_0, B_1, B_2, B_3) \quad \text{for every } X \in \mathbb{R}^{V \times d}

    See :func:`simplex_bound`, :func:`welch_bound`, :func:`hadamard_power_bound` and
    :func:`volume_bound` for the formulas and proofs.  The bound depends on
    :math:`(V, d)` only (invariant under every isometry and scaling of the points); it
    is non-increasing in ``V`` and non-decreasing in ``d``, and equals 1 (attained by
    the regular simplex) for :math:`V \le d + 1`.  Numerical guarantee: every bound is
    computed in float64 and rounded outward by 8 ulps, so the returned float is itself
    a valid bound, also where it is attained (:math:`V = d + 2` for even ``d``,
    :math:`(10, 4)`, :math:`(16, 5)`).  Time O(k) for the Hadamard power ``k``.

    References
    ----------
    .. [1] LM-head update geometry (v1, max-min spreading), arXiv:2608.22253.

    Examples
    --------
    >>> import refgeo
    >>> b = refgeo.ratio_upper_bound(10, 4)
    >>> b.binding, round(b.value ** 2, 12)
    ('B1', 0.5)
    >>> refgeo.ratio_upper_bound(50000, 64).binding
    'B2'
    """
    V, d = _check_vd(V, d)
    b0 = simplex_bound(V, d)
    b1 = welch_bound(V, d)
    b2, k = _best_hadamard(V, d, None)
    b3 = volume_bound(V, d)
    vals = {"B0": b0, "B1": b1, "B2": b2, "B3": b3}
    binding = min(vals, key=lambda name: (vals[name], name))
    return RatioBound(value=vals[binding], binding=binding, b0=b0, b1=b1, b2=b2, b3=b3, k=k, V=V, d=d)
