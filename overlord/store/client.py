"""Connecting to the control-path Redis, embedded or external.

Every client rides through a Redis outage: a command that finds the server gone
(connection refused or reset) or frozen (a socket timeout) is retried with exponential
backoff for up to its budget (`Job.redis_outage_s` for the roles, `RIDE_THROUGH_S` by
default), with one log line saying what it waits for, before the error reaches the role,
which then fails with it. The client remembers its last outage (`unreachable_since`,
`last_outage_end`) so failure detection does not take a heartbeat that could not be
written for a dead role. Writes are idempotent (SET, HSET, XADD whose duplicates the
reader drops), fenced (a Planner's WATCHed MULTI is never retried by redis-py: it ends
in the lease's WriteUncertain check) or counters where a double count is harmless (a
fencing token, a restart count), so a retried command that had in fact been applied
does no harm.

Behind Redis Sentinel, `redis+sentinel://[user[:password]@]host:port[,host:port...]/<service>[/db]`
names the Sentinels and the primary's service name: the client asks them for the
primary on every new connection, so a failover is an outage the retry above rides
through (a client still talking to a demoted primary hears READONLY and reconnects).
The password is the data servers'; Sentinels are asked without one.

A TLS server (rediss://) is verified against the system's CAs, or against the CA file
named by `OVERLORD_REDIS_CA` (set it for the sidecar and the trainer; forked roles inherit it).

A URL that names no password (stored configs never hold one: `Job.to_dict`) takes it
from `$OVERLORD_REDIS_PASSWORD`, else from the file `$OVERLORD_REDIS_PASSWORD_FILE`
names, which must be readable by its owner only. The embedded server's socket
(`unix://` without a user part) never gets one.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import unquote

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelManagedConnection

from overlord.config import split_redis_password
from overlord.errors import ConfigError, StoreError

CA_ENV = "OVERLORD_REDIS_CA"
PASSWORD_ENV = "OVERLORD_REDIS_PASSWORD"
PASSWORD_FILE_ENV = "OVERLORD_REDIS_PASSWORD_FILE"
SENTINEL_SCHEME = "redis+sentinel://"
SOCKET_TIMEOUT_S = 10.0
RIDE_THROUGH_S = 30.0
_BACKOFF_CAP_S = 0.5
RETRIED = (redis.ConnectionError, redis.TimeoutError)

log = logging.getLogger(__name__)
T = TypeVar("T")


class OutageRetry(Retry):  # type: ignore[misc]  # redis-py is read untyped (pyproject.toml says why)
    """redis-py's Retry bounded by time, not by count: a command is retried while the
    server has been gone for less than `budget_s` (a frozen server costs a socket timeout
    per try, so a count says nothing about how long it waited)."""

    def __init__(
        self,
        url: str,
        budget_s: float,
        setting: str = "Job.redis_outage_s",
        revive: Callable[[], bool] | None = None,
    ) -> None:
        super().__init__(ExponentialBackoff(cap=_BACKOFF_CAP_S, base=0.005), -1, supported_errors=RETRIED)
        self.url, self.budget_s, self.setting = redact(url), budget_s, setting
        # the server's owner (the sidecar, of its embedded server): starts it again if it
        # died, True if it did; the budget then runs from its restart
        self.revive = revive
        self.unreachable_since: float | None = None  # monotonic, while the server is gone
        self.last_outage_end: float | None = None  # monotonic, when it last came back

    def __deepcopy__(self, memo: dict[int, Any]) -> OutageRetry:
        """This object, not a copy: redis-py gives each connection it opens after
        `set_retry` a deep copy of the client's retry, and the outage a command on that
        connection rode through then went into the copy. `outage_within` reads the
        client's: a thread whose command ran on a second connection (another thread held
        the first) saw a role's heartbeat, stale from the outage, as a dead role."""
        return self

    def call_with_retry(
        self,
        do: Callable[[], T],
        fail: Callable[..., Any],
        is_retryable: Callable[[Exception], bool] | None = None,
        with_failure_count: bool = False,
    ) -> T:
        retried = False  # a reconnect nested in a command that still times out is no recovery

        def failed(error: Exception, *count: int) -> None:
            nonlocal retried
            retried = True
            now = time.monotonic()
            if self.unreachable_since is None:
                self.unreachable_since = now
                log.warning(
                    "Redis at %s unreachable (%s: %s); waiting for it up to %gs (%s)",
                    self.url,
                    type(error).__name__,
                    error,
                    self.budget_s,
                    self.setting,
                )
            if self.revive is not None and self.revive():
                self.unreachable_since = now = time.monotonic()
            if now - self.unreachable_since >= self.budget_s:
                if getattr(error, "outage_named", False):  # from a reconnect nested in this command
                    raise error
                named = type(error)(
                    f"Redis at {self.url} unreachable for {now - self.unreachable_since:.0f}s, past "
                    f"{self.setting}={self.budget_s:g} ({error}); bring it back or fail it "
                    f"over, or raise {self.setting}"
                )
                setattr(named, "outage_named", True)  # noqa: B010 - an attribute redis-py's errors lack
                raise named from error
            fail(error, *count)

        result: T = super().call_with_retry(do, failed, is_retryable, with_failure_count)
        if retried and self.unreachable_since is not None:
            gone = time.monotonic() - self.unreachable_since
            self.unreachable_since, self.last_outage_end = None, time.monotonic()
            log.warning("Redis at %s answers again after %.1fs", self.url, gone)
        return result


