/* Quantize loops for fp8ref.quant (called through ctypes; linked into fp8ref._kernels).
 *
 * One pass reads 16/32-bit inputs and writes codes; the scale operand is constant over runs of `g`
 * elements of a row (tensor, channel, group and block scales alike). The caller (quant.py) fills
 * every format/mode/sign-dependent code exactly as codec.py's _EncParams does, and keeps the numpy
 * paths as the fallback and the reference the tests compare these loops against.
 *
 * exact ('fp8ref' recipe): the exact quotient x/s rounded once. For float32-exact x and s the
 * correctly rounded double q = (double)x/(double)s already rounds like x/s in every mode: a decision
 * point d of the format (grid point or midpoint, <= 9 significant bits) that x/s does not equal is at
 * least 2^-34 relative away from it (x - d*s is a nonzero multiple of 2^min(exp(x), exp(d*s)) with
 * |x| < 2^24 such units, |d*s| < 2^33), far more than the 2^-53 double rounding error, so q lies on
 * the same side of every d, and q == d only when x/s == d (docs/quantize.md). q is never subnormal
 * nor infinite (|q| in [2^-277, 2^278]). q is then encoded by the encode core on its bits.
 *
 * not exact: producer recipes (compressed-tensors, auto-round, hf-fp8): fp32 x/s or x*m, optionally
 * rounded (RNE, integer arithmetic) to the model dtype bf16/fp16, + 0, clamp, then RNE to the format.
 *
 * fp8ref_quant takes the operands from s (given or computed scales); fp8ref_quant_fused (16-bit
 * inputs, dynamic scales) finds each (band, group)'s amax, looks its operand up in `table` (quant.py
 * fills it with recipes.compute_scale of every 15-bit magnitude, so the scale rule has one home) and
 * encodes the tile while it is still in L1: the input is read from memory once.
 */
#include "_kernels.h"

/* float16 bits -> float32, exact, without float arithmetic on subnormals (DAZ-proof). */
FP8REF_INLINE float from_f16(uint32_t h) {
    uint32_t a = h & 0x7FFFu, E = a >> 10, m = a & 0x3FFu;
    uint32_t normal = (a << 13) + (112u << 23);
    uint32_t special = 0x7F800000u | (m << 13);
    uint32_t mag = SEL(E == 31, special, normal);
    float sub = (float)(int32_t)m * 0x1p-24f; /* m * 2^-24 is a normal float32 */
    uint32_t v = SEL(E == 0, bits_of(sub), mag);
    return f32_of(v | ((h & 0x8000u) << 16));
}

FP8REF_INLINE float load(const void *src, int64_t i, int kind) {
    if (kind == BF16) return f32_of((uint32_t)((const uint16_t *)src)[i] << 16);
    if (kind == F16) return from_f16(((const uint16_t *)src)[i]);
    return ((const float *)src)[i];
}

/* float32 -> bfloat16 value (RNE), NaN kept as is. */
FP8REF_INLINE float round_bf16(float y) {
    uint32_t u = bits_of(y);
    uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    return f32_of(SEL((u & 0x7FFFFFFFu) > 0x7F800000u, u, r));
}

/* float32 -> float16 value (RNE, subnormals, overflow to Inf), as float32; NaN/Inf kept. */
FP8REF_INLINE float round_f16(float y) {
    uint32_t u = bits_of(y), a = u & 0x7FFFFFFFu, sign = u & 0x80000000u;
    uint32_t normal = (a + 0xFFFu + ((a >> 13) & 1u)) & ~0x1FFFu;
    /* below 2^-14 the quantum is 2^-24 = ulp(0.5f): one fp32 addition rounds there (RNE) */
    uint32_t sub = bits_of((f32_of(a) + 0.5f) - 0.5f);
    uint32_t r = SEL(a < 0x38800000u, sub, normal);
    r = SEL(a >= 0x477FF000u, 0x7F800000u, r); /* >= 65520 rounds to Inf */
    r = SEL(a >= 0x7F800000u, a, r);
    return f32_of(r | sign);
}

