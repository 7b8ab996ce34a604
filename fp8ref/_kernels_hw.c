/* The NVIDIA "fused" tensor-core datapath of fp8ref.hardware (fdpa.fused_step), chained over K,
 * called through ctypes. Finite operands only: the caller routes NaN/Inf (operands, scales, C) to
 * the numpy model.
 *
 * For every output (m, n) and every step [k0, k0 + L) of K, with C the running accumulator:
 *     E   = max(e_a[m,k] + e_b[k,n] (+ scale exponents) over the step, e_C)   (e_C = e_zero for C = 0;
 *           also e_zero when `zero_in` and some product of the step is zero)
 *     S   = sum_k trunc(a[m,k] * b[k,n] * 2**(F - E + es)) + trunc(C * 2**(F - E))    (integers)
 *     C   = round-toward-zero(S * 2**(E - F)) to `out_bits` fraction bits, exponent >= -126
 * Every quantity is exact: a * b (at most 8 significant bits) is exact in fp32, scaling it by a
 * power of two is exact, each truncated term is below 2**(F + 2) (< 2**31, converted by cvttps), the
 * sums are int64, and S * 2**(E - F) is exact in float64 (S < 2**53). Rounding toward zero is then a
 * mask on the float64 mantissa. The numpy model computes the same integers; the bytes agree.
 *
 * Loop order: columns in chunks of NB lanes (the vectorised axis), then steps, then rows, so a
 * step's B rows (L x NB) stay in L1 while every row of A passes over them.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "_kernels.h"

#define NB 256
#define ZERO_EXP (-(1 << 20)) /* alignment exponent of a zero operand: below everything */

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
#define HW_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define HW_CLONES
#endif

static inline float pow2f(int x) { /* 2**x for -126 <= x <= 127 */
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)(x + 127) << 23;
    return v.f;
}

static inline double pow2d(int x) { /* 2**x for -1022 <= x <= 1023 */
    union { uint64_t u; double d; } v;
    v.u = (uint64_t)(x + 1023) << 52;
    return v.d;
}

/* round-toward-zero of the exact v = S * 2**(E - F) (S an integer held in a double) to out_bits
 * fraction bits with exponent >= -126: clear the low mantissa bits of v; written branch-free so it
 * vectorises. A value >= 2**128 stays >= 2**128 and converts to infinity. */
static inline float normalise_rz(double S, int E, int F, int out_bits) {
    union { double d; uint64_t u; } v;
    v.d = S * pow2d(E - F);
    int ev = (int)((v.u >> 52) & 0x7ff) - 1023;
    int drop = 52 - out_bits + (ev < -126 ? -126 - ev : 0);
    v.u = drop >= 53 ? 0 : v.u & ~((UINT64_C(1) << (drop & 63)) - 1);
    return (float)v.d;
}

/* One column chunk [j0, j0 + w) of one row m over one step [k0, k0 + L). The step's sum is int32
 * when every term and partial sum fits (wide == 0: F <= 23, L <= 32), else float64 (exact integers). */
