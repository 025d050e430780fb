"""The remote data path: a trainer reads its micro-batches over Arrow Flight from a
sidecar, with the bytes of the local ring; requests for another job or with a wrong
token are refused."""

from __future__ import annotations

import socket
import time
from dataclasses import replace

import pyarrow.flight as flight
import pytest

from overlord import BatchSpec, Mesh
from overlord.remote.endpoint import job_token
from overlord.remote.flight import RemoteReader
from overlord.store import Keys

pytestmark = pytest.mark.timeout(180)

JOB = dict(
    seed=12,
    epochs=1,
    mesh=Mesh(dp=2),
    batch=BatchSpec(global_batch=16, micro_batches=2, context_length=512, ring_bytes=1 << 20),
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # make test-slow (CI runs it): keeps make test under 6 minutes on 2 cores
def test_a_rank_over_flight_gets_the_bytes_of_the_local_ring(cluster, corpus_keys):
    local = cluster(**JOB)
    local.start_sidecar()
    local.start_trainers()
    expected = local.results()
    assert local.stop() == 0

    port = _free_port()
    c = cluster(**JOB, flight_port=port)
    c.start_sidecar()
    c.start_trainers(ranks=[0])
    c.start_trainers(ranks=[1], remote=f"grpc://127.0.0.1:{port}")
    got = c.results()
    for rank in range(2):
        assert got[rank]["end"] == "stop", got[rank]["end"]
        assert got[rank]["digests"] == expected[rank]["digests"]
    seen = [k for rec in got.values() for batch in rec["keys"] for k in batch]
    assert len(seen) == len(set(seen)) and set(seen) == corpus_keys
    assert c.stop() == 0


def _wait_port(port: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        assert time.monotonic() < deadline, f"nothing listens on port {port}"
        time.sleep(0.05)


def test_a_wrong_token_or_job_is_refused(cluster):
    port = _free_port()
    c = cluster(**JOB, flight_port=port)
    c.start_sidecar()
    _wait_port(port)
    location = f"grpc://127.0.0.1:{port}"
    with pytest.raises(flight.FlightUnauthenticatedError, match="wrong token"):
        next(iter(RemoteReader(c.job, location, 0, token="not-the-token")))
    other = replace(c.job, name="otherjob")
    with pytest.raises(flight.FlightUnauthenticatedError, match="serves job"):
        next(iter(RemoteReader(other, location, 0, token=job_token(c.job))))
    assert c.stop() == 0


@pytest.mark.slow  # make test-slow (CI runs it): keeps make test under 6 minutes on 2 cores
def test_a_ring_a_local_role_reads_is_unavailable_not_taken(cluster):
    """A loader's sample ring that this node's Data Constructor reads (or one of this
    node's roles that is stopping still holds): a reader is told to try again, and the
    local consumer keeps the ring."""
    port = _free_port()
    c = cluster(**JOB, flight_port=port)
    c.start_sidecar()
    c.start_trainers(sleep="0.02")
    r, keys = c.redis(), Keys(c.job.name)
    deadline = time.monotonic() + 60
    while int(r.hget(keys.progress, "c0") or -1) < 0:  # dp 0's constructor reads its loader's ring
        assert time.monotonic() < deadline, "no step built within 60 s"
        time.sleep(0.05)
    reader = RemoteReader(
        c.job, f"grpc://127.0.0.1:{port}", token=job_token(c.job), samples=(0, 0), timeout_s=5, open_timeout_s=1
    )
    with pytest.raises(flight.FlightUnavailableError, match="consumer side already claimed by live pid .* try again"):
        next(iter(reader))
    reader.close()
    got = c.results()
    assert all(rec["end"] == "stop" for rec in got.values()), got
    assert c.stop() == 0


def _self_signed(tmp_path):
    import subprocess

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return str(cert), str(key)


@pytest.mark.slow  # make test-slow (CI runs it): keeps make test under 6 minutes on 2 cores
def test_flight_over_tls_serves_the_same_bytes_and_refuses_plain_text(cluster, tmp_path):
    cert, key = _self_signed(tmp_path)
    port = _free_port()
    c = cluster(**JOB, flight_port=port, flight_cert=cert, flight_key=key)
    c.start_sidecar()
    _wait_port(port)
    with pytest.raises(flight.FlightError):  # a plain-text client cannot talk to a TLS endpoint
        next(iter(RemoteReader(c.job, f"grpc://127.0.0.1:{port}", 0, token=job_token(c.job), timeout_s=3)))
    c.start_trainers(ranks=[0])
    c.start_trainers(ranks=[1], remote=f"grpc+tls://localhost:{port}")
    got = c.results()
    assert all(rec["end"] == "stop" for rec in got.values()), {r: rec["end"] for r, rec in got.items()}
    assert c.stop() == 0


BAD_TICKETS = {  # ticket bytes -> what the answer must say
    b"not json at all": "not JSON",
    b"\xff\xfe\x00": "not JSON",
    b"[" * 100_000: "more than 4096",
    b'["job", "token"]': "a JSON list, not an object",
    b'"just a string"': "a JSON str, not an object",
    b"{}": "'job' is None, not a string",
    b'{"job": "j", "token": 5}': "'token' is 5, not a string",
    b'{"job": "j", "token": "t", "lz4": "yes", "rank": 0}': "'lz4' is 'yes'",
    b'{"job": "j", "token": "t"}': "'rank' is None",
    b'{"job": "j", "token": "t", "rank": "0"}': "'rank' is '0'",
    b'{"job": "j", "token": "t", "rank": true}': "'rank' is True",
    b'{"job": "j", "token": "t", "rank": -1}': "'rank' is -1",
    b'{"job": "j", "token": "t", "rank": 99999999999999999999999}': "'rank' is 99999999999999999999999",
    b'{"job": "j", "token": "t", "rank": 0, "after": "x"}': "'after' is 'x'",
    b'{"job": "j", "token": "t", "rank": 0, "after": [1.5, 0]}': "'after' is [1.5, 0]",
    b'{"job": "j", "token": "t", "rank": 0, "after": [0]}': "'after' is [0]",
    b'{"job": "j", "token": "t", "rank": 0, "after": [-2, 0]}': "'after' is [-2, 0]",
    b'{"job": "j", "token": "t", "rank": 0, "after": [0, 18446744073709551616]}': "'after' is [0, 18446744073709551616]",
    b'{"job": "j", "token": "t", "loader": 0}': "'dp' is None",
    b'{"job": "j", "token": "t", "loader": -3, "dp": 0}': "'loader' is -3",
}


@pytest.mark.slow  # make test-slow (CI runs it): keeps make test under 6 minutes on 2 cores
def test_malformed_tickets_are_answered_with_a_message_and_the_endpoint_keeps_serving(cluster, corpus_keys):
    port = _free_port()
    c = cluster(**JOB, flight_port=port)
    c.start_sidecar()
    _wait_port(port)
    client = flight.FlightClient(f"grpc://127.0.0.1:{port}")
    try:
        for raw, says in BAD_TICKETS.items():
            with pytest.raises(flight.FlightServerError) as err:
                client.do_get(flight.Ticket(raw)).read_all()
            message = str(err.value)
            assert says in message and "a ticket is a JSON object" in message, (raw[:60], message)
            assert "Traceback" not in message and 'File "' not in message, message
    finally:
        client.close()
    # a well-formed ticket of the wrong job is refused by authentication, not by shape
    with pytest.raises(flight.FlightUnauthenticatedError, match="serves job"):
        next(iter(RemoteReader(replace(c.job, name="otherjob"), f"grpc://127.0.0.1:{port}", 0, token=job_token(c.job))))
    # and the endpoint still serves a good client its whole stream
    c.start_trainers(ranks=[0])
    c.start_trainers(ranks=[1], remote=f"grpc://127.0.0.1:{port}")
    got = c.results()
    assert all(rec["end"] == "stop" for rec in got.values()), {r: rec["end"] for r, rec in got.items()}
    seen = [k for rec in got.values() for batch in rec["keys"] for k in batch]
    assert len(seen) == len(set(seen)) and set(seen) == corpus_keys
    assert c.stop() == 0


def _flight_server_pid(run_path) -> int:
    from pathlib import Path

    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"overlord.remote.server" in cmd and str(run_path).encode() in cmd:
                return int(entry.name)
    raise AssertionError(f"no Flight server of {run_path} runs")


@pytest.mark.slow  # make test-slow (CI runs it): keeps make test under 6 minutes on 2 cores
def test_a_stream_that_goes_silent_is_cancelled_not_waited_on_for_ever(cluster, monkeypatch):
    """A reader that only receives never hears that its connection died (half-open
    after a link cut): with no batch, not even a keep-alive, for STALL_S, its stream is
    cancelled and the caller told, so it can open another. Here the serving Flight
    endpoint is frozen (SIGSTOP)."""
    import os
    import signal
    import time

    from overlord.remote import flight as remote

    monkeypatch.setattr(remote, "STALL_S", 3.0)
    port = _free_port()
    c = cluster(**JOB, flight_port=port)
    c.start_sidecar()
    _wait_port(port)
    reader = RemoteReader(c.job, f"grpc://127.0.0.1:{port}", 0, token=job_token(c.job), timeout_s=1.0)
    try:
        try:
            next(reader)  # the stream is open, records or keep-alives flow
        except remote.RingTimeout:
            pass
        server = _flight_server_pid(c.job.run_path)
        os.kill(server, signal.SIGSTOP)
        try:
            frozen = time.monotonic()
            with pytest.raises(remote.StreamStalled, match="not even a keep-alive"):
                while time.monotonic() - frozen < 60:
                    try:
                        next(reader)
                    except remote.RingTimeout:
                        pass
            assert time.monotonic() - frozen < 30, "cancelled, but long after STALL_S"
        finally:
            os.kill(server, signal.SIGCONT)
    finally:
        reader.close()
    assert c.stop() == 0
