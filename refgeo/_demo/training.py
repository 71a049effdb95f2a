"""Training the demo's head: sizes and budgets, the optimizers, the training loop.

Every optimizer trains the softmax head from ``W = 0`` on the same mini-batches:
AdamW (written here), RowNorm (:class:`refgeo.RowNorm`), rescaled RowNorm
(:func:`refgeo.rescaled_rownorm` on the momentum), the warm-started exact diameter LMO
(:class:`refgeo.DiameterLMO`) and the spreading update (:func:`refgeo.spread_update` on
the momentum).  Along training, the loop records the certified row diameter ``D(S_t)``
of each update and its Hilbert RMS on a panel of held-out hidden states.

Examples
--------
>>> sorted(SIZES)
['full', 'quick', 'tiny']
>>> SIZES["full"].vocab
3000
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from typing import Any, Callable

import numpy as np

from refgeo import DiameterLMO, RowNorm, hilbert_rms, rescaled_rownorm, row_diameter, spread_update

from .model import loss, loss_grad

__all__ = ["MOMENTUM", "SIZES", "AdamW", "DemoSize", "LibraryOptimizer", "MomentumRule", "Progress", "Run",
           "make_methods", "train"]


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
        norm (re-centered), so that the solver can close its gap within ``lmo_solve_s``.
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
                     budget_s=20.0, lmo_budget_s=30.0, lmo_step_s=2.0, spread_max_vocab=600, lmo_rows=300,
                     lmo_solve_s=1.5, diag_budget_s=4.0, stage_budget_s=12.0, lr_adamw=0.04, gamma=0.025),
    "quick": DemoSize(vocab=2000, d=32, context=3, batch=128, steps=120, diag_every=4, eval_every=20,
                      lmo_every=40, n_eval=1024, n_panel=256, n_tokenwise=600, max_files=40,
                      budget_s=2.0, lmo_budget_s=3.0, lmo_step_s=0.3, spread_max_vocab=600, lmo_rows=150,
                      lmo_solve_s=0.5, diag_budget_s=1.0, stage_budget_s=2.0, lr_adamw=0.04, gamma=0.025),
    "tiny": DemoSize(top_rows=64, vocab=300, d=16, context=2, batch=64, steps=24, diag_every=3, eval_every=8,
                     lmo_every=12, n_eval=256, n_panel=64, n_tokenwise=200, max_files=6,
                     budget_s=0.5, lmo_budget_s=0.5, lmo_step_s=0.05, spread_max_vocab=600, lmo_rows=60,
                     lmo_solve_s=0.2, diag_budget_s=0.3, stage_budget_s=0.5, lr_adamw=0.04, gamma=0.025),
}

MOMENTUM = 0.95  # of RowNorm and of the momentum fed to the other library directions
_EPS = 1e-8


class Progress:
    """tqdm when importable, else a throttled counter on stderr; silent when not ``enabled``."""

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


# ------------------------------------------------------------------ optimizers

class AdamW:
    """AdamW (decoupled weight decay), a few lines of NumPy."""

    def __init__(self, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01) -> None:
        self.lr, self.b1, self.b2, self.eps, self.wd = lr, betas[0], betas[1], eps, weight_decay
        self.m: np.ndarray | None = None
        self.v: np.ndarray | None = None

    def update(self, W: np.ndarray, G: np.ndarray, t: int) -> np.ndarray:
        """The step ``S_t`` for the head ``W`` and the gradient ``G`` at step ``t >= 1``."""
        if self.m is None or self.v is None:  # the first step sets both moments
            self.m, self.v = np.zeros_like(W), np.zeros_like(W)
        self.m = self.b1 * self.m + (1 - self.b1) * G
        self.v = self.b2 * self.v + (1 - self.b2) * G * G
        mhat = self.m / (1 - self.b1**t)
        vhat = self.v / (1 - self.b2**t)
        return -self.lr * (mhat / (np.sqrt(vhat) + self.eps) + self.wd * W)


class LibraryOptimizer:
    """A refgeo optimizer (``step(param, grad)`` updates ``param`` and returns it).

    With ``certified``, the optimizer is a :class:`refgeo.DiameterLMO` and the certified
    gap of each step's solve is recorded in ``gaps``.
    """

    def __init__(self, opt: Any, *, certified: bool = False) -> None:
        self.opt, self.certified = opt, certified
        self.gaps: list[tuple[int, float]] = []

    def update(self, W: np.ndarray, G: np.ndarray, t: int) -> np.ndarray:
        """The step ``S_t`` for the head ``W`` and the gradient ``G`` at step ``t >= 1``."""
        P = self.opt.step(W.copy(), G)
        if self.certified:
            self.gaps.append((t, float(self.opt.last_result.gap)))
        return P - W


class MomentumRule:
    """Bias-corrected momentum B_t (as RowNorm) fed to a library direction ``fn(B, eta)``."""

    def __init__(self, fn: Callable[[np.ndarray, float], np.ndarray], eta: float) -> None:
        self.fn, self.eta = fn, eta
        self.B: np.ndarray | None = None
        self.gaps: list[tuple[int, float]] = []

    def update(self, W: np.ndarray, G: np.ndarray, t: int) -> np.ndarray:
        """The step ``S_t = fn(B_t / (1 - mu^t), eta)`` at step ``t >= 1``."""
        self.B = (1 - MOMENTUM) * G if self.B is None else MOMENTUM * self.B + (1 - MOMENTUM) * G
        Bhat = self.B / (1 - MOMENTUM**t)
        return np.asarray(self.fn(Bhat, self.eta), dtype=np.float64)


def make_methods(size: DemoSize) -> tuple[list[tuple[str, str, Callable[[], Any]]], list[str]]:
    """(name, label, factory) of the optimizers trained at this size, and why others are not."""
    eta = 2.0 * size.gamma
    methods: list[tuple[str, str, Callable[[], Any]]] = [
        ("adamw", f"AdamW (lr {size.lr_adamw:g})", lambda: AdamW(size.lr_adamw)),
        ("rownorm", f"RowNorm (gamma {size.gamma:g})",
         lambda: LibraryOptimizer(RowNorm(lr=size.gamma, mu=MOMENTUM, eps=_EPS))),
        ("rescaled", f"rescaled RowNorm (eta {eta:g})",
         lambda: MomentumRule(lambda B, e: rescaled_rownorm(B, eta=e), eta)),
        ("exact_lmo", f"exact diameter LMO (eta {eta:g})",
         lambda: LibraryOptimizer(DiameterLMO(lr=eta, momentum=MOMENTUM, rtol=1e-2, max_time=size.lmo_step_s),
                                  certified=True)),
    ]
    skipped: list[str] = []
    if size.vocab > size.spread_max_vocab:
        skipped.append(f"spreading update: not trained at V = {size.vocab} (each step solves an exact LMO "
                       f"and a max-min problem over all V rows, minutes per step at this size; the demo trains "
                       f"it for V <= {size.spread_max_vocab}, e.g. its internal `tiny` size). Section 4 shows "
                       "what the max-min solver `refgeo.spread` reaches for this (V, d).")
    else:
        def spread_step(B: np.ndarray, e: float) -> np.ndarray:
            return spread_update(B, eta=e, n_points=3, lmo_rtol=0.5, max_time=size.lmo_step_s, seed=0).update

        methods.append(("spread", f"spreading update (eta {eta:g})", lambda: MomentumRule(spread_step, eta)))
    return methods, skipped


# ------------------------------------------------------------------ training

@dataclasses.dataclass
class Run:
    """The record of one optimizer's training run (curves, timings, final head)."""

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


