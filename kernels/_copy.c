/* Host-memory block copies for CPU pools (tiers/hostcopy.py), without the GIL.
 *
 * copy_pairs(dsts, srcs, counter) copies pairs pulled one at a time from a shared
 * counter (an int64 in a writable buffer), so the caller and any helper threads
 * calling it with the same lists split the work dynamically. The GIL is released
 * for the whole pull loop: Python-level chunk hand-offs had made each helper wait
 * for the interpreter between chunks whenever another thread was planning a move.
 *
 * Pairs of 64 KiB or more (a scattered block is one pair) are copied with
 * non-temporal (streaming) stores: a block written to
 * another tier is not read back soon, and streaming skips the read-for-ownership
 * of every destination line. Measured on a 2-core AMD EPYC host for 256 MiB:
 * glibc memcpy 13 GB/s on one thread, a plain AVX2 streaming loop 19-20 GB/s.
 * The widest loop the CPU has is chosen at import (``streaming()`` names it).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define KV_HAVE_STREAM 1
#endif

#define STREAM_MIN_BYTES (64 * 1024) /* smaller copies stay cached: an engine may read them next */

#ifdef KV_HAVE_STREAM
/* Streaming copy, four pages at a time: each pass takes the same 256 B of four
 * consecutive pages, prefetching ahead in each (glibc's large-copy loop does the
 * same). Measured on a 2-core Xeon host for 256 MiB over 2 threads: the plain
 * AVX2 streaming loop 18.8 ms, this loop with AVX2 15.3 ms, with AVX-512 13.9 ms,
 * numpy's copies (glibc memcpy) of each thread's half 15.6-17.9 ms. */
#define PAGE 4096
#define SPAN (4 * PAGE)
#define PASS 256

