/* The tensor-core datapaths of fp8ref.hardware (fdpa.fused_step, fdpa.pairwise_step) chained over
 * K, and the FP32 promotion of a kernel (hardware.kernels), as tasks over (batch, column chunk)
 * units. Finite operands only: fp8ref.hardware.native routes NaN/Inf (operands, scales, C) to the
 * numpy model.
 *
 * Codes are decoded here, once per step and column chunk for B and once per row and step for A,
 * through 256-entry tables built by native.py from the format's parameters: an fp32 value (FP8/6/4
 * values are fp32-exact) and an int16 alignment exponent (zero: HW_ZERO, so that a product with a
 * zero operand sits below every nonzero one even with two block scales added: |scale exp| <= 127).
 *
 * fused (NVIDIA), for every output (m, n) and every step [k0, k0 + L) of K, C the running value:
 *     E   = max(e_a[m,k] + e_b[k,n] (+ scale exponents) over the step, e_C)   (e_C = e_zero for C = 0;
 *           also e_zero when `zero_in` and some product of the step is zero)
 *     S   = sum_k trunc(a[m,k] * b[k,n] * 2**(F - E + es)) + trunc(C * 2**(F - E))    (integers)
 *     C   = round-toward-zero(S * 2**(E - F)) to `out_bits` fraction bits, exponent >= -126
 * Every quantity is exact: a * b (at most 8 significant bits) is exact in fp32, scaling it by a
 * power of two is exact, each truncated term is below 2**(F + 2) (< 2**31, converted by cvttps), the
 * sums are int32 (F <= 23, L <= 32, no block scales: below 2**31) or int64. Rounding toward zero
 * clears the low bits of |S|, and the kept bits times 2**(E - F) are exact (normalise_rz*). The
 * numpy model computes the same integers; the bytes agree (tests/hardware/test_fused_c.py).
 *
 * pairwise (AMD CDNA3 FP8 MFMA): the even and the odd products of a step are fused separately with F
 * fraction bits (int32 sums S0, S1 at exponents E0, E1), combined by floor at e_dot = max(E0, E1),
 * aligned with C at e_max = max(e_dot, e_C) (products floored to F2 + 1 fraction bits, C to F),
 * floored to F2 fraction bits of the result and rounded to nearest fp32; the integers are those of
 * fdpa.pairwise_step (int64 arithmetic shifts are floors).
 *
 * Promotion (fused only): every `promote` steps, and after the last, the row's tensor-core value d
 * goes into the FP32 register accumulator, acc = fp32(acc + fp32(d * s)) or fma(d, s, acc) with s =
 * fp32(psa[m, p] * psb[p, n]) (1 without promotion scales), and d restarts at +0.
 *
 * Loop order per unit: steps, then rows, so a step's decoded B slab (L x NB values and exponents,
 * 24 KiB) stays in L1 while every row of A passes over it; the inner loops run over NB columns.
 * Where the CPU has AVX-512 VNNI and VBMI, hw_avx512.c takes the whole units of the FP8
 * instructions with F <= 13 and f32 results (Hopper, Ada): same integers, fewer instructions a product.
 */
#include <math.h>
#include <stdlib.h>

#include "kernels.h"

#define NB HW_NB
#define HW_ZERO_SUM (-2048) /* below it: a product with a zero operand */
#define HW_LMAX 64

static inline float pow2f(int x) { /* 2**x for -126 <= x <= 127 */
    return f32_of((uint32_t)(x + 127) << 23);
}

static inline double pow2d(int x) { /* 2**x for -1022 <= x <= 1023 */
    uint64_t u = (uint64_t)(x + 1023) << 52;
    double d;
    memcpy(&d, &u, 8);
    return d;
}

/* round-toward-zero of the exact v = S * 2**(E - F) (S an integer, |S| < 2**53) to out_bits fraction
 * bits with exponent >= -126: v is exact in double (a normal one: |v| >= 2**-175), so clearing the
 * low bits of its significand below the kept ones (more below the subnormal grid, all when v is below
 * it) is the rounding, and the kept value converts to float32 exactly (or, >= 2**128, to infinity).
 * 64-bit integer and double lanes only: gcc vectorises the loops that call it. */
FP8REF_INLINE float normalise_rz(int64_t S, int E, int F, int out_bits) {
    const double v = (double)S * pow2d(E - F);
    uint64_t u = bits64_of(v);
    const int ex = (int)((u >> 52) & 0x7ff) - 1023;
    const int drop = 52 - out_bits + (ex < -126 ? -126 - ex : 0);
    const uint64_t low = (1ull << (drop < 53 ? drop : 63)) - 1; /* past 52: the sign bit alone stays */
    u &= ~low;
    double r;
    memcpy(&r, &u, 8);
    return (float)r + 0.0f; /* + 0.0f: never -0, as the model */
}

/* 32 exponent lanes (int16) and 16 value lanes (fp32, int32) as GCC generic vectors: the hot loops
 * keep their running max and sums in registers across k (gcc 12 does not interchange the plain
 * loops); each target clone lowers them to its own vector width. */
#define VL 32
#pragma GCC diagnostic ignored "-Wpsabi" /* the default clone passes them in memory: inline only, no ABI */
typedef int16_t v32hi __attribute__((vector_size(64)));
typedef float v16sf __attribute__((vector_size(64)));
typedef int32_t v16si __attribute__((vector_size(64)));

FP8REF_INLINE v32hi vload_hi(const int16_t *p) { v32hi v; memcpy(&v, p, sizeof v); return v; }
FP8REF_INLINE void vstore_hi(int16_t *p, v32hi v) { memcpy(p, &v, sizeof v); }
FP8REF_INLINE v16sf vload_sf(const float *p) { v16sf v; memcpy(&v, p, sizeof v); return v; }
FP8REF_INLINE v32hi vmax_hi(v32hi a, v32hi b) { v32hi m = a > b; return (a & m) | (b & ~m); }
FP8REF_INLINE v32hi vmin_hi(v32hi a, v32hi b) { v32hi m = a < b; return (a & m) | (b & ~m); }
typedef int16_t v16hi __attribute__((vector_size(32))); /* 16 columns (the pairwise loop: CDNA3's n is 16 or 32) */
FP8REF_INLINE v16hi vload16_hi(const int16_t *p) { v16hi v; memcpy(&v, p, sizeof v); return v; }
FP8REF_INLINE v16hi vmax16_hi(v16hi a, v16hi b) { v16hi m = a > b; return (a & m) | (b & ~m); }

