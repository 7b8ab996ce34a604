/* The codec's elementwise loops (fp8ref.codec), one of the per-ISA files (kernels.h, FP8REF_TASK):
 *
 * encode_f32: float32 -> ExMy codes by integer arithmetic on the float32 bit pattern (the encode
 * core of kernels.h). The caller (codec.py) precomputes every code that depends on the format,
 * mode and sign (NaN, Inf, overflow, negative zero), so the loop only rounds. It is one of two
 * independent encoders: the other is the numpy path in codec.py, and tests compare them.
 *
 * gather_u16 / gather_f32_rto16 / decode_f32: table lookups (16-bit inputs -> codes, codes -> values).
 */
#include "kernels.h"

/* Round-to-nearest-even fast path (encode_rne32 in kernels.h). */
void FP8REF_TASK(fp8ref_encode_f32_rne)(const ew_job *j, size_t lo, size_t hi) {
    const uint32_t *restrict src = j->src;
    uint8_t *restrict dst = j->dst;
    const rne_params p = *(const rne_params *)j->arg;
    for (size_t i = lo; i < hi; i++) dst[i] = (uint8_t)encode_rne32(src[i], &p, 0);
}

#define ENCODE_CASE(MODE) \
    case MODE:            \
        for (size_t i = lo; i < hi; i++) dst[i] = (uint8_t)encode_bits32(src[i], &p, MODE, 0); \
        break;

void FP8REF_TASK(fp8ref_encode_f32)(const ew_job *j, size_t lo, size_t hi) {
    const uint32_t *restrict src = j->src;
    uint8_t *restrict dst = j->dst;
    const enc_params p = *(const enc_params *)j->arg;
    switch (p.mode) {
        ENCODE_CASE(RNE) ENCODE_CASE(RNA) ENCODE_CASE(RTZ) ENCODE_CASE(RUP) ENCODE_CASE(RDOWN) ENCODE_CASE(RTO)
    default: break;
    }
}

/* unrolled: the loop of one lookup a step ran at one step per cycle or at half that, by where the
 * linker put it (a 16-byte shift of the code put it across a 64-byte line: 21 vs 37 ms for 64 Mi
 * inputs on one thread, Zen 4; measured). Two loads and a store per input bound it either way. */
void FP8REF_TASK(fp8ref_gather_u16)(const ew_job *j, size_t lo, size_t hi) {
    const uint16_t *restrict src = j->src;
    uint8_t *restrict dst = j->dst;
    const uint8_t *restrict lut = j->arg;
#pragma GCC unroll 4
    for (size_t i = lo; i < hi; i++) dst[i] = lut[src[i]];
}

/* float32 input through a 65536-entry table indexed by the bfloat16 "round to odd" of x:
 * the top 16 bits with the sticky OR of the low 16 bits folded into bit 0. */
void FP8REF_TASK(fp8ref_gather_f32_rto16)(const ew_job *j, size_t lo, size_t hi) {
    const uint32_t *restrict src = j->src;
    uint8_t *restrict dst = j->dst;
    const uint8_t *restrict lut = j->arg;
    for (size_t i = lo; i < hi; i++) {
        uint32_t u = src[i];
        dst[i] = lut[(u | ((u & 0xFFFFu) + 0xFFFFu)) >> 16];
    }
}

void FP8REF_TASK(fp8ref_decode_f32)(const ew_job *j, size_t lo, size_t hi) {
    const uint8_t *restrict src = j->src;
    float *restrict dst = j->dst;
    const float *restrict lut = j->arg;
    for (size_t i = lo; i < hi; i++) dst[i] = lut[src[i]];
}
