"""Assertion helpers whose default tolerances are the documented error bounds.

Each ``assert_*`` compares a candidate's output with refgeo's reference and raises
:class:`ConformanceError` (an ``AssertionError``) naming the quantity, the expected and
the received values and the tolerance that was applied.  Tolerances (unit roundoff
:math:`u = 2^{-24}` for float32, :math:`2^{-53}` for float64,
:math:`\\gamma_m = m u / (1 - m u)`):

* logit Hilbert distances (elementwise, pairwise): the bound documented in
  :func:`refgeo.pdist_hilbert`, :math:`u_{in} (|\\max_k d_k| + |\\min_k d_k|)`, plus one
  rounding of the returned value to the candidate's output dtype, but no coarser than
  the input's (a float16 result of float64 logits is held to float64 precision), plus
  the float64 reference's own rounding, :math:`2 u_{64}` of the same scale;
* Hilbert distances of probabilities: :math:`8 u_{in} (\\max|\\log p| + \\max|\\log q| + 1)`;
  ``inf`` (different supports) must be reported exactly;
* distances between rows (extreme pairs, k-NN): the refined float64 value is exact up
  to :math:`\\gamma_{d+3}(u_{64})` relative; a candidate computing in the input
  precision is allowed :math:`2\\gamma_{d+3}(u_{in})` relative on top, which covers
  direct differences and the centered Gram identity for the diameter (not for the
  closest pair, where cancellation is unbounded: that is what the check catches), plus
  the underflow floor :math:`\\sqrt{(d+1)\\,\\mathrm{tiny}_{in}}`;
* projected RowNorm, the RowNorm optimizer and local diagonal fits: the rounding of
  their closed forms in the input precision, scaled by the conditioning of each row
  (see each helper's Notes).

Passing ``rtol``/``atol`` replaces the default by ``atol + rtol * |expected|``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .._certify import scaled_row_norms
from .._validate import check_bool, check_choice, check_finite, check_real

__all__ = [
    "ConformanceError",
    "as_numpy",
    "assert_cdist_close",
    "assert_extreme_pair_close",
    "assert_hilbert_close",
    "assert_hilbert_logits_close",
    "assert_knn_close",
    "assert_local_diagonal_fit_close",
    "assert_pdist_close",
    "assert_projected_rownorm_close",
    "assert_rownorm_steps_close",
    "rownorm_reference_steps",
]

_U64 = 2.0**-53
_TIE_RULES = ("smallest", "any")


class ConformanceError(AssertionError):
    """A candidate implementation disagrees with refgeo's reference.

    Subclasses ``AssertionError``, so pytest reports it as a test failure.

    Attributes
    ----------
    name : str
        The quantity (``"row_diameter"``, ...) or the assertion helper that failed.
    reason : str
        What is wrong, in one sentence.
    expected, got : object
        Reference and candidate values (as NumPy arrays or results).
    tolerance : str
        The tolerance that was applied, with its origin.
    inputs : dict
        The inputs of the failing example, by argument name (empty when the helper was
        called directly).
    scenario : str
        The input scenario (adversarial structure) that produced the example, if any.
    """

    def __init__(
        self,
        reason: str,
        *,
        name: str = "",
        expected: Any = None,
        got: Any = None,
        tolerance: str = "",
        inputs: dict[str, Any] | None = None,
        scenario: str = "",
    ) -> None:
        self.name = name
        self.scenario = scenario
        self.reason = reason
        self.expected = expected
        self.got = got
        self.tolerance = tolerance
        self.inputs = dict(inputs or {})
        super().__init__(self._message())

    def with_context(self, name: str, inputs: dict[str, Any], scenario: str = "") -> ConformanceError:
        """A copy of this error that also names the quantity, the failing inputs and the scenario."""
        return ConformanceError(
            self.reason,
            name=name,
            expected=self.expected,
            got=self.got,
            tolerance=self.tolerance,
            inputs=inputs,
            scenario=scenario,
        )

    def _message(self) -> str:
        head = f"candidate disagrees with refgeo's reference for {self.name!r}" if self.name else "mismatch"
        lines = [f"{head}: {self.reason}"]
        if self.scenario:
            lines.append(f"  scenario:  {self.scenario}")
        for key, val in self.inputs.items():
            lines.append(_field(f"input {key}", val))
        if self.expected is not None:
            lines.append(_field("expected", self.expected))
        if self.got is not None:
            lines.append(_field("got", self.got))
        if self.tolerance:
            lines.append(f"  tolerance: {self.tolerance}")
        return "\n".join(lines)


def _describe_layout(a: np.ndarray) -> str:
    if a.ndim < 2 or a.flags.c_contiguous:
        return "C-contiguous" if a.flags.c_contiguous else f"strided view, strides={a.strides}"
    if a.flags.f_contiguous:
        return "Fortran-ordered"
    return f"strided view, strides={a.strides}"


def _field(label: str, val: Any) -> str:
    prefix = f"  {label + ':':<10} "
    if isinstance(val, np.ndarray):
        with np.printoptions(precision=17, floatmode="unique", threshold=400, linewidth=100):
            body = repr(val)
        body += f"  # shape {val.shape}, {val.dtype}, {_describe_layout(val)}"
    else:
        body = repr(val)
    return prefix + body.replace("\n", "\n" + " " * len(prefix))


# --------------------------------------------------------------------------- conversion


def as_numpy(x: Any) -> np.ndarray:
    """Convert an array of any library (NumPy, PyTorch, JAX, CuPy, ...) to NumPy.

    Tries DLPack (``np.from_dlpack``) for objects that export it, then
    ``np.asarray``; tensors that carry autograd state are detached, device arrays are
    brought to the host (``.get()`` for CuPy, ``.cpu()`` for PyTorch).  PyTorch
    bfloat16 tensors become float32 (exactly: NumPy has no bfloat16), so that the default
    tolerances applied to them are float32's; pass ``rtol``/``atol`` for a kernel that
    computes in bfloat16.  The ``assert_*`` helpers read their inputs (``X``, ``z``, ...)
    through this function too.

    Parameters
    ----------
    x : array_like or tensor
        The candidate's output.

    Returns
    -------
    a : ndarray
        A NumPy array (a view where the library allows it).

    Examples
    --------
    >>> from refgeo.testing import as_numpy
    >>> as_numpy([1.0, 2.0]).dtype
    dtype('float64')
    """
    if isinstance(x, np.ndarray):
        return x
    if type(x).__module__.split(".")[0] == "torch" and hasattr(x, "detach"):
        return _torch_as_numpy(x)
    if hasattr(x, "detach") and callable(x.detach):  # other autograd tensors
        x = x.detach()
    if hasattr(x, "__dlpack__"):
        try:
            return np.from_dlpack(x)
        except Exception:  # device memory, unsupported dtype: other routes below
            pass
    if type(x).__module__.split(".")[0] == "cupy" and hasattr(x, "get"):
        return np.asarray(x.get())
    try:
        return np.asarray(x)
    except Exception:
        if hasattr(x, "cpu"):
            return np.asarray(x.cpu())
        raise


def _torch_as_numpy(x: Any) -> np.ndarray:
    # NumPy has no bfloat16 (float32 holds its values exactly); lazily conjugated or
    # negated views and autograd history have no NumPy equivalent
    import torch

    t = x.detach()
    if t.device.type == "meta":
        raise TypeError("a meta tensor has no values to compare; the candidate must return a tensor with data.")
    if t.layout != torch.strided:
        t = t.to_dense()
    if t.dtype == torch.bfloat16:
        t = t.float()
    return t.resolve_conj().resolve_neg().cpu().numpy()


def _input(x: Any) -> np.ndarray:
    """An input of a helper as NumPy (a tensor, or a list of tensors such as gradients)."""
    if isinstance(x, (list, tuple)) and x and all(hasattr(v, "shape") for v in x):
        return np.stack([as_numpy(v) for v in x])
    return as_numpy(x)


def _real_arg(x: Any, name: str, what: str = "a real array") -> np.ndarray:
    """An array given to a helper, as NumPy: real, or a TypeError naming it (text gave
    NumPy's "could not convert string to float")."""
    a = _input(x)
    if a.dtype.kind not in "fiub":
        raise TypeError(f"{name} must be {what}, got dtype {a.dtype} instead.")
    return a


def _rows_arg(x: Any, name: str) -> np.ndarray:
    """An array of rows given to a helper, as NumPy: real and 2-D, or an error naming it
    (not a failed unpacking or an IndexError further on)."""
    a = _real_arg(x, name, "a real array of rows")
    if a.ndim != 2:
        raise ValueError(f"{name} must be a 2-D array of shape (V, d), got shape {a.shape} instead.")
    return a


def _result_arg(obj: Any, name: str, kind: str, fields: tuple[str, ...]) -> Any:
    """``obj`` if it has the fields of refgeo's result ``kind``, else a TypeError naming it."""
    if not all(hasattr(obj, f) for f in fields):
        raise TypeError(
            f"{name} must be the reference's result (a refgeo.{kind}, with {', '.join(fields)}), "
            f"got {type(obj).__name__} instead."
        )
    return obj


def _check_rule(tie_break: str) -> str:
    return check_choice(tie_break, "tie_break", _TIE_RULES)


def _unit_roundoff(dtype) -> float:
    dt = np.dtype(dtype)
    if dt.kind != "f":
        return _U64
    return float(np.finfo(dt).eps) / 2.0


def _gamma(m: int, u: float) -> float:
    return m * u / (1.0 - m * u)


def _check_tols(rtol, atol) -> None:
    """``rtol``/``atol``: None or a finite number >= 0 (a negative or NaN tolerance would
    blame every candidate)."""
    for value, name in ((rtol, "rtol"), (atol, "atol")):
        if value is not None:
            check_real(value, name, min_value=0.0)


def _real_values(got: np.ndarray, what: str, expected: Any = None) -> np.ndarray:
    """``got`` as float64; a complex, text or other non-numeric result is a mismatch
    (casting would drop an imaginary part or parse a string)."""
    if got.dtype.kind in "fiu":
        return got.astype(np.float64)
    if got.dtype.kind == "O":
        try:
            return got.astype(np.float64)
        except (TypeError, ValueError):
            pass
    raise ConformanceError(
        f"{what} must be real numbers, got an array of dtype {got.dtype}.", expected=expected, got=got
    )


def _user_tol(rtol, atol, expected):
    return (0.0 if atol is None else float(atol)) + (0.0 if rtol is None else float(rtol)) * np.abs(expected)


def _user_tol_text(rtol, atol) -> str:
    return f"|got - expected| <= atol + rtol * |expected| with rtol={rtol}, atol={atol} (user-supplied)"


def _compare_arrays(expected, got, tol, *, what: str, tol_text: str, inf_exact: bool = False):
    """Elementwise |got - expected| <= tol; NaN never passes; inf must match exactly."""
    got = np.asarray(got)
    if got.shape != expected.shape:
        raise ConformanceError(
            f"{what} has shape {got.shape}, expected shape {expected.shape}.", expected=expected, got=got
        )
    g = _real_values(got, what, expected)
    tol = np.broadcast_to(np.asarray(tol, dtype=np.float64), expected.shape)
    with np.errstate(invalid="ignore"):
        both_inf = np.isinf(expected) & (g == expected)
        err = np.where(both_inf, 0.0, np.abs(g - expected))
    bad = ~(err <= tol)  # catches NaN
    if inf_exact:
        bad |= np.isinf(expected) != np.isinf(g)
    if np.any(bad):
        k = np.unravel_index(int(np.flatnonzero(bad)[0]), expected.shape) if expected.ndim else ()
        where = f" at index {tuple(int(t) for t in k)}" if expected.ndim else ""
        raise ConformanceError(
            f"{what}{where} is {float(g[k])!r}, expected {float(expected[k])!r}: the error {err[k]:.3g} exceeds the "
            f"tolerance {tol[k]:.3g} ({int(np.sum(bad))} of {bad.size} entries out of tolerance).",
            expected=expected,
            got=got,
            tolerance=tol_text,
        )


# --------------------------------------------------------------------------- Hilbert


def _reference(fn, *args, **kwargs):
    import refgeo

    with refgeo.use_backend("reference"):
        return fn(*args, **kwargs)


def _logit_tol(dmax, dmin, in_dtype, out_dtype):
    """The logit Hilbert tolerance: the input-precision bound of refgeo.pdist_hilbert,
    plus one rounding of the result at the input's precision (the kernel's last
    subtraction), whatever dtype it is returned in.  A result less precise than its
    input is held to the input's precision: with the output's roundoff a float16 result
    of float64 logits was allowed 2**-11 relative, and a kernel computing in float16
    throughout passed.  A result more precise than its input is not held to its own:
    a float32 kernel returning float64 (torch's .double(), .tolist()) failed one input
    in 12, its last subtraction rounded in float32.  With gradual underflow a rounding
    errs by at most u |x| plus half the smallest subnormal (a float32 result of
    4.65e-259 is 0)."""
    u_in = _unit_roundoff(in_dtype)
    u_out = _unit_roundoff(out_dtype)
    scale = np.abs(dmax) + np.abs(dmin)
    floor = 0.0
    if u_out <= u_in and np.dtype(out_dtype).kind == "f":
        floor = float(np.finfo(out_dtype).smallest_subnormal) / 2
    return (u_in + 2 * _U64) * scale + u_in * np.abs(dmax - dmin) + floor


_LOGIT_TOL_TEXT = (
    "(u_in + 2 u_64) * (|max_k d_k| + |min_k d_k|) + u_in * |d| + (half the smallest subnormal of the "
    "returned dtype) (d = w - z; u_in = unit roundoff of the input), the bound "
    "documented in refgeo.pdist_hilbert, one rounding of the result at the input's precision "
    "and the float64 reference's own rounding"
)


def assert_hilbert_logits_close(
    actual: Any, z: Any, w: Any, /, *, rtol: float | None = None, atol: float | None = None
) -> None:
    """Assert ``actual`` equals ``refgeo.hilbert_distance_logits(z, w)`` (rows of z, w).

    Parameters
    ----------
    actual : array_like of shape (n,) or scalar
        The candidate's distances along the last axis.
    z, w : ndarray of shape (n, V) or (V,)
        The logits given to the candidate.
    rtol, atol : float, default=None
        Replace the default tolerance by ``atol + rtol * |expected|``.

    Raises
    ------
    ConformanceError
        When an entry is out of tolerance, NaN, or the shape differs.

    Notes
    -----
    Default tolerance per entry, with :math:`d = w - z` and the unit roundoff of the
    input:

    .. math:: (u_{in} + 2 u_{64}) (|\\max_k d_k| + |\\min_k d_k|)
              + u_{in} |\\max_k d_k - \\min_k d_k| + \\eta_{out} / 2

    (:math:`\\eta_{out}` the smallest subnormal of the returned dtype, counted when it is
    at least as precise as the input; :math:`2 u_{64}` of the same scale is the float64
    reference's own rounding, which the comparison with it has to allow: with float64
    logits a result two ulps of the scale from the reference passes).  One rounding of
    the result at the input's precision is allowed (the kernel's last subtraction),
    whatever dtype the result is returned in: a result less precise than its logits
    cannot show that the kernel computed at their precision, and a float32 kernel may
    return float64.

    Examples
    --------
    >>> import numpy as np
    >>> from refgeo.testing import assert_hilbert_logits_close
    >>> z = np.array([[0.0, 1.0, 2.0]]); w = np.array([[5.0, 5.0, 5.0]])
    >>> assert_hilbert_logits_close(np.array([2.0]), z, w)
    """
    _check_tols(rtol, atol)
    import refgeo

    z, w = _real_arg(z, "z"), _real_arg(w, "w")
    z64 = np.asarray(z, dtype=np.float64)
    w64 = np.asarray(w, dtype=np.float64)
    expected = np.asarray(_reference(refgeo.hilbert_distance_logits, z, w), dtype=np.float64)
    got = as_numpy(actual)
    if rtol is None and atol is None:
        d = w64 - z64
        tol = _logit_tol(d.max(axis=-1), d.min(axis=-1), np.result_type(z, w), got.dtype)
        text = _LOGIT_TOL_TEXT
    else:
        tol, text = _user_tol(rtol, atol, expected), _user_tol_text(rtol, atol)
    _compare_arrays(expected, got, tol, what="distance", tol_text=text)


def assert_hilbert_close(
    actual: Any, p: Any, q: Any, /, *, rtol: float | None = None, atol: float | None = None
) -> None:
    """Assert ``actual`` equals ``refgeo.hilbert_distance(p, q)`` (rows of p, q).

    Parameters
    ----------
    actual : array_like of shape (n,) or scalar
        The candidate's distances; ``inf`` exactly where the supports differ.
    p, q : ndarray of shape (n, V) or (V,)
        The non-negative vectors given to the candidate.
    rtol, atol : float, default=None
        Replace the default tolerance by ``atol + rtol * |expected|``.

    Raises
    ------
    ConformanceError
        When a finite entry is out of tolerance, ``inf`` is missing or spurious, or an
        entry is NaN.

    Notes
    -----
    Default tolerance :math:`8 u_{in} (\\max_k |\\log p_k| + \\max_k |\\log q_k| + 1)` over the
    common support (a few roundings of each logarithm, ratio and normalization).

    Examples
    --------
    >>> import numpy as np
    >>> from refgeo.testing import assert_hilbert_close
    >>> assert_hilbert_close(np.array([np.log(4.0), np.inf]),
    ...                      np.array([[0.5, 0.25, 0.25], [1.0, 0.0, 0.0]]),
    ...                      np.array([[0.25, 0.25, 0.5], [0.5, 0.5, 0.0]]))
    """
    _check_tols(rtol, atol)
    import refgeo

    p, q = _real_arg(p, "p"), _real_arg(q, "q")
    expected = np.asarray(_reference(refgeo.hilbert_distance, p, q), dtype=np.float64)
    got = as_numpy(actual)
    if rtol is None and atol is None:
        p64 = np.asarray(p, dtype=np.float64)
        q64 = np.asarray(q, dtype=np.float64)
        with np.errstate(divide="ignore"):
            lp = np.where(p64 > 0, np.abs(np.log(np.where(p64 > 0, p64, 1.0))), 0.0)
            lq = np.where(q64 > 0, np.abs(np.log(np.where(q64 > 0, q64, 1.0))), 0.0)
        tol = 8 * _unit_roundoff(np.result_type(p, q)) * (lp.max(axis=-1) + lq.max(axis=-1) + 1.0)
        text = "8 u_in (max|log p| + max|log q| + 1); inf must match exactly"
    else:
        tol, text = _user_tol(rtol, atol, expected), _user_tol_text(rtol, atol)
    _compare_arrays(expected, got, tol, what="distance", tol_text=text, inf_exact=True)


def _pairwise_extremes(A, B):
    """float64 max and min over k of B[j, k] - A[i, k], shape (nA, nB), one row of A at a
    time: the (nA, nB, V) differences at once took 6.6 GB for 128 rows of V = 50257."""
    A = np.asarray(A, dtype=np.float64)
    B = np.asarray(B, dtype=np.float64)
    hi = np.empty((A.shape[0], B.shape[0]))
    lo = np.empty_like(hi)
    for i in range(A.shape[0]):
        D = B - A[i]
        hi[i] = D.max(axis=-1)
        lo[i] = D.min(axis=-1)
    return hi, lo


def assert_pdist_close(actual: Any, X: Any, /, *, rtol: float | None = None, atol: float | None = None) -> None:
    """Assert ``actual`` equals ``refgeo.pdist_hilbert(X)`` (logit rows).

    Parameters
    ----------
    actual : array_like of shape (n*(n-1)//2,) or (n, n)
        Condensed (``pdist`` order) or square distances.
    X : ndarray of shape (n, V)
        The logit rows given to the candidate.
    rtol, atol : float, default=None
        Replace the default tolerance by ``atol + rtol * |expected|``.

    Raises
    ------
    ConformanceError
        On a value out of tolerance, a wrong shape, or (square form) a nonzero diagonal
        or an asymmetric matrix.

    Notes
    -----
    Default tolerance: the float32 bound documented in :func:`refgeo.pdist_hilbert`,
    :math:`u_{in}(|\\max_k d_k| + |\\min_k d_k|)` for the pair's difference
    :math:`d = x_j - x_i`, plus one rounding of the value to the returned dtype, no
    coarser than the input's, plus the float64 reference's own rounding (see
    :func:`assert_hilbert_logits_close`).

    Examples
    --------
    >>> import numpy as np
    >>> from refgeo.testing import assert_pdist_close
    >>> Z = np.array([[0.0, 0.0, 0.0], [0.0, 1.0, 2.0], [5.0, 5.0, 6.0]], dtype=np.float32)
    >>> assert_pdist_close(np.array([2.0, 1.0, 1.0], dtype=np.float32), Z)
    """
    _check_tols(rtol, atol)
    import refgeo

    X = _rows_arg(X, "X")
    n = X.shape[0]
    expected = np.asarray(_reference(refgeo.pdist_hilbert, X), dtype=np.float64)
    got = as_numpy(actual)
    iu = np.triu_indices(n, k=1)
    if got.ndim == 2 and got.shape == (n, n):
        if np.any(np.diag(got) != 0) or not np.array_equal(got, got.T, equal_nan=True):
            raise ConformanceError(
                "the square distance matrix must be symmetric with a zero diagonal.", expected=expected, got=got
            )
        got = got[iu]
    if rtol is None and atol is None:
        hi, lo = _pairwise_extremes(X, X)
        tol = _logit_tol(hi[iu], lo[iu], X.dtype, got.dtype)
        text = _LOGIT_TOL_TEXT
    else:
        tol, text = _user_tol(rtol, atol, expected), _user_tol_text(rtol, atol)
    _compare_arrays(expected, got, tol, what="condensed distance", tol_text=text)


def assert_cdist_close(
    actual: Any, XA: Any, XB: Any, /, *, rtol: float | None = None, atol: float | None = None
) -> None:
    """Assert ``actual`` equals ``refgeo.cdist_hilbert(XA, XB)`` (logit rows).

    Parameters
    ----------
    actual : array_like of shape (nA, nB)
    XA : ndarray of shape (nA, V)
    XB : ndarray of shape (nB, V)
    rtol, atol : float, default=None
        Replace the default tolerance (as in :func:`assert_pdist_close`).

    Raises
    ------
    ConformanceError
        On a value out of tolerance or a wrong shape.

    Examples
    --------
    >>> import numpy as np
    >>> from refgeo.testing import assert_cdist_close
    >>> assert_cdist_close(np.array([[2.0, 0.0]]), np.zeros((1, 3)),
    ...                    np.array([[0.0, 1.0, 2.0], [1.0, 1.0, 1.0]]))
    """
    _check_tols(rtol, atol)
    import refgeo

    XA = _rows_arg(XA, "XA")
    XB = _rows_arg(XB, "XB")
    expected = np.asarray(_reference(refgeo.cdist_hilbert, XA, XB), dtype=np.float64)
    got = as_numpy(actual)
    if rtol is None and atol is None:
        hi, lo = _pairwise_extremes(XA, XB)
        tol = _logit_tol(hi, lo, np.result_type(XA, XB), got.dtype)
        text = _LOGIT_TOL_TEXT
    else:
        tol, text = _user_tol(rtol, atol, expected), _user_tol_text(rtol, atol)
    _compare_arrays(expected, got, tol, what="distance", tol_text=text)


# --------------------------------------------------------------------------- row distances


def _canonical_sq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """refgeo's refined squared distance (same operations, bit for bit)."""
    from refgeo._certify import canonical_sq as canon

    return np.asarray(canon(np, np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)))


