"""refgeo.torch.RowNorm against refgeo.RowNorm, step by step, on LM-like gradients.

Skips cleanly without torch; runs whenever torch is installed (CI installs it).
"""

from __future__ import annotations

import copy
import doctest
import importlib
import io
import re
import sys

import numpy as np
import pytest

import refgeo

torch = pytest.importorskip("torch")
rtorch = importlib.import_module("refgeo.torch")


def _lm_gradients(V=64, d=16, T=12, n_tok=48, seed=0, zero_steps=(), dtype=np.float64):
    """Cross-entropy gradients of an LM head: Zipf-distributed targets, hidden states with a
    large common component, G = (softmax(W h) - e_y)^T h summed over a batch of tokens."""
    rng = np.random.default_rng(seed)
    W = 0.02 * rng.standard_normal((V, d))
    common = 8.0 * rng.standard_normal(d)  # the large component every hidden state shares
    ranks = np.arange(1, V + 1)
    zipf = (1.0 / ranks) / (1.0 / ranks).sum()
    grads = []
    for t in range(T):
        H = common + rng.standard_normal((n_tok, d))
        y = rng.choice(V, size=n_tok, p=zipf)
        Z = H @ W.T
        P = np.exp(Z - Z.max(axis=1, keepdims=True))
        P /= P.sum(axis=1, keepdims=True)
        P[np.arange(n_tok), y] -= 1.0
        G = P.T @ H / n_tok
        grads.append(np.zeros_like(G) if t in zero_steps else G)
    return W.astype(dtype), np.stack(grads).astype(dtype)


def _run_both(W0, grads, *, lr=0.02, mu=0.95, eps=1e-8, weight_decay=0.0, **kw):
    W_np = np.array(W0, copy=True)
    ref = refgeo.RowNorm(lr=lr, mu=mu, eps=eps, weight_decay=weight_decay, **kw)
    W_t = torch.nn.Parameter(torch.from_numpy(np.array(W0, copy=True)))
    opt = rtorch.RowNorm([W_t], lr=lr, momentum=mu, eps=eps, weight_decay=weight_decay, **kw)
    out = []
    for g in grads:
        ref.step(W_np, g)
        W_t.grad = torch.from_numpy(np.array(g))
        opt.step()
        out.append((W_np.copy(), W_t.detach().numpy().copy(), ref.last_step(), opt.last_step().numpy()))
    return out


def _rel(a, b):
    scale = max(float(np.abs(b).max()), np.finfo(np.float64).tiny)
    return float(np.abs(np.asarray(a, dtype=np.float64) - b).max()) / scale


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("zero_steps", [(), (3, 4, 9)])
def test_steps_equal_refgeo_rownorm_float64(weight_decay, zero_steps):
    W0, grads = _lm_gradients(zero_steps=zero_steps)
    for W_np, W_t, S_np, S_t in _run_both(W0, grads, weight_decay=weight_decay):
        assert _rel(S_t, S_np) <= 1e-12
        assert _rel(W_t, W_np) <= 1e-12


@pytest.mark.parametrize("kw", [dict(bias_correction=False), dict(project=True), dict(center=False),
                                dict(eps=0.0, mu=0.5)])
def test_options_equal_refgeo_rownorm_float64(kw):
    W0, grads = _lm_gradients(T=6, seed=1, zero_steps=(2,))
    for W_np, W_t, S_np, S_t in _run_both(W0, grads, **kw):
        assert _rel(S_t, S_np) <= 1e-12
        assert _rel(W_t, W_np) <= 1e-12


def test_float32_steps_agree_to_float32_rounding():
    W0, grads = _lm_gradients(T=8, seed=2, dtype=np.float32, zero_steps=(5,))
    d = W0.shape[1]
    u = np.finfo(np.float32).eps / 2
    for W_np, W_t, S_np, S_t in _run_both(W0, grads, weight_decay=0.05):
        assert W_t.dtype == np.float32
        # A few roundings per entry of the momentum average, the norm over d entries
        # and the division: (d + 10) u relative to the step size lr.
        assert float(np.abs(S_t - S_np).max()) <= 0.02 * (d + 10) * u * 4
        assert float(np.abs(W_t.astype(np.float64) - W_np).max()) <= 0.02 * 8 * (d + 10) * u * 4 + 8 * u


def test_zero_rows_and_zero_gradient_from_the_start():
    W0 = np.ones((4, 3))
    grads = np.zeros((3, 4, 3))
    grads[1, 0] = [1.0, -2.0, 2.0]  # one nonzero row only after a zero step
    grads[1, 1] = -grads[1, 0]
    for W_np, W_t, S_np, S_t in _run_both(W0, grads, eps=0.0):
        np.testing.assert_array_equal(S_t[2:], 0.0)  # rows that never had a gradient
        assert _rel(S_t, S_np) <= 1e-12 if np.any(S_np) else not np.any(S_t)
        assert _rel(W_t, W_np) <= 1e-12


def test_tiny_and_huge_rows_neither_underflow_nor_overflow():
    G = np.array([[1e-200, -1e-200], [-1e-200, 1e-200], [3e200, 4e200], [-3e200, -4e200]])
    W0 = np.zeros_like(G)
    for W_np, W_t, S_np, S_t in _run_both(W0, G[None], eps=0.0):
        assert np.all(np.isfinite(S_t))
        np.testing.assert_allclose(np.linalg.norm(S_t, axis=1), 0.02, rtol=1e-14)
        assert _rel(S_t, S_np) <= 1e-12


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("eps", [0.0, 1e-8])
def test_subnormal_rows_are_normalized(dtype, eps):
    """Rows of subnormal entries (the gradient rows of very rare tokens): torch divides a
    number by a tensor as the number times the reciprocal, so ``eps / m`` was
    ``0 * inf = NaN`` for ``eps = 0`` and such rows were not normalized at all (a row of
    norm 1.25 lr, and in float32 sqrt(8) lr)."""
    tiny = 3e-310 if dtype == np.float64 else 3e-40
    G = np.array([[3.0, 4.0] * 4, [-3.0, -4.0] * 4, [1.0, 0.0] * 4], dtype=dtype)
    G[:2] *= tiny
    W = torch.nn.Parameter(torch.zeros(G.shape, dtype=torch.from_numpy(G).dtype))
    opt = rtorch.RowNorm([W], lr=0.1, eps=eps, momentum=0.0, center=False)
    W.grad = torch.from_numpy(G)
    opt.step()
    want = -0.1 * refgeo.row_normalize(G.astype(np.float64), eps=eps)
    got = W.detach().double().numpy()
    tol = 1e-15 if dtype == np.float64 else 1e-7
    np.testing.assert_allclose(got, want, rtol=tol, atol=0.0)
    if eps == 0.0:
        assert refgeo.row_diameter(got).value <= 0.2 * (1 + tol)


def test_huge_gradients_are_centered_without_overflow():
    """Column means of rows near the largest float: a plain mean overflowed, and the
    parameter became NaN with no error; now the step is refgeo.RowNorm's."""
    G = np.array([[1e308, 1.0], [1e308, 1.0], [-1e308, 1.0], [5e307, -3.0]])
    for W_np, W_t, S_np, S_t in _run_both(np.zeros_like(G), G[None], eps=0.0):
        assert np.all(np.isfinite(W_t)) and _rel(S_t, S_np) <= 1e-12


def test_gradients_beyond_the_state_range_change_nothing():
    """A float32 state cannot hold the centered 3e38 gradient (-4e38): a ValueError that
    says so, before any group changes (it was NaN in the parameter and the buffer)."""
    A = torch.nn.Parameter(torch.zeros(3, 2))
    W = torch.nn.Parameter(torch.zeros(3, 2))
    opt = rtorch.RowNorm([{"params": [A]}, {"params": [W]}], lr=0.1)
    A.grad = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, -1.0]])
    W.grad = torch.tensor([[3e38, 1.0], [3e38, 1.0], [-3e38, 1.0]])
    with pytest.raises(ValueError, match=r"gradient of param_groups\[1\].*float32 range.*overflows"):
        opt.step()
    assert not torch.any(A) and not torch.any(W) and len(opt.state) == 0
    W.grad = W.grad * 0.25  # centered: at most 1e38
    opt.step()
    assert torch.all(torch.isfinite(W)) and torch.all(torch.isfinite(A))
    np.testing.assert_allclose(W.detach().numpy()[:, 0], [-0.1, -0.1, 0.1], rtol=1e-6)


def test_step_diameter_is_within_the_budget():
    W0, grads = _lm_gradients(T=5, seed=3)
    W = torch.nn.Parameter(torch.from_numpy(W0.copy()))
    opt = rtorch.RowNorm([W], lr=0.05)
    for g in grads:
        W.grad = torch.from_numpy(g)
        opt.step()
        assert refgeo.row_diameter(opt.last_step().numpy()).value <= 2 * 0.05 * (1 + 1e-12)


