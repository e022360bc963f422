/* The host side of kernels/checksum.py's block checksum, in one pass.
 *
 * numpy needs four passes over a block (multiply, shift, xor, sum), which holds
 * a host to ~7 GB/s a core: on a small node that CPU is what a verified NVMe
 * read spends beyond the disk. This loop does the same arithmetic once per
 * word, with the GIL released so the I/O threads verify in parallel. It
 * returns the sum of the word terms, sum_i (x_i ^ x_i >> 32) with
 * x_i = w_i * (2i + 1) * P (mod 2**64); checksum.py applies C, the tail word and
 * the finaliser, so both paths share one definition (checksum.h holds the loop,
 * shared with _blockio.c).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "checksum.h"

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
    s = kv_sum_terms((const unsigned char *)view.buf, n_words);
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
