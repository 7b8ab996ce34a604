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
#include "kernels.h"
#include <math.h>
#include <stdlib.h>

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
    int stream;     /* the VBMI table loop writes the codes around the cache (directly or by stream_copy) */
    int vbmi;       /* the table loop runs tab_run_vbmi (HAVE_VBMI, read once per task) */
} consts;

FP8REF_INLINE consts consts_of(const quant_job *j, int vbmi) {
    consts c = {*j->p, {0}, j->rne != NULL, j->addend, j->clampv, j->neg0, (uint32_t)j->cast16,
                f32_of((uint32_t)(127 - 125 - j->p->emin + j->p->M) << 23), j->stream != 0, vbmi};
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
#if defined(__FMA__) || !defined(__x86_64__)
        float r = __builtin_fmaf(-d, sv, ax);
#else /* no fma instruction (x86-64 below v3: fmaf is a library call per input): d*sv is exact in
       * double (24 x 24 bits), and the one rounding of the difference keeps its sign and its zero */
        double r = (double)ax - (double)d * (double)sv;
#endif
        uint32_t nudged = bits_of(d) + (uint32_t)(r > 0.0f) - (uint32_t)(r < 0.0f);
        uint32_t code = fast ? encode_rne32(nudged | sign, &c->rp, 1) : encode_bits32(nudged | sign, &c->p, mode, 1);
        dst[k] = (uint8_t)SEL(code == c->neg0, 0u, code);
    }
    return !big;
}

/* A producer recipe's value before the encode: fp32 x/s or x*m, optionally rounded to the model
 * dtype, + addend, clamped. */
