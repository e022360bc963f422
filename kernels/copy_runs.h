/* A host copy as runs of bytes between two buffers (kernels/_copy.c): the job its pieces
 * are pulled from, and ``rows_prepare``, which finds the runs in two arrays of row numbers
 * (rows consecutive on both sides make one run; numpy had cost the owner ~26 us a descriptor
 * where this loop takes ~1 us), every row checked against both buffers before a byte moves. */
#ifndef KVTIER_COPY_RUNS_H
#define KVTIER_COPY_RUNS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "copy_pool.h"
#include "stream_copy.h"

/* A copy of runs: the job, what its pieces read, and the buffers it holds until joined. */
typedef struct {
    pool_job job;
    char *dst;
    const char *src;
    const int64_t *dof, *sof, *len;
    int64_t *starts; /* starts[r]: run r's first piece */
    int64_t *owned;  /* dof, sof and len where rows_prepare made them (else NULL) */
    int64_t runs, piece;
    int overlap;       /* the two buffers share bytes: runs go in order, each as memmove */
    Py_buffer bufs[4]; /* dst, src, dst_rows, src_rows */
    int held;          /* buffers acquired */
} runs_job;

static void run_piece(pool_job *job, int64_t i) {
    runs_job *c = (runs_job *)job; /* job is the first member */
    int64_t lo = 0, hi = c->runs, off, n;
    while (hi - lo > 1) { /* the run holding piece i: the last with starts <= i (never an empty one) */
        int64_t mid = (lo + hi) / 2;
        if (c->starts[mid] <= i)
            lo = mid;
        else
            hi = mid;
    }
    off = (i - c->starts[lo]) * c->piece;
    n = c->len[lo] - off < c->piece ? c->len[lo] - off : c->piece;
    copy_one(c->dst + c->dof[lo] + off, c->src + c->sof[lo] + off, (size_t)n);
    __atomic_fetch_add(&job->bytes, n, __ATOMIC_RELAXED);
}

static void runs_release(runs_job *rj) {
    for (int k = 0; k < rj->held; k++)
        PyBuffer_Release(&rj->bufs[k]);
    rj->held = 0;
    PyMem_Free(rj->starts);
    PyMem_Free(rj->owned);
    rj->starts = rj->owned = NULL;
}

/* The int64 view of a buffer of n entries, or NULL with an error set. */
static const int64_t *int64s(Py_buffer *b, Py_ssize_t n, const char *what) {
    if (b->len != n * 8 || ((uintptr_t)b->buf & 7)) {
        PyErr_Format(PyExc_ValueError, "copy_rows: %s must be %zd aligned int64s", what, n);
        return NULL;
    }
    return (const int64_t *)b->buf;
}

/* Cut ``runs`` runs (rj->dof/sof/len, dst and src held as bufs[0] and bufs[1]) into pieces
 * of at most ``piece`` bytes, every run checked against the buffers first; -1 with an error set. */