/* normalise_rz for int32 S where 2**(E - F) lies in [2**-162, 2**114] (no block scales, F <= 23):
 * 16 lanes a vector instead of 8. |S| keeps at most 24 bits, so (float)|S| is exact; the scaling by
 * 2**(E - F) is split in two normal powers when tiny, each product exact (the result is on the fp32
 * grid) or overflowing to infinity (the value is >= 2**128). */
FP8REF_INLINE float normalise_rz32(int32_t S, int E, int F, int out_bits) {
    uint32_t mag = (uint32_t)(S < 0 ? -S : S);
    const int top = 31 - __builtin_clz(mag | 1);
    const int below = -126 - (top + E - F);
    int drop = top - out_bits + (below > 0 ? below : 0);
    drop = drop < 0 ? 0 : (drop < 31 ? drop : 31);
    mag = (mag >> drop) << drop;
    const float m = (float)(int32_t)mag;
    const int x = E - F, lo = x < -100 ? -64 : 0;
    return (S < 0 ? -m : m) * pow2f(x - lo) * pow2f(lo) + 0.0f; /* + 0.0f: never -0, as the model */
}

/* The unbiased exponent fp8ref aligns a float32 C with: normal: its own; subnormal or zero: -126. */
FP8REF_INLINE int c_exponent(float c) {
    int field = (int)((bits_of(c) >> 23) & 0xff);
    return (field > 0 ? field : 1) - 127;
}

/* B rows [k0, k0 + L), columns [j0, j0 + w) decoded into bv / bx (row stride NB); returns the
 * codes' flags (j->fb: 1 NaN/Inf, 2 not a code of the format; such codes decode as zeros). */
FP8REF_INLINE int decode_slab(const hw_job *j, const uint8_t *B, size_t k0, size_t L, size_t j0, size_t w,
                              float *bv, int16_t *bx) {
    int bad = 0;
    for (size_t k = 0; k < L; k++) {
        const uint8_t *row = B + (k0 + k) * j->N + j0;
        for (size_t c = 0; c < w; c++) {
            bv[k * NB + c] = j->vb[row[c]];
            bx[k * NB + c] = j->xb[row[c]];
            bad |= j->fb[row[c]];
        }
    }
    return bad;
}

/* A's L codes at a decoded into av / ax; returns their flags. */
FP8REF_INLINE int decode_row(const hw_job *j, const uint8_t *a, size_t L, float *av, int16_t *ax) {
    int bad = 0;
    for (size_t k = 0; k < L; k++) {
        av[k] = j->va[a[k]];
        ax[k] = j->xa[a[k]];
        bad |= j->fa[a[k]];
    }
    return bad;
}

/* The caller's C values (the first step's d): a NaN/Inf one flags 1 and reads as 0 (the caller
 * discards the result and runs the numpy model, which owns the specials' rules). */
FP8REF_INLINE int check_c(float *d, size_t w) {
    int bad = 0;
    for (size_t c = 0; c < w; c++) {
        const int special = (bits_of(d[c]) & 0x7f800000u) == 0x7f800000u;
        bad |= special;
        d[c] = special ? 0.0f : d[c];
    }
    return bad;
}

FP8REF_INLINE void flag(const hw_job *j, int bad) {
    if (bad) __atomic_fetch_or(&((hw_job *)j)->bad, (int64_t)bad, __ATOMIC_RELAXED);
}

/* round-to-nearest-even of the exact v = S * 2**(E - F) (|S| < 2**53) to float16 (10 fraction bits,
 * exponent >= -14; >= 2**16 after rounding: infinity), returned as the (exact) float32 of that
 * float16. v is exact in double; adding and subtracting c = 1.5 * 2**(q + 52), q the exponent of the
 * f16 grid at v, rounds v to a multiple of 2**q to nearest even (the FPU's default rounding; no
 * contraction: -ffp-contract=off). Branch-free: gcc vectorises the loop that calls it. */
FP8REF_INLINE float normalise_rne16(int64_t S, int E, int F) {
    const double v = (double)S * pow2d(E - F);
    const int ev = (int)((bits64_of(v) >> 52) & 0x7ff) - 1023;
    const int q = (ev > -14 ? ev : -14) - 10;
    const uint64_t cb = ((uint64_t)(q + 52 + 1023) << 52) | (1ull << 51);
    double c;
    memcpy(&c, &cb, 8);
    const double r = (v + c) - c;
    const float f = (float)r;
    return (fabs(r) >= 65536.0 ? copysignf(INFINITY, f) : f) + 0.0f; /* + 0.0f: never -0, as the model */
}

/* The alignment exponent of a running value d (float32, or a float16 value when f16): normal: its
 * own; subnormal: the format's minimum (-126, -14); zero: e_zero. */
FP8REF_INLINE int d_exponent(float d, int e_zero, int f16) {
    if (!(bits_of(d) & 0x7fffffffu)) return e_zero;
    const int e = c_exponent(d);
    return f16 && e < -14 ? -14 : e;
}

