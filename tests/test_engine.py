"""The certified pairwise engine against a float64 brute-force oracle.

The oracle (``_oracle_sq``) is written here, independently of refgeo: the documented
power-of-two prescaling, then direct float64 differences summed in the documented
canonical order (eight lanes ``k mod 8`` in
increasing ``k``, then ``((p0+p1)+(p2+p3))+((p4+p5)+(p6+p7))``), so certified results
must match it *exactly*: same indices, same values.  Strategies draw the adversarial
cases: common offsets up to 1e8 times the spread, exact duplicates,
near-duplicates at 1e-12 relative distance, integer grids full of ties, float32,
V = 2, d = 1, ragged last tiles, tile sizes and n_threads in {1, 2}.
Each kernel gets >= 2000 hypothesis examples in total.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import refgeo
from refgeo import _backend, _certify, _engine, _memory, rows
from refgeo.testing import strategies as rst



# ------------------------------------------------------------------ oracle


def _oracle_exponent(*arrays) -> int:
    """The documented prescaling: float64 rows whose largest magnitude m lies outside
    [2**-64, 2**65) are used as rows * 2**-e, e the binary exponent of m."""
    if all(np.asarray(a).dtype == np.float32 for a in arrays):
        return 0
    m = max(float(np.max(np.abs(a))) for a in arrays)
    if m == 0.0 or 2.0**-64 <= m < 2.0**65:
        return 0
    return math.frexp(m)[1]


def _oracle_prescaled(S):
    """S as the kernels see it (float64 and scaled when the rule says so)."""
    e = _oracle_exponent(S)
    return np.ldexp(np.asarray(S, dtype=np.float64), -e) if e else S


def _oracle_sq(A, B):
    """(nA, nB) squared distances of the prescaled rows (units of ``2**(2e)``), float64
    direct differences, canonical order."""
    e = _oracle_exponent(A, B)
    A = np.ldexp(np.asarray(A, dtype=np.float64), -e)
    B = np.ldexp(np.asarray(B, dtype=np.float64), -e)
    d = A.shape[1]
    pad = (-d) % 8
    Ap = np.pad(A, ((0, 0), (0, pad)))
    Bp = np.pad(B, ((0, 0), (0, pad)))
    lanes = np.zeros((A.shape[0], B.shape[0], 8))
    for k0 in range(0, d + pad, 8):
        t = Ap[:, None, k0 : k0 + 8] - Bp[None, :, k0 : k0 + 8]
        lanes = lanes + t * t
    p = [lanes[..., r] for r in range(8)]
    return ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]))


def _oracle_extreme(S, maximize, D2=None):
    D2 = _oracle_sq(S, S) if D2 is None else D2
    iu = np.triu_indices(len(S), 1)
    vals = D2[iu]
    k = int(np.argmax(vals) if maximize else np.argmin(vals))  # first = smallest (i, j)
    return math.ldexp(math.sqrt(vals[k]), _oracle_exponent(S)), int(iu[0][k]), int(iu[1][k])


def _oracle_knn(X, k, Y=None, exclude_self=True):
    D2 = _oracle_sq(X, X if Y is None else Y)
    if Y is None and exclude_self:
        np.fill_diagonal(D2, np.inf)
    order = np.argsort(D2, axis=1, kind="stable")[:, :k]  # ties: smaller index first
    e = _oracle_exponent(X, X if Y is None else Y)
    return order, np.ldexp(np.sqrt(np.take_along_axis(D2, order, 1)), e)


# ------------------------------------------------------------------ strategies


@st.composite
def adversarial_clouds(draw, max_v=24, max_d=9):
    """Row clouds with the adversarial structure built in.

    Hypothesis draws the structure (sizes, kind, duplicates, scale, offset, dtype) and
    a seed; NumPy fills in the numbers (fast, so thousands of examples stay cheap).
    """
    V = draw(st.integers(2, max_v))
    d = draw(st.integers(1, max_d))
    kind = draw(st.sampled_from(["uniform", "grid", "near_duplicates"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if kind == "grid":  # many exact ties
        S = rng.integers(-2, 3, size=(V, d)).astype(np.float64)
    else:
        S = rng.uniform(-1.0, 1.0, size=(V, d))
    if kind == "near_duplicates":  # pairs at 0 or ~1e-12 relative distance
        for _ in range(draw(st.integers(1, V - 1))):
            a, b = rng.integers(0, V, size=2)
            eps = rng.choice([0.0, 1e-12, -1e-12, 3e-12])
            S[b] = S[a] * (1.0 + eps) + eps
    if draw(st.booleans()):  # an exact duplicate row
        a, b = rng.integers(0, V, size=2)
        S[b] = S[a]
    spread = draw(st.sampled_from([1.0, 1e-3, 1e3]))
    offset = draw(st.sampled_from([0.0, 1.0, 1e4, 1e8]))  # common offset, times the spread
    S = S * spread + offset * spread * rng.uniform(-1.0, 1.0, size=d)
    return S.astype(draw(st.sampled_from([np.float64, np.float32])))


def engine_clouds():
    """The public row strategies (structured clouds: ties, ulp-level near duplicates,
    offsets, rank deficiency, layouts) and the clouds above, which add near duplicates
    at 1e-12 relative distance under offsets up to 1e8 and cost little per example."""
    return st.one_of(adversarial_clouds(), rst.row_clouds(n_rows=(2, 24), n_cols=(1, 9)))


# n_threads = 2 in 1/32 of the examples (about 60 per test): on a loaded machine,
# waking an OpenMP team costs far more than these tiny examples; the larger
# agnosticism cases below run every kernel on 1 and 2 threads.
engine_options = dict(tile_size=st.integers(1, 30), n_threads=st.sampled_from([1] * 31 + [2]))


@pytest.fixture
def parallel_always(monkeypatch):
    """Use the requested threads even for tiny inputs, so the thread merge is tested."""
    monkeypatch.setattr(_engine, "MIN_PARALLEL_WORK", 0)


def _examples(backend, n=2000):
    """n examples on the compiled engine; the reference is the oracle's twin (checked in
    test_rows.py against naive NumPy), a tenth is enough for it; on the GPU a twentieth:
    an example's tiles of 1 to 30 rows launch thousands of device kernels, each about
    as long as the whole example takes on the CPU (the GPU code is the same array-API
    code that test_tiled_engine.py checks on the CPU at full count)."""
    return {"reference": n // 10, "cupy": n // 20}.get(backend, n)


def _assert_pair(r, want, S, backend):
    value, i, j = want
    assert (r.i, r.j) == (i, j)
    assert r.value == value  # certified: bitwise equal to the float64 oracle
    assert r.error_bound >= 0.0
    assert r.dtype == str(S.dtype)
    assert r.backend == backend
    assert r.n_refined >= 1


def _kernel_pair(info, S, **opts):
    """``(value, i, j)`` of the extreme-pair kernel run on all rows of ``S``: the public
    functions hand the kernels only the rows that decide the pair when some rows are
    identical (refgeo._duplicates), so the kernels' own tie handling is checked here."""
    run, e = rows._pair_run(info, S, opts.get("tile_size"), opts.get("n_threads"))
    return math.ldexp(run.value, e), run.i, run.j


def _assert_extremes_exact(S, backend, **opts):
    """Diameter, closest pair and farthest partners of ``S`` against the float64 oracle."""
    D2 = _oracle_sq(S, S)
    for info, maximize, public in ((rows._DIAMETER, True, refgeo.row_diameter),
                                   (rows._CLOSEST, False, refgeo.closest_pair)):
        want = _oracle_extreme(S, maximize, D2)
        _assert_pair(public(S, **opts), want, S, backend)
        assert _kernel_pair(info, S, **opts) == want
    fp = refgeo.farthest_partners(S, **opts)
    np.fill_diagonal(D2, -np.inf)
    want = np.argmax(D2, axis=1)
    np.testing.assert_array_equal(fp.indices, want)
    np.testing.assert_array_equal(fp.distances, np.ldexp(np.sqrt(D2[np.arange(len(S)), want]), _oracle_exponent(S)))


_BUDGET, _BUDGET_DIVISOR = _engine.MIN_MIXED_BUDGET, _engine.MIN_MIXED_BUDGET_DIVISOR  # the defaults
_FARTHEST = {name: getattr(_engine, name) for name in ("FARTHEST_MIN_CAP", "FARTHEST_CAP_SHARE",
                                                         "FARTHEST_BUDGET_DIVISOR", "FARTHEST_MIN_HEAVY_ROWS",
                                                         "FARTHEST_HEAVY_SHARE")}


def _restore_mixed_settings(monkeypatch):
    """Restore the engine's float32-filter thresholds and budgets after the test."""
    for name in ("MAX_MIXED_MIN_WORK", "MIN_MIXED_MIN_WORK", "MIN_MIXED_BUDGET", "MIN_MIXED_BUDGET_DIVISOR",
                 *_FARTHEST):
        monkeypatch.setattr(_engine, name, getattr(_engine, name))


def _set_mixed(mixed, tight):
    """float64 rows through the float32 filter from no work on (or never); with
    ``tight``, a closest-pair run through a float32 filter gives up after one refinement,
    and a farthest-partner run once a row has had two."""
    _engine.MAX_MIXED_MIN_WORK = _engine.MIN_MIXED_MIN_WORK = 0 if mixed else 1 << 62
    _engine.MIN_MIXED_BUDGET = 1 if tight else _BUDGET
    _engine.MIN_MIXED_BUDGET_DIVISOR = 1 << 62 if tight else _BUDGET_DIVISOR
    for name, value in _FARTHEST.items():
        setattr(_engine, name, {"FARTHEST_MIN_CAP": 1, "FARTHEST_MIN_HEAVY_ROWS": 0}.get(name, 1 << 62)
                if tight else value)


# ------------------------------------------------------------------ >= 2000 examples per kernel


def test_extreme_pairs_exact(backend, parallel_always, monkeypatch):
    """row_diameter, closest_pair and farthest_partners: 2000 examples each."""
    _restore_mixed_settings(monkeypatch)

    @settings(max_examples=_examples(backend))
    @given(S=engine_clouds(), mixed=st.booleans(), tight=st.booleans(), **engine_options)
    def check(S, mixed, tight, tile_size, n_threads):
        # float64 rows: float32 filter or not; the closest pair's budget of refinements
        # in the float32 filter tight (a run in float64 after about every float32 run)
        _set_mixed(mixed, tight)
        _assert_extremes_exact(S, backend, tile_size=tile_size, n_threads=n_threads)

    check()