static int runs_plan(runs_job *rj, Py_ssize_t runs, Py_ssize_t piece) {
    Py_buffer *b = rj->bufs;
    int64_t total = 0;
    Py_ssize_t r;
    if (piece <= 0) {
        PyErr_SetString(PyExc_ValueError, "copy_rows: a positive piece size");
        return -1;
    }
    rj->starts = PyMem_Malloc((size_t)(runs + 1) * sizeof(int64_t));
    if (rj->starts == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (r = 0; r < runs; r++) { /* every run checked before a byte moves */
        const int64_t n = rj->len[r], d = rj->dof[r], s = rj->sof[r];
        if (n < 0 || d < 0 || s < 0 || d > b[0].len - n || s > b[1].len - n) {
            PyErr_Format(PyExc_ValueError, "copy_rows: run %zd (%lld bytes from %lld to %lld) is outside the buffers",
                         r, (long long)n, (long long)s, (long long)d);
            return -1;
        }
        rj->starts[r] = total;
        total += n / piece + (n % piece != 0); /* (n + piece - 1 wrapped for a huge piece) */
    }
    rj->starts[runs] = total;
    rj->overlap = (const char *)b[0].buf < (const char *)b[1].buf + b[1].len &&
                  (const char *)b[1].buf < (const char *)b[0].buf + b[0].len;
    rj->dst = b[0].buf;
    rj->src = b[1].buf;
    rj->runs = runs;
    rj->piece = piece;
    rj->job.piece = run_piece;
    rj->job.total = total;
    return 0;
}

/* The buffer of ``o`` if it holds 8-byte signed integers (an int32 array would otherwise be
 * read as half as many rows); -1 with an error set (nothing held) if not. */
static int signed_rows(PyObject *o, Py_buffer *b, const char *what) {
    const char *f;
    if (PyObject_GetBuffer(o, b, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    f = b->format ? b->format : "B";
    if (f[0] == '<' || f[0] == '=' || f[0] == '@')
        f++;
    if (b->itemsize != 8 || strchr("qln", f[0]) == NULL || f[1] != '\0') {
        PyErr_Format(PyExc_ValueError, "copy_rows: %s must be int64 row numbers, not '%s'", what,
                     b->format ? b->format : "B");
        PyBuffer_Release(b);
        return -1;
    }
    return 0;
}

/* Parse (dst, src, dst_rows, src_rows, row_bytes, piece, threads=1) into ``rj`` (zeroed): row
 * dst_rows[i] of dst gets row src_rows[i] of src, rows ``row_bytes`` each; runs of rows consecutive
 * on both sides become one run. -1 with an error set (nothing held) if a row is outside. */
static int rows_prepare(runs_job *rj, PyObject *args, Py_ssize_t *threads) {
    Py_buffer *b = rj->bufs;
    Py_ssize_t row, piece, n, i, runs = 0, dcap, scap;
    const int64_t *d, *s;
    int64_t *dof, *sof, *len;
    PyObject *drows, *srows;
    if (!PyArg_ParseTuple(args, "w*y*OOnn|n", &b[0], &b[1], &drows, &srows, &row, &piece, threads))
        return -1;
    rj->held = 2;
    if (signed_rows(drows, &b[2], "dst_rows") < 0)
        goto fail;
    rj->held = 3;
    if (signed_rows(srows, &b[3], "src_rows") < 0)
        goto fail;
    rj->held = 4;
    n = b[2].len / 8;
    if (row <= 0) {
        PyErr_SetString(PyExc_ValueError, "copy_rows: a positive row size");
        goto fail;
    }
    if (!(d = int64s(&b[2], n, "dst_rows")) || !(s = int64s(&b[3], n, "src_rows")))
        goto fail;
    if ((rj->owned = PyMem_Malloc((size_t)(3 * n + 1) * sizeof(int64_t))) == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    dof = rj->owned;
    sof = dof + n;
    len = sof + n;
    dcap = b[0].len / row;
    scap = b[1].len / row;
    for (i = 0; i < n; i++) {
        if (d[i] < 0 || d[i] >= dcap || s[i] < 0 || s[i] >= scap) {
            PyErr_Format(PyExc_IndexError, "copy_rows: rows outside %zd destination / %zd source rows (row %zd: %lld <- %lld)",
                         dcap, scap, i, (long long)d[i], (long long)s[i]);
            goto fail;
        }
        if (runs && d[i] == d[i - 1] + 1 && s[i] == s[i - 1] + 1) {
            len[runs - 1] += row;
        } else {
            dof[runs] = d[i] * row; /* < len: no overflow */
            sof[runs] = s[i] * row;
            len[runs++] = row;
        }
    }
    PyBuffer_Release(&b[3]); /* the row numbers are read: only dst and src are held from here */
    PyBuffer_Release(&b[2]);
    rj->held = 2;
    rj->dof = dof;
    rj->sof = sof;
    rj->len = len;
    if (runs_plan(rj, runs, piece) == 0)
        return 0;
fail:
    runs_release(rj);
    return -1;
}

#endif
