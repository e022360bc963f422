/* Replay's per-access path of the value policy, in one call for a run of accesses
 * (policy/value_compiled.py packs the state; policy/value.py is the reference).
 *
 * run(arrays, ints, floats, start, stop) -> (next, hits)
 *
 * Replays accesses start..stop-1 exactly as ValuePolicy.observe / admit / evict /
 * insert and replay.sim.simulate do (same integer and float operations in the same
 * order, so the same hits, the same model counts bit for bit and the same
 * calibration pairs), and stops *before* the first access it must not take:
 *
 *   - one that would rebuild the model's tables (every ``refresh_every`` accesses);
 *   - one that could draw past the end of the policy's or the shadows' pool of random
 *     positions (Python refills the pools with numpy's generator);
 *   - one whose calibration pairs might not fit the staging buffer;
 *   - one that would read or write anything out of range: a block id, feature class, cell,
 *     clock, random position, slot, reverse index or a prediction's recalibration bin (the
 *     hooks do with it what they do:
 *     raise, mostly), so corrupt state is never read here and the loop indexes freely.
 *
 * Python then takes that one access on the reference path and calls again. Everything
 * the run changes lives in the arrays given, and in ``ints`` / ``floats`` (the scalar
 * registers of replay_state.h, read and written back by the caller). Python's replay loop costs
 * ~25 us an access in ~10 interpreted calls; this costs well under 1 us.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "replay_state.h"
#include "replay_calibration.h"

static const struct { const char *name; const char *formats; Py_ssize_t itemsize; int written; } SPEC[N_ARRAYS] = {
    {"blocks", "qlQL", 8, 0}, {"classes", "qlQL", 8, 0}, {"resident", "?bB", 1, 1}, {"last", "qlQL", 8, 1},
    {"count", "B", 1, 1}, {"cell", "h", 2, 1}, {"reuses", "d", 8, 1}, {"accesses", "d", 8, 1},
    {"period_start", "d", 8, 0}, {"tables", "f", 4, 0}, {"prob", "f", 4, 0}, {"stage_of_count", "qlQL", 8, 0},
    {"slots", "qlQL", 8, 1}, {"where", "i", 4, 1}, {"pool", "qlQL", 8, 0}, {"member", "B", 1, 1},
    {"shadow_slots", "qlQL", 8, 1}, {"shadow_size", "qlQL", 8, 1}, {"shadow_hits", "d", 8, 1},
    {"shadow_pool", "qlQL", 8, 0}, {"pred", "f", 4, 1}, {"deadline", "f", 4, 1}, {"staged_p", "d", 8, 1},
    {"staged_y", "B", 1, 1}, {"staged_d", "f", 4, 1}, {"pending_code", "B", 1, 1}, {"recal_floor", "f", 4, 0},
    {"recal_ceiling", "f", 4, 0},
    {"due_n", "d", 8, 1}, {"due_p", "d", 8, 1}, {"reused", "d", 8, 1},
};

static int get(PyObject *o, Py_buffer *v, int i) {
    if (PyObject_GetBuffer(o, v, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS | (SPEC[i].written ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    const char *f = v->format ? v->format : "B";
    if (f[0] == '<' || f[0] == '=' || f[0] == '@')
        f++;
    if (v->itemsize != SPEC[i].itemsize || strchr(SPEC[i].formats, f[0]) == NULL || f[1] != '\0') {
        PyErr_Format(PyExc_TypeError, "run: %s has format '%s', not one of '%s' of %zd bytes", SPEC[i].name,
                     v->format ? v->format : "B", SPEC[i].formats, SPEC[i].itemsize);
        PyBuffer_Release(v);
        return -1;
    }
    return 0;
}

static inline Py_ssize_t len(const Py_buffer *v) { return v->len / v->itemsize; }

/* Every array's size against the registers, once a call: the loop then indexes freely. */
static int check_sizes(const Py_buffer *b, const int64_t *I) {
    Py_ssize_t n_blocks = len(&b[A_LAST]), table = I[I_N_AGES] * I[I_N_CELLS];
    struct { int a; Py_ssize_t want; int at_least; } need[] = {
        {A_CLASSES, len(&b[A_BLOCKS]), 0}, {A_RESIDENT, n_blocks, 0}, {A_COUNT, n_blocks, 0},
        {A_CELL, n_blocks, 0}, {A_WHERE, n_blocks, 0}, {A_MEMBER, n_blocks, 0},
        {A_REUSES, I[I_N_CELLS] * I[I_N_BUCKETS], 0}, {A_ACCESSES, I[I_N_CELLS], 0},
        {A_PERIOD_START, I[I_DECAY_RING], 0}, {A_TABLES, I[I_K] * table, 0}, {A_PROB, table, 0},
        {A_STAGE_OF_COUNT, I[I_MAX_COUNT] + 1, 1}, {A_SLOTS, I[I_CAPACITY], 0},
        {A_SHADOW_SLOTS, I[I_K] * I[I_SHADOW_CAP], 0}, {A_SHADOW_SIZE, I[I_K], 0}, {A_SHADOW_HITS, I[I_K], 0},
        {A_STAGED_Y, len(&b[A_STAGED_P]), 0}, {A_STAGED_D, len(&b[A_STAGED_P]), 0},
    };
    if (I[I_K] < 1 || I[I_K] > 8 || I[I_CAPACITY] < 1 || I[I_SAMPLES] < 1 || I[I_SHADOW_SAMPLES] < 1 ||
        I[I_SHADOW_CAP] < 1 || I[I_REFRESH_EVERY] < 1 || I[I_DECAY_RING] < 1 || I[I_CALIBRATION_SAMPLE] < 1 ||
        I[I_ACTIVE] < 0 || I[I_ACTIVE] >= I[I_K] || I[I_SIZE] < 0 || I[I_SIZE] > I[I_CAPACITY] ||
        I[I_N_AGES] < 1 || I[I_N_STAGES] < 1 || I[I_N_IRR] < 1 || I[I_N_STAGES] > 32767 || I[I_N_IRR] > 32767 ||
        I[I_N_BUCKETS] < 1 || I[I_MAX_COUNT] < 1 || /* (the two bounded before their product below) */
        I[I_MAX_COUNT] > 255 || I[I_N_CELLS] < I[I_N_STAGES] * I[I_N_IRR] || I[I_N_CELLS] > 32767 ||
        I[I_CLOCK] < 0 || I[I_CLOCK] >= ((int64_t)1 << 62) || I[I_THRESHOLD] < 0 ||
        n_blocks > ((Py_ssize_t)1 << 31) ||
        /* bounded before they are multiplied below: a product that wraps would pass a size check */
        I[I_N_AGES] > (1 << 20) || I[I_N_BUCKETS] > (1 << 16) || I[I_SHADOW_CAP] > ((int64_t)1 << 40) ||
        I[I_DECAY_RING] > (1 << 30) || I[I_SAMPLES] > ((int64_t)1 << 31) || I[I_SHADOW_SAMPLES] > ((int64_t)1 << 31)) {
        PyErr_SetString(PyExc_ValueError, "run: registers out of range");
        return -1;
    }
    for (size_t i = 0; i < sizeof need / sizeof need[0]; i++) {
        Py_ssize_t have = len(&b[need[i].a]);
        if (need[i].at_least ? have < need[i].want : have != need[i].want) {
            PyErr_Format(PyExc_ValueError, "run: %s has %zd elements, not %zd", SPEC[need[i].a].name, have,
                         need[i].want);
            return -1;
        }
    }
    for (int i = 0; i < I[I_K]; i++)
        if (((int64_t *)b[A_SHADOW_SIZE].buf)[i] < 0 || ((int64_t *)b[A_SHADOW_SIZE].buf)[i] > I[I_SHADOW_CAP]) {
            PyErr_SetString(PyExc_ValueError, "run: a shadow cache's size is out of range");
            return -1;
        }
    for (int64_t c = 0; c <= I[I_MAX_COUNT]; c++)
        if (((int64_t *)b[A_STAGE_OF_COUNT].buf)[c] < 0 || ((int64_t *)b[A_STAGE_OF_COUNT].buf)[c] >= I[I_N_STAGES]) {
            PyErr_SetString(PyExc_ValueError, "run: stage_of_count names a stage out of range");
            return -1;
        }
    return 0;
}

