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
    size_t next; /* the next unclaimed task */
} par_ctx;

/* Task t covers [n*t/ntasks, n*(t+1)/ntasks); each team member claims the next unclaimed task
 * until none is left, so a member the OS deschedules (a shared machine) holds up at most its
 * current task, not a fixed share (a team may be smaller than asked). Which thread runs a task
 * never changes what it writes. */
static void par_body(void *data) {
    par_ctx *c = data;
    for (size_t t; (t = __atomic_fetch_add(&c->next, 1, __ATOMIC_RELAXED)) < c->ntasks;)
        c->fn(c->args, c->n * t / c->ntasks, c->n * (t + 1) / c->ntasks);
}

void fp8ref_parallel(fp8ref_task fn, const void *args, size_t n, size_t ntasks, size_t nthreads) {
    ntasks = ntasks < n ? ntasks : n;
    if (!omp_parallel || nthreads < 2 || ntasks < 2) {
        if (n) fn(args, 0, n);
        return;
    }
    par_ctx c = {fn, args, n, ntasks, 0};
    omp_parallel(par_body, &c, (unsigned)(nthreads < ntasks ? nthreads : ntasks), 0);
}

/* One task call on arrays handed over as Python objects, for callers where ctypes' per-array
 * address lookup (numpy's .ctypes) costs more than the loop (one small tensor-core instruction,
 * fp8ref.hardware.native.Plan). Called through ctypes.PyDLL, so with the GIL held: each object's
 * C-contiguous buffer address is written at offsets[i] in the job, the task runs over [0, n) with the
 * GIL released, the buffers are released. -1 with a Python exception set when an object exposes no
 * C-contiguous buffer (the caller made them contiguous first: an internal contract). */
int fp8ref_call_with_buffers(fp8ref_task fn, void *job, size_t n, PyObject *arrays, const size_t *offsets) {
    Py_buffer views[8];
    if (!PyTuple_Check(arrays) || PyTuple_GET_SIZE(arrays) > 8) {
        PyErr_SetString(PyExc_TypeError, "fp8ref_call_with_buffers: expected a tuple of at most 8 arrays");
        return -1;
    }
    const Py_ssize_t count = PyTuple_GET_SIZE(arrays);
    for (Py_ssize_t i = 0; i < count; i++) {
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(arrays, i), &views[i], PyBUF_C_CONTIGUOUS) < 0) {
            while (i--) PyBuffer_Release(&views[i]);
            return -1;
        }
        memcpy((char *)job + offsets[i], &views[i].buf, sizeof(void *));
    }
    Py_BEGIN_ALLOW_THREADS
    if (n) fn(job, 0, n);
    Py_END_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++) PyBuffer_Release(&views[i]);
    return 0;
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
SIZEOF(epi_job)
SIZEOF(bsum_job)

static struct PyModuleDef kernels_module = {PyModuleDef_HEAD_INIT, "_kernels",
                                            "C loops for fp8ref (used through ctypes).", -1, NULL};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&kernels_module); }
