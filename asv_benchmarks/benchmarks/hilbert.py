"""Benchmarks for refgeo.hilbert: pairwise Hilbert distances of logits (the tropical kernel)."""

import numpy as np

from ._common import BACKENDS, DTYPES, best_time, environment, realistic, refgeo, require_backend, rng


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
        self._run()

    def peakmem_pdist_hilbert(self, n_V, dtype, backend):
        self._run()

    def track_speedup_vs_numpy_loop(self, n_V, dtype, backend):
        """Speed ratio against the plain NumPy row loop, measured in the same process."""
        Z = self.Z

        def numpy_loop():
            for i in range(Z.shape[0]):
                D = Z[i + 1 :] - Z[i]
                D.max(1) - D.min(1)

        return best_time(numpy_loop, 1) / best_time(self._run, 2)

    track_speedup_vs_numpy_loop.unit = "x"


class CdistLogits:
    params = ([(40, 50, 4096)] if not realistic() else [(256, 256, 50257)], DTYPES, BACKENDS)
    param_names = ["nA_nB_V", "dtype", "backend"]

    def setup(self, shape, dtype, backend):
        require_backend(backend)
        nA, nB, V = shape
        g = rng(1)
        self.A = g.standard_normal((nA, V)).astype(dtype)
        self.B = g.standard_normal((nB, V)).astype(dtype)
        self.backend = backend
        environment(dtype, backend)

    def time_cdist_hilbert(self, shape, dtype, backend):
        with refgeo.use_backend(self.backend):
            refgeo.cdist_hilbert(self.A, self.B)

    def peakmem_cdist_hilbert(self, shape, dtype, backend):
        with refgeo.use_backend(self.backend):
            refgeo.cdist_hilbert(self.A, self.B)
