"""The offline demo behind ``refgeo demo``: head optimizers on Python's own documentation.

Pipeline (every stage uses only what this installation of refgeo provides; a stage
whose library part is missing is skipped and the report says so):

1. corpus: :mod:`refgeo._corpus` tokenises ``pydoc_data.topics`` and standard-library
   docstrings, vocabulary of V words plus ``<unk>``;
2. features: a fixed (untrained) two-layer feature map of the previous ``c`` tokens,
   ``h0 = sum_k E_k[w_{t-k}]`` (random projections of the one-hot context, one
   projection per position) and ``h1 = h0 + tanh(h0 R)`` (a fixed residual layer);
   the last coordinate of ``h1`` is a constant 1 (the head's bias);
3. training: only the softmax head ``W`` (V x d) is trained, from ``W = 0`` on the same
   mini-batches for every optimizer: AdamW (written here), RowNorm, rescaled RowNorm,
   the warm-started exact diameter LMO and the spreading update;
4. diagnostics: per-step row diameter ``D(S_t)`` of the actual update ``S_t`` and the
   Hilbert RMS of the step on a panel of held-out hidden states against the bound
   ``max ||h|| D(S_t)``; the certified LMO gap and the RowNorm/exact ratio along
   training; the final head's distance ratio against the upper bound for (V, d); a
   tokenwise decomposition of the feature layer ``h0 -> h1``; timings;
5. report: ``report.md``, PNG plots (matplotlib, Agg backend) and ``results.json``.

Examples
--------
>>> sorted(SIZES)
['full', 'quick', 'tiny']
>>> SIZES["full"].vocab
3000
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import os
import platform
import sys
import time
from typing import Any, Callable

import numpy as np

from . import _corpus

__all__ = ["DemoSize", "SIZES", "run_demo"]


@dataclasses.dataclass(frozen=True, slots=True)
class DemoSize:
    """Sizes, hyper-parameters and time budgets of one demo run.

    Attributes
    ----------
    vocab, d, context : int
        Vocabulary size (with ``<unk>``), hidden width, number of previous tokens.
    batch, steps : int
        Mini-batch size and number of optimizer steps per method.
    diag_every, eval_every, lmo_every : int
        Step intervals of the update diagnostics, held-out loss and LMO certificates.
    n_eval, n_panel, n_tokenwise : int
        Held-out tokens for the loss, hidden states in the Hilbert-RMS panel, tokens in
        the tokenwise decomposition.
    max_files : int or None
        Standard-library files read for docstrings (None: all).
    budget_s : float
        Seconds of updates allowed for rescaled RowNorm (one certified diameter per
        step); past it, it stops early and the report says so.  AdamW and RowNorm
        (O(B V d) per step) always run every step.
    lmo_budget_s : float
        The same for the two optimizers that solve an exact LMO every step (the exact
        diameter LMO and the spreading update).
    lmo_step_s : float
        ``max_time`` of each of their solves (the best certified step so far is used).
    spread_max_vocab : int
        The spreading update (an exact LMO plus a max-min solve per step) runs only for
        ``vocab <= spread_max_vocab``.
    lmo_rows : int
        The LMO certificates along training use the ``lmo_rows`` gradient rows of largest
        norm (re-centred), so that the solver can close its gap within ``lmo_solve_s``.
    lmo_solve_s : float
        ``max_time`` of each certificate solve.
    diag_budget_s : float
        Seconds of per-step diagnostics per optimizer (their interval grows to fit).
    stage_budget_s : float
        Seconds for each of the LMO-certificate and head-geometry analyses.
    lr_adamw, gamma : float
        AdamW learning rate; RowNorm step ``gamma`` (the diameter budget is ``2 gamma``).
    top_rows : int
        The final-head geometry is also reported on the rows of the ``top_rows`` most
        frequent training targets.
    """

    vocab: int
    d: int
    context: int
    batch: int
    steps: int
    diag_every: int
    eval_every: int
    lmo_every: int
    n_eval: int
    n_panel: int
    n_tokenwise: int
    max_files: int | None
    budget_s: float
    lmo_budget_s: float
    lmo_step_s: float
    spread_max_vocab: int
    lmo_rows: int
    lmo_solve_s: float
    diag_budget_s: float
    stage_budget_s: float
    lr_adamw: float
    gamma: float
    top_rows: int = 256


SIZES: dict[str, DemoSize] = {
    "full": DemoSize(vocab=3000, d=64, context=3, batch=256, steps=400, diag_every=4, eval_every=25,
                     lmo_every=50, n_eval=2048, n_panel=512, n_tokenwise=1500, max_files=None,
                     budget_s=20.0, lmo_budget_s=20.0, lmo_step_s=0.3, spread_max_vocab=600, lmo_rows=300,
                     lmo_solve_s=1.5, diag_budget_s=4.0, stage_budget_s=12.0, lr_adamw=0.04, gamma=0.025),
    "quick": DemoSize(vocab=2000, d=32, context=3, batch=128, steps=120, diag_every=4, eval_every=20,
                      lmo_every=40, n_eval=1024, n_panel=256, n_tokenwise=600, max_files=40,
                      budget_s=2.0, lmo_budget_s=2.0, lmo_step_s=0.1, spread_max_vocab=600, lmo_rows=150,
                      lmo_solve_s=0.5, diag_budget_s=1.0, stage_budget_s=2.0, lr_adamw=0.04, gamma=0.025),
    "tiny": DemoSize(top_rows=64, vocab=300, d=16, context=2, batch=64, steps=24, diag_every=3, eval_every=8,
                     lmo_every=12, n_eval=256, n_panel=64, n_tokenwise=200, max_files=6,
                     budget_s=0.5, lmo_budget_s=0.5, lmo_step_s=0.05, spread_max_vocab=600, lmo_rows=60,
                     lmo_solve_s=0.2, diag_budget_s=0.3, stage_budget_s=0.5, lr_adamw=0.04, gamma=0.025),
}

_MOMENTUM = 0.95
_EPS = 1e-8


# ------------------------------------------------------------------ small utilities

def _lib(module: str, name: str) -> Any:
    """``refgeo.<module>.<name>`` or None when this installation does not have it."""
    try:
        mod = importlib.import_module(f"refgeo.{module}")
    except ImportError:
        return None
    return getattr(mod, name, None)


class _Progress:
    """tqdm when importable, else a throttled counter on stderr."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled, self.n = total, enabled, 0
        self._bar = None
        self._last = 0.0
        self._desc = ""
        if enabled:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, file=sys.stderr, unit="step", dynamic_ncols=True, leave=True)
            except ImportError:
                self._bar = None

    def describe(self, text: str) -> None:
        self._desc = text
        if self._bar is not None:
            self._bar.set_description(text)
        elif self.enabled:
            self._print(force=True)

    def update(self, k: int = 1) -> None:
        self.n += k
        if self._bar is not None:
            self._bar.update(k)
        elif self.enabled:
            self._print()

    def _print(self, force: bool = False) -> None:
        now = time.perf_counter()
        if force or now - self._last > 0.5 or self.n >= self.total:
            self._last = now
            print(f"\r[refgeo demo] {self._desc}: {self.n}/{self.total} steps", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.enabled:
            print(file=sys.stderr, flush=True)


class _Timer:
    def __init__(self) -> None:
        self.t: dict[str, float] = {}

    def add(self, key: str, dt: float) -> None:
        self.t[key] = self.t.get(key, 0.0) + dt


# ------------------------------------------------------------------ model

class _Features:
    """Fixed random features of the previous ``context`` tokens (see the module docstring)."""

    def __init__(self, V: int, d: int, context: int, rng: np.random.Generator) -> None:
        self.context = context
        self.E = rng.standard_normal((context, V, d)) * (2.0 / math.sqrt(context * d))
        self.R = rng.standard_normal((d, d)) * (1.5 / math.sqrt(d))

    def __call__(self, ids: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        h0 = self.E[0][ids[pos - 1]]
        for k in range(1, self.context):
            h0 = h0 + self.E[k][ids[pos - 1 - k]]
        h1 = h0 + np.tanh(h0 @ self.R)
        h0[:, -1] = 1.0
        h1[:, -1] = 1.0
        return h0, h1


def _loss_grad(W: np.ndarray, H: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    """Mean cross-entropy of softmax(H W^T) and its gradient in W (rows sum to zero)."""
    Z = H @ W.T
    Z -= Z.max(axis=1, keepdims=True)
    P = np.exp(Z)
    s = P.sum(axis=1, keepdims=True)
    rows = np.arange(len(y))
    loss = float(np.mean(np.log(s[:, 0]) - Z[rows, y]))
    P /= s
    P[rows, y] -= 1.0
    return loss, P.T @ H / len(y)


def _loss(W: np.ndarray, H: np.ndarray, y: np.ndarray, chunk: int = 1024) -> float:
    total = 0.0
    for a in range(0, len(y), chunk):
        Z = H[a : a + chunk] @ W.T
        m = Z.max(axis=1, keepdims=True)
        lse = np.log(np.exp(Z - m).sum(axis=1)) + m[:, 0]
        total += float(np.sum(lse - Z[np.arange(len(Z)), y[a : a + chunk]]))
    return total / len(y)


# ------------------------------------------------------------------ optimizers

class _AdamW:
    """AdamW (decoupled weight decay), a few lines of NumPy."""

    def __init__(self, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01) -> None:
        self.lr, self.b1, self.b2, self.eps, self.wd = lr, betas[0], betas[1], eps, weight_decay
        self.m = self.v = None

    def update(self, W: np.ndarray, G: np.ndarray, t: int) -> np.ndarray:
        if self.m is None:
            self.m, self.v = np.zeros_like(W), np.zeros_like(W)
        self.m = self.b1 * self.m + (1 - self.b1) * G
        self.v = self.b2 * self.v + (1 - self.b2) * G * G
        mhat = self.m / (1 - self.b1**t)
        vhat = self.v / (1 - self.b2**t)
        return -self.lr * (mhat / (np.sqrt(vhat) + self.eps) + self.wd * W)


class _LibOptimizer:
    """A refgeo.optim optimizer (``step(param, grad)`` updates ``param`` in place)."""

    def __init__(self, opt: Any) -> None:
        self.opt = opt
        self.gaps: list[tuple[int, float]] = []

    def update(self, W: np.ndarray, G: np.ndarray, t: int) -> np.ndarray:
        P = W.copy()
        out = self.opt.step(P, G)
        if isinstance(out, np.ndarray) and out.shape == W.shape:
            P = out
        res = getattr(self.opt, "last_result", None)
        if res is not None and getattr(res, "gap", None) is not None:
            self.gaps.append((t, float(res.gap)))
        return P - W


class _MomentumRule:
    """Bias-corrected momentum B_t (as RowNorm) fed to a library direction ``fn(B, eta)``."""

    def __init__(self, fn: Callable[[np.ndarray, float], Any], eta: float) -> None:
        self.fn, self.eta, self.B = fn, eta, None
        self.gaps: list[tuple[int, float]] = []

    def update(self, W: np.ndarray, G: np.ndarray, t: int) -> np.ndarray:
        self.B = (1 - _MOMENTUM) * G if self.B is None else _MOMENTUM * self.B + (1 - _MOMENTUM) * G
        Bhat = self.B / (1 - _MOMENTUM**t)
        S = self.fn(Bhat, self.eta)
        S = getattr(S, "update", S)
        return np.asarray(S, dtype=np.float64)


def _call_kw(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """Call ``fn`` with the keyword arguments it accepts."""
    import inspect

    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return fn(*args, **kwargs)
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return fn(*args, **kwargs)
    return fn(*args, **{k: v for k, v in kwargs.items() if k in params})


def _make_methods(size: DemoSize) -> tuple[list[tuple[str, str, Callable[[], Any]]], list[str]]:
    """(name, label, factory) of the available optimizers, and why others are skipped."""
    eta = 2.0 * size.gamma
    methods: list[tuple[str, str, Callable[[], Any]]] = [
        ("adamw", f"AdamW (lr {size.lr_adamw:g})", lambda: _AdamW(size.lr_adamw))
    ]
    skipped: list[str] = []
    RowNorm = _lib("optim", "RowNorm")
    if RowNorm is not None:
        methods.append(("rownorm", f"RowNorm (gamma {size.gamma:g})",
                        lambda: _LibOptimizer(RowNorm(lr=size.gamma, mu=_MOMENTUM, eps=_EPS))))
    else:
        skipped.append("RowNorm: `refgeo.optim.RowNorm` is not available in this installation.")
    rescaled = _lib("lmo", "rescaled_rownorm")
    if rescaled is not None:
        methods.append(("rescaled", f"rescaled RowNorm (eta {eta:g})",
                        lambda: _MomentumRule(lambda B, e: rescaled(B, eta=e), eta)))
    else:
        skipped.append("rescaled RowNorm: `refgeo.lmo.rescaled_rownorm` is not available in this installation.")
    DiameterLMO = _lib("optim", "DiameterLMO")
    if DiameterLMO is not None:
        methods.append(("exact_lmo", f"exact diameter LMO (eta {eta:g})",
                        lambda: _LibOptimizer(DiameterLMO(lr=eta, momentum=_MOMENTUM, rtol=1e-2,
                                                          max_time=size.lmo_step_s))))
    else:
        skipped.append("exact diameter LMO: `refgeo.optim.DiameterLMO` is not available in this installation.")
    spread_update = _lib("spreading", "spread_update")
    if spread_update is None:
        skipped.append("spreading update: `refgeo.spreading.spread_update` is not available in this installation.")
    elif size.vocab > size.spread_max_vocab:
        skipped.append(f"spreading update: not trained at V = {size.vocab} (each step solves an exact LMO "
                       f"and a max-min problem over all V rows, minutes per step at this size; the demo trains "
                       f"it for V <= {size.spread_max_vocab}, e.g. its internal `tiny` size). Section 4 shows "
                       "what the max-min solver `refgeo.spread` reaches for this (V, d).")
    else:
        methods.append(("spread", f"spreading update (eta {eta:g})",
                        lambda: _MomentumRule(lambda B, e: _call_kw(spread_update, B, eta=e, n_points=3,
                                                                    lmo_rtol=0.5, max_time=size.lmo_step_s,
                                                                    seed=0), eta)))
    return methods, skipped


# ------------------------------------------------------------------ training

@dataclasses.dataclass
class _Run:
    name: str
    label: str
    steps: list[int] = dataclasses.field(default_factory=list)
    train_loss: list[float] = dataclasses.field(default_factory=list)
    eval_steps: list[int] = dataclasses.field(default_factory=list)
    eval_loss: list[float] = dataclasses.field(default_factory=list)
    diag_steps: list[int] = dataclasses.field(default_factory=list)
    D: list[float] = dataclasses.field(default_factory=list)
    rms: list[float] = dataclasses.field(default_factory=list)
    bound: list[float] = dataclasses.field(default_factory=list)
    update_s: float = 0.0
    diag_s: float = 0.0
    steps_done: int = 0
    stopped_early: bool = False
    W: np.ndarray | None = None
    grads: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)
    error: str | None = None
    gaps: list[tuple[int, float]] = dataclasses.field(default_factory=list)


def _train(name, label, factory, *, size, batches, feats, ids, H_eval, y_eval, H_panel,
           progress, keep_grads) -> _Run:
    """Train one head from W = 0; stop early past ``size.budget_s`` seconds of updates.

    Diagnostics run every ``every`` steps, ``every`` doubling whenever their time would
    exceed ``size.diag_budget_s`` per optimizer (so a slow diameter backend stays cheap).
    """
    row_diameter = _lib("rows", "row_diameter")
    hilbert_rms = _lib("rows", "hilbert_rms")
    hmax = float(np.linalg.norm(H_panel, axis=1).max())
    run = _Run(name, label)
    V, d = size.vocab, size.d
    W = np.zeros((V, d))
    rule = factory()
    progress.describe(name)
    run.eval_steps.append(0)
    run.eval_loss.append(_loss(W, H_eval, y_eval))
    every = size.diag_every
    # cheap O(B V d) steps always run to the end; the O(V^2 d)-per-step methods have budgets
    budget = {"rescaled": size.budget_s, "exact_lmo": size.lmo_budget_s, "spread": size.lmo_budget_s}.get(name, math.inf)
    for t in range(1, size.steps + 1):
        t0 = time.perf_counter()
        pos = batches[t - 1]
        _, H = feats(ids, pos)
        loss, G = _loss_grad(W, H, ids[pos])
        try:
            S = rule.update(W, G, t)
        except Exception as exc:  # noqa: BLE001 - a failing optimizer must not stop the demo
            run.error = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
            progress.update(size.steps - t + 1)
            break
        W = W + S
        run.update_s += time.perf_counter() - t0
        run.steps.append(t)
        run.train_loss.append(loss)
        if keep_grads and (t % size.lmo_every == 0 or t == 1):
            run.grads[t] = G
        t0 = time.perf_counter()
        if row_diameter is not None and (t % every == 0 or t == 1):
            D = float(row_diameter(S).value)
            run.diag_steps.append(t)
            run.D.append(D)
            run.bound.append(hmax * D)
            if hilbert_rms is not None:
                run.rms.append(float(hilbert_rms(S, H_panel)))
        if t % size.eval_every == 0 or t == size.steps:
            run.eval_steps.append(t)
            run.eval_loss.append(_loss(W, H_eval, y_eval))
        run.diag_s += time.perf_counter() - t0
        if run.diag_steps and t == run.diag_steps[-1]:
            # space the remaining diagnostics so that they fit in diag_budget_s
            per_diag = run.diag_s / len(run.diag_steps)
            every = max(size.diag_every, math.ceil(size.steps * per_diag / size.diag_budget_s))
        run.steps_done = t
        progress.update()
        if run.update_s > budget and t < size.steps:
            run.stopped_early = True
            progress.update(size.steps - t)
            break
    if run.steps_done and run.eval_steps[-1] != run.steps_done:
        run.eval_steps.append(run.steps_done)
        run.eval_loss.append(_loss(W, H_eval, y_eval))
    run.W = W
    run.gaps = list(getattr(rule, "gaps", []))
    return run


# ------------------------------------------------------------------ analyses

def _tension_bounds(res: Any) -> tuple[float, float] | None:
    """(lower, upper) certified bounds on T(G) of an LMOResult."""
    lo, hi = getattr(res, "lower_bound", None), getattr(res, "upper_bound", None)
    if lo is None or hi is None:
        return None
    return float(lo), float(hi)


def _lmo_track(run: _Run, size: DemoSize) -> tuple[dict[str, Any] | None, str | None]:
    """Certified LMO gap and RowNorm/exact ratio at the stored gradients of ``run``.

    Each gradient is restricted to its ``size.lmo_rows`` rows of largest norm and
    re-centred (the rows that carry the step), so the solver can certify T(G) within
    ``size.lmo_solve_s`` seconds.
    """
    diameter_lmo = _lib("lmo", "diameter_lmo")
    if diameter_lmo is None:
        return None, "LMO certificates: `refgeo.lmo.diameter_lmo` is not available in this installation."
    out: dict[str, Any] = {"trajectory": run.label, "rows": size.lmo_rows, "steps": [], "gap": [],
                           "lower": [], "upper": [], "half_sum": [], "ratio_lo": [], "ratio_hi": [],
                           "seconds": [], "solver_gap": []}
    t_start = time.perf_counter()
    for t in sorted(run.grads):
        G = run.grads[t]
        keep = np.sort(np.argsort(-np.linalg.norm(G, axis=1), kind="stable")[: size.lmo_rows])
        Gk = G[keep] - G[keep].mean(axis=0)
        t0 = time.perf_counter()
        res = diameter_lmo(Gk, eta=1.0, rtol=1e-3, max_time=size.lmo_solve_s)
        dt = time.perf_counter() - t0
        tb = _tension_bounds(res)
        if tb is None:
            return None, "LMO certificates: the LMOResult has no certified bounds."
        lo, hi = tb
        closed = _lib("lmo", "tension_bounds")
        if closed is not None:  # the closed-form bracket of SPEC §3 (1/2 sum, Jung, pairwise flow)
            cb = closed(Gk)
            lo, hi = max(lo, float(cb.lower)), min(hi, float(cb.upper))
        half = 0.5 * float(np.linalg.norm(Gk, axis=1).sum())
        out["steps"].append(t)
        out["gap"].append((hi - lo) / hi if hi > 0 else 0.0)
        out["solver_gap"].append(float(res.gap))
        out["lower"].append(lo)
        out["upper"].append(hi)
        out["half_sum"].append(half)
        out["ratio_lo"].append(half / hi if hi > 0 else 1.0)
        out["ratio_hi"].append(min(1.0, half / lo) if lo > 0 else 1.0)
        out["seconds"].append(dt)
        if time.perf_counter() - t_start > size.stage_budget_s:
            break
    return out, None


def _head_geometry(runs: list[_Run], size: DemoSize, targets: np.ndarray,
                   rng: np.random.Generator) -> tuple[dict[str, Any] | None, list[str]]:
    """Distance ratio of each trained head (all rows, and rows of tokens seen as targets)."""
    row_diameter = _lib("rows", "row_diameter")
    closest_pair = _lib("rows", "closest_pair")
    notes: list[str] = []
    if row_diameter is None or closest_pair is None:
        return None, ["final-head geometry: `refgeo.rows` is not available in this installation."]
    covering_radius = _lib("rows", "covering_radius")
    jung_constant = _lib("rows", "jung_constant")
    ratio_upper_bound = _lib("bounds", "ratio_upper_bound")
    V, d = size.vocab, size.d
    out: dict[str, Any] = {"V": V, "d": d, "methods": {}}
    if ratio_upper_bound is not None:
        out["upper_bound"] = _value(ratio_upper_bound(V, d))
    else:
        notes.append("rho upper bound: `refgeo.bounds.ratio_upper_bound` is not available in this installation.")
    X = rng.standard_normal((V, d))
    X /= np.linalg.norm(X, axis=1, keepdims=True)
    out["random_sphere_rho"] = float(closest_pair(X).value / row_diameter(X).value)
    spread = _lib("spreading", "spread")
    if spread is not None:
        res = spread(V, d, seed=0, max_time=size.stage_budget_s / 4)
        out["spread_rho"] = float(res.ratio)
    else:
        notes.append("max-min solver reference: `refgeo.spreading.spread` is not available in this installation.")
    t_start = time.perf_counter()
    for run in runs:
        W = run.W
        D, m = row_diameter(W), closest_pair(W)
        # the most frequent targets of this run: rows the head has evidence on
        counts = np.bincount(targets[: run.steps_done].ravel(), minlength=V)
        seen = np.sort(np.argsort(-counts, kind="stable")[: min(size.top_rows, int(np.count_nonzero(counts)))])
        Ws = W[seen]
        Ds, ms = row_diameter(Ws), closest_pair(Ws)
        rec: dict[str, Any] = {"D": float(D.value), "m": float(m.value),
                               "rho": float(m.value / D.value) if D.value > 0 else 0.0,
                               "rho_seen": float(ms.value / Ds.value) if Ds.value > 0 else 0.0,
                               "n_seen": int(len(seen))}
        if ratio_upper_bound is not None:
            rec["upper_bound_seen"] = _value(ratio_upper_bound(int(len(seen)), d))
        k = int(np.linalg.matrix_rank(W - W.mean(axis=0)))
        rec["rank"] = k
        if covering_radius is not None and time.perf_counter() - t_start < size.stage_budget_s:
            ball = covering_radius(W, max_iter=2000, tol=1e-6)
            rec["rad"] = float(ball.radius)
            rec["rad_lower"] = float(ball.lower_bound)
        if jung_constant is not None:
            rec["jung_upper"] = float(jung_constant(k)) * rec["D"]
        out["methods"][run.name] = rec
    return out, notes


def _value(x: Any) -> float:
    return float(getattr(x, "value", x))


def _tokenwise(feats: _Features, ids: np.ndarray, pos: np.ndarray, head: _Run | None) -> tuple[dict[str, Any] | None, str | None]:
    """Decompose the fixed feature layer h0 -> h1 and, with a trained head, the KL of patching."""
    decompose = _lib("tokenwise", "decompose")
    if decompose is None:
        return None, "tokenwise decomposition: `refgeo.tokenwise.decompose` is not available in this installation."
    X, Y = feats(ids, pos)
    k = min(2 * X.shape[1], X.shape[0] - 1)
    res = _call_kw(decompose, X, Y, k=k, cls="full", ridge=1e-3)
    out: dict[str, Any] = {"N": int(X.shape[0]), "d": int(X.shape[1]), "k": k, "cls": "full (ridge 1e-3)",
                           "per_token": {}, "scalars": {}}
    summary = getattr(res, "summary", None)
    if callable(summary):
        for key, v in summary().items():
            if isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool):
                out["scalars"][key] = float(v)
    else:
        out["scalars"]["energy_fraction"] = float(res.energy_fraction)
    for name in ("relative_error", "angle_rho_tau", "angle_delta_tau"):
        v = getattr(res, name, None)
        if v is not None:
            out["per_token"][name] = np.asarray(v, dtype=float)
    output_perturbation = _lib("tokenwise", "output_perturbation")
    spearman = _lib("tokenwise", "spearman")
    patched = getattr(res, "patched", None)
    if head is not None and output_perturbation is not None and callable(patched):
        W = head.W
        kl = np.asarray(output_perturbation(lambda h: np.asarray(h) @ W.T, Y, patched(X)), dtype=float)
        out["per_token"]["kl"] = kl
        out["head"] = head.label
        out["scalars"]["mean_kl"] = float(np.mean(kl))
        if spearman is not None and "relative_error" in out["per_token"]:
            e = out["per_token"]["relative_error"]
            ok = np.isfinite(e) & np.isfinite(kl)
            out["scalars"]["spearman_error_kl"] = float(spearman(e[ok], kl[ok]))
    return out, None


def _guard(what: str, fn: Callable[[], Any], skipped: list[str]) -> Any:
    """Run an optional stage; on any error record one line in ``skipped`` and return None."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - the demo reports and goes on
        skipped.append(f"{what}: failed with {type(exc).__name__}: {' '.join(str(exc).split())}")
        return None


# ------------------------------------------------------------------ plots

_COLORS = {"adamw": "tab:gray", "rownorm": "tab:blue", "rescaled": "tab:green", "exact_lmo": "tab:red",
           "spread": "tab:purple"}
# Rescaled RowNorm often retraces RowNorm: a dash-dot line on top keeps both visible.
_STYLES = {"rescaled": "-."}


def _run_label(r, planned: int) -> str:
    """The run's label, saying where a time-budgeted run stopped early."""
    if r.steps and r.steps[-1] + 1 < planned:
        return f"{r.label} (time budget: stopped at step {r.steps[-1] + 1})"
    return r.label


def _smooth(y: list[float], k: int) -> np.ndarray:
    y = np.asarray(y, dtype=float)
    if k <= 1 or len(y) < k:
        return y
    c = np.cumsum(np.insert(y, 0, 0.0))
    head = c[1:k] / np.arange(1, k)
    return np.concatenate([head, (c[k:] - c[:-k]) / k])


def _plots(out_dir: str, runs: list[_Run], size: DemoSize, lmo: dict | None, geo: dict | None,
           tok: dict | None) -> tuple[dict[str, str], str | None]:
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return {}, "plots: matplotlib is not installed (`pip install matplotlib`); the report has tables only."
    files: dict[str, str] = {}
    eta = 2.0 * size.gamma
    title_sfx = f"(V={size.vocab}, d={size.d}, batch {size.batch})"

    fig, ax = plt.subplots(figsize=(11, 4.8))
    for r in runs:
        c = _COLORS.get(r.name)
        ax.plot(r.steps, _smooth(r.train_loss, max(1, size.steps // 20)), color=c, lw=1.4,
                ls=_STYLES.get(r.name, "-"), label=f"{_run_label(r, size.steps)}: train (moving avg)")
        ax.plot(r.eval_steps, r.eval_loss, color=c, ls="--", marker="o", ms=3, lw=1, label=f"{r.label}: held-out")
    ax.set_xlabel("training step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(f"Next-token loss of the LM head on Python's documentation\n{title_sfx}")
    ax.axhline(math.log(size.vocab), color="k", lw=0.6, ls=":", label=f"uniform, log V = {math.log(size.vocab):.2f}")
    ax.legend(fontsize=7, ncol=1, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "loss.png"), dpi=110)
    plt.close(fig)
    files["loss"] = "loss.png"

    if any(r.D for r in runs):
        fig, axes = plt.subplots(1, 2, figsize=(15, 4.8), gridspec_kw={"width_ratios": [1, 1]})
        ax = axes[0]
        for r in runs:
            if r.D:
                ax.plot(r.diag_steps, r.D, color=_COLORS.get(r.name), lw=1.2, marker=".", ms=4,
                        ls=_STYLES.get(r.name, "-"), label=r.label)
        ax.axhline(eta, color="k", ls=":", lw=1.5, zorder=5, label=f"diameter budget eta = 2 gamma = {eta:g}")
        ax.set_yscale("log")
        ax.set_xlabel("training step t")
        ax.set_ylabel("row diameter D(S_t)  (certified)")
        ax.set_title("Row diameter of each update S_t = W_t - W_{t-1}")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3, which="both")
        ax = axes[1]
        for r in runs:
            if r.rms:
                c = _COLORS.get(r.name)
                ax.plot(r.diag_steps, r.rms, color=c, lw=1.2, marker=".", ms=4, label=f"{r.label}: Hilbert RMS")
                ax.plot(r.diag_steps, r.bound, color=c, lw=1, ls="--", marker="x", ms=3,
                        label=f"{r.label}: bound max||h|| D(S_t)")
        ax.set_yscale("log")
        ax.set_xlabel("training step t")
        ax.set_ylabel("Hilbert distance of output distributions")
        ax.set_title(f"Hilbert RMS of each step over {size.n_panel} held-out states vs its bound")
        ax.legend(fontsize=7, ncol=1, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        ax.grid(alpha=0.3, which="both")
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "step_geometry.png"), dpi=110)
        plt.close(fig)
        files["step_geometry"] = "step_geometry.png"

    if lmo is not None and lmo["steps"]:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
        ax = axes[0]
        gaps = np.maximum(np.asarray(lmo["gap"], dtype=float), 1e-16)
        ax.plot(lmo["steps"], gaps, "o-", color="tab:blue",
                label=f"certificate for G_t ({lmo['rows']} largest rows, {lmo['trajectory'].split(' (')[0]} run)")
        if lmo.get("optimizer_gaps"):
            og = np.asarray(lmo["optimizer_gaps"], dtype=float)
            ax.plot(og[:, 0], np.maximum(og[:, 1], 1e-16), ".-", color="tab:red", ms=4,
                    label="each step of the exact-LMO optimizer (all rows, warm-started)")
        ax.set_yscale("log")
        ax.set_xlabel("training step t")
        ax.set_ylabel("relative gap (upper - lower) / upper")
        ax.set_title("Exact diameter LMO: certified optimality gap along training")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3, which="both")
        ax = axes[1]
        lo_r, hi_r = np.asarray(lmo["ratio_lo"], dtype=float), np.asarray(lmo["ratio_hi"], dtype=float)
        ax.errorbar(lmo["steps"], lo_r, yerr=[np.zeros_like(lo_r), hi_r - lo_r], fmt="o-", color="tab:blue",
                    ms=4, capsize=4, lw=1,
                    label="RowNorm / exact: (1/2) sum ||g_i|| / T(G), certified range (bar)")
        ax.axhline(1 / math.sqrt(2), color="k", ls=":", label="guarantee 1/sqrt(2)")
        ax.axhline(1.0, color="k", ls="-", lw=0.6)
        ax.set_ylim(0.6, 1.02)
        ax.set_xlabel("training step t")
        ax.set_ylabel("decrease of RowNorm / decrease of the exact LMO")
        ax.set_title("How much of the steepest-descent decrease RowNorm gets")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "lmo.png"), dpi=110)
        plt.close(fig)
        files["lmo"] = "lmo.png"

    if geo is not None and geo["methods"]:
        fig, ax = plt.subplots(figsize=(8.5, 5.6))
        names = list(geo["methods"])
        labels = [next(r.label for r in runs if r.name == n).split(" (")[0] for n in names]
        x = np.arange(len(names))
        cols = [_COLORS.get(n, "tab:blue") for n in names]
        floor = 1e-4  # log axis: a zero ratio (identical rows) is drawn at the floor and labelled
        all_rho = [geo["methods"][n]["rho"] for n in names]
        seen_rho = [geo["methods"][n]["rho_seen"] for n in names]
        ax.bar(x - 0.2, [max(v, floor) for v in all_rho], width=0.4, color=cols, alpha=0.45, edgecolor="k",
               label=f"all {geo['V']} rows")
        ax.bar(x + 0.2, [max(v, floor) for v in seen_rho], width=0.4, color=cols, edgecolor="k", hatch="//",
               label="rows of the most frequent training targets")
        for xi, v in zip(x, all_rho):
            ax.text(xi - 0.2, max(v, floor) * 1.15, "0 (equal rows)" if v == 0 else f"{v:.3g}", ha="center",
                    fontsize=7, rotation=90 if v == 0 else 0, va="bottom")
        for xi, v in zip(x, seen_rho):
            ax.text(xi + 0.2, max(v, floor) * 1.15, f"{v:.3g}", ha="center", fontsize=7, va="bottom")
        if "upper_bound" in geo:
            ax.axhline(geo["upper_bound"], color="k", ls="--",
                       label=f"all {geo['V']} rows: upper bound on rho for d = {geo['d']}: {geo['upper_bound']:.3f}")
        ax.axhline(geo["random_sphere_rho"], color="tab:orange", ls=":",
                   label=f"all {geo['V']} rows: random unit rows, same d: {geo['random_sphere_rho']:.3f}")
        if "spread_rho" in geo:
            ax.axhline(geo["spread_rho"], color="tab:purple", ls="-.",
                       label=f"all {geo['V']} rows: max-min solver refgeo.spread: {geo['spread_rho']:.3f}")
        ub_seen = [geo["methods"][n].get("upper_bound_seen") for n in names]
        if ub_seen and ub_seen[0] is not None and len({round(u, 12) for u in ub_seen if u is not None}) == 1:
            ax.axhline(ub_seen[0], color="k", ls=(0, (1, 3)),
                       label=f"{geo['methods'][names[0]]['n_seen']} frequent rows: upper bound {ub_seen[0]:.3f}")
        ax.set_yscale("log")
        ax.set_ylim(floor, 1.5)
        ax.set_xticks(x, labels, rotation=15)
        ax.set_xlabel("optimizer")
        ax.set_ylabel("distance ratio rho = m(W) / D(W)  (log scale)")
        ax.set_title("Geometry of the trained head: closest pair / diameter of its rows")
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=2)
        ax.grid(alpha=0.3, axis="y", which="both")
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "head_geometry.png"), dpi=110)
        plt.close(fig)
        files["head_geometry"] = "head_geometry.png"

    if tok is not None and tok.get("per_token"):
        per = tok["per_token"]
        panels = [k for k in ("relative_error", "angle", "kl") if k in per or (k == "angle" and "angle_rho_tau" in per)]
        fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4.3), squeeze=False)
        for ax, key in zip(axes[0], panels):
            if key == "relative_error":
                v = np.asarray(per["relative_error"], dtype=float)
                v = v[np.isfinite(v)]
                ax.hist(v, bins=40, color="tab:cyan", edgecolor="k", lw=0.3, label=f"{len(v)} tokens")
                ax.axvline(float(np.median(v)), color="k", ls="--", label=f"median {np.median(v):.3g}")
                ax.set_xlabel("relative error ||r_i|| / ||Delta_i||")
                ax.set_ylabel("number of tokens")
                ax.set_title("Residual size of the tokenwise fit", fontsize=10)
            elif key == "angle":
                for name, color, lab in (("angle_delta_tau", "tab:blue", "angle(Delta_i, tau_i)"),
                                         ("angle_rho_tau", "tab:red", "angle(r_i, tau_i)")):
                    if name in per:
                        v = np.asarray(per[name], dtype=float)
                        v = v[np.isfinite(v)]
                        ax.hist(v, bins=36, range=(0, 180), alpha=0.6, color=color, label=lab)
                ax.axvline(60, color="k", ls=":", lw=1, label="60 degrees")
                ax.set_xlabel("angle (degrees)")
                ax.set_ylabel("number of tokens")
                ax.set_title("Alignment: full update, tokenwise part, residual", fontsize=10)
            else:
                e = np.asarray(per["relative_error"], dtype=float)
                kl = np.asarray(per["kl"], dtype=float)
                ok = np.isfinite(e) & np.isfinite(kl) & (e > 0) & (kl > 0)
                sp = tok["scalars"].get("spearman_error_kl")
                lab = f"tokens (Spearman {sp:.2f})" if sp is not None else "tokens"
                ax.scatter(e[ok], kl[ok], s=5, alpha=0.5, color="tab:purple", label=lab)
                ax.set_xscale("log")
                ax.set_yscale("log")
                # the errors span less than a decade: label the 2x and 5x minor ticks too
                ax.xaxis.set_minor_locator(matplotlib.ticker.LogLocator(subs=(2.0, 5.0)))
                ax.xaxis.set_minor_formatter(matplotlib.ticker.LogFormatterSciNotation(labelOnlyBase=False))
                ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
                ax.set_xlabel("relative error ||r_i|| / ||Delta_i||")
                ax.set_ylabel("KL(p_orig || p_patched) (nats)")
                ax.set_title("Output change when h1 is patched by its fit\n(head: " + tok.get("head", "") + ")",
                             fontsize=10)
            ax.legend(fontsize=7)
            ax.grid(alpha=0.3)
        fig.suptitle(f"Tokenwise decomposition of the feature layer h0 -> h1 ({tok['N']} held-out tokens, "
                     f"{tok['cls']} local maps, k = {tok['k']})", fontsize=11)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "tokenwise.png"), dpi=110)
        plt.close(fig)
        files["tokenwise"] = "tokenwise.png"
    return files, None


