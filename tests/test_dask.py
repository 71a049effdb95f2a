"""The Dask backend on a real ``distributed.LocalCluster``: identical to the single-machine engine.

One cluster for the module (two single-threaded worker processes on the loopback
interface), shut down at the end within a bounded time.  Every test compares a Dask
input against the same rows as a NumPy array on the single-machine engine, for exact
equality of values and indices (the certified values are refined float64 numbers, so
"equal" means bit for bit).  The module skips when ``dask`` or ``distributed`` is not
installed (the optional ``[dask]`` extra).
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import refgeo

da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")
cloudpickle = pytest.importorskip("cloudpickle")

from ._dask_cluster import TIMEOUT as _TIMEOUT  # noqa: E402
from ._dask_cluster import graph_key_clashes, kill_at_first_result, local_client  # noqa: E402
from .test_duplicate_rows import clouds_with_copies  # noqa: E402


@pytest.fixture(scope="module")
def client():
    with local_client() as c:
        yield c


def _rows(seed, V, d, dtype, ties):
    rng = np.random.default_rng(seed)
    if ties:  # small integers: many equal distances, so the tie rule decides
        S = rng.integers(-2, 3, size=(V, d)).astype(dtype)
    else:
        S = rng.standard_normal((V, d)).astype(dtype)
    return S


def _same_pair(a, b):
    assert (a.value, a.i, a.j) == (b.value, b.i, b.j)
    assert b.backend == "dask"
    assert a.dtype == b.dtype


def _same_rows(a, b):
    assert isinstance(b.indices, np.ndarray) and isinstance(b.distances, np.ndarray)
    np.testing.assert_array_equal(b.indices, a.indices)
    np.testing.assert_array_equal(b.distances, a.distances)
    assert b.distances.dtype == np.float64 and b.indices.dtype == np.int64
    assert b.backend == "dask" and a.dtype == b.dtype


def _chunks(draw, V):
    kind = draw(st.sampled_from(["one", "rows", "any"]))
    if kind == "one":
        return V
    if kind == "rows":
        return 1
    return draw(st.integers(1, V))  # a ragged last chunk unless it divides V


@st.composite
def _case(draw):
    V = draw(st.integers(2, 20))
    d = draw(st.integers(1, 9))
    dtype = draw(st.sampled_from([np.float64, np.float32]))
    return V, d, dtype, _chunks(draw, V), draw(st.booleans()), draw(st.integers(0, 2**16))


@settings(max_examples=10)
@given(_case())
def test_extreme_pairs_match_the_engine(client, case):
    V, d, dtype, chunk, ties, seed = case
    S = _rows(seed, V, d, dtype, ties)
    D = da.from_array(S, chunks=(chunk, d))
    _same_pair(refgeo.row_diameter(S), refgeo.row_diameter(D))
    _same_pair(refgeo.closest_pair(S), refgeo.closest_pair(D))
    _same_rows(refgeo.farthest_partners(S), refgeo.farthest_partners(D))


@pytest.mark.parametrize("ties", [True, False], ids=["ties", "normal"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_dask_input_ignores_the_requested_backend_and_matches_the_reference(client, ties, dtype):
    # the array type wins: under use_backend("reference") (as under REFGEO_BACKEND) a
    # Dask array still runs the task graph, bit for bit the reference's answers
    S = _rows(7, 203, 5, dtype, ties)
    D = da.from_array(S, chunks=(37, 5))
    with refgeo.use_backend("reference"):
        _same_pair(refgeo.row_diameter(S), refgeo.row_diameter(D))
        _same_pair(refgeo.closest_pair(S), refgeo.closest_pair(D))
        _same_rows(refgeo.farthest_partners(S), refgeo.farthest_partners(D))
        _same_rows(refgeo.knn(S, 6), refgeo.knn(D, 6))
        _same_rows(refgeo.knn(S, 4, S[:50]), refgeo.knn(D, 4, da.from_array(S[:50], chunks=(20, 5))))
        assert refgeo.row_diameter(S).backend == "reference"


@settings(max_examples=10)
@given(_case(), st.integers(1, 6), st.booleans())
def test_knn_matches_the_engine(client, case, k, exclude_self):
    V, d, dtype, chunk, ties, seed = case
    S = _rows(seed, V, d, dtype, ties)
    k = min(k, V - int(exclude_self))
    D = da.from_array(S, chunks=(chunk, d))
    _same_rows(refgeo.knn(S, k, exclude_self=exclude_self), refgeo.knn(D, k, exclude_self=exclude_self))


@settings(max_examples=8)
@given(_case(), st.integers(1, 30), st.integers(1, 8))
def test_knn_against_other_rows_matches_the_engine(client, case, n_y, k):
    V, d, dtype, chunk, ties, seed = case
    X = _rows(seed, V, d, dtype, ties)
    Y = _rows(seed + 1, n_y, d, dtype, ties)
    k = min(k, n_y)
    got = refgeo.knn(da.from_array(X, chunks=(chunk, d)), k, da.from_array(Y, chunks=(max(1, n_y // 2), d)))
    _same_rows(refgeo.knn(X, k, Y), got)


@pytest.mark.parametrize(
    "V, chunks", [(40, (7, 4)), (8, (1, 4)), (40, (40, 4)), (40, (13, 1))],
    ids=["ragged", "rows", "one", "columns"],
)
def test_chunkings_of_one_matrix_agree(client, V, chunks):
    # (13, 1) chunks the column axis too: the backend merges the column chunks
    S = _rows(3, V, 4, np.float64, ties=True)
    D = da.from_array(S, chunks=chunks)
    _same_pair(refgeo.row_diameter(S), refgeo.row_diameter(D))
    _same_rows(refgeo.knn(S, 5), refgeo.knn(D, 5))
    assert refgeo.distance_ratio(D) == refgeo.distance_ratio(S)


@pytest.mark.parametrize("engine", ["compiled", "numpy", "array"])
def test_extreme_pair_tasks_of_either_engine(client, engine):
    # the compiled block-pair tasks, the NumPy ones (no extension on the workers) and
    # the array-API ones (CuPy chunks; here on NumPy)
    from refgeo import _dask

    for seed, ties, chunk in [(1, False, 7), (2, True, 5), (3, True, 40)]:
        S = _rows(seed, 40, 4, np.float32, ties)
        D = da.from_array(S, chunks=(chunk, 4))
        for maximize, fn in [(True, refgeo.row_diameter), (False, refgeo.closest_pair)]:
            want, got = fn(S), _dask._extreme(D, maximize=maximize, tile_size=None, engine=engine)
            assert (got.value, got.i, got.j) == (want.value, want.i, want.j)


@pytest.mark.parametrize("V", [9, 10, 18])
def test_one_row_chunks_beyond_one_reduction_group(client, V):
    # one-row blocks have no pair of their own: with more than eight blocks a group of
    # the tree reduction can hold only that empty record
    S = _rows(V, V, 3, np.float64, ties=False)
    D = da.from_array(S, chunks=(1, 3))
    _same_rows(refgeo.farthest_partners(S), refgeo.farthest_partners(D))
    _same_rows(refgeo.knn(S, 3), refgeo.knn(D, 3))


def test_task_blocks_larger_than_the_cap_are_split(client, monkeypatch):
    from refgeo import _dask

    S = _rows(5, 60, 3, np.float32, ties=False)
    D = da.from_array(S, chunks=(60, 3))
    # tile_size caps the rows of a task block: one chunk becomes several tasks
    _same_pair(refgeo.row_diameter(S), refgeo.row_diameter(D, tile_size=7))
    _same_rows(refgeo.farthest_partners(S), refgeo.farthest_partners(D, tile_size=7))
    assert _dask.block_rows((60,), 7) == (7,) * 6 + (6,) * 3


def test_wide_range_float64_rows_are_prescaled_alike(client):
    S = _rows(8, 30, 5, np.float64, ties=False) * 1e200
    D = da.from_array(S, chunks=(8, 5))
    a, b = refgeo.row_diameter(S), refgeo.row_diameter(D)
    _same_pair(a, b)
    assert b.scale_exponent == a.scale_exponent != 0
    _same_rows(refgeo.knn(S, 3), refgeo.knn(D, 3))


def test_near_ties_in_the_float32_band(client):
    # two far-apart clusters of near-duplicate float64 rows: thousands of cross pairs lie
    # within the float32 bound of the diameter, and near-duplicates make the closest
    # pairs and the k-NN hinge on the last bits of the refined values
    rng = np.random.default_rng(4)
    S = np.repeat([[1e3] * 6, [-1e3] * 6], 24, axis=0) + rng.standard_normal((48, 6)) * 1e-9
    S[5] = S[30] + 1e-13
    D = da.from_array(S, chunks=(11, 6))
    _same_pair(refgeo.row_diameter(S), refgeo.row_diameter(D))
    _same_pair(refgeo.closest_pair(S), refgeo.closest_pair(D))
    _same_rows(refgeo.farthest_partners(S), refgeo.farthest_partners(D))
    _same_rows(refgeo.knn(S, 7), refgeo.knn(D, 7))


def test_memory_mapped_npy(client, tmp_path):
    S = _rows(11, 50, 6, np.float32, ties=False)
    path = tmp_path / "rows.npy"
    np.save(path, S)
    D = da.from_array(np.load(path, mmap_mode="r"), chunks=(16, 6))
    _same_pair(refgeo.row_diameter(S), refgeo.row_diameter(D))
    _same_rows(refgeo.knn(S, 4), refgeo.knn(D, 4))
    # the form of docs/cluster.md for large files: each task opens the memory map itself,
    # so only the file name travels through the scheduler
    import dask

    S = _rows(12, 400, 6, np.float32, ties=False)
    np.save(path, S)
    read = dask.delayed(lambda a, b: np.load(path, mmap_mode="r")[a:b], pure=True)
    D = da.concatenate([da.from_delayed(read(a, a + 100), shape=(100, 6), dtype=S.dtype) for a in range(0, 400, 100)])
    assert len(cloudpickle.dumps(dict(D.__dask_graph__()))) < S.nbytes / 2
    _same_pair(refgeo.row_diameter(S), refgeo.row_diameter(D))
    _same_rows(refgeo.farthest_partners(S), refgeo.farthest_partners(D))


def test_zarr_input(client, tmp_path):
    # a zarr array is read chunk by chunk by the tasks (only the store's path travels)
    zarr = pytest.importorskip("zarr")
    S = _rows(13, 300, 5, np.float32, ties=False)
    z = zarr.create_array(store=str(tmp_path / "rows.zarr"), shape=S.shape, chunks=(64, 5), dtype=S.dtype)
    z[:] = S
    D = da.from_zarr(str(tmp_path / "rows.zarr"))
    assert D.chunks[0][0] == 64
    assert len(cloudpickle.dumps(dict(D.__dask_graph__()))) < S.nbytes / 2
    _same_pair(refgeo.row_diameter(S), refgeo.row_diameter(D))
    _same_rows(refgeo.knn(S, 6), refgeo.knn(D, 6))


@pytest.mark.parametrize("engine", ["compiled", "numpy", "array"])
def test_knn_duplicate_rows_overflow_the_heaps(client, engine):
    # four distinct points repeated: more exact ties at the k-th distance than a task's
    # heap holds, so rows are refined against the whole block (the compiled and the
    # array-API tasks) and the tie rule alone decides; the NumPy tasks (no extension on
    # the workers) and the array-API tasks (CuPy chunks; here on NumPy) agree
    from refgeo import _dask

    S = np.random.default_rng(3).integers(0, 2, size=(60, 2)).astype(np.float32)
    for k, chunk in [(1, 30), (5, 60), (3, 7)]:
        D = da.from_array(S, chunks=(chunk, 2))
        got = _dask.knn(D, k, None, exclude_self=True, engine=engine)
        want = refgeo.knn(S, k)
        np.testing.assert_array_equal(got.indices, want.indices)
        np.testing.assert_array_equal(got.distances, want.distances)
        Y = S[::3] + 1
        got = _dask.knn(D, k, da.from_array(Y, chunks=(9, 2)), exclude_self=False, engine=engine)
        want = refgeo.knn(S, k, Y)
        np.testing.assert_array_equal(got.indices, want.indices)
        np.testing.assert_array_equal(got.distances, want.distances)


@pytest.mark.parametrize("engine", ["compiled", "array", "numpy"])
def test_knn_of_lm_gradient_rows_is_certified_from_the_heaps(client, engine):
    """LM-head gradient rows (norms over nine decades): a task bounded the pairs its heap
    dropped with the largest norm of the block, so no row of the small ones was settled
    and every pair was refined (16.5 million of 16.8 million at 4096 x 256, 3.5 s against
    0.37 s for Gaussian rows).  Keys on lowered norms bound each pair by its own; the
    NumPy tasks (``engine="numpy"``) bounded a row's pairs by the largest norm of the
    other block in the same way (870,000 pairs refined here in float32)."""
    from refgeo import _dask
    from refgeo._lm_gradients import lm_gradient

    for dtype in (np.float32, np.float64):
        S = lm_gradient(1024, 64, n_tokens=512, seed=1).astype(dtype)
        got = _dask.knn(da.from_array(S, chunks=(256, 64)), 8, None, exclude_self=True, engine=engine)
        want = refgeo.knn(S, 8)
        np.testing.assert_array_equal(got.indices, want.indices)
        np.testing.assert_array_equal(got.distances, want.distances)
        assert got.n_refined <= 16 * 8 * len(S)  # all pairs: about a million


@pytest.mark.parametrize("engine", ["compiled", "numpy", "array"])
def test_tiny_float32_rows_are_filtered_in_float64(client, engine):
    """float32 rows of norm about 1e-18: the float32 filter's absolute term exceeds
    every distance there, so the NumPy tasks, which kept it, refined all 523,776 pairs
    of the k-NN; the compiled and array-API tasks switch to float64, as the engines do."""
    from refgeo import _dask

    X = (_rows(15, 1024, 16, np.float64, ties=False) * 1e-19).astype(np.float32)
    got = _dask.knn(da.from_array(X, chunks=(256, 16)), 5, None, exclude_self=True, engine=engine)
    want = refgeo.knn(X, 5)
    np.testing.assert_array_equal(got.indices, want.indices)
    np.testing.assert_array_equal(got.distances, want.distances)
    assert got.n_refined <= 4 * 5 * len(X)


@st.composite
def _side_case(draw):
    # synthetic filter values and norms, not from rows: pairs placed a few ulps around
    # the lower-end threshold t_i of their row, with column norms up to 2**60 times
    # the row's (b_j far above t_i + a_i, which rows of a real block never reach)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    na, nb = draw(st.integers(1, 4)), draw(st.integers(2, 6))
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    c = draw(st.sampled_from([1e-10, 1e-6, 1e-3]))
    nA = 2.0 ** rng.integers(-20, 20, na) * rng.uniform(0, 1, na)
    nB = 2.0 ** rng.integers(-20, 60, nb) * rng.uniform(0, 1, nb)
    bj = c * nB * (1.0 + 2.0**-40)
    H = (bj[None, :] * (1.0 + 2.0**-50) + rng.uniform(-1.0, 1.0, (na, nb)) * rng.choice([0.0, 1e-12, 1.0], (na, nb)))
    H += rng.integers(-8, 9, H.shape) * np.spacing(np.abs(H) + 1e-300)
    return H.astype(dtype), nA, nB, c, draw(st.integers(1, nb))


@settings(max_examples=300, deadline=None)
@given(case=_side_case())
@example(case=(np.array([[0.0, 0.6132501978417401]]), np.array([0.0]), np.array([0.0, 6132501978.411818]),
               1e-10, 1))
def test_knn_side_keeps_every_pair_within_the_threshold(case):
    """The NumPy k-NN tasks pick candidates by a key in the filter dtype first, then by
    the float64 lower end: every pair whose lower end is at most the row's threshold
    must survive the first step.  The example is a reviewer's: with a margin of
    ``2**-50 max b`` the float64 rounding of the lower end (about ``2**-53 b_j``) lost
    a pair whose column norm is 1e10 times the threshold."""
    from refgeo import _dask

    H, nA, nB, c, m = case
    eabs = 1e-300
    b = _dask._Blocks(None, None, H, nA, nB, c, eabs, 0.0)
    hi, cand = _dask._knn_side(H, nA, nB, b, m)
    a = (c * nA + eabs) * (1.0 + 2.0**-40)
    bj = c * nB * (1.0 + 2.0**-40)
    H64 = H.astype(np.float64)
    lo = H64 - ((a[:, None] + bj[None, :]) + np.abs(H64) * 2.0**-50)
    t = hi.max(axis=1)
    want = set(zip(*np.nonzero(lo <= t[:, None])))
    assert set(zip(cand.rows.tolist(), cand.cols.tolist())) == {(int(i), int(j)) for i, j in want}


@st.composite
def _seeded_case(draw):
    # a few distinct integer rows, each repeated across the row blocks: many keys equal
    # a row's seed (the K-th key of its first block pair) exactly; blocks of fewer rows
    # than a heap holds sit before and after full ones, so a seeded heap may drop pairs
    # even where it has room for every candidate
    k = draw(st.integers(1, 4))
    full = k + 8  # heap entries of a row against a large block
    sizes = draw(st.lists(st.one_of(st.integers(1, full), st.integers(full + 2, 2 * full + 4)),
                          min_size=2, max_size=4))
    d = draw(st.integers(1, 3))
    n_distinct = draw(st.integers(1, 4))
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    return k, tuple(sizes), d, n_distinct, dtype, draw(st.booleans()), draw(st.integers(0, 2**16))


@settings(max_examples=25)
@given(_seeded_case())
def test_knn_seeded_heaps_keep_exact_ties(client, case):
    k, sizes, d, n_distinct, dtype, exclude_self, seed = case
    rng = np.random.default_rng(seed)
    points = rng.integers(-2, 3, size=(n_distinct, d))
    S = points[rng.integers(0, n_distinct, size=sum(sizes))].astype(dtype)
    k = min(k, S.shape[0] - int(exclude_self))
    D = da.from_array(S, chunks=(sizes, d))
    _same_rows(refgeo.knn(S, k, exclude_self=exclude_self), refgeo.knn(D, k, exclude_self=exclude_self))
    # X against Y: the first block of Y seeds the row's heaps in the other blocks of Y
    Y = S[::-1].copy()
    got = refgeo.knn(da.from_array(S, chunks=(sizes[::-1], d)), k, da.from_array(Y, chunks=(sizes, d)))
    _same_rows(refgeo.knn(S, k, Y), got)


def _cli(*argv, env=None):
    """``refgeo ...`` in a subprocess: its Dask client, IO loop and threads end with it."""
    import subprocess
    import sys

    code = "import sys; from refgeo import cli; sys.exit(cli.main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                          timeout=_TIMEOUT, env=env)


@pytest.mark.parametrize("suffix", [".npy", ".npz"])
def test_cli_inspect_on_a_scheduler(client, tmp_path, capsys, suffix):
    # the same report as on one machine; the progress lines come from the scheduler
    import json

    from refgeo import cli

    S = _rows(14, 90, 5, np.float32, ties=False)
    path = str(tmp_path / f"rows{suffix}")
    np.save(path, S) if suffix == ".npy" else np.savez(path, S=S)
    assert cli.main(["inspect", path, "--json", "--no-progress"]) == 0
    want = json.loads(capsys.readouterr().out)
    run = _cli("inspect", path, "--json", "--progress", "--scheduler", client.scheduler.address,
               "--chunk-rows", "16")
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout)
    for key in ("diameter", "closest_pair"):
        assert got[key]["backend"] == "dask"
        assert (got[key]["value"], got[key]["pair"]) == (want[key]["value"], want[key]["pair"])
    assert got["ratio"] == want["ratio"]
    lines = [ln for ln in run.stderr.splitlines() if ln.startswith("refgeo inspect: dask: ")]
    assert lines, run.stderr
    done, total = map(int, lines[-1].split()[-2].split("/"))
    assert done == total > 6 * 7 // 2  # at least the block-pair tasks of 6 blocks


def test_cli_inspect_on_a_scheduler_from_a_running_event_loop(client, tmp_path, capsys):
    """cli.main called where an event loop runs (a notebook cell): the scheduler probe's
    asyncio.run refused to run there, and the command blamed the scheduler."""
    import asyncio
    import json

    from refgeo import cli

    path = str(tmp_path / "rows.npy")
    np.save(path, _rows(3, 30, 4, np.float64, ties=False))

    async def cell():
        return cli.main(["inspect", path, "--json", "--no-progress", "--scheduler", client.scheduler.address])

    assert asyncio.run(cell()) == 0
    assert json.loads(capsys.readouterr().out)["diameter"]["backend"] == "dask"


def _task_names(client):
    """A scheduler plugin (the scheduler of the module's cluster runs in this process) that
    records the name of every task that finishes: ``plugin.names``."""
    from distributed.diagnostics.plugin import SchedulerPlugin

    class Names(SchedulerPlugin):
        name = "record-task-names"

        def __init__(self):
            self.names = set()

        def transition(self, key, start, finish, *args, **kwargs):
            if finish == "memory":
                self.names.add(str(key[0] if isinstance(key, tuple) else key).rpartition("-")[0])

    return Names()


@pytest.mark.parametrize("dtype", [np.float32, np.int16])
def test_cli_inspect_npy_is_read_by_the_workers(client, tmp_path, dtype):
    # a .npy FILE is read by the workers' own tasks, --chunk-rows rows each (only its
    # path travels), also where the rows are converted (integers to float64); a .npz is
    # sent from the command's process
    S = _rows(15, 60, 4, np.float64, ties=True).astype(dtype)
    path = tmp_path / "rows.npy"
    np.save(path, S)
    plugin = _task_names(client)
    client.cluster.scheduler.add_plugin(plugin)
    try:
        run = _cli("inspect", str(path), "--json", "--no-progress", "--scheduler", client.scheduler.address,
                   "--chunk-rows", "16")
    finally:
        client.cluster.scheduler.remove_plugin(plugin.name)
    assert run.returncode == 0, run.stderr
    # the reading tasks (fused with their first consumers by Dask's optimization)
    assert any("read_npy_rows" in n for n in plugin.names), sorted(plugin.names)
    got = json.loads(run.stdout)
    for key, fn in (("diameter", refgeo.row_diameter), ("closest_pair", refgeo.closest_pair)):
        want = fn(S)
        assert got[key]["backend"] == "dask"
        assert (got[key]["value"], got[key]["pair"]) == (want.value, [want.i, want.j])


def test_cli_ctrl_c_on_a_scheduler_prints_one_line(client, tmp_path):
    """Ctrl-C during the gather left the client's wait task with distributed's AllExit,
    which asyncio reported with its traceback ("Task exception was never retrieved") as
    the client closed, before the command's one line."""
    from ._interrupt import interrupt

    path = tmp_path / "rows.npy"
    np.save(path, np.random.default_rng(0).standard_normal((40000, 128)).astype(np.float32))
    code = ("import sys; from refgeo import cli; print('ready', flush=True); "
            f"sys.exit(cli.main(['inspect', {str(path)!r}, '--scheduler', {client.scheduler.address!r}, "
            "'--chunk-rows', '2000']))")
    res = interrupt(code, delay=3.0, exit_timeout=60.0)
    assert res.returncode == 130, res.err
    assert res.err.splitlines() == ["refgeo inspect: interrupted"], res.err


def test_cli_inspect_scheduler_errors(tmp_path):
    path = str(tmp_path / "rows.npy")
    np.save(path, _rows(1, 10, 3, np.float64, ties=False))
    run = _cli("inspect", path, "--scheduler", "tcp://127.0.0.1:9", "--scheduler-timeout", "1")
    assert run.returncode == 2, run.stderr
    assert "could not connect to the Dask scheduler at 'tcp://127.0.0.1:9'" in run.stderr, run.stderr
    run = _cli("inspect", path, "--scheduler", "tcp://127.0.0.1:9", "--scheduler-timeout", "0")
    assert run.returncode == 2 and "--scheduler-timeout" in run.stderr, run.stderr
    # malformed addresses: one line, and no traceback from the half-made client at exit
    for address in ["foo", "tcp://127.0.0.1:notaport", "http://127.0.0.1:9", "inproc://x"]:
        run = _cli("inspect", path, "--scheduler", address, "--scheduler-timeout", "1")
        assert run.returncode == 2, run.stderr
        (line,) = run.stderr.splitlines()
        assert line.startswith(f"refgeo inspect: error: --scheduler {address!r} is not a Dask scheduler address"), line
    # tls:// without credentials: Client's TypeError, and a traceback 20 s later at exit
    run = _cli("inspect", path, "--scheduler", "tls://127.0.0.1:9", "--scheduler-timeout", "1")
    (line,) = run.stderr.splitlines()
    assert run.returncode == 2 and "tls:// needs TLS credentials" in line, run.stderr
    # a port that accepts and never speaks Dask (here: a socket that only listens; any
    # other server): the client's timeout did not cover the handshake, and it hung
    import socket

    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        address = f"tcp://127.0.0.1:{srv.getsockname()[1]}"
        run = _cli("inspect", path, "--scheduler", address, "--scheduler-timeout", "1")
    (line,) = run.stderr.splitlines()
    assert run.returncode == 2 and f"at {address!r}: no answer within 1 s" in line, run.stderr


def test_nan_names_the_chunk(client):
    S = _rows(1, 40, 3, np.float64, ties=False)
    S[25, 1] = np.nan
    with pytest.raises(ValueError, match=r"chunk of rows 20:30"):
        refgeo.row_diameter(da.from_array(S, chunks=(10, 3)))
    with pytest.raises(ValueError, match=r"X must contain only finite values.*rows 20:30"):
        refgeo.knn(da.from_array(S, chunks=(10, 3)), 2)


def test_unknown_chunk_sizes_name_the_argument(client):
    # after a boolean mask the row count is NaN: every function says which argument,
    # and how to cure it, before any memory estimate or check of k sees the NaN
    S = _rows(4, 13, 4, np.float64, ties=False)
    D = da.from_array(S, chunks=(5, 4))
    masked = D[D[:, 0] > -10]
    for name, call in [("S", lambda: refgeo.row_diameter(masked)), ("S", lambda: refgeo.closest_pair(masked)),
                       ("X", lambda: refgeo.knn(masked, 2)), ("Y", lambda: refgeo.knn(S, 2, masked))]:
        with pytest.raises(ValueError, match=rf"^{name} has unknown chunk sizes.*{name}\.compute_chunk_sizes\(\)"):
            call()


def test_masked_entries_are_refused_as_for_numpy(client):
    # the tasks read the blocks through np.asarray, the values under the mask included:
    # a masked outlier was the diameter, and a masked NaN (which the masked finiteness
    # check skipped) became an error about the GEMM range
    S = np.array([[0.0, 0.0], [3.0, 4.0], [1.0, 1.0], [1e6, 0.0]])
    masked = da.ma.masked_greater(da.from_array(S, chunks=(2, 2)), 1000.0)
    msg = ("S must not have masked entries (NumPy would use the values under the mask), got 1 masked entry "
           "instead; pass dask.array.ma.filled(S, value)")
    with pytest.raises(TypeError, match=re.escape(msg)):
        refgeo.row_diameter(masked)
    with pytest.raises(TypeError, match=re.escape("Y must not have masked entries")):
        refgeo.knn(S, 1, da.ma.masked_invalid(da.from_array(np.vstack([S[:3], [[np.nan, 0.0]]]), chunks=(2, 2))))
    # a masked array without masked entries is its data, as for NumPy
    whole = da.ma.masked_greater(da.from_array(S, chunks=(2, 2)), 1e7)
    assert refgeo.row_diameter(whole).value == refgeo.row_diameter(S).value


def test_knn_keeps_no_centered_copies_after_the_call():
    """The k-NN filter tasks memoize the centered copies of their blocks; entries of
    freed blocks were purged only at the next insertion, so after a call on the
    threaded scheduler the caller's process held up to 16 of them (a copy of the whole
    input here).  An entry goes when its block or the call's mean is collected."""
    import gc

    import dask

    from refgeo import _dask

    X = np.random.default_rng(8).standard_normal((1200, 16))
    with dask.config.set(scheduler="threads"):
        res = refgeo.knn(da.from_array(X, chunks=(200, 16)), 3)
        gc.collect()
        assert len(_dask._CENTERED) == 0
        _same_rows(refgeo.knn(X, 3), res)
        # and within a call the memo still serves: the same answer from a graph whose
        # blocks stay alive (persisted) across two calls
        D = da.from_array(X, chunks=(200, 16)).persist()
        _same_rows(refgeo.knn(D, 3), refgeo.knn(D, 3))
        gc.collect()
        assert len(_dask._CENTERED) == 0
        # and no finalizer stays behind on the blocks that live on (one per call did)
        alive = _alive_finalizers()
        for _ in range(3):
            refgeo.knn(D, 3)
        gc.collect()
        assert _alive_finalizers() == alive


def _alive_finalizers():
    import gc
    import weakref

    return sum(1 for o in gc.get_objects() if isinstance(o, weakref.finalize) and o.alive)


def _hide_ext():
    import refgeo._backend as b

    b._hidden_ext, b._ext = b._ext, None


def _restore_ext():
    import refgeo._backend as b

    b._ext = b.__dict__.pop("_hidden_ext", b._ext)


def test_a_worker_without_the_extension_says_so(client):
    """The engine is chosen where the call runs, the kernels run on the workers: a worker
    whose refgeo had no refgeo_ext failed with "AttributeError: 'NoneType' object has
    no attribute '_common'".  It is an ImportError saying what to install."""
    if refgeo.show_config(mode="dicts")["backends"]["cython"]["available"] is not True:
        pytest.skip("the client has no compiled extension: it picks the NumPy tasks")
    S = np.random.default_rng(9).standard_normal((60, 4))
    D = da.from_array(S, chunks=(20, 4))
    client.run(_hide_ext)
    try:
        for call in (lambda: refgeo.row_diameter(D), lambda: refgeo.closest_pair(D), lambda: refgeo.knn(D, 2)):
            with pytest.raises(ImportError, match="refgeo_ext .* is not importable on the Dask worker"):
                call()
    finally:
        client.run(_restore_ext)
    _same_pair(refgeo.row_diameter(S), refgeo.row_diameter(D))  # the workers have it again


def test_dask_and_numpy_rows_together(client):
    # a NumPy matrix next to a Dask one runs on the Dask engine, with the same bits
    X = _rows(5, 23, 4, np.float64, ties=True)
    Y = _rows(6, 9, 4, np.float64, ties=True)
    want = refgeo.knn(X, 3, Y)
    for got in (refgeo.knn(da.from_array(X, chunks=(7, 4)), 3, Y), refgeo.knn(X, 3, da.from_array(Y, chunks=(4, 4)))):
        _same_rows(want, got)


def test_covering_radius_of_dask_rows_is_the_one_of_numpy_rows(client):
    # it passed the Dask array to DLPack (AttributeError: no __dlpack__)
    S = _rows(7, 40, 5, np.float64, ties=True)
    want = refgeo.covering_radius(S)
    got = refgeo.covering_radius(da.from_array(S, chunks=(9, 5)))
    assert (got.radius, got.lower_bound, got.n_iter) == (want.radius, want.lower_bound, want.n_iter)
    np.testing.assert_array_equal(np.asarray(got.center), want.center)
    np.testing.assert_array_equal(np.asarray(got.weights), want.weights)


def test_hilbert_rms_and_backward_bound_of_dask_rows_next_to_numpy_arrays(client):
    # a NumPy panel or residual next to Dask rows was array_api_compat's "Multiple
    # namespaces" TypeError; it is wrapped as a Dask array, as knn's Y is
    g = np.random.default_rng(8)
    S, H, r, R = g.standard_normal((30, 4)), g.standard_normal((7, 4)), g.standard_normal(30), g.standard_normal((3, 30))
    D = da.from_array(S, chunks=(10, 4))
    assert refgeo.hilbert_rms(D, H) == refgeo.hilbert_rms(S, H)
    assert refgeo.backward_bound(D, r) == refgeo.backward_bound(S, r)
    np.testing.assert_array_equal(np.asarray(refgeo.backward_bound(D, R)), refgeo.backward_bound(S, R))


def test_mixed_dtypes(client):
    X = _rows(2, 20, 4, np.float32, ties=False)
    Y = _rows(3, 25, 4, np.float64, ties=False)
    got = refgeo.knn(da.from_array(X, chunks=(6, 4)), 3, da.from_array(Y, chunks=(10, 4)))
    want = refgeo.knn(X, 3, Y)
    _same_rows(want, got)
    assert got.dtype == "float64"
    # integers are converted to float64, as for NumPy input
    Z = np.arange(24).reshape(8, 3) ** 2
    _same_pair(refgeo.row_diameter(Z), refgeo.row_diameter(da.from_array(Z, chunks=(3, 3))))
    with pytest.raises(TypeError, match="S must have a real floating dtype"):
        refgeo.row_diameter(da.from_array(np.ones((4, 2), dtype=complex), chunks=2))
    # beyond 2**53 float64 would round them (2**53 + 1 to 2**53): refused, as NumPy input is
    Z[5, 1] = 2**53 + 1
    with pytest.raises(ValueError, match=r"S must have integer entries of magnitude at most 2\*\*53"):
        refgeo.row_diameter(da.from_array(Z, chunks=(3, 3)))
    with pytest.raises(ValueError, match=r"Y must have integer entries"):
        refgeo.knn(X, 1, da.from_array(Z[:, :4 - 1].repeat(2, axis=1)[:, :4], chunks=(3, 4)))


def test_killed_worker_gives_the_same_result(client):
    # one worker process is killed as soon as it has finished the first block-pair
    # filter task of the k-NN graph (the refinements and merges still to come need its
    # result); Dask reruns the lost tasks on the other worker and on the restarted one
    S = _rows(21, 300, 8, np.float64, ties=True)
    D = da.from_array(S, chunks=(15, 8))
    pids = client.run(os.getpid)
    scheduler = client.cluster.scheduler  # in this process: the plugin sees every transition
    plugin = kill_at_first_result(pids, "_knn_")
    scheduler.add_plugin(plugin)
    try:
        got = refgeo.knn(D, 4)
    finally:
        scheduler.remove_plugin(plugin.name)
    assert plugin.killed is not None, "no k-NN task finished on a worker of the cluster"
    _same_rows(refgeo.knn(S, 4), got)
    client.wait_for_workers(2, timeout=_TIMEOUT)
    # the killed process is gone: its nanny started a new one
    assert pids[plugin.killed] not in client.run(os.getpid).values()


@settings(max_examples=30)
@given(st.integers(1, 40), st.integers(1, 300), st.integers(-30, 30))
def test_refine_pairs_is_the_canonical_sum(d, n, scale):
    # the tasks' refinement must give the bits of the one canonical summation order
    from refgeo._certify import canonical_sq
    from refgeo._dask import refine_pairs

    rng = np.random.default_rng(d * 1000 + n)
    A = rng.standard_normal((17, d)) * 2.0**scale
    B = rng.standard_normal((9, d))
    r, q = rng.integers(0, 17, n), rng.integers(0, 9, n)
    np.testing.assert_array_equal(refine_pairs(A, B, r, q), canonical_sq(np, A[r], B[q]))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 70), st.integers(1, 70), st.integers(1, 9), st.integers(1, 20),
       st.sampled_from([1, 3, 16, 1024]), st.sampled_from(["float32", "float64"]), st.booleans())
