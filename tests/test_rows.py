"""Row geometry (docs/theory/rows.md): the public API of refgeo.rows against naive NumPy and closed forms.

Every test runs on every backend (``backend`` fixture).  The oracle here is plain
NumPy broadcasting (``_naive_dist``), independent of refgeo's blocked reference.
"""

from __future__ import annotations

import itertools
import math
import re
import warnings
from fractions import Fraction

import numpy as np
import pytest
import scipy.spatial.distance
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import refgeo
from refgeo.testing import strategies as rst

from ._layouts import assert_same_result, other_layouts

finite = dict(allow_nan=False, allow_infinity=False, allow_subnormal=False)


def _naive_dist(A, B):
    """All distances by direct float64 differences (small inputs only).

    Computed on the rows scaled to a largest entry near 1 (the way ``math.hypot``
    avoids underflow), then scaled back: otherwise squares of tiny differences such as
    1e-211 underflow to 0 here, where refgeo returns the representable answer.
    """
    A = np.asarray(A, dtype=np.float64)
    B = np.asarray(B, dtype=np.float64)
    m = max(float(np.abs(A).max()), float(np.abs(B).max()))
    e = math.frexp(m)[1] if m > 0 else 0
    A, B = np.ldexp(A, -e), np.ldexp(B, -e)
    return np.ldexp(np.sqrt(((A[:, None, :] - B[None, :, :]) ** 2).sum(-1)), e)


def _assert_same_partners(got, Dm, want):
    """``got`` indices equal the naive oracle's ``want`` (rows of indices into the columns
    of ``Dm``), except where the two are tied to rounding: the oracle sums the squares in
    NumPy's order and compares rounded square roots, refgeo compares the canonical sums
    (at rows 1e-8 apart beside a distance of 4 the square roots tie where the sums differ
    by an ulp, and refgeo orders by the sums)."""
    got, want = np.asarray(got), np.asarray(want)
    rows = np.arange(len(Dm))[:, None] if want.ndim == 2 else np.arange(len(Dm))
    np.testing.assert_allclose(Dm[rows, got], Dm[rows, want], rtol=1e-14)


def _naive_extreme(S, maximize):
    Dm = _naive_dist(S, S)
    V = len(S)
    iu = np.triu_indices(V, 1)
    vals = Dm[iu]
    k = int(np.argmax(vals) if maximize else np.argmin(vals))  # first: smallest (i, j)
    return vals[k], int(iu[0][k]), int(iu[1][k])


def _brute_force_radius(S):
    """Minimum enclosing ball radius by enumeration, independent of refgeo's solver.

    The ball is fixed by a support set of at most d + 1 rows, and its center is the
    circumcenter of that set in the set's affine hull; so the smallest circumradius
    over all such subsets whose ball holds every row is the covering radius
    (exponential in V: small inputs only).
    """
    S = np.asarray(S, dtype=np.float64)
    V, d = S.shape
    best = math.inf
    for m in range(1, min(V, d + 1) + 1):
        for sub in itertools.combinations(range(V), m):
            P = S[list(sub)]
            # center c = P0 + B^T y with B = P[1:] - P0 and |c - P_t| equal for all t:
            # 2 B B^T y = |B|^2 rowwise
            B = P[1:] - P[0]
            if m == 1:
                c = P[0]
            else:
                G = B @ B.T
                y, *_ = np.linalg.lstsq(2.0 * G, np.sum(B * B, axis=1), rcond=None)
                c = P[0] + B.T @ y
                r_sub = np.linalg.norm(P - c, axis=1)
                if np.ptp(r_sub) > 1e-9 * max(1.0, r_sub.max()):  # degenerate subset
                    continue
            r = float(np.linalg.norm(S - c, axis=1).max())
            if r < best:
                best = r
    return best


@st.composite
def clouds(draw, max_v=9, max_d=5):
    """float64 rows with entries anywhere in [-10, 10] (the public row strategies draw
    structured clouds; this one samples the plain range, used against naive NumPy)."""
    V = draw(st.integers(2, max_v))
    d = draw(st.integers(1, max_d))
    S = draw(hnp.arrays(np.float64, (V, d), elements=st.floats(-10, 10, **finite)))
    if draw(st.booleans()):  # an exact duplicate row
        S[draw(st.integers(0, V - 1))] = S[draw(st.integers(0, V - 1))]
    return S


# ------------------------------------------------------------------ against naive NumPy


@settings(max_examples=200)
@given(clouds())
def test_extreme_pairs_match_naive(backend, S):
    for fn, maximize in ((refgeo.row_diameter, True), (refgeo.closest_pair, False)):
        r = fn(S)
        v, i, j = _naive_extreme(S, maximize)
        # A distance far below the largest entry m has a subnormal square: refgeo keeps
        # the absolute accuracy of the squared sum there (module docstring), ~2**-500 m.
        atol = max(float(np.abs(S).max()) * 2.0**-500, 1e-300)
        assert r.value == pytest.approx(v, rel=1e-14, abs=atol)
        if (r.i, r.j) != (i, j):
            # the naive oracle rounds differently from the canonical sum: another pair
            # may win only when it is tied with the oracle's to rounding
            Dm = _naive_dist(S, S)
            assert Dm[r.i, r.j] == pytest.approx(v, rel=1e-14, abs=atol)
        assert r.i < r.j
        assert r.backend == backend
        assert r.dtype == "float64"


@settings(max_examples=100)
@given(clouds())
def test_farthest_partners_match_naive(backend, S):
    fp = refgeo.farthest_partners(S)
    Dm = _naive_dist(S, S)
    np.fill_diagonal(Dm, -np.inf)
    _assert_same_partners(fp.indices, Dm, np.argmax(Dm, axis=1))
    np.testing.assert_allclose(fp.distances, Dm.max(1), rtol=1e-14)
    assert fp.indices.dtype == np.int64 and fp.distances.dtype == np.float64
    assert not fp.indices.flags.writeable


@settings(max_examples=100)
@given(clouds(), st.data())
def test_knn_matches_naive(backend, S, data):
    V = len(S)
    k = data.draw(st.integers(1, V - 1))
    r = refgeo.knn(S, k)
    Dm = _naive_dist(S, S)
    np.fill_diagonal(Dm, np.inf)
    order = np.argsort(Dm, axis=1, kind="stable")[:, :k]
    _assert_same_partners(r.indices, Dm, order)
    np.testing.assert_allclose(r.distances, np.take_along_axis(Dm, order, 1), rtol=1e-14)
    Y = data.draw(hnp.arrays(np.float64, (data.draw(st.integers(1, 6)), S.shape[1]),
                             elements=st.floats(-10, 10, **finite)))
    k2 = data.draw(st.integers(1, len(Y)))
    r2 = refgeo.knn(S, k2, Y)
    Dm = _naive_dist(S, Y)
    order = np.argsort(Dm, axis=1, kind="stable")[:, :k2]
    _assert_same_partners(r2.indices, Dm, order)


def test_neighbors_are_ordered_by_the_squared_sums_where_the_distances_tie(backend):
    """Rows 2**-24 apart beside a distance of 4 (CI's example against the naive
    oracle): the squared distances from row 1 are 16 + 2**-48 (one ulp of 16) to row 0
    and 16 to row 2, whose square roots both round to 4.0.  The order is the squared
    sums', so row 2 is nearer, whatever the rounded distances say."""
    S = np.array([[2.0**-24, 0.0], [0.0, 4.0], [0.0, 0.0]])
    assert 16.0 + 2.0**-48 > 16.0 and math.sqrt(16.0 + 2.0**-48) == 4.0
    r = refgeo.knn(S, 2)
    np.testing.assert_array_equal(r.indices[1], [2, 0])
    np.testing.assert_array_equal(r.distances[1], [4.0, 4.0])
    assert refgeo.farthest_partners(S).indices[1] == 0


def test_knn_keep_self():
    S = np.array([[0.0], [1.0], [3.0]])
    r = refgeo.knn(S, 1, exclude_self=False)
    np.testing.assert_array_equal(r.indices, [[0], [1], [2]])
    np.testing.assert_array_equal(r.distances, 0.0)


# ------------------------------------------------------------------ identities


def test_regular_simplex_closed_forms(backend):
    E = np.eye(5) * 3.0
    assert refgeo.row_diameter(E).value == pytest.approx(3.0 * math.sqrt(2), rel=1e-15)
    assert refgeo.distance_ratio(E) == 1.0
    ball = refgeo.covering_radius(E)
    # k = 4 (rank of centered rows): rad = J_4 * D for the regular simplex
    rad = refgeo.jung_constant(4) * 3.0 * math.sqrt(2)
    assert ball.radius == pytest.approx(rad, rel=1e-12)
    assert ball.lower_bound == pytest.approx(rad, rel=1e-10)
    assert ball.lower_bound <= rad * (1 + 1e-14)


