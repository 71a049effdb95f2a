"""The docs page "Testing your implementation against refgeo" runs as shown.

Runs the page's Python blocks in order, in one namespace, under the page's derandomized
profile.  A block followed by a ``text`` block that starts with
``refgeo.testing.ConformanceError:`` must raise a report for the same quantity; other blocks
must run without error; a block followed by a ``text`` block that starts with
``<quantity>: the candidate agrees`` must print it.  Blocks that use torch run when torch is
installed and are skipped otherwise.  The exact failing example is not compared: hypothesis seeds its search with
literal constants found in the modules loaded at the time (the page's outputs were
obtained in a plain interpreter; under pytest other modules are loaded), so the shrunk
example can differ between the two: ``python tools/testing_page_outputs.py`` reruns the
page in a plain interpreter and shows the reports that changed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import pathlib
import re

import hypothesis
import pytest
from hypothesis import settings

from refgeo.testing import ConformanceError
from refgeo.testing import strategies as rst

PAGE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "testing.md"
FENCE = re.compile(r"^```(\w+)\n(.*?)^```\n", re.S | re.M)
PREFIX = "refgeo.testing.ConformanceError: "
PASSED = re.compile(r"^\w+: the candidate agrees with refgeo's reference")
HAS_TORCH = importlib.util.find_spec("torch") is not None
# The page's failure reports come from one version of hypothesis; another version, or
# the same one in another process (the examples it shrinks to vary with what ran
# before), may report other inputs.  Under that version the kind of failure must be the
# page's and (for NumPy kernels) the scenario the page's or an earlier one (the reports
# once drifted to other scenarios unnoticed; see _not_later).
_PAGE_HYPOTHESIS = re.search(r"with hypothesis (\d+\.\d+)", PAGE.read_text()) if PAGE.exists() else None
SAME_HYPOTHESIS = bool(_PAGE_HYPOTHESIS) and hypothesis.__version__.startswith(_PAGE_HYPOTHESIS.group(1) + ".")
_KIND = re.compile(r"reference for '\w+': (wrong tie-breaking|the value|[^:.]+)")
_SCENARIO = re.compile(r"^  scenario:  (\w+)", re.M)


def _what_failed(text: str) -> tuple:
    """(kind of failure, scenario or None) of a report."""
    kind, scenario = _KIND.search(text), _SCENARIO.search(text)
    return (kind.group(1) if kind else text.splitlines()[0], scenario.group(1) if scenario else None)


def _not_later(got, shown, quantity) -> bool:
    """Whether the scenario ``got`` is ``shown`` or runs before it.  Scenarios run in
    order and the first failure is reported; an earlier one that finds the defect in
    one environment and not in another (the examples drawn depend on the modules
    loaded: under the whole suite the float32 Gram kernel of the page failed on exact
    duplicates, in a plain interpreter on near duplicates, the next scenario) is not a
    drift; a later one would be (a scenario that stopped finding it).  The order is the
    quantity's: "integers" is a structure of rows and of logits."""
    if got == shown:
        return True
    order = {"hilbert_distance_logits": rst.LOGIT_STRUCTURES, "pdist_hilbert": rst.LOGIT_STRUCTURES,
             "cdist_hilbert": rst.LOGIT_STRUCTURES, "hilbert_distance": rst.SUPPORTS,
             "projected_rownorm": rst.GRADIENT_STRUCTURES}.get(quantity, rst.ROW_STRUCTURES)
    return got in order and shown in order and order.index(got) < order.index(shown)


def _blocks():
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(PAGE.read_text())]


def _quantity(text: str) -> str:
    """The quantity named in the first line of a report."""
    return re.match(r"candidate disagrees with refgeo's reference for '(\w+)'", text).group(1)


@pytest.mark.skipif(not PAGE.exists(), reason="docs/testing.md is not in this checkout")
def test_docs_page_examples_produce_the_shown_output():
    blocks = _blocks()
    namespace: dict = {}
    checked = 0
    try:
        for k, (lang, code) in enumerate(blocks):
            if lang != "python" or ("torch" in code and not HAS_TORCH):
                continue
            shown = blocks[k + 1][1] if k + 1 < len(blocks) and blocks[k + 1][0] == "text" else ""
            if shown.startswith(PREFIX):
                with pytest.raises(ConformanceError) as info:
                    exec(compile(code, f"{PAGE.name}[block {k}]", "exec"), namespace)
                expected = shown[len(PREFIX):]
                assert _quantity(str(info.value)) == _quantity(expected), f"block {k}"
                if SAME_HYPOTHESIS:
                    got, shown_kind = _what_failed(str(info.value)), _what_failed(expected)
                    assert got[0] == shown_kind[0], f"block {k}"
                    if "torch" not in code:  # torch's kernels round by its thread count: the scenario may vary
                        assert _not_later(got[1], shown_kind[1], _quantity(expected)), f"block {k}: {got} after {shown_kind}"
                checked += 1
            elif PASSED.match(shown):
                out = io.StringIO()
                with contextlib.redirect_stdout(out):
                    exec(compile(code, f"{PAGE.name}[block {k}]", "exec"), namespace)
                assert out.getvalue().strip() == shown.strip(), f"block {k}"
            else:
                exec(compile(code, f"{PAGE.name}[block {k}]", "exec"), namespace)
    finally:
        settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
    assert checked >= 5
