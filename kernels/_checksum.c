/* The host side of kernels/checksum.py's block checksum, in one pass.
 *
 * numpy needs four passes over a block (multiply, shift, xor, sum), which holds
 * a host to ~7 GB/s a core: on a small node that CPU is what a verified NVMe
 * read spends beyond the disk. This loop does the same arithmetic once per
 * word, with the GIL released so the I/O threads verify in parallel. It
 * returns the sum of the word terms, sum_i (x_i ^ x_i >> 32) with
 * x_i = w_i * (2i + 1) * P (mod 2**64); checksum.py applies C, the tail word and
 * the finaliser, so both paths share one definition.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static const uint64_t P = 0x9E3779B97F4A7C15ULL;

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
/* one build for every x86-64 host; the loader picks the AVX-512 copy (64-bit
 * vector multiplies) where the CPU has it */
#define KV_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define KV_CLONES
#endif

KV_CLONES static uint64_t sum_terms(const unsigned char *p, Py_ssize_t n_words) {
    uint64_t s0 = 0, s1 = 0, m = P;
    const uint64_t step = 2 * P;
    Py_ssize_t i = 0;
    for (; i + 1 < n_words; i += 2) {  /* two sums: the adds do not wait on each other */
        uint64_t w0, w1, x0, x1;
        memcpy(&w0, p + 8 * i, 8);
        memcpy(&w1, p + 8 * i + 8, 8);
        x0 = w0 * m;
        x1 = w1 * (m + step);
        s0 += x0 ^ (x0 >> 32);
        s1 += x1 ^ (x1 >> 32);
        m += 2 * step;
    }
    if (i < n_words) {
        uint64_t w, x;
        memcpy(&w, p + 8 * i, 8);
        x = w * m;
        s0 += x ^ (x >> 32);
    }
    return s0 + s1;
}

static PyObject *py_sum_terms(PyObject *self, PyObject *args) {
    Py_buffer view;
    Py_ssize_t n_words;
    uint64_t s;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*n", &view, &n_words))
        return NULL;
    if (n_words < 0 || n_words > view.len / 8) {
        PyBuffer_Release(&view);
        PyErr_Format(PyExc_ValueError, "%zd words do not fit in a buffer of %zd bytes", n_words, view.len);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    s = sum_terms((const unsigned char *)view.buf, n_words);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(s);
}

static PyMethodDef methods[] = {
    {"sum_terms", py_sum_terms, METH_VARARGS,
     "sum_terms(buffer, n_words) -> sum of x_i ^ (x_i >> 32) over the first n_words little-endian words (mod 2**64)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_checksum", NULL, -1, methods};

PyMODINIT_FUNC PyInit__checksum(void) { return PyModule_Create(&module); }
