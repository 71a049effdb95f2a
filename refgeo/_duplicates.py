"""Exact duplicate rows, found in O(V d) before an extreme-pair or k-NN kernel runs.

Why: the engines certify an extreme pair by refining, in float64 direct differences,
every pair whose filtered squared distance lies within the rounding bound of the
running extreme.  Identical rows defeat that filter: every pair of them ties.  20,000
zero rows among 30,000 made :func:`refgeo.closest_pair` refine 2e8 pairs (4.9 s, against
0.07 s for the diameter of the same rows), and two clusters of 15,000 identical rows
made :func:`refgeo.row_diameter` refine 2.25e8 (3.5 s).  Such rows are common in LM
heads: the embedding rows of tokens a tokenizer reserves but never trains, or a padding
row tied to zero.

Rows are hashed by the bits of ``row + 0.0`` (which turns ``-0.0`` into ``0.0``, so the
hash is a function of float equality, which for finite rows is distance zero), each row
that shares its hash is compared with the first such row (and groups of equal hash that
hold several classes are sorted by their bytes), and the kernel then runs on the first
occurrence of each class.  The tie rule survives the reduction: first occurrences keep
their order, so the lexicographically smallest pair among the distinct rows maps to the
smallest pair among all rows (a later occurrence never precedes its class's first).  A hash
collision of unequal rows costs a place in that sort and never merges them.

One caveat keeps the reduction exact: the kernels' distances are square roots of
float64 squared differences, and two distinct rows closer than about 2**-537 of the
largest entry have a squared difference that underflows to 0 (the documented
tiny-distance limit of :mod:`refgeo.rows`).  Such a pair ties with identical rows there,
and may precede them in the tie rule.  :func:`separated` checks that it cannot happen
(every nonzero entry at least 2**-400 of the largest); otherwise the rows run as they
are.

The k-NN kernel suffers the same way (a row's k-th distance ties with every copy of a
row, beyond any heap) and runs on the distinct rows too; :func:`expand_neighbors` turns
its answer back into rows.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

__all__ = ["DuplicateRows", "classes", "duplicate_rows", "equal_rows", "expand_neighbors", "hash_runs",
           "magnitudes", "row_hashes", "separated", "separated_by"]

# elements of S hashed per block: bounds the temporaries at a few MiB whatever V d is
_BLOCK_ELEMENTS = 1 << 18

# rows sorted at once where classes tie in a k-NN answer (_sort_tied): a few tens of MiB
_TIE_BLOCK_ROWS = 1 << 20

# fixed odd multipliers: the result never depends on them (equal hashes are verified),
# only the number of collisions does; fixed so that runs are reproducible in time too
_MULTIPLIERS = (np.random.default_rng(0x5EED).integers(0, 2**63, size=4096, dtype=np.uint64) * np.uint64(2)
                + np.uint64(1))


@dataclasses.dataclass(frozen=True)
class DuplicateRows:
    """Classes of identical rows of ``S`` (at least one class has two rows).

    Attributes
    ----------
    first : ndarray of int64
        The first row of each class, increasing: the distinct rows in their order.
    pair : tuple of int
        ``(i, j)``, the lexicographically smallest pair of identical rows: ``i`` the
        first row with a later copy, ``j`` its next copy.
    label : ndarray of int64
        The class of every row: ``S[i]`` equals ``S[first[label[i]]]``.
    """

    first: np.ndarray
    pair: tuple[int, int]
    label: np.ndarray


def row_hashes(S: np.ndarray) -> np.ndarray:
    """One uint64 per row: a wrapping linear hash of its entries' bits, folded first.

    Why the fold (``x ^ (x >> 32)``): a float's sign and exponent sit in its top bits,
    and a product with an odd multiplier only carries bits upward, so without it the
    bits of +-1 entries hashed to 2 values (the parity of the minus signs) and of
    {-1, 0, 1} to at most 4,096.  Folded, the sign bit lands at bit 31 and reaches the
    33 bits above it (20,000 random sign rows: no collision).  Collisions cost a sort,
    never a wrong class (:func:`duplicate_rows` compares the rows).
    """
    V, d = S.shape
    bits = np.uint64 if S.dtype.itemsize == 8 else np.uint32
    R = np.tile(_MULTIPLIERS, -(-d // _MULTIPLIERS.size))[:d]
    h = np.empty(V, dtype=np.uint64)
    step = max(1, _BLOCK_ELEMENTS // max(d, 1))
    zero = S.dtype.type(0)
    for s in range(0, V, step):
        X = np.ascontiguousarray(S[s : s + step] + zero).view(bits).astype(np.uint64)
        Z = X >> np.uint64(32)
        Z ^= X
        Z *= R
        h[s : s + step] = Z.sum(axis=1, dtype=np.uint64)
    return h


def duplicate_rows(S: np.ndarray) -> DuplicateRows | None:
    """The classes of identical rows of the finite float rows ``S``, or None if all differ.

    Time O(V d) to hash plus O(V log V) to sort the hashes, O(d) to compare each row
    that shares its hash with the first such row, and O(m d log m) to sort the m rows
    of hash groups that hold more than one class (collisions).

    Examples
    --------
    >>> import numpy as np
    >>> dup = duplicate_rows(np.array([[1.0, 0.0], [2.0, 0.0], [1.0, -0.0], [2.0, 0.0]]))
    >>> dup.first.tolist(), dup.pair
    ([0, 1], (0, 2))
    >>> duplicate_rows(np.eye(3)) is None
    True
    """
    V = S.shape[0]
    if V < 2:
        return None
    runs = hash_runs(row_hashes(S))
    if runs is None:
        return None
    rows, lead = runs
    return classes(V, rows, lead, equal_rows(S, rows, S, lead), lambda idx: S[idx])


def hash_runs(h: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """``(rows, lead)``: the rows whose hash in ``h`` (one per row) another row shares,
    and for each the first (smallest) row of that hash; None when all hashes differ.
    Time O(V log V)."""
    V = h.size
    order = np.argsort(h, kind="stable")  # equal hashes stay in increasing row order
    hs = h[order]
    same = hs[1:] == hs[:-1]
    if not same.any():
        return None
    # runs of equal hashes in the sorted order; lead[p]: the first row of p's run
    # (the smallest: the sort is stable), for the positions p in runs of two or more
    start = np.flatnonzero(np.concatenate(([True], ~same)))
    length = np.diff(np.append(start, V))
    pos = np.flatnonzero(np.repeat(length, length) > 1)
    return order[pos], order[np.repeat(start, length)[pos]]


def equal_rows(A: np.ndarray, a: np.ndarray, B: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``A[a[t]] == B[b[t]]`` row by row (``-0.0 == 0.0``), in blocks of pairs."""
    eq = np.empty(a.size, dtype=bool)
    step = max(1, _BLOCK_ELEMENTS // max(A.shape[1], 1))
    for q in range(0, a.size, step):
        eq[q : q + step] = np.all(A[a[q : q + step]] == B[b[q : q + step]], axis=1)
    return eq


def classes(V: int, rows: np.ndarray, lead: np.ndarray, eq: np.ndarray, take) -> DuplicateRows | None:
    """The classes of identical rows among ``V`` rows, from :func:`hash_runs`'
    ``(rows, lead)`` and ``eq``, whether each row equals its run's lead
    (:func:`equal_rows`).  ``take(idx)`` returns the rows ``idx`` (increasing) as a
    NumPy array; it is called only for the rows of runs that hold several classes
    (hash collisions).  None if all rows differ."""
    # one comparison with its run's lead per row (eq): a run of one class (the common
    # case, and one of 50,000 zero rows) is settled in O(n d)
    rep = np.arange(V)  # rep[i]: the first row identical to row i
    rep[rows[eq]] = lead[eq]
    # runs holding rows of several classes (hash collisions): their rows' bytes sorted,
    # O(m d log m) for m such rows however the hashes collide; after + 0.0, byte
    # equality is float equality for finite rows; return_index gives each class's
    # first occurrence, here its smallest row (the rows are taken in increasing order)
    mixed_run = np.zeros(V, dtype=bool)
    mixed_run[lead[~eq]] = True
    cand = np.sort(rows[mixed_run[lead]])
    if cand.size:
        C = np.ascontiguousarray(take(cand))
        C += C.dtype.type(0)
        keys = C.view(np.dtype((np.void, C.dtype.itemsize * C.shape[1]))).ravel()
        _, first_of, inverse = np.unique(keys, return_index=True, return_inverse=True)
        rep[cand] = cand[first_of[inverse.ravel()]]
    if np.all(rep == np.arange(V)):
        return None
    first = np.flatnonzero(rep == np.arange(V))
    copies = np.flatnonzero(rep != np.arange(V))  # every later copy, increasing
    # the smallest i with a copy is the smallest rep among the copies; j its first copy
    i = int(rep[copies].min())
    j = int(copies[rep[copies] == i][0])
    return DuplicateRows(first, (i, j), np.searchsorted(first, rep))


def separated(S: np.ndarray) -> bool:
    """Whether every two distinct rows of ``S`` have a nonzero float64 squared difference
    in the kernels (whatever power-of-two prescaling they apply).

    Sufficient condition, checked in O(V d): every nonzero ``|s_ik|`` is at least
    ``2**-400 max |S|``.  The prescaling leaves the largest entry at least 2**-64, so
    the nonzero entries are at least 2**-464; two distinct floats there differ by at
    least one ulp, 2**-516, whose square 2**-1032 is still a (subnormal) nonzero
    float64.  Always true for float32 rows.

    Examples
    --------
    >>> import numpy as np
    >>> separated(np.array([[1.0, 0.0], [1.0, 1e-3]])), separated(np.array([[1.0], [1e-170]]))
    (True, False)
    """
    return separated_by(*magnitudes(S))


def magnitudes(S: np.ndarray) -> tuple[float, float]:
    """``(max |s_ik|, min over the nonzero |s_ik|)`` (0 and inf when every entry is
    zero), in blocks of rows: temporaries of a few MiB whatever the size of ``S``."""
    largest, smallest = 0.0, math.inf
    step = max(1, _BLOCK_ELEMENTS // max(S.shape[1], 1))
    for s in range(0, S.shape[0], step):
        a = np.abs(S[s : s + step])
        nonzero = a[a > 0]
        if nonzero.size:
            largest, smallest = max(largest, float(nonzero.max())), min(smallest, float(nonzero.min()))
    return largest, smallest


def separated_by(largest: float, smallest_nonzero: float) -> bool:
    """:func:`separated` from the :func:`magnitudes` of the rows (of all their blocks)."""
    return smallest_nonzero == math.inf or smallest_nonzero >= math.ldexp(largest, -400)


def expand_neighbors(nbr: np.ndarray, dist: np.ndarray, label: np.ndarray, k: int,
                     sq_distances) -> tuple[np.ndarray, np.ndarray]:
    """The k nearest candidate rows of each query, from its nearest candidate classes.

    Why: with identical candidate rows the k-NN kernel runs on one row per class
    (:func:`refgeo.rows.knn`), and this turns its answer back into rows.  The rows in
    the tie rule's order (distance, then index) are the classes in the kernel's order
    (distance, then first row) with each class's rows in increasing order, except where
    classes tie: there their rows interleave by index.  The first ``k`` rows come from
    the first ``k`` classes of that order (each class ahead of a row puts its first row
    ahead of it), so ``k`` classes per query suffice.

    Parameters
    ----------
    nbr : ndarray of int64, shape (q, r)
        The candidate classes nearest each query, in the kernel's order (``r >= k``
        columns, or every class).
    dist : ndarray of float64, shape (q, r)
        Their distances.
    label : ndarray of int64, shape (n,)
        The class of each candidate row (:attr:`DuplicateRows.label`).
    k : int
        Rows per query, at most the rows of the classes in ``nbr[i]``.
    sq_distances : callable
        ``sq_distances(queries, classes)``, for two int64 arrays of one shape: the
        kernel's squared distances (float64, the refined values whose order the tie rule
        follows) from each query to the class beside it.  Called only for queries where
        classes with equal ``dist`` share a run (equal square roots of different squares
        included), to order them exactly.

    Returns
    -------
    indices, distances : ndarray of shape (q, k)
        Candidate rows in the tie rule's order, and their distances.

    Time O(q k log r), plus O(m log m) for each query with tied classes, ``m`` the rows
    that can reach its first ``k`` (about ``k``; :func:`_sort_tied`); memory a few MiB
    beyond the outputs.

    Examples
    --------
    >>> import numpy as np
    >>> label = np.array([0, 1, 0, 1, 2])  # rows 0, 2 and rows 1, 3 identical
    >>> idx, _ = expand_neighbors(np.array([[1, 0, 2]]), np.array([[1.0, 2.0, 3.0]]),
    ...                           label, 3, None)
    >>> idx.tolist()
    [[1, 3, 0]]
    """
    q, r = nbr.shape
    order = np.argsort(label, kind="stable")  # the rows of each class, increasing
    counts = np.bincount(label)
    starts = np.cumsum(counts) - counts
    indices = np.empty((q, k), dtype=np.int64)
    distances = np.empty((q, k), dtype=dist.dtype)
    pos = np.arange(k)
    step = max(1, _BLOCK_ELEMENTS // (r + k))
    for s in range(0, q, step):
        C, D = nbr[s : s + step], dist[s : s + step]
        b = np.arange(C.shape[0])[:, None]
        cnt = np.minimum(counts[C], k)  # a class gives at most k rows
        cum = np.cumsum(cnt, axis=1)
        # rank[b, p]: the class of output position p, by one sorted search over the
        # block's cumulative counts (rows kept apart by an offset beyond every count)
        off = b * (int(cum[:, -1].max()) + 1)
        rank = np.searchsorted((cum + off).ravel(), (pos + off).ravel(), side="right").reshape(C.shape[0], k)
        rank -= b * r
        taken = pos - (cum[b, rank] - cnt[b, rank])  # position within its class
        indices[s : s + step] = order[starts[C[b, rank]] + taken]
        distances[s : s + step] = D[b, rank]
        # classes at one distance interleave by index: only where a class used with a
        # second row is followed by one at its distance (used or not)
        used = np.arange(r - 1) <= rank[:, -1:]
        tied = np.flatnonzero(((D[:, 1:] == D[:, :-1]) & (counts[C[:, :-1]] > 1) & used).any(axis=1))
        if tied.size:
            _sort_tied(tied, C, D, rank[:, -1], s, k, order, starts, counts, sq_distances, indices, distances)
    return indices, distances


def _sort_tied(tied, C, D, last, s, k, order, starts, counts, sq_distances, indices, distances):
    """Rows ``s + tied`` of :func:`expand_neighbors`' outputs, sorted by exact squared
    distance, then index, over the rows that can be among the first ``k``.

    Those are, for a query, the rows of the classes up to the last one used (``last``)
    and the classes after it at its distance, and of the class at rank ``j`` only its
    first ``k - j`` rows (each of the ``j`` classes ahead puts a row ahead of all of
    its rows).  These are at least ``k`` rows, and about ``k`` unless many copies tie:
    one sort of all of them, query by query, in blocks of about a million rows.
    """
    r = C.shape[1]
    j = np.arange(r)
    # the classes each query needs: up to `last`, and the run at its distance after it
    D_t, last_t = D[tied], last[tied]
    beyond = j > last_t[:, None]
    at_last = D_t == D_t[np.arange(tied.size), last_t][:, None]
    stop = np.cumsum(beyond & ~at_last, axis=1) > 0  # from the first class past the run
    m = np.where(stop, 0, np.clip(k - j, 0, counts[C[tied]]))  # rows per (query, class)
    per_query = m.sum(axis=1)
    ends = np.cumsum(per_query)
    a = 0
    while a < tied.size:  # blocks of queries of about _TIE_BLOCK_ROWS rows, at least one query each
        b = max(a + 1, int(np.searchsorted(ends, (ends[a - 1] if a else 0) + _TIE_BLOCK_ROWS, side="right")))
        t, mt = tied[a:b], m[a:b]
        q_of, c_of = np.nonzero(mt)  # the (query, class) pairs with rows, row-major
        n_rows = mt[q_of, c_of]
        sq = np.asarray(sq_distances(s + t[q_of], C[t[q_of], c_of]), dtype=np.float64)
        first = np.repeat(np.cumsum(n_rows) - n_rows, n_rows)
        w = np.arange(first.size) - first  # position within its class
        q = np.repeat(q_of, n_rows)
        c = np.repeat(c_of, n_rows)
        rows = order[starts[C[t][q, c]] + w]
        keys = np.repeat(sq, n_rows)
        o = np.lexsort((rows, keys, q))  # by query, then squared distance, then index
        start = np.concatenate(([0], np.cumsum(per_query[a:b])[:-1]))
        pick = o[(start[:, None] + np.arange(k)).ravel()]
        indices[s + t] = rows[pick].reshape(t.size, k)
        distances[s + t] = D[t[:, None], c[pick].reshape(t.size, k)]
        a = b
