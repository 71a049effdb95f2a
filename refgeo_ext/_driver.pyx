# cython: language_level=3
"""The one parallel tile driver of refgeo_ext: tile pairs, threads, buffers, stops.

Every tiled kernel (``_extreme_pairs``, ``_knn``, ``_tropical``) is a subclass of
:class:`TileDriver` that overrides the hooks declared in ``_driver.pxd``.  The
driver owns what the kernels used to copy by hand::

    run(n_a, n_b, triangle, n_threads, progress)
      task list: tile pairs (I, J), I <= J (triangle) or all of n_a x n_b
      n = usable_threads(n_threads)           <- 1 in a forked child (_common)
      n == 1: a plain loop, no OpenMP region at all
      else:   with nogil, parallel(num_threads=n):
                  allocate this thread's buffers, init_thread(tid)
                  for p in prange(n_tasks, schedule="dynamic"):
                      skip if the run failed or was cancelled
                      process_tile(tid, I_p, J_p)   <- the kernel's epilogue
                      master thread only: _poll()   <- Ctrl-C, progress
                  finalize_thread(tid), free this thread's buffers
      raise the stop's exception (KeyboardInterrupt, MemoryError, the hook's), or
      report progress(total, total)

Interrupts.  OpenMP threads cannot run Python code, so the master thread (thread 0,
the thread that called the kernel) polls between its tiles: at most every
``SIGNAL_INTERVAL`` seconds of wall-clock time it takes the GIL and calls
``PyErr_CheckSignals``, which runs the Python signal handlers (SIGINT raises
``KeyboardInterrupt``).  An exception there sets ``cancelled``; every thread reads
it before taking its next tile, so the team drains within one tile per thread, the
buffers are freed, and ``run`` re-raises.  The caller never sees the partly written
outputs: the kernel's ``def`` wrapper propagates the exception.  One clock read per
tile and one GIL round trip per 50 ms cost far below 1% of a run.
"""

from cython.parallel cimport parallel, prange, threadid
from cpython.exc cimport PyErr_CheckSignals
from libc.stdlib cimport calloc, free, malloc

from ._common cimport usable_threads

cdef extern from "driver.h" nogil:
    double refgeo_now()
    int refgeo_flag_get(const int *f)
    void refgeo_flag_set(int *f)
    void refgeo_count_add(Py_ssize_t *c, Py_ssize_t v)
    Py_ssize_t refgeo_count_get(const Py_ssize_t *c)

# Seconds between two signal checks, and between two progress reports, of the master
# thread: a Ctrl-C is honoured within 50 ms plus one tile, a progress bar is redrawn
# at most five times a second.
cdef double SIGNAL_INTERVAL = 0.05
cdef double PROGRESS_INTERVAL = 0.2


