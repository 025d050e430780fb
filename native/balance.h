/*
 * Overlord balancing kernels: the three loops of the Planner's `balance` that numpy
 * can only run as many small calls (overlord/plan/balance/_kk.py, _greedy.py,
 * _refine.py). Each is the step-for-step twin of its Python form: the same order of
 * floating-point operations, the same tie-breaks (by position, then index), so both
 * give the same bins bit for bit (tests/plan/test_balance_native.py checks it).
 * Python validates every argument and owns every array; C only reads and writes them.
 *
 * Arrays are C-contiguous: double = float64, int64_t = int64. Sizes are element counts.
 * Every function returns OVL_BAL_OK, or OVL_BAL_ENOMEM when a scratch allocation fails
 * (nothing written to the outputs is meaningful then).
 */
#ifndef OVERLORD_BALANCE_H
#define OVERLORD_BALANCE_H

#include <stdint.h>

#define OVL_BAL_OK 0
#define OVL_BAL_ENOMEM (-1)

/*
 * out[0..n) := indices of c (finite, >= 0) by cost, ascending or (descending != 0)
 * descending, ties by index: a stable LSD radix sort of the costs' bit patterns
 * (-0.0 counts as 0.0), so it is the one order a stable sort gives.
 */
int ovl_bal_cost_order(const double *c, int64_t n, int descending, int64_t *out);

/*
 * Largest differencing of vals[0..m) (sorted descending) into k subsets; bin[i] gets
 * the subset of item i, subsets numbered by decreasing sum. equal_count != 0 starts
 * from chunks of k consecutive items (the equal-size variant), else from singletons.
 * Partitions are popped largest spread first, ties by creation order.
 */
int ovl_bal_differencing(const double *vals, int64_t m, int64_t k, int equal_count, int64_t *bin);

/*
 * LPT in every group: order[start[g]..start[g+1]) are group g's items, largest cost
 * first; each goes to the bin (of k) with the least load, the first on a tie, among
 * those where used + sizes[i] <= capacity (every bin when sizes is NULL). An item no
 * bin can take keeps bin[i] as it was (-1). bin is indexed by item.
 */
int ovl_bal_greedy_groups(const double *costs, const double *sizes, double capacity, const int64_t *order,
                          const int64_t *start, int64_t groups, int64_t k, int64_t *bin);

/*
 * The members of each bin as a table of k rows of m (item indices in index order,
 * -1 pads) and each bin's load, the costs summed in index order: bin[n] in [-1, k),
 * no bin holding more than m items.
 */
int ovl_bal_bin_table(const int64_t *bin, const double *costs, int64_t n, int64_t k, int64_t m, int64_t *table,
                      double *loads);

/*
 * Pairwise swap refinement (`_refine._refine_pairs`). table[k*m]: each bin's members
 * (item index, -1 pads), updated in place; loads[k] updated in place; bin[n] (by item)
 * updated in place. cn[n+1] = costs / scale with cn[n] = 1.0 (a pad); cz[n+1] = costs
 * with cz[n] = 0.0. Stops once no bin is above `stop`, when no pair can swap, or after
 * max_swaps swaps.
 */
int ovl_bal_refine_pairs(const double *cn, const double *cz, int64_t n, int64_t *table, int64_t k, int64_t m,
                         double *loads, double stop, double scale, int64_t max_swaps, int64_t *bin);

/*
 * `_assign.assign(costs, buckets, bins)` with its defaults in one call
 * (balance_assign.c): equal-count Karmarkar-Karp over buckets in the LPT order, the
 * pairwise swap refinement (tolerance tol, 4 * buckets swaps at most), then LPT over
 * the bins of each bucket. c[n] finite and >= 0, n >= 1; bucket[n] and mbin[n] get
 * each item's bucket and bin (every item is placed: there is no capacity).
 */
int ovl_bal_two_level(const double *c, int64_t n, int64_t buckets, int64_t bins, double tol, int64_t *bucket,
                      int64_t *mbin);

/*
 * The Planner's exactly-once check (plan_check.c): 1 when given[n][3] holds exactly the
 * rows of wanted[m][3], each once (no row twice on either side), else 0; or
 * OVL_BAL_ENOMEM. Rows are compared whole, never by hash alone.
 */
int ovl_plan_same_once(const int64_t *given, int64_t n, const int64_t *wanted, int64_t m);

#endif
