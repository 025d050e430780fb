/*
 * Overlord shared-memory ring: single producer, single consumer, variable-size records.
 *
 * One POSIX shared-memory segment per ring, mapped by exactly one producer process
 * (a Source Loader or Data Constructor) and one consumer process (a Data Constructor
 * or a trainer Client) on the same node. This file owns the protocol; the mapping is
 * made by the caller (Python mmap) and handed to ovl_ring_init / ovl_ring_open.
 *
 * Segment layout (little-endian, offsets in bytes):
 *
 *   0     +--------------------------------------------------------------+
 *         | magic u64 "OVLRING1"   (stored last, release: header ready)  |
 *         | version u32 | header_size u32 | capacity u64                 |
 *   24    | creator_pid i32 | producer_pid i32 | consumer_pid i32        |
 *   36    | closed u32 | error_state u32 (0 none, 1 writing, 2 set)      |
 *   44    | error_len u32 | @48 creator_pidns u64 | @56 creator_start u64 |
 *   64    +-- producer cache line ---------------------------------------+
 *         | head u64 (monotonic) | data_seq u32 | data_waiters u32       |
 *   128   +-- consumer cache line ---------------------------------------+
 *         | tail u64 (monotonic) | space_seq u32 | space_waiters u32     |
 *   192   +--------------------------------------------------------------+
 *         | error_msg[2048]: UTF-8, NUL-terminated, first error wins     |
 *   2240  | producer_pidns u64 | consumer_pidns u64 (set by claims)       |
 *   2256  | consumer_mark u64: the consumer's progress, opaque to the ring |
 *   2264  | mark_seq u32 | mark_waiters u32: a watcher of the mark asleep   |
 *   2272  | reserved (zero) up to 2304                                  |
 *   2304  | seq u32 | len u32 | note[248]: the consumer's note            |
 *   2560  | seq u32 | len u32 | note[248]: the producer's note            |
 *         |   (both written and read in Python only: overlord.shm._pyring) |
 *   2816  | reserved (zero) up to 4096                                   |
 *   4096  +== data area: capacity bytes (power of two, >= 4096) ========+
 *         | rec | rec | ... | WRAP pad | (wraps to data offset 0)       |
 *         +--------------------------------------------------------------+
 *
 * head and tail are byte counters that only grow; a position in the data area is
 * counter & (capacity - 1), and head - tail is the number of bytes in use.
 *
 * Record (8-byte aligned, contiguous, never straddles the end of the data area):
 *
 *   +0  length u32 (payload bytes) | +4 flags u32 (0 = data, 1 = WRAP) | +8 payload
 *   total span = align8(8 + length)
 *
 * A record that would straddle the end is preceded by a WRAP record covering the rest
 * of the data area (length = rest - 8); the consumer skips it. So the largest record
 * is capacity - 8 bytes, and every record the consumer sees is one contiguous view.
 * The WRAP record is published on its own, before the producer waits for room at
 * offset 0: a consumer that reads (or polls) frees it, even while the ring looks empty.
 *
 * Rewinding: the producer also wraps early, before the end, when the bytes in use lie
 * in one piece before its position and the free bytes in front of them (from data
 * offset 0 to tail) hold the new record and twice the most this producer has had in
 * use (its peak, kept in its process). So a ring touches the pages of about three times
 * its peak fill, not its whole capacity: a ring sized for a burst costs shared memory
 * only when the burst comes. Until the consumer passes it, the WRAP record's bytes count
 * as in use, so rewinding shortens the room ahead of the producer: measured against its
 * peak, a producer that fills and drains in bursts still has room for twice its largest
 * burst (against the fill of the moment, a burst after a quiet spell had to wait for the
 * consumer). The consumer sees nothing new: a WRAP record, published with the record
 * after it.
 *
 * Ordering: the producer writes a record, then stores head with release; the consumer
 * loads head with acquire before reading. Symmetrically for tail and reuse of space.
 * Blocking: a waiter registers in *_waiters, snapshots *_seq, re-checks its condition
 * and sleeps with FUTEX_WAIT on *_seq (shared futex, cross-process). The other side
 * always bumps *_seq after publishing and calls FUTEX_WAKE only if *_waiters != 0, so
 * the fast path is two atomic operations and no syscall. The seq_cst ordering on
 * (publish, seq++, load waiters) vs (waiters++, load seq, check) rules out lost wakeups.
 */
