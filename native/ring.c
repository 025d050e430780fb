/*
 * Overlord shared-memory ring: the protocol. See ring.h for the byte layout.
 *
 * Invariants kept here:
 *   - tail <= head <= tail + capacity (counters only grow);
 *   - [tail, head) holds whole records, each contiguous in the data area;
 *   - only the producer stores head, only the consumer stores tail;
 *   - a sleeper is always woken: publish, then bump seq, then check waiters.
 */
#define _GNU_SOURCE
#include "ring.h"

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__SSE2__)
#include <emmintrin.h>
#define OVL_STREAM_STORES 1
#endif

static inline uint64_t align8(uint64_t n) {
    return (n + (OVL_RING_ALIGN - 1)) & ~(uint64_t)(OVL_RING_ALIGN - 1);
}

static inline uint64_t record_span(uint64_t len) { return align8(OVL_RING_RECORD_HEADER + len); }

/* Sleep while *word == expected, at most timeout_ns (< 0: no limit). Not FUTEX_PRIVATE:
 * the word lives in a MAP_SHARED mapping and the waker is another process. */
static int futex_wait(_Atomic uint32_t *word, uint32_t expected, int64_t timeout_ns) {
    struct timespec ts;
    struct timespec *tsp = NULL;
    if (timeout_ns >= 0) {
        ts.tv_sec = (time_t)(timeout_ns / 1000000000);
        ts.tv_nsec = (long)(timeout_ns % 1000000000);
        tsp = &ts;
    }
    long rc = syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT, expected, tsp, NULL, 0);
    if (rc == -1 && errno == ETIMEDOUT) {
        return OVL_ETIMEDOUT;
    }
    /* Woken, value already changed (EAGAIN) or a signal (EINTR): the caller re-checks. */
    return OVL_OK;
}

static void futex_wake_all(_Atomic uint32_t *word) {
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* Publish side of the wake-up handshake; the seq bump is unconditional so a waiter
 * that snapshotted seq before our publish never sleeps past it. */
static void notify(_Atomic uint32_t *seq, _Atomic uint32_t *waiters) {
    atomic_fetch_add_explicit(seq, 1, memory_order_seq_cst);
    if (atomic_load_explicit(waiters, memory_order_seq_cst) != 0) {
        futex_wake_all(seq);
    }
}

void ovl_stream_copy(void *dst, const void *src, size_t n) {
#ifdef OVL_STREAM_STORES
    unsigned char *d = dst;
    const unsigned char *s = src;
    size_t head = (size_t)(-(uintptr_t)d & 15u); /* streaming stores want 16-byte aligned targets */
    if (head > n) {
        head = n;
    }
    memcpy(d, s, head);
    d += head, s += head, n -= head;
    for (; n >= 64; d += 64, s += 64, n -= 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)s), b = _mm_loadu_si128((const __m128i *)(s + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + 32)), e = _mm_loadu_si128((const __m128i *)(s + 48));
        _mm_stream_si128((__m128i *)d, a);
        _mm_stream_si128((__m128i *)(d + 16), b);
        _mm_stream_si128((__m128i *)(d + 32), c);
        _mm_stream_si128((__m128i *)(d + 48), e);
    }
    memcpy(d, s, n);
    _mm_sfence(); /* streaming stores are weakly ordered: visible before the commit's release */
#else
    memcpy(dst, src, n);
#endif
}

uint64_t ovl_ring_segment_size(uint64_t capacity) { return OVL_RING_HEADER_SIZE + capacity; }

uint64_t ovl_ring_round_capacity(uint64_t requested) {
    if (requested > OVL_RING_MAX_CAPACITY) {
        return 0;
    }
    uint64_t cap = OVL_RING_MIN_CAPACITY;
    while (cap < requested) {
        cap <<= 1;
    }
    return cap;
}

static int capacity_ok(uint64_t cap) {
    return cap >= OVL_RING_MIN_CAPACITY && cap <= OVL_RING_MAX_CAPACITY && (cap & (cap - 1)) == 0;
}

