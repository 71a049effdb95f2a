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
   quadratic_trace_code
   minimal_vectors
   lattice_ball
   embed

The algebra: GF(2^m) arithmetic and the trace (the Kerdock and Delsarte-Goethals sets
of quadratic forms), the fast Walsh-Hadamard transform (one orthonormal basis per
form), and lattice balls (the lattice points nearest to a center) for small ``d``.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import re
from collections.abc import Callable
from typing import Any

import numpy as np

from . import _memory
from ._interop import from_foreign, to_caller
from ._validate import as_float_array, check_int

__all__ = [
    "cross_polytope",
    "delsarte_goethals_code",
    "embed",
    "kerdock_code",
    "lattice_ball",
    "minimal_vectors",
    "orthogonal_simplices",
    "quadratic_trace_code",
    "regular_simplex",
]


# =========================================================================== constructions


def _check_size(what: str, V: int, d: int, work: float = 0.0,
                advice: str = "Ask for fewer rows V or a smaller d.") -> None:
    """``MemoryError`` naming the call when the (V, d) float64 result (and ``work`` bytes
    of temporaries) cannot fit, before NumPy's own allocation error from inside."""
    _memory.check_memory(what, {f"result ({V} x {d} float64)": 8.0 * V * d, "working memory": work}, advice)


def regular_simplex(V: int, d: int, /) -> np.ndarray:
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
    _check_size(f"regular_simplex({V}, {d})", V, d)
    X = np.zeros((V, d))
    for k in range(1, V):  # Helmert row k: k ones then -k, over sqrt(k (k + 1))
        c = 1.0 / math.sqrt(k * (k + 1.0))
        X[:k, k - 1] = c
        X[k, k - 1] = -k * c
    X /= math.sqrt(1.0 - 1.0 / V)
    return X


