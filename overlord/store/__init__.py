"""The control path: Redis keys, connections and the embedded server.

`Keys` loads with the package; connections and the server (redis-py: 6 MiB of a
process) on first use, so a trainer of a job on one node, which reads only its ring and
leaves its figures in the ring's consumer note, never loads redis-py.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from overlord.store.keys import Keys

if TYPE_CHECKING:
    from overlord.store.client import connect, outage_within, redact
    from overlord.store.server import EmbeddedRedis, redis_server_binary

_ON_USE = {
    "connect": "client",
    "outage_within": "client",
    "redact": "client",
    "EmbeddedRedis": "server",
    "redis_server_binary": "server",
}


def __getattr__(name: str) -> Any:
    """The names that load redis-py, imported on first use (PEP 562)."""
    module = _ON_USE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    "EmbeddedRedis",
    "Keys",
    "connect",
    "outage_within",
    "redact",
    "redis_server_binary",
]