#define KV_COPY_4X(NAME, TARGET, VEC, LOAD, STORE)                                           \
    __attribute__((target(TARGET))) static void NAME(char *d, const char *s, size_t n) {     \
        size_t head = (PAGE - ((uintptr_t)d & (PAGE - 1))) & (PAGE - 1), i = 0;              \
        if (head > n)                                                                        \
            head = n;                                                                        \
        memcpy(d, s, head); /* page-aligned stores from here */                             \
        d += head;                                                                           \
        s += head;                                                                           \
        n -= head;                                                                           \
        for (; i + SPAN <= n; i += SPAN) {                                                   \
            for (size_t off = 0; off < PAGE; off += PASS) {                                  \
                for (size_t p = 0; p < 4; p++) {                                             \
                    const char *ss = s + i + p * PAGE + off;                                 \
                    char *dd = d + i + p * PAGE + off;                                       \
                    _mm_prefetch(ss + 2 * PASS, _MM_HINT_T0); /* never faults, even past s */ \
                    _mm_prefetch(ss + 2 * PASS + 64, _MM_HINT_T0);                           \
                    for (size_t v = 0; v < PASS; v += 4 * sizeof(VEC)) {                     \
                        VEC a = LOAD((const void *)(ss + v));                                \
                        VEC b = LOAD((const void *)(ss + v + sizeof(VEC)));                  \
                        VEC c = LOAD((const void *)(ss + v + 2 * sizeof(VEC)));              \
                        VEC e = LOAD((const void *)(ss + v + 3 * sizeof(VEC)));              \
                        STORE((void *)(dd + v), a);                                          \
                        STORE((void *)(dd + v + sizeof(VEC)), b);                            \
                        STORE((void *)(dd + v + 2 * sizeof(VEC)), c);                        \
                        STORE((void *)(dd + v + 3 * sizeof(VEC)), e);                        \
                    }                                                                        \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
        _mm_sfence(); /* streaming stores are weakly ordered: visible before the completion */ \
        memcpy(d + i, s + i, n - i);                                                         \
    }

#define LOAD256(p) _mm256_loadu_si256((const __m256i *)(p))
#define STORE256(p, v) _mm256_stream_si256((__m256i *)(p), v)
KV_COPY_4X(copy_stream_avx2, "avx2", __m256i, LOAD256, STORE256)
KV_COPY_4X(copy_stream_avx512, "avx512f", __m512i, _mm512_loadu_si512, _mm512_stream_si512)
#endif

/* 0: memmove only; 1: AVX2 streaming; 2: AVX-512 streaming (chosen once, at import) */
static int stream_kind;
static const char *const stream_names[] = {"none", "avx2", "avx512"};

static void copy_one(char *d, const char *s, size_t n) {
#ifdef KV_HAVE_STREAM
    /* overlapping views of one array take memmove's path: the streaming loop copies forwards */
    if (stream_kind && n >= STREAM_MIN_BYTES && (d + n <= s || s + n <= d)) {
        if (stream_kind == 2)
            copy_stream_avx512(d, s, n);
        else
            copy_stream_avx2(d, s, n);
        return;
    }
#endif
    memmove(d, s, n);
}

static int best_stream(void) {
#ifdef KV_HAVE_STREAM
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f"))
        return 2;
    return __builtin_cpu_supports("avx2") ? 1 : 0;
#else
    return 0;
#endif
}

static PyObject *py_copy_pairs(PyObject *self, PyObject *args) {
    PyObject *dsts, *srcs;
    Py_buffer counter;
    Py_buffer *views = NULL;
    Py_ssize_t n, got = 0, i, done = 0;
    PyObject *result = NULL;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!O!w*", &PyList_Type, &dsts, &PyList_Type, &srcs, &counter))
        return NULL;
    n = PyList_GET_SIZE(dsts);
    if (PyList_GET_SIZE(srcs) != n || counter.len < 8 || ((uintptr_t)counter.buf & 7)) {
        PyErr_SetString(PyExc_ValueError, "copy_pairs: lists of one length and an aligned int64 counter");
        goto out;
    }
    views = PyMem_Calloc((size_t)(2 * n + 1), sizeof(Py_buffer));
    if (views == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    for (got = 0; got < n; got++) { /* every buffer checked before a byte moves */
        Py_buffer *d = &views[2 * got], *s = &views[2 * got + 1];
        if (PyObject_GetBuffer(PyList_GET_ITEM(dsts, got), d, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            goto release;
        if (PyObject_GetBuffer(PyList_GET_ITEM(srcs, got), s, PyBUF_C_CONTIGUOUS) < 0) {
            PyBuffer_Release(d);
            goto release;
        }
        if (d->len != s->len) {
            PyErr_Format(PyExc_ValueError, "copy_pairs: pair %zd has %zd destination and %zd source bytes",
                         got, d->len, s->len);
            PyBuffer_Release(d);
            PyBuffer_Release(s);
            goto release;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (;;) {
        i = (Py_ssize_t)__atomic_fetch_add((int64_t *)counter.buf, 1, __ATOMIC_RELAXED);
        if (i < 0 || i >= n) /* (a counter that starts negative, or wrapped, takes nothing) */
            break;
        copy_one(views[2 * i].buf, views[2 * i + 1].buf, (size_t)views[2 * i].len);
        done++;
    }
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(done);
release:
    for (i = 0; i < got; i++) {
        PyBuffer_Release(&views[2 * i]);
        PyBuffer_Release(&views[2 * i + 1]);
    }
    PyMem_Free(views);
out:
    PyBuffer_Release(&counter);
    return result;
}

static PyObject *py_streaming(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    return PyUnicode_FromString(stream_names[stream_kind]);
}

static PyObject *py_use_streaming(PyObject *self, PyObject *args) {
    const char *name;
    int k, want = -1;
    (void)self;
    if (!PyArg_ParseTuple(args, "s", &name))
        return NULL;
    for (k = 0; k < 3; k++)
        if (strcmp(name, stream_names[k]) == 0)
            want = k;
    if (want < 0 || want > best_stream()) {
        PyErr_Format(PyExc_ValueError, "use_streaming: %s is not a loop this CPU runs (best: %s)", name,
                     stream_names[best_stream()]);
        return NULL;
    }
    k = stream_kind;
    stream_kind = want;
    return PyUnicode_FromString(stream_names[k]);
}

static PyMethodDef methods[] = {
    {"copy_pairs", py_copy_pairs, METH_VARARGS,
     "copy_pairs(dsts, srcs, counter) -> pairs this call copied; pairs are taken by an atomic "
     "fetch-add on the int64 at counter[0], so threads sharing it split the work"},
    {"streaming", py_streaming, METH_NOARGS, "streaming() -> the non-temporal store loop large copies take: 'avx512', 'avx2' or 'none'"},
    {"use_streaming", py_use_streaming, METH_VARARGS,
     "use_streaming(kind) -> the previous kind; for tests of each loop the CPU runs ('none' always runs)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_copy", NULL, -1, methods};

PyMODINIT_FUNC PyInit__copy(void) {
    stream_kind = best_stream();
    return PyModule_Create(&module);
}
