"""A published step's writes as one Lua script, made only while this Planner leads.

Publishing a step took six round trips in redis-py: WATCH the lease, GET it,
MULTI/EXEC of the step's writes, SCRIPT EXISTS (redis-py asks before every pipeline
that holds a script), the durability marker's EVALSHA, and an HGET to see that the step
landed. `StepWrite` records the step's commands (redis-py's own command methods, through
`execute_command`) and `queue` sends them as one EVALSHA of `_SCRIPT`, which, atomically:

1. writes nothing and answers -1 unless the lease still holds this Planner's value: a
   deposed Planner writes nothing (and, with no WATCH, this Planner's own renewal of the
   lease cannot cut the write short);
2. makes the step's writes (a turn's: every step of it, named by its last) unless the
   `planner` hash already names this step or a later one as published (a retry after a reply lost with the connection, or after a
   failover that kept the write, writes the step once; a failover that lost it finds
   an older step there and writes it again): answers 1 when it wrote them, 0 if not;
3. always makes the marker HSET on the `planner` hash, so a WAIT / WAITAOF queued
   after it on the same connection has a write of that connection to wait for
   (overlord.store.durable).

The script is loaded once (SCRIPT LOAD) and called by its SHA: no SCRIPT EXISTS per
step. A server that lost its script cache (restarted, or a replica promoted that never
loaded it) answers NOSCRIPT; `noscript` tells that error, and the caller loads the
script again and retries.

    KEYS: the lease, the `planner` hash, then every key the step writes (declared so a
          Redis Cluster routes the call; they share the job's hash tag)
    ARGV: the lease value, the `planner` field of the published step, the step, the
          marker's field count m, m field/value pairs, then per command its argument
          count and its arguments (the command's name first)
"""

from __future__ import annotations

from typing import Any

import redis

from overlord.store import Keys
from overlord.store.lane import Batch
from overlord.store.schema import PLANNER_STEP

_SCRIPT = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return -1
end
local first = 5 + 2 * tonumber(ARGV[4])
local published = tonumber(redis.call('HGET', KEYS[2], ARGV[2]))
local wrote = 0
if published == nil or published < tonumber(ARGV[3]) then
  local i = first
  while i <= #ARGV do
    local n = tonumber(ARGV[i])
    redis.call(unpack(ARGV, i + 1, i + n))
    i = i + n + 1
  end
  wrote = 1
end
if first > 5 then
  redis.call('HSET', KEYS[2], unpack(ARGV, 5, first - 1))
end
return wrote
"""

_MULTI_KEY = {"DEL", "UNLINK"}  # commands whose every argument is a key; the others name one first


class StepWrite(Batch):
    """The commands of one step's publication, recorded (nothing is sent): call
    `set`, `xadd`, `hset`, `hdel`, `delete`... as on a pipeline. It also keeps the keys
    they write, which the script declares."""

    def __init__(self) -> None:
        super().__init__()
        self.keys: dict[str, None] = {}  # insertion-ordered set

    def execute_command(self, *args: Any, **options: Any) -> None:
        name = str(args[0]).upper()
        for key in args[1:] if name in _MULTI_KEY else args[1:2]:
            self.keys[key.decode() if isinstance(key, bytes) else str(key)] = None
        super().execute_command(*args, **options)


class StepScript:
    """`_SCRIPT` on one server: loaded once, queued on pipelines by its SHA."""

    def __init__(self, r: redis.Redis) -> None:
        self.r = r
        self.sha = r.script_load(_SCRIPT)

    def load(self) -> None:
        """Load the script again (after a NOSCRIPT)."""
        self.sha = self.r.script_load(_SCRIPT)

    def queue(
        self, pipe: Any, keys: Keys, lease_value: bytes, step: int, write: StepWrite, marker: dict[str, Any]
    ) -> None:
        """Queue on `pipe` the fenced write of `step` (see the module docstring); its
        reply is -1 (not this Planner's lease: nothing written), 0 (the step was there:
        only the marker written) or 1 (written)."""
        own = (keys.leader, keys.planner)
        argv: list[Any] = [lease_value, PLANNER_STEP, step, len(marker)]
        for kv in marker.items():
            argv.extend(kv)
        for command in write.commands:
            argv.append(len(command))
            argv.extend(command)
        declared = [*own, *(k for k in write.keys if k not in own)]
        pipe.evalsha(self.sha, len(declared), *declared, *argv)


def noscript(exc: BaseException) -> bool:
    """Whether `exc` is the server's NOSCRIPT (its script cache lost the script)."""
    return isinstance(exc, redis.exceptions.NoScriptError) or (
        isinstance(exc, redis.ResponseError) and str(exc).startswith("NOSCRIPT")
    )
