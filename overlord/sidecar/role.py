"""Entry point and shared plumbing of every role process a sidecar starts.

    python -m overlord.sidecar.role {planner|loader|shadow|constructor} --run-dir DIR --index N [--attempt K]

The job comes from DIR/job.json (JSON, never a pickle) and the Redis URL from the
OVERLORD_REDIS_URL environment variable (so a password never shows in `ps`). A role
that fails pushes one JSON error record (role, index, node, pid, message) to
`overlord:{job}:errors` before exiting 1; the sidecar forwards it to the trainers. One
that another process superseded exits `SUPERSEDED` (3). Each role keeps a heartbeat
key with a TTL; a Source Loader's is fenced by the `active` hash (written only while
`active` names this process, or nobody), so a loader superseded while out of Redis's
reach cannot pass for its successor when it comes back. `--attempt` counts the
sidecar's restarts of this role: a restarted role recovers its position from Redis
instead of starting the job.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from overlord import heap
from overlord.config import Job
from overlord.logs import log_context, setup_logging
from overlord.procmem import rss_bytes
from overlord.runtime.flow import HEARTBEAT_S, Beat, set_on_signal
from overlord.runtime.layout import Layout
from overlord.store import Keys, connect
from overlord.store.schema import encode_active

log = logging.getLogger("overlord")

HEARTBEAT_TTL_S = 5
# the exit status of a role that stopped because another process runs its unit now (a
# Data Constructor host or Source Loader superseded while its node was out of Redis's
# reach): not a failure; the sidecar forgets it, and starts the unit again if it is
# placed here. A transform may exit with any status too, so the role also leaves a
# note (`superseded_note`) naming its pid, and the sidecar believes the two together.
SUPERSEDED = 3


def superseded_note(run_dir: Path, name: str) -> Path:
    """Where role `name` (role<index>) notes that it stopped superseded."""
    return run_dir / f"{name}.superseded"


def was_superseded(run_dir: Path, name: str, pid: int, code: int | None) -> bool:
    """Whether role `name`, pid `pid`, which exited `code`, stopped superseded (its note
    is consumed)."""
    if code != SUPERSEDED:
        return False
    note = superseded_note(run_dir, name)
    try:
        noted = note.read_text().strip()
    except OSError:
        return False
    note.unlink(missing_ok=True)
    return noted == str(pid)


# KEYS: the heartbeat, `active`; ARGV: the beat, its TTL (s), the loader index, this process in `active`
_FENCED_BEAT = """
local named = redis.call('HGET', KEYS[2], ARGV[3])
if named and named ~= ARGV[4] then
  return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
