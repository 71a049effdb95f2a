"""Backend selection, use_backend, REFGEO_BACKEND, REFGEO_REQUIRE_EXT, show_config, and
the backend each pairwise result reports."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import refgeo
from refgeo import _backend


def _run(code, **env):
    full = {k: v for k, v in os.environ.items() if not k.startswith("REFGEO_")}
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=120)


def _probe_info():
    calls = []

    def make(name):
        def fn(*a, **k):
            calls.append(name)
            return name

        return fn

    info = _backend.KernelInfo(name="probe", reference=make("reference"), cython=make("cython"))
    return info, calls


def test_use_backend_context_selects_and_restores():
    info, _ = _probe_info()
    X = np.zeros((2, 2))
    with refgeo.use_backend("reference"):
        assert _backend.dispatch(info, X)[0] == "reference"
        assert refgeo.get_backend() == "reference"
    assert refgeo.get_backend() in ("auto", os.environ.get("REFGEO_BACKEND", "auto"))


def test_auto_prefers_cython_when_built():
    pytest.importorskip("refgeo_ext")
    info, _ = _probe_info()
    with refgeo.use_backend("auto"):
        assert _backend.dispatch(info, np.zeros((2, 2)))[0] == "cython"
    # a kernel without a compiled path falls back to the reference
    plain = _backend.KernelInfo(name="plain", reference=lambda: None)
    with refgeo.use_backend("auto"):
        assert _backend.dispatch(plain, np.zeros(2))[0] == "reference"


def test_env_variable_is_read_and_context_wins(monkeypatch):
    info, _ = _probe_info()
    monkeypatch.setenv("REFGEO_BACKEND", "reference")
    assert refgeo.get_backend() == "reference"
    assert _backend.dispatch(info, np.zeros(2))[0] == "reference"
    if _backend.extension() is not None:
        with refgeo.use_backend("cython"):
            assert _backend.dispatch(info, np.zeros(2))[0] == "cython"
    monkeypatch.setenv("REFGEO_BACKEND", "fastest")
    with pytest.raises(ValueError, match=re.escape("the REFGEO_BACKEND environment variable must be one of")):
        refgeo.get_backend()


def test_bad_backend_names():
    with pytest.raises(ValueError, match=re.escape("backend name must be one of ('auto', 'reference', 'cython', 'cupy'), got 'numba' instead.")):
        with refgeo.use_backend("numba"):
            pass


def test_cupy_backend_needs_cupy_arrays():
    info, _ = _probe_info()
    with refgeo.use_backend("cupy"):
        with pytest.raises(ValueError, match="backend 'cupy' needs CuPy arrays, got ndarray instead"):
            _backend.dispatch(info, np.zeros(2))


def test_array_api_strict_runs_the_reference():
    xps = pytest.importorskip("array_api_strict")
    info, _ = _probe_info()
    a = xps.asarray([[0.0, 1.0], [2.0, 0.5]])
    assert _backend.dispatch(info, a)[0] == "reference"
    if _backend.extension() is not None:
        with refgeo.use_backend("cython"):
            with pytest.raises(ValueError, match="only 'reference' is array-API generic"):
                _backend.dispatch(info, a)


def test_rows_of_two_array_kinds_are_a_type_error():
    xps = pytest.importorskip("array_api_strict")
    X = xps.asarray([[0.0, 1.0], [2.0, 0.5], [1.0, 1.0]])
    with pytest.raises(TypeError, match=r"^X and Y must be arrays of one kind, got array_api_strict\..* and numpy"):
        refgeo.knn(X, 1, np.ones((2, 2)))


def test_hilbert_arguments_of_two_array_kinds_are_a_type_error():
    """array_api_compat's "Multiple namespaces" TypeError named neither argument."""
    xps = pytest.importorskip("array_api_strict")
    X = xps.asarray([[0.0, 1.0], [2.0, 0.5]])
    calls = [
        (lambda: refgeo.cdist_hilbert(X, np.ones((2, 2))), "XA and XB"),
        (lambda: refgeo.hilbert_distance_logits(np.ones(2), X[0, :]), "z and w"),
        (lambda: refgeo.funk_distance_logits(X[0, :], [0.0, 1.0]), "z and w"),  # a list becomes NumPy
        (lambda: refgeo.hilbert_distance(X[0, :] * 0.0 + 0.5, np.full(2, 0.5)), "p and q"),
    ]
    for call, names in calls:
        with pytest.raises(TypeError, match=rf"^{names} must be arrays of one kind, got "):
            call()
    assert float(refgeo.hilbert_distance_logits(X[0, :], X[1, :])) == 2.5  # one kind: fine


