r"""Max-min spreading: approximately equidistant rows (SPEC §4).

For :math:`V > d + 1` points no configuration in :math:`\mathbb{R}^d` is equidistant;
the v1 update asks for the next best thing,

.. math:: \max_X \; m(X) \quad \text{subject to} \quad D(X) \le \eta,

equivalently the largest distance ratio :math:`\rho = m/D`.  This module has the
algebraic constructions that solve it (or nearly) where they exist, a solver that
reaches the known optima in small cases and improves on the constructions at scale,
and the gradient-coupled form that trades loss decrease against :math:`m(S)`.

.. autosummary::

   regular_simplex
   orthogonal_simplices
   cross_polytope
   kerdock_code
   delsarte_goethals_code
   embed
   spread
   spread_update
   SpreadResult
   SpreadProgress
   SpreadUpdate

Every result reports how far it is from the limit: ``SpreadResult.upper_bound`` is
:func:`refgeo.ratio_upper_bound` for ``(V, d)``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ._validate import (
    as_float_array,
    check_bool,
    check_choice,
    check_int,
    check_min_rows,
    check_open_unit_interval,
    check_real,
)
from .bounds import RatioBound, ratio_upper_bound

__all__ = [
    "SpreadProgress",
    "SpreadResult",
    "SpreadUpdate",
    "cross_polytope",
    "delsarte_goethals_code",
    "embed",
    "kerdock_code",
    "orthogonal_simplices",
    "regular_simplex",
    "spread",
    "spread_update",
]


def _readonly(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


# =========================================================================== constructions


def regular_simplex(V: int, d: int) -> np.ndarray:
    r"""Vertices of a regular simplex: ``V <= d + 1`` unit vectors, pairwise equidistant.

    Parameters
    ----------
    V : int
        Number of points, ``2 <= V <= d + 1``.
    d : int
        Dimension.

    Returns
    -------
    X : ndarray of shape (V, d)
        float64 unit rows with :math:`\langle x_i, x_j \rangle = -1/(V-1)` for
        :math:`i \ne j`, centred (:math:`\sum_i x_i = 0`), supported on the first
        ``V - 1`` coordinates.

    Notes
    -----
    .. math:: \lVert x_i - x_j \rVert^2 = \frac{2V}{V - 1}, \qquad \rho = 1

    The rows are :math:`e_i - \mathbf{1}/V` written in the Helmert basis of
    :math:`\mathbf{1}^\perp` and normalised.  The optimum of max-min spreading for
    every :math:`V \le d + 1`.  Time and memory O(V d).

    References
    ----------
    .. [1] LM-head update geometry (v1, max-min spreading), arXiv:2608.22253.

    Examples
    --------
    >>> import refgeo
    >>> X = refgeo.regular_simplex(3, 2)
    >>> (X @ X.T).round(12).tolist()
    [[1.0, -0.5, -0.5], [-0.5, 1.0, -0.5], [-0.5, -0.5, 1.0]]
    """
    d = check_int(d, "d", min_value=1)
    V = check_int(V, "V", min_value=2, max_value=d + 1)
    X = np.zeros((V, d))
    for k in range(1, V):  # Helmert row k: k ones then -k, over sqrt(k (k + 1))
        c = 1.0 / math.sqrt(k * (k + 1.0))
        X[:k, k - 1] = c
        X[k, k - 1] = -k * c
    X /= math.sqrt(1.0 - 1.0 / V)
    return X


def orthogonal_simplices(d: int) -> np.ndarray:
    r"""Two regular simplices in orthogonal subspaces: ``d + 2`` points in R^d.

    Parameters
    ----------
    d : int
        Dimension, ``d >= 1``.

    Returns
    -------
    X : ndarray of shape (d + 2, d)
        float64 rows: a simplex of :math:`a + 1` points in the first
        :math:`a = \lfloor d/2 \rfloor` coordinates and one of :math:`b + 1` points in
        the other :math:`b = d - a`, centred at the origin, with radii chosen so that
        both simplices have the same edge (the largest radius is 1).

    Notes
    -----
    .. math:: \rho^2 = \frac12\Big(\frac{a}{a+1} + \frac{b}{b+1}\Big)
       \quad (= d/(d+2) \text{ for even } d)

    Cross pairs are the closest (:math:`m^2 = r_1^2 + r_2^2`), edges the farthest.
    For even ``d`` this attains :func:`refgeo.welch_bound` at :math:`V = d + 2`, hence is
    optimal.  Time and memory O(d^2).

    References
    ----------
    .. [1] LM-head update geometry (v1, max-min spreading), arXiv:2608.22253.

    Examples
    --------
    >>> import refgeo
    >>> refgeo.orthogonal_simplices(2).round(12).tolist()
    [[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0], [0.0, -1.0]]
    """
    d = check_int(d, "d", min_value=1)
    a = d // 2
    b = d - a
    # Equal edges: r_k^2 * 2 (k + 1) / k is the same for k = a and k = b (largest r = 1).
    r2 = 1.0
    r1 = math.sqrt(a / (a + 1.0) * (b + 1.0) / b) if a > 0 else 0.0
    X = np.zeros((d + 2, d))
    if a > 0:
        X[: a + 1, :a] = r1 * regular_simplex(a + 1, a)
    X[a + 1 :, a:] = r2 * regular_simplex(b + 1, b)
    return X


def cross_polytope(d: int) -> np.ndarray:
    r"""The cross polytope (orthoplex): the ``2 d`` points :math:`\pm e_i`.

    Parameters
    ----------
    d : int
        Dimension, ``d >= 1``.

    Returns
    -------
    X : ndarray of shape (2 d, d)
        float64 rows :math:`e_1, -e_1, e_2, -e_2, \dots`.

    Notes
    -----
    .. math:: m = \sqrt{2}, \quad D = 2, \quad \rho = 1/\sqrt{2} \quad (d \ge 2)

    The optimal spherical code of :math:`2d` points; inner products
    :math:`\{0, -1\}`.  Time and memory O(d^2).

    Examples
    --------
    >>> import refgeo
    >>> refgeo.cross_polytope(2).tolist()
    [[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0], [0.0, -1.0]]
    """
    d = check_int(d, "d", min_value=1)
    X = np.zeros((2 * d, d))
    idx = np.arange(d)
    X[2 * idx, idx] = 1.0
    X[2 * idx + 1, idx] = -1.0
    return X


def embed(X: Any, /, *, d: int) -> np.ndarray:
    r"""Zero-pad the rows of ``X`` into a larger dimension ``d``.

    Parameters
    ----------
    X : array_like of shape (V, d0)
        A configuration.
    d : int
        Target dimension, ``d >= d0``.

    Returns
    -------
    Y : ndarray of shape (V, d)
        float64 ``[X, 0]``: every distance and inner product is unchanged, so
        :math:`\rho(Y) = \rho(X)`.

    Examples
    --------
    >>> import refgeo
    >>> refgeo.embed([[1.0], [-1.0]], d=3).tolist()
    [[1.0, 0.0, 0.0], [-1.0, 0.0, 0.0]]
    """
    X = as_float_array(X, "X", ndim=2, shape_hint="2-D array of shape (V, d0)")
    d = check_int(d, "d", min_value=int(X.shape[1]))
    Y = np.zeros((X.shape[0], d))
    Y[:, : X.shape[1]] = np.asarray(X, dtype=np.float64)
    return Y


# --------------------------------------------------------------------------- Kerdock


def _fwht(a: np.ndarray, axis: int = 0) -> np.ndarray:
    """Unnormalised fast Walsh-Hadamard transform along ``axis`` (length a power of 2)."""
    a = np.moveaxis(np.array(a, dtype=np.float64, copy=True), axis, 0)
    n = a.shape[0]
    h = 1
    while h < n:
        v = a.reshape(n // (2 * h), 2, h, *a.shape[1:])
        x = v[:, 0].copy()
        v[:, 0] += v[:, 1]
        v[:, 1] = x - v[:, 1]
        h *= 2
    return np.moveaxis(a, 0, axis)


def _irreducible_poly(m: int) -> int:
    """The smallest irreducible binary polynomial of degree ``m`` (bit k = coefficient of x^k)."""

    def pmod(a: int, b: int) -> int:
        db = b.bit_length()
        while a.bit_length() >= db:
            a ^= b << (a.bit_length() - db)
        return a

    for p in range((1 << m) | 1, 1 << (m + 1), 2):
        if all(pmod(p, q) != 0 for q in range(2, 1 << (m // 2 + 1)) if q.bit_length() - 1 <= m // 2):
            return p
    raise AssertionError("unreachable: irreducible polynomials exist in every degree")


def _gf_mul(a: np.ndarray, b: np.ndarray, m: int, poly: int) -> np.ndarray:
    """Elementwise product in GF(2^m) = F_2[x]/(poly), elements as int64 bit masks."""
    a = np.asarray(a, dtype=np.int64).copy()
    b = np.asarray(b, dtype=np.int64).copy()
    r = np.zeros(np.broadcast(a, b).shape, dtype=np.int64)
    top = 1 << m
    for _ in range(m):
        r ^= np.where(b & 1, a, 0)
        b >>= 1
        a <<= 1
        a ^= np.where(a & top, poly, 0)
    return r


def _parity(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a, dtype=np.int64).copy()
    p = np.zeros_like(a)
    while np.any(a):
        p ^= a & 1
        a >>= 1
    return p


class _Field:
    """GF(2^m) = F_2[x]/(poly) with the powers of x and the trace, for odd m."""

    def __init__(self, m: int):
        self.m = m
        self.poly = _irreducible_poly(m)
        pw = [1]
        for _ in range(3 * m):
            pw.append(int(_gf_mul(np.array(pw[-1]), np.array(2), m, self.poly)))
        self.powers = np.array(pw, dtype=np.int64)  # x^0, x^1, ..., x^{3m}

    def mul(self, a, b):
        return _gf_mul(a, b, self.m, self.poly)

    def trace(self, z):
        z = np.asarray(z, dtype=np.int64)
        t = z.copy()
        acc = z.copy()
        for _ in range(self.m - 1):
            acc = self.mul(acc, acc)
            t ^= acc
        return t & 1  # the trace lies in F_2 = {0, 1}


def _kerdock_forms(n: int, us: np.ndarray, ws: np.ndarray | None = None) -> np.ndarray:
    r"""Alternating (symplectic) forms of a Kerdock / Delsarte-Goethals set on F_2^n, n even.

    Identify :math:`F_2^n` with :math:`K \oplus F_2`, :math:`K = GF(2^{n-1})` (odd
    degree), coordinates in the polynomial basis :math:`x^0, \dots, x^{n-2}` of K
    followed by the :math:`F_2` coordinate.  For :math:`u \in K`,

    .. math:: B_u((x, a), (y, b)) = \mathrm{Tr}(ux)\mathrm{Tr}(uy) + \mathrm{Tr}(u^2 xy)
              + a\,\mathrm{Tr}(uy) + b\,\mathrm{Tr}(ux),

    the polarisation of :math:`Q(ux) + a\,\mathrm{Tr}(ux)` with
    :math:`Q(z) = \sum_{j=1}^{(n-2)/2} \mathrm{Tr}(z^{2^j + 1})`; every
    :math:`B_u + B_v` (:math:`u \ne v`) is nonsingular (a Kerdock set).  With ``ws``,
    :math:`C_w((x, a), (y, b)) = \mathrm{Tr}(w(xy^2 + x^2y))` is added (pairs
    ``(us[i], ws[i])``); every nonzero :math:`B_u + C_w` has rank at least
    :math:`n - 2` (a Delsarte-Goethals set).  Both facts are checked in the tests.
    Returns int64 0/1 matrices of shape (len(us), n, n).
    """
    m = n - 1
    F = _Field(m)
    us = np.asarray(us, dtype=np.int64)
    basis = F.powers[:m]
    tr_u_e = F.trace(F.mul(us[:, None], basis[None, :]))  # (U, m): Tr(u x^i)
    u2 = F.mul(us, us)
    tr_u2_pow = F.trace(F.mul(u2[:, None], F.powers[None, : 2 * m - 1]))  # Tr(u^2 x^k)
    i = np.arange(m)
    B = np.zeros((us.shape[0], n, n), dtype=np.int64)
    B[:, :m, :m] = (tr_u_e[:, :, None] * tr_u_e[:, None, :] + tr_u2_pow[:, np.add.outer(i, i)]) & 1
    B[:, :m, m] = tr_u_e
    B[:, m, :m] = tr_u_e
    if ws is not None:
        ws = np.asarray(ws, dtype=np.int64)
        tr_w_pow = F.trace(F.mul(ws[:, None], F.powers[None, : 3 * m - 2]))  # Tr(w x^k)
        C = tr_w_pow[:, np.add.outer(i, 2 * i)] ^ tr_w_pow[:, np.add.outer(2 * i, i)]
        B[:, :m, :m] ^= C
    B[:, np.arange(n), np.arange(n)] = 0  # alternating (the construction already is)
    return B


def _check_power_of_4(d: int) -> int:
    d = check_int(d, "d", min_value=4)
    n = d.bit_length() - 1
    if d != 1 << n or n % 2:
        raise ValueError(f"d must be a power of 4 (4, 16, 64, 256, ...), got {d} instead.")
    return n


def _quadratic_code(d: int, V: int, n: int, us: np.ndarray, ws: np.ndarray | None) -> np.ndarray:
    """Standard basis, then one Hadamard basis H diag((-1)^{Q}) per form (first V rows)."""
    X = np.zeros((V, d))
    k = min(V, d)
    X[np.arange(k), np.arange(k)] = 1.0
    n_bases = -(-(V - d) // d) if V > d else 0
    if n_bases == 0:
        return X
    B = _kerdock_forms(n, us[:n_bases], None if ws is None else ws[:n_bases])
    U = np.triu(B, 1)  # Q(z) = sum_{i<j} B_ij z_i z_j has polarisation B
    z = np.arange(d, dtype=np.int64)
    Z = (z[:, None] >> np.arange(n)[None, :]) & 1  # (d, n) bits of z
    scale = 1.0 / math.sqrt(d)
    for b in range(n_bases):
        q = ((Z @ U[b]) * Z).sum(axis=1) & 1
        s = 1.0 - 2.0 * q  # (-1)^{Q(z)}
        basis = _fwht(np.diag(s), axis=0) * scale  # row a: (-1)^{a.z} s(z) / sqrt(d)
        lo = d + b * d
        hi = min(V, lo + d)
        X[lo:hi] = basis[: hi - lo]
    return X


def delsarte_goethals_code(d: int, V: int | None = None) -> np.ndarray:
    r"""A Delsarte-Goethals line set: up to :math:`d + d^3/4` lines of coherence :math:`2/\sqrt d`.

    Parameters
    ----------
    d : int
        Dimension, a power of 4, at least 16.
    V : int, default=None
        Number of vectors, ``1 <= V <= d + d**3 // 4``; ``None`` returns all.

    Returns
    -------
    X : ndarray of shape (V, d)
        float64 unit rows, one per line: the standard basis, then :math:`d^2/4`
        orthonormal bases :math:`H \operatorname{diag}((-1)^{Q})`, the first
        :math:`d/2` of which are those of :func:`kerdock_code` (so the first
        :math:`d(d/2+1)` rows agree with it).

    Notes
    -----
    The quadratic forms are :math:`Q_u + C_w` (Kerdock forms plus the Gold-type forms
    :math:`\mathrm{Tr}(w(xy^2 + x^2y))`); every difference has symplectic rank at least
    :math:`n - 2`, so cross-basis inner products lie in
    :math:`\{0, \pm 1/\sqrt d, \pm 2/\sqrt d\}` and

    .. math:: \rho^2 \ge \frac{\sqrt d - 2}{\sqrt d + 2}.

    For :math:`V \gg d^2` with small ``d`` (the hard regime), e.g. :math:`(50000, 64)`:
    :math:`\rho = \sqrt{3/5} = 0.7746` against the bound 0.865 (random points: 0.45).
    Time O(V d), memory O(V d); entries exactly :math:`0, 1, \pm 2^{-n/2}`.

    References
    ----------
    .. [1] LM-head update geometry (v1, max-min spreading), arXiv:2608.22253.
    .. [2] A. R. Calderbank, P. J. Cameron, W. M. Kantor, J. J. Seidel,
       Z4-Kerdock codes, orthogonal spreads, and extremal Euclidean line-sets,
       Proc. London Math. Soc. 75 (1997).

    Examples
    --------
    >>> import numpy as np, refgeo
    >>> X = refgeo.delsarte_goethals_code(16)
    >>> G = np.abs(X @ X.T).round(12)
    >>> X.shape, sorted(set(G.ravel().tolist()))
    ((1040, 16), [0.0, 0.25, 0.5, 1.0])
    """
    n = _check_power_of_4(d)
    if n < 4:
        raise ValueError(f"d must be a power of 4 that is at least 16, got {d} instead.")
    half = d // 2
    total = d + d * half * half
    V = total if V is None else check_int(V, "V", min_value=1, max_value=total)
    w, u = np.divmod(np.arange(half * half, dtype=np.int64), half)
    return _quadratic_code(d, V, n, u, w)


def kerdock_code(d: int, V: int | None = None) -> np.ndarray:
    r"""Real mutually unbiased bases from a Kerdock set: up to :math:`d(d/2 + 1)` lines.

    Parameters
    ----------
    d : int
        Dimension, a power of 4 (``4, 16, 64, 256, 1024, ...``).
    V : int, default=None
        Number of vectors, ``1 <= V <= d (d/2 + 1)``; ``None`` returns all of them.

    Returns
    -------
    X : ndarray of shape (V, d)
        float64 unit rows, one vector per line (never both :math:`v` and :math:`-v`):
        first the standard basis, then :math:`d/2` bases
        :math:`\{ d^{-1/2} (-1)^{Q_u(z) + a \cdot z} \}_{a}` (rows indexed by
        :math:`a \in F_2^n`, coordinates by :math:`z \in F_2^n`, :math:`n = \log_2 d`),
        in that order; the first ``V`` rows are returned.  Entries are exactly
        :math:`0, 1` or :math:`\pm 2^{-n/2}`.

    Notes
    -----
    Within a basis the rows are orthonormal; across bases every inner product is
    :math:`\pm 1/\sqrt{d}`, because :math:`Q_u - Q_v` has a nonsingular symplectic part
    (a bent function), so

    .. math:: \rho^2 = \frac{\sqrt d - 1}{\sqrt d + 1} \quad (V \ge d + 2),

    (at :math:`V = d + 1` the one extra row is the all-positive Hadamard row, so no
    inner product is negative and :math:`\rho^2 = 1 - 1/\sqrt d`),

    within 0.5% of :func:`refgeo.welch_bound` wherever :math:`V \le d^2/2 + d`
    (e.g. :math:`(50000, 1024)`: 0.96922 against 0.96955).  The quadratic forms come
    from the trace construction over :math:`GF(2^{n-1})` (see ``_kerdock_forms``);
    each basis is :math:`H \operatorname{diag}(s_u)` built with a fast Walsh-Hadamard
    transform.  Time O(V d + (V/d) d \log d), memory O(V d).  Exact: every inner
    product is computed without rounding in float64.

    References
    ----------
    .. [1] LM-head update geometry (v1, max-min spreading), arXiv:2608.22253.
    .. [2] A. R. Calderbank, P. J. Cameron, W. M. Kantor, J. J. Seidel,
       Z4-Kerdock codes, orthogonal spreads, and extremal Euclidean line-sets,
       Proc. London Math. Soc. 75 (1997).

    Examples
    --------
    >>> import numpy as np, refgeo
    >>> X = refgeo.kerdock_code(4)
    >>> X.shape, sorted(set(np.abs(X @ X.T).round(12).ravel().tolist()))
    ((12, 4), [0.0, 0.5, 1.0])
    """
    n = _check_power_of_4(d)
    total = d * (d // 2 + 1)
    V = total if V is None else check_int(V, "V", min_value=1, max_value=total)
    return _quadratic_code(d, V, n, np.arange(d // 2, dtype=np.int64), None)


# =========================================================================== candidates


@dataclasses.dataclass(frozen=True)
class _Candidate:
    """A construction for (V, d) with its exact ratio (known in closed form)."""

    name: str
    rho: float
    build: Callable[[], np.ndarray]
    diameter: float | None = None  # exact D of build() when its distances are known exactly


def _kerdock_tagged(q: int, V: int, d: int, tags: bool) -> np.ndarray:
    """Stacked copies of kerdock_code(q) in orthogonal blocks of R^d, optionally tagged.

    With ``tags`` each basis b of a copy gets its own extra coordinate t_b and its
    vectors become v + q^(-1/4) t_b: cross-basis inner products +-1/sqrt(q) (from v),
    same-basis ones 1/sqrt(q) (from the tag), all norms^2 1 + 1/sqrt(q); so
    rho^2 = sqrt(q)/(sqrt(q) + 2) (coherence 1/(sqrt(q) + 1) after normalisation).
    Entries are exact dyadic numbers when q^(1/4) is a power of 2 (q = 16, 256, ...).
    """
    per = q * (q // 2 + 1)
    n_bases = -(-V // q)
    n_copies = -(-n_bases // (q // 2 + 1))
    # Spread the bases evenly over the copies.
    bases = [n_bases // n_copies + (1 if i < n_bases % n_copies else 0) for i in range(n_copies)]
    X = np.zeros((V, d))
    row = 0
    col = 0
    tag = q**-0.25
    for nb in bases:
        take = min(nb * q, V - row, per)
        K = kerdock_code(q, take)
        if tags:
            X[row : row + take, col : col + q] = K
            b_of_row = np.arange(take) // q
            X[row + np.arange(take), col + q + b_of_row] = tag
            col += q + nb
        else:
            X[row : row + take, col : col + q] = K
            col += q
        row += take
    assert row == V and col <= d
    return X


# Lattice balls: in small dimension the best configurations are packings, not points
# on a sphere (every sphere-based construction has ratio O(V^(-1/(d-1)))); the V points
# of a dense lattice nearest to a centre give ratio about V^(-1/d).
_LATTICE_MAX_D = 8
_LATTICE_MAX_V = 20000
_LATTICE_MAX_BOX = 1 << 21  # lattice points enumerated at most


def _lattice_points(d: int, m: int) -> tuple[np.ndarray, float]:
    """Points of a dense lattice in the box [-m, m]^d and its minimal distance.

    d = 1: Z; d = 2: the hexagonal lattice A2; 3 <= d <= 8: the checkerboard lattice
    D_d (integer vectors with even coordinate sum; D_3 is the FCC packing).
    """
    axes = [np.arange(-m, m + 1, dtype=np.float64)] * d
    P = np.stack(np.meshgrid(*axes, indexing="ij"), axis=-1).reshape(-1, d)
    if d == 1:
        return P, 1.0
    if d == 2:
        # basis (1, 0), (1/2, sqrt(3)/2)
        return np.column_stack([P[:, 0] + 0.5 * P[:, 1], (math.sqrt(3.0) / 2.0) * P[:, 1]]), 1.0
    return P[np.sum(P, axis=1) % 2 == 0], math.sqrt(2.0)


def _lattice_ball(V: int, d: int) -> tuple[np.ndarray, float] | None:
    """The V lattice points nearest to the best of a few centres, with their ratio."""
    from .rows import row_diameter

    # smallest box whose inscribed ball (radius m - 1/2, any centre) holds about 1.5 V
    # lattice points: ball volume over the covolume (1, sqrt(3)/2, 2 for Z, A2, D_d)
    covolume = 1.0 if d == 1 else (math.sqrt(3.0) / 2.0 if d == 2 else 2.0)
    unit_ball = math.pi ** (d / 2.0) / math.gamma(d / 2.0 + 1.0)
    m = 1
    while unit_ball * (m - 0.5) ** d / covolume < 1.5 * V:
        m += 1
    if (2 * m + 1) ** d > _LATTICE_MAX_BOX:
        return None
    P, lam = _lattice_points(d, m)
    rng = np.random.default_rng(0)
    # a lattice point, a deep-hole-like point and (for smaller V) random offsets; each
    # costs one O(V^2 d) diameter
    centres = [np.zeros(d), np.full(d, 0.5)]
    if d > 1 and V <= 5000:
        centres += [rng.uniform(-0.5, 0.5, d) for _ in range(4)]
    best = None
    for c in centres:
        r2 = np.einsum("ij,ij->i", P - c, P - c)
        idx = np.argsort(r2, kind="stable")[:V]
        if math.sqrt(r2[idx[-1]]) + float(np.max(np.abs(c))) >= m:
            continue  # the ball around c leaves the box: points outside it are missing
        X = P[idx]
        D = row_diameter(X).value
        if best is None or lam / D > best[1]:
            best = (X, lam / D)
    return best


def _simplex_blocks(V: int, d: int) -> tuple[list[int], float]:
    """Block sizes and ratio of V - d regular simplices (unit edge) in orthogonal blocks.

    Blocks of p and q points (circumradii R^2 = (p-1)/(2p)) are at distance^2
    R_p^2 + R_q^2 < 1 from each other, so the diameter is 1 and m^2 is that sum for the
    two smallest blocks; V - t dimensions are used for t blocks, hence t = V - d.
    """
    t = V - d
    sizes = [V // t + (1 if i < V % t else 0) for i in range(t)]
    a, b = sorted(sizes)[:2]
    return sizes, math.sqrt((a - 1) / (2.0 * a) + (b - 1) / (2.0 * b))


def _build_simplex_blocks(V: int, d: int) -> np.ndarray:
    sizes, _ = _simplex_blocks(V, d)
    X = np.zeros((V, d))
    row = col = 0
    for p in sizes:
        block = regular_simplex(p, p - 1) if p > 1 else np.zeros((1, 0))
        if p > 1:
            block = block / math.sqrt(2.0 * p / (p - 1.0))  # unit edge (unit circumradius before)
        X[row : row + p, col : col + p - 1] = block
        row += p
        col += p - 1
    return X


def _candidates(V: int, d: int) -> list[_Candidate]:
    """Constructions usable for (V, d), each with its closed-form ratio (the lattice
    balls of small d with a computed one)."""
    out: list[_Candidate] = []
    if V <= d + 1:
        out.append(_Candidate("regular_simplex", 1.0, lambda: regular_simplex(V, d),
                              math.sqrt(2.0 * V / (V - 1.0))))
        return out
    if d <= _LATTICE_MAX_D and V <= _LATTICE_MAX_V and V > 2 * d:
        lb = _lattice_ball(V, d)
        if lb is not None:
            X, rho = lb
            name = {1: "lattice(Z)", 2: "lattice(A2)"}.get(d, f"lattice(D{d})")
            out.append(_Candidate(name, rho, lambda X=X: X.copy()))
    if V == d + 2:
        a, b = d // 2, d - d // 2
        rho = math.sqrt(0.5 * (a / (a + 1.0) + b / (b + 1.0)))
        out.append(_Candidate("orthogonal_simplices", rho, lambda: orthogonal_simplices(d)))
    if V <= 2 * d and d >= 2:
        out.append(_Candidate("cross_polytope", math.sqrt(0.5), lambda: cross_polytope(d)[:V], 2.0))
    if d + 2 < V <= 2 * d:
        # generalises orthogonal_simplices (V = d + 2, two blocks) to V - d blocks
        t = V - d
        out.append(_Candidate(f"orthogonal_simplices(x{t})", _simplex_blocks(V, d)[1],
                              lambda: _build_simplex_blocks(V, d)))
    q = 4
    while q <= d:
        sq = math.sqrt(q)
        n_bases = -(-V // q)
        if n_bases >= 2:
            n_copies = -(-n_bases // (q // 2 + 1))
            if n_copies * q <= d:
                rho = math.sqrt((sq - 1.0) / (sq + 1.0))
                out.append(_Candidate(f"kerdock({q})x{n_copies}", rho,
                                      lambda q=q: _kerdock_tagged(q, V, d, False), math.sqrt(2.0 + 2.0 / sq)))
            if n_copies * q + n_bases <= d:
                rho = math.sqrt(sq / (sq + 2.0))
                dyadic = int(round(math.log(q, 4))) % 2 == 0  # q^(1/4) a power of 2
                out.append(_Candidate(f"kerdock({q})x{n_copies}+tags", rho,
                                      lambda q=q: _kerdock_tagged(q, V, d, True),
                                      math.sqrt(2.0 + 4.0 / sq) if dyadic else None))
            if q >= 16 and V > q * (q // 2 + 1) and V <= q + q**3 // 4:
                rho = math.sqrt((sq - 2.0) / (sq + 2.0))
                out.append(_Candidate(f"delsarte_goethals({q})", rho,
                                      lambda q=q: embed(delsarte_goethals_code(q, V), d=d), math.sqrt(2.0 + 4.0 / sq)))
        q *= 4
    return out


# =========================================================================== results


@dataclasses.dataclass(frozen=True, slots=True)
class SpreadProgress:
    """One progress report of :func:`spread` (passed to ``callback``).

    Attributes
    ----------
    phase : str
        ``"start"`` (a multistart local solve finished), ``"round"`` (a round of the
        smoothed iteration finished) or ``"done"``.
    iteration : int
        Starts or rounds so far.
    elapsed : float
        Seconds since the call began.
    ratio : float
        Best distance ratio so far (measured, not yet certified).
    upper_bound : float
        :func:`refgeo.ratio_upper_bound` for ``(V, d)``.
    """

    phase: str
    iteration: int
    elapsed: float
    ratio: float
    upper_bound: float


@dataclasses.dataclass(frozen=True, slots=True)
class SpreadResult:
    """A spread configuration with its certified ratio and the gap to the bound.

    Attributes
    ----------
    points : ndarray of shape (V, d)
        float64 rows, centred (mean row 0), scaled so that the diameter is ``eta``
        (read-only).
    min_dist : float
        :math:`m(X)`, the closest-pair distance.
    diameter : float
        :math:`D(X)`.
    ratio : float
        :math:`\\rho = m/D`.
    upper_bound : float
        :func:`refgeo.ratio_upper_bound` ``(V, d).value``: no configuration does better.
    certified : bool
        True when ``min_dist`` and ``diameter`` are certified: computed by the certified
        engine (:func:`refgeo.closest_pair`, :func:`refgeo.row_diameter`), or known
        algebraically for an unmodified exact construction (see ``certificate``).
    certificate : str
        ``"engine"``, ``"algebraic"`` or ``"none"``.
    error_bound : float
        Bound on the relative error of ``min_dist`` and ``diameter`` (0 when computed
        by the engine with ``eta = 1``: those are the exact refined float64 values;
        otherwise they are certified at diameter 1 and scaled by ``eta``, and ``ratio``
        is the certified ratio itself).  With ``certify=False`` it is the a-priori
        bound of the float64 Gram expansion relative to ``min_dist**2``, large (even
        inf) when the closest pair is short against the row norms.
    min_pair, diameter_pair : tuple of int
        A closest pair and a diameter pair ``(i, j)``, ``i < j`` (``(-1, -1)`` when
        not computed, with the algebraic certificate).
    bound : RatioBound
        All four bounds and which one binds.
    method : str
        ``"construction"``, ``"epigraph"`` or ``"smooth"``.
    init : str
        Name of the starting construction (or ``"random"``, ``"user"``).
    n_iter : int
        Local solves (epigraph) or iteration steps (smooth).
    elapsed : float
        Seconds.
    history : tuple of (float, float)
        ``(elapsed, best ratio)`` after each start or round.
    """

    points: np.ndarray
    min_dist: float
    diameter: float
    ratio: float
    upper_bound: float
    certified: bool
    certificate: str
    error_bound: float
    min_pair: tuple[int, int]
    diameter_pair: tuple[int, int]
    bound: RatioBound
    method: str
    init: str
    n_iter: int
    elapsed: float
    history: tuple[tuple[float, float], ...]

    @property
    def gap(self) -> float:
        """``upper_bound - ratio`` (how far from the limit)."""
        return self.upper_bound - self.ratio


# =========================================================================== helpers


def _pair_sq(X: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """All pairs i < j and their squared distances (small V only)."""
    i, j = np.triu_indices(X.shape[0], 1)
    diff = X[i] - X[j]
    return i, j, np.einsum("pk,pk->p", diff, diff)


def _ratio_small(X: np.ndarray) -> float:
    _, _, e = _pair_sq(X)
    return math.sqrt(float(e.min()) / float(e.max())) if e.max() > 0 else 0.0


class _Clock:
    def __init__(self, max_time: float | None):
        self.t0 = time.perf_counter()
        self.deadline = None if max_time is None else self.t0 + max_time

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return math.inf if self.deadline is None else self.deadline - time.perf_counter()


# --------------------------------------------------------------------------- small: epigraph


def _epigraph_solve(X0: np.ndarray, *, maxiter: int = 500, deadline: float | None = None) -> np.ndarray:
    r"""Local solve of max t s.t. t <= ||x_i - x_j||^2 <= 1 over all pairs (SLSQP, analytic
    Jacobians), stopped at ``deadline`` (time.perf_counter()); never worse than X0."""
    iu, ju, e = _pair_sq(X0)
    X = X0 / math.sqrt(max(float(e.max()), 1e-300))
    Y = _epigraph_slsqp(X, iu, ju, iu, ju, maxiter, deadline)
    return Y if _ratio_small(Y) >= _ratio_small(X) else X


def _epigraph_slsqp(X0, li, lj, hi_i, hi_j, maxiter, deadline=None):
    from scipy.optimize import minimize

    V, d = X0.shape
    n = V * d
    L, H = li.shape[0], hi_i.shape[0]
    e_lo = np.einsum("pk,pk->p", X0[li] - X0[lj], X0[li] - X0[lj])
    z0 = np.concatenate([X0.ravel(), [e_lo.min()]])
    grad_obj = np.zeros(n + 1)
    grad_obj[n] = -1.0
    ii = np.concatenate([li, hi_i])
    jj = np.concatenate([lj, hi_j])
    rows = np.arange(L + H)
    sign = np.concatenate([np.ones(L), -np.ones(H)])

    def sq(z):
        X = z[:n].reshape(V, d)
        diff = X[ii] - X[jj]
        return np.einsum("pk,pk->p", diff, diff), diff

    def cons(z):
        e, _ = sq(z)
        return np.concatenate([e[:L] - z[n], 1.0 - e[L:]])

    def jac(z):
        _, diff = sq(z)
        J = np.zeros((L + H, V, d))
        J[rows, ii] = 2.0 * diff * sign[:, None]
        J[rows, jj] = -2.0 * diff * sign[:, None]
        A = np.zeros((L + H, n + 1))
        A[:, :n] = J.reshape(L + H, n)
        A[:L, n] = -1.0
        return A

    def stop_at_deadline(_):
        # the time budget is honoured inside a solve, not only between starts (one
        # SLSQP solve at (50, 8) takes seconds)
        if deadline is not None and time.perf_counter() > deadline:
            raise StopIteration

    res = minimize(
        lambda z: -z[n],
        z0,
        jac=lambda z: grad_obj,
        constraints=[{"type": "ineq", "fun": cons, "jac": jac}],
        method="SLSQP",
        options={"maxiter": maxiter, "ftol": 1e-16},
        callback=stop_at_deadline,
    )
    X = res.x[:n].reshape(V, d)
    return X if np.all(np.isfinite(X)) else X0


def _sphere_prephase(X: np.ndarray, betas=(4.0, 8.0, 16.0, 32.0, 64.0)) -> np.ndarray:
    """Annealed log-sum-exp of pairwise cosines on the sphere (L-BFGS), small V."""
    from scipy.optimize import minimize

    V, d = X.shape
    x = X.ravel().copy()
    mask = ~np.eye(V, dtype=bool)
    for beta in betas:

        def f(x, beta=beta):
            Y = x.reshape(V, d)
            nr = np.linalg.norm(Y, axis=1, keepdims=True)
            U = Y / nr
            G = U @ U.T
            mx = G[mask].max()
            W = np.where(mask, np.exp(beta * (G - mx)), 0.0)
            S = W.sum() / 2.0
            gU = (W @ U) / S
            gY = (gU - np.sum(gU * U, axis=1, keepdims=True) * U) / nr
            return mx + math.log(S) / beta, gY.ravel()

        x = minimize(f, x, jac=True, method="L-BFGS-B", options={"maxiter": 200}).x
    Y = x.reshape(V, d)
    return Y / np.linalg.norm(Y, axis=1, keepdims=True)


# --------------------------------------------------------------------------- large: smoothed


def _near_far(X: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """For unit rows: the k largest and k smallest inner products of every row (j != i).

    One GEMM pass over row blocks (the neighbourhoods are candidate sets only; every
    value used afterwards is recomputed in float64).  float32 for large problems;
    float64 up to V^2 d = 2^30, where float32 cannot rank inner products that all lie
    within 1e-7 of 1 (crowded points in small d: the near sets were wrong and the
    measured ratio with them).  Time O(V^2 d).
    """
    V, d = X.shape
    k = min(k, V - 1)
    X32 = np.ascontiguousarray(X, dtype=np.float64 if V * V * d <= (1 << 30) else np.float32)
    near = np.empty((V, k), dtype=np.int64)
    far = np.empty((V, k), dtype=np.int64)
    b = max(1, min(V, (1 << 24) // max(V, 1)))
    for i0 in range(0, V, b):
        i1 = min(V, i0 + b)
        G = X32[i0:i1] @ X32.T
        r = np.arange(i1 - i0)
        G[r, i0 + r] = np.inf
        far[i0:i1] = np.argpartition(G, k - 1, axis=1)[:, :k]
        G[r, i0 + r] = -np.inf
        near[i0:i1] = np.argpartition(G, V - k, axis=1)[:, V - k :]
    return near, far


def _pairs(nbr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    V, k = nbr.shape
    i = np.repeat(np.arange(V), k)
    j = nbr.ravel()
    lo = np.minimum(i, j)
    hi = np.maximum(i, j)
    key = np.unique(lo * V + hi)
    return key // V, key % V


def _rowdot(X: np.ndarray, i: np.ndarray, j: np.ndarray) -> np.ndarray:
    out = np.empty(i.shape[0])
    step = max(1, (1 << 22) // max(X.shape[1], 1))
    for s in range(0, i.shape[0], step):
        out[s : s + step] = np.einsum("pk,pk->p", X[i[s : s + step]], X[j[s : s + step]])
    return out


def _smooth(
    X: np.ndarray,
    *,
    k: int,
    clock: _Clock,
    max_rounds: int,
    inner: int,
    target: float,
    report: Callable[[int, float], bool],
) -> tuple[np.ndarray, float, int]:
    r"""Annealed max-min iteration on the sphere over k-NN neighbourhoods.

    Each round refreshes the candidate pairs (the ``k`` nearest and ``k`` farthest
    partners of every row), measures the ratio there (exact for the extreme pairs:
    they are among the candidates), then drives every candidate pair into the window
    :math:`a \le \langle x_i, x_j \rangle \le b` with :math:`(1-b)/(1-a)` a little
    above the current :math:`\rho^2` by gradient steps on the squared hinge penalty
    (all violating pairs move at once; O(V k d) per step).  Returns the best
    configuration seen at a refresh, its ratio and the number of steps.
    """
    from scipy import sparse

    V, d = X.shape
    nrm = np.linalg.norm(X, axis=1, keepdims=True)
    zero = nrm[:, 0] == 0.0
    if np.any(zero):
        # a zero row (the origin, e.g. in a user init) has no direction on the sphere:
        # give it a fixed pseudo-random one
        X = X.copy()
        X[zero] = np.random.default_rng(0).standard_normal((int(zero.sum()), d))
        nrm = np.linalg.norm(X, axis=1, keepdims=True)
    X = X / nrm
    best_X, best_rho = X.copy(), -1.0
    frac = _FRAC0  # fraction of the log-gap to the bound asked for in one round
    lr = 1e-2  # step: the largest rotation of a row, in radians
    steps = 0
    for r in range(max_rounds + 1):
        near, far = _near_far(X, k)
        In, Jn = _pairs(near)
        If, Jf = _pairs(far)
        ipn = _rowdot(X, In, Jn)
        ipf = _rowdot(X, If, Jf)
        M, mu = float(ipn.max()), float(ipf.min())
        rho = math.sqrt(max(1.0 - M, 0.0) / max(1.0 - mu, 1e-300))
        if rho > best_rho:
            best_X, best_rho = X.copy(), rho
        if report(r, best_rho) or r == max_rounds or clock.left() <= 0:
            break
        if rho >= target:
            break
        log_gap = max(2.0 * math.log(target / rho), 1e-12) if rho > 0 else 1.0
        t = frac * log_gap
        b = 1.0 - (1.0 - M) * math.exp(t / 2.0)
        a = 1.0 - (1.0 - mu) * math.exp(-t / 2.0)
        ok = False
        lr = max(lr, 1e-4)
        for _ in range(inner):
            if clock.left() <= 0:
                break
            vn = np.maximum(ipn - b, 0.0)
            vf = np.maximum(a - ipf, 0.0)
            pen = float(vn @ vn + vf @ vf)
            if pen == 0.0:
                ok = True
                break
            W = sparse.coo_matrix(
                (np.concatenate([vn, -vf]), (np.concatenate([In, If]), np.concatenate([Jn, Jf]))), shape=(V, V)
            ).tocsr()
            G = W @ X + W.T @ X
            G -= np.sum(G * X, axis=1, keepdims=True) * X
            G /= max(float(np.sqrt(np.max(np.einsum("ij,ij->i", G, G)))), 1e-300)  # lr = largest angle
            while lr > 1e-9:
                Xn = X - lr * G
                Xn /= np.linalg.norm(Xn, axis=1, keepdims=True)
                ipn_n = _rowdot(Xn, In, Jn)
                ipf_n = _rowdot(Xn, If, Jf)
                vn2 = np.maximum(ipn_n - b, 0.0)
                vf2 = np.maximum(a - ipf_n, 0.0)
                if float(vn2 @ vn2 + vf2 @ vf2) < pen:
                    X, ipn, ipf = Xn, ipn_n, ipf_n
                    lr = min(lr * 1.5, 0.5)
                    break
                lr *= 0.5
            steps += 1
        frac = min(0.5, frac * 1.5) if ok else max(1e-3, frac * 0.5)
    return best_X, best_rho, steps


# --------------------------------------------------------------------------- certification


def _gram_extremes(X: np.ndarray) -> tuple[float, float, tuple[int, int], tuple[int, int]]:
    """m and D (uncertified) by blocked float64 Gram expansion on centred rows; O(V^2 d)."""
    V = X.shape[0]
    Xc = X - X.mean(axis=0)
    nrm = np.einsum("ij,ij->i", Xc, Xc)
    lo, hi = math.inf, -math.inf
    lo_p = hi_p = (0, 1)
    b = max(1, min(V, (1 << 23) // max(V, 1)))
    for i0 in range(0, V, b):
        i1 = min(V, i0 + b)
        E = nrm[i0:i1, None] + nrm[None, :] - 2.0 * (Xc[i0:i1] @ Xc.T)
        r = np.arange(i1 - i0)
        E[r, i0 + r] = np.inf
        a = int(np.argmin(E))
        if E.flat[a] < lo:
            lo, lo_p = float(E.flat[a]), (i0 + a // V, a % V)
        E[r, i0 + r] = -np.inf
        a = int(np.argmax(E))
        if E.flat[a] > hi:
            hi, hi_p = float(E.flat[a]), (i0 + a // V, a % V)
    srt = lambda p: (min(p), max(p))  # noqa: E731
    return math.sqrt(max(lo, 0.0)), math.sqrt(max(hi, 0.0)), srt(lo_p), srt(hi_p)


def _engine_is_compiled(X: np.ndarray) -> bool:
    from . import _backend, rows

    try:
        return _backend.dispatch(rows._DIAMETER, X)[0] != "reference"
    except Exception:  # pragma: no cover - backend selection errors: use the reference
        return False


# =========================================================================== spread

_INITS = ("auto", "construction", "random")
_METHODS = ("auto", "epigraph", "smooth", "construction")
_SMALL_V = 50
_FRAC0 = 0.25
_INNER = 50


def spread(
    V: int,
    d: int,
    /,
    *,
    eta: float = 1.0,
    init: str | Any = "auto",
    method: str = "auto",
    seed: int | None = None,
    max_time: float | None = None,
    callback: Callable[[SpreadProgress], Any] | None = None,
    progress: bool = False,
    n_starts: int | None = None,
    k: int = 16,
    max_rounds: int = 20,
    certify: bool | str = "auto",
) -> SpreadResult:
    r"""Maximise the closest-pair distance of V points in R^d under a diameter budget.

    Parameters
    ----------
    V : int
        Number of points (rows), ``V >= 2``.
    d : int
        Dimension, ``d >= 1``.
    eta : float, default=1.0
        Diameter budget :math:`\eta > 0`; the result has :math:`D(X) = \eta`.
    init : {"auto", "construction", "random"} or array_like of shape (V, d), default="auto"
        Starting point: the best algebraic construction for ``(V, d)`` (``"auto"`` uses
        it when one exists), random points, or a user configuration.
    method : {"auto", "epigraph", "smooth", "construction"}, default="auto"
        ``"epigraph"``: multistart SLSQP on :math:`\max t` s.t.
        :math:`t \le \lVert x_i - x_j \rVert^2 \le 1` with analytic Jacobians (small V);
        ``"smooth"``: the annealed k-NN iteration on the sphere (large V);
        ``"construction"``: no optimisation (the start is returned: the best
        construction, or random points where none exists; ``result.init`` says which).
        ``"auto"``: the regular simplex for :math:`V \le d + 1`, ``"epigraph"`` for
        :math:`V \le 50` (started from the best construction), else ``"smooth"``,
        except that for :math:`V > 50` a construction is returned as is when it is
        within 1% of the bound,
        when :math:`V^2 d > 5 \cdot 10^{10}`, or when it is a lattice ball in
        :math:`d \le 4` (the V points of the hexagonal or checkerboard lattice nearest
        to a centre; offered for :math:`d \le 8`, :math:`2d < V \le 20000`; from
        d = 5 on ``"smooth"`` starts from random points and its result is kept only
        when it beats the lattice).
    seed : int, default=None
        Seed of the random starts (results are reproducible for a given seed, up to the
        time budget).
    max_time : float, default=None
        Time budget in seconds for the optimisation (the final certification is
        extra).  None: ``n_starts`` starts or ``max_rounds`` rounds.
    callback : callable, default=None
        Called with a :class:`SpreadProgress` after each start or round; returning
        True stops the optimisation.
    progress : bool, default=False
        Show a tqdm progress bar when tqdm is importable.
    n_starts : int, default=None
        Local solves of the epigraph method (default 12 for ``V <= 20``, else 4; stops
        early when the bound is reached).
    k : int, default=16
        Neighbours per row (nearest and farthest) of the smoothed iteration.
    max_rounds : int, default=20
        Neighbourhood refreshes of the smoothed iteration.
    certify : bool or "auto", default="auto"
        True: certify m and D with :func:`refgeo.closest_pair` and
        :func:`refgeo.row_diameter` (the engine).  ``"auto"``: the engine, except for an
        unmodified construction whose distances are known in closed form and whose
        engine certification would be expensive (V > 4000 and :math:`V^2 d > 5 \cdot
        10^{10}`): that one is certified algebraically.  False: an uncertified float64
        Gram estimate.

    Returns
    -------
    result : SpreadResult
        Points (centred, :math:`D = \eta`), ``min_dist``, ``diameter``, ``ratio``,
        ``upper_bound`` (:func:`refgeo.ratio_upper_bound`), the certificate and the
        optimisation record.

    Notes
    -----
    .. math:: \max_X \; m(X) = \min_{i<j} \lVert x_i - x_j \rVert
              \quad \text{s.t.} \quad D(X) = \max_{i<j} \lVert x_i - x_j \rVert \le \eta

    Constructions (closed-form :math:`\rho`): the regular simplex (:math:`V \le d+1`,
    :math:`\rho = 1`), two orthogonal simplices (:math:`V = d + 2`), the cross
    polytope, stacked :func:`kerdock_code` copies (:math:`\rho^2 =
    (\sqrt q - 1)/(\sqrt q + 1)`), *tagged* Kerdock copies where spare dimensions
    exist (one extra coordinate per basis; :math:`\rho^2 = \sqrt q/(\sqrt q + 2)`, e.g.
    0.9428 for :math:`(32768, 512)` and :math:`(50257, 768)`), and
    :func:`delsarte_goethals_code` beyond :math:`d^2/2`.

    Cost: the epigraph method is :math:`O(V^2 \cdot V d)` per SLSQP iteration; the
    smoothed iteration costs :math:`O(V k d)` per step and :math:`O(V^2 d)` per
    neighbourhood refresh (one float32 GEMM pass); certification is
    :math:`O(V^2 d)`.  The returned values are certified when ``certified`` is True
    (see :class:`SpreadResult`).  Invariant to rotations of the result; the problem
    is invariant under isometries and scaling.

    References
    ----------
    .. [1] LM-head update geometry (v1, max-min spreading), arXiv:2608.22253.

    Examples
    --------
    >>> import refgeo
    >>> r = refgeo.spread(4, 3)
    >>> round(r.ratio, 12), round(r.diameter, 12), r.method
    (1.0, 1.0, 'construction')
    >>> r = refgeo.spread(4, 2, seed=0)
    >>> round(r.ratio ** 2, 9), round(r.upper_bound ** 2, 9)
    (0.5, 0.5)
    """
    clock = _Clock(None)
    d = check_int(d, "d", min_value=1)
    V = check_int(V, "V", min_value=2)
    eta = check_real(eta, "eta", min_value=0.0, strict=True)
    method = check_choice(method, "method", _METHODS)
    if max_time is not None:
        max_time = check_real(max_time, "max_time", min_value=0.0)
    if callback is not None and not callable(callback):
        raise TypeError(f"callback must be callable or None, got {type(callback).__name__} instead.")
    progress = check_bool(progress, "progress")
    n_starts = check_int(n_starts, "n_starts", min_value=1, allow_none=True)
    k = check_int(k, "k", min_value=1)
    max_rounds = check_int(max_rounds, "max_rounds", min_value=0)
    if not (isinstance(certify, str) and certify == "auto"):
        if not isinstance(certify, (bool, np.bool_)):
            raise ValueError(f"certify must be True, False or 'auto', got {certify!r} instead.")
        certify = bool(certify)  # np.True_ would fail the `certify is True` test below
    user_X = None
    if isinstance(init, str):
        init = check_choice(init, "init", _INITS)
    else:
        user_X = as_float_array(init, "init", ndim=2, shape_hint="2-D array of shape (V, d)")
        user_X = np.array(user_X, dtype=np.float64)
        if user_X.shape != (V, d):
            raise ValueError(f"init must have shape ({V}, {d}), got shape {user_X.shape} instead.")
        centred = user_X - user_X.mean(axis=0)
        if not np.any(centred):
            raise ValueError(f"init must have at least two distinct rows, got {V} identical rows instead.")
    seed = check_int(seed, "seed", min_value=0, allow_none=True)
    rng = np.random.default_rng(seed)
    bound = ratio_upper_bound(V, d)
    opt_clock = _Clock(max_time)

    # ---- start
    cands = _candidates(V, d) if user_X is None and init != "random" else []
    best_c = max(cands, key=lambda c: c.rho) if cands else None
    if user_X is not None:
        X, init_name = user_X, "user"
    elif best_c is not None:
        X, init_name = best_c.build(), best_c.name
    else:
        X = rng.standard_normal((V, d))
        X /= np.linalg.norm(X, axis=1, keepdims=True)
        init_name = "random"
    start_rho = best_c.rho if (best_c is not None and user_X is None) else None

    if method == "auto":
        if user_X is None and best_c is not None and best_c.rho >= 1.0:
            method = "construction"
        elif V <= _SMALL_V:
            method = "epigraph"
        elif best_c is not None and best_c.name.startswith("lattice") and d <= 4:
            # a packing in the ball: the smooth iteration works on the sphere, where
            # every configuration is worse in d <= 4 (from d = 5 on it can win: it then
            # starts from random points and is kept only if it beats the lattice)
            method = "construction"
        elif start_rho is not None and (start_rho >= 0.99 * bound.value or V * V * d > 5e10):
            # Near the bound, or too large for O(V^2 d) neighbourhood refreshes to pay off
            # against an algebraic construction (whose massive ties the local iteration
            # cannot break): return the construction.
            method = "construction"
        else:
            method = "smooth"

    history: list[tuple[float, float]] = []
    bar = None
    if progress:
        try:
            from tqdm.auto import tqdm

            bar = tqdm(total=None, desc="spread", leave=False)
        except ImportError:  # pragma: no cover - tqdm is optional
            bar = None

    def report(phase: str, it: int, rho: float) -> bool:
        history.append((clock.elapsed(), rho))
        if bar is not None:
            bar.update(1)
            bar.set_postfix(ratio=f"{rho:.6f}", bound=f"{bound.value:.6f}")
        if callback is not None:
            return bool(callback(SpreadProgress(phase, it, clock.elapsed(), rho, bound.value)))
        return False

    n_iter = 0
    modified = method != "construction"
    if method == "epigraph":
        X, n_iter = _multistart(X if (user_X is not None or best_c is not None) else None, V, d,
                                n_starts=(12 if V <= 20 else 4) if n_starts is None else n_starts, rng=rng,
                                clock=opt_clock, bound=bound.value, report=report)
    elif method == "smooth":
        X0 = X.copy()
        rho0 = start_rho
        if user_X is None and best_c is not None and best_c.name.startswith("lattice"):
            X = rng.standard_normal((V, d))  # projecting a ball packing on the sphere collapses it
        elif user_X is None and best_c is not None:
            X = X + 1e-6 * rng.standard_normal(X.shape)  # break the ties of the construction
        X, rho, n_iter = _smooth(X, k=k, clock=opt_clock, max_rounds=max_rounds, inner=_INNER,
                                 target=bound.value, report=lambda r, rho: report("round", r, rho))
        if rho0 is not None and rho <= rho0:
            # the iteration did not beat the construction: say what is returned
            X, modified, method = X0, False, "construction"
    if bar is not None:
        bar.close()

    # ---- scale, centre, certify
    X = np.asarray(X, dtype=np.float64)
    V_ = X.shape[0]
    algebraic = (not modified) and best_c is not None and best_c.diameter is not None and user_X is None
    cheap = V_ <= 4000 or (_engine_is_compiled(X) and V_ * V_ * X.shape[1] <= 5e10)
    if certify is True or (certify == "auto" and (cheap or not algebraic)):
        mode = "engine"
    elif certify == "auto":
        mode = "algebraic"
    else:
        mode = "none"
    X = X - X.mean(axis=0)
    if mode == "algebraic":
        # Exact construction: every pairwise distance is known in closed form (the
        # inner-product spectrum, verified in the tests); scaling by eta/D rounds each
        # entry once, which moves every distance by at most a few ulps (relative).
        X = X * (eta / best_c.diameter)
        diameter, min_dist = eta, best_c.rho * eta
        pm, pd = (-1, -1), (-1, -1)
        err = 8.0 * 2.0**-52
    elif mode == "engine":
        from .rows import closest_pair, row_diameter

        # certified at diameter ~1, then scaled by eta: squared distances of points at
        # eta = 1e-160 would be subnormal (and at 1e160 overflow), and the refined
        # values with them (review: ratio above the proven bound at eta = 3e-161)
        Dp = row_diameter(X)
        X = X * (1.0 / Dp.value)
        Dp = row_diameter(X)
        mp = closest_pair(X)
        pd, pm = (Dp.i, Dp.j), (mp.i, mp.j)
        ratio = mp.value / Dp.value
        if eta != 1.0:
            X = X * eta
        diameter, min_dist = Dp.value * eta, mp.value * eta
        # exact refined values at eta = 1; otherwise one rounding per coordinate and
        # one per reported value
        err = 0.0 if eta == 1.0 else 4.0 * 2.0**-53
    else:
        m0, D0, pm, pd = _gram_extremes(X)
        # the Gram expansion's error on a squared distance is about c (n_i + n_j) (the
        # engine's a-priori bound, rows.py): relative to m0^2 it is large when the
        # closest pair is short against the norms (cancellation), so say so
        from ._certify import rounding_bound as _rounding_bound

        Xc = X - X.mean(axis=0)
        c, _ = _rounding_bound(X.shape[1], "float64")
        n_max = float(np.max(np.einsum("ij,ij->i", Xc, Xc)))
        err = c * 2.0 * n_max / (m0 * m0) if m0 > 0 else math.inf
        X = X * (eta / D0)
        min_dist, diameter = m0 * eta / D0, eta
    certificate = mode
    if mode != "engine":
        ratio = min_dist / diameter
    if callback is not None:
        callback(SpreadProgress("done", n_iter, clock.elapsed(), ratio, bound.value))
    return SpreadResult(
        points=_readonly(X),
        min_dist=float(min_dist),
        diameter=float(diameter),
        ratio=float(ratio),
        upper_bound=bound.value,
        certified=certificate != "none",
        certificate=certificate,
        error_bound=float(err),
        min_pair=tuple(int(v) for v in pm),
        diameter_pair=tuple(int(v) for v in pd),
        bound=bound,
        method=method,
        init=init_name,
        n_iter=int(n_iter),
        elapsed=clock.elapsed(),
        history=tuple(history),
    )


def _multistart(X_first, V, d, *, n_starts, rng, clock, bound, report):
    """Best of several epigraph solves: the given start, then alternating random starts
    (Gaussian clouds, and sphere points spread by an annealed soft-max of cosines)."""
    best_X, best_rho = None, -1.0
    done = 0
    for s in range(n_starts):
        if s > 0 and clock.left() <= 0:
            break
        if s == 0 and X_first is not None:
            X0 = X_first
        elif s % 2 == 1:
            X0 = _sphere_prephase(rng.standard_normal((V, d)))
        else:
            X0 = rng.standard_normal((V, d))
        X = _epigraph_solve(X0, deadline=clock.deadline)
        rho = _ratio_small(X)
        done += 1
        if rho > best_rho:
            best_X, best_rho = X, rho
        if report("start", s, best_rho) or best_rho >= bound * (1.0 - 1e-12):
            break
    return best_X, done


# =========================================================================== gradient-coupled


@dataclasses.dataclass(frozen=True, slots=True)
class SpreadUpdate:
    r"""The gradient-coupled spread step and its trade-off curve (SPEC §4, v1 form).

    Attributes
    ----------
    update : ndarray of shape (V, d)
        The chosen step S (float64, read-only): :math:`D(S) \le \eta` (certified),
        :math:`\mathbf{1}^T S = 0`, decrease at least ``target_decrease``.
    decrease : float
        :math:`-\langle G, S \rangle`.
    min_dist, diameter, ratio : float
        Certified :math:`m(S)`, :math:`D(S)` and :math:`m/D`.
    target_decrease : float
        :math:`(1 - \varepsilon)` times the exact LMO's decrease.
    eps : float
        The tolerated fraction of lost decrease.
    rownorm_decrease, rownorm_min_dist : float
        Decrease and :math:`m` of projected RowNorm (:func:`refgeo.projected_rownorm`).
    lmo_decrease, lmo_min_dist : float
        Decrease and :math:`m` of the exact LMO step (:func:`refgeo.diameter_lmo`).
    lmo_upper_bound : float
        :math:`\eta` times the certified upper bound on the tension: no step with
        :math:`D \le \eta` decreases more.
    spread_min_dist : float
        :math:`m` of the spread configuration alone (the largest possible at this
        budget, up to the solver): the other end of the curve.
    curve_t : ndarray of shape (n,)
        Interpolation parameter of each curve point (0: exact LMO, 1: aligned spread
        configuration).
    curve_decrease, curve_min_dist : ndarray of shape (n,)
        The trade-off curve: decrease and certified :math:`m` of each point, every point
        rescaled to :math:`D = \eta`.
    """

    update: np.ndarray
    decrease: float
    min_dist: float
    diameter: float
    ratio: float
    target_decrease: float
    eps: float
    rownorm_decrease: float
    rownorm_min_dist: float
    lmo_decrease: float
    lmo_min_dist: float
    lmo_upper_bound: float
    spread_min_dist: float
    curve_t: np.ndarray
    curve_decrease: np.ndarray
    curve_min_dist: np.ndarray


def _align(X: np.ndarray, G: np.ndarray, n_rounds: int = 5) -> np.ndarray:
    """Rotate (Procrustes) and re-assign the rows of X to maximise <-G, X>."""
    from scipy.optimize import linear_sum_assignment

    V = X.shape[0]
    Y = X
    best = Y
    best_val = -math.inf
    for _ in range(n_rounds):
        U, _, Wt = np.linalg.svd(Y.T @ (-G), full_matrices=False)
        Y = Y @ (U @ Wt)  # best rotation for the current assignment
        if V <= 2000:
            r, c = linear_sum_assignment(-((-G) @ Y.T))  # row i of G gets row c[i] of Y
            Y = Y[c[np.argsort(r)]]
        val = float(np.sum(-G * Y))
        if val <= best_val + 1e-12 * abs(best_val):
            break
        best, best_val = Y, val
    return best


def _scaled_step(S: np.ndarray, eta: float):
    """Centre S and scale it to a certified diameter eta; return (S, D, m)."""
    from .rows import closest_pair, row_diameter

    S = S - S.mean(axis=0)
    D = row_diameter(S).value
    if D == 0.0:
        return S, 0.0, 0.0
    S = S * (eta / D)
    return S, row_diameter(S).value, closest_pair(S).value


def spread_update(
    G: Any,
    /,
    *,
    eta: float = 1.0,
    eps: float = 0.05,
    n_points: int = 9,
    seed: int | None = None,
    n_starts: int = 4,
    lmo_rtol: float = 1e-4,
    max_time: float | None = None,
) -> SpreadUpdate:
    r"""Gradient-coupled max-min step: keep most of the best decrease, spread the rows.

    Parameters
    ----------
    G : array_like of shape (V, d)
        Gradient of the head weight (centred internally: :math:`\mathbf{1}^T S = 0`
        makes the mean row irrelevant).
    eta : float, default=1.0
        Diameter budget.
    eps : float, default=0.05
        Fraction of the exact LMO's decrease that may be given up, ``0 <= eps <= 1``.
    n_points : int, default=9
        Points of the trade-off curve (``>= 2``).
    seed : int, default=None
        Seed of :func:`spread` (small V).
    n_starts : int, default=4
        Local solves of :func:`spread` (small V).
    lmo_rtol : float, default=1e-4
        ``rtol`` of :func:`refgeo.diameter_lmo`.
    max_time : float, default=None
        Time budget of the inner :func:`spread` call.

    Returns
    -------
    step : SpreadUpdate
        The update, its certified :math:`m`, :math:`D`, decrease, the RowNorm and
        exact-LMO reference points and the trade-off curve.

    Notes
    -----
    .. math:: \max_S \; m(S) \quad \text{s.t.} \quad D(S) \le \eta,\;
              \mathbf{1}^T S = 0,\; -\langle G, S \rangle \ge (1 - \varepsilon)\,
              \eta\,\underline{T}(G)

    with :math:`\eta\,\underline{T}(G)` the decrease of the exact LMO step
    :math:`S_*` (certified within ``lmo_rtol`` of optimal).  The curve joins
    :math:`S_*` (largest decrease, :math:`m` often 0: tied rows) to the spread
    configuration :math:`X` of :func:`spread` (largest :math:`m`), rotated by
    Procrustes and re-assigned to the rows of :math:`-G` (Hungarian algorithm for
    :math:`V \le 2000`) to maximise its own decrease: :math:`S_t \propto (1-t) S_* + t X`,
    each point centred and rescaled to :math:`D = \eta`.  The step is the curve point of
    largest :math:`m` meeting the decrease constraint (:math:`S_*` itself when no other
    does).  Time: one LMO solve, one spread solve, :math:`2 n` certified extreme-pair
    computations (:math:`O(V^2 d)` each).  Equivariant under row permutations and
    orthogonal maps of ``G`` (up to the solver's tie breaking).

    References
    ----------
    .. [1] LM-head update geometry, arXiv:2608.22253 (v1: the max-min update; v2:
       the exact LMO and RowNorm).

    Examples
    --------
    >>> import numpy as np, refgeo
    >>> G = np.array([[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0], [0.0, -1.0]])
    >>> st = refgeo.spread_update(G, eta=2.0, eps=0.0, seed=0)
    >>> round(st.decrease, 9), round(st.lmo_decrease, 9), round(st.ratio, 9)
    (4.0, 4.0, 0.707106781)
    """
    from .lmo import diameter_lmo, projected_rownorm
    from .rows import closest_pair

    G = as_float_array(G, "G", ndim=2, shape_hint="2-D array of shape (V, d)")
    G = np.array(G, dtype=np.float64)
    check_min_rows(G, "G", 2)
    V, d = G.shape
    eta = check_real(eta, "eta", min_value=0.0, strict=True)
    eps = check_real(eps, "eps", min_value=0.0)
    if eps > 1.0:
        raise ValueError(f"eps == {eps}, must be <= 1.")
    n_points = check_int(n_points, "n_points", min_value=2)
    lmo_rtol = check_open_unit_interval(lmo_rtol, "lmo_rtol")
    Gc = G - G.mean(axis=0)

    rn = np.asarray(projected_rownorm(Gc, eta=eta), dtype=np.float64)
    rn_dec = float(-np.sum(Gc * rn))
    rn_m = closest_pair(rn).value
    lmo = diameter_lmo(Gc, eta=eta, rtol=lmo_rtol)
    S_star = np.asarray(lmo.update, dtype=np.float64)
    lmo_dec = float(lmo.decrease)
    lmo_m = closest_pair(S_star).value
    target = (1.0 - eps) * lmo_dec

    X = np.array(spread(V, d, eta=eta, seed=seed, n_starts=n_starts, max_time=max_time, certify=False).points)
    if np.any(Gc):
        X = _align(X, Gc)

    ts = np.linspace(0.0, 1.0, n_points)
    steps, decs, ms, Ds = [], [], [], []
    for t in ts:
        S, D, m = _scaled_step((1.0 - t) * S_star + t * X, eta)
        if D == 0.0:  # pragma: no cover - only if S_* and X cancel exactly
            S, D, m = S_star, _row_diameter_value(S_star), lmo_m
        steps.append(S)
        decs.append(float(-np.sum(Gc * S)))
        ms.append(m)
        Ds.append(D)
    ok = [i for i in range(n_points) if decs[i] >= target]
    if ok:
        pick = max(ok, key=lambda i: (ms[i], decs[i]))
        S, dec, m, D = steps[pick], decs[pick], ms[pick], Ds[pick]
    else:  # pragma: no cover - t = 0 is S_* rescaled up to D = eta, so it always qualifies
        S, dec, m, D = S_star, lmo_dec, lmo_m, _row_diameter_value(S_star)
    S = np.array(S)
    return SpreadUpdate(
        update=_readonly(S),
        decrease=dec,
        min_dist=m,
        diameter=D,
        ratio=m / D if D > 0 else 0.0,
        target_decrease=target,
        eps=eps,
        rownorm_decrease=rn_dec,
        rownorm_min_dist=rn_m,
        lmo_decrease=lmo_dec,
        lmo_min_dist=lmo_m,
        lmo_upper_bound=eta * float(lmo.upper_bound),
        spread_min_dist=ms[-1],
        curve_t=_readonly(ts),
        curve_decrease=_readonly(np.array(decs)),
        curve_min_dist=_readonly(np.array(ms)),
    )


def _row_diameter_value(S: np.ndarray) -> float:
    from .rows import row_diameter

    return row_diameter(S).value


# ``refgeo/__init__.py`` star-imports this module and then reads ``spread.__all__``,
# where ``spread`` is by then this function (it shadows the module of the same name):
# give the function the module's export list so both spellings work.
spread.__all__ = __all__  # type: ignore[attr-defined]
