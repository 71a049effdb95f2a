"""``refgeo.show_config()``: what this installation can do and how it computes."""

from __future__ import annotations

import json
import os
import platform
import sys
from importlib.metadata import PackageNotFoundError, version as _pkg_version
from typing import Any

from . import _backend, _tiled

__all__ = ["__version__", "show_config"]

# The version lives here, not in __init__, so that show_config needs nothing from the
# package's __init__ (which imports this module).
try:
    __version__ = _pkg_version("refgeo")
except PackageNotFoundError:  # pragma: no cover - running from an uninstalled tree
    __version__ = "0+unknown"


def _config_dict() -> dict[str, Any]:
    import numpy as np

    ext = _backend.extension()
    backends = {
        name: {"available": ok, "detail": why} for name, (ok, why) in _backend.available_backends().items()
    }
    try:
        from threadpoolctl import threadpool_info

        blas = [
            {k: info.get(k) for k in ("internal_api", "version", "num_threads", "threading_layer", "filepath")}
            for info in threadpool_info()
        ]
    except Exception as exc:  # pragma: no cover - threadpoolctl is a dependency
        blas = [{"error": str(exc)}]
    return {
        "refgeo": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "numpy": np.__version__,
        "backends": backends,
        "requested_backend": _backend.get_backend(),
        "require_ext": os.environ.get("REFGEO_REQUIRE_EXT", "") == "1",
        "openmp": {
            "compiled": bool(ext.has_openmp()) if ext is not None else False,
            "max_threads": int(ext.openmp_max_threads()) if ext is not None else 1,
        },
        "threadpools": blas,
        "cupy_matmul": (
            "float32 inputs: IEEE float32 GEMM" if _tiled.matmul_precision("float32") == "float32"
            else "float32 inputs: float64 GEMM (CUPY_TF32=1 is set; TF32 would void the rounding bound)"
        ) + "; float64 inputs: float64 GEMM; refinement in float64",
        "dtype_policy": (
            "float32/float64 kept; integer/bool converted to float64; reference accumulates in "
            "float64; certified results are refined in float64"
        ),
        "torch": _torch_dispatch(backends),
    }


def _torch_dispatch(backends) -> dict[str, Any]:
    """The torch version (from the package metadata: torch is not imported here) and
    where the row-geometry engine functions send each kind of tensor."""
    try:
        torch_version = _pkg_version("torch")
    except PackageNotFoundError:
        torch_version = None
    # the rules of refgeo._backend.select, applied to the NumPy / CuPy views of tensors
    requested = _backend.get_backend()
    if requested == "cupy":
        cpu = "error: backend 'cupy' needs CuPy arrays (pass CUDA tensors)"
    elif requested == "reference" or not backends["cython"]["available"]:
        cpu = "reference (NumPy view)"
    else:
        cpu = "cython (zero-copy NumPy view)"
    if not backends["cupy"]["available"]:
        cuda = "unavailable: install CuPy"
    elif requested == "reference":
        cuda = "reference (zero-copy DLPack to CuPy, array-API code)"
    else:
        cuda = "cupy (zero-copy DLPack)"
    return {"version": torch_version, "cpu_tensors": cpu, "cuda_tensors": cuda}


def show_config(*, mode: str = "stdout") -> dict[str, Any] | None:
    """Print (or return) the version, backends, BLAS/OpenMP threads and dtype policy.

    Parameters
    ----------
    mode : {"stdout", "dicts"}, default="stdout"
        Print a readable report, or return it as a dictionary.

    Returns
    -------
    config : dict or None
        The report when ``mode="dicts"``.

    Examples
    --------
    >>> import refgeo
    >>> cfg = refgeo.show_config(mode="dicts")
    >>> cfg["backends"]["reference"]["available"]
    True
    """
    from ._validate import check_choice

    check_choice(mode, "mode", ("stdout", "dicts"))
    cfg = _config_dict()
    if mode == "dicts":
        return cfg
    print(f"refgeo {cfg['refgeo']} (python {cfg['python']}, numpy {cfg['numpy']})")
    print(f"platform: {cfg['platform']}")
    print(f"requested backend: {cfg['requested_backend']}  (REFGEO_REQUIRE_EXT={int(cfg['require_ext'])})")
    print("backends:")
    for name, b in cfg["backends"].items():
        mark = "available" if b["available"] else "unavailable"
        print(f"  {name:<10} {mark:<12} {b['detail']}")
    omp = cfg["openmp"]
    print(f"openmp: compiled={omp['compiled']} max_threads={omp['max_threads']}")
    print("thread pools (threadpoolctl):")
    for tp in cfg["threadpools"]:
        print("  " + json.dumps(tp))
    print(f"cupy matmul precision: {cfg['cupy_matmul']}")
    print(f"dtype policy: {cfg['dtype_policy']}")
    tv = cfg["torch"]
    print(
        f"torch: {tv['version'] or 'not installed'}  (CPU tensors -> {tv['cpu_tensors']}; "
        f"CUDA tensors -> {tv['cuda_tensors']}; row-geometry engine functions)"
    )
    return None
