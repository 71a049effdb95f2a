"""The ``refgeo`` command (console script ``refgeo`` and ``python -m refgeo``).

Subcommands::

    refgeo demo [--out DIR] [--quick]       offline demo on real text, writes a report
    refgeo inspect FILE [--key K] [--json]  row geometry of a matrix (.npy / .npz)
    refgeo spread --V N --d D [--out FILE]  max-min spreading of N rows in dimension D
    refgeo lmo GRAD.npy [--eta E]           diameter LMO of a gradient, with certificate
    refgeo tokenwise X.npy Y.npy [--k K]    tokenwise decomposition of a layer update
    refgeo config                           what this installation can do (show_config)

Every error (missing file, wrong shape, bad key, bad number, a library part that this
installation lacks) prints one line to stderr and exits with status 2; set
``REFGEO_DEBUG=1`` to see the traceback of an unexpected error instead.

Examples
--------
>>> main(["config", "--help"])  # doctest: +ELLIPSIS
usage: refgeo config [-h]
...
0
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import os
import sys
import zipfile
from typing import Any, Callable, NoReturn

__all__ = ["main"]

PROG = "refgeo"


class CLIError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block) and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


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


def _float_type(name: str, *, positive: bool = True) -> Callable[[str], float]:
    def convert(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r} instead") from None
        if not math.isfinite(value) or (positive and value <= 0):
            want = "a finite number > 0" if positive else "a finite number"
            raise argparse.ArgumentTypeError(f"must be {want}, got {text!r} instead")
        return value

    return convert


# ------------------------------------------------------------------ helpers

def _require(module: str, name: str, command: str) -> Any:
    """The public function ``refgeo.<module>.<name>``, or a CLIError saying it is missing."""
    try:
        mod = importlib.import_module(f"refgeo.{module}")
    except ImportError as exc:
        raise CLIError(f"refgeo.{module} cannot be imported ({exc}); '{command}' needs it") from None
    fn = getattr(mod, name, None)
    if fn is None:
        from refgeo import __version__

        raise CLIError(
            f"refgeo.{module}.{name} is not available in this refgeo ({__version__}); '{command}' needs it"
        )
    return fn


def _load_matrix(path: str, *, key: str | None = None, label: str = "FILE"):
    """Load a finite real 2-D array from .npy or .npz (no pickles)."""
    import numpy as np

    if not os.path.exists(path):
        raise CLIError(f"{label} {path!r} does not exist")
    if os.path.isdir(path):
        raise CLIError(f"{label} {path!r} is a directory, not a .npy or .npz file")
    lower = path.lower()
    if not lower.endswith((".npy", ".npz")):
        raise CLIError(f"{label} must be a .npy or .npz file, got {path!r} instead")
    try:
        if lower.endswith(".npy"):
            if key is not None:
                raise CLIError(f"--key applies to .npz files only, got --key {key!r} for {path!r}")
            arr = np.load(path, allow_pickle=False)
            where = path
        else:
            with np.load(path, allow_pickle=False) as npz:
                keys = list(npz.files)
                if not keys:
                    raise CLIError(f"{path!r} holds no arrays")
                if key is None:
                    if len(keys) > 1:
                        raise CLIError(
                            f"{path!r} holds several arrays ({', '.join(keys)}); choose one with --key"
                        )
                    key = keys[0]
                if key not in keys:
                    raise CLIError(f"--key {key!r} is not in {path!r}; available keys: {', '.join(keys)}")
                arr = npz[key]
                where = f"{path}[{key}]"
    except CLIError:
        raise
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CLIError(f"cannot read {path!r} as a NumPy file: {reason}") from None
    if arr.dtype.kind not in "biuf":
        raise CLIError(f"{where} must hold real numbers, got dtype {arr.dtype} instead")
    if arr.ndim != 2:
        raise CLIError(f"{where} must hold a 2-D array of shape (rows, columns), got shape {arr.shape} instead")
    if arr.size == 0:
        raise CLIError(f"{where} must be non-empty, got shape {arr.shape} instead")
    arr = np.asarray(arr, dtype=np.float64) if arr.dtype.kind != "f" else arr
    if not np.all(np.isfinite(arr)):
        raise CLIError(f"{where} must contain only finite values, got {int(np.sum(~np.isfinite(arr)))} NaN/inf entries")
    return arr, where


def _jsonable(x: Any) -> Any:
    import numpy as np

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


def _save_npy(path: str, arr: Any, label: str = "--out") -> None:
    import numpy as np

    if not path.lower().endswith(".npy"):
        raise CLIError(f"{label} must name a .npy file, got {path!r} instead")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise CLIError(f"{label}: directory {parent!r} does not exist")
    try:
        np.save(path, np.asarray(arr))
    except OSError as exc:
        raise CLIError(f"cannot write {path!r}: {exc.strerror or exc}") from None


def _value(x: Any) -> float:
    """A float from a number or a result object with a ``value`` field."""
    return float(getattr(x, "value", x))


# ------------------------------------------------------------------ commands

def _cmd_config(args: argparse.Namespace) -> int:
    import refgeo

    if args.json:
        _print_json(refgeo.show_config(mode="dicts"))
    else:
        refgeo.show_config()
    return 0


def _inspect_report(S, *, H: float) -> dict[str, Any]:
    import numpy as np

    row_diameter = _require("rows", "row_diameter", "inspect")
    closest_pair = _require("rows", "closest_pair", "inspect")
    V, d = S.shape
    if V < 2:
        raise CLIError(f"the matrix must have at least 2 rows, got shape {S.shape} instead")
    out: dict[str, Any] = {"shape": [V, d], "dtype": str(S.dtype)}
    D = row_diameter(S)
    m = closest_pair(S)
    out["diameter"] = {"value": D.value, "pair": [D.i, D.j], "error_bound": D.error_bound, "backend": D.backend}
    out["closest_pair"] = {"value": m.value, "pair": [m.i, m.j], "error_bound": m.error_bound, "backend": m.backend}
    out["ratio"] = m.value / D.value if D.value > 0 else None
    out["condition_number"] = D.value / m.value if m.value > 0 else None
    X = np.asarray(S, dtype=np.float64)
    k = int(np.linalg.matrix_rank(X - X.mean(axis=0))) if D.value > 0 else 0
    out["rank_centred"] = k
    covering_radius = getattr(importlib.import_module("refgeo.rows"), "covering_radius", None)
    jung_constant = getattr(importlib.import_module("refgeo.rows"), "jung_constant", None)
    if covering_radius is not None:
        ball = covering_radius(S, max_iter=20_000)
        out["covering_radius"] = {"radius": ball.radius, "lower_bound": ball.lower_bound, "n_iter": ball.n_iter}
    if jung_constant is not None:
        J = jung_constant(k)
        out["jung"] = {"k": k, "J_k": J, "lower": D.value / 2, "upper": J * D.value}
    ratio_upper_bound = getattr(importlib.import_module("refgeo.bounds"), "ratio_upper_bound", None)
    if ratio_upper_bound is not None:
        out["ratio_upper_bound"] = _value(ratio_upper_bound(V, d))
    out["backward_bound"] = {"factor": D.value / 2, "meaning": "||S^T r||_2 <= (D/2) ||r||_1 for 1^T r = 0"}
    worst = getattr(importlib.import_module("refgeo.rows"), "worst_case_hidden_state", None)
    if worst is not None:
        w = worst(S, H=H)
        out["worst_case_hidden_state"] = {"H": H, "value": w.value, "pair": [w.i, w.j], "h": np.asarray(w.h)}
    return out


def _cmd_inspect(args: argparse.Namespace) -> int:
    S, where = _load_matrix(args.file, key=args.key)
    rep = _inspect_report(S, H=args.H)
    rep = {"source": where, **rep}
    if args.json:
        _print_json(rep)
        return 0
    D, m = rep["diameter"], rep["closest_pair"]
    rows: list[tuple[str, Any]] = [
        ("source", where),
        ("shape (V, d)", f"({rep['shape'][0]}, {rep['shape'][1]})  {rep['dtype']}"),
        ("diameter D", f"{D['value']:.10g}  rows ({D['pair'][0]}, {D['pair'][1]})  [{D['backend']}]"),
        ("closest pair m", f"{m['value']:.10g}  rows ({m['pair'][0]}, {m['pair'][1]})"),
        ("ratio rho = m/D", "undefined (all rows equal)" if rep["ratio"] is None else f"{rep['ratio']:.6g}"),
        ("condition D/m", "inf (duplicate rows)" if rep["condition_number"] is None else f"{rep['condition_number']:.6g}"),
        ("rank of centred rows", rep["rank_centred"]),
    ]
    if "covering_radius" in rep:
        c = rep["covering_radius"]
        rows.append(("covering radius", f"{c['radius']:.8g}  (certified >= {c['lower_bound']:.8g})"))
    if "jung" in rep:
        j = rep["jung"]
        rows.append(("Jung bounds", f"D/2 = {j['lower']:.6g} <= rad <= J_k D = {j['upper']:.6g}  (J_{j['k']} = {j['J_k']:.6g})"))
    if "ratio_upper_bound" in rep:
        rows.append(("rho upper bound (V, d)", f"{rep['ratio_upper_bound']:.6g}"))
    else:
        rows.append(("rho upper bound (V, d)", "unavailable (refgeo.bounds.ratio_upper_bound missing)"))
    rows.append(("backward bound", f"||S^T r|| <= {rep['backward_bound']['factor']:.6g} ||r||_1  (1^T r = 0)"))
    if "worst_case_hidden_state" in rep:
        w = rep["worst_case_hidden_state"]
        h = w["h"]
        shown = ", ".join(f"{v:.4g}" for v in h[:8]) + (", ..." if len(h) > 8 else "")
        rows.append((f"h* (||h|| = {w['H']:g})", f"[{shown}]  moves logits by {w['value']:.6g} (Hilbert)"))
    _print_table(rows)
    return 0


def _check_out_path(path: str | None) -> None:
    """Validate an ``--out`` .npy path before a (possibly long) computation."""
    if path is None:
        return
    if not path.lower().endswith(".npy"):
        raise CLIError(f"--out must name a .npy file, got {path!r} instead")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise CLIError(f"--out: directory {parent!r} does not exist")


def _cmd_spread(args: argparse.Namespace) -> int:
    spread = _require("spreading", "spread", "spread")
    _check_out_path(args.out)
    res = spread(args.V, args.d, eta=args.eta, seed=args.seed, max_time=args.max_time)
    rep: dict[str, Any] = {
        "V": args.V,
        "d": args.d,
        "eta": args.eta,
        "min_dist": res.min_dist,
        "diameter": res.diameter,
        "ratio": res.ratio,
        "upper_bound": res.upper_bound,
    }
    for extra in ("certified", "certificate", "error_bound", "min_pair", "diameter_pair", "method", "init",
                  "n_iter", "elapsed"):
        if hasattr(res, extra):
            rep[extra] = getattr(res, extra)
    bound = getattr(res, "bound", None)
    if bound is not None and hasattr(bound, "binding"):
        rep["upper_bound_binding"] = bound.binding
    if args.out is not None:
        _save_npy(args.out, res.points)
        rep["saved"] = args.out
    if args.json:
        _print_json(rep)
    else:
        _print_table([(k, v) for k, v in rep.items()])
    return 0


def _cmd_lmo(args: argparse.Namespace) -> int:
    import numpy as np

    diameter_lmo = _require("lmo", "diameter_lmo", "lmo")
    G, where = _load_matrix(args.grad, key=args.key, label="GRAD")
    if G.shape[0] < 2:
        raise CLIError(f"{where} must have at least 2 rows, got shape {G.shape} instead")
    _check_out_path(args.out)
    if args.center:
        G = G - G.mean(axis=0, dtype=np.float64)
    res = diameter_lmo(G, eta=args.eta, rtol=args.rtol, max_time=args.max_time)
    G64 = np.asarray(G, dtype=np.float64)
    half_sum = 0.5 * float(np.linalg.norm(G64 - G64.mean(axis=0), axis=1).sum())
    rep: dict[str, Any] = {"source": where, "shape": list(G.shape), "eta": args.eta}
    for name in ("decrease", "lower_bound", "upper_bound", "gap", "converged", "method", "iterations",
                 "rounds", "elapsed"):
        if hasattr(res, name):
            rep[name] = getattr(res, name)
    pairs = getattr(res, "pairs", None)
    if pairs is not None:
        rep["active_pairs"] = int(np.shape(pairs)[0])
    lo, hi = float(res.lower_bound), float(res.upper_bound)
    rep["rownorm_half_sum"] = half_sum
    rep["rownorm_over_exact"] = [half_sum / hi if hi > 0 else 1.0, min(1.0, half_sum / lo) if lo > 0 else 1.0]
    if args.out is not None:
        _save_npy(args.out, res.update)
        rep["saved"] = args.out
    if args.json:
        _print_json(rep)
    else:
        rows = [(k, v) for k, v in rep.items() if k != "rownorm_over_exact"]
        r = rep["rownorm_over_exact"]
        rows.append(("RowNorm / exact decrease", f"in [{r[0]:.6g}, {r[1]:.6g}]  (guaranteed >= 0.707107)"))
        _print_table(rows)
    return 0


def _cmd_tokenwise(args: argparse.Namespace) -> int:
    import numpy as np

    decompose = _require("tokenwise", "decompose", "tokenwise")
    X, wx = _load_matrix(args.x, label="X")
    Y, wy = _load_matrix(args.y, label="Y")
    if X.shape != Y.shape:
        raise CLIError(f"X and Y must have the same shape (N, d), got {X.shape} and {Y.shape} instead")
    if args.k >= X.shape[0]:
        raise CLIError(f"--k must be smaller than the number of tokens N = {X.shape[0]}, got {args.k} instead")
    kwargs: dict[str, Any] = {"k": args.k, "cls": args.cls}
    if args.rank is not None:
        kwargs["rank"] = args.rank
    if args.ridge is not None:
        kwargs["ridge"] = args.ridge
    res = decompose(X, Y, **kwargs)
    rep: dict[str, Any] = {"X": wx, "Y": wy, "N": X.shape[0], "d": X.shape[1]}
    rep.update(_tokenwise_summary(res))
    if args.json:
        _print_json(rep)
    else:
        _print_table([(k, v) for k, v in rep.items()])
    return 0


def _tokenwise_summary(res: Any) -> dict[str, Any]:
    """The result's own ``summary()``, else its scalar fields and per-token medians."""
    import numpy as np

    summary = getattr(res, "summary", None)
    if callable(summary):
        return dict(summary())
    out: dict[str, Any] = {}
    for f in dataclasses.fields(res):
        v = getattr(res, f.name)
        if isinstance(v, np.ndarray) and v.ndim == 1 and v.dtype.kind == "f":
            out[f"median_{f.name}"] = float(np.nanmedian(v))
        elif isinstance(v, (int, float, str, bool, np.generic)):
            out[f.name] = v
    return out


