"""The head optimizers of docs/theory/lmo.md: RowNorm (as trained in the source) and DiameterLMO."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import refgeo


def _centered(A):
    return A - A.mean(axis=0, keepdims=True)


def _brute_diameter(S):
    diff = S[:, None, :] - S[None, :, :]
    return float(np.sqrt(np.max(np.einsum("ijk,ijk->ij", diff, diff))))


def _rn(B, eps):
    """RN_eps by its definition, row by row."""
    out = np.zeros_like(B)
    for i, b in enumerate(B):
        n = math.sqrt(float(b @ b)) + eps
        if n > 0:
            out[i] = b / n
    return out


def _grads(seed, n=4, V=7, d=3):
    rng = np.random.default_rng(seed)
    return [_centered(rng.standard_normal((V, d))) for _ in range(n)]


finite = dict(allow_nan=False, allow_infinity=False, allow_subnormal=False)


@settings(max_examples=30)
@given(
    hnp.arrays(np.float64, st.tuples(st.integers(2, 9), st.integers(1, 4)), elements=st.floats(-1e3, 1e3, **finite)),
    st.floats(1e-3, 10.0),
    st.booleans(),
)
def test_rownorm_step_within_two_gamma(G, lr, project):
    opt = refgeo.RowNorm(lr=lr, project=project)
    W = np.zeros_like(G)
    for _ in range(2):
        opt.step(W, G)
        S = opt.last_step()
        assert _brute_diameter(S) <= 2 * lr * (1 + 1e-12)


def test_rownorm_matches_definition_with_bias_correction():
    grads = _grads(0)
    mu, eps, lr = 0.9, 1e-3, 0.05
    opt = refgeo.RowNorm(lr=lr, mu=mu, eps=eps)
    W = np.ones((7, 3))
    B = np.zeros((7, 3))
    expected_W = W.copy()
    for t, g in enumerate(grads, start=1):
        B = mu * B + (1 - mu) * g
        S = -lr * _rn(B / (1 - mu**t), eps)
        expected_W += S
        opt.step(W, g)
        np.testing.assert_allclose(opt.last_step(), S, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(W, expected_W, rtol=1e-13)


def test_eps_forms_equivalent():
    """Bias correction acts only through eps: corrected with eps == uncorrected with
    eps * (1 - mu^t); with eps = 0 bias correction changes nothing."""
    grads = _grads(1)
    mu, eps = 0.95, 1e-2
    a = refgeo.RowNorm(lr=1.0, mu=mu, eps=eps, bias_correction=True)
    zero_a = refgeo.RowNorm(lr=1.0, mu=mu, eps=0.0, bias_correction=True)
    zero_b = refgeo.RowNorm(lr=1.0, mu=mu, eps=0.0, bias_correction=False)
    Wa, Wz1, Wz2 = (np.zeros((7, 3)) for _ in range(3))
    B = np.zeros((7, 3))
    for t, g in enumerate(grads, start=1):
        a.step(Wa, g)
        B = mu * B + (1 - mu) * g
        np.testing.assert_allclose(a.last_step(), -_rn(B, eps * (1 - mu**t)), rtol=1e-12)
        zero_a.step(Wz1, g)
        zero_b.step(Wz2, g)
        np.testing.assert_allclose(zero_a.last_step(), zero_b.last_step(), rtol=1e-13)


def test_first_step_is_rownorm_of_gradient():
    g = _grads(2, n=1)[0]
    opt = refgeo.RowNorm(lr=0.5, eps=0.0)
    W = np.zeros_like(g)
    opt.step(W, g)
    np.testing.assert_allclose(W, -0.5 * refgeo.row_normalize(g), rtol=1e-13)
    # with the outer P the step is the projected RowNorm step (eta = 2 * lr)
    opt = refgeo.RowNorm(lr=0.5, eps=0.0, project=True)
    W = np.zeros_like(g)
    opt.step(W, g)
    np.testing.assert_allclose(W, refgeo.projected_rownorm(g, eta=1.0), rtol=1e-12, atol=1e-15)


def test_state_round_trip():
    grads = _grads(3, n=6)
    a = refgeo.RowNorm(lr=0.1, mu=0.8, weight_decay=0.01, project=True)
    Wa = np.ones((7, 3))
    for g in grads[:3]:
        a.step(Wa, g)
    state = a.state_dict()
    b = refgeo.RowNorm(lr=1.0)
    b.load_state_dict(state)
    state["buffer"][:] = 0.0  # the state dict holds a copy
    Wb = Wa.copy()
    for g in grads[3:]:
        a.step(Wa, g)
        b.step(Wb, g)
    np.testing.assert_array_equal(Wa, Wb)
    assert b.t == a.t == 6


def test_zero_gradient_gives_zero_step():
    opt = refgeo.RowNorm(lr=0.3)
    W = np.full((4, 2), 2.0)
    opt.step(W, np.zeros((4, 2)))
    np.testing.assert_array_equal(W, 2.0)
    np.testing.assert_array_equal(opt.last_step(), 0.0)
    d = refgeo.DiameterLMO(lr=0.3)
    d.step(W, np.zeros((4, 2)))
    np.testing.assert_array_equal(W, 2.0)


def test_weight_decay_is_decoupled_and_excluded_from_last_step():
    g = _grads(4, n=1)[0]
    W = np.full((7, 3), 3.0)
    opt = refgeo.RowNorm(lr=0.1, weight_decay=0.5, eps=0.0)
    opt.step(W, g)
    S = -0.1 * refgeo.row_normalize(g)
    np.testing.assert_allclose(opt.last_step(), S, rtol=1e-13)
    np.testing.assert_allclose(W, 3.0 * (1 - 0.1 * 0.5) + S, rtol=1e-13)


def _steps(grads, transform=lambda g: g, **kw):
    opt = refgeo.RowNorm(lr=0.2, **kw)
    W = np.zeros_like(transform(grads[0]))
    out = []
    for g in grads:
        opt.step(W, transform(g))
        out.append(opt.last_step())
    return out


def test_rownorm_invariances():
    grads = _grads(5)
    rng = np.random.default_rng(0)
    base = _steps(grads, eps=0.0)
    perm = rng.permutation(7)
    for s, sp in zip(base, _steps(grads, lambda g: g[perm], eps=0.0)):
        np.testing.assert_allclose(sp, s[perm], rtol=1e-13)
    Q, _ = np.linalg.qr(rng.standard_normal((3, 3)))
    for s, sq in zip(base, _steps(grads, lambda g: g @ Q, eps=0.0)):
        np.testing.assert_allclose(sq, s @ Q, rtol=1e-12, atol=1e-14)
    for s, sc in zip(base, _steps(grads, lambda g: 7.5 * g, eps=0.0)):
        np.testing.assert_allclose(sc, s, rtol=1e-13)
    shift = rng.standard_normal(3)
    for s, ss in zip(base, _steps(grads, lambda g: g + shift, eps=0.0)):
        np.testing.assert_allclose(ss, s, rtol=1e-12, atol=1e-14)


def test_diameter_lmo_optimizer():
    grads = _grads(6, n=4, V=12, d=3)
    lr = 0.25
    opt = refgeo.DiameterLMO(lr=lr, momentum=0.5, rtol=1e-6, weight_decay=0.1)
    W = np.ones((12, 3))
    M = np.zeros((12, 3))
    for g in grads:
        W_before = W.copy()
        opt.step(W, g)
        S = opt.last_step()
        assert refgeo.row_diameter(S).value <= lr
        np.testing.assert_allclose(W, W_before * (1 - lr * 0.1) + S, rtol=1e-13)
        M = 0.5 * M + 0.5 * g
        res = opt.last_result
        assert res.gap <= 1e-6
        assert -np.sum(M * S) == pytest.approx(lr * res.lower_bound, rel=1e-12)
        # beats RowNorm's radius step on the same direction
        assert -np.sum(M * S) >= -np.sum(M * refgeo.projected_rownorm(M, eta=lr)) * (1 - 1e-12)
    state = opt.state_dict()
    other = refgeo.DiameterLMO(lr=1.0)
    other.load_state_dict(state)
    g = _grads(7, n=1, V=12, d=3)[0]
    Wa, Wb = W.copy(), W.copy()
    opt.step(Wa, g)
    other.step(Wb, g)
    np.testing.assert_allclose(Wa, Wb, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("make", [lambda: refgeo.RowNorm(lr=0.1, eps=1e-3, project=True),
                                  lambda: refgeo.DiameterLMO(lr=0.1, momentum=0.5)])
def test_steps_do_not_depend_on_the_memory_layout_of_the_gradient(make):
    """Fortran-order, strided and reversed gradients give the same parameters, bit for bit."""
    from ._layouts import assert_same_result, other_layouts

    grads = _grads(5, n=3, V=9, d=4)

    def run(gs):
        W, opt = np.zeros((9, 4)), make()
        for g in gs:
            opt.step(W, g)
        return W

    want = run(grads)
    for views in zip(*(other_layouts(g) for g in grads)):
        assert_same_result(run(views), want)


def test_bad_input():
    opt = refgeo.RowNorm(lr=0.1)
    with pytest.raises(TypeError, match=re.escape("param must be a float32 or float64 numpy.ndarray")):
        opt.step([[1.0, 2.0]], np.zeros((1, 2)))
    W = np.zeros((3, 2))
    with pytest.raises(ValueError, match=re.escape("param and grad must have the same shape")):
        opt.step(W, np.zeros((3, 3)))
    ro = np.zeros((3, 2))
    ro.setflags(write=False)
    with pytest.raises(ValueError, match=re.escape("param must be a writeable array")):
        opt.step(ro, np.zeros((3, 2)))
    bad = np.zeros((3, 2))
    bad[1, 1] = np.inf
    with pytest.raises(ValueError, match=re.escape("grad must contain only finite values, got 0 NaN and 1 infinite entries instead.")):
        opt.step(W, bad)
    with pytest.raises(ValueError, match=re.escape("lr == 0.0, must be > 0.0.")):
        refgeo.RowNorm(lr=0.0)
    with pytest.raises(ValueError, match=re.escape("mu must be in [0, 1), got 1.0 instead.")):
        refgeo.RowNorm(lr=0.1, mu=1.0)
    with pytest.raises(ValueError, match=re.escape("momentum must be in [0, 1), got 1.5 instead.")):
        refgeo.DiameterLMO(lr=0.1, momentum=1.5)
    with pytest.raises(ValueError, match=re.escape("grad must have rows summing to zero")):
        refgeo.DiameterLMO(lr=0.1).step(W, np.ones((3, 2)))
    # a subnormal diameter budget cannot carry a step: refused by its own name when the
    # optimizer is built (it was accepted, then the first step's error blamed the
    # gradient and called it "eta")
    with pytest.raises(ValueError, match=re.escape("lr == 1e-310, must be >= 2.2250738585072014e-308")):
        refgeo.DiameterLMO(lr=1e-310)


def test_a_step_size_beyond_the_parameters_dtype_is_refused_before_any_change():
    """The step's entries reach lr (2 lr with project=True): an lr beyond the largest
    value of the parameter's dtype wrote inf into a float32 weight (a RuntimeWarning)
    and into a float16 tensor (silently)."""
    g = np.array([[1.0, 0.0], [-1.0, 0.0]])
    W = np.zeros((2, 2), dtype=np.float32)
    opt = refgeo.RowNorm(lr=1e39)
    with pytest.raises(ValueError, match=re.escape("lr == 1e+39, must be <= 3.40282e+38 for param of dtype float32")):
        opt.step(W, g)
    assert opt.t == 0 and opt.buffer is None and not W.any()
    torch = pytest.importorskip("torch")
    T = torch.zeros(2, 2, dtype=torch.float16)
    with pytest.raises(ValueError, match=re.escape("must be <= 32752 for param of dtype float16: the step's "
                                                   "entries reach 2 lr (project=True)")):
        refgeo.RowNorm(lr=4e4, project=True).step(T, g)
    assert not T.any()
    out = refgeo.RowNorm(lr=6e4, eps=0.0).step(T, g)  # within float16's 65504: finite
    assert torch.isfinite(out).all() and float(out.abs().max()) == 60000.0


def test_a_diameter_lmo_step_beyond_the_parameters_dtype_is_refused_before_any_change():
    """The LMO step's entries reach lr (centered rows of diameter lr): with no check an lr
    beyond the dtype's top wrote inf into a float32 array (a RuntimeWarning) and into a
    float16 tensor (silently), and the step count and warm start moved."""
    g = np.array([[1.0, 0.0], [-1.0, 0.0], [0.0, 0.0]])
    W = np.zeros((3, 2), dtype=np.float32)
    opt = refgeo.DiameterLMO(lr=1e39)
    with pytest.raises(ValueError, match=re.escape("lr == 1e+39, must be <= 3.40282e+38 for param of dtype float32: "
                                                   "the step's entries reach lr")):
        opt.step(W, g)
    assert opt.t == 0 and opt.last_result is None and not W.any()
    torch = pytest.importorskip("torch")
    T = torch.zeros(3, 2, dtype=torch.float16)
    with pytest.raises(ValueError, match=re.escape("must be <= 65504 for param of dtype float16")):
        refgeo.DiameterLMO(lr=2e5).step(T, g)
    assert not T.any()
    out = refgeo.DiameterLMO(lr=6e4).step(T, g)  # within float16's 65504: finite
    assert torch.isfinite(out).all() and float(out.abs().max()) == 30000.0


def test_failed_step_changes_no_state():
    """A gradient the LMO rejects (rows not summing to zero) leaves buffer and warm start
    as they were: the next valid steps match an optimizer that never saw it."""
    grads = _grads(4, n=3)
    W1, W2 = np.zeros((7, 3)), np.zeros((7, 3))
    a = refgeo.DiameterLMO(lr=0.1, momentum=0.9, rtol=1e-6)
    b = refgeo.DiameterLMO(lr=0.1, momentum=0.9, rtol=1e-6)
    a.step(W1, grads[0])
    b.step(W2, grads[0])
    with pytest.raises(ValueError, match=re.escape("grad must have rows summing to zero")):
        a.step(W1, grads[1] + 1.0)
    np.testing.assert_array_equal(a.buffer, b.buffer)
    for g in grads[1:]:
        a.step(W1, g)
        b.step(W2, g)
    np.testing.assert_array_equal(W1, W2)
    with pytest.raises(ValueError, match=re.escape("grad must keep the shape of the optimizer state (7, 3)")):
        a.step(np.zeros((7, 1)), np.zeros((7, 1)))


def test_hyperparameters_changed_between_steps_are_checked():
    W, g = np.zeros((7, 3)), _grads(5, n=1)[0]
    opt = refgeo.RowNorm(lr=0.1)
    opt.mu = 1.0
    with pytest.raises(ValueError, match=re.escape("mu must be in [0, 1), got 1.0 instead.")):
        opt.step(W, g)
    opt = refgeo.DiameterLMO(lr=0.1)
    opt.momentum = 1.0
    with pytest.raises(ValueError, match=re.escape("momentum must be in [0, 1), got 1.0 instead.")):
        opt.step(W, g)
    assert not W.any()
    with pytest.raises(ValueError, match=re.escape("rtol must be in (0, 1), got 2.0 instead.")):
        refgeo.DiameterLMO(lr=0.1, rtol=2.0)
    with pytest.raises(TypeError, match=re.escape("project must be a bool, got str instead.")):
        refgeo.RowNorm(lr=0.1, project="no")


def test_load_state_dict_rejects_inconsistent_state():
    W, g = np.zeros((7, 3)), _grads(6, n=1)[0]
    opt = refgeo.DiameterLMO(lr=0.1, momentum=0.5)
    opt.step(W, g)
    good = opt.state_dict()
    with pytest.raises(ValueError, match=re.escape("state['t'] == -1, must be >= 0.")):
        refgeo.RowNorm(lr=0.1).load_state_dict({**refgeo.RowNorm(lr=0.1).state_dict(), "t": -1})
    with pytest.raises(ValueError, match=re.escape("state['warm_pairs'] must be integer pairs of rows in [0, 6]")):
        refgeo.DiameterLMO(lr=0.1).load_state_dict({**good, "warm_pairs": np.array([[0, 99]])})
    with pytest.raises(ValueError, match=re.escape("state['warm_update'] must have the buffer's shape (7, 3)")):
        refgeo.DiameterLMO(lr=0.1).load_state_dict({**good, "warm_update": np.zeros((4, 3))})
    # a warm start without its pairs or flows raised KeyError
    for key in ("warm_pairs", "warm_flows"):
        partial = {k: v for k, v in good.items() if k != key}
        with pytest.raises(ValueError, match=re.escape(f"state must have the keys of state_dict(), got one without ['{key}'] instead.")):
            refgeo.DiameterLMO(lr=0.1).load_state_dict(partial)
    fresh = refgeo.DiameterLMO(lr=1.0)
    fresh.load_state_dict(good)
    np.testing.assert_array_equal(fresh.buffer, opt.buffer)


def test_a_step_count_beyond_the_float64_range_steps():
    """A restored count of 10**400 was accepted, then the next bias-corrected step raised
    OverflowError (``mu**t`` of an int beyond float64's range).  Any count steps (mu**t
    is 0 there, so the step is the plain buffer's), and the count it leaves loads back
    (a cap on load at 2**63 - 1 left 2**63 after one step, which no longer loaded)."""
    W, g = np.zeros((2, 2)), np.array([[3.0, 4.0], [-3.0, -4.0]])
    for t in (2**63 - 1, 10**400):
        opt = refgeo.RowNorm(lr=0.1, mu=0.9)
        opt.step(W, g)
        plain = refgeo.RowNorm(lr=0.1, mu=0.9, bias_correction=False)
        plain.load_state_dict({**opt.state_dict(), "bias_correction": False})
        opt.load_state_dict({**opt.state_dict(), "t": t})
        W1, W2 = np.zeros((2, 2)), np.zeros((2, 2))
        opt.step(W1, g)
        plain.step(W2, g)
        np.testing.assert_array_equal(W1, W2)
        assert opt.t == t + 1
        refgeo.RowNorm(lr=0.1, mu=0.9).load_state_dict(opt.state_dict())


@pytest.mark.parametrize("cls", [refgeo.RowNorm, refgeo.DiameterLMO])
@pytest.mark.parametrize(
    "change, error, message",
    [
        ({"t": True}, TypeError, "state['t'] must be an integer, got bool (True) instead."),
        ({"lr": -1.0}, ValueError, "lr == -1.0, must be > 0.0."),
        ("drop t", ValueError, "state must have the keys of state_dict(), got one without ['t'] instead."),
        ("list", TypeError, "state must be a dict from state_dict(), got list instead."),
    ],
    ids=["t_bool", "lr", "missing_key", "not_a_dict"],
)
def test_failed_load_state_dict_changes_nothing(cls, change, error, message):
    # The optimizer was reset (t = 0, no buffer, the bad state's hyper-parameters) before
    # the state was checked, so a failed load lost the training state.
    W, g = np.zeros((7, 3)), _grads(7, n=1)[0]
    opt = cls(lr=0.1, **({"momentum": 0.5} if cls is refgeo.DiameterLMO else {}))
    opt.step(W, g)
    opt.step(W, g)
    before = opt.state_dict()
    state = dict(before)
    if change == "drop t":
        del state["t"]
    elif change == "list":
        state = [1]
    else:
        state.update(change)
    with pytest.raises(error, match=re.escape(message)):
        opt.load_state_dict(state)
    after = opt.state_dict()
    assert after.keys() == before.keys()
    for key in before:
        if isinstance(before[key], np.ndarray):
            np.testing.assert_array_equal(after[key], before[key])
        else:
            assert after[key] == before[key]


def test_diameter_lmo_restored_warm_start_is_checked():
    W, g = np.zeros((7, 3)), _grads(8, n=1)[0]
    opt = refgeo.DiameterLMO(lr=0.1)
    opt.step(W, g)
    good = opt.state_dict()
    with pytest.raises(ValueError, match=re.escape("state['warm_eta'] must be a finite number, got nan instead.")):
        refgeo.DiameterLMO(lr=0.1).load_state_dict({**good, "warm_eta": math.nan})
    bad_flows = np.full(np.asarray(good["warm_flows"]).shape, np.nan)
    with pytest.raises(ValueError, match=re.escape("state['warm_flows'] must be finite flow magnitudes >= 0, got [nan")):
        refgeo.DiameterLMO(lr=0.1).load_state_dict({**good, "warm_flows": bad_flows})


@pytest.mark.parametrize("cls", [refgeo.RowNorm, refgeo.DiameterLMO])
def test_a_decay_that_amplifies_the_parameters_is_refused(cls):
    """lr * weight_decay > 2 multiplies the parameters by more than 1 in size at every
    step: a torch RowNorm with lr = 1, weight_decay = 3 reached inf in 2,000 steps
    without an error.  Refused at construction and at a step after the attributes
    changed, before the parameters are touched; lr * weight_decay = 2 is allowed."""
    msg = "weight_decay == 3.0, must be <= 2 / lr = 2: the decay multiplies the parameters by 1 - lr * weight_decay = -2"
    with pytest.raises(ValueError, match=re.escape(msg)):
        cls(lr=1.0, weight_decay=3.0)
    opt = cls(lr=0.5, weight_decay=4.0)  # lr * weight_decay = 2
    W = np.zeros((4, 2))
    G = np.array([[1.0, 2.0], [-1.0, 0.5], [0.5, -1.0], [-0.5, -1.5]])
    opt.step(W, G)
    before = W.copy()
    opt.lr = 1.0
    with pytest.raises(ValueError, match=re.escape("weight_decay == 4.0, must be <= 2 / lr = 2")):
        opt.step(W, G)
    np.testing.assert_array_equal(W, before)


def test_diameter_lmo_step_errors_name_grad():
    # They named diameter_lmo's G, which is not an argument of step().
    opt = refgeo.DiameterLMO(lr=0.1)
    W = np.zeros((1, 2))
    with pytest.raises(ValueError, match=re.escape("grad must have at least 2 rows (shape (V, d)), got shape (1, 2) instead.")):
        opt.step(W, np.ones((1, 2)))
    W = np.zeros((3, 2))
    with pytest.raises(ValueError, match=re.escape("grad must have rows summing to zero (1^T grad = 0")):
        opt.step(W, np.ones((3, 2)))
    assert not W.any() and opt.t == 0 and opt.last_result is None
    # centered gradients near the top of the float range are accepted
    opt.step(W, np.array([[1.7e308, 0.0], [-1.7e308, 0.0], [0.0, 0.0]]))
    assert refgeo.row_diameter(W).value <= 0.1


def test_rownorm_centers_rows_near_the_float64_maximum():
    # The column sums of these rows overflow: a plain mean gave inf, and the step NaN
    # (or a ValueError naming row_normalize's A, after the state had changed).
    from fractions import Fraction

    G = np.array([[1.7e308, 1.0], [1.7e308, -3.0], [1.7e308, 2.0], [1.7e308, 0.5]])
    exact = [[Fraction(x) for x in row] for row in G.tolist()]
    mean = [sum(col) / len(exact) for col in zip(*exact)]
    Gc = np.array([[float(x - m) for x, m in zip(row, mean)] for row in exact])
    opt = refgeo.RowNorm(lr=0.1, eps=0.0)
    W = np.zeros_like(G)
    opt.step(W, G)
    np.testing.assert_allclose(W, -0.1 * _rn(Gc, 0.0), rtol=1e-15, atol=0.0)
    # centered rows beyond the float64 range: an error naming grad, and no state change
    big = np.array([[1.7e308, 0.0], [-1.7e308, 0.0], [-1.7e308, 0.0], [-1.7e308, 0.0]])
    with pytest.raises(ValueError, match=re.escape("grad must have a centered momentum average inside the float64 range")):
        opt.step(W, big)
    assert opt.t == 1
    np.testing.assert_allclose(W, -0.1 * _rn(Gc, 0.0), rtol=1e-15, atol=0.0)
    np.testing.assert_array_equal(opt.buffer, (1.0 - 0.95) * Gc)



@pytest.mark.parametrize("cls", ["RowNorm", "DiameterLMO"])
@pytest.mark.parametrize("shape", [(0, 3), (3, 0)])
def test_an_empty_param_is_named_as_empty(cls, shape):
    """An empty param was refused as one that repeats its entries in memory (NumPy
    gives empty arrays zero strides), the wrong reason."""
    with pytest.raises(ValueError, match=re.escape(f"param must be non-empty, got shape {shape} instead.")):
        getattr(refgeo, cls)(lr=0.1).step(np.zeros(shape), np.zeros(shape))


@pytest.mark.parametrize("cls", ["RowNorm", "DiameterLMO"])
def test_an_expanded_tensor_is_refused_as_param(cls):
    """An expanded tensor's NumPy view is writeable, but its rows are one row in memory:
    the in-place update wrote every row's step over the others (5 equal rows came back)."""
    torch = pytest.importorskip("torch")
    W = torch.zeros(1, 3, dtype=torch.float64).expand(5, 3)
    G = refgeo.center_rows(np.random.default_rng(0).standard_normal((5, 3)))
    opt = getattr(refgeo, cls)(lr=0.1)
    with pytest.raises(ValueError, match=re.escape("param must not repeat its entries in memory")):
        opt.step(W, G)
    assert torch.equal(W, torch.zeros(5, 3, dtype=torch.float64))
    # a writeable NumPy array with a zero stride, and overlapping windows of a tensor
    row = np.zeros(3)
    A = np.lib.stride_tricks.as_strided(row, (5, 3), (0, 8), writeable=True)
    with pytest.raises(ValueError, match="param must not repeat"):
        opt.step(A, G)
    assert not row.any()
    line = torch.zeros(7, dtype=torch.float64)
    with pytest.raises(ValueError, match="param must not repeat"):
        opt.step(line.unfold(0, 3, 1), G)  # shape (5, 3), strides (1, 1)
    assert not line.any()
    # layouts that do not overlap pass: transposed, sliced, negative strides
    base = np.zeros((3, 10))
    for P in (base.T[:5], base[:, ::2].T, np.zeros((5, 3))[::-1]):
        getattr(refgeo, cls)(lr=0.1).step(P, G)


def test_a_zero_time_limit_steps_by_projected_rownorm():
    """``max_time=0`` was refused (``must be > 0``) while ``diameter_lmo`` now takes it:
    every solve then stops before a solver starts and the step is the projected
    RowNorm step of the gradient, scaled by ``lr``."""
    from refgeo._lm_gradients import lm_gradient

    G = lm_gradient(300, 8, seed=4)
    W = np.zeros_like(G)
    opt = refgeo.DiameterLMO(lr=0.25, max_time=0.0)
    opt.step(W, G)
    # the optimizer solves for its centered gradient (refgeo.center_rows); rows of the
    # Zipf gradient 1e-5 times the largest take their direction only to that rounding
    np.testing.assert_allclose(W, refgeo.projected_rownorm(refgeo.center_rows(G), eta=0.25), rtol=0, atol=1e-13)
    np.testing.assert_allclose(W, refgeo.projected_rownorm(G, eta=0.25), rtol=0, atol=1e-9)
    assert opt.last_result.method == "rownorm" and opt.last_result.gap <= 0.5
    assert refgeo.row_diameter(W).value <= 0.25


def test_diameter_lmo_with_momentum_takes_every_gradient_the_solver_takes():
    """Gradients each centered within the solver's tolerance, of alternating sign: the
    average of the raw gradients kept their remainders while the centered parts
    cancelled, and the third step was refused ("grad must have rows summing to zero").
    Each gradient is centered before it is averaged."""
    g = np.random.default_rng(3)
    A = g.standard_normal((50, 8))
    A -= A.mean(axis=0)
    c = np.ones(8) / np.sqrt(8)
    off = 0.5 * 2.0**-8 * np.linalg.norm(A, axis=1).sum() / 50 * c  # half the tolerance
    W = np.zeros_like(A)
    opt = refgeo.DiameterLMO(lr=0.1, momentum=0.9)
    for t in range(4):
        G = (-1) ** t * A + off
        refgeo.diameter_lmo(G, eta=0.1)  # the solver takes it
        opt.step(W, G)
    assert opt.t == 4
    np.testing.assert_allclose(opt.buffer.sum(axis=0), 0.0, atol=1e-13)  # the buffer stays centered
    with pytest.raises(ValueError, match="grad must have rows summing to zero"):
        opt.step(W, A + 3.0 * off / 0.5)  # three times the tolerance
    assert opt.t == 4


@pytest.mark.parametrize("kind", ["equal rows", "common offset", "one ulp apart"])
def test_center_rows_output_is_taken_by_the_lmo_functions(kind):
    """center_rows's output was refused by the functions whose error recommends it:
    the rounding of its mean (a shift common to every row) stayed, and for rows that
    were all equal it was all there was (105 of 200 random rows)."""
    g = np.random.default_rng(11)
    for _ in range(20):
        x = g.standard_normal(4)
        if kind == "equal rows":
            A = np.tile(x, (5, 1))
        elif kind == "common offset":
            A = 1e12 * x + g.standard_normal((7, 4))
        else:
            A = np.tile(x, (6, 1))
            A[2, 1] = np.nextafter(A[2, 1], np.inf)
        C = refgeo.center_rows(A)
        res = refgeo.diameter_lmo(C, eta=1.0)
        refgeo.tension_bounds(C)
        refgeo.rescaled_rownorm(C, eta=1.0)
        if kind == "equal rows":  # P 1 x^T = 0 exactly: no step
            assert not C.any() and not np.asarray(res.update).any()
            W = np.ones_like(A)
            refgeo.RowNorm(lr=0.1, eps=0.0).step(W, A)  # invariant under a common row shift: no move
            np.testing.assert_array_equal(W, 1.0)


def test_diameter_lmo_state_counts_its_steps_through_a_round_trip():
    """``state_dict()`` holds the step count: 0 fresh, 2 after two steps, and the same
    after ``load_state_dict`` (a mutant that never counted passed every other test)."""
    opt = refgeo.DiameterLMO(lr=0.5)
    assert opt.state_dict()["t"] == 0
    W = np.zeros((2, 2))
    G = np.array([[3.0, 4.0], [-3.0, -4.0]])
    opt.step(W, G)
    opt.step(W, G)
    assert opt.state_dict()["t"] == 2
    fresh = refgeo.DiameterLMO(lr=0.5)
    fresh.load_state_dict(opt.state_dict())
    assert fresh.state_dict()["t"] == 2


@pytest.mark.parametrize("cls", [refgeo.RowNorm, refgeo.DiameterLMO])
def test_an_infinite_learning_rate_is_refused(cls):
    with pytest.raises(ValueError, match=re.escape("lr must be a finite number, got inf instead.")):
        cls(lr=float("inf"))


def test_a_flag_given_as_an_integer_is_refused():
    with pytest.raises(TypeError, match=re.escape("project must be a bool, got int instead.")):
        refgeo.RowNorm(lr=0.1, project=1)
