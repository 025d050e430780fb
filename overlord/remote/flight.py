"""The remote data path: sidecars serve ring records to other nodes over Arrow Flight.

Two kinds of stream, both the records of one shared-memory ring, unchanged:

- a trainer's micro-batches (`rank`): where a trainer's Data Constructor runs on
  another node (its own node's sidecar is down, or not started yet), it reads them
  from that node's client ring for its rank;
- a Source Loader's samples for one DP group (`loader`, `dp`): a Data Constructor
  pulls the samples of sources placed on other nodes (overlord.remote.bridge).

    Flight stream: Arrow IPC record batches (optionally LZ4-compressed), schema
        record: binary    one ring record per row, in the batch wire format of
                          overlord.shm._batch (named arrays + JSON meta, bounds-checked
                          on decode; no pickle)

    ticket: JSON {"job": name, "token": str, "lz4": bool,
                  "rank": int, "after": [step, mb]}          a trainer's micro-batches
               or {"job", "token", "lz4", "loader": int, "dp": int}   samples
            checked before use (parse_ticket): anything else is answered with a
            FlightServerError saying what is wrong, never a traceback

With `Job.flight_cert`/`flight_key` the endpoint speaks only TLS (grpc+tls://) and
readers verify it against $OVERLORD_FLIGHT_CA (or the certificate itself).

The ticket's job must be the one this sidecar serves and its token the job's (compared
in constant time), or the request is refused with FlightUnauthenticatedError. Records
at or before `after` are skipped server-side (a client resuming its stream), and the
client drops anything at or before its last batch too, as it does locally. A stream
ends when the ring's producer is gone and every record was sent (its Data Constructor
or Source Loader moved to another node, or is restarting): the reader then looks up
where that role runs now. One stream per ring at a time: a new request for a ring
takes it over from the old one. What is in flight is bounded by gRPC flow control and
`RECORDS_PER_BATCH`.

Serving a rank's micro-batches, the endpoint is that client ring's consumer, so it sets
the ring's consumer mark (step + 1 of the last batch handed on, as a local client does)
each time gRPC takes a record batch to send: the Planner's bound on its lead over the
trainers (overlord.constructor.marks) then holds for a rank read over the network too.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from overlord.config import Job
from overlord.errors import ConfigError, PeerDied, RingClosed, RingError, RingTimeout
from overlord.runtime import service
from overlord.runtime.layout import client_ring, sample_ring
from overlord.shm import Ring, decode_batch

log = logging.getLogger("overlord.remote")

SCHEMA = pa.schema([pa.field("record", pa.binary())])
RECORDS_PER_BATCH = 4  # ring records per Arrow record batch: small, so a trainer never waits on a fill
KEEPALIVE_S = 1.0  # an idle stream sends an empty batch this often, so a reader's wait stays bounded
# A reader that got nothing, not even a keep-alive, for this long cancels its stream: the
# connection is dead without a word (half-open after a link cut: the server forgot the
# stream, and a reader that only receives never hears of it)
STALL_S = 10 * KEEPALIVE_S
CA_ENV = "OVERLORD_FLIGHT_CA"


TICKET_HOLDS = (
    'a ticket is a JSON object {"job": str, "token": str, "lz4": bool, "rank": int, '
    '"after": [step, microbatch]} or {"job": str, "token": str, "lz4": bool, "loader": int, "dp": int}; '
    "read with overlord.remote.RemoteReader"
)
MAX_TICKET_BYTES = 4096  # a real one is ~120 B
_INT64 = 2**63 - 1


def parse_ticket(raw: bytes) -> dict:
    """The request a ticket holds, its shape and types checked before anything uses it.

    Raises:
        flight.FlightServerError: saying what is wrong and what a ticket holds (the
            client sees the message; no traceback crosses).
    """

    def bad(what: str) -> flight.FlightServerError:
        return flight.FlightServerError(f"bad ticket: {what}; {TICKET_HOLDS}")

    def integer(value: object, low: int) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and low <= value <= _INT64

    if len(raw) > MAX_TICKET_BYTES:
        raise bad(f"{len(raw)} bytes, more than {MAX_TICKET_BYTES}")
    try:
        request = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise bad(f"not JSON ({type(exc).__name__}: {str(exc)[:80]})") from None
    if not isinstance(request, dict):
        raise bad(f"a JSON {type(request).__name__}, not an object")
    for key in ("job", "token"):
        if not isinstance(request.get(key), str):
            raise bad(f"{key!r} is {request.get(key)!r}, not a string")
    if not isinstance(request.get("lz4", False), bool):
        raise bad(f"'lz4' is {request['lz4']!r}, not true or false")
    if "loader" in request or "dp" in request:
        for key in ("loader", "dp"):
            if not integer(request.get(key), 0):
                raise bad(f"{key!r} is {request.get(key)!r}, not an integer in [0, 2^63)")
        return request
    if not integer(request.get("rank"), 0):
        raise bad(f"'rank' is {request.get('rank')!r}, not an integer in [0, 2^63)")
    after = request.get("after", [-1, -1])
    if not (isinstance(after, list) and len(after) == 2 and all(integer(v, -1) for v in after)):
        raise bad(f"'after' is {after!r}, not [step, microbatch] (two integers >= -1; [-1, -1]: from the start)")
    return request


class BatchServer(flight.FlightServerBase):
    """Serves one job's micro-batches, by rank, over Flight."""

    def __init__(self, job: Job, location: str, token: str, **kwargs) -> None:
        super().__init__(location, **kwargs)
        self.job, self.token = job, token
        self._owners: dict[str, object] = {}  # ring name -> the stream that reads it now
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    def _check(self, request: dict) -> str:
        """Authenticate a request; the name of the ring it asks for."""
        if request.get("job") != self.job.name:
            raise flight.FlightUnauthenticatedError(
                f"this sidecar serves job {self.job.name!r}, not {request.get('job')!r}"
            )
        if not hmac.compare_digest(str(request.get("token", "")), self.token):
            raise flight.FlightUnauthenticatedError(f"wrong token for job {self.job.name!r}")
        if "loader" in request:
            loader, dp = request.get("loader"), request.get("dp")
            if not isinstance(loader, int) or loader < 0 or not isinstance(dp, int) or not 0 <= dp < self.job.mesh.dp:
                raise flight.FlightServerError(
                    f"loader {loader!r} / dp {dp!r} is not a sample ring of job {self.job.name!r}"
                )
            return sample_ring(self.job, loader, dp)
        rank = request.get("rank")
        if not isinstance(rank, int) or not 0 <= rank < self.job.mesh.world_size:
            raise flight.FlightServerError(f"rank {rank!r} is not a rank of job {self.job.name!r}")
        return client_ring(self.job, rank)

    def do_get(self, context, ticket):
        request = parse_ticket(ticket.ticket)
        name = self._check(request)
        after = tuple(request["after"]) if request.get("after") and tuple(request["after"]) >= (0, 0) else None
        try:
            ring = Ring.attach(name, timeout=self.job.timeout_s)
        except RingTimeout:
            raise flight.FlightUnavailableError(f"ring {name} does not exist on node {self.job.node!r} yet") from None
        try:
            ring.claim_consumer()  # the remote reader is this ring's consumer now
        except RingError as exc:
            ring.close()
            # a role of this node still reads it (one placed elsewhere that is stopping, which
            # its sidecar kills past a grace): unavailable for now, the reader dials again
            raise flight.FlightUnavailableError(f"{exc} on node {self.job.node!r}; try again") from None
        me = object()
        with self._guard:
            self._owners[name] = me  # an older stream of this ring stops at its next read
            lock = self._locks.setdefault(name, threading.Lock())
        log.info("ring %s served over Flight to %s", name, context.peer())
        options = pa.ipc.IpcWriteOptions(compression="lz4" if request.get("lz4") else None)
        records = self._records(ring, name, me, lock, after, context, marking="loader" not in request)
        return flight.GeneratorStream(SCHEMA, records, options=options)

    def _read_one(self, ring: Ring, name: str, me: object, lock: threading.Lock, timeout: float) -> bytes | None:
        """One record copied out of the ring (None: nothing within `timeout`); raises
        RingClosed at the end and _Superseded when a newer stream took the ring."""
        with lock:  # one reader of a ring at a time; never held across a yield
            if self._owners.get(name) is not me or ring.consumer_pid != os.getpid():
                raise _Superseded()  # a newer stream, or a local consumer (a role moved here), took it
            try:
                view = ring.read(timeout=timeout)
            except RingTimeout:
                return None
            except PeerDied:
                raise RingClosed("producer gone, every record sent") from None
            record = bytes(view)
            ring.release()
            return record

    def _records(self, ring: Ring, name: str, me: object, lock: threading.Lock, after, context, marking: bool = False):
        records: list[bytes] = []
        sent = time.monotonic()
        top = -1  # the highest step among the records of the batch being filled
        if marking and after is not None:
            # the reader has every batch up to `after` (read elsewhere: this node's ring
            # before, or another node's); the records it skips below mark nothing, and a
            # mark left behind would hold the Planner, and so the rank, back for ever
            _mark(ring, after[0])
        try:
            while not context.is_cancelled():
                try:
                    record = self._read_one(ring, name, me, lock, 0.05)
                except (RingClosed, _Superseded):
                    break
                if record is None:
                    if records or time.monotonic() - sent > KEEPALIVE_S:
                        yield pa.record_batch([pa.array(records, pa.binary())], schema=SCHEMA)
                        top = _mark(ring, top)
                        records, sent = [], time.monotonic()
                    continue
                if after is not None or marking:
                    _, meta = decode_batch(memoryview(record))
                    if after is not None:  # resuming: skip what the reader has
                        if "step" in meta and (meta["step"], meta["microbatch"]) <= after:
                            continue
                        after = None
                    top = max(top, int(meta.get("step", -1)))
                records.append(record)
                if len(records) >= RECORDS_PER_BATCH:
                    yield pa.record_batch([pa.array(records, pa.binary())], schema=SCHEMA)
                    top = _mark(ring, top)
                    records, sent = [], time.monotonic()
            if records:
                yield pa.record_batch([pa.array(records, pa.binary())], schema=SCHEMA)
        finally:
            ring.close()