return 1
"""
ROLES = ("planner", "loader", "shadow", "constructor")
ROLE_TITLES = {
    "planner": "Planner",
    "loader": "SourceLoader process",
    "shadow": "ShadowLoader process",
    "constructor": "DataConstructor host",
}


@dataclass
class RoleContext:
    """What every role needs: the job, the layout, Redis, and a stop flag."""

    role: str
    index: int
    job: Job
    redis_url: str
    run_dir: Path
    attempt: int = 0
    r: redis.Redis = field(init=False)
    keys: Keys = field(init=False)
    layout: Layout = field(init=False)
    stop: threading.Event = field(default_factory=threading.Event)
    beat: Beat = field(default_factory=Beat)
    silent: bool = False  # a standby Planner beats only once it leads
    superseded: bool = False  # another process runs this unit now: exit with SUPERSEDED

    def __post_init__(self) -> None:
        self.r = connect(
            self.redis_url, ride_through_s=self.job.redis_outage_s, name=f"{self.role}{self.index}", known=True
        )
        self.keys = Keys(self.job.name)
        raw = self.r.get(self.keys.layout)
        self.layout = Layout.from_json(raw) if raw else Layout.plan(self.job)
        self._fenced_beat = self.r.register_script(_FENCED_BEAT)

    @property
    def origin(self) -> str:
        return f"{ROLE_TITLES[self.role]} {self.index} on node {self.job.node!r} (pid {os.getpid()})"

    def publish_heartbeat(self) -> None:
        """Write this role's heartbeat now (the role may change: a shadow is promoted);
        a Source Loader's only while `active` names it (or nobody)."""
        key = self.keys.heartbeat(self.role, str(self.index))
        value = json.dumps(
            {
                "pid": os.getpid(),
                "node": self.job.node,
                "time": time.time(),
                "loop_age": round(self.beat.age(), 3),
                "attempt": self.attempt,
                "rss_mb": round(rss_bytes(os.getpid()) / 2**20, 1),
            }
        )
        if self.role == "loader":
            me = encode_active(os.getpid(), self.job.node)
            self._fenced_beat(keys=[key, self.keys.active], args=[value, HEARTBEAT_TTL_S, self.index, me])
        else:
            self.r.set(key, value, ex=HEARTBEAT_TTL_S)

    def heartbeat_forever(self) -> None:
        """Beats every HEARTBEAT_S, and hands free heap pages back every heap.TRIM_EVERY_S."""
        trimmed = time.monotonic()
        while not self.stop.is_set():
            try:
                if not self.silent:
                    self.publish_heartbeat()
            except redis.RedisError:
                pass  # the control path may blip; data keeps flowing
            if time.monotonic() - trimmed >= heap.TRIM_EVERY_S:
                heap.trim()
                trimmed = time.monotonic()
            self.stop.wait(HEARTBEAT_S)

    def drop_heartbeat(self) -> None:
        """On the way out: this role's heartbeat goes now, not at its TTL, so the role
        can start again at once elsewhere (a unit moving to another node waits for it)."""
        key = self.keys.heartbeat(self.role, str(self.index))
        try:
            raw = self.r.get(key)
            beat = json.loads(raw) if raw is not None else {}
            if beat.get("pid") == os.getpid() and beat.get("node") == self.job.node:  # pids repeat across nodes
                self.r.delete(key)
        except redis.RedisError:
            pass

    def report_error(self, exc: BaseException) -> None:
        record: dict[str, Any] = {
            "role": self.role,
            "index": self.index,
            "node": self.job.node,
            "pid": os.getpid(),
            "type": type(exc).__name__,
            "message": f"{self.origin} failed: {type(exc).__name__}: {exc}",
            "time": time.time(),
        }
        try:
            self.r.rpush(self.keys.errors, json.dumps(record))
        except redis.RedisError:
            pass
        sys.stderr.write(record["message"] + "\n" + traceback.format_exc())
        sys.stderr.flush()


def _run(ctx: RoleContext) -> None:
    # deferred: a role process loads only its own role's code; the sidecar preloads
    # all three before it forks
    if ctx.role == "planner":
        from overlord.planner.process import run_planner as main
    elif ctx.role in ("loader", "shadow"):
        from overlord.loader.process import run_loader as main
    else:
        from overlord.constructor.process import run_constructors as main
    main(ctx)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="overlord-role")
    parser.add_argument("role", choices=ROLES)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--attempt", type=int, default=0)
    args = parser.parse_args(argv)
    setup_logging(f"{args.role}{args.index}")
    run_dir = Path(args.run_dir)
    job = Job.from_dict(json.loads((run_dir / "job.json").read_text()))
    log_context(job.name, job.node)
    ctx = RoleContext(args.role, args.index, job, os.environ["OVERLORD_REDIS_URL"], run_dir, args.attempt)
    signal.signal(signal.SIGTERM, set_on_signal(ctx.stop))
    # every thread's stack to the role's log (its stderr), from the signal handler in C:
    # it works while a thread holds the GIL (the sidecar sends it before killing a role
    # that would not stop; `kill -USR1 <pid>` by hand shows where a role waits)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    threading.Thread(target=ctx.heartbeat_forever, daemon=True, name="heartbeat").start()
    try:
        _run(ctx)
    except Exception as exc:  # noqa: BLE001 - every failure is reported with its origin
        ctx.report_error(exc)
        return 1
    finally:
        ctx.stop.set()
    ctx.drop_heartbeat()
    if ctx.superseded:
        superseded_note(run_dir, f"{args.role}{args.index}").write_text(str(os.getpid()))
        return SUPERSEDED
    return 0


if __name__ == "__main__":
    sys.exit(main())
