/* Fast loops for fp8ref's codec, called through ctypes (the GIL is released during calls), and the
 * parallel driver every loop runs on.
 *
 * encode_f32: float32 -> ExMy codes by integer arithmetic on the float32 bit pattern (the encode
 * core of _kernels.h). The caller (codec.py) precomputes every code that depends on the format,
 * mode and sign (NaN, Inf, overflow, negative zero), so the loop only rounds. It is one of two
 * independent encoders: the other is the numpy path in codec.py, and tests compare them.
 *
 * gather_u16 / gather_f32_rto16 / decode_f32: table lookups (16-bit inputs -> codes, codes -> values).
 * The fused quantize loops are in _kernels_quant.c, the declared-order fp32 GEMM in _kernels_matmul.c.
 *
 * fp8ref_parallel runs a task on the OpenMP runtime that torch already loaded (fp8ref_bind_openmp
 * receives its GOMP_parallel entry point from _native.py): fp8ref's loops then run on torch's own
 * worker threads, one team, instead of a second pool that competes with torch's spinning workers.
 * Nothing here links an OpenMP runtime or needs -fopenmp; unbound, tasks run on the calling thread.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_kernels.h"

/* ---- parallel driver ---------------------------------------------------------------------------- */
typedef void (*gomp_parallel_fn)(void (*)(void *), void *, unsigned, unsigned);
static gomp_parallel_fn omp_parallel;
static int (*omp_thread_num)(void);
static int (*omp_num_threads)(void);

/* GOMP_parallel(fn, data, num_threads, flags), omp_get_thread_num, omp_get_num_threads of the
 * loaded runtime (libgomp, or LLVM/Intel libomp, which export the same GOMP_ entry points). */
void fp8ref_bind_openmp(void *parallel, void *thread_num, void *num_threads) {
    omp_thread_num = (int (*)(void))thread_num;
    omp_num_threads = (int (*)(void))num_threads;
    omp_parallel = (gomp_parallel_fn)parallel;
}

typedef struct {
    fp8ref_task fn;
    const void *args;
    size_t n, ntasks;
} par_ctx;

/* Task t covers [n*t/ntasks, n*(t+1)/ntasks); team member i takes tasks i, i + team, ... (a team
 * may be smaller than asked). */
static void par_body(void *data) {
    const par_ctx *c = data;
    size_t team = (size_t)omp_num_threads();
    for (size_t t = (size_t)omp_thread_num(); t < c->ntasks; t += team)
        c->fn(c->args, c->n * t / c->ntasks, c->n * (t + 1) / c->ntasks);
}

void fp8ref_parallel(fp8ref_task fn, const void *args, size_t n, size_t ntasks, size_t nthreads) {
    ntasks = ntasks < n ? ntasks : n;
    if (!omp_parallel || nthreads < 2 || ntasks < 2) {
        if (n) fn(args, 0, n);
        return;
    }
    par_ctx c = {fn, args, n, ntasks};
    omp_parallel(par_body, &c, (unsigned)(nthreads < ntasks ? nthreads : ntasks), 0);
}

/* ---- codec loops -------------------------------------------------------------------------------- */
/* Round-to-nearest-even fast path (encode_rne32 in _kernels.h). */
FP8REF_CLONES void fp8ref_encode_f32_rne(const ew_job *j, size_t lo, size_t hi) {
    const uint32_t *restrict src = j->src;
    uint8_t *restrict dst = j->dst;
    const rne_params p = *(const rne_params *)j->arg;
    for (size_t i = lo; i < hi; i++) dst[i] = (uint8_t)encode_rne32(src[i], &p, 0);
}

#define ENCODE_CASE(MODE) \
    case MODE:            \
        for (size_t i = lo; i < hi; i++) dst[i] = (uint8_t)encode_bits32(src[i], &p, MODE, 0); \
        break;

FP8REF_CLONES void fp8ref_encode_f32(const ew_job *j, size_t lo, size_t hi) {
    const uint32_t *restrict src = j->src;
    uint8_t *restrict dst = j->dst;
    const enc_params p = *(const enc_params *)j->arg;
    switch (p.mode) {
        ENCODE_CASE(RNE) ENCODE_CASE(RNA) ENCODE_CASE(RTZ) ENCODE_CASE(RUP) ENCODE_CASE(RDOWN) ENCODE_CASE(RTO)
    default: break;
    }
}

FP8REF_CLONES void fp8ref_gather_u16(const ew_job *j, size_t lo, size_t hi) {
    const uint16_t *restrict src = j->src;
    uint8_t *restrict dst = j->dst;
    const uint8_t *restrict lut = j->arg;
    for (size_t i = lo; i < hi; i++) dst[i] = lut[src[i]];
}

