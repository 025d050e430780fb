/*
 * The Planner's exactly-once check (`PlannerCore._check`) in one pass: whether a plan
 * holds each selected sample once. Rows are (stream, epoch, seq) int64 triples; the
 * selected rows go into an open-addressing table keyed by the whole row, and each
 * planned row must find one not found before. No row is reduced to a hash alone: two
 * rows are the same only when their three values are.
 */
#include <stdlib.h>
#include <string.h>

#include "balance.h"

static uint64_t row_hash(const int64_t *r) {
    uint64_t h = (uint64_t)r[0] * 0x9E3779B97F4A7C15ULL;
    h ^= (uint64_t)r[1] + 0xBF58476D1CE4E5B9ULL + (h << 6) + (h >> 2);
    h ^= (uint64_t)r[2] + 0x94D049BB133111EBULL + (h << 6) + (h >> 2);
    h ^= h >> 33; /* murmur3's finaliser: every input bit reaches the low bits the mask keeps */
    h *= 0xFF51AFD7ED558CCDULL;
    h ^= h >> 33;
    h *= 0xC4CEB9FE1A85EC53ULL;
    h ^= h >> 33;
    return h;
}

static int same_row(const int64_t *a, const int64_t *b) { return a[0] == b[0] && a[1] == b[1] && a[2] == b[2]; }

int ovl_plan_same_once(const int64_t *given, int64_t n, const int64_t *wanted, int64_t m) {
    if (n != m) {
        return 0;
    }
    if (m == 0) {
        return 1;
    }
    uint64_t cap = 2;
    while (cap < 2 * (uint64_t)m) { /* at most half full: probes stay short */
        cap <<= 1;
    }
    int64_t *slot = malloc(cap * sizeof *slot); /* index of a wanted row, -1 when empty */
    unsigned char *seen = calloc((size_t)m, 1); /* whether a given row matched wanted row i */
    if (slot == NULL || seen == NULL) {
        free(slot);
        free(seen);
        return OVL_BAL_ENOMEM;
    }
    memset(slot, 0xFF, cap * sizeof *slot);
    uint64_t mask = cap - 1;
    int ok = 1;
    for (int64_t i = 0; ok && i < m; i++) {
        const int64_t *row = wanted + 3 * i;
        uint64_t at = row_hash(row) & mask;
        while (slot[at] >= 0 && !same_row(wanted + 3 * slot[at], row)) {
            at = (at + 1) & mask;
        }
        ok = slot[at] < 0; /* else a sample selected twice: the plan cannot hold each once */
        slot[at] = i;
    }
    for (int64_t i = 0; ok && i < n; i++) {
        const int64_t *row = given + 3 * i;
        uint64_t at = row_hash(row) & mask;
        for (;; at = (at + 1) & mask) {
            if (slot[at] < 0) {
                ok = 0; /* planned, never selected */
                break;
            }
            if (same_row(wanted + 3 * slot[at], row)) {
                ok = !seen[slot[at]]; /* planned twice when seen already */
                seen[slot[at]] = 1;
                break;
            }
        }
    }
    free(slot);
    free(seen);
    return ok; /* n == m distinct planned rows, each selected: every selected one is planned once */
}
