"""The docs page "Testing your implementation against refgeo" shows real output.

Runs the page's Python blocks in order, in one namespace, under the page's derandomised
profile.  A block followed by a ``text`` block that starts with
``refgeo.testing.ConformanceError:`` must raise exactly that report (compared line by line
with hypothesis's version that produced the page; with another version only the quantity
and the kind of failure are compared, since shrinking may end elsewhere).  Other blocks
must run without error.
"""

from __future__ import annotations

import os
import pathlib
import re

import hypothesis
import pytest
from hypothesis import settings

from refgeo.testing import ConformanceError

PAGE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "testing.md"
# hypothesis version that produced the outputs on the page
PAGE_HYPOTHESIS = "6.155.2"
FENCE = re.compile(r"^```(\w+)\n(.*?)^```\n", re.S | re.M)
PREFIX = "refgeo.testing.ConformanceError: "


def _blocks():
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(PAGE.read_text())]


def _header(text: str) -> str:
    """'for 'name': <kind of failure>' without the numbers."""
    first = text.splitlines()[0]
    return re.split(r"[-\d]", first, maxsplit=1)[0]


@pytest.mark.skipif(not PAGE.exists(), reason="docs/testing.md is not in this checkout")
def test_docs_page_examples_produce_the_shown_output():
    blocks = _blocks()
    namespace: dict = {}
    checked = 0
    try:
        for k, (lang, code) in enumerate(blocks):
            if lang != "python" or "import torch" in code:
                continue
            shown = blocks[k + 1][1] if k + 1 < len(blocks) and blocks[k + 1][0] == "text" else ""
            if shown.startswith(PREFIX):
                with pytest.raises(ConformanceError) as info:
                    exec(compile(code, f"{PAGE.name}[block {k}]", "exec"), namespace)
                expected = shown[len(PREFIX):].split("\nFalsifying example")[0].rstrip("\n")
                got = str(info.value)
                if hypothesis.__version__ == PAGE_HYPOTHESIS:
                    assert got == expected, f"block {k}: the page shows\n{expected}\nbut the run gave\n{got}"
                else:
                    assert _header(got) == _header(expected)
                checked += 1
            else:
                exec(compile(code, f"{PAGE.name}[block {k}]", "exec"), namespace)
    finally:
        settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
    assert checked >= 5