/* The loop constants, copied out of the job (so that the uint8 stores cannot alias them). */
typedef struct {
    enc_params p;
    rne_params rp;
    int rne; /* mode RNE and rp applies */
    float addend, clampv;
    uint32_t neg0, cast16;
    float exact_lo; /* exact_f32's smallest scale: D*s stays a multiple of 2^-149 */
} consts;

FP8REF_INLINE consts consts_of(const quant_job *j) {
    consts c = {*j->p, {0}, j->rne != NULL, j->addend, j->clampv, j->neg0, (uint32_t)j->cast16,
                f32_of((uint32_t)(127 - 125 - j->p->emin + j->p->M) << 23)};
    if (j->rne) c.rp = *j->rne;
    return c;
}

/* The exact quotient's codes in float32 arithmetic (16 lanes per AVX-512 vector, no division):
 * q = |x| * fp32(1/s) is within 2^-22 relative (or 2^-149 absolute) of Q = |x|/s, far less than
 * the spacing h of the format's decision points (grid points and midpoints: h >= Q * 2^-9, and
 * h >= 2^-141 since emin - M >= -140), so D = q rounded to a multiple of h (adding a magic power
 * of two whose ulp is h) is the one decision point within h of Q. The sign of the exact residual
 * |x| - D*s (one fma: D*s is exact inside it; rounded once, the sum keeps its sign, and is never
 * rounded to 0 while D*s and x are multiples of 2^-149: s >= exact_lo) says whether Q is above,
 * on or below D; D nudged by one float32 ulp that way lies on the same side of every decision
 * point as Q, so the encode core rounds it as Q in every mode. Needs s in [exact_lo, 2^125]
 * (1/s normal) and q below 2^64 (else returns 0: the caller recomputes the segment). */
FP8REF_INLINE int exact_f32(const void *src, uint8_t *restrict dst, int64_t lo, int64_t hi, float sv,
                            const consts *c, int kind, int mode, int fast) {
    float rcp = 1.0f / sv;
    uint32_t efloor = (uint32_t)(c->p.emin + 127), lift = (uint32_t)(22 - c->p.M), big = 0;
    for (int64_t k = lo; k < hi; k++) {
        uint32_t xb = bits_of(load(src, k, kind)), sign = xb & 0x80000000u;
        float ax = f32_of(xb & 0x7FFFFFFFu);
        float q = ax * rcp;
        uint32_t E = bits_of(q) >> 23;
        big |= E >= 127 + 64;
        float magic = f32_of(((E > efloor ? E : efloor) + lift) << 23);
        float d = (q + magic) - magic;
        float r = __builtin_fmaf(-d, sv, ax);
        uint32_t nudged = bits_of(d) + (uint32_t)(r > 0.0f) - (uint32_t)(r < 0.0f);
        uint32_t code = fast ? encode_rne32(nudged | sign, &c->rp, 1) : encode_bits32(nudged | sign, &c->p, mode, 1);
        dst[k] = (uint8_t)SEL(code == c->neg0, 0u, code);
    }
    return !big;
}

/* dst[k] for k in [lo, hi), one operand sv; KIND, EXACT, MODE, MUL, MODEL, FAST (encode_rne32 for
 * the last step) are constants at every call site (the dispatch below and in segment), so each
 * combination gets its own vectorized loop. */
