"""Identical rows: the extreme-pair functions run their kernel on the rows that decide
the pair (refgeo._duplicates), and the result is the one of every row."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import refgeo
from refgeo import _duplicates, rows
from refgeo._certify import scale_exponent

from .test_engine import (
    _assert_knn_rows_exact,
    _kernel_pair,
    _oracle_exponent,
    _oracle_extreme,
    _oracle_knn,
    _oracle_sq,
)


@st.composite
def clouds_with_copies(draw):
    """A few distinct rows, each copied several times in a random order, with ``-0.0``
    for some zeros (equal to ``0.0``, other bits), and sometimes entries so small that
    distinct rows tie with identical ones in float64 (the reduction must step aside)."""
    n_distinct = draw(st.integers(1, 6))
    d = draw(st.integers(1, 5))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kind = draw(st.sampled_from(["grid", "uniform", "tiny"]))
    base = rng.integers(-2, 3, size=(n_distinct, d)).astype(np.float64)
    if kind == "uniform":
        base = rng.uniform(-1.0, 1.0, size=(n_distinct, d))
    elif kind == "tiny":  # 1e-200 apart: squared differences underflow to 0
        base = base * 1e-200
        base[0] = 1.0
    V = draw(st.integers(max(3, n_distinct), 40))
    S = base[np.concatenate([np.arange(n_distinct), rng.integers(0, n_distinct, V - n_distinct)])]
    S = S[rng.permutation(V)]
    S[(S == 0.0) & (rng.random(S.shape) < 0.5)] = -0.0
    scale = draw(st.sampled_from([1.0, 2.0**-70, 2.0**80, 3.0]))
    return (S * scale).astype(draw(st.sampled_from([np.float64, np.float32])))


@settings(max_examples=300, deadline=None)
@given(S=clouds_with_copies(), tile_size=st.integers(1, 8))
@example(S=np.array([[1.0], [7.96118281e-196], [0.0], [0.0], [0.0], [7.96118281e-196]]), tile_size=1)
@example(S=np.array([[0.0, 0.0], [1.0, 1.0], [-0.0, 0.0], [1.0, 1.0]]), tile_size=2)
@example(S=np.array([[1.0], [2.0**-400], [2.0**-400], [0.0]]), tile_size=1)
@example(S=np.array([[1e300], [0.0], [0.0]]), tile_size=1)
def test_identical_rows_give_the_pair_of_every_row(backend, S, tile_size):
    """The public result equals the float64 oracle and the kernel run on all rows: the
    same value, the same (lexicographically smallest) pair and the prescaling of all
    rows.  The first example: rows 1e-196 apart tie with the identical rows (1, 5) at 0
    in float64, and the tie rule gives (1, 2); the second: a -0.0 row is a copy of the
    0.0 row before it; the last two: identical rows far below (above) the largest row
    reported the prescaling of the pair alone (-399 instead of 0, 0 instead of 997)."""
    D2 = _oracle_sq(S, S)
    for info, maximize, public in ((rows._DIAMETER, True, refgeo.row_diameter),
                                   (rows._CLOSEST, False, refgeo.closest_pair)):
        want = _oracle_extreme(S, maximize, D2)
        r = public(S, tile_size=tile_size)
        assert (r.value, r.i, r.j) == want == _kernel_pair(info, S, tile_size=tile_size)
        assert r.backend == backend and r.scale_exponent == scale_exponent(np, [S])
    if want[0] == 0.0 and _oracle_extreme(S, True, D2)[0] > 0.0:
        assert refgeo.distance_ratio(S) == 0.0


def test_many_identical_rows_are_not_refined_pair_by_pair(backend):
    """2,000 zero rows among 3,000 (untrained embedding rows): every pair of them was
    inside the filter's bound, so closest_pair refined all 2e6 of them (2e8 pairs and
    4.9 s at 20,000 zero rows among 30,000); two clusters of identical rows did the
    same to row_diameter."""
    rng = np.random.default_rng(0)
    S = rng.standard_normal((3000, 16))
    zero = np.sort(rng.choice(3000, 2000, replace=False))
    S[zero] = 0.0
    m = refgeo.closest_pair(S)
    assert (m.value, m.i, m.j) == (0.0, zero[0], zero[1]) and m.n_refined <= 1
    two = np.repeat(rng.standard_normal((2, 16)), 1500, axis=0)[rng.permutation(3000)]
    D = refgeo.row_diameter(two)
    a = int(np.flatnonzero(np.any(two != two[0], axis=1))[0])  # the first row of the other cluster
    assert (D.i, D.j) == (0, a) and D.value == pytest.approx(np.linalg.norm(two[0] - two[a]), rel=1e-15)
    assert D.n_refined <= 1


@settings(max_examples=300, deadline=None)
@given(S=clouds_with_copies(), data=st.data(), tile_size=st.integers(1, 8))
def test_knn_of_rows_with_copies_is_the_knn_of_every_row(backend, S, data, tile_size):
    """knn on one row per class of copies, expanded to every row, equals the oracle on
    all rows: X against itself (with and without the row itself) and against Y, with
    copies on either side and across (Y's copies searched whatever the size of X), in
    blocks of any size; so do the farthest partners."""
    exclude_self = data.draw(st.booleans())
    k = data.draw(st.integers(1, len(S) - int(exclude_self)))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    Y = S[rng.integers(0, len(S), size=data.draw(st.integers(1, 2 * len(S))))]
    X = S[rng.integers(0, len(S), size=data.draw(st.integers(1, 2 * len(S))))]
    k_y = data.draw(st.integers(1, len(Y)))
    with pytest.MonkeyPatch.context() as mp:
        if data.draw(st.booleans()):  # expanded however few the copies
            mp.setattr(rows, "_copies_worth_removing", lambda dup, *a: dup)
        # blocks of one query (or a few) in the expansion and the tie sort: never change the answer
        mp.setattr(_duplicates, "_BLOCK_ELEMENTS", data.draw(st.sampled_from([1, 50, 1 << 18])))
        mp.setattr(_duplicates, "_TIE_BLOCK_ROWS", data.draw(st.sampled_from([1, 7, 40, 1 << 20])))
        mp.setattr(rows, "_EXPAND_BLOCK", data.draw(st.sampled_from([1, 30, 1 << 16])))
        mp.setattr(rows, "KNN_COPIES_MIN_OTHER", data.draw(st.sampled_from([1, 4096])))
        r = refgeo.knn(S, k, exclude_self=exclude_self, tile_size=tile_size)
        r_y = refgeo.knn(X, k_y, Y, tile_size=tile_size)
        fp = refgeo.farthest_partners(S, tile_size=tile_size)
    D2 = _oracle_sq(S, S)
    np.fill_diagonal(D2, -np.inf)
    far = np.argmax(D2, axis=1)  # ties: the smallest j
    np.testing.assert_array_equal(fp.indices, far)
    np.testing.assert_array_equal(fp.distances, np.ldexp(np.sqrt(D2[np.arange(len(S)), far]), _oracle_exponent(S)))
    idx, dist = _oracle_knn(S, k, exclude_self=exclude_self)
    np.testing.assert_array_equal(r.indices, idx)
    np.testing.assert_array_equal(r.distances, dist)
    assert r.backend == backend
    idx, dist = _oracle_knn(X, k_y, Y)
    np.testing.assert_array_equal(r_y.indices, idx)
    np.testing.assert_array_equal(r_y.distances, dist)


def test_knn_interleaves_classes_at_one_distance_by_index(backend, monkeypatch):
    """Rows 0 and 3 are copies at the distance of row 2 from row 1: row 1's neighbors
    interleave the two classes by index (0, 2, 3), not class by class (0, 3, 2); so do
    those of the query (1, 2) against these rows as Y.  The copies are reduced however
    few (the rules would run these rows as they are), and the tie sort runs."""
    monkeypatch.setattr(rows, "_copies_worth_removing", lambda dup, *a: dup)
    monkeypatch.setattr(rows, "KNN_COPIES_MIN_OTHER", 1)
    sorted_ties = []
    real = _duplicates._sort_tied
    monkeypatch.setattr(_duplicates, "_sort_tied", lambda tied, *a: sorted_ties.append(tied.size) or real(tied, *a))
    S = np.array([[2.0, 1.0], [1.0, 2.0], [0.0, 1.0], [2.0, 1.0]])
    for exclude_self, want in ((True, [0, 2, 3]), (False, [1, 0, 2])):
        assert refgeo.knn(S, 3, exclude_self=exclude_self).indices[1].tolist() == want
    r = refgeo.knn(S[1:2], 3, S[[0, 3, 2, 0]])
    assert r.indices.tolist() == [[0, 1, 2]]
    np.testing.assert_array_equal(r.distances, np.sqrt(2.0))
    assert len(sorted_ties) == 3


@pytest.mark.parametrize("block", [16, 40, 1 << 20])
def test_tied_classes_sorted_in_blocks_of_several_queries(backend, monkeypatch, block):
    """Integers 0..9 copied 1 to 5 times: every query has two classes at each distance
    (x - t and x + t), so the tie sort runs for many queries with different numbers of
    candidate rows; blocks of several of them must give each its own rows."""
    monkeypatch.setattr(rows, "_copies_worth_removing", lambda dup, *a: dup)
    monkeypatch.setattr(_duplicates, "_TIE_BLOCK_ROWS", block)
    rng = np.random.default_rng(1)
    for _ in range(5):
        S = np.repeat(np.arange(10.0), rng.integers(1, 6, 10))[:, None]
        S = S[rng.permutation(len(S))]
        for k in (2, 4, 6, 9):
            r = refgeo.knn(S, k)
            idx, dist = _oracle_knn(S, k)
            np.testing.assert_array_equal(r.indices, idx)
            np.testing.assert_array_equal(r.distances, dist)


def test_copies_are_reduced_where_they_pay():
    """The rules of rows._copies_worth_removing at their edges: an eighth of the rows
    and 32 k copies, or classes beyond a heap's slack (max(8, k/2) rows) holding a 64th
    of the rows and 128 k / d of them; and Y is searched only for 4,096 queries."""
    def classes(n, sizes):
        S = np.arange(n, dtype=np.float64)[:, None].repeat(2, axis=1)
        at = 0
        for c in sizes:
            S[at : at + c] = S[at]
            at += c
        return _duplicates.duplicate_rows(S)

    worth = rows._copies_worth_removing
    assert worth(classes(16000, [2] * 2000), 4) is not None  # 2,000 copies: an eighth
    assert worth(classes(16000, [2] * 1999), 4) is None
    assert worth(classes(16000, [2001])) is not None  # farthest partners: no heap
    assert worth(classes(16000, [2] * 2000), 100) is None  # 2,000 copies < 32 k
    # heap slack: classes of more than max(8, k // 2) rows
    assert worth(classes(16000, [251]), 16, 64) is not None  # 251 >= 16,000 / 64
    assert worth(classes(16000, [249]), 16, 64) is None
    assert worth(classes(16000, [9] * 28), 16, 64) is not None  # 252 rows in classes of 9
    assert worth(classes(16000, [8] * 32), 16, 64) is None  # classes of 8 fit the slack
    assert worth(classes(16000, [300]), 64, 8) is None  # below 128 k / d = 1,024
    assert worth(classes(16000, [300]), None) is None  # farthest partners: no heap
    assert rows.KNN_COPIES_MIN_OTHER == 4096


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_knn_of_many_copies_runs_on_the_distinct_rows(backend, dtype):
    """2,000 zero rows among 3,000 (a padding row repeated, or a model's embedding
    layer: one hidden state per occurrence of a token).  Every zero row ties with
    1,999 others at its k-th distance, beyond any heap, so each was refined against
    every candidate (over 6e6 pairs; 3 s at 8,000 copies among 16,000); the distinct
    rows are 1,001.  The farthest partners run on them too."""
    rng = np.random.default_rng(3)
    S = rng.standard_normal((3000, 16)).astype(dtype)
    zero = np.sort(rng.choice(3000, 2000, replace=False))
    S[zero] = 0.0
    r = refgeo.knn(S, 4)
    if backend != "reference":  # the reference refines every pair of the rows it gets
        assert r.n_refined <= 100 * 1001
    check = np.concatenate([zero[:50], zero[-50:], rng.choice(3000, 100, replace=False)])
    _assert_knn_rows_exact(r, S, check, 4)
    assert r.indices[zero[0]].tolist() == zero[1:5].tolist()  # copies first, by index
    assert r.indices[zero[1]].tolist() == [zero[0], *zero[2:5]]
    seen = []
    real = rows._pair_run
    with pytest.MonkeyPatch.context() as mp:  # the farthest-partner kernel's rows
        mp.setattr(rows, "_pair_run", lambda info, A, *a: seen.append(A.shape[0]) or real(info, A, *a))
        fp = refgeo.farthest_partners(S)
    assert seen == [1001]
    D2 = _oracle_sq(S[check], S)
    D2[np.arange(check.size), check] = -np.inf
    np.testing.assert_array_equal(fp.indices[check], np.argmax(D2, axis=1))


@pytest.mark.parametrize("value", [0.0, -2.5])
def test_farthest_partners_of_one_repeated_row(backend, value, monkeypatch):
    """Every row alike (a head before training): every partner is at distance 0, the
    first other row (row 1 for row 0, row 0 for the others).  All 2,000 rows ran, and
    every pair tied and was refined (1.3e8 pairs, 1 s at 16,000 rows); now two do."""
    S = np.full((2000, 8), value)
    seen = []
    real = rows._pair_run
    monkeypatch.setattr(rows, "_pair_run", lambda info, A, *a: seen.append(A.shape[0]) or real(info, A, *a))
    fp = refgeo.farthest_partners(S)
    assert seen == [2]
    assert fp.indices.tolist() == [1] + [0] * 1999 and not fp.distances.any()


def test_hash_collisions_never_merge_distinct_rows(monkeypatch):
    """With every row hashed alike, the exact comparison alone tells the classes apart."""
    monkeypatch.setattr(_duplicates, "row_hashes", lambda S: np.zeros(len(S), dtype=np.uint64))
    rng = np.random.default_rng(1)
    S = rng.integers(-1, 2, size=(200, 3)).astype(np.float64)
    dup = _duplicates.duplicate_rows(S)
    _, first = np.unique(S, axis=0, return_index=True)
    assert dup.first.tolist() == sorted(first.tolist())
    D2 = _oracle_sq(S, S)
    r = refgeo.closest_pair(S)
    assert (r.value, r.i, r.j) == _oracle_extreme(S, False, D2)
    r = refgeo.row_diameter(S)
    assert (r.value, r.i, r.j) == _oracle_extreme(S, True, D2)


def _brute_force_classes(S):
    """``(first, pair)`` of :class:`refgeo._duplicates.DuplicateRows` by the definition."""
    V = len(S)
    rep = [next(i for i in range(j + 1) if np.all(S[i] == S[j])) for j in range(V)]
    first = [j for j in range(V) if rep[j] == j]
    pairs = [(rep[j], j) for j in range(V) if rep[j] != j]
    return (first, min(pairs)) if pairs else None


@settings(max_examples=200, deadline=None)
@given(S=clouds_with_copies(), weak=st.sampled_from(["zero", "positives", "first entry"]))
def test_weak_hashes_leave_the_classes_exact(S, weak):
    """Hashes that collide for some groups and not others: groups of one class (one
    comparison per row) and groups of several (sorted by their bytes) in one call."""
    hashes = {"zero": lambda A: np.zeros(len(A), dtype=np.uint64),
              "positives": lambda A: (A > 0).sum(axis=1).astype(np.uint64),
              "first entry": lambda A: (A[:, 0] > 0).astype(np.uint64)}[weak]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_duplicates, "row_hashes", hashes)
        dup = _duplicates.duplicate_rows(S)
    want = _brute_force_classes(S)
    if want is None:
        assert dup is None
    else:
        assert (dup.first.tolist(), dup.pair) == want
        np.testing.assert_array_equal(S[dup.first[dup.label]], S)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("kind", ["signs", "ternary", "powers of two"])
def test_rows_that_differ_in_sign_and_exponent_bits_hash_apart(kind, dtype):
    """Sign and exponent are a float's top bits; a hash that only carries bits upward
    (products with odd multipliers) gave 20,000 sign rows 2 hash values, and the exact
    comparison then took 9 s.  Binarized and ternary heads are such rows."""
    rng = np.random.default_rng(2)
    shape = (20_000, 64)
    S = {"signs": lambda: rng.choice([-1.0, 1.0], shape),
         "ternary": lambda: rng.integers(-1, 2, shape).astype(np.float64),
         "powers of two": lambda: 2.0 ** rng.integers(-3, 4, shape)}[kind]().astype(dtype)
    assert len(np.unique(S, axis=0)) == len(S)  # all distinct: the hashes should be too
    assert len(np.unique(_duplicates.row_hashes(S))) >= len(S) - 2


def test_distinct_rows_are_left_alone():
    assert _duplicates.duplicate_rows(np.eye(5)) is None
    assert _duplicates.duplicate_rows(np.array([[0.0], [-0.0]])).pair == (0, 1)
    assert _duplicates.duplicate_rows(np.array([[0.0], [1e-300]])) is None