@settings(max_examples=50)
@given(rst.row_clouds(dtypes=np.float64, n_rows=(2, 8), n_cols=(1, 4), max_offset=1e2), st.floats(0.1, 5.0))
def test_worst_case_hidden_state_attains_HD(backend, S, H):
    D = refgeo.row_diameter(S).value
    w = refgeo.worst_case_hidden_state(S, H=H)
    assert w.value == pytest.approx(H * D, rel=1e-14)
    assert np.linalg.norm(w.h) == pytest.approx(H if D > 0 else 0.0, rel=1e-13)
    z = S @ w.h
    assert z.max() - z.min() == pytest.approx(H * D, rel=1e-12, abs=1e-12)
    rng = np.random.default_rng(0)
    for h in rng.standard_normal((8, S.shape[1])):
        z = S @ h
        assert z.max() - z.min() <= np.linalg.norm(h) * D * (1 + 1e-12) + 1e-12


@settings(max_examples=50)
@given(rst.row_clouds(dtypes=np.float64, n_rows=(2, 8), n_cols=(1, 4), max_offset=1e2))
def test_backward_bound(backend, S):
    D = refgeo.row_diameter(S)
    r = np.zeros(len(S))
    r[D.i], r[D.j] = 1.0, -1.0
    assert np.linalg.norm(S.T @ r) == pytest.approx(refgeo.backward_bound(S, r), rel=1e-13, abs=1e-13)
    rng = np.random.default_rng(1)
    R = rng.standard_normal((5, len(S)))
    R -= R.mean(1, keepdims=True)
    b = refgeo.backward_bound(S, R)
    assert np.all(np.linalg.norm(R @ S, axis=1) <= b * (1 + 1e-12) + 1e-12)


@settings(max_examples=100)
@given(clouds(max_v=9, max_d=5), st.integers(0, 2**32 - 1), st.floats(0.125, 8.0))
def test_row_geometry_invariances(backend, S, seed, alpha):
    """D and m are invariant under a common translation, right-orthogonal maps and row
    permutations, and scale with |alpha|.  Permutations and power-of-two scalings are
    exact in floating point; translations and rotations hold to the rounding of the
    transformed rows."""
    rng = np.random.default_rng(seed)
    D, m = refgeo.row_diameter(S), refgeo.closest_pair(S)
    scale = max(1.0, float(np.abs(S).max()))
    tol = 1e-12 * scale * math.sqrt(S.shape[1])
    # permutation: the same values exactly; the pair is the image of a tied pair
    perm = rng.permutation(len(S))
    Dp, mp = refgeo.row_diameter(S[perm]), refgeo.closest_pair(S[perm])
    assert Dp.value == D.value and mp.value == m.value
    assert np.linalg.norm(S[perm[Dp.i]] - S[perm[Dp.j]]) == pytest.approx(D.value, abs=tol)
    # power-of-two scaling: exact while the squared differences stay normal floats
    a = 2.0 ** round(math.log2(alpha))
    for got, want in ((refgeo.row_diameter(-a * S).value, D.value), (refgeo.closest_pair(a * S).value, m.value)):
        if min(a, 1.0) * want > 1e-150:
            assert got == a * want
        else:  # subnormal squares round differently at each scale
            assert got == pytest.approx(a * want, rel=1e-6, abs=1e-300)
    # translation and orthogonal maps: up to rounding of the new rows
    shift = rng.uniform(-10, 10, size=S.shape[1])
    assert refgeo.row_diameter(S + shift).value == pytest.approx(D.value, abs=4 * tol)
    assert refgeo.closest_pair(S + shift).value == pytest.approx(m.value, abs=4 * tol)
    Q, _ = np.linalg.qr(rng.standard_normal((S.shape[1], S.shape[1])))
    assert refgeo.row_diameter(S @ Q).value == pytest.approx(D.value, abs=4 * tol)
    assert refgeo.closest_pair(S @ Q).value == pytest.approx(m.value, abs=4 * tol)


@settings(max_examples=50)
@given(rst.row_clouds(dtypes=np.float64, n_rows=(1, 7), n_cols=(1, 4), max_offset=1e2))
def test_covering_radius_bounds(S):
    """The certificate brackets the covering radius found by enumeration."""
    ball = refgeo.covering_radius(S)
    rad = _brute_force_radius(S)
    slack = 1e-9 * rad + 1e-12
    assert ball.lower_bound <= rad + slack
    assert rad <= ball.radius + slack
    assert ball.radius - ball.lower_bound <= 1e-9 * ball.radius + 1e-12
    if len(S) < 2:
        assert ball.radius == 0.0
        return
    D = refgeo.row_diameter(S).value
    # a rank too low makes the Jung bound too small (an absolute tolerance of 1e-9
    # called two rows 9.3e-10 apart rank 0); one too high only loosens it, so the
    # tolerance is relative to the centered rows, and distinct rows span a direction
    k = max(1, np.linalg.matrix_rank(S - S.mean(0))) if D > 0 else 0
    assert D / 2 <= ball.radius * (1 + 1e-9) + 1e-12
    assert ball.radius <= refgeo.jung_constant(int(k)) * D * (1 + 1e-9) + 1e-12
    assert np.all(np.linalg.norm(S - ball.center, axis=1) <= ball.radius * (1 + 1e-12) + 1e-12)
    assert D <= math.sqrt(2) * np.linalg.norm(S, 2) * (1 + 1e-12) + 1e-12


@pytest.mark.parametrize("const", [0.1, 1e40, -1e50])
def test_covering_radius_with_a_constant_column_far_from_the_spread(const):
    """A constant column's mean is off by an ulp of it, a shift common to every row,
    which the center's rounding multiplied back in: beside a spread of 5e-40 (or 10,
    or 2) the certified lower bound came out 1e7 (or 1e8, or 1e19) times the radius.
    Now the bracket holds against brute force, and the column's center is the value."""
    rng = np.random.default_rng(0)
    for spread in (1e-39, 10.0):
        S = np.c_[np.full(7, const), spread * rng.standard_normal((7, 3))]
        ball = refgeo.covering_radius(S)
        rad = _brute_force_radius(S[:, 1:])
        assert ball.lower_bound <= rad * (1 + 1e-9) and rad <= ball.radius * (1 + 1e-9)
        assert ball.radius <= refgeo.row_diameter(S).value
        assert ball.center[0] == const
    S = np.array([[0.1, -5e-40, -2e-40], [0.1, 0.0, -1e-40], [0.1, -1e-40, -5e-40]])  # found by a review
    ball = refgeo.covering_radius(S)
    assert ball.lower_bound <= _brute_force_radius(S[:, 1:]) * (1 + 1e-9) <= ball.radius * (1 + 2e-9)


@pytest.mark.parametrize("dtype, scale", [(np.float32, 1.0), (np.float64, 1e200)])
def test_covering_radius_holds_one_float64_copy_of_the_rows(dtype, scale):
    """The solver's temporaries were two more arrays of the size of the rows (a 200,000 x
    64 float32 file: 314 MB for 51 MB of rows); now one float64 copy, scaled (rows of
    1e200 are solved times a power of two) and centered in place, and the distances to
    the center in blocks."""
    import tracemalloc

    S = (np.random.default_rng(4).standard_normal((20_000, 64)) * scale).astype(dtype)
    copy = S.size * 8
    tracemalloc.start()
    try:
        ball = refgeo.covering_radius(S, max_iter=200)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1.5 * copy, (peak, copy)  # the old code: 3 copies
    assert np.all(np.linalg.norm((S - ball.center) / scale, axis=1) <= ball.radius / scale * (1 + 1e-6))


def test_hilbert_rms_matches_definition(backend):
    rng = np.random.default_rng(3)
    S = rng.standard_normal((7, 4))
    Hs = rng.standard_normal((5, 4))
    Z = Hs @ S.T
    want = math.sqrt(np.mean((Z.max(1) - Z.min(1)) ** 2))
    assert refgeo.hilbert_rms(S, Hs) == pytest.approx(want, rel=1e-14)
    assert refgeo.hilbert_rms(S, Hs) <= np.linalg.norm(Hs, axis=1).max() * refgeo.row_diameter(S).value


def test_jung_constant_values():
    assert refgeo.jung_constant(0) == 0.0
    assert refgeo.jung_constant(1) == 0.5
    assert refgeo.jung_constant(2) == pytest.approx(1 / math.sqrt(3), rel=1e-15)
    # ranks beyond the float range: J_k -> 1/sqrt(2) (the ratio k / (2 (k + 1)) is a float)
    assert refgeo.jung_constant(10**400) == math.sqrt(0.5)
    assert refgeo.jung_constant(np.int64(2**62)) == math.sqrt(0.5)


# ------------------------------------------------------------------ memory layout


_ROW_FUNCTIONS = {
    "row_diameter": lambda S, R, Hs: refgeo.row_diameter(S),
    "closest_pair": lambda S, R, Hs: refgeo.closest_pair(S),
    "distance_ratio": lambda S, R, Hs: refgeo.distance_ratio(S),
    "farthest_partners": lambda S, R, Hs: refgeo.farthest_partners(S),
    "knn": lambda S, R, Hs: refgeo.knn(S, 1),
    "knn_Y": lambda S, R, Hs: refgeo.knn(Hs, 2, S),
    "covering_radius": lambda S, R, Hs: refgeo.covering_radius(S),
    "worst_case_hidden_state": lambda S, R, Hs: refgeo.worst_case_hidden_state(S, H=3.0),
    "hilbert_rms": lambda S, R, Hs: refgeo.hilbert_rms(S, Hs),
    "backward_bound": lambda S, R, Hs: refgeo.backward_bound(S, R),
}