def test_state_dict_round_trip_continues_identically():
    W0, grads = _lm_gradients(T=8, seed=4)
    W_a = torch.nn.Parameter(torch.from_numpy(W0.copy()))
    opt_a = rtorch.RowNorm([W_a], lr=0.03, weight_decay=0.01)
    for g in grads[:4]:
        W_a.grad = torch.from_numpy(g)
        opt_a.step()
    saved = copy.deepcopy(opt_a.state_dict())
    W_b = torch.nn.Parameter(W_a.detach().clone())
    opt_b = rtorch.RowNorm([W_b], lr=0.03, weight_decay=0.01)
    opt_b.load_state_dict(saved)
    assert opt_b.state[W_b]["step"] == 4
    assert opt_b.state[W_b]["momentum_buffer"].dtype == torch.float64
    for g in grads[4:]:
        for W, opt in ((W_a, opt_a), (W_b, opt_b)):
            W.grad = torch.from_numpy(g)
            opt.step()
        assert torch.equal(W_a, W_b)


@pytest.mark.parametrize("step", [2**63 - 1, 10**400], ids=["int64_max", "1e400"])
def test_a_restored_step_count_beyond_the_float64_range_steps(step):
    """A state with a step count of 10**400 loaded, then the next bias-corrected step
    raised OverflowError (``mu**t``); mu**t is 0 there, so the step is the one without
    bias correction, from the same buffer."""
    W0, grads = _lm_gradients(T=3, seed=4)
    W_a = torch.nn.Parameter(torch.from_numpy(W0.copy()))
    opt_a = rtorch.RowNorm([W_a], lr=0.03)
    for g in grads[:2]:
        W_a.grad = torch.from_numpy(g)
        opt_a.step()
    saved = copy.deepcopy(opt_a.state_dict())
    saved["state"][0]["step"] = step
    W_b = torch.nn.Parameter(W_a.detach().clone())
    opt_b = rtorch.RowNorm([W_b], lr=0.03, bias_correction=False)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    for group in opt_b.param_groups:
        group["bias_correction"] = False
    opt_a.load_state_dict(saved)
    for W, opt in ((W_a, opt_a), (W_b, opt_b)):
        W.grad = torch.from_numpy(grads[2])
        opt.step()
    assert torch.equal(W_a, W_b) and bool(torch.isfinite(W_a).all())
    assert opt_a.state[W_a]["step"] == step + 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_state_dict_round_trip_keeps_float32_buffers_of_half_parameters(dtype):
    """Half-precision parameters keep float32 buffers, and a state_dict round trip keeps
    them bit for bit (torch's loader casts state to the parameter's dtype)."""
    W0, grads = _lm_gradients(T=6, seed=5)
    W_a = torch.nn.Parameter(torch.from_numpy(W0).to(dtype))
    opt_a = rtorch.RowNorm([W_a], lr=0.03)
    for g in grads[:3]:
        W_a.grad = torch.from_numpy(g).to(dtype)
        opt_a.step()
    W_b = torch.nn.Parameter(W_a.detach().clone())
    opt_b = rtorch.RowNorm([W_b], lr=0.03)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    for key in ("momentum_buffer", "last_step"):
        assert opt_b.state[W_b][key].dtype == torch.float32
        assert torch.equal(opt_b.state[W_b][key], opt_a.state[W_a][key]), key
    for g in grads[3:]:
        for W, opt in ((W_a, opt_a), (W_b, opt_b)):
            W.grad = torch.from_numpy(g).to(dtype)
            opt.step()
        assert torch.equal(opt_a.state[W_a]["momentum_buffer"], opt_b.state[W_b]["momentum_buffer"])
        assert torch.equal(W_a, W_b)


def test_closure_and_lr_scheduler():
    W0, grads = _lm_gradients(T=6, seed=5)
    W = torch.nn.Parameter(torch.from_numpy(W0.copy()))
    opt = rtorch.RowNorm([W], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ref_W = W0.copy()
    ref = refgeo.RowNorm(lr=0.1)
    for t, g in enumerate(grads):
        def closure(g=g):
            opt.zero_grad()
            W.grad = torch.from_numpy(g.copy())
            return 1.5

        assert opt.step(closure) == 1.5
        ref.lr = 0.1 * 0.5 ** (t // 2)
        ref.step(ref_W, g)
        sched.step()
        assert _rel(W.detach().numpy(), ref_W) <= 1e-12
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)


@pytest.mark.parametrize("which", ["RowNorm", "DiameterLMO"])
def test_tensor_lr_is_read_at_every_step(which):
    # torch's optimizers take lr as a one-element tensor (LR schedules under torch.compile
    # fill_ it in place); the steps must equal those with the same float lr
    W0, grads = _lm_gradients(V=20, d=6, T=4, seed=6)
    cls = getattr(rtorch, which)
    W_f = torch.nn.Parameter(torch.from_numpy(W0.copy()))
    W_t = torch.nn.Parameter(torch.from_numpy(W0.copy()))
    lr = torch.tensor(0.08)  # float32: the float lr is its value, 0.0799999982...
    opt_f, opt_t = cls([W_f], lr=lr.item()), cls([W_t], lr=lr)
    for t, g in enumerate(grads):
        if t == 2:  # a schedule changes the tensor in place: read at the next step
            lr.fill_(0.02)
            opt_f.param_groups[0]["lr"] = lr.item()
        for W, opt in ((W_f, opt_f), (W_t, opt_t)):
            W.grad = torch.from_numpy(g.copy())
            opt.step()
        assert torch.equal(W_f, W_t), t
    assert opt_t.param_groups[0]["lr"] is lr


@pytest.mark.parametrize("which", ["RowNorm", "DiameterLMO"])
def test_bad_tensor_lr_is_refused_by_name(which):
    cls = getattr(rtorch, which)
    W = torch.nn.Parameter(torch.zeros(3, 2))
    cases = [
        (torch.tensor([0.1, 0.2]), ValueError, "lr must be a number or a one-element tensor, got a tensor of shape (2,) instead."),
        (torch.tensor(True), TypeError, "lr must be a real number, got a tensor of dtype torch.bool instead."),
        (torch.tensor(0.1 + 0j), TypeError, "lr must be a real number, got a tensor of dtype torch.complex64 instead."),
        (torch.empty((), device="meta"), TypeError, "lr is a meta tensor (a shape without values)"),
        (torch.tensor(float("nan")), ValueError, "lr must be a finite number, got nan instead."),
    ]
    for lr, err, msg in cases:
        with pytest.raises(err, match=re.escape(msg)):
            cls([W], lr=lr)
    opt = cls([W], lr=torch.tensor(0.1))
    opt.param_groups[0]["lr"].fill_(-1.0)  # refused at the step, before anything changes
    W.grad = torch.ones(3, 2)
    # RowNorm takes lr = 0; the LMO needs lr > 0 and says so for -1 as for 0 (it said
    # ">= 0" for -1, then "> 0" for 0)
    bound = "> 0.0" if which == "DiameterLMO" else ">= 0.0"
    with pytest.raises(ValueError, match=re.escape(f"lr == -1.0, must be {bound}.")):
        opt.step()
    assert torch.equal(W, torch.zeros(3, 2)) and not opt.state[W]
    if which == "DiameterLMO":
        with pytest.raises(ValueError, match=re.escape("lr == 0.0, must be > 0.0.")):
            cls([W], lr=0.0)


def test_a_closure_computing_real_gradients():
    torch.manual_seed(0)
    H = torch.randn(32, 8, dtype=torch.float64) + 4.0
    y = torch.randint(0, 10, (32,))
    W = torch.nn.Parameter(0.01 * torch.randn(10, 8, dtype=torch.float64))
    opt = rtorch.RowNorm([W], lr=0.05)

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(H @ W.T, y)
        loss.backward()
        return loss

    losses = [float(opt.step(closure).detach()) for _ in range(20)]
    assert losses[-1] < losses[0]


def test_several_groups_and_named_parameters():
    model = torch.nn.Sequential(torch.nn.Linear(6, 5, bias=False), torch.nn.Linear(5, 4, bias=False)).double()
    with pytest.raises(ValueError, match=r"exactly one 2-D parameter .* got 2 parameters in param group 0"):
        rtorch.RowNorm(model.parameters(), lr=0.01)
    groups = [{"params": [model[0].weight]}, {"params": [model[1].weight], "lr": 0.02}]
    opt = rtorch.RowNorm(groups, lr=0.01)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    assert opt.last_step(1).shape == (4, 5) and opt.last_step(0).shape == (5, 6)


def test_bad_parameters_are_refused_by_name():
    lin = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match=r"parameter 'bias' must be 2-D .* got shape \(2,\)"):
        rtorch.RowNorm([("bias", lin.bias)], lr=0.1)
    with pytest.raises(ValueError, match=r"must be 2-D .* got shape \(2, 2, 2\)"):
        rtorch.RowNorm([torch.nn.Parameter(torch.zeros(2, 2, 2))], lr=0.1)
    for shape in ((3, 0), (0, 3)):  # torch's RuntimeError from its first reduction at step()
        for cls in (rtorch.RowNorm, rtorch.DiameterLMO):
            with pytest.raises(ValueError, match=r"must be 2-D and non-empty .* got shape"):
                cls([torch.nn.Parameter(torch.zeros(shape))], lr=0.1)
    with pytest.raises(TypeError, match="real floating-point tensor, got dtype torch.complex64"):
        rtorch.RowNorm([torch.zeros(2, 2, dtype=torch.complex64)], lr=0.1)
    with pytest.raises(TypeError, match="real floating-point tensor, got dtype torch.int64"):
        rtorch.RowNorm([torch.zeros(2, 2, dtype=torch.int64)], lr=0.1)
    with pytest.raises(ValueError, match="must be finite"):
        rtorch.RowNorm([torch.nn.Parameter(torch.tensor([[1.0, float("nan")]]))], lr=0.1)
    with pytest.raises(ValueError, match="momentum must be in"):
        rtorch.RowNorm([torch.nn.Parameter(torch.zeros(2, 2))], lr=0.1, momentum=1.0)
    with pytest.raises(ValueError, match="lr"):
        rtorch.RowNorm([torch.nn.Parameter(torch.zeros(2, 2))], lr=-0.1)


