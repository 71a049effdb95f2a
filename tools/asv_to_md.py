"""Write docs/benchmarks.md from one asv results file (refgeo's benchmark page).

Usage (after an ``asv run --python=same --set-commit-hash HASH`` into RESULTS_DIR)::

    python tools/asv_to_md.py RESULTS_DIR --out docs/benchmarks.md \
        --command "the asv command that produced the results" [--note "..."]

The page records the machine (CPU model, cores, memory, OS), the software (Python, NumPy,
SciPy, refgeo commit), the BLAS/OpenMP libraries and thread counts (the ``runtime``
parameter every refgeo benchmark carries) and one table per benchmark class.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import glob
import itertools
import json
import os
import platform
import sys


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _fmt(value, unit: str) -> str:
    if value is None:
        return "failed"
    if isinstance(value, float) and value != value:
        return "n/a (skipped)"
    if unit == "seconds":
        for scale, name in ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs")):
            if value >= scale:
                return f"{value / scale:.3g} {name}"
        return f"{value * 1e9:.3g} ns"
    if unit == "bytes":
        return f"{value / 2**20:.1f} MiB"
    if isinstance(value, float):
        text = f"{value:.4g}"
    else:
        text = str(value)
    return f"{text} {unit}".strip() if unit and unit != "unit" else text


def _unquote(p: str) -> str:
    try:
        v = ast.literal_eval(p)
    except (ValueError, SyntaxError):
        return p
    return v if isinstance(v, str) else p


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results_dir")
    ap.add_argument("--out", required=True)
    ap.add_argument("--command", required=True, help="the command that produced the results")
    ap.add_argument("--note", default="", help="extra paragraph (e.g. machine sharing)")
    ap.add_argument("--sizes", choices=("small", "realistic"), default="small",
                    help="which benchmark sizes the results are for (REFGEO_BENCH_SIZE of the run)")
    args = ap.parse_args(argv)

    with open(os.path.join(args.results_dir, "benchmarks.json")) as f:
        benchmarks = json.load(f)
    files = sorted(glob.glob(os.path.join(args.results_dir, "*", "*.json")))
    files = [p for p in files if not p.endswith("machine.json")]
    if not files:
        print("no results found", file=sys.stderr)
        return 1
    path = max(files, key=os.path.getmtime)
    with open(path) as f:
        res = json.load(f)
    with open(os.path.join(os.path.dirname(path), "machine.json")) as f:
        machine = json.load(f)
    cols = res["result_columns"]

    import numpy
    import scipy

    import refgeo

    runtimes = set()
    sections: dict[str, list[str]] = {}
    for name in sorted(res["results"]):
        entry = dict(zip(cols, res["results"][name]))
        meta = benchmarks.get(name, {})
        unit = meta.get("unit", "")
        pnames = meta.get("param_names", [])
        params = entry.get("params") or []
        values = entry.get("result")
        if values is None:
            values = [None]
        combos = list(itertools.product(*params)) if params else [()]
        keep = [i for i, n in enumerate(pnames) if n != "runtime"]
        for combo in combos:
            if "runtime" in pnames:
                runtimes.add(_unquote(combo[pnames.index("runtime")]))
        module_class, _, method = name.rpartition(".")
        lines = sections.setdefault(module_class, [])
        if not lines:
            header = [pnames[i] for i in keep]
            lines.append("| benchmark | " + " | ".join(header) + " | value |")
            lines.append("|---|" + "---|" * len(header) + "---|")
        for combo, value in zip(combos, values):
            cells = [f"`{_unquote(combo[i])}`" if "'" not in str(_unquote(combo[i])) else str(combo[i])
                     for i in keep]
            lines.append(f"| `{method}` | " + " | ".join(cells) + f" | {_fmt(value, unit)} |")

    when = datetime.datetime.fromtimestamp(res["date"] / 1000, tz=datetime.timezone.utc)
    ram_gib = int(machine.get("ram", 0) or 0) / 2**30
    out = [
        "# Benchmarks",
        "",
        "Numbers from one run of refgeo's [asv](https://asv.readthedocs.io) benchmarks "
        + ("(`asv_benchmarks/`) at the small (CI) sizes. Realistic sizes are run by hand with "
           "`REFGEO_BENCH_SIZE=realistic`. " if args.sizes == "small" else
           "(`asv_benchmarks/`) at the realistic (acceptance) sizes, `REFGEO_BENCH_SIZE=realistic`. ")
        + "`track_speedup_vs_*` are speed ratios against a "
        "baseline measured in the same process (higher is better); `track_*` quality "
        "numbers are described in each benchmark's docstring.",
        "",
        "## Machine and software",
        "",
        f"- **Date**: {when:%Y-%m-%d %H:%M} UTC; refgeo commit `{res['commit_hash'][:10]}` "
        f"(version {refgeo.__version__}).",
        f"- **CPU**: {_cpu_model()}, {machine.get('num_cpu')} cores available; "
        f"{ram_gib:.0f} GiB RAM; {machine.get('os')} ({machine.get('arch')}).",
        f"- **Python** {platform.python_version()}, NumPy {numpy.__version__}, "
        f"SciPy {scipy.__version__}.",
        "- **BLAS / OpenMP and threads** (the `runtime` parameter of every result): "
        + "; ".join(f"`{r}`" for r in sorted(runtimes)) + ".",
        f"- **Command**: `{args.command}`",
    ]
    if args.note:
        out += ["", args.note]
    for module_class, lines in sections.items():
        out += ["", f"## `{module_class}`", ""] + lines
    out.append("")
    with open(args.out, "w") as f:
        f.write("\n".join(out))
    print(f"wrote {args.out} ({len(res['results'])} benchmarks)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
