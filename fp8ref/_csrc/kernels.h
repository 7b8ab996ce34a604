/* The C ABI of fp8ref's loops (the .c files of fp8ref/_csrc), declared once. fp8ref/_native.py mirrors every
 * struct below with a ctypes.Structure and compares it field by field (name, offset, size: the table
 * fp8ref_layout() of module.c, from offsetof) and by sizeof when it loads the library: a mismatch
 * refuses the kernels (the numpy paths run) with a warning.
 *
 * Every parallel loop is a task `void f(const void *args, size_t lo, size_t hi)` over [lo, hi) of
 * its own unit (elements, rows, bands, column cuts); fp8ref_parallel (or _native's thread-pool
 * fallback) splits [0, n) into tasks. Units are independent, so the bytes never depend on the split.
 */
#ifndef FP8REF_KERNELS_H
#define FP8REF_KERNELS_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef void (*fp8ref_task)(const void *args, size_t lo, size_t hi);

/* ---- the ABI structs --------------------------------------------------------------------------- */
typedef struct { /* codec._EncParams: everything format/mode/sign dependent, precomputed by codec.py */
    int32_t M, emin, bias, mode;
    uint32_t maxmag, signbit;
    uint32_t nan_pos, nan_neg, inf_pos, inf_neg, ovf_pos, ovf_neg, zero_neg;
} enc_params;

typedef struct { /* codec._RneParams: the round-to-nearest-even float32 fast path */
    uint32_t S, H, B, emin_bits, magic_bits, maxmag, signbit;
    uint32_t nan_pos, nan_neg, inf_pos, inf_neg, ovf_pos, ovf_neg, zero_neg;
} rne_params;

typedef struct { /* an elementwise loop: dst[i] = f(src[i]) for i in [lo, hi) */
    const void *src;
    void *dst;
    const void *arg; /* enc_params, rne_params or a lookup table */
} ew_job;

typedef struct { /* out[r, j] = max magnitude bits over row r's elements [j*g, (j+1)*g), rows [lo, hi) */
    const void *src;
    void *out;
    int64_t K, g;
} amax_job;

typedef struct { /* quant._QuantJob */
    const void *src;
    uint8_t *dst;
    const float *s;       /* given scale operands; row r's start at s[s_off[r]] */
    const int64_t *s_off;
    const float *table;   /* fused: the operand for each 15-bit amax pattern */
    uint16_t *amax;       /* fused: the amax bits found, one per (band, group), or NULL */
    const enc_params *p;
    const rne_params *rne; /* or NULL: the round-to-nearest-even fast path, where it applies */
    int64_t K, g;         /* row length; elements per operand along the row */
    int64_t r2, bh;       /* fused: rows per matrix, rows per band (block height; 1 otherwise) */
    int32_t kind;         /* 0 bfloat16, 1 float16, 2 float32 (bit patterns) */
    int32_t exact;        /* 1: the exact quotient x/s rounded once ('fp8ref' recipe) */
    int32_t op;           /* not exact: 0 x / s, 1 x * s */
    int32_t model;        /* not exact: 0 none, 1 round to bfloat16, 2 round to float16 */
    int32_t cast16;       /* not exact: round the (float16) input to bfloat16 first */
    float addend;         /* +0.0f turns -0 into +0 (add_zero); -0.0f changes nothing */
    float clampv;         /* clamp to +-clampv (+inf: no clamp); NaN passes */
    uint32_t neg0;        /* code replaced by 0 (0x100: none) */
    int32_t stream;       /* codes too large for the cache: written around it (whole aligned lines) */
    uint32_t tab_slots;   /* slots of a task's table cache, a power of two up to 65,536; 0: twice the
                           * task's operands, 8 to 1,024 (tests take others: 1 is what a failed
                           * allocation leaves) */
    uint32_t bound;       /* the inputs' largest magnitude bits where the caller knows them (bfloat16,
                           * its amax found from them), else 0xFFFFFFFF: rows_given's STEP_ZEROS */
    const float *stored;  /* fused: the stored scale of each 15-bit amax pattern, or NULL (amax bits only) */
    const uint8_t *final; /* fused, with stored: 1 where the codes coded with that amax's operand are final */
    float *scale;         /* fused, with stored: out, each (band, group)'s stored scale, beside its amax bits */
    int64_t not_final;    /* fused, with stored: out, the (band, group)s whose amax is not final (added
                           * atomically: tasks run in parallel) */
} quant_job;

typedef struct { /* the declared-order fp32 GEMM, see matmul.c; tasks are column cuts */
    const void *A, *B;
    const float *tab_a, *tab_b, *sa, *sb;
    float *total, *part, *scratch;
    size_t M, K, N, L, bk, KB;
    size_t step;           /* columns per cut (whole register panels) */
    size_t scratch_stride; /* floats of scratch per cut */
    size_t fused;
} mm_job;

