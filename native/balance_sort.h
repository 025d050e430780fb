/* Sorting kernels the balancers share: included by balance.c only (static, so they
 * compile into its unit as before and inline where they did), not part of balance.h.
 * Plain C11, no Python. */
#ifndef OVERLORD_BALANCE_SORT_H
#define OVERLORD_BALANCE_SORT_H

#include <stdint.h>
#include <string.h>

typedef struct {
    uint64_t key;
    int64_t idx;
} keyed;

enum { RADIX_BITS = 11, RADIX_BUCKETS = 1 << RADIX_BITS, RADIX_PASSES = (64 + RADIX_BITS - 1) / RADIX_BITS };

/* idx[0..len) := positions 0..len-1 ordered by key ascending, ties by position (what
 * numpy's argsort(kind="stable") gives). tmp: len scratch entries. Bottom-up merge sort
 * with a branch-free merge step (the comparisons are data-dependent coin flips, which a
 * branch mispredicts half the time): stable, since a tie takes from the left run. */
static void ovl_sort_stable_order(const double *key, int64_t len, int64_t *idx, int64_t *tmp) {
    for (int64_t i = 0; i < len; i++) {
        idx[i] = i;
    }
    int64_t *src = idx, *dst = tmp;
    for (int64_t width = 1; width < len; width *= 2) {
        for (int64_t lo = 0; lo < len; lo += 2 * width) {
            int64_t mid = lo + width < len ? lo + width : len;
            int64_t hi = lo + 2 * width < len ? lo + 2 * width : len;
            int64_t a = lo, b = mid, o = lo;
            while (a < mid && b < hi) {
                int64_t ia = src[a], ib = src[b];
                int take_b = key[ib] < key[ia];
                dst[o++] = take_b ? ib : ia;
                b += take_b;
                a += !take_b;
            }
            while (a < mid) {
                dst[o++] = src[a++];
            }
            while (b < hi) {
                dst[o++] = src[b++];
            }
        }
        int64_t *t = src;
        src = dst;
        dst = t;
    }
    if (src != idx) {
        memcpy(idx, src, (size_t)len * sizeof *idx);
    }
}

/* Stable LSD radix sort of a[0..n) by key; b: n scratch entries. Returns the array
 * (a or b) that holds the result. Passes where every key has the same digit are skipped. */
static keyed *ovl_sort_radix(keyed *a, keyed *b, int64_t n, int64_t (*hist)[RADIX_BUCKETS]) {
    memset(hist, 0, RADIX_PASSES * sizeof *hist);
    for (int64_t i = 0; i < n; i++) {
        for (int p = 0; p < RADIX_PASSES; p++) {
            hist[p][(a[i].key >> (p * RADIX_BITS)) & (RADIX_BUCKETS - 1)]++;
        }
    }
    for (int p = 0; p < RADIX_PASSES; p++) {
        int64_t *h = hist[p], total = 0;
        int trivial = 0;
        for (int d = 0; d < RADIX_BUCKETS; d++) {
            trivial |= h[d] == n; /* every key has this digit: the pass would change nothing */
            int64_t cnt = h[d];
            h[d] = total;
            total += cnt;
        }
        if (trivial) {
            continue;
        }
        for (int64_t i = 0; i < n; i++) { /* stable: equal digits keep their order */
            b[h[(a[i].key >> (p * RADIX_BITS)) & (RADIX_BUCKETS - 1)]++] = a[i];
        }
        keyed *t = a;
        a = b;
        b = t;
    }
    return a;
}

/* A non-negative double's sort key: its bits, which order as the values do (-0.0 as 0.0). */
static inline uint64_t ovl_sort_cost_key(double v) {
    v += 0.0; /* -0.0 + 0.0 is +0.0: both zeros tie */
    uint64_t bits;
    memcpy(&bits, &v, sizeof bits);
    return bits;
}

#endif /* OVERLORD_BALANCE_SORT_H */
