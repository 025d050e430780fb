"""How far the trainers of one DP group have consumed, published for the Planner.

The Planner may plan step s only while s <= (the slowest trainer's step) + plan_ahead,
so a metric a trainer reports at step t (`DataLoader.report_metrics`) shapes the plan
of step t + plan_ahead + 1 at the latest, whatever the ring sizes. What a trainer has
consumed is in its client ring: the client sets the ring's consumer mark to step + 1
each time it hands the trainer a batch of `step` (0: nothing yet), and the Flight
endpoint does the same for a rank it serves over the network (overlord.remote.flight).

Each Data Constructor's `MarkWatch` reads the marks of the rings it writes (every rank
of its group on this node: plain loads from shared memory, through mappings of the
watch's own, so no Ring object is shared with the constructor's thread) and publishes
their minimum as `progress` t<dp>, with an entry on the `progressed` stream the Planner
blocks on, when it rises: O(1) Redis writes per step, none while it stands, whether
the constructor builds or waits for a plan. One thread per process looks at every
watch started in it (a constructor host runs several groups) when a trainer sets its
mark (it wakes the thread: `overlord.shm.wait_marks`), and every `LOOK_EVERY_S`.

- A ring read to the end (nothing pending) counts as consumed up to the last step
  written to it: a consumer that sets no mark paces the Planner step by step instead
  of stalling the job.
- A rank whose trainer left (the constructor stopped writing to it) does not hold
  the group back.
- The published mark never goes down: a restarted Data Constructor reads it from
  Redis, then from the rings, which keep their marks across its restart.

The same thread publishes the trainers' running totals of a job on one node: a trainer
leaves them in its ring's consumer note (overlord.torch.stats) and, once every
`NOTES_EVERY_S` (and at once for a trainer's first), the notes that changed go to the
`stats` hash in one HSET for all the groups of the process: one write a second per node
instead of a connection and a write a second per rank. A trainer that died leaves its note as it was, so its record stands
still, which is how the other ranks' watchdogs tell it (overlord.torch.watchdog).

Fencing. Every mark of a group (c<dp>, t<dp>) and its replay request (r<dp>) is written
only while `progress` o<dp> names the writer (`Owner`): a Data Constructor that was
superseded while out of Redis's reach (its node cut off, its unit restarted on another
node) and comes back writes nothing more. Unfenced, its c<dp> once landed after its
successor had set the mark back, and the successor's replay request then asked the
loaders for the steps after it, not the ones it was building: they never came.
Such a process learns it at its next write, or at its watch's next read of o<dp>
(every `OWNER_CHECK_S`), and its whole host stops (`on_superseded`): it exits with
`SUPERSEDED` (overlord.sidecar.role), so the sidecar of a node its unit is placed on
again starts a new one, which takes the group over, instead of keeping the stale one.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping

import redis

from overlord.errors import RingError
from overlord.runtime.layout import client_ring
from overlord.shm import Ring, wait_marks
from overlord.store.schema import (
    consumed_entry,
    consumed_field,
    encode_contact,
    note_record,
    owner_field,
    replay_requester,
    trainer_stats_field,
)

log = logging.getLogger("overlord.constructor")

POLL_S = 0.002  # between two looks at the marks where the kernel cannot sleep on them all
LOOK_EVERY_S = 0.02  # a look in Python at least this often, marks moved or not (a ring read
# to the end, retries, trainers that left)
RETRY_S = 0.1  # after a failed write, before the group's next look
OWNER_CHECK_S = 1.0  # how often a watch reads who owns its group's marks (a stale process learns it)
NOTES_EVERY_S = 1.0  # how often the trainers' notes that changed are published
STREAM_MAXLEN = 1000  # `progressed` entries kept (only the newest matter)

# KEYS: `progress`, `progressed`; ARGV: o<dp>, the writer, the field, its value, then for
# a mark the `progressed` stream's MAXLEN and its entry's fields and values
_FENCED_WRITE = """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then
  return 0
end
redis.call('HSET', KEYS[1], ARGV[3], ARGV[4])
if #ARGV > 4 then
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[5], '*', unpack(ARGV, 6))
end
return 1
"""


class Superseded(Exception):
    """Another Data Constructor of this DP group writes its marks now."""


class Owner:
    """This process's claim to write DP group `dp`'s marks: `progress` o<dp> names it
    (`me`, `<pid>.<time>`) from its start; every write checks it on the server."""

    def __init__(self, r, keys, dp: int) -> None:
        self.r, self.keys, self.dp = r, keys, dp
        self.me = replay_requester(os.getpid())
        self.field = owner_field(dp)
        self._write = r.register_script(_FENCED_WRITE)

    def claim(self) -> None:
        """A first start: this process writes the group's marks from now on."""
        self.r.hset(self.keys.progress, self.field, self.me)

    def write(self, field: str, value, entry: Mapping[str, int] | None = None, client=None) -> None:
        """HSET `progress` `field` (and XADD `entry` to `progressed`) while this process
        owns the group; queued on `client` (a pipeline) if given, as a bare EVALSHA: a
        script object on a pipeline costs a SCRIPT EXISTS each execute (one a step), so
        a server that lost the script answers NOSCRIPT there, and the caller writes
        again without `client` (which loads it).

        Raises:
            Superseded: not queued, and another process owns the group.
        """
        args = [self.field, self.me, field, value]
        if entry is not None:
            args += [STREAM_MAXLEN, *(x for kv in entry.items() for x in kv)]
        if client is not None:
            client.evalsha(self._write.sha, 2, self.keys.progress, self.keys.progressed, *args)
            return
        check(self._write(keys=[self.keys.progress, self.keys.progressed], args=args), self.dp)

    def holds(self) -> bool:
        """Whether `progress` still names this process as the group's owner."""
        raw = self.r.hget(self.keys.progress, self.field)
        return raw is not None and raw.decode() == self.me


