/* Float64 refinement and small helpers of the certified pairwise engine.
 *
 * refgeo_sqdist_f64 / _f32 compute the *refined* squared distance of two rows by
 * direct differences in float64, in the one summation order that refgeo's
 * reference backend also uses (`_canonical_sq`): eight lanes
 * p[k mod 8] accumulated in increasing k, then ((p0+p1)+(p2+p3))+((p4+p5)+(p6+p7)).
 * Every operation is a correctly rounded IEEE double operation: this file must be
 * compiled without fast-math flags and without FMA contraction (meson passes
 * -ffp-contract=off), so both backends return bitwise identical values.
 */
#ifndef REFGEO_REFINE_H
#define REFGEO_REFINE_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#define REFGEO_DEFINE_SQDIST(NAME, T)                                              \
    static inline double NAME(const T *a, const T *b, ptrdiff_t d)                 \
    {                                                                              \
        double p[8] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};                    \
        ptrdiff_t k = 0, r;                                                        \
        for (; k + 8 <= d; k += 8) {                                               \
            for (r = 0; r < 8; r++) {                                              \
                double t = (double)a[k + r] - (double)b[k + r];                    \
                double sq = t * t;                                                 \
                p[r] = p[r] + sq;                                                  \
            }                                                                      \
        }                                                                          \
        for (r = 0; k + r < d; r++) {                                              \
            double t = (double)a[k + r] - (double)b[k + r];                        \
            double sq = t * t;                                                     \
            p[r] = p[r] + sq;                                                      \
        }                                                                          \
        return ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7])); \
    }

REFGEO_DEFINE_SQDIST(refgeo_sqdist_f64, double)
REFGEO_DEFINE_SQDIST(refgeo_sqdist_f32, float)

/* Tile epilogues that scan every entry of a GEMM tile are also compiled for AVX2 and
 * chosen at load time (an ifunc) on x86-64 Linux with GCC; elsewhere the baseline
 * ISA is used.  Both compute the same IEEE operations (no FMA contraction). */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define REFGEO_TARGET_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define REFGEO_TARGET_CLONES
#endif

/* refgeo_sqdist_pairs_*: the refined squared distances out[q] of the n pairs
 * (ij[2q], ij[2q + 1]) of rows of S (d columns), each exactly as refgeo_sqdist_*
 * computes it (the same function, inlined into both clones): the AVX2 clone sums the
 * eight lanes in four-wide registers, the same IEEE operations in the same order,
 * about a quarter faster (a closest pair of hidden states refines millions of
 * candidates). */
#define REFGEO_DEFINE_SQDIST_PAIRS(NAME, T, SQDIST)                                  \
    REFGEO_TARGET_CLONES static void NAME(const T *S, ptrdiff_t d, const ptrdiff_t *ij, \
                                          ptrdiff_t n, double *out)                  \
    {                                                                                \
        ptrdiff_t q;                                                                 \
        for (q = 0; q < n; q++)                                                      \
            out[q] = SQDIST(S + ij[2 * q] * d, S + ij[2 * q + 1] * d, d);            \
    }

REFGEO_DEFINE_SQDIST_PAIRS(refgeo_sqdist_pairs_f64, double, refgeo_sqdist_f64)
REFGEO_DEFINE_SQDIST_PAIRS(refgeo_sqdist_pairs_f32, float, refgeo_sqdist_f32)

/* Ask for the bytes [p, p + bytes) to be brought into the cache (a hint; no-op
 * without GCC builtins).  Candidate rows are refined from scattered places of a
 * large array: fetching the next row while the current one is summed hides most of
 * the memory latency. */
static inline void refgeo_prefetch(const void *p, size_t bytes)
{
#if defined(__GNUC__)
    const char *c = (const char *)p;
    size_t off;
    for (off = 0; off < bytes; off += 64)
        __builtin_prefetch(c + off, 0, 3);
#else
    (void)p;
    (void)bytes;
#endif
}

/* The top of a k-NN heap is read by the other threads of the tile driver while its
 * owner updates it (a shared pruning threshold, knn.h): it is stored and loaded as
 * a relaxed atomic, which is a plain move on x86-64 and AArch64.  Any value a
 * reader sees was the top at some moment, and tops only decrease. */
#if defined(__GNUC__)
static inline double refgeo_load_top(const double *p)
{
    double v;
    __atomic_load(p, &v, __ATOMIC_RELAXED);
    return v;
}
static inline void refgeo_store_top(double *p, double v)
{
    __atomic_store(p, &v, __ATOMIC_RELAXED);
}
#else
static inline double refgeo_load_top(const double *p) { return *(const volatile double *)p; }
static inline void refgeo_store_top(double *p, double v) { *(volatile double *)p = v; }
#endif

/* (value, index) records, sorted by value then index: the engine's one tie rule. */
typedef struct {
    double v;
    int64_t j;
} refgeo_vj;

/* refgeo_sqdist_cands_*: cand[q].v = the refined squared distance of row a and row
 * cand[q].j of B (d columns) for the n candidates of one k-NN row, fetching the next
 * candidate's row while the current one is summed (they lie scattered over B); the
 * values of refgeo_sqdist_*, with an AVX2 clone as refgeo_sqdist_pairs_*. */
#define REFGEO_DEFINE_SQDIST_CANDS(NAME, T, SQDIST)                                  \
    REFGEO_TARGET_CLONES static void NAME(const T *a, const T *B, ptrdiff_t d,        \
                                          refgeo_vj *cand, ptrdiff_t n)               \
    {                                                                                \
        ptrdiff_t q;                                                                 \
        if (n > 0)                                                                   \
            refgeo_prefetch(B + cand[0].j * d, (size_t)d * sizeof(T));               \
        for (q = 0; q < n; q++) {                                                    \
            if (q + 1 < n)                                                           \
                refgeo_prefetch(B + cand[q + 1].j * d, (size_t)d * sizeof(T));       \
            cand[q].v = SQDIST(a, B + cand[q].j * d, d);                             \
        }                                                                            \
    }

