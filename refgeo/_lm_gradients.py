r"""Synthetic LM-head gradients with the structure of trained language models (private).

Used by the diameter-LMO tests and benchmarks.  A linear head :math:`W \in
\mathbb{R}^{V \times d}` with a unigram bias reads hidden states :math:`h_t` and is
trained by cross-entropy, so its gradient is

.. math:: G = \tfrac1n \sum_t (p_t - e_{c_t})\, h_t^\top, \qquad \mathbf{1}^\top G = 0,

with :math:`p_t = \mathrm{softmax}(W h_t + b)`.  Two features of real heads make this
gradient hard for the exact LMO, and both are built in:

- token frequencies follow Zipf's law (exponent about 1.1): the bias is
  :math:`b_i = -1.1 \log(i + 1)`, so most tokens are rare;
- the final hidden states share a common component several times the noise
  (anisotropy): :math:`h_t = 3u + \xi_t` with :math:`\lVert u \rVert = 1` and
  :math:`\xi_t \sim N(0, I_d / d)` (unit expected norm).

Targets :math:`c_t` are sampled from the model itself.  A rare token's row is then
about :math:`\bar p_i \cdot \bar h`: most rows are tiny and point almost the same way.
:func:`isotropic_gradient` is the older case without either feature (uniform prior,
standard normal hidden states).
"""

from __future__ import annotations

import math

import numpy as np

from ._threads import blas_single_thread

__all__ = ["isotropic_gradient", "lm_gradient"]


def _sample(rng, P):
    """One index per row of the row-stochastic P, drawn from that row."""
    c = (np.cumsum(P, axis=1) > rng.random((P.shape[0], 1))).argmax(axis=1)
    return c


def _ce_gradient(rng, Hs, W, b):
    # one BLAS thread: a threaded GEMM sums in an order set by the thread count, and
    # its last bits moved the sampled targets and the tests' inputs (different bits
    # with OPENBLAS_NUM_THREADS=1 and 2)
    with blas_single_thread():
        Z = Hs @ W.T + b
        Z -= Z.max(axis=1, keepdims=True)
        P = np.exp(Z)
        P /= P.sum(axis=1, keepdims=True)
        c = _sample(rng, P)
        P[np.arange(len(c)), c] -= 1.0
        G = P.T @ Hs / len(c)
    return G - G.mean(axis=0, keepdims=True)  # removes the float rounding of 1^T G


def lm_gradient(
    V: int,
    d: int,
    *,
    n_tokens: int = 1024,
    zipf: float = 1.1,
    common: float = 3.0,
    scale: float = 2.0,
    seed: int = 0,
) -> np.ndarray:
    """Cross-entropy gradient (V, d) of a head with Zipf prior and anisotropic states.

    ``common`` is the norm of the shared hidden-state component (noise of unit
    expected norm), ``scale`` the typical logit spread of W; targets are sampled from
    the model.  The columns sum to zero (the rows add up to the zero vector, to
    rounding).  Deterministic in ``seed`` (the same bits for any BLAS thread count,
    for a given BLAS and CPU).
    """
    rng = np.random.default_rng(seed)
    u = rng.standard_normal(d)
    u /= np.linalg.norm(u)
    Hs = common * u + rng.standard_normal((n_tokens, d)) / math.sqrt(d)
    W = rng.standard_normal((V, d)) * scale
    b = -zipf * np.log(np.arange(1, V + 1, dtype=np.float64))
    return _ce_gradient(rng, Hs, W, b)


def isotropic_gradient(V: int, d: int, *, n_tokens: int = 1024, scale: float = 2.0, seed: int = 0) -> np.ndarray:
    """Cross-entropy gradient (V, d) with a uniform prior and standard normal states."""
    rng = np.random.default_rng(seed)
    Hs = rng.standard_normal((n_tokens, d))
    W = rng.standard_normal((V, d)) * scale / math.sqrt(d)
    return _ce_gradient(rng, Hs, W, np.zeros(V))
