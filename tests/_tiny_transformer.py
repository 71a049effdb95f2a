"""A small decoder-only transformer in NumPy (random weights, fixed seed) for end-to-end tests.

Pre-norm blocks ``h <- h + Attn(LN(h)); h <- h + MLP(LN(h))`` with causal multi-head
attention and a GELU MLP, a final LayerNorm and a tied unembedding.  ``forward`` returns
the residual stream after every block, ``logits_from(l, H)`` runs blocks ``l, l+1, ...``
and the head on states ``H`` of shape (B, T, d): the "rest of the model" that
``refgeo.output_perturbation`` needs.
"""

from __future__ import annotations

import numpy as np


def _layer_norm(h, g, b, eps=1e-5):
    mu = h.mean(-1, keepdims=True)
    var = ((h - mu) ** 2).mean(-1, keepdims=True)
    return (h - mu) / np.sqrt(var + eps) * g + b


def _gelu(z):
    return 0.5 * z * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (z + 0.044715 * z**3)))


class TinyTransformer:
    """Random-weight transformer: ``vocab`` tokens, width ``d``, ``n_layers`` blocks."""

    def __init__(self, vocab=50, d=16, n_layers=3, n_heads=2, d_mlp=32, max_len=32, seed=0):
        g = np.random.default_rng(seed)
        self.d, self.n_heads, self.n_layers = d, n_heads, n_layers
        s = 1.0 / np.sqrt(d)
        self.embed = g.standard_normal((vocab, d))
        self.pos = 0.3 * g.standard_normal((max_len, d))
        self.blocks = []
        for _ in range(n_layers):
            self.blocks.append(
                {
                    "ln1": (1.0 + 0.1 * g.standard_normal(d), 0.1 * g.standard_normal(d)),
                    "qkv": s * g.standard_normal((d, 3 * d)),
                    "out": s * g.standard_normal((d, d)),
                    "ln2": (1.0 + 0.1 * g.standard_normal(d), 0.1 * g.standard_normal(d)),
                    "fc1": s * g.standard_normal((d, d_mlp)),
                    "b1": 0.1 * g.standard_normal(d_mlp),
                    "fc2": (1.0 / np.sqrt(d_mlp)) * g.standard_normal((d_mlp, d)),
                }
            )
        self.ln_f = (np.ones(d), np.zeros(d))

    def _attention(self, blk, h):
        B, T, d = h.shape
        nh, dh = self.n_heads, d // self.n_heads
        q, k, v = np.split(h @ blk["qkv"], 3, axis=-1)
        q = q.reshape(B, T, nh, dh).transpose(0, 2, 1, 3)
        k = k.reshape(B, T, nh, dh).transpose(0, 2, 1, 3)
        v = v.reshape(B, T, nh, dh).transpose(0, 2, 1, 3)
        att = q @ k.transpose(0, 1, 3, 2) / np.sqrt(dh)
        att = np.where(np.tril(np.ones((T, T), dtype=bool)), att, -np.inf)
        att = np.exp(att - att.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        o = (att @ v).transpose(0, 2, 1, 3).reshape(B, T, d)
        return o @ blk["out"]

    def block(self, l, h):
        """Apply block ``l`` to states of shape (B, T, d)."""
        blk = self.blocks[l]
        h = h + self._attention(blk, _layer_norm(h, *blk["ln1"]))
        z = _layer_norm(h, *blk["ln2"]) @ blk["fc1"] + blk["b1"]
        return h + _gelu(z) @ blk["fc2"]

    def forward(self, tokens):
        """Residual stream ``[h_0, h_1, ..., h_L]`` for integer tokens of shape (B, T)."""
        T = tokens.shape[1]
        h = self.embed[tokens] + self.pos[:T]
        states = [h]
        for l in range(self.n_layers):
            h = self.block(l, h)
            states.append(h)
        return states

    def head(self, h):
        return _layer_norm(h, *self.ln_f) @ self.embed.T

    def logits_from(self, l, H):
        """Logits when the residual stream entering block ``l`` is ``H`` (B, T, d)."""
        h = np.asarray(H, dtype=np.float64)
        for j in range(l, self.n_layers):
            h = self.block(j, h)
        return self.head(h)
