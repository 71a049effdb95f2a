"""Benchmarks for refgeo.tokenwise: local fits and the full decomposition (docs/theory/tokenwise.md).

The k-NN search is timed separately (``KNN``) and the fits receive precomputed
neighborhoods, so the fit cost is visible on its own; ``Decompose.time_end_to_end``
includes the search.
"""

import warnings

import numpy as np

from ._common import DTYPES, environment, hidden_states, realistic, records_runtime, refgeo, require_backend, rng

# (N, d, k): small for CI, realistic = the size of the documented acceptance numbers.
SIZES = [(400, 64, 16)] if not realistic() else [(20000, 768, 64)]
CLASSES = ["diagonal", "low_rank", "orthogonal", "full"]


def _panels(N, d, dtype):
    g = rng(0)
    X = g.standard_normal((N, d))
    Y = X + 0.3 * np.tanh(X @ (g.standard_normal((d, d)) / np.sqrt(d)))
    return X.astype(dtype), Y.astype(dtype)


def _kw(cls):
    return {"rank": 8} if cls == "low_rank" else {}


@records_runtime(backend="auto")
class FitLocalMaps:
    """fit_local_maps on precomputed neighborhoods, per class."""

    params = (SIZES, CLASSES, DTYPES)
    param_names = ["N_d_k", "cls", "dtype"]
    timeout = 1200

    def setup(self, N_d_k, cls, dtype):
        require_backend("reference")
        N, d, k = N_d_k
        if realistic() and cls in ("orthogonal", "full"):
            raise NotImplementedError("orthogonal/full are reference classes: small sizes only")
        self.X, self.Y = _panels(N, d, dtype)
        self.nbr = refgeo.knn(self.X, k)
        environment(dtype, "reference")

    def _run(self, cls):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return refgeo.fit_local_maps(self.X, self.Y, cls=cls, neighbors=self.nbr, **_kw(cls))

    def time_fit_local_maps(self, N_d_k, cls, dtype):
        self._run(cls)

    def peakmem_fit_local_maps(self, N_d_k, cls, dtype):
        self._run(cls)


# hidden states, k = 2d (an exactly linear layer is identified): small for CI; realistic 20,000 of R^64
HS_SIZES = [(2000, 32, 64)] if not realistic() else [(20000, 64, 128)]


@records_runtime(dtype="float32", backend="reference")
class FitHiddenStates:
    """fit_local_maps on hidden states shaped like a residual stream (``hidden_states``:
    a common component, Zipf token counts, near-copies of frequent tokens), whose
    neighbor panels are ill-conditioned: the full and low-rank fits solve those from
    their SVD, not from the Gram matrix (which squares the condition number).
    ``track_exact_layer_energy_fraction`` fits a layer that the class represents
    exactly: what is left of the update should be rounding (the Gram solve left 0.17
    of it on states with a common component 1e6 times their spread)."""

    params = (HS_SIZES, ["low_rank", "full"])
    param_names = ["N_d_k", "cls"]
    timeout = 1200

    def setup(self, N_d_k, cls):
        require_backend("reference")
        N, d, k = N_d_k
        self.X = hidden_states(N, d)
        g = rng(1)
        # a layer acting off the mean direction, of rank 8: in both classes (rank=8)
        u = self.X.mean(axis=0, dtype=np.float64)
        P = np.eye(d) - np.outer(u, u) / (u @ u)
        self.A = np.eye(d) + P @ g.standard_normal((d, 8)) @ g.standard_normal((8, d)) @ P / d
        X64 = self.X.astype(np.float64)
        self.Y = (X64 + 0.3 * np.tanh(X64 @ (g.standard_normal((d, d)) / np.sqrt(d)))).astype(np.float32)
        self.Y_exact = X64 @ self.A.T
        self.nbr = refgeo.knn(self.X, k)
        environment("float32", "reference")

    def _fit(self, Y, cls):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return refgeo.fit_local_maps(self.X.astype(np.float64) if Y is self.Y_exact else self.X, Y, cls=cls,
                                         neighbors=self.nbr, **_kw(cls))

    def time_fit_local_maps(self, N_d_k, cls):
        self._fit(self.Y, cls)

    def track_exact_layer_energy_fraction(self, N_d_k, cls):
        """Energy of the update left by the fit of a layer the class holds exactly."""
        fit = self._fit(self.Y_exact, cls)
        X64 = self.X.astype(np.float64)
        return float(np.sum((fit.fitted - self.Y_exact) ** 2) / np.sum((self.Y_exact - X64) ** 2))

    track_exact_layer_energy_fraction.unit = "fraction"


