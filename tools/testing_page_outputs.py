"""Rerun the examples of docs/testing.md and show the failure reports that changed.

The page shows, after each call that fails, the report the kit printed.  Which example
hypothesis shrinks to depends on its version and on the modules loaded (it seeds its
search with constants found in them), so ``tests/test_testing_kit_docs.py`` checks only
the quantity a report names.  This script runs the page's Python blocks in order, in a
plain interpreter as the page's outputs were made, and for every shown report prints
whether the rerun gives the same text, and the new text where it does not (the
``Falsifying example`` notes are compared only where the page shows them).

Usage::

    python tools/testing_page_outputs.py [docs/testing.md]
"""

from __future__ import annotations

import pathlib
import re
import sys

from refgeo.testing import ConformanceError

FENCE = re.compile(r"^```(\w+)\n(.*?)^```\n", re.S | re.M)
PREFIX = "refgeo.testing.ConformanceError: "


def main(page: pathlib.Path) -> int:
    text = page.read_text()
    blocks = [(m.group(1), m.group(2), text[: m.start()].count("\n") + 1) for m in FENCE.finditer(text)]
    namespace: dict = {}
    changed = 0
    for k, (lang, code, line) in enumerate(blocks):
        if lang != "python":
            continue
        shown = blocks[k + 1][1] if k + 1 < len(blocks) and blocks[k + 1][0] == "text" else ""
        got = None
        try:
            exec(compile(code, f"{page.name}, line {line}", "exec"), namespace)
        except ConformanceError as exc:
            got = PREFIX + str(exc)
            if "Falsifying example" in shown:
                got += "\n" + "\n".join(getattr(exc, "__notes__", []))
        if not shown.startswith(PREFIX):
            continue
        same = got is not None and got.strip() == shown.strip()
        print(f"line {line}: {'same' if same else 'CHANGED'}")
        if not same:
            changed += 1
            print(got if got is not None else "(no report: the call passed)")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main(pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "docs/testing.md")))