def test_reference_code_runs_unchanged_on_array_api_strict():
    xps = pytest.importorskip("array_api_strict")
    rng = np.random.default_rng(0)
    Z = rng.standard_normal((5, 7))
    P = rng.dirichlet(np.ones(7), size=2)
    Zs, Ps = xps.asarray(Z), xps.asarray(P)
    checks = [
        (refgeo.variation(Zs), refgeo.variation(Z)),
        (refgeo.hilbert_distance_logits(Zs[0, :], Zs[1, :]), refgeo.hilbert_distance_logits(Z[0], Z[1])),
        (refgeo.hilbert_distance(Ps[0, :], Ps[1, :]), refgeo.hilbert_distance(P[0], P[1])),
        (refgeo.funk_distance(Ps[0, :], Ps[1, :]), refgeo.funk_distance(P[0], P[1])),
        (refgeo.funk_distance_logits(Zs[0, :], Zs[1, :]), refgeo.funk_distance_logits(Z[0], Z[1])),
        (refgeo.pdist_hilbert(Zs), refgeo.pdist_hilbert(Z)),
        (refgeo.cdist_hilbert(Zs[:2, :], Zs), refgeo.cdist_hilbert(Z[:2], Z)),
        (refgeo.pdist_hilbert(Ps, kind="probabilities"), refgeo.pdist_hilbert(P, kind="probabilities")),
        (refgeo.tv_bound(xps.asarray([0.5, 1.0])), refgeo.tv_bound(np.array([0.5, 1.0]))),
    ]
    for strict_result, numpy_result in checks:
        assert type(strict_result).__module__.startswith("array_api_strict")
        np.testing.assert_allclose(np.asarray(strict_result), numpy_result, rtol=1e-13, atol=1e-13)


def test_require_ext_turns_missing_extension_into_import_error():
    # Hide refgeo_ext with a meta-path blocker, then import refgeo with REFGEO_REQUIRE_EXT=1.
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'refgeo_ext' or name.startswith('refgeo_ext.'):\n"
        "            raise ImportError('blocked for the test')\n"
        "sys.meta_path.insert(0, Block())\n"
        "try:\n"
        "    import refgeo\n"
        "except ImportError as e:\n"
        "    print('IMPORTERROR', type(e).__name__, e)\n"
        "else:\n"
        "    print('IMPORTED', refgeo.show_config(mode='dicts')['backends']['cython']['available'])\n"
    )
    strict = _run(code, REFGEO_REQUIRE_EXT="1")
    assert "IMPORTERROR ExtensionUnavailableError REFGEO_REQUIRE_EXT=1" in strict.stdout, strict.stderr
    lax = _run(code)
    assert "IMPORTED False" in lax.stdout, lax.stderr


def test_fallback_without_extension_still_computes():
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'refgeo_ext': raise ImportError('blocked')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import numpy as np, refgeo\n"
        "print(refgeo.pdist_hilbert(np.array([[0., 1.], [1., 0.]])))\n"
        "S = np.random.default_rng(0).standard_normal((20, 3))\n"
        "rs = [refgeo.row_diameter(S), refgeo.closest_pair(S), refgeo.farthest_partners(S), refgeo.knn(S, 2)]\n"
        "print('BACKENDS', sorted({r.backend for r in rs}))\n"
        "try:\n"
        "    refgeo.use_backend('cython').__enter__()\n"
        "except refgeo.ExtensionUnavailableError as e:\n"
        "    print('NOCYTHON')\n"
    )
    out = _run(code)
    assert "[2.]" in out.stdout and "NOCYTHON" in out.stdout, out.stderr
    assert "BACKENDS ['reference']" in out.stdout, out.stderr


