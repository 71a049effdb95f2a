/* The fused epilogue of one k-NN tile: keys of a GEMM tile into the row heaps.
 *
 * For the tile G = X_I Y_J^T (bi x bj, row-major, ld bj) and every pair (i, j) of
 * the tile, the key n_j - 2 g_ij goes into the max-heap of row i (K records, largest
 * key at position 0) if it is below the heap's top; for X against X (symmetric)
 * also the key n_i - 2 g_ij into the heap of row j.  (The caller passes the lowered
 * norms (1 - c') n of _knn.pyx.tp as nA and nB, so that a key is a lower bound.)  On one thread a key is
 * inserted exactly when the one-element-at-a-time loop would insert it, in the same
 * order per heap, so the heaps end as that loop leaves them (on several threads the
 * shared threshold below also applies):
 *
 *   - almost every key is rejected (a row keeps K of N keys, about K ln(N / K)
 *     insertions in all), so each row of the tile is first compared against the
 *     tops its heaps had when the row began, in one branch-free loop that the
 *     compiler vectorizes, into a byte mask.  Tops only decrease, so a key the mask
 *     rejects would have been rejected by the plain loop too;
 *   - the keys the mask flags (found eight mask bytes at a time) are then tried
 *     one at a time in the plain loop's order, against the current tops.
 *
 * Heap i receives its keys in increasing j and heap j (symmetric) in increasing i,
 * as in the plain loop.  The diagonal tiles of X against X, where one heap receives
 * keys both as a row and as a column, keep the plain loop (refgeo_ext/_knn.pyx.tp).
 * Keys are computed with the same two IEEE double operations everywhere
 * (g2 = 2 * (double) g is exact; v = n - g2 is one rounding), so the vector and
 * scalar paths agree bitwise; no fast-math, no FMA contraction (meson passes
 * -ffp-contract=off).
 */
#ifndef REFGEO_KNN_H
#define REFGEO_KNN_H

#include <stddef.h>
#include <stdint.h>
#include <math.h>
#include <string.h>

#include "refine.h"

/* mask[q] = 1 where key q of the row can enter a heap whose top is (still) top /
 * ctop[q]: a straight loop over the row, which the compiler vectorizes. */
#define REFGEO_DEFINE_KNN_MASK(NAME, T)                                                 \
    static inline void NAME##_sym(const T *restrict g, const double *restrict nb,       \
                                  const double *restrict ct, double top, double ni,     \
                                  unsigned char *restrict mask, ptrdiff_t n)            \
    {                                                                                   \
        ptrdiff_t q;                                                                    \
        for (q = 0; q < n; q++) {                                                       \
            double g2 = 2.0 * (double)g[q];                                             \
            mask[q] = (nb[q] - g2 < top) | (ni - g2 < ct[q]);                           \
        }                                                                               \
    }                                                                                   \
    static inline void NAME##_row(const T *restrict g, const double *restrict nb,       \
                                  double top, unsigned char *restrict mask, ptrdiff_t n) \
    {                                                                                   \
        ptrdiff_t q;                                                                    \
        for (q = 0; q < n; q++) {                                                       \
            double g2 = 2.0 * (double)g[q];                                             \
            mask[q] = nb[q] - g2 < top;                                                 \
        }                                                                               \
    }

REFGEO_DEFINE_KNN_MASK(refgeo_knn_mask_f64, double)
REFGEO_DEFINE_KNN_MASK(refgeo_knn_mask_f32, float)

/* The heaps of rows r0 .. r0 + n - 1 into the cache before the tile's insertions.
 * All heaps together exceed the last-level cache at realistic sizes, and a sift
 * down is a chain of dependent loads: fetched on demand, a tile's insertions wait
 * on thousands of memory round trips one after the other, while these prefetches
 * (independent, n K records) overlap. */
static inline void refgeo_knn_prefetch_heaps(const refgeo_vj *heaps, ptrdiff_t r0,
                                             ptrdiff_t n, ptrdiff_t K)
{
    refgeo_prefetch(heaps + r0 * K, (size_t)(n * K) * sizeof(refgeo_vj));
}

/* Eight mask bytes as one word, byte b of the mask in bits 8b .. 8b + 7, and the
 * index of the lowest nonzero byte of a nonzero such word. */
#if defined(__GNUC__) && defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
static inline uint64_t refgeo_mask_word(const unsigned char *m)
{
    uint64_t w;
    memcpy(&w, m, 8);
    return w;
}
static inline ptrdiff_t refgeo_lowest_byte(uint64_t w)
{
    return (ptrdiff_t)(__builtin_ctzll(w) >> 3);
}
#else
static inline uint64_t refgeo_mask_word(const unsigned char *m)
{
    uint64_t w = 0;
    int b;
    for (b = 0; b < 8; b++)
        w |= (uint64_t)m[b] << (8 * b);
    return w;
}
static inline ptrdiff_t refgeo_lowest_byte(uint64_t w)
{
    ptrdiff_t b = 0;
    while (((w >> (8 * b)) & 0xff) == 0)
        b++;
    return b;
}
#endif