def test_bad_gradients_change_nothing():
    W = torch.nn.Parameter(torch.zeros(3, 2, dtype=torch.float64))
    opt = rtorch.RowNorm([("head.weight", W)], lr=0.1)
    W.grad = torch.tensor([[1.0, 0.0], [float("inf"), 0.0], [0.0, 1.0]], dtype=torch.float64)
    with pytest.raises(ValueError, match=r"gradient of 'head.weight' must be finite"):
        opt.step()
    assert not torch.any(W) and len(opt.state) == 0
    opt.param_groups[0]["lr"] = float("nan")
    W.grad = torch.zeros(3, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="lr"):
        opt.step()


def test_import_does_not_need_torch_until_used():
    # refgeo.torch imports no torch at module level (the class is built on first use).
    src = open(rtorch.__file__).read()
    head = src.split("def _build", 1)[0]
    assert "\nimport torch" not in head and "\nfrom torch" not in head
    assert "RowNorm" in dir(rtorch)
    with pytest.raises(AttributeError):
        rtorch.NoSuchOptimizer  # noqa: B018


def test_docstring_example():
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    tests = [t for cls in (rtorch.RowNorm, rtorch.DiameterLMO)
             for t in finder.find(cls, f"refgeo.torch.{cls.__name__}", globs={})]
    assert sum(len(t.examples) for t in tests) >= 10
    for t in tests:
        runner.run(t, out=sys.stdout.write)
    assert runner.failures == 0


@pytest.mark.gpu
def test_cuda_steps_equal_cpu_steps():
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device here")
    W0, grads = _lm_gradients(T=5, seed=6)
    W_cpu = torch.nn.Parameter(torch.from_numpy(W0.copy()))
    W_gpu = torch.nn.Parameter(torch.from_numpy(W0.copy()).cuda())
    opts = [rtorch.RowNorm([W], lr=0.02, weight_decay=0.1) for W in (W_cpu, W_gpu)]
    for g in grads:
        for W, opt in zip((W_cpu, W_gpu), opts):
            W.grad = torch.from_numpy(g).to(W.device)
            opt.step()
    assert _rel(W_gpu.detach().cpu().numpy(), W_cpu.detach().numpy()) <= 1e-12


def test_tutorial_runs_and_keeps_the_bound():
    # docs/tutorials/torch-rownorm.md: its Python blocks run in order (only in a checkout).
    import pathlib
    import re

    page = pathlib.Path(__file__).resolve().parents[1] / "docs" / "tutorials" / "torch-rownorm.md"
    if not page.exists():
        pytest.skip("docs/tutorials/torch-rownorm.md is not in this checkout")
    code = "\n".join(m.group(1) for m in re.finditer(r"^```python\n(.*?)^```\n", page.read_text(), re.S | re.M))
    namespace: dict = {}
    exec(compile(code, str(page), "exec"), namespace)
    assert namespace["rn_diam"].max() <= 2 * namespace["lr"] * (1 + 1e-12)
    assert namespace["rn_loss"][-10:].mean() < namespace["rn_loss"][:10].mean() - 0.5
    records = namespace["monitor"].records
    assert [r["step"] for r in records] == [10, 20, 30]
    assert all(r["hilbert_rms"] <= r["bound"] for r in records)


# --------------------------------------------------------------------------- HeadStepMonitor


def test_monitor_records_equal_row_diameter_and_hilbert_rms():
    W0, grads = _lm_gradients(T=9, seed=7)
    rng = np.random.default_rng(8)
    panel = 3.0 + rng.standard_normal((20, W0.shape[1]))
    W = torch.nn.Parameter(torch.from_numpy(W0.copy()))
    opt = rtorch.RowNorm([W], lr=0.05, weight_decay=0.1)
    mon = rtorch.HeadStepMonitor(opt, torch.from_numpy(panel), every=3)
    steps = {}
    for t, g in enumerate(grads, start=1):
        W.grad = torch.from_numpy(g)
        opt.step()
        steps[t] = opt.last_step().numpy().copy()
    assert [r["step"] for r in mon.records] == [3, 6, 9]
    hmax = float(np.linalg.norm(panel, axis=1).max())
    for rec in mon.records:
        S = steps[rec["step"]]
        pair = refgeo.row_diameter(S)
        assert rec["diameter"] == pair.value and rec["pair"] == (pair.i, pair.j)
        assert rec["hilbert_rms"] == refgeo.hilbert_rms(S, panel)
        assert rec["bound"] == pytest.approx(hmax * pair.value, rel=1e-15)
        assert rec["hilbert_rms"] <= rec["bound"] * (1 + 1e-12)
        h = np.array(rec["h_star"])
        assert np.linalg.norm(h) == pytest.approx(hmax, rel=1e-12)
        # h* attains the bound: the Hilbert distance of the step at h* is H D(S).
        Sh = S @ h
        assert Sh.max() - Sh.min() == pytest.approx(hmax * pair.value, rel=1e-9)
        assert all(isinstance(v, (int, float, tuple, list)) for v in rec.values())  # plain values
    mon.close()
    W.grad = torch.from_numpy(grads[0])
    for _ in range(3):
        opt.step()
    assert len(mon.records) == 3


