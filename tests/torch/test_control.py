"""A trainer's control client (overlord.torch.control): its first connection, made while
the job's Redis is away, waits for it when a sidecar of the job runs on the node (that
sidecar reached the server: the node's link is cut, or a failover runs), and is an
error at once when none does (a wrong URL). A trainer whose first Redis call fell in a
10 s link cut of its node died with 'unreachable' while every role rode it through
(found by random link cuts on two namespaced hosts)."""

from __future__ import annotations

import fcntl
import socket
import subprocess
import threading
import time

import pytest

from overlord.config import Job, Source
from overlord.errors import StoreError
from overlord.sidecar.mode import lock_path
from overlord.store.server import redis_server_binary
from overlord.torch.control import Control


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def job(tmp_path):
    path = tmp_path / "web.jsonl"
    path.write_text('{"text": "a"}\n')
    return Job(
        name="ctl",
        sources=(Source(name="web", paths=(str(path),)),),
        redis_url=f"redis://127.0.0.1:{_port()}/0",
        redis_outage_s=30.0,
        run_dir=str(tmp_path / "run"),
    )


def test_with_no_sidecar_on_the_node_an_unreachable_redis_is_an_error_at_once(job):
    started = time.monotonic()
    with pytest.raises(StoreError, match="unreachable"):
        Control(job).client()
    assert time.monotonic() - started < 5


def test_with_the_job_s_sidecar_on_the_node_the_first_connection_waits_for_redis(job, tmp_path):
    path = lock_path(job)
    path.parent.mkdir(parents=True, exist_ok=True)
    port = int(job.redis_url.rsplit(":", 1)[1].split("/")[0])
    server: list[subprocess.Popen] = []

    def come_back() -> None:  # the link is back 1.5 s later
        time.sleep(1.5)
        args = ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(tmp_path)]
        server.append(subprocess.Popen([redis_server_binary(), *args], stdout=subprocess.DEVNULL))

    with open(path, "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # what a running sidecar holds
        later = threading.Thread(target=come_back)
        later.start()
        try:
            started = time.monotonic()
            client = Control(job).client()
            assert client.ping() is True
            assert 1.0 < time.monotonic() - started < 25
        finally:
            later.join()
            for proc in server:
                proc.kill()
                proc.wait(timeout=10)
