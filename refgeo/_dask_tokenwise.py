"""The tokenwise fits on Dask arrays of hidden states: task graphs for
:func:`refgeo.fit_local_maps` and :func:`refgeo.decompose`.

:mod:`refgeo.tokenwise` routes ``dask.array.Array`` inputs here (after validating the
options as for NumPy input) and builds its result records from what these functions
return.  The graph:

1. Scale: the exponent ``e`` of the largest entry is a Dask max/min reduction (exact).
2. Neighbors: the rows ``X 2**-e`` (standardized with reproducible column sums, or
   normalized for the cosine metric, a token block at a time) go to :func:`refgeo.knn`,
   whose Dask engine returns the (N, k) indices and distances to the caller: the same
   as on one machine, bit for bit.
3. Fits: one task per token block (the row chunks of ``X``).  For each other block
   holding some of its tokens' neighbors a small task extracts those rows of ``X`` and
   ``Y``; the fit task appends them to its own rows, remaps the neighbor indices to
   these local rows and runs the single-machine kernel
   (:func:`refgeo._tokenwise_fit.fit_class`) on its tokens only.  The kernels read
   nothing but a token's own row and its neighbors' rows, and work token by token
   within their batches, so every fitted value, coefficient and map is the
   single-machine one, bit for bit.  The fitted values are persisted on the workers
   (the call does the work, as on one machine; the returned arrays are chunked like
   ``X``).
4. Metrics (:func:`decompose`): per-token quantities come from row-wise tasks (the
   same functions as on one machine: the same bits) and travel to the caller as (N,)
   arrays; sums over tokens of those run there with NumPy (the same bits again).  The
   d x d R factors of tau (the dominant subspace) and of the global baselines' panels
   are QR factorizations of per-block factors, tree-reduced on the workers (TSQR):
   they, and what depends on them (subspace, singular values, projections, baselines),
   agree with the single-machine values to rounding (a factorization's rounding
   depends on how the rows are grouped).

Memory per task: a token block of ``b`` rows, the rows of its neighbors (at most
``b k``, at most N) and the kernel's panels of ``chunk`` tokens; per-token records are
``O(b)``, R factors ``O(d^2)``.  Nothing of size N x N or N x d reaches the caller
besides the (N, k) neighbors, weights and distances and the (N,) metrics.  Dask itself
is imported only here, when a Dask array arrives.
"""

from __future__ import annotations

import math
import sys

import numpy as np

from . import _memory
from . import _tokenwise_fit as _fit
from ._interop import to_host
from ._threads import blas_single_thread

__all__ = [
    "check_fit_memory", "check_known_chunks", "fit", "fit_bytes", "max_abs", "max_abs_each",
    "metrics", "metrics_bytes", "panels", "parts", "parts_max_abs", "search_neighbors", "unscaled", "update_max",
    "worker_identities",
]


def _da():
    import dask.array as da

    return da


def _rows(A, ex):
    """``A * 2**-ex`` (a scaled copy, or ``A`` itself when ``ex == 0``)."""
    return A if ex == 0 else np.ldexp(A, -ex)


def _one_blas_thread(fn):
    """``fn`` with BLAS on one thread: Dask runs the tasks of a worker in parallel."""
    import functools

    @functools.wraps(fn)
    def run(*args):
        with blas_single_thread():
            return fn(*args)

    return run


def _merge_tree(parts, merge, fan_in=8):
    """``merge`` of a list of delayed values, ``fan_in`` at a time, on the workers
    (``merge(list)`` must be associative: sums, stacked R factors)."""
    import dask

    task = dask.delayed(merge, pure=True)
    while len(parts) > 1:
        parts = [task(parts[s : s + fan_in]) for s in range(0, len(parts), fan_in)]
    return parts[0]


def _sum_tree(parts, fan_in=8):
    """The sum of a list of delayed arrays, ``fan_in`` at a time, on the workers."""
    return _merge_tree(parts, lambda xs: sum(xs[1:], xs[0]), fan_in)


# --------------------------------------------------------------------- panels


