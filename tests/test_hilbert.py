"""Properties of the Hilbert projective distance (docs/theory/hilbert.md), each against its definition."""

from __future__ import annotations

import decimal
import math
import re
import warnings

import numpy as np
import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import refgeo

from ._layouts import assert_same_result, other_layouts
from ._tolerances import EPS64, pairwise_logits_atol

finite = dict(allow_nan=False, allow_infinity=False, allow_subnormal=False)


@st.composite
def logit_pairs(draw, max_v=12, scale=None):
    v = draw(st.integers(1, max_v))
    s = draw(st.sampled_from([1.0, 10.0, 1e4])) if scale is None else scale
    el = st.floats(-s, s, **finite)
    z = draw(hnp.arrays(np.float64, v, elements=el))
    w = draw(hnp.arrays(np.float64, v, elements=el))
    return z, w


@st.composite
def positive_vectors(draw, v=None, n=2):
    v = draw(st.integers(1, 10)) if v is None else v
    el = st.floats(1e-6, 1.0, **finite)
    return [draw(hnp.arrays(np.float64, v, elements=el)) for _ in range(n)]


def _brute_hilbert(p, q):
    """max over i, j of |log(p_i/p_j) - log(q_i/q_j)| (docs/theory/hilbert.md, second form)."""
    lp, lq = np.log(p), np.log(q)
    a = (lp[:, None] - lp[None, :]) - (lq[:, None] - lq[None, :])
    return float(np.max(np.abs(a)))


# ------------------------------------------------------------------- identities


@given(positive_vectors(n=2))
def test_hilbert_matches_pairwise_log_ratio_form(pq):
    p, q = pq
    d = float(refgeo.hilbert_distance(p, q))
    assert d == pytest.approx(_brute_hilbert(p, q), rel=1e-12, abs=1e-12)


@given(positive_vectors(n=3))
def test_hilbert_symmetry_and_triangle(pqr):
    p, q, r = pqr
    dpq = float(refgeo.hilbert_distance(p, q))
    assert dpq == float(refgeo.hilbert_distance(q, p))
    dqr = float(refgeo.hilbert_distance(q, r))
    dpr = float(refgeo.hilbert_distance(p, r))
    assert dpr <= dpq + dqr + 1e-12 * (1 + dpq + dqr)


@given(positive_vectors(n=2), st.floats(1e-3, 1e3), st.floats(1e-3, 1e3))
def test_hilbert_projective_invariance(pq, a, b):
    p, q = pq
    d = float(refgeo.hilbert_distance(p, q))
    d2 = float(refgeo.hilbert_distance(a * p, b * q))
    assert d2 == pytest.approx(d, abs=64 * EPS64 * (1 + abs(math.log(a)) + abs(math.log(b)) + d))


@settings(max_examples=60)
@given(positive_vectors(n=2), st.integers(-900, 900), st.integers(-900, 900), st.booleans())
@example(pq=[np.array([3.0, 1.0]), np.array([1.0, 1.0])], i=1000, j=-1000, zeros=False)
def test_projective_distances_are_blind_to_power_of_two_scales(pq, i, j, zeros):
    """Scaling by 2**i is exact, and the distances see only each vector's entries
    relative to its largest: the results stay the same bits, whatever the scale (the
    logs of entries near 1e300 used to leave 6e-14 behind, 250 ulps of log 3)."""
    p, q = pq
    if zeros and p.size > 1:  # a common zero: the distance on that face
        p[0] = q[0] = 0.0
    a, b = np.ldexp(p, i), np.ldexp(q, j)
    assert np.array_equal(a / 2.0**i, p) and np.array_equal(b / 2.0**j, q)  # exact scaling
    assert refgeo.hilbert_distance(a, b) == refgeo.hilbert_distance(p, q)
    assert refgeo.funk_distance(a, b) == refgeo.funk_distance(p, q)
    assert refgeo.funk_distance(b, a) == refgeo.funk_distance(q, p)
    np.testing.assert_array_equal(refgeo.pdist_hilbert(np.stack([a, b, p, q]), kind="probabilities"),
                                  refgeo.pdist_hilbert(np.stack([p, q, p, q]), kind="probabilities"))


@settings(max_examples=60)
@given(positive_vectors(n=2), st.floats(-300, 300), st.floats(-300, 300))
@example(pq=[np.array([3.0, 1.0]), np.array([1.0, 1.0])], u=0.0, w=308.0)
@example(pq=[np.array([3.0, 1.0]), np.array([1.0, 1.0])], u=-300.0, w=0.0)
def test_projective_distances_at_any_decimal_scale(pq, u, w):
    """Scaling by 10**u rounds each entry once (half an ulp of its log): the distances
    move by a few ulps of the logs of the entries relative to each vector's largest,
    however far the scale is from 1."""
    p, q = pq
    a, b = p * 10.0**u, q * 10.0**w
    assume(np.all(a > 1e-300) and np.all(b > 1e-300) and np.all(np.isfinite(a)) and np.all(np.isfinite(b)))
    span = float(np.log(p.max() / p.min()) + np.log(q.max() / q.min()))
    d = float(refgeo.hilbert_distance(p, q))
    tol = 16 * EPS64 * (1 + span + d)
    assert float(refgeo.hilbert_distance(a, b)) == pytest.approx(d, abs=tol)
    assert float(refgeo.funk_distance(a, b)) == pytest.approx(float(refgeo.funk_distance(p, q)), abs=tol)


@given(positive_vectors(n=1))
def test_hilbert_zero_iff_proportional(p):
    (p,) = p
    assert float(refgeo.hilbert_distance(p, 3.0 * p)) <= 1e-14


