/* The replay kernel's registers and state (kernels/_replay.c): one owner of the layout
 * that policy/value_compiled.py packs, shared by the kernel's parts. */
#ifndef KVTIER_REPLAY_STATE_H
#define KVTIER_REPLAY_STATE_H

#ifndef PY_SSIZE_T_CLEAN
#define PY_SSIZE_T_CLEAN
#endif
#include <Python.h>
#include <stdint.h>

/* ints: read/write */
enum { I_CLOCK, I_SIZE, I_POOL_AT, I_SHADOW_AT, I_BYPASSED, I_STAGED,
       /* ints: read only */
       I_REFRESH_EVERY, I_ACTIVE, I_CAPACITY, I_SAMPLES, I_ADMISSION, I_THRESHOLD, I_SHADOW_CAP,
       I_SHADOW_SAMPLES, I_K, I_SCORED, I_CALIBRATION_SAMPLE, I_N_AGES, I_N_CELLS, I_N_STAGES, I_N_IRR,
       I_N_BUCKETS, I_DECAY_RING, I_MAX_COUNT,
       I_FLOAT32_COMPARE, /* numpy >= 2 compares a Python float with a float32 in float32, 1.x in float64 */
       I_RECAL, I_RECAL_BINS, I_RECAL_RING, I_RECAL_PERIOD, I_RECAL_FOLDED, /* predictor/recalibration.py */
       /* ints: read/write again */
       I_RECAL_UNTRACKED, N_INTS };
/* floats: read only, then read/write */
enum { F_DECAYED, F_LOG_DECAY, F_INV_G, F_HORIZON, F_EV_SUM, F_EV_N, F_EVIDENCE_FLOOR, N_FLOATS };
/* arrays, in this order */
enum { A_BLOCKS, A_CLASSES, A_RESIDENT, A_LAST, A_COUNT, A_CELL, A_REUSES, A_ACCESSES, A_PERIOD_START,
       A_TABLES, A_PROB, A_STAGE_OF_COUNT, A_SLOTS, A_WHERE, A_POOL, A_MEMBER, A_SHADOW_SLOTS,
       A_SHADOW_SIZE, A_SHADOW_HITS, A_SHADOW_POOL, A_PRED, A_DEADLINE, A_STAGED_P, A_STAGED_Y,
       A_STAGED_D, A_PENDING_CODE, A_RECAL_FLOOR, A_RECAL_CEILING, A_DUE_N, A_DUE_P, A_REUSED, N_ARRAYS };

#define HASH 0x9E3779B1ULL
#define UNTRACKED 255 /* recalibration.UNTRACKED */

typedef struct {
    int64_t *blocks, *classes, *last, *stage_of_count, *slots, *pool, *sslots, *ssize, *spool;
    uint8_t *resident, *count, *member, *staged_y, *pending_code;
    int16_t *cell;
    int32_t *where;
    double *reuses, *accesses, *period_start, *shits, *staged_p, *due_n, *due_p, *reused;
    float *tables, *prob, *pred, *deadline, *staged_d, *recal_floor, *recal_ceiling;
    Py_ssize_t n_trace, n_blocks, n_pool, n_spool, n_staged;
} State;

#endif
