"""Shared fixtures: hypothesis profiles, the backend and dtype fixtures."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

import refgeo
from refgeo import _backend

# Profiles (HYPOTHESIS_PROFILE): "ci" is derandomized so CI failures reproduce;
# "nightly" explores more and keeps a database; "dev" is quick.
settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
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


@pytest.fixture(params=_backend_params())
def backend(request):
    """Run the test on one backend; an unavailable backend skips (fails with REFGEO_REQUIRE_EXT=1
    for cython)."""
    name = request.param
    ok, why = _backend.available_backends()[name]
    if not ok:
        if name == "cython" and REQUIRE_EXT:
            pytest.fail(f"REFGEO_REQUIRE_EXT=1 but the cython backend is unavailable: {why}")
        pytest.skip(f"backend {name!r} unavailable: {why}")
    with refgeo.use_backend(name):
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