def test_monitor_bad_input():
    W = torch.nn.Parameter(torch.zeros(3, 2, dtype=torch.float64))
    opt = rtorch.RowNorm([W], lr=0.1)
    with pytest.raises(ValueError, match=re.escape("every == 0, must be >= 1.")):
        rtorch.HeadStepMonitor(opt, torch.zeros(4, 2), every=0)
    with pytest.raises(ValueError, match=r"d = 2 columns"):
        rtorch.HeadStepMonitor(opt, torch.zeros(4, 3))
    with pytest.raises(ValueError, match=re.escape("hidden_states must contain only finite values, got 1 NaN")):
        rtorch.HeadStepMonitor(opt, torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(TypeError, match=re.escape("optimizer must be a torch optimizer with last_step(group)")):
        rtorch.HeadStepMonitor(torch.optim.SGD([W], lr=0.1), torch.zeros(4, 2))
    with pytest.raises(ValueError, match=re.escape("n_threads == 0, must be >= 1.")):
        rtorch.HeadStepMonitor(opt, torch.zeros(4, 2), n_threads=0)


@pytest.mark.parametrize("cls", ["RowNorm", "DiameterLMO"])
def test_monitor_skips_calls_that_did_not_step_the_group(cls):
    """A call with no gradient leaves the weight (and last_step) as they were: it is not
    recorded as a new step; the next real step is, with the diameter of its own step."""
    W = torch.nn.Parameter(torch.zeros(3, 2, dtype=torch.float64))
    opt = getattr(rtorch, cls)([W], lr=0.1)
    mon = rtorch.HeadStepMonitor(opt, torch.eye(2, dtype=torch.float64), every=1)
    W.grad = torch.tensor([[3.0, 4.0], [-3.0, -4.0], [0.0, 0.0]], dtype=torch.float64)
    opt.step()
    W.grad = None
    before = W.detach().clone()
    opt.step()
    assert torch.equal(W.detach(), before)
    assert [r["step"] for r in mon.records] == [1]
    W.grad = torch.tensor([[1.0, 0.0], [0.0, 0.0], [-1.0, 0.0]], dtype=torch.float64)
    opt.step()
    assert [r["step"] for r in mon.records] == [1, 3]
    S = opt.last_step().double().numpy()
    # brute force over the row pairs of the recorded step
    want = max(np.linalg.norm(S[i] - S[j]) for i in range(3) for j in range(3))
    assert mon.records[-1]["diameter"] == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("cls", ["RowNorm", "DiameterLMO"])
def test_monitor_after_a_rollback_records_the_real_steps_only(cls):
    """A rollback to a checkpoint (load_state_dict between steps, as after a loss spike)
    sets the step count back: the next real step was taken for a skipped call (its count
    equalled the last one seen), and a call without a gradient for a real step."""
    import copy

    W = torch.nn.Parameter(torch.zeros(3, 2, dtype=torch.float64))
    opt = getattr(rtorch, cls)([W], lr=0.1)
    mon = rtorch.HeadStepMonitor(opt, torch.eye(2, dtype=torch.float64), every=1)
    grad = torch.tensor([[3.0, 4.0], [-3.0, -4.0], [0.0, 0.0]], dtype=torch.float64)
    W.grad = grad.clone()
    opt.step()                                   # call 1: step 1
    ckpt = copy.deepcopy(opt.state_dict())
    opt.step()                                   # call 2: step 2
    opt.load_state_dict(ckpt)                    # back to step 1
    opt.step()                                   # call 3: a real step (step 2 again)
    assert [r["step"] for r in mon.records] == [1, 2, 3]
    opt.load_state_dict(ckpt)
    W.grad = None
    before = W.detach().clone()
    opt.step()                                   # call 4: skipped (no gradient)
    assert torch.equal(W.detach(), before)
    assert [r["step"] for r in mon.records] == [1, 2, 3]
    mon.close()
    W.grad = grad.clone()
    opt.step()                                   # closed: nothing recorded
    assert len(mon.records) == 3


def test_constructor_errors_name_the_class_and_the_budget():
    W = torch.nn.Parameter(torch.zeros(3, 2))
    # the class's own name, not that of the factory that builds it at import time
    with pytest.raises(TypeError, match=re.escape("RowNorm.__init__() got an unexpected keyword argument 'maximize'")):
        rtorch.RowNorm([W], lr=0.1, maximize=True)
    with pytest.raises(ValueError, match=re.escape("lr == 1e-310, must be >= 2.2250738585072014e-308")):
        rtorch.DiameterLMO([W], lr=1e-310)


def test_rownorm_refuses_a_step_size_beyond_the_parameters_dtype():
    """lr = 1e39 gave a float32 weight inf and NaN entries, lr = 1e5 a float16 one,
    without an error."""
    for dtype, lr in ((torch.float32, 1e39), (torch.float16, 1e5)):
        W = torch.nn.Parameter(torch.zeros(2, 2, dtype=dtype))
        W.grad = torch.tensor([[1.0, 0.0], [-1.0, 0.0]], dtype=dtype)
        opt = rtorch.RowNorm([W], lr=lr)
        with pytest.raises(ValueError, match=re.escape(f"lr == {lr!r}, must be <= ")):
            opt.step()
        assert not W.detach().any() and not opt.state


@pytest.mark.parametrize("dtype, lr", [(torch.float32, 1e39), (torch.bfloat16, 1e39), (torch.float16, 2e5)])
def test_diameter_lmo_refuses_a_step_size_beyond_the_parameters_dtype(dtype, lr):
    """The LMO step's entries reach lr: float16 weights came back -inf and inf at
    lr = 2e5, and the step count and warm start advanced."""
    W = torch.nn.Parameter(torch.zeros(3, 2, dtype=dtype))
    W.grad = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 0.0]], dtype=dtype)
    opt = rtorch.DiameterLMO([W], lr=lr)
    with pytest.raises(ValueError, match=re.escape(f"lr == {lr!r}, must be <= ")):
        opt.step()
    assert not W.detach().any() and not opt.state_dict()["refgeo_solvers"]


def test_projected_rownorm_steps_near_the_dtypes_top_stay_finite():
    """With project=True the outer centering summed the columns of rows of norm lr in
    the parameter's dtype: at lr = 1e38 and V = 16 (an lr the step-size check accepts)
    the sums overflowed and the float32 weights came back inf, without an error.  Now
    the step is the NumPy optimizer's (which centers in float64)."""
    V = 16
    g = np.tile([[1.0, 0.0, 0.0]], (V, 1))
    g[0] = [-1.0, 0.0, 0.0]
    W = torch.nn.Parameter(torch.zeros(V, 3))
    W.grad = torch.tensor(g, dtype=torch.float32)
    rtorch.RowNorm([W], lr=1e38, eps=0.0, project=True).step()
    W_np = np.zeros((V, 3), dtype=np.float32)
    refgeo.RowNorm(lr=1e38, eps=0.0, project=True).step(W_np, g)
    assert torch.isfinite(W).all()
    np.testing.assert_allclose(W.detach().numpy(), W_np, rtol=1e-6, atol=0)


def test_monitor_refuses_one_row_head_before_any_step():
    """A head of fewer than 2 rows has no row diameter: refused when the monitor is
    built, not by an error about an internal S after the weight has already moved."""
    W = torch.nn.Parameter(torch.zeros(1, 2, dtype=torch.float64))
    opt = rtorch.RowNorm([W], lr=0.1)
    with pytest.raises(ValueError, match=re.escape("param group 0 must be 2-D with at least 2 rows")):
        rtorch.HeadStepMonitor(opt, torch.eye(2, dtype=torch.float64), every=1)


@pytest.mark.parametrize("S", [np.zeros(2), np.zeros((3, 2, 1)), [[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]],
                               np.zeros((1, 2)), np.zeros((3, 3))])
def test_monitor_record_names_bad_steps(S):
    """record(S) takes the step from the caller: a wrong rank, too few rows or a width
    other than the panel's is a ValueError naming S (a list is array_like)."""
    W = torch.nn.Parameter(torch.zeros(3, 2, dtype=torch.float64))
    mon = rtorch.HeadStepMonitor(rtorch.RowNorm([W], lr=0.1), torch.eye(2, dtype=torch.float64))
    if isinstance(S, list):
        rec = mon.record(S, step=1)
        A = np.array(S)
        # brute force: the largest distance between two rows
        want = max(np.linalg.norm(A[i] - A[j]) for i in range(3) for j in range(3))
        assert rec["diameter"] == pytest.approx(want, rel=1e-15)
        return
    with pytest.raises(ValueError, match=r"^S must "):
        mon.record(S, step=1)

def test_monitor_reads_bfloat16_and_grad_tensors_and_names_bad_ones():
    """The panel and a recorded step may be bfloat16 or carry autograd history (read as
    their exact float32 values); meta and integer tensors are TypeErrors naming them."""
    W = torch.nn.Parameter(torch.zeros(3, 2))
    opt = rtorch.RowNorm([W], lr=0.1)
    H = torch.tensor([[1.0, 0.5], [-2.0, 0.25]])
    S = torch.tensor([[0.5, -1.0], [0.0, 0.25], [-0.5, 0.75]])
    want = rtorch.HeadStepMonitor(opt, H.numpy()).record(S.numpy(), step=1)
    for h, s in ((H.bfloat16(), S.bfloat16()), (H.requires_grad_() * 1.0, S.requires_grad_() * 1.0)):
        mon = rtorch.HeadStepMonitor(opt, h)
        assert mon.record(s, step=1) == want
        mon.close()
    with pytest.raises(TypeError, match="hidden_states .*meta"):
        rtorch.HeadStepMonitor(opt, torch.zeros(4, 2, device="meta"))
    with pytest.raises(TypeError, match=re.escape("hidden_states must have a real floating dtype (float32 or "
                                                  "float64), got dtype torch.int64 instead")):
        rtorch.HeadStepMonitor(opt, torch.ones(4, 2, dtype=torch.int64))
    mon = rtorch.HeadStepMonitor(opt, H)
    with pytest.raises(TypeError, match="S .*meta"):
        mon.record(torch.zeros(3, 2, device="meta"), step=1)


def test_monitor_records_do_not_depend_on_threads():
    # Small recordings run on one thread by default; the record must be the same as on
    # two threads, BLAS pinned or not (the engine is thread-count independent).
    W0, grads = _lm_gradients(T=2, seed=11)
    panel = 2.0 + np.random.default_rng(12).standard_normal((40, W0.shape[1]))
    S = torch.from_numpy(grads[-1])
    W = torch.nn.Parameter(torch.from_numpy(W0.copy()))
    records = [
        rtorch.HeadStepMonitor(rtorch.RowNorm([W], lr=0.1), panel, n_threads=n).record(S, step=1)
        for n in (None, 1, 2)
    ]
    assert records[0] == records[1] == records[2]


