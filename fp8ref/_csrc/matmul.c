/* The declared-order fp32 GEMM model of fp8ref.matmul (accumulate="fp32"), called through ctypes.
 *
 * For every output (m, n) and every accumulation block [k0, k0 + L) of K:
 *     part = +0;  for k in order: part = fp32(part + fp32(a[m,k] * b[k,n]))
 *     total = fp32(total + fp32(fp32(sa[m,blk] * sb[blk,n]) * part))   (no scales: total + part)
 * Every product and every sum is rounded on its own: the file is compiled with -ffp-contract=off
 * and the kernels multiply, then add, so they give the same bits as the scalar definition. The
 * one exception is explicit: when every product is exact in fp32 (FP8 code operands), rounding it
 * is a no-op and a fused multiply-add gives the same bits at half the cost (ukr_avx512_fma). Speed comes from the loop structure only: each output
 * still sees its k in increasing order.
 *
 * Structure (BLIS-like): k is cut into chunks of at most KC that never cross a block boundary;
 * rows into blocks of MC; per chunk and row block the A values are packed (rows interleaved by MR,
 * decoded from FP8 codes through a table on the way), the B values as NR-column panels (kc x NR,
 * L1-resident once used), and a micro-kernel keeps an MR x NR accumulator tile in registers for the
 * whole chunk, broadcasting one A value per row and step. Between chunks the tile lives in `part`.
 * The B panels of a chunk are packed together, row by row, so that B is read contiguously.
 */
#include "kernels.h"

#define KC 256    /* k per chunk: a 256 x 32 B panel (32 KiB) stays in L1 */
#define MC 256    /* rows per packed A block (<= 256 KiB, L2) */
#define MR_MAX 8
#define NR_MAX 32 /* scratch: MC * KC + KC * (n1 - n0 rounded up to NR_MAX) floats plus 64 bytes */

typedef void (*ukernel)(const float *ap, const float *bp, size_t kc, float *c, size_t ldc, int zero);

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

/* 8 x 32 tile = 16 zmm accumulators; per k: 2 B loads, 8 broadcasts, 16 multiplies, 16 adds.
 * STEP(acc, a, b) is either a rounded product then a rounded sum, or one fused multiply-add: the
 * fused form is used only when the caller proves every product exact in fp32 (FP8 operands in the
 * "epilogue" order), where fp32(acc + fp32(a*b)) == fp32(acc + a*b) bit for bit. */
#define MULADD512(acc, a, b) _mm512_add_ps(acc, _mm512_mul_ps(a, b))
#define FMA512(acc, a, b) _mm512_fmadd_ps(a, b, acc)
#define UKR_AVX512(NAME, STEP)                                                                          \
    __attribute__((target("avx512f"))) static void NAME(const float *ap, const float *bp, size_t kc,   \
                                                        float *c, size_t ldc, int zero) {               \
        __m512 acc[8][2];                                                                               \
        _Pragma("GCC unroll 8") for (int i = 0; i < 8; i++) {                                           \
            acc[i][0] = zero ? _mm512_setzero_ps() : _mm512_loadu_ps(c + i * ldc);                      \
            acc[i][1] = zero ? _mm512_setzero_ps() : _mm512_loadu_ps(c + i * ldc + 16);                 \
        }                                                                                               \
        for (size_t k = 0; k < kc; k++, ap += 8, bp += 32) {                                            \
            __m512 b0 = _mm512_load_ps(bp), b1 = _mm512_load_ps(bp + 16);                               \
            _Pragma("GCC unroll 8") for (int i = 0; i < 8; i++) {                                       \
                __m512 a = _mm512_set1_ps(ap[i]);                                                       \
                acc[i][0] = STEP(acc[i][0], a, b0);                                                     \
                acc[i][1] = STEP(acc[i][1], a, b1);                                                     \
            }                                                                                           \
        }                                                                                               \
        _Pragma("GCC unroll 8") for (int i = 0; i < 8; i++) {                                           \
            _mm512_storeu_ps(c + i * ldc, acc[i][0]);                                                   \
            _mm512_storeu_ps(c + i * ldc + 16, acc[i][1]);                                              \
        }                                                                                               \
    }
UKR_AVX512(ukr_avx512, MULADD512)
UKR_AVX512(ukr_avx512_fma, FMA512)