@pytest.mark.parametrize("name", sorted(_ROW_FUNCTIONS))
@settings(max_examples=25)
@given(seed=st.integers(0, 2**32 - 1), V=st.integers(3, 40), d=st.integers(1, 40))
@example(seed=0, V=3, d=1)  # the smallest panel
@example(seed=1, V=9, d=8)  # the refinement's lane of 8, and one past it
@example(seed=2, V=40, d=9)
def test_results_do_not_depend_on_memory_layout(backend, name, seed, V, d):
    """Fortran-order, strided and reversed views of the same values give the same bits
    (NumPy's reductions and BLAS otherwise sum in an order set by the strides)."""
    fn = _ROW_FUNCTIONS[name]
    rng = np.random.default_rng(seed)
    S = rng.standard_normal((V, d)) + 10.0 * rng.standard_normal(d)
    R = rng.standard_normal((7, V))
    R -= R.mean(axis=1, keepdims=True)
    Hs = rng.standard_normal((9, d))
    want = fn(S, R, Hs)
    for arrays in zip(other_layouts(S), other_layouts(R), other_layouts(Hs)):
        assert_same_result(fn(*arrays), want)


# ------------------------------------------------------------------ array API (array-api-strict)


def test_reference_runs_on_array_api_strict():
    xps = pytest.importorskip("array_api_strict")
    rng = np.random.default_rng(4)
    S = rng.standard_normal((11, 3))
    Sx = xps.asarray(S)
    with refgeo.use_backend("reference"):
        want = refgeo.row_diameter(S)
    got = refgeo.row_diameter(Sx)
    assert (got.value, got.i, got.j) == (want.value, want.i, want.j)
    assert got.backend == "reference"
    c = refgeo.closest_pair(Sx)
    _, i, j = _naive_extreme(S, False)
    assert (c.i, c.j) == (i, j)
    kn = refgeo.knn(Sx, 3)
    Dm = _naive_dist(S, S)
    np.fill_diagonal(Dm, np.inf)
    np.testing.assert_array_equal(np.from_dlpack(kn.indices), np.argsort(Dm, 1, kind="stable")[:, :3])
    fp = refgeo.farthest_partners(Sx)
    assert isinstance(fp.indices, type(Sx))
    ball = refgeo.covering_radius(Sx)
    assert isinstance(ball.center, type(Sx))


def test_hilbert_rms_and_backward_bound_run_on_array_api_strict():
    """Both work in blocks whose last slice ran past the array's end: NumPy clips such a
    slice, array-api-strict raised IndexError (the array API leaves it unspecified)."""
    xps = pytest.importorskip("array_api_strict")
    rng = np.random.default_rng(0)
    S, H, r = rng.standard_normal((30, 6)), rng.standard_normal((11, 6)), rng.standard_normal((4, 30))
    got = refgeo.hilbert_rms(xps.asarray(S), xps.asarray(H))
    Z = H @ S.T  # the logit changes of the panel, one row per hidden state
    assert float(got) == pytest.approx(np.sqrt(np.mean((Z.max(axis=1) - Z.min(axis=1)) ** 2)), rel=1e-12)
    bound = refgeo.backward_bound(xps.asarray(S), xps.asarray(r))
    assert isinstance(bound, type(xps.asarray(S)))
    np.testing.assert_allclose(np.from_dlpack(bound), refgeo.backward_bound(S, r), rtol=0, atol=0)
    assert float(refgeo.backward_bound(xps.asarray(S), xps.asarray(r[0]))) == refgeo.backward_bound(S, r[0])


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "fn", [refgeo.row_diameter, refgeo.closest_pair, refgeo.farthest_partners, refgeo.distance_ratio]
)
def test_bad_input(fn):
    with pytest.raises(ValueError, match=re.escape("S must contain only finite values, got 1 NaN")):
        fn(np.array([[0.0, np.nan], [1.0, 2.0]]))
    with pytest.raises(ValueError, match=re.escape("got 0 NaN and 1 infinite entries instead.")):
        fn(np.array([[0.0, np.inf], [1.0, 2.0]]))
    with pytest.raises(ValueError, match=re.escape("S must be a 2-D array of shape (V, d), got shape (3,) instead.")):
        fn(np.zeros(3))
    with pytest.raises(ValueError, match=re.escape("S must be non-empty, got shape (0, 3) instead.")):
        fn(np.zeros((0, 3)))
    with pytest.raises(ValueError, match=re.escape("S must have at least 2 rows (shape (V, d)), got shape (1, 3) instead.")):
        fn(np.zeros((1, 3)))
    with pytest.raises(TypeError, match=re.escape("S must have a real floating dtype")):
        fn(np.zeros((2, 2), dtype=complex))
    with pytest.raises(ValueError, match=re.escape("tile_size == 0, must be >= 1.")):
        fn(np.zeros((2, 2)), tile_size=0)
    with pytest.raises(ValueError, match=re.escape("n_threads == 0, must be >= 1.")):
        fn(np.zeros((2, 2)), n_threads=0)


@pytest.mark.skipif(np.finfo(np.longdouble).max <= np.finfo(np.float64).max, reason="longdouble is float64 here")
def test_longdouble_entries_beyond_the_float64_range_are_named():
    """float64 conversion made them inf, with an overflow RuntimeWarning, and the error
    then spoke of infinite entries that the input did not have."""
    S = np.array([[np.longdouble("1e400"), 0.0], [0.0, 0.0]], dtype=np.longdouble)
    msg = "S must have entries within the float64 range (|x| <= 1.798e+308), got 1 entry beyond it (largest 1e+400) instead."
    with pytest.raises(ValueError, match=re.escape(msg)):
        refgeo.row_diameter(S)
    assert refgeo.row_diameter(np.array([[3, 4], [0, 0]], dtype=np.longdouble)).value == 5.0


def test_masked_entries_are_rejected_not_ignored():
    """np.asarray drops the mask: the masked values were used as data."""
    S = np.ma.array([[0.0, 0.0], [3.0, 4.0], [1e6, 0.0]], mask=[[0, 0], [0, 0], [1, 0]])
    msg = "S must not have masked entries (NumPy would use the values under the mask), got 1 masked entry instead"
    with pytest.raises(TypeError, match=re.escape(msg)):
        refgeo.row_diameter(S)
    with pytest.raises(TypeError, match=re.escape("hidden must not have masked entries")):
        refgeo.hilbert_rms(np.eye(2), np.ma.array([1.0, 2.0], mask=[0, 1]))
    # a masked array without masked entries is its data
    assert refgeo.row_diameter(np.ma.array(S.data[:2])).value == 5.0


def test_integer_input_is_converted_to_float64(backend):
    S = np.array([[0, 0], [3, 4], [1, 1]], dtype=np.int32)
    r = refgeo.row_diameter(S)
    assert (r.value, r.i, r.j, r.dtype) == (5.0, 0, 1, "float64")



@pytest.mark.parametrize("dtype", [np.int64, np.uint64])
def test_integers_beyond_two_to_the_53_are_refused(backend, dtype):
    """float64 holds every integer up to 2**53 and not 2**53 + 1: up to there integer
    rows keep their exact distances, beyond it a silent rounding would make rows that
    differ exact copies."""
    big = 2**53
    S = np.array([[big, 0], [big - 1, 0], [0, 0]], dtype=dtype)
    r = refgeo.closest_pair(S)
    assert (r.value, r.i, r.j) == (1.0, 0, 1)
    S[0, 0] = big + 1  # rounds to 2**53, which is 2 from row 1: no longer 1 apart exactly
    for fn, name in ((refgeo.closest_pair, "S"), (refgeo.row_diameter, "S"), (lambda X: refgeo.knn(X, 1), "X")):
        with pytest.raises(ValueError, match=re.escape(f"{name} must have integer entries of magnitude at most "
                                                       f"2**53 = {big}, which float64 holds exactly, got {big + 1}")):
            fn(S)
    if dtype == np.int64:
        S[0, 0] = -big - 1  # the negative side as well
        with pytest.raises(ValueError, match=f"got {big + 1} instead"):
            refgeo.row_diameter(S)


def test_listed_integers_beyond_two_to_the_53_are_refused():
    """A list that mixes integers from 2**63 on with others becomes float64 in NumPy (the
    rounding happens there, before any integer array exists): refused as well."""
    with pytest.raises(ValueError, match=re.escape(f"got {2**63 + 1} instead")):
        refgeo.closest_pair([[2**63 + 1, 0], [2**63, 0], [0, 0]])
    with pytest.raises(ValueError, match=re.escape(f"x must have integer entries")):
        refgeo.variation([2**63, 0])
    # floats of that size are floats: kept
    assert refgeo.row_diameter([[2.0**63, 0.0], [0.0, 0.0]]).value == 2.0**63
    # a NaN beside them does not hide them (where NaN is allowed)
    from refgeo._validate import as_float_array

    with pytest.raises(ValueError, match="x must have integer entries"):
        as_float_array([2**63 + 1, 2**63, float("nan")], "x", finite=False)
    # integers beyond every integer dtype make an object array: the same ValueError
    # (it was the TypeError "must have a real floating dtype ... got dtype object")
    for big in (2**64, -(2**63) - 1, 10**30):
        with pytest.raises(ValueError, match=re.escape(f"S must have integer entries of magnitude at most 2**53 = {2**53}")):
            refgeo.row_diameter([[big, 0], [0, 1]])
        # a bare int where an array is expected: the same range error, not a dtype one
        with pytest.raises(ValueError, match=re.escape(f"x must have integer entries of magnitude at most 2**53")):
            refgeo.variation(big)
    with pytest.raises(TypeError, match="got dtype object"):
        refgeo.row_diameter([[object(), 0], [0, 1]])