def test_monitor_docstring_example():
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for t in doctest.DocTestFinder().find(rtorch.HeadStepMonitor, "refgeo.torch.HeadStepMonitor", globs={}):
        runner.run(t, out=sys.stdout.write)
    assert runner.failures == 0 and runner.tries > 0


def test_monitor_h_star_is_worst_case_hidden_state():
    rng = np.random.default_rng(9)
    S = rng.standard_normal((7, 4))
    panel = rng.standard_normal((5, 4))
    W = torch.nn.Parameter(torch.zeros(7, 4, dtype=torch.float64))
    mon = rtorch.HeadStepMonitor(rtorch.RowNorm([W], lr=0.1), panel)
    rec = mon.record(torch.from_numpy(S), step=1)
    worst = refgeo.worst_case_hidden_state(S, H=float(np.linalg.norm(panel, axis=1).max()))
    np.testing.assert_allclose(rec["h_star"], worst.h, rtol=1e-15, atol=0)
    assert rec["pair"] == (worst.i, worst.j)
    assert mon.record(np.zeros((7, 4)), step=2)["h_star"] == [0.0] * 4


@pytest.mark.parametrize("panel_scale, step_scale", [
    (2.0**700, 1.0), (2.0**-700, 1.0), (2.0**700, 2.0**-600), (2.0**-700, 2.0**500), (1.0, 2.0**-1000),
    (1.0, 2.0**500), (1.0, 1.0)])  # every bound within the float64 range
def test_monitor_records_stay_finite_for_extreme_hidden_states_and_steps(panel_scale, step_scale):
    """The hidden-state norm was a plain norm: states of 1e200 gave max_hidden_norm,
    bound and h_star inf, states of 1e-200 a bound of 0 below the Hilbert RMS."""
    rng = np.random.default_rng(4)
    S, panel = rng.standard_normal((6, 3)) * step_scale, rng.standard_normal((4, 3)) * panel_scale
    W = torch.nn.Parameter(torch.zeros(6, 3, dtype=torch.float64))
    rec = rtorch.HeadStepMonitor(rtorch.RowNorm([W], lr=0.1), panel).record(torch.from_numpy(S), step=1)
    H = panel_scale * float(np.linalg.norm(panel / panel_scale, axis=1).max())
    assert rec["max_hidden_norm"] == pytest.approx(H, rel=1e-15)
    worst = refgeo.worst_case_hidden_state(S, H=H)
    np.testing.assert_allclose(rec["h_star"], worst.h, rtol=1e-14, atol=0)
    assert rec["bound"] == pytest.approx(worst.value, rel=1e-14)
    assert 0 < rec["hilbert_rms"] <= rec["bound"]


@pytest.mark.parametrize("which", ["RowNorm", "DiameterLMO"])
def test_an_amplifying_decay_is_refused_before_the_step(which):
    # lr = 1, weight_decay = 3 reached inf in 2,000 steps without an error
    cls = getattr(rtorch, which)
    W = torch.nn.Parameter(torch.zeros(3, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match=re.escape("weight_decay == 3.0, must be <= 2 / lr = 2")):
        cls([W], lr=1.0, weight_decay=3.0)
    opt = cls([W], lr=0.1, weight_decay=3.0)
    opt.param_groups[0]["lr"] = 1.0  # a schedule's change between steps
    W.grad = torch.tensor([[1.0, 2.0], [-1.0, 0.5], [0.0, -2.5]], dtype=torch.float64)
    with pytest.raises(ValueError, match=re.escape("weight_decay == 3.0, must be <= 2 / lr = 2")):
        opt.step()
    assert torch.equal(W.detach(), torch.zeros(3, 2, dtype=torch.float64))


def test_monitor_refuses_a_bound_beyond_the_float64_range():
    # it recorded "bound": inf next to a finite Hilbert RMS
    W = torch.nn.Parameter(torch.zeros(2, 2, dtype=torch.float64))
    mon = rtorch.HeadStepMonitor(rtorch.RowNorm([W], lr=0.1), np.array([[1e200, 1.0]]))
    with pytest.raises(ValueError, match=re.escape("the bound max ||h|| * D(S) = 1e+200 * 2e+150 is beyond")):
        mon.record(np.array([[0.0, 1e150], [0.0, -1e150]]), step=1)
    assert mon.record(np.array([[0.0, 1e100], [0.0, -1e100]]), step=2)["bound"] == pytest.approx(2e300, rel=1e-15)


@pytest.mark.parametrize("make", [lambda W: rtorch.RowNorm([W], lr=0.1), lambda W: rtorch.DiameterLMO([W], lr=0.1)])
def test_bad_group_indices_and_steps_are_named(make):
    """last_step(5) was an IndexError, DiameterLMO.last_result(1) / (-1) / (True) None;
    HeadStepMonitor.record(step=1.5) recorded step 1."""
    W = torch.nn.Parameter(torch.zeros(4, 2, dtype=torch.float64))
    opt = make(W)
    methods = [opt.last_step] + ([opt.last_result] if hasattr(opt, "last_result") else [])
    for method in methods:
        assert method(0) is None  # before the first step
        with pytest.raises(ValueError, match=r"^group must be in \[0, 0\], got 5 instead"):
            method(5)
        with pytest.raises(ValueError, match="^group == -1"):
            method(-1)
        with pytest.raises(TypeError, match="^group must be an integer"):
            method(True)
    mon = rtorch.HeadStepMonitor(opt, np.eye(2))
    for bad in (None, 1.5, "1", True):
        with pytest.raises(TypeError, match="^step must be an integer"):
            mon.record(np.eye(4, 2), step=bad)
    assert mon.record(np.eye(4, 2), step=3)["step"] == 3


# --------------------------------------------------------------------------- DiameterLMO


@pytest.mark.parametrize("kw", [dict(), dict(momentum=0.9, weight_decay=0.1)])
def test_diameter_lmo_steps_equal_refgeo(kw):
    W0, grads = _lm_gradients(V=24, d=6, T=5, seed=10, zero_steps=(2,))
    W_np = W0.copy()
    ref = refgeo.DiameterLMO(lr=0.05, **kw)
    W = torch.nn.Parameter(torch.from_numpy(W0.copy()))
    opt = rtorch.DiameterLMO([W], lr=0.05, **kw)
    for g in grads:
        ref.step(W_np, g)
        W.grad = torch.from_numpy(g.copy())
        opt.step()
        np.testing.assert_array_equal(W.detach().numpy(), W_np)
        np.testing.assert_array_equal(opt.last_step().numpy(), ref.last_step())
        res = opt.last_result()
        assert res.gap <= 1e-3 and refgeo.row_diameter(res.update).value <= 0.05 * (1 + 1e-9)


def test_diameter_lmo_state_dict_round_trip_and_float32():
    W0, grads = _lm_gradients(V=16, d=5, T=6, seed=11, dtype=np.float32)
    W_a = torch.nn.Parameter(torch.from_numpy(W0.copy()))
    opt_a = rtorch.DiameterLMO([W_a], lr=0.05, momentum=0.5)
    for g in grads[:3]:
        W_a.grad = torch.from_numpy(g.copy())
        opt_a.step()
    # through a checkpoint file, read with torch.load's default weights_only=True (it
    # refused the NumPy arrays the state held)
    buf = io.BytesIO()
    torch.save(opt_a.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf)
    W_b = torch.nn.Parameter(W_a.detach().clone())
    opt_b = rtorch.DiameterLMO([W_b], lr=0.05, momentum=0.5)
    opt_b.load_state_dict(saved)
    for g in grads[3:]:
        for W, opt in ((W_a, opt_a), (W_b, opt_b)):
            W.grad = torch.from_numpy(g.copy())
            opt.step()
        assert W_a.dtype == torch.float32 and torch.equal(W_a, W_b)


def test_diameter_lmo_bad_input_and_monitor():
    with pytest.raises(ValueError, match=r"parameter 'b' must be 2-D"):
        rtorch.DiameterLMO([("b", torch.nn.Parameter(torch.zeros(3)))], lr=0.1)
    with pytest.raises(ValueError, match="lr"):
        rtorch.DiameterLMO([torch.nn.Parameter(torch.zeros(2, 2))], lr=0.0)
    W = torch.nn.Parameter(torch.zeros(3, 2, dtype=torch.float64))
    opt = rtorch.DiameterLMO([("head", W)], lr=0.1)
    W.grad = torch.tensor([[1.0, float("nan")], [0.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    with pytest.raises(ValueError, match="gradient of 'head'"):
        opt.step()
    one = torch.nn.Parameter(torch.zeros(1, 3, dtype=torch.float64))
    one.grad = torch.ones(1, 3, dtype=torch.float64)  # a one-row head: the row count, not the centering
    with pytest.raises(ValueError, match=r"gradient of 'one': grad must have at least 2 rows"):
        rtorch.DiameterLMO([("one", one)], lr=0.1).step()
    mon = rtorch.HeadStepMonitor(opt, torch.eye(2, dtype=torch.float64), every=1)
    W.grad = torch.tensor([[3.0, 4.0], [-3.0, -4.0], [0.0, 0.0]], dtype=torch.float64)
    opt.step()
    assert mon.records[0]["diameter"] == pytest.approx(0.1, rel=1e-9)


@pytest.mark.parametrize("cls", ["RowNorm", "DiameterLMO"])
def test_a_refused_param_group_leaves_the_optimizer_as_it_was(cls):
    W = torch.nn.Parameter(torch.zeros(4, 3, dtype=torch.float64))
    opt = getattr(rtorch, cls)([W], lr=0.1)
    state = opt.state_dict()
    with pytest.raises(ValueError, match="2-D"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(5, dtype=torch.float64))]})
    with pytest.raises(ValueError, match="lr"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2, 3, dtype=torch.float64))], "lr": -1.0})
    assert len(opt.param_groups) == 1 and opt.state_dict() == state
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2, 3, dtype=torch.float64))], "lr": 0.5})
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.5]


