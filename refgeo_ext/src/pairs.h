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

#endif /* REFGEO_PAIRS_H */