def test_knn_bad_input():
    S = np.zeros((3, 2))
    with pytest.raises(ValueError, match=re.escape("k == 3, must be <= 2.")):
        refgeo.knn(S, 3)
    with pytest.raises(ValueError, match=re.escape("k == 0, must be >= 1.")):
        refgeo.knn(S, 0)
    with pytest.raises(ValueError, match=re.escape("k == 4, must be <= 3.")):
        refgeo.knn(S, 4, S)
    with pytest.raises(ValueError, match=re.escape("X and Y must have the same number of columns")):
        refgeo.knn(S, 1, np.zeros((2, 3)))
    with pytest.raises(ValueError, match=re.escape("X must have at least 2 rows for k-NN with exclude_self=True")):
        refgeo.knn(np.zeros((1, 2)), 1)
    with pytest.raises(TypeError, match=re.escape("k must be an integer")):
        refgeo.knn(S, 1.5)


def test_distance_ratio_all_equal_rows():
    with pytest.raises(ValueError, match=re.escape("S must have at least two distinct rows")):
        refgeo.distance_ratio(np.ones((3, 2)))


def test_distance_ratio_of_distinct_rows_below_the_resolution_says_so():
    """Rows of a common offset of 1e200 and a spread of 1 are distinct, but every
    distance has a subnormal square once scaled (the documented limit): the error said
    "all rows equal"; it names the limit and the remedy, which works."""
    S = np.array([[1e200, 1.0], [1e200, 2.0], [1e200, 3.0]])
    with pytest.raises(ValueError, match=re.escape("got distinct rows closer than about 2**-537 times the largest "
                                                   "entry instead")):
        refgeo.distance_ratio(S)
    assert refgeo.distance_ratio(S - S[0]) == 0.5


@pytest.mark.skipif(np.finfo(np.longdouble).eps >= np.finfo(np.float64).eps, reason="long double is float64 here")
def test_long_double_rows_that_round_together_are_said_to():
    """Rows 2**-60 apart are distinct in long double and equal once read as float64:
    the error said "all rows equal" of rows that were not, without a word on the
    conversion."""
    S = np.array([[1.0], [1.0]], dtype=np.longdouble)
    S[1, 0] += np.longdouble(2) ** -60
    assert S[1, 0] != S[0, 0]
    with pytest.raises(ValueError, match=re.escape("got all rows equal instead (after rounding long double to float64).")):
        refgeo.distance_ratio(S)
    assert refgeo.row_diameter(S).value == 0.0  # the documented reading: the rounded rows
    with pytest.raises(ValueError, match=re.escape("got all rows equal instead.")):  # equal before too
        refgeo.distance_ratio(np.ones((3, 2), dtype=np.longdouble))
    with pytest.raises(ValueError, match=re.escape("(after rounding long double to float64).")):  # a list
        refgeo.distance_ratio(list(S))


def test_distance_ratio_is_the_ratio_of_the_scaled_rows():
    """As documented: where the public values are rounded (a subnormal closest distance)
    or out of range (a diameter beyond float64), the ratio is still that of the rows."""
    t = 5e-324
    S = np.array([[0.0, 0.0], [3 * t, 3 * t], [1000 * t, 0.0]])
    exact = 3 * math.sqrt(2) / 1000  # |(3t, 3t)| / |(1000t, 0)|
    assert refgeo.distance_ratio(S) == pytest.approx(exact, rel=1e-15)
    assert refgeo.closest_pair(S).value / refgeo.row_diameter(S).value != pytest.approx(exact, rel=1e-3)
    big = np.array([[1e308, 0.0], [-1e308, 0.0], [-1e308, 1e300]])
    with pytest.raises(ValueError, match="beyond the float64 range"):
        refgeo.row_diameter(big)
    assert refgeo.distance_ratio(big) == pytest.approx(5e-9, rel=1e-15)  # 1e300 / 2e308


def test_backward_bound_checks_the_residual_length():
    with pytest.raises(ValueError, match=re.escape("r must have 2 entries per residual")):
        refgeo.backward_bound(np.eye(2), np.array([1.0, 0.0, -1.0]))


@settings(max_examples=100)
@given(rst.row_clouds(dtypes=np.float64, n_rows=(2, 8), n_cols=(1, 4), max_offset=1e4),
       st.integers(0, 2**32 - 1), st.sampled_from([1e-3, 1.0, 1e3]))
def test_backward_bound_covers_residuals_off_zero_sum(S, seed, shift):
    """Residuals with 1^T r != 0 (rows far from the origin, where the sum times the rows'
    position dominates S^T r): the bound holds against S^T r computed in exact rationals."""
    rng = np.random.default_rng(seed)
    R = rng.standard_normal((4, len(S)))
    R -= R.mean(axis=1, keepdims=True)
    R[:, 0] += shift * rng.standard_normal(4)
    got = refgeo.backward_bound(S, R)
    Sf = [[Fraction(float(v)) for v in row] for row in S]
    for r, b in zip(R, got):
        exact = [sum(Fraction(float(ri)) * Sf[i][k] for i, ri in enumerate(r)) for k in range(S.shape[1])]
        norm2 = sum(v * v for v in exact)
        assert float(norm2) <= (b * (1 + 1e-12)) ** 2


@pytest.mark.parametrize("c", [0.0, 3.0, -1e4])
def test_backward_bound_off_zero_sum_is_tight_for_two_rows(c):
    # V = 2, one column, r = e_a with s_a the row farther from the origin: D/2 + |mean|
    # is |s_a| exactly; r = e_a - e_b is the zero-sum equality case.
    S = np.array([[c], [c + 1.0]]) if c >= 0 else np.array([[c + 1.0], [c]])
    a = 1
    assert refgeo.backward_bound(S, np.eye(2)[a]) == abs(S[a, 0])
    assert refgeo.backward_bound(S, np.eye(2)[a] - np.eye(2)[1 - a]) == 1.0


def test_worst_case_hidden_state_at_zero_radius_has_no_negative_zeros():
    w = refgeo.worst_case_hidden_state(np.array([[0.0, 0.0], [3.0, 4.0]]), H=0.0)
    assert w.value == 0.0
    np.testing.assert_array_equal(w.h, [0.0, 0.0])
    assert not np.any(np.signbit(w.h))  # h = H (s_a - s_b)/D with s_a - s_b = (-3, -4)