#ifndef OVERLORD_RING_H
#define OVERLORD_RING_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#define OVL_RING_MAGIC UINT64_C(0x31474E49524C564F) /* "OVLRING1" little-endian */
#define OVL_RING_VERSION 1u
#define OVL_RING_HEADER_SIZE 4096u
#define OVL_RING_RECORD_HEADER 8u
#define OVL_RING_ALIGN 8u
#define OVL_RING_MIN_CAPACITY UINT64_C(4096)
/* Record lengths are u32, so a ring larger than 4 GiB could hold records it cannot describe. */
#define OVL_RING_MAX_CAPACITY (UINT64_C(1) << 32)
#define OVL_RING_ERROR_BYTES 2048u /* slot size including the terminating NUL */
#define OVL_RING_FLAG_WRAP 1u

/* Status codes; functions return them (0 = success). Python maps them to exceptions. */
enum {
    OVL_OK = 0,
    OVL_EAGAIN = 1,    /* nothing ready / no space yet: wait and retry */
    OVL_ETIMEDOUT = 2, /* a wait slice elapsed */
    OVL_ECLOSED = 3,   /* producer closed and ring drained, or write after close */
    OVL_EERROR = 4,    /* error slot set and nothing ready */
    OVL_ETOOBIG = 5,   /* record can never fit */
    OVL_ECORRUPT = 6,  /* a record header is inconsistent with head/tail */
    OVL_EUNINIT = 7,   /* header not initialised yet (magic still 0) */
    OVL_EMAGIC = 8,    /* not an Overlord ring */
    OVL_EVERSION = 9,  /* ring protocol version mismatch */
    OVL_ESIZE = 10,    /* mapping smaller than header + capacity, or bad capacity */
    OVL_ESTATE = 11,   /* commit/release without a reservation/read */
};

typedef struct ovl_ring_header {
    _Atomic uint64_t magic;
    uint32_t version;
    uint32_t header_size;
    uint64_t capacity;
    int32_t creator_pid;
    _Atomic int32_t producer_pid;
    _Atomic int32_t consumer_pid;
    _Atomic uint32_t closed;
    _Atomic uint32_t error_state;
    uint32_t error_len;
    uint64_t creator_pidns; /* inode of /proc/<creator>/ns/pid: pids mean nothing across namespaces */
    uint64_t creator_start; /* creator start time (clock ticks since boot): defeats pid reuse */

    /* Producer-written line: the consumer only reads it (and bumps data_waiters while asleep). */
    _Alignas(64) _Atomic uint64_t head;
    _Atomic uint32_t data_seq;
    _Atomic uint32_t data_waiters;

    /* Consumer-written line, apart so the two sides do not false-share. */
    _Alignas(64) _Atomic uint64_t tail;
    _Atomic uint32_t space_seq;
    _Atomic uint32_t space_waiters;

    _Alignas(64) char error_msg[OVL_RING_ERROR_BYTES];
    /* pid namespaces of the claimants: a peer in another namespace cannot be probed by pid. */
    _Atomic uint64_t producer_pidns;
    _Atomic uint64_t consumer_pidns;
    /* What the consumer has finished with, in its own units (a trainer: its last batch);
     * the producer reads it to tell how far ahead of the consumer it runs. */
    _Atomic uint64_t consumer_mark;
    /* Bumped (and woken) at every mark the consumer sets: a watcher of many rings' marks
     * (a Data Constructor host's mark poller) sleeps on them instead of polling. */
    _Atomic uint32_t mark_seq;
    _Atomic uint32_t mark_waiters;
    uint8_t reserved[OVL_RING_HEADER_SIZE - 192 - OVL_RING_ERROR_BYTES - 32];
} ovl_ring_header;

