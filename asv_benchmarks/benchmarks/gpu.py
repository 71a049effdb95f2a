"""GPU benchmarks: the ``cupy`` backend (``refgeo._tiled`` on CuPy) and CUDA tensors.

Every class skips (``NotImplementedError`` in ``setup``) where CuPy or a CUDA device is
missing, which is the case in CI: these run by hand on a machine with a GPU
(docs/benchmarks.md, "GPU runs", says how and what one such run measured).

Baselines measured in the same process:

* the float32 GEMM roofline of the GPU: ``V^2 d`` flops (the symmetric computation, as
  in ``extreme_pairs.py``) divided by the best rate of ``cupy.matmul`` on an n x n
  float32 product in IEEE float32 (CuPy's default; the engine never uses TF32), rate
  and kernel time interleaved (``_common.roofline_fraction`` with a GPU rate);
* the ``cython`` backend on a host copy of the same rows (all the machine's cores),
  ``track_speedup_vs_cython``;
* for CUDA tensors: the same rows as a CuPy array (the DLPack hand-over costs nothing
  when the ratio is 1).

Data: Gaussian rows, and LM-head gradients with the structure of trained models (Zipf
prior, hidden states with a common component three times the noise;
``refgeo._lm_gradients.lm_gradient``), where most rows are tiny and point the same way.
Small sizes by default; ``REFGEO_BENCH_SIZE=realistic`` selects the LM-head sizes
(V = 50257, d = 768 for the extreme pairs; N = 50000, d = 768, k = 32 for k-NN).

Device memory: ``track_device_pool_mb`` runs the call with a fresh CuPy memory pool and
reports the bytes the pool holds afterwards (a pool keeps the blocks it handed out, so
this is the call's peak device allocation up to block rounding).  It is the partner of
every ``time_*`` here in place of asv's ``peakmem_*``, which measures the host process
only (and would cost one more process per parameter in a short hand run).
"""

import time

import numpy as np

from ._common import best_time, environment, realistic, records_runtime, refgeo, require_backend, rng, speed_ratio

try:
    from refgeo._lm_gradients import lm_gradient
except ImportError:  # older commits
    lm_gradient = None

DATA = ["gaussian", "lm_gradient"]
# float64 rows run a float64 GEMM on the GPU (the engine never filters them in float32
# there); at the LM-head sizes only float32, the dtype of real heads, keeps a hand run short
DTYPES = ["float32", "float64"] if not realistic() else ["float32"]


def _cupy():
    """CuPy with at least one CUDA device, or skip."""
    require_backend("cupy")
    try:
        import cupy
    except ImportError:  # pragma: no cover - available_backends said yes
        raise NotImplementedError("CuPy is not installed") from None
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise NotImplementedError("no CUDA device")
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        raise NotImplementedError(f"no usable CUDA device: {exc}") from None
    return cupy


def _rows(kind, V, d, dtype):
    """Host rows of the given kind (seeded)."""
    if kind == "gaussian":
        return rng(0).standard_normal((V, d)).astype(dtype)
    if lm_gradient is None:
        raise NotImplementedError("refgeo._lm_gradients is not available")
    return lm_gradient(V, d, n_tokens=1024, seed=0).astype(dtype)


def _synced(cp, fn):
    """``fn`` followed by a device synchronization (results are host scalars already,
    but k-NN returns device arrays: the time must include their kernels)."""

    def run():
        out = fn()
        cp.cuda.Device().synchronize()
        return out

    return run


def gpu_sgemm_rate(cp, n: int) -> float:
    """Best float32 GEMM rate of the GPU on an n x n product (flop/s), best of 3."""
    a = cp.asarray(rng(1).standard_normal((n, n)), dtype=cp.float32)
    b = cp.asarray(rng(2).standard_normal((n, n)), dtype=cp.float32)
    (a @ b).sum()  # cuBLAS handle and kernel selection outside the timing
    cp.cuda.Device().synchronize()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        a @ b
        cp.cuda.Device().synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best


def gpu_roofline_fraction(cp, flops: float, fn, rounds: int = 3, n: int = 8192) -> float:
    """``flops`` at the GPU's best float32 GEMM rate over the best time of ``fn``,
    GEMM rate and call interleaved over ``rounds`` rounds."""
    rate, t = 0.0, float("inf")
    for _ in range(rounds):
        rate = max(rate, gpu_sgemm_rate(cp, n))
        t = min(t, best_time(fn, 1))
    return flops / rate / t


def _device_pool_mb(cp, fn) -> float:
    """Bytes held by a fresh CuPy memory pool after ``fn`` (its peak, to block rounding)."""
    old = cp.get_default_memory_pool()
    pool = cp.cuda.MemoryPool()
    cp.cuda.set_allocator(pool.malloc)
    try:
        fn()
        cp.cuda.Device().synchronize()
        return pool.total_bytes() / 2**20
    finally:
        cp.cuda.set_allocator(old.malloc)
        pool.free_all_blocks()


