/* Sorting kernels the balancers share (balance.c): internal to the native module, not
 * part of balance.h. Plain C11, no Python. */
#ifndef OVERLORD_BALANCE_SORT_H
#define OVERLORD_BALANCE_SORT_H

#include <stdint.h>
#include <string.h>

typedef struct {
    uint64_t key;
    int64_t idx;
} keyed;

enum { RADIX_BITS = 11, RADIX_BUCKETS = 1 << RADIX_BITS, RADIX_PASSES = (64 + RADIX_BITS - 1) / RADIX_BITS };

/* idx[0..len) := positions 0..len-1 ordered by key ascending, ties by position (numpy's
 * argsort(kind="stable")); tmp: len scratch entries. */
void ovl_sort_stable_order(const double *key, int64_t len, int64_t *idx, int64_t *tmp);

/* Stable LSD radix sort of a[0..n) by key; b: n scratch entries. Returns the array
 * (a or b) that holds the result. */
keyed *ovl_sort_radix(keyed *a, keyed *b, int64_t n, int64_t (*hist)[RADIX_BUCKETS]);

/* A non-negative double's sort key: its bits, which order as the values do (-0.0 as 0.0). */
static inline uint64_t ovl_sort_cost_key(double v) {
    v += 0.0; /* -0.0 + 0.0 is +0.0: both zeros tie */
    uint64_t bits;
    memcpy(&bits, &v, sizeof bits);
    return bits;
}

#endif /* OVERLORD_BALANCE_SORT_H */