def test_record_heaps_hold_the_keys_of_the_split_heaps(na, nb, d, K, tile, dtype, ties):
    # block_pair_records (the engine's vectorized epilogue) against block_pair_keys (the
    # plain loop) on two distinct blocks: per row the same multiset of kept keys, and
    # each record names a row whose key it holds (ties may keep other ids)
    import math

    from refgeo import _backend, _dask

    if not _backend.available_backends()["cython"][0]:
        pytest.skip("the compiled extension is not built")
    ext = _backend.extension()
    rng = np.random.default_rng(na * 10007 + nb * 101 + d)
    draw = (lambda n: rng.integers(-1, 2, (n, d))) if ties else (lambda n: rng.standard_normal((n, d)))
    A, B = draw(na).astype(dtype), draw(nb).astype(dtype)
    nA = np.einsum("ij,ij->i", A.astype(np.float64), A.astype(np.float64))
    nB = np.einsum("ij,ij->i", B.astype(np.float64), B.astype(np.float64))
    s = "32" if dtype == "float32" else "64"
    ka, kb = np.full((na, K), math.inf), np.full((nb, K), math.inf)
    ia, ib = np.full((na, K), -1, dtype=np.int64), np.full((nb, K), -1, dtype=np.int64)
    getattr(ext._knn_blocks, "block_pair_keys" + s)(A, nA, B, nB, False, False, True, tile, ka, ia, kb, ib)
    old = _dask._KNN_TASK_TILE
    try:
        _dask._KNN_TASK_TILE = tile
        ra, rida, rb, ridb = _dask._records_pair(ext, s, A, nA, B, nB, K)
    finally:
        _dask._KNN_TASK_TILE = old
    np.testing.assert_array_equal(np.sort(ra, axis=1), np.sort(ka, axis=1))
    np.testing.assert_array_equal(np.sort(rb, axis=1), np.sort(kb, axis=1))
    G = A.astype(np.float64) @ B.astype(np.float64).T
    for keys, ids, n_other, rows_g in ((ra, rida, nB, G), (rb, ridb, nA, G.T)):
        assert np.array_equal(ids < 0, np.isinf(keys))
        r, c = np.nonzero(ids >= 0)
        # the key of a record is n_j - 2 g_ij of the row it names, up to the filter's rounding
        np.testing.assert_allclose(keys[r, c], n_other[ids[r, c]] - 2 * rows_g[r, ids[r, c]],
                                   rtol=1e-5, atol=1e-3 * (1 + np.abs(n_other).max()))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 60), st.integers(0, 60), st.integers(1, 6), st.sampled_from([1, 4, 256]),
       st.sampled_from(["float32", "float64"]), st.booleans(), st.sampled_from(["grid", "normal", "near"]),
       st.sampled_from([None, "best", "pair", "half"]), st.booleans())