@pytest.mark.parametrize("bad", ["nan", "not_centered", "lr", "solve"])
def test_diameter_lmo_bad_group_changes_no_group(bad):
    """A bad gradient or hyper-parameter in group 1 leaves group 0 (parameter, solver
    state) as it was, as RowNorm does: the step is all or nothing."""
    W0, grads = _lm_gradients(V=8, d=3, T=3, seed=13)
    A = torch.nn.Parameter(torch.from_numpy(W0.copy()))
    B = torch.nn.Parameter(torch.from_numpy(W0.copy()))
    opt = rtorch.DiameterLMO([{"params": [A]}, {"params": [B]}], lr=0.05, momentum=0.5)
    A.grad, B.grad = torch.from_numpy(grads[0].copy()), torch.from_numpy(grads[0].copy())
    opt.step()
    A_before, saved = A.detach().clone(), copy.deepcopy(opt.state_dict())
    A.grad = torch.from_numpy(grads[1].copy())
    g = torch.from_numpy(grads[1].copy())
    if bad == "nan":
        g[0, 0] = float("nan")
    elif bad == "not_centered":
        g[0] += 1.0
    elif bad == "solve":
        # passes every check up front and fails in the solve: its tension is beyond
        # the float64 range (group 0 had moved when the solves ran one after a step)
        rows = refgeo.center_rows(np.random.default_rng(0).standard_normal((8, 3)))
        g = torch.from_numpy(rows / np.abs(rows).max() * 1.79e308)
    else:
        opt.param_groups[1]["lr"] = -1.0
    B.grad = g
    with pytest.raises(ValueError):
        opt.step()
    assert torch.equal(A.detach(), A_before)
    assert opt.state[A]["step"] == 1
    after = opt.state_dict()
    assert after["refgeo_solvers"][0]["t"] == saved["refgeo_solvers"][0]["t"] == 1
    np.testing.assert_array_equal(after["refgeo_solvers"][0]["buffer"], saved["refgeo_solvers"][0]["buffer"])


@pytest.mark.parametrize("cls", ["RowNorm", "DiameterLMO"])
def test_meta_parameters_are_refused_by_name(cls):
    W = torch.nn.Parameter(torch.empty(4, 3, device="meta"))
    with pytest.raises(TypeError, match="parameter 'head' is a meta tensor"):
        getattr(rtorch, cls)([("head", W)], lr=0.1)


def _momentum_checked_gradients():
    """Gradients for a momentum-0.9 DiameterLMO: ``G1`` centered; ``off`` not centered on
    its own (rows summing to 3e-2 of their norms) though its momentum average with
    ``G1``'s buffer would be; ``bad`` centered on its own (to 1e-5 of its norms) though
    its average with that buffer would not be (the buffer ``0.1 G1`` cancels
    ``-0.9 G1`` and leaves the offset).  Each gradient is checked, then centered, then
    averaged, so ``off`` is refused and ``bad`` taken."""
    W0, grads = _lm_gradients(V=8, d=3, T=1, seed=21)
    G1 = grads[0]
    G2 = 1e-3 * (G1 / np.abs(G1).max())
    off = G2 + 1e-2 * np.abs(G2).max()
    bad = -0.9 * G1 + 1e-6 * np.abs(G1).max()
    return W0, G1, off, bad


@pytest.mark.parametrize("seed", range(3))
def test_diameter_lmo_takes_gradients_computed_under_bfloat16_autocast(seed):
    """The usual mixed precision: float32 weights, the forward and backward under
    bfloat16 autocast, so the float32 gradient's rows sum to zero only to bfloat16's
    rounding (2e-4 to 4e-4 of the row norms here).  The tolerance 1e-4 refused it at
    every seed at V = 512; the step is now taken, and it is the NumPy optimizer's on the
    same gradient."""
    torch.manual_seed(seed)
    head = torch.nn.Linear(16, 512, bias=False)
    h = torch.randn(64, 16) + 2.0  # hidden states with a common component
    y = torch.randint(0, 512, (64,))
    W0 = head.weight.detach().double().numpy().copy()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = torch.nn.functional.cross_entropy(head(h), y)
    loss.backward()
    G = head.weight.grad.double().numpy()
    assert np.linalg.norm(G.sum(axis=0)) > 1e-4 * np.linalg.norm(G, axis=1).sum()
    opt = rtorch.DiameterLMO([head.weight], lr=0.1)
    opt.step()
    W_np = W0.copy()
    refgeo.DiameterLMO(lr=0.1).step(W_np, G)
    np.testing.assert_allclose(head.weight.detach().double().numpy(), W_np.astype(np.float32), rtol=0, atol=1e-6)
    assert refgeo.row_diameter(head.weight.detach().double().numpy() - W0).value <= 0.1 * (1 + 1e-5)


def test_diameter_lmo_checks_each_gradient_as_refgeo_does():
    """The torch optimizer's up-front check is the NumPy optimizer's: each gradient on
    its own (the solver's tolerance), so both refuse ``off``, both take ``bad``, and they
    step the same."""
    W0, G1, off, bad = _momentum_checked_gradients()
    with pytest.raises(ValueError, match="rows summing to zero"):
        refgeo.diameter_lmo(off, eta=0.05)  # not centered on its own
    refgeo.diameter_lmo(bad, eta=0.05)  # centered enough on its own
    W_np = W0.copy()
    ref = refgeo.DiameterLMO(lr=0.05, momentum=0.9)
    W = torch.nn.Parameter(torch.from_numpy(W0.copy()))
    opt = rtorch.DiameterLMO([W], lr=0.05, momentum=0.9)
    ref.step(W_np, G1)
    W.grad = torch.from_numpy(G1.copy())
    opt.step()
    with pytest.raises(ValueError, match="grad must have rows summing to zero"):
        ref.step(W_np, off)
    W.grad = torch.from_numpy(off.copy())
    with pytest.raises(ValueError, match="the gradient of .*rows summing to zero"):
        opt.step()
    np.testing.assert_array_equal(W.detach().numpy(), W_np)  # neither moved
    ref.step(W_np, bad)
    W.grad = torch.from_numpy(bad.copy())
    opt.step()
    np.testing.assert_array_equal(W.detach().numpy(), W_np)
    assert ref.t == 2 and opt.state_dict()["refgeo_solvers"][0]["t"] == 2


def test_diameter_lmo_group_whose_gradient_fails_changes_no_group():
    """A group whose gradient is not centered (the solver refuses it) leaves every group
    as it was, the groups before it included: the check is up front."""
    W0, G1, off, _ = _momentum_checked_gradients()
    A = torch.nn.Parameter(torch.from_numpy(W0.copy()))
    B = torch.nn.Parameter(torch.from_numpy(W0.copy()))
    opt = rtorch.DiameterLMO([{"params": [A]}, {"params": [B]}], lr=0.05, momentum=0.9)
    A.grad, B.grad = torch.from_numpy(G1.copy()), torch.from_numpy(G1.copy())
    opt.step()
    A_before, saved = A.detach().clone(), copy.deepcopy(opt.state_dict())
    A.grad, B.grad = torch.from_numpy(G1.copy()), torch.from_numpy(off.copy())
    with pytest.raises(ValueError, match="the gradient of .*rows summing to zero"):
        opt.step()
    assert torch.equal(A.detach(), A_before)
    after = opt.state_dict()
    assert after["refgeo_solvers"][0]["t"] == saved["refgeo_solvers"][0]["t"] == 1
    np.testing.assert_array_equal(after["refgeo_solvers"][0]["buffer"], saved["refgeo_solvers"][0]["buffer"])


