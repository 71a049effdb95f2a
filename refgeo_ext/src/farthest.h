/* The farthest partners' tile epilogue, shared by the single-machine kernel
 * (refgeo_ext/_extreme_pairs.pyx.tp) and the Dask block-pair kernel
 * (refgeo_ext/_knn_blocks.pyx.tp).
 *
 * One call handles one GEMM tile G (bi x bj, row-major: G[ii * bj + jj] = x_i . y_j)
 * in both directions: row i of the tile may get partner j, and row j may get
 * partner i.  The rows' and the columns' state (L: certified lower bound on the
 * row's farthest refined value; B, Bj: its best refined value and partner so far)
 * are passed as pointers to the tile's first row and first column, so the columns
 * may live in the same arrays as the rows (one matrix, the single-machine kernel)
 * or in another block's (the Dask task).  ``row_id0`` and ``col_id0`` are the
 * partner ids stored for the tile's first row and first column.
 *
 *   pass 1: certified lower bounds f - e, row and column maxima -> L
 *   pass 2: refine (i, j) when its upper bound f + e reaches row i's or row j's
 *           certified value max(L, B); update both rows with the tie rule (among
 *           equal refined values the smaller partner id)
 *
 * f_ij = n_i + n_j - 2 G_ij and e_ij = c (n_i + n_j) + e_abs (refgeo's rounding
 * bound, whose 16 u64 term covers the rounding of these comparisons), so every pair
 * attaining a row's farthest value is refined, whatever the tile size.  No pointer
 * is restrict: on a diagonal tile the row and column state alias.
 *
 * ``cI`` and ``cJ`` (NULL: not counted) get, per tile row and per tile column, the
 * number of refined pairs that row's or column's bound asked for and that came out
 * below its best so far (this thread's), added to what they hold: refinements a finer filter could
 * have spared (an exact tie with the best, which any filter must refine, is not
 * counted).  The single-machine kernel stops a float32 filter's run when rows waste
 * more refinements than a float64 filter would cost them.
 */
#ifndef REFGEO_FARTHEST_H
#define REFGEO_FARTHEST_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "refine.h"

#define REFGEO_DEFINE_FARTHEST_TILE(NAME, T, ST, SQDIST)                                   \
    static void NAME(const T *G, ptrdiff_t bi, ptrdiff_t bj, int diag, const double *nI,   \
                     const double *nJ, const ST *SI, const ST *SJ, ptrdiff_t d,            \
                     int64_t row_id0, int64_t col_id0, double cp, double eabs, double *w,  \
                     double *colv, double *LI, double *BI, int64_t *BjI, double *LJ,       \
                     double *BJ, int64_t *BjJ, int64_t *nref, ptrdiff_t *cI,               \
                     ptrdiff_t *cJ)                                                        \
    {                                                                                      \
        ptrdiff_t ii, jj, jstart;                                                          \
        const T *row;                                                                      \
        double ni, v, m, rowT, r;                                                          \
        int64_t pi, pj;                                                                    \
        for (jj = 0; jj < bj; jj++) {                                                      \
            w[jj] = (1.0 - cp) * nJ[jj];                                                   \
            colv[jj] = -INFINITY;                                                          \
        }                                                                                  \
        for (ii = 0; ii < bi; ii++) {                                                      \
            row = G + ii * bj;                                                             \
            jstart = diag ? ii + 1 : 0;                                                    \
            ni = (1.0 - cp) * nI[ii] - eabs;                                               \
            m = -INFINITY;                                                                 \
            for (jj = jstart; jj < bj; jj++) {                                             \
                v = w[jj] - 2.0 * (double)row[jj] + ni;                                    \
                if (v > m)                                                                 \
                    m = v;                                                                 \
                if (v > colv[jj])                                                          \
                    colv[jj] = v;                                                          \
            }                                                                              \
            if (m > LI[ii])                                                                \
                LI[ii] = m;                                                                \
        }                                                                                  \
        for (jj = 0; jj < bj; jj++)                                                        \
            if (colv[jj] > LJ[jj])                                                         \
                LJ[jj] = colv[jj];                                                         \
        for (jj = 0; jj < bj; jj++) {                                                      \
            w[jj] = (1.0 + cp) * nJ[jj];                                                   \
            colv[jj] = LJ[jj] > BJ[jj] ? LJ[jj] : BJ[jj];                                  \
        }                                                                                  \
        for (ii = 0; ii < bi; ii++) {                                                      \
            row = G + ii * bj;                                                             \
            jstart = diag ? ii + 1 : 0;                                                    \
            ni = (1.0 + cp) * nI[ii] + eabs;                                               \
            rowT = LI[ii] > BI[ii] ? LI[ii] : BI[ii];                                      \
            pi = row_id0 + ii;                                                             \
            for (jj = jstart; jj < bj; jj++) {                                             \
                v = w[jj] - 2.0 * (double)row[jj] + ni;                                    \
                if (v >= rowT || v >= colv[jj]) {                                          \
                    pj = col_id0 + jj;                                                     \
                    r = SQDIST(SI + ii * d, SJ + jj * d, d);                               \
                    nref[0] += 1;                                                          \
                    if (cI != NULL && v >= rowT && r < BI[ii])                             \
                        cI[ii] += 1;                                                       \
                    if (cJ != NULL && v >= colv[jj] && r < BJ[jj])                         \
                        cJ[jj] += 1;                                                       \
                    if (r > BI[ii] || (r == BI[ii] && pj < BjI[ii])) {                     \
                        BI[ii] = r;                                                        \
                        BjI[ii] = pj;                                                      \
                        if (r > rowT)                                                      \
                            rowT = r;                                                      \
                    }                                                                      \
                    if (r > BJ[jj] || (r == BJ[jj] && pi < BjJ[jj])) {                     \
                        BJ[jj] = r;                                                        \
                        BjJ[jj] = pi;                                                      \
                        if (r > colv[jj])                                                  \
                            colv[jj] = r;                                                  \
                    }                                                                      \
                }                                                                          \
            }                                                                              \
        }                                                                                  \
    }

/* Variants by (filter dtype, dtype of the original rows): 64, 32, 32s64. */
REFGEO_DEFINE_FARTHEST_TILE(refgeo_farthest_tile_64, double, double, refgeo_sqdist_f64)
REFGEO_DEFINE_FARTHEST_TILE(refgeo_farthest_tile_32, float, float, refgeo_sqdist_f32)
REFGEO_DEFINE_FARTHEST_TILE(refgeo_farthest_tile_32s64, float, double, refgeo_sqdist_f64)

#endif /* REFGEO_FARTHEST_H */