def _mark(ring: Ring, top: int) -> int:
    """gRPC took the batch holding steps up to `top` to send: mark them consumed (see
    overlord.constructor.marks). Returns the next batch's `top`."""
    if top >= 0 and top + 1 > ring.consumer_mark:
        ring.set_consumer_mark(top + 1)
    return -1


class _Superseded(Exception):
    """A newer stream took over this ring."""


def serve(job: Job, port: int, token: str, host: str = "0.0.0.0") -> BatchServer:
    """Start a BatchServer on `port` in a background thread (TLS when the job has a cert)."""
    try:
        if job.flight_cert and job.flight_key:  # Job refuses one without the other
            pair = flight.CertKeyPair(cert=Path(job.flight_cert).read_bytes(), key=Path(job.flight_key).read_bytes())
            server = BatchServer(job, f"grpc+tls://{host}:{port}", token, tls_certificates=[pair])
        else:
            server = BatchServer(job, f"grpc://{host}:{port}", token)
    except pa.ArrowException as e:  # gRPC says only "did not start properly": find out whether the port is taken
        if service.port_taken(host, port):
            hint = service.port_hint(port) or "stop what holds it or choose another port"
            raise ConfigError(
                f"the Flight endpoint cannot listen on {host}:{port} (Job.flight_port): something on this host "
                f"holds that port; {hint}"
            ) from e
        raise
    threading.Thread(target=server.serve, daemon=True, name="flight").start()
    return server


