"""The NumPy filter of candidate pairs: which pairs of rows can reach a row's threshold.

The Dask tasks on NumPy chunks (``refgeo._dask``) filter pairs outside a compiled tile
epilogue, in several kinds of task that must agree.  The filter values are formed
on a GEMM output in the filter dtype (float32 or float64), each pair gets a certified
lower end from its own norms, and only the pairs whose lower end is at most the row's
threshold are refined in float64.

Why a module of its own: the bound of these values (:func:`filter_bound`) and the
outward rounding of thresholds into the filter dtype are a certificate, which every kind
of task must apply alike and which is tested apart from the task graph
(``tests/test_filter.py``).  This module depends only on :mod:`refgeo._certify` and NumPy.
"""

from __future__ import annotations

import math

import numpy as np

from ._certify import UNIT_ROUNDOFF, rounding_bound

__all__ = ["error_terms", "filter_bound", "filter_values", "first_per_row", "pairs_within", "round_into",
           "sparse_nonzero"]


def filter_bound(d: int, dt: str) -> tuple[float, float]:
    """``(c, eabs)``: ``|H_ij - r_ij| <= c (n_i + n_j) + eabs`` for the values of
    :func:`filter_values` in the filter dtype ``dt``.

    ``c`` is :func:`refgeo._certify.rounding_bound`'s plus ``7 u``: forming
    ``H = (fl(-2 x_i . x_j) + fl(n_i)) + fl(n_j)`` in the filter dtype with unit roundoff
    u adds at most ``u (a + 2.01 a + 3.02 a) <= 6.1 u a`` (``a = n_i + n_j``,
    ``|2 x_i . x_j| <= 1.01 a``) to the float64 epilogue that bound is for.
    """
    c, eabs = rounding_bound(d, dt)
    return c + 7.0 * UNIT_ROUNDOFF[dt], eabs


def filter_values(XA, XB, nA, nB):
    """``H = (fl(-2 x_i . x_j) + fl(n_i)) + fl(n_j)`` in the filter dtype, formed in place
    on the GEMM output (the rounding that :func:`filter_bound` covers)."""
    H = XA @ XB.T
    H *= -2.0
    H += nA.astype(H.dtype)[:, None]
    H += nB.astype(H.dtype)[None, :]
    return H


def round_into(x, dtype, sign=1.0):
    """``x`` (float64) rounded outward into ``dtype``: up for ``sign`` > 0 (every entry
    at least ``x``'s), down otherwise."""
    y = x.astype(dtype)
    off = (y < x) if sign > 0 else (y > x)
    y[off] = np.nextafter(y[off], np.asarray(math.copysign(math.inf, sign), dtype=dtype))
    return y


def sparse_nonzero(M):
    """``np.nonzero`` of a 2-D boolean array with few True entries, in the same order.

    The mask is scanned as 64-bit words, eight entries at a time, and only the words
    that hold a True entry are opened: ``np.nonzero`` looks at every byte, and on
    masks of k-NN rows whose ties no heap held (about 50 True entries in 20,000 a row)
    it took a third of the time of the filter.
    """
    n, m = M.shape
    if M.size == 0:
        return np.zeros(0, np.intp), np.zeros(0, np.intp)
    flat = np.ascontiguousarray(M).reshape(-1)
    head = flat.size - flat.size % 8
    words = np.flatnonzero(flat[:head].view(np.uint64))
    idx = (words[:, None] * 8 + np.arange(8)).reshape(-1)
    idx = np.concatenate([idx, np.arange(head, flat.size)])
    idx = idx[flat[idx]]
    return idx // m, idx % m


def error_terms(c, eabs, nA, nB, dtype):
    """``(a, bj, b_up, slack)``: each pair's error ``e_ij <= a_i + bj_j`` for the filter
    values of rows with squared norms ``nA`` against ``nB`` (``filter_bound``'s ``c``
    and ``eabs``), ``a_i = c n_i + eabs`` and ``bj_j = c n_j`` widened by ``2**-40``
    for their own rounding, ``bj`` rounded up into the filter ``dtype`` (``b_up``, for
    the keys ``H_ij - b_j``), and ``slack = 2**-48 max bj``.

    Each pair is bounded by its own norms, not by the block's largest (``c (n_i + max
    n)``): rows of an LM-head gradient span nine decades of norm, and for the small rows
    ``c max n`` exceeded their whole neighbourhood, so almost every pair was refined.
    A pair's lower end ``H_ij - e_ij - 2**-50 |H_ij|`` can be at most ``t_i`` only if
    its key is at most ``W_i = (t_i + a_i + slack) (1 + 2**-48)`` (``|H_ij| <= |key| +
    max b``; the margins also cover the float64 rounding of the lower end, about
    ``2**-53 (|H_ij| + a_i + b_j)``), so the keys at most ``W_i`` rounded up (one
    rounding, monotone) hold every candidate (:func:`pairs_within`).
    """
    a = (c * np.asarray(nA, dtype=np.float64) + eabs) * (1.0 + 2.0**-40)
    bj = c * np.asarray(nB, dtype=np.float64) * (1.0 + 2.0**-40)
    b_up = round_into(bj, dtype)
    slack = float(bj.max()) * 2.0**-48
    return a, bj, b_up, slack


