"""Backend registry and dispatch: ``"reference" | "cython" | "cupy"``.

How a backend is chosen for one call (first rule that applies):

1. The input's array type.  CuPy arrays go to the ``cupy`` backend (or to the
   array-API reference code, which runs on CuPy unchanged, for kernels without GPU
   code); other non-NumPy array-API arrays (array-api-strict, ...) go to ``reference``.
2. ``refgeo.use_backend(name)``, a context manager (the most local setting wins).
3. The ``REFGEO_BACKEND`` environment variable.
4. ``"auto"``: ``cython`` for NumPy inputs when ``refgeo_ext`` is built and the kernel
   has a compiled path usable for these inputs, ``reference`` otherwise.

``REFGEO_REQUIRE_EXT=1`` makes a missing compiled extension an ``ImportError`` at
``import refgeo`` instead of a silent fallback to the reference backend.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
from collections.abc import Callable, Iterator
from typing import Any

from array_api_compat import is_array_api_obj, is_cupy_array, is_numpy_array

__all__ = [
    "BACKENDS",
    "ExtensionUnavailableError",
    "KernelInfo",
    "available_backends",
    "dispatch",
    "get_backend",
    "resolve_n_threads",
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

if _ext is None and os.environ.get("REFGEO_REQUIRE_EXT", "") == "1":
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
def use_backend(name: str) -> Iterator[str]:
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
        Wrapper around ``refgeo_ext`` for NumPy float32/float64 inputs.
    cupy : callable or None
        GPU implementation for CuPy arrays; without one CuPy inputs run ``reference``.
    usable : callable or None
        ``usable(*arrays) -> bool``: can the compiled paths take these inputs?
    """

    name: str
    reference: Callable[..., Any]
    cython: Callable[..., Any] | None = None
    cupy: Callable[..., Any] | None = None
    usable: Callable[..., bool] | None = None


def dispatch(info: KernelInfo, *arrays: Any) -> tuple[str, Callable[..., Any]]:
    """Pick ``(backend_name, implementation)`` for a call of ``info`` on ``arrays``."""
    arrays = tuple(a for a in arrays if a is not None)
    if any(is_cupy_array(a) for a in arrays):
        if get_backend() == "reference" or info.cupy is None:
            return "reference", info.reference
        return "cupy", info.cupy
    if any(is_array_api_obj(a) and not is_numpy_array(a) for a in arrays):
        requested = get_backend()
        if requested not in ("auto", "reference"):
            raise ValueError(
                f"backend {requested!r} cannot run {info.name} on "
                f"{type(arrays[0]).__module__} arrays; only 'reference' is array-API generic."
            )
        return "reference", info.reference
    requested = get_backend()
    if requested == "reference":
        return "reference", info.reference
    if requested == "cupy":
        raise ValueError(
            f"backend 'cupy' needs CuPy arrays, got {type(arrays[0]).__name__} instead; "
            "convert with cupy.asarray(...)."
        )
    fast_ok = info.cython is not None and (info.usable is None or info.usable(*arrays))
    if requested == "cython":
        if _ext is None:
            raise ExtensionUnavailableError(f"backend 'cython' is unavailable: {_ext_error}")
        if fast_ok:
            return "cython", info.cython
        return "reference", info.reference
    if _ext is not None and fast_ok:
        return "cython", info.cython
    return "reference", info.reference


def resolve_n_threads(n_threads: Any) -> int:
    """``None`` -> every OpenMP thread; otherwise a positive int (checked)."""
    from ._validate import check_int

    if n_threads is None:
        return int(_ext.openmp_max_threads()) if _ext is not None else 1
    return check_int(n_threads, "n_threads", min_value=1)


def extension():
    """The imported ``refgeo_ext`` module, or ``None``."""
    return _ext