/* The layout is a cross-process ABI: pin every offset the Python side and other builds rely on. */
_Static_assert(ATOMIC_LLONG_LOCK_FREE == 2, "64-bit atomics must be lock-free to live in shared memory");
_Static_assert(ATOMIC_INT_LOCK_FREE == 2, "32-bit atomics must be lock-free to live in shared memory");
_Static_assert(sizeof(_Atomic uint32_t) == 4, "futex words are 32-bit");
_Static_assert(sizeof(_Atomic uint64_t) == 8, "counters are 64-bit");
_Static_assert(offsetof(ovl_ring_header, version) == 8, "layout");
_Static_assert(offsetof(ovl_ring_header, capacity) == 16, "layout");
_Static_assert(offsetof(ovl_ring_header, creator_pid) == 24, "layout");
_Static_assert(offsetof(ovl_ring_header, producer_pid) == 28, "layout");
_Static_assert(offsetof(ovl_ring_header, consumer_pid) == 32, "layout");
_Static_assert(offsetof(ovl_ring_header, closed) == 36, "layout");
_Static_assert(offsetof(ovl_ring_header, error_state) == 40, "layout");
_Static_assert(offsetof(ovl_ring_header, error_len) == 44, "layout");
_Static_assert(offsetof(ovl_ring_header, creator_pidns) == 48, "layout");
_Static_assert(offsetof(ovl_ring_header, creator_start) == 56, "layout");
_Static_assert(offsetof(ovl_ring_header, head) == 64, "head on its own cache line");
_Static_assert(offsetof(ovl_ring_header, data_seq) == 72, "layout");
_Static_assert(offsetof(ovl_ring_header, tail) == 128, "tail on its own cache line");
_Static_assert(offsetof(ovl_ring_header, space_seq) == 136, "layout");
_Static_assert(offsetof(ovl_ring_header, error_msg) == 192, "layout");
_Static_assert(offsetof(ovl_ring_header, producer_pidns) == 2240, "layout");
_Static_assert(offsetof(ovl_ring_header, consumer_pidns) == 2248, "layout");
_Static_assert(offsetof(ovl_ring_header, consumer_mark) == 2256, "layout");
_Static_assert(offsetof(ovl_ring_header, mark_seq) == 2264, "layout");
_Static_assert(sizeof(ovl_ring_header) == OVL_RING_HEADER_SIZE, "header is exactly one page");
_Static_assert(OVL_RING_HEADER_SIZE % 64 == 0, "data area starts cache-line aligned");

/* Process-local view of a mapped ring plus the state of one in-flight reserve/read. */
typedef struct ovl_ring {
    ovl_ring_header *hdr;
    uint8_t *data;
    uint64_t capacity;
    uint64_t mask;
    int reserved;      /* producer: a record is reserved but not committed */
    uint64_t res_pos;  /* its head counter value */
    uint64_t res_len;  /* its payload length */
    int reading;       /* consumer: a record is handed out but not released */
    uint64_t read_pos; /* its tail counter value */
    uint64_t read_span;
    uint64_t peak;     /* producer: the most bytes of records in use it has seen (rewinding) */
    uint64_t pad_at;   /* producer: head counter value of its last WRAP record */
    uint64_t pad_len;  /* and its span (0: none yet) */
} ovl_ring;

/* Copy n bytes into a ring record with stores that bypass the cache (SSE2 streaming
 * stores on x86-64; memcpy elsewhere), fenced before it returns, so a commit that
 * follows publishes them. For records larger than a core's cache: the record's lines
 * are not read in first (a plain store reads each line it writes), and the producer
 * does not evict what it works on for bytes another process reads. */
void ovl_stream_copy(void *dst, const void *src, size_t n);

/* Segment size for a (rounded) capacity. */
uint64_t ovl_ring_segment_size(uint64_t capacity);
/* Round a requested capacity up to a power of two >= OVL_RING_MIN_CAPACITY; 0 if too large. */
uint64_t ovl_ring_round_capacity(uint64_t requested);
/* Initialise a zero-filled mapping of ovl_ring_segment_size(capacity) bytes. */
int ovl_ring_init(void *base, uint64_t len, uint64_t capacity, int32_t creator_pid,
                  uint64_t creator_pidns, uint64_t creator_start);
