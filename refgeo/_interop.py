"""Foreign arrays in, results back in the caller's framework (PyTorch, JAX on CPU).

A CPU tensor is viewed zero-copy as a NumPy array (``tensor.detach().numpy()``: no
autograd warning, strides kept, so a non-contiguous tensor is copied only where a
kernel needs contiguous rows), and then runs exactly like the NumPy array would,
compiled engine included.  bfloat16, float16 and float8 tensors are upcast to float32
first (NumPy has none of them, and float32 holds them all exactly); results say so.  A CUDA
tensor goes zero-copy through DLPack to CuPy, and so to the CuPy backend; without
CuPy it is an error that says what to install.  Functions that compute with NumPy
only (``host=True``) take a host copy of a CUDA tensor instead, and return their
arrays to the tensor's device.

Integer, boolean and complex tensors are refused with ``TypeError``: a tensor of
indices or of complex values passed where real rows are expected is a mistake, and
converting it silently would hide that.  (NumPy integer arrays keep their documented
conversion to float64.)

A JAX array on the CPU is viewed through DLPack (zero-copy, read-only) and results
go back through ``jax.numpy.asarray``, except 64-bit results while JAX's x64 mode is
off: those stay NumPy arrays, since JAX would round float64 distances and int64
indices to 32 bits.  JAX arrays on other devices are refused with a ``TypeError``
that says how to convert them (``np.asarray(x)``).

Array results come back as tensors on the caller's device (``torch.from_numpy``
shares the memory; ``torch.from_dlpack`` for CuPy results); scalars come back as
Python floats.  Neither torch nor JAX is imported here: a tensor can only exist once
its caller imported its framework, and :func:`array_api_compat.is_torch_array` and
:func:`array_api_compat.is_jax_array` look only at ``sys.modules``.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import numpy as np
from array_api_compat import is_cupy_array, is_jax_array, is_numpy_array, is_torch_array

__all__ = [
    "Origin",
    "fields_to_caller",
    "first_origin",
    "from_foreign",
    "in_input_dtype",
    "input_eps",
    "mark_modified",
    "precision_eps",
    "to_caller",
    "to_host",
]

# JAX dtypes the compiled engine cannot take as they are, and what they become
_JAX_UPCAST = {"bfloat16": "float32", "float16": "float32"}


@dataclasses.dataclass(frozen=True, slots=True)
class Origin:
    """Where an input came from, so that results can go back there.

    Attributes
    ----------
    framework : str
        ``"torch"`` or ``"jax"``.
    device : Any
        The tensor's device (``torch.device``; the JAX device).
    converted_from : str or None
        The tensor's dtype when it was upcast (``"torch.bfloat16"``, ``"torch.float16"``,
        a torch float8 dtype such as ``"torch.float8_e4m3fn"``, ``"jax.bfloat16"``,
        ``"jax.float16"``).
    """

    framework: str
    device: Any
    converted_from: str | None = None


def _dtype_error(name: str, dtype: Any, hint: str) -> TypeError:
    return TypeError(
        f"{name} must have a real floating dtype (float32 or float64), got dtype {dtype} instead{hint}."
    )


def from_foreign(x: Any, name: str, *, host: bool = False) -> tuple[Any, Origin | None]:
    """``(array, origin)``: a NumPy (or CuPy) view of a tensor, or ``(x, None)``.

    Parameters
    ----------
    x : Any
        The argument as the caller passed it.
    name : str
        The argument's name, for error messages.
    host : bool, default=False
        Return a NumPy array for CUDA tensors too (a host copy; no CuPy needed), for
        functions that compute with NumPy only.

    Raises
    ------
    TypeError
        For integer, boolean or complex tensors, for a CUDA tensor when CuPy is not
        installed (``host=False``), for meta tensors and for tensors on devices refgeo
        cannot run.
    """
    if is_torch_array(x):
        return _from_torch(x, name, host)
    if is_jax_array(x):
        return _from_jax(x, name)
    return x, None


def _from_torch(x: Any, name: str, host: bool) -> tuple[Any, Origin]:
    torch = sys.modules["torch"]
    t = x.detach()
    if t.device.type == "meta":
        # checked first: .cpu() (the hint for other devices) cannot copy a meta tensor
        raise TypeError(
            f"{name} is a meta tensor (a shape without values), which refgeo cannot compute with; "
            "pass a tensor that holds the values."
        )
    if t.layout != torch.strided:
        raise TypeError(
            f"{name} is a sparse tensor (layout {t.layout}), which refgeo cannot view as an "
            f"array; pass {name}.to_dense()."
        )
    converted = None
    # every floating dtype narrower than float32 (bfloat16, float16, the float8 formats)
    # has no NumPy dtype the engine takes, and float32 holds its values exactly (float8
    # raised torch's "Got unsupported ScalarType", naming no argument)
    if t.is_floating_point() and t.element_size() < 4:
        converted = str(t.dtype)
        t = t.to(torch.float32)
    if not t.is_floating_point():
        hint = (
            f"; pass {name}.double() if the values are meant as real numbers"
            if not t.is_complex()
            else ""
        )
        raise _dtype_error(name, t.dtype, hint)
    # lazily conjugated or negated views have no NumPy equivalent: materialize them
    t = t.resolve_conj().resolve_neg()
    origin = Origin("torch", t.device, converted)
    if t.device.type == "cpu":
        return t.numpy(), origin
    if t.device.type == "cuda":
        if host:
            return t.cpu().numpy(), origin
        try:
            import cupy
        except ImportError:
            raise TypeError(
                f"{name} is a CUDA tensor, which refgeo runs through CuPy, and CuPy is not "
                "installed: install it (`pip install cupy-cuda12x` for CUDA 12) or pass "
                f"{name}.cpu() to run on the CPU."
            ) from None
        return cupy.from_dlpack(t), origin
    raise TypeError(
        f"{name} is a tensor on device {t.device}, which refgeo cannot run; pass {name}.cpu()."
    )


def _from_jax(x: Any, name: str) -> tuple[Any, Origin]:
    devices = list(x.devices()) if hasattr(x, "devices") else []
    if any(getattr(d, "platform", "cpu") != "cpu" for d in devices):
        raise TypeError(
            f"{name} is a JAX array on {devices[0]}, which refgeo cannot run; pass "
            f"np.asarray({name}) (a host copy) instead."
        )
    dtype = str(x.dtype)
    converted = None
    if dtype in _JAX_UPCAST:
        converted = f"jax.{dtype}"
        x = x.astype("float32")
        dtype = "float32"
    if dtype not in ("float32", "float64"):
        raise _dtype_error(name, f"jax.{dtype}", "")
    # DLPack gives a read-only NumPy view of the CPU buffer (no copy)
    return np.from_dlpack(x), Origin("jax", devices[0] if devices else None, converted)


# machine epsilon of the float precisions below float64 that a check may allow for
_PRECISION_EPS = {"float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}


def precision_eps(dtype: Any) -> float:
    """Machine epsilon of float32, float16 or bfloat16 (a NumPy dtype or scalar type,
    ``"torch.bfloat16"``, a torch dtype), else 0.0: float64, exact dtypes, and the
    float8 formats, whose rounding is too coarse for a check to allow for it.

    For checks whose tolerance must cover the caller's own rounding: a bfloat16
    cross-entropy gradient has rows that sum to zero only to bfloat16 precision.
    """
    try:
        name = np.dtype(dtype).name  # np.float32, "float16", np.dtype(...)
    except TypeError:  # torch / JAX dtypes and their names
        name = str(dtype).rsplit(".", 1)[-1]  # "torch.bfloat16" -> "bfloat16"
    return _PRECISION_EPS.get(name, 0.0)


def input_eps(x: Any, origin: Origin | None) -> float:
    """:func:`precision_eps` of an input as the caller passed it: the dtype a tensor
    had before its upcast (``origin.converted_from``), else ``x``'s own dtype."""
    if origin is not None and origin.converted_from is not None:
        return precision_eps(origin.converted_from)
    return precision_eps(getattr(x, "dtype", "float64"))