/* The age bucket of block ``b``'s table row, as ReuseModel.age_buckets computes it. */
static inline int64_t age_index(const State *s, const int64_t *I, double inv_g, int64_t clock, int64_t b) {
    double a = (double)(clock - s->last[b]) * inv_g;
    if (!(a >= 0.0)) /* (a negative or NaN granularity: the first bucket, never before the table) */
        a = 0.0;
    if (a > (double)(I[I_N_AGES] - 1))
        a = (double)(I[I_N_AGES] - 1);
    return (int64_t)a * I[I_N_CELLS] + s->cell[b];
}

/* ReuseModel.access, without the refresh (the caller stops before that access). */
static inline void model_access(State *s, int64_t *I, const double *F, int64_t b, int64_t cls) {
    int64_t clock = ++I[I_CLOCK];
    int64_t st = s->count[b], irr = 0;
    if (st) {
        int64_t d = clock - s->last[b];
        int64_t j = (int64_t)(2.0 * log2((double)d));
        if (j > I[I_N_BUCKETS] - 1)
            j = I[I_N_BUCKETS] - 1;
        int64_t r = I[I_REFRESH_EVERY], then = (clock - d - 1) / r, now = (clock - 1) / r;
        double weight;
        if (then == now)
            weight = 1.0;
        else if (now - then < I[I_DECAY_RING])
            weight = exp(F[F_DECAYED] - s->period_start[then % I[I_DECAY_RING]]);
        else
            weight = exp((double)(now - then) * F[F_LOG_DECAY]);
        s->reuses[s->cell[b] * I[I_N_BUCKETS] + j] += weight;
        irr = 1 + j / 4;
        if (irr > I[I_N_IRR] - 1)
            irr = I[I_N_IRR] - 1;
    }
    st = st + 1 < I[I_MAX_COUNT] ? st + 1 : I[I_MAX_COUNT];
    s->count[b] = (uint8_t)st;
    int64_t cell = (cls * I[I_N_STAGES] + s->stage_of_count[st]) * I[I_N_IRR] + irr;
    s->cell[b] = (int16_t)cell;
    s->accesses[cell] += 1.0;
    s->last[b] = clock;
}

