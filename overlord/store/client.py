"""Connecting to the control-path Redis, embedded or external.

Every client rides through a Redis outage: a command that finds the server gone
(connection refused or reset) is retried with exponential backoff for about
`RIDE_THROUGH_S` before the error reaches the role, which then fails with it. Writes
are idempotent (SET, HSET, XADD whose duplicates the reader drops) or fenced (a
Planner's MULTI fails over to a checkpoint reload), so a retried command that had in
fact been applied does no harm.

A TLS server (rediss://) is verified against the system's CAs, or against the CA file
named by `OVERLORD_REDIS_CA` (set it for the sidecar and the trainer; forked roles inherit it).
"""

from __future__ import annotations

import os

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from overlord.errors import StoreError

CA_ENV = "OVERLORD_REDIS_CA"
SOCKET_TIMEOUT_S = 10.0
RIDE_THROUGH_S = 30.0
_BACKOFF_CAP_S = 0.1


def connect(url: str, *, timeout_s: float = SOCKET_TIMEOUT_S, ride_through_s: float = RIDE_THROUGH_S) -> redis.Redis:
    """Open a Redis client for `url` (redis://, rediss://, unix://; ACL user and password in
    the URL: `rediss://user:password@host:port/0`).

    Values stay bytes (plans and metadata are binary or JSON decoded by their owners).
    A rediss:// server's certificate must verify (and name the host): against the CA file
    in `$OVERLORD_REDIS_CA` if set, else the system's CAs. redis-py's own URL query
    parameters also work and win over the environment, e.g.
    `rediss://user:pw@host:6380/0?ssl_ca_certs=/etc/overlord/ca.pem&ssl_cert_reqs=required`.

    Args:
        url: the server.
        timeout_s: socket timeout of one command.
        ride_through_s: how long a command keeps retrying while the server is gone.

    Raises:
        StoreError: the server does not answer a PING (unreachable, TLS or login refused).
    """
    tls = {}
    if url.startswith("rediss://") and os.environ.get(CA_ENV):
        tls = {"ssl_ca_certs": os.environ[CA_ENV], "ssl_cert_reqs": "required"}
    client = redis.Redis.from_url(
        url,
        **tls,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        health_check_interval=30,
        retry=Retry(ExponentialBackoff(), 1, supported_errors=(redis.ConnectionError,)),
    )
    try:
        client.ping()  # a server that is not there at all is a configuration error: say so now
    except redis.RedisError as exc:
        raise StoreError(f"Redis at {redact(url)} is unreachable: {exc}; check Job.redis_url") from None
    retries = max(0, int(ride_through_s / _BACKOFF_CAP_S) + 6)  # the first ~6 backoffs are short
    client.set_retry(Retry(ExponentialBackoff(cap=_BACKOFF_CAP_S, base=0.005), retries,
                           supported_errors=(redis.ConnectionError,)))
    return client


def redact(url: str) -> str:
    """The URL with any password replaced, for messages and logs."""
    if "@" not in url:
        return url
    scheme, rest = url.split("://", 1)
    return f"{scheme}://***@{rest.rsplit('@', 1)[1]}"  # the last @: a password may hold one
