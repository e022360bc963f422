/* Helper threads for the host copy (kernels/_copy.c) that never touch the interpreter.
 *
 * A copy is a job: a count of pieces and a function that copies piece i. Jobs are
 * posted to a FIFO; helpers (plain pthreads, made once and blocked on a condition
 * variable between jobs) take pieces of the oldest job that has some left, from
 * its atomic counter. A caller may join its job (pull pieces too, then wait for
 * the last), at once (a synchronous copy) or later (a copy started by one thread
 * and finished by another). A Python helper had to take the GIL to start and to
 * finish each copy, so a copy started while the daemon's owner thread ran Python
 * went single-threaded until the owner let go (measured here: 0.3-0.7 ms of a
 * 4 ms pass with one core idle).
 *
 * Helper k runs on the k-th CPU this process may use (round robin). Left to the
 * scheduler, the two helpers of a copy on a 2-core host often woke on one core
 * and shared it until a load balance moved one (a 256 MiB copy: 14.4 ms joined
 * by its caller, 16-20 ms with the caller asleep; pinned, 14.4 either way).
 * Pinning costs no balance: pieces are pulled, so a helper whose CPU is busy
 * with something else just copies fewer of them.
 *
 * A job stays in the FIFO from its start to its join (helpers look past one with
 * no piece left). A fork waits for no copy; the child, which has none of the
 * parent's threads, starts its own helpers, and a job not finished at the fork
 * fails there when joined (threads the child does not have were copying it).
 */
#ifndef KVTIER_COPY_POOL_H
#define KVTIER_COPY_POOL_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* sched_getaffinity, pthread_setaffinity_np, SCHED_BATCH */
#endif
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>

#define POOL_MAX_HELPERS 64

static int64_t pool_led; /* pieces copied by the threads that started them (``pool_start_lead``) */

typedef struct pool_job {
    void (*piece)(struct pool_job *job, int64_t i); /* copies piece i */
    void *ctx;                                      /* what ``piece`` reads */
    int64_t total;                                  /* pieces */
    int64_t next;                                   /* the next piece to take (atomic) */
    int64_t done;                                   /* pieces copied (atomic) */
    int64_t bytes;                                  /* bytes copied (atomic, by ``piece``) */
    int want;                                       /* helpers that may join */
    /* under pool.mu: */
    int joined;                                     /* helpers that joined */
    int active;                                     /* threads pulling its pieces now */
    int queued;                                     /* in the FIFO (from its start to its join) */
    int orphaned;                                   /* in flight across a fork: never finishes here */
    struct pool_job *link;                          /* the next job in the FIFO */
} pool_job;

static struct {
    pthread_mutex_t mu;  /* guards everything below and each job's fields marked so */
    pthread_cond_t wake; /* a job was posted */
    pthread_cond_t idle; /* a job finished */
    pool_job *head, *tail;
    int helpers; /* threads started */
    int awake;   /* helpers not blocked on ``wake`` (changed under mu, read atomically by a leader) */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER, NULL, NULL, 0, 0};

static int job_finished(pool_job *job) { /* under pool.mu */
    return job->active == 0 && __atomic_load_n(&job->done, __ATOMIC_ACQUIRE) >= job->total;
}

static void unlink_job(pool_job *job) { /* under pool.mu */
    pool_job **p = &pool.head, *prev = NULL;
    while (*p != NULL && *p != job) {
        prev = *p;
        p = &(*p)->link;
    }
    if (*p == NULL)
        return;
    *p = job->link;
    if (pool.tail == job)
        pool.tail = prev;
    job->link = NULL;
    job->queued = 0;
}

/* Pull pieces until none is left; then leave the job (under pool.mu on return). */
static void pull(pool_job *job) {
    for (;;) {
        int64_t i = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);
        if (i >= job->total)
            break;
        job->piece(job, i);
        __atomic_fetch_add(&job->done, 1, __ATOMIC_RELEASE);
    }
    pthread_mutex_lock(&pool.mu);
    job->active--;
    if (job_finished(job))
        pthread_cond_broadcast(&pool.idle);
}

static pool_job *next_job(void) { /* under pool.mu: the oldest job with pieces and room left */
    for (pool_job *j = pool.head; j != NULL; j = j->link)
        if (j->joined < j->want && __atomic_load_n(&j->next, __ATOMIC_RELAXED) < j->total)
            return j;
    return NULL;
}

/* The set of the k-th CPU the process may run on (its main thread's set, not the creating
 * thread's, which a thread inherits: a creator pinned to one CPU would have put every helper
 * there); 0 if there is none to name. */