FP8REF_INLINE float producer_y(float x, float sv, const consts *c, int kind, int mul, int model) {
    if (kind == F16) x = f32_of(SEL(c->cast16, bits_of(round_bf16(x)), bits_of(x)));
    float y = mul ? x * sv : x / sv;
    if (model == 1) y = round_bf16(y);
    if (model == 2) y = round_f16(y);
    y = y + c->addend;
    y = y > c->clampv ? c->clampv : y;
    return y < -c->clampv ? -c->clampv : y;
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
        float y = producer_y(load(src, k, kind), sv, c, kind, mul, model);
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

/* ---- bfloat16 inputs by thresholds ----------------------------------------------------------
 * For one operand sv and a recipe that rounds to nearest even, a bfloat16 input's code is a
 * nondecreasing function of its magnitude bits a = E << 7 | m. Where the value the format rounds
 * (the exact quotient x/s, or a producer's y) is at least the format's smallest normal 2^emin,
 * doubling x doubles that value exactly (binary scaling commutes with a quotient, a product and
 * the RNE roundings to float32/bfloat16/float16 away from their overflow), and the format's RNE
 * commutes with doubling in its normal range, so the magnitude code grows by 2^M. From the first
 * such binade E_b on: mag(E, m) = mag(E_b, 0) + (E - E_b) 2^M + #{i : m >= t_i}, with the 2^M
 * steps t_i of mag(E_b, m) over m, which the segment loop itself finds once per operand on the
 * inputs (E_b, 0..127) and (E_b + 1, 0) (the build checks that last step is 2^M). A magnitude code
 * above the format's largest takes the code the segment loop gives the largest input handled
 * here: every overflow has that one code (the recipe's clamp at >= the format's max, or the
 * overflow code). The rest (inputs below 2^E_b other than +-0, whose codes are looked up too, and
 * inputs whose y could be infinite) run the segment loop, a chunk at a time: rare in a weight.
 * This loop is 16-bit integer work, 32 lanes per AVX-512 vector, and no float arithmetic. */
typedef struct {
    uint32_t key; /* sv's bits; valid only if built */
    int built, ok;
    uint16_t lo, hi; /* magnitude bits taken here: a == 0 or lo <= a < hi */
    uint16_t eb, base, shift, maxmag, signbit, ovf_p, ovf_n, zero_p, zero_n;
    uint16_t t[8];      /* the portable loop's (filled only in a task that runs it: c->vbmi is per task), */
    int8_t tm1[8];      /* and t_i - 1 (t_i <= 128: signed bytes compare with m <= 127) */
    uint8_t steps[128]; /* the VBMI loop's tables: the code of (E_b, m) = base + #{i : m >= t_i}, */
    uint8_t shl[64];    /* and min(d 2^M, 255) */
    /* the AVX2 loop's (tab_run_avx2, x86-64-v3 and v4 without VBMI): m = 16 j + l, j < 8, and
     * #{i : m >= t_i} = win_a[j] + (l >= win_b1[j]) + (l >= win_b2[j]): every window of 16 holds at
     * most two t_i (they lie more than 8 apart: see tab_build); bytes 8-15 are never indexed */
    uint8_t win_a[16], win_b1m1[16], win_b2m1[16]; /* the b's less one, 15: none */
    int avx2;                                      /* those tables are valid and the overflow and
                                                    * sign rules fit its min and OR (tab_build) */
} bf16_tab;

/* elements per operand worth a build; inputs per VBMI call (at most, where the codes go through a
 * buffer); 64-input words the VBMI loop may mark per call */
enum { TAB_MIN = 512, TAB_CHUNK = 1024, TAB_WORDS = 256 };
/* input bytes of the block tiles taken together (amaxes, then codes): one 128x128 bfloat16 tile,
 * which the encode then reads from L1 (measured against 64-256 KiB runs: 0.85-0.88 vs 0.66-0.74
 * of copy_ with two threads, the same or better with one) */
enum { TILE_RUN_BYTES = 32 * 1024 };

/* Whether the value a producer rounds (or, exact, x/s) is >= 2^emin for magnitude bits a; `thr` is
 * sv 2^emin (exact, in double: x/s >= 2^emin <=> x >= s 2^emin exactly) or 2^emin (producers). */
FP8REF_INLINE int at_least_normal(uint16_t a, float sv, double thr, const consts *c, int exact, int mul, int model) {
    float x = f32_of((uint32_t)a << 16);
    if (exact) return (double)x >= thr;
    return (double)producer_y(x, sv, c, BF16, mul, model) >= thr;
}

FP8REF_INLINE int y_finite(uint16_t a, float sv, const consts *c, int exact, int mul, int model) {
    if (exact) return 1; /* the exact quotient is encoded from a double: never infinite */
    float y = producer_y(f32_of((uint32_t)a << 16), sv, c, BF16, mul, model);
    return y - y == 0.0f;
}

FP8REF_INLINE void tab_build(bf16_tab *t, float sv, const consts *c, int exact, int mul, int model) {
    t->key = bits_of(sv), t->built = 1, t->ok = 0, t->avx2 = 0;
    const enc_params *p = &c->p;
    int M = p->M;
    double maxval = ldexp(1.0 + (double)(p->maxmag & ((1u << M) - 1u)) / (double)(1u << M),
                          (int)(p->maxmag >> M) - p->bias);
    if (M > 3 || p->signbit != 0x80u || !(sv > 0.0f && sv < INFINITY) || !((double)c->clampv >= maxval)) return;
    int lo = 1, hi = 255; /* E_b: the smallest exponent field whose inputs all give values >= 2^emin */
    const double thr = exact ? ldexp((double)sv, p->emin) : ldexp(1.0, p->emin);
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (at_least_normal((uint16_t)(mid << 7), sv, thr, c, exact, mul, model)) hi = mid; else lo = mid + 1;
    }
    int eb = lo, top = 255, a = eb;
    for (int b = 254; a < b;) { /* top: the first exponent field with an infinite y */
        int mid = (a + b + 1) / 2;
        if (y_finite((uint16_t)(mid << 7 | 0x7F), sv, c, exact, mul, model)) a = mid; else b = mid - 1;
        top = a + 1;
    }
    if (!exact && !y_finite((uint16_t)(eb << 7 | 0x7F), sv, c, exact, mul, model)) return;
    if (eb + 2 > top) return;
    uint16_t in[133];
    uint8_t out[133];
    for (int m = 0; m < 128; m++) in[m] = (uint16_t)(eb << 7 | m);
    in[128] = (uint16_t)((eb + 1) << 7), in[129] = 0, in[130] = 0x8000u;
    in[131] = (uint16_t)((top - 1) << 7 | 0x7F), in[132] = in[131] | 0x8000u;
    /* two calls: the largest inputs' quotients exceed what the exact loop's float32 path takes, and
     * would send all 133 to the double path */
    segment(in, out, 0, 131, sv, c, BF16, exact, RNE, mul, model);
    segment(in, out, 131, 133, sv, c, BF16, exact, RNE, mul, model);
    uint32_t base = out[0], step = 1u << M, lim = base + step < p->maxmag ? base + step : p->maxmag;
    if (base < step || base > p->maxmag || out[128] != base + step) return;
    int bad = 0;
    for (int m = 1; m < 128; m++) bad |= (out[m] < out[m - 1]) | (out[m] > lim);
    if (bad) return;
    for (uint32_t i = 0; i < 8 && !c->vbmi; i++) { /* t_i (the portable loop's): the first m whose code */
        int a0 = 0, b0 = 128;                    /* is base + i + 1 or more; out is nondecreasing */
        while (a0 < b0) {
            int mid = (a0 + b0) / 2;
            if (out[mid] > base + i) b0 = mid; else a0 = mid + 1;
        }
        t->t[i] = (uint16_t)a0;
        t->tm1[i] = (int8_t)(a0 - 1);
    }
    for (int m = 0; m < 128; m++) t->steps[m] = out[m];
    for (int d = 0; d < 64; d++) t->shl[d] = (uint8_t)((d << M) > 255 ? 255 : d << M);
    t->lo = (uint16_t)(eb << 7), t->hi = (uint16_t)(top << 7), t->eb = (uint16_t)eb, t->base = (uint16_t)base;
    t->shift = (uint16_t)M, t->maxmag = (uint16_t)p->maxmag, t->signbit = (uint16_t)p->signbit;
    t->ovf_p = out[131], t->ovf_n = out[132], t->zero_p = out[129], t->zero_n = out[130];
    /* The AVX2 loop's windows. Between consecutive t_i (midpoints) the exact quotient moves by one
     * step of the format, more than 8 units of m (x/s < 2^(e+1) within the binade puts the step
     * s 2^(e-3) above 2^(E-4)), so a window of 16 holds at most two; checked here for every recipe (a
     * producer's rounding to the model dtype may move a t_i by one). Overflow: min(c, ovf_p) is the old rule where
     * ovf_p is maxmag (saturating) or maxmag + 1 (Inf/NaN), and the negative one that | 0x80. */
    int win_ok = !c->vbmi && (t->ovf_p == p->maxmag || t->ovf_p == p->maxmag + 1) && t->ovf_n == (t->ovf_p | 0x80u);
    for (int j = 0; j < 8 && win_ok; j++) {
        int below = 0, nb = 0, b[3] = {16, 16, 16};
        for (int i = 0; i < 8; i++) {
            int ti = t->t[i] - 16 * j;
            if (ti <= 0) below++;
            else if (ti < 16) b[nb < 2 ? nb++ : (win_ok = 0, 2)] = ti;
        }
        t->win_a[j] = t->win_a[j + 8] = (uint8_t)below;
        t->win_b1m1[j] = t->win_b1m1[j + 8] = (uint8_t)(b[0] - 1);
        t->win_b2m1[j] = t->win_b2m1[j + 8] = (uint8_t)(b[1] - 1);
    }
    t->avx2 = win_ok;
    t->ok = 1;
}

