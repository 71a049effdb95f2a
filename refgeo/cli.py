"""The ``refgeo`` command (console script ``refgeo`` and ``python -m refgeo``).

Subcommands::

    refgeo demo [--out DIR] [--quick]       offline demo on real text, writes a report
    refgeo inspect FILE [--key K] [--json]  row geometry of a matrix (.npy / .npz)
    refgeo spread --V N --d D [--out FILE]  max-min spreading of N rows in dimension D
    refgeo lmo GRAD.npy [--eta E]           diameter LMO of a gradient, with certificate
    refgeo tokenwise X.npy Y.npy [--k K]    tokenwise decomposition of a layer update
    refgeo config                           what this installation can do (show_config)

Every error (missing file, wrong shape, bad key, bad number) prints one line to stderr
and exits with status 2; set ``REFGEO_DEBUG=1`` to see the traceback of an unexpected
error instead.  Ctrl-C prints one line and exits with status 130.  A closed pipe
(``refgeo inspect m.npy | head -n 3``) ends the command quietly with status 0, the
Unix convention.  ``.npy`` inputs are memory-mapped: the diameter and closest pair read
them in tiles, and ``inspect``'s other reports (rank, covering radius, worst-case hidden
state) each hold one float64 copy of the rows at a time.

On a terminal, long computations show progress on stderr (``--no-progress`` turns it
off; ``--progress`` turns it on where stderr is not a terminal).

Examples
--------
>>> main(["config", "--help"])  # doctest: +ELLIPSIS
usage: refgeo config [-h]
...
0
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import functools
import importlib.util
import inspect
import io
import json
import logging
import math
import os
import sys
import warnings
import zipfile
import zlib
from typing import Any, Callable, NoReturn

import numpy as np

from refgeo import (
    __version__,
    center_rows,
    closest_pair,
    covering_radius,
    decompose,
    diameter_lmo,
    jung_constant,
    ratio_upper_bound,
    row_diameter,
    show_config,
    spread,
    worst_case_hidden_state,
)

from ._certify import scale_exponent
from ._validate import as_float_array, check_centered_rows, check_min_rows, check_same_shape
from ._interop import precision_eps
from .lmo import _centered_rtol
from .tokenwise import _MLP_DEFAULTS, CLASSES

__all__ = ["main"]

PROG = "refgeo"


class CLIError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block) and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")

    def _print_message(self, message: str, file: Any = None) -> None:
        # argparse's own drops a write error of --help and --version (it catches
        # OSError), so `refgeo --help >&-` exited 0 having written nothing; an error
        # writing stdout now reaches main, which reports it as for a command.  Errors
        # writing stderr (closed, a broken pipe) lose the message, as _to_stderr does:
        # main would take them for stdout's (a broken pipe there is status 0).
        if not message:
            return
        if file is None or file is sys.stderr:
            _to_stderr(message.rstrip("\n"))
        else:
            file.write(message)


# ------------------------------------------------------------------ argument types

def _int_type(name: str, min_value: int) -> Callable[[str], int]:
    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {min_value}, got {text!r} instead") from None
        if value < min_value:
            raise argparse.ArgumentTypeError(f"must be an integer >= {min_value}, got {value} instead")
        return value

    return convert


def _float_type(*, positive: bool = True, nonnegative: bool = False, normal: bool = False,
                below: float | None = None) -> Callable[[str], float]:
    """A finite float option: > 0 (``positive``), >= 0 (``nonnegative``) or any, and < ``below``;
    ``normal`` asks for at least the smallest normal float64 (the library's ``eta``).

    The library's own checks would name its argument (``rtol``), not the option
    (``--rtol``), so the ranges the library enforces are checked here too; argparse
    puts the option's name before the message ("argument --rtol: must be ...").
    """
    if normal:
        tiny = sys.float_info.min
        want, ok = f"a finite number >= {tiny!r} (the smallest normal float64)", (lambda v: v >= tiny)
    elif positive:
        want, ok = "a finite number > 0", (lambda v: v > 0)
    elif nonnegative:
        want, ok = "a finite number >= 0", (lambda v: v >= 0)
    else:
        want, ok = "a finite number", (lambda v: True)
    if below is not None:
        want = f"{want} and < {below:g}"

    def convert(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r} instead") from None
        if not math.isfinite(value) or not ok(value) or (below is not None and not value < below):
            raise argparse.ArgumentTypeError(f"must be {want}, got {text!r} instead")
        return value

    return convert


# ------------------------------------------------------------------ helpers

def _load_matrix(path: str, *, key: str | None = None, label: str = "FILE", key_flag: str = "--key",
                 with_file_dtype: bool = False):
    """A finite real 2-D array from .npy (memory-mapped) or .npz (read whole; no pickles).

    ``key`` names the array of a ``.npz`` file; ``key_flag`` is the command's option
    that sets it, for the messages.  ``with_file_dtype=True``
    also returns the file's own dtype (integer, boolean and float16 files are converted
    to float64).

    A ``.npy`` file is opened with ``mmap_mode="r"``: the rows are paged in from the file
    as the computation reads them, so a matrix larger than memory is never copied in
    whole by the loader (the finiteness check reads it in blocks of rows).
    """
    if not os.path.exists(path):
        raise CLIError(f"{label} {path!r} does not exist")
    if os.path.isdir(path):
        raise CLIError(f"{label} {path!r} is a directory, not a .npy or .npz file")
    if not os.path.isfile(path):
        # a FIFO (or another stream) is read twice below, header then data: the data
        # read hung on a FIFO whose writer had gone, or failed as "No data left in file"
        raise CLIError(f"{label} {path!r} is not a regular file (a pipe or a device); save the array to a file first")
    lower = path.lower()
    if not lower.endswith((".npy", ".npz")):
        raise CLIError(f"{label} must be a .npy or .npz file, got {path!r} instead")
    # np.load reads a file without the NumPy or zip header as a pickle, and its refusal
    # then spoke of pickled data and allow_pickle=, which no option here exposes
    magic = b"\x93NUMPY" if lower.endswith(".npy") else b"PK"
    try:
        with open(path, "rb") as fh:
            head = fh.read(len(magic))
    except OSError as exc:
        raise CLIError(f"cannot read {path!r}: {exc.strerror or exc}") from None
    if head != magic:
        kind = "a NumPy .npy file" if lower.endswith(".npy") else "a NumPy .npz (zip) file"
        raise CLIError(f"{label} {path!r} is not {kind}: it does not start with the format's header")
    try:
        if lower.endswith(".npy"):
            if key is not None:
                raise CLIError(f"{key_flag} applies to .npz files only, got {key_flag} {key!r} for {path!r}")
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
            where = path
        else:
            with np.load(path, allow_pickle=False) as npz:
                keys = list(npz.files)
                if not keys:
                    raise CLIError(f"{path!r} holds no arrays")
                if key is None:
                    if len(keys) > 1:
                        raise CLIError(
                            f"{path!r} holds several arrays ({', '.join(keys)}); choose one with {key_flag}"
                        )
                    key = keys[0]
                if key not in keys:
                    raise CLIError(f"{key_flag} {key!r} is not in {path!r}; available keys: {', '.join(keys)}")
                arr = npz[key]
                where = f"{path}[{key}]"
    except CLIError:
        raise
    except (ValueError, OSError, EOFError, zipfile.BadZipFile, zlib.error, NotImplementedError) as exc:
        # (a damaged deflate stream is a zlib.error, a member of an unsupported
        # compression method a NotImplementedError: "internal error" before)
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CLIError(f"cannot read {path!r} as a NumPy file: {reason}") from None
    # the library's own checks and messages: dtype, 2-D, non-empty, finite
    checked = as_float_array(arr, where, ndim=2, shape_hint="2-D array of shape (rows, columns)")
    return (checked, where, str(arr.dtype)) if with_file_dtype else (checked, where)


def _jsonable(x: Any) -> Any:
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: _jsonable(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return _jsonable(x.tolist())
    if isinstance(x, np.generic):
        return _jsonable(x.item())
    if isinstance(x, float) and not math.isfinite(x):
        return None  # JSON has no inf/NaN
    return x


def _print_json(obj: Any) -> None:
    print(json.dumps(_jsonable(obj), indent=2))


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.6g}"
    return str(x)


def _print_table(rows: list[tuple[str, Any]]) -> None:
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {_fmt(v)}")


def _check_out_path(path: str | None) -> None:
    """Validate an ``--out`` .npy path before a (possibly long) computation."""
    if path is None:
        return
    if not path.lower().endswith(".npy"):
        raise CLIError(f"--out must name a .npy file, got {path!r} instead")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise CLIError(f"--out: directory {parent!r} does not exist")


def _save_npy(path: str, arr: Any) -> None:
    """Write ``arr`` to exactly ``path``, whole or not at all.

    ``np.save`` given a name appends ``.npy`` unless the name ends in lower-case
    ``.npy`` (``--out S.NPY`` wrote ``S.NPY.npy`` and reported ``S.NPY``), and it writes
    in place: a full disk, a file size limit or Ctrl-C left a truncated file that
    ``np.load`` cannot read, in place of the one that was there.  The array goes to a
    new file beside the target (so that the rename stays on one file system) and is
    renamed over it only once written; on any failure the new file is removed and the
    target is untouched.  As a write in place would: a link is written through (its
    target replaced), an existing file keeps its permissions, a new one gets
    ``0o666`` less the umask.
    """
    import stat
    import tempfile

    _check_out_path(path)
    arr = np.asarray(arr)
    target = os.path.realpath(path)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), prefix=".refgeo-", suffix=".tmp")
        try:
            mode = stat.S_IMODE(os.stat(target).st_mode)
        except FileNotFoundError:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.chmod(tmp, mode)  # (os.fchmod is POSIX-only before Python 3.13)
        with os.fdopen(fd, "wb") as fh:
            np.save(fh, arr)  # a file object: no suffix is added
        os.replace(tmp, target)
    except BaseException as exc:  # also KeyboardInterrupt: no partial file stays behind
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if isinstance(exc, OSError):
            raise CLIError(f"cannot write {path!r}: {exc.strerror or exc}") from None
        raise


def _show_progress(args: argparse.Namespace) -> bool:
    """``--progress`` / ``--no-progress`` if given, else whether stderr is a terminal."""
    if args.progress is not None:
        return bool(args.progress)
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # a replaced or closed stderr
        return False


def _progress_kw(fn: Callable[..., Any], args: argparse.Namespace) -> dict[str, Any]:
    """``{"progress": ...}`` for a library call that takes ``progress=``, else ``{}``.

    The feature check of the ``--progress`` flag: the long calls gain ``progress=`` one
    by one, and the command passes it to exactly those that accept it.  The library's
    bar is tqdm; by default (a terminal, no flag) it is shown only where tqdm is
    installed, so that a default never prints the library's "install tqdm" warning.
    """
    if "progress" not in inspect.signature(fn).parameters:
        return {}
    show = _show_progress(args)
    if show and args.progress is None and importlib.util.find_spec("tqdm") is None:
        show = False
    return {"progress": show}


# ------------------------------------------------------------------ commands

def _cmd_config(args: argparse.Namespace) -> int:
    if args.json:
        _print_json(show_config(mode="dicts"))
    else:
        show_config()
    return 0


def _inspect_report(S, args: argparse.Namespace, pairs: tuple[Any, Any] | None = None) -> dict[str, Any]:
    H = args.H
    V, d = S.shape
    out: dict[str, Any] = {"shape": [V, d], "dtype": str(S.dtype)}
    if pairs is None:
        D = row_diameter(S, **_progress_kw(row_diameter, args))
        m = closest_pair(S, **_progress_kw(closest_pair, args))
    else:  # computed on a Dask cluster
        D, m = pairs
    out["diameter"] = {"value": D.value, "pair": [D.i, D.j], "error_bound": D.error_bound, "backend": D.backend}
    out["closest_pair"] = {"value": m.value, "pair": [m.i, m.j], "error_bound": m.error_bound, "backend": m.backend}
    out["ratio"] = m.value / D.value if D.value > 0 else None
    out["condition_number"] = D.value / m.value if m.value > 0 else None
    if D.value > 0:
        X = np.array(S, dtype=np.float64)  # one float64 copy, scaled and centered in place
        # scaled by a power of two (exact: the same rank), as the engine scales rows,
        # so that the mean of rows near the float64 maximum cannot overflow
        np.ldexp(X, -scale_exponent(np, [X]), out=X)
        X -= X.mean(axis=0)
        k = int(np.linalg.matrix_rank(X))
        del X
    else:
        k = 0
    out["rank_centered"] = k
    ball = covering_radius(S, max_iter=20_000)
    out["covering_radius"] = {"radius": ball.radius, "lower_bound": ball.lower_bound, "n_iter": ball.n_iter}
    J = jung_constant(k)
    out["jung"] = {"k": k, "J_k": J, "lower": D.value / 2, "upper": J * D.value}
    out["ratio_upper_bound"] = float(ratio_upper_bound(V, d).value)
    out["backward_bound"] = {"factor": D.value / 2, "meaning": "||S^T r||_2 <= (D/2) ||r||_1 for 1^T r = 0"}
    w = worst_case_hidden_state(S, H=H)
    out["worst_case_hidden_state"] = {"H": H, "value": w.value, "pair": [w.i, w.j], "h": np.asarray(w.h)}
    return out


# Default seconds ``inspect --scheduler`` waits for the scheduler to answer
# (``--scheduler-timeout``): Dask retries a refused connection until then.
SCHEDULER_TIMEOUT = 10.0


def _probe_scheduler(distributed: Any, address: str, timeout: float) -> None:
    """``CLIError`` unless a Dask scheduler at ``address`` answers an ``identity``
    request within ``timeout`` seconds (connection and answer together)."""
    import asyncio
    import concurrent.futures

    async def exchange():
        comm = await distributed.comm.connect(address, timeout=timeout)
        try:
            await comm.write({"op": "identity", "reply": True})
            return await comm.read()
        finally:
            comm.abort()

    async def bounded():
        return await asyncio.wait_for(exchange(), timeout)

    try:
        # in a thread of its own: asyncio.run refuses to run where the caller's thread
        # already runs an event loop (cli.main from a notebook cell)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            reply = pool.submit(asyncio.run, bounded()).result()
    except (OSError, asyncio.TimeoutError, TimeoutError) as exc:
        raise CLIError(f"could not connect to the Dask scheduler at {address!r}: "
                       f"{str(exc) or f'no answer within {timeout:g} s'}") from None
    except Exception as exc:  # whatever the other end spoke, it was not a scheduler's answer
        raise CLIError(f"could not connect to the Dask scheduler at {address!r}: it did not answer as a "
                       f"Dask scheduler ({type(exc).__name__}: {exc})") from None
    if not (isinstance(reply, dict) and reply.get("type") == "Scheduler"):
        raise CLIError(f"could not connect to the Dask scheduler at {address!r}: what answered there is not "
                       f"a Dask scheduler (its identity: {str(reply)[:80]})")


def _read_npy_rows(path: str, a: int, b: int, dtype: Any) -> np.ndarray:
    """Rows ``a:b`` of a ``.npy`` file as a C-contiguous array of ``dtype`` (the dtype the
    command's checks gave the whole file), read by the Dask worker that runs the task."""
    return np.array(np.load(path, mmap_mode="r", allow_pickle=False)[a:b], dtype=dtype, order="C")


def _install_task_counter(name: str, dask_scheduler: Any = None) -> None:
    """Add a plugin ``name`` to a Dask scheduler (runs there) that counts the tasks
    submitted from now on and those finished."""
    from distributed.diagnostics.plugin import SchedulerPlugin

    class TaskCounter(SchedulerPlugin):
        def __init__(self) -> None:
            self.done = self.total = 0

        def transition(self, key: Any, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
            if start == "released" and finish == "waiting":
                self.total += 1
            elif finish == "memory":
                self.done += 1

    dask_scheduler.add_plugin(TaskCounter(), name=name)


def _task_counts(name: str, dask_scheduler: Any = None) -> tuple[int, int]:
    """``(finished, submitted)`` tasks seen by the plugin ``name`` (runs on the scheduler)."""
    plugin = dask_scheduler.plugins[name]
    return plugin.done, plugin.total


def _remove_task_counter(name: str, dask_scheduler: Any = None) -> None:
    dask_scheduler.remove_plugin(name=name)


class _SchedulerProgress:
    """Reports, from the scheduler, the tasks finished by the graphs submitted meanwhile.

    A plugin on the scheduler counts the tasks submitted and finished; a background
    thread asks it every 0.5 s and writes ``refgeo inspect: dask: <done>/<total>
    tasks`` to stderr when the counts changed (at most one line a second), and a last
    line when the block ends.
    """

    def __init__(self, client: Any, show: bool) -> None:
        import uuid

        self.client, self.show = client, show
        self.name = f"refgeo-inspect-{uuid.uuid4().hex}"
        self.last: tuple[int, int] | None = None
        self.last_time = 0.0
        self.stop: Any = None
        self.thread: Any = None

    def _counts(self) -> tuple[int, int]:
        return tuple(self.client.run_on_scheduler(_task_counts, self.name))

    def _report(self, force: bool = False) -> None:
        import time

        now = time.monotonic()
        c = self._counts()
        if c != self.last and (force or now - self.last_time >= 1.0) and c[1] > 0:
            _to_stderr(f"refgeo inspect: dask: {c[0]}/{c[1]} tasks")
            self.last, self.last_time = c, now

    def _loop(self) -> None:
        while not self.stop.wait(0.5):
            try:
                self._report()
            except Exception:  # the scheduler went away: the computation reports it
                return

    def __enter__(self) -> "_SchedulerProgress":
        import threading

        if self.show:
            self.client.run_on_scheduler(_install_task_counter, self.name)
            self.stop = threading.Event()
            self.thread = threading.Thread(target=self._loop, daemon=True)
            self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.show:
            self.stop.set()
            self.thread.join(5)
            if exc[0] is None:
                self._report(force=True)
            self.client.run_on_scheduler(_remove_task_counter, self.name)


class _NotAllExit(logging.Filter):
    """Drops asyncio's report of a task that ended in ``kind`` (distributed's AllExit:
    the client's gather, interrupted), which nobody retrieves."""

    def __init__(self, kind: type) -> None:
        super().__init__()
        self.kind = kind

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], self.kind))