def panels(X, Y):
    """``(X, Y)`` as Dask arrays with whole rows per chunk and the same row chunks.

    A NumPy (or host) ``Y`` next to a Dask ``X`` (or the other way round) is wrapped
    with the other's row chunks.  Unknown chunk sizes are refused.
    """
    from ._dask import _engine_rows

    da = _da()
    if not isinstance(X, da.Array):
        X = da.from_array(np.asarray(X), chunks=(Y.chunks[0], -1))
    if not isinstance(Y, da.Array):
        Y = da.from_array(np.asarray(Y), chunks=(X.chunks[0], -1))
    check_known_chunks(X, "X")
    check_known_chunks(Y, "Y")
    # float16 and long double chunks as float64, as a NumPy input is converted: the
    # neighbor search's exact scaling by 2**-e ran in float16, where entries 2**14
    # below the largest became subnormal (other neighbors than the NumPy path's)
    X, Y = _engine_rows(X, "X"), _engine_rows(Y, "Y")
    rows = tuple(c for c in X.chunks[0] if c > 0)  # empty chunks hold no token block
    if len(X.chunks[1]) > 1 or rows != X.chunks[0]:
        X = X.rechunk({0: rows, 1: -1})  # a task needs whole rows
    if len(Y.chunks[1]) > 1 or Y.chunks[0] != rows:
        Y = Y.rechunk({0: rows, 1: -1})
    if not isinstance(getattr(X, "_meta", None), np.ndarray):
        X = X.map_blocks(_host, meta=np.empty((0, 0), dtype=X.dtype))
    if not isinstance(getattr(Y, "_meta", None), np.ndarray):
        Y = Y.map_blocks(_host, meta=np.empty((0, 0), dtype=Y.dtype))
    return X, Y


def check_known_chunks(A, name):
    """``ValueError`` for a Dask array with chunks of unknown size (e.g. after a boolean mask)."""
    da = _da()
    if isinstance(A, da.Array) and any(math.isnan(c) for cs in A.chunks for c in cs):
        raise ValueError(
            f"{name} has unknown chunk sizes; call {name}.compute_chunk_sizes() first."
        )


def _offsets(A):
    return np.concatenate([[0], np.cumsum(A.chunks[0])]).astype(np.int64)


def max_abs_each(X, Y) -> tuple[float, float]:
    """``(max |x|, max |y|)`` of two Dask arrays, in one pass (0 for an empty one)."""
    import dask

    (hx, lx, hy, ly) = dask.compute(*(r for A in (X, Y) for r in ((A.max(), A.min()) if A.size else (0.0, 0.0))))
    return max(float(hx), -float(lx)), max(float(hy), -float(ly))


def _update_max_block(XI, YI, ex):
    XI, YI = to_host(XI).astype(np.float64), to_host(YI).astype(np.float64)
    D = _rows(YI, ex) - _rows(XI, ex)
    return np.array([max(float(D.max()), -float(D.min())) if D.size else 0.0])


def update_max(X, Y, e) -> float:
    """``max |y - x|`` of the scaled panels ``(X, Y) 2**-e`` (a Dask reduction)."""
    da = _da()
    parts = da.map_blocks(_update_max_block, X, Y, e, drop_axis=1, chunks=((1,) * X.numblocks[0],),
                          dtype=np.float64)
    return float(parts.max().compute())


def max_abs(A) -> float:
    """``max |a|`` of a Dask array (0 for an empty one)."""
    import dask

    if A.size == 0:
        return 0.0
    hi, lo = dask.compute(A.max(), A.min())
    return max(float(hi), -float(lo))


def unscaled(A, e):
    """``A 2**e`` lazily, a chunk at a time (exact: a power of two)."""
    if e == 0:
        return A
    return A.map_blocks(np.ldexp, e, dtype=A.dtype)


# ------------------------------------------------------------------ neighbors


def _binned_block(B, width):
    return _fit.binned_sums(np.asarray(B, dtype=np.float64), width)


def _binned_sq_block(B, mu, width):
    return _fit.binned_sums((np.asarray(B, dtype=np.float64) - mu) ** 2, width)