def test_show_config_reports_backends(capsys):
    refgeo.show_config()
    text = capsys.readouterr().out
    assert f"refgeo {refgeo.__version__}" in text
    for name in ("reference", "cython", "cupy"):
        assert re.search(rf"^\s+{name}\s+(available|unavailable)", text, re.M)
    assert "openmp: compiled=" in text and "thread pools" in text
    cfg = refgeo.show_config(mode="dicts")
    assert cfg["backends"]["cython"]["available"] == (_backend.extension() is not None)
    with pytest.raises(ValueError, match="mode must be one of"):
        refgeo.show_config(mode="json")


def test_show_config_reports_torch_dispatch():
    from importlib.metadata import PackageNotFoundError, version

    try:
        want = version("torch")
    except PackageNotFoundError:
        want = None
    tv = refgeo.show_config(mode="dicts")["torch"]
    assert tv["version"] == want
    cython_ok = _backend.available_backends()["cython"][0]
    runs_cython = cython_ok and refgeo.get_backend() in ("auto", "cython")
    assert tv["cpu_tensors"].startswith("cython" if runs_cython else "reference")


def test_cython_backend_reported_available_when_required():
    if os.environ.get("REFGEO_REQUIRE_EXT") != "1":
        pytest.skip("only meaningful when the build is required (REFGEO_REQUIRE_EXT=1)")
    assert refgeo.show_config(mode="dicts")["backends"]["cython"]["available"]


def test_subnormals_survive_import():
    # A library compiled with fast-math flags sets flush-to-zero at load time; ours must not.
    code = (
        "import numpy as np\n"
        "import refgeo, refgeo_ext\n"
        "x = np.float64(5e-324)\n"
        "t = np.finfo(np.float64).smallest_normal / 4\n"
        "print(x > 0, (t * 2) > 0, np.float32(1e-45) > 0)\n"
    )
    out = _run(code)
    assert out.stdout.strip() == "True True True", out.stderr


def test_square_form_on_array_api_strict():
    xps = pytest.importorskip("array_api_strict")
    Z = np.random.default_rng(5).standard_normal((4, 6))
    got = refgeo.pdist_hilbert(xps.asarray(Z), form="square")
    np.testing.assert_array_equal(np.asarray(got), refgeo.pdist_hilbert(Z, form="square"))


# ------------------------------------------------------------------ the backend that ran


def _engine_calls(S):
    """The four pairwise engine functions on S: name -> result."""
    return {
        "row_diameter": refgeo.row_diameter(S),
        "closest_pair": refgeo.closest_pair(S),
        "farthest_partners": refgeo.farthest_partners(S),
        "knn": refgeo.knn(S, 2),
    }


def test_results_report_the_backend_bound_and_refined_count(backend):
    rng = np.random.default_rng(1)
    S = rng.standard_normal((60, 5))
    for name, r in _engine_calls(S).items():
        assert r.backend == backend, name
        assert r.dtype == "float64" and r.n_refined >= 1, name
        if backend == "reference":
            assert r.error_bound == 0.0, name
        else:  # the filter ran: a positive a-priori bound
            assert 0.0 < r.error_bound < 1e-10, name
    r = refgeo.knn(S.astype(np.float32), 2)
    assert r.dtype == "float32"


