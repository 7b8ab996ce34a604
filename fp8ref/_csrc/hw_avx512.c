/* The fused datapath of fp8ref.hardware (see hw.c) for FP8 operands, F <= 13, no block
 * scales and a float32 result (Hopper / Ada FP8 wgmma and mma, and their kernels), on CPUs with
 * AVX-512 F, DQ, BW, VL, CD, VNNI and VBMI: the same integers as fused_row, with fewer instructions
 * per product. fp8ref_hw_fused calls it for each whole 128-column unit it serves.
 *
 * A product's term trunc(|a| |b| 2**(F - E)) is one fused multiply-add rounded toward zero onto a
 * magic number: with g = 2**(E - F) and Mc = 1.5 * 2**23 * g (exact in float32), |a| |b| < 2**(E + 2)
 * <= Mc / 3 when F <= 20, so Mc + |a| |b| stays in Mc's binade, whose last bit is g, and
 *     bits(RZ(Mc + |a| |b|)) = bits(Mc) + trunc(|a| |b| / g).
 * For a negative a, RU(Mc - |a| |b|) gives bits(Mc) - trunc(|a| |b| / g) the same way (rounding a
 * positive value up is rounding its distance below Mc down). bits(Mc) has a zero low half and the
 * term is below 2**(F + 2) <= 2**15, so the low int16 of the float's bits is the signed term; one
 * VNNI dot product (vpdpwssd) with B's sign, +1 or -1 in the low int16 and 0 in the high one, adds
 * it into the int32 sum. Each row's K elements are split by the sign of a: positive ones take the
 * first instruction, negative ones the second.
 *
 * The alignment exponents are int8 here (64 columns an instruction): the formats' exponents fit in
 * [-31, 31] and a zero operand's is X8_ZERO, so a sum holding one is below every real one (lo_real).
 * The unit runs only when every |C| is below 2**100: with K |a b| below 2**100 too (checked once a
 * call), every step's E is at most 101, so Mc is a normal float32. A zero C sets E only where the
 * step has no nonzero product (e_zero below lo_real is checked), and then the sum is 0 whatever E.
 * Codes decode through the tables by VBMI byte permutes and fp32 permutes, 64 and 16 codes a time.
 */
#include "kernels.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define FAST_ISA "avx512f,avx512dq,avx512bw,avx512vl,avx512cd,avx512vnni,avx512vbmi"
#define FAST __attribute__((target(FAST_ISA)))
#define FAST_INLINE static inline __attribute__((target(FAST_ISA), always_inline))
#define NB HW_NB
#define LMAX 32        /* longest step */
#define X8_ZERO (-64)  /* int8 alignment exponent of a zero operand */
#define C_LIMIT 0x71800000u /* bits of 2**100 */
#define PF_ROWS 2

int fp8ref_hw_fast_prepare(const hw_job *j, hw_fast *t) {
    if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
          __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
          __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512vnni") &&
          __builtin_cpu_supports("avx512vbmi")))
        return 0;
    if (j->F < 0 || j->F > 13 || j->L > LMAX || j->SA || j->zero_in || j->f16)
        return 0;
    const float *v[2] = {j->va, j->vb};
    const int16_t *x[2] = {j->xa, j->xb};
    int lo[2] = {99, 99}, hi[2] = {-99, -99};
    float top[2] = {0, 0};
    for (int s = 0; s < 2; s++)
        for (int c = 0; c < 128; c++) { /* sign at bit 7: code | 0x80 is -value, same exponent */
            const float p = v[s][c], n = v[s][c | 0x80];
            if (!(p >= 0) || n != -p || x[s][c] != x[s][c | 0x80]) return 0;
            const int e = x[s][c];
            if (e != HW_ZERO) {
                if (e < -31 || e > 31) return 0;
                lo[s] = e < lo[s] ? e : lo[s];
                hi[s] = e > hi[s] ? e : hi[s];
            }
            top[s] = p > top[s] ? p : top[s];
            (s ? t->mb : t->ma)[c] = p;
            (s ? t->xb8 : t->xa8)[c] = (int8_t)(e == HW_ZERO ? X8_ZERO : e);
        }
    t->lo_real = lo[0] + lo[1];
    /* a zero operand's sums below every real one; a zero C's e_zero too (then it never sets E) */
    if (X8_ZERO + (hi[0] > hi[1] ? hi[0] : hi[1]) >= t->lo_real || j->e_zero >= t->lo_real) return 0;
    return (double)j->K * top[0] * top[1] < 0x1p100;
}