def _exact_sq(a: np.ndarray, b: np.ndarray):
    """The exact squared distance of two float64 rows, as a ``Fraction`` (O(d))."""
    from fractions import Fraction

    return sum(((Fraction(x) - Fraction(y)) ** 2 for x, y in zip(a.tolist(), b.tolist())), Fraction(0))


def _exact_in_any_order(rows, in_dtype) -> bool:
    """Whether every difference, square, product and sum of the entries of ``rows`` (the
    rows of a tie; any scaling by a power of two) is exact in the input precision, in any
    order of computation: entries ``n 2**q`` with integers ``|n| <= M`` and
    ``4 d M**2 <= 2**p`` (``p`` the precision's bits).  Then every correct kernel, by
    direct differences or by the Gram identity, sees an exact tie as a tie; elsewhere
    its rounding may order the tied pairs either way (a float64 kernel summing
    ``((a + b) + c) + d`` put one of two pairs at permuted coordinates 1 ulp above the
    other)."""
    from fractions import Fraction

    dt = np.dtype(in_dtype)
    p = np.finfo(dt).nmant + 1 if dt.kind == "f" else 53
    vals = [Fraction(float(x)) for x in np.asarray(rows, dtype=np.float64).ravel().tolist() if x != 0.0]
    if not vals:
        return True
    # the lowest set bit of every entry: n * 2**q with n odd, q = v2(numerator) - log2(denominator)
    q = min((abs(f.numerator) & -abs(f.numerator)).bit_length() - f.denominator.bit_length() for f in vals)
    M = max(abs(f) for f in vals) / Fraction(2) ** q
    return 4 * np.asarray(rows).shape[-1] * M * M <= 2**p


