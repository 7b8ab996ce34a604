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
    uint16_t t[8];      /* the portable loop's: the 2^M steps t_i, */
    int8_t tm1[8];      /* and t_i - 1 (t_i <= 128: signed bytes compare with m <= 127) */
    uint8_t steps_j[128]; /* the VBMI loop's: the code of (E_b, m) = base + #{i : m >= t_i}, less j */
    /* The vector loops (tab_run_vbmi, tab_run_bw, tab_run_avx2) start from v = (E - E_b) 2^M + j,
     * j = m >> (7 - M) the top M bits of m, saturated to [0, 255]: the code of (E, m) is v +
     * steps_j[m] (VBMI), or in windows of W = 2^(7-M) values of m, m = W j + l, v + win_t[j] + (l >
     * win_b1m1[j]) + (l > win_b2m1[j]) (AVX-512BW, AVX2): win_t[j] = base - j + #{i : t_i <= W j}, and
     * a window holds at most two t_i (they lie more than W / 2 apart: see tab_build). The window
     * tables repeat every 2^M bytes: vpshufb indexes them by v's low four bits. */
    uint8_t win_t[16], win_b1m1[16], win_b2m1[16]; /* the b's less one, W - 1: none */
    int fast; /* the overflow, sign and range rules fit the vector loops, and the windows hold */
    /* Band rows' half windows (STEP_BAND in the AVX2 and AVX-512BW loops): W / 2 values of m, m = (W / 2)
     * j' + l, each holding at most one t_i, indexed by v' = (E - E_b) 2^(M+1) + j' (packed as v, one
     * shift less): the code of (E, m) is avg(v', 0) + half_t[j'] + (l > half_bm1[j']), where avg(v', 0) =
     * (v' + 1) >> 1 (vpavgb) = (E - E_b) 2^M + ((j' + 1) >> 1): one lookup, one compare and one add a
     * step fewer than the windows, one average and one mask of v''s low four bits more. v' reaches 255
     * half as many binades above E_b (tab_below_half_top). */
    uint8_t half_t[16], half_bm1[16];
    uint32_t ebmh; /* E_b 2^(M+1) in both halves: ebm2 << 1, kept for the group switches as ebm2 is */
    int half;
    uint32_t ebm2; /* E_b 2^M in both halves: band rows' group switches broadcast it from memory (AVX2,
                    * AVX-512BW blocks replayed 1-3% faster than a shift and a broadcast from a register) */
} bf16_tab;

/* elements per operand worth a build; inputs per vector-loop call (at most: the buffer's size,
 * where the codes go through one). 8,192: a common row in one call (pieces of 1,024 spent 8-11% of
 * the per-channel loop's time on each call's setup: measured) */
enum { TAB_MIN = 512, TAB_CHUNK = 8192 };
/* A task's tables, kept by operand: a weight's dynamic scales repeat (an amax is one of the 128
 * bfloat16 values of its binade), so most rows and tiles find their table built. Open addressing on
 * sv's bits, TAB_PROBES slots from its home; where all are taken, the home slot's table is replaced.
 * A direct-mapped cache of 64 rebuilt tables all the time (an 8192x8192 N(0, 0.02) weight's 86 row
 * amaxes made 731 builds per call, ~0.5 us each). 128 slots held that weight's scales but not a
 * weight whose rows or blocks spread over a few binades: with row scales spread over four binades
 * (549 distinct amaxes) per channel took 10.9 against 7.6 ms, 128x128 blocks (~60 distinct a band)
 * 13.3 against 9.0 (x86-64-v3, one thread). 1,024 slots, on the heap: 8.0 and 9.7 ms there, the
 * same on the N(0, 0.02) weight; 2,048 no better. Where the allocation fails, one slot on the stack:
 * every operand builds its table again and block bands go by tiles (right, slower). A task with
 * fewer operands gets fewer slots, twice its operands (at least 8): allocating and emptying 1,024
 * took 1-4 us of a small call's 50-110 (measured). quant_job's tab_slots may ask for another power
 * of two (tests). */
enum { TAB_CACHE_BITS = 10, TAB_PROBES = 8 };
typedef struct {
    bf16_tab *e;    /* 1 << bits slots */
    uint32_t bits;
    bf16_tab one;   /* the slot where the heap's were refused */
} tab_cache;
/* a cache for a task of at most `operands` distinct operands, or of `slots` slots where that is a
 * power of two up to 65,536 */
FP8REF_INLINE void tab_cache_init(tab_cache *tc, uint32_t slots, int64_t operands) {
    uint32_t bits = 3;
    while (bits < TAB_CACHE_BITS && ((int64_t)1 << bits) < 2 * operands) bits++;
    if (slots && !(slots & (slots - 1)) && slots <= 1u << 16) bits = (uint32_t)__builtin_ctz(slots);
    tc->e = bits ? malloc(sizeof(bf16_tab) << bits) : NULL;
    tc->bits = tc->e ? bits : 0;
    if (!tc->e) tc->e = &tc->one;
    for (uint32_t i = 0; i < 1u << tc->bits; i++) tc->e[i].built = 0;
}
FP8REF_INLINE void tab_cache_free(tab_cache *tc) {
    if (tc->e != &tc->one) free(tc->e);
}
/* whether t holds sv's table */
FP8REF_INLINE int tab_holds(const bf16_tab *t, float sv) { return t->built && t->key == bits_of(sv); }
FP8REF_INLINE bf16_tab *tab_slot(tab_cache *tc, float sv) {
    const uint32_t key = bits_of(sv), mask = (1u << tc->bits) - 1;
    const uint32_t home = tc->bits ? (key * 0x9E3779B1u) >> (32 - tc->bits) : 0;
    /* never emptied in a task: a key lies before any empty slot */
    for (uint32_t i = 0; i < TAB_PROBES && i <= mask; i++) {
        bf16_tab *t = &tc->e[(home + i) & mask];
        if (!t->built || t->key == key) return t;
    }
    return &tc->e[home];
}
/* input bytes of the block tiles taken together (amaxes, then codes): one 128x128 bfloat16 tile,
 * which the encode then reads from the copy its amax pass gathered (bands_fused; measured against
 * 64-256 KiB runs: 0.85-0.88 vs 0.66-0.74 of copy_ with two threads, the same or better with one) */
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
    t->key = bits_of(sv), t->built = 1, t->ok = 0, t->fast = 0;
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
    uint32_t i = 0; /* t_i: the first m whose code is base + i + 1 or more (128: none); out is nondecreasing */
    for (int m = 0; m < 128; m++)
        for (; i < 8 && out[m] > base + i; i++) t->t[i] = (uint16_t)m, t->tm1[i] = (int8_t)(m - 1);
    for (; i < 8; i++) t->t[i] = 128, t->tm1[i] = 127;
    for (int m = 0; m < 128; m++) t->steps_j[m] = (uint8_t)(out[m] - (m >> (7 - M))); /* >= base - 2^M + 1 > 0 */
    t->lo = (uint16_t)(eb << 7), t->hi = (uint16_t)(top << 7), t->eb = (uint16_t)eb, t->base = (uint16_t)base;
    t->ebm2 = (uint32_t)(eb << M) * 0x00010001u;
    t->shift = (uint16_t)M, t->maxmag = (uint16_t)p->maxmag, t->signbit = (uint16_t)p->signbit;
    t->ovf_p = out[131], t->ovf_n = out[132], t->zero_p = out[129], t->zero_n = out[130];
    /* The window loops' tables. Between consecutive t_i (midpoints) the exact quotient moves by one
     * step of the format, more than W / 2 units of m (x/s < 2^(e+1) within the binade puts the step
     * s 2^(e-M) above 2^(E-M-1)), so a window of W holds at most two; checked here for every recipe (a
     * producer's rounding to the model dtype may move a t_i by one). Overflow: min(c, ovf_p) is the
     * old rule where ovf_p is maxmag (saturating) or maxmag + 1 (Inf/NaN), and the negative one that
     * | 0x80. The loop sends v = 0 and v = 255 (saturated) to the segment loop, and takes every E up
     * to E_b + (254 >> M): all of them must have a finite y (below top). */
    const int W = 1 << (7 - M), nw = 1 << M;
    int win_ok = (t->ovf_p == p->maxmag || t->ovf_p == p->maxmag + 1) &&
                 t->ovf_n == (t->ovf_p | 0x80u) && top - eb > (254 >> M);
    for (int j = 0; j < nw && win_ok && !c->vbmi; j++) { /* the windows: not the VBMI loop's */
        int below = 0, nb = 0, b[3] = {W, W, W};
        for (int i = 0; i < 8; i++) {
            int ti = t->t[i] - W * j;
            if (ti <= 0) below++;
            else if (ti < W) b[nb < 2 ? nb++ : (win_ok = 0, 2)] = ti;
        }
        int tj = (int)base - j + below;
        win_ok &= tj >= 0 && tj <= 127;
        for (int r = j; r < 16; r += nw) {
            t->win_t[r] = (uint8_t)tj;
            t->win_b1m1[r] = (uint8_t)(b[0] - 1);
            t->win_b2m1[r] = (uint8_t)(b[1] - 1);
        }
    }
    t->fast = win_ok;
    /* the half windows: the t_i lie more than W / 2 apart (above), so each holds at most one; checked */
    const int H = W >> 1, nh = nw << 1;
    int half_ok = win_ok && !c->vbmi;
    for (int j = 0; j < nh && half_ok; j++) {
        int below = 0, b = H;
        for (int i = 0; i < 8; i++) {
            const int ti = t->t[i] - H * j;
            if (ti <= 0) below++;
            else if (ti < H) half_ok &= b == H, b = ti;
        }
        for (int r = j; r < 16; r += nh) {
            t->half_t[r] = (uint8_t)((int)base - ((j + 1) >> 1) + below);
            t->half_bm1[r] = (uint8_t)(b - 1);
        }
    }
    t->ebmh = (uint32_t)(eb << (M + 1)) * 0x00010001u;
    t->half = half_ok;
    t->ok = 1;
}
/* whether every input of magnitude bits at most a lies below v = 255 in t: no step need look for
 * inputs past the table (STEP_BAND, STEP_ZEROS) */
FP8REF_INLINE int tab_below_top(const bf16_tab *t, uint32_t a) {
    return (a >> (7 - t->shift)) < (uint32_t)((t->eb << t->shift) + 255);
}
/* whether every input of magnitude bits at most a lies below v' = 255 in t's half windows */
FP8REF_INLINE int tab_below_half_top(const bf16_tab *t, uint32_t a) {
    return (a >> (6 - t->shift)) < (uint32_t)((t->eb << (t->shift + 1)) + 255);
}
/* whether no input of magnitude bits at most a codes past t's overflow code (the magnitude codes
 * grow with a): the AVX2 and AVX-512BW band-row steps leave out the overflow rule (STEP_BAND) */
FP8REF_INLINE int tab_no_overflow(const bf16_tab *t, uint32_t a) {
    const uint32_t e = a >> 7, m = a & 0x7Fu;
    if (e < t->eb) return 1; /* below the table: every input goes to fix_lanes */
    return ((e - t->eb) << t->shift) + (m >> (7 - t->shift)) + t->steps_j[m] <= t->ovf_p; /* v + steps_j[m] */
}
/* whether t codes +-0 as STEP_ZEROS gives them, 0x00 and 0x80 (not e4m3fnuz: its -0 is 0x00) */
FP8REF_INLINE int tab_signed_zeros(const bf16_tab *t) { return t->zero_p == 0 && t->zero_n == 0x80u; }

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

