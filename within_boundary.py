# within*: on integer rows (GEMM exact in any order) the held set must equal exactly the
# set given by the documented test, with thresholds placed exactly on / just below a pair's lower end.
import numpy as np
from refgeo import _backend, _certify
K = _backend.extension()._knn
rng = np.random.default_rng(0)
cases = bad = 0
for it in range(3000):
    dt = [np.float32, np.float64][it % 2]
    n, m, d = int(rng.integers(1, 40)), int(rng.integers(1, 60)), int(rng.integers(1, 10))
    XA = rng.integers(-3, 4, (n, d)).astype(dt); XB = rng.integers(-3, 4, (m, d)).astype(dt)
    if rng.random() < 0.5: XB[: min(m, n)] = XA[: min(m, n)]
    nA = np.einsum("ij,ij->i", XA.astype(float), XA.astype(float)); nB = np.einsum("ij,ij->i", XB.astype(float), XB.astype(float))
    cp, eabs = _certify.rounding_bound(d, "float32" if dt == np.float32 else "float64")
    cl = _certify.lowered_key_bound(cp)
    if rng.random() < 0.3: eabs = float(rng.choice([0.0, 1e-3, 1.0]))
    G = XA.astype(float) @ XB.astype(float).T
    mB = np.multiply(nB, 1.0 - cl); a = (1.0 - cl) * nA
    LO = ((mB[None, :] - 2.0 * G) + a[:, None]) - eabs
    j = rng.integers(0, m, n)
    T = LO[np.arange(n), j].copy()
    below = rng.random(n) < 0.3
    T[below] = np.nextafter(T[below], -np.inf)
    T[rng.random(n) < 0.1] = np.inf
    sc = np.where(rng.random(n) < 0.5, rng.integers(-1, m, n), -1).astype(np.int64)
    cap = int(rng.integers(1, m + 2))
    counts = np.zeros(n, np.int64); cols = np.full((n, cap + 1), -7, np.int64)
    fn = K.within32 if dt == np.float32 else K.within64
    fn(XA, nA, XB, nB, T, sc, cl, eabs, int(rng.choice([1, 2, 3, 7, 64])), int(rng.integers(1, 5)), counts, cols)
    for i in range(n):
        exp = set(np.flatnonzero(LO[i] <= T[i]).tolist()) - {int(sc[i])}
        cases += 1
        if len(exp) <= cap:
            got = cols[i, : counts[i]].tolist()
            if counts[i] != len(exp) or set(got) != exp or len(got) != len(set(got)):
                bad += 1; print("MISMATCH", it, i, counts[i], sorted(exp), sorted(got)); 
        else:
            if counts[i] <= cap:
                bad += 1; print("NOT FLAGGED", it, i, counts[i], len(exp), cap)
print("rows checked", cases, "bad", bad)
