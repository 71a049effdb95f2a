"""``fit_local_maps`` and ``decompose`` on Dask arrays, on a real ``distributed.LocalCluster``.

Every test compares Dask input with the same rows as NumPy arrays on one machine.  The
neighbors, the fitted values, coefficients and maps, delta, tau, rho and every
per-token quantity computed row by row (relative errors, cosines, angles) and the
sums over tokens of those are the same bits: the fit of a token reads only its own row
and its neighbors' rows, the single-machine fit does not depend on its chunk size, and
the sums over tokens run on the gathered (N,) arrays with the same NumPy calls.  What
comes from d x d R factors (subspace, singular values, projections, subspace energies,
global baselines) is a tree of QR factorizations of per-block factors on the cluster and
one factorization on one machine, whose roundings differ: those agree to rounding.
"""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import refgeo
from refgeo._dask_tokenwise import worker_identities

from ._dask_cluster import TIMEOUT, graph_key_clashes, kill_at_first_result, local_client

da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")

_CLASSES = ["diagonal", "psd_diagonal", "low_rank", "orthogonal", "scaled_orthogonal", "full"]
_PAIRS = ("delta_tau", "rho_tau", "rho_delta")
_PARTS = ("delta", "tau", "rho")
# Gram-based quantities: one GEMM against a sum of per-block GEMMs
_RTOL = 1e-10


@pytest.fixture(scope="module")
def client():
    with local_client() as c:
        yield c


def hidden_states(seed, n, d, vocab, dtype=np.float64):
    """Layer inputs and outputs shaped like a residual stream.

    A large common component (norm about 40) shared by every token, a token embedding
    drawn from a Zipf-distributed vocabulary (repeated tokens give exactly repeated
    rows of X: ties at distance 0) and a small per-position context term; the layer
    adds a tokenwise nonlinear update and a context-dependent one.
    """
    rng = np.random.default_rng(seed)
    common = 40.0 * rng.standard_normal(d) / np.sqrt(d)
    emb = rng.standard_normal((vocab, d))
    p = 1.0 / np.arange(1, vocab + 1) ** 1.1
    tokens = rng.choice(vocab, size=n, p=p / p.sum())
    X = common + emb[tokens]
    context = rng.random(n) < 0.5  # half of the positions see some context
    X[context] += 0.05 * rng.standard_normal((int(context.sum()), d))
    W = np.eye(d) + 0.2 * rng.standard_normal((d, d)) / np.sqrt(d)
    Y = X @ W.T + np.tanh(X - common) + 0.01 * rng.standard_normal((n, d))
    return X.astype(dtype), Y.astype(dtype)


def _chunks(draw, n):
    kind = draw(st.sampled_from(["one", "small", "any"]))
    if kind == "one":
        return n
    if kind == "small":
        return draw(st.integers(1, 3))
    return draw(st.integers(1, n))  # a ragged last chunk unless it divides n


def _class_options(draw, d):
    cls = draw(st.sampled_from(_CLASSES))
    rank = draw(st.integers(1, d)) if cls == "low_rank" else None
    return dict(
        cls=cls, rank=rank,
        ridge=draw(st.sampled_from([0.0, 0.0, 1e-3, 1.0])),
        prior=draw(st.sampled_from(["identity", "zero"])),
        metric=draw(st.sampled_from(["euclidean", "cosine"])),
        standardize=draw(st.booleans()),
        exclude_self=draw(st.booleans()),
        weights=draw(st.sampled_from([None, "gaussian"])),
    )


@st.composite
def _case(draw):
    n = draw(st.integers(4, 40))
    d = draw(st.integers(1, 7))
    opts = _class_options(draw, d)
    k = draw(st.integers(1, min(8, n - 1)))
    dtype = draw(st.sampled_from([np.float64, np.float32]))
    return n, d, k, dtype, opts, _chunks(draw, n), _chunks(draw, d), draw(st.integers(0, 2**16))


def _dask(A, rows, cols):
    return da.from_array(A, chunks=(rows, cols))


def _quiet(fn, *args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # under-determined classes
        return fn(*args, **kw)


def _equal(a, b):
    np.testing.assert_array_equal(np.asarray(b), np.asarray(a))


def _same_fit(a, b):
    for name in ("neighbors", "distances", "weights"):
        if getattr(a, name) is None:  # no distances with given indices
            assert getattr(b, name) is None
            continue
        assert isinstance(getattr(b, name), np.ndarray), name  # (N, k): on the caller
        _equal(getattr(a, name), getattr(b, name))
    assert isinstance(b.fitted, da.Array)
    _equal(a.fitted, b.fitted.compute())
    assert (a.coefficients is None) == (b.coefficients is None)
    if a.coefficients is not None:
        _equal(a.coefficients, b.coefficients.compute())
    assert (a.maps is None) == (b.maps is None)
    if a.maps is not None:
        _equal(a.maps, b.maps.compute())
    assert (a.dof, a.n_targets, a.config) == (b.dof, b.n_targets, b.config)


def _aligned(U, V):
    """``V`` with each column's sign matched to ``U`` (eigenvectors are signed freely)."""
    s = np.sign(np.sum(U * V, axis=0))
    return V * np.where(s == 0, 1.0, s)


def _close(a, b, scale=1.0, rtol=_RTOL):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=rtol, atol=rtol * scale)