/* One fused step of one row over columns [0, w) of the chunk; d: the row's running values. */
FP8REF_INLINE void fused_row(const float *restrict av, const int16_t *restrict ax, const float *restrict bv,
                             const int16_t *restrict bx, const int16_t *restrict es, size_t L, size_t w,
                             float *restrict d, int F, int out_bits, int e_zero, int zero_in, int wide,
                             int f16) {
    int16_t emax[NB], emin[NB];
    int32_t isum[NB], emax32[NB];
    int64_t lsum[NB];
    float up[NB];
    for (size_t c = 0; c < w; c++) {
        emax[c] = (int16_t)d_exponent(d[c], e_zero, f16);
        if (zero_in) emin[c] = 0;
    }
    const size_t wv0 = w & ~(size_t)(VL - 1);
    for (size_t c = wide ? 0 : wv0; c < w; c++) { /* the non-wide vector blocks store their sums */
        isum[c] = 0;
        lsum[c] = 0;
    }
    const size_t wv = w & ~(size_t)(VL - 1); /* whole vector blocks; the rest by the plain loops */
    for (size_t c0 = 0; c0 < wv; c0 += VL) { /* the block's max (and min) held in registers over k */
        /* four independent chains over k: gcc lowers the max to compare + blend (4 cycles each) */
        v32hi mx[4], mn[4];
        const v32hi e_s = vload_hi(es + c0);
        for (int i = 0; i < 4; i++) {
            mx[i] = vload_hi(emax + c0);
            mn[i] = zero_in ? vload_hi(emin + c0) : mx[i];
        }
        size_t k = 0;
        for (; k + 4 <= L; k += 4)
            for (int i = 0; i < 4; i++) {
                const v32hi x = vload_hi(bx + (k + i) * NB + c0) + e_s + ax[k + i];
                mx[i] = vmax_hi(mx[i], x);
                if (zero_in) mn[i] = vmin_hi(mn[i], x);
            }
        for (; k < L; k++) {
            const v32hi x = vload_hi(bx + k * NB + c0) + e_s + ax[k];
            mx[0] = vmax_hi(mx[0], x);
            if (zero_in) mn[0] = vmin_hi(mn[0], x);
        }
        vstore_hi(emax + c0, vmax_hi(vmax_hi(mx[0], mx[1]), vmax_hi(mx[2], mx[3])));
        if (zero_in) vstore_hi(emin + c0, vmin_hi(vmin_hi(mn[0], mn[1]), vmin_hi(mn[2], mn[3])));
    }
    for (size_t k = 0; k < L; k++) {
        const int16_t e = ax[k];
        const int16_t *restrict x_k = bx + k * NB;
        for (size_t c = wv; c < w; c++) {
            int16_t x = (int16_t)(e + x_k[c] + es[c]);
            emax[c] = x > emax[c] ? x : emax[c];
            if (zero_in) emin[c] = x < emin[c] ? x : emin[c];
        }
    }
    for (size_t c = 0; c < w; c++) {
        int E = emax[c];
        if (zero_in) E = (emin[c] < HW_ZERO_SUM && E < e_zero) ? e_zero : E;
        emax32[c] = E;
        int x = F - E + es[c];
        up[c] = pow2f(x < -126 ? -126 : (x > 127 ? 127 : x));
    }
    const size_t wi = wide ? 0 : wv;
    for (size_t c0 = 0; c0 < wi; c0 += VL) { /* int32 sums held in registers over k */
        const v16sf u0 = vload_sf(up + c0), u1 = vload_sf(up + c0 + 16);
        v16si s0 = {0}, s1 = {0};
        for (size_t k = 0; k < L; k++) {
            const float a = av[k];
            s0 += __builtin_convertvector((a * vload_sf(bv + k * NB + c0)) * u0, v16si);
            s1 += __builtin_convertvector((a * vload_sf(bv + k * NB + c0 + 16)) * u1, v16si);
        }
        memcpy(isum + c0, &s0, sizeof s0);
        memcpy(isum + c0 + 16, &s1, sizeof s1);
    }
    for (size_t k = 0; k < L; k++) {
        const float a = av[k];
        const float *restrict b_k = bv + k * NB;
        if (wide)
            for (size_t c = 0; c < w; c++) lsum[c] += (int32_t)((a * b_k[c]) * up[c]);
        else
            for (size_t c = wi; c < w; c++) isum[c] += (int32_t)((a * b_k[c]) * up[c]);
    }
    if (f16) /* a loop of its own: the f32 one below stays vectorised */
        for (size_t c = 0; c < w; c++) {
            const int E = emax32[c];
            const int32_t tc = (int32_t)((double)d[c] * pow2d(F - E));
            const float r = normalise_rne16((wide ? lsum[c] : isum[c]) + tc, E, F);
            d[c] = (bits_of(d[c]) & 0x7fffffffu) == 0x7f800000u ? d[c] : r;
        }
    else
        for (size_t c = 0; c < w; c++) {
            const int E = emax32[c];
            const int32_t tc = (int32_t)((double)d[c] * pow2d(F - E)); /* |C term| < 2**(F + 1) */
            const float r = wide ? normalise_rz(lsum[c] + tc, E, F, out_bits)
                                 : normalise_rz32(isum[c] + tc, E, F, out_bits); /* |isum| <= 2**30 */
            d[c] = (bits_of(d[c]) & 0x7fffffffu) == 0x7f800000u ? d[c] : r; /* an Inf C (a step overflowed) stays */
        }
}

FP8REF_INLINE void fused_unit(const hw_job *j, size_t u, int zero_in, int wide, int f16) {
    const size_t M = j->M, N = j->N, K = j->K, L = j->L, S = K / L;
    const size_t bt = u / j->chunks, j0 = (u % j->chunks) * NB, w = N - j0 < NB ? N - j0 : NB;
    const uint8_t *A = j->A + bt * M * K, *B = j->B + bt * K * N;
    const uint8_t *SA = j->SA ? j->SA + bt * M * S : NULL, *SB = j->SB ? j->SB + bt * S * N : NULL;
    float *D = j->D + bt * M * N, *acc = j->acc ? j->acc + bt * M * N : NULL;
    float bv[HW_LMAX * NB], av[HW_LMAX];
    int16_t bx[HW_LMAX * NB], ax[HW_LMAX], sbx[NB], es[NB];
    int bad = 0;
    for (size_t c = 0; c < w; c++) sbx[c] = 0;
    for (size_t s = 0; s < S; s++) {
        bad |= decode_slab(j, B, s * L, L, j0, w, bv, bx);
        if (SB)
            for (size_t c = 0; c < w; c++) {
                sbx[c] = j->xs[SB[s * N + j0 + c]];
                bad |= j->fs[SB[s * N + j0 + c]];
            }
        const int promote = acc && ((j->promote && (s + 1) % j->promote == 0) || s + 1 == S);
        for (size_t m = 0; m < M; m++) {
            bad |= decode_row(j, A + m * K + s * L, L, av, ax);
            const int16_t sa = SA ? j->xs[SA[m * S + s]] : 0;
            if (SA) bad |= j->fs[SA[m * S + s]];
            for (size_t c = 0; c < w; c++) es[c] = (int16_t)(sa + sbx[c]);
            float *d = D + m * N + j0;
            if (s == 0) bad |= check_c(d, w);
            fused_row(av, ax, bv, bx, es, L, w, d, (int)j->F, (int)j->out_bits, (int)j->e_zero, zero_in, wide, f16);
            if (promote) promote_row(j, m, j->promote ? s / j->promote : 0, j0, w, d, acc + m * N + j0);
        }
    }
    flag(j, bad);
}

