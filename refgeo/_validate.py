"""Argument checks shared by every public function.

All user-facing error text lives here, in one form:
``"{name} must be {requirement}, got {observed} instead."``  Values and shapes raise
``ValueError``; a wrong kind of object (a string where an array is expected, a complex
or object dtype) raises ``TypeError``.

Dtype policy (documented in the README): float32 and float64 arrays are kept as they
are; integer and boolean arrays are converted to float64; complex, object and string
arrays are rejected with ``TypeError``, and so are masked arrays with masked entries (the
mask would be ignored).  NumPy results are C-contiguous (Fortran-order,
strided and reversed inputs are copied), so no result depends on the memory layout;
``contiguous=False`` skips the copy for callers that are exact in any memory order.
"""

from __future__ import annotations

import math
import numbers
import sys
from typing import Any, Literal, TypeVar, overload

import numpy as np
from array_api_compat import array_namespace, is_array_api_obj, is_dask_array, is_numpy_array

from ._certify import unscale

__all__ = [
    "as_float_array",
    "check_axis",
    "check_bool",
    "check_callable",
    "check_centered_rows",
    "check_decay",
    "check_choice",
    "check_finite",
    "check_int",
    "check_min_rows",
    "check_no_repeated_entries",
    "check_nonnegative",
    "check_open_unit_interval",
    "check_real",
    "check_same_shape",
    "check_same_trailing",
]

# Elements per block of the finiteness check of a large NumPy array: the temporaries stay
# at about 1 MiB whatever the input (a memory-mapped matrix is then read once, in blocks).
_FINITE_BLOCK = 1 << 20

# The type of the choices of ``check_choice``: a tuple of ``Literal`` strings gives back
# that ``Literal`` type, so a checked argument keeps its annotated type.
_Choice = TypeVar("_Choice", bound=str)


def _describe_dtype(x) -> str:
    return str(getattr(x, "dtype", type(x).__name__))


def _dtype_error(name: str, x) -> TypeError:
    # arrays, unlike tensors (refgeo._interop), have their integers and booleans converted:
    # the message says so, as it refuses strings and complex numbers
    return TypeError(
        f"{name} must have a real floating dtype (float32 or float64; integer and boolean arrays "
        f"are converted to float64), got dtype {_describe_dtype(x)} instead."
    )


def _bound_error(name: str, value, relation: str, bound) -> ValueError:
    return ValueError(f"{name} == {value}, must be {relation} {bound}.")


def _check_unmasked(n_masked: int, name: str, fill: str = "{}.filled(value)") -> None:
    if n_masked:
        raise TypeError(
            f"{name} must not have masked entries (NumPy would use the values under "
            f"the mask), got {n_masked} masked entr{'y' if n_masked == 1 else 'ies'} instead; "
            f"pass {fill.format(name)} or leave the masked rows out."
        )


