"""Benchmarks for the Dask backend of the pairwise engine, against the single-process engine.

In the same run: a ``distributed.LocalCluster`` of 2 single-threaded worker processes
(loopback only) running the task graph on rows that live on the workers, and the
single-process compiled engine with 2 threads on the same rows as one NumPy array.

* ``track_throughput_ratio``: single-process time over Dask time (best of 3 each,
  same process, same data); the target is at least 0.8;
* ``track_peak_worker_rss``: the largest peak resident set of a worker process (MiB),
  after the run;
* ``track_bytes_per_task``, ``track_overhead_per_task``, ``track_gflop_per_task``: the
  per-task numbers of the scaling model in ``docs/cluster.md`` (bytes the workers
  received per block-pair task on a first call, wall time per task not spent computing,
  and the GEMM work of one block-pair task).

Small sizes run in CI; ``REFGEO_BENCH_SIZE=realistic`` selects ``row_diameter`` at
V = 65536, d = 1024 float32 and ``knn`` at N = 100000, d = 768, k = 32 (float32, in row
chunks of 4096 and of 8192).
"""

import logging
import os
import time

import numpy as np

from ._common import best_time, environment, realistic, records_runtime, refgeo, require_backend

# The cluster's own logs stay quiet (the scheduler and nannies run in this process, the
# workers in child processes that read the environment when they import distributed):
# on a loaded machine a shutdown race (a heartbeat from a worker the scheduler already
# dropped) logs a traceback at ERROR, which the CI check of the asv log reads as a
# failure.  A failing benchmark still raises, and asv reports it.
os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "critical")
logging.getLogger("distributed").setLevel(logging.CRITICAL)

try:
    import dask
    import dask.array as da
    import distributed
except ImportError:  # the `dask` extra is not installed: setup skips
    dask = da = distributed = None

# (operation, rows, d, k, rows per task block)
if realistic():
    # knn in row chunks of 4096 and of 8192: its work outside the GEMM grows with the
    # rows of a block pair, so its share halves with twice the rows (docs/cluster.md)
    CASES = [("row_diameter", 65536, 1024, 0, 2048), ("knn", 100000, 768, 32, 4096),
             ("knn", 100000, 768, 32, 8192)]
else:
    CASES = [("row_diameter", 4096, 64, 0, 512), ("knn", 4096, 64, 8, 512)]


def _label(case):
    op, n, d, k, b = case
    return f"{op} {n}x{d}" + (f" k={k}" if k else "") + f" b={b}"


@records_runtime(dtype="float32", backend="dask")
class DaskEngine:
    """The task graph on 2 single-threaded workers vs the engine with 2 threads."""

    params = ([_label(c) for c in CASES],)
    param_names = ["case"]
    timeout = 3600
    number = 1
    repeat = 1

    def setup(self, case):
        if dask is None:
            raise NotImplementedError("dask and distributed are not installed (the `dask` extra)")
        require_backend("cython")
        environment("float32", "dask")
        op, n, d, k, b = next(c for c in CASES if _label(c) == case)
        self.op, self.k = op, k
        self.cluster = distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
            dashboard_address=None, worker_dashboard_address=None,
        )
        self.client = distributed.Client(self.cluster)
        # the rows are drawn on the workers: neither process ever holds all of them twice
        rows = da.random.default_rng(0).standard_normal((n, d), chunks=(b, d), dtype=np.float32)
        self.D = rows.persist()
        distributed.wait(self.D)
        self.S = self.D.compute()
        self.gflop = 2.0 * b * b * d / 1e9

    def teardown(self, case):
        # Workers leave before the scheduler closes: a worker whose heartbeat meets a
        # closed scheduler logs a traceback (seen on a loaded machine), which the CI
        # check of the asv log reads as a failure.
        self.client.retire_workers(close_workers=True)
        self.client.close()
        self.cluster.close()

    def _run(self, X):
        if self.op == "knn":
            return refgeo.knn(X, self.k, n_threads=2)
        return refgeo.row_diameter(X, n_threads=2)

    def time_dask(self, case):
        self._run(self.D)

    def time_single_process(self, case):
        self._run(self.S)

    def track_throughput_ratio(self, case):
        """Single-process time / Dask time (higher is better, 1 = parity)."""
        t_dask = best_time(lambda: self._run(self.D))
        t_one = best_time(lambda: self._run(self.S))
        return t_one / t_dask

    track_throughput_ratio.unit = "x"

    def track_peak_worker_rss(self, case):
        """Largest peak RSS of a worker process after one run (MiB)."""
        self._run(self.D)

        def peak():
            import resource

            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0

        return max(self.client.run(peak).values())

    track_peak_worker_rss.unit = "MiB"

    def _stream(self):
        with distributed.get_task_stream(client=self.client) as ts:
            t0 = time.perf_counter()
            self._run(self.D)
            wall = time.perf_counter() - t0
        return ts.data, wall

    def track_bytes_per_task(self, case):
        """Bytes received by workers per block-pair task, on the first call (KiB)."""

        def incoming(dask_worker):
            log = getattr(dask_worker, "transfer_incoming_log", None) or ()
            return sum(e.get("total", 0) for e in log)

        before = self.client.run(incoming)
        data, _ = self._stream()
        after = self.client.run(incoming)
        moved = sum(after[w] - before.get(w, 0) for w in after)
        return moved / max(1, sum(1 for t in data if "_task" in str(t["key"]))) / 2**10

    track_bytes_per_task.unit = "KiB"

    def track_overhead_per_task(self, case):
        """Wall time not spent computing, per task, with 2 workers (ms)."""
        data, wall = self._stream()
        busy = sum(
            s["stop"] - s["start"] for t in data for s in t.get("startstops", ()) if s.get("action") == "compute"
        )
        return max(0.0, wall - busy / 2.0) / max(1, len(data)) * 1e3

    track_overhead_per_task.unit = "ms"

    def track_gflop_per_task(self, case):
        """GEMM work of one block-pair task (2 b^2 d flop)."""
        return self.gflop

    track_gflop_per_task.unit = "Gflop"