def _scaled_rows(*arrays):
    """float64 copies of ``arrays`` prescaled as refgeo prescales them, and the exponent.

    Refined distances of the returned rows times ``2**e`` are refgeo's distances.
    """
    from refgeo._certify import scale_exponent, scale_rows

    e = scale_exponent(np, arrays)
    return [np.asarray(scale_rows(np, a, e), dtype=np.float64) for a in arrays], e


def _distance_rtol(d: int, in_dtype) -> float:
    return 2.0 * _gamma(d + 3, _unit_roundoff(in_dtype)) + _gamma(d + 3, _U64)


def _distance_floor(d: int, in_dtype) -> float:
    """Absolute floor: squares of differences below sqrt(tiny) underflow in the input dtype."""
    dt = np.dtype(in_dtype) if np.dtype(in_dtype).kind == "f" else np.dtype(np.float64)
    return math.sqrt((d + 1) * float(np.finfo(dt).tiny))


def _distance_tol_text(d: int, in_dtype) -> str:
    return (
        f"|got - expected| <= {_distance_rtol(d, in_dtype):.3g} * expected + {_distance_floor(d, in_dtype):.3g} "
        f"(relative 2 gamma_(d+3)(u_in) + gamma_(d+3)(u_64) for d={d}, {np.dtype(in_dtype)} input; "
        "absolute: the underflow floor sqrt((d+1) tiny_in))"
    )


