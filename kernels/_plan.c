/* The block table's bookkeeping of a memory-tier move's common case, in one call
 * (tiers/planning.py): every block named once, live, idle, with a copy in ``src`` and
 * none in ``dst``, unpinned where the source copy goes, and enough free ``dst`` slots.
 *
 * plan(blocks, keep_source, src, dst, tid, free_state, sealed_state, state, copies, busy,
 *      pins, inflight, slot_src, slot_dst, owner_dst, free_next, free_prev, free_owner,
 *      free_lengths, nbytes, src_slots, dst_slots, lengths, keep) -> None | bool
 *
 * returns None, having changed nothing, where a block is not that case (the caller's
 * numpy path then refuses the move, or plans what is left of it); else, for every block b
 * of ``blocks`` in order, it takes the front of dst's free list as b's dst slot (as
 * ``IndexLists.pop_front_n``), marks b moving (busy 1, inflight ``tid``), writes the
 * outputs src_slots, dst_slots, lengths (b's valid bytes) and keep (``keep_source`` and b
 * sealed), and returns whether any block has an NVMe copy (its idle-list entry then needs
 * refreshing).
 *
 * Why: after a large copy has been through the caches, numpy's ~25 calls for this cost
 * 5-20 us each (measured on a 2-core host: ~300 us before the first byte of a 64 MiB
 * descriptor of 256 blocks moved); this loop reads each block's columns once.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "buffer_args.h"

enum {
    BLOCKS, STATE, COPIES, BUSY, PINS, INFLIGHT, SLOT_SRC, SLOT_DST, OWNER, NEXT, PREV, LISTED, LENGTHS, NBYTES,
    OUT_SRC, OUT_DST, OUT_LEN, OUT_KEEP, N_ARGS
};

static const spec specs[N_ARGS] = {
    {"blocks", "qlLn", 8, 0, 0},     {"state", "B", 1, 0, 0},         {"copies", "B", 1, 1, 0},
    {"busy", "B", 1, 1, 0},          {"pins", "il", 4, 0, 0},         {"inflight", "il", 4, 1, 0},
    {"slot_src", "il", 4, 0, 0},     {"slot_dst", "il", 4, 1, 0},     {"owner_dst", "il", 4, 1, 0},
    {"free_next", "il", 4, 1, 0},    {"free_prev", "il", 4, 1, 0},    {"free_owner", "b", 1, 1, 0},
    {"free_lengths", "qlLn", 8, 1, 0}, {"nbytes", "IL", 4, 0, 0},     {"src_slots", "qlLn", 8, 1, 0},
    {"dst_slots", "qlLn", 8, 1, 0},  {"lengths", "qlLn", 8, 1, 0},    {"keep", "?", 1, 1, 0},
};

#define LEN(k) (v[k].len / specs[k].itemsize)
#define NVME_BIT 4u /* tier 2 (tiers/types.py) */

/* The arguments' shapes; NULL, or what is wrong (an error: the caller passed the wrong columns). */
static const char *shapes(Py_buffer *v) {
    Py_ssize_t n = LEN(STATE), slots = LEN(OWNER), k = LEN(BLOCKS);
    if (LEN(COPIES) != n || LEN(BUSY) != n || LEN(PINS) != n || LEN(INFLIGHT) != n || LEN(SLOT_SRC) != n ||
        LEN(SLOT_DST) != n || LEN(NBYTES) != n)
        return "the per-block columns differ in length";
    if (LEN(NEXT) != slots + 1 || LEN(PREV) != slots + 1 || LEN(LISTED) != slots || LEN(LENGTHS) < 1)
        return "the free list is not one list over the destination slots";
    if (LEN(OUT_SRC) != k || LEN(OUT_DST) != k || LEN(OUT_LEN) != k || LEN(OUT_KEEP) != k)
        return "an output is not one entry a block";
    if (shared(v, specs, N_ARGS))
        return "two arguments share memory";
    return NULL;
}

#define MARK (-2) /* a free-list entry already taken by this walk (a listed one is 0, an unlisted -1) */

/* Is every block the common case? Each block passed is marked (busy 1: a block named again
 * then fails), and the marks are undone unless all pass. The free list's first k entries
 * are walked into dst_slots too, each marked while walking (a list that comes round to an
 * entry again is broken), and the entry after them, whose link the splice rewrites, must be
 * the sentinel or listed. 1 if all pass (the walk's marks left for the caller to overwrite),
 * 0 if not (nothing changed), -1 with an error set if the free list is broken (nothing
 * changed). */
