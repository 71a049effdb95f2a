"""Foreign arrays in, results back in the caller's framework (PyTorch for now).

A CPU tensor is viewed zero-copy as a NumPy array (``tensor.detach().numpy()``: no
autograd warning, strides kept, so a non-contiguous tensor is copied only where a
kernel needs contiguous rows), and then runs exactly like the NumPy array would,
compiled engine included.  bfloat16 and float16 tensors are upcast to float32 first
(NumPy has no bfloat16, and float32 holds both exactly); results say so.  A CUDA
tensor goes zero-copy through DLPack to CuPy, and so to the CuPy backend; without
CuPy it is an error that says what to install.

Array results come back as tensors on the caller's device (``torch.from_numpy``
shares the memory; ``torch.from_dlpack`` for CuPy results); scalars stay Python
floats.  torch is never imported here: a tensor can only exist once its caller
imported torch, and :func:`array_api_compat.is_torch_array` looks only at
``sys.modules``.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from array_api_compat import is_torch_array

__all__ = ["Origin", "from_foreign", "to_caller"]

# torch dtypes the compiled engine cannot take as they are, and what they become
_UPCAST = {"torch.bfloat16": "float32", "torch.float16": "float32"}


@dataclasses.dataclass(frozen=True, slots=True)
class Origin:
    """Where an input came from, so that results can go back there.

    Attributes
    ----------
    framework : str
        ``"torch"``.
    device : Any
        The tensor's device (``torch.device``).
    converted_from : str or None
        The tensor's dtype when it was upcast (``"torch.bfloat16"``, ``"torch.float16"``).
    """

    framework: str
    device: Any
    converted_from: str | None = None


def from_foreign(x: Any, name: str) -> tuple[Any, Origin | None]:
    """``(array, origin)``: a NumPy (or CuPy) view of a tensor, or ``(x, None)``.

    Raises
    ------
    TypeError
        For a CUDA tensor when CuPy is not installed, and for tensors on other devices.
    """
    if not is_torch_array(x):
        return x, None
    torch = sys.modules["torch"]
    t = x.detach()
    if t.layout != torch.strided:
        raise TypeError(
            f"{name} is a sparse tensor (layout {t.layout}), which refgeo cannot view as an "
            f"array; pass {name}.to_dense()."
        )
    converted = None
    if str(t.dtype) in _UPCAST:
        converted = str(t.dtype)
        t = t.to(torch.float32)
    if t.is_complex():
        raise TypeError(f"{name} must have a real floating dtype (float32 or float64), got dtype {t.dtype} instead.")
    # lazily conjugated or negated views have no NumPy equivalent: materialize them
    t = t.resolve_conj().resolve_neg()
    origin = Origin("torch", t.device, converted)
    if t.device.type == "cpu":
        return t.numpy(), origin
    if t.device.type == "cuda":
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


def to_caller(a: Any, origin: Origin | None) -> Any:
    """An array result in the framework and on the device of ``origin``."""
    if origin is None or a is None:
        return a
    torch = sys.modules["torch"]
    if getattr(origin.device, "type", "cpu") == "cpu":
        return torch.from_numpy(a)
    return torch.from_dlpack(a)