#define SEL16(c, a, b) ((uint16_t)((b) ^ (((a) ^ (b)) & (uint16_t)(0u - (uint32_t)(c)))))

/* Codes of x[0, n) by the table, one input at a time (tab_run's tail); returns nonzero if some
 * input is not one the table takes. */
FP8REF_INLINE uint16_t tab_run_scalar(const uint16_t *restrict x, uint8_t *restrict dst, int64_t n, const bf16_tab *t) {
    const uint16_t lo = t->lo, hi = t->hi, eb = t->eb, base = t->base, sh = t->shift, mx = t->maxmag;
    const uint16_t sb = t->signbit, op = t->ovf_p, on = t->ovf_n, zp = t->zero_p, zn = t->zero_n;
    const uint16_t t0 = t->t[0], t1 = t->t[1], t2 = t->t[2], t3 = t->t[3], t4 = t->t[4], t5 = t->t[5],
                   t6 = t->t[6], t7 = t->t[7];
    uint16_t slow = 0;
    for (int64_t k = 0; k < n; k++) { /* branch-free (SEL16) so that it vectorizes */
        uint16_t h = x[k], a = h & 0x7FFFu, neg = h >> 15, m = a & 0x7Fu;
        uint16_t steps = (uint16_t)((m >= t0) + (m >= t1) + (m >= t2) + (m >= t3) + (m >= t4) + (m >= t5) +
                                    (m >= t6) + (m >= t7));
        uint16_t c = (uint16_t)(base + (uint16_t)((uint16_t)((a >> 7) - eb) << sh) + steps);
        uint16_t code = SEL16(c > mx, SEL16(neg, on, op), c | (uint16_t)(sb & (0u - neg)));
        code = SEL16(a == 0, SEL16(neg, zn, zp), code);
        slow |= (uint16_t)((a != 0) & ((a < lo) | (a >= hi)));
        dst[k] = (uint8_t)code;
    }
    return slow;
}

/* ---- writing around the cache -----------------------------------------------------------------
 * dst[0, n) = src[0, n) with the whole aligned 64-byte lines of dst written by non-temporal stores
 * (the line is not read first, as a normal store's is, nor kept in the cache); the partial lines at
 * either end by normal stores, so a line shared with a neighbouring piece is never streamed. Each
 * level streams with its widest stores (SSE2's are in every x86-64 CPU); off x86-64 a plain copy. */
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define CAN_STREAM 1
FP8REF_INLINE void stream_line(uint8_t *dst, const uint8_t *src) {
#if defined(__AVX512F__)
    _mm512_stream_si512((__m512i *)dst, _mm512_loadu_si512(src));
#elif defined(__AVX__)
    for (int i = 0; i < 64; i += 32) _mm256_stream_si256((__m256i *)(dst + i), _mm256_loadu_si256((const __m256i *)(src + i)));
#else
    for (int i = 0; i < 64; i += 16) _mm_stream_si128((__m128i *)(dst + i), _mm_loadu_si128((const __m128i *)(src + i)));
#endif
}
static void stream_copy(uint8_t *restrict dst, const uint8_t *restrict src, int64_t n) {
    int64_t head = (int64_t)((-(uintptr_t)dst) & 63u);
    head = head < n ? head : n;
    memcpy(dst, src, (size_t)head);
    int64_t k = head;
    for (; k + 64 <= n; k += 64) stream_line(dst + k, src + k);
    memcpy(dst + k, src + k, (size_t)(n - k));
}
#define STREAM_FENCE() _mm_sfence() /* streamed lines visible before the task returns to its caller */
#else
#define CAN_STREAM 0
#define stream_copy(dst, src, n) memcpy(dst, src, (size_t)(n))
#define STREAM_FENCE() ((void)0)
#endif

/* tab_run_scalar's rules on TAB_VB inputs at a time in byte lanes (GNU C vector extensions, which the
 * compiler maps onto the level's SSE2, AVX2 or AVX-512BW, or NEON): the magnitude bits split into
 * m (7 bits) and E (8 bits) once, and every step after that one byte per input. Written out with
 * vectors because the compiler's own vectorization of tab_run_scalar keeps 16-bit lanes (half as
 * many per instruction) and measured 0.2-0.3 of copy_ on x86-64-v3 (docs/performance.md). (E - E_b)
 * is capped at 128 >> M: from there on every code overflows (base >= 2^M), and the sum stays a byte. */
#if defined(__AVX512BW__)
#define TAB_VB 64
#elif defined(__AVX2__)
#define TAB_VB 32
#else
#define TAB_VB 16
#endif
typedef uint8_t tab_u8 __attribute__((vector_size(TAB_VB)));
typedef int8_t tab_i8 __attribute__((vector_size(TAB_VB)));
typedef uint16_t tab_u16 __attribute__((vector_size(2 * TAB_VB)));
#define VSEL(mask, a, b) ((tab_u8)(((a) & (tab_u8)(mask)) | ((b) & ~(tab_u8)(mask))))

