/* Block I/O for the posix backend: one share of a batch, every block read or
 * written (and a read verified) without the GIL.
 *
 * The backend gives each I/O thread one share of a batch. In Python each block
 * of a share took the GIL back twice (around the call, then for its checksum),
 * and on a small host it waited for it behind the mover's planning: the disk
 * then had fewer than io_threads requests in flight, and a 256 KiB read ran at
 * 0.66-0.8 of a bare 8-thread O_DIRECT loop. Here the whole share runs in one
 * call; only a block that fails goes back to Python (tiers/io_backends.py redoes
 * it on its own path, which owns the error messages and the buffered fallback).
 *
 * transfer(write, fds, offsets, buffers, checks) -> list of status, one per job
 *   job j: buffers[j] (a sequence of up to KV_MAX_IOV contiguous buffers) moved
 *   to / from fds[j] at offsets[j] with pwritev / preadv, resumed after short
 *   transfers; checks[j] (reads only) is None or (length, checksum): the first
 *   buffer's first length bytes must have that block checksum (checksum.h).
 *   status: 0 done, an errno, KV_SHORT (end of file) or KV_MISMATCH.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <limits.h>
#include <sys/uio.h>
#include "checksum.h"

#define KV_MAX_IOV 8
#define KV_SHORT (-1)
#define KV_MISMATCH (-2)

typedef struct {
    int fd;
    long long offset;
    int n_iov;
    Py_buffer views[KV_MAX_IOV];
    int verify;
    size_t length;
    uint64_t expected;
    int status;
} job_t;

static void release_jobs(job_t *jobs, Py_ssize_t n) {
    for (Py_ssize_t j = 0; j < n; j++)
        for (int k = 0; k < jobs[j].n_iov; k++)
            PyBuffer_Release(&jobs[j].views[k]);
}

/* one job's bytes, resumed after short transfers; 0 or an error status */
static int move_job(job_t *job, int write) {
    struct iovec iov[KV_MAX_IOV];
    struct iovec *v = iov;
    int cnt = job->n_iov;
    size_t total = 0, done = 0;
    for (int k = 0; k < cnt; k++) {
        iov[k].iov_base = job->views[k].buf;
        iov[k].iov_len = (size_t)job->views[k].len;
        total += iov[k].iov_len;
    }
    while (done < total) {
        ssize_t r = write ? pwritev(job->fd, v, cnt, (off_t)(job->offset + (long long)done))
                          : preadv(job->fd, v, cnt, (off_t)(job->offset + (long long)done));
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return errno;
        }
        if (r == 0)
            return KV_SHORT;
        done += (size_t)r;
        while (cnt && (size_t)r >= v->iov_len) { /* drop whole views, trim the partial one */
            r -= (ssize_t)v->iov_len;
            v++;
            cnt--;
        }
        if (cnt && r) {
            v->iov_base = (char *)v->iov_base + r;
            v->iov_len -= (size_t)r;
        }
    }
    if (job->verify && kv_block_checksum((const unsigned char *)job->views[0].buf, job->length) != job->expected)
        return KV_MISMATCH;
    return 0;
}

/* parse job j from Python objects (GIL held); -1 with an exception set */
static int parse_job(job_t *job, PyObject *fd, PyObject *offset, PyObject *bufs, PyObject *check, int write) {
    long fd_value = PyLong_AsLong(fd);
    if (fd_value == -1 && PyErr_Occurred())
        return -1;
    if (fd_value < INT_MIN || fd_value > INT_MAX) {
        PyErr_Format(PyExc_OverflowError, "fd %ld is out of range", fd_value);
        return -1;
    }
    job->fd = (int)fd_value;
    job->offset = PyLong_AsLongLong(offset);
    if (job->offset == -1 && PyErr_Occurred())
        return -1;
    if (job->offset < 0) {
        PyErr_SetString(PyExc_ValueError, "negative offset");
        return -1;
    }
    long long total = 0;
    PyObject *seq = PySequence_Fast(bufs, "buffers[j] must be a sequence of buffers");
    if (seq == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n < 1 || n > KV_MAX_IOV) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError, "a job takes 1 to %d buffers, got %zd", KV_MAX_IOV, n);
        return -1;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, k), &job->views[k],
                               write ? PyBUF_C_CONTIGUOUS : (PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE)) < 0) {
            Py_DECREF(seq);
            return -1;
        }
        job->n_iov++;
        if (job->views[k].len > LLONG_MAX - job->offset - total) {
            Py_DECREF(seq);
            PyErr_SetString(PyExc_OverflowError, "offset + bytes exceed the largest file offset");
            return -1;
        }
        total += job->views[k].len;
    }
    Py_DECREF(seq);
    if (check != Py_None) {
        unsigned long long expected;
        Py_ssize_t length;
        if (write) {
            PyErr_SetString(PyExc_ValueError, "checks apply to reads only");
            return -1;
        }
        if (!PyTuple_Check(check)) {
            PyErr_SetString(PyExc_TypeError, "checks[j] must be None or a (length, checksum) tuple");
            return -1;
        }
        if (!PyArg_ParseTuple(check, "nK", &length, &expected))
            return -1;
        if (length < 0 || length > job->views[0].len) {
            PyErr_Format(PyExc_ValueError, "check length %zd outside the first buffer (%zd bytes)", length,
                         job->views[0].len);
            return -1;
        }
        job->verify = 1;
        job->length = (size_t)length;
        job->expected = (uint64_t)expected;
    }
    return 0;
}

