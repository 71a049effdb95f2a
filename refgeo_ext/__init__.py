"""refgeo_ext: compiled kernels behind refgeo's ``cython`` backend.

Private to refgeo: call the public functions in :mod:`refgeo`, which validate their
arguments and dispatch here.  Kernels receive C-contiguous float32/float64 arrays and
preallocated outputs and never check arguments themselves.

Dataflow of the tiled kernels::

    center (_common): X = S - mean in the filter dtype, float64 norms n_i
      -> tile driver (_driver): tile pairs (I, J) on OpenMP threads, per-thread
         buffers, Ctrl-C and progress polled by the calling thread between tiles
      -> tile epilogue of the kernel (one hook per kernel):
           GEMM G = X_I X_J^T (_blas)
           -> fused epilogue (max, min, top-k, farthest partner) + candidate buffer
           -> float64 refinement of candidates by direct differences (src/refine.h)
         or, for Hilbert distances, the tropical max-minus-min fold (src/tropical.h)
      -> merge per-thread results in tile order with the tie rule -> result

Why tiles: a tile pair's cross-term block (256 x 256 by default, 512 x 512 for the
diameter and closest pair through a float32 filter) stays in the core's
L2 cache while the epilogue reads it, so the candidates are filtered at GEMM speed and
only the few pairs that may reach the extreme are refined.  k-NN tiles are larger
(1024 rows by default): its epilogue reads the block once, streaming, so the block need
not fit in L2, and larger tiles pack the GEMM operands less often.

Modules:

``_common``
    ``center64/center32/center32s64``, ``has_openmp``, ``openmp_max_threads`` and the
    fork detection (a forked child runs every kernel serially, warning once).
``_driver`` (+ ``_driver.pxd``)
    ``TileDriver``, the one parallel tile driver; kernels subclass it and override
    the hooks ``init_thread``, ``process_tile`` and ``finalize_thread``.
``_extreme_pairs``
    certified row diameter, closest pair and farthest partners (GEMM tiles).
``_knn``
    certified exact k nearest neighbors (GEMM tiles, per-row heaps).
``_knn_blocks``
    the k-NN filter and the extreme pair of two row blocks, the float64 refinement of given pairs:
    the per-task kernels of the Dask backend (serial; Dask runs the tasks in parallel).
``_tropical``
    pairwise max-minus-min of logit differences (Hilbert pdist/cdist).
``_blas`` (``.pxd`` only)
    dgemm/sgemm from ``scipy.linalg.cython_blas``, row-major convention.

Every tiled kernel takes an optional ``progress`` callable, ``progress(done, total)``
(see ``_driver.pyi``), and raises ``KeyboardInterrupt`` promptly on Ctrl-C.
"""

from . import _common, _driver, _extreme_pairs, _knn, _knn_blocks, _tropical

__all__ = ["_common", "_driver", "_extreme_pairs", "_knn", "_knn_blocks", "_tropical", "has_openmp",
           "openmp_max_threads"]

has_openmp = _common.has_openmp
openmp_max_threads = _common.openmp_max_threads
