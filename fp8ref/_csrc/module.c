/* Fast loops for fp8ref's codec, called through ctypes (the GIL is released during calls), and the
 * parallel driver every loop runs on.
 *
 * The loops live beside this file: the codec's in codec.c, the fused quantize loops in quant.c, the
 * declared-order fp32 GEMM in matmul.c, fp8ref.hardware's in hw.c and hw_avx512.c, the exact GEMM's
 * staging and epilogue in exact.c.
 *
 * fp8ref_parallel runs a task on the OpenMP runtime that torch already loaded (fp8ref_bind_openmp
 * receives its GOMP_parallel entry point from _native.py): fp8ref's loops then run on torch's own
 * worker threads, one team, instead of a second pool that competes with torch's spinning workers.
 * Nothing here links an OpenMP runtime or needs -fopenmp; unbound, tasks run on the calling thread.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "kernels.h"

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

/* kernels.hw_call(task, template, a, b, d[, sa, sb]) -> flags: one small tensor-core instruction's C
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

/* ---- the ABI layout, checked field by field by _native.py at load time ----------------------------- */
typedef struct {
    const char *type, *field; /* field "" is the struct itself: size = sizeof */
    size_t offset, size;
} fp8ref_field;

#define STRUCT(T) {#T, "", 0, sizeof(T)}
#define FIELD(T, f) {#T, #f, offsetof(T, f), sizeof(((T *)0)->f)}
static const fp8ref_field layout[] = {
    STRUCT(enc_params), FIELD(enc_params, M), FIELD(enc_params, emin), FIELD(enc_params, bias),
    FIELD(enc_params, mode), FIELD(enc_params, maxmag), FIELD(enc_params, signbit), FIELD(enc_params, nan_pos),
    FIELD(enc_params, nan_neg), FIELD(enc_params, inf_pos), FIELD(enc_params, inf_neg), FIELD(enc_params, ovf_pos),
    FIELD(enc_params, ovf_neg), FIELD(enc_params, zero_neg),
    STRUCT(rne_params), FIELD(rne_params, S), FIELD(rne_params, H), FIELD(rne_params, B),
    FIELD(rne_params, emin_bits), FIELD(rne_params, magic_bits), FIELD(rne_params, maxmag),
    FIELD(rne_params, signbit), FIELD(rne_params, nan_pos), FIELD(rne_params, nan_neg), FIELD(rne_params, inf_pos),
    FIELD(rne_params, inf_neg), FIELD(rne_params, ovf_pos), FIELD(rne_params, ovf_neg), FIELD(rne_params, zero_neg),
    STRUCT(ew_job), FIELD(ew_job, src), FIELD(ew_job, dst), FIELD(ew_job, arg),
    STRUCT(amax_job), FIELD(amax_job, src), FIELD(amax_job, out), FIELD(amax_job, K), FIELD(amax_job, g),
    STRUCT(quant_job), FIELD(quant_job, src), FIELD(quant_job, dst), FIELD(quant_job, s), FIELD(quant_job, s_off),
    FIELD(quant_job, table), FIELD(quant_job, amax), FIELD(quant_job, p), FIELD(quant_job, rne),
    FIELD(quant_job, K), FIELD(quant_job, g), FIELD(quant_job, r2), FIELD(quant_job, bh), FIELD(quant_job, kind),
    FIELD(quant_job, exact), FIELD(quant_job, op), FIELD(quant_job, model), FIELD(quant_job, cast16),
    FIELD(quant_job, addend), FIELD(quant_job, clampv), FIELD(quant_job, neg0), FIELD(quant_job, stream),
    FIELD(quant_job, tab_slots), FIELD(quant_job, bound), FIELD(quant_job, stored), FIELD(quant_job, final),
    FIELD(quant_job, scale), FIELD(quant_job, not_final),
    STRUCT(mm_job), FIELD(mm_job, A), FIELD(mm_job, B), FIELD(mm_job, tab_a), FIELD(mm_job, tab_b),
    FIELD(mm_job, sa), FIELD(mm_job, sb), FIELD(mm_job, total), FIELD(mm_job, part), FIELD(mm_job, scratch),
    FIELD(mm_job, M), FIELD(mm_job, K), FIELD(mm_job, N), FIELD(mm_job, L), FIELD(mm_job, bk), FIELD(mm_job, KB),
    FIELD(mm_job, step), FIELD(mm_job, scratch_stride), FIELD(mm_job, fused),
    STRUCT(hw_job), FIELD(hw_job, A), FIELD(hw_job, B), FIELD(hw_job, SA), FIELD(hw_job, SB), FIELD(hw_job, va),
    FIELD(hw_job, vb), FIELD(hw_job, xa), FIELD(hw_job, xb), FIELD(hw_job, xs), FIELD(hw_job, ss),
    FIELD(hw_job, ia), FIELD(hw_job, ib), FIELD(hw_job, fa), FIELD(hw_job, fb), FIELD(hw_job, fs),
    FIELD(hw_job, psa), FIELD(hw_job, psb), FIELD(hw_job, D), FIELD(hw_job, acc), FIELD(hw_job, M),
    FIELD(hw_job, N), FIELD(hw_job, K), FIELD(hw_job, L), FIELD(hw_job, chunks), FIELD(hw_job, promote),
    FIELD(hw_job, np), FIELD(hw_job, G), FIELD(hw_job, block), FIELD(hw_job, F), FIELD(hw_job, out_bits),
    FIELD(hw_job, e_zero), FIELD(hw_job, zero_in), FIELD(hw_job, fma), FIELD(hw_job, unit), FIELD(hw_job, smb),
    FIELD(hw_job, f16), FIELD(hw_job, bad),
    STRUCT(dec_job), FIELD(dec_job, src), FIELD(dec_job, dst), FIELD(dec_job, lut), FIELD(dec_job, flags),
    FIELD(dec_job, scale), FIELD(dec_job, norm2), FIELD(dec_job, src_rs), FIELD(dec_job, src_cs),
    FIELD(dec_job, dst_rs), FIELD(dec_job, rows), FIELD(dec_job, cols), FIELD(dec_job, unit), FIELD(dec_job, s_rs),
    FIELD(dec_job, s_rb), FIELD(dec_job, s_cb), FIELD(dec_job, n_rs), FIELD(dec_job, n_rb), FIELD(dec_job, n_cb),
    FIELD(dec_job, stream),
    STRUCT(epi_job), FIELD(epi_job, t), FIELD(epi_job, out), FIELD(epi_job, unsure), FIELD(epi_job, sa),
    FIELD(epi_job, sb), FIELD(epi_job, bias), FIELD(epi_job, norm), FIELD(epi_job, slack), FIELD(epi_job, max),
    FIELD(epi_job, M), FIELD(epi_job, N), FIELD(epi_job, ldt), FIELD(epi_job, sa_s), FIELD(epi_job, sb_s),
    FIELD(epi_job, mode), FIELD(epi_job, precision), FIELD(epi_job, emin), FIELD(epi_job, parts),
    FIELD(epi_job, part_stride),
    STRUCT(bsum_job), FIELD(bsum_job, a), FIELD(bsum_job, aT), FIELD(bsum_job, b), FIELD(bsum_job, va),
    FIELD(bsum_job, vb), FIELD(bsum_job, mi), FIELD(bsum_job, ni), FIELD(bsum_job, sums), FIELD(bsum_job, M),
    FIELD(bsum_job, K), FIELD(bsum_job, E), FIELD(bsum_job, bk), FIELD(bsum_job, b_rs), FIELD(bsum_job, b_cs),
    STRUCT(dot_job), FIELD(dot_job, a), FIELD(dot_job, w), FIELD(dot_job, lut), FIELD(dot_job, t),
    FIELD(dot_job, flags), FIELD(dot_job, M), FIELD(dot_job, K), FIELD(dot_job, N), FIELD(dot_job, w_rs),
    FIELD(dot_job, sym), FIELD(dot_job, bk),
};

