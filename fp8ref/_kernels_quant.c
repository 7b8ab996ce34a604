/* Fused quantize loops for fp8ref.quant (called through ctypes; linked into fp8ref._kernels).
 *
 * One pass reads 16/32-bit inputs and writes codes; the scale operand is constant over runs of `g`
 * elements of a row (tensor, channel, group and block scales alike: row r's scales start at
 * s[s_off[r]]). The caller (quant.py) fills every format/mode/sign-dependent code exactly as
 * codec.py's _EncParams does, and keeps the numpy paths as the fallback and the reference the
 * tests compare these loops against.
 *
 * quant_exact: the 'fp8ref' recipe, the exact quotient x/s rounded once. For float32-exact x and s the
 * correctly rounded double q = (double)x/(double)s already rounds like x/s in every mode: a decision
 * point d of the format (grid point or midpoint, <= 9 significant bits) that x/s does not equal is at
 * least 2^-34 relative away from it (x - d*s is a nonzero multiple of 2^min(exp(x), exp(d*s)) with
 * |x| < 2^24 such units, |d*s| < 2^33), far more than the 2^-53 double rounding error, so q lies on
 * the same side of every d, and q == d only when x/s == d (docs/quantize.md). q is never subnormal
 * nor infinite (|q| in [2^-277, 2^278]). q is then encoded by integer arithmetic on its bits.
 *
 * quant_f32: producer recipes (compressed-tensors, auto-round, hf-fp8): fp32 x/s or x*m, optionally
 * rounded (RNE, integer arithmetic) to the model dtype bf16/fp16, + 0, clamp, then RNE to the format.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef struct { /* the layout of codec._EncParams */
    int32_t M, emin, bias, mode;
    uint32_t maxmag, signbit;
    uint32_t nan_pos, nan_neg, inf_pos, inf_neg, ovf_pos, ovf_neg, zero_neg;
} enc_params;

typedef struct { /* the layout of quant._QuantJob */
    const void *src;
    uint8_t *dst;
    const float *s;       /* scale operands */
    const int64_t *s_off; /* per row: index of its first operand */
    int64_t K, g;         /* row length; elements per operand along the row */
    int32_t kind;         /* 0 bfloat16, 1 float16, 2 float32 (bit patterns) */
    int32_t op;           /* quant_f32: 0 x / s, 1 x * s */
    int32_t model;        /* quant_f32: 0 none, 1 round to bfloat16, 2 round to float16 */
    int32_t cast16;       /* quant_f32: round the (float16) input to bfloat16 first */
    float addend;         /* +0.0f turns -0 into +0 (add_zero); -0.0f changes nothing */
    float clampv;         /* clamp to +-clampv (+inf: no clamp); NaN passes */
    uint32_t neg0;        /* code replaced by 0 (0x100: none) */
} quant_job;

enum { RNE = 0, RNA = 1, RTZ = 2, RUP = 3, RDOWN = 4, RTO = 5 };
enum { BF16 = 0, F16 = 1, F32 = 2 };

#define SEL(c, a, b) ((b) ^ (((a) ^ (b)) & (0u - (uint32_t)(c))))