def _as_index(x: Any, what: str) -> int:
    a = as_numpy(x)
    ok = a.size == 1 and (
        np.issubdtype(a.dtype, np.integer)
        # a float holding an integer (1.0) is accepted; NaN, inf and 1.5 are not
        or (a.dtype.kind == "f" and math.isfinite(float(a.reshape(()))) and float(a.reshape(())).is_integer())
    )
    if not ok:  # bool, complex, text, several values
        raise ConformanceError(f"{what} must be one integer index, got {x!r}.")
    return int(a.reshape(()))


def _as_value(x: Any) -> float:
    """The candidate's extreme value as a float: one real number (NaN is compared, and fails)."""
    try:
        a = as_numpy(x)
    except Exception:
        a = None
    if a is None or a.size != 1 or a.dtype.kind not in "fiu":
        raise ConformanceError(f"the value must be one real number, got {x!r}.", got=x)
    return float(a.reshape(()))


def assert_extreme_pair_close(
    value: Any,
    i: Any,
    j: Any,
    reference_pair: Any,
    S: Any,
    /,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    tie_break: str = "smallest",
) -> None:
    """Assert a candidate's extreme pair (diameter or closest pair) matches refgeo's.

    Parameters
    ----------
    value : float
        The candidate's distance.
    i, j : int or None
        The candidate's pair (``i < j``).  ``None`` for both: a kernel that returns the
        distance only (as many published diameter functions do) is checked on its value,
        and a failure report says that the pair was not checked.
    reference_pair : refgeo.ExtremePair
        ``refgeo.row_diameter(S)`` or ``refgeo.closest_pair(S)``.
    S : ndarray of shape (V, d)
        The rows given to the candidate.
    rtol, atol : float, default=None
        Replace the default tolerance by ``atol + rtol * reference_pair.value``.
    tie_break : {"smallest", "any"}, default="smallest"
        ``"smallest"``: refgeo's rule, among exactly tied pairs (equal refined float64
        distances, and equal exact distances) that every correct kernel sees as tied
        (identical rows, or rows of integers times a common power of two that no
        difference, square, product or sum rounds in the input precision: :math:`4 d
        M^2 \\le 2^p` for integers up to M and p bits; or pairs of the same two rows,
        duplicated) the lexicographically smallest
        ``(i, j)`` must be returned; of other exact ties (which a kernel's own rounding
        may order either way) and of pairs whose distances differ but round to the same
        refined value, any one within the tolerance is accepted.
        ``"any"``: any pair whose distance is within the tolerance is accepted.

    Raises
    ------
    ConformanceError
        When the value is out of tolerance; when the pair is invalid (out of range,
        ``i >= j``); when the pair's own distance is not within the tolerance of the
        extreme (it is not an extreme pair, e.g. an off-by-one index); or, with
        ``tie_break="smallest"``, when it ties exactly with a smaller pair (equal refined
        and exact distances, in rows every kernel computes exactly).

    Notes
    -----
    A different pair than the reference's is accepted only where the two values tie
    within the tolerance, whose default is the certified error of the refined value
    plus the rounding of a computation in the input precision:

    .. math:: |v - v_{ref}| \\le \\big(2\\gamma_{d+3}(u_{in}) + \\gamma_{d+3}(u_{64})\\big)\\, v_{ref}
              + \\sqrt{(d+1)\\,\\mathrm{tiny}_{in}}

    (the last term: squares of differences below :math:`\\sqrt{\\mathrm{tiny}}` underflow).

    Examples
    --------
    >>> import numpy as np, refgeo
    >>> from refgeo.testing import assert_extreme_pair_close
    >>> S = np.array([[0.0, 0.0], [3.0, 4.0], [1.0, 1.0]])
    >>> assert_extreme_pair_close(5.0, 0, 1, refgeo.row_diameter(S), S)
    >>> assert_extreme_pair_close(5.0, None, None, refgeo.row_diameter(S), S)  # value only
    """
    _check_tols(rtol, atol)
    tie_break = _check_rule(tie_break)
    S = _rows_arg(S, "S")
    V, d = S.shape
    _result_arg(reference_pair, "reference_pair", "ExtremePair", ("value", "i", "j"))
    ref_v = float(reference_pair.value)
    ri, rj = int(reference_pair.i), int(reference_pair.j)
    expected = {"value": ref_v, "i": ri, "j": rj}
    got_v = _as_value(value)
    value_only = i is None and j is None
    if (i is None) != (j is None):
        raise ConformanceError(f"i and j must both be indices or both be None, got i={i!r}, j={j!r}.")
    if value_only:
        got: dict[str, Any] = {"value": got_v}
    else:
        gi, gj = _as_index(i, "i"), _as_index(j, "j")
        got = {"value": got_v, "i": gi, "j": gj}
    if rtol is None and atol is None:
        tol = _distance_rtol(d, S.dtype) * ref_v + _distance_floor(d, S.dtype)
        text = _distance_tol_text(d, S.dtype)
    else:
        tol = float(_user_tol(rtol, atol, ref_v))
        text = _user_tol_text(rtol, atol)
    if not (abs(got_v - ref_v) <= tol):
        raise ConformanceError(
            f"the value {got_v!r} differs from the reference {ref_v!r} by {abs(got_v - ref_v):.3g}, more than "
            f"the tolerance {tol:.3g}." + (" (Value only: the candidate returned no pair, so the pair was not "
                                            "checked.)" if value_only else ""),
            expected=expected,
            got=got,
            tolerance=text,
        )
    if value_only:
        return
    if not (0 <= gi < gj < V):
        raise ConformanceError(
            f"the pair ({gi}, {gj}) is not a valid pair i < j of rows 0..{V - 1}.",
            expected=expected,
            got=got,
            tolerance=text,
        )
    if (gi, gj) == (ri, rj):
        return
    (rows,), e = _scaled_rows(S)
    sq_got = float(_canonical_sq(rows[gi], rows[gj]))
    sq_ref = float(_canonical_sq(rows[ri], rows[rj]))
    pair_v = math.ldexp(math.sqrt(sq_got), e)
    if sq_got == sq_ref:
        # Equal refined values are a tie only where the exact distances are equal too:
        # float64 rounding can merge distances that differ (rows 1e-16 apart), and a
        # candidate that computes otherwise may then return the pair that is farther (or
        # closer) in exact arithmetic.  Such a pair is within the tolerance; a pair that
        # ties exactly must follow the rule, whatever value the candidate reports.
        sq_exact = _exact_sq(rows[gi], rows[gj])
        a, b, c, e2 = rows[gi], rows[gj], rows[ri], rows[rj]
        # seen by every kernel: distance 0, the same two rows (duplicates: one input,
        # one value), or rows no order of computation rounds
        same = ((np.array_equal(a, c) and np.array_equal(b, e2)) or (np.array_equal(a, e2) and np.array_equal(b, c)))
        if (tie_break == "smallest" and sq_exact == _exact_sq(c, e2)
                and (sq_exact == 0 or same or _exact_in_any_order(rows[[gi, gj, ri, rj]], S.dtype))):
            raise ConformanceError(
                f"wrong tie-breaking: the pairs ({gi}, {gj}) and ({ri}, {rj}) have exactly equal refined "
                f"distances {pair_v!r}; refgeo's rule returns the lexicographically smallest pair ({ri}, {rj}).",
                expected=expected,
                got=got,
                tolerance="exact ties go to the smallest (i, j) (tie_break='smallest')",
            )
        return
    if not (abs(pair_v - ref_v) <= tol):
        raise ConformanceError(
            f"the pair ({gi}, {gj}) is not an extreme pair: its distance is {pair_v!r}, the reference "
            f"pair ({ri}, {rj}) has {ref_v!r}; they differ by {abs(pair_v - ref_v):.3g}, more than the "
            f"tolerance {tol:.3g}.",
            expected=expected,
            got=got,
            tolerance=text,
        )


