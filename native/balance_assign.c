/*
 * The shipped two-level balance in one call (`_assign.assign` with its defaults): the
 * kernels of balance.c composed as the Python glue between them composes them, step for
 * step, so the bins are the same bit for bit (tests/plan/test_balance_native.py).
 */
#include <math.h>
#include <stdlib.h>

#include "balance.h"

/* numpy's sum of a contiguous float64 array (add.reduce: pairwise, 8 lanes, blocks of
 * 128), so `stop` is the float numpy computes for loads.mean() * (1 + tol). */
static double numpy_sum(const double *a, int64_t n) {
    if (n < 8) {
        double res = 0.0;
        for (int64_t i = 0; i < n; i++) {
            res += a[i];
        }
        return res;
    }
    if (n <= 128) {
        double r[8];
        int64_t i;
        for (int j = 0; j < 8; j++) {
            r[j] = a[j];
        }
        for (i = 8; i < n - (n % 8); i += 8) {
            for (int j = 0; j < 8; j++) {
                r[j] += a[i + j];
            }
        }
        double res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; i++) {
            res += a[i];
        }
        return res;
    }
    int64_t n2 = n / 2;
    n2 -= n2 % 8;
    return numpy_sum(a, n2) + numpy_sum(a + n2, n - n2);
}

int ovl_bal_two_level(const double *c, int64_t n, int64_t buckets, int64_t bins, double tol, int64_t *bucket,
                      int64_t *mbin) {
    int rc = OVL_BAL_ENOMEM;
    int64_t *lpt = malloc((size_t)(n ? n : 1) * sizeof *lpt);
    int64_t *rank_bin = malloc((size_t)(n ? n : 1) * sizeof *rank_bin);
    int64_t *by_bucket = malloc((size_t)(n ? n : 1) * sizeof *by_bucket);
    int64_t *start = calloc((size_t)buckets + 1, sizeof *start);
    int64_t *slot = malloc((size_t)buckets * sizeof *slot);
    double *vals = malloc((size_t)(n ? n : 1) * sizeof *vals);
    int64_t *table = NULL;
    double *loads = NULL, *cn = NULL, *cz = NULL;
    if (!lpt || !rank_bin || !by_bucket || !start || !slot || !vals) {
        goto out;
    }
    /* inter: equal-count Karmarkar-Karp over the LPT order */
    if (ovl_bal_cost_order(c, n, 1, lpt) != OVL_BAL_OK) {
        goto out;
    }
    for (int64_t i = 0; i < n; i++) {
        vals[i] = c[lpt[i]];
    }
    if (ovl_bal_differencing(vals, n, buckets, 1, rank_bin) != OVL_BAL_OK) {
        goto out;
    }
    for (int64_t i = 0; i < n; i++) {
        bucket[lpt[i]] = rank_bin[i];
    }
    /* swap refinement of the buckets (`_refine._refine_pairs`, 4k swaps at most) */
    if (n >= 2 && buckets >= 2) {
        for (int64_t i = 0; i < n; i++) {
            start[bucket[i] + 1]++;
        }
        int64_t m = 0;
        double top = 0.0;
        for (int64_t b = 1; b <= buckets; b++) {
            m = start[b] > m ? start[b] : m;
        }
        for (int64_t i = 0; i < n; i++) {
            top = c[i] > top ? c[i] : top;
        }
        double scale = top != 0.0 ? top : 1.0;
        table = malloc((size_t)(buckets * m) * sizeof *table);
        loads = malloc((size_t)buckets * sizeof *loads);
        cn = malloc((size_t)(n + 1) * sizeof *cn);
        cz = malloc((size_t)(n + 1) * sizeof *cz);
        if (!table || !loads || !cn || !cz) {
            goto out;
        }
        if (ovl_bal_bin_table(bucket, c, n, buckets, m, table, loads) != OVL_BAL_OK) {
            goto out;
        }
        for (int64_t i = 0; i < n; i++) {
            cn[i] = c[i] / scale;
            cz[i] = c[i];
        }
        cn[n] = 1.0;
        cz[n] = 0.0;
        double stop = numpy_sum(loads, buckets) / (double)buckets * (1.0 + tol);
        if (ovl_bal_refine_pairs(cn, cz, n, table, buckets, m, loads, stop, scale, 4 * buckets, bucket) !=
            OVL_BAL_OK) {
            goto out;
        }
        for (int64_t b = 0; b <= buckets; b++) {
            start[b] = 0;
        }
    }
    /* intra: LPT in every bucket, its items by bucket then LPT order (a stable counting sort) */
    for (int64_t i = 0; i < n; i++) {
        start[bucket[i] + 1]++;
        mbin[i] = -1;
    }
    for (int64_t b = 0; b < buckets; b++) {
        start[b + 1] += start[b];
    }
    for (int64_t b = 0; b < buckets; b++) {
        slot[b] = start[b];
    }
    for (int64_t i = 0; i < n; i++) {
        by_bucket[slot[bucket[lpt[i]]]++] = lpt[i];
    }
    rc = ovl_bal_greedy_groups(c, NULL, INFINITY, by_bucket, start, buckets, bins, mbin);
out:
    free(lpt);
    free(rank_bin);
    free(by_bucket);
    free(start);
    free(slot);
    free(vals);
    free(table);
    free(loads);
    free(cn);
    free(cz);
    return rc;
}
