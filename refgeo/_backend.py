"""Backend registry and dispatch: ``"reference" | "cython" | "cupy"``.

How a backend is chosen for one call (first rule that applies):

1. The input's array type.  CuPy arrays go to the ``cupy`` backend (or to the
   array-API reference code, which runs on CuPy unchanged, for kernels without GPU
   code); other non-NumPy array-API arrays (array-api-strict, ...) go to ``reference``.
2. ``refgeo.use_backend(name)``, a context manager (the most local setting wins).
3. The ``REFGEO_BACKEND`` environment variable.
4. ``"auto"``: ``cython`` for NumPy inputs when ``refgeo_ext`` is built and the kernel
   has a compiled path, ``reference`` otherwise.

:func:`select` returns the choice as a :class:`Selection` that says why it was made;
the pairwise kernels return a :class:`KernelRun` that carries the backend whose code
actually ran and that reason, so a result never names a backend that did not compute
it.  A kernel never falls back inside a call: every decision is made here, before it
runs.

``REFGEO_REQUIRE_EXT=1`` makes a missing compiled extension an ``ImportError`` at
``import refgeo``, and makes a call raise :class:`ExtensionUnavailableError` instead of
falling back to the reference for a NumPy input that has a compiled path.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from array_api_compat import is_array_api_obj, is_cupy_array, is_dask_array, is_numpy_array

from ._validate import check_int

__all__ = [
    "BACKENDS",
    "ExtensionUnavailableError",
    "KernelInfo",
    "KernelRun",
    "Selection",
    "available_backends",
    "dask_fusion_off",
    "dask_graphs_unfused",
    "dispatch",
    "get_backend",
    "require_ext",
    "resolve_n_threads",
    "run",
    "select",
    "use_backend",
]

BACKENDS = ("reference", "cython", "cupy")
_CHOICES = ("auto",) + BACKENDS


class ExtensionUnavailableError(ImportError):
    """The compiled extension ``refgeo_ext`` is required but could not be imported."""


def _load_extension():
    try:
        import refgeo_ext  # noqa: F401
    except ImportError as exc:  # pragma: no cover - exercised in a build without the extension
        return None, f"refgeo_ext could not be imported: {exc}"
    return refgeo_ext, None


_ext, _ext_error = _load_extension()

def require_ext() -> bool:
    """Whether ``REFGEO_REQUIRE_EXT=1`` is set (read at each call, so tests may set it)."""
    return os.environ.get("REFGEO_REQUIRE_EXT", "") == "1"


if _ext is None and require_ext():
    raise ExtensionUnavailableError(
        f"REFGEO_REQUIRE_EXT=1 but the compiled extension is unavailable ({_ext_error}). "
        "Reinstall with `python -m pip install .` to compile it, or unset REFGEO_REQUIRE_EXT."
    )


def _load_cupy():
    try:
        import cupy  # noqa: F401
    except Exception as exc:  # ImportError, or CUDA errors raised at import
        return None, f"cupy is not importable ({type(exc).__name__}: {exc})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # pragma: no cover - needs a broken CUDA setup
        return None, f"cupy is installed but no CUDA device is usable ({exc})"
    if n < 1:  # pragma: no cover
        return None, "cupy is installed but no CUDA device was found"
    return cupy, None


_requested: contextvars.ContextVar[str | None] = contextvars.ContextVar("refgeo_backend", default=None)


def _check_name(name: Any, source: str) -> str:
    if not isinstance(name, str) or name not in _CHOICES:
        raise ValueError(f"{source} must be one of {_CHOICES}, got {name!r} instead.")
    return name


@contextlib.contextmanager
def use_backend(name: str, /) -> Iterator[str]:
    """Run the enclosed calls on backend ``name`` (``"auto"`` restores the default).

    Parameters
    ----------
    name : {"auto", "reference", "cython", "cupy"}
        Backend for NumPy inputs inside the ``with`` block.  Takes precedence over the
        ``REFGEO_BACKEND`` environment variable; the array type of an input still
        wins (CuPy arrays never run on the cython backend).

    Examples
    --------
    >>> import numpy as np, refgeo
    >>> with refgeo.use_backend("reference"):
    ...     float(refgeo.hilbert_distance_logits(np.zeros(3), np.array([0., 1., 3.])))
    3.0
    """
    name = _check_name(name, "backend name")
    if name == "cython" and _ext is None:
        raise ExtensionUnavailableError(f"backend 'cython' is unavailable: {_ext_error}")
    token = _requested.set(name)
    try:
        yield name
    finally:
        _requested.reset(token)


def get_backend() -> str:
    """The backend requested for NumPy inputs right now (may be ``"auto"``)."""
    name = _requested.get()
    if name is not None:
        return name
    env = os.environ.get("REFGEO_BACKEND", "").strip()
    if env:
        return _check_name(env, "the REFGEO_BACKEND environment variable")
    return "auto"


def available_backends() -> dict[str, tuple[bool, str]]:
    """``{name: (available, reason)}`` for every backend."""
    cupy, cupy_error = _load_cupy()
    return {
        "reference": (True, "pure NumPy / array API; always available"),
        "cython": (
            (True, "refgeo_ext compiled" + (" with OpenMP" if _ext.has_openmp() else " without OpenMP"))
            if _ext is not None
            else (False, _ext_error)
        ),
        "cupy": (True, f"cupy {cupy.__version__}") if cupy is not None else (False, cupy_error),
    }


@dataclasses.dataclass(frozen=True, slots=True)
class KernelInfo:
    """Registry entry for one kernel (in the spirit of SciPy's ``MetricInfo``).

    Attributes
    ----------
    name : str
        Public name of the operation.
    reference : callable
        Array-API implementation; the oracle, runs on any namespace.
    cython : callable or None
        Wrapper around ``refgeo_ext`` for NumPy float32/float64 inputs; it takes every
        input the public function validated (no fallback inside a call).
    cupy : callable or None
        GPU implementation for CuPy arrays; without one CuPy inputs run ``reference``.
    dask : callable or None
        Task-graph implementation for Dask arrays (``refgeo._dask``); without one Dask
        inputs run ``reference``.
    """

    name: str
    reference: Callable[..., Any]
    cython: Callable[..., Any] | None = None
    cupy: Callable[..., Any] | None = None
    dask: Callable[..., Any] | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Selection:
    """The backend :func:`select` chose for one call, and why.

    Attributes
    ----------
    backend : str
        ``"reference"``, ``"cython"`` or ``"cupy"``.
    kernel : callable
        The implementation to call.
    reason : str
        One line saying which rule chose it (for results and error messages).
    """

    backend: str
    kernel: Callable[..., Any]
    reason: str


@dataclasses.dataclass(frozen=True, slots=True)
class KernelRun:
    """What one pairwise kernel computed, on the rows it was given.

    Extreme-pair kernels fill ``value, i, j``; per-row kernels (farthest partners,
    k-NN) fill ``indices, distances``.  Distances are those of the rows passed in
    (the public functions pass rows prescaled by a power of two and scale back).

    Attributes
    ----------
    backend : str
        The backend whose code produced the numbers.
    reason : str
        Why that backend ran (:attr:`Selection.reason`; empty until :func:`run` sets it).
    error_bound : float
        A-priori bound on ``|filtered - refined|`` of the squared distances (0.0 when
        every pair was evaluated directly).
    n_refined : int
        Pairs evaluated by direct float64 differences.
    value : float or None
        The extreme distance.
    i, j : int or None
        The extreme pair, ``i < j``.
    indices, distances : array or None
        Per-row partner indices (int64) and distances (float64).
    """

    backend: str
    error_bound: float
    n_refined: int
    reason: str = ""
    value: float | None = None
    i: int | None = None
    j: int | None = None
    indices: Any = None
    distances: Any = None


_FUSE = "optimization.fuse.active"
_fusion_lock = threading.Lock()


@dataclasses.dataclass
class _Fusion:
    inside: int = 0  # calls inside dask_fusion_off
    before: Any = None  # the setting before the first of them


_fusion = _Fusion()


@contextlib.contextmanager
def dask_fusion_off() -> Iterator[None]:
    """Dask's low-level task fusion (``optimization.fuse.active``) off inside the block.

    Calls may overlap in several threads, and Dask's configuration is one global
    dictionary: ``dask.config.set`` used as a context manager restores what it found,
    so with two overlapping calls the one that ends last would restore the other's
    ``False`` and leave fusion off for good.  Here the first call to enter saves the
    setting and the last to leave restores it.
    """
    import dask

    with _fusion_lock:
        if _fusion.inside == 0:
            _fusion.before = dask.config.get(_FUSE, None)
            dask.config.set({_FUSE: False})
        _fusion.inside += 1
    try:
        yield
    finally:
        with _fusion_lock:
            _fusion.inside -= 1
            if _fusion.inside == 0:
                dask.config.set({_FUSE: _fusion.before})


def dask_graphs_unfused(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with Dask's low-level task fusion off (:func:`dask_fusion_off`) while it
    runs, when one of its arguments is a Dask array.

    Why: one call submits several graphs over the same chunks of its input (the
    finiteness check, the duplicate-row hashes and comparisons, the pairwise tasks on a
    subset of the rows), and each optimization fuses the input's tasks by how that graph
    uses them, so a chunk key can arrive with a different task in two consecutive
    graphs.  The distributed scheduler then warns ("Detected different `run_spec`",
    see docs/cluster.md) while the old task is still remembered: harmless for the result,
    alarming for the user, and it was measured in 54 of 120 calls on masked and
    rechunked inputs with duplicate rows.  Without fusion every graph gives each key
    its own unchanged task (0 of 120).  Culling and Dask's blockwise fusion, which
    name their outputs afresh, still run; the cost is one more small task per chunk
    along a chain of chunk operations, against a pairwise task per block pair.
    """

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        # a Dask array exists only once its caller imported Dask
        if "dask" not in sys.modules or not any(is_dask_array(a) for a in (*args, *kwargs.values())):
            return fn(*args, **kwargs)
        with dask_fusion_off():
            return fn(*args, **kwargs)

    return call


def _array_kind(a: Any) -> str:
    return f"{type(a).__module__.split('.')[0]}.{type(a).__name__}"


def select(info: KernelInfo, *arrays: Any) -> Selection:
    """Pick the backend for a call of ``info`` on ``arrays`` (None entries ignored)."""
    arrays = tuple(a for a in arrays if a is not None)
    requested = get_backend()
    if info.dask is not None and any(is_dask_array(a) for a in arrays):
        # the array type wins, whatever was requested: the task graph runs the engine
        # on NumPy blocks on the workers (refgeo._dask)
        return Selection("dask", info.dask, "Dask input runs the task-graph engine")
    if any(is_cupy_array(a) for a in arrays):
        if requested == "reference":
            return Selection("reference", info.reference, "CuPy input, reference backend requested")
        if info.cupy is None:
            return Selection("reference", info.reference, f"CuPy input; {info.name} has no GPU code")
        return Selection("cupy", info.cupy, "CuPy input")
    foreign = [a for a in arrays if is_array_api_obj(a) and not is_numpy_array(a)]
    if foreign:
        if requested not in ("auto", "reference"):
            raise ValueError(
                f"backend {requested!r} cannot run {info.name} on "
                f"{type(foreign[0]).__module__} arrays; only 'reference' is array-API generic."
            )
        return Selection(
            "reference", info.reference, f"{_array_kind(foreign[0])} input runs the array-API reference"
        )
    if requested == "reference":
        return Selection("reference", info.reference, _requested_text("reference"))
    if requested == "cupy":
        raise ValueError(
            f"backend 'cupy' needs CuPy arrays, got {type(arrays[0]).__name__} instead; "
            "convert with cupy.asarray(...)."
        )
    if requested == "cython" and _ext is None:
        raise ExtensionUnavailableError(f"backend 'cython' is unavailable: {_ext_error}")
    if info.cython is None:
        return Selection("reference", info.reference, f"{info.name} has no compiled path")
    if _ext is None:
        if require_ext():
            raise ExtensionUnavailableError(
                f"REFGEO_REQUIRE_EXT=1 but {info.name} would fall back to the reference: {_ext_error}."
            )
        return Selection("reference", info.reference, f"fallback: {_ext_error}")
    why = _requested_text("cython") if requested == "cython" else "auto: refgeo_ext is built, NumPy input"
    return Selection("cython", info.cython, why)


def _requested_text(name: str) -> str:
    if _requested.get() is not None:
        return f"use_backend({name!r})"
    return f"REFGEO_BACKEND={name}"


def dispatch(info: KernelInfo, *arrays: Any) -> tuple[str, Callable[..., Any]]:
    """``(backend, implementation)`` of :func:`select`, for callers that need no reason."""
    s = select(info, *arrays)
    return s.backend, s.kernel


def run(info: KernelInfo, arrays: tuple[Any, ...], *args: Any, **kwargs: Any) -> KernelRun:
    """Select the backend for ``arrays`` and run ``kernel(*args, **kwargs)`` on it.

    Returns the kernel's :class:`KernelRun` with the selection's reason filled in.
    """
    s = select(info, *arrays)
    result = s.kernel(*args, **kwargs)
    if result.backend != s.backend:  # pragma: no cover - a kernel that falls back is a bug
        raise RuntimeError(f"{info.name}: {s.backend!r} was selected but {result.backend!r} ran")
    return dataclasses.replace(result, reason=s.reason)


def resolve_n_threads(n_threads: Any) -> int:
    """``None`` -> every OpenMP thread; otherwise a positive int (checked)."""
    if n_threads is None:
        return int(_ext.openmp_max_threads()) if _ext is not None else 1
    return check_int(n_threads, "n_threads", min_value=1)


def extension():
    """The imported ``refgeo_ext`` module, or ``None``."""
    return _ext