@given(seed=st.integers(0, 2**32 - 1), spread=st.floats(1.0, 60.0), c=st.floats(1.0, 10.0))
@example(seed=3, spread=15.0, c=3.0)  # a softmax reaching 1e-40, logs near -92: 2.8e-14
def test_hilbert_of_proportional_softmaxes_is_a_few_ulps_of_their_largest_log(seed, spread, c):
    """The documented error: a few ulps of the largest log of an entry relative to its
    vector's largest, for softmax vectors whose entries span up to e^-400 (the
    strategy above draws entries in [1e-6, 1] only)."""
    z = np.random.default_rng(seed).standard_normal(300) * spread
    p = np.exp(z - z.max())
    p /= p.sum()
    assume(np.all(p > 0) and np.all(c * p > 0))
    largest = float(np.max(np.abs(np.log(p / p.max()))))
    for q in (c * p, p * 2.0**-60):
        d = float(refgeo.hilbert_distance(p, q))
        assert 0.0 <= d <= 8 * EPS64 * (1.0 + largest)
    assert float(refgeo.hilbert_distance(p, p * 2.0**-60)) == 0.0  # powers of two: exact


@given(logit_pairs(), st.floats(-1e4, 1e4), st.floats(-1e4, 1e4))
def test_logit_form_is_shift_invariant(zw, a, b):
    z, w = zw
    d = float(refgeo.hilbert_distance_logits(z, w))
    d2 = float(refgeo.hilbert_distance_logits(z + a, w + b))
    # shifting rounds each entry once: error <= ulp of the largest magnitude involved
    scale = np.max(np.abs(np.concatenate([z, w]))) + abs(a) + abs(b)
    assert d2 == pytest.approx(d, abs=8 * EPS64 * scale)


@given(logit_pairs(scale=30.0))
def test_logit_form_equals_probability_form(zw):
    z, w = zw
    p = np.exp(z - z.max())
    q = np.exp(w - w.max())
    assume(np.all(p > 1e-300) and np.all(q > 1e-300))
    d_logit = float(refgeo.hilbert_distance_logits(z, w))
    d_prob = float(refgeo.hilbert_distance(p / p.sum(), q / q.sum()))
    assert d_prob == pytest.approx(d_logit, abs=1e-10 * (1 + d_logit))


def test_extreme_logits_are_exact():
    z = np.array([1e4, -1e4, 0.0])
    w = np.array([-1e4, 1e4, 0.5])
    # softmax(z) underflows to (1, 0, 0); the logit form still gives the exact answer.
    assert float(refgeo.hilbert_distance_logits(z, w)) == 4e4
    assert math.isfinite(float(refgeo.funk_distance_logits(z, w)))


@given(positive_vectors(n=2))
def test_funk_nonnegative_and_sums_to_hilbert(pq):
    p, q = pq
    f_pq = float(refgeo.funk_distance(p, q))
    f_qp = float(refgeo.funk_distance(q, p))
    assert f_pq >= 0 and f_qp >= 0
    d = float(refgeo.hilbert_distance(p, q))
    assert f_pq + f_qp == pytest.approx(d, abs=1e-12 * (1 + d))


@given(logit_pairs(scale=50.0))
def test_funk_logits_matches_probability_funk_and_sums(zw):
    z, w = zw
    fz = float(refgeo.funk_distance_logits(z, w))
    fw = float(refgeo.funk_distance_logits(w, z))
    d = float(refgeo.hilbert_distance_logits(z, w))
    assert fz >= 0 and fw >= 0
    assert fz + fw == pytest.approx(d, abs=1e-9 * (1 + d))
    p, q = np.exp(z - z.max()), np.exp(w - w.max())
    assume(np.all(p > 1e-200) and np.all(q > 1e-200))
    assert float(refgeo.funk_distance(p, q)) == pytest.approx(fz, abs=1e-9 * (1 + fz))


@given(logit_pairs(scale=20.0))
def test_cross_entropy_bound(zw):
    z, w = zw
    lp = z - np.log(np.sum(np.exp(z - z.max()))) - z.max()
    lq = w - np.log(np.sum(np.exp(w - w.max()))) - w.max()
    d = float(refgeo.hilbert_distance_logits(z, w))
    bound = float(refgeo.ce_bound(d))
    assert np.max(np.abs(lp - lq)) <= bound + 1e-9 * (1 + bound)


@given(logit_pairs(scale=20.0))
def test_tv_bound_holds(zw):
    z, w = zw
    p = np.exp(z - z.max()); p /= p.sum()
    q = np.exp(w - w.max()); q /= q.sum()
    tv = 0.5 * np.abs(p - q).sum()
    d = float(refgeo.hilbert_distance_logits(z, w))
    assert tv <= float(refgeo.tv_bound(d)) + 1e-12


@pytest.mark.parametrize("delta", [0.1, 1.0, 3.0, 10.0])
def test_tv_bound_equality_case(delta):
    # Two points with likelihood ratios e^{+delta/2} and e^{-delta/2}: p = (a, 1-a) with
    # a/(1-a) = e^{delta/2}, q the mirror image.
    a = 1.0 / (1.0 + math.exp(-delta / 2))
    p = np.array([a, 1 - a])
    q = np.array([1 - a, a])
    d = float(refgeo.hilbert_distance(p, q))
    assert d == pytest.approx(delta, rel=1e-12)
    tv = 0.5 * np.abs(p - q).sum()
    assert tv == pytest.approx(float(refgeo.tv_bound(d)), rel=1e-12)


# ------------------------------------------------------------------- supports


def test_common_support_gives_face_distance():
    p = np.array([0.5, 0.0, 0.5])
    q = np.array([0.25, 0.0, 0.75])
    assert float(refgeo.hilbert_distance(p, q)) == pytest.approx(math.log(3.0), rel=1e-14)


def test_mismatched_supports_give_inf():
    assert float(refgeo.hilbert_distance([0.5, 0.5, 0.0], [0.5, 0.0, 0.5])) == math.inf
    assert float(refgeo.funk_distance([0.5, 0.5], [1.0, 0.0])) == math.inf
    # p has no mass where q is zero: the one-sided Funk metric stays finite
    assert math.isfinite(float(refgeo.funk_distance([1.0, 0.0], [0.5, 0.5])))


