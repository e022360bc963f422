/* The eviction victim among sampled residents, in one call (predictor/reuse_model.py).
 *
 * lowest(blocks, table, last, cell, clock, inv_g, n_ages, n_cells, weight) returns
 * (i, value): the position in ``blocks`` of the lowest value and that value, where
 *
 *     age bucket = min(int64((clock - last[b]) * inv_g), n_ages - 1)
 *     value      = table[age bucket * n_cells + cell[b]]   (float32)
 *                  x weight[b]                              (float32, when weight is given)
 *
 * exactly as numpy computes it in ReuseModel.values (same casts, same float32
 * product; the first lowest wins, a NaN counts as lowest as in numpy's argmin).
 * numpy takes a dozen calls for it, ~5 us on 16 blocks, paid on every miss of a
 * full cache; this takes one. Without the compiled kernel the numpy path serves,
 * with the same decisions.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

static int get(PyObject *o, Py_buffer *v, const char *fmt, Py_ssize_t itemsize, const char *name) {
    if (PyObject_GetBuffer(o, v, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    const char *f = v->format ? v->format : "B";
    if (f[0] == '<' || f[0] == '=' || f[0] == '@')
        f++;
    if (v->itemsize != itemsize || strchr(fmt, f[0]) == NULL || f[1] != '\0') {
        PyErr_Format(PyExc_TypeError, "lowest: %s has format '%s', not one of '%s' of %zd bytes", name,
                     v->format ? v->format : "B", fmt, itemsize);
        PyBuffer_Release(v);
        return -1;
    }
    return 0;
}

static PyObject *py_lowest(PyObject *self, PyObject *args) {
    PyObject *o_blocks, *o_table, *o_last, *o_cell, *o_weight;
    long long clock;
    double inv_g;
    Py_ssize_t n_ages, n_cells;
    Py_buffer blocks, table, last, cell, weight;
    int have_weight, ok = 0;
    Py_ssize_t best = -1;
    float best_v = 0.0f;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOOLdnnO", &o_blocks, &o_table, &o_last, &o_cell, &clock, &inv_g, &n_ages,
                          &n_cells, &o_weight))
        return NULL;
    have_weight = o_weight != Py_None;
    if (get(o_blocks, &blocks, "qlQL", 8, "blocks") < 0)
        return NULL;
    if (get(o_table, &table, "f", 4, "table") < 0)
        goto r0;
    if (get(o_last, &last, "qlQL", 8, "last") < 0)
        goto r1;
    if (get(o_cell, &cell, "h", 2, "cell") < 0)
        goto r2;
    if (have_weight && get(o_weight, &weight, "f", 4, "weight") < 0)
        goto r3;
    {
        const int64_t *bl = blocks.buf, *la = last.buf;
        const int16_t *ce = cell.buf;
        const float *ta = table.buf, *we = have_weight ? weight.buf : NULL;
        Py_ssize_t n = blocks.len / 8, n_last = last.len / 8, n_table = table.len / 4;
        Py_ssize_t n_cell = cell.len / 2, n_weight = have_weight ? weight.len / 4 : 0;
        if (n == 0) {
            PyErr_SetString(PyExc_ValueError, "lowest: no blocks");
            goto r4;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t b = bl[i];
            if (b < 0 || b >= n_last || b >= n_cell || (have_weight && b >= n_weight)) {
                PyErr_Format(PyExc_IndexError, "lowest: block %lld out of range", (long long)b);
                goto r4;
            }
            int64_t age = (int64_t)((double)(clock - la[b]) * inv_g);
            if (age > n_ages - 1)
                age = n_ages - 1;
            int64_t at = age * n_cells + ce[b];
            if (at < 0 || at >= n_table) {
                PyErr_Format(PyExc_IndexError, "lowest: table index %lld out of range", (long long)at);
                goto r4;
            }
            float v = ta[at];
            if (have_weight)
                v = v * we[b];
            if (best < 0 || v < best_v || (isnan(v) && !isnan(best_v))) {
                best = i;
                best_v = v;
                if (isnan(v))
                    break; /* numpy's argmin: the first NaN */
            }
        }
        ok = 1;
    }
r4:
    if (have_weight)
        PyBuffer_Release(&weight);
r3:
    PyBuffer_Release(&cell);
r2:
    PyBuffer_Release(&last);
r1:
    PyBuffer_Release(&table);
r0:
    PyBuffer_Release(&blocks);
    if (!ok)
        return NULL;
    return Py_BuildValue("(nd)", best, (double)best_v);
}

static PyMethodDef methods[] = {
    {"lowest", py_lowest, METH_VARARGS,
     "lowest(blocks, table, last, cell, clock, inv_g, n_ages, n_cells, weight) -> (i, value) of the lowest value"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_value", NULL, -1, methods};

PyMODINIT_FUNC PyInit__value(void) { return PyModule_Create(&module); }
