"""CPU torch tensors against NumPy arrays on the compiled engine (same data, same process).

A CPU tensor is viewed zero-copy as a NumPy array and runs the same kernels, so each
``track_numpy_over_torch_*`` ratio (NumPy-input time over tensor-input time) should
stay at or above 1/1.1.  The sizes are those of the acceptance benchmarks
(``extreme_pairs.RowDiameter``, ``extreme_pairs.KNN``, ``hilbert.PdistLogits``): small
in CI, realistic with ``REFGEO_BENCH_SIZE=realistic``.  Skips without torch.
"""

from ._common import best_time, environment, realistic, records_runtime, refgeo, require_backend, rng, speed_ratio

try:  # imported with the module: asv's forkserver (used in CI) then imports torch once
    import torch as _torch
except ImportError:  # setup skips
    _torch = None


def _interleaved_ratio(numpy_call, torch_call, budget: float = 0.5) -> float:
    """Best NumPy-input time over best tensor-input time, the two timed alternately
    (so that a slow phase of a shared machine hits both), as many times as fit in
    about ``budget`` seconds per side (at least 3): short calls need many samples for
    their best time to settle."""
    numpy_call()
    once = best_time(torch_call, 1)  # also warms up: the first call pays for imports and threads
    repeat = max(3, min(200, int(budget / max(once, 1e-6))))
    return speed_ratio(numpy_call, torch_call, repeat)


def _require_torch():
    if _torch is None:
        raise NotImplementedError("torch is not installed")
    return _torch


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
        N, dk, self.k = (50000, 768, 32) if realistic() else (2000, 64, 8)
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


def _tutorial_setup(torch):
    """The corpus and frozen body of docs/tutorials/torch-rownorm.md: the 511 most
    frequent tokens of Python's own help text (Zipf frequencies) and hidden states
    ``tanh(.) + 1`` with a large common component."""
    import collections
    import re

    from pydoc_data.topics import topics

    tokens = re.findall(r"[a-z]+|[^\sa-z]", " ".join(topics[k] for k in sorted(topics)).lower())
    V, d, ctx, batch = 512, 64, 3, 256
    counts = collections.Counter(tokens)
    vocab = ["<unk>"] + sorted(counts, key=lambda w: (-counts[w], w))[: V - 1]
    index = {w: i for i, w in enumerate(vocab)}
    ids = torch.tensor([index.get(w, 0) for w in tokens])
    torch.manual_seed(0)
    embed = torch.nn.Embedding(V, d).requires_grad_(False)
    mix = torch.nn.Linear(ctx * d, d).requires_grad_(False)

    def hidden(starts):
        windows = ids[starts[:, None] + torch.arange(ctx)]
        return torch.tanh(mix(embed(windows).reshape(len(starts), -1))) + 1.0

    return ids, hidden, V, d, ctx, batch


@records_runtime
class HeadStepMonitorOverhead:
    """The tutorial's training loop with ``refgeo.torch.HeadStepMonitor(every=10)`` on
    and off: ``track_monitor_cost`` is the on/off time ratio (target <= 1.5), the median
    over alternating pairs of 100-step runs (so that a slow phase of a shared machine
    hits both sides)."""

    timeout = 600

    def setup(self):
        self.torch = _require_torch()
        require_backend("cython")
        import refgeo.torch  # noqa: F401  (the adapter, imported as a user would)

        self.ids, self.hidden, self.V, self.d, self.ctx, self.batch = _tutorial_setup(self.torch)
        self.panel = self.hidden(self.torch.arange(256))
        W = self.torch.nn.Parameter(self.torch.zeros(self.V, self.d))
        self._mon = refgeo.torch.HeadStepMonitor(refgeo.torch.RowNorm([W], lr=0.05), self.panel)
        self._S = self.torch.randn(self.V, self.d, generator=self.torch.Generator().manual_seed(2))
        environment("float32", "cython")

    def _loop(self, monitor, steps=100):
        torch = self.torch
        torch.manual_seed(1)
        head = torch.nn.Linear(self.d, self.V, bias=False)
        opt = refgeo.torch.RowNorm([head.weight], lr=0.05)
        mon = refgeo.torch.HeadStepMonitor(opt, self.panel, every=10) if monitor else None
        import time

        t0 = time.perf_counter()
        for _ in range(steps):
            starts = torch.randint(0, len(self.ids) - self.ctx - 1, (self.batch,))
            logits = head(self.hidden(starts))
            loss = torch.nn.functional.cross_entropy(logits, self.ids[starts + self.ctx])
            opt.zero_grad()
            loss.backward()
            opt.step()
        elapsed = time.perf_counter() - t0
        if mon is not None and len(mon.records) != steps // 10:
            raise RuntimeError(f"the monitor recorded {len(mon.records)} steps, not {steps // 10}")
        return elapsed

    def track_monitor_cost(self):
        """Loop time with the monitor every 10 steps over the time without it (target <= 1.5)."""
        import statistics

        self._loop(True, 20)
        self._loop(False, 20)
        ratios = []
        for _ in range(7):
            off = self._loop(False)
            on = self._loop(True)
            ratios.append(on / off)
        return statistics.median(ratios)

    track_monitor_cost.unit = "x"

    def time_record(self):
        """One recorded step of the tutorial's head (512 x 64) over the 256-state panel."""
        self._mon.record(self._S, step=1)
