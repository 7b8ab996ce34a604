/* The loops of the exact fast path (fp8ref/matmul/exact_fast.py), called through ctypes.
 *
 * fp8ref_decode_f64: FP8 codes -> float64 GEMM operands, optionally times a scale per element
 * (the block scales folded in: exact, a 4-bit significand times a float32) and with the sums of
 * squares of the scaled values per scale block (the Cauchy-Schwarz bound of the blocked path).
 *
 * fp8ref_exact_epilogue: the one rounding to the output (float32, bfloat16, float16: precision P,
 * emin, max), per element, of
 *   mode 0: x = s * t + bias with t exact (the GEMM of integers times 2**g) and s = sa * sb exact.
 *           p + e = s * t exactly (p = fl(s * t), e = fma(s, t, -p)); with a bias, three TwoSums
 *           give x = h + tail with h = fl(x) up to one ulp and the sign of tail exact; h rounded
 *           to odd (its last bit set where the tail is nonzero: h moved one ulp toward x when h is
 *           even) then rounded to P <= 51 bits is the correct rounding of x (Boldo-Melquiond), so
 *           every element is decided here.
 *   mode 1: y = fl(t + bias), t the sum of the K-group GEMMs' results (in group order), with
 *           |y - x| <= bound = slack * (norm + |bias|): decided where
 *           fl(y - bound) and fl(y + bound) round to the same bits and neither is a rounding
 *           boundary of out (a midpoint, itself a float64: fl is monotone, so fl(z) is on z's side
 *           of every boundary unless it is one); the rest are flagged for the exact path.
 * Undecided elements keep their t (mode 0: the exact path reads it; mode 1: the summed t). An exact zero is +0; a nonzero x that rounds to zero keeps its sign (docs/matmul.md).
 * Compiled with -ffp-contract=off: every fused multiply-add below is explicit.
 */
#include <math.h>
#include <stdlib.h> /* getenv */

#include "kernels.h"
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

/* ---- staging ------------------------------------------------------------------------------------ */
static inline double scale_of(const dec_job *j, int64_t r, int64_t c) {
    return j->scale[(r / j->s_rb) * j->s_rs + c / j->s_cb];
}

static inline double *norm_of(const dec_job *j, int64_t r, int64_t c) {
    return j->norm2 + (r / j->n_rb) * j->n_rs + c / j->n_cb;
}

/* Columns [c0, cols) of row r, one at a time (any strides, any block layout). */
static int decode_tail(const dec_job *j, int64_t r, int64_t c0) {
    const uint8_t *src = j->src + r * j->src_rs;
    double *dst = j->dst + r * j->dst_rs;
    int bad = 0;
    for (int64_t c = c0; c < j->cols; c++) {
        double v = j->lut[src[c * j->src_cs]];
        bad |= v != v;
        if (j->scale) v *= scale_of(j, r, c);
        dst[c] = v;
        if (j->norm2) *norm_of(j, r, c) += v * v;
    }
    return bad;
}

#if defined(__x86_64__) && defined(__GNUC__)
/* Contiguous codes, 16 per step, without gathers (slow here): the 256-entry float32 table sits in
 * 16 registers; 8 two-register permutes look up the low 5 index bits, a blend tree on bits 5-7
 * picks the result, and two widenings give the float64 values (exact). Scales and norms take the
 * vector path when the 16 columns share one scale/norm column or have one each, else the row
 * finishes one column at a time. */