static PyObject *py_transfer(PyObject *self, PyObject *args) {
    int write;
    PyObject *fds, *offsets, *buffers, *checks;
    (void)self;
    if (!PyArg_ParseTuple(args, "pOOOO", &write, &fds, &offsets, &buffers, &checks))
        return NULL;
    /* tuples, not PySequence_Fast (which hands back the caller's list itself): parsing an item can
     * run Python (an __index__), which could shrink a list under the loop below */
    PyObject *f = PySequence_Tuple(fds);
    PyObject *o = f ? PySequence_Tuple(offsets) : NULL;
    PyObject *b = o ? PySequence_Tuple(buffers) : NULL;
    PyObject *c = (b && checks != Py_None) ? PySequence_Tuple(checks) : NULL;
    PyObject *out = NULL;
    job_t *jobs = NULL;
    Py_ssize_t n = 0, parsed = 0;
    if (b == NULL || (checks != Py_None && c == NULL))
        goto done;
    n = PySequence_Fast_GET_SIZE(f);
    if (PySequence_Fast_GET_SIZE(o) != n || PySequence_Fast_GET_SIZE(b) != n ||
        (c && PySequence_Fast_GET_SIZE(c) != n)) {
        PyErr_SetString(PyExc_ValueError, "fds, offsets, buffers and checks differ in length");
        goto done;
    }
    jobs = PyMem_Calloc((size_t)(n ? n : 1), sizeof(job_t));
    if (jobs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; parsed < n; parsed++) {
        if (parse_job(&jobs[parsed], PySequence_Fast_GET_ITEM(f, parsed), PySequence_Fast_GET_ITEM(o, parsed),
                      PySequence_Fast_GET_ITEM(b, parsed), c ? PySequence_Fast_GET_ITEM(c, parsed) : Py_None,
                      write) < 0) {
            parsed++; /* its views taken so far are released below */
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t j = 0; j < n; j++)
        jobs[j].status = move_job(&jobs[j], write);
    Py_END_ALLOW_THREADS
    out = PyList_New(n);
    for (Py_ssize_t j = 0; out && j < n; j++) {
        PyObject *st = PyLong_FromLong(jobs[j].status);
        if (st == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, j, st);
    }
done:
    if (jobs) {
        release_jobs(jobs, parsed);
        PyMem_Free(jobs);
    }
    Py_XDECREF(f);
    Py_XDECREF(o);
    Py_XDECREF(b);
    Py_XDECREF(c);
    return out;
}

static PyObject *py_checksum(PyObject *self, PyObject *args) {
    Py_buffer view;
    Py_ssize_t length;
    uint64_t h;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*n", &view, &length))
        return NULL;
    if (length < 0 || length > view.len) {
        PyBuffer_Release(&view);
        PyErr_Format(PyExc_ValueError, "length %zd outside a buffer of %zd bytes", length, view.len);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    h = kv_block_checksum((const unsigned char *)view.buf, (size_t)length);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(h);
}

static PyMethodDef methods[] = {
    {"transfer", py_transfer, METH_VARARGS,
     "transfer(write, fds, offsets, buffers, checks) -> [status]: a share of block I/O without the GIL"},
    {"checksum", py_checksum, METH_VARARGS,
     "checksum(buffer, length) -> the block checksum of buffer[:length] (the value checksum.py defines)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_blockio", NULL, -1, methods};

PyMODINIT_FUNC PyInit__blockio(void) {
    PyObject *m = PyModule_Create(&module);
    if (m && (PyModule_AddIntConstant(m, "SHORT", KV_SHORT) < 0 || PyModule_AddIntConstant(m, "MISMATCH", KV_MISMATCH) < 0 ||
              PyModule_AddIntConstant(m, "MAX_IOV", KV_MAX_IOV) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