class StreamStalled(RingError):
    """A Flight stream sent nothing, not even a keep-alive, for STALL_S: it was cancelled."""


class _StallWatch:
    """One thread for the process: cancels the stream of every RemoteReader whose read
    has waited past STALL_S (the readers are held weakly; a closed one is dropped)."""

    def __init__(self) -> None:
        self.readers: weakref.WeakSet[RemoteReader] = weakref.WeakSet()
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None

    def watch(self, reader: RemoteReader) -> None:
        with self.lock:
            self.readers.add(reader)
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, daemon=True, name="flight-stall-watch")
                self.thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(KEEPALIVE_S)
            now = time.monotonic()
            with self.lock:
                readers = list(self.readers)
            for reader in readers:
                since, stream = reader.reading_since, reader.reader
                if since is not None and stream is not None and now - since > STALL_S:
                    reader.stalled = True
                    try:
                        stream.cancel()
                    except Exception:  # noqa: BLE001 - a stream that ended meanwhile
                        pass


_STALLS = _StallWatch()


class RemoteReader:
    """A trainer's stream of its micro-batches from a sidecar's Flight endpoint.

    Every read is bounded: the server sends a keep-alive batch every KEEPALIVE_S while
    idle, and a read that gets nothing for STALL_S is cancelled (StreamStalled): the
    caller opens a new stream."""

    def __init__(
        self,
        job: Job,
        location: str,
        rank: int | None = None,
        *,
        token: str,
        lz4: bool = True,
        after: tuple[int, int] = (-1, -1),
        timeout_s: float = 60.0,
        samples: tuple[int, int] | None = None,
        open_timeout_s: float | None = None,
    ) -> None:
        """Read rank `rank`'s micro-batches, or with `samples=(loader, dp)` the samples
        loader process `loader` sends DP group `dp`. Opening waits up to
        `open_timeout_s` (default `timeout_s`) for an endpoint that is starting."""
        self.location, self.timeout_s = location, timeout_s
        self.open_timeout_s = timeout_s if open_timeout_s is None else open_timeout_s
        if location.startswith("grpc+tls://"):
            ca = os.environ.get(CA_ENV) or job.flight_cert
            if not ca:
                raise ConfigError(f"{location} is TLS: set ${CA_ENV} to the CA that signed the sidecar's certificate")
            self.client = flight.FlightClient(location, tls_root_certs=Path(ca).read_bytes())
        else:
            self.client = flight.FlightClient(location)
        request = {"job": job.name, "token": token, "lz4": lz4}
        if samples is not None:
            request.update(loader=samples[0], dp=samples[1])
        else:
            request.update(rank=rank, after=list(after))
        self.ticket = flight.Ticket(json.dumps(request).encode())
        self.reader: Any = None
        self.reading_since: float | None = None  # monotonic: a read waits since then
        self.stalled = False  # the stall watch cancelled the stream
        self._rows: list = []
        _STALLS.watch(self)

    def _open(self) -> Any:
        """Open the stream, waiting (up to the open timeout) for a sidecar that is starting."""
        deadline = time.monotonic() + self.open_timeout_s
        while True:
            try:
                # no call deadline: a stream lasts as long as the job; idle waits are
                # bounded by the server's keep-alive batches and the stall watch instead
                self.reader = self.client.do_get(self.ticket)
                first = self._read_chunk()
            except flight.FlightUnavailableError:
                self.reader = None
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
                continue
            except StopIteration:
                first = None
            return first

    def _read_chunk(self) -> Any:
        """The stream's next chunk; StreamStalled if the stall watch cancelled it."""
        self.reading_since = time.monotonic()
        try:
            return self.reader.read_chunk()
        except Exception as exc:
            if self.stalled:
                raise StreamStalled(
                    f"Flight stream from {self.location} sent nothing, not even a keep-alive, for {STALL_S:g}s "
                    "(the connection died without a word, e.g. across a link cut); cancelled"
                ) from exc
            raise
        finally:
            self.reading_since = None

    def __iter__(self):
        return self

    def __next__(self) -> memoryview:
        """The next ring record, copied to an aligned buffer (arrays decoded from it are
        aligned for every dtype); StopIteration at the end of the stream.

        Raises:
            RingTimeout: no record for `timeout_s` (the server's keep-alives came: it
                lives, but nothing was produced).
        """
        deadline = time.monotonic() + self.timeout_s
        while not self._rows:
            if self.reader is None:
                first = self._open()
                if first is None:
                    raise StopIteration
                chunk = first.data
            else:
                chunk = self._read_chunk().data  # raises StopIteration at the end of the stream
            if chunk.num_rows == 0:
                if time.monotonic() > deadline:
                    raise RingTimeout(f"no record from {self.location} within {self.timeout_s:g}s")
                continue
            column = chunk.column(0)
            offsets = np.frombuffer(
                column.buffers()[1], dtype=np.int32, count=len(column) + 1, offset=column.offset * 4
            )
            data = memoryview(column.buffers()[2])
            self._rows = [data[offsets[i] : offsets[i + 1]] for i in range(len(column))][::-1]
        row = self._rows.pop()
        record = np.empty(len(row), dtype=np.uint8)  # numpy aligns its allocations
        record[:] = np.frombuffer(row, dtype=np.uint8)
        return record.data

    def close(self) -> None:
        try:
            if self.reader is not None:
                self.reader.cancel()
        except Exception:  # noqa: BLE001 - closing a finished stream
            pass
        self.client.close()