static __attribute__((noinline)) uint16_t tab_run(const uint16_t *restrict x, uint8_t *restrict dst, int64_t n,
                                                  int64_t ahead, const bf16_tab *t) { /* one copy: no constants */
    const tab_u8 zero_v = {0}, eb = zero_v + (uint8_t)t->eb, etop = zero_v + (uint8_t)(t->hi >> 7);
    const tab_u8 base = zero_v + (uint8_t)t->base, mx = zero_v + (uint8_t)t->maxmag, sb = zero_v + (uint8_t)t->signbit;
    const tab_u8 op = zero_v + (uint8_t)t->ovf_p, on = zero_v + (uint8_t)t->ovf_n;
    const tab_u8 zp = zero_v + (uint8_t)t->zero_p, zn = zero_v + (uint8_t)t->zero_n;
    const tab_u8 dmax = zero_v + (uint8_t)(128u >> t->shift);
    const int sh = t->shift;
    tab_i8 tm1[8];
    for (int i = 0; i < 8; i++) tm1[i] = (tab_i8){0} + t->tm1[i];
    tab_u8 slow = zero_v;
    int64_t k = 0;
    for (; k + TAB_VB <= n; k += TAB_VB) {
        tab_u16 h;
        memcpy(&h, x + k, sizeof h);
        if (ahead) /* the same lines of the next unit, into L2, spread over the loop (a burst of
                    * prefetches fills the miss queue and stalls: measured) */
            for (int b = 0; b < 2 * TAB_VB; b += 64) __builtin_prefetch((const char *)(x + k + ahead) + b, 0, 2);
        const tab_u8 lo = __builtin_convertvector(h & 0xFF, tab_u8), hb = __builtin_convertvector(h >> 8, tab_u8);
        const tab_u8 neg = (tab_u8)((tab_i8)hb < 0), m = lo & 0x7F, e7 = hb & 0x7F;
        const tab_u8 E = (tab_u8)(e7 + e7) | (lo >> 7);
        const tab_u8 zero = (tab_u8)((e7 | lo) == 0);
        tab_i8 steps = {0};
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) steps -= (tab_i8)m > tm1[i]; /* a comparison is -1 where true */
        tab_u8 d = (E - eb) & (tab_u8)(E > eb);
        d = VSEL(d > dmax, dmax, d);
        const tab_u8 c = base + (tab_u8)steps + (d << sh);
        tab_u8 code = c | (sb & neg);
        code = VSEL(c > mx, VSEL(neg, on, op), code);
        code = VSEL(zero, VSEL(neg, zn, zp), code);
        slow |= (~zero & (tab_u8)(E < eb)) | (tab_u8)(E >= etop);
        memcpy(dst + k, &code, sizeof code);
    }
    uint16_t any = tab_run_scalar(x + k, dst + k, n - k, t);
    for (int i = 0; i < TAB_VB; i++) any |= slow[i];
    return any;
}

/* tab_run's rules in AVX2 intrinsics, 32 inputs per step, for the CPUs without VBMI (x86-64-v3, and
 * v4's object: on Zen 4 a 512-bit vector costs two 256-bit ones). 42 instructions a step where the
 * compiler's tab_run takes ~90 (its byte shifts, eight threshold compares and blends, spills): the
 * 2^M steps over m by three 16-byte lookups (win_*), (E - E_b) and the slow test from one wrapping
 * byte difference, overflow by min and the sign by OR (tab_build's avx2 conditions). Runs x0 + r *
 * stride, r < rows, of n inputs (a block tile in one call, as tab_run_vbmi). Returns how many of its
 * 32-input words hold inputs it does not take: word slow_w[i] (r * ceil(n / 32) + k / 32), inputs
 * slow_at[i]. */