def pairs_within(Hs, keys, a, bj, slack, t):
    """``(r, q, lo)``: the pairs of a strip of filter values ``Hs`` (rows r of the
    strip) whose lower end ``lo`` is at most the row's ``t``: ``keys`` are ``Hs - b_j`` in
    the filter dtype, ``a``, ``bj``, ``slack`` from :func:`error_terms` (which says
    why the keys at most ``W`` hold every pair within reach)."""
    W = round_into((t + a + slack) * (1.0 + 2.0**-48), Hs.dtype)
    r, q = sparse_nonzero(keys <= W[:, None])
    h = Hs[r, q].astype(np.float64)
    lo = h - ((a[r] + bj[q]) + np.abs(h) * 2.0**-50)
    keep = lo <= t[r]
    return r[keep], q[keep], lo[keep]


# first_per_row sorts only the candidates at or below each row's m-th smallest key when
# the rows with more than m candidates have more than FIRST_PREFILTER_FACTOR * m on
# average, and their keys fit in a padded (those rows, most candidates of a row) array
# at most FIRST_PREFILTER_FACTOR times their number.
FIRST_PREFILTER_FACTOR = 4


def first_per_row(keys, vals, rows, cols, n_rows, m):
    """The first ``m`` candidates of every row, ordered by ``keys`` then column:
    ``(vals, cols, ok)`` of shape ``(n_rows, m)``, ``ok`` False where a row has fewer.

    Where rows have many more candidates than ``m``, only those whose key is at most
    the row's ``m``-th smallest (``np.partition`` of the keys of each row with more
    than ``m``, padded) are sorted: they hold the row's first ``m`` whatever the
    columns.  Why: the Dask k-NN refines up to 250 pairs a row of hidden states with
    Zipf token counts (the states of one token tie in float32) and sorted all 2.6
    million of them by (row, key, column) for k = 1: a quarter of the time.
    """
    keys, vals = np.asarray(keys), np.asarray(vals)
    if rows.shape[0] == 0:
        return np.zeros((n_rows, m), vals.dtype), np.zeros((n_rows, m), cols.dtype), np.zeros((n_rows, m), bool)
    if m >= 1 and rows.shape[0] > FIRST_PREFILTER_FACTOR * m:
        count = np.bincount(rows, minlength=n_rows)
        heavy = np.flatnonzero(count > m)
        width = int(count.max())
        n_heavy = int(count[heavy].sum())
        many = n_heavy > FIRST_PREFILTER_FACTOR * m * heavy.size
        if many and heavy.size * width <= FIRST_PREFILTER_FACTOR * n_heavy:
            slot = np.full(n_rows, -1, dtype=np.intp)
            slot[heavy] = np.arange(heavy.size)
            on = slot[rows] >= 0
            hr = rows[on]
            by_row = np.argsort(hr, kind="stable")
            hs = hr[by_row]
            start = np.cumsum(count[heavy]) - count[heavy]
            pad = np.full((heavy.size, width), np.inf)
            pad[slot[hs], np.arange(hs.shape[0]) - start[slot[hs]]] = keys[on][by_row]
            mth = np.full(n_rows, np.inf)  # rows with at most m candidates keep them all
            mth[heavy] = np.partition(pad, m - 1, axis=1)[:, m - 1]
            sel = keys <= mth[rows]
            keys, vals, rows, cols = keys[sel], vals[sel], rows[sel], cols[sel]
    order = np.lexsort((cols, keys, rows))
    rs = rows[order]
    start = np.searchsorted(rs, np.arange(n_rows))
    count = np.diff(np.append(start, rs.shape[0]))
    pos = np.minimum(start[:, None] + np.arange(m)[None, :], max(rs.shape[0] - 1, 0))
    ok = np.arange(m)[None, :] < count[:, None]
    return vals[order][pos], cols[order][pos], ok
