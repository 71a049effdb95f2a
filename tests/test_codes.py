"""Constructions of refgeo.codes (docs/theory/spreading.md): exact spectra, counts and
closed-form ratios of the simplices, Kerdock and Delsarte-Goethals codes, and the lattice
balls and shells, each checked by brute force independently of the construction."""

from __future__ import annotations

import itertools
import math
import re

import numpy as np
import pytest
from scipy.spatial.distance import pdist

import refgeo
from refgeo.codes import _candidates, _fwht, _golay, _kerdock_forms, _OddField, _rm14


def _sq_dists(X):
    X = np.asarray(X, dtype=np.float64)
    i, j = np.triu_indices(X.shape[0], 1)
    return ((X[i] - X[j]) ** 2).sum(1)


def _rho(X) -> float:
    e = _sq_dists(X)
    return math.sqrt(e.min() / e.max())


def _rank_gf2(M) -> int:
    """Rank over F_2 by Gaussian elimination (independent of refgeo)."""
    M = np.array(M, dtype=np.int64) % 2
    r = 0
    for c in range(M.shape[1]):
        piv = [i for i in range(r, M.shape[0]) if M[i, c]]
        if not piv:
            continue
        M[[r, piv[0]]] = M[[piv[0], r]]
        for i in range(M.shape[0]):
            if i != r and M[i, c]:
                M[i] ^= M[r]
        r += 1
    return r


def _sylvester(d):
    H = np.array([[1.0]])
    while H.shape[0] < d:
        H = np.block([[H, H], [H, -H]])
    return H


# =========================================================================== constructions


@pytest.mark.parametrize("d", [1, 2, 5, 9])
def test_regular_simplex(d):
    for V in range(2, d + 2):
        X = refgeo.regular_simplex(V, d)
        assert X.shape == (V, d)
        G = X @ X.T
        np.testing.assert_allclose(G, np.where(np.eye(V, dtype=bool), 1.0, -1.0 / (V - 1)), atol=1e-14)
        np.testing.assert_allclose(X.sum(0), 0.0, atol=1e-14)
        assert _rho(X) == pytest.approx(1.0, abs=1e-14)


@pytest.mark.parametrize("d", range(1, 10))
def test_orthogonal_simplices(d):
    X = refgeo.orthogonal_simplices(d)
    a, b = d // 2, d - d // 2
    assert X.shape == (d + 2, d)
    assert _rho(X) ** 2 == pytest.approx(0.5 * (a / (a + 1) + b / (b + 1)), abs=1e-13)
    assert np.linalg.norm(X, axis=1).max() == pytest.approx(1.0)
    if d % 2 == 0:
        assert _rho(X) ** 2 == pytest.approx(d / (d + 2), abs=1e-13)
        assert _rho(X) == pytest.approx(refgeo.welch_bound(d + 2, d), abs=1e-12)


@pytest.mark.parametrize("d", [2, 3, 7])
def test_cross_polytope(d):
    X = refgeo.cross_polytope(d)
    assert X.shape == (2 * d, d)
    G = X @ X.T
    off = G[~np.eye(2 * d, dtype=bool)]
    assert set(np.unique(off).tolist()) == {-1.0, 0.0}
    assert _rho(X) == pytest.approx(math.sqrt(0.5), abs=1e-15)


def test_embed():
    X = refgeo.kerdock_code(4)
    Y = refgeo.embed(X, d=9)
    assert Y.shape == (12, 9) and not Y[:, 4:].any()
    np.testing.assert_array_equal(_sq_dists(Y), _sq_dists(X))
    with pytest.raises(ValueError, match=re.escape("d == 3, must be >= 4.")):
        refgeo.embed(X, d=3)


# --------------------------------------------------------------------------- Kerdock


@pytest.mark.parametrize("d", [4, 16, 64])
def test_kerdock_spectrum_counts_and_rho(d):
    X = refgeo.kerdock_code(d)
    nb = d // 2 + 1
    assert X.shape == (d * nb, d)
    s = 1 / math.sqrt(d)
    assert set(np.unique(np.abs(X)).tolist()) <= {0.0, s, 1.0}
    G = X @ X.T
    blocks = G.reshape(nb, d, nb, d).transpose(0, 2, 1, 3)  # blocks[b, c] = basis b vs basis c
    same = np.eye(nb, dtype=bool)
    assert (blocks[same] == np.eye(d)).all()  # orthonormal within (exactly)
    assert (np.abs(blocks[~same]) == s).all()  # unbiased across (exactly)
    # never both v and -v, and the closed form of rho (unit rows: |x - y|^2 = 2 - 2<x, y>)
    off = G[~np.eye(G.shape[0], dtype=bool)]
    assert np.abs(off).max() < 1.0
    assert (2 - 2 * off.max()) / (2 - 2 * off.min()) == pytest.approx((math.sqrt(d) - 1) / (math.sqrt(d) + 1), abs=1e-14)