/* One step's B operands of the unit, shared by every row of A. */
typedef struct {
    float bm[LMAX * NB];   /* |b| */
    int32_t bs[LMAX * NB]; /* sign of b: 0x0001 or 0xffff (+1, -1) in the low int16, 0 in the high */
    int8_t bx[LMAX * NB];  /* alignment exponent */
} fast_slab;

/* 16 codes (int32 lanes) to the fp32 values of a 128-entry table (the code's low 7 bits) in 8 registers */
/* c's four 16-byte quarters (the extract's lane number must be a constant: a loop variable does not
 * compile where the loop is not unrolled first, as at -O2 or with clang) */
FAST_INLINE void quarters(__m512i c, __m128i q[4]) {
    q[0] = _mm512_castsi512_si128(c);
    q[1] = _mm512_extracti32x4_epi32(c, 1);
    q[2] = _mm512_extracti32x4_epi32(c, 2);
    q[3] = _mm512_extracti32x4_epi32(c, 3);
}

FAST_INLINE __m512 lookup128(const __m512 *T, __m512i c) {
    const __m512 r0 = _mm512_permutex2var_ps(T[0], c, T[1]), r1 = _mm512_permutex2var_ps(T[2], c, T[3]);
    const __m512 r2 = _mm512_permutex2var_ps(T[4], c, T[5]), r3 = _mm512_permutex2var_ps(T[6], c, T[7]);
    const __mmask16 b5 = _mm512_test_epi32_mask(c, _mm512_set1_epi32(32));
    const __mmask16 b6 = _mm512_test_epi32_mask(c, _mm512_set1_epi32(64));
    return _mm512_mask_blend_ps(b6, _mm512_mask_blend_ps(b5, r0, r1), _mm512_mask_blend_ps(b5, r2, r3));
}

/* 64 codes to their flags (256-entry byte table in 4 registers) */
FAST_INLINE __m512i flags256(const __m512i *T, __m512i c) {
    return _mm512_mask_blend_epi8(_mm512_movepi8_mask(c), _mm512_permutex2var_epi8(T[0], c, T[1]),
                                  _mm512_permutex2var_epi8(T[2], c, T[3]));
}

FAST_INLINE void load_tables(const float *m, const int8_t *x8, const uint8_t *f, __m512 *M, __m512i *X, __m512i *Fl) {
    for (int i = 0; i < 8; i++) M[i] = _mm512_loadu_ps(m + 16 * i);
    X[0] = _mm512_loadu_si512(x8);
    X[1] = _mm512_loadu_si512(x8 + 64);
    for (int i = 0; i < 4; i++) Fl[i] = _mm512_loadu_si512(f + 64 * i);
}

/* B rows [k0, k0 + L) of the unit's 128 columns into the slab; returns the OR of their flags. */
FAST_INLINE __m512i decode_slab(const hw_job *j, const hw_fast *t, const uint8_t *B, size_t k0, size_t L,
                                size_t j0, fast_slab *sl) {
    __m512 M[8];
    __m512i X[2], Fl[4], bad = _mm512_setzero_si512();
    load_tables(t->mb, t->xb8, j->fb, M, X, Fl);
    const __m512i low7 = _mm512_set1_epi8(0x7f), plus = _mm512_set1_epi32(1), minus = _mm512_set1_epi32(0xffff);
    for (size_t k = 0; k < L; k++)
        for (int h = 0; h < 2; h++) {
            const __m512i c = _mm512_loadu_si512(B + (k0 + k) * j->N + j0 + 64 * h);
            bad = _mm512_or_si512(bad, flags256(Fl, c));
            _mm512_store_si512(sl->bx + k * NB + 64 * h, _mm512_permutex2var_epi8(X[0], _mm512_and_si512(c, low7), X[1]));
            const uint64_t neg = _mm512_movepi8_mask(c);
            __m128i cq[4];
            quarters(c, cq);
            for (int q = 0; q < 4; q++) {
                const __m512i c32 = _mm512_cvtepu8_epi32(cq[q]);
                const size_t at = k * NB + 64 * h + 16 * q;
                _mm512_store_ps(sl->bm + at, lookup128(M, c32));
                _mm512_store_si512(sl->bs + at, _mm512_mask_mov_epi32(plus, (__mmask16)(neg >> (16 * q)), minus));
            }
        }
    return bad;
}