def test_batched_axis_argument():
    rng = np.random.default_rng(0)
    z = rng.standard_normal((4, 5, 6))
    w = rng.standard_normal((4, 5, 6))
    d = refgeo.hilbert_distance_logits(z, w, axis=1)
    assert d.shape == (4, 6)
    for a in range(4):
        for c in range(6):
            diff = w[a, :, c] - z[a, :, c]
            assert d[a, c] == diff.max() - diff.min()
    # broadcasting one reference vector against a batch
    d2 = refgeo.hilbert_distance_logits(z[0], w[0, 0])
    assert d2.shape == (5,)


def test_float32_inputs_accumulate_in_float64():
    z = np.array([0.0, 1.0], dtype=np.float32)
    w = np.array([1e-8, 0.0], dtype=np.float32)
    d = refgeo.hilbert_distance_logits(z, w)
    assert d.dtype == np.float64
    assert float(d) == 1.0 + float(np.float32(1e-8))


# ------------------------------------------------------------------- pairwise


@st.composite
def logit_matrices(draw, max_n=9, max_v=70, dtypes=(np.float64, np.float32)):
    n = draw(st.integers(1, max_n))
    v = draw(st.integers(1, max_v))
    dtype = draw(st.sampled_from(dtypes))
    scale = draw(st.sampled_from([1.0, 1e3, 1e4]))
    X = draw(hnp.arrays(dtype, (n, v), elements=st.floats(-scale, scale, width=32, **finite)))
    if draw(st.booleans()):  # duplicate rows
        X[n // 2] = X[0]
    return X


def _loop_pdist(X):
    X = X.astype(np.float64)
    n = X.shape[0]
    out = [float(refgeo.hilbert_distance_logits(X[i], X[j])) for i in range(n) for j in range(i + 1, n)]
    return np.array(out, dtype=np.float64)


@settings(max_examples=100)
@given(X=logit_matrices(), tile=st.integers(1, 9), threads=st.sampled_from([1, 2]))
def test_pdist_equals_loop_of_pairwise_calls(backend, X, tile, threads):
    got = refgeo.pdist_hilbert(X, tile_size=tile, n_threads=threads)
    ref = _loop_pdist(X)
    assert got.shape == ref.shape and got.dtype == np.float64
    maxabs = float(np.max(np.abs(X.astype(np.float64)))) * 2 if X.size else 0.0
    np.testing.assert_allclose(got, ref, rtol=0, atol=pairwise_logits_atol(X.dtype, maxabs))


@settings(max_examples=60)
@given(X=logit_matrices(), Y=logit_matrices(), tile=st.integers(1, 9))
def test_cdist_equals_loop(backend, X, Y, tile):
    v = min(X.shape[1], Y.shape[1])
    X, Y = np.ascontiguousarray(X[:, :v]), np.ascontiguousarray(Y[:, :v])
    got = refgeo.cdist_hilbert(X, Y, tile_size=tile)
    ref = np.array(
        [[float(refgeo.hilbert_distance_logits(x.astype(np.float64), y.astype(np.float64))) for y in Y] for x in X]
    )
    maxabs = 2 * float(max(np.max(np.abs(X)), np.max(np.abs(Y)))) if X.size and Y.size else 0.0
    dt = np.float64 if np.float64 in (X.dtype, Y.dtype) else np.float32
    np.testing.assert_allclose(got, ref, rtol=0, atol=pairwise_logits_atol(dt, maxabs))


def test_cython_equals_reference_exactly_in_float64():
    pytest.importorskip("refgeo_ext")
    rng = np.random.default_rng(1)
    X = rng.standard_normal((70, 1037)) * 50 + 1e6  # large common offset, ragged tiles
    with refgeo.use_backend("cython"):
        a = refgeo.pdist_hilbert(X, tile_size=7)
        b = refgeo.cdist_hilbert(X[:9], X[20:], tile_size=4)
    with refgeo.use_backend("reference"):
        np.testing.assert_array_equal(a, refgeo.pdist_hilbert(X))
        np.testing.assert_array_equal(b, refgeo.cdist_hilbert(X[:9], X[20:]))


def test_cython_float32_within_stated_tolerance():
    pytest.importorskip("refgeo_ext")
    rng = np.random.default_rng(2)
    X = (rng.standard_normal((40, 3001)) * 8).astype(np.float32)
    with refgeo.use_backend("cython"):
        a = refgeo.pdist_hilbert(X)
    with refgeo.use_backend("reference"):
        b = refgeo.pdist_hilbert(X)
    assert np.max(np.abs(a - b)) <= pairwise_logits_atol(np.float32, 2 * float(np.abs(X).max()))


def test_pdist_results_do_not_depend_on_tiles_or_threads():
    rng = np.random.default_rng(3)
    X = rng.standard_normal((45, 300)).astype(np.float32)
    base = refgeo.pdist_hilbert(X, tile_size=64, n_threads=1)
    for tile in (1, 3, 16, 45, 100, 2**40):  # 2**40 rows per tile crashed the process
        for threads in (1, 2):
            np.testing.assert_array_equal(refgeo.pdist_hilbert(X, tile_size=tile, n_threads=threads), base)
    Y = X[:7]
    np.testing.assert_array_equal(refgeo.cdist_hilbert(X, Y, tile_size=2**62), refgeo.cdist_hilbert(X, Y))


def test_pdist_cdist_accept_any_valid_thread_count():
    # n_threads beyond a C int (2**31) is a valid positive int: it raised OverflowError
    # in the compiled kernel instead of running with one thread per task
    rng = np.random.default_rng(31)
    X = rng.standard_normal((20, 9))
    Y = X[:5] + 1.0
    want_p = np.array([np.ptp(X[j] - X[i]) for i in range(20) for j in range(i + 1, 20)])
    want_c = np.array([[np.ptp(Y[j] - X[i]) for j in range(5)] for i in range(20)])
    for threads in (2**31, 2**63):
        np.testing.assert_array_equal(refgeo.pdist_hilbert(X, n_threads=threads), want_p)
        np.testing.assert_array_equal(refgeo.cdist_hilbert(X, Y, n_threads=threads), want_c)
        np.testing.assert_array_equal(
            refgeo.pdist_hilbert(np.exp(X), kind="probabilities", n_threads=threads),
            refgeo.pdist_hilbert(np.exp(X), kind="probabilities", n_threads=1),
        )


def test_pdist_square_form_and_probabilities():
    rng = np.random.default_rng(4)
    P = rng.dirichlet(np.ones(7), size=5)
    sq = refgeo.pdist_hilbert(P, kind="probabilities", form="square")
    assert sq.shape == (5, 5)
    np.testing.assert_array_equal(sq, sq.T)
    assert np.all(np.diag(sq) == 0)
    for i in range(5):
        for j in range(5):
            if i != j:
                assert sq[i, j] == pytest.approx(float(refgeo.hilbert_distance(P[i], P[j])), rel=1e-12)
    # zeros on mismatched supports
    P[0, 0] = 0.0
    d = refgeo.pdist_hilbert(P, kind="probabilities")
    assert np.all(np.isinf(d[:4])) and np.all(np.isfinite(d[4:]))
    c = refgeo.cdist_hilbert(P[:2], P, kind="probabilities")
    assert c.shape == (2, 5) and c[0, 0] == 0.0 and np.isinf(c[0, 1])


def test_pdist_single_row_is_empty():
    assert refgeo.pdist_hilbert(np.zeros((1, 4))).shape == (0,)


def test_an_all_zero_row_is_named():
    """The message named the normalized axis ("axis 1") and no row."""
    P = np.array([[1.0, 1.0], [1.0, 2.0], [0.0, 0.0]])
    with pytest.raises(ValueError, match=re.escape("X must have at least one positive entry in each row, "
                                                   "got an all-zero row at index 2 instead.")):
        refgeo.pdist_hilbert(P, kind="probabilities")
    with pytest.raises(ValueError, match=re.escape("XB must have at least one positive entry in each row")):
        refgeo.cdist_hilbert(P[:2], P, kind="probabilities")


@pytest.mark.parametrize("kind", ["logits", "probabilities"])
def test_no_vectors_give_empty_results(backend, kind):
    """An empty batch (no tokens selected) was refused as "must be non-empty"; NumPy's
    reductions over the other axis give an empty result, as SciPy's pdist of no rows
    does.  A vector with no entries stays an error."""
    E = np.zeros((0, 3))
    X = np.full((2, 3), 0.5)
    assert refgeo.pdist_hilbert(E, kind=kind).shape == (0,)
    assert refgeo.pdist_hilbert(E, kind=kind, form="square").shape == (0, 0)
    assert refgeo.cdist_hilbert(E, X, kind=kind).shape == (0, 2)
    assert refgeo.cdist_hilbert(X, E, kind=kind).shape == (2, 0)
    batch = np.zeros((0, 4, 3))
    fns = ([refgeo.hilbert_distance_logits, refgeo.funk_distance_logits] if kind == "logits"
           else [refgeo.hilbert_distance, refgeo.funk_distance])
    for fn in fns:
        assert fn(batch, batch).shape == (0, 4)
        assert fn(batch, np.full(3, 0.25)).shape == (0, 4)  # broadcast against one vector
        assert fn(np.full((2, 0, 3), 0.5), np.full((2, 0, 3), 0.5), axis=0).shape == (0, 3)
    assert refgeo.variation(batch).shape == (0, 4)


# ------------------------------------------------------------------- memory layout

_LAYOUT_CASES = {
    "variation": lambda P, Q, Z, W: refgeo.variation(Z, axis=0),
    "hilbert_distance_logits": lambda P, Q, Z, W: refgeo.hilbert_distance_logits(Z, W),
    "hilbert_distance": lambda P, Q, Z, W: refgeo.hilbert_distance(P, Q, axis=0),
    "funk_distance": lambda P, Q, Z, W: refgeo.funk_distance(P, Q),
    "funk_distance_axis0": lambda P, Q, Z, W: refgeo.funk_distance(P, Q, axis=0),
    "funk_distance_logits": lambda P, Q, Z, W: refgeo.funk_distance_logits(Z, W),
    "funk_distance_logits_axis0": lambda P, Q, Z, W: refgeo.funk_distance_logits(Z, W, axis=0),
    "pdist_hilbert": lambda P, Q, Z, W: refgeo.pdist_hilbert(Z),
    "cdist_hilbert": lambda P, Q, Z, W: refgeo.cdist_hilbert(P, Q, kind="probabilities"),
}


@pytest.mark.parametrize("name", sorted(_LAYOUT_CASES))
@settings(max_examples=25)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 30), V=st.integers(2, 30))
@example(seed=0, n=1, V=2)  # the smallest batch
@example(seed=1, n=30, V=8)  # one full lane of 8, then 9: the lane boundary of the kernels
@example(seed=2, n=2, V=9)
def test_results_do_not_depend_on_memory_layout(backend, name, seed, n, V):
    """Fortran-order, strided and reversed views of a batch give the same bits."""
    fn = _LAYOUT_CASES[name]
    rng = np.random.default_rng(seed)
    P, Q = rng.random((n, V)) + 1e-3, rng.random((n, V)) + 1e-3
    Z, W = 5.0 * rng.standard_normal((n, V)), 5.0 * rng.standard_normal((n, V))
    want = fn(P, Q, Z, W)
    for arrays in zip(*(other_layouts(A) for A in (P, Q, Z, W))):
        assert_same_result(np.asarray(fn(*arrays)), np.asarray(want))