#if defined(__x86_64__) && defined(__GNUC__) && defined(__AVX2__)
static __attribute__((noinline)) int tab_run_avx2(const uint16_t *restrict x0, uint8_t *restrict dst0, int64_t n,
                                                  int64_t rows, int64_t stride, int64_t dst_stride, int64_t ahead,
                                                  const bf16_tab *t, uint32_t *restrict slow_at,
                                                  int32_t *restrict slow_w) {
    /* in each 128-bit lane: the low bytes of its eight inputs, then their high bytes */
    const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8,
                                           10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    const __m256i wa = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)t->win_a));
    const __m256i wb1 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)t->win_b1m1));
    const __m256i wb2 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)t->win_b2m1));
    const __m256i eb = _mm256_set1_epi8((char)t->eb), span = _mm256_set1_epi8((char)((t->hi >> 7) - t->eb));
    const __m256i dmax = _mm256_set1_epi8((char)(128u >> t->shift)), base = _mm256_set1_epi8((char)t->base);
    const __m256i opv = _mm256_set1_epi8((char)t->ovf_p), zp = _mm256_set1_epi8((char)t->zero_p);
    const __m256i zn = _mm256_set1_epi8((char)t->zero_n), m7f = _mm256_set1_epi8(0x7F), m0f = _mm256_set1_epi8(0x0F);
    const __m256i s80 = _mm256_set1_epi8((char)0x80), zero_v = _mm256_setzero_si256();
    const __m128i sh = _mm_cvtsi32_si128(t->shift);
    int hits = 0;
    const int32_t per_run = (int32_t)((n + 31) / 32);
    for (int64_t r = 0; r < rows; r++) {
    const uint16_t *x = x0 + r * stride;
    uint8_t *dst = dst0 + r * dst_stride;
    int64_t k = 0;
    for (; k + 32 <= n; k += 32) {
        __m256i h0 = _mm256_loadu_si256((const __m256i *)(x + k));
        __m256i h1 = _mm256_loadu_si256((const __m256i *)(x + k + 16));
        if (ahead) _mm_prefetch((const char *)(x + k + ahead), _MM_HINT_T1); /* the next unit's line, into L2 */
        h0 = _mm256_shuffle_epi8(h0, split), h1 = _mm256_shuffle_epi8(h1, split);
        /* byte order of lo, hi and every vector after: inputs 0-7, 16-23 | 8-15, 24-31 */
        const __m256i lo = _mm256_unpacklo_epi64(h0, h1), hi = _mm256_unpackhi_epi64(h0, h1);
        const __m256i m = _mm256_and_si256(lo, m7f), e7 = _mm256_and_si256(hi, m7f), sign = _mm256_and_si256(hi, s80);
        const __m256i E = _mm256_sub_epi8(_mm256_add_epi8(e7, e7), _mm256_cmpgt_epi8(zero_v, lo)); /* + lo's bit 7 */
        const __m256i j = _mm256_and_si256(_mm256_srli_epi16(m, 4), m0f), l = _mm256_and_si256(lo, m0f);
        __m256i steps = _mm256_sub_epi8(_mm256_shuffle_epi8(wa, j), _mm256_cmpgt_epi8(l, _mm256_shuffle_epi8(wb1, j)));
        steps = _mm256_sub_epi8(steps, _mm256_cmpgt_epi8(l, _mm256_shuffle_epi8(wb2, j)));
        const __m256i u = _mm256_sub_epi8(E, eb); /* E - E_b, wrapping: >= span exactly outside [E_b, top) */
        /* min(u, 128 >> M) << M stays in its byte; base + steps <= maxmag, so c > maxmag only by d */
        const __m256i c = _mm256_adds_epu8(_mm256_add_epi8(steps, base),
                                           _mm256_sll_epi16(_mm256_min_epu8(u, dmax), sh));
        const __m256i zero = _mm256_cmpeq_epi8(_mm256_or_si256(E, m), zero_v);
        __m256i code = _mm256_or_si256(_mm256_min_epu8(c, opv), sign);
        code = _mm256_blendv_epi8(code, _mm256_blendv_epi8(zp, zn, sign), zero);
        const __m256i slow = _mm256_andnot_si256(zero, _mm256_cmpeq_epi8(_mm256_max_epu8(u, span), u));
        _mm256_storeu_si256((__m256i *)(dst + k), _mm256_permute4x64_epi64(code, 0xD8));
        uint32_t bits = (uint32_t)_mm256_movemask_epi8(slow);
        if (bits) /* back to input order */
            slow_at[hits] = (bits & 0xFF0000FFu) | ((bits >> 8) & 0xFF00u) | ((bits << 8) & 0xFF0000u),
            slow_w[hits++] = (int32_t)(r * per_run + k / 32);
    }
    uint32_t tail = 0;
    for (int64_t i = k; i < n; i++) tail |= (uint32_t)(tab_run_scalar(x + i, dst + i, 1, t) != 0) << (i - k);
    if (tail) slow_at[hits] = tail, slow_w[hits++] = (int32_t)(r * per_run + k / 32);
    }
    return hits;
}
#define HAVE_TAB_AVX2 1
#else
#define HAVE_TAB_AVX2 0
#define tab_run_avx2(x, dst, n, rows, stride, dst_stride, ahead, t, slow_at, slow_w) 0
#endif

/* tab_run with AVX-512 VBMI, 64 inputs per step: the code of (E_b, m) from a 128-byte table
 * (vpermi2b), (E - E_b) 2^M from a 64-byte table (saturating at 255 > maxmag: an overflow), the
 * rest as masks. Same rules and result as tab_run (tests compare both with the segment loop). Runs
 * x0 + r * stride, r < rows, of n inputs. Returns how many of its 64-input words hold inputs it
 * does not take: word i is slow_w[i] (run r, word k / 64: r * ceil(n / 64) + k / 64), its inputs
 * marked one bit each in slow_at[i]. */
#if defined(__x86_64__) && defined(__GNUC__) && defined(__AVX512BW__) /* the x86-64-v4 object alone: a
                                                                       * forced lower level runs as its CPUs do */