static int kth_cpu(int k, cpu_set_t *one) {
#ifdef CPU_ISSET
    cpu_set_t allowed;
    int n, c, seen = 0;
    if (sched_getaffinity(getpid(), sizeof allowed, &allowed) != 0 || (n = CPU_COUNT(&allowed)) < 1)
        return 0;
    for (c = 0; c < CPU_SETSIZE; c++) {
        if (CPU_ISSET(c, &allowed) && seen++ == k % n) {
            CPU_ZERO(one);
            CPU_SET(c, one);
            return 1;
        }
    }
#else
    (void)k;
    (void)one;
#endif
    return 0;
}

/* Pin the calling thread to the k-th CPU (``kth_cpu``); left as it is if that fails. (A helper
 * is born pinned where its attributes allow: this is the fallback.) */
static void pin_to_kth_cpu(int k) {
    cpu_set_t one;
    if (kth_cpu(k, &one))
        pthread_setaffinity_np(pthread_self(), sizeof one, &one);
}

/* A helper does not preempt the thread that wakes it. Woken as a normal thread, the helper
 * pinned to the starter's CPU took that CPU from the starter at once and held it for 2-4 ms
 * (the scheduler's slice); the owner thread, which starts a descriptor's copy and then plans
 * the next, sat off-CPU meanwhile, the copy ran dry between descriptors and a 256 MiB
 * demotion in four took 0.4-0.5 ms longer (measured on a 2-core host: 20-30 of 160 starts
 * so delayed; none as SCHED_BATCH). A batch thread waits for the tick or for a free CPU
 * instead, and takes its fair share as ever: the copy still fills every core the owner
 * leaves. An engine's threads on those cores are not preempted by a wake-up either. */
static void batch_scheduling(void) {
#ifdef SCHED_BATCH
    struct sched_param none = {0};
    /* only from the normal policy the helper inherited: one an operator chose for the process
     * (SCHED_IDLE, real time) stays; this thread only (Linux); left as is if refused */
    if (sched_getscheduler(0) == SCHED_OTHER)
        sched_setscheduler(0, SCHED_BATCH, &none);
#endif
}

/* Attributes a helper is born with: its CPU, and batch scheduling where the creator runs the
 * normal policy. Set in the thread itself, both came after its first wake-up, which could
 * preempt the creator, and a helper seen between its start and those calls had neither. */
static void helper_attributes(pthread_attr_t *attr, int k) {
    cpu_set_t one;
    if (kth_cpu(k, &one))
        pthread_attr_setaffinity_np(attr, sizeof one, &one);
#ifdef SCHED_BATCH
    if (sched_getscheduler(0) == SCHED_OTHER) {
        struct sched_param none = {0};
        pthread_attr_setinheritsched(attr, PTHREAD_EXPLICIT_SCHED);
        pthread_attr_setschedpolicy(attr, SCHED_BATCH);
        pthread_attr_setschedparam(attr, &none);
    }
#endif
}

static void *pool_helper(void *arg) {
    pin_to_kth_cpu((int)(intptr_t)arg);
    batch_scheduling();
    pthread_mutex_lock(&pool.mu);
    __atomic_add_fetch(&pool.awake, 1, __ATOMIC_RELEASE);
    for (;;) {
        pool_job *job = next_job();
        if (job == NULL) {
            __atomic_sub_fetch(&pool.awake, 1, __ATOMIC_RELEASE);
            pthread_cond_wait(&pool.wake, &pool.mu);
            __atomic_add_fetch(&pool.awake, 1, __ATOMIC_RELEASE);
            continue;
        }
        job->joined++;
        job->active++;
        pthread_mutex_unlock(&pool.mu);
        pull(job); /* returns holding pool.mu */
    }
    return NULL;
}

/* Start helpers until there are ``n`` (under pool.mu); fewer if a thread cannot start. */
static void pool_grow(int n) {
    while (pool.helpers < n && pool.helpers < POOL_MAX_HELPERS) {
        pthread_t t;
        pthread_attr_t attr;
        sigset_t all, old;
        int rc;
        for (int born = 1; born >= 0; born--) { /* born pinned and batch; else as before, set inside */
            pthread_attr_init(&attr);
            pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
            pthread_attr_setstacksize(&attr, 256 * 1024);
            if (born)
                helper_attributes(&attr, pool.helpers);
            sigfillset(&all); /* signals stay with Python's threads */
            pthread_sigmask(SIG_SETMASK, &all, &old);
            rc = pthread_create(&t, &attr, pool_helper, (void *)(intptr_t)pool.helpers);
            pthread_sigmask(SIG_SETMASK, &old, NULL);
            pthread_attr_destroy(&attr);
            if (rc == 0)
                break;
        }
        if (rc != 0)
            return;
        /* named here, not by the helper: a helper that has not run yet (its CPU busy, or the
         * process under SCHED_IDLE) is already "kvtier-copy" to top and /proc */
        pthread_setname_np(t, "kvtier-copy");
        pool.helpers++;
    }
}

