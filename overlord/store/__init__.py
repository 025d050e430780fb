"""The control path: Redis keys, connections and the embedded server."""

from overlord.store.client import connect, outage_within, redact
from overlord.store.keys import Keys
from overlord.store.server import EmbeddedRedis, redis_server_binary

__all__ = [
    "EmbeddedRedis",
    "Keys",
    "connect",
    "outage_within",
    "redact",
    "redis_server_binary",
]
