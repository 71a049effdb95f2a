/* Row scans of the extreme-pair tile epilogues (refgeo_ext/_extreme_pairs.pyx.tp).
 *
 * Once the running bound is good (the diameter is seeded with a refined distance
 * near the maximum), almost no pair of a tile can reach it: 4 pairs of 33 million
 * are refined for 8192 Gaussian rows.  Each tile row is therefore first tested with
 * one of these scans; only a row with a candidate runs the pair-by-pair loop, which
 * then finds exactly the pairs it would have found alone (the scan uses the
 * threshold the row starts with, and thresholds only tighten).
 */
#ifndef REFGEO_PAIRS_H
#define REFGEO_PAIRS_H

#include <stddef.h>
#include <stdint.h>
#include <math.h>

#include "refine.h"

/* Whether some q < n has w[q] - 2 g[q] >= thr (ge) or <= thr (le), computed as the
 * tile epilogues of the extreme pairs compute it (2 g exact, one rounded
 * subtraction): one branch-free pass that the compiler vectorizes, so that a tile
 * row with no candidate (almost all of them once the running bound is good) costs
 * a fraction of a cycle per entry. */
#define REFGEO_DEFINE_ANY(NAME, T, OP)                                                  \
    REFGEO_TARGET_CLONES static int NAME(const T *restrict g, const double *restrict w, \
                                         double thr, ptrdiff_t n)                       \
    {                                                                                   \
        ptrdiff_t q;                                                                    \
        int64_t hit = 0;                                                                \
        for (q = 0; q < n; q++)                                                         \
            hit |= (int64_t)(w[q] - 2.0 * (double)g[q] OP thr);                         \
        return hit != 0;                                                                \
    }

REFGEO_DEFINE_ANY(refgeo_any_ge_f64, double, >=)
REFGEO_DEFINE_ANY(refgeo_any_ge_f32, float, >=)
REFGEO_DEFINE_ANY(refgeo_any_le_f64, double, <=)
REFGEO_DEFINE_ANY(refgeo_any_le_f32, float, <=)

/* *lo = min over q < n of wl[q] - 2 g[q], *hi = the same with wh (the closest pair's
 * lower and upper ends of a tile row, up to the row's own terms), each computed as the
 * pair-by-pair loop computes it (2 g exact, one rounded subtraction), so the minima are
 * bitwise the loop's.  Eight independent lanes, each a select (exact on the finite
 * values the kernels see), which the compiler vectorizes: a scalar minimum is a chain
 * of dependent compares, and the closest pair's tile epilogue spent as long in it as
 * in the GEMM at d = 64. */
#define REFGEO_DEFINE_MIN2(NAME, T)                                                      \
    REFGEO_TARGET_CLONES static void NAME(const T *restrict g, const double *restrict wl, \
                                          const double *restrict wh, ptrdiff_t n,         \
                                          double *lo, double *hi)                         \
    {                                                                                     \
        double ml[8], mh[8], a, b;                                                        \
        ptrdiff_t q = 0;                                                                  \
        int l;                                                                            \
        for (l = 0; l < 8; l++) {                                                         \
            ml[l] = INFINITY;                                                             \
            mh[l] = INFINITY;                                                             \
        }                                                                                 \
        for (; q + 8 <= n; q += 8) {                                                      \
            for (l = 0; l < 8; l++) {                                                     \
                double g2 = 2.0 * (double)g[q + l];                                       \
                a = wl[q + l] - g2;                                                       \
                b = wh[q + l] - g2;                                                       \
                ml[l] = a < ml[l] ? a : ml[l];                                            \
                mh[l] = b < mh[l] ? b : mh[l];                                            \
            }                                                                             \
        }                                                                                 \
        for (l = 0; q < n; q++, l++) {                                                    \
            double g2 = 2.0 * (double)g[q];                                               \
            a = wl[q] - g2;                                                               \
            b = wh[q] - g2;                                                               \
            ml[l] = a < ml[l] ? a : ml[l];                                                \
            mh[l] = b < mh[l] ? b : mh[l];                                                \
        }                                                                                 \
        a = INFINITY;                                                                     \
        b = INFINITY;                                                                     \
        for (l = 0; l < 8; l++) {                                                         \
            a = ml[l] < a ? ml[l] : a;                                                    \
            b = mh[l] < b ? mh[l] : b;                                                    \
        }                                                                                 \
        *lo = a;                                                                          \
        *hi = b;                                                                          \
    }

REFGEO_DEFINE_MIN2(refgeo_min2_f64, double)
REFGEO_DEFINE_MIN2(refgeo_min2_f32, float)

#endif /* REFGEO_PAIRS_H */
