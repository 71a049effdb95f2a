"""Tolerances of the approximate comparisons, each derived from the unit roundoff.

Certified / exact quantities match the float64 reference exactly; approximate ones
get an eps-derived bound with the reason next to it.
"""

import numpy as np

EPS32 = float(np.finfo(np.float32).eps)  # 2**-23
EPS64 = float(np.finfo(np.float64).eps)  # 2**-52


def pairwise_logits_atol(dtype, max_abs_diff):
    """Absolute error allowed for a pairwise logit distance.

    float64: exact (one rounding per difference, max/min exact, same operations).
    float32: each difference is rounded once in float32 (relative error 2**-24), so the
    max and the min each move by at most 2**-24 times their size; the sum of the two is
    at most 2 * 2**-24 * max|d| = EPS32 * max|d|.
    """
    if np.dtype(dtype) == np.float64:
        return 0.0
    return EPS32 * max_abs_diff

