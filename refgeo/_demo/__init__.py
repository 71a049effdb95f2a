"""The offline demo behind ``refgeo demo``: head optimizers on Python's own documentation.

Pipeline, one module each:

1. :mod:`~refgeo._demo.corpus`: tokenizes ``pydoc_data.topics`` and standard-library
   docstrings, vocabulary of V words plus ``<unk>``;
2. :mod:`~refgeo._demo.model`: fixed features of the previous ``c`` tokens,
   ``h0 = sum_k E_k[w_{t-k}]`` and ``h1 = h0 + tanh(h0 R)``, and the loss of the softmax
   head ``W`` (V x d), the only trained part;
3. :mod:`~refgeo._demo.training`: the sizes and budgets, and the training loop: from
   ``W = 0`` on the same mini-batches for every optimizer (AdamW, RowNorm, rescaled
   RowNorm, the warm-started exact diameter LMO, the spreading update), with the
   per-step row diameter ``D(S_t)`` of the update and its Hilbert RMS on held-out
   hidden states against the bound ``max ||h|| D(S_t)``;
4. :mod:`~refgeo._demo.analysis`: the certified LMO gap and the RowNorm/exact ratio
   along training, the final head's distance ratio against the upper bound for (V, d),
   a tokenwise decomposition of the feature layer ``h0 -> h1``;
5. :mod:`~refgeo._demo.plots` and :mod:`~refgeo._demo.report`: PNG plots (matplotlib,
   Agg backend), ``report.md`` and ``results.json``.

Examples
--------
>>> sorted(SIZES)
['full', 'quick', 'tiny']
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import numpy as np

from .._validate import check_choice
from . import analysis, corpus, plots, report, training
from .model import Features
from .training import SIZES, DemoSize

__all__ = ["SIZES", "DemoSize", "run_demo"]


# every file the demo writes into its output directory
_OUTPUTS = ("report.md", "results.json", "loss.png", "step_geometry.png", "lmo.png", "head_geometry.png",
            "tokenwise.png")


def _check_out_dir(out_dir: str) -> None:
    """Create ``out_dir`` and check that the demo can write its files there, before the
    training: an unwritable directory, or a directory where ``report.md`` or a plot
    goes, failed only when the first file was saved, after minutes of training."""
    import tempfile

    if not isinstance(out_dir, str) or not out_dir:
        raise ValueError(f"out_dir must name a directory, got {out_dir!r} instead.")
    try:
        os.makedirs(out_dir, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out_dir, prefix=".refgeo-demo-write-check-"):
            pass
    except OSError as exc:
        raise ValueError(f"out_dir {out_dir!r} is not a directory the demo can write to: {exc}") from None
    taken = [f for f in _OUTPUTS if os.path.isdir(os.path.join(out_dir, f))]
    if taken:
        raise ValueError(f"out_dir {out_dir!r} holds directories where the demo writes its files: "
                         f"{', '.join(taken)}.")


def run_demo(out_dir: str, *, size: str = "full", seed: int = 0, progress: bool = True) -> str:
    """Run the demo and write ``report.md``, PNG plots and ``results.json`` into ``out_dir``.

    Parameters
    ----------
    out_dir : str
        Output directory (created if missing).
    size : {"full", "quick", "tiny"}, default="full"
        ``full`` (about 1-3 minutes on 2 cores), ``quick`` (about 10-30 s), ``tiny`` (tests).
    seed : int, default=0
        Seed of the features, batches and the random reference configuration.  Parts
        with budgets in seconds depend on the machine's speed as well, so two runs with
        one seed can differ there: the steps the exact LMO and the spreading update
        take, and the steps at which the update diagnostics run.
    progress : bool, default=True
        Show a progress bar on stderr.

    Returns
    -------
    path : str
        Path of ``report.md``.
    """
    check_choice(size, "size", tuple(SIZES))
    cfg = SIZES[size]
    t_all = time.perf_counter()
    _check_out_dir(out_dir)
    timings: dict[str, float] = {}

    t0 = time.perf_counter()
    text = corpus.build_corpus(vocab_size=cfg.vocab, max_files=cfg.max_files)
    timings["corpus (read + tokenize)"] = time.perf_counter() - t0
    cfg = dataclasses.replace(cfg, vocab=len(text.vocab))

    rng = np.random.default_rng(seed)
    ids = np.asarray(text.ids, dtype=np.int64)
    n = len(ids)
    split = int(0.9 * n)
    c = cfg.context
    feats = Features(cfg.vocab, cfg.d, c, rng)
    held = rng.permutation(np.arange(split + c, n))
    eval_pos, panel_pos, tok_pos = held[: cfg.n_eval], held[cfg.n_eval : cfg.n_eval + cfg.n_panel], \
        held[cfg.n_eval + cfg.n_panel : cfg.n_eval + cfg.n_panel + cfg.n_tokenwise]
    _, H_eval = feats(ids, eval_pos)
    y_eval = ids[eval_pos]
    _, H_panel = feats(ids, panel_pos)
    batches = rng.integers(c, split, size=(cfg.steps, cfg.batch))

    methods, skipped = training.make_methods(cfg)
    bar = training.Progress(cfg.steps * len(methods), progress)
    runs: list[training.Run] = []
    lmo_source = "rownorm"
    try:
        for name, label, factory in methods:
            runs.append(training.train(name, label, factory, size=cfg, batches=batches, feats=feats, ids=ids,
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
        lmo = analysis.lmo_track(src, cfg)
        exact = next((r for r in runs if r.name == "exact_lmo"), None)
        if exact is not None and exact.gaps:
            lmo["optimizer_label"] = exact.label
            lmo["optimizer_gaps"] = [[t, g] for t, g in exact.gaps]
    timings["LMO certificates"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    geo = analysis.head_geometry(runs, cfg, ids[batches], rng)
    timings["final-head geometry"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    head = next((r for r in runs if r.name == "rownorm"), runs[0])
    tok = analysis.tokenwise(feats, ids, tok_pos, head)
    timings["tokenwise decomposition"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    files, why = plots.plot_all(out_dir, runs, cfg, lmo, geo, tok)
    if why:
        skipped.append(why)
    timings["plots"] = time.perf_counter() - t0
    timings["total"] = time.perf_counter() - t_all

    path = report.write_report(out_dir, size_name=size, size=cfg, seed=seed, corpus=text, runs=runs, lmo=lmo,
                               geo=geo, tok=tok, files=files, skipped=skipped, timings=timings)
    with open(os.path.join(out_dir, "results.json"), "w", encoding="utf-8") as fh:
        json.dump(report.results_json(runs, lmo, geo, tok, timings, size, cfg, text), fh, indent=1)
    return path