def train(name, label, factory, *, size, batches, feats, ids, H_eval, y_eval, H_panel,
          progress, keep_grads) -> Run:
    """Train one head from W = 0 with the optimizer ``factory()``; return its :class:`Run`.

    ``batches[t - 1]`` holds the target positions of step ``t`` in ``ids``, ``feats``
    maps them to hidden states; the held-out loss uses ``(H_eval, y_eval)`` and the
    Hilbert RMS the panel ``H_panel``.  The methods that solve an O(V^2 d) problem per
    step stop early past their budget of seconds of updates (``size.budget_s`` or
    ``size.lmo_budget_s``); an optimizer that raises ends its run with ``error`` set.

    Diagnostics run at step 1 and every ``every`` steps, ``every`` (at least
    ``size.diag_every``) respaced after each so that the measured time per diagnostic
    fits ``size.diag_budget_s`` per optimizer (a slow diameter backend stays cheap; the
    steps diagnosed depend on the machine's speed and are recorded in ``diag_steps``).
    """
    hmax = float(np.linalg.norm(H_panel, axis=1).max())
    run = Run(name, label)
    W = np.zeros((size.vocab, size.d))
    rule = factory()
    progress.describe(name)
    run.eval_steps.append(0)
    run.eval_loss.append(loss(W, H_eval, y_eval))
    every = size.diag_every
    # cheap O(B V d) steps always run to the end; the O(V^2 d)-per-step methods have budgets
    budget = {"rescaled": size.budget_s, "exact_lmo": size.lmo_budget_s, "spread": size.lmo_budget_s}.get(name, math.inf)
    for t in range(1, size.steps + 1):
        t0 = time.perf_counter()
        pos = batches[t - 1]
        _, H = feats(ids, pos)
        value, G = loss_grad(W, H, ids[pos])
        try:
            S = rule.update(W, G, t)
        except Exception as exc:  # noqa: BLE001 - a failing optimizer must not stop the demo
            run.error = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
            progress.update(size.steps - t + 1)
            break
        W = W + S
        run.update_s += time.perf_counter() - t0
        run.steps.append(t)
        run.train_loss.append(value)
        if keep_grads and (t % size.lmo_every == 0 or t == 1):
            run.grads[t] = G
        t0 = time.perf_counter()
        if t % every == 0 or t == 1:
            D = float(row_diameter(S).value)
            run.diag_steps.append(t)
            run.D.append(D)
            run.bound.append(hmax * D)
            run.rms.append(float(hilbert_rms(S, H_panel)))
        if t % size.eval_every == 0 or t == size.steps:
            run.eval_steps.append(t)
            run.eval_loss.append(loss(W, H_eval, y_eval))
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
        run.eval_loss.append(loss(W, H_eval, y_eval))
    run.W = W
    run.gaps = list(rule.gaps) if isinstance(rule, LibraryOptimizer) else []
    return run

