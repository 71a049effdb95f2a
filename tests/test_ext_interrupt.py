"""Ctrl-C stops every compiled tiled kernel promptly with ``KeyboardInterrupt``.

Each case starts a call that runs well over 10 s in a child process, sends SIGINT 1 s
into the kernel and requires the child to exit within 2 s with ``KeyboardInterrupt``
in its output.  The compiled tile driver polls the signal from the calling thread
between tiles and stops the OpenMP team; without that, the call runs to its end.
"""

from __future__ import annotations

import os
import sys
import textwrap

import pytest

from refgeo import _backend

from ._interrupt import interrupt

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform == "win32", reason="SIGINT to a child needs POSIX"),
    pytest.mark.skipif(
        not _backend.available_backends()["cython"][0], reason="the compiled extension is not built"
    ),
]

# Sizes: each call takes well over 10 s on two threads (n_threads=2 bounds the speed on
# bigger machines too), and the inputs stay below ~600 MB.  Uniform float32 data is
# cheap to draw; the kernels' work does not depend on it.
CASES = {
    "row_diameter": ("S = rng.random((40000, 1024), dtype=np.float32)", "refgeo.row_diameter(S, n_threads=2)"),
    "closest_pair": ("S = rng.random((40000, 1024), dtype=np.float32)", "refgeo.closest_pair(S, n_threads=2)"),
    "farthest_partners": (
        "S = rng.random((40000, 1024), dtype=np.float32)",
        "refgeo.farthest_partners(S, n_threads=2)",
    ),
    "knn": ("X = rng.random((60000, 768), dtype=np.float32)", "refgeo.knn(X, 32, n_threads=2)"),
    "pdist_hilbert": (
        "Z = rng.random((6000, 16384), dtype=np.float32)",
        "refgeo.pdist_hilbert(Z, n_threads=2)",
    ),
    "cdist_hilbert": (
        "A = rng.random((4000, 16384), dtype=np.float32)\n"
        "B = rng.random((4000, 16384), dtype=np.float32)",
        "refgeo.cdist_hilbert(A, B, n_threads=2)",
    ),
}

CHILD = """
import time
import numpy as np
import refgeo
rng = np.random.default_rng(0)
{setup}
print("ready", flush=True)
t0 = time.perf_counter()
{call}
print(f"finished normally after {{time.perf_counter() - t0:.1f}} s", flush=True)
"""


@pytest.mark.parametrize("name", sorted(CASES))
def test_sigint_stops_the_kernel(name):
    setup, call = CASES[name]
    code = textwrap.dedent(CHILD.format(setup=setup, call=call))
    run = interrupt(code, env=dict(os.environ, REFGEO_BACKEND="cython", PYTHONUNBUFFERED="1"))
    assert "finished normally" not in run.out, f"{name} ignored SIGINT:\n{run.out}"
    assert "KeyboardInterrupt" in run.err, run.err
    assert run.returncode != 0
    assert run.seconds < 2.0, f"{name}: exit took {run.seconds:.2f} s after SIGINT"