int ovl_ring_init(void *base, uint64_t len, uint64_t capacity, int32_t creator_pid,
                  uint64_t creator_pidns, uint64_t creator_start) {
    if (!capacity_ok(capacity) || len < ovl_ring_segment_size(capacity)) {
        return OVL_ESIZE;
    }
    ovl_ring_header *h = (ovl_ring_header *)base;
    memset(h, 0, sizeof(*h));
    h->version = OVL_RING_VERSION;
    h->header_size = OVL_RING_HEADER_SIZE;
    h->capacity = capacity;
    h->creator_pid = creator_pid;
    h->creator_pidns = creator_pidns;
    h->creator_start = creator_start;
    /* Last, with release: an attacher that sees the magic sees every field above. */
    atomic_store_explicit(&h->magic, OVL_RING_MAGIC, memory_order_release);
    return OVL_OK;
}

int ovl_ring_check(const void *base, uint64_t len) {
    if (len < OVL_RING_HEADER_SIZE) {
        return OVL_EUNINIT; /* the creator has not sized the segment yet */
    }
    ovl_ring_header *h = (ovl_ring_header *)base;
    uint64_t magic = atomic_load_explicit(&h->magic, memory_order_acquire);
    if (magic == 0) {
        return OVL_EUNINIT;
    }
    if (magic != OVL_RING_MAGIC) {
        return OVL_EMAGIC;
    }
    if (h->version != OVL_RING_VERSION || h->header_size != OVL_RING_HEADER_SIZE) {
        return OVL_EVERSION;
    }
    if (!capacity_ok(h->capacity) || len < ovl_ring_segment_size(h->capacity)) {
        return OVL_ESIZE;
    }
    return OVL_OK;
}

int ovl_ring_open(ovl_ring *r, void *base, uint64_t len) {
    int rc = ovl_ring_check(base, len);
    if (rc != OVL_OK) {
        return rc;
    }
    memset(r, 0, sizeof(*r));
    r->hdr = (ovl_ring_header *)base;
    r->data = (uint8_t *)base + OVL_RING_HEADER_SIZE;
    r->capacity = r->hdr->capacity;
    r->mask = r->capacity - 1;
    return OVL_OK;
}

uint64_t ovl_ring_max_record(const ovl_ring *r) {
    uint64_t max = r->capacity - OVL_RING_RECORD_HEADER;
    return max > UINT32_MAX ? UINT32_MAX : max;
}

/* ---------------------------------------------------------------- producer */

/* Bytes the producer must see free before try_reserve can make progress: the record
 * itself, or, if it would straddle the end, the padding up to the end. */
static uint64_t space_needed(const ovl_ring *r, uint64_t head, uint64_t span) {
    uint64_t contig = r->capacity - (head & r->mask);
    return span <= contig ? span : contig;
}

/* A WRAP record at data offset pos covering the contig bytes to the end. */
static void write_wrap(ovl_ring *r, uint64_t pos, uint64_t contig) {
    uint32_t wrap[2] = {(uint32_t)(contig - OVL_RING_RECORD_HEADER), OVL_RING_FLAG_WRAP};
    memcpy(r->data + pos, wrap, sizeof(wrap));
}

