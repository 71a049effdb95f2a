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

from ._common import (REPEAT, environment, hidden_states, realistic, records_runtime, refgeo, require_backend,
                      speed_ratio)

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


def _held(client) -> int:
    """Tasks the scheduler holds (the persisted rows, and results not yet released)."""
    return client.run_on_scheduler(lambda dask_scheduler: len(dask_scheduler.tasks))


def best_settled_time(client, fn, held: int, repeat: int | None = None) -> float:
    """:func:`best_time` of a graph run on ``client``, each call started once the
    scheduler holds only its ``held`` tasks again: a call submitted while the last
    result's keys are still being released found them in memory and took 0.01 s where
    a run takes 0.3 s (the graphs are pure, so the same rows give the same keys)."""
    best = float("inf")
    for _ in range(REPEAT if repeat is None else repeat):
        for _ in range(500):
            if _held(client) <= held:
                break
            time.sleep(0.01)
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _label(case):
    op, n, d, k, b = case
    return f"{op} {n}x{d}" + (f" k={k}" if k else "") + f" b={b}"


class _TwoWorkers:
    """A ``distributed.LocalCluster`` of 2 single-threaded worker processes on the
    loopback interface, started by ``setup`` for each case and retired by ``teardown``."""

    param_names = ["case"]
    timeout = 3600
    number = 1
    repeat = 1

    def _start_cluster(self):
        if dask is None:
            raise NotImplementedError("dask and distributed are not installed (the `dask` extra)")
        require_backend("cython")
        environment("float32", "dask")
        self.cluster = distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
            dashboard_address=None, worker_dashboard_address=None,
        )
        self.client = distributed.Client(self.cluster)

    def _settled(self, fn) -> float:
        """Time of one call of ``fn``, started on a settled scheduler (the ``timer``
        of :func:`speed_ratio` in the ratio trackers)."""
        return best_settled_time(self.client, fn, self.held, repeat=1)

    def teardown(self, case):
        # Workers leave before the scheduler closes: a worker whose heartbeat meets a
        # closed scheduler logs a traceback (seen on a loaded machine), which the CI
        # check of the asv log reads as a failure.
        self.client.retire_workers(close_workers=True)
        self.client.close()
        self.cluster.close()


@records_runtime(dtype="float32", backend="dask")
class DaskEngine(_TwoWorkers):
    """The task graph on 2 single-threaded workers vs the engine with 2 threads."""

    params = ([_label(c) for c in CASES],)

    def setup(self, case):
        op, n, d, k, b = next(c for c in CASES if _label(c) == case)
        self.op, self.k = op, k
        self._start_cluster()
        # the rows are drawn on the workers: neither process ever holds all of them twice
        rows = da.random.default_rng(0).standard_normal((n, d), chunks=(b, d), dtype=np.float32)
        self.D = rows.persist()
        distributed.wait(self.D)
        self.S = self.D.compute()
        self.held = _held(self.client)
        self.gflop = 2.0 * b * b * d / 1e9

    def _run(self, X):
        if self.op == "knn":
            return refgeo.knn(X, self.k, n_threads=2)
        return refgeo.row_diameter(X, n_threads=2)

    def time_dask(self, case):
        self._run(self.D)

    def time_single_process(self, case):
        self._run(self.S)

    def track_throughput_ratio(self, case):
        """Single-process time / Dask time (higher is better, 1 = parity), the two
        interleaved (:func:`speed_ratio`), each call on a settled scheduler."""
        return speed_ratio(lambda: self._run(self.S), lambda: self._run(self.D), timer=self._settled)

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
        """Bytes received by workers per task (every task of the graph: the block pairs
        and the hashing and seed tasks beside them, as docs/cluster.md reports it), on
        the first call (KiB)."""

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


# (case, rows, d, k, rows per chunk)
if realistic():
    # knn untrained: the baseline refines every pair of copies in a block (quadratic in
    # the copies), so a smaller head than the others
    LM_CASES = [("knn lm_gradient", 50257, 768, 32, 8192), ("closest_pair untrained", 50257, 768, 0, 8192),
                ("knn untrained", 16384, 768, 16, 4096), ("knn near_copies", 50257, 768, 32, 8192),
                ("knn hidden_states", 32768, 256, 16, 8192)]
    ONE_CLUSTER = (32768, 256, 8192)
else:
    LM_CASES = [("knn lm_gradient", 4096, 64, 8, 1024), ("closest_pair untrained", 8192, 64, 0, 2048),
                ("knn untrained", 4096, 64, 8, 1024), ("knn near_copies", 8192, 64, 16, 2048),
                ("knn hidden_states", 8192, 64, 1, 2048)]
    ONE_CLUSTER = (8192, 64, 2048)
# half the rows within 1e-5 of one point: an untrained tail whose rows moved a little
# from their shared initialisation (weight decay, noise), in chunks of their own
LM_CASES += [(f"{op} one_cluster", *ONE_CLUSTER[:2], k, ONE_CLUSTER[2])
             for op, k in [("row_diameter", 0), ("closest_pair", 0), ("farthest_partners", 0), ("knn", 1)]]


