"""``check_against_reference``: run a candidate against refgeo's oracle with hypothesis.

The registry maps a quantity's name to a :class:`Reference`: how to call refgeo's
reference, how to call the candidate, how to compare (one of the ``assert_*``
helpers), and which inputs to draw.  Adding a quantity is one ``_register(...)`` call.
"""

from __future__ import annotations

import dataclasses
import hashlib
import numbers
from collections.abc import Callable
from typing import Any

import numpy as np
from hypothesis import HealthCheck, Phase, given
from hypothesis import seed as hseed
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from .._validate import check_callable
from . import strategies as rst
from ._assertions import (
    ConformanceError,
    _check_rule,
    _as_index,
    _check_tols,
    as_numpy,
    assert_cdist_close,
    assert_extreme_pair_close,
    assert_hilbert_close,
    assert_hilbert_logits_close,
    assert_knn_close,
    assert_local_diagonal_fit_close,
    assert_pdist_close,
    assert_projected_rownorm_close,
    assert_rownorm_steps_close,
)

__all__ = ["Case", "ConformanceReport", "Reference", "check_against_reference", "reference_names", "signature"]


@dataclasses.dataclass(frozen=True, slots=True)
class Case:
    """One drawn input: positional arrays (named) and keyword arguments.

    Attributes
    ----------
    args : tuple
        Positional arguments (arrays first), passed to the reference and the candidate.
    names : tuple of str
        Names of ``args`` for the failure report.
    kwargs : dict
        Keyword arguments (scalars such as ``k`` or ``eta``), passed to both.
    """

    args: tuple
    names: tuple
    kwargs: dict = dataclasses.field(default_factory=dict)

    def inputs(self) -> dict[str, Any]:
        """All arguments by name (positional, then keyword), as shown in reports."""
        out = dict(zip(self.names, self.args))
        out.update(self.kwargs)
        return out


@dataclasses.dataclass(frozen=True, slots=True)
class ConformanceReport:
    """What :func:`check_against_reference` checked, returned when the candidate passed.

    Attributes
    ----------
    name : str
        The quantity, e.g. ``"row_diameter"``.
    scenarios : tuple of str
        The input scenarios that were run (one per adversarial structure).
    examples : int
        Examples on which the candidate agreed with the reference, over all scenarios.
    unchecked : tuple of str
        Parts of the result that were not compared, e.g. ``("pair (i, j)",)`` for a
        diameter kernel that returns its value only.  Empty when everything was checked.
    """

    name: str
    scenarios: tuple
    examples: int
    unchecked: tuple = ()

    def __str__(self) -> str:
        n = len(self.scenarios)
        text = (f"{self.name}: the candidate agrees with refgeo's reference on {self.examples} examples "
                f"in {n} scenario{'s' if n != 1 else ''}")
        if self.unchecked:
            text += f"; not checked: {', '.join(self.unchecked)} (the candidate returned the value only)"
        return text


@dataclasses.dataclass(frozen=True, slots=True)
class Reference:
    """Registry entry: one quantity a candidate can be checked against.

    Attributes
    ----------
    name : str
        The quantity, e.g. ``"row_diameter"``.
    signature : str
        How the candidate is called and what it returns (shown in docs and errors).
    arg_names : tuple of str
        Names of the positional arguments.
    reference : callable
        ``reference(*args, **kwargs)``, run on refgeo's reference backend.
    compare : callable
        ``compare(got, expected, case, rtol, atol, tie_break)``; raises
        :class:`ConformanceError`, and may return the names of the parts of the result
        it could not check (a value-only extreme pair: ``("pair (i, j)",)``).
    strategy : callable
        ``strategy(dtypes) -> {label: SearchStrategy}``: the default inputs as named
        scenarios (one per adversarial structure), each drawing :class:`Case` objects.
    """

    name: str
    signature: str
    arg_names: tuple
    reference: Callable[..., Any]
    compare: Callable[..., Any]
    strategy: Callable[[tuple], dict]


