/* The block table's bookkeeping when a memory-tier copy has landed, in one call
 * (tiers/landing.py).
 *
 * land(blocks, keep, src, dst, busy, inflight, copies, io_failures, slot_src, slot_owner_src,
 *      free_next, free_prev, free_owner, free_lengths, hbm_slot, hbm_slot_ns, namespace)
 * does for every block b of ``blocks``, in order, what numpy does in ``landing.land_numpy``:
 *
 *     busy[b] -= 1; inflight[b] = 0; copies[b] |= 1 << dst; io_failures[b] = 0
 *     hbm_slot_ns[hbm_slot[b]] = namespace[b]                 (dst is HBM: the three given)
 *     and where keep is false, the source slot goes back to its free list's tail:
 *     copies[b] &= ~(1 << src); slot_owner_src[slot_src[b]] = -1; slot_src[b] = -1
 *
 * Every index is checked before anything changes (a refusal changes nothing), and so are
 * repeats (a block named twice, two blocks naming one slot) and arguments sharing memory. numpy
 * took ~20 calls for it, each a pass over the blocks; after a 256 MiB copy has been
 * through the caches each call cost 5-40 us (measured on a 2-core host: ~280 us for
 * 1024 blocks, of a 15 ms move), this loop one pass.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "buffer_args.h"

enum { BLOCKS, KEEP, BUSY, INFLIGHT, COPIES, FAILURES, SLOT, OWNER, NEXT, PREV, LISTED, LENGTHS, HSLOT, HNS, NS, N_ARGS };

static const spec specs[N_ARGS] = {
    {"blocks", "qlLn", 8, 0, 0},      {"keep", "?", 1, 0, 0},           {"busy", "B", 1, 1, 0},
    {"inflight", "il", 4, 1, 0},      {"copies", "B", 1, 1, 0},         {"io_failures", "B", 1, 1, 0},
    {"slot_src", "il", 4, 1, 0},      {"slot_owner_src", "il", 4, 1, 0}, {"free_next", "il", 4, 1, 0},
    {"free_prev", "il", 4, 1, 0},     {"free_owner", "b", 1, 1, 0},     {"free_lengths", "qlLn", 8, 1, 0},
    {"hbm_slot", "il", 4, 0, 1},      {"hbm_slot_ns", "H", 2, 1, 1},    {"namespace", "H", 2, 0, 1},
};

#define LEN(k) (v[k].len / specs[k].itemsize)

#define MARK (-2) /* a source slot named by a block already checked (a free list's owner is -1 or >= 0) */

/* Every index the loop will follow, checked against the table as the loop will find it: a
 * block named twice, or two blocks naming one source slot, are refused too (each block's
 * transfer id and each dropped slot's list entry are marked while checking, then restored).
 * NULL, or the reason it would go astray. */
static const char *check(Py_buffer *v, int hbm) {
    const int64_t *blocks = v[BLOCKS].buf;
    const char *keep = v[KEEP].buf, *why = NULL;
    const int32_t *slot = v[SLOT].buf, *hslot = hbm ? v[HSLOT].buf : NULL, *prev = v[PREV].buf;
    int32_t *inflight = v[INFLIGHT].buf;
    int8_t *listed = v[LISTED].buf;
    const uint8_t *busy = v[BUSY].buf;
    Py_ssize_t n = LEN(BUSY), slots = LEN(OWNER), k = LEN(BLOCKS), i, j;
    if (LEN(KEEP) != k)
        return "keep has another length than blocks";
    if (LEN(INFLIGHT) != n || LEN(COPIES) != n || LEN(FAILURES) != n || LEN(SLOT) != n)
        return "the per-block columns differ in length";
    if (LEN(NEXT) != slots + 1 || LEN(PREV) != slots + 1 || LEN(LISTED) != slots || LEN(LENGTHS) < 1)
        return "the free list is not one list over the source slots";
    if (prev[slots] < 0 || prev[slots] > slots)
        return "the free list's tail is outside it";
    if (hbm && (LEN(HSLOT) != n || LEN(NS) != n))
        return "hbm_slot or namespace is not a per-block column";
    if (shared(v, specs, N_ARGS))
        return "two arguments share memory";
    for (i = 0; i < k; i++) {
        const int64_t b = blocks[i];
        if (b < 0 || b >= n) {
            why = "a block is outside the table";
            break;
        }
        if (inflight[b] < 0) { /* transfer ids are positive: marked, so named before */
            why = "a block is named twice";
            break;
        }
        if (busy[b] == 0) {
            why = "a block that was not moving";
            break;
        }
        if (hbm && (hslot[b] < 0 || hslot[b] >= LEN(HNS))) {
            why = "a block landed in HBM without an HBM slot";
            break;
        }
        if (!keep[i]) {
            const int32_t s = slot[b];
            if (s < 0 || s >= slots) {
                why = "a block to drop holds no source slot";
                break;
            }
            if (listed[s] != NIL) {
                why = listed[s] == MARK ? "two blocks name one source slot" : "a source slot is on a free list already";
                break;
            }
            listed[s] = MARK;
        }
        inflight[b] = ~inflight[b];
    }
    for (j = 0; j < i; j++) { /* the marks undone: blocks[0..i) were each marked once */
        const int64_t b = blocks[j];
        inflight[b] = ~inflight[b];
        if (!keep[j])
            listed[slot[b]] = NIL;
    }
    return why;
}