def mark_modified(tensor: Any) -> None:
    """Tell autograd that ``tensor`` was changed in place through a NumPy view.

    torch counts in-place changes made by its own operations; writes through
    ``tensor.numpy()`` are invisible to it, so a graph that saved the tensor would
    differentiate the new values silently instead of raising its "modified by an
    inplace operation" error, as torch's optimizers make it do.
    """
    sys.modules["torch"].autograd.graph.increment_version(tensor)


def first_origin(*origins: Origin | None) -> Origin | None:
    """The first foreign origin among several arguments' (None when all were NumPy)."""
    return next((o for o in origins if o is not None), None)


def _writable(a):
    # torch.from_numpy warns on read-only arrays (results are frozen read-only views):
    # a fresh view of a writable base can be made writable again; otherwise copy
    if a.flags.writeable:
        return a
    v = a.view()
    try:
        v.setflags(write=True)
    except ValueError:
        v = a.copy()
    return v


def to_caller(a: Any, origin: Origin | None) -> Any:
    """An array result in the framework and on the device of ``origin``.

    ``None`` stays ``None``; 0-d results become Python floats; with no origin (NumPy
    input) ``a`` is returned as it is.
    """
    if origin is None or a is None:
        return a
    if getattr(a, "ndim", None) == 0 or np.isscalar(a):
        return float(a)
    if origin.framework == "jax":
        a = np.asarray(a)
        if a.dtype.itemsize == 8 and not sys.modules["jax"].config.read("jax_enable_x64"):
            # JAX without x64 would round float64 distances and int64 indices to 32 bits
            return a
        return sys.modules["jax.numpy"].asarray(a)
    torch = sys.modules["torch"]
    on_cpu = getattr(origin.device, "type", "cpu") == "cpu"
    if is_numpy_array(a):
        t = torch.from_numpy(_writable(a))
        return t if on_cpu else t.to(origin.device)
    return torch.from_dlpack(a)