@pytest.mark.parametrize("name", ["variation", "hilbert_distance_logits"])
def test_max_minus_min_reads_any_layout_without_a_copy(name):
    """variation and hilbert_distance_logits are differences and maxima, exact in any
    summation order: a Fortran-order or strided input is read as it is, not copied
    (the copy cost one input's size of memory and a third more time)."""
    import tracemalloc

    rng = np.random.default_rng(3)
    Z = rng.standard_normal((600, 500))
    W = rng.standard_normal((600, 500))
    fn = {"variation": lambda z, w: refgeo.variation(z), "hilbert_distance_logits": refgeo.hilbert_distance_logits}[name]
    want = fn(Z, W)
    for z, w in zip(other_layouts(Z), other_layouts(W)):
        tracemalloc.start()
        try:
            got = fn(z, w)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert_same_result(got, want)
        limit = 0.6 * Z.nbytes if name == "variation" else 1.6 * Z.nbytes  # z - w is one temporary
        assert peak < limit, (peak, Z.nbytes)


# ------------------------------------------------------------------- bad input

BAD_INPUT_CASES = [
    (refgeo.variation, ([1.0, np.nan],), ValueError, "x must contain only finite values, got 1 NaN"),
    (refgeo.variation, ([],), ValueError, "x must have at least one entry along axis -1, got shape (0,) instead."),
    (refgeo.hilbert_distance_logits, (np.zeros((2, 0)), np.zeros((2, 0)), ), ValueError, "z must have at least one entry along axis -1, got shape (2, 0)"),
    (refgeo.hilbert_distance, (np.ones((2, 3)), np.zeros((3, 2)) + 0.5), ValueError, "p and q must have broadcastable shapes"),
    (refgeo.hilbert_distance, (np.array([[1.0, 1.0], [0.0, 0.0]]), [0.5, 0.5]), ValueError, "p must have at least one positive entry along axis -1, got an all-zero vector at index 1 instead."),
    (refgeo.variation, ("abc",), TypeError, "x must be an array of real numbers"),
    (refgeo.variation, ([1 + 2j],), TypeError, "x must have a real floating dtype"),
    (refgeo.hilbert_distance_logits, ([1.0, np.inf], [0.0, 0.0]), ValueError, "z must contain only finite"),
    (refgeo.hilbert_distance_logits, ([1.0, 2.0], [0.0, 0.0, 1.0]), ValueError, "z and w must have broadcastable shapes"),
    (refgeo.hilbert_distance, ([0.5, -1e-3], [0.5, 0.5]), ValueError, "p must have entries >= 0 for the Hilbert distance, got a smallest entry of -1.0e-03 instead."),
    (refgeo.hilbert_distance, ([0.5, 0.5], [0.0, 0.0]), ValueError, "q must have at least one positive entry"),
    (refgeo.funk_distance, ([0.5, np.nan], [0.5, 0.5]), ValueError, "p must contain only finite values"),
    (refgeo.pdist_hilbert, (np.zeros(5),), ValueError, "X must be a 2-D array of shape (n, V), got shape (5,) instead."),
    (refgeo.pdist_hilbert, (np.zeros((3, 0)),), ValueError, "X must have at least one column (V >= 1), got shape (3, 0) instead."),
    (refgeo.cdist_hilbert, (np.zeros((2, 5)), np.zeros((2, 4))), ValueError, "XA and XB must have the same number of columns"),
    (refgeo.tv_bound, (-1.0,), ValueError, "d must be a Hilbert distance"),
    (refgeo.ce_bound, (np.nan,), ValueError, "d must be a Hilbert distance"),
]