def _dask_inspect(S: Any, args: argparse.Namespace) -> tuple[Any, Any]:
    """Diameter and closest pair of the rows on the Dask scheduler ``args.scheduler``.

    A ``.npy`` file is read by the workers themselves, ``--chunk-rows`` rows per task
    (the path must name the same file on every worker); the rows of a ``.npz`` file
    are sent from this process.
    """
    try:
        import dask
        import dask.array as da
        import distributed
    except ImportError as exc:
        raise CLIError(f"--scheduler needs Dask: python -m pip install 'refgeo[dask]' ({exc})") from None
    try:
        # a malformed address is refused before a client exists: a client whose start
        # failed times out again in its finalizer at exit, printing a traceback
        distributed.comm.get_address_host_port(args.scheduler)
    except ValueError as exc:
        raise CLIError(
            f"--scheduler {args.scheduler!r} is not a Dask scheduler address (e.g. tcp://host:8786): {exc}"
        ) from None
    if args.scheduler.partition("://")[0] == "tls":
        # Client raised a TypeError (no ssl_context) and its half-made self timed out
        # again at exit, a traceback 20 s later
        raise CLIError(f"--scheduler {args.scheduler!r}: tls:// needs TLS credentials, which refgeo inspect "
                       "does not take; connect with tcp:// (e.g. through an SSH tunnel)")
    # The client's timeout covers the connection, not the handshake after it: a port
    # that accepts and never speaks Dask (any other server) hung the command for good.
    # One exchange under a deadline of our own first, which leaves nothing behind.
    _probe_scheduler(distributed, args.scheduler, args.scheduler_timeout)
    try:
        client = distributed.Client(args.scheduler, timeout=args.scheduler_timeout, set_as_default=False)
    except (OSError, TimeoutError, ValueError) as exc:
        raise CLIError(f"could not connect to the Dask scheduler at {args.scheduler!r}: {exc}") from None
    # Ctrl-C during a gather leaves the client's wait task with distributed's AllExit,
    # which asyncio logs with its traceback ("Task exception was never retrieved") as
    # the client closes, before the command's one line
    asyncio_log = logging.getLogger("asyncio")
    if not any(isinstance(f, _NotAllExit) for f in asyncio_log.filters):  # once per process
        asyncio_log.addFilter(_NotAllExit(distributed.client.AllExit))
    V, d = S.shape
    b = args.chunk_rows
    with client, dask.config.set(scheduler=client):
        # the file name, not the loaded array, decides: the checks hand back a plain
        # array (a view of the memory map, or a converted copy), never an np.memmap
        if args.file.lower().endswith(".npy"):
            path = os.path.abspath(args.file)
            read = dask.delayed(_read_npy_rows, pure=True)
            D = da.concatenate([
                da.from_delayed(read(path, a, min(a + b, V), S.dtype), shape=(min(a + b, V) - a, d), dtype=S.dtype)
                for a in range(0, V, b)
            ])
        else:
            D = da.from_array(np.asarray(S), chunks=(b, d))
        with _SchedulerProgress(client, _show_progress(args)):
            return row_diameter(D, tile_size=b), closest_pair(D, tile_size=b)