_REGISTRY: dict[str, Reference] = {}


def _register(entry: Reference) -> None:
    _REGISTRY[entry.name] = entry


def reference_names() -> list[str]:
    """Sorted names accepted by :func:`check_against_reference` in this installation.

    Returns
    -------
    names : list of str

    Examples
    --------
    >>> from refgeo.testing import reference_names
    >>> "row_diameter" in reference_names()
    True
    """
    return sorted(_REGISTRY)


def _scenarios(options, make) -> dict:
    """One scenario per option: every adversarial structure gets its share of examples."""
    return {opt: make(opt) for opt in options}


def _cases(strategy, names: tuple, **kwargs):
    """Wrap a strategy of one array (or a tuple of arrays) into a strategy of Cases."""

    def as_case(value):
        args = value if isinstance(value, tuple) else (value,)
        return Case(args=args, names=names, kwargs=dict(kwargs))

    return strategy.map(as_case)


# --------------------------------------------------------------------------- results


def _is_scalar(result: Any) -> bool:
    """A number, a NumPy scalar or a 0-d array or tensor of any library."""
    if isinstance(result, (bool, np.bool_)):
        return False
    if isinstance(result, (int, float, np.number)):
        return True
    return getattr(result, "ndim", None) == 0 or getattr(result, "shape", None) == ()


def _as_pair(result: Any) -> tuple[Any, Any, Any]:
    """(value, i, j) from an ExtremePair-like object, a tuple/list, a dict or a lone value.

    A lone value (a number or a 0-d array/tensor, or an object with ``.value`` only) gives
    ``(value, None, None)``: the candidate is checked on its value only.
    """
    if all(hasattr(result, a) for a in ("value", "i", "j")):
        return result.value, result.i, result.j
    if isinstance(result, dict):
        if "value" in result and "i" not in result and "j" not in result:
            return result["value"], None, None
        if all(k in result for k in ("value", "i", "j")):
            return result["value"], result["i"], result["j"]
        raise ConformanceError(
            "the candidate's dict must hold the keys 'value', 'i' and 'j' (or 'value' alone: then only "
            f"the value is checked), got keys {sorted(map(str, result))}.",
            got=result,
        )
    if isinstance(result, (tuple, list)) and len(result) == 3:
        return tuple(result)
    if _is_scalar(result):
        return result, None, None
    if hasattr(result, "value") and not hasattr(result, "i") and not hasattr(result, "j"):
        return result.value, None, None
    raise ConformanceError(
        "the candidate must return (value, i, j), an object with .value, .i, .j attributes, or the value "
        f"alone (then only the value is checked), got {type(result).__name__}.",
        got=result,
    )


def _as_pair_of_arrays(result: Any, first: str, second: str) -> tuple[Any, Any]:
    if all(hasattr(result, a) for a in (first, second)):
        return getattr(result, first), getattr(result, second)
    if isinstance(result, dict):
        if first in result and second in result:
            return result[first], result[second]
        raise ConformanceError(
            f"the candidate's dict must hold the keys {first!r} and {second!r}, got keys {sorted(map(str, result))}.",
            got=result,
        )
    if isinstance(result, (tuple, list)) and len(result) == 2:
        return tuple(result)
    raise ConformanceError(
        f"the candidate must return ({first}, {second}) or an object with .{first}, .{second}, "
        f"got {type(result).__name__}.",
        got=result,
    )


# --------------------------------------------------------------------------- comparisons


def _cmp_logits(got, expected, case, rtol, atol, tie_break):
    assert_hilbert_logits_close(got, *case.args, rtol=rtol, atol=atol)


def _cmp_probabilities(got, expected, case, rtol, atol, tie_break):
    assert_hilbert_close(got, *case.args, rtol=rtol, atol=atol)


def _cmp_pdist(got, expected, case, rtol, atol, tie_break):
    assert_pdist_close(got, *case.args, rtol=rtol, atol=atol)


