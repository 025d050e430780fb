"""The sidecar: one per node; starts, watches and stops every role of the job there.

Start-up: take the job's lock in its run directory (one sidecar per job and node),
remove shared-memory segments left by dead owners, start the embedded redis-server
(or connect to Job.redis_url), publish the job, its layout and this node, create every
ring, then start the Planner, the Source Loader processes and the Data Constructor
host as child processes that die with the sidecar (PR_SET_PDEATHSIG).

While running it watches the children. A child that fails has pushed its error record
to Redis; the sidecar copies that message into every trainer's ring, so the trainer
raises it with its origin, then stops the job. A child that was killed (a signal, not
an error of its own) is restarted, up to `Job.max_restarts` times per role, and
recovers from Redis:

- the Planner: its lease is dropped at once, and the new one leads from the newest
  checkpoint;
- a Source Loader process with a shadow: its heartbeat is dropped, so the Planner
  promotes the shadow; a new shadow is started behind it;
- one without a shadow (or a shadow): started again, rebuilding its read buffers
  from the planner checkpoint of the earliest unfinished step;
- the Data Constructor host: started again at the step after the last one written.

A loader process that dies inside a transform (its in-flight table,
overlord/loader/inflight.py, names the sample) is reported with that sample's source,
file and row; one killed twice in a row on the same sample is not restarted again.

The embedded redis-server is restarted too (from its append-only file) if it dies;
the roles ride through the gap (see overlord.store.client). On the way out every ring
is unlinked and the embedded Redis is stopped.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from typing import TextIO

import redis

from overlord.autoscale.apply import autoscale
from overlord.config import Job
from overlord.errors import OverlordError
from overlord.loader.inflight import inflight_path, last_samples
from overlord.logs import log_context
from overlord.metrics import metrics_host, start_metrics_process
from overlord.plan.checkpoint import Checkpoints
from overlord.runtime.flow import HEARTBEAT_S, set_on_signal
from overlord.runtime.layout import Layout, client_ring, sample_ring
from overlord.runtime.lease import release_dead
from overlord.shm import Ring, cleanup_stale, unlink_all
from overlord.shm import pid_alive as _alive
from overlord.sidecar import mode
from overlord.sidecar.checks import check_redis, check_shm, check_sources, check_transforms
from overlord.sidecar.membership import NodeMember
from overlord.sidecar.mode import lock_path
from overlord.sidecar.mode import sidecar_running as sidecar_running  # where tests and tools look for it
from overlord.sidecar.role import HEARTBEAT_TTL_S
from overlord.sidecar.spawn import RoleProcess, fork_role, preload
from overlord.store import EmbeddedRedis, Keys, connect, redact
from overlord.store.schema import PLANNER_DONE, PLANNER_UPDATED, RESUME_STEP, encode_record, skip_field
from overlord.store.schema import positions as read_positions

log = logging.getLogger("overlord.sidecar")

POLL_S = 0.02
SHADOW_RESPAWN_S = 1.0  # after a promotion, when the replacement shadow starts


class Sidecar(NodeMember):
    """Runs one job's roles on this node.

    Args:
        job: the job.
        exit_when_idle: exit once every trainer that attached has gone (or none came
            within the job timeout); used when a DataLoader spawned this sidecar.
        resume: continue the job where its trainers' `load_state_dict` positions say,
            from the planner checkpoints kept in Redis, instead of starting at step 0.
    """

    def __init__(self, job: Job, *, exit_when_idle: bool = False, resume: bool = False) -> None:
        if resume and job.multi_node:
            raise OverlordError(
                "--resume of a job on several nodes is not supported yet: a node's sidecar that "
                "restarts joins the running job by itself; restart a stopped job fresh"
            )
        self.job = job
        self.exit_when_idle = exit_when_idle
        self.resume = resume
        self.keys = Keys(job.name)
        self.run_dir = job.run_path
        self.redis: EmbeddedRedis | None = None
        self.children: dict[str, RoleProcess] = {}
        self.attempts: dict[str, int] = {}  # role<index> -> restarts so far
        self.awaiting: dict[int, float] = {}  # loader process -> when its shadow's promotion was awaited
        self.shadow_due: dict[int, float] = {}  # loader process -> when to start its new shadow
        self.rings: list[Ring] = []
        self.client_rings: dict[int, Ring] = {}
        self.stop = threading.Event()
        self._lock_fh: TextIO | None = None
        # processes of its own next to the roles (not forked: they run server threads):
        # name -> (how to start it, the process)
        self.services: dict[str, tuple[Callable[[], subprocess.Popen], subprocess.Popen]] = {}
        self._beaten = 0.0  # when the node heartbeat was last written (monotonic)
        self._state_checked = 0.0  # when Redis was last seen holding the job's state (monotonic)
        # several nodes: which units run here follows the Planner's `placement` hash
        self.leaving: set[str] = set()  # units placed elsewhere now, stopping here
        self.fostered: dict[str, list[Ring]] = {}  # constructor<h> of another node run here -> its client rings
        self._placed_at = 0.0
        self._errors_at = 0.0
        self.deaths: dict[int, tuple[tuple, str] | None] = {}  # pid of a dead loader process -> its sample
        self.poisoned: dict[int, tuple] = {}  # loader process -> the sample its last death in a transform was on

    # -- start-up ------------------------------------------------------------------------

    def _take_lock(self) -> None:
        self.job.make_run_path()
        self._lock_fh = open(lock_path(self.job), "a+")
        try:
            fcntl.flock(self._lock_fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OverlordError(
                f"a sidecar for job {self.job.name!r} already runs on this node (lock {lock_path(self.job)}); "
                "stop it first or use another Job.name"
            ) from None
        self._lock_fh.seek(0)
        self._lock_fh.truncate()
        self._lock_fh.write(str(os.getpid()))
        self._lock_fh.flush()

    def _start_store(self) -> str:
        if self.job.redis_url:
            return self.job.redis_url
        self.redis = EmbeddedRedis(self.run_dir).start()
        return self.redis.url

    def _publish(self, r, layout: Layout) -> None:
        # forget the last run's plans, metadata and errors; a resume keeps the checkpoints
        keep = (
            {self.keys.ckpt.encode(), self.keys.ckpt_delta.encode(), self.keys.ckpt_layout.encode()}
            if self.resume
            else set()
        )
        keep.add(self.keys.profile.encode())  # cost profiles outlive a run: the next start partitions from them
        keep.add(self.keys.boot.encode())  # held by this sidecar while it publishes
        if self.job.autoscale is not None:
            keep.add(self.keys.autoscale.encode())  # written just before, from the journal or the stored one
        stale = [k for k in r.scan_iter(match=self.keys.pattern, count=1000) if k not in keep]
        if stale:
            r.delete(*stale)
        if self.resume:
            previous = r.get(self.keys.ckpt_layout)
            if previous is not None and json.loads(previous) != _streams_of(layout):
                raise OverlordError(
                    f"cannot resume job {self.job.name!r}: its sources or partitions changed since the "
                    "checkpoints were written (their cursors are per source partition); start it fresh "
                    "(without --resume)"
                )
        pipe = r.pipeline(transaction=True)
        pipe.set(self.keys.job_config, self.job.to_json())
        pipe.set(self.keys.layout, layout.to_json())
        pipe.set(self.keys.ckpt_layout, json.dumps(_streams_of(layout)))
        pipe.hset(self.keys.nodes, self.job.node, encode_record(self._membership()))
        pipe.execute()

    def _beat(self) -> None:
        """The node's heartbeat (`hb:sidecar:<node>`, TTL): membership lapses with it."""
        now = time.monotonic()
        if now - self._beaten < HEARTBEAT_S:
            return
        self._beaten = now
        try:
            self.r.set(
                self.keys.heartbeat("sidecar", self.job.node),
                json.dumps({"pid": os.getpid(), "node": self.job.node, "time": time.time(), "loop_age": 0.0}),
                ex=HEARTBEAT_TTL_S,
            )
        except redis.RedisError:
            pass  # Redis away: the watch loop restarts an embedded one

    def _create_rings(self, layout: Layout) -> None:
        for loader in range(layout.loaders):
            for dp in range(self.job.mesh.dp):
                self.rings.append(Ring.create(sample_ring(self.job, loader, dp), self.job.sample_ring_bytes))
        for rank in self.job.ranks_of_node(self.job.node):
            ring = Ring.create(client_ring(self.job, rank), self.job.batch.ring_bytes)
            self.rings.append(ring)
            self.client_rings[rank] = ring

    def _await_positions(self) -> bool:
        """Wait for every trainer's `load_state_dict` position, then fix the resume step
        (the earliest) and how many micro-batches each rank already consumed past it.
        Returns whether every rank is past the last step of a finite job (nothing to run)."""
        world, mb = self.job.mesh.world_size, self.job.batch.micro_batches
        deadline = time.monotonic() + self.job.timeout_s
        while True:
            raw = self.r.hgetall(self.keys.resume)
            positions = read_positions(raw, world)
            if len(positions) == world:
                break
            if time.monotonic() > deadline:
                missing = sorted(set(range(world)) - set(positions))
                raise OverlordError(
                    f"resuming job {self.job.name!r}: rank(s) {missing} did not report a position within "
                    f"{self.job.timeout_s:g}s; every trainer must call DataLoader.load_state_dict() before iterating"
                )
            time.sleep(POLL_S)
        step = min(p[0] for p in positions.values())
        kept = Checkpoints(self.keys).steps(self.r)
        if step not in kept:
            raise OverlordError(
                f"resuming job {self.job.name!r} at step {step}: no planner checkpoint for it "
                f"(kept: steps {kept[:1]}..{kept[-1:]}); the trainers' state is older than what Redis kept"
            )
        later = [s for s in kept if s > step]  # the old run's future: the resumed run writes its own
        if later:
            self.r.hdel(self.keys.ckpt, *later)
            self.r.hdel(self.keys.ckpt_delta, *later)
        mapping = {RESUME_STEP: step, **{skip_field(r): (p[0] - step) * mb + p[1] for r, p in positions.items()}}
        self.r.hset(self.keys.resume, mapping=mapping)
        mode.write(self.job, resume=True, decided=True, spawned=mode.spawned_here())
        log.info(
            "resuming job %r at step %d (micro-batches already consumed per rank: %s)",
            self.job.name,
            step,
            {r: mapping[skip_field(r)] for r in positions},
        )
        # the state before `step` says the job's last step came before it
        return bool(Checkpoints(self.keys).load(self.r, step).get("done"))

    def _end_at_once(self) -> None:
        """A resume after the last step of a finite job: start no role, mark the job done
        and close every client ring, so each trainer's iteration ends at once (the ring
        drains, then says closed) instead of waiting for batches no step will bring."""
        log.info(
            "resuming job %r after its last step: nothing left to deliver; the trainers' iteration ends", self.job.name
        )
        self.r.hset(self.keys.planner, mapping={PLANNER_DONE: 1, PLANNER_UPDATED: time.time()})
        for ring in self.client_rings.values():
            ring.close_writer()

    def _spawn(self, role: str, index: int, url: str, attempt: int = 0) -> RoleProcess:
        proc = fork_role(role, index, self.run_dir, url, attempt)
        proc.role, proc.index = role, index
        self.children[f"{role}{index}"] = proc
        if role == "loader":
            self.r.hset(self.keys.active, index, proc.pid)
        return proc

    def _serve(self, name: str, start: Callable[[], subprocess.Popen]) -> None:
        self.services[name] = (start, start())

    def _layout(self) -> Layout:
        """Size the loaders (autoscale) and lay the job out."""
        partitioning = None
        if self.job.autoscale is not None:
            self.job, partitioning = autoscale(self.job, self.r, self.keys, resume=self.resume)
        return Layout.plan(self.job, partitioning)

    def start(self) -> None:
        log_context(self.job.name, self.job.node)
        check_sources(self.job)  # before anything starts: a wrong path is the commonest mistake
        check_transforms(self.job)  # a transform that does not import is named now, not at the first batch
        if self.job.redis_url:
            check_redis(self.job.redis_url)
        self._take_lock()
        removed = cleanup_stale(self.job.name)
        for table in self.run_dir.glob("inflight-*.bin"):  # in-flight tables of a previous run's loaders
            table.unlink(missing_ok=True)
        if removed:
            log.info("removed %d shared-memory segment(s) left by dead owners: %s", len(removed), removed)
        url = self._start_store()
        # short: the watch loop goes on without Redis (restarting an embedded one that died);
        # its roles and trainers are the ones that wait up to Job.redis_outage_s
        self.r = connect(url, ride_through_s=1.0, setting="the sidecar's retry before its loop goes on")
        if self.job.multi_node:
            layout, placement = self._boot()
        else:
            layout, placement = self._layout(), None
        check_shm(self.job, layout.loaders)
        (self.run_dir / "job.json").write_text(self.job.to_json())
        if placement is None:
            self._publish(self.r, layout)
        self._create_rings(layout)
        # what a trainer that loads a state finds here (overlord.sidecar.mode)
        mode.write(self.job, resume=self.resume, decided=False, spawned=mode.spawned_here())
        if self.resume and self._await_positions():
            self._end_at_once()
            return
        preload()
        self.url, self.layout = url, layout
        if self.job.flight_port:
            # deferred: pyarrow.flight (gRPC) is loaded only by jobs that serve rings to other nodes
            from overlord.remote.flight import job_token, start_server_process

            token = job_token(self.job, create=True, r=self.r)
            self._serve("the Flight endpoint", lambda: start_server_process(self.job, token, self.run_dir))
        if self.job.metrics_port:
            self._serve("the metrics endpoint", lambda: start_metrics_process(self.job, self.run_dir, url))
        self.r.connection_pool.disconnect()  # children open their own connections
        self._spawn("planner", 0, url)  # on several nodes: one per node, one leads
        if placement is not None:
            self._beat()
            self._follow_placement(placement)
        else:
            for i in range(layout.loaders):
                self._spawn("loader", i, url)
            for i in layout.shadowed:
                self._spawn("shadow", i, url)
            for i in range(layout.constructor_hosts):
                self._spawn("constructor", i, url)
        if self.job.flight_port:
            log.info(
                "serving rings over Arrow Flight on port %d%s",
                self.job.flight_port,
                " (TLS)" if self.job.flight_cert else "",
            )
        if self.job.metrics_port:
            log.info(
                "serving Prometheus metrics on %s port %d (/metrics)", metrics_host(self.job), self.job.metrics_port
            )
        log.info(
            "sidecar for job %r on node %r: %d stream(s) in %d loader process(es), %d DP group(s), redis %s",
            self.job.name,
            self.job.node,
            len(layout.streams),
            layout.loaders,
            self.job.mesh.dp,
            "embedded" if self.redis else "external",
        )

    # -- watching ------------------------------------------------------------------------

    def _failure_message(self, name: str, code: int) -> str:
        try:
            raw = self.r.lindex(self.keys.errors, 0)
        except Exception:  # noqa: BLE001 - Redis itself may be the casualty
            raw = None
        died = self._died_in_transform(name, code)
        if code < 0 and self.attempts.get(name, 0) >= self.job.max_restarts:
            proc = self.children[name]
            return (
                f"{name} (pid {proc.pid}) on node {self.job.node!r} was killed by signal {-code} after "
                f"{self.attempts[name]} restarts (Job.max_restarts); see {self.run_dir / (name + '.log')}"
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
            f"see {self.run_dir / (name + '.log')}"
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
            f"{sentence}, {times}; see {self.run_dir / (name + '.log')}. Fix the transform for that row (something "
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

    def _clients_gone(self) -> bool:
        """True once every client that attached has exited (and at least one attached)."""
        seen = [ring.consumer_pid for ring in self.client_rings.values() if ring.consumer_pid]
        return bool(seen) and not any(_alive(pid) for pid in seen)

    def _drained(self) -> bool:
        """Every client ring is read to the end, or its trainer attached and exited."""
        return all(
            ring.pending() == 0 or (ring.consumer_pid and not _alive(ring.consumer_pid))
            for ring in [*self.client_rings.values(), *(r for rings in self.fostered.values() for r in rings)]
        )

    # -- recovery ------------------------------------------------------------------------

    def _restart_redis(self) -> None:
        if self.redis is None:
            return  # an external Redis: nothing of ours to start
        log.warning(
            "the embedded redis-server (pid %s) died; starting it again from its append-only file",
            self.redis.proc.pid if self.redis.proc else "?",
        )
        self.redis.proc = None
        self.redis.start()

    def _restartable(self, name: str, code: int) -> bool:
        """A role killed by a signal is restarted (within its budget); one that failed
        with an error of its own would fail again: that ends the job."""
        return code < 0 and self.attempts.get(name, 0) < self.job.max_restarts

    def _dying_again(self, killed: list[str], codes: dict) -> str | None:
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

    def _restart(self, name: str) -> None:
        proc = self.children.pop(name)
        role, index = proc.role, proc.index
        attempt = self.attempts[name] = self.attempts.get(name, 0) + 1
        self.r.hincrby(self.keys.restarts, name, 1)
        beat = self.r.get(self.keys.heartbeat(role, str(index)))
        if beat is not None and json.loads(beat).get("pid") == proc.pid:
            self.r.delete(self.keys.heartbeat(role, str(index)))  # its heartbeat lapses now, not at its TTL
        if role == "planner":
            release_dead(self.r, self.keys, proc.pid, self.job.node)
        shadow = self.children.get(f"shadow{index}")
        if role == "loader" and shadow is not None and shadow.poll() is None:
            log.warning("%s (pid %d) was killed; the Planner promotes its shadow (pid %d)", name, proc.pid, shadow.pid)
            self.awaiting[index] = time.monotonic()
            return
        log.warning(
            "%s (pid %d) was killed; restarting it (restart %d of %d)", name, proc.pid, attempt, self.job.max_restarts
        )
        self._spawn(role, index, self.url, attempt)

    def _promoted(self) -> None:
        """A shadow the Planner promoted is the active loader now: start a new shadow."""
        for k, since in list(self.awaiting.items()):
            shadow = self.children[f"shadow{k}"]
            active = self.r.hget(self.keys.active, k)
            if active is not None and int(active) == shadow.pid:
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
                self._spawn("loader", k, self.url, self.attempts.get(f"loader{k}", 1))

    def _start_due_shadows(self) -> None:
        for k, due in list(self.shadow_due.items()):
            if time.monotonic() >= due:
                del self.shadow_due[k]
                self._spawn("shadow", k, self.url, self.attempts.get(f"loader{k}", 1))

    def watch(self) -> int:
        """Supervise until the job ends, a role fails, or a stop is requested; 0 on success."""
        started = time.monotonic()
        finished: float | None = None
        while not self.stop.wait(POLL_S):
            if self.redis is not None and self.redis.proc is not None and self.redis.proc.poll() is not None:
                self._restart_redis()
            for name, (start, proc) in list(self.services.items()):
                if proc.poll() is not None:
                    log.warning("%s (pid %d) exited with %s; starting it again", name, proc.pid, proc.returncode)
                    self._serve(name, start)
            self._beat()
            codes = {name: proc.poll() for name, proc in self.children.items()}
            lost = self._lost_state(failing=any(c not in (None, 0) for c in codes.values()))
            if lost is not None:
                return self._fail(lost)
            try:
                if self.job.multi_node:
                    self._retire(codes)
                    self._follow_placement()
                    message = self._remote_failure()
                    if message is not None:
                        return self._fail(message)
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                log.warning("Redis unreachable while following the placement (%s); retrying", exc)
                continue
            killed = [n for n, c in codes.items() if c is not None and c != 0 and self._restartable(n, c)]
            again = self._dying_again(killed, codes)
            if again is not None:
                return self._fail(again)
            try:
                for name in killed:
                    self._restart(name)
                    codes.pop(name)
                if self.awaiting:
                    self._promoted()
                if self.shadow_due:
                    self._start_due_shadows()
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                log.warning("Redis unreachable while recovering a role (%s); retrying", exc)
                continue
            failed = [(n, c) for n, c in codes.items() if c not in (None, 0)]
            if failed:
                return self._fail(self._failure_message(*failed[0]))
            if not self.awaiting and all(c == 0 for c in codes.values()):
                finished = finished or time.monotonic()
                if self._drained() or time.monotonic() - finished > self.job.timeout_s:
                    return 0
            if self.exit_when_idle:
                if self._clients_gone():
                    return 0
                attached = any(ring.consumer_pid for ring in self.client_rings.values())
                if not attached and time.monotonic() - started > max(self.job.timeout_s, 30):
                    log.info("no trainer attached within %.0fs; exiting", max(self.job.timeout_s, 30))
                    return 0
        return 0

    def _lost_state(self, failing: bool) -> str | None:
        """Why the job must end when its Redis came back without the job's state (restarted
        without persistence, or flushed): nothing is left to plan or resume from. Checked
        once a heartbeat, and at once when a role failed (it may have failed for that)."""
        now = time.monotonic()
        if not failing and now - self._state_checked < HEARTBEAT_S:
            return None
        try:
            if self.r.exists(self.keys.job_config):
                self._state_checked = now
                return None
        except redis.RedisError:
            return None  # away: the roles wait for it up to Job.redis_outage_s
        return (
            f"the job's Redis at {redact(self.url)} no longer holds the state of job {self.job.name!r} (its key "
            f"{self.keys.job_config!r} is gone: Redis restarted without persistence, or was flushed); its plans, "
            "cursors and checkpoints are lost. Restart the job (trainers resume from their state_dict) and give "
            "Redis an append-only file (appendonly yes) or a replica"
        )

    def _fail(self, message: str) -> int:
        log.error("%s", message)
        for ring in [*self.client_rings.values(), *(r for rings in self.fostered.values() for r in rings)]:
            ring.set_error(message)
        self._grace_for_clients()
        return 1

    def _grace_for_clients(self) -> None:
        """Keep the rings (with the error set) until every trainer has attached and left,
        or the job timeout passes, so a trainer that comes late still reads the error."""
        deadline = time.monotonic() + self.job.timeout_s
        while time.monotonic() < deadline and not self.stop.is_set():
            pids = [ring.consumer_pid for ring in self.client_rings.values()]
            if all(pids) and not any(_alive(pid) for pid in pids if pid):
                return
            time.sleep(POLL_S)

    # -- shutdown ------------------------------------------------------------------------

    def shutdown(self) -> None:
        for _, service in self.services.values():
            if service.poll() is None:
                service.terminate()
        for _, service in self.services.values():
            try:
                service.wait(timeout=5)
            except subprocess.TimeoutExpired:
                service.kill()
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
        for ring in self.rings:
            ring.close()
        unlink_all(self.job.name, self.job.node)
        if self.redis is not None:
            self.redis.stop()
        if self._lock_fh is not None:
            self._lock_fh.close()

    def run(self) -> int:
        """Start, watch, and always clean up. Returns the process exit status."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, set_on_signal(self.stop))
        try:
            self.start()
            return self.watch()
        finally:
            self.shutdown()
            # Cleaned up and about to exit. A stop asked for now (a supervisor's SIGTERM
            # racing a job that ended on its own) must not end the exit with -15: CPython
            # puts the default action back while it finalizes, so ignore these instead.
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, signal.SIG_IGN)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _streams_of(layout: Layout) -> dict:
    """What planner checkpoints depend on: the streams (source partitions), not which
    process hosts them or how many DP groups there are."""
    return {"streams": layout.streams, "stream_source": layout.stream_source}