# ------------------------------------------------------------------ report

def _f(x: float, digits: int = 4) -> str:
    return f"{x:.{digits}g}"


def _write_report(out_dir: str, *, size_name: str, size: DemoSize, seed: int, corpus: _corpus.Corpus,
                  runs: list[_Run], lmo: dict | None, geo: dict | None, tok: dict | None,
                  files: dict[str, str], skipped: list[str], timings: dict[str, float]) -> str:
    import refgeo

    eta = 2.0 * size.gamma
    L: list[str] = []
    L.append("# refgeo demo: LM-head update geometry on Python's own documentation\n")
    L.append(f"refgeo {refgeo.__version__}, Python {platform.python_version()}, NumPy {np.__version__}, "
             f"backend `{refgeo.get_backend()}`; size `{size_name}`, seed {seed}.\n")
    L.append("## Setup\n")
    src = corpus.sources
    L.append(f"- **Corpus** (offline, shipped with Python): {src['pydoc_data.topics']} `pydoc_data.topics` "
             f"entries and {src['stdlib docstrings']} docstrings from {src['stdlib files']} standard-library "
             f"files: {len(corpus.ids)} tokens, {corpus.n_types} distinct; vocabulary V = {len(corpus.vocab)} "
             f"including `<unk>` ({100 * corpus.unk_rate:.2f}% of tokens). Last 10% held out.")
    L.append(f"- **Model**: fixed features of the previous {size.context} tokens, h0 = sum_k E_k[w_(t-k)] "
             f"(random projections of the one-hot context), h1 = h0 + tanh(h0 R), d = {size.d} (last "
             f"coordinate constant 1); only the softmax head W (V x d) is trained, from W = 0.")
    L.append(f"- **Training**: {size.steps} steps, batch {size.batch}, identical batches for every optimizer. "
             f"AdamW lr {size.lr_adamw:g} (weight decay 0.01); RowNorm gamma {size.gamma:g}, momentum "
             f"{_MOMENTUM}; the diameter-budget methods use eta = 2 gamma = {eta:g}, the bound that "
             f"RowNorm guarantees (D(S_t) <= 2 gamma).\n")

    L.append("## 1. Loss curves\n")
    if "loss" in files:
        L.append(f"![Training and held-out cross-entropy per optimizer]({files['loss']})\n")
    L.append("| optimizer | steps run | final train loss (mean of last 10%) | final held-out loss | best held-out loss |")
    L.append("|---|---|---|---|---|")
    for r in runs:
        k = max(1, len(r.train_loss) // 10)
        note = " (stopped by time budget)" if r.stopped_early else ""
        L.append(f"| {r.label} | {r.steps_done}{note} | {_f(float(np.mean(r.train_loss[-k:])))} | "
                 f"{_f(r.eval_loss[-1])} | {_f(min(r.eval_loss))} |")
    L.append(f"\nUniform prediction: log V = {_f(math.log(size.vocab))} nats.\n")

    L.append("## 2. Step geometry: D(S_t) and Hilbert RMS against the bound\n")
    if any(r.D for r in runs):
        if "step_geometry" in files:
            L.append(f"![Row diameter and Hilbert RMS of every update]({files['step_geometry']})\n")
        L.append(f"Every {size.diag_every} steps: the certified row diameter of the actual update S_t and the "
                 f"Hilbert RMS of the step over {size.n_panel} held-out hidden states, against the bound "
                 "max ‖h‖ D(S_t) (SPEC §2: the worst case over the ball is attained, the RMS never exceeds it).\n")
        L.append("| optimizer | median D(S_t) | max D(S_t) / eta | median RMS / bound | max RMS / bound |")
        L.append("|---|---|---|---|---|")
        for r in runs:
            if not r.D:
                continue
            D = np.asarray(r.D)
            if r.rms:
                ratio = np.asarray(r.rms) / np.maximum(np.asarray(r.bound), 1e-300)
                rr = f"{_f(float(np.median(ratio)))} | {_f(float(ratio.max()))}"
            else:
                rr = "not computed | not computed"
            L.append(f"| {r.label} | {_f(float(np.median(D)))} | {_f(float(D.max()) / eta)} | {rr} |")
        L.append("")
    else:
        L.append("Skipped: `refgeo.rows.row_diameter` is not available in this installation.\n")

    L.append("## 3. Diameter LMO: certified gap and RowNorm / exact ratio\n")
    if lmo is not None and lmo["steps"]:
        if "lmo" in files:
            L.append(f"![Certified LMO gap and RowNorm/exact ratio along training]({files['lmo']})\n")
        L.append(f"Minibatch gradients G_t of the {lmo['trajectory']} trajectory, restricted to their "
                 f"{lmo['rows']} rows of largest norm and re-centred; exact LMO solved with eta = 1. "
                 "The min-tension value T(G) is certified between `lower` and `upper` (the solver's bracket "
                 "intersected with the closed-form bounds of `refgeo.tension_bounds`); RowNorm's decrease per "
                 "unit diameter is (1/2) sum ‖g_i‖ (SPEC §3), guaranteed >= T(G)/sqrt(2).\n")
        L.append("| step | T(G) lower | T(G) upper | relative gap | (1/2) sum ‖g_i‖ | RowNorm / exact | LMO seconds |")
        L.append("|---|---|---|---|---|---|---|")
        for i, t in enumerate(lmo["steps"]):
            L.append(f"| {t} | {_f(lmo['lower'][i], 6)} | {_f(lmo['upper'][i], 6)} | {_f(lmo['gap'][i], 3)} | "
                     f"{_f(lmo['half_sum'][i], 6)} | {_f(lmo['ratio_lo'][i])} - {_f(lmo['ratio_hi'][i])} | "
                     f"{_f(lmo['seconds'][i], 3)} |")
        if lmo.get("optimizer_gaps"):
            g = np.asarray(lmo["optimizer_gaps"], dtype=float)[:, 1]
            worst = float(np.max(g))
            verdict = (
                "so each step is certified to keep at least (1 - gap) of the optimal decrease"
                if worst <= 1.0 - 1.0 / math.sqrt(2.0)
                else f"with gaps up to {_f(worst, 3)} its certified share (1 - gap) of the optimal decrease "
                "falls below RowNorm's guaranteed 1/sqrt(2) = 0.707: the time limit per solve was too short "
                "for a certificate at this size (the step itself may still be close to optimal)"
            )
            L.append(f"\nThe {lmo['optimizer_label']} optimizer (all V rows, warm-started, a time limit per solve) "
                     f"certified each of its {len(g)} step{'s' if len(g) != 1 else ''}: gap {_f(float(g[0]), 3)} at its first step, "
                     f"{_f(float(g[-1]), 3)} at its last, median {_f(float(np.median(g)), 3)}; {verdict}.")
        L.append("")
    else:
        L.append("Skipped: " + next((s for s in skipped if s.startswith("LMO")), "no gradients recorded.") + "\n")

    L.append("## 4. Geometry of the final head\n")
    if geo is not None:
        if "head_geometry" in files:
            L.append(f"![Distance ratio of the trained heads against the upper bound]({files['head_geometry']})\n")
        ub = f"{_f(geo['upper_bound'])}" if "upper_bound" in geo else "not available"
        L.append(f"Upper bound on rho = m/D for (V, d) = ({geo['V']}, {geo['d']}): {ub}; random unit rows reach "
                 f"rho = {_f(geo['random_sphere_rho'])}"
                 + (f", the max-min solver `refgeo.spread` {_f(geo['spread_rho'])}" if "spread_rho" in geo else "")
                 + ". Rows of tokens never seen as a training target receive "
                 "identical updates from W = 0 (their gradients coincide), so they stay equal and m(W) = 0 "
                 "over all rows. Tokens seen only after identical contexts are just as indistinguishable. The "
                 "second rho column uses the rows of the most frequent training targets of that run (their "
                 "number and the upper bound for that number of rows in brackets).\n")
        L.append("| optimizer | D(W) | m(W) | rho, all rows | rho, frequent-token rows | covering radius (certified range) "
                 "| Jung bounds D/2 .. J_k D |")
        L.append("|---|---|---|---|---|---|---|")
        for r in runs:
            g = geo["methods"][r.name]
            rad = f"{_f(g['rad_lower'])} - {_f(g['rad'])}" if "rad" in g else "not computed (time budget)"
            jung = f"{_f(g['D'] / 2)} .. {_f(g['jung_upper'])}" if "jung_upper" in g else "not computed"
            ubs = f", bound {_f(g['upper_bound_seen'])}" if "upper_bound_seen" in g else ""
            L.append(f"| {r.label} | {_f(g['D'])} | {_f(g['m'])} | {_f(g['rho'])} | "
                     f"{_f(g['rho_seen'])} ({g['n_seen']} rows{ubs}) | "
                     f"{rad} | {jung} |")
        L.append("")
    else:
        L.append("Skipped: `refgeo.rows` is not available in this installation.\n")

    L.append("## 5. Tokenwise decomposition of the features (h0 -> h1)\n")
    if tok is not None:
        if "tokenwise" in files:
            L.append(f"![Per-token metrics of the tokenwise decomposition]({files['tokenwise']})\n")
        L.append(f"{tok['N']} held-out tokens, d = {tok['d']}: y_i = A(x_i) x_i + r_i with A fitted on the "
                 "nearest neighbours of x_i (SPEC §5).\n")
        L.append("| quantity | value |")
        L.append("|---|---|")
        shown = {
            "energy_fraction": "residual energy fraction sum ‖r‖^2 / sum ‖Delta‖^2",
            "median_relative_error": "median relative error ‖r_i‖ / ‖Delta_i‖",
            "median_angle_delta_tau": "median angle(Delta_i, tau_i), degrees",
            "median_angle_rho_tau": "median angle(r_i, tau_i), degrees",
            "frac_angle_rho_tau_gt_60": "fraction of tokens with angle(r_i, tau_i) > 60 degrees",
            "subspace_energy_delta": "energy of Delta in the top-8 tokenwise subspace",
            "subspace_energy_rho": "energy of r in the top-8 tokenwise subspace",
            "baseline_linear_energy_fraction": "residual energy fraction of one global linear map (in-sample, not leave-one-out)",
            "mean_kl": "mean KL(p_orig ‖ p_patched) when h1 is patched, nats",
            "spearman_error_kl": "Spearman(relative error, KL)",
        }
        for key, text in shown.items():
            if key in tok["scalars"]:
                L.append(f"| {text} | {_f(tok['scalars'][key])} |")
        L.append(f"| local maps | {tok['cls']}, k = {tok['k']} nearest neighbours, leave-one-out |")
        if "head" in tok:
            L.append(f"| head used for the KL | {tok['head']} |")
        L.append("")
    else:
        L.append("Skipped: " + next((s for s in skipped if s.startswith("tokenwise")), "not run.") + "\n")

    L.append("## 6. Timings\n")
    L.append("Wall-clock seconds on this machine (shared machines give pessimistic numbers).\n")
    L.append("| stage | seconds | per step (ms) |")
    L.append("|---|---|---|")
    for r in runs:
        L.append(f"| train {r.label}: updates | {_f(r.update_s, 3)} | {_f(1e3 * r.update_s / max(1, r.steps_done), 3)} |")
        L.append(f"| train {r.label}: diagnostics | {_f(r.diag_s, 3)} | {_f(1e3 * r.diag_s / max(1, r.steps_done), 3)} |")
    for k, v in timings.items():
        L.append(f"| {k} | {_f(v, 3)} | |")
    L.append("")

    if skipped:
        L.append("## Skipped parts\n")
        for s in skipped:
            L.append(f"- {s}")
        L.append("")
    path = os.path.join(out_dir, "report.md")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write("\n".join(L))
    return path


def _results_json(runs: list[_Run], lmo, geo, tok, timings, size_name, size, corpus) -> dict[str, Any]:
    def clean(x):
        if isinstance(x, dict):
            return {str(k): clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        if isinstance(x, np.ndarray):
            return clean(x.tolist())
        if isinstance(x, np.generic):
            return x.item()
        return x

    return clean({
        "size": size_name,
        "config": dataclasses.asdict(size),
        "corpus": {"tokens": len(corpus.ids), "types": corpus.n_types, "vocab": len(corpus.vocab),
                   "unk_rate": corpus.unk_rate, "sources": corpus.sources},
        "runs": {r.name: {"label": r.label, "steps_done": r.steps_done, "stopped_early": r.stopped_early,
                          "train_loss": r.train_loss, "eval_steps": r.eval_steps, "eval_loss": r.eval_loss,
                          "diag_steps": r.diag_steps, "D": r.D, "hilbert_rms": r.rms, "bound": r.bound,
                          "update_s": r.update_s, "diag_s": r.diag_s} for r in runs},
        "lmo": lmo,
        "head_geometry": geo,
        "tokenwise": None if tok is None else {k: v for k, v in tok.items() if k != "per_token"},
        "timings": timings,
    })


# ------------------------------------------------------------------ entry point

def run_demo(out_dir: str, *, size: str = "full", seed: int = 0, progress: bool = True) -> str:
    """Run the demo and write ``report.md``, PNG plots and ``results.json`` into ``out_dir``.

    Parameters
    ----------
    out_dir : str
        Output directory (created if missing).
    size : {"full", "quick", "tiny"}, default="full"
        ``full`` (about 1-3 minutes on 2 cores), ``quick`` (about 15-30 s), ``tiny`` (tests).
    seed : int, default=0
        Seed of the features, batches and the random reference configuration.
    progress : bool, default=True
        Show a progress bar on stderr.

    Returns
    -------
    path : str
        Path of ``report.md``.
    """
    if size not in SIZES:
        raise ValueError(f"size must be one of {tuple(SIZES)}, got {size!r} instead.")
    cfg = SIZES[size]
    t_all = time.perf_counter()
    os.makedirs(out_dir, exist_ok=True)
    timings: dict[str, float] = {}

    t0 = time.perf_counter()
    corpus = _corpus.build_corpus(vocab_size=cfg.vocab, max_files=cfg.max_files)
    timings["corpus (read + tokenise)"] = time.perf_counter() - t0
    cfg = dataclasses.replace(cfg, vocab=len(corpus.vocab))

    rng = np.random.default_rng(seed)
    ids = np.asarray(corpus.ids, dtype=np.int64)
    n = len(ids)
    split = int(0.9 * n)
    c = cfg.context
    feats = _Features(cfg.vocab, cfg.d, c, rng)
    held = rng.permutation(np.arange(split + c, n))
    eval_pos, panel_pos, tok_pos = held[: cfg.n_eval], held[cfg.n_eval : cfg.n_eval + cfg.n_panel], \
        held[cfg.n_eval + cfg.n_panel : cfg.n_eval + cfg.n_panel + cfg.n_tokenwise]
    _, H_eval = feats(ids, eval_pos)
    y_eval = ids[eval_pos]
    _, H_panel = feats(ids, panel_pos)
    batches = rng.integers(c, split, size=(cfg.steps, cfg.batch))

    methods, skipped = _make_methods(cfg)
    if _lib("rows", "row_diameter") is None:
        skipped.append("per-step D(S_t) and Hilbert RMS: `refgeo.rows` is not available in this installation.")
    bar = _Progress(cfg.steps * len(methods), progress)
    runs: list[_Run] = []
    lmo_source = "rownorm" if any(m[0] == "rownorm" for m in methods) else "adamw"
    try:
        for name, label, factory in methods:
            runs.append(_train(name, label, factory, size=cfg, batches=batches, feats=feats, ids=ids,
                               H_eval=H_eval, y_eval=y_eval, H_panel=H_panel, progress=bar,
                               keep_grads=(name == lmo_source)))
            if runs[-1].stopped_early:
                skipped.append(f"{label}: stopped after {runs[-1].steps_done} of {cfg.steps} steps "
                               f"(time budget of {cfg.lmo_budget_s if name in ('exact_lmo', 'spread') else cfg.budget_s:g} s "
                               "of updates for this optimizer).")
    finally:
        bar.close()

    for r in runs:
        if r.error and r.steps_done == 0:
            skipped.append(f"{r.label}: failed at its first step ({r.error}); left out.")
        elif r.error:
            skipped.append(f"{r.label}: failed after {r.steps_done} steps ({r.error}); its curves stop there.")
    runs = [r for r in runs if r.steps_done > 0]

    t0 = time.perf_counter()
    lmo = None
    src = next((r for r in runs if r.name == lmo_source), None)
    if src is not None:
        res = _guard("LMO certificates", lambda: _lmo_track(src, cfg), skipped)
        if res is not None:
            lmo, why = res
            if why:
                skipped.append(why)
    exact = next((r for r in runs if r.name == "exact_lmo"), None)
    if lmo is not None and exact is not None and exact.gaps:
        lmo["optimizer_label"] = exact.label
        lmo["optimizer_gaps"] = [[t, g] for t, g in exact.gaps]
    timings["LMO certificates"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    geo = None
    res = _guard("final-head geometry", lambda: _head_geometry(runs, cfg, ids[batches], rng), skipped)
    if res is not None:
        geo, notes = res
        skipped.extend(notes)
    timings["final-head geometry"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    tok = None
    head = next((r for r in runs if r.name == "rownorm"), runs[0] if runs else None)
    res = _guard("tokenwise decomposition", lambda: _tokenwise(feats, ids, tok_pos, head), skipped)
    if res is not None:
        tok, why = res
        if why:
            skipped.append(why)
    timings["tokenwise decomposition"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    files: dict[str, str] = {}
    res = _guard("plots", lambda: _plots(out_dir, runs, cfg, lmo, geo, tok), skipped)
    if res is not None:
        files, why = res
        if why:
            skipped.append(why)
    timings["plots"] = time.perf_counter() - t0
    timings["total"] = time.perf_counter() - t_all

    path = _write_report(out_dir, size_name=size, size=cfg, seed=seed, corpus=corpus, runs=runs, lmo=lmo,
                         geo=geo, tok=tok, files=files, skipped=skipped, timings=timings)
    with open(os.path.join(out_dir, "results.json"), "w", encoding="utf-8") as fh:
        json.dump(_results_json(runs, lmo, geo, tok, timings, size, cfg, corpus), fh, indent=1)
    return path
