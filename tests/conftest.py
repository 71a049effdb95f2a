"""Shared fixtures: hypothesis profiles, the backend and dtype fixtures."""

from __future__ import annotations

import contextlib
import dataclasses
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

import refgeo
from refgeo import _backend

# Profiles (HYPOTHESIS_PROFILE): "ci" is derandomized so CI failures reproduce
# ("ci-rerun", below, is it with fewer examples); "nightly" explores more and keeps a
# database; "dev" is quick.
settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
# "ci-rerun": the ci profile with a quarter of the examples, for CI's second pass over
# the same tests (the reference backend), which checks the code in another configuration
# after the first pass explored it with 100 examples a test (the pass cost about 9
# minutes of the 2 cores with 100).
settings.register_profile(
    "ci-rerun",
    parent=settings.get_profile("ci"),
    max_examples=25,
)
# "ci-smoke": a few examples a test, for the suite against the installed wheel, which
# checks the packaging (the compiled extension, data files, imports outside the
# checkout), not the mathematics the first two passes explored.
settings.register_profile(
    "ci-smoke",
    parent=settings.get_profile("ci"),
    max_examples=5,
)
settings.register_profile(
    "nightly",
    max_examples=2000,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "dev", max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

REQUIRE_EXT = os.environ.get("REFGEO_REQUIRE_EXT", "") == "1"


def _backend_params():
    return [
        pytest.param("reference", id="reference"),
        pytest.param("cython", id="cython"),
        pytest.param("cupy", id="cupy", marks=pytest.mark.gpu),
    ]


@contextlib.contextmanager
def numpy_inputs_on_the_device(to_device, to_host):
    """Under ``use_backend("cupy")``, run the kernels of NumPy inputs as CuPy inputs.

    The tests are written with NumPy inputs and expectations, and ``use_backend("cupy")``
    alone refuses NumPy arrays.  Here the backend selection sees the arrays a CuPy caller
    would hand over: a kernel with GPU code (``KernelInfo.cupy``) runs on
    ``to_device`` copies of its array arguments (the public function has validated and
    prescaled them on the host), and the arrays of its result come back through
    ``to_host``; a kernel without GPU code runs the reference, as a CuPy input would.
    Every other request (a nested ``use_backend("reference")``, Dask inputs) is
    selected as usual.  The public path of real CuPy arrays and CUDA tensors
    (validation, prescaling and results on the device) has tests of its own.
    """
    select = _backend.select

    def on_device(kernel):
        def run(*args, **kwargs):
            moved = [to_device(a) if isinstance(a, np.ndarray) else a for a in args]
            out = kernel(*moved, **kwargs)
            return dataclasses.replace(
                out, **{f: to_host(getattr(out, f)) for f in ("indices", "distances") if getattr(out, f) is not None}
            )

        return run

    def select_on_device(info, *arrays):
        given = [a for a in arrays if a is not None]
        if _backend.get_backend() != "cupy" or not given or not all(isinstance(a, np.ndarray) for a in given):
            return select(info, *arrays)
        if info.cupy is None:
            return _backend.Selection("reference", info.reference, f"CuPy input; {info.name} has no GPU code")
        return _backend.Selection("cupy", on_device(info.cupy), "CuPy input (NumPy input moved by the test)")

    _backend.select = select_on_device
    try:
        yield
    finally:
        _backend.select = select


def pytest_collection_modifyitems(config, items):
    """Mark the tests that use the ``backend`` fixture ``backends``: they select each
    backend themselves, so REFGEO_BACKEND does not change them, and a run on another
    default backend can leave them out (``-m "not slow and not backends"``, as CI's run on
    the reference backend does: it repeated them test for test)."""
    for item in items:
        if "backend" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.backends)


@pytest.fixture(params=_backend_params())
def backend(request):
    """Run the test on one backend; an unavailable backend skips (fails with REFGEO_REQUIRE_EXT=1
    for cython).  On ``cupy`` the kernels of the test's NumPy inputs run on the GPU
    (:func:`numpy_inputs_on_the_device`)."""
    name = request.param
    ok, why = _backend.available_backends()[name]
    if not ok:
        if name == "cython" and REQUIRE_EXT:
            pytest.fail(f"REFGEO_REQUIRE_EXT=1 but the cython backend is unavailable: {why}")
        pytest.skip(f"backend {name!r} unavailable: {why}")
    with refgeo.use_backend(name), contextlib.ExitStack() as stack:
        if name == "cupy":
            import cupy

            stack.enter_context(numpy_inputs_on_the_device(cupy.asarray, cupy.asnumpy))
        yield name


@pytest.fixture
def xp_for_backend(backend):
    """Array namespace that feeds ``backend`` (CuPy for cupy, NumPy otherwise)."""
    if backend == "cupy":
        import cupy

        return cupy
    return np


@pytest.fixture(params=[np.float64, np.float32], ids=["float64", "float32"])
def dtype(request):
    return request.param


@pytest.fixture
def rng():
    return np.random.default_rng(12345)
