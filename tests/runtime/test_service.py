"""The sidecar's server processes: their restart pause, and a Flight port already taken."""

import socket
import subprocess
import sys

import pytest

from overlord import BatchSpec, Job, Mesh, Source
from overlord.errors import ConfigError
from overlord.remote.flight import serve
from overlord.runtime import service
from overlord.runtime.service import RESTART_MAX_S, RESTART_MIN_S, STEADY_S, Supervised


def _job() -> Job:
    return Job(
        name="svc",
        sources=(Source(name="a", paths=("x",)),),
        mesh=Mesh(dp=2),
        batch=BatchSpec(global_batch=2),
        nodes=("n0", "n1"),
        node="n0",
        redis_url="redis://127.0.0.1:1/0",
        flight_port=8815,
    )


def test_a_flight_port_an_outgoing_connection_took_fails_with_the_port_and_what_to_change():
    """The kernel hands an outgoing connection a local port from its ephemeral range; a
    Flight endpoint set to that port cannot listen while the connection lives. gRPC says
    only "did not start properly": the error names the port and why."""
    job = _job()
    with socket.create_server(("127.0.0.1", 0)) as listener:
        with socket.create_connection(listener.getsockname()) as client:
            peer, _ = listener.accept()
            with peer:
                port = client.getsockname()[1]  # the outgoing connection's own port
                with pytest.raises(ConfigError) as raised:
                    serve(job, port, "token")
    message = str(raised.value)
    assert f"0.0.0.0:{port}" in message and "Job.flight_port" in message, message
    span = service.ephemeral_ports()
    if span is not None and span[0] <= port <= span[1]:
        assert "ip_local_port_range" in message, message


def test_only_a_port_in_the_ephemeral_range_gets_the_hint():
    span = service.ephemeral_ports()
    if span is None:
        pytest.skip("/proc/sys/net/ipv4/ip_local_port_range is not readable here")
    low, high = span
    assert f"{low}-{high}" in service.port_hint(low) and service.port_hint(high)
    assert service.port_hint(low - 1) == "" and service.port_hint(high + 1) == ""


def _exits() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])


def test_a_server_process_that_keeps_exiting_is_started_again_after_a_doubling_pause(tmp_path):
    """Not fifty times a second (the sidecar's watch tick): each exit in a row doubles the
    pause, up to RESTART_MAX_S; one that ran STEADY_S before it exited starts again soon."""
    starts = []

    def start():
        starts.append(_exits())
        return starts[-1]

    s = Supervised("the test server", start, tmp_path / "test.log")
    t = s.started
    pauses = []
    for _ in range(8):
        s.proc.wait(timeout=30)
        s.keep_up(t)  # sees the exit: sets the pause
        assert s.again_at is not None and len(starts) == len(pauses) + 1
        pauses.append(s.pause)
        s.keep_up(t + s.pause / 2)
        assert len(starts) == len(pauses), "started again before its pause was over"
        t += s.pause
        s.keep_up(t)
        assert len(starts) == len(pauses) + 1 and s.again_at is None
    assert pauses[0] == RESTART_MIN_S and pauses[1] == 2 * RESTART_MIN_S
    assert pauses[-1] == RESTART_MAX_S and all(b >= a for a, b in zip(pauses, pauses[1:]))
    s.proc.wait(timeout=30)
    s.keep_up(t + STEADY_S)  # it "ran" STEADY_S this time: the shortest pause again
    assert s.pause == RESTART_MIN_S
    for p in starts:
        p.wait(timeout=30)


def test_a_server_process_that_runs_is_left_alone(tmp_path):
    s = Supervised(
        "the test server",
        lambda: subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]),
        tmp_path / "t.log",
    )
    try:
        s.keep_up(s.started + 100)
        assert s.again_at is None and s.proc.poll() is None
    finally:
        s.proc.kill()
        s.proc.wait(timeout=30)