/* The inputs a vector table loop does not take (v = 0: below E_b, those with subnormal or zero codes
 * but +-0; v = 255: past the table), by the segment loop, into the step's codes before they are
 * stored: a fix-up after the step was streamed wrote into a line still in flight and waited on
 * memory (~180 ns each; N(0, s) rows have ~0.9 such inputs per 8,192: 10-15% of a per-channel
 * pass, measured). kind BF16 and mode RNE: the table loops'. */
typedef struct {
    float sv;
    const consts *c;
    int exact, mul, model;
} fix_ctx;
static __attribute__((noinline, unused)) void fix_lanes(const uint16_t *x, uint8_t *codes, uint64_t lanes,
                                                        const fix_ctx *f) {
    for (; lanes; lanes &= lanes - 1) {
        const int64_t i = __builtin_ctzll(lanes);
        segment(x, codes, i, i + 1, f->sv, f->c, BF16, f->exact, RNE, f->mul, f->model);
    }
}

#define NO_BAND_ROW(x, dst, ng, g, tabs, fixes, pf_off, stream, zeros)                                    \
    ((void)(x), (void)(dst), (void)(ng), (void)(g), (void)(tabs), (void)(fixes), (void)(pf_off), (void)(stream), \
     (void)(zeros))
#define NO_BAND_ROW_NEXT(x, dst, ng, g, tabs, fixes, pf_off, stream, zeros, next, accs) \
    (NO_BAND_ROW(x, dst, ng, g, tabs, fixes, pf_off, stream, zeros), (void)(next), (void)(accs))
#define NO_TAB_LOOP(x, dst, n, rows, stride, dst_stride, pf, stream, zeros, t, f) \
    ((void)(x), (void)(dst), (void)(n), (void)(rows), (void)(stride), (void)(dst_stride), (void)(pf), \
     (void)(stream), (void)(zeros), (void)(t), (void)(f)) /* a table loop not in this object */

/* A vector step's test for the inputs it leaves to fix_lanes (its `top`). STEP_TILE: v = 0 (below the
 * table, and +-0, which the step codes itself) or v = 255 (past it). STEP_BAND: v = 0 alone, where no
 * input reaches v = 255 (band rows: the caller checked every group's amax); the AVX2 and AVX-512BW
 * steps take v' and the half windows (bf16_tab; v' = 0 alone), and leave out the overflow rule,
 * where no input codes past the overflow code (tab_no_overflow: one instruction a step fewer; the
 * captured tasks replayed one thread, ns per input: AVX2 with two steps to a branch per channel
 * 0.112 -> 0.103, blocks 0.126 -> 0.117; AVX-512BW 0.1035 -> 0.1019, 0.1130 -> 0.1069).
 * STEP_ZEROS, band rows too: v signed, saturated to [-128, 127], so that +-0 codes without a test
 * or a branch. v = -128: +-0 and the inputs 2^(7-M) binades or more below E_b, whose values (binade
 * E_b - 1 lies below 2^(emin+1), each one lower halves) lie below 2^(emin-14), under half the
 * smallest subnormal 2^(emin-M): they round to +-0, coded 0x00 and 0x80 (the caller checked the
 * table's zero_p and zero_n; e4m3fnuz's -0 is 0x00).
 * v -127 to -1 go to fix_lanes (the AVX2 step's one test sends v = 0 too, which the table codes as
 * well). v 127 (from 127 to 254) looks up a step of at least base - (2^M - 1) >= 1 and saturates at
 * 127: the overflow code, as every such input's magnitude code is past 127. One more instruction a
 * step than STEP_BAND in the VBMI loop, three more in the AVX2 and AVX-512BW loops (their band rows
 * take the half windows): taken where a task's first row holds many zeros (zeros_heavy), which otherwise
 * cost a mispredicted branch at each step holding one; by tiles too (rows_given: per tensor) where the
 * caller gives the inputs' largest magnitude and it lies below v = 255 (quant_job.bound). */
enum { STEP_BAND = 0, STEP_TILE = 1, STEP_ZEROS = 2 };

/* What the vector table loops prefetch while they compute (into L2, PREFETCHT1), one line per 32
 * inputs: rows of n inputs `stride` apart from p, `rows` of them, then from p again; p NULL: their
 * own inputs (a no-op). A plan's rows hold at least one step wherever the runs do: the walk takes no steps
 * otherwise (segment_tab's plans are the runs' own shape). */
typedef struct {
    const uint16_t *p;
    int64_t n, rows, stride;
} pf_plan;

/* Page priming. Where the walk goes row after row (one contiguous row per call, the next row in the
 * plan: bands_fused's channels, rows_given's rows, which go last to first), each step that starts a
 * 4 KiB page of the prefetch plan or of the codes also touches, with one PREFETCHNTA, the page
 * PAGE_AHEAD bytes on in the rows' direction, so that its translation is in the TLB before the
 * plan's T1 prefetches and the streamed stores reach it. With 4 KiB pages the pass waited on page
 * walks once the operation before it (a copy_, any pass over 128 MiB) had evicted the page tables
 * from the caches (Zen 4: back-to-back calls ~15% faster than calls after a copy_; none faster with
 * 2 MiB pages). PREFETCHNTA or T0 there gained 5-23% in a C model of the walk, T1 or T2 nothing
 * (Zen 4 is reported to drop T1/T2 prefetches at times; these look like the ones that miss the TLB).
 * The distance mattered little (8 KiB to 256 KiB for the codes). docs/performance.md, seventh pass. */
enum { PAGE_AHEAD = 32768 };
/* the page `on` bytes from p primed where p is the first of a walk's `step`-byte steps in its page */
static inline __attribute__((always_inline)) void prime_page(const void *p, uintptr_t step, intptr_t on) {
    if (((uintptr_t)p & 4095u) < step) __builtin_prefetch((const void *)((uintptr_t)p + (uintptr_t)on), 0, 0);
}

/* The vector table loops' walk over `rows` runs of n inputs (x0 + r * stride; codes at dst0 + r *
 * dst_stride): the whole W-input steps of every run in one flat loop, then each run's last n % W
 * inputs. STEP(x, dst, pf, left, ...) does one step. A loop per run reloaded the loops' constants
 * at every run: 128-input runs of a block tile spent 7% of the x86-64-v3 pass there (measured).
 * The prefetch keeps its own count, although every caller's plan has the runs' shape: simpler
 * walks (one count for both, from a plain pointer and stride; or other bounds on this count) ran
 * the AVX-512BW loop per channel from memory 10-16% slower (8192x8192, one or two threads, A/B in
 * one process; their hot loops differ in a few bytes of code). The cause is not known. */
#define TAB_WALK(W, STEP, ...)                                                                        \
    do {                                                                                              \
        const int64_t whole_ = n - n % (W);                                                           \
        const pf_plan pp_ = pf->p ? *pf : (pf_plan){x0, n, rows, stride};                            \
        const int64_t pn_ = pp_.n - pp_.n % (W);                                                      \
        const uint16_t *x_ = x0, *pf_ = pp_.p;                                                        \
        uint8_t *d_ = dst0;                                                                           \
        int64_t pk_ = pn_, pr_ = pp_.rows;                                                            \
        const int prime_ = pf->p && pf->rows == 1 && rows == 1; /* row after row: PAGE_AHEAD */      \
        /* rows_given goes last row first */                                                          \
        const intptr_t on_ = (uintptr_t)pf->p < (uintptr_t)x0 ? -PAGE_AHEAD : PAGE_AHEAD;            \
        for (int64_t s_ = pn_ > 0 ? rows * (whole_ / (W)) : 0, k_ = whole_; s_ > 0; s_--) {           \
            STEP(x_, d_, pf_, (W), __VA_ARGS__);                                                      \
            x_ += (W), d_ += (W), pf_ += (W);                                                         \
            if (prime_) prime_page(pf_, 2 * (W), on_), prime_page(d_, (W), on_);                      \
            if ((k_ -= (W)) == 0) /* the next run */                                                  \
                k_ = whole_, x_ += stride - whole_, d_ += dst_stride - whole_;                        \
            if ((pk_ -= (W)) == 0) { /* the next prefetch row, or the first again */                  \
                pk_ = pn_, pf_ += pp_.stride - pn_;                                                   \
                if (--pr_ == 0) pr_ = pp_.rows, pf_ = pp_.p;                                          \
            }                                                                                         \
        }                                                                                             \
        for (int64_t r_ = 0; whole_ < n && r_ < rows; r_++)                                           \
            STEP(x0 + r_ * stride + whole_, dst0 + r_ * dst_stride + whole_, x0 + r_ * stride + whole_, \
                 n - whole_, __VA_ARGS__);                                                            \
    } while (0)

/* One row of a unit of bands_fused (a band's rows, up to UNIT_GROUPS groups of each): ng groups of g inputs
 * (g a multiple of 64), group i_ by its own table (the loop's constants from tabs[0], then per group
 * GROUP_OF(&K_, tabs[i_]) sets the ones that depend on the operand: the caller checked that the others
 * agree; reloading all of them per group took 3-4% longer at v3) and fixes[i_]; the codes streamed
 * (whole aligned lines: the caller checked) where `stream`, else stored (STREAM: each of the loop's two
 * copies has its own constant; stored codes went by tiles, 40% slower, before: docs/performance.md,
 * eleventh pass). Each step prefetches into L2 the plan line pf_off inputs
 * on (STEP's) and primes the pages on as TAB_WALK primes a row.
 * BAND_ROW: the row's steps in one loop, the group's constants switched every g / W steps, each step
 * testing for v = 0 alone (top = 0: the caller checked that no group's amax reaches v = 255). A loop
 * per group, for 128-input groups (two AVX-512 steps), spent ~25 instructions a group getting in and
 * out of it. 8192x8192 128x128 blocks, one thread, ns per input, A/B in one process (the captured
 * task replayed): cache-resident VBMI 0.097 -> 0.083, AVX-512BW 0.121 -> 0.109, v3 0.132 -> 0.124;
 * from memory 0.133 -> 0.119, 0.133 -> 0.126, 0.129 -> 0.122.
 * BAND_ROW_NEXT also reads `next` (the next unit's row, of the same shape) for the next unit's
 * amaxes: group i_'s running maxima of the magnitude bits in the ACC_T at accs + 32 i_ (ACC_MAX adds
 * one step's inputs), so that the next unit's inputs come from memory while this one computes, not in
 * a pass of their own; its prefetch plan is then the next unit's row after (256-1,024 inputs past the
 * loads were slower, 4,096-16,384 the same). It keeps a loop per group: flat, x86-64-v3's 16
 * registers spilled the running maxima (per channel 8.4 against 7.4 ms, one thread). TOP: the steps'
 * test, measured per loop (per channel from memory, one thread): the VBMI loop testing v = 0 alone
 * took 0.116 against 0.089 ns per input (the same cache-resident), AVX-512BW 0.098 against 0.110
 * with both, v3 0.098 against 0.105. These loops' speed from memory also moves by 5-10% with where
 * the linker puts them (the same code 16-48 bytes further on: docs/performance.md, ninth pass). */
