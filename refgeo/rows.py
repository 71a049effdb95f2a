"""Row geometry of an LM-head update (see :doc:`/theory/rows`): certified extreme pairs and k-NN.

For an update :math:`S \\in \\mathbb{R}^{V \\times d}` with rows :math:`s_i`, the row
diameter :math:`D(S) = \\max_{i<j} \\lVert s_i - s_j \\rVert_2` is the operator norm
from :math:`\\ell_2` to :math:`(\\mathbb{R}^V/\\mathbb{R}\\mathbf{1}, \\lVert\\cdot\\rVert_{var})`:
it is the largest Hilbert distance a step can cause for a hidden state of unit norm.

.. autosummary::

   row_diameter
   closest_pair
   distance_ratio
   farthest_partners
   knn
   covering_radius
   jung_constant
   worst_case_hidden_state
   hilbert_rms
   backward_bound

Exact means certified
---------------------
Every distance this module reports is the *refined* float64 value

.. math:: r_{ij} = \\mathrm{fl}\\Big(\\sum_k \\mathrm{fl}(s_{ik} - s_{jk})^2\\Big)

computed by direct differences in float64 in one fixed summation order (eight
interleaved partial sums, lane ``k mod 8``, combined as
``((p0+p1)+(p2+p3))+((p4+p5)+(p6+p7))``), so the reference and the compiled backend
agree bit for bit.  The compiled backend filters pairs with the Gram expansion and
refines, in float64, every pair whose filtered value lies within an a-priori rounding
bound of the running extreme (see :func:`row_diameter`, Notes); the reference
evaluates every pair directly.  CuPy arrays run the same filter and refinement with
whole-tile array operations (cuBLAS GEMM in IEEE float32/float64, never TF32; float64
refinement on the device), written against the array API.  Ties go to the
lexicographically smallest ``(i, j)`` (for k-NN: the smaller index), so every backend,
tile size and thread count returns the same value and the same indices.

The whole float range
---------------------
float64 rows whose largest magnitude ``m`` lies outside ``[2**-64, 2**65)`` are first
multiplied by ``2**-e`` with ``e`` the binary exponent of ``m`` (``m`` then lies in
``[1/2, 1)``), on every backend alike, and the distances are multiplied back by
``2**e``.  Both steps are exact in binary floating point, so rows of size ``1e200`` or
``1e-300`` get their finite distances, and scaling the rows by a power of two scales
every distance by exactly that power.  Two limits remain, where no scaling can help:
a distance above the largest float64 (about ``1.8e308``, rows of opposite sign near
the top of the range) raises ``ValueError``; and a distance below about ``2**-511 m``
has a subnormal square, so it keeps only the absolute accuracy of the canonical squared
sum (about ``sqrt(d) 2**-537 m``), not a relative one (entries more than ``2**1022``
times smaller than ``m`` are themselves subnormal once scaled).  float32 rows are never
scaled: their squares always fit in float64.

Input dtypes
------------
float32 and float64 rows are used as they are.  Every other real input is read as
float64: integers and booleans (exactly; integers of magnitude above 2**53 raise
``ValueError``, as float64 cannot hold every one of them), NumPy float16 (exactly) and NumPy long double (rounded
once to float64: rows that only long double tells apart become equal rows, and the
certified answers are those of the rounded rows).  Torch and JAX bfloat16, float16 and
float8 tensors are upcast to float32 (exactly; the results' ``converted_from`` names
the dtype); integer and boolean tensors are a ``TypeError``.

Progress
--------
The engine functions take ``progress=False|True|callable``.  ``True`` shows a tqdm bar
(when tqdm is not installed: one ``UserWarning`` per process, and nothing else).  A
callable is called as ``progress(info)`` with ``info = {"done", "total", "elapsed",
"eta"}`` (steps, steps, seconds, seconds; ``eta`` is NaN before the first step), from
the calling thread only, at most four times a second: once when the work starts
(``done == 0``), between tiles, and once at the end with ``done == total``; ``done``
never decreases.  On the compiled engine a step is one task of the tile driver (a tile
pair; for k-NN also a block of 64 rows in the certification pass); the total is known
when the kernel starts and grows only when k-NN redoes rows with a float64 filter, or
when the closest pair's float32 run exceeds its budget of refinements and a float64 run
follows (one more run each).  :func:`distance_ratio` counts both of its kernels in one total.  The
reference, CuPy and Dask backends report their whole run as one step, at its end: a
callable is told only the start and the end, and cannot stop them in between (Ctrl-C
can).  An exception raised by the callable stops the computation and propagates; the
results are bitwise the same with progress on or off.

Where the code lives
--------------------
This module holds the results and the public functions.  The certification algebra
(rounding bound, canonical squared distance, tie rule, prescaling) is in
``refgeo/_certify.py``, the brute-force reference kernels in ``refgeo/_reference.py``,
the compiled-engine wrappers in ``refgeo/_engine.py``, the array-API (CuPy) engine in
``refgeo/_tiled.py``, and the choice between them in ``refgeo/_backend.py``.  The
enclosing-ball solver of :func:`covering_radius` stays here: it is a small NumPy
iteration used by that one function, with no backend variants to dispatch between.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
from array_api_compat import array_namespace, is_cupy_array, is_dask_array, is_numpy_array

from . import _backend, _dask, _duplicates, _engine, _memory, _progress, _reference, _tiled
from ._certify import (
    U64,
    _quiet_overflow,
    canonical_sq,
    compensated_sums,
    dtype_name,
    f64,
    scale_exponent,
    scale_rows,
    scale_rows_inplace,
    unscale,
    unscale_array,
)
from ._interop import first_origin, from_foreign, to_caller
from ._validate import (
    as_float_array,
    check_bool,
    check_int,
    check_min_rows,
    check_real,
    check_same_trailing,
)

__all__ = [
    "EnclosingBall",
    "ExtremePair",
    "FarthestPartners",
    "KNNResult",
    "WorstCaseHiddenState",
    "backward_bound",
    "closest_pair",
    "covering_radius",
    "distance_ratio",
    "farthest_partners",
    "hilbert_rms",
    "jung_constant",
    "knn",
    "row_diameter",
    "worst_case_hidden_state",
]

# float64 elements of one block of hidden-state products in hilbert_rms.
_ROW_ELEMENTS = 1 << 20

# --------------------------------------------------------------------------- results


@dataclasses.dataclass(frozen=True, slots=True)
class ExtremePair:
    """A certified extreme pair of rows (diameter or closest pair).

    Attributes
    ----------
    value : float
        The distance :math:`\\lVert s_i - s_j \\rVert_2` of the pair, the square root of
        the refined float64 squared distance (module docstring).
    i, j : int
        The pair, ``i < j``; among equal values the lexicographically smallest.
    error_bound : float
        The a-priori bound on ``|filtered - refined|`` (squared distances of the rows
        ``S * 2**-scale_exponent`` the kernels saw) used to select the candidate pairs
        that were refined; ``0.0`` when every pair was evaluated directly (reference
        backend).  A closest pair whose float32 run exceeded its budget of refinements
        reports the bound of the float64 run that followed (see :func:`row_diameter`),
        so this can depend on ``n_threads`` and ``tile_size``; the value and the pair
        never do.  Where ``S`` has identical rows the kernel sees only the rows that
        decide the pair (:func:`row_diameter`), and this and ``n_refined`` describe that
        run.
    backend : str
        Backend whose code computed the result (``"reference"``, ``"cython"``,
        ``"cupy"``, ``"dask"``).
    dtype : str
        dtype of the input after conversion (``"float64"`` or ``"float32"``).
    n_refined : int
        Number of pairs evaluated by direct float64 differences.
    scale_exponent : int
        The kernels ran on ``S * 2**-scale_exponent`` (exact) and the distance was
        scaled back; 0 unless float64 rows lie outside ``[2**-64, 2**65)`` in magnitude.
    converted_from : str or None
        The dtype of a tensor that was upcast to ``dtype`` on the way in
        (``"torch.bfloat16"``, ``"torch.float16"``, a float8 dtype such as
        ``"torch.float8_e4m3fn"``); None when the input was used as is.
    """

    value: float
    i: int
    j: int
    error_bound: float
    backend: str
    dtype: str
    n_refined: int
    scale_exponent: int = 0
    converted_from: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class FarthestPartners:
    """Per-row farthest partner.

    Attributes
    ----------
    indices : ndarray or tensor of shape (V,)
        int64 (a torch tensor for tensor input); ``indices[i]`` is the ``j != i`` maximizing ``||s_i - s_j||`` (ties: the
        smallest ``j``).
    distances : ndarray or tensor of shape (V,)
        float64 refined distances ``||s_i - s_{indices[i]}||``.
    error_bound : float
        The rounding bound of the filter (squared distances of the rows
        ``S * 2**-scale_exponent``), as in :class:`ExtremePair`; ``0.0`` on the
        reference backend.  Where a float32 filter gave up for a float64 one
        (:func:`farthest_partners`), the float64 filter's, so this can depend on
        ``n_threads`` and ``tile_size``; the partners and distances never do.
    backend : str
        Backend whose code computed the result.
    dtype : str
        dtype of the input after conversion (``"float64"`` or ``"float32"``).
    n_refined : int
        Number of pairs evaluated by direct float64 differences.  Where the kernel ran
        on one row of each class of identical rows (:func:`farthest_partners`), this and
        ``error_bound`` describe that run (its size can choose another filter).
    scale_exponent : int
        The kernels ran on rows scaled by ``2**-scale_exponent``; see :class:`ExtremePair`.
    converted_from : str or None
        The dtype of a tensor upcast on the way in; see :class:`ExtremePair`.
    """

    indices: Any
    distances: Any
    error_bound: float
    backend: str
    dtype: str
    n_refined: int
    scale_exponent: int = 0
    converted_from: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class KNNResult:
    """k nearest neighbors of every query row.

    Attributes
    ----------
    indices : ndarray or tensor of shape (n, k)
        int64 indices (a torch tensor for tensor input) into the candidate rows, sorted by increasing distance; equal
        squared distances are ordered by the smaller index.
    distances : ndarray or tensor of shape (n, k)
        float64 refined distances, ascending along each row.
    error_bound : float
        The rounding bound of the filter (squared distances of the rows
        ``S * 2**-scale_exponent``), as in :class:`ExtremePair`; ``0.0`` on the
        reference backend.  Where rows that the float32 filter left uncertified
        went through a float64 filter (:func:`knn`), the largest bound used, so this can
        depend on ``n_threads`` and ``tile_size``; the neighbors and distances never do.
    backend : str
        Backend whose code computed the result.
    dtype : str
        dtype of the input after conversion (``"float64"`` or ``"float32"``).
    n_refined : int
        Number of pairs evaluated by direct float64 differences.  Where the kernel ran
        on one row of each class of identical rows (:func:`knn`), this and
        ``error_bound`` describe that run (its size can choose another filter).
    scale_exponent : int
        The kernels ran on rows scaled by ``2**-scale_exponent``; see :class:`ExtremePair`.
    converted_from : str or None
        The dtype of a tensor upcast on the way in; see :class:`ExtremePair`.
    """

    indices: Any
    distances: Any
    error_bound: float
    backend: str
    dtype: str
    n_refined: int
    scale_exponent: int = 0
    converted_from: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class EnclosingBall:
    """A (near-)minimum enclosing ball of the rows with a certificate.

    Attributes
    ----------
    radius : float
        ``max_i ||s_i - center||``: an upper bound on the covering radius, attained by
        ``center``.  It is evaluated on the centered rows; the returned ``center``
        (mean row plus the solver's center) is rounded to the size of the rows, so
        for a cloud far from the origin against its own size (rows 1e8 apart by 1, or
        near-duplicates of size 1) ``max_i ||s_i - center||`` recomputed from it can
        exceed ``radius`` by that rounding (up to about 1e-7 relative in those examples).
    center : ndarray or tensor of shape (d,)
        float64 center of the ball (a tensor for tensor input, as every array here).
    lower_bound : float
        Certified lower bound on the covering radius, from the dual weights:
        :math:`\\sum_i w_i \\lVert s_i - \\bar s_w \\rVert^2 \\le \\mathrm{rad}^2` with
        :math:`\\bar s_w = \\sum_i w_i s_i`.
    weights : ndarray or tensor of shape (V,)
        Dual weights (a probability vector; positive only on the support points).
    n_iter : int
        Iterations of the solver.
    """

    radius: float
    center: Any
    lower_bound: float
    weights: Any
    n_iter: int


@dataclasses.dataclass(frozen=True, slots=True)
class WorstCaseHiddenState:
    """The hidden state of norm ``H`` that moves the output distribution most.

    Attributes
    ----------
    value : float
        :math:`\\sup_{\\lVert h \\rVert \\le H} \\lVert S h \\rVert_{var} = H \\cdot D(S)`.
    h : ndarray or tensor of shape (d,)
        float64 (a tensor for a tensor ``S``)
        :math:`h^* = H (s_a - s_b) / \\lVert s_a - s_b \\rVert` for the diameter pair
        (the zero vector when ``D(S) = 0``: then every h attains 0).
    i, j : int
        The diameter pair ``(a, b)``.
    """

    value: float
    h: Any
    i: int
    j: int


# --------------------------------------------------------------------------- dispatch
#
# One registry entry per kernel: the reference (_reference.py, the oracle), the
# compiled engine (_engine.py) and the array-API engine for CuPy (_tiled.py).  The
# public functions validate, prescale the rows by a power of two (exact; see
# _certify.py), let _backend.run pick and run one kernel, scale the distances back and
# wrap the KernelRun in a result.

# Only the compiled engine reports progress between tiles; the reference, CuPy and
# Dask kernels take the reporter and report their run as one step when it ends.


def _whole_run(kernel):
    def run(*args, progress=None, **kwargs):
        if progress is None:
            return kernel(*args, **kwargs)
        start = progress.begin(1)
        out = kernel(*args, **kwargs)
        progress.update_to(start + 1)
        return out

    run.__name__ = run.__qualname__ = kernel.__name__
    run.__doc__ = kernel.__doc__
    return run


_DIAMETER = _backend.KernelInfo(
    name="row_diameter", reference=_whole_run(_reference.diameter), cython=_engine.diameter,
    cupy=_whole_run(_tiled.diameter), dask=_whole_run(_dask.diameter),
)


def _engine_is_compiled(X) -> bool:
    """Whether :func:`row_diameter` of ``X`` runs a compiled engine, not the NumPy
    reference (whose passes cost several times more: the solvers budget by it)."""
    try:
        return _backend.dispatch(_DIAMETER, X)[0] != "reference"
    except Exception:  # pragma: no cover - backend selection errors: use the reference
        return False


_CLOSEST = _backend.KernelInfo(
    name="closest_pair", reference=_whole_run(_reference.closest), cython=_engine.closest,
    cupy=_whole_run(_tiled.closest), dask=_whole_run(_dask.closest),
)
_FARTHEST = _backend.KernelInfo(
    name="farthest_partners", reference=_whole_run(_reference.farthest), cython=_engine.farthest,
    cupy=_whole_run(_tiled.farthest), dask=_whole_run(_dask.farthest),
)
_KNN = _backend.KernelInfo(
    name="knn", reference=_whole_run(_reference.knn), cython=_engine.knn, cupy=_whole_run(_tiled.knn),
    dask=_whole_run(_dask.knn),
)


def _readonly(a):
    if is_numpy_array(a):
        a.setflags(write=False)
    return a


def _check_rows(S, name="S", min_rows=2):
    S = as_float_array(S, name, ndim=2, shape_hint="2-D array of shape (V, d)")
    check_min_rows(S, name, min_rows)
    return S


def _tile_option(tile_size):
    return check_int(tile_size, "tile_size", min_value=1, allow_none=True)


def _threads_option(n_threads):
    return check_int(n_threads, "n_threads", min_value=1, allow_none=True)


def _pair_run(info, S, tile_size, n_threads, bar=None, e=None) -> tuple[_backend.KernelRun, int]:
    """The kernel run of ``info`` on ``S * 2**-e``, and ``e`` (by default the prescaling
    of ``S`` itself; a subset of rows gets that of the whole); ``bar`` None reports nothing."""
    xp = array_namespace(S)
    if e is None:
        e = scale_exponent(xp, [S])
    run = _backend.run(info, (S,), scale_rows(xp, S, e), tile_size=tile_size, n_threads=n_threads,
                       progress=bar if bar is not None and bar.active else None)
    return run, e


def _extreme_pair_run(info, S, tile_size, n_threads, bar, found=None) -> tuple[_backend.KernelRun, int, tuple[float, int, int]]:
    """:func:`_pair_run` of the diameter or closest-pair kernel on the rows that decide
    it, and ``(value, i, j)`` with the pair in the rows of ``S``.

    With identical rows in a NumPy or Dask ``S`` (:mod:`refgeo._duplicates`,
    :func:`refgeo._dask.duplicate_rows`) the diameter kernel runs on the first row of
    each class, and the closest-pair kernel on the smallest pair of identical rows (its
    distance is 0, the smallest there is); the kernel that computed the result is still
    the one reported.  CuPy rows, and rows with entries below 2**-400 of the largest
    (whose distinct pairs can tie with identical rows in float64:
    :func:`refgeo._duplicates.separated`), run as they are.  ``found``: what
    :func:`_duplicate_rows` returned, if the caller called it already.
    """
    rows = None
    dup, e = _duplicate_rows(S) if found is None else found
    if dup is not None:
        if info is _CLOSEST:
            rows = np.array(dup.pair)
        else:  # every row identical: the smallest pair, at distance 0
            rows = dup.first if dup.first.size >= 2 else np.array([0, 1])
    # the prescaling of all rows, so that scale_exponent describes S (the closest pair
    # of identical rows alone would get its own)
    if e is None and rows is not None:
        e = scale_exponent(array_namespace(S), [S])
    run, e = _pair_run(info, S if rows is None else _take_rows(S, rows), tile_size, n_threads, bar, e)
    value, i, j = _pair_of(run)
    if rows is not None:
        i, j = int(rows[i]), int(rows[j])
    return run, e, (value, i, j)


def _duplicate_rows(S) -> tuple[_duplicates.DuplicateRows | None, int | None]:
    """``(dup, e)``: the classes of identical rows of ``S`` where the extreme-pair
    kernels may run on fewer rows (NumPy and Dask rows that are
    :func:`refgeo._duplicates.separated`; else None), and the prescaling exponent of
    ``S`` where the search found it on the way (Dask rows; else None)."""
    if S.shape[0] <= 2:  # the pair itself
        return None, None
    if is_numpy_array(S):
        dup = _duplicates.duplicate_rows(S)
        return (dup if dup is not None and _duplicates.separated(S) else None), None
    if is_dask_array(S):
        return _dask.duplicate_rows(S)
    return None, None


def _take_rows(S, rows, *, as_many_blocks=False):
    """``S[rows]`` for increasing ``rows``; from a Dask array in row chunks of its largest
    size (a selection keeps the rows of each chunk apart, and many small chunks cost a
    task per block pair), or with ``as_many_blocks`` in as many row chunks as ``S`` has.

    Why the second: the pairwise tasks of the distinct rows then spread over the
    workers as those of the rows did.  The 4,096 distinct integer rows of R^6 of 30,000
    (k = 32) took 0.31 s in one chunk, 0.21 s in 6 chunks on two threads (before the
    k-NN tasks filtered a tied row again against the block, instead of refining it
    against every row of it: 4.8 s in one chunk)."""
    if not is_dask_array(S):
        return S[rows]
    T = _dask.take_rows(S, rows)
    if as_many_blocks:
        return T.rechunk({0: -(-len(rows) // S.numblocks[0])})
    return T.rechunk({0: max(S.chunks[0])}) if T.numblocks[0] > 1 else T


def _pair_of(run: _backend.KernelRun) -> tuple[float, int, int]:
    """``(value, i, j)`` of an extreme-pair kernel run (every such kernel fills them)."""
    if run.value is None or run.i is None or run.j is None:
        raise RuntimeError(f"internal error: the {run.backend} extreme-pair kernel returned no pair")
    return run.value, run.i, run.j


def _too_large(what: str, scaled: float, e: int) -> ValueError:
    return ValueError(
        f"{what} is {scaled!r} * 2**{e}, beyond the float64 range (largest finite "
        f"{np.finfo(np.float64).max:.4g}): the rows differ by more than a float64 can hold; "
        "scale S down first."
    )


def _engine_rows(S, name="S"):
    """Validated rows of an engine function, and where a foreign input came from.

    Tensors are viewed as NumPy (or CuPy) arrays first (:mod:`refgeo._interop`), so
    they run on the compiled engine like the arrays they share memory with.
    """
    S, origin = from_foreign(S, name)
    return _check_rows(S, name), origin


def _rounded_together(x) -> bool:
    """Whether ``x`` is NumPy data wider than float64 (an array, or a list of
    long-double numbers) whose rows differ there and not once read as float64.
    Converted again: only on an error path (a Dask array's chunks are computed)."""
    if not (isinstance(getattr(x, "dtype", None), np.dtype) or isinstance(x, (list, tuple))):
        return False
    try:
        w = np.asarray(x)
    except Exception:  # noqa: BLE001 - ragged input was refused before this
        return False
    return w.dtype.kind == "f" and w.dtype.itemsize > 8 and w.ndim == 2 and bool(np.any(w != w[:1]))


def _converted(*origins) -> str | None:
    return next((o.converted_from for o in origins if o is not None and o.converted_from), None)


def _array_out(a, origin):
    """An array result: in the caller's framework, or a read-only NumPy array."""
    return to_caller(a, origin) if origin is not None else _readonly(a)


def _extreme_pair_result(info, S, tile_size, n_threads, progress, what) -> ExtremePair:
    S, origin = _engine_rows(S)
    tile_size, n_threads = _tile_option(tile_size), _threads_option(n_threads)
    progress = _progress.check_progress(progress)
    with _progress.Progress(progress, None, desc=info.name, unit="tile") as bar:
        run, e, (scaled, i, j) = _extreme_pair_run(info, S, tile_size, n_threads, bar)
        bar.finish()
    value = unscale(scaled, e)
    if not math.isfinite(value):
        raise _too_large(what, scaled, e)
    return ExtremePair(
        value=float(value),
        i=int(i),
        j=int(j),
        error_bound=float(run.error_bound),
        backend=run.backend,
        dtype=dtype_name(S),
        n_refined=int(run.n_refined),
        scale_exponent=e,
        converted_from=_converted(origin),
    )


def _common_dtype_name(X, Y) -> str:
    return "float32" if dtype_name(X) == dtype_name(Y) == "float32" else "float64"


def _unscaled_distances(xp, run, e, what):
    dist = unscale_array(xp, run.distances, e)
    if not bool(xp.all(xp.isfinite(dist))):
        raise _too_large(what, float(xp.max(run.distances)), e)
    return dist


# --------------------------------------------------------------------------- public API


@_backend.dask_graphs_unfused
def row_diameter(
    S: Any, /, *, tile_size: int | None = None, n_threads: int | None = None, progress: Any = False
) -> ExtremePair:
    r"""Certified row diameter :math:`D(S) = \max_{i<j} \lVert s_i - s_j \rVert_2`.

    Parameters
    ----------
    S : array_like of shape (V, d)
        Finite rows, ``V >= 2``.  float32 and float64 are kept; integer and boolean
        inputs are converted to float64 (integers of magnitude above 2**53, which it
        would round, raise ``ValueError``), NumPy float16 and long double too (long
        double rounded once: see the module's "Input dtypes").  A torch tensor (CPU:
        viewed zero-copy, run on the compiled engine; CUDA: through CuPy) is accepted
        as well; bfloat16,
        float16 and float8 tensors are upcast to float32 (``converted_from`` says so),
        and integer and boolean tensors are a ``TypeError`` (convert them explicitly).
    tile_size : int, default=None
        Rows per tile of the compiled engine (None: 512 for a float32 filter, halved
        down to 256 until every thread has 32 tile pairs; 256 otherwise).  Never
        changes the value or the pair.
    n_threads : int, default=None
        Threads of the compiled engine (all OpenMP threads when None).  Never changes
        the value or the pair.
    progress : bool or callable, default=False
        Report progress (see :mod:`refgeo.rows`, "Progress"): True shows a tqdm bar, a
        callable receives ``{"done", "total", "elapsed", "eta"}``.  Never changes the
        result.

    Returns
    -------
    pair : ExtremePair
        ``value`` = D(S), the pair ``(i, j)`` (``i < j``; the lexicographically
        smallest among ties), the rounding bound used and the number of refined pairs.

    Notes
    -----
    .. math:: D(S) = \max_{i<j} \lVert s_i - s_j \rVert_2

    A seminorm: :math:`D(S + \mathbf{1}a^\top) = D(S)`, :math:`D(\alpha S) = |\alpha| D(S)`,
    :math:`D(SQ) = D(S)` for orthogonal Q, invariant to row permutations, and
    :math:`D(S) \le \sqrt{2}\lVert S \rVert_2`.  By the forward-size theorem,
    :math:`\sup_{\lVert h \rVert \le H} \lVert S h \rVert_{var} = H D(S)`.

    Time O(V^2 d); the compiled engine uses one BLAS GEMM per tile pair (extra memory
    O(b^2 p) for tile size b and p threads, never V x V); the reference evaluates every
    pair by direct differences in blocks of bounded memory.  Identical rows of a NumPy
    or Dask ``S`` are found first, in O(V d), and only the first row of each class goes to the
    kernel (two clusters of 15,000 identical rows took 3.5 s, every cross pair tied);
    the value and the pair are those of all rows.

    Certification (compiled engine).  Rows are centered, :math:`x_i = s_i - \mu`, and
    stored in the input dtype with unit roundoff u (:math:`2^{-53}` or :math:`2^{-24}`);
    the filter value is :math:`f_{ij} = n_i + n_j - 2\,\mathrm{fl}(x_i^\top x_j)` with
    float64 norms :math:`n_i`.  With :math:`\gamma_m = m u/(1 - m u)` and
    :math:`a_{ij} = n_i + n_j`, the a-priori bound

    .. math:: |f_{ij} - r_{ij}| \le c(d, u)\, a_{ij}, \quad
              c = 1.01\,[\gamma_d(u) + \gamma_d(u_{64}) + 4 u_{64} + 4.01 (u + u_{64})
              + 2.01\,\gamma_{d+2}(u_{64})]

    covers the GEMM (:math:`2\gamma_d \lvert x_i\rvert^\top\lvert x_j\rvert \le \gamma_d a_{ij}`,
    for any summation order, with or without FMA), the norms, the epilogue's float64
    operations, the rounding of the centered copy and the rounding of the refined value
    itself (:doc:`/theory/rows`, "Exact means certified"); the kernels add :math:`16 u_{64}` to
    c for the rounding of their own comparisons and an absolute
    :math:`32\, d\, \eta` (:math:`\eta` the smallest normal number of the dtype, so that
    the bound also holds when another library has switched on flush-to-zero) for
    underflow.  A pair is dropped only when its filtered value proves it cannot reach
    or tie an already certified value; every other pair is refined, so the result
    equals the reference's for every tile size and thread count.  The reported
    ``error_bound`` is :math:`c \cdot \max_{ij} a_{ij} + 32 d \eta`.  A float32 input
    whose squared norms would overflow the GEMM, or are so small (below
    :math:`2^{-70}`) that its products underflow and the absolute term would keep every
    pair, is filtered in float64.  Large float64
    inputs (:math:`V^2 d / 2 \ge 2^{26}`) are filtered through a float32 centered copy
    (float32 GEMM at about twice the float64 rate, the float32 bound) and refined from
    the float64 rows: the same certified value and pair in about half the time.  The
    closest pair's float32 filter (of float64 and of float32 rows) runs with a budget
    of :math:`\max(2^{16}, V^2 / (32 p))` refinements per thread (:math:`p` threads):
    near-duplicate clusters fill the wider float32 band with candidates, and past the
    budget the run stops and the float64 filter runs instead, on float64 copies of
    float32 rows (``error_bound`` describes that run, ``n_refined`` counts both).  For
    float64 rows this cuts the time by a third to a half while near-duplicates stay
    under the budget (0.66 of the float64 filter's time at 8,000 x 64, 0.45 at 20,000 x
    64); where a cluster holds about a quarter of the rows or more (within about
    :math:`10^{-3}` of each other relative to their norms, at d = 64) the call took up
    to about twice the float64 filter's time (measured: 1.84 with 40% of 8,000 rows).

    Exact means: equal to the refined float64 values of the rows as given, or, for
    float64 rows beyond ``[2**-64, 2**65)`` in magnitude, of the rows scaled by the
    power of two that brings the largest entry into ``[1/2, 1)``, scaled back (module
    docstring: exact in both directions, so rows of size 1e200 give their finite
    diameter).  A diameter above the largest float64 raises ``ValueError``.

    References
    ----------
    .. [1] LM-head update geometry, arXiv:2608.22253.

    Examples
    --------
    >>> import numpy as np, refgeo
    >>> S = np.array([[0.0, 0.0], [3.0, 4.0], [1.0, 1.0]])
    >>> r = refgeo.row_diameter(S)
    >>> r.value, r.i, r.j
    (5.0, 0, 1)
    """
    return _extreme_pair_result(_DIAMETER, S, tile_size, n_threads, progress, "the row diameter")


@_backend.dask_graphs_unfused
def closest_pair(
    S: Any, /, *, tile_size: int | None = None, n_threads: int | None = None, progress: Any = False
) -> ExtremePair:
    r"""Certified closest pair :math:`m(S) = \min_{i<j} \lVert s_i - s_j \rVert_2`.

    Parameters
    ----------
    S : array_like of shape (V, d)
        Finite rows, ``V >= 2`` (float32/float64 kept, integers converted to float64).
    tile_size : int, default=None
        Rows per tile of the compiled engine (default as in :func:`row_diameter`);
        never changes the result.
    n_threads : int, default=None
        Threads of the compiled engine; never changes the result.
    progress : bool or callable, default=False
        Report progress (see :mod:`refgeo.rows`, "Progress"): True shows a tqdm bar, a
        callable receives ``{"done", "total", "elapsed", "eta"}``.  Never changes the
        result.

    Returns
    -------
    pair : ExtremePair
        ``value`` = m(S) (0 for duplicate rows), the pair ``(i, j)``, ``i < j``, the
        lexicographically smallest among ties.

    Notes
    -----
    .. math:: m(S) = \min_{i<j} \lVert s_i - s_j \rVert_2

    Invariant under translation, orthogonal maps and row permutation; scales with
    :math:`|\alpha|`.  Time O(V^2 d).  Certified exactly as :func:`row_diameter`: the
    filter keeps every pair within the rounding bound of the running minimum, so near
    duplicates (relative distance 1e-12) are resolved by float64 direct differences;
    on pathological clusters many pairs are refined (slow, still exact).  On the
    compiled engine large float64 rows are filtered in float32, and every float32
    filter runs with a budget of refinements past which a float64 run follows (Notes
    of :func:`row_diameter`).  Identical
    rows of a NumPy or Dask ``S`` are found first, in O(V d), and the answer is then the
    smallest pair of them (every pair of identical rows ties, and refining them all
    took 4.9 s at 20,000 zero rows among 30,000); :func:`row_diameter` runs on the
    first row of each class of identical rows.  Same value and pair as on all rows.

    The refined value is the root of a float64 sum of squares, on rows prescaled by a
    power of two only where the squares would leave the float64 range: a pair closer
    than about 1e-154 times the largest entry has a subnormal or zero square, so its
    value loses digits, down to 0 for rows that differ (rows 1e-200 and 3e-200 beside
    a row at 1.0 give 0, and :func:`distance_ratio` 0); ``error_bound`` covers it.
    Rows on scales that far apart are better run apart.

    References
    ----------
    .. [1] LM-head update geometry, arXiv:2608.22253.

    Examples
    --------
    >>> import numpy as np, refgeo
    >>> r = refgeo.closest_pair(np.array([[0.0, 0.0], [3.0, 4.0], [3.0, 5.0]]))
    >>> r.value, r.i, r.j
    (1.0, 1, 2)
    """
    return _extreme_pair_result(_CLOSEST, S, tile_size, n_threads, progress, "the closest-pair distance")


@_backend.dask_graphs_unfused
def distance_ratio(
    S: Any, /, *, tile_size: int | None = None, n_threads: int | None = None, progress: Any = False
) -> float:
    r"""Distance ratio :math:`\rho(S) = m(S) / D(S) \in [0, 1]`.

    Parameters
    ----------
    S : array_like of shape (V, d)
        Finite rows with at least two distinct rows.
    tile_size, n_threads : int, default=None
        Passed to :func:`closest_pair` and :func:`row_diameter`.
    progress : bool or callable, default=False
        As in :func:`row_diameter`; one total for both kernels.

    Returns
    -------
    rho : float
        The certified closest distance over the certified diameter, both of the rows
        scaled by the same power of two (see the module's "The whole float range"):
        ``closest_pair(S).value / row_diameter(S).value`` wherever both are normal
        floats, and finite also where the diameter itself exceeds the float64 range
        (which :func:`row_diameter` refuses) or the closest distance is subnormal
        (which :func:`closest_pair` rounds).

    Raises
    ------
    ValueError
        When all rows coincide (``D(S) = 0``: the ratio is undefined), or when distinct
        rows are closer than the engine resolves (every squared distance below the
        float64 range once scaled: about ``2**-537`` times the largest entry).

    Notes
    -----
    .. math:: \rho(S) = \frac{\min_{i<j} \lVert s_i - s_j \rVert}{\max_{i<j} \lVert s_i - s_j \rVert}

    Its inverse is the condition number of the row cloud.  Invariant under
    translation, scaling, orthogonal maps and permutations.  Time O(V^2 d).  The
    regular simplex attains 1.  A closest distance below about 1e-154 times the
    largest entry can count as 0 (:func:`closest_pair`, Notes).

    References
    ----------
    .. [1] LM-head update geometry, arXiv:2608.22253.

    Examples
    --------
    >>> import numpy as np, refgeo
    >>> refgeo.distance_ratio(np.array([[0.0], [1.0], [3.0]]))
    0.3333333333333333
    """
    S_in = S
    S, _ = _engine_rows(S)
    tile_size = _tile_option(tile_size)
    n_threads = _threads_option(n_threads)
    progress = _progress.check_progress(progress)
    # both on the same prescaled rows: the ratio needs no scaling back, so it is
    # finite even where D(S) itself exceeds the float64 range; two kernel runs of the
    # same tiles, announced as one total
    with _progress.Progress(progress, None, desc="distance_ratio", unit="tile", runs=2) as bar:
        found = _duplicate_rows(S)  # once for both runs (a pass over the chunks of a Dask S)
        D = _extreme_pair_run(_DIAMETER, S, tile_size, n_threads, bar, found)[2][0]
        if D == 0.0:
            if bool((S != S[:1]).any()):
                # distinct rows whose distances the engine cannot resolve (see "The whole
                # float range"): they were reported as all equal
                raise ValueError(
                    "S must have distinct rows at distances float64 resolves for the distance ratio, got "
                    "distinct rows closer than about 2**-537 times the largest entry instead (every squared "
                    "distance underflows to 0, e.g. rows of a common offset of 1e200 and a spread of 1); "
                    "subtract the common offset first."
                )
            raise ValueError(
                "S must have at least two distinct rows for the distance ratio, got all rows equal instead"
                + (" (after rounding long double to float64)." if _rounded_together(S_in) else ".")
            )
        m = _extreme_pair_run(_CLOSEST, S, tile_size, n_threads, bar, found)[2][0]
        bar.finish()
    return m / D


@_backend.dask_graphs_unfused
def farthest_partners(
    S: Any, /, *, tile_size: int | None = None, n_threads: int | None = None, progress: Any = False
) -> FarthestPartners:
    r"""For every row, the farthest other row.

    Parameters
    ----------
    S : array_like of shape (V, d)
        Finite rows, ``V >= 2``.
    tile_size, n_threads : int, default=None
        Engine options; never change the result.
    progress : bool or callable, default=False
        Report progress (see :mod:`refgeo.rows`, "Progress"): True shows a tqdm bar, a
        callable receives ``{"done", "total", "elapsed", "eta"}``.  Never changes the
        result.

    Returns
    -------
    fp : FarthestPartners
        ``indices`` (int64, shape (V,)): :math:`\arg\max_{j \ne i} \lVert s_i - s_j \rVert`
        with ties to the smallest ``j``; ``distances`` (float64, shape (V,)); torch
        tensors for a tensor ``S``.  Also the backend that ran, the rounding bound and
        the number of refined pairs.

    Notes
    -----
    .. math:: \phi(i) = \arg\max_{j \ne i} \lVert s_i - s_j \rVert_2

    The maximum of ``distances`` is :math:`D(S)`.  The Frank-Wolfe vertex of the
    min-tension LMO (see :doc:`/theory/lmo`) is a farthest pair.  Time O(V^2 d); distances are refined
    float64 values, certified as in :func:`row_diameter` (large float64 inputs are
    filtered in float32 there too; a float32 filter gives up for a float64 one where
    many rows' farthest partners lie in a cluster of near-copies it cannot tell apart,
    not for exact ties, which any filter must refine: ``n_refined`` then counts both
    runs, and ``error_bound`` is the float64 filter's, :class:`FarthestPartners`).
    Where an eighth of the NumPy or Dask rows or more (and at least 32) are copies of
    others, the kernel runs on one row of each class (a row's partner is the first row
    of the farthest class).

    References
    ----------
    .. [1] LM-head update geometry, arXiv:2608.22253.

    Examples
    --------
    >>> import numpy as np, refgeo
    >>> fp = refgeo.farthest_partners(np.array([[0.0], [1.0], [3.0]]))
    >>> fp.indices.tolist(), fp.distances.tolist()
    ([2, 2, 0], [3.0, 2.0, 3.0])
    """
    S, origin = _engine_rows(S)
    tile_size, n_threads = _tile_option(tile_size), _threads_option(n_threads)
    progress = _progress.check_progress(progress)
    # identical rows: the kernel on one row of each class (a row's farthest partner is
    # the first row of the farthest class, and never of its own: the rows are
    # separated); 8,000 zero rows among 16,000 took 0.26 s, against 0.07 s alone
    found, e = _duplicate_rows(S)  # e: the prescaling, where the search found it (Dask rows)
    dup = _copies_worth_removing(found)
    with _progress.Progress(progress, None, desc="farthest_partners", unit="tile") as bar:
        if dup is None:
            run, e = _pair_run(_FARTHEST, S, tile_size, n_threads, bar, e)
        else:
            # one class: rows 0 and 1, each the other's partner (every other row's is 0)
            first = dup.first if dup.first.size >= 2 else np.array([0, 1])
            run, e = _pair_run(_FARTHEST, _take_rows(S, first), tile_size, n_threads, bar,
                               scale_exponent(array_namespace(S), [S]) if e is None else e)
            label = dup.label if dup.first.size >= 2 else np.minimum(np.arange(S.shape[0]), 1)
            run = dataclasses.replace(run, indices=first[np.asarray(run.indices)][label],
                                      distances=np.asarray(run.distances)[label])
        bar.finish()
    dist = _unscaled_distances(array_namespace(S), run, e, "the largest farthest-partner distance")
    return FarthestPartners(
        indices=_array_out(run.indices, origin),
        distances=_array_out(dist, origin),
        error_bound=float(run.error_bound),
        backend=run.backend,
        dtype=dtype_name(S),
        n_refined=int(run.n_refined),
        scale_exponent=e,
        converted_from=_converted(origin),
    )


def _one_namespace(X, Y, names=("X", "Y")):
    """``(X, Y)`` in one array namespace: a NumPy array next to a Dask one becomes a
    Dask array of one row chunk per 8192 rows (the other kinds cannot meet: a
    ``TypeError`` naming both)."""
    if is_dask_array(X) != is_dask_array(Y) and (is_numpy_array(X) or is_numpy_array(Y)):
        import dask.array as da

        return tuple(A if is_dask_array(A) else da.from_array(A, chunks=(8192,) + (-1,) * (A.ndim - 1))
                     for A in (X, Y))
    try:
        array_namespace(X, Y)
    except TypeError:
        raise TypeError(
            f"{names[0]} and {names[1]} must be arrays of one kind, got {type(X).__module__}.{type(X).__name__} "
            f"and {type(Y).__module__}.{type(Y).__name__} instead; move one to the other's library first."
        ) from None
    return X, Y


@_backend.dask_graphs_unfused
def knn(
    X: Any,
    k: int,
    Y: Any = None,
    /,
    *,
    exclude_self: bool = True,
    tile_size: int | None = None,
    n_threads: int | None = None,
    progress: Any = False,
) -> KNNResult:
    r"""Exact k nearest neighbors (Euclidean) of every row of ``X`` among the rows of ``Y``.

    Parameters
    ----------
    X : array_like of shape (n, d)
        Query rows (finite; float32/float64 kept, integers converted to float64).
    k : int
        Number of neighbors, ``1 <= k <= number of candidates`` (``n_Y``, or ``n - 1``
        when ``Y`` is None and ``exclude_self``).
    Y : array_like of shape (n_Y, d), default=None
        Candidate rows; None means ``X`` itself.
    exclude_self : bool, default=True
        When ``Y`` is None, row ``i`` is not its own neighbor (leave-one-out; exact
        duplicates of row ``i`` still are).  Ignored when ``Y`` is given.
    tile_size, n_threads : int, default=None
        Engine options; never change the result.
    progress : bool or callable, default=False
        Report progress (see :mod:`refgeo.rows`, "Progress"): True shows a tqdm bar, a
        callable receives ``{"done", "total", "elapsed", "eta"}``.  Never changes the
        result.

    Returns
    -------
    result : KNNResult
        ``indices`` (int64, shape (n, k)) and ``distances`` (float64, shape (n, k)),
        ascending; equal squared distances are ordered by the smaller index; torch
        tensors when ``X`` or ``Y`` is one.  Also the backend that ran, the rounding
        bound and the number of refined pairs.

    Notes
    -----
    .. math:: N_k(i) = \operatorname{arg\,min}^{(k)}_{j} \lVert x_i - y_j \rVert_2

    Time O(n n_Y d) (half of it for X against X: each pair's GEMM entry serves both
    rows), extra memory O(n K p + b^2 p) in the compiled engine for K = k + max(8, k/2)
    heap entries per row and thread.  Per-row heaps of filtered values are kept in
    the GEMM epilogue; a row is certified when every pair left out of its heap has a
    filtered value beyond the rounding bound (see :func:`row_diameter`) of its k-th
    upper bound, and then every kept pair within that bound is refined in float64.
    A row whose heap holds fewer than its ties (rows with many ties at their k-th
    distance, as sign rows and clusters of near-copies have) is filtered again against
    the candidates that can be within reach of it (all of them, or for rows grouped
    around an anchor the rows near the anchor, by the triangle inequality), in the
    epilogue of a second GEMM of those rows, and only the pairs
    whose certified lower end can reach its k-th upper bound are refined (a row with
    more than ``max(k, N / 16)`` of them in float32: through a float64 filter; more
    than ``max(k, N / 4)`` in float64: against every candidate).  So the
    answer is the exact one even where a float32 Gram-trick answer is wrong.  Large float64 inputs are
    filtered in float32 (half the GEMM time; the float32 bound is used) and the rows
    it cannot certify are redone with a float64 filter.  Invariant under a common
    translation, orthogonal maps and scaling of ``X`` and ``Y``.

    Identical NumPy or Dask rows (untrained or padding rows of a head, the hidden
    states of one token at an embedding layer) would tie at the k-th distance beyond
    any heap; where they are many enough to pay for it (an eighth of the rows, or
    classes larger than a heap's slack), the kernel runs on one row of each class
    instead, and its answer is expanded to every row, copies by index (a copy of the
    distinct rows in memory; against ``Y`` a side is searched for copies where the
    other has at least 4,096 rows).  With 40% of 4,000 rows identical this is 10 times
    faster for k = 16 (asv: ``extreme_pairs.IdenticalRows.track_knn_speedup_vs_all_rows``).

    References
    ----------
    .. [1] Tokenwise decomposition of layer updates, arXiv:2604.02459.

    Examples
    --------
    >>> import numpy as np, refgeo
    >>> r = refgeo.knn(np.array([[0.0], [1.0], [3.0]]), 1)
    >>> r.indices.tolist(), r.distances.tolist()
    ([[1], [0], [1]], [[1.0], [1.0], [2.0]])
    """
    X, origin_x = from_foreign(X, "X")
    Y, origin_y = from_foreign(Y, "Y")
    origin = origin_x if origin_x is not None else origin_y
    X = as_float_array(X, "X", ndim=2, shape_hint="2-D array of shape (n, d)")
    if Y is not None:
        Y = as_float_array(Y, "Y", ndim=2, shape_hint="2-D array of shape (n_Y, d)")
        check_same_trailing(X, Y, ("X", "Y"))
        X, Y = _one_namespace(X, Y)
    if is_dask_array(X):  # long double chunks checked and converted under their own names
        X, Y = _dask._engine_rows(X, "X"), _dask._engine_rows(Y, "Y")
    exclude_self = check_bool(exclude_self, "exclude_self")
    n_cand = (X.shape[0] - int(exclude_self)) if Y is None else Y.shape[0]
    if n_cand < 1:
        raise ValueError(
            f"X must have at least 2 rows for k-NN with exclude_self=True, got shape {tuple(X.shape)} instead."
        )
    k = check_int(k, "k", min_value=1, max_value=n_cand)
    tile_size = _tile_option(tile_size)
    n_threads = _threads_option(n_threads)
    progress = _progress.check_progress(progress)
    n_rows = X.shape[0]
    # the (n, k) results exist on every backend: no work starts if they cannot fit
    # (the compiled engine checks its heaps as well)
    _memory.check_memory(
        f"knn of {n_rows} rows (k={k})", {f"indices and distances ({n_rows}, {k})": 16.0 * n_rows * k},
        "Pass a smaller k, or query the rows of X in chunks (knn(X[a:b], k, Y) for Y the candidate rows).",
    )
    xp = array_namespace(X) if Y is None else array_namespace(X, Y)
    # X's identical rows; the search over Dask rows finds the prescaling on its way
    # (another pass over every chunk, from disk for a file, when computed here too)
    found = _duplicate_rows(X) if Y is None else (None, None)
    e = found[1] if found[1] is not None else scale_exponent(xp, [X] if Y is None else [X, Y])
    with _progress.Progress(progress, None, desc="knn", unit="tile") as bar:
        options = dict(tile_size=tile_size, n_threads=n_threads, progress=bar if bar.active else None)
        run = _knn_of_distinct_rows(X, Y, k, exclude_self, e, options, found)
        if run is None:
            run = _backend.run(_KNN, (X, Y), scale_rows(xp, X, e), k, None if Y is None else scale_rows(xp, Y, e),
                               exclude_self=exclude_self, **options)
        bar.finish()
    dist = _unscaled_distances(xp, run, e, "the largest k-NN distance")
    return KNNResult(
        indices=_array_out(run.indices, origin),
        distances=_array_out(dist, origin),
        error_bound=float(run.error_bound),
        backend=run.backend,
        dtype=dtype_name(X) if Y is None else _common_dtype_name(X, Y),
        n_refined=int(run.n_refined),
        scale_exponent=e,
        converted_from=_converted(origin_x, origin_y),
    )


# Rows per block of the expansion of a k-NN answer to every row, times k + 1: its
# temporaries stay in cache (a module constant so that tests can make blocks small)
_EXPAND_BLOCK = 1 << 16

# Against Y, the rows of one side are searched for copies only where the other side
# has at least this many: the search (a hash of every row) of 200,000 x 64 float32
# candidates takes 0.06 s, and the k-NN of 256, 1,024 and 4,096 queries against them
# 0.075, 0.19 and 0.67 s (the search added 79%, 31% and 9%); copies among a few
# queries' candidates cost those queries a redo against every candidate at most.
KNN_COPIES_MIN_OTHER = 4096


def _row_fetcher(A, dup, e):
    """``fetch(idx)``: float64 NumPy rows ``idx`` of the kernel's rows (one per class of
    ``dup``, all rows when None), prescaled by ``2**-e``; a Dask ``A`` computes only the
    distinct rows asked for."""
    def fetch(idx):
        uniq, inv = np.unique(idx, return_inverse=True)
        at = uniq if dup is None else dup.first[uniq]
        rows = _take_rows(A, at).compute() if is_dask_array(A) else A[at]
        return scale_rows(np, np.asarray(rows, dtype=np.float64), e)[inv.ravel()]
    return fetch


def _copies_worth_removing(dup, k=None, d=1) -> _duplicates.DuplicateRows | None:
    """``dup`` where running on the distinct rows pays (else None).

    Two gains, against the cost of writing ``k`` expanded rows per query (tens of ns
    each, and a sort where classes tie):

    - the kernel's work on the copies: worth it where an eighth of the rows or more
      are copies, and at least ``32 k`` of them (4,000 classes of 2 rows of R^16 at
      k = 256 saved nothing and the expansion doubled the time);
    - for candidates of a k-NN search (``k`` given), ties beyond the heap: a class of
      more rows than the heap's slack (``max(8, k/2)`` entries beyond ``k``) at a
      query's k-th distance sends the query to a redo against every candidate (a
      filter, then the pairs within reach of its bound), which costs about what the
      query cost (O(n d)); worth it where such classes hold a
      64th of the rows and ``128 k / d`` rows or more (one class of 71 among 5,000 sign
      rows of R^16 at k = 64 cost 0.35 s as it was, 0.59 s expanded; 8 classes of 33
      among 16,000 rows of R^16 at k = 64, 0.50 s against 0.57 s).
    """
    if dup is None:
        return None
    n = dup.label.size
    copies = n - dup.first.size
    if copies >= max(n / 8, 32 * (k or 1)):
        return dup
    if k is not None:
        sizes = np.bincount(dup.label)
        if sizes[sizes > max(8, k // 2)].sum() >= max(n / 64, 128 * k / max(d, 1)):
            return dup
    return None


def _knn_of_distinct_rows(X, Y, k, exclude_self, e, options, found) -> _backend.KernelRun | None:
    """The k-NN kernel run on one row of each class of identical rows, its answer
    expanded to all rows (:func:`refgeo._duplicates.expand_neighbors`); None where the
    copies do not pay for it (:func:`_copies_worth_removing`), where no class has two
    rows, and for rows that are neither NumPy nor Dask rows, or not separated.

    Why: a query's k-th distance ties with every copy of a row there, and a heap of
    ``k + max(8, k/2)`` entries cannot certify such a tie: the rows are filtered
    again against every candidate (and, past ``N / 16`` ties in a float32 filter,
    through a float64 filter, past ``N / 4`` in a float64 one, against every
    candidate).  8,000 copies of one row among 16,000
    took 3 s against 0.05 s for the other 8,000 rows, and the hidden states of a
    model's embedding layer repeat one row per occurrence of a token.

    Identical rows have bitwise equal refined distances to every row, so a query
    class's answer is every query's answer; with ``Y`` None a row's own class comes
    first (distance 0, every other class is farther: the rows are separated), and
    ``exclude_self`` drops the row itself from its class's ``k + 1`` nearest rows.
    ``n_refined`` and ``error_bound`` are those of the run on the distinct rows.
    ``found``: what :func:`_duplicate_rows` returned for ``X`` (read with ``Y`` None).
    """
    k_out = k + int(Y is None and exclude_self)  # with the row itself, dropped below
    if Y is None:
        dup_x = dup_y = _copies_worth_removing(found[0], k_out, X.shape[1])
    else:  # each side searched only where the other is large enough to pay for it
        dup_x = _copies_worth_removing(_duplicate_rows(X)[0]) \
            if Y.shape[0] >= KNN_COPIES_MIN_OTHER else None
        dup_y = _copies_worth_removing(_duplicate_rows(Y)[0], k_out, Y.shape[1]) \
            if X.shape[0] >= KNN_COPIES_MIN_OTHER else None
    if dup_x is None and dup_y is None:
        return None
    xp = array_namespace(X)
    n_x = X.shape[0]
    label_x = np.arange(n_x) if dup_x is None else dup_x.label
    # the query rows that run
    U = scale_rows(xp, X if dup_x is None else _take_rows(X, dup_x.first, as_many_blocks=True), e)
    if Y is None:
        n_u = U.shape[0]
        if n_u == 1:  # one class: its row against itself, at distance 0
            run = _backend.run(_KNN, (X, None), U, 1, U, exclude_self=False, **options)
            nbr, dist = run.indices, run.distances
        else:
            run = _backend.run(_KNN, (X, None), U, min(max(k_out - 1, 1), n_u - 1), None,
                               exclude_self=True, **options)
            nbr = np.hstack([np.arange(n_u)[:, None], run.indices])
            dist = np.hstack([np.zeros((n_u, 1)), run.distances])
        label_y = label_x
    else:
        UY = scale_rows(xp, Y if dup_y is None else _take_rows(Y, dup_y.first, as_many_blocks=True), e)
        label_y = np.arange(Y.shape[0]) if dup_y is None else dup_y.label
        run = _backend.run(_KNN, (X, Y), U, min(k, UY.shape[0]), UY, exclude_self=False, **options)
        nbr, dist = run.indices, run.distances

    fetch_x = _row_fetcher(X, dup_x, e)
    fetch_y = fetch_x if Y is None else _row_fetcher(Y, dup_y, e)

    def sq_distances(queries, classes):  # the refined values, for classes at one distance
        uq, iq = np.unique(queries, return_inverse=True)
        uc, ic = np.unique(classes, return_inverse=True)
        Q, B = fetch_x(uq), fetch_y(uc)  # each distinct row once
        out = np.empty(queries.size)
        step = max(1, (1 << 18) // max(Q.shape[1], 1))  # temporaries of a few MiB
        for a in range(0, queries.size, step):
            out[a : a + step] = canonical_sq(np, Q[iq[a : a + step]], B[ic[a : a + step]])
        return out

    idx_c, d_c = _duplicates.expand_neighbors(nbr, dist, label_y, k_out, sq_distances)
    # every query row gets its class's rows, in blocks of rows (temporaries that stay in
    # cache: whole-size gathers and masks cost 0.6 s of 2.5 at 16,000 rows and k = 256)
    idx, d = np.empty((n_x, k), dtype=np.int64), np.empty((n_x, k))
    step = max(1, _EXPAND_BLOCK // k_out)
    for a in range(0, n_x, step):
        E, Dd = idx_c[label_x[a : a + step]], d_c[label_x[a : a + step]]
        if Y is None and exclude_self:  # drop the row itself where it is among the k + 1
            keep = E != np.arange(a, a + E.shape[0])[:, None]
            keep[keep.all(axis=1), k] = False
            E, Dd = E[keep].reshape(-1, k), Dd[keep].reshape(-1, k)
        idx[a : a + step], d[a : a + step] = E, Dd
    return dataclasses.replace(run, indices=idx, distances=d)


# --------------------------------------------------------------------------- covering radius


def _to_numpy(x):
    """A NumPy view/copy of an array-API array (DLPack; CuPy goes through the host)."""
    if is_numpy_array(x):
        return x
    if is_dask_array(x):  # the solver's many passes run on one in-memory copy
        return np.asarray(x.compute())
    if is_cupy_array(x):
        return x.get()
    return np.from_dlpack(x)


def _sq_dists_to(X, c):
    """``||x_i - c||^2`` for every row, in blocks of about 1 MiB: the temporaries of
    ``np.sum((X - c) ** 2, axis=1)`` were two more arrays of the size of X (a 200,000 x
    64 float32 file took 314 MB in covering_radius for 51 MB of rows).  Each row's sum
    is the same as over the whole array."""
    V, d = X.shape
    r2 = np.empty(V)
    step = max(1, (1 << 17) // max(d, 1))
    for a in range(0, V, step):
        D = X[a : a + step] - c
        np.sum(D * D, axis=1, out=r2[a : a + step])
    return r2


def _meb_eval(X, lam):
    """Center, squared distances to it and the dual value for weights ``lam``."""
    c = lam @ X
    r2 = _sq_dists_to(X, c)
    return c, r2, float(lam @ r2)


def covering_radius(S: Any, /, *, tol: float = 1e-10, max_iter: int = 100_000) -> EnclosingBall:
    r"""Minimum enclosing ball of the rows, with a certified lower bound.

    Parameters
    ----------
    S : array_like of shape (V, d)
        Finite rows, ``V >= 1``; a torch tensor too (``center`` and ``weights`` then
        come back as tensors on its device).
    tol : float, default=1e-10
        Relative gap at which to stop: ``radius - lower_bound <= tol * radius``.
    max_iter : int, default=100000
        Iteration cap of the Frank-Wolfe solver (the certificate holds at any stop).

    Returns
    -------
    ball : EnclosingBall
        ``radius`` (upper bound, attained by ``center``), ``lower_bound`` (certified by
        the dual ``weights``), ``center``, ``weights`` and ``n_iter``.

    Notes
    -----
    .. math:: \mathrm{rad}(S) = \min_c \max_i \lVert s_i - c \rVert_2
              = \max_{w \in \Delta} \Big(\sum_i w_i \lVert s_i - \bar s_w \rVert^2\Big)^{1/2}

    Solved on the dual by Frank-Wolfe with away steps on the simplex (Yildirim) in
    float64 on centered rows, polished every 50 iterations by solving for the
    circumcenter of the support set in its affine hull (accepted only when its
    barycentric weights are non-negative and no point lies outside).  Any weights give
    the lower bound and any center the upper bound, so ``lower_bound <= rad(S) <=
    radius`` whenever the solver stops (up to the float64 rounding of the two
    evaluations).  Bounds: :math:`D/2 \le \mathrm{rad} \le J_k D`
    (:func:`jung_constant`, k the rank of the centered rows), the regular simplex
    attaining the upper end.  Time O(V d) per iteration, extra memory O(V d) (a
    float64 copy).  Invariant under translation (the center moves along), orthogonal
    maps and permutations; scales with :math:`|\alpha|`.  Computed with NumPy for
    every input namespace (a Dask array is computed into that one copy: the solver
    passes over the rows many times); the center and weights are returned in the
    input's.  float64
    rows beyond ``[2**-64, 2**65)`` in magnitude are solved scaled by a power of two
    (exact), as in :func:`row_diameter`.

    References
    ----------
    .. [1] LM-head update geometry, arXiv:2608.22253.
    .. [2] E. A. Yildirim, Two algorithms for the minimum enclosing ball problem,
       SIAM J. Optim. 19 (2008).

    Examples
    --------
    >>> import numpy as np, refgeo
    >>> ball = refgeo.covering_radius(np.array([[0.0, 0.0], [2.0, 0.0], [1.0, 0.5]]))
    >>> ball.radius, ball.center.tolist()
    (1.0, [1.0, 0.0])
    """
    S, origin = from_foreign(S, "S")
    S = _check_rows(S, min_rows=1)
    tol = check_real(tol, "tol", min_value=0.0)
    max_iter = check_int(max_iter, "max_iter", min_value=0)
    xp = array_namespace(S)
    # one float64 copy of the rows, scaled and centered in place (a copy and the centered
    # rows were two)
    X = np.array(_to_numpy(S), dtype=np.float64)
    e = scale_exponent(np, [X])
    scale_rows_inplace(X, e)
    V = X.shape[0]
    mu = X.mean(axis=0)
    # a column of one value is centered to exactly 0 about that value: its mean is off
    # by an ulp of it, a shift common to every row that the center's rounding then
    # multiplied back in (a constant column of 0.1 beside a spread of 5e-40 put the
    # "certified" lower bound at 3e-33, 1e7 times the radius)
    const = np.all(X == X[:1], axis=0)
    mu[const] = X[0, const]
    X -= mu
    # start: the point a farthest from the mean and the point b farthest from a
    a = int(np.argmax(_sq_dists_to(X, np.zeros(X.shape[1]))))
    b = int(np.argmax(_sq_dists_to(X, X[a])))
    lam = np.zeros(V)
    lam[a] += 0.5
    lam[b] += 0.5
    c, r2, phi = _meb_eval(X, lam)
    n_iter = 0
    while n_iter < max_iter:
        far = int(np.argmax(r2))
        R2 = float(r2[far])
        if R2 == 0.0 or math.sqrt(R2) - math.sqrt(max(phi, 0.0)) <= tol * math.sqrt(R2):
            break
        n_iter += 1
        if n_iter % 50 == 0:
            pol = _meb_polish(X, lam)
            if pol is not None:
                lam = pol
                c, r2, phi = _meb_eval(X, lam)
                continue
        # Frank-Wolfe step toward `far`, or away step from the support point `near`,
        # with exact line search on the concave dual phi(w) = sum w_i |x_i|^2 - |X^T w|^2.
        near = int(np.argmin(np.where(lam > 0, r2, np.inf)))
        gap_fw = R2 - phi
        gap_aw = phi - float(r2[near])
        if gap_fw >= gap_aw:
            u = X[far] - c
            uu = float(u @ u)
            t = 1.0 if uu == 0.0 else min(1.0, gap_fw / (2.0 * uu))
            lam *= 1.0 - t
            lam[far] += t
        else:
            u = c - X[near]
            uu = float(u @ u)
            t_max = lam[near] / (1.0 - lam[near]) if lam[near] < 1.0 else 0.0
            t = t_max if uu == 0.0 else min(t_max, gap_aw / (2.0 * uu))
            lam *= 1.0 + t
            lam[near] -= t
            if t == t_max:
                lam[near] = 0.0
        lam = np.maximum(lam, 0.0)
        lam /= lam.sum()
        c, r2, phi = _meb_eval(X, lam)
    pol = _meb_polish(X, lam)
    if pol is not None:
        lam = pol
        c, r2, phi = _meb_eval(X, lam)
    R = math.sqrt(float(r2.max()))
    # phi and R^2 are the same quantity at the optimum, evaluated two ways: phi can
    # exceed R^2 there only by the rounding of the two evaluations, and R is then the
    # better-founded value of both bounds
    lower = min(math.sqrt(max(phi, 0.0)), R)
    radius = unscale(R, e)
    if not math.isfinite(radius):
        raise _too_large("the covering radius", R, e)
    center = unscale_array(np, c + mu, e)
    if not is_numpy_array(S):
        center = xp.asarray(center, dtype=xp.float64)
        lam = xp.asarray(lam, dtype=xp.float64)
    return EnclosingBall(
        radius=radius, center=_array_out(center, origin), lower_bound=unscale(lower, e),
        weights=_array_out(lam, origin),
        n_iter=n_iter,
    )


def _meb_polish(X, lam):
    """Weights of the circumcenter of the support set, if valid; otherwise None."""
    supp = np.flatnonzero(lam > 1e-14 * lam.max())
    P = X[supp]
    m = supp.size
    # center c = P^T w with 1^T w = 1 and |p_t - c|^2 equal for all t:
    # 2 G w + z 1 = diag(G), 1^T w = 1, with G = P P^T and z a free offset.
    G = P @ P.T
    A = np.zeros((m + 1, m + 1))
    A[:m, :m] = 2.0 * G
    A[:m, m] = 1.0
    A[m, :m] = 1.0
    rhs = np.concatenate([np.diag(G), [1.0]])
    sol = np.linalg.lstsq(A, rhs, rcond=None)[0]
    w = sol[:m]
    if not np.all(np.isfinite(w)) or np.any(w < -1e-12) or w.sum() <= 0:
        return None
    w = np.maximum(w, 0.0)
    w /= w.sum()
    lam2 = np.zeros_like(lam)
    lam2[supp] = w
    c, r2, phi = _meb_eval(X, lam2)
    if float(r2.max()) > phi * (1.0 + 1e-12):
        return None  # a point lies outside: the support set is not final
    return lam2


# --------------------------------------------------------------------------- small identities


def jung_constant(k: int, /) -> float:
    r"""Jung's constant :math:`J_k = \sqrt{k / (2(k+1))}`.

    Parameters
    ----------
    k : int
        Dimension (rank of the centered rows), ``k >= 0``.

    Returns
    -------
    J : float
        The smallest J with :math:`\mathrm{rad}(S) \le J\, D(S)` for every S of rank k.

    Notes
    -----
    .. math:: J_k = \sqrt{\frac{k}{2(k+1)}}

    Increases from 0 (k = 0) to :math:`1/\sqrt{2}`; attained by the regular simplex.
    O(1).

    References
    ----------
    .. [1] LM-head update geometry, arXiv:2608.22253.

    Examples
    --------
    >>> import refgeo
    >>> refgeo.jung_constant(1), refgeo.jung_constant(3)
    (0.5, 0.6123724356957945)
    """
    k = check_int(k, "k", min_value=0)
    # integer true division: correctly rounded for every k, also beyond the float range
    return math.sqrt(k / (2 * (k + 1)))


def worst_case_hidden_state(S: Any, /, *, H: float = 1.0) -> WorstCaseHiddenState:
    r"""The hidden state of norm H that maximizes :math:`\lVert S h \rVert_{var}`.

    Parameters
    ----------
    S : array_like of shape (V, d)
        Finite update rows, ``V >= 2``; a torch tensor too (``h`` is then a tensor,
        and the diameter runs on the compiled engine as for the NumPy view).
    H : float, default=1.0
        Radius of the hidden-state ball, ``H >= 0``.

    Returns
    -------
    worst : WorstCaseHiddenState
        ``value`` = H D(S), ``h`` (float64, shape (d,)) and the diameter pair.

    Notes
    -----
    .. math:: \sup_{\lVert h \rVert \le H} d_H(\mathrm{softmax}(Wh), \mathrm{softmax}((W+S)h))
              = \sup_{\lVert h \rVert \le H} \lVert S h \rVert_{var} = H\, D(S),

    attained at :math:`h^* = H (s_a - s_b)/\lVert s_a - s_b \rVert`, independently of W.
    Time O(V^2 d) (one certified diameter).  A value :math:`H D(S)` beyond the largest
    float64 raises ``ValueError``; a representable one is returned also where
    :math:`D(S)` itself exceeds the float64 range (a small H).

    References
    ----------
    .. [1] LM-head update geometry, arXiv:2608.22253.

    Examples
    --------
    >>> import numpy as np, refgeo
    >>> w = refgeo.worst_case_hidden_state(np.array([[0.0, 0.0], [3.0, 4.0]]), H=5.0)
    >>> w.value, w.h.tolist()
    (25.0, [-3.0, -4.0])
    """
    S, origin = _engine_rows(S)
    H = check_real(H, "H", min_value=0.0)
    # the diameter of the prescaled rows, not row_diameter(S): D(S) itself may exceed
    # the float64 range (rows near +-1e308) where H D(S) does not (a small H)
    D_scaled, i, j, e = _scaled_diameter(S)
    xp = array_namespace(S)
    X = f64(xp, S)
    if e == 0:
        # rows in [2**-64, 2**65): D(S) is the kernels' value as it is
        value = H * D_scaled
    else:
        # the direction from the prescaled pair: H / D(S) overflows for subnormal D(S),
        # and the rows' own difference may be subnormal; the scaled ones are neither
        a, c = scale_rows(xp, X[i, :], e), scale_rows(xp, X[j, :], e)
        # one rounding, also where H D(S) is subnormal; H's own power of two is moved
        # into the unscaling, so that H times the scaled diameter (about 1) cannot
        # overflow where H D(S) itself is representable (a large H and tiny rows)
        mH, eH = math.frexp(H)
        value = unscale(mH * D_scaled, e + eH)
    if not math.isfinite(value):
        # checked before h is formed: its entries would overflow too (a RuntimeWarning)
        D_text = repr(D_scaled) if e == 0 else f"{D_scaled!r} * 2**{e}"
        raise ValueError(
            f"H * D(S) = {H!r} * {D_text} is beyond the float64 range (largest finite "
            f"{np.finfo(np.float64).max:.4g}); pass a smaller H or scale S down first."
        )
    if D_scaled == 0.0:
        h = xp.zeros((X.shape[1],), dtype=xp.float64)
    elif e == 0:
        h = _direction_times(X[i, :] - X[j, :], D_scaled, H)
    else:
        h = _direction_times(a - c, D_scaled, H)
    return WorstCaseHiddenState(value=value, h=_array_out(h, origin), i=i, j=j)


def _scaled_diameter(S) -> tuple[float, int, int, int]:
    """``(D', i, j, e)``: the certified diameter ``D'`` of the rows ``S * 2**-e`` (the
    prescaling of :func:`row_diameter`, exact) and its pair; ``D(S) = D' 2**e``, which
    can exceed the float64 range where ``D'`` (about 1) does not."""
    with _progress.Progress(False, None, desc="row_diameter", unit="tile") as bar:
        _, e, (value, i, j) = _extreme_pair_run(_DIAMETER, S, None, None, bar)
        bar.finish()
    return float(value), int(i), int(j), e


_TINY64 = float(np.finfo(np.float64).tiny)  # smallest normal float64


def _direction_times(diff, norm, H):
    """``diff * (H / norm)``, or ``(diff / norm) * H`` where ``H / norm`` overflows (a
    large H and rows a few ulps apart) or is subnormal (a small H and a large diameter,
    where the ratio kept only a few digits): the entries of h never exceed H in size,
    and h keeps norm H to rounding."""
    ratio = H / norm
    # + 0.0: H = 0 gives zeros, not -0.0 for the negative entries of diff
    if math.isfinite(ratio) and ratio >= _TINY64:
        return diff * ratio + 0.0
    return (diff / norm) * H + 0.0


def hilbert_rms(S: Any, hidden: Any, /) -> float:
    r"""Hilbert RMS of a step over a panel of hidden states.

    Parameters
    ----------
    S : array_like of shape (V, d)
        Update rows.
    hidden : array_like of shape (N, d) or (d,)
        Hidden states :math:`h_1, \dots, h_N`.  Either argument may be a torch
        tensor (viewed as NumPy on the CPU; the result is a Python float either way).

    Returns
    -------
    rms : float
        :math:`\sqrt{\tfrac1N \sum_t \delta_t^2}` with :math:`\delta_t = \lVert S h_t \rVert_{var}`.

    Notes
    -----
    .. math:: \mathrm{RMS} = \Big(\frac1N \sum_{t=1}^N \lVert S h_t \rVert_{var}^2\Big)^{1/2}
              \le \max_t \lVert h_t \rVert \, D(S)

    :math:`\delta_t` is the Hilbert distance between the output distributions before and
    after the step at :math:`h_t`, for any W.  Products and squared ranges accumulate in
    float64; time O(N V d), extra memory O(V b + N) for blocks of b hidden states.
    float64 inputs beyond ``[2**-64, 2**65)`` in magnitude are prescaled by powers of
    two (exact, as in :func:`row_diameter`), and tiny spreads are summed scaled, so
    the RMS is finite wherever it is a float64; beyond that, ``ValueError``.
    Invariant under a common shift of the rows of S; where the rows share a large
    offset (a column whose entries lie within a factor 2 of each other) it is
    subtracted first, exactly, so that it does not cancel the spread.

    References
    ----------
    .. [1] LM-head update geometry, arXiv:2608.22253.

    Examples
    --------
    >>> import numpy as np, refgeo
    >>> S = np.array([[0.0, 0.0], [3.0, 4.0]])
    >>> refgeo.hilbert_rms(S, np.array([[1.0, 0.0], [0.0, 1.0]]))
    3.5355339059327378
    """
    S, _ = from_foreign(S, "S")
    hidden, _ = from_foreign(hidden, "hidden")
    S = as_float_array(S, "S", ndim=2, shape_hint="2-D array of shape (V, d)")
    hidden = as_float_array(hidden, "hidden", ndim=(1, 2))
    S, hidden = _one_namespace(S, hidden, ("S", "hidden"))
    xp = array_namespace(S, hidden)
    Hm = f64(xp, hidden)
    if Hm.ndim == 1:
        Hm = xp.expand_dims(Hm, axis=0)
    check_same_trailing(S, Hm, ("S", "hidden"), "number of columns (hidden width d)")
    X = f64(xp, S)
    # delta_t does not change under a common shift of the rows.  Where a column holds a
    # common offset (every entry of the first row's sign and within a factor 2 of it)
    # the first row's entry is subtracted from it, exactly (Sterbenz), so that the
    # offset neither cancels the spread in the products (rows 1e16 + [1, -1] gave 0 for
    # 2) nor, through the prescaling, flushes small entries to zero; other columns stay
    # as they are (subtracting there would round: 2**-600 - 1 is -1).
    c = X[0:1, :]
    a, ac = xp.abs(X), xp.abs(c)
    with np.errstate(over="ignore"):  # 2 |x| of entries near the largest float is inf, and compares right
        offset = xp.all((xp.sign(X) == xp.sign(c)) & (a <= 2.0 * ac) & (ac <= 2.0 * a), axis=0, keepdims=True)
    D = X - xp.where(offset, c, xp.zeros_like(c))
    # the shifted rows and the hidden states are prescaled by powers of two (exact, as
    # in row_diameter), so the products cannot overflow; the result is scaled back once
    ex, eh = scale_exponent(xp, [D]), scale_exponent(xp, [Hm])
    e = ex + eh
    X = scale_rows(xp, D, ex)
    Hm = scale_rows(xp, Hm, eh)
    N, V = Hm.shape[0], X.shape[0]
    b = max(1, _ROW_ELEMENTS // max(V, 1))
    deltas = []
    for t0 in range(0, N, b):
        # slice ends within the array: the array API leaves a longer one unspecified
        # (array-api-strict raised IndexError, where NumPy clips it)
        Z = Hm[t0 : min(t0 + b, N), :] @ xp.permute_dims(X, (1, 0))
        deltas.append(xp.max(Z, axis=1) - xp.min(Z, axis=1))
    top = max(float(xp.max(dl)) for dl in deltas)
    if top == 0.0:
        return 0.0
    # Spreads far below the size of the products (cancellation) would have subnormal
    # or zero squares: then they are summed scaled by the power of two that brings the
    # largest to [1/2, 1), like a scaled two-norm.
    es = 0 if 2.0**-500 <= top <= 2.0**500 else math.frexp(top)[1]
    total = 0.0
    for dl in deltas:
        dl = scale_rows(xp, dl, es)
        total += float(xp.sum(dl * dl))
    rms = unscale(math.sqrt(total / N), e + es)
    if not math.isfinite(rms):
        raise _too_large("the Hilbert RMS", math.sqrt(total / N), e + es)
    return rms


def backward_bound(S: Any, r: Any, /):
    r"""Bound on the backward signal: :math:`\lVert S^\top r \rVert_2 \le \tfrac12 D(S) \lVert r \rVert_1`.

    Parameters
    ----------
    S : array_like of shape (V, d)
        Update rows, ``V >= 2``.
    r : array_like of shape (V,) or (n, V)
        Residual vectors, e.g. ``p - e_c`` for cross-entropy.  They need not sum to
        zero: a softmax residual rounded in float32 or bfloat16 sums to about 1e-3, and
        the bound then covers the sum as well (Notes).

    Returns
    -------
    bound : float or ndarray of shape (n,)
        An upper bound on :math:`\lVert S^\top r \rVert_2` per residual, to rounding:
        :math:`\tfrac12 D(S) \lVert r \rVert_1` where :math:`\mathbf{1}^\top r = 0` (a
        tensor when ``S`` or ``r`` is one; a Python float for one residual).

    Notes
    -----
    .. math:: \lVert S^\top r \rVert_2 \le \frac{D(S)}{2} \lVert r \rVert_1
              \quad (\mathbf{1}^\top r = 0),

    with equality at :math:`r = e_a - e_b` for a diameter pair (a, b); for
    cross-entropy :math:`r = p - e_c` it reads :math:`D(S)(1 - p_c)`.  A residual with
    :math:`\sigma = \mathbf{1}^\top r \ne 0` splits into
    :math:`r_0 = r - (\sigma / V) \mathbf{1}`, which sums to zero, and :math:`\sigma`
    times the mean row :math:`\bar s`:

    .. math:: \lVert S^\top r \rVert_2 \le \frac{D(S)}{2} \lVert r_0 \rVert_1
              + |\sigma| \, \lVert \bar s \rVert_2 ,

    the value returned (equality for ``V = 2`` and ``r = e_a`` where :math:`s_a - s_b`
    and :math:`s_a + s_b` point the same way, as in the example).  :math:`D(S)` does not see where
    the rows lie and :math:`\lVert \bar s \rVert` does, which is why a residual off
    zero sum cannot take the first bound alone: rows 1e4 from the origin and a
    bfloat16 softmax residual would break it threefold.  Time O(V^2 d) for the
    certified diameter plus O(n V) (the sums of r to twice the working precision,
    since their error is multiplied by the mean row, with that error added to
    :math:`|\sigma|`; correctly rounded, by :func:`math.fsum`, for the residuals whose
    error would show, where the rows lie more than about :math:`10^{12} D(S)` from the
    origin) and O(V d) for the mean row where some :math:`\sigma` may be nonzero
    (its column sums also to twice the working precision).  The rounding of these
    steps is counted where it could cancel the decisive part (the error of
    :math:`\sigma` in both terms, that of :math:`\sigma / V` in every entry of
    :math:`r_0`, entries of ``r`` that its prescaling rounds away).  The bound is
    returned wherever it is a float64, also where :math:`D(S)` itself is not (rows
    near ``+-1e308`` and :math:`\lVert r \rVert_1 < 2`); beyond that, ``ValueError``.

    References
    ----------
    .. [1] LM-head update geometry, arXiv:2608.22253.

    Examples
    --------
    >>> import numpy as np, refgeo
    >>> S = np.array([[0.0, 0.0], [3.0, 4.0]])
    >>> refgeo.backward_bound(S, np.array([1.0, -1.0]))
    5.0
    >>> refgeo.backward_bound(S, np.array([0.0, 1.0]))  # sums to 1: 5/2 + |(1.5, 2)|
    5.0
    """
    S, origin_s = _engine_rows(S)
    r, origin_r = from_foreign(r, "r")
    origin = origin_r if origin_r is not None else origin_s
    r = as_float_array(r, "r", ndim=(1, 2))
    if r.shape[-1] != S.shape[0]:
        raise ValueError(
            f"r must have {S.shape[0]} entries per residual (one per row of S), got shape "
            f"{tuple(r.shape)} instead."
        )
    S, r = _one_namespace(S, r, ("S", "r"))
    xp = array_namespace(S, r)
    r64 = f64(xp, r)
    # residuals prescaled by a power of two (exact) and D split into mantissa and
    # exponent, so that neither the l1 norms nor the product overflow on the way to a
    # bound that is a float64; it is scaled back in one step
    er = scale_exponent(xp, [r64])
    scaled_r = scale_rows(xp, r64, er)
    # sigma = 1^T r to twice the working precision (compensated_sums): a float sum's
    # error, up to about u ||r||_1, is multiplied by the mean row below, which may lie far
    # from the origin compared with D(S) (rows 1e20 out, D = 1: a float sum of exactly 0
    # hid a term of 1000)
    tot, err, l1 = compensated_sums(xp, scaled_r)
    lost = None
    if er > 0:
        # the prescaling rounds entries more than 2**1022 below the largest to
        # subnormals or zero, each by at most the smallest normal number (flush-to-zero
        # included): the residual moved by those bits counts in err (both terms take it)
        flushed = xp.logical_and(xp.abs(scaled_r) < 2.0**-1022, r64 != 0.0)
        lost = xp.astype(xp.sum(xp.astype(flushed, xp.int64), axis=-1), xp.float64) * 2.0**-1022
    r64 = scaled_r
    # D(S) = D' 2**e from the prescaled rows: D(S) itself may exceed the float64 range
    # where the bound does not (residuals of size below 1)
    D_scaled, _, _, eS = _scaled_diameter(S)
    mD, eD = math.frexp(D_scaled)
    eD += eS
    V = S.shape[0]
    if lost is not None and not bool(xp.any(lost != 0.0)):
        lost = None
    off = bool(xp.any(tot != 0.0)) or bool(xp.any(err != 0.0)) or lost is not None
    if off:
        # the mean row of the rows prescaled like the diameter's, split like D: its
        # norm bounded from the column sums to twice the working precision (a float mean
        # of the rows 1e16, 1, -1e16 is 0, and the bound was 0 for ||S^T 1|| = 1)
        # (O(V d): 1.3 s at 50257 x 768, where the certified diameter takes 10 s)
        columns = xp.permute_dims(scale_rows(xp, f64(xp, S), eS), (1, 0))
        cols, cerr, _ = compensated_sums(xp, columns)
        norm = (float(xp.linalg.vector_norm(cols)) + float(xp.linalg.vector_norm(cerr))) / V
        mS, eM = math.frexp(norm)
        eM += eS
        # the error of sigma costs err ||s_mean||; where its part beyond the final
        # rounding, O(log^2 V u^2 ||r||_1), is above the rounding of the first term (rows
        # more than about 1e12 D(S) from the origin), the sum is taken correctly rounded
        # instead (math.fsum, a Python loop: only those rows)
        rel = math.ldexp(mS / max(mD, 0.5), max(-1100, min(1100, eM - eD)))
        beyond = err - U64 * xp.abs(tot)
        loose = xp.reshape(beyond * rel > (0.25 * U64) * l1, (-1,))
        if bool(xp.any(loose)):
            rows = xp.reshape(r64, (-1, r64.shape[-1]))
            fixed = xp.reshape(tot, (-1,)).tolist()
            spent = xp.reshape(err, (-1,)).tolist()
            for i, bad in enumerate(loose.tolist()):
                if bad:
                    # correctly rounded: within u |sigma| <= 2 u |fl(sigma)|
                    fixed[i] = math.fsum(rows[i, :].tolist())
                    spent[i] = 2.0 * U64 * abs(fixed[i])
            tot = xp.reshape(xp.asarray(fixed, dtype=xp.float64), tot.shape)
            err = xp.reshape(xp.asarray(spent, dtype=xp.float64), err.shape)
        if lost is not None:
            err = err + lost
        # S^T r = S^T w + t s_mean for the computed t and w = r - (t / V) 1 (exactly),
        # and 1^T w = sigma - t, |sigma - t| <= err, so ||S^T w|| <= D/2 (||w||_1 + err)
        # + err ||s_mean||.  The computed r0 = fl(r - fl(t / V)) is within u of w
        # entrywise, but fl(t / V) is off t / V by up to u |t| / V in every entry, a
        # total of u |t| that is not small next to ||r0||_1 where r is nearly constant
        # (at V = 3: 75% of S^T r was missed); none where V is a power of two, but
        # for an underflow (the smallest normal number per entry, flush-to-zero too)
        r64 = r64 - xp.expand_dims(tot, axis=-1) / V
        slack = err + V * 2.0**-1022
        if V & (V - 1):
            slack = slack + (2.0 * U64) * xp.abs(tot)
    l1 = xp.sum(xp.abs(r64), axis=-1)
    scaled = (0.5 * mD) * (l1 + slack) if off else (0.5 * mD) * l1
    out = unscale_array(xp, scaled, eD + er)
    if off:
        moved = unscale_array(xp, mS * (xp.abs(tot) + err), eM + er)
        with _quiet_overflow(xp):
            out = out + moved
    if not bool(xp.all(xp.isfinite(out))):
        if off and not bool(xp.all(xp.isfinite(moved))):
            raise ValueError(
                "the backward bound's term |1^T r| ||mean row of S|| is beyond the float64 "
                "range: the residuals' sums times the rows' position overflow; scale r or S down "
                "(or center r) first."
            )
        raise _too_large("the backward bound", float(xp.max(scaled)), eD + er)
    if out.ndim == 0:
        return float(out)
    return to_caller(out, origin)
