"""The array-API engine (``refgeo._tiled``, the ``cupy`` backend) against the oracle.

There is no GPU in CI: the engine is written against the array API, so the same code
runs here on NumPy arrays (2000 hypothesis examples per kernel, the clouds of test_engine.py) and on array-api-strict arrays (which reject anything outside the
standard).  GPU runs of the same checks happen only where CuPy finds a device
(the ``gpu`` tests here, and every test of the ``backend`` fixture's cupy parameter;
``tools/gpu_check.sh`` runs them).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import refgeo
from refgeo import _backend, _certify, _tiled

from .test_engine import (  # noqa: F401
    FTZ_ROWS,
    _oracle_extreme,
    _oracle_knn,
    _oracle_prescaled,
    _oracle_sq,
    engine_clouds,
    flush_to_zero,
)

xps = pytest.importorskip("array_api_strict")

NAMESPACES = {"numpy": (np.asarray, 2000), "array_api_strict": (xps.asarray, 200)}


def _np(a):
    return np.asarray(a) if isinstance(a, np.ndarray) else np.from_dlpack(a)


def _check_pair(got, want, S, maximize):
    assert (got.value, got.i, got.j) == want  # certified: bitwise the oracle's value and pair
    assert got.error_bound >= 0.0 and got.n_refined >= 1 and got.backend == "cupy"


def _arrays(run):
    return _np(run.indices), _np(run.distances)


@pytest.mark.parametrize("ns", NAMESPACES)
def test_extreme_pairs_and_farthest_exact(ns):
    conv, n = NAMESPACES[ns]

    @settings(max_examples=n)
    @given(S=engine_clouds(), tile=st.one_of(st.none(), st.integers(1, 30)))
    def check(S, tile):
        S = _oracle_prescaled(S)  # the kernels get the rows the public functions pass
        D2 = _oracle_sq(S, S)
        A = conv(S)
        _check_pair(_tiled.diameter(A, tile_size=tile), _oracle_extreme(S, True, D2), S, True)
        _check_pair(_tiled.closest(A, tile_size=tile), _oracle_extreme(S, False, D2), S, False)
        idx, dist = _arrays(_tiled.farthest(A, tile_size=tile))
        np.fill_diagonal(D2, -np.inf)
        want = np.argmax(D2, axis=1)
        np.testing.assert_array_equal(idx, want)
        np.testing.assert_array_equal(dist, np.sqrt(D2[np.arange(len(S)), want]))

    check()


@pytest.mark.parametrize("ns", NAMESPACES)
def test_knn_exact(ns):
    conv, n = NAMESPACES[ns]

    @settings(max_examples=n)
    @given(S=engine_clouds(), data=st.data(), tile=st.one_of(st.none(), st.integers(1, 30)))
    def check(S, data, tile):
        S = _oracle_prescaled(S)
        exclude_self = data.draw(st.booleans())
        k = data.draw(st.integers(1, len(S) - int(exclude_self)))
        idx, dist = _arrays(_tiled.knn(conv(S), k, None, exclude_self=exclude_self, tile_size=tile))
        want_idx, want_dist = _oracle_knn(S, k, exclude_self=exclude_self)
        np.testing.assert_array_equal(idx, want_idx)
        np.testing.assert_array_equal(dist, want_dist)
        # against Y: copies and near-copies of rows of S, so ties cross X and Y
        rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
        pick = rng.integers(0, len(S), size=data.draw(st.integers(1, 12)))
        noise = data.draw(st.sampled_from([0.0, 1e-12, 1e-3]))
        Y = (S[pick].astype(np.float64) * (1.0 + noise * rng.standard_normal(S.shape[1]))).astype(S.dtype)
        k = data.draw(st.integers(1, len(Y)))
        idx, dist = _arrays(_tiled.knn(conv(S), k, conv(Y), exclude_self=True, tile_size=tile))
        want_idx, want_dist = _oracle_knn(S, k, Y)
        np.testing.assert_array_equal(idx, want_idx)
        np.testing.assert_array_equal(dist, want_dist)

    check()


def test_float32_gram_trick_would_fail_here():
    # Rows at 1e-4 spacing under a 1e4 offset: a float32 Gram trick on the raw rows
    # cannot see their order; the engine centers, filters and refines.
    rng = np.random.default_rng(3)
    S = (1e4 + 1e-2 * rng.standard_normal((200, 16))).astype(np.float32)
    raw = S.astype(np.float32)
    n = np.sum(raw * raw, axis=1)
    gram = n[:, None] + n[None, :] - 2.0 * (raw @ raw.T)
    np.fill_diagonal(gram, np.inf)
    idx, _ = _arrays(_tiled.knn(xps.asarray(S), 1, None, exclude_self=True, tile_size=64))
    want, _ = _oracle_knn(S, 1)
    np.testing.assert_array_equal(idx, want)
    assert not np.array_equal(np.argmin(gram, axis=1), want[:, 0])  # the naive answer is wrong


def test_overflowing_float32_norms_fall_back_to_float64():
    S = np.array([[3e18, 0.0], [0.0, 3e18], [1.0, 1.0]], dtype=np.float32)
    want = _oracle_extreme(S, True)
    got = _tiled.diameter(xps.asarray(S))
    assert (got.value, got.i, got.j) == want


def test_underflowing_float32_products_filter_in_float64():
    """float32 rows near 1e-20: float32 products underflow and would leave every pair
    to refine; the float64 filter gives the same answer and prunes."""
    S = (np.random.default_rng(4).standard_normal((200, 8)) * 1e-20).astype(np.float32)
    for fn, maximize in ((_tiled.diameter, True), (_tiled.closest, False)):
        got = fn(S)
        assert (got.value, got.i, got.j) == _oracle_extreme(S, maximize)
        assert got.n_refined < 200 * 199 // 40
    kn = _tiled.knn(S, 3, None, exclude_self=True)
    np.testing.assert_array_equal(_np(kn.indices), _oracle_knn(S, 3)[0])
    assert kn.n_refined < 200 * 199 // 20


def test_tf32_request_filters_in_float64(monkeypatch):
    assert _tiled.matmul_precision("float32") == "float32"
    monkeypatch.setenv("CUPY_TF32", "1")
    assert _tiled.matmul_precision("float32") == "float64"
    assert _tiled.matmul_precision("float64") == "float64"


def test_public_functions_route_cupy_arrays_to_the_engine(monkeypatch):
    # Stand-in for CuPy: array-api-strict arrays flagged as CuPy arrays.
    monkeypatch.setattr(_backend, "is_cupy_array", lambda a: type(a).__module__.startswith("array_api_strict"))
    rng = np.random.default_rng(5)
    S = rng.standard_normal((40, 6))
    A = xps.asarray(S)
    monkeypatch.delenv("REFGEO_BACKEND", raising=False)  # CuPy arrays run "auto" here
    r = refgeo.row_diameter(A)
    assert r.backend == "cupy" and (r.value, r.i, r.j) == _oracle_extreme(S, True)
    r = refgeo.closest_pair(A)
    assert r.backend == "cupy" and (r.value, r.i, r.j) == _oracle_extreme(S, False)
    got = refgeo.knn(A, 3)
    np.testing.assert_array_equal(_np(got.indices), _oracle_knn(S, 3)[0])
    with refgeo.use_backend("reference"):
        assert refgeo.row_diameter(A).backend == "reference"


@pytest.mark.gpu
def test_cupy_arrays_dispatch_to_the_gpu_engine():
    cp = pytest.importorskip("cupy")
    ok, why = _backend.available_backends()["cupy"]
    if not ok:
        pytest.skip(why)
    rng = np.random.default_rng(0)
    for dtype in (np.float64, np.float32):
        S = (rng.standard_normal((3000, 64)) + 1e3).astype(dtype)
        r = refgeo.row_diameter(cp.asarray(S))
        assert r.backend == "cupy" and (r.value, r.i, r.j) == _oracle_extreme(S, True)
        got = refgeo.knn(cp.asarray(S[:1000]), 8)
        np.testing.assert_array_equal(cp.asnumpy(got.indices), _oracle_knn(S[:1000], 8)[0])
        assert math.isfinite(r.error_bound)


@settings(max_examples=300)
@given(bits=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=64), shift=st.integers(0, 31))
def test_float32_widened_from_its_bits_equals_the_cast(bits, shift):
    """The flush-free float32 -> float64 widening (what CuPy float32 inputs get) equals
    NumPy's cast for every finite bit pattern, sign of zero included, subnormals of
    every size and strided views included."""
    b = np.array(bits, dtype=np.uint64)
    b = np.concatenate([b, b >> shift, b & 0x807FFFFF]).astype(np.uint32)  # subnormals, zeros
    x = b.view(np.float32)
    x = x[np.isfinite(x)]
    for view in (x, x[::2]):
        got = _certify.float32_bits_to_float64(np, view)
        want = view.astype(np.float64)
        assert got.dtype == np.float64
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


@pytest.mark.gpu
def test_cupy_float32_subnormal_rows_are_not_flushed():
    """CuPy flushes float32 subnormals in its kernels (``-ftz=true``): a float32 row
    [3.9e-42] was widened to 0.0 on an H200, and knn then called row 0 the nearest
    row of row 1 at distance 0.  The certified results of such rows equal NumPy's."""
    cp = pytest.importorskip("cupy")
    if not _backend.available_backends()["cupy"][0]:
        pytest.skip("no CUDA device")
    tiny = np.float32(2.0**-149)
    rows = [np.array([[3.856e-42], [0.0]], dtype=np.float32),
            np.array([[tiny, 0.0], [0.0, tiny], [0.0, 0.0], [3 * tiny, -tiny]], dtype=np.float32),
            (np.random.default_rng(0).standard_normal((50, 3)) * 2.0**-130).astype(np.float32)]
    for S in rows:
        A = cp.asarray(S)
        np.testing.assert_array_equal(cp.asnumpy(_certify.f64(cp, A)), S.astype(np.float64))
        for fn in (refgeo.row_diameter, refgeo.closest_pair):
            got, want = fn(A), fn(S)
            assert got.backend == "cupy" and (got.value, got.i, got.j) == (want.value, want.i, want.j)
        got, want = refgeo.knn(A, 1, exclude_self=False), refgeo.knn(S, 1, exclude_self=False)
        np.testing.assert_array_equal(cp.asnumpy(got.indices), want.indices)
        np.testing.assert_array_equal(cp.asnumpy(got.distances), want.distances)
    # the Hilbert functions widen CuPy float32 the same way (they had a cast of their own)
    z = np.array([3.856e-42, 0.0], dtype=np.float32)
    got = refgeo.hilbert_distance_logits(cp.asarray(z), cp.zeros(2, dtype=cp.float32))
    assert float(got) == float(refgeo.hilbert_distance_logits(z, np.zeros(2, dtype=np.float32))) > 0.0


def test_certificate_survives_flush_to_zero(flush_to_zero):
    S = FTZ_ROWS
    for fn, maximize in ((_tiled.closest, False), (_tiled.diameter, True)):
        r = fn(S, tile_size=2)
        assert (r.value, r.i, r.j) == _oracle_extreme(S, maximize)
    idx, _ = _arrays(_tiled.knn(S, 1, None, exclude_self=True))
    np.testing.assert_array_equal(idx, _oracle_knn(S, 1)[0])