def as_float_array(
    x: Any,
    name: str,
    *,
    ndim: int | tuple[int, ...] | None = None,
    min_ndim: int | None = None,
    shape_hint: str | None = None,
    allow_empty: bool = False,
    finite: bool = True,
    contiguous: bool = True,
    keep_zeros: bool = False,
):
    """Return ``x`` as a float32/float64 array of its own namespace, or raise.

    NumPy inputs and Python sequences become C-contiguous NumPy arrays; other
    array-API arrays (CuPy, array-api-strict) stay in their namespace.
    ``contiguous=False`` keeps a NumPy input's layout (no copy), for callers whose
    results are exact whatever the memory order (differences, maxima and minima).
    ``keep_zeros=True``: for non-negative inputs whose zeros mean something (the
    support of a probability vector), a long-double entry too small for float64 is a
    ``ValueError``, not a new zero.
    """
    if isinstance(x, (str, bytes)) or x is None:
        raise TypeError(f"{name} must be an array of real numbers, got {type(x).__name__} instead.")
    if is_array_api_obj(x) and not is_numpy_array(x):
        if is_dask_array(x) and isinstance(getattr(x, "_meta", None), np.ma.MaskedArray):
            # its tasks read the blocks through np.asarray, the values under the mask
            # included (a masked NaN passed the finiteness check, whose masked .all()
            # skips it): refused as a NumPy masked array is, where something is masked
            import dask.array as da  # a Dask array is here: dask is importable

            _check_unmasked(int(da.ma.getmaskarray(x).sum().compute()), name, "dask.array.ma.filled({}, value)")
        if is_dask_array(x) and math.prod(x.shape) > 0 and any(0 in c for c in x.chunks):
            # a boolean mask leaves empty chunks, and Dask's own reductions (the
            # integer check's min and max, the max of the prescaling) then fail to
            # concatenate; dropping them moves no data.  (Unknown sizes are NaN: their
            # product is not > 0, and they are refused below.)
            x = x.rechunk(tuple(tuple(n for n in c if n) for c in x.chunks))
        xp = array_namespace(x)
        if xp.isdtype(x.dtype, "real floating"):
            arr = x
        elif xp.isdtype(x.dtype, ("integral", "bool")):
            _check_exact_integers(xp, x, name)
            arr = xp.astype(x, xp.float64)
        else:
            raise _dtype_error(name, x)
    else:
        if isinstance(x, np.ma.MaskedArray):
            _check_unmasked(int(np.ma.count_masked(x)), name)
        try:
            arr = np.asarray(x)
        except Exception as exc:  # ragged lists and the like
            raise TypeError(f"{name} must be an array of real numbers, could not convert it: {exc}") from None
        kind = arr.dtype.kind
        if kind in "iub":
            _check_exact_integers(np, arr, name)
            arr = arr.astype(np.float64)
        elif kind == "f":
            if not isinstance(x, np.ndarray):
                _check_listed_integers(x, arr, name)
            if arr.dtype not in (np.float32, np.float64):
                # float16 / longdouble: compute in float64, which holds float16 exactly.
                wide = arr
                with np.errstate(over="ignore"):
                    arr = arr.astype(np.float64)
                if finite and wide.dtype.itemsize > 8:
                    _check_float64_range(wide, arr, name)
                if keep_zeros and wide.dtype.itemsize > 8:
                    _check_no_new_zeros(wide, arr, name)
        else:
            if kind == "O" and isinstance(x, (list, tuple, int)):
                # integers beyond every integer dtype (from 2**64, or below -2**63) make
                # NumPy build an object array: the documented range error, not a dtype one
                # (a bare int too: its 0-d array is refused for its shape only after this)
                _check_listed_integers(x, None, name)
            raise _dtype_error(name, arr)
        if contiguous and not arr.flags.c_contiguous:
            # NumPy's reductions and BLAS pick their summation order from the strides:
            # one layout for every caller makes the results independent of it
            arr = np.ascontiguousarray(arr)
    shape = tuple(arr.shape)
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if arr.ndim not in allowed:
            want = shape_hint or " or ".join(f"{k}-D" for k in allowed) + " array"
            raise ValueError(
                f"{name} must be a {want}, got shape {shape} instead."
                if shape_hint
                else f"{name} must be a {want}, got {arr.ndim}-D array of shape {shape} instead."
            )
    if min_ndim is not None and arr.ndim < min_ndim:
        raise ValueError(
            f"{name} must be an array with at least {min_ndim} dimension(s), got shape {shape} instead."
        )
    if any(isinstance(n, float) and math.isnan(n) for n in shape):
        # a Dask array after a boolean mask: its sizes are unknown until computed
        raise ValueError(
            f"{name} has unknown chunk sizes (shape {shape}); call {name}.compute_chunk_sizes() first."
        )
    if not allow_empty and math.prod(shape) == 0:
        raise ValueError(f"{name} must be non-empty, got shape {shape} instead.")
    if finite:
        check_finite(arr, name)
    return arr


def beyond_float64(wide) -> tuple[int, Any]:
    """``(count, largest magnitude or None)`` of the finite entries of a (long double)
    NumPy array that become infinite in float64."""
    with np.errstate(over="ignore"):
        beyond = np.isinf(wide.astype(np.float64)) & np.isfinite(wide)
    n = int(np.count_nonzero(beyond))
    return n, (np.max(np.abs(wide[beyond])) if n else None)