int ovl_ring_try_reserve(ovl_ring *r, uint64_t len, uint64_t *offset) {
    r->reserved = 0; /* an uncommitted reservation was never published: dropping it is safe */
    if (len > ovl_ring_max_record(r)) {
        return OVL_ETOOBIG;
    }
    if (atomic_load_explicit(&r->hdr->closed, memory_order_relaxed)) {
        return OVL_ECLOSED;
    }
    uint64_t span = record_span(len);
    uint64_t head = atomic_load_explicit(&r->hdr->head, memory_order_relaxed);
    uint64_t tail = atomic_load_explicit(&r->hdr->tail, memory_order_acquire);
    uint64_t pos = head & r->mask;
    uint64_t contig = r->capacity - pos;
    uint64_t used = head - tail;
    /* Bytes of records in use: not the last WRAP record's, while it is in use (published, not passed). */
    int pad_in_use = r->pad_len && tail <= r->pad_at && head >= r->pad_at + r->pad_len;
    uint64_t held = used - (pad_in_use ? r->pad_len : 0);
    if (span > contig) {
        if (head + contig - tail > r->capacity) {
            return OVL_EAGAIN;
        }
        /* Pad to the end so the record starts at data offset 0 and stays contiguous. */
        write_wrap(r, pos, contig);
        r->pad_at = head;
        r->pad_len = contig;
        head += contig;
        atomic_store_explicit(&r->hdr->head, head, memory_order_release);
        notify(&r->hdr->data_seq, &r->hdr->data_waiters);
        pos = 0;
    } else if (pos != 0 && used <= pos && pos - used >= span + 2 * r->peak) { /* used <= pos: no WRAP in use */
        /* Rewind early (see ring.h): in use is [tail, head) before pos, and the free
         * bytes in front of tail hold this record and twice the most this producer has
         * had in use. The WRAP record is published with this one, by commit (which
         * also notes it as the last WRAP: a reservation dropped uncommitted leaves none). */
        write_wrap(r, pos, contig);
        head += contig;
        pos = 0;
    }
    if (head + span - tail > r->capacity) {
        return OVL_EAGAIN;
    }
    if (held + span > r->peak) {
        r->peak = held + span;
    }
    r->reserved = 1;
    r->res_pos = head;
    r->res_len = len;
    *offset = OVL_RING_HEADER_SIZE + pos + OVL_RING_RECORD_HEADER;
    return OVL_OK;
}

int ovl_ring_wait_space(ovl_ring *r, uint64_t len, int64_t timeout_ns) {
    ovl_ring_header *h = r->hdr;
    uint64_t span = record_span(len);
    int rc = OVL_OK;
    atomic_fetch_add_explicit(&h->space_waiters, 1, memory_order_seq_cst);
    uint32_t seq = atomic_load_explicit(&h->space_seq, memory_order_seq_cst);
    uint64_t head = atomic_load_explicit(&h->head, memory_order_relaxed);
    uint64_t tail = atomic_load_explicit(&h->tail, memory_order_seq_cst);
    if (r->capacity - (head - tail) < space_needed(r, head, span)) {
        /* A leasing consumer may hold the space it waits for while it waits for data:
         * wake it, so it can copy out what it holds (ovl_ring_wait_data_at). */
        notify(&h->data_seq, &h->data_waiters);
        rc = futex_wait(&h->space_seq, seq, timeout_ns);
    }
    atomic_fetch_sub_explicit(&h->space_waiters, 1, memory_order_seq_cst);
    return rc;
}

/* Publish the reserved record: the consumer sees it at its next look; nobody is woken. */
static int publish(ovl_ring *r) {
    if (!r->reserved) {
        return OVL_ESTATE;
    }
    uint32_t rec[2] = {(uint32_t)r->res_len, 0};
    memcpy(r->data + (r->res_pos & r->mask), rec, sizeof(rec));
    r->reserved = 0;
    uint64_t published = atomic_load_explicit(&r->hdr->head, memory_order_relaxed); /* only this side writes it */
    if (published != r->res_pos) { /* an early rewind's WRAP record, published now with this one */
        r->pad_at = published;
        r->pad_len = r->res_pos - published;
    }
    atomic_store_explicit(&r->hdr->head, r->res_pos + record_span(r->res_len), memory_order_release);
    return OVL_OK;
}

int ovl_ring_commit(ovl_ring *r) {
    int rc = publish(r);
    if (rc == OVL_OK) {
        notify(&r->hdr->data_seq, &r->hdr->data_waiters);
    }
    return rc;
}

int ovl_ring_commit_quiet(ovl_ring *r) { return publish(r); }

void ovl_ring_wake_data(ovl_ring *r) { notify(&r->hdr->data_seq, &r->hdr->data_waiters); }

void ovl_ring_abort(ovl_ring *r) { r->reserved = 0; }

void ovl_ring_close_writer(ovl_ring *r) {
    atomic_store_explicit(&r->hdr->closed, 1, memory_order_release);
    notify(&r->hdr->data_seq, &r->hdr->data_waiters);
}