/* Check the header of a mapping: OVL_OK, OVL_EUNINIT, OVL_EMAGIC, OVL_EVERSION, OVL_ESIZE. */
int ovl_ring_check(const void *base, uint64_t len);
/* Bind a process-local handle to a checked mapping. */
int ovl_ring_open(ovl_ring *r, void *base, uint64_t len);
/* Largest payload a record may have in this ring. */
uint64_t ovl_ring_max_record(const ovl_ring *r);

/* Producer. Offsets are from the start of the segment (base) to the payload. */
int ovl_ring_try_reserve(ovl_ring *r, uint64_t len, uint64_t *offset);
int ovl_ring_wait_space(ovl_ring *r, uint64_t len, int64_t timeout_ns);
int ovl_ring_commit(ovl_ring *r);
/* Publish without waking a consumer asleep on the ring: a producer that writes several
 * records in a row wakes it once, with ovl_ring_wake_data after the last. A waiting
 * consumer sleeps on until that wake-up or its own timeout, never past either. */
int ovl_ring_commit_quiet(ovl_ring *r);
void ovl_ring_wake_data(ovl_ring *r);
void ovl_ring_abort(ovl_ring *r);
void ovl_ring_close_writer(ovl_ring *r);

/* Consumer. try_read releases the previous record first. */
int ovl_ring_try_read(ovl_ring *r, uint64_t *offset, uint64_t *len);
int ovl_ring_wait_data(ovl_ring *r, int64_t timeout_ns);
int ovl_ring_release(ovl_ring *r);

/* Consumer with leases: several records handed out at once, released in any order.
 * The caller keeps its own read cursor (a head/tail counter value, >= tail): peek
 * returns the record at the cursor and the cursor after it (past a WRAP record too)
 * without moving tail (OVL_EAGAIN with *next past a lone WRAP record: step over it,
 * it holds no data); release_to moves tail forward to a cursor value once every
 * record before it is released. Never mix with try_read/release on one ring. */
int ovl_ring_peek(ovl_ring *r, uint64_t cursor, uint64_t *offset, uint64_t *len, uint64_t *next);
int ovl_ring_wait_data_at(ovl_ring *r, uint64_t cursor, int holding, int64_t timeout_ns);
int ovl_ring_release_to(ovl_ring *r, uint64_t tail);
/* wait_data_at, for a caller `holding` leases, returns at once while the producer waits
 * for space (the producer also wakes a consumer waiting for data when it starts to
 * wait): a leasing consumer that holds that space copies out what it holds (detach)
 * instead of waiting forever. */
/* The first record-aligned cursor: where a new consumer starts. */
uint64_t ovl_ring_tail(const ovl_ring *r);

/* Consumer: store its progress mark (opaque to the ring) and wake a watcher of it. */
void ovl_ring_set_mark(ovl_ring *r, uint64_t mark);

/* Watcher: sleep until the consumer mark of one of the n rings differs from seen[i], at
 * most timeout_ns; marks_out[i] gets each ring's mark then. One futex_waitv over the
 * rings' mark_seq words where the kernel has it (Linux 5.16, at most 128 rings), else
 * looks every poll_ns. Returns OVL_OK, or OVL_ETIMEDOUT when no mark moved. */
int ovl_ring_wait_marks(ovl_ring *const *rings, int n, const uint64_t *seen, uint64_t *marks_out,
                        int64_t timeout_ns, int64_t poll_ns);
/* Whether the producer is asleep waiting for space. */
int ovl_ring_space_wanted(const ovl_ring *r);

/* Anyone. set_error returns OVL_EERROR if an error was already set (first error wins). */
int ovl_ring_set_error(ovl_ring *r, const char *msg, uint64_t len);
/* Returns the message length and sets *msg, or -1 if no error is set. */
int64_t ovl_ring_get_error(const ovl_ring *r, const char **msg);
int ovl_ring_is_closed(const ovl_ring *r);
uint64_t ovl_ring_pending(const ovl_ring *r);

#endif /* OVERLORD_RING_H */
