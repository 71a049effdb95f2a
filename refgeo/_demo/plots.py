"""The demo's plots: PNG files (matplotlib, Agg backend) for the report.

One figure per report section: the loss curves, the step geometry (row diameter and
Hilbert RMS of every update against its bound), the certified LMO gap and the
RowNorm/exact ratio, the distance ratio of the trained heads, and the per-token
metrics of the tokenwise decomposition.  matplotlib is optional: without it the
report has tables only.

Examples
--------
>>> smooth([1.0, 3.0, 5.0, 7.0], 2).tolist()  # running mean, the first k - 1 over fewer points
[1.0, 2.0, 4.0, 6.0]
"""

from __future__ import annotations

import math
import os

import numpy as np

from .training import DemoSize, Run

__all__ = ["plot_all", "run_label", "smooth"]


_COLORS = {"adamw": "tab:gray", "rownorm": "tab:blue", "rescaled": "tab:green", "exact_lmo": "tab:red",
           "spread": "tab:purple"}
# Rescaled RowNorm often retraces RowNorm: a dash-dot line on top keeps both visible.
_STYLES = {"rescaled": "-."}


def run_label(r, planned: int) -> str:
    """The run's label, saying why and after which step a run ended before ``planned``
    steps: its time budget (``stopped_early``) or an error (the legend said "stopped
    at step 14" for a run the report, rightly, said stopped after 13, named no run
    that stopped one step short, and blamed the time budget for errors)."""
    if r.error is not None:
        return f"{r.label} (error after step {r.steps_done})"
    if r.stopped_early and r.steps_done < planned:
        return f"{r.label} (time budget: stopped after step {r.steps_done} of {planned})"
    return r.label


def smooth(y: list[float], k: int) -> np.ndarray:
    """Running mean over ``k`` points (the first ``k - 1`` values average what there is)."""
    a = np.asarray(y, dtype=float)
    if k <= 1 or len(a) < k:
        return a
    c = np.cumsum(np.insert(a, 0, 0.0))
    head = c[1:k] / np.arange(1, k)
    return np.concatenate([head, (c[k:] - c[:-k]) / k])