/* ---------------------------------------------------------------- consumer */

static void advance_tail(ovl_ring *r, uint64_t tail) {
    atomic_store_explicit(&r->hdr->tail, tail, memory_order_release);
    notify(&r->hdr->space_seq, &r->hdr->space_waiters);
}

int ovl_ring_release(ovl_ring *r) {
    if (!r->reading) {
        return OVL_ESTATE;
    }
    r->reading = 0;
    advance_tail(r, r->read_pos + r->read_span);
    return OVL_OK;
}

int ovl_ring_try_read(ovl_ring *r, uint64_t *offset, uint64_t *len) {
    if (r->reading) {
        ovl_ring_release(r);
    }
    for (;;) {
        uint64_t tail = atomic_load_explicit(&r->hdr->tail, memory_order_relaxed);
        uint64_t next = tail;
        int rc = ovl_ring_peek(r, tail, offset, len, &next);
        if (rc == OVL_EAGAIN && next != tail) {
            advance_tail(r, next); /* a lone WRAP record: free its space, the producer waits for it */
            continue;
        }
        if (rc != OVL_OK) {
            return rc;
        }
        uint64_t span = record_span(*len);
        if (next - span != tail) {
            advance_tail(r, next - span); /* past the WRAP record before this one */
        }
        r->reading = 1;
        r->read_pos = next - span;
        r->read_span = span;
        return OVL_OK;
    }
}

/* ---------------------------------------------------------------- consumer, leases */

uint64_t ovl_ring_tail(const ovl_ring *r) { return atomic_load_explicit(&r->hdr->tail, memory_order_acquire); }

void ovl_ring_set_mark(ovl_ring *r, uint64_t mark) {
    atomic_store_explicit(&r->hdr->consumer_mark, mark, memory_order_release);
    notify(&r->hdr->mark_seq, &r->hdr->mark_waiters);
}

/* futex_waitv(2) (Linux 5.16): one sleep on several shared futex words. */
#define OVL_FUTEX_WAITV_MAX 128
#define OVL_FUTEX2_SIZE_U32 0x02
#ifndef SYS_futex_waitv
#define SYS_futex_waitv 449
#endif
struct ovl_futex_waitv {
    uint64_t val;
    uint64_t uaddr;
    uint32_t flags;
    uint32_t reserved;
};

static int64_t monotonic_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static int marks_moved(ovl_ring *const *rings, int n, const uint64_t *seen, uint64_t *out) {
    int moved = 0;
    for (int i = 0; i < n; i++) {
        out[i] = atomic_load_explicit(&rings[i]->hdr->consumer_mark, memory_order_seq_cst);
        moved |= out[i] != seen[i];
    }
    return moved;
}

int ovl_ring_wait_marks(ovl_ring *const *rings, int n, const uint64_t *seen, uint64_t *marks_out,
                        int64_t timeout_ns, int64_t poll_ns) {
    int64_t deadline = monotonic_ns() + timeout_ns;
    static _Atomic int no_waitv = 0; /* futex_waitv failed once: poll from then on */
    struct ovl_futex_waitv waiters[OVL_FUTEX_WAITV_MAX];
    int vector = n > 0 && n <= OVL_FUTEX_WAITV_MAX && !atomic_load_explicit(&no_waitv, memory_order_relaxed);
    for (;;) {
        int registered = vector;
        if (registered) {
            for (int i = 0; i < n; i++) {
                atomic_fetch_add_explicit(&rings[i]->hdr->mark_waiters, 1, memory_order_seq_cst);
                waiters[i].val = atomic_load_explicit(&rings[i]->hdr->mark_seq, memory_order_seq_cst);
                waiters[i].uaddr = (uint64_t)(uintptr_t)&rings[i]->hdr->mark_seq;
                waiters[i].flags = OVL_FUTEX2_SIZE_U32; /* shared: the words live in MAP_SHARED mappings */
                waiters[i].reserved = 0;
            }
        }
        /* after the seq snapshots: a mark set since is seen here or wakes the sleep below */
        int moved = marks_moved(rings, n, seen, marks_out);
        int64_t left = deadline - monotonic_ns();
        if (!moved && left > 0) {
            if (vector) {
                struct timespec until = {(time_t)((deadline) / 1000000000), (long)((deadline) % 1000000000)};
                long rc = syscall(SYS_futex_waitv, waiters, (unsigned int)n, 0, &until, CLOCK_MONOTONIC);
                if (rc == -1 && errno != EAGAIN && errno != ETIMEDOUT && errno != EINTR) {
                    /* no futex_waitv here (ENOSYS), or it refuses these words: look every poll_ns
                     * from now on rather than spin on an error until the deadline */
                    atomic_store_explicit(&no_waitv, 1, memory_order_relaxed);
                    vector = 0;
                }
            } else {
                int64_t nap = left < poll_ns ? left : poll_ns;
                struct timespec ts = {(time_t)(nap / 1000000000), (long)(nap % 1000000000)};
                nanosleep(&ts, NULL);
            }
        }
        if (registered) {
            for (int i = 0; i < n; i++) {
                atomic_fetch_sub_explicit(&rings[i]->hdr->mark_waiters, 1, memory_order_seq_cst);
            }
        }
        if (moved) {
            return OVL_OK;
        }
        if (left <= 0) {
            return OVL_ETIMEDOUT;
        }
    }
}