@pytest.mark.parametrize("fn,args,exc,msg", BAD_INPUT_CASES, ids=[f"{c[0].__name__}-{i}" for i, c in enumerate(BAD_INPUT_CASES)])
def test_bad_input_is_rejected_with_clear_error(fn, args, exc, msg):
    with pytest.raises(exc, match=re.escape(msg)):
        fn(*args)


def test_bad_keyword_arguments():
    X = np.zeros((3, 4))
    with pytest.raises(ValueError, match=re.escape("kind must be one of ('logits', 'probabilities'), got 'logit' instead.")):
        refgeo.pdist_hilbert(X, kind="logit")
    with pytest.raises(ValueError, match=re.escape("form must be one of")):
        refgeo.pdist_hilbert(X, form="full")
    with pytest.raises(ValueError, match=re.escape("tile_size == 0, must be >= 1.")):
        refgeo.pdist_hilbert(X, tile_size=0)
    with pytest.raises(TypeError, match="n_threads must be an integer"):
        refgeo.pdist_hilbert(X, n_threads=1.5)
    with pytest.raises(ValueError, match=re.escape("axis must be in [-1, 0] for a 1-D array, got 3 instead.")):
        refgeo.variation([1.0, 2.0], axis=3)


def test_integer_inputs_are_converted_to_float64():
    assert refgeo.variation(np.array([1, 5, 3])) == 4.0
    assert refgeo.pdist_hilbert(np.array([[0, 0], [0, 3]])).dtype == np.float64


@pytest.mark.parametrize("dtype, big", [(np.float32, 3e38), (np.float64, 1e308)])
def test_logits_at_the_edge_of_the_float_range(backend, dtype, big):
    """Differences that overflow the dtype: equal shifts are distance 0, the rest is the
    float64 value (the float32 kernel returned NaN, the float64 formula inf - inf)."""
    X = np.array([[big, big], [-big, -big], [big, 0.0], [-big, 0.0]], dtype=dtype)
    b = float(X[0, 0])  # the float32-rounded value
    want = np.array([0.0, b, b, b, b, 2 * b])
    np.testing.assert_array_equal(refgeo.pdist_hilbert(X), want)
    np.testing.assert_array_equal(refgeo.cdist_hilbert(X, X[:2]), [[0, 0], [0, 0], [b, b], [b, b]])
    assert refgeo.hilbert_distance_logits(X[0], X[1]) == 0.0


