"""The NumPy filter of candidate pairs of the Dask tasks (refgeo._filter): every pair that
can reach a row's threshold is returned.  (The compiled engine's threshold pass is tested
in test_engine.py.)"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from refgeo import _certify, _filter


@settings(max_examples=300)
@given(M=hnp.arrays(bool, hnp.array_shapes(min_dims=2, max_dims=2, min_side=0, max_side=40)),
       step=st.sampled_from([1, 2, 3]))
def test_sparse_nonzero_is_nonzero(M, step):
    """Same pairs in the same order as np.nonzero, for any shape (lengths not a multiple
    of 8, empty masks, strided views)."""
    M = M[:, ::step]
    r, q = _filter.sparse_nonzero(M)
    r0, q0 = np.nonzero(M)
    np.testing.assert_array_equal(r, r0)
    np.testing.assert_array_equal(q, q0)


@settings(max_examples=200)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 30), m=st.integers(1, 40), d=st.integers(1, 9),
       dt=st.sampled_from(["float32", "float64"]), spread=st.sampled_from([1e-7, 1e-3, 1.0]))
def test_pairs_within_holds_every_pair_within_the_threshold(seed, n, m, d, dt, spread):
    """Near-copy rows, centered as the Dask tasks center them, and thresholds at exact
    squared distances: every pair whose exact squared distance is at most the row's
    threshold is among those returned, with a lower end at most that distance (the
    filter values' bound, the keys' outward rounding and the lower ends are
    certified)."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((3, d))
    A = base[rng.integers(0, 3, n)] + spread * rng.standard_normal((n, d))
    B = np.vstack([A, base[rng.integers(0, 3, m)] + spread * rng.standard_normal((m, d))])
    if dt == "float32":
        A, B = A.astype(np.float32).astype(np.float64), B.astype(np.float32).astype(np.float64)
    mu = B.mean(axis=0)
    XA, XB = (A - mu).astype(dt), (B - mu).astype(dt)
    nA = np.einsum("ij,ij->i", XA, XA, dtype=np.float64)
    nB = np.einsum("ij,ij->i", XB, XB, dtype=np.float64)
    exact = _certify.canonical_sq(np, A[:, None, :], B[None, :, :])
    # thresholds at the exact squared distance of a random pair of each row (itself: 0)
    T = exact[np.arange(n), rng.integers(0, n + m, n)]
    H = _filter.filter_values(XA, XB, nA, nB)
    a, bj, b_up, slack = _filter.error_terms(*_filter.filter_bound(d, dt), nA, nB, XB.dtype)
    r, q, lo = _filter.pairs_within(H, H - b_up, a, bj, slack, T)
    got = dict(zip(zip(r.tolist(), q.tolist()), lo.tolist()))
    for i in range(n):
        for j in np.flatnonzero(exact[i] <= T[i]):
            assert (i, int(j)) in got, (i, j)
            assert got[i, int(j)] <= exact[i, j], (i, j, got[i, int(j)], exact[i, j])
    assert all(lo_ij <= T[i] for (i, _), lo_ij in got.items())


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n_rows=st.integers(1, 40), n=st.integers(0, 600), m=st.integers(1, 6),
       levels=st.sampled_from([2, 5, 1000]), skew=st.booleans(), factor=st.sampled_from([1, 4, 1 << 40]))
def test_first_per_row_matches_a_sort_of_each_row(seed, n_rows, n, m, levels, skew, factor):
    """``first_per_row``: each row's first ``m`` candidates by (key, column), padded, with
    or without the prefilter by each row's m-th smallest key (``factor`` 1: whenever a
    row has more than m; the default; never), on keys with many ties (few levels), rows
    with no, few and many candidates, and repeated columns."""
    rng = np.random.default_rng(seed)
    p = rng.random(n_rows) ** (8 if skew else 1)
    rows = rng.choice(n_rows, size=n, p=p / p.sum()).astype(np.int64)
    cols = rng.integers(0, 50, n).astype(np.int64)
    keys = rng.integers(0, levels, n) / levels
    vals = keys * 3.0 + 1.0
    old = _filter.FIRST_PREFILTER_FACTOR
    try:
        _filter.FIRST_PREFILTER_FACTOR = factor
        v, c, ok = _filter.first_per_row(keys, vals, rows, cols, n_rows, m)
    finally:
        _filter.FIRST_PREFILTER_FACTOR = old
    assert v.shape == c.shape == ok.shape == (n_rows, m)
    for r in range(n_rows):
        mine = np.flatnonzero(rows == r)
        want = sorted(zip(keys[mine], cols[mine], vals[mine]))[:m]
        assert ok[r].sum() == len(want)
        assert [(float(a), int(b)) for a, b in zip(v[r][ok[r]], c[r][ok[r]])] == [(float(w), int(q)) for _, q, w in want]
