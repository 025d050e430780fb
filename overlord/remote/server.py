"""The node's Arrow Flight endpoint as a process of its own (see
overlord.remote.flight.start_server_process for why it is not a sidecar thread).

    python -m overlord.remote.server --run-dir DIR --parent SIDECAR_PID

The job comes from DIR/job.json, the token from $OVERLORD_FLIGHT_TOKEN.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

from overlord.config import Job
from overlord.remote.flight import TOKEN_ENV, serve
from overlord.sidecar.flow import set_on_signal


def main(argv: list[str] | None = None) -> int:
    import argparse
    import signal

    from overlord.store.server import die_with_parent

    parser = argparse.ArgumentParser(prog="overlord-flight")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--parent", type=int, required=True)
    args = parser.parse_args(argv)
    die_with_parent(signal.SIGKILL)
    if os.getppid() != args.parent:
        return 1  # the sidecar died before we asked to die with it
    from overlord.logs import setup_logging

    setup_logging("flight")
    job = Job.from_dict(json.loads((Path(args.run_dir) / "job.json").read_text()))
    server = serve(job, job.flight_port, os.environ[TOKEN_ENV])
    stop = threading.Event()
    signal.signal(signal.SIGTERM, set_on_signal(stop))
    stop.wait()
    server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