def outage_within(r: redis.Redis, seconds: float) -> bool:
    """Whether `r` found Redis gone within the last `seconds` (or is waiting for it now):
    a heartbeat missing or stale then says nothing about its role."""
    retry = r.get_retry()
    if not isinstance(retry, OutageRetry):
        return False
    if retry.unreachable_since is not None:
        return True
    return retry.last_outage_end is not None and time.monotonic() - retry.last_outage_end < seconds


def connect(
    url: str,
    *,
    timeout_s: float = SOCKET_TIMEOUT_S,
    ride_through_s: float = RIDE_THROUGH_S,
    setting: str = "Job.redis_outage_s",
    name: str | None = None,
    known: bool = False,
    revive: Callable[[], bool] | None = None,
) -> redis.Redis:
    """Open a Redis client for `url` (redis://, rediss://, unix://, redis+sentinel://; ACL
    user and password in the URL: `rediss://user:password@host:port/0`).

    Values stay bytes (plans and metadata are binary or JSON decoded by their owners).
    A rediss:// server's certificate must verify (and name the host): against the CA file
    in `$OVERLORD_REDIS_CA` if set, else the system's CAs. redis-py's own URL query
    parameters also work and win over the environment, e.g.
    `rediss://user:pw@host:6380/0?ssl_ca_certs=/etc/overlord/ca.pem&ssl_cert_reqs=required`.

    Args:
        url: the server.
        timeout_s: socket timeout of one command.
        ride_through_s: how long a command keeps retrying while the server is gone.
        setting: what sets `ride_through_s`, named in the log line and the error.
        name: the connections' CLIENT SETNAME (a role's name: `CLIENT LIST` then tells
            whose commands are whose, as bench/control.py counts them).
        known: the server is known to serve the job (a role's: its sidecar reached it),
            so the first PING rides through an outage like any command; otherwise it
            fails at once, as a wrong URL should. A role started again while the
            embedded server restarts (both killed at once) waited for nothing and failed.
        revive: called on each failed try (`OutageRetry.revive`): the sidecar starts its
            embedded server again there if it died, whatever command found it gone.

    Raises:
        StoreError: the server does not answer a PING (unreachable, TLS or login refused).
    """
    tls = {}
    if url.startswith("rediss://") and os.environ.get(CA_ENV):
        tls = {"ssl_ca_certs": os.environ[CA_ENV], "ssl_cert_reqs": "required"}
    password = env_password(url)
    if password is not None:
        tls["password"] = password  # the URL's own options win over keyword arguments: it names none here
    options: dict[str, Any] = {
        **tls,
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "health_check_interval": 30,
        "retry": Retry(ExponentialBackoff(), 1, supported_errors=(redis.ConnectionError,)),
    }
    if name is not None:
        options["client_name"] = name
    if url.startswith(SENTINEL_SCHEME):
        client = sentinel_client(url, options, timeout_s)
    else:
        client = redis.Redis.from_url(url, **options)
    retry = OutageRetry(url, ride_through_s, setting, revive) if ride_through_s > 0 else None
    if retry is not None and known:
        client.set_retry(retry)
    try:
        client.ping()  # a server that is not there at all is a configuration error: say so now
    except redis.RedisError as exc:
        raise StoreError(f"Redis at {redact(url)} is unreachable: {exc}; check Job.redis_url") from None
    client.set_retry(retry if retry is not None else Retry(ExponentialBackoff(), 0, supported_errors=RETRIED))
    return client