def check(done, dp: int) -> None:
    """Raise Superseded if a fenced write (its script's reply) was refused."""
    if not done:
        raise Superseded(f"DataConstructor dp={dp}: another process owns the group's marks now")


class MarkWatch:
    """Publishes DP group `dp`'s trainer mark while its Data Constructor runs.

    Args:
        job: the job.
        dp: the DP group.
        r: a Redis client (thread-safe: the poller takes connections of its own).
        keys: the job's keys.
        outputs: the constructor's rank -> ring it writes; a rank dropped from it
            (its trainer left) no longer counts. Read, never changed, here.
        written: rank -> the last step the constructor wrote to that rank's ring.
        owner: the constructor's claim (its writes are fenced by it).
        on_superseded: called (from the poller's thread) once another process owns
            the group: a write was refused, or the owner, read every OWNER_CHECK_S,
            names another. A process cut off from Redis learns it there once it is back,
            even while its trainers read nothing of it (their marks do not move).
    """

    def __init__(
        self,
        job,
        dp: int,
        r,
        keys,
        outputs: Mapping[int, Ring],
        written: Mapping[int, int],
        owner: Owner,
        on_superseded: Callable[[], None] | None = None,
    ) -> None:
        self.dp, self.r, self.keys, self.outputs, self.written = dp, r, keys, outputs, written
        self.owner, self.on_superseded = owner, on_superseded
        self.rings = {rank: Ring.attach(client_ring(job, rank), timeout=job.timeout_s) for rank in outputs}
        self.node = job.node
        self.noted: dict[int, bytes] = {}  # rank -> the consumer note last published
        raw = r.hget(keys.progress, consumed_field(dp))
        self.published = int(raw) if raw is not None else 0
        self.ended = threading.Event()  # stopped, superseded, or its rings are gone
        self._lock = threading.Lock()  # held by the poller while it looks at this group
        self._retry_at = 0.0  # after a failed write: the next look is not before this
        self._owner_at = time.monotonic() + OWNER_CHECK_S  # the next read of the group's owner

    def start(self) -> MarkWatch:
        _Poller.of_this_process().add(self)
        return self

    def stop(self) -> None:
        self.ended.set()
        _Poller.of_this_process().remove(self)
        if self._lock.acquire(timeout=5):  # the poller is not looking at the rings now
            try:
                publish_notes([self])  # the trainers' last totals (a trainer's final note)
                self._close()
            finally:
                self._lock.release()
        # else the poller is stuck in this group's write: it closes the rings (ended) when it returns

    def _close(self) -> None:
        for ring in self.rings.values():
            ring.close()
        self.rings = {}

    def mark(self) -> int:
        """The group's mark now: the least over its ranks still served (0: one has not
        consumed yet)."""
        marks = []
        for rank, ring in self.rings.items():
            if rank not in self.outputs:
                continue  # its trainer left
            mark = ring.consumer_mark
            last = self.written.get(rank, -1)  # read before pending(): that record was written by then
            if last >= 0 and ring.pending() == 0:
                mark = max(mark, last + 1)  # read to the end: every record up to `last` was consumed
            marks.append(mark)
        return min(marks, default=0)

    def poll(self, now: float) -> None:
        """One look at the group's rings (the poller's, with `_lock` held): publish the
        mark if it rose; `ended` is set once nothing more is to be published here."""
        if self.ended.is_set() or now < self._retry_at:
            return
        try:
            mark = self.mark()
            if mark > self.published:
                self.owner.write(consumed_field(self.dp), mark, entry=consumed_entry(self.dp, mark))
                self.published = mark
            if now >= self._owner_at:
                self._owner_at = now + OWNER_CHECK_S
                if not self.owner.holds():
                    check(False, self.dp)
        except Superseded as exc:
            log.warning("%s; its trainers' mark is no longer published from here", exc)
            self.ended.set()
            if self.on_superseded is not None:
                self.on_superseded()
        except redis.RedisError as exc:  # the control path rides through outages; try again
            log.warning("DataConstructor dp=%d: publishing the trainers' mark failed (%s); retrying", self.dp, exc)
            self._retry_at = now + RETRY_S
        except RingError:
            self.ended.set()  # the sidecar removed the rings: the job is ending

    def first_note(self) -> bool:
        """Whether a trainer whose note was never published left one (published at once:
        the contact stamped back is what its watchdog dates a Redis outage from)."""
        try:
            return any(rank not in self.noted and ring.consumer_note() is not None for rank, ring in self.rings.items())
        except RingError:
            return False  # closed under the group: its look ends it

    def notes(self) -> dict[int, tuple[bytes, str]]:
        """rank -> (its trainer's consumer note, its `stats` record) for the notes that
        changed since they were last published (`noted`)."""
        fresh = {}
        for rank, ring in self.rings.items():
            try:
                note = ring.consumer_note()
            except RingError:
                continue  # closed under the group: its look ends it
            if note is None or note == self.noted.get(rank):
                continue
            record = note_record(note, self.node)
            if record is None:
                self.noted[rank] = note  # not a record: passed over until it changes
            else:
                fresh[rank] = (note, record)
        return fresh


