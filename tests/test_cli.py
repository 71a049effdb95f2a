"""The ``refgeo`` command: every subcommand, its --help, and each error path.

Error paths must print exactly one line to stderr (no traceback) and return 2.
Expected values come from brute force (scipy's pdist) or closed forms of the theory
pages (docs/theory/), never from the code under test.  The pipe, Ctrl-C and
memory-mapping tests run the command as a real process.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
import tracemalloc

import numpy as np
import pytest
from scipy.spatial.distance import pdist

import refgeo
from refgeo import cli

COMMANDS = ["demo", "inspect", "spread", "lmo", "tokenwise", "config"]


def run(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(rc, err, *fragments):
    assert rc == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("refgeo")
    assert ": error: " in lines[0]
    for f in fragments:
        assert f in lines[0], (f, lines[0])


@pytest.fixture
def files(tmp_path):
    """A regular simplex, a random cloud, a .npz with two arrays and some broken files."""
    rng = np.random.default_rng(7)
    p = {}
    p["simplex"] = tmp_path / "simplex.npy"
    np.save(p["simplex"], np.eye(5))
    p["cloud"] = tmp_path / "cloud.npy"
    np.save(p["cloud"], rng.standard_normal((40, 3)))
    p["npz"] = tmp_path / "two.npz"
    np.savez(p["npz"], W=rng.standard_normal((12, 4)), b=rng.standard_normal((12, 4)))
    p["one"] = tmp_path / "one.npz"
    np.savez(p["one"], only=np.eye(3))
    p["vec"] = tmp_path / "vec.npy"
    np.save(p["vec"], np.arange(5.0))
    p["nan"] = tmp_path / "nan.npy"
    np.save(p["nan"], np.array([[0.0, np.nan], [1.0, 2.0]]))
    p["onerow"] = tmp_path / "onerow.npy"
    np.save(p["onerow"], np.ones((1, 3)))
    p["tworows"] = tmp_path / "tworows.npy"
    np.save(p["tworows"], np.array([[0.0, 1.0, 2.0], [1.0, 0.5, 0.0]]))
    p["text"] = tmp_path / "data.txt"
    p["text"].write_text("1 2 3\n")
    p["corrupt"] = tmp_path / "corrupt.npy"
    p["corrupt"].write_bytes(b"this is not a numpy file")
    p["pickled"] = tmp_path / "pickled.npy"
    np.save(p["pickled"], np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    p["strings"] = tmp_path / "strings.npy"
    np.save(p["strings"], np.array([["a", "b"], ["c", "d"]]))
    return {k: str(v) for k, v in p.items()}


# ------------------------------------------------------------------ help and dispatch

@pytest.mark.parametrize("command", COMMANDS)
def test_help_of_every_command(capsys, command):
    rc, out, _ = run(capsys, command, "--help")
    assert rc == 0
    assert out.startswith(f"usage: refgeo {command}")


def test_top_level_help_lists_every_command(capsys):
    rc, out, _ = run(capsys, "--help")
    assert rc == 0
    for c in COMMANDS:
        assert c in out


def test_version(capsys):
    rc, out, _ = run(capsys, "--version")
    assert rc == 0
    assert out.strip() == f"refgeo {refgeo.__version__}"


def test_no_command_is_an_error(capsys):
    rc, _, err = run(capsys)
    assert_one_line_error(rc, err, "choose a command")


def test_unknown_command_is_an_error(capsys):
    rc, _, err = run(capsys, "frobnicate")
    assert_one_line_error(rc, err, "invalid choice")


def test_unknown_option_is_an_error(capsys, files):
    rc, _, err = run(capsys, "inspect", files["simplex"], "--bogus")
    assert_one_line_error(rc, err, "unrecognized arguments")


# ------------------------------------------------------------------ config

def test_config_prints_show_config(capsys):
    rc, out, _ = run(capsys, "config")
    assert rc == 0
    assert out.startswith(f"refgeo {refgeo.__version__}")
    assert "backends:" in out


def test_config_json(capsys):
    rc, out, _ = run(capsys, "config", "--json")
    assert rc == 0
    cfg = json.loads(out)
    assert cfg["refgeo"] == refgeo.__version__
    assert cfg["backends"]["reference"]["available"] is True


# ------------------------------------------------------------------ inspect

def test_inspect_regular_simplex_closed_form(capsys, files):
    # rows e_1..e_5: every distance sqrt(2), rho = 1, rank 4, rad = sqrt(4/5) = J_4 D
    rc, out, _ = run(capsys, "inspect", files["simplex"], "--json")
    assert rc == 0
    rep = json.loads(out)
    assert rep["shape"] == [5, 5]
    assert rep["diameter"]["value"] == pytest.approx(math.sqrt(2), rel=1e-12)
    assert rep["closest_pair"]["value"] == pytest.approx(math.sqrt(2), rel=1e-12)
    assert rep["ratio"] == pytest.approx(1.0, rel=1e-12)
    assert rep["rank_centered"] == 4
    J4 = math.sqrt(4 / 10)
    assert rep["jung"]["J_k"] == pytest.approx(J4, rel=1e-12)
    assert rep["covering_radius"]["radius"] == pytest.approx(math.sqrt(4 / 5), rel=1e-6)
    assert rep["covering_radius"]["lower_bound"] <= math.sqrt(4 / 5) + 1e-12
    assert rep["ratio_upper_bound"] == pytest.approx(1.0)  # V <= d + 1: the simplex is optimal
    w = rep["worst_case_hidden_state"]
    assert np.linalg.norm(w["h"]) == pytest.approx(1.0, rel=1e-12)
    assert w["value"] == pytest.approx(math.sqrt(2), rel=1e-12)


def test_inspect_random_cloud_against_brute_force(capsys, files):
    S = np.load(files["cloud"])
    dist = pdist(S)
    rc, out, _ = run(capsys, "inspect", files["cloud"], "--json", "--H", "2.5")
    assert rc == 0
    rep = json.loads(out)
    assert rep["diameter"]["value"] == pytest.approx(dist.max(), rel=1e-12)
    assert rep["closest_pair"]["value"] == pytest.approx(dist.min(), rel=1e-12)
    assert rep["ratio"] == pytest.approx(dist.min() / dist.max(), rel=1e-12)
    i, j = rep["diameter"]["pair"]
    assert np.linalg.norm(S[i] - S[j]) == pytest.approx(dist.max(), rel=1e-12)
    w = rep["worst_case_hidden_state"]
    h = np.asarray(w["h"])
    assert np.linalg.norm(h) == pytest.approx(2.5, rel=1e-12)
    z = S @ h
    assert z.max() - z.min() == pytest.approx(2.5 * dist.max(), rel=1e-10)  # attains H D(S)
    lo, hi = rep["jung"]["lower"], rep["jung"]["upper"]
    assert lo <= rep["covering_radius"]["radius"] * (1 + 1e-9)
    assert rep["covering_radius"]["lower_bound"] <= hi * (1 + 1e-9)


def test_inspect_text_output(capsys, files):
    rc, out, err = run(capsys, "inspect", files["simplex"])
    assert rc == 0 and err == ""
    assert "diameter D" in out and "closest pair m" in out and "h*" in out
    assert "1.414213562" in out


def test_inspect_zero_hidden_norm_shows_plain_zeros(capsys, files):
    # --H 0: h* is the zero vector; its entries print as 0, not as -0
    rc, out, err = run(capsys, "inspect", files["simplex"], "--H", "0")
    assert rc == 0 and err == ""
    line = next(ln for ln in out.splitlines() if ln.startswith("h*"))
    assert "[0, 0, 0, 0, 0]" in line and "moves logits by 0 " in line, line


def test_inspect_wide_hidden_state_is_shown_with_an_ellipsis(capsys, tmp_path):
    # h* of d = 12 shows its first 8 entries, then ", ..."
    f = tmp_path / "wide.npy"
    np.save(f, np.random.default_rng(2).standard_normal((6, 12)))
    rc, out, err = run(capsys, "inspect", str(f))
    assert rc == 0 and err == ""
    line = next(ln for ln in out.splitlines() if ln.startswith("h*"))
    assert line.count(",") == 8 and ", ...]" in line, line


def test_inspect_npz_with_key(capsys, files):
    S = np.load(files["npz"])["b"]
    rc, out, _ = run(capsys, "inspect", files["npz"], "--key", "b", "--json")
    assert rc == 0
    rep = json.loads(out)
    assert rep["source"].endswith("two.npz[b]")
    assert rep["diameter"]["value"] == pytest.approx(pdist(S).max(), rel=1e-12)


def test_inspect_npz_with_one_array_needs_no_key(capsys, files):
    rc, out, _ = run(capsys, "inspect", files["one"], "--json")
    assert rc == 0
    assert json.loads(out)["shape"] == [3, 3]


def test_inspect_duplicate_rows_give_zero_ratio(capsys, tmp_path):
    f = tmp_path / "dup.npy"
    np.save(f, np.array([[0.0, 0.0], [1.0, 0.0], [1.0, 0.0]]))
    rc, out, _ = run(capsys, "inspect", str(f), "--json")
    assert rc == 0
    rep = json.loads(out)
    assert rep["ratio"] == 0.0
    assert rep["condition_number"] is None  # infinite: JSON null, never Infinity


def test_inspect_rows_near_the_float64_maximum(tmp_path):
    # rows near 1.7e308 whose differences are representable (D is about 2e307): the
    # centered rows span the plane, so the rank is 2 and the covering radius lies between
    # the Jung bounds; a real process, so that a warning on stderr is seen
    f = tmp_path / "huge.npy"
    np.save(f, np.array([[1.7e308, 1.7e308], [1.6e308, 1.69e308], [1.5e308, 1.65e308]]))
    proc = subprocess.run(_refgeo("inspect", str(f), "--json"), capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stderr) == (0, "")
    rep = json.loads(proc.stdout)
    assert rep["rank_centered"] == 2
    jung, radius = rep["jung"], rep["covering_radius"]["radius"]
    assert jung["k"] == 2 and jung["J_k"] == pytest.approx(1 / math.sqrt(3))
    assert jung["lower"] <= radius <= jung["upper"]


@pytest.mark.parametrize(
    "case, args, fragments",
    [
        ("missing", ["inspect", "{tmp}/nope.npy"], ["does not exist"]),
        ("directory", ["inspect", "{tmp}"], ["is a directory"]),
        ("suffix", ["inspect", "{text}"], [".npy or .npz"]),
        ("1-D", ["inspect", "{vec}"], ["2-D array", "(5,)"]),
        ("nan", ["inspect", "{nan}"], ["finite"]),
        ("one row", ["inspect", "{onerow}"], ["at least 2 rows"]),
        ("corrupt", ["inspect", "{corrupt}"], ["is not a NumPy .npy file", "header"]),
        ("pickled", ["inspect", "{pickled}"], ["cannot read"]),
        ("strings", ["inspect", "{strings}"], ["real floating dtype", "<U1"]),
        ("several arrays", ["inspect", "{npz}"], ["several arrays", "W, b", "--key"]),
        ("bad key", ["inspect", "{npz}", "--key", "Z"], ["'Z'", "W, b"]),
        ("key on npy", ["inspect", "{simplex}", "--key", "W"], [".npz files only"]),
        ("bad H", ["inspect", "{simplex}", "--H", "abc"], ["--H", "number"]),
        ("nan H", ["inspect", "{simplex}", "--H", "nan"], ["--H", "finite"]),
        ("negative H", ["inspect", "{simplex}", "--H", "-1"], ["argument --H: must be a finite number >= 0, got '-1'"]),
        ("no file", ["inspect"], ["required"]),
    ],
)
def test_inspect_errors(capsys, files, tmp_path, case, args, fragments):
    argv = [a.format(tmp=tmp_path, **files) for a in args]
    rc, out, err = run(capsys, *argv)
    assert out == ""
    assert_one_line_error(rc, err, *fragments)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes here")
@pytest.mark.parametrize("suffix", [".npy", ".npz"])
def test_a_named_pipe_is_refused_before_it_is_read(tmp_path, suffix):
    # the loader reads a file twice (its header, then the data): a FIFO hung once its
    # writer had gone (.npy), or failed as "No data left in file" (.npz); no writer is
    # needed here, the pipe is refused before it is opened
    fifo = tmp_path / f"pipe{suffix}"
    os.mkfifo(fifo)
    # in a child with a timeout: the defect this guards against blocks in open()
    proc = subprocess.run(_refgeo("inspect", str(fifo)), capture_output=True, text=True, timeout=120)
    assert proc.stdout == ""
    assert_one_line_error(proc.returncode, proc.stderr, "is not a regular file", "save the array to a file first")


# ------------------------------------------------------------------ spread

def test_spread_pentagon(capsys, tmp_path):
    # V = 5 in the plane: the regular pentagon is optimal, rho = 1/phi = 0.61803 (docs/theory/spreading.md)
    out_file = tmp_path / "points.npy"
    rc, out, _ = run(capsys, "spread", "--V", "5", "--d", "2", "--out", str(out_file), "--json",
                     "--max-time", "5")
    assert rc == 0
    rep = json.loads(out)
    X = np.load(out_file)
    assert X.shape == (5, 2)
    dist = pdist(X)
    assert rep["min_dist"] == pytest.approx(dist.min(), rel=1e-9)
    assert rep["diameter"] == pytest.approx(dist.max(), rel=1e-9)
    assert rep["ratio"] == pytest.approx(dist.min() / dist.max(), rel=1e-9)
    assert rep["ratio"] <= rep["upper_bound"] + 1e-12
    assert rep["ratio"] == pytest.approx((math.sqrt(5) - 1) / 2, abs=1e-3)


def test_spread_text_output(capsys):
    rc, out, _ = run(capsys, "spread", "--V", "4", "--d", "3", "--max-time", "2")
    assert rc == 0
    assert "ratio" in out and "upper_bound" in out


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["--V", "abc", "--d", "2"], ["--V", "integer"]),
        (["--V", "1", "--d", "2"], ["--V", ">= 2"]),
        (["--V", "5", "--d", "0"], ["--d", ">= 1"]),
        (["--V", "5", "--d", "2.5"], ["--d", "integer"]),
        (["--d", "2"], ["--V", "required"]),
        (["--V", "5", "--d", "2", "--eta", "-1"], ["--eta", ">= 2.2250738585072014e-308"]),
        # subnormal: the library's message named eta, not the option
        (["--V", "5", "--d", "2", "--eta", "1e-320"], ["argument --eta: must be", "smallest normal float64"]),
        (["--V", "5", "--d", "2", "--out", "{tmp}/points.txt"], [".npy"]),
        (["--V", "5", "--d", "2", "--out", "{tmp}/no/such/dir/p.npy"], ["does not exist"]),
    ],
)
def test_spread_errors(capsys, tmp_path, args, fragments):
    rc, _, err = run(capsys, "spread", *[a.format(tmp=tmp_path) for a in args])
    assert_one_line_error(rc, err, *fragments)


# ------------------------------------------------------------------ lmo

def test_lmo_rank_one_closed_form(capsys, tmp_path):
    # G = a b^T with 1^T a = 0: T(G) = ||a||_1 ||b|| / 2 (docs/theory/lmo.md), RowNorm is exact
    a = np.array([1.0, -2.0, 0.5, 0.5])
    b = np.array([3.0, 4.0])
    f = tmp_path / "g.npy"
    np.save(f, np.outer(a, b))
    out_file = tmp_path / "S.npy"
    rc, out, _ = run(capsys, "lmo", str(f), "--eta", "2", "--json", "--out", str(out_file))
    assert rc == 0
    rep = json.loads(out)
    T = 0.5 * np.abs(a).sum() * np.linalg.norm(b)
    # at eta = 2 the decrease is 2 T, and the bracket is of T itself (per unit eta)
    assert rep["tension_lower_bound"] <= T * (1 + 1e-9)
    assert rep["tension_upper_bound"] >= T * (1 - 1e-9)
    assert rep["decrease"] == pytest.approx(2 * T, rel=1e-6)
    assert rep["decrease"] <= 2 * rep["tension_upper_bound"] * (1 + 1e-12)
    assert rep["rownorm_tension"] == pytest.approx(T, rel=1e-12)  # rank one: RowNorm is exact
    assert rep["rownorm_over_exact"][0] == pytest.approx(1.0, rel=1e-6)
    S = np.load(out_file)
    assert S.shape == (4, 2)
    assert pdist(S).max() <= 2 * (1 + 1e-9)  # D(S) <= eta
    assert -np.sum(np.outer(a, b) * S) == pytest.approx(2 * T, rel=1e-6)


@pytest.mark.parametrize("scale, center", [(2.0**664, False), (2.0**-664, False), (2.0**1019, True)],
                         ids=["1e200", "1e-200", "center-near-max"])
def test_lmo_tiny_and_huge_gradients(tmp_path, scale, center):
    # the rank-one closed form of test_lmo_rank_one_closed_form scaled by a power of two:
    # the half sum of the row norms is T * scale and RowNorm stays exact (the squares of
    # the entries overflowed or underflowed: "in [inf, 1]" or "[0, 0]"); with --center the
    # rows a + 3 of a gradient near the float64 maximum, whose column sums overflow
    a = np.array([1.0, -2.0, 0.5, 0.5])
    b = np.array([3.0, 4.0])
    f = tmp_path / "g.npy"
    np.save(f, np.outer(a + 3 if center else a, b) * scale)
    proc = subprocess.run(_refgeo("lmo", str(f), "--json", *(["--center"] if center else [])),
                          capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stderr) == (0, "")
    rep = json.loads(proc.stdout)
    T = 0.5 * np.abs(a).sum() * np.linalg.norm(b)
    assert rep["rownorm_tension"] == pytest.approx(T * scale, rel=1e-12)
    assert rep["rownorm_over_exact"] == pytest.approx([1.0, 1.0], rel=1e-6)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_lmo_center_is_center_rows(capsys, tmp_path, dtype):
    """--center subtracted the mean once, in float64: the rounding of the mean stayed in
    every row, and past a common offset of about 1e13 times the spread the LMO refused
    the rows as not centered, naming --center as the remedy; float32 rows were centered
    in float64.  It is refgeo.center_rows now: the same result as the Python API's."""
    rng = np.random.default_rng(2)
    G = (1e6 + 1e-8 * rng.standard_normal((30, 4))) if dtype == np.float64 else (1.0 + rng.standard_normal((40, 5)))
    G = G.astype(dtype)
    f = tmp_path / "g.npy"
    np.save(f, G)
    rc, out, err = run(capsys, "lmo", str(f), "--center", "--json")
    assert (rc, err) == (0, "")
    want = refgeo.diameter_lmo(refgeo.center_rows(G))
    assert json.loads(out)["decrease"] == float(want.decrease)