__attribute__((target("avx512f"))) static int decode_row_avx512(const dec_job *j, int64_t r, const __m512 *t) {
    const uint8_t *src = j->src + r * j->src_rs;
    double *dst = j->dst + r * j->dst_rs;
    const double *srow = j->scale ? j->scale + (r / j->s_rb) * j->s_rs : NULL;
    double *nrow = j->norm2 ? j->norm2 + (r / j->n_rb) * j->n_rs : NULL;
    __mmask16 nan = 0;
    const int stream = j->stream && ((uintptr_t)dst & 63) == 0; /* 16 values: two whole lines */
    int64_t c = 0;
    for (; c + 16 <= j->cols; c += 16) {
        if (srow && j->s_cb != 1 && c / j->s_cb != (c + 15) / j->s_cb) break;
        if (nrow && j->n_cb != 1 && c / j->n_cb != (c + 15) / j->n_cb) break;
        __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(src + c)));
        __m512 r8[8];
        for (int p = 0; p < 8; p++) r8[p] = _mm512_permutex2var_ps(t[2 * p], idx, t[2 * p + 1]);
        __mmask16 b5 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(32));
        __mmask16 b6 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(64));
        __mmask16 b7 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(128));
        for (int p = 0; p < 4; p++) r8[p] = _mm512_mask_blend_ps(b5, r8[2 * p], r8[2 * p + 1]);
        for (int p = 0; p < 2; p++) r8[p] = _mm512_mask_blend_ps(b6, r8[2 * p], r8[2 * p + 1]);
        __m512 v = _mm512_mask_blend_ps(b7, r8[0], r8[1]);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        __m512d d0 = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
        __m512d d1 = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
        if (srow) {
            if (j->s_cb == 1) {
                d0 = _mm512_mul_pd(d0, _mm512_loadu_pd(srow + c));
                d1 = _mm512_mul_pd(d1, _mm512_loadu_pd(srow + c + 8));
            } else {
                __m512d s = _mm512_set1_pd(srow[c / j->s_cb]);
                d0 = _mm512_mul_pd(d0, s);
                d1 = _mm512_mul_pd(d1, s);
            }
        }
        if (stream) {
            _mm512_stream_pd(dst + c, d0);
            _mm512_stream_pd(dst + c + 8, d1);
        } else {
            _mm512_storeu_pd(dst + c, d0);
            _mm512_storeu_pd(dst + c + 8, d1);
        }
        if (nrow) {
            if (j->n_cb == 1) {
                _mm512_storeu_pd(nrow + c, _mm512_fmadd_pd(d0, d0, _mm512_loadu_pd(nrow + c)));
                _mm512_storeu_pd(nrow + c + 8, _mm512_fmadd_pd(d1, d1, _mm512_loadu_pd(nrow + c + 8)));
            } else {
                nrow[c / j->n_cb] += _mm512_reduce_add_pd(_mm512_fmadd_pd(d1, d1, _mm512_mul_pd(d0, d0)));
            }
        }
    }
    return (nan != 0) | decode_tail(j, r, c);
}

__attribute__((target("avx512f"))) static void decode_rows_avx512(const dec_job *j, int64_t r0, int64_t r1) {
    __m512 t[16];
    for (int p = 0; p < 16; p++) t[p] = _mm512_loadu_ps(j->lut + 16 * p);
    for (int64_t r = r0; r < r1; r++) j->flags[r] = (uint8_t)decode_row_avx512(j, r, t);
    if (j->stream) _mm_sfence(); /* streamed lines visible before the task returns */
}
#endif

/* Units of j->unit rows (a norm block never spans two units, so tasks write disjoint norms). */
void fp8ref_decode_f64(const dec_job *j, size_t lo, size_t hi) {
    int64_t r0 = (int64_t)lo * j->unit, r1 = (int64_t)hi * j->unit < j->rows ? (int64_t)hi * j->unit : j->rows;
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (j->src_cs == 1 && __builtin_cpu_supports("avx512f") && !getenv("FP8REF_NO_AVX512")) {
        decode_rows_avx512(j, r0, r1);
        return;
    }
#endif
    for (int64_t r = r0; r < r1; r++) j->flags[r] = (uint8_t)decode_tail(j, r, 0);
}

/* ---- the product of a few rows with a weight's codes, looked up on the fly -------------------------- */
/* Every product and every partial sum is an integer times 2**g below 2**53 (the fast path's
 * condition), so the sum is exact in any order, fused or not: the bytes of t equal the GEMM's on the
 * decoded weight. Per row n of w, K codes are read once (1 byte each, not 8 of a float64 copy). */
/* out[m, n] += the sum over k in [k0, k1) of row n (m < M); 1 where a looked-up value is NaN. */
static int dot_tail(const dot_job *j, int64_t n, int64_t k0, int64_t k1, double *out) {
    const uint8_t *w = j->w + n * j->w_rs;
    int bad = 0;
    for (int64_t m = 0; m < j->M; m++) {
        const double *a = j->a + m * j->K;
        double s = 0.0;
        for (int64_t k = k0; k < k1; k++) {
            double v = j->lut[w[k]];
            bad |= v != v;
            s += a[k] * v;
        }
        out[m * j->N + n] += s;
    }
    return bad;
}