#define BAND_ROW(W, STEP, STREAM, TOP, CONSTS_OF, GROUP_OF, ...)                                      \
    __typeof__(CONSTS_OF(tabs[0])) K_ = CONSTS_OF(tabs[0]);                                           \
    for (int64_t k_ = 0, i_ = -1, left_ = 0; k_ < ng * g; k_ += (W), left_--) {                       \
        if (left_ == 0) i_++, left_ = g / (W), GROUP_OF(&K_, tabs[i_]);                               \
        const uint16_t *pf_ = x + k_ + pf_off;                                                        \
        STEP(x + k_, dst + k_, pf_, (W), STREAM, TOP, &K_, __VA_ARGS__);                              \
        prime_page(pf_, 2 * (W), PAGE_AHEAD), prime_page(dst + k_, (W), PAGE_AHEAD);                   \
    }
#define BAND_ROW_NEXT(W, STEP, STREAM, TOP, CONSTS_OF, GROUP_OF, ACC_T, ACC_MAX, ...)                 \
    __typeof__(CONSTS_OF(tabs[0])) K_ = CONSTS_OF(tabs[0]);                                           \
    for (int64_t i_ = 0; i_ < ng; i_++) {                                                             \
        GROUP_OF(&K_, tabs[i_]);                                                                      \
        ACC_T acc_;                                                                                   \
        memcpy(&acc_, accs + 32 * i_, sizeof acc_);                                                   \
        for (int64_t k_ = i_ * g; k_ < i_ * g + g; k_ += (W)) {                                      \
            const uint16_t *pf_ = x + k_ + pf_off;                                                    \
            acc_ = ACC_MAX(acc_, next + k_);                                                          \
            STEP(x + k_, dst + k_, pf_, (W), STREAM, TOP, &K_, __VA_ARGS__);                          \
            prime_page(pf_, 2 * (W), PAGE_AHEAD), prime_page(dst + k_, (W), PAGE_AHEAD);               \
        }                                                                                             \
        memcpy(accs + 32 * i_, &acc_, sizeof acc_);                                                   \
    }
/* the loop four times in its function, the store kind and the steps' test constants in each: codes
 * streamed where `stream`, else stored; the steps' test STEP_ZEROS (constants ZCONSTS_OF, ZGROUP_OF)
 * where `zeros`, else TOP (CONSTS_OF, GROUP_OF) */
#define BAND_ROW_COPIES(LOOP, W, STEP, TOP, CONSTS_OF, GROUP_OF, ZCONSTS_OF, ZGROUP_OF, ...)           \
    if (!zeros && stream) {                                                                           \
        LOOP(W, STEP, 1, TOP, CONSTS_OF, GROUP_OF, __VA_ARGS__);                                      \
    } else if (!zeros) {                                                                              \
        LOOP(W, STEP, 0, TOP, CONSTS_OF, GROUP_OF, __VA_ARGS__);                                      \
    } else if (stream) {                                                                              \
        LOOP(W, STEP, 1, STEP_ZEROS, ZCONSTS_OF, ZGROUP_OF, __VA_ARGS__);                             \
    } else {                                                                                          \
        LOOP(W, STEP, 0, STEP_ZEROS, ZCONSTS_OF, ZGROUP_OF, __VA_ARGS__);                             \
    }
#define BAND_ROW_ARGS                                                                                 \
    const uint16_t *restrict x, uint8_t *restrict dst, int64_t ng, int64_t g, const bf16_tab *const *tabs, \
        const fix_ctx *fixes, int64_t pf_off, int stream, int zeros
#define BAND_ROW_NEXT_ARGS BAND_ROW_ARGS, const uint16_t *next, uint16_t *restrict accs

#if defined(__x86_64__) && defined(__GNUC__) && defined(__AVX2__)
/* running maxima of the magnitude bits of the 32 inputs at p (BAND_ROW, amax_groups) */
static inline __attribute__((always_inline)) __m256i avx2_acc_max(__m256i acc, const uint16_t *p) {
    const __m256i mask = _mm256_set1_epi16(0x7FFF);
    return _mm256_max_epu16(acc, _mm256_max_epu16(_mm256_and_si256(_mm256_loadu_si256((const __m256i *)p), mask),
                                                  _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(p + 16)), mask)));
}
static inline __attribute__((always_inline)) __m256i avx2_acc_max2(__m256i acc, const uint16_t *p) {
    return avx2_acc_max(avx2_acc_max(acc, p), p + 32);
}
#endif

/* tab_run's rules in AVX2 intrinsics, 32 inputs per step, in the x86-64-v3 object (the v4 object runs
 * tab_run_bw or tab_run_vbmi). 26 vector instructions a step (23 in band rows, STEP_BAND, two steps
 * to a branch, by the half windows: bf16_tab; the compiler's tab_run takes ~90): in 16-bit lanes,
 * v = (E - E_b) 2^M + j straight from the bits (a + a drops the sign, one shift, one saturating
 * subtraction: 0 below E_b), packed to bytes with unsigned saturation; then three 16-byte lookups by
 * v (win_*: tab_build), two compares with l, one saturating add (v >= 128 looks up zeros and
 * overflows whatever it adds), overflow by min and the sign by OR. v = 0 (below the table, and +-0)
 * and v = 255 go to fix_lanes, +-0 here. Runs x0 + r * stride, r < rows, of n inputs (a block
 * tile in one call, as tab_run_vbmi). */
#if defined(__x86_64__) && defined(__GNUC__) && defined(__AVX2__) && !defined(__AVX512BW__)
typedef struct {
    __m256i wt, wb1, wb2, ebm, lmask, opv, s80, zp, zn, bias, edge, zero, low4;
    __m128i sh;
} avx2_consts;
#define AVX2_ORDER(c) _mm256_permute4x64_epi64((c), 0xD8) /* packed byte order back to input order */
/* the codes of the 32 inputs at x in packed byte order (inputs 0-7, 16-23 | 8-15, 24-31), and in *bits
 * the lanes (packed order) that `top` leaves to avx2_fix */
static inline __attribute__((always_inline)) __m256i avx2_codes(const uint16_t *x, int top, const avx2_consts *K,
                                                                uint32_t *bits) {
    const __m256i h0 = _mm256_loadu_si256((const __m256i *)x), h1 = _mm256_loadu_si256((const __m256i *)(x + 16));
    const __m256i a0 = _mm256_add_epi16(h0, h0), a1 = _mm256_add_epi16(h1, h1); /* magnitude bits << 1 */
    const __m256i l = _mm256_packus_epi16(_mm256_and_si256(h0, K->lmask), _mm256_and_si256(h1, K->lmask));
    const __m256i sgn = _mm256_packs_epi16(h0, h1); /* bit 7: the input's sign */
    const __m256i e0 = _mm256_srl_epi16(a0, K->sh), e1 = _mm256_srl_epi16(a1, K->sh);
    const __m256i v = top == STEP_ZEROS ? _mm256_packs_epi16(_mm256_sub_epi16(e0, K->ebm), _mm256_sub_epi16(e1, K->ebm))
                                        : _mm256_packus_epi16(_mm256_subs_epu16(e0, K->ebm), _mm256_subs_epu16(e1, K->ebm));
    if (top == STEP_BAND) { /* v', l and the tables are the half windows' (avx2_band_consts_of), looked up
                             * by v''s low four bits (vpshufb gives 0 where bit 7 is set: v' >= 128);
                             * no overflow: the caller checked (tab_no_overflow); v' = 0 alone to fix */
        const __m256i j = _mm256_and_si256(v, K->low4);
        const __m256i c1 = _mm256_cmpgt_epi8(l, _mm256_shuffle_epi8(K->wb1, j)); /* -1 where true */
        *bits = (uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(v, K->zero));
        const __m256i st = _mm256_sub_epi8(_mm256_shuffle_epi8(K->wt, j), c1);
        const __m256i code = _mm256_add_epi8(_mm256_avg_epu8(v, K->zero), st);
        return _mm256_or_si256(code, _mm256_and_si256(sgn, K->s80));
    }
    const __m256i c1 = _mm256_cmpgt_epi8(l, _mm256_shuffle_epi8(K->wb1, v)); /* -1 where true */
    const __m256i c2 = _mm256_cmpgt_epi8(l, _mm256_shuffle_epi8(K->wb2, v));
    const __m256i st = _mm256_sub_epi8(_mm256_shuffle_epi8(K->wt, v), _mm256_add_epi8(c1, c2));
    if (top == STEP_ZEROS) { /* v -128: +-0's codes (max with 0, then the sign); v + 127 below 0: -128, or past 0 */
        *bits = ~(uint32_t)_mm256_movemask_epi8(_mm256_add_epi8(v, K->bias));
        return _mm256_or_si256(_mm256_max_epi8(_mm256_min_epi8(_mm256_adds_epi8(v, st), K->opv), K->zero),
                               _mm256_and_si256(sgn, K->s80));
    }
    /* v + 127 wraps 0 to 127 and 255 to 126, and every other v below 126 (signed) */
    *bits = (uint32_t)_mm256_movemask_epi8(_mm256_cmpgt_epi8(_mm256_add_epi8(v, K->bias), K->edge));
    return _mm256_or_si256(_mm256_min_epu8(_mm256_adds_epu8(v, st), K->opv), _mm256_and_si256(sgn, K->s80));
}
/* avx2_codes' code for x in input order, with its lanes `bits` (nonzero) coded: +-0 here (but for
 * STEP_ZEROS, which coded them), the rest by fix_lanes */
static inline __attribute__((always_inline)) __m256i avx2_fix(const uint16_t *x, __m256i code, uint32_t bits, int top,
                                                                const avx2_consts *K, const fix_ctx *f) {
    if (top != STEP_ZEROS) {
        const __m256i h0 = _mm256_loadu_si256((const __m256i *)x), h1 = _mm256_loadu_si256((const __m256i *)(x + 16));
        const __m256i z = _mm256_packs_epi16(_mm256_cmpeq_epi16(_mm256_add_epi16(h0, h0), K->zero),
                                             _mm256_cmpeq_epi16(_mm256_add_epi16(h1, h1), K->zero));
        code = _mm256_blendv_epi8(code, _mm256_blendv_epi8(K->zp, K->zn, _mm256_packs_epi16(h0, h1)), z);
        bits &= ~(uint32_t)_mm256_movemask_epi8(z);
    }
    code = AVX2_ORDER(code); /* input order */
    if (bits) { /* bits back to input order */
        uint8_t tmp[32];
        _mm256_storeu_si256((__m256i *)tmp, code);
        fix_lanes(x, tmp, (bits & 0xFF0000FFu) | ((bits >> 8) & 0xFF00u) | ((bits << 8) & 0xFF0000u), f);
        code = _mm256_loadu_si256((const __m256i *)tmp);
    }
    return code;
}
static inline __attribute__((always_inline)) void avx2_store(uint8_t *dst, __m256i code, int stream) {
    if (stream) /* whole aligned lines: the caller checked dst and dst_stride */
        _mm256_stream_si256((__m256i *)dst, code);
    else
        _mm256_storeu_si256((__m256i *)dst, code);
}
/* `steps` 32-input steps at x that hold lanes for avx2_fix, coded again from their inputs and their
 * table t (a band row's groups differ in their windows alone: band_tables). Out of line and from
 * scratch, so that the hot loops keep nothing live for the fix-up: inline, its values (the sign
 * bytes, the zero codes, the steps' codes) spilled the loop's tables and sign bytes to the stack, one
 * to three loads and stores a step (blocks replayed, x86-64-v3, ns per input: 0.112 inline, 0.106
 * out of line, 0.100 with the fix-up left out). */