def test_a_damaged_compressed_npz_is_a_file_error(capsys, tmp_path):
    """A damaged deflate stream (zlib.error) and a member of an unsupported compression
    method (NotImplementedError) were reported as "internal error"; a bad CRC already
    named the file."""
    import zipfile

    good = tmp_path / "cz.npz"
    np.savez_compressed(good, a=np.random.default_rng(0).standard_normal((2000, 5)))
    data = bytearray(good.read_bytes())
    data[100:110] = b"\xff" * 10
    bad = tmp_path / "damaged.npz"
    bad.write_bytes(bytes(data))
    rc, _, err = run(capsys, "inspect", str(bad))
    assert_one_line_error(rc, err, "cannot read", "damaged.npz", "as a NumPy file")
    # a zip member whose compression method zipfile cannot read (LZMA marked as 99)
    odd = tmp_path / "odd.npz"
    with zipfile.ZipFile(odd, "w", compression=zipfile.ZIP_LZMA) as z:
        with z.open("a.npy", "w") as fh:
            np.save(fh, np.ones((3, 2)))
    raw = bytearray(odd.read_bytes())
    for sig, off in ((b"PK\x03\x04", 8), (b"PK\x01\x02", 10)):  # the method fields
        i = raw.find(sig)
        raw[i + off:i + off + 2] = (99).to_bytes(2, "little")
    odd.write_bytes(bytes(raw))
    rc, _, err = run(capsys, "inspect", str(odd))
    assert_one_line_error(rc, err, "cannot read", "odd.npz", "as a NumPy file")