def _cmp_cdist(got, expected, case, rtol, atol, tie_break):
    assert_cdist_close(got, *case.args, rtol=rtol, atol=atol)


def _cmp_extreme_pair(got, expected, case, rtol, atol, tie_break):
    value, i, j = _as_pair(got)
    assert_extreme_pair_close(value, i, j, expected, case.args[0], rtol=rtol, atol=atol, tie_break=tie_break)
    return ("pair (i, j)",) if i is None else ()


def _cmp_knn(got, expected, case, rtol, atol, tie_break):
    indices, distances = _as_pair_of_arrays(got, "indices", "distances")
    assert_knn_close(indices, distances, expected, case.args[0], rtol=rtol, atol=atol, tie_break=tie_break)
    # indices only (distances None): the report says what was not checked, as for a
    # diameter returned without its pair
    return ("distances",) if distances is None else ()


def _cmp_farthest(got, expected, case, rtol, atol, tie_break):
    indices, distances = _as_pair_of_arrays(got, "indices", "distances")
    # Farthest partners are a k-NN with k = 1 under the reversed order: compare row by
    # row as extreme pairs of the one-row problems.
    S = np.asarray(case.args[0])
    # both of shape (V,), as documented: flattened first, (2, V / 2), (V, 1) and (1, V)
    # results were taken
    idx = as_numpy(indices)
    dist = as_numpy(distances)
    ref_idx = np.asarray(expected.indices)
    ref_dist = np.asarray(expected.distances)
    if idx.shape != ref_idx.shape or dist.shape != ref_dist.shape:
        raise ConformanceError(
            f"indices and distances must have shape {ref_idx.shape}, got {idx.shape} and {dist.shape}.",
            expected={"indices": ref_idx, "distances": ref_dist},
            got={"indices": idx, "distances": dist},
        )
    for r in range(S.shape[0]):
        try:
            partner = _as_index(idx[r], f"the partner of row {r}")  # not 1.5 truncated, nor NaN
        except ConformanceError as exc:
            raise ConformanceError(exc.reason, expected={"indices": ref_idx, "distances": ref_dist},
                                   got={"indices": idx, "distances": dist}) from None
        a, b = min(r, partner), max(r, partner)
        ra, rb = min(r, int(ref_idx[r])), max(r, int(ref_idx[r]))
        ref = _PairView(float(ref_dist[r]), ra, rb)
        if a == b:
            raise ConformanceError(
                f"row {r} is listed as its own farthest partner.",
                expected={"indices": ref_idx, "distances": ref_dist},
                got={"indices": idx, "distances": dist},
            )
        try:
            assert_extreme_pair_close(dist[r], a, b, ref, S, rtol=rtol, atol=atol, tie_break=tie_break)
        except ConformanceError as exc:
            raise ConformanceError(
                f"row {r}: {exc.reason}",
                expected={"indices": ref_idx, "distances": ref_dist},
                got={"indices": idx, "distances": dist},
                tolerance=exc.tolerance,
            ) from None


@dataclasses.dataclass(frozen=True, slots=True)
class _PairView:
    value: float
    i: int
    j: int


# --------------------------------------------------------------------------- registry


def _ref(path: str) -> Callable[..., Any]:
    def call(*args, **kwargs):
        import refgeo

        return getattr(refgeo, path)(*args, **kwargs)

    call.__name__ = f"refgeo.{path}"
    return call


@st.composite
def _cdist_case(draw, dts):
    v = draw(st.integers(1, 12))
    dt = draw(st.sampled_from(dts))
    XA = draw(rst.logits(n_rows=(1, 5), n_cols=v, dtypes=dt))
    XB = draw(rst.logits(n_rows=(1, 5), n_cols=v, dtypes=dt))
    return Case(args=(XA, XB), names=("XA", "XB"))


@st.composite
def _knn_case(draw, dts, structure):
    S = draw(rst.row_clouds(n_rows=(2, 10), dtypes=dts, structures=(structure,)))
    k = draw(st.integers(1, S.shape[0] - 1))
    return Case(args=(S, k), names=("X", "k"))