cdef class TileDriver:
    """Walks a list of tile pairs on OpenMP threads and calls the kernel's hooks."""

    def __dealloc__(self):
        free(self.task_i)
        free(self.task_j)
        self._free_buffers()

    cdef int init_thread(self, int tid) noexcept nogil:
        return 0

    cdef void process_tile(self, int tid, Py_ssize_t I, Py_ssize_t J) noexcept nogil:
        pass

    cdef void finalize_thread(self, int tid) noexcept nogil:
        pass

    cdef void *thread_buffer(self, int tid, int slot) noexcept nogil:
        return self.buffers[tid * N_THREAD_BUFFERS + slot]

    cdef bint stopped(self) noexcept nogil:
        return refgeo_flag_get(&self.failed) != 0 or refgeo_flag_get(&self.cancelled) != 0

    cdef int run(self, Py_ssize_t n_a, Py_ssize_t n_b, bint triangle, int n_threads,
                 object progress, Py_ssize_t progress_offset=0,
                 Py_ssize_t progress_total=-1) except -1:
        """Run ``process_tile`` on every tile pair; raise what stopped the run, if anything.

        Tasks are the pairs ``(I, J)`` with ``I <= J < n_a`` when ``triangle``, else
        all of ``range(n_a) x range(n_b)``, in row-major order; with
        ``self.task_block = B > 0``, in row-major order of the B x B blocks of pairs
        and row-major within a block, so that consecutive tasks (on all threads)
        touch the per-row state of only 2 B tiles: a kernel whose epilogue updates
        per-row state much larger than the cache (the k-NN heaps) then finds it in
        the cache.  ``progress`` is None
        or a callable ``progress(done, total)``, called by the calling thread between
        tiles at most every 0.2 s and once with ``done == total`` at the end.  The
        counts are ``progress_offset`` plus the tasks done so far, out of
        ``progress_total`` (default: ``progress_offset + n_tasks``), so a kernel with
        two passes can report them as one; the final call only comes when the
        offset and this run's tasks reach the total.  An exception raised by
        ``progress`` stops the run like a Ctrl-C and propagates.
        """
        cdef int n = usable_threads(n_threads)
        cdef Py_ssize_t p, q, I, J, n_tasks, B, SI, SJ
        cdef int tid = 0
        cdef int started = 0
        cdef double t0
        free(self.task_i)
        free(self.task_j)
        self.task_i = NULL
        self.task_j = NULL
        self._free_buffers()
        n_tasks = n_a * (n_a + 1) // 2 if triangle else n_a * n_b
        self.n_tasks = n_tasks
        self.task_i = <Py_ssize_t *> malloc((n_tasks + 1) * sizeof(Py_ssize_t))
        self.task_j = <Py_ssize_t *> malloc((n_tasks + 1) * sizeof(Py_ssize_t))
        if self.task_i == NULL or self.task_j == NULL:
            raise MemoryError("no memory for the tile-pair list; pass a larger tile_size")
        q = 0
        if triangle:
            n_b = n_a
        B = self.task_block if self.task_block > 0 else max(n_a, n_b, 1)
        for SI in range(0, n_a, B):
            for SJ in range(SI if triangle else 0, n_b, B):
                for I in range(SI, min(SI + B, n_a)):
                    for J in range(max(SJ, I) if triangle else SJ, min(SJ + B, n_b)):
                        self.task_i[q] = I
                        self.task_j[q] = J
                        q += 1
        if n > n_tasks:
            n = <int> n_tasks if n_tasks > 0 else 1
        self.buffers = <void **> calloc(n * N_THREAD_BUFFERS, sizeof(void *))
        if self.buffers == NULL:
            raise MemoryError("no memory for the per-thread buffer table")
        self.n_buffer_threads = n
        self.failed = 0
        self.cancelled = 0
        self.done = 0
        self.error = None
        self.progress = progress
        self.has_progress = progress is not None
        self.progress_offset = progress_offset
        self.progress_total = progress_offset + n_tasks if progress_total < 0 else progress_total
        t0 = refgeo_now()
        self.next_signal_check = t0 + SIGNAL_INTERVAL
        self.next_progress = t0 + PROGRESS_INTERVAL

        if n == 1:
            # The serial path enters no OpenMP region: a forked child (where GNU
            # OpenMP would hang) and small problems take it.
            with nogil:
                started = self._thread_start(0)
                p = 0
                while p < n_tasks and not self.stopped():
                    self.process_tile(0, self.task_i[p], self.task_j[p])
                    self.done += 1
                    self._poll()
                    p += 1
                self._thread_end(0, started)
        else:
            with nogil, parallel(num_threads=n):
                tid = threadid()
                started = self._thread_start(tid)
                # schedule="dynamic" (chunks of one tile pair): tiles differ in cost,
                # diagonal tiles do half the pairs, the maximum mode skips whole tiles
                # that cannot reach the running bound, candidate refinement is bursty
                # and the tropical triangle is ragged, so static blocks would leave
                # threads idle at the end.  One tile is milliseconds of GEMM, so the
                # shared counter behind dynamic scheduling costs nothing measurable,
                # and results never depend on which thread ran which tile.
                for p in prange(n_tasks, schedule="dynamic"):
                    if self.stopped():
                        continue
                    self.process_tile(tid, self.task_i[p], self.task_j[p])
                    refgeo_count_add(&self.done, 1)
                    if tid == 0:
                        self._poll()
                self._thread_end(tid, started)

        free(self.task_i)
        free(self.task_j)
        self.task_i = NULL
        self.task_j = NULL
        self._free_buffers()
        self.progress = None
        if self.error is not None:
            exc = self.error
            self.error = None
            raise exc
        if self.failed:
            raise MemoryError("no memory for the per-thread tile buffers; pass a smaller tile_size")
        if progress is not None and progress_offset + n_tasks >= self.progress_total:
            progress(self.progress_total, self.progress_total)
        return 0

    cdef int _thread_start(self, int tid) noexcept nogil:
        """Allocate thread ``tid``'s buffers (first touch on its own core), init it."""
        cdef int slot
        cdef void *b
        cdef bint ok = True
        for slot in range(N_THREAD_BUFFERS):
            if self.buffer_bytes[slot] > 0:
                b = malloc(self.buffer_bytes[slot])
                self.buffers[tid * N_THREAD_BUFFERS + slot] = b
                if b == NULL:
                    ok = False
        if ok and self.init_thread(tid) != 0:
            ok = False
        if not ok:
            refgeo_flag_set(&self.failed)
        return ok

    cdef void _thread_end(self, int tid, bint started) noexcept nogil:
        cdef int slot
        if started and not self.stopped():
            self.finalize_thread(tid)
        for slot in range(N_THREAD_BUFFERS):
            free(self.buffers[tid * N_THREAD_BUFFERS + slot])
            self.buffers[tid * N_THREAD_BUFFERS + slot] = NULL

    cdef void _poll(self) noexcept nogil:
        """Master thread, between tiles: Ctrl-C and progress, rate-limited."""
        cdef double now = refgeo_now()
        cdef bint check = now >= self.next_signal_check
        cdef bint report = self.has_progress and now >= self.next_progress
        if not (check or report):
            return
        with gil:
            try:
                if check:
                    self.next_signal_check = now + SIGNAL_INTERVAL
                    PyErr_CheckSignals()
                if report:
                    self.next_progress = now + PROGRESS_INTERVAL
                    self.progress(self.progress_offset + refgeo_count_get(&self.done),
                                  self.progress_total)
            except BaseException as exc:
                self.error = exc
                refgeo_flag_set(&self.cancelled)

    cdef void _free_buffers(self) noexcept nogil:
        cdef Py_ssize_t q
        if self.buffers != NULL:
            for q in range(self.n_buffer_threads * N_THREAD_BUFFERS):
                free(self.buffers[q])
            free(self.buffers)
        self.buffers = NULL
        self.n_buffer_threads = 0