FP8REF_INLINE void segment_k(const void *src, uint8_t *restrict dst, int64_t lo, int64_t hi, float sv,
                             const consts *c, int kind, int exact, int mode, int mul, int model, int fast) {
    if (exact) {
        if (sv < c->exact_lo || sv > 0x1p125f || !exact_f32(src, dst, lo, hi, sv, c, kind, mode, fast)) {
            double sd = (double)sv; /* the general case: the double quotient (see the top) */
            for (int64_t k = lo; k < hi; k++) {
                uint32_t code = encode_bits64(bits64_of((double)load(src, k, kind) / sd), &c->p, mode, 1);
                dst[k] = (uint8_t)SEL(code == c->neg0, 0u, code);
            }
        }
        return;
    }
    for (int64_t k = lo; k < hi; k++) {
        float x = load(src, k, kind);
        if (kind == F16) x = f32_of(SEL(c->cast16, bits_of(round_bf16(x)), bits_of(x)));
        float y = mul ? x * sv : x / sv;
        if (model == 1) y = round_bf16(y);
        if (model == 2) y = round_f16(y);
        y = y + c->addend;
        y = y > c->clampv ? c->clampv : y;
        y = y < -c->clampv ? -c->clampv : y;
        uint32_t code = fast ? encode_rne32(bits_of(y), &c->rp, 0) : encode_bits32(bits_of(y), &c->p, RNE, 0);
        dst[k] = (uint8_t)SEL(code == c->neg0, 0u, code);
    }
}

FP8REF_INLINE void segment(const void *src, uint8_t *restrict dst, int64_t lo, int64_t hi, float sv,
                           const consts *c, int kind, int exact, int mode, int mul, int model) {
    if (mode == RNE && c->rne)
        segment_k(src, dst, lo, hi, sv, c, kind, exact, mode, mul, model, 1);
    else
        segment_k(src, dst, lo, hi, sv, c, kind, exact, mode, mul, model, 0);
}

/* rows [r0, r1): row r's operands start at s[s_off[r]], one per g elements. Last row first: a
 * per-tensor quantize has just read the rows first to last for its amax (same split), so the
 * rows still in the last-level cache come first and only the rest is read from memory again. */
FP8REF_INLINE void rows_given(const quant_job *j, int64_t r0, int64_t r1, int kind, int exact, int mode, int mul,
                              int model) {
    const consts c = consts_of(j);
    for (int64_t r = r1 - 1; r >= r0; r--) {
        const float *srow = j->s + j->s_off[r];
        for (int64_t k0 = 0; k0 < j->K; k0 += j->g) {
            int64_t k1 = k0 + j->g < j->K ? k0 + j->g : j->K;
            segment(j->src, j->dst, r * j->K + k0, r * j->K + k1, srow[k0 / j->g], &c, kind, exact, mode, mul, model);
        }
    }
}

/* bands [b0, b1): band b is rows [b*bh, b*bh + bh) of matrix b / nbr (cut at r2); per group of g
 * columns: amax over the tile, its operand from the table, then the tile's codes */
FP8REF_INLINE void bands_fused(const quant_job *j, int64_t b0, int64_t b1, int kind, int exact, int mode, int mul,
                               int model) {
    const consts c = consts_of(j);
    const uint16_t *x = j->src;
    int64_t nbr = (j->r2 + j->bh - 1) / j->bh, ng = (j->K + j->g - 1) / j->g;
    for (int64_t b = b0; b < b1; b++) {
        int64_t m = b / nbr, br = b % nbr;
        int64_t lo = m * j->r2 + br * j->bh, hi = m * j->r2 + (br * j->bh + j->bh < j->r2 ? br * j->bh + j->bh : j->r2);
        for (int64_t jg = 0; jg < ng; jg++) {
            int64_t k0 = jg * j->g, k1 = k0 + j->g < j->K ? k0 + j->g : j->K;
            uint16_t a = 0;
            for (int64_t r = lo; r < hi; r++) a = amax_run16(x + r * j->K + k0, (size_t)(k1 - k0), a);
            j->amax[b * ng + jg] = a;
            float sv = j->table[a];
            for (int64_t r = lo; r < hi; r++)
                segment(j->src, j->dst, r * j->K + k0, r * j->K + k1, sv, &c, kind, exact, mode, mul, model);
        }
    }
}

