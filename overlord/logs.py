"""Logging for every Overlord process, through the standard `logging` module.

`setup_logging(role)` configures the root logger once per process:

- the level from `$OVERLORD_LOG` (default INFO);
- plain lines `time role logger message` by default, or with
  `$OVERLORD_LOG_FORMAT=json` one JSON object per line, for a log shipper:
  {"time": ISO-8601 UTC, "level", "logger", "role", "pid", "job", "node", "message",
  "exc" (a traceback, when there is one)}.

`job` and `node` are set with `log_context` once the process has read its job (a
forked role inherits its sidecar's).
"""

from __future__ import annotations

import json
import logging
import os
import time

FORMAT_ENV = "OVERLORD_LOG_FORMAT"
_CONTEXT = {"job": "", "node": ""}


def log_context(job: str, node: str) -> None:
    """The job and node every later record of this process names."""
    _CONTEXT.update(job=job, node=node)


class JsonFormatter(logging.Formatter):
    """One JSON object per record."""

    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "role": self.role,
            "pid": record.process,
            "job": _CONTEXT["job"],
            "node": _CONTEXT["node"],
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(role: str) -> None:
    """Configure this process's logging for `role` (replaces earlier handlers)."""
    level = os.environ.get("OVERLORD_LOG", "INFO").upper()
    handler = logging.StreamHandler()
    if os.environ.get(FORMAT_ENV, "text").lower() == "json":
        handler.setFormatter(JsonFormatter(role))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {role} %(name)s %(message)s"))
    logging.basicConfig(level=level, handlers=[handler], force=True)
    logging.captureWarnings(True)  # library warnings become records too (one JSON line each)