static inline float f32_of(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t bits_of(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* float16 bits -> float32, exact, without float arithmetic on subnormals (DAZ-proof). */
static inline float from_f16(uint32_t h) {
    uint32_t a = h & 0x7FFFu, E = a >> 10, m = a & 0x3FFu;
    uint32_t normal = (a << 13) + (112u << 23);
    uint32_t special = 0x7F800000u | (m << 13);
    uint32_t mag = SEL(E == 31, special, normal);
    float sub = (float)(int32_t)m * 0x1p-24f;      /* m * 2^-24 is a normal float32 */
    uint32_t v = SEL(E == 0, bits_of(sub), mag);
    return f32_of(v | ((h & 0x8000u) << 16));
}

static inline float load(const void *src, int64_t i, int kind) {
    if (kind == BF16) return f32_of((uint32_t)((const uint16_t *)src)[i] << 16);
    if (kind == F16) return from_f16(((const uint16_t *)src)[i]);
    return ((const float *)src)[i];
}

/* float32 -> bfloat16 value (RNE), NaN kept as is. */
static inline float round_bf16(float y) {
    uint32_t u = bits_of(y);
    uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    return f32_of(SEL((u & 0x7FFFFFFFu) > 0x7F800000u, u, r));
}

/* float32 -> float16 value (RNE, subnormals, overflow to Inf), as float32; NaN/Inf kept. */
static inline float round_f16(float y) {
    uint32_t u = bits_of(y), a = u & 0x7FFFFFFFu, sign = u & 0x80000000u;
    uint32_t normal = (a + 0xFFFu + ((a >> 13) & 1u)) & ~0x1FFFu;
    /* below 2^-14 the quantum is 2^-24 = ulp(0.5f): one fp32 addition rounds there (RNE) */
    uint32_t sub = bits_of((f32_of(a) + 0.5f) - 0.5f);
    uint32_t r = SEL(a < 0x38800000u, sub, normal);
    r = SEL(a >= 0x477FF000u, 0x7F800000u, r);   /* >= 65520 rounds to Inf */
    r = SEL(a >= 0x7F800000u, a, r);
    return f32_of(r | sign);
}

/* float32 bits -> code, RNE (the producer recipes' only mode). */
static inline uint32_t encode_rne32(uint32_t u, const enc_params *p) {
    uint32_t s = u >> 31, a = u & 0x7FFFFFFFu;
    int32_t E = (int32_t)(a >> 23);
    uint32_t sig = (a & 0x7FFFFFu) | ((uint32_t)(E != 0) << 23);
    int32_t e = E + (E == 0) - 127;
    int32_t below = p->emin - e;
    below = below > 0 ? below : 0;
    int32_t shift = 23 - p->M + below;
    shift = shift < 31 ? shift : 31;
    uint32_t q = sig >> shift, rem = sig & ((1u << shift) - 1u), half = 1u << (shift - 1);
    q += (uint32_t)((rem > half) | ((rem == half) & q));
    int32_t ebase = (e > p->emin ? e : p->emin) + p->bias - 1;
    uint32_t mag = ((uint32_t)ebase << p->M) + q;
    uint32_t c = mag | (s * p->signbit);
    c = SEL(mag == 0, SEL(s, p->zero_neg, 0u), c);
    c = SEL(mag > p->maxmag, SEL(s, p->ovf_neg, p->ovf_pos), c);
    uint32_t special = SEL((a & 0x7FFFFFu) != 0, SEL(s, p->nan_neg, p->nan_pos), SEL(s, p->inf_neg, p->inf_pos));
    return SEL(E == 255, special, c);
}

/* ---- quant_f32 ------------------------------------------------------------------------------ */
#define F32_LOOP(KIND, MUL, MODEL)                                                            \
    for (int64_t r = r0; r < r1; r++) {                                                       \
        const float *srow = j.s + j.s_off[r];                                                 \
        for (int64_t k0 = 0; k0 < j.K; k0 += j.g) {                                           \
            int64_t k1 = k0 + j.g < j.K ? k0 + j.g : j.K;                                     \
            float sv = srow[k0 / j.g];                                                        \
            for (int64_t k = r * j.K + k0; k < r * j.K + k1; k++) {                           \
                float x = load(j.src, k, KIND);                                               \
                if (KIND == F16) x = f32_of(SEL(j.cast16, bits_of(round_bf16(x)), bits_of(x))); \
                float y = MUL ? x * sv : x / sv;                                              \
                if (MODEL == 1) y = round_bf16(y);                                            \
                if (MODEL == 2) y = round_f16(y);                                             \
                y = y + j.addend;                                                             \
                y = y > j.clampv ? j.clampv : y;                                              \
                y = y < -j.clampv ? -j.clampv : y;                                            \
                uint32_t c = encode_rne32(bits_of(y), &p);                                    \
                j.dst[k] = (uint8_t)SEL(c == j.neg0, 0u, c);                                  \
            }                                                                                 \
        }                                                                                     \
    }

#define F32_MODELS(KIND, MUL)                            \
    switch (j.model) {                                   \
    case 0: F32_LOOP(KIND, MUL, 0) break;                \
    case 1: F32_LOOP(KIND, MUL, 1) break;                \
    default: F32_LOOP(KIND, MUL, 2) break;               \
    }

__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
void fp8ref_quant_f32(const quant_job *jp, size_t r0_, size_t r1_, const enc_params *pp) {
    const quant_job j = *jp;
    const enc_params p = *pp;
    int64_t r0 = (int64_t)r0_, r1 = (int64_t)r1_;
    int sel = j.kind * 2 + (j.op != 0);
    switch (sel) {
    case 0: F32_MODELS(BF16, 0) break;
    case 1: F32_MODELS(BF16, 1) break;
    case 2: F32_MODELS(F16, 0) break;
    case 3: F32_MODELS(F16, 1) break;
    case 4: F32_MODELS(F32, 0) break;
    default: F32_MODELS(F32, 1) break;
    }
}

/* ---- quant_exact ---------------------------------------------------------------------------- */
#define EXACT_LOOP(KIND, ROUND_UP)                                                            \
    for (int64_t r = r0; r < r1; r++) {                                                       \
        const float *srow = j.s + j.s_off[r];                                                 \
        for (int64_t k0 = 0; k0 < j.K; k0 += j.g) {                                           \
            int64_t k1 = k0 + j.g < j.K ? k0 + j.g : j.K;                                     \
            double sd = (double)srow[k0 / j.g];                                               \
            for (int64_t k = r * j.K + k0; k < r * j.K + k1; k++) {                           \
                double x = (double)load(j.src, k, KIND);                                      \
                double qd = x / sd;                                                           \
                uint64_t u;                                                                   \
                memcpy(&u, &qd, 8);                                                           \
                uint64_t s = u >> 63, a = u & 0x7FFFFFFFFFFFFFFFull;                          \
                int64_t E = (int64_t)(a >> 52);                                               \
                uint64_t sig = (a & 0xFFFFFFFFFFFFFull) | ((uint64_t)(E != 0) << 52);         \
                int64_t e = E + (E == 0) - 1023;                                              \
                int64_t below = p.emin - e;                                                   \
                below = below > 0 ? below : 0;                                                \
                int64_t shift = 52 - p.M + below;                                             \
                shift = shift < 63 ? shift : 63;                                              \
                uint64_t q = sig >> shift;                                                    \
                uint64_t frac = sig << (64 - shift); /* the dropped bits, left-aligned */     \
                (void)frac; /* rtz does not look at them */                                   \
                q += (uint64_t)(ROUND_UP);                                                    \
                int64_t ebase = (e > p.emin ? e : p.emin) + p.bias - 1;                       \
                uint64_t mag = ((uint64_t)ebase << p.M) + q;                                  \
                uint32_t c = (uint32_t)mag | ((uint32_t)s * p.signbit);                       \
                c = SEL(mag == 0, SEL(s, p.zero_neg, 0u), c);                                 \
                c = SEL(mag > p.maxmag, SEL(s, p.ovf_neg, p.ovf_pos), c);                     \
                j.dst[k] = (uint8_t)c;                                                        \
            }                                                                                 \
        }                                                                                     \
    }

#define HALF (1ull << 63)
/* gcc 12 vectorizes variable shifts of data, not of constants: the mask tests use frac */
#define EXACT_MODES(KIND)                                                  \
    switch (p.mode) {                                                      \
    case RNE: EXACT_LOOP(KIND, (frac > HALF) | ((frac == HALF) & q)) break; \
    case RNA: EXACT_LOOP(KIND, frac >= HALF) break;                         \
    case RTZ: EXACT_LOOP(KIND, 0u) break;                                   \
    case RUP: EXACT_LOOP(KIND, (frac != 0u) & (s ^ 1u)) break;              \
    case RDOWN: EXACT_LOOP(KIND, (frac != 0u) & s) break;                   \
    default: EXACT_LOOP(KIND, (frac != 0u) & ~q & 1u) break;                \
    }

/* Inputs must be finite (the 'fp8ref' recipe rejects NaN/Inf first); s positive finite float32. */
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
void fp8ref_quant_exact(const quant_job *jp, size_t r0_, size_t r1_, const enc_params *pp) {
    const quant_job j = *jp;
    const enc_params p = *pp;
    int64_t r0 = (int64_t)r0_, r1 = (int64_t)r1_;
    switch (j.kind) {
    case BF16: EXACT_MODES(BF16) break;
    case F16: EXACT_MODES(F16) break;
    default: EXACT_MODES(F32) break;
    }
}

/* ---- amax ------------------------------------------------------------------------------------ */
/* out[r, j] = max magnitude bits (sign cleared) over row r's elements [j*g, (j+1)*g): integer
 * order is magnitude order and NaN patterns sort above Inf, as scaling.reduce_amax. */
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
void fp8ref_amax_u16(const uint16_t *restrict src, uint16_t *restrict out, size_t r0, size_t r1, size_t K,
                     size_t g) {
    size_t ng = (K + g - 1) / g;
    for (size_t r = r0; r < r1; r++)
        for (size_t jg = 0; jg < ng; jg++) {
            size_t k1 = (jg + 1) * g < K ? (jg + 1) * g : K;
            uint16_t m = 0;
            for (size_t k = jg * g; k < k1; k++) {
                uint16_t a = src[r * K + k] & 0x7FFFu;
                m = a > m ? a : m;
            }
            out[r * ng + jg] = m;
        }
}

__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
void fp8ref_amax_u32(const uint32_t *restrict src, uint32_t *restrict out, size_t r0, size_t r1, size_t K,
                     size_t g) {
    size_t ng = (K + g - 1) / g;
    for (size_t r = r0; r < r1; r++)
        for (size_t jg = 0; jg < ng; jg++) {
            size_t k1 = (jg + 1) * g < K ? (jg + 1) * g : K;
            uint32_t m = 0;
            for (size_t k = jg * g; k < k1; k++) {
                uint32_t a = src[r * K + k] & 0x7FFFFFFFu;
                m = a > m ? a : m;
            }
            out[r * ng + jg] = m;
        }
}