def float64_range_error(name: str, n: int, top) -> ValueError:
    """The error for ``n`` finite entries of ``name`` beyond the float64 range, the
    largest of magnitude ``top``."""
    return ValueError(
        f"{name} must have entries within the float64 range (|x| <= "
        f"{np.finfo(np.float64).max:.4g}), got {n} entr{'y' if n == 1 else 'ies'} beyond it "
        f"(largest {np.format_float_scientific(top, precision=3, trim='-')}) instead."
    )


# integers of magnitude up to 2**53 are exactly float64; 2**53 + 1 is not
EXACT_INTEGER_LIMIT = 2**53


def integer_magnitude(lo, hi) -> int:
    """The largest magnitude of integer entries whose minimum is ``lo`` and maximum ``hi``."""
    return max(int(hi), -int(lo))


def integer_range_error(name: str, top: int) -> ValueError:
    """The error for integer entries of ``name`` beyond 2**53 in magnitude (largest ``top``)."""
    return ValueError(
        f"{name} must have integer entries of magnitude at most 2**53 = {EXACT_INTEGER_LIMIT}, which "
        f"float64 holds exactly, got {top} instead: refgeo computes in float64, where 2**53 + 1 "
        f"and 2**53 are one number. Convert {name} to float64 yourself if that rounding is acceptable."
    )


def _check_exact_integers(xp, arr, name: str) -> None:
    """``ValueError`` for 64-bit integer entries that float64 may not hold (narrower
    integers always fit): a silent rounding made rows that differ exact copies (the
    closest pair of rows 2**62 and 2**62 + 1 was 0)."""
    if xp.isdtype(arr.dtype, "bool") or xp.iinfo(arr.dtype).bits < 64 or math.prod(arr.shape) == 0:
        return
    lo, hi = xp.min(arr), xp.max(arr)
    if hasattr(lo, "dask"):  # a Dask array: one pass over its chunks for both
        import dask

        lo, hi = dask.compute(lo, hi)
    top = integer_magnitude(lo, hi)
    if top > EXACT_INTEGER_LIMIT:
        raise integer_range_error(name, top)


def _check_listed_integers(x, arr, name: str) -> None:
    """``ValueError`` for Python integers beyond 2**53 in a list that NumPy made float64
    (it does so for integers from 2**63 on beside others) or, ``arr=None``, an object
    array (a list, or a bare int): the check of 64-bit integer arrays never saw them.  Only lists whose float64
    array holds such magnitudes are looked at again, as Python objects."""
    if not isinstance(x, (list, tuple, int)) or (arr is not None and not bool((np.abs(arr) > EXACT_INTEGER_LIMIT).any())):
        return  # (NaN compares False: a NaN beside such integers does not hide them)
    ints = [v for v in np.asarray(x, dtype=object).ravel() if isinstance(v, (int, np.integer))
            and not isinstance(v, (bool, np.bool_))]
    top = max((abs(int(v)) for v in ints), default=0)
    if top > EXACT_INTEGER_LIMIT:
        raise integer_range_error(name, top)


def _check_float64_range(wide, arr, name: str) -> None:
    """``ValueError`` for finite long-double entries that became inf in float64 (the
    finiteness check would report infinities the input did not have)."""
    if bool(np.all(np.isfinite(arr))):
        return
    n, top = beyond_float64(wide)
    if n:
        raise float64_range_error(name, n, top)


