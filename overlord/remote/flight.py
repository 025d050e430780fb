"""The remote data path: a sidecar serves its trainers' micro-batches over Arrow Flight.

Where a trainer cannot read its ring (its node has no sidecar of its own), it asks a
sidecar that serves its rank for the same micro-batches over the network. The server
takes the consumer side of that rank's client ring and streams each record, unchanged:

    Flight stream: Arrow IPC record batches (optionally LZ4-compressed), schema
        record: binary    one ring record per row, in the batch wire format of
                          overlord.shm._batch (named arrays + JSON meta, bounds-checked
                          on decode; no pickle)

    ticket: JSON {"job": name, "rank": int, "token": str, "lz4": bool, "after": [step, mb]}

With `Job.flight_cert`/`flight_key` the endpoint speaks only TLS (grpc+tls://) and
readers verify it against $OVERLORD_FLIGHT_CA (or the certificate itself).

The ticket's job must be the one this sidecar serves and its token the job's (compared
in constant time), or the request is refused with FlightUnauthenticatedError. Records
at or before `after` are skipped server-side (a client resuming its stream), and the
client drops anything at or before its last batch too, as it does locally. What is in
flight is bounded by gRPC flow control and `RECORDS_PER_BATCH`.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import secrets
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from overlord.config import Job
from overlord.errors import ConfigError, RingClosed, RingTimeout
from overlord.shm import Ring, decode_batch
from overlord.sidecar.layout import client_ring

log = logging.getLogger("overlord.remote")

SCHEMA = pa.schema([pa.field("record", pa.binary())])
RECORDS_PER_BATCH = 4  # ring records per Arrow record batch: small, so a trainer never waits on a fill
TOKEN_ENV = "OVERLORD_FLIGHT_TOKEN"
CA_ENV = "OVERLORD_FLIGHT_CA"
TOKEN_FILE = "flight.token"


def job_token(job: Job, *, create: bool = False) -> str:
    """The job's Flight token: $OVERLORD_FLIGHT_TOKEN, else the run directory's token file
    (mode 0600), made by the sidecar when `create`."""
    token = os.environ.get(TOKEN_ENV)
    if token:
        return token
    path = Path(job.run_path) / TOKEN_FILE
    if create and not path.exists():
        job.make_run_path()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_urlsafe(32))
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        raise ConfigError(
            f"no Flight token for job {job.name!r}: set ${TOKEN_ENV} (the same on every node) or run on the "
            f"node whose sidecar wrote {path}"
        ) from None


class BatchServer(flight.FlightServerBase):
    """Serves one job's micro-batches, by rank, over Flight."""

    def __init__(self, job: Job, location: str, token: str, **kwargs) -> None:
        super().__init__(location, **kwargs)
        self.job, self.token = job, token
        self.serving: dict[int, threading.Event] = {}

    def _check(self, request: dict) -> int:
        if request.get("job") != self.job.name:
            raise flight.FlightUnauthenticatedError(
                f"this sidecar serves job {self.job.name!r}, not {request.get('job')!r}")
        if not hmac.compare_digest(str(request.get("token", "")), self.token):
            raise flight.FlightUnauthenticatedError(f"wrong token for job {self.job.name!r}")
        rank = request.get("rank")
        if not isinstance(rank, int) or not 0 <= rank < self.job.mesh.world_size:
            raise flight.FlightServerError(f"rank {rank!r} is not a rank of job {self.job.name!r}")
        return rank

    def do_get(self, context, ticket):
        try:
            request = json.loads(ticket.ticket)
        except ValueError:
            raise flight.FlightServerError(
                "the ticket is not JSON {job, rank, token, lz4, after}; read with overlord.remote.RemoteReader") from None
        rank = self._check(request)
        after = tuple(request["after"]) if request.get("after") and tuple(request["after"]) >= (0, 0) else None
        ring = Ring.attach(client_ring(self.job, rank), timeout=self.job.timeout_s)
        ring.claim_consumer()  # the remote trainer is this rank's consumer now
        log.info("rank %d served over Flight to %s", rank, context.peer())
        options = pa.ipc.IpcWriteOptions(compression="lz4" if request.get("lz4") else None)
        return flight.GeneratorStream(SCHEMA, self._records(ring, after, context), options=options)

    def _records(self, ring: Ring, after: tuple[int, int], context):
        records: list[bytes] = []
        try:
            while not context.is_cancelled():
                try:
                    view = ring.read(timeout=0.05 if records else 0.5)
                except RingTimeout:
                    if records:
                        yield pa.record_batch([pa.array(records, pa.binary())], schema=SCHEMA)
                        records = []
                    continue
                except RingClosed:
                    break
                if after is not None:  # resuming: skip what the reader has (decoding only until then)
                    _, meta = decode_batch(view)
                    if (meta["step"], meta["microbatch"]) <= after:
                        continue
                    after = None
                records.append(bytes(view))
                if len(records) >= RECORDS_PER_BATCH:
                    yield pa.record_batch([pa.array(records, pa.binary())], schema=SCHEMA)
                    records = []
            if records:
                yield pa.record_batch([pa.array(records, pa.binary())], schema=SCHEMA)
        finally:
            ring.close()