/* K-block length of the job: its sums are kept apart per block (t's leading axis). */
FP8REF_INLINE int64_t dot_block(const dot_job *j) { return j->bk > 0 && j->bk < j->K ? j->bk : j->K; }

/* K-blocks of the job: ceil(K / L), and one (of zero sums) where K is 0 */
FP8REF_INLINE int64_t dot_blocks(const dot_job *j, int64_t L) { return j->K > 0 ? (j->K + L - 1) / L : 1; }

#if defined(__x86_64__) && defined(__GNUC__)
/* 16 codes per step, looked up as decode_row_avx512 does (permutes and a blend tree, no gathers);
 * a table symmetric in the sign bit (sym) needs half the permutes: the magnitude, then the sign.
 * Each row's K-blocks one after the other: the row's codes are read once, in order. */
__attribute__((target("avx512f"))) static void dot_rows_avx512(const dot_job *j, int64_t n0, int64_t n1) {
    __m512 t[16];
    for (int p = 0; p < 16; p++) t[p] = _mm512_loadu_ps(j->lut + 16 * p);
    const int64_t M = j->M, L = dot_block(j), nb = dot_blocks(j, L);
    const int sym = j->sym != 0;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *w = j->w + n * j->w_rs;
        int bad = 0;
        for (int64_t blk = 0; blk < nb; blk++) {
            const int64_t b0 = blk * L, b1 = j->K - b0 < L ? j->K : b0 + L, e16 = b0 + (b1 - b0) / 16 * 16;
            double *out = j->t + blk * M * j->N;
            __m512d acc[DOT_MAX_M];
            for (int64_t m = 0; m < M; m++) acc[m] = _mm512_setzero_pd();
            __mmask16 nan = 0;
            for (int64_t k = b0; k < e16; k += 16) {
                __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + k)));
                __m512 r8[8], v;
                __mmask16 b5 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(32));
                __mmask16 b6 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(64));
                if (sym) { /* the magnitude's 128 entries, then bit 7 moved to the float's sign */
                    for (int p = 0; p < 4; p++) r8[p] = _mm512_permutex2var_ps(t[2 * p], idx, t[2 * p + 1]);
                    r8[0] = _mm512_mask_blend_ps(b5, r8[0], r8[1]);
                    r8[1] = _mm512_mask_blend_ps(b5, r8[2], r8[3]);
                    __m512i sign = _mm512_slli_epi32(_mm512_and_si512(idx, _mm512_set1_epi32(128)), 24);
                    v = _mm512_castsi512_ps(_mm512_xor_si512(
                        _mm512_castps_si512(_mm512_mask_blend_ps(b6, r8[0], r8[1])), sign));
                } else {
                    for (int p = 0; p < 8; p++) r8[p] = _mm512_permutex2var_ps(t[2 * p], idx, t[2 * p + 1]);
                    __mmask16 b7 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(128));
                    for (int p = 0; p < 4; p++) r8[p] = _mm512_mask_blend_ps(b5, r8[2 * p], r8[2 * p + 1]);
                    for (int p = 0; p < 2; p++) r8[p] = _mm512_mask_blend_ps(b6, r8[2 * p], r8[2 * p + 1]);
                    v = _mm512_mask_blend_ps(b7, r8[0], r8[1]);
                }
                nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
                __m512d d0 = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
                __m512d d1 = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
                for (int64_t m = 0; m < M; m++) {
                    const double *a = j->a + m * j->K + k;
                    acc[m] = _mm512_fmadd_pd(d0, _mm512_loadu_pd(a), acc[m]);
                    acc[m] = _mm512_fmadd_pd(d1, _mm512_loadu_pd(a + 8), acc[m]);
                }
            }
            for (int64_t m = 0; m < M; m++) out[m * j->N + n] = _mm512_reduce_add_pd(acc[m]);
            bad |= (nan != 0) | dot_tail(j, n, e16, b1, out);
        }
        j->flags[n] = (uint8_t)bad;
    }
}
#endif

