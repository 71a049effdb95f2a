#!/usr/bin/env python
"""Check the output of ``refgeo demo``: the report, its plots, and that every number is finite.

Usage::

    python tools/check_demo_report.py DIR

Checks (exit status 0 when all pass, 1 otherwise, one line per problem):

* ``DIR/report.md`` exists and has the six numbered sections;
* every image it links (``![...](file.png)``) exists, is a PNG of at least 200 x 150
  pixels, and ``loss.png`` is among them;
* no number in the report is NaN or infinite (no ``nan``/``inf`` word anywhere);
* ``DIR/results.json`` parses with no NaN/Infinity constants, and every number in it
  is finite.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import sys

SECTIONS = (
    "## 1. Loss curves",
    "## 2. Step geometry",
    "## 3. Diameter LMO",
    "## 4. Geometry of the final head",
    "## 5. Tokenwise decomposition",
    "## 6. Timings",
)
_IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")
_NONFINITE = re.compile(r"(?<![A-Za-z])[+-]?(nan|inf|infinity)(?![A-Za-z])", re.IGNORECASE)
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_size(path: str) -> tuple[int, int] | None:
    with open(path, "rb") as fh:
        head = fh.read(24)
    if len(head) < 24 or head[:8] != _PNG_SIGNATURE or head[12:16] != b"IHDR":
        return None
    return struct.unpack(">II", head[16:24])


def _walk_numbers(x, where: str, problems: list[str]) -> int:
    if isinstance(x, bool) or x is None or isinstance(x, str):
        return 0
    if isinstance(x, (int, float)):
        if not math.isfinite(x):
            problems.append(f"results.json: non-finite number {x!r} at {where}")
        return 1
    if isinstance(x, dict):
        return sum(_walk_numbers(v, f"{where}.{k}", problems) for k, v in x.items())
    if isinstance(x, list):
        return sum(_walk_numbers(v, f"{where}[{i}]", problems) for i, v in enumerate(x))
    return 0


def _reject_constant(name: str):
    raise ValueError(f"non-finite constant {name}")


def check(out_dir: str) -> list[str]:
    """Return the list of problems found in a demo output directory (empty: all good)."""
    problems: list[str] = []
    report = os.path.join(out_dir, "report.md")
    if not os.path.isfile(report):
        return [f"{report} does not exist"]
    with open(report, encoding="utf-8") as fh:
        text = fh.read()
    for s in SECTIONS:
        if s not in text:
            problems.append(f"report.md: section {s!r} is missing")
    images = _IMAGE.findall(text)
    if "loss.png" not in images:
        problems.append("report.md: the loss plot (loss.png) is not linked")
    for name in images:
        path = os.path.join(out_dir, name)
        if not os.path.isfile(path):
            problems.append(f"report.md links {name}, which does not exist")
            continue
        size = _png_size(path)
        if size is None:
            problems.append(f"{name} is not a PNG file")
        elif size[0] < 200 or size[1] < 150:
            problems.append(f"{name} is only {size[0]} x {size[1]} pixels")
    for lineno, line in enumerate(text.splitlines(), 1):
        m = _NONFINITE.search(line)
        if m:
            problems.append(f"report.md:{lineno}: non-finite value {m.group(0)!r}: {line.strip()[:120]}")
    results = os.path.join(out_dir, "results.json")
    if not os.path.isfile(results):
        problems.append(f"{results} does not exist")
    else:
        try:
            with open(results, encoding="utf-8") as fh:
                data = json.load(fh, parse_constant=_reject_constant)
        except ValueError as exc:
            problems.append(f"results.json: {exc}")
        else:
            if _walk_numbers(data, "$", problems) == 0:
                problems.append("results.json holds no numbers")
    return problems


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: check_demo_report.py DIR", file=sys.stderr)
        return 2
    problems = check(args[0])
    for p in problems:
        print(f"check_demo_report: {p}", file=sys.stderr)
    if problems:
        return 1
    with open(os.path.join(args[0], "report.md"), encoding="utf-8") as fh:
        n_img = len(_IMAGE.findall(fh.read()))
    print(f"check_demo_report: OK ({args[0]}: report.md, {n_img} plots, all numbers finite)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