def _merge_binned_all(xs):
    """The binned sums of a list of blocks' binned sums (exact in any grouping)."""
    acc = xs[0]
    for x in xs[1:]:
        acc = _fit.merge_binned(acc, x)
    return acc


def _column_sums(Z, n, fn, *args):
    import dask

    width = _fit.bin_width(n)
    task = dask.delayed(fn, pure=True)
    parts = [task(b, *args, width) for b in Z.to_delayed()[:, 0]]
    return _fit.finish_binned(dask.compute(_merge_tree(parts, _merge_binned_all))[0])


def search_neighbors(X, e, k, metric, standardize, exclude_self):
    """Indices (N, k) and distances (N, k) (NumPy), as the single-machine search.

    The same transformations of the rows, a token block at a time: the exact scaling
    by ``2**-e``, the standardization with the reproducible column means and spreads
    of :func:`refgeo._tokenwise_fit.binned_sums` (the same bits for every chunking),
    the unit rows of the cosine metric; then the Dask k-NN engine of :func:`refgeo.knn`.
    """
    from .rows import knn

    n = X.shape[0]
    Z = X if e == 0 else X.map_blocks(np.ldexp, -e, dtype=X.dtype)
    if standardize:
        Z = Z.astype(np.float64)
        mu = _column_sums(Z, n, _binned_block) / n
        var = _column_sums(Z, n, _binned_sq_block, mu) / n
        Z = Z.map_blocks(_fit.standardized, mu, np.sqrt(var), dtype=np.float64)
    if metric == "cosine":
        Z = Z.astype(np.float64).map_blocks(_fit.unit_rows, dtype=np.float64)
    return _fit.neighbors_in_units_of_x(knn(Z, k, exclude_self=exclude_self), e, metric, standardize)


# ----------------------------------------------------------------------- fits


def _gather(XJ, YJ, rows):
    """The rows ``rows`` of one source block of X and of Y."""
    return to_host(XJ)[rows], to_host(YJ)[rows]


def _fit_block(XI, YI, gathered, nbr, w, e, cls, rank, ridge, ident, chunk, return_maps):
    """The local fits of one token block: its rows, then the gathered neighbor rows."""
    XI, YI = to_host(XI), to_host(YI)
    if gathered:
        XI = np.concatenate([XI] + [g[0] for g in gathered])
        YI = np.concatenate([YI] + [g[1] for g in gathered])
    X64, Y64, ex = _fit.panels64(XI, YI, e)
    # one BLAS thread per task: Dask runs the tasks in parallel (as the kernels run on
    # one machine, many small batched GEMMs and eigensolvers)
    with blas_single_thread():
        fitted, coef, maps = _fit.fit_class(X64, Y64, ex, nbr, w, cls, rank, ridge, ident,
                                            max(1, min(chunk, nbr.shape[0])), return_maps)
    return fitted, coef, maps


def _local_plan(idx_block, offsets, I):
    """Where the neighbors of token block ``I`` live: ``(local neighbor indices,
    [(source block J, rows of J)])``, the block's own rows first, then those gathered
    from the other blocks in increasing order of J."""
    s, t = int(offsets[I]), int(offsets[I + 1])
    u = np.unique(idx_block)
    src = np.searchsorted(offsets, u, side="right") - 1
    local = np.empty(u.shape[0], dtype=np.int64)
    own = src == I
    local[own] = u[own] - s
    nxt = t - s
    sources = []
    for J in np.unique(src[~own]):
        sel = np.flatnonzero(src == J)
        local[sel] = nxt + np.arange(sel.shape[0])
        nxt += sel.shape[0]
        sources.append((int(J), u[sel] - offsets[J]))
    return local[np.searchsorted(u, idx_block)], sources


def worker_identities(client) -> dict:
    """Every worker of a synchronous ``distributed.Client``, as the scheduler lists them now.

    ``client.scheduler_info()`` fetches them and then returns the client's cache, which
    the client's own periodic update (asking for no workers) can overwrite in between:
    under load the workers came back empty, and the memory check was skipped.  Asked
    directly, the scheduler answers with all of them (``n_workers=-1``: some releases
    list only five by default).
    """
    try:
        identity = client.sync(client.scheduler.identity, n_workers=-1)
    except TypeError:  # a release whose identity takes no n_workers lists them all
        identity = client.sync(client.scheduler.identity)
    return dict(identity.get("workers") or {})