def orthogonal_simplices(d: int, /) -> np.ndarray:
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
    _check_size(f"orthogonal_simplices({d})", d + 2, d, 8.0 * (d // 2 + 2) * (d - d // 2 + 1), "Ask for a smaller d.")
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


def cross_polytope(d: int, /) -> np.ndarray:
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
    _check_size(f"cross_polytope({d})", 2 * d, d, advice="Ask for a smaller d.")
    X = np.zeros((2 * d, d))
    idx = np.arange(d)
    X[2 * idx, idx] = 1.0
    X[2 * idx + 1, idx] = -1.0
    return X


def embed(X: Any, /, *, d: int) -> np.ndarray:
    r"""Zero-pad the rows of ``X`` into a larger dimension ``d``.

    Parameters
    ----------
    X : array_like or tensor of shape (V, d0)
        A configuration.
    d : int
        Target dimension, ``d >= d0``.

    Returns
    -------
    Y : ndarray of shape (V, d)
        float64 ``[X, 0]``: every distance and inner product is unchanged, so
        :math:`\rho(Y) = \rho(X)`.  A float64 tensor on ``X``'s device when ``X`` is
        a tensor.

    Examples
    --------
    >>> import refgeo
    >>> refgeo.embed([[1.0], [-1.0]], d=3).tolist()
    [[1.0, 0.0, 0.0], [-1.0, 0.0, 0.0]]
    """
    # tensors go through the common converter: autograd and bfloat16 tensors are
    # viewed as their values, integer/bool/complex tensors are a TypeError naming X
    X, origin = from_foreign(X, "X", host=True)
    X = as_float_array(X, "X", ndim=2, shape_hint="2-D array of shape (V, d0)")
    d = check_int(d, "d", min_value=int(X.shape[1]))
    _check_size(f"embed(X of shape {tuple(X.shape)}, d={d})", int(X.shape[0]), d, advice="Ask for a smaller d.")
    Y = np.zeros((X.shape[0], d))
    Y[:, : X.shape[1]] = np.asarray(X, dtype=np.float64)
    return to_caller(Y, origin)


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


def _check_power_of_4(d: int) -> tuple[int, int]:
    """``(d, log2(d))`` with ``d`` a Python int (a NumPy integer ``d`` overflowed in the
    row counts: ``np.int16(64)`` gave 64 rows for the 65,600 of the full code)."""
    d = check_int(d, "d", min_value=4)
    n = d.bit_length() - 1
    if d != 1 << n or n % 2:
        raise ValueError(f"d must be a power of 4 (4, 16, 64, 256, ...), got {d} instead.")
    return d, n


def _n_bases(V: int, d: int) -> int:
    """Hadamard bases after the standard basis that the first V rows reach."""
    return -(-(V - d) // d) if V > d else 0


def _check_code_size(what: str, V: int, d: int) -> None:
    """:func:`_check_size` of a quadratic code: the rows, and one basis at a time (diag(s),
    its transform and the scaled copy, d x d each).  Called before the forms' indices are
    formed: with the default V (all rows) they number about d/2, and NumPy's own error
    came first ("Maximum allowed size exceeded" at d = 4**40)."""
    _check_size(what, V, d, 32.0 * d * d if _n_bases(V, d) else 0.0)


def _quadratic_code(d: int, V: int, n: int, us: np.ndarray, ws: np.ndarray | None) -> np.ndarray:
    """Standard basis, then one Hadamard basis H diag((-1)^{Q}) per form (first V rows;
    ``us`` and ``ws`` hold at least the forms these rows reach; the size is checked by
    the caller, :func:`_check_code_size`)."""
    n_bases = _n_bases(V, d)
    X = np.zeros((V, d))
    k = min(V, d)
    X[np.arange(k), np.arange(k)] = 1.0
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


def delsarte_goethals_code(d: int, V: int | None = None, /) -> np.ndarray:
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
    Time O(V d log d), memory O(V d + d^2); entries exactly :math:`0, 1, \pm 2^{-n/2}`.

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
    d, n = _check_power_of_4(d)
    if n < 4:
        raise ValueError(f"d must be a power of 4 that is at least 16, got {d} instead.")
    half = d // 2
    total = d + d * half * half
    V = total if V is None else check_int(V, "V", min_value=1, max_value=total)
    _check_code_size(f"delsarte_goethals_code({d}, {V})", V, d)
    # only the forms the first V rows reach (all d^2/4 of them were built for any V)
    idx = np.arange(_n_bases(V, d), dtype=np.int64)
    # every index below half (always for d >= 2^63, where half is no int64 and the
    # size check below refuses the rows): w = 0, u = idx, without NumPy's divmod
    w, u = np.divmod(idx, half) if idx.size > half else (np.zeros_like(idx), idx)
    return _quadratic_code(d, V, n, u, w)


def kerdock_code(d: int, V: int | None = None, /) -> np.ndarray:
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

    within 0.5% of :func:`refgeo.welch_bound` for :math:`d \ge 64` once
    :math:`V \ge d^2/4` (e.g. :math:`(50000, 1024)`: 0.96922 against 0.96955; at the
    full code 0.29% below it for d = 64 and 0.04% for d = 256, but 2.2% for d = 16 and
    16% for d = 4, and further below for small V: the bound grows to 1 as V falls to
    d + 1).  The quadratic forms come from the trace construction over
    :math:`GF(2^{n-1})` (see ``_kerdock_forms``); each basis is
    :math:`H \operatorname{diag}(s_u)` built with a fast Walsh-Hadamard transform of a
    d x d matrix.  Time O(V d log d), memory O(V d + d^2).  Exact: every inner product
    is computed without rounding in float64.

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
    d, n = _check_power_of_4(d)
    total = d * (d // 2 + 1)
    V = total if V is None else check_int(V, "V", min_value=1, max_value=total)
    _check_code_size(f"kerdock_code({d}, {V})", V, d)
    us = np.arange(_n_bases(V, d), dtype=np.int64)  # the forms the first V rows reach
    return _quadratic_code(d, V, n, us, None)


# --------------------------------------------------------------------------- p-ary trace codes


def _prime_factors(n: int) -> list[int]:
    out, q = [], 2
    while q * q <= n:
        if n % q == 0:
            out.append(q)
            while n % q == 0:
                n //= q
        q += 1
    return out + ([n] if n > 1 else [])


def _poly_mulmod(a: list[int], b: list[int], tail: tuple[int, ...], p: int) -> list[int]:
    """a b modulo f = x^m + sum_k tail[k] x^k over F_p (coefficient lists of length m)."""
    m = len(tail)
    prod = [0] * (2 * m - 1)
    for i, ai in enumerate(a):
        if ai:
            for j, bj in enumerate(b):
                prod[i + j] += ai * bj
    for top in range(2 * m - 2, m - 1, -1):  # x^top = -x^(top-m) sum_k tail[k] x^k
        c = prod[top] % p
        if c:
            for k in range(m):
                prod[top - m + k] -= c * tail[k]
    return [c % p for c in prod[:m]]


def _x_power(e: int, tail: tuple[int, ...], p: int) -> list[int]:
    """x^e modulo f, by repeated squaring."""
    m = len(tail)
    r, b = [1] + [0] * (m - 1), [0, 1] + [0] * (m - 2)
    while e:
        if e & 1:
            r = _poly_mulmod(r, b, tail, p)
        b = _poly_mulmod(b, b, tail, p)
        e >>= 1
    return r


def _primitive_tail(p: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """GF(p^m) = F_p[x]/(f) for the first primitive monic f of degree m (tails in
    lexicographic order), as the table of the powers of x: ``exp[i]`` is the element
    x^i written as the integer sum_k c_k p^k (i = 0 .. p^m - 2), ``log`` its inverse
    (``log[0] = 0``, unused).

    f is primitive when x has order p^m - 1 modulo f: x^(p^m - 1) = 1 and
    x^((p^m - 1)/q) != 1 for every prime q dividing p^m - 1 (a reducible f leaves
    zero divisors, fewer than p^m - 1 units, so no element of that order).  Only tails
    with (-1)^m f(0), the norm of the root, a primitive root modulo p are tried (the
    norm of a primitive element is one): a plain walk over the tails took 48 s for
    p = 31, m = 3.
    """
    N = p**m
    qs = _prime_factors(N - 1)
    qp = _prime_factors(p - 1)
    roots = {g for g in range(1, p) if all(pow(g, (p - 1) // q, p) != 1 for q in qp)}
    one = [1] + [0] * (m - 1)
    for tail in itertools.product(range(p), repeat=m):  # f = x^m + sum_k tail[k] x^k
        if ((-1) ** m * tail[0]) % p not in roots:
            continue
        tail = tuple(tail)
        if _x_power(N - 1, tail, p) == one and all(_x_power((N - 1) // q, tail, p) != one for q in qs):
            break
    else:
        raise AssertionError("unreachable: every finite field has a primitive polynomial")
    weights = p ** np.arange(m, dtype=np.int64)
    exp = np.empty(N - 1, dtype=np.int64)
    v = one
    for i in range(N - 1):
        exp[i] = int(np.dot(v, weights))
        top = v[-1]  # x * v, then x^m = -sum_k tail[k] x^k
        v = [(-top * tail[0]) % p] + [(v[k - 1] - top * tail[k]) % p for k in range(1, m)]
    log = np.zeros(N, dtype=np.int64)
    log[exp] = np.arange(N - 1)
    return exp, log


class _OddField:
    """GF(p^m), p an odd prime: products through the powers of a primitive element
    and the trace Tr(y) = y + y^p + ... + y^(p^(m-1)) to F_p, elements as integers."""

    def __init__(self, p: int, m: int):
        self.p, self.m, self.N = p, m, p**m
        self.exp, self.log = _primitive_tail(p, m)
        # The trace is F_p-linear: Tr(y) = sum_k c_k Tr(x^k) for y = sum_k c_k x^k, and
        # Tr(x^k) = sum_j x^(k p^j), the conjugates added coefficientwise modulo p (it
        # lies in F_p: coefficient 0 alone).  O(N) memory: the conjugates of every
        # element at once took (N, m, m) int64 arrays (24 GiB at p = 3, m = 15).
        basis = np.zeros(m, dtype=np.int64)
        for k in range(m):
            acc = [0] * m
            for j in range(m):
                e = self.exp[(k * pow(p, j, self.N - 1)) % (self.N - 1)]
                acc = [(acc[t] + (int(e) // p**t) % p) % p for t in range(m)]
            assert not any(acc[1:])
            basis[k] = acc[0]
        tr = np.zeros(self.N - 1, dtype=np.int64)
        y = self.exp.copy()
        for k in range(m):
            tr += (y % p) * basis[k]
            y //= p
        self.trace_of_power = tr % p  # Tr(x^i)

    def trace_products(self, a: np.ndarray, z: np.ndarray) -> np.ndarray:
        """Tr(a z) for every a (rows) and z (columns), int64 in [0, p)."""
        a = np.asarray(a, dtype=np.int64)[:, None]
        z = np.asarray(z, dtype=np.int64)[None, :]
        t = self.trace_of_power[(self.log[a] + self.log[z]) % (self.N - 1)]
        return np.where((a == 0) | (z == 0), 0, t)

    def squares(self) -> np.ndarray:
        """x^2 for every element x."""
        x = np.arange(self.N, dtype=np.int64)
        return np.where(x == 0, 0, self.exp[(2 * self.log[x]) % (self.N - 1)])


def _trace_code_weights(p: int, m: int) -> tuple[int, int]:
    """(W, e): the Hamming distances of :func:`quadratic_trace_code` are W inside a class
    and W - e, W, W + e across classes; W = (p - 1) p^(m-1), e = p^((m-1)/2)."""
    return (p - 1) * p ** (m - 1), p ** ((m - 1) // 2)


def _is_odd_prime(p: int) -> bool:
    return p % 2 == 1 and p > 2 and all(p % r for r in range(3, math.isqrt(p) + 1, 2))


def _check_trace_code_args(p: int, m: int, V: int | None) -> tuple[int, int, int, int]:
    """(p, m, V, d), checked; p^m is not formed where it has more than 62 bits
    (3**(10**9) alone takes minutes), which also bounds the primality test."""
    p = check_int(p, "p", min_value=3)
    m = check_int(m, "m", min_value=3)
    if p % 2 == 0:
        raise ValueError(f"p must be an odd prime (3, 5, 7, 11, ...), got {p} instead.")
    if m % 2 == 0:
        raise ValueError(f"m must be odd (3, 5, 7, ...), got {m} instead.")
    what = f"quadratic_trace_code({p}, {m}{'' if V is None else f', {V}'})"
    if m * math.log2(p) > 62:
        raise MemoryError(f"{what} has (p - 1) * p**m > 2**62 coordinates per row. Ask for a smaller p or m.")
    if not _is_odd_prime(p):  # p < 2**21 here: at most 724 trial divisions
        raise ValueError(f"p must be an odd prime (3, 5, 7, 11, ...), got {p} instead.")
    N = p**m
    V = N * N if V is None else check_int(V, "V", min_value=1, max_value=N * N)
    d = (p - 1) * N
    _check_size(what, V, d, _trace_code_work(p, m, V, d), "Ask for fewer rows V or a smaller p or m.")
    return p, m, V, d


def _trace_code_work(p: int, m: int, V: int, d: int) -> float:
    """Bytes of temporaries of :func:`_trace_code_rows` beside its result: the field's
    int64 tables (powers, logarithms, traces and two temporaries, N each), the trace
    products (three arrays of one class's size) and one class's rows."""
    N = p**m
    return 48.0 * N + 8.0 * min(V, N) * (3 * N + d) + 24.0 * -(-V // N) * N


def _trace_code_parts(p: int, m: int) -> tuple[np.ndarray, float]:
    """The float64 entries every row is made of: the simplex vertices over sqrt(p^m)
    (symbol s -> row s, unit rows) and the tag t.  A cross-class pair moves apart by
    t^2 + t^2 = 2 t^2, e Hamming units of 2p/((p - 1) p^m) each: the closest cross pair
    (W - e) then meets the classes' W."""
    N = p**m
    _, e = _trace_code_weights(p, m)
    return regular_simplex(p, p - 1) / math.sqrt(N), math.sqrt(p * e / ((p - 1.0) * N))


@functools.lru_cache(maxsize=None)  # _candidates asks for it at every spread call
def _trace_code_closed_form(p: int, m: int, tags: bool) -> tuple[float, float, float]:
    """(rho, D, build error) of the code's rows, plain or tagged: the closed forms, and
    a bound on the relative error of the *built* rows' distances against them.

    Every built row is a concatenation of the float64 vertices and tag of
    :func:`_trace_code_parts` (copied, never recomputed), so each of its squared
    distances is a sum of squared distances between float vertices, and 2 t^2 across
    classes: within the relative error r of the worst of those terms against their
    exact values 2p/((p - 1) p^m) and e times it, computed here exactly (Fractions of
    the floats).  A distance then errs by at most r/2 < r.
    """
    from fractions import Fraction

    N = p**m
    W, e = _trace_code_weights(p, m)
    vertex, t = _trace_code_parts(p, m)
    unit = Fraction(2 * p, (p - 1) * N)  # exact squared distance of two symbols
    r = Fraction(0)
    for i in range(p):
        for j in range(i + 1, p):
            sq = sum((Fraction(float(a)) - Fraction(float(b))) ** 2 for a, b in zip(vertex[i], vertex[j]))
            r = max(r, abs(sq / unit - 1))
    if tags:
        r = max(r, abs(2 * Fraction(t) ** 2 / (e * unit) - 1))
    lo, hi = (W, W + 2 * e) if tags else (W - e, W + e)
    # the float's rounding of r itself, outward
    return math.sqrt(lo / hi), math.sqrt(float(unit) * hi), float(r) * (1.0 + 2.0**-50)


def _trace_code_rows(p: int, m: int, V: int, d: int, tags: bool) -> np.ndarray:
    """The first V rows of the code (see :func:`quadratic_trace_code`) in the first
    (p - 1) p^m coordinates of R^d, with one tag coordinate per class after them when
    ``tags`` (the size is checked by the caller)."""
    F = _OddField(p, m)
    N = F.N
    n_classes = -(-V // N)
    vertex, t = _trace_code_parts(p, m)
    lin = F.trace_products(np.arange(min(V, N)), np.arange(N))  # Tr(b x), (b, x)
    quad = F.trace_products(np.arange(n_classes), F.squares())  # Tr(a x^2), (a, x)
    X = np.zeros((V, d))
    for a in range(n_classes):
        lo, hi = a * N, min(V, (a + 1) * N)
        sym = (quad[a][None, :] + lin[: hi - lo]) % p
        X[lo:hi, : (p - 1) * N] = vertex[sym].reshape(hi - lo, (p - 1) * N)
        if tags:
            X[lo:hi, (p - 1) * N + a] = t
    return X


def quadratic_trace_code(p: int, m: int, V: int | None = None, /) -> np.ndarray:
    r"""The quadratic trace code of :math:`GF(p^m)`, symbols on a simplex: up to
    :math:`p^{2m}` unit rows of :math:`\mathbb{R}^{(p-1)p^m}` at three distances.

    Parameters
    ----------
    p : int
        An odd prime (3, 5, 7, ...).
    m : int
        An odd integer, at least 3.
    V : int, default=None
        Number of rows, ``1 <= V <= p**(2*m)``; ``None`` returns all of them.

    Returns
    -------
    X : ndarray of shape (V, (p - 1) * p**m)
        float64 unit rows, one per function :math:`f_{a,b}(x) = \mathrm{Tr}(a x^2 + b x)`
        (:math:`a, b \in GF(p^m)`, Tr the trace to :math:`F_p`): coordinate block
        :math:`x` (of :math:`p^m`, :math:`p - 1` coordinates each) holds vertex
        :math:`f_{a,b}(x)` of a regular simplex of :math:`p` points, over
        :math:`\sqrt{p^m}`.  Row :math:`r` is :math:`a = \lfloor r / p^m \rfloor`,
        :math:`b = r \bmod p^m` (field elements numbered by their coefficients); the rows
        of one :math:`a` form a *class*.

    Notes
    -----
    Distinct simplex vertices are at squared distance :math:`2p/(p-1)`, so
    :math:`\lVert x_{a,b} - x_{a',b'} \rVert^2 = \frac{2p}{(p-1)p^m}\, h`, with
    :math:`h` the number of :math:`x` where the two functions differ: the weight of
    :math:`f_{a-a',b-b'}` (the code is linear over :math:`F_p`).  Inside a class it is
    a nonzero linear function, :math:`h = W = (p-1)p^{m-1}`; across classes
    :math:`Q(x) = \mathrm{Tr}((a-a') x^2)` is a nondegenerate quadratic form in an
    odd number :math:`m` of variables, and completing the square leaves
    :math:`Q(y) = c` with :math:`p^{m-1}` or :math:`p^{m-1} \pm p^{(m-1)/2}` solutions,
    so :math:`h \in \{W - e, W, W + e\}`, :math:`e = p^{(m-1)/2}`, all three taken once
    two classes are present (:math:`V > p^m`), and

    .. math:: \rho^2 = \frac{W - e}{W + e}
              = \frac{(p-1)\sqrt{p^{m-1}} - 1}{(p-1)\sqrt{p^{m-1}} + 1}.

    :math:`p = 3, m = 5`: 59,049 rows in :math:`\mathbb{R}^{486}` with
    :math:`\rho^2 = 17/19` (:math:`\rho = 0.9459`, against 0.9428 for the tagged
    Kerdock code of :math:`\mathbb{R}^{256}`, whose binary quadratic forms stop at
    coherence 1/16); :math:`p = 5, m = 3`: 15,625 rows in :math:`\mathbb{R}^{500}`,
    :math:`\rho^2 = 19/21`.  :func:`refgeo.spread` also offers it with one tag
    coordinate per class (where :math:`(p-1)p^m + \lceil V/p^m \rceil \le d`), which
    adds :math:`e` to every cross-class distance: :math:`\rho^2 = W/(W + 2e)`
    (0.9 for :math:`p = 3, m = 5`: :math:`\rho = 0.9487` at :math:`(50257, 768)`).
    The entries are not dyadic, but every row is made of the same p float64 vertices
    (and tag), whose squared distances :func:`refgeo.spread` computes exactly: they
    bound the rows' distances against the closed forms (a few ulps), its algebraic
    certificate where the engine's would be expensive.  Time and memory O(V (p - 1) p^m)
    for the rows, O(p^m) for the field's tables (a Python loop over its elements:
    seconds from p^m = 10^6 on) and O(min(V, p^m) p^m) for the traces of one class.

    References
    ----------
    .. [1] R. Lidl, H. Niederreiter, Finite Fields, Theorem 6.26-6.27 (the number of
       solutions of a nondegenerate quadratic equation), Cambridge University Press
       (1997).

    Examples
    --------
    >>> import numpy as np, refgeo
    >>> from scipy.spatial.distance import pdist
    >>> X = refgeo.quadratic_trace_code(3, 3)
    >>> X.shape
    (729, 54)
    >>> h = np.unique((pdist(X, "sqeuclidean") * 27 * 2 / 6).round(9))
    >>> h.tolist()  # the Hamming distances W - e, W, W + e
    [15.0, 18.0, 21.0]
    """
    p, m, V, d = _check_trace_code_args(p, m, V)
    return _trace_code_rows(p, m, V, d, False)


# =========================================================================== candidates


@dataclasses.dataclass(frozen=True)
class _Candidate:
    """A construction for (V, d) with its exact ratio (known in closed form)."""

    name: str
    rho: float
    build: Callable[[], np.ndarray]
    # D of build() in closed form where its distances are known so (exactly for dyadic
    # entries, within build_error otherwise): the algebraic certificate uses it
    diameter: float | None = None
    on_sphere: bool = True  # False for packings in a ball (the sphere iteration cannot improve them)
    # relative error of build()'s distances against the closed forms (rho, diameter):
    # 0 for exact (dyadic) entries; the algebraic certificate adds it
    build_error: float = 0.0
    # False: returned as is by spread(method="auto") (see there): ball packings, shell
    # subsets and the algebraic codes, which no tangent direction improves to first order
    iterate: bool = True


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


# --------------------------------------------------------------------------- lattices
#
# In small dimension the best configurations are packings in a ball, not points on a
# sphere (every sphere-based construction has ratio O(V^(-1/(d-1)))): the V points of
# a dense lattice nearest to a well-chosen center give ratio about V^(-1/d).  Below
# the kissing number, subsets of the minimal vectors (one shell of the theta series)
# do better: their inner products take a few values, so the diameter is set by the
# most negative inner product kept.  Every point set is enumerated shell by shell
# (coordinate by coordinate with the partial norm bounded), never from a full box.

# Lattice balls are offered for any V up to the enumeration's limit (2^20 lattice
# points enumerated: about 4e5 points for the D3 ball): the sphere iteration from
# random points is no alternative there (ratio 0 at (20001, 1), where every point of
# the 0-sphere is +-1, 3e-8 against 0.0067 at (20001, 2), and 4e-5 against 0.033 at
# (20001, 3) when d >= 3 stopped at 20,000 points).  Large balls cost seconds (11.7 s
# for the E8 ball of 200,000 points), as their certification does.
_LATTICE_MAX_POINTS = 1 << 20  # lattice points enumerated at most for one ball
_LATTICE_MAX_CENTER = 2.0**24  # largest |center| entry of a lattice ball


def _coset_ball(center: np.ndarray, r2: float, offset: np.ndarray, step: np.ndarray) -> np.ndarray:
    """Points x of the coset ``offset + step * Z^n`` with ``|x - center|^2 <= r2``.

    Breadth first over the coordinates: a prefix survives while its partial squared
    distance is at most ``r2`` (the Fincke-Pohst bound for an orthogonal basis), so the
    work is proportional to the points of the projected balls, not to a box.
    """
    n = center.shape[0]
    P = np.zeros((1, 0))
    part = np.zeros(1)
    for k in range(n):
        s = np.sqrt(np.maximum(r2 - part, 0.0))
        lo = np.ceil((center[k] - s - offset[k]) / step[k] - 1e-9).astype(np.int64)
        hi = np.floor((center[k] + s - offset[k]) / step[k] + 1e-9).astype(np.int64)
        cnt = np.maximum(hi - lo + 1, 0)
        total = int(cnt.sum())
        if total > _LATTICE_MAX_POINTS:
            raise _TooManyPoints
        idx = np.repeat(np.arange(P.shape[0]), cnt)
        first = np.repeat(np.cumsum(cnt) - cnt, cnt)
        v = offset[k] + step[k] * (lo[idx] + (np.arange(total) - first))
        part = part[idx] + (v - center[k]) ** 2
        keep = part <= r2 * (1.0 + 1e-12)
        P = np.column_stack([P[idx][keep], v[keep]])
        part = part[keep]
    return P


class _TooManyPoints(Exception):
    """A ball would hold more than ``_LATTICE_MAX_POINTS`` points."""


def _rm14() -> np.ndarray:
    """The 32 words of the first-order Reed-Muller code RM(1, 4) (length 16, 0/1)."""
    z = (np.arange(16)[:, None] >> np.arange(4)[None, :]) & 1
    words = [(a0 + z @ np.array(a)) % 2 for a0 in (0, 1) for a in itertools.product((0, 1), repeat=4)]
    return np.array(words, dtype=np.int64)


def _golay() -> np.ndarray:
    """The 4096 words of the extended binary Golay code (length 24, 0/1).

    The cyclic quadratic-residue code of length 23 with generator polynomial
    :math:`x^{11} + x^{10} + x^6 + x^5 + x^4 + x^2 + 1`, extended by a parity bit
    (weights 0, 8, 12, 16, 24: checked in the tests).
    """
    g = np.zeros(23, dtype=np.int64)
    g[[0, 2, 4, 5, 6, 10, 11]] = 1
    G = np.array([np.roll(g, s) for s in range(12)])
    msg = (np.arange(4096)[:, None] >> np.arange(12)[None, :]) & 1
    C = (msg @ G) % 2
    return np.column_stack([C, C.sum(axis=1) % 2])


def _sign_patterns(n: int, even: bool) -> np.ndarray:
    """All +-1 vectors of length n (with an even number of -1 when ``even``)."""
    s = 1 - 2 * ((np.arange(1 << n)[:, None] >> np.arange(n)[None, :]) & 1)
    return s[(s < 0).sum(axis=1) % 2 == 0] if even else s


def _pairs_pm(n: int, value: float) -> np.ndarray:
    """The 4 C(n, 2) vectors with two entries +-value and zeros elsewhere."""
    i, j = np.triu_indices(n, 1)
    out = np.zeros((4 * i.shape[0], n))
    for k, (a, b) in enumerate(itertools.product((value, -value), repeat=2)):
        out[k * i.shape[0] + np.arange(i.shape[0]), i] = a
        out[k * i.shape[0] + np.arange(i.shape[0]), j] = b
    return out


@functools.lru_cache(maxsize=None)
def _e8_min() -> np.ndarray:
    half = 0.5 * _sign_patterns(8, even=True).astype(np.float64)
    return _frozen(np.vstack([_pairs_pm(8, 1.0), half]))


def _frozen(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)  # cached: callers get copies
    return a


def _section(P: np.ndarray, k: int) -> np.ndarray:
    """Points of E8 with x_1 = ... = x_k, in orthonormal coordinates of that subspace."""
    P = P[np.all(P[:, 1:k] == P[:, :1], axis=1)]
    return np.column_stack([math.sqrt(k) * P[:, 0], P[:, k:]])


@functools.lru_cache(maxsize=None)
def _bw16_min() -> np.ndarray:
    """Minimal vectors of the Barnes-Wall lattice: x in Z^16, x mod 2 in RM(1, 4),
    sum(x) = 0 mod 4, over sqrt(2) (norm 4)."""
    W = _rm14()
    octs = W[W.sum(axis=1) == 8]
    s = _sign_patterns(8, even=True)
    rows = [_pairs_pm(16, 2.0)]
    for w in octs:
        Y = np.zeros((s.shape[0], 16))
        Y[:, np.flatnonzero(w)] = s
        rows.append(Y)
    return _frozen(np.vstack(rows) / math.sqrt(2.0))


@functools.lru_cache(maxsize=None)
def _leech_min() -> np.ndarray:
    """The 196,560 minimal vectors of the Leech lattice (norm 4).

    In the integer coordinates of norm 32: (+-4, +-4, 0^22) (1,104), (+-2)^8 on the
    octads of the Golay code with an even number of minus signs (97,152), and
    (-+3, +-1^23) from every Golay word with one coordinate moved by 4 (98,304).
    """
    C = _golay()
    octs = C[C.sum(axis=1) == 8]
    s = _sign_patterns(8, even=True)
    rows = [_pairs_pm(24, 4.0)]
    for w in octs:
        Y = np.zeros((s.shape[0], 24))
        Y[:, np.flatnonzero(w)] = 2.0 * s
        rows.append(Y)
    base = np.where(C == 1, 1.0, -1.0)  # x = 1 mod 4 exactly on the word
    for j in range(24):
        Y = base.copy()
        Y[:, j] -= 4.0 * Y[:, j]  # 1 -> -3, -1 -> 3: the class mod 4 is kept
        rows.append(Y)
    return _frozen(np.vstack(rows) / math.sqrt(8.0))


@dataclasses.dataclass(frozen=True)
class _Lattice:
    """A lattice: dimension, minimal norm, covolume, minimal vectors and ball points."""

    name: str
    dim: int
    min_norm: float
    covolume: float
    minimal: Callable[[], np.ndarray]
    ball: Callable[[np.ndarray, float], np.ndarray] | None  # (center, r2) -> points
    centers: Callable[[], list[np.ndarray]]  # lattice point, holes


def _dn_ball(n: int):
    def ball(c, r2):
        P = _coset_ball(c, r2, np.zeros(n), np.ones(n))
        return P[np.round(P.sum(axis=1)).astype(np.int64) % 2 == 0]

    return ball


def _e8_ball(c, r2):
    P = np.vstack([_coset_ball(c, r2, np.zeros(8), np.ones(8)), _coset_ball(c, r2, np.full(8, 0.5), np.ones(8))])
    return P[np.round(P.sum(axis=1)).astype(np.int64) % 2 == 0]


def _e8_section_ball(k: int):
    def ball(c, r2):
        # c lies in the section; lift it to E8's coordinates
        lift = np.concatenate([np.full(k, c[0] / math.sqrt(k)), c[1:]])
        return _section(_e8_ball(lift, r2), k)

    return ball


def _a2_ball(c, r2):
    step = np.array([1.0, math.sqrt(3.0)])
    return np.vstack([_coset_ball(c, r2, np.zeros(2), step), _coset_ball(c, r2, np.array([0.5, math.sqrt(3.0) / 2]), step)])


def _lattice(name: str) -> _Lattice:
    """The lattice called ``name``: "Z", "A2", "D<n>" (n >= 3), "E6", "E7", "E8",
    "BW16" or "Leech"."""
    rng = np.random.default_rng(0)
    if name == "Z":
        return _Lattice(name, 1, 1.0, 1.0, lambda: np.array([[1.0], [-1.0]]),
                        lambda c, r2: _coset_ball(c, r2, np.zeros(1), np.ones(1)),
                        lambda: [np.zeros(1), np.full(1, 0.5)])
    if name == "A2":
        hexagon = np.array([[math.cos(t), math.sin(t)] for t in np.arange(6) * math.pi / 3])
        return _Lattice(name, 2, 1.0, math.sqrt(3.0) / 2, lambda: hexagon, _a2_ball,
                        lambda: [np.zeros(2), np.array([0.5, math.sqrt(3.0) / 6]),
                                 np.array([0.5, 0.0])] + [rng.uniform(-0.5, 0.5, 2) for _ in range(3)])
    if name.startswith("D"):
        n = int(name[1:])
        return _Lattice(name, n, 2.0, 2.0, lambda: _pairs_pm(n, 1.0), _dn_ball(n),
                        lambda: [np.zeros(n), np.eye(n)[0], np.full(n, 0.5)]
                        + [rng.uniform(-0.5, 0.5, n) for _ in range(3)])
    if name == "E8":
        return _Lattice(name, 8, 2.0, 1.0, _e8_min, _e8_ball,
                        lambda: [np.zeros(8), np.eye(8)[0], np.full(8, 0.25), np.r_[5 / 6, np.full(7, 1 / 6)]]
                        + [rng.uniform(-0.5, 0.5, 8) for _ in range(2)])
    if name in ("E7", "E6"):
        k = 2 if name == "E7" else 3
        n = 9 - k
        # deep-hole-like and generic points of the section
        return _Lattice(name, n, 2.0, math.sqrt(9.0 - n), lambda: _section(_e8_min(), k), _e8_section_ball(k),
                        lambda: [np.zeros(n), np.eye(n)[-1], np.r_[0.0, np.full(n - 1, 0.25)]]
                        + [np.r_[0.0, rng.uniform(-0.5, 0.5, n - 1)] for _ in range(2)])
    if name == "BW16":
        return _Lattice(name, 16, 4.0, 16.0, _bw16_min, None, lambda: [np.zeros(16)])
    if name == "Leech":
        return _Lattice(name, 24, 4.0, 1.0, _leech_min, None, lambda: [np.zeros(24)])
    raise ValueError(f"lattice must be one of 'Z', 'A2', 'D<n>', 'E6', 'E7', 'E8', 'BW16', 'Leech', got {name!r} instead.")


def _lattice_name(lattice: Any) -> _Lattice:
    if not isinstance(lattice, str):
        raise TypeError(f"lattice must be a str, got {type(lattice).__name__} instead.")
    # ASCII digits only: str.isdigit() also takes '³' (which int() refuses) and other
    # scripts' digits; no leading zero, so that one lattice has one name ('D03' is D3's
    # name misspelt, as 'E08' would be)
    if lattice.startswith("D") and not (re.fullmatch("D[1-9][0-9]*", lattice) and int(lattice[1:]) >= 3):
        raise ValueError(f"lattice 'D<n>' needs an integer n >= 3, got {lattice!r} instead.")
    return _lattice(lattice)


def minimal_vectors(lattice: str, /) -> np.ndarray:
    r"""The minimal vectors of a lattice (its kissing configuration).

    Parameters
    ----------
    lattice : {"Z", "A2", "D<n>", "E6", "E7", "E8", "BW16", "Leech"}
        The integers, the hexagonal lattice, the checkerboard lattice
        :math:`D_n = \{x \in \mathbb{Z}^n : \sum x_i \text{ even}\}` (``n >= 3``), the
        exceptional root lattices, the Barnes-Wall lattice :math:`\Lambda_{16}` or the
        Leech lattice :math:`\Lambda_{24}`.

    Returns
    -------
    X : ndarray of shape (K, n)
        float64 rows, every vector of the lattice's minimal norm (2 for the root
        lattices :math:`D_n, E_6, E_7, E_8`, 4 for :math:`\Lambda_{16}` and
        :math:`\Lambda_{24}`, 1 for Z and A2), in a fixed order.  The counts are the
        kissing numbers: :math:`2n(n-1)` for :math:`D_n`, 72, 126, 240, 4320 and
        196,560.

    Notes
    -----
    Closed forms: :math:`E_8 = D_8 \cup (D_8 + \tfrac12 \mathbf 1)` (the 112 vectors
    :math:`\pm e_i \pm e_j` and the 128 vectors :math:`(\pm\tfrac12)^8` with an even
    number of minus signs); :math:`E_7` and :math:`E_6` are the sections
    :math:`x_1 = x_2` and :math:`x_1 = x_2 = x_3` of :math:`E_8`, written in
    orthonormal coordinates of the section; :math:`\Lambda_{16}` is
    :math:`\{x \in \mathbb{Z}^{16} : x \bmod 2 \in RM(1, 4),\ \sum x_i \equiv 0
    \pmod 4\}/\sqrt 2`; :math:`\Lambda_{24}` is built on the extended Golay code
    (shapes :math:`(\pm4^2 0^{22})`, :math:`(\pm2^8 0^{16})`, :math:`(\mp3, \pm1^{23})`
    over :math:`\sqrt 8`).  Inner products between minimal vectors take the values
    :math:`\{0, \pm\tfrac14, \pm\tfrac12, \pm1\}` times the norm.  Time and memory
    O(K n).

    References
    ----------
    .. [1] J. H. Conway, N. J. A. Sloane, Sphere Packings, Lattices and Groups,
       3rd ed., Springer (1999), chapters 4 and 8.

    Examples
    --------
    >>> import refgeo
    >>> X = refgeo.minimal_vectors("E8")
    >>> X.shape, sorted(set((X @ X.T).ravel().tolist()))
    ((240, 8), [-2.0, -1.0, 0.0, 1.0, 2.0])
    """
    lat = _lattice_name(lattice)
    if lat.name.startswith("D"):
        # 2 n (n - 1) vectors of length n, built and then copied: D_1000 needs 32 GB
        n = lat.dim
        _memory.check_memory(f"minimal_vectors({lattice!r})",
                             {f"{2 * n * (n - 1)} vectors of length {n} (float64, built and copied)":
                              16.0 * 2 * n * (n - 1) * n}, "Ask for a lattice D<n> of smaller n.")
    return np.array(lat.minimal(), dtype=np.float64, order="C")  # a copy


def lattice_ball(V: int, lattice: str, /, *, center: Any = None) -> np.ndarray:
    r"""The ``V`` points of a lattice nearest to a center.

    Parameters
    ----------
    V : int
        Number of points, ``1 <= V <= 1,000,000``.
    lattice : {"Z", "A2", "D<n>", "E6", "E7", "E8"}
        See :func:`minimal_vectors` (:math:`\Lambda_{16}` and :math:`\Lambda_{24}`
        offer their minimal vectors only).
    center : array_like of shape (n,), default=None
        The center (the origin when None), entries at most ``2**24`` in magnitude.
        Deep holes of the lattice are good centers: e.g. :math:`(1, 0, \dots, 0)` for
        :math:`E_8`.

    Returns
    -------
    X : ndarray of shape (V, n)
        float64 lattice points sorted by distance to ``center`` (ties in the
        enumeration order).  Their closest-pair distance is the lattice minimum
        whenever two of them are neighbors in the lattice.

    Raises
    ------
    MemoryError
        When the enumeration would hold more than ``2**20`` lattice points (the
        ball is enlarged past ``V`` points, and its projections can hold more), so
        the largest ``V`` lies below 1,000,000: ``V = 880,000`` is refused for
        every lattice but ``"A2"`` (``"Z"``, the ``"D<n>"``, ``"E6"``, ``"E7"``
        and ``"E8"``).

    Notes
    -----
    The points are enumerated coordinate by coordinate within the ball of a radius
    chosen from the volume of the ball over the covolume (the Gaussian heuristic),
    enlarged until it holds ``V`` points; prefixes whose partial squared distance
    already exceeds the radius are dropped, so no box around the ball is built.  Time
    O(V n) up to the points of the projected balls; memory O(V n).

    Examples
    --------
    >>> import numpy as np, refgeo
    >>> X = refgeo.lattice_ball(17, "E8", center=[1, 0, 0, 0, 0, 0, 0, 0])
    >>> np.unique(np.linalg.norm(X - [1, 0, 0, 0, 0, 0, 0, 0], axis=1).round(12)).tolist()
    [1.0, 1.414213562373]
    """
    lat = _lattice_name(lattice)
    V = check_int(V, "V", min_value=1, max_value=1_000_000)
    # before the center of length n is allocated (NumPy's "Maximum allowed dimension
    # exceeded" for D<n> with n near 1e19 named no argument)
    _check_size(f"lattice_ball({V}, {lattice!r})", V, lat.dim, advice="Ask for fewer points V or a lattice D<n> of smaller n.")
    if lat.ball is None:
        raise ValueError(f"lattice {lattice!r} offers its minimal vectors only (minimal_vectors), not balls.")
    c = np.zeros(lat.dim) if center is None else as_float_array(from_foreign(center, "center", host=True)[0],
                                                                 "center", ndim=1)
    c = np.asarray(c, dtype=np.float64)
    if c.shape != (lat.dim,):
        raise ValueError(f"center must have shape ({lat.dim},), got shape {c.shape} instead.")
    top = float(np.max(np.abs(c)))
    if top > _LATTICE_MAX_CENTER:
        # farther out the coordinates (multiples of 1/2, sqrt(3)/2, ...) lose their
        # fractional bits: near 2**53 the points are no longer distinct, and beyond
        # the int64 range the enumeration never ends
        raise ValueError(
            f"center must have entries of magnitude at most 2**24 (lattice coordinates "
            f"keep an absolute accuracy of 2**-28 there), got {top!r} instead; subtract a "
            "nearby lattice vector from the center and add it to the returned points."
        )
    X = _nearest_points(lat, V, c)
    if X is None:
        # in high dimension the projections of even a small ball hold many points
        raise MemoryError(f"lattice_ball({V}, {lattice!r}) would enumerate more than "
                          f"{_LATTICE_MAX_POINTS} lattice points (the projections of its ball in "
                          f"dimension {lat.dim} hold them); ask for fewer points or a lattice of "
                          "smaller dimension.")
    return X


def _nearest_points(lat: _Lattice, V: int, c: np.ndarray) -> np.ndarray | None:
    n = lat.dim
    # log of the unit ball's volume (math.gamma overflows from n = 343 on)
    log_unit_ball = 0.5 * n * math.log(math.pi) - math.lgamma(0.5 * n + 1.0)
    # radius of a ball holding about 1.2 V points, plus the covering slack
    R = math.exp((math.log(1.2 * V * lat.covolume) - log_unit_ball) / n) + 0.5 * math.sqrt(lat.min_norm)
    ball = lat.ball
    if ball is None:  # callers only ask lattices that enumerate balls
        raise RuntimeError(f"internal error: lattice {lat.name} has no ball enumeration")
    while True:
        try:
            P = ball(c, R * R)
        except _TooManyPoints:
            return None
        if P.shape[0] >= V:
            break
        R *= 1.15
    r2 = np.einsum("ij,ij->i", P - c, P - c)
    return P[np.argsort(r2, kind="stable")[:V]]


def _ball_diameter(X: np.ndarray, c: np.ndarray) -> float:
    """Certified diameter of points in a ball around c, from the outer points only.

    Any pair at distance D has |x - c| + |y - c| >= D, so once the outermost shell
    gives D0 <= D, a point with |x - c| < D0 - r_max cannot be an end of a diameter.
    """
    from .rows import row_diameter

    r = np.sqrt(np.einsum("ij,ij->i", X - c, X - c))
    r_max = float(r.max())
    D0 = row_diameter(X[r >= r_max * (1.0 - 1e-12)]).value if np.sum(r >= r_max * (1.0 - 1e-12)) >= 2 else 0.0
    keep = r >= (D0 - r_max) * (1.0 - 1e-9) - 1e-12
    return row_diameter(X[keep]).value


def _best_ball(lat: _Lattice, V: int) -> tuple[np.ndarray, float, int] | None:
    """The V points nearest to the best of the lattice's centers, with their ratio."""
    best: tuple[np.ndarray, float, int] | None = None
    for k, c in enumerate(lat.centers()):
        X = _nearest_points(lat, V, c)
        if X is None:
            return None
        rho = math.sqrt(lat.min_norm) / _ball_diameter(X, c)
        if best is None or rho > best[1]:
            best = (X, rho, k)
    return best


def _shell_subsets(M: np.ndarray, V: int) -> list[tuple[str, np.ndarray, float, float]]:
    """Subsets of a shell (all of norm r^2, inner products on a few levels) of V points.

    For each level t (from the largest), a greedy independent set (lowest conflict
    degree first) of the graph of pairs with inner product below t, in a pool: the
    whole shell when it is small, else the caps of the shell nearest to one shell
    vector and to the all-ones direction (for the Leech lattice the second holds 7,176
    minimal vectors with inner products >= -r^2/4, the first only 2,301).  The origin
    is added when it helps (it is at distance r from every point, never closer than
    the shell's own closest pair when the inner products reach r^2 / 2).  Returns
    (label, points, exact ratio, exact diameter), both from the integer-valued Gram
    levels: with the diameter ``spread`` certifies a large subset in closed form, where
    the engine is slow (each row of the whole Leech shell has 4,600 partners at the
    closest distance: 60 s on 2 cores at V = 196,560).
    """
    r2 = float(M[0] @ M[0])
    # the pool: the whole shell, or caps of it (the Leech shell's 196,560 vectors would
    # need a 39 GB Gram matrix); 3 V vectors leave the greedy room to choose
    n_pool = min(M.shape[0], max(3 * V, 2000), 8000)
    if n_pool == M.shape[0]:
        pools = [("", M)]
    elif V - 1 <= n_pool:
        pools = [(f",cap{k}", M[np.argsort(-(M @ u), kind="stable")[:n_pool]])
                 for k, u in enumerate((M[0], np.ones(M.shape[1])))]
    else:  # the caps cannot hold V points (nor V - 1 and the origin)
        pools = []
    out = []
    for tag, P in pools:
        out += _shell_greedy(P, V, r2, tag)
    if V > n_pool and V <= M.shape[0]:
        out += _shell_prefix(M, V, r2)
    return out


def _shell_prefix(M: np.ndarray, V: int, r2: float) -> list[tuple[str, np.ndarray, float, float]]:
    """The first V vectors of a whole shell of minimal vectors, beyond the pools.

    Two distinct minimal vectors differ by a nonzero lattice vector, so every distance
    is at least ``r`` (the lattice minimum), and at most ``2 r``: the ratio is exactly
    1/2 when the rows hold an antipodal pair and a pair at distance ``r`` (inner product
    ``r^2 / 2``), both checked here in O(V d).  Without it 8000 < V <= 196,560 in
    d = 24 had no construction at all (random points: 0.21 at V = 196,560, where the
    whole Leech shell has 1/2).
    """
    X = M[:V]
    # exact keys of the rows: the shells' coordinates are multiples of 1/2 or 1/sqrt(8)
    scale = 2.0 * math.sqrt(2.0)
    keys = np.rint(X * scale).astype(np.int64)
    if not np.allclose(keys, X * scale, rtol=0.0, atol=1e-9):
        return []
    rows = {k.tobytes() for k in keys}
    antipodal = any((-k).tobytes() in rows for k in keys)
    neighbor = bool(np.any(np.rint(4.0 * (X[1:] @ X[0]) / r2) == 2))
    if not (antipodal and neighbor):
        return []
    return [("ip>=-4/4,prefix", X.copy(), 0.5, 2.0 * math.sqrt(r2))]


def _shell_greedy(P: np.ndarray, V: int, r2: float, tag: str) -> list[tuple[str, np.ndarray, float, float]]:
    out = []
    # inner products in units of r^2 / 4 (exact small integers), blockwise as int8.
    # float32 suffices to round them: the rows scaled to norm 2 have products in
    # [-4, 4] with an error below (d + 2) u 4 < 1e-5 for d <= 32, far from 1/2; it
    # took a third of the time of float64 (1.3-1.9 s for a pool of 8000 in d = 24)
    Q = (P * (2.0 / math.sqrt(r2))).astype(np.float32)
    L = np.empty((P.shape[0], P.shape[0]), dtype=np.int8)
    for i0 in range(0, P.shape[0], 1024):
        B = Q[i0 : i0 + 1024] @ Q.T
        L[i0 : i0 + 1024] = np.rint(B, out=B)
    # key: the conflict degree of a point still available, about 2^40 for one that is
    # not (set to 2^40 when it goes; the degrees subtracted from it later, at most
    # n_pool^2 = 6.4e7 in all, leave it above 2^39), so that one argmin picks the first
    # available point of least degree
    dead = np.int64(1) << np.int64(40)
    for lv in range(1, -5, -1):  # inner products >= lv r^2 / 4 kept, from the largest
        conflict = L < lv
        alive = np.ones(P.shape[0], dtype=bool)
        key = conflict.sum(axis=1).astype(np.int64)
        chosen: list[int] = []
        while len(chosen) < V:
            i = int(np.argmin(key))
            if key[i] >= dead // 2:
                break  # nothing left
            chosen.append(i)
            gone = alive & conflict[i]
            gone[i] = True
            alive &= ~gone
            # L is symmetric: the rows of the removed points (contiguous) give the same
            # counts as their columns, several times faster
            key -= conflict[gone].sum(axis=0)
            key[gone] = dead
        for with_origin in (False, True):
            k = V - 1 if with_origin else V
            if len(chosen) < k or k < 2:
                continue
            idx = np.array(chosen[:k])
            Lx = L[np.ix_(idx, idx)]  # int8 levels in [-4, 4]: no wider copy needed
            np.fill_diagonal(Lx, -4)
            m2 = 2.0 * r2 - 0.5 * r2 * float(Lx.max())  # |x - y|^2 = 2 r^2 - 2 <x, y>
            np.fill_diagonal(Lx, 4)
            D2 = 2.0 * r2 - 0.5 * r2 * float(Lx.min())
            X = P[idx]
            if with_origin:
                X = np.vstack([np.zeros((1, X.shape[1])), X])
                m2 = min(m2, r2)
                D2 = max(D2, r2)
            out.append((f"ip>={lv:g}/4{tag}" + ("+0" if with_origin else ""), X, math.sqrt(m2 / D2),
                        math.sqrt(D2)))
        if len(chosen) >= V:
            break  # a larger level already fits V points; smaller ones only widen D
    return out


def _line(V: int) -> np.ndarray:
    """V equally spaced points of the line, at the integers 0, ..., V - 1."""
    return np.arange(V, dtype=np.float64)[:, None]


_LATTICE_OF_DIM = {1: "Z", 2: "A2", 6: "E6", 7: "E7", 8: "E8", 16: "BW16", 24: "Leech"}


def _lattice_candidates(V: int, d: int) -> list[_Candidate]:
    """Lattice balls and shell subsets for (V, d): the lattice of dimension d (Z, A2,
    E6, E7, E8, BW16, Leech), D_d for 3 <= d <= 24, and between the special dimensions
    the largest special lattice below d (E8 for 9 <= d <= 15, BW16 for 17 <= d <= 23,
    Leech for 25 <= d <= 32), zero-padded to d (distances unchanged)."""
    names = []
    if d in _LATTICE_OF_DIM:
        names.append(_LATTICE_OF_DIM[d])
    if 3 <= d <= 24:
        names.append(f"D{d}")
    for lo, hi, name in ((9, 15, "E8"), (17, 23, "BW16"), (25, 32, "Leech")):
        if lo <= d <= hi:
            names.append(name)
    out = []
    for name in names:
        lat = _lattice(name)
        n = lat.dim
        pad = "" if n == d else f"+0^{d - n}"

        def padded(X, n=n):
            return X.copy() if n == d else embed(X, d=d)

        if name == "Z":
            # V equally spaced points, optimal: rho = 1/(V - 1) is the volume bound
            # the integers 0 .. V - 1: every distance exact, the diameter V - 1
            out.append(_Candidate("lattice(Z)", 1.0 / (V - 1.0), functools.partial(_line, V),
                                  float(V - 1) if V <= 2**53 else None, on_sphere=False, iterate=False))
            continue
        # D_n balls beyond n = 12 hold thousands of points within their first two
        # shells, where the shell subsets and the sphere codes do better
        if lat.ball is not None and 2 * d < V and (n <= 12 or name != f"D{n}"):
            b = _best_ball(lat, V)
            if b is not None:
                X, rho, k = b
                out.append(_Candidate(f"lattice({name}{pad})", rho, functools.partial(padded, X),
                                      on_sphere=False, iterate=False))
        if name not in ("Z", "A2") and n >= 5:
            M = lat.minimal()
            if V <= M.shape[0] + 1:
                for label, X, rho, D in _shell_subsets(M, V):
                    out.append(_Candidate(f"shell({name}{pad},{label})", rho, functools.partial(padded, X), D,
                                          on_sphere="+0" not in label, iterate=False))
    return out


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


def _embedded_dg(q: int, V: int, d: int) -> np.ndarray:
    return embed(delsarte_goethals_code(q, V), d=d)


def _dg_class_tagged(q: int, V: int, d: int) -> np.ndarray:
    r"""The Delsarte-Goethals code of R^q with one tag coordinate per Kerdock class.

    The bases of :func:`delsarte_goethals_code` come in classes of :math:`q/2`
    (the Kerdock forms plus one Gold-type form :math:`C_w`; the standard basis joins
    the first class): within a class every difference of forms is nonsingular, so
    cross-basis inner products are :math:`\pm\mu`, :math:`\mu = 1/\sqrt q`; the
    values :math:`\pm 2\mu` occur only across classes.  A tag :math:`t e_c` with
    :math:`t^2 = \mu` on every vector of class c adds :math:`\mu` inside a class:
    squared distances lie in :math:`[2 - 2\mu, 2 + 6\mu]` and
    :math:`\rho^2 = (\sqrt q - 1)/(\sqrt q + 3)` (7/11 for q = 64, from 3/5), with
    only :math:`\lceil (V - q)/(q^2/2) \rceil` extra coordinates (25 at V = 50000,
    q = 64) where one tag per basis needs :math:`V/q`.
    """
    X = np.zeros((V, d))
    X[:, :q] = delsarte_goethals_code(q, V)
    cls = np.maximum(np.arange(V) - q, 0) // (q * (q // 2))  # basis (i - q) // q, class basis // (q/2)
    X[np.arange(V), q + cls] = q**-0.25
    return X


def _dg_tagged(q: int, V: int, d: int) -> np.ndarray:
    r"""The Delsarte-Goethals code of R^q with one tag coordinate per basis.

    Every vector of basis b gets :math:`t e_b` with :math:`t^2 = 2/\sqrt q`:
    same-basis inner products become :math:`t^2` (from 0), cross-basis ones stay in
    :math:`\{0, \pm 1/\sqrt q, \pm 2/\sqrt q\}` and every norm^2 is
    :math:`1 + t^2`, so squared distances lie in :math:`[2, 2 + 8/\sqrt q]` and
    :math:`\rho^2 = \sqrt q/(\sqrt q + 4)` (from :math:`(\sqrt q - 2)/(\sqrt q + 2)`
    untagged): 2/3 for q = 64.  Needs ``q + ceil(V/q) <= d``.  Entries are dyadic
    when :math:`t^2 = 2^{1-n/2}` is a square of one, i.e. q = 64, 1024, ...
    """
    X = np.zeros((V, d))
    X[:, :q] = delsarte_goethals_code(q, V)
    b = np.arange(V) // q
    X[np.arange(V), q + b] = math.sqrt(2.0 / math.sqrt(q))
    return X


def _candidates(V: int, d: int) -> list[_Candidate]:
    """Constructions usable for (V, d), each with its closed-form ratio (the lattice
    balls of small d with a computed one)."""
    out: list[_Candidate] = []
    if V <= d + 1:
        out.append(_Candidate("regular_simplex", 1.0, lambda: regular_simplex(V, d),
                              math.sqrt(2.0 * V / (V - 1.0))))
        return out
    out += _lattice_candidates(V, d)
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
                                      functools.partial(_kerdock_tagged, q, V, d, False), math.sqrt(2.0 + 2.0 / sq),
                                      iterate=False))
            if n_copies * q + n_bases <= d:
                rho = math.sqrt(sq / (sq + 2.0))
                dyadic = int(round(math.log(q, 4))) % 2 == 0  # q^(1/4) a power of 2
                out.append(_Candidate(f"kerdock({q})x{n_copies}+tags", rho,
                                      functools.partial(_kerdock_tagged, q, V, d, True),
                                      math.sqrt(2.0 + 4.0 / sq) if dyadic else None,
                                      iterate=False))
            if q >= 16 and V > q * (q // 2 + 1) and V <= q + q**3 // 4:
                rho = math.sqrt((sq - 2.0) / (sq + 2.0))
                out.append(_Candidate(f"delsarte_goethals({q})", rho,
                                      functools.partial(_embedded_dg, q, V, d), math.sqrt(2.0 + 4.0 / sq),
                                      iterate=False))
                n_classes = -(-(V - q) // (q * (q // 2)))
                if q + n_classes <= d:
                    dyadic = int(round(math.log(q, 4))) % 2 == 0  # q^(-1/4) a power of 2
                    out.append(_Candidate(f"delsarte_goethals({q})+class_tags", math.sqrt((sq - 1.0) / (sq + 3.0)),
                                          functools.partial(_dg_class_tagged, q, V, d),
                                          math.sqrt(2.0 + 6.0 / sq) if dyadic else None, iterate=False))
                if q + n_bases <= d:
                    dyadic = int(round(math.log(q, 4))) % 2 == 1  # 2/sqrt(q) a square of a power of 2
                    out.append(_Candidate(f"delsarte_goethals({q})+tags", math.sqrt(sq / (sq + 4.0)),
                                          functools.partial(_dg_tagged, q, V, d),
                                          math.sqrt(2.0 + 8.0 / sq) if dyadic else None, iterate=False))
        q *= 4
    # p-ary quadratic trace codes: (p - 1) p^m coordinates, up to p^(2m) rows; V > d + 1
    # here, so V > p^m and two classes are present (the closed forms hold)
    for p in range(3, math.isqrt(math.isqrt(d)) + 3, 2):  # (p - 1) p^3 <= d: p - 1 <= d^(1/4)
        if not _is_odd_prime(p):
            continue
        m = 3
        while (p - 1) * p**m <= d:
            N = p**m
            if V <= N * N:
                rho, D, err = _trace_code_closed_form(p, m, False)
                out.append(_Candidate(f"quadratic_trace({p}^{m})", rho,
                                      functools.partial(_trace_code_rows, p, m, V, d, False), D,
                                      iterate=False, build_error=err))
                if (p - 1) * N + -(-V // N) <= d:
                    rho, D, err = _trace_code_closed_form(p, m, True)
                    out.append(_Candidate(f"quadratic_trace({p}^{m})+class_tags", rho,
                                          functools.partial(_trace_code_rows, p, m, V, d, True), D,
                                          iterate=False, build_error=err))
            m += 2
    return out
