"""Tensors in, tensors out: every public array function on torch tensors against the same
call on NumPy arrays (bit for bit), without warnings, and the bad-input contract.

Skips cleanly without torch; runs whenever torch is installed.  The engine functions
(row_diameter, closest_pair, distance_ratio, farthest_partners, knn) are covered in
test_rows.py; here they appear only in the bad-input checks.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import numpy as np
import pytest

import refgeo
from refgeo import _backend

torch = pytest.importorskip("torch")

_RNG = np.random.default_rng(14)
Z = _RNG.standard_normal((7, 9))
W = _RNG.standard_normal((7, 9))
P = np.exp(_RNG.standard_normal((7, 9)))
Q = np.exp(_RNG.standard_normal((7, 9)))
P0 = P.copy()
P0[1, 3] = 0.0  # a zero: the support-aware path
S = _RNG.standard_normal((30, 6))
HID = _RNG.standard_normal((11, 6))
R1 = np.eye(30)[0] - np.eye(30)[5]
R2 = _RNG.integers(-3, 4, size=(4, 30)).astype(np.float64)
R2[:, -1] -= R2.sum(axis=1)  # integers: the zero sum is exact in float32 too
X = _RNG.standard_normal((24, 4))
Y = X @ np.diag([1.5, 0.5, 1.0, 2.0]) + 0.01 * _RNG.standard_normal((24, 4))
NEIGHBORS = refgeo.knn(X, 5)
H3 = _RNG.standard_normal((2, 5, 4))
H3p = H3 + 0.1 * _RNG.standard_normal((2, 5, 4))
A = _RNG.standard_normal(40)
B = A + _RNG.standard_normal(40)


def _layer_report(c):
    r = refgeo.decompose(c(X), c(Y), k=6, cls="diagonal", subspace_rank=2, layer=1)
    return refgeo.layer_report([r], perturbations=[c(np.abs(Y[:, 0]))])


# Each case builds its inputs through ``c`` (NumPy array -> the input under test), so
# the same case runs on NumPy arrays and on tensors of every kind.
CASES = {
    "variation": lambda c: refgeo.variation(c(Z)),
    "variation_scalar": lambda c: refgeo.variation(c(Z[0])),
    "variation_axis0": lambda c: refgeo.variation(c(Z), axis=0),
    "hilbert_distance_logits": lambda c: refgeo.hilbert_distance_logits(c(Z), c(W)),
    "hilbert_distance_logits_scalar": lambda c: refgeo.hilbert_distance_logits(c(Z[0]), c(W[0])),
    "hilbert_distance": lambda c: refgeo.hilbert_distance(c(P), c(Q)),
    "hilbert_distance_zeros": lambda c: refgeo.hilbert_distance(c(P0), c(Q)),
    "hilbert_distance_scalar": lambda c: refgeo.hilbert_distance(c(P[0]), c(Q[0])),
    "funk_distance": lambda c: refgeo.funk_distance(c(P), c(Q)),
    "funk_distance_logits": lambda c: refgeo.funk_distance_logits(c(Z), c(W)),
    "pdist_hilbert": lambda c: refgeo.pdist_hilbert(c(Z)),
    "pdist_hilbert_square": lambda c: refgeo.pdist_hilbert(c(Z), form="square"),
    "pdist_hilbert_probabilities": lambda c: refgeo.pdist_hilbert(c(P), kind="probabilities"),
    "pdist_hilbert_zeros": lambda c: refgeo.pdist_hilbert(c(P0), kind="probabilities"),
    "cdist_hilbert": lambda c: refgeo.cdist_hilbert(c(Z), c(W[:4])),
    "cdist_hilbert_probabilities": lambda c: refgeo.cdist_hilbert(c(P), c(Q[:3]), kind="probabilities"),
    "cdist_hilbert_one_tensor": lambda c: refgeo.cdist_hilbert(Z, c(W[:4])),
    "tv_bound": lambda c: refgeo.tv_bound(c(np.abs(Z))),
    "ce_bound": lambda c: refgeo.ce_bound(c(np.abs(Z))),
    "covering_radius": lambda c: refgeo.covering_radius(c(S)),
    "worst_case_hidden_state": lambda c: refgeo.worst_case_hidden_state(c(S), H=2.0),
    "hilbert_rms": lambda c: refgeo.hilbert_rms(c(S), c(HID)),
    "backward_bound": lambda c: refgeo.backward_bound(c(S), c(R2)),
    "backward_bound_scalar": lambda c: refgeo.backward_bound(c(S), c(R1)),
    "fit_local_maps": lambda c: refgeo.fit_local_maps(c(X), c(Y), k=6, cls="diagonal"),
    "fit_local_maps_maps": lambda c: refgeo.fit_local_maps(
        c(X), c(Y), k=6, cls="scaled_orthogonal", return_maps=True, weights="gaussian"
    ),
    "fit_local_maps_given": lambda c: refgeo.fit_local_maps(
        c(X), c(Y), cls="low_rank", rank=1, ridge=0.1, neighbors=torch.tensor(NEIGHBORS.indices),
        weights=c(np.abs(NEIGHBORS.distances) + 1.0),
    ),
    "fit_tokenwise_mlp_predict": lambda c: refgeo.fit_tokenwise_mlp(c(X), c(Y), hidden=3, epochs=3).predict(c(X)),
    "decompose": lambda c: refgeo.decompose(c(X), c(Y), k=6, cls="diagonal", subspace_rank=2),
    "decompose_full": lambda c: refgeo.decompose(c(X), c(Y), k=6, cls="full", ridge=0.1),
    "decompose_mlp": lambda c: refgeo.decompose(
        c(X), c(Y), cls="mlp", mlp_options={"hidden": 3, "epochs": 3}, subspace_rank=2
    ),
    "patched": lambda c: refgeo.decompose(c(X), c(Y), k=6, cls="diagonal").patched(c(X)),
    "summary": lambda c: refgeo.decompose(c(X), c(Y), k=6, cls="diagonal").summary(),
    "layer_report": _layer_report,
    # logits_fn doubles (exact in every dtype: half tensors reach it as half tensors)
    "output_perturbation": lambda c: refgeo.output_perturbation(lambda h: 2.0 * h, c(H3), c(H3p)),
    "output_perturbation_per_token": lambda c: refgeo.output_perturbation(
        lambda h: 2.0 * h, c(H3[0]), c(H3p[0]), mode="per_token", divergence="js", readout="sum"
    ),
    "spearman": lambda c: refgeo.spearman(c(A), c(B)),
    "embed": lambda c: refgeo.embed(c(S), d=8),
    "spread_update": lambda c: refgeo.spread_update(c(S[:6, :3]), seed=0, n_points=3, n_starts=1),
}

# Cases whose inputs alone are not enough to reach every kind of bad input in the
# same way (precomputed integer neighbors go in as they are).
_ENGINE = {
    "row_diameter": lambda c: refgeo.row_diameter(c(S)),
    "closest_pair": lambda c: refgeo.closest_pair(c(S)),
    "distance_ratio": lambda c: refgeo.distance_ratio(c(S)),
    "farthest_partners": lambda c: refgeo.farthest_partners(c(S)),
    "knn": lambda c: refgeo.knn(c(S), 3),
}
ALL_CASES = {**CASES, **_ENGINE}


def _assert_same(got, want, where="result"):
    """``got`` (tensor input) equals ``want`` (NumPy input) exactly, arrays as tensors."""
    if isinstance(want, np.ndarray):
        assert isinstance(got, torch.Tensor), f"{where}: {type(got).__name__}, not a tensor"
        assert got.device.type == "cpu"
        assert str(got.dtype) == f"torch.{want.dtype}", where
        np.testing.assert_array_equal(got.numpy(), want, err_msg=where)
    elif dataclasses.is_dataclass(want):
        assert type(got) is type(want), where
        for f in dataclasses.fields(want):
            _assert_same(getattr(got, f.name), getattr(want, f.name), f"{where}.{f.name}")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_same(g, w, f"{where}[{i}]")
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for k in want:
            _assert_same(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, float):
        # scalars come back as Python floats (NumPy input may give NumPy scalars)
        assert type(got) is float, f"{where}: {type(got).__name__}, not a float"
        assert got == want or (math.isnan(got) and math.isnan(want)), where
    else:
        assert got == want, where


def _grad(a):
    t = torch.tensor(a, requires_grad=True)
    return t, t


def _strided(a):
    # the same values, every last-axis stride 2: a view NumPy sees as non-contiguous
    leaf = torch.from_numpy(np.repeat(a, 2, axis=-1).copy()).requires_grad_(True)
    return leaf, leaf[..., ::2]


def _run_quietly(case, c):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return case(c)


@pytest.fixture(params=["reference", "cython"])
def cpu_backend(request):
    ok, why = _backend.available_backends()[request.param]
    if not ok:
        pytest.skip(f"backend {request.param!r} unavailable: {why}")
    with refgeo.use_backend(request.param):
        yield request.param


@pytest.mark.parametrize("kind", ["requires_grad", "strided"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_tensor_result_equals_numpy_result(name, dtype, kind, cpu_backend):
    """Arrays come back as CPU tensors holding exactly the NumPy call's values; scalars as
    Python floats; no warning (requires_grad included); nothing is recorded on the graph."""
    made = _check_tensor_equals_numpy(CASES[name], name, dtype, kind)
    if kind == "strided":
        assert any(not t.is_contiguous() for t in made)


def _check_tensor_equals_numpy(case, name, dtype, kind):
    """Run ``case`` on NumPy arrays and on tensors of ``kind`` holding the same values:
    the results must be the same and no gradient may reach the leaves.  Returns the
    tensors the case was given."""
    make = {"requires_grad": _grad, "strided": _strided}[kind]
    made, leaves = [], []

    def to_tensor(a):
        leaf, t = make(np.asarray(a, dtype=dtype))
        made.append(t)
        leaves.append(leaf)
        return t

    want = case(lambda a: np.asarray(a, dtype=dtype))
    got = _run_quietly(case, to_tensor)
    _assert_same(got, want, name)
    assert all(t.grad is None for t in leaves)
    return made


def _check_half_runs_as_float32(case, name, half):
    """A bfloat16/float16 tensor gives exactly the float32 result of its values."""
    half_dtype = getattr(torch, half)

    def rounded(a):  # the half values, as a float32 NumPy array (exact)
        return torch.from_numpy(np.asarray(a, dtype=np.float32)).to(half_dtype).to(torch.float32).numpy()

    want = case(rounded)
    got = _run_quietly(case, lambda a: torch.from_numpy(np.asarray(a, dtype=np.float32)).to(half_dtype))
    _assert_same(got, want, name)


def _check_non_float_tensors_refused(case):
    for dtype in (torch.int64, torch.int32, torch.bool):
        with pytest.raises(TypeError, match=r"must have a real floating dtype .* got dtype torch\.(int|bool)"):
            case(lambda a: torch.from_numpy(np.asarray(a)).to(dtype))
    with pytest.raises(TypeError, match=r"must have a real floating dtype .* got dtype torch\.complex128"):
        case(lambda a: torch.from_numpy(np.asarray(a, dtype=np.complex128)))


def _with_nan(a):
    a = np.array(a, dtype=np.float64)
    a.flat[a.size // 2] = np.nan
    return torch.from_numpy(a)


@pytest.mark.parametrize("half", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_half_tensors_run_as_float32(name, half):
    """bfloat16/float16 tensors give exactly the float32 result of the same values."""
    _check_half_runs_as_float32(CASES[name], name, half)


@pytest.mark.parametrize("half", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("name", ["variation", "pdist_hilbert", "cdist_hilbert", "covering_radius",
                                  "hilbert_rms", "embed"])
def test_float8_tensors_run_as_float32(name, half):
    """float8 tensors (no NumPy dtype, like bfloat16) give exactly the float32 result of
    their values; they raised torch's "unsupported ScalarType" TypeError."""
    _check_half_runs_as_float32(CASES[name], name, half)