def test_a_float32_value_does_not_depend_on_the_other_rows(backend):
    """One pair whose float32 difference overflowed sent the whole result to the
    float64 reference: every other value changed (1.9999998808 became 1.99999994).
    Now only the overflowed pairs are differenced in float64, so a pair's value is
    the one it has among its own two rows."""
    X = np.array([[1.0, 3e-8, 0.0], [3e-8, 1.0, 0.0]], np.float32)
    big = np.array([[3e38, 0, 0], [-3e38, 0, 0]], np.float32)
    Y = np.vstack([X, big])
    D = refgeo.pdist_hilbert(Y, form="square")
    for i in range(4):
        for j in range(4):
            if i != j:
                assert D[i, j] == refgeo.pdist_hilbert(Y[[i, j]])[0], (i, j)
    C = refgeo.cdist_hilbert(X, Y)
    np.testing.assert_array_equal(C, D[:2])
    b = float(np.float32(3e38))
    assert D[2, 3] == 2 * b and math.isfinite(D[2, 3])  # the overflowed pair: float64


def test_long_double_probabilities_keep_their_support():
    """Long-double probabilities below the float64 range became 0 in the conversion,
    which changes the support: hilbert_distance([1e-400, 1], [1, 1]) was inf (it is
    log 1e400 = 921.03), and [1e-400, 2e-400] was called an all-zero vector.  They are
    refused, naming the argument; the logits functions take the logs."""
    L = np.longdouble
    if np.finfo(L).tiny >= np.finfo(np.float64).tiny:
        pytest.skip("long double is float64 on this platform")
    p = np.array([L("1e-400"), L(1)])
    q = np.array([L(1), L(1)])
    for call, name in ((lambda: refgeo.hilbert_distance(p, q), "p"),
                       (lambda: refgeo.hilbert_distance(q, np.array([L("1e-400"), L("2e-400")])), "q"),
                       (lambda: refgeo.funk_distance(q, p), "q"),
                       (lambda: refgeo.pdist_hilbert(np.stack([q, p]), kind="probabilities"), "X"),
                       (lambda: refgeo.cdist_hilbert(q[None], p[None], kind="probabilities"), "XB")):
        with pytest.raises(ValueError, match=rf"^{name} must have nonzero entries within the float64 range"):
            call()
    # a negative one becomes -0.0, which a check for entries >= 0 lets through
    with pytest.raises(ValueError, match=r"^p must have entries >= 0, got an entry of -1e-400 \(long double\)"):
        refgeo.hilbert_distance(np.array([L("-1e-400"), L(1)]), q)
    # as logits the same numbers are ordinary: log(1e-400) = -921.03
    z = np.log(p).astype(np.float64)
    assert refgeo.hilbert_distance_logits(z, np.zeros(2)) == pytest.approx(400 * math.log(10), rel=1e-12)
    # long-double logits below the range are fine as they are (an absolute error of 1e-400)
    assert refgeo.pdist_hilbert(np.stack([q, p]))[0] == 1.0


def _decimal_funk_logits(z, w):
    """max_i (z_i - w_i) - lse(z) + lse(w) in decimal arithmetic (no overflow), with
    700 digits: sums of float64 values are exact (60 digits rounded 1e300 - 1e10 to 1e300)."""
    with decimal.localcontext() as ctx:
        ctx.prec = 700
        Z = [decimal.Decimal(float(a)) for a in z]
        W = [decimal.Decimal(float(b)) for b in w]

        def lse(x):
            m = max(x)
            return m + sum((a - m).exp() for a in x).ln()

        return max(a - b for a, b in zip(Z, W)) - lse(Z) + lse(W)


def test_funk_distance_logits_of_logits_whose_differences_overflow():
    """z - w beyond the float64 range: the representable Funk distance, not inf."""
    B = 1e308
    assert refgeo.funk_distance_logits([B, B], [-B, -B]) == 0.0  # softmax(z) == softmax(w)
    assert refgeo.funk_distance_logits([B, 0.0], [-B, 0.0]) == B
    assert refgeo.funk_distance_logits([0.0, 0.0], [B, -B]) == math.inf  # 2e308 - log 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert refgeo.funk_distance_logits([B, -B], [B, -B]) == 0.0


@settings(max_examples=200)
@given(st.integers(1, 6).flatmap(lambda v: st.tuples(
    hnp.arrays(np.float64, (2, v), elements=st.floats(-1.0, 1.0, **finite)),
    st.sampled_from([1.0, 1e4, 1e300, 1e308, 1.7e308]))))
@example((np.array([[1.0, -1.0], [-1.0, 1.0]]), 1.7e308))  # every difference beyond the float64 range
@example((np.array([[1.0, -1.0], [1.0, -1.0]]), 1.7e308))  # equal rows at the top of the range: 0
@example((np.array([[0.0], [0.0]]), 1.0))  # one logit each
def test_funk_distance_logits_over_the_whole_float_range(zw):
    u, scale = zw
    z, w = u[0] * scale, u[1] * scale
    want = _decimal_funk_logits(z, w)
    got = float(refgeo.funk_distance_logits(z, w))
    if want > decimal.Decimal(np.finfo(np.float64).max) * decimal.Decimal("1.000001"):
        assert got == math.inf
        return
    assume(want < decimal.Decimal(np.finfo(np.float64).max) * decimal.Decimal("0.999999"))
    # differences of logits of size m carry an absolute rounding of a few ulps of m, the
    # log-sum-exps (of size up to log V beyond the largest logit) a few ulps of 1
    m = max(float(np.abs(z).max()), float(np.abs(w).max()), 1.0)
    assert got == pytest.approx(max(float(want), 0.0), rel=1e-13, abs=8 * EPS64 * m)