@records_runtime(backend="auto")
class Decompose:
    """decompose end to end (k-NN search included) for the acceptance classes."""

    params = (SIZES, ["diagonal", "low_rank"], DTYPES)
    param_names = ["N_d_k", "cls", "dtype"]
    timeout = 1800

    def setup(self, N_d_k, cls, dtype):
        require_backend("reference")
        self.X, self.Y = _panels(N_d_k[0], N_d_k[1], dtype)
        self.k = N_d_k[2]
        environment(dtype, "auto")

    def _run(self, cls):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return refgeo.decompose(self.X, self.Y, k=self.k, cls=cls, **_kw(cls))

    def time_end_to_end(self, N_d_k, cls, dtype):
        self._run(cls)

    def peakmem_end_to_end(self, N_d_k, cls, dtype):
        self._run(cls)

    def track_energy_fraction(self, N_d_k, cls, dtype):
        """Residual energy fraction (quality: how much of the update is not tokenwise)."""
        return self._run(cls).energy_fraction

    track_energy_fraction.unit = "fraction"


@records_runtime(backend="auto")
class FitProgress:
    """fit_local_maps with progress reports on against off (the overhead should be < 2%).

    ``"callable"`` passes a no-op callable (the throttled reports, without drawing);
    ``"off"`` is ``progress=False``.  Small chunks make the per-chunk cost visible.
    """

    params = (SIZES, ["off", "callable"])
    param_names = ["N_d_k", "progress"]
    timeout = 1200

    def setup(self, N_d_k, progress):
        require_backend("reference")
        N, d, k = N_d_k
        self.X, self.Y = _panels(N, d, np.float64)
        self.nbr = refgeo.knn(self.X, k)
        self.progress = (lambda info: None) if progress == "callable" else False
        environment("float64", "reference")

    def time_fit_local_maps(self, N_d_k, progress):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            refgeo.fit_local_maps(self.X, self.Y, cls="low_rank", rank=8, neighbors=self.nbr, chunk_size=64,
                                  progress=self.progress)


@records_runtime(backend="auto")
class KNN:
    """The k-NN search that decompose runs first (refgeo.knn, auto backend)."""

    params = (SIZES, DTYPES)
    param_names = ["N_d_k", "dtype"]
    timeout = 1800

    def setup(self, N_d_k, dtype):
        require_backend("reference")
        environment(dtype, "auto")
        self.X, _ = _panels(N_d_k[0], N_d_k[1], dtype)
        self.k = N_d_k[2]

    def time_knn(self, N_d_k, dtype):
        refgeo.knn(self.X, self.k)


@records_runtime(dtype="float64", backend="reference")
class Perturbation:
    """output_perturbation per token through a small causal toy model."""

    params = ([(8, 16, 64, 500)] if not realistic() else [(16, 128, 256, 50257)], ["all", "per_token"])
    param_names = ["B_T_d_V", "mode"]

    def setup(self, shape, mode):
        require_backend("reference")
        environment("float64", "reference")
        B, T, d, V = shape
        g = rng(2)
        self.W = g.standard_normal((d, V)).astype(np.float64) / np.sqrt(d)
        self.H = g.standard_normal((B, T, d))
        self.P = self.H + 0.1 * g.standard_normal((B, T, d))

    def _logits(self, H):
        c = np.cumsum(H, axis=-2) / np.arange(1, H.shape[-2] + 1)[:, None]
        return (c.reshape(-1, c.shape[-1]) @ self.W).reshape(c.shape[:-1] + (-1,))

    def time_output_perturbation(self, shape, mode):
        refgeo.output_perturbation(self._logits, self.H, self.P, mode=mode)