def _one_cluster(n, d):
    """float32 Gaussian rows whose second half lies within 1e-5 of one point."""
    g = np.random.default_rng(11)
    S = g.standard_normal((n, d)).astype(np.float32)
    S[n // 2 :] = 5.0 + 1e-5 * g.standard_normal((n - n // 2, d))
    return S


def _untrained_head(n, d):
    """float32 rows around a common offset whose rarest 40% of tokens (Zipf counts)
    keep one row, the mean: the untrained tail of a vocabulary."""
    g = np.random.default_rng(3)
    S = (g.standard_normal((n, d)) + 4.0).astype(np.float32)
    S[np.argsort(g.zipf(1.3, size=n), kind="stable")[: (2 * n) // 5]] = S.mean(axis=0)
    return S


@records_runtime(dtype="float32", backend="dask")
class DaskLMRows(_TwoWorkers):
    """The task graph on rows shaped like an LM head's, where Gaussian rows hide the cost.

    * ``knn lm_gradient``: k-NN of LM-head gradient rows (``refgeo._lm_gradients``: Zipf
      token counts, row norms over nine decades) on the NumPy tasks, which workers
      without the compiled extension run; baseline in the same run: the compiled tasks.
      The NumPy tasks bounded a row's pairs with the largest norm of the other block and
      refined almost every pair (30x the compiled tasks' time at 4096 x 256).
    * ``closest_pair untrained``: a head whose rarest 40% of tokens share one row;
      baseline in the same run: the same graph handed every row (no search for identical
      rows), which refines every pair of them.
    * ``knn untrained``: ``knn`` of such a head, which runs the graph on one row of each
      class of identical rows; baseline in the same run: the k-NN graph on every row,
      where each copy ties with every other at its k-th distance, beyond any heap, and
      is filtered again against whole blocks.
    * ``knn near_copies``: rows in clusters of 50 near-copies (1e-6 apart, within the
      float32 filter's bound of each other), as hidden states of one token in similar
      contexts are: every row ties beyond its heap, so its tasks filter it again against
      the whole block.  Baseline in the same run: the single-process engine with 2
      threads on the same rows as one NumPy array (a ratio near 1 is parity; before
      the tasks filtered such rows again they refined every pair of the block, 70
      times the single-process time).
    * ``knn hidden_states``: hidden states with Zipf token counts
      (:func:`_common.hidden_states`), whose frequent tokens' rows are near-copies that
      overflow their heaps: a task hands them to the single-process engine with their
      thresholds (``refgeo._engine.knn(..., thresholds=T)``), which groups them around
      anchors.  Baseline in the same run: the single-process engine with 2 threads on
      the same rows.
    * ``row_diameter``, ``closest_pair``, ``farthest_partners``, ``knn`` (k = 1)
      ``one_cluster``: half of the float32 rows within 1e-5 of one point, in chunks of
      their own: every pair of the cluster lies in the float32 band.  Baseline in the
      same run: the single-process engine with 2 threads on the same rows.  Before the
      diameter's tasks started from a seed, the closest pair's and the farthest
      partners' tasks gave up on a float32 filter that wastes refinements, and the k-NN
      tasks asked the engine for the block's k best of such rows, they refined every
      pair of the cluster: 14, 1.6, 4.5 and 30 times the single-process time at
      20,000 x 64.

    ``track_ratio`` is the baseline's time over the case's (best of 3 each, the two
    interleaved by :func:`speed_ratio`, every call on a settled scheduler:
    :func:`best_settled_time`; higher is better),
    ``track_refined_per_row`` the pairs the case refined per row.
    """

    params = ([c[0] for c in LM_CASES],)

    def setup(self, case):
        from refgeo import _dask, rows

        _, n, d, k, b = next(c for c in LM_CASES if c[0] == case)
        self._start_cluster()
        if case.endswith("one_cluster"):
            S = _one_cluster(n, d)
            fn = getattr(refgeo, case.split()[0])
            args = (k,) if k else ()
            self.run = lambda: fn(self.D, *args)
            self.baseline = lambda: fn(S, *args, n_threads=2)
        elif case == "knn untrained":
            S = _untrained_head(n, d)
            self.run = lambda: refgeo.knn(self.D, k)
            self.baseline = lambda: _dask.knn(self.D, k, None, exclude_self=True)
        elif case in ("knn hidden_states", "knn near_copies"):
            if case == "knn hidden_states":
                S = hidden_states(n, d)
            else:
                g = np.random.default_rng(5)
                S = (np.repeat(g.standard_normal((-(-n // 50), d)), 50, axis=0)[:n]
                     + 1e-6 * g.standard_normal((n, d))).astype(np.float32)
            self.run = lambda: refgeo.knn(self.D, k)
            self.baseline = lambda: refgeo.knn(S, k, n_threads=2)
        elif k:
            from refgeo._lm_gradients import lm_gradient

            S = lm_gradient(n, d, n_tokens=1024, seed=0).astype(np.float32)
            self.run = lambda: _dask.knn(self.D, k, None, exclude_self=True, engine="numpy")
            self.baseline = lambda: _dask.knn(self.D, k, None, exclude_self=True, engine="compiled")
        else:
            S = _untrained_head(n, d)
            self.run = lambda: refgeo.closest_pair(self.D)
            self.baseline = lambda: rows._pair_run(rows._CLOSEST, self.D, None, None)[0]
        self.n = n
        self.D = self.client.persist(da.from_array(S, chunks=(b, d)))
        distributed.wait(self.D)
        self.held = _held(self.client)

    def time_dask(self, case):
        self.run()

    def track_ratio(self, case):
        """Baseline time / the case's time (higher is better), the two interleaved
        (:func:`speed_ratio`), each call on a settled scheduler."""
        return speed_ratio(self.baseline, self.run, timer=self._settled)

    track_ratio.unit = "x"

    def track_refined_per_row(self, case):
        """Pairs refined per row."""
        return self.run().n_refined / self.n

    track_refined_per_row.unit = "pairs"