/* Tasks over units [lo, hi): unit u is batch u / chunks, columns [(u % chunks) * NB, + NB). */
void FP8REF_TASK(fp8ref_hw_fused)(const hw_job *j, size_t lo, size_t hi) {
    const int wide = j->F > 23 || j->L > 32 || j->SA != NULL; /* else int32 sums, normalise_rz32 */
    hw_fast fast;
    int fast_ok = -1; /* hw_avx512.c takes the whole 128-column units it serves; FP8REF_NO_AVX512: none */
    for (size_t u = lo; u < hi; u++) { /* each combination its own inlined copy (f16 apart: it slows the f32 ones) */
        if (j->N - (u % j->chunks) * NB >= NB) {
            if (fast_ok < 0) fast_ok = !getenv("FP8REF_NO_AVX512") && fp8ref_hw_fast_prepare(j, &fast);
            const int bad = fast_ok ? fp8ref_hw_fused_fast(j, &fast, u) : -1;
            if (bad >= 0) {
                flag(j, bad);
                continue;
            }
        }
        if (j->f16)
            j->zero_in ? (wide ? fused_unit(j, u, 1, 1, 1) : fused_unit(j, u, 1, 0, 1))
                       : (wide ? fused_unit(j, u, 0, 1, 1) : fused_unit(j, u, 0, 0, 1));
        else
            j->zero_in ? (wide ? fused_unit(j, u, 1, 1, 0) : fused_unit(j, u, 1, 0, 0))
                       : (wide ? fused_unit(j, u, 0, 1, 0) : fused_unit(j, u, 0, 0, 0));
    }
}

/* grouped (NVIDIA kind::mxf4 / mxf4nvf4), one step of L elements of one row over the chunk's columns:
 * the G = 16 products of each group are summed exactly as integers, P = sum a * b / 2**unit (the
 * codes' values in units of their formats' last bit: e2m1 at most 12 of them, so a product is at
 * most 144 and the group sum below 2**12, exact in int16); the group sum times its two scales (value
 * sig_a * sig_b * 2**(x_a + x_b - 2 smb)) is one term with alignment exponent x_a + x_b, unless every
 * product of the group or a scale is zero (then the step's E takes e_zero). Then as fused:
 *     S = sum_g trunc(P_g * s_g * 2**(F - E)) + trunc(C * 2**(F - E)),  C = rz(S * 2**(E - F))
 * with t_g = P_g * sig_a * sig_b an integer below 2**20 shifted by x_g - 2 smb + unit + F - E <= 33
 * (in [-500, 430] whatever the scales: 2**sh is a normal double): t_g * 2**sh is exact in double, its
 * truncation to int64 is the shifted integer, |S| < 2**50.
 *
 * Vectorised as the fused loop is, by GCC generic vectors every target clone lowers to its width:
 * the group sums over 32 int16 columns a vector (four vectors held in registers over a group), the
 * alignment and the normalisation over 8 columns (int32 exponents, int64 / double sums); where the
 * CPU has AVX-512, grouped_align_avx512 takes 16 columns a step instead (same bits). A chunk whose
 * width is not a whole number of vectors runs on a zero-padded copy of d; the padding is dropped. */
#define HW_G 16 /* products per group (native.applies requires it) */
#define HW_NG (HW_LMAX / HW_G)
#define GW 8 /* columns per vector of the alignment pass */
typedef int16_t v8hi __attribute__((vector_size(16)));
typedef int32_t v8si __attribute__((vector_size(32)));
typedef int64_t v8di __attribute__((vector_size(64)));
typedef double v8df __attribute__((vector_size(64)));
typedef float v8sf __attribute__((vector_size(32)));

FP8REF_INLINE v8si vload8_hi(const int16_t *p) {
    v8hi v;
    memcpy(&v, p, sizeof v);
    return __builtin_convertvector(v, v8si);
}
FP8REF_INLINE v8si vload8_si(const int32_t *p) { v8si v; memcpy(&v, p, sizeof v); return v; }
FP8REF_INLINE v8si vsel_si(v8si m, v8si a, v8si b) { return (a & m) | (b & ~m); } /* m ? a : b (m: -1 / 0) */
FP8REF_INLINE v8di vsel_di(v8di m, v8di a, v8di b) { return (a & m) | (b & ~m); }
FP8REF_INLINE v8df pow2d_v(v8si x) { /* 2**x lane-wise, -1022 <= x <= 1023 */
    return (v8df)((__builtin_convertvector(x, v8di) + 1023) << 52);
}

/* B rows [k0, k0 + L), columns [j0, j0 + w) of the chunk as integers into bi (row stride NB), zero in
 * columns [w, wp); returns the codes' flags. */
