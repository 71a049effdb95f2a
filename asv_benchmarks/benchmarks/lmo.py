"""Benchmarks for refgeo.lmo: projected/rescaled RowNorm and the exact diameter LMO.

Two kinds of cross-entropy gradient G = (P - Y)^T H / n of a linear head (rows are
vocabulary rows and sum to zero), from ``refgeo._lm_gradients``:

- ``"lm"``: the structure of trained LM heads: Zipf(1.1) token frequencies, hidden
  states with a common component of norm 3 against unit noise, targets sampled from
  the model (most rows tiny and nearly collinear: the hard case for the exact LMO);
- ``"isotropic"``: a uniform prior and standard normal hidden states.

A third kind, ``"demo"`` (:class:`DiameterLMODemo`), is recorded from ``refgeo demo
--quick``'s training (the RowNorm head at steps 40 and 120, V = 2000, d = 32), stored
compressed in ``data/demo_gradients.npz`` and regenerated on purpose with
``tools/record_demo_gradients.py``.  Small runs use its 150 rows of largest norm,
re-centered, as the demo's LMO certificates do; realistic runs use all 2000 rows
(about 45 s per solve at rtol 1e-3, exact/RowNorm ratio about 1.22).

``track_gap`` records the certified relative gap reached by ``diameter_lmo``,
``track_decrease_ratio`` the exact/RowNorm decrease ratio (about 1.08 on ``"lm"`` at
V = 2000, 1.23 on ``"isotropic"``).  Realistic sizes (``REFGEO_BENCH_SIZE=realistic``):
V = 2000, d = 64 and V = 8000, d = 128 at rtol 1e-3, and the GPT-2-sized head
V = 50257, d = 768 at rtol 1e-2.
"""

import os
import time

import numpy as np

from ._common import environment, realistic, records_runtime, refgeo, require_backend

try:
    from refgeo._lm_gradients import isotropic_gradient, lm_gradient
except ImportError:  # older commits: setup skips
    isotropic_gradient = lm_gradient = None


def gradient(kind, V, d, n_tokens=1024, seed=0):
    if lm_gradient is None:
        raise NotImplementedError("refgeo._lm_gradients is not available")
    if kind == "lm":
        return lm_gradient(V, d, n_tokens=n_tokens, seed=seed)
    return isotropic_gradient(V, d, n_tokens=n_tokens, seed=seed)


_CASES = [(200, 16, 256)] if not realistic() else [(2000, 64, 1024), (8000, 128, 1024)]
_KINDS = ["lm", "isotropic"]


@records_runtime(dtype="float64", backend="auto")
class RowNormSteps:
    """projected_rownorm and rescaled_rownorm on a cross-entropy gradient."""

    params = (_CASES, _KINDS)
    param_names = ["V_d_tokens", "kind"]

    def setup(self, case, kind):
        require_backend("reference")
        V, d, n = case
        self.G = gradient(kind, V, d, n)
        environment("float64", "reference")

    def time_projected_rownorm(self, case, kind):
        refgeo.projected_rownorm(self.G, eta=1.0)

    def peakmem_projected_rownorm(self, case, kind):
        refgeo.projected_rownorm(self.G, eta=1.0)

    def time_rescaled_rownorm(self, case, kind):
        refgeo.rescaled_rownorm(self.G, eta=1.0)

    def peakmem_rescaled_rownorm(self, case, kind):
        refgeo.rescaled_rownorm(self.G, eta=1.0)

    def track_rescaled_gain(self, case, kind):
        """Decrease of the rescaled step over RowNorm's (>= 1)."""
        G = self.G
        rn = -float(np.sum(G * refgeo.projected_rownorm(G, eta=1.0)))
        return -float(np.sum(G * refgeo.rescaled_rownorm(G, eta=1.0))) / rn

    track_rescaled_gain.unit = "x"


