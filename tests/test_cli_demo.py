"""``refgeo demo``: the report, its plots, finite numbers; the corpus, the model and the checker.

The default suite runs the demo at its internal ``tiny`` size (seconds); the real
``--quick`` run is marked slow.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import pathlib
import re
import select
import struct
import sys

import numpy as np
import pytest
from scipy.special import log_softmax

from refgeo import _demo, cli
from refgeo._demo import corpus, model, training

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load_checker():
    path = ROOT / "tools" / "check_demo_report.py"
    if not path.exists():
        pytest.skip("tools/check_demo_report.py is not in this checkout")
    spec = importlib.util.spec_from_file_location("check_demo_report", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def checker():
    return _load_checker()


def _read_all(fd: int) -> str:
    chunks = []
    while select.select([fd], [], [], 0)[0]:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # the slave side is closed
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode("utf-8", "replace")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """The tiny demo, run as ``refgeo demo`` with stderr on a real terminal (a pseudo-terminal)."""
    pty = pytest.importorskip("pty")
    out = tmp_path_factory.mktemp("demo_tiny")
    master, slave = pty.openpty()
    # a fresh pseudo-terminal is 0 x 0: give it a size, or a tqdm bar with dynamic
    # width (tqdm installed) draws nothing at all
    fcntl = pytest.importorskip("fcntl")
    termios = pytest.importorskip("termios")
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    saved = sys.stderr
    try:
        with os.fdopen(slave, "w") as stream:
            sys.stderr = stream
            try:
                rc = cli.main(["demo", "--size", "tiny", "--out", str(out)])
            finally:
                sys.stderr = saved
        terminal = _read_all(master)
    finally:
        os.close(master)
    assert rc == 0
    return out, terminal


@pytest.fixture(scope="module")
def tiny_report(tiny_run):
    return tiny_run[0]


# ------------------------------------------------------------------ the demo end to end

def test_tiny_demo_writes_report_plots_and_json(tiny_report, checker):
    assert checker.check(str(tiny_report)) == []
    text = (tiny_report / "report.md").read_text(encoding="utf-8")
    for png in ("loss.png", "step_geometry.png", "head_geometry.png"):
        assert f"]({png})" in text
        assert (tiny_report / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((tiny_report / "results.json").read_text(encoding="utf-8"))
    assert "adamw" in data["runs"]
    assert data["corpus"]["vocab"] == _demo.SIZES["tiny"].vocab


def test_tiny_demo_numbers_are_consistent(tiny_report):
    data = json.loads((tiny_report / "results.json").read_text(encoding="utf-8"))
    V = data["corpus"]["vocab"]
    for name, run in data["runs"].items():
        # the first held-out loss is at W = 0: exactly the uniform prediction log V
        assert run["eval_loss"][0] == pytest.approx(math.log(V), rel=1e-12), name
        assert all(math.isfinite(x) for x in run["train_loss"])
        # Hilbert RMS never exceeds max ||h|| D(S_t) (docs/theory/rows.md)
        for rms, bound in zip(run["hilbert_rms"], run["bound"]):
            assert rms <= bound * (1 + 1e-12)
    eta = 2 * data["config"]["gamma"]
    if "rownorm" in data["runs"]:
        # RowNorm guarantees D(S_t) <= 2 gamma
        assert max(data["runs"]["rownorm"]["D"]) <= eta * (1 + 1e-12)
    for name in ("rescaled", "exact_lmo"):
        if name in data["runs"]:
            assert max(data["runs"][name]["D"]) <= eta * (1 + 1e-9), name
    geo = data["head_geometry"]
    if geo is not None and "upper_bound" in geo:
        for rec in geo["methods"].values():
            assert 0.0 <= rec["rho"] <= geo["upper_bound"] + 1e-12
    lmo = data["lmo"]
    if lmo is not None:
        for lo, hi in zip(lmo["ratio_lo"], lmo["ratio_hi"]):
            # RowNorm gets at least 1/sqrt(2) of the exact decrease (docs/theory/lmo.md)
            assert 1 / math.sqrt(2) - 1e-9 <= hi and lo <= hi <= 1.0


def test_demo_report_mentions_what_was_skipped(tiny_report):
    text = (tiny_report / "report.md").read_text(encoding="utf-8")
    data = json.loads((tiny_report / "results.json").read_text(encoding="utf-8"))
    for run in data["runs"].values():
        if run["stopped_early"]:
            assert f"stopped after {run['steps_done']} of" in text


def test_demo_survives_a_failing_optimizer(tmp_path, monkeypatch, checker):
    class Broken:
        def __init__(self, **kwargs):
            self.t = 0

        def step(self, param, grad):
            self.t += 1
            if self.t == 3:
                raise FloatingPointError("planted failure")
            param -= 0.01 * grad
            return param

    monkeypatch.setattr(training, "RowNorm", Broken)
    path = _demo.run_demo(str(tmp_path), size="tiny", progress=False)
    text = pathlib.Path(path).read_text(encoding="utf-8")
    assert "failed after 2 steps (FloatingPointError: planted failure)" in text
    assert checker.check(str(tmp_path)) == []
    data = json.loads((tmp_path / "results.json").read_text(encoding="utf-8"))
    assert data["runs"]["rownorm"]["steps_done"] == 2
    assert data["runs"]["adamw"]["steps_done"] == _demo.SIZES["tiny"].steps


def test_run_labels_say_why_and_after_which_step_a_run_ended():
    """The legend said "stopped at step 14" for a run that stopped after 13 (as the
    report said), nothing for a run that stopped one step short, and "time budget"
    for a run that ended with an error."""
    from refgeo._demo.plots import run_label

    r = training.Run("x", "X")
    r.steps, r.steps_done, r.stopped_early = list(range(1, 12)), 11, True
    assert run_label(r, 24) == "X (time budget: stopped after step 11 of 24)"
    r.steps, r.steps_done = list(range(1, 24)), 23
    assert run_label(r, 24) == "X (time budget: stopped after step 23 of 24)"
    e = training.Run("a", "A")
    e.steps, e.steps_done, e.error = [1, 2, 3], 3, "FloatingPointError: planted"
    assert run_label(e, 24) == "A (error after step 3)"
    done = training.Run("b", "B")
    done.steps, done.steps_done = list(range(1, 25)), 24
    assert run_label(done, 24) == "B"


@pytest.mark.parametrize("case", ["report_is_a_directory", "unwritable", "empty"])
def test_demo_refuses_an_output_folder_it_cannot_write_before_training(tmp_path, monkeypatch, capsys, case):
    """A folder the demo could not write to failed only when the first plot was saved,
    after the training (minutes at the default size)."""
    if case == "report_is_a_directory":
        (tmp_path / "report.md").mkdir()
        out, want = str(tmp_path), "holds directories where the demo writes its files: report.md"
    elif case == "unwritable":
        if not os.path.isdir("/proc/self"):
            pytest.skip("no unwritable directory here")
        out, want = "/proc/self", "is not a directory the demo can write to"
    else:
        out, want = "", "--out must name a directory, got '' instead"

    def no_training(*args, **kwargs):
        raise AssertionError("the demo trained before checking its output folder")

    monkeypatch.setattr(training, "train", no_training)
    assert cli.main(["demo", "--size", "tiny", "--out", out, "--no-progress"]) == 2
    assert want in capsys.readouterr().err
    with pytest.raises(ValueError, match="out_dir"):
        _demo.run_demo(out, size="tiny", progress=False)


def test_run_demo_rejects_unknown_size(tmp_path):
    with pytest.raises(ValueError, match=re.escape("size must be one of ('full', 'quick', 'tiny'), got 'huge' instead.")):
        _demo.run_demo(str(tmp_path), size="huge")


@pytest.mark.slow
def test_quick_demo(tmp_path, checker):
    rc = cli.main(["demo", "--quick", "--out", str(tmp_path / "demo"), "--no-progress"])
    assert rc == 0
    assert checker.check(str(tmp_path / "demo")) == []


# ------------------------------------------------------------------ progress

def test_progress_counter_without_tqdm(monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm now raises ImportError
    bar = training.Progress(total=3, enabled=True)
    bar.describe("adamw")
    for _ in range(3):
        bar.update()
    bar.close()
    err = capsys.readouterr().err
    assert "[refgeo demo] adamw: 3/3 steps" in err


def test_demo_shows_progress_on_a_terminal(tiny_run):
    _, terminal = tiny_run
    for name in ("adamw", "rownorm", "rescaled", "exact_lmo"):
        assert name in terminal
    assert "refgeo demo: wrote" in terminal


def test_progress_disabled_is_silent(capsys):
    bar = training.Progress(total=2, enabled=False)
    bar.describe("x")
    bar.update(2)
    bar.close()
    assert capsys.readouterr().err == ""


# ------------------------------------------------------------------ corpus and model

def test_corpus_vocabulary_and_unknown_rate():
    c = corpus.build_corpus(vocab_size=50, max_files=2)
    assert c.vocab[0] == "<unk>" and len(c.vocab) == 50
    assert len(set(c.vocab)) == 50
    assert c.ids.min() >= 0 and c.ids.max() < 50
    assert not c.ids.flags.writeable
    assert c.unk_rate == pytest.approx(float(np.mean(c.ids == 0)))
    assert c.sources["stdlib files"] <= 2


def test_vocabulary_keeps_most_frequent_tokens_brute_force():
    tokens = corpus.tokenize("b a c a b a d e e e e , , .")
    vocab, ids = corpus.build_vocabulary(tokens, vocab_size=4)
    counts = {t: tokens.count(t) for t in set(tokens)}
    ranked = sorted(counts, key=lambda t: (-counts[t], t))
    assert vocab == ["<unk>"] + ranked[:3]
    assert [vocab[i] if i else None for i in ids] == [t if t in vocab else None for t in tokens]


def test_loss_and_gradient_match_log_softmax_and_finite_differences():
    rng = np.random.default_rng(0)
    V, d, B = 7, 3, 5
    W = rng.standard_normal((V, d))
    H = rng.standard_normal((B, d))
    y = rng.integers(0, V, B)
    loss, G = model.loss_grad(W, H, y)
    assert loss == pytest.approx(-np.mean(log_softmax(H @ W.T, axis=1)[np.arange(B), y]), rel=1e-13)
    assert model.loss(W, H, y, chunk=2) == pytest.approx(loss, rel=1e-13)
    np.testing.assert_allclose(G.sum(axis=0), 0.0, atol=1e-13)  # 1^T G = 0
    eps = 1e-6
    for i, j in [(0, 0), (3, 1), (6, 2)]:
        E = np.zeros_like(W)
        E[i, j] = eps
        num = (model.loss(W + E, H, y) - model.loss(W - E, H, y)) / (2 * eps)
        assert G[i, j] == pytest.approx(num, rel=1e-6, abs=1e-9)


def test_adamw_first_step_is_signed_and_decays():
    # first bias-corrected Adam step is -lr * g / (|g| + eps) = -lr * sign(g), plus decoupled decay
    opt = training.AdamW(0.1, weight_decay=0.5)
    W = np.array([[1.0, -2.0], [0.0, 3.0]])
    G = np.array([[2.0, -0.5], [-3.0, 1e-3]])
    S = opt.update(W, G, 1)
    np.testing.assert_allclose(S, -0.1 * (np.sign(G) + 0.5 * W), rtol=1e-4)


def test_tokenwise_section_leaves_out_copies_of_a_state():
    """Held-out tokens with the same context window have the same state; leave-one-out
    removes only the token itself, so its copies were its neighbors at distance 0 and
    fitted it exactly (at the tiny size 81 of 200 tokens, median relative error 7e-6
    against 0.33, and the reported medians and energy fraction were biased)."""
    from refgeo._demo import analysis

    rng = np.random.default_rng(0)
    feats = model.Features(20, 8, 2, rng)
    ids = rng.integers(0, 20, size=400)
    ids[200:260] = ids[100:160]  # a repeated passage: 58 windows seen twice
    pos = np.arange(2, 400)
    X, _ = feats(ids, pos)
    distinct = np.unique(X, axis=0).shape[0]
    assert distinct < len(pos)
    out = analysis.tokenwise(feats, ids, pos, None)
    assert out["N"] == distinct and out["duplicates_dropped"] == len(pos) - distinct
    # no token is fitted by a copy of itself (with the copies kept the smallest was 4e-4)
    assert np.min(out["per_token"]["relative_error"]) > 1e-3


def test_features_are_fixed_and_shaped():
    rng = np.random.default_rng(1)
    f = model.Features(V=20, d=6, context=3, rng=rng)
    ids = np.arange(40) % 20
    pos = np.array([3, 10, 39])
    h0, h1 = f(ids, pos)
    assert h0.shape == h1.shape == (3, 6)
    np.testing.assert_array_equal(h0[:, -1], 1.0)
    np.testing.assert_array_equal(h1[:, -1], 1.0)
    expect = f.E[0][ids[pos - 1]] + f.E[1][ids[pos - 2]] + f.E[2][ids[pos - 3]]
    np.testing.assert_allclose(h0[:, :-1], expect[:, :-1], rtol=1e-15)
    np.testing.assert_allclose(h1[:, :-1], (expect + np.tanh(expect @ f.R))[:, :-1], rtol=1e-15)


# ------------------------------------------------------------------ the CI checker

def _write_minimal(out: pathlib.Path, text: str, results: str = '{"x": 1.0}') -> None:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(3, 2))
    fig.savefig(out / "loss.png", dpi=100)
    plt.close(fig)
    (out / "report.md").write_text(text, encoding="utf-8")
    (out / "results.json").write_text(results, encoding="utf-8")


SECTIONS = "\n".join(
    ["## 1. Loss curves", "![loss](loss.png)", "## 2. Step geometry", "## 3. Diameter LMO",
     "## 4. Geometry of the final head", "## 5. Tokenwise decomposition", "## 6. Timings",
     "information, infinite and Finland are words, not numbers: 1.5e-3"]
)


def test_checker_accepts_a_good_report(tmp_path, checker):
    _write_minimal(tmp_path, SECTIONS)
    assert checker.check(str(tmp_path)) == []
    assert checker.main([str(tmp_path)]) == 0


@pytest.mark.parametrize("bad", ["| loss | nan |", "| D | inf |", "value -Infinity here", "NaN"])
def test_checker_rejects_non_finite_numbers_in_report(tmp_path, checker, bad):
    _write_minimal(tmp_path, SECTIONS + "\n" + bad)
    problems = checker.check(str(tmp_path))
    assert len(problems) == 1 and "non-finite" in problems[0]
    assert checker.main([str(tmp_path)]) == 1


def test_checker_rejects_non_finite_json(tmp_path, checker):
    _write_minimal(tmp_path, SECTIONS, results='{"a": [1.0, NaN]}')
    assert any("results.json" in p for p in checker.check(str(tmp_path)))
    _write_minimal(tmp_path, SECTIONS, results='{"a": 1e999}')
    assert any("non-finite number" in p for p in checker.check(str(tmp_path)))


def test_checker_rejects_missing_plot_section_and_report(tmp_path, checker):
    _write_minimal(tmp_path, SECTIONS.replace("## 4. Geometry of the final head", "") + "\n![x](gone.png)")
    problems = checker.check(str(tmp_path))
    assert any("gone.png" in p for p in problems)
    assert any("Geometry of the final head" in p for p in problems)
    (tmp_path / "fake.png").write_text("not a png")
    _write_minimal(tmp_path, SECTIONS + "\n![f](fake.png)")
    assert any("not a PNG" in p for p in checker.check(str(tmp_path)))
    assert checker.check(str(tmp_path / "nowhere")) == [f"{tmp_path / 'nowhere' / 'report.md'} does not exist"]
