"""Server processes next to the sidecar: the Flight endpoint and the metrics endpoint.

They run server threads (gRPC, HTTP), and the sidecar forks its roles: a process that
forks must not have such threads running (a forked child that then uses gRPC dies),
so each server is a process of its own, started with `start` and run by `main`:

    python -m <module> --run-dir DIR --parent SIDECAR_PID

It reads the job from DIR/job.json, dies with the sidecar (PR_SET_PDEATHSIG), and
stops its server on SIGTERM. Secrets travel in its environment, never in argv.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from overlord.config import Job
from overlord.logs import log_context, setup_logging
from overlord.runtime.flow import set_on_signal
from overlord.store.server import die_with_parent

log = logging.getLogger("overlord.sidecar")

RESTART_MIN_S = 0.5  # the pause before a server process that exited is started again ...
RESTART_MAX_S = 15.0  # ... doubling with each exit in a row, up to this
STEADY_S = 60.0  # one that ran this long before it exited starts again after the shortest pause

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def start(module: str, run_dir: Path, log_name: str, env: dict[str, str]) -> subprocess.Popen:
    """Start `python -m module` for this sidecar, logging to run_dir/log_name."""
    log = open(run_dir / log_name, "ab")
    return subprocess.Popen(
        [sys.executable, "-m", module, "--run-dir", str(run_dir), "--parent", str(os.getpid())],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=dict(os.environ, **env),
    )


def main(name: str, argv: list[str] | None, serve: Callable[[Job], Callable[[], None]]) -> int:
    """Run a server process: `serve(job)` starts the server and returns how to stop it."""
    parser = argparse.ArgumentParser(prog=f"overlord-{name}")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--parent", type=int, required=True)
    args = parser.parse_args(argv)
    die_with_parent(signal.SIGKILL)
    if os.getppid() != args.parent:
        return 1  # the sidecar died before we asked to die with it
    setup_logging(name)
    job = Job.from_dict(json.loads((Path(args.run_dir) / "job.json").read_text()))
    log_context(job.name, job.node)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, set_on_signal(stop))
    shutdown = serve(job)
    stop.wait()
    shutdown()
    return 0


class Supervised:
    """A server process the sidecar keeps up: `keep_up` starts it again once it has
    exited, after a pause that doubles with each exit in a row (RESTART_MIN_S to
    RESTART_MAX_S), so one that cannot start (its port taken) is not started fifty times
    a second, and each exit is logged with where its own log is."""

    def __init__(self, name: str, start: Callable[[], subprocess.Popen], log_path: Path) -> None:
        self.name, self._start, self.log_path = name, start, log_path
        self.proc = start()
        self.started = time.monotonic()
        self.pause = 0.0
        self.again_at: float | None = None  # when it starts again (monotonic); None while it runs

    def keep_up(self, now: float) -> None:
        if self.again_at is None:
            if self.proc.poll() is None:
                return
            ran = now - self.started
            self.pause = RESTART_MIN_S if ran >= STEADY_S else min(RESTART_MAX_S, max(RESTART_MIN_S, 2 * self.pause))
            self.again_at = now + self.pause
            log.warning(
                "%s (pid %d) exited with %s after %.1f s; starting it again in %.1f s (its log: %s)",
                self.name,
                self.proc.pid,
                self.proc.returncode,
                ran,
                self.pause,
                self.log_path,
            )
        elif now >= self.again_at:
            self.again_at = None
            self.proc, self.started = self._start(), now


def ephemeral_ports() -> tuple[int, int] | None:
    """The kernel's range of local ports for outgoing connections (None: unreadable)."""
    try:
        low, high = (int(v) for v in EPHEMERAL_RANGE.read_text().split())
    except (OSError, ValueError):
        return None
    return low, high


def port_hint(port: int) -> str:
    """What to say about a listening port that lies in the ephemeral range: any outgoing
    connection on this host can take it first, and then the server cannot listen."""
    span = ephemeral_ports()
    if span is None or not span[0] <= port <= span[1]:
        return ""
    return (
        f"port {port} lies in this host's range for outgoing connections ({span[0]}-{span[1]}, "
        "net.ipv4.ip_local_port_range): any connection can take it first; choose a port outside it"
    )


def port_taken(host: str, port: int) -> bool:
    """Whether something on this host holds TCP `port` (a bind as the server would do fails)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False