class _LMOSolve:
    """One certified solve per setup (solves take seconds), its time and its gap: the
    part the LMO classes share.  ``params``: ``(V, d, n_tokens)`` cases, gradient
    kinds and rtols."""

    max_time = 300.0

    def setup(self, case, kind, rtol):
        require_backend("reference")
        V, d, n = case
        self.G = gradient(kind, V, d, n)
        environment("float64", "reference")
        self._result = None

    def _run(self, rtol):
        return refgeo.diameter_lmo(self.G, eta=1.0, rtol=rtol, max_time=self.max_time)

    def _cached(self, rtol):
        # the track_* quantities come from one solve per setup
        if self._result is None:
            self._result = self._run(rtol)
        return self._result

    def time_diameter_lmo(self, case, kind, rtol):
        self._run(rtol)

    def track_gap(self, case, kind, rtol):
        """Certified relative gap (upper - lower) / upper reached."""
        return self._cached(rtol).gap

    track_gap.unit = "relative gap"


@records_runtime(dtype="float64", backend="auto")
class DiameterLMO(_LMOSolve):
    """Exact LMO with a certified gap on LM-like and isotropic gradients."""

    params = (_CASES, _KINDS, [1e-2, 1e-3])
    param_names = ["V_d_tokens", "kind", "rtol"]
    timeout = 600

    def peakmem_diameter_lmo(self, case, kind, rtol):
        self._run(rtol)

    def track_decrease_ratio(self, case, kind, rtol):
        """Exact decrease over RowNorm's (1/2) sum ||g_i||."""
        res = self._cached(rtol)
        return res.lower_bound / (0.5 * float(np.linalg.norm(self.G, axis=1).sum()))

    track_decrease_ratio.unit = "x"

    def track_working_pairs(self, case, kind, rtol):
        """Pairs carrying flow in the returned solution."""
        return len(self._cached(rtol).pairs)

    track_working_pairs.unit = "pairs"


@records_runtime(dtype="float64", backend="auto")
class DiameterLMOGPT2Head:
    """The GPT-2-sized head (V = 50257, d = 768) at rtol 1e-2, LM-like gradient
    (realistic runs only: about 3 minutes, 2 GB)."""

    params = ([1e-2],)
    param_names = ["rtol"]
    timeout = 1800
    number = 1
    repeat = 1

    def setup(self, rtol):
        if not realistic():
            raise NotImplementedError("realistic size only (REFGEO_BENCH_SIZE=realistic)")
        require_backend("reference")
        self.G = gradient("lm", 50257, 768, 1024)
        environment("float64", "reference")

    def time_diameter_lmo(self, rtol):
        refgeo.diameter_lmo(self.G, eta=1.0, rtol=rtol, max_time=1700.0)

    def peakmem_diameter_lmo(self, rtol):
        refgeo.diameter_lmo(self.G, eta=1.0, rtol=rtol, max_time=1700.0)

    def track_decrease_ratio(self, rtol):
        """Exact decrease over RowNorm's (1/2) sum ||g_i||."""
        res = refgeo.diameter_lmo(self.G, eta=1.0, rtol=rtol, max_time=1700.0)
        return res.lower_bound / (0.5 * float(np.linalg.norm(self.G, axis=1).sum()))

    track_decrease_ratio.unit = "x"


_DEMO_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "demo_gradients.npz")
# small runs: the demo's own restriction (its LMO certificates use the lmo_rows = 150
# rows of largest norm at the quick size); realistic runs: the whole head
_DEMO_ROWS = 150 if not realistic() else None


def demo_gradient(step, rows=_DEMO_ROWS):
    """The recorded head gradient of ``refgeo demo --quick`` at ``step``, restricted to
    its ``rows`` rows of largest norm and re-centered (all rows when None)."""
    with np.load(_DEMO_FILE) as z:
        G = np.array(z[f"G_{step}"], dtype=np.float64)
    if rows is not None:
        keep = np.sort(np.argsort(-np.linalg.norm(G, axis=1), kind="stable")[:rows])
        G = G[keep]
    return G - G.mean(axis=0, keepdims=True)


