"""Shared pieces of refgeo's asv benchmarks.

Conventions:
- one file per area (``hilbert.py``, ``extreme_pairs.py``, ``lmo.py``, ...);
- params ``(size, dtype, backend)``; ``SMALL`` sizes run in CI (``asv run --quick``),
  ``REALISTIC`` sizes are selected with ``REFGEO_BENCH_SIZE=realistic``;
- a seeded RNG in ``setup``; ``NotImplementedError`` in ``setup`` skips an absent backend;
- every ``time_*`` has a ``peakmem_*`` partner; quality and speed ratios are ``track_*``;
- every result records dtype, backend, BLAS and threads: ``dtype`` and ``backend`` are
  parameters, and the last parameter of every class is ``RUNTIME``, a one-value list whose
  value names the BLAS libraries and their thread counts and the OpenMP threads
  (``"openblas 0.3.30 x2 [scipy]; ..."``), so it is stored with each result in asv's
  results files; decorate the class with ``@records_runtime`` (it appends the parameter
  and lets the methods keep their own signatures), or append it by hand with
  ``with_runtime(params, names)``.  ``environment()``
  also prints the full details (with refgeo's config) to the benchmark's stderr; call it
  from ``setup``.
- speed ratios against a baseline are measured in the same process with ``speed_ratio``
  (``track_speedup_vs_*``, unit ``"x"``: the two sides interleaved, the same number of
  calls each); roofline fractions come from
  ``roofline_fraction`` (GEMM rate and kernel time interleaved);
- ``best_time`` takes the best of ``REPEAT`` calls: 3, or ``REFGEO_BENCH_REPEAT`` (CI's
  smoke run sets 1: its numbers are not measurements, and the repeats were a third of
  its time).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time

import numpy as np

try:
    import refgeo
    from refgeo import _backend
except ImportError:  # older commits: benchmarks still load, setup skips
    refgeo = None
    _backend = None

BACKENDS = ["reference", "cython"]
DTYPES = ["float64", "float32"]


def _threadpools() -> list[dict]:
    """threadpoolctl's view, after loading the BLAS of NumPy and SciPy (refgeo_ext uses SciPy's)."""
    try:
        import scipy.linalg  # noqa: F401  (loads SciPy's BLAS so threadpoolctl sees it)
        from threadpoolctl import threadpool_info
    except Exception:  # pragma: no cover
        return []
    pools = []
    for p in threadpool_info():
        path = str(p.get("filepath") or "")
        owner = "numpy" if "numpy" in path else "scipy" if "scipy" in path else "system"
        pools.append(
            {
                "internal_api": p.get("internal_api"),
                "version": p.get("version"),
                "num_threads": p.get("num_threads"),
                "threading_layer": p.get("threading_layer"),
                "owner": owner,
            }
        )
    return pools


def runtime_label() -> str:
    """One line naming the BLAS/OpenMP libraries and their thread counts of this process."""
    parts = []
    for p in _threadpools():
        version = " " + ".".join(str(p["version"]).split(".")[:3]) if p["version"] else ""
        owner = f" [{p['owner']}]" if p["owner"] != "system" else ""
        parts.append(f"{p['internal_api']}{version} x{p['num_threads']}{owner}")
    return "; ".join(sorted(parts)) or "no BLAS/OpenMP pools found"


# The one-value parameter that stores BLAS and thread counts with every asv result.
RUNTIME = [runtime_label()]


def with_runtime(params, param_names):
    """Append the ``runtime`` parameter: ``params, param_names = with_runtime(...)``.

    The benchmark methods then take ``runtime`` as their last argument; see
    ``records_runtime`` for a form that leaves the methods unchanged.
    """
    return list(params) + [RUNTIME], list(param_names) + ["runtime"]


_BENCH_PREFIXES = ("time_", "timeraw_", "peakmem_", "mem_", "track_")


def _drop_trailing_arguments(fn, n):
    @functools.wraps(fn)  # keeps .unit, .timeout, ... and __wrapped__ (asv reads the source)
    def wrapper(*args):
        return fn(*args[:-n])

    wrapper._drops_trailing = True
    return wrapper


def records_runtime(cls=None, *, dtype=None, backend=None):
    """Class decorator: add the one-value ``runtime`` parameter (BLAS, OpenMP, threads).

    Every result of the class then stores the BLAS libraries and thread counts in asv's
    results, next to the class's own parameters.  ``dtype=`` and ``backend=`` add
    one-value ``dtype`` and ``backend`` parameters for classes that do not vary them
    (a solver that always works in float64, say), so that those are recorded as well:
    ``@records_runtime(dtype="float64", backend="reference")``.  The methods
    (``setup``, ``teardown``, ``time_*``, ``peakmem_*``, ``track_*``, ...) keep their
    signatures: the extra trailing arguments are dropped before they are called.
    """
    if cls is None:
        return functools.partial(records_runtime, dtype=dtype, backend=backend)
    params = list(getattr(cls, "params", []))
    names = list(getattr(cls, "param_names", []))
    # a subclass of a decorated class inherits the extra parameters its base added:
    # those are taken off what it inherits (they were appended twice: 9 names for 6
    # parameters, which asv cut silently, and an inherited params list made the
    # wrapped methods receive one argument too many)
    inherited = getattr(cls, "_runtime_extra", 0)
    if inherited and "params" not in vars(cls):
        params = params[:-inherited]
    if inherited and "param_names" not in vars(cls):
        names = names[:-inherited]
    if params and not isinstance(params[0], (tuple, list)):  # asv's one-parameter form
        params = [params]
    extra = [(n, [v]) for n, v in (("dtype", dtype), ("backend", backend)) if v is not None]
    extra.append(("runtime", RUNTIME))
    if inherited and inherited != len(extra):
        raise TypeError(f"{cls.__name__}: records_runtime must add as many parameters as on its base class "
                        f"({inherited}), whose wrapped methods drop that many")
    cls.params = params + [v for _, v in extra]
    cls.param_names = names + [n for n, _ in extra]
    cls._runtime_extra = len(extra)
    # inherited methods too (a shared base class of trackers): wrapped on this class
    for attr in dir(cls):
        fn = getattr(cls, attr)
        if getattr(fn, "_drops_trailing", False):  # inherited from a decorated class: wrapped once
            continue
        if callable(fn) and (attr in ("setup", "teardown") or attr.startswith(_BENCH_PREFIXES)):
            setattr(cls, attr, _drop_trailing_arguments(fn, len(extra)))
    return cls


def realistic() -> bool:
    """True when realistic (hand-run) sizes are requested."""
    return os.environ.get("REFGEO_BENCH_SIZE", "small") == "realistic"


def require_backend(name: str) -> None:
    """Skip (asv: NotImplementedError in setup) when refgeo or the backend is missing."""
    if refgeo is None:
        raise NotImplementedError("refgeo is not importable")
    ok, why = _backend.available_backends()[name]
    if not ok:
        raise NotImplementedError(f"backend {name!r} unavailable: {why}")


def environment(dtype: str, backend: str) -> dict:
    """dtype, backend, BLAS and thread counts of this run (printed to the asv log)."""
    info = {"dtype": dtype, "backend": backend, "threadpools": _threadpools()}
    if refgeo is not None:
        cfg = refgeo.show_config(mode="dicts")
        info["openmp_threads"] = cfg["openmp"]["max_threads"]
        info["refgeo"] = cfg["refgeo"]
    print("refgeo-bench-env " + json.dumps(info), file=sys.stderr)
    return info


def rng(seed: int = 0) -> np.random.Generator:
    """The seeded generator every benchmark draws its data from."""
    return np.random.default_rng(seed)


def hidden_states(n: int, d: int, seed: int = 6) -> np.ndarray:
    """float32 hidden states shaped like a residual stream: a common component (norm
    about 5 sqrt(d)) shared by every row, the embedding of a token drawn with Zipf
    counts (exponent 1.1, a vocabulary of n / 2 tokens) and a small context term (1e-3
    per entry).  The rows of one frequent token are near-copies, nearly equidistant."""
    g = rng(seed)
    vocab = n // 2
    p = 1.0 / np.arange(1, vocab + 1) ** 1.1
    tokens = g.choice(vocab, size=n, p=p / p.sum())
    X = 5.0 * g.standard_normal(d) + g.standard_normal((vocab, d))[tokens]
    return (X + 1e-3 * g.standard_normal((n, d))).astype(np.float32)


def _repeat_from_env() -> int:
    """``REFGEO_BENCH_REPEAT`` as a count >= 1 (0 timed nothing: every ratio inf / inf)."""
    text = os.environ.get("REFGEO_BENCH_REPEAT", "3")
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"REFGEO_BENCH_REPEAT must be an integer >= 1, got {text!r} instead.")
    return n


REPEAT = _repeat_from_env()


def best_time(fn, repeat: int | None = None) -> float:
    """Best wall time of ``repeat`` calls (default ``REPEAT``; for speed-ratio trackers
    measured in-process)."""
    best = float("inf")
    for _ in range(REPEAT if repeat is None else repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def speed_ratio(baseline, candidate, rounds: int | None = None, timer=None) -> float:
    """Best time of ``baseline`` over best time of ``candidate``, the two called
    alternately ``rounds`` times each (default ``REPEAT``), the one that goes first
    alternating too: the same number of samples on both sides, from the same stretch
    of a shared machine's load.  (One baseline call against the best of two refgeo
    calls moved a ratio by 1.5x on a busy 2-core machine, always in refgeo's favor.)
    Every ratio of two timings in these benchmarks uses this one definition.

    ``timer(fn)`` times one call (default: wall time of ``fn()``); the Dask
    benchmarks pass one that first waits for the scheduler to settle
    (``dask_engine.best_settled_time``), on both sides."""
    if timer is None:
        timer = functools.partial(best_time, repeat=1)
    t_base = t_cand = float("inf")
    for r in range(REPEAT if rounds is None else rounds):
        for side in ((0, 1) if r % 2 == 0 else (1, 0)):
            if side == 0:
                t_base = min(t_base, timer(baseline))
            else:
                t_cand = min(t_cand, timer(candidate))
    return t_base / t_cand


def dgemm_rate(n: int = 2048, dtype=np.float64) -> float:
    """Measured GEMM rate in flop/s on an n x n product (the roofline): best of
    ``REPEAT`` (3)."""
    a = rng(1).standard_normal((n, n)).astype(dtype)
    b = rng(2).standard_normal((n, n)).astype(dtype)
    t = best_time(lambda: a @ b)
    return 2.0 * n**3 / t


def roofline_fraction(flops: float, fn, rounds: int, calls: int = 1, n: int = 4096,
                      dtype=np.float32) -> float:
    """``flops`` at the best GEMM rate over the best time of ``fn``, interleaved.

    ``rounds`` rounds of (the GEMM rate of an n x n product, best of 3; ``calls`` calls
    of ``fn``), so that both sides sample the same stretch of a shared machine's load;
    the fraction is ``flops / max(rate) / min(time)``: the kernel at its best against
    the ceiling at its best.  A call right after the GEMM shares the cores with BLAS
    worker threads that keep spinning for a while (about 0.1 s) after the GEMM
    returns, which matters for calls of a fraction of a second: give those
    ``calls=2``.  Every roofline tracker uses this one definition.
    """
    rate, t = 0.0, float("inf")
    for _ in range(rounds):
        rate = max(rate, dgemm_rate(n, dtype))
        t = min(t, best_time(fn, calls))
    return flops / rate / t
