"""A Data Constructor's inputs from Source Loaders on other nodes, over Arrow Flight.

On a job on several nodes a loader process and a Data Constructor may run on
different nodes (loaders are spread over the nodes; a node's units move when its
sidecar dies). The constructor then reads that loader's samples through a Bridge: a
thread that streams the records of the loader's ring for this DP group from the
Flight endpoint of the node the loader runs on (overlord.remote.flight), into a
bounded in-process queue the constructor reads like a ring. Bounded in flight: the
queue (`QUEUE_RECORDS`), gRPC flow control and the loader's own ring.

Where each loader runs comes from a Directory: the `placement` and `nodes` hashes,
read together every `REFRESH_S` by one thread per process.

Exactly once: a stream that ends cleanly ended because the loader process is gone
and every record it wrote was sent (it moved, or is restarting; the restarted one
sends every unfinished step again). A stream cut by an error may have lost records
in transit: the bridge then sets `broke`, and the constructor asks every loader to
replay to its DP group from the step it is collecting (`progress` r<dp>, as a restarted
constructor does, fenced by its claim on the group). The constructor drops what it
receives twice.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

from overlord.errors import RingTimeout
from overlord.store.schema import json_records

log = logging.getLogger("overlord.bridge")

REFRESH_S = 0.1
QUEUE_RECORDS = 64
RETRY_S = 0.1
OPEN_S = 1.0  # how long to dial a node before looking up the placement again
# A bridge that cannot get its stream back fails every RETRY_S or so (its node is
# unreachable, or its ring there is still held by a unit that is stopping), and each
# failure owes a replay, in which every loader sends the group all it keeps from the
# step on: a constructor asks at most once this often (one owed meanwhile waits)
REPLAY_GAP_S = 1.0


class Directory:
    """Where every unit runs and how each node's Flight endpoint is reached."""

    def __init__(self, r, keys, stop: threading.Event) -> None:
        self.r, self.keys, self.stop = r, keys, stop
        self.placement: dict[str, str] = {}
        self.nodes: dict[str, dict] = {}
        self.refresh()
        threading.Thread(target=self._forever, daemon=True, name="directory").start()

    def refresh(self) -> None:
        pipe = self.r.pipeline(transaction=False)
        pipe.hgetall(self.keys.placement)
        pipe.hgetall(self.keys.nodes)
        placement, nodes = pipe.execute()
        self.placement = {k.decode(): v.decode() for k, v in placement.items()}
        self.nodes = json_records(nodes)

    def _forever(self) -> None:
        while not self.stop.wait(REFRESH_S):
            try:
                self.refresh()
            except Exception as exc:  # noqa: BLE001 - Redis blips: keep the last view
                log.debug("directory refresh failed: %s", exc)

    def node_of(self, unit: str) -> str | None:
        return self.placement.get(unit)

    def flight(self, node: str) -> str | None:
        return (self.nodes.get(node) or {}).get("flight")


class Breaks:
    """Whether a Data Constructor owes its loaders a replay request for broken
    streams of its bridges (each bridge's `broke`), at most once every REPLAY_GAP_S."""

    def __init__(self, bridges, gap_s: float = REPLAY_GAP_S) -> None:
        self.bridges, self.gap_s = bridges, gap_s
        self._asked = float("-inf")  # monotonic: the last time owed() said yes

    def owed(self) -> bool:
        """True (and the flags cleared) when a stream broke since the last request and
        the gap has passed; a break within the gap stays flagged until it has."""
        now = time.monotonic()
        if now - self._asked < self.gap_s or not any(b.broke.is_set() for b in self.bridges):
            return False
        for b in self.bridges:
            b.broke.clear()
        self._asked = now
        return True


class Bridge:
    """Samples of loader process `loader` for DP group `dp`, while that loader runs on
    another node; reads like a ring (try_read / read / release / close)."""

    def __init__(
        self,
        job,
        r,
        keys,
        loader: int,
        dp: int,
        directory: Directory,
        stop: threading.Event,
        token: str,
        lz4: bool = True,
    ) -> None:
        self.job, self.r, self.keys = job, r, keys
        self.loader, self.dp, self.directory, self.stop = loader, dp, directory, stop
        self.token, self.lz4 = token, lz4
        self.queue: queue.Queue[memoryview] = queue.Queue(maxsize=QUEUE_RECORDS)
        self.received = 0
        self.reconnects = 0
        self.broke = threading.Event()  # records in transit may be lost: a replay is owed
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"bridge-l{loader}-c{dp}")
        self._thread.start()

    # -- the ring-like side the Data Constructor reads -------------------------------

    def try_read(self) -> memoryview | None:
        try:
            return self.queue.get_nowait()
        except queue.Empty:
            return None

    def read(self, timeout: float) -> memoryview:
        try:
            return self.queue.get(timeout=timeout)
        except queue.Empty:
            raise RingTimeout(
                f"no sample from loader process {self.loader} for dp={self.dp} within {timeout:.3g}s"
            ) from None

    def release(self) -> None:
        pass  # every record is its own buffer

    def close(self) -> None:
        pass  # the thread ends with the stop event

    # -- the stream --------------------------------------------------------------------

    def _run(self) -> None:
        unit = f"loader{self.loader}"
        while not self.stop.is_set():
            node = self.directory.node_of(unit)
            location = self.directory.flight(node) if node else None
            if node is None or node == self.job.node or location is None:
                self.stop.wait(RETRY_S)  # local (its ring is read directly) or not placed yet
                continue
            # deferred: pyarrow.flight (overlord.remote.endpoint) loads where a stream crosses nodes
            from overlord.remote.flight import RemoteReader

            reader = RemoteReader(
                self.job,
                location,
                token=self.token,
                lz4=self.lz4,
                timeout_s=self.job.timeout_s,
                samples=(self.loader, self.dp),
                open_timeout_s=OPEN_S,
            )  # then look again where the loader runs
            try:
                self._pump(reader, unit, node)
            except Exception as exc:  # noqa: BLE001 - pyarrow.flight errors: reconnect and ask for a replay
                if self.stop.is_set():
                    return
                self.reconnects += 1
                log.warning(
                    "samples of loader process %d for dp=%d from node %r: stream broke (%s); asking for a replay",
                    self.loader,
                    self.dp,
                    node,
                    str(exc).splitlines()[0],
                )
                self.broke.set()  # the constructor asks for the replay (it knows its step)
                self.stop.wait(RETRY_S)
            finally:
                reader.close()

    def _pump(self, reader, unit: str, node: str) -> None:
        """Move records into the queue until the stream ends (clean: the loader is gone)."""
        while not self.stop.is_set():
            try:
                record = next(reader)
            except StopIteration:
                return
            except RingTimeout:
                if self.directory.node_of(unit) != node:
                    return  # it moved while idle
                continue  # an idle loader (ahead of the trainers, or finished)
            while not self.stop.is_set():
                try:
                    self.queue.put(record, timeout=0.2)
                    self.received += 1
                    break
                except queue.Full:
                    continue