def test_backward_bound_covers_a_low_precision_softmax_residual():
    """A bfloat16 softmax residual sums to about 1e-3; with rows 1e4 from the origin
    ||S^T r|| is then far above D(S) ||r||_1 / 2 (the sum times the rows' position).
    The bound adds |1^T r| ||mean row|| and holds; centered in float64, the residual gets
    D(S) ||r||_1 / 2 back."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    S = rng.standard_normal((64, 4)) + 1e4
    r = torch.softmax(torch.tensor(rng.standard_normal(64), dtype=torch.bfloat16), 0)
    r[5] -= 1
    r64 = r.double().numpy()
    D = scipy.spatial.distance.pdist(S).max()
    assert np.linalg.norm(S.T @ r64) > 1.5 * D * np.abs(r64).sum() / 2  # the zero-sum bound fails
    for x in (r, r64, r64.astype(np.float32)):
        x64 = np.asarray(x.double() if isinstance(x, torch.Tensor) else x, dtype=np.float64)
        got = float(refgeo.backward_bound(S, x))
        assert np.linalg.norm(S.T @ x64) <= got * (1 + 1e-12)
        assert got < 2 * np.linalg.norm(S.T @ x64)  # and it is not vacuous
    rc = r64 - r64.mean()
    got = refgeo.backward_bound(S, rc)
    assert np.linalg.norm(S.T @ rc) <= got * (1 + 1e-12)
    assert got == pytest.approx(D * np.abs(rc).sum() / 2, rel=1e-12)


# ------------------------------------------------------------------ the whole float range


def _exact_dynamic_range(S):
    """S with entries below 2**-300 times its largest set to zero: then every nonzero
    squared difference is a normal float64 at any scale the functions use, and
    scaling by a power of two is exact for the result."""
    m = float(np.max(np.abs(S)))
    return np.where(np.abs(S) < math.ldexp(m, -300), 0.0, S) if m > 0 else S


@settings(max_examples=150)
@given(rst.row_clouds(dtypes=np.float64, n_rows=(2, 9), n_cols=(1, 5)), st.integers(-1000, 1000))
def test_power_of_two_scaling_is_exact_over_the_whole_range(backend, S, k):
    """f(2**k S) == 2**k f(S) for every distance, bit for bit, for k in [-1000, 1000];
    a result beyond the float64 range raises ValueError instead of returning inf."""
    S = _exact_dynamic_range(np.ascontiguousarray(S))
    S2 = np.ldexp(S, k)
    assume(np.all(np.isfinite(S2)) and np.array_equal(np.ldexp(S2, -k), S))
    D = refgeo.row_diameter(S)
    if D.value > 0 and math.log2(D.value) + k >= 1024:  # 2**k D(S) is not a float64
        with pytest.raises(ValueError, match="beyond the float64 range"):
            refgeo.row_diameter(S2)
        if D.value > 0:  # the ratio is scale-free: still finite
            assert refgeo.distance_ratio(S2) == refgeo.distance_ratio(S)
        return
    D2 = refgeo.row_diameter(S2)
    assert (D2.value, D2.i, D2.j) == (math.ldexp(D.value, k), D.i, D.j)
    assert D2.backend == backend and math.isfinite(D2.error_bound)
    m, m2 = refgeo.closest_pair(S), refgeo.closest_pair(S2)
    assert (m2.value, m2.i, m2.j) == (math.ldexp(m.value, k), m.i, m.j)
    if D.value > 0:
        assert refgeo.distance_ratio(S2) == refgeo.distance_ratio(S)
    fp, fp2 = refgeo.farthest_partners(S), refgeo.farthest_partners(S2)
    assert fp2.backend == backend and fp2.dtype == "float64" and fp2.n_refined >= 1
    np.testing.assert_array_equal(fp2.indices, fp.indices)
    np.testing.assert_array_equal(fp2.distances, np.ldexp(fp.distances, k))
    kk = min(3, len(S) - 1)
    kn, kn2 = refgeo.knn(S, kk), refgeo.knn(S2, kk)
    np.testing.assert_array_equal(kn2.indices, kn.indices)
    np.testing.assert_array_equal(kn2.distances, np.ldexp(kn.distances, k))
    Y, Y2 = S[::2], S2[::2]
    kn, kn2 = refgeo.knn(S, 1, Y), refgeo.knn(S2, 1, Y2)
    np.testing.assert_array_equal(kn2.indices, kn.indices)
    np.testing.assert_array_equal(kn2.distances, np.ldexp(kn.distances, k))


def test_rows_of_size_1e200_get_their_finite_diameter(backend):
    rng = np.random.default_rng(0)
    S = rng.random((100, 4))
    big = refgeo.row_diameter(S * 2.0**665)  # about 1e200
    small = refgeo.row_diameter(S)
    assert big.backend == backend
    assert (big.value, big.i, big.j) == (math.ldexp(small.value, 665), small.i, small.j)
    assert big.scale_exponent != 0 and small.scale_exponent == 0
    tiny = refgeo.row_diameter(S * 2.0**-1000)  # about 1e-301: squares would underflow
    assert (tiny.value, tiny.i, tiny.j) == (math.ldexp(small.value, -1000), small.i, small.j)
    ball, ball_big = refgeo.covering_radius(S), refgeo.covering_radius(S * 2.0**665)
    assert ball_big.radius == pytest.approx(math.ldexp(ball.radius, 665), rel=1e-12)
    np.testing.assert_allclose(ball_big.center, np.ldexp(ball.center, 665), rtol=1e-12)


@pytest.mark.parametrize("k", [-1060, -1030, -1000, -600, 0, 600, 1000])
def test_worst_case_hidden_state_over_the_whole_range(backend, k):
    """h* is a direction of norm H at every scale of the rows: scaling S by 2**k scales
    D(S) by 2**k and leaves h* as it is (no inf from H / D for subnormal D)."""
    S = np.array([[0.0, 0.0], [3.0, 4.0], [1.0, 1.0], [-2.0, 1.0]])  # exact at 2**-1060
    base = refgeo.worst_case_hidden_state(S, H=2.0)
    got = refgeo.worst_case_hidden_state(np.ldexp(S, k), H=2.0)
    np.testing.assert_array_equal(got.h, base.h)
    assert (got.i, got.j) == (base.i, base.j)
    assert got.value == math.ldexp(base.value, k)


@pytest.mark.parametrize("k", [-1000, -60, 0, 60, 600, 1000])
@pytest.mark.parametrize("H", [1e200, 1e300, 1.7e308])
def test_worst_case_hidden_state_of_a_large_H_and_a_tiny_diameter(backend, k, H):
    """h* has norm H also where H / D(S) overflows (rows one ulp apart), at every scale
    of the rows; and the value H D(S) is the float64 product."""
    S = np.ldexp(np.array([[1.0, 0.0], [1.0 + 2.0**-52, 0.0]]), k)
    D = refgeo.row_diameter(S).value
    assert D == math.ldexp(1.0, k - 52)
    if not math.isfinite(H * D):
        with pytest.raises(ValueError, match="beyond the float64 range"):
            refgeo.worst_case_hidden_state(S, H=H)
        return
    w = refgeo.worst_case_hidden_state(S, H=H)
    assert (w.i, w.j) == (0, 1)
    np.testing.assert_array_equal(w.h, [-H, 0.0])  # s_0 - s_1 points along -e_1
    assert w.value == H * D


@pytest.mark.parametrize("k", [0, 20, 60, 600, 1000])
@pytest.mark.parametrize("H", [1e-300, 2.2250738585072014e-308])
def test_worst_case_hidden_state_of_a_small_H_and_a_large_diameter(backend, k, H):
    """h* has norm H to the last bits also where H / D(S) is subnormal (it was rounded
    to a few digits: 8e-9 relative for H = 1e-300 and D(S) = 5e15)."""
    S = np.ldexp(np.array([[0.0, 0.0], [3.0, 4.0]]), k)
    w = refgeo.worst_case_hidden_state(S, H=H)
    want = (-0.6 * H, -0.8 * H)  # (s_0 - s_1) / ||s_0 - s_1|| = -(3, 4) / 5
    np.testing.assert_allclose(w.h, want, rtol=4 * 2.0**-52, atol=0.0)


@pytest.mark.parametrize("k", [-1000, -600])
def test_worst_case_hidden_state_of_a_large_H_and_tiny_rows(backend, k):
    """H D(S) is representable although H times the prescaled diameter (about 1) is not:
    the value is the product, not a ValueError (tiny rows were scaled up, and H = 1.7e308
    times their scaled diameter 1.24 overflowed)."""
    S = np.ldexp(np.array([[0.0, 0.0], [-7.0, 7.0]]), k)  # scaled: entries 7/8, diameter 1.24
    H = 1.7e308
    w = refgeo.worst_case_hidden_state(S, H=H)
    D = refgeo.row_diameter(S).value
    assert w.value == pytest.approx(H * D, rel=2.0**-51)
    r = math.sqrt(0.5)  # (s_0 - s_1) / ||s_0 - s_1|| = (1, -1) / sqrt(2)
    np.testing.assert_allclose(w.h, (r * H, -r * H), rtol=4 * 2.0**-52, atol=0.0)


@pytest.mark.parametrize("H", [1e-10, 0.5, 0.0])
def test_worst_case_hidden_state_where_only_the_diameter_overflows(backend, H):
    """H D(S) is a float64 although D(S) = 2 * 1e308 is not: the value and h come back
    (row_diameter's ValueError for D(S) came out of worst_case_hidden_state)."""
    big = 1e308
    S = np.array([[big, 0.0], [-big, 0.0], [0.0, 1.0]])
    w = refgeo.worst_case_hidden_state(S, H=H)
    assert (w.i, w.j) == (0, 1)
    assert w.value == float(Fraction(H) * 2 * Fraction(big))  # one rounding of the exact product
    np.testing.assert_array_equal(w.h, [H, 0.0])  # (s_0 - s_1) / ||s_0 - s_1|| = e_1


@pytest.mark.parametrize("scale", [0.25, 1e-300])
def test_backward_bound_where_only_the_diameter_overflows(backend, scale):
    """The bound D(S) ||r||_1 / 2 is a float64 although D(S) = 2 * 1e308 is not."""
    big = 1e308
    S = np.array([[big, 0.0], [-big, 0.0], [0.0, 1.0]])
    r = np.array([scale, -scale, 0.0])
    want = float(Fraction(2) * Fraction(big) * 2 * Fraction(scale) / 2)
    assert refgeo.backward_bound(S, r) == want
    np.testing.assert_array_equal(refgeo.backward_bound(S, np.stack([r, -r])), [want, want])


def test_worst_case_hidden_state_beyond_the_float64_range_raises(backend):
    S = np.array([[0.0, 0.0], [3.0, 4.0]])
    with pytest.raises(ValueError, match=r"H \* D\(S\) = 1e\+308 \* 5.0 is beyond the float64 range"):
        refgeo.worst_case_hidden_state(S, H=1e308)
    # the largest H: h's entries overflow too, but the ValueError comes first (no
    # RuntimeWarning from forming h; warnings are errors in this suite)
    with pytest.raises(ValueError, match="beyond the float64 range"):
        refgeo.worst_case_hidden_state(np.array([[0.0], [-3.0]]), H=1.7976931348623157e308)
    with pytest.raises(ValueError, match="beyond the float64 range"):
        refgeo.worst_case_hidden_state(np.ldexp(S, 1000), H=1e10)
    assert refgeo.worst_case_hidden_state(S, H=3e307).value == 3e307 * 5.0


@pytest.mark.parametrize("k", [-1064, -1000, -600, 0, 600, 1000])
@pytest.mark.parametrize("which", ["S", "hidden"])
def test_hilbert_rms_over_the_whole_range(k, which):
    """Scaling S or the hidden states by 2**k scales the RMS by exactly 2**k: no inf
    from squares that overflow, no 0 from squares that underflow."""
    S = np.array([[0.0, 0.0], [3.0, 4.0], [1.0, 1.0]])
    Hs = np.array([[1.0, 0.0], [0.0, 1.0], [0.5, -2.0], [0.25, 0.25]])
    base = refgeo.hilbert_rms(S, Hs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = refgeo.hilbert_rms(np.ldexp(S, k), Hs) if which == "S" else refgeo.hilbert_rms(S, np.ldexp(Hs, k))
    assert got == math.ldexp(base, k)


def test_hilbert_rms_of_tiny_spreads_next_to_large_entries():
    """Products that cancel leave a spread of 2**-600 next to entries of size 1: its
    square underflows, the RMS does not."""
    S = np.array([[1.0, -1.0], [2.0**-600, 0.0]])
    Hs = np.array([[1.0, 1.0], [1.0, 1.0]])
    assert refgeo.hilbert_rms(S, Hs) == 2.0**-600
    assert refgeo.hilbert_rms(S, Hs[0]) == 2.0**-600


def _exact_hilbert_rms(S, H):
    """sqrt(mean_t (max_i s_i.h_t - min_i s_i.h_t)^2) in rational arithmetic."""
    from fractions import Fraction

    total = Fraction(0)
    for h in H:
        z = [sum((Fraction(float(a)) * Fraction(float(b)) for a, b in zip(row, h)), Fraction(0)) for row in S]
        total += (max(z) - min(z)) ** 2
    return math.sqrt(total / len(H))


@settings(max_examples=60)
@given(st.integers(2, 6), st.integers(1, 4), st.sampled_from([0.0, 1e8, -1e16, 1e300, 1.7e308]), st.integers(0, 2**32))
@example(2, 1, 1.7e308, 0).via("2 |x| overflowed in the offset test: a RuntimeWarning (an error here)")
def test_hilbert_rms_of_rows_with_a_large_common_offset(V, d, offset, seed):
    """delta_t ignores a common shift of the rows; an offset in the products cancelled
    the spread (rows 1e16 + [1, -1] gave 0 for 2), and prescaling rows of 1e300 flushed
    entries of 1e-300 to zero.  Rows near the largest float gave the right value with
    an overflow warning (HeadStepMonitor.record passed it on)."""
    rng = np.random.default_rng(seed)
    S = rng.integers(-3, 4, size=(V, d)).astype(np.float64) + offset  # small spread, exact entries
    H = rng.integers(-2, 3, size=(3, d)).astype(np.float64)
    want = _exact_hilbert_rms(S, H)
    assert refgeo.hilbert_rms(S, H) == pytest.approx(want, rel=1e-12, abs=0.0)


def test_hilbert_rms_next_to_huge_entries():
    assert refgeo.hilbert_rms(np.array([[1e16, 1.0], [1e16, -1.0]]), np.array([1.0, 1.0])) == 2.0
    S = np.array([[1e300, 1e-300], [1e300, -1e-300]])
    assert refgeo.hilbert_rms(S, np.array([0.0, 1.0])) == pytest.approx(2e-300, rel=1e-15)


def test_hilbert_rms_beyond_the_float64_range_raises():
    S = np.array([[0.0], [1e300]])
    with pytest.raises(ValueError, match="beyond the float64 range"):
        refgeo.hilbert_rms(S, np.array([[1e300]]))


@pytest.mark.parametrize("k", [-1000, -600, 0, 600, 1000])
def test_backward_bound_over_the_whole_range(k):
    """Scaling the residuals or the rows by 2**k scales the bound by exactly 2**k: no
    inf from an l1 norm that overflows on its own; beyond the float64 range, ValueError."""
    S = np.array([[0.0, 0.0], [3.0, 4.0], [1.0, 1.0]])
    R = np.array([[1.0, -1.0, 0.0], [0.25, 0.5, -0.75]])
    base = refgeo.backward_bound(S, R)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_array_equal(refgeo.backward_bound(S, np.ldexp(R, k)), np.ldexp(base, k))
        np.testing.assert_array_equal(refgeo.backward_bound(np.ldexp(S, k), R), np.ldexp(base, k))
        # huge residuals against a tiny step: the l1 norm alone overflows, the bound does not
        got = refgeo.backward_bound(np.ldexp(S, -k), np.ldexp(R, k) * 2.0**23)
        np.testing.assert_array_equal(got, base * 2.0**23)
    with pytest.raises(ValueError, match="beyond the float64 range"):
        refgeo.backward_bound(S * 1e300, R[0] * 1e10)


def test_backward_bound_and_hilbert_rms_take_tensors():
    torch = pytest.importorskip("torch")
    S = np.array([[0.0, 0.0], [3.0, 4.0], [1.0, 1.0]])
    R = np.array([[1.0, -1.0, 0.0], [0.25, 0.5, -0.75]])
    for k in (0, 700, -700):
        St, Rt = torch.tensor(np.ldexp(S, k)), torch.tensor(np.ldexp(R, -k))
        got = refgeo.backward_bound(St, Rt)
        assert isinstance(got, torch.Tensor)
        np.testing.assert_array_equal(got.numpy(), refgeo.backward_bound(np.ldexp(S, k), np.ldexp(R, -k)))
        assert refgeo.backward_bound(St, Rt[0]) == refgeo.backward_bound(S, R[0])
        assert refgeo.hilbert_rms(St, torch.tensor(R[:, :2])) == refgeo.hilbert_rms(np.ldexp(S, k), R[:, :2])


def test_distances_beyond_the_float64_range_raise(backend):
    S = np.array([[-1.5e308, 0.0], [1.5e308, 0.0], [0.0, 1.0]])
    with pytest.raises(ValueError, match=r"row diameter is .* beyond the float64 range"):
        refgeo.row_diameter(S)
    with pytest.raises(ValueError, match="beyond the float64 range"):
        refgeo.farthest_partners(S)
    with pytest.raises(ValueError, match="beyond the float64 range"):
        refgeo.knn(S, 2)
    # the representable answers stay available
    assert refgeo.closest_pair(S).value == pytest.approx(math.hypot(1.5e308, 1.0), rel=1e-15)
    assert refgeo.distance_ratio(S) == pytest.approx(0.5, rel=1e-15)
    np.testing.assert_array_equal(refgeo.knn(S, 1).indices[:, 0], [2, 2, 0])


# ------------------------------------------------------------------ torch tensors


def test_cpu_tensors_run_like_their_numpy_arrays(backend):
    """CPU tensors (requires_grad, non-contiguous) run on the backend their NumPy view
    would, with no warning, and array results come back as tensors."""
    torch = pytest.importorskip("torch")
    if backend == "cupy":
        pytest.skip("CPU tensors run on the CPU backends")
    rng = np.random.default_rng(6)
    S = rng.standard_normal((80, 12))
    t = torch.tensor(S, requires_grad=True)
    strided = torch.tensor(np.repeat(S, 2, axis=1))[:, ::2]  # the same rows, non-contiguous
    assert not strided.is_contiguous()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for T in (t, strided):
            for fn in (refgeo.row_diameter, refgeo.closest_pair):
                got, want = fn(T), fn(S)
                assert got == want and got.backend == backend
                assert isinstance(got.value, float)
            ratio = refgeo.distance_ratio(T)
            assert type(ratio) is float and ratio == refgeo.distance_ratio(S)
            fp, fp_np = refgeo.farthest_partners(T), refgeo.farthest_partners(S)
            assert isinstance(fp.indices, torch.Tensor) and isinstance(fp.distances, torch.Tensor)
            assert fp.indices.dtype == torch.int64 and fp.distances.dtype == torch.float64
            np.testing.assert_array_equal(fp.indices.numpy(), fp_np.indices)
            np.testing.assert_array_equal(fp.distances.numpy(), fp_np.distances)
            assert fp.backend == backend
            kn, kn_np = refgeo.knn(T, 4), refgeo.knn(S, 4)
            assert isinstance(kn.indices, torch.Tensor) and kn.backend == backend
            np.testing.assert_array_equal(kn.indices.numpy(), kn_np.indices)
            np.testing.assert_array_equal(kn.distances.numpy(), kn_np.distances)
        # a tensor for Y alone is enough for tensor results
        kn = refgeo.knn(S[:10], 2, t)
        assert isinstance(kn.indices, torch.Tensor)
        np.testing.assert_array_equal(kn.indices.numpy(), refgeo.knn(S[:10], 2, S).indices)
    assert t.grad is None  # nothing was recorded on the graph


@pytest.mark.gpu
def test_cuda_tensors_run_on_the_gpu_engine_and_come_back_on_their_device():
    """CUDA tensors (requires_grad, non-contiguous, bfloat16) go through DLPack to the
    CuPy engine: the certified pair and value equal those of the same rows as a NumPy
    array on the compiled engine, array results are tensors on the input's device, and
    nothing is recorded on the graph."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("cupy")
    from refgeo import _backend

    if not torch.cuda.is_available() or not _backend.available_backends()["cupy"][0]:
        pytest.skip("needs a CUDA device that torch and CuPy both see")
    rng = np.random.default_rng(16)
    # Zipf-scaled rows around a common direction (most rows tiny, all alike), plus ties
    S = (rng.standard_normal((3000, 48)) + 4.0) / np.arange(1, 3001)[:, None] ** 1.1
    S[10] = S[20]
    t = torch.tensor(S, requires_grad=True, device="cuda")
    strided = torch.tensor(np.repeat(S, 2, axis=1), device="cuda")[:, ::2]
    half = torch.tensor(S, device="cuda").to(torch.bfloat16)
    S_half = half.float().cpu().numpy()
    for T, A in ((t, S), (strided, S), (half, S_half)):
        for fn in (refgeo.row_diameter, refgeo.closest_pair):
            got, want = fn(T), fn(A)
            assert got.backend == "cupy"
            assert (got.value, got.i, got.j) == (want.value, want.i, want.j)
        kn, kn_np = refgeo.knn(T, 5), refgeo.knn(A, 5)
        assert isinstance(kn.indices, torch.Tensor) and kn.indices.device == T.device
        np.testing.assert_array_equal(kn.indices.cpu().numpy(), kn_np.indices)
        np.testing.assert_array_equal(kn.distances.cpu().numpy(), kn_np.distances)
        fp, fp_np = refgeo.farthest_partners(T), refgeo.farthest_partners(A)
        assert fp.indices.device == T.device
        np.testing.assert_array_equal(fp.indices.cpu().numpy(), fp_np.indices)
    assert refgeo.row_diameter(half).converted_from == "torch.bfloat16"
    assert t.grad is None


def test_the_other_row_functions_take_tensors_like_the_engine_functions():
    """covering_radius, worst_case_hidden_state, hilbert_rms and backward_bound take
    requires_grad and half-precision tensors without warnings, record nothing on the
    graph, equal the NumPy results and return tensors where they return arrays."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(12)
    S = rng.standard_normal((9, 3))
    Hs = rng.standard_normal((4, 3))
    R = np.zeros((2, 9))
    R[0, :2] = [1.0, -1.0]
    R[1, 3:6] = [0.5, 0.5, -1.0]
    t = torch.tensor(S, requires_grad=True)
    half = torch.tensor(S).to(torch.bfloat16)
    S_half = half.to(torch.float32).numpy()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for T, A in ((t, S), (half, S_half)):
            ball, want = refgeo.covering_radius(T), refgeo.covering_radius(A)
            assert ball.radius == want.radius and isinstance(ball.center, torch.Tensor)
            np.testing.assert_array_equal(ball.center.numpy(), want.center)
            np.testing.assert_array_equal(ball.weights.numpy(), want.weights)
            w, want = refgeo.worst_case_hidden_state(T), refgeo.worst_case_hidden_state(A)
            assert isinstance(w.h, torch.Tensor) and w.h.grad_fn is None
            np.testing.assert_array_equal(w.h.numpy(), want.h)
            assert (w.value, w.i, w.j) == (want.value, want.i, want.j)
            Ht = torch.tensor(Hs, requires_grad=True)
            assert refgeo.hilbert_rms(T, Ht) == refgeo.hilbert_rms(A, Hs)
            b = refgeo.backward_bound(T, torch.tensor(R, requires_grad=True))
            assert isinstance(b, torch.Tensor) and b.grad_fn is None
            np.testing.assert_array_equal(b.numpy(), refgeo.backward_bound(A, R))
    assert t.grad is None


@pytest.mark.parametrize("half", ["bfloat16", "float16"])
def test_half_precision_tensors_are_upcast_to_float32(backend, half):
    torch = pytest.importorskip("torch")
    if backend == "cupy":
        pytest.skip("CPU tensors run on the CPU backends")
    t = torch.randn(50, 8).to(getattr(torch, half))
    S32 = t.to(torch.float32).numpy()  # exact: float32 holds every half value
    for fn in (refgeo.row_diameter, refgeo.closest_pair):
        got, want = fn(t), fn(S32)
        assert (got.value, got.i, got.j, got.dtype) == (want.value, want.i, want.j, "float32")
        assert got.converted_from == f"torch.{half}" and want.converted_from is None
    kn = refgeo.knn(t, 3)
    assert kn.dtype == "float32" and kn.converted_from == f"torch.{half}"
    np.testing.assert_array_equal(kn.indices.numpy(), refgeo.knn(S32, 3).indices)
    assert refgeo.farthest_partners(t).converted_from == f"torch.{half}"


def test_tensors_on_devices_refgeo_cannot_run():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"S is a sparse tensor \(layout torch.sparse_coo\).*S.to_dense\(\)"):
        refgeo.row_diameter(torch.eye(3).to_sparse())
    with pytest.raises(TypeError, match=r"Y is a sparse tensor"):
        refgeo.knn(np.eye(3), 1, torch.eye(3).to_sparse())
    with pytest.raises(TypeError, match=r"S is a meta tensor \(a shape without values\)"):
        refgeo.row_diameter(torch.empty((3, 2), device="meta"))
    if torch.cuda.is_available():
        try:
            import cupy  # noqa: F401
        except ImportError:
            with pytest.raises(TypeError, match="CUDA tensor.*CuPy is not installed: install it"):
                refgeo.row_diameter(torch.zeros((3, 2), device="cuda"))


def test_backward_bound_sums_the_residual_exactly():
    """Rows 1e20 from the origin with D(S) = 1: a float sum of r that rounds to 0 (or
    to 1e-30) would hide the term 1e-17 * 1e20 = 1000 of S^T r; the sum is taken
    correctly rounded."""
    S = np.array([[1e20, 1.0], [1e20, 0.0], [1e20, 0.0], [1e20, 0.0]])
    for r in (np.array([1.0, 1e-17, -1.0, 0.0]), np.array([1.0, 1e-17, -1.0, 1e-30])):
        Sf = [[Fraction(float(v)) for v in row] for row in S]
        exact = [sum(Fraction(float(ri)) * Sf[i][k] for i, ri in enumerate(r)) for k in range(2)]
        norm = math.sqrt(float(sum(v * v for v in exact)))
        got = refgeo.backward_bound(S, r)
        assert norm <= got * (1 + 1e-12)
        np.testing.assert_array_equal(refgeo.backward_bound(S, np.stack([r, r])), [got, got])


def test_backward_bound_second_term_overflow_is_a_value_error():
    # the term itself overflows (2e300 * 5e9), or both terms fit and their sum does not
    with pytest.raises(ValueError, match=re.escape("|1^T r| ||mean row of S|| is beyond the float64 range")):
        refgeo.backward_bound(np.array([[1e10, 0.0], [0.0, 1.0]]), np.array([1e300, 1e300]))
    with pytest.raises(ValueError, match=re.escape("the backward bound is")):
        refgeo.backward_bound(np.array([[1.7e308, 0.0], [0.0, 1.7e308]]), np.array([1.0, 0.0]))


def _cancelling_sums():
    # entries of wildly different sizes that cancel: a big value, its negative and small
    # ones in between (the sums a float loop gets wrong), or random magnitudes
    big = st.floats(1.0, 1e16).flatmap(lambda b: st.tuples(st.just(b), st.lists(
        st.floats(-1.0, 1.0, allow_subnormal=False), min_size=0, max_size=6)))
    planted = big.map(lambda t: [t[0], *t[1], -t[0], *[v * 1e-17 for v in t[1]]])
    spread = st.lists(st.tuples(st.floats(-1.0, 1.0), st.integers(-300, 300)),
                      min_size=1, max_size=40).map(lambda vs: [math.ldexp(m, e) for m, e in vs])
    return st.one_of(planted, spread).flatmap(st.permutations)


@settings(max_examples=300)
@given(st.lists(_cancelling_sums(), min_size=1, max_size=3).filter(
    lambda rows: len({len(r) for r in rows}) == 1))
def test_compensated_sums_are_within_their_error_bound(rows):
    """The vectorized sums behind backward_bound against exact rationals: the error is
    within the returned bound, which is zero only for an exact sum and within twice
    the working precision's accuracy, u |sum| + O(log^2 n u^2 ||x||_1)."""
    from array_api_compat import array_namespace

    from refgeo._certify import compensated_sums

    x = np.array(rows, dtype=np.float64)
    got, err, norms = compensated_sums(array_namespace(x), x)
    for row, s, e, l1_got in zip(x, got, err, norms):
        exact = sum(Fraction(float(v)) for v in row)
        assert l1_got == pytest.approx(math.fsum(abs(v) for v in row), rel=1e-14)
        assert abs(Fraction(float(s)) - exact) <= Fraction(float(e))
        l1 = math.fsum(abs(v) for v in row)
        levels = max(1, math.ceil(math.log2(len(row))))
        assert e <= (2**-53 * abs(float(exact)) + 4 * (levels + 1) ** 2 * 2.0**-106 * l1) * (1 + 1e-9) + 1e-300


def test_backward_bound_sums_the_residual_without_a_python_loop():
    """Rows 1e10 from the origin with D(S) = 1: a float sum of r = (1, 1e-17, -1, 0) is 0
    and hides the term 1e-17 * 1e10 = 1e-7 of S^T r, a relative error far above
    rounding; the compensated sum gets it, without the math.fsum fallback, which is
    only for rows more than about 1e12 D(S) out."""
    import unittest.mock

    S = np.array([[1e10, 1.0], [1e10, 0.0], [1e10, 0.0], [1e10, 0.0]])
    r = np.array([[1.0, 1e-17, -1.0, 0.0], [0.5, 1e-17, 0.0, -0.5]])
    assert np.sum(r, axis=1).tolist() == [0.0, 0.0]
    Sf = [[Fraction(float(v)) for v in row] for row in S]
    with unittest.mock.patch("math.fsum", side_effect=AssertionError("fsum called")):
        got = refgeo.backward_bound(S, r)
    for ri, b in zip(r, got):
        exact = [sum(Fraction(float(v)) * Sf[i][k] for i, v in enumerate(ri)) for k in range(2)]
        norm = math.sqrt(float(sum(v * v for v in exact)))
        assert norm <= b * (1 + 1e-15)
        assert b <= norm * (1 + 1e-15) + 1.0  # D/2 ||r0||_1 = 1 plus the 1e-7 term


@pytest.mark.parametrize("shape", [(2**16 + 3,), (2, 3 * 2**16 + 1), (3000, 23)])
def test_compensated_sums_across_blocks(shape):
    """Inputs larger than the 2**16-entry blocks the tree runs on (a row in pieces, or
    many short rows per block): a big value and its negative planted in different
    blocks, small values in between, each sum checked against exact rationals."""
    from array_api_compat import array_namespace

    from refgeo._certify import compensated_sums

    rng = np.random.default_rng(sum(shape))
    x = rng.standard_normal(shape) * 1e-12
    flat = x.reshape(-1, shape[-1])
    for row in flat:
        i, j = rng.choice(shape[-1], 2, replace=False)
        row[i], row[j] = 1e8, -1e8
    got, err, norms = compensated_sums(array_namespace(x), x)
    assert got.shape == norms.shape == shape[:-1]
    np.testing.assert_allclose(norms, np.abs(x).sum(axis=-1), rtol=1e-14)
    for row, s, e in zip(flat, np.reshape(got, -1), np.reshape(err, -1)):
        exact = sum(map(Fraction, row.tolist()))
        assert abs(Fraction(float(s)) - exact) <= Fraction(float(e))
        levels = math.ceil(math.log2(shape[-1])) + 1
        l1 = float(np.abs(row).sum())
        assert abs(float(s) - float(exact)) <= 2**-53 * abs(float(exact)) + 4 * (levels + 1) ** 2 * 2.0**-106 * l1


def _exact_backward_norm(S, r):
    Sf = [[Fraction(float(v)) for v in row] for row in S]
    col = [sum(Fraction(float(ri)) * Sf[i][k] for i, ri in enumerate(r)) for k in range(S.shape[1])]
    top = max(abs(v) for v in col)
    if top == 0:
        return 0.0
    # scaled by the largest entry: the square of 1e-290 underflows
    return float(top) * math.sqrt(float(sum((v / top) ** 2 for v in col)))


@pytest.mark.parametrize("S,r", [
    # the float mean of these rows is 0: the mean row's norm is bounded from column
    # sums to twice the working precision
    (np.array([[1e16], [1.0], [-1e16]]), np.array([1.0, 1.0, 1.0])),
    # a nearly constant residual at V = 3: fl(t / 3) is off t / 3 in every entry
    (np.array([[2.0], [-1.0], [-1.0]]), np.array([0.5167927876527325, np.nextafter(0.5167927876527325, 0),
                                                   np.nextafter(0.5167927876527325, 0)])),
    # the prescaling of r (largest entry 1e308) flushes the entry 1e-300 to zero
    (np.full((3, 2), 1e10), np.array([1e308, -1e308, 1e-300])),
])
def test_backward_bound_holds_where_rounding_cancels(S, r):
    """Three inputs where every float operation of the bound rounds the decisive part
    away (found in review; each returned less than ||S^T r||, two of them 0)."""
    assert _exact_backward_norm(S, r) <= refgeo.backward_bound(S, r)


def test_backward_bound_takes_no_python_loop_for_rows_near_the_origin():
    """Softmax rows (sums near 1) with ||mean row|| about D(S): the compensated sums'
    error is far below the rounding of the bound, so math.fsum is not called (it was,
    for every residual, when the test counted the final rounding u |sigma| as error)."""
    import unittest.mock

    rng = np.random.default_rng(1)
    S = rng.standard_normal((200, 8)) + 3.0
    p = np.exp(rng.standard_normal((50, 200)))
    p /= p.sum(axis=1, keepdims=True)
    with unittest.mock.patch("math.fsum", side_effect=AssertionError("fsum called")):
        got = refgeo.backward_bound(S, p)
    for row, b in zip(p[:5], got[:5]):
        assert _exact_backward_norm(S, row) <= b * (1 + 1e-15)


@pytest.mark.parametrize("max_iter", [0, 1, 2, 5])
def test_a_stopped_covering_radius_brackets_the_exact_radius(max_iter):
    """Stopped early, ``lower_bound <= radius* <= radius``: the lower bound is
    min(sqrt(phi), R), and a mutant returning R alone (above the true radius) passed
    every other test."""
    for seed in range(3):
        S = np.random.default_rng(seed).standard_normal((300, 6))
        exact = refgeo.covering_radius(S, tol=1e-14)
        b = refgeo.covering_radius(S, max_iter=max_iter)
        assert b.lower_bound <= exact.radius * (1 + 1e-12)
        assert b.radius >= exact.lower_bound * (1 - 1e-12)


# ---- scaling and widening of rows at the ends of the float ranges (mutation testing
# ---- of refgeo/_certify.py found these paths unchecked by the engine tests)


def test_rows_far_below_the_normal_range_give_their_exact_distance():
    """2**-1030 is subnormal: the rows are scaled up by a power of two (exact), so the
    diameter is the distance itself, not 0 or a rounded value."""
    r = refgeo.row_diameter(np.array([[0.0], [2.0**-1030]]))
    assert r.value == 2.0**-1030 and (r.i, r.j) == (0, 1)


def test_a_diameter_beyond_the_float64_range_is_a_value_error():
    """3.4e308 is not a float64: an error saying so, never a finite stand-in."""
    with pytest.raises(ValueError, match=r"^the row diameter is .* beyond the float64 range"):
        refgeo.row_diameter(np.array([[1.7e308], [-1.7e308]]))


def test_float32_rows_are_never_scaled_and_float64_rows_outside_the_band_are():
    """The module docstring: float32 squares fit in float64, so float32 rows run
    unscaled (scale_exponent 0) whatever their size; float64 rows outside
    [2**-64, 2**65) run scaled by a power of two, and the distance is still exact."""
    S32 = np.array([[1e30, 0.0], [-1e30, 0.0], [0.0, 1.0]], dtype=np.float32)
    r = refgeo.row_diameter(S32)
    assert r.scale_exponent == 0 and r.dtype == "float32"
    assert (r.i, r.j) == (0, 1) and r.value == 2.0 * float(np.float32(1e30))
    r = refgeo.row_diameter(np.array([[2.0**100], [0.0], [1.0]]))
    assert r.value == 2.0**100 and (r.i, r.j) == (0, 1) and r.scale_exponent != 0


def test_float32_subnormals_widen_to_float64_exactly():
    from array_api_compat import array_namespace

    from refgeo._certify import float32_bits_to_float64

    x = np.array([2.0**-149, -3.0 * 2.0**-140, 1.5], dtype=np.float32)
    assert float32_bits_to_float64(array_namespace(x), x).tolist() == [2.0**-149, -3.0 * 2.0**-140, 1.5]


def test_scaled_row_norms_of_rows_whose_squares_leave_the_float64_range():
    from refgeo._certify import scaled_row_norms

    n = scaled_row_norms(np.array([[3e200, 4e200], [3e-200, 4e-200]]))
    assert n[0] == pytest.approx(5e200, rel=1e-15) and n[1] == pytest.approx(5e-200, rel=1e-15)


def test_the_refined_square_sums_its_lanes_in_the_documented_order():
    """canonical_sq adds the squares of lanes k mod 8 as ((p0 + p1) + (p2 + p3)) +
    ((p4 + p5) + (p6 + p7)): every backend reproduces this order bit for bit.  Here
    p0 = 1 + 2**-25 + 2**-52 (odd last bit) and p2 = p3 = 2**-54, so p2 + p3 = 2**-53
    is a tie that rounds p0 up to even; adding them one at a time leaves p0."""
    from array_api_compat import array_namespace

    from refgeo._certify import canonical_sq

    a = np.array([[1.0 + 2.0**-26, 0.0, 2.0**-27, 2.0**-27, 0.0, 0.0, 0.0, 0.0]])
    assert (1.0 + 2.0**-26) ** 2 == 1.0 + 2.0**-25 + 2.0**-52
    assert canonical_sq(array_namespace(a), a, np.zeros_like(a)).tolist() == [1.0 + 2.0**-25 + 2.0**-51]