def publish_notes(watches: list[MarkWatch]) -> None:
    """The trainers' notes that changed, of every group watched here, in one HSET of the
    `stats` hash (a Redis that is away only delays them: the next turn tries again). Once
    it is written, each ring's producer note says when: a trainer that stalls dates a
    Redis outage from it (overlord.torch.watchdog), as from a write of its own."""
    fresh = [(watch, watch.notes()) for watch in watches]
    fields = {trainer_stats_field(rank): record for _, notes in fresh for rank, (_, record) in notes.items()}
    if not fields:
        return
    first = fresh[0][0]
    try:
        first.r.hset(first.keys.stats, mapping=fields)
    except redis.RedisError as exc:
        log.debug("publishing %d trainers' running totals failed (%s); next turn", len(fields), exc)
        return
    contact = encode_contact(time.time())
    for watch, notes in fresh:
        watch.noted.update((rank, note) for rank, (note, _) in notes.items())
        for ring in watch.rings.values():
            try:
                ring.set_producer_note(contact)
            except RingError:
                break  # closed under the group: its look ends it


class _Poller:
    """One thread per process looks at the marks of every group whose Data Constructor
    runs in it: a constructor host runs several groups, and a thread each woke 500 times
    a second per group for a few loads from shared memory (each cost about 1.5% of a
    core). It sleeps on all the rings' marks at once (`wait_marks`: a trainer that sets
    its mark wakes it) and looks at the groups when one moved, or every `LOOK_EVERY_S`;
    a look every 2 ms cost 5-5.6% of a core in bench/control.py, half of it the timer's
    wake-ups alone. It runs while a watch is started, and ends with the last.
    """

    _instance: _Poller | None = None
    _pid = 0
    _guard = threading.Lock()

    def __init__(self) -> None:
        self.watches: list[MarkWatch] = []
        self.lock = threading.Lock()  # guards `watches` and `thread`
        self.thread: threading.Thread | None = None

    @classmethod
    def of_this_process(cls) -> _Poller:
        with cls._guard:
            if cls._instance is None or cls._pid != os.getpid():  # a forked child has no thread
                cls._instance, cls._pid = _Poller(), os.getpid()
            return cls._instance

    def add(self, watch: MarkWatch) -> None:
        with self.lock:
            self.watches.append(watch)
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, daemon=True, name="marks")
                self.thread.start()

    def remove(self, watch: MarkWatch) -> None:
        with self.lock:
            if watch in self.watches:
                self.watches.remove(watch)

    def _run(self) -> None:
        seen: tuple[int, ...] | None = None  # the watched rings' marks, as the last wait left them
        watched: list[Ring] = []
        notes_at = 0.0  # monotonic: the next publication of the trainers' notes
        while True:
            with self.lock:
                self.watches = [w for w in self.watches if not w.ended.is_set()]
                if not self.watches:
                    self.thread = None
                    return
                watches = list(self.watches)
            locks = [watch._lock for watch in watches]  # a group's stop() waits while its rings are watched
            for lock in locks:
                lock.acquire()
            try:
                rings = [ring for watch in watches for ring in watch.rings.values()]
                if rings != watched:
                    seen, watched = None, rings  # a look now, then waits from the marks it saw
                try:
                    seen = wait_marks(rings, seen, LOOK_EVERY_S, POLL_S)
                except RingError:
                    seen = None  # a ring closed under its group: the look below ends the group
                    time.sleep(POLL_S)
                now = time.monotonic()
                if now >= notes_at or any(watch.first_note() for watch in watches):
                    notes_at = now + NOTES_EVERY_S
                    publish_notes(watches)
                for watch in watches:
                    watch.poll(now)
                    if watch.ended.is_set():
                        watch._close()  # nothing more is read here (stop() may not have waited for this look)
            finally:
                for lock in locks:
                    lock.release()
