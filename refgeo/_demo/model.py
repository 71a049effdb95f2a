"""The demo's next-token model: fixed features of the context and a trained softmax head.

The features are a fixed (untrained) two-layer map of the previous ``c`` tokens,
``h0 = sum_k E_k[w_{t-k}]`` (random projections of the one-hot context, one projection
per position) and ``h1 = h0 + tanh(h0 R)`` (a fixed residual layer); the last
coordinate of both is a constant 1 (the head's bias).  Only the softmax head ``W``
(V x d) is trained, on the cross-entropy of ``softmax(h1 W^T)``.

Examples
--------
>>> import numpy as np
>>> W, H, y = np.zeros((4, 2)), np.ones((3, 2)), np.array([0, 1, 3])
>>> loss, G = loss_grad(W, H, y)
>>> round(loss, 12) == round(float(np.log(4)), 12)  # W = 0 predicts uniformly
True
>>> bool(np.allclose(G.sum(axis=0), 0.0))  # the rows of a softmax gradient sum to zero
True
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["Features", "loss", "loss_grad"]


class Features:
    """Fixed random features ``(h0, h1)`` of the previous ``context`` tokens.

    Parameters
    ----------
    V, d, context : int
        Vocabulary size, hidden width and number of previous tokens.
    rng : numpy.random.Generator
        Source of the fixed projections ``E`` (context, V, d) and ``R`` (d, d).
    """

    def __init__(self, V: int, d: int, context: int, rng: np.random.Generator) -> None:
        self.context = context
        self.E = rng.standard_normal((context, V, d)) * (2.0 / math.sqrt(context * d))
        self.R = rng.standard_normal((d, d)) * (1.5 / math.sqrt(d))

    def __call__(self, ids: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(h0, h1)`` of shape (len(pos), d) for the tokens at positions ``pos`` of ``ids``."""
        h0 = self.E[0][ids[pos - 1]]
        for k in range(1, self.context):
            h0 = h0 + self.E[k][ids[pos - 1 - k]]
        h1 = h0 + np.tanh(h0 @ self.R)
        h0[:, -1] = 1.0
        h1[:, -1] = 1.0
        return h0, h1


def loss_grad(W: np.ndarray, H: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    """Mean cross-entropy of softmax(H W^T) and its gradient in W (rows sum to zero).

    O(B V d) for B hidden states ``H`` (B, d), a head ``W`` (V, d) and targets ``y`` (B,).
    """
    Z = H @ W.T
    Z -= Z.max(axis=1, keepdims=True)
    P = np.exp(Z)
    s = P.sum(axis=1, keepdims=True)
    rows = np.arange(len(y))
    value = float(np.mean(np.log(s[:, 0]) - Z[rows, y]))
    P /= s
    P[rows, y] -= 1.0
    return value, P.T @ H / len(y)


def loss(W: np.ndarray, H: np.ndarray, y: np.ndarray, chunk: int = 1024) -> float:
    """Mean cross-entropy of softmax(H W^T), ``chunk`` states at a time (bounded memory)."""
    total = 0.0
    for a in range(0, len(y), chunk):
        Z = H[a : a + chunk] @ W.T
        m = Z.max(axis=1, keepdims=True)
        lse = np.log(np.exp(Z - m).sum(axis=1)) + m[:, 0]
        total += float(np.sum(lse - Z[np.arange(len(Z)), y[a : a + chunk]]))
    return total / len(y)