def test_lmo_regular_simplex_ratio(capsys, tmp_path):
    # rows of a centered regular simplex with k = 2: RowNorm / exact = sqrt(3/4) = 0.8660 (docs/theory/lmo.md)
    G = np.array([[1.0, 0.0], [-0.5, math.sqrt(3) / 2], [-0.5, -math.sqrt(3) / 2]])
    f = tmp_path / "tri.npy"
    np.save(f, G)
    rc, out, _ = run(capsys, "lmo", str(f), "--json", "--rtol", "1e-8", "--max-time", "20")
    assert rc == 0
    lo, hi = json.loads(out)["rownorm_over_exact"]
    assert lo <= math.sqrt(3) / 2 + 1e-6 and hi >= math.sqrt(3) / 2 - 1e-6
    assert hi - lo < 1e-4


def test_lmo_text_output_and_center(capsys, tmp_path):
    f = tmp_path / "g.npy"
    np.save(f, np.array([[1.0, 2.0], [3.0, 5.0], [0.0, 1.0]]))  # rows do not sum to zero
    rc, out, _ = run(capsys, "lmo", str(f), "--center")
    assert rc == 0
    assert "RowNorm / exact decrease" in out
    assert "tension_upper_bound (per unit eta)" in out and "rownorm_tension (per unit eta)" in out


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["{tmp}/nope.npy"], ["GRAD", "does not exist"]),
        (["{vec}"], ["2-D array"]),
        (["{nan}"], ["finite"]),
        (["{onerow}"], ["at least 2 rows"]),
        (["{simplex}", "--eta", "0"], ["--eta", "smallest normal float64"]),
        (["{simplex}", "--eta", "1e-320"], ["argument --eta: must be", "smallest normal float64"]),
        (["{simplex}", "--eta", "inf"], ["--eta", "finite"]),
        (["{simplex}", "--rtol", "1"], ["argument --rtol: must be a finite number > 0 and < 1, got '1' instead"]),
        (["{simplex}", "--rtol", "0"], ["argument --rtol: must be a finite number > 0 and < 1, got '0' instead"]),
        (["{simplex}", "--out", "{tmp}/S.csv"], [".npy"]),
        (["{npz}"], ["several arrays"]),
    ],
)
def test_lmo_errors(capsys, files, tmp_path, args, fragments):
    rc, _, err = run(capsys, "lmo", *[a.format(tmp=tmp_path, **files) for a in args])
    assert_one_line_error(rc, err, *fragments)


