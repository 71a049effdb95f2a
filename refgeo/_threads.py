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
import dataclasses
import threading
from typing import Any, Iterator

__all__ = ["blas_single_thread"]

_CONTROLLER = None


@dataclasses.dataclass
class _Pinned:
    """The calls inside :func:`blas_single_thread` and the limiter that restores BLAS."""

    inside: int = 0
    limiter: Any = None


_pinned = _Pinned()
_pinned_lock = threading.Lock()


@contextlib.contextmanager
def _pinned_blas(controller: Any) -> Iterator[None]:
    # BLAS's thread count is one setting for the whole process, and calls overlap in
    # several threads: with a limiter per call the one that left last restored the
    # 1 the other had set, and BLAS stayed single-threaded for the rest of the process
    # (the first to leave also unpinned BLAS under the other's OpenMP tiles).  So the
    # first call to enter pins it and the last to leave restores it.
    entered = False
    try:
        with _pinned_lock:
            if _pinned.inside == 0:
                _pinned.limiter = controller.limit(limits=1, user_api="blas")
            _pinned.inside += 1
            entered = True
        yield
    finally:
        # (the count is taken inside the try, so that a Ctrl-C arriving after the lock
        # block is undone here; one between the increment and `entered` is not)
        if entered:
            with _pinned_lock:
                _pinned.inside -= 1
                if _pinned.inside == 0:
                    limiter, _pinned.limiter = _pinned.limiter, None
                    limiter.restore_original_limits()


def blas_single_thread(n_threads: int = 2):
    """Context manager limiting BLAS to one thread; a no-op when ``n_threads <= 1``.

    ``n_threads`` is the number of threads the caller is about to run itself (OpenMP
    tiles); with one, BLAS keeps its pool and nothing needs limiting.  Overlapping
    calls (several Python threads) share one limit: BLAS is restored when the last of
    them leaves.
    """
    global _CONTROLLER
    if n_threads <= 1:
        return contextlib.nullcontext()
    if _CONTROLLER is None:
        import scipy.linalg  # noqa: F401  (load SciPy's BLAS before the scan)
        from threadpoolctl import ThreadpoolController

        _CONTROLLER = ThreadpoolController()
    return _pinned_blas(_CONTROLLER)