def _same_result(a, b, X, Y):
    """Every field of two decompositions of ``(X, Y)``: bit for bit where it is
    row-wise, to rounding where it comes from a Gram matrix."""
    for name in _PARTS:
        v = getattr(b, name)
        assert isinstance(v, da.Array), name
        _equal(getattr(a, name), v.compute())
    for name in ("relative_error", "neighbors", "eval_mask"):
        assert isinstance(getattr(b, name), np.ndarray)
        _equal(getattr(a, name), getattr(b, name))
    assert a.energy_fraction == b.energy_fraction or (np.isnan(a.energy_fraction) and np.isnan(b.energy_fraction))
    for p in _PAIRS:
        _equal(getattr(a.cosines, p), getattr(b.cosines, p))
        _equal(getattr(a.angles, p), getattr(b.angles, p))
    if a.coefficients is None:
        assert b.coefficients is None
    else:
        _equal(a.coefficients, b.coefficients.compute())
    assert (a.dof, a.n_targets, a.config) == (b.dof, b.n_targets, b.config)
    # the Gram-based fields
    sv_a, sv_b = a.subspace_singular_values, b.subspace_singular_values
    top = float(sv_a[0]) if sv_a.size else 0.0
    _close(sv_a, sv_b, top)
    # the eigenvectors of well-separated singular values (others span a subspace only)
    gap = np.diff(sv_a) if sv_a.size > 1 else np.zeros(0)
    sep = np.ones(sv_a.shape[0], dtype=bool)
    if sep.size > 1:
        tight = np.abs(gap) <= 1e-6 * max(top, 1e-300)
        sep[:-1] &= ~tight
        sep[1:] &= ~tight
    sep &= sv_a > 1e-6 * max(top, 1e-300)
    if sep.any():
        np.testing.assert_allclose(_aligned(a.subspace, b.subspace)[:, sep], a.subspace[:, sep], atol=1e-6)
    for p in _PARTS:
        np.testing.assert_allclose(getattr(b.projections, p), getattr(a.projections, p), atol=1e-6)
        np.testing.assert_allclose(getattr(b.subspace_energies, p), getattr(a.subspace_energies, p), atol=1e-6)
    assert len(a.baselines) == len(b.baselines)
    for x, y in zip(a.baselines, b.baselines):
        assert x.kind == y.kind
        rtol = _baseline_rtol(x.kind, X, Y)
        if rtol is None:
            continue  # an eigenvalue at the pseudo-inverse's cut-off: kept or dropped by rounding
        _close(x.map, y.map, float(np.max(np.abs(x.map))) if x.map.size else 1.0, rtol)
        np.testing.assert_allclose(y.relative_error, x.relative_error, rtol=100 * rtol, atol=100 * rtol)
        np.testing.assert_allclose(y.energy_fraction, x.energy_fraction, rtol=100 * rtol, atol=100 * rtol)


def _baseline_rtol(kind, X, Y):
    """How far a global baseline may move when its d x d Gram matrices change by a few
    roundings: the condition of ``G = X^T X`` (linear) or of ``M = Y^T X`` (Procrustes)
    times the unit roundoff; None where an eigenvalue sits at the cut-off of the
    pseudo-inverse (the two solves may keep different numbers of directions)."""
    X, Y = np.asarray(X, dtype=np.float64), np.asarray(Y, dtype=np.float64)
    top = max(float(np.max(np.abs(X))), float(np.max(np.abs(Y))), 1e-300)
    X, Y = X / top, Y / top  # condition numbers are scale-free; the Gram matrices of 1e200 are not finite
    eps = np.finfo(np.float64).eps
    if kind == "linear":
        mu = np.linalg.eigvalsh(X.T @ X)
        cut = X.shape[1] * eps * max(float(mu[-1]), 0.0)
        if np.any((mu > cut / 1e3) & (mu < cut * 1e3)):
            return None
        kept = mu[mu > cut]
        cond = float(kept[-1] / kept[0]) if kept.size else 1.0
    else:
        sv = np.linalg.svd(Y.T @ X, compute_uv=False)
        pair = sv[:-1] + sv[1:] if sv.size > 1 else sv
        cond = float(sv[0] / pair.min()) if sv.size and pair.min() > 0 else np.inf
        if not np.isfinite(cond) or cond > 1e8:
            return None
    return max(_RTOL, 1e3 * eps * cond)


# ------------------------------------------------------------------ fit_local_maps