def test_lmo_uncentered_gradient_library_error(capsys, files):
    # the simplex rows e_i do not sum to zero: the library's ValueError becomes one line
    rc, _, err = run(capsys, "lmo", files["simplex"])
    assert_one_line_error(rc, err)


def test_lmo_uncentered_gradient_suggests_center(tmp_path):
    # the remedy on the command line is --center, not the Python function the library
    # names; the file is named, and with --center the same file runs
    f = tmp_path / "g.npy"
    np.save(f, np.array([[1.0, 2.0], [3.0, 5.0], [0.0, 1.0]]))
    proc = subprocess.run(_refgeo("lmo", str(f)), capture_output=True, text=True, timeout=120)
    assert_one_line_error(proc.returncode, proc.stderr, str(f), "rows summing to zero", "Pass --center")
    assert "refgeo.center_rows" not in proc.stderr
    proc = subprocess.run(_refgeo("lmo", str(f), "--center"), capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stderr) == (0, "")


def _float16_gradient_off_by(lo, hi, seed=0):
    # a float16 gradient whose float64 row sum is lo..hi of its row norms: centered in
    # float64, then rounded to float16 (the rounding alone moves the sum)
    rng = np.random.default_rng(seed)
    while True:
        G = rng.standard_normal((4, 3)) * 1000
        G = (G - G.mean(axis=0)).astype(np.float16)
        G64 = G.astype(np.float64)
        off = np.linalg.norm(G64.sum(axis=0)) / np.linalg.norm(G64, axis=1).sum()
        if lo < off < hi:
            return G