def _room(X, n_tasks):
    """``(workers, local)``: the memory of the scheduler that runs ``X``'s graph.

    ``workers`` is ``(per_task, total, at_once)`` on a ``distributed`` cluster whose
    workers all have a memory limit (else None): a worker runs one task per thread, at
    most ``n_tasks`` at once, so the smallest limit over those tasks, the sum of the
    limits, and how many tasks that smallest worker runs at once.

    ``local`` is ``(avail, at_once, where, fewer)`` where the tasks run on this machine
    and share its memory with the caller (else None): on Dask's local schedulers (the
    synchronous one a task at a time, the others ``num_workers`` at once, by default one
    per CPU core) and on a cluster whose workers are threads of this process
    (``LocalCluster(processes=False)``: every thread of every worker at once, whatever
    their limits add up to).  ``avail`` is this process's available memory (None where
    unknown), ``where`` ends the message and ``fewer`` names the knob for ``at_once``.
    """
    import dask
    import dask.local
    import dask.multiprocessing
    import dask.system

    scheduler = dask.base.get_scheduler(collections=[X])
    client = getattr(scheduler, "__self__", None)
    distributed = sys.modules.get("distributed")  # a Client was made: it is imported
    avail = _memory.available_memory()
    if distributed is not None and isinstance(client, distributed.Client):
        info = worker_identities(client)
        limits = [(int(w.get("memory_limit") or 0), max(1, int(w.get("nthreads") or 1))) for w in info.values()]
        workers = None
        if limits and min(m for m, _ in limits) > 0:  # else a worker without a limit: nothing known
            smallest = min(limits, key=lambda mt: mt[0] // min(mt[1], n_tasks))
            at_once = min(smallest[1], n_tasks)
            workers = (smallest[0] // at_once, sum(m for m, _ in limits), at_once)
        local = None
        if info and all(str(address).startswith("inproc://") for address in info):
            threads = sum(t for _, t in limits)
            local = (avail, max(1, min(threads, n_tasks)),
                     " in this process (its in-process Dask workers run the tasks here)",
                     "the workers' threads")
        return workers, local
    if scheduler is dask.local.get_sync:
        at_once = 1
    else:
        at_once = int(dask.config.get("num_workers", None) or dask.system.CPU_COUNT or 1)
    # the processes scheduler runs the tasks in child processes, on this machine
    where = (" on this machine (the local Dask scheduler's processes run the tasks)"
             if scheduler is dask.multiprocessing.get
             else " in this process (the local Dask scheduler runs the tasks here)")
    return None, (avail, max(1, min(at_once, n_tasks)), where, "dask.config num_workers")


def fit_bytes(X, Y, k, cls, chunk, return_maps):
    """``(task, kept)``: the bytes, by part, of the largest fit task of :func:`fit` and
    of the results it persists (upper estimates, for :func:`check_fit_memory`).

    A task holds its token block of ``b`` rows and the rows of its neighbors (at most
    ``min(b k, N - b)``) as given, joined into one panel and (other dtypes) as float64,
    its neighbors and weights, the kernel's panels
    (:func:`refgeo._tokenwise_fit.panel_bytes`) and its results; the workers keep the
    fitted values, coefficients and maps of all N tokens.
    """
    n, d = X.shape
    b = max(X.chunks[0])
    g = min(b * k, n - b)
    given = X.dtype.itemsize + Y.dtype.itemsize
    as64 = X.dtype != np.float64 or Y.dtype != np.float64
    per_row = d * (given * (2 if g else 1) + (16 if as64 else 0))
    diagonal = cls in ("diagonal", "psd_diagonal")
    label, panel = _fit.panel_bytes(cls, b + g, d, k, max(1, min(chunk, b)), return_maps)
    task = {
        f"rows of X and Y of the largest token block ({b} rows) and of up to {g} neighbor rows"
        + (", joined" if g else "") + (", as float64" if as64 else ""): per_row * (b + g),
        "its neighbors and weights": 24 * b * k,
        label: panel,
        "its fitted values" + (" and coefficients" if diagonal else ""): 8 * b * d * (1 + diagonal),
    }
    kept = {"fitted values (N, d)": 8 * n * d}
    if diagonal:
        kept["coefficients (N, d)"] = 8 * n * d
    if return_maps:
        task["its maps, return_maps=True"] = 8 * b * d * d
        kept["maps (N, d, d), return_maps=True"] = 8 * n * d * d
    return task, kept


def metrics_bytes(X, Y):
    """The bytes, by part, of the largest metrics task of :func:`metrics` (an upper
    estimate): the block's rows of X and Y (as given and as float64) and of the fitted
    values, about a dozen (b, d) panels of delta, tau, rho, their projections and
    cosines, and the (d, d) R factors, baseline maps and subspace."""
    b, d = max(X.chunks[0]), X.shape[1]
    as64 = X.dtype != np.float64 or Y.dtype != np.float64
    given = (X.dtype.itemsize + Y.dtype.itemsize + (16 if as64 else 0)) * b * d
    return {
        f"rows of X, Y and the fitted values of the largest token block ({b} rows)": given + 8 * b * d,
        "the per-token panels of the metrics": 8 * 13 * b * d,
        "the (d, d) R factors and maps": 8 * 6 * d * d,
    }


def check_fit_memory(what, X, Y, k, cls, chunk, return_maps, caller, metrics=False):
    """Refuse, before any work, a fit whose largest task or whose persisted results
    (:func:`fit_bytes`), or with ``metrics`` (:func:`refgeo.decompose`) whose largest
    metrics task (:func:`metrics_bytes`), exceed the memory of the scheduler that runs
    it (:func:`_room`).

    Where the tasks run on this machine (Dask's local schedulers, or workers that are
    threads of this process), the persisted results, the tasks running at once and
    ``caller`` (the bytes that come to this process, by part) also share this
    process's memory: their sum is checked against it, after the workers' own limits.
    """
    task, kept = fit_bytes(X, Y, k, cls, chunk, return_maps)
    if metrics:
        # the metrics tasks run after the fit tasks, on the persisted fitted values
        other = metrics_bytes(X, Y)
        if sum(other.values()) > sum(task.values()):
            task = {f"{name} (a metrics task)": v for name, v in other.items()}
    b = max(X.chunks[0])
    n_tasks = sum(1 for c in X.chunks[0] if c > 0)
    c = max(1, min(chunk, b))
    smaller = (f"Rechunk X and Y into smaller row blocks (now up to {b} rows), pass a smaller k (now {k}) "
               f"or chunk_size (now {c})" + (", leave return_maps=False" if return_maps else ""))
    workers, local = _room(X, n_tasks)
    if workers is not None:
        per_task, total, at_once = workers
        tasks = "the one task" if at_once == 1 else f"the {at_once} tasks"
        _memory.check_memory(f"{what}, one task", task, f"{smaller}, or give the workers more memory per thread.",
                             room=per_task,
                             where=f" per task on the smallest Dask worker (its memory limit over {tasks} it runs at once)")
        _memory.check_memory(
            f"{what}, the results kept on the workers", kept,
            ("Leave return_maps=False, add" if return_maps else "Add") + " workers or memory to them, "
            "or pass fewer tokens per call.", room=total, where=" on the Dask workers together")
    if local is not None and local[0] is not None:
        avail, at_once, where, knob = local
        parts = dict(caller)
        parts.update(kept)
        times = f" (times {at_once}, the tasks running at once)" if at_once > 1 else ""
        parts.update({f"one task: {name}{times}": at_once * v for name, v in task.items()})
        fewer = f", run fewer tasks at once (now {at_once}: {knob})" if at_once > 1 else ""
        _memory.check_memory(what, parts, f"{smaller}{fewer}, or pass fewer tokens per call.", room=avail,
                             where=where)


def fit(X, Y, e, idx, w, cls, rank, ridge, ident, chunk, return_maps):
    """``(fitted, coefficients, maps)`` of the scaled panels ``(X, Y) 2**-e`` as Dask
    arrays chunked like X's rows, persisted on the workers (``coefficients`` and
    ``maps`` None where the class has none or they were not asked for).

    ``idx`` and ``w`` are the (N, k) NumPy neighbors and weights; ``ridge`` is the
    ridge of the scaled problem.
    """
    import dask

    da = _da()
    n, d = X.shape
    offsets = _offsets(X)
    xb, yb = X.to_delayed()[:, 0], Y.to_delayed()[:, 0]
    gather = dask.delayed(_gather, pure=True, nout=2)
    task = dask.delayed(_fit_block, pure=True, nout=3)
    diagonal = cls in ("diagonal", "psd_diagonal")
    fitted, coefs, maps = [], [], []
    for I in range(len(xb)):
        s, t = int(offsets[I]), int(offsets[I + 1])
        b = t - s
        if b == 0:
            continue
        nbr, sources = _local_plan(idx[s:t], offsets, I)
        gathered = [gather(xb[J], yb[J], rows) for J, rows in sources]
        f, c, m = task(xb[I], yb[I], gathered, nbr, w[s:t], e, cls, rank, ridge, ident, chunk, return_maps)
        fitted.append(da.from_delayed(f, shape=(b, d), dtype=np.float64))
        if diagonal:
            coefs.append(da.from_delayed(c, shape=(b, d), dtype=np.float64))
        elif cls == "scaled_orthogonal":
            coefs.append(da.from_delayed(c, shape=(b,), dtype=np.float64))
        if return_maps:
            maps.append(da.from_delayed(m, shape=(b, d, d), dtype=np.float64))
    out = [da.concatenate(fitted)]
    out.append(da.concatenate(coefs) if coefs else None)
    out.append(da.concatenate(maps) if maps else None)
    keep = [a for a in out if a is not None]
    persisted = iter(dask.persist(*keep))
    return tuple(next(persisted) if a is not None else None for a in out)


# -------------------------------------------------------------------- metrics


def _parts(XI, YI, FI, ex):
    """delta, tau and rho of one block (scaled), as the single-machine ``_metrics``."""
    xb = _rows(XI, ex)
    delta = np.subtract(_rows(YI, ex), xb)
    tau = FI - xb
    rho = delta - tau
    return xb, delta, tau, rho


def _block_panels(XI, YI, e):
    return _fit.panels64(to_host(XI), to_host(YI), e)


@_one_blas_thread
def _metrics_block(XI, YI, FI, e, gram, baselines):
    """The per-token record of one block (:func:`refgeo._tokenwise_fit.token_record`)
    and its sums: column sums of delta, tau, rho, the scaled R factor of tau (when
    ``gram``; :func:`refgeo._tokenwise_fit.scaled_r`) and the R factor of the
    baselines' panel (when ``baselines``)."""
    X64, Y64, ex = _block_panels(XI, YI, e)
    xb, delta, tau, rho = _parts(X64, Y64, FI, ex)
    rec = _fit.token_record(delta, tau, rho)
    d = xb.shape[1]
    sums = np.stack([delta.sum(axis=0), tau.sum(axis=0), rho.sum(axis=0)])
    R = _fit.scaled_r(tau) if gram else (np.zeros((0, d)), 0)
    # the R factor of [1 | x | y] (the baselines' least squares, without normal
    # equations, and the means the Procrustes baseline splits off)
    B = _fit.qr_r(_fit.baseline_panel(xb, _rows(Y64, ex))) if baselines else np.zeros((0, 1 + 2 * d))
    return rec, sums, R, B


@_one_blas_thread
def _centered_r_block(XI, YI, FI, e, m):
    X64, Y64, ex = _block_panels(XI, YI, e)
    return _fit.scaled_r(_parts(X64, Y64, FI, ex)[2] - m)


@_one_blas_thread
def _projection_block(XI, YI, FI, e, U, means, maps):
    """The norm records (:func:`refgeo._tokenwise_fit.norm_record`) of one block: of
    delta, tau and rho (centered by ``means`` when given) with their projections on
    ``U``, then of the residuals of the baselines' transposed ``maps``."""
    X64, Y64, ex = _block_panels(XI, YI, e)
    xb, delta, tau, rho = _parts(X64, Y64, FI, ex)
    out = [_fit.norm_record(v if means is None else v - means[j], U) for j, v in enumerate((delta, tau, rho))]
    yb = _rows(Y64, ex)
    for AT in maps:
        res = xb @ AT
        np.subtract(yb, res, out=res)
        out.append(_fit.norm_record(res))
    return np.concatenate(out)


def _field_block(XI, YI, FI, e, which, scale_back=True):
    X64, Y64, ex = _block_panels(XI, YI, e)
    v = _parts(X64, Y64, FI, ex)[which]
    return np.ldexp(v, e) if e and scale_back else v


def parts(X, Y, F, e):
    """Lazy ``(delta, tau, rho)`` (scaled back) from the persisted fitted values ``F``."""
    fields = []
    for which in (1, 2, 3):
        fields.append(_da().map_blocks(_field_block, X, Y, F, e, which, dtype=np.float64))
    return tuple(fields)


def parts_max_abs(X, Y, F, e):
    """``max |entry|`` of the scaled delta, tau and rho (for the range check only)."""
    da = _da()
    return [max_abs(da.map_blocks(_field_block, X, Y, F, e, which, False, dtype=np.float64))
            for which in (1, 2, 3)]


def metrics(X, Y, F, e, subspace_rank, center_subspace, baselines, ridge, identity_prior):
    """Every metric of the decomposition, from the persisted scaled fitted values ``F``.

    Returns a dict: ``record``, the (13, N) per-token record
    (:func:`refgeo._tokenwise_fit.token_record`), ``projections``, the (3, N) norm
    records of delta, tau and rho with their projections
    (:func:`refgeo._tokenwise_fit.norm_record`), ``subspace`` and ``singular_values``
    (scaled), and for the baselines their transposed ``baseline_maps`` and the (2, N)
    norm records ``baseline_residuals`` of their residuals.
    """
    import dask

    n, d = X.shape
    xb, yb, fb = X.to_delayed()[:, 0], Y.to_delayed()[:, 0], F.to_delayed()[:, 0]
    task = dask.delayed(_metrics_block, pure=True, nout=4)
    recs = [task(xb[i], yb[i], fb[i], e, not center_subspace, baselines) for i in range(len(xb))]
    sums = _sum_tree([r[1] for r in recs])
    R = _merge_tree([r[2] for r in recs], _fit.merge_scaled_r)
    B = _merge_tree([r[3] for r in recs], _fit.merge_r)
    records, sums, R, B = dask.compute([r[0] for r in recs], sums, R, B)
    record = np.concatenate(records, axis=1)
    means = None
    if center_subspace:
        # explicit subtraction of the mean, as on one machine (the shortcut
        # G - n m m^T cancels catastrophically for a large mean update)
        means = sums / n
        gtask = dask.delayed(_centered_r_block, pure=True)
        m_ = dask.delayed(means[1], pure=True)
        R = dask.compute(_merge_tree([gtask(xb[i], yb[i], fb[i], e, m_) for i in range(len(xb))],
                                     _fit.merge_scaled_r))[0]
    U, sv = _fit.subspace(*R, subspace_rank)
    maps = _fit.baseline_maps(B, n, ridge, identity_prior) if baselines else ()
    ptask = dask.delayed(_projection_block, pure=True)
    # one key each for the d x r and d x d matrices, not a copy in every task
    U_, means_, maps_ = (dask.delayed(a, pure=True) for a in (U, means, maps))
    proj = dask.compute([ptask(xb[i], yb[i], fb[i], e, U_, means_, maps_) for i in range(len(xb))])[0]
    proj = np.concatenate(proj, axis=1)
    return {
        "record": record, "projections": (proj[0:3], proj[3:6], proj[6:9]),
        "subspace": U, "singular_values": sv, "baseline_maps": maps,
        "baseline_residuals": tuple(proj[9 + 2 * j : 11 + 2 * j] for j in range(len(maps))),
    }
