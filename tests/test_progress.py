"""progress= on the engine calls and the pairwise Hilbert distances; memory checks first."""

from __future__ import annotations

import math
import re
import threading
import time
import tracemalloc

import numpy as np
import pytest

import refgeo
from refgeo import _backend, _memory, _progress

compiled = pytest.mark.skipif(_backend.extension() is None, reason="the compiled extension is not built")


@pytest.fixture
def cython():
    """The compiled engine, whatever REFGEO_BACKEND says."""
    with refgeo.use_backend("cython"):
        yield


def _rows(V=1500, d=40, seed=0):
    return np.random.default_rng(seed).standard_normal((V, d))


def _calls(S):
    """Every engine call with a progress argument, on small tiles (many tasks)."""
    Z = S[:400, :30]
    h = S.shape[0] // 2
    return {
        "row_diameter": lambda p: refgeo.row_diameter(S, tile_size=32, progress=p),
        "closest_pair": lambda p: refgeo.closest_pair(S, tile_size=32, progress=p),
        "distance_ratio": lambda p: refgeo.distance_ratio(S, tile_size=32, progress=p),
        "farthest_partners": lambda p: refgeo.farthest_partners(S, tile_size=32, progress=p),
        "knn": lambda p: refgeo.knn(S, 5, tile_size=32, progress=p),
        "knn_xy": lambda p: refgeo.knn(S[:h], 3, S[h:], tile_size=32, progress=p),
        "pdist_hilbert": lambda p: refgeo.pdist_hilbert(Z, tile_size=8, progress=p),
        "cdist_hilbert": lambda p: refgeo.cdist_hilbert(Z, Z[:50], tile_size=8, progress=p),
    }


def _same(a, b):
    """Bitwise equality of two results (dataclasses of arrays and floats, or arrays).

    ``n_refined`` is a work count that depends on which thread ran which tile first
    (it differs between two runs with progress off too), so it is not compared.
    """
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, float):
        return np.float64(a).tobytes() == np.float64(b).tobytes()
    fields = [f for f in a.__dataclass_fields__ if f != "n_refined"]
    return all(_same(getattr(a, f), getattr(b, f)) if isinstance(getattr(a, f), (np.ndarray, float))
               else getattr(a, f) == getattr(b, f) for f in fields)


def _check_reports(seen, *, main):
    assert seen, "the callable was never called"
    assert {t for t, _ in seen} == {main}
    infos = [i for _, i in seen]
    assert all(set(i) == {"done", "total", "elapsed", "eta"} for i in infos)
    assert infos[0]["done"] == 0 and math.isnan(infos[0]["eta"])
    assert infos[-1]["done"] == infos[-1]["total"] > 0 and infos[-1]["eta"] == 0.0
    assert all(a["done"] <= b["done"] and a["elapsed"] <= b["elapsed"] for a, b in zip(infos, infos[1:]))
    # each report after the first tells of steps done since the last one
    assert all(a["done"] < b["done"] for a, b in zip(infos, infos[1:]))
    assert all(0 <= i["done"] <= i["total"] for i in infos)
    assert all(a["total"] <= b["total"] for a, b in zip(infos, infos[1:]))
    # the end is reported once, last (a k-NN redo pass or a smaller second run included)
    assert [i["done"] == i["total"] for i in infos].count(True) == 1
    return infos


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_callable_reports_are_monotone_end_at_the_total_and_leave_results_alone(backend):
    S = _rows()
    if backend == "reference":
        S = S[:120]
    main = threading.get_ident()
    with refgeo.use_backend(backend):
        for name, call in _calls(S).items():
            seen = []
            got = call(lambda info: seen.append((threading.get_ident(), dict(info))))
            infos = _check_reports(seen, main=main)
            assert _same(got, call(False)), name
            if backend == "reference" or _backend.extension() is None:
                # no hook between tiles: the whole run is one step (two for distance_ratio)
                assert infos[-1]["total"] == (2 if name == "distance_ratio" else 1), name


