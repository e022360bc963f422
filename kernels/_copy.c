/* Host-memory block copies for CPU pools (tiers/hostcopy.py), without the GIL.
 *
 * copy_rows (rows of one buffer to rows of another, as runs of bytes cut into pieces:
 * copy_runs.h) and copy_pairs (a list of (dst, src) buffers) hand their pieces to the
 * calling thread and to helper threads that never take the GIL (copy_pool.h), which
 * pull them one at a time from a shared counter, so the split follows whichever core is free. The
 * GIL is released for the whole copy: Python-level hand-offs had made each helper
 * wait for the interpreter whenever another thread was planning a move.
 *
 * Pieces of 64 KiB or more (a scattered block is one piece) are copied with
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

#include "copy_pool.h"
#include "copy_runs.h"
#include "stream_copy.h"

static int64_t lead_pieces = 4; /* see pool_start_lead: 4 MiB at most, ~0.2-0.3 ms */

/* Helpers for a copy of ``threads`` threads in all, ``joining`` of them the caller's. */
static int helpers_for(Py_ssize_t threads, int joining) {
    if (threads - joining < 1)
        return 0;
    return threads - joining > POOL_MAX_HELPERS ? POOL_MAX_HELPERS : (int)(threads - joining);
}

static void pair_piece(pool_job *job, int64_t i) {
    Py_buffer *v = (Py_buffer *)job->ctx;
    copy_one(v[2 * i].buf, v[2 * i + 1].buf, (size_t)v[2 * i].len);
    __atomic_fetch_add(&job->bytes, (int64_t)v[2 * i].len, __ATOMIC_RELAXED);
}

/* copy_pairs(dsts, srcs, threads=1): every (dst, src) pair, over the calling thread and
 * threads - 1 pool helpers; returns the pairs copied. */
static PyObject *py_copy_pairs(PyObject *self, PyObject *args) {
    PyObject *dsts, *srcs;
    Py_buffer *views = NULL;
    Py_ssize_t n, got = 0, i, threads = 1;
    PyObject *result = NULL;
    pool_job job = {0};
    (void)self;
    if (!PyArg_ParseTuple(args, "O!O!|n", &PyList_Type, &dsts, &PyList_Type, &srcs, &threads))
        return NULL;
    n = PyList_GET_SIZE(dsts);
    if (PyList_GET_SIZE(srcs) != n) {
        PyErr_SetString(PyExc_ValueError, "copy_pairs: lists of one length");
        return NULL;
    }
    views = PyMem_Calloc((size_t)(2 * n + 1), sizeof(Py_buffer));
    if (views == NULL)
        return PyErr_NoMemory();
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
    job.piece = pair_piece;
    job.total = n;
    job.ctx = views;
    Py_BEGIN_ALLOW_THREADS
    pool_start(&job, helpers_for(threads, 1));
    pool_join(&job, 1); /* (a child forked meanwhile lacks this thread: nothing there joins it) */
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(n);
release:
    for (i = 0; i < got; i++) {
        PyBuffer_Release(&views[2 * i]);
        PyBuffer_Release(&views[2 * i + 1]);
    }
    PyMem_Free(views);
    return result;
}

/* A copy's pieces are pulled one at a time by the calling thread and threads - 1 pool helpers;
 * buffers that share bytes are copied run by run, in order, each as memmove (on the calling
 * thread alone). No Python object a run: a scattered move of a thousand blocks costs an int64
 * array each way, where views had cost a microsecond or more each. A piece is the unit of
 * balance: the last one taken is all a copy waits for after every other thread is done.
 * copy_now: such a copy, done on return. */