def _cmd_demo(args: argparse.Namespace) -> int:
    from . import _demo

    size = args.size or ("quick" if args.quick else "full")
    out = args.out
    if os.path.exists(out) and not os.path.isdir(out):
        raise CLIError(f"--out {out!r} exists and is not a directory")
    report = _demo.run_demo(out, size=size, seed=args.seed, progress=not args.no_progress)
    print(f"refgeo demo: wrote {report}", file=sys.stderr)
    return 0


# ------------------------------------------------------------------ parser

def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Update geometry for language models: Hilbert distances, certified row geometry, "
        "the diameter LMO, max-min spreading and tokenwise fits.",
        epilog="Run 'refgeo demo' for a tour on real text (no downloads). "
        "Errors print one line and exit with status 2.",
    )
    from refgeo import __version__

    parser.add_argument("--version", action="version", version=f"refgeo {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    p = sub.add_parser(
        "demo",
        help="train a small next-token LM head on Python's own documentation and write a report",
        description="Build a word-level corpus from pydoc_data.topics and standard-library docstrings, "
        "train the softmax head of a small next-token model with AdamW, RowNorm, rescaled RowNorm, "
        "the exact diameter LMO and the spreading update (where available), and write "
        "DIR/report.md with PNG plots and DIR/results.json.",
    )
    p.add_argument("--out", default="refgeo-demo", metavar="DIR", help="output directory (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="small run, about 15-30 s")
    p.add_argument("--seed", type=_int_type("--seed", 0), default=0, help="random seed (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--size", choices=("full", "quick", "tiny"), default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser(
        "inspect",
        help="row geometry of a matrix: diameter, closest pair, ratio, covering radius, bounds, h*",
        description="Certified row geometry of a (V, d) matrix stored in a .npy or .npz file.",
    )
    p.add_argument("file", metavar="FILE", help=".npy or .npz file holding a 2-D array")
    p.add_argument("--key", metavar="K", help="array name inside a .npz file")
    p.add_argument("--H", type=_float_type("--H", positive=False), default=1.0,
                   help="hidden-state norm for the worst-case h* (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser(
        "spread",
        help="max-min spreading: V points in R^d with the largest closest-pair/diameter ratio",
        description="Run the max-min spreading solver for (V, d) and report min distance, diameter, "
        "ratio and the upper bound on the ratio.",
    )
    p.add_argument("--V", type=_int_type("--V", 2), required=True, metavar="N", help="number of rows, >= 2")
    p.add_argument("--d", type=_int_type("--d", 1), required=True, metavar="D", help="dimension, >= 1")
    p.add_argument("--eta", type=_float_type("--eta"), default=1.0, help="diameter budget (default: %(default)s)")
    p.add_argument("--seed", type=_int_type("--seed", 0), default=0, help="random seed (default: %(default)s)")
    p.add_argument("--max-time", type=_float_type("--max-time"), default=10.0, metavar="SECONDS",
                   help="time limit of the solver (default: %(default)s)")
    p.add_argument("--out", metavar="FILE", help="save the points to this .npy file")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=_cmd_spread)

    p = sub.add_parser(
        "lmo",
        help="exact diameter LMO of a gradient (min-tension value, certificate, RowNorm ratio)",
        description="Solve min <G, S> subject to D(S) <= eta, 1^T S = 0 for the gradient in GRAD.",
    )
    p.add_argument("grad", metavar="GRAD.npy", help=".npy (or .npz with --key) file holding G of shape (V, d)")
    p.add_argument("--key", metavar="K", help="array name inside a .npz file")
    p.add_argument("--eta", type=_float_type("--eta"), default=1.0, help="diameter budget (default: %(default)s)")
    p.add_argument("--rtol", type=_float_type("--rtol"), default=1e-4,
                   help="certified relative gap to reach (default: %(default)s)")
    p.add_argument("--max-time", type=_float_type("--max-time"), default=60.0, metavar="SECONDS",
                   help="time limit; the best certified step so far is reported (default: %(default)s)")
    p.add_argument("--center", action="store_true",
                   help="subtract the mean row first (gradients must have rows summing to about zero)")
    p.add_argument("--out", metavar="FILE", help="save the update S to this .npy file")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=_cmd_lmo)

    p = sub.add_parser(
        "tokenwise",
        help="tokenwise decomposition y_i = A(x_i) x_i + r_i of a layer update",
        description="Fit a local linear map on the k nearest neighbours of each token and report "
        "how much of the update Y - X is tokenwise.",
    )
    p.add_argument("x", metavar="X.npy", help="hidden states before the layer, shape (N, d)")
    p.add_argument("y", metavar="Y.npy", help="hidden states after the layer, shape (N, d)")
    p.add_argument("--k", type=_int_type("--k", 1), default=16, help="neighbours per token (default: %(default)s)")
    p.add_argument("--cls", default="diagonal", metavar="CLASS",
                   help="class of local maps: diagonal, psd_diagonal, lowrank, orthogonal, scaled_orthogonal, "
                   "full or mlp (default: %(default)s)")
    p.add_argument("--rank", type=_int_type("--rank", 1), default=None, help="rank for --cls lowrank")
    p.add_argument("--ridge", type=_float_type("--ridge", positive=False), default=None,
                   help="ridge penalty lambda >= 0 (library default if omitted)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=_cmd_tokenwise)

    p = sub.add_parser("config", help="print the installation's configuration (refgeo.show_config)",
                       description="Print version, backends, BLAS/OpenMP threads and the dtype policy.")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=_cmd_config)
    return parser