_ANCHORS = {name: getattr(_engine, name) for name in ("ANCHOR_BATCH", "ANCHOR_MIN_GAIN", "ANCHOR_MAX_SHARE",
                                                        "ANCHOR_REACH", "ANCHOR_MIN_WORK", "ANCHOR_UNION_SHARE",
                                                        "ANCHOR_MERGE_GROWTH", "LOCAL_FRAME_GAIN")}


def _draw_anchors(data):
    """The grouping of the rows the heaps defer around anchors (``_engine._anchor_groups``),
    as set up by default (tiny examples then never group), or grouping every row it can:
    any anchors, any reach and any frame give the same answer."""
    if data.draw(st.booleans()):
        for name, value in _ANCHORS.items():
            setattr(_engine, name, value)
        return
    _engine.ANCHOR_BATCH = data.draw(st.sampled_from([1, 2, 5, 64]))
    _engine.ANCHOR_MIN_GAIN = data.draw(st.sampled_from([0, 1, 2]))
    _engine.ANCHOR_MAX_SHARE = 1
    _engine.ANCHOR_REACH = data.draw(st.sampled_from([0.0, 0.5, 2.0, 8.0]))
    _engine.ANCHOR_MIN_WORK = data.draw(st.sampled_from([0, 1 << 12]))
    _engine.ANCHOR_UNION_SHARE = data.draw(st.sampled_from([1, 16]))
    # each group through heaps in its own frame first, never, or where it gains
    _engine.LOCAL_FRAME_GAIN = data.draw(st.sampled_from([0.0, 16.0, math.inf]))
    _engine.ANCHOR_MERGE_GROWTH = data.draw(st.sampled_from([0.0, 1.25, 1e9]))  # never, default, always


_TIE_PROBE = {name: getattr(_engine, name) for name in ("KNN_TIE_PROBE", "KNN_TIE_PROBE_SHARE",
                                                          "KNN_TIE_PROBE_MIN_ROWS")}


def _draw_tie_probe(data):
    """The probe of the float64 filter's heaps (``_engine.KNN_TIE_PROBE*``), as set up by
    default (tiny examples never probe), or probing a few rows and skipping the float64
    filter for the rest when the probe defers any share of them (0: always): any
    probe gives the same answer."""
    if data.draw(st.booleans()):
        for name, value in _TIE_PROBE.items():
            setattr(_engine, name, value)
        return
    _engine.KNN_TIE_PROBE = data.draw(st.sampled_from([1, 3]))
    _engine.KNN_TIE_PROBE_MIN_ROWS = data.draw(st.sampled_from([0, 4]))
    _engine.KNN_TIE_PROBE_SHARE = data.draw(st.sampled_from([0.0, 0.5, 0.9]))


def test_knn_exact(backend, parallel_always, monkeypatch):
    """knn of X against X (with and without self) and against Y: 2000 examples."""
    monkeypatch.setattr(_engine, "KNN_MIXED_MIN_WORK", _engine.KNN_MIXED_MIN_WORK)  # restored after
    for name, value in {**_ANCHORS, **_TIE_PROBE}.items():
        monkeypatch.setattr(_engine, name, value)

    @settings(max_examples=_examples(backend))
    @given(S=engine_clouds(), data=st.data(), **engine_options)
    def check(S, data, tile_size, n_threads):
        opts = dict(tile_size=tile_size, n_threads=n_threads)
        # float64 rows: float32 filter plus float64 redo of uncertified rows, or not
        _engine.KNN_MIXED_MIN_WORK = data.draw(st.sampled_from([0, 1 << 62]))
        _draw_anchors(data)
        _draw_tie_probe(data)
        exclude_self = data.draw(st.booleans())
        k = data.draw(st.integers(1, len(S) - int(exclude_self)))
        r = refgeo.knn(S, k, exclude_self=exclude_self, **opts)
        idx, dist = _oracle_knn(S, k, exclude_self=exclude_self)
        np.testing.assert_array_equal(r.indices, idx)
        np.testing.assert_array_equal(r.distances, dist)
        # against Y: rows of S copied or perturbed, so ties and near-ties cross X and Y
        nY = data.draw(st.integers(1, 20))
        rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
        pick = rng.integers(0, len(S), size=nY)
        noise = data.draw(st.sampled_from([0.0, 1e-12, 1e-3]))
        Y = (S[pick].astype(np.float64) * (1.0 + noise * rng.standard_normal(S.shape[1]))).astype(S.dtype)
        k = data.draw(st.integers(1, nY))
        r = refgeo.knn(S, k, Y, **opts)
        idx, dist = _oracle_knn(S, k, Y)
        np.testing.assert_array_equal(r.indices, idx)
        np.testing.assert_array_equal(r.distances, dist)

    check()


# ------------------------------------------------------------------ agnosticism on larger inputs


def _larger_cases():
    rng = np.random.default_rng(7)
    g = rng.standard_normal((300, 40))
    yield "gaussian", g
    yield "offset1e6_f32", (g * 1e-3 + 1e6).astype(np.float32)
    clustered = np.repeat(rng.standard_normal((30, 12)), 10, axis=0)
    clustered[::7] += 1e-12
    yield "clusters", clustered
    yield "simplex", np.eye(120) * 2.5  # every pair ties: buffers overflow and flush
    yield "grid_f32", rng.integers(-1, 2, size=(257, 5)).astype(np.float32)


@pytest.mark.parametrize("name,S", list(_larger_cases()), ids=[c[0] for c in _larger_cases()])
def test_tile_and_thread_agnosticism(backend, name, S):
    want_D = _oracle_extreme(S, True)
    want_m = _oracle_extreme(S, False)
    k = 5
    want_knn = _oracle_knn(S, k)
    D2 = _oracle_sq(S, S)
    np.fill_diagonal(D2, -np.inf)
    want_fp = np.argmax(D2, axis=1)
    for tile in (16, 33, 256, len(S)):
        for n_threads in (1, 2):
            opts = dict(tile_size=tile, n_threads=n_threads)
            _assert_pair(refgeo.row_diameter(S, **opts), want_D, S, backend)
            _assert_pair(refgeo.closest_pair(S, **opts), want_m, S, backend)
            r = refgeo.knn(S, k, **opts)
            np.testing.assert_array_equal(r.indices, want_knn[0])
            np.testing.assert_array_equal(r.distances, want_knn[1])
            np.testing.assert_array_equal(refgeo.farthest_partners(S, **opts).indices, want_fp)


def test_regular_simplex_ties_resolve_to_smallest_pair(backend):
    E = np.eye(150)
    for fn in (refgeo.row_diameter, refgeo.closest_pair):
        r = fn(E, tile_size=16, n_threads=2)
        assert (r.i, r.j, r.value) == (0, 1, math.sqrt(2.0))
    fp = refgeo.farthest_partners(E, tile_size=16, n_threads=2)
    assert fp.indices[0] == 1 and np.all(fp.indices[1:] == 0)
    kn = refgeo.knn(E, 3, tile_size=16, n_threads=2)
    np.testing.assert_array_equal(kn.indices[0], [1, 2, 3])
    np.testing.assert_array_equal(kn.indices[5], [0, 1, 2])


def test_all_rows_equal(backend):
    S = np.full((40, 3), 7.0)
    r = refgeo.row_diameter(S, tile_size=8)
    assert (r.value, r.i, r.j) == (0.0, 0, 1)
    m = refgeo.closest_pair(S, tile_size=8)
    assert (m.value, m.i, m.j) == (0.0, 0, 1)
    kn = refgeo.knn(S, 4, tile_size=8, n_threads=2)
    np.testing.assert_array_equal(kn.indices[0], [1, 2, 3, 4])
    np.testing.assert_array_equal(kn.indices[39], [0, 1, 2, 3])


def test_near_duplicates_under_huge_offset(backend):
    """The Gram trick alone cannot see a 1e-12 relative gap under a 1e8 offset."""
    rng = np.random.default_rng(11)
    S = rng.standard_normal((200, 16))
    S[123] = S[45] * (1 + 1e-12)
    S[77] = S[45] * (1 + 2e-12)
    S = S + 1e8
    want = _oracle_extreme(S, False)
    r = refgeo.closest_pair(S, tile_size=32, n_threads=2)
    _assert_pair(r, want, S, backend)
    assert {r.i, r.j} <= {45, 77, 123}


def test_float32_knn_exact_where_gram_trick_is_not(backend):
    """A float32 Gram-trick k-NN answer is wrong here; the certified one is not."""
    rng = np.random.default_rng(5)
    base = rng.standard_normal((1, 64))
    X = (base + 1e-3 * rng.standard_normal((400, 64)) + 30.0).astype(np.float32)
    k = 4
    # float32 Gram trick as a plain implementation would do it
    n = np.einsum("ij,ij->i", X, X)
    G = n[:, None] + n[None, :] - 2 * (X @ X.T)
    np.fill_diagonal(G, np.inf)
    gram = np.argsort(G, axis=1, kind="stable")[:, :k]
    want_idx, want_dist = _oracle_knn(X, k)
    assert not np.array_equal(gram, want_idx)  # the trap is real
    r = refgeo.knn(X, k, tile_size=64, n_threads=2)
    np.testing.assert_array_equal(r.indices, want_idx)
    np.testing.assert_array_equal(r.distances, want_dist)


@pytest.mark.parametrize("exclude_self", [True, False])
def test_knn_float32_filter_of_float64_rows_redoes_uncertified_rows(backend, monkeypatch, exclude_self):
    """Clusters 1e-9 wide: the float32 filter cannot order them, the float64 redo does."""
    monkeypatch.setattr(_engine, "KNN_MIXED_MIN_WORK", 0)
    rng = np.random.default_rng(9)
    centers = rng.standard_normal((12, 20))
    X = np.repeat(centers, 25, axis=0) + 1e-9 * rng.standard_normal((300, 20))
    Y = X[::3] + 1e-10
    for tile, n_threads in ((32, 2), (300, 1)):
        r = refgeo.knn(X, 6, exclude_self=exclude_self, tile_size=tile, n_threads=n_threads)
        want = _oracle_knn(X, 6, exclude_self=exclude_self)
        np.testing.assert_array_equal(r.indices, want[0])
        np.testing.assert_array_equal(r.distances, want[1])
        r = refgeo.knn(X, 4, Y, tile_size=tile, n_threads=n_threads)
        want = _oracle_knn(X, 4, Y)
        np.testing.assert_array_equal(r.indices, want[0])
        np.testing.assert_array_equal(r.distances, want[1])