void fp8ref_lut_dot(const dot_job *j, size_t lo, size_t hi) {
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && !getenv("FP8REF_NO_AVX512")) { /* the env: the tests' portable run */
        dot_rows_avx512(j, (int64_t)lo, (int64_t)hi);
        return;
    }
#endif
    const int64_t L = dot_block(j), nb = dot_blocks(j, L);
    for (size_t n = lo; n < hi; n++) {
        int bad = 0;
        for (int64_t blk = 0; blk < nb; blk++) {
            const int64_t b0 = blk * L;
            double *out = j->t + blk * j->M * j->N;
            for (int64_t m = 0; m < j->M; m++) out[m * j->N + (int64_t)n] = 0.0;
            bad |= dot_tail(j, (int64_t)n, b0, j->K - b0 < L ? j->K : b0 + L, out);
        }
        j->flags[n] = (uint8_t)bad;
    }
}

/* ---- epilogue ----------------------------------------------------------------------------------- */
typedef struct {
    int sh;              /* 53 - P: float64 fraction bits below out's last place */
    uint64_t half, low;  /* 2**(sh-1), 2**sh - 1 */
    double normal;       /* 2**emin */
    double up, down;     /* 2**(P-1-emin) and its inverse: out's subnormal spacing is `down` */
    double max;
} out_grid;

FP8REF_INLINE uint64_t bits64(double x) {
    uint64_t u;
    memcpy(&u, &x, 8);
    return u;
}

FP8REF_INLINE double double64(uint64_t u) {
    double x;
    memcpy(&x, &u, 8);
    return x;
}

/* RNE of h on out's grid, overflow to +-Inf, a zero keeping its sign. */
FP8REF_INLINE double round_out(double h, const out_grid *g) {
    uint64_t u = bits64(h);
    u += ((u >> g->sh) & 1) + (g->half - 1);
    u &= ~g->low;
    double c = double64(u);
    c = fabs(c) > g->max ? copysign(INFINITY, h) : c;
    double tiny = rint(h * g->up) * g->down; /* exact: a power-of-two scaling each way */
    return fabs(h) >= g->normal ? c : tiny;
}

/* z is a rounding boundary of out (a midpoint between neighbours, also the overflow threshold). */
FP8REF_INLINE int on_boundary(double z, const out_grid *g) {
    double a = fabs(z) * g->up;
    int tiny_mid = a - floor(a) == 0.5;
    int mid = (bits64(z) & g->low) == g->half;
    return fabs(z) >= g->normal ? mid : tiny_mid;
}

FP8REF_INLINE void two_sum(double a, double b, double *s, double *e) {
    double x = a + b, bv = x - a;
    *s = x;
    *e = (a - (x - bv)) + (b - bv);
}

/* mode 0 for one element: the correct rounding of s * t + b (b = 0 when there is no bias). */
FP8REF_INLINE double exact_one(double s, double t, double b, int has_bias, const out_grid *g, uint8_t *unsure) {
    double p = s * t;
    double e = __builtin_fma(s, t, -p); /* exact: p + e = s * t (no underflow: |s * t| >= 2**-400 or 0) */
    double h = p, tail = e;
    if (has_bias) {
        double h1, l1, u, d, l3;
        two_sum(p, b, &h1, &l1);
        two_sum(l1, e, &u, &d);
        two_sum(h1, u, &h, &l3);
        tail = l3 != 0 ? l3 : d; /* l3 is a multiple of ulp(u) > 2 |d| when nonzero */
    }
    uint64_t hb = bits64(h);
    int odd_up = tail != 0 && !(hb & 1);
    hb += odd_up ? (((tail > 0) == (h > 0)) ? 1 : (uint64_t)-1) : 0;
    double ro = double64(hb);
    /* outside the proof (never met by FP8 data): a zero h with a tail, a tiny h */
    *unsure = (h == 0 && tail != 0) | (h != 0 && fabs(h) < 0x1p-1000);
    double c = round_out(ro, g);
    return h == 0 ? 0.0 : c;
}

/* mode 1 for one element. */
FP8REF_INLINE double bound_one(double y, double bound, const out_grid *g, uint8_t *unsure) {
    double lo = y - bound, hi = y + bound;
    double clo = round_out(lo, g), chi = round_out(hi, g);
    int sure = bits64(clo) == bits64(chi) && !on_boundary(lo, g) && !on_boundary(hi, g);
    int zero = bound == 0 && y == 0; /* every term is zero: +0 */
    *unsure = !(sure | zero);
    return zero ? 0.0 : clo;
}