/* The table above (its entries through *n): each struct's sizeof, then its fields in declaration order. */
const fp8ref_field *fp8ref_layout(size_t *n) {
    *n = sizeof(layout) / sizeof(layout[0]);
    return layout;
}

/* ---- the CPU's instruction-set level (which per-ISA objects it may run) ------------------------------ */
/* The x86-64 psABI level this CPU and OS run: 4 (AVX-512 F/BW/CD/DQ/VL), 3 (AVX2, FMA, BMI1/2, F16C,
 * MOVBE, LZCNT), 2, 1; 0 off x86-64 (the generic objects). GCC's cpu model checks the OS saves the
 * vector state (XGETBV) before it reports AVX or AVX-512. */
int fp8ref_cpu_level(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
#if __GNUC__ >= 12 && !defined(__clang__)
    if (__builtin_cpu_supports("x86-64-v4")) return 4;
    if (__builtin_cpu_supports("x86-64-v3")) return 3;
    if (__builtin_cpu_supports("x86-64-v2")) return 2;
#else /* older compilers name the features one by one (the ones they know of each level) */
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512cd") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx2") &&
        __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi2"))
        return 4;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi") &&
        __builtin_cpu_supports("bmi2"))
        return 3;
    if (__builtin_cpu_supports("sse4.2") && __builtin_cpu_supports("popcnt")) return 2;
#endif
    return 1;
#else
    return 0;
#endif
}

static PyMethodDef kernels_methods[] = {
    {"hw_call", (PyCFunction)(void (*)(void))hw_call, METH_FASTCALL,
     "One tensor-core instruction's C loop (see fp8ref/_csrc/module.c)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef kernels_module = {PyModuleDef_HEAD_INIT, "_kernels",
                                            "C loops for fp8ref (used through ctypes; hw_call: a Python function).", -1,
                                            kernels_methods};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&kernels_module); }