def _bf16_centered_gradient(V, d, seed):
    """A centered float64 gradient rounded to bfloat16: the rounding alone moves the
    sum of its rows by more than 1e-4 of the row norms at small V."""
    rng = np.random.default_rng(seed)
    G = rng.standard_normal((V, d))
    G -= G.mean(axis=0)
    g = torch.tensor(G).bfloat16()
    g64 = g.double().numpy()
    ratio = np.linalg.norm(g64.sum(axis=0)) / np.linalg.norm(g64, axis=1).sum()
    assert 1e-4 < ratio < 2.0**-7
    return g, g64


def test_bfloat16_gradients_are_centered_to_their_own_precision():
    """refgeo.torch.DiameterLMO refused a bfloat16 cross-entropy gradient of 50 rows
    ("rows summing to zero ... 5.4e-03 against 2.3e+01"): the centering tolerance
    (1e-4 of the row norms) was float64's.  It is bfloat16's unit roundoff for every
    gradient now (one rounding cannot move the sum further), and its eps for bfloat16
    tensors; the float64 array of the same values (a gradient computed under bfloat16
    autocast) gives the same step."""
    g, g64 = _bf16_centered_gradient(50, 4, 3)
    np.testing.assert_allclose(refgeo.diameter_lmo(g64, eta=0.5).update, refgeo.diameter_lmo(g, eta=0.5).update.numpy(),
                               rtol=0, atol=1e-12)
    c64 = g64 - g64.mean(axis=0)  # what the solver takes: the bfloat16 values, centered
    # (centered once more inside: equal to the last bits)
    res, ref = refgeo.diameter_lmo(g, eta=0.5), refgeo.diameter_lmo(c64, eta=0.5)
    np.testing.assert_allclose(res.update.numpy(), ref.update, rtol=0, atol=1e-12)
    assert res.lower_bound == pytest.approx(ref.lower_bound, rel=1e-12)
    b, b_ref = refgeo.tension_bounds(g), refgeo.tension_bounds(c64)
    assert (b.lower, b.upper) == pytest.approx((b_ref.lower, b_ref.upper), rel=1e-12)
    np.testing.assert_allclose(refgeo.rescaled_rownorm(g).numpy(), refgeo.rescaled_rownorm(c64), rtol=0, atol=1e-12)
    # the optimizer: the same step as the NumPy optimizer on the centered values
    W = torch.nn.Parameter(torch.zeros(50, 4, dtype=torch.bfloat16))
    opt = refgeo.torch.DiameterLMO([W], lr=0.5)
    W.grad = g
    opt.step()
    ref_opt = refgeo.DiameterLMO(lr=0.5)
    ref_opt.step(np.zeros((50, 4)), c64)
    np.testing.assert_allclose(opt.last_step(0), ref_opt.last_step(), rtol=0, atol=1e-12)
    # a bfloat16 gradient that is not centered is still refused, by name: here off by
    # 2 bfloat16 eps (1.6% of the row norms), where its rounding could not take it
    off = g64 + 2 * 2.0**-7 * np.linalg.norm(g64, axis=1).sum() / 50 * np.array([1.0, 0, 0, 0])
    gb = torch.tensor(off).bfloat16()
    ob = gb.double().numpy()
    assert np.linalg.norm(ob.sum(axis=0)) / np.linalg.norm(ob, axis=1).sum() > 1.5 * 2.0**-7
    W.grad = gb
    with pytest.raises(ValueError, match=re.escape("must have rows summing to zero")):
        opt.step()
    for G in (gb, torch.tensor(off).to(torch.float8_e4m3fn)):  # float8: held to 2**-8, not its eps
        with pytest.raises(ValueError, match=re.escape("G must have rows summing to zero")):
            refgeo.diameter_lmo(G)


def test_precision_eps_reads_every_spelling_of_a_dtype():
    """The tolerances above key on the caller's precision, however it is spelt."""
    from refgeo._interop import precision_eps

    for spelling in (np.float32, np.dtype(np.float32), "float32", torch.float32, "torch.float32"):
        assert precision_eps(spelling) == np.finfo(np.float32).eps
    for spelling in (np.float16, torch.float16, "jax.float16"):
        assert precision_eps(spelling) == np.finfo(np.float16).eps
    assert precision_eps(torch.bfloat16) == precision_eps("torch.bfloat16") == 2.0**-7
    for exact in (np.float64, torch.float64, np.int64, torch.float8_e5m2, "torch.float8_e4m3fn"):
        assert precision_eps(exact) == 0.0


@pytest.mark.parametrize("kind", ["torch.DiameterLMO", "DiameterLMO", "RowNorm"])
def test_steps_written_through_numpy_views_are_seen_by_autograd(kind):
    """The optimizers write a CPU float parameter through its NumPy view, which torch's
    version counter does not see: a backward through a graph that saved the weight
    before the step used the new values silently.  torch's own optimizers make that
    backward raise; so do these."""
    rng = np.random.default_rng(0)
    G = rng.standard_normal((6, 3))
    G -= G.mean(axis=0)
    W = torch.nn.Parameter(torch.tensor(rng.standard_normal((6, 3))))
    loss = (W * W).sum()  # saves W for its backward
    if kind == "torch.DiameterLMO":
        W.grad = torch.tensor(G)
        refgeo.torch.DiameterLMO([W], lr=0.1).step()
    else:
        opt = refgeo.DiameterLMO(lr=0.1) if kind == "DiameterLMO" else refgeo.RowNorm(lr=0.1)
        assert opt.step(W, torch.tensor(G)) is W
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_rownorm_gradient_of_a_resized_parameter_changes_no_group():
    """A parameter resized in place (p.data = ...) keeps its momentum buffer: torch's
    broadcast error came after the earlier groups had moved and the step count grown."""
    rng = np.random.default_rng(3)
    A = torch.nn.Parameter(torch.from_numpy(rng.standard_normal((5, 3))))
    B = torch.nn.Parameter(torch.from_numpy(rng.standard_normal((5, 3))))
    opt = rtorch.RowNorm([{"params": [A]}, {"params": [B]}], lr=0.1, momentum=0.9)
    A.grad, B.grad = torch.ones(5, 3, dtype=torch.float64), torch.ones(5, 3, dtype=torch.float64)
    opt.step()
    A_before = A.detach().clone()
    B.data = torch.zeros(6, 3, dtype=torch.float64)
    B.grad = torch.ones(6, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match=re.escape("the gradient of param_groups[1]['params'][0] must keep "
                                                   "the shape of the optimizer state (5, 3), got shape (6, 3)")):
        opt.step()
    assert torch.equal(A.detach(), A_before) and opt.state[A]["step"] == opt.state[B]["step"] == 1


def test_diameter_lmo_messages_name_its_own_class_and_arguments():
    W, V = (torch.nn.Parameter(torch.zeros(4, 3, dtype=torch.float64)) for _ in range(2))
    with pytest.raises(ValueError, match=re.escape("refgeo.torch.DiameterLMO takes exactly one 2-D parameter")):
        rtorch.DiameterLMO([W, V], lr=0.1)
    opt = rtorch.DiameterLMO([W], lr=0.1)
    W.grad = torch.eye(4, 3, dtype=torch.float64).to_sparse()
    with pytest.raises(TypeError, match=re.escape("the gradient of param_groups[0]['params'][0] must be dense, "
                                                  "got a sparse tensor instead.")):
        opt.step()
    W.grad = torch.ones(4, 3, dtype=torch.float64)  # rows that do not sum to zero
    with pytest.raises(ValueError, match=r"the gradient of param_groups\[0\]\['params'\]\[0\]: grad must have "
                                         r"rows summing to zero"):
        opt.step()


def test_a_state_dict_of_the_other_optimizer_is_refused_before_any_change():
    """RowNorm's state loaded into a DiameterLMO (or back) raised KeyError at the next
    step, or after torch had replaced the param groups (the optimizer then unusable)."""
    W = torch.nn.Parameter(torch.from_numpy(np.random.default_rng(0).standard_normal((5, 3))))
    rn, lmo = rtorch.RowNorm([W], lr=0.1), rtorch.DiameterLMO([W], lr=0.2)
    W.grad = torch.from_numpy(refgeo.center_rows(np.random.default_rng(1).standard_normal((5, 3))))
    rn.step()
    lmo.step()
    for opt, other in ((rn, lmo), (lmo, rn)):
        before = copy.deepcopy(opt.state_dict())
        with pytest.raises(ValueError, match=re.escape(f"state_dict must be a state_dict() of refgeo.torch."
                                                       f"{type(opt).__name__}, got param group 0 without")):
            opt.load_state_dict(other.state_dict())
        after = opt.state_dict()
        assert after["param_groups"] == before["param_groups"]
        opt.step()  # still usable


