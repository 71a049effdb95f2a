"""The same values in other memory layouts, and a bit-for-bit comparison of results.

NumPy's reductions and BLAS pick their summation order from the strides, so a result
computed straight from a Fortran-order or strided view can differ in its last bits
from the one of the C-contiguous array; refgeo's results must not.
"""

from __future__ import annotations

import dataclasses

import numpy as np


def other_layouts(A):
    """The values of ``A`` in Fortran order, as a strided view and with negative strides."""
    A = np.asarray(A)
    yield np.asfortranarray(A)
    wide = np.zeros(tuple(2 * n for n in A.shape), dtype=A.dtype)
    every_other = tuple(slice(None, None, 2) for _ in A.shape)
    wide[every_other] = A
    yield wide[every_other]
    yield np.flip(np.flip(A).copy())


def assert_same_result(a, b, skip=("elapsed",)):
    """``a`` and ``b`` are equal bit for bit: arrays, floats and dataclass fields
    (recursively; the fields named in ``skip``, such as timings, are not compared)."""
    if dataclasses.is_dataclass(a):
        assert type(a) is type(b)
        for f in dataclasses.fields(a):
            if f.name not in skip:
                assert_same_result(getattr(a, f.name), getattr(b, f.name), skip)
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.shape == b.shape and a.dtype == b.dtype
        assert a.tobytes() == b.tobytes()
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same_result(x, y, skip)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same_result(a[key], b[key], skip)
    elif isinstance(a, float) and a != a:
        assert b != b
    else:
        assert a == b