def plot_all(out_dir: str, runs: list[Run], size: DemoSize, lmo: dict | None, geo: dict | None,
             tok: dict | None) -> tuple[dict[str, str], str | None]:
    """Write the PNG plots into ``out_dir``; return ``({plot: file name}, why not)``.

    ``lmo``, ``geo`` and ``tok`` are the results of :mod:`refgeo._demo.analysis` (None:
    that plot is left out).  Without matplotlib no file is written and the second item
    says so.
    """
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return {}, "plots: matplotlib is not installed (`pip install matplotlib`); the report has tables only."
    files: dict[str, str] = {}
    eta = 2.0 * size.gamma
    title_sfx = f"(V={size.vocab}, d={size.d}, batch {size.batch})"

    fig, ax = plt.subplots(figsize=(11, 4.8))
    for r in runs:
        c = _COLORS.get(r.name)
        ax.plot(r.steps, smooth(r.train_loss, max(1, size.steps // 20)), color=c, lw=1.4,
                ls=_STYLES.get(r.name, "-"), label=f"{run_label(r, size.steps)}: train (moving avg)")
        ax.plot(r.eval_steps, r.eval_loss, color=c, ls="--", marker="o", ms=3, lw=1, label=f"{r.label}: held-out")
    ax.set_xlabel("training step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(f"Next-token loss of the LM head on Python's documentation\n{title_sfx}")
    ax.axhline(math.log(size.vocab), color="k", lw=0.6, ls=":", label=f"uniform, log V = {math.log(size.vocab):.2f}")
    ax.legend(fontsize=7, ncol=1, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "loss.png"), dpi=110)
    plt.close(fig)
    files["loss"] = "loss.png"

    if any(r.D for r in runs):
        fig, axes = plt.subplots(1, 2, figsize=(15, 4.8), gridspec_kw={"width_ratios": [1, 1]})
        ax = axes[0]
        for r in runs:
            if r.D:
                ax.plot(r.diag_steps, r.D, color=_COLORS.get(r.name), lw=1.2, marker=".", ms=4,
                        ls=_STYLES.get(r.name, "-"), label=r.label)
        ax.axhline(eta, color="k", ls=":", lw=1.5, zorder=5, label=f"diameter budget eta = 2 gamma = {eta:g}")
        ax.set_yscale("log")
        ax.set_xlabel("training step t")
        ax.set_ylabel("row diameter D(S_t)  (certified)")
        ax.set_title("Row diameter of each update S_t = W_t - W_{t-1}")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3, which="both")
        ax = axes[1]
        for r in runs:
            if r.rms:
                c = _COLORS.get(r.name)
                ax.plot(r.diag_steps, r.rms, color=c, lw=1.2, marker=".", ms=4, label=f"{r.label}: Hilbert RMS")
                ax.plot(r.diag_steps, r.bound, color=c, lw=1, ls="--", marker="x", ms=3,
                        label=f"{r.label}: bound max||h|| D(S_t)")
        ax.set_yscale("log")
        ax.set_xlabel("training step t")
        ax.set_ylabel("Hilbert distance of output distributions")
        ax.set_title(f"Hilbert RMS of each step over {size.n_panel} held-out states vs its bound")
        ax.legend(fontsize=7, ncol=1, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        ax.grid(alpha=0.3, which="both")
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "step_geometry.png"), dpi=110)
        plt.close(fig)
        files["step_geometry"] = "step_geometry.png"

    if lmo is not None and lmo["steps"]:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
        ax = axes[0]
        gaps = np.maximum(np.asarray(lmo["gap"], dtype=float), 1e-16)
        ax.plot(lmo["steps"], gaps, "o-", color="tab:blue",
                label=f"certificate for G_t ({lmo['rows']} largest rows, {lmo['trajectory'].split(' (')[0]} run)")
        if lmo.get("optimizer_gaps"):
            og = np.asarray(lmo["optimizer_gaps"], dtype=float)
            ax.plot(og[:, 0], np.maximum(og[:, 1], 1e-16), ".-", color="tab:red", ms=4,
                    label="each step of the exact-LMO optimizer (all rows, warm-started)")
        ax.set_yscale("log")
        ax.set_xlabel("training step t")
        ax.set_ylabel("relative gap (upper - lower) / upper")
        ax.set_title("Exact diameter LMO: certified optimality gap along training")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3, which="both")
        ax = axes[1]
        lo_r, hi_r = np.asarray(lmo["ratio_lo"], dtype=float), np.asarray(lmo["ratio_hi"], dtype=float)
        ax.errorbar(lmo["steps"], lo_r, yerr=[np.zeros_like(lo_r), hi_r - lo_r], fmt="o-", color="tab:blue",
                    ms=4, capsize=4, lw=1,
                    label="RowNorm / exact: (1/2) sum ||g_i|| / T(G), certified range (bar)")
        ax.axhline(1 / math.sqrt(2), color="k", ls=":", label="guarantee 1/sqrt(2)")
        ax.axhline(1.0, color="k", ls="-", lw=0.6)
        ax.set_ylim(0.6, 1.02)
        ax.set_xlabel("training step t")
        ax.set_ylabel("decrease of RowNorm / decrease of the exact LMO")
        ax.set_title("How much of the steepest-descent decrease RowNorm gets")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "lmo.png"), dpi=110)
        plt.close(fig)
        files["lmo"] = "lmo.png"

    if geo is not None and geo["methods"]:
        fig, ax = plt.subplots(figsize=(8.5, 5.6))
        names = list(geo["methods"])
        labels = [next(r.label for r in runs if r.name == n).split(" (")[0] for n in names]
        x = np.arange(len(names))
        cols = [_COLORS.get(n, "tab:blue") for n in names]
        floor = 1e-4  # log axis: a zero ratio (identical rows) is drawn at the floor and labeled
        all_rho = [geo["methods"][n]["rho"] for n in names]
        seen_rho = [geo["methods"][n]["rho_seen"] for n in names]
        ax.bar(x - 0.2, [max(v, floor) for v in all_rho], width=0.4, color=cols, alpha=0.45, edgecolor="k",
               label=f"all {geo['V']} rows")
        ax.bar(x + 0.2, [max(v, floor) for v in seen_rho], width=0.4, color=cols, edgecolor="k", hatch="//",
               label="rows of the most frequent training targets")
        for xi, v in zip(x, all_rho):
            ax.text(xi - 0.2, max(v, floor) * 1.15, "0 (equal rows)" if v == 0 else f"{v:.3g}", ha="center",
                    fontsize=7, rotation=90 if v == 0 else 0, va="bottom")
        for xi, v in zip(x, seen_rho):
            ax.text(xi + 0.2, max(v, floor) * 1.15, f"{v:.3g}", ha="center", fontsize=7, va="bottom")
        if "upper_bound" in geo:
            ax.axhline(geo["upper_bound"], color="k", ls="--",
                       label=f"all {geo['V']} rows: upper bound on rho for d = {geo['d']}: {geo['upper_bound']:.3f}")
        ax.axhline(geo["random_sphere_rho"], color="tab:orange", ls=":",
                   label=f"all {geo['V']} rows: random unit rows, same d: {geo['random_sphere_rho']:.3f}")
        if "spread_rho" in geo:
            ax.axhline(geo["spread_rho"], color="tab:purple", ls="-.",
                       label=f"all {geo['V']} rows: max-min solver refgeo.spread: {geo['spread_rho']:.3f}")
        ub_seen = [geo["methods"][n].get("upper_bound_seen") for n in names]
        if ub_seen and ub_seen[0] is not None and len({round(u, 12) for u in ub_seen if u is not None}) == 1:
            ax.axhline(ub_seen[0], color="k", ls=(0, (1, 3)),
                       label=f"{geo['methods'][names[0]]['n_seen']} frequent rows: upper bound {ub_seen[0]:.3f}")
        ax.set_yscale("log")
        ax.set_ylim(floor, 1.5)
        ax.set_xticks(x, labels, rotation=15)
        ax.set_xlabel("optimizer")
        ax.set_ylabel("distance ratio rho = m(W) / D(W)  (log scale)")
        ax.set_title("Geometry of the trained head: closest pair / diameter of its rows")
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=2)
        ax.grid(alpha=0.3, axis="y", which="both")
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "head_geometry.png"), dpi=110)
        plt.close(fig)
        files["head_geometry"] = "head_geometry.png"

    if tok is not None and tok.get("per_token"):
        per = tok["per_token"]
        panels = [k for k in ("relative_error", "angle", "kl") if k in per or (k == "angle" and "angle_rho_tau" in per)]
        fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4.3), squeeze=False)
        for ax, key in zip(axes[0], panels):
            if key == "relative_error":
                v = np.asarray(per["relative_error"], dtype=float)
                v = v[np.isfinite(v)]
                ax.hist(v, bins=40, color="tab:cyan", edgecolor="k", lw=0.3, label=f"{len(v)} tokens")
                ax.axvline(float(np.median(v)), color="k", ls="--", label=f"median {np.median(v):.3g}")
                ax.set_xlabel("relative error ||r_i|| / ||Delta_i||")
                ax.set_ylabel("number of tokens")
                ax.set_title("Residual size of the tokenwise fit", fontsize=10)
            elif key == "angle":
                for name, color, lab in (("angle_delta_tau", "tab:blue", "angle(Delta_i, tau_i)"),
                                         ("angle_rho_tau", "tab:red", "angle(r_i, tau_i)")):
                    if name in per:
                        v = np.asarray(per[name], dtype=float)
                        v = v[np.isfinite(v)]
                        ax.hist(v, bins=36, range=(0, 180), alpha=0.6, color=color, label=lab)
                ax.axvline(60, color="k", ls=":", lw=1, label="60 degrees")
                ax.set_xlabel("angle (degrees)")
                ax.set_ylabel("number of tokens")
                ax.set_title("Alignment: full update, tokenwise part, residual", fontsize=10)
            else:
                e = np.asarray(per["relative_error"], dtype=float)
                kl = np.asarray(per["kl"], dtype=float)
                ok = np.isfinite(e) & np.isfinite(kl) & (e > 0) & (kl > 0)
                sp = tok["scalars"].get("spearman_error_kl")
                lab = f"tokens (Spearman {sp:.2f})" if sp is not None else "tokens"
                ax.scatter(e[ok], kl[ok], s=5, alpha=0.5, color="tab:purple", label=lab)
                ax.set_xscale("log")
                ax.set_yscale("log")
                # the errors span less than a decade: label the 2x and 5x minor ticks too
                ax.xaxis.set_minor_locator(matplotlib.ticker.LogLocator(subs=(2.0, 5.0)))
                ax.xaxis.set_minor_formatter(matplotlib.ticker.LogFormatterSciNotation(labelOnlyBase=False))
                ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
                ax.set_xlabel("relative error ||r_i|| / ||Delta_i||")
                ax.set_ylabel("KL(p_orig || p_patched) (nats)")
                ax.set_title("Output change when h1 is patched by its fit\n(head: " + tok.get("head", "") + ")",
                             fontsize=10)
            ax.legend(fontsize=7)
            ax.grid(alpha=0.3)
        fig.suptitle(f"Tokenwise decomposition of the feature layer h0 -> h1 ({tok['N']} held-out tokens, "
                     f"{tok['cls']} local maps, k = {tok['k']})", fontsize=11)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "tokenwise.png"), dpi=110)
        plt.close(fig)
        files["tokenwise"] = "tokenwise.png"
    return files, None