def _knn_edge_clouds():
    rng = np.random.default_rng(21)
    yield "grid_ties", rng.integers(-1, 2, size=(300, 4)).astype(np.float64)
    yield "grid_ties_f32", rng.integers(-2, 3, size=(260, 3)).astype(np.float32)
    dup = np.repeat(rng.standard_normal((40, 6)), 8, axis=0)  # every row 8 times
    dup[::5] += 1e-13
    yield "duplicates", dup
    yield "gaussian", rng.standard_normal((333, 9))


@pytest.mark.parametrize("name,S", list(_knn_edge_clouds()), ids=[c[0] for c in _knn_edge_clouds()])
def test_knn_tile_epilogue_edge_cases(backend, parallel_always, monkeypatch, name, S):
    """The k-NN tile epilogue against the oracle where its shortcuts could slip.

    The epilogue flags, per tile row, the keys below the heaps' tops in one vectorized
    pass and inserts only those; on two threads a key must also be below the other
    thread's top for the row (heaps that end with fewer than K entries); the tile
    pairs may be walked in blocks (KNN_HEAP_BLOCK_BYTES).  Exact ties everywhere
    (integer grids, rows repeated 8 times), k from 1 to N - 1 (heaps holding every
    candidate), tiles that are no multiple of the 8-byte mask words, one and two
    threads, row-major and blocked tile order, float64 rows with and without the
    float32 filter.
    """
    n = len(S)
    for k in (1, 9, n - 1):
        want = _oracle_knn(S, k)
        for tile, n_threads, block, mixed in ((13, 2, 40000, 0), (64, 2, 0, 1 << 62),
                                              (64, 1, 40000, 0), (n, 2, 1, 0), (7, 2, 1 << 40, 0)):
            monkeypatch.setattr(_engine, "KNN_HEAP_BLOCK_BYTES", block)
            monkeypatch.setattr(_engine, "KNN_MIXED_MIN_WORK", mixed)
            r = refgeo.knn(S, k, tile_size=tile, n_threads=n_threads)
            np.testing.assert_array_equal(r.indices, want[0], err_msg=f"{k=} {tile=} {n_threads=}")
            np.testing.assert_array_equal(r.distances, want[1])
    # X against Y (no column heaps; the float64 redo excludes row i by index)
    Y = S[::3].copy()
    want = _oracle_knn(S, 5, Y)
    for tile, n_threads in ((13, 2), (len(S), 1)):
        r = refgeo.knn(S, 5, Y, tile_size=tile, n_threads=n_threads)
        np.testing.assert_array_equal(r.indices, want[0])
        np.testing.assert_array_equal(r.distances, want[1])


