"""The demo's report: ``report.md`` (six numbered sections) and ``results.json``.

The sections are fixed (``tools/check_demo_report.py`` checks them): 1. loss curves,
2. step geometry, 3. diameter LMO, 4. geometry of the final head, 5. tokenwise
decomposition, 6. timings; a last list says what was skipped or stopped early and why.
Every number is finite: ``results.json`` is written without NaN or Infinity.

Examples
--------
>>> fmt(2 / 3), fmt(2 / 3, 2)
('0.6667', '0.67')
"""

from __future__ import annotations

import dataclasses
import math
import os
import platform
from typing import Any

import numpy as np

from refgeo import __version__, get_backend

from .corpus import Corpus
from .training import MOMENTUM, DemoSize, Run

__all__ = ["fmt", "results_json", "write_report"]


def fmt(x: float, digits: int = 4) -> str:
    """``x`` with ``digits`` significant digits."""
    return f"{x:.{digits}g}"


def write_report(out_dir: str, *, size_name: str, size: DemoSize, seed: int, corpus: Corpus,
                 runs: list[Run], lmo: dict | None, geo: dict, tok: dict, files: dict[str, str],
                 skipped: list[str], timings: dict[str, float]) -> str:
    """Write ``out_dir/report.md`` from the runs and the analyses; return its path.

    ``lmo`` is None when no gradients were recorded (the run they come from failed at
    its first step); ``files`` names the plots that :func:`refgeo._demo.plots.plot_all`
    wrote; ``skipped`` lists what was left out or stopped early, one line each.
    """

    eta = 2.0 * size.gamma
    L: list[str] = []
    L.append("# refgeo demo: LM-head update geometry on Python's own documentation\n")
    L.append(f"refgeo {__version__}, Python {platform.python_version()}, NumPy {np.__version__}, "
             f"backend `{get_backend()}`; size `{size_name}`, seed {seed}.\n")
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
             f"{MOMENTUM}; the diameter-budget methods use eta = 2 gamma = {eta:g}, the bound that "
             f"RowNorm guarantees (D(S_t) <= 2 gamma).\n")

    L.append("## 1. Loss curves\n")
    if "loss" in files:
        L.append(f"![Training and held-out cross-entropy per optimizer]({files['loss']})\n")
    L.append("| optimizer | steps run | final train loss (mean of last 10%) | final held-out loss | best held-out loss |")
    L.append("|---|---|---|---|---|")
    for r in runs:
        k = max(1, len(r.train_loss) // 10)
        note = " (stopped by time budget)" if r.stopped_early else ""
        L.append(f"| {r.label} | {r.steps_done}{note} | {fmt(float(np.mean(r.train_loss[-k:])))} | "
                 f"{fmt(r.eval_loss[-1])} | {fmt(min(r.eval_loss))} |")
    L.append(f"\nUniform prediction: log V = {fmt(math.log(size.vocab))} nats.\n")

    L.append("## 2. Step geometry: D(S_t) and Hilbert RMS against the bound\n")
    if "step_geometry" in files:
        L.append(f"![Row diameter and Hilbert RMS of every update]({files['step_geometry']})\n")
    L.append(f"At step 1 and every {size.diag_every} steps or more (the interval grows to keep these "
             f"diagnostics within {size.diag_budget_s:g} s per optimizer; results.json lists the steps): "
             "the certified row diameter of the actual update S_t and the "
             f"Hilbert RMS of the step over {size.n_panel} held-out hidden states, against the bound "
             "max ‖h‖ D(S_t) (docs/theory/rows.md: the worst case over the ball is attained, the RMS never "
             "exceeds it).\n")
    L.append("| optimizer | median D(S_t) | max D(S_t) / eta | median RMS / bound | max RMS / bound |")
    L.append("|---|---|---|---|---|")
    for r in runs:
        D = np.asarray(r.D)
        ratio = np.asarray(r.rms) / np.maximum(np.asarray(r.bound), 1e-300)
        L.append(f"| {r.label} | {fmt(float(np.median(D)))} | {fmt(float(D.max()) / eta)} | "
                 f"{fmt(float(np.median(ratio)))} | {fmt(float(ratio.max()))} |")
    L.append("")

    L.append("## 3. Diameter LMO: certified gap and RowNorm / exact ratio\n")
    if lmo is not None and lmo["steps"]:
        if "lmo" in files:
            L.append(f"![Certified LMO gap and RowNorm/exact ratio along training]({files['lmo']})\n")
        L.append(f"Minibatch gradients G_t of the {lmo['trajectory']} trajectory, restricted to their "
                 f"{lmo['rows']} rows of largest norm and re-centered; exact LMO solved with eta = 1. "
                 "The min-tension value T(G) is certified between `lower` and `upper` (the solver's bracket "
                 "intersected with the closed-form bounds of `refgeo.tension_bounds`); RowNorm's decrease per "
                 "unit diameter is (1/2) sum ‖g_i‖ (docs/theory/lmo.md), guaranteed >= T(G)/sqrt(2).\n")
        L.append("| step | T(G) lower | T(G) upper | relative gap | (1/2) sum ‖g_i‖ | RowNorm / exact | LMO seconds |")
        L.append("|---|---|---|---|---|---|---|")
        for i, t in enumerate(lmo["steps"]):
            L.append(f"| {t} | {fmt(lmo['lower'][i], 6)} | {fmt(lmo['upper'][i], 6)} | {fmt(lmo['gap'][i], 3)} | "
                     f"{fmt(lmo['half_sum'][i], 6)} | {fmt(lmo['ratio_lo'][i])} - {fmt(lmo['ratio_hi'][i])} | "
                     f"{fmt(lmo['seconds'][i], 3)} |")
        if lmo.get("optimizer_gaps"):
            g = np.asarray(lmo["optimizer_gaps"], dtype=float)[:, 1]
            worst = float(np.max(g))
            verdict = (
                "so each step is certified to keep at least (1 - gap) of the optimal decrease"
                if worst <= 1.0 - 1.0 / math.sqrt(2.0)
                else f"with gaps up to {fmt(worst, 3)} its certified share (1 - gap) of the optimal decrease "
                "falls below RowNorm's guaranteed 1/sqrt(2) = 0.707: the time limit per solve was too short "
                "for a certificate at this size (the step itself may still be close to optimal)"
            )
            L.append(f"\nThe {lmo['optimizer_label']} optimizer (all V rows, warm-started, a time limit per solve) "
                     f"certified each of its {len(g)} step{'s' if len(g) != 1 else ''}: gap {fmt(float(g[0]), 3)} at its first step, "
                     f"{fmt(float(g[-1]), 3)} at its last, median {fmt(float(np.median(g)), 3)}; {verdict}.")
        L.append("")
    else:
        L.append("Skipped: no gradients recorded.\n")

    L.append("## 4. Geometry of the final head\n")
    if "head_geometry" in files:
        L.append(f"![Distance ratio of the trained heads against the upper bound]({files['head_geometry']})\n")
    L.append(f"Upper bound on rho = m/D for (V, d) = ({geo['V']}, {geo['d']}): {fmt(geo['upper_bound'])}; random "
             f"unit rows reach rho = {fmt(geo['random_sphere_rho'])}, the max-min solver `refgeo.spread` "
             f"{fmt(geo['spread_rho'])}. Rows of tokens never seen as a training target receive "
             "identical updates from W = 0 (their gradients coincide), so they stay equal and m(W) = 0 "
             "over all rows. Tokens seen only after identical contexts are just as indistinguishable. The "
             "second rho column uses the rows of the most frequent training targets of that run (their "
             "number and the upper bound for that number of rows in brackets).\n")
    L.append("| optimizer | D(W) | m(W) | rho, all rows | rho, frequent-token rows | covering radius (certified range) "
             "| Jung bounds D/2 .. J_k D |")
    L.append("|---|---|---|---|---|---|---|")
    for r in runs:
        g = geo["methods"][r.name]
        rad = f"{fmt(g['rad_lower'])} - {fmt(g['rad'])}" if "rad" in g else "not computed (time budget)"
        L.append(f"| {r.label} | {fmt(g['D'])} | {fmt(g['m'])} | {fmt(g['rho'])} | "
                 f"{fmt(g['rho_seen'])} ({g['n_seen']} rows, bound {fmt(g['upper_bound_seen'])}) | "
                 f"{rad} | {fmt(g['D'] / 2)} .. {fmt(g['jung_upper'])} |")
    L.append("")

    L.append("## 5. Tokenwise decomposition of the features (h0 -> h1)\n")
    if "tokenwise" in files:
        L.append(f"![Per-token metrics of the tokenwise decomposition]({files['tokenwise']})\n")
    dup = tok.get("duplicates_dropped", 0)
    dropped = (f" ({dup} more held-out tokens repeat an earlier token's state: left out, as a copy "
               "would be its neighbor at distance 0 and fit it exactly)") if dup else ""
    L.append(f"{tok['N']} held-out tokens of distinct states{dropped}, d = {tok['d']}: y_i = A(x_i) x_i + r_i "
             "with A fitted on the nearest neighbors of x_i (docs/theory/tokenwise.md).\n")
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
            L.append(f"| {text} | {fmt(tok['scalars'][key])} |")
    L.append(f"| local maps | {tok['cls']}, k = {tok['k']} nearest neighbors, leave-one-out |")
    if "head" in tok:
        L.append(f"| head used for the KL | {tok['head']} |")
    L.append("")

    L.append("## 6. Timings\n")
    L.append("Wall-clock seconds on this machine (shared machines give pessimistic numbers).\n")
    L.append("| stage | seconds | per step (ms) |")
    L.append("|---|---|---|")
    for r in runs:
        L.append(f"| train {r.label}: updates | {fmt(r.update_s, 3)} | {fmt(1e3 * r.update_s / max(1, r.steps_done), 3)} |")
        L.append(f"| train {r.label}: diagnostics | {fmt(r.diag_s, 3)} | {fmt(1e3 * r.diag_s / max(1, r.steps_done), 3)} |")
    for stage, seconds in timings.items():
        L.append(f"| {stage} | {fmt(seconds, 3)} | |")
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


def results_json(runs: list[Run], lmo, geo, tok, timings, size_name, size, corpus) -> dict[str, Any]:
    """Everything the report shows, as JSON-ready Python objects (the per-token arrays left out)."""
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
        "tokenwise": {k: v for k, v in tok.items() if k != "per_token"},
        "timings": timings,
    })