static inline __attribute__((always_inline)) avx2_consts avx2_consts_of(const bf16_tab *t);
static inline __attribute__((always_inline)) avx2_consts avx2_band_consts_of(const bf16_tab *t);
/* the 32 inputs at x coded, every lane, in input order */
static inline __attribute__((always_inline)) __m256i avx2_coded(const uint16_t *x, int top, const avx2_consts *K,
                                                                const fix_ctx *f) {
    uint32_t bits;
    const __m256i c = avx2_codes(x, top, K, &bits);
    return bits ? avx2_fix(x, c, bits, top, K, f) : AVX2_ORDER(c);
}
static __attribute__((noinline, cold)) void avx2_fix_steps(const uint16_t *x, uint8_t *dst, int steps, int stream,
                                                           int top, const bf16_tab *t, const fix_ctx *f) {
    const avx2_consts K = top == STEP_BAND ? avx2_band_consts_of(t) : avx2_consts_of(t);
    for (int i = 0; i < steps; i++, x += 32, dst += 32) /* `top` a constant in each call: its own code */
        avx2_store(dst,
                   top == STEP_ZEROS  ? avx2_coded(x, STEP_ZEROS, &K, f)
                   : top == STEP_TILE ? avx2_coded(x, STEP_TILE, &K, f)
                                      : avx2_coded(x, STEP_BAND, &K, f),
                   stream);
}
/* one step: inputs [0, left) of x; left < 32 (a run's last inputs) by tab_run_scalar */
static inline __attribute__((always_inline)) void avx2_step(const uint16_t *x, uint8_t *dst, const uint16_t *pf,
                                                            int64_t left, int stream, int top, const avx2_consts *K,
                                                            const bf16_tab *t, const fix_ctx *f) {
    if (left < 32) {
        uint32_t tail = 0;
        for (int64_t i = 0; i < left; i++) tail |= (uint32_t)(tab_run_scalar(x + i, dst + i, 1, t) != 0) << i;
        if (tail) fix_lanes(x, dst, tail, f);
        return;
    }
    _mm_prefetch((const char *)pf, _MM_HINT_T1); /* the plan's line (TAB_WALK), into L2 */
    uint32_t bits;
    const __m256i code = avx2_codes(x, top, K, &bits);
    if (__builtin_expect(bits != 0, 0))
        avx2_fix_steps(x, dst, 1, stream, top, t, f);
    else
        avx2_store(dst, AVX2_ORDER(code), stream);
}
/* two steps, 64 inputs, one branch for both (band rows: their groups hold whole pairs). Per channel,
 * the captured task replayed (tools/ab_kernels.py --replay, x86-64-v3, one thread, 2026-12-06), ns per
 * input: one step a branch 0.101-0.152, two 0.097-0.139 (the overflow rule left out in both); one
 * test of the two steps' v (their min) no faster. */
static inline __attribute__((always_inline)) void avx2_step2(const uint16_t *x, uint8_t *dst, const uint16_t *pf,
                                                             int64_t left, int stream, int top, const avx2_consts *K,
                                                             const bf16_tab *t, const fix_ctx *f) {
    (void)left;
    _mm_prefetch((const char *)pf, _MM_HINT_T1), _mm_prefetch((const char *)(pf + 32), _MM_HINT_T1);
    uint32_t b0, b1;
    const __m256i c0 = avx2_codes(x, top, K, &b0), c1 = avx2_codes(x + 32, top, K, &b1);
    if (__builtin_expect((b0 | b1) != 0, 0))
        avx2_fix_steps(x, dst, 2, stream, top, t, f);
    else
        avx2_store(dst, AVX2_ORDER(c0), stream), avx2_store(dst + 32, AVX2_ORDER(c1), stream);
}
static inline __attribute__((always_inline)) avx2_consts avx2_consts_of(const bf16_tab *t) {
    const int M = t->shift;
    return (avx2_consts){
        .wt = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)t->win_t)),
        .wb1 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)t->win_b1m1)),
        .wb2 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)t->win_b2m1)),
        .ebm = _mm256_set1_epi32((int)t->ebm2), .lmask = _mm256_set1_epi16((short)((1 << (7 - M)) - 1)),
        .opv = _mm256_set1_epi8((char)t->ovf_p), .s80 = _mm256_set1_epi8((char)0x80),
        .zp = _mm256_set1_epi8((char)t->zero_p), .zn = _mm256_set1_epi8((char)t->zero_n),
        .bias = _mm256_set1_epi8(127), .edge = _mm256_set1_epi8(125), .zero = _mm256_setzero_si256(),
        .low4 = _mm256_set1_epi8(15),
        .sh = _mm_cvtsi32_si128(8 - M)};
}
static __attribute__((noinline)) void tab_run_avx2(const uint16_t *restrict x0, uint8_t *restrict dst0, int64_t n,
                                                   int64_t rows, int64_t stride, int64_t dst_stride,
                                                   const pf_plan *pf, int stream, int zeros, const bf16_tab *t,
                                                   const fix_ctx *f) {
    const avx2_consts K = avx2_consts_of(t);
    if (!zeros) /* the common copy first (BAND_ROW_COPIES) */
        TAB_WALK(32, avx2_step, stream, STEP_TILE, &K, t, f);
    else
        TAB_WALK(32, avx2_step, stream, STEP_ZEROS, &K, t, f);
}
static inline __attribute__((always_inline)) void avx2_group_of(avx2_consts *K, const bf16_tab *t) {
    K->wt = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)t->win_t));
    K->wb1 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)t->win_b1m1));
    K->wb2 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)t->win_b2m1));
    K->ebm = _mm256_set1_epi32((int)t->ebm2);
}
/* STEP_BAND's constants: the half windows (bf16_tab) */
static inline __attribute__((always_inline)) void avx2_band_group_of(avx2_consts *K, const bf16_tab *t) {
    K->wt = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)t->half_t));
    K->wb1 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)t->half_bm1));
    K->ebm = _mm256_set1_epi32((int)t->ebmh);
}
static inline __attribute__((always_inline)) avx2_consts avx2_band_consts_of(const bf16_tab *t) {
    avx2_consts K = avx2_consts_of(t);
    avx2_band_group_of(&K, t);
    K.lmask = _mm256_set1_epi16((short)((1 << (6 - t->shift)) - 1)), K.sh = _mm_cvtsi32_si128(7 - t->shift);
    return K;
}
/* on a 64-byte line: where another edit had put it 48 bytes into one, blocks took 4% longer (x86-64-v3,
 * the captured task replayed cache-resident: 0.1178 against 0.1119-0.1133 ns per input, 2026-12-06) */
static __attribute__((noinline, aligned(64))) void band_row_avx2(BAND_ROW_ARGS) {
    BAND_ROW_COPIES(BAND_ROW, 64, avx2_step2, STEP_BAND, avx2_band_consts_of, avx2_band_group_of, avx2_consts_of,
                    avx2_group_of, tabs[i_], &fixes[i_]);
}
static __attribute__((noinline, aligned(64))) void band_row_avx2_next(BAND_ROW_NEXT_ARGS) {
    BAND_ROW_COPIES(BAND_ROW_NEXT, 64, avx2_step2, STEP_BAND, avx2_band_consts_of, avx2_band_group_of,
                    avx2_consts_of, avx2_group_of, __m256i, avx2_acc_max2, tabs[i_], &fixes[i_]);
}
#define HAVE_TAB_AVX2 1
#else
#define HAVE_TAB_AVX2 0
#define tab_run_avx2 NO_TAB_LOOP
#define band_row_avx2 NO_BAND_ROW
#define band_row_avx2_next NO_BAND_ROW_NEXT
#endif

/* tab_run with AVX-512 VBMI, 64 inputs per step in 17 vector instructions (16 in BAND_ROW): v as
 * tab_run_avx2's (packed with saturation and put back in input order by one qword permute), the
 * code v + steps_j[m] from a 128-byte table (vpermi2b indexes by m and ignores bit 7, E's lowest
 * bit), overflow by min, the sign by one ternary-logic OR. Same rules and result as tab_run (tests
 * compare both with the segment loop). Runs x0 + r * stride, r < rows, of n inputs; the inputs it
 * does not take by fix_lanes. */
#if defined(__x86_64__) && defined(__GNUC__) && defined(__AVX512BW__) /* the x86-64-v4 object alone: a
                                                                       * forced lower level runs as its CPUs do */
#define FP8REF_VBMI __attribute__((target("avx512f,avx512bw,avx512vbmi")))
#define FP8REF_BW __attribute__((target("avx512f,avx512bw")))
#define HAVE_TAB_BW 1
static int vbmi_ok = -1;

/* A 64-input step of the AVX-512 table loops: inputs [0, min(left, 64)) into (h0, h1), zero beyond;
 * the mask of those taken. Whole steps load without masks (their setup cost as much as the VBMI
 * loop's step: measured). `pf`: two lines of the prefetch plan (TAB_WALK), into L2 while this one
 * computes. */
FP8REF_BW static inline __mmask64 step_load(const uint16_t *x, int64_t left, const uint16_t *pf, __m512i *h0,
                                            __m512i *h1) {
    _mm_prefetch((const char *)pf, _MM_HINT_T1);
    _mm_prefetch((const char *)pf + 64, _MM_HINT_T1);
    if (left >= 64) {
        *h0 = _mm512_loadu_si512(x), *h1 = _mm512_loadu_si512(x + 32);
        return ~(__mmask64)0;
    }
    const __mmask32 m0 = left >= 32 ? ~(__mmask32)0 : (((__mmask32)1 << left) - 1);
    const __mmask32 m1 = left <= 32 ? 0 : (((__mmask32)1 << (left - 32)) - 1);
    *h0 = _mm512_maskz_loadu_epi16(m0, x), *h1 = _mm512_maskz_loadu_epi16(m1, x + 32);
    return ((__mmask64)1 << left) - 1;
}

/* v = (E - E_b) 2^M + j of the step's 64 inputs, a0 and a1 their magnitude bits << 1, packed with
 * saturation per 128-bit lane (packus's order): to [0, 255], or to [-128, 127] (STEP_ZEROS) */
FP8REF_BW static inline __m512i step_v(__m512i a0, __m512i a1, __m128i sh, __m512i ebm, int top) {
    const __m512i e0 = _mm512_srl_epi16(a0, sh), e1 = _mm512_srl_epi16(a1, sh);
    return top == STEP_ZEROS ? _mm512_packs_epi16(_mm512_sub_epi16(e0, ebm), _mm512_sub_epi16(e1, ebm))
                             : _mm512_packus_epi16(_mm512_subs_epu16(e0, ebm), _mm512_subs_epu16(e1, ebm));
}

