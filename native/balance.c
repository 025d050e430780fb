/* Balancing kernels: see balance.h. Plain C11, no Python. */
#include "balance.h"
#include "balance_sort.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- cost order ------------------------------------------------------------------ */

int ovl_bal_cost_order(const double *c, int64_t n, int descending, int64_t *out) {
    keyed *a = malloc((size_t)(n ? n : 1) * sizeof *a), *b = malloc((size_t)(n ? n : 1) * sizeof *b);
    int64_t(*hist)[RADIX_BUCKETS] = malloc(RADIX_PASSES * sizeof *hist);
    if (!a || !b || !hist) {
        free(a);
        free(b);
        free(hist);
        return OVL_BAL_ENOMEM;
    }
    for (int64_t i = 0; i < n; i++) {
        uint64_t bits = ovl_sort_cost_key(c[i]);
        a[i].key = descending ? ~bits : bits;
        a[i].idx = i;
    }
    const keyed *sorted = ovl_sort_radix(a, b, n, hist);
    for (int64_t i = 0; i < n; i++) {
        out[i] = sorted[i].idx;
    }
    free(a);
    free(b);
    free(hist);
    return OVL_BAL_OK;
}

/* ---- largest differencing ------------------------------------------------------- */

typedef struct {
    double spread;  /* largest minus smallest subset sum */
    int64_t seq;    /* creation order: the tie-break */
    int64_t slot;   /* partition in the pool, or -1 for the singleton `item` */
    int64_t item;
} kk_entry;

/* The heap pops the largest spread first, ties by the lowest seq (keys are unique). */
static int kk_before(const kk_entry *a, const kk_entry *b) {
    return a->spread > b->spread || (a->spread == b->spread && a->seq < b->seq);
}

static void kk_push(kk_entry *heap, int64_t *len, kk_entry e) {
    int64_t i = (*len)++;
    while (i > 0) {
        int64_t p = (i - 1) / 2;
        if (!kk_before(&e, &heap[p])) {
            break;
        }
        heap[i] = heap[p];
        i = p;
    }
    heap[i] = e;
}

static kk_entry kk_pop(kk_entry *heap, int64_t *len) {
    kk_entry top = heap[0], last = heap[--(*len)];
    int64_t i = 0, n = *len;
    for (;;) {
        int64_t c = 2 * i + 1;
        if (c >= n) {
            break;
        }
        if (c + 1 < n && kk_before(&heap[c + 1], &heap[c])) {
            c++;
        }
        if (!kk_before(&heap[c], &last)) {
            break;
        }
        heap[i] = heap[c];
        i = c;
    }
    if (n > 0) {
        heap[i] = last;
    }
    return top;
}

typedef struct {
    double *sums; /* slots * k */
    int64_t *ids; /* slots * k */
    int64_t *free_slots;
    int64_t n_free, n_slots, k;
} kk_pool;

/* Room for `n` slots in all (n > n_slots), the new ones free; 0, or -1 out of memory. */
static int kk_grow(kk_pool *p, int64_t n) {
    double *s = realloc(p->sums, (size_t)(n * p->k) * sizeof *s);
    if (!s) {
        return -1;
    }
    p->sums = s;
    int64_t *ids = realloc(p->ids, (size_t)(n * p->k) * sizeof *ids);
    if (!ids) {
        return -1;
    }
    p->ids = ids;
    int64_t *fr = realloc(p->free_slots, (size_t)n * sizeof *fr);
    if (!fr) {
        return -1;
    }
    p->free_slots = fr;
    for (int64_t s2 = n - 1; s2 >= p->n_slots; s2--) { /* handed out lowest first */
        p->free_slots[p->n_free++] = s2;
    }
    p->n_slots = n;
    return 0;
}

static int64_t kk_alloc(kk_pool *p) {
    if (!p->n_free && kk_grow(p, p->n_slots ? 2 * p->n_slots : 16) < 0) {
        return -1;
    }
    return p->free_slots[--p->n_free];
}