def _fail(command: str | None, message: str) -> int:
    prog = f"{PROG} {command}" if command else PROG
    line = " ".join(str(message).split())  # one line, whatever the message
    print(f"{prog}: error: {line}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Run the ``refgeo`` command with ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    parser = _build_parser()
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as exc:  # --help, --version, or a usage error (already printed)
        return int(exc.code or 0) if not isinstance(exc.code, str) else 2
    if args.command is None:
        return _fail(None, "choose a command: demo, inspect, spread, lmo, tokenwise, config (see 'refgeo --help')")
    try:
        return int(args.func(args))
    except CLIError as exc:
        return _fail(args.command, str(exc))
    except (ValueError, TypeError, OSError, KeyError, RuntimeError, MemoryError) as exc:
        if os.environ.get("REFGEO_DEBUG") == "1":
            raise
        msg = str(exc) or type(exc).__name__
        if isinstance(exc, KeyError):
            msg = f"missing key {msg}"
        if isinstance(exc, MemoryError):
            msg = "out of memory"
        return _fail(args.command, msg)
    except KeyboardInterrupt:
        print(f"{PROG} {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - the CLI never shows a traceback
        if os.environ.get("REFGEO_DEBUG") == "1":
            raise
        return _fail(args.command, f"internal error ({type(exc).__name__}): {exc} (set REFGEO_DEBUG=1 for the traceback)")
