r"""Tokenwise decomposition of layer updates (see :doc:`/theory/tokenwise`).

For hidden states :math:`X = h_l` and :math:`Y = h_{l+1}` (rows :math:`x_i, y_i`), a
map :math:`A_i` from a restricted class is fitted on the k nearest neighbors of
:math:`x_i` and the update is split into a tokenwise part and a residual:

.. math::

    \Delta_i = y_i - x_i = \underbrace{(A_i x_i - x_i)}_{\tau_i}
                         + \underbrace{(y_i - A_i x_i)}_{\rho_i}.

.. autosummary::

   fit_local_maps
   fit_tokenwise_mlp
   decompose
   output_perturbation
   spearman
   layer_report

Choices the source leaves open are parameters, recorded in every result's ``config``:
the number of neighbors ``k``, the neighbor metric (``"euclidean"`` or
``"cosine"``, optionally after standardizing coordinates), leave-one-out exclusion,
neighbor weights, the function class, the rank, the ridge weight ``ridge`` and its prior
``A_0`` (identity or zero), the rank and centering of the dominant subspace, and the
MLP's training options.  The k-NN search is :func:`refgeo.knn` (exact).

Under-determined fits.  A local map is determined by its ``k`` neighbors only on the
span of their inputs, at most ``k`` of the ``d`` directions: full and low-rank maps need
``k >= d``, orthogonal ones ``k >= d - 1``, diagonal ones ``k >= 1``.  Below that,
refgeo returns the solution closest to the prior (the ``ridge -> 0+`` limit of the
identity/zero-prior ridge problem; for orthogonal maps the identity on the directions
the data leave free) and warns with the degrees of freedom.

Long calls.  :func:`fit_local_maps` and :func:`decompose` check their memory before
any work (a ``MemoryError`` says what to change), report progress with
``progress=True`` (tqdm) or a callable, stop at the next chunk on ``KeyboardInterrupt``,
and work on exactly rescaled panels, so that hidden states anywhere in the float64
range (1e-300 to 1e300) fit alike.

Tensors.  Every function accepts torch tensors (and CPU JAX arrays) for its array
arguments: CPU tensors, ``requires_grad`` or not, are viewed as NumPy arrays without
a copy, CUDA tensors are copied to the host (the fits use batched LAPACK),
bfloat16/float16 are upcast to float32, and integer, boolean and complex tensors are
a ``TypeError`` (NumPy integer arrays are converted to float64, as everywhere).  When ``X`` or ``Y`` is a tensor, every array
field of the result comes back as a tensor on that device: for :class:`LocalFit`
``fitted``, ``neighbors``, ``distances``, ``weights``, ``coefficients`` and ``maps``;
for :class:`TokenwiseResult` ``delta``, ``tau``, ``rho``, ``relative_error``, the
arrays of ``cosines``, ``angles`` and ``projections``, ``subspace``,
``subspace_singular_values``, ``neighbors``, ``eval_mask``, ``coefficients`` and
each baseline's ``map`` and ``relative_error``.  Floats (energy fractions, subspace
energies, :func:`spearman`) stay Python floats.  :class:`MLPFit` keeps its parameters
and losses as NumPy arrays (it is a NumPy model); its ``predict`` returns a tensor for
a tensor.  ``output_perturbation`` calls ``logits_fn`` with tensors (on the states'
device) when the states are tensors, and returns a tensor.  Integer, boolean and
complex tensors are a ``TypeError`` (precomputed ``neighbors`` excepted: those are
indices), non-finite ones a ``ValueError``.

Dask.  :func:`fit_local_maps` and :func:`decompose` accept ``dask.array.Array``
hidden states (the optional ``[dask]`` extra) and run on the active Dask scheduler
(see docs/cluster.md, "Tokenwise fits on a cluster"): the k-NN on the Dask engine of
:func:`refgeo.knn`, one fit task per token block with its neighbors' rows gathered
from the other blocks, the metrics as reductions on the workers.  The (N, k)
neighbors, weights and distances and the (N,) metrics come back as NumPy arrays; the
(N, d) fields (``fitted``, ``coefficients``, ``maps``, ``delta``, ``tau``, ``rho``)
are Dask arrays chunked like ``X``: ``fitted``, ``coefficients`` and ``maps`` are
computed during the call and persisted on the workers, ``delta``, ``tau`` and ``rho``
are lazy, a chunk at a time from those and the chunks of ``X`` and ``Y``.  Every
row-wise result is the single-machine one bit for bit; what comes from d x d R
factors merged over token blocks (subspace, singular values, projections, baselines)
agrees to rounding.  ``cls="mlp"`` is refused for Dask input (``NotImplementedError``).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from . import _backend, _memory, _progress
from . import _tokenwise_fit as _fit
from ._interop import fields_to_caller, first_origin, from_foreign, in_input_dtype, to_caller, to_host
from ._threads import blas_single_thread
from ._validate import (
    as_float_array,
    check_bool,
    check_callable,
    check_choice,
    check_finite,
    check_int,
    check_min_rows,
    check_real,
    check_same_shape,
    outside_stacklevel,
)

__all__ = [
    "GlobalBaseline",
    "LocalFit",
    "MLPFit",
    "TokenwisePairs",
    "TokenwiseParts",
    "TokenwiseResult",
    "decompose",
    "fit_local_maps",
    "fit_tokenwise_mlp",
    "layer_report",
    "output_perturbation",
    "spearman",
]

CLASSES = ("diagonal", "psd_diagonal", "low_rank", "orthogonal", "scaled_orthogonal", "full")
_PRIORS = ("identity", "zero")
_METRICS = ("euclidean", "cosine")
_WEIGHTS = ("uniform", "gaussian")
_ACTIVATIONS = ("gelu", "relu", "tanh")


def _ro(a):
    """Read-only view (results are immutable)."""
    if a is None:
        return None
    # a view, so that freezing never reaches an array the caller still owns
    a = np.asarray(a).view()
    a.setflags(write=False)
    return a


class _ReadOnlyDict(dict):
    """A result's ``config``: a dict that refuses changes, as the rest of a frozen
    result does (its arrays are read-only); nested dicts are read-only too.  It
    compares, prints, pickles and serializes as a dict; ``dict(result.config)`` is a
    copy that can be changed."""

    __slots__ = ()

    def __init__(self, *args: Any, **kwargs: Any):
        if self:  # config.__init__(...) would update it in place
            self._refuse()
        items = dict(*args, **kwargs)
        super().__init__({k: _ReadOnlyDict(v) if type(v) is dict else v for k, v in items.items()})

    def _refuse(self, *args: Any, **kwargs: Any):
        raise TypeError("a result's config is read-only; change a copy: dict(result.config)")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _refuse  # type: ignore[assignment]

    def __reduce__(self):
        return (type(self), (dict(self),))


def _freeze_config(result) -> None:
    """``result.config`` as a :class:`_ReadOnlyDict` (a frozen dataclass's __post_init__)."""
    if not isinstance(result.config, _ReadOnlyDict):
        object.__setattr__(result, "config", _ReadOnlyDict(result.config))


def _f64(a):
    return a if a.dtype == np.float64 else a.astype(np.float64)


def _foreign_panels(X, Y):
    """``_panels`` of tensors too (host NumPy views; see :mod:`refgeo._interop`), and
    where a tensor came from, so that the result's arrays can go back there."""
    X, origin_x = from_foreign(X, "X", host=True)
    Y, origin_y = from_foreign(Y, "Y", host=True)
    X, Y = _panels(X, Y)
    return X, Y, first_origin(origin_x, origin_y)


def _panels(X, Y):
    X = as_float_array(X, "X", ndim=2, shape_hint="2-D array of shape (N, d)")
    Y = as_float_array(Y, "Y", ndim=2, shape_hint="2-D array of shape (N, d)")
    check_same_shape(X, Y, ("X", "Y"))
    check_min_rows(X, "X", 2, "(N, d)")
    if not isinstance(X, np.ndarray) or not isinstance(Y, np.ndarray):
        raise TypeError(
            f"X and Y must be NumPy arrays (the tokenwise fits use batched LAPACK), got "
            f"{type(X).__name__} and {type(Y).__name__} instead."
        )
    return X, Y


def _degrees_of_freedom(cls: str, d: int, rank: int | None = None) -> int:
    """Free parameters of one local map of class ``cls`` in dimension ``d``."""
    if cls in ("diagonal", "psd_diagonal"):
        return d
    if cls == "low_rank":
        if rank is None:
            raise TypeError("rank must be an integer for cls='low_rank', got None instead.")
        return rank * (2 * d - rank)
    if cls == "orthogonal":
        return d * (d - 1) // 2
    if cls == "scaled_orthogonal":
        return d * (d - 1) // 2 + 1
    return d * d


def _min_neighbors(cls: str, d: int) -> int:
    """Smallest k whose neighbors (in general position) identify a map of class ``cls``.

    A linear map is determined by the data only on the span of the neighbors' inputs
    (at most k directions): full and low-rank maps need all d directions, orthogonal
    ones d - 1 (an orthogonal map is fixed, up to a reflection, by d - 1 directions),
    diagonal ones a single non-zero neighbor per coordinate.
    """
    if cls in ("diagonal", "psd_diagonal"):
        return 1
    if cls in ("orthogonal", "scaled_orthogonal"):
        return max(1, d - 1)
    return d


def _warn_underdetermined(cls, dof, k, d, ridge):
    need = _min_neighbors(cls, d)
    if k < need:
        how = "the ridge solution" if ridge > 0 else "the minimum-norm solution (closest to the prior)"
        warnings.warn(
            f"cls={cls!r} is under-determined for k={k}: each local map has {dof} degrees "
            f"of freedom, and k={k} neighbors span at most {k} of the d={d} input "
            f"directions (identification needs k >= {need}); {how} is used.",
            UserWarning,
            stacklevel=outside_stacklevel(),
        )


# ------------------------------------------------------------------ results


@dataclasses.dataclass(frozen=True, slots=True)
class LocalFit:
    """Local maps fitted on k-NN neighborhoods (see :func:`fit_local_maps`).

    Attributes
    ----------
    fitted : ndarray of shape (N, d)
        float64 :math:`A_i x_i`, the tokenwise prediction of :math:`y_i`.
    neighbors : ndarray of shape (N, k)
        int64 neighbor indices used for token ``i``.
    distances : ndarray of shape (N, k) or None
        float64 neighbor distances in the search metric (None if only indices were
        supplied).
    weights : ndarray of shape (N, k)
        float64 neighbor weights, normalized to mean 1 per token.
    coefficients : ndarray or None
        Diagonal classes: the diagonal of :math:`A_i`, shape (N, d);
        ``scaled_orthogonal``: the scale :math:`s_i`, shape (N,); otherwise None.
    maps : ndarray of shape (N, d, d) or None
        The maps :math:`A_i` when ``return_maps=True`` (memory N d^2).
    dof : int
        Degrees of freedom of one local map.
    n_targets : int
        ``k * d``, the number of scalar targets of one local fit.
    config : dict
        Every choice that produced the fit.
    """

    fitted: Any
    neighbors: Any
    distances: Any
    weights: Any
    coefficients: Any
    maps: Any
    dof: int
    n_targets: int
    config: dict

    def __post_init__(self):
        _freeze_config(self)


@dataclasses.dataclass(frozen=True, slots=True)
class MLPFit:
    r"""A shallow residual MLP :math:`T(x) = x + \mathrm{MLP}(x)` (see :func:`fit_tokenwise_mlp`).

    Attributes
    ----------
    W1 : ndarray of shape (d, h)
    b1 : ndarray of shape (h,)
    W2 : ndarray of shape (h, d)
    b2 : ndarray of shape (d,)
        Weights acting on standardized inputs ``(x - x_mean) / x_scale`` and producing
        the standardized update ``(y - x) / delta_scale``.
    x_mean : ndarray of shape (d,)
    x_scale, delta_scale : float
        Standardization constants (RMS over the training tokens).
    train_index, test_index : ndarray of int64
        The seeded split of the tokens.
    train_loss, test_loss : ndarray of shape (epochs,)
        Mean squared error per coordinate (standardized units).  ``train_loss[e]`` is
        the running loss of epoch ``e``: each mini-batch's loss before its own update
        (with full batches, ``train_loss[0]`` is the loss at initialization);
        ``test_loss[e]`` is the held-out loss after epoch ``e`` (NaN without held-out
        tokens).  The two curves are therefore up to one epoch apart.
    n_parameters : int
        Number of trained parameters (the MLP's degrees of freedom).
    config : dict
        Every training choice (hidden width, activation, epochs, learning rate,
        batch size, weight decay, train fraction, seed).
    """

    W1: Any
    b1: Any
    W2: Any
    b2: Any
    x_mean: Any
    x_scale: float
    delta_scale: float
    train_index: Any
    test_index: Any
    train_loss: Any
    test_loss: Any
    n_parameters: int
    config: dict

    def __post_init__(self):
        _freeze_config(self)

    def predict(self, X: Any, /):
        """Return :math:`T(x) = x + \\mathrm{MLP}(x)` (float64) for rows of ``X`` (a tensor
        on ``X``'s device for a tensor ``X``)."""
        X, origin = from_foreign(X, "X", host=True)
        X = as_float_array(X, "X", ndim=2, shape_hint="2-D array of shape (N, d)")
        if X.shape[1] != self.W1.shape[0]:
            raise ValueError(
                f"X must have {self.W1.shape[0]} columns (the MLP's d), got shape {tuple(X.shape)} instead."
            )
        X = _f64(np.asarray(X))
        # inputs near the float64 maximum overflow the pre-activations (and GELU(-inf)
        # is inf * 0): an error naming X, never NaN rows
        with np.errstate(over="ignore", invalid="ignore"):
            out, _ = _fit.mlp_forward(
                (self.W1, self.b1, self.W2, self.b2), (X - self.x_mean) / self.x_scale, self.config["activation"]
            )
            T = X + out * self.delta_scale
        if not np.all(np.isfinite(T)):
            bad = int(np.sum(~np.all(np.isfinite(T), axis=1)))
            raise ValueError(
                f"X must be smaller for T(x) to be computed in float64, got {bad} rows (largest entry "
                f"{_max_abs(X):.3g}) whose MLP pre-activations or outputs leave the float64 range instead."
            )
        return to_caller(T, origin)


@dataclasses.dataclass(frozen=True, slots=True)
class GlobalBaseline:
    r"""One global map fitted to all tokens, for comparison with the local fits.

    Attributes
    ----------
    kind : str
        ``"linear"`` (one ridge-regularized matrix, same ``ridge`` and prior as the local
        fit) or ``"procrustes"`` (one scaled orthogonal map).
    map : ndarray of shape (d, d)
        The fitted :math:`A` (``y ≈ A x``).
    relative_error : ndarray of shape (N,)
        :math:`\lVert y_i - A x_i\rVert / \lVert \Delta_i\rVert` (NaN where
        :math:`\Delta_i = 0`).
    energy_fraction : float
        :math:`\sum \lVert y_i - A x_i\rVert^2 / \sum \lVert \Delta_i\rVert^2` over the
        evaluated tokens (NaN where :math:`\Delta_i = 0` on every one of them: nothing
        to explain).
    """

    kind: str
    map: Any
    relative_error: Any
    energy_fraction: float


@dataclasses.dataclass(frozen=True, slots=True)
class TokenwisePairs:
    r"""A per-token quantity for each of the three pairs of parts of an update.

    Used for :attr:`TokenwiseResult.cosines` and :attr:`TokenwiseResult.angles`.

    Attributes
    ----------
    delta_tau : ndarray of shape (N,)
        The pair :math:`(\Delta_i, \tau_i)`: full update and tokenwise part.
    rho_tau : ndarray of shape (N,)
        The pair :math:`(\rho_i, \tau_i)`: residual and tokenwise part.
    rho_delta : ndarray of shape (N,)
        The pair :math:`(\rho_i, \Delta_i)`: residual and full update.
    """

    delta_tau: Any
    rho_tau: Any
    rho_delta: Any


@dataclasses.dataclass(frozen=True, slots=True)
class TokenwiseParts:
    r"""A quantity for each part :math:`\Delta, \tau, \rho` of an update.

    Used for :attr:`TokenwiseResult.projections` (per-token arrays of shape (N,)) and
    :attr:`TokenwiseResult.subspace_energies` (floats).

    Attributes
    ----------
    delta : ndarray of shape (N,) or float
        Of the full update :math:`\Delta`.
    tau : ndarray of shape (N,) or float
        Of the tokenwise part :math:`\tau`.
    rho : ndarray of shape (N,) or float
        Of the residual :math:`\rho`.
    """

    delta: Any
    tau: Any
    rho: Any


@dataclasses.dataclass(frozen=True, slots=True)
class TokenwiseResult:
    r"""Tokenwise decomposition :math:`\Delta = \tau + \rho` of one layer update.

    Attributes
    ----------
    delta, tau, rho : ndarray of shape (N, d)
        float64 full update :math:`\Delta_i = y_i - x_i`, tokenwise update
        :math:`\tau_i = A_i x_i - x_i` and residual :math:`\rho_i = \Delta_i - \tau_i`
        (so :math:`\Delta = \tau + \rho` up to one float64 rounding per entry).
    relative_error : ndarray of shape (N,)
        :math:`\lVert\rho_i\rVert / \lVert\Delta_i\rVert` (NaN where :math:`\Delta_i = 0`).
        Every per-token metric is computed from the token's own vectors scaled by a power
        of two, so it stays finite for a token whose update is far below the others'
        (``2**-600`` times the largest entry of ``X`` and ``Y``, say, where its squares
        would underflow).
    energy_fraction : float
        :math:`\sum_i \lVert\rho_i\rVert^2 / \sum_i \lVert\Delta_i\rVert^2` over the
        evaluated tokens (NaN where :math:`\Delta_i = 0` on every one of them, e.g.
        ``Y = X``: nothing to explain).
    cosines : TokenwisePairs
        Per-token cosines of the pairs, e.g. ``cosines.rho_tau`` (arrays of shape (N,);
        NaN where a vector is zero).
    angles : TokenwisePairs
        The same angles in degrees, in [0, 180].
    subspace : ndarray of shape (d, r)
        :math:`U_r`, the top-r left singular vectors of :math:`[\tau_1 \dots \tau_N]`
        (evaluated tokens; centered first when ``config["center_subspace"]``).
    subspace_singular_values : ndarray of shape (r,)
        The matching singular values.
    projections : TokenwiseParts
        Per-token projection energies :math:`\lVert U_r^T v_i\rVert^2/\lVert v_i\rVert^2`
        of :math:`v = \Delta, \tau, \rho` (arrays of shape (N,)).
    subspace_energies : TokenwiseParts
        Aggregates :math:`\sum \lVert U_r^T v_i\rVert^2 / \sum \lVert v_i\rVert^2` over
        the evaluated tokens (floats).
    dof : int
        Degrees of freedom of one local map (MLP: its number of parameters).
    n_targets : int
        Scalar targets per local fit (``k d``; MLP: training tokens times ``d``).
    neighbors : ndarray of shape (N, k) or None
        Neighbor indices of the local fits (None for the MLP).
    eval_mask : ndarray of bool, shape (N,)
        Tokens the aggregate metrics are computed on (all for local fits, the
        held-out tokens for the MLP).
    coefficients : ndarray or None
        As in :class:`LocalFit`.
    baselines : tuple of GlobalBaseline
        The global linear and Procrustes fits (empty with ``baselines=False``).
    config : dict
        Every choice (see :doc:`/theory/tokenwise`) that produced this result.

    Examples
    --------
    A layer that doubles every hidden state is tokenwise: the residual vanishes and
    the tokenwise part is the whole update.

    >>> import numpy as np, refgeo
    >>> X = np.array([[1.0, 2.0], [2.0, 1.0], [3.0, 5.0], [4.0, 3.0]])
    >>> r = refgeo.decompose(X, 2.0 * X, k=2, cls="diagonal", subspace_rank=2)
    >>> r.cosines.delta_tau.round(12).tolist(), r.angles.delta_tau.tolist()
    ([1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0])
    >>> r.subspace_energies.delta, r.subspace_energies.tau  # rank 2 = d: everything
    (1.0, 1.0)
    >>> bool(np.all(np.isnan(r.cosines.rho_tau)))  # rho = 0: no angle with it
    True
    """

    delta: Any
    tau: Any
    rho: Any
    relative_error: Any
    energy_fraction: float
    cosines: TokenwisePairs
    angles: TokenwisePairs
    subspace: Any
    subspace_singular_values: Any
    projections: TokenwiseParts
    subspace_energies: TokenwiseParts
    dof: int
    n_targets: int
    neighbors: Any
    eval_mask: Any
    coefficients: Any
    baselines: tuple
    config: dict

    def __post_init__(self):
        _freeze_config(self)

    def patched(self, X: Any, /):
        """The tokenwise prediction ``X + tau`` (= ``A_i x_i``): the states to patch in
        (a tensor on ``X``'s device for a tensor ``X``)."""
        if _any_dask(self.tau) or _any_dask(X):  # results of Dask input: lazily, chunk by chunk
            X, _ = from_foreign(X, "X", host=True)
            X = as_float_array(X, "X", ndim=2, shape_hint="2-D array of shape (N, d)")
            check_same_shape(X, self.tau, ("X", "tau"))
            return X.astype(np.float64) + self.tau
        X, origin = from_foreign(X, "X", host=True)
        X = as_float_array(X, "X", ndim=2, shape_hint="2-D array of shape (N, d)")
        tau = to_host(self.tau)
        check_same_shape(X, tau, ("X", "tau"))
        return to_caller(_f64(np.asarray(X)) + tau, origin)

    def summary(self) -> dict:
        """Means and medians of the per-token metrics over the evaluated tokens.

        Keys ``mean_<metric>`` and ``median_<metric>`` for ``relative_error``,
        ``angle_<pair>``, ``cos_<pair>`` and ``projection_<part>`` (pairs
        ``delta_tau``, ``rho_tau``, ``rho_delta``; parts ``delta``, ``tau``, ``rho``),
        ``frac_angle_rho_tau_gt_60``, ``subspace_energy_<part>``, the baselines'
        energy fractions and median relative errors, ``dof`` and ``n_targets``.
        """
        # fields may be tensors (tensor input): the statistics are NumPy's
        m = to_host(self.eval_mask)
        out = {
            "cls": self.config["cls"],
            "n_tokens": int(np.sum(m)),
            "energy_fraction": self.energy_fraction,
        }
        per_token = [("relative_error", self.relative_error)]
        per_token += [(f"angle_{p}", getattr(self.angles, p)) for p in _PAIRS]
        per_token += [(f"cos_{p}", getattr(self.cosines, p)) for p in _PAIRS]
        per_token += [(f"projection_{p}", getattr(self.projections, p)) for p in _PARTS]
        for name, v in per_token:
            v = to_host(v)[m]
            out[f"mean_{name}"] = _finite_mean(v)
            out[f"median_{name}"] = _finite_median(v)
        a = to_host(self.angles.rho_tau)[m]
        a = a[np.isfinite(a)]
        out["frac_angle_rho_tau_gt_60"] = float(np.mean(a > 60.0)) if a.size else math.nan
        for p in _PARTS:
            out[f"subspace_energy_{p}"] = getattr(self.subspace_energies, p)
        for b in self.baselines:
            out[f"baseline_{b.kind}_energy_fraction"] = b.energy_fraction
            out[f"baseline_{b.kind}_median_relative_error"] = _finite_median(to_host(b.relative_error)[m])
        out["dof"] = self.dof
        out["n_targets"] = self.n_targets
        return out


_PAIRS = tuple(f.name for f in dataclasses.fields(TokenwisePairs))
_PARTS = tuple(f.name for f in dataclasses.fields(TokenwiseParts))


def _finite_mean(v):
    v = v[np.isfinite(v)]
    return float(np.mean(v)) if v.size else math.nan


def _finite_median(v):
    v = v[np.isfinite(v)]
    return float(np.median(v)) if v.size else math.nan


# ------------------------------------------------------------ neighborhoods


def _given_neighbors(n, k, neighbors):
    """Validated copies of precomputed neighbors: indices (N, k) int64 and distances or None."""
    if hasattr(neighbors, "shape"):  # an index array (a tensor's .indices is something else)
        idx, dist = neighbors, None
    else:
        dist = getattr(neighbors, "distances", None)
        idx = getattr(neighbors, "indices", neighbors)
    idx = to_host(idx)  # a KNNResult of tensors, or a tensor of indices, too
    if idx.ndim != 2 or idx.shape[0] != n or idx.dtype.kind not in "iu":
        raise ValueError(
            f"neighbors must be an integer array of shape (N, k) with N = {n} (or a "
            f"KNNResult), got {idx.dtype} array of shape {idx.shape} instead."
        )
    if idx.shape[1] < 1 or (idx.size and (idx.min() < 0 or idx.max() >= n)):
        raise ValueError(
            f"neighbors must hold at least one column of indices in [0, {n - 1}], got "
            f"shape {idx.shape} with range [{idx.min() if idx.size else 0}, "
            f"{idx.max() if idx.size else 0}] instead."
        )
    if k is not None and k != idx.shape[1]:
        raise ValueError(f"k must equal neighbors.shape[1] = {idx.shape[1]}, got {k} instead.")
    if dist is not None:
        dist = np.array(to_host(dist), dtype=np.float64)  # a copy: results never alias inputs
        if dist.shape != idx.shape:
            dist = None
        elif not (np.all(np.isfinite(dist)) and np.all(dist >= 0)):
            bad = int(np.sum(~np.isfinite(dist) | (dist < 0)))
            raise ValueError(
                f"neighbors.distances must be finite and non-negative, got {bad} NaN, infinite or "
                f"negative entries instead."
            )
    return np.array(idx, dtype=np.int64), dist


def _search_neighbors(X, e, k, metric, standardize, exclude_self):
    """Indices (N, k) and distances (N, k) from :func:`refgeo.knn`, in the units of X.

    The search runs on ``X * 2**-e`` (exact: a power of two), so that the squared
    distances of the engine neither overflow nor underflow; the distances are
    scaled back (the standardized and cosine metrics are scale-free).  Standardizing
    uses the column means and spreads of :func:`refgeo._tokenwise_fit.mean_and_spread`
    (sums that do not depend on the order of the rows).
    """
    from .rows import knn

    Z = X if e == 0 else np.ldexp(X, -e)
    if standardize:
        Z = _f64(Z)
        # reproducible means and spreads: the same bits for any order of the rows'
        # blocks, so that the Dask engine finds the same standardized rows
        mu, sd = _fit.mean_and_spread(Z)
        Z = _fit.standardized(Z, mu, sd)
    if metric == "cosine":
        Z = _fit.unit_rows(_f64(Z))
    return _fit.neighbors_in_units_of_x(knn(Z, k, exclude_self=exclude_self), e, metric, standardize)


def _resolve_weights(weights, idx, dist):
    n, k = idx.shape
    if weights is None or (isinstance(weights, str) and weights == "uniform"):
        return np.ones((n, k)), "uniform"
    if isinstance(weights, str):
        check_choice(weights, "weights", _WEIGHTS)
        if dist is None:
            raise ValueError(
                "weights must be 'uniform' when neighbors carry no distances, got 'gaussian' instead."
            )
        h = dist[:, -1:]
        with np.errstate(divide="ignore", invalid="ignore"):
            w = np.where(h > 0, np.exp(-0.5 * (dist / np.where(h > 0, h, 1.0)) ** 2), 1.0)
        return w / w.mean(axis=1, keepdims=True), "gaussian"
    weights, _ = from_foreign(weights, "weights", host=True)
    w = as_float_array(weights, "weights", ndim=2, shape_hint="2-D array of shape (N, k)")
    w = _f64(np.asarray(w))
    if w.shape != (n, k):
        raise ValueError(f"weights must have shape {(n, k)} (N, k), got shape {w.shape} instead.")
    if np.any(w < 0):
        raise ValueError(f"weights must be non-negative, got min {float(w.min()):.3g} instead.")
    # divide by the row maximum first: a row mean of weights near 1e308 overflows
    wmax = w.max(axis=1, keepdims=True)
    w = w / np.where(wmax > 0, wmax, 1.0)
    s = w.mean(axis=1, keepdims=True)
    if np.any(s <= 0):
        raise ValueError(
            f"weights must have a positive entry in every row, got {int(np.sum(s <= 0))} all-zero rows instead."
        )
    return w / s, "array"


# -------------------------------------------------------------- fit options


def _validate_fit_options(n, d, k, cls, rank, ridge, prior, metric, standardize, exclude_self, neighbors):
    check_choice(cls, "cls", CLASSES)
    check_choice(prior, "prior", _PRIORS)
    check_choice(metric, "metric", _METRICS)
    standardize = check_bool(standardize, "standardize")
    exclude_self = check_bool(exclude_self, "exclude_self")
    ridge = check_real(ridge, "ridge", min_value=0.0)
    if neighbors is None:
        if k is None:
            raise TypeError("k must be an integer (or pass neighbors=), got NoneType instead.")
        k = check_int(k, "k", min_value=1)  # a Python int: NumPy's small ints overflow in the sizes
        kmax = n - 1 if exclude_self else n
        if k > kmax:
            what = f"N - 1 = {kmax} (leave-one-out neighborhoods)" if exclude_self else f"N = {kmax}"
            raise ValueError(f"k == {k}, must be <= {what}.")
    elif k is not None:
        k = check_int(k, "k", min_value=1)
    if cls == "low_rank":
        if rank is None:
            raise ValueError("rank must be an integer in [1, d] for cls='low_rank', got None instead.")
        rank = check_int(rank, "rank", min_value=1, max_value=d)
    elif rank is not None:
        raise ValueError(f"rank must be None unless cls='low_rank', got rank={rank!r} with cls={cls!r} instead.")
    return k, rank, ridge, standardize, exclude_self


_dispatch_fit = _fit.fit_class


# ------------------------------------------------------------------ scaling
#
# The fits and metrics run on X * 2**-e and Y * 2**-e, with e chosen so that the
# largest entry lies in [1/2, 1).  A power of two scales exactly, so the results are
# exactly equivariant: fit(2**m X, 2**m Y) = 2**m fit(X, Y) bit for bit, for every m
# that keeps the entries normal numbers.  Without it, the squares in the Gram
# matrices overflow for entries near 1e160 and underflow near 1e-170.  The local
# problem scales as ||2**-e (y - A x)||^2 = 4**-e ||y - A x||^2, so the ridge that
# gives the same maps is lam * 4**-e.


# A scaled ridge above 2**600 (the data are below 1) is infinite in effect: the fit
# equals the prior to far below float64 resolution of the data.  Capping it keeps
# inf / inf = NaN out of the closed forms.
_MAX_SCALED_RIDGE = 2.0**600


def _scale_exponent(*arrays) -> int:
    """The ``e`` with ``max |a| * 2**-e`` in [1/2, 1) over all arrays (0 when all are zero)."""
    return _fit.exponent_of(max(_max_abs(a) for a in arrays))


_scaled64 = _fit.scaled64
_panels64 = _fit.panels64


# rows per block of the blockwise scaled passes over (N, d) panels: O(8192 d) temporaries
_ROWS = 8192


def _rows(A, ex, s, t):
    """Rows ``s:t`` of ``A * 2**-ex`` (a scaled copy, or a view when ``ex == 0``)."""
    return A[s:t] if ex == 0 else np.ldexp(A[s:t], -ex)


def _max_abs(a) -> float:
    """``max |a|`` without an ``|a|`` temporary (0 for an empty array)."""
    return max(float(a.max()), -float(a.min())) if a.size else 0.0


def _fits_after_scaling(m, e) -> bool:
    """Whether ``m * 2**e`` (``m`` a scaled magnitude) is a finite float64."""
    return m == 0 or math.frexp(m)[1] + e <= 1024


def _check_update_range(X64, Y64, ex, e):
    """``ValueError`` unless ``Y - X`` is representable (the panels are scaled by ``2**-e``).

    The scaled entries are below 1, so ``|y - x| < 2**(e + 1)``: only ``e == 1024``
    (entries of at least 2**1023, about 9e307) can overflow, and only then are the
    differences taken, a block of rows at a time.
    """
    if e < 1024:
        return
    m = 0.0
    for s in range(0, X64.shape[0], _ROWS):
        t = min(X64.shape[0], s + _ROWS)
        m = max(m, _max_abs(_rows(Y64, ex, s, t) - _rows(X64, ex, s, t)))
    if not _fits_after_scaling(m, e):
        raise ValueError(
            f"Y - X must lie in the float64 range, got |y - x| up to about 2**{math.frexp(m)[1] + e - 1:.0f} "
            f"instead (entries near the float64 maximum with opposite signs); scale X and Y down by the "
            f"same power of two: the decomposition scales exactly."
        )


# X and Y share one power-of-two scaling, and the fits square both panels (Gram
# matrices, kernel forms, eigenproblems): the smaller one may be at most this many
# binary orders of magnitude below the other before its squares leave the normal range
# (the full fit returned NaN at 2**510, the diagonal one the identity at 2**664).
_MAX_SIZE_GAP = 500


def _check_relative_size(mx, my):
    """``ValueError`` unless ``mx`` and ``my``, the largest entries of X and Y, are within
    ``2**500`` (an all-zero panel has no size and passes)."""
    if mx == 0.0 or my == 0.0:
        return
    gap = math.frexp(my)[1] - math.frexp(mx)[1]
    if abs(gap) > _MAX_SIZE_GAP:
        raise ValueError(
            f"X and Y must have entries within a factor 2**{_MAX_SIZE_GAP} of each other in size, got "
            f"largest entries {mx:.3g} and {my:.3g} (Y about 2**{gap} times X) instead: the fits square "
            "both panels scaled by one power of two, and the smaller one underflows; rescale X or Y "
            "first (a linear map scales with the ratio)."
        )


def _range_error(what, m, e):
    return ValueError(
        f"X and Y must be smaller for the result to be a float64 number, got {what} of about "
        f"2**{math.frexp(m)[1] + e - 1:.0f} instead; scale X and Y down by the same power of two (fitted "
        f"values, delta, tau, rho and the singular values scale exactly, every other metric is unchanged)."
    )


def _scaled_ridge(ridge, e):
    """The ridge of the scaled problem, ``ridge * 4**-e`` (capped, see above)."""
    if ridge == 0:
        return ridge
    # the cap applies without scaling too (e == 0): a ridge near the float64 maximum
    # overflows lam * d in the closed forms
    if math.frexp(ridge)[1] - 2 * e > 600:
        return _MAX_SCALED_RIDGE
    return math.ldexp(ridge, -2 * e)


# ---------------------------------------------------------------- local fits


@dataclasses.dataclass(slots=True)
class _FitPlan:
    """The validated options of one local fit, resolved before any work starts."""

    cls: str
    k: int
    rank: int | None
    ridge: float
    prior: str
    metric: str
    standardize: bool
    exclude_self: bool
    weights: Any
    given: tuple | None  # (indices, distances) of given neighbors, else None
    chunk: int
    return_maps: bool
    n_chunks: int

    @property
    def n_steps(self) -> int:
        """Progress steps: the neighbor search, then one per chunk (two for diagonal fits)."""
        return int(self.given is None) + (2 if self.cls in ("diagonal", "psd_diagonal") else 1) * self.n_chunks


def _plan_fit(X, k, cls, rank, ridge, prior, metric, standardize, exclude_self, weights, neighbors,
              chunk_size, return_maps):
    n, d = X.shape
    k, rank, ridge, standardize, exclude_self = _validate_fit_options(
        n, d, k, cls, rank, ridge, prior, metric, standardize, exclude_self, neighbors
    )
    chunk_size = check_int(chunk_size, "chunk_size", min_value=1, allow_none=True)
    return_maps = check_bool(return_maps, "return_maps")
    given = None if neighbors is None else _given_neighbors(n, k, neighbors)
    if given is not None:
        k = given[0].shape[1]
    chunk = min(chunk_size or _fit.default_chunk(k, d, n, cls in ("diagonal", "psd_diagonal")), n)
    return _FitPlan(cls, int(k), rank, ridge, prior, metric, standardize, exclude_self, weights, given,
                    int(chunk), return_maps, -(-n // chunk))


def _fit_bytes(plan, n, d, copies):
    """Bytes one local fit allocates, by part (an upper estimate; see :func:`_check_fit_memory`)."""
    f, b, k = 8, plan.chunk, plan.k
    diagonal = plan.cls in ("diagonal", "psd_diagonal")
    parts = {
        "fitted values (N, d), neighbors, distances and weights (N, k)": f * (n * d + 3 * n * k),
    }
    if diagonal:
        parts["coefficients (N, d)"] = f * n * d
    if plan.return_maps:
        parts["maps (N, d, d), return_maps=True"] = f * n * d * d
    if copies:
        parts[f"{copies} scaled float64 copies of (N, d)"] = copies * f * n * d
    if plan.given is None:
        parts["neighbor search (two (N, d) copies)"] = 2 * f * n * d
    label, panel = _fit.panel_bytes(plan.cls, n, d, k, b, plan.return_maps)
    parts[label] = panel
    return parts


def _check_fit_memory(what, parts, plan):
    advice = (
        f"Pass a smaller chunk_size (now {plan.chunk}; the panels grow as chunk_size * k * max(d, k)) "
        f"or a smaller k (now {plan.k})"
        + (", leave return_maps=False" if plan.return_maps else "")
        + ", or pass fewer tokens per call."
    )
    _memory.check_memory(what, parts, advice)


def _run_fit(plan, X, X64, Y64, ex, e, bar):
    """The fit of the scaled panels ``(X, Y) * 2**-e``; the fitted values stay scaled.

    ``X64 * 2**-ex`` and ``Y64 * 2**-ex`` are those panels (see :func:`_panels64`).

    Returns ``(fitted, coefficients, maps, indices, distances, weights, weights_kind)``.
    """
    n, d = X.shape
    if plan.given is None:
        idx, dist = _search_neighbors(X, e, plan.k, plan.metric, plan.standardize, plan.exclude_self)
        bar.advance()
    else:
        idx, dist = plan.given
    w, wkind = _resolve_weights(plan.weights, idx, dist)
    dof = _degrees_of_freedom(plan.cls, d, plan.rank)
    _warn_underdetermined(plan.cls, dof, plan.k, d, plan.ridge)
    ident = plan.prior == "identity"
    with blas_single_thread():  # many small batched GEMMs / eigh: threads only spin
        fitted, coef, maps = _dispatch_fit(X64, Y64, ex, idx, w, plan.cls, plan.rank,
                                           _scaled_ridge(plan.ridge, e), ident, plan.chunk, plan.return_maps,
                                           bar.advance)
    return fitted, coef, maps, idx, dist, w, wkind


def _fit_config(plan, X, wkind):
    given = plan.given is not None
    return {
        "cls": plan.cls,
        "k": int(plan.k),
        "rank": plan.rank,
        "ridge": plan.ridge,
        "prior": plan.prior,
        "metric": None if given else plan.metric,
        "standardize": None if given else plan.standardize,
        "exclude_self": None if given else plan.exclude_self,
        "weights": wkind,
        "neighbors": "given" if given else "refgeo.knn",
        "chunk_size": int(plan.chunk),
        "dtype": str(X.dtype),
        "n_tokens": int(X.shape[0]),
        "d": int(X.shape[1]),
    }


def _n_copies(X, Y):
    """How many (N, d) float64 arrays conversion allocates for X and Y (see :func:`_panels64`)."""
    return 0 if X.dtype == np.float64 and Y.dtype == np.float64 else 2


@_backend.dask_graphs_unfused
def fit_local_maps(
    X: Any,
    Y: Any,
    /,
    *,
    k: int | None = None,
    cls: str,
    rank: int | None = None,
    ridge: float = 0.0,
    prior: str = "identity",
    metric: str = "euclidean",
    standardize: bool = False,
    exclude_self: bool = True,
    weights: Any = None,
    neighbors: Any = None,
    chunk_size: int | None = None,
    return_maps: bool = False,
    progress: Any = False,
) -> LocalFit:
    r"""Fit a map :math:`A_i` of a restricted class on the k nearest neighbors of each token.

    Parameters
    ----------
    X, Y : array_like of shape (N, d)
        Hidden states before (:math:`h_l`) and after (:math:`h_{l+1}`) the layer; finite,
        float32 or float64 (fits run in float64); torch tensors too (module
        docstring, "Tensors"), and Dask arrays chunked along the tokens, which run
        on the active Dask scheduler, one fit task per row chunk (module docstring,
        "Dask"; docs/cluster.md).
    k : int
        Number of neighbors, ``1 <= k <= N - 1`` (``<= N`` without exclusion).  May be
        omitted when ``neighbors`` is given.
    cls : {"diagonal", "psd_diagonal", "low_rank", "orthogonal", "scaled_orthogonal", "full"}
        The function class (see Notes).
    rank : int, default=None
        Rank ``r`` of :math:`A - A_0` for ``cls="low_rank"``, ``1 <= r <= d``.
    ridge : float, default=0.0
        :math:`\lambda \ge 0` in the penalty :math:`\lambda \lVert A - A_0\rVert_F^2`.
    prior : {"identity", "zero"}, default="identity"
        :math:`A_0`.  With ``"identity"`` the low-rank class is
        :math:`A = I + B C^T` (a rank-r update on the residual stream).
    metric : {"euclidean", "cosine"}, default="euclidean"
        Neighbor metric (cosine: Euclidean on the normalized rows).
    standardize : bool, default=False
        Standardize the coordinates (zero mean, unit variance) for the neighbor
        search only.
    exclude_self : bool, default=True
        Leave-one-out neighborhoods.  Without exclusion ``x_i`` is its own nearest
        neighbor, and with ``k = 1`` and the full class the residual vanishes
        identically: the degeneracy that docs/theory/tokenwise.md warns about.  Exclusion removes token
        ``i`` only, not other tokens with the same hidden state: exact duplicates
        (e.g. repeated BOS positions) are each other's neighbors at distance 0 and
        can fit one another exactly, the same degeneracy.
    weights : {None, "uniform", "gaussian"} or array_like of shape (N, k), default=None
        Neighbor weights :math:`w_{ij}`, normalized to mean 1 per token.
        ``"gaussian"``: :math:`\exp(-\tfrac12 (\delta_{ij}/\delta_{ik})^2)` with
        :math:`\delta_{ik}` the distance to the k-th neighbor.
    neighbors : KNNResult or array_like of int of shape (N, k), default=None
        Precomputed neighborhoods (e.g. shared across classes), used as given (a
        token listed as its own neighbor stays in its panel); ``metric``,
        ``standardize`` and ``exclude_self`` then do not apply and are recorded as
        None in ``config``.  Otherwise :func:`refgeo.knn` is called.
    chunk_size : int, default=None
        Tokens per chunk (gathered neighbor panel); the default keeps a
        (chunk, k, max(d, 4k)) float64 panel near 48 MiB, and for the diagonal
        classes, which gather no panels, a (chunk, max(d, k)) block.  Progress
        reports and interrupts land between chunks.  The result does not depend on
        it (bit for bit for the diagonal classes, to rounding for the others).
    return_maps : bool, default=False
        Also return every :math:`A_i` (memory N d^2; for small problems and tests).
    progress : bool or callable, default=False
        ``True`` shows a tqdm bar (when tqdm is installed; otherwise it warns once);
        a callable receives ``{"done", "total", "elapsed", "eta"}`` dicts, from the
        calling thread, between chunks, at most about four times a second.  The
        steps are the neighbor search (when it runs) and the chunks of tokens.

    Returns
    -------
    fit : LocalFit
        Its arrays are tensors on the input's device when ``X`` or ``Y`` is a tensor.
        For Dask input ``fitted``, ``coefficients`` and ``maps`` are Dask arrays
        chunked like ``X`` (persisted on the workers), the (N, k) arrays NumPy; the
        values are the single-machine ones bit for bit, for every chunking.

    Raises
    ------
    ValueError
        Mismatched shapes, non-finite states, ``k`` out of range, ``rank > d``,
        fitted values beyond the float64 range (about 1.8e308), or X and Y whose
        largest entries are more than ``2**500`` apart (their common scaling would
        underflow the smaller panel's squares).
    MemoryError
        Before any work, when the outputs and working memory (from N, d, k, the
        class, ``chunk_size`` and ``return_maps``) exceed the available memory; the
        message names the sizes and what to change.
    KeyboardInterrupt
        An interrupt stops the fit at the next chunk (nothing is returned).

    Warns
    -----
    UserWarning
        When ``k`` neighbors cannot identify a map of the class (``k < d`` for full
        and low rank, ``k < d - 1`` for orthogonal); the message states the degrees
        of freedom.

    Notes
    -----
    .. math::

        A_i = \operatorname*{arg\,min}_{A \in \mathcal{C}}
              \sum_{j \in N_k(i)} w_{ij} \lVert y_j - A x_j\rVert^2
              + \lambda \lVert A - A_0\rVert_F^2

    Closed forms, all vectorized over tokens:

    * diagonal: :math:`a_c = (\sum_j w_{ij} x_{jc} y_{jc} + \lambda a_{0c}) /
      (\sum_j w_{ij} x_{jc}^2 + \lambda)` (a sparse-matrix product, O(N k d));
      ``psd_diagonal`` clips at 0, the exact constrained minimizer per coordinate;
    * full: ridge in kernel form, :math:`D = A - A_0`,
      :math:`D^T = \tilde X^T (K + \lambda I)^{+} \tilde R` with
      :math:`K = \tilde X \tilde X^T` (k x k), minimum-norm for :math:`\lambda = 0`;
    * low_rank: ridge reduced-rank regression of the targets
      :math:`r_j = y_j - A_0 x_j` (rank of :math:`D` at most r), through a k x k
      eigenproblem;
    * orthogonal: weighted Procrustes :math:`Q = \operatorname{polar}(\sum_j w_{ij}
      y_j x_j^T + \lambda A_0)` reduced exactly to the span of the 2k neighbor
      vectors; the identity on its complement (ties broken towards the identity);
      ``scaled_orthogonal`` adds :math:`s = \operatorname{tr}(Q^T M_\lambda)/
      (\sum_j w_{ij}\lVert x_j\rVert^2 + \lambda d)`.

    Time O(N k d) (diagonal), O(N k^2 d + N k^3) (full, low rank, orthogonal), plus
    the k-NN search; extra memory O(chunk k max(k, d) + N d), never N k d.
    Numerical guarantee: float64 closed forms.  The full and low-rank fits solve a
    neighbor panel from its k x k Gram matrix where the panel's eigenvalues there stay
    above 1e-7 of the largest (the Gram form squares the condition number: its error
    stays below about 1e-6 of the targets), and from the panel's SVD elsewhere (states
    with a large common component: the Gram form dropped every direction but the
    common one); singular values below ``100 max(k, d) eps`` relative are treated as
    zero, with or without ridge.  Whole float range: the fit runs on
    ``X 2^{-e}, Y 2^{-e}`` (exact; rows are scaled as they are gathered, no copy),
    with ``e`` putting the largest entry in [1/2, 1) and the ridge scaled by
    ``4^{-e}``, so entries from about 1e-300 to 1e300 fit alike and
    ``fit(2^m X, 2^m Y, ridge=4^m lam)`` is ``2^m fit(X, Y, ridge=lam)`` bit for bit.
    A neighbor panel more than ``2^300`` from that scaling is then scaled by a power
    of two of its own (from its rows of nonzero weight; the ridge by its square), so
    a cluster of tokens far below the rest (``2^-600`` times their size) is fitted as
    if it were alone.  What scaling cannot help: entries more than about
    2^1000 below the largest one lose their low bits (they are negligible against
    it); the diagonal classes fit each coordinate on its own, from sums of squares of
    its entries, so a coordinate whose entries are more than about ``2^510`` below the
    largest entry of their panel loses precision (its squares are subnormal) and
    beyond about ``2^540`` takes the prior (its squares are zero); the neighbor
    search has the engine's absolute floor (:mod:`refgeo.rows`): distances below about
    ``2^-511`` times the largest entry of X are resolved only to about ``sqrt(d)
    2^-537`` times it, so within a cluster that far below the rest the neighbors are
    ties, broken by the smaller index (pass ``neighbors`` found on the cluster alone);
    and a ridge above ``2^600``
    times the squared largest entry acts as an infinite one; results beyond the float64
    maximum (about 1.8e308) raise a ``ValueError``.  Invariances: a global
    rotation of X and Y (not for the diagonal classes), a common scaling of X and Y
    (every class without ridge), token permutations (when no neighbor distances
    tie: :func:`knn` breaks ties by the smaller index, so a permutation can change
    which of two equidistant tokens is a neighbor).

    References
    ----------
    .. [1] Tokenwise decomposition of layer updates, arXiv:2604.02459.
    .. [2] A. Mukherjee and J. Zhu, Reduced rank ridge regression and its kernel
       extensions, Stat. Anal. Data Min. 4 (2011).

    Examples
    --------
    >>> import numpy as np, refgeo
    >>> X = np.array([[1.0, 2.0], [2.0, 1.0], [3.0, 5.0], [4.0, 3.0]])
    >>> fit = refgeo.fit_local_maps(X, 2.0 * X, k=2, cls="diagonal")
    >>> fit.coefficients.tolist()
    [[2.0, 2.0], [2.0, 2.0], [2.0, 2.0], [2.0, 2.0]]
    """
    if _any_dask(X, Y):
        return _fit_local_maps_dask(X, Y, k, cls, rank, ridge, prior, metric, standardize, exclude_self, weights,
                                    neighbors, chunk_size, return_maps, progress)
    X, Y, origin = _foreign_panels(X, Y)
    n, d = X.shape
    plan = _plan_fit(X, k, cls, rank, ridge, prior, metric, standardize, exclude_self, weights, neighbors,
                     chunk_size, return_maps)
    progress = _progress.check_progress(progress)
    sizes = _max_abs(X), _max_abs(Y)
    _check_relative_size(*sizes)
    e = _fit.exponent_of(max(sizes))
    _check_fit_memory(f"fit_local_maps(N={n}, d={d}, k={plan.k}, cls={plan.cls!r})",
                      _fit_bytes(plan, n, d, _n_copies(X, Y)), plan)
    X64, Y64, ex = _panels64(X, Y, e)
    with _progress.Progress(progress, plan.n_steps, desc="fit_local_maps", unit="chunk") as bar:
        fitted, coef, maps, idx, dist, w, wkind = _run_fit(plan, X, X64, Y64, ex, e, bar)
    del X64, Y64
    if e:
        if e > 0 and not _fits_after_scaling(_max_abs(fitted), e):
            raise _range_error("|A_i x_i|", _max_abs(fitted), e)
        np.ldexp(fitted, e, out=fitted)  # the maps and coefficients are scale-free
    return fields_to_caller(LocalFit(
        fitted=_ro(fitted),
        neighbors=_ro(idx),
        distances=_ro(dist),
        weights=_ro(w),
        coefficients=_ro(coef),
        maps=_ro(maps),
        dof=int(_degrees_of_freedom(plan.cls, d, plan.rank)),
        n_targets=int(plan.k * d),
        config=_fit_config(plan, X, wkind),
    ), origin)


# ---------------------------------------------------------------- Dask input
#
# Dask arrays of hidden states run on the task graphs of refgeo._dask_tokenwise
# (imported, with Dask, only when a Dask array arrives); the options are validated
# here exactly as for NumPy input, and the records are the same classes.


def _any_dask(*arrays) -> bool:
    from array_api_compat import is_dask_array

    return any(is_dask_array(a) for a in arrays)


def _dask_panels(X, Y):
    """Validated Dask panels (whole rows per chunk, the same row chunks) of X and Y.

    Their entries are not read: :func:`_check_dask_finite` does that, after the memory
    check (a pass over all the data is work).
    """
    from . import _dask_tokenwise as _dt

    X, _ = from_foreign(X, "X", host=True)
    Y, _ = from_foreign(Y, "Y", host=True)
    _dt.check_known_chunks(X, "X")
    _dt.check_known_chunks(Y, "Y")
    X = as_float_array(X, "X", ndim=2, shape_hint="2-D array of shape (N, d)", finite=False)
    Y = as_float_array(Y, "Y", ndim=2, shape_hint="2-D array of shape (N, d)", finite=False)
    check_same_shape(X, Y, ("X", "Y"))
    check_min_rows(X, "X", 2, "(N, d)")
    return _dt.panels(X, Y)


def _check_dask_finite(X, Y):
    """``ValueError`` for NaN or infinite entries of the Dask panels (one pass each)."""
    check_finite(X, "X")
    check_finite(Y, "Y")


def _dask_weights(weights):
    """(N, k) weights given as a Dask array come to the caller, as the neighbors do."""
    if _any_dask(weights):
        weights, _ = from_foreign(weights, "weights", host=True)
        return np.asarray(weights.compute())
    return weights


def _dask_unsupported(name, value, why):
    return NotImplementedError(
        f"{name}={value!r} is not supported for Dask arrays ({why}); call .compute() on X and Y first "
        f"to run it in this process."
    )


def _check_dask_memory(what, plan, X, Y, metrics):
    """:func:`_check_fit_memory` for Dask panels: what comes to the caller (the (N, k)
    neighbors, distances and weights, and the (N,) metrics of :func:`decompose`) against
    this process's memory, each task and the kept results against the workers' (all of
    it against this process's where the tasks run here: Dask's local schedulers, or
    in-process workers)."""
    from . import _dask_tokenwise as _dt

    n, k = X.shape[0], plan.k
    parts = {"neighbors, distances and weights (N, k)": 24 * n * k}
    if metrics:
        parts["per-token metrics (about 24 (N,) arrays)"] = 24 * 8 * n
    _memory.check_memory(what, parts, "Pass a smaller k, or pass fewer tokens per call.")
    _dt.check_fit_memory(what, X, Y, k, plan.cls, plan.chunk, plan.return_maps, parts, metrics)


def _run_fit_dask(plan, X, Y, e, bar):
    """:func:`_run_fit` on Dask panels: the fitted values stay scaled (persisted)."""
    from . import _dask_tokenwise as _dt

    d = X.shape[1]
    if plan.given is None:
        idx, dist = _dt.search_neighbors(X, e, plan.k, plan.metric, plan.standardize, plan.exclude_self)
        bar.advance()
    else:
        idx, dist = plan.given
    w, wkind = _resolve_weights(_dask_weights(plan.weights), idx, dist)
    dof = _degrees_of_freedom(plan.cls, d, plan.rank)
    _warn_underdetermined(plan.cls, dof, plan.k, d, plan.ridge)
    fitted, coef, maps = _dt.fit(X, Y, e, idx, w, plan.cls, plan.rank, _scaled_ridge(plan.ridge, e),
                                 plan.prior == "identity", plan.chunk, plan.return_maps)
    bar.advance()
    return fitted, coef, maps, idx, dist, w, wkind


def _fit_local_maps_dask(X, Y, k, cls, rank, ridge, prior, metric, standardize, exclude_self, weights, neighbors,
                         chunk_size, return_maps, progress):
    from . import _dask_tokenwise as _dt

    X, Y = _dask_panels(X, Y)
    n, d = X.shape
    plan = _plan_fit(X, k, cls, rank, ridge, prior, metric, standardize, exclude_self, weights, neighbors,
                     chunk_size, return_maps)
    progress = _progress.check_progress(progress)
    _check_dask_memory(f"fit_local_maps(N={n}, d={d}, k={plan.k}, cls={plan.cls!r})", plan, X, Y, False)
    _check_dask_finite(X, Y)
    sizes = _dt.max_abs_each(X, Y)
    _check_relative_size(*sizes)
    e = _fit.exponent_of(max(sizes))
    # steps: the neighbor search (when it runs) and the fit
    with _progress.Progress(progress, int(plan.given is None) + 1, desc="fit_local_maps", unit="step") as bar:
        fitted, coef, maps, idx, dist, w, wkind = _run_fit_dask(plan, X, Y, e, bar)
    if e > 0:
        m = _dt.max_abs(fitted)
        if not _fits_after_scaling(m, e):
            raise _range_error("|A_i x_i|", m, e)
    config = _fit_config(plan, X, wkind)
    return LocalFit(
        fitted=_dt.unscaled(fitted, e),
        neighbors=_ro(idx),
        distances=_ro(dist),
        weights=_ro(w),
        coefficients=coef,
        maps=maps,
        dof=int(_degrees_of_freedom(plan.cls, d, plan.rank)),
        n_targets=int(plan.k * d),
        config=config,
    )


def _decompose_options(d, subspace_rank, center_subspace, baselines, progress):
    """The validated subspace, baseline and progress options of :func:`decompose`."""
    if subspace_rank is None:
        subspace_rank = min(8, d)
    subspace_rank = check_int(subspace_rank, "subspace_rank", min_value=1, max_value=d)
    center_subspace = check_bool(center_subspace, "center_subspace")
    baselines = check_bool(baselines, "baselines")
    return subspace_rank, center_subspace, baselines, _progress.check_progress(progress)


def _decompose_dask(X, Y, k, cls, rank, ridge, prior, metric, standardize, exclude_self, weights, neighbors,
                    subspace_rank, center_subspace, mlp_options, baselines, chunk_size, layer, progress):
    from . import _dask_tokenwise as _dt

    check_choice(cls, "cls", CLASSES + ("mlp",))
    if cls == "mlp":
        raise _dask_unsupported("cls", cls, "the MLP trains on all tokens at once in one process")
    # unused, but a wrong kind of value is still a mistake of the call (as for NumPy input)
    _check_mlp_options(None, **{**_MLP_DEFAULTS, **_mlp_options_dict(mlp_options)})
    X, Y = _dask_panels(X, Y)
    n, d = X.shape
    subspace_rank, center_subspace, baselines, progress = _decompose_options(
        d, subspace_rank, center_subspace, baselines, progress)
    plan = _plan_fit(X, k, cls, rank, ridge, prior, metric, standardize, exclude_self, weights, neighbors,
                     chunk_size, False)
    ridge = plan.ridge
    _check_dask_memory(f"decompose(N={n}, d={d}, cls={plan.cls!r})", plan, X, Y, True)
    _check_dask_finite(X, Y)
    sizes = _dt.max_abs_each(X, Y)
    _check_relative_size(*sizes)
    e = _fit.exponent_of(max(sizes))
    if e >= 1024:  # as _check_update_range: only entries near the float64 maximum can overflow
        m = _dt.update_max(X, Y, e)
        if not _fits_after_scaling(m, e):
            raise ValueError(
                f"Y - X must lie in the float64 range, got |y - x| up to about 2**{math.frexp(m)[1] + e - 1:.0f} "
                f"instead (entries near the float64 maximum with opposite signs); scale X and Y down by the "
                f"same power of two: the decomposition scales exactly."
            )
    n_steps = int(plan.given is None) + 2
    with _progress.Progress(progress, n_steps, desc="decompose", unit="step") as bar:
        fitted, coef, _, nbr, _, _, wkind = _run_fit_dask(plan, X, Y, e, bar)
        identity = plan.prior == "identity"
        f = _dt.metrics(X, Y, fitted, e, subspace_rank, center_subspace, baselines, _scaled_ridge(ridge, e),
                        identity)
        bar.advance()
    eval_mask = np.ones(n, dtype=bool)
    rec = f["record"]
    # the same checks as for NumPy input (see decompose): entries only when a row norm
    # could leave the range
    if e > 0:
        if not _fits_after_scaling(_fit.largest_norm(rec), e):
            for name, m in zip(("delta", "tau", "rho"), _dt.parts_max_abs(X, Y, fitted, e)):
                if not _fits_after_scaling(m, e):
                    raise _range_error(f"|{name}|", m, e)
        m = _max_abs(f["singular_values"])
        if not _fits_after_scaling(m, e):
            raise _range_error("the largest singular value of [tau_1 ... tau_N]", m, e)
    delta, tau, rho = _dt.parts(X, Y, fitted, e)
    fits = [_baseline(kind, AT, r, rec, eval_mask)
            for kind, AT, r in zip(("linear", "procrustes"), f["baseline_maps"], f["baseline_residuals"])]
    config = _fit_config(plan, X, wkind)
    config["mlp"] = None
    config.update(subspace_rank=subspace_rank, center_subspace=center_subspace, baselines=baselines, layer=layer)
    sv = f["singular_values"]
    return TokenwiseResult(
        delta=delta, tau=tau, rho=rho, **_token_fields(rec, f["projections"], eval_mask),
        subspace=_ro(f["subspace"]), subspace_singular_values=_ro(np.ldexp(sv, e) if e else sv),
        dof=int(_degrees_of_freedom(plan.cls, d, plan.rank)), n_targets=int(plan.k * d), neighbors=_ro(nbr),
        eval_mask=_ro(eval_mask), coefficients=coef, baselines=tuple(fits), config=config,
    )


# ----------------------------------------------------------------------- MLP


def fit_tokenwise_mlp(
    X: Any,
    Y: Any,
    /,
    *,
    hidden: int = 64,
    activation: str = "gelu",
    train_fraction: float = 0.8,
    epochs: int = 200,
    learning_rate: float = 1e-3,
    batch_size: int | None = None,
    weight_decay: float = 0.0,
    seed: int = 0,
    progress: Any = False,
) -> MLPFit:
    r"""Train a shallow residual MLP :math:`T(x) = x + W_2\,\phi(W_1 x + b_1) + b_2` in NumPy.

    Parameters
    ----------
    X, Y : array_like of shape (N, d)
        Hidden states before and after the layer (finite; torch tensors too).
    hidden : int, default=64
        Hidden width ``h``.
    activation : {"gelu", "relu", "tanh"}, default="gelu"
    train_fraction : float, default=0.8
        Fraction of tokens (seeded random split) used for training; the rest are held
        out.  Must leave at least one token on each side.
    epochs : int, default=200
    learning_rate : float, default=1e-3
        Adam step size (betas 0.9, 0.999).
    batch_size : int, default=None
        Minibatch size; None trains full-batch.
    weight_decay : float, default=0.0
        L2 penalty on ``W1`` and ``W2`` added to the gradient.
    seed : int, default=0
        Seeds the split, the initialization and the minibatch order.
    progress : bool or callable, default=False
        As in :func:`fit_local_maps`, one step per epoch.

    Returns
    -------
    fit : MLPFit
        Use ``fit.predict(X)`` for :math:`T(X)`; ``fit.test_index`` are the held-out
        tokens.

    Notes
    -----
    .. math:: \min_\theta \frac{1}{|S| d} \sum_{i \in S}
              \lVert \mathrm{MLP}_\theta(\hat x_i) - \hat\Delta_i \rVert^2

    on the training set S, with :math:`\hat x = (x - \bar x)/s_x` and
    :math:`\hat\Delta = (y - x)/s_\Delta` (RMS scales of the training tokens).  Time
    O(epochs N d h); memory O(N (d + h)).  Deterministic for a given seed and BLAS.
    Unlike the local fits this is one global map, evaluated on held-out tokens.

    References
    ----------
    .. [1] Tokenwise decomposition of layer updates, arXiv:2604.02459.

    Examples
    --------
    >>> import numpy as np, refgeo
    >>> X = np.random.default_rng(0).standard_normal((50, 3))
    >>> fit = refgeo.fit_tokenwise_mlp(X, X, hidden=4, epochs=2, seed=0)
    >>> fit.n_parameters, len(fit.train_index), len(fit.test_index)
    (31, 40, 10)
    """
    X, Y, _ = _foreign_panels(X, Y)
    progress = _progress.check_progress(progress)
    opts = _check_mlp_options(X.shape[0], hidden, activation, train_fraction, epochs, learning_rate,
                              batch_size, weight_decay, seed)
    with _progress.Progress(progress, opts[3], desc="fit_tokenwise_mlp", unit="epoch") as bar:
        hidden, activation, tf, epochs, lr, batch_size, wd, seed = opts
        return _fit_mlp(X, Y, hidden, activation, tf, epochs, lr, batch_size, wd, seed, tick=bar.advance)


def _mlp_options_dict(mlp_options) -> dict:
    """``mlp_options`` as a dict of keywords of :func:`fit_tokenwise_mlp` (None: empty)."""
    if mlp_options is not None and not isinstance(mlp_options, Mapping):
        raise TypeError(
            f"mlp_options must be a mapping of keywords of fit_tokenwise_mlp, got "
            f"{type(mlp_options).__name__} instead."
        )
    opts = dict(mlp_options or {})
    bad = sorted(set(opts) - set(_MLP_DEFAULTS))
    if bad:
        raise TypeError(f"mlp_options must hold keywords of fit_tokenwise_mlp, got unknown {bad} instead.")
    return opts


def _check_mlp_options(n, hidden, activation, train_fraction, epochs, learning_rate, batch_size, weight_decay,
                       seed):
    """The validated MLP options, in the order of :func:`_fit_mlp` (before any report or
    work); ``n`` None (options another class does not use) skips the check of
    ``train_fraction`` against the number of tokens."""
    hidden = check_int(hidden, "hidden", min_value=1)
    check_choice(activation, "activation", _ACTIVATIONS)
    tf = check_real(train_fraction, "train_fraction", min_value=0.0, strict=True)
    epochs = check_int(epochs, "epochs", min_value=1)
    lr = check_real(learning_rate, "learning_rate", min_value=0.0, strict=True)
    batch_size = check_int(batch_size, "batch_size", min_value=1, allow_none=True)
    wd = check_real(weight_decay, "weight_decay", min_value=0.0)
    seed = check_int(seed, "seed", min_value=0)
    n_train = None if n is None else int(round(tf * n))
    if n_train is not None and not 1 <= n_train <= n - 1:
        raise ValueError(
            f"train_fraction must leave at least one training and one held-out token, got "
            f"{tf} of N = {n} tokens ({n_train} for training) instead."
        )
    return hidden, activation, tf, epochs, lr, batch_size, wd, seed


def _fit_mlp(X, Y, hidden, activation, train_fraction, epochs, learning_rate, batch_size, weight_decay, seed,
             tick=None):
    n, d = X.shape
    hidden, activation, tf, epochs, lr, batch_size, wd, seed = _check_mlp_options(
        n, hidden, activation, train_fraction, epochs, learning_rate, batch_size, weight_decay, seed
    )
    n_train = int(round(tf * n))
    rng = np.random.default_rng(seed)
    perm = rng.permutation(n)
    tr, te = np.sort(perm[:n_train]), np.sort(perm[n_train:])
    # the standardization constants come from the exactly rescaled panels (their mean
    # squares would overflow for entries near 1e160) and are scaled back when stored
    X, Y = np.asarray(X), np.asarray(Y)
    e = _scale_exponent(X, Y)
    X64, Y64 = _scaled64(X, e), _scaled64(Y, e)
    _check_update_range(X64, Y64, 0, e)
    D = Y64 - X64
    mu = X64[tr].mean(axis=0)
    sx = float(np.sqrt(np.mean((X64[tr] - mu) ** 2))) or 1.0
    sd = float(np.sqrt(np.mean(D[tr] ** 2))) or 1.0
    Xs = (X64 - mu) / sx
    T = D / sd
    del X64, Y64, D
    if not (_fits_after_scaling(sx, e) and _fits_after_scaling(sd, e)):
        raise _range_error("the RMS spread of the training tokens", max(sx, sd), e)
    mu, sx, sd = np.ldexp(mu, e), math.ldexp(sx, e), math.ldexp(sd, e)
    params, h_tr, h_te = _fit.train_mlp(
        Xs[tr], T[tr], hidden, activation, epochs, lr, batch_size, wd, rng, Xs[te], T[te], tick
    )
    W1, b1, W2, b2 = params
    return MLPFit(
        W1=_ro(W1), b1=_ro(b1), W2=_ro(W2), b2=_ro(b2), x_mean=_ro(mu), x_scale=sx, delta_scale=sd,
        train_index=_ro(tr), test_index=_ro(te), train_loss=_ro(h_tr), test_loss=_ro(h_te),
        n_parameters=int(W1.size + b1.size + W2.size + b2.size),
        config={
            "hidden": hidden, "activation": activation, "train_fraction": tf, "epochs": epochs,
            "learning_rate": lr, "batch_size": batch_size, "weight_decay": wd, "seed": seed,
        },
    )


# ------------------------------------------------------------------ metrics


_ratio = _fit.ratio
_energy = _fit.energy


def _global_baselines(X, Y, ex, mask_fit, mask_eval, rec, ridge, identity_prior):
    """Global ridge linear map and global scaled Procrustes (fitted on ``mask_fit``).

    Linear: ridge least squares ``min ||Y - X A^T||^2 + lam ||A - A_0||^2`` (the
    minimum-norm map when ``lam = 0``), from the R factor of ``[1 | X | Y]``, not the
    normal equations (:func:`refgeo._tokenwise_fit.baseline_maps`).
    Procrustes: ``s Q`` with ``Q = polar(Y^T X)``, ``s = ||Y^T X||_* / ||X||_F^2``.
    The panels are ``X * 2**-ex`` and ``Y * 2**-ex``, a block of rows at a time (their
    R factors merged as they come: O(d^2) memory).
    """
    n, d = X.shape
    out = []
    R = np.zeros((0, 1 + 2 * d))
    every = bool(mask_fit.all())
    for s in range(0, n, _ROWS):
        t = min(n, s + _ROWS)
        xb, yb = _rows(X, ex, s, t), _rows(Y, ex, s, t)
        if not every:
            xb, yb = xb[mask_fit[s:t]], yb[mask_fit[s:t]]
        R = _fit.merge_r([R, _fit.baseline_panel(xb, yb)])
    AT, PT = _fit.baseline_maps(R, int(np.count_nonzero(mask_fit)), ridge, identity_prior)
    for kind, AT_ in (("linear", AT), ("procrustes", PT)):
        res_rec = np.empty((2, n))
        for s in range(0, n, _ROWS):  # O(_ROWS d) temporaries, not O(N d)
            t = min(n, s + _ROWS)
            res = _rows(X, ex, s, t) @ AT_
            np.subtract(_rows(Y, ex, s, t), res, out=res)
            res_rec[:, s:t] = _fit.norm_record(res)
        del res
        out.append(_baseline(kind, AT_, res_rec, rec, mask_eval))
    return tuple(out)


@_backend.dask_graphs_unfused
def decompose(
    X: Any,
    Y: Any,
    /,
    *,
    k: int | None = None,
    cls: str,
    rank: int | None = None,
    ridge: float = 0.0,
    prior: str = "identity",
    metric: str = "euclidean",
    standardize: bool = False,
    exclude_self: bool = True,
    weights: Any = None,
    neighbors: Any = None,
    subspace_rank: int | None = None,
    center_subspace: bool = False,
    mlp_options: Mapping[str, Any] | None = None,
    baselines: bool = True,
    chunk_size: int | None = None,
    layer: Any = None,
    progress: Any = False,
) -> TokenwiseResult:
    r"""Split a layer update into a tokenwise part and a residual, with every metric of :doc:`/theory/tokenwise`.

    Parameters
    ----------
    X, Y : array_like of shape (N, d)
        Hidden states :math:`h_l` and :math:`h_{l+1}` (finite; float32 or float64;
        torch tensors too, see the module docstring, "Tensors"; Dask arrays run on
        the active Dask scheduler, see "Dask" there and docs/cluster.md; not with
        ``cls="mlp"``).
    k, cls, rank, ridge, prior, metric, standardize, exclude_self, weights, neighbors, chunk_size
        As in :func:`fit_local_maps`; ``cls`` may also be ``"mlp"`` (a global residual
        MLP, :func:`fit_tokenwise_mlp`, trained with ``mlp_options`` and evaluated on
        its held-out tokens; ``k`` and the neighbor options are then unused).
    subspace_rank : int, default=None
        ``r`` of the dominant tokenwise subspace, ``1 <= r <= d``; None means
        ``min(8, d)``.
    center_subspace : bool, default=False
        Center :math:`\tau` (and each of :math:`\Delta, \tau, \rho` for their projection
        energies) by its mean over the evaluated tokens.
    mlp_options : mapping, default=None
        Keyword arguments of :func:`fit_tokenwise_mlp` for ``cls="mlp"``.
    baselines : bool, default=True
        Also fit the global linear and Procrustes baselines (four O(N d^2) GEMMs;
        ``False`` leaves ``result.baselines`` empty).
    layer : object, default=None
        A label recorded in ``config["layer"]`` (used by :func:`layer_report`).
    progress : bool or callable, default=False
        As in :func:`fit_local_maps`; the steps are the neighbor search, the chunks
        of the fit (the MLP's epochs), the metrics and the baselines.

    Returns
    -------
    result : TokenwiseResult
        Every array field (the per-token ``delta``, ``tau``, ``rho``,
        ``relative_error``, ``cosines``, ``angles``, ``projections``, ``neighbors``,
        ``eval_mask``, ``coefficients``; also ``subspace``, its singular values and the
        baselines' arrays) is a tensor on the input's device when ``X`` or ``Y`` is one.
        For Dask input ``delta``, ``tau``, ``rho`` and ``coefficients`` are Dask
        arrays chunked like ``X`` and every other field is NumPy: the per-token
        fields, the energy fraction and the neighbors are the single-machine values
        bit for bit; the subspace (up to the signs of its columns), its singular
        values, the projections, subspace energies and baselines agree to rounding
        (R factors of tau and, for the baselines, of ``[X | Y]``, merged over token
        blocks by QR factorizations of the stacked factors).

    Raises
    ------
    NotImplementedError
        ``cls="mlp"`` with Dask input (call ``.compute()`` first to train in this
        process).
    ValueError, MemoryError, KeyboardInterrupt
        As in :func:`fit_local_maps`; the memory estimate adds the (N, d) outputs
        and temporaries of the metrics.  A ``ValueError`` also when ``Y - X`` (checked
        before any work), tau, rho or the singular values leave the float64 range
        (entries near 1e308): scaling X and Y down by a power of two gives the same
        decomposition, exactly scaled.  ``cls="mlp"`` accepts X and Y more than ``2**500``
        apart in size (the MLP scales its panels itself).

    Notes
    -----
    .. math::

        \Delta_i = y_i - x_i,\quad \tau_i = A_i x_i - x_i,\quad
        \rho_i = \Delta_i - \tau_i,\qquad
        e_i = \frac{\lVert\rho_i\rVert}{\lVert\Delta_i\rVert},\quad
        E = \frac{\sum_i \lVert\rho_i\rVert^2}{\sum_i \lVert\Delta_i\rVert^2}

    and :math:`\lVert U_r^T v\rVert^2/\lVert v\rVert^2` for the top-r left singular
    vectors :math:`U_r` of :math:`[\tau_1 \dots \tau_N]` (a d x d float64
    eigenproblem).  Time: the fit's, plus O(N d^2) for the subspace and the global
    baselines; memory O(N d) (about eight N x d float64 arrays at the peak; the
    rescaling makes no (N, d) copy of float64 inputs: the rows are scaled block by
    block).  All metrics in float64; :math:`\Delta = \tau + \rho` holds to one
    rounding.  Invariances as in :func:`fit_local_maps`, including the exact
    power-of-two scaling over the whole float range; cosines, angles, relative
    errors and energy fractions are also invariant to a common scaling.

    References
    ----------
    .. [1] Tokenwise decomposition of layer updates, arXiv:2604.02459.

    Examples
    --------
    >>> import numpy as np, refgeo
    >>> X = np.array([[1.0, 2.0], [2.0, 1.0], [3.0, 5.0], [4.0, 3.0]])
    >>> r = refgeo.decompose(X, 2.0 * X, k=2, cls="diagonal", subspace_rank=1)
    >>> r.energy_fraction, float(np.max(np.abs(r.rho)))
    (0.0, 0.0)
    >>> r.angles.delta_tau.tolist(), round(r.subspace_energies.tau, 6)
    ([0.0, 0.0, 0.0, 0.0], 0.953984)
    >>> reports = []
    >>> r = refgeo.decompose(X, 2.0 * X, k=2, cls="full", progress=reports.append)
    >>> [(p["done"], p["total"]) for p in reports]   # the start and the end
    [(0, 4), (4, 4)]
    """
    if _any_dask(X, Y):
        return _decompose_dask(X, Y, k, cls, rank, ridge, prior, metric, standardize, exclude_self, weights,
                               neighbors, subspace_rank, center_subspace, mlp_options, baselines, chunk_size,
                               layer, progress)
    X, Y, origin = _foreign_panels(X, Y)
    n, d = X.shape
    check_choice(cls, "cls", CLASSES + ("mlp",))
    subspace_rank, center_subspace, baselines, progress = _decompose_options(
        d, subspace_rank, center_subspace, baselines, progress)
    sizes = _max_abs(X), _max_abs(Y)
    e = _fit.exponent_of(max(sizes))
    f = 8
    # delta, tau, rho; about 16 per-token float64 arrays; one (N, d) centering temporary
    extra = {"delta, tau and rho (N, d) and the per-token metrics": f * (2 * n * d + 16 * n),
             "the (N, d) temporaries of the metrics": f * n * d}
    what = f"decompose(N={n}, d={d}, cls={cls!r})"
    if cls == "mlp":
        # the neighbor options are unused here, but a misspelled choice is still an error;
        # rank belongs to cls="low_rank" alone, as for the local classes
        if rank is not None:
            raise ValueError(f"rank must be None unless cls='low_rank', got rank={rank!r} with cls='mlp' instead.")
        check_choice(metric, "metric", _METRICS)
        if isinstance(weights, str):
            check_choice(weights, "weights", _WEIGHTS)
        ridge = check_real(ridge, "ridge", min_value=0.0)
        check_choice(prior, "prior", _PRIORS)
        # unused, but a wrong kind of value is still a mistake of the call
        check_int(k, "k", min_value=1, allow_none=True)
        check_int(chunk_size, "chunk_size", min_value=1, allow_none=True)
        check_bool(standardize, "standardize")
        check_bool(exclude_self, "exclude_self")
        opts = {**_MLP_DEFAULTS, **_mlp_options_dict(mlp_options)}
        checked = _check_mlp_options(n, **opts)
        hidden, epochs = checked[0], checked[3]
        parts = {"fitted values (N, d)": f * n * d, "the MLP's (N, hidden) activations": 4 * f * n * hidden,
                 f"{_n_copies(X, Y) + 4} (N, d) standardized copies": (_n_copies(X, Y) + 4) * f * n * d, **extra}
        _memory.check_memory(what, parts, "Pass fewer tokens per call, or a smaller hidden width in mlp_options.")
        n_steps = epochs + 1 + int(baselines)
    else:
        # unused, but a wrong kind of value is still a mistake of the call
        _check_mlp_options(None, **{**_MLP_DEFAULTS, **_mlp_options_dict(mlp_options)})
        plan = _plan_fit(X, k, cls, rank, ridge, prior, metric, standardize, exclude_self, weights, neighbors,
                         chunk_size, False)
        _check_relative_size(*sizes)
        ridge = plan.ridge
        parts = {**_fit_bytes(plan, n, d, _n_copies(X, Y)), **extra}
        _check_fit_memory(what, parts, plan)
        n_steps = plan.n_steps + 1 + int(baselines)
    # Everything below runs on the scaled panels (see "scaling" above): the per-token
    # metrics are scale-free, and delta, tau, rho and the singular values are scaled
    # back at the end.
    X64, Y64, ex = _panels64(X, Y, e)
    _check_update_range(X64, Y64, ex, e)
    with _progress.Progress(progress, n_steps, desc="decompose", unit="step") as bar:
        if cls == "mlp":
            mfit = _fit_mlp(X, Y, **opts, tick=bar.advance)  # scales its panels itself
            try:
                fitted = mfit.predict(X)
            except ValueError:  # predictions beyond the float64 range
                fitted = None
            if fitted is None:
                raise ValueError(
                    "X and Y must be smaller for the result to be a float64 number, got MLP predictions "
                    "T(x_i) beyond the float64 range instead; scale X and Y down by the same power of two."
                )
            if e:
                np.ldexp(fitted, -e, out=fitted)
            eval_mask = np.zeros(n, dtype=bool)
            eval_mask[mfit.test_index] = True
            fit_mask = ~eval_mask
            dof, n_targets, nbr, coef = mfit.n_parameters, int(len(mfit.train_index) * d), None, None
            config = {
                "cls": "mlp", "k": None, "rank": None, "ridge": ridge, "prior": prior, "metric": None,
                "standardize": None, "exclude_self": None, "weights": None, "neighbors": None,
                "chunk_size": None, "dtype": str(X.dtype), "n_tokens": int(n), "d": int(d),
                "mlp": dict(mfit.config),
            }
        else:
            fitted, coef, _, nbr, _, _, wkind = _run_fit(plan, X, X64, Y64, ex, e, bar)
            eval_mask = np.ones(n, dtype=bool)
            fit_mask = eval_mask
            dof, n_targets = _degrees_of_freedom(plan.cls, d, plan.rank), plan.k * d
            config = _fit_config(plan, X, wkind)
            config["mlp"] = None
        del X, Y
        fields = _metrics(X64, Y64, ex, fitted, eval_mask, subspace_rank, center_subspace)
        bar.advance()
        fits = (
            _global_baselines(X64, Y64, ex, fit_mask, eval_mask, fields.pop("_record"), _scaled_ridge(ridge, e),
                              config["prior"] == "identity")
            if baselines
            else ()
        )
        fields.pop("_record", None)
        if baselines:
            bar.advance()
    # no entry is larger than its row's norm: the entries are looked at only when some
    # row norm would leave the range (O(N) in the common case)
    max_norm = fields.pop("_max_norm")
    entries_may_overflow = e > 0 and not _fits_after_scaling(max_norm, e)
    if e:
        for name in ("delta", "tau", "rho", "subspace_singular_values"):
            if name != "subspace_singular_values" and not entries_may_overflow:
                continue
            if e > 0 and not _fits_after_scaling(_max_abs(fields[name]), e):
                raise _range_error(f"|{name}|" if name != "subspace_singular_values" else
                                   "the largest singular value of [tau_1 ... tau_N]", _max_abs(fields[name]), e)
        for name in ("delta", "tau", "rho", "subspace_singular_values"):
            np.ldexp(fields[name], e, out=fields[name])
    config.update(subspace_rank=subspace_rank, center_subspace=center_subspace, baselines=baselines, layer=layer)
    return fields_to_caller(TokenwiseResult(
        **{name: _ro(v) if isinstance(v, np.ndarray) else v for name, v in fields.items()},
        dof=int(dof), n_targets=int(n_targets), neighbors=_ro(nbr), eval_mask=_ro(eval_mask),
        coefficients=_ro(coef), baselines=fits, config=config,
    ), origin)


def _metrics(X, Y, ex, fitted, eval_mask, subspace_rank, center_subspace):
    """Every per-token and aggregate metric of the decomposition (fields of the result).

    ``fitted`` (owned, writable, scaled) becomes tau in place.  ``X * 2**-ex`` and
    ``Y * 2**-ex`` are the scaled panels, taken a block of rows at a time; every
    metric except delta, tau, rho and the singular values is scale-free.
    """
    n = X.shape[0]
    delta = np.empty_like(fitted)
    tau = fitted
    for s in range(0, n, _ROWS):
        t = min(n, s + _ROWS)
        xb = _rows(X, ex, s, t)
        np.subtract(_rows(Y, ex, s, t), xb, out=delta[s:t])
        tau[s:t] -= xb
    del xb
    rho = delta - tau
    rec = np.concatenate([_fit.token_record(delta[s:s + _ROWS], tau[s:s + _ROWS], rho[s:s + _ROWS])
                          for s in range(0, n, _ROWS)], axis=1)

    # dominant tokenwise subspace
    # Centering subtracts the mean explicitly: the shortcut G - n m m^T (and
    # |v|^2 - 2 v.m + |m|^2) cancels catastrophically when the mean update is large
    # against its spread, as in residual streams (NaN projections at a mean of 1e8).
    te = tau[eval_mask]
    if center_subspace:
        te = te - te.mean(axis=0)
    R, E = _fit.scaled_r(te)
    del te
    U, sv = _fit.subspace(R, E, subspace_rank)
    proj = []
    for v in (delta, tau, rho):
        mean = v[eval_mask].mean(axis=0) if center_subspace else None
        proj.append(np.concatenate([_fit.norm_record(v[s:s + _ROWS] if mean is None else v[s:s + _ROWS] - mean, U)
                                    for s in range(0, n, _ROWS)], axis=1))
    return {
        "delta": delta, "tau": tau, "rho": rho, **_token_fields(rec, proj, eval_mask),
        "subspace": U, "subspace_singular_values": sv,
        "_record": rec,
        # the largest row norm of delta, tau, rho (scaled): bounds every entry
        "_max_norm": _fit.largest_norm(rec),
    }


def _token_fields(rec, proj, eval_mask):
    """The fields of a :class:`TokenwiseResult` that come from the per-token record
    ``rec`` (:func:`refgeo._tokenwise_fit.token_record`) and the projection records
    ``proj`` of delta, tau and rho (:func:`refgeo._tokenwise_fit.norm_record`); the
    aggregates are over the tokens of ``eval_mask``.  Shared by the NumPy and the Dask
    engines."""
    m = eval_mask
    ro = _ro
    sums = [_fit.scaled_sum(rec[j][m], rec[3 + j][m]) for j in range(3)]
    projections, energies = [], []
    for p2, vn2, ev in proj:
        projections.append(ro(_ratio(p2, vn2)))
        energies.append(_energy(_fit.scaled_sum(p2[m], ev[m]), _fit.scaled_sum(vn2[m], ev[m])))
    return {
        "relative_error": ro(rec[6]),
        "energy_fraction": _energy(sums[2], sums[0]),
        "cosines": TokenwisePairs(delta_tau=ro(rec[7]), rho_tau=ro(rec[8]), rho_delta=ro(rec[9])),
        "angles": TokenwisePairs(delta_tau=ro(rec[10]), rho_tau=ro(rec[11]), rho_delta=ro(rec[12])),
        "projections": TokenwiseParts(*projections),
        "subspace_energies": TokenwiseParts(*energies),
    }


def _baseline(kind, AT, res_rec, rec, eval_mask):
    """The :class:`GlobalBaseline` of the transposed map ``AT`` from the norm record
    ``res_rec`` of its residuals (:func:`refgeo._tokenwise_fit.norm_record`) and the
    per-token record ``rec``."""
    m = eval_mask
    r2, er = res_rec
    return GlobalBaseline(
        kind=kind, map=_ro(np.ascontiguousarray(AT.T)), relative_error=_ro(_fit.norm_ratio(r2, er, rec[0], rec[3])),
        energy_fraction=_energy(_fit.scaled_sum(r2[m], er[m]), _fit.scaled_sum(rec[0][m], rec[3][m])),
    )


_MLP_DEFAULTS = {
    "hidden": 64, "activation": "gelu", "train_fraction": 0.8, "epochs": 200, "learning_rate": 1e-3,
    "batch_size": None, "weight_decay": 0.0, "seed": 0,
}


# ------------------------------------------------------------- intervention


def _log_softmax(z, name, axis=-1):
    """Max-shifted float64 log-softmax of the logits ``z`` (``name`` in errors).

    Finite wherever the probability is positive in float64; a logit more than the
    float64 range below the largest one gets ``-inf`` (probability exactly 0), as does
    a logit of ``-inf``.  NaN or ``+inf`` logits, a row of ``-inf`` only and an empty
    vocabulary axis are a ``ValueError`` (they gave NaN, or NumPy's empty-reduction
    error).
    """
    z = _f64(np.asarray(z))
    if z.ndim == 0 or z.shape[axis] == 0:
        raise ValueError(f"{name} must have at least one logit along the vocabulary axis, got shape {z.shape} instead.")
    if bool(np.any(np.isnan(z) | np.isposinf(z))) or bool(np.any(np.all(np.isneginf(z), axis=axis))):
        raise ValueError(
            f"{name} must be finite or -inf (a token of probability 0) with a finite logit in every row, "
            "got NaN, +inf or a row of -inf instead."
        )
    m = np.max(z, axis=axis, keepdims=True)
    with np.errstate(over="ignore"):
        s = z - m
    return s - np.log(np.sum(np.exp(s), axis=axis, keepdims=True))


def _logits(z, name):
    """``(z, log_softmax(z))`` of validated float64 logits (see :func:`_log_softmax`):
    the divergences read the logit change ``zq - zp`` itself, not only the logs."""
    z = _f64(np.asarray(z))
    return z, _log_softmax(z, name)


def _divergence(P, Q, kind):
    """The divergence of every position: ``P``, ``Q`` are :func:`_logits` pairs with the
    vocabulary on the last axis; a few ulps relative (``_tokenwise_fit.divergence``)."""
    (zp, lp), (zq, lq) = P, Q
    V = lp.shape[-1]
    flat = (np.reshape(a, (-1, V)) for a in (zp, lp, zq, lq))
    return _fit.divergence(*flat, kind).reshape(lp.shape[:-1])


def _call_logits(logits_fn, H, lead, name, origin=None, input_origin=None):
    # the caller's function sees the caller's framework (tensors for tensor states) and,
    # with input_origin, the caller's half-precision dtype (a bfloat16 model cannot
    # multiply the float32 copy of its states); it gets a copy (O(T d), against the
    # O(T d V) of its logits): H may be a view of the caller's states, and a function
    # that works in place changed them, and every later patched input with them
    L, _ = from_foreign(logits_fn(in_input_dtype(to_caller(H.copy(), origin), input_origin)), name, host=True)
    L = as_float_array(L, name, finite=False)
    if L.ndim != len(lead) + 1 or tuple(L.shape[:-1]) != tuple(lead):
        raise ValueError(
            f"{name} must have shape {tuple(lead) + ('V',)} (the hidden states' leading shape "
            f"plus a vocabulary axis), got shape {tuple(L.shape)} instead."
        )
    check_finite(L, name)
    return _logits(L, name)


def output_perturbation(
    logits_fn: Callable[[Any], Any],
    H_orig: Any,
    H_patched: Any,
    /,
    *,
    mode: str = "all",
    divergence: str = "kl",
    readout: str = "self",
):
    r"""Divergence of the model's output when hidden states are replaced by their tokenwise fit.

    Parameters
    ----------
    logits_fn : callable
        Maps hidden states of shape (T, d) or (B, T, d) to logits of shape (T, V) or
        (B, T, V): the rest of the model, supplied by the user.  It receives tensors
        (on the states' device) when ``H_orig`` or ``H_patched`` is a tensor, NumPy
        arrays otherwise (bfloat16 or float16 tensors when both states are of that
        dtype, so that a half-precision model takes them), and may return NumPy arrays
        or tensors (autograd-tracked ones too: they are detached).  Sequences along the
        batch axis must be processed independently.
    H_orig, H_patched : array_like of shape (T, d) or (B, T, d)
        Original states :math:`h_{l+1}` and the patched ones (e.g.
        ``result.patched(X)`` reshaped).
    mode : {"all", "per_token"}, default="all"
        ``"all"`` patches every position at once (two calls of ``logits_fn``);
        ``"per_token"`` patches one position at a time (T + 1 calls; position t of
        every sequence in the batch is patched together).
    divergence : {"kl", "reverse_kl", "js"}, default="kl"
        :math:`\mathrm{KL}(p \Vert q)`, :math:`\mathrm{KL}(q \Vert p)` or Jensen-Shannon,
        with p the original and q the patched output distribution.
    readout : {"self", "sum"}, default="self"
        For ``"per_token"``: the divergence at the patched position, or summed over
        all positions of the sequence.

    Returns
    -------
    div : ndarray of shape (T,) or (B, T)
        float64, ``>= 0`` (a tensor on the states' device for tensor states).

    Notes
    -----
    .. math:: \mathrm{KL}(p \Vert q) = \sum_v p_v (\log p_v - \log q_v),\quad
              \log p = z - \max z - \log \textstyle\sum_v e^{z_v - \max z}

    Max-shifted float64 log-softmax, so any finite logits work (no probability is
    formed before the log).  The divergences are computed from the logit change
    :math:`\delta = z_q - z_p` centered under p, :math:`x = \delta - E_p \delta`, as
    sums of second-order terms, e.g. :math:`\mathrm{KL}(p \Vert q) =
    \log(1 + \sum_v p_v (e^{x_v} - 1 - x_v))`: relative to the divergence of the
    float64 logits however small it is (within ``2**-46`` of 400-digit arithmetic in
    the tests; differences of logs lose :math:`u \sum_v p_v |\log p_v|` absolute, all
    of a KL of 1e-17), and ``>= 0``.  A KL beyond ``e**709`` or infinite takes the
    differences of logs (then accurate relative to itself).
    Invariant to adding a constant to the logits of any position.  Cost: 2 (``"all"``) or T + 1
    (``"per_token"``) calls of ``logits_fn``, plus O(B T V).

    References
    ----------
    .. [1] Tokenwise decomposition of layer updates, arXiv:2604.02459.

    Examples
    --------
    >>> import numpy as np, refgeo
    >>> H = np.array([[0.0, 0.0], [0.0, 0.0]])
    >>> P = np.array([[0.0, 0.0], [np.log(3.0), 0.0]])
    >>> kl = refgeo.output_perturbation(lambda h: h, H, P)
    >>> [round(float(v), 12) for v in kl]   # KL((1/2, 1/2) || (3/4, 1/4))
    [0.0, 0.143841036226]
    """
    check_callable(logits_fn, "logits_fn")
    H_orig, origin_o = from_foreign(H_orig, "H_orig", host=True)
    H_patched, origin_p = from_foreign(H_patched, "H_patched", host=True)
    origin = first_origin(origin_o, origin_p)
    # both states upcast from the same half dtype: logits_fn gets that dtype back (exact,
    # as every state it sees is one of theirs); mixed dtypes keep the upcast one
    same_half = (origin_o is not None and origin_p is not None and origin_o.converted_from is not None
                 and origin_o.converted_from == origin_p.converted_from)
    input_origin = origin_o if same_half else None
    Ho = as_float_array(H_orig, "H_orig", ndim=(2, 3), shape_hint="2-D or 3-D array of shape ([B,] T, d)")
    Hp = as_float_array(H_patched, "H_patched", ndim=(2, 3), shape_hint="2-D or 3-D array of shape ([B,] T, d)")
    check_same_shape(Ho, Hp, ("H_orig", "H_patched"))
    check_choice(mode, "mode", ("all", "per_token"))
    check_choice(divergence, "divergence", ("kl", "reverse_kl", "js"))
    check_choice(readout, "readout", ("self", "sum"))
    Ho, Hp = np.asarray(Ho), np.asarray(Hp)
    lead = Ho.shape[:-1]
    P = _call_logits(logits_fn, Ho, lead, "logits_fn(H_orig)", origin, input_origin)
    if mode == "all":
        Q = _call_logits(logits_fn, Hp, lead, "logits_fn(H_patched)", origin, input_origin)
        _check_vocabulary(P, Q, "logits_fn(H_patched)")
        return to_caller(_divergence(P, Q, divergence), origin)
    T = lead[-1]
    out = np.empty(lead, dtype=np.float64)
    for t in range(T):
        H = Ho.copy()
        H[..., t, :] = Hp[..., t, :]
        Q = _call_logits(logits_fn, H, lead, "logits_fn(H)", origin, input_origin)
        _check_vocabulary(P, Q, "logits_fn(H)")
        if readout == "self":
            # only position t is read: its divergence, not the whole sequence's
            out[..., t] = _divergence((P[0][..., t, :], P[1][..., t, :]), (Q[0][..., t, :], Q[1][..., t, :]),
                                      divergence)
        else:
            out[..., t] = np.sum(_divergence(P, Q, divergence), axis=-1)
    return to_caller(out, origin)


def _check_vocabulary(P, Q, name):
    # both calls' logits over one vocabulary (else a broadcasting error naming no call)
    if Q[1].shape != P[1].shape:
        raise ValueError(
            f"{name} must return logits of the shape of logits_fn(H_orig), {P[1].shape}, got shape "
            f"{Q[1].shape} instead."
        )


# ----------------------------------------------------------------- Spearman


def _average_ranks(x):
    n = x.shape[0]
    order = np.argsort(x, kind="stable")
    xs = x[order]
    new = np.empty(n, dtype=bool)
    new[0] = True
    new[1:] = xs[1:] != xs[:-1]
    starts = np.flatnonzero(new)
    ends = np.append(starts[1:], n)
    avg = 0.5 * (starts + ends - 1) + 1.0
    ranks = np.empty(n, dtype=np.float64)
    ranks[order] = avg[np.cumsum(new) - 1]
    return ranks


def spearman(a: Any, b: Any, /) -> float:
    r"""Spearman rank correlation with average ranks for ties.

    Parameters
    ----------
    a, b : array_like of shape (n,)
        Finite values, ``n >= 2``.

    Returns
    -------
    rho : float
        Pearson correlation of the average ranks; NaN when either input is constant.

    Notes
    -----
    .. math:: \rho_S = \frac{\sum_i (R_i - \bar R)(S_i - \bar S)}
              {\sqrt{\sum_i (R_i - \bar R)^2 \sum_i (S_i - \bar S)^2}}

    with :math:`R, S` the average ranks (tied values share the mean of their
    positions), as ``scipy.stats.spearmanr``.  Time O(n log n).  Invariant under
    strictly increasing transformations of either input.

    Examples
    --------
    >>> import refgeo
    >>> refgeo.spearman([1.0, 2.0, 3.0, 4.0], [1.0, 3.0, 2.0, 4.0])
    0.8
    """
    a, _ = from_foreign(a, "a", host=True)
    b, _ = from_foreign(b, "b", host=True)
    a = as_float_array(a, "a", ndim=1, shape_hint="1-D array of shape (n,)")
    b = as_float_array(b, "b", ndim=1, shape_hint="1-D array of shape (n,)")
    check_same_shape(a, b, ("a", "b"))
    if a.shape[0] < 2:
        raise ValueError(f"a must have at least 2 entries, got shape {tuple(a.shape)} instead.")
    ra = _average_ranks(_f64(np.asarray(a)))
    rb = _average_ranks(_f64(np.asarray(b)))
    ra -= ra.mean()
    rb -= rb.mean()
    den = math.sqrt(float(ra @ ra) * float(rb @ rb))
    if den == 0.0:
        return math.nan
    return float(min(1.0, max(-1.0, float(ra @ rb) / den)))


# -------------------------------------------------------------- layer table


def layer_report(
    results: Sequence[TokenwiseResult],
    /,
    *,
    perturbations: Sequence[Any] | None = None,
    layers: Sequence[Any] | None = None,
) -> list[dict]:
    r"""One tidy row per (layer, class): means, medians and Spearman(error, perturbation).

    Parameters
    ----------
    results : sequence of TokenwiseResult
        One decomposition per (layer, class).
    perturbations : sequence of array_like of shape (N,), default=None
        Per-token output perturbation (e.g. KL from :func:`output_perturbation`, in
        the token order of the result), one per result (or None entries).
    layers : sequence, default=None
        Layer labels; default ``result.config["layer"]``.

    Returns
    -------
    rows : list of dict
        Keys ``layer``, ``cls``, ``k``, ``rank``, ``ridge``, ``prior``, the summary of
        :meth:`TokenwiseResult.summary` (means, medians, energy fractions, subspace
        energies, baselines, degrees of freedom), and, with perturbations,
        ``mean_perturbation``, ``median_perturbation`` and ``spearman_error_perturbation``
        over the evaluated tokens where both values are finite.  Ready for
        ``pandas.DataFrame(rows)``.

    Notes
    -----
    .. math:: \rho_S\big(e_i, \mathrm{KL}_i\big),\quad
              e_i = \lVert\rho_i\rVert / \lVert\Delta_i\rVert

    Time O(N log N) per row (the ranks).

    References
    ----------
    .. [1] Tokenwise decomposition of layer updates, arXiv:2604.02459.

    Examples
    --------
    >>> import numpy as np, refgeo
    >>> X = np.array([[1.0, 2.0], [2.0, 1.0], [3.0, 5.0], [4.0, 3.0]])
    >>> r = refgeo.decompose(X, 2.0 * X, k=2, cls="diagonal", subspace_rank=1, layer=3)
    >>> row = refgeo.layer_report([r])[0]
    >>> row["layer"], row["cls"], row["energy_fraction"]
    (3, 'diagonal', 0.0)
    """
    if isinstance(results, TokenwiseResult) or not isinstance(results, Sequence):
        raise TypeError(f"results must be a sequence of TokenwiseResult, got {type(results).__name__} instead.")
    for i, r in enumerate(results):
        if not isinstance(r, TokenwiseResult):
            raise TypeError(f"results[{i}] must be a TokenwiseResult, got {type(r).__name__} instead.")
    n = len(results)
    for name, seq in (("perturbations", perturbations), ("layers", layers)):
        # a string has a length too: layers="abc" labelled three layers 'a', 'b', 'c'
        if seq is not None and (not hasattr(seq, "__len__") or isinstance(seq, (str, bytes))):
            raise TypeError(f"{name} must be None or a sequence with one entry per result, got "
                            f"{type(seq).__name__} instead.")
        if seq is not None and len(seq) != n:
            raise ValueError(f"{name} must have one entry per result ({n}), got {len(seq)} instead.")
    rows = []
    for i, r in enumerate(results):
        cfg = r.config
        row = {
            "layer": layers[i] if layers is not None else cfg.get("layer"),
            "cls": cfg["cls"],
            "k": cfg["k"],
            "rank": cfg["rank"],
            "ridge": cfg["ridge"],
            "prior": cfg["prior"],
        }
        row.update(r.summary())
        p = None if perturbations is None else perturbations[i]
        if p is not None:
            # NaN/inf allowed (a diverged token): they are left out of the statistics
            p, _ = from_foreign(p, f"perturbations[{i}]", host=True)
            p = as_float_array(p, f"perturbations[{i}]", ndim=1, finite=False, shape_hint="1-D array of shape (N,)")
            p = np.asarray(p, dtype=np.float64)
            err, mask = to_host(r.relative_error), to_host(r.eval_mask)
            if p.shape[0] != err.shape[0]:
                raise ValueError(
                    f"perturbations[{i}] must have one value per token ({err.shape[0]}), "
                    f"got {p.shape[0]} instead."
                )
            # the three statistics on one set of tokens, as documented: the mean and
            # median took tokens whose relative error is NaN (an update of zero) too
            m = mask & np.isfinite(p) & np.isfinite(err)
            row["mean_perturbation"] = _finite_mean(p[m])
            row["median_perturbation"] = _finite_median(p[m])
            row["spearman_error_perturbation"] = (
                spearman(err[m], p[m]) if int(m.sum()) >= 2 else math.nan
            )
        rows.append(row)
    return rows
