/* Fast loops for fp8ref's codec, called through ctypes (the GIL is released during calls).
 *
 * encode_f32: float32 -> ExMy codes by integer arithmetic on the float32 bit pattern. The caller
 * (codec.py) precomputes every code that depends on the format, mode and sign (NaN, Inf, overflow,
 * negative zero), so the loop below only rounds. It is one of two independent encoders: the other
 * is the numpy path in codec.py, and tests compare them.
 *
 * gather_u16 / gather_f32_rto16 / decode_f32: table lookups (16-bit inputs -> codes, codes -> values).
 * The declared-order fp32 GEMM of fp8ref.matmul is in _kernels_matmul.c.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stddef.h>
#include <string.h>

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

/* Round-to-nearest-even fast path (the common case): the normal range rounds the float32 bit
 * pattern itself (add half an ulp minus one, plus the kept LSB, then shift: carries walk into the
 * exponent as they should); the subnormal range adds a "magic" power of two whose ulp is the target's
 * subnormal quantum, so the FPU's own round-to-nearest-even (the default mode, never changed here)
 * does the rounding (the classic float -> half trick). codec.py uses it only for formats whose
 * half-minimum subnormal is >= 2**-126, so float32 subnormal inputs (even flushed by DAZ) give 0. */
typedef struct {
    uint32_t S, H, B, emin_bits, magic_bits, maxmag, signbit;
    uint32_t nan_pos, nan_neg, inf_pos, inf_neg, ovf_pos, ovf_neg, zero_neg;
} rne_params;

static inline float bits_to_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t f32_to_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
void fp8ref_encode_f32_rne(const uint32_t *restrict src, uint8_t *restrict dst, size_t n,
                           const rne_params *pp) {
    const rne_params p = *pp;
    const float magic = bits_to_f32(p.magic_bits);
    for (size_t i = 0; i < n; i++) {
        uint32_t u = src[i];
        uint32_t s = u >> 31;
        uint32_t a = u & 0x7FFFFFFFu;
        uint32_t normal = ((a + p.H + ((a >> p.S) & 1u)) >> p.S) - p.B;
        uint32_t subnormal = f32_to_bits(bits_to_f32(a) + magic) - p.magic_bits;
        uint32_t mag = SEL(a < p.emin_bits, subnormal, normal);
        uint32_t c = mag | (s * p.signbit);
        c = SEL(mag == 0, SEL(s, p.zero_neg, 0u), c);
        c = SEL(mag > p.maxmag, SEL(s, p.ovf_neg, p.ovf_pos), c);
        uint32_t special = SEL(a > 0x7F800000u, SEL(s, p.nan_neg, p.nan_pos), SEL(s, p.inf_neg, p.inf_pos));
        c = SEL(a >= 0x7F800000u, special, c);
        dst[i] = (uint8_t)c;
    }
}

__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
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

__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
void fp8ref_gather_u16(const uint16_t *restrict src, uint8_t *restrict dst, size_t n,
                       const uint8_t *restrict lut) {
    for (size_t i = 0; i < n; i++) dst[i] = lut[src[i]];
}

/* float32 input through a 65536-entry table indexed by the bfloat16 "round to odd" of x:
 * the top 16 bits with the sticky OR of the low 16 bits folded into bit 0. */
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
void fp8ref_gather_f32_rto16(const uint32_t *restrict src, uint8_t *restrict dst, size_t n,
                             const uint8_t *restrict lut) {
    for (size_t i = 0; i < n; i++) {
        uint32_t u = src[i];
        dst[i] = lut[(u | ((u & 0xFFFFu) + 0xFFFFu)) >> 16];
    }
}

__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
void fp8ref_decode_f32(const uint8_t *restrict src, float *restrict dst, size_t n,
                       const float *restrict lut) {
    for (size_t i = 0; i < n; i++) dst[i] = lut[src[i]];
}

static struct PyModuleDef kernels_module = {PyModuleDef_HEAD_INIT, "_kernels",
                                            "C loops for fp8ref.codec (used through ctypes).", -1, NULL};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&kernels_module); }
