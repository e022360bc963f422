/* Streaming (non-temporal) copies for the host copy (kernels/_copy.c), and the choice
 * of loop: the widest the CPU runs, chosen once at import. */
#ifndef KVTIER_STREAM_COPY_H
#define KVTIER_STREAM_COPY_H

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define KV_HAVE_STREAM 1
#endif

#define STREAM_MIN_BYTES (64 * 1024) /* smaller copies stay cached: an engine may read them next */

#ifdef KV_HAVE_STREAM
/* Streaming copy, four pages at a time: each pass takes the same 256 B of four
 * consecutive pages, prefetching ahead in each (glibc's large-copy loop does the
 * same). Measured on a 2-core Xeon host for 256 MiB over 2 threads: the plain
 * AVX2 streaming loop 18.8 ms, this loop with AVX2 15.3 ms, with AVX-512 13.9 ms,
 * numpy's copies (glibc memcpy) of each thread's half 15.6-17.9 ms. */
#define PAGE 4096
#define SPAN (4 * PAGE)
#define PASS 256

/* What both streaming loops share: the head copied plainly up to an ALIGN-byte boundary of
 * the destination (the stream stores need 32 or 64 B alignment), and one step of four vectors
 * loaded, then stored non-temporally. */
#define KV_ALIGN_HEAD(ALIGN)                                                                 \
    size_t head = ((ALIGN) - ((uintptr_t)d & ((ALIGN) - 1))) & ((ALIGN) - 1), i = 0;         \
    if (head > n)                                                                            \
        head = n;                                                                            \
    memcpy(d, s, head);                                                                      \
    d += head;                                                                               \
    s += head;                                                                               \
    n -= head;

#define KV_MOVE_4(VEC, LOAD, STORE, DST, SRC)                                                \
    do {                                                                                     \
        VEC a = LOAD((const void *)(SRC));                                                   \
        VEC b = LOAD((const void *)((SRC) + sizeof(VEC)));                                   \
        VEC c = LOAD((const void *)((SRC) + 2 * sizeof(VEC)));                               \
        VEC e = LOAD((const void *)((SRC) + 3 * sizeof(VEC)));                               \
        STORE((void *)(DST), a);                                                             \
        STORE((void *)((DST) + sizeof(VEC)), b);                                             \
        STORE((void *)((DST) + 2 * sizeof(VEC)), c);                                         \
        STORE((void *)((DST) + 3 * sizeof(VEC)), e);                                         \
    } while (0)

#define KV_COPY_4X(NAME, TARGET, VEC, LOAD, STORE)                                           \
    __attribute__((target(TARGET))) static void NAME(char *d, const char *s, size_t n) {     \
        KV_ALIGN_HEAD(PAGE) /* page-aligned stores from here */                              \
        for (; i + SPAN <= n; i += SPAN) {                                                   \
            for (size_t off = 0; off < PAGE; off += PASS) {                                  \
                for (size_t p = 0; p < 4; p++) {                                             \
                    const char *ss = s + i + p * PAGE + off;                                 \
                    char *dd = d + i + p * PAGE + off;                                       \
                    _mm_prefetch(ss + 2 * PASS, _MM_HINT_T0); /* never faults, even past s */ \
                    _mm_prefetch(ss + 2 * PASS + 64, _MM_HINT_T0);                           \
                    for (size_t v = 0; v < PASS; v += 4 * sizeof(VEC))                       \
                        KV_MOVE_4(VEC, LOAD, STORE, dd + v, ss + v);                         \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
        _mm_sfence(); /* streaming stores are weakly ordered: visible before the completion */ \
        memcpy(d + i, s + i, n - i);                                                         \
    }

/* Streaming copy, one linear sweep: non-temporal stores from a 64 B-aligned
 * destination, the source prefetched 1 KiB ahead with the non-temporal hint.
 * Measured on a 2-core AMD EPYC host (32 MiB L3), 256 MiB over 2 threads in 1 MiB
 * pieces in a C harness: 18.2 ms, the four-page loop 21.7 ms, glibc's memcpy 23.7 ms
 * (glibc's on one thread over the whole 256 MiB: 19-21 ms; through the mover's own call
 * the linear sweep 16.6 ms, the four-page loop 20.7); on one thread the four-page loop was the
 * slowest of the three there. Which loop is best depends on the CPU: the daemon
 * measures them once at start (tiers/copy_tuning.py). */
#define KV_COPY_LINEAR(NAME, TARGET, VEC, LOAD, STORE)                                       \
    __attribute__((target(TARGET))) static void NAME(char *d, const char *s, size_t n) {     \
        KV_ALIGN_HEAD(64) /* cache-line-aligned stores from here */                          \
        for (; i + 4 * sizeof(VEC) <= n; i += 4 * sizeof(VEC)) {                             \
            _mm_prefetch(s + i + 1024, _MM_HINT_NTA); /* never faults, even past s */        \
            KV_MOVE_4(VEC, LOAD, STORE, d + i, s + i);                                       \
        }                                                                                    \
        _mm_sfence();                                                                        \
        memcpy(d + i, s + i, n - i);                                                         \
    }

#define LOAD256(p) _mm256_loadu_si256((const __m256i *)(p))
#define STORE256(p, v) _mm256_stream_si256((__m256i *)(p), v)
KV_COPY_4X(copy_stream_avx2, "avx2", __m256i, LOAD256, STORE256)
KV_COPY_4X(copy_stream_avx512, "avx512f", __m512i, _mm512_loadu_si512, _mm512_stream_si512)
KV_COPY_LINEAR(copy_linear_avx2, "avx2", __m256i, LOAD256, STORE256)
KV_COPY_LINEAR(copy_linear_avx512, "avx512f", __m512i, _mm512_loadu_si512, _mm512_stream_si512)
#endif

/* The loops a large copy may take (index = kind; 0: memmove only; the four-page loops
 * keep their first names). At import: the widest four-page loop the CPU runs
 * (``default_stream``); the daemon may pick another by measuring (``use_streaming``). */
#define N_STREAM_KINDS 5
static const char *const stream_names[N_STREAM_KINDS] = {"none", "avx2", "avx512", "avx2_linear",
                                                         "avx512_linear"};
static int stream_kind;

/* Does this CPU run loop ``k``? */
static int stream_runs(int k) {
#ifdef KV_HAVE_STREAM
    __builtin_cpu_init();
    if (k == 1 || k == 3)
        return __builtin_cpu_supports("avx2") != 0;
    if (k == 2 || k == 4)
        return __builtin_cpu_supports("avx512f") != 0;
#endif
    return k == 0;
}

static void copy_one(char *d, const char *s, size_t n) {
#ifdef KV_HAVE_STREAM
    /* overlapping views of one array take memmove's path: the streaming loops copy forwards */
    if (stream_kind && n >= STREAM_MIN_BYTES && (d + n <= s || s + n <= d)) {
        switch (stream_kind) {
        case 1:
            copy_stream_avx2(d, s, n);
            return;
        case 2:
            copy_stream_avx512(d, s, n);
            return;
        case 3:
            copy_linear_avx2(d, s, n);
            return;
        case 4:
            copy_linear_avx512(d, s, n);
            return;
        default:
            break;
        }
    }
#endif
    memmove(d, s, n);
}

/* The widest four-page loop this CPU runs: the kind at import. */
static int default_stream(void) {
    return stream_runs(2) ? 2 : stream_runs(1) ? 1 : 0;
}

#endif