static inline __attribute__((always_inline)) void step_row(
    const float *a_row, const int32_t *ea_row, const float *B, const int32_t *EB, size_t N, size_t j0,
    size_t w, size_t k0, size_t L, int32_t sa, const int32_t *sb_row, float *cr, int F, int out_bits,
    int e_zero, int zero_in, int wide) {
    int32_t emax[NB], emin[NB], es[NB], isum[NB];
    float up[NB];
    double dsum[NB];
    for (size_t j = 0; j < w; j++) {
        es[j] = sa + (sb_row ? sb_row[j] : 0);
        uint32_t bits;
        memcpy(&bits, cr + j, 4);
        int field = (int)((bits >> 23) & 0xff);
        emax[j] = (bits & 0x7fffffffu) ? (field > 0 ? field : 1) - 127 : e_zero;
        emin[j] = 0;
        isum[j] = 0;
        dsum[j] = 0;
    }
    for (size_t k = k0; k < k0 + L; k++) {
        const int32_t e = ea_row[k];
        const int32_t *eb_k = EB + k * N + j0;
        if (zero_in) {
            for (size_t j = 0; j < w; j++) {
                int32_t x = e + eb_k[j] + es[j];
                emax[j] = x > emax[j] ? x : emax[j];
                emin[j] = x < emin[j] ? x : emin[j];
            }
        } else {
            for (size_t j = 0; j < w; j++) {
                int32_t x = e + eb_k[j] + es[j];
                emax[j] = x > emax[j] ? x : emax[j];
            }
        }
    }
    for (size_t j = 0; j < w; j++) {
        int32_t E = emax[j];
        if (zero_in) E = (emin[j] < ZERO_EXP / 2 && E < e_zero) ? e_zero : E;
        emax[j] = E;
        int32_t x = F - E + es[j];
        up[j] = pow2f(x < -126 ? -126 : (x > 127 ? 127 : x));
    }
    for (size_t k = k0; k < k0 + L; k++) {
        const float a = a_row[k];
        const float *b_k = B + k * N + j0;
        if (wide)
            for (size_t j = 0; j < w; j++) dsum[j] += (double)(int32_t)((a * b_k[j]) * up[j]);
        else
            for (size_t j = 0; j < w; j++) isum[j] += (int32_t)((a * b_k[j]) * up[j]);
    }
    for (size_t j = 0; j < w; j++) {
        const int E = emax[j];
        const double tc = (double)(int32_t)((double)cr[j] * pow2d(F - E)); /* |C term| < 2**(F + 1) */
        cr[j] = normalise_rz((wide ? dsum[j] : (double)isum[j]) + tc, E, F, out_bits);
    }
}

/* pa, ea: a values (fp32) and alignment exponents, (nbatch, M, K); pb, eb: (nbatch, K, N);
 * esa (nbatch, M, K / L), esb (nbatch, K / L, N): scale exponents or NULL; c (nbatch, M, N) in/out.
 * Processes batches [b0, b1) and columns [n0, n1). */
HW_CLONES
void fp8ref_hw_fused(const float *pa, const int32_t *ea, const float *pb, const int32_t *eb,
                     const int32_t *esa, const int32_t *esb, float *c, size_t M, size_t N, size_t K,
                     size_t L, int64_t F, int64_t out_bits, int64_t e_zero, int64_t zero_in, size_t b0,
                     size_t b1, size_t n0, size_t n1) {
    const size_t S = K / L;
    const int wide = F > 23 || L > 32;
    for (size_t bt = b0; bt < b1; bt++) {
        const float *A = pa + bt * M * K, *B = pb + bt * K * N;
        const int32_t *EA = ea + bt * M * K, *EB = eb + bt * K * N;
        const int32_t *SA = esa ? esa + bt * M * S : NULL, *SB = esb ? esb + bt * S * N : NULL;
        float *C = c + bt * M * N;
        for (size_t j0 = n0; j0 < n1; j0 += NB) {
            const size_t w = (n1 - j0 < NB) ? n1 - j0 : NB;
            for (size_t s = 0; s < S; s++)
                for (size_t m = 0; m < M; m++) {
                    const int32_t sa = SA ? SA[m * S + s] : 0;
                    const int32_t *sb_row = SB ? SB + s * N + j0 : NULL;
                    if (wide)
                        step_row(A + m * K, EA + m * K, B, EB, N, j0, w, s * L, L, sa, sb_row, C + m * N + j0,
                                 (int)F, (int)out_bits, (int)e_zero, (int)zero_in, 1);
                    else
                        step_row(A + m * K, EA + m * K, B, EB, N, j0, w, s * L, L, sa, sb_row, C + m * N + j0,
                                 (int)F, (int)out_bits, (int)e_zero, (int)zero_in, 0);
                }
        }
    }
}

/* The parallel task (fp8ref_parallel, _native.parallel): units [lo, hi) are batches, or column
 * panels of every batch; outputs are independent, so the bytes never depend on the split. */
void fp8ref_hw_fused_task(const hw_job *j, size_t lo, size_t hi) {
    size_t b0 = 0, b1 = j->nbatch, n0 = 0, n1 = j->N;
    if (j->by_batch) {
        b0 = lo;
        b1 = hi;
    } else {
        n0 = lo * j->panel;
        n1 = hi * j->panel < j->N ? hi * j->panel : j->N;
    }
    fp8ref_hw_fused(j->pa, j->ea, j->pb, j->eb, j->esa, j->esb, j->c, j->M, j->N, j->K, j->L, j->F, j->out_bits,
                    j->e_zero, j->zero_in, b0, b1, n0, n1);
}