def test_lmo_takes_the_gradients_the_library_takes(capsys, tmp_path):
    # a float16 gradient centered, then rounded (its row sum off by up to the float16
    # eps): the command reports the library's result on the same array; a sum off by
    # twice the library's tolerance (2**-8 of the row norms) is refused, with the
    # command's remedy
    eps16 = float(np.finfo(np.float16).eps)
    G = _float16_gradient_off_by(1e-4, eps16)
    f = tmp_path / "g16.npy"
    np.save(f, G)
    rc, out, err = run(capsys, "lmo", str(f), "--json")
    assert (rc, err) == (0, "")
    ref = refgeo.diameter_lmo(G, eta=1.0)
    assert json.loads(out)["decrease"] == pytest.approx(ref.decrease, rel=1e-12)
    G64 = G.astype(np.float64)
    G64[0, 0] += 2 * 2.0**-8 * np.linalg.norm(G64, axis=1).sum()
    np.save(f, G64)
    with pytest.raises(ValueError, match="rows summing to zero"):
        refgeo.diameter_lmo(G64)
    rc, _, err = run(capsys, "lmo", str(f))
    assert_one_line_error(rc, err, str(f), "rows summing to zero", "Pass --center")


# ------------------------------------------------------------------ tokenwise

def test_tokenwise_linear_layer_is_fully_tokenwise(capsys, tmp_path):
    # Y = X diag(c): a diagonal map fits exactly, residual energy 0 (docs/theory/tokenwise.md)
    rng = np.random.default_rng(3)
    X = rng.standard_normal((50, 4))
    Y = X * np.array([2.0, -1.0, 0.5, 3.0])
    np.save(tmp_path / "x.npy", X)
    np.save(tmp_path / "y.npy", Y)
    rc, out, _ = run(capsys, "tokenwise", str(tmp_path / "x.npy"), str(tmp_path / "y.npy"), "--k", "8", "--json")
    assert rc == 0
    rep = json.loads(out)
    assert rep["N"] == 50 and rep["d"] == 4
    assert rep["energy_fraction"] == pytest.approx(0.0, abs=1e-20)


def test_tokenwise_text_output(capsys, tmp_path):
    rng = np.random.default_rng(4)
    X = rng.standard_normal((30, 3))
    np.save(tmp_path / "x.npy", X)
    np.save(tmp_path / "y.npy", X + 0.1 * np.tanh(X))
    rc, out, _ = run(capsys, "tokenwise", str(tmp_path / "x.npy"), str(tmp_path / "y.npy"), "--k", "6",
                     "--cls", "full", "--ridge", "1e-3")
    assert rc == 0
    assert "energy_fraction" in out


def test_tokenwise_mlp_uses_no_neighbors(capsys, tmp_path):
    # the MLP is one global map: 12 tokens are enough whatever --k says (default 16)
    rng = np.random.default_rng(5)
    X = rng.standard_normal((12, 3))
    np.save(tmp_path / "x.npy", X)
    np.save(tmp_path / "y.npy", X + 0.1 * np.tanh(X))
    rc, out, err = run(capsys, "tokenwise", str(tmp_path / "x.npy"), str(tmp_path / "y.npy"), "--cls", "mlp",
                       "--json")
    assert rc == 0, err
    rep = json.loads(out)
    assert rep["cls"] == "mlp" and rep["N"] == 12


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["{tmp}/nope.npy", "{cloud}"], ["X", "does not exist"]),
        (["{cloud}", "{tmp}/nope.npy"], ["Y", "does not exist"]),
        (["{cloud}", "{simplex}"], ["same shape", "(40, 3)", "(5, 5)"]),
        (["{cloud}", "{cloud}", "--k", "40"], ["--k", "smaller than", "40"]),
        (["{cloud}", "{cloud}", "--k", "0"], ["--k", ">= 1"]),
        (["{cloud}", "{cloud}", "--ridge", "-1"], ["argument --ridge: must be a finite number >= 0, got '-1'"]),
        (["{cloud}", "{cloud}", "--rank", "2"], ["--rank applies to --cls low_rank only, got --cls diagonal"]),
        (["{cloud}", "{cloud}", "--cls", "mlp", "--rank", "2"], ["--rank applies to --cls low_rank only, got --cls mlp"]),
        (["{cloud}", "{cloud}", "--cls", "low_rank"], ["--cls low_rank needs --rank R, 1 <= R <= d = 3"]),
        (["{cloud}", "{cloud}", "--cls", "low_rank", "--rank", "4"],
         ["--rank must be <= d = 3 (the width of X and Y), got 4 instead"]),
        (["{cloud}"], ["required"]),
        # the library's message named train_fraction, which no option of the command sets
        (["{tworows}", "{tworows}", "--cls", "mlp"],
         ["--cls mlp trains on 80% of the tokens", "N = 2 tokens give 2 for training and 0 held out"]),
    ],
)
def test_tokenwise_errors(capsys, files, tmp_path, args, fragments):
    rc, _, err = run(capsys, "tokenwise", *[a.format(tmp=tmp_path, **files) for a in args])
    assert_one_line_error(rc, err, *fragments)