static PyObject *py_land(PyObject *self, PyObject *args) {
    PyObject *objs[N_ARGS];
    Py_buffer v[N_ARGS];
    int src, dst, hbm;
    const char *why;
    Py_ssize_t i, k, dropped = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOiiOOOOOOOOOOOOO", &objs[BLOCKS], &objs[KEEP], &src, &dst, &objs[BUSY],
                          &objs[INFLIGHT], &objs[COPIES], &objs[FAILURES], &objs[SLOT], &objs[OWNER], &objs[NEXT],
                          &objs[PREV], &objs[LISTED], &objs[LENGTHS], &objs[HSLOT], &objs[HNS], &objs[NS]))
        return NULL;
    if (src < 0 || src > 7 || dst < 0 || dst > 7 || src == dst) {
        PyErr_SetString(PyExc_ValueError, "land: src and dst are two tiers (0-7)");
        return NULL;
    }
    if (take("land", objs, v, specs, N_ARGS) < 0)
        return NULL;
    hbm = v[HSLOT].obj != NULL && v[HNS].obj != NULL && v[NS].obj != NULL;
    if ((why = check(v, hbm)) != NULL) {
        PyErr_Format(PyExc_ValueError, "land: %s", why);
        goto done;
    }
    {
        const int64_t *blocks = v[BLOCKS].buf;
        const char *keep = v[KEEP].buf;
        uint8_t *busy = v[BUSY].buf, *copies = v[COPIES].buf, *failures = v[FAILURES].buf;
        int32_t *inflight = v[INFLIGHT].buf, *slot = v[SLOT].buf, *owner = v[OWNER].buf;
        int32_t *next = v[NEXT].buf, *prev = v[PREV].buf;
        int8_t *listed = v[LISTED].buf;
        const int32_t sentinel = (int32_t)LEN(LISTED);
        int32_t tail = prev[sentinel];
        const uint8_t set = (uint8_t)(1u << dst), clear = (uint8_t)~(1u << src);
        k = LEN(BLOCKS);
        for (i = 0; i < k; i++) {
            const int64_t b = blocks[i];
            busy[b]--;
            inflight[b] = 0;
            copies[b] |= set;
            failures[b] = 0;
            if (hbm)
                ((uint16_t *)v[HNS].buf)[((const int32_t *)v[HSLOT].buf)[b]] = ((const uint16_t *)v[NS].buf)[b];
            if (!keep[i]) {
                const int32_t s = slot[b];
                copies[b] &= clear;
                owner[s] = NIL;
                slot[b] = NIL;
                next[tail] = s; /* to the free list's tail, in order */
                prev[s] = tail;
                listed[s] = 0;
                tail = s;
                dropped++;
            }
        }
        next[tail] = sentinel;
        prev[sentinel] = tail;
        ((int64_t *)v[LENGTHS].buf)[0] += dropped;
    }
done:
    release(v, N_ARGS);
    if (PyErr_Occurred())
        return NULL;
    return PyLong_FromSsize_t(dropped);
}

static PyMethodDef methods[] = {
    {"land", py_land, METH_VARARGS,
     "land(blocks, keep, src, dst, busy, inflight, copies, io_failures, slot_src, slot_owner_src, free_next, "
     "free_prev, free_owner, free_lengths, hbm_slot, hbm_slot_ns, namespace) -> source slots freed"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_land", NULL, -1, methods};

PyMODINIT_FUNC PyInit__land(void) { return PyModule_Create(&module); }