@settings(max_examples=200)
@given(st.integers(1, 8).flatmap(lambda v: st.tuples(
    hnp.arrays(np.float64, (2, v), elements=st.floats(-30.0, 30.0, **finite)),
    st.sampled_from([0.0, 1e4, 1e10, 1e17, -1e17, 1e300]),
    st.sampled_from([0.0, 1e10, -1e17]),
    hnp.arrays(np.bool_, (v,)),
    st.sampled_from([-1e9, -1e20, float(np.finfo(np.float32).min)]))))
@example((np.zeros((2, 4)), 1e17, 0.0, np.zeros(4, bool), -1e9))  # equal distributions: was log 4
@example((np.zeros((2, 1000)), 1e17, 0.0, np.zeros(1000, bool), -1e9))  # was log 1000
@example((np.array([[0.0, 1.0, 0.0], [5.0, 5.5, 0.0]]), 0.0, 0.0, np.array([False, False, True]), -1e20))
def test_funk_distance_logits_is_accurate_to_the_spread_not_the_offset(zwc):
    """Softmax ignores an offset, and a masked logit (the same large negative value in
    z and w, as masked_fill writes) contributes an exact 0 to max(z - w): the error is a
    few ulps of the unmasked logits' spread and of log V, whatever their size.  Summed
    as ``max(z - w) - (m_z + s_z) + (m_w + s_w)`` s_z was rounded away next to a large
    m_z; as ``max((z - m_z) - (w - m_w))`` the masked term was rounded at the mask's size
    (4.66 came out as 0.16 with a mask of -1e20)."""
    u, cz, cw, mask, fill = zwc
    assume(not mask.all())
    z, w = u[0] + cz, u[1] + cw  # rounded: the reference takes the same floats
    z[mask], w[mask] = fill, fill
    want = max(float(_decimal_funk_logits(z, w)), 0.0)
    got = float(refgeo.funk_distance_logits(z, w))
    spread = float(np.ptp(z[~mask])) + float(np.ptp(w[~mask])) + math.log(z.size) + 1.0
    assert got == pytest.approx(want, rel=1e-13, abs=8 * EPS64 * spread)


def test_variation_beyond_the_float64_range_is_inf_without_a_warning():
    """max - min above the largest float64 is inf, as for hilbert_distance_logits (it
    came with an overflow RuntimeWarning); ranges that fit are exact."""
    assert refgeo.variation([1e308, -1e308]) == math.inf
    np.testing.assert_array_equal(refgeo.variation([[1e308, -1e308], [1e308, -7e307]]), [math.inf, 1.7e308])
    assert refgeo.hilbert_distance_logits([1e308, -1e308], [-1e308, 1e308]) == math.inf


def test_funk_distance_of_vectors_whose_sum_overflows():
    assert refgeo.funk_distance([1e308, 1e308], [1.0, 3.0]) == pytest.approx(math.log(2.0), rel=1e-12)


# ---- found by mutation testing: code paths no test reached (each test fails when the
# ---- line it names is changed; the expected values come from the definitions)


def test_funk_logits_whose_differences_overflow():
    """softmax([1e308, 0]) = (1, 0) against softmax of equal logits (1/2, 1/2): the Funk
    distance log max(p / q) is log 2, while z - w overflows float64 (the halved path)."""
    z = np.array([1e308, 0.0])
    w = np.array([-1e308, -1e308])
    assert refgeo.funk_distance_logits(z, w) == pytest.approx(math.log(2.0), rel=1e-12)


def test_funk_logits_of_one_distribution_are_never_negative():
    """w = z - 3.4385...: the same distribution; the float64 formula gives -2.2e-16 here,
    and the documented result is >= 0 (clamped)."""
    z = np.array([0.28223560639382317, -0.35209610838834, 0.22079286561607478, -0.07948832377875412])
    w = np.array([-3.156730052169882, -3.791061766952045, -3.2181727929476303, -3.518453982342459])
    assert refgeo.funk_distance_logits(z, w) >= 0.0
    assert refgeo.funk_distance_logits(w, z) >= 0.0


def test_a_batch_with_one_all_zero_distribution_is_refused():
    """Every row of a batch must be a distribution: one all-zero row among valid ones."""
    with pytest.raises(ValueError, match="p"):
        refgeo.hilbert_distance(np.array([[1.0, 1.0], [0.0, 0.0]]), np.ones((2, 2)))


def test_one_overflowing_pair_leaves_a_subnormal_distance_of_its_batch_exact():
    """Row 1's difference overflows (the batch takes the halved path); row 0's distance
    is the subnormal 5e-324 exactly, not 0."""
    z = np.array([[5e-324, 0.0], [1e308, -1e308]])
    d = refgeo.hilbert_distance_logits(z, np.zeros((2, 2)))
    assert d[0] == 5e-324
    assert d[1] == math.inf  # 2e308: beyond float64 (documented)


def test_variation_refuses_an_axis_past_the_last_masked_entries_and_unrepresentable_integers():
    """Silent wrong answers otherwise: NumPy's masked values are used under the mask,
    and 2**62 and 2**62 + 1 are one float64 (variation 0, true value 1)."""
    with pytest.raises(ValueError, match=re.escape("axis must be in [-1, 0] for a 1-D array, got 1 instead.")):
        refgeo.variation([3.0, -1.0, 2.0], axis=1)
    with pytest.raises(TypeError, match=r"^x must not have masked entries"):
        refgeo.variation(np.ma.masked_array([3.0, -1.0, 100.0], mask=[False, False, True]))
    with pytest.raises(ValueError, match=r"^x must have integer entries of magnitude at most 2\*\*53"):
        refgeo.variation(np.array([2**62, 2**62 + 1], dtype=np.int64))