def _check_no_new_zeros(wide, arr, name: str) -> None:
    """``ValueError`` for nonzero long-double entries that became 0 in float64: where
    zeros mark a support, that changes the answer (a finite distance became inf).
    A negative one (it became -0.0, which passes a check for entries >= 0) is named
    as negative: ``keep_zeros`` is for non-negative inputs."""
    lost = (arr == 0) & (wide != 0)
    n = int(np.count_nonzero(lost))
    if n and bool(np.any(wide[lost] < 0)):
        small = np.format_float_scientific(np.min(wide[lost]), precision=3, trim="-")
        raise ValueError(f"{name} must have entries >= 0, got an entry of {small} (long double) instead.")
    if n:
        small = np.format_float_scientific(np.max(np.abs(wide[lost])), precision=3, trim="-")
        entries = "entry" if n == 1 else "entries"
        raise ValueError(
            f"{name} must have nonzero entries within the float64 range, got {n} {entries} "
            f"of magnitude at most {small} (long double), which float64 holds as 0; the "
            "distances take logs, so pass the logs as logits instead (the *_logits "
            "functions), computed in long double and converted."
        )


def _all_finite(xp, x) -> bool:
    if not is_numpy_array(x) or x.ndim == 0 or x.size <= _FINITE_BLOCK:
        return bool(xp.all(xp.isfinite(x)))
    rows = max(1, _FINITE_BLOCK // max(1, x.size // x.shape[0]))
    return all(bool(np.isfinite(x[a : a + rows]).all()) for a in range(0, x.shape[0], rows))


def _check_finite_chunks(x, name: str) -> None:
    """The finiteness check of a Dask array, naming the row range of the first bad chunk."""
    ok = x.map_blocks(
        lambda b: np.isfinite(b).all(axis=tuple(range(1, b.ndim))), drop_axis=list(range(1, x.ndim)),
        dtype=bool,
    ).compute()
    if bool(ok.all()):
        return
    bad = int(np.argmin(ok))
    edges = np.cumsum((0,) + tuple(x.chunks[0]))
    c = int(np.searchsorted(edges, bad, side="right")) - 1
    raise ValueError(
        f"{name} must contain only finite values, got NaN or infinite entries in the chunk "
        f"of rows {int(edges[c])}:{int(edges[c + 1])} (first at row {bad}) instead."
    )


def check_finite(x, name: str) -> None:
    """Raise ``ValueError`` if ``x`` holds NaN or infinity (large arrays are checked in blocks)."""
    if is_dask_array(x) and x.ndim >= 1:
        return _check_finite_chunks(x, name)
    xp = array_namespace(x)
    if not _all_finite(xp, x):
        n_nan = int(xp.sum(xp.astype(xp.isnan(x), xp.int64)))
        n_inf = int(xp.sum(xp.astype(xp.isinf(x), xp.int64)))
        raise ValueError(
            f"{name} must contain only finite values, got {n_nan} NaN and {n_inf} infinite "
            f"entries instead."
        )


def check_nonnegative(x, name: str, what: str = "Hilbert distance") -> None:
    """Raise ``ValueError`` if ``x`` has negative entries (probability-like inputs)."""
    xp = array_namespace(x)
    if bool(xp.any(x < 0)):
        lo = float(xp.min(x))
        raise ValueError(f"{name} must have entries >= 0 for the {what}, got a smallest entry of {lo:.1e} instead.")


def check_axis(axis: Any, ndim: int, name: str = "axis") -> int:
    """Normalize an axis index for an array of ``ndim`` dimensions."""
    if isinstance(axis, bool) or not isinstance(axis, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {type(axis).__name__} instead.")
    axis = int(axis)
    if not -ndim <= axis < ndim:
        raise ValueError(f"{name} must be in [-{ndim}, {ndim - 1}] for a {ndim}-D array, got {axis} instead.")
    return axis % ndim


# Overloads: without ``allow_none=True`` the result is always an ``int``, so callers need
# no ``None`` narrowing after the check.
@overload
def check_int(
    value: Any,
    name: str,
    *,
    min_value: int | None = ...,
    max_value: int | None = ...,
    allow_none: Literal[False] = ...,
) -> int: ...


@overload
def check_int(
    value: Any,
    name: str,
    *,
    min_value: int | None = ...,
    max_value: int | None = ...,
    allow_none: bool,
) -> int | None: ...


def check_int(
    value: Any,
    name: str,
    *,
    min_value: int | None = None,
    max_value: int | None = None,
    allow_none: bool = False,
) -> int | None:
    """Return ``value`` as int after range checks (``min_value <= value <= max_value``)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} ({value!r}) instead.")
    value = int(value)
    if min_value is not None and value < min_value:
        raise _bound_error(name, value, ">=", min_value)
    if max_value is not None and value > max_value:
        raise _bound_error(name, value, "<=", max_value)
    return value


def check_bool(value: Any, name: str) -> bool:
    """Return ``value`` as bool; only ``bool`` and ``numpy.bool_`` are accepted
    (``"no"`` or ``0`` for a flag is a mistake, not a value)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} instead.")
    return bool(value)


def check_real(
    value: Any,
    name: str,
    *,
    min_value: float | None = None,
    strict: bool = False,
    allow_inf: bool = False,
) -> float:
    """Return ``value`` as float: finite (unless ``allow_inf``), and ``>= min_value``
    (``> min_value`` with ``strict``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} ({value!r}) instead.")
    try:
        value = float(value)
    except OverflowError:  # a Python int or Fraction beyond the float64 range
        text = repr(value)
        raise ValueError(
            f"{name} must be a finite number, got {text[:20] + '...' if len(text) > 24 else text} instead."
        ) from None
    if math.isnan(value) or (math.isinf(value) and not allow_inf):
        raise ValueError(f"{name} must be a finite number, got {value} instead.")
    if min_value is not None:
        if strict and not value > min_value:
            raise _bound_error(name, value, ">", min_value)
        if not strict and not value >= min_value:
            raise _bound_error(name, value, ">=", min_value)
    return value


def check_open_unit_interval(value: Any, name: str) -> float:
    """Return ``value`` as float after checking ``0 < value < 1`` (tolerances, fractions)."""
    value = check_real(value, name, min_value=0.0, strict=True)
    if not value < 1.0:
        raise ValueError(f"{name} must be in (0, 1), got {value} instead.")
    return value


def check_decay(lr: float, weight_decay: float) -> None:
    """Raise ``ValueError`` when the decoupled decay ``param *= 1 - lr * weight_decay``
    multiplies the parameters by more than 1 in size (``lr * weight_decay > 2``): they
    would grow without bound, to inf and NaN, whatever the gradients."""
    if lr * weight_decay > 2.0:
        raise ValueError(
            f"weight_decay == {weight_decay!r}, must be <= 2 / lr = {2.0 / lr:.6g}: the decay multiplies the "
            f"parameters by 1 - lr * weight_decay = {1.0 - lr * weight_decay:.6g} at every step, which makes "
            "them grow without bound."
        )


def check_step_size(lr: float, project: bool, top: float, what: str) -> None:
    """Raise ``ValueError`` when a RowNorm or diameter-LMO step cannot be held in the
    dtype of the parameter (``what``: its name and dtype; ``top``: the dtype's largest
    value): the step's rows have norm at most ``lr`` (``2 lr`` with RowNorm's outer
    centering; a centered LMO step of diameter ``lr`` has rows within ``lr`` of 0), and an
    ``lr`` beyond ``top`` wrote inf and NaN into the weights without an error
    (``lr=1e39`` for a float32 weight, ``1e5`` for a float16 one)."""
    reach = 2.0 * lr if project else lr
    if reach > top:
        limit = top / 2.0 if project else top
        raise ValueError(
            f"lr == {lr!r}, must be <= {limit:.6g} for {what}: the step's entries reach "
            f"{'2 lr (project=True)' if project else 'lr'}, beyond the dtype's largest value {top:.6g}."
        )


def check_choice(value: Any, name: str, choices: tuple[_Choice, ...]) -> _Choice:
    """Check that ``value`` is one of the string ``choices``."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, one of {choices}, got {type(value).__name__} instead.")
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r} instead.")
    return value