def assert_knn_close(
    indices: Any,
    distances: Any,
    reference: Any,
    X: Any,
    /,
    *,
    Y: Any = None,
    exclude_self: bool = True,
    rtol: float | None = None,
    atol: float | None = None,
    tie_break: str = "smallest",
) -> None:
    """Assert a candidate's k nearest neighbors match ``refgeo.knn``.

    Parameters
    ----------
    indices : array_like of shape (n, k)
        The candidate's neighbor indices, nearest first.
    distances : array_like of shape (n, k) or None
        The candidate's distances (None: only the indices are checked).
    reference : refgeo.KNNResult
        ``refgeo.knn(X, k, Y, exclude_self=...)``.
    X : ndarray of shape (n, d)
        Query rows.
    Y : ndarray of shape (n_Y, d), default=None
        Candidate rows (None: X itself).
    exclude_self : bool, default=True
        Whether a row may be its own neighbor (when Y is None).
    rtol, atol : float, default=None
        Replace the default distance tolerance by ``atol + rtol * |expected|``.
    tie_break : {"smallest", "any"}, default="smallest"
        ``"smallest"``: among exactly equal distances (refined and exact, in rows every
        correct kernel computes exactly, as for :func:`assert_extreme_pair_close`) the smaller
        index comes first, and no index is listed while a smaller one at exactly the
        same distance is left out (refgeo's rule; checked on the candidate's list, so near-equal
        neighbors inside the tolerance may still shift an exact tie to another rank);
        ``"any"``: any order of near-equal neighbors.

    Raises
    ------
    ConformanceError
        On a wrong shape, an index out of range, a repeated neighbor, the query row
        itself (with ``exclude_self``), a distance out of tolerance, a neighbor whose
        true distance is not within tolerance of the reference's at that rank, or a
        wrong order among exact ties.  A result that is not real numbers (complex,
        text) is a mismatch, in every helper.

    Notes
    -----
    Tolerance as in :func:`assert_extreme_pair_close`, per entry.

    Examples
    --------
    >>> import numpy as np, refgeo
    >>> from refgeo.testing import assert_knn_close
    >>> X = np.array([[0.0], [1.0], [3.0]])
    >>> assert_knn_close([[1], [0], [1]], [[1.0], [1.0], [2.0]], refgeo.knn(X, 1), X)
    """
    _check_tols(rtol, atol)
    tie_break = _check_rule(tie_break)
    X = _rows_arg(X, "X")
    B = X if Y is None else _rows_arg(Y, "Y")
    if B.shape[1] != X.shape[1]:
        raise ValueError(f"Y must have the {X.shape[1]} columns of X, got shape {B.shape} instead.")
    _result_arg(reference, "reference", "KNNResult", ("indices", "distances"))
    ref_idx = np.asarray(reference.indices)
    ref_dist = np.asarray(reference.distances, dtype=np.float64)
    if ref_idx.ndim != 2 or ref_idx.shape[0] != X.shape[0]:
        raise ValueError(
            f"reference must be the k-NN of the {X.shape[0]} rows of X, got indices of shape {ref_idx.shape} instead."
        )
    n, k = ref_idx.shape
    d = X.shape[1]
    got_idx = as_numpy(indices)
    expected = {"indices": ref_idx, "distances": ref_dist}
    got = {"indices": got_idx, "distances": None if distances is None else as_numpy(distances)}
    if rtol is None and atol is None:
        tol = _distance_rtol(d, np.result_type(X, B)) * ref_dist + _distance_floor(d, np.result_type(X, B))
        text = _distance_tol_text(d, np.result_type(X, B))
    else:
        tol = _user_tol(rtol, atol, ref_dist)
        text = _user_tol_text(rtol, atol)
    if got_idx.shape != (n, k) or not (np.issubdtype(got_idx.dtype, np.integer) or got_idx.size == 0):
        raise ConformanceError(
            f"indices must be an integer array of shape {(n, k)}, got {got_idx.dtype} of shape {got_idx.shape}.",
            expected=expected,
            got=got,
        )
    if distances is not None:
        _compare_arrays(ref_dist, got["distances"], tol, what="distance", tol_text=text)
    nb = B.shape[0]
    (A64, B64), e = _scaled_rows(X, B)
    for r in range(n):
        row = got_idx[r]
        if np.any(row < 0) or np.any(row >= nb):
            raise ConformanceError(f"row {r}: neighbor index out of range 0..{nb - 1}: {row.tolist()}.",
                                   expected=expected, got=got)
        if len(set(row.tolist())) != k:
            raise ConformanceError(f"row {r}: repeated neighbor in {row.tolist()}.", expected=expected, got=got)
        if Y is None and exclude_self and r in row:
            raise ConformanceError(f"row {r} is listed as its own neighbor (exclude_self=True).",
                                   expected=expected, got=got)
        sq = _canonical_sq(A64[r][None, :], B64[row])
        if tie_break == "smallest":
            _check_knn_ties(r, row, sq, _canonical_sq(A64[r][None, :], B64), A64[r], B64,
                            Y is None and exclude_self, e, expected, got, np.result_type(X, B))
        for c in range(k):
            if row[c] == ref_idx[r, c]:
                continue
            dist = math.ldexp(math.sqrt(float(sq[c])), e)
            if not (abs(dist - ref_dist[r, c]) <= tol[r, c]):
                raise ConformanceError(
                    f"row {r}, rank {c}: neighbor {int(row[c])} is at distance {dist!r}, but the reference's "
                    f"neighbor {int(ref_idx[r, c])} at that rank is at {float(ref_dist[r, c])!r} (difference "
                    f"{abs(dist - ref_dist[r, c]):.3g} > tolerance {tol[r, c]:.3g}).",
                    expected=expected,
                    got=got,
                    tolerance=text,
                )