#if defined(__x86_64__) && defined(__GNUC__)
/* The same two element functions, 8 elements per step (AVX-512 F/DQ/BW/VL); the scalar ones take
 * the last N % 8. */
#define EPI_TARGET __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl")))
typedef struct {
    __m512i low, half_m1, not_low, half, one;
    __m512d normal, up, down, max, inf, zero;
} vgrid;

EPI_TARGET static vgrid vgrid_of(const out_grid *g) {
    vgrid v;
    v.low = _mm512_set1_epi64((long long)g->low);
    v.not_low = _mm512_set1_epi64((long long)~g->low);
    v.half = _mm512_set1_epi64((long long)g->half);
    v.half_m1 = _mm512_set1_epi64((long long)(g->half - 1));
    v.one = _mm512_set1_epi64(1);
    v.normal = _mm512_set1_pd(g->normal);
    v.up = _mm512_set1_pd(g->up);
    v.down = _mm512_set1_pd(g->down);
    v.max = _mm512_set1_pd(g->max);
    v.inf = _mm512_set1_pd(INFINITY);
    v.zero = _mm512_setzero_pd();
    return v;
}

EPI_TARGET static inline __m512d vround_out(__m512d h, const vgrid *v, int sh) {
    __m512i u = _mm512_castpd_si512(h);
    __m512i r = _mm512_add_epi64(_mm512_and_si512(_mm512_srli_epi64(u, (unsigned)sh), v->one), v->half_m1);
    __m512d c = _mm512_castsi512_pd(_mm512_and_si512(_mm512_add_epi64(u, r), v->not_low));
    __m512i sign = _mm512_andnot_si512(_mm512_castpd_si512(_mm512_abs_pd(h)), u);
    __m512d inf = _mm512_castsi512_pd(_mm512_or_si512(sign, _mm512_castpd_si512(v->inf)));
    c = _mm512_mask_blend_pd(_mm512_cmp_pd_mask(_mm512_abs_pd(c), v->max, _CMP_GT_OQ), c, inf);
    __m512d tiny = _mm512_mul_pd(_mm512_roundscale_pd(_mm512_mul_pd(h, v->up), _MM_FROUND_TO_NEAREST_INT |
                                                      _MM_FROUND_NO_EXC), v->down);
    return _mm512_mask_blend_pd(_mm512_cmp_pd_mask(_mm512_abs_pd(h), v->normal, _CMP_GE_OQ), tiny, c);
}

EPI_TARGET static inline __mmask8 von_boundary(__m512d z, const vgrid *v) {
    __m512d a = _mm512_mul_pd(_mm512_abs_pd(z), v->up);
    __mmask8 tiny_mid = _mm512_cmp_pd_mask(_mm512_sub_pd(a, _mm512_roundscale_pd(a, _MM_FROUND_TO_NEG_INF |
                                                         _MM_FROUND_NO_EXC)), _mm512_set1_pd(0.5), _CMP_EQ_OQ);
    __mmask8 mid = _mm512_cmpeq_epi64_mask(_mm512_and_si512(_mm512_castpd_si512(z), v->low), v->half);
    __mmask8 normal = _mm512_cmp_pd_mask(_mm512_abs_pd(z), v->normal, _CMP_GE_OQ);
    return (normal & mid) | (~normal & tiny_mid);
}

EPI_TARGET static inline void vtwo_sum(__m512d a, __m512d b, __m512d *s, __m512d *e) {
    __m512d x = _mm512_add_pd(a, b), bv = _mm512_sub_pd(x, a);
    *s = x;
    *e = _mm512_add_pd(_mm512_sub_pd(a, _mm512_sub_pd(x, bv)), _mm512_sub_pd(b, bv));
}

EPI_TARGET static inline void store_flags(uint8_t *uns, __mmask8 m) {
    _mm_storel_epi64((__m128i *)uns, _mm_maskz_mov_epi8((__mmask16)m, _mm_set1_epi8(1)));
}