#define FP8REF_VBMI __attribute__((target("avx512f,avx512bw,avx512vbmi")))
static int vbmi_ok = -1;
#define EVEN8(i) (2 * (i)), (2 * (i) + 2), (2 * (i) + 4), (2 * (i) + 6), (2 * (i) + 8), (2 * (i) + 10), (2 * (i) + 12), (2 * (i) + 14)
static const uint8_t lo_bytes[64] = {EVEN8(0), EVEN8(8), EVEN8(16), EVEN8(24), EVEN8(32), EVEN8(40), EVEN8(48), EVEN8(56)};
FP8REF_VBMI static int tab_run_vbmi(const uint16_t *restrict x0, uint8_t *restrict dst0, int64_t n,
                                         int64_t rows, int64_t stride, int64_t dst_stride, int64_t ahead,
                                         int stream, const bf16_tab *t, uint64_t *restrict slow_at,
                                         int32_t *restrict slow_w) {
    const __m512i tlo = _mm512_loadu_si512(t->steps), thi = _mm512_loadu_si512(t->steps + 64);
    const __m512i shtab = _mm512_loadu_si512(t->shl);
    const __m512i eb = _mm512_set1_epi8((char)t->eb), etop = _mm512_set1_epi8((char)(t->hi >> 7));
    const __m512i mx = _mm512_set1_epi8((char)t->maxmag), sb = _mm512_set1_epi8((char)t->signbit);
    const __m512i op = _mm512_set1_epi8((char)t->ovf_p), on = _mm512_set1_epi8((char)t->ovf_n);
    const __m512i zp = _mm512_set1_epi8((char)t->zero_p), zn = _mm512_set1_epi8((char)t->zero_n);
    const __m512i m7f = _mm512_set1_epi8(0x7F), lim = _mm512_set1_epi8(63), ff = _mm512_set1_epi16(0xFF);
    /* byte i of the result: the low (or high) byte of 16-bit lane i of the pair (a, b) */
    const __m512i lo_idx = _mm512_loadu_si512(lo_bytes);
    const __m512i hi_idx = _mm512_add_epi8(lo_idx, _mm512_set1_epi8(1));
    int hits = 0;
    for (int64_t r = 0; r < rows; r++) {
    const uint16_t *x = x0 + r * stride;
    uint8_t *dst = dst0 + r * dst_stride;
    for (int64_t k = 0; k < n; k += 64) {
        int64_t left = n - k;
        __mmask32 m0 = left >= 32 ? ~(__mmask32)0 : (((__mmask32)1 << left) - 1);
        __mmask32 m1 = left >= 64 ? ~(__mmask32)0 : left <= 32 ? 0 : (((__mmask32)1 << (left - 32)) - 1);
        __mmask64 all = left >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << left) - 1);
        __m512i h0 = _mm512_maskz_loadu_epi16(m0, x + k), h1 = _mm512_maskz_loadu_epi16(m1, x + k + 32);
        if (ahead) { /* the same two lines of the next unit, into L2 while this one computes */
            _mm_prefetch((const char *)(x + k + ahead), _MM_HINT_T1);
            _mm_prefetch((const char *)(x + k + ahead) + 64, _MM_HINT_T1);
        }
        __m512i lob = _mm512_permutex2var_epi8(h0, lo_idx, h1);
        __m512i hib = _mm512_permutex2var_epi8(h0, hi_idx, h1);
        __m512i e0 = _mm512_and_si512(_mm512_srli_epi16(h0, 7), ff), e1 = _mm512_and_si512(_mm512_srli_epi16(h1, 7), ff);
        __m512i E = _mm512_permutex2var_epi8(e0, lo_idx, e1);
        __m512i m = _mm512_and_si512(lob, m7f);
        __mmask64 neg = _mm512_movepi8_mask(hib);
        __mmask64 zero = _mm512_testn_epi8_mask(E, E) & _mm512_testn_epi8_mask(m, m);
        __m512i d = _mm512_min_epu8(_mm512_subs_epu8(E, eb), lim);
        __m512i c = _mm512_adds_epu8(_mm512_permutex2var_epi8(tlo, m, thi), _mm512_permutexvar_epi8(d, shtab));
        __mmask64 ovf = _mm512_cmpgt_epu8_mask(c, mx);
        c = _mm512_mask_blend_epi8(neg, c, _mm512_or_si512(c, sb));
        c = _mm512_mask_blend_epi8(ovf & ~neg, c, op);
        c = _mm512_mask_blend_epi8(ovf & neg, c, on);
        c = _mm512_mask_blend_epi8(zero & ~neg, c, zp);
        c = _mm512_mask_blend_epi8(zero & neg, c, zn);
        __mmask64 slow = ((_mm512_cmplt_epu8_mask(E, eb) & ~zero) | _mm512_cmpge_epu8_mask(E, etop)) & all;
        if (slow) slow_at[hits] = slow, slow_w[hits++] = (int32_t)(r * ((n + 63) / 64) + k / 64);
        if (stream && left >= 64) /* whole aligned lines (the caller checked dst and dst_stride) */
            _mm512_stream_si512((__m512i *)(dst + k), c);
        else
            _mm512_mask_storeu_epi8(dst + k, all, c);
    }
    }
    return hits;
}

/* FP8REF_NO_VBMI (read at each call, for the tests) runs the portable loop instead */
#define HAVE_VBMI() ((vbmi_ok >= 0 ? vbmi_ok : (vbmi_ok = __builtin_cpu_supports("avx512vbmi") && \
                                                           __builtin_cpu_supports("avx512bw"))) && \
                     !getenv("FP8REF_NO_VBMI"))
#else
#define HAVE_VBMI() 0
#define tab_run_vbmi(x, dst, n, rows, stride, dst_stride, ahead, stream, t, slow_at, slow_w) 0
#endif

/* whether a task's table loop runs tab_run_vbmi (read once per task) */
#define TABLE_VBMI(kind, mode) ((kind) == BF16 && (mode) == RNE && HAVE_VBMI())

/* segment() over `rows` runs [lo, hi) + r * stride sharing one operand sv (of `count` elements in
 * all): bfloat16 inputs by the table where it applies (built on the first run of a new sv), else
 * the segment loop. The VBMI loop takes up to TAB_CHUNK inputs per call (whole short runs, or
 * pieces of a long one) and hands back the inputs it does not take, which the segment loop does. */