def check_same_trailing(a, b, names: tuple[str, str], what: str = "number of columns") -> None:
    """Raise unless ``a`` and ``b`` agree in their last dimension."""
    if a.shape[-1] != b.shape[-1]:
        raise ValueError(
            f"{names[0]} and {names[1]} must have the same {what}, got shapes "
            f"{tuple(a.shape)} and {tuple(b.shape)} instead."
        )


def check_min_rows(x, name: str, min_rows: int, shape_hint: str = "(V, d)") -> None:
    """Raise ``ValueError`` unless the 2-D array ``x`` has at least ``min_rows`` rows."""
    if x.shape[0] < min_rows:
        raise ValueError(
            f"{name} must have at least {min_rows} rows (shape {shape_hint}), "
            f"got shape {tuple(x.shape)} instead."
        )


def check_same_shape(a, b, names: tuple[str, str]) -> None:
    """Raise ``ValueError`` unless ``a`` and ``b`` have the same shape."""
    if tuple(a.shape) != tuple(b.shape):
        raise ValueError(
            f"{names[0]} and {names[1]} must have the same shape, got shapes "
            f"{tuple(a.shape)} and {tuple(b.shape)} instead."
        )


def outside_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning issued by this function's caller point at
    the first frame outside refgeo (the user's call), however many refgeo frames
    (wrappers such as ``dask_graphs_unfused``, private helpers) lie between."""
    level = 1
    frame: Any = sys._getframe(1)  # FrameType, then FrameType | None
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] == "refgeo":
        frame, level = frame.f_back, level + 1
    return level


def check_callable(value: Any, name: str) -> None:
    """Raise ``TypeError`` unless ``value`` is callable."""
    if not callable(value):
        raise TypeError(f"{name} must be callable, got {type(value).__name__} instead.")


def check_centered_rows(x, name: str, rtol: float, exponent: int = 0) -> None:
    """Raise ``ValueError`` unless the rows of the 2-D array ``x`` sum to about zero:
    ``||sum_i x_i|| <= rtol * sum_i ||x_i||`` (float64 accumulation).  ``x`` may be the
    caller's array times ``2**-exponent`` (scaled so that no sum overflows): the
    message reports the caller's values."""
    xp = array_namespace(x)
    xf = xp.astype(x, xp.float64) if x.dtype != xp.float64 else x
    total = float(xp.linalg.vector_norm(xp.sum(xf, axis=0)))
    scale = float(xp.sum(xp.linalg.vector_norm(xf, axis=1)))
    if total > rtol * scale:
        if exponent:
            # the numbers of the caller's G (a message about 1.8e-01 for rows of 1e-20
            # described the scaled copy); beyond float64 they read inf
            total, scale = unscale(total, exponent), unscale(scale, exponent)
        raise ValueError(
            f"{name} must have rows summing to zero (1^T {name} = 0, as for cross-entropy "
            f"gradients; ||sum of rows|| <= {rtol:g} * sum of row norms), got "
            f"||sum of rows|| = {total:.3e} against sum of row norms {scale:.3e} instead. "
            f"Center it first with refgeo.center_rows({name}) if that is intended."
        )


def check_no_repeated_entries(strides, shape, itemsize: int, name: str) -> None:
    """``ValueError`` when an array updated in place may hold one entry at two indices.

    An expanded torch tensor (stride 0) or an unfolded one (overlapping windows) has a
    writeable NumPy view whose rows share memory: the in-place update wrote every row's
    step over the others, and the parameter came back wrong without an error.  The test
    is the usual sufficient one for no overlap: sorted by stride, each dimension of more
    than one entry steps past everything the smaller strides span.
    """
    if any(int(n) == 0 for n in shape):
        return  # no entries, none repeated (NumPy gives empty arrays any strides)
    span = itemsize
    for st, n in sorted((abs(int(st)), int(n)) for st, n in zip(strides, shape) if n > 1):
        if st < span:
            raise ValueError(
                f"{name} must not repeat its entries in memory (it is updated in place), got an "
                f"array with strides {tuple(strides)} for shape {tuple(shape)} (a broadcast, "
                f"expanded or unfolded tensor) instead; pass a copy ({name}.clone() or np.array({name}))."
            )
        span = st * (n - 1) + span
