/* Small C helpers of the tile driver (_driver.pyx): a monotonic clock for the
 * master thread's polling, and relaxed atomics for the flags and the counters
 * that OpenMP threads share.  Relaxed order is enough: a flag only asks the
 * threads to stop taking tiles, and every result is read after the parallel
 * region's closing barrier, which orders all memory.
 */
#ifndef REFGEO_DRIVER_H
#define REFGEO_DRIVER_H

#include <stddef.h>
#include <time.h>

static inline double refgeo_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

#if defined(__GNUC__) || defined(__clang__)
static inline int refgeo_flag_get(const int *f) { return __atomic_load_n(f, __ATOMIC_RELAXED); }
static inline void refgeo_flag_set(int *f) { __atomic_store_n(f, 1, __ATOMIC_RELAXED); }
static inline void refgeo_count_add(ptrdiff_t *c, ptrdiff_t v)
{
    __atomic_fetch_add(c, v, __ATOMIC_RELAXED);
}
static inline ptrdiff_t refgeo_count_get(const ptrdiff_t *c)
{
    return __atomic_load_n(c, __ATOMIC_RELAXED);
}
/* Adds v and returns the count before: a reservation of v slots. */
static inline ptrdiff_t refgeo_count_take(ptrdiff_t *c, ptrdiff_t v)
{
    return __atomic_fetch_add(c, v, __ATOMIC_RELAXED);
}
#else
static inline int refgeo_flag_get(const int *f) { return *(const volatile int *)f; }
static inline void refgeo_flag_set(int *f) { *(volatile int *)f = 1; }
static inline void refgeo_count_add(ptrdiff_t *c, ptrdiff_t v)
{
#ifdef _OPENMP
#pragma omp atomic
#endif
    *c += v;
}
static inline ptrdiff_t refgeo_count_get(const ptrdiff_t *c) { return *(const volatile ptrdiff_t *)c; }
static inline ptrdiff_t refgeo_count_take(ptrdiff_t *c, ptrdiff_t v)
{
    ptrdiff_t old;
#ifdef _OPENMP
#pragma omp atomic capture
#endif
    { old = *c; *c += v; }
    return old;
}
#endif

#endif /* REFGEO_DRIVER_H */