/* The first lowest of ``n`` float32 values (numpy's argmin: the first NaN wins). */
#define LOWEST_STEP(v, i, best, best_v)                                               \
    if ((best) < 0 || (v) < (best_v) || (isnan(v) && !isnan(best_v))) {              \
        (best) = (i);                                                                 \
        (best_v) = (v);                                                               \
    }

/* ShadowCaches.access: every candidate's miniature takes sampled block ``b`` (the
 * positions and slots it reads were checked by ``must_stop``). */
static void shadows_access(State *s, int64_t *I, double inv_g, int64_t b) {
    int64_t K = I[I_K], cap = I[I_SHADOW_CAP], ss = I[I_SHADOW_SAMPLES], clock = I[I_CLOCK];
    Py_ssize_t table = I[I_N_AGES] * I[I_N_CELLS];
    int bits = s->member[b], full[8], n_full = 0;
    for (int k = 0; k < K; k++) {
        if (bits >> k & 1)
            s->shits[k] += 1.0;
        else if (s->ssize[k] < cap) {
            s->sslots[k * cap + s->ssize[k]] = b;
            s->ssize[k]++;
            bits |= 1 << k;
        } else
            full[n_full++] = k;
    }
    if (n_full) {
        const int64_t *pos = s->spool + I[I_SHADOW_AT];
        int64_t victim_at[8];
        int admitted[8];
        for (int r = 0; r < n_full; r++) {
            int k = full[r];
            Py_ssize_t best = -1;
            float best_v = 0.0f;
            for (int64_t j = 0; j < ss; j++) {
                float v = s->tables[k * table + age_index(s, I, inv_g, clock, s->sslots[k * cap + pos[r * ss + j]])];
                LOWEST_STEP(v, j, best, best_v)
                if (isnan(v))
                    break;
            }
            victim_at[r] = pos[r * ss + best];
            admitted[r] = s->tables[k * table + s->cell[b]] > best_v;
        }
        I[I_SHADOW_AT] += n_full * ss;
        for (int r = 0; r < n_full; r++)
            if (admitted[r]) {
                int k = full[r];
                int64_t *slot = &s->sslots[k * cap + victim_at[r]];
                s->member[*slot] &= (uint8_t)~(1u << k);
                *slot = b;
                bits |= 1 << k;
            }
    }
    s->member[b] = (uint8_t)bits;
}