class FollowingConnection(SentinelManagedConnection):  # type: ignore[misc]  # redis-py is read untyped
    """A connection to the primary the Sentinels name now, on every (re)connect.

    redis-py 8 reconnects a dropped connection through `connect_check_health`, which
    dials the host it had and retries that one host: a client whose primary died kept
    dialling it, past the failover, until its outage budget ran out. Here each dial asks
    the Sentinels first and tries once; the command's own retry (OutageRetry) asks again.
    """

    def connect_check_health(self, check_health: bool = True, retry_socket_connect: bool = True) -> None:
        if self._sock:
            return
        if self.connection_pool.is_master:  # MasterNotFoundError is a ConnectionError: retried
            self.host, self.port = self.connection_pool.get_master_address()
        super().connect_check_health(check_health=check_health, retry_socket_connect=False)


def sentinel_client(url: str, options: dict[str, Any], timeout_s: float) -> redis.Redis:
    """A client of the primary that the Sentinels in `url` name (see the module docstring).

    Raises:
        ConfigError: the URL names no Sentinel or no service.
    """
    rest = url[len(SENTINEL_SCHEME) :].split("?", 1)[0]
    userinfo, _, hosts = rest.rpartition("@")
    where, _, path = hosts.partition("/")
    service, _, db = path.partition("/")
    sentinels: list[tuple[str, int]] = []
    for entry in filter(None, where.split(",")):
        host, _, port = entry.rpartition(":")
        if not host or not port.isdigit():
            sentinels = []
            break
        sentinels.append((host.strip("[]"), int(port)))
    if not sentinels or not service:
        raise ConfigError(
            f"Job.redis_url={redact(url)!r} names no Sentinel or no service: write "
            "redis+sentinel://host:26379,host2:26379,host3:26379/<service>[/db]"
        )
    user, colon, secret = userinfo.partition(":")
    if user:
        options["username"] = unquote(user)
    if colon:
        options["password"] = unquote(secret)
    ask = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
    return Sentinel(sentinels, sentinel_kwargs=ask).master_for(
        service, db=int(db or 0), connection_class=FollowingConnection, **options
    )


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
            raise ConfigError(
                f"${PASSWORD_FILE_ENV}={path} has mode {stat.S_IMODE(mode):04o}: others may read the "
                f"Redis password; chmod 600 {path}"
            )
        with open(path) as fh:
            return fh.read().strip()
    except OSError as exc:
        raise ConfigError(
            f"${PASSWORD_FILE_ENV}={path} cannot be read ({exc.strerror}); point it at the file "
            "holding the Redis password, or set $OVERLORD_REDIS_PASSWORD"
        ) from None


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