/* 6 x 16 tile = 12 ymm accumulators (AVX2 has 16 vector registers). */
__attribute__((target("avx2"))) static void ukr_avx2(const float *ap, const float *bp, size_t kc, float *c,
                                                     size_t ldc, int zero) {
    __m256 acc[6][2];
#pragma GCC unroll 6
    for (int i = 0; i < 6; i++) {
        acc[i][0] = zero ? _mm256_setzero_ps() : _mm256_loadu_ps(c + i * ldc);
        acc[i][1] = zero ? _mm256_setzero_ps() : _mm256_loadu_ps(c + i * ldc + 8);
    }
    for (size_t k = 0; k < kc; k++, ap += 6, bp += 16) {
        __m256 b0 = _mm256_load_ps(bp), b1 = _mm256_load_ps(bp + 8);
#pragma GCC unroll 6
        for (int i = 0; i < 6; i++) {
            __m256 a = _mm256_broadcast_ss(ap + i);
            acc[i][0] = _mm256_add_ps(acc[i][0], _mm256_mul_ps(a, b0));
            acc[i][1] = _mm256_add_ps(acc[i][1], _mm256_mul_ps(a, b1));
        }
    }
#pragma GCC unroll 6
    for (int i = 0; i < 6; i++) {
        _mm256_storeu_ps(c + i * ldc, acc[i][0]);
        _mm256_storeu_ps(c + i * ldc + 8, acc[i][1]);
    }
}

/* pack_b's common case (codes, a full 32-column panel): the table lookups as 16-wide gathers. */
__attribute__((target("avx512f"))) static void pack_b_codes_avx512(const uint8_t *B, const float *tab,
                                                                   size_t N, size_t kb, size_t kc, size_t n,
                                                                   float *bp) {
    for (size_t k = 0; k < kc; k++, bp += 32) {
        const uint8_t *row = B + (kb + k) * N + n;
        __m512i i0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)row));
        __m512i i1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + 16)));
        _mm512_store_ps(bp, _mm512_i32gather_ps(i0, tab, 4));
        _mm512_store_ps(bp + 16, _mm512_i32gather_ps(i1, tab, 4));
    }
}
#endif

/* Portable 4 x 8 tile. */
static void ukr_plain(const float *ap, const float *bp, size_t kc, float *c, size_t ldc, int zero) {
    float acc[4][8];
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 8; j++) acc[i][j] = zero ? 0.0f : c[i * ldc + j];
    for (size_t k = 0; k < kc; k++, ap += 4, bp += 8)
        for (int i = 0; i < 4; i++)
            for (int j = 0; j < 8; j++) acc[i][j] = acc[i][j] + ap[i] * bp[j];
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 8; j++) c[i * ldc + j] = acc[i][j];
}

static ukernel pick(size_t *mr, size_t *nr, size_t fused) {
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) { *mr = 8; *nr = 32; return fused ? ukr_avx512_fma : ukr_avx512; }
    if (__builtin_cpu_supports("avx2")) { *mr = 6; *nr = 16; return ukr_avx2; }
#endif
    *mr = 4; *nr = 8;
    return ukr_plain;
}

/* x[r, k] for an operand given as float32 values (tab == NULL) or as uint8 codes and a value table. */
static inline float value(const void *x, const float *tab, size_t i) {
    return tab ? tab[((const uint8_t *)x)[i]] : ((const float *)x)[i];
}

/* A rows [m0, m0+mc), k [kb, kb+kc) -> ap[(tile * kc + k) * mr + i]; rows past M are zero. */
static void pack_a(const void *A, const float *tab, size_t M, size_t K, size_t m0, size_t mc, size_t kb,
                   size_t kc, size_t mr, float *ap) {
    for (size_t t = 0; t < mc; t += mr, ap += kc * mr)
        for (size_t i = 0; i < mr; i++) {
            size_t m = m0 + t + i;
            for (size_t k = 0; k < kc; k++) ap[k * mr + i] = m < M ? value(A, tab, m * K + kb + k) : 0.0f;
        }
}

/* B k [kb, kb+kc), columns [n, n+nw) -> bp[k * nr + j]; columns past nw are zero. */
static void pack_b(const void *B, const float *tab, size_t N, size_t kb, size_t kc, size_t n, size_t nw,
                   size_t nr, float *bp) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (tab && nw == 32 && nr == 32) {
        pack_b_codes_avx512(B, tab, N, kb, kc, n, bp);
        return;
    }
#endif
    for (size_t k = 0; k < kc; k++)
        for (size_t j = 0; j < nr; j++) bp[k * nr + j] = j < nw ? value(B, tab, (kb + k) * N + n + j) : 0.0f;
}