EPI_TARGET static int64_t exact_row_avx512(const epi_job *j, const out_grid *g, int64_t m, const double *t,
                                           double *out, uint8_t *uns) {
    vgrid v = vgrid_of(g);
    const __m512d signbit = _mm512_set1_pd(-0.0), tiny_h = _mm512_set1_pd(0x1p-1000);
    const __m512i minus_one = _mm512_set1_epi64(-1);
    __m512d sa = _mm512_set1_pd(j->sa[m * j->sa_s]);
    int64_t n = 0;
    for (; n + 8 <= j->N; n += 8) {
        __m512d s = j->sb_s ? _mm512_mul_pd(sa, _mm512_loadu_pd(j->sb + n)) : _mm512_mul_pd(sa, _mm512_set1_pd(j->sb[0]));
        __m512d tv = _mm512_loadu_pd(t + n);
        __m512d p = _mm512_mul_pd(s, tv), e = _mm512_fmsub_pd(s, tv, p), h = p, tail = e;
        if (j->bias) {
            __m512d h1, l1, u, d, l3;
            vtwo_sum(p, _mm512_loadu_pd(j->bias + n), &h1, &l1);
            vtwo_sum(l1, e, &u, &d);
            vtwo_sum(h1, u, &h, &l3);
            tail = _mm512_mask_blend_pd(_mm512_cmp_pd_mask(l3, v.zero, _CMP_NEQ_UQ), d, l3);
        }
        __m512i hb = _mm512_castpd_si512(h);
        __mmask8 nz_tail = _mm512_cmp_pd_mask(tail, v.zero, _CMP_NEQ_UQ);
        __mmask8 odd_up = nz_tail & _mm512_testn_epi64_mask(hb, v.one);
        __mmask8 same = _mm512_testn_epi64_mask(_mm512_xor_si512(_mm512_castpd_si512(tail), hb),
                                                _mm512_castpd_si512(signbit));
        hb = _mm512_mask_add_epi64(hb, odd_up, hb, _mm512_mask_blend_epi64(same, minus_one, v.one));
        __mmask8 hzero = _mm512_cmp_pd_mask(h, v.zero, _CMP_EQ_OQ);
        __mmask8 bad = (hzero & nz_tail) | (~hzero & _mm512_cmp_pd_mask(_mm512_abs_pd(h), tiny_h, _CMP_LT_OQ));
        __m512d c = vround_out(_mm512_castsi512_pd(hb), &v, g->sh);
        c = _mm512_mask_blend_pd(hzero, c, v.zero);
        _mm512_storeu_pd(out + n, _mm512_mask_blend_pd(bad, c, tv));
        store_flags(uns + n, bad);
    }
    return n;
}

EPI_TARGET static int64_t bound_row_avx512(const epi_job *j, const out_grid *g, int64_t m, const double *t,
                                           double *out, uint8_t *uns) {
    vgrid v = vgrid_of(g);
    const double *norm = j->norm + m * j->N;
    __m512d slack = _mm512_set1_pd(j->slack * (1 + 0x1p-45));
    int64_t n = 0;
    for (; n + 8 <= j->N; n += 8) {
        __m512d tv = _mm512_loadu_pd(t + n);
        for (int64_t p = 1; p < j->parts; p++) tv = _mm512_add_pd(tv, _mm512_loadu_pd(t + p * j->part_stride + n));
        __m512d b = j->bias ? _mm512_loadu_pd(j->bias + n) : v.zero;
        __m512d y = _mm512_add_pd(tv, b);
        __m512d bound = _mm512_mul_pd(slack, _mm512_add_pd(_mm512_loadu_pd(norm + n), _mm512_abs_pd(b)));
        __m512d lo = _mm512_sub_pd(y, bound), hi = _mm512_add_pd(y, bound);
        __m512d clo = vround_out(lo, &v, g->sh), chi = vround_out(hi, &v, g->sh);
        __mmask8 sure = _mm512_cmpeq_epi64_mask(_mm512_castpd_si512(clo), _mm512_castpd_si512(chi)) &
                        ~von_boundary(lo, &v) & ~von_boundary(hi, &v);
        __mmask8 zero = _mm512_cmp_pd_mask(bound, v.zero, _CMP_EQ_OQ) & _mm512_cmp_pd_mask(y, v.zero, _CMP_EQ_OQ);
        __mmask8 bad = (__mmask8) ~(sure | zero);
        __m512d c = _mm512_mask_blend_pd(zero, clo, v.zero);
        _mm512_storeu_pd(out + n, _mm512_mask_blend_pd(bad, c, tv));
        store_flags(uns + n, bad);
    }
    return n;
}
#endif

