"""The subset bounds of tools/code_subset_bounds.py, checked where they can be checked.

The script's numbers (docs/tutorials/spreading.md, "What stands in the way") rest on three
things that can go wrong: the orbits of the affine group on RM(2, n) (the LP has one
variable per orbit, which is valid only if the orbits are exactly the "rank, weight"
classes), the linear program itself, and Hoffman's bound.  Here they are tested on RM(2, 4)
(2^11 words of length 16), small enough to compute the orbits by brute force and to hold
the real Delsarte-Goethals rows of R^16, and on the Gold code itself (about a second).
The script lives in the source tree, so this file skips against an installed wheel.
"""

from __future__ import annotations

import importlib.util
import itertools
import pathlib

import numpy as np
import pytest

import refgeo

TOOL = pathlib.Path(__file__).resolve().parents[1] / "tools" / "code_subset_bounds.py"
pytestmark = pytest.mark.skipif(not TOOL.is_file(), reason="needs the source tree (tools/)")


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("code_subset_bounds", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _truth_tables(n: int) -> np.ndarray:
    """Truth tables (2^n bits, as rows) of the RM(2, n) words, in the script's index order."""
    Z = (np.arange(2**n)[:, None] >> np.arange(n)) & 1
    gens = [np.ones(2**n, dtype=np.int64)] + [Z[:, i] for i in range(n)]
    gens += [Z[:, i] & Z[:, j] for i, j in itertools.combinations(range(n), 2)]
    idx = np.arange(1 << len(gens))
    bits = (idx[:, None] >> np.arange(len(gens))) & 1
    return (bits @ np.array(gens)) % 2


def _orbits_by_brute_force(n: int, T: np.ndarray, seed: int = 0) -> np.ndarray:
    """Orbit labels of AGL(n, 2) acting on the words by f -> f(Az + b), by union-find."""
    key = {row.tobytes(): i for i, row in enumerate(T.astype(np.uint8))}
    parent = np.arange(len(T))

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    Z = (np.arange(2**n)[:, None] >> np.arange(n)) & 1
    weights = 1 << np.arange(n)
    rng = np.random.default_rng(seed)
    moves = []
    while len(moves) < 6:  # a few random invertible A plus translations generate AGL(n, 2)
        A = rng.integers(0, 2, (n, n))
        if round(abs(np.linalg.det(A))) % 2:
            moves.append(((Z @ A.T) % 2 @ weights))
    moves += [np.arange(2**n) ^ (1 << i) for i in range(n)]  # z -> z + e_i
    for perm in moves:
        for i, row in enumerate(T):
            j = key[row[perm].astype(np.uint8).tobytes()]
            a, b = find(i), find(j)
            if a != b:
                parent[a] = b
    return np.array([find(i) for i in range(len(T))])


def test_affine_orbits_are_the_rank_weight_classes(tool):
    # The LP's symmetrization needs this: classes coarser than the orbits would make the
    # "one variable per class" program a guess, not a bound.
    n = 4
    weights, rank = tool.reed_muller2(n)
    T = _truth_tables(n)
    np.testing.assert_array_equal(T.sum(axis=1), weights)
    _, classes = tool.affine_orbits(weights, rank)
    orbits = _orbits_by_brute_force(n, T)
    pairs = set(zip(classes.tolist(), orbits.tolist()))
    assert len(pairs) == len(set(classes.tolist())) == len(set(orbits.tolist()))


def _dg_words(tool):
    """The +-1/4 rows of refgeo's Delsarte-Goethals code of R^16 as RM(2, 4) word indices."""
    X = refgeo.delsarte_goethals_code(16)[16:]  # the standard basis is not a +-1/4 row
    bits = (X < 0).astype(np.int64)
    key = {row.astype(np.uint8).tobytes(): i for i, row in enumerate(_truth_tables(4))}
    return X, np.array([key[b.astype(np.uint8).tobytes()] for b in bits])


def test_lp_bound_is_at_least_real_subsets_and_at_most_hoffman(tool):
    weights, rank = tool.reed_muller2(4)
    keys, orbit = tool.affine_orbits(weights, rank)
    ip_of_orbit = 16 - 2 * (keys % 1000)
    X, words = _dg_words(tool)
    assert len(set(words.tolist())) == len(X) == 1024
    G = np.round(16 * (X @ X.T)).astype(np.int64)
    occurring = sorted(set(G[np.triu_indices(len(X), 1)].tolist()))

    # The whole code: its own inner products allowed, the bound must admit all 1024 rows.
    allowed = np.isin(ip_of_orbit, occurring)
    assert tool.delsarte(orbit, allowed) >= 1024

    # Each window better than the code's own: the LP bound caps a greedy subset of the
    # real rows from above and Hoffman's bound from below.
    ips = tool._ips(16, weights)
    lo_code, hi_code = min(occurring), max(occurring)
    rho2_code = (16 - hi_code) / (16 - lo_code)
    windows = tool.maximal_windows(ips, 16, rho2_code, strict=True)
    assert windows
    for lo, hi in windows:
        allowed = (ip_of_orbit >= lo) & (ip_of_orbit <= hi)
        lp = tool.delsarte(orbit, allowed)
        hoffman = tool.hoffman(weights, (weights > 0) & ~allowed[orbit])
        chosen = []
        for i in range(len(X)):
            if all(lo <= G[i, j] <= hi for j in chosen):
                chosen.append(i)
        assert len(chosen) <= lp <= hoffman, (lo, hi)


def test_maximal_windows(tool):
    # Inner products (x 10) -3, 0, 2, 5: rho^2 = (10 - hi) / (10 - lo) is 10/13 for
    # [-3, 0], 0.8 for [0, 2], 5/8 for [2, 5], 8/13 for [-3, 2] (which holds [-3, 0] and
    # [0, 2]) and 1/2 for [0, 5].
    assert tool.maximal_windows([-3, 0, 2, 5], 10, 0.6, strict=False) == [(-3, 2), (2, 5)]
    assert tool.maximal_windows([-3, 0, 2, 5], 10, 8 / 13, strict=False) == [(-3, 2), (2, 5)]
    assert tool.maximal_windows([-3, 0, 2, 5], 10, 8 / 13, strict=True) == [(-3, 0), (0, 2), (2, 5)]


def test_gold_code_subsets_stay_below_32768(tool):
    w = tool.gold_weights()
    values, counts = np.unique(w, return_counts=True)
    # The Gold code's weight distribution (m = 9): 2^(m-1) and 2^(m-1) +- 2^((m-1)/2).
    m = 9
    expect = {0: 1, 2**(m - 1): (2**m - 1) * (2**(m - 1) + 1),
              2**(m - 1) - 2**((m - 1) // 2): (2**m - 1) * (2**(m - 2) + 2**((m - 3) // 2)),
              2**(m - 1) + 2**((m - 1) // 2): (2**m - 1) * (2**(m - 2) - 2**((m - 3) // 2))}
    assert dict(zip(values.tolist(), counts.tolist())) == expect
    w19 = np.concatenate([w, 511 - w])
    windows = tool.maximal_windows(tool._ips(511, w19), 511, 0.945**2, strict=False)
    assert sorted(windows) == [(-33, 1), (-1, 33)]
    simplex = np.arange(1 << 9)  # the words Tr(a x): all at weight 256 from each other
    for lo, hi in windows:
        bad = (w19 > 0) & ((511 - 2 * w19 < lo) | (511 - 2 * w19 > hi))
        assert not bad[simplex[1:]].any()
        assert 512 <= tool.hoffman(w19, bad) < 32768


def test_krawtchouk_is_the_macwilliams_transform(tool):
    # For a linear code C, sum_i A_i K_k(i) / |C| is the weight distribution of its dual:
    # RM(1, 4) (32 words) against RM(2, 4) (2^11 words), both from their generators.
    n = 4
    rm2 = np.bincount(tool.reed_muller2(n)[0], minlength=2**n + 1)
    Z = (np.arange(2**n)[:, None] >> np.arange(n)) & 1
    gens = np.array([np.ones(2**n, dtype=np.int64)] + [Z[:, i] for i in range(n)])
    rm1 = np.bincount(tool._all_words_weights(gens), minlength=2**n + 1)
    dual = tool.krawtchouk(2**n) @ rm1 / rm1.sum()
    np.testing.assert_array_equal(dual, rm2)


def _largest_code(n: int, lo: int, hi: int) -> int:
    """The largest binary code of length n with every distance in [lo, hi], by search.

    Translations are isometries, so the code may hold the zero word; the rest is a maximum
    clique among the words at an allowed distance from it.
    """
    pop = np.array([bin(i).count("1") for i in range(2**n)])
    ok = (pop >= lo) & (pop <= hi)
    adj = [set(np.flatnonzero(ok[np.arange(2**n) ^ v]).tolist()) for v in range(2**n)]
    best = 0

    def grow(size, cand):
        nonlocal best
        best = max(best, size)
        while cand and size + len(cand) > best:
            v = cand.pop()
            grow(size + 1, cand & adj[v])

    grow(1, set(np.flatnonzero(ok).tolist()))
    return best


@pytest.mark.parametrize("lo,hi", [(2, 3), (3, 4), (2, 4), (4, 6), (3, 5), (2, 2), (4, 4)])
def test_binary_lp_bound_caps_the_largest_code(tool, lo, hi):
    largest, bound = _largest_code(6, lo, hi), tool.binary_delsarte(6, lo, hi)
    assert largest <= bound
    if (lo, hi) != (2, 3):  # length 6 is small enough for the bound to be met, except there
        assert largest == bound


def test_binary_lp_bound_admits_real_codes(tool):
    # Rows of a Sylvester Hadamard matrix of order 16 are 16 words at distance 8; the
    # +-1/4 Delsarte-Goethals rows of R^16 are 1024 words with distances in [4, 12].
    H = np.array([[1]])
    for _ in range(4):
        H = np.block([[H, H], [H, -H]])
    D = (H[:, None, :] != H[None, :, :]).sum(axis=2)
    assert set(D[np.triu_indices(16, 1)].tolist()) == {8}
    assert tool.binary_delsarte(16, 8, 8) >= 16
    X = refgeo.delsarte_goethals_code(16)[16:]
    bits = (X < 0).astype(np.int64)
    D = (bits[:, None, :] != bits[None, :, :]).sum(axis=2)[np.triu_indices(len(X), 1)]
    assert tool.binary_delsarte(16, int(D.min()), int(D.max())) >= len(X) == 1024


def test_distance_windows(tool):
    # lo / hi > 0.6, each maximal: [1, 1], [2, 3], [3, 4], [4, 6], [5, 8] for n = 9.
    assert tool.distance_windows(9, 0.6) == [(1, 1), (2, 3), (3, 4), (4, 6), (5, 8)]


def test_gegenbauer_in_three_dimensions_are_legendre(tool):
    # On S^2 the normalized Gegenbauer polynomials are the Legendre polynomials.
    t = np.linspace(-1, 1, 41)
    P = tool.gegenbauer(3, 12, t)
    for k in range(13):
        np.testing.assert_allclose(P[k], np.polynomial.legendre.Legendre.basis(k)(t), atol=1e-12)


def _ip_set(X: np.ndarray, n_rows: int | None = None) -> list[float]:
    X = X / np.linalg.norm(X, axis=1, keepdims=True)
    R = X if n_rows is None else X[np.random.default_rng(0).choice(len(X), n_rows, replace=False)]
    G = np.rint(64 * (R @ X.T)) / 64  # every set here has inner products in (1/64) Z
    return sorted(set(G.ravel().tolist()) - {1.0})


@pytest.mark.parametrize("lattice,d,size", [("E8", 8, 240), ("Leech", 24, 196_560)])
def test_spherical_lp_bound_is_met_by_tight_kissing_configurations(tool, lattice, d, size):
    # E8 and Leech minimal vectors are tight spherical designs: the bound is their size.
    X = refgeo.minimal_vectors(lattice)
    ips = _ip_set(X, n_rows=None if len(X) < 1000 else 50)
    assert len(X) == size
    assert tool.spherical_delsarte(d, ips) == size


def test_spherical_lp_bound_admits_real_codes(tool):
    for X in (refgeo.kerdock_code(16), refgeo.delsarte_goethals_code(16), refgeo.minimal_vectors("BW16")):
        ips = _ip_set(np.asarray(X))
        bound = tool.spherical_delsarte(16, ips)
        assert len(X) <= bound
    with pytest.raises(ValueError, match="ips"):
        tool.spherical_delsarte(16, [0.0, 1.0])


def test_absolute_bound(tool):
    # s = 1: a regular simplex, d + 1 points; s = 2: d (d + 3) / 2 (Delsarte-Goethals-Seidel),
    # met by the 27 points of the Schlaefli configuration in R^6.
    for d in (2, 6, 64):
        assert tool.absolute_bound(d, 1) == d + 1
        assert tool.absolute_bound(d, 2) == d * (d + 3) // 2
    assert tool.absolute_bound(64, 3) == 47_840 < 50_000


@pytest.mark.parametrize("m,size", [(2, 24), (4, 4320)])
def test_barnes_wall_minimal_vectors(tool, m, size):
    # BW4 is D4 (24 roots); BW16 is compared with refgeo's own construction of it (a
    # different one: x mod 2 in RM(1, 4), sum x = 0 mod 4) through the full distribution
    # of inner products, an isometry invariant.
    X = tool.barnes_wall_minimal(m).astype(np.float64)
    n = 2**m
    assert X.shape == (size, n)
    np.testing.assert_array_equal((X**2).sum(axis=1), n // 2)
    assert len({r.tobytes() for r in X}) == size
    ref = {2: refgeo.minimal_vectors("D4"), 4: refgeo.minimal_vectors("BW16")}[m]

    def hist(Y):
        G = np.rint(8 * (Y @ Y.T) / (Y[0] @ Y[0])).astype(np.int64)
        return np.bincount(G.ravel() + 8)

    np.testing.assert_array_equal(hist(X), hist(np.asarray(ref, dtype=np.float64)))
    # inner products over the norm are 0 or +-2^-j (signs of a quadratic summed over a flat)
    assert set(_ip_set(X)) <= {0.0, 0.25, -0.25, 0.5, -0.5, -1.0}


def test_johnson_bound_is_met_by_the_golay_octads(tool):
    """The 759 words of weight 8 of the extended Golay code share at most 4 positions
    pairwise (the Steiner system S(5, 8, 24)), and meet Johnson's bound exactly."""
    from refgeo import codes

    C = codes._golay()
    octads = C[C.sum(axis=1) == 8]
    shared = octads @ octads.T
    np.fill_diagonal(shared, 0)
    assert len(octads) == tool.johnson_bound(24, 4, 8) == 759
    assert shared.max() == 4
    assert tool.johnson_bound(24, 3, 8) < 759  # sharing at most 3: not all of them
    assert [tool.johnson_bound(10, 0, w) for w in (1, 3, 10)] == [10, 3, 1]