/* Post ``job`` for up to ``helpers`` helpers (its piece fields set, the rest zero); as many as
 * could be started (a thread limit, no memory): with none, it waits for its joiner to copy it.
 * With ``lead`` > 0 and every helper asleep, the caller copies up to ``lead`` pieces itself
 * until one wakes: a helper woken from idle took ~0.1-0.2 ms to run here (a virtual CPU's
 * wake-up), time in which the bare loop's caller is already copying. With a helper awake
 * (an earlier copy still running) the caller leads nothing: the copy is not waiting. */
static void pool_start_lead(pool_job *job, int helpers, int64_t lead) {
    int64_t led = 0;
    job->want = 0;
    if (helpers <= 0 || job->total <= 0)
        return;
    pthread_mutex_lock(&pool.mu);
    pool_grow(helpers);
    job->want = helpers < pool.helpers ? helpers : pool.helpers; /* none started: the joiner copies it */
    if (job->want == 0) {
        pthread_mutex_unlock(&pool.mu);
        return;
    }
    job->queued = 1;
    if (pool.tail != NULL)
        pool.tail->link = job;
    else
        pool.head = job;
    pool.tail = job;
    pthread_cond_broadcast(&pool.wake);
    lead = __atomic_load_n(&pool.awake, __ATOMIC_ACQUIRE) == 0 ? lead : 0;
    if (lead > 0)
        job->active++; /* (before a helper can see the job finished without this thread) */
    pthread_mutex_unlock(&pool.mu);
    if (lead <= 0)
        return;
    while (led < lead && __atomic_load_n(&pool.awake, __ATOMIC_ACQUIRE) == 0) {
        int64_t i = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);
        if (i >= job->total)
            break;
        job->piece(job, i);
        __atomic_fetch_add(&job->done, 1, __ATOMIC_RELEASE);
        led++;
    }
    __atomic_add_fetch(&pool_led, led, __ATOMIC_RELAXED);
    pthread_mutex_lock(&pool.mu);
    job->active--;
    if (job_finished(job))
        pthread_cond_broadcast(&pool.idle);
    pthread_mutex_unlock(&pool.mu);
}

static void pool_start(pool_job *job, int helpers) { pool_start_lead(job, helpers, 0); }

/* Wait until every piece of the job is copied and no helper still reads it, pulling the
 * pieces left too if ``help`` (or if it has no helpers). 0, or -1 for a job orphaned by a
 * fork. Call without the GIL. A copy started for ``threads`` helpers is joined without
 * help: on a host of two cores, the joining thread as a third copier slowed the copy. */
static int pool_join(pool_job *job, int help) {
    int ok;
    pthread_mutex_lock(&pool.mu);
    if (!job->orphaned) {
        if (help || job->want <= 0) {
            job->active++;
            pthread_mutex_unlock(&pool.mu);
            pull(job); /* returns holding pool.mu */
        }
        while (!job_finished(job) && !job->orphaned)
            pthread_cond_wait(&pool.idle, &pool.mu);
    }
    if (job->queued)
        unlink_job(job);
    ok = job->orphaned ? -1 : 0;
    pthread_mutex_unlock(&pool.mu);
    return ok;
}

/* Wait up to ``seconds`` for every piece of the job to be copied (no help, nothing released):
 * 1 if it is, 0 if not yet. Call without the GIL. */
static int pool_wait(pool_job *job, double seconds) {
    struct timespec until;
    int done;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += (time_t)seconds;
    until.tv_nsec += (long)((seconds - (double)(time_t)seconds) * 1e9);
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&pool.mu);
    while (!(done = __atomic_load_n(&job->done, __ATOMIC_ACQUIRE) >= job->total) && !job->orphaned)
        if (pthread_cond_timedwait(&pool.idle, &pool.mu, &until) != 0)
            break;
    done = __atomic_load_n(&job->done, __ATOMIC_ACQUIRE) >= job->total;
    pthread_mutex_unlock(&pool.mu);
    return done;
}

static void pool_before_fork(void) { pthread_mutex_lock(&pool.mu); }

static void pool_after_fork_parent(void) { pthread_mutex_unlock(&pool.mu); }

static void pool_after_fork_child(void) { /* only the forking thread exists here, in no join */
    for (pool_job *j = pool.head; j != NULL; j = j->link) {
        j->active = 0;
        j->queued = 0;
        j->orphaned = __atomic_load_n(&j->done, __ATOMIC_RELAXED) < j->total;
    }
    pool.head = pool.tail = NULL;
    pool.helpers = 0;
    pool.awake = 0;
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pthread_cond_init(&pool.idle, NULL);
}

static int pool_atfork(void) {
    return pthread_atfork(pool_before_fork, pool_after_fork_parent, pool_after_fork_child);
}

#endif