FP8REF_INLINE void segment_tab(const void *src, uint8_t *restrict dst, int64_t lo, int64_t hi, int64_t rows,
                               int64_t stride, int64_t ahead, float sv, const consts *c, bf16_tab *tab, int64_t count,
                               int kind, int exact, int mode, int mul, int model) {
    const int vbmi = c->vbmi;
    int fresh = !(tab->built && tab->key == bits_of(sv));
    if (kind == BF16 && mode == RNE && (fresh ? count >= TAB_MIN : tab->ok)) {
        if (fresh) tab_build(tab, sv, c, exact, mul, model);
        if (tab->ok) {
            int64_t n = hi - lo, piece = n < TAB_CHUNK ? n : TAB_CHUNK, words = (piece + 63) / 64;
            /* streamed straight from the VBMI loop where every run starts on a line (pieces start
             * TAB_CHUNK apart), else by stream_copy from buf, whatever the offsets */
            const int direct = c->stream && ((uintptr_t)(dst + lo) & 63u) == 0 && (rows == 1 || (stride & 63) == 0);
            const int buffered = c->stream && !direct;
            /* runs per call: a 128x128 tile in one (buf holds TAB_CHUNK codes) */
            int64_t per = n <= TAB_CHUNK ? (buffered ? TAB_CHUNK / 64 : TAB_WORDS) / words : 1;
            uint64_t slow_at[TAB_WORDS];
            int32_t slow_w[TAB_WORDS];
            uint8_t buf[TAB_CHUNK + 64]; /* buffered: the piece's codes, run after run, then copied out */
            for (int64_t r0 = 0; r0 < rows; r0 += per) {
                int64_t nr = rows - r0 < per ? rows - r0 : per;
                for (int64_t k0 = 0; k0 < n; k0 += piece) {
                    int64_t len = n - k0 < piece ? n - k0 : piece, at = lo + r0 * stride + k0;
                    const uint16_t *x = (const uint16_t *)src + at;
                    if (!vbmi && HAVE_TAB_AVX2 && tab->avx2) { /* the runs that fit in buf per call */
                        const int buffered2 = c->stream && CAN_STREAM;
                        const int64_t grp = buffered2 ? TAB_CHUNK / len : nr, lw = (len + 31) / 32;
                        uint32_t at32[2 * TAB_WORDS]; /* nr * lw <= 2 TAB_WORDS (per above) */
                        int32_t w32[2 * TAB_WORDS];
                        for (int64_t r1 = 0; r1 < nr; r1 += grp) {
                            const int64_t g = nr - r1 < grp ? nr - r1 : grp, os = buffered2 ? len : stride;
                            const uint16_t *xg = x + r1 * stride;
                            uint8_t *og = buffered2 ? buf : dst + at + r1 * stride;
                            int hits = tab_run_avx2(xg, og, len, g, stride, os, ahead, tab, at32, w32);
                            for (int i = 0; i < hits; i++) /* only the inputs it does not take */
                                for (uint32_t b = at32[i]; b; b &= b - 1) {
                                    int64_t r = w32[i] / lw, k = 32 * (w32[i] % lw) + __builtin_ctz(b);
                                    segment(xg + r * stride, og + r * os, k, k + 1, sv, c, kind, exact, mode, mul,
                                            model);
                                }
                            for (int64_t r = 0; buffered2 && r < g; r++)
                                stream_copy(dst + at + (r1 + r) * stride, buf + r * len, len);
                        }
                        continue;
                    }
                    if (!vbmi) { /* streamed through buf: the compiler's vector stores are normal ones */
                        for (int64_t r = 0; r < nr; r++) {
                            const uint16_t *xr = x + r * stride;
                            uint8_t *dr = dst + at + r * stride, *o = c->stream && CAN_STREAM ? buf : dr;
                            if (tab_run(xr, o, len, ahead, tab)) /* only the inputs it does not take */
                                for (int64_t k = 0; k < len; k++) {
                                    const uint16_t a = xr[k] & 0x7FFFu;
                                    if (a != 0 && (a < tab->lo || a >= tab->hi))
                                        segment(xr, o, k, k + 1, sv, c, kind, exact, mode, mul, model);
                                }
                            if (o == buf) stream_copy(dr, buf, len);
                        }
                        continue;
                    }
                    uint8_t *out = buffered ? buf : dst + at;
                    int64_t os = buffered ? len : stride;
                    int hits = tab_run_vbmi(x, out, len, nr, stride, os, ahead, direct, tab, slow_at, slow_w);
                    if (hits) {
                        if (direct) STREAM_FENCE(); /* the streamed lines written before a fix-up's normal store */
                        int64_t lw = (len + 63) / 64; /* words per run of this piece */
                        for (int i = 0; i < hits; i++) /* only the inputs it did not take */
                            for (uint64_t b = slow_at[i]; b; b &= b - 1) {
                                int64_t r = slow_w[i] / lw, k = 64 * (slow_w[i] % lw) + __builtin_ctzll(b);
                                segment(x + r * stride, out + r * os, k, k + 1, sv, c, kind, exact, mode, mul,
                                        model);
                            }
                    }
                    if (buffered)
                        for (int64_t r = 0; r < nr; r++) stream_copy(dst + at + r * stride, buf + r * len, len);
                }
            }
            return;
        }
    }
    for (int64_t r = 0; r < rows; r++)
        segment(src, dst, lo + r * stride, hi + r * stride, sv, c, kind, exact, mode, mul, model);
}

/* rows [r0, r1): row r's operands start at s[s_off[r]], one per g elements. Last row first: a
 * per-tensor quantize has just read the rows first to last for its amax (same split), so the
 * rows still in the last-level cache come first and only the rest is read from memory again. */
FP8REF_INLINE void rows_given(const quant_job *j, int64_t r0, int64_t r1, int kind, int exact, int mode, int mul,
                              int model) {
    const consts c = consts_of(j, TABLE_VBMI(kind, mode));
    bf16_tab tab = {0};
    for (int64_t r = r1 - 1; r >= r0; r--) {
        const float *srow = j->s + j->s_off[r];
        for (int64_t k0 = 0; k0 < j->K; k0 += j->g) {
            int64_t k1 = k0 + j->g < j->K ? k0 + j->g : j->K;
            segment_tab(j->src, j->dst, r * j->K + k0, r * j->K + k1, 1, 0, -j->K, srow[k0 / j->g], &c, &tab,
                        k1 - k0, kind, exact, mode, mul, model); /* prefetching the row done next */
        }
    }
}