def _cmd_inspect(args: argparse.Namespace) -> int:
    # float16, integer and boolean files are computed in float64; the report names both
    S, where, file_dtype = _load_matrix(args.file, key=args.key, with_file_dtype=True)
    check_min_rows(S, where, 2)
    pairs = _dask_inspect(S, args) if args.scheduler is not None else None
    rep = _inspect_report(S, args, pairs)
    rep = {"source": where, "file_dtype": file_dtype, **rep}
    if args.json:
        _print_json(rep)
        return 0
    D, m = rep["diameter"], rep["closest_pair"]
    c, j, w = rep["covering_radius"], rep["jung"], rep["worst_case_hidden_state"]
    h = w["h"]
    # + 0.0: no "-0" for the zero h* of --H 0
    shown = ", ".join(f"{v + 0.0:.4g}" for v in h[:8]) + (", ..." if len(h) > 8 else "")
    _print_table([
        ("source", where),
        ("shape (V, d)", f"({rep['shape'][0]}, {rep['shape'][1]})  {rep['dtype']}"
                         + (f" (the file: {file_dtype})" if file_dtype != rep["dtype"] else "")),
        ("diameter D", f"{D['value']:.10g}  rows ({D['pair'][0]}, {D['pair'][1]})  [{D['backend']}]"),
        ("closest pair m", f"{m['value']:.10g}  rows ({m['pair'][0]}, {m['pair'][1]})"),
        ("ratio rho = m/D", "undefined (all rows equal)" if rep["ratio"] is None else f"{rep['ratio']:.6g}"),
        ("condition D/m", "inf (duplicate rows)" if rep["condition_number"] is None else f"{rep['condition_number']:.6g}"),
        ("rank of centered rows", rep["rank_centered"]),
        ("covering radius", f"{c['radius']:.8g}  (certified >= {c['lower_bound']:.8g})"),
        ("Jung bounds", f"D/2 = {j['lower']:.6g} <= rad <= J_k D = {j['upper']:.6g}  (J_{j['k']} = {j['J_k']:.6g})"),
        ("rho upper bound (V, d)", f"{rep['ratio_upper_bound']:.6g}"),
        ("backward bound", f"||S^T r|| <= {rep['backward_bound']['factor']:.6g} ||r||_1  (1^T r = 0)"),
        (f"h* (||h|| = {w['H']:g})", f"[{shown}]  moves logits by {w['value']:.6g} (Hilbert)"),
    ])
    return 0


