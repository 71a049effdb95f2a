"""Can a subset of a known binary code beat the constructions of ``refgeo.spread``?

Rows ``(-1)^c / sqrt(n)`` of a binary code of length ``n`` have inner products
``(n - 2 w) / n``, ``w`` the Hamming distance, so a subset whose inner products lie in a
window ``[lo, hi]`` has distance ratio ``rho^2 = (n - hi) / (n - lo)``.  Dropping one
extreme inner product of a large code would raise rho; this script bounds how many rows
such a subset can keep, for the two cases quoted in docs/tutorials/spreading.md ("What
stands in the way"):

* **d = 512**: the Gold code of length 511 (the dual of the double-error-correcting BCH
  code, 2^18 words; 2^19 with the complements; also extended to length 512), inner
  products {31, -1, -33}/511, rho = 0.9393.  Is there a subset of 32,768 rows with
  rho >= 0.945?
* **d = 64**: the second-order Reed-Muller code RM(2, 6), 2^22 words of length 64.  It
  holds every row of the Delsarte-Goethals and Kerdock codes of R^64 (with either sign),
  whose inner products {0, +-1/8, +-1/4} give rho = sqrt(3/5) = 0.7746.  Is there a
  subset of 50,000 rows with rho > 0.7746?

* **d = 64, any binary code**: Delsarte's linear programming bound of the Hamming scheme
  (Krawtchouk polynomials) for codes of length 64 whose distances lie in a window
  ``[lo, hi]`` with ``lo / hi > 3/5``, that is rho > 0.7746.  Which windows leave room for
  50,000 words?
* **d = 64, codes over q letters**, each letter a vertex of the regular simplex of
  R^(q - 1) (``n = 64 // (q - 1)`` letters): the same linear program in the q-ary
  Hamming scheme, and the volume estimate of how far a greedy choice of words of one
  weight gets.
* **d = 64, binary words of one weight** (rows on a cap of the cube): words of weight
  ``w`` whose supports pairwise share at most ``o`` positions have distances in
  ``[2 (w - o), 2 w]``, so rho^2 = (w - o) / w.  Johnson's bound on such constant-weight
  codes says which ``(w, o)`` leave room for 50,000 words.
* **d = 64, the Barnes-Wall lattice BW64**: its 9,694,080 minimal vectors are the next
  candidate after binary codes.  Their inner products are sums of the signs
  ``(-1)^q`` of a quadratic function ``q`` over a flat of F_2^6, scaled by a power of 2,
  and such sums are 0 or a power of 2 (Dickson), so the inner products (over the norm)
  lie in {0, +-1/8, +-1/4, +-1/2, +-1} (the script checks this on sampled rows).  For
  each window of those values with rho > 0.7746, Delsarte's linear programming bound on
  the sphere (Gegenbauer polynomials) and, for a window of s values, the absolute bound
  on s-distance sets cap the number of unit vectors of R^64 with inner products in it,
  whatever the vectors.

The first two codes are linear, so "no two rows at a difference of weight in W" makes the subset an
independent set of the Cayley graph of the code's group with connection set
``S = {c : wt(c) in W}``.  Its eigenvalues are the character sums
``sum_{s in S} (-1)^{<y, s>}``, one Walsh-Hadamard transform of the indicator of S over
the generator coordinates, and two bounds follow:

* Hoffman's ratio bound ``N (-lambda_min) / (lambda_max - lambda_min)``;
* Delsarte's linear programming bound.  The pair counts ``A(x) = #{(t, t') : t - t' = x}
  / |T|`` of a subset T have ``A(0) = 1``, ``A >= 0``, ``A = 0`` on S, a nonnegative
  Fourier transform and total ``|T|``.  Averaged over a group of code automorphisms they
  stay feasible and become constant on its orbits, so the linear program has one variable
  per orbit.  For RM(2, 6) the affine group AGL(6, 2) (``f -> f(Az + b)``) acts with the
  orbits "rank of the quadratic part, weight" (Dickson's classification: 11 orbits).

Every window with the required rho lies inside one of the maximal windows listed, so the
largest bound over them caps every such subset.

Usage::

    python tools/code_subset_bounds.py

About 2.5 minutes and 1 GB (the 2^22 words of RM(2, 6) and their eigenvalues; the
minimal vectors of BW64, 620 MB as int8).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
from scipy.optimize import linprog

from refgeo.codes import _Field, _fwht

_POPCOUNT = np.array([bin(i).count("1") for i in range(256)], dtype=np.int64)


def _all_words_weights(gens: np.ndarray) -> np.ndarray:
    """Weights of all 2^k sums of the k rows of ``gens`` (0/1); index bit j selects row j."""
    packed = np.packbits(gens.astype(np.uint8), axis=1)
    words = np.zeros((1 << len(gens), packed.shape[1]), dtype=np.uint8)
    for j, g in enumerate(packed):  # doubling: words[i + 2^j] = words[i] xor row j
        words[1 << j: 2 << j] = words[: 1 << j] ^ g
    return _POPCOUNT[words].sum(axis=1)


def gold_weights() -> np.ndarray:
    """Weights of the 2^18 Gold words Tr(a x + b x^3), x over the nonzero elements of GF(2^9)."""
    m = 9
    F = _Field(m)
    xs = np.arange(1, 2**m, dtype=np.int64)  # the nonzero field elements, as bit masks
    cubes = F.mul(F.mul(xs, xs), xs)
    basis = F.powers[:m]
    gens = np.concatenate([F.trace(F.mul(basis[:, None], xs[None, :])),
                           F.trace(F.mul(basis[:, None], cubes[None, :]))])
    return _all_words_weights(gens)


def reed_muller2(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Weights and ranks (of the alternating form) of the 2^(1 + n + n(n-1)/2) words of RM(2, n).

    Generators: 1, then z_1..z_n, then the products z_i z_j (i < j); the quadratic part of
    word i is its bits n + 1 and up.
    """
    Z = (np.arange(2**n)[:, None] >> np.arange(n)) & 1
    pairs = list(itertools.combinations(range(n), 2))
    gens = np.array([np.ones(2**n, dtype=np.int64)] + [Z[:, i] for i in range(n)]
                    + [Z[:, i] & Z[:, j] for i, j in pairs])
    weights = _all_words_weights(gens)
    q = np.arange(1 << len(pairs))
    B = np.zeros((len(q), n, n), dtype=np.int64)  # the alternating form of each quadratic part
    for t, (i, j) in enumerate(pairs):
        B[:, i, j] = B[:, j, i] = (q >> t) & 1
    kernel = ((np.einsum("qij,xj->qxi", B, Z) % 2).sum(axis=2) == 0).sum(axis=1)  # 2^(n - rank)
    rank_q = n - np.round(np.log2(kernel)).astype(np.int64)
    return weights, rank_q[np.arange(len(weights)) >> (1 + n)]