void fp8ref_exact_epilogue(const epi_job *j, size_t lo, size_t hi) {
    out_grid g;
    g.sh = 53 - (int)j->precision;
    g.half = (uint64_t)1 << (g.sh - 1);
    g.low = ((uint64_t)1 << g.sh) - 1;
    g.normal = ldexp(1.0, (int)j->emin);
    g.up = ldexp(1.0, (int)(j->precision - 1 - j->emin));
    g.down = 1.0 / g.up;
    g.max = j->max;
    const double widen = 1 + 0x1p-45; /* the rounding of the bound's own two operations */
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    const int vec = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
          __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
#endif
    for (size_t m = lo; m < hi; m++) {
        const double *t = j->t + m * j->ldt;
        double *out = j->out + m * j->N;
        uint8_t *uns = j->unsure + m * j->N;
        const double *bias = j->bias;
        int64_t n = 0;
#if defined(__x86_64__) && defined(__GNUC__)
        if (vec) n = j->mode == 0 ? exact_row_avx512(j, &g, (int64_t)m, t, out, uns)
                                  : bound_row_avx512(j, &g, (int64_t)m, t, out, uns);
#endif
        if (j->mode == 0) {
            double sa = j->sa[m * j->sa_s];
            for (; n < j->N; n++) {
                double c = exact_one(sa * j->sb[n * j->sb_s], t[n], bias ? bias[n] : 0.0, bias != NULL, &g, uns + n);
                out[n] = uns[n] ? t[n] : c;
            }
        } else {
            const double *norm = j->norm + m * j->N;
            double slack = j->slack * widen;
            for (; n < j->N; n++) {
                double b = bias ? bias[n] : 0.0, y = t[n];
                for (int64_t p = 1; p < j->parts; p++) y += t[p * j->part_stride + n];
                double c = bound_one(y + b, slack * (norm[n] + fabs(b)), &g, uns + n);
                out[n] = uns[n] ? y : c;
            }
        }
    }
}

/* ---- exact block sums of single elements (the repair of the blocked path) ------------------------- */
/* sums[blk * E + e] = sum over k in block blk of va[a[m_e, k]] * vb[b[k, n_e]]: every product and
 * every partial sum is an integer times 2**g below 2**53 (the fast path's condition), so exact in
 * any order. Tasks are ranges of e. b row-major (b_cs == 1): k outer, the row of b in L1, a read
 * through its transpose aT (K x M); else (b_rs == 1, a weight's transposed view): per element, a
 * row of a against a row of b's storage, both contiguous. */
void fp8ref_block_sums(const bsum_job *j, size_t lo, size_t hi) {
    int64_t E = j->E, kb = (j->K + j->bk - 1) / j->bk;
    for (int64_t blk = 0; blk < kb; blk++)
        for (size_t e = lo; e < hi; e++) j->sums[blk * E + e] = 0.0;
    if (j->b_cs == 1) {
        for (int64_t k = 0; k < j->K; k++) {
            const uint8_t *brow = j->b + k * j->b_rs, *acol = j->aT + k * j->M;
            double *s = j->sums + (k / j->bk) * E;
            for (size_t e = lo; e < hi; e++) s[e] += j->va[acol[j->mi[e]]] * j->vb[brow[j->ni[e]]];
        }
        return;
    }
    for (size_t e = lo; e < hi; e++) {
        const uint8_t *arow = j->a + j->mi[e] * j->K, *bcol = j->b + j->ni[e] * j->b_cs;
        for (int64_t blk = 0; blk < kb; blk++) {
            int64_t k1 = (blk + 1) * j->bk < j->K ? (blk + 1) * j->bk : j->K;
            double s = 0.0;
            for (int64_t k = blk * j->bk; k < k1; k++) s += j->va[arow[k]] * j->vb[bcol[k]];
            j->sums[blk * E + e] = s;
        }
    }
}
