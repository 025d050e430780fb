"""The node's Arrow Flight endpoint as a process of its own (overlord.runtime.service
says why it is not a sidecar thread).

    python -m overlord.remote.server --run-dir DIR --parent SIDECAR_PID

The job comes from DIR/job.json, the token from $OVERLORD_FLIGHT_TOKEN.
"""

from __future__ import annotations

import os
import sys

from overlord.remote.endpoint import TOKEN_ENV
from overlord.remote.flight import serve
from overlord.runtime import service


def main(argv: list[str] | None = None) -> int:
    def start(job):
        return serve(job, job.flight_port, os.environ[TOKEN_ENV]).shutdown

    return service.main("flight", argv, start)


if __name__ == "__main__":
    sys.exit(main())