typedef struct { /* fp8ref.hardware.native: an instruction chained over K (hw.c); tasks are
                  * (batch, column chunk) units */
    const uint8_t *A, *B;    /* codes (batch, M, K), (batch, K, N) */
    const uint8_t *SA, *SB;  /* block-scale codes (batch, M, K / block), (batch, K / block, N), or NULL */
    const float *va, *vb;    /* fp32 value per code (NaN/Inf codes: 0) */
    const int16_t *xa, *xb, *xs; /* alignment exponent per code (zero: -4096); xs: scale exponents */
    const int16_t *ss;       /* grouped: scale significand per code (0: a zero scale) */
    const int16_t *ia, *ib;  /* grouped: value per code in units of 2**(emin - mantissa bits) of its format */
    const uint8_t *fa, *fb, *fs; /* per code: 0 finite, 1 NaN/Inf, 2 not a code of the format */
    const float *psa, *psb;  /* promotion scales (M, np), (np, N) float32, or NULL */
    float *D;                /* (batch, M, N): C in, the tensor-core accumulator out */
    float *acc;              /* (batch, M, N) FP32 promotion accumulator, or NULL (no promotion) */
    size_t M, N, K, L, chunks;
    size_t promote, np;      /* steps per promotion (0: only after the last), promotion blocks */
    size_t G, block;         /* grouped: products per group, K elements per block scale */
    int64_t F, out_bits, e_zero, zero_in, fma; /* pairwise: out_bits is F2 */
    int64_t unit, smb;       /* grouped: exponent of a product's last bit, scale mantissa bits */
    int64_t f16;             /* fused: C and D hold float16 values, normalised to nearest-even f16 */
    int64_t bad;             /* out: flags of the codes and C read (1: NaN/Inf, 2: not a code) */
} hw_job;

#define HW_NB 128          /* columns per unit of the hardware loops (native.py's _NB) */
#define HW_ZERO (-4096)    /* int16 alignment exponent of a zero operand (native.py builds the tables) */

typedef struct { /* hw_avx512.c: the fused loop's tables, built once a call (fp8ref_hw_fast_prepare) */
    float ma[128], mb[128];     /* |value| per code & 0x7f */
    int8_t xa8[128], xb8[128];  /* alignment exponent per code & 0x7f, int8 (zero: -64) */
    int32_t lo_real;            /* the smallest exponent sum of two nonzero operands */
} hw_fast;
int fp8ref_hw_fast_prepare(const hw_job *j, hw_fast *t);         /* 1: the CPU and the job fit the loop */
int fp8ref_hw_fused_fast(const hw_job *j, const hw_fast *t, size_t u); /* the flags; -1: a large C, not run */

typedef struct { /* the operand staging of the exact fast path (exact.c): row r, column c < cols
                  * of the codes -> v = lut[code] (* scale), rows [unit * lo, unit * hi) */
    const uint8_t *src;
    double *dst;
    const float *lut;     /* 256 values (exact in float32); NaN for the codes the caller must not use */
    uint8_t *flags;       /* per row: 1 when the row holds a NaN value */
    const double *scale;  /* NULL, or v *= scale[(r / s_rb) * s_rs + c / s_cb] */
    double *norm2;        /* NULL, or norm2[(r / n_rb) * n_rs + c / n_cb] += v * v */
    int64_t src_rs, src_cs, dst_rs, rows, cols, unit;
    int64_t s_rs, s_rb, s_cb, n_rs, n_rb, n_cb;
    int64_t stream;       /* 1: rows starting on a cache line are written around the cache (dst too large to stay there) */
} dec_job;

typedef struct { /* the exact epilogue (exact.c): out[m, n] from t[m, n], rows [lo, hi) */
    const double *t;      /* M x N, row stride ldt: exact sums (mode 0) or the float64 GEMM y (mode 1) */
    double *out;          /* M x N contiguous (may be t itself when ldt == N) */
    uint8_t *unsure;      /* M x N: 1 where the caller must decide exactly */
    const double *sa, *sb; /* mode 0: scale sa[m * sa_s] * sb[n * sb_s] (exact: two float32 values) */
    const double *bias;   /* N finite values, or NULL */
    const double *norm;   /* mode 1: M x N, the Cauchy-Schwarz bound of sum |a'b'| (row stride N) */
    double slack, max;    /* mode 1: |y - x| <= slack * (norm + |bias|); out's largest finite value */
    int64_t M, N, ldt, sa_s, sb_s, mode, precision, emin;
    int64_t parts, part_stride; /* mode 1: y = sum of `parts` arrays t + g * part_stride (in g order), + bias */
} epi_job;

