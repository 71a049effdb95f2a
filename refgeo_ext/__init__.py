"""refgeo_ext: compiled kernels behind refgeo's ``cython`` backend.

Private to refgeo: call the public functions in :mod:`refgeo`, which validate their
arguments and dispatch here.  Kernels receive C-contiguous float32/float64 arrays and
preallocated outputs and never check arguments themselves.

Dataflow of the tiled kernels::

    row tiles (OpenMP, one thread per tile)
      -> column chunks / BLAS GEMM of the tile pair (cross term)
      -> fused epilogue (max, min, top-k, farthest partner) + candidate buffer
      -> float64 refinement of candidates by direct differences
      -> merge in tile order (deterministic) -> result

Modules:

``_tropical``
    pairwise max-minus-min of logit differences (Hilbert pdist/cdist).
``_extreme_pairs``
    certified row diameter, closest pair and farthest partners (GEMM tiles).
``_knn``
    certified exact k nearest neighbours (GEMM tiles, per-row heaps).
``_blas`` (``.pxd`` only)
    dgemm/sgemm from ``scipy.linalg.cython_blas``, row-major convention.
"""

from . import _extreme_pairs, _knn, _tropical

__all__ = ["_extreme_pairs", "_knn", "_tropical", "has_openmp", "openmp_max_threads"]

has_openmp = _tropical.has_openmp
openmp_max_threads = _tropical.openmp_max_threads