def test_each_engine_function_reports_its_fallback(monkeypatch):
    """Without the extension, auto falls back to the reference and says so; with
    REFGEO_REQUIRE_EXT=1 the same call raises instead."""
    monkeypatch.delenv("REFGEO_BACKEND", raising=False)
    monkeypatch.delenv("REFGEO_REQUIRE_EXT", raising=False)
    monkeypatch.setattr(_backend, "_ext", None)
    monkeypatch.setattr(_backend, "_ext_error", "refgeo_ext hidden for the test")
    S = np.random.default_rng(2).standard_normal((30, 4))
    with refgeo.use_backend("auto"):
        for name, r in _engine_calls(S).items():
            assert r.backend == "reference", name
            assert r.error_bound == 0.0 and r.n_refined >= 30 * 29 // 2, name
        sel = _backend.select(refgeo.rows._DIAMETER, S)
        assert sel.backend == "reference" and sel.reason == "fallback: refgeo_ext hidden for the test"
        monkeypatch.setenv("REFGEO_REQUIRE_EXT", "1")
        calls = [
            lambda: refgeo.row_diameter(S),
            lambda: refgeo.closest_pair(S),
            lambda: refgeo.farthest_partners(S),
            lambda: refgeo.knn(S, 2),
        ]
        for call, name in zip(calls, ("row_diameter", "closest_pair", "farthest_partners", "knn")):
            with pytest.raises(refgeo.ExtensionUnavailableError, match=f"REFGEO_REQUIRE_EXT=1 but {name} would fall back"):
                call()


def test_selection_says_why():
    info = refgeo.rows._DIAMETER
    X = np.zeros((2, 2))
    with refgeo.use_backend("reference"):
        s = _backend.select(info, X)
        assert (s.backend, s.reason) == ("reference", "use_backend('reference')")
        run = _backend.run(info, (X,), X)
        assert (run.backend, run.reason) == ("reference", "use_backend('reference')")
        assert (run.value, run.i, run.j) == (0.0, 0, 1)
    if _backend.extension() is not None:
        with refgeo.use_backend("auto"):
            s = _backend.select(info, X)
        assert (s.backend, s.reason) == ("cython", "auto: refgeo_ext is built, NumPy input")
    xps = pytest.importorskip("array_api_strict")
    with refgeo.use_backend("auto"):
        s = _backend.select(info, xps.asarray(X))
    assert s.backend == "reference" and "array_api_strict" in s.reason and "array-API reference" in s.reason


def test_huge_rows_run_on_the_engine_that_is_reported(backend):
    """Rows of size 1e200 once overflowed, fell back inside the call and were reported
    as cython with value inf; now they are prescaled and run where they say."""
    S = np.random.default_rng(3).random((100, 4)) * 1e200
    for name, r in _engine_calls(S).items():
        assert r.backend == backend, name
        assert r.scale_exponent == 665, name
    D = refgeo.row_diameter(S)
    with refgeo.use_backend("reference"):
        ref = refgeo.row_diameter(S)
    assert math.isfinite(D.value) and (D.value, D.i, D.j) == (ref.value, ref.i, ref.j)
    assert 1e199 < D.value < 3e200


def test_show_config_torch_dispatch_follows_the_requested_backend():
    """Under use_backend("reference") CPU tensors run the reference, and show_config
    says so (it named the compiled engine whenever it was built)."""
    with refgeo.use_backend("reference"):
        tv = refgeo.show_config(mode="dicts")["torch"]
        assert tv["cpu_tensors"].startswith("reference")
        if _backend.available_backends()["cupy"][0]:
            assert tv["cuda_tensors"].startswith("reference")
    with refgeo.use_backend("cupy"):
        assert "needs CuPy arrays" in refgeo.show_config(mode="dicts")["torch"]["cpu_tensors"]


def test_overlapping_blas_pins_restore_the_thread_count_when_the_last_one_leaves():
    """BLAS's thread count is one setting per process.  With a limiter per call, two
    overlapping calls that ended in the order they began left BLAS at one thread for
    the rest of the process (and the first to leave unpinned it under the other)."""
    from threadpoolctl import threadpool_info, threadpool_limits

    from refgeo._threads import blas_single_thread

    def counts():
        return sorted({i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"})

    import scipy.linalg  # noqa: F401  (SciPy's BLAS loaded, as the controller loads it)
    with threadpool_limits(limits=2, user_api="blas"):  # more than one, whatever the machine
        before = counts()
        if not before or max(before) < 2:
            pytest.skip("a BLAS without threads: nothing to pin")
        a, b = blas_single_thread(), blas_single_thread()
        a.__enter__()
        b.__enter__()
        assert counts() == [1]
        a.__exit__(None, None, None)
        assert counts() == [1]  # b still runs its tiles
        b.__exit__(None, None, None)
        assert counts() == before