FP8REF_INLINE int decode_slab_int(const hw_job *j, const uint8_t *B, size_t k0, size_t L, size_t j0, size_t w,
                                  size_t wp, int16_t *bi) {
    int bad = 0;
    for (size_t k = 0; k < L; k++) {
        const uint8_t *row = B + (k0 + k) * j->N + j0;
        for (size_t c = 0; c < w; c++) {
            bi[k * NB + c] = j->ib[row[c]];
            bad |= j->fb[row[c]];
        }
        for (size_t c = w; c < wp; c++) bi[k * NB + c] = 0;
    }
    return bad;
}

/* The step's per-column operands of B, shared by every row of A:  bi (L x NB), per group g the mask
 * bnz of its nonzero elements (bit i: element g * G + i) and its scale's exponent and significand. */
typedef struct {
    int16_t bi[HW_LMAX * NB], bnz[HW_NG * NB];
    int32_t sbx[HW_NG * NB], sbs[HW_NG * NB];
} grouped_slab;

/* ... and of a row of A: its integers, per group the nonzero mask and scale exponent, significand. */
typedef struct {
    int16_t ai[HW_LMAX];
    int32_t anz[HW_NG], xsa[HW_NG], ssa[HW_NG];
} grouped_row_ops;

/* The group sums P (ng x NB, int16) of one row over columns [0, wp), wp a multiple of VL. */
FP8REF_INLINE void group_sums(const int16_t *restrict ai, const int16_t *restrict bi, size_t ng, size_t wp,
                              int16_t *restrict P) {
    for (size_t g = 0; g < ng; g++) {
        const int16_t *restrict a = ai + g * HW_G, *restrict b = bi + g * HW_G * NB;
        size_t c0 = 0;
        for (; c0 + 4 * VL <= wp; c0 += 4 * VL) {
            v32hi p0 = {0}, p1 = {0}, p2 = {0}, p3 = {0};
            for (size_t i = 0; i < HW_G; i++) {
                const int16_t x = a[i];
                const int16_t *r = b + i * NB + c0;
                p0 += x * vload_hi(r);
                p1 += x * vload_hi(r + VL);
                p2 += x * vload_hi(r + 2 * VL);
                p3 += x * vload_hi(r + 3 * VL);
            }
            vstore_hi(P + g * NB + c0, p0);
            vstore_hi(P + g * NB + c0 + VL, p1);
            vstore_hi(P + g * NB + c0 + 2 * VL, p2);
            vstore_hi(P + g * NB + c0 + 3 * VL, p3);
        }
        for (; c0 < wp; c0 += VL) {
            v32hi p = {0};
            for (size_t i = 0; i < HW_G; i++) p += a[i] * vload_hi(b + i * NB + c0);
            vstore_hi(P + g * NB + c0, p);
        }
    }
}

/* One step of one row: dl (w8 floats, w8 a multiple of GW; C in, the step's result out) from the
 * group sums P. */
FP8REF_INLINE void grouped_align(const hw_job *j, const grouped_slab *restrict sl, const grouped_row_ops *restrict ro,
                                 const int16_t *restrict P, size_t ng, size_t w8, float *restrict dl) {
    const int F = (int)j->F, e_zero = (int)j->e_zero, out_bits = (int)j->out_bits;
    const int shift = (int)j->unit - 2 * (int)j->smb + F; /* sh = x_g + shift - E */
    for (size_t c0 = 0; c0 < w8; c0 += GW) {
        v8si db;
        memcpy(&db, dl + c0, sizeof db);
        const v8si mag = db & 0x7fffffff, inf = mag == 0x7f800000; /* an Inf d (an earlier step overflowed) stays */
        const v8si field = (db >> 23) & 0xff;
        v8si E = vsel_si(mag == 0, (v8si){0} + e_zero, vsel_si(field > 0, field, (v8si){0} + 1) - 127);
        v8si sg[HW_NG], xg[HW_NG];
        for (size_t g = 0; g < ng; g++) {
            const v8si nz = (vload8_hi(sl->bnz + g * NB + c0) & ro->anz[g]) != 0;
            sg[g] = nz & (ro->ssa[g] * vload8_si(sl->sbs + g * NB + c0)); /* 0: a zero group or scale */
            xg[g] = ro->xsa[g] + vload8_si(sl->sbx + g * NB + c0);
            const v8si e = vsel_si(sg[g] == 0, (v8si){0} + e_zero, xg[g]); /* a zero term: e_zero takes part */
            E = vsel_si(e > E, e, E);
        }
        const v8si finite = db & ~inf; /* an Inf d reads as 0 (its result is dropped) */
        v8sf d;
        memcpy(&d, &finite, sizeof d);
        /* |C term| < 2**(F + 1) */
        v8di S = __builtin_convertvector(__builtin_convertvector(d, v8df) * pow2d_v(F - E), v8di);
        for (size_t g = 0; g < ng; g++) {
            const v8df t = __builtin_convertvector(vload8_hi(P + g * NB + c0) * sg[g], v8df);
            S += __builtin_convertvector(t * pow2d_v(xg[g] + shift - E), v8di); /* trunc(t * 2**sh) */
        }
        /* normalise_rz, lane-wise: clear the significand's bits below out_bits (more below 2**-126) */
        v8di u = (v8di)(__builtin_convertvector(S, v8df) * pow2d_v(E - F));
        const v8di ex = ((u >> 52) & 0x7ff) - 1023, below = -126 - ex;
        v8di drop = (52 - out_bits) + (below & (below > 0));
        drop = vsel_di(drop < 53, drop, (v8di){0} + 63); /* past 52: the sign bit alone stays */
        u &= ~((((v8di){0} + 1) << drop) - 1);
        const v8sf r = __builtin_convertvector((v8df)u, v8sf) + 0.0f; /* + 0.0f: never -0, as the model */
        v8si rb;
        memcpy(&rb, &r, sizeof rb);
        rb = vsel_si(inf, db, rb);
        memcpy(dl + c0, &rb, sizeof rb);
    }
}