_register(
    Reference(
        name="hilbert_distance_logits",
        signature="candidate(z, w) -> d of shape (n,): Hilbert distance of softmax rows, max(w - z) - min(w - z)",
        arg_names=("z", "w"),
        reference=_ref("hilbert_distance_logits"),
        compare=_cmp_logits,
        strategy=lambda dts: _scenarios(
            rst.LOGIT_STRUCTURES, lambda s: _cases(rst.logit_pairs(dtypes=dts, structures=(s,)), ("z", "w"))
        ),
    )
)
_register(
    Reference(
        name="hilbert_distance",
        signature="candidate(p, q) -> d of shape (n,): Hilbert distance of non-negative rows (inf off-support)",
        arg_names=("p", "q"),
        reference=_ref("hilbert_distance"),
        compare=_cmp_probabilities,
        strategy=lambda dts: _scenarios(
            rst.SUPPORTS, lambda s: _cases(rst.simplex_pairs(dtypes=dts, supports=(s,)), ("p", "q"))
        ),
    )
)
_register(
    Reference(
        name="pdist_hilbert",
        signature="candidate(X) -> condensed (n*(n-1)//2,) or square (n, n) Hilbert distances of logit rows",
        arg_names=("X",),
        reference=_ref("pdist_hilbert"),
        compare=_cmp_pdist,
        strategy=lambda dts: _scenarios(
            rst.LOGIT_STRUCTURES[:-1],
            lambda s: _cases(rst.logits(n_rows=(1, 8), dtypes=dts, structures=(s,)), ("X",)),
        ),
    )
)
_register(
    Reference(
        name="cdist_hilbert",
        signature="candidate(XA, XB) -> (nA, nB) Hilbert distances between logit rows",
        arg_names=("XA", "XB"),
        reference=_ref("cdist_hilbert"),
        compare=_cmp_cdist,
        strategy=lambda dts: {"logits": _cdist_case(dts)},
    )
)
_register(
    Reference(
        name="row_diameter",
        signature="candidate(S) -> (value, i, j) or an object with .value, .i, .j (i < j)",
        arg_names=("S",),
        reference=_ref("row_diameter"),
        compare=_cmp_extreme_pair,
        strategy=lambda dts: _scenarios(
            rst.ROW_STRUCTURES, lambda s: _cases(rst.row_clouds(dtypes=dts, structures=(s,)), ("S",))
        ),
    )
)
_register(
    Reference(
        name="closest_pair",
        signature="candidate(S) -> (value, i, j) or an object with .value, .i, .j (i < j)",
        arg_names=("S",),
        reference=_ref("closest_pair"),
        compare=_cmp_extreme_pair,
        strategy=lambda dts: _scenarios(
            rst.ROW_STRUCTURES, lambda s: _cases(rst.row_clouds(dtypes=dts, structures=(s,)), ("S",))
        ),
    )
)
_register(
    Reference(
        name="farthest_partners",
        signature="candidate(S) -> (indices (V,), distances (V,)) or an object with .indices, .distances",
        arg_names=("S",),
        reference=_ref("farthest_partners"),
        compare=_cmp_farthest,
        strategy=lambda dts: _scenarios(
            rst.ROW_STRUCTURES, lambda s: _cases(rst.row_clouds(dtypes=dts, structures=(s,)), ("S",))
        ),
    )
)
_register(
    Reference(
        name="knn",
        signature="candidate(X, k) -> (indices (n, k), distances (n, k)), nearest first, self excluded",
        arg_names=("X", "k"),
        reference=_ref("knn"),
        compare=_cmp_knn,
        strategy=lambda dts: _scenarios(rst.ROW_STRUCTURES, lambda s: _knn_case(dts, s)),
    )
)


def _cmp_projected_rownorm(got, expected, case, rtol, atol, tie_break):
    assert_projected_rownorm_close(got, case.args[0], eta=case.kwargs["eta"], rtol=rtol, atol=atol)


