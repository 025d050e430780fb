"""Starting role processes by fork from the sidecar.

The sidecar imports what the roles need (numpy, pyarrow, redis, Pillow, the role
modules) once, freezes those objects out of the garbage collector's reach
(`gc.freeze`, so collections do not dirty their pages), and forks each role. The
children share those pages copy-on-write instead of importing their own copies, which
is most of a Python process's memory. Nothing is pickled: a child gets its role name,
index and run directory, and reads the job from the run directory.

A forked child asks the kernel to SIGKILL it when the sidecar dies
(PR_SET_PDEATHSIG), so `kill -9` of the sidecar takes every role with it at once (a
role riding through a Redis outage would otherwise linger, holding the sidecar's
inherited lock, while the next sidecar waits to start).
"""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import sys
import time
import traceback
from pathlib import Path

from overlord import heap
from overlord.config import split_redis_password
from overlord.runtime.lease import RUN_ENV
from overlord.sidecar.role import main as role_main
from overlord.store.client import password_env
from overlord.store.server import die_with_parent


def preload(remote: bool = False) -> None:
    """Import every module a role uses, then freeze them for copy-on-write sharing
    (after `heap.tune`, so the sidecar's own heap is kept flat too, and with Arrow's
    buffers in that heap: `heap.use_system_arrow_pool`). pyarrow.flight only if
    `remote` (a job on several nodes, whose Data Constructors bridge over Flight): a
    job on one node never loads it (overlord.remote.endpoint)."""
    heap.tune()
    heap.use_system_arrow_pool()
    # deferred: the roles' modules (pyarrow, Pillow, the role loops: ~0.5 s) load here by
    # design: once, in the sidecar that forks, after heap.tune and the Arrow pool choice
    import numpy  # noqa: F401
    import PIL.Image  # noqa: F401
    import pyarrow.parquet  # noqa: F401
    import redis  # noqa: F401

    import overlord.constructor.process  # noqa: F401
    import overlord.loader.process  # noqa: F401
    import overlord.planner.process  # noqa: F401
    import overlord.transforms  # noqa: F401

    if remote:
        # deferred: gRPC and Arrow's Flight (~8 MiB of PSS), for a job whose constructors bridge nodes
        import pyarrow.flight  # noqa: F401

    gc.collect()
    gc.freeze()


class RoleProcess:
    """A forked role process: the subset of `subprocess.Popen` the sidecar uses."""

    def __init__(self, name: str, pid: int) -> None:
        self.name, self.pid = name, pid
        self.role, self.index = name.rstrip("0123456789"), int(name[len(name.rstrip("0123456789")) :] or 0)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                self.returncode = -1 if self.returncode is None else self.returncode
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} (pid {self.pid}) did not exit within {timeout}s")
            time.sleep(0.02)
        return self.returncode if self.returncode is not None else -1

    def _signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def dump_stacks(self) -> None:
        """Have it write every thread's stack to its log (overlord.sidecar.role)."""
        self._signal(signal.SIGUSR1)


def _set_name(name: str) -> None:
    """Name the process (/proc/PID/comm, shown by ps and top) after its role."""
    libc = ctypes.CDLL(None)
    libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME


def fork_role(
    role: str, index: int, run_dir: Path, redis_url: str, attempt: int = 0, run: bytes | None = None
) -> RoleProcess:
    """Fork a child that runs `overlord.sidecar.role.main` for (role, index); `attempt`
    counts restarts (a restarted role recovers from Redis); `run`: the job's run token
    (the `run` key) the sidecar started or joined with, in $OVERLORD_RUN."""
    log = run_dir / f"{role}{index}.log"
    sys.stdout.flush()
    sys.stderr.flush()
    parent = os.getpid()
    pid = os.fork()
    if pid:
        return RoleProcess(f"{role}{index}", pid)
    code = 1
    try:
        die_with_parent(signal.SIGKILL)
        if os.getppid() != parent:
            os._exit(1)  # the sidecar died between the fork and that request: nobody would kill us
        _set_name(f"ovl-{role}{index}")
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        # the child reads the URL without its password; the password travels beside it
        os.environ["OVERLORD_REDIS_URL"] = split_redis_password(redis_url)[0]
        os.environ.update(password_env(redis_url))
        os.environ.pop(RUN_ENV, None)
        if run is not None:
            os.environ[RUN_ENV] = run.decode()
        code = role_main([role, "--run-dir", str(run_dir), "--index", str(index), "--attempt", str(attempt)])
    except BaseException:  # noqa: BLE001 - the child must never return into the sidecar's code
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