def test_dask_arrays_are_refused_by_name():
    """The Hilbert functions are not distributed: on Dask input their checks forced a
    compute each (40 graphs for a 40-row pdist) while the arithmetic stayed lazy,
    outside the overflow guards (warnings reached the caller's compute())."""
    da = pytest.importorskip("dask.array")
    Z = da.from_array(np.array([[0.0, 1.0], [1e308, -1e308]]), chunks=1)
    P = da.from_array(np.full((3, 2), 0.5), chunks=1)
    cases = [
        (lambda: refgeo.variation(Z), "x"),
        (lambda: refgeo.hilbert_distance_logits(Z, np.zeros(2)), "z"),
        (lambda: refgeo.hilbert_distance_logits(np.zeros(2), Z), "w"),
        (lambda: refgeo.funk_distance_logits(Z, Z), "z"),
        (lambda: refgeo.hilbert_distance(P, P), "p"),
        (lambda: refgeo.funk_distance(np.full(2, 0.5), P), "q"),
        (lambda: refgeo.pdist_hilbert(Z), "X"),
        (lambda: refgeo.cdist_hilbert(np.zeros((1, 2)), Z), "XB"),
        (lambda: refgeo.tv_bound(da.from_array(np.ones(3))), "d"),
    ]
    for call, name in cases:
        with pytest.raises(TypeError, match=rf"^{name} must be a NumPy, torch, JAX or CuPy array, got a Dask array"):
            call()


def _exact_hilbert(p, q):
    """d_H from exact rationals: log(R) with R = max(p_i / q_i) / min(p_i / q_i), taken as
    log1p(R - 1) of the correctly rounded R - 1 (accurate to an ulp or two however close
    R is to 1), with the largest log of an entry relative to its vector's largest."""
    from fractions import Fraction

    r = [Fraction(a) / Fraction(b) for a, b in zip(p.tolist(), q.tolist())]
    R = max(r) / min(r)
    big = max(abs(math.log(Fraction(x) / Fraction(max(v.tolist())))) for v in (p, q) for x in v.tolist())
    return (math.log1p(float(R - 1)) if R < 2 else math.log(R)), big


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 6), st.integers(0, 2**32 - 1), st.integers(-52, -2), st.sampled_from([1.0, 3.0, 2.0**-900, 1e300]))
@example(2, 0, -52, 1.0).via("two distributions 3.7e-17 apart came out at distance 0")
def test_nearly_identical_distributions_have_their_small_distance(V, seed, e, scale):
    """Logs of each mantissa (errors of 1e-16, ulps of log 2) put two distributions
    3.7e-17 apart at distance 0 and others 2e-3 off, against the documented few ulps of
    the largest log of an entry relative to its vector's largest; pdist_hilbert took
    the same logs."""
    rng = np.random.default_rng(seed)
    p = rng.uniform(0.5, 1.0, V)
    if seed == 0:
        p = np.array([float.fromhex("0x1.0000000000006p-1"), float.fromhex("0x1.ffffffffffff5p-2")])
        q = np.array([float.fromhex("0x1.7fffffffffffdp+0"), float.fromhex("0x1.7ffffffffffecp+0")])
    else:
        q = p * (1.0 + rng.uniform(-1.0, 1.0, V) * 2.0**e) * scale
    want, big = _exact_hilbert(p, q)
    got = float(refgeo.hilbert_distance(p, q))
    assert abs(got - want) <= 8 * math.ulp(max(big, want)), (got, want)
    assert refgeo.pdist_hilbert(np.stack([p, q]), kind="probabilities")[0] == got


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=2, max_size=6).filter(any), st.integers(0, 2**32 - 1))
@example([1, 0], 0).via("the largest entry 2**-1074: log1p(-1) on the zeros warned")
def test_distributions_of_the_smallest_subnormals(counts, seed):
    """Entries that are small multiples of 2**-1074, beside zeros: ``top * 0.5`` of a
    largest entry of 2**-1074 is 0, and the zeros took the log1p path of the entries
    near the largest (a divide-by-zero RuntimeWarning, an error under ``-W error``)."""
    p = np.array(counts, dtype=np.float64) * 5e-324
    q = np.where(p > 0, np.random.default_rng(seed).uniform(0.5, 3.0, p.size), 0.0)
    on = p > 0
    want, big = _exact_hilbert(p[on], q[on])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = float(refgeo.hilbert_distance(p, q))
        both = refgeo.pdist_hilbert(np.stack([p, q]), kind="probabilities")[0]
        funk = float(refgeo.funk_distance(p, q))
    assert abs(got - want) <= 8 * math.ulp(max(big, want)), (got, want)
    assert both == got
    assert 0.0 <= funk <= got + 8 * math.ulp(max(big, want))


def test_tv_bound_of_negative_zero_is_positive_zero():
    """tanh(-0.0) is -0.0: tv_bound(-0.0) returned -0.0 where ce_bound returns 0.0."""
    for f in (refgeo.tv_bound, refgeo.ce_bound):
        assert math.copysign(1.0, float(f(-0.0))) == 1.0


def test_nearly_identical_distributions_in_a_namespace_without_frexp():
    """array-api-strict has no frexp: its logs were log(p) - log(max p), 1e-16 off, and the
    distance 3.7e-17 came out 5.6e-17; entries near the largest take log1p there too."""
    xs = pytest.importorskip("array_api_strict")
    p = np.array([float.fromhex("0x1.0000000000006p-1"), float.fromhex("0x1.ffffffffffff5p-2"), 0.0])
    q = np.array([float.fromhex("0x1.7fffffffffffdp+0"), float.fromhex("0x1.7ffffffffffecp+0"), 0.0])
    want, _ = _exact_hilbert(p[:2], q[:2])
    got = float(refgeo.hilbert_distance(xs.asarray(p), xs.asarray(q)))
    assert got == pytest.approx(want, rel=1e-12)
    assert got == float(refgeo.hilbert_distance(p, q))