def _check_knn_ties(r, row, sq, sq_all, A_r, B, skip_self, e, expected, got, in_dtype) -> None:
    """refgeo's tie rule on one row of neighbors: exactly equal distances (refined and
    exact: ``A_r`` is the row, ``B`` the candidates, both scaled) are listed by increasing
    index, and no neighbor is listed while a smaller index at exactly the same distance
    is left out, where every kernel sees the tie (distance 0, duplicated candidates,
    or :func:`_exact_in_any_order`).

    Neighbors at near-equal distances (inside the tolerance) may come in any order, so
    an exact tie can sit at a different rank than in the reference; the rule is checked
    on the candidate's own list, not rank by rank.
    """
    k = len(row)
    listed = set(row.tolist())

    def exact(j):
        return _exact_sq(A_r, B[j])

    def seen(j, m):  # an exact tie of neighbors j and m that every correct kernel sees
        return (exact(j) == 0 or np.array_equal(B[j], B[m])
                or _exact_in_any_order(np.stack([A_r, B[j], B[m]]), in_dtype))

    for a in range(k):
        for b in range(a + 1, k):
            if sq[a] == sq[b] and row[a] > row[b] and exact(row[a]) == exact(row[b]) and seen(row[a], row[b]):
                raise ConformanceError(
                    f"wrong tie-breaking in row {r}: neighbors {int(row[a])} (rank {a}) and {int(row[b])} "
                    f"(rank {b}) are at exactly equal refined distance {math.ldexp(math.sqrt(float(sq[a])), e)!r}; "
                    "refgeo orders equal distances by the smaller index.",
                    expected=expected,
                    got=got,
                    tolerance="exact ties ordered by index (tie_break='smallest')",
                )
        j = int(row[a])
        for m in np.flatnonzero(sq_all[:j] == sq[a]).tolist():
            if m not in listed and not (skip_self and m == r) and exact(m) == exact(j) and seen(j, m):
                raise ConformanceError(
                    f"wrong tie-breaking in row {r}, rank {a}: neighbor {j} is listed but neighbor {m}, at "
                    f"exactly equal refined distance {math.ldexp(math.sqrt(float(sq[a])), e)!r}, is not; refgeo "
                    "orders equal distances by the smaller index.",
                    expected=expected,
                    got=got,
                    tolerance="exact ties ordered by index (tie_break='smallest')",
                )


# --------------------------------------------------------------------------- LMO and optimizer


def assert_projected_rownorm_close(
    actual: Any, G: Any, /, *, eta: float = 1.0, rtol: float | None = None, atol: float | None = None
) -> None:
    """Assert ``actual`` equals ``refgeo.projected_rownorm(G, eta=eta)``.

    Parameters
    ----------
    actual : array_like of shape (V, d)
        The candidate's step :math:`-\\tfrac{\\eta}{2} P\\,\\mathrm{RN}(PG)`.
    G : ndarray of shape (V, d)
        The gradient given to the candidate.
    eta : float, default=1.0
        Diameter budget.
    rtol, atol : float, default=None
        Replace the default tolerance by ``atol + rtol * |expected|``.

    Raises
    ------
    ConformanceError
        On a wrong shape or an entry out of tolerance.

    Notes
    -----
    Default tolerance (absolute, every entry of column j):
    :math:`\\eta\\,(d + 6 + V a_j)\\,u_{in}` with
    :math:`a_j = \\tfrac1V \\sum_i \\lvert \\mathrm{RN}(PG)_{ij} \\rvert \\le 1`, the
    rounding of a row normalization (:math:`(d+3)u` relative on rows of norm 1) and of
    the outer mean over V rows (a sum in any order errs by at most
    :math:`\\gamma_{V-1} \\sum_i \\lvert x_i \\rvert`), in the input precision (also for
    a result in a coarser dtype: a float32 step of a float64 gradient is held to float64
    precision).  With :math:`a_j = 1` in place of the column's own mean, a bfloat16
    kernel passed at (32000, 64) (errors 1.9e-3, tolerance 1.9e-3; now 2.0e-4).  It assumes the centering
    :math:`PG` is exact or harmless, as for gradients whose rows sum to zero exactly
    (:func:`refgeo.testing.strategies.centered_gradients`); rows of ``PG`` at the
    rounding level of the centering are ill-conditioned for any implementation.

    Examples
    --------
    >>> import numpy as np
    >>> from refgeo.testing import assert_projected_rownorm_close
    >>> G = np.array([[2.0, 1.0], [-2.0, -1.0]])
    >>> s = np.array([2.0, 1.0]) / np.sqrt(5.0)
    >>> assert_projected_rownorm_close(np.array([-s, s]), G, eta=2.0)
    """
    _check_tols(rtol, atol)
    import refgeo

    G = _input(G)
    expected = np.asarray(_reference(refgeo.projected_rownorm, G, eta=eta), dtype=np.float64)
    got = as_numpy(actual)
    if rtol is None and atol is None:
        V, d = G.shape
        # the outer mean's rounding is bounded by the column's own absolute sum (V a_j),
        # not by V: with V, a bfloat16 kernel passed at V = 32000
        G64 = np.asarray(G, dtype=np.float64)
        a = np.abs(refgeo.row_normalize(refgeo.center_rows(G64))).mean(axis=0)
        # the input's roundoff, not the coarser of input and result: a float16 result of a
        # float64 gradient was allowed 2**-11 per entry, as the logit tolerance once was
        tol = float(eta) * (d + 6 + V * a) * _unit_roundoff(G.dtype)
        text = (f"eta (d + 6 + V a_j) u_in, a_j = mean_i |RN(PG)_ij| <= 1: {tol.min():.3g} to {tol.max():.3g} "
                f"per entry (V={V}, d={d}, {G.dtype} input)")
    else:
        tol, text = _user_tol(rtol, atol, expected), _user_tol_text(rtol, atol)
    _compare_arrays(expected, got, tol, what="step entry", tol_text=text)