@st.composite
def tie_clouds(draw, max_v=80, max_d=4):
    """Integer-valued clouds where nearly every distance ties with many others.

    Grids of {-1, 0, 1}, a few distinct rows each repeated many times, and the points
    of an integer lattice box, with signed zeros (whole rows negated) and a power-of-two
    scale (exact: the ties survive it, and 2**+-600 forces the prescaling).  Sizes span
    many tiles of 3 to 16 rows, so the off-diagonal tile epilogue, the shared pruning
    threshold and the blocked tile order all see exact ties at the heaps' tops.
    """
    V = draw(st.integers(2, max_v))
    d = draw(st.integers(1, max_d))
    kind = draw(st.sampled_from(["grid", "duplicates", "lattice"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if kind == "grid":
        S = rng.integers(-1, 2, size=(V, d))
    elif kind == "duplicates":
        base = rng.integers(-2, 3, size=(draw(st.integers(1, 6)), d))
        S = base[rng.integers(0, len(base), size=V)]
    else:
        side = int(math.ceil(V ** (1.0 / d)))
        box = np.stack(np.meshgrid(*[np.arange(side)] * d, indexing="ij"), -1).reshape(-1, d)
        S = box[:V] if draw(st.booleans()) else box[rng.permutation(len(box))[:V]]
    S = S.astype(np.float64)
    S[rng.random(V) < 0.5] *= -1.0  # zero entries of these rows become -0.0
    dtype = draw(st.sampled_from([np.float64, np.float32]))
    scales = [1.0, 2.0**-30, 2.0**30] + ([2.0**-600, 2.0**600] if dtype == np.float64 else [])
    return (S * draw(st.sampled_from(scales))).astype(dtype)


tie_options = dict(tile_size=st.sampled_from([3, 7, 16]), n_threads=st.sampled_from([1, 2, 3, 4]))


def test_knn_exact_with_ties_on_small_tiles_and_threads(backend, parallel_always, monkeypatch):
    """k-NN on tie clouds: 1 to 4 threads, tiles of 3, 7 and 16 rows, every tile order.

    Every heap sees keys equal to its top (and to the other threads' tops for the row)
    with smaller and larger indices; k runs from 1 to every candidate.
    """
    monkeypatch.setattr(_engine, "KNN_MIXED_MIN_WORK", _engine.KNN_MIXED_MIN_WORK)  # restored after
    monkeypatch.setattr(_engine, "KNN_HEAP_BLOCK_BYTES", _engine.KNN_HEAP_BLOCK_BYTES)
    monkeypatch.setattr(_engine, "WITHIN_SLOTS", _engine.WITHIN_SLOTS)

    @settings(max_examples=_examples(backend, 300))
    @given(S=tie_clouds(), data=st.data(), **tie_options)
    def check(S, data, tile_size, n_threads):
        opts = dict(tile_size=tile_size, n_threads=n_threads)
        _engine.KNN_MIXED_MIN_WORK = data.draw(st.sampled_from([0, 1 << 62]))
        # rows the heaps cannot certify: their pairs within reach, in strips of one row,
        # of a few rows, or of all of them
        _engine.WITHIN_SLOTS = data.draw(st.sampled_from([1, 64, 1 << 22]))
        # row-major order, blocks of one tile pair, of two to three tiles per side, one block
        _engine.KNN_HEAP_BLOCK_BYTES = data.draw(
            st.sampled_from([0, 1, 2 * tile_size * 16 * 16, 3 * tile_size * 16 * 24, 1 << 40])
        )
        exclude_self = data.draw(st.booleans())
        n_cand = len(S) - int(exclude_self)
        if n_cand >= 1:
            k = data.draw(st.sampled_from(sorted({1, min(2, n_cand), min(8, n_cand), n_cand})))
            r = refgeo.knn(S, k, exclude_self=exclude_self, **opts)
            idx, dist = _oracle_knn(S, k, exclude_self=exclude_self)
            np.testing.assert_array_equal(r.indices, idx)
            np.testing.assert_array_equal(r.distances, dist)
        # against Y: duplicated rows of S and rows of S itself, so X and Y tie across
        rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
        Y = S[rng.integers(0, len(S), size=data.draw(st.integers(1, 2 * len(S))))]
        k = data.draw(st.sampled_from(sorted({1, min(8, len(Y)), len(Y)})))
        r = refgeo.knn(S, k, Y, **opts)
        idx, dist = _oracle_knn(S, k, Y)
        np.testing.assert_array_equal(r.indices, idx)
        np.testing.assert_array_equal(r.distances, dist)

    check()


def _assert_knn_rows_exact(r, S, rows, k):
    D2 = _oracle_sq(S[rows], S)
    D2[np.arange(len(rows)), rows] = np.inf
    want = np.lexsort((np.broadcast_to(np.arange(len(S)), D2.shape), D2), axis=1)[:, :k]
    np.testing.assert_array_equal(r.indices[rows], want)
    dist = np.ldexp(np.sqrt(np.take_along_axis(D2, want, 1)), _oracle_exponent(S))  # D2: prescaled units
    np.testing.assert_array_equal(r.distances[rows], dist)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_knn_of_lm_gradient_rows_is_certified_from_the_heaps(backend, dtype):
    """LM-head gradient rows (Zipf prior, a common hidden-state component) span nine
    orders of magnitude in norm.  The heaps bounded a pair left out with the largest
    norm of all rows, which for the small rows exceeded their whole neighbourhood: no
    row was certified and every pair was refined (16.6 million of 16.8 million at
    4096 x 256, 1.35 s against 0.06 s for Gaussian rows).  Keys on lowered norms bound
    each pair by its own: about 1.6 refined pairs per neighbour."""
    if backend != "cython":
        pytest.skip("the compiled engine's heaps")
    from refgeo._lm_gradients import lm_gradient

    S = lm_gradient(2048, 128, n_tokens=512, seed=1).astype(dtype)
    r = refgeo.knn(S, 8)
    assert r.n_refined <= 4 * 8 * len(S)  # all pairs: 4.2 million
    _assert_knn_rows_exact(r, S, np.random.default_rng(6).choice(len(S), 200, replace=False), 8)


@settings(max_examples=150)
@given(S=engine_clouds(), decades=st.lists(st.integers(0, 12), min_size=1, max_size=64),
       k=st.integers(1, 6))
def test_knn_of_rows_of_many_magnitudes_is_exact(backend, S, decades, k):
    """Rows scaled by 1 to 1e-12 (Zipf-like row norms): the lowered-norm keys order
    pairs whose bounds differ by twelve orders of magnitude; the answer is the oracle's."""
    scale = 10.0 ** -np.resize(np.array(decades, dtype=np.float64), len(S))
    S = (S.astype(np.float64) * scale[:, None]).astype(S.dtype)
    k = min(k, len(S) - 1)
    r = refgeo.knn(S, k)
    _assert_knn_rows_exact(r, S, np.arange(len(S)), k)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_knn_of_sign_rows_redoes_tied_rows_with_larger_heaps(backend, dtype):
    """Sign rows (a binarized head): squared distances are multiples of 4, and a row of
    5,000 random +-1 rows of length 64 has about 9 others at its 8-th distance, more
    than the heaps' slack.  Those rows were refined against every candidate (1,100
    pairs per row, and a full sort of them: 8.2 s at 20,000 rows); redone with 4 times
    the heap they refine about 12."""
    if backend != "cython":
        pytest.skip("the compiled engine's heaps")
    rng = np.random.default_rng(5)
    S = rng.choice([-1.0, 1.0], size=(5000, 64)).astype(dtype)
    r = refgeo.knn(S, 8)
    assert r.n_refined <= 4 * 8 * len(S)
    _assert_knn_rows_exact(r, S, rng.choice(len(S), 200, replace=False), 8)


def _recorder(monkeypatch, name, entry):
    """The list that each call of ``_engine.<name>`` appends ``entry(*args, **kwargs)``
    to (the call itself runs unchanged)."""
    calls = []
    real = getattr(_engine, name)

    def recorded(*args, **kwargs):
        calls.append(entry(*args, **kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(_engine, name, recorded)
    return calls


def _record_knn_passes(monkeypatch, kernels=None):
    """The list that each pass of the compiled k-NN appends ``(rows, K)`` to (``K``
    None: the first pass's heap size); ``kernels``, if given, gets each pass's filter
    dtype."""
    kernels = [] if kernels is None else kernels

    def entry(*args, **kwargs):
        kernels.append(kwargs.get("dt"))
        return args[3].shape[0], kwargs.get("K")  # rows (SA), heap entries

    return _recorder(monkeypatch, "_knn_pass", entry)


def _record_runs(monkeypatch, threshold_passes=False):
    """The list that each heap pass of the compiled k-NN appends ``(filter dtype, rows,
    candidates)`` to, and, with ``threshold_passes``, each threshold pass
    ``("threshold pass", rows, candidates)``."""
    runs = _recorder(monkeypatch, "_knn_pass", lambda *a, **kw: (kw.get("dt"), a[3].shape[0], a[6].shape[0]))
    if threshold_passes:
        real = _engine._within

        def within(XA, nA, XB, *args, **kwargs):
            runs.append(("threshold pass", XA.shape[0], XB.shape[0]))
            return real(XA, nA, XB, *args, **kwargs)

        monkeypatch.setattr(_engine, "_within", within)
    return runs


def _record_settled(monkeypatch):
    """The list that each call of the compiled k-NN's last step (the rows no heap
    certified, against the pairs within reach of their bound) appends its row count to."""
    return _recorder(monkeypatch, "_settle", lambda F, *a, **kw: F.size)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_knn_where_ties_defer_most_rows_takes_one_threshold_pass(backend, dtype, monkeypatch):
    """3,000 sign rows of length 16 at k = 16: the 16-th distance of a row ties with
    about 20 others, and the first pass defers most rows.  They were redone with heaps
    4 times larger, in passes of as many rows as the first pass's heap records hold (the
    same GEMM as one threshold pass, plus the heaps' insertions; 20,000 rows of length 64:
    0.75 s, 0.52 s now).  Now their pairs within reach of their bound are found by one
    threshold pass and only those are refined: no second heap pass."""
    if backend != "cython":
        pytest.skip("the compiled engine's heaps")
    rng = np.random.default_rng(4)
    S = rng.choice([-1.0, 1.0], size=(3000, 16)).astype(dtype)
    passes = _record_knn_passes(monkeypatch)
    settled = _record_settled(monkeypatch)
    r = refgeo.knn(S, 16)
    assert passes == [(3000, None)], passes  # the first pass only
    assert len(settled) == 1 and settled[0] >= 1500, settled  # most rows deferred
    assert r.n_refined <= 4 * 16 * len(S)
    _assert_knn_rows_exact(r, S, rng.choice(len(S), 300, replace=False), 16)


@pytest.mark.parametrize("dtype,noise,against", [(np.float32, 1e-3, False), (np.float32, 0.0, True),
                                                 (np.float64, 1e-9, True)])
def test_knn_where_ties_exceed_every_heap_refines_only_the_pairs_within_reach(backend, dtype, noise, against,
                                                                            monkeypatch):
    """Clusters of 50 near-copies (closer than the float32 filter resolves) at k = 1: no
    heap (9 keys, grown to 36) holds a row's ties, and each row was refined against every
    candidate (1,999 pairs a row here; knn(X, 1) of 20,000 such float32 rows of R^64:
    400 million pairs, 6.1 s against 0.2 s for Gaussian rows).  The rows are now filtered
    again against every candidate and only the pairs that can reach their bound are
    refined (the 49 others of the cluster), in strips of 20 rows (126 pair slots a row,
    max(k, N / 16) + 1, in a float32 filter; 5 rows of N / 4 + 1 in a float64 one)."""
    if backend != "cython":
        pytest.skip("the compiled engine's heaps")
    rng = np.random.default_rng(5)
    base = rng.standard_normal((40, 16))
    X = (np.repeat(base, 50, axis=0) + noise * rng.standard_normal((2000, 16))).astype(dtype)
    if noise == 0.0:  # exact copies: the kernel itself (refgeo.knn runs it on one of each)
        X[::50] += 1e-4
    Y = X[rng.permutation(2000)] if against else None
    monkeypatch.setattr(_engine, "WITHIN_SLOTS", 20 * 126)  # strips of 20 rows
    settled = _record_settled(monkeypatch)
    r = _engine.knn(X, 1, Y, exclude_self=not against)
    assert sum(settled) >= 1500, settled  # the ties defer most rows past any heap
    assert r.n_refined <= 2000 * 60, r.n_refined
    idx, dist = _oracle_knn(X, 1, Y)
    np.testing.assert_array_equal(r.indices, idx)
    np.testing.assert_array_equal(r.distances, dist)


def test_knn_of_float32_rows_in_one_large_cluster_goes_through_a_float64_filter(backend, monkeypatch):
    """Half of 2,000 float32 rows within 1e-5 of one point (a head's untrained rows
    after small updates): the float32 filter cannot tell them apart, so each of them had
    every row of the cluster within reach and was refined against every candidate
    (2 million pairs here; 20,000 rows of R^64: 200 million pairs and 3.4 s).  Rows
    with too many pairs within reach now go through a float64 filter, which separates
    them."""
    if backend != "cython":
        pytest.skip("the compiled engine's heaps")
    rng = np.random.default_rng(6)
    X = np.vstack([rng.standard_normal((1000, 32)), 5 + 1e-5 * rng.standard_normal((1000, 32))]).astype(np.float32)
    filters = []
    _record_knn_passes(monkeypatch, filters)
    r = _engine.knn(X, 2, None, exclude_self=True)
    assert filters[0] == "float32" and "float64" in filters  # the float64 filter ran
    assert r.n_refined <= 2000 * 40, r.n_refined
    idx, dist = _oracle_knn(X, 2)
    np.testing.assert_array_equal(r.indices, idx)
    np.testing.assert_array_equal(r.distances, dist)


def test_knn_of_a_grouped_cluster_runs_its_float64_filter_against_the_group(backend, monkeypatch):
    """400 of 2,000 float32 rows of R^32 within 1e-4 of a point far from the origin (the
    states of one frequent token): the float32 filter ties them, the threshold pass
    groups them around anchors, and they have too many pairs within reach for it, so
    they go through a float64 filter.  Its heaps ran them against every row (hidden
    states of R^256 with Zipf token counts: a third of the call); now one float64
    pass against the group's candidates, the 400 rows of the cluster (the anchors of
    one round split them into 64 groups with the same candidates, merged into one).
    (Without the group's own frame, which spares them the float64 filter: the next
    test.)"""
    if backend != "cython":
        pytest.skip("the compiled engine's float64 filter")
    monkeypatch.setattr(_engine, "LOCAL_FRAME_GAIN", math.inf)
    X = _far_cluster()
    passes = _record_runs(monkeypatch)
    for k in (1, 4):
        passes.clear()
        r = _engine.knn(X, k, None, exclude_self=True)
        assert passes[0] == ("float32", 2000, 2000), passes
        assert passes[1:] == [("float64", 400, 400)], passes
        idx, dist = _oracle_knn(X, k)
        np.testing.assert_array_equal(r.indices, idx)
        np.testing.assert_array_equal(r.distances, dist)


def _far_cluster():
    """2,000 float32 rows of R^32: 400 within 1e-4 of a point far from the origin."""
    rng = np.random.default_rng(8)
    X = np.vstack([rng.standard_normal((1600, 32)), 20 + 1e-4 * rng.standard_normal((400, 32))])
    return X[rng.permutation(2000)].astype(np.float32)


@pytest.mark.parametrize("k", [1, 4])
def test_knn_of_a_grouped_cluster_certifies_it_in_the_groups_own_frame(backend, monkeypatch, k):
    """The cluster of the previous test, in its own frame: centered at its rows' median
    they have squared norms near 3e-7 instead of about 8,200, the float32 filter's
    bound shrinks with them, and one float32 heap pass of the cluster against itself
    certifies every row, where the common frame ties them all and sends them through
    a float64 filter."""
    if backend != "cython":
        pytest.skip("the compiled engine's group frames")
    X = _far_cluster()
    passes = _record_runs(monkeypatch)
    r = _engine.knn(X, k, None, exclude_self=True)
    assert passes == [("float32", 2000, 2000), ("float32", 400, 400)], passes
    idx, dist = _oracle_knn(X, k)
    np.testing.assert_array_equal(r.indices, idx)
    np.testing.assert_array_equal(r.distances, dist)


def test_knn_centers_a_group_at_its_median(backend, monkeypatch):
    """A group with the 400 rows of one cluster and the 12 of another, 0.5 away per
    coordinate (the anchors' groups of two clusters merged): centered at the mean, the
    12 rows pull the center 0.015 a coordinate off the 400 (squared norms about 7e-3
    instead of 3e-7) and 81 rows stay tied; centered at the coordinate-wise median, one
    float32 heap pass certifies the 400, and only the 12 go on to the threshold pass."""
    if backend != "cython":
        pytest.skip("the compiled engine's group frames")
    rng = np.random.default_rng(8)
    X = np.vstack([rng.standard_normal((1600, 32)), 20 + 1e-4 * rng.standard_normal((400, 32)),
                   20.5 + 1e-4 * rng.standard_normal((12, 32))])
    X = X[rng.permutation(len(X))].astype(np.float32)
    runs = _record_runs(monkeypatch, threshold_passes=True)
    r = _engine.knn(X, 1, None, exclude_self=True)
    assert runs == [("float32", 2012, 2012), ("float32", 412, 412), ("threshold pass", 12, 412)], runs
    idx, dist = _oracle_knn(X, 1)
    np.testing.assert_array_equal(r.indices, idx)
    np.testing.assert_array_equal(r.distances, dist)


@pytest.mark.parametrize("gain", [0.0, 16.0])
def test_knn_of_exact_copies_skips_the_group_frame(backend, monkeypatch, gain):
    """300 exact copies of one row among 1,200 Gaussian rows: about their own center
    every norm is 0, and they tie in any frame, so the group's own frame would
    certify nothing (a heap pass for nothing: 5 to 20% of the call on repeated hidden
    states); they go straight to the float64 filter, whatever LOCAL_FRAME_GAIN is."""
    if backend != "cython":
        pytest.skip("the compiled engine's group frames")
    rng = np.random.default_rng(3)
    X = np.vstack([rng.standard_normal((1200, 16)), np.repeat(5 + rng.standard_normal((1, 16)), 300, axis=0)])
    X = X.astype(np.float32)
    monkeypatch.setattr(_engine, "ANCHOR_MIN_WORK", 0)
    monkeypatch.setattr(_engine, "LOCAL_FRAME_GAIN", gain)
    runs = _record_runs(monkeypatch)
    r = _engine.knn(X, 2, None, exclude_self=True)
    assert runs == [("float32", 1500, 1500), ("float64", 300, 300)], runs
    idx, dist = _oracle_knn(X, 2)
    np.testing.assert_array_equal(r.indices, idx)
    np.testing.assert_array_equal(r.distances, dist)


@pytest.mark.parametrize("k", [1, 2])
def test_knn_of_a_few_copies_among_near_copies_runs_the_group_frame(backend, monkeypatch, k):
    """8 exact copies of a point and 6 rows within 1e-4 of it: the median of the group
    is the point, so its median norms are 0, but the group is not all copies, and in
    its own frame the heaps (9 slots and more) certify all 14 rows; judged by the
    median norms alone, it skipped the frame and refined them in the common one."""
    if backend != "cython":
        pytest.skip("the compiled engine's group frames")
    rng = np.random.default_rng(3)
    p = 5 + rng.standard_normal(16)
    X = np.vstack([rng.standard_normal((1200, 16)), np.repeat(p[None], 8, axis=0),
                   p + 1e-4 * rng.standard_normal((6, 16))]).astype(np.float32)
    for name, value in dict(ANCHOR_MIN_WORK=0, ANCHOR_MIN_GAIN=0, ANCHOR_MAX_SHARE=1, ANCHOR_BATCH=1).items():
        monkeypatch.setattr(_engine, name, value)
    runs = _record_runs(monkeypatch, threshold_passes=True)
    r = _engine.knn(X, k, None, exclude_self=True)
    assert runs == [("float32", 1214, 1214), ("float32", 14, 14)], runs
    idx, dist = _oracle_knn(X, k)
    np.testing.assert_array_equal(r.indices, idx)
    np.testing.assert_array_equal(r.distances, dist)


@st.composite
def near_copy_clouds(draw):
    """Rows in clusters of near-copies of random sizes (up to 40), some exact copies,
    at scales the float32 filter cannot resolve: every path of the redo (heaps grown,
    the pairs within reach, the float64 filter, every candidate)."""
    n_centers = draw(st.integers(1, 6))
    d = draw(st.integers(1, 12))
    sizes = draw(st.lists(st.integers(1, 40), min_size=n_centers, max_size=n_centers))
    seed = draw(st.integers(0, 2**32 - 1))
    noise = draw(st.sampled_from([0.0, 1e-9, 1e-6, 1e-3]))
    offset = draw(st.sampled_from([0.0, 3.0, 1e4]))
    rng = np.random.default_rng(seed)
    centers = offset + rng.standard_normal((n_centers, d))
    X = np.repeat(centers, sizes, axis=0)
    X = X + noise * rng.standard_normal(X.shape) * (rng.random(X.shape[0]) < 0.8)[:, None]
    return X[rng.permutation(X.shape[0])]


@pytest.mark.parametrize("thresholds", [False, True])
def test_knn_of_near_copy_clouds_matches_the_oracle(backend, parallel_always, monkeypatch, thresholds):
    """Every answer of the redo paths is exact: near-copy clusters against themselves
    and against a second cloud, float32 and float64 (filtered in float32 from no work
    on), small strips, anchor groups, probes of the float64 heaps, tiles and threads.

    With ``thresholds`` (``knn(..., thresholds=T)``, for the Dask tasks' rows that
    overflowed their heaps), a row's answer starts with its k nearest among the rows
    within its threshold, exactly (index and distance, ties by index); where fewer
    than k are within it, the rest of the row holds further rows in order, or -1 and
    inf.  Thresholds at a row's j-th distance, just above, between, near 0, or beyond
    every row."""
    if backend != "cython":
        pytest.skip("the compiled engine's redo")
    monkeypatch.setattr(_engine, "KNN_MIXED_MIN_WORK", 0)
    for name, value in {**_ANCHORS, **_TIE_PROBE}.items():
        monkeypatch.setattr(_engine, name, value)

    @settings(max_examples=_examples(backend, 300))
    @given(X=near_copy_clouds(), Y=st.one_of(st.none(), near_copy_clouds()), k=st.integers(1, 6),
           f32=st.booleans(), slots=st.sampled_from([1, 500, 1 << 22]), data=st.data(), **tie_options)
    def check(X, Y, k, f32, slots, data, tile_size, n_threads):
        # grouped clusters send their rows to the float64 filter (or to every candidate)
        # against their group's candidates alone; a probe of the float64 heaps may skip it
        _draw_anchors(data)
        _draw_tie_probe(data)
        if Y is not None and Y.shape[1] != X.shape[1]:
            Y = np.resize(Y, (Y.shape[0], X.shape[1]))
        n_cand = X.shape[0] - 1 if Y is None else Y.shape[0]
        if n_cand < k:
            return
        if f32:
            X = X.astype(np.float32)
            Y = None if Y is None else Y.astype(np.float32)
        _engine.WITHIN_SLOTS = slots
        if not thresholds:
            r = _engine.knn(X, k, Y, exclude_self=Y is None, tile_size=tile_size, n_threads=n_threads)
            idx, dist = _oracle_knn(X, k, Y)
            np.testing.assert_array_equal(r.indices, idx)
            np.testing.assert_array_equal(r.distances, dist)
            return
        B64 = (X if Y is None else Y).astype(np.float64)
        D2 = _certify.canonical_sq(np, X.astype(np.float64)[:, None, :], B64[None, :, :])
        if Y is None:
            np.fill_diagonal(D2, np.inf)
        rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
        at = np.sort(D2, axis=1)[np.arange(len(X)), rng.integers(0, n_cand, len(X))]
        T = at * rng.choice([1.0, 1.0 + 1e-9, 0.5, 1e-300], len(X))
        T[rng.random(len(X)) < 0.1] = np.inf
        r = _engine.knn(X, k, Y, exclude_self=Y is None, tile_size=tile_size, n_threads=n_threads,
                        thresholds=T)
        order = np.lexsort((np.broadcast_to(np.arange(B64.shape[0]), D2.shape), D2), axis=1)
        for i in range(len(X)):
            within = order[i][D2[i, order[i]] <= T[i]][:k]
            m = within.size
            np.testing.assert_array_equal(r.indices[i, :m], within)
            np.testing.assert_array_equal(r.distances[i, :m], np.sqrt(D2[i, within]))
            rest, rest_d = r.indices[i, m:], r.distances[i, m:]
            held = rest >= 0  # beyond the threshold: further rows in order, then padding
            assert np.all(held[:-1] >= held[1:]) and np.all(np.isinf(rest_d[~held]))
            if held.any():
                np.testing.assert_array_equal(rest_d[held], np.sqrt(D2[i, rest[held]]))
                seq = np.concatenate([within[-1:], rest[held]])
                assert np.all(D2[i, rest[held]] > T[i])
                assert all((D2[i, a], a) < (D2[i, b], b) for a, b in zip(seq[:-1], seq[1:]))

    monkeypatch.setattr(_engine, "WITHIN_SLOTS", _engine.WITHIN_SLOTS)  # restored after
    check()


@pytest.mark.parametrize("T", [[1.0, np.nan, 1.0], [1.0, -1.0, 1.0], [1.0, 1.0], [[1.0, 1.0, 1.0]]])
def test_knn_refuses_thresholds_it_cannot_use(backend, T):
    """A NaN threshold spread into its anchor group's radius and emptied the group's
    candidates (its other rows came back padded); a negative one, or one of another
    shape, is as meaningless: each is refused, naming ``thresholds``."""
    if backend != "cython":
        pytest.skip("the compiled engine's thresholds")
    X = np.random.default_rng(0).standard_normal((3, 4))
    with pytest.raises(ValueError, match="thresholds must hold one squared distance"):
        _engine.knn(X, 1, X + 1.0, exclude_self=False, thresholds=np.array(T))


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(2, 150), d=st.integers(1, 40),
       kind=st.sampled_from(["copies", "grid", "gaussian", "two_scales"]), f64=st.booleans(),
       mixed=st.booleans(), reach=st.sampled_from([0.0, 0.5, 2.0, 8.0]), batch=st.sampled_from([1, 3, 64]),
       share=st.sampled_from([1, 4]), slots=st.sampled_from([5, 60, 1 << 22]),
       growth=st.sampled_from([0.0, 1.25, 1e9]))
def test_anchor_groups_hold_every_candidate_within_reach(seed, n, d, kind, f64, mixed, reach, batch, share, slots,
                                                         growth):
    """The groups of deferred k-NN rows around anchors (``_engine._anchor_groups``): each
    group's candidates hold every row within the square root of each member's threshold
    (refined distance, not the filter's), whatever the anchors, the reach and the
    threshold, on rows with many equal distances (near-copies in high dimension, grids)."""
    rng = np.random.default_rng(seed)
    if kind == "copies":  # tokens seen many times: near-copies about equally far apart
        base = rng.standard_normal((max(1, n // 10), d)) + 3.0
        S = base[rng.integers(0, base.shape[0], n)] + 1e-3 * rng.standard_normal((n, d))
    elif kind == "grid":
        S = rng.integers(-2, 3, (n, d)).astype(np.float64)
    elif kind == "two_scales":
        S = rng.standard_normal((n, d)) * np.where(rng.random((n, 1)) < 0.5, 1e-6, 1.0)
    else:
        S = rng.standard_normal((n, d))
    S = S.astype(np.float64 if f64 else np.float32)
    (orig,), (X,), (nrm,), dt = _engine._center([S], 1, float32_filter=mixed)
    S64 = orig.astype(np.float64)
    D2 = ((S64[:, None, :] - S64[None, :, :]) ** 2).sum(axis=2)
    F = np.flatnonzero(rng.random(n) < 0.6)
    # thresholds: a row's k-th smallest distance, a little above or below it, zero, or all
    kth = np.sort(D2[F], axis=1)[:, rng.integers(0, n)]
    T = kth * rng.choice([1.0, 1.0 + 1e-6, 0.5, 0.0, 4.0], size=F.size)
    old = {name: getattr(_engine, name) for name in (*_ANCHORS, "WITHIN_SLOTS")}
    try:
        _engine.ANCHOR_BATCH, _engine.ANCHOR_MIN_GAIN, _engine.ANCHOR_MAX_SHARE = batch, 0, share
        _engine.ANCHOR_REACH, _engine.ANCHOR_MIN_WORK, _engine.WITHIN_SLOTS = reach, 0, slots
        _engine.ANCHOR_MERGE_GROWTH = growth  # groups merged never, as by default, or while the union fits
        groups, rest = _engine._anchor_groups(F, T, X, nrm, X, nrm, dt)
    finally:
        for name, value in old.items():
            setattr(_engine, name, value)
    assert sum(C.size for _, C in groups) <= slots  # the candidate lists' memory
    seen = np.concatenate([rest] + [pos for pos, _ in groups])
    np.testing.assert_array_equal(np.sort(seen), np.arange(F.size))  # every row once
    for pos, C in groups:
        assert np.all(np.diff(C) > 0)
        for p in pos:
            within = np.flatnonzero(D2[F[p]] <= T[p] * (1.0 - 1e-12))
            assert set(within.tolist()) <= set(C.tolist()), (F[p], T[p])
            assert F[p] in set(C.tolist())


def test_within_holds_every_pair_within_the_threshold_on_any_tiles_and_threads(backend, parallel_always):
    """The compiled threshold pass of the rows no heap settles (``_engine._within``):
    for thresholds at exact squared distances, every pair whose exact squared distance
    is at most the row's threshold is held, the row itself never is, a held pair is
    within twice the filter's rounding bound of the threshold, a row with more pairs
    within reach than its slots is flagged, and the counts are the same on every tile
    size and thread count (the pairs run in parallel into shared slots) on the rows
    with no pair inside the rounding band just above the threshold."""
    if backend != "cython":
        pytest.skip("the compiled engine's threshold pass")

    @settings(max_examples=_examples(backend, 200))
    @given(X=near_copy_clouds(), other=st.booleans(), f32=st.booleans(), cap=st.integers(1, 30),
           seed=st.integers(0, 2**32 - 1), **tie_options)
    def check(X, other, f32, cap, seed, tile_size, n_threads):
        rng = np.random.default_rng(seed)
        A = X.astype(np.float32) if f32 else X
        B = A if not other else A[rng.permutation(A.shape[0])][: max(1, A.shape[0] // 2)]
        origs, cents, norms, dt = _engine._center([A, B], 1)
        exact = _oracle_sq(origs[0], origs[1])
        n, m = exact.shape
        own = np.arange(n) if not other else None
        T = exact[np.arange(n), rng.integers(0, m, n)]  # at a pair's exact distance
        T[rng.random(n) < 0.2] = np.inf  # every pair within reach
        runs = []
        for tile, threads in [(tile_size, n_threads), (max(1, n + m), 1)]:
            counts = np.zeros(n, dtype=np.int64)
            cols = np.full((n, cap + 1), -1, dtype=np.int64)
            cp, eabs = _certify.rounding_bound(X.shape[1], dt)
            cl = _certify.lowered_key_bound(cp)
            fn = getattr(_backend.extension()._knn, "within" + ("32" if dt == "float32" else "64"))
            fn(cents[0], norms[0], cents[1], norms[1], T, np.arange(n) if own is not None else np.full(n, -1),
               cl, eabs, tile, threads, counts, cols)
            runs.append(counts)
            for i in range(n):
                within = [j for j in np.flatnonzero(exact[i] <= T[i]) if own is None or j != i]
                reach = 2.01 * (cl * (norms[0][i] + norms[1]) + eabs) * (1 + 1e-9) + 1e-300
                if counts[i] > cap:  # flagged: more than cap pairs within the bound's reach
                    near = exact[i] <= T[i] + reach
                    if own is not None:
                        near[i] = False
                    assert np.count_nonzero(near) > cap, (i, counts[i], np.count_nonzero(near))
                    continue
                held = cols[i, : counts[i]]
                assert len(set(held.tolist())) == counts[i] and (own is None or i not in held)
                assert set(within) <= set(held.tolist()), (i, within, held)
                assert np.all(exact[i, held] <= T[i] + reach[held]), (i, exact[i, held], T[i])
                assert len(within) <= cap  # so a row with more is flagged
        # the same counts on every tiling, except on a row with a pair inside the
        # rounding band (T, T + reach]: the GEMM's float32 roundings depend on the
        # block shape (BLAS picks kernels by it), so such a pair may pass in one tiling
        # and not in another; a row flagged in one is handed back whole and answered
        # exactly all the same
        band = np.zeros(n, dtype=bool)
        for i in range(n):
            reach = 2.01 * (cl * (norms[0][i] + norms[1]) + eabs) * (1 + 1e-9) + 1e-300
            inside = (exact[i] > T[i]) & (exact[i] <= T[i] + reach)
            if own is not None:
                inside[i] = False
            band[i] = inside.any()
        np.testing.assert_array_equal(np.minimum(runs[0], cap + 1)[~band], np.minimum(runs[1], cap + 1)[~band])

    check()


def test_knn_counts_the_refinements_of_rows_refined_against_every_candidate(backend, monkeypatch):
    """300 sign rows of length 16 at k = 16: most rows have more pairs within reach of
    their bound than max(k, N / 16) (the share set here) and are refined against every
    candidate, counted as
    that fallback runs; ``n_refined`` must add the threshold pass's own refinements to
    those, not overwrite them (it read the count before the fallback ran)."""
    if backend != "cython":
        pytest.skip("the compiled engine's fallback")
    X = np.random.default_rng(0).choice([-1.0, 1.0], size=(300, 16))
    monkeypatch.setattr(_engine, "SETTLE_DENSE_SHARE_F64", 16)  # more rows to the fallback
    dense_pairs = []
    real = _engine._settle

    def settle(F, *args, **kwargs):
        # (idx, dist, XA, nA, XB, nB, dt, SA, SB, k, self_cols, n_threads, dense, ...)
        args = list(args)
        dense = args[12]
        # rows R against their group's candidates C (None: every row), self excluded
        args[12] = lambda R, C: (dense_pairs.append(R.size * ((300 if C is None else C.size) - 1)), dense(R, C))[1]
        return real(F, *args, **kwargs)

    monkeypatch.setattr(_engine, "_settle", settle)
    r = _engine.knn(X, 16, None, exclude_self=True)
    assert sum(dense_pairs) >= 100 * 16, dense_pairs
    assert r.n_refined >= sum(dense_pairs), (r.n_refined, dense_pairs)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_knn_of_a_code_with_thousands_of_exact_ties_refines_only_the_ties(backend, dtype):
    """8,000 rows of the Delsarte-Goethals code of R^64 at k = 16: a row's 16-th distance
    ties exactly with about 600 others (more than N / 16 = 500, fewer than N / 4).  No
    filter separates exact ties, so those rows were refined against every candidate
    (nearly all 64 million pairs; 400 million and 7.2 s at 20,000 rows, where spread's
    neighbour lists come from); now only the pairs within reach of each row's bound."""
    if backend != "cython":
        pytest.skip("the compiled engine's fallback")
    S = refgeo.delsarte_goethals_code(64, 8000).astype(dtype)
    r = refgeo.knn(S, 16)
    assert r.n_refined < 8000 * 8000 // 4, r.n_refined
    _assert_knn_rows_exact(r, S, np.random.default_rng(3).choice(8000, 200, replace=False), 16)


def test_knn_of_a_code_skips_the_float64_filter_after_a_probe(backend, monkeypatch):
    """The rows of a code tie exactly, so the float32 filter leaves many of them with
    more than N / 16 pairs within reach, and the float64 filter's heaps, a GEMM pass over
    every candidate, deferred them all again (knn(X, 16) of 20,000 Delsarte-Goethals
    rows of R^64: 1.4 of 5.3 s, and 1.6 s more for its threshold pass).  Now a probe of
    a few of them finds that, and the others take a float32 threshold pass with up to
    N / 4 pairs a row instead (here: probes of 16 rows from sets of 32 or more)."""
    if backend != "cython":
        pytest.skip("the compiled engine's float64 filter")
    S = refgeo.delsarte_goethals_code(64, 4000)
    monkeypatch.setattr(_engine, "KNN_MIXED_MIN_WORK", 0)  # float64 rows filtered in float32
    monkeypatch.setattr(_engine, "KNN_TIE_PROBE", 16)
    monkeypatch.setattr(_engine, "KNN_TIE_PROBE_MIN_ROWS", 32)
    filters = []
    passes = _record_knn_passes(monkeypatch, filters)
    skipped = []
    real = _engine._settle

    def settle(F, *args, **kwargs):
        if kwargs.get("dense_share") is not None:  # the rows after a probe that deferred its rows
            skipped.append((F.size, args[6]))
        return real(F, *args, **kwargs)

    monkeypatch.setattr(_engine, "_settle", settle)
    r = _engine.knn(S, 16, None, exclude_self=True)
    assert skipped and all(dt == "float32" for _, dt in skipped), (skipped, passes)
    # the float64 heaps ran on the probes, not on the rows that skipped them
    assert sum(rows for (rows, _), f in zip(passes, filters) if f == "float64") + sum(n for n, _ in skipped) \
        <= r.distances.shape[0], (passes, skipped)
    _assert_knn_rows_exact(r, S, np.random.default_rng(3).choice(4000, 300, replace=False), 16)


@pytest.mark.parametrize("case", ["code", "one_cluster"])
def test_knn_counts_every_refinement_once(backend, case, monkeypatch):
    """``n_refined`` is the sum of the refinements of every heap pass and every threshold
    pass's picks, whatever path the rows took (the float64 filter, its probe, the rows
    refined against every candidate): a count that read ``n_refined`` before a pass whose
    dense path adds to it lost those (``n_refined += _settle(...)``)."""
    if backend != "cython":
        pytest.skip("the compiled engine's paths")
    if case == "code":  # exact ties: the probe, and rows refined against every candidate
        S = refgeo.delsarte_goethals_code(64, 4000)
        monkeypatch.setattr(_engine, "KNN_TIE_PROBE", 16)
        monkeypatch.setattr(_engine, "KNN_TIE_PROBE_MIN_ROWS", 32)
    else:  # near-copies that only the float64 filter separates
        rng = np.random.default_rng(6)
        S = np.vstack([rng.standard_normal((1000, 32)), 5 + 1e-5 * rng.standard_normal((1000, 32))])
    S = S.astype(np.float32)
    counted = []
    real_pass, real_pick = _engine._knn_pass, _engine._backend.extension()._knn

    def knn_pass(*args, **kwargs):
        out = real_pass(*args, **kwargs)
        counted.append(int(out[2][1]))
        return out

    class Picks:  # the extension module with its pick* counted
        def __getattr__(self, name):
            fn = getattr(real_pick, name)
            if not name.startswith("pick"):
                return fn
            return lambda *a: (counted.append(int(fn(*a))), counted[-1])[1]

    monkeypatch.setattr(_engine, "_knn_pass", knn_pass)
    ext = _engine._backend.extension()
    monkeypatch.setattr(ext, "_knn", Picks())
    r = _engine.knn(S, 16, None, exclude_self=True)
    assert len(counted) >= 3, counted  # more paths than the first pass
    assert r.n_refined == sum(counted), (r.n_refined, counted)


def _record_farthest_runs(monkeypatch):
    """The list that each run of the compiled farthest partners appends its rows' dtype
    to (a float32 filter's run that gives up is followed by a float64 run)."""
    runs = []
    real = _engine.farthest

    def farthest(S, **kwargs):
        runs.append(S.dtype)
        return real(S, **kwargs)

    monkeypatch.setattr(_engine, "farthest", farthest)
    return runs


@pytest.mark.parametrize("cluster", [1500, 600])
def test_farthest_partners_in_a_cluster_float32_cannot_resolve_run_in_float64(backend, monkeypatch, cluster):
    """Half (or a fifth) of 3,000 float32 rows within 1e-5 of one point: the farthest
    partner of each other row lies in that cluster, whose rows float32 cannot tell
    apart, so every such row refined most of the cluster (2 million pairs here, in
    R^64; 20,000 rows: 83 million and 2.4 s on one thread, 0.80 s for Gaussian rows).
    Once the refinements pass their budget with enough rows past their cap of
    refinements below their best, the run stops and a float64 filter answers (a cap
    of V / 4 missed clusters smaller than that)."""
    if backend != "cython":
        pytest.skip("the compiled engine's float32 filter")
    rng = np.random.default_rng(12)
    S = np.vstack([rng.standard_normal((3000 - cluster, 64)),
                   5 + 1e-5 * rng.standard_normal((cluster, 64))]).astype(np.float32)
    runs = _record_farthest_runs(monkeypatch)
    fp = _engine.farthest(S)
    assert runs == [np.float32, np.float64], runs
    assert fp.n_refined < (3000 - cluster) * cluster // 4, fp.n_refined  # the float32 run gave up early
    D2 = _oracle_sq(S, S)
    np.fill_diagonal(D2, -np.inf)
    want = np.argmax(D2, axis=1)
    np.testing.assert_array_equal(fp.indices, want)
    np.testing.assert_array_equal(fp.distances, np.sqrt(D2[np.arange(3000), want]))


def test_farthest_partners_of_a_code_keep_the_float32_run(backend, monkeypatch):
    """8,000 float32 rows of the Delsarte-Goethals code of R^64, and the 2,112 of the
    Kerdock code: each row ties exactly with hundreds of rows at its farthest distance
    (in the Kerdock code with half of all rows), millions of refinements in all, far
    past the budget; a float64 filter would refine the same ties, which are not
    counted against the cap, so the float32 run stands."""
    if backend != "cython":
        pytest.skip("the compiled engine's float32 filter")
    S = refgeo.delsarte_goethals_code(64, 8000).astype(np.float32)
    runs = _record_farthest_runs(monkeypatch)
    fp = _engine.farthest(S)
    K = refgeo.kerdock_code(64).astype(np.float32)
    fk = _engine.farthest(K)
    assert runs == [np.float32, np.float32], runs
    assert fp.n_refined > 8000 * 8000 // _engine.FARTHEST_BUDGET_DIVISOR  # past the budget
    assert fk.n_refined > 2112 * 2112 // _engine.FARTHEST_BUDGET_DIVISOR
    G = S[:200].astype(np.float64) @ S.T.astype(np.float64)
    G[np.arange(200), np.arange(200)] = np.inf
    np.testing.assert_array_equal(fp.indices[:200], np.argmin(G, axis=1))  # smallest index first


def test_knn_copies_beyond_any_heap_refine_only_their_copies(backend, monkeypatch):
    """Ties beyond any heap: 2 rows with 150 copies each among 3,000 (k = 1).  The
    copies were redone with larger heaps, which settled none of them, then through the
    float64 filter (3 passes).  Their pairs within reach of their bound are now found by
    one threshold pass of the first filter: each copy refines its 149 copies, not every
    row, and no further heap pass runs.  The kernel itself: refgeo.knn runs it on one
    row of each class of copies."""
    if backend != "cython":
        pytest.skip("the compiled engine's heaps")
    rng = np.random.default_rng(8)
    S = rng.standard_normal((3000, 8))
    copies = rng.choice(3000, 300, replace=False)
    S[copies] = rng.standard_normal((2, 8))[np.arange(300) % 2]
    passes = _record_knn_passes(monkeypatch)
    settled = _record_settled(monkeypatch)
    assert _certify.scale_exponent(np, [S]) == 0  # the kernel sees S as it is
    r = _engine.knn(S, 1, None, exclude_self=True)
    assert passes == [(3000, None)] and len(settled) == 1 and 300 <= settled[0] <= 330, (passes, settled)
    assert r.n_refined <= 2 * 3000 + 300 * 150  # each copy: its 149 copies, not all rows
    idx, dist = _oracle_knn(S, 1)
    np.testing.assert_array_equal(r.indices, idx)
    np.testing.assert_array_equal(r.distances, dist)


@pytest.mark.parametrize("V,d,against", [(500, 8, 0), (3000, 16, 0), (1, 16, 20000)])
def test_knn_redo_passes_stay_within_the_memory_estimate(backend, monkeypatch, V, d, against):
    """Each pass's heaps (the threads and heap size the compiled kernel is handed, times
    its rows) fit in the heap bytes knn_memory checked before the call: at (500, 8) the
    first pass is too small to run in parallel and the redo of its deferred rows would
    be large enough to.  One query row against candidates where it ties with 30 sign rows
    keeps its heap (a pass of one row with a heap 4 times larger exceeded the first's)."""
    if backend != "cython":
        pytest.skip("the compiled engine's heaps")
    rng = np.random.default_rng(9)
    S = rng.choice([-1.0, 1.0], (V, d)).astype(np.float32)
    Y = None
    if against:
        S = np.zeros((V, d), dtype=np.float32)
        Y = np.vstack([rng.choice([-1.0, 1.0], (30, d)), 10.0 + rng.standard_normal((against, d))])
    estimates, heaps = [], []
    real_check, real_pass = _memory.check_memory, _engine._knn_pass

    def checked(what, parts, *args, **kwargs):
        estimates.extend(v for key, v in parts.items() if key.startswith("heaps"))
        return real_check(what, parts, *args, **kwargs)

    def counted(fn, *args, **kw):
        def kernel(*a, **k):
            # (XA, nA, SA, XB, nB, SB, symmetric, exclude_self, self_idx, defer, k, cp,
            #  eabs, tile, n_threads, K, ...)
            heaps.append(16.0 * a[14] * a[2].shape[0] * a[15])
            return fn(*a, **k)

        return real_pass(kernel, *args, **kw)

    settled = _record_settled(monkeypatch)
    monkeypatch.setattr(_memory, "check_memory", checked)
    monkeypatch.setattr(_engine, "_knn_pass", counted)
    r = refgeo.knn(S, 8, Y, n_threads=8)
    assert len(estimates) == 1 and (len(heaps) >= 2 or settled)  # the ties defer rows
    assert max(heaps) <= estimates[0], (heaps, estimates)
    idx, dist = _oracle_knn(S, 8, Y)
    np.testing.assert_array_equal(r.indices, idx)
    np.testing.assert_array_equal(r.distances, dist)


def test_knn_memory_estimate_covers_the_float64_redo(backend, monkeypatch):
    """float64 rows in groups of near-copies (1e-9 apart): the float32 filter defers
    every row, and the redo copies them and centers all rows again in float64.  What
    the call allocates (tracemalloc's peak) stays within the knn_memory estimate it
    checked (3.1 times the estimate before the redo copies were counted)."""
    if backend != "cython":
        pytest.skip("the compiled engine's memory")
    import tracemalloc

    rng = np.random.default_rng(0)
    X = np.repeat(rng.standard_normal((100, 512)), 20, axis=0) + 1e-9 * rng.standard_normal((2000, 512))
    estimates = []
    real = _memory.check_memory

    def checked(what, parts, *args, **kwargs):
        if what.startswith("knn"):
            estimates.append(sum(parts.values()))
        return real(what, parts, *args, **kwargs)

    monkeypatch.setattr(_memory, "check_memory", checked)
    tracemalloc.start()
    try:
        r = refgeo.knn(X, 8, n_threads=2)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert estimates and peak <= max(estimates), (peak, estimates)
    assert np.all(r.indices[:, 0] // 20 == np.arange(2000) // 20)  # a near-copy first


def _record_extreme_pair_kernels(monkeypatch):
    """The list of kernel variants (``"64"``, ``"32"``, ``"32s64"``) that each run of the
    compiled extreme-pair kernel appends to."""
    seen = []
    real = _backend.extension()

    class Pairs:
        def __getattr__(self, name):
            if name.startswith("extreme_pair"):
                seen.append(name.removeprefix("extreme_pair"))
            return getattr(real._extreme_pairs, name)

    class Extension:
        _extreme_pairs = Pairs()

        def __getattr__(self, name):
            return getattr(real, name)

    monkeypatch.setattr(_backend, "extension", Extension)
    return seen


def test_closest_pair_of_float64_rows_filters_in_float32(backend, monkeypatch):
    """The closest pair of large float64 rows runs through the float32 filter, as the
    diameter does (it kept the float64 filter: 0.44 s for 20,000 x 64, now 0.20 s, the
    time of float32 rows), and is the float64 oracle's pair."""
    if backend != "cython":
        pytest.skip("the compiled engine's filter")
    S = np.random.default_rng(7).standard_normal((1500, 64))
    assert 1500 * 1500 * 64 // 2 >= _engine.MIN_MIXED_MIN_WORK
    seen = _record_extreme_pair_kernels(monkeypatch)
    r = refgeo.closest_pair(S)
    assert seen == ["32s64"]
    _assert_pair(r, _oracle_extreme(S, False), S, backend)


@pytest.mark.parametrize("dtype,kernels", [(np.float64, ["32s64", "64"]), (np.float32, ["32", "64"])])
def test_closest_pair_gives_up_a_float32_filter_that_near_copies_fill(backend, monkeypatch, dtype, kernels):
    """Half of the rows within 1e-5 of one point (a head's rows that few updates
    touched): the float32 filter cannot tell them apart, and every pair of them fell in
    its band (1,000 rows here: 500,000 refinements; 20,000 float32 rows of R^64: 50
    million and 0.99 s).  Past its budget of refinements the run stops and the float64
    filter, which separates them, runs instead (0.68 s there)."""
    if backend != "cython":
        pytest.skip("the compiled engine's filter")
    rng = np.random.default_rng(8)
    S = np.vstack([rng.standard_normal((1000, 16)), 5 + 1e-5 * rng.standard_normal((1000, 16))]).astype(dtype)
    monkeypatch.setattr(_engine, "MIN_MIXED_MIN_WORK", 0)
    seen = _record_extreme_pair_kernels(monkeypatch)
    r = refgeo.closest_pair(S, n_threads=2)
    assert seen == kernels
    assert r.n_refined <= 2 * _engine.MIN_MIXED_BUDGET + 2 * 4096 + 1000  # the budget, the buffers, the float64 run
    _assert_pair(r, _oracle_extreme(S, False), S, backend)


def test_extreme_pairs_exact_with_ties_on_small_tiles_and_threads(backend, parallel_always, monkeypatch):
    """Diameter, closest pair and farthest partners on tie clouds, 1 to 4 threads.

    The row scan before each tile row's pair loop must not skip a row whose only
    candidates sit exactly at the running bound (equal distances, smaller indices).
    """
    _restore_mixed_settings(monkeypatch)

    @settings(max_examples=_examples(backend, 300))
    @given(S=tie_clouds(), mixed=st.booleans(), tight=st.booleans(), **tie_options)
    def check(S, mixed, tight, tile_size, n_threads):
        _set_mixed(mixed, tight)
        _assert_extremes_exact(S, backend, tile_size=tile_size, n_threads=n_threads)

    check()


@pytest.mark.parametrize("n_threads", [2, 4])
def test_knn_bitwise_repeatable_across_runs(backend, parallel_always, monkeypatch, n_threads):
    """20 runs on several threads give the oracle's bits every time.

    The threads' heaps share pruning thresholds that they read while the other
    threads write them; whatever the interleaving, the answer must not change.  Many
    tile pairs (16-row tiles over 1200 rows) keep the threads racing on the same rows.
    """
    monkeypatch.setattr(_engine, "KNN_MIXED_MIN_WORK", 0)  # float32 filter and float64 redo
    rng = np.random.default_rng(31)
    S = rng.integers(-2, 3, size=(1200, 5)).astype(np.float64)
    S[600:] = S[:600]  # every row twice: ties at every heap's top
    k = 10
    idx, dist = _oracle_knn(S, k)
    for _ in range(20 if backend == "cython" else 1):
        r = refgeo.knn(S, k, tile_size=16, n_threads=n_threads)
        np.testing.assert_array_equal(r.indices, idx)
        np.testing.assert_array_equal(r.distances, dist)


def test_knn_kernel_rejects_heap_sizes_it_cannot_hold():
    """The kernel allocates its heaps itself: a heap smaller than k, or one whose bytes
    overflow the address space, is refused before anything is allocated or written."""
    ext = pytest.importorskip("refgeo_ext")
    X = np.arange(8.0).reshape(4, 2)
    n = np.sum(X * X, axis=1)
    cp, eabs = _certify.rounding_bound(2, "float64")

    def run(k, K):
        out_idx = np.zeros((4, k), dtype=np.int64)
        ext._knn.knn64(X, n, X, X, n, X, True, True, np.full(4, -1, dtype=np.int64), False,
                       k, _certify.lowered_key_bound(cp), eabs, 4, 1, K, 0, out_idx, np.zeros((4, k)), np.zeros(2, dtype=np.int64))
        return out_idx

    np.testing.assert_array_equal(run(3, 3)[0], [1, 2, 3])
    with pytest.raises(ValueError, match="K"):
        run(3, 1)  # the certificate reads the k-th smallest bound of the heap
    with pytest.raises(MemoryError, match="heaps"):
        run(1, 2**60)  # 4 rows x 2**60 records x 16 bytes wraps around size_t


def test_float32_and_float64_agree_on_float32_values(backend):
    rng = np.random.default_rng(3)
    S32 = rng.standard_normal((500, 24)).astype(np.float32)
    a = refgeo.row_diameter(S32)
    b = refgeo.row_diameter(S32.astype(np.float64))
    assert (a.value, a.i, a.j) == (b.value, b.i, b.j)
    assert a.dtype == "float32" and b.dtype == "float64"


def test_layouts_and_read_only_input(backend):
    rng = np.random.default_rng(8)
    S = rng.standard_normal((50, 7))
    want = _oracle_extreme(S, True)
    F = np.asfortranarray(S)
    _assert_pair(refgeo.row_diameter(F), want, S, backend)
    R = S.copy()
    R.setflags(write=False)
    _assert_pair(refgeo.row_diameter(R), want, S, backend)
    strided = np.repeat(S, 2, axis=1)[:, ::2]
    _assert_pair(refgeo.row_diameter(strided), want, S, backend)


# ------------------------------------------------------------------ the rounding bound itself


@settings(max_examples=300)
@given(S=adversarial_clouds(max_v=16, max_d=40))
def test_rounding_bound_holds_for_blas_filter(S):
    """|f - r| <= c (n_i + n_j) + e_abs for the filtered values BLAS actually produces."""
    dt = "float32" if S.dtype == np.float32 else "float64"
    c, eabs = _certify.rounding_bound(S.shape[1], dt)
    mu = S.astype(np.float64).mean(0)
    X = (S.astype(np.float64) - mu).astype(S.dtype)
    n = np.sum(X.astype(np.float64) ** 2, axis=1)
    f = n[:, None] + n[None, :] - 2.0 * (X @ X.T).astype(np.float64)
    assert _oracle_exponent(S) == 0  # the filter sees the rows as they are
    r = _oracle_sq(S, S)
    assert np.all(np.abs(f - r) <= c * (n[:, None] + n[None, :]) + eabs)


def test_rounding_bound_shape():
    c64, e64 = _certify.rounding_bound(512, "float64")
    c32, e32 = _certify.rounding_bound(512, "float32")
    assert 512 * 2.0**-53 < c64 < 5 * 512 * 2.0**-53  # float64: GEMM, norms and refinement each ~d u
    assert 512 * 2.0**-24 < c32 < 2 * 512 * 2.0**-24
    # absolute term: 32 d times the smallest normal number (valid under flush-to-zero too)
    assert e64 == 32 * 512 * 2.0**-1022 and e32 == 32 * 512 * 2.0**-126
    assert _certify.rounding_bound(2**24, "float32")[0] == math.inf


def test_certificate_fields():
    pytest.importorskip("refgeo_ext")
    rng = np.random.default_rng(2)
    S = rng.standard_normal((400, 32))
    with refgeo.use_backend("cython"):
        r = refgeo.row_diameter(S)
    assert r.backend == "cython"
    c, eabs = _certify.rounding_bound(32, "float64")
    Sc = S - S.mean(0)
    assert r.error_bound == pytest.approx(c * 2 * np.max(np.sum(Sc**2, 1)), rel=1e-6)
    assert 1 <= r.n_refined < 400 * 399 // 2  # the filter discarded almost every pair
    with refgeo.use_backend("reference"):
        ref = refgeo.row_diameter(S)
    assert ref.error_bound == 0.0 and ref.n_refined == 400 * 399 // 2


# Rows whose float32 Gram products fall below the normal range (1e-21 scale): under
# flush-to-zero the filter loses them, and only a bound whose absolute term uses the
# smallest normal number still keeps the true closest pair.
FTZ_ROWS = (np.array([[-0.5, 0], [0.5, 0], [10, 0], [10.001, 0], [-10, 0], [-10, 0.5]]) * 1e-21).astype(np.float32)


@pytest.fixture
def flush_to_zero():
    """Flush-to-zero switched on by another library in the process (here torch)."""
    torch = pytest.importorskip("torch")
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    yield
    torch.set_flush_denormal(False)


def test_certificate_survives_flush_to_zero(backend, flush_to_zero):
    S = FTZ_ROWS
    for fn, maximize in ((refgeo.closest_pair, False), (refgeo.row_diameter, True)):
        r = fn(S, tile_size=2)
        assert (r.value, r.i, r.j) == _oracle_extreme(S, maximize)
    np.testing.assert_array_equal(refgeo.knn(S, 1).indices, _oracle_knn(S, 1)[0])


@pytest.mark.parametrize("dtype,scale", [(np.float32, 1e-20), (np.float64, 2.0**-60)])
def test_tiny_rows_keep_the_filter_useful(backend, monkeypatch, dtype, scale):
    """Rows so small that float32 products underflow (float32 rows near 1e-20, float64
    rows near 2**-60 that are not prescaled) are filtered where the products are normal:
    the same exact answer, and the filter still discards almost every pair."""
    if backend == "reference":
        pytest.skip("the reference evaluates every pair")
    monkeypatch.setattr(_engine, "MAX_MIXED_MIN_WORK", 0)  # float64 rows: the float32 filter
    monkeypatch.setattr(_engine, "KNN_MIXED_MIN_WORK", 0)
    S = (np.random.default_rng(11).standard_normal((300, 16)) * scale).astype(dtype)
    assert _oracle_exponent(S) == 0
    pairs = 300 * 299 // 2
    D = refgeo.row_diameter(S)
    _assert_pair(D, _oracle_extreme(S, True), S, backend)
    m = refgeo.closest_pair(S)
    _assert_pair(m, _oracle_extreme(S, False), S, backend)
    kn = refgeo.knn(S, 3)
    np.testing.assert_array_equal(kn.indices, _oracle_knn(S, 3)[0])
    fp = refgeo.farthest_partners(S)
    for r in (D, m, kn, fp):
        assert r.n_refined < pairs // 20, r