def affine_orbits(weights: np.ndarray, rank: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The AGL(n, 2) orbits of RM(2, n): ``(keys, orbit)``, key = 1000 rank + weight, orbit 0 = zero word."""
    keys, orbit = np.unique(rank * 1000 + weights, return_inverse=True)
    return keys, orbit


def maximal_windows(ips: list[int], n: int, rho2_min: float, strict: bool) -> list[tuple[int, int]]:
    """The maximal windows [lo, hi] of the inner products ``ips`` (x n) with rho^2 >= (or >) rho2_min."""
    ok = (lambda r: r > rho2_min) if strict else (lambda r: r >= rho2_min)
    wins = [(lo, hi) for hi in ips for lo in ips if lo <= hi and ok((n - hi) / (n - lo))]
    return [w for w in wins if not any(v != w and v[0] <= w[0] and w[1] <= v[1] for v in wins)]


def hoffman(weights: np.ndarray, bad: np.ndarray) -> int:
    """Hoffman's ratio bound on a subset with no difference in ``bad`` (a mask over the group)."""
    lam = _fwht(bad.astype(np.float64))
    lo, top = lam.min(), lam[0]
    return math.floor(len(weights) * (-lo) / (top - lo) + 1e-9)  # a count: round down


def delsarte(orbit: np.ndarray, allowed: np.ndarray) -> int:
    """Delsarte's LP bound; ``orbit[x]`` numbers the orbits (0 = the zero word), ``allowed`` per orbit."""
    n_orbits = int(orbit.max()) + 1
    sizes = np.bincount(orbit, minlength=n_orbits)
    lam = np.stack([np.round(_fwht((orbit == c).astype(np.float64))).astype(np.int64)
                    for c in range(n_orbits)], axis=1)
    rows = np.unique(lam, axis=0)  # one constraint per distinct eigenvalue row
    bounds = [(1, 1)] + [(0, None) if allowed[c] else (0, 0) for c in range(1, n_orbits)]
    res = linprog(-np.ones(n_orbits), A_ub=-rows / sizes, b_ub=np.zeros(len(rows)),
                  bounds=bounds, method="highs")
    if res.status != 0:
        raise RuntimeError(f"linprog: {res.message}")
    return math.floor(-res.fun + 1e-6)


def krawtchouk(n: int, q: int = 2) -> np.ndarray:
    """``K[k, x]``: the Krawtchouk polynomials of the Hamming scheme of length ``n`` over
    an alphabet of ``q`` letters.

    ``K_k(x) = sum_j (-1)^j (q - 1)^(k - j) C(x, j) C(n - x, k - j)``, exact integers (as
    floats for the LP).
    """
    return np.array([[sum((-1) ** j * (q - 1) ** (k - j) * math.comb(x, j) * math.comb(n - x, k - j)
                           for j in range(k + 1))
                      for x in range(n + 1)] for k in range(n + 1)], dtype=np.float64)


def binary_delsarte(n: int, lo: int, hi: int, q: int = 2) -> int:
    """Delsarte's LP bound on any code of length ``n`` over ``q`` letters (binary by
    default) whose distances lie in [lo, hi].

    The distance distribution ``A_i`` (``A_0 = 1``, ``A_i >= 0``, zero outside the window,
    at most the ``C(n, i) (q - 1)^i`` words at distance ``i``) has
    ``sum_i A_i K_k(i) >= 0`` for every ``k``; the code has ``sum_i A_i`` words.
    """
    idx = np.arange(lo, hi + 1)
    K = krawtchouk(n, q)[1:]
    A, b = -K[:, idx], K[:, 0]
    scale = np.abs(np.concatenate([A, b[:, None]], axis=1)).max(axis=1)  # entries reach C(n, n/2)
    res = linprog(-np.ones(len(idx)), A_ub=A / scale[:, None], b_ub=b / scale,
                  bounds=[(0, math.comb(n, i) * (q - 1) ** i) for i in idx], method="highs")
    if res.status != 0:
        raise RuntimeError(f"linprog: {res.message}")
    return math.floor(1 - res.fun + 1e-6)


def constant_weight_gv(n: int, q: int, w: int, lo: int) -> float:
    """Words of weight ``w`` over ``q`` letters (length ``n``) divided by those within
    distance ``lo - 1`` of one of them: the Gilbert-Varshamov floor of a greedy choice of
    words of weight ``w`` at distance at least ``lo`` (all their distances are at most
    ``2 w``).  Two such words whose supports share ``o`` positions, ``e`` of them with
    equal letters, are at distance ``2 (w - o) + (o - e)``."""
    near = sum(math.comb(w, o) * math.comb(n - w, w - o) * (q - 1) ** (w - o) * math.comb(o, e) * (q - 2) ** (o - e)
               for o in range(w + 1) for e in range(o + 1) if 2 * (w - o) + (o - e) < lo)
    return math.comb(n, w) * (q - 1) ** w / near


def johnson_bound(n: int, o: int, w: int) -> int:
    """Johnson's bound on words of weight ``w`` and length ``n`` whose supports pairwise
    share at most ``o`` positions (distance at least ``2 (w - o)``):
    ``floor(n / w * J(n - 1, o - 1, w - 1))``, with ``J(n, 0, w) = floor(n / w)``.
    A Steiner system S(o + 1, w, n) meets it."""
    if o >= w:
        return math.comb(n, w)
    if o == 0:
        return n // w
    return n * johnson_bound(n - 1, o - 1, w - 1) // w


def constant_weight_table(n: int = 64, V: int = 50_000) -> None:
    """Every weight ``w`` and overlap ``o`` (supports sharing 0 to ``o`` positions) with
    rho > 0.7746 whose Johnson bound reaches ``V`` words, with the share of the bound
    that ``V`` is and the volume estimate of a greedy choice."""
    print(f"\n### d = {n}: binary words of one weight (a cap) with rho > 0.7746\n")
    print("| weight w | shared positions <= o | rho | Johnson bound | needed share | greedy estimate |")
    print("|---|---|---|---|---|---|")
    rows = [(math.sqrt((w - o) / w), w, o) for w in range(2, n // 2 + 1) for o in range(w)
            if (w - o) / w > 0.6 and johnson_bound(n, o, w) >= V]
    for rho, w, o in sorted(rows, reverse=True):
        bound = johnson_bound(n, o, w)
        print(f"| {w} | {o} | {rho:.4f} | {bound:,} | {V / bound:.2f} | "
              f"{constant_weight_gv(n, 2, w, 2 * (w - o)):,.0f} |")
    print(f"\n{V:,} words are about half of each bound or more.  Steiner systems S(o + 1, w, {n}), "
          "which would meet it, fail the divisibility conditions for all these (w, o), and none with "
          "o + 1 >= 6 has been constructed (Keevash proved that they exist for large n, not how to "
          "build them).")


def gegenbauer(d: int, k_max: int, t: np.ndarray) -> np.ndarray:
    """``P[k, i]``: the Gegenbauer polynomials of S^(d-1) at ``t[i]``, normalized to ``P_k(1) = 1``.

    ``P_0 = 1``, ``P_1 = t``, ``P_(k+1) = ((2k + d - 2) t P_k - k P_(k-1)) / (k + d - 2)``:
    the three-term recurrence of the normalized polynomials, bounded by 1 on [-1, 1], so
    the recurrence is stable where the unnormalized ones (up to 1e40 at k = 80, d = 64) are not.
    """
    t = np.asarray(t, dtype=np.float64)
    P = np.empty((k_max + 1, t.size))
    P[0] = 1.0
    if k_max >= 1:
        P[1] = t
    for k in range(1, k_max):
        P[k + 1] = ((2 * k + d - 2) * t * P[k] - k * P[k - 1]) / (k + d - 2)
    return P


def spherical_delsarte(d: int, ips: list[float], k_max: int = 80) -> int:
    """Delsarte's LP bound on unit vectors of R^d whose pairwise inner products lie in ``ips``.

    The inner product distribution ``A_t`` (pairs at ``t`` per point) has
    ``1 + sum_t A_t P_k(t) >= 0`` for every ``k`` (the Gegenbauer polynomials are positive
    definite on the sphere), and the set has ``1 + sum_t A_t`` points.  ``ips`` is a finite
    set of values in [-1, 1) (include -1 to allow antipodal pairs).
    """
    t = np.array(sorted(set(float(v) for v in ips)))
    if t.size == 0 or t[0] < -1 or t[-1] >= 1:
        raise ValueError(f"ips must lie in [-1, 1), got {ips!r}")
    P = gegenbauer(d, k_max, t)[1:]
    res = linprog(-np.ones(t.size), A_ub=-P, b_ub=np.ones(k_max), bounds=[(0, None)] * t.size,
                  method="highs")
    if res.status != 0:
        raise RuntimeError(f"linprog: {res.message}")
    return math.floor(1 - res.fun + 1e-6)


def absolute_bound(d: int, s: int) -> int:
    """Delsarte, Goethals and Seidel's bound on an s-distance set of unit vectors in R^d.

    ``C(d + s - 1, s) + C(d + s - 2, s - 1)`` points, whatever the s inner products: the
    functions ``x -> prod_t (<x, y> - t)`` of the points y are independent polynomials of
    degree s on the sphere.  At d = 64 it is 2,144 for s = 2 and 47,840 for s = 3: no window
    holding three inner products or fewer has room for 50,000 points.
    """
    if s < 1:
        raise ValueError(f"s must be >= 1, got {s}")
    return math.comb(d + s - 1, s) + math.comb(d + s - 2, s - 1)


def _flats(m: int, k: int) -> list[tuple[int, np.ndarray]]:
    """The k-flats of F_2^m as ``(translate, basis)``, points as integers (bit j: coordinate j).

    Each k-dimensional subspace once, by its reduced row echelon basis (pivots ``P``, free
    bits right of each pivot outside ``P``); the translates run over the span of the unit
    vectors off the pivots, a complement, so every flat appears once.
    """
    out = []
    for P in itertools.combinations(range(m), k):
        free = [[c for c in range(p + 1, m) if c not in P] for p in P]
        n_free = sum(map(len, free))
        others = [c for c in range(m) if c not in P]
        for bits in range(1 << n_free):
            basis, used = [], 0
            for p, cols in zip(P, free):
                row = 1 << p
                for c in cols:
                    row |= ((bits >> used) & 1) << c
                    used += 1
                basis.append(row)
            for tb in range(1 << len(others)):
                t = sum(((tb >> i) & 1) << c for i, c in enumerate(others))
                out.append((t, np.array(basis, dtype=np.int64)))
    return out


def barnes_wall_minimal(m: int) -> np.ndarray:
    """The minimal vectors of the Barnes-Wall lattice BW_(2^m), m even, as int8 rows of norm 2^(m-1).

    BW_(2^m) = RM(1, m) + 2 RM(3, m) + ... + 2^(m/2-1) RM(m-1, m) + 2^(m/2) Z^(2^m)
    (Construction D).  A minimal vector is ``2^i (-1)^g`` on a flat of dimension
    ``m - 2i - 1`` (a minimum weight word of RM(2i + 1, m)) and zero elsewhere, ``g``
    quadratic on the flat (the sign changes that stay in the lattice), i = 0 .. m/2 - 1.
    m = 4 gives the 4,320 of BW16, m = 6 the 9,694,080 of BW64 (620 MB).
    """
    if m % 2 or m < 2:
        raise ValueError(f"m must be even and >= 2, got {m}")
    n, blocks = 1 << m, []
    for i in range(m // 2):
        k = m - 2 * i - 1
        Z = (np.arange(1 << k)[:, None] >> np.arange(k)) & 1
        mons = [np.ones(1 << k, dtype=np.int64)] + [Z[:, a] for a in range(k)]
        mons += [Z[:, a] & Z[:, b] for a, b in itertools.combinations(range(k), 2)]
        mons = np.array(mons)
        coef = (np.arange(1 << len(mons))[:, None] >> np.arange(len(mons))) & 1
        signs = (1 - 2 * ((coef @ mons) % 2)).astype(np.int8) * (1 << i)  # (2^|mons|, 2^k)
        for t, basis in _flats(m, k):
            pts = t ^ np.bitwise_xor.reduce(Z * basis, axis=1) if k else np.array([t])
            X = np.zeros((signs.shape[0], n), dtype=np.int8)
            X[:, pts] = signs
            blocks.append(X)
    return np.concatenate(blocks)


def distance_windows(n: int, rho2: float) -> list[tuple[int, int]]:
    """The maximal windows [lo, hi] of distances 1..n-1 with ``lo / hi > rho2``."""
    wins = []
    for lo in range(1, n):
        hi = max((h for h in range(lo, n) if lo / h > rho2), default=None)
        if hi is not None and (not wins or hi > wins[-1][1]):
            wins.append((lo, hi))
    return wins


def _ips(n: int, w: np.ndarray) -> list[int]:
    return sorted({int(n - 2 * v) for v in np.unique(w) if 0 < v < n})


def gold_table(rho_min: float = 0.945) -> None:
    w18 = gold_weights()
    w19 = np.concatenate([w18, 511 - w18])  # with the all-ones word: the complements
    codes = [("Gold, 2^18 words", 511, w18), ("Gold, 2^19 words", 511, w19),
             ("Gold extended, 2^19 words", 512, w19 + w19 % 2)]
    print(f"### d = 512: subsets of the Gold code with rho >= {rho_min}\n")
    print("| code | window (x n) | rho | largest subset (Hoffman) |\n|---|---|---|---|")
    for name, n, w in codes:
        for lo, hi in maximal_windows(_ips(n, w), n, rho_min**2, strict=False):
            bad = (w > 0) & ((n - 2 * w < lo) | (n - 2 * w > hi))  # complements: n - 2w = -n
            print(f"| {name} | [{lo}, {hi}] | {math.sqrt((n - hi) / (n - lo)):.4f} "
                  f"| {hoffman(w, bad):,} |")


def reed_muller_table() -> None:
    w, rank = reed_muller2(6)
    keys, orbit = affine_orbits(w, rank)
    print("\n### d = 64: subsets of RM(2, 6) (every Delsarte-Goethals row, either sign) "
          "with rho > 0.7746\n")
    print("orbits (rank, weight: size):",
          ", ".join(f"({k // 1000}, {k % 1000}: {s})" for k, s in zip(keys.tolist(), np.bincount(orbit))))
    print("\n| window (x 64) | rho | largest subset (Hoffman) | largest subset (Delsarte LP) |")
    print("|---|---|---|---|")
    for lo, hi in maximal_windows(_ips(64, w), 64, 0.6, strict=True):
        ip = 64 - 2 * (keys % 1000)
        allowed = (ip >= lo) & (ip <= hi)
        bad = (w > 0) & ~allowed[orbit]
        print(f"| [{lo}, {hi}] | {math.sqrt((64 - hi) / (64 - lo)):.4f} | {hoffman(w, bad):,} "
              f"| {delsarte(orbit, allowed):,} |")


def binary_table(n: int = 64, V: int = 50_000) -> None:
    print(f"\n### d = {n}: any binary code of length {n} (rows +-1/sqrt({n})) with rho > 0.7746\n")
    print("| distances | rho | largest code (Delsarte LP) | |\n|---|---|---|---|")
    for lo, hi in distance_windows(n, 0.6):
        bound = binary_delsarte(n, lo, hi)
        print(f"| [{lo}, {hi}] | {math.sqrt(lo / hi):.4f} | {bound:,} "
              f"| {'open' if bound >= V else f'below {V:,}'} |")


def qary_table(d: int = 64, V: int = 50_000, n_best: int = 3) -> None:
    """Codes over ``q`` letters, each coordinate a regular simplex of R^(q - 1).

    A letter becomes a vertex of the regular simplex (``q`` unit vectors with inner
    products ``-1/(q - 1)``), so a word of length ``n = d // (q - 1)`` is a vector of
    R^d and two words at Hamming distance ``w`` have inner product
    ``1 - q w / ((q - 1) n)`` (over the norm): ``rho^2 = lo / hi`` for distances in
    ``[lo, hi]``, as for binary codes (``q = 2``).  For each ``q`` the windows with the
    largest linear programming bound, and the largest volume estimate of
    :func:`constant_weight_gv` over the weights (a floor for a greedy choice; a random
    greedy run over the 39,680 ternary words of weight 3, distances [4, 6], kept 282).
    """
    print(f"\n### d = {d}: codes over q letters, each letter a simplex vertex, with rho > 0.7746\n")
    print("| q | length | best windows (Delsarte LP) | constant weight w, window: greedy estimate |")
    print("|---|---|---|---|")
    for q in (3, 4, 5, 7, 8, 9, 17):
        n = d // (q - 1)
        wins = sorted(((binary_delsarte(n, lo, hi, q), lo, hi) for lo, hi in distance_windows(n, 0.6)),
                      reverse=True)
        best = ", ".join(f"[{lo}, {hi}] ({math.sqrt(lo / hi):.4f}): {b:,}" for b, lo, hi in wins[:n_best])
        gv = max((constant_weight_gv(n, q, w, lo), w, lo)
                 for w in range(1, (n + 1) // 2 + 1)
                 for lo in [min((x for x in range(1, 2 * w + 1) if x / (2 * w) > 0.6), default=2 * w + 1)]
                 if lo <= 2 * w)
        print(f"| {q} | {n} | {best} | w = {gv[1]}, [{gv[2]}, {2 * gv[1]}]: {gv[0]:,.0f} |")
    print(f"\n{V:,} words are needed; 'open' windows are those whose LP bound reaches it.")


def barnes_wall_table(V: int = 50_000, n_sample: int = 64) -> None:
    X = barnes_wall_minimal(6)
    rng = np.random.default_rng(0)
    ips = set()
    # the three shapes, in the order built: +-1 on 32 coordinates, +-2 on 8, +-4 on 2
    for lo, hi in ((0, 8_257_536), (8_257_536, 9_686_016), (9_686_016, len(X))):
        R = X[rng.integers(lo, hi, n_sample)].astype(np.float32)
        for i0 in range(0, len(X), 1 << 20):
            ips |= set(np.unique(R @ X[i0 : i0 + (1 << 20)].astype(np.float32).T).tolist())
    ips2 = sorted(int(2 * v) for v in ips if v != 32)  # x 64: inner products over the norm 32
    print(f"\n### d = 64: the {len(X):,} minimal vectors of BW64 with rho > 0.7746\n")
    print("inner products x 64 (sampled rows against all):", ips2)
    print("\n| window (x 64) | rho | spherical LP | s-distance bound | |")
    print("|---|---|---|---|---|")
    for lo, hi in maximal_windows(ips2, 64, 0.6, strict=True):
        vals = [v / 64 for v in ips2 if lo <= v <= hi]
        lp, ab = spherical_delsarte(64, vals), absolute_bound(64, len(vals))
        print(f"| [{lo}, {hi}] | {math.sqrt((64 - hi) / (64 - lo)):.4f} | {lp:,} | {ab:,} "
              f"| {'open' if min(lp, ab) >= V else f'below {V:,}'} |")


if __name__ == "__main__":
    gold_table()
    reed_muller_table()
    binary_table()
    qary_table()
    constant_weight_table()
    barnes_wall_table()