/* One arm per constant combination: exact x 6 modes, or producer x op x model. */
#define EXACT_ARMS(DRV, KIND)                                                                      \
    switch (j->p->mode) {                                                                          \
    case RNE: DRV(j, lo, hi, KIND, 1, RNE, 0, 0); break;                                           \
    case RNA: DRV(j, lo, hi, KIND, 1, RNA, 0, 0); break;                                           \
    case RTZ: DRV(j, lo, hi, KIND, 1, RTZ, 0, 0); break;                                           \
    case RUP: DRV(j, lo, hi, KIND, 1, RUP, 0, 0); break;                                           \
    case RDOWN: DRV(j, lo, hi, KIND, 1, RDOWN, 0, 0); break;                                       \
    default: DRV(j, lo, hi, KIND, 1, RTO, 0, 0); break;                                            \
    }
#define PRODUCER_ARMS(DRV, KIND)                                                                   \
    switch (j->op * 3 + j->model) {                                                                \
    case 0: DRV(j, lo, hi, KIND, 0, RNE, 0, 0); break;                                             \
    case 1: DRV(j, lo, hi, KIND, 0, RNE, 0, 1); break;                                             \
    case 2: DRV(j, lo, hi, KIND, 0, RNE, 0, 2); break;                                             \
    case 3: DRV(j, lo, hi, KIND, 0, RNE, 1, 0); break;                                             \
    case 4: DRV(j, lo, hi, KIND, 0, RNE, 1, 1); break;                                             \
    default: DRV(j, lo, hi, KIND, 0, RNE, 1, 2); break;                                            \
    }
#define ARMS(DRV, KIND)                       \
    if (j->exact) { EXACT_ARMS(DRV, KIND) }   \
    else { PRODUCER_ARMS(DRV, KIND) }

/* Rows [lo, hi) with the operands in s. exact: inputs finite (the 'fp8ref' recipe rejects NaN/Inf
 * first), s positive finite float32. */
FP8REF_CLONES void fp8ref_quant(const quant_job *j, size_t lo_, size_t hi_) {
    int64_t lo = (int64_t)lo_, hi = (int64_t)hi_;
    if (j->kind == BF16) { ARMS(rows_given, BF16) }
    else if (j->kind == F16) { ARMS(rows_given, F16) }
    else { ARMS(rows_given, F32) }
}

/* Bands [lo, hi) of 16-bit input with dynamic scales (amax -> table operand). Codes computed from
 * an operand the exact loop cannot take (not positive finite: amax 0 or NaN/Inf) are not used:
 * quant.py sees the amax and quantizes again by the general path. */
FP8REF_CLONES void fp8ref_quant_fused(const quant_job *j, size_t lo_, size_t hi_) {
    int64_t lo = (int64_t)lo_, hi = (int64_t)hi_;
    if (j->kind == BF16) { ARMS(bands_fused, BF16) }
    else { ARMS(bands_fused, F16) }
}

/* ---- amax ----------------------------------------------------------------------------------- */
/* out[r, jg] = max magnitude bits over row r's elements [jg*g, (jg+1)*g), rows [r0, r1). */
#define AMAX_KERNEL(NAME, T, RUN)                                                                  \
    FP8REF_CLONES void NAME(const amax_job *j, size_t r0, size_t r1) {                             \
        size_t K = (size_t)j->K, g = (size_t)j->g, ng = (K + g - 1) / g;                           \
        const T *src = j->src;                                                                     \
        T *out = j->out;                                                                           \
        for (size_t r = r0; r < r1; r++)                                                           \
            for (size_t jg = 0; jg < ng; jg++) {                                                   \
                size_t k0 = jg * g, k1 = k0 + g < K ? k0 + g : K;                                  \
                out[r * ng + jg] = RUN(src + r * K + k0, k1 - k0, 0);                              \
            }                                                                                      \
    }
AMAX_KERNEL(fp8ref_amax_u16, uint16_t, amax_run16)
AMAX_KERNEL(fp8ref_amax_u32, uint32_t, amax_run32)