/* float32 input through a 65536-entry table indexed by the bfloat16 "round to odd" of x:
 * the top 16 bits with the sticky OR of the low 16 bits folded into bit 0. */
FP8REF_CLONES void fp8ref_gather_f32_rto16(const ew_job *j, size_t lo, size_t hi) {
    const uint32_t *restrict src = j->src;
    uint8_t *restrict dst = j->dst;
    const uint8_t *restrict lut = j->arg;
    for (size_t i = lo; i < hi; i++) {
        uint32_t u = src[i];
        dst[i] = lut[(u | ((u & 0xFFFFu) + 0xFFFFu)) >> 16];
    }
}

FP8REF_CLONES void fp8ref_decode_f32(const ew_job *j, size_t lo, size_t hi) {
    const uint8_t *restrict src = j->src;
    float *restrict dst = j->dst;
    const float *restrict lut = j->arg;
    for (size_t i = lo; i < hi; i++) dst[i] = lut[src[i]];
}

/* Rows of FP8 codes (any strides) -> float64 through a table, and which rows hold a NaN value (the
 * table maps NaN/Inf and out-of-range codes to NaN): the operand staging of the exact fast path,
 * one cache-sized panel at a time, so no float64 copy of a whole operand is written. */
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
/* Contiguous codes, 16 per step, without gathers (slow here): the 256-entry float32 table sits in
 * 16 registers; 8 two-register permutes look up the low 5 index bits, a blend tree on bits 5-7
 * picks the result, and two widenings give the float64 values (exact). */
__attribute__((target("avx512f"))) static int decode_row_avx512(const uint8_t *src, double *dst, const __m512 *t,
                                                                 const float *lut, int64_t n) {
    __mmask16 nan = 0;
    int64_t c = 0;
    for (; c + 16 <= n; c += 16) {
        __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(src + c)));
        __m512 r[8];
        for (int p = 0; p < 8; p++) r[p] = _mm512_permutex2var_ps(t[2 * p], idx, t[2 * p + 1]);
        __mmask16 b5 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(32));
        __mmask16 b6 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(64));
        __mmask16 b7 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(128));
        for (int p = 0; p < 4; p++) r[p] = _mm512_mask_blend_ps(b5, r[2 * p], r[2 * p + 1]);
        for (int p = 0; p < 2; p++) r[p] = _mm512_mask_blend_ps(b6, r[2 * p], r[2 * p + 1]);
        __m512 v = _mm512_mask_blend_ps(b7, r[0], r[1]);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        _mm512_storeu_pd(dst + c, _mm512_cvtps_pd(_mm512_castps512_ps256(v)));
        _mm512_storeu_pd(dst + c + 8, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
    }
    int bad = nan != 0;
    for (; c < n; c++) {
        dst[c] = lut[src[c]];
        bad |= dst[c] != dst[c];
    }
    return bad;
}

__attribute__((target("avx512f"))) static void decode_rows_avx512(const dec_job *j, size_t lo, size_t hi) {
    __m512 t[16];
    for (int p = 0; p < 16; p++) t[p] = _mm512_loadu_ps(j->lut + 16 * p);
    for (size_t r = lo; r < hi; r++)
        j->flags[r] = (uint8_t)decode_row_avx512(j->src + (int64_t)r * j->src_rs, j->dst + (int64_t)r * j->dst_rs, t,
                                                 j->lut, j->cols);
}
#endif

void fp8ref_decode_f64(const dec_job *j, size_t lo, size_t hi) {
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (j->src_cs == 1 && __builtin_cpu_supports("avx512f")) {
        decode_rows_avx512(j, lo, hi);
        return;
    }
#endif
    for (size_t r = lo; r < hi; r++) {
        const uint8_t *src = j->src + (int64_t)r * j->src_rs;
        double *dst = j->dst + (int64_t)r * j->dst_rs;
        int bad = 0;
        for (int64_t c = 0; c < j->cols; c++) {
            dst[c] = j->lut[src[c * j->src_cs]];
            bad |= dst[c] != dst[c];
        }
        j->flags[r] = (uint8_t)bad;
    }
}

/* ---- ABI sizes, checked by _native.py at load time ----------------------------------------------- */
#define SIZEOF(T) size_t fp8ref_sizeof_##T(void) { return sizeof(T); }
SIZEOF(enc_params)
SIZEOF(rne_params)
SIZEOF(ew_job)
SIZEOF(amax_job)
SIZEOF(quant_job)
SIZEOF(mm_job)
SIZEOF(hw_job)
SIZEOF(dec_job)

static struct PyModuleDef kernels_module = {PyModuleDef_HEAD_INIT, "_kernels",
                                            "C loops for fp8ref (used through ctypes).", -1, NULL};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&kernels_module); }