def rownorm_reference_steps(
    W0: Any, grads: Any, /, *, lr: float, mu: float = 0.95, eps: float = 1e-8, bias_correction: bool = True
) -> np.ndarray:
    """The RowNorm optimizer (see :doc:`/theory/lmo`), written out: parameters after each step.

    Parameters
    ----------
    W0 : ndarray of shape (V, d)
        Initial parameter (float32 or float64; updates are added in this dtype).
    grads : ndarray of shape (T, V, d)
        Gradients of steps 1..T.
    lr, mu, eps : float
        :math:`\\gamma`, :math:`\\mu`, :math:`\\varepsilon`.
    bias_correction : bool, default=True
        Divide the average by :math:`1 - \\mu^t` (False reproduces the classic bug).

    Returns
    -------
    W : ndarray of shape (T, V, d)
        ``W[t-1]`` is the parameter after step t, in the dtype of ``W0``.

    Raises
    ------
    TypeError, ValueError
        For a ``W0`` that is not a float32/float64 (V, d) array, ``grads`` not of shape
        (T, V, d) with T >= 1, or hyper-parameters out of range (``lr > 0``,
        ``0 <= mu < 1``, ``eps >= 0``; real numbers, ``bias_correction`` a bool).

    Notes
    -----
    .. math::

        B_t = \\mu B_{t-1} + (1-\\mu) G_t,\\quad \\hat B_t = \\frac{B_t}{1-\\mu^t},\\quad
        W_t = W_{t-1} - \\gamma\\,\\mathrm{RN}_\\varepsilon(\\hat B_t),\\quad
        \\mathrm{RN}_\\varepsilon(B)_i = \\frac{b_i}{\\lVert b_i \\rVert + \\varepsilon}

    in float64 (the parameter is rounded to its dtype after each step), without the
    optional outer centering, weight decay or gradient centering.  ``refgeo.RowNorm``
    with ``center=True`` agrees whenever the gradients' rows sum to zero.

    Examples
    --------
    >>> import numpy as np
    >>> from refgeo.testing import rownorm_reference_steps
    >>> W = rownorm_reference_steps(np.zeros((2, 2)), np.array([[[3.0, 4.0], [-3.0, -4.0]]]), lr=0.1, eps=0.0)
    >>> W[0].round(12).tolist()
    [[-0.06, -0.08], [0.06, 0.08]]
    """
    W0, grads = _steps_inputs(W0, grads)
    lr = check_real(lr, "lr", min_value=0.0, strict=True)
    mu = check_real(mu, "mu", min_value=0.0)
    if not mu < 1.0:
        raise ValueError(f"mu must be in [0, 1), got {mu} instead.")
    eps = check_real(eps, "eps", min_value=0.0)
    bias_correction = check_bool(bias_correction, "bias_correction")
    W = np.array(W0, copy=True)
    G = np.asarray(grads, dtype=np.float64)
    B = np.zeros(W.shape, dtype=np.float64)
    out = []
    for t in range(1, G.shape[0] + 1):
        B = mu * B + (1.0 - mu) * G[t - 1]
        Bh = B / (1.0 - mu**t) if bias_correction else B
        n = scaled_row_norms(Bh)[:, None] + eps  # squares: gradients of 1e200 took a zero step
        S = np.where(n > 0, Bh / np.where(n > 0, n, 1.0), 0.0)
        W = W + (-lr * S).astype(W.dtype)
        out.append(W.copy())
    return np.stack(out)


def _steps_inputs(W0, grads) -> tuple[np.ndarray, np.ndarray]:
    """``W0`` (V, d) float32/float64 and ``grads`` (T, V, d) with T >= 1, as NumPy."""
    W0 = _input(W0)
    grads = _input(grads)
    if W0.ndim != 2 or W0.dtype not in (np.float32, np.float64):
        raise TypeError(
            f"W0 must be a float32 or float64 array of shape (V, d), got {W0.dtype} of shape {W0.shape} instead."
        )
    if grads.ndim != 3 or grads.shape[1:] != W0.shape or grads.shape[0] < 1:
        raise ValueError(
            f"grads must have shape (T, V, d) = (T, {W0.shape[0]}, {W0.shape[1]}) with T >= 1 steps, got shape "
            f"{grads.shape} instead."
        )
    # RowNorm refuses them; the written-out steps skipped a NaN gradient silently
    check_finite(W0, "W0")
    check_finite(grads, "grads")
    return W0, grads


def _rownorm_oracle(W0, grads, lr, mu, eps):
    """Parameters after each step from refgeo.optim.RowNorm, on the gradients as given
    (``center=False``: the formula of :func:`rownorm_reference_steps`; with RowNorm's
    default the oracle centered them and refused the kit's own reference steps)."""
    from refgeo import RowNorm

    W = np.array(W0, copy=True, order="C")
    opt = RowNorm(lr=lr, mu=mu, eps=eps, center=False)
    out = []
    for g in np.asarray(grads):
        opt.step(W, g)
        out.append(W.copy())
    return np.stack(out)