/* The smallest top over the other threads' heaps of rows r0 .. r0 + n - 1 (+inf
 * with one thread): heaps is the first thread's heaps, stride the distance between
 * two threads' heaps, own the caller's (skipped). */
static inline void refgeo_knn_other_tops(const refgeo_vj *heaps, ptrdiff_t stride,
                                         int n_heaps, const refgeo_vj *own, ptrdiff_t r0,
                                         ptrdiff_t n, ptrdiff_t K, double *out)
{
    ptrdiff_t q;
    int t;
    for (q = 0; q < n; q++)
        out[q] = INFINITY;
    for (t = 0; t < n_heaps; t++) {
        const refgeo_vj *h = heaps + t * stride;
        if (h == own)
            continue;
        for (q = 0; q < n; q++) {
            double v = refgeo_load_top(&h[(r0 + q) * K].v);
            if (v < out[q])
                out[q] = v;
        }
    }
}

/* Column keys of a symmetric tile wait in a list and go into their heaps column by
 * column.  Inserted as they come, row after row of the tile, every insertion into
 * one of the bj column heaps would find that heap evicted by the others since its
 * last insertion; grouped per column (a stable counting sort keeps each heap's keys
 * in increasing i, the plain loop's order) a heap is fetched once per flush.  A key
 * enters the list when it is below the column's top at the last flush; it is tried
 * against the current top when the list is flushed, so the heaps end as the plain
 * loop leaves them. */
#define REFGEO_KNN_PENDING 16384

typedef struct {
    double v;
    int32_t ii;
    int32_t c;
} refgeo_knn_pend;

/* Bytes of tile scratch for tiles of at most tile rows (see NAME below). */
#define REFGEO_KNN_SCRATCH_BYTES(tile)                                                  \
    (3 * (size_t)(tile) * sizeof(double) + 2 * REFGEO_KNN_PENDING * sizeof(refgeo_knn_pend) \
     + ((size_t)(tile) + 1) * sizeof(ptrdiff_t) + (size_t)(tile) + 8)

static void refgeo_knn_flush_columns(const refgeo_knn_pend *pend, ptrdiff_t n,
                                     refgeo_knn_pend *sorted, ptrdiff_t *start,
                                     ptrdiff_t bj, refgeo_vj *own, ptrdiff_t i0,
                                     ptrdiff_t j0, ptrdiff_t K, double *ctop,
                                     const double *cother)
{
    ptrdiff_t q, e, b;
    for (q = 0; q <= bj; q++)
        start[q] = 0;
    for (e = 0; e < n; e++)
        start[pend[e].c + 1]++;
    for (q = 1; q <= bj; q++)
        start[q] += start[q - 1];
    for (e = 0; e < n; e++)
        sorted[start[pend[e].c]++] = pend[e];
    /* now start[c] is the end of column c's run; it begins where column c - 1's ends */
    b = 0;
    for (q = 0; q < bj; q++) {
        ptrdiff_t end = start[q];
        if (b < end) {
            refgeo_vj *hj = own + (j0 + q) * K;
            double top = hj[0].v < cother[q] ? hj[0].v : cother[q];
            for (e = b; e < end; e++) {
                if (sorted[e].v < top) {
                    refgeo_heap_replace_top(hj, K, sorted[e].v, (int64_t)(i0 + sorted[e].ii));
                    top = hj[0].v < cother[q] ? hj[0].v : cother[q];
                }
            }
            ctop[q] = top;
            b = end;
        }
    }
}

/* NAME(G, bi, bj, i0, j0, nA, nB, symmetric, self_idx, K, own, heaps, stride,
 *      n_heaps, scratch):
 * own is the calling thread's heaps of all rows (row r at r * K records), heaps the
 * first of the n_heaps threads' heaps (own among them, stride records apart); scratch
 * holds REFGEO_KNN_SCRATCH_BYTES(max(bi, bj)) bytes.  self_idx[i] is the column row
 * i must not match (-1: none).
 *
 * Shared threshold.  Each thread keeps its own heaps, so without help a row's
 * heaps would each fill up from its own share of the candidates: twice the
 * insertions of one heap on two threads.  A key is instead tried only below the
 * smallest top of the row's heaps on all threads (read when the tile starts; a
 * stale top is larger, hence still safe).  This is exact: a full heap holds K keys
 * at or below its top, so the K smallest keys of the row lie at or below every
 * top, and a key not below some thread's top is never needed among them; the
 * merged heaps (refgeo_ext/_knn.pyx.tp) still hold the row's K smallest keys, and
 * every pair they leave out has a key at or above the K-th of them.  A heap may
 * now end with fewer than K keys (id -1 in the empty slots). */