static int common_case(Py_buffer *v, int src, int dst, int keep_source, uint8_t free_state, uint8_t sealed_state) {
    const int64_t *blocks = v[BLOCKS].buf;
    const uint8_t *state = v[STATE].buf, *copies = v[COPIES].buf;
    uint8_t *busy = v[BUSY].buf;
    const int32_t *pins = v[PINS].buf, *slot_dst = v[SLOT_DST].buf, *next = v[NEXT].buf;
    int8_t *listed = v[LISTED].buf;
    int64_t *out_dst = v[OUT_DST].buf;
    const Py_ssize_t n = LEN(STATE), slots = LEN(OWNER), k = LEN(BLOCKS);
    const uint8_t have = (uint8_t)(1u << src), lack = (uint8_t)(1u << dst);
    Py_ssize_t i, j, walked = 0;
    int ok = 1;
    for (i = 0; i < k; i++) {
        const int64_t b = blocks[i];
        if (b < 0 || b >= n || state[b] == free_state || busy[b] != 0 || !(copies[b] & have) ||
            (copies[b] & lack) || slot_dst[b] != NIL ||
            (pins[b] != 0 && !(keep_source && state[b] == sealed_state))) { /* a pinned source copy stays */
            ok = 0;
            break;
        }
        busy[b] = 1;
    }
    if (ok && ((const int64_t *)v[LENGTHS].buf)[0] < k)
        ok = 0; /* too few free slots: the numpy path answers None */
    if (ok) {
        int32_t e = next[slots];
        for (walked = 0; walked < k; walked++) {
            if (e < 0 || e >= slots || listed[e] != 0)
                break;
            out_dst[walked] = e;
            listed[e] = MARK;
            e = next[e];
        }
        if (walked < k || !(e == slots || (e >= 0 && e < slots && listed[e] == 0))) {
            PyErr_SetString(PyExc_RuntimeError, "plan: the destination's free list is broken");
            ok = -1;
        }
    }
    if (ok != 1) {
        for (j = 0; j < walked; j++)
            listed[out_dst[j]] = 0; /* every entry marked was listed */
        for (j = 0; j < i; j++)
            busy[blocks[j]] = 0; /* every block marked had busy 0 */
    }
    return ok;
}

static PyObject *py_plan(PyObject *self, PyObject *args) {
    PyObject *objs[N_ARGS];
    Py_buffer v[N_ARGS];
    int src, dst, keep_source, ok = 0, nvme = 0;
    int free_state, sealed_state;
    long tid;
    const char *why;
    (void)self;
    if (!PyArg_ParseTuple(args, "OpiiliiOOOOOOOOOOOOOOOOO", &objs[BLOCKS], &keep_source, &src, &dst, &tid,
                          &free_state, &sealed_state, &objs[STATE], &objs[COPIES], &objs[BUSY], &objs[PINS],
                          &objs[INFLIGHT], &objs[SLOT_SRC], &objs[SLOT_DST], &objs[OWNER], &objs[NEXT],
                          &objs[PREV], &objs[LISTED], &objs[LENGTHS], &objs[NBYTES], &objs[OUT_SRC],
                          &objs[OUT_DST], &objs[OUT_LEN], &objs[OUT_KEEP]))
        return NULL;
    if (src < 0 || src > 7 || dst < 0 || dst > 7 || src == dst || tid <= 0 || tid > INT32_MAX || free_state < 0 ||
        free_state > 255 || sealed_state < 0 || sealed_state > 255) {
        PyErr_SetString(PyExc_ValueError, "plan: src and dst are two tiers (0-7), tid a positive int32, "
                                          "the states bytes");
        return NULL;
    }
    if (take("plan", objs, v, specs, N_ARGS) < 0)
        return NULL;
    if ((why = shapes(v)) != NULL) {
        PyErr_Format(PyExc_ValueError, "plan: %s", why);
        goto done;
    }
    ok = common_case(v, src, dst, keep_source, (uint8_t)free_state, (uint8_t)sealed_state);
    if (ok == 1) {
        const int64_t *blocks = v[BLOCKS].buf;
        const uint8_t *state = v[STATE].buf, *copies = v[COPIES].buf;
        const int32_t *slot_src = v[SLOT_SRC].buf;
        const uint32_t *nbytes = v[NBYTES].buf;
        int32_t *inflight = v[INFLIGHT].buf, *slot_dst = v[SLOT_DST].buf, *owner = v[OWNER].buf;
        int32_t *next = v[NEXT].buf, *prev = v[PREV].buf;
        int8_t *listed = v[LISTED].buf;
        int64_t *out_src = v[OUT_SRC].buf, *out_dst = v[OUT_DST].buf, *out_len = v[OUT_LEN].buf;
        char *out_keep = v[OUT_KEEP].buf;
        const Py_ssize_t k = LEN(BLOCKS);
        const int32_t sentinel = (int32_t)LEN(LISTED);
        int32_t after = k ? next[out_dst[k - 1]] : next[sentinel];
        for (Py_ssize_t i = 0; i < k; i++) {
            const int64_t b = blocks[i];
            const int32_t s = (int32_t)out_dst[i];
            next[s] = prev[s] = NIL; /* off the free list */
            listed[s] = NIL;
            owner[s] = (int32_t)b;
            slot_dst[b] = s;
            inflight[b] = (int32_t)tid;
            out_src[i] = slot_src[b];
            out_len[i] = nbytes[b];
            out_keep[i] = keep_source && state[b] == sealed_state;
            nvme |= (copies[b] & NVME_BIT) != 0;
        }
        next[sentinel] = after; /* the popped run spliced out */
        prev[after] = sentinel;
        ((int64_t *)v[LENGTHS].buf)[0] -= k;
    }
done:
    release(v, N_ARGS);
    if (PyErr_Occurred())
        return NULL;
    if (ok != 1)
        Py_RETURN_NONE;
    return PyBool_FromLong(nvme);
}

static PyMethodDef methods[] = {
    {"plan", py_plan, METH_VARARGS,
     "plan(blocks, keep_source, src, dst, tid, free_state, sealed_state, state, copies, busy, pins, inflight, "
     "slot_src, slot_dst, owner_dst, free_next, free_prev, free_owner, free_lengths, nbytes, src_slots, dst_slots, "
     "lengths, keep) -> None (not the common case: nothing changed) or whether a block has an NVMe copy"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_plan", NULL, -1, methods};

PyMODINIT_FUNC PyInit__plan(void) { return PyModule_Create(&module); }
