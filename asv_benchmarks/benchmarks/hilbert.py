"""Benchmarks for refgeo.hilbert: pairwise Hilbert distances of logits (the tropical kernel).

Baselines measured in the same process: the plain NumPy row loop (one ``max - min`` of
the difference per pair of rows) and SciPy's ``pdist(metric="chebyshev")``, a max-|x - y|
reduction of the same shape and cost class (SciPy has no Hilbert metric).
"""

import numpy as np

from ._common import (
    BACKENDS,
    DTYPES,
    environment,
    realistic,
    refgeo,
    require_backend,
    records_runtime,
    rng,
    speed_ratio,
)


def _numpy_loop(Z):
    """The baseline loop: for each row, max minus min of the differences to later rows."""
    out = []
    for i in range(Z.shape[0]):
        D = Z[i + 1 :] - Z[i]
        out.append(D.max(1) - D.min(1))
    return out


@records_runtime
class PdistLogits:
    """pdist_hilbert on (n, V) logits."""

    params = ([(60, 4096)] if not realistic() else [(500, 50257)], DTYPES, BACKENDS)
    param_names = ["n_V", "dtype", "backend"]
    timeout = 600

    def setup(self, n_V, dtype, backend):
        require_backend(backend)
        n, V = n_V
        self.Z = rng(0).standard_normal((n, V)).astype(dtype) * 3
        self.backend = backend
        environment(dtype, backend)

    def _run(self):
        with refgeo.use_backend(self.backend):
            return refgeo.pdist_hilbert(self.Z)

    def time_pdist_hilbert(self, n_V, dtype, backend):
        """All pairs of rows, condensed form."""
        self._run()

    def peakmem_pdist_hilbert(self, n_V, dtype, backend):
        self._run()

    def track_speedup_vs_numpy_loop(self, n_V, dtype, backend):
        """Speed ratio against the plain NumPy row loop, measured in the same process."""
        return speed_ratio(lambda: _numpy_loop(self.Z), self._run)

    track_speedup_vs_numpy_loop.unit = "x"

    def track_speedup_vs_scipy_chebyshev(self, n_V, dtype, backend):
        """Speed ratio against scipy pdist(metric="chebyshev") (same reduction shape)."""
        from scipy.spatial.distance import pdist

        Z = self.Z
        return speed_ratio(lambda: pdist(Z, metric="chebyshev"), self._run)

    track_speedup_vs_scipy_chebyshev.unit = "x"

    def track_max_abs_diff_vs_reference(self, n_V, dtype, backend):
        """Largest |result - reference backend| (0 in float64: both are exact)."""
        with refgeo.use_backend("reference"):
            ref = refgeo.pdist_hilbert(self.Z)
        return float(np.max(np.abs(np.asarray(self._run(), dtype=np.float64) - ref)))

    track_max_abs_diff_vs_reference.unit = "logit units"


@records_runtime
class CdistLogits:
    """cdist_hilbert between two sets of logits."""

    params = ([(40, 50, 4096)] if not realistic() else [(256, 256, 50257)], DTYPES, BACKENDS)
    param_names = ["nA_nB_V", "dtype", "backend"]
    timeout = 600

    def setup(self, shape, dtype, backend):
        require_backend(backend)
        nA, nB, V = shape
        g = rng(1)
        self.A = g.standard_normal((nA, V)).astype(dtype)
        self.B = g.standard_normal((nB, V)).astype(dtype)
        self.backend = backend
        environment(dtype, backend)

    def _run(self):
        with refgeo.use_backend(self.backend):
            return refgeo.cdist_hilbert(self.A, self.B)

    def time_cdist_hilbert(self, shape, dtype, backend):
        self._run()

    def peakmem_cdist_hilbert(self, shape, dtype, backend):
        self._run()

    def track_speedup_vs_scipy_chebyshev(self, shape, dtype, backend):
        """Speed ratio against scipy cdist(metric="chebyshev") (same reduction shape)."""
        from scipy.spatial.distance import cdist

        return speed_ratio(lambda: cdist(self.A, self.B, metric="chebyshev"), self._run)

    track_speedup_vs_scipy_chebyshev.unit = "x"


def _softmax_rows(Z):
    """Probability rows of an LM's output distribution: softmax of Zipf-shaped logits
    (a log-frequency prior plus noise), whose few largest entries sit near the top."""
    V = Z.shape[1]
    Z = Z - np.log(np.arange(1, V + 1))[None, :]
    P = np.exp(Z - Z.max(axis=1, keepdims=True))
    return P / P.sum(axis=1, keepdims=True)


@records_runtime(dtype="float64", backend="auto")
class HilbertProbabilities:
    """hilbert_distance (elementwise) and pdist_hilbert(kind="probabilities") on softmax
    rows of LM vocabularies: each entry's log relative to its row's largest (its scale
    split off exactly, ``log1p`` near the largest).  Baseline: the plain NumPy formula
    ``max(log p - log q) - min(log p - log q)``, measured in the same process (faster,
    less accurate: its logs carry the rounding of their size)."""

    params = ([(64, 4096)] if not realistic() else [(200, 50257)],)
    param_names = ["n_V"]
    timeout = 600

    def setup(self, n_V):
        n, V = n_V
        self.P = _softmax_rows(rng(2).standard_normal((n, V)) * 2.0)
        self.Q = np.roll(self.P, 1, axis=0)
        environment("float64", "auto")

    def time_hilbert_distance(self, n_V):
        refgeo.hilbert_distance(self.P, self.Q)

    def track_cost_over_plain_logs(self, n_V):
        """Time of hilbert_distance over the time of the plain NumPy log-ratio formula
        (the price of the exact scale split and the log1p near the largest entries)."""
        def plain():
            r = np.log(self.P) - np.log(self.Q)
            return r.max(axis=1) - r.min(axis=1)

        return speed_ratio(lambda: refgeo.hilbert_distance(self.P, self.Q), plain)

    track_cost_over_plain_logs.unit = "x"

    def time_pdist_probabilities(self, n_V):
        refgeo.pdist_hilbert(self.P[: max(2, self.P.shape[0] // 2)], kind="probabilities")