/* grouped_align with AVX-512 (F, DQ, BW, VL), 16 columns a step: the exponents in int32 lanes, the
 * sums in two halves of 8 doubles. Every term is an integer times a power of two whose product is a
 * normal double or zero, so vscalefpd (x * 2**floor(y)) scales it exactly and vrndscalepd truncates it;
 * the partial sums are integers below 2**53, exact in double. The normalisation, round-toward-zero to
 * 23 fraction bits with exponent >= -126 (grouped: rz-f32 only), is the double -> float conversion
 * rounding toward zero (float32's own grid), an overflow (>= 2**128) made infinite as the model does.
 * Same bits as the portable grouped_align (tests/hardware/test_fused_c.py runs both). */
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HW_AVX512_TARGET target("avx512f,avx512dq,avx512bw,avx512vl")
#define HW_AVX512 __attribute__((HW_AVX512_TARGET, noinline))
#define HW_AVX512_INLINE static inline __attribute__((HW_AVX512_TARGET, always_inline))
static int avx512_ok = -1;
/* FP8REF_NO_AVX512 (read at each call, for the tests) runs the portable grouped_align instead */
#define HAVE_AVX512()                                                                                          \
    ((avx512_ok >= 0 ? avx512_ok                                                                               \
                     : (avx512_ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") && \
                                    __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"))) && \
     !getenv("FP8REF_NO_AVX512"))

HW_AVX512_INLINE __m512d trunc_scaled(__m256i x, __m256i e) { /* trunc(x * 2**e), int32 lanes in */
    return _mm512_roundscale_pd(_mm512_scalef_pd(_mm512_cvtepi32_pd(x), _mm512_cvtepi32_pd(e)),
                                _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
}

HW_AVX512_INLINE __m256 rz_f32(__m512d S, __m256i e) { /* S * 2**e rounded toward zero to float32, >= 2**128: Inf */
    const __m512d v = _mm512_scalef_pd(S, _mm512_cvtepi32_pd(e));
    __m256 r = _mm512_cvt_roundpd_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __mmask8 over = _mm512_cmp_pd_mask(_mm512_abs_pd(v), _mm512_set1_pd(0x1p128), _CMP_GE_OQ);
    r = _mm256_mask_or_ps(r, over, _mm256_and_ps(r, _mm256_set1_ps(-0.0f)), _mm256_set1_ps(INFINITY));
    return _mm256_add_ps(r, _mm256_setzero_ps()); /* + 0.0f: never -0, as the model */
}

HW_AVX512 static void grouped_align_avx512(const hw_job *j, const grouped_slab *restrict sl,
                                           const grouped_row_ops *restrict ro, const int16_t *restrict P, size_t ng,
                                           size_t w16, float *restrict dl) {
    const __m512i vF = _mm512_set1_epi32((int)j->F), vez = _mm512_set1_epi32((int)j->e_zero);
    const __m512i shift = _mm512_set1_epi32((int)j->unit - 2 * (int)j->smb + (int)j->F);
    __m512i anz[HW_NG], ssa[HW_NG], xsa[HW_NG];
    for (size_t g = 0; g < ng; g++) {
        anz[g] = _mm512_set1_epi32(ro->anz[g]);
        ssa[g] = _mm512_set1_epi32(ro->ssa[g]);
        xsa[g] = _mm512_set1_epi32(ro->xsa[g]);
    }
    for (size_t c0 = 0; c0 < w16; c0 += 16) {
        const __m512i db = _mm512_loadu_si512(dl + c0), mag = _mm512_and_si512(db, _mm512_set1_epi32(0x7fffffff));
        const __mmask16 inf = _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7f800000));
        const __m512i field = _mm512_and_si512(_mm512_srli_epi32(db, 23), _mm512_set1_epi32(0xff));
        __m512i E = _mm512_sub_epi32(_mm512_max_epi32(field, _mm512_set1_epi32(1)), _mm512_set1_epi32(127));
        E = _mm512_mask_mov_epi32(E, _mm512_testn_epi32_mask(mag, mag), vez);
        __m512i sg[HW_NG], xg[HW_NG];
        for (size_t g = 0; g < ng; g++) {
            const __m512i bn = _mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)(sl->bnz + g * NB + c0)));
            sg[g] = _mm512_maskz_mullo_epi32(_mm512_test_epi32_mask(bn, anz[g]), ssa[g],
                                             _mm512_loadu_si512(sl->sbs + g * NB + c0));
            xg[g] = _mm512_add_epi32(xsa[g], _mm512_loadu_si512(sl->sbx + g * NB + c0));
            E = _mm512_max_epi32(E, _mm512_mask_mov_epi32(xg[g], _mm512_testn_epi32_mask(sg[g], sg[g]), vez));
        }
        const __m512 d = _mm512_castsi512_ps(_mm512_maskz_mov_epi32((__mmask16)~inf, db)); /* an Inf d reads as 0 */
        const __m512i up = _mm512_sub_epi32(vF, E), down = _mm512_sub_epi32(E, vF);
        __m512d S[2];
        S[0] = _mm512_roundscale_pd(_mm512_scalef_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(d)),
                                                     _mm512_cvtepi32_pd(_mm512_castsi512_si256(up))),
                                    _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
        S[1] = _mm512_roundscale_pd(_mm512_scalef_pd(_mm512_cvtps_pd(_mm512_extractf32x8_ps(d, 1)),
                                                     _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(up, 1))),
                                    _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
        for (size_t g = 0; g < ng; g++) {
            const __m512i p = _mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)(P + g * NB + c0)));
            const __m512i t = _mm512_mullo_epi32(p, sg[g]), sh = _mm512_sub_epi32(_mm512_add_epi32(xg[g], shift), E);
            S[0] = _mm512_add_pd(S[0], trunc_scaled(_mm512_castsi512_si256(t), _mm512_castsi512_si256(sh)));
            S[1] = _mm512_add_pd(S[1], trunc_scaled(_mm512_extracti64x4_epi64(t, 1), _mm512_extracti64x4_epi64(sh, 1)));
        }
        const __m512 r = _mm512_insertf32x8(_mm512_castps256_ps512(rz_f32(S[0], _mm512_castsi512_si256(down))),
                                            rz_f32(S[1], _mm512_extracti64x4_epi64(down, 1)), 1);
        _mm512_storeu_si512(dl + c0, _mm512_mask_mov_epi32(_mm512_castps_si512(r), inf, db)); /* an Inf d stays */
    }
}
#else
#define HAVE_AVX512() 0
#define grouped_align_avx512(j, sl, ro, P, ng, w16, dl) ((void)0)
#endif

