"""The ``distributed.LocalCluster`` of the Dask tests: processes, loopback only, bounded shutdown.

A test module makes it its module-scoped fixture with :func:`local_client`; the cluster
(two single-threaded worker processes on 127.0.0.1) is shut down at the end of the
module within ``TIMEOUT`` seconds, so that no later module runs on it.
"""

from __future__ import annotations

import contextlib
import os
import signal

# seconds any cluster operation may take before the test fails instead of hanging
TIMEOUT = 60


@contextlib.contextmanager
def local_client(n_workers: int = 2):
    """A ``distributed.Client`` on a fresh ``LocalCluster`` (the default scheduler while open)."""
    import dask
    import distributed

    # The worker processes take the configuration in force when they start.  A worker
    # that fetches a result from a killed peer retries the refused connection until
    # the connect timeout (30 s by default, twice in a row seen under load); 10 s is
    # ample for loopback and bounds what a killed-worker test waits.  The scheduler's
    # HTTP server takes a free loopback port: the default, 8787, is taken by the cluster
    # of another pytest-xdist worker ("Port 8787 is already in use").
    with dask.config.set({"distributed.comm.timeouts.connect": "10s"}):
        cluster = distributed.LocalCluster(
            n_workers=n_workers, threads_per_worker=1, processes=True, host="127.0.0.1",
            dashboard_address="127.0.0.1:0", worker_dashboard_address=None, timeout=TIMEOUT,
        )
    c = distributed.Client(cluster, timeout=TIMEOUT)
    try:
        c.wait_for_workers(n_workers, timeout=TIMEOUT)
        yield c
    finally:
        c.close(timeout=TIMEOUT)
        cluster.close(timeout=TIMEOUT)


def kill_at_first_result(pids, prefix):
    """A scheduler plugin that kills the worker process holding the first finished task
    whose key contains ``prefix``.

    It acts from the scheduler's own transition (the scheduler of :func:`local_client`
    runs in the test's process), so the kill comes while the graph runs, whatever the
    load, and the result the worker held is lost with it.  ``pids`` maps worker
    addresses to process ids (``client.run(os.getpid)``); ``plugin.killed`` is the
    address of the killed worker, or None.
    """
    from distributed.diagnostics.plugin import SchedulerPlugin

    class KillAtFirstResult(SchedulerPlugin):
        name = "kill-at-first-result"

        def __init__(self):
            self.killed = None

        def transition(self, key, start, finish, *args, worker=None, **kwargs):
            if self.killed is None and (start, finish) == ("processing", "memory") and prefix in str(key):
                if worker in pids:
                    os.kill(pids[worker], signal.SIGKILL)
                    self.killed = worker

    return KillAtFirstResult()


@contextlib.contextmanager
def graph_key_clashes(client):
    """Record every graph the scheduler of :func:`local_client` receives inside the
    block; yields ``(seen, clashes)``: the keys seen, and those that two graphs gave
    different dependencies (what the scheduler's "Detected different `run_spec`"
    warning, described in docs/cluster.md, reports when it still remembers the first graph).

    The warning itself depends on when the scheduler forgets a graph; what the graphs
    declare does not, so a test of it is deterministic.  Skips where the scheduler has
    no ``_generate_taskstates`` (private: the one place that sees each submitted graph
    whole).
    """
    import pytest

    scheduler = client.cluster.scheduler
    if not hasattr(scheduler, "_generate_taskstates"):
        pytest.skip("this distributed version has no Scheduler._generate_taskstates to record graphs with")
    seen: dict = {}
    clashes: set = set()
    generate = scheduler._generate_taskstates

    def recording(keys, dsk, *args, **kwargs):
        for k, spec in dsk.items():
            deps = frozenset(getattr(spec, "dependencies", ()))
            if seen.setdefault(k, deps) != deps:
                clashes.add(k)
        return generate(keys, dsk, *args, **kwargs)

    scheduler._generate_taskstates = recording
    try:
        yield seen, clashes
    finally:
        del scheduler._generate_taskstates
