"""SPEC §2 row geometry: the public API of refgeo.rows against naive NumPy and closed forms.

Every test runs on every backend (``backend`` fixture).  The oracle here is plain
NumPy broadcasting (``_naive_sq``), independent of refgeo's blocked reference.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import refgeo

finite = dict(allow_nan=False, allow_infinity=False, allow_subnormal=False)


def _naive_sq(A, B):
    """All squared distances by direct float64 differences (small inputs only)."""
    A = np.asarray(A, dtype=np.float64)
    B = np.asarray(B, dtype=np.float64)
    return ((A[:, None, :] - B[None, :, :]) ** 2).sum(-1)


def _naive_extreme(S, maximise):
    D2 = _naive_sq(S, S)
    V = len(S)
    iu = np.triu_indices(V, 1)
    vals = D2[iu]
    k = int(np.argmax(vals) if maximise else np.argmin(vals))  # first: smallest (i, j)
    return vals[k], int(iu[0][k]), int(iu[1][k])


@st.composite
def clouds(draw, max_v=9, max_d=5):
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
    for fn, maximise in ((refgeo.row_diameter, True), (refgeo.closest_pair, False)):
        r = fn(S)
        v2, i, j = _naive_extreme(S, maximise)
        assert (r.i, r.j) == (i, j)
        assert r.value == pytest.approx(math.sqrt(v2), rel=1e-14, abs=1e-300)
        assert r.i < r.j
        assert r.backend == backend
        assert r.dtype == "float64"


@settings(max_examples=100)
@given(clouds())
def test_farthest_partners_match_naive(backend, S):
    fp = refgeo.farthest_partners(S)
    D2 = _naive_sq(S, S)
    np.fill_diagonal(D2, -np.inf)
    np.testing.assert_array_equal(fp.indices, np.argmax(D2, axis=1))
    np.testing.assert_allclose(fp.distances, np.sqrt(D2.max(1)), rtol=1e-14)
    assert fp.indices.dtype == np.int64 and fp.distances.dtype == np.float64
    assert not fp.indices.flags.writeable


@settings(max_examples=100)
@given(clouds(), st.data())
def test_knn_matches_naive(backend, S, data):
    V = len(S)
    k = data.draw(st.integers(1, V - 1))
    r = refgeo.knn(S, k)
    D2 = _naive_sq(S, S)
    np.fill_diagonal(D2, np.inf)
    order = np.argsort(D2, axis=1, kind="stable")[:, :k]
    np.testing.assert_array_equal(r.indices, order)
    np.testing.assert_allclose(r.distances, np.sqrt(np.take_along_axis(D2, order, 1)), rtol=1e-14)
    Y = data.draw(hnp.arrays(np.float64, (data.draw(st.integers(1, 6)), S.shape[1]),
                             elements=st.floats(-10, 10, **finite)))
    k2 = data.draw(st.integers(1, len(Y)))
    r2 = refgeo.knn(S, k2, Y)
    D2 = _naive_sq(S, Y)
    order = np.argsort(D2, axis=1, kind="stable")[:, :k2]
    np.testing.assert_array_equal(r2.indices, order)


def test_knn_keep_self():
    S = np.array([[0.0], [1.0], [3.0]])
    r = refgeo.knn(S, 1, exclude_self=False)
    np.testing.assert_array_equal(r.indices, [[0], [1], [2]])
    np.testing.assert_array_equal(r.distances, 0.0)


# ------------------------------------------------------------------ SPEC §2 identities


def test_regular_simplex_closed_forms(backend):
    E = np.eye(5) * 3.0
    assert refgeo.row_diameter(E).value == pytest.approx(3.0 * math.sqrt(2), rel=1e-15)
    assert refgeo.distance_ratio(E) == 1.0
    ball = refgeo.covering_radius(E)
    # k = 4 (rank of centred rows): rad = J_4 * D for the regular simplex
    assert ball.radius == pytest.approx(refgeo.jung_constant(4) * 3.0 * math.sqrt(2), rel=1e-12)
    assert ball.lower_bound <= ball.radius


@settings(max_examples=50)
@given(clouds(max_v=8, max_d=4), st.floats(0.1, 5.0))
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
@given(clouds(max_v=8, max_d=4))
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
@given(clouds(max_v=8, max_d=4))
def test_covering_radius_bounds(S):
    D = refgeo.row_diameter(S).value
    ball = refgeo.covering_radius(S)
    k = np.linalg.matrix_rank(S - S.mean(0), tol=1e-9 * max(1.0, np.abs(S).max()))
    assert ball.lower_bound <= ball.radius
    assert ball.radius - ball.lower_bound <= 1e-9 * ball.radius + 1e-12
    assert D / 2 <= ball.radius * (1 + 1e-9) + 1e-12
    assert ball.radius <= refgeo.jung_constant(int(k)) * D * (1 + 1e-9) + 1e-12
    assert np.all(np.linalg.norm(S - ball.centre, axis=1) <= ball.radius * (1 + 1e-12) + 1e-12)
    assert D <= math.sqrt(2) * np.linalg.norm(S, 2) * (1 + 1e-12) + 1e-12


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
    v2, i, j = _naive_extreme(S, False)
    assert (c.i, c.j) == (i, j)
    kn = refgeo.knn(Sx, 3)
    D2 = _naive_sq(S, S)
    np.fill_diagonal(D2, np.inf)
    np.testing.assert_array_equal(np.from_dlpack(kn.indices), np.argsort(D2, 1, kind="stable")[:, :3])
    fp = refgeo.farthest_partners(Sx)
    assert isinstance(fp.indices, type(Sx))
    ball = refgeo.covering_radius(Sx)
    assert isinstance(ball.centre, type(Sx))


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


def test_integer_input_is_converted_to_float64(backend):
    S = np.array([[0, 0], [3, 4], [1, 1]], dtype=np.int32)
    r = refgeo.row_diameter(S)
    assert (r.value, r.i, r.j, r.dtype) == (5.0, 0, 1, "float64")


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


def test_backward_bound_needs_zero_sum():
    with pytest.raises(ValueError, match=re.escape("r must sum to zero along its last axis")):
        refgeo.backward_bound(np.eye(2), np.array([1.0, 0.0]))
    with pytest.raises(ValueError, match=re.escape("r must have 2 entries per residual")):
        refgeo.backward_bound(np.eye(2), np.array([1.0, 0.0, -1.0]))