def _cmd_spread(args: argparse.Namespace) -> int:
    _check_out_path(args.out)
    res = spread(args.V, args.d, eta=args.eta, seed=args.seed, max_time=args.max_time,
                 **_progress_kw(spread, args))
    rep: dict[str, Any] = {
        "V": args.V,
        "d": args.d,
        "eta": args.eta,
        "min_dist": res.min_dist,
        "diameter": res.diameter,
        "ratio": res.ratio,
        "upper_bound": res.upper_bound,
        "upper_bound_binding": res.bound.binding,
        "certified": res.certified,
        "certificate": res.certificate,
        "error_bound": res.error_bound,
        "min_pair": res.min_pair,
        "diameter_pair": res.diameter_pair,
        "method": res.method,
        "init": res.init,
        "n_iter": res.n_iter,
        "elapsed": res.elapsed,
    }
    if args.out is not None:
        _save_npy(args.out, res.points)
        rep["saved"] = args.out
    if args.json:
        _print_json(rep)
    else:
        _print_table([(k, v) for k, v in rep.items()])
    return 0


def _scale_exponent(G: np.ndarray) -> int:
    """The engine's power-of-two scaling of the rows ``G`` (:func:`refgeo._certify.scale_exponent`):
    ``G * 2**-e`` has neither overflowing nor underflowing squares."""
    return scale_exponent(np, [G])


