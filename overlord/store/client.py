"""Connecting to the control-path Redis, embedded or external.

Every client rides through a Redis outage: a command that finds the server gone
(connection refused or reset) is retried with exponential backoff for about
`RIDE_THROUGH_S` before the error reaches the role, which then fails with it. Writes
are idempotent (SET, HSET, XADD whose duplicates the reader drops) or fenced (a
Planner's MULTI fails over to a checkpoint reload), so a retried command that had in
fact been applied does no harm.

A TLS server (rediss://) is verified against the system's CAs, or against the CA file
named by `OVERLORD_REDIS_CA` (set it for the sidecar and the trainer; forked roles inherit it).

A URL that names no password (stored configs never hold one: `Job.to_dict`) takes it
from `$OVERLORD_REDIS_PASSWORD`, else from the file `$OVERLORD_REDIS_PASSWORD_FILE`
names, which must be readable by its owner only. The embedded server's socket
(`unix://` without a user part) never gets one.
"""

from __future__ import annotations

import os
import stat

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from overlord.config import split_redis_password
from overlord.errors import ConfigError, StoreError

CA_ENV = "OVERLORD_REDIS_CA"
PASSWORD_ENV = "OVERLORD_REDIS_PASSWORD"
PASSWORD_FILE_ENV = "OVERLORD_REDIS_PASSWORD_FILE"
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
    password = env_password(url)
    if password is not None:
        tls["password"] = password  # the URL's own options win over keyword arguments: it names none here
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


def env_password(url: str) -> str | None:
    """The password `url` needs from the environment: None when it names one itself,
    when it is the embedded server's socket, or when no variable is set.

    Raises:
        ConfigError: $OVERLORD_REDIS_PASSWORD_FILE cannot be read or others may read it.
    """
    if split_redis_password(url)[1] is not None:
        return None
    if url.startswith("unix://") and "@" not in url.split("?", 1)[0]:
        return None
    if os.environ.get(PASSWORD_ENV):
        return os.environ[PASSWORD_ENV]
    path = os.environ.get(PASSWORD_FILE_ENV)
    if not path:
        return None
    try:
        mode = os.stat(path).st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(f"${PASSWORD_FILE_ENV}={path} has mode {stat.S_IMODE(mode):04o}: others may read the "
                              f"Redis password; chmod 600 {path}")
        with open(path) as fh:
            return fh.read().strip()
    except OSError as exc:
        raise ConfigError(f"${PASSWORD_FILE_ENV}={path} cannot be read ({exc.strerror}); point it at the file "
                          "holding the Redis password, or set $OVERLORD_REDIS_PASSWORD") from None


def password_env(url: str | None) -> dict[str, str]:
    """The environment a child process needs to reach `url` once its password is cut
    from what the child reads (a stored config): {$OVERLORD_REDIS_PASSWORD: pw}, or {}."""
    if url is None:
        return {}
    password = split_redis_password(url)[1]
    if password is None:
        password = env_password(url)
    return {PASSWORD_ENV: password} if password else {}


def redact(url: str) -> str:
    """The URL with any password replaced, for messages and logs."""
    url = split_redis_password(url)[0]  # a `password=` query parameter goes too
    if "@" not in url:
        return url
    scheme, rest = url.split("://", 1)
    return f"{scheme}://***@{rest.rsplit('@', 1)[1]}"  # the last @: a password may hold one