def serve(job: Job, port: int, token: str, host: str = "0.0.0.0") -> BatchServer:
    """Start a BatchServer on `port` in a background thread (TLS when the job has a cert)."""
    if job.flight_cert:
        pair = flight.CertKeyPair(cert=Path(job.flight_cert).read_bytes(), key=Path(job.flight_key).read_bytes())
        server = BatchServer(job, f"grpc+tls://{host}:{port}", token, tls_certificates=[pair])
    else:
        server = BatchServer(job, f"grpc://{host}:{port}", token)
    threading.Thread(target=server.serve, daemon=True, name="flight").start()
    return server


class RemoteReader:
    """A trainer's stream of its micro-batches from a sidecar's Flight endpoint."""

    def __init__(self, job: Job, location: str, rank: int, *, token: str, lz4: bool = True,
                 after: tuple[int, int] = (-1, -1), timeout_s: float = 60.0) -> None:
        self.location, self.timeout_s = location, timeout_s
        if location.startswith("grpc+tls://"):
            ca = os.environ.get(CA_ENV) or job.flight_cert
            if not ca:
                raise ConfigError(f"{location} is TLS: set ${CA_ENV} to the CA that signed the sidecar's certificate")
            self.client = flight.FlightClient(location, tls_root_certs=Path(ca).read_bytes())
        else:
            self.client = flight.FlightClient(location)
        self.ticket = flight.Ticket(json.dumps({"job": job.name, "rank": rank, "token": token, "lz4": lz4,
                                                "after": list(after)}).encode())
        self.reader = None
        self._rows: list = []

    def _open(self) -> None:
        """Open the stream, waiting (up to the timeout) for a sidecar that is starting."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            reader = self.client.do_get(self.ticket, flight.FlightCallOptions(timeout=self.timeout_s))
            try:
                first = reader.read_chunk()
            except flight.FlightUnavailableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
                continue
            except StopIteration:
                first = None
            self.reader = reader
            return first

    def __iter__(self):
        return self

    def __next__(self) -> memoryview:
        """The next ring record, copied to an aligned buffer (arrays decoded from it are
        aligned for every dtype); StopIteration at the end of the stream."""
        while not self._rows:
            if self.reader is None:
                first = self._open()
                if first is None:
                    raise StopIteration
                chunk = first.data
            else:
                chunk = self.reader.read_chunk().data  # raises StopIteration at the end of the stream
            column = chunk.column(0)
            offsets = np.frombuffer(column.buffers()[1], dtype=np.int32, count=len(column) + 1,
                                    offset=column.offset * 4)
            data = memoryview(column.buffers()[2])
            self._rows = [data[offsets[i]:offsets[i + 1]] for i in range(len(column))][::-1]
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