def _half_sum_of_centered_row_norms(G: np.ndarray) -> float:
    """``sum_i ||g_i - mean||_2 / 2`` (the RowNorm decrease), on the rows scaled by a power
    of two: the squares of the entries of a gradient of magnitude 1e200 overflow and those of
    1e-200 underflow to 0."""
    e = _scale_exponent(G)
    X = np.ldexp(np.asarray(G, dtype=np.float64), -e)
    X -= X.mean(axis=0)
    try:
        return math.ldexp(0.5 * float(np.linalg.norm(X, axis=1).sum()), e)
    except OverflowError:
        return math.inf


def _cmd_lmo(args: argparse.Namespace) -> int:
    G, where = _load_matrix(args.grad, key=args.key, label="GRAD")
    check_min_rows(G, where, 2)
    _check_out_path(args.out)
    if not args.center:
        # the library's check, first: its remedy is a Python function, the command's --center
        try:
            e = _scale_exponent(G)
            check_centered_rows(np.ldexp(np.asarray(G, dtype=np.float64), -e), "G",
                                _centered_rtol(precision_eps(G.dtype)), e)
        except ValueError as exc:
            msg = str(exc).partition(" Center it first")[0]
            raise CLIError(f"{where}: {msg} Pass --center to subtract the mean row first.") from None
    else:
        # the library's centering (two passes, in G's dtype): one pass left the rounding
        # of the mean in every row, which the LMO's centering check refused, with a
        # remedy that was this very option (a common offset 1e14 times the spread)
        try:
            G = center_rows(G)
        except ValueError:
            raise CLIError(f"--center: the centered rows of {where} exceed the range of {G.dtype}; "
                           "scale the gradient down") from None
    res = diameter_lmo(G, eta=args.eta, rtol=args.rtol, max_time=args.max_time,
                       **_progress_kw(diameter_lmo, args))
    half_sum = _half_sum_of_centered_row_norms(G)
    lo, hi = float(res.lower_bound), float(res.upper_bound)
    rep: dict[str, Any] = {
        "source": where,
        "shape": list(G.shape),
        "eta": args.eta,
        "decrease": res.decrease,
        # the bracket of the tension T(G), the optimal decrease per unit eta: the decrease
        # above is eta times its lower end (labelled, since for eta != 1 the bare names
        # read as bounds on the decrease, which they are not)
        "tension_lower_bound": res.lower_bound,
        "tension_upper_bound": res.upper_bound,
        "gap": res.gap,
        "converged": res.converged,
        "method": res.method,
        "iterations": res.iterations,
        "rounds": res.rounds,
        "elapsed": res.elapsed,
        "active_pairs": int(np.shape(res.pairs)[0]),
        "rownorm_tension": half_sum,
        "rownorm_over_exact": [half_sum / hi if hi > 0 else 1.0, min(1.0, half_sum / lo) if lo > 0 else 1.0],
    }
    if args.out is not None:
        _save_npy(args.out, res.update)
        rep["saved"] = args.out
    if args.json:
        _print_json(rep)
    else:
        per_unit = {"tension_lower_bound", "tension_upper_bound", "rownorm_tension"}
        rows = [(f"{k} (per unit eta)" if k in per_unit else k, v)
                for k, v in rep.items() if k != "rownorm_over_exact"]
        r = rep["rownorm_over_exact"]
        rows.append(("RowNorm / exact decrease", f"in [{r[0]:.6g}, {r[1]:.6g}]  (guaranteed >= 0.707107)"))
        _print_table(rows)
    return 0


