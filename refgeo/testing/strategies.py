"""Hypothesis strategies for testing implementations of refgeo's quantities.

Every strategy draws NumPy arrays with the adversarial structure that breaks fast
kernels (large common offsets, exact and near duplicates, near-tie extremes, rank
deficiency, one huge row, extreme logits, zeros on shared or mismatched supports,
Fortran-ordered and strided views) next to plain random data.  Sizes and dtypes are
keyword arguments; the structure is drawn first from a list whose first entry is the
plainest one, so a failing example shrinks towards small, plain inputs and keeps only
the structure that matters.

.. autosummary::

   logits
   logit_pairs
   simplex_pairs
   row_clouds
   centered_gradients
   gradient_sequences
   hidden_state_pairs
   HiddenStatePair

Sizes are given as an ``int`` (fixed) or a ``(min, max)`` tuple; ``dtypes`` is one dtype
or a sequence of them (float32 and float64 are supported); ``layouts`` chooses among
``"C"``, ``"F"`` (Fortran order) and ``"strided"`` (a non-contiguous view into a larger
buffer whose unused entries are NaN, so a kernel that ignores strides reads NaN).

Examples
--------
>>> import numpy as np
>>> from hypothesis import given, settings
>>> from refgeo.testing import strategies as rst
>>> @settings(max_examples=20, database=None)
... @given(rst.row_clouds(n_rows=(2, 5), n_cols=3, dtypes="float32"))
... def test_shape(S):
...     assert S.dtype == np.float32 and S.shape[1] == 3
>>> test_shape()
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from hypothesis import reject
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

__all__ = [
    "GRADIENT_STRUCTURES",
    "HiddenStatePair",
    "LAYOUTS",
    "LOGIT_STRUCTURES",
    "MAP_CLASSES",
    "ROW_STRUCTURES",
    "SUPPORTS",
    "centered_gradients",
    "gradient_sequences",
    "hidden_state_pairs",
    "logit_pairs",
    "logits",
    "row_clouds",
    "simplex_pairs",
]

#: Structures of :func:`logits`, plainest first.
LOGIT_STRUCTURES = ("moderate", "integers", "extreme", "shifted", "spike", "constant", "near")
#: Supports of :func:`simplex_pairs`: all positive, zeros in the same places, zeros in
#: different places (Hilbert distance ``inf``).
SUPPORTS = ("full", "shared", "mismatched")
#: Structures of :func:`row_clouds`, plainest first.
ROW_STRUCTURES = (
    "generic",
    "integers",
    "duplicates",
    "near_duplicates",
    "near_ties",
    "offset",
    "rank_deficient",
    "huge_row",
)
#: Structures of :func:`centered_gradients`, plainest first.
GRADIENT_STRUCTURES = ("cross_entropy", "rank_one", "sparse", "multiscale", "zipf")
#: Classes of planted local maps in :func:`hidden_state_pairs`.
MAP_CLASSES = ("identity", "diagonal", "low_rank", "orthogonal")
#: Memory layouts of the drawn arrays.
LAYOUTS = ("C", "F", "strided")

_FLOAT_DTYPES = (np.dtype(np.float64), np.dtype(np.float32))
_BOUNDED: dict[str, Any] = dict(allow_nan=False, allow_infinity=False, allow_subnormal=False)
# arrays of up to this many entries are drawn entry by entry (see _unit)
_DRAW_EACH = 128


# --------------------------------------------------------------------------- arguments


class _ArgumentsChecked(Exception):
    pass


def _stop_at_first_draw(strategy):
    raise _ArgumentsChecked


def _composite(fn):
    """``st.composite`` whose arguments are checked when the strategy is built.

    Every strategy body validates its arguments before its first draw, so running it
    with a ``draw`` that stops at once raises argument errors eagerly, where the
    strategy is defined, instead of inside a test run.
    """
    strategy_fn = st.composite(fn)

    @functools.wraps(fn)
    def build(**kwargs):
        try:
            fn(_stop_at_first_draw, **kwargs)
        except _ArgumentsChecked:
            pass
        return strategy_fn(**kwargs)

    build.__signature__ = inspect.signature(strategy_fn)
    return build



def _size_range(value: Any, name: str, minimum: int) -> tuple[int, int]:
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        lo = hi = int(value)
    elif isinstance(value, tuple) and len(value) == 2 and all(
        isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in value
    ):
        lo, hi = int(value[0]), int(value[1])
    else:
        raise TypeError(f"{name} must be an int or a (min, max) tuple of ints, got {value!r} instead.")
    if lo < minimum or hi < lo:
        raise ValueError(f"{name} must satisfy {minimum} <= min <= max, got {value!r} instead.")
    return lo, hi


def _dtypes(value: Any) -> tuple[np.dtype, ...]:
    if isinstance(value, (str, type, np.dtype)):
        items = [value]
    elif hasattr(value, "__iter__"):
        items = list(value)
    else:  # list(3) said "'int' object is not iterable"
        raise TypeError(f"dtypes must be a dtype or a sequence of float32/float64 dtypes, got {value!r} instead.")
    out = []
    for item in items:
        try:
            dt = np.dtype(item)
        except TypeError:
            raise TypeError(f"dtypes must be float32/float64 dtypes, got {item!r} instead.") from None
        if dt not in _FLOAT_DTYPES:
            raise ValueError(f"dtypes must contain only float32 or float64, got {dt} instead.")
        out.append(dt)
    if not out:
        raise ValueError("dtypes must name at least one dtype, got an empty sequence instead.")
    return tuple(out)


def _positive_real(value: Any, name: str, *, minimum: float = 0.0, strict: bool = True) -> float:
    """A finite real number above ``minimum`` (``>=`` unless ``strict``), else TypeError/ValueError."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} ({value!r}) instead.")
    v = float(value)
    if not math.isfinite(v) or not (v > minimum if strict else v >= minimum):
        relation = ">" if strict else ">="
        raise ValueError(f"{name} must be a finite number {relation} {minimum:g}, got {value!r} instead.")
    return v