/* A popped entry as a pool slot: a singleton is built only now (memory stays O(heap)). */
static int64_t kk_materialise(kk_pool *p, const kk_entry *e, const double *vals) {
    if (e->slot >= 0) {
        return e->slot;
    }
    int64_t s = kk_alloc(p);
    if (s < 0) {
        return -1;
    }
    double *sums = p->sums + s * p->k;
    int64_t *ids = p->ids + s * p->k;
    for (int64_t t = 0; t < p->k; t++) {
        sums[t] = 0.0;
        ids[t] = -1;
    }
    sums[0] = vals[e->item];
    ids[0] = e->item;
    return s;
}

int ovl_bal_differencing(const double *vals, int64_t m, int64_t k, int equal_count, int64_t *bin) {
    if (k == 1 || m < 2) {
        for (int64_t i = 0; i < m; i++) {
            bin[i] = 0;
        }
        return OVL_BAL_OK;
    }
    int rc = OVL_BAL_ENOMEM;
    kk_pool pool = {NULL, NULL, NULL, 0, 0, k};
    int64_t n_entries = equal_count ? (m + k - 1) / k : m;
    kk_entry *heap = malloc((size_t)n_entries * sizeof *heap);
    int64_t *parent = malloc((size_t)m * sizeof *parent);
    double *ns = malloc((size_t)k * sizeof *ns);
    double *key = malloc((size_t)k * sizeof *key);
    int64_t *ni = malloc((size_t)k * sizeof *ni);
    int64_t *o = malloc((size_t)(2 * k) * sizeof *o);
    int64_t *where = malloc((size_t)k * sizeof *where);
    if (!heap || !parent || !ns || !key || !ni || !o || !where) {
        goto out;
    }
    for (int64_t i = 0; i < m; i++) {
        parent[i] = i;
    }
    int64_t len = 0;
    if (equal_count) {
        /* Chunks of k consecutive sorted items, one item per subset, padded with empty ones:
         * their slots at once (merging only frees slots). */
        if (kk_grow(&pool, n_entries) < 0) {
            goto out;
        }
        for (int64_t j = 0; j < n_entries; j++) {
            int64_t s = kk_alloc(&pool);
            if (s < 0) {
                goto out;
            }
            double *sums = pool.sums + s * k;
            int64_t *ids = pool.ids + s * k;
            for (int64_t t = 0; t < k; t++) {
                int64_t i = j * k + t;
                sums[t] = i < m ? vals[i] : 0.0;
                ids[t] = i < m ? i : -1;
            }
            kk_entry e = {sums[0] - sums[k - 1], j, s, -1};
            kk_push(heap, &len, e);
        }
    } else {
        for (int64_t j = 0; j < m; j++) {
            kk_entry e = {vals[j], j, -1, j};
            kk_push(heap, &len, e);
        }
    }
    int64_t seq = len;
    while (len > 1) {
        kk_entry ea = kk_pop(heap, &len), eb = kk_pop(heap, &len);
        int64_t sa_slot = kk_materialise(&pool, &ea, vals);
        if (sa_slot < 0) {
            goto out;
        }
        int64_t sb_slot = kk_materialise(&pool, &eb, vals);
        if (sb_slot < 0) {
            goto out;
        }
        double *sa = pool.sums + sa_slot * k, *sb = pool.sums + sb_slot * k;
        int64_t *ia = pool.ids + sa_slot * k, *ib = pool.ids + sb_slot * k;
        /* The largest subset of one meets the smallest of the other. */
        for (int64_t t = 0; t < k; t++) {
            int64_t r = k - 1 - t;
            if (ia[t] >= 0 && ib[r] >= 0) {
                parent[ib[r]] = ia[t];
            }
            ns[t] = sa[t] + sb[r];
            key[t] = -ns[t];
            ni[t] = ia[t] >= 0 ? ia[t] : ib[r];
        }
        ovl_sort_stable_order(key, k, o, o + k);
        for (int64_t t = 0; t < k; t++) {
            sa[t] = ns[o[t]];
            ia[t] = ni[o[t]];
        }
        pool.free_slots[pool.n_free++] = sb_slot;
        kk_entry e = {sa[0] - sa[k - 1], seq++, sa_slot, -1};
        kk_push(heap, &len, e);
    }
    kk_entry last = kk_pop(heap, &len);
    int64_t fs = kk_materialise(&pool, &last, vals);
    if (fs < 0) {
        goto out;
    }
    const int64_t *final = pool.ids + fs * k;
    /* subset of each root item: its position in the final partition */
    for (int64_t t = 0; t < k; t++) {
        where[t] = final[t];
    }
    for (int64_t i = 0; i < m; i++) {
        bin[i] = -1;
    }
    for (int64_t t = 0; t < k; t++) {
        if (where[t] >= 0) {
            bin[where[t]] = t;
        }
    }
    for (int64_t i = 0; i < m; i++) {
        int64_t r = i;
        while (parent[r] != r) {
            r = parent[r];
        }
        bin[i] = bin[r];
    }
    rc = OVL_BAL_OK;
out:
    free(pool.sums);
    free(pool.ids);
    free(pool.free_slots);
    free(heap);
    free(parent);
    free(ns);
    free(key);
    free(ni);
    free(o);
    free(where);
    return rc;
}