def _cmp_rownorm(got, expected, case, rtol, atol, tie_break):
    if isinstance(got, (list, tuple)):
        got = np.stack([as_numpy(w) for w in got])
    assert_rownorm_steps_close(got, *case.args, rtol=rtol, atol=atol, **case.kwargs)


@st.composite
def _rownorm_lmo_case(draw, dts, structure):
    # Sizes of real LM-head gradient entries (1 down to 1e-12); see centered_gradients for
    # why the size is drawn explicitly.
    G = draw(rst.centered_gradients(dtypes=dts, structures=(structure,), scales=(1.0, 2.0**-20, 2.0**-40)))
    norms = np.sqrt(np.einsum("ij,ij->i", G.astype(np.float64), G.astype(np.float64)))
    if draw(st.booleans()) and norms.min() > 0.0:
        # A common row shift c (on the same binary grid): the inner P of the formula must
        # remove it.  Centering then rounds by about u |c| in the input precision (a mean
        # taken as sum * (1/V) is not exact), so c is the shortest row, and none is
        # zero: a row of PG far below |c| would come out of any correct float32
        # kernel as a rounding-noise direction, and spoil every row through the outer P.
        G = G + G[int(np.argmin(norms))][None, :]
    return Case(args=(G,), names=("G",), kwargs={"eta": draw(st.sampled_from([1.0, 0.02, 3.0]))})


@st.composite
def _rownorm_step_case(draw, dts):
    grads = draw(rst.gradient_sequences(dtypes=dts))
    W0 = draw(rst.row_clouds(n_rows=grads.shape[1], n_cols=grads.shape[2], dtypes=grads.dtype,
                             structures=("generic",), layouts="C"))
    kwargs = {
        "lr": draw(st.sampled_from([0.02, 1e-3, 1.0])),
        "mu": draw(st.sampled_from([0.95, 0.5])),
        "eps": draw(st.sampled_from([1e-8, 1e-6, 0.0])),
    }
    return Case(args=(W0, grads), names=("W0", "grads"), kwargs=kwargs)


def _rownorm_reference(W0, grads, *, lr, mu, eps):
    from ._assertions import _rownorm_oracle

    return _rownorm_oracle(W0, grads, lr, mu, eps)


_register(
    Reference(
        name="projected_rownorm",
        signature="candidate(G, eta=eta) -> S of shape (V, d): -(eta/2) P RN(P G)",
        arg_names=("G",),
        reference=_ref("projected_rownorm"),
        compare=_cmp_projected_rownorm,
        strategy=lambda dts: _scenarios(("cross_entropy", "rank_one", "sparse", "zipf"),
                                        lambda s: _rownorm_lmo_case(dts, s)),
    )
)
_register(
    Reference(
        name="rownorm_step",
        signature=(
            "candidate(W0, grads, lr=lr, mu=mu, eps=eps) -> parameters after each step, shape (T, V, d) "
            "(or after the last, (V, d)): RowNorm (docs/theory/lmo.md) from W0 with grads[0], ..., grads[T-1]"
        ),
        arg_names=("W0", "grads"),
        reference=_rownorm_reference,
        compare=_cmp_rownorm,
        strategy=lambda dts: {"gradient_sequences": _rownorm_step_case(dts)},
    )
)


def _cmp_local_diagonal(got, expected, case, rtol, atol, tie_break):
    assert_local_diagonal_fit_close(got, *case.args, lam=case.kwargs["lam"], rtol=rtol, atol=atol)


@st.composite
def _local_fit_case(draw, dts, map_class):
    import refgeo

    h = draw(rst.hidden_state_pairs(dtypes=dts, map_classes=(map_class,)))
    n = h.X.shape[0]
    k = draw(st.integers(1, min(6, n - 1)))
    with refgeo.use_backend("reference"):
        nb = np.asarray(refgeo.knn(h.X, k).indices)
    X, Y = np.array(h.X), np.array(h.Y)  # writable copies
    return Case(args=(X, Y, nb), names=("X", "Y", "neighbors"), kwargs={"lam": draw(st.sampled_from([1e-3, 1.0, 0.0]))})