static inline int sampled(const int64_t *I, int64_t b) {
    return (((uint64_t)b * HASH) & 0xFFFFFFFFULL) < (uint64_t)I[I_THRESHOLD];
}

/* A block id whose table row can be looked up: in range, a cell in range, an age >= 0. */
static inline int valid(const State *s, const int64_t *I, int64_t c) {
    return c >= 0 && c < s->n_blocks && s->cell[c] >= 0 && s->cell[c] < I[I_N_CELLS] && s->last[c] >= 0 &&
           s->last[c] <= I[I_CLOCK];
}

/* Whether access ``i`` must go to the reference path (module doc): before anything of it
 * is written, every index it may read or write is checked here. */
static inline int must_stop(const State *s, const int64_t *I, int64_t b, int64_t cls) {
    if ((I[I_CLOCK] + 1) % I[I_REFRESH_EVERY] == 0 || (I[I_SCORED] && I[I_STAGED] + 3 > s->n_staged))
        return 1;
    if (cls < 0 || cls >= I[I_N_CELLS] / (I[I_N_STAGES] * I[I_N_IRR]) || !valid(s, I, b) ||
        (s->count[b] && s->last[b] < 1))
        return 1;
    if (I[I_SCORED] && I[I_RECAL] && s->pending_code[b] >= I[I_K] * I[I_RECAL_BINS] && s->pending_code[b] != UNTRACKED)
        return 1;
    if (sampled(I, b)) {
        int64_t cap = I[I_SHADOW_CAP], ss = I[I_SHADOW_SAMPLES];
        if (I[I_SHADOW_AT] + I[I_K] * ss > s->n_spool)
            return 1;
        const int64_t *pos = s->spool + I[I_SHADOW_AT];
        for (int64_t k = 0, r = 0; k < I[I_K]; k++) {
            if ((s->member[b] >> k & 1) || s->ssize[k] < cap)
                continue;
            for (int64_t j = 0; j < ss; j++, r++) /* the draws of the r-th miniature that must evict */
                if (pos[r] < 0 || pos[r] >= cap || !valid(s, I, s->sslots[k * cap + pos[r]]))
                    return 1;
        }
    }
    if (s->resident[b] || I[I_SIZE] < I[I_CAPACITY])
        return 0;
    /* a miss of a full cache: the victim search's draws, candidates and the swap-remove */
    int draw = I[I_CAPACITY] > I[I_SAMPLES];
    if (draw && I[I_POOL_AT] + I[I_SAMPLES] > s->n_pool)
        return 1;
    int64_t n_cand = draw ? I[I_SAMPLES] : I[I_SIZE];
    for (int64_t j = 0; j < n_cand; j++) {
        int64_t at = draw ? s->pool[I[I_POOL_AT] + j] : j, c;
        if (at < 0 || at >= I[I_SIZE] || !valid(s, I, c = s->slots[at]) || s->where[c] != at || c == b)
            return 1;
    }
    int64_t last = s->slots[I[I_SIZE] - 1];
    return last < 0 || last >= s->n_blocks;
}

