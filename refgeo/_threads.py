"""One BLAS thread-pool controller for the whole package.

Two situations want BLAS pinned to one thread:

* OpenMP over tiles (the compiled engine): each OpenMP thread runs its own small GEMM,
  and a multi-threaded BLAS underneath would oversubscribe the cores (OpenMP over
  tiles with BLAS at one thread, or BLAS threads without OpenMP: never both);
* dense factorisations of many small matrices (eigh, svd of k x k panels in the
  tokenwise fits), whose level-2 parts do not scale and whose threaded versions only
  spin on a loaded machine.

``threadpoolctl`` scans the loaded libraries once; the controller is kept.
"""

from __future__ import annotations

import contextlib

__all__ = ["blas_single_thread"]

_CONTROLLER = None


def blas_single_thread(n_threads: int = 2):
    """Context manager limiting BLAS to one thread; a no-op when ``n_threads <= 1``.

    ``n_threads`` is the number of threads the caller is about to run itself (OpenMP
    tiles); with one, BLAS keeps its pool and nothing needs limiting.
    """
    global _CONTROLLER
    if n_threads <= 1:
        return contextlib.nullcontext()
    if _CONTROLLER is None:
        import scipy.linalg  # noqa: F401  (load SciPy's BLAS before the scan)
        from threadpoolctl import ThreadpoolController

        _CONTROLLER = ThreadpoolController()
    return _CONTROLLER.limit(limits=1, user_api="blas")