/* total[m, n] = fp32(total + fp32(fp32(sa[m,blk] * sb[blk,n]) * part)), or total + part (no scales). */
static void epilogue(const float *sa, const float *sb, size_t KB, size_t blk, const float *c, size_t ldc,
                     float *total, size_t N, size_t m, size_t mw, size_t n, size_t nw) {
    for (size_t i = 0; i < mw; i++) {
        float *t = total + (m + i) * N + n;
        const float *p = c + i * ldc;
        if (sa) {
            float s_a = sa[(m + i) * KB + blk];
            const float *s_b = sb + blk * N + n;
            for (size_t j = 0; j < nw; j++) t[j] = t[j] + (s_a * s_b[j]) * p[j];
        } else {
            for (size_t j = 0; j < nw; j++) t[j] = t[j] + p[j];
        }
    }
}

/* The fp32 model for output columns [n0, n1) (threads take disjoint column ranges).
 * A: M x K, B: K x N, row-major, float32 values (tab_* NULL) or uint8 codes with a 256-entry value
 * table. sa: M x KB, sb: KB x N float32 (both NULL: total += part unscaled). L: accumulation block
 * length; the block starting at k uses scale column min(k / bk, KB - 1). total (M x N) is written;
 * part (M x N) holds accumulators between chunks; scratch: see NR_MAX. fused != 0 (with code
 * operands) allows the fused multiply-add kernel: the caller has proved every product exact. */
static void mm_cut(const void *A, const void *B, const float *tab_a, const float *tab_b, const float *sa,
                   const float *sb, float *total, float *part, float *scratch, size_t M, size_t K, size_t N,
                   size_t L, size_t bk, size_t KB, size_t n0, size_t n1, size_t fused) {
    size_t mr, nr;
    ukernel ukr = pick(&mr, &nr, fused && tab_a && tab_b);
    float *ap = (float *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    float *bp = ap + MC * KC;
    float tile[MR_MAX * NR_MAX];
    for (size_t m = 0; m < M; m++)
        for (size_t n = n0; n < n1; n++) total[m * N + n] = 0.0f;
    for (size_t b0 = 0; b0 < K; b0 += L) {
        size_t b1 = K - b0 < L ? K : b0 + L;
        size_t blk = b0 / bk < KB ? b0 / bk : KB - 1;
        for (size_t kb = b0; kb < b1; kb += KC) {
            size_t kc = b1 - kb < KC ? b1 - kb : KC;
            int first = kb == b0, last = kb + kc == b1;
            /* all column panels of this chunk at once: the rows of B are read contiguously */
            for (size_t n = n0; n < n1; n += nr)
                pack_b(B, tab_b, N, kb, kc, n, n1 - n < nr ? n1 - n : nr, nr, bp + (n - n0) * kc);
            for (size_t m0 = 0; m0 < M; m0 += MC) {
                size_t mc = M - m0 < MC ? M - m0 : MC;
                size_t mc_pad = (mc + mr - 1) / mr * mr;
                pack_a(A, tab_a, M, K, m0, mc_pad, kb, kc, mr, ap);
                for (size_t n = n0; n < n1; n += nr) {
                    size_t nw = n1 - n < nr ? n1 - n : nr;
                    for (size_t t = 0; t < mc_pad; t += mr) {
                        size_t m = m0 + t, mw = M - m < mr ? M - m : mr;
                        float *c = part + m * N + n;
                        size_t ldc = N;
                        if (mw < mr || nw < nr) { /* edge tile: work on a padded copy */
                            for (size_t i = 0; i < mr; i++)
                                for (size_t j = 0; j < nr; j++)
                                    tile[i * nr + j] = (!first && i < mw && j < nw) ? c[i * N + j] : 0.0f;
                            c = tile;
                            ldc = nr;
                        }
                        ukr(ap + t * kc, bp + (n - n0) * kc, kc, c, ldc, first);
                        if (c == tile && !last)
                            for (size_t i = 0; i < mw; i++) memcpy(part + (m + i) * N + n, tile + i * nr, nw * 4);
                        if (last) epilogue(sa, sb, KB, blk, c, ldc, total, N, m, mw, n, nw);
                    }
                }
            }
        }
    }
}

/* Column cuts [lo, hi) of the job: cut c is columns [c*step, min(N, (c+1)*step)), with its own scratch. */
void fp8ref_mm_seq_f32(const mm_job *j, size_t lo, size_t hi) {
    for (size_t c = lo; c < hi; c++) {
        size_t n0 = c * j->step, n1 = n0 + j->step < j->N ? n0 + j->step : j->N;
        mm_cut(j->A, j->B, j->tab_a, j->tab_b, j->sa, j->sb, j->total, j->part, j->scratch + c * j->scratch_stride,
               j->M, j->K, j->N, j->L, j->bk, j->KB, n0, n1, j->fused);
    }
}
