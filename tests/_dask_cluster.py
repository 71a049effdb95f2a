"""The ``distributed.LocalCluster`` of the Dask tests: processes, loopback only, bounded shutdown.

A test module makes it its module-scoped fixture with :func:`local_client`; the cluster
(two single-threaded worker processes on 127.0.0.1) is shut down at the end of the
module within ``TIMEOUT`` seconds, so that no later module runs on it.
"""

from __future__ import annotations

import contextlib

# seconds any cluster operation may take before the test fails instead of hanging
TIMEOUT = 60


@contextlib.contextmanager
def local_client(n_workers: int = 2):
    """A ``distributed.Client`` on a fresh ``LocalCluster`` (the default scheduler while open)."""
    import distributed

    cluster = distributed.LocalCluster(
        n_workers=n_workers, threads_per_worker=1, processes=True, host="127.0.0.1",
        dashboard_address=None, worker_dashboard_address=None, timeout=TIMEOUT,
    )
    c = distributed.Client(cluster, timeout=TIMEOUT)
    try:
        c.wait_for_workers(n_workers, timeout=TIMEOUT)
        yield c
    finally:
        c.close(timeout=TIMEOUT)
        cluster.close(timeout=TIMEOUT)
