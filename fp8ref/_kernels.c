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

/* _kernels.hw_call(task, template, a, b, d[, sa, sb]) -> flags: one small tensor-core instruction's C
 * loop (fp8ref.hardware.native.Plan), a Python function (METH_FASTCALL) because ctypes' conversion of
 * each argument and numpy's .ctypes cost more than the loop. task and template are addresses (the
 * C task; the plan's hw_job, copied here: concurrent calls never share one); a, b, d, sa, sb expose
 * C-contiguous buffers (the caller made them so: an internal contract), their addresses become the
 * job's A, B, D, SA, SB. The task runs over the job's chunks with the GIL released; returns the
 * copy's bad flags. */
static PyObject *hw_call(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    static const size_t offsets[5] = {offsetof(hw_job, A), offsetof(hw_job, B), offsetof(hw_job, D),
                                      offsetof(hw_job, SA), offsetof(hw_job, SB)};
    (void)self;
    if (nargs != 5 && nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "hw_call: expected task, template, a, b, d[, sa, sb]");
        return NULL;
    }
    fp8ref_task fn = (fp8ref_task)PyLong_AsVoidPtr(args[0]);
    const hw_job *tmpl = PyLong_AsVoidPtr(args[1]);
    if (PyErr_Occurred()) return NULL;
    hw_job job = *tmpl;
    Py_buffer views[5];
    const Py_ssize_t count = nargs - 2;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (PyObject_GetBuffer(args[2 + i], &views[i], PyBUF_C_CONTIGUOUS) < 0) {
            while (i--) PyBuffer_Release(&views[i]);
            return NULL;
        }
        memcpy((char *)&job + offsets[i], &views[i].buf, sizeof(void *));
    }
    Py_BEGIN_ALLOW_THREADS
    fn(&job, 0, job.chunks);
    Py_END_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++) PyBuffer_Release(&views[i]);
    return PyLong_FromLongLong((long long)job.bad);
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
SIZEOF(dot_job)

static PyMethodDef kernels_methods[] = {
    {"hw_call", (PyCFunction)(void (*)(void))hw_call, METH_FASTCALL,
     "One tensor-core instruction's C loop (see _kernels.c)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef kernels_module = {PyModuleDef_HEAD_INIT, "_kernels",
                                            "C loops for fp8ref (used through ctypes; hw_call: a Python function).", -1,
                                            kernels_methods};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&kernels_module); }
