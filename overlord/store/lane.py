"""A hot loop's commands on one connection of its client, without redis-py's per-command layers.

redis-py 8 spends about 60 us of CPU on a command above the socket (its retry and
connection-pool wrappers, event dispatch, response callbacks), and about 180 us more on
a blocking XREAD; the Planner sends a few commands a step and blocks on `progressed`
once or twice a step, so at the demo's step rate that was about a fifth of its CPU.
Measured on this machine (a blocking XREAD woken every 4 ms, CPU per wake): redis-py's
`xread` 349 us, the same command on its connection 170 us, a bare socket 158 us.

A `Lane` holds one connection of the client's pool (so the client's TLS, ACL login,
Sentinel-named primary and timeouts apply as they are) and talks on it directly:
commands packed by the connection, replies read as the server sends them (no
callbacks). A command that finds the connection broken drops it and goes again
through the client's retry (`OutageRetry`: the same ride-through budget, log lines and
named error as any command), on a fresh connection. The commands sent here are the
ones the callers may send twice (reads, and writes made idempotent or fenced, as every
retried command in overlord.store.client).

One thread only: a Lane is not shared.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis
from redis.commands.core import CoreCommands

from overlord.store.client import RETRIED

Entry = tuple[bytes, dict[bytes, bytes]]  # a stream entry: its id and its fields


class Batch(CoreCommands):  # type: ignore[misc]  # redis-py is read untyped (pyproject.toml says why)
    """Commands recorded for one round trip of a `Lane` (nothing is sent): call `evalsha`,
    `hset`, `execute_command`... as on a pipeline."""

    def __init__(self) -> None:
        self.commands: list[tuple[Any, ...]] = []

    def execute_command(self, *args: Any, **options: Any) -> None:
        self.commands.append(args)


class Lane:
    """Commands of one loop on a connection of `r`'s pool (see the module docstring)."""

    def __init__(self, r: redis.Redis) -> None:
        self.r = r
        self.conn: Any = None  # the held connection; None until the first command, or after one broke

    def execute(self, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Send `commands` in one round trip; their replies, in order, as the server sent
        them (RESP2 or RESP3 as the client speaks).

        Raises:
            redis.ResponseError: the first command the server refused (every reply is
                read first, so the connection stays in step).
            redis.ConnectionError, redis.TimeoutError: the server stayed gone past the
                client's outage budget.
        """
        if self.conn is not None:
            try:
                return self._round_trip(self.conn, commands)
            except RETRIED:
                pass  # dropped: again through the client's retry, on a fresh connection
        replies: list[Any] = self.r.get_retry().call_with_retry(
            lambda: self._round_trip(self._connect(), commands), self._failed
        )
        return replies

    def command(self, *args: Any) -> Any:
        """One command's reply (see `execute`)."""
        return self.execute([args])[0]

    def xread(
        self, last: dict[Any, Any], *, block_ms: int | None = None, count: int | None = None
    ) -> list[tuple[bytes, list[Entry]]]:
        """XREAD of the streams in `last` (stream key -> the last id read) as redis-py's
        `xread` returns it: [(stream key, [(entry id, {field: value})...])...], [] when
        none has a new entry within `block_ms`."""
        args: list[Any] = ["XREAD"]
        if count is not None:
            args += ["COUNT", count]
        if block_ms is not None:
            args += ["BLOCK", block_ms]
        args += ["STREAMS", *last, *last.values()]
        reply = self.command(*args)
        if not reply:
            return []
        pairs = reply.items() if isinstance(reply, dict) else reply  # RESP3 answers a map
        return [(key, [(entry_id, _fields(fields)) for entry_id, fields in entries]) for key, entries in pairs]

    def close(self) -> None:
        """Give the connection back to the client's pool."""
        if self.conn is not None:
            conn, self.conn = self.conn, None
            self.r.connection_pool.release(conn)

    def _round_trip(self, conn: Any, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        replies: list[Any] = []
        refused = None
        try:
            conn.send_packed_command(conn.pack_commands(commands), check_health=False)
            for _ in commands:
                try:
                    replies.append(conn.read_response())
                except redis.ResponseError as exc:  # a refusal is a whole reply: read on
                    replies.append(exc)
                    refused = refused or exc
        except BaseException:  # cut off mid-reply (or interrupted): the connection is out of step
            self._drop()
            raise
        if refused is not None:
            raise refused
        return replies

    def _connect(self) -> Any:
        if self.conn is None:
            self.conn = self.r.connection_pool.get_connection()
        return self.conn

    def _failed(self, error: Exception, *count: int) -> None:
        self._drop()  # _round_trip dropped it already, unless dialling failed

    def _drop(self) -> None:
        """Close the held connection (its state is unknown) and give it back: the next
        command dials afresh."""
        if self.conn is not None:
            conn, self.conn = self.conn, None
            conn.disconnect()
            self.r.connection_pool.release(conn)


def _fields(flat: Any) -> dict[bytes, bytes]:
    """An entry's fields as a dict, from the flat [field, value, ...] list the server sends."""
    if isinstance(flat, dict):
        return flat
    it = iter(flat)
    return dict(zip(it, it))
