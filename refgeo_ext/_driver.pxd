# cython: language_level=3
"""The one parallel tile driver of refgeo_ext (implementation: ``_driver.pyx``).

A kernel subclasses :class:`TileDriver`, stores its arrays (raw pointers into
memoryviews its ``def`` wrapper holds) and per-thread buffer sizes, overrides the
hooks and calls :meth:`run`.  Hooks run without the GIL, on OpenMP threads:

``init_thread(tid)``
    once per thread before its first tile, after the driver has allocated the
    thread's buffers; returns 0, or -1 to fail the run with ``MemoryError``.
``process_tile(tid, I, J)``
    the epilogue: one task, the tile pair ``(I, J)`` (``J == 0`` for 1-D task lists).
``finalize_thread(tid)``
    once per thread after its last tile, only if ``init_thread`` succeeded and the
    run was not stopped; the driver frees the thread's buffers after it.
"""

# Per-thread buffers a kernel may ask for (``buffer_bytes[slot]``, 0 = unused).
cdef enum:
    N_THREAD_BUFFERS = 4


cdef class TileDriver:
    # task list: tile pairs (task_i[p], task_j[p]), p < n_tasks; in row-major order,
    # or, with task_block > 0 (set by the kernel before run), grouped into blocks of
    # task_block x task_block tile pairs (see run)
    cdef Py_ssize_t n_tasks
    cdef Py_ssize_t task_block
    cdef Py_ssize_t *task_i
    cdef Py_ssize_t *task_j
    # per-thread buffers: sizes set by the kernel, memory owned by the driver
    cdef size_t buffer_bytes[N_THREAD_BUFFERS]
    cdef void **buffers
    cdef int n_buffer_threads
    # shared state, read by every thread between tiles
    cdef int failed
    cdef int cancelled
    cdef Py_ssize_t done
    # master-thread polling (signals, progress)
    cdef object progress
    cdef object error
    cdef bint has_progress
    cdef double next_signal_check
    cdef double next_progress
    cdef Py_ssize_t progress_offset
    cdef Py_ssize_t progress_total

    cdef int init_thread(self, int tid) noexcept nogil
    cdef void process_tile(self, int tid, Py_ssize_t I, Py_ssize_t J) noexcept nogil
    cdef void finalize_thread(self, int tid) noexcept nogil

    cdef int run(self, Py_ssize_t n_a, Py_ssize_t n_b, bint triangle, int n_threads,
                 object progress, Py_ssize_t progress_offset=*,
                 Py_ssize_t progress_total=*) except -1
    cdef void *thread_buffer(self, int tid, int slot) noexcept nogil
    cdef bint stopped(self) noexcept nogil

    cdef int _thread_start(self, int tid) noexcept nogil
    cdef void _thread_end(self, int tid, bint started) noexcept nogil
    cdef void _poll(self) noexcept nogil
    cdef void _free_buffers(self) noexcept nogil
