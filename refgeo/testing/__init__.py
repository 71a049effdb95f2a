"""Verification kit: test your own kernels (PyTorch, JAX, Triton, CuPy, ...) against refgeo.

refgeo's reference backend is a trusted oracle; this subpackage turns it into a
test suite for other implementations (docs page: "Testing your implementation against
refgeo").  It needs ``hypothesis`` (``pip install hypothesis``).

* :func:`check_against_reference` draws adversarial inputs with hypothesis, runs a
  candidate callable and refgeo's reference on each, and raises the minimal failing
  example as a :class:`ConformanceError` (an ``AssertionError``, so it works in pytest).
* ``assert_*`` helpers compare one output with the reference; their default tolerances
  are the documented error bounds (certified float64 values, the float32 bound of
  :func:`refgeo.pdist_hilbert`, exact tie rules).
* :mod:`refgeo.testing.strategies` holds the hypothesis strategies themselves.

.. autosummary::

   check_against_reference
   ConformanceReport
   reference_names
   signature
   assert_hilbert_logits_close
   assert_hilbert_close
   assert_pdist_close
   assert_cdist_close
   assert_extreme_pair_close
   assert_knn_close
   assert_local_diagonal_fit_close
   assert_projected_rownorm_close
   assert_rownorm_steps_close
   rownorm_reference_steps
   as_numpy
   ConformanceError
   strategies

Examples
--------
>>> import numpy as np
>>> from refgeo.testing import check_against_reference
>>> def diameter(S):  # direct differences in float64: correct, if slow
...     S = np.asarray(S, dtype=np.float64)
...     i, j = np.triu_indices(len(S), k=1)
...     D = np.sqrt(((S[i] - S[j]) ** 2).sum(axis=1))
...     k = np.argmax(D)  # first maximum: the smallest (i, j) among ties
...     return D[k], i[k], j[k]
>>> print(check_against_reference(diameter, "row_diameter", max_examples=24))
row_diameter: the candidate agrees with refgeo's reference on 24 examples in 8 scenarios
"""

from . import strategies
from ._assertions import (
    ConformanceError,
    as_numpy,
    assert_cdist_close,
    assert_extreme_pair_close,
    assert_hilbert_close,
    assert_hilbert_logits_close,
    assert_knn_close,
    assert_local_diagonal_fit_close,
    assert_pdist_close,
    assert_projected_rownorm_close,
    assert_rownorm_steps_close,
    rownorm_reference_steps,
)
from ._conformance import Case, ConformanceReport, Reference, check_against_reference, reference_names, signature

# Reported as ``refgeo.testing.ConformanceError`` in tracebacks (where users import it from).
for _cls in (Case, ConformanceError, ConformanceReport, Reference):
    _cls.__module__ = __name__
del _cls

__all__ = [
    "Case",
    "ConformanceError",
    "ConformanceReport",
    "Reference",
    "as_numpy",
    "assert_cdist_close",
    "assert_extreme_pair_close",
    "assert_hilbert_close",
    "assert_hilbert_logits_close",
    "assert_knn_close",
    "assert_local_diagonal_fit_close",
    "assert_pdist_close",
    "assert_projected_rownorm_close",
    "assert_rownorm_steps_close",
    "check_against_reference",
    "reference_names",
    "rownorm_reference_steps",
    "signature",
    "strategies",
]