def _cmd_tokenwise(args: argparse.Namespace) -> int:
    X, wx = _load_matrix(args.x, key=args.x_key, label="X", key_flag="--x-key")
    Y, wy = _load_matrix(args.y, key=args.y_key, label="Y", key_flag="--y-key")
    check_same_shape(X, Y, ("X", "Y"))
    kwargs: dict[str, Any] = {"cls": args.cls}
    if args.cls == "mlp":
        # the library's message names its train_fraction, which no option here sets
        tf, n = _MLP_DEFAULTS["train_fraction"], X.shape[0]
        n_train = int(round(tf * n))  # as fit_tokenwise_mlp splits them
        if not 1 <= n_train <= n - 1:
            raise CLIError(f"--cls mlp trains on {tf:.0%} of the tokens and evaluates on the rest, which "
                           f"needs at least one of each: N = {n} tokens give {n_train} for training and "
                           f"{n - n_train} held out")
    else:  # the MLP is one global map: no neighbors, --k does not apply
        if args.k >= X.shape[0]:
            raise CLIError(f"--k must be smaller than the number of tokens N = {X.shape[0]}, got {args.k} instead")
        kwargs["k"] = args.k
    if args.rank is not None and args.cls != "low_rank":
        raise CLIError(f"--rank applies to --cls low_rank only, got --cls {args.cls}")
    if args.cls == "low_rank":
        if args.rank is None:
            raise CLIError(f"--cls low_rank needs --rank R, 1 <= R <= d = {X.shape[1]}")
        if args.rank > X.shape[1]:
            raise CLIError(f"--rank must be <= d = {X.shape[1]} (the width of X and Y), got {args.rank} instead")
        kwargs["rank"] = args.rank
    if args.ridge is not None:
        kwargs["ridge"] = args.ridge
    res = decompose(X, Y, **kwargs, **_progress_kw(decompose, args))
    rep: dict[str, Any] = {"X": wx, "Y": wy, "N": X.shape[0], "d": X.shape[1]}
    rep.update(res.summary())
    if args.json:
        _print_json(rep)
    else:
        _print_table([(k, v) for k, v in rep.items()])
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from . import _demo  # the demo's plotting and corpus code loads only for this command

    size = args.size or ("quick" if args.quick else "full")
    out = args.out
    if os.path.exists(out) and not os.path.isdir(out):
        raise CLIError(f"--out {out!r} exists and is not a directory")
    try:
        _demo._check_out_dir(out)  # before the training (run_demo checks again)
    except ValueError as exc:
        raise CLIError(str(exc).replace("out_dir", "--out", 1).rstrip(".")) from None
    report = _demo.run_demo(out, size=size, seed=args.seed, progress=_show_progress(args))
    _to_stderr(f"refgeo demo: wrote {report}")
    return 0


# ------------------------------------------------------------------ parser