def test_diameter_lmo_refuses_a_parameter_with_repeated_entries():
    """Written through its NumPy view, an expanded parameter came back with all rows
    equal to the last row's step, without an error."""
    W = torch.nn.Parameter(torch.zeros(1, 3, dtype=torch.float64).expand(5, 3))
    opt = rtorch.DiameterLMO([W], lr=0.1)
    W.grad = torch.from_numpy(refgeo.center_rows(np.random.default_rng(0).standard_normal((5, 3))))
    with pytest.raises(ValueError, match=re.escape("parameter param_groups[0]['params'][0] must not repeat")):
        opt.step()
    assert not W.detach().any() and opt.last_result(0) is None


@pytest.mark.parametrize("Opt", ["RowNorm", "DiameterLMO"])
@pytest.mark.parametrize("layout", ["expanded", "unfolded"])
def test_optimizers_refuse_parameters_whose_rows_overlap(Opt, layout):
    """RowNorm took an unfolded parameter (rows sharing entries with their neighbors)
    and returned it wrong, 0.16 off its step, without an error; an expanded one raised
    torch's RuntimeError after the step count and momentum had moved.  Both optimizers
    refuse them, naming the parameter, with the parameter and the state untouched."""
    V, d = 6, 3
    base = torch.zeros(d if layout == "expanded" else V + d - 1, dtype=torch.float64)
    W = base.expand(V, d) if layout == "expanded" else base.unfold(0, d, 1)
    W.requires_grad_()
    opt = getattr(rtorch, Opt)([W], lr=0.1)
    W.grad = torch.from_numpy(refgeo.center_rows(np.random.default_rng(0).standard_normal((V, d))))
    with pytest.raises(ValueError, match=re.escape("parameter param_groups[0]['params'][0] must not repeat")):
        opt.step()
    assert not base.any() and not opt.state.get(W)
    # the same step on a copy is taken
    P = W.detach().clone().requires_grad_()
    opt = getattr(rtorch, Opt)([P], lr=0.1)
    P.grad = W.grad.clone()
    opt.step()
    assert P.detach().abs().max() > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_parameters_are_rounded_once_as_by_the_numpy_optimizer(dtype):
    """A decayed bfloat16 head was rounded after the decay and again after the step:
    5,840 of 16,384 weights one unit in the last place off refgeo.RowNorm's, which
    decays and steps on a float32 copy and rounds once."""
    torch.manual_seed(0)
    W = torch.randn(256, 64).to(dtype)
    g = torch.randn(256, 64).to(dtype)
    P = torch.nn.Parameter(W.clone())
    opt = rtorch.RowNorm([P], lr=0.05, weight_decay=0.3)
    for _ in range(2):
        P.grad = g.clone()
        opt.step()
    Q, ref = W.clone(), refgeo.RowNorm(lr=0.05, weight_decay=0.3)
    for _ in range(2):
        ref.step(Q, g.clone())
    assert torch.equal(P.detach(), Q)


def test_parameters_with_the_negative_bit_are_updated():
    """z.conj().imag is a float64 tensor with torch's negative bit, which has no NumPy
    view: the NumPy optimizers updated a resolved copy and lost it (state advanced,
    parameter unchanged), and refgeo.torch.DiameterLMO raised torch's RuntimeError
    after moving the earlier groups.  Each now takes the step of the resolved tensor."""
    torch.manual_seed(0)
    g = torch.from_numpy(refgeo.center_rows(np.random.default_rng(0).standard_normal((6, 3))))
    for opt_cls in (refgeo.RowNorm, refgeo.DiameterLMO):
        p = torch.randn(6, 3, dtype=torch.complex128).conj().imag
        assert p.is_neg()
        want = p.resolve_neg().clone()
        opt_cls(lr=0.1).step(want, g.clone())
        assert opt_cls(lr=0.1).step(p, g.clone()) is p
        assert torch.equal(p, want)
    A = torch.nn.Parameter(torch.randn(6, 3, dtype=torch.float64))
    B = torch.randn(6, 3, dtype=torch.complex128).conj().imag
    A0, B0 = A.detach().clone(), B.resolve_neg().clone()
    opt = rtorch.DiameterLMO([{"params": [A]}, {"params": [B]}], lr=0.1)
    A.grad, B.grad = g.clone(), g.clone()
    opt.step()
    twin = [torch.nn.Parameter(A0.clone()), torch.nn.Parameter(B0.clone())]
    ref = rtorch.DiameterLMO([{"params": [twin[0]]}, {"params": [twin[1]]}], lr=0.1)
    twin[0].grad, twin[1].grad = g.clone(), g.clone()
    ref.step()
    assert torch.equal(A.detach(), twin[0].detach()) and torch.equal(B, twin[1].detach())


def test_a_refused_diameter_lmo_state_changes_nothing():
    """load_state_dict loaded torch's part (a new lr) and dropped the solvers' momentum
    and warm starts before it refused a saved solver state."""
    def trained(seed):
        torch.manual_seed(seed)
        W = torch.nn.Parameter(torch.randn(6, 3, dtype=torch.float64))
        opt = rtorch.DiameterLMO([W], lr=0.1, momentum=0.5)
        for t in range(2):
            W.grad = torch.from_numpy(refgeo.center_rows(np.random.default_rng(seed + t).standard_normal((6, 3))))
            opt.step()
        return opt

    opt, other = trained(0), trained(1)
    bad = opt.state_dict()
    bad["refgeo_solvers"][0]["warm_flows"] = -bad["refgeo_solvers"][0]["warm_flows"] - 1
    bad["param_groups"][0]["lr"] = 0.3
    before = copy.deepcopy(other.state_dict())
    with pytest.raises(ValueError, match=re.escape("state['warm_flows'] must be finite flow magnitudes >= 0")):
        other.load_state_dict(bad)
    after = other.state_dict()
    assert after["param_groups"] == before["param_groups"] and other.last_result() is not None
    for key, value in before["refgeo_solvers"][0].items():
        got = after["refgeo_solvers"][0][key]
        assert torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_rownorm_of_a_gradient_with_equal_rows_does_not_move(dtype):
    """Rows all equal are a common row shift, which centering removes exactly
    (``P 1 x^T = 0``): one pass left each row at the rounding of the mean, and the row
    normalization made that a full step of ``lr`` for every row.  As refgeo.RowNorm."""
    x = torch.tensor([-0.23531485, 0.21645473, 0.6693357, 0.42196949], dtype=torch.float64)
    g = x.repeat(5, 1).to(dtype)
    W = torch.nn.Parameter(torch.ones(5, 4, dtype=dtype))
    opt = rtorch.RowNorm([W], lr=0.1, eps=0.0)
    W.grad = g.clone()
    opt.step()
    assert torch.equal(W.detach(), torch.ones(5, 4, dtype=dtype))
    W_np = np.ones((5, 4))
    refgeo.RowNorm(lr=0.1, eps=0.0).step(W_np, g.double().numpy())
    np.testing.assert_array_equal(W_np, 1.0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("center", [True, False])
def test_rownorm_step_makes_no_temporary_of_the_gradients_size(dtype, center, monkeypatch):
    """The docstring promises O(V + d) memory besides the state: ``isfinite(g).all()``
    made a float copy of g and three boolean ones, the equal-rows test of centering a
    (V, d) boolean array, and a bfloat16 parameter was stepped through a float32 copy of
    all of it.  The largest allocation of a step, from torch's profiler, stays below an
    eighth of the state (the bfloat16 blocks set to 1024 entries here)."""
    from torch.profiler import ProfilerActivity, profile

    monkeypatch.setattr(rtorch, "_BLOCK_ENTRIES", 1024)
    V, d = 256, 64
    torch.manual_seed(0)
    W = torch.nn.Parameter(torch.randn(V, d, dtype=dtype))
    W.grad = torch.randn(V, d).to(dtype)
    opt = rtorch.RowNorm([W], lr=0.1, weight_decay=0.01, center=center)
    opt.step()  # the state exists before the measured step
    before = W.detach().clone()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        opt.step()
    state = opt.state[W]["momentum_buffer"]
    largest = max(e.self_cpu_memory_usage for e in prof.events())
    assert 0 < largest <= state.numel() * state.element_size() / 8, largest
    assert not torch.equal(W.detach(), before)  # it did step