int ovl_ring_space_wanted(const ovl_ring *r) {
    return atomic_load_explicit(&r->hdr->space_waiters, memory_order_acquire) != 0;
}

int ovl_ring_peek(ovl_ring *r, uint64_t cursor, uint64_t *offset, uint64_t *len, uint64_t *next) {
    ovl_ring_header *h = r->hdr;
    for (;;) {
        uint64_t tail = atomic_load_explicit(&h->tail, memory_order_relaxed);
        uint64_t head = atomic_load_explicit(&h->head, memory_order_acquire);
        if (cursor < tail || cursor > head || (cursor & (OVL_RING_ALIGN - 1)) != 0 || head - tail > r->capacity) {
            return OVL_ECORRUPT;
        }
        if (head == cursor) {
            int err = atomic_load_explicit(&h->error_state, memory_order_acquire) == 2;
            int closed = atomic_load_explicit(&h->closed, memory_order_acquire) != 0;
            *next = cursor;
            if (!err && !closed) {
                return OVL_EAGAIN;
            }
            if (atomic_load_explicit(&h->head, memory_order_acquire) != cursor) {
                continue;
            }
            return err ? OVL_EERROR : OVL_ECLOSED;
        }
        uint64_t pos = cursor & r->mask;
        uint64_t contig = r->capacity - pos;
        uint32_t rec[2];
        memcpy(rec, r->data + pos, sizeof(rec));
        uint64_t skip = 0;
        if (rec[1] == OVL_RING_FLAG_WRAP) {
            if (rec[0] != contig - OVL_RING_RECORD_HEADER || head - cursor < contig) {
                return OVL_ECORRUPT;
            }
            if (head - cursor == contig) {
                *next = head; /* only the WRAP so far: the caller steps past it, so it can be freed */
                return OVL_EAGAIN;
            }
            skip = contig;
            pos = 0;
            contig = r->capacity;
            memcpy(rec, r->data, sizeof(rec));
        }
        uint64_t span = record_span(rec[0]);
        if (rec[1] != 0 || span > contig || span > head - cursor - skip) {
            return OVL_ECORRUPT;
        }
        *offset = OVL_RING_HEADER_SIZE + pos + OVL_RING_RECORD_HEADER;
        *len = rec[0];
        *next = cursor + skip + span;
        return OVL_OK;
    }
}

