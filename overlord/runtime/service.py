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
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from overlord.config import Job
from overlord.logs import log_context, setup_logging
from overlord.runtime.flow import set_on_signal
from overlord.store.server import die_with_parent


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
