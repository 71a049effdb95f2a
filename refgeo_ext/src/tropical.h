/*
 * Tropical (max-minus-min) reduction kernels for pairwise Hilbert distances of logits.
 *
 * For two rows a, b of length K the Hilbert distance of their softmaxes is
 *     max_k (b_k - a_k) - min_k (b_k - a_k).
 * No GEMM identity applies to max/min, so this is a streaming kernel of its own.
 *
 * refgeo_trop4_<suf>(a0..a3, b, K, mx, mn, ldm) folds the column range [0, K) of the four
 * row pairs (a_r, b) into running maxima mx[r*ldm] and minima mn[r*ldm].  Four rows of A share
 * each load of b (register blocking); the inner loop uses GCC vector extensions so the
 * same source gives SSE2, AVX2 or AVX-512 code (function multiversioning on x86-64 Linux).
 *
 * Exactness: b_k - a_k is one IEEE subtraction in the input type, and max/min select
 * values without rounding, so the float64 kernel returns bit-for-bit the values of the
 * float64 reference.  No fast-math flags: comparisons and selects only, NaN never reaches
 * here (inputs are validated finite in Python).
 */
#ifndef REFGEO_TROPICAL_H
#define REFGEO_TROPICAL_H

#include <stddef.h>
#include <string.h>
#include <math.h>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define REFGEO_MULTIVERSION __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define REFGEO_MULTIVERSION
#endif

typedef float refgeo_vf32 __attribute__((vector_size(32)));
typedef int refgeo_vi32 __attribute__((vector_size(32)));
typedef double refgeo_vf64 __attribute__((vector_size(32)));
typedef long long refgeo_vi64 __attribute__((vector_size(32)));

#define REFGEO_DEFINE_TROP4(SUF, T, VT, VI)                                              \
static inline VT refgeo_vload_##SUF(const T *p) {                                       \
    VT v; memcpy(&v, p, sizeof(v)); return v;                                            \
}                                                                                        \
/* Lane-wise select written as a loop: GCC's SLP vectoriser turns it into one     */     \
/* (v)maxps/(v)minps, whose semantics (a > b ? a : b) it matches exactly.          */     \
static inline __attribute__((always_inline)) VT refgeo_vmax_##SUF(VT a, VT b) {          \
    VT r;                                                                                \
    for (int l = 0; l < (int)(sizeof(VT) / sizeof(T)); l++) r[l] = a[l] > b[l] ? a[l] : b[l]; \
    return r;                                                                            \
}                                                                                        \
static inline __attribute__((always_inline)) VT refgeo_vmin_##SUF(VT a, VT b) {          \
    VT r;                                                                                \
    for (int l = 0; l < (int)(sizeof(VT) / sizeof(T)); l++) r[l] = a[l] < b[l] ? a[l] : b[l]; \
    return r;                                                                            \
}                                                                                        \
REFGEO_MULTIVERSION                                                                      \
static void refgeo_trop4_##SUF(const T *a0, const T *a1, const T *a2, const T *a3,      \
                               const T *b, ptrdiff_t K, T *mx, T *mn, ptrdiff_t ldm)                    \
{                                                                                        \
    enum { W = (int)(sizeof(VT) / sizeof(T)) };                                          \
    const VT ninf = (VT){0} - (T)INFINITY, pinf = (VT){0} + (T)INFINITY;                 \
    VT M0 = ninf, M1 = ninf, M2 = ninf, M3 = ninf;                                       \
    VT N0 = pinf, N1 = pinf, N2 = pinf, N3 = pinf;                                       \
    ptrdiff_t k = 0;                                                                     \
    for (; k + W <= K; k += W) {                                                         \
        VT vb = refgeo_vload_##SUF(b + k), d;                                            \
        d = vb - refgeo_vload_##SUF(a0 + k);                                             \
        M0 = refgeo_vmax_##SUF(d, M0); N0 = refgeo_vmin_##SUF(d, N0);                    \
        d = vb - refgeo_vload_##SUF(a1 + k);                                             \
        M1 = refgeo_vmax_##SUF(d, M1); N1 = refgeo_vmin_##SUF(d, N1);                    \
        d = vb - refgeo_vload_##SUF(a2 + k);                                             \
        M2 = refgeo_vmax_##SUF(d, M2); N2 = refgeo_vmin_##SUF(d, N2);                    \
        d = vb - refgeo_vload_##SUF(a3 + k);                                             \
        M3 = refgeo_vmax_##SUF(d, M3); N3 = refgeo_vmin_##SUF(d, N3);                    \
    }                                                                                    \
    T m[4] = {mx[0], mx[ldm], mx[2 * ldm], mx[3 * ldm]};                                  \
    T n[4] = {mn[0], mn[ldm], mn[2 * ldm], mn[3 * ldm]};          \
    for (int l = 0; l < W; l++) {                                                        \
        if (M0[l] > m[0]) m[0] = M0[l];                                                  \
        if (M1[l] > m[1]) m[1] = M1[l];                                                  \
        if (M2[l] > m[2]) m[2] = M2[l];                                                  \
        if (M3[l] > m[3]) m[3] = M3[l];                                                  \
        if (N0[l] < n[0]) n[0] = N0[l];                                                  \
        if (N1[l] < n[1]) n[1] = N1[l];                                                  \
        if (N2[l] < n[2]) n[2] = N2[l];                                                  \
        if (N3[l] < n[3]) n[3] = N3[l];                                                  \
    }                                                                                    \
    const T *a[4] = {a0, a1, a2, a3};                                                    \
    for (; k < K; k++) {                                                                 \
        for (int r = 0; r < 4; r++) {                                                    \
            T d = b[k] - a[r][k];                                                        \
            if (d > m[r]) m[r] = d;                                                      \
            if (d < n[r]) n[r] = d;                                                      \
        }                                                                                \
    }                                                                                    \
    for (int r = 0; r < 4; r++) { mx[r * ldm] = m[r]; mn[r * ldm] = n[r]; }                          \
}

REFGEO_DEFINE_TROP4(f32, float, refgeo_vf32, refgeo_vi32)
REFGEO_DEFINE_TROP4(f64, double, refgeo_vf64, refgeo_vi64)

#endif /* REFGEO_TROPICAL_H */
