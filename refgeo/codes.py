r"""Spherical codes and lattice packings: the constructions behind max-min spreading.

Configurations of ``V`` points in :math:`\mathbb{R}^d` whose distance ratio
:math:`\rho = m/D` (closest pair over diameter) is known in closed form, or certified
by the engine (see :doc:`/theory/spreading`).  :func:`refgeo.spread` starts from the
best of them for each ``(V, d)``; the solver itself lives in :mod:`refgeo.spreading`.

.. autosummary::

   regular_simplex
   orthogonal_simplices
   cross_polytope
   kerdock_code
   delsarte_goethals_code
   embed

The algebra: GF(2^m) arithmetic and the trace (the Kerdock and Delsarte-Goethals sets
of quadratic forms), the fast Walsh-Hadamard transform (one orthonormal basis per
form), and lattice balls (the lattice points nearest to a center) for small ``d``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ._validate import as_float_array, check_int

__all__ = [
    "cross_polytope",
    "delsarte_goethals_code",
    "embed",
    "kerdock_code",
    "orthogonal_simplices",
    "regular_simplex",
]


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
        :math:`i \ne j`, centered (:math:`\sum_i x_i = 0`), supported on the first
        ``V - 1`` coordinates.

    Notes
    -----
    .. math:: \lVert x_i - x_j \rVert^2 = \frac{2V}{V - 1}, \qquad \rho = 1

    The rows are :math:`e_i - \mathbf{1}/V` written in the Helmert basis of
    :math:`\mathbf{1}^\perp` and normalized.  The optimum of max-min spreading for
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
        the other :math:`b = d - a`, centered at the origin, with radii chosen so that
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
    """Unnormalized fast Walsh-Hadamard transform along ``axis`` (length a power of 2)."""
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

    the polarization of :math:`Q(ux) + a\,\mathrm{Tr}(ux)` with
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
    U = np.triu(B, 1)  # Q(z) = sum_{i<j} B_ij z_i z_j has polarization B
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
    rho^2 = sqrt(q)/(sqrt(q) + 2) (coherence 1/(sqrt(q) + 1) after normalization).
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
# of a dense lattice nearest to a center give ratio about V^(-1/d).
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
    """The V lattice points nearest to the best of a few centers, with their ratio."""
    from .rows import row_diameter

    # smallest box whose inscribed ball (radius m - 1/2, any center) holds about 1.5 V
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
    centers = [np.zeros(d), np.full(d, 0.5)]
    if d > 1 and V <= 5000:
        centers += [rng.uniform(-0.5, 0.5, d) for _ in range(4)]
    best = None
    for c in centers:
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
        # generalizes orthogonal_simplices (V = d + 2, two blocks) to V - d blocks
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