@pytest.mark.slow
def test_kerdock_256_all_pairs_of_bases():
    d = 256
    X = refgeo.kerdock_code(d)
    for b in range(d // 2 + 1):
        blk = X[b * d : (b + 1) * d] @ X.T
        blk[:, b * d : (b + 1) * d] -= np.eye(d)
        assert set(np.unique(np.abs(blk)).tolist()) == {0.0, 1 / 16}


def test_kerdock_256_sampled_bases():
    d = 256
    X = refgeo.kerdock_code(d, 20 * d)
    G = X[::d // 4] @ X.T  # 4 rows of each basis against everything
    own = np.repeat(np.arange(20), d)
    for r, row in enumerate(G):
        b = (r * (d // 4)) // d
        other = own != b
        assert set(np.unique(np.abs(row[other])).tolist()) == {1 / 16}


def test_kerdock_prefix_and_V():
    X = refgeo.kerdock_code(16)
    for V in (1, 5, 16, 17, 100, 144):
        np.testing.assert_array_equal(refgeo.kerdock_code(16, V), X[:V])


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.int64])
def test_codes_take_numpy_integer_dimensions(dtype):
    """A NumPy integer d overflowed in the row counts: np.int8(16) gave "negative
    dimensions are not allowed", and np.int16(64) silently gave the 64 rows of the
    standard basis for the d + d**3/4 = 65,600 of the Delsarte-Goethals code."""
    k = refgeo.kerdock_code(dtype(16))
    assert k.shape == (16 * (16 // 2 + 1), 16)
    np.testing.assert_array_equal(k, refgeo.kerdock_code(16))
    if np.iinfo(dtype).max >= 64:
        g = refgeo.delsarte_goethals_code(dtype(64))
        assert g.shape == (64 + 64**3 // 4, 64)
        # unit rows, |inner products| in {0, 1/8, 1/4} across rows (sampled rows)
        rows = g[np.random.default_rng(0).choice(g.shape[0], 300, replace=False)]
        ip = np.abs(rows @ rows.T)[np.triu_indices(300, 1)]
        assert set(np.unique(ip).tolist()) <= {0.0, 0.125, 0.25}
        np.testing.assert_array_equal(np.linalg.norm(g, axis=1), 1.0)


@pytest.mark.parametrize("n", [2, 4, 6, 8])
def test_kerdock_forms_differences_are_nonsingular(n):
    """The Kerdock-set property, checked over F_2 independently of the inner products."""
    B = _kerdock_forms(n, np.arange(2 ** (n - 1)))
    assert not B[:, np.arange(n), np.arange(n)].any()  # alternating
    assert (B == np.transpose(B, (0, 2, 1))).all()
    for u, v in itertools.combinations(range(B.shape[0]), 2):
        assert _rank_gf2(B[u] ^ B[v]) == n


def test_fwht_is_sylvester_hadamard():
    for d in (1, 2, 8, 32):
        np.testing.assert_array_equal(_fwht(np.eye(d)), _sylvester(d))


# --------------------------------------------------------------------------- Delsarte-Goethals


def test_delsarte_goethals_16():
    X = refgeo.delsarte_goethals_code(16)
    assert X.shape == (16 + 16 * 64, 16)
    np.testing.assert_array_equal(X[: 16 * 9], refgeo.kerdock_code(16))
    G = np.abs(X @ X.T - np.eye(X.shape[0]))
    assert set(np.unique(G).tolist()) == {0.0, 0.25, 0.5}
    assert _rho(X) ** 2 == pytest.approx((4 - 2) / (4 + 2), abs=1e-14)


@pytest.mark.parametrize("n", [4, 6])
def test_delsarte_goethals_forms_rank(n):
    h = 2 ** (n - 1)
    w, u = np.divmod(np.arange(h * h), h)
    B = _kerdock_forms(n, u, w)
    rng = np.random.default_rng(0)
    pairs = list(itertools.combinations(range(B.shape[0]), 2))
    if len(pairs) > 3000:
        pairs = [pairs[i] for i in rng.choice(len(pairs), 3000, replace=False)]
    assert min(_rank_gf2(B[a] ^ B[b]) for a, b in pairs) >= n - 2


def test_delsarte_goethals_64_sampled():
    assert refgeo.delsarte_goethals_code(64, 7).shape == (7, 64)
    X = refgeo.delsarte_goethals_code(64, 16000)
    G = np.abs(X[::101] @ X.T)
    G[np.arange(G.shape[0]), np.arange(0, X.shape[0], 101)] = 0.0
    assert set(np.unique(G).tolist()) <= {0.0, 0.125, 0.25}


# --------------------------------------------------------------------------- candidates


@pytest.mark.parametrize(
    "V, d",
    [(3, 2), (5, 3), (6, 4), (7, 5), (8, 4), (10, 8), (20, 16), (100, 20), (150, 40), (300, 32), (200, 40), (40, 16),
     (100, 24), (130, 34)],
)
def test_candidates_closed_form_rho(V, d):
    """Every construction the solver may start from has the ratio it claims."""
    for c in _candidates(V, d):
        X = c.build()
        assert X.shape == (V, d), c.name
        assert _rho(X) == pytest.approx(c.rho, abs=1e-12), c.name
        assert c.rho <= refgeo.ratio_upper_bound(V, d).value
        if c.diameter is not None:  # closed-form diameter, used by the algebraic certificate
            assert math.sqrt(_sq_dists(X).max()) == pytest.approx(c.diameter, rel=1e-15), c.name


def test_tagged_delsarte_goethals_spectrum_and_rho():
    """One tag per basis lifts the same-basis inner products from 0 to t^2 = 2/sqrt(q):
    squared distances in [2, 2 + 8/sqrt(q)], rho^2 = 2/3 for q = 64 (from 3/5)."""
    V, d = 2200, 64 + 35
    (c,) = [c for c in _candidates(V, d) if c.name == "delsarte_goethals(64)+tags"]
    X = c.build()
    G = X @ X.T
    assert np.allclose(np.diag(G), 1.25, atol=0, rtol=0)  # dyadic entries: exact
    levels = sorted(set(np.round(8 * G[np.triu_indices(V, 1)], 12).tolist()))
    assert levels == [-2.0, -1.0, 0.0, 1.0, 2.0]
    assert c.rho == pytest.approx(math.sqrt(2 / 3), abs=1e-15)
    e = (2.5 - 2.0 * G)[np.triu_indices(V, 1)]  # squared distances (exact: dyadic Gram)
    assert math.sqrt(e.min() / e.max()) == pytest.approx(c.rho, abs=1e-15)
    assert math.sqrt(e.max()) == c.diameter
    plain = {k.name: k.rho for k in _candidates(V, d)}["delsarte_goethals(64)"]
    assert plain == pytest.approx(math.sqrt(3 / 5)) and c.rho > plain


@pytest.mark.parametrize("V, d, rho2", [(3000, 66, 7 / 11), (1000, 40, 3 / 7)])
def test_class_tagged_delsarte_goethals(V, d, rho2):
    """One tag per Kerdock class of bases (2 extra coordinates at (3000, 66)): inside a
    class the inner products move from +-1/sqrt(q) to 1/sqrt(q) +- 1/sqrt(q)."""
    cands = {c.name: c for c in _candidates(V, d)}
    q = 64 if d >= 64 else 16
    c = cands[f"delsarte_goethals({q})+class_tags"]
    assert f"delsarte_goethals({q})+tags" not in cands  # one tag per basis needs more room
    X = c.build()
    G = X @ X.T
    n = np.diag(G)
    e = (n[:, None] + n[None, :] - 2.0 * G)[np.triu_indices(V, 1)]
    assert math.sqrt(e.min() / e.max()) == pytest.approx(c.rho, abs=1e-12)
    assert c.rho == pytest.approx(math.sqrt(rho2), abs=1e-15)
    assert c.rho > cands[f"delsarte_goethals({q})"].rho
    if c.diameter is not None:
        assert math.sqrt(e.max()) == pytest.approx(c.diameter, rel=1e-15)


@pytest.mark.parametrize("V, d", [(145, 18), (145, 26), (400, 40), (1040, 16 + 65), (2113, 66), (2113, 98)])
def test_delsarte_goethals_candidates_at_the_switch_points(V, d):
    """Every Delsarte-Goethals construction offered one row past the Kerdock code (two
    classes, a partial basis), with just room for its tags, or whole, has the ratio and
    the diameter it claims (also those that are not the best for (V, d))."""
    cands = [c for c in _candidates(V, d) if c.name.startswith("delsarte_goethals")]
    assert len(cands) >= 2  # the plain code and at least one tagged form
    for c in cands:
        X = c.build()
        D = refgeo.row_diameter(X).value  # certified by the engine
        assert refgeo.closest_pair(X).value / D == pytest.approx(c.rho, abs=1e-13), c.name
        assert c.rho <= refgeo.ratio_upper_bound(V, d).value, c.name
        if c.diameter is not None:
            assert D == pytest.approx(c.diameter, rel=1e-15), c.name


def test_tagged_kerdock_beats_plain():
    names = {c.name: c.rho for c in _candidates(32768, 512)}
    assert names["kerdock(256)x1+tags"] == pytest.approx(math.sqrt(16 / 18))
    assert names["kerdock(256)x1"] == pytest.approx(math.sqrt(15 / 17))


# --------------------------------------------------------------------------- quadratic trace codes


def _hamming_from_row(X, r, p, m):
    """Hamming distances from row r, read off the squared Euclidean ones (distinct
    simplex vertices are at 2p/((p-1)N), N = p^m), after checking that they are whole."""
    N = p**m
    h = ((X - X[r]) ** 2).sum(axis=1) * ((p - 1) * N / (2.0 * p))
    np.testing.assert_allclose(h, np.round(h), rtol=0, atol=1e-9)
    return np.round(h).astype(np.int64)


@pytest.mark.parametrize("p, m", [(3, 3), (5, 3), (3, 5)])
def test_quadratic_trace_code_distances_follow_the_quadratic_forms(p, m):
    """Hamming distances W inside a class (a linear function) and W - e, W, W + e across
    classes (a nondegenerate quadratic form in m variables: p^(m-1) or
    p^(m-1) +- p^((m-1)/2) zeros), with W = (p-1) p^(m-1), e = p^((m-1)/2); from the zero
    word (row 0) the numbers of rows at each distance are those of the theory (Lidl and
    Niederreiter 6.26-6.27: (p-1)/2 values c of each quadratic character, each with
    p^(m-1) +- e solutions of Q(y) = c)."""
    N = p**m
    W, e = (p - 1) * p ** (m - 1), p ** ((m - 1) // 2)
    X = refgeo.quadratic_trace_code(p, m)
    assert X.shape == (N * N, (p - 1) * N)
    np.testing.assert_allclose(np.linalg.norm(X, axis=1), 1.0, rtol=1e-14)
    # every coordinate block is one of p vertices of a regular simplex
    blocks = X[:: max(1, N // 8)].reshape(-1, p - 1)
    _, first = np.unique(blocks.round(12), axis=0, return_index=True)
    assert first.size == p
    vd = pdist(blocks[first], "sqeuclidean")
    np.testing.assert_allclose(vd, 2.0 * p / ((p - 1) * N), rtol=1e-12)
    levels, counts = np.unique(_hamming_from_row(X, 0, p, m), return_counts=True)
    assert levels.tolist() == [0, W - e, W, W + e]
    half = (N - 1) * (p - 1) // 2
    assert counts.tolist() == [1, half * (p ** (m - 1) + e), (N - 1) * (p ** (m - 1) + 1), half * (p ** (m - 1) - e)]
    # every row sees the same spectrum (the code is linear), inside its class only W
    for r in np.random.default_rng(0).choice(N * N, 4, replace=False):
        h = _hamming_from_row(X, r, p, m)
        same = np.arange(N * N) // N == r // N
        assert set(h[same].tolist()) == {0, W} and set(h[~same].tolist()) == {W - e, W, W + e}
        assert np.unique(h, return_counts=True)[1].tolist() == counts.tolist()


def test_quadratic_trace_code_prefix_and_all_pairs():
    """The first V rows are a prefix of the code; over all pairs of the (3, 3) code the
    ratio is the closed form sqrt((W - e)/(W + e)) = sqrt(15/21)."""
    X = refgeo.quadratic_trace_code(3, 3)
    for V in (1, 2, 27, 28, 500, 729):
        np.testing.assert_array_equal(refgeo.quadratic_trace_code(3, 3, V), X[:V])
    assert _rho(X) == pytest.approx(math.sqrt(15 / 21), abs=1e-14)
    assert _rho(X[:28]) == pytest.approx(math.sqrt(15 / 21), abs=1e-14)  # two classes suffice
    assert _rho(X[:27]) == pytest.approx(1.0, abs=1e-14)  # one class: a simplex


@pytest.mark.parametrize("p, m", [(3, 3), (3, 5), (3, 7), (5, 3), (7, 3), (31, 3)])
def test_odd_field_tables_make_a_field(p, m):
    """The tables' products distribute over coefficientwise addition modulo p (checked
    without the tables), x^(p^m - 1) = 1 with every nonzero element a power of x, and the
    trace is F_p-linear and onto."""
    F = _OddField(p, m)
    N = p**m
    assert sorted(F.exp.tolist()) == list(range(1, N))
    digits = lambda a: (np.asarray(a)[..., None] // p ** np.arange(m)) % p  # noqa: E731
    number = lambda c: (c * p ** np.arange(m)).sum(-1)  # noqa: E731
    add = lambda a, b: number((digits(a) + digits(b)) % p)  # noqa: E731

    def mul(a, b):
        a, b = np.asarray(a), np.asarray(b)
        return np.where((a == 0) | (b == 0), 0, F.exp[(F.log[a] + F.log[b]) % (N - 1)])

    rng = np.random.default_rng(p * 100 + m)
    a, b, c = rng.integers(0, N, (3, 4000))
    np.testing.assert_array_equal(mul(a, add(b, c)), add(mul(a, b), mul(a, c)))
    tr = F.trace_products(np.array([1]), np.arange(N))[0]  # Tr(z)
    np.testing.assert_array_equal(tr[add(a, b)], (tr[a] + tr[b]) % p)
    assert set(tr.tolist()) == set(range(p))
    # Tr(z^p) = Tr(z): the Frobenius permutes the conjugates
    zp = np.arange(N)
    for _ in range(p - 1):
        zp = mul(zp, np.arange(N))
    np.testing.assert_array_equal(tr[zp], tr)


@pytest.mark.parametrize("args, exc, msg", [
    ((4, 3), ValueError, "p must be an odd prime (3, 5, 7, 11, ...), got 4 instead."),
    ((9, 3), ValueError, "p must be an odd prime (3, 5, 7, 11, ...), got 9 instead."),
    ((2, 3), ValueError, "p == 2, must be >= 3."),
    ((3, 4), ValueError, "m must be odd (3, 5, 7, ...), got 4 instead."),
    ((3, 1), ValueError, "m == 1, must be >= 3."),
    ((3, 3, 0), ValueError, "V == 0, must be >= 1."),
    ((3, 3, 730), ValueError, "V == 730, must be <= 729."),
    ((3.0, 3), TypeError, "p must be an integer, got float (3.0) instead."),
    ((3, 3, "5"), TypeError, "V must be an integer, got str ('5') instead."),
    ((3, 41), MemoryError, "quadratic_trace_code(3, 41) has (p - 1) * p**m > 2**62 coordinates per row."),
    ((10**30 + 1, 3), MemoryError, "quadratic_trace_code(1000000000000000000000000000001, 3) has"),
])
def test_quadratic_trace_code_errors(args, exc, msg):
    with pytest.raises(exc, match=re.escape(msg)):
        refgeo.quadratic_trace_code(*args)


def test_quadratic_trace_code_beyond_memory_is_refused_by_name():
    with pytest.raises(MemoryError, match=re.escape("quadratic_trace_code(3, 19, 1000000) needs about ")):
        refgeo.quadratic_trace_code(3, 19, 10**6)


@pytest.mark.parametrize("V, d, names", [
    (729, 54, ["quadratic_trace(3^3)"]),
    (300, 70, ["quadratic_trace(3^3)", "quadratic_trace(3^3)+class_tags"]),
    (2000, 500, ["quadratic_trace(3^5)", "quadratic_trace(3^5)+class_tags", "quadratic_trace(5^3)"]),
])
def test_quadratic_trace_candidates(V, d, names):
    """The trace-code candidates offered for (V, d) have the ratio they claim (all pairs,
    or the engine's certified extremes), within ratio_upper_bound; the class tags lift
    the ratio to sqrt(W/(W + 2e))."""
    cands = {c.name: c for c in _candidates(V, d) if c.name.startswith("quadratic_trace")}
    assert sorted(cands) == sorted(names)
    for name, c in cands.items():
        X = c.build()
        assert X.shape == (V, d)
        if V <= 1000:
            rho = _rho(X)
        else:
            with refgeo.use_backend("cython" if refgeo._backend.available_backends()["cython"][0] else "reference"):
                rho = refgeo.closest_pair(X).value / refgeo.row_diameter(X).value
        assert rho == pytest.approx(c.rho, abs=1e-13), name
        assert c.rho <= refgeo.ratio_upper_bound(V, d).value, name
        p, m = (int(t) for t in re.match(r"quadratic_trace\((\d+)\^(\d+)\)", name).groups())
        W, e = (p - 1) * p ** (m - 1), p ** ((m - 1) // 2)
        assert c.rho ** 2 == pytest.approx(W / (W + 2 * e) if name.endswith("tags") else (W - e) / (W + e), abs=1e-14)


# --------------------------------------------------------------------------- lattices


KISSING = {"D5": 40, "D12": 264, "E6": 72, "E7": 126, "E8": 240, "BW16": 4320}


@pytest.mark.parametrize("name", sorted(KISSING))
def test_minimal_vectors_counts_norms_and_levels(name):
    """Kissing numbers, one norm, and inner products on the levels {0, +-1/4, +-1/2, +-1}
    times the norm, with the closest pair at exactly the lattice minimum."""
    X = refgeo.minimal_vectors(name)
    n2 = np.einsum("ij,ij->i", X, X)
    assert X.shape[0] == KISSING[name] and np.unique(np.round(X, 12), axis=0).shape[0] == X.shape[0]
    np.testing.assert_allclose(n2, n2[0], rtol=1e-14)
    G = 4.0 * (X @ X.T) / n2[0]
    assert np.all(np.abs(G - np.round(G)) < 1e-9)
    off = np.round(G[~np.eye(X.shape[0], dtype=bool)])
    assert off.max() == 2.0 and off.min() == -4.0  # closest pair at distance^2 = norm; antipodal
    if name in ("BW16",):
        assert set(np.unique(off).tolist()) == {-4.0, -2.0, -1.0, 0.0, 1.0, 2.0}


def test_leech_minimal_vectors():
    X = refgeo.minimal_vectors("Leech")
    assert X.shape == (196560, 24)
    Y = X * math.sqrt(8.0)
    assert np.array_equal(Y, np.round(Y)) and np.all(np.einsum("ij,ij->i", Y, Y) == 32.0)
    assert np.unique(Y, axis=0).shape[0] == 196560
    # inner products of a sample against all: levels of 8 (norm-32 units), at most 16 apart
    # from the vector itself, i.e. no two minimal vectors are closer than the minimum
    G = Y[::997] @ Y.T
    assert set(np.unique(G).tolist()) == {-32.0, -16.0, -8.0, 0.0, 8.0, 16.0, 32.0}


@pytest.mark.parametrize("V, d", [(9000, 24), (196560, 24), (9000, 30)])
def test_the_leech_shell_beyond_the_pools(V, d):
    """8000 < V <= 196,560 in d = 24 to 32 had no construction (the shell subsets were
    drawn from caps of 8000 vectors only), and spread started from random points (0.21
    at V = 196,560, where the whole Leech shell has 1/2)."""
    from scipy.spatial.distance import cdist

    cands = [c for c in _candidates(V, d) if c.name.startswith("shell(Leech")]
    assert cands and max(c.rho for c in cands) == 0.5
    c = max(cands, key=lambda c: c.rho)
    X = c.build()
    assert X.shape == (V, d)
    rows = X if V <= 10000 else X[np.random.default_rng(0).choice(V, 10000, replace=False)]
    lo, hi = math.inf, 0.0
    for i in range(0, rows.shape[0], 1000):  # brute force over all pairs (or a sample)
        E = cdist(rows[i : i + 1000], rows, "sqeuclidean")
        E[np.arange(E.shape[0]), i + np.arange(E.shape[0])] = np.inf
        lo = min(lo, float(E.min()))
        E[np.isinf(E)] = 0.0
        hi = max(hi, float(E.max()))
    assert lo == pytest.approx(4.0, rel=1e-12) and hi == pytest.approx(16.0, rel=1e-12)


def test_golay_and_reed_muller_weights():
    C = _golay()
    w, n = np.unique(C.sum(axis=1), return_counts=True)
    assert w.tolist() == [0, 8, 12, 16, 24] and n.tolist() == [1, 759, 2576, 759, 1]
    assert np.unique(C, axis=0).shape[0] == 4096 and np.all((C[1:50] ^ C[50:99]) @ np.ones(24) % 4 == 0)
    R = _rm14()
    w, n = np.unique(R.sum(axis=1), return_counts=True)
    assert w.tolist() == [0, 8, 16] and n.tolist() == [1, 30, 1]


def test_lattice_ball_follows_the_e8_theta_series():
    """Around the origin the shells of E8 hold 1, 240, 2160, 6720 points (the theta
    series of E8, 1 + 240 sum sigma_3(n) q^n)."""
    X = refgeo.lattice_ball(1 + 240 + 2160 + 6720, "E8")
    n2, counts = np.unique(np.round(np.einsum("ij,ij->i", X, X), 9), return_counts=True)
    assert n2.tolist() == [0.0, 2.0, 4.0, 6.0] and counts.tolist() == [1, 240, 2160, 6720]
    assert np.unique(X, axis=0).shape[0] == X.shape[0]


@pytest.mark.parametrize("center", [None, [0.1, -0.05, 0.02, 0.0, 0.07, -0.1, 0.03, 0.01]])
def test_lattice_ball_matches_a_box_enumeration(center):
    """The 30 nearest points against E8 in a box by brute force (integer points in
    [-2, 2]^8, half-integer ones in [-1.5, 1.5]^8, even coordinate sum)."""
    X = refgeo.lattice_ball(30, "E8", center=center)
    c = np.zeros(8) if center is None else np.asarray(center, dtype=float)
    ints = np.stack(np.meshgrid(*[np.arange(-2.0, 3.0)] * 8, indexing="ij"), -1).reshape(-1, 8)
    halves = np.stack(np.meshgrid(*[np.arange(-1.5, 2.0)] * 8, indexing="ij"), -1).reshape(-1, 8)
    B = np.vstack([ints, halves])
    B = B[np.round(B.sum(axis=1)) % 2 == 0]
    rb = np.sort(np.linalg.norm(B - c, axis=1))
    rx = np.linalg.norm(X - c, axis=1)
    assert rx.max() < 2.2  # a point outside the box is at distance >= 2.4 from c
    np.testing.assert_allclose(rx, rb[:30], rtol=1e-12)
    assert np.unique(X, axis=0).shape[0] == 30
    assert all(np.any(np.all(B == x, axis=1)) for x in X)


@pytest.mark.parametrize("name, d", [("D5", 5), ("E6", 6), ("E7", 7), ("A2", 2), ("Z", 1)])
def test_lattice_ball_radii_are_sorted_and_min_distance_is_the_minimum(name, d):
    X = refgeo.lattice_ball(400, name)
    assert X.shape == (400, d)
    dd = pdist(X)
    lam = {"Z": 1.0, "A2": 1.0}.get(name, math.sqrt(2.0))
    assert dd.min() == pytest.approx(lam, rel=1e-12)
    r = np.linalg.norm(X, axis=1)
    assert np.all(np.diff(r) >= -1e-12)


@pytest.mark.parametrize("name, n", [("Z", 1), ("A2", 2), ("D4", 4), ("E8", 8)])
@pytest.mark.parametrize("big", [2.0**53, 1e17, 1e300])
def test_lattice_ball_rejects_centers_beyond_exact_lattice_coordinates(name, n, big):
    """Near 2**53 the lattice points around the center are no longer distinct float64
    vectors (the ball came back with duplicates, and a center of 1e300 never returned)."""
    c = np.zeros(n)
    c[-1] = big
    with pytest.raises(ValueError, match=re.escape("center must have entries of magnitude at most 2**24")):
        refgeo.lattice_ball(20, name, center=c)


@pytest.mark.parametrize("name, n", [("Z", 1), ("A2", 2), ("D4", 4), ("E8", 8)])
def test_lattice_ball_far_from_the_origin_is_a_translate(name, n):
    """A center 2**24 away (the largest accepted) gives distinct points whose closest
    pair is the lattice minimum and whose distances to the center are sorted."""
    c = np.full(n, 2.0**24)
    X = refgeo.lattice_ball(50, name, center=c)
    assert np.unique(X, axis=0).shape[0] == 50
    lam = {"Z": 1.0, "A2": 1.0}.get(name, math.sqrt(2.0))
    assert pdist(X).min() == pytest.approx(lam, rel=1e-8)
    r = np.linalg.norm(X - c, axis=1)
    assert np.all(np.diff(r) >= -1e-8)


def test_lattice_errors():
    with pytest.raises(ValueError, match=re.escape("lattice must be one of")):
        refgeo.minimal_vectors("E9")
    with pytest.raises(ValueError, match=re.escape("lattice 'D<n>' needs an integer n >= 3, got 'D2' instead.")):
        refgeo.minimal_vectors("D2")
    with pytest.raises(TypeError, match=re.escape("lattice must be a str, got int instead.")):
        refgeo.lattice_ball(5, 8)
    with pytest.raises(ValueError, match=re.escape("center must have shape (8,), got shape (3,) instead.")):
        refgeo.lattice_ball(5, "E8", center=[0, 0, 0])
    with pytest.raises(ValueError, match=re.escape("offers its minimal vectors only")):
        refgeo.lattice_ball(5, "Leech")


@pytest.mark.parametrize("module", ["codes", "spreading"])
def test_sources_hold_no_control_characters(module):
    """A docstring written with ``\\rho`` outside a raw string holds a carriage return
    and renders as "ho"; no control character but the newline belongs in the sources."""
    import pathlib
    import refgeo as pkg

    text = (pathlib.Path(pkg.__file__).parent / f"{module}.py").read_bytes().decode("utf-8")
    bad = sorted({hex(ord(ch)) for ch in text if ord(ch) < 0x20 and ch != "\n"})
    assert bad == [], f"control characters {bad} in refgeo/{module}.py"


# --------------------------------------------------------------------------- sizes and names


def _memory_error(what: str, parts: str, advice: str) -> str:
    """The full MemoryError text of refgeo._memory.check_memory (the available memory
    varies: any amount)."""
    return (re.escape(f"{what} needs about {parts}, but only ") + r"[0-9.]+ (B|KiB|MiB|GiB|TiB) are available\. "
            + re.escape(advice) + "$")


@pytest.mark.parametrize("call, what, parts, advice", [
    (lambda: refgeo.regular_simplex(3, 2**40), "regular_simplex(3, 1099511627776)",
     "24.0 TiB (result (3 x 1099511627776 float64): 24.0 TiB)", "Ask for fewer rows V or a smaller d."),
    (lambda: refgeo.cross_polytope(2**40), "cross_polytope(1099511627776)",
     "17592186044416.0 TiB (result (2199023255552 x 1099511627776 float64): 17592186044416.0 TiB)",
     "Ask for a smaller d."),
    (lambda: refgeo.orthogonal_simplices(2**30), "orthogonal_simplices(1073741824)",
     "10485760.0 TiB (result (1073741826 x 1073741824 float64): 8388608.0 TiB; working memory: 2097152.0 TiB)",
     "Ask for a smaller d."),
    (lambda: refgeo.embed([[1.0]], d=2**40), "embed(X of shape (1, 1), d=1099511627776)",
     "8.0 TiB (result (1 x 1099511627776 float64): 8.0 TiB)", "Ask for a smaller d."),
    (lambda: refgeo.kerdock_code(4**20, 1), "kerdock_code(1099511627776, 1)",
     "8.0 TiB (result (1 x 1099511627776 float64): 8.0 TiB)", "Ask for fewer rows V or a smaller d."),
    (lambda: refgeo.kerdock_code(4**10, 4**10 + 1), "kerdock_code(1048576, 1048577)",
     "40.0 TiB (result (1048577 x 1048576 float64): 8.0 TiB; working memory: 32.0 TiB)",
     "Ask for fewer rows V or a smaller d."),
    (lambda: refgeo.delsarte_goethals_code(4**20, 1), "delsarte_goethals_code(1099511627776, 1)",
     "8.0 TiB (result (1 x 1099511627776 float64): 8.0 TiB)", "Ask for fewer rows V or a smaller d."),
    # d >= 2^63: half = d / 2 is no int64, and NumPy's divmod raised OverflowError first
    (lambda: refgeo.delsarte_goethals_code(4**32, 5), "delsarte_goethals_code(18446744073709551616, 5)",
     "671088640.0 TiB (result (5 x 18446744073709551616 float64): 671088640.0 TiB)",
     "Ask for fewer rows V or a smaller d."),
    # a center of n zeros was allocated first (NumPy's "Maximum allowed dimension exceeded")
    (lambda: refgeo.lattice_ball(5, "D10000000000000000000"), "lattice_ball(5, 'D10000000000000000000')",
     "363797880.7 TiB (result (5 x 10000000000000000000 float64): 363797880.7 TiB)",
     "Ask for fewer points V or a lattice D<n> of smaller n."),
    (lambda: refgeo.minimal_vectors("D100000"), "minimal_vectors('D100000')",
     "29103.5 TiB (19999800000 vectors of length 100000 (float64, built and copied): 29103.5 TiB)",
     "Ask for a lattice D<n> of smaller n."),
])
def test_constructions_beyond_memory_are_refused_by_name(call, what, parts, advice):
    """NumPy's own allocation errors from inside ("array is too big", "Unable to
    allocate") named no argument, and minimal_vectors("D1000") tried 16 GB."""
    with pytest.raises(MemoryError, match=_memory_error(what, parts, advice)):
        call()


@pytest.mark.parametrize("fn", [refgeo.kerdock_code, refgeo.delsarte_goethals_code])
@pytest.mark.parametrize("d", [4**20, 4**31, 4**40])
def test_all_rows_of_a_code_beyond_memory_are_refused_by_name(fn, d):
    """With the default V (every row) the forms' indices, about d/2 of them, were formed
    before the size check: NumPy's "Unable to allocate 4.00 TiB", "array is too big" or
    "Maximum allowed size exceeded" came from inside instead of the MemoryError naming
    the call."""
    with pytest.raises(MemoryError, match=re.escape(f"{fn.__name__}({d}, ")):
        fn(d)


def test_codes_build_only_the_forms_their_rows_reach():
    """The first V rows need ceil((V - d)/d) forms; all d^2/4 Delsarte-Goethals forms
    were indexed for any V (2^38 integers for d = 4^10)."""
    X = refgeo.delsarte_goethals_code(4**10, 5)
    assert X.shape == (5, 4**10)
    np.testing.assert_array_equal(X, np.eye(5, 4**10))
    np.testing.assert_array_equal(refgeo.delsarte_goethals_code(64, 300), refgeo.delsarte_goethals_code(64)[:300])
    np.testing.assert_array_equal(refgeo.kerdock_code(64, 300), refgeo.kerdock_code(64)[:300])


@pytest.mark.parametrize("name", ["D\u00b3", "D\u0663", "D3 ", "D-3", "D03", "D0010"])
def test_lattice_names_take_ascii_digits_only(name):
    """'D³' passed str.isdigit and crashed in int(); 'D٣' (an Arabic-Indic 3) was D3;
    'D03' (a leading zero) was D3 under a second name."""
    with pytest.raises(ValueError, match=re.escape(f"lattice 'D<n>' needs an integer n >= 3, got {name!r} instead.")):
        refgeo.minimal_vectors(name)


def test_lattice_ball_in_high_dimension_is_refused_by_name():
    """math.gamma(n/2 + 1) overflowed from n = 343 on (OverflowError: math range error);
    the refusal now says that the dimension, not V, is the cause."""
    with pytest.raises(MemoryError, match=re.escape(
            "lattice_ball(1, 'D400') would enumerate more than 1048576 lattice points (the projections "
            "of its ball in dimension 400 hold them); ask for fewer points or a lattice of smaller dimension.")):
        refgeo.lattice_ball(1, "D400")


def _greedy_by_the_definition(L, V, lv):
    """The greedy independent set of the pairs with level below lv, written plainly:
    repeatedly the first available point of least conflict degree among the available."""
    conflict = L < lv
    alive = np.ones(L.shape[0], dtype=bool)
    chosen = []
    while len(chosen) < V and alive.any():
        avail = np.flatnonzero(alive)
        deg = conflict[np.ix_(avail, avail)].sum(axis=1)
        i = int(avail[np.argmin(deg)])
        chosen.append(i)
        alive &= ~conflict[i]
        alive[i] = False
    return chosen


@pytest.mark.parametrize("name, n_pool, V", [("E8", 240, 60), ("E8", 240, 240), ("BW16", 700, 300),
                                             ("Leech", 900, 500), ("D12", 264, 100)])
def test_shell_greedy_follows_its_definition(name, n_pool, V):
    """The shell subsets' greedy keeps its degrees incrementally (an argmin over a key
    where removed points sit at 2^40); the chosen points are those of the plain
    definition, level by level."""
    from refgeo.codes import _lattice, _shell_greedy

    M = _lattice(name).minimal()
    P = M[np.argsort(-(M @ M[0]), kind="stable")[:n_pool]]
    r2 = float(P[0] @ P[0])
    L = np.rint(4.0 * (P @ P.T) / r2).astype(np.int8)
    got = {label: X for label, X, _, _ in _shell_greedy(P, V, r2, "")}
    assert got
    for lv in range(1, -5, -1):
        chosen = _greedy_by_the_definition(L, V, lv)
        label = f"ip>={lv:g}/4"
        if len(chosen) >= V:
            np.testing.assert_array_equal(got[label], P[chosen[:V]])
            break
        assert label not in got
        if len(chosen) == V - 1:  # room for V - 1 points and the origin
            np.testing.assert_array_equal(got[label + "+0"][1:], P[chosen])
