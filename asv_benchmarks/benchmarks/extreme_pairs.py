"""Benchmarks for the certified pairwise engine (refgeo.rows: extreme pairs and k-NN).

Baselines measured in the same process:

* ``scipy.spatial.distance.pdist(S).max()`` (direct differences, one thread);
* the GEMM roofline: ``V^2 d`` flops (one GEMM per tile pair ``I <= J``) divided by the
  rate of NumPy's GEMM on a 4096 x 4096 product, rate and kernel time measured in
  interleaved rounds (``_common.roofline_fraction``);
* scikit-learn's ``NearestNeighbors(algorithm="brute").kneighbors`` for k-NN (a
  benchmark-only dependency; the tracker skips without it).

Small sizes run in CI; ``REFGEO_BENCH_SIZE=realistic`` selects the realistic sizes
(V = 8192, d = 512 for the diameter; N = 50000, d = 768, k = 32 for k-NN; V = 65536,
d = 1024 float32 for peak memory).
"""

import math

import numpy as np

from ._common import (
    BACKENDS,
    DTYPES,
    REPEAT,
    best_time,
    environment,
    hidden_states,
    realistic,
    records_runtime,
    refgeo,
    require_backend,
    rng,
    roofline_fraction,
    speed_ratio,
    with_runtime,
)


class RowDiameter:
    """row_diameter, closest_pair and farthest_partners on Gaussian rows."""

    params, param_names = with_runtime(
        ([(1024, 64)] if not realistic() else [(8192, 512)], DTYPES, BACKENDS, [None]),
        ["V_d", "dtype", "backend", "tile_size"],
    )
    timeout = 1200

    def setup(self, V_d, dtype, backend, tile_size, runtime):
        require_backend(backend)
        if backend == "reference" and realistic():
            raise NotImplementedError("the reference backend is the oracle, not timed at realistic sizes")
        V, d = V_d
        self.S = rng(0).standard_normal((V, d)).astype(dtype)
        self.backend = backend
        self.tile_size = tile_size
        environment(dtype, backend)

    def _diameter(self):
        with refgeo.use_backend(self.backend):
            return refgeo.row_diameter(self.S, tile_size=self.tile_size)

    def time_row_diameter(self, V_d, dtype, backend, tile_size, runtime):
        """Certified diameter (value, pair, bound)."""
        self._diameter()

    def peakmem_row_diameter(self, V_d, dtype, backend, tile_size, runtime):
        self._diameter()

    def time_closest_pair(self, V_d, dtype, backend, tile_size, runtime):
        with refgeo.use_backend(self.backend):
            refgeo.closest_pair(self.S, tile_size=self.tile_size)

    def peakmem_closest_pair(self, V_d, dtype, backend, tile_size, runtime):
        with refgeo.use_backend(self.backend):
            refgeo.closest_pair(self.S, tile_size=self.tile_size)

    def time_farthest_partners(self, V_d, dtype, backend, tile_size, runtime):
        with refgeo.use_backend(self.backend):
            refgeo.farthest_partners(self.S, tile_size=self.tile_size)

    def peakmem_farthest_partners(self, V_d, dtype, backend, tile_size, runtime):
        with refgeo.use_backend(self.backend):
            refgeo.farthest_partners(self.S, tile_size=self.tile_size)

    def track_speedup_vs_pdist(self, V_d, dtype, backend, tile_size, runtime):
        """pdist(S).max() time over row_diameter time (same process, same data)."""
        from scipy.spatial.distance import pdist

        S = self.S
        return speed_ratio(lambda: pdist(S).max(), self._diameter)

    track_speedup_vs_pdist.unit = "x"

    def track_roofline_fraction(self, V_d, dtype, backend, tile_size, runtime):
        """(V^2 d flops / dgemm rate on 4096 x 4096, 1024 x 1024 at the small
        size) over row_diameter time."""
        V, d = V_d
        return roofline_fraction(V * V * d, self._diameter, 3, 2, 4096 if realistic() else 1024, np.float64)

    track_roofline_fraction.unit = "fraction"

    def track_sgemm_roofline_fraction(self, V_d, dtype, backend, tile_size, runtime):
        """(V^2 d flops / float32 GEMM rate on 4096 x 4096, 1024 x 1024 at the small size)
        over row_diameter time.

        At the realistic size the engine filters in float32 whatever the input dtype,
        so the float32 GEMM rate measured in the same process is the honest ceiling:
        the symmetric computation does V^2 d / 2 multiply-adds, one GEMM per tile pair.
        At the CI size float64 rows keep the float64 filter (below
        ``MIN_MIXED_MIN_WORK``), and their fraction reads low against this ceiling.
        """
        V, d = V_d
        return roofline_fraction(V * V * d, self._diameter, 3, 2, 4096 if realistic() else 1024)

    track_sgemm_roofline_fraction.unit = "fraction"

    def _closest_pair(self):
        with refgeo.use_backend(self.backend):
            return refgeo.closest_pair(self.S, tile_size=self.tile_size)

    def track_closest_pair_sgemm_roofline_fraction(self, V_d, dtype, backend, tile_size, runtime):
        """(V^2 d flops / float32 GEMM rate on 4096 x 4096, 1024 x 1024 at the small size)
        over closest_pair time.

        On the compiled engine at the realistic size the closest pair filters every pair
        through a float32 GEMM, for float64 rows too (with a budget of refinements, past
        which it runs again in float64; at the CI size float64 rows keep the float64
        filter), and cannot skip tiles as the diameter does: the symmetric GEMM is its
        ceiling.
        """
        V, d = V_d
        return roofline_fraction(V * V * d, self._closest_pair, 3, 2, 4096 if realistic() else 1024)

    track_closest_pair_sgemm_roofline_fraction.unit = "fraction"

    def track_refined_pairs(self, V_d, dtype, backend, tile_size, runtime):
        """Candidate pairs refined in float64 by the certification."""
        return self._diameter().n_refined

    track_refined_pairs.unit = "pairs"

    def track_distance_ratio(self, V_d, dtype, backend, tile_size, runtime):
        with refgeo.use_backend(self.backend):
            return refgeo.distance_ratio(self.S, tile_size=self.tile_size)

    track_distance_ratio.unit = "m/D"