#define REFGEO_DEFINE_KNN_TILE(NAME, T, MASK)                                           \
    REFGEO_TARGET_CLONES static void NAME(                                                 \
        const T *G, ptrdiff_t bi, ptrdiff_t bj, ptrdiff_t i0, ptrdiff_t j0,             \
        const double *nA, const double *nB, int symmetric, const int64_t *self_idx,     \
        ptrdiff_t K, refgeo_vj *own, const refgeo_vj *heaps, ptrdiff_t stride,          \
        int n_heaps, void *scratch)                                                     \
    {                                                                                   \
        ptrdiff_t ii, jb, q;                                                            \
        const double *nb = nB + j0;                                                     \
        double *rother = (double *)scratch;                                             \
        double *cother = rother + bi;                                                   \
        double *ctop = cother + bj;                                                     \
        refgeo_knn_pend *pend = (refgeo_knn_pend *)(ctop + bj);                         \
        refgeo_knn_pend *sorted = pend + REFGEO_KNN_PENDING;                            \
        ptrdiff_t *start = (ptrdiff_t *)(sorted + REFGEO_KNN_PENDING);                  \
        unsigned char *mask = (unsigned char *)(start + bj + 1);                        \
        ptrdiff_t n_pend = 0;                                                           \
        refgeo_knn_prefetch_heaps(own, i0, bi, K);                                      \
        refgeo_knn_other_tops(heaps, stride, n_heaps, own, i0, bi, K, rother);          \
        if (symmetric) {                                                                \
            refgeo_knn_prefetch_heaps(own, j0, bj, K);                                  \
            refgeo_knn_other_tops(heaps, stride, n_heaps, own, j0, bj, K, cother);      \
            for (q = 0; q < bj; q++) {                                                  \
                double t = own[(j0 + q) * K].v;                                         \
                ctop[q] = t < cother[q] ? t : cother[q];                                \
            }                                                                           \
        }                                                                               \
        for (q = bj; q < bj + 8; q++)                                                   \
            mask[q] = 0;                                                                \
        for (ii = 0; ii < bi; ii++) {                                                   \
            const ptrdiff_t i = i0 + ii;                                                \
            const T *row = G + ii * bj;                                                 \
            refgeo_vj *hi = own + i * K;                                                \
            const double ni = nA[i];                                                    \
            const int64_t sidx = self_idx[i];                                           \
            const double rt = rother[ii];                                               \
            double top = hi[0].v < rt ? hi[0].v : rt;                                   \
            if (symmetric)                                                              \
                MASK##_sym(row, nb, ctop, top, ni, mask, bj);                           \
            else                                                                        \
                MASK##_row(row, nb, top, mask, bj);                                     \
            for (jb = 0; jb < bj; jb += 8) {                                            \
                uint64_t word = refgeo_mask_word(mask + jb);                            \
                if (word == 0)                                                          \
                    continue;                                                           \
                while (word != 0) {                                                     \
                    const ptrdiff_t c = jb + refgeo_lowest_byte(word);                  \
                    const int64_t j = j0 + c;                                           \
                    double g2, v;                                                       \
                    word &= word - 1;                                                   \
                    if (j == sidx)                                                      \
                        continue;                                                       \
                    g2 = 2.0 * (double)row[c];                                          \
                    v = nb[c] - g2;                                                     \
                    if (v < top) {                                                      \
                        refgeo_heap_replace_top(hi, K, v, j);                           \
                        top = hi[0].v < rt ? hi[0].v : rt;                              \
                    }                                                                   \
                    if (symmetric) {                                                    \
                        v = ni - g2;                                                    \
                        if (v < ctop[c]) {                                              \
                            pend[n_pend].v = v;                                         \
                            pend[n_pend].ii = (int32_t)ii;                              \
                            pend[n_pend].c = (int32_t)c;                                \
                            if (++n_pend == REFGEO_KNN_PENDING) {                       \
                                refgeo_knn_flush_columns(pend, n_pend, sorted, start,   \
                                                         bj, own, i0, j0, K, ctop,      \
                                                         cother);                       \
                                n_pend = 0;                                             \
                            }                                                           \
                        }                                                               \
                    }                                                                   \
                }                                                                       \
            }                                                                           \
        }                                                                               \
        if (n_pend > 0)                                                                 \
            refgeo_knn_flush_columns(pend, n_pend, sorted, start, bj, own, i0, j0, K,   \
                                     ctop, cother);                                     \
    }

REFGEO_DEFINE_KNN_TILE(refgeo_knn_tile_f64, double, refgeo_knn_mask_f64)
REFGEO_DEFINE_KNN_TILE(refgeo_knn_tile_f32, float, refgeo_knn_mask_f32)

#endif /* REFGEO_KNN_H */