void FP8REF_TASK(fp8ref_hw_grouped)(const hw_job *j, size_t lo, size_t hi) {
    const size_t M = j->M, N = j->N, K = j->K, L = j->L, S = K / L, ng = L / HW_G;
    const size_t nbk = K / j->block; /* scales per row of A */
    grouped_slab sl;
    grouped_row_ops ro;
    int16_t P[HW_NG * NB];
    float dl[NB];
    const int vec = HAVE_AVX512();
    int bad = 0;
    for (size_t u = lo; u < hi; u++) {
        const size_t bt = u / j->chunks, j0 = (u % j->chunks) * NB, w = N - j0 < NB ? N - j0 : NB;
        const size_t wp = (w + VL - 1) & ~(size_t)(VL - 1); /* whole int16 vectors (NB is a multiple of VL) */
        const uint8_t *A = j->A + bt * M * K, *B = j->B + bt * K * N;
        const uint8_t *SA = j->SA + bt * M * nbk, *SB = j->SB + bt * nbk * N;
        float *D = j->D + bt * M * N, *acc = j->acc ? j->acc + bt * M * N : NULL;
        for (size_t s = 0; s < S; s++) {
            bad |= decode_slab_int(j, B, s * L, L, j0, w, wp, sl.bi);
            for (size_t g = 0; g < ng; g++) {
                for (size_t c0 = 0; c0 < wp; c0 += VL) {
                    v32hi mask = {0};
                    for (size_t i = 0; i < HW_G; i++)
                        mask |= (vload_hi(sl.bi + (g * HW_G + i) * NB + c0) != 0) & (int16_t)(1u << i);
                    vstore_hi(sl.bnz + g * NB + c0, mask);
                }
                const uint8_t *sb = SB + (s * L + g * HW_G) / j->block * N + j0;
                for (size_t c = 0; c < w; c++) {
                    sl.sbx[g * NB + c] = j->xs[sb[c]];
                    sl.sbs[g * NB + c] = j->ss[sb[c]];
                    bad |= j->fs[sb[c]];
                }
                for (size_t c = w; c < wp; c++) sl.sbx[g * NB + c] = sl.sbs[g * NB + c] = 0;
            }
            const int promote = acc && ((j->promote && (s + 1) % j->promote == 0) || s + 1 == S);
            for (size_t m = 0; m < M; m++) {
                const uint8_t *a = A + m * K + s * L;
                for (size_t k = 0; k < L; k++) {
                    ro.ai[k] = j->ia[a[k]];
                    bad |= j->fa[a[k]];
                }
                for (size_t g = 0; g < ng; g++) {
                    int32_t mask = 0;
                    for (size_t i = 0; i < HW_G; i++) mask |= (ro.ai[g * HW_G + i] != 0) << i;
                    ro.anz[g] = mask;
                    const uint8_t code = SA[m * nbk + (s * L + g * HW_G) / j->block];
                    ro.xsa[g] = j->xs[code];
                    ro.ssa[g] = j->ss[code];
                    bad |= j->fs[code];
                }
                float *d = D + m * N + j0, *dv = w == wp ? d : dl; /* a partial vector: on a padded copy */
                if (s == 0) bad |= check_c(d, w);
                if (dv == dl) {
                    memcpy(dl, d, w * sizeof *dl);
                    for (size_t c = w; c < wp; c++) dl[c] = 0.0f;
                }
                group_sums(ro.ai, sl.bi, ng, wp, P);
                if (vec) /* 16 columns a step (wp is a multiple of 32) */
                    grouped_align_avx512(j, &sl, &ro, P, ng, (w + 15) & ~(size_t)15, dv);
                else
                    grouped_align(j, &sl, &ro, P, ng, (w + GW - 1) & ~(size_t)(GW - 1), dv);
                if (dv == dl) memcpy(d, dl, w * sizeof *dl);
                if (promote) promote_row(j, m, j->promote ? s / j->promote : 0, j0, w, d, acc + m * N + j0);
            }
        }
    }
    flag(j, bad);
}