/* its codes: streamed as a whole aligned line (the caller checked dst and dst_stride), else stored */
FP8REF_BW static inline void step_store(uint8_t *dst, int64_t left, int stream, __mmask64 all, __m512i c) {
    if (left < 64)
        _mm512_mask_storeu_epi8(dst, all, c);
    else if (stream)
        _mm512_stream_si512((__m512i *)dst, c);
    else
        _mm512_storeu_si512(dst, c);
}
/* the step's codes c (input order) with `lanes` by fix_lanes */
FP8REF_BW static inline __m512i step_fix(const uint16_t *x, __mmask64 lanes, __m512i c, const fix_ctx *f) {
    if (!lanes) return c;
    uint8_t tmp[64];
    _mm512_storeu_si512(tmp, c);
    fix_lanes(x, tmp, lanes, f);
    return _mm512_loadu_si512(tmp);
}
/* running maxima of the magnitude bits of the 64 inputs at p (BAND_ROW) */
FP8REF_BW static inline __m512i zmm_acc_max(__m512i acc, const uint16_t *p) {
    const __m512i mask = _mm512_set1_epi16(0x7FFF);
    return _mm512_max_epu16(acc, _mm512_max_epu16(_mm512_and_si512(_mm512_loadu_si512(p), mask),
                                                  _mm512_and_si512(_mm512_loadu_si512(p + 32), mask)));
}
#define EVEN8(i) (2 * (i)), (2 * (i) + 2), (2 * (i) + 4), (2 * (i) + 6), (2 * (i) + 8), (2 * (i) + 10), (2 * (i) + 12), (2 * (i) + 14)
static const uint8_t lo_bytes[64] = {EVEN8(0), EVEN8(8), EVEN8(16), EVEN8(24), EVEN8(32), EVEN8(40), EVEN8(48), EVEN8(56)};
typedef struct {
    __m512i tlo, thi, ebm, opv, zp, zn, s80, one, two, order, lo_idx, hi_idx, m128;
    __m128i sh;
} vbmi_consts;
FP8REF_VBMI static inline __attribute__((always_inline)) void vbmi_step(const uint16_t *x, uint8_t *dst,
                                                                        const uint16_t *pf, int64_t left, int stream,
                                                                        int top, const vbmi_consts *K, const fix_ctx *f) {
    __m512i h0, h1;
    const __mmask64 all = step_load(x, left, pf, &h0, &h1);
    const __m512i a0 = _mm512_add_epi16(h0, h0), a1 = _mm512_add_epi16(h1, h1); /* magnitude bits << 1 */
    const __m512i v = _mm512_permutexvar_epi64(K->order, step_v(a0, a1, K->sh, K->ebm, top)); /* in input order */
    const __m512i lob = _mm512_permutex2var_epi8(h0, K->lo_idx, h1), hib = _mm512_permutex2var_epi8(h0, K->hi_idx, h1);
    const __m512i y = _mm512_permutex2var_epi8(K->tlo, lob, K->thi);
    if (top == STEP_ZEROS) { /* v -128 (negative lanes 0, then the sign): +-0's codes; -127 to -1 by fix_lanes */
        const __mmask64 neg = _mm512_movepi8_mask(v);
        __m512i c = _mm512_maskz_min_epi8(~neg, _mm512_adds_epi8(v, y), K->opv);
        c = _mm512_ternarylogic_epi32(c, hib, K->s80, 0xF8); /* c | (hib & 0x80) */
        step_store(dst, left, stream, all, step_fix(x, _mm512_mask_cmpgt_epi8_mask(neg & all, v, K->m128), c, f));
        return;
    }
    __m512i c = _mm512_min_epu8(_mm512_adds_epu8(v, y), K->opv);
    c = _mm512_ternarylogic_epi32(c, hib, K->s80, 0xF8); /* c | (hib & 0x80) */
    __mmask64 slow = (top == STEP_TILE ? _mm512_cmplt_epu8_mask(_mm512_add_epi8(v, K->one), K->two) /* v = 0 or 255 */
                                       : _mm512_testn_epi8_mask(v, v)) & all;                        /* v = 0 */
    if (slow) { /* +-0 here; the rest by fix_lanes */
        const __mmask64 zero = (__mmask64)_mm512_testn_epi16_mask(a0, a0) |
                               (__mmask64)_mm512_testn_epi16_mask(a1, a1) << 32;
        const __mmask64 neg = _mm512_movepi8_mask(hib);
        c = _mm512_mask_blend_epi8(zero & ~neg, c, K->zp);
        c = _mm512_mask_blend_epi8(zero & neg, c, K->zn);
        c = step_fix(x, slow & ~zero, c, f);
    }
    step_store(dst, left, stream, all, c);
}
FP8REF_VBMI static inline __attribute__((always_inline)) vbmi_consts vbmi_consts_of(const bf16_tab *t) {
    const int M = t->shift;
    /* byte i of lo_idx: the low byte of 16-bit lane i of the pair (a, b); hi_idx: its high byte */
    const __m512i lo_idx = _mm512_loadu_si512(lo_bytes), one = _mm512_set1_epi8(1);
    return (vbmi_consts){
        .tlo = _mm512_loadu_si512(t->steps_j), .thi = _mm512_loadu_si512(t->steps_j + 64),
        .ebm = _mm512_set1_epi32((int)t->ebm2), .opv = _mm512_set1_epi8((char)t->ovf_p),
        .zp = _mm512_set1_epi8((char)t->zero_p), .zn = _mm512_set1_epi8((char)t->zero_n),
        .s80 = _mm512_set1_epi8((char)0x80), .one = one, .two = _mm512_set1_epi8(2),
        .order = _mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7), /* packus's qwords back in input order */
        .lo_idx = lo_idx, .hi_idx = _mm512_add_epi8(lo_idx, one), .m128 = _mm512_set1_epi8(-128),
        .sh = _mm_cvtsi32_si128(8 - M)};
}
FP8REF_VBMI static void tab_run_vbmi(const uint16_t *restrict x0, uint8_t *restrict dst0, int64_t n,
                                          int64_t rows, int64_t stride, int64_t dst_stride, const pf_plan *pf,
                                          int stream, int zeros, const bf16_tab *t, const fix_ctx *f) {
    const vbmi_consts K = vbmi_consts_of(t);
    if (!zeros) /* the common copy first (BAND_ROW_COPIES) */
        TAB_WALK(64, vbmi_step, stream, STEP_TILE, &K, f);
    else
        TAB_WALK(64, vbmi_step, stream, STEP_ZEROS, &K, f);
}
FP8REF_VBMI static inline __attribute__((always_inline)) void vbmi_group_of(vbmi_consts *K, const bf16_tab *t) {
    K->tlo = _mm512_loadu_si512(t->steps_j);
    K->thi = _mm512_loadu_si512(t->steps_j + 64);
    K->ebm = _mm512_set1_epi32((int)t->ebm2);
}
FP8REF_VBMI __attribute__((noinline)) static void band_row_vbmi(BAND_ROW_ARGS) {
    BAND_ROW_COPIES(BAND_ROW, 64, vbmi_step, STEP_BAND, vbmi_consts_of, vbmi_group_of, vbmi_consts_of, vbmi_group_of,
                    &fixes[i_]);
}
FP8REF_VBMI __attribute__((noinline)) static void band_row_vbmi_next(BAND_ROW_NEXT_ARGS) {
    BAND_ROW_COPIES(BAND_ROW_NEXT, 64, vbmi_step, STEP_TILE, vbmi_consts_of, vbmi_group_of, vbmi_consts_of,
                    vbmi_group_of, __m512i, zmm_acc_max, &fixes[i_]);
}

/* tab_run_avx2's rules in AVX-512BW, 64 inputs per step in 24 vector instructions (22 in band
 * rows, by the half windows), for the AVX-512 CPUs without VBMI (Skylake-SP, Cascade Lake): the
 * same v, l and sign packed per 128-bit lane, the three lookups per lane (the tables repeat in every
 * lane), the two compares as masks that add one each; one qword permute puts the codes back in input
 * order. Called as tab_run_vbmi. */
static const uint8_t pack_group[8] = {0, 4, 1, 5, 2, 6, 3, 7}; /* packed 8-input group g: inputs 8 pack_group[g].. */
/* a lane mask in packed order, in input order */
static inline uint64_t in_input_order(uint64_t packed) {
    uint64_t m = 0;
    for (int g = 0; packed && g < 8; g++) m |= ((packed >> (8 * g)) & 0xFFu) << (8 * pack_group[g]);
    return m;
}
typedef struct {
    __m512i wt, wb1, wb2, ebm, lmask, opv, zp, zn, s80, one, two, order, m128, low4;
    __m128i sh;
} bw_consts;
FP8REF_BW static inline __attribute__((always_inline)) void bw_step(const uint16_t *x, uint8_t *dst, const uint16_t *pf,
                                                                    int64_t left, int stream, int top, const bw_consts *K,
                                                                    const fix_ctx *f) {
    __m512i h0, h1;
    const __mmask64 all = step_load(x, left, pf, &h0, &h1);
    const __m512i a0 = _mm512_add_epi16(h0, h0), a1 = _mm512_add_epi16(h1, h1);
    const __m512i v = step_v(a0, a1, K->sh, K->ebm, top);
    const __m512i l = _mm512_packus_epi16(_mm512_and_si512(h0, K->lmask), _mm512_and_si512(h1, K->lmask));
    const __m512i sgn = _mm512_packs_epi16(h0, h1); /* bit 7: the input's sign */
    /* STEP_BAND: the half windows (bw_band_consts_of), one threshold each, looked up by v''s low four
     * bits (vpshufb gives 0 where bit 7 is set) */
    const __m512i j = top == STEP_BAND ? _mm512_and_si512(v, K->low4) : v;
    __m512i st = _mm512_shuffle_epi8(K->wt, j);
    st = _mm512_mask_add_epi8(st, _mm512_cmpgt_epi8_mask(l, _mm512_shuffle_epi8(K->wb1, j)), st, K->one);
    if (top != STEP_BAND)
        st = _mm512_mask_add_epi8(st, _mm512_cmpgt_epi8_mask(l, _mm512_shuffle_epi8(K->wb2, v)), st, K->one);
    uint64_t in_order = 0;
    if (top == STEP_ZEROS) { /* as vbmi_step's */
        const __mmask64 neg = _mm512_movepi8_mask(v), slow = _mm512_mask_cmpgt_epi8_mask(neg, v, K->m128);
        __m512i c = _mm512_maskz_min_epi8(~neg, _mm512_adds_epi8(v, st), K->opv);
        c = _mm512_ternarylogic_epi32(c, sgn, K->s80, 0xF8); /* c | (sgn & 0x80) */
        in_order = in_input_order(slow) & all;
        step_store(dst, left, stream, all, step_fix(x, in_order, _mm512_permutexvar_epi64(K->order, c), f));
        return;
    }
    /* STEP_BAND: no overflow, the caller checked (tab_no_overflow) */
    __m512i c = top == STEP_BAND ? _mm512_add_epi8(_mm512_avg_epu8(v, _mm512_setzero_si512()), st)
                                 : _mm512_min_epu8(_mm512_adds_epu8(v, st), K->opv);
    c = _mm512_ternarylogic_epi32(c, sgn, K->s80, 0xF8); /* c | (sgn & 0x80) */
    __mmask64 slow = top == STEP_TILE ? _mm512_cmplt_epu8_mask(_mm512_add_epi8(v, K->one), K->two) /* v = 0 or 255, packed order */
                                      : _mm512_testn_epi8_mask(v, v);                        /* v = 0 */
    if (slow) { /* +-0 here; the rest by fix_lanes, in input order */
        const __m512i z = _mm512_packs_epi16(_mm512_movm_epi16(_mm512_testn_epi16_mask(a0, a0)),
                                             _mm512_movm_epi16(_mm512_testn_epi16_mask(a1, a1)));
        const __mmask64 zm = _mm512_movepi8_mask(z), neg = _mm512_movepi8_mask(sgn);
        c = _mm512_mask_blend_epi8(zm & ~neg, c, K->zp);
        c = _mm512_mask_blend_epi8(zm & neg, c, K->zn);
        in_order = in_input_order(slow & ~zm) & all;
    }
    c = step_fix(x, in_order, _mm512_permutexvar_epi64(K->order, c), f);
    step_store(dst, left, stream, all, c);
}
FP8REF_BW static inline __attribute__((always_inline)) bw_consts bw_consts_of(const bf16_tab *t) {
    const int M = t->shift;
    return (bw_consts){
        .wt = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)t->win_t)),
        .wb1 = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)t->win_b1m1)),
        .wb2 = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)t->win_b2m1)),
        .ebm = _mm512_set1_epi32((int)t->ebm2), .lmask = _mm512_set1_epi16((short)((1 << (7 - M)) - 1)),
        .opv = _mm512_set1_epi8((char)t->ovf_p), .zp = _mm512_set1_epi8((char)t->zero_p),
        .zn = _mm512_set1_epi8((char)t->zero_n), .s80 = _mm512_set1_epi8((char)0x80),
        .one = _mm512_set1_epi8(1), .two = _mm512_set1_epi8(2),
        .order = _mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7), /* packed qwords back in input order */
        .m128 = _mm512_set1_epi8(-128), .low4 = _mm512_set1_epi8(15), .sh = _mm_cvtsi32_si128(8 - M)};
}
FP8REF_BW static void tab_run_bw(const uint16_t *restrict x0, uint8_t *restrict dst0, int64_t n, int64_t rows,
                                 int64_t stride, int64_t dst_stride, const pf_plan *pf, int stream, int zeros,
                                 const bf16_tab *t, const fix_ctx *f) {
    const bw_consts K = bw_consts_of(t);
    if (!zeros) /* the common copy first (BAND_ROW_COPIES) */
        TAB_WALK(64, bw_step, stream, STEP_TILE, &K, f);
    else
        TAB_WALK(64, bw_step, stream, STEP_ZEROS, &K, f);
}
FP8REF_BW static inline __attribute__((always_inline)) void bw_group_of(bw_consts *K, const bf16_tab *t) {
    K->wt = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)t->win_t));
    K->wb1 = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)t->win_b1m1));
    K->wb2 = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)t->win_b2m1));
    K->ebm = _mm512_set1_epi32((int)t->ebm2);
}
/* STEP_BAND's constants: the half windows (bf16_tab) */
FP8REF_BW static inline __attribute__((always_inline)) void bw_band_group_of(bw_consts *K, const bf16_tab *t) {
    K->wt = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)t->half_t));
    K->wb1 = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)t->half_bm1));
    K->ebm = _mm512_set1_epi32((int)t->ebmh);
}
FP8REF_BW static inline __attribute__((always_inline)) bw_consts bw_band_consts_of(const bf16_tab *t) {
    bw_consts K = bw_consts_of(t);
    bw_band_group_of(&K, t);
    K.lmask = _mm512_set1_epi16((short)((1 << (6 - t->shift)) - 1)), K.sh = _mm_cvtsi32_si128(7 - t->shift);
    return K;
}
FP8REF_BW __attribute__((noinline)) static void band_row_bw(BAND_ROW_ARGS) {
    BAND_ROW_COPIES(BAND_ROW, 64, bw_step, STEP_BAND, bw_band_consts_of, bw_band_group_of, bw_consts_of, bw_group_of,
                    &fixes[i_]);
}
FP8REF_BW __attribute__((noinline)) static void band_row_bw_next(BAND_ROW_NEXT_ARGS) {
    BAND_ROW_COPIES(BAND_ROW_NEXT, 64, bw_step, STEP_BAND, bw_band_consts_of, bw_band_group_of, bw_consts_of,
                    bw_group_of, __m512i, zmm_acc_max, &fixes[i_]);
}