@records_runtime(backend="cupy")
class GPUExtremePairs:
    """row_diameter and closest_pair of CuPy arrays on the GPU."""

    params = ([(4096, 256)] if not realistic() else [(50257, 768)], DTYPES, DATA)
    param_names = ["V_d", "dtype", "data"]
    timeout = 1200
    # one process per benchmark, up to 3 samples of one call: the GPU calls take
    # milliseconds to a second, and the cython baseline seconds at the realistic sizes
    rounds, repeat, number = 1, (1, 3, 20.0), 1

    def setup(self, V_d, dtype, data):
        self.cp = cp = _cupy()
        V, d = V_d
        self.host = _rows(data, V, d, dtype)
        self.S = cp.asarray(self.host)
        environment(dtype, "cupy")
        self._diameter()  # cuBLAS handles, kernel compilation and the memory pool warm

    def _diameter(self):
        return refgeo.row_diameter(self.S)

    def _closest(self):
        return refgeo.closest_pair(self.S)

    def time_row_diameter(self, V_d, dtype, data):
        self._diameter()

    def time_closest_pair(self, V_d, dtype, data):
        self._closest()

    def track_device_pool_mb(self, V_d, dtype, data):
        """Device bytes the row_diameter call allocated (fresh CuPy pool, MiB)."""
        return _device_pool_mb(self.cp, self._diameter)

    track_device_pool_mb.unit = "MiB"

    def track_sgemm_roofline_fraction(self, V_d, dtype, data):
        """(V^2 d flops / the GPU's float32 GEMM rate) over row_diameter time."""
        V, d = V_d
        return gpu_roofline_fraction(self.cp, V * V * d, self._diameter)

    track_sgemm_roofline_fraction.unit = "fraction"

    def track_speedup_vs_cython(self, V_d, dtype, data):
        """row_diameter of the host rows on the cython backend over the GPU time."""
        require_backend("cython")
        host = self.host

        def cpu():
            with refgeo.use_backend("cython"):
                return refgeo.row_diameter(host)

        gpu, ref = self._diameter(), cpu()
        if (gpu.value, gpu.i, gpu.j) != (ref.value, ref.i, ref.j):  # the same certified pair
            raise AssertionError(f"cupy {gpu} != cython {ref}")
        return speed_ratio(cpu, self._diameter)

    track_speedup_vs_cython.unit = "x"

    def track_refined_pairs(self, V_d, dtype, data):
        """Candidate pairs the certification refined in float64 on the GPU."""
        return self._diameter().n_refined

    track_refined_pairs.unit = "pairs"


@records_runtime(backend="cupy")
class GPUKNN:
    """knn of CuPy rows against themselves (self excluded)."""

    params = ([(4096, 256, 8)] if not realistic() else [(50000, 768, 32)], DTYPES, DATA)
    param_names = ["N_d_k", "dtype", "data"]
    timeout = 1800
    rounds, repeat, number = 1, (1, 3, 20.0), 1

    def setup(self, N_d_k, dtype, data):
        self.cp = cp = _cupy()
        N, d, k = N_d_k
        self.host = _rows(data, N, d, dtype)
        self.X = cp.asarray(self.host)
        self.k = k
        environment(dtype, "cupy")
        self._run = _synced(cp, lambda: refgeo.knn(self.X, self.k))
        self._run()

    def time_knn(self, N_d_k, dtype, data):
        self._run()

    def track_device_pool_mb(self, N_d_k, dtype, data):
        """Device bytes the knn call allocated (fresh CuPy pool, MiB)."""
        return _device_pool_mb(self.cp, self._run)

    track_device_pool_mb.unit = "MiB"

    def track_sgemm_roofline_fraction(self, N_d_k, dtype, data):
        """(N^2 d flops / the GPU's float32 GEMM rate) over knn time."""
        N, d, _ = N_d_k
        return gpu_roofline_fraction(self.cp, N * N * d, self._run)

    track_sgemm_roofline_fraction.unit = "fraction"

    def track_speedup_vs_cython(self, N_d_k, dtype, data):
        """knn of the host rows on the cython backend over the GPU time (same indices)."""
        require_backend("cython")
        host, k, cp = self.host, self.k, self.cp

        def cpu():
            with refgeo.use_backend("cython"):
                return refgeo.knn(host, k)

        got, want = self._run(), cpu()
        if not np.array_equal(cp.asnumpy(got.indices), want.indices):
            raise AssertionError("cupy and cython k-NN indices differ")
        return speed_ratio(cpu, self._run)

    track_speedup_vs_cython.unit = "x"


@records_runtime(dtype="float32", backend="cupy")
class CUDATensors:
    """CUDA torch tensors go to the GPU engine through DLPack (zero-copy)."""

    params = ([(4096, 256)] if not realistic() else [(50257, 768)],)  # one parameter, tuple-valued
    param_names = ["V_d"]
    rounds, repeat, number = 1, (1, 3, 20.0), 1

    def setup(self, V_d):
        cp = _cupy()
        try:
            import torch
        except ImportError:
            raise NotImplementedError("torch is not installed") from None
        if not torch.cuda.is_available():
            raise NotImplementedError("torch sees no CUDA device")
        V, d = V_d
        host = _rows("lm_gradient", V, d, "float32")
        self.T = torch.from_numpy(host).cuda()
        self.S = cp.asarray(host)
        environment("float32", "cupy")
        refgeo.row_diameter(self.T)

    def time_row_diameter_cuda_tensor(self, V_d):
        refgeo.row_diameter(self.T)

    def track_tensor_over_cupy(self, V_d):
        """row_diameter time of the CUDA tensor over that of the same CuPy array."""
        return speed_ratio(lambda: refgeo.row_diameter(self.T), lambda: refgeo.row_diameter(self.S), 3)

    track_tensor_over_cupy.unit = "x"