@pytest.mark.parametrize("half", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("name", ["row_diameter", "closest_pair", "farthest_partners", "knn"])
def test_float8_engine_results_say_converted(name, half):
    """The engine's results equal those of the float32 values, and say what they came from."""
    dtype = getattr(torch, half)
    t = torch.from_numpy(S.astype(np.float32)).to(dtype)
    got = _run_quietly(_ENGINE[name], lambda a: t)
    want = _ENGINE[name](lambda a: t.to(torch.float32).numpy())
    assert got.converted_from == f"torch.{half}"
    _assert_same(dataclasses.replace(got, converted_from=None), want, name)


@pytest.mark.parametrize("half", ["bfloat16", "float16"])
@pytest.mark.parametrize("mode", ["all", "per_token"])
def test_output_perturbation_gives_a_half_model_its_own_dtype(half, mode):
    """A bfloat16/float16 head gets states of its own dtype (the float32 copies made its
    matmul raise); the divergences are those of its logits, computed here directly."""
    dtype = getattr(torch, half)
    torch.manual_seed(3)
    head = torch.nn.Linear(4, 6, bias=False).to(dtype)
    Ho = torch.from_numpy(H3[0].astype(np.float32)).to(dtype)
    Hp = torch.from_numpy(H3p[0].astype(np.float32)).to(dtype)
    seen = []

    def logits_fn(h):
        seen.append(h.dtype)
        return head(h)

    got = refgeo.output_perturbation(logits_fn, Ho, Hp, mode=mode)
    assert set(seen) == {dtype}

    def logp(H):  # float64 log-softmax of the head's own logits
        L = head(H).detach().double().numpy()
        L = L - L.max(axis=-1, keepdims=True)
        return L - np.log(np.exp(L).sum(axis=-1, keepdims=True))

    lp = logp(Ho)
    if mode == "all":
        lq = logp(Hp)
        want = np.sum(np.exp(lp) * (lp - lq), axis=-1)
    else:
        want = np.empty(Ho.shape[0])
        for t in range(Ho.shape[0]):
            H = Ho.clone()
            H[t] = Hp[t]
            lq = logp(H)
            want[t] = np.sum(np.exp(lp[t]) * (lp[t] - lq[t]))
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("name", sorted(ALL_CASES))
def test_integer_boolean_and_complex_tensors_are_type_errors(name):
    _check_non_float_tensors_refused(ALL_CASES[name])


@pytest.mark.parametrize("name", sorted(ALL_CASES))
def test_non_finite_tensors_are_value_errors(name):
    with pytest.raises(ValueError, match=r"(must contain only finite values, got 1 NaN|not NaN)"):
        ALL_CASES[name](_with_nan)


@pytest.mark.parametrize("name", sorted(ALL_CASES))
def test_every_function_converts_through_interop(name):
    """Tensors refgeo cannot run (meta: shapes without values) get the converter's
    TypeError: every function goes through it, so CUDA tensors get its CuPy message as
    well.  The message does not suggest ``.cpu()``, which cannot copy a meta tensor."""
    case = ALL_CASES[name]
    with pytest.raises(TypeError, match=r"is a meta tensor \(a shape without values\)") as info:
        case(lambda a: torch.empty(np.shape(a), dtype=torch.float64, device="meta"))
    assert ".cpu()" not in str(info.value)


def test_cuda_tensors_without_cupy_say_what_to_install():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    try:
        import cupy  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("CuPy is installed")
    with pytest.raises(TypeError, match="CuPy is not installed: install it"):
        refgeo.pdist_hilbert(torch.zeros((3, 4), device="cuda"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_pairwise_kernels_read_a_contiguous_tensor_in_place(monkeypatch, dtype):
    """pdist/cdist_hilbert hand the compiled kernel the tensor's own memory (no copy)."""
    ok, why = _backend.available_backends()["cython"]
    if not ok:
        pytest.skip(why)
    from refgeo_ext import _tropical

    seen = []
    suffix = "32" if dtype == torch.float32 else "64"
    for fn_name in ("pdist_logits" + suffix, "cdist_logits" + suffix):
        real = getattr(_tropical, fn_name)

        def spy(*args, _real=real, **kwargs):
            seen.extend(a.__array_interface__["data"][0] for a in args[:2] if isinstance(a, np.ndarray))
            return _real(*args, **kwargs)

        monkeypatch.setattr(_tropical, fn_name, spy)
    t = torch.randn(40, 300, dtype=dtype, requires_grad=True)
    u = torch.randn(10, 300, dtype=dtype)
    with refgeo.use_backend("cython"):
        d = refgeo.pdist_hilbert(t)
        c = refgeo.cdist_hilbert(t, u)
        want = refgeo.pdist_hilbert(t.detach().numpy().copy())
    assert t.data_ptr() in seen and u.data_ptr() in seen
    np.testing.assert_array_equal(d.numpy(), want)
    assert c.shape == (40, 10)


def test_results_share_memory_with_the_computed_array():
    """Array results are wrapped, not copied (torch.from_numpy on the result)."""
    t = torch.randn(20, 5)
    d = refgeo.pdist_hilbert(t)
    assert d.is_contiguous() and d.dtype == torch.float64
    fit = refgeo.fit_local_maps(t, 2 * t, k=5, cls="diagonal")
    # the frozen NumPy result is read-only; its tensor is a writable view of the same memory
    assert isinstance(fit.fitted, torch.Tensor) and fit.fitted.shape == (20, 5)


def test_logits_fn_sees_tensors_for_tensor_states():
    seen = []

    def logits_fn(h):
        seen.append(type(h))
        return 2.0 * h

    H = torch.randn(4, 3, requires_grad=True)
    out = refgeo.output_perturbation(logits_fn, H, H + 0.1)
    assert set(seen) == {torch.Tensor} and isinstance(out, torch.Tensor)
    refgeo.output_perturbation(logits_fn, H.detach().numpy(), H.detach().numpy())
    assert seen[-1] is np.ndarray


def test_jax_arrays():
    """CPU JAX arrays: the same results, in JAX with x64 on; integer arrays are a TypeError."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    was = jax.config.read("jax_enable_x64")
    jax.config.update("jax_enable_x64", True)
    try:
        Zj = jnp.asarray(Z)
        got = refgeo.pdist_hilbert(Zj)
        assert isinstance(got, jax.Array)
        np.testing.assert_array_equal(np.asarray(got), refgeo.pdist_hilbert(Z))
        assert refgeo.row_diameter(Zj) == refgeo.row_diameter(Z)
        kn = refgeo.knn(jnp.asarray(S), 3)
        assert isinstance(kn.indices, jax.Array) and kn.indices.dtype == jnp.int64
        np.testing.assert_array_equal(np.asarray(kn.indices), refgeo.knn(S, 3).indices)
        assert type(refgeo.variation(jnp.asarray(Z[0]))) is float
        with pytest.raises(TypeError, match="must have a real floating dtype"):
            refgeo.pdist_hilbert(jnp.asarray(Z).astype(jnp.int32))
        jax.config.update("jax_enable_x64", False)
        # 32-bit JAX: float32 in; the float64 distances stay NumPy rather than be rounded
        Z32 = Z.astype(np.float32)
        got = refgeo.pdist_hilbert(jnp.asarray(Z32))
        assert isinstance(got, np.ndarray) and got.dtype == np.float64
        np.testing.assert_array_equal(got, refgeo.pdist_hilbert(Z32))
    finally:
        jax.config.update("jax_enable_x64", was)


# --------------------------------------------------------------------------- LMO and optimizers
# Centered gradients (the LMO functions require 1^T G = 0 up to 1e-4 relative); integer
# values, so that the float32 and half-precision copies are centered exactly as well.
GC = _RNG.integers(-4, 5, size=(12, 4)).astype(np.float64)
GC[-1] -= GC.sum(axis=0)
GC2 = _RNG.integers(-4, 5, size=(12, 4)).astype(np.float64)
GC2[-1] -= GC2.sum(axis=0)


def _timeless(r):
    # everything of an LMOResult but its wall time is a function of the input
    return dataclasses.replace(r, elapsed=0.0)


def _optimizer_steps(opt, c):
    # a NumPy parameter stepped with the gradients under test: comes back as a tensor
    # sharing its memory when the gradients are tensors
    W = np.zeros(GC.shape)
    opt.step(W, c(GC))
    return opt.step(W, c(GC2))


LMO_CASES = {
    "center_rows": lambda c: refgeo.center_rows(c(S)),
    "row_normalize": lambda c: refgeo.row_normalize(c(S), eps=1e-3),
    "projected_rownorm": lambda c: refgeo.projected_rownorm(c(S), eta=0.5),
    "rescaled_rownorm": lambda c: refgeo.rescaled_rownorm(c(GC), eta=0.5),
    "tension_bounds": lambda c: refgeo.tension_bounds(c(GC)),
    "diameter_lmo": lambda c: _timeless(refgeo.diameter_lmo(c(GC), eta=0.5, rtol=1e-6)),
    "RowNorm.step": lambda c: _optimizer_steps(refgeo.RowNorm(lr=0.1, mu=0.9), c),
    "DiameterLMO.step": lambda c: _optimizer_steps(refgeo.DiameterLMO(lr=0.1, momentum=0.5), c),
}


@pytest.mark.parametrize("kind", ["requires_grad", "strided"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("name", sorted(LMO_CASES))
def test_lmo_tensor_result_equals_numpy_result(name, dtype, kind):
    made = _check_tensor_equals_numpy(LMO_CASES[name], name, dtype, kind)
    if kind == "strided":
        assert all(not t.is_contiguous() for t in made)


@pytest.mark.parametrize("half", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", sorted(LMO_CASES))
def test_lmo_half_tensors_run_as_float32(name, half):
    _check_half_runs_as_float32(LMO_CASES[name], name, half)


@pytest.mark.parametrize("name", sorted(LMO_CASES))
def test_lmo_bad_tensors(name):
    """Integer, boolean and complex tensors: TypeError; non-finite ones: ValueError; a
    device refgeo cannot run: the converter's TypeError (so every entry point converts)."""
    case = LMO_CASES[name]
    _check_non_float_tensors_refused(case)
    with pytest.raises(ValueError, match=r"must contain only finite values, got 1 NaN"):
        case(_with_nan)
    with pytest.raises(TypeError, match=r"is a meta tensor \(a shape without values\)"):
        case(lambda a: torch.empty(np.shape(a), dtype=torch.float64, device="meta"))


@pytest.mark.parametrize("opt_cls", [refgeo.RowNorm, refgeo.DiameterLMO])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_tensor_parameters_are_updated_in_place(opt_cls, dtype):
    """A tensor parameter is updated in place and returned itself (half-precision ones
    through a float32 copy written back); the optimizer state stays NumPy."""
    W0 = _RNG.standard_normal(GC.shape)
    leaf = torch.tensor(np.repeat(W0, 2, axis=1)).to(dtype).requires_grad_(True)
    Wt = leaf[:, ::2]  # non-contiguous
    Wnp = Wt.detach().to(torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype).numpy().copy()
    got_opt, want_opt = opt_cls(lr=0.1), opt_cls(lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for g in (GC, GC2):
            assert got_opt.step(Wt, torch.tensor(g, requires_grad=True)) is Wt
            want_opt.step(Wnp, g)
            # the parameter holds its own dtype between steps
            Wnp[...] = torch.from_numpy(Wnp).to(dtype).to(torch.from_numpy(Wnp).dtype).numpy()
    want = torch.from_numpy(Wnp).to(dtype).to(torch.float64).numpy()
    np.testing.assert_array_equal(Wt.detach().to(torch.float64).numpy(), want)
    np.testing.assert_array_equal(leaf.detach()[:, 1::2].to(torch.float64).numpy(),
                                  torch.tensor(W0[:, :]).to(dtype).to(torch.float64).numpy())
    assert leaf.grad is None
    state = got_opt.state_dict()
    assert isinstance(state["buffer"], np.ndarray) or state["buffer"] is None
    assert isinstance(got_opt.last_step(), np.ndarray)
    np.testing.assert_array_equal(got_opt.last_step(), want_opt.last_step())


def test_lmo_warm_start_from_a_tensor_result():
    t = torch.tensor(GC)
    first = refgeo.diameter_lmo(t, rtol=1e-3)
    assert isinstance(first.update, torch.Tensor) and isinstance(first.pairs, torch.Tensor)
    got = refgeo.diameter_lmo(torch.tensor(GC2), rtol=1e-6, warm_start=first)
    want = refgeo.diameter_lmo(GC2, rtol=1e-6, warm_start=refgeo.diameter_lmo(GC, rtol=1e-3))
    _assert_same(_timeless(got), _timeless(want))


def test_jax_parameters_are_refused():
    jax = pytest.importorskip("jax")
    with pytest.raises(TypeError, match="JAX array instead, which cannot be updated in place"):
        refgeo.RowNorm(lr=0.1).step(jax.numpy.zeros(GC.shape), GC)


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_half_tensors_as_secondary_arguments_read_as_float32(half):
    """spread(init=), lattice_ball(center=) and the fields of diameter_lmo's warm start
    read low-precision tensors as the exact float32 arrays (torch's "Got unsupported
    ScalarType BFloat16" named no argument)."""
    init = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.5, 0.5], [0.25, 0.75], [1.0, 1.0]], dtype=half)
    want = refgeo.spread(5, 2, init=init.float().numpy(), method="smooth", max_time=5.0, seed=0)
    got = refgeo.spread(5, 2, init=init, method="smooth", max_time=5.0, seed=0)
    assert got.ratio == want.ratio
    center = torch.tensor([0.5, 0.25, 0.0, 0.0], dtype=half)
    np.testing.assert_array_equal(refgeo.lattice_ball(7, "D4", center=center),
                                  refgeo.lattice_ball(7, "D4", center=center.float().numpy()))
    G = GC.astype(np.float64)
    first = refgeo.diameter_lmo(G)
    warm = dataclasses.replace(first, update=torch.from_numpy(np.array(first.update)).to(half))
    assert np.isfinite(refgeo.diameter_lmo(G, warm_start=warm).gap)