/* FP8REF_NO_VBMI (read at each call, for the tests) runs the portable loop instead */
#define HAVE_VBMI() ((vbmi_ok >= 0 ? vbmi_ok : (vbmi_ok = __builtin_cpu_supports("avx512vbmi") && \
                                                           __builtin_cpu_supports("avx512bw"))) && \
                     !getenv("FP8REF_NO_VBMI"))
#else
#define HAVE_VBMI() 0
#define tab_run_vbmi NO_TAB_LOOP
#define HAVE_TAB_BW 0
#define tab_run_bw NO_TAB_LOOP
#define band_row_vbmi NO_BAND_ROW
#define band_row_bw NO_BAND_ROW
#define band_row_vbmi_next NO_BAND_ROW_NEXT
#define band_row_bw_next NO_BAND_ROW_NEXT
#endif

/* whether a task's table loop runs tab_run_vbmi (read once per task) */
#define TABLE_VBMI(kind, mode) ((kind) == BF16 && (mode) == RNE && HAVE_VBMI())

/* segment() over `rows` runs [lo, hi) + r * stride sharing one operand sv (of `count` elements in
 * all): bfloat16 inputs by the table where it applies (built on the first run of a new sv), else
 * the segment loop. The vector loops take up to TAB_CHUNK inputs per call (whole short runs, or
 * pieces of a long one; a whole tile where the codes stream straight from the loop) and the inputs
 * they do not take by fix_lanes. `copy`: the same bfloat16 inputs, row r at copy + r * (hi - lo) (a
 * tile gathered by its amax pass), for the vector loops to read instead of src; or NULL. */
FP8REF_INLINE void segment_tab(const void *src, uint8_t *restrict dst, int64_t lo, int64_t hi, int64_t rows,
                               int64_t stride, int64_t ahead, const uint16_t *copy, float sv, const consts *c,
                               bf16_tab *tab, int64_t count, int kind, int exact, int mode, int mul, int model,
                               uint32_t zbound) {
    const int vbmi = c->vbmi;
    int fresh = !tab_holds(tab, sv);
    if (kind == BF16 && mode == RNE && (fresh ? count >= TAB_MIN : tab->ok)) {
        if (fresh) tab_build(tab, sv, c, exact, mul, model);
        if (tab->ok) {
            int64_t n = hi - lo, piece = n < TAB_CHUNK ? n : TAB_CHUNK, words = (piece + 63) / 64;
            /* STEP_ZEROS (see there) where the caller asks (zbound: every input's magnitude bits at most
             * this, else above 0x7FFF), no input reaches v = 255, and +-0 code as 0x00 and 0x80 */
            const int zeros = zbound <= 0x7FFFu && tab_signed_zeros(tab) && tab_below_top(tab, zbound);
            /* streamed straight from the vector loops where every run starts on a line (pieces start
             * TAB_CHUNK apart), else by stream_copy from buf, whatever the offsets */
            const int direct = c->stream && ((uintptr_t)(dst + lo) & 63u) == 0 && (rows == 1 || (stride & 63) == 0);
            const int buffered = c->stream && !direct;
            /* runs per call: a 128x128 tile in one (buf holds TAB_CHUNK codes) */
            int64_t per = n <= TAB_CHUNK ? (buffered ? TAB_CHUNK / 64 / words : rows) : 1;
            const fix_ctx f = {sv, c, exact, mul, model};
            uint8_t buf[TAB_CHUNK + 64]; /* buffered: the piece's codes, run after run, then copied out */
            for (int64_t r0 = 0; r0 < rows; r0 += per) {
                int64_t nr = rows - r0 < per ? rows - r0 : per;
                for (int64_t k0 = 0; k0 < n; k0 += piece) {
                    int64_t len = n - k0 < piece ? n - k0 : piece, at = lo + r0 * stride + k0;
                    const uint16_t *x = (const uint16_t *)src + at, *pf = ahead ? x + ahead : NULL;
                    /* what the vector loops read: the copy where there is one (its rows n apart) */
                    const uint16_t *xv = copy ? copy + r0 * n + k0 : x;
                    const int64_t xs = copy ? n : stride;
                    if (!vbmi && HAVE_TAB_AVX2 && tab->fast) { /* the runs that fit in buf per call */
                        const int buffered2 = buffered && CAN_STREAM; /* else direct, or not streamed */
                        const int64_t grp = buffered2 ? TAB_CHUNK / len : nr;
                        for (int64_t r1 = 0; r1 < nr; r1 += grp) {
                            const int64_t g = nr - r1 < grp ? nr - r1 : grp, os = buffered2 ? len : stride;
                            uint8_t *og = buffered2 ? buf : dst + at + r1 * stride;
                            const pf_plan pp = {pf ? pf + r1 * stride : NULL, len, g, stride};
                            tab_run_avx2(xv + r1 * xs, og, len, g, xs, os, &pp, direct && CAN_STREAM, zeros, tab,
                                         &f);
                            for (int64_t r = 0; buffered2 && r < g; r++)
                                stream_copy(dst + at + (r1 + r) * stride, buf + r * len, len);
                        }
                        continue;
                    }
                    if (!tab->fast || (!vbmi && !HAVE_TAB_BW)) { /* through buf: the compiler's stores are
                                                                    * normal ones */
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
                    const pf_plan pp = {pf, len, nr, stride};
                    if (vbmi)
                        tab_run_vbmi(xv, out, len, nr, xs, os, &pp, direct, zeros, tab, &f);
                    else
                        tab_run_bw(xv, out, len, nr, xs, os, &pp, direct, zeros, tab, &f);
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

/* Whether band rows (and tiles under a bound) should take +-0 without a branch (STEP_ZEROS): where
 * `row` holds more than one in 4,096. Per channel, 512x8192 replayed, ns per input STEP_BAND /
 * STEP_ZEROS with a share of the inputs +-0 (Zen 4): x86-64-v3 none 0.105 / 0.108, 1 in 8,192
 * 0.106 / 0.108, in 4,096 0.109 / 0.108, in 2,048 0.111 / 0.108, in 256 0.149 / 0.108; VBMI none
 * 0.078 / 0.079, in 4,096 0.080 / 0.079, in 256 0.136 / 0.078; AVX-512BW never slower (0.102 /
 * 0.101 with none). FP8REF_BAND_ZEROS=0 or 1 forces the choice (tests). */
static int zeros_heavy(const uint16_t *row, int64_t n) {
    const char *force = getenv("FP8REF_BAND_ZEROS");
    if (force) return force[0] == '1';
    int64_t z = 0;
    for (int64_t k = 0; k < n; k++) z += (row[k] & 0x7FFFu) == 0;
    return z * 4096 > n;
}

/* A band row's tables: group i's operand fx[i].sv, its table built where new, into tp[i]. Whether
 * every group goes by band rows: its inputs' magnitude bits, at most bound[i * bstep], lie below its
 * table's top (STEP_BAND need not look for inputs past it; a NaN or Inf goes by tiles) and, where VBMI
 * does not run, below its half windows' top (tab_below_half_top) and code past no overflow
 * (tab_no_overflow), and its table's other constants agree with group 0's, which band_row_* keeps;
 * *zok: whether every table codes +-0 as STEP_ZEROS does. */
FP8REF_INLINE int band_tables(tab_cache *tabs, const consts *c, int64_t n, const uint16_t *bound, int64_t bstep,
                              const bf16_tab **tp, const fix_ctx *fx, int *zok) {
    for (int64_t i = 0; i < n; i++) {
        bf16_tab *t = tab_slot(tabs, fx[i].sv);
        if (!tab_holds(t, fx[i].sv)) tab_build(t, fx[i].sv, c, fx[i].exact, fx[i].mul, fx[i].model);
        tp[i] = t;
    }
    int ok = 1, z = 1;
    for (int64_t i = 0; i < n; i++) { /* a later group may have taken an earlier one's slot */
        const bf16_tab *t = tp[i], *t0 = tp[0];
        ok &= tab_holds(t, fx[i].sv) && t->ok && t->fast && t->shift == t0->shift && t->ovf_p == t0->ovf_p &&
              t->zero_p == t0->zero_p && t->zero_n == t0->zero_n && tab_below_top(t, bound[i * bstep]) &&
              (c->vbmi || (t->half && tab_below_half_top(t, bound[i * bstep]) && tab_no_overflow(t, bound[i * bstep])));
        z &= tab_signed_zeros(t);
    }
    *zok = z;
    return ok;
}
/* one band row (band_row_*'s arguments) by the loop this task runs */
FP8REF_INLINE void band_row_run(const consts *c, BAND_ROW_ARGS) {
    if (c->vbmi)
        band_row_vbmi(x, dst, ng, g, tabs, fixes, pf_off, stream, zeros);
    else if (HAVE_TAB_AVX2)
        band_row_avx2(x, dst, ng, g, tabs, fixes, pf_off, stream, zeros);
    else
        band_row_bw(x, dst, ng, g, tabs, fixes, pf_off, stream, zeros);
}

/* rows [r0, r1): row r's operands start at s[s_off[r]], one per g elements. Last row first: a
 * per-tensor quantize has just read the rows first to last for its amax (same split), so the
 * rows still in the last-level cache come first and only the rest is read from memory again (the
 * amax pass last row first and these rows first to last took 16.5 against 13.5 ms, 8192x8192 per
 * tensor, x86-64-v3, one thread). Where the caller gives the inputs' bound (quant_job.bound: per
 * tensor, the amax) and every group's table takes it (band_tables), a row goes by band rows:
 * bands_fused's loops, two steps to a branch, no test for inputs past the table, and without VBMI no
 * overflow rule. Against tiles, the C tasks replayed (8192-wide, ns per input) x86-64-v3 0.119 ->
 * 0.109, AVX-512BW 0.108 -> 0.101, VBMI 0.083 -> 0.077; whole calls, one thread, v3 13.9 -> 13.1 ms
 * (2026-12-06). BAND_ROW primes the pages ahead of a row, which here were the rows done before it:
 * priming in the rows' direction instead was no faster (v3 14.0 against 13.2 ms). */
FP8REF_INLINE void rows_given(const quant_job *j, int64_t r0, int64_t r1, int kind, int exact, int mode, int mul,
                              int model) {
    const consts c = consts_of(j, TABLE_VBMI(kind, mode));
    const int64_t ng = (j->K + j->g - 1) / j->g;
    tab_cache tabs;
    tab_cache_init(&tabs, j->tab_slots, (r1 - r0) * ng);
    /* the inputs' bound where the caller knows one and the task's first row holds many +-0 */
    const int zeros = kind == BF16 && j->bound <= 0x7FFFu && r1 > r0 &&
                      zeros_heavy((const uint16_t *)j->src + (r1 - 1) * j->K, j->K);
    const uint32_t zbound = zeros ? j->bound : 0xFFFFFFFFu;
    const int st = c.stream && CAN_STREAM && ((uintptr_t)j->dst & 63u) == 0;
    const int band = (HAVE_TAB_AVX2 || HAVE_TAB_BW) && kind == BF16 && mode == RNE && j->bound <= 0x7FFFu &&
                     j->g % 64 == 0 && j->g >= TAB_MIN && j->K % j->g == 0 && ng <= 64 && (st || !c.stream);
    const uint16_t bound = (uint16_t)j->bound;
    const bf16_tab *tp[64];
    fix_ctx fx[64];
    for (int64_t r = r1 - 1; r >= r0; r--) {
        const float *srow = j->s + j->s_off[r];
        if (band) {
            int zok;
            for (int64_t i = 0; i < ng; i++) fx[i] = (fix_ctx){srow[i], &c, exact, mul, model};
            if (band_tables(&tabs, &c, ng, &bound, 0, tp, fx, &zok)) { /* prefetching the row done next */
                band_row_run(&c, (const uint16_t *)j->src + r * j->K, j->dst + r * j->K, ng, j->g, tp, fx,
                             r > r0 ? -j->K : 0, st, zeros && zok);
                continue;
            }
        }
        for (int64_t k0 = 0; k0 < j->K; k0 += j->g) {
            int64_t k1 = k0 + j->g < j->K ? k0 + j->g : j->K;
            segment_tab(j->src, j->dst, r * j->K + k0, r * j->K + k1, 1, 0, -j->K, NULL, srow[k0 / j->g], &c,
                        tab_slot(&tabs, srow[k0 / j->g]), k1 - k0, kind, exact, mode, mul, model,
                        zbound); /* prefetching the row done next */
        }
    }
    tab_cache_free(&tabs);
}

/* amax_run16 with four running maxima (the one of the compiler's loop waits on each load in turn:
 * perf put a third of the fused loop's time there) */
FP8REF_INLINE uint16_t amax_row16(const uint16_t *restrict x, size_t n, uint16_t m) {
    size_t k = 0;
#if defined(__x86_64__) && defined(__GNUC__) && defined(__AVX2__)
    if (n >= 64) {
        const __m256i mask = _mm256_set1_epi16(0x7FFF);
        __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
        for (; k + 64 <= n; k += 64) {
            a0 = _mm256_max_epu16(a0, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + k)), mask));
            a1 = _mm256_max_epu16(a1, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + k + 16)), mask));
            a2 = _mm256_max_epu16(a2, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + k + 32)), mask));
            a3 = _mm256_max_epu16(a3, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + k + 48)), mask));
        }
        __m256i a = _mm256_max_epu16(_mm256_max_epu16(a0, a1), _mm256_max_epu16(a2, a3));
        __m128i h = _mm_max_epu16(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
        /* the max of eight: the min of their complements (phminposuw) */
        uint16_t top = (uint16_t)~_mm_cvtsi128_si32(_mm_minpos_epu16(_mm_xor_si128(h, _mm_set1_epi16(-1))));
        m = top > m ? top : m;
    }
