"""CPU torch tensors against NumPy arrays on the compiled engine (same data, same process).

A CPU tensor is viewed zero-copy as a NumPy array and runs the same kernels, so each
``track_numpy_over_torch_*`` ratio (NumPy-input time over tensor-input time) should
stay at or above 1/1.1.  The sizes are those of the acceptance benchmarks
(``extreme_pairs.RowDiameter``, ``extreme_pairs.KNN``, ``hilbert.PdistLogits``): small
in CI, realistic with ``REFGEO_BENCH_SIZE=realistic``.  Skips without torch.
"""

from ._common import best_time, environment, realistic, records_runtime, refgeo, require_backend, rng


def _interleaved_ratio(numpy_call, torch_call, budget: float = 0.5) -> float:
    """Best NumPy-input time over best tensor-input time, the two timed alternately
    (so that a slow phase of a shared machine hits both), as many times as fit in
    about ``budget`` seconds per side (at least 3): short calls need many samples for
    their best time to settle."""
    numpy_call()
    once = best_time(torch_call, 1)  # also warms up: the first call pays for imports and threads
    repeat = max(3, min(200, int(budget / max(once, 1e-6))))
    t_np = t_torch = float("inf")
    for _ in range(repeat):
        t_np = min(t_np, best_time(numpy_call, 1))
        t_torch = min(t_torch, best_time(torch_call, 1))
    return t_np / t_torch


def _require_torch():
    try:
        import torch
    except ImportError:
        raise NotImplementedError("torch is not installed") from None
    return torch


@records_runtime(backend="cython")
class TorchInputs:
    """row_diameter, knn and pdist_hilbert on a float32 or float64 CPU tensor and its NumPy twin."""

    params = (["float64", "float32"],)
    param_names = ["dtype"]
    timeout = 3600

    def setup(self, dtype):
        torch = _require_torch()
        require_backend("cython")
        V, d = (8192, 512) if realistic() else (1024, 64)
        N, dk, self.k = (50000, 768, 32) if realistic() else (4000, 64, 8)
        n, Vz = (500, 50257) if realistic() else (60, 4096)
        self.S = rng(0).standard_normal((V, d)).astype(dtype)
        self.X = rng(1).standard_normal((N, dk)).astype(dtype)
        self.Z = (rng(2).standard_normal((n, Vz)) * 3).astype(dtype)
        # requires_grad, as an optimizer's tensors would be: viewed without a copy or a warning
        self.S_t = torch.from_numpy(self.S).requires_grad_(True)
        self.X_t = torch.from_numpy(self.X).requires_grad_(True)
        self.Z_t = torch.from_numpy(self.Z).requires_grad_(True)
        environment(dtype, "cython")

    def _run(self, fn, *args):
        with refgeo.use_backend("cython"):
            return fn(*args)

    def track_numpy_over_torch_row_diameter(self, dtype):
        """row_diameter: NumPy-input time over CPU-tensor time (target >= 1/1.1)."""
        return _interleaved_ratio(
            lambda: self._run(refgeo.row_diameter, self.S), lambda: self._run(refgeo.row_diameter, self.S_t)
        )

    track_numpy_over_torch_row_diameter.unit = "x"

    def track_numpy_over_torch_knn(self, dtype):
        """knn (X against X): NumPy-input time over CPU-tensor time (target >= 1/1.1)."""
        return _interleaved_ratio(
            lambda: self._run(refgeo.knn, self.X, self.k), lambda: self._run(refgeo.knn, self.X_t, self.k)
        )

    track_numpy_over_torch_knn.unit = "x"

    def track_numpy_over_torch_pdist_hilbert(self, dtype):
        """pdist_hilbert (logits): NumPy-input time over CPU-tensor time (target >= 1/1.1)."""
        return _interleaved_ratio(
            lambda: self._run(refgeo.pdist_hilbert, self.Z), lambda: self._run(refgeo.pdist_hilbert, self.Z_t)
        )

    track_numpy_over_torch_pdist_hilbert.unit = "x"

    def time_row_diameter_torch(self, dtype):
        self._run(refgeo.row_diameter, self.S_t)

    def peakmem_row_diameter_torch(self, dtype):
        self._run(refgeo.row_diameter, self.S_t)
