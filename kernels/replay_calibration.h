/* The replay kernel's calibration bookkeeping (kernels/_replay.c): CalibrationTracker and
 * Recalibrator (predictor/calibration.py, predictor/recalibration.py) per access, with the
 * same float operations in the same order. */
#ifndef KVTIER_REPLAY_CALIBRATION_H
#define KVTIER_REPLAY_CALIBRATION_H

#include <math.h>

#include "replay_state.h"

static inline int scored(const int64_t *I, int64_t b) {
    return I[I_SCORED] && ((((uint64_t)b * HASH) >> 7) % (uint64_t)I[I_CALIBRATION_SAMPLE]) == 0;
}

static inline void stage_pair(State *s, int64_t *I, float p, uint8_t y, float d) {
    Py_ssize_t n = I[I_STAGED];
    s->staged_p[n] = (double)p;
    s->staged_y[n] = y;
    s->staged_d[n] = d;
    I[I_STAGED] = n + 1;
}

/* ``now <= deadline`` as numpy compares a Python float with a float32 element. */
static inline int before(const int64_t *I, double now, float deadline) {
    return I[I_FLOAT32_COMPARE] ? (float)now <= deadline : now <= (double)deadline;
}

/* Recalibrator._slot: the ring row of a deadline's period, -1 outside the ring or not a
 * number; compared in double before any conversion (folded + ring < 2^53: exact). */
static inline int64_t ring_slot(const int64_t *I, float deadline) {
    double q = (double)deadline / (double)I[I_RECAL_PERIOD];
    if (!(q >= (double)I[I_RECAL_FOLDED] && q < (double)(I[I_RECAL_FOLDED] + I[I_RECAL_RING])))
        return -1;
    return (int64_t)floor(q) % I[I_RECAL_RING];
}

/* recalibration.bin_of: clamped before the conversion; UNTRACKED for NaN */
static inline int64_t bin_of(const int64_t *I, float p) {
    double x = (double)p * (double)I[I_RECAL_BINS];
    if (x != x)
        return UNTRACKED;
    return x < 0.0 ? 0 : x >= (double)(I[I_RECAL_BINS] - 1) ? I[I_RECAL_BINS] - 1 : (int64_t)x;
}

/* CalibrationTracker.access: a pending prediction of ``b`` resolves. */
static inline void calib_access(State *s, int64_t *I, int64_t b, double now) {
    float p = s->pred[b];
    if (p == p) {
        uint8_t y = (uint8_t)before(I, now, s->deadline[b]);
        stage_pair(s, I, p, y, s->deadline[b]);
        s->pred[b] = NAN;
        if (y && I[I_RECAL]) { /* Recalibrator.reuse */
            int64_t slot = ring_slot(I, s->deadline[b]), code = s->pending_code[b];
            if (code != UNTRACKED && slot >= 0)
                s->reused[slot * I[I_K] * I[I_RECAL_BINS] + code] += 1.0;
        }
    }
}

/* CalibrationTracker.predict */
static inline void calib_predict(State *s, int64_t *I, int64_t b, double p, double now, double horizon) {
    float old = s->pred[b];
    if (old == old) {
        if (before(I, now, s->deadline[b]))
            return;
        stage_pair(s, I, old, 0, s->deadline[b]);
    }
    s->deadline[b] = (float)(now + horizon);
    if (!I[I_RECAL]) {
        s->pred[b] = (float)p;
        return;
    }
    float pf = (float)p; /* Recalibrator.track, then .state, for the active model */
    int64_t bin = bin_of(I, pf), slot = ring_slot(I, s->deadline[b]), code = I[I_ACTIVE] * I[I_RECAL_BINS] + bin;
    if (bin != UNTRACKED && slot >= 0) {
        s->due_n[slot * I[I_K] * I[I_RECAL_BINS] + code] += 1.0;
        s->due_p[slot * I[I_K] * I[I_RECAL_BINS] + code] += (double)pf;
        s->pending_code[b] = (uint8_t)code;
    } else {
        s->pending_code[b] = UNTRACKED;
        I[I_RECAL_UNTRACKED]++;
    }
    if (bin == UNTRACKED) {
        s->pred[b] = pf;
        return;
    }
    float lo = s->recal_floor[code], hi = s->recal_ceiling[code];
    s->pred[b] = pf < lo ? lo : pf > hi ? hi : pf;
}

#endif
