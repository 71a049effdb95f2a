"""The compiled kernels' ``progress(done, total)`` hook (kernel level)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from refgeo import _backend

ext = _backend.extension()
pytestmark = pytest.mark.skipif(ext is None, reason="the compiled extension is not built")


def _pdist(Z, tile, n_threads, progress=None):
    n = Z.shape[0]
    out = np.empty(n * (n - 1) // 2)
    ext._tropical.pdist_logits64(Z, out, tile, 64, n_threads, progress=progress)
    return out


@pytest.mark.parametrize("n_threads", [1, 2])
def test_progress_counts_every_task_and_leaves_results_alone(n_threads):
    Z = np.random.default_rng(0).standard_normal((200, 300))
    calls = []
    got = _pdist(Z, 16, n_threads, progress=lambda done, total: calls.append((done, total)))
    assert got.tobytes() == _pdist(Z, 16, n_threads).tobytes()
    # tasks: 13 row tiles of 16 rows times 2 column blocks of 8 * 16 = 128 rows
    assert calls[-1] == (26, 26)
    assert all(t == 26 for _, t in calls)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)


def test_progress_on_a_gemm_kernel():
    rng = np.random.default_rng(1)
    S = rng.standard_normal((500, 20))
    X = np.empty_like(S)
    nrm = np.empty(500)
    ext._common.center64(S, S.mean(axis=0), X, nrm, 2)
    tile = 64
    tile_rmax = np.sqrt(np.maximum.reduceat(nrm, np.arange(0, 500, tile)))

    def run(progress=None):
        out_r, out_ij, out_nref = np.empty(2), np.empty((2, 2), np.int64), np.zeros(2, np.int64)
        ext._extreme_pairs.extreme_pair64(X, nrm, tile_rmax, S, True, 1e-12, 0.0, 0.0, tile, 2,
                                         out_r, out_ij, out_nref, progress=progress)
        return out_r.max()

    calls = []
    assert run(lambda done, total: calls.append((done, total))) == run()
    assert calls[-1] == (36, 36)  # 8 tiles: 8 * 9 / 2 pairs I <= J


def test_progress_is_rate_limited():
    Z = np.random.default_rng(2).standard_normal((1000, 6000)).astype(np.float32)
    out = np.empty(1000 * 999 // 2)
    calls = []
    t0 = time.perf_counter()
    ext._tropical.pdist_logits32(Z, out, 8, 1024, 2, progress=lambda d, t: calls.append(d))
    elapsed = time.perf_counter() - t0
    # at most one call per 0.2 s between tiles, plus the final one
    assert len(calls) <= elapsed / 0.2 + 2


def test_an_exception_in_progress_stops_the_kernel():
    Z = np.random.default_rng(3).standard_normal((100, 50))

    def fail(done, total):
        raise RuntimeError("stop here")

    with pytest.raises(RuntimeError, match="stop here"):
        _pdist(Z, 8, 2, progress=fail)