/* ---- LPT in groups -------------------------------------------------------------- */

int ovl_bal_greedy_groups(const double *costs, const double *sizes, double capacity, const int64_t *order,
                          const int64_t *start, int64_t groups, int64_t k, int64_t *bin) {
    double *loads = malloc((size_t)k * sizeof *loads);
    double *used = malloc((size_t)k * sizeof *used);
    if (!loads || !used) {
        free(loads);
        free(used);
        return OVL_BAL_ENOMEM;
    }
    for (int64_t g = 0; g < groups; g++) {
        for (int64_t b = 0; b < k; b++) {
            loads[b] = 0.0;
            used[b] = 0.0;
        }
        for (int64_t p = start[g]; p < start[g + 1]; p++) {
            int64_t i = order[p], best = -1;
            if (sizes) {
                double s = sizes[i];
                for (int64_t b = 0; b < k; b++) {
                    if (used[b] + s <= capacity && (best < 0 || loads[b] < loads[best])) {
                        best = b;
                    }
                }
                if (best < 0) {
                    continue;
                }
                used[best] += s;
            } else {
                best = 0;
                for (int64_t b = 1; b < k; b++) {
                    if (loads[b] < loads[best]) {
                        best = b;
                    }
                }
            }
            loads[best] += costs[i];
            bin[i] = best;
        }
    }
    free(loads);
    free(used);
    return OVL_BAL_OK;
}

/* ---- a placement as a table ---------------------------------------------------- */

int ovl_bal_bin_table(const int64_t *bin, const double *costs, int64_t n, int64_t k, int64_t m, int64_t *table,
                      double *loads) {
    int64_t *fill = calloc((size_t)(k ? k : 1), sizeof *fill);
    if (!fill) {
        return OVL_BAL_ENOMEM;
    }
    for (int64_t j = 0; j < k * m; j++) {
        table[j] = -1;
    }
    for (int64_t b = 0; b < k; b++) {
        loads[b] = 0.0;
    }
    for (int64_t i = 0; i < n; i++) {
        int64_t b = bin[i];
        if (b >= 0) {
            table[b * m + fill[b]++] = i;
            loads[b] += costs[i];
        }
    }
    free(fill);
    return OVL_BAL_OK;
}

/* ---- pairwise swap refinement --------------------------------------------------- */

/* A member of a bin: its normalised cost (cn[n] for a pad) and its slot in the row. */
typedef struct {
    double val;
    int64_t slot;
} member;

/* The refinement's state beside the table: each entry's cn and cost (cz) in the table's
 * layout, so the pair loops read rows, not the item arrays at random; and each bin's
 * members by (normalised cost, slot), kept across rounds. The numpy form sorts every
 * pair's light row each round; here all rows are sorted once and each swap updates its
 * two rows (one removal, one insertion), which gives the same order. */