def _local_diagonal_reference(X, Y, neighbors, *, lam):
    import refgeo

    return refgeo.fit_local_maps(X, Y, neighbors=neighbors, cls="diagonal", ridge=lam, prior="identity")


_register(
    Reference(
        name="local_diagonal_fit",
        signature=(
            "candidate(X, Y, neighbors, lam=lam) -> A_i x_i of shape (N, d): the diagonal map per token, "
            "a_c = (sum_j x_jc y_jc + lam) / (sum_j x_jc^2 + lam) over j in neighbors[i] (identity prior)"
        ),
        arg_names=("X", "Y", "neighbors"),
        reference=_local_diagonal_reference,
        compare=_cmp_local_diagonal,
        strategy=lambda dts: _scenarios(rst.MAP_CLASSES, lambda c: _local_fit_case(dts, c)),
    )
)


# --------------------------------------------------------------------------- runner


def _coerce_case(value: Any, entry: Reference) -> Case:
    if isinstance(value, Case):
        return value
    args = value if isinstance(value, tuple) else (value,)
    names = tuple(entry.arg_names[: len(args)]) + tuple(f"arg{k}" for k in range(len(entry.arg_names), len(args)))
    return Case(args=args, names=names)


def _snapshot(args):
    return [a.copy() if isinstance(a, np.ndarray) else None for a in args]


def _run_one(entry: Reference, candidate, case: Case, convert, rtol, atol, tie_break, scenario) -> tuple:
    """Check one case; returns the parts of the result that could not be checked."""
    __tracebackhide__ = True  # pytest: show the report, not the kit's frames
    import refgeo

    with refgeo.use_backend("reference"):
        expected = entry.reference(*case.args, **case.kwargs)
    before = _snapshot(case.args)
    call_args = tuple(convert(a) if (convert is not None and isinstance(a, np.ndarray)) else a for a in case.args)
    context = (entry.name, case.inputs(), scenario)
    try:
        got = candidate(*call_args, **case.kwargs)
    except Exception as exc:
        raise ConformanceError(f"the candidate raised {type(exc).__name__}: {exc}").with_context(*context) from exc
    for name, a, b in zip(case.names, case.args, before):
        if b is not None and not np.array_equal(a, b, equal_nan=True):
            raise ConformanceError(
                f"the candidate modified its input {name!r} in place.", expected=b, got=a
            ).with_context(*context)
    try:
        unchecked = entry.compare(got, expected, case, rtol, atol, tie_break)
    except ConformanceError as exc:
        raise exc.with_context(*context) from None
    return tuple(unchecked or ())