static PyObject *copy_now(PyObject *args) {
    runs_job rj = {0};
    Py_ssize_t threads = 1;
    if (rows_prepare(&rj, args, &threads) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    if (rj.overlap) { /* pieces in parallel would read bytes another piece already wrote */
        for (int64_t r = 0; r < rj.runs; r++) {
            memmove(rj.dst + rj.dof[r], rj.src + rj.sof[r], (size_t)rj.len[r]);
            rj.job.bytes += rj.len[r];
        }
    } else {
        pool_start(&rj.job, helpers_for(threads, 1));
        pool_join(&rj.job, 1); /* (a child forked meanwhile lacks this thread: nothing there joins it) */
    }
    Py_END_ALLOW_THREADS
    runs_release(&rj);
    return PyLong_FromLongLong(rj.job.bytes);
}

/* copy_rows(dst, src, dst_rows, src_rows, row_bytes, piece, threads=1): row dst_rows[i] of dst
 * gets row src_rows[i] of src; the runs that rows consecutive on both sides make
 * (``rows_prepare``) are cut into pieces of at most ``piece`` bytes; returns the bytes copied. */
static PyObject *py_copy_rows(PyObject *self, PyObject *args) {
    (void)self;
    return copy_now(args);
}

/* A copy started by one thread and joined by another (``start_rows``). */
typedef struct {
    PyObject_HEAD
    runs_job rj;
    int joined;
} CopyJob;

static int copyjob_finish(CopyJob *self) { /* with the GIL; 0, or -1 if a fork orphaned it */
    int rc = 0;
    if (!self->joined) {
        Py_BEGIN_ALLOW_THREADS
        rc = pool_join(&self->rj.job, 0); /* its helpers copy it: a joiner pulling too oversubscribed */
        Py_END_ALLOW_THREADS
        self->joined = 1;
        runs_release(&self->rj);
    }
    return rc;
}

static PyObject *copyjob_join(CopyJob *self, PyObject *unused) {
    (void)unused;
    if (self->joined) {
        PyErr_SetString(PyExc_RuntimeError, "CopyJob.join: joined already");
        return NULL;
    }
    if (copyjob_finish(self) < 0) {
        PyErr_SetString(PyExc_RuntimeError, "CopyJob.join: the copy was in flight across a fork; its bytes "
                                            "are not all copied in this process");
        return NULL;
    }
    return PyLong_FromLongLong(self->rj.job.bytes);
}

static PyObject *copyjob_done(CopyJob *self, PyObject *unused) {
    (void)unused;
    return PyBool_FromLong(self->joined ||
                           __atomic_load_n(&self->rj.job.done, __ATOMIC_ACQUIRE) >= self->rj.job.total);
}

static PyObject *copyjob_wait(CopyJob *self, PyObject *args) {
    double seconds;
    int done = 1;
    if (!PyArg_ParseTuple(args, "d", &seconds))
        return NULL;
    if (!self->joined) {
        if (seconds < 0)
            seconds = 0;
        if (seconds > 1e6)
            seconds = 1e6;
        Py_BEGIN_ALLOW_THREADS
        done = pool_wait(&self->rj.job, seconds);
        Py_END_ALLOW_THREADS
    }
    return PyBool_FromLong(done);
}

static void copyjob_dealloc(CopyJob *self) {
    copyjob_finish(self); /* its buffers and pieces outlive no helper */
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef copyjob_methods[] = {
    {"join", (PyCFunction)copyjob_join, METH_NOARGS,
     "join() -> bytes copied: pull the pieces left, wait for the rest, release the buffers"},
    {"done", (PyCFunction)copyjob_done, METH_NOARGS, "done() -> whether every piece is copied"},
    {"wait", (PyCFunction)copyjob_wait, METH_VARARGS,
     "wait(seconds) -> whether every piece is copied, waiting up to seconds for it (join still releases)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject CopyJobType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvtier.kernels._copy.CopyJob",
    .tp_basicsize = sizeof(CopyJob),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A host copy in progress on the pool's helper threads (start_rows).",
    .tp_dealloc = (destructor)copyjob_dealloc,
    .tp_methods = copyjob_methods,
};

/* A copy of runs on ``threads`` helper threads, begun before this returns; the CopyJob's join()
 * finishes it (on any thread). */
static PyObject *start_job(PyObject *args) {
    Py_ssize_t threads = 1;
    CopyJob *job;
    job = PyObject_New(CopyJob, &CopyJobType);
    if (job == NULL)
        return NULL;
    memset(&job->rj, 0, sizeof(job->rj));
    job->joined = 1; /* nothing to wait for until it is started */
    if (rows_prepare(&job->rj, args, &threads) < 0) {
        Py_DECREF(job);
        return NULL;
    }
    if (job->rj.overlap) {
        PyErr_SetString(PyExc_ValueError, "start_rows: the buffers overlap; copy_rows copies such rows in order");
        runs_release(&job->rj);
        Py_DECREF(job); /* (joined is still 1: its dealloc waits for nothing) */
        return NULL;
    }
    job->joined = 0;
    /* with the GIL held: the pool's lock is held for microseconds, and no helper takes the GIL;
     * letting the GIL go here handed it to a thread that kept it for milliseconds (a lead, while
     * the helpers wake, is at most ``lead_pieces`` pieces: ~0.1 ms each) */
    pool_start_lead(&job->rj.job, helpers_for(threads, 0), lead_pieces);
    if (job->rj.job.want == 0 && job->rj.job.total > 0) {
        /* no helper could start (a thread limit): nobody would copy it before join(), and the
         * owner joins a started copy only once done() says it landed, so it is copied here */
        Py_BEGIN_ALLOW_THREADS
        pool_join(&job->rj.job, 1);
        Py_END_ALLOW_THREADS
    }
    return (PyObject *)job;
}

/* start_rows(dst, src, dst_rows, src_rows, row_bytes, piece, threads=1) -> CopyJob: copy_rows
 * begun on ``threads`` helper threads before this returns. */
static PyObject *py_start_rows(PyObject *self, PyObject *args) {
    (void)self;
    return start_job(args);
}

static PyObject *py_use_lead(PyObject *self, PyObject *args) {
    Py_ssize_t pieces, old = (Py_ssize_t)lead_pieces;
    (void)self;
    if (!PyArg_ParseTuple(args, "n", &pieces))
        return NULL;
    if (pieces < 0) {
        PyErr_SetString(PyExc_ValueError, "use_lead: pieces >= 0");
        return NULL;
    }
    lead_pieces = pieces;
    return PyLong_FromSsize_t(old);
}

static PyObject *py_led(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    return PyLong_FromLongLong(__atomic_load_n(&pool_led, __ATOMIC_RELAXED));
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
    for (k = 0; k < N_STREAM_KINDS; k++)
        if (strcmp(name, stream_names[k]) == 0)
            want = k;
    if (want < 0 || !stream_runs(want)) {
        PyErr_Format(PyExc_ValueError, "use_streaming: %s is not a loop this CPU runs (it runs: %s)", name,
                     stream_runs(2) ? "none, avx2, avx512, avx2_linear, avx512_linear"
                     : stream_runs(1) ? "none, avx2, avx2_linear" : "none");
        return NULL;
    }
    k = stream_kind;
    stream_kind = want;
    return PyUnicode_FromString(stream_names[k]);
}

static PyObject *py_streaming_kinds(PyObject *self, PyObject *args) {
    PyObject *out = PyList_New(0);
    (void)self;
    (void)args;
    if (out == NULL)
        return NULL;
    for (int k = 0; k < N_STREAM_KINDS; k++) {
        if (!stream_runs(k))
            continue;
        PyObject *name = PyUnicode_FromString(stream_names[k]);
        if (name == NULL || PyList_Append(out, name) != 0) {
            Py_XDECREF(name);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(name);
    }
    return out;
}

static PyMethodDef methods[] = {
    {"copy_pairs", py_copy_pairs, METH_VARARGS,
     "copy_pairs(dsts, srcs, threads=1) -> pairs copied: each (dst, src) pair, over the calling "
     "thread and threads - 1 helper threads, the GIL released"},
    {"copy_rows", py_copy_rows, METH_VARARGS,
     "copy_rows(dst, src, dst_rows, src_rows, row_bytes, piece, threads=1) -> bytes copied: row "
     "dst_rows[i] gets row src_rows[i] (int64 row numbers); the runs they make are cut into pieces of at "
     "most piece bytes, pulled by the calling thread and threads - 1 helper threads"},
    {"start_rows", py_start_rows, METH_VARARGS,
     "start_rows(dst, src, dst_rows, src_rows, row_bytes, piece, threads=1) -> CopyJob: copy_rows "
     "begun on threads helper threads before this returns; its join() finishes it"},
    {"use_lead", py_use_lead, METH_VARARGS,
     "use_lead(pieces) -> the previous count: pieces a started copy's caller copies itself while every "
     "helper is still asleep (0: none)"},
    {"led", py_led, METH_NOARGS, "led() -> pieces copied so far by the threads that started their copies"},
    {"streaming", py_streaming, METH_NOARGS,
     "streaming() -> the loop large copies take now: one of streaming_kinds() ('none': memmove)"},
    {"streaming_kinds", py_streaming_kinds, METH_NOARGS,
     "streaming_kinds() -> the loops this CPU runs: 'none' (memmove), then the four-page streaming loops "
     "('avx2', 'avx512'), then the linear ones ('avx2_linear', 'avx512_linear')"},
    {"use_streaming", py_use_streaming, METH_VARARGS,
     "use_streaming(kind) -> the previous kind: the loop every later large copy takes (set while no copy "
     "runs); a kind the CPU does not run raises ValueError and changes nothing"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_copy", NULL, -1, methods};

PyMODINIT_FUNC PyInit__copy(void) {
    stream_kind = default_stream();
    PyObject *m;
    if (pool_atfork() != 0) {
        PyErr_SetString(PyExc_OSError, "_copy: pthread_atfork failed");
        return NULL;
    }
    if (PyType_Ready(&CopyJobType) < 0 || (m = PyModule_Create(&module)) == NULL)
        return NULL;
    Py_INCREF(&CopyJobType);
    if (PyModule_AddObject(m, "CopyJob", (PyObject *)&CopyJobType) < 0) {
        Py_DECREF(&CopyJobType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