typedef struct {
    double *tcn, *tcz; /* k * m, as table */
    member *sorted;    /* k * m */
    int64_t m;
} refine_state;

/* Every bin's members by (normalised cost, slot), all rows at once: a stable radix sort
 * of the table's entries (in table order: by bin, then slot) by cost, then a stable
 * counting sort by bin. */
static int rows_sort_all(refine_state *st, int64_t k) {
    int64_t m = st->m, n = k * m;
    keyed *a = malloc((size_t)(n ? n : 1) * sizeof *a), *b = malloc((size_t)(n ? n : 1) * sizeof *b);
    int64_t(*hist)[RADIX_BUCKETS] = malloc(RADIX_PASSES * sizeof *hist);
    int64_t *fill = calloc((size_t)k, sizeof *fill);
    if (!a || !b || !hist || !fill) {
        free(a);
        free(b);
        free(hist);
        free(fill);
        return OVL_BAL_ENOMEM;
    }
    for (int64_t j = 0; j < n; j++) {
        a[j].key = ovl_sort_cost_key(st->tcn[j]);
        a[j].idx = j;
    }
    const keyed *by_cost = ovl_sort_radix(a, b, n, hist);
    for (int64_t t = 0; t < n; t++) {
        int64_t j = by_cost[t].idx, bin = j / m;
        member *e = st->sorted + bin * m + fill[bin]++;
        e->val = st->tcn[j];
        e->slot = j - bin * m;
    }
    free(a);
    free(b);
    free(hist);
    free(fill);
    return OVL_BAL_OK;
}

/* Slot s of bin b now holds an item of normalised cost v. */
static void row_update(refine_state *st, int64_t b, int64_t s, double v) {
    int64_t m = st->m, q = 0;
    member *row = st->sorted + b * m;
    while (row[q].slot != s) {
        q++;
    }
    memmove(row + q, row + q + 1, (size_t)(m - 1 - q) * sizeof *row);
    int64_t e = 0;
    while (e < m - 1 && (row[e].val < v || (row[e].val == v && row[e].slot < s))) {
        e++;
    }
    memmove(row + e + 1, row + e, (size_t)(m - 1 - e) * sizeof *row);
    row[e].val = v;
    row[e].slot = s;
}

