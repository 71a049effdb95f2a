"""Numerical kernels of refgeo.tokenwise: closed-form local fits on neighbor panels.

Every function here receives clean float64 NumPy arrays and resolved options (the
public wrappers in :mod:`refgeo.tokenwise` validate); none of them checks arguments.

Conventions (docs/theory/tokenwise.md).  Token ``i`` has neighbors ``N_k(i)`` (row
``i`` of ``nbr``) with weights ``w_ij`` normalized to mean 1 over the neighborhood.
The local problem is

    min_A  sum_j w_ij ||y_j - A x_j||^2 + lam ||A - A0||_F^2,   A0 in {0, I},

written with ``D = A - A0`` and targets ``r_j = y_j - A0 x_j``.  Each kernel returns
the fitted value ``A_i x_i`` of every token (and small per-token coefficients), never
the d x d maps, except on request for tests (``return_maps``).

Queries: a kernel fits the first ``nbr.shape[0]`` rows of ``X`` (all of them on one
machine); the neighbors may be any rows.  A task of the Dask engine passes its token
block followed by the neighbor rows it gathered from other blocks, with ``nbr``
remapped to those local rows: the fit of a token reads only its own row and its
neighbors' rows, so the result is the same bits.

Memory: the neighbor panels ``X[nbr[chunk]]`` are gathered ``chunk`` tokens at a
time, so at most ``chunk * k * d`` float64 numbers per panel exist at once.

Scaling: the fits receive ``ex`` and work on ``X * 2**-ex`` and ``Y * 2**-ex``,
scaling only the rows they gather (exact: a power of two), so that no scaled (N, d)
copy is needed; the fitted values they return are those of the scaled panels.
"""

from __future__ import annotations

import math

import numpy as np

from ._certify import two_diff

# Relative threshold below which a Gram eigenvalue / singular value counts as zero.
_RCOND_SCALE = 100.0
_EPS = float(np.finfo(np.float64).eps)

# Target bytes of one gathered neighbor panel (chunk * k * d * 8).
_PANEL_BYTES = 48 * 2**20


def scaled64(A, e):
    """float64 ``A * 2**-e`` (exact); ``A`` itself when it is float64 and ``e == 0``."""
    if A.dtype == np.float64:
        return A if e == 0 else np.ldexp(A, -e)
    out = A.astype(np.float64)
    if e:
        np.ldexp(out, -e, out=out)
    return out


def panels64(X, Y, e):
    """``(X64, Y64, ex)``: float64 panels and the exponent still to apply to them.

    float64 inputs are used as they are (``ex = e``: the kernels scale the rows they
    gather, and no (N, d) copy is made); other dtypes are converted, and the copies
    are scaled in place (``ex = 0``).
    """
    if X.dtype == np.float64 and Y.dtype == np.float64:
        return X, Y, e
    return scaled64(X, e), scaled64(Y, e), 0


