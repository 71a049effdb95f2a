"""A throttled progress reporter for long calls.

It is for public functions that loop over chunks in Python (the tokenwise fits, and
any other chunked loop in the package); the memory check before work is
:mod:`refgeo._memory`.  This module depends on nothing in
refgeo but :mod:`refgeo._validate`, so every layer may use it.

Progress
--------
A public function takes ``progress=False|True|callable`` and wraps its loop::

    progress = check_progress(progress)          # validate early, with the other options
    ...
    with Progress(progress, total=n_steps, desc="fit_local_maps") as bar:
        for chunk in chunks:
            work(chunk)
            bar.advance()                        # between chunks, in the calling thread

* ``False``: nothing is reported, and the loop pays one attribute test per step.
* ``True``: a tqdm bar (``tqdm.auto``) when tqdm is importable; otherwise one
  ``UserWarning`` per process saying how to get it, and nothing else.
* a callable: called as ``progress(info)`` with a dict
  ``{"done": int, "total": int, "elapsed": float, "eta": float}`` (seconds; ``eta``
  is NaN until a step has finished).  It is called from the thread that created the
  reporter, never from a worker thread; once at the start (``done == 0``), then
  between steps at most once per ``interval`` seconds (0.25 s by default: at most a
  few times a second, whatever the chunk size), and always once when the last step
  ends (``done == total``, reported once and only then: a call that runs compiled
  kernels reports it when the call ends, since one kernel run may be followed by
  another that nobody announced, and its ``total`` never decreases; a tqdm bar
  shows the same).  Whatever the callable raises propagates to the caller of the
  public function, which stops there: a callable can cancel a long call by raising.

Interrupts.  Nothing here catches ``BaseException``: a ``KeyboardInterrupt`` raised
while a chunk runs leaves the loop at once, and the ``with`` block closes the bar.

"""

from __future__ import annotations

import math
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from ._validate import check_real

__all__ = ["Progress", "call_with_progress", "check_progress"]

_TQDM_WARNED = False


