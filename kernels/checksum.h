/* The block checksum of kernels/checksum.py, in C: shared by _checksum.c (the
 * sum of word terms, for checksum.py) and _blockio.c (whole checksums of blocks
 * verified on the I/O thread that read them, without the GIL).
 *
 *   x_i = w_i * (2i + 1) * P;  term_i = x_i ^ (x_i >> 32)      (mod 2**64)
 *   s   = C * sum_i term_i  (+ the tail word's term * C)
 *   h   = fmix64(s ^ fmix64(length + K))
 */
#ifndef KVTIER_CHECKSUM_H
#define KVTIER_CHECKSUM_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define KV_P 0x9E3779B97F4A7C15ULL
#define KV_C 0xD6E8FEB86659FD93ULL
#define KV_K 0x27D4EB2F165667C5ULL

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
/* one build for every x86-64 host; the loader picks the AVX-512 copy (64-bit
 * vector multiplies) where the CPU has it */
#define KV_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define KV_CLONES
#endif

/* sum of term_i over the first n_words little-endian words of p (any alignment) */
KV_CLONES static uint64_t kv_sum_terms(const unsigned char *p, ptrdiff_t n_words) {
    uint64_t s0 = 0, s1 = 0, m = KV_P;
    const uint64_t step = 2 * KV_P;
    ptrdiff_t i = 0;
    for (; i + 1 < n_words; i += 2) { /* two sums: the adds do not wait on each other */
        uint64_t w0, w1, x0, x1;
        memcpy(&w0, p + 8 * i, 8);
        memcpy(&w1, p + 8 * i + 8, 8);
        x0 = w0 * m;
        x1 = w1 * (m + step);
        s0 += x0 ^ (x0 >> 32);
        s1 += x1 ^ (x1 >> 32);
        m += 2 * step;
    }
    if (i < n_words) {
        uint64_t w, x;
        memcpy(&w, p + 8 * i, 8);
        x = w * m;
        s0 += x ^ (x >> 32);
    }
    return s0 + s1;
}

static inline uint64_t kv_fmix64(uint64_t h) {
    h ^= h >> 33;
    h *= 0xFF51AFD7ED558CCDULL;
    h ^= h >> 33;
    h *= 0xC4CEB9FE1A85EC53ULL;
    return h ^ (h >> 33);
}

/* the whole checksum of p[:length] */
static inline uint64_t kv_block_checksum(const unsigned char *p, size_t length) {
    size_t n = length / 8, rest = length % 8;
    uint64_t s = kv_sum_terms(p, (ptrdiff_t)n) * KV_C;
    if (rest) { /* the tail word, zero-padded */
        uint64_t w = 0, x;
        memcpy(&w, p + 8 * n, rest);
        x = w * ((2 * (uint64_t)n + 1) * KV_P);
        s += (x ^ (x >> 32)) * KV_C;
    }
    return kv_fmix64(s ^ kv_fmix64(length + KV_K));
}

#endif
