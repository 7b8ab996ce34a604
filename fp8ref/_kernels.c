/* Fast loops for fp8ref's codec, called through ctypes (the GIL is released during calls).
 *
 * encode_f32: float32 -> ExMy codes by integer arithmetic on the float32 bit pattern. The caller
 * (codec.py) precomputes every code that depends on the format, mode and sign (NaN, Inf, overflow,
 * negative zero), so the loop below only rounds. It is one of two independent encoders: the other
 * is the numpy path in codec.py, and tests compare them.
 *
 * gather_u16 / gather_f32_rto16 / decode_f32: table lookups (16-bit inputs -> codes, codes -> values).
 * seq_acc_f32: the declared-order fp32 accumulation of fp8ref.matmul.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stddef.h>

typedef struct {
    int32_t M, emin, bias, mode;
    uint32_t maxmag, signbit;
    uint32_t nan_pos, nan_neg, inf_pos, inf_neg, ovf_pos, ovf_neg, zero_neg;
} enc_params;

enum { RNE = 0, RNA = 1, RTZ = 2, RUP = 3, RDOWN = 4, RTO = 5 };

/* Branch-free so that compilers vectorize it: SEL(c, a, b) is c ? a : b for c in {0, 1}. */
#define SEL(c, a, b) ((b) ^ (((a) ^ (b)) & (0u - (uint32_t)(c))))

#define ENCODE_LOOP(ROUND_UP)                                                         \
    for (size_t i = 0; i < n; i++) {                                                  \
        uint32_t u = src[i];                                                          \
        uint32_t s = u >> 31;                                                         \
        uint32_t a = u & 0x7FFFFFFFu;                                                 \
        int32_t E = (int32_t)(a >> 23);                                               \
        uint32_t sig = (a & 0x7FFFFFu) | ((uint32_t)(E != 0) << 23);                  \
        int32_t e = E + (E == 0) - 127;                                               \
        int32_t below = p.emin - e;                                                   \
        below = below > 0 ? below : 0;                                                \
        int32_t shift = 23 - p.M + below;                                             \
        shift = shift < 31 ? shift : 31;                                              \
        uint32_t q = sig >> shift;                                                    \
        uint32_t rem = sig & ((1u << shift) - 1u);                                    \
        uint32_t half = 1u << (shift - 1);                                            \
        q += (uint32_t)(ROUND_UP);                                                    \
        int32_t ebase = (e > p.emin ? e : p.emin) + p.bias - 1;                       \
        uint32_t mag = ((uint32_t)ebase << p.M) + q;                                  \
        uint32_t c = mag | (s * p.signbit);                                           \
        c = SEL(mag == 0, SEL(s, p.zero_neg, 0u), c);                                 \
        c = SEL(mag > p.maxmag, SEL(s, p.ovf_neg, p.ovf_pos), c);                     \
        uint32_t special = SEL((a & 0x7FFFFFu) != 0, SEL(s, p.nan_neg, p.nan_pos),    \
                               SEL(s, p.inf_neg, p.inf_pos));                         \
        c = SEL(E == 255, special, c);                                                \
        dst[i] = (uint8_t)c;                                                          \
    }

__attribute__((target_clones("avx2", "default")))
void fp8ref_encode_f32(const uint32_t *restrict src, uint8_t *restrict dst, size_t n,
                       const enc_params *pp) {
    const enc_params p = *pp;
    switch (p.mode) {
    case RNE: ENCODE_LOOP((rem > half) | ((rem == half) & q)) break;
    case RNA: ENCODE_LOOP(rem >= half) break;
    case RTZ: ENCODE_LOOP(0u) break;
    case RUP: ENCODE_LOOP((rem != 0u) & (s ^ 1u)) break;
    case RDOWN: ENCODE_LOOP((rem != 0u) & s) break;
    case RTO: ENCODE_LOOP((rem != 0u) & ~q) break;
    default: break;
    }
}

__attribute__((target_clones("avx2", "default")))
void fp8ref_gather_u16(const uint16_t *restrict src, uint8_t *restrict dst, size_t n,
                       const uint8_t *restrict lut) {
    for (size_t i = 0; i < n; i++) dst[i] = lut[src[i]];
}