@records_runtime(dtype="float64", backend="cython")
class IdenticalRows:
    """closest_pair, row_diameter and knn on a head whose rarest tokens share one row.

    Zipf-distributed token counts leave the tail of a vocabulary untrained, and its
    rows keep one common value (here 40% of the rows equal the mean row, the others
    Gaussian around it).  Baseline in the same process: the same kernel handed every
    row, which refines every pair of identical rows (refgeo._duplicates), and for knn
    redoes every copy against every candidate (k = 16).  The
    overhead trackers are the time to look for identical rows over the diameter's time,
    on rows where none exist: Gaussian rows, and the sign rows of a binarized head
    (whose entries differ only in the float's top bit, where a weak hash collides).
    """

    params = ([(4000, 64)] if not realistic() else [(50257, 768)],)
    param_names = ["V_d"]
    timeout = 1200

    def setup(self, V_d):
        require_backend("cython")
        environment("float64", "cython")
        V, d = V_d
        g = rng(3)
        self.S = g.standard_normal((V, d)) + 4.0
        counts = g.zipf(1.3, size=V)
        self.S[np.argsort(counts, kind="stable")[: (2 * V) // 5]] = self.S.mean(axis=0)
        self.G = g.standard_normal((V, d))
        self.B = np.where(g.random((V, d)) < 0.5, -1.0, 1.0)

    def _all_rows(self, info):
        from refgeo import rows

        return rows._pair_run(info, self.S, None, None)  # the kernel on every row, no search

    def time_closest_pair(self, V_d):
        refgeo.closest_pair(self.S)

    def time_row_diameter(self, V_d):
        refgeo.row_diameter(self.S)

    def track_closest_pair_speedup_vs_all_rows(self, V_d):
        from refgeo import rows

        with refgeo.use_backend("cython"):
            return speed_ratio(lambda: self._all_rows(rows._CLOSEST), lambda: refgeo.closest_pair(self.S))

    track_closest_pair_speedup_vs_all_rows.unit = "x"

    def time_knn(self, V_d):
        refgeo.knn(self.S, 16)

    def track_knn_speedup_vs_all_rows(self, V_d):
        from refgeo import _backend, rows

        with refgeo.use_backend("cython"):
            return speed_ratio(lambda: _backend.run(rows._KNN, (self.S, None), self.S, 16, None, exclude_self=True),
                               lambda: refgeo.knn(self.S, 16))

    track_knn_speedup_vs_all_rows.unit = "x"

    def track_search_overhead(self, V_d):
        from refgeo import _duplicates

        return speed_ratio(lambda: _duplicates.duplicate_rows(self.G), lambda: refgeo.row_diameter(self.G))

    track_search_overhead.unit = "fraction"

    def track_search_overhead_signs(self, V_d):
        from refgeo import _duplicates

        return speed_ratio(lambda: _duplicates.duplicate_rows(self.B), lambda: refgeo.row_diameter(self.B))

    track_search_overhead_signs.unit = "fraction"


@records_runtime(dtype="float32/float64", backend="cython")
class Float32Speedup:
    """float64 time over float32 time of row_diameter on the same float32-representable data.

    At the realistic size float64 rows are filtered through a float32 copy too (see
    ``refgeo.row_diameter``), so this ratio is near 1: it tracks what the float64
    originals cost on top (centering, refinement), not a GEMM precision difference.
    """

    params = ([(1024, 64)] if not realistic() else [(8192, 512)],)
    param_names = ["V_d"]
    timeout = 1200

    def setup(self, V_d):
        require_backend("cython")
        V, d = V_d
        self.S32 = rng(0).standard_normal((V, d)).astype(np.float32)
        self.S64 = self.S32.astype(np.float64)
        environment("float32/float64", "cython")

    def track_float32_speedup(self, V_d):
        """Also asserts the same certified answer for both dtypes."""
        with refgeo.use_backend("cython"):
            a = refgeo.row_diameter(self.S32)
            b = refgeo.row_diameter(self.S64)
            if (a.value, a.i, a.j) != (b.value, b.i, b.j):
                raise AssertionError(f"float32 and float64 answers differ: {a} vs {b}")
            return speed_ratio(lambda: refgeo.row_diameter(self.S64), lambda: refgeo.row_diameter(self.S32),
                               max(2, REPEAT))

    track_float32_speedup.unit = "x"


@records_runtime(dtype="float64", backend="cython")
class ProgressOverhead:
    """row_diameter with a progress callable against progress=False (same data).

    The callable is the cheapest real consumer (it stores the last report), so the
    ratio is what the reporting itself costs: the tile driver's clock reads and a
    GIL round trip at most five times a second.  Target: below 1.02.
    """

    params = ([(1024, 64)] if not realistic() else [(8192, 512)],)
    param_names = ["V_d"]
    timeout = 1200

    def setup(self, V_d):
        require_backend("cython")
        V, d = V_d
        self.S = rng(0).standard_normal((V, d))
        environment("float64", "cython")

    def track_progress_overhead(self, V_d):
        """Best time with progress over best time without, alternating the two."""
        last = {}
        with refgeo.use_backend("cython"):
            on = lambda: refgeo.row_diameter(self.S, progress=last.update)  # noqa: E731
            off = lambda: refgeo.row_diameter(self.S, progress=False)  # noqa: E731
            off(), on()  # warm: first-call costs (imports, page faults) hit neither
            ratio = speed_ratio(on, off, 5)
            if last.get("done") != last.get("total"):
                raise AssertionError(f"the last report is not the end: {last}")
        return ratio

    track_progress_overhead.unit = "on/off"


@records_runtime(dtype="float32", backend="cython")
class PeakMemoryLarge:
    """Peak memory of row_diameter at V = 65536, d = 1024, float32 (the realistic size;
    V = 2048, d = 128 at the small one)."""

    params = ([(2048, 128)] if not realistic() else [(65536, 1024)],)
    param_names = ["V_d"]
    timeout = 3600

    def setup(self, V_d):
        require_backend("cython")
        V, d = V_d
        self.S = rng(0).standard_normal((V, d), dtype=np.float32)
        environment("float32", "cython")

    def peakmem_row_diameter_float32(self, V_d):
        with refgeo.use_backend("cython"):
            refgeo.row_diameter(self.S)


class KNN:
    """knn of X against X (self excluded)."""

    params, param_names = with_runtime(
        ([(2000, 64, 8)] if not realistic() else [(50000, 768, 32)], DTYPES, BACKENDS),
        ["N_d_k", "dtype", "backend"],
    )
    timeout = 3600

    def setup(self, N_d_k, dtype, backend, runtime):
        require_backend(backend)
        if backend == "reference" and realistic():
            raise NotImplementedError("the reference backend is the oracle, not timed at realistic sizes")
        N, d, k = N_d_k
        self.X = rng(0).standard_normal((N, d)).astype(dtype)
        self.k = k
        self.backend = backend
        environment(dtype, backend)

    def _run(self):
        with refgeo.use_backend(self.backend):
            return refgeo.knn(self.X, self.k)

    def time_knn(self, N_d_k, dtype, backend, runtime):
        self._run()

    def peakmem_knn(self, N_d_k, dtype, backend, runtime):
        self._run()

    def track_speedup_vs_sklearn_brute(self, N_d_k, dtype, backend, runtime):
        """sklearn NearestNeighbors(algorithm="brute").kneighbors time over knn time."""
        try:
            from sklearn.neighbors import NearestNeighbors
        except ImportError:  # pragma: no cover - benchmark-only dependency
            raise NotImplementedError("scikit-learn is not installed") from None
        X, k = self.X, self.k
        nn = NearestNeighbors(n_neighbors=k, algorithm="brute").fit(X)
        return speed_ratio(lambda: nn.kneighbors(), self._run)

    track_speedup_vs_sklearn_brute.unit = "x"

    def track_sgemm_roofline_fraction(self, N_d_k, dtype, backend, runtime):
        """(N^2 d flops / float32 GEMM rate on 4096 x 4096, 1024 x 1024 at the small size)
        over knn time.

        N^2 d flops is the symmetric computation (N^2 d / 2 multiply-adds): the ceiling
        of an exact k-NN that filters every pair through a float32 GEMM.
        """
        N, d, _ = N_d_k
        return roofline_fraction(N * N * d, self._run, 2, 1, 4096 if realistic() else 1024)

    track_sgemm_roofline_fraction.unit = "fraction"


class KNNLMGradient(KNN):
    """knn of LM-head gradient rows (Zipf prior, hidden states with a common component;
    ``refgeo._lm_gradients.lm_gradient``): row norms span nine orders of magnitude.

    Until the k-NN keys were taken on lowered norms (``refgeo_ext/_knn.pyx.tp``) no row
    of these was certified from its heap and every pair was refined: 1.35 s against
    0.06 s for Gaussian rows at 4096 x 256 (float32, 2 cores).
    """

    def setup(self, N_d_k, dtype, backend, runtime):
        require_backend(backend)
        if backend == "reference" and realistic():
            raise NotImplementedError("the reference backend is the oracle, not timed at realistic sizes")
        from refgeo._lm_gradients import lm_gradient

        N, d, k = N_d_k
        self.X = lm_gradient(N, d, n_tokens=1024, seed=0).astype(dtype)
        self.k = k
        self.backend = backend
        environment(dtype, backend)

    def track_refined_per_neighbour(self, N_d_k, dtype, backend, runtime):
        """Pairs refined in float64 per reported neighbour (N k of them)."""
        N, _, k = N_d_k
        return self._run().n_refined / (N * k)

    track_refined_per_neighbour.unit = "pairs"


class _StructuredKNN:
    """The trackers shared by the knn benchmarks of structured rows.

    ``setup`` stores the structured rows in ``self.X``, Gaussian rows of the same shape
    in ``self.G`` (the baseline, timed in the same process) and the number of
    neighbours in ``self.k``; ``n_threads`` (a class attribute, None for every core)
    pins the thread count where a ratio should not depend on the machine.  The methods
    take the class's parameters as ``*params`` and ignore them: setup has used them.
    """

    n_threads = None

    def _knn(self, X):
        with refgeo.use_backend("cython"):
            return refgeo.knn(X, self.k, n_threads=self.n_threads)

    def time_knn(self, *params):
        self._knn(self.X)

    def track_time_over_gaussian(self, *params):
        return speed_ratio(lambda: self._knn(self.X), lambda: self._knn(self.G))

    track_time_over_gaussian.unit = "x"

    def track_refined_pairs_per_row(self, *params):
        return self._knn(self.X).n_refined / len(self.X)

    track_refined_pairs_per_row.unit = "pairs"

    def _speedup_vs(self, name, value):
        """Time of knn(X) with the engine setting ``name`` at ``value`` (a baseline path)
        over its time as set up, in the same process."""
        from refgeo import _engine

        def baseline():
            old = getattr(_engine, name)
            setattr(_engine, name, value)
            try:
                return self._knn(self.X)
            finally:
                setattr(_engine, name, old)

        return speed_ratio(baseline, lambda: self._knn(self.X))


@records_runtime(dtype="float32", backend="cython")
class TiedRows(_StructuredKNN):
    """knn of the sign rows of a binarized head: +-1 entries, so squared distances are
    multiples of 4 and many rows tie at a row's k-th distance (about 9 at k = 8 for
    20,000 rows of length 64), more than the heaps' slack.

    Baseline in the same process: knn of Gaussian rows of the same shape, where ties
    do not occur.  The refined-pairs tracker counts float64 refinements per row (k
    where every row certifies from its heap).  At (8000, 64, 16) the first pass defers
    most rows, whose redo grows its heaps in several passes (in one pass they could not
    grow, and the signs took 8.6 times the Gaussian rows' time).
    """

    params = ([(4000, 64, 8), (8000, 64, 16)] if not realistic() else [(50000, 768, 32), (50000, 64, 16)],)
    param_names = ["N_d_k"]
    timeout = 1200

    def setup(self, N_d_k):
        require_backend("cython")
        environment("float32", "cython")
        N, d, k = N_d_k
        g = rng(4)
        self.X = np.where(g.random((N, d)) < 0.5, -1.0, 1.0).astype(np.float32)
        self.G = g.standard_normal((N, d)).astype(np.float32)
        self.k = k


@records_runtime(dtype="float32", backend="cython")
class NearCopyRows(_StructuredKNN):
    """knn(X, 1) of float32 rows in clusters of 50 near-copies (1e-3 apart, closer than
    the float32 filter resolves; a head's rows that few updates touched), and of rows half
    of which lie within 1e-5 of one point.  No heap holds a row's ties: the rows are
    filtered again against every candidate (a threshold pass in a GEMM epilogue) and
    only the pairs within reach of their bound are refined, or, for the one cluster
    (too many pairs within reach), they go through a float64 filter (first: every
    pair, 30 times the Gaussian rows' time for the clusters; then a NumPy filter, 7 to
    9 times).

    Baseline in the same process: knn of Gaussian rows of the same shape.
    """

    params = ([(8000, 64)] if not realistic() else [(20000, 64)], ["clusters", "one_cluster"])
    param_names = ["N_d", "rows"]
    timeout = 1200

    def setup(self, N_d, rows):
        require_backend("cython")
        environment("float32", "cython")
        N, d = N_d
        g = rng(5)
        if rows == "clusters":
            X = np.repeat(g.standard_normal((N // 50, d)), 50, axis=0)
            X = X + 1e-3 * g.standard_normal(X.shape)
        else:
            X = np.vstack([g.standard_normal((N // 2, d)), 5 + 1e-5 * g.standard_normal((N - N // 2, d))])
        self.X = X.astype(np.float32)
        self.G = g.standard_normal((N, d)).astype(np.float32)
        self.k = 1

    def _farthest(self, X):
        with refgeo.use_backend("cython"):
            return refgeo.farthest_partners(X)

    def track_farthest_time_over_gaussian(self, N_d, rows):
        """farthest_partners of the same rows over Gaussian rows: where half of the rows
        lie in one cluster, every other row's farthest partners tie within the float32
        band (the float32 run gives up for a float64 one past its limits: 1.5 at
        8,000 x 64; before, it refined the whole cluster for each row: 5.4 at
        20,000 x 64)."""
        return speed_ratio(lambda: self._farthest(self.X), lambda: self._farthest(self.G))

    track_farthest_time_over_gaussian.unit = "x"


@records_runtime(dtype="float32", backend="cython")
class KNNHiddenStates(_StructuredKNN):
    """knn of hidden states shaped like a residual stream (:func:`_common.hidden_states`:
    a common component, the embedding of a token drawn with Zipf counts and a small
    context term).  The rows of one frequent token are near-copies, nearly
    equidistant, which the float32 filter ties beyond any heap; the threshold pass
    groups them around anchors (``refgeo._engine._anchor_groups``) and runs each group
    against the rows within reach of its anchor.

    Baselines in the same process: the same call with no row grouped around an anchor
    (``_engine.ANCHOR_MIN_GAIN`` out of reach: every deferred row against every row,
    the path before the anchors), the same call without the groups' own frames
    (``_engine.LOCAL_FRAME_GAIN`` infinite: every group filtered in the frame of all
    rows, where its near-copies tie), and knn of Gaussian rows of the same shape.  One
    thread, so that the ratios do not depend on the machine's cores.
    """

    params = ([(8000, 128)] if not realistic() else [(20000, 256)], [1, 16])
    param_names = ["N_d", "k"]
    timeout = 1200
    n_threads = 1

    def setup(self, N_d, k):
        require_backend("cython")
        environment("float32", "cython")
        N, d = N_d
        self.X = hidden_states(N, d)
        self.G = rng(7).standard_normal((N, d)).astype(np.float32)
        self.k = k

    def track_speedup_vs_no_anchors(self, N_d, k):
        return self._speedup_vs("ANCHOR_MIN_GAIN", 1 << 30)

    track_speedup_vs_no_anchors.unit = "x"

    def track_speedup_vs_common_frame(self, N_d, k):
        return self._speedup_vs("LOCAL_FRAME_GAIN", math.inf)

    track_speedup_vs_common_frame.unit = "x"


@records_runtime(dtype="float64", backend="cython")
class KNNCodeRows(_StructuredKNN):
    """knn(X, 16) of the rows of the Delsarte-Goethals code of R^64 (the neighbour lists
    of ``spread``'s iteration): a row's 16-th distance ties exactly with hundreds of
    others, which no filter separates.

    Baselines in the same process: the same call with the probe of the float64 filter's
    heaps switched off (``_engine.KNN_TIE_PROBE_SHARE`` out of reach: the rows the
    float32 filter leaves with many pairs within reach go through the float64 heaps and
    threshold pass, which separate nothing here), and knn of Gaussian rows of the same
    shape.  One thread.
    """

    params = ([(8000, 64)] if not realistic() else [(20000, 64)],)
    param_names = ["N_d"]
    timeout = 1200
    n_threads = 1

    def setup(self, N_d):
        require_backend("cython")
        environment("float64", "cython")
        N, d = N_d
        self.X = refgeo.delsarte_goethals_code(d, N)
        self.G = rng(8).standard_normal((N, d))
        self.k = 16

    def track_speedup_vs_no_probe(self, N_d):
        return self._speedup_vs("KNN_TIE_PROBE_SHARE", math.inf)

    track_speedup_vs_no_probe.unit = "x"


@records_runtime(dtype="float64", backend="cython")
class ClosestPairNearDuplicates:
    """closest_pair of float64 rows of which a share lies within 1e-6 of one point (rows
    that few updates touched), at the end of the matrix.

    The float32 filter cannot separate such rows, and every pair of them is a
    refinement: past its budget (refgeo._engine.MIN_MIXED_BUDGET_DIVISOR) the run stops
    and the float64 filter runs instead.  Baseline in the same process: the float64
    filter alone (the engine's threshold for the float32 filter set out of reach).
    ``track_time_over_float64_filter`` below 1 is the float32 filter's gain; it is about
    2 at worst, where the near-duplicates fill the budget.
    """

    params = ([(8000, 64)] if not realistic() else [(50000, 64)], [0.1, 0.4])
    param_names = ["V_d", "share"]
    timeout = 1200

    def setup(self, V_d, share):
        require_backend("cython")
        environment("float64", "cython")
        V, d = V_d
        g = rng(7)
        m = int(V * share)
        self.S = np.vstack([g.standard_normal((V - m, d)), 5 + 1e-6 * g.standard_normal((m, d))])

    def _closest(self):
        with refgeo.use_backend("cython"):
            return refgeo.closest_pair(self.S)

    def time_closest_pair(self, V_d, share):
        self._closest()

    def track_time_over_float64_filter(self, V_d, share):
        from refgeo import _engine

        def plain():
            saved = _engine.MIN_MIXED_MIN_WORK
            _engine.MIN_MIXED_MIN_WORK = 1 << 62
            try:
                return self._closest()
            finally:
                _engine.MIN_MIXED_MIN_WORK = saved

        return speed_ratio(self._closest, plain)

    track_time_over_float64_filter.unit = "x"


@records_runtime
class BackwardBoundResiduals:
    """backward_bound on float32 softmax residuals ``p - e_c`` (rounded, they sum to
    about 1e-7, not 0, so the bound takes ``sigma = 1^T r`` to twice the working
    precision and adds ``|sigma|`` times the mean row).

    Rows: a Zipf-trained LM head's update shape (a large common component, rows far
    from the origin compared with their spread), logits of Zipf(1.1)-ranked tokens.
    Baseline, same process: ``math.fsum`` over ``tolist()`` per residual, the correctly
    rounded sums the bound took before (11 s and about 3 GB at 2000 x 50257).
    """

    params = ([(8192, 64, 256)] if not realistic() else [(50257, 64, 2000)],)
    param_names = ["V_d_n"]
    timeout = 1200

    def setup(self, V_d_n):
        require_backend("cython")
        environment("float32", "cython")
        V, d, n = V_d_n
        g = rng(6)
        self.S = (g.standard_normal((V, d)) + 30.0 * g.standard_normal(d)).astype(np.float32)
        ranks = np.arange(1, V + 1, dtype=np.float64)
        z = -1.1 * np.log(ranks) + 0.5 * g.standard_normal((n, V))
        p = np.exp(z - z.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        p[np.arange(n), g.integers(0, V, n)] -= 1.0
        self.R = p.astype(np.float32)
        refgeo.row_diameter(self.S)  # warm the engine (the diameter is part of every call)

    def time_backward_bound(self, V_d_n):
        refgeo.backward_bound(self.S, self.R)

    def track_sums_speedup_vs_fsum(self, V_d_n):
        from refgeo._certify import compensated_sums

        R64 = self.R.astype(np.float64)
        return speed_ratio(lambda: [math.fsum(row) for row in R64.tolist()],
                           lambda: compensated_sums(np, R64), max(2, REPEAT))

    track_sums_speedup_vs_fsum.unit = "x"
