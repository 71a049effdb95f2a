"""A process forked after a parallel compiled call still gets the same results.

GNU OpenMP cannot run a parallel region in a child forked after its thread pool
started: the first region waits forever for threads that do not exist.  refgeo_ext
marks the child (``os.register_at_fork``) and runs its kernels serially there,
without entering an OpenMP region, with bitwise the parent's results.
"""

from __future__ import annotations

import multiprocessing
import sys
import warnings

import numpy as np
import pytest

import refgeo
from refgeo import _backend

pytestmark = [
    pytest.mark.skipif(sys.platform == "win32", reason="no fork start method"),
    pytest.mark.skipif(
        not _backend.available_backends()["cython"][0], reason="the compiled extension is not built"
    ),
]


def _data():
    rng = np.random.default_rng(7)
    # large enough for the parallel path (V^2 d / 2 well above the one-thread cutoff)
    S = rng.standard_normal((3000, 64)).astype(np.float32)
    Z = rng.standard_normal((300, 2000))
    return S, Z


def _compute(n_threads):
    S, Z = _data()
    d = refgeo.row_diameter(S, n_threads=n_threads)
    k = refgeo.knn(S, 8, n_threads=n_threads)
    p = refgeo.pdist_hilbert(Z, n_threads=n_threads)
    return (d.value, d.i, d.j), k.indices, k.distances, p


def _in_child(n_threads):
    import refgeo_ext

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = _compute(n_threads)
        results_again = _compute(n_threads)
    messages = [str(w.message) for w in caught if "forked" in str(w.message)]
    return results, results_again, messages, refgeo_ext.openmp_max_threads(), refgeo_ext._common.in_forked_child()


@pytest.mark.parametrize("n_threads", [None, 2])
def test_forked_child_matches_parent(n_threads):
    with refgeo.use_backend("cython"):
        parent = _compute(2)  # starts the OpenMP thread pool in this process
        ctx = multiprocessing.get_context("fork")
        with ctx.Pool(1) as pool:
            job = pool.apply_async(_in_child, (n_threads,))
            try:
                child, child_again, messages, max_threads, forked = job.get(timeout=60)
            except multiprocessing.TimeoutError:
                pool.terminate()
                pytest.fail("the forked child did not return within 60 s")
    assert forked and max_threads == 1
    for got in (child, child_again):
        assert got[0] == parent[0]
        np.testing.assert_array_equal(got[1], parent[1])
        assert got[2].tobytes() == parent[2].tobytes()
        assert got[3].tobytes() == parent[3].tobytes()
    # one warning per process, saying how to keep the threads
    assert len(messages) == 1 and "forkserver" in messages[0], messages