def test_extreme_pair_task_is_the_exact_extreme(na, nb, d, tile, dtype, maximize, kind, seed, tight):
    # one block-pair task of the compiled engine (its tiles scanned row by row before the
    # pair loop) against the brute-force extreme with the tie rule, on rows with many
    # exact ties (integer grids), without, or near-copies far from the origin (every pair
    # in the float32 band); the diameter from a seed (the refined maximum itself, which
    # every pair that ties it must still reach, another pair's value, or half of it),
    # the closest pair with a budget of a few refinements (tight: the float64 rerun)
    from refgeo import _backend, _dask, _engine

    if not _backend.available_backends()["cython"][0]:
        pytest.skip("the compiled extension is not built")
    rng = np.random.default_rng(na * 1009 + nb * 31 + d)
    if kind == "grid":
        draw = lambda n: rng.integers(-2, 3, (n, d))  # noqa: E731
    elif kind == "near":
        draw = lambda n: 100.0 + 1e-6 * rng.standard_normal((n, d))  # noqa: E731
    else:
        draw = lambda n: rng.standard_normal((n, d))  # noqa: E731
    SA = draw(na).astype(dtype)
    SB = None if nb == 0 else draw(nb).astype(dtype)
    B = SA if SB is None else SB
    A64, B64 = SA.astype(np.float64), B.astype(np.float64)
    pairs = [(i, j) for i in range(na) for j in range(B.shape[0]) if SB is not None or i < j]
    r, q = np.array([p[0] for p in pairs], dtype=np.int64), np.array([p[1] for p in pairs], dtype=np.int64)
    D = _dask.refine_pairs(A64, B64, r, q)  # the refined values, as the task refines
    bound0 = None
    if maximize and seed is not None and pairs:
        bound0 = {"best": D.max(), "pair": D[len(pairs) // 2], "half": 0.5 * D.max()}[seed]
    old = _dask._TASK_TILE, _engine.MIN_MIXED_BUDGET, _engine.MIN_MIXED_BUDGET_DIVISOR
    try:
        _dask._TASK_TILE = tile
        if tight:
            _engine.MIN_MIXED_BUDGET, _engine.MIN_MIXED_BUDGET_DIVISOR = 2, 1 << 30
        got = _dask._pair_task_compiled(SA, SB, 0, 0, np.zeros(d), maximize, bound0)
    finally:
        _dask._TASK_TILE, _engine.MIN_MIXED_BUDGET, _engine.MIN_MIXED_BUDGET_DIVISOR = old
    if not pairs:
        assert got is None
        return
    best = D.max() if maximize else D.min()
    first = min(p for p, v in zip(pairs, D) if v == best)
    assert got is not None and (got.i, got.j) == first
    assert got.value == best


def test_extreme_pairs_of_one_big_cluster_refine_little(client):
    """Half of the float32 rows within 1e-5 of one point, in chunks of their own (the
    reserved tokens of a vocabulary sit together): every pair of the cluster is in the
    float32 band, and every cluster row ties as the farthest partner of the others.  The diameter's tasks refined all of them (2.1e6 here), each task
    starting from nothing; they now start from a seed found by two sweeps over the
    blocks.  The closest pair's tasks refined all of them as well; a task past its
    budget now runs again through a float64 filter, as the engine does."""
    from refgeo import _dask, _engine

    rng = np.random.default_rng(5)
    V, d = 4096, 8
    S = rng.standard_normal((V, d)).astype(np.float32)
    S[: V // 2] = 5 + 1e-5 * rng.standard_normal((V // 2, d))
    D = da.from_array(S, chunks=(1024, d))
    for dask_fn, engine_fn, most in [(_dask.diameter, _engine.diameter, 1000), (_dask.closest, _engine.closest, 700_000)]:
        got, want = dask_fn(D), engine_fn(S)
        assert (got.value, got.i, got.j) == (want.value, want.i, want.j)
        assert got.n_refined < most
    # the farthest partners: each row refined every pair that could reach its running
    # best in each block pair (2.1e6), the Gaussian rows all of the cluster; now each
    # row starts from its distance to the rows of the seed sweeps, tile pairs that
    # cannot reach it are skipped, and a task that wastes refinements on near-copies
    # runs again through a float64 filter
    got, want = _dask.farthest(D), _engine.farthest(S)
    np.testing.assert_array_equal(got.indices, want.indices)
    np.testing.assert_array_equal(got.distances, want.distances)
    assert got.n_refined < 100_000
    with refgeo.use_backend("reference"):
        ref = refgeo.row_diameter(S), refgeo.closest_pair(S), refgeo.farthest_partners(S)
    for got, want in zip([refgeo.row_diameter(D), refgeo.closest_pair(D)], ref):
        assert (got.value, got.i, got.j) == (want.value, want.i, want.j)
    far = refgeo.farthest_partners(D)
    np.testing.assert_array_equal(far.indices, ref[2].indices)
    np.testing.assert_array_equal(far.distances, ref[2].distances)


_ENGINES = ["compiled", "numpy", "array"]


def _tie_rows(seed, V, d, dtype, kind):
    """Rows without ties, on an integer grid (many equal distances), with duplicates
    (equal rows: equal farthest values from every other row, and pairs at distance 0),
    or near-duplicates far from the origin (many pairs inside the filter's bound, with
    distinct refined values); a large common component, antipodal pairs tied to far
    below the float32 bound, rows of two scales; "tiny" rows are filtered in float64 (float32 products
    would underflow), as rows are where float32 would overflow or has no useful bound."""
    rng = np.random.default_rng(seed)
    if kind == "tiny":
        return (rng.standard_normal((V, d)) * 2.0**-40).astype(dtype)
    if kind == "common":  # a common component a million times the spread
        return (1e6 * rng.standard_normal(d) + rng.standard_normal((V, d))).astype(dtype)
    if kind == "antipodal":  # farthest partners tied to below the float32 bound
        P = rng.standard_normal(((V + 1) // 2, d))
        return (np.concatenate([P, -P])[:V] + rng.standard_normal((V, d)) * 1e-12 + 1e3).astype(dtype)
    if kind == "mixed":  # half the rows a trillion times smaller than the others
        S = rng.standard_normal((V, d))
        S[: V // 2] *= 1e-12
        return S.astype(dtype)
    if kind == "grid":
        return rng.integers(-2, 3, size=(V, d)).astype(dtype)
    if kind == "near":
        base = rng.integers(-1, 2, size=(max(1, V // 4), d)) * 1e3
        return (base[rng.integers(0, base.shape[0], size=V)] + rng.standard_normal((V, d)) * 1e-9).astype(dtype)
    S = rng.standard_normal((V, d)).astype(dtype)
    if kind == "duplicates":
        S = S[rng.integers(0, max(1, V // 3), size=V)]
    return S


@st.composite
def _tie_case(draw):
    V = draw(st.integers(2, 24))
    d = draw(st.integers(1, 9))
    dtype = draw(st.sampled_from([np.float64, np.float32]))
    kind = draw(st.sampled_from(["normal", "grid", "duplicates", "near", "common", "antipodal", "mixed"]))
    return V, d, dtype, _chunks(draw, V), kind, draw(st.integers(0, 2**16))


def _skip_without_ext(engine):
    from refgeo import _backend

    if engine == "compiled" and not _backend.available_backends()["cython"][0]:
        pytest.skip("the compiled extension is not built")


def _tie_panels(engine, case):
    """The rows of a :func:`_tie_case` and the same rows as a Dask array (skips the
    compiled engine where the extension is not built)."""
    _skip_without_ext(engine)
    V, d, dtype, chunk, kind, seed = case
    S = _tie_rows(seed, V, d, dtype, kind)
    return S, da.from_array(S, chunks=(chunk, d))


@pytest.mark.parametrize("engine", _ENGINES)
@settings(max_examples=8)
@given(case=_tie_case())
def test_farthest_partners_of_every_engine(client, engine, case):
    # the one-phase compiled and array-API tasks and the two-phase NumPy tasks against
    # the single-machine engine, bit for bit, ties included
    from refgeo import _dask

    S, D = _tie_panels(engine, case)
    got = _dask.farthest(D, engine=engine)
    want = refgeo.farthest_partners(S)
    np.testing.assert_array_equal(got.indices, want.indices)
    np.testing.assert_array_equal(got.distances, want.distances)
    assert got.indices.dtype == np.int64 and got.distances.dtype == np.float64


@pytest.mark.parametrize("engine", _ENGINES)
@settings(max_examples=8)
@given(case=_tie_case())
def test_extreme_pairs_of_every_engine(client, engine, case):
    from refgeo import _dask

    S, D = _tie_panels(engine, case)
    for maximize, fn in [(True, refgeo.row_diameter), (False, refgeo.closest_pair)]:
        want, got = fn(S), _dask._extreme(D, maximize=maximize, tile_size=None, engine=engine)
        assert (got.value, got.i, got.j) == (want.value, want.i, want.j)


@pytest.mark.parametrize("engine", _ENGINES)
def test_farthest_partners_tasks_split_and_one_row_blocks(client, engine):
    # blocks split by tile_size, one-row chunks beyond one reduction group, float64 rows
    # filtered in float32 by the compiled tasks
    from refgeo import _dask

    _skip_without_ext(engine)
    S = _tie_rows(6, 60, 3, np.float64, "duplicates")
    want = refgeo.farthest_partners(S)
    for D, tile in [(da.from_array(S, chunks=(60, 3)), 7), (da.from_array(S[:18], chunks=(1, 3)), None)]:
        got = _dask.farthest(D, tile_size=tile, engine=engine)
        ref = want if D.shape[0] == 60 else refgeo.farthest_partners(S[:18])
        np.testing.assert_array_equal(got.indices, ref.indices)
        np.testing.assert_array_equal(got.distances, ref.distances)


def test_small_row_chunks_are_warned_about(monkeypatch):
    # 60 one-row chunks make 1,830 block-pair tasks where one 2048-row block does: above
    # a threshold (here lowered from 10,000 to 1,000, which 150 chunks passed in 21 s) a
    # PerformanceWarning at the user's call, with the rechunk that cures it, and the same
    # result; an explicit tile_size of one row (the user's choice) is not warned
    import warnings

    import dask
    from dask.array.core import PerformanceWarning

    from refgeo import _dask

    monkeypatch.setattr(_dask, "SMALL_BLOCK_TASKS", 1000)
    S = _rows(3, 60, 2, np.float64, ties=False)
    want = refgeo.row_diameter(S)
    with dask.config.set(scheduler="sync"):
        with pytest.warns(PerformanceWarning) as record:
            got = refgeo.row_diameter(da.from_array(S, chunks=(1, 2)))
        _same_pair(want, got)
        (w,) = record
        assert str(w.message) == (
            "the row chunks of S (at most 1 rows each) make 1,830 block-pair tasks; chunks of 2048 rows "
            "would make 1. Rechunk the rows before the call, e.g. S.rechunk({0: 2048, 1: -1}) (the result "
            "does not depend on the chunks).")
        assert w.filename == __file__
        with warnings.catch_warnings():
            warnings.simplefilter("error", PerformanceWarning)
            _same_pair(want, refgeo.row_diameter(da.from_array(S, chunks=(60, 2)), tile_size=1))
            # at the threshold or below it: 44 chunks, 990 tasks
            _same_pair(refgeo.row_diameter(S[:44]), refgeo.row_diameter(da.from_array(S[:44], chunks=(1, 2))))


def test_small_row_chunks_of_x_or_y_are_named(monkeypatch):
    # k-NN of X against Y: the warning names the matrix whose row chunks are small, and
    # their size, not the largest chunk of both; none where only a merge of chunks that
    # are already whole blocks would help (fewer tasks than the threshold, here 30)
    import warnings

    import dask
    from dask.array.core import PerformanceWarning

    from refgeo import _dask

    monkeypatch.setattr(_dask, "SMALL_BLOCK_TASKS", 30)
    X = _rows(4, 120, 2, np.float64, ties=False)
    Y = _rows(5, 150, 2, np.float64, ties=False)
    rechunk = "{0: 8192, 1: -1}"
    with dask.config.set(scheduler="sync"):
        # (rows of X, chunks of X, chunks of Y): the matrices named and their largest chunk
        for (nx, xc, yc), (name, size) in [((10, 10, 1), ("Y", 1)), ((120, 3, 150), ("X", 3)),
                                           ((40, 1, 5), ("X and Y", 5))]:
            with pytest.warns(PerformanceWarning) as record:
                got = refgeo.knn(da.from_array(X[:nx], chunks=(xc, 2)), 2, da.from_array(Y, chunks=(yc, 2)))
            _same_rows(refgeo.knn(X[:nx], 2, Y), got)
            (w,) = record
            text = str(w.message)
            assert text.startswith(f"the row chunks of {name} (at most {size} rows each) make "), text
            want = (f"{name}.rechunk({rechunk})" if name != "X and Y"
                    else f"X.rechunk({rechunk}) and Y.rechunk({rechunk})")
            assert f"e.g. {want} (the result" in text, text
        with warnings.catch_warnings():
            warnings.simplefilter("error", PerformanceWarning)
            # 5 one-row chunks of X against one chunk of Y: 5 tasks
            refgeo.knn(da.from_array(X[:5], chunks=(1, 2)), 2, da.from_array(Y, chunks=(150, 2)))


def test_pair_engine_dispatch():
    from refgeo import _backend, _dask

    D = da.from_array(np.zeros((4, 2)), chunks=2)
    assert _dask._pair_engine(None, D) == ("compiled" if _backend.extension() is not None else "numpy")
    assert _dask._pair_engine("array", D) == "array"
    with pytest.raises(ValueError, match="engine must be"):
        _dask._pair_engine("gpu", D)


def _brute_farthest(A, B, same):
    """Each row's farthest partner by the canonical refined value (ties: smallest index)."""
    from refgeo._certify import canonical_sq

    A64, B64 = A.astype(np.float64), B.astype(np.float64)
    D = canonical_sq(np, A64[:, None, :], B64[None, :, :])
    if same:
        np.fill_diagonal(D, -np.inf)
    return D.max(axis=1), D.argmax(axis=1), D.max(axis=0), D.argmax(axis=0)


_KINDS = ["normal", "grid", "duplicates", "near", "tiny", "common", "antipodal", "mixed"]


@pytest.mark.parametrize("kind", _KINDS)
@pytest.mark.parametrize("task", ["compiled", "array"])
@settings(max_examples=25, deadline=None)
@given(na=st.integers(1, 60), nb=st.integers(0, 60), d=st.integers(1, 6), tile=st.sampled_from([1, 4, 256]),
       dtype=st.sampled_from(["float32", "float64"]), low=st.sampled_from([None, "exact", "half", "above"]),
       tight=st.booleans())
@example(na=2, nb=0, d=1, tile=1, dtype="float32", low=None, tight=False)  # two rows: one pair refined serves both
def test_farthest_task_is_the_exact_farthest(task, kind, na, nb, d, tile, dtype, low, tight):
    # one block-pair task (the compiled kernel block_pair_farthest, with tiles of 1, 4
    # or 256 rows, or the array-API task) against brute force over the canonical
    # refined values, with the tie rule, for both blocks' rows.  The compiled task with
    # lower bounds on the rows' farthest values (the value itself, which the pairs that
    # tie it must still reach; half of it; or, for every third row, above it: that row's
    # partner lies in another block and it may report none here), and with a give-up
    # rule so tight that every float32 filter runs again in float64
    from refgeo import _dask, _engine

    _skip_without_ext(task)
    seed = na * 1009 + nb * 31 + d
    SA = _tie_rows(seed, na, d, dtype, kind)
    SB = None if nb == 0 else _tie_rows(seed + 1, nb, d, dtype, kind)
    if SB is not None and kind == "duplicates":
        SB[: min(na, nb) // 2] = SA[: min(na, nb) // 2]  # equal rows across the blocks
    mu = np.concatenate([SA] if SB is None else [SA, SB]).astype(np.float64).mean(axis=0)
    if SB is None and na < 2:
        low = None
    if low is not None or (SB is not None or na >= 2):
        va, ja, vb, jb = _brute_farthest(SA, SA if SB is None else SB, SB is None)
    lows, above_a, above_b = (), np.zeros(na, bool), np.zeros(max(nb, 0), bool)
    if task == "compiled" and low is not None:
        def bound(v, above):
            out = v * (0.5 if low == "half" else 1.0)
            if low == "above":
                out = np.where(above, 2.0 * v + 1.0, v)
            return out
        above_a[::3] = low == "above"
        above_b[1::3] = low == "above"
        lows = (bound(va, above_a),) if SB is None else (bound(va, above_a), bound(vb, above_b))
    fn = _dask._farthest_task_compiled if task == "compiled" else _dask._farthest_task_xp
    consts = ("_TASK_TILE",)
    engine_consts = ("FARTHEST_MIN_CAP", "FARTHEST_CAP_SHARE", "FARTHEST_BUDGET_DIVISOR",
                     "FARTHEST_MIN_HEAVY_ROWS", "FARTHEST_HEAVY_SHARE")
    old = [getattr(_dask, c) for c in consts], [getattr(_engine, c) for c in engine_consts]
    try:
        _dask._TASK_TILE = tile
        if tight:
            for c, v in zip(engine_consts, (1, 1 << 40, 1 << 40, 0, 1 << 40)):
                setattr(_engine, c, v)
        rec_a, rec_b = fn(SA, SB, 5, 100, mu, *lows)
    finally:
        for c, v in zip(consts, old[0]):
            setattr(_dask, c, v)
        for c, v in zip(engine_consts, old[1]):
            setattr(_engine, c, v)
    if SB is None and na < 2:
        assert rec_a is None and rec_b is None
        return

    def check(rec, v, j, off, above):
        keep = ~above
        np.testing.assert_array_equal(rec.values[keep], v[keep])
        np.testing.assert_array_equal(rec.index[keep], j[keep] + off)
        # a row whose bound lies above its farthest value here: no partner, or a real one
        none = rec.index[above] == _dask._NO_INDEX
        assert np.all(rec.values[above][none] == -np.inf)
        assert np.all(rec.values[above][~none] <= v[above][~none])

    check(rec_a, va, ja, 100, above_a)
    if SB is None:
        assert rec_b is None
    else:
        check(rec_b, vb, jb, 5, above_b)
    # every row's value is a refined pair; in one block a pair serves both its rows
    # (the array-API task refines a self pair for each of its rows)
    least = (na if task == "array" else -(-na // 2)) if SB is None else max(na, nb)
    if not lows:
        assert rec_a.n_refined >= least
    assert np.isfinite(rec_a.bound)


@pytest.mark.parametrize("kind", _KINDS)
@pytest.mark.parametrize("maximize", [True, False], ids=["max", "min"])
@settings(max_examples=20, deadline=None)
@given(na=st.integers(1, 40), nb=st.integers(0, 40), d=st.integers(1, 6), dtype=st.sampled_from(["float32", "float64"]))
def test_array_pair_task_is_the_exact_extreme(maximize, kind, na, nb, d, dtype):
    # the array-API extreme-pair task against brute force over the canonical refined
    # values, with the tie rule of the smallest (i, j)
    from refgeo import _dask
    from refgeo._certify import canonical_sq

    seed = na * 1013 + nb * 37 + d
    SA = _tie_rows(seed, na, d, dtype, kind)
    SB = None if nb == 0 else _tie_rows(seed + 1, nb, d, dtype, kind)
    got = _dask._pair_task_xp(SA, SB, 3, 50, None, maximize)
    B = SA if SB is None else SB
    D = canonical_sq(np, SA.astype(np.float64)[:, None, :], B.astype(np.float64)[None, :, :])
    pairs = [(i, j) for i in range(na) for j in range(B.shape[0]) if SB is not None or i < j]
    if not pairs:
        assert got is None
        return
    best = max(D[p] for p in pairs) if maximize else min(D[p] for p in pairs)
    i, j = min(p for p in pairs if D[p] == best)
    assert (got.value, got.i, got.j) == (best, i + 3, j + 50)


def _cupy_or_skip():
    cp = pytest.importorskip("cupy")
    try:
        if cp.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except cp.cuda.runtime.CUDARuntimeError as exc:
        pytest.skip(f"no CUDA device: {exc}")
    return cp


@pytest.mark.gpu
def test_cupy_chunks_run_the_array_tasks_on_the_gpu(client):
    # real CuPy chunks: the default engine is the array-API one, and the answers are the
    # single-machine engine's on the same rows as a NumPy array
    cp = _cupy_or_skip()
    from refgeo import _dask

    for dtype, kind, chunk in [(np.float64, "normal", 70), (np.float32, "grid", 33), (np.float32, "duplicates", 200)]:
        S = _tie_rows(7, 200, 16, dtype, kind)
        D = da.from_array(S, chunks=(chunk, 16)).map_blocks(cp.asarray, dtype=S.dtype)
        assert _dask._chunks_on_gpu(D) and _dask._pair_engine(None, D) == "array"
        for maximize, fn in [(True, refgeo.row_diameter), (False, refgeo.closest_pair)]:
            want, got = fn(S), _dask._extreme(D, maximize=maximize, tile_size=None)
            assert (got.value, got.i, got.j) == (want.value, want.i, want.j)
        got, want = _dask.farthest(D), refgeo.farthest_partners(S)
        np.testing.assert_array_equal(got.indices, want.indices)
        np.testing.assert_array_equal(got.distances, want.distances)
        got, want = _dask.knn(D, 5, None, exclude_self=True), refgeo.knn(S, 5)
        np.testing.assert_array_equal(got.indices, want.indices)
        np.testing.assert_array_equal(got.distances, want.distances)


def test_float16_and_long_double_chunks_run_as_float64(client):
    # NumPy inputs of these dtypes are converted to float64 (float16 exactly); Dask
    # chunks must give the same answers, bit for bit (the k-NN refinement of long
    # double chunks must not fall back to float32)
    S = _rows(9, 30, 5, np.float64, ties=False)
    for dtype in (np.float16, np.longdouble):
        W = S.astype(dtype)
        D = da.from_array(W, chunks=(7, 5))
        _same_pair(refgeo.row_diameter(W), refgeo.row_diameter(D))
        _same_pair(refgeo.closest_pair(W), refgeo.closest_pair(D))
        _same_rows(refgeo.farthest_partners(W), refgeo.farthest_partners(D))
        _same_rows(refgeo.knn(W, 4), refgeo.knn(D, 4))
        _same_rows(refgeo.knn(W, 3, W[:11]), refgeo.knn(D, 3, D[:11]))


@pytest.mark.skipif(np.finfo(np.longdouble).max <= np.finfo(np.float64).max,
                    reason="long double is float64 here")
def test_long_double_beyond_the_float64_range_names_the_argument(client):
    # as for a NumPy input: a ValueError naming the argument and the largest entry,
    # before any task runs (no overflow warnings, no error about GEMM norms)
    import warnings

    W = np.longdouble("1e400") * np.arange(1, 4, dtype=np.longdouble)[:, None] * np.ones((3, 2), dtype=np.longdouble)
    msg = r"{} must have entries within the float64 range \(\|x\| <= 1.798e\+308\), got 6 entries beyond it \(largest 3e\+400\) instead."
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for fn in (refgeo.row_diameter, refgeo.closest_pair, refgeo.farthest_partners, refgeo.distance_ratio):
            with pytest.raises(ValueError, match=msg.format("S")):
                fn(da.from_array(W, chunks=2))
        with pytest.raises(ValueError, match=msg.format("X")):
            refgeo.knn(da.from_array(W, chunks=2), 1)
        with pytest.raises(ValueError, match=msg.format("Y")):
            refgeo.knn(da.from_array(np.ones((2, 2)), chunks=1), 1, da.from_array(W, chunks=2))


# --------------------------------------------------------------------------- identical rows


def test_identical_rows_are_not_refined_pair_by_pair(client):
    """2,000 zero rows among 3,000 (untrained embedding rows) in Dask chunks: every pair
    of them lay within the filter's bound, so ``closest_pair`` refined all 2e6 (2e8
    pairs and 3.9 s at 20,000 among 30,000); two clusters of identical rows did the same
    to ``row_diameter``.  The kernels now run on the rows that decide the pair
    (:func:`refgeo._dask.duplicate_rows`), with the answer of all rows."""
    rng = np.random.default_rng(0)
    S = rng.standard_normal((3000, 16))
    S[np.sort(rng.choice(3000, 2000, replace=False))] = 0.0
    D = da.from_array(S, chunks=(700, 8))  # column chunks too: a hash takes whole rows
    m = refgeo.closest_pair(D)
    _same_pair(refgeo.closest_pair(S), m)
    assert m.value == 0.0 and m.n_refined <= 1
    two = np.repeat(rng.standard_normal((2, 16)), 1500, axis=0)[rng.permutation(3000)]
    r = refgeo.row_diameter(da.from_array(two, chunks=(500, 16)))
    _same_pair(refgeo.row_diameter(two), r)
    assert r.n_refined <= 1
    assert refgeo.distance_ratio(D) == refgeo.distance_ratio(S) == 0.0


@settings(max_examples=25, deadline=None)
@given(S=clouds_with_copies(), data=st.data())
def test_identical_rows_in_any_chunking_give_the_pair_of_every_row(client, S, data):
    """Copies of a few rows, ``-0.0`` beside ``0.0``, rows too close to tell apart in
    float64 (they must run as they are) and every prescaling, in random row and column
    chunks: the value, the pair and the prescaling of the NumPy rows."""
    V, d = S.shape
    D = da.from_array(S, chunks=(data.draw(st.integers(1, V)), data.draw(st.integers(1, d))))
    for fn in (refgeo.row_diameter, refgeo.closest_pair):
        want, got = fn(S), fn(D)
        _same_pair(want, got)
        assert got.scale_exponent == want.scale_exponent


@settings(max_examples=6, deadline=None)
@given(S=clouds_with_copies(), data=st.data())
def test_knn_of_copies_in_any_chunking_is_the_one_of_numpy_rows(client, S, data):
    """knn on one row of each class of copies, expanded to every row: the answer of the
    NumPy rows (itself checked against the oracle on all rows), with and without the row
    itself, and against Y with copies on both sides, in random row and column chunks;
    the farthest partners too."""
    from refgeo import rows

    V, d = S.shape
    D = da.from_array(S, chunks=(data.draw(st.integers(1, V)), data.draw(st.integers(1, d))))
    exclude_self = data.draw(st.booleans())
    k = data.draw(st.integers(1, V - int(exclude_self)))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rows, "_copies_worth_removing", lambda dup, *a: dup)  # however few
        mp.setattr(rows, "KNN_COPIES_MIN_OTHER", 1)
        _same_rows(refgeo.knn(S, k, exclude_self=exclude_self), refgeo.knn(D, k, exclude_self=exclude_self))
        _same_rows(refgeo.farthest_partners(S), refgeo.farthest_partners(D))
        Y = S[::-1][: data.draw(st.integers(1, V))]
        k = data.draw(st.integers(1, len(Y)))
        _same_rows(refgeo.knn(S, k, Y), refgeo.knn(D, k, da.from_array(Y, chunks=(data.draw(st.integers(1, len(Y))), d))))


def test_knn_of_many_copies_runs_on_the_distinct_rows(client):
    """8,000 zero rows among 16,000 in Dask chunks: every zero row tied with 7,999 others
    at its k-th distance and was refined against whole blocks (2.5e8 refined pairs, 71 s
    on 2 threads against 0.19 s for the other 8,000 rows alone); the kernel now runs on
    the 8,001 distinct rows."""
    rng = np.random.default_rng(0)
    S = rng.standard_normal((16000, 64))
    S[::2] = 0.0
    r = refgeo.knn(da.from_array(S, chunks=(4000, 64)), 4)
    assert r.n_refined <= 100 * 8001
    assert r.indices[0].tolist() == [2, 4, 6, 8] and r.indices[2].tolist() == [0, 4, 6, 8]
    odd = np.r_[1:80:2, 16000 - 79 : 16000 : 2]  # distinct rows: themselves first among S, at 0
    want = refgeo.knn(S[odd], 5, S)
    np.testing.assert_array_equal(r.indices[odd], want.indices[:, 1:])
    np.testing.assert_array_equal(r.distances[odd], want.distances[:, 1:])
    # the distinct rows of a grid, many ties at the 32nd distance: a row its heap could
    # not certify was refined against the whole block (7.4e6 pairs in one chunk; 2.2e6
    # for the rows as they were), and is now filtered again against it (1.9e5)
    G = np.random.default_rng(0).integers(0, 4, (30000, 6)).astype(np.float64)
    r = refgeo.knn(da.from_array(G, chunks=(5000, 6)), 32)
    assert r.n_refined < 250_000
    _same_rows(refgeo.knn(G, 32), r)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_knn_of_near_copies_refines_only_the_pairs_that_can_reach_the_kth(client, monkeypatch, dtype):
    """Clusters of 40 near-copies within the filter's bound of each other (1e-6 apart in
    float32, 1e-9 in float64): every row ties with its 39 copies, beyond its heap, and
    was refined against every row of the block (3,998,000 refined pairs for 2,000
    float32 rows, all of them).  Such a row is filtered again against the block, and
    only the pairs that can reach its k-th distance are refined (its 39 copies at most,
    and the task refines the k + 1 the engine returns once more); the heaps of its other
    block pairs are not seeded with a key inside its cluster (each row went to that
    refinement in every block pair: 11,440 rows here)."""
    import dask

    from refgeo import _dask

    rng = np.random.default_rng(3)
    noise = 1e-6 if dtype == np.float32 else 1e-9
    S = (np.repeat(rng.standard_normal((50, 16)), 40, axis=0)
         + noise * rng.standard_normal((2000, 16))).astype(dtype)
    Y = S[::-1].copy()
    rows = []
    real = _dask._whole_block_pairs
    monkeypatch.setattr(_dask, "_whole_block_pairs",
                        lambda P, Q, r, *a, **kw: rows.append(r.size) or real(P, Q, r, *a, **kw))
    monkeypatch.setattr(_dask, "_WHOLE_STRIP_ELEMENTS", 1500)  # the array-API tasks' strips: 3 rows
    with dask.config.set(scheduler="synchronous"):  # the tasks run here, where rows counts
        got = refgeo.knn(da.from_array(S, chunks=(500, 16)), 8)
        got_y = refgeo.knn(da.from_array(S, chunks=(500, 16)), 8, da.from_array(Y, chunks=(700, 16)))
        # the array-API tasks (CuPy chunks on a GPU; NumPy chunks here) filter such a
        # row again on the device
        arr = _dask.knn(da.from_array(S, chunks=(500, 16)), 8, None, exclude_self=True, engine="array")
    assert got.n_refined <= (40 + 9) * len(S) and got_y.n_refined <= (41 + 9) * len(S)
    assert 0 < sum(rows) <= 2 * 1.25 * len(S)  # about once per row and call, not once per block pair
    assert arr.n_refined <= 40 * len(S)
    np.testing.assert_array_equal(arr.indices, got.indices)
    np.testing.assert_array_equal(arr.distances, got.distances)
    _same_rows(refgeo.knn(S, 8), got)
    _same_rows(refgeo.knn(S, 8, Y), got_y)
    # the same on the cluster's workers
    _same_rows(got, refgeo.knn(da.from_array(S, chunks=(500, 16)), 8))


@pytest.mark.parametrize("k", [1, 5])
def test_knn_of_hidden_states_sends_the_heaps_overflow_to_the_engine_with_thresholds(monkeypatch, k):
    """Hidden states with Zipf token counts (a common component, a token's embedding, a
    1e-4 context term): the rows of a frequent token are near-copies that overflow their
    heaps.  A task hands them to the single-machine engine with its thresholds, which
    skips its first pass (before, those rows were filtered against the whole block in
    strips, and the many with too many pairs within reach passed the engine's first
    pass as well), and the answer is the engine's."""
    import dask

    from refgeo import _dask, _engine

    rng = np.random.default_rng(11)
    V, d, vocab = 1600, 16, 400
    p = 1.0 / np.arange(1, vocab + 1) ** 1.1
    tokens = rng.choice(vocab, size=V, p=p / p.sum())
    S = (3.0 * rng.standard_normal(d) + rng.standard_normal((vocab, d))[tokens]
         + 1e-4 * rng.standard_normal((V, d))).astype(np.float32)
    Y = S[rng.permutation(V)[:700]] + np.float32(1e-5)
    whole, engine_rows = [], []
    real_whole, real_knn = _dask._whole_block_pairs, _engine.knn

    def knn(X, *a, thresholds=None, **kw):
        assert thresholds is not None and thresholds.shape == (len(X),)
        engine_rows.append(len(X))
        return real_knn(X, *a, thresholds=thresholds, **kw)

    monkeypatch.setattr(_dask, "_whole_block_pairs",
                        lambda P, Q, r, *a, **kw: whole.append(r.size) or real_whole(P, Q, r, *a, **kw))
    monkeypatch.setattr(_engine, "knn", knn)
    with dask.config.set(scheduler="synchronous"):  # the tasks run here, where the patches hold
        got = refgeo.knn(da.from_array(S, chunks=(400, d)), k)
        got_y = refgeo.knn(da.from_array(S, chunks=(400, d)), k, da.from_array(Y, chunks=(300, d)))
    monkeypatch.undo()
    _same_rows(refgeo.knn(S, k), got)
    _same_rows(refgeo.knn(S, k, Y), got_y)
    assert sum(whole) > V / 4 and sum(engine_rows) == sum(whole)


@pytest.mark.parametrize("k", [1, 5])
def test_knn_of_one_big_cluster_asks_the_engine_for_the_block_best(client, k):
    """Half of the float32 rows within 1e-5 of one point (the shape of the rare-token
    rows of an LM head): within a block of the cluster every pair ties in float32, and
    the row's threshold, set by the float32 keys of every block, reaches all of them.
    Each such row refined every pair of the cluster in each block (all 10^8 of 20,000
    rows: 60 s against 2 s on one machine).  A row with more than max(k, b / 16) pairs
    within reach now takes the block's k best from the engine's float64 filter."""
    from refgeo import _dask, _engine

    rng = np.random.default_rng(7)
    V, d = 1200, 16
    S = rng.standard_normal((V, d)).astype(np.float32)
    cl = rng.permutation(V)[: V // 2]  # scattered over every block
    S[cl] = 5 + 1e-5 * rng.standard_normal((cl.size, d))
    S[cl[1]] = S[cl[0]]  # an exact pair inside the cluster: a tie at distance 0
    Y = S[rng.permutation(V)[:500]] + np.float32(1e-6)
    got = _dask.knn(da.from_array(S, chunks=(300, d)), k, None, exclude_self=True)
    want = _engine.knn(S, k, None, exclude_self=True)
    np.testing.assert_array_equal(got.indices, want.indices)
    np.testing.assert_array_equal(got.distances, want.distances)
    # every cluster row with each cluster row of its blocks: 150,000 pairs before
    assert got.n_refined < 40 * V
    got_y = _dask.knn(da.from_array(S, chunks=(300, d)), k, da.from_array(Y, chunks=(200, d)), exclude_self=False)
    want_y = _engine.knn(S, k, Y, exclude_self=False)
    np.testing.assert_array_equal(got_y.indices, want_y.indices)
    np.testing.assert_array_equal(got_y.distances, want_y.distances)
    assert got_y.n_refined < 40 * V
    # the public function on the reference backend agrees (it removes the exact copy
    # first and puts it back)
    with refgeo.use_backend("reference"):
        ref = refgeo.knn(S, k)
    _same_rows(ref, refgeo.knn(da.from_array(S, chunks=(300, d)), k))


def test_knn_takes_the_prescaling_from_the_duplicate_search(client, monkeypatch):
    """The search for identical rows passes over every chunk and finds the prescaling
    on its way; knn of float64 rows (read from disk for a file) passed over them again
    for it.  The answer, and its scale_exponent, are those of the NumPy rows."""
    from refgeo import rows

    seen = []
    orig = rows.scale_exponent
    monkeypatch.setattr(rows, "scale_exponent", lambda xp, arrays: seen.append(arrays) or orig(xp, arrays))
    rng = np.random.default_rng(2)
    S = np.repeat(rng.standard_normal((40, 5)), 3, axis=0) * 2.0**300
    for copies in (S, S[::3]):  # with and without identical rows
        got = refgeo.knn(da.from_array(copies, chunks=(25, 5)), 4)
        assert not any(isinstance(a, da.Array) for arrays in seen for a in arrays)
        want = refgeo.knn(copies, 4)
        assert got.scale_exponent == want.scale_exponent > 0
        _same_rows(want, got)


def test_duplicate_search_is_the_one_of_numpy_rows(client, monkeypatch):
    """The classes from the chunks' hashes equal those of the NumPy rows, also when
    every row hashes alike (collisions are told apart by comparing the fetched rows);
    beyond the fetch budget, or for rows that are not separated, the rows run as
    they are, with the same answer."""
    import dask

    from refgeo import _dask, _duplicates

    from refgeo._certify import scale_exponent

    rng = np.random.default_rng(5)
    S = rng.integers(-1, 2, size=(300, 3)).astype(np.float64) * 2.0**-90  # prescaled
    D = da.from_array(S, chunks=(70, 3))
    want = _duplicates.duplicate_rows(S)
    got, e = _dask.duplicate_rows(D)
    assert (got.first.tolist(), got.pair) == (want.first.tolist(), want.pair)
    assert e == scale_exponent(np, [S]) == -89  # the pass that finds the exponent alone
    with dask.config.set(scheduler="synchronous"), monkeypatch.context() as mp:  # tasks run here
        mp.setattr(_duplicates, "row_hashes", lambda A: np.zeros(len(A), dtype=np.uint64))
        got, _ = _dask.duplicate_rows(D)
    assert (got.first.tolist(), got.pair) == (want.first.tolist(), want.pair)
    # the budget counts one row per group of equal hashes (and the rows of groups
    # that hold several classes), not every copy: 2,000 zero rows fetch one
    Z = _rows(16, 3000, 64, np.float64, ties=False)
    Z[::3] = 0.0
    monkeypatch.setattr(_dask, "_DUPLICATE_FETCH_BYTES", 10 * 64 * 8)
    got, _ = _dask.duplicate_rows(da.from_array(Z, chunks=(500, 64)))
    assert got.pair == (0, 3) and got.first.size == 2001
    monkeypatch.setattr(_dask, "_DUPLICATE_FETCH_BYTES", 0)
    assert _dask.duplicate_rows(D) == (None, -89)
    _same_pair(refgeo.closest_pair(S), refgeo.closest_pair(D))
    T = np.array([[1.0], [1e-170], [1e-170], [0.0]])  # not separated: distinct rows tie at 0
    assert _dask.duplicate_rows(da.from_array(T, chunks=(2, 1)))[0] is None
    assert _dask.duplicate_rows(da.from_array(np.eye(4, dtype=np.float32), chunks=(2, 4))) == (None, 0)


@pytest.mark.parametrize("chunks", [((4, 0, 6), 3), ((0, 10), 3), ((3, 0, 0, 7), (1, 0, 2))],
                         ids=["middle", "first", "rows-and-columns"])
def test_empty_chunks(client, chunks):
    """Empty chunks (a boolean mask leaves them): ``block_rows`` divided by zero in
    every engine, and Dask's own max (the prescaling) failed to concatenate."""
    X = _rows(14, 10, 3, np.float64, ties=False)
    D = da.from_array(X, chunks=chunks)
    for fn in (refgeo.row_diameter, refgeo.closest_pair):
        _same_pair(fn(X), fn(D))
    assert refgeo.distance_ratio(D) == refgeo.distance_ratio(X)
    _same_rows(refgeo.knn(X, 3), refgeo.knn(D, 3))
    _same_rows(refgeo.farthest_partners(X), refgeo.farthest_partners(D))
    _same_rows(refgeo.knn(X, 2, X[:4]), refgeo.knn(D, 2, da.from_array(X[:4], chunks=((0, 4), 3))))
    mask = np.arange(10) % 3 != 1
    M = D[da.from_array(mask, chunks=4)]
    M.compute_chunk_sizes()
    _same_pair(refgeo.row_diameter(X[mask]), refgeo.row_diameter(M))


@pytest.mark.parametrize("dtype", [np.int64, np.uint64, np.int32, np.bool_])
def test_integer_rows_with_empty_chunks(client, dtype):
    """Integer rows with an empty chunk (``x[mask]`` after ``compute_chunk_sizes``): the
    exact-integer check's min and max (Dask reductions) ran before the empty chunks were
    dropped and failed to concatenate, for 64-bit integers; float rows got through."""
    X = np.random.default_rng(2).integers(0 if dtype is np.uint64 else -5, 5, (30, 4)).astype(dtype)
    mask = np.r_[np.ones(10, bool), np.zeros(10, bool), np.ones(10, bool)]
    M = da.from_array(X, chunks=(10, 4))[da.from_array(mask, chunks=10)]
    M.compute_chunk_sizes()
    assert 0 in M.chunks[0]
    want = X[mask]
    _same_pair(refgeo.row_diameter(want), refgeo.row_diameter(M))
    _same_pair(refgeo.closest_pair(want), refgeo.closest_pair(M))
    _same_rows(refgeo.knn(want, 2), refgeo.knn(M, 2))
    got, ref = refgeo.covering_radius(M), refgeo.covering_radius(want)
    assert got.radius == ref.radius
    np.testing.assert_array_equal(np.asarray(got.center), ref.center)


def test_graphs_of_one_input_agree_on_every_chunk_key(client):
    """Every graph that the calls submit gives each chunk key of the input the same
    task.  A call submits several (the finiteness check, the duplicate-row hashes and
    comparisons, the pairwise tasks on the rows that decide), and with Dask's low-level
    fusion on, each fused the input's tasks by its own use of them: the scheduler then
    warned "Detected different `run_spec`" (docs/cluster.md) in about one call in
    seven on masked, rechunked rows with duplicates."""
    rng = np.random.default_rng(21)
    X = rng.standard_normal((900, 12))
    X[rng.choice(900, 450, replace=False)] = X[0]
    keep = rng.random(900) > 0.1
    D = da.from_array(X, chunks=(130, 5))[da.from_array(keep, chunks=130)]
    D.compute_chunk_sizes()
    D = D.rechunk((200, 6))
    Y = X[keep]
    with graph_key_clashes(client) as (seen, clashes):
        _same_pair(refgeo.closest_pair(Y), refgeo.closest_pair(D))
        _same_pair(refgeo.row_diameter(Y), refgeo.row_diameter(D))
        assert refgeo.distance_ratio(D) == refgeo.distance_ratio(Y)
        _same_rows(refgeo.farthest_partners(Y), refgeo.farthest_partners(D))
        _same_rows(refgeo.knn(Y, 3), refgeo.knn(D, 3))
    assert len(seen) > 100  # the recording saw the graphs
    assert not clashes, sorted(map(str, clashes))[:5]


def test_fusion_setting_survives_overlapping_calls():
    """Two calls that overlap (threads) and end in the order they began leave Dask's
    fusion setting as it was; ``dask.config.set`` as a context manager restores what it
    found, so the second to end would restore the first's ``False`` for good."""
    import dask

    from refgeo._backend import dask_fusion_off

    for before in (None, True):
        with dask.config.set({"optimization.fuse.active": before}):
            a, b = dask_fusion_off(), dask_fusion_off()
            a.__enter__()
            b.__enter__()
            assert dask.config.get("optimization.fuse.active") is False
            a.__exit__(None, None, None)
            assert dask.config.get("optimization.fuse.active") is False  # b still runs
            b.__exit__(None, None, None)
            assert dask.config.get("optimization.fuse.active") is before