def check_against_reference(
    candidate: Callable[..., Any],
    name: str,
    *,
    strategy: Any = None,
    dtypes: Any = None,
    rtol: float | None = None,
    atol: float | None = None,
    max_examples: int = 100,
    tie_break: str = "smallest",
    convert: Callable[[np.ndarray], Any] | None = None,
    settings: hsettings | None = None,
) -> ConformanceReport:
    """Check a candidate implementation against refgeo's reference, with hypothesis.

    Draws adversarial inputs, calls ``candidate`` and refgeo's reference backend
    (``refgeo.use_backend("reference")``) on each, and compares with the quantity's
    ``assert_*`` helper.  On a mismatch hypothesis shrinks the input and the minimal
    failing example is raised as :class:`ConformanceError` (an ``AssertionError``, so it
    fails a pytest test), with the inputs, the expected and received values, and the
    tolerance.

    Parameters
    ----------
    candidate : callable
        The implementation under test.  It receives NumPy arrays (or whatever
        ``convert`` makes of them) and may return arrays of any library: results are
        converted with DLPack or ``np.asarray``.  Its call signature per ``name`` is
        given by :func:`signature` and in the docs page.
    name : str
        The quantity, one of :func:`reference_names`: ``"hilbert_distance_logits"``,
        ``"hilbert_distance"``, ``"pdist_hilbert"``, ``"cdist_hilbert"``,
        ``"row_diameter"``, ``"closest_pair"``, ``"farthest_partners"``, ``"knn"``,
        ``"projected_rownorm"``, ``"rownorm_step"``, ``"local_diagonal_fit"``.
    strategy : hypothesis strategy or dict of them, default=None
        Inputs to draw instead of the quantity's default scenarios; it may draw a
        :class:`Case`, a tuple of positional arguments, or one array.  A dict
        ``{label: strategy}`` is run as separate scenarios.
    dtypes : dtype or sequence of dtypes, default=None
        Restrict the default scenarios to these input dtypes (float32 and/or float64),
        e.g. ``"float32"`` for a float32-only kernel.  Not combinable with ``strategy``.
    rtol, atol : float, default=None
        Replace the certified default tolerance by ``atol + rtol * |expected|``.
    max_examples : int, default=100
        Examples drawn in all (before shrinking), shared evenly by the scenarios
        (``ceil(max_examples / scenarios)`` each: 13 of 8 scenarios by default): the
        default strategy of a quantity has one scenario per adversarial structure (for
        rows: generic, integers, duplicates, near duplicates, near ties, offsets, rank
        deficient, one huge row), so none of them is left to chance.
    tie_break : {"smallest", "any"}, default="smallest"
        For index-valued results: require refgeo's tie rule among exactly equal
        distances that every correct kernel computes exactly (see
        :func:`assert_extreme_pair_close`), or accept any near-extreme index (for a
        kernel that centers or rescales the rows first, whose rounding orders exact
        ties either way).
    convert : callable, default=None
        Applied to every array input before the candidate sees it, e.g.
        ``torch.from_numpy`` or ``cupy.asarray``.
    settings : hypothesis.settings, default=None
        Parent settings (profile, database, derandomize); by default the current
        profile.  ``deadline`` is always off and only the first bug is reported.

    Returns
    -------
    report : ConformanceReport
        When the candidate passed: the scenarios and examples run, and what was not
        checked (``report.unchecked``: the pair of an extreme-pair kernel that returned
        its value only).

    Raises
    ------
    ConformanceError
        For the minimal failing example of the first failing scenario.
    ValueError
        For an unknown ``name``, or bad options.

    Notes
    -----
    Each scenario is one hypothesis test run with ``report_multiple_bugs=False``; with
    a derandomized profile its seed depends only on the quantity and the scenario.  Do
    not call this function inside a test decorated with ``@given`` (hypothesis refuses
    nested ``@given``); there, draw inputs with :mod:`refgeo.testing.strategies` and
    compare with an ``assert_*`` helper.

    Examples
    --------
    >>> import numpy as np
    >>> from refgeo.testing import check_against_reference
    >>> def my_logit_distance(z, w):
    ...     d = np.asarray(w, dtype=np.float64) - np.asarray(z, dtype=np.float64)
    ...     return d.max(axis=-1) - d.min(axis=-1)
    >>> report = check_against_reference(my_logit_distance, "hilbert_distance_logits", max_examples=20)
    >>> report.examples > 0, report.unchecked
    (True, ())

    A diameter kernel that returns the value only is checked on its value:

    >>> def diameter_value(S):
    ...     S = np.asarray(S, dtype=np.float64)
    ...     return np.sqrt(((S[:, None, :] - S[None, :, :]) ** 2).sum(axis=-1)).max()
    >>> check_against_reference(diameter_value, "row_diameter", max_examples=16).unchecked
    ('pair (i, j)',)
    """
    __tracebackhide__ = True
    entry = _entry(name)
    check_callable(candidate, "candidate")
    _check_rule(tie_break)
    _check_tols(rtol, atol)
    if isinstance(max_examples, bool) or not isinstance(max_examples, numbers.Integral):
        raise TypeError(f"max_examples must be a positive int, got {type(max_examples).__name__} instead.")
    if max_examples < 1:
        raise ValueError(f"max_examples must be a positive int, got {max_examples!r} instead.")
    max_examples = int(max_examples)
    if convert is not None:
        check_callable(convert, "convert")
    if settings is not None and not isinstance(settings, hsettings):
        raise TypeError(
            f"settings must be a hypothesis.settings object or None, got {type(settings).__name__} instead."
        )
    if isinstance(strategy, dict) and not strategy:
        # no scenario would run, and the report would say the candidate agrees
        raise ValueError("strategy must be a hypothesis strategy or a non-empty dict of them, got {} instead.")
    if strategy is not None:
        for label, value in (strategy.items() if isinstance(strategy, dict) else [("", strategy)]):
            if not isinstance(value, SearchStrategy):
                where = f"strategy[{label!r}]" if isinstance(strategy, dict) else "strategy"
                raise TypeError(
                    f"{where} must be a hypothesis strategy (or a dict of them), got {type(value).__name__} instead."
                )
    if strategy is None:
        scenarios = entry.strategy(rst._dtypes(rst._FLOAT_DTYPES if dtypes is None else dtypes))
    elif dtypes is not None:
        raise ValueError("dtypes must be None when a strategy is given, got both instead (set the dtypes "
                         "in the strategy).")
    elif isinstance(strategy, dict):
        scenarios = dict(strategy)
    else:
        scenarios = {"": strategy}
    parent = settings if settings is not None else hsettings()  # the current profile
    per_scenario = max(1, -(-max_examples // max(1, len(scenarios))))
    run_settings = hsettings(
        parent,
        max_examples=per_scenario,
        deadline=None,
        report_multiple_bugs=False,
        phases=tuple(p for p in parent.phases if p is not Phase.explain),
        suppress_health_check=tuple(parent.suppress_health_check)
        + (HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much),
    )
    tally: dict[str, Any] = {"examples": 0, "unchecked": set()}
    for label, cases in scenarios.items():
        _run_scenario(entry, candidate, cases, label, run_settings, convert, rtol, atol, tie_break, tally)
    return ConformanceReport(
        name=entry.name,
        scenarios=tuple(scenarios),
        examples=tally["examples"],
        unchecked=tuple(sorted(tally["unchecked"])),
    )


def _run_scenario(entry, candidate, cases, label, run_settings, convert, rtol, atol, tie_break, tally):
    __tracebackhide__ = True

    @run_settings
    @given(cases)
    def conformance(case):
        __tracebackhide__ = True
        unchecked = _run_one(entry, candidate, _coerce_case(case, entry), convert, rtol, atol, tie_break, label)
        tally["examples"] += 1
        tally["unchecked"].update(unchecked)

    # Each scenario gets its own database key and, when derandomized, a seed that depends
    # only on the quantity and the scenario (not on the kit's source code).
    key = f"refgeo.testing/{entry.name}/{label}".encode()
    conformance.hypothesis.inner_test._hypothesis_internal_add_digest = key
    if run_settings.derandomize:
        conformance = hseed(int.from_bytes(hashlib.sha256(key).digest()[:8], "big"))(conformance)
    conformance()


def _entry(name: str) -> Reference:
    if not isinstance(name, str):
        raise TypeError(f"name must be a string, got {type(name).__name__} instead.")
    entry = _REGISTRY.get(name)
    if entry is None:
        raise ValueError(f"name must be one of {reference_names()}, got {name!r} instead.")
    return entry


def signature(name: str) -> str:
    """How ``check_against_reference`` calls a candidate for ``name``, and what it expects back.

    Parameters
    ----------
    name : str
        A quantity of :func:`reference_names`.

    Returns
    -------
    str
        The call and the expected return, as one line.

    Examples
    --------
    >>> from refgeo.testing import signature
    >>> signature("row_diameter")
    'candidate(S) -> (value, i, j) or an object with .value, .i, .j (i < j)'
    """
    return _entry(name).signature