def test_a_one_step_run_reports_its_start_and_its_end_only():
    """The reference backend runs a kernel as one step, held short of its total until
    the call ends; a run longer than the reporting interval (0.25 s) reported
    ``done == 0`` a second time at its end, then ``done == 1`` (also on Dask input)."""
    S = np.random.default_rng(3).standard_normal((3000, 16))
    seen = []
    with refgeo.use_backend("reference"):
        refgeo.row_diameter(S, progress=seen.append)
    assert [(i["done"], i["total"]) for i in seen] == [(0, 1), (1, 1)]
    if seen[-1]["elapsed"] <= 0.25:  # the old code's second report needs a longer run
        pytest.skip("the run was shorter than the reporting interval: the check above cannot fail")


@compiled
def test_compiled_engine_counts_tile_pairs(cython):
    S = _rows(1000, 8)
    seen = []
    refgeo.row_diameter(S, tile_size=100, progress=seen.append)
    assert seen[-1]["done"] == seen[-1]["total"] == 10 * 11 // 2
    seen = []
    refgeo.distance_ratio(S, tile_size=100, progress=seen.append)
    assert [i["total"] for i in seen] == [110] * len(seen)  # both kernels, announced together
    seen = []
    refgeo.knn(S, 4, tile_size=100, progress=seen.append)
    assert seen[-1]["total"] == 55 + 1000 // 64 + 1  # tile pairs, then blocks of 64 rows
    # rows the first pass defers (sign rows: ties) are filtered again by a threshold
    # pass, tiles of those rows against the tiles of their candidates (every row, or
    # the rows near a group's anchor), which nobody announced
    seen = []
    signs = np.random.default_rng(0).choice([-1.0, 1.0], (1000, 16))
    refgeo.knn(signs, 8, tile_size=100, progress=seen.append)
    first = 55 + 1000 // 64 + 1
    assert seen[-1]["done"] == seen[-1]["total"] > first, seen
    # with no row grouped around an anchor, every threshold pass runs against the 10
    # tiles of every row
    from refgeo import _engine

    old = _engine.ANCHOR_MIN_GAIN
    try:
        _engine.ANCHOR_MIN_GAIN = 1 << 30
        seen = []
        refgeo.knn(signs, 8, tile_size=100, progress=seen.append)
    finally:
        _engine.ANCHOR_MIN_GAIN = old
    assert seen[-1]["done"] == seen[-1]["total"] > first and (seen[-1]["total"] - first) % 10 == 0, seen


@compiled
@pytest.mark.parametrize("call", ["knn_signs", "distance_ratio_repeated_row"])
def test_the_end_is_reported_once_when_more_kernel_runs_follow(cython, call):
    """k-NN of sign rows redoes tied rows in passes nobody announced, and distance_ratio
    of rows with one repeated row runs its closest pair on those 2 rows after a
    diameter run on all:
    neither may report done == total before the call ends, nor a total that shrinks."""
    rng = np.random.default_rng(4)
    seen = []
    if call == "knn_signs":
        S = rng.choice([-1.0, 1.0], (3000, 16)).astype(np.float32)
        refgeo.knn(S, 8, tile_size=64, progress=lambda i: (seen.append(dict(i)), time.sleep(0.3)))
    else:
        S = rng.standard_normal((3000, 8))
        S[1] = S[0]
        refgeo.distance_ratio(S, tile_size=64, progress=lambda i: (seen.append(dict(i)), time.sleep(0.3)))
    _check_reports([(threading.get_ident(), i) for i in seen], main=threading.get_ident())