def assert_rownorm_steps_close(
    actual: Any,
    W0: Any,
    grads: Any,
    /,
    *,
    lr: float,
    mu: float = 0.95,
    eps: float = 1e-8,
    rtol: float | None = None,
    atol: float | None = None,
) -> None:
    """Assert a candidate RowNorm optimizer's parameters match ``refgeo.RowNorm``.

    Parameters
    ----------
    actual : array_like of shape (T, V, d) or (V, d)
        Parameters after each of the T steps, or only after the last.
    W0 : ndarray of shape (V, d)
        Initial parameter.
    grads : ndarray of shape (T, V, d)
        Gradients of the steps.
    lr, mu, eps : float
        Hyper-parameters of :class:`refgeo.RowNorm`.
    rtol, atol : float, default=None
        Replace the default tolerance by ``atol + rtol * |expected|``.

    Raises
    ------
    ConformanceError
        On a wrong shape or an entry out of tolerance (the first failing step is named).

    Notes
    -----
    Default tolerance for entry (i, j) after step t, with u the roundoff of the parameter
    dtype, :math:`a_{s,i} = \\mu a_{s-1,i} + (1-\\mu)\\lVert g_{s,i} \\rVert` (the size of the
    terms averaged into :math:`b_{s,i}`), :math:`a_{s,ij}` the same sum of
    :math:`|g_{s,ij}|`, :math:`n_{s,i} = \\lVert b_{s,i} \\rVert + \\varepsilon\\,|1-\\mu^s|`,
    :math:`\\kappa_{s,i} = a_{s,i} / n_{s,i}` and :math:`r_{s,ij} = |b_{s,ij}| / n_{s,i}`:

    .. math:: \\sum_{s \\le t} 2\\gamma u\\,\\big((s + 4)\\,a_{s,ij} / n_{s,i}
              + r_{s,ij} ((s + 4)\\kappa_{s,i} + d + 4)\\big) + 2 u\\, |W_{s}|_{ij}

    (momentum averaging and row normalization in the parameter precision, and the
    rounding of the parameter update, for the candidate and the oracle; each step's
    term is at most :math:`2\\gamma (1 + u)`, since steps whose entries are at most
    :math:`\\gamma` differ by no more, and is that where the oracle's buffer row
    cancels to 0 with :math:`\\varepsilon = 0`: its exact direction may be any; an
    entry errs by its own buffer entry's rounding and by its share of the norm's, so a state kept in
    float16 for float32 parameters is caught at d = 4096, where a bound per row, every
    entry allowed the whole row's error, let it pass).  Missing bias
    correction, a misplaced :math:`\\varepsilon` or a wrong momentum are far outside it
    when rows are small enough for :math:`\\varepsilon` to matter.

    The steps are those of :func:`rownorm_reference_steps`: the gradients are averaged
    as given, not centered first.  ``refgeo.RowNorm`` with its default ``center=True``
    takes the same steps when the gradients' rows sum to zero, as cross-entropy
    gradients of an LM head do.

    Examples
    --------
    >>> import numpy as np
    >>> from refgeo.testing import assert_rownorm_steps_close
    >>> W0 = np.zeros((2, 2)); G = np.array([[[3.0, 4.0], [-3.0, -4.0]]])
    >>> assert_rownorm_steps_close([[[-0.06, -0.08], [0.06, 0.08]]], W0, G, lr=0.1, eps=0.0)
    """
    _check_tols(rtol, atol)
    W0, grads = _steps_inputs(W0, grads)
    expected = _rownorm_oracle(W0, grads, lr, mu, eps).astype(np.float64)
    got = as_numpy(actual)
    if got.shape == W0.shape and grads.shape[0] >= 1:
        expected, steps = expected[-1:], [grads.shape[0]]
        got = got[None]
    else:
        steps = list(range(1, grads.shape[0] + 1))
    if rtol is None and atol is None:
        # the parameter's roundoff, as documented: the oracle updates float64 parameters
        # in float64 whatever the gradients' dtype (float32 gradients took the float32
        # roundoff, and a float32 implementation passed for a float64 one)
        u = _unit_roundoff(W0.dtype)
        d = W0.shape[1]
        G64 = grads.astype(np.float64)
        a = np.zeros(W0.shape[0])
        ae = np.zeros(W0.shape)
        b = np.zeros(W0.shape)
        acc = np.zeros(W0.shape)
        full = _rownorm_oracle(W0, grads, lr, mu, eps).astype(np.float64)
        per_step = []
        for s in range(1, grads.shape[0] + 1):
            a = mu * a + (1 - mu) * scaled_row_norms(G64[s - 1])
            ae = mu * ae + (1 - mu) * np.abs(G64[s - 1])
            b = mu * b + (1 - mu) * G64[s - 1]
            nb = scaled_row_norms(b) + eps * abs(1 - mu**s)
            kappa = np.where(a > 0, a / np.where(nb > 0, nb, np.inf), 0.0)
            # per entry, not per row: an entry of the step errs by its own buffer entry's
            # rounding and by its share |rn_ij| of the norm's; the row-wise bound (every
            # entry allowed the whole row's) let a float16 momentum state pass at d = 4096
            den = np.where(nb > 0, nb, np.inf)[:, None]
            inc = 2 * lr * u * ((s + 4) * ae / den + np.abs(b) / den * ((s + 4) * kappa[:, None] + d + 4))
            # capped at 2 lr: two steps of entries at most lr differ by no more.  A row
            # whose float64 buffer cancelled to 0 (eps = 0) has no direction to check: the
            # exact one may be anything (a kernel exact in rationals failed by lr with a
            # tolerance of 8e-17, from kappa = 0 there)
            cap = 2 * lr * (1 + u)
            inc = np.where(((nb == 0) & (a > 0))[:, None], cap, np.minimum(inc, cap))
            acc = acc + inc
            per_step.append(acc + 2 * u * np.abs(full[s - 1]) * s)
        tol = np.stack([per_step[s - 1] for s in steps])
        text = ("sum over steps of 2 lr u ((s + 4) a_ij / n_i + |rn_ij| ((s + 4) kappa_i + d + 4)), each at "
                "most 2 lr (1 + u), + 2 u |W| (u of the parameter dtype; see Notes)")
    else:
        tol, text = _user_tol(rtol, atol, expected), _user_tol_text(rtol, atol)
    try:
        _compare_arrays(expected, got, tol, what="parameter", tol_text=text)
    except ConformanceError as exc:
        # (a result that is not real numbers is the mismatch already raised: text made
        # astype raise its own ValueError here)
        if got.shape == expected.shape and got.ndim == 3 and got.dtype.kind in "fiu":
            bad = ~(np.abs(got.astype(np.float64) - expected) <= tol)
            first = int(np.argmax(bad.reshape(bad.shape[0], -1).any(axis=1)))
            raise ConformanceError(
                f"step {steps[first]}: {exc.reason}", expected=exc.expected, got=exc.got, tolerance=exc.tolerance
            ) from None
        raise


# --------------------------------------------------------------------------- tokenwise


def assert_local_diagonal_fit_close(
    actual: Any,
    X: Any,
    Y: Any,
    neighbors: Any,
    /,
    *,
    lam: float = 0.0,
    rtol: float | None = None,
    atol: float | None = None,
) -> None:
    """Assert a candidate's tokenwise prediction :math:`A_i x_i` matches ``refgeo.fit_local_maps``.

    The diagonal class with identity prior on given neighborhoods:
    ``refgeo.fit_local_maps(X, Y, neighbors=neighbors, cls="diagonal", ridge=lam).fitted``.

    Parameters
    ----------
    actual : array_like of shape (N, d)
        The candidate's :math:`A_i x_i`.
    X, Y : ndarray of shape (N, d)
        Hidden states before and after the layer.
    neighbors : ndarray of int of shape (N, k) or refgeo.KNNResult
        Neighborhood :math:`N_k(i)` of every token.
    lam : float, default=0.0
        Ridge :math:`\\lambda` towards :math:`A_0 = I`.
    rtol, atol : float, default=None
        Replace the default tolerance by ``atol + rtol * |expected|``.

    Raises
    ------
    ConformanceError
        On a wrong shape or an entry out of tolerance.

    Notes
    -----
    Per coordinate c, :math:`a_{ic} = (\\sum_j x_{jc} y_{jc} + \\lambda)/(\\sum_j x_{jc}^2 + \\lambda)`
    over :math:`j \\in N_k(i)`.  Default tolerance of the entry :math:`(i, c)`, from the
    rounding of the two sums and the division in the input precision (:math:`u`):

    .. math:: 2\\gamma_{k+3}(u)\\,|x_{ic}|\\,
              \\frac{\\sum_j |x_{jc} y_{jc}| + \\lambda + |a_{ic}| (\\sum_j x_{jc}^2 + \\lambda)}
                   {\\sum_j x_{jc}^2 + \\lambda} + u\\,|a_{ic} x_{ic}|

    (infinite where the denominator vanishes: refgeo then returns the prior, a
    convention, not a numerical result).

    Examples
    --------
    >>> import numpy as np, refgeo
    >>> from refgeo.testing import assert_local_diagonal_fit_close
    >>> X = np.array([[1.0, 2.0], [2.0, 1.0], [3.0, 5.0], [4.0, 3.0]])
    >>> nb = refgeo.knn(X, 2).indices
    >>> assert_local_diagonal_fit_close(2.0 * X, X, 2.0 * X, nb)
    """
    _check_tols(rtol, atol)
    import refgeo

    lam = check_real(lam, "lam", min_value=0.0)
    X = _input(X)
    Y = _input(Y)
    # a KNNResult as fit_local_maps takes it (as an array it became a 0-d object array)
    # (isinstance: a torch tensor has an .indices method, for sparse tensors)
    nb = _input(neighbors.indices if isinstance(neighbors, refgeo.KNNResult) else neighbors)
    fit = _reference(refgeo.fit_local_maps, X, Y, neighbors=nb, cls="diagonal", ridge=lam, prior="identity")
    expected = np.asarray(fit.fitted, dtype=np.float64)
    got = as_numpy(actual)
    if rtol is None and atol is None:
        u = _unit_roundoff(np.result_type(X, Y))
        X64, Y64 = X.astype(np.float64), Y.astype(np.float64)
        Xn, Yn = X64[nb], Y64[nb]  # (N, k, d)
        den = (Xn * Xn).sum(axis=1) + lam
        num_abs = np.abs(Xn * Yn).sum(axis=1) + lam
        a = np.asarray(fit.coefficients, dtype=np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            rel = np.where(den > 0, (num_abs + np.abs(a) * den) / den, np.inf)
        tol = 2 * _gamma(nb.shape[1] + 3, u) * np.abs(X64) * rel + u * np.abs(expected)
        tol = np.where(np.isnan(tol), np.inf, tol)
        text = "2 gamma_(k+3)(u) |x_ic| (sum|x y| + lam + |a| (sum x^2 + lam)) / (sum x^2 + lam) + u |a x| (see Notes)"
    else:
        tol, text = _user_tol(rtol, atol, expected), _user_tol_text(rtol, atol)
    _compare_arrays(expected, got, tol, what="prediction", tol_text=text)
