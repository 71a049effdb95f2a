# cython: language_level=3
"""BLAS GEMM for the tiled engine, through ``scipy.linalg.cython_blas`` only.

Row-major convention, written down once.  Fortran BLAS is column-major, and a
row-major (r x c) array with leading dimension c is, byte for byte, the column-major
(c x r) array of its transpose.  The engine needs the row-major tile product

    C (m x n, ld n) = A (m x k, ld k) @ B (n x k, ld k)^T      (cross terms x_i . y_j)

which in column-major terms is C^T (n x m, ld n) = B @ A^T: ``transa = 'T'`` on the
buffer of B (column-major k x n, ld k), ``transb = 'N'`` on the buffer of A
(column-major k x m, ld k).  ``cython_blas`` takes non-const pointers, so ``const``
is cast away; BLAS never writes A or B.
"""

from scipy.linalg.cython_blas cimport dgemm, sgemm


cdef inline void gemm_nt_f64(const double *A, const double *B, int m, int n, int k,
                           double *C) noexcept nogil:
    """C[i * n + j] = sum_l A[i * k + l] * B[j * k + l]  (row-major C = A B^T)."""
    cdef char ta = b'T'
    cdef char tb = b'N'
    cdef double one = 1.0
    cdef double zero = 0.0
    cdef int ld = k
    cdef int ldc = n
    dgemm(&ta, &tb, &n, &m, &k, &one, <double *> B, &ld, <double *> A, &ld, &zero, C, &ldc)


cdef inline void gemm_nt_f32(const float *A, const float *B, int m, int n, int k,
                           float *C) noexcept nogil:
    """float32 version of :func:`gemm_nt_f64` (sgemm)."""
    cdef char ta = b'T'
    cdef char tb = b'N'
    cdef float one = 1.0
    cdef float zero = 0.0
    cdef int ld = k
    cdef int ldc = n
    sgemm(&ta, &tb, &n, &m, &k, &one, <float *> B, &ld, <float *> A, &ld, &zero, C, &ldc)