def _add_progress(p: argparse.ArgumentParser) -> None:
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="show progress on stderr (default: only when stderr is a terminal)")


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Update geometry for language models: Hilbert distances, certified row geometry, "
        "the diameter LMO, max-min spreading and tokenwise fits.",
        epilog="Run 'refgeo demo' for a tour on real text (no downloads). "
        "Errors print one line and exit with status 2.",
    )
    parser.add_argument("--version", action="version", version=f"refgeo {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    p = sub.add_parser(
        "demo",
        help="train a small next-token LM head on Python's own documentation and write a report",
        description="Build a word-level corpus from pydoc_data.topics and standard-library docstrings, "
        "train the softmax head of a small next-token model with AdamW, RowNorm, rescaled RowNorm, "
        "the exact diameter LMO and the spreading update (at small vocabularies), and write "
        "DIR/report.md with PNG plots and DIR/results.json.",
    )
    p.add_argument("--out", default="refgeo-demo", metavar="DIR", help="output directory (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="small run, about 10-30 s")
    p.add_argument("--seed", type=_int_type("--seed", 0), default=0,
                   help="random seed (default: %(default)s); the parts with time budgets (the exact LMO's and "
                   "spreading's steps, the diagnosed steps) also depend on the machine's speed")
    _add_progress(p)
    p.add_argument("--size", choices=("full", "quick", "tiny"), default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser(
        "inspect",
        help="row geometry of a matrix: diameter, closest pair, ratio, covering radius, bounds, h*",
        description="Certified row geometry of a (V, d) matrix stored in a .npy or .npz file.",
    )
    p.add_argument("file", metavar="FILE", help=".npy or .npz file holding a 2-D array")
    p.add_argument("--key", metavar="K", help="array name inside a .npz file")
    p.add_argument("--H", type=_float_type(positive=False, nonnegative=True), default=1.0,
                   help="hidden-state norm for the worst-case h* (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--scheduler", metavar="ADDRESS", default=None,
                   help="compute the diameter and the closest pair on this Dask scheduler "
                   "(e.g. tcp://host:8786; needs refgeo[dask]; a .npy FILE is read by the "
                   "workers, so its path must be valid on every worker)")
    p.add_argument("--chunk-rows", type=_int_type("--chunk-rows", 1), default=4096, metavar="N",
                   help="rows per Dask task block with --scheduler (default: %(default)s)")
    p.add_argument("--scheduler-timeout", type=_float_type(), default=SCHEDULER_TIMEOUT,
                   metavar="SECONDS",
                   help="seconds to wait for the Dask scheduler to answer (default: %(default)s)")
    _add_progress(p)
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser(
        "spread",
        help="max-min spreading: V points in R^d with the largest closest-pair/diameter ratio",
        description="Run the max-min spreading solver for (V, d) and report min distance, diameter, "
        "ratio and the upper bound on the ratio.",
    )
    p.add_argument("--V", type=_int_type("--V", 2), required=True, metavar="N", help="number of rows, >= 2")
    p.add_argument("--d", type=_int_type("--d", 1), required=True, metavar="D", help="dimension, >= 1")
    p.add_argument("--eta", type=_float_type(normal=True), default=1.0, help="diameter budget (default: %(default)s)")
    p.add_argument("--seed", type=_int_type("--seed", 0), default=0, help="random seed (default: %(default)s)")
    p.add_argument("--max-time", type=_float_type(), default=10.0, metavar="SECONDS",
                   help="time limit of the solver (default: %(default)s)")
    p.add_argument("--out", metavar="FILE", help="save the points to this .npy file")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    _add_progress(p)
    p.set_defaults(func=_cmd_spread)

    p = sub.add_parser(
        "lmo",
        help="exact diameter LMO of a gradient (min-tension value, certificate, RowNorm ratio)",
        description="Solve min <G, S> subject to D(S) <= eta, 1^T S = 0 for the gradient in GRAD. "
                    "It reports the decrease -<G, S> at this eta and, per unit eta, the certified "
                    "bracket of the tension T(G) (the optimal decrease is eta T(G)) and the "
                    "tension of projected RowNorm (half the sum of the centered row norms).",
    )
    p.add_argument("grad", metavar="GRAD.npy", help=".npy (or .npz with --key) file holding G of shape (V, d)")
    p.add_argument("--key", metavar="K", help="array name inside a .npz file")
    p.add_argument("--eta", type=_float_type(normal=True), default=1.0, help="diameter budget (default: %(default)s)")
    p.add_argument("--rtol", type=_float_type(below=1.0), default=1e-4,
                   help="certified relative gap to reach (default: %(default)s)")
    p.add_argument("--max-time", type=_float_type(), default=60.0, metavar="SECONDS",
                   help="time limit; the best certified step so far is reported (default: %(default)s)")
    p.add_argument("--center", action="store_true",
                   help="subtract the mean row first (gradients must have rows summing to about zero)")
    p.add_argument("--out", metavar="FILE", help="save the update S to this .npy file")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    _add_progress(p)
    p.set_defaults(func=_cmd_lmo)

    p = sub.add_parser(
        "tokenwise",
        help="tokenwise decomposition y_i = A(x_i) x_i + r_i of a layer update",
        description="Fit a local linear map on the k nearest neighbors of each token and report "
        "how much of the update Y - X is tokenwise.",
    )
    p.add_argument("x", metavar="X.npy", help="hidden states before the layer, shape (N, d) (.npy or .npz)")
    p.add_argument("y", metavar="Y.npy", help="hidden states after the layer, shape (N, d) (.npy or .npz)")
    p.add_argument("--x-key", metavar="K", help="array name of X inside a .npz file")
    p.add_argument("--y-key", metavar="K", help="array name of Y inside a .npz file (X and Y may share one file)")
    p.add_argument("--k", type=_int_type("--k", 1), default=16,
                   help="neighbors per token, unused by --cls mlp (default: %(default)s)")
    p.add_argument("--cls", default="diagonal", metavar="CLASS", choices=(*CLASSES, "mlp"),
                   help="class of local maps: diagonal, psd_diagonal, low_rank, orthogonal, scaled_orthogonal, "
                   "full or mlp (default: %(default)s)")
    p.add_argument("--rank", type=_int_type("--rank", 1), default=None, help="rank for --cls low_rank")
    p.add_argument("--ridge", type=_float_type(positive=False, nonnegative=True), default=None,
                   help="ridge penalty lambda >= 0 of the local fits and of the global linear baseline "
                        "(with --cls mlp, of the baseline only; library default if omitted)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    _add_progress(p)
    p.set_defaults(func=_cmd_tokenwise)

    p = sub.add_parser("config", help="print the installation's configuration (refgeo.show_config)",
                       description="Print version, backends, BLAS/OpenMP threads and the dtype policy.")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=_cmd_config)
    return parser


class _ClosedStdout(io.TextIOBase):
    """Python's ``sys.stdout`` is None when the process started with stdout closed."""

    def write(self, text: str) -> int:
        raise OSError(errno.EBADF, "standard output is closed")


class _QuietStderr:
    """``sys.stderr`` for the length of a command: writing it never raises.

    Progress bars (tqdm, the demo's counter) write stderr themselves; where its reader
    had gone away their ``BrokenPipeError`` reached :func:`main`, which took it for
    stdout's (status 0): the command stopped early and exited 0 having printed or saved
    nothing.  Errors writing stderr are dropped, as :func:`_to_stderr` drops them.
    """

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except (OSError, ValueError):
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except (OSError, ValueError):
            pass

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, ...
        return getattr(self._stream, name)


def _to_stderr(line: str) -> None:
    """Print one line to stderr, or nothing where stderr is closed (``2>&-``): the
    message is lost, but the exit status still says what happened (the print raised
    ``OSError`` there and the command exited with status 1, or with ``sys.stderr``
    None the message went to stdout)."""
    if sys.stderr is None:  # print(file=None) would write to stdout
        return
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def _show_warning(command: str, message: Any, *args: Any, **kwargs: Any) -> None:
    _to_stderr(f"{PROG} {command}: warning: {' '.join(str(message).split())}")


def _fail(command: str | None, message: str) -> int:
    prog = f"{PROG} {command}" if command else PROG
    line = " ".join(str(message).split())  # one line, whatever the message
    _to_stderr(f"{prog}: error: {line}")
    return 2


def _run(argv: list[str] | None) -> int:
    parser = _build_parser()
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as exc:  # --help, --version, or a usage error (already printed)
        return int(exc.code or 0) if not isinstance(exc.code, str) else 2
    if args.command is None:
        return _fail(None, "choose a command: demo, inspect, spread, lmo, tokenwise, config (see 'refgeo --help')")
    try:
        with warnings.catch_warnings():
            # a library warning (an under-determined fit, a missing tqdm) as one line
            # naming the command, like the errors, not Python's two lines with this
            # file's path and source line
            warnings.showwarning = functools.partial(_show_warning, args.command)
            return int(args.func(args))
    except CLIError as exc:
        return _fail(args.command, str(exc))
    except BrokenPipeError:
        raise  # the reader went away: not an error of the command (see main)
    except (ValueError, TypeError, OSError, KeyError, RuntimeError, MemoryError) as exc:
        if os.environ.get("REFGEO_DEBUG") == "1":
            raise
        msg = str(exc) or type(exc).__name__
        if isinstance(exc, KeyError):
            msg = f"missing key {msg}"
        if isinstance(exc, MemoryError) and not str(exc):
            msg = "out of memory"
        return _fail(args.command, msg)
    except KeyboardInterrupt:
        _to_stderr(f"{PROG} {args.command}: interrupted")
        return 130
    except Exception as exc:  # noqa: BLE001 - the CLI never shows a traceback
        if os.environ.get("REFGEO_DEBUG") == "1":
            raise
        return _fail(args.command, f"internal error ({type(exc).__name__}): {exc} (set REFGEO_DEBUG=1 for the traceback)")


def _stdout_to_devnull() -> None:
    """Point file descriptor 1 at /dev/null, so that the interpreter's final flush of the
    output still buffered for a closed pipe succeeds instead of failing at exit."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # an in-memory stdout (tests): nothing to redirect
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def main(argv: list[str] | None = None) -> int:
    """Run the ``refgeo`` command with ``argv`` (default ``sys.argv[1:]``); return the exit status.

    Exit status: 0 on success (also when the reader of stdout goes away early, as
    ``refgeo inspect m.npy | head -n 3`` does), 2 for any error (one line on stderr),
    130 after Ctrl-C (one line on stderr).
    """
    if sys.stdout is None:
        # started with stdout closed (>&-): a command that prints fails when it writes
        # (one line, status 2), and `demo`, which writes only files, still runs
        sys.stdout = _ClosedStdout()
    stderr = sys.stderr
    if stderr is not None:
        sys.stderr = _QuietStderr(stderr)
    try:
        status = _run(argv)
        # flush here, not at interpreter exit, so that a closed pipe is seen (and handled) now
        sys.stdout.flush()
    except BrokenPipeError:
        _stdout_to_devnull()
        return 0
    except OSError as exc:  # another write error of stdout (a closed descriptor, a full disk)
        _stdout_to_devnull()
        return _fail(None, f"writing standard output: {exc.strerror or exc}")
    except KeyboardInterrupt:  # outside a command: while parsing or flushing
        _to_stderr(f"{PROG}: interrupted")
        return 130
    finally:
        sys.stderr = stderr
    return status