int ovl_ring_wait_data_at(ovl_ring *r, uint64_t cursor, int holding, int64_t timeout_ns) {
    ovl_ring_header *h = r->hdr;
    int rc = OVL_OK;
    atomic_fetch_add_explicit(&h->data_waiters, 1, memory_order_seq_cst);
    uint32_t seq = atomic_load_explicit(&h->data_seq, memory_order_seq_cst);
    uint64_t head = atomic_load_explicit(&h->head, memory_order_seq_cst);
    /* Not while the producer waits for space the caller holds (see wait_space). */
    int idle = head == cursor && (!holding || atomic_load_explicit(&h->space_waiters, memory_order_seq_cst) == 0) &&
               atomic_load_explicit(&h->closed, memory_order_seq_cst) == 0 &&
               atomic_load_explicit(&h->error_state, memory_order_seq_cst) != 2;
    if (idle) {
        rc = futex_wait(&h->data_seq, seq, timeout_ns);
    }
    atomic_fetch_sub_explicit(&h->data_waiters, 1, memory_order_seq_cst);
    return rc;
}

int ovl_ring_release_to(ovl_ring *r, uint64_t new_tail) {
    uint64_t tail = atomic_load_explicit(&r->hdr->tail, memory_order_relaxed);
    uint64_t head = atomic_load_explicit(&r->hdr->head, memory_order_acquire);
    if (new_tail < tail || new_tail > head || (new_tail & (OVL_RING_ALIGN - 1)) != 0) {
        return OVL_ESTATE;
    }
    if (new_tail != tail) {
        advance_tail(r, new_tail);
    }
    return OVL_OK;
}

int ovl_ring_wait_data(ovl_ring *r, int64_t timeout_ns) {
    ovl_ring_header *h = r->hdr;
    int rc = OVL_OK;
    atomic_fetch_add_explicit(&h->data_waiters, 1, memory_order_seq_cst);
    uint32_t seq = atomic_load_explicit(&h->data_seq, memory_order_seq_cst);
    uint64_t tail = atomic_load_explicit(&h->tail, memory_order_relaxed);
    int idle = atomic_load_explicit(&h->head, memory_order_seq_cst) == tail &&
               atomic_load_explicit(&h->closed, memory_order_seq_cst) == 0 &&
               atomic_load_explicit(&h->error_state, memory_order_seq_cst) != 2;
    if (idle) {
        rc = futex_wait(&h->data_seq, seq, timeout_ns);
    }
    atomic_fetch_sub_explicit(&h->data_waiters, 1, memory_order_seq_cst);
    return rc;
}

/* ---------------------------------------------------------------- anyone */

int ovl_ring_set_error(ovl_ring *r, const char *msg, uint64_t len) {
    ovl_ring_header *h = r->hdr;
    uint32_t expected = 0;
    /* First error wins: it is the root cause; later ones are usually its consequences. */
    if (!atomic_compare_exchange_strong_explicit(&h->error_state, &expected, 1, memory_order_acq_rel,
                                                 memory_order_acquire)) {
        return OVL_EERROR;
    }
    if (len > OVL_RING_ERROR_BYTES - 1) {
        len = OVL_RING_ERROR_BYTES - 1;
    }
    memcpy(h->error_msg, msg, (size_t)len);
    h->error_msg[len] = '\0';
    h->error_len = (uint32_t)len;
    atomic_store_explicit(&h->error_state, 2, memory_order_release);
    notify(&h->data_seq, &h->data_waiters);
    notify(&h->space_seq, &h->space_waiters);
    return OVL_OK;
}

int64_t ovl_ring_get_error(const ovl_ring *r, const char **msg) {
    const ovl_ring_header *h = r->hdr;
    if (atomic_load_explicit(&r->hdr->error_state, memory_order_acquire) != 2) {
        return -1;
    }
    uint32_t len = h->error_len;
    if (len > OVL_RING_ERROR_BYTES - 1) {
        len = OVL_RING_ERROR_BYTES - 1; /* never trust shared memory with a length */
    }
    *msg = h->error_msg;
    return len;
}

int ovl_ring_is_closed(const ovl_ring *r) {
    return atomic_load_explicit(&r->hdr->closed, memory_order_acquire) != 0;
}

uint64_t ovl_ring_pending(const ovl_ring *r) {
    uint64_t tail = atomic_load_explicit(&r->hdr->tail, memory_order_acquire);
    uint64_t head = atomic_load_explicit(&r->hdr->head, memory_order_acquire);
    return head - tail;
}