typedef struct { /* exact K-block sums of chosen elements (exact.c); tasks are ranges of e */
    const uint8_t *a, *aT, *b; /* a (M x K) row-major, its transpose (K x M) (b_cs == 1 only), b codes */
    const double *va, *vb;     /* value per code (256 each) */
    const int64_t *mi, *ni;    /* element e is (mi[e], ni[e]) */
    double *sums;              /* (ceil(K / bk), E) */
    int64_t M, K, E, bk, b_rs, b_cs;
} bsum_job;

typedef struct { /* t[b, m, n] = sum_(k in K-block b) a[m, k] * lut[w[n, k]] (exact.c): the exact fast
                  * path's product for a few rows of a, each weight code looked up as it is read (no
                  * float64 copy of w); tasks are ranges of n */
    const double *a;      /* M x K values, row-major */
    const uint8_t *w;     /* N x K codes, row stride w_rs, columns contiguous */
    const float *lut;     /* 256 values (exact in float32); NaN for the codes the caller must not use */
    double *t;            /* ceil(K / bk) x M x N, row-major (one block: M x N) */
    uint8_t *flags;       /* per n: 1 when row n of w holds a NaN value */
    int64_t M, K, N, w_rs;
    int64_t sym;          /* 1: lut[c | 0x80] is lut[c] with its sign flipped (c < 128): 128 entries looked up */
    int64_t bk;           /* K-block length whose sums are kept apart (block-scaled weights); 0: all of K */
} dot_job;
#define DOT_MAX_M 8 /* rows of a per call (the accumulators stay in registers) */

/* ---- shared helpers ----------------------------------------------------------------------------- */
enum { RNE = 0, RNA = 1, RTZ = 2, RUP = 3, RDOWN = 4, RTO = 5 };
enum { BF16 = 0, F16 = 1, F32 = 2 };

/* The per-ISA files (codec.c, quant.c, hw.c: the hot loops) are compiled once per instruction-set
 * level, with that level's -march and -DFP8REF_ISA=<suffix> (setup.py: x86_64_v4, x86_64_v3, x86_64 on
 * x86-64; generic elsewhere). FP8REF_TASK(f) names a loop f_<suffix> there, so the objects link side
 * by side; _native.py binds f to the best level this CPU runs (FP8REF_ISA forces one, docs/build.md).
 * Every other file is compiled once and picks its AVX-512 paths at run time. */
#define FP8REF_CAT_(a, b) a##_##b
#define FP8REF_CAT(a, b) FP8REF_CAT_(a, b)
#ifdef FP8REF_ISA
#define FP8REF_TASK(f) FP8REF_CAT(f, FP8REF_ISA)
#else
#define FP8REF_TASK(f) f
#endif
#define FP8REF_INLINE static inline __attribute__((always_inline))

/* Branch-free so that compilers vectorize it: SEL(c, a, b) is c ? a : b for c in {0, 1}. */
#define SEL(c, a, b) ((b) ^ (((a) ^ (b)) & (0u - (uint32_t)(c))))