static void run(State *s, int64_t *I, double *F, Py_ssize_t *i, Py_ssize_t stop, int64_t *hits) {
    double inv_g = F[F_INV_G];
    Py_ssize_t table = I[I_N_AGES] * I[I_N_CELLS];
    const float *mine_table = s->tables + I[I_ACTIVE] * table;
    for (; *i < stop; (*i)++) {
        int64_t b = s->blocks[*i], cls = s->classes[*i];
        if (must_stop(s, I, b, cls))
            return;
        /* ValuePolicy.observe */
        if (scored(I, b))
            calib_access(s, I, b, (double)(I[I_CLOCK] + 1));
        model_access(s, I, F, b, cls);
        if (sampled(I, b))
            shadows_access(s, I, inv_g, b);
        if (s->resident[b]) {
            (*hits)++;
            continue;
        }
        int64_t clock = I[I_CLOCK];
        if (I[I_SIZE] < I[I_CAPACITY]) { /* admit without a victim; insert */
            s->slots[I[I_SIZE]] = b;
            s->where[b] = (int32_t)I[I_SIZE];
            I[I_SIZE]++;
            s->resident[b] = 1;
            continue;
        }
        /* ValuePolicy._find_victim over ``samples`` residents drawn from the pool */
        int draw = I[I_CAPACITY] > I[I_SAMPLES];
        Py_ssize_t n_cand = draw ? I[I_SAMPLES] : I[I_SIZE];
        const int64_t *pos = s->pool + I[I_POOL_AT];
        Py_ssize_t best = -1;
        float best_v = 0.0f;
        for (Py_ssize_t j = 0; j < n_cand; j++) {
            float v = mine_table[age_index(s, I, inv_g, clock, s->slots[draw ? pos[j] : j])];
            LOWEST_STEP(v, j, best, best_v)
            if (isnan(v))
                break;
        }
        if (draw)
            I[I_POOL_AT] += I[I_SAMPLES];
        int64_t victim = s->slots[draw ? pos[best] : best];
        /* ValuePolicy.admit */
        float mine = mine_table[s->cell[b]];
        if (scored(I, b))
            calib_predict(s, I, b, (double)s->prob[s->cell[b]], (double)clock, F[F_HORIZON]);
        /* ... and ValuePolicy._neither_reused: below the evidence floor, the resident stays */
        if (I[I_ADMISSION] && (!(mine > best_v) ||
                               (F[F_EVIDENCE_FLOOR] > 0.0 && (double)s->prob[s->cell[b]] < F[F_EVIDENCE_FLOOR] &&
                                (double)s->prob[age_index(s, I, inv_g, clock, victim)] < F[F_EVIDENCE_FLOOR]))) {
            I[I_BYPASSED]++;
            continue;
        }
        /* ValuePolicy.evict -> _record_eviction; then swap-remove and insert */
        F[F_EV_SUM] += (double)(clock - s->last[victim]);
        F[F_EV_N] += 1.0;
        if (scored(I, victim))
            calib_predict(s, I, victim, (double)s->prob[age_index(s, I, inv_g, clock, victim)], (double)clock,
                          F[F_HORIZON]);
        int64_t size = I[I_SIZE], at = s->where[victim], moved = s->slots[size - 1];
        s->slots[at] = moved;
        s->where[moved] = (int32_t)at;
        s->where[victim] = -1;
        s->resident[victim] = 0;
        s->slots[size - 1] = b;
        s->where[b] = (int32_t)(size - 1);
        s->resident[b] = 1;
    }
}

