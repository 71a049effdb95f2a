r"""Framework-free optimizers for the LM-head weight on NumPy arrays (see :doc:`/theory/lmo`).

Each optimizer keeps its state in plain NumPy arrays, updates ``param`` in place in
``step(param, grad)`` (a NumPy array or a torch tensor; the gradient may be any array
or tensor, viewed as NumPy without a copy where it can be), and round-trips through ``state_dict()`` /
``load_state_dict()``.  Both guarantee a row diameter of the step (without weight
decay) within a stated budget: ``2 * lr`` for :class:`RowNorm`, ``lr`` for
:class:`DiameterLMO`.

.. autosummary::

   RowNorm
   DiameterLMO
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
from array_api_compat import is_jax_array, is_torch_array

from ._interop import Origin, from_foreign, input_eps, mark_modified, to_caller
from ._validate import (
    as_float_array,
    check_bool,
    check_centered_rows,
    check_decay,
    check_int,
    check_min_rows,
    check_no_repeated_entries,
    check_open_unit_interval,
    check_real,
    check_same_shape,
    check_step_size,
)
from .lmo import (
    LMOResult,
    _centered_rtol,
    _centered_unchecked,
    _check_eta,
    _pow2_exponent,
    diameter_lmo,
    row_normalize,
)

__all__ = ["DiameterLMO", "RowNorm"]


class _Param:
    """The parameter as a writeable NumPy array, and how to return it to the caller.

    A float32/float64 CPU tensor is updated in place through its zero-copy NumPy view;
    any other tensor (bfloat16, float16, CUDA) is updated on a float32/float64 host
    copy that :meth:`done` writes back into the tensor.
    """

    def __init__(self, param: Any, grad: Any):
        if is_jax_array(param):
            raise TypeError(
                "param must be a float32 or float64 numpy.ndarray or torch tensor (updated in "
                "place), got a JAX array instead, which cannot be updated in place; pass "
                "np.array(param) and convert the result back."
            )
        self.tensor = param if is_torch_array(param) else None
        origin: Origin | None = None
        if self.tensor is not None:
            param, origin = from_foreign(param, "param", host=True)
        elif not isinstance(param, np.ndarray) or param.dtype not in (np.float32, np.float64):
            raise TypeError(
                "param must be a float32 or float64 numpy.ndarray or torch tensor (updated in place), got "
                f"{type(param).__name__}{'' if not hasattr(param, 'dtype') else ' of dtype ' + str(param.dtype)} instead."
            )
        if param.ndim != 2:
            raise ValueError(f"param must be a 2-D array of shape (V, d), got shape {param.shape} instead.")
        if param.size == 0:
            raise ValueError(f"param must be non-empty, got shape {param.shape} instead.")
        if not param.flags.writeable:
            raise ValueError("param must be a writeable array (it is updated in place), got a read-only array instead.")
        check_no_repeated_entries(param.strides, param.shape, param.itemsize, "param")
        # only a view shares the tensor's memory; upcast or device copies are written back,
        # and so is any other copy (a tensor with torch's negative bit, z.conj().imag, is
        # resolved into one: its update was lost, without an error)
        self.copied = origin is not None and self.tensor is not None and (
            origin.converted_from is not None or getattr(origin.device, "type", "cpu") != "cpu"
            or param.ctypes.data != self.tensor.data_ptr()
        )
        grad, self.grad_origin = from_foreign(grad, "grad", host=True)
        # the precision the caller's gradient had (its rows sum to zero only to that)
        self.grad_eps = input_eps(grad, self.grad_origin)
        grad = as_float_array(grad, "grad", ndim=2, shape_hint="2-D array of shape (V, d)")
        check_same_shape(param, grad, ("param", "grad"))
        self.array = param
        self.grad = np.asarray(grad, dtype=np.float64)
        # the largest value the caller's parameter holds (a float16 tensor updated on a
        # float32 copy keeps float16's range), and its dtype's name
        if self.tensor is not None:
            import torch  # loaded: the parameter is a tensor

            self.top = float(torch.finfo(self.tensor.dtype).max)
            self.dtype_name = str(self.tensor.dtype).replace("torch.", "")
        else:
            self.top, self.dtype_name = float(np.finfo(param.dtype).max), str(param.dtype)

    def done(self) -> Any:
        """The updated parameter: the caller's tensor itself (updated in place), or the
        NumPy array, as a tensor sharing its memory when the gradient was a tensor."""
        if self.tensor is None:
            return to_caller(self.array, self.grad_origin)
        if self.copied:  # detach() shares the version counter: autograd sees the copy
            self.tensor.detach().copy_(to_caller(self.array, Origin("torch", self.tensor.device)))
        else:
            mark_modified(self.tensor)  # written through its NumPy view
        return self.tensor


def _check_unit_interval(value, name):
    value = check_real(value, name, min_value=0.0)
    if not value < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value} instead.")
    return value


def _check_step_count(t):
    return check_int(t, "state['t']", min_value=0)


def _bias_correction(mu: float, t: int) -> float:
    """Adam's bias correction 1 - mu**t of an average after t steps, with the count capped
    at 2**63, where mu**t is 0 for every mu < 1 (exp(-1024) for mu = 1 - 2**-53): a
    restored count beyond float64's range (10**400) raised OverflowError in mu**t."""
    return 1.0 - mu ** min(t, 2**63)