int ovl_bal_refine_pairs(const double *cn, const double *cz, int64_t n, int64_t *table, int64_t k, int64_t m,
                         double *loads, double stop, double scale, int64_t max_swaps, int64_t *bin) {
    int64_t half = k / 2, h1 = half ? half : 1;
    int64_t *order = malloc((size_t)(2 * k) * sizeof *order);
    int64_t *pos = malloc((size_t)m * sizeof *pos);
    int64_t *a_of = malloc((size_t)h1 * sizeof *a_of);
    int64_t *b_of = malloc((size_t)h1 * sizeof *b_of);
    int64_t *i_of = malloc((size_t)h1 * sizeof *i_of);
    int64_t *y_of = malloc((size_t)h1 * sizeof *y_of);
    refine_state st = {malloc((size_t)(k * m) * sizeof(double)), malloc((size_t)(k * m) * sizeof(double)),
                       malloc((size_t)(k * m) * sizeof(member)), m};
    int rc = OVL_BAL_ENOMEM;
    if (!order || !pos || !a_of || !b_of || !i_of || !y_of || !st.tcn || !st.tcz || !st.sorted) {
        goto out;
    }
    for (int64_t j = 0; j < k * m; j++) {
        int64_t x = table[j] >= 0 ? table[j] : n;
        st.tcn[j] = cn[x];
        st.tcz[j] = cz[x];
    }
    if (rows_sort_all(&st, k) != OVL_BAL_OK) {
        goto out;
    }
    int64_t shift = 0, swaps = 0;
    int64_t max_shift = half < 8 ? half : 8;
    while (swaps < max_swaps) {
        ovl_sort_stable_order(loads, k, order, order + k);
        int64_t hot = 0;
        while (hot < half && loads[order[k - 1 - hot]] > stop) {
            hot++; /* the heavy half, heaviest first: those above `stop` are a prefix */
        }
        if (hot == 0) {
            break;
        }
        int64_t first_found = 0, n_go = 0;
        for (int64_t r = 0; r < hot; r++) {
            int64_t a = order[k - 1 - r], b = order[(r + shift) % half];
            double la = loads[a], lb = loads[b];
            double gap = la - lb;
            const int64_t *ra = table + a * m, *rb = table + b * m;
            const double *za = st.tcz + a * m, *zb = st.tcz + b * m;
            const member *sa = st.sorted + a * m, *sb = st.sorted + b * m;
            /* The numpy form searches every pair's row at once, each shifted into a band
             * of its own: the same additions here, so the comparisons round alike. */
            double band = 4.0 * (double)r;
            double g2 = gap / (2.0 * scale);
            /* Each x's ideal partner costs gap/2 less: the first y of b at or above that
             * (searchsorted, side left). The target only grows with x's cost, so one walk
             * over both rows in cost order finds them all. */
            int64_t p = 0;
            for (int64_t e = 0; e < m; e++) {
                double t = sa[e].val - g2;
                t = t < -0.5 ? -0.5 : t;
                t = t > 1.0 ? 1.0 : t;
                t += band;
                while (p < m && sb[p].val + band < t) {
                    p++;
                }
                pos[sa[e].slot] = p;
            }
            /* candidates: column i (< m) the y just below x_i's ideal partner, m + i the one
             * at it; the first minimum of the new max load wins */
            int64_t best_col = -1, best_y = -1;
            double best_new = INFINITY;
            for (int64_t col = 0; col < 2 * m; col++) {
                int64_t i = col < m ? col : col - m;
                if (ra[i] < 0) {
                    continue;
                }
                int64_t q = col < m ? (pos[i] > 0 ? pos[i] - 1 : 0) : (pos[i] < m - 1 ? pos[i] : m - 1);
                int64_t ys = sb[q].slot;
                if (rb[ys] < 0) {
                    continue;
                }
                double d = za[i] - zb[ys];
                double lo_side = la - d, hi_side = lb + d;
                double nw = lo_side > hi_side ? lo_side : hi_side;
                if (d > 0 && nw < la && nw < best_new) {
                    best_new = nw;
                    best_col = col;
                    best_y = ys;
                }
            }
            if (best_col >= 0) {
                first_found |= r == 0;
                a_of[n_go] = a;
                b_of[n_go] = b;
                i_of[n_go] = best_col % m;
                y_of[n_go] = best_y; /* y's slot in b */
                n_go++;
            }
        }
        if (!first_found) { /* the heaviest found no partner: try it with the next lighter ones */
            shift++;
            if (shift >= max_shift && n_go == 0) {
                break;
            }
        } else {
            shift = 0;
        }
        if (n_go == 0) {
            continue;
        }
        if (n_go > max_swaps - swaps) {
            n_go = max_swaps - swaps;
        }
        for (int64_t g = 0; g < n_go; g++) { /* the pairs are disjoint: one at a time is all at once */
            int64_t a = a_of[g], b = b_of[g], i = i_of[g], j = y_of[g];
            int64_t ia = a * m + i, jb = b * m + j;
            int64_t x = table[ia], y = table[jb];
            double cx = st.tcn[ia], cy = st.tcn[jb], zx = st.tcz[ia], zy = st.tcz[jb];
            table[ia] = y;
            table[jb] = x;
            st.tcn[ia] = cy;
            st.tcn[jb] = cx;
            st.tcz[ia] = zy;
            st.tcz[jb] = zx;
            row_update(&st, a, i, cy);
            row_update(&st, b, j, cx);
            bin[x] = b;
            bin[y] = a;
            double d = zx - zy;
            loads[a] -= d;
            loads[b] += d;
        }
        swaps += n_go;
    }
    rc = OVL_BAL_OK;
out:
    free(order);
    free(pos);
    free(a_of);
    free(b_of);
    free(i_of);
    free(y_of);
    free(st.tcn);
    free(st.tcz);
    free(st.sorted);
    return rc;
}
