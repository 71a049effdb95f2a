"""Benchmarks for refgeo.lmo: projected/rescaled RowNorm and the exact diameter LMO.

The fixed case is a synthetic cross-entropy gradient G = (P - Y)^T H / n of a linear
head (rows are vocabulary rows and sum to zero).  ``track_gap`` records the certified
relative gap reached by ``diameter_lmo``, ``track_decrease_ratio`` the exact/RowNorm
decrease ratio (docs/theory/lmo.md reports about 1.27 on such gradients).
"""

import math

import numpy as np

from ._common import environment, realistic, records_runtime, refgeo, require_backend, rng


def ce_gradient(V, d, n_tokens, seed=0, scale=2.0):
    g = rng(seed)
    Hs = g.standard_normal((n_tokens, d))
    W = g.standard_normal((V, d)) * scale / math.sqrt(d)
    Z = Hs @ W.T
    Z -= Z.max(axis=1, keepdims=True)
    P = np.exp(Z)
    P /= P.sum(axis=1, keepdims=True)
    c = (P.cumsum(axis=1) > g.random((n_tokens, 1))).argmax(axis=1)
    P[np.arange(n_tokens), c] -= 1.0
    G = P.T @ Hs / n_tokens
    return G - G.mean(axis=0, keepdims=True)


_CASES = [(200, 16, 256)] if not realistic() else [(2000, 64, 1024)]


@records_runtime(dtype="float64", backend="auto")
class RowNormSteps:
    """projected_rownorm and rescaled_rownorm on a cross-entropy gradient."""

    params = (_CASES,)
    param_names = ["V_d_tokens"]

    def setup(self, case):
        require_backend("reference")
        V, d, n = case
        self.G = ce_gradient(V, d, n)
        environment("float64", "reference")

    def time_projected_rownorm(self, case):
        refgeo.projected_rownorm(self.G, eta=1.0)

    def peakmem_projected_rownorm(self, case):
        refgeo.projected_rownorm(self.G, eta=1.0)

    def time_rescaled_rownorm(self, case):
        refgeo.rescaled_rownorm(self.G, eta=1.0)

    def peakmem_rescaled_rownorm(self, case):
        refgeo.rescaled_rownorm(self.G, eta=1.0)

    def track_rescaled_gain(self, case):
        """Decrease of the rescaled step over RowNorm's (>= 1)."""
        G = self.G
        rn = -float(np.sum(G * refgeo.projected_rownorm(G, eta=1.0)))
        return -float(np.sum(G * refgeo.rescaled_rownorm(G, eta=1.0))) / rn

    track_rescaled_gain.unit = "x"


@records_runtime(dtype="float64", backend="auto")
class DiameterLMO:
    """Exact LMO with a certified gap on a small fixed cross-entropy gradient."""

    params = (_CASES, [1e-2, 1e-3])
    param_names = ["V_d_tokens", "rtol"]
    timeout = 600

    def setup(self, case, rtol):
        require_backend("reference")
        V, d, n = case
        self.G = ce_gradient(V, d, n)
        environment("float64", "reference")

    def _run(self, rtol):
        return refgeo.diameter_lmo(self.G, eta=1.0, rtol=rtol, max_time=300.0)

    def time_diameter_lmo(self, case, rtol):
        self._run(rtol)

    def peakmem_diameter_lmo(self, case, rtol):
        self._run(rtol)

    def track_gap(self, case, rtol):
        """Certified relative gap (upper - lower) / upper reached."""
        return self._run(rtol).gap

    track_gap.unit = "relative gap"

    def track_decrease_ratio(self, case, rtol):
        """Exact decrease over RowNorm's (1/2) sum ||g_i||."""
        res = self._run(rtol)
        return res.lower_bound / (0.5 * float(np.linalg.norm(self.G, axis=1).sum()))

    track_decrease_ratio.unit = "x"

    def track_working_pairs(self, case, rtol):
        """Pairs carrying flow in the returned solution."""
        return len(self._run(rtol).pairs)

    track_working_pairs.unit = "pairs"