@settings(max_examples=12, deadline=None)
@given(_case(), st.booleans())
def test_fit_local_maps_is_the_single_machine_fit(client, case, return_maps):
    n, d, k, dtype, opts, rows, cols, seed = case
    X, Y = hidden_states(seed, n, d, vocab=max(2, n // 3), dtype=dtype)
    want = _quiet(refgeo.fit_local_maps, X, Y, k=k, return_maps=return_maps, **opts)
    got = _quiet(refgeo.fit_local_maps, _dask(X, rows, cols), _dask(Y, max(1, rows // 2), d), k=k,
                 return_maps=return_maps, **opts)
    _same_fit(want, got)
    assert got.fitted.chunks[0] == _dask(X, rows, cols).chunks[0]  # chunked like X's rows


def test_the_single_machine_fit_does_not_depend_on_its_chunk_size():
    # the premise of bit identity on a cluster: a token's fit is the same bits whatever
    # batch of tokens it is computed in
    X, Y = hidden_states(5, 60, 6, vocab=15)
    for cls, rank in [("diagonal", None), ("full", None), ("low_rank", 2), ("orthogonal", None),
                      ("scaled_orthogonal", None)]:
        for k in (3, 12):  # 2k < d and 2k >= d for the orthogonal classes
            ref = _quiet(refgeo.fit_local_maps, X, Y, k=k, cls=cls, rank=rank, chunk_size=60, return_maps=True)
            for c in (1, 7, 59):
                f = _quiet(refgeo.fit_local_maps, X, Y, k=k, cls=cls, rank=rank, chunk_size=c, return_maps=True)
                _equal(ref.fitted, f.fitted)
                _equal(ref.maps, f.maps)


@pytest.mark.parametrize("cls", _CLASSES)
def test_realistic_hidden_states_every_class(client, cls):
    # a residual stream with a large common component and Zipf-repeated tokens (exact
    # duplicate rows: ties in the neighbor search), ragged chunks of 23 rows
    X, Y = hidden_states(11, 120, 8, vocab=30)
    rank = 3 if cls == "low_rank" else None
    kw = dict(k=10, cls=cls, rank=rank, ridge=1e-2)
    Xd, Yd = _dask(X, 23, 8), _dask(Y, 23, 4)
    _same_fit(_quiet(refgeo.fit_local_maps, X, Y, **kw, return_maps=True),
              _quiet(refgeo.fit_local_maps, Xd, Yd, **kw, return_maps=True))
    _same_result(_quiet(refgeo.decompose, X, Y, **kw), _quiet(refgeo.decompose, Xd, Yd, **kw), X, Y)


def test_given_neighbors_and_array_weights(client):
    X, Y = hidden_states(3, 50, 5, vocab=12)
    nn = refgeo.knn(X, 6)
    w = np.random.default_rng(0).random((50, 6)) + 0.1
    for neighbors, weights in [(nn, w), (nn.indices, None), (nn, da.from_array(w, chunks=(7, 6)))]:
        kw = dict(cls="full", neighbors=neighbors, ridge=0.1)
        want = _quiet(refgeo.fit_local_maps, X, Y, **kw, weights=None if weights is None else w)
        got = _quiet(refgeo.fit_local_maps, _dask(X, 9, 5), _dask(Y, 9, 5), **kw, weights=weights)
        _same_fit(want, got)


def test_empty_and_column_chunks(client):
    # a zero-row chunk holds no token block; column chunks are merged
    X, Y = hidden_states(8, 30, 5, vocab=9)
    Xd = da.from_array(X, chunks=((10, 0, 20), (2, 3)))
    kw = dict(k=4, cls="low_rank", rank=2)
    _same_fit(_quiet(refgeo.fit_local_maps, X, Y, **kw), _quiet(refgeo.fit_local_maps, Xd, Y, **kw))
    want = _quiet(refgeo.decompose, X, Y, **kw)
    _same_result(want, _quiet(refgeo.decompose, Xd, _dask(Y, 7, 5), **kw), X, Y)


# ----------------------------------------------------------------------- decompose


@settings(max_examples=10, deadline=None)
@given(_case(), st.integers(1, 4), st.booleans(), st.booleans())
def test_decompose_is_the_single_machine_decomposition(client, case, r, center, baselines):
    n, d, k, dtype, opts, rows, cols, seed = case
    X, Y = hidden_states(seed, n, d, vocab=max(2, n // 3), dtype=dtype)
    kw = dict(k=k, subspace_rank=min(r, d), center_subspace=center, baselines=baselines, layer=2, **opts)
    want = _quiet(refgeo.decompose, X, Y, **kw)
    got = _quiet(refgeo.decompose, _dask(X, rows, cols), _dask(Y, rows, d), **kw)
    _same_result(want, got, X, Y)
    assert got.summary().keys() == want.summary().keys()
    _equal(want.patched(X), got.patched(_dask(X, rows, d)).compute())


def test_wide_range_states_scale_exactly(client):
    # entries near 1e200: the fits and metrics run on exactly rescaled panels
    X, Y = hidden_states(7, 40, 4, vocab=10)
    X, Y = X * 1e200, Y * 1e200
    kw = dict(k=6, cls="scaled_orthogonal")
    want = _quiet(refgeo.decompose, X, Y, **kw)
    got = _quiet(refgeo.decompose, _dask(X, 11, 4), _dask(Y, 11, 4), **kw)
    _same_result(want, got, X, Y)
    _same_fit(_quiet(refgeo.fit_local_maps, X, Y, **kw), _quiet(refgeo.fit_local_maps, _dask(X, 11, 4), Y, **kw))


@pytest.mark.parametrize("dtype", [np.float16, np.longdouble])
def test_half_and_long_double_states_are_fitted_in_float64(client, dtype):
    """A NumPy float16 (or long double) input is converted to float64 first; Dask chunks
    of those dtypes went through as they were, and the neighbor search's exact scaling
    by 2**-e ran in float16: with one channel near 2e4 (the common component of a
    residual stream), entries 2**14 below it became subnormal and 9 of 200 tokens had
    other neighbors (distances off by 2.8e-3)."""
    X, Y = hidden_states(3, 200, 8, vocab=60)
    X[:, 0] += 20000.0
    X, Y = X.astype(dtype), (1.1 * X).astype(dtype)
    kw = dict(k=8, cls="full")
    want = _quiet(refgeo.fit_local_maps, X, Y, **kw)
    got = _quiet(refgeo.fit_local_maps, _dask(X, 50, 8), _dask(Y, 50, 8), **kw)
    _same_fit(want, got)
    assert got.config["dtype"] == want.config["dtype"] == "float64"


@pytest.mark.parametrize("center", [False, True])
def test_subspace_singular_values_of_one_dominant_direction(client, center):
    """States 1e4 + 1e-4 noise through a linear layer: tau has one direction of size
    2e5 and the others near 1e-3.  From the Gram matrix tau^T tau those held only
    sqrt(u) of the largest: 3.5x off on one machine, and different for every chunking
    (0.0 at chunks of 100).  From R factors they are the SVD of tau's to rounding."""
    rng = np.random.default_rng(3)
    N, d = 500, 8
    X = 1e4 + 1e-4 * rng.standard_normal((N, d))
    Y = X @ (np.eye(d) + 0.1 * rng.standard_normal((d, d)))
    kw = dict(k=12, cls="diagonal", subspace_rank=d, center_subspace=center, baselines=False)
    one = refgeo.decompose(X, Y, **kw)
    tau = np.asarray(one.tau)
    want = np.linalg.svd(tau - tau.mean(axis=0) if center else tau, compute_uv=False)
    for r in (one, *(refgeo.decompose(_dask(X, c, d), _dask(Y, c, d), **kw) for c in (23, 100, 250))):
        np.testing.assert_allclose(r.subspace_singular_values, want, rtol=0, atol=1e-13 * want[0])


@pytest.mark.parametrize("center", [False, True])
def test_tokens_far_below_the_others_have_the_single_machine_metrics(client, center):
    # half the tokens 2**-600 times the rest: their squared norms underflow in the
    # panels' one scaling, so every per-token metric and the Gram matrix of tau are
    # taken from vectors scaled by powers of two of their own, in every block alike
    X, Y = hidden_states(11, 40, 4, vocab=10)
    X[20:], Y[20:] = np.ldexp(X[20:], -600), np.ldexp(Y[20:], -600)
    kw = dict(k=6, cls="diagonal", subspace_rank=2, center_subspace=center)
    want = _quiet(refgeo.decompose, X, Y, **kw)
    got = _quiet(refgeo.decompose, _dask(X, 7, 4), _dask(Y, 7, 4), **kw)
    _same_result(want, got, X, Y)
    for v in (got.relative_error, got.cosines.rho_tau, got.angles.delta_tau, got.projections.rho):
        assert np.isfinite(v).all()
    assert all(np.isfinite(b.relative_error).all() for b in got.baselines)


_CALLER = """
import json, sys, tracemalloc, warnings
import dask.array as da, distributed, numpy as np, refgeo

n, d, k = 8000, 256, 4
client = distributed.Client(sys.argv[1], timeout=60)
X = da.random.RandomState(0).standard_normal((n, d), chunks=(1000, d)) + 3.0
Y = 1.5 * X + 0.1 * da.random.RandomState(1).standard_normal((n, d), chunks=(1000, d))
tracemalloc.start()
fit = refgeo.fit_local_maps(X, Y, k=k, cls="full", ridge=1.0)
peak_fit = tracemalloc.get_traced_memory()[1]
tracemalloc.reset_peak()
r = refgeo.decompose(X, Y, k=k, cls="diagonal", subspace_rank=4, baselines=False)
peak = tracemalloc.get_traced_memory()[1]
tracemalloc.stop()
print(json.dumps({
    "nbytes": n * d * 8, "peak_fit": peak_fit, "peak": peak,
    "lazy": isinstance(fit.fitted, da.Array) and isinstance(r.tau, da.Array),
    "shapes": [list(fit.neighbors.shape), list(r.relative_error.shape)],
    "pieces": len(client.who_has(fit.fitted)), "blocks": len(X.chunks[0]),
    "coefficient": float(r.coefficients.mean().compute()),
}))
client.close()
"""


def test_the_caller_never_holds_an_n_by_d_array(client):
    # a separate caller process (here the scheduler shares the test's process): the
    # states are made on the workers, and the caller's allocations during the fit and
    # the decomposition stay well below one (N, d) float64 array: it receives the
    # (N, k) neighbors, the (N,) metrics and d x d matrices
    import json
    import subprocess
    import sys

    from ._dask_cluster import TIMEOUT

    run = subprocess.run([sys.executable, "-c", _CALLER, client.scheduler.address], capture_output=True,
                         text=True, timeout=4 * TIMEOUT)
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout.strip().splitlines()[-1])
    # (the peaks are the (N, k) and (N,) arrays, d x d eigenproblems and the client's
    # receive buffers: about 0.2 and 0.3-0.5 of one (N, d) float64 array here)
    assert got["peak_fit"] < got["nbytes"] / 3, got
    assert got["peak"] < got["nbytes"] * 0.7, got
    assert got["lazy"] and got["shapes"] == [[8000, 4], [8000]]
    # the persisted fitted values live on the workers, one piece per token block
    assert got["pieces"] == got["blocks"]
    assert abs(got["coefficient"] - 1.5) < 0.05


def test_killed_worker_gives_the_same_decomposition(client):
    # one worker process is killed as soon as it has finished the first fit task (the
    # fitted values it persisted are lost with it, and the metrics still need them);
    # Dask reruns the lost tasks on the other worker and on the restarted one
    import os

    X, Y = hidden_states(31, 600, 8, vocab=60)
    kw = dict(k=6, cls="full", ridge=1e-3)
    pids = client.run(os.getpid)
    scheduler = client.cluster.scheduler  # in this process: the plugin sees every transition
    plugin = kill_at_first_result(pids, "fit_block")
    scheduler.add_plugin(plugin)
    try:
        got = _quiet(refgeo.decompose, _dask(X, 100, 8), _dask(Y, 100, 8), **kw)
    finally:
        scheduler.remove_plugin(plugin.name)
    assert plugin.killed is not None, "no fit task finished on a worker of the cluster"
    _same_result(_quiet(refgeo.decompose, X, Y, **kw), got, X, Y)
    client.wait_for_workers(2, timeout=TIMEOUT)
    assert pids[plugin.killed] not in client.run(os.getpid).values()


# -------------------------------------------------------------------------- errors


def test_underdetermined_warning_points_at_the_caller(client):
    X, Y = hidden_states(3, 60, 6, vocab=12)
    for fn in (refgeo.fit_local_maps, refgeo.decompose):
        with pytest.warns(UserWarning, match="under-determined") as w:
            fn(_dask(X, 20, 6), _dask(Y, 20, 6), k=3, cls="full")
        assert [x.filename for x in w if "under-determined" in str(x.message)] == [__file__]


def test_options_that_need_one_process_are_refused(client):
    X, Y = hidden_states(1, 30, 3, vocab=8)
    Xd, Yd = _dask(X, 10, 3), _dask(Y, 10, 3)
    with pytest.raises(NotImplementedError, match=r"cls='mlp' is not supported for Dask arrays.*\.compute\(\)"):
        refgeo.decompose(Xd, Yd, cls="mlp")
    with pytest.raises(ValueError, match="cls"):
        refgeo.fit_local_maps(Xd, Yd, k=3, cls="lowrank")
    with pytest.raises(ValueError, match="k == 30"):
        refgeo.fit_local_maps(Xd, Yd, k=30, cls="full")
    with pytest.raises(ValueError, match="X and Y"):
        refgeo.fit_local_maps(Xd, _dask(Y[:20], 10, 3), k=3, cls="full")


def test_nan_names_the_chunk(client):
    X, Y = hidden_states(2, 40, 3, vocab=8)
    X[25, 1] = np.nan
    with pytest.raises(ValueError, match=r"X must contain only finite values.*rows 20:30"):
        refgeo.fit_local_maps(_dask(X, 10, 3), _dask(Y, 10, 3), k=3, cls="full")


@pytest.mark.parametrize("p", [510, -600])
def test_panels_of_very_different_sizes_are_rejected(client, p):
    # as on one machine: Y = 2**p X underflows one panel in the scaled fits
    X, _ = hidden_states(2, 40, 3, vocab=8)
    Y = np.ldexp(X, p)
    msg = "X and Y must have entries within a factor 2**500 of each other in size"
    for fn in (refgeo.fit_local_maps, refgeo.decompose):
        with pytest.raises(ValueError, match=re.escape(msg)):
            fn(X, Y, k=3, cls="full")
        with pytest.raises(ValueError, match=re.escape(msg)):
            fn(_dask(X, 10, 3), _dask(Y, 10, 3), k=3, cls="full")
    # 2**500 apart: fitted, the same bits as on one machine
    Y = np.ldexp(X, 500)
    want = refgeo.fit_local_maps(X, Y, k=3, cls="diagonal")
    got = refgeo.fit_local_maps(_dask(X, 10, 3), _dask(Y, 10, 3), k=3, cls="diagonal")
    np.testing.assert_array_equal(np.asarray(got.fitted), want.fitted)
    np.testing.assert_array_equal(np.asarray(got.coefficients), want.coefficients)


def test_unknown_chunk_sizes_are_refused(client):
    X, Y = hidden_states(2, 40, 3, vocab=8)
    Xd = _dask(X, 10, 3)
    Xd = Xd[Xd[:, 0] > -1e9]  # a boolean mask: row chunks of unknown size
    with pytest.raises(ValueError, match="unknown chunk sizes.*compute_chunk_sizes"):
        refgeo.fit_local_maps(Xd, _dask(Y, 10, 3), k=3, cls="full")


def test_progress_reports_the_steps(client):
    X, Y = hidden_states(4, 30, 3, vocab=8)
    reports = []
    refgeo.decompose(_dask(X, 10, 3), _dask(Y, 10, 3), k=4, cls="diagonal", progress=reports.append)
    assert (reports[0]["done"], reports[-1]["done"]) == (0, reports[-1]["total"]) == (0, 3)


def test_larger_realistic_layer(client):
    # 3000 tokens of width 32, k = 40, standardized neighbors, a centered subspace, in
    # blocks of 700 tokens (about 5 s on two cores)
    X, Y = hidden_states(21, 3000, 32, vocab=400)
    for cls in ("full", "scaled_orthogonal"):
        kw = dict(k=40, cls=cls, ridge=1e-3, standardize=True, center_subspace=True)
        want = _quiet(refgeo.decompose, X, Y, **kw)
        _same_result(want, _quiet(refgeo.decompose, _dask(X, 700, 16), Y, **kw), X, Y)


class _Computed(Exception):
    """Raised by a block of :func:`_lazy_panels`: the call got past its memory check."""


def _lazy_panels(n, b, d):
    """(N, d) Dask panels in blocks of ``b`` rows that raise :class:`_Computed` when
    computed: a refused call never computes them, and a call that is not refused stops
    at its first work, allocating nothing."""

    def computed(block):
        raise _Computed("a block was computed")

    return da.zeros((n, d), chunks=(b, d)).map_blocks(computed, dtype=np.float64, meta=np.empty((0, 0)))


def _fit_maps(n, b, d, **kw):
    """``fit_local_maps`` with maps of (n, d) lazy panels in blocks of ``b`` rows, each
    token its own neighbor (k = 1)."""
    X = _lazy_panels(n, b, d)
    return refgeo.fit_local_maps(X, X, neighbors=np.zeros((n, 1), np.int64), cls="diagonal", return_maps=True,
                                 **kw)


def test_memory_is_checked_against_the_workers_before_any_work(client):
    # the cluster's own memory limits: the maps of one token block exceed the smallest
    # worker's, or all the maps together exceed the workers' sum
    # asked of the scheduler now: client.scheduler_info()'s cache came back without
    # workers when the client's periodic update overwrote it (seen once under load)
    limits = [w["memory_limit"] for w in worker_identities(client).values()]
    d = 512
    per_map = 8 * d * d
    b = min(limits) // per_map + 1
    seen = []
    with pytest.raises(MemoryError) as info:
        _fit_maps(2 * b, b, d, progress=seen.append)
    msg = str(info.value)
    assert msg.startswith(f"fit_local_maps(N={2 * b}, d=512, k=1, cls='diagonal'), one task needs about ")
    assert "per task on the smallest Dask worker (its memory limit over the one task it runs at once)" in msg
    assert "its maps, return_maps=True" in msg
    assert f"Rechunk X and Y into smaller row blocks (now up to {b} rows)" in msg
    assert "leave return_maps=False" in msg and "more memory per thread" in msg
    assert seen == []  # refused before the first step
    # blocks that fit one at a time, whose maps together do not fit the cluster
    b = min(limits) // (3 * per_map)
    n = b * (sum(limits) // (b * per_map) + 1)
    with pytest.raises(MemoryError, match=r"the results kept on the workers needs about .* on the Dask workers") as info:
        _fit_maps(n, b, d)
    assert "Leave return_maps=False, add workers or memory to them" in str(info.value)
    assert "Rechunk" not in str(info.value)  # smaller blocks keep as much
    # a call that fits goes to work (and stops at its first block here)
    with pytest.raises(_Computed):
        _fit_maps(4 * b, b, d)
    # decompose: the metrics task of one block holds more than its fit task
    b = min(limits) // (8 * d * 14)
    X = _lazy_panels(b, b, d)
    with pytest.raises(MemoryError, match=r"one task needs .*\(a metrics task\)"):
        refgeo.decompose(X, X, neighbors=np.zeros((b, 1), np.int64), cls="diagonal")
    with pytest.raises(_Computed):
        refgeo.decompose(X[: b // 2], X[: b // 2], neighbors=np.zeros((b // 2, 1), np.int64), cls="diagonal")


def _in_process_client(**kw):
    """A ``LocalCluster(processes=False)`` (its workers are threads of this process) and
    its client, as one context manager."""
    import contextlib

    stack = contextlib.ExitStack()
    cluster = stack.enter_context(distributed.LocalCluster(processes=False, dashboard_address="127.0.0.1:0",
                                                           worker_dashboard_address=None, **kw))
    stack.enter_context(distributed.Client(cluster, timeout=TIMEOUT))
    return stack


def _available():
    avail = refgeo._memory.available_memory()
    if avail is None:
        pytest.skip("the available memory is unknown on this system")
    return avail


@pytest.mark.parametrize("limited", [True, False])
@pytest.mark.filterwarnings("ignore:Port .* is already in use:UserWarning")  # the in-process worker's dashboard
def test_memory_per_task_counts_the_tasks_a_worker_runs_at_once(client, limited):
    # one worker with two threads and a limit of a quarter of this process's memory:
    # one task may take its whole limit, two take half each; a worker without a limit
    # (0) is not checked (and the calls fit this process)
    d = 512
    quarter = _available() // 4
    with _in_process_client(n_workers=1, threads_per_worker=2, memory_limit=quarter if limited else 0):
        limit = next(iter(worker_identities(distributed.get_client()).values()))["memory_limit"]
        assert limit == (quarter if limited else 0)
        b = quarter * 3 // (4 * 8 * d * d)  # maps of 3/4 of the quarter per block
        with pytest.raises(_Computed):
            _fit_maps(b, b, d)
        if limited:
            with pytest.raises(MemoryError, match=r"one task needs .* per task on the smallest Dask worker "
                                                  r"\(its memory limit over the 2 tasks it runs at once\)"):
                _fit_maps(2 * b, b, d)
        else:
            with pytest.raises(_Computed):
                _fit_maps(2 * b, b, d)
    assert distributed.default_client() is client


@pytest.mark.filterwarnings("ignore:Port .* is already in use:UserWarning")  # the in-process worker's dashboard
def test_memory_of_in_process_workers_is_this_process(client):
    # two in-process workers, each allowed all of this process's memory: the workers'
    # limits pass the maps of four blocks (two fifths of the memory each, 8/5 in all,
    # under the limits' sum of 2), but the workers are threads of this process, which
    # holds them all, and the two tasks they run at once
    d = 512
    avail = _available()
    with _in_process_client(n_workers=2, threads_per_worker=1, memory_limit=avail):
        b = avail * 2 // (5 * 8 * d * d)
        with pytest.raises(MemoryError) as info:
            _fit_maps(4 * b, b, d)
        msg = str(info.value)
        assert msg.startswith(f"fit_local_maps(N={4 * b}, d=512, k=1, cls='diagonal') needs about ")
        assert "are available in this process (its in-process Dask workers run the tasks here)" in msg
        assert "maps (N, d, d), return_maps=True" in msg and "(times 2, the tasks running at once)" in msg
        assert "run fewer tasks at once (now 2: the workers' threads)" in msg
        # one block at a time fits
        with pytest.raises(_Computed):
            _fit_maps(b, b, d)
    assert distributed.default_client() is client


def test_memory_on_the_local_scheduler_is_this_process(client):
    import dask

    avail = _available()
    d = 512
    b = avail // (8 * d * d) + 1
    with dask.config.set(scheduler="threads"), pytest.raises(MemoryError, match=r"in this process \(the local"):
        _fit_maps(b, b, d)
    # the processes scheduler: child processes of this one, on this machine
    with dask.config.set(scheduler="processes"), pytest.raises(MemoryError, match=r"on this machine \(the local"):
        _fit_maps(b, b, d)
    # the tasks running at once share this process with the results: blocks with
    # neighbor rows in the three others, each task about 2/5 of the memory, fit one at
    # a time (with the kept fitted values and coefficients), not four at once
    k = 3
    b = avail // (8 * d * 60)
    n = 4 * b
    X = _lazy_panels(n, b, d)
    nbr = np.zeros((n, k), np.int64)
    for scheduler, workers in (("sync", 4), ("threads", 1)):
        with dask.config.set(scheduler=scheduler, num_workers=workers), pytest.raises(_Computed):
            refgeo.fit_local_maps(X, X, neighbors=nbr, cls="diagonal")
    with dask.config.set(scheduler="threads", num_workers=4), pytest.raises(MemoryError) as info:
        refgeo.fit_local_maps(X, X, neighbors=nbr, cls="diagonal")
    assert "(times 4, the tasks running at once)" in str(info.value)
    assert "run fewer tasks at once (now 4: dask.config num_workers)" in str(info.value)
    # decompose checks the same way: here the (N,) metrics alone exceed this process
    n = avail // (24 * 8) + 1
    with pytest.raises(MemoryError, match=r"decompose\(N=\d+, d=1, cls='diagonal'\) needs about .*per-token metrics"):
        refgeo.decompose(_lazy_panels(n, n // 4 + 1, 1), _lazy_panels(n, n // 4 + 1, 1), k=1, cls="diagonal")


_TASK_PEAKS = """
import json, math, sys, tracemalloc
import numpy as np
from refgeo import _dask_tokenwise as _dt

n, d, b, k, chunk = 1200, 32, 300, 8, 100
out = {}
for dtype in (np.float64, np.float32):
    rng = np.random.default_rng(3)
    X = 4 * rng.standard_normal((n, d))
    Y = (X + 0.1 * rng.standard_normal((n, d))).astype(dtype)
    X = X.astype(dtype)
    e = math.frexp(float(max(np.abs(X).max(), np.abs(Y).max())))[1]  # as scale_exponent
    idx = rng.integers(0, n, (n, k))  # neighbors in every block: the most rows to gather
    w = rng.random((n, k)) + 0.5
    offsets = np.arange(0, n + 1, b)
    nbr, sources = _dt._local_plan(idx[:b], offsets, 0)
    XI, YI, wI = X[:b].copy(), Y[:b].copy(), w[:b].copy()
    gathered = [tuple(np.ascontiguousarray(a) for a in _dt._gather(X[s : s + b], Y[s : s + b], rows))
                for s, rows in ((offsets[J], rows) for J, rows in sources)]
    held = XI.nbytes + YI.nbytes + wI.nbytes + nbr.nbytes + sum(a.nbytes + c.nbytes for a, c in gathered)
    for cls in sys.argv[1].split(","):
        for return_maps in (False, True):
            rank = 4 if cls == "low_rank" else None
            args = (XI, YI, gathered, nbr, wI, e, cls, rank, 1e-3, True, chunk, return_maps)
            _dt._fit_block(*args)  # the imports and caches of a first call are not the task's
            tracemalloc.start()
            try:
                start = tracemalloc.get_traced_memory()[0]
                got = _dt._fit_block(*args)
                peak = tracemalloc.get_traced_memory()[1] - start
            finally:
                tracemalloc.stop()
            assert got[0].shape == (b, d) and (got[2] is not None) == return_maps
            out[f"{np.dtype(dtype).name}-{return_maps}-{cls}"] = held + peak
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def task_peaks():
    # tracemalloc's peak counts the allocations of every thread of the process: in the
    # test session, threads of the clusters of other tests (heartbeats, comms) add a
    # few hundred kB at random, so the task runs alone in a fresh interpreter
    import json
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _TASK_PEAKS, ",".join(_CLASSES)], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("cls", _CLASSES)
@pytest.mark.parametrize("return_maps", [False, True])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_the_task_estimate_bounds_what_a_fit_task_holds(task_peaks, cls, return_maps, dtype):
    # tracemalloc follows NumPy's allocations: the inputs of the first fit task (its
    # block and the neighbor rows gathered from the three others) and the peak of the
    # task itself stay within the estimate of the memory check
    from refgeo import _dask_tokenwise as _dt

    n, d, b, k, chunk = 1200, 32, 300, 8, 100  # as in _TASK_PEAKS
    A = np.zeros((n, d), dtype=dtype)
    task, _ = _dt.fit_bytes(_dask(A, b, d), _dask(A, b, d), k, cls, chunk, return_maps)
    used = task_peaks[f"{np.dtype(dtype).name}-{return_maps}-{cls}"]
    assert used <= sum(task.values()), (used, task)


def test_graphs_of_one_input_agree_on_every_chunk_key(client):
    """fit_local_maps and decompose submit several graphs over the same chunks (the
    finiteness and range checks, the neighbor search, the fits, the metrics); with
    Dask's low-level fusion on, each fused the input's tasks by its own use of them,
    and the scheduler warned "Detected different `run_spec`" (docs/cluster.md).  Fusion is off for their
    length, as for the row functions (test_dask.py).  (Inputs built from one another,
    such as ``Xd`` and ``Xd + 1.0``, still give some keys two sets of dependencies by
    Dask's blockwise fusion; four decompose calls on those logged the warning 48 times
    with fusion on and none with it off.)"""
    rng = np.random.default_rng(4)
    X = rng.standard_normal((240, 5))
    Y = X + 0.1 * rng.standard_normal((240, 5))
    Xd = (da.from_array(X, chunks=(70, 3)) * 1.0).rechunk((60, 5))
    Yd = (da.from_array(Y, chunks=(50, 5)) * 1.0).rechunk((60, 5))
    with graph_key_clashes(client) as (seen, clashes):
        r = refgeo.decompose(Xd, Yd, k=3, cls="diagonal")
        f = refgeo.fit_local_maps(Xd, Yd, k=3, cls="full", standardize=True)
    assert r.energy_fraction == refgeo.decompose(X, Y, k=3, cls="diagonal").energy_fraction
    np.testing.assert_array_equal(f.fitted, refgeo.fit_local_maps(X, Y, k=3, cls="full", standardize=True).fitted)
    assert len(seen) > 50  # the recording saw the graphs
    assert not clashes, sorted(map(str, clashes))[:5]


def test_misspelled_mlp_options_are_refused_for_dask_input_too(client):
    X = da.from_array(np.random.default_rng(5).standard_normal((40, 3)), chunks=20)
    for bad, match in (({"bogus": 1}, "bogus"), ({"hidden": -3}, "hidden")):
        with pytest.raises((TypeError, ValueError), match=match):
            refgeo.decompose(X, X + 1.0, k=4, cls="diagonal", mlp_options=bad)
        with pytest.raises((TypeError, ValueError), match=match):  # the same error as for NumPy input
            refgeo.decompose(X.compute(), X.compute() + 1.0, k=4, cls="diagonal", mlp_options=bad)