def default_chunk(k: int, d: int, n: int, diagonal: bool = False) -> int:
    """Tokens per chunk so that one (chunk, k, max(d, 4k)) float64 block stays near 48 MiB.

    ``4k``: the kernel-form fits also hold about four (chunk, k, k) arrays at once
    (Gram matrix, eigenvectors, and for low rank two more), which dominate when k is
    large compared with d.  The diagonal fits gather no panels: their chunk holds one
    (chunk, max(d, k)) block of the sparse products, and small chunks only add
    per-chunk overhead.
    """
    per_token = 8 * (max(d, k) if diagonal else k * max(d, 4 * k))
    return int(max(1, min(n, _PANEL_BYTES // max(1, per_token))))


def panel_bytes(cls: str, n: int, d: int, k: int, chunk: int, return_maps: bool = False) -> tuple[str, int]:
    """``(label, bytes)``: the working panels of the fit of ``n`` tokens of class ``cls``
    in chunks of ``chunk`` tokens (an upper estimate, for the memory checks).

    The diagonal classes hold one (n, d) product panel, a chunk of sparse products, the
    two scaled chunks of rows they multiply and the rows' exponents; the others gather
    (chunk, k, d) neighbor panels (the linear fits) or work in the span of ``m = min(d, 2k)``
    directions (the orthogonal fits), and with ``return_maps`` hold up to four
    (chunk, d, d) temporaries of the maps besides the (n, d, d) maps themselves (which
    the callers count with the results).
    """
    f, b = 8, chunk
    if cls in ("diagonal", "psd_diagonal"):
        # (f + 2) n d: the panel and the two boolean masks of the zero denominators;
        # 2 f n: the rows' and the panels' exponents; per token of a chunk, its scaled
        # rows (and the far rows' copies scaled by their own exponents), and its
        # neighbors' exponents, weights and sparse entries
        return (f"one (N, d) product panel, chunks of chunk_size={b} tokens",
                (f + 2) * n * d + 2 * f * n + (5 * f * d + 28 * k) * b)
    maps = 4 * f * b * d * d if return_maps else 0
    label = f"neighbor panels of chunk_size={b} tokens" + (" and their maps" if return_maps else "")
    if cls in ("low_rank", "full"):
        # (chunk, k, k): the Gram matrix and its eigenvectors, for low rank also the
        # products of the rank-r eigenproblem, all alive until the chunk ends (ten of
        # them at the peak, measured with tracemalloc at k = 64, d = 16), and with
        # return_maps the pseudo-inverse and its product temporary
        kk = (10 if cls == "low_rank" else 6) + (2 if return_maps else 0)
        return label, f * b * k * (3 * d + kk * k) + maps
    # (chunk, m, m): the QR's R, the cross-covariance, the two reflections, the
    # reflected matrix, its SVD, the factors reflected back and the polar factor;
    # (chunk, k, d): the panels and their centered copies; (chunk, k, m): those
    # projected and weighted
    m = d if 2 * k >= d else 2 * k
    return label, f * b * (4 * k * d + 4 * d * m + 5 * k * m + 14 * m * m) + maps


# --------------------------------------------------------------------- diagonal


def _rows(A, ex, s, t):
    """Rows ``s:t`` of ``A * 2**-ex`` (a view when ``ex == 0``)."""
    return A[s:t] if ex == 0 else np.ldexp(A[s:t], -ex)


# The exponent of a zero row: below every float64 exponent, so that it never sets the
# scale of a panel.
_NO_EXPONENT = -1100

# Rows and panels whose largest entry lies within 2**+-_FAR of the panels' one scaling
# are used as they are: a square that underflows there is below 2**-470 of its row's
# squared norm, and their results stay the bits of the one scaling.  Only those further
# away (a cluster of tokens 2**-540 times the rest) are scaled by powers of two of their
# own.
_FAR = 300


def row_tops(A):
    """``max_c |A[..., c]|`` over the last axis, without an ``|A|`` temporary."""
    return np.maximum(A.max(axis=-1), -A.min(axis=-1))


def far_exponents(top):
    """The exponents by which rows (or panels) of largest magnitudes ``top`` are scaled:
    their binary exponents beyond ``2**+-_FAR``, else 0 (zero rows: 0)."""
    e = np.frexp(top)[1]
    return np.where(np.abs(e) > _FAR, e, 0)


# A ridge scaled by a panel's exponent is capped here: far above every sum of the scaled
# panels (at most k d), so that the fit is the prior's to rounding, as lam -> inf, where
# the scaled ridge overflowed to inf (and inf / inf to NaN).
_RIDGE_CAP = 2.0**900


def _panel_ridge(lam, E):
    """``lam 4**-E`` for the panels scaled by ``2**-E`` (``E`` an integer array), capped
    at :data:`_RIDGE_CAP` (``lam`` itself where ``E = 0``)."""
    E = np.asarray(E)
    with np.errstate(over="ignore"):
        return np.where(E == 0, float(lam), np.minimum(np.ldexp(np.full(E.shape, float(lam)), -2 * E), _RIDGE_CAP))


def fit_diagonal(X, Y, nbr, w, lam, a0, nonneg, chunk, tick=None, ex=0):
    """Coordinate-wise closed form ``a_c = (sum w x y + lam a0) / (sum w x^2 + lam)``.

    The neighbor sums are products of the sparse neighbor-weight matrix (k entries per
    row) with the dense (N, d) panels ``X*Y`` and ``X*X``: O(N k d) time, O(N d) extra
    memory, no (N, k, d) gather.  The products run ``chunk`` rows at a time (each row
    on its own, so the result does not depend on ``chunk``), calling ``tick()`` after
    each: 2 ceil(N / chunk) steps.  A coordinate with a zero denominator (``lam = 0``
    and all neighbors zero there) carries no information and takes the prior value
    ``a0``.  ``nonneg`` clips at 0, the exact minimizer of the 1-D convex problem on
    ``a >= 0``.

    Each token's sums are those of its panel scaled by a power of two of its own where
    the panel is far from the panels' one scaling (:data:`_FAR`), as :func:`_linear_svd`
    scales its panels: the products of such rows are taken from the rows scaled by
    their own exponents ``e_j`` (of ``max(|x_j|, |y_j|)``) and weighted by ``4**(e_j -
    E_i)``, ``E_i`` the largest exponent of the neighbors of token ``i`` with a nonzero
    weight, and ``lam`` by ``4**-E_i`` (the ratio is unchanged).  Products of the
    panels' one scaling underflowed for a cluster of tokens 2**-540 times the rest,
    whose fit was the prior.
    """
    import scipy.sparse as sp

    n_rows, d = X.shape
    n, k = nbr.shape  # the queries are the first n rows of X
    num = np.empty((n, d))
    den = np.empty((n, d))
    indptr = np.arange(0, min(chunk, n) * k + 1, k)
    er = np.empty(n_rows, dtype=np.int64)
    P = np.empty((n_rows, d))
    for s in range(0, n_rows, chunk):  # X * Y, and the rows' exponents
        e = min(n_rows, s + chunk)
        xb, yb = _rows(X, ex, s, e), _rows(Y, ex, s, e)
        top = np.maximum(row_tops(xb), row_tops(yb))
        # a zero row adds nothing: its exponent must not set a panel's scale
        er[s:e] = np.where(top > 0, far_exponents(top), _NO_EXPONENT)
        np.multiply(xb, yb, out=P[s:e])
    far = np.flatnonzero((er != 0) & (er != _NO_EXPONENT))

    def far_products(B):
        # the far rows' products again, from the rows scaled by their exponents
        for s in range(0, far.size, chunk):
            f = far[s : s + chunk]
            sh = -(ex + er[f])[:, None]
            xf = np.ldexp(X[f], sh)
            P[f] = xf * (xf if B is X else np.ldexp(B[f], sh))

    if far.size:
        far_products(Y)
    else:
        er[:] = 0  # every row as it is: the bits of the one scaling
    E = np.zeros(n, dtype=np.int64)
    for out in (num, den):
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            wt = w[s:e]
            if far.size:
                en = er[nbr[s:e]]  # a copy: made the weights' exponents in place
                if out is num:
                    # a neighbor of weight 0 is not in the problem: not in its scale
                    E[s:e] = np.where(wt > 0, en, _NO_EXPONENT).max(axis=1, initial=_NO_EXPONENT)
                en -= E[s:e, None]
                en *= 2
                wt = np.ldexp(wt, en)
            S = sp.csr_matrix((wt.ravel(), nbr[s:e].ravel(), indptr[: e - s + 1]), shape=(e - s, n_rows))
            out[s:e] = S @ P
            if tick is not None:
                tick()
        if out is num:
            for s in range(0, n_rows, chunk):
                e = min(n_rows, s + chunk)
                xb = _rows(X, ex, s, e)
                np.multiply(xb, xb, out=P[s:e])
            far_products(X)
    del P
    if lam:
        lam_i = _panel_ridge(lam, E)[:, None]
        num += lam_i * a0
        den += lam_i
    pos = den > 0
    np.divide(num, den, out=num, where=pos)
    num[~pos] = a0
    if nonneg:
        np.maximum(num, 0.0, out=num)
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        np.multiply(_rows(X, ex, s, e), num[s:e], out=den[s:e])
    return den, num


# ------------------------------------------------------- full ridge and low rank


def _kernel_pinv_weights(mu, lam, rcond):
    """``1/(mu + lam)`` and ``mu/(mu + lam)`` on the numerical range of the Gram matrix.

    Eigenvalues below ``rcond * mu_max`` count as zero for every ``lam``, not only for
    ``lam = 0``: the query ``kappa = Xt x`` and the targets lie in the range of ``Xt``,
    so the null space contributes nothing in exact arithmetic, while ``1/lam`` on it
    would amplify rounding noise (a rank-deficient panel, e.g. ``k > d``, with
    ``lam = 1e-14`` gave errors of order one).  It also makes ``lam -> 0+`` continuous
    with the minimum-norm answer at ``lam = 0``.
    """
    mu = np.maximum(mu, 0.0)
    keep = mu > rcond * mu[..., -1:]
    inv = np.where(keep, 1.0 / np.where(keep, mu + lam, 1.0), 0.0)
    h = np.where(keep, mu * inv, 0.0)
    return inv, h


# A panel whose min(k, d)-th Gram eigenvalue is below this fraction of the largest is
# solved from its SVD instead.  The Gram eigenproblem squares the panel's condition
# number, and a direction whose eigenvalue falls below the cut-off (rcond = 100
# max(k, d) eps of the largest) is dropped: hidden states with a large common
# component (a mean 1e6 times their spread) lost every direction but the mean, and the
# fit of an exactly linear layer left 36% of the update.  Measured error of the Gram
# solve, relative to the targets, on panels u + 10**-s noise with a layer acting off u
# (d from 2 to 64, k = 2d):
# at most 1e-6 for ratios above 1e-7, 6e-5 above 1e-9, 2e-2 above 1e-11, and beyond
# 1 below 1e-12 (medians 1e-11, 4e-10, 9e-9).  Below the ratio the SVD costs 2 to 8
# times as much per panel; states of one token with a common component (the
# benchmarks' hidden states: ratios near 5e-10) take it.
_GRAM_MIN_RATIO = 1e-7
# ... and so is a panel whose largest Gram eigenvalue is below this (2**-960: its
# squares are near the subnormal range, where they lose digits, then vanish)
_GRAM_MIN_SCALE = 2.0**-960


def _linear_gram(Xt, Rt, xi, lam, rcond, rank, return_maps):
    """:func:`fit_linear`'s solve of a batch of panels from the k x k Gram matrices:
    ``(t, DT, ill)`` with ``t`` the fitted deltas (b, d), ``DT`` the maps' transposes
    (b, d, d) or None, and ``ill`` the panels too ill-conditioned for it."""
    k, d = Xt.shape[1:]
    K = Xt @ Xt.swapaxes(1, 2)
    kap = np.einsum("bkd,bd->bk", Xt, xi)
    mu, E = np.linalg.eigh(K)
    # and panels whose squares are subnormal or zero: far below the largest entry of X
    # and Y (every panel shares their scaling), the Gram form returned a zero map
    ill = (mu[:, k - min(k, d)] < _GRAM_MIN_RATIO * mu[:, -1]) | (mu[:, -1] < _GRAM_MIN_SCALE)
    if ill.any():
        # their answers come from the SVD (fit_linear); here they must only stay
        # finite: 1 / (mu + lam) of a tiny eigenvalue overflowed, and the rank-r
        # eigenproblem of the resulting inf/NaN raised LinAlgError ("Eigenvalues did
        # not converge") before the SVD could take the panel over.  Unit eigenvalues
        # in place (no copies of the panels: the task estimates count on it).
        mu = np.where(ill[:, None], 1.0, mu)
        E[ill] = np.eye(k)
    inv, h = _kernel_pinv_weights(mu, lam, rcond)
    # alpha-coefficients of the query: c = (K + lam)^+ kappa  (b, k)
    c = np.einsum("bkm,bm->bk", E, inv * np.einsum("bkm,bk->bm", E, kap))
    G = None
    if rank is not None and rank < min(k, d):
        # L = E diag(sqrt(h)); C = L^T (Rt Rt^T) L
        T = Rt @ Rt.swapaxes(1, 2)
        L = E * np.sqrt(h)[:, None, :]
        C = L.swapaxes(1, 2) @ T @ L
        nu, Phi = np.linalg.eigh(C)
        nu = nu[:, ::-1][:, :rank]
        Phi = Phi[:, :, ::-1][:, :, :rank]
        good = nu > rcond * np.maximum(nu[:, :1], 0.0)
        scale = np.where(good, 1.0 / np.sqrt(np.where(good, nu, 1.0)), 0.0)
        G = (L @ Phi) * scale[:, None, :]  # (b, k, r): V_r = Rt^T G
        # t = Rt^T c; projected t = V_r V_r^T t = Rt^T G G^T T c
        c = np.einsum("bkr,br->bk", G, np.einsum("bkr,bk->br", G, np.einsum("bkm,bm->bk", T, c)))
    t = np.einsum("bkd,bk->bd", Rt, c)
    DT = None
    if return_maps:
        # D^T = Xt^T (K+lam)^+ Rt, then projected on V_r
        Kp = (E * inv[:, None, :]) @ E.swapaxes(1, 2)
        DT = Xt.swapaxes(1, 2) @ Kp @ Rt
        if G is not None:
            V = Rt.swapaxes(1, 2) @ G
            DT = DT @ V @ V.swapaxes(1, 2)
    return t, DT, ill


def _exponents(A, axes):
    """Per-panel binary exponents ``e`` with the largest magnitude of ``A`` over ``axes``
    in ``[2**(e-1), 2**e)`` (0 for an all-zero panel)."""
    top = np.max(np.abs(A), axis=axes)
    return np.frexp(np.where(top > 0, top, 1.0))[1]


def _linear_svd(Xt, Rt, xi, lam, rcond, rank, return_maps):
    """:func:`fit_linear`'s solve from the thin SVD ``Xt = U S V^T`` (the condition
    number of the panel, not its square): ``c = U diag(s / (s^2 + lam)) V^T x_i`` on
    the singular values above ``rcond`` of the largest, and the rank-r projection from
    the SVD of ``Rt^T U diag(s / sqrt(s^2 + lam))``.  ``(t, DT)`` as
    :func:`_linear_gram`'s; 2 to 8 times its cost per panel.

    Each panel, its query and its targets are scaled by powers of two of their own
    (largest entry in [1/2, 1); ``lam`` by the square of the panel's) and the
    exponents applied to the results at the end, exactly: a panel far below the scale
    of X (a cluster 1e-310 times the rest, with subnormal singular values) made
    ``1 / s`` inf, and its fits NaN; and a query beside such a panel (a large state
    whose nearest neighbors are tiny ones) has a ``c`` beyond the float range where
    ``t = Rt^T c`` is not."""
    k, d = Xt.shape[1:]
    eX, eq, eR = _exponents(Xt, (1, 2)), _exponents(xi, 1), _exponents(Rt, (1, 2))
    Xs = np.ldexp(Xt, -eX[:, None, None])
    xs = np.ldexp(xi, -eq[:, None])
    Rs = np.ldexp(Rt, -eR[:, None, None])
    with np.errstate(over="ignore"):
        lam_b = np.ldexp(np.full(eX.shape, float(lam)), -2 * eX)[:, None]
    U, sv, Vt = np.linalg.svd(Xs, full_matrices=False)
    keep = sv > rcond * sv[:, :1]
    # s / (s^2 + lam) as 1 / (s + lam / s), and s / sqrt(s^2 + lam) as 1 / sqrt(1 +
    # (lam / s) / s): an infinite ridge (lam_b beyond the float range) gives 0
    sk = np.where(keep, sv, 1.0)
    with np.errstate(over="ignore", invalid="ignore"):
        r = np.where(keep, lam_b / sk, 0.0)
        f = np.where(keep, 1.0 / (sk + r), 0.0)
        hq = np.where(keep, 1.0 / np.sqrt(1.0 + r / sk), 0.0)
    c = np.einsum("bkm,bm->bk", U, f * np.einsum("bmd,bd->bm", Vt, xs))
    t = np.einsum("bkd,bk->bd", Rs, c)  # t = 2**(eR + eq - eX) Rs^T c
    V = None
    if rank is not None and rank < min(k, d):
        M = Rs.swapaxes(1, 2) @ (U * hq[:, None, :])  # (b, d, m), up to the factor 2**eR
        P, sig, _ = np.linalg.svd(M, full_matrices=False)
        good = sig[:, :rank] > rcond * np.maximum(sig[:, :1], 0.0)
        V = P[:, :, :rank] * good[:, None, :]  # V_r, orthonormal columns (or 0)
        t = np.einsum("bdr,br->bd", V, np.einsum("bdr,bd->br", V, t))
    with np.errstate(over="ignore"):  # (only where the result itself is beyond the range)
        t = np.ldexp(t, (eR + eq - eX)[:, None])
    DT = None
    if return_maps:
        # D^T = V diag(1 / (s + lam / s)) U^T Rt = 2**(eR - eX) V diag(f) U^T Rs
        DT = Vt.swapaxes(1, 2) @ (f[:, :, None] * (U.swapaxes(1, 2) @ Rs))
        if V is not None:
            DT = DT @ V @ V.swapaxes(1, 2)
        with np.errstate(over="ignore"):
            DT = np.ldexp(DT, (eR - eX)[:, None, None])
    return t, DT


def fit_linear(X, Y, nbr, w, lam, identity_prior, rank, chunk, return_maps=False, tick=None, ex=0):
    """Full ridge (``rank=None``) or reduced-rank ridge (rank ``r``) local fits.

    Kernel (dual) form, exact for any k and d: with weighted panels
    ``Xt = W^{1/2} X_N`` and ``Rt = W^{1/2} R_N`` (k x d) and ``K = Xt Xt^T``,

        D^T = Xt^T (K + lam I)^+ Rt        (minimum-norm when lam = 0),

    so ``D x_i = Rt^T (K + lam I)^+ Xt x_i``.  The rank-r fit (ridge reduced-rank
    regression, Mukherjee & Zhu 2011) projects the ridge solution on the top-r right
    singular vectors of the augmented fitted values, whose Gram matrix is
    ``Rt^T H Rt`` with ``H = K (K + lam I)^+``; with ``H = L L^T`` these are
    ``V_r = Rt^T L Phi_r nu_r^{-1/2}`` from the k x k eigenproblem of
    ``L^T Rt Rt^T L``.  Cost O(k^2 d + k^3) per token, no d x d matrix.  Panels
    whose Gram matrix is too ill-conditioned for its eigenproblem
    (:data:`_GRAM_MIN_RATIO`) are solved again from their SVD (:func:`_linear_svd`).
    """
    d = X.shape[1]
    n, k = nbr.shape  # the queries are the first n rows of X
    fitted = np.empty((n, d), dtype=np.float64)
    maps = np.empty((n, d, d), dtype=np.float64) if return_maps else None
    rcond = _RCOND_SCALE * max(k, d) * _EPS
    sw = np.sqrt(w)
    weighted = not np.all(w == 1.0)
    # reused panel buffers: no fresh (chunk, k, d) allocation per chunk
    bufX = np.empty((min(chunk, n) * k, d))
    bufR = np.empty((min(chunk, n) * k, d))
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        b = e - s
        idx = nbr[s:e]
        Xt = np.take(X, idx.ravel(), axis=0, out=bufX[: b * k], mode="clip").reshape(b, k, d)
        Rt = np.take(Y, idx.ravel(), axis=0, out=bufR[: b * k], mode="clip").reshape(b, k, d)
        if ex:
            np.ldexp(Xt, -ex, out=Xt)
            np.ldexp(Rt, -ex, out=Rt)
        if identity_prior:
            Rt -= Xt
        if weighted:
            ws = sw[s:e, :, None]
            Rt *= ws
            Xt *= ws
        xi = _rows(X, ex, s, e)
        t, DT, ill = _linear_gram(Xt, Rt, xi, lam, rcond, rank, return_maps)
        if ill.any():
            t[ill], DT_ill = _linear_svd(Xt[ill], Rt[ill], xi[ill], lam, rcond, rank, return_maps)
            if return_maps:
                DT[ill] = DT_ill
        fitted[s:e] = (xi + t) if identity_prior else t
        if return_maps:
            A = DT.swapaxes(1, 2)
            if identity_prior:
                A = A + np.eye(d)
            maps[s:e] = A
        if tick is not None:
            tick()  # between chunks: progress, and where an interrupt lands
    return fitted, maps


# ------------------------------------------------------------------ orthogonal


def _householder(v):
    """Batched reflections ``H = I - beta u u^T`` with ``H v = sigma |v| e_1``: returns
    ``u`` (b, m), ``beta`` (b,) and the signs ``sigma`` (b,) (``-sign(v_0)``, the stable
    choice); ``beta = sigma = 0`` (the identity) for a zero ``v``.  Applied as rank-one
    updates (:func:`_reflect_rows`, :func:`_reflect_cols`), O(m^2) each, not as products."""
    nv = np.linalg.norm(v, axis=1)
    live = nv > 0
    u = v / np.where(live, nv, 1.0)[:, None]
    sign = np.where(u[:, 0] >= 0, 1.0, -1.0)
    u[:, 0] += sign
    uu = np.einsum("bm,bm->b", u, u)
    beta = np.where(live, 2.0 / np.where(live, uu, 1.0), 0.0)
    return u, beta, np.where(live, -sign, 0.0)


def _reflect_rows(u, beta, A):
    """``H A`` for the reflections ``H = I - beta u u^T`` (batched)."""
    return A - (beta[:, None] * u)[:, :, None] * np.einsum("bm,bmn->bn", u, A)[:, None, :]


def _reflect_cols(A, u, beta):
    """``A H`` for the reflections ``H = I - beta u u^T`` (batched)."""
    return A - np.einsum("bmn,bn->bm", A, u)[:, :, None] * (beta[:, None] * u)[:, None, :]


def polar_near_identity(U, s, Vt, tol):
    """Orthogonal maximizer of ``tr(Q^T M)`` for ``M = U diag(s) V^T``; ties broken by
    maximal ``tr(Q)``.

    With ``r`` singular values above ``tol`` (b,), every maximizer is
    ``U_1 V_1^T + U_2 Z V_2^T`` (Z orthogonal); the one closest to the identity takes
    ``Z = b a^T`` from the SVD ``V_2^T U_2 = a c b^T``.  This is the limit of the
    identity-prior solution as the ridge goes to 0.
    """
    V = Vt.swapaxes(-1, -2)
    m = U.shape[-1]
    r = np.sum(s > tol[:, None], axis=1)
    Q = np.empty_like(U)
    for rv in np.unique(r):
        sel = np.nonzero(r == rv)[0]
        U1, V1 = U[sel, :, :rv], V[sel, :, :rv]
        Qs = U1 @ V1.swapaxes(1, 2)
        if rv < m:
            U2, V2 = U[sel, :, rv:], V[sel, :, rv:]
            a, _, bt = np.linalg.svd(V2.swapaxes(1, 2) @ U2)
            Qs = Qs + U2 @ (bt.swapaxes(1, 2) @ a.swapaxes(1, 2)) @ V2.swapaxes(1, 2)
        Q[sel] = Qs
    return Q


def fit_orthogonal(X, Y, nbr, w, lam, identity_prior, scaled, chunk, return_maps=False, tick=None, ex=0):
    """Weighted (scaled) orthogonal Procrustes per token, reduced to span(X_N, Y_N).

    ``M = sum_j w_j y_j x_j^T`` has rank <= k, so with an orthonormal basis ``P`` of
    the span of the 2k neighbor vectors (batched QR; ``P = I`` when ``2k >= d``) the
    problem is exactly an m-dimensional one, ``M_s = P^T M P + lam A0_s``, and
    ``Q = P Q_s P^T + (I - P P^T)``: the identity on the complement, which is the
    exact solution for the identity prior and the tie-break towards the identity for
    lam = 0 or the zero prior (whose penalty is constant on orthogonal matrices).
    Scaled class: ``s = tr(Q^T (M + lam A0)) / (sum_j w_j ||x_j||^2 + lam d)``.

    The panel's common component is split off exactly: with weighted means
    ``xbar, ybar`` and total weight ``W``, ``M = N + W ybar xbar^T`` where ``N`` is
    formed from the centered rows (plus the prior).  In the bases of two reflections
    taking ``xbar`` and ``ybar`` to the first axis the rank-one term is one entry, and
    the SVD of that graded matrix keeps ``N``'s small singular values to ``N``'s own
    rounding; formed directly, ``M`` held them only to ``eps ||M||``: states with a
    common offset 1e6 times their spread lost them below the zero threshold, and the
    fit took the tie-break's rotation (objective up to 2.6 times the optimum).  The
    means are taken before the projection onto ``P``, so that the centered rows are
    exact where the offset dominates.  A singular value counts as zero below
    ``rcond ||N||_F`` plus what the means' rounding leaves in N,
    ``4 (m + 4)^2 eps^2 W |xbar| |ybar|`` (a common shift of the centered rows cancels
    in N to that second-order term): neighbors that are copies of one row leave N
    nothing but it (1e-32), which must not pin the rotation.
    """
    d = X.shape[1]
    n, k = nbr.shape  # the queries are the first n rows of X
    fitted = np.empty((n, d), dtype=np.float64)
    scale_out = np.ones(n, dtype=np.float64)
    maps = np.empty((n, d, d), dtype=np.float64) if return_maps else None
    full_space = 2 * k >= d
    rcond = _RCOND_SCALE * max(2 * k, d) * _EPS
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        idx = nbr[s:e]
        Xn = X[idx]
        Yn = Y[idx]
        wn = w[s:e]
        # a panel far from the one scaling (_FAR) is scaled by a power of two of its
        # own (Q and the scale do not change; lam by its square): products of a
        # cluster 2**-540 times the rest underflowed, and its fit was the tie-break's.
        # Its scale is that of the rows in the problem (weights > 0), X and Y together
        top = np.where(wn > 0, np.maximum(row_tops(Xn), row_tops(Yn)), 0.0).max(axis=1)
        eP = far_exponents(np.ldexp(top, -ex)) if ex else far_exponents(top)
        if ex or eP.any():
            sh = -(ex + eP)[:, None, None]
            np.ldexp(Xn, sh, out=Xn)
            np.ldexp(Yn, sh, out=Yn)
        lam_b = _panel_ridge(lam, eP)
        xi = _rows(X, ex, s, e)
        # the weighted means are split off before any projection: a row minus a mean
        # it is close to is exact (Sterbenz), where projecting the raw rows would
        # round each by eps |xbar|, far above their spread under a large offset
        W = wn.sum(axis=1)
        Wd = np.where(W > 0, W, 1.0)[:, None]  # all weights 0: M = 0, any mean does
        xbar = np.einsum("bk,bkd->bd", wn, Xn) / Wd
        ybar = np.einsum("bk,bkd->bd", wn, Yn) / Wd
        xc = Xn - xbar[:, None, :]
        yc = Yn - ybar[:, None, :]
        if full_space:
            xis = xi
            m = d
        else:
            Z = np.concatenate([Xn, Yn], axis=1).swapaxes(1, 2)  # (b, d, 2k)
            P, _ = np.linalg.qr(Z)  # (b, d, 2k), orthonormal columns
            del Z
            m = P.shape[2]
            xc, yc = xc @ P, yc @ P
            xbar = np.einsum("bd,bdm->bm", xbar, P)
            ybar = np.einsum("bd,bdm->bm", ybar, P)
            xis = np.einsum("bd,bdm->bm", xi, P)
        N = (yc * wn[:, :, None]).swapaxes(1, 2) @ xc  # (b, m, m)
        del xc, yc
        nx, ny = np.linalg.norm(xbar, axis=1), np.linalg.norm(ybar, axis=1)
        # what N cannot resolve beyond its own rounding: the means' rounding, a common
        # shift of the centered rows that cancels in N but for W e_y e_x^T; neighbors
        # that are copies of one row leave N nothing but that (1e-32)
        noise = 4.0 * (m + 4) ** 2 * _EPS * _EPS * W * nx * ny
        if identity_prior and lam:
            N = N + lam_b[:, None, None] * np.eye(m)
        uy, by, sy = _householder(ybar)
        ux, bx, sx = _householder(xbar)
        Mr = _reflect_cols(_reflect_rows(uy, by, N), ux, bx)  # M in the reflected bases, but for its (0, 0) entry
        Mr[:, 0, 0] += sy * sx * W * ny * nx
        U, sv, Vt = np.linalg.svd(Mr)
        Q = polar_near_identity(_reflect_rows(uy, by, U), sv, _reflect_cols(Vt, ux, bx),
                                rcond * np.linalg.norm(N, axis=(1, 2)) + noise)
        qx = np.einsum("bmn,bn->bm", Q, xis)
        if full_space:
            out = qx
        else:
            out = xi - np.einsum("bdm,bm->bd", P, xis) + np.einsum("bdm,bm->bd", P, qx)
        if scaled:
            # tr(Q^T M) = tr(Q^T N) + W ybar^T Q xbar
            tr = np.einsum("bmn,bmn->b", Q, N) + W * np.einsum("bm,bmn,bn->b", ybar, Q, xbar)
            if identity_prior and lam:
                tr = tr + lam_b * (d - m)
            den = np.einsum("bk,bkd,bkd->b", wn, Xn, Xn) + lam_b * d
            with np.errstate(divide="ignore", invalid="ignore"):
                sc = np.where(den > 0, np.maximum(tr, 0.0) / np.where(den > 0, den, 1.0), 1.0)
            scale_out[s:e] = sc
            out = out * sc[:, None]
        fitted[s:e] = out
        if return_maps:
            if full_space:
                A = Q
            else:
                A = np.eye(d) - P @ P.swapaxes(1, 2) + P @ Q @ P.swapaxes(1, 2)
            maps[s:e] = A * scale_out[s:e, None, None]
        if tick is not None:
            tick()
    return fitted, scale_out, maps


# ----------------------------------------------------------------------- MLP


# Beyond this |z| the tanh of GELU is +-1 exactly in float64 (its argument exceeds 4e7):
# the cubic is evaluated on z clipped here, where it cannot overflow (it did beyond 5.6e102,
# and 0 * inf made the derivative NaN); values inside are unchanged bit for bit.
_GELU_SATURATED = 1e3


def gelu(z):
    """tanh approximation of GELU and its derivative."""
    c = np.sqrt(2.0 / np.pi)
    zc = np.clip(z, -_GELU_SATURATED, _GELU_SATURATED)
    u = c * (zc + 0.044715 * zc**3)
    t = np.tanh(u)
    g = 0.5 * z * (1.0 + t)
    dg = 0.5 * (1.0 + t) + 0.5 * zc * (1.0 - t * t) * c * (1.0 + 3 * 0.044715 * zc * zc)
    return g, dg


def activation(name, z):
    if name == "gelu":
        return gelu(z)
    if name == "relu":
        return np.maximum(z, 0.0), (z > 0).astype(z.dtype)
    t = np.tanh(z)
    return t, 1.0 - t * t


def mlp_forward(params, Xs, act):
    W1, b1, W2, b2 = params
    z = Xs @ W1 + b1
    a, da = activation(act, z)
    return a @ W2 + b2, (z, a, da)


def train_mlp(Xs, T, hidden, act, epochs, lr, batch, weight_decay, rng, Xv=None, Tv=None, tick=None):
    """Adam on the mean squared error ``mean ||MLP(x) - t||^2 / d`` (standardized data).

    ``tick()`` is called after each epoch (progress reports).
    """
    n, d = Xs.shape
    W1 = rng.standard_normal((d, hidden)) / np.sqrt(d)
    b1 = np.zeros(hidden)
    W2 = rng.standard_normal((hidden, d)) * (0.1 / np.sqrt(hidden))
    b2 = np.zeros(d)
    params = [W1, b1, W2, b2]
    m1 = [np.zeros_like(p) for p in params]
    m2 = [np.zeros_like(p) for p in params]
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    step = 0
    hist_train = np.empty(epochs)
    hist_test = np.full(epochs, np.nan)
    batch = n if batch is None else batch
    # overflow in a diverging run is reported below as a ValueError naming the learning
    # rate, not as a stream of RuntimeWarnings
    with np.errstate(over="ignore", invalid="ignore"):
        for ep in range(epochs):
            order = rng.permutation(n) if batch < n else np.arange(n)
            tot = 0.0
            for s in range(0, n, batch):
                ib = order[s : s + batch]
                xb, tb = Xs[ib], T[ib]
                out, (z, a, da) = mlp_forward(params, xb, act)
                err = out - tb
                nb = xb.shape[0]
                tot += float(np.sum(err * err))
                g_out = err * (2.0 / (nb * d))
                gW2 = a.T @ g_out
                gb2 = g_out.sum(0)
                g_z = (g_out @ params[2].T) * da
                gW1 = xb.T @ g_z
                gb1 = g_z.sum(0)
                grads = [gW1 + weight_decay * params[0], gb1, gW2 + weight_decay * params[2], gb2]
                step += 1
                for p, g, u, v in zip(params, grads, m1, m2):
                    u *= beta1
                    u += (1 - beta1) * g
                    v *= beta2
                    v += (1 - beta2) * g * g
                    uh = u / (1 - beta1**step)
                    vh = v / (1 - beta2**step)
                    p -= lr * uh / (np.sqrt(vh) + eps)
            hist_train[ep] = tot / (n * d)
            if not (math.isfinite(tot) and all(np.isfinite(p).all() for p in params)):
                # an overflowing step (too large a learning rate) leaves NaN weights, which
                # would come back as NaN fits and losses, or as an error about X and Y
                raise ValueError(
                    f"learning_rate must be small enough for the MLP's training to converge, got {lr!r} "
                    f"instead (its loss or weights were not finite after epoch {ep + 1} of {epochs})."
                )
            if Xv is not None and Xv.shape[0]:
                ov, _ = mlp_forward(params, Xv, act)
                hist_test[ep] = float(np.mean((ov - Tv) ** 2))
            if tick is not None:
                tick()
    return params, hist_train, hist_test


# ------------------------------------------------------------ class dispatch


def fit_class(X64, Y64, ex, idx, w, cls, rank, ridge, ident, chunk, return_maps, tick=None):
    """``(fitted, coefficients, maps)`` of the class ``cls`` for the queries ``idx``."""
    n = idx.shape[0]
    d = X64.shape[1]
    coef = maps = None
    if cls in ("diagonal", "psd_diagonal"):
        a0 = 1.0 if ident else 0.0
        fitted, coef = fit_diagonal(X64, Y64, idx, w, ridge, a0, cls == "psd_diagonal", chunk, tick, ex)
        if return_maps:
            maps = np.zeros((n, d, d))
            maps[:, np.arange(d), np.arange(d)] = coef
    elif cls in ("low_rank", "full"):
        fitted, maps = fit_linear(X64, Y64, idx, w, ridge, ident, rank, chunk, return_maps, tick, ex)
    else:
        fitted, sc, maps = fit_orthogonal(
            X64, Y64, idx, w, ridge, ident, cls == "scaled_orthogonal", chunk, return_maps, tick, ex
        )
        coef = sc if cls == "scaled_orthogonal" else None
    return fitted, coef, maps


# ------------------------------------------------------------ per-row metrics
#
# Every function here works row by row (or entry by entry), so a block of rows gives
# the same bits as the whole array: the Dask engine runs them on token blocks.
#
# Squared norms are taken from rows scaled by their own power of two where they are far
# from the panels' one scaling (row_scaled), and kept as pairs (n2, e) meaning
# n2 * 4**e: the squares of a token 2**-540 times smaller than the largest entry of X
# and Y underflowed to 0 (NaN relative errors, cosines and projections for a
# representable answer).  Rows within 2**+-_FAR are used as they are: the same bits.


def row_inner(a, b):
    """``sum_c a[i, c] b[i, c]`` for every row ``i``."""
    return np.einsum("ij,ij->i", a, b)


def row_scaled(V):
    """``(W, e)``: ``W_i = V_i 2**-e_i`` with ``e_i`` from :func:`far_exponents` (0 for
    rows within ``2**+-_FAR`` of the panels' scale, which are ``V``'s own: the same bits),
    so ``|V_i|^2 = |W_i|^2 4**e_i`` and no square of ``W`` underflows beyond a rounding
    of its row's norm; every ratio, cosine and angle of one token's vectors is the same
    from ``W``."""
    e = far_exponents(row_tops(V))
    if not e.any():
        return V, e
    return np.ldexp(V, -e[:, None]), e


def cosine(ab, na, nb):
    """Clipped ``ab / (na nb)``; NaN where a norm is zero."""
    den = na * nb
    with np.errstate(divide="ignore", invalid="ignore"):
        c = np.where(den > 0, ab / np.where(den > 0, den, 1.0), np.nan)
    return np.clip(c, -1.0, 1.0)


def angle(a, b, na, nb, c, block=4096):
    """Angle in degrees; NaN for a zero vector.

    ``arccos(c)`` where ``|c| < 0.99`` (there its error is below 1e-14 degrees);
    elsewhere Kahan's ``2 atan2(|u - v|, |u + v|)`` on the unit vectors, which stays
    accurate near 0 and 180 degrees where arccos of a rounded cosine does not (those
    rows only, ``block`` at a time).
    """
    out = np.full(c.shape, np.nan)
    ok = np.isfinite(c)
    mid = ok & (np.abs(c) < 0.99)
    out[mid] = np.degrees(np.arccos(c[mid]))
    rows = np.flatnonzero(ok & ~mid)
    for s in range(0, rows.size, block):
        r = rows[s : s + block]
        u = a[r] / na[r, None]
        v = b[r] / nb[r, None]
        dm = u - v
        u += v
        out[r] = np.degrees(2.0 * np.arctan2(np.sqrt(row_inner(dm, dm)), np.sqrt(row_inner(u, u))))
    return out


def ratio(num, den):
    """``num / den`` where ``den > 0``, NaN elsewhere."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)


def norm_ratio(a2, ea, b2, eb):
    """Per-token ``|a_i| / |b_i|`` from the pairs ``(a2, ea)`` and ``(b2, eb)`` of
    :func:`row_scaled` squared norms and exponents; NaN where ``b_i = 0`` (inf only
    beyond the float64 range)."""
    with np.errstate(over="ignore"):
        return np.ldexp(ratio(np.sqrt(a2), np.sqrt(b2)), (ea - eb).astype(np.int64))


def token_record(delta, tau, rho):
    """The (13, n) per-token record of one block of (scaled) delta, tau and rho.

    Rows 0-2: the squared norms of the row-scaled delta, tau, rho (:func:`row_scaled`);
    3-5: their exponents (float); 6: the relative error ``|rho_i| / |delta_i|``; 7-9:
    the cosines and 10-12: the angles of (delta, tau), (rho, tau) and (rho, delta).
    """
    (dv, ed), (tv, et), (rv, er) = row_scaled(delta), row_scaled(tau), row_scaled(rho)
    dn2, tn2, rn2 = row_inner(dv, dv), row_inner(tv, tv), row_inner(rv, rv)
    dn, tn, rn = np.sqrt(dn2), np.sqrt(tn2), np.sqrt(rn2)
    c_dt = cosine(row_inner(dv, tv), dn, tn)
    c_rt = cosine(row_inner(rv, tv), rn, tn)
    c_rd = cosine(row_inner(rv, dv), rn, dn)
    return np.stack([
        dn2, tn2, rn2, ed, et, er, norm_ratio(rn2, er, dn2, ed), c_dt, c_rt, c_rd,
        angle(dv, tv, dn, tn, c_dt), angle(rv, tv, rn, tn, c_rt), angle(rv, dv, rn, dn, c_rd),
    ])


def norm_record(v, U=None):
    """``[|w_i|^2, e_i]`` of the row-scaled ``v`` (:func:`row_scaled`), preceded by the
    squared norms ``|U^T w_i|^2`` of their projections on the columns of ``U`` when it
    is given: a (2, n) or (3, n) record."""
    w, e = row_scaled(v)
    rows = [row_inner(w, w), e]
    if U is not None:
        p = w @ U
        rows.insert(0, row_inner(p, p))
    return np.stack(rows)


def scaled_sum(n2, e):
    """``(s, E)`` with ``sum_i n2_i 4**e_i = s 4**E``: every term is taken relative to
    the largest exponent ``E`` of a nonzero term, so the sum neither underflows nor
    overflows."""
    nz = n2 > 0
    if not nz.any():
        return 0.0, 0
    E = int(e[nz].max())
    return float(np.sum(np.ldexp(n2, (2 * (e - E)).astype(np.int64)))), E


def energy(num, den):
    """``num / den`` of two :func:`scaled_sum` pairs, as a float; NaN where ``den`` is 0."""
    (sn, en), (sd, ed) = num, den
    if not sd > 0:
        return float("nan")
    with np.errstate(over="ignore"):
        return float(np.ldexp(sn / sd, 2 * (en - ed)))


def largest_norm(rec):
    """The largest row norm of delta, tau and rho in a :func:`token_record`."""
    with np.errstate(over="ignore"):
        return float(np.max(np.ldexp(np.sqrt(rec[0:3]), rec[3:6].astype(np.int64)), initial=0.0))


def scaled_r(T):
    """``(R, E)``: the R factor (:func:`qr_r`) of ``T * 2**-E``, with ``E`` the power of
    two that brings the largest entry to [1/2, 1) where that is beyond ``2**+-_FAR``
    (the factor of updates far smaller than the panels' scale underflowed to 0).

    The subspace of tau comes from the SVD of R, not from the eigenvalues of the Gram
    matrix ``T^T T``: those hold singular values only down to ``sqrt(u)`` of the
    largest (tau of one dominant direction, 2e5, had its next ones, 9e-4, off by 3.5x,
    and dependent on the Dask chunking)."""
    E = int(far_exponents(np.max(row_tops(T), initial=0.0))) if T.size else 0
    return qr_r(np.ldexp(T, -E) if E else T), E


def merge_scaled_r(parts):
    """The :func:`scaled_r` pair of the rows behind the pairs ``parts`` (TSQR)."""
    E = max((Eb for R, Eb in parts if R.any()), default=0)
    return merge_r([np.ldexp(R, Eb - E) for R, Eb in parts]), E


def subspace(R, E, rank):
    """``(U, s)``: the top ``rank`` right singular vectors of the rows behind the
    :func:`scaled_r` pair ``(R, E)`` (d x rank) and their singular values (scaled back
    by ``2**E``; zeros past the number of rows)."""
    from ._threads import blas_single_thread

    d = R.shape[1]
    with blas_single_thread():
        _, s, Vt = np.linalg.svd(R, full_matrices=True)
    s = np.concatenate([s, np.zeros(d - s.shape[0])])
    return np.ascontiguousarray(Vt[:rank].T), np.ldexp(s[:rank], E)


def exponent_of(top: float) -> int:
    """The ``e`` with ``top * 2**-e`` in [1/2, 1), for ``top`` the largest magnitude of
    the panels (0 when it is 0): the one power-of-two scaling of the NumPy and the Dask
    fits."""
    return math.frexp(top)[1] if top > 0 else 0


def neighbors_in_units_of_x(res, e, metric, standardize):
    """``(indices, distances)`` of a :class:`refgeo.KNNResult` of the rows ``X 2**-e``
    as int64 and float64 (N, k) arrays, the Euclidean distances scaled back to the
    units of ``X`` (exactly: a power of two; the standardized and cosine metrics are
    scale-free).  The one ending of the NumPy and the Dask neighbor searches."""
    dist = np.asarray(res.distances, dtype=np.float64)
    if e and not standardize and metric == "euclidean":
        dist = np.ldexp(dist, e)
    return np.asarray(res.indices, dtype=np.int64), dist


def unit_rows(Z):
    """Rows of float64 ``Z`` scaled to unit norm (zero rows stay zero), for the cosine metric.

    Rows are divided by their largest entry first: the squared norm of a row much
    smaller than the largest one would underflow.
    """
    amax = np.max(np.abs(Z), axis=1)
    Z = Z / np.where(amax > 0, amax, 1.0)[:, None]
    nrm = np.sqrt(row_inner(Z, Z))
    return Z / np.where(nrm > 0, nrm, 1.0)[:, None]


def standardized(Z, mu, sd):
    """``(Z - mu) / sd`` with a zero spread counting as one."""
    return (Z - mu) / np.where(sd > 0, sd, 1.0)


# ------------------------------------------------------------ global baselines


def qr_r(A):
    """The R factor of ``A`` (``(min(n, m), m)`` for ``A`` of shape ``(n, m)``): its Gram
    matrix is ``A^T A``, so the factors of row blocks merge by stacking them and
    factoring again (TSQR), in any grouping, to rounding."""
    from ._threads import blas_single_thread

    if A.shape[0] == 0:
        return np.zeros((0, A.shape[1]))
    with blas_single_thread():
        return np.linalg.qr(A, mode="r")


def merge_r(parts):
    """The R factor of the rows behind the R factors ``parts`` (:func:`qr_r`)."""
    return qr_r(np.vstack(parts))


def baseline_panel(X, Y):
    """``[1 | X | Y]``: the rows whose R factor (:func:`qr_r`, merged with
    :func:`merge_r`) :func:`baseline_maps` takes.

    The column of ones comes first, so that the factor's first row holds the column
    sums (``sqrt(n)`` times the means) and the rest is the R factor of the centered
    rows: the Procrustes baseline needs the common component split off (see
    :func:`baseline_maps`).
    """
    return np.hstack([np.ones((X.shape[0], 1)), X, Y])


def baseline_maps(R, n_rows, ridge, identity_prior):
    """Transposed maps ``(A_linear^T, A_procrustes^T)`` from the R factor of
    ``[1 | X | Y]`` (:func:`baseline_panel`, :func:`qr_r`; ``(m, 1 + 2d)``).

    With ``R_x`` and ``R_y`` its columns of X and Y, ``X^T X = R_x^T R_x`` and
    ``X^T Y = R_x^T R_y``.

    Linear: the ridge least squares ``min ||R_x D^T - T||^2 + lam ||D||^2`` with
    ``T = R_y - R_x A_0^T`` (``[X | Y] = Q R``, so ``||Y - X A_0^T - X D^T|| = ||T - R_x
    D^T||``), solved from the SVD ``R_x = U S V^T``: ``D^T = V diag(s / (s^2 + lam))
    U^T T``, minimum-norm when ``lam = 0`` (singular values below ``max(n_rows, 2 d)
    eps`` of the largest dropped, as ``numpy.linalg.lstsq`` drops them: the rounding
    of the factorization grows with the rows, and a rank-deficient X kept directions
    of rounding noise at ``2 d eps``, whose size depended on the row blocks).  Why not the normal equations ``(X^T X + lam I) D^T = X^T R``:
    they square the condition number of X, which for hidden states with a large
    common component (a mean 1e8 times their spread) is 1e16, and the map of an exactly
    linear layer left all of its update (energy fraction 0.9998).

    Procrustes: ``s Q`` with ``Q = polar(M)``, ``M = Y^T X``,
    ``s = ||M||_* / ||X||_F^2``.  ``M = N + n ybar xbar^T`` with ``N`` the
    cross-product of the centered rows, read off the factor: its first row is
    ``sqrt(n) [1, xbar, ybar]`` (up to one sign) and the rows below are the centered
    rows' factor.  ``M`` formed whole holds its small singular values only to
    ``eps ||M||``, ``eps (offset / spread)^2`` relative to their size: with a common
    offset 3e7 times the spread the Procrustes map was far from optimal (energy
    fraction 0.89 against 0.84; above 1 at 1e8).  As in :func:`fit_orthogonal` the
    rank-one term becomes one entry in the bases of two reflections taking ``xbar`` and
    ``ybar`` to the first axis, and the SVD of that graded matrix keeps ``N``'s small
    singular values.
    """
    from ._threads import blas_single_thread

    d = (R.shape[1] - 1) // 2
    Rx, Ry = R[:, 1 : 1 + d], R[:, 1 + d :]
    T = Ry - Rx if identity_prior else Ry
    with blas_single_thread():
        U, sv, Vt = np.linalg.svd(Rx, full_matrices=False)
    if ridge > 0:
        f = sv / (sv * sv + ridge)
    else:
        keep = sv > max(int(n_rows), 2 * d) * _EPS * (float(sv[0]) if sv.size else 0.0)
        f = np.where(keep, 1.0 / np.where(keep, sv, 1.0), 0.0)
    DT = Vt.T @ (f[:, None] * (U.T @ T))
    AT = DT + np.eye(d) if identity_prior else DT
    # M = N + v w^T: v = sqrt(n) ybar, w = sqrt(n) xbar (one sign on both)
    N = Ry[1:].T @ Rx[1:] if R.shape[0] > 1 else np.zeros((d, d))
    v, w = (Ry[0], Rx[0]) if R.shape[0] else (np.zeros(d), np.zeros(d))
    uy, by, sy = _householder(v[None])
    ux, bx, sx = _householder(w[None])
    Mr = _reflect_cols(_reflect_rows(uy, by, N[None]), ux, bx)
    Mr[0, 0, 0] += sy[0] * sx[0] * float(np.linalg.norm(v)) * float(np.linalg.norm(w))
    with blas_single_thread():
        U2, sv2, Vt2 = np.linalg.svd(Mr)
    Q = _reflect_rows(uy, by, U2) @ _reflect_cols(Vt2, ux, bx)
    den = float(np.sum(Rx * Rx))
    sc = float(np.sum(sv2)) / den if den > 0 else 1.0
    return AT, (sc * Q[0]).T


# ------------------------------------------------- reproducible column sums
#
# The standardization of the neighbor search needs column means and spreads.  A
# floating-point sum depends on the order of its terms, so a plain sum over row blocks
# would change the standardized rows, and with them the neighbors at ties, with the
# chunking.  These sums are binned instead: every entry is split exactly into slices
# on a fixed grid of exponents (multiples of ``W`` bits), and the slices of one bin,
# all multiples of the bin's quantum, add up exactly in any order (``W`` leaves room
# for N terms in 53 bits).  A block's bins merge exactly with any other block's, so
# the sum is the same bits for every partition of the rows; its error against the
# exact sum is below ``N 2**(t - BINS W)`` for entries below ``2**t``, then one
# rounding (math.fsum of the bins).

BINS = 4  # slices per entry: 4 W >= 100 bits below the largest entry for N < 2**20
_NO_BIN = -(2**20)  # the top bin of an all-zero column: below every real one


def bin_width(n_total: int) -> int:
    """Bits per bin ``W`` for sums of ``n_total`` terms: ``n_total 2**W < 2**52``."""
    return max(1, 52 - int(n_total).bit_length())


def binned_sums(A, width):
    """``(top, bins)``: the column sums of float64 ``A`` (entries below 2**960 in
    magnitude) in ``BINS`` exact bins per column; bin ``j`` of column ``c`` holds
    multiples of ``2**((top[c] - j) * width)``."""
    n, d = A.shape
    amax = np.max(np.abs(A), axis=0) if n else np.zeros(d)
    ex = np.frexp(amax)[1].astype(np.int64)  # amax < 2**ex
    # the top bin holds |entries| <= 2**((top + 1) width)
    top = np.where(amax > 0, -((-ex) // width) - 1, _NO_BIN)
    bins = np.zeros((BINS, d))
    r = np.array(A, dtype=np.float64, copy=True)
    for j in range(BINS):
        qe = (top - j) * width  # quantum exponent of this bin
        # sigma = 1.5 * 2**(qe + 52): fl(sigma + r) - sigma is r rounded to a multiple of
        # 2**qe (|r| < 2**(qe + 51) since width <= 51); below the subnormal quantum every
        # float64 is already such a multiple and the slice is r itself
        small = qe < -1074
        sigma = np.ldexp(1.5, np.clip(qe + 52, -1022, 1023))
        q = np.where(small, r, (sigma + r) - sigma)
        bins[j] = q.sum(axis=0)  # exact: multiples of 2**qe below n 2**(qe + width)
        r -= q
    return top, bins


def merge_binned(a, b):
    """The binned sums of the union of two blocks (exact, any order)."""
    ta, ba = a
    tb, bb = b
    top = np.maximum(ta, tb)
    out = np.zeros_like(ba)
    for t, bs in ((ta, ba), (tb, bb)):
        shift = top - t  # bins this block's bins move down by
        for j in range(BINS):
            dst = j + shift
            ok = dst < BINS  # bins below the merged range hold what the others dropped too
            cols = np.flatnonzero(ok)
            out[dst[cols], cols] += bs[j, cols]
    return top, out


def finish_binned(s) -> np.ndarray:
    """The column sums, each bin sum added with one rounding (math.fsum)."""
    import math

    _, bins = s
    return np.array([math.fsum(bins[:, c]) for c in range(bins.shape[1])])


def column_sums(blocks, n_total, transform=None):
    """Reproducible column sums over an iterable of row blocks (``transform`` applied
    to each block first): the same bits for every partition of the same rows."""
    width = bin_width(n_total)
    acc = None
    for b in blocks:
        b = np.asarray(b, dtype=np.float64) if transform is None else transform(b)
        s = binned_sums(b, width)
        acc = s if acc is None else merge_binned(acc, s)
    return finish_binned(acc)


def mean_and_spread(Z, rows=8192):
    """Column means and standard deviations (``sqrt(mean((z - mean)^2))``) of float64
    ``Z``, as reproducible sums (see :func:`binned_sums`), ``rows`` rows at a time."""
    n = Z.shape[0]
    blocks = [Z[s : s + rows] for s in range(0, n, rows)]
    mu = column_sums(blocks, n) / n
    var = column_sums(blocks, n, lambda b: (b - mu) ** 2) / n
    return mu, np.sqrt(var)


# ---------------------------------------------------------------- divergences

_LOG2 = math.log(2.0)
# 1/n! for n = 2..19: the series of expm1(x) - x
_INV_FACT = tuple(1.0 / math.factorial(n) for n in range(2, 20))
# entries per block of the divergence kernels (the temporaries stay in cache)
_DIV_BLOCK = 2**15


def expm1_minus_x(x):
    """``expm1(x) - x`` to a few ulps relative for every float64 ``x``.

    Direct subtraction loses ``2 u / |x|`` relative near 0 (the value is ``x**2 / 2``);
    there the Taylor series runs, with as many terms as the largest ``|x| <= 1/2`` of
    the array needs (4 at ``|x| <= 1e-3``, 17 at 1/2).  ``inf`` past exp's range.
    """
    small = np.abs(x) <= 0.5
    if small.all():
        return _series_g(x)
    out = np.empty_like(x)
    out[small] = _series_g(x[small])
    big = x[~small]
    with np.errstate(over="ignore"):
        out[~small] = np.expm1(big) - big
    return out


def _series_g(x):
    if x.size == 0:
        return x.copy()
    top = float(np.max(np.abs(x)))
    # the first dropped term, relative to x**2 / 2, below 2**-60
    n = next((n for n in range(1, len(_INV_FACT)) if top**n * _INV_FACT[n] < 2.0**-61), len(_INV_FACT) - 1)
    acc = np.full_like(x, _INV_FACT[n])
    for c in _INV_FACT[n - 1::-1]:
        acc *= x
        acc += c
    return acc * x * x


def divergence_from_logs(lp, lq, kind):
    """The divergences from the two log-softmaxes, entry by entry (absolute accuracy
    ``u * sum p |log p|``): the fallback of :func:`divergence` where a term overflows
    or is infinite."""
    p = np.exp(lp)
    with np.errstate(invalid="ignore", over="ignore"):
        if kind == "kl":
            return np.sum(np.where(p > 0, p * (lp - lq), 0.0), axis=-1)
        q = np.exp(lq)
        if kind == "reverse_kl":
            return np.sum(np.where(q > 0, q * (lq - lp), 0.0), axis=-1)
        # log of the midpoint; exactly log p where the two agree (so JS(p, p) = 0 exactly)
        lm = np.where(lp == lq, lp, np.logaddexp(lp, lq) - _LOG2)
        return 0.5 * (np.sum(np.where(p > 0, p * (lp - lm), 0.0), axis=-1)
                      + np.sum(np.where(q > 0, q * (lq - lm), 0.0), axis=-1))


def divergence(zp, lp, zq, lq, kind):
    """KL(p||q), KL(q||p) or JS(p, q) of each row, accurate relative to itself (within
    ``2**-46`` of 400-digit arithmetic on the same logits in the tests).

    ``zp``, ``zq`` are float64 logits of shape (n, V) (finite or ``-inf``), ``lp``,
    ``lq`` their log-softmaxes.  With ``delta = zq - zp`` (the logit change, exact as
    TwoSum's ``hi + lo``), ``w = p`` and ``x = delta - sum_v w_v delta_v`` (centered,
    so ``sum w x = 0`` and no first-order term is left to cancel)::

        KL(p||q) = log1p(sum_v w_v g(x_v)) - log(1 - q0),   g(x) = expm1(x) - x >= 0
        log q_v - log p_v = y_v = x_v - KL(p||q)
        JS(p, q) = 1/2 sum_v w_v (y e^y - (1 + e^y) log((1 + e^y) / 2)) + (terms where p = 0)
        KL(q||p) = KL(p||q) with p and q exchanged

    with ``q0`` the mass of q where p underflows to 0.  Every summand is ``>= 0`` and
    second order in ``x`` (the summed differences of logs lose ``u |log p| / KL``
    relative: a KL of 6e-18 came out 0).  Where ``x > 1`` a summand is taken as
    ``exp(log w + x) - w (1 + x)`` from ``log w = lp - log sum p``, not from ``w``
    (a weight below the normal range has a few bits; ``e**x`` past the range may
    meet such a weight).  A row whose KL is infinite (q = 0 where p > 0) or beyond
    ``e**709``, or whose JS meets a ``-inf`` logit of q where p > 0, takes
    :func:`divergence_from_logs`.  Cost O(n V), in blocks of ``_DIV_BLOCK`` entries.
    """
    if kind == "reverse_kl":
        return divergence(zq, lq, zp, lp, "kl")
    n, V = zp.shape
    out = np.empty(n)
    step = max(1, _DIV_BLOCK // max(V, 1))
    for r in range(0, n, step):
        s = slice(r, r + step)
        with np.errstate(all="ignore"):
            v = _divergence_block(zp[s], lp[s], zq[s], lq[s], kind)
        bad = ~np.isfinite(v)
        if bad.any():
            v[bad] = divergence_from_logs(lp[s][bad], lq[s][bad], kind)
        out[s] = v
    return np.maximum(out, 0.0)


def _weighted(w, t):
    return np.einsum("ij,ij->i", w, t)


def _softmax_weights(z):
    """``(w, hi, lo, log_total)``: the softmax ``w`` of the logits ``z``, each weight to a
    few ulps, with ``log w = hi + lo - log_total`` exactly up to ``log_total``'s rounding.

    ``exp(log_softmax(z))`` carries the rounding of ``z - max z``, ``u |log p|``
    relative (1.4e-14 at a token 245 below the largest, which can carry the whole
    divergence); here ``z - max z`` is taken exactly as ``hi + lo`` and
    ``exp(hi + lo) = exp(hi) (1 + lo)`` to rounding (``|lo| <= ulp(hi) / 2``)."""
    hi, lo = two_diff(z, np.max(z, axis=-1, keepdims=True))
    lo = np.where(np.isfinite(hi), lo, 0.0)
    e = np.exp(hi) * (1.0 + lo)
    total = np.sum(e, axis=-1, keepdims=True)
    return e / total, hi, lo, np.log(total)


def _divergence_block(zp, lp, zq, lq, kind):
    w, *log_w = _softmax_weights(zp)
    pos = w > 0
    full = bool(pos.all())
    q = _softmax_weights(zq)[0] if kind == "js" or not full else None
    # the logit change exactly, as hi + lo (TwoSum), less the change of the likeliest
    # token (exact where the changes share a large common part, e.g. zq = zp + 3 + 1e-12
    # noise: a rounded change had lost the noise to u |zq - zp|)
    hi, lo = two_diff(zq, zp)
    top = hi[np.arange(hi.shape[0]), np.argmax(lp, axis=-1)][:, None]
    delta = (hi - top) + lo
    # -inf logits (p = 0) give NaN here; they are zeroed (their weight is 0)
    if not full:
        delta = np.where(pos, delta, 0.0)
    mu = _weighted(w, delta)[:, None]
    x = delta - mu
    if not full:
        x[~pos] = 0.0
    kl = np.log1p(np.sum(_kl_terms(w, log_w, x, (hi, lo, top, mu)), axis=-1))
    if not full:
        # q's normalizer holds mass q0 where p underflowed to 0; p's does not.
        # log(1 - q0) from the rest of q where q0 is large (1 - q0 rounds there)
        q_rest = np.where(pos, 0.0, q)
        q0 = np.sum(q_rest, axis=-1)
        kl = kl - np.where(q0 > 0.5, np.log(np.sum(np.where(pos, q, 0.0), axis=-1)), np.log1p(-q0))
    if kind == "kl":
        return kl
    y = x - kl[:, None]
    t = _js_terms(w, q, y)
    if not full:
        lm = np.logaddexp(lp, lq) - _LOG2
        t = np.where(pos, t, np.where(q_rest > 0, q_rest * (lq - lm), 0.0))
    return 0.5 * np.sum(t, axis=-1)


def _kl_terms(w, log_w, x, change):
    """``w g(x)`` with ``g(x) = expm1(x) - x``; where ``x > 1`` as ``exp(log w + x) - w (1 + x)``
    (``log_w``: :func:`_softmax_weights`' ``hi, lo, log_total``): ``e**x`` may pass the
    range, or meet a weight below the normal range that holds a few bits, while
    ``exp(log w + x) = q e**KL`` stays in range as long as the KL does.  The exponent
    is summed exactly from its parts (the weight's ``hi + lo``, the change's
    ``hi - top + lo`` from ``change``, less ``mu``): rounded, ``log w`` and ``x``
    carried ``u (|log w| + x)`` (a weight e**-700 and x = 700 make a term of 1 with
    an error of 1.6e-13; 925 ulps of KL were seen).  A weight 0 gives 0."""
    big = x > 1.0
    if not big.any():
        return w * expm1_minus_x(x)
    t = w * expm1_minus_x(np.where(big, 0.0, x))
    whi, wlo, log_total = (np.broadcast_to(a, x.shape)[big] for a in log_w)
    dhi, dlo, top, mu = (np.broadcast_to(a, x.shape)[big] for a in change)
    s1, r1 = two_diff(dhi, top)  # the change less the likeliest token's, exactly
    a, ra = two_diff(whi, -s1)  # log w's hi + that
    b, rb = two_diff(a, mu)  # less the mean change
    rest = np.where(np.isfinite(b), (ra + rb) + (r1 + dlo + wlo), 0.0)
    xb = x[big]
    t[big] = np.exp(b - log_total) * (1.0 + rest) - w[big] * (1.0 + xb)
    return t


def _js_terms(w, q, y):
    # w (y e^y - (1 + e^y) log((1 + e^y) / 2)); with s = y / 2 and m = expm1(s) this is
    # 2 w e^s (s sinh s - cosh s log cosh s), sinh s = m (2 + m) / (2 e^s),
    # cosh s - 1 = m**2 / (2 e^s): second order, a factor 2 of cancellation at most
    small = np.abs(y) <= 2.0
    if small.all():
        return w * _js_small(0.5 * y)
    t = np.empty_like(y)
    t[small] = w[small] * _js_small(0.5 * y[small])
    yb, wb = y[~small], w[~small]
    # q itself, not w e^y: y = log q - log p holds u |log p| of rounding (200 ulps of
    # JS at log p = -700), and a weight below the normal range a few bits
    q = q[~small]
    L = np.logaddexp(0.0, yb) - _LOG2  # log((p + q) / (2 p))
    # y > 2: q (y - L) - p L with y - L = log 2 - log1p(e^-y) (no cancellation)
    t[~small] = np.where(yb > 0, q * (_LOG2 - np.log1p(np.exp(-yb))) - wb * L, q * yb - (wb + q) * L)
    return t


def _js_small(s):
    m = np.expm1(s)
    e = 1.0 + m
    c1 = m * m / (2.0 * e)
    return 2.0 * e * (s * (m * (2.0 + m) / (2.0 * e)) - (1.0 + c1) * np.log1p(c1))