static PyObject *py_run(PyObject *self, PyObject *args) {
    PyObject *arrays, *o_ints, *o_floats;
    Py_ssize_t start, stop;
    Py_buffer b[N_ARRAYS], vi, vf;
    int got = 0, ok = 0;
    int64_t hits = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!OOnn", &PyTuple_Type, &arrays, &o_ints, &o_floats, &start, &stop))
        return NULL;
    if (PyTuple_GET_SIZE(arrays) != N_ARRAYS) {
        PyErr_Format(PyExc_ValueError, "run: %d arrays, not %zd", N_ARRAYS, PyTuple_GET_SIZE(arrays));
        return NULL;
    }
    if (PyObject_GetBuffer(o_ints, &vi, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
        return NULL;
    if (PyObject_GetBuffer(o_floats, &vf, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&vi);
        return NULL;
    }
    if (vi.itemsize != 8 || vi.len / 8 != N_INTS || vf.itemsize != 8 || vf.len / 8 != N_FLOATS ||
        strchr("qlQL", (vi.format ? vi.format : "B")[0]) == NULL || (vf.format ? vf.format : "B")[0] != 'd') {
        PyErr_Format(PyExc_ValueError, "run: ints must be %d int64, floats %d float64", N_INTS, N_FLOATS);
        goto done;
    }
    for (; got < N_ARRAYS; got++)
        if (get(PyTuple_GET_ITEM(arrays, got), &b[got], got) < 0)
            goto done;
    int64_t *I = vi.buf;
    double *F = vf.buf;
    if (check_sizes(b, I) < 0)
        goto done;
    State s = {
        .blocks = b[A_BLOCKS].buf, .classes = b[A_CLASSES].buf, .last = b[A_LAST].buf,
        .stage_of_count = b[A_STAGE_OF_COUNT].buf, .slots = b[A_SLOTS].buf, .pool = b[A_POOL].buf,
        .sslots = b[A_SHADOW_SLOTS].buf, .ssize = b[A_SHADOW_SIZE].buf, .spool = b[A_SHADOW_POOL].buf,
        .resident = b[A_RESIDENT].buf, .count = b[A_COUNT].buf, .member = b[A_MEMBER].buf,
        .staged_y = b[A_STAGED_Y].buf, .cell = b[A_CELL].buf, .where = b[A_WHERE].buf,
        .reuses = b[A_REUSES].buf, .accesses = b[A_ACCESSES].buf, .period_start = b[A_PERIOD_START].buf,
        .shits = b[A_SHADOW_HITS].buf, .staged_p = b[A_STAGED_P].buf, .tables = b[A_TABLES].buf,
        .prob = b[A_PROB].buf, .pred = b[A_PRED].buf, .deadline = b[A_DEADLINE].buf,
        .staged_d = b[A_STAGED_D].buf, .pending_code = b[A_PENDING_CODE].buf, .recal_floor = b[A_RECAL_FLOOR].buf,
        .recal_ceiling = b[A_RECAL_CEILING].buf,
        .due_n = b[A_DUE_N].buf, .due_p = b[A_DUE_P].buf, .reused = b[A_REUSED].buf, .n_trace = len(&b[A_BLOCKS]), .n_blocks = len(&b[A_LAST]),
        .n_pool = len(&b[A_POOL]), .n_spool = len(&b[A_SHADOW_POOL]), .n_staged = len(&b[A_STAGED_P]),
    };
    if (I[I_SCORED] && (len(&b[A_PRED]) != s.n_blocks || len(&b[A_DEADLINE]) != s.n_blocks)) {
        PyErr_SetString(PyExc_ValueError, "run: calibration arrays must cover every block");
        goto done;
    }
    if (I[I_SCORED] && I[I_RECAL] &&
        (I[I_RECAL_BINS] < 1 || I[I_RECAL_BINS] > UNTRACKED || I[I_K] * I[I_RECAL_BINS] > UNTRACKED || I[I_RECAL_RING] < 1 ||
         I[I_RECAL_RING] > ((int64_t)1 << 20) || I[I_RECAL_PERIOD] < 1 || I[I_RECAL_FOLDED] < 0 ||
         I[I_RECAL_FOLDED] > ((int64_t)1 << 52) || I[I_RECAL_UNTRACKED] < 0 || len(&b[A_PENDING_CODE]) != s.n_blocks ||
         len(&b[A_RECAL_FLOOR]) != I[I_K] * I[I_RECAL_BINS] || len(&b[A_RECAL_CEILING]) != I[I_K] * I[I_RECAL_BINS] ||
         len(&b[A_DUE_N]) != I[I_RECAL_RING] * I[I_K] * I[I_RECAL_BINS] ||
         len(&b[A_DUE_P]) != I[I_RECAL_RING] * I[I_K] * I[I_RECAL_BINS] ||
         len(&b[A_REUSED]) != I[I_RECAL_RING] * I[I_K] * I[I_RECAL_BINS])) {
        PyErr_SetString(PyExc_ValueError, "run: recalibration registers or arrays out of range");
        goto done;
    }
    if (start < 0 || stop > s.n_trace || start > stop) {
        PyErr_SetString(PyExc_IndexError, "run: start and stop must lie in the trace, start <= stop");
        goto done;
    }
    if (I[I_STAGED] < 0 || I[I_STAGED] > s.n_staged || I[I_POOL_AT] < 0 || I[I_POOL_AT] > s.n_pool ||
        I[I_SHADOW_AT] < 0 || I[I_SHADOW_AT] > s.n_spool) {
        PyErr_SetString(PyExc_ValueError, "run: a position register is out of range");
        goto done;
    }
    run(&s, I, F, &start, stop, &hits);
    ok = 1;
done:
    for (int i = 0; i < got; i++)
        PyBuffer_Release(&b[i]);
    PyBuffer_Release(&vf);
    PyBuffer_Release(&vi);
    if (!ok)
        return NULL;
    return Py_BuildValue("(nL)", start, (long long)hits);
}

static PyMethodDef methods[] = {
    {"run", py_run, METH_VARARGS,
     "run(arrays, ints, floats, start, stop) -> (next, hits): the value policy's replay of accesses "
     "start..stop-1, up to the first one the reference path must take"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_replay", NULL, -1, methods};

PyMODINIT_FUNC PyInit__replay(void) { return PyModule_Create(&module); }
