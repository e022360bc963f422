/* Numpy columns handed to a kernel as buffers (kernels/_land.c, kernels/_plan.c): each
 * checked for its element type and writability as a spec says, and for sharing bytes with
 * another where one is written (the same array given as two columns: the loop's writes would
 * change what a later check had read). */
#ifndef KVTIER_BUFFER_ARGS_H
#define KVTIER_BUFFER_ARGS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#define NIL (-1)

typedef struct {
    const char *name, *formats;
    Py_ssize_t itemsize;
    int writable, optional;
} spec;

/* The buffers, as the spec says; -1 with an error set (and none held) if one is not. */
static int take(const char *fn, PyObject **objs, Py_buffer *views, const spec *specs, int n) {
    int i;
    for (i = 0; i < n; i++) {
        const char *f;
        memset(&views[i], 0, sizeof(Py_buffer));
        if (objs[i] == Py_None && specs[i].optional)
            continue;
        if (PyObject_GetBuffer(objs[i], &views[i],
                               PyBUF_FORMAT | PyBUF_C_CONTIGUOUS | (specs[i].writable ? PyBUF_WRITABLE : 0)) < 0)
            goto fail;
        f = views[i].format ? views[i].format : "B";
        if (f[0] == '<' || f[0] == '=' || f[0] == '@')
            f++;
        if (views[i].itemsize != specs[i].itemsize || strchr(specs[i].formats, f[0]) == NULL || f[1] != '\0') {
            PyErr_Format(PyExc_TypeError, "%s: %s has format '%s', not one of '%s' of %zd bytes", fn, specs[i].name,
                         views[i].format ? views[i].format : "B", specs[i].formats, specs[i].itemsize);
            PyBuffer_Release(&views[i]);
            goto fail;
        }
    }
    return 0;
fail:
    while (--i >= 0)
        if (views[i].obj != NULL)
            PyBuffer_Release(&views[i]);
    return -1;
}

static void release(Py_buffer *views, int n) {
    for (int i = 0; i < n; i++)
        if (views[i].obj != NULL)
            PyBuffer_Release(&views[i]);
}

/* Two arguments that share bytes, one of them written. */
static int shared(Py_buffer *v, const spec *specs, int n) {
    for (int a = 0; a < n; a++)
        for (int c = a + 1; c < n; c++)
            if (v[a].obj != NULL && v[c].obj != NULL && (specs[a].writable || specs[c].writable) &&
                (const char *)v[a].buf < (const char *)v[c].buf + v[c].len &&
                (const char *)v[c].buf < (const char *)v[a].buf + v[a].len)
                return 1;
    return 0;
}

#endif
