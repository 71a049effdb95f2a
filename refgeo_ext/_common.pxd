# cython: language_level=3
"""Shared C-level pieces of refgeo_ext (implementation: ``_common.pyx.tp``)."""

# The number of threads a kernel may really use for ``n_threads`` requested: 1 in a
# process forked after the extension was loaded (GNU OpenMP cannot run a parallel
# region there; warns once) and without OpenMP, else ``n_threads``.
cdef int usable_threads(int n_threads) except -1