def test_tokenwise_reads_arrays_of_npz_files(tmp_path):
    # X and Y in one .npz: --x-key and --y-key choose them, and an .npz with several
    # arrays and no key names the option that exists (tokenwise has no --key)
    rng = np.random.default_rng(6)
    X = rng.standard_normal((20, 3))
    f = tmp_path / "states.npz"
    np.savez(f, X=X, Y=X * np.array([2.0, -1.0, 0.5]))
    proc = subprocess.run(_refgeo("tokenwise", str(f), str(f)), capture_output=True, text=True, timeout=120)
    assert_one_line_error(proc.returncode, proc.stderr, "several arrays", "--x-key")
    proc = subprocess.run(_refgeo("tokenwise", str(f), str(f), "--x-key", "X"), capture_output=True, text=True,
                          timeout=120)
    assert_one_line_error(proc.returncode, proc.stderr, "several arrays", "--y-key")
    proc = subprocess.run(_refgeo("tokenwise", str(f), str(f), "--x-key", "X", "--y-key", "Y", "--k", "5", "--json"),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    assert (rep["X"], rep["Y"], rep["N"]) == (f"{f}[X]", f"{f}[Y]", 20)
    assert rep["energy_fraction"] == pytest.approx(0.0, abs=1e-20)  # Y = X diag(c): diagonal maps are exact
    proc = subprocess.run(_refgeo("tokenwise", str(f), str(f), "--x-key", "Z", "--y-key", "Y"), capture_output=True,
                          text=True, timeout=120)
    assert_one_line_error(proc.returncode, proc.stderr, "--x-key 'Z'", "X, Y")


def test_tokenwise_bad_class_names_the_option(capsys, files):
    # the library's message named its argument (cls), not the option
    rc, _, err = run(capsys, "tokenwise", files["cloud"], files["cloud"], "--cls", "banana")
    assert_one_line_error(rc, err, "argument --cls: invalid choice: 'banana'", "scaled_orthogonal", "mlp")


# ------------------------------------------------------------------ unexpected errors

def test_internal_error_is_one_line(capsys, monkeypatch, files):
    def boom(*args, **kwargs):
        raise ZeroDivisionError("planted")

    monkeypatch.setattr(cli, "_inspect_report", boom)
    rc, _, err = run(capsys, "inspect", files["simplex"])
    assert_one_line_error(rc, err, "internal error", "ZeroDivisionError", "planted")


def test_internal_error_traceback_with_debug(monkeypatch, files):
    def boom(*args, **kwargs):
        raise ZeroDivisionError("planted")

    monkeypatch.setattr(cli, "_inspect_report", boom)
    monkeypatch.setenv("REFGEO_DEBUG", "1")
    with pytest.raises(ZeroDivisionError):
        cli.main(["inspect", files["simplex"]])


def test_multiline_library_message_is_flattened(capsys, monkeypatch, files):
    def bad(*args, **kwargs):
        raise ValueError("first line\nsecond line")

    monkeypatch.setattr(cli, "_inspect_report", bad)
    rc, _, err = run(capsys, "inspect", files["simplex"])
    assert_one_line_error(rc, err, "first line second line")


@pytest.mark.slow  # a fresh interpreter: seconds with a wheel, much longer with an editable build
def test_python_m_refgeo_error_has_no_traceback(tmp_path):
    # a real process: exit status and stderr as a user sees them
    proc = subprocess.run([sys.executable, "-m", "refgeo", "inspect", str(tmp_path / "nope.npy")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.strip() == f"refgeo inspect: error: FILE {str(tmp_path / 'nope.npy')!r} does not exist"


# ------------------------------------------------------------------ demo (argument errors)

def test_demo_out_is_a_file(capsys, files):
    rc, _, err = run(capsys, "demo", "--out", files["simplex"], "--size", "tiny")
    assert_one_line_error(rc, err, "not a directory")


def test_demo_bad_seed(capsys, tmp_path):
    rc, _, err = run(capsys, "demo", "--out", str(tmp_path), "--seed", "-3")
    assert_one_line_error(rc, err, "--seed")


def test_demo_bad_size(capsys, tmp_path):
    rc, _, err = run(capsys, "demo", "--out", str(tmp_path), "--size", "huge")
    assert_one_line_error(rc, err, "invalid choice")


def test_main_reads_sys_argv(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["refgeo", "config", "--json"])
    assert cli.main() == 0
    assert json.loads(capsys.readouterr().out)["refgeo"] == refgeo.__version__


def test_no_stray_files(tmp_path, capsys, monkeypatch):
    # --help never writes anything
    monkeypatch.chdir(tmp_path)
    for c in COMMANDS:
        cli.main([c, "--help"])
    capsys.readouterr()
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------ pipes, Ctrl-C, memory-mapped input

def _refgeo(*argv):
    return [sys.executable, "-m", "refgeo", *argv]


def _default_sigint():
    # a child started from a shell that ignores SIGINT (a background job) would inherit the
    # ignore; with the default disposition Python installs its KeyboardInterrupt handler
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_closed_pipe_ends_quietly_with_status_0(tmp_path):
    # 3 x 30000 rows: the JSON (with h* of 30000 entries) is far larger than a pipe buffer,
    # so the command is still writing when the reader goes away, as with `| head -c1`
    f = tmp_path / "wide.npy"
    np.save(f, np.random.default_rng(0).standard_normal((3, 30_000)))
    proc = subprocess.Popen(_refgeo("inspect", str(f), "--json"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    first = proc.stdout.read(1)
    proc.stdout.close()  # the reader exits
    err = proc.stderr.read()
    proc.wait(timeout=120)
    assert first == b"{"
    assert err == b""
    assert proc.returncode == 0


def test_a_closed_stderr_pipe_does_not_stop_a_command_with_progress(tmp_path):
    # tqdm re-raised the EPIPE of writing stderr, and main took it for stdout's closed
    # pipe: the command stopped early and exited 0 having printed and saved nothing
    pytest.importorskip("tqdm")  # without tqdm, --progress warns once through the CLI's own stderr writer
    out = tmp_path / "rows.npy"
    r, w = os.pipe()
    os.close(r)  # the reader of stderr is gone before the command starts
    try:
        proc = subprocess.run(_refgeo("spread", "--V", "50", "--d", "3", "--max-time", "0.5", "--progress",
                                      "--json", "--out", str(out)), stdout=subprocess.PIPE, stderr=w, timeout=120)
    finally:
        os.close(w)
    assert proc.returncode == 0
    rep = json.loads(proc.stdout)
    rows = np.load(out)
    assert rows.shape == (50, 3)
    d = pdist(rows)
    assert rep["ratio"] <= d.min() / d.max() * (1 + 1e-12)


def test_out_is_written_to_exactly_the_named_file(capsys, tmp_path):
    # np.save appends .npy to any name not ending in lower-case .npy
    for name in ("rows.NPY", "rows.Npy"):
        target = tmp_path / name
        rc, out, _ = run(capsys, "spread", "--V", "6", "--d", "2", "--max-time", "0.2", "--out", str(target))
        assert rc == 0 and out.splitlines()[-1].split() == ["saved", str(target)]
        assert np.load(target).shape == (6, 2)
    assert sorted(os.listdir(tmp_path)) == ["rows.NPY", "rows.Npy"]


def test_out_writes_as_a_write_in_place_would(capsys, tmp_path):
    """The atomic save (a new file renamed over the target) keeps what writing in place
    kept: a link is written through, an existing file keeps its permissions (0600 came
    back 0644), and a name that fits the file system is not refused for its temporary
    file's (".name.<pid>.tmp" made a 250-character name too long)."""
    real = tmp_path / "real"
    real.mkdir()
    target = real / "target.npy"
    np.save(target, np.zeros(3))
    os.chmod(target, 0o600)
    link = tmp_path / "link.npy"
    link.symlink_to(target)
    rc, _, err = run(capsys, "spread", "--V", "5", "--d", "2", "--max-time", "0.2", "--out", str(link))
    assert rc == 0, err
    assert link.is_symlink() and np.load(target).shape == (5, 2)
    assert os.stat(target).st_mode & 0o777 == 0o600
    long = tmp_path / ("x" * 246 + ".npy")  # 250 characters: within NAME_MAX (255)
    rc, _, err = run(capsys, "spread", "--V", "5", "--d", "2", "--max-time", "0.2", "--out", str(long))
    assert rc == 0, err
    assert np.load(long).shape == (5, 2)
    assert sorted(os.listdir(tmp_path)) == sorted(["real", "link.npy", long.name])
    assert os.listdir(real) == ["target.npy"]


def _limit_file_size(limit):
    def set_limit():
        import resource

        _default_sigint()
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return set_limit


@pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_FSIZE is POSIX")
def test_a_failed_save_keeps_the_file_that_was_there(tmp_path):
    # np.save wrote in place: a full disk or a file size limit left a truncated .npy that
    # np.load cannot read, in place of the earlier one (Python ignores SIGXFSZ, so the
    # write fails with EFBIG instead of killing the process)
    target = tmp_path / "rows.npy"
    before = np.arange(6.0).reshape(3, 2)
    np.save(target, before)
    proc = subprocess.run(_refgeo("spread", "--V", "4000", "--d", "16", "--max-time", "0.5", "--no-progress",
                                  "--out", str(target)), capture_output=True, text=True, timeout=120,
                          preexec_fn=_limit_file_size(64 * 1024))
    assert_one_line_error(proc.returncode, proc.stderr, "cannot write", "rows.npy")
    np.testing.assert_array_equal(np.load(target), before)
    assert os.listdir(tmp_path) == ["rows.npy"]  # no partial file left beside it


def test_library_warning_is_one_line_naming_the_command(tmp_path):
    # an under-determined fit warned in Python's two lines, with cli.py's path and source line
    rng = np.random.default_rng(0)
    X = rng.standard_normal((40, 6))
    np.save(tmp_path / "X.npy", X)
    np.save(tmp_path / "Y.npy", X + 0.1 * rng.standard_normal((40, 6)))
    proc = subprocess.run(_refgeo("tokenwise", str(tmp_path / "X.npy"), str(tmp_path / "Y.npy"), "--cls", "full",
                                  "--k", "2", "--no-progress"), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    (line,) = proc.stderr.splitlines()
    assert line.startswith("refgeo tokenwise: warning: cls='full' is under-determined for k=2")


def test_inspect_names_the_dtype_of_the_file_and_the_one_computed_in(capsys, tmp_path):
    f = tmp_path / "i.npy"
    np.save(f, np.arange(12).reshape(4, 3) ** 2)
    rc, out, _ = run(capsys, "inspect", str(f), "--json")
    rep = json.loads(out)
    assert rc == 0 and (rep["file_dtype"], rep["dtype"]) == ("int64", "float64")
    rc, out, _ = run(capsys, "inspect", str(f))
    assert "float64 (the file: int64)" in out
    g = tmp_path / "f.npy"
    np.save(g, np.eye(3, dtype=np.float32))
    rc, out, _ = run(capsys, "inspect", str(g), "--json")
    assert (json.loads(out)["file_dtype"], json.loads(out)["dtype"]) == ("float32", "float32")


def _close_fd(fd):
    return lambda: os.close(fd)


def test_closed_stdout_or_stderr_gives_status_2_without_a_traceback(tmp_path):
    # started with stdout closed (`refgeo config >&-`): Python's sys.stdout is None, and
    # the flush raised AttributeError with a traceback (status 1); the command now fails
    # where it writes (a command that writes only files, like demo, still runs)
    proc = subprocess.run(_refgeo("config"), capture_output=False, stderr=subprocess.PIPE, text=True,
                          preexec_fn=_close_fd(1), timeout=120)
    assert (proc.returncode, proc.stderr) == (2, "refgeo config: error: [Errno 9] standard output is closed\n")
    # stderr closed (`2>&-`): printing the error raised OSError (status 1); the status
    # still says it is an error of the command
    proc = subprocess.run(_refgeo("inspect", str(tmp_path / "none.npy")), stdout=subprocess.PIPE,
                          preexec_fn=_close_fd(2), timeout=120)
    assert (proc.returncode, proc.stdout) == (2, b"")
    # --help and --version write through argparse, which dropped the error (status 0)
    for flag in ("--help", "--version"):
        proc = subprocess.run(_refgeo(flag), capture_output=False, stderr=subprocess.PIPE, text=True,
                              preexec_fn=_close_fd(1), timeout=120)
        assert (proc.returncode, proc.stderr) == (2, "refgeo: error: writing standard output: standard output is closed\n")
    proc = subprocess.run(_refgeo("--no-such-option"), stdout=subprocess.PIPE, preexec_fn=_close_fd(2), timeout=120)
    assert (proc.returncode, proc.stdout) == (2, b"")
    # a usage error whose stderr reader went away: still status 2 (not the 0 of a
    # closed stdout pipe)
    r, w = os.pipe()
    os.close(r)
    try:
        proc = subprocess.run(_refgeo("--no-such-option"), stdout=subprocess.PIPE, stderr=w, timeout=120)
    finally:
        os.close(w)
    assert (proc.returncode, proc.stdout) == (2, b"")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_stdout_is_one_line_and_status_2():
    with open("/dev/full", "w") as full:
        proc = subprocess.run(_refgeo("config"), stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "No space left on device" in proc.stderr, proc.stderr


def test_reader_that_stops_at_a_match_like_grep_q(tmp_path):
    f = tmp_path / "wide.npy"
    np.save(f, np.random.default_rng(1).standard_normal((4, 30_000)))
    proc = subprocess.Popen(_refgeo("inspect", str(f), "--json"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    seen = b""
    while b'"diameter"' not in seen:
        chunk = proc.stdout.read1(4096)
        assert chunk, "the output ended before the match"
        seen += chunk
    proc.stdout.close()
    err = proc.stderr.read()
    proc.wait(timeout=120)
    assert (proc.returncode, err) == (0, b"")


def test_ctrl_c_exits_130_with_one_line():
    t0 = time.monotonic()
    subprocess.run(_refgeo("--version"), capture_output=True, timeout=120, check=True)
    startup = time.monotonic() - t0
    # V = 3000 in R^40 (no lattice or code construction to return at once) runs the
    # smooth solver for its whole --max-time (60 s)
    proc = subprocess.Popen(_refgeo("spread", "--V", "3000", "--d", "40", "--max-time", "60"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_default_sigint)
    time.sleep(2 * startup + 1.0)  # well inside the computation
    assert proc.poll() is None, "the command ended before the interrupt"
    proc.send_signal(signal.SIGINT)
    t1 = time.monotonic()
    out, err = proc.communicate(timeout=30)
    assert time.monotonic() - t1 < 10
    assert proc.returncode == 130
    assert out == ""
    assert err.splitlines() == ["refgeo spread: interrupted"]


def test_npy_input_is_memory_mapped_not_read_whole(tmp_path):
    # 32 MiB of float64 on disk; loading and checking it must allocate only O(1 MiB)
    rng = np.random.default_rng(5)
    f = tmp_path / "big.npy"
    big = rng.standard_normal((4096, 1024))
    np.save(f, big)
    tracemalloc.start()
    try:
        S, where = cli._load_matrix(str(f))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * 2**20, peak
    assert where == str(f)
    assert not S.flags.writeable  # a read-only view of the file
    np.testing.assert_array_equal(S[::512], big[::512])


def test_memory_mapped_input_gives_the_brute_force_answer(capsys, tmp_path):
    rng = np.random.default_rng(6)
    S = rng.standard_normal((300, 7)).astype(np.float32)
    f = tmp_path / "f32.npy"
    np.save(f, S)
    rc, out, _ = run(capsys, "inspect", str(f), "--json")
    assert rc == 0
    rep = json.loads(out)
    assert rep["dtype"] == "float32"
    dist = pdist(S.astype(np.float64))
    assert abs(rep["diameter"]["value"] - dist.max()) <= rep["diameter"]["error_bound"]
    assert abs(rep["closest_pair"]["value"] - dist.min()) <= rep["closest_pair"]["error_bound"]


def test_non_finite_entry_deep_in_a_large_file_is_found(capsys, tmp_path):
    # the blockwise finiteness check reads every block, not only the first
    S = np.zeros((3000, 512))
    S[2999, 511] = np.inf
    f = tmp_path / "late_inf.npy"
    np.save(f, S)
    rc, _, err = run(capsys, "inspect", str(f))
    assert_one_line_error(rc, err, "finite", "1 infinite")


# ------------------------------------------------------------------ progress

def _parse(*argv):
    return cli._build_parser().parse_args(list(argv))


def test_progress_defaults_to_on_for_a_terminal(monkeypatch):
    pty = pytest.importorskip("pty")
    master, slave = pty.openpty()  # stderr on the slave side of a real pseudo-terminal
    try:
        with os.fdopen(slave, "w") as stream:
            # set in the test body: pytest re-installs its own capture between phases
            monkeypatch.setattr(sys, "stderr", stream)
            for command in (["inspect", "m.npy"], ["spread", "--V", "5", "--d", "2"], ["lmo", "g.npy"],
                            ["tokenwise", "x.npy", "y.npy"], ["demo"]):
                assert cli._show_progress(_parse(*command)) is True, command
                assert cli._show_progress(_parse(*command, "--no-progress")) is False, command
    finally:
        os.close(master)


def test_library_progress_by_default_only_with_tqdm(monkeypatch):
    # on a terminal the library's bar is passed on by default only where tqdm can draw
    # it (no "install tqdm" warning for a default); an explicit --progress always passes
    import importlib.util

    pty = pytest.importorskip("pty")
    master, slave = pty.openpty()
    try:
        with os.fdopen(slave, "w") as stream:
            monkeypatch.setattr(sys, "stderr", stream)
            has_tqdm = importlib.util.find_spec("tqdm") is not None
            args = _parse("lmo", "g.npy")
            assert cli._progress_kw(refgeo.diameter_lmo, args) == {"progress": has_tqdm}
            assert cli._progress_kw(refgeo.diameter_lmo, _parse("lmo", "g.npy", "--progress")) == {"progress": True}
            assert cli._progress_kw(refgeo.diameter_lmo, _parse("lmo", "g.npy", "--no-progress")) == {"progress": False}
    finally:
        os.close(master)


def test_progress_defaults_to_off_otherwise(tmp_path, monkeypatch):
    with open(tmp_path / "log.txt", "w") as fh:
        monkeypatch.setattr(sys, "stderr", fh)
        assert cli._show_progress(_parse("inspect", "m.npy")) is False
        assert cli._show_progress(_parse("inspect", "m.npy", "--progress")) is True