@records_runtime(dtype="float64", backend="auto")
class DiameterLMODemo:
    """Exact LMO with a certified gap on gradients recorded from the demo's training."""

    params = ([40, 120], [1e-3])
    param_names = ["step", "rtol"]
    timeout = 600

    def setup(self, step, rtol):
        require_backend("reference")
        if not os.path.exists(_DEMO_FILE):
            raise NotImplementedError(f"{_DEMO_FILE} is missing (tools/record_demo_gradients.py)")
        self.G = demo_gradient(step)
        environment("float64", "reference")
        self._result = None

    def _run(self, rtol):
        return refgeo.diameter_lmo(self.G, eta=1.0, rtol=rtol, max_time=300.0)

    def _cached(self, rtol):
        if self._result is None:
            self._result = self._run(rtol)
        return self._result

    def time_diameter_lmo(self, step, rtol):
        self._run(rtol)

    def peakmem_diameter_lmo(self, step, rtol):
        self._run(rtol)

    def track_gap(self, step, rtol):
        """Certified relative gap (upper - lower) / upper reached."""
        return self._cached(rtol).gap

    track_gap.unit = "relative gap"

    def track_decrease_ratio(self, step, rtol):
        """Exact decrease over RowNorm's (1/2) sum ||g_i||."""
        res = self._cached(rtol)
        return res.lower_bound / (0.5 * float(np.linalg.norm(self.G, axis=1).sum()))

    track_decrease_ratio.unit = "x"


@records_runtime(dtype="float64", backend="auto")
class DiameterLMOTight(_LMOSolve):
    """The exact LMO as a correctness oracle: small gradients at tight tolerances, where
    users compare their own solvers against the certified value.  On ``"lm"`` gradients
    the first-order solvers crawl there (rtol 1e-10 at (40, 6): the ADMM stopped at a
    gap of 3.6e-8 after 30 s); ``track_converged`` is 1 when the certified gap reached
    ``rtol`` within ``max_time``."""

    params = ([(40, 6, 1024), (120, 8, 1024)], _KINDS, [1e-10])  # 1e-6 too in docs/benchmarks.md
    param_names = ["V_d_tokens", "kind", "rtol"]
    timeout = 300
    max_time = 60.0

    def track_converged(self, case, kind, rtol):
        """1 if the certified gap reached rtol within max_time, else 0."""
        return int(self._cached(rtol).converged)

    track_converged.unit = "converged"


@records_runtime(dtype="float64", backend="auto")
class DiameterLMOLowDim(DiameterLMOTight):
    """Gradients of few columns at a moderate tolerance: the shapes of users' own
    property tests.  The first-order solvers crawl there too (IRLS 15-20 s at
    isotropic (250, 4), rtol 1e-4), the barrier method's long steps of t left its
    central path in low dimension.  (d = 2 is the barrier method's weak case, stages
    that need up to 200 Newton steps, or do not center at all, where the first-order
    solver finishes: isotropic (350..500, 2) is not here, to keep CI's smoke run
    short; docs/benchmarks.md has those numbers.)  ``track_converged`` as in
    :class:`DiameterLMOTight`."""

    params = ([(250, 4, 1024)], _KINDS, [1e-4])


@records_runtime(dtype="float64", backend="auto")
class Budget:
    """How well ``diameter_lmo`` keeps ``max_time``: the call's wall time over
    ``max_time`` (at most 1 where the budget is kept; IRLS, which runs one reweighting
    and its certificate whatever is left, starts only where an estimate of that round
    fits: before, at (1400, 64) under 0.3 s, it started at 0.18 s and the call took
    0.67 s), and the certified gap reached within it."""

    params = ([(1400, 64, 0.3)] if not realistic() else [(8000, 128, 2.0), (50257, 768, 30.0)], _KINDS)
    param_names = ["V_d_maxtime", "kind"]
    timeout = 600

    def setup(self, case, kind):
        require_backend("reference")
        V, d, _ = case
        self.G = gradient(kind, V, d)
        environment("float64", "reference")

    def track_elapsed_over_max_time(self, case, kind):
        """Wall time of the call over max_time (<= 1: kept)."""
        t0 = time.perf_counter()
        refgeo.diameter_lmo(self.G, eta=1.0, max_time=case[2])
        return (time.perf_counter() - t0) / case[2]

    track_elapsed_over_max_time.unit = "x"

    def track_gap(self, case, kind):
        """Certified relative gap reached within max_time."""
        return refgeo.diameter_lmo(self.G, eta=1.0, max_time=case[2]).gap

    track_gap.unit = "relative gap"
