"""Record head gradients from ``refgeo demo``'s training for the exact-LMO benchmark.

The demo trains a linear LM head from ``W = 0`` on a corpus of standard-library text
(``refgeo/_demo``).  This script repeats the setup of ``refgeo demo --quick`` (seed 0:
corpus, features, batches) and trains the RowNorm head, the trajectory the demo's LMO
certificates are computed on, keeping the cross-entropy gradient ``G`` of the head at
the steps the demo stores.  They are saved, float64 and compressed, to
``asv_benchmarks/benchmarks/data/demo_gradients.npz`` with keys ``G_<step>`` plus the
``steps`` and the demo size.

The corpus is read from the running Python's standard library, so another Python
version records other (similar) gradients: the file in the repository is the reference
and is regenerated only on purpose.

Usage::

    python tools/record_demo_gradients.py [--size quick] [--steps 40 120] [--out PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import numpy as np

from refgeo._demo import corpus, training
from refgeo._demo.model import Features

_HERE = os.path.dirname(os.path.abspath(__file__))
_DEFAULT_OUT = os.path.join(_HERE, "..", "asv_benchmarks", "benchmarks", "data", "demo_gradients.npz")


def record(size: str = "quick", steps: tuple[int, ...] = (40, 120), seed: int = 0) -> dict[int, np.ndarray]:
    """``{step: G}``: the RowNorm run's head gradients at ``steps`` (the demo's setup)."""
    cfg = training.SIZES[size]
    text = corpus.build_corpus(vocab_size=cfg.vocab, max_files=cfg.max_files)
    cfg = dataclasses.replace(cfg, vocab=len(text.vocab), steps=max(steps))
    # the same draws, in the same order, as refgeo._demo.run_demo
    rng = np.random.default_rng(seed)
    ids = np.asarray(text.ids, dtype=np.int64)
    n = len(ids)
    split = int(0.9 * n)
    c = cfg.context
    feats = Features(cfg.vocab, cfg.d, c, rng)
    held = rng.permutation(np.arange(split + c, n))
    eval_pos, panel_pos = held[: cfg.n_eval], held[cfg.n_eval : cfg.n_eval + cfg.n_panel]
    _, H_eval = feats(ids, eval_pos)
    _, H_panel = feats(ids, panel_pos)
    batches = rng.integers(c, split, size=(training.SIZES[size].steps, cfg.batch))
    name, label, factory = next(m for m in training.make_methods(cfg)[0] if m[0] == "rownorm")
    # keep every gradient: lmo_every = 1
    run = training.train(name, label, factory, size=dataclasses.replace(cfg, lmo_every=1), batches=batches,
                         feats=feats, ids=ids, H_eval=H_eval, y_eval=ids[eval_pos], H_panel=H_panel,
                         progress=training.Progress(cfg.steps, False), keep_grads=True)
    return {t: np.asarray(run.grads[t], dtype=np.float64) for t in steps}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="quick", choices=sorted(training.SIZES))
    ap.add_argument("--steps", type=int, nargs="+", default=[40, 120])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=_DEFAULT_OUT)
    args = ap.parse_args(argv)
    grads = record(args.size, tuple(args.steps), args.seed)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    np.savez_compressed(args.out, steps=np.array(sorted(grads)), size=np.array(args.size),
                        **{f"G_{t}": g for t, g in grads.items()})
    for t, g in sorted(grads.items()):
        print(f"step {t}: G {g.shape}, |1^T G| / sum ||g_i|| = "
              f"{np.linalg.norm(g.sum(0)) / np.linalg.norm(g, axis=1).sum():.1e}")
    print(f"{args.out}: {os.path.getsize(args.out) / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