@compiled
def test_reports_are_rate_limited_and_come_between_tiles(cython):
    Z = np.random.default_rng(2).standard_normal((3400, 4000)).astype(np.float32)
    seen = []
    t0 = time.perf_counter()
    refgeo.pdist_hilbert(Z, tile_size=8, n_threads=2, progress=seen.append)
    elapsed = time.perf_counter() - t0
    times = [i["elapsed"] for i in seen]
    if elapsed >= 0.8:  # reports are due every 0.25 s: a run this long has one in between
        assert len(seen) >= 3, "a run of several tenths of a second reports in between"
    assert len(seen) >= 2, "the start and the end are always reported"
    # start and end always; in between at least 0.2 s apart
    assert all(b - a >= 0.19 for a, b in zip(times[1:-2], times[2:-1]))
    assert len(seen) <= 3 + elapsed / 0.2


@compiled
def test_a_raising_callable_stops_the_call(cython):
    class Stop(Exception):
        pass

    def stop(info):
        if info["done"] > 0:
            raise Stop

    S = _rows(6000, 64)
    with pytest.raises(Stop):
        refgeo.row_diameter(S, tile_size=16, progress=stop)


def test_progress_is_checked_and_true_without_tqdm_warns_once(monkeypatch):
    S = _rows(50, 3)
    for bad in (1, "yes", None):
        with pytest.raises(TypeError, match=re.escape("progress must be False, True or a callable, got")):
            refgeo.row_diameter(S, progress=bad)
        with pytest.raises(TypeError, match="progress must be"):
            refgeo.pdist_hilbert(S, progress=bad)
    import sys
    import warnings

    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    monkeypatch.setattr(_progress, "_TQDM_WARNED", False)
    with pytest.warns(UserWarning, match="tqdm"):
        a = refgeo.knn(S, 2, progress=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        b = refgeo.knn(S, 2, progress=True)
    assert _same(a, b)


@compiled
def test_progress_true_draws_a_tqdm_bar(cython, capsys):
    pytest.importorskip("tqdm")
    refgeo.row_diameter(_rows(600, 5), tile_size=100, progress=True)
    err = capsys.readouterr().err
    assert "row_diameter" in err and "21/21" in err  # 6 tiles: 6 * 7 / 2 tile pairs


def test_a_bar_over_a_time_budget_shows_the_percentage_not_a_fraction_of_one(capsys):
    """With max_time the steps are the fraction of the budget used (total 1.0); tqdm's
    counter printed "0.17526080799871124/1.0"."""
    pytest.importorskip("tqdm")
    refgeo.spread(300, 7, init="random", method="smooth", max_time=0.3, progress=True, seed=0)
    last = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert last.startswith("spread: 100%") and "/1.0" not in last and "ratio=" in last, last
    refgeo.spread(300, 7, init="random", method="smooth", max_rounds=3, progress=True, seed=0)
    last = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert "4/4" in last, last  # counted steps keep tqdm's counter


@compiled
def test_a_tqdm_bar_is_full_only_when_the_call_ends(cython, monkeypatch):
    """k-NN of sign rows redoes tied rows in passes nobody announced: the bar, like a
    callable, stays short of its total until the call ends (it was full before the
    redo pass, then its total grew), and it ends full."""
    tqdm_std = pytest.importorskip("tqdm.std")
    states = []
    real = tqdm_std.tqdm.update

    def update(self, n=1):
        out = real(self, n)
        states.append((self.n, self.total))
        return out

    monkeypatch.setattr(tqdm_std.tqdm, "update", update)
    S = np.random.default_rng(4).choice([-1.0, 1.0], (3000, 16)).astype(np.float32)
    refgeo.knn(S, 8, tile_size=64, progress=True)
    assert len(states) >= 2
    assert all(n < total for n, total in states[:-1]), states
    assert states[-1][0] == states[-1][1]
    assert [t for _, t in states] == sorted(t for _, t in states)  # the total never shrinks


def test_progress_true_on_the_reference_backend_draws_one_step(capsys):
    pytest.importorskip("tqdm")
    with refgeo.use_backend("reference"):
        refgeo.row_diameter(_rows(600, 5), tile_size=100, progress=True)
    err = capsys.readouterr().err
    assert "row_diameter" in err and "1/1" in err  # the whole run is one step there


# ------------------------------------------------------------------ memory


def _too_many_rows(bytes_per_row_pair):
    """A row count whose quadratic output is twice the memory available now."""
    avail = _memory.available_memory()
    if avail is None:
        pytest.skip("available memory unknown here")
    return int(math.sqrt(2.0 * avail / bytes_per_row_pair)) + 2


def _fails_fast(call, *words):
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(MemoryError) as info:
            call()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - t0 < 5.0
    assert peak < 64 * 2**20, f"{peak} bytes allocated before the MemoryError"
    for w in words:
        assert w in str(info.value), str(info.value)
    return str(info.value)


def test_pdist_and_cdist_check_the_output_first():
    n = _too_many_rows(4.0)  # n^2 / 2 pairs of 8 bytes
    X = np.zeros((n, 2))
    msg = _fails_fast(lambda: refgeo.pdist_hilbert(X), "pdist_hilbert", f"n={n}", "available", "cdist_hilbert(X[a:b], X)")
    assert "GiB" in msg or "TiB" in msg
    _fails_fast(lambda: refgeo.pdist_hilbert(X, form="square"), "square output")
    m = _too_many_rows(8.0)
    A = np.zeros((m, 2))
    _fails_fast(lambda: refgeo.cdist_hilbert(A, A), "cdist_hilbert", f"({m}, {m})", "chunks")


def test_knn_checks_its_outputs_first():
    n = _too_many_rows(16.0)  # (n, k) int64 + float64 with k = n - 1
    X = np.arange(float(n)).reshape(n, 1)
    for backend in ("auto", "reference"):
        with refgeo.use_backend(backend):
            _fails_fast(lambda: refgeo.knn(X, n - 1), "knn", f"({n}, {n - 1})", "smaller k")


@compiled
def test_knn_checks_the_per_thread_heaps_first(cython):
    avail = _memory.available_memory()
    if avail is None:
        pytest.skip("available memory unknown here")
    n, k = 20_000, 400
    K = k + k // 2
    threads = int(2 * avail / (16.0 * n * K)) + 1  # the heaps alone: twice the memory
    if 16.0 * n * k > avail / 4 or threads > 10_000:
        pytest.skip("too much memory here for this size")
    X = np.arange(float(n)).reshape(n, 1)
    _fails_fast(lambda: refgeo.knn(X, k, n_threads=threads, tile_size=1), "heaps", f"K={K}", "n_threads")


# ------------------------------------------------------------------ CLI


@pytest.mark.skipif(not hasattr(__import__("os"), "openpty"), reason="needs a pseudo-terminal")
def test_cli_inspect_shows_the_engine_progress_on_a_terminal(tmp_path):
    """On a terminal (a pseudo-terminal 100 columns wide), ``refgeo inspect`` draws the
    bars of row_diameter and closest_pair on stderr; through a pipe it stays quiet."""
    pytest.importorskip("tqdm")
    import fcntl
    import os
    import struct
    import subprocess
    import sys
    import termios

    path = tmp_path / "m.npy"
    np.save(path, _rows(2000, 16))
    cmd = [sys.executable, "-m", "refgeo", "inspect", str(path)]
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    proc = subprocess.Popen(cmd, stdin=slave, stdout=subprocess.PIPE, stderr=slave, close_fds=True)
    os.close(slave)
    out = proc.stdout.read()
    proc.wait(timeout=120)

    def read():
        try:
            return os.read(master, 65536)
        except OSError:  # the child closed its end of the terminal
            return b""

    err = b"".join(iter(read, b""))
    os.close(master)
    assert proc.returncode == 0 and b"diameter" in out
    text = err.decode(errors="replace")
    assert "row_diameter" in text and "closest_pair" in text and "tile" in text, text
    piped = subprocess.run(cmd, capture_output=True, timeout=120)
    assert piped.returncode == 0 and b"row_diameter" not in piped.stderr