def check_progress(value: Any, name: str = "progress") -> bool | Callable[[dict], Any]:
    """Return ``value`` if it is ``False``, ``True`` or a callable; raise ``TypeError`` otherwise."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if callable(value):
        return value
    raise TypeError(f"{name} must be False, True or a callable, got {type(value).__name__} instead.")


def _tqdm_bar(total: float | None, desc: str, unit: str):
    """A tqdm bar, or None (with the one warning) when tqdm is missing; ``total`` None
    checks for tqdm and returns a function that makes the bar once the total is known."""
    global _TQDM_WARNED
    try:
        from tqdm.auto import tqdm
    except ImportError:
        if not _TQDM_WARNED:
            _TQDM_WARNED = True
            warnings.warn(
                "progress=True shows a bar only when tqdm is installed (pip install tqdm); "
                "running without one. Pass a callable to receive progress reports instead.",
                UserWarning,
                stacklevel=4,
            )
        return None
    def make(n):
        if isinstance(n, float):
            # a fraction of a time budget (total 1.0): the percentage alone, where tqdm's
            # counter showed "0.17526080799871124/1.0"
            return tqdm(total=n, desc=desc, bar_format="{l_bar}{bar}| [{elapsed}<{remaining}{postfix}]")
        return tqdm(total=n, desc=desc, unit=unit)

    return make if total is None else make(total)


class Progress:
    """Throttled progress over ``total`` steps of a loop (see the module docstring).

    Parameters
    ----------
    progress : bool or callable
        As accepted by :func:`check_progress`.
    total : int
        Number of steps; ``advance`` is called once per finished step (or with ``n``).
    desc : str, default=""
        Label of the tqdm bar.
    unit : str, default="step"
        Unit of the tqdm bar.
    interval : float, default=0.25
        Smallest time in seconds between two calls of a callable (the start and the
        end are always reported).
    """

    __slots__ = ("_bar", "_callback", "_done", "_finished", "_interval", "_kernel", "_last", "_reported",
                 "_runs", "_start", "_started", "_thread", "_total")

    def __init__(self, progress: Any, total: float | None, *, desc: str = "", unit: str = "step",
                 interval: float = 0.25, runs: int = 1):
        progress = check_progress(progress)
        self._interval = check_real(interval, "interval", min_value=0.0)
        # total None: the steps are announced by the kernel runs (begin); the start is
        # reported with the first run, when the total is known
        self._started = total is not None
        self._total: float = max(total, 0) if total is not None else 0
        self._runs = runs
        self._done: float = 0
        self._reported: float = -1
        # kernel runs (begin) may be followed by runs nobody announced (k-NN's redo
        # passes), so once one has begun the end is reported by finish() alone
        self._kernel = False
        self._finished = False
        self._start = time.perf_counter()
        self._last = self._start
        self._thread = threading.get_ident()
        self._bar: Any = None  # a tqdm bar (untyped dependency) or None
        self._callback: Callable[[dict], Any] | None = None
        if progress is True:
            # with the total still unknown: a factory, called by the first begin()
            self._bar = _tqdm_bar(self._total if self._started else None, desc, unit)
        elif callable(progress):
            self._callback = progress
            if self._started:
                self._report(progress, self._start)

    @property
    def active(self) -> bool:
        """Whether anything is reported (a bar or a callable)."""
        return self._bar is not None or self._callback is not None

    def _shown(self) -> float:
        """The steps reported as done: short of the total, while kernel runs may follow."""
        if self._kernel and not self._finished:
            return min(self._done, max(self._total - 1, 0))
        return self._done

    def info(self, now: float | None = None) -> dict:
        """The report ``{"done", "total", "elapsed", "eta"}`` at time ``now``."""
        now = time.perf_counter() if now is None else now
        elapsed = now - self._start
        done = self._shown()
        if done > 0:
            eta = elapsed * max(self._total - done, 0) / done
        else:
            eta = math.nan
        return {"done": done, "total": self._total, "elapsed": elapsed, "eta": eta}

    def _report(self, callback: Callable[[dict], Any], now: float) -> None:
        self._last = now
        self._reported = self._shown()
        callback(self.info(now))

    def advance(self, n: float = 1) -> None:
        """Record ``n`` finished steps; report if due (callable) or update the bar."""
        self._done = min(self._done + n, self._total) if self._total else self._done + n
        if self._bar is not None:
            self._sync_bar()
        elif self._callback is not None and threading.get_ident() == self._thread:
            now = time.perf_counter()
            # the end once (not again for steps beyond the total; after kernel runs, by
            # finish()), else throttled
            end = self._done >= self._total and not (self._kernel and not self._finished)
            # nothing new to tell: a one-step run that ends is held short of its total
            # until finish(), and reported the start's done == 0 a second time
            fresh = self._reported != self._shown()
            if (end and self._reported != self._done) or (fresh and now - self._last >= self._interval):
                self._report(self._callback, now)

    def _sync_bar(self) -> None:
        # the bar shows what a callable would be told: short of the total while kernel
        # runs may follow (a full bar, then a k-NN redo pass, looked done)
        step = self._shown() - self._bar.n
        if step > 0:
            self._bar.update(step)

    def update_to(self, done: float) -> None:
        """Record that ``done`` steps are finished (never moves back); report if due."""
        if done > self._done:
            self.advance(done - self._done)

    def set_total(self, total: float) -> None:
        """Change the number of steps (a kernel run that says how many tasks it has).

        After a kernel run has begun the total only grows: a run smaller than announced
        (the second of two, on fewer rows) leaves its remaining steps to finish().
        """
        if self._kernel:
            total = max(total, self._total)
        if total != self._total:
            self._total = total
            if self._bar is not None:
                self._bar.total = total
                self._bar.refresh()

    # A compiled kernel's tile driver reports ``progress(done, total)`` for its own
    # tasks; a public call may run several kernels (the diameter and the closest pair,
    # k-NN's float64 redo pass, the closest pair's float64 run after a float32 run past
    # its budget), so each run is a segment of this reporter's steps.

    def begin(self, n_tasks: int) -> float:
        """A kernel run of ``n_tasks`` steps starts here; returns its first step.

        The total becomes the steps so far plus ``n_tasks`` for this run and for each
        run still expected (``runs`` in the constructor, all assumed the same size).
        A run that was not expected (k-NN's redo pass, the closest pair's float64 run)
        makes the total grow.
        """
        offset = self._done
        self._kernel = True
        self._runs = max(self._runs - 1, 0)
        total = offset + n_tasks * (1 + self._runs)
        if self._started:
            self.set_total(total)
        else:
            self._total = total
            self._started = True
            if self._bar is not None:
                self._bar = self._bar(self._total)
            if self._callback is not None:
                self._report(self._callback, time.perf_counter())
        return offset

    def kernel_hook(self, n_tasks: int) -> Callable[[int, int], None] | None:
        """``progress(done, total)`` for a compiled kernel of ``n_tasks`` tasks, or None.

        None when nothing is reported, so that the kernel pays nothing.  The kernel's
        own ``total`` is authoritative (``n_tasks`` is the caller's count of the same).
        """
        if not self.active:
            return None
        offset = self.begin(n_tasks)
        later = self._runs

        def hook(done: int, total: int) -> None:
            self.set_total(offset + total * (1 + later))
            self.update_to(offset + done)

        return hook

    def finish(self) -> None:
        """Mark every step done and report the end once (a run with no hook: one step)."""
        self._runs = 0
        if not self._started:
            self.begin(1)
        self.set_total(max(self._total, self._done))
        self._finished = True
        self.update_to(self._total)
        if self._bar is not None:
            self._sync_bar()
        self.flush()

    def flush(self) -> None:
        """Report the current state to a callable unless it has just been reported."""
        if self._callback is not None and self._reported != self._shown():
            self._report(self._callback, time.perf_counter())

    def postfix(self, **values: Any) -> None:
        """Show ``values`` after the tqdm bar (nothing for a callable)."""
        if self._bar is not None:
            self._bar.set_postfix(refresh=False, **values)

    def close(self) -> None:
        """Close the tqdm bar (idempotent)."""
        if self._bar is not None:
            if self._started:  # else a factory that never made a bar
                self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def call_with_progress(fn: Callable[..., Any], *args: Any, progress: Any, desc: str,
                       unit: str = "tile", **kwargs: Any) -> Any:
    """``fn(*args, progress=reporter_or_None, **kwargs)`` with one :class:`Progress`.

    For a public call that is one kernel run: ``fn`` receives the reporter when
    something is reported (it calls :meth:`Progress.kernel_hook` to get the kernel's
    ``progress`` callable) and None otherwise.  The end is reported when ``fn``
    returns (``done == total``; a backend without a hook reports one step).
    """
    with Progress(progress, None, desc=desc, unit=unit) as bar:
        out = fn(*args, progress=bar if bar.active else None, **kwargs)
        bar.finish()
    return out
