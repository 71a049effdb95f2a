"""The verification kit (refgeo.testing): it passes correct kernels and catches planted bugs.

Each planted bug is a small, realistic mistake in a candidate kernel; the kit must
report it as a ConformanceError (an AssertionError) naming the inputs, the expected and
received values and the tolerance.  Correct candidates, including refgeo's own fast
paths, must pass.  max_examples stays small (50) to keep the module fast.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import refgeo
from refgeo import testing as rt
from refgeo.testing import ConformanceError, check_against_reference
from refgeo.testing import strategies as rst

N = 50  # examples per conformance run

pytest_plugins = ["pytester"]


def _caught(candidate, name, **kwargs) -> ConformanceError:
    kwargs.setdefault("max_examples", N)
    with pytest.raises(ConformanceError) as info:
        check_against_reference(candidate, name, **kwargs)
    return info.value


# --------------------------------------------------------------------------- candidates
# Small NumPy kernels written the way users write theirs.


def _pairs(n):
    return np.triu_indices(n, k=1)


def direct_extreme(S, *, maximize=True, dtype=np.float64):
    """Direct differences, first extreme in (i, j) order (refgeo's tie rule)."""
    X = np.asarray(S, dtype=dtype)
    i, j = _pairs(len(X))
    D = np.sqrt(((X[i] - X[j]) ** 2).sum(axis=1))
    k = int(np.argmax(D) if maximize else np.argmin(D))
    return float(D[k]), int(i[k]), int(j[k])


def gram_extreme(S, *, maximize=True, dtype=np.float64, center=True):
    """The Gram identity |x|^2 + |y|^2 - 2 x.y in ``dtype``."""
    X = np.asarray(S, dtype=dtype)
    if center:
        X = X - X.mean(axis=0)
    sq = (X * X).sum(axis=1)
    i, j = _pairs(len(X))
    D2 = sq[i] + sq[j] - 2 * (X @ X.T)[i, j]
    D = np.sqrt(np.maximum(D2, 0))
    k = int(np.argmax(D) if maximize else np.argmin(D))
    return float(D[k]), int(i[k]), int(j[k])


def direct_knn(X, k, *, dtype=np.float64, reverse_ties=False):
    A = np.asarray(X, dtype=dtype)
    D = np.sqrt(((A[:, None, :] - A[None, :, :]) ** 2).sum(axis=-1))
    np.fill_diagonal(D, np.inf)
    cols = np.arange(len(A))
    if reverse_ties:  # among equal distances the larger index first
        idx = np.stack([np.lexsort((-cols, row))[:k] for row in D])
    else:
        idx = np.argsort(D, axis=1, kind="stable")[:, :k]
    return idx, np.take_along_axis(D, idx, axis=1)


def logit_distance(z, w):
    d = np.asarray(w, dtype=np.float64) - np.asarray(z, dtype=np.float64)
    return d.max(axis=-1) - d.min(axis=-1)


# --------------------------------------------------------------------------- correct kernels pass


@pytest.mark.parametrize(
    "name, candidate",
    [
        ("row_diameter", direct_extreme),
        ("closest_pair", lambda S: direct_extreme(S, maximize=False)),
        ("knn", direct_knn),
        ("hilbert_distance_logits", logit_distance),
    ],
    ids=["diameter", "closest", "knn", "logits"],
)
def test_correct_numpy_kernels_pass(name, candidate):
    check_against_reference(candidate, name, max_examples=N)


def test_input_precision_kernels_pass_with_certified_tolerance():
    # Direct differences in float32 on float32 rows, and a centered float64 Gram
    # diameter, are inside the documented tolerance.
    f32 = rst.row_clouds(dtypes="float32")
    check_against_reference(lambda S: direct_extreme(S, dtype=np.asarray(S).dtype), "row_diameter", strategy=f32,
                            max_examples=N)
    check_against_reference(lambda S: direct_extreme(S, maximize=False, dtype=np.asarray(S).dtype),
                            "closest_pair", strategy=f32, max_examples=N)
    check_against_reference(gram_extreme, "row_diameter", max_examples=N)


def _float32_logits(z, w):
    d = np.asarray(w, dtype=np.float32) - np.asarray(z, dtype=np.float32)
    return d.max(axis=-1) - d.min(axis=-1)  # float32 result


def _float32_pdist(X):
    X = np.asarray(X, dtype=np.float32)
    i, j = _pairs(len(X))
    d = X[j] - X[i]
    return d.max(axis=1) - d.min(axis=1)


def test_float32_hilbert_kernels_pass_with_the_documented_bound():
    f32 = rst.logit_pairs(dtypes="float32")
    check_against_reference(_float32_logits, "hilbert_distance_logits", strategy=f32, max_examples=N)
    check_against_reference(_float32_pdist, "pdist_hilbert", strategy=rst.logits(n_rows=(1, 6), dtypes="float32"),
                            max_examples=N)


@pytest.mark.parametrize(
    "name",
    [
        "hilbert_distance_logits",
        "hilbert_distance",
        "pdist_hilbert",
        "cdist_hilbert",
        "row_diameter",
        "closest_pair",
        "farthest_partners",
        "knn",
    ],
)
def test_refgeo_fast_paths_pass(name, backend):
    # refgeo's public functions on every available backend (the compiled engine where
    # built) are candidates like any other; the oracle always runs on "reference".
    if backend == "reference":
        pytest.skip("the reference backend is the oracle itself")
    fn = getattr(refgeo, name)
    used = set()

    def candidate(*args, **kwargs):
        out = fn(*args, **kwargs)
        used.add(getattr(out, "backend", None))
        return out

    check_against_reference(candidate, name, max_examples=N)
    if name in ("row_diameter", "closest_pair") and backend == "cython":
        assert "cython" in used  # the compiled engine was really exercised


@pytest.mark.parametrize("name", ["row_diameter", "knn", "hilbert_distance"])
def test_refgeo_array_api_reference_passes(name):
    # refgeo's reference code on array-api-strict arrays (DLPack on the way back).
    xps = pytest.importorskip("array_api_strict")
    fn = getattr(refgeo, name)
    check_against_reference(lambda *a, **k: fn(*a, **k), name, convert=xps.asarray, max_examples=30)


# --------------------------------------------------------------------------- planted bugs


def test_catches_off_by_one_index():
    def off_by_one(S):
        v, i, j = direct_extreme(S)
        return v, i, j - 1 if j - 1 > i else j + 1

    err = _caught(off_by_one, "row_diameter", strategy=rst.row_clouds(n_rows=(3, 8)))
    assert "pair" in err.reason


def test_catches_off_by_one_knn_index():
    def off_by_one(X, k):
        idx, dist = direct_knn(X, k)
        return idx + 1, dist

    err = _caught(off_by_one, "knn")
    assert "out of range" in err.reason or "own neighbor" in err.reason or "rank" in err.reason


def farthest_numpy(S):
    X = np.asarray(S, dtype=np.float64)
    D = np.sqrt(((X[:, None, :] - X[None, :, :]) ** 2).sum(axis=-1))
    np.fill_diagonal(D, -np.inf)
    idx = D.argmax(axis=1)
    return idx, D[np.arange(len(X)), idx]


def test_farthest_partners_kernel_and_its_off_by_one():
    check_against_reference(farthest_numpy, "farthest_partners", max_examples=N)

    def off_by_one(S):
        idx, dist = farthest_numpy(S)
        return (idx + 1) % len(idx), dist

    err = _caught(off_by_one, "farthest_partners")
    assert err.reason.startswith("row ")


def test_farthest_partners_of_the_wrong_shape_are_refused():
    """Both outputs were flattened before their shapes were compared: (V, 1), (1, V) and
    (2, V / 2) results "agreed" with refgeo's (V,)."""
    for shape in ((-1, 1), (1, -1)):
        err = _caught(lambda S, shape=shape: tuple(a.reshape(shape) for a in farthest_numpy(S)), "farthest_partners")
        assert err.reason.startswith("indices and distances must have shape (")


def test_knn_indices_without_distances_are_reported_unchecked():
    """A k-NN candidate returning (indices, None) was reported with nothing unchecked."""
    report = check_against_reference(lambda X, k: (direct_knn(X, k)[0], None), "knn", max_examples=16)
    assert report.unchecked == ("distances",)
    assert check_against_reference(direct_knn, "knn", max_examples=16).unchecked == ()


def test_catches_missing_centering():
    # float64 Gram identity without centering: exact on centered data, wrong by the
    # cancellation of |x|^2 ~ offset^2 on rows sharing a large offset.
    err = _caught(lambda S: gram_extreme(S, center=False), "row_diameter",
                  strategy=rst.row_clouds(dtypes="float64", structures=("generic", "offset")))
    assert np.max(np.abs(err.inputs["S"])) > 10.0  # the shrunk example kept the offset
    # The same kernel with centering passes on the same inputs.
    check_against_reference(gram_extreme, "row_diameter", max_examples=N,
                            strategy=rst.row_clouds(dtypes="float64", structures=("generic", "offset")))


def test_catches_float32_gram_trick_on_offset_rows():
    def naive(S):
        return gram_extreme(S, dtype=np.float32, center=False)

    err = _caught(naive, "row_diameter", strategy=rst.row_clouds(dtypes="float32", structures=("offset",)))
    assert err.inputs["S"].dtype == np.float32
    assert "differs from the reference" in err.reason or "not an extreme pair" in err.reason


def test_catches_float32_gram_trick_closest_pair_even_when_centered():
    err = _caught(lambda S: gram_extreme(S, maximize=False, dtype=np.float32), "closest_pair",
                  strategy=rst.row_clouds(dtypes="float32"))
    assert err.name == "closest_pair"


def test_catches_wrong_tie_breaking():
    def last_of_ties(S):
        X = np.asarray(S, dtype=np.float64)
        i, j = _pairs(len(X))
        D = np.sqrt(((X[i] - X[j]) ** 2).sum(axis=1))
        k = len(D) - 1 - int(np.argmax(D[::-1]))  # last maximum
        return float(D[k]), int(i[k]), int(j[k])

    err = _caught(last_of_ties, "row_diameter")
    assert err.reason.startswith("wrong tie-breaking")
    # Accepting any tied pair is an explicit choice.
    check_against_reference(last_of_ties, "row_diameter", tie_break="any", max_examples=N)


def test_rounded_tie_is_not_an_exact_tie():
    # Rows 1.1e-16 apart: the refined float64 distances of (0, 3) and (1, 3) both round
    # to 1.0, so refgeo's rule returns (0, 3); a centered Gram kernel finds (1, 3) at
    # 1.0000000000000002, the farther pair in exact arithmetic (1 + 2**-53).  Either
    # value for (1, 3) is within the tolerance.  Rows 0 and 2 are equal: (2, 3) ties
    # (0, 3) exactly, and returning it breaks the rule whatever value comes with it.
    S = np.array([[0.0], [2.0**-53], [0.0]] + [[-1.0]] * 5)
    ref = refgeo.row_diameter(S)
    assert (ref.i, ref.j, ref.value) == (0, 3, 1.0)
    rt.assert_extreme_pair_close(np.nextafter(1.0, 2.0), 1, 3, ref, S)
    rt.assert_extreme_pair_close(1.0, 1, 3, ref, S)
    for value in (1.0, np.nextafter(1.0, 2.0)):
        with pytest.raises(ConformanceError, match=re.escape("wrong tie-breaking: the pairs (2, 3) and (0, 3)")):
            rt.assert_extreme_pair_close(value, 2, 3, ref, S)


def test_exact_ties_a_float_kernel_rounds_apart_accept_either_pair():
    """Rows 1 and 2 hold the same entries at permuted coordinates, so (0, 1) and (0, 2)
    tie exactly; refgeo's refined sum ((a + b) + (c + d)) rounds them equally, the
    module docstring's own direct-difference kernel (((a + b) + c) + d) puts (0, 2) 1 ulp
    above, and it was reported as "wrong tie-breaking".  Ties of small integers, which
    no order of computation rounds, still follow the rule."""
    S = np.zeros((3, 4))
    v = np.array([-0.9, 0.01, 0.04, -0.47])
    S[1], S[2] = v, v[[0, 1, 3, 2]]
    ref = refgeo.row_diameter(S)
    assert (ref.i, ref.j) == (0, 1)
    d1, d2 = (math.sqrt(((S[0] - S[r]) ** 2).sum()) for r in (1, 2))  # NumPy sums left to right at d = 4
    assert d2 > d1  # the kernel's rounding orders the exact tie
    rt.assert_extreme_pair_close(d2, 0, 2, ref, S)
    # the closest pair of 0, M, 2M: (0, 1) and (1, 2) tie exactly; with M = 3 every
    # kernel computes both exactly (the rule holds), with M = 2**30 + 1 and d = 1 a square
    # is beyond float64's 53 bits (4 d M**2 > 2**53 for the largest entry, 2M)
    for M, enforced in ((3.0, True), (2.0**30 + 1.0, False), (2.0**25, True)):
        S = np.array([[0.0], [M], [2.0 * M]])
        ref = refgeo.closest_pair(S)
        assert (ref.i, ref.j, ref.value) == (0, 1, M)
        if enforced:
            with pytest.raises(ConformanceError, match="wrong tie-breaking"):
                rt.assert_extreme_pair_close(M, 1, 2, ref, S)
        else:
            rt.assert_extreme_pair_close(M, 1, 2, ref, S)


def test_ties_between_duplicated_rows_follow_the_rule_whatever_the_entries():
    """Pairs of the same two rows (one row duplicated) tie for every kernel, whatever
    their entries: the rule for rows no order rounds left them out, and a wrong pair
    passed."""
    rng = np.random.default_rng(0)
    S = rng.standard_normal((6, 5))
    first = refgeo.row_diameter(S)
    S[5] = S[first.i]  # (i, j) and (j, 5) hold the same two rows
    ref = refgeo.row_diameter(S)
    assert (ref.i, ref.j) == (first.i, first.j)
    with pytest.raises(ConformanceError, match="wrong tie-breaking"):
        rt.assert_extreme_pair_close(ref.value, min(ref.j, 5), max(ref.j, 5), ref, S)
    X = rng.standard_normal((8, 4))
    X[5] = X[2]
    knn = refgeo.knn(X, 3)
    row = [r for r in range(8) if r not in (2, 5) and 2 in knn.indices[r].tolist()][0]
    swapped = knn.indices.copy()
    swapped[row] = [5 if v == 2 else v for v in knn.indices[row].tolist()]
    if 5 in knn.indices[row].tolist():
        swapped[row] = [2 if v == 5 else 5 if v == 2 else v for v in knn.indices[row].tolist()]
    with pytest.raises(ConformanceError, match="wrong tie-breaking"):
        rt.assert_knn_close(swapped, None, knn, X)


def test_knn_exact_ties_a_float_kernel_rounds_apart_accept_either_order():
    """The k-NN form of the case above: neighbors 1 and 2 of row 0 tie exactly at
    permuted coordinates of non-dyadic entries; listing 2 first is accepted, and among
    small integers it is not."""
    v = np.array([-0.9, 0.01, 0.04, -0.47])
    X = np.stack([np.zeros(4), v, v[[0, 1, 3, 2]], 5.0 * np.ones(4)])
    ref = refgeo.knn(X, 2)
    assert ref.indices[0].tolist() == [1, 2]
    rest = ref.indices[1:].tolist()
    rt.assert_knn_close([[2, 1]] + rest, None, ref, X)
    Xi = np.stack([np.zeros(4), np.array([1.0, 0, 2, 0]), np.array([1.0, 0, 0, 2]), 5.0 * np.ones(4)])
    ref = refgeo.knn(Xi, 2)
    with pytest.raises(ConformanceError, match=re.escape("wrong tie-breaking in row 0")):
        rt.assert_knn_close([[2, 1]] + ref.indices[1:].tolist(), None, ref, Xi)


def test_knn_rounded_tie_is_not_an_exact_tie():
    # Row 0's candidates 1, 2 and 3 are at refined squared distance 1.0, but 2 is
    # exactly at 1 + 2**-54 (farther; it rounds to 1): listing it after 3, in exact
    # order, is allowed; listing 3 (an exact twin of 1) before 1 is not
    X = np.array([[0.0, 0.0], [1.0, 0.0], [1.0, 2.0**-27], [1.0, 0.0], [5.0, 0.0]])
    ref = refgeo.knn(X, 3)
    assert ref.indices[0].tolist() == [1, 2, 3]  # the refined values tie: by index
    rest = ref.indices[1:].tolist()
    rt.assert_knn_close([[1, 3, 2]] + rest, None, ref, X)
    with pytest.raises(ConformanceError, match=re.escape("wrong tie-breaking in row 0")):
        rt.assert_knn_close([[3, 1, 2]] + rest, None, ref, X)


def test_a_wrong_neighbor_is_reported_with_plain_numbers():
    """The reference's distance was printed as ``np.float64(0.0)`` (its repr under
    NumPy 2) in the middle of the message."""
    X = np.array([[0.0, 0.0], [0.0, 0.0], [3.0, 0.0], [7.0, 0.0]])
    ref = refgeo.knn(X, 1)
    wrong = ref.indices.copy()
    wrong[0, 0] = 2  # at distance 3, where the reference's neighbor is at 0
    with pytest.raises(ConformanceError, match=re.escape("at that rank is at 0.0 (difference 3 >")) as info:
        rt.assert_knn_close(wrong, None, ref, X)
    assert "np.float64" not in str(info.value)


def test_catches_wrong_knn_tie_breaking():
    err = _caught(lambda X, k: direct_knn(X, k, reverse_ties=True), "knn")
    assert err.reason.startswith("wrong tie-breaking")
    check_against_reference(lambda X, k: direct_knn(X, k, reverse_ties=True), "knn", tie_break="any",
                            max_examples=N)


def test_catches_probabilities_that_ignore_support():
    def eps_smoothed(p, q):  # the common "add 1e-12" shortcut: finite where it must be inf
        lr = np.log(np.asarray(p, np.float64) + 1e-12) - np.log(np.asarray(q, np.float64) + 1e-12)
        return lr.max(axis=-1) - lr.min(axis=-1)

    err = _caught(eps_smoothed, "hilbert_distance")
    assert "distance" in err.reason


def test_catches_softmax_round_trip_on_extreme_logits():
    def via_probabilities(z, w):  # underflows for logits of size 1e4
        def softmax(x):
            e = np.exp(x - x.max(axis=-1, keepdims=True))
            return e / e.sum(axis=-1, keepdims=True)

        with np.errstate(divide="ignore", invalid="ignore"):
            lr = np.log(softmax(np.asarray(w, np.float64))) - np.log(softmax(np.asarray(z, np.float64)))
        return lr.max(axis=-1) - lr.min(axis=-1)

    _caught(via_probabilities, "hilbert_distance_logits")


def test_catches_a_kernel_that_ignores_strides():
    def raw_buffer(X):  # reads the underlying buffer as if it were C-contiguous
        X = np.asarray(X)
        base = X if X.base is None else X.base
        flat = np.asarray(base).reshape(-1)[: X.size].reshape(X.shape)
        i, j = _pairs(len(X))
        d = flat[j].astype(np.float64) - flat[i]
        return d.max(axis=1) - d.min(axis=1)

    err = _caught(raw_buffer, "pdist_hilbert")
    assert "strided" in str(err) or "Fortran" in str(err)


def test_catches_in_place_modification():
    def centers_in_place(S):
        S -= S.mean(axis=0)
        return direct_extreme(S)

    err = _caught(centers_in_place, "row_diameter")
    assert "modified its input" in err.reason


def test_candidate_exceptions_become_conformance_errors():
    def fails_on_one_column(S):
        if np.asarray(S).shape[1] == 1:
            raise RuntimeError("d == 1 is not supported")
        return direct_extreme(S)

    err = _caught(fails_on_one_column, "row_diameter")
    assert "RuntimeError" in err.reason
    assert isinstance(err.__cause__, RuntimeError)


def test_wrong_shape_and_nan_are_reported():
    err = _caught(lambda z, w: logit_distance(z, w)[..., None], "hilbert_distance_logits")
    assert "shape" in err.reason
    err = _caught(lambda z, w: np.full(np.shape(z)[:-1], np.nan), "hilbert_distance_logits")
    assert "nan" in err.reason


# --------------------------------------------------------------------------- LMO and optimizer


def _rn(B, eps=0.0):
    n = np.sqrt((B * B).sum(axis=1, keepdims=True)) + eps
    return np.where(n > 0, B / np.where(n > 0, n, 1.0), 0.0)


def rownorm_numpy(W0, grads, *, lr, mu, eps, bias_correction=True, eps_inside_sqrt=False, dtype=None):
    """A user's RowNorm loop; ``dtype`` = working precision (default: float64)."""
    dt = np.dtype(dtype or np.float64)
    W = np.array(W0, copy=True)
    B = np.zeros(W.shape, dtype=dt)
    out = []
    for t, g in enumerate(np.asarray(grads), start=1):
        B = dt.type(mu) * B + dt.type(1 - mu) * g.astype(dt)
        Bh = B / dt.type(1 - mu**t) if bias_correction else B
        if eps_inside_sqrt:
            n = np.sqrt((Bh * Bh).sum(axis=1, keepdims=True) + dt.type(eps))
            S = np.where(n > 0, Bh / np.where(n > 0, n, 1), 0)
        else:
            S = _rn(Bh, dt.type(eps))
        W = W - (lr * S).astype(W.dtype)
        out.append(W.copy())
    return np.stack(out)


def refgeo_rownorm(W0, grads, *, lr, mu, eps):
    W = np.array(W0, copy=True)
    opt = refgeo.RowNorm(lr=lr, mu=mu, eps=eps)
    return [opt.step(W, g).copy() for g in grads]


def projected_rownorm_numpy(G, *, eta, inner=True, outer=True, scale_safe=False):
    """A user's projected RowNorm, written as practitioners write it: ``b / sqrt(sum(b**2))``.

    The textbook normalization squares the entries, so a row of norm below
    sqrt(tiny) (1.5e-154 in float64) comes out as zero instead of a unit direction.
    That is a property of the formula, not a bug worth failing a user's CI over:
    gradients of real LM heads are never that small in float64.  So the kit keeps its
    exact tolerance (the reference is right: a nonzero row has a unit direction) and
    draws gradients whose size is explicit (``scales`` of the gradient strategies,
    1 down to 1e-12 by default) instead of letting hypothesis shrink a whole gradient
    to 1e-258.  Users who need the kernel to be safe at any size ask for tiny scales,
    as ``test_naive_rownorm_underflow_is_caught_when_asked`` does; ``scale_safe=True``
    divides each row by its largest entry first and passes there too.
    """
    G = np.asarray(G, dtype=np.float64)
    B = G - G.mean(axis=0) if inner else G
    if scale_safe:
        top = np.abs(B).max(axis=1, keepdims=True)
        B = np.where(top > 0, B / np.where(top > 0, top, 1.0), 0.0)
    N = _rn(B)
    return -(eta / 2) * (N - N.mean(axis=0) if outer else N)


def test_lmo_and_optimizer_fast_paths_pass():
    check_against_reference(lambda G, eta: refgeo.projected_rownorm(G, eta=eta), "projected_rownorm", max_examples=N)
    check_against_reference(refgeo_rownorm, "rownorm_step", max_examples=N)


def test_correct_user_rownorm_kernels_pass():
    check_against_reference(projected_rownorm_numpy, "projected_rownorm", max_examples=N)
    check_against_reference(rownorm_numpy, "rownorm_step", max_examples=N)
    # Working in float32 throughout is inside the tolerance for float32 parameters.
    check_against_reference(lambda W0, g, **kw: rownorm_numpy(W0, g, dtype=np.float32, **kw), "rownorm_step",
                            strategy=_rownorm_cases("float32"), max_examples=N)


def test_naive_rownorm_underflow_is_caught_when_asked():
    # Gradients of size 2**-600 (~2.4e-181): squares underflow in float64.
    @st.composite
    def tiny(draw):
        G = draw(rst.centered_gradients(dtypes="float64", structures=("rank_one", "sparse"), scales=(2.0**-600,)))
        return rt.Case(args=(G,), names=("G",), kwargs={"eta": 1.0})

    err = _caught(projected_rownorm_numpy, "projected_rownorm", strategy=tiny())
    assert "step entry" in err.reason
    check_against_reference(lambda G, eta: projected_rownorm_numpy(G, eta=eta, scale_safe=True), "projected_rownorm",
                            strategy=tiny(), max_examples=N)


def test_gradient_sizes_follow_scales():
    # The overall size of a drawn gradient is the requested scale, whatever the float draw.
    @settings(max_examples=30)
    @given(rst.centered_gradients(scales=(2.0**-100, 1.0)))
    def run(G):
        top = float(np.abs(G).max())
        assert top == 0.0 or 0.5 <= top < 1.0 or 2.0**-101 <= top < 2.0**-100

    run()


def _rownorm_cases(dtype, scales=(1.0, 2.0**-20, 2.0**-27, 2.0**-30)):
    @st.composite
    def cases(draw):
        grads = draw(rst.gradient_sequences(dtypes=dtype, scales=scales))
        W0 = draw(rst.row_clouds(n_rows=grads.shape[1], n_cols=grads.shape[2], dtypes=dtype, layouts="C"))
        kw = {"lr": 0.02, "mu": 0.95, "eps": 1e-8}
        return rt.Case(args=(W0, grads), names=("W0", "grads"), kwargs=kw)

    return cases()


def test_catches_rownorm_without_bias_correction():
    err = _caught(lambda W0, g, **kw: rownorm_numpy(W0, g, bias_correction=False, **kw), "rownorm_step")
    assert err.reason.startswith("step ")
    # Also in float32, where eps only matters for small gradients (1e-8 here).
    _caught(lambda W0, g, **kw: rownorm_numpy(W0, g, bias_correction=False, dtype=np.float32, **kw),
            "rownorm_step", strategy=_rownorm_cases("float32", scales=(2.0**-27,)))


def test_catches_rownorm_eps_inside_the_square_root():
    _caught(lambda W0, g, **kw: rownorm_numpy(W0, g, eps_inside_sqrt=True, **kw), "rownorm_step")


@pytest.mark.parametrize("inner, outer", [(False, True), (True, False)], ids=["no_inner_P", "no_outer_P"])
def test_catches_projected_rownorm_without_centering(inner, outer):
    _caught(lambda G, eta: projected_rownorm_numpy(G, eta=eta, inner=inner, outer=outer), "projected_rownorm")


@settings(max_examples=40)
@given(rst.gradient_sequences(), st.sampled_from([0.02, 1.0]), st.sampled_from([0.95, 0.5]),
       st.sampled_from([1e-8, 0.0]))
def test_spec_rownorm_reference_agrees_with_refgeo_optim(grads, lr, mu, eps):
    # The kit's transcription of docs/theory/lmo.md and refgeo.optim.RowNorm are independent codes.
    W0 = np.linspace(-1, 1, grads.shape[1] * grads.shape[2]).reshape(grads.shape[1:]).astype(grads.dtype)
    spec = rt.rownorm_reference_steps(W0, grads, lr=lr, mu=mu, eps=eps)
    ours = np.stack(refgeo_rownorm(W0, grads, lr=lr, mu=mu, eps=eps))
    u = np.finfo(grads.dtype).eps
    np.testing.assert_allclose(ours, spec, rtol=0, atol=8 * u * (1 + lr) * grads.shape[0])


# --------------------------------------------------------------------------- tokenwise


def diagonal_fit_numpy(X, Y, neighbors, *, lam, prior=1.0, self_included=False):
    X = np.asarray(X, dtype=np.float64)
    Y = np.asarray(Y, dtype=np.float64)
    nb = np.asarray(neighbors)
    if self_included:  # a classic leak: the token's own pair in its neighborhood
        nb = np.concatenate([np.arange(len(X))[:, None], nb[:, :-1]], axis=1)
    num = (X[nb] * Y[nb]).sum(axis=1) + lam * prior
    den = (X[nb] ** 2).sum(axis=1) + lam
    a = np.where(den > 0, num / np.where(den > 0, den, 1.0), 1.0)
    return a * X


def test_local_diagonal_fit_passes_refgeo_and_numpy():
    check_against_reference(
        lambda X, Y, nb, lam: refgeo.fit_local_maps(X, Y, neighbors=nb, cls="diagonal", ridge=lam).fitted,
        "local_diagonal_fit", max_examples=N)
    check_against_reference(diagonal_fit_numpy, "local_diagonal_fit", max_examples=N)


@pytest.mark.parametrize("bug", [{"prior": 0.0}, {"self_included": True}], ids=["zero_prior", "self_included"])
def test_catches_local_fit_bugs(bug):
    _caught(lambda X, Y, nb, lam: diagonal_fit_numpy(X, Y, nb, lam=lam, **bug), "local_diagonal_fit")


# --------------------------------------------------------------------------- pinned regressions
# Minimal examples the kit found (see docs/testing.md), kept as fixed cases.

PINNED_ROWS = [
    pytest.param(np.array([[10000.0], [10001.0]], dtype=np.float32), True, id="offset-1e4"),
    pytest.param(np.array([[100.96875], [100.0]], dtype=np.float32), True, id="offset-1e2"),
    pytest.param(np.array([[1.0], [1.0000001]], dtype=np.float32), True, id="one-ulp"),
    pytest.param(np.array([[0.734375], [0.0], [0.75]], dtype=np.float32), False, id="closest-after-centering"),
]


@pytest.mark.parametrize("S, diameter", PINNED_ROWS)
def test_pinned_gram_failures(S, diameter):
    ref = refgeo.row_diameter(S) if diameter else refgeo.closest_pair(S)
    if diameter:  # no centering
        naive = gram_extreme(S, dtype=np.float32, center=False)
    else:  # rows centered in float64, then the float32 Gram identity
        S64 = S.astype(np.float64)
        naive = gram_extreme(S64 - S64.mean(axis=0), maximize=False, dtype=np.float32, center=False)
    with pytest.raises(ConformanceError):
        rt.assert_extreme_pair_close(*naive, ref, S)
    rt.assert_extreme_pair_close(*direct_extreme(S, maximize=diameter, dtype=np.float32), ref, S)


def test_pinned_rownorm_without_bias_correction():
    W0, G = np.zeros((2, 1)), np.array([[[-0.5], [0.5]]])
    kw = {"lr": 0.02, "mu": 0.95, "eps": 1e-8}
    rt.assert_rownorm_steps_close(rownorm_numpy(W0, G, **kw), W0, G, **kw)
    with pytest.raises(ConformanceError, match=re.escape("step 1: parameter at index (0, 0, 0)")):
        rt.assert_rownorm_steps_close(rownorm_numpy(W0, G, bias_correction=False, **kw), W0, G, **kw)


def test_rownorm_steps_of_uncentered_gradients_are_the_reference_steps():
    """The assertion's oracle and rownorm_reference_steps are the same formula on
    gradients whose rows do not sum to zero (the oracle centered them, and refused the
    kit's own reference steps); an implementation that centers them is caught."""
    rng = np.random.default_rng(0)
    W0, G = rng.standard_normal((5, 4)), rng.standard_normal((4, 5, 4))
    kw = {"lr": 0.1, "mu": 0.9, "eps": 1e-8}
    rt.assert_rownorm_steps_close(rt.rownorm_reference_steps(W0, G, **kw), W0, G, **kw)
    centering = rt.rownorm_reference_steps(W0, G - G.mean(axis=1, keepdims=True), **kw)
    with pytest.raises(ConformanceError, match="step 1"):
        rt.assert_rownorm_steps_close(centering, W0, G, **kw)


def test_float32_gradients_do_not_loosen_the_tolerance_of_float64_parameters():
    """The tolerance is the parameter dtype's, as documented: with float64 parameters and
    float32 gradients it took the float32 roundoff, and steps taken wholly in float32
    (1e-7 off) passed; the oracle runs in float64 there and the same steps fail."""
    rng = np.random.default_rng(0)
    W0, g32 = rng.standard_normal((3, 4)), rng.standard_normal((5, 3, 4)).astype(np.float32)
    kw = {"lr": 0.01, "mu": 0.95, "eps": 1e-8}
    in_float32 = rt.rownorm_reference_steps(W0.astype(np.float32), g32, **kw).astype(np.float64)
    with pytest.raises(ConformanceError, match="step 1"):
        rt.assert_rownorm_steps_close(in_float32, W0, g32, **kw)
    rt.assert_rownorm_steps_close(rt.rownorm_reference_steps(W0, g32.astype(np.float64), **kw), W0, g32, **kw)


def test_a_coarser_result_does_not_loosen_the_logit_tolerance():
    """A float16 result of float64 logits was allowed 2**-11 relative (the output's
    roundoff), and a kernel computing in float16 throughout passed 3 rows of 4; the
    tolerance is now the input's.  A float32 kernel on float32 logits still passes."""
    rng = np.random.default_rng(0)
    z, w = rng.standard_normal((4, 50)), rng.standard_normal((4, 50))

    def in_float16(z, w):
        d = w.astype(np.float16) - z.astype(np.float16)
        return d.max(axis=-1) - d.min(axis=-1)

    with pytest.raises(ConformanceError, match="exceeds the tolerance"):
        rt.assert_hilbert_logits_close(in_float16(z, w), z, w)
    with pytest.raises(ConformanceError, match="exceeds the tolerance"):
        rt.assert_hilbert_logits_close(refgeo.hilbert_distance_logits(z, w).astype(np.float16), z, w)
    z32, w32 = z.astype(np.float32), w.astype(np.float32)
    d = w32 - z32
    rt.assert_hilbert_logits_close(d.max(axis=-1) - d.min(axis=-1), z32, w32)
    rt.assert_hilbert_logits_close(refgeo.hilbert_distance_logits(z32, w32).astype(np.float32), z32, w32)


def test_a_float32_kernel_may_return_float64_logit_distances():
    """The last subtraction of a float32 kernel rounds in float32 whatever dtype it
    returns; the tolerance took the returned dtype's roundoff for it, so the same values
    passed as float32 and failed as float64 (2.86e-6 against 2.08e-6 here, and one
    random input in 12), in every logit helper."""
    z = np.array([[-4.3686833, 5.198417, -4.7657905, 13.8898]], dtype=np.float32)
    w = np.array([[3.5145507, -4.74333, -19.44265, -13.077532]], dtype=np.float32)
    d = w - z
    r = d.max(axis=-1) - d.min(axis=-1)  # in float32
    exact = float(np.max(w.astype(np.float64) - z) - np.min(w.astype(np.float64) - z))
    assert abs(float(r[0]) - exact) > 2.0**-53 * exact + 2.0**-24 * (abs(d.max()) + abs(d.min()))
    for result in (r, r.astype(np.float64)):
        rt.assert_hilbert_logits_close(result, z, w)
    X = np.concatenate([z, w])
    D = X[1] - X[0]
    rt.assert_pdist_close(np.array([D.max() - D.min()], dtype=np.float64), X)
    rt.assert_cdist_close(np.array([[D.max() - D.min()]], dtype=np.float64), z, w)


def test_a_coarser_result_does_not_loosen_the_projected_rownorm_tolerance():
    """The tolerance took the coarser roundoff of input and result: a float16 step of a
    float64 gradient passed (2**-11 per entry allowed) and the report called it u_in."""
    G = np.random.default_rng(3).standard_normal((6, 3))
    G -= G.mean(axis=0)
    step = refgeo.projected_rownorm(G)
    with pytest.raises(ConformanceError, match="exceeds the tolerance"):
        rt.assert_projected_rownorm_close(step.astype(np.float16), G)
    with pytest.raises(ConformanceError, match="exceeds the tolerance"):
        rt.assert_projected_rownorm_close(step.astype(np.float32), G)
    rt.assert_projected_rownorm_close(step, G)
    G32 = G.astype(np.float32)
    rt.assert_projected_rownorm_close(refgeo.projected_rownorm(G32).astype(np.float32), G32)


def test_projected_rownorm_tolerance_scales_with_the_columns_not_with_v():
    """The outer mean's rounding was bounded by V u per entry: at V = 8000 a kernel in
    bfloat16 (errors about 3e-4 of eta) passed, as did a step 0.5% too long.  The
    bound is the column's own absolute sum, V a_j u (a_j about 0.1 here); float32 and
    float64 kernels, and a gradient with Zipf-scaled rows, still pass."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    G = rng.standard_normal((8000, 64)).astype(np.float32)
    G -= G.mean(axis=0)

    def kernel(G, dtype):  # -(1/2) P RN(P G), computed in dtype
        g = torch.from_numpy(G).to(dtype)
        g = g - g.mean(0)
        r = g / g.norm(dim=1, keepdim=True)
        return -0.5 * (r - r.mean(0))

    for bad in (kernel(G, torch.bfloat16), kernel(G, torch.float16), 1.005 * kernel(G, torch.float32)):
        with pytest.raises(ConformanceError, match="exceeds the tolerance"):
            rt.assert_projected_rownorm_close(bad, G)
    rt.assert_projected_rownorm_close(kernel(G, torch.float32), G)
    rt.assert_projected_rownorm_close(kernel(G, torch.float64).float(), G)
    Z = (rng.standard_normal((8000, 64)) * np.logspace(0, -3, 8000)[:, None]).astype(np.float32)
    Z -= Z.mean(axis=0)
    rt.assert_projected_rownorm_close(kernel(Z, torch.float32), Z)


def test_distance_helpers_name_bad_inputs():
    """A scalar X was an IndexError from inside assert_pdist_close, and text logits
    NumPy's "could not convert string to float"."""
    w = np.zeros(3)
    cases = [
        (lambda: rt.assert_pdist_close(np.zeros(0), 3.0), ValueError, "X must be a 2-D array of shape (V, d)"),
        (lambda: rt.assert_cdist_close(np.zeros((1, 1)), np.zeros(3), np.zeros((1, 3))), ValueError,
         "XA must be a 2-D array of shape (V, d)"),
        (lambda: rt.assert_hilbert_logits_close(np.zeros(1), "abc", w), TypeError, "z must be a real array"),
        (lambda: rt.assert_hilbert_close(np.zeros(1), np.ones(3) / 3, ["a", "b", "c"]), TypeError,
         "q must be a real array"),
    ]
    for call, kind, msg in cases:
        with pytest.raises(kind, match=re.escape(msg)):
            call()


def test_rownorm_steps_with_a_half_precision_state_are_caught_at_lm_widths():
    """The tolerance allowed every entry its whole row's rounding (2 lr u (d + 4) at
    d = 4096): a RowNorm keeping its momentum in float16 for float32 parameters passed.
    Per entry (its buffer entry's rounding and its share of the norm's) it is caught;
    the same optimizer with a float32 state, plain or lerp momentum, still passes."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    V, d = 64, 4096
    W0 = (0.02 * rng.standard_normal((V, d))).astype(np.float32)
    grads = (1e-3 * rng.standard_normal((2, V, d))).astype(np.float32)
    grads -= grads.mean(axis=1, keepdims=True)

    def steps(state_dtype, lerp=False):
        W, buf, out = torch.from_numpy(W0.copy()), torch.zeros((V, d), dtype=state_dtype), []
        for t, g in enumerate(torch.from_numpy(grads), 1):
            if lerp:
                buf.lerp_(g.to(state_dtype), 1 - 0.95)
            else:
                buf.mul_(0.95).add_(g.to(state_dtype), alpha=1 - 0.95)
            bh = buf / (1 - 0.95**t)
            W -= (0.02 * bh / (bh.norm(dim=1, keepdim=True) + 1e-8)).float()
            out.append(W.clone())
        return torch.stack(out).numpy()

    kw = {"lr": 0.02, "mu": 0.95, "eps": 1e-8}
    for state in (torch.float16, torch.bfloat16):
        with pytest.raises(ConformanceError, match="exceeds the tolerance"):
            rt.assert_rownorm_steps_close(steps(state), W0, grads, **kw)
    rt.assert_rownorm_steps_close(steps(torch.float32), W0, grads, **kw)
    rt.assert_rownorm_steps_close(steps(torch.float32, lerp=True), W0, grads, **kw)


def test_helpers_name_their_bad_arguments():
    """Bad arguments of the helpers were AttributeErrors, failed unpackings, IndexErrors
    and broadcasting errors from deep inside; an empty strategy dict passed having tested
    nothing; a NaN gradient was skipped silently by the written-out RowNorm steps."""
    S = np.random.default_rng(0).standard_normal((6, 3))
    pair, nn = refgeo.row_diameter(S), refgeo.knn(S, 2)
    cases = [
        (lambda: rt.assert_extreme_pair_close(pair.value, pair.i, pair.j, "row_diameter", S), TypeError, "reference_pair"),
        (lambda: rt.assert_extreme_pair_close(pair.value, pair.i, pair.j, pair, S[0]), ValueError, "^S must be a 2-D"),
        (lambda: rt.assert_knn_close(nn.indices, nn.distances, None, S), TypeError, "^reference must"),
        (lambda: rt.assert_knn_close(nn.indices, nn.distances, nn, "x"), TypeError, "^X must be a real"),
        (lambda: rt.assert_knn_close(nn.indices, nn.distances, nn, S, Y=S[:, :2]), ValueError, "^Y must have the 3"),
        (lambda: rt.assert_knn_close(nn.indices, nn.distances, nn, S[:3]), ValueError, "^reference must be the k-NN"),
        (lambda: check_against_reference(lambda z, w: 0.0, "hilbert_distance_logits", strategy={}), ValueError,
         "^strategy must be a hypothesis strategy or a non-empty dict"),
        (lambda: check_against_reference(lambda S: (0.0, 0, 1), "row_diameter", dtypes=3), TypeError,
         "^dtypes must be a dtype or a sequence"),
        (lambda: rt.rownorm_reference_steps(np.ones((3, 2)), np.full((1, 3, 2), np.nan), lr=0.1), ValueError,
         "^grads must contain only finite values"),
        (lambda: rt.rownorm_reference_steps(np.full((3, 2), np.inf), np.ones((1, 3, 2)), lr=0.1), ValueError,
         "^W0 must contain only finite values"),
    ]
    for call, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            call()
    rt.assert_extreme_pair_close(pair.value, pair.i, pair.j, pair, S)
    rt.assert_knn_close(nn.indices, nn.distances, nn, S)
    Y = 1.1 * S + 0.1  # the neighbors as a KNNResult, as fit_local_maps takes them
    fit = refgeo.fit_local_maps(S, Y, neighbors=nn, cls="diagonal")
    rt.assert_local_diagonal_fit_close(fit.fitted, S, Y, nn)
    rt.assert_local_diagonal_fit_close(fit.fitted, S, Y, nn.indices)


# --------------------------------------------------------------------------- the report


def test_report_names_inputs_expected_got_and_tolerance():
    err = _caught(lambda S: gram_extreme(S, dtype=np.float32, center=False), "row_diameter",
                  strategy=rst.row_clouds(dtypes="float32", structures=("offset",)),
                  settings=settings(derandomize=True, database=None))
    assert isinstance(err, AssertionError)
    text = str(err)
    assert text.startswith("candidate disagrees with refgeo's reference for 'row_diameter'")
    for field in ("input S:", "expected:", "got:", "tolerance:", "dtype=float32"):
        assert field in text
    # The shrunk example is small.
    assert err.inputs["S"].shape[0] <= 4


def test_works_inside_a_pytest_test(pytester):
    pytester.makepyfile(
        """
        import numpy as np
        from refgeo.testing import check_against_reference

        def naive(S):
            X = np.asarray(S, dtype=np.float32)
            sq = (X * X).sum(1)
            D2 = sq[:, None] + sq[None, :] - 2 * X @ X.T
            i, j = np.triu_indices(len(X), 1)
            k = int(np.argmax(D2[i, j]))
            return float(np.sqrt(max(D2[i, j][k], 0))), int(i[k]), int(j[k])

        def test_naive():
            check_against_reference(naive, "row_diameter", max_examples=50)
        """
    )
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-q")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*ConformanceError: candidate disagrees*row_diameter*", "*tolerance:*"])


# --------------------------------------------------------------------------- assertion helpers


def test_extreme_pair_near_tie_swap_is_accepted_exact_tie_is_not():
    S = np.array([[0.0, 0.0], [1.0, 0.0], [0.0, np.nextafter(1.0, 2.0)]])
    ref = refgeo.closest_pair(S)  # (0, 1) at 1.0; (0, 2) at 1 + 1 ulp
    assert (ref.i, ref.j) == (0, 1)
    rt.assert_extreme_pair_close(1.0, 0, 2, ref, S)  # near tie: accepted
    S2 = np.array([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    ref2 = refgeo.closest_pair(S2)
    with pytest.raises(ConformanceError, match="wrong tie-breaking"):
        rt.assert_extreme_pair_close(1.0, 0, 2, ref2, S2)
    rt.assert_extreme_pair_close(1.0, 0, 2, ref2, S2, tie_break="any")


def test_extreme_pair_tolerance_is_the_documented_one():
    rng = np.random.default_rng(0)
    S = rng.standard_normal((6, 4)).astype(np.float32)
    ref = refgeo.row_diameter(S)
    u = 2.0**-24
    gamma = lambda m, u: m * u / (1 - m * u)  # noqa: E731
    tol = (2 * gamma(7, u) + gamma(7, 2.0**-53)) * ref.value
    rt.assert_extreme_pair_close(ref.value + 0.99 * tol, ref.i, ref.j, ref, S)
    with pytest.raises(ConformanceError, match="more than the tolerance"):
        rt.assert_extreme_pair_close(ref.value + 1.01 * tol, ref.i, ref.j, ref, S)
    rt.assert_extreme_pair_close(ref.value * 1.1, ref.i, ref.j, ref, S, rtol=0.2)


def test_extreme_pair_rejects_invalid_pairs():
    S = np.array([[0.0], [1.0], [3.0]])
    ref = refgeo.row_diameter(S)
    with pytest.raises(ConformanceError, match=re.escape("the pair (2, 0) is not a valid pair i < j")):
        rt.assert_extreme_pair_close(3.0, 2, 0, ref, S)
    with pytest.raises(ConformanceError, match="not an extreme pair"):
        rt.assert_extreme_pair_close(3.0, 0, 1, ref, S)
    with pytest.raises(ValueError, match=re.escape("tie_break must be one of ('smallest', 'any'), got 'x' instead.")):
        rt.assert_extreme_pair_close(3.0, 0, 2, ref, S, tie_break="x")


def test_pdist_helper_uses_the_float32_bound_of_pdist_hilbert():
    rng = np.random.default_rng(1)
    X = (rng.standard_normal((5, 7)) * 100).astype(np.float32)
    exact = refgeo.pdist_hilbert(X.astype(np.float64))
    got32 = _float32_pdist(X)
    rt.assert_pdist_close(got32, X)  # float32 kernel, float32 output
    rt.assert_pdist_close(refgeo.pdist_hilbert(X, form="square"), X)  # square form
    i, j = _pairs(5)
    d = X[j].astype(np.float64) - X[i]
    # the documented bound, and the last subtraction at the input's precision
    bound = (2.0**-24 * (np.abs(d.max(1)) + np.abs(d.min(1))) + 2.0**-53 * 2 * (np.abs(d.max(1)) + np.abs(d.min(1)))
             + 2.0**-24 * (d.max(1) - d.min(1)))
    k = int(np.argmax(bound))
    bad = exact.copy()
    bad[k] += 1.5 * bound[k]
    with pytest.raises(ConformanceError, match=re.escape(f"condensed distance at index ({k},)")):
        rt.assert_pdist_close(bad, X)
    asym = refgeo.pdist_hilbert(X, form="square")
    asym[0, 1] += 1.0
    with pytest.raises(ConformanceError, match="symmetric with a zero diagonal"):
        rt.assert_pdist_close(asym, X)


def test_hilbert_helper_requires_exact_inf():
    p = np.array([[1.0, 0.0], [0.5, 0.5]])
    q = np.array([[0.5, 0.5], [0.25, 0.75]])
    rt.assert_hilbert_close(refgeo.hilbert_distance(p, q), p, q)
    with pytest.raises(ConformanceError, match="index \\(0,\\)"):
        rt.assert_hilbert_close(np.array([1e300, refgeo.hilbert_distance(p[1], q[1])]), p, q)


def test_knn_helper_checks_indices_and_distances():
    X = np.array([[0.0], [1.0], [3.0], [6.0]])
    ref = refgeo.knn(X, 2)
    rt.assert_knn_close(ref.indices, ref.distances, ref, X)
    rt.assert_knn_close(ref.indices, None, ref, X)
    with pytest.raises(ConformanceError, match="repeated neighbor"):
        rt.assert_knn_close([[1, 1], [0, 2], [1, 0], [2, 1]], None, ref, X)
    with pytest.raises(ConformanceError, match="own neighbor"):
        rt.assert_knn_close([[0, 1], [0, 2], [1, 0], [2, 1]], None, ref, X)
    with pytest.raises(ConformanceError, match=re.escape("indices must be an integer array of shape (4, 2)")):
        rt.assert_knn_close(ref.indices[:, :1], None, ref, X)


def test_as_numpy_converts_other_array_libraries():
    xps = pytest.importorskip("array_api_strict")
    a = xps.asarray([[1.0, 2.0]], dtype=xps.float32)
    out = rt.as_numpy(a)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32 and out.tolist() == [[1.0, 2.0]]

    class FakeTensor:  # autograd-style object: must be detached before conversion
        def __init__(self, v):
            self.v = v

        def detach(self):
            return np.asarray(self.v)

    assert rt.as_numpy(FakeTensor([3.0])).tolist() == [3.0]
    assert rt.as_numpy(2.5).shape == ()


def test_convert_hands_the_candidate_other_arrays():
    xps = pytest.importorskip("array_api_strict")
    seen = []

    def candidate(z, w):
        seen.append(type(z).__module__)
        d = w - z
        return xps.max(d, axis=-1) - xps.min(d, axis=-1)

    check_against_reference(candidate, "hilbert_distance_logits", convert=xps.asarray, max_examples=20,
                            strategy=rst.logit_pairs(layouts="C"))
    assert seen and all(m.startswith("array_api_strict") for m in seen)


# --------------------------------------------------------------------------- arguments, registry


def test_registry_lists_available_quantities():
    names = rt.reference_names()
    assert names == sorted(names)
    for name in ("hilbert_distance_logits", "pdist_hilbert", "row_diameter", "closest_pair", "knn",
                 "projected_rownorm", "rownorm_step", "local_diagonal_fit"):
        assert name in names
        assert rt.signature(name).startswith("candidate(")


def test_argument_errors():
    with pytest.raises(ValueError, match=re.escape("name must be one of")):
        check_against_reference(logit_distance, "no_such_quantity")
    with pytest.raises(TypeError, match=re.escape("candidate must be callable, got int instead.")):
        check_against_reference(3, "row_diameter")
    with pytest.raises(ValueError, match=re.escape("max_examples must be a positive int, got 0 instead.")):
        check_against_reference(logit_distance, "hilbert_distance_logits", max_examples=0)
    with pytest.raises(ValueError, match=re.escape("tie_break must be one of ('smallest', 'any'), got 'y' instead.")):
        check_against_reference(logit_distance, "hilbert_distance_logits", tie_break="y")


def test_every_structure_gets_its_share_of_examples():
    # The default strategy runs one scenario per structure, so a bug that only large
    # rows expose is found even with 2 examples per structure; the report names the
    # scenario.
    from refgeo.testing._conformance import _REGISTRY

    assert list(_REGISTRY["row_diameter"].strategy(rst._FLOAT_DTYPES)) == list(rst.ROW_STRUCTURES)

    def wrong_on_large_rows(S):
        return direct_extreme(S) if np.abs(S).max() < 50 else (0.0, 0, 1)

    err = _caught(wrong_on_large_rows, "row_diameter", max_examples=2 * len(rst.ROW_STRUCTURES))
    assert err.scenario in ("near_ties", "offset", "huge_row")
    assert f"scenario:  {err.scenario}" in str(err)


def test_dtypes_restricts_the_default_scenarios():
    seen = set()

    def spy(S):
        seen.add(np.asarray(S).dtype)
        return direct_extreme(S)

    check_against_reference(spy, "row_diameter", dtypes="float32", max_examples=16)
    assert seen == {np.dtype(np.float32)}
    with pytest.raises(ValueError, match=re.escape("dtypes must be None when a strategy is given")):
        check_against_reference(spy, "row_diameter", dtypes="float32", strategy=rst.row_clouds())


def test_scenarios_from_a_dict():
    err = _caught(lambda S: gram_extreme(S, dtype=np.float32, center=False), "row_diameter",
                  strategy={"plain": rst.row_clouds(structures=("integers",), dtypes="float32"),
                            "shifted": rst.row_clouds(structures=("offset",), dtypes="float32")})
    assert err.scenario == "shifted"  # integers are exact in the float32 Gram identity
    check_against_reference(direct_extreme, "row_diameter", strategy={"a": rst.row_clouds(n_rows=2)},
                            max_examples=5)


def test_user_strategy_and_tolerance():
    # A user strategy may draw bare arrays; a loose tolerance accepts a sloppy kernel.
    def sloppy(z, w):
        return logit_distance(z, w) * (1 + 1e-6)

    strat = st.tuples(st.just(np.zeros((1, 3))), st.just(np.array([[0.0, 1.0, 2.0]])))
    _caught(sloppy, "hilbert_distance_logits", strategy=strat, max_examples=5)
    check_against_reference(sloppy, "hilbert_distance_logits", strategy=strat, rtol=1e-5, max_examples=5)


# --------------------------------------------------------------------------- the strategies


@settings(max_examples=60)
@given(rst.centered_gradients(structures=("cross_entropy", "rank_one", "sparse", "zipf")))
def test_centered_gradients_rows_sum_to_exactly_zero(G):
    assert np.all(G.sum(axis=0) == 0)
    assert np.all(G[::-1].sum(axis=0) == 0)  # whatever the order
    assert np.isfinite(G).all()


@settings(max_examples=500)
@given(rst.centered_gradients(dtypes="float32", structures=("multiscale",), scales=(1.0, 4.0)))
def test_centered_gradients_keep_their_largest_entry_below_the_scale(G):
    """Multiscale rows were scaled into [1/2, 1) in float64, then rounded: in float32 a
    largest entry 0.9999999999999999 became 1.0, at the documented open end (about 6 of
    500 draws)."""
    top = float(np.abs(G).max())
    assert top == 0.0 or any(s / 2 <= top < s for s in (1.0, 4.0))


@settings(max_examples=60)
@given(rst.simplex_pairs(supports=("mismatched",), n_cols=(2, 8)))
def test_mismatched_supports_give_inf(pq):
    p, q = pq
    assert np.all(np.isinf(refgeo.hilbert_distance(p, q)))


@settings(max_examples=60)
@given(rst.simplex_pairs(supports=("full", "shared")))
def test_shared_supports_give_finite_distances(pq):
    p, q = pq
    assert (p >= 0).all() and (q >= 0).all()
    assert np.all(np.isfinite(refgeo.hilbert_distance(p, q)))


@settings(max_examples=60)
@given(rst.row_clouds(n_rows=(2, 5), n_cols=(1, 3), dtypes="float32", layouts=("F", "strided")))
def test_row_clouds_honor_size_dtype_layout(S):
    assert S.dtype == np.float32 and 2 <= S.shape[0] <= 5 and 1 <= S.shape[1] <= 3
    assert np.isfinite(S).all()
    if S.shape[0] > 1 and S.shape[1] > 1:
        assert not S.flags.c_contiguous


@settings(max_examples=150, database=None)
@given(rst.row_clouds(structures=("generic", "offset", "rank_deficient", "huge_row")),
       rst.logit_pairs(dtypes="float32"))
def test_row_clouds_are_never_one_repeated_row_and_hold_no_subnormals(S, zw):
    """hypothesis's fill made 29% of "generic" and 59% of "offset" clouds one repeated
    row (diameter 0), which left a kernel without its certified refinement a 30% chance
    to pass; and float32 draws held subnormals (1e-45), which the kit says it does not
    draw.  Over 150 draws of each kind: none."""
    assert S.shape[0] < 2 or np.any(S != S[:1])
    for x in (S, *zw):
        assert not np.any((x != 0) & (np.abs(x) < np.finfo(x.dtype).tiny))


@pytest.mark.parametrize("strategy", [
    rst.logits(n_rows=8, n_cols=128), rst.row_clouds(n_rows=128, n_cols=8), rst.logit_pairs(n_rows=4, n_cols=256),
    rst.simplex_pairs(n_rows=4, n_cols=256), rst.centered_gradients(n_rows=256, n_cols=1, structures=("zipf",)),
    rst.row_clouds(n_rows=600, n_cols=16, structures=("near_ties",)),
], ids=repr)
def test_large_fixed_sizes_draw(strategy):
    """Drawn entry by entry, arrays of 1,000 entries failed hypothesis's
    large_base_example health check before the test ran; near ties of 600 rows built a
    V x V x d array of differences."""
    @settings(max_examples=5, database=None, deadline=None)
    @given(strategy)
    def draws(x):
        pass

    draws()


@settings(max_examples=20)
@given(rst.row_clouds(n_rows=1, structures=("near_ties",)))
def test_near_ties_of_one_row(S):
    # the extreme pair of one row does not exist: the nudge goes to row 0
    assert S.shape[0] == 1 and np.isfinite(S).all()


@settings(max_examples=40)
@given(rst.centered_gradients(structures=("zipf",), n_rows=(6, 12), n_cols=(2, 8), dtypes="float64"))
def test_zipf_gradients_are_nearly_rank_one(G):
    """An LM head's gradient under a large common hidden component: the top singular
    value carries almost all of it (isotropic Gaussian gradients spread over d).  d >= 2:
    every matrix of one column is rank one."""
    assert G.shape[1] >= 2 and np.any(G)  # softmax(z) - e_c is never zero
    s = np.linalg.svd(G, compute_uv=False)
    assert s[0] ** 2 >= 0.9 * np.sum(s**2)


@settings(max_examples=30)
@given(rst.row_clouds(structures=("duplicates",)))
def test_duplicates_have_zero_closest_distance(S):
    assert refgeo.closest_pair(S).value == 0.0


@settings(max_examples=30)
@given(rst.hidden_state_pairs(dtypes="float64"))
def test_hidden_state_pairs_are_planted_exactly(h):
    Y = np.einsum("nij,nj->ni", h.maps[h.labels], h.X) + h.residual
    np.testing.assert_allclose(h.Y, Y, rtol=1e-13, atol=1e-12)
    moved = np.flatnonzero(np.linalg.norm(h.residual, axis=1) > 0)
    assert moved.tolist() == h.outliers.tolist()


@settings(max_examples=30)
@given(rst.logits(structures=("extreme", "spike"), n_cols=(2, 8), dtypes="float64"))
def test_extreme_logits_reach_1e4(z):
    assert np.abs(z).max() <= 1e4


def test_strategy_argument_errors():
    with pytest.raises(ValueError, match=re.escape("n_rows must satisfy 1 <= min <= max, got (3, 2) instead.")):
        rst.row_clouds(n_rows=(3, 2))
    with pytest.raises(ValueError, match=re.escape("dtypes must contain only float32 or float64, got int64 instead.")):
        rst.logits(dtypes="int64")
    with pytest.raises(ValueError, match=re.escape("structures must be a non-empty selection of")):
        rst.row_clouds(structures=("nope",))


# --------------------------------------------------------------------------- optional: torch
# Torch kernels under test receive tensors (convert=torch.from_numpy).  These tests skip
# when torch is not installed and run whenever it is (CI installs it).


def _torch():
    return pytest.importorskip("torch")


def torch_direct_diameter(S):
    """A correct torch diameter: float64 direct differences, first maximum."""
    torch = _torch()
    D = torch.cdist(S.to(torch.float64), S.to(torch.float64), compute_mode="donot_use_mm_for_euclid_dist")
    n = D.shape[0]
    iu = torch.triu_indices(n, n, offset=1)
    vals = D[iu[0], iu[1]]
    k = int(torch.argmax(vals))
    return vals[k], int(iu[0][k]), int(iu[1][k])


def torch_blockwise_diameter(S, *, block=4, compute_mode="use_mm_for_euclid_dist", center=False):
    """The diameter as practitioners write it for a large head: float32 ``torch.cdist`` over
    row blocks (so the V x V matrix never exists), returning only the maximum.

    With the default ``compute_mode`` cdist uses the Gram identity
    |x|^2 + |y|^2 - 2 x.y, which cancels catastrophically in float32 when the rows share
    a large common component or nearly coincide: the known defect.
    """
    torch = _torch()
    X = S.to(torch.float32)
    if center:
        X = X - X.mean(dim=0)
    best = X.new_zeros(())
    for start in range(0, X.shape[0], block):
        D = torch.cdist(X[start:start + block], X, compute_mode=compute_mode)
        best = torch.maximum(best, D.max())
    return best


@pytest.mark.parametrize("scale", [2.0**700, 2.0**-700, 1.0])
def test_rownorm_reference_steps_normalize_rows_at_any_scale(scale):
    """The written-out steps took row norms from squares: gradients of 1e200 gave a zero
    step (refgeo.RowNorm normalizes them) and the tolerance was NaN (inf / inf)."""
    G = np.random.default_rng(6).standard_normal((3, 5, 4)) * scale
    W0 = np.zeros((5, 4))
    steps = rt.rownorm_reference_steps(W0, G, lr=0.1, eps=0.0)
    unit = rt.rownorm_reference_steps(W0, G / scale, lr=0.1, eps=0.0)
    np.testing.assert_array_equal(steps, unit)  # RowNorm is scale-free with eps = 0
    rt.assert_rownorm_steps_close(steps, W0, G, lr=0.1, eps=0.0)


def test_local_diagonal_fit_neighbors_as_a_torch_tensor():
    # a tensor has an .indices method (sparse tensors): it was read as a KNNResult
    torch = _torch()
    X = np.random.default_rng(5).standard_normal((12, 3))
    Y = 1.1 * X + 0.1
    nn = refgeo.knn(X, 3)
    fit = refgeo.fit_local_maps(X, Y, neighbors=nn, cls="diagonal")
    rt.assert_local_diagonal_fit_close(fit.fitted, X, Y, torch.from_numpy(np.array(nn.indices)))


def test_torch_implementation_if_available():
    torch = _torch()
    report = check_against_reference(torch_direct_diameter, "row_diameter", convert=torch.from_numpy,
                                     max_examples=N, tie_break="any")
    assert report.unchecked == () and report.examples >= N


def test_torch_kernel_receives_tensors():
    torch = _torch()
    seen = set()

    def candidate(S):
        seen.add(type(S))
        return torch_direct_diameter(S)

    check_against_reference(candidate, "row_diameter", convert=torch.from_numpy, max_examples=8, tie_break="any")
    assert seen == {torch.Tensor}


def test_torch_blockwise_mm_cdist_diameter_is_caught():
    # The realistic defect: float32 mm-based cdist without centering, value only.
    torch = _torch()
    err = _caught(torch_blockwise_diameter, "row_diameter", convert=torch.from_numpy, dtypes="float32")
    assert "differs from the reference" in err.reason
    assert "the pair was not checked" in err.reason  # value-only candidate: said in the report
    assert set(err.got) == {"value"} and {"value", "i", "j"} <= set(err.expected)
    assert np.asarray(err.inputs["S"]).dtype == np.float32


def test_torch_blockwise_diameter_fixed_passes_on_its_value():
    # Direct differences (the one-word fix) pass for float32 input; the report says that
    # the pair was not checked.
    torch = _torch()
    report = check_against_reference(
        lambda S: torch_blockwise_diameter(S, compute_mode="donot_use_mm_for_euclid_dist"), "row_diameter",
        convert=torch.from_numpy, dtypes="float32", max_examples=N)
    assert report.unchecked == ("pair (i, j)",)
    assert "not checked: pair (i, j)" in str(report)


def test_value_only_candidates_are_accepted_for_extreme_pairs():
    # Python floats, NumPy scalars, 0-d arrays and {"value": ...} are checked on their value.
    def direct(S):
        return direct_extreme(np.asarray(S))

    for wrap in (lambda r: float(r[0]), lambda r: np.float64(r[0]), lambda r: np.array(r[0]),
                 lambda r: {"value": r[0]}):
        report = check_against_reference(lambda S: wrap(direct(S)), "row_diameter", max_examples=16)
        assert report.unchecked == ("pair (i, j)",)
    # A wrong value is still caught, with the pair reported as unchecked.
    err = _caught(lambda S: 1.001 * direct(S)[0], "row_diameter")
    assert "the pair was not checked" in err.reason
    # Full (value, i, j) results leave nothing unchecked.
    assert check_against_reference(direct, "row_diameter", max_examples=16).unchecked == ()


def test_value_only_closest_pair_with_torch():
    torch = _torch()

    def closest_value(S):
        X = S.to(torch.float64)
        D = torch.cdist(X, X, compute_mode="donot_use_mm_for_euclid_dist")
        n = D.shape[0]
        iu = torch.triu_indices(n, n, offset=1)
        return D[iu[0], iu[1]].min()  # a 0-d tensor

    report = check_against_reference(closest_value, "closest_pair", convert=torch.from_numpy, max_examples=N)
    assert report.unchecked == ("pair (i, j)",)


@pytest.mark.gpu
def test_torch_cuda_kernel_if_available():
    torch = _torch()
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device here")
    report = check_against_reference(torch_direct_diameter, "row_diameter",
                                     convert=lambda a: torch.from_numpy(a).cuda(), max_examples=N, tie_break="any")
    assert report.examples >= N
    _caught(torch_blockwise_diameter, "row_diameter", convert=lambda a: torch.from_numpy(a).cuda(), dtypes="float32")


def test_torch_bfloat16_grad_and_view_tensors_as_numpy():
    """as_numpy takes what torch kernels return: bfloat16 (as exact float32), tensors with
    autograd history, conjugate views; a meta tensor (no values) is a TypeError."""
    from refgeo.testing import as_numpy

    torch = _torch()
    x = torch.tensor([[1.0, -2.5], [3.0, 0.125]])
    for t in (x.bfloat16(), x.bfloat16().requires_grad_() * 1.0, x.requires_grad_() * 1.0):
        a = as_numpy(t)
        assert a.dtype == np.float32
        np.testing.assert_array_equal(a, x.detach().numpy())
    c = torch.tensor([1 + 2j, 3 - 1j]).conj()
    np.testing.assert_array_equal(as_numpy(c), np.array([1 - 2j, 3 + 1j]))
    with pytest.raises(TypeError, match=re.escape("a meta tensor has no values to compare; the candidate "
                                                  "must return a tensor with data.")):
        as_numpy(torch.empty(3, device="meta"))


def test_helpers_take_torch_inputs_and_bfloat16_outputs():
    """The assert_* helpers read their inputs as candidates' outputs are read: tensors with
    autograd history included; a bfloat16 output is compared (and can fail) like any other."""
    from refgeo.testing import assert_hilbert_logits_close, assert_pdist_close

    torch = _torch()
    Z = torch.tensor([[0.0, 0.0, 0.0], [0.0, 1.0, 2.0], [5.0, 5.0, 6.0]], requires_grad=True)
    d = torch.tensor([2.0, 1.0, 1.0])
    assert_pdist_close(d, Z)
    assert_pdist_close(d.bfloat16(), Z.detach())
    assert_hilbert_logits_close(d[:1], Z[:1], Z[1:2] * 1.0)
    with pytest.raises(ConformanceError):
        assert_pdist_close((1.5 * d).bfloat16(), Z)
    err = _caught(lambda X: torch_blockwise_diameter(X, compute_mode="donot_use_mm_for_euclid_dist").bfloat16(),
                  "row_diameter", convert=torch.from_numpy, dtypes="float32")
    assert "differs from the reference" in err.reason  # bfloat16 rounding, not a TypeError


# --------------------------------------------------------------------------- false passes and false failures


def _input_precision_knn(X, k):
    return direct_knn(X, k, dtype=np.asarray(X).dtype)


@pytest.mark.parametrize(
    "X, k",
    [
        # (1, 0) is at distance 1 from rows 1, 3, 4 and at 1 + 7e-15 from row 2: equal in
        # float32, so the float32 kernel lists 1, 2, 3 (in tolerance); rank 2 then holds
        # 3 where the reference has 4, an exact tie the kernel ordered correctly
        (np.array([[1.0, 0.0], [1.0, 1.0], [1.0000001, 1.0], [1.0, 1.0], [1.0, 1.0]], dtype=np.float32), 3),
        # float32 squares of 4.2e-40 underflow to 0 (inside the underflow floor)
        (np.array([[0.0], [4.2079e-40], [4.2079e-40], [4.2079e-40]], dtype=np.float32), 2),
    ],
    ids=["near_tie_shifts_rank", "underflow"],
)
def test_knn_tie_rule_accepts_exact_ties_moved_by_near_ties(X, k):
    # Was "wrong tie-breaking ... neighbors 3 and 4 are at exactly equal refined distance":
    # the rule was checked rank by rank against the reference.
    idx, dist = _input_precision_knn(X, k)
    rt.assert_knn_close(idx, dist, refgeo.knn(X, k), X)
    check_against_reference(_input_precision_knn, "knn", strategy=st.just((X, k)), max_examples=1)


def test_knn_tie_rule_still_catches_larger_indices_among_exact_ties():
    X = np.array([[0.0], [1.0], [-1.0], [1.0], [3.0]])
    ref = refgeo.knn(X, 2)  # row 0: 1, 2, 3 at distance 1 -> (1, 2)
    with pytest.raises(ConformanceError, match=re.escape(
            "wrong tie-breaking in row 0, rank 1: neighbor 3 is listed but neighbor 2, at exactly equal refined "
            "distance 1.0, is not; refgeo orders equal distances by the smaller index.")):
        rt.assert_knn_close([[1, 3], [3, 0], [0, 1], [1, 0], [3, 1]], None, ref, X)
    with pytest.raises(ConformanceError, match=re.escape(
            "wrong tie-breaking in row 0: neighbors 2 (rank 0) and 1 (rank 1) are at exactly equal refined "
            "distance 1.0; refgeo orders equal distances by the smaller index.")):
        rt.assert_knn_close([[2, 1], [3, 0], [0, 1], [1, 0], [3, 1]], None, ref, X)
    rt.assert_knn_close([[2, 1], [3, 0], [0, 1], [1, 0], [3, 1]], None, ref, X, tie_break="any")


def test_complex_and_text_results_are_mismatches():
    # Cast to float64, a complex result lost its imaginary part and a string was parsed:
    # both passed.
    z, w = np.array([[0.0, 1.0, 2.0]]), np.array([[5.0, 5.0, 5.0]])
    with pytest.raises(ConformanceError, match=re.escape("distance must be real numbers, got an array of dtype complex128.")):
        rt.assert_hilbert_logits_close(np.array([2.0 + 5.0j]), z, w)
    with pytest.raises(ConformanceError, match=re.escape("distance must be real numbers, got an array of dtype <U3.")):
        rt.assert_hilbert_logits_close(np.array(["2.0"]), z, w)
    err = _caught(lambda z, w: logit_distance(z, w) + 1e-3j, "hilbert_distance_logits", max_examples=2)
    assert err.reason == "distance must be real numbers, got an array of dtype complex128."


def test_extreme_pair_value_and_indices_must_be_numbers():
    S = np.array([[0.0, 0.0], [3.0, 4.0], [1.0, 1.0]])
    ref = refgeo.row_diameter(S)
    for value in ["5.0", 5.0 + 1j, None, [5.0, 1.0]]:
        with pytest.raises(ConformanceError, match=re.escape(f"the value must be one real number, got {value!r}.")):
            rt.assert_extreme_pair_close(value, 0, 1, ref, S)
    # NaN and inf raised ValueError/OverflowError from int(), booleans passed as 0 and 1
    for i in [math.nan, math.inf, False, 0.5]:
        with pytest.raises(ConformanceError, match=re.escape(f"i must be one integer index, got {i!r}.")):
            rt.assert_extreme_pair_close(5.0, i, 1, ref, S)
    rt.assert_extreme_pair_close(5.0, 0.0, np.int32(1), ref, S)


def test_tolerances_and_runner_options_are_checked_by_name():
    z, w = np.array([[0.0, 1.0, 2.0]]), np.array([[5.0, 5.0, 5.0]])
    # A negative or NaN tolerance blamed the candidate; a string raised float()'s error.
    with pytest.raises(ValueError, match=re.escape("rtol == -1.0, must be >= 0.0.")):
        rt.assert_hilbert_logits_close(np.array([2.0]), z, w, rtol=-1.0)
    with pytest.raises(ValueError, match=re.escape("atol must be a finite number, got nan instead.")):
        rt.assert_pdist_close(np.zeros(0), np.zeros((1, 2)), atol=math.nan)
    with pytest.raises(TypeError, match=re.escape("rtol must be a real number, got str ('x') instead.")):
        check_against_reference(logit_distance, "hilbert_distance_logits", rtol="x")
    with pytest.raises(TypeError, match=re.escape("atol must be a real number, got bool (True) instead.")):
        check_against_reference(logit_distance, "hilbert_distance_logits", atol=True)
    with pytest.raises(TypeError, match=re.escape("convert must be callable, got int instead.")):
        check_against_reference(logit_distance, "hilbert_distance_logits", convert=5)
    with pytest.raises(TypeError, match=re.escape("settings must be a hypothesis.settings object or None, got int instead.")):
        check_against_reference(logit_distance, "hilbert_distance_logits", settings=3)
    with pytest.raises(TypeError, match=re.escape(
            "strategy must be a hypothesis strategy (or a dict of them), got int instead.")):
        check_against_reference(logit_distance, "hilbert_distance_logits", strategy=3)
    with pytest.raises(TypeError, match=re.escape(
            "strategy['a'] must be a hypothesis strategy (or a dict of them), got list instead.")):
        check_against_reference(logit_distance, "hilbert_distance_logits", strategy={"a": [1]})
    with pytest.raises(TypeError, match=re.escape("max_examples must be a positive int, got float instead.")):
        check_against_reference(logit_distance, "hilbert_distance_logits", max_examples=2.0)
    report = check_against_reference(logit_distance, "hilbert_distance_logits", max_examples=np.int64(7))
    assert report.examples >= 7


def test_rownorm_reference_steps_checks_its_arguments():
    W0, G = np.zeros((2, 2)), np.array([[[3.0, 4.0], [-3.0, -4.0]]])
    # mu = nan returned zeros, mu = 1 NaN, an int W0 truncated every update to 0
    with pytest.raises(ValueError, match=re.escape("mu must be a finite number, got nan instead.")):
        rt.rownorm_reference_steps(W0, G, lr=0.1, mu=math.nan)
    with pytest.raises(ValueError, match=re.escape("mu must be in [0, 1), got 1.0 instead.")):
        rt.rownorm_reference_steps(W0, G, lr=0.1, mu=1.0)
    with pytest.raises(TypeError, match=re.escape("lr must be a real number, got str ('a') instead.")):
        rt.rownorm_reference_steps(W0, G, lr="a")
    with pytest.raises(TypeError, match=re.escape(
            "W0 must be a float32 or float64 array of shape (V, d), got int64 of shape (2, 2) instead.")):
        rt.rownorm_reference_steps(W0.astype(np.int64), G, lr=0.1)
    for grads in (G[:0], G[0], G[:, :, :1]):
        msg = f"grads must have shape (T, V, d) = (T, 2, 2) with T >= 1 steps, got shape {grads.shape} instead."
        with pytest.raises(ValueError, match=re.escape(msg)):
            rt.rownorm_reference_steps(W0, grads, lr=0.1)
        with pytest.raises(ValueError, match=re.escape(msg)):
            rt.assert_rownorm_steps_close(np.zeros((1, 2, 2)), W0, grads, lr=0.1)
    with pytest.raises(ValueError, match=re.escape("lam == -5.0, must be >= 0.0.")):
        rt.assert_local_diagonal_fit_close(np.ones((3, 1)), np.ones((3, 1)), np.ones((3, 1)),
                                           np.array([[1], [0], [0]]), lam=-5.0)


def test_strategy_parameters_are_checked_when_the_strategy_is_built():
    cases = [
        (lambda: rst.logits(max_abs=-1.0), ValueError, "max_abs must be a finite number > 0, got -1.0 instead."),
        (lambda: rst.logit_pairs(max_abs=math.nan), ValueError, "max_abs must be a finite number > 0, got nan instead."),
        (lambda: rst.logits(max_abs=1e300), ValueError,
         "max_abs must be at most the largest float32 (3.403e+38) so that the drawn logits are finite, got 1e+300"),
        (lambda: rst.row_clouds(max_offset=0.01), ValueError, "max_offset must be a finite number >= 1, got 0.01 instead."),
        (lambda: rst.row_clouds(n_rows=(True, 3)), TypeError,
         "n_rows must be an int or a (min, max) tuple of ints, got (True, 3) instead."),
        (lambda: rst.centered_gradients(scales="12"), TypeError,
         "scales must be a sequence of positive numbers, got str instead."),
        (lambda: rst.centered_gradients(scales=(math.nan,)), ValueError,
         "scales must be positive finite numbers, got (nan,) instead."),
        (lambda: rst.centered_gradients(scales=(True,)), TypeError,
         "scales must be a sequence of positive numbers, got (True,) instead."),
        (lambda: rst.gradient_sequences(dtypes="float32", scales=(2.0**-600,)), ValueError,
         "scales must be normal numbers of a drawn dtype (float32), got (2.409919865102884e-181,) instead"),
        (lambda: rst.hidden_state_pairs(max_outliers=-1), ValueError, "max_outliers must be >= 0, got -1 instead."),
        (lambda: rst.hidden_state_pairs(outlier_size=math.nan), ValueError,
         "outlier_size must be a finite number >= 0, got nan instead."),
        (lambda: rst.simplex_pairs(normalize="no"), TypeError, "normalize must be a bool, got str instead."),
        (lambda: rst.simplex_pairs(n_cols=1, supports=("mismatched",)), ValueError,
         "supports=('mismatched',) needs n_cols >= 2 (one column has no second support entry), got n_cols=1 instead."),
    ]
    for build, error, message in cases:
        with pytest.raises(error, match=re.escape(message)):
            build()


def test_strategies_honor_their_documented_ranges_at_the_boundaries():
    # 2**-600 is zero in float32: such gradients were all zero (float32 draws only
    # float64 now); mismatched supports with V = 1 had equal supports; a float32 logit
    # of size 1e300 was inf.
    @settings(max_examples=40, database=None)
    @given(rst.centered_gradients(scales=(2.0**-600,)), rst.simplex_pairs(supports=("mismatched",)),
           rst.logits(max_abs=3e38, dtypes="float32", structures=("extreme", "shifted", "spike")))
    def run(G, pq, z):
        assert G.dtype == np.float64
        top = float(np.abs(G).max())
        assert top == 0.0 or 2.0**-601 <= top < 2.0**-600
        p, q = pq
        assert p.shape[1] >= 2 and ((p > 0) != (q > 0)).any(axis=1).all()
        assert np.isfinite(z).all()

    run()


def _rownorm_reciprocal_mean(G, eta):
    """Correct projected RowNorm in the input precision, means taken as sum * (1/V)."""
    G = np.asarray(G)
    dt = G.dtype.type
    inv = dt(1.0 / G.shape[0])
    Gc = G - G.sum(axis=0) * inv
    n = np.linalg.norm(Gc, axis=1, keepdims=True)
    N = np.where(n > 0, Gc / np.where(n > 0, n, 1), 0).astype(G.dtype)
    return dt(-eta / 2) * (N - N.sum(axis=0) * inv)


def test_projected_rownorm_shift_keeps_centering_well_conditioned():
    # The default scenarios shifted G by its first row also when G had zero rows: in
    # float32, sum * (1/V) rounds, the zero rows became noise directions and the outer P
    # spread them to every entry (error 0.36 against a tolerance of 8e-7).
    check_against_reference(_rownorm_reciprocal_mean, "projected_rownorm", dtypes="float32", max_examples=150)
    G = np.array([[1.5], [0.75], [0.75], [0.75], [0.75], [0.75], [0.0]], dtype=np.float32)  # G' + G'[0]
    err = _caught(_rownorm_reciprocal_mean, "projected_rownorm",
                  strategy=st.just(rt.Case(args=(G,), names=("G",), kwargs={"eta": 1.0})), max_examples=1)
    assert "step entry at index (0, 0)" in err.reason  # such inputs are ill-conditioned: not drawn


def test_farthest_partner_indices_must_be_integers():
    # 1.5 was truncated to 1 (and passed, 1 being right); NaN raised int()'s ValueError.
    S = np.array([[0.0, 0.0], [3.0, 4.0], [1.0, 1.0]])
    ref = refgeo.farthest_partners(S)
    assert int(ref.indices[0]) == 1
    for bad in [1.5, math.nan]:
        def candidate(S, bad=bad):
            idx = np.asarray(ref.indices, dtype=np.float64)
            idx[0] = bad
            return idx, np.asarray(ref.distances)

        err = _caught(candidate, "farthest_partners", strategy=st.just(S), max_examples=1)
        assert err.reason == f"the partner of row 0 must be one integer index, got {np.float64(bad)!r}."


# ---- found by a review of the kit (stop 55): each fails on the kit before its fix


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_near_logit_pairs_stay_finite_and_within_max_abs(dtype):
    """"near" moved entries of w by ulps with no limit: at max_abs = the dtype's largest
    value 1.5% (float32) to 7% (float64) of the draws held inf, which refgeo refuses."""
    top = float(np.finfo(dtype).max)

    @settings(max_examples=200, database=None, derandomize=True)
    @given(rst.logit_pairs(structures=("near",), max_abs=top, dtypes=dtype))
    def check(zw):
        z, w = zw
        assert np.isfinite(w).all(), zw
        assert np.abs(w).max() <= max(np.abs(z).max(), np.float64(top))
        refgeo.hilbert_distance_logits(z, w)  # accepted

    check()


def test_shifted_logits_respect_max_abs():
    """The docstring names "shifted" among the structures max_abs sizes: a shift of 1e2
    was drawn whatever max_abs (101.0 at max_abs = 5)."""

    @settings(max_examples=100, database=None, derandomize=True)
    @given(rst.logits(structures=("shifted",), max_abs=5.0, dtypes="float64"))
    def check(z):
        assert np.abs(z).max() <= 5.0

    check()


def test_rownorm_steps_of_a_buffer_row_that_cancels_to_zero():
    """With eps = 0 a momentum row that the float64 oracle rounds to 0 has no direction
    to check (its exact value here is -2.7e-18): the tolerance was 8e-17 there and a
    kernel exact in rational arithmetic (a step of +lr) failed; the oracle's own steps
    (no step on that row) pass as before, and a wrong step elsewhere still fails."""
    from fractions import Fraction

    mu, x, lr = 0.95, 0.8427709922403473, 0.02
    W0 = np.zeros((2, 1))
    G = np.array([[[x], [-x]], [[-mu * x], [mu * x]]])
    # exact momentum (bias correction cancels in the direction): b2 = mu (1-mu) g1 + (1-mu) g2
    m, fx = Fraction(mu), Fraction(x)
    b2 = m * (1 - m) * fx + (1 - m) * Fraction(-mu * x)
    assert b2 != 0  # the exact buffer has a sign; float64 rounds it to 0
    exact = np.array([[[-lr], [lr]], [[-lr - lr * np.sign(float(b2))], [lr + lr * np.sign(float(b2))]]])
    rt.assert_rownorm_steps_close(exact, W0, G, lr=lr, mu=mu, eps=0.0)
    rt.assert_rownorm_steps_close(rt.rownorm_reference_steps(W0, G, lr=lr, mu=mu, eps=0.0), W0, G, lr=lr, mu=mu, eps=0.0)
    wrong = exact.copy()
    wrong[0, 0, 0] += lr  # step 1 is well conditioned: still checked
    with pytest.raises(ConformanceError, match="step 1"):
        rt.assert_rownorm_steps_close(wrong, W0, G, lr=lr, mu=mu, eps=0.0)


def test_pairwise_logit_helpers_do_not_form_every_difference_at_once():
    """The tolerance of assert_pdist_close/assert_cdist_close came from the (n, n, V)
    float64 differences: 6.6 GB for 128 rows of V = 50257.  Peak traced memory stays
    within a few copies of the rows now."""
    import tracemalloc

    Z = np.random.default_rng(0).standard_normal((32, 4000)).astype(np.float32)
    D = refgeo.pdist_hilbert(Z)
    C = refgeo.cdist_hilbert(Z[:20], Z)
    tracemalloc.start()
    try:
        rt.assert_pdist_close(D, Z)
        rt.assert_cdist_close(C, Z[:20], Z)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    rows = Z.size * 8  # the rows in float64: 1 MB
    assert peak < 6 * rows, peak  # the differences at once: 32 MB


def test_malformed_results_are_conformance_errors():
    """Text parameters from a RowNorm candidate raised NumPy's "could not convert string
    to float" from the step-naming handler; dicts without the documented keys raised a
    bare KeyError."""
    W0 = np.zeros((2, 2))
    G = np.array([[[3.0, 4.0], [-3.0, -4.0]]])
    with pytest.raises(ConformanceError):
        rt.assert_rownorm_steps_close(np.array([[["a", "b"], ["c", "d"]]]), W0, G, lr=0.1, eps=0.0)
    with pytest.raises(ConformanceError, match="keys 'indices' and 'distances'|keys 'distances' and 'indices'|must hold the keys"):
        check_against_reference(lambda S, k: {"indices": np.zeros((len(S), k), int), "dists": np.zeros((len(S), k))},
                                "knn", max_examples=5)
    with pytest.raises(ConformanceError, match="must hold the keys 'value', 'i' and 'j'"):
        check_against_reference(lambda S: {"value": 1.0, "i": 0}, "row_diameter", max_examples=5)


def test_logit_tolerance_is_the_documented_one():
    """The docstring's formula, (u_in + 2 u_64)(|max d| + |min d|) + u_in |d| (float64
    logits: u_in = u_64), is the one applied: just inside it passes, just outside fails
    (the docs said u_in (|max d| + |min d|), a third of what was applied)."""
    u = 2.0**-53
    z = np.array([[0.0, 0.0]])
    w = np.array([[1e4, -1e4]])
    exact = 2e4
    tol = 3 * u * 2e4 + u * 2e4
    rt.assert_hilbert_logits_close(np.array([exact + 0.9 * tol]), z, w)
    with pytest.raises(ConformanceError):
        rt.assert_hilbert_logits_close(np.array([exact + 1.1 * tol]), z, w)
