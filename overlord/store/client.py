"""Connecting to the control-path Redis, embedded or external."""

from __future__ import annotations

import redis

from overlord.errors import StoreError

SOCKET_TIMEOUT_S = 10.0


def connect(url: str, *, timeout_s: float = SOCKET_TIMEOUT_S) -> redis.Redis:
    """Open a Redis client for `url` (redis://, rediss://, unix://; password in the URL).

    Values stay bytes (plans and metadata are binary or JSON decoded by their owners).

    Raises:
        StoreError: the server does not answer a PING.
    """
    client = redis.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        health_check_interval=30,
    )
    try:
        client.ping()
    except redis.RedisError as exc:
        raise StoreError(f"Redis at {redact(url)} is unreachable: {exc}; check Job.redis_url") from None
    return client


def redact(url: str) -> str:
    """The URL with any password replaced, for messages and logs."""
    if "@" not in url:
        return url
    scheme, rest = url.split("://", 1)
    return f"{scheme}://***@{rest.split('@', 1)[1]}"