def _check_state(state: Any, keys: tuple[str, ...]) -> None:
    """A ``state_dict()``: a mapping with every key (checked before anything is restored)."""
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a dict from state_dict(), got {type(state).__name__} instead.")
    missing = [k for k in keys if k not in state]
    if missing:
        raise ValueError(f"state must have the keys of state_dict(), got one without {missing} instead.")


def _check_buffer(buf):
    """A restored momentum buffer: None or a finite 2-D float array."""
    if buf is None:
        return None
    buf = as_float_array(buf, "state['buffer']", ndim=2, shape_hint="2-D array of shape (V, d)")
    return np.array(buf, dtype=np.float64)


class RowNorm:
    r"""RowNorm optimizer for the LM head (see :doc:`/theory/lmo`), as trained in the source.

    Parameters
    ----------
    lr : float
        Step size :math:`\gamma > 0` (may be changed between steps through ``opt.lr``).
        The step's entries reach ``lr`` (``2 lr`` with ``project``): a step that the
        parameter's dtype cannot hold (``lr`` above 3.4e38 for float32, 65504 for a
        float16 tensor) is a ``ValueError`` at ``step``, before anything changes.
    mu : float, default=0.95
        Momentum :math:`\mu \in [0, 1)` of the gradient average.
    eps : float, default=1e-8
        Added to every row norm, ``>= 0``.
    bias_correction : bool, default=True
        Divide the average by :math:`1 - \mu^t`.
    project : bool, default=False
        Apply the outer centering P to the step (changes no probability: it shifts all
        rows by one vector).
    weight_decay : float, default=0.0
        Decoupled weight decay :math:`\lambda \ge 0`: ``param *= 1 - lr * weight_decay``
        before the step is added; ``lr * weight_decay <= 2`` (a larger product makes the
        parameters grow without bound: ``ValueError``).
    center : bool, default=True
        Center each incoming gradient (:math:`PG`).  A no-op for cross-entropy
        gradients (:math:`\mathbf{1}^\top G = 0`); it makes the step invariant under
        a common row shift of the gradients.

    Notes
    -----
    .. math::

        B_t = \mu B_{t-1} + (1 - \mu) G_t, \qquad \hat B_t = B_t / (1 - \mu^t), \qquad
        S_t = -\gamma_t\, [P]\, \mathrm{RN}_\varepsilon(\hat B_t),

    :math:`\mathrm{RN}_\varepsilon(B)_i = b_i / (\lVert b_i \rVert + \varepsilon)`.  Every row
    of :math:`\mathrm{RN}_\varepsilon` has norm below 1, so :math:`D(S_t) \le 2\gamma_t`
    (the optional P shifts all rows alike and keeps D).  Bias correction only acts
    through :math:`\varepsilon`: it equals using :math:`\varepsilon (1 - \mu^t)` on the
    uncorrected :math:`B_t`; with ``eps = 0`` it changes nothing.  Time and memory O(Vd)
    per step.  The step is equivariant under row permutations and right-orthogonal
    transforms of the gradients and (with ``eps = 0``) invariant under their positive
    scaling.

    References
    ----------
    .. [1] LM-head update geometry, arXiv:2608.22253 (v2).

    Examples
    --------
    >>> import numpy as np, refgeo
    >>> W = np.zeros((2, 2))
    >>> opt = refgeo.RowNorm(lr=0.1, eps=0.0)
    >>> opt.step(W, np.array([[3.0, 4.0], [-3.0, -4.0]])).round(12).tolist()
    [[-0.06, -0.08], [0.06, 0.08]]
    """

    def __init__(
        self,
        *,
        lr: float,
        mu: float = 0.95,
        eps: float = 1e-8,
        bias_correction: bool = True,
        project: bool = False,
        weight_decay: float = 0.0,
        center: bool = True,
    ):
        self.lr, self.mu, self.eps = lr, mu, eps
        self.bias_correction, self.project = bias_correction, project
        self.weight_decay, self.center = weight_decay, center
        (self.lr, self.mu, self.eps, self.bias_correction, self.project, self.weight_decay,
         self.center) = self._checked_hyperparameters()
        self.t = 0
        self.buffer: np.ndarray | None = None
        self._last: np.ndarray | None = None

    def _checked_hyperparameters(self):
        """Validated hyper-parameters; run at construction and at every step, since any
        of them may be changed between steps through the attributes."""
        out = (
            check_real(self.lr, "lr", min_value=0.0, strict=True),
            _check_unit_interval(self.mu, "mu"),
            check_real(self.eps, "eps", min_value=0.0),
            check_bool(self.bias_correction, "bias_correction"),
            check_bool(self.project, "project"),
            check_real(self.weight_decay, "weight_decay", min_value=0.0),
            check_bool(self.center, "center"),
        )
        check_decay(out[0], out[5])
        return out

    def step(self, param: Any, grad: Any, /) -> Any:
        """Update ``param`` (V, d) in place with the gradient ``grad`` (V, d); return it.

        Nothing (parameter, step count, momentum buffer) changes when it raises, e.g.
        a ``ValueError`` for a gradient whose centered momentum average leaves the
        float64 range.  ``param`` is a NumPy array or a torch tensor, ``grad`` any
        array or tensor; the state stays NumPy.  A tensor ``param`` is returned itself;
        a NumPy ``param`` comes back as a tensor sharing its memory when ``grad`` is a
        tensor.
        """
        p = _Param(param, grad)
        param, g = p.array, p.grad
        lr, mu, eps, bias_correction, project, weight_decay, center = self._checked_hyperparameters()
        check_step_size(lr, project, p.top, f"param of dtype {p.dtype_name}")
        if self.buffer is not None and self.buffer.shape != g.shape:
            raise ValueError(
                f"grad must keep the shape of the optimizer state {self.buffer.shape}, got "
                f"shape {g.shape} instead."
            )
        if center:
            # the mean of rows near 1e308 without overflowing the column sums (a plain
            # mean gave inf, then NaN in the buffer)
            with np.errstate(over="ignore"):  # an overflow is reported below, by name
                g = _centered_unchecked(np, g)
        # the new state is built aside and kept only once it is finite: a gradient
        # whose centered rows or average leave the float64 range changes nothing
        t = self.t + 1
        buffer = (1.0 - mu) * g if self.buffer is None else mu * self.buffer + (1.0 - mu) * g
        with np.errstate(over="ignore", invalid="ignore"):
            Bhat = buffer / _bias_correction(mu, t) if bias_correction else buffer
        if not (np.all(np.isfinite(g)) and np.all(np.isfinite(Bhat))):
            raise ValueError(
                "grad must have a centered momentum average inside the float64 range "
                f"(max {float(np.finfo(np.float64).max)!r}), got one that overflows instead; scale "
                "grad down (with eps = 0 the step does not depend on its scale)."
            )
        self.t, self.buffer = t, buffer
        S = -lr * row_normalize(Bhat, eps=eps)
        if project:
            S -= S.mean(axis=0, keepdims=True)
        self._last = S
        if weight_decay:
            param *= 1.0 - lr * weight_decay
        param += S.astype(param.dtype, copy=False)
        return p.done()

    def last_step(self) -> np.ndarray | None:
        """The signed, learning-rate-scaled step of the last call (weight decay excluded),
        float64 of shape (V, d); None before the first step."""
        return None if self._last is None else self._last.copy()

    def state_dict(self) -> dict:
        """Hyper-parameters, the step count and a copy of the momentum buffer."""
        return {
            "lr": self.lr,
            "mu": self.mu,
            "eps": self.eps,
            "bias_correction": self.bias_correction,
            "project": self.project,
            "weight_decay": self.weight_decay,
            "center": self.center,
            "t": self.t,
            "buffer": None if self.buffer is None else self.buffer.copy(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a ``state_dict()``; nothing changes when it raises."""
        _check_state(state, ("lr", "mu", "eps", "bias_correction", "project", "weight_decay", "center", "t", "buffer"))
        fresh = RowNorm(
            lr=state["lr"],
            mu=state["mu"],
            eps=state["eps"],
            bias_correction=state["bias_correction"],
            project=state["project"],
            weight_decay=state["weight_decay"],
            center=state["center"],
        )
        fresh.t = _check_step_count(state["t"])
        fresh.buffer = _check_buffer(state["buffer"])
        self.__dict__.update(fresh.__dict__)  # only once everything is checked


class DiameterLMO:
    r"""Steepest descent under the row diameter with the exact, warm-started LMO.

    Parameters
    ----------
    lr : float
        Diameter budget :math:`\eta` of every step (through ``opt.lr``): a normal float64
        number, at least 2.2250738585072014e-308.
    momentum : float, default=0.0
        :math:`\mu \in [0, 1)`; the LMO is applied to
        :math:`M_t = \mu M_{t-1} + (1 - \mu) G_t` (plain gradients when 0).
    rtol : float, default=1e-3
        Certified relative gap of each LMO solve (see :func:`refgeo.diameter_lmo`).
    max_time : float, default=None
        Time limit per solve in seconds, ``>= 0`` (the best certified step so far is
        used; once the limit has passed, the projected RowNorm step: see
        :func:`refgeo.diameter_lmo`).
    weight_decay : float, default=0.0
        Decoupled weight decay: ``param *= 1 - lr * weight_decay`` before the step;
        ``lr * weight_decay <= 2``.

    Notes
    -----
    .. math:: S_t = \arg\min \{ \langle M_t, S \rangle : D(S) \le \eta,\
              \mathbf{1}^\top S = 0 \}

    computed by :func:`refgeo.diameter_lmo` (given the previous solve as a warm start,
    which its ADMM uses), so
    :math:`D(S_t) \le \eta` is certified and the decrease
    :math:`-\langle M_t, S_t \rangle` is within ``rtol`` of the optimum
    :math:`\eta T(M_t)`, which is at least RowNorm's and at most :math:`\sqrt{2k/(k+1)}`
    times it (k = rank of :math:`M_t`).
    Gradients are centered before use (a no-op for cross-entropy gradients; rows that
    do not sum to about zero raise ``ValueError``).  Time per step: one LMO solve
    (see :func:`refgeo.diameter_lmo`).

    References
    ----------
    .. [1] LM-head update geometry, arXiv:2608.22253 (v2).

    Examples
    --------
    >>> import numpy as np, refgeo
    >>> W = np.zeros((2, 2))
    >>> opt = refgeo.DiameterLMO(lr=0.5)
    >>> opt.step(W, np.array([[3.0, 4.0], [-3.0, -4.0]])).round(6).tolist()
    [[-0.15, -0.2], [0.15, 0.2]]
    """

    def __init__(
        self,
        *,
        lr: float,
        momentum: float = 0.0,
        rtol: float = 1e-3,
        max_time: float | None = None,
        weight_decay: float = 0.0,
    ):
        self.lr, self.momentum, self.rtol = lr, momentum, rtol
        self.max_time, self.weight_decay = max_time, weight_decay
        self.lr, self.momentum, self.rtol, self.max_time, self.weight_decay = self._checked_hyperparameters()
        self.t = 0
        self.buffer: np.ndarray | None = None
        self.last_result: LMOResult | None = None

    def _checked_hyperparameters(self):
        """Validated (lr, momentum, rtol, max_time, weight_decay); run at construction
        and at every step (the attributes may be changed between steps)."""
        out = (
            # the step's diameter budget: a subnormal lr was accepted here and refused by
            # the solve at the first step, as "eta", in an error about the gradient
            _check_eta(self.lr, "lr"),
            _check_unit_interval(self.momentum, "momentum"),
            check_open_unit_interval(self.rtol, "rtol"),
            None if self.max_time is None else check_real(self.max_time, "max_time", min_value=0.0),
            check_real(self.weight_decay, "weight_decay", min_value=0.0),
        )
        check_decay(out[0], out[4])
        return out

    def step(self, param: Any, grad: Any, /) -> Any:
        """Update ``param`` (V, d) in place with the gradient ``grad`` (V, d); return it.

        Nothing (parameter, momentum buffer, warm start) changes when it raises.
        ``param`` is a NumPy array or a torch tensor, ``grad`` any array or tensor; the
        state stays NumPy.  A tensor ``param`` is returned itself; a NumPy ``param``
        comes back as a tensor sharing its memory when ``grad`` is a tensor.
        """
        p = _Param(param, grad)
        # the step's entries reach lr (its rows lie within lr of their mean): beyond the
        # dtype's top it wrote inf into the weights (float16 at lr=2e5)
        check_step_size(self._checked_hyperparameters()[0], False, p.top, f"param of dtype {p.dtype_name}")
        res, M = self._solve(p.grad, p.grad_eps)
        self._commit(p.array, res, M)
        return p.done()

    def _solve(self, g: np.ndarray, grad_eps: float) -> tuple[Any, np.ndarray | None]:
        """The LMO result for the float64 gradient ``g`` (rows centered to ``grad_eps``)
        and the new momentum buffer (None without momentum).  Changes nothing, so that
        ``refgeo.torch.DiameterLMO`` solves every group before it steps any."""
        lr, momentum, rtol, max_time, _ = self._checked_hyperparameters()
        M = self._checked_average(g, grad_eps, momentum)
        warm = self.last_result
        if warm is not None and tuple(warm.update.shape) != M.shape:
            warm = None
        res = diameter_lmo(M, eta=lr, rtol=rtol, max_time=max_time, warm_start=warm)
        return res, (M if momentum > 0.0 else None)

    def _checked_average(self, g: np.ndarray, grad_eps: float, momentum: float) -> np.ndarray:
        """The centered momentum average of ``g``, which the solver takes, after the
        solver's own checks of ``g`` under this optimizer's name for it; changes
        nothing (``refgeo.torch.DiameterLMO`` checks every group with it before solving
        any).

        Each gradient is checked on its own, and the average (the new buffer) is
        centered: checked after averaging, the remainders of gradients each centered
        within the tolerance added up while their centered parts cancelled, and a run
        of accepted gradients was refused at the third step; and an average that
        cancels to rounding noise is centered to that noise's own size, which the
        solver takes.  Centering changes no step (``1^T S = 0``).
        """
        check_min_rows(g, "grad", 2)
        # the solver's own check, on g rescaled by a power of two (no sum overflows);
        # a gradient of half precision (bfloat16) is centered only to its own rounding
        e = _pow2_exponent(g)
        check_centered_rows(np.ldexp(g, -e), "grad", _centered_rtol(grad_eps), e)
        with np.errstate(over="ignore"):  # reported below, by name
            M = _centered_unchecked(np, self._averaged(g, momentum))
        if not bool(np.all(np.isfinite(M))):
            raise ValueError(
                "grad must have a centered momentum average inside the float64 range "
                f"(max {float(np.finfo(np.float64).max)!r}), got one that overflows instead; scale "
                "grad down (the step does not depend on its scale)."
            )
        return M

    def _commit(self, param: np.ndarray, res: Any, M: np.ndarray | None) -> None:
        """Apply a result of :meth:`_solve` to ``param`` (NumPy, in place) and the state."""
        if M is not None:
            self.buffer = M
        self.t += 1
        self.last_result = res
        if self.weight_decay:
            param *= 1.0 - res.eta * self.weight_decay
        param += np.asarray(res.update).astype(param.dtype, copy=False)

    def _averaged(self, g: np.ndarray, momentum: float) -> np.ndarray:
        """The matrix the LMO solves for the float64 gradient ``g``: its momentum average
        with the buffer (a new array: the buffer is replaced only once the solve has
        succeeded), or ``g`` itself; ``ValueError`` when ``g`` does not have the buffer's
        shape.  Changes nothing (``refgeo.torch.DiameterLMO`` checks every group with it
        before stepping any)."""
        if self.buffer is not None and self.buffer.shape != g.shape:
            raise ValueError(
                f"grad must keep the shape of the optimizer state {self.buffer.shape}, got "
                f"shape {g.shape} instead."
            )
        if momentum > 0.0:
            return (1.0 - momentum) * g if self.buffer is None else momentum * self.buffer + (1.0 - momentum) * g
        return g

    def last_step(self) -> np.ndarray | None:
        """The signed step of the last call (weight decay excluded), float64 (V, d)."""
        return None if self.last_result is None else np.array(self.last_result.update)

    def state_dict(self) -> dict:
        """Hyper-parameters, step count, momentum buffer and the warm start."""
        res = self.last_result
        return {
            "lr": self.lr,
            "momentum": self.momentum,
            "rtol": self.rtol,
            "max_time": self.max_time,
            "weight_decay": self.weight_decay,
            "t": self.t,
            "buffer": None if self.buffer is None else self.buffer.copy(),
            "warm_update": None if res is None else np.array(res.update),
            "warm_pairs": None if res is None else np.array(res.pairs),
            "warm_flows": None if res is None else np.array(res.flows),
            "warm_eta": None if res is None else res.eta,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a ``state_dict()``; nothing changes when it raises."""
        _check_state(state, ("lr", "momentum", "rtol", "max_time", "weight_decay", "t", "buffer"))
        fresh = DiameterLMO(
            lr=state["lr"],
            momentum=state["momentum"],
            rtol=state["rtol"],
            max_time=state["max_time"],
            weight_decay=state["weight_decay"],
        )
        fresh._restore(state)
        self.__dict__.update(fresh.__dict__)  # only once everything is checked

    def _restore(self, state: dict) -> None:
        """Step count, buffer and warm start of a checked ``state`` into this fresh optimizer."""
        self.t = _check_step_count(state["t"])
        self.buffer = _check_buffer(state["buffer"])
        if state.get("warm_update") is not None:
            # a warm start comes with its pairs, flows and budget (a KeyError otherwise)
            _check_state(state, ("warm_update", "warm_pairs", "warm_flows", "warm_eta"))
            upd = as_float_array(state["warm_update"], "state['warm_update']", ndim=2,
                                 shape_hint="2-D array of shape (V, d)")
            upd = np.array(upd, dtype=np.float64)
            if self.buffer is not None and upd.shape != self.buffer.shape:
                raise ValueError(
                    f"state['warm_update'] must have the buffer's shape {self.buffer.shape}, got "
                    f"shape {upd.shape} instead."
                )
            upd.setflags(write=False)
            pairs = np.asarray(state["warm_pairs"])
            flows = np.asarray(state["warm_flows"], dtype=np.float64).reshape(-1)
            V = upd.shape[0]
            if (pairs.dtype.kind not in "iu" or pairs.size % 2 or flows.size != pairs.size // 2
                    or (pairs.size and (pairs.min() < 0 or pairs.max() >= V))):
                raise ValueError(
                    f"state['warm_pairs'] must be integer pairs of rows in [0, {V - 1}] with one "
                    f"state['warm_flows'] entry each, got {pairs.dtype} pairs of shape {pairs.shape} "
                    f"and {flows.size} flows instead."
                )
            if not np.all(np.isfinite(flows) & (flows >= 0)):
                raise ValueError("state['warm_flows'] must be finite flow magnitudes >= 0, got "
                                 f"{flows.tolist()[:8]} instead.")
            self.last_result = LMOResult(
                update=upd,
                decrease=math.nan,
                lower_bound=math.nan,
                upper_bound=math.nan,
                gap=math.nan,
                pairs=pairs.astype(np.int64).reshape(-1, 2),
                flows=flows,
                iterations=0,
                rounds=0,
                eta=check_real(state.get("warm_eta"), "state['warm_eta']", min_value=0.0, strict=True),
                method="restored",
                converged=False,
                elapsed=0.0,
            )