def in_input_dtype(a: Any, origin: Origin | None) -> Any:
    """A ``to_caller`` result in the dtype the caller's tensor had before its upcast.

    For arrays handed back to the caller's own code (a ``logits_fn``): a bfloat16 model
    cannot take the float32 copy of its bfloat16 states.  The values came from such a
    tensor, so the cast back is exact.  Anything else is returned as it is.
    """
    if origin is None or origin.converted_from is None or a is None or isinstance(a, float):
        return a
    framework, dtype = origin.converted_from.split(".", 1)
    if framework == "torch":
        return a.to(getattr(sys.modules["torch"], dtype))
    return a.astype(dtype)


def fields_to_caller(result: Any, origin: Origin | None) -> Any:
    """A frozen result record with every NumPy array field in the caller's framework.

    Nested records (and tuples of records) are converted too; other fields (floats,
    ints, dicts) are kept.  With no origin the record is returned as it is.
    """
    if origin is None:
        return result
    changes = {}
    for f in dataclasses.fields(result):
        v = getattr(result, f.name)
        if is_numpy_array(v):
            changes[f.name] = to_caller(v, origin)
        elif dataclasses.is_dataclass(v) and not isinstance(v, type):
            changes[f.name] = fields_to_caller(v, origin)
        elif isinstance(v, tuple) and v and all(dataclasses.is_dataclass(b) for b in v):
            changes[f.name] = tuple(fields_to_caller(b, origin) for b in v)
    return dataclasses.replace(result, **changes)


def to_host(a: Any) -> Any:
    """A NumPy array of an array result of any framework (results of earlier calls
    fed back in): zero-copy for CPU tensors and NumPy, a host copy otherwise."""
    if is_torch_array(a):
        t = a.detach().cpu()
        if t.is_floating_point() and t.element_size() < 4:
            # bfloat16, float16 and float8 have no NumPy dtype (torch's "Got unsupported
            # ScalarType"); float32 holds their values exactly, as in from_foreign
            import torch

            t = t.to(torch.float32)
        return t.numpy()
    if is_cupy_array(a):
        return a.get()
    return np.asarray(a)