def _max_abs(value: Any, dts: tuple[np.dtype, ...]) -> float:
    """``max_abs`` of the logit strategies: positive, and finite in every drawn dtype."""
    v = _positive_real(value, "max_abs")
    for dt in dts:
        if v > float(np.finfo(dt).max):
            raise ValueError(
                f"max_abs must be at most the largest {dt} ({float(np.finfo(dt).max):.4g}) so that the drawn "
                f"logits are finite, got {value!r} instead (restrict dtypes to float64 for larger values)."
            )
    return v


def _choices(value: Any, name: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    items = (value,) if isinstance(value, str) else tuple(value)
    bad = [v for v in items if v not in allowed]
    if bad or not items:
        raise ValueError(f"{name} must be a non-empty selection of {allowed}, got {value!r} instead.")
    # Keep the library's order (plainest first) so that shrinking heads for plain cases.
    return tuple(v for v in allowed if v in items)


def _check_flag(value: Any, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} instead.")
    return bool(value)


def _draw_size(draw, bounds: tuple[int, int]) -> int:
    lo, hi = bounds
    return lo if lo == hi else draw(st.integers(lo, hi))


def _unit(draw, shape, lo=-1.0, hi=1.0) -> np.ndarray:
    """float64 array of bounded values; shrinks towards zeros.

    Every entry of a small array is drawn on its own (``fill=st.nothing()``): with
    hypothesis's fill a whole array often held one value, so 29% of "generic" and 59%
    of "offset" row clouds were one repeated row, and a kernel that skips the certified
    refinement passed the default budget in 3 of 10 runs.  Larger arrays cannot be
    drawn so (entry by entry, 1,000 of them failed hypothesis's health check
    large_base_example before the test ran), and with the fill 95% of them repeat a
    row: half of them are uniform values from a drawn seed instead (shrinking to the
    fill's arrays)."""
    if math.prod(shape) <= _DRAW_EACH:
        return draw(hnp.arrays(np.float64, shape, elements=st.floats(lo, hi, **_BOUNDED), fill=st.nothing()))
    if draw(st.booleans()):
        return np.random.default_rng(draw(st.integers(0, 2**32 - 1))).uniform(lo, hi, shape)
    return draw(hnp.arrays(np.float64, shape, elements=st.floats(lo, hi, **_BOUNDED)))


def _flush_subnormals(x: np.ndarray) -> np.ndarray:
    """``x`` with entries below the dtype's smallest normal set to 0 (in place).

    Values are drawn as normal float64 numbers; rounded to float32 some (1e-45) became
    subnormal, which a flush-to-zero kernel (a GPU's default) reads as 0.  The kit
    draws none: subnormal inputs are a test of their own, asked for by scale."""
    tiny = np.finfo(x.dtype).tiny
    x[np.abs(x) < tiny] = 0
    return x


def _apply_layout(x: np.ndarray, layout: str) -> np.ndarray:
    if layout == "F":
        return np.asfortranarray(x)
    if layout == "strided":
        big = np.full(tuple(2 * s + 1 for s in x.shape), np.nan, dtype=x.dtype)
        view = big[tuple(slice(1, None, 2) for _ in x.shape)]
        view[...] = x
        return view
    return np.ascontiguousarray(x)


def _pick(draw, options: tuple):
    """One of ``options``, spread evenly over a test run and shrinking to ``options[0]``.

    ``st.sampled_from`` inside a composite strategy often revisits the same few options
    for a whole run (hypothesis mutates earlier examples); a wide integer reduced modulo
    the number of options covers all of them, and still shrinks towards the first.
    """
    if len(options) == 1:
        return options[0]
    return options[draw(st.integers(0, (1 << 16) - 1)) % len(options)]


def _layout(draw, layouts: tuple[str, ...]) -> str:
    return _pick(draw, layouts)


def _nudge(x: np.ndarray, index: tuple[int, ...], ulps: int, limit: float = math.inf) -> None:
    """Move ``x[index]`` by ``ulps`` units in the last place (in x's dtype), in place;
    the other way where that would pass ``limit`` in magnitude (an entry at the dtype's
    largest value stepped to inf, outside a strategy's documented ``max_abs``).

    A zero entry is first replaced by half an ulp of 1 (no subnormals are produced).
    """
    v0 = x[index]
    if v0 == 0:  # an ulp of 1 rather than a subnormal: near, but never underflowing
        v0 = x.dtype.type(0.5) * np.finfo(x.dtype).eps
    for sign in (1, -1):
        direction = np.inf if sign * ulps > 0 else -np.inf
        v = v0
        with np.errstate(over="ignore"):  # a step past the largest value: the other way
            for _ in range(abs(ulps)):
                v = np.nextafter(v, x.dtype.type(direction))
        if abs(float(v)) <= limit:
            break
    x[index] = v


# --------------------------------------------------------------------------- logits


def _logit_values(draw, shape, dtype, structure, max_abs) -> np.ndarray:
    n, v = shape
    if structure == "moderate":
        z = _unit(draw, shape, -10.0, 10.0)
    elif structure == "integers":
        z = draw(hnp.arrays(np.int64, shape, elements=st.integers(-3, 3))).astype(np.float64)
    elif structure == "extreme":
        z = _unit(draw, shape, -max_abs, max_abs)
    elif structure == "shifted":
        # at most max_abs, as documented (a shift of 1e2 was drawn for any max_abs)
        small = min(1e2, max_abs)
        shift = draw(st.sampled_from([small, -small, max_abs, -max_abs]))
        z = np.clip(shift + _unit(draw, shape, -1.0, 1.0), -max_abs, max_abs)
    elif structure == "spike":
        z = _unit(draw, shape, -1.0, 1.0)
        col = draw(st.integers(0, v - 1))
        z[:, col] = draw(st.sampled_from([max_abs, -max_abs]))
    else:  # constant
        z = np.repeat(_unit(draw, (n, 1), -max_abs, max_abs), v, axis=1)
    return _flush_subnormals(z.astype(dtype))


@_composite
def logits(
    draw,
    *,
    n_rows: int | tuple[int, int] = (1, 6),
    n_cols: int | tuple[int, int] = (1, 16),
    dtypes: Any = _FLOAT_DTYPES,
    structures: Sequence[str] = LOGIT_STRUCTURES,
    max_abs: float = 1e4,
    layouts: Sequence[str] = LAYOUTS,
) -> np.ndarray:
    """Logit vectors as the rows of an array of shape (n, V).

    Parameters
    ----------
    n_rows, n_cols : int or (int, int), default=(1, 6) and (1, 16)
        Number of rows n and vocabulary size V (fixed or a range).
    dtypes : dtype or sequence of dtypes, default=(float64, float32)
    structures : sequence of str, default=LOGIT_STRUCTURES
        ``"moderate"`` (values in [-10, 10]), ``"integers"`` (ties between entries),
        ``"extreme"`` (values up to ``max_abs``, whose softmax underflows),
        ``"shifted"`` (a large common shift, to which every logit quantity is invariant),
        ``"spike"`` (one column at ``+-max_abs``), ``"constant"`` (softmax uniform).
        ``"near"`` only matters in :func:`logit_pairs` (here it draws ``"moderate"``).
    max_abs : float, default=1e4
        Size of the ``"extreme"``, ``"shifted"``, ``"spike"`` and ``"constant"`` logits:
        positive and at most the largest value of every drawn dtype (3.4e38 for
        float32), so that every drawn value is finite.
    layouts : sequence of {"C", "F", "strided"}, default=LAYOUTS

    Returns
    -------
    strategy
        Draws finite arrays of shape (n, V).
    """
    rows = _size_range(n_rows, "n_rows", 1)
    cols = _size_range(n_cols, "n_cols", 1)
    dts = _dtypes(dtypes)
    structs = _choices(structures, "structures", LOGIT_STRUCTURES)
    lays = _choices(layouts, "layouts", LAYOUTS)
    max_abs = _max_abs(max_abs, dts)
    shape = (_draw_size(draw, rows), _draw_size(draw, cols))
    dtype = _pick(draw, dts)
    structure = _pick(draw, structs)
    structure = "moderate" if structure == "near" else structure
    return _apply_layout(_logit_values(draw, shape, dtype, structure, max_abs), _layout(draw, lays))


@_composite
def logit_pairs(
    draw,
    *,
    n_rows: int | tuple[int, int] = (1, 6),
    n_cols: int | tuple[int, int] = (1, 16),
    dtypes: Any = _FLOAT_DTYPES,
    structures: Sequence[str] = LOGIT_STRUCTURES,
    max_abs: float = 1e4,
    layouts: Sequence[str] = LAYOUTS,
) -> tuple[np.ndarray, np.ndarray]:
    """Pairs ``(z, w)`` of logit arrays of the same shape (n, V) and dtype.

    Parameters are those of :func:`logits`.  ``z`` and ``w`` get independently drawn
    structures, except ``"near"``: ``w`` is ``z`` with a few entries moved by a few
    units in the last place (distances at the rounding level).

    Returns
    -------
    strategy
        Draws tuples ``(z, w)``.
    """
    rows = _size_range(n_rows, "n_rows", 1)
    cols = _size_range(n_cols, "n_cols", 1)
    dts = _dtypes(dtypes)
    structs = _choices(structures, "structures", LOGIT_STRUCTURES)
    lays = _choices(layouts, "layouts", LAYOUTS)
    max_abs = _max_abs(max_abs, dts)
    shape = (_draw_size(draw, rows), _draw_size(draw, cols))
    dtype = _pick(draw, dts)
    sz = _pick(draw, structs)
    if sz == "near":
        z = _logit_values(draw, shape, dtype, "extreme", max_abs)
        w = z.copy()
        for _ in range(draw(st.integers(1, 3))):
            idx = (draw(st.integers(0, shape[0] - 1)), draw(st.integers(0, shape[1] - 1)))
            _nudge(w, idx, draw(st.sampled_from([1, -1, 3, -3])), limit=float(np.max(np.abs(z), initial=max_abs)))
        _flush_subnormals(w)  # an entry at the smallest normal moved towards 0
    else:
        sw = _pick(draw, tuple(s for s in structs if s != "near") or ("moderate",))
        z = _logit_values(draw, shape, dtype, sz, max_abs)
        w = _logit_values(draw, shape, dtype, sw, max_abs)
    layout = _layout(draw, lays)
    return _apply_layout(z, layout), _apply_layout(w, layout)


# --------------------------------------------------------------------------- probabilities


def _positive_rows(draw, shape, dtype) -> np.ndarray:
    tiny = 1e-30 if dtype == np.float32 else 1e-300
    mags = draw(hnp.arrays(np.int64, shape, elements=st.sampled_from([0, 0, 0, 1, 3, 8, 30, 300])))
    mags = np.minimum(mags, -int(math.log10(tiny)))
    base = _unit(draw, shape, 0.5, 1.0)
    return base * 10.0 ** (-mags.astype(np.float64))


@_composite
def simplex_pairs(
    draw,
    *,
    n_rows: int | tuple[int, int] = (1, 6),
    n_cols: int | tuple[int, int] = (1, 12),
    dtypes: Any = _FLOAT_DTYPES,
    supports: Sequence[str] = SUPPORTS,
    normalize: bool = True,
    layouts: Sequence[str] = LAYOUTS,
) -> tuple[np.ndarray, np.ndarray]:
    """Pairs ``(p, q)`` of probability vectors (rows) with zeros on chosen supports.

    Parameters
    ----------
    n_rows, n_cols : int or (int, int), default=(1, 6) and (1, 12)
    dtypes : dtype or sequence of dtypes, default=(float64, float32)
    supports : sequence of {"full", "shared", "mismatched"}, default=SUPPORTS
        All entries positive; zeros in the same places in ``p`` and ``q`` (the distance is
        the one on that face); zeros in different places (``inf``; a row of ``p`` and ``q``
        differ in at least one support entry; drawn only for V >= 2: a V = 1 draw takes
        another of the selected supports, and with ``"mismatched"`` alone V >= 2).
        Entries span 1 down to 1e-30 (float32) or 1e-300 (float64), so logs of very
        different sizes meet.
    normalize : bool, default=True
        Rows sum to 1 (computed in float64, then rounded to the dtype); otherwise they
        carry arbitrary positive scales (the Hilbert distance is projective).
    layouts : sequence of {"C", "F", "strided"}, default=LAYOUTS

    Returns
    -------
    strategy
        Draws tuples ``(p, q)`` of non-negative arrays of shape (n, V), each row with a
        positive entry.
    """
    rows = _size_range(n_rows, "n_rows", 1)
    cols = _size_range(n_cols, "n_cols", 1)
    dts = _dtypes(dtypes)
    sups = _choices(supports, "supports", SUPPORTS)
    lays = _choices(layouts, "layouts", LAYOUTS)
    normalize = _check_flag(normalize, "normalize")
    if sups == ("mismatched",) and cols[1] < 2:
        raise ValueError(
            f"supports=('mismatched',) needs n_cols >= 2 (one column has no second support entry), got "
            f"n_cols={n_cols!r} instead."
        )
    if sups == ("mismatched",):
        cols = (max(2, cols[0]), cols[1])  # every draw must have a second support entry
    n, v = _draw_size(draw, rows), _draw_size(draw, cols)
    dtype = _pick(draw, dts)
    support = _pick(draw, sups)
    if support == "mismatched" and v < 2:
        support = "full" if "full" in sups else sups[0]
    p = _positive_rows(draw, (n, v), dtype)
    q = _positive_rows(draw, (n, v), dtype)
    if support != "full":
        mask_p = draw(hnp.arrays(np.bool_, (n, v)))
        mask_p[np.arange(n), draw(hnp.arrays(np.int64, n, elements=st.integers(0, v - 1)))] = True
        mask_q = mask_p.copy()
        if support == "mismatched":
            # Flip one entry per row, keeping a positive entry in q.
            for r in range(n):
                c = draw(st.integers(0, v - 1))
                mask_q[r, c] = not mask_q[r, c]
                if not mask_q[r].any():
                    mask_q[r, (c + 1) % v] = True
                    if mask_p[r, (c + 1) % v] and mask_p[r].sum() == 1:
                        mask_p[r, c] = True
        p = np.where(mask_p, p, 0.0)
        q = np.where(mask_q, q, 0.0)
    if normalize:
        p = p / p.sum(axis=1, keepdims=True)
        q = q / q.sum(axis=1, keepdims=True)
    else:
        p = p * draw(st.sampled_from([1.0, 1e3, 1e-3]))
        q = q * draw(st.sampled_from([1.0, 7.0, 1e-6]))
    layout = _layout(draw, lays)
    return _apply_layout(p.astype(dtype), layout), _apply_layout(q.astype(dtype), layout)


# --------------------------------------------------------------------------- row clouds


def _extreme_pair(x: np.ndarray, farthest: bool) -> tuple[int, int]:
    """A pair of rows of ``x`` at the largest distance, or at the smallest positive one
    (the largest where every pair is at 0).  ``x`` holds small integers times one
    scale, so the Gram identity is exact in float64 (O(V^2) memory; the differences
    took V^2 d, 371 MB at V = 1500, d = 16)."""
    y = x.astype(np.float64)
    n = np.einsum("ij,ij->i", y, y)
    D2 = n[:, None] + n[None, :] - 2.0 * (y @ y.T)
    iu = np.triu_indices(len(y), 1)
    vals = D2[iu]
    if not farthest and np.any(vals > 0):
        k = int(np.argmin(np.where(vals > 0, vals, np.inf)))
    else:
        k = int(np.argmax(vals))
    return int(iu[0][k]), int(iu[1][k])


# the structures whose draws must not be one repeated row (the "duplicates" structure
# draws repeated rows on purpose)
_SPREAD_STRUCTURES = ("generic", "offset", "rank_deficient", "huge_row")


def _row_values(draw, v, d, dtype, structure, max_offset) -> np.ndarray:
    if structure == "integers":
        return draw(hnp.arrays(np.int64, (v, d), elements=st.integers(-3, 3))).astype(dtype)
    if structure == "duplicates":
        k = draw(st.integers(1, max(1, v - 1)))
        distinct = _unit(draw, (k, d))
        idx = draw(hnp.arrays(np.int64, v, elements=st.integers(0, k - 1)))
        idx[: min(k, v)] = np.arange(min(k, v))
        idx[-1] = draw(st.integers(0, k - 1))  # at least one repeated row (v > k)
        return distinct[idx].astype(dtype)
    if structure == "near_duplicates":
        x = _unit(draw, (v, d)).astype(dtype)
        for _ in range(draw(st.integers(1, 2))):
            a = draw(st.integers(0, v - 1))
            b = (a + draw(st.integers(1, max(1, v - 1)))) % v
            x[b] = x[a]
            _nudge(x, (b, draw(st.integers(0, d - 1))), draw(st.sampled_from([1, -1, 2])))
        return x
    if structure == "near_ties":
        # Vertices of a cube / cross-polytope have many exactly tied distances; one
        # entry moved by an ulp turns an exact tie into a near tie.
        x = draw(hnp.arrays(np.int64, (v, d), elements=st.sampled_from([-1, 1, 0]))).astype(dtype)
        scale = dtype.type(draw(st.sampled_from([1.0, 3.0, 1e3])))
        x = x * scale
        # the nudged entry is one of a pair at the largest or the smallest positive
        # distance, where a tie decides the answer (a random entry missed the extreme
        # pairs in 9 draws of 10)
        i, j = _extreme_pair(x, draw(st.booleans())) if v > 1 else (0, 0)
        row = (i, j)[draw(st.integers(0, 1))]
        _nudge(x, (row, draw(st.integers(0, d - 1))), draw(st.sampled_from([1, -1])))
        return x
    if structure == "offset":
        exps = [e for e in (2, 4, 6, 8) if 10.0**e <= max_offset] or [0]
        mag = 10.0 ** _pick(draw, tuple(exps))
        offset = mag * _unit(draw, (1, d), 0.5, 1.0) * draw(st.sampled_from([1.0, -1.0]))
        return (offset + _unit(draw, (v, d))).astype(dtype)
    if structure == "rank_deficient":
        r = draw(st.integers(1, max(1, min(v, d) - 1)))  # rank 1 where min(V, d) = 1
        return (_unit(draw, (v, r)) @ _unit(draw, (r, d))).astype(dtype)
    if structure == "huge_row":
        x = _unit(draw, (v, d))
        x[draw(st.integers(0, v - 1))] *= draw(st.sampled_from([1e3, 1e6]))
        return x.astype(dtype)
    return _unit(draw, (v, d)).astype(dtype)  # generic


@_composite
def row_clouds(
    draw,
    *,
    n_rows: int | tuple[int, int] = (2, 12),
    n_cols: int | tuple[int, int] = (1, 6),
    dtypes: Any = _FLOAT_DTYPES,
    structures: Sequence[str] = ROW_STRUCTURES,
    max_offset: float = 1e8,
    layouts: Sequence[str] = LAYOUTS,
) -> np.ndarray:
    """Row matrices ``S`` of shape (V, d) with adversarial geometry.

    Parameters
    ----------
    n_rows, n_cols : int or (int, int), default=(2, 12) and (1, 6)
        V and d; the defaults include V = 2 and d = 1.
    dtypes : dtype or sequence of dtypes, default=(float64, float32)
    structures : sequence of str, default=ROW_STRUCTURES
        ``"generic"`` (entries in [-1, 1]); ``"integers"`` (small integers: many exactly
        tied distances); ``"duplicates"`` (repeated rows, closest distance 0);
        ``"near_duplicates"`` (a row equal to another up to a few ulps);
        ``"near_ties"`` (scaled cube/cross-polytope vertices with one entry moved by one
        ulp); ``"offset"`` (a common offset row of size 1e2 to ``max_offset`` added to a
        spread of size 1: the Gram identity ``|x|^2 + |y|^2 - 2 x.y`` cancels
        catastrophically unless rows are centered); ``"rank_deficient"`` (rank < min(V, d)
        where that is at least 2, else rank 1, in float64, before the one rounding to
        the drawn dtype: in float32 the smallest singular values are about 1e-8 of the
        largest, not 0);
        ``"huge_row"`` (one row 1e3 or 1e6 times the others).  Draws of
        ``"generic"``, ``"offset"``, ``"rank_deficient"`` and ``"huge_row"`` never
        repeat one row V times, and no entry is subnormal in the drawn dtype.
    max_offset : float, default=1e8
        Largest common offset (ratio of offset to spread), ``>= 1``; below 1e2 the
        offset is of size 1.
    layouts : sequence of {"C", "F", "strided"}, default=LAYOUTS

    Returns
    -------
    strategy
        Draws finite arrays of shape (V, d).  Values are built in float64 and rounded
        once to the drawn dtype, so the array is exactly what the oracle sees.
    """
    rows = _size_range(n_rows, "n_rows", 1)
    cols = _size_range(n_cols, "n_cols", 1)
    dts = _dtypes(dtypes)
    structs = _choices(structures, "structures", ROW_STRUCTURES)
    lays = _choices(layouts, "layouts", LAYOUTS)
    max_offset = _positive_real(max_offset, "max_offset", minimum=1.0, strict=False)
    v, d = _draw_size(draw, rows), _draw_size(draw, cols)
    dtype = _pick(draw, dts)
    structure = _pick(draw, structs)
    x = _flush_subnormals(_row_values(draw, v, d, dtype, structure, max_offset))
    if structure in _SPREAD_STRUCTURES and v > 1 and not np.any(x != x[:1]):
        # one repeated row (a float32 offset of 1e8 rounds a spread of 1 away) tests
        # nothing these structures are for; hypothesis draws again
        reject()
    return _apply_layout(x, _layout(draw, lays))


# --------------------------------------------------------------------------- gradients


def _unit_top(G: np.ndarray) -> np.ndarray:
    """G divided by a power of two (exactly) so that its largest magnitude is in [1/2, 1).

    The overall size of a gradient is then the caller's ``scale``, not an accident of
    the float draw: hypothesis likes tiny floats, and a whole gradient at 1e-258 would
    make every textbook ``b / sqrt(sum(b**2))`` kernel underflow (see
    :func:`centered_gradients`).
    """
    top = float(np.max(np.abs(G))) if G.size else 0.0
    if top == 0.0:
        return np.zeros_like(G)
    # ldexp scales exactly, also from subnormal entries (a product by 2**1070 would overflow).
    return np.ldexp(G, -math.frexp(top)[1])


def _snap_and_center(G: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Round G to a coarse binary grid and set the last row to minus the sum of the others.

    On the grid every partial sum of rows is exact in ``dtype``, so the rows sum to
    exactly zero whatever the summation order.  The largest magnitude ends up in [1/2, 1).
    """
    v = G.shape[0]
    G = _unit_top(G)
    if not G.any():
        return np.zeros_like(G, dtype=dtype)
    mant = np.finfo(dtype).nmant + 1
    bits = mant - (int(math.ceil(math.log2(v))) + 2)
    step = 2.0 ** -bits
    Gs = np.round(G / step) * step
    Gs[-1] = -Gs[:-1].sum(axis=0)
    return _unit_top(Gs).astype(dtype)  # the last row may exceed 1; power-of-two scaling is exact


def _softmax(z):
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _gradient_values(draw, v, d, dtype, structure) -> np.ndarray:
    if structure == "rank_one":
        a = _unit(draw, (v, 1))
        return _snap_and_center(a * _unit(draw, (1, d), 0.25, 1.0), dtype)
    if structure == "sparse":
        G = np.zeros((v, d))
        k = draw(st.integers(1, max(1, v // 2)))
        rows = draw(st.permutations(range(v)))[: 2 * k]
        for a, b in zip(rows[0::2], rows[1::2]):
            g = _unit(draw, (d,), 0.25, 1.0)
            G[a], G[b] = g, -g
        return _snap_and_center(G, dtype)
    if structure == "multiscale":
        # Rows of very different norms (down to 1e-10): makes the eps of RN_eps matter.
        G = _unit(draw, (v, d), 0.1, 1.0) * np.sign(_unit(draw, (v, d)) + 0.5)
        exps = draw(hnp.arrays(np.int64, (v, 1), elements=st.sampled_from([0, 3, 6, 8, 9, 10])))
        G = G * 10.0 ** (-exps.astype(np.float64))
        G[-1] = -G[:-1].sum(axis=0) if v > 1 else 0.0
        # rounded to the dtype first, then scaled (exactly): scaled first, a largest
        # entry 0.9999999999999999 rounded to 1.0 in float32, outside [scale/2, scale)
        return _unit_top(G.astype(dtype))
    if structure == "zipf":
        # An LM head's gradient: targets c_t with Zipf frequencies (rank r drawn with
        # weight 1/r), logits that favor the frequent tokens (a log-frequency prior),
        # and hidden states h_t = m + n_t with a common component m 10 to 1000 times
        # their spread.  G = sum_t (softmax(z_t) - e_{c_t}) h_t^T is then nearly rank
        # one along m, with row sizes set by the frequencies of the targets.
        n_tok = draw(st.integers(4, 16))
        ranks = np.arange(1, v + 1, dtype=np.float64)
        cdf = np.cumsum(1.0 / ranks) / np.sum(1.0 / ranks)
        u = _unit(draw, (n_tok,), 0.0, 1.0)
        c = np.minimum(np.searchsorted(cdf, u, side="right"), v - 1)
        Z = -np.log(ranks)[None, :] + _unit(draw, (n_tok, v), -1.0, 1.0)
        sign = np.where(_unit(draw, (1, d)) < 0, -1.0, 1.0)
        m = 10.0 ** _pick(draw, (1, 2, 3)) * _unit(draw, (1, d), 0.5, 1.0) * sign
        H = m + _unit(draw, (n_tok, d))
        R = _softmax(Z)
        R[np.arange(n_tok), c] -= 1.0
        return _snap_and_center(R.T @ H, dtype)
    # cross_entropy: G = sum_t (softmax(z_t) - e_{c_t}) h_t^T over a few tokens t.
    n_tok = draw(st.integers(1, 4))
    Z = _unit(draw, (n_tok, v), -4.0, 4.0)
    c = draw(hnp.arrays(np.int64, n_tok, elements=st.integers(0, v - 1)))
    H = _unit(draw, (n_tok, d), -1.0, 1.0)
    R = _softmax(Z)
    R[np.arange(n_tok), c] -= 1.0
    return _snap_and_center(R.T @ H, dtype)


@_composite
def centered_gradients(
    draw,
    *,
    n_rows: int | tuple[int, int] = (2, 12),
    n_cols: int | tuple[int, int] = (1, 6),
    dtypes: Any = _FLOAT_DTYPES,
    structures: Sequence[str] = GRADIENT_STRUCTURES,
    layouts: Sequence[str] = LAYOUTS,
    scales: Sequence[float] = (1.0,),
) -> np.ndarray:
    """Cross-entropy-like gradients ``G`` of shape (V, d) whose rows sum to zero.

    Parameters
    ----------
    n_rows, n_cols : int or (int, int), default=(2, 12) and (1, 6)
    dtypes : dtype or sequence of dtypes, default=(float64, float32)
    structures : sequence of str, default=GRADIENT_STRUCTURES
        ``"cross_entropy"`` (:math:`G = \\sum_t (\\mathrm{softmax}(z_t) - e_{c_t}) h_t^T`
        over 1-4 tokens); ``"rank_one"`` (:math:`a b^T`, closed forms in :doc:`/theory/lmo`);
        ``"sparse"`` (pairs of opposite rows, the others exactly zero);
        ``"multiscale"`` (row norms from 1 down to 1e-10); ``"zipf"`` (an LM head's
        gradient over 4-16 tokens: Zipf target frequencies, logits with a
        log-frequency prior, hidden states with a common component 10 to 1000 times
        their spread, so G is nearly rank one, along that component).
    layouts : sequence of {"C", "F", "strided"}, default=LAYOUTS
    scales : sequence of float, default=(1.0,)
        Overall size: the largest entry of a drawn nonzero ``G`` has magnitude in
        ``[scale/2, scale)``, with ``scale`` drawn from this list (powers of two keep
        the rows' sums exactly zero).  Dtypes in which a scale is not a normal number
        are not drawn (``scales=(2.0**-600,)`` draws float64 only); ``ValueError``
        when none is left.

    Returns
    -------
    strategy
        Draws arrays of shape (V, d) with :math:`\\mathbf{1}^T G = 0`: exactly (every
        partial sum is exact in the dtype, for scales that are powers of two) for all
        structures but ``"multiscale"``, whose rows sum to zero up to rounding.  The zero
        gradient is drawn too (hypothesis shrinks towards it): every kernel must return
        a zero step for it.

    Notes
    -----
    Why the size is a parameter and not left to the float draw: the textbook row
    normalization ``b / sqrt(sum(b**2))`` squares the entries, which underflows for rows
    of norm below about :math:`\\sqrt{\\text{tiny}}` (1.5e-154 in float64, 1.1e-19 in
    float32; 1e-4 or so in float16 accumulation) and returns a zero row where the
    reference returns a unit direction.  Gradients of a real LM head are nowhere near
    that in float64, so the default draws keep the largest entry near ``scale`` and a
    plain kernel passes; to test a kernel's behavior on such inputs (a float16 kernel,
    or a scale-safe one that divides by the largest entry first), ask for them, e.g.
    ``scales=(2.0**-600,)``.
    """
    rows = _size_range(n_rows, "n_rows", 2)
    cols = _size_range(n_cols, "n_cols", 1)
    dts = _dtypes(dtypes)
    structs = _choices(structures, "structures", GRADIENT_STRUCTURES)
    lays = _choices(layouts, "layouts", LAYOUTS)
    scales = _scales(scales)
    dts = _dtypes_for_scales(dts, scales)
    v, d = _draw_size(draw, rows), _draw_size(draw, cols)
    dtype = _pick(draw, dts)
    G = _gradient_values(draw, v, d, dtype, _pick(draw, structs))
    G = G * dtype.type(_pick(draw, scales))
    return _apply_layout(G, _layout(draw, lays))


def _scales(scales: Sequence[float]) -> tuple[float, ...]:
    if isinstance(scales, (str, bytes)) or not isinstance(scales, Sequence):
        raise TypeError(f"scales must be a sequence of positive numbers, got {type(scales).__name__} instead.")
    if any(isinstance(c, (bool, np.bool_)) or not isinstance(c, (int, float, np.integer, np.floating)) for c in scales):
        raise TypeError(f"scales must be a sequence of positive numbers, got {scales!r} instead.")
    out = tuple(float(c) for c in scales)
    if not out or not all(c > 0 and math.isfinite(c) for c in out):
        raise ValueError(f"scales must be positive finite numbers, got {scales!r} instead.")
    return out


def _dtypes_for_scales(dts: tuple[np.dtype, ...], scales: tuple[float, ...]) -> tuple[np.dtype, ...]:
    """The dtypes in which every scale is a normal number (2**-600 is zero in float32)."""
    out = tuple(dt for dt in dts if all(float(np.finfo(dt).tiny) <= c <= float(np.finfo(dt).max) for c in scales))
    if not out:
        raise ValueError(
            f"scales must be normal numbers of a drawn dtype ({', '.join(str(dt) for dt in dts)}), got "
            f"{scales!r} instead: a gradient of that size is zero or infinite there."
        )
    return out


@_composite
def gradient_sequences(
    draw,
    *,
    n_steps: int | tuple[int, int] = (1, 4),
    n_rows: int | tuple[int, int] = (2, 8),
    n_cols: int | tuple[int, int] = (1, 4),
    dtypes: Any = _FLOAT_DTYPES,
    structures: Sequence[str] = ("cross_entropy", "rank_one", "sparse"),
    scales: Sequence[float] = (1.0, 2.0**-20, 2.0**-27, 2.0**-30),
) -> np.ndarray:
    """A sequence of T centered gradients, stacked in an array of shape (T, V, d).

    Each step draws its own structure (see :func:`centered_gradients`) and its own
    overall scale, so one sequence mixes, say, a large cross-entropy step with steps
    of size 1e-9, for which the ``eps`` of a RowNorm step and its bias correction
    matter.

    Parameters
    ----------
    n_steps, n_rows, n_cols : int or (int, int), default=(1, 4), (2, 8), (1, 4)
    dtypes : dtype or sequence of dtypes, default=(float64, float32)
    structures : sequence of str, default=("cross_entropy", "rank_one", "sparse")
        Structures of :func:`centered_gradients` (all of whose rows sum to exactly zero).
    scales : sequence of float, default=(1, 2**-20, 2**-27, 2**-30)
        Per-step sizes (the largest entry of a nonzero step is in ``[scale/2, scale)``);
        powers of two keep the rows' sums exactly zero.  Dtypes in which a scale is not
        a normal number are not drawn, as in :func:`centered_gradients`.

    Returns
    -------
    strategy
        Draws C-contiguous arrays of shape (T, V, d).
    """
    steps = _size_range(n_steps, "n_steps", 1)
    rows = _size_range(n_rows, "n_rows", 2)
    cols = _size_range(n_cols, "n_cols", 1)
    dts = _dtypes(dtypes)
    structs = _choices(structures, "structures", GRADIENT_STRUCTURES)
    scales = _scales(scales)
    dts = _dtypes_for_scales(dts, scales)
    t, v, d = _draw_size(draw, steps), _draw_size(draw, rows), _draw_size(draw, cols)
    dtype = _pick(draw, dts)
    out = []
    for _ in range(t):
        G = _gradient_values(draw, v, d, dtype, _pick(draw, structs))
        out.append(G * dtype.type(_pick(draw, scales)))
    return np.stack(out)


# --------------------------------------------------------------------------- hidden states


@dataclasses.dataclass(frozen=True, slots=True)
class HiddenStatePair:
    """Hidden states before and after a layer, with planted tokenwise structure.

    Attributes
    ----------
    X : ndarray of shape (N, d)
        Hidden states :math:`h_l` (token clusters around a few centers).
    Y : ndarray of shape (N, d)
        :math:`y_i = A_{c(i)} x_i + r_i`.
    maps : ndarray of shape (K, d, d)
        The planted local maps :math:`A_k`, one per cluster (float64).
    labels : ndarray of shape (N,)
        Cluster :math:`c(i)` of each token.
    residual : ndarray of shape (N, d)
        Planted residuals :math:`r_i` (float64): zero except on ``outliers``.
    outliers : ndarray of shape (n_outliers,)
        Tokens given a large residual (sorted).
    map_class : str
        One of :data:`MAP_CLASSES`.
    """

    X: np.ndarray
    Y: np.ndarray
    maps: np.ndarray
    labels: np.ndarray
    residual: np.ndarray
    outliers: np.ndarray
    map_class: str


def _orthogonal(M: np.ndarray) -> np.ndarray:
    Q, R = np.linalg.qr(M + 2.0 * np.eye(M.shape[0]))  # shifted: never singular
    return Q * np.where(np.diag(R) < 0, -1.0, 1.0)


@_composite
def hidden_state_pairs(
    draw,
    *,
    n_tokens: int | tuple[int, int] = (6, 24),
    n_cols: int | tuple[int, int] = (1, 5),
    n_clusters: int | tuple[int, int] = (1, 3),
    dtypes: Any = _FLOAT_DTYPES,
    map_classes: Sequence[str] = MAP_CLASSES,
    max_outliers: int = 2,
    outlier_size: float = 1.0,
) -> HiddenStatePair:
    """Pairs ``(X, Y)`` of hidden-state panels whose update is planted tokenwise.

    Tokens fall in K well-separated clusters; every token of cluster k is mapped by
    the same :math:`A_k` of the chosen class (identity, diagonal with entries in
    [0.5, 2], :math:`I + BC^T` of rank 1, or orthogonal), and up to ``max_outliers``
    tokens get a residual of norm ``outlier_size``.  A local fit on neighbors within
    the cluster recovers :math:`A_k`, so the planted residuals are what a tokenwise
    decomposition must report.

    Parameters
    ----------
    n_tokens, n_cols, n_clusters : int or (int, int)
        N, d and K.
    dtypes : dtype or sequence of dtypes, default=(float64, float32)
    map_classes : sequence of str, default=MAP_CLASSES
    max_outliers : int, default=2
        At most this many outliers, ``>= 0``.
    outlier_size : float, default=1.0
        Norm of every planted residual, finite and ``>= 0``.

    Returns
    -------
    strategy
        Draws :class:`HiddenStatePair` instances (X and Y in the drawn dtype).
    """
    toks = _size_range(n_tokens, "n_tokens", 2)
    cols = _size_range(n_cols, "n_cols", 1)
    ks = _size_range(n_clusters, "n_clusters", 1)
    dts = _dtypes(dtypes)
    classes = _choices(map_classes, "map_classes", MAP_CLASSES)
    if isinstance(max_outliers, (bool, np.bool_)) or not isinstance(max_outliers, (int, np.integer)):
        raise TypeError(f"max_outliers must be an int, got {type(max_outliers).__name__} instead.")
    if max_outliers < 0:
        raise ValueError(f"max_outliers must be >= 0, got {max_outliers!r} instead.")
    outlier_size = _positive_real(outlier_size, "outlier_size", strict=False)
    n, d = _draw_size(draw, toks), _draw_size(draw, cols)
    k = min(_draw_size(draw, ks), n)
    dtype = _pick(draw, dts)
    map_class = _pick(draw, classes)
    labels = np.sort(np.arange(n) % k)
    centers = 10.0 * np.arange(k, dtype=np.float64)[:, None] * np.ones((1, d)) + 5.0
    X = centers[labels] + _unit(draw, (n, d))
    maps = np.empty((k, d, d))
    for c in range(k):
        if map_class == "identity":
            maps[c] = np.eye(d)
        elif map_class == "diagonal":
            maps[c] = np.diag(_unit(draw, (d,), 0.5, 2.0))
        elif map_class == "low_rank":
            maps[c] = np.eye(d) + 0.5 * _unit(draw, (d, 1)) @ _unit(draw, (1, d))
        else:
            maps[c] = _orthogonal(_unit(draw, (d, d)))
    residual = np.zeros((n, d))
    n_out = draw(st.integers(0, min(max_outliers, n)))
    outliers = np.sort(np.asarray(draw(st.permutations(range(n)))[:n_out], dtype=np.int64))
    for t in outliers:
        sign = np.sign(_unit(draw, (d,)) + 0.5)
        r = _unit(draw, (d,), 0.5, 1.0) * np.where(sign == 0, 1.0, sign)  # never a zero row
        residual[t] = outlier_size * r / np.linalg.norm(r)
    X = X.astype(dtype)
    Y = (np.einsum("nij,nj->ni", maps[labels], X.astype(np.float64)) + residual).astype(dtype)
    return HiddenStatePair(X, Y, maps, labels, residual, outliers, map_class)