#endif
    return amax_run16(x + k, n - k, m);
}

/* max magnitude bits of a tile of `rows` rows (stride `stride`) and 128 columns: the 128 running
 * maxima stay in vector registers; one reduction per tile instead of one per row. `copy` (or NULL):
 * the tile's inputs, rows 128 apart: its rows lie a power of two apart in x, so that they share a few
 * cache sets, and a second pass over x found most of them gone from L1 and half from L2 */
FP8REF_INLINE uint16_t amax_tile128(const uint16_t *restrict x, int64_t rows, int64_t stride,
                                    uint16_t *restrict copy) {
#if defined(__x86_64__) && defined(__GNUC__) && defined(__AVX2__)
    /* written out: the compiler kept the 128 maxima in memory, a load and a store per 16
     * inputs (perf: 80% of the fused loop's time on 128x128 blocks) */
    const __m256i mask = _mm256_set1_epi16(0x7FFF);
    __m256i a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_si256();
    for (int64_t r = 0; r < rows; r++)
#pragma GCC unroll 8 /* else -O2 keeps a[] in memory: a load, max and store per 16 inputs (perf) */
        for (int i = 0; i < 8; i++) {
            const __m256i h = _mm256_loadu_si256((const __m256i *)(x + r * stride) + i);
            if (copy) _mm256_store_si256((__m256i *)(copy + r * 128) + i, h);
            a[i] = _mm256_max_epu16(a[i], _mm256_and_si256(h, mask));
        }
    uint16_t acc[128];
    for (int i = 0; i < 8; i++) _mm256_storeu_si256((__m256i *)acc + i, a[i]);
    return amax_row16(acc, 128, 0);
#else
    uint16_t acc[128] = {0};
    for (int64_t r = 0; r < rows; r++)
        for (int k = 0; k < 128; k++) {
            uint16_t v = x[r * stride + k] & 0x7FFFu;
            acc[k] = v > acc[k] ? v : acc[k];
            if (copy) copy[r * 128 + k] = x[r * stride + k];
        }
    return amax_run16(acc, 128, 0);
#endif
}

FP8REF_INLINE uint16_t amax_rows16(const uint16_t *restrict x, int64_t rows, int64_t stride, int64_t n) {
    uint16_t m = 0;
    for (int64_t r = 0; r < rows; r++) m = amax_row16(x + r * stride, (size_t)n, m);
    return m;
}

/* a[i] = max magnitude bits of group i of `rows` rows (stride `stride`) of ng groups of g inputs at
 * x (g a multiple of 64): each group's running maxima in a vector over its row, kept in accs + 32 i
 * between rows, one reduction per group at the end (an amax_row16 per group and row reduced every
 * 128 inputs: 9.74 -> 9.39 ms for 8192x8192 128x128 blocks, one thread, AVX-512BW, measured) */
FP8REF_INLINE void amax_groups(const uint16_t *restrict x, int64_t rows, int64_t stride, int64_t ng, int64_t g,
                               uint16_t *restrict accs, uint16_t *restrict a) {
    memset(accs, 0, sizeof(uint16_t) * 32 * (size_t)ng);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < ng; i++) {
            const uint16_t *p = x + r * stride + i * g;
            uint16_t *acc = accs + 32 * i;
#if defined(__x86_64__) && defined(__GNUC__) && defined(__AVX2__)
            __m256i m = _mm256_load_si256((const __m256i *)acc);
            for (int64_t k = 0; k < g; k += 32) m = avx2_acc_max(m, p + k);
            _mm256_store_si256((__m256i *)acc, m);
#else
            for (int64_t k = 0; k < g; k++) {
                const uint16_t v = p[k] & 0x7FFFu;
                acc[k % 32] = v > acc[k % 32] ? v : acc[k % 32];
            }
#endif
        }
    for (int64_t i = 0; i < ng; i++) a[i] = amax_row16(accs + 32 * i, 32, 0);
}

/* band b's rows [lo, hi): rows [b*bh, b*bh + bh) of matrix b / nbr (nbr bands each), cut at its r2 rows */
FP8REF_INLINE void band_span(const quant_job *j, int64_t nbr, int64_t b, int64_t *lo, int64_t *hi) {
    const int64_t m = b / nbr, r = b % nbr * j->bh;
    *lo = m * j->r2 + r, *hi = m * j->r2 + (r + j->bh < j->r2 ? r + j->bh : j->r2);
}
/* A unit of bands_fused and the next one, both in the caches: a channel of up to 32,768 bfloat16 inputs.
 * Per channel, one thread, Zen 4, A/B in one process, band rows without -> with the next unit's read:
 * rows of 16 KiB 8.06 -> 7.50 ms, of 64 KiB 8.03 -> 7.56, of 256 KiB the same; 128x128 blocks (2 MiB)
 * 20% slower with it (9.35 -> 11.20 ms). */
enum { FUSE_BYTES = 64 * 1024 };

/* A unit's groups: amaxes, the next unit's running maxima (32 per group), tables and fix-up contexts;
 * 64 on the stack, more on the heap (unit_groups_grow). Band rows of blocks take a whole band as one
 * unit, up to UNIT_GROUPS groups (128x128 blocks: K up to 65,536). In units of 64 groups a band
 * wider than 8,192 was read in pieces of its rows; whole bands, x86-64-v3, one thread, whole calls:
 * 4096x11008 9.66 -> 6.26 ms, 4096x14336 10.80 -> 8.28, 2048x28672 11.42 -> 10.07 (two units of
 * 112 groups, another run: 12.03 against 10.22); AVX-512BW 8.78 -> 6.03, 9.71 -> 7.61, 10.30 ->
 * 9.47; 8,192 wide the same. */
