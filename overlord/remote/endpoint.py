"""The node's Flight endpoint as the sidecar sees it: the job's token, and the process
that serves it (overlord.remote.server, which imports flight.py).

Kept apart from flight.py so that a sidecar, its roles and a trainer load
pyarrow.flight (gRPC and Arrow's Flight libraries: ~8 MiB of a process's PSS, their
relocated pages private to it) only where a job reads or serves over Flight: a job on
one node never does.
"""

from __future__ import annotations

import os
import secrets
import subprocess
from pathlib import Path

from overlord.config import Job
from overlord.errors import ConfigError
from overlord.runtime import service
from overlord.store import Keys, connect
from overlord.store.client import password_env

TOKEN_ENV = "OVERLORD_FLIGHT_TOKEN"
TOKEN_FILE = "flight.token"


def job_token(job: Job, *, create: bool = False, r=None) -> str:
    """The job's Flight token: $OVERLORD_FLIGHT_TOKEN; else, on several nodes, the one in
    the job's Redis (`flight-token`, made by the first sidecar; Redis access is the
    trust root there); else the run directory's token file (mode 0600), made by the
    sidecar when `create`."""
    token = os.environ.get(TOKEN_ENV)
    if token:
        return token
    if job.multi_node:
        if r is None:
            if job.redis_url is None:
                raise ConfigError(f"job {job.name!r} runs on several nodes without Job.redis_url; set it")
            r = connect(job.redis_url, timeout_s=5)
        key = Keys(job.name).flight_token
        if create:
            r.set(key, secrets.token_urlsafe(32), nx=True)
        raw = r.get(key)
        if raw is None:
            raise ConfigError(f"no Flight token for job {job.name!r} in Redis yet: is a sidecar of the job up?")
        return raw.decode()
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


def start_server_process(job: Job, token: str, run_dir: Path) -> subprocess.Popen:
    """Run the node's Flight endpoint in a process of its own (overlord.runtime.service:
    a forked role that used gRPC after its parent started gRPC threads would crash); the
    token travels in its environment, never in argv."""
    return service.start(
        "overlord.remote.server", run_dir, "flight.log", {TOKEN_ENV: token, **password_env(job.redis_url)}
    )