FP8REF_INLINE float f32_of(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
FP8REF_INLINE uint32_t bits_of(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
FP8REF_INLINE uint64_t bits64_of(double d) { uint64_t u; memcpy(&u, &d, 8); return u; }

/* The d values of row m go into the FP32 accumulator; d restarts at +0 (both fused loops). */
FP8REF_INLINE void promote_row(const hw_job *j, size_t m, size_t p, size_t j0, size_t w, float *restrict d,
                               float *restrict acc) {
    const float *sa = j->psa ? j->psa + m * j->np : NULL;
    const float *sb = j->psb ? j->psb + p * j->N + j0 : NULL;
    for (size_t c = 0; c < w; c++) {
        const float s = sa ? sa[p] * sb[c] : 1.0f;
        acc[c] = j->fma ? fmaf(d[c], s, acc[c]) : acc[c] + d[c] * s;
        d[c] = 0.0f;
    }
}

/* The code of a rounded magnitude `mag` (exponent field << M | mantissa) with sign s: zero,
 * overflow and the NaN/Inf input classes take the codes the caller precomputed in P. */
#define ENCODE_TAIL(P, mag, s, is_special, is_nan)                                              \
    ({                                                                                          \
        uint32_t c_ = (uint32_t)(mag) | ((0u - (uint32_t)(s)) & (P)->signbit);                   \
        c_ = SEL((mag) == 0, SEL(s, (P)->zero_neg, 0u), c_);                                    \
        c_ = SEL((mag) > (P)->maxmag, SEL(s, (P)->ovf_neg, (P)->ovf_pos), c_);                  \
        uint32_t sp_ = SEL(is_nan, SEL(s, (P)->nan_neg, (P)->nan_pos), SEL(s, (P)->inf_neg, (P)->inf_pos)); \
        SEL(is_special, sp_, c_);                                                               \
    })

/* The encode core, written once for both input widths: an IEEE binary value's bits u (W bits,
 * MB mantissa bits, exponent bias EB) -> code, rounded in `mode`; `finite` != 0 promises no NaN/Inf
 * input (the exact quotient) and drops their test. Both are constants after inlining, so each
 * caller's loop is specialized and vectorized. The dropped bits are tested left-aligned in `frac`
 * (gcc 12 vectorizes variable shifts of data, not of constants). float32 inputs use W = 32; the
 * exact quotient of quant_exact is a double (W = 64): 32-bit lanes vectorize twice as wide, and
 * float32 is the codec's hot path, so both widths are instantiated from this one definition. */
#define DEFINE_ENCODE(NAME, U, I, W, MB, EB)                                                    \
    FP8REF_INLINE uint32_t NAME(U u, const enc_params *p, int mode, int finite) {                           \
        U s = u >> (W - 1), a = u & ~((U)1 << (W - 1));                                         \
        I E = (I)(a >> MB);                                                                     \
        U mant = a & (((U)1 << MB) - 1u);                                                       \
        U sig = mant | ((U)(E != 0) << MB);                                                     \
        I e = E + (E == 0) - EB;                                                                \
        I below = p->emin - e;                                                                  \
        below = below > 0 ? below : 0;                                                          \
        I shift = MB - p->M + below;                                                            \
        shift = shift < W - 1 ? shift : W - 1;                                                  \
        U q = sig >> shift;                                                                     \
        U frac = sig << (W - shift); /* the dropped bits, left-aligned (shift >= 1) */          \
        const U half = (U)1 << (W - 1);                                                         \
        U up = mode == RNE     ? (U)((frac > half) | ((frac == half) & q))                      \
               : mode == RNA   ? (U)(frac >= half)                                              \
               : mode == RTZ   ? (U)0                                                           \
               : mode == RUP   ? (U)((frac != 0) & (s ^ 1u))                                    \
               : mode == RDOWN ? (U)((frac != 0) & s)                                           \
                               : (U)((frac != 0) & ~q & 1u); /* RTO */                          \
        q += up;                                                                                \
        I ebase = (e > p->emin ? e : p->emin) + p->bias - 1;                                    \
        U mag = ((U)ebase << p->M) + q;                                                         \
        return ENCODE_TAIL(p, mag, s, !finite && E == (I)((1u << (W - 1 - MB)) - 1u), mant != 0); \
    }

DEFINE_ENCODE(encode_bits32, uint32_t, int32_t, 32, 23, 127)
DEFINE_ENCODE(encode_bits64, uint64_t, int64_t, 64, 52, 1023)

/* Round-to-nearest-even fast path of float32 bits u (the common case; a different method from
 * the encode core, on purpose: tests compare the two): the normal range rounds the float32 bit
 * pattern itself (add half an ulp minus one, plus the kept LSB, then shift: carries walk into the
 * exponent as they should); the subnormal range adds a "magic" power of two whose ulp is the
 * target's subnormal quantum, so the FPU's own round-to-nearest-even (the default mode, never
 * changed here) does the rounding (the classic float -> half trick). codec.py hands it out only
 * for formats whose half-minimum subnormal is >= 2**-126, so float32 subnormal inputs (even
 * flushed by DAZ) give 0. `finite` != 0 promises no NaN/Inf input. */
FP8REF_INLINE uint32_t encode_rne32(uint32_t u, const rne_params *p, int finite) {
    uint32_t s = u >> 31, a = u & 0x7FFFFFFFu;
    uint32_t normal = ((a + p->H + ((a >> p->S) & 1u)) >> p->S) - p->B;
    uint32_t subnormal = bits_of(f32_of(a) + f32_of(p->magic_bits)) - p->magic_bits;
    uint32_t mag = SEL(a < p->emin_bits, subnormal, normal);
    return ENCODE_TAIL(p, mag, s, !finite && a >= 0x7F800000u, a > 0x7F800000u);
}

/* Max of the magnitude bits (sign cleared) of x[0, n): integer order is magnitude order, and NaN
 * patterns sort above Inf, as scaling.reduce_amax. */
#define DEFINE_AMAX(NAME, T, MASK)                                                              \
    FP8REF_INLINE T NAME(const T *restrict x, size_t n, T m) {                                  \
        for (size_t k = 0; k < n; k++) {                                                        \
            T a = x[k] & (MASK);                                                                \
            m = a > m ? a : m;                                                                  \
        }                                                                                       \
        return m;                                                                               \
    }

DEFINE_AMAX(amax_run16, uint16_t, 0x7FFFu)
DEFINE_AMAX(amax_run32, uint32_t, 0x7FFFFFFFu)

#endif