enum { UNIT_GROUPS = 512 };
typedef struct {
    uint16_t *a, *accs;
    const bf16_tab **tp;
    fix_ctx *fx;
    int64_t cap;
    void *heap;
} unit_groups;
/* room for n groups on the heap; where the allocation fails, the 64 on the stack stay */
static void unit_groups_grow(unit_groups *u, int64_t n) {
    const size_t accs_b = (size_t)n * 32 * sizeof(uint16_t), tp_b = (size_t)n * sizeof(const bf16_tab *);
    const size_t fx_b = (size_t)n * sizeof(fix_ctx), a_b = (size_t)n * sizeof(uint16_t);
    char *raw = malloc(accs_b + tp_b + fx_b + a_b + 64);
    if (!raw) return;
    char *p = raw + (-(uintptr_t)raw & 63u); /* accs: aligned loads */
    u->accs = (uint16_t *)p, u->tp = (const bf16_tab **)(p + accs_b), u->fx = (fix_ctx *)(p + accs_b + tp_b);
    u->a = (uint16_t *)(p + accs_b + tp_b + fx_b), u->cap = n, u->heap = raw;
}

/* bands [b0, b1): band b is rows [b*bh, b*bh + bh) of matrix b / nbr (cut at r2); per group of g
 * columns: amax over the tile, its operand from the table, then the tile's codes */
FP8REF_INLINE void bands_fused(const quant_job *j, int64_t b0, int64_t b1, int kind, int exact, int mode, int mul,
                               int model) {
    const consts c = consts_of(j, TABLE_VBMI(kind, mode));
    const uint16_t *x = j->src;
    uint16_t tile[128 * 128] __attribute__((aligned(64)));
    int have = 0; /* a holds this unit's amaxes: read by the unit before it (band rows) */
    int64_t nbr = (j->r2 + j->bh - 1) / j->bh, ng = (j->K + j->g - 1) / j->g, not_final = 0;
    tab_cache tabs;
    tab_cache_init(&tabs, j->tab_slots, (b1 - b0) * ng);
    /* Band rows stream their own codes into aligned rows (st), or store them. Codes to stream that start
     * off a line (numpy's out=) go row by row through rowbuf and stream_copy, which streams the whole
     * lines and stores the two partial ones (each shared with the row beside it). 8192x8192 into an
     * out= 16 bytes into a line, A/B in one process, tiles (streamed through their own buffer) ->
     * rowbuf, ms: blocks x86-64-v3 one thread 24.3 -> 10.1, two 13.4 -> 6.9, VBMI two 12.7 -> 6.3;
     * channels v3 11.5 -> 8.3 and 5.8 -> 5.4, VBMI 9.2 -> 8.3 and 6.2 -> 5.8. */
    const int aligned = ((uintptr_t)j->dst & 63u) == 0, st = c.stream && CAN_STREAM && aligned;
    const int band = (HAVE_TAB_AVX2 || HAVE_TAB_BW) && kind == BF16 && mode == RNE && j->g % 64 == 0 &&
                     j->K % j->g == 0 && j->K % 64 == 0;
    uint8_t *rowbuf = band && c.stream && CAN_STREAM && !st ? aligned_alloc(64, (size_t)j->K) : NULL;
    int64_t lo0 = 0, hi0 = 0;
    if (band && b0 < b1) band_span(j, nbr, b0, &lo0, &hi0);
    const int zeros = band && b0 < b1 && zeros_heavy(x + lo0 * j->K, j->K); /* STEP_ZEROS where the tables allow */
    uint16_t a_s[64], accs_s[64 * 32] __attribute__((aligned(64)));
    const bf16_tab *tp_s[64];
    fix_ctx fx_s[64];
    unit_groups u = {a_s, accs_s, tp_s, fx_s, 64, NULL};
    if (band && j->bh > 1 && ng > 64) unit_groups_grow(&u, ng < UNIT_GROUPS ? ng : UNIT_GROUPS);
    uint16_t *restrict const a = u.a, *restrict const accs = u.accs; /* a unit's amaxes; the next one's maxima */
    const bf16_tab **restrict const tp = u.tp;
    fix_ctx *restrict const fx = u.fx;
    for (int64_t b = b0; b < b1; b++) {
        int64_t lo, hi;
        band_span(j, nbr, b, &lo, &hi);
        /* units: a run of groups of the band. Tiles in runs of TILE_RUN_BYTES of input: their amaxes (row
         * by row, each row's piece read in one sweep, or tile by tile for 128-wide tiles), then their codes
         * while the run is in cache; while a run's codes are computed, the next run's input is prefetched
         * into L2 (`ahead` elements on).
         * Band rows instead, where the vector loops take whole lines (bfloat16, RNE, g and K multiples
         * of 64): a band's groups at once (unit_groups; a channel: one row), the codes row by row, each
         * row through every group's table (band_row_*), streamed or stored (st, rowbuf above). The unit's amaxes come first: read
         * by the unit before it while that one's codes were computed (BAND_ROW_NEXT; units up to FUSE_BYTES),
         * or else in a pass of their own (amax_groups; the task's first unit, 128x128 blocks), the unit
         * then read again from the caches (2 MiB for 128x128 blocks: 128 rows of 8,192 inputs) while
         * the next unit is prefetched into L2. Rows keep the reads and the streamed codes sequential;
         * tiles walk 128 pages at once. 8192x8192 128x128 blocks, whole calls after a copy_, A/B in one
         * process (Zen 4), tiles -> band rows: one thread v3 10.78 -> 10.00 ms, BW 10.53 -> 10.00, VBMI
         * 8.34 -> 8.33; two threads v3 6.08 -> 5.85, BW 6.23 -> 6.17, VBMI 6.69 -> 6.17. */
        int64_t run = band ? ng : j->bh > 1 ? (TILE_RUN_BYTES / 2 / (hi - lo) / j->g) : 1;
        run = run < 1 ? 1 : run > u.cap ? u.cap : run;
        for (int64_t j0 = 0; j0 < ng; j0 += run) {
            int64_t j1 = j0 + run < ng ? j0 + run : ng;
            /* the next run's, or at the band's end the next band's first run (rows hi.., column 0) */
            const int64_t ahead = j1 < ng ? run * j->g : (hi - lo) * j->K - j0 * j->g;
            /* a whole 128x128 (or shorter) bfloat16 tile, one per run: gathered by its amax pass for
             * the table loops (8192x8192 blocks, 2 threads: VBMI 6.5-6.9 -> 5.4-5.5 ms, x86-64-v3
             * 6.8-7.2 -> 6.2-6.6 ms: measured) */
            const int gather = !band && kind == BF16 && j->g == 128 && run == 1 && hi - lo > 1 && hi - lo <= 128 &&
                               j0 * 128 + 128 <= j->K;
            if (!have) {
                memset(a, 0, sizeof(uint16_t) * (size_t)(j1 - j0));
                if (band)
                    amax_groups(x + lo * j->K + j0 * j->g, hi - lo, j->K, j1 - j0, j->g, accs, a);
                else if (j->g == 128 && hi - lo > 1)
                    for (int64_t jg = j0; jg < j1; jg++) {
                        int64_t k0 = jg * j->g;
                        a[jg - j0] = k0 + 128 <= j->K
                                         ? amax_tile128(x + lo * j->K + k0, hi - lo, j->K, gather ? tile : NULL)
                                         : amax_rows16(x + lo * j->K + k0, hi - lo, j->K, j->K - k0);
                    }
                else
                    for (int64_t r = lo; r < hi; r++)
                        for (int64_t jg = j0; jg < j1; jg++) {
                            int64_t k0 = jg * j->g, k1 = k0 + j->g < j->K ? k0 + j->g : j->K;
                            a[jg - j0] = amax_row16(x + r * j->K + k0, (size_t)(k1 - k0), a[jg - j0]);
                        }
            }
            have = 0;
            if (j->amax)
                for (int64_t jg = j0; jg < j1; jg++) j->amax[b * ng + jg] = a[jg - j0];
            if (j->stored) /* the scales and the test quant.py made with its tables (_operand_table) */
                for (int64_t jg = j0; jg < j1; jg++) {
                    j->scale[b * ng + jg] = j->stored[a[jg - j0]];
                    not_final += !j->final[a[jg - j0]];
                }
            if (band) { /* every group's table, built where new; the band row by row if all hold */
                int zok;
                for (int64_t jg = j0; jg < j1; jg++) fx[jg - j0] = (fix_ctx){j->table[a[jg - j0]], &c, exact, mul, model};
                /* each group's amax bounds its inputs */
                if (band_tables(&tabs, &c, j1 - j0, a, 1, tp, fx, &zok)) {
                    zok &= zeros;
                    /* the next unit (the band's next run, or the next band's first: row r - lo of it
                     * `ahead` inputs from row r's first here), read for its amaxes while this one's
                     * codes are computed where this task has it, it has this unit's shape and both
                     * fit in the caches together (FUSE_BYTES) */
                    int64_t nlo = 0, nhi = 0;
                    if (b + 1 < b1) band_span(j, nbr, b + 1, &nlo, &nhi);
                    /* run <= ng: every run but a band's last has run groups, the next band's first too */
                    have = (hi - lo) * (j1 - j0) * j->g * 2 <= FUSE_BYTES && j1 - j0 == run &&
                           (j1 < ng ? j1 + run <= ng : b + 1 < b1 && nhi - nlo == hi - lo);
                    if (have) memset(accs, 0, sizeof(uint16_t) * 32 * (size_t)run);
                    for (int64_t r = lo; r < hi; r++) {
                        const uint16_t *xr = x + r * j->K + j0 * j->g, *nx = have ? xr + ahead : NULL;
                        const int64_t pf_off = have ? ahead + j->K : ahead; /* the next unit's next row, or its row */
                        uint8_t *const dr0 = j->dst + r * j->K + j0 * j->g, *dr = rowbuf ? rowbuf : dr0;
                        if (c.vbmi && nx)
                            band_row_vbmi_next(xr, dr, j1 - j0, j->g, tp, fx, pf_off, st, zok, nx, accs);
                        else if (HAVE_TAB_AVX2 && nx)
                            band_row_avx2_next(xr, dr, j1 - j0, j->g, tp, fx, pf_off, st, zok, nx, accs);
                        else if (nx)
                            band_row_bw_next(xr, dr, j1 - j0, j->g, tp, fx, pf_off, st, zok, nx, accs);
                        else
                            band_row_run(&c, xr, dr, j1 - j0, j->g, tp, fx, pf_off, st, zok);
                        if (rowbuf) {
                            for (int64_t k = 0; k < (j1 - j0) * j->g; k += 4096) /* as BAND_ROW primes its codes */
                                __builtin_prefetch(dr0 + k + PAGE_AHEAD, 0, 0);
                            stream_copy(dr0, rowbuf, (j1 - j0) * j->g);
                        }
                    }
                    for (int64_t jg = 0; have && jg < run; jg++) a[jg] = amax_row16(accs + 32 * jg, 32, 0);
                    continue;
                }
            }
            for (int64_t jg = j0; jg < j1; jg++) {
                int64_t k0 = jg * j->g, k1 = k0 + j->g < j->K ? k0 + j->g : j->K;
                float sv = j->table[a[jg - j0]];
                segment_tab(j->src, j->dst, lo * j->K + k0, lo * j->K + k1, hi - lo, j->K, ahead,
                            gather ? tile : NULL, sv, &c, tab_slot(&tabs, sv),
                            (hi - lo) * (k1 - k0), kind, exact, mode, mul, model, 0xFFFFFFFFu);
            }
        }
    }
    free(u.heap);
    free(rowbuf);
    tab_cache_free(&tabs);
    if (not_final) __atomic_fetch_add(&((quant_job *)j)->not_final, not_final, __ATOMIC_RELAXED);
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
AMAX_KERNEL(fp8ref_amax_u16, uint16_t, amax_row16)
AMAX_KERNEL(fp8ref_amax_u32, uint32_t, amax_run32)