/* float32 input through a 65536-entry table indexed by the bfloat16 "round to odd" of x:
 * the top 16 bits with the sticky OR of the low 16 bits folded into bit 0. */
__attribute__((target_clones("avx2", "default")))
void fp8ref_gather_f32_rto16(const uint32_t *restrict src, uint8_t *restrict dst, size_t n,
                             const uint8_t *restrict lut) {
    for (size_t i = 0; i < n; i++) {
        uint32_t u = src[i];
        dst[i] = lut[(u | ((u & 0xFFFFu) + 0xFFFFu)) >> 16];
    }
}

__attribute__((target_clones("avx2", "default")))
void fp8ref_decode_f32(const uint8_t *restrict src, float *restrict dst, size_t n,
                       const float *restrict lut) {
    for (size_t i = 0; i < n; i++) dst[i] = lut[src[i]];
}

/* Sequential fp32 accumulation for fp8ref.matmul's "fp32" model:
 *   part[m, n] = (((+0 + A[m,k0]*B[k0,n]) + A[m,k0+1]*B[k0+1,n]) + ...)   for k in [k0, k1)
 * each product and each sum rounded to fp32 (built with -ffp-contract=off: no fused multiply-add).
 * The order over k is the declared one; tiling over m and n only changes which (m, n) are computed
 * together, never the order of additions into one accumulator. Columns [n0, n1) let callers split
 * the work across threads. A is M x K, B is K x N, part is M x N, all row-major. */
#define ACC_MT 4
#define ACC_NT 64
#define ACC_KC 256 /* k-chunk: a 256 x 64 tile of B (64 KiB) stays in L2 while every m-tile uses it */
__attribute__((target_clones("avx512f", "avx2", "default")))
void fp8ref_seq_acc_f32(const float *restrict A, const float *restrict B, float *restrict part,
                        size_t M, size_t K, size_t N, size_t k0, size_t k1, size_t n0, size_t n1) {
    float acc[ACC_MT][ACC_NT];
    for (size_t m = 0; m < M; m++)
        for (size_t n = n0; n < n1; n++) part[m * N + n] = 0.0f;
    /* Accumulators live in `part` between k-chunks, so each one still adds in k order. */
    for (size_t kc = k0; kc < k1; kc += ACC_KC) {
        size_t ke = k1 - kc < ACC_KC ? k1 : kc + ACC_KC;
        for (size_t nt = n0; nt < n1; nt += ACC_NT) {
            size_t nw = n1 - nt < ACC_NT ? n1 - nt : ACC_NT;
            for (size_t m = 0; m < M; m += ACC_MT) {
                size_t mw = M - m < ACC_MT ? M - m : ACC_MT;
                for (size_t i = 0; i < mw; i++)
                    for (size_t j = 0; j < nw; j++) acc[i][j] = part[(m + i) * N + nt + j];
                if (mw == ACC_MT && nw == ACC_NT) {
                    for (size_t k = kc; k < ke; k++) {
                        const float *brow = B + k * N + nt;
                        for (size_t i = 0; i < ACC_MT; i++) {
                            float a = A[(m + i) * K + k];
                            for (size_t j = 0; j < ACC_NT; j++) acc[i][j] = acc[i][j] + a * brow[j];
                        }
                    }
                } else {
                    for (size_t k = kc; k < ke; k++) {
                        const float *brow = B + k * N + nt;
                        for (size_t i = 0; i < mw; i++) {
                            float a = A[(m + i) * K + k];
                            for (size_t j = 0; j < nw; j++) acc[i][j] = acc[i][j] + a * brow[j];
                        }
                    }
                }
                for (size_t i = 0; i < mw; i++)
                    for (size_t j = 0; j < nw; j++) part[(m + i) * N + nt + j] = acc[i][j];
            }
        }
    }
}

static struct PyModuleDef kernels_module = {PyModuleDef_HEAD_INIT, "_kernels",
                                            "C loops for fp8ref.codec (used through ctypes).", -1, NULL};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&kernels_module); }