REFGEO_DEFINE_SQDIST_CANDS(refgeo_sqdist_cands_f64, double, refgeo_sqdist_f64)
REFGEO_DEFINE_SQDIST_CANDS(refgeo_sqdist_cands_f32, float, refgeo_sqdist_f32)

/* Max-heap of n (key, id) records, largest key at position 0, four children per
 * node (node p has children 4p + 1 .. 4p + 4): replace the top by (k, j) and sift
 * it down.  A heap filled with (+inf, -1) is valid.  A sift is a chain of
 * dependent loads, one per level, that often miss the cache (the heaps of all
 * rows outgrow it): four children per node halve the levels of a binary heap
 * (three for K = 48), and key and id share a record, so a level touches at most
 * two cache lines.  The largest child is picked without branches (which child
 * wins is unpredictable); on ties the first one. */
static inline void refgeo_heap_replace_top(refgeo_vj *h, ptrdiff_t n, double k, int64_t j)
{
    ptrdiff_t pos = 0;
    for (;;) {
        ptrdiff_t c = 4 * pos + 1, big, q, e;
        double kb;
        if (c >= n)
            break;
        e = c + 4 < n ? c + 4 : n;
        big = c;
        kb = h[c].v;
        for (q = c + 1; q < e; q++) {
            double kq = h[q].v;
            int gt = kq > kb;
            big = gt ? q : big;
            kb = gt ? kq : kb;
        }
        if (kb <= k)
            break;
        if (pos == 0)
            refgeo_store_top(&h[0].v, kb);
        else
            h[pos].v = kb;
        h[pos].j = h[big].j;
        pos = big;
    }
    if (pos == 0)
        refgeo_store_top(&h[0].v, k);
    else
        h[pos].v = k;
    h[pos].j = j;
}

/* Binary max-heap of n keys with their ids in two parallel arrays, largest key at
 * position 0: replace the top by (k, j) and sift it down.  A heap filled with +inf
 * keys is valid.  The Dask block-pair tasks (_knn_blocks) keep their heaps this way:
 * the keys and ids travel between processes as two NumPy arrays. */
static inline void refgeo_heap2_replace_top(double *key, int64_t *id, ptrdiff_t n,
                                            double k, int64_t j)
{
    ptrdiff_t pos = 0;
    for (;;) {
        ptrdiff_t l = 2 * pos + 1, r = l + 1, big;
        if (l >= n)
            break;
        big = (r < n && key[r] > key[l]) ? r : l;
        if (key[big] <= k)
            break;
        key[pos] = key[big];
        id[pos] = id[big];
        pos = big;
    }
    key[pos] = k;
    id[pos] = j;
}

static int refgeo_vj_cmp(const void *pa, const void *pb)
{
    const refgeo_vj *a = (const refgeo_vj *)pa, *b = (const refgeo_vj *)pb;
    if (a->v < b->v)
        return -1;
    if (a->v > b->v)
        return 1;
    return (a->j > b->j) - (a->j < b->j);
}

static inline void refgeo_sort_vj(refgeo_vj *a, ptrdiff_t n)
{
    qsort(a, (size_t)n, sizeof(refgeo_vj), refgeo_vj_cmp);
}


/* Whether record a precedes record b in the tie rule (refgeo_vj_cmp). */
static inline int refgeo_vj_before(const refgeo_vj *a, const refgeo_vj *b)
{
    return refgeo_vj_cmp(a, b) < 0;
}

/* Sift a[p] down the binary max-heap a[0 .. n) ordered by the tie rule. */
static inline void refgeo_vj_sift_down(refgeo_vj *a, ptrdiff_t n, ptrdiff_t p)
{
    refgeo_vj x = a[p];
    for (;;) {
        ptrdiff_t c = 2 * p + 1;
        if (c >= n)
            break;
        if (c + 1 < n && refgeo_vj_before(&a[c], &a[c + 1]))
            c++;
        if (!refgeo_vj_before(&x, &a[c]))
            break;
        a[p] = a[c];
        p = c;
    }
    a[p] = x;
}

/* The k smallest records of a[0 .. n) by the tie rule, moved to a[0 .. k) and sorted;
 * the rest of a is left in some order.  O(n log k): a k-NN row that its heaps could not
 * certify (more ties at its k-th distance than the heaps hold: sign rows, whose squared
 * distances are multiples of 4) refines every candidate, and sorting all n of them
 * took three quarters of knn's time on 20,000 sign rows. */
static inline void refgeo_smallest_vj(refgeo_vj *a, ptrdiff_t n, ptrdiff_t k)
{
    ptrdiff_t p, q;
    if (k < n) {
        for (p = k / 2 - 1; p >= 0; p--)
            refgeo_vj_sift_down(a, k, p);
        for (q = k; q < n; q++) {
            if (refgeo_vj_before(&a[q], &a[0])) {
                a[0] = a[q];
                refgeo_vj_sift_down(a, k, 0);
            }
        }
        n = k;
    }
    refgeo_sort_vj(a, n);
}

/* Ascending sort of n doubles (small n: the certification of one k-NN row). */
static int refgeo_double_cmp(const void *pa, const void *pb)
{
    double a = *(const double *)pa, b = *(const double *)pb;
    return (a > b) - (a < b);
}

static inline void refgeo_sort_double(double *a, ptrdiff_t n)
{
    qsort(a, (size_t)n, sizeof(double), refgeo_double_cmp);
}

#endif /* REFGEO_REFINE_H */
