r"""PyTorch optimizers for the LM head: the RowNorm recipe as a ``torch.optim.Optimizer``.

An optional module: ``import refgeo.torch`` does not import PyTorch; the first use of
``refgeo.torch.RowNorm`` does (``pip install torch``).  The mathematics is that of
:class:`refgeo.RowNorm` (see :doc:`/theory/lmo`), computed on the tensors' own device:

.. math::

    B_t = \mu B_{t-1} + (1 - \mu) P G_t, \qquad \hat B_t = B_t / (1 - \mu^t), \qquad
    S_t = -\gamma_t\, [P]\, \mathrm{RN}_\varepsilon(\hat B_t), \qquad
    W_t = (1 - \gamma_t \lambda) W_{t-1} + S_t,

with :math:`\mathrm{RN}_\varepsilon(B)_i = b_i / (\lVert b_i \rVert + \varepsilon)`, so that
the row diameter of every step is at most :math:`2\gamma_t`.

.. autosummary::

   RowNorm
   DiameterLMO
   HeadStepMonitor
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

from ._certify import scale_exponent_of, scaled_row_norms
from ._interop import from_foreign, mark_modified, precision_eps
from ._validate import (
    as_float_array,
    check_bool,
    check_decay,
    check_int,
    check_min_rows,
    check_no_repeated_entries,
    check_real,
    check_step_size,
)
from .optim import _bias_correction
from .rows import _direction_times

__all__ = ["DiameterLMO", "HeadStepMonitor", "RowNorm"]

_CLASSES: dict[str, Any] = {}

# Below this many flops (V^2 d) a recorded diameter is faster on one thread than on a
# team that has to share the cores with the framework's still-spinning threads.
_SMALL_RECORD_FLOPS = 1 << 27

# RowNorm steps a bfloat16/float16 parameter in float32 blocks of about this many entries
# (16 MiB; whole rows), so that a step's temporaries stay O(V + d).
_BLOCK_ENTRIES = 1 << 22


def _max_row_norm(H: Any) -> float:
    """Largest Euclidean row norm of the float64 array ``H`` (0 without rows), from scaled
    rows (:func:`refgeo._certify.scaled_row_norms`): with squares the bound of a monitor
    on hidden states of 1e200 was inf, on states of 1e-200 zero."""
    return float(scaled_row_norms(H).max()) if len(H) else 0.0


def __getattr__(name: str) -> Any:
    # The classes subclass torch.optim.Optimizer, so they are built (and torch imported)
    # on first use; importing refgeo.torch stays free for users without torch.
    if name in __all__:
        if name not in _CLASSES:
            _CLASSES.update(_build())
        return _CLASSES[name]
    raise AttributeError(f"module 'refgeo.torch' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)


def _import_torch() -> Any:
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - exercised without torch
        raise ImportError(
            "refgeo.torch needs PyTorch, which is not installed: `python -m pip install torch`."
        ) from exc
    return torch


def _positive_int(value: Any, name: str, min_value: int) -> int:
    out = check_int(value, name, min_value=min_value)
    assert out is not None  # check_int returns None only with allow_none=True
    return out


def _group_index(optimizer: Any, group: Any) -> int:
    """``group`` as an index of ``optimizer.param_groups``, or an error naming it (a bad
    index was an IndexError, or silently None where the groups are looked up by key)."""
    group = check_int(group, "group", min_value=0)
    if group >= len(optimizer.param_groups):
        raise ValueError(f"group must be in [0, {len(optimizer.param_groups) - 1}], got {group} instead.")
    return group


def _check_unit_interval(value: Any, name: str) -> float:
    value = check_real(value, name, min_value=0.0)
    if not value < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value} instead.")
    return value


def _build() -> dict[str, Any]:
    torch = _import_torch()

    def _state_dtype(p: Any) -> Any:
        """The dtype of RowNorm's buffers: float64 for float64 parameters, else float32."""
        return torch.float64 if p.dtype == torch.float64 else torch.float32

    def _max_abs(S: Any, dim: int | None = None) -> Any:
        """``max |s|`` over ``S`` (a 0-d tensor) or along ``dim`` (kept): from one
        ``aminmax`` pass, 5 to 7 times faster on the CPU than ``vector_norm(ord=inf)``."""
        lo, hi = torch.aminmax(S) if dim is None else torch.aminmax(S, dim=dim, keepdim=True)
        return torch.maximum(hi, -lo)

    def _column_mean(S: Any) -> Any:
        """The mean row of ``S``, free of overflow in the column sums: rows near the
        largest float (3e38 in a float32 state) are averaged scaled down by a power of
        two, as :class:`refgeo.RowNorm` does in float64."""
        V = S.shape[0]
        top = torch.finfo(S.dtype).max
        if float(_max_abs(S)) * V < top / 2:
            return S.mean(dim=0, keepdim=True)
        k = 8 + math.frexp(float(V))[1]
        return (S * 2.0**-k).mean(dim=0, keepdim=True) * 2.0**k

    def _center_(S: Any) -> None:
        """``S`` minus its mean row, in place, as :class:`refgeo.RowNorm` centers in
        float64: a second pass removes the rounding of the first mean (a shift common
        to every row), and rows that are then all equal, from rows that were all equal,
        become 0 (``P 1 r^T = 0``; one pass left each row at that rounding, which the
        row normalization made a full step)."""
        S.sub_(_column_mean(S))
        S.sub_(_column_mean(S))
        # a 0-d mask (no host sync) from the columns' extremes: O(d) temporaries, where
        # S == S[:1] made a (V, d) boolean array
        lo, hi = torch.aminmax(S, dim=0)
        S.masked_fill_((lo == hi).all(), 0.0)

    def _row_normalize_(S: Any, eps: float) -> None:
        """``S`` row-normalized in place, ``s_i / (||s_i|| + eps)``, zero rows kept zero:
        :func:`refgeo.row_normalize` with O(V) temporaries.

        With ``m_i = max_j |s_ij|`` it is ``(s_i / m_i) / (||s_i / m_i|| + eps / m_i)``:
        no norm overflows or underflows.  Where ``eps / m_i`` overflows (tiny rows) the
        norm is negligible next to ``eps`` and ``s_i / (m_i ||s_i / m_i|| + eps)`` is
        safe.  ``eps / m_i`` is a true division: torch evaluates a number divided by a
        tensor as the number times the reciprocal, which is ``0 * inf = NaN`` for
        ``eps = 0`` and a subnormal ``m_i``, and that row was left unnormalized.
        """
        m = _max_abs(S, dim=1)
        nonzero = m > 0
        m = torch.where(nonzero, m, torch.ones_like(m))  # zero rows stay zero
        S.div_(m)
        v = torch.linalg.vector_norm(S, dim=1, keepdim=True)
        q = torch.full_like(m, eps).div_(m)
        fine = torch.isfinite(q)
        den = torch.where(fine, v + torch.where(fine, q, torch.zeros_like(q)), torch.ones_like(v))
        S.div_(torch.where(den > 0, den, torch.ones_like(den)))
        if not bool(fine.all()):  # tiny rows: s_i / (m_i v_i + eps), from s_i = m_i (s_i / m_i)
            tiny = torch.where(fine, torch.ones_like(m), m)
            den_tiny = torch.where(fine, torch.ones_like(m), tiny * v + eps)
            # undo the division by den (1 on those rows), then s_i / (m_i v_i + eps)
            S.mul_(tiny).div_(den_tiny)

    def _check_not_overlapping(p: Any, name: str) -> None:
        """``ValueError`` when the parameter ``p``, updated in place, holds one entry at
        two indices (an expanded or unfolded tensor), on any device."""
        size = p.element_size()
        check_no_repeated_entries([st * size for st in p.stride()], p.shape, size, f"parameter {name}")

    def _name(group: dict, k: int) -> str:
        names = group.get("param_names")
        return repr(names[0]) if names else f"param_groups[{k}]['params'][0]"

    def _check_group(group: dict, k: int, owner: str) -> None:
        params = group["params"]
        if len(params) != 1:
            raise ValueError(
                f"refgeo.torch.{owner} takes exactly one 2-D parameter (the LM-head weight) per param group, "
                f"got {len(params)} parameters in param group {k} instead."
            )
        p = params[0]
        name = _name(group, k)
        if p.is_complex() or not p.is_floating_point():
            raise TypeError(f"parameter {name} must be a real floating-point tensor, got dtype {p.dtype} instead.")
        if p.ndim != 2 or p.numel() == 0:
            raise ValueError(
                f"parameter {name} must be 2-D and non-empty (the LM-head weight, shape (V, d)), got shape "
                f"{tuple(p.shape)} instead."
            )
        if p.is_sparse:
            raise TypeError(f"parameter {name} must be a dense tensor, got a sparse tensor instead.")
        if p.device.type == "meta":
            raise TypeError(
                f"parameter {name} is a meta tensor (a shape without values); materialize the model "
                "(to_empty() and load its weights) before building the optimizer."
            )
        if not bool(torch.isfinite(p).all()):
            raise ValueError(f"parameter {name} must be finite, got a tensor with NaN or inf entries instead.")

    def _lr(value: Any, strict: bool = False) -> float:
        # torch's optimizers take lr as a number or a one-element tensor (schedules under
        # torch.compile keep it a tensor and fill_ it in place), so it is read at each step
        if isinstance(value, torch.Tensor):
            if value.device.type == "meta":
                raise TypeError("lr is a meta tensor (a shape without values); pass a number or a tensor "
                                "that holds the value.")
            if value.numel() != 1:
                raise ValueError(f"lr must be a number or a one-element tensor, got a tensor of shape "
                                 f"{tuple(value.shape)} instead.")
            if value.dtype == torch.bool or value.is_complex():
                raise TypeError(f"lr must be a real number, got a tensor of dtype {value.dtype} instead.")
            value = value.item()
        # RowNorm takes lr = 0 (a schedule's first step); the LMO's diameter budget must
        # be positive, and its message says so for any lr <= 0 alike
        return check_real(value, "lr", min_value=0.0, strict=strict)

    def _hyperparameters(group: dict) -> tuple:
        out = (
            _lr(group["lr"]),
            _check_unit_interval(group["momentum"], "momentum"),
            check_real(group["eps"], "eps", min_value=0.0),
            check_real(group["weight_decay"], "weight_decay", min_value=0.0),
            check_bool(group["bias_correction"], "bias_correction"),
            check_bool(group["project"], "project"),
            check_bool(group["center"], "center"),
        )
        check_decay(out[0], out[3])
        return out

    def _add_checked_group(opt: Any, param_group: dict, check: Any) -> None:
        # torch's add_param_group fills in the defaults; the group is then checked as a
        # whole (one 2-D weight, valid hyperparameters) and taken back out when refused,
        # so a failed call leaves the optimizer as it was
        torch.optim.Optimizer.add_param_group(opt, param_group)
        group = opt.param_groups[-1]
        try:
            _check_group(group, len(opt.param_groups) - 1, type(opt).__name__)
            check(group)
        except (TypeError, ValueError):
            opt.param_groups.pop()
            raise

    def _check_saved_groups(opt: Any, state_dict: dict) -> None:
        """``ValueError`` before anything changes when ``state_dict``'s param groups lack
        this optimizer's hyper-parameters: one of the other optimizer (RowNorm's
        loaded into a DiameterLMO, or back) raised ``KeyError`` at the next step, or
        after torch had replaced the param groups, leaving the optimizer unusable."""
        groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        if not isinstance(groups, (list, tuple)):
            raise ValueError(f"state_dict must be a state_dict() of refgeo.torch.{type(opt).__name__}, got one "
                             "without 'param_groups' instead.")
        # this optimizer's own hyper-parameters, not opt.defaults: torch's loader adds
        # "differentiable" to those, so a second load of the same checkpoint (a second
        # rollback) was refused as "without ['differentiable']"
        for k, group in enumerate(groups):
            missing = sorted(set(opt._HYPERPARAMETERS) - set(group))
            if missing:
                raise ValueError(
                    f"state_dict must be a state_dict() of refgeo.torch.{type(opt).__name__}, got param group "
                    f"{k} without {missing} instead (saved by another optimizer?)."
                )

    class RowNorm(torch.optim.Optimizer):  # type: ignore[name-defined,misc]  # built at run time
        r"""RowNorm for the LM-head weight, as a ``torch.optim.Optimizer``.

        The steps equal :class:`refgeo.RowNorm`'s (float64: to about 1e-15 relative;
        float32: to float32 rounding), on the parameter's device.  One exception: the
        float32 momentum buffer of a float32, bfloat16 or float16 parameter loses the
        digits of gradient rows in the float32 subnormal range (entries below about
        1e-38), which :class:`refgeo.RowNorm`'s float64 buffer keeps; with ``eps = 0``
        such a row's direction can differ, with the default ``eps`` its step is below
        1e-29 either way.  The comparison is of the steps, not of their directions,
        where a row of the momentum buffer cancels to its rounding (``mu = 0.9``,
        gradient rows ``g`` and then ``-0.9 g`` leave ``B = 0`` up to a few ulps of
        ``g``): the two buffers then hold different rounding errors, and with ``eps = 0``
        the normalized rows point anywhere (either may be the one nearer the exact
        recursion); with ``eps`` above that rounding the step of such a row is small in
        both.

        Parameters
        ----------
        params : tensor, iterable of tensors, of (name, tensor) pairs, or of dicts
            The 2-D LM-head weight, of shape (V, d): exactly one parameter per param
            group (several groups are allowed, e.g. two heads).  Names given through
            ``model.named_parameters()`` appear in error messages.
        lr : float or Tensor
            Step size :math:`\gamma \ge 0` (LR schedulers change ``group["lr"]``); a
            one-element tensor, as torch's optimizers take, is read at every step.
        momentum : float, default=0.95
            :math:`\mu \in [0, 1)` of the gradient average.
        eps : float, default=1e-8
            Added to every row norm, ``>= 0``.
        weight_decay : float, default=0.0
            Decoupled weight decay :math:`\lambda \ge 0`: ``W *= 1 - lr * weight_decay``
            before the step is added; ``lr * weight_decay <= 2`` (checked at each step:
            a larger product makes the weights grow without bound).
        bias_correction : bool, default=True
            Divide the average by :math:`1 - \mu^t`.
        project : bool, default=False
            Apply the outer centering P to the step.
        center : bool, default=True
            Center each gradient (:math:`PG`; a no-op for cross-entropy gradients).

        Notes
        -----
        .. math:: S_t = -\gamma_t\,[P]\,\mathrm{RN}_\varepsilon\big(B_t / (1 - \mu^t)\big),
                  \quad B_t = \mu B_{t-1} + (1 - \mu) P G_t

        State per parameter: ``step`` (int), ``momentum_buffer`` and ``last_step``
        (the step :math:`S_t` before weight decay), both of the parameter's shape, in
        float64 for float64 parameters and float32 otherwise; ``state_dict()`` holds
        them.  Each step costs O(Vd) time and, besides the state, only O(V + d)
        memory: the last step is the scratch space, and the row norms are scale-safe
        in place (rows of norm 1e-200 or 1e200 neither underflow nor overflow, nor
        do rows of subnormal entries, nor the column means of rows near the largest
        float).  A parameter whose ``grad`` is None is skipped.  Everything is checked
        before any group changes.

        Raises
        ------
        ValueError
            A parameter that is not 2-D, several parameters in one group, a parameter with
            NaN or inf entries (checked when it joins the optimizer), a gradient with NaN or
            inf entries (at each step), a gradient whose centered momentum average
            leaves the range of the state's dtype (a centered float32 gradient beyond
            3.4e38), an ``lr`` whose step the parameter's dtype cannot hold (the step's
            entries reach ``lr``, ``2 lr`` with ``project``: above 65504 for float16),
            hyper-parameters out of range, a parameter whose rows share memory
            (an expanded or unfolded tensor: it is updated in place).
        TypeError
            A complex, integer or sparse parameter or gradient.

        Examples
        --------
        >>> import torch, refgeo.torch
        >>> W = torch.nn.Parameter(torch.zeros(2, 2, dtype=torch.float64))
        >>> opt = refgeo.torch.RowNorm([W], lr=0.1, eps=0.0)
        >>> W.grad = torch.tensor([[3.0, 4.0], [-3.0, -4.0]], dtype=torch.float64)
        >>> _ = opt.step()
        >>> W.detach().round(decimals=12).tolist()
        [[-0.06, -0.08], [0.06, 0.08]]
        >>> opt.last_step().tolist() == W.detach().tolist()   # S_t, before weight decay
        True
        """

        _HYPERPARAMETERS = ("lr", "momentum", "eps", "weight_decay", "bias_correction", "project", "center")

        def __init__(
            self,
            params: Any,
            lr: Any,
            momentum: float = 0.95,
            eps: float = 1e-8,
            weight_decay: float = 0.0,
            *,
            bias_correction: bool = True,
            project: bool = False,
            center: bool = True,
        ) -> None:
            if isinstance(params, torch.Tensor):
                params = [params]
            defaults = dict(lr=lr, momentum=momentum, eps=eps, weight_decay=weight_decay,
                            bias_correction=bias_correction, project=project, center=center)
            _hyperparameters(defaults)
            super().__init__(params, defaults)

        def add_param_group(self, param_group: dict) -> None:
            _add_checked_group(self, param_group, _hyperparameters)

        @torch.no_grad()
        def step(self, closure: Any = None) -> Any:
            """One step for every param group; returns ``closure()`` when given."""
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            # Validate everything before changing anything: a bad gradient in group 1
            # leaves group 0 untouched too.
            work = []
            for k, group in enumerate(self.param_groups):
                hyper = _hyperparameters(group)
                p = group["params"][0]
                g = p.grad
                if g is None:
                    continue
                name = _name(group, k)
                if g.is_sparse:
                    raise TypeError(f"the gradient of {name} must be dense, got a sparse tensor instead.")
                if g.is_complex() or not g.is_floating_point():
                    raise TypeError(f"the gradient of {name} must be real floating point, got dtype {g.dtype} instead.")
                # from one aminmax (NaN propagates): torch.isfinite made a float copy of
                # g and three boolean ones, 1.75 times g's size in float32
                a = float(_max_abs(g))
                if not math.isfinite(a):
                    raise ValueError(f"the gradient of {name} must be finite, got NaN or inf entries instead.")
                state = self.state.get(p)  # self.state[p] would add an entry
                if state and tuple(state["momentum_buffer"].shape) != tuple(g.shape):
                    # a parameter resized in place (p.data = ...) or state loaded from
                    # another model: torch's broadcast error came after earlier groups moved
                    raise ValueError(
                        f"the gradient of {name} must keep the shape of the optimizer state "
                        f"{tuple(state['momentum_buffer'].shape)}, got shape {tuple(g.shape)} instead."
                    )
                check_step_size(hyper[0], hyper[5], float(torch.finfo(p.dtype).max),
                                f"parameter {name} of dtype {str(p.dtype).replace('torch.', '')}")
                self._check_range(p, g, a, hyper, name)
                # an expanded parameter raised torch's RuntimeError after the state had
                # moved; an unfolded one (overlapping rows) took every row's step over its
                # neighbors' without an error
                _check_not_overlapping(p, name)
                work.append((p, g, hyper))
            for p, g, (lr, mu, eps, wd, bias_correction, project, center) in work:
                state = self.state[p]
                if len(state) == 0:
                    dtype = _state_dtype(p)
                    state["step"] = 0
                    state["momentum_buffer"] = torch.zeros(p.shape, dtype=dtype, device=p.device)
                    state["last_step"] = torch.zeros(p.shape, dtype=dtype, device=p.device)
                B, S = state["momentum_buffer"], state["last_step"]
                state["step"] = t = int(state["step"]) + 1
                S.copy_(g)  # S is the scratch space: first the (centered) gradient
                if center:
                    _center_(S)
                B.mul_(mu).add_(S, alpha=1.0 - mu)
                if bias_correction:
                    torch.div(B, _bias_correction(mu, t), out=S)
                else:
                    S.copy_(B)
                _row_normalize_(S, eps)
                S.mul_(-lr)
                if project:
                    # rows of norm lr near the dtype's top: the column sums overflowed
                    # (inf in the weights at lr = 1e38, V = 16, float32)
                    S.sub_(_column_mean(S))
                if p.dtype == S.dtype:
                    if wd:
                        p.mul_(1.0 - lr * wd)
                    p.add_(S)
                else:
                    # bfloat16/float16: decay and step in the state's float32, one rounding
                    # to the parameter (two roundings left a third of the weights of a
                    # decayed head an ulp off the NumPy optimizer's)
                    # in blocks of rows: a float32 copy of the whole parameter was the
                    # step's one temporary of its size
                    rows = max(1, _BLOCK_ENTRIES // p.shape[1])
                    for i0 in range(0, p.shape[0], rows):
                        P = p[i0:i0 + rows].detach().to(S.dtype)
                        if wd:
                            P.mul_(1.0 - lr * wd)
                        p[i0:i0 + rows].copy_(P.add_(S[i0:i0 + rows]))
                        del P  # before the next block's: one block alive at a time
            return loss

        def _check_range(self, p: Any, g: Any, a: float, hyper: tuple, name: str) -> None:
            """``ValueError`` when the centered gradient, the momentum buffer or its
            bias-corrected average of this step would leave the range of the state's
            dtype (float32 for every parameter but float64 ones), before anything changes.

            A bound from two maxima decides almost always: a centered entry is at most
            ``2 max |g|``; only when the bound comes within a factor of 2 of the largest
            float are the values formed (in temporaries) and checked."""
            _, mu, _, _, bias_correction, _, center = hyper
            dtype = _state_dtype(p)
            top = torch.finfo(dtype).max
            state = self.state.get(p, {})  # self.state[p] would add an entry
            t = int(state.get("step", 0)) + 1  # a = max |g|, from the finiteness check
            b = float(_max_abs(state["momentum_buffer"])) if state else 0.0
            bound = mu * b + (1.0 - mu) * (2.0 * a if center else a)
            if bias_correction:
                bound /= _bias_correction(mu, t)
            if bound < top / 2:
                return
            G = g.to(dtype)
            if center:
                G = G - _column_mean(G)
            B = (1.0 - mu) * G if not state else mu * state["momentum_buffer"] + (1.0 - mu) * G
            Bhat = B / _bias_correction(mu, t) if bias_correction else B
            if not (bool(torch.isfinite(G).all()) and bool(torch.isfinite(Bhat).all())):
                raise ValueError(
                    f"the gradient of {name} must have a centered momentum average inside the {dtype} range "
                    f"of the optimizer state (max {top!r}), got one that overflows instead; scale it down "
                    "(with eps = 0 the step does not depend on its scale)."
                )

        def load_state_dict(self, state_dict: dict) -> None:
            """Restore a ``state_dict()`` (the buffers keep their float32/float64 precision)."""
            # torch's loader casts the state to the parameter's dtype, which would round
            # the float32 buffers of a bfloat16/float16 parameter: keep the saved tensors
            # (matched to the parameters as torch matches them, group by group, in order)
            _check_saved_groups(self, state_dict)
            saved_state = state_dict.get("state", {})
            saved = {}
            for saved_group, group in zip(state_dict.get("param_groups", ()), self.param_groups):
                for pid, p in zip(saved_group["params"], group["params"]):
                    if pid in saved_state:
                        saved[p] = saved_state[pid]
            super().load_state_dict(state_dict)
            for group in self.param_groups:
                p = group["params"][0]
                state = self.state.get(p)
                if state:
                    dtype = _state_dtype(p)
                    state["step"] = int(state["step"])
                    for key in ("momentum_buffer", "last_step"):
                        value = saved[p][key] if p in saved and key in saved[p] else state[key]
                        state[key] = value.to(dtype=dtype, device=p.device, copy=True)

        def last_step(self, group: int = 0) -> Any:
            """The step :math:`S_t` of the last call for param group ``group`` (weight decay
            excluded), a tensor of the parameter's shape; None before the first step."""
            p = self.param_groups[_group_index(self, group)]["params"][0]
            state = self.state.get(p)
            return None if not state else state["last_step"].clone()

    class DiameterLMO(torch.optim.Optimizer):  # type: ignore[name-defined,misc]  # built at run time
        r"""Steepest descent under the row diameter with the exact LMO, as a torch optimizer.

        Each step calls :class:`refgeo.DiameterLMO` (the certified, warm-started solver of
        :func:`refgeo.diameter_lmo`) on the host, with a time limit per solve, and writes
        the result back to the parameter's device.  The steps are those of
        :class:`refgeo.DiameterLMO` on the same gradients.

        Parameters
        ----------
        params : tensor, iterable of tensors, of (name, tensor) pairs, or of dicts
            One 2-D LM-head weight (V, d) per param group.
        lr : float or Tensor
            Diameter budget :math:`\eta` of every step, at least the smallest normal
            float64 (LR schedulers change it); a one-element tensor is read at every step.
        momentum : float, default=0.0
            :math:`\mu \in [0, 1)` of the averaged gradient the LMO is applied to.
        rtol : float, default=1e-3
            Certified relative gap of each solve.
        max_time : float, default=None
            Time limit per solve in seconds, ``>= 0`` (the best certified step so far is
            used; once the limit has passed, the projected RowNorm step: see
            :func:`refgeo.diameter_lmo`).
        weight_decay : float, default=0.0
            Decoupled weight decay: ``W *= 1 - lr * weight_decay`` before the step;
            ``lr * weight_decay <= 2``.

        Notes
        -----
        .. math:: S_t = \arg\min \{ \langle M_t, S \rangle : D(S) \le \eta,\
                  \mathbf{1}^\top S = 0 \}

        ``last_result(group)`` is the solve's :class:`refgeo.LMOResult` (its ``gap`` is
        the certified relative gap), ``last_step(group)`` the step :math:`S_t` as a
        float64 tensor.  ``state_dict()`` holds the solver's state (momentum buffer and
        warm start).  Time per step: one LMO solve (see :func:`refgeo.diameter_lmo`).

        Examples
        --------
        >>> import torch, refgeo.torch
        >>> W = torch.nn.Parameter(torch.zeros(2, 2, dtype=torch.float64))
        >>> opt = refgeo.torch.DiameterLMO([W], lr=0.5)
        >>> W.grad = torch.tensor([[3.0, 4.0], [-3.0, -4.0]], dtype=torch.float64)
        >>> _ = opt.step()
        >>> W.detach().round(decimals=6).tolist()
        [[-0.15, -0.2], [0.15, 0.2]]
        >>> opt.last_result().gap <= 1e-3
        True
        """

        _HYPERPARAMETERS = ("lr", "momentum", "rtol", "max_time", "weight_decay")

        def __init__(self, params: Any, lr: Any, momentum: float = 0.0, rtol: float = 1e-3,
                     max_time: float | None = None, weight_decay: float = 0.0) -> None:
            if isinstance(params, torch.Tensor):
                params = [params]
            defaults = dict(lr=lr, momentum=momentum, rtol=rtol, max_time=max_time, weight_decay=weight_decay)
            self._solvers: dict[int, Any] = {}
            self._solver_for(defaults)  # validates the hyper-parameters by name
            super().__init__(params, defaults)

        @staticmethod
        def _solver_for(group: dict, solver: Any = None) -> Any:
            import refgeo

            hyper = {k: group[k] for k in ("momentum", "rtol", "max_time", "weight_decay")}
            hyper["lr"] = _lr(group["lr"], strict=True)
            if solver is None:
                return refgeo.DiameterLMO(**hyper)
            for k, v in hyper.items():
                setattr(solver, k, v)  # validated again by the solver at its next step
            return solver

        def add_param_group(self, param_group: dict) -> None:
            _add_checked_group(self, param_group, self._solver_for)

        @torch.no_grad()
        def step(self, closure: Any = None) -> Any:
            """One LMO step for every param group; returns ``closure()`` when given.

            Nothing changes when it raises: every group's gradient (dense, real, finite,
            of the momentum buffer's shape) and hyper-parameters, and the matrix its solver
            will solve for (the momentum average, rows summing to about zero), are checked
            first."""
            import numpy as np

            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            # Check every group before changing any (as RowNorm does): a bad gradient or
            # hyper-parameter in group 1 leaves group 0 as it was.
            work = []
            for k, group in enumerate(self.param_groups):
                p = group["params"][0]
                if p.grad is None:
                    continue
                name = _name(group, k)
                g = p.grad
                if g.is_sparse:
                    raise TypeError(f"the gradient of {name} must be dense, got a sparse tensor instead.")
                if g.is_complex() or not g.is_floating_point():
                    raise TypeError(f"the gradient of {name} must be real floating point, got dtype {g.dtype} instead.")
                fresh = self._solver_for(group)  # a fresh solver validates the group's hyper-parameters
                check_step_size(fresh.lr, False, float(torch.finfo(p.dtype).max),
                                f"parameter {name} of dtype {str(p.dtype).replace('torch.', '')}")
                # resolve_neg: a tensor with torch's negative bit (z.conj().imag) has no
                # NumPy view (a RuntimeError from .numpy())
                G = g.detach().resolve_neg().to(device="cpu", dtype=torch.float64).numpy()
                try:
                    # C-contiguous, as the NumPy optimizer makes it (sums in one order)
                    G = as_float_array(G, "grad", ndim=2, shape_hint="2-D array of shape (V, d)")
                    check_min_rows(G, "grad", 2)  # before the centering check
                    # the solver's own checks of G, and its momentum average with the buffer
                    self._solvers.get(k, fresh)._checked_average(G, precision_eps(g.dtype), fresh.momentum)
                except ValueError as exc:
                    raise ValueError(f"the gradient of {name}: {exc}") from exc
                # the solver reads its precision from the gradient's own dtype (a
                # bfloat16 g is centered only to its rounding)
                work.append((k, group, p, name, G, precision_eps(g.dtype)))
            # Every solve before any step: a solve can still fail (a tension beyond the
            # float64 range), and group 0 had moved when group 1's solve raised.
            solved = []
            for k, group, p, name, G, grad_eps in work:
                # written through its NumPy view on the CPU, with copy_ elsewhere: either
                # way overlapping rows take each other's steps
                _check_not_overlapping(p, name)
                solver = self._solver_for(group, self._solvers.get(k))
                try:
                    res, M = solver._solve(G, grad_eps)
                except ValueError as exc:
                    raise ValueError(f"the gradient of {name}: {exc}") from exc
                solved.append((k, p, solver, res, M))
            for k, p, solver, res, M in solved:
                self._solvers[k] = solver
                host = torch.float64 if p.dtype == torch.float64 else torch.float32
                # a view for CPU float tensors; a copy, written back below, for the others
                # and for one with the negative bit (whose .numpy() raised after the earlier
                # groups had moved)
                W = p.detach().resolve_neg().to(device="cpu", dtype=host).numpy()
                solver._commit(W, res, M)
                if W.ctypes.data != p.data_ptr():
                    p.copy_(torch.from_numpy(np.ascontiguousarray(W)))
                else:  # written through its NumPy view, which autograd does not see
                    mark_modified(p)
                self.state[p]["step"] = solver.t
            return loss

        def last_result(self, group: int = 0) -> Any:
            """The :class:`refgeo.LMOResult` of the last solve of param group ``group``
            (None before the first)."""
            solver = self._solvers.get(_group_index(self, group))
            return None if solver is None else solver.last_result

        def last_step(self, group: int = 0) -> Any:
            """The step of the last call (weight decay excluded), float64, on the parameter's
            device; None before the first step."""
            group = _group_index(self, group)
            solver = self._solvers.get(group)
            S = None if solver is None else solver.last_step()
            p = self.param_groups[group]["params"][0]
            return None if S is None else torch.from_numpy(S).to(p.device)

        def state_dict(self) -> dict:
            """torch's optimizer state plus, under ``"refgeo_solvers"``, each group's solver
            state (momentum buffer and warm start, as CPU tensors and plain numbers, so
            that ``torch.load`` reads it back with its default ``weights_only=True``)."""
            import numpy as np

            def portable(v: Any) -> Any:
                if isinstance(v, np.ndarray):
                    return torch.from_numpy(v.copy())
                return v.item() if isinstance(v, np.generic) else v

            out = super().state_dict()
            # Kept out of out["state"]: torch casts the tensors there to the parameter's
            # dtype on loading.  The solvers' NumPy arrays travel as CPU tensors (of
            # their own dtype): torch.load's default weights_only=True refuses NumPy
            # arrays and NumPy scalars, so a checkpoint holding them could not be read back.
            out["refgeo_solvers"] = {
                k: {key: portable(v) for key, v in solver.state_dict().items()}
                for k, solver in self._solvers.items()
            }
            return out

        def load_state_dict(self, state_dict: dict) -> None:
            """Restore a ``state_dict()`` (also one loaded by ``torch.load`` with its
            default ``weights_only=True``)."""
            _check_saved_groups(self, state_dict)
            state_dict = dict(state_dict)
            solvers = state_dict.pop("refgeo_solvers", {})
            # the solvers are built on the loaded groups' hyper-parameters, so torch's part
            # is loaded first and put back when a saved solver is refused (it stayed
            # loaded, with the solvers' momentum and warm starts dropped)
            before, before_solvers = super().state_dict(), self._solvers
            super().load_state_dict(state_dict)
            try:
                loaded = {}
                for k, saved in solvers.items():
                    solver = self._solver_for(self.param_groups[int(k)])
                    solver.load_state_dict({key: v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else v
                                            for key, v in saved.items()})
                    loaded[int(k)] = solver
            except BaseException:
                super().load_state_dict(before)
                self._solvers = before_solvers
                raise
            self._solvers = loaded

    class HeadStepMonitor:
        r"""Records the geometry of an LM-head optimizer's steps, every ``every`` steps.

        Parameters
        ----------
        optimizer : torch.optim.Optimizer
            An optimizer with ``last_step(group)`` (such as :class:`RowNorm`): the step
            :math:`S_t` of the last call, before weight decay.
        hidden_states : tensor or array of shape (N, d)
            A fixed panel of hidden states :math:`h_1, \dots, h_N` fed to the head.
        every : int, default=10
            Record after optimizer steps ``every, 2 every, ...`` (calls of
            ``optimizer.step()``); a call that skipped the group (its gradient None,
            so that ``last_step`` is still the previous one) is not recorded.
        group : int, default=0
            The param group whose step is recorded.
        n_threads : int, optional
            Threads for the recorded step's diameter.  By default one thread while the
            diameter costs under :math:`V^2 d = 2^{27}` flops (a 512 x 512 head, say), and the
            engine's default beyond: a small recording runs right after the framework's
            own parallel step, whose idle threads still spin on the cores, and a second
            thread team then waits for them rather than helping (see Notes).

        Attributes
        ----------
        records : list of dict
            One plain dict per recorded step, ready for any logger: ``step``,
            ``diameter`` (the certified :math:`D(S_t)`, :func:`refgeo.row_diameter`),
            ``pair`` (its rows), ``diameter_error_bound``, ``h_star`` (the worst-case
            hidden state of norm :math:`\max_t \lVert h_t\rVert`, a list of floats,
            :func:`refgeo.worst_case_hidden_state`), ``hilbert_rms`` (over the panel,
            float64 accumulation, :func:`refgeo.hilbert_rms`), ``max_hidden_norm`` and
            ``bound`` = :math:`\max_t \lVert h_t \rVert\, D(S_t)`, which bounds every
            Hilbert distance the step :math:`S_t` causes on the panel: the step as
            computed, before weight decay and before rounding to the parameter's dtype
            (a bfloat16 or float16 weight moves by the rounding of :math:`W + S_t`, which
            the bound does not cover: each entry's change differs from :math:`S_t`'s by
            up to half a unit in the last place of the weight).

        Notes
        -----
        .. math:: \mathrm{RMS}_t = \Big(\frac1N \sum_i \lVert S_t h_i \rVert_{var}^2\Big)^{1/2}
                  \le \max_i \lVert h_i \rVert\, D(S_t)

        A recorded step costs one certified diameter (the compiled engine for CPU
        tensors) and one O(N V d) pass; other steps cost nothing.  The step and the
        panel are read on the host (``.cpu()`` for device tensors).  ``close()``
        removes the hooks.

        Small recordings run on one thread, BLAS included.  Right after
        ``optimizer.step()`` the framework's OpenMP and BLAS threads are still spinning
        (they wait actively for the next parallel region); a thread team started then
        competes with them for the cores.  On two cores, a 512 x 64 step's diameter took
        5 ms on two threads there against 0.45 ms on one.

        Examples
        --------
        >>> import torch, refgeo.torch
        >>> W = torch.nn.Parameter(torch.zeros(3, 2, dtype=torch.float64))
        >>> opt = refgeo.torch.RowNorm([W], lr=0.1, eps=0.0)
        >>> mon = refgeo.torch.HeadStepMonitor(opt, torch.eye(2, dtype=torch.float64), every=1)
        >>> W.grad = torch.tensor([[3.0, 4.0], [-3.0, -4.0], [0.0, 0.0]], dtype=torch.float64)
        >>> _ = opt.step()
        >>> rec = mon.records[0]
        >>> rec["step"], round(rec["diameter"], 12), rec["pair"], round(rec["bound"], 12)
        (1, 0.2, (0, 1), 0.2)
        """

        def __init__(
            self, optimizer: Any, hidden_states: Any, *, every: int = 10, group: int = 0,
            n_threads: int | None = None,
        ) -> None:
            if not callable(getattr(optimizer, "last_step", None)) or not (
                    hasattr(optimizer, "register_step_pre_hook") and hasattr(optimizer, "register_step_post_hook")):
                raise TypeError(
                    "optimizer must be a torch optimizer with last_step(group) (e.g. refgeo.torch.RowNorm), "
                    f"got {type(optimizer).__name__} instead."
                )
            self.every = _positive_int(every, "every", 1)
            self.group = _group_index(optimizer, group)
            self.n_threads = None if n_threads is None else _positive_int(n_threads, "n_threads", 1)
            # tensors as their host values (bfloat16 as exact float32, autograd history
            # ignored); integer, complex and meta tensors are TypeErrors naming the argument
            hidden_states, _ = from_foreign(hidden_states, "hidden_states", host=True)
            H = as_float_array(hidden_states, "hidden_states", ndim=2, shape_hint="2-D array of shape (N, d)")
            weight = optimizer.param_groups[self.group]["params"][0]
            # checked here, not at the first recorded step: the hook runs after the
            # optimizer has changed the weight, and its error would name an S the caller
            # never passed
            if weight.ndim != 2 or weight.shape[0] < 2:
                raise ValueError(
                    f"the parameter of param group {self.group} must be 2-D with at least 2 rows "
                    f"(a row diameter needs two rows), got shape {tuple(weight.shape)} instead."
                )
            d = weight.shape[1]
            if H.shape[1] != d:
                raise ValueError(
                    f"hidden_states must have d = {d} columns (the head's), got shape {H.shape} instead."
                )
            import numpy as np

            self._hidden = np.array(H, dtype=np.float64)
            self._max_norm = _max_row_norm(self._hidden)
            if not math.isfinite(self._max_norm):
                raise ValueError(
                    "hidden_states must have row norms within the float64 range (largest finite "
                    f"{np.finfo(np.float64).max:.4g}), got a row of norm beyond it instead."
                )
            self.optimizer = optimizer
            self.records: list[dict] = []
            self._count = 0
            self._step_before: int | None = None
            self._handles = (optimizer.register_step_pre_hook(self._before_step),
                             optimizer.register_step_post_hook(self._after_step))

        def _state_step(self) -> int | None:
            # the group's own step count (RowNorm and DiameterLMO keep state["step"]);
            # int() takes a snapshot of a tensor count that an optimizer bumps in place
            p = self.optimizer.param_groups[self.group]["params"][0]
            t = self.optimizer.state.get(p, {}).get("step")
            return None if t is None else int(t)

        def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
            # the group's step count as this call finds it: compared with the previous
            # call's, a load_state_dict() between the calls (a rollback to a checkpoint)
            # made a real step look skipped and a skipped one real
            self._step_before = self._state_step()

        def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
            self._count += 1
            # a call that skipped the group (its gradient None) left last_step() at the
            # previous step: recording it again would report a step that did not happen
            t = self._state_step()
            advanced = t is None or t != self._step_before
            if self._count % self.every or not advanced:
                return
            S = optimizer.last_step(self.group)
            if S is None:
                return
            self.records.append(self.record(S, step=self._count))

        def record(self, S: Any, *, step: int) -> dict:
            """The record of one step ``S`` (a tensor or array of shape (V, d))."""
            import numpy as np

            import refgeo

            from ._threads import blas_single_thread

            step = check_int(step, "step")
            S, _ = from_foreign(S, "S", host=True)
            # S may come from the caller: a 1-D or 3-D S, or a list, is a ValueError
            # naming S rather than a failed unpacking or a missing attribute
            S = as_float_array(S, "S", ndim=2, shape_hint="2-D array of shape (V, d)")
            check_min_rows(S, "S", 2)
            V, d = S.shape
            if d != self._hidden.shape[1]:
                raise ValueError(
                    f"S must have d = {self._hidden.shape[1]} columns (those of hidden_states), "
                    f"got shape {S.shape} instead."
                )
            n_threads = self.n_threads
            if n_threads is None and V * V * d < _SMALL_RECORD_FLOPS:
                n_threads = 1
            # BLAS pinned too (the seed's products and the panel's GEMM): its pool
            # would meet the framework's spinning threads as the OpenMP team would.
            with blas_single_thread() if n_threads == 1 else contextlib.nullcontext():
                pair = refgeo.row_diameter(S, n_threads=n_threads)
                rms = float(refgeo.hilbert_rms(S, self._hidden))
            # h* = H (s_i - s_j) / D(S), as refgeo.worst_case_hidden_state computes it,
            # from the pair already certified (no second diameter).
            diff = S[pair.i].astype(np.float64) - S[pair.j]
            e = scale_exponent_of(float(np.max(np.abs(diff))))
            if pair.value == 0:
                h_star = np.zeros(S.shape[1])
            elif e == 0:
                h_star = _direction_times(diff, float(pair.value), self._max_norm)
            else:
                # a difference far from 1 (subnormal, or near the float64 limit): the
                # direction from the difference scaled by 2**-e, of norm about 1
                u = np.ldexp(diff, -e)
                h_star = _direction_times(u, float(np.linalg.norm(u)), self._max_norm)
            bound = self._max_norm * float(pair.value)
            if not math.isfinite(bound):
                # as refgeo.worst_case_hidden_state refuses it: an inf bound is no bound
                raise ValueError(
                    f"the bound max ||h|| * D(S) = {self._max_norm!r} * {float(pair.value)!r} is beyond the "
                    f"float64 range (largest finite {np.finfo(np.float64).max:.4g}); scale S or the "
                    "hidden states down first."
                )
            return {
                "step": int(step),
                "diameter": float(pair.value),
                "pair": (int(pair.i), int(pair.j)),
                "diameter_error_bound": float(pair.error_bound),
                "h_star": [float(x) for x in h_star],
                "hilbert_rms": rms,
                "max_hidden_norm": self._max_norm,
                "bound": bound,
            }

        def close(self) -> None:
            """Stop recording (removes the optimizer hooks)."""
            for handle in self._handles:
                handle.remove()

    for cls in (RowNorm, DiameterLMO, HeadStepMonitor):
        cls.__module__ = __name__
        cls.__qualname__ = cls.__name__
        # the methods too: Python names a call's wrong keyword by the function's
        # qualified name ("_build.<locals>.RowNorm.__init__() got an unexpected ...")
        for name, member in vars(cls).items():
            fn = getattr(member, "__func__", member)  # staticmethods hold theirs
            if callable(fn) and hasattr(fn, "__qualname__"):
                fn.__qualname__ = f"{cls.__name__}.{name}"
    return {"RowNorm": RowNorm, "DiameterLMO": DiameterLMO, "HeadStepMonitor": HeadStepMonitor}