/* One pairwise step of one row over columns [0, w) of the chunk. */
FP8REF_INLINE void pairwise_row(const float *restrict av, const int16_t *restrict ax, const float *restrict bv,
                                const int16_t *restrict bx, size_t L, size_t w, float *restrict d, int F, int F2) {
    int16_t E0[NB], E1[NB];
    int32_t S0[NB], S1[NB];
    float up0[NB], up1[NB];
    const size_t wv = w & ~(size_t)15; /* whole 16-column blocks: max, scaling and sums held in registers */
    for (size_t c0 = 0; c0 < wv; c0 += 16) {
        v16hi m0 = (v16hi){0} + 2 * HW_ZERO, m1 = m0;
        for (size_t k = 0; k < L; k += 2) {
            m0 = vmax16_hi(m0, vload16_hi(bx + k * NB + c0) + ax[k]);
            m1 = vmax16_hi(m1, vload16_hi(bx + (k + 1) * NB + c0) + ax[k + 1]);
        }
        /* an all-zero half: -999, its sum is 0 whatever the scaling (2**0) */
        v16si x0 = __builtin_convertvector(m0, v16si), x1 = __builtin_convertvector(m1, v16si);
        const v16si z0 = x0 < HW_ZERO_SUM, z1 = x1 < HW_ZERO_SUM;
        x0 = (z0 & -999) | (~z0 & x0);
        x1 = (z1 & -999) | (~z1 & x1);
        const v16si b0 = ((~z0 & (F - x0)) + 127) << 23, b1 = ((~z1 & (F - x1)) + 127) << 23; /* pow2f */
        v16sf u0, u1;
        memcpy(&u0, &b0, sizeof u0);
        memcpy(&u1, &b1, sizeof u1);
        v16si s0 = {0}, s1 = {0};
        for (size_t k = 0; k < L; k += 2) {
            s0 += __builtin_convertvector((av[k] * vload_sf(bv + k * NB + c0)) * u0, v16si);
            s1 += __builtin_convertvector((av[k + 1] * vload_sf(bv + (k + 1) * NB + c0)) * u1, v16si);
        }
        m0 = __builtin_convertvector(x0, v16hi);
        m1 = __builtin_convertvector(x1, v16hi);
        memcpy(E0 + c0, &m0, sizeof m0);
        memcpy(E1 + c0, &m1, sizeof m1);
        memcpy(S0 + c0, &s0, sizeof s0);
        memcpy(S1 + c0, &s1, sizeof s1);
    }
    for (size_t c = wv; c < w; c++) { /* the last columns, one at a time */
        E0[c] = E1[c] = 2 * HW_ZERO;
        S0[c] = S1[c] = 0;
    }
    for (size_t k = 0; k < L; k += 2) {
        const int16_t e0 = ax[k], e1 = ax[k + 1];
        const int16_t *restrict x0 = bx + k * NB, *restrict x1 = x0 + NB;
        for (size_t c = wv; c < w; c++) {
            int16_t y0 = (int16_t)(e0 + x0[c]), y1 = (int16_t)(e1 + x1[c]);
            E0[c] = y0 > E0[c] ? y0 : E0[c];
            E1[c] = y1 > E1[c] ? y1 : E1[c];
        }
    }
    for (size_t c = wv; c < w; c++) {
        E0[c] = E0[c] < HW_ZERO_SUM ? -999 : E0[c];
        E1[c] = E1[c] < HW_ZERO_SUM ? -999 : E1[c];
        up0[c] = pow2f(E0[c] == -999 ? 0 : F - E0[c]);
        up1[c] = pow2f(E1[c] == -999 ? 0 : F - E1[c]);
    }
    for (size_t k = 0; k < L; k += 2) {
        const float a0 = av[k], a1 = av[k + 1];
        const float *restrict b0 = bv + k * NB, *restrict b1 = b0 + NB;
        for (size_t c = wv; c < w; c++) {
            S0[c] += (int32_t)((a0 * b0[c]) * up0[c]);
            S1[c] += (int32_t)((a1 * b1[c]) * up1[c]);
        }
    }
    for (size_t c = 0; c < w; c++) {
        const int e0 = E0[c], e1 = E1[c], e_dot = e0 > e1 ? e0 : e1;
        const int s0 = e_dot - e0 < 63 ? e_dot - e0 : 63, s1 = e_dot - e1 < 63 ? e_dot - e1 : 63;
        const int64_t Sd = ((int64_t)S0[c] >> s0) + ((int64_t)S1[c] >> s1);
        const int e_c = c_exponent(d[c]); /* finite: |products| < 2**33 cannot round a finite C to Inf */
        const int e_max = e_dot > e_c ? e_dot : e_c;
        const int gap = e_max - e_dot, lift = F2 + 1 - F; /* products: F2 + 1 fraction bits at e_max */
        const int right = gap - lift < 0 ? 0 : (gap - lift < 63 ? gap - lift : 63);
        const int left = lift - gap > 0 ? lift - gap : 0;
        const int64_t dot = (int64_t)((uint64_t)(Sd >> right) << left); /* floor(Sd * 2**(lift - gap)) */
        /* C: floored to F fraction bits at e_max (integer shifts: gcc keeps (long)floor(x) scalar) */
        const uint32_t cb = bits_of(d[c]);
        const int64_t mant = (int64_t)((cb & 0x7fffffu) | ((cb & 0x7f800000u) ? 0x800000u : 0u));
        const int64_t sig_c = (cb >> 31) ? -mant : mant;
        const int sh = e_max - e_c + 23 - F;
        const int cr = sh < 0 ? 0 : (sh < 63 ? sh : 63), cl = sh < 0 ? -sh : 0;
        int64_t cs = (int64_t)((uint64_t)(sig_c >> cr) << cl);
        cs &= -(int64_t)(e_c >= e_max - F - 1);
        int64_t T = dot + (int64_t)((uint64_t)cs << lift); /* units 2**(e_max - F2 - 1) */
        /* floor to F2 fraction bits below the leading bit (exponent >= -126) */
        const uint64_t mag = (uint64_t)(T < 0 ? -T : T);
        const int64_t ev = 63 - __builtin_clzll(mag | 1) + e_max - F2 - 1;
        int64_t cut = (ev > -126 ? ev : -126) - e_max + 1;
        cut = cut < 0 ? 0 : (cut < 63 ? cut : 63);
        T = (int64_t)((uint64_t)(T >> cut) << cut);
        d[c] = (float)((double)T * pow2d(e_max - F2 - 1));
    }
}

void FP8REF_TASK(fp8ref_hw_pairwise)(const hw_job *j, size_t lo, size_t hi) {
    const size_t M = j->M, N = j->N, K = j->K, L = j->L, S = K / L;
    float bv[HW_LMAX * NB], av[HW_LMAX];
    int16_t bx[HW_LMAX * NB], ax[HW_LMAX];
    int bad = 0;
    for (size_t u = lo; u < hi; u++) {
        const size_t bt = u / j->chunks, j0 = (u % j->chunks) * NB, w = N - j0 < NB ? N - j0 : NB;
        const uint8_t *A = j->A + bt * M * K, *B = j->B + bt * K * N;
        float *D = j->D + bt * M * N;
        for (size_t s = 0; s < S; s++) {
            bad |= decode_slab(j, B, s * L, L, j0, w, bv, bx);
            for (size_t m = 0; m < M; m++) {
                bad |= decode_row(j, A + m * K + s * L, L, av, ax);
                if (s == 0) bad |= check_c(D + m * N + j0, w);
                pairwise_row(av, ax, bv, bx, L, w, D + m * N + j0, (int)j->F, (int)j->out_bits);
            }
        }
    }
    flag(j, bad);
}