/* max magnitude bits of a tile of `rows` rows (stride `stride`) and 128 columns: the 128 running
 * maxima stay in four vector registers; one reduction per tile instead of one per row */
FP8REF_INLINE uint16_t amax_tile128(const uint16_t *restrict x, int64_t rows, int64_t stride) {
    uint16_t acc[128] = {0};
    for (int64_t r = 0; r < rows; r++)
        for (int k = 0; k < 128; k++) {
            uint16_t v = x[r * stride + k] & 0x7FFFu;
            acc[k] = v > acc[k] ? v : acc[k];
        }
    return amax_run16(acc, 128, 0);
}

FP8REF_INLINE uint16_t amax_rows16(const uint16_t *restrict x, int64_t rows, int64_t stride, int64_t n) {
    uint16_t m = 0;
    for (int64_t r = 0; r < rows; r++) m = amax_run16(x + r * stride, (size_t)n, m);
    return m;
}

/* bands [b0, b1): band b is rows [b*bh, b*bh + bh) of matrix b / nbr (cut at r2); per group of g
 * columns: amax over the tile, its operand from the table, then the tile's codes */
FP8REF_INLINE void bands_fused(const quant_job *j, int64_t b0, int64_t b1, int kind, int exact, int mode, int mul,
                               int model) {
    const consts c = consts_of(j, TABLE_VBMI(kind, mode));
    bf16_tab tab = {0};
    const uint16_t *x = j->src;
    int64_t nbr = (j->r2 + j->bh - 1) / j->bh, ng = (j->K + j->g - 1) / j->g;
    for (int64_t b = b0; b < b1; b++) {
        int64_t m = b / nbr, br = b % nbr;
        int64_t lo = m * j->r2 + br * j->bh, hi = m * j->r2 + (br * j->bh + j->bh < j->r2 ? br * j->bh + j->bh : j->r2);
        /* tiles in runs of TILE_RUN_BYTES of input: their amaxes (row by row, each row's piece read in
         * one sweep, or tile by tile for 128-wide tiles), then their codes while the run is in cache;
         * while a run's codes are computed, the next run's input is prefetched into L2 (`ahead`
         * elements on: the next row for channel scales, g = K) */
        int64_t run = j->bh > 1 ? (TILE_RUN_BYTES / 2 / (hi - lo) / j->g) : 1;
        run = run < 1 ? 1 : run > 64 ? 64 : run;
        for (int64_t j0 = 0; j0 < ng; j0 += run) {
            int64_t j1 = j0 + run < ng ? j0 + run : ng;
            /* the next run's, or at the band's end the next band's first run (rows hi.., column 0) */
            const int64_t ahead = j1 < ng ? run * j->g : (hi - lo) * j->K - j0 * j->g;
            uint16_t a[64] = {0};
            if (j->g == 128 && hi - lo > 1)
                for (int64_t jg = j0; jg < j1; jg++) {
                    int64_t k0 = jg * j->g;
                    a[jg - j0] = k0 + 128 <= j->K ? amax_tile128(x + lo * j->K + k0, hi - lo, j->K)
                                                  : amax_rows16(x + lo * j->K + k0, hi - lo, j->K, j->K - k0);
                }
            else
                for (int64_t r = lo; r < hi; r++)
                    for (int64_t jg = j0; jg < j1; jg++) {
                        int64_t k0 = jg * j->g, k1 = k0 + j->g < j->K ? k0 + j->g : j->K;
                        a[jg - j0] = amax_run16(x + r * j->K + k0, (size_t)(k1 - k0), a[jg - j0]);
                    }
            for (int64_t jg = j0; jg < j1; jg++) {
                int64_t k0 = jg * j->g, k1 = k0 + j->g < j->K ? k0 + j->g : j->K;
                j->amax[b * ng + jg] = a[jg - j0];
                float sv = j->table[a[jg - j0]];
                segment_tab(j->src, j->dst, lo * j->K + k0, lo * j->K + k1, hi - lo, j->K, ahead, sv, &c, &tab,
                            (hi - lo) * (k1 - k0), kind, exact, mode, mul, model);
            }
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
void FP8REF_TASK(fp8ref_quant)(const quant_job *j, size_t lo_, size_t hi_) {
    int64_t lo = (int64_t)lo_, hi = (int64_t)hi_;
    if (j->kind == BF16) { ARMS(rows_given, BF16) }
    else if (j->kind == F16) { ARMS(rows_given, F16) }
    else { ARMS(rows_given, F32) }
    if (j->stream) STREAM_FENCE();
}

/* Bands [lo, hi) of 16-bit input with dynamic scales (amax -> table operand). Codes computed from
 * an operand the exact loop cannot take (not positive finite: amax 0 or NaN/Inf) are not used:
 * quant.py sees the amax and quantizes again by the general path. */
void FP8REF_TASK(fp8ref_quant_fused)(const quant_job *j, size_t lo_, size_t hi_) {
    int64_t lo = (int64_t)lo_, hi = (int64_t)hi_;
    if (j->kind == BF16) { ARMS(bands_fused, BF16) }
    else { ARMS(bands_fused, F16) }
    if (j->stream) STREAM_FENCE();
}

/* ---- amax ----------------------------------------------------------------------------------- */
/* out[r, jg] = max magnitude bits over row r's elements [jg*g, (jg+1)*g), rows [r0, r1). */
#define AMAX_KERNEL(NAME, T, RUN)                                                                  \
    void FP8REF_TASK(NAME)(const amax_job *j, size_t r0, size_t r1) {                             \
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
