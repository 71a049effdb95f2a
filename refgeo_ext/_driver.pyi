# The tile driver has no Python-level API: kernels subclass ``TileDriver`` in Cython
# (``_driver.pxd``).  What every kernel's optional ``progress`` argument receives:
from typing import Callable, Protocol

class Progress(Protocol):
    """``progress(done, total)``: ``done`` of ``total`` tasks (tile pairs) finished.

    Called from the thread that called the kernel only, between tiles, at most about
    five times a second, and once more with ``done == total`` when the kernel
    completes.  It runs with the GIL held while the other threads keep working; an
    exception it raises stops the kernel and propagates (like a Ctrl-C).
    """

    def __call__(self, done: int, total: int, /) -> object: ...

ProgressHook = Callable[[int, int], object] | None

class TileDriver: ...