/* One row's step of A: |a| per k, its exponent replicated in the 4 bytes of an int32 (a broadcast
 * gives 64 int8 lanes), and k split by sign (kp: a >= 0, kn: a < 0); returns the OR of the flags. */
typedef struct {
    float am[LMAX];
    int32_t ax[LMAX], kp[LMAX + 16], kn[LMAX + 16]; /* + 16: the second compressed half is stored whole */
    int np, nn;
} fast_row;

FAST_INLINE __m512i decode_row(const __m512 *M, const __m512i *X, const __m512i *Fl, const uint8_t *a, size_t L,
                               fast_row *r) {
    const __mmask64 in = (1ull << L) - 1; /* L <= LMAX = 32 */
    const __m512i c = _mm512_maskz_loadu_epi8(in, a);
    const __m512i x8 = _mm512_permutex2var_epi8(X[0], _mm512_and_si512(c, _mm512_set1_epi8(0x7f)), X[1]);
    /* byte i of the result: byte (i / 4) (+ 16 for the second half) of x8 */
    const __m512i by4 = _mm512_set_epi8(15, 15, 15, 15, 14, 14, 14, 14, 13, 13, 13, 13, 12, 12, 12, 12, 11, 11, 11, 11,
                                        10, 10, 10, 10, 9, 9, 9, 9, 8, 8, 8, 8, 7, 7, 7, 7, 6, 6, 6, 6, 5, 5, 5, 5, 4, 4,
                                        4, 4, 3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    _mm512_storeu_si512(r->ax, _mm512_permutexvar_epi8(by4, x8));
    _mm512_storeu_si512(r->ax + 16, _mm512_permutexvar_epi8(_mm512_add_epi8(by4, _mm512_set1_epi8(16)), x8));
    const uint32_t neg = (uint32_t)(_mm512_movepi8_mask(c) & in), pos = (uint32_t)(~_mm512_movepi8_mask(c) & in);
    __m128i cq[4];
    quarters(c, cq);
    for (int q = 0; q < 2; q++) {
        const __m512i c32 = _mm512_cvtepu8_epi32(cq[q]);
        _mm512_storeu_ps(r->am + 16 * q, lookup128(M, c32));
    }
    const __m512i k0 = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i k1 = _mm512_add_epi32(k0, _mm512_set1_epi32(16));
    /* compress in registers, then plain stores (the compressing store is microcoded) */
    _mm512_storeu_si512(r->kp, _mm512_maskz_compress_epi32((__mmask16)pos, k0));
    _mm512_storeu_si512(r->kp + __builtin_popcount(pos & 0xffff), _mm512_maskz_compress_epi32((__mmask16)(pos >> 16), k1));
    _mm512_storeu_si512(r->kn, _mm512_maskz_compress_epi32((__mmask16)neg, k0));
    _mm512_storeu_si512(r->kn + __builtin_popcount(neg & 0xffff), _mm512_maskz_compress_epi32((__mmask16)(neg >> 16), k1));
    r->np = __builtin_popcount(pos);
    r->nn = __builtin_popcount(neg);
    return _mm512_maskz_mov_epi8(in, flags256(Fl, c));
}

/* Adds the terms of the n elements k = ks[i] of the row (a of one sign) to the 8 column vectors'
 * sums: a >= 0 rounds Mc + |a b| toward zero, a < 0 rounds Mc - |a b| up (neg: a constant). */
FAST_INLINE void add_terms(const fast_slab *restrict sl, const float *restrict am, const int32_t *ks, int n,
                           const __m512 *Mc, __m512i *S, int neg) {
    for (int i = 0; i < n; i++) {
        const int k = ks[i];
        const __m512 a = _mm512_set1_ps(am[k]);
        const float *b = sl->bm + k * NB;
        const int32_t *sg = sl->bs + k * NB;
        for (int v = 0; v < 8; v++) {
            const __m512 bv = _mm512_load_ps(b + 16 * v);
            const __m512 t = neg ? _mm512_fnmadd_round_ps(a, bv, Mc[v], _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC)
                                 : _mm512_fmadd_round_ps(a, bv, Mc[v], _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
            S[v] = _mm512_dpwssd_epi32(S[v], _mm512_castps_si512(t), _mm512_load_si512(sg + 16 * v));
        }
    }
}

/* The int32 sums of the row's terms over the step, for the 8 column vectors (Mc: their magic numbers). */
FAST_INLINE void row_sums(const fast_slab *restrict sl, const fast_row *restrict r, const __m512 *Mc, __m512i *S) {
    for (int v = 0; v < 8; v++) S[v] = _mm512_setzero_si512();
    add_terms(sl, r->am, r->kp, r->np, Mc, S, 0);
    add_terms(sl, r->am, r->kn, r->nn, Mc, S, 1);
}

/* round-toward-zero of S * 2**x (x = E - F as a float; |S| < 2**24, exact as a float) to out_bits
 * fraction bits, exponent >= -126 (normalise_rz32): toward zero onto float32's grid (2**-149 below
 * 2**-126; no overflow: E <= 101), then the last 23 - out_bits bits of the significand cleared. The
 * grids are nested, so the two truncations are one. + 0: never -0. */
FAST_INLINE __m512 normalise(__m512i S, __m512 x, __m512 keep) {
    const __m512 r = _mm512_scalef_round_ps(_mm512_cvtepi32_ps(S), x, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    return _mm512_add_ps(_mm512_and_ps(r, keep), _mm512_setzero_ps());
}

FAST int fp8ref_hw_fused_fast(const hw_job *j, const hw_fast *t, size_t u) {
    const size_t M = j->M, N = j->N, K = j->K, L = j->L, S = K / L;
    const size_t bt = u / j->chunks, j0 = (u % j->chunks) * NB;
    const uint8_t *A = j->A + bt * M * K, *B = j->B + bt * K * N;
    float *D = j->D + bt * M * N, *acc = j->acc ? j->acc + bt * M * N : NULL;
    const int F = (int)j->F, out_bits = (int)j->out_bits;
    __m512i big = _mm512_setzero_si512();
    for (size_t m = 0; m < M; m++)
        for (int v = 0; v < 8; v++)
            big = _mm512_max_epu32(big, _mm512_and_si512(_mm512_loadu_si512(D + m * N + j0 + 16 * v),
                                                         _mm512_set1_epi32(0x7fffffff)));
    if (_mm512_reduce_max_epu32(big) >= C_LIMIT) return -1; /* a large, Inf or NaN C: the portable loop */
    fast_slab sl __attribute__((aligned(64)));
    fast_row r;
    __m512 MA[8];
    __m512i XA[2], FA[4], bad = _mm512_setzero_si512();
    load_tables(t->ma, t->xa8, j->fa, MA, XA, FA);
    /* biased exponents Eb = E + 127; Mc's bits: (Eb + 23 - F) << 23 | 1 << 22 */
    const __m512i lo_real = _mm512_set1_epi8((char)t->lo_real), mc = _mm512_set1_epi32(((23 - F) << 23) | 0x400000);
    const __m512i bias = _mm512_set1_epi32(127), one = _mm512_set1_epi32(1), f_bias = _mm512_set1_epi32(F + 127);
    const __m512 keep = _mm512_castsi512_ps(_mm512_set1_epi32((int)(~0u << (23 - out_bits))));
    for (size_t s = 0; s < S; s++) {
        bad = _mm512_or_si512(bad, decode_slab(j, t, B, s * L, L, j0, &sl));
        const int promote = acc && ((j->promote && (s + 1) % j->promote == 0) || s + 1 == S);
        const size_t p = j->promote ? s / j->promote : 0;
        for (size_t m = 0; m < M; m++) {
            if (m + PF_ROWS < M) { /* rows PF_ROWS ahead: A's and D's rows are 4 KiB apart or more (no hardware prefetch) */
                _mm_prefetch((const char *)(A + (m + PF_ROWS) * K + s * L), _MM_HINT_T0);
                for (int v = 0; v < 8; v++) _mm_prefetch((const char *)(D + (m + PF_ROWS) * N + j0 + 16 * v), _MM_HINT_T0);
                if (promote)
                    for (int v = 0; v < 8; v++) _mm_prefetch((const char *)(acc + (m + PF_ROWS) * N + j0 + 16 * v), _MM_HINT_T0);
            }
            bad = _mm512_or_si512(bad, decode_row(MA, XA, FA, A + m * K + s * L, L, &r));
            float *d = D + m * N + j0;
            __m512i m0 = _mm512_set1_epi8(-128), m1 = m0; /* the step's largest product exponent */
            for (size_t k = 0; k < L; k++) {
                const __m512i e = _mm512_set1_epi32(r.ax[k]);
                m0 = _mm512_max_epi8(m0, _mm512_add_epi8(_mm512_load_si512(sl.bx + k * NB), e));
                m1 = _mm512_max_epi8(m1, _mm512_add_epi8(_mm512_load_si512(sl.bx + k * NB + 64), e));
            }
            /* no nonzero product: -128, below every C's exponent (lo_real > -126, so a zero C, read as
             * -126, leaves E alone where products are; where none are, the sum is 0 whatever E) */
            m0 = _mm512_mask_mov_epi8(m0, _mm512_cmplt_epi8_mask(m0, lo_real), _mm512_set1_epi8(-128));
            m1 = _mm512_mask_mov_epi8(m1, _mm512_cmplt_epi8_mask(m1, lo_real), _mm512_set1_epi8(-128));
            __m512 Mc[8];
            __m512i Eb[8], Sv[8];
            __m128i mq[8];
            quarters(m0, mq);
            quarters(m1, mq + 4);
            for (int v = 0; v < 8; v++) {
                const __m512i ep = _mm512_cvtepi8_epi32(mq[v]);
                const __m512i db = _mm512_loadu_si512(d + 16 * v); /* C's exponent field, subnormal or zero: 1 */
                const __m512i field = _mm512_max_epi32(_mm512_srli_epi32(_mm512_slli_epi32(db, 1), 24), one);
                Eb[v] = _mm512_max_epi32(field, _mm512_add_epi32(ep, bias));
                Mc[v] = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(Eb[v], 23), mc));
            }
            row_sums(&sl, &r, Mc, Sv);
            for (int v = 0; v < 8; v++) {
                const __m512 up = _mm512_cvtepi32_ps(_mm512_sub_epi32(f_bias, Eb[v])); /* F - E */
                const __m512 dv = _mm512_loadu_ps(d + 16 * v); /* C's term: exact, below 2**(F + 1) */
                const __m512i tc = _mm512_cvttps_epi32(_mm512_scalef_ps(dv, up));
                const __m512 down = _mm512_xor_ps(up, _mm512_set1_ps(-0.0f));
                _mm512_storeu_ps(d + 16 * v, normalise(_mm512_add_epi32(Sv[v], tc), down, keep));
            }
            if (promote) promote_row(j, m, p, j0, NB, d, acc + m * N + j0);
        }
    }
    uint8_t b[64]; /* the flags' OR over the bytes */
    _mm512_storeu_si512(b, bad);
    int f = 0;
    for (int i = 0; i < 64; i++) f |= b[i];
    return f;
}

#else
int fp8ref_hw_fast_prepare(const hw_job *j, hw_fast *t) { (void)j; (void)t; return 0; }
int fp8ref_hw_fused_fast(const hw_job *j, const hw_fast *t, size_t u) { (void)j; (void)t; (void)u; return -1; }
#endif
