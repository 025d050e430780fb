"""The role processes a sidecar runs on its node: forking them, restarting those that
were killed, and naming those that failed.

A child that was killed (a signal, not an error of its own) is restarted, up to
`Job.max_restarts` times per role, and recovers from Redis:

- the Planner: its lease is dropped at once, and the new one leads from the newest
  checkpoint;
- a Source Loader process with a shadow: its heartbeat is dropped, so the Planner
  promotes the shadow; a new shadow is started behind it (not at once: its reading
  would take CPU from the promoted loader just when it catches up). On several nodes
  the shadow runs on another node: the promotion moves the loader's unit there, and
  the Planner's placement says where its new shadow runs (`adopt` renames a shadow of
  this node promoted for a loader that died elsewhere);
- one without a shadow (or a shadow): started again, rebuilding its read buffers
  from the planner checkpoint of the earliest unfinished step;
- the Data Constructor host: started again at the step after the last one written.

A child that failed has pushed its error record to Redis; its message is the job's
error. A loader process that dies inside a transform (its in-flight table,
overlord/loader/inflight.py, names the sample) is reported with that sample's source,
file and row; one killed twice in a row on the same sample is not restarted again.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from pathlib import Path
from typing import Any

import redis

from overlord.config import Job
from overlord.loader.inflight import inflight_path, last_samples
from overlord.runtime.lease import release_dead
from overlord.sidecar.role import superseded_note
from overlord.sidecar.spawn import RoleProcess, fork_role
from overlord.store import Keys
from overlord.store.schema import decode_active, encode_active

log = logging.getLogger("overlord.sidecar")

SHADOW_RESPAWN_S = 1.0  # after a promotion, when the replacement shadow starts


class Roles:
    """The role processes of one job on this node, by name (`role<index>`).

    It reads only what neither autoscaling nor joining a job changes of `job` (its
    node, `max_restarts`, `timeout_s`). `use()` gives it the Redis client it writes
    through and the URL the roles connect to, once the sidecar's store is up.
    """

    def __init__(self, job: Job, keys: Keys, run_dir: Path) -> None:
        self.job, self.keys, self.run_dir = job, keys, run_dir
        self.r: Any = None  # the sidecar's Redis client (redis.Redis), from use()
        self.url = ""
        # the job's `run` token this node started or joined with: its roles serve that run
        # (a Planner leads only while it is the job's), and a placement of another is not
        # followed (Membership.follow)
        self.run: bytes | None = None
        self.children: dict[str, RoleProcess] = {}
        self.attempts: dict[str, int] = {}  # role<index> -> restarts so far
        self.awaiting: dict[int, float] = {}  # loader process -> when its shadow's promotion was awaited
        self.superseded: dict[int, str] = {}  # loader process -> the dead one's `active`, while awaited
        self.shadow_due: dict[int, float] = {}  # loader process -> when to start its new shadow
        self.deaths: dict[int, tuple[tuple, str] | None] = {}  # pid of a dead loader process -> its sample
        self.poisoned: dict[int, tuple] = {}  # loader process -> the sample its last death in a transform was on

    def use(self, r: Any, url: str) -> None:
        """Write through `r`; roles connect to `url`."""
        self.r, self.url = r, url

    # -- starting ------------------------------------------------------------------------

    def spawn(self, role: str, index: int, attempt: int = 0) -> RoleProcess:
        """Fork `role<index>` (`attempt`: its restarts so far; a restarted role recovers
        from Redis)."""
        # a note an earlier process of it left unread (it stopped superseded while told to
        # leave, or in a rewind) must not vouch for this one's exit 3
        superseded_note(self.run_dir, f"{role}{index}").unlink(missing_ok=True)
        proc = fork_role(role, index, self.run_dir, self.url, attempt, run=self.run)
        proc.role, proc.index = role, index
        self.children[f"{role}{index}"] = proc
        if role == "loader":
            self.r.hset(self.keys.active, index, encode_active(proc.pid, self.job.node))
        return proc

    def adopt(self, active: dict[bytes, bytes]) -> None:
        """A shadow of this node that `active` names is its loader now (promoted for a
        loader that died, or was cut off, on another node): watch it as `loader<k>`."""
        for name, proc in list(self.children.items()):
            named = active.get(str(proc.index).encode())
            if proc.role == "shadow" and named is not None and named.decode() == encode_active(proc.pid, self.job.node):
                proc.role = "loader"
                self.children[f"loader{proc.index}"] = self.children.pop(name)
                log.warning("%s (pid %d) was promoted: it is loader process %d now", name, proc.pid, proc.index)

    def codes(self) -> dict[str, int | None]:
        """Each child's exit status (None: running)."""
        return {name: proc.poll() for name, proc in self.children.items()}

    def forget(self, name: str) -> None:
        """Stop watching `name` (it stopped because it was placed elsewhere)."""
        self.children.pop(name)

    # -- restarting ----------------------------------------------------------------------

    def restartable(self, name: str, code: int) -> bool:
        """A role killed by a signal is restarted (within its budget); one that failed
        with an error of its own would fail again: that ends the job."""
        return code < 0 and self.attempts.get(name, 0) < self.job.max_restarts

    def dying_again(self, killed: list[str], codes: dict) -> str | None:
        """The error for a loader process killed inside a transform on the same sample
        as its last death (a restart would die there again); remembers the others'."""
        for name in killed:
            died = self._died_in_transform(name, codes[name])
            index = self.children[name].index
            if died is None:
                self.poisoned.pop(index, None)  # died elsewhere: "in a row" starts again
                continue
            if self.poisoned.get(index) == died[0]:
                return self._death_message(name, died[1], again=True)
            self.poisoned[index] = died[0]
            log.warning("%s; restarting it once more", died[1])
        return None

    def restart(self, name: str) -> None:
        """Start the killed `name` again, or have the Planner promote its shadow."""
        r = self.r
        proc = self.children.pop(name)
        role, index = proc.role, proc.index
        attempt = self.attempts[name] = self.attempts.get(name, 0) + 1
        r.hincrby(self.keys.restarts, name, 1)
        beat = r.get(self.keys.heartbeat(role, str(index)))
        if beat is not None and json.loads(beat).get("pid") == proc.pid:
            r.delete(self.keys.heartbeat(role, str(index)))  # its heartbeat lapses now, not at its TTL
        if role == "planner":
            release_dead(r, self.keys, proc.pid, self.job.node)
        shadow = self.children.get(f"shadow{index}")
        if role == "loader" and shadow is not None and shadow.poll() is None:
            log.warning("%s (pid %d) was killed; the Planner promotes its shadow (pid %d)", name, proc.pid, shadow.pid)
            self.awaiting[index] = time.monotonic()
            return
        elsewhere = self._shadow_elsewhere(index) if role == "loader" and self.job.multi_node else None
        if elsewhere is not None:
            log.warning("%s (pid %d) was killed; the Planner promotes its shadow on node %r", name, proc.pid, elsewhere)
            self.awaiting[index] = time.monotonic()
            self.superseded[index] = encode_active(proc.pid, self.job.node)
            return
        log.warning(
            "%s (pid %d) was killed; restarting it (restart %d of %d)", name, proc.pid, attempt, self.job.max_restarts
        )
        self.spawn(role, index, attempt)

    def follow_promotions(self) -> None:
        """Shadows awaiting promotion, and new shadows due, after loaders were killed."""
        if self.awaiting:
            self._promoted()
        if self.shadow_due:
            self._start_due_shadows()

    def _shadow_elsewhere(self, index: int) -> str | None:
        """The node of a Shadow Loader of loader process `index` that beats on another node."""
        raw = self.r.get(self.keys.heartbeat("shadow", str(index)))
        node = json.loads(raw).get("node") if raw is not None else None
        return node if node not in (None, self.job.node) else None

    def _promoted(self) -> None:
        """A shadow the Planner promoted is the active loader now: start a new shadow
        (on several nodes: the promotion moved the unit; the placement says the rest)."""
        for k, since in list(self.awaiting.items()):
            shadow = self.children.get(f"shadow{k}")
            active = self.r.hget(self.keys.active, k)
            if shadow is None:  # its shadow ran on another node
                if active is not None and active.decode() != self.superseded[k]:
                    del self.awaiting[k], self.superseded[k]
                    log.info("loader process %d: promoted on node %r", k, (decode_active(active) or (0, "?"))[1])
                elif time.monotonic() - since > self.job.timeout_s:
                    del self.awaiting[k], self.superseded[k]
                    log.warning("loader process %d: no promotion within %.0fs; restarting it", k, self.job.timeout_s)
                    self.spawn("loader", k, self.attempts.get(f"loader{k}", 1))
                continue
            if active is not None and active.decode() == encode_active(shadow.pid, self.job.node):
                del self.awaiting[k]
                shadow.role = "loader"
                self.children[f"loader{k}"] = self.children.pop(f"shadow{k}")
                # not at once: the new shadow's reading would take CPU from the promoted
                # loader just when it catches up
                self.shadow_due[k] = time.monotonic() + SHADOW_RESPAWN_S
                log.info(
                    "loader process %d: shadow pid %d promoted; a new shadow starts in %.0fs",
                    k,
                    shadow.pid,
                    SHADOW_RESPAWN_S,
                )
            elif time.monotonic() - since > self.job.timeout_s:
                del self.awaiting[k]
                log.warning(
                    "loader process %d: no promotion within %.0fs (is the Planner up?); restarting it",
                    k,
                    self.job.timeout_s,
                )
                self.spawn("loader", k, self.attempts.get(f"loader{k}", 1))

    def _start_due_shadows(self) -> None:
        for k, due in list(self.shadow_due.items()):
            if time.monotonic() >= due:
                del self.shadow_due[k]
                self.spawn("shadow", k, self.attempts.get(f"loader{k}", 1))

    # -- failing -------------------------------------------------------------------------

    def log_of(self, name: str) -> Path:
        """The log of child `name`: named after the role it was started as (a shadow
        promoted here, watched as `loader<k>`, writes on to `shadow<k>.log`)."""
        return self.run_dir / f"{self.children[name].name}.log"

    def failure_message(self, name: str, code: int) -> str:
        """The job's error for `name`, which exited with `code` and is not restarted."""
        try:
            raw = self.r.lindex(self.keys.errors, 0)
        except Exception:  # noqa: BLE001 - Redis itself may be the casualty
            raw = None
        died = self._died_in_transform(name, code)
        if code < 0 and self.attempts.get(name, 0) >= self.job.max_restarts:
            proc = self.children[name]
            return (
                f"{name} (pid {proc.pid}) on node {self.job.node!r} was killed by signal {-code} after "
                f"{self.attempts[name]} restarts (Job.max_restarts); see {self.log_of(name)}"
                + (f"; it died {died[1].split(' died ', 1)[1]}" if died else "")
            )
        if raw:
            return json.loads(raw)["message"]
        if died:
            return self._death_message(name, died[1], again=False)
        proc = self.children[name]
        how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
        return (
            f"{name} (pid {proc.pid}) on node {self.job.node!r} {how} without reporting an error; "
            f"see {self.log_of(name)}"
        )

    def _died_in_transform(self, name: str, code: int) -> tuple[tuple, str] | None:
        """For a loader process (active or shadow) that died: (the sample, a sentence
        naming it) when its in-flight table (overlord/loader/inflight.py) shows it was
        inside a transform; None otherwise. Read once per death (the table goes)."""
        proc = self.children[name]
        if proc.pid in self.deaths:
            return self.deaths[proc.pid]
        found = None
        if proc.role in ("loader", "shadow"):
            path = inflight_path(self.run_dir, proc.pid)
            samples = last_samples(path)
            path.unlink(missing_ok=True)
            if samples:
                what, key, _ = samples[0]
                how = f"by signal {-code} ({_signal_name(-code)})" if code < 0 else f"with status {code}"
                found = (key, f"{name} (pid {proc.pid}) on node {self.job.node!r} died {how} while transforming {what}")
        self.deaths[proc.pid] = found
        return found

    def _death_message(self, name: str, sentence: str, again: bool) -> str:
        """The job's error for a loader process that died in a transform; also pushed as
        the job's error record (what `overlord status` and trainers on other nodes read)."""
        times = "twice in a row (not restarted again)" if again else "without reporting an error"
        message = (
            f"{sentence}, {times}; see {self.log_of(name)}. Fix the transform for that row (something "
            "in it ends the process: os._exit, a signal, a crash in native code; or the OOM killer took it: see "
            "dmesg). on_error: skip does not skip it: a skip is decided by the file's bytes alone, so that every "
            "active, shadow and restarted loader makes it alike, and a death is not"
        )
        proc = self.children[name]
        record = {
            "role": proc.role,
            "index": proc.index,
            "node": self.job.node,
            "pid": proc.pid,
            "type": "LoaderDied",
            "message": message,
            "time": time.time(),
        }
        try:
            self.r.rpush(self.keys.errors, json.dumps(record))
        except redis.RedisError:
            pass  # the trainers of this node hear it from their rings all the same
        return message

    # -- stopping ------------------------------------------------------------------------

    def stop(self) -> None:
        """Terminate every child and reap it (killed after 5 s)."""
        for proc in self.children.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 5.0
        for proc in self.children.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except TimeoutError:
                proc.kill()
                proc.wait(timeout=5)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
