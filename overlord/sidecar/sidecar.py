"""The sidecar: one per node; starts, watches and stops every role of the job there.

Start-up: take the job's lock in its run directory (one sidecar per job and node),
remove shared-memory segments left by dead owners, start the embedded redis-server
(or connect to Job.redis_url), publish the job, its layout and this node, create every
ring, then start the Planner, the Source Loader processes and the Data Constructor
host as child processes that die with the sidecar (PR_SET_PDEATHSIG).

While running it watches the children (overlord.sidecar.supervision: a child killed by
a signal is restarted within `Job.max_restarts` and recovers from Redis; one that
failed ends the job). A failure's message goes into every trainer's ring, so the
trainer raises it with its origin. On several nodes it follows the Planner's
placement (overlord.sidecar.membership); with `--resume` it first waits for the
trainers' positions (overlord.sidecar.resume).

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
from overlord.logs import log_context
from overlord.metrics import metrics_host, start_metrics_process
from overlord.remote.endpoint import job_token, start_server_process
from overlord.runtime.flow import HEARTBEAT_S, set_on_signal
from overlord.runtime.layout import Layout, client_ring, sample_ring
from overlord.runtime.service import Supervised, port_hint
from overlord.shm import Ring, cleanup_stale, unlink_all
from overlord.shm import pid_alive as _alive
from overlord.sidecar import mode, resume, rewind
from overlord.sidecar.checks import check_redis, check_shm, check_sources, check_transforms
from overlord.sidecar.membership import Membership, Republished, live_nodes
from overlord.sidecar.mode import lock_path
from overlord.sidecar.mode import sidecar_running as sidecar_running  # where tests and tools look for it
from overlord.sidecar.role import HEARTBEAT_TTL_S
from overlord.sidecar.spawn import preload
from overlord.sidecar.supervision import Roles
from overlord.store import EmbeddedRedis, Keys, connect, redact
from overlord.store.schema import RESUME_AWAITING, encode_position, encode_record, position_field

LOCK_WAIT_S = 5.0  # a dead sidecar's children let go of its lock within this

log = logging.getLogger("overlord.sidecar")

POLL_S = 0.02


class Sidecar:
    """Runs one job's roles on this node.

    Args:
        job: the job.
        exit_when_idle: exit once every trainer that attached has gone (or none came
            within the job timeout); used when a DataLoader spawned this sidecar.
        resume: continue the job where its trainers' `load_state_dict` positions say,
            from the planner checkpoints kept in Redis, instead of starting at step 0.
    """

    def __init__(self, job: Job, *, exit_when_idle: bool = False, resume: bool = False) -> None:
        self.job = job
        self.exit_when_idle = exit_when_idle
        self.resume = resume
        self.rewinding = False  # several nodes: taking part in a rewind (overlord.sidecar.rewind)
        self._rewind_checked = 0.0  # when Redis was last asked whether a rewind is under way (monotonic)
        self._runs = 0  # runs begun: 1, and one more per rewind or rejoin (the mode file says it)
        self.rejoining = False  # joining again a job published without this node (`_rejoin`)
        self.keys = Keys(job.name)
        self.run_dir = job.run_path
        self.redis: EmbeddedRedis | None = None
        self.roles = Roles(job, self.keys, self.run_dir)  # the role processes it runs
        self.membership = Membership(job, self.keys, self.roles)  # several nodes: its part in the job
        self.rings: list[Ring] = []
        self.client_rings: dict[int, Ring] = {}
        self.stop = threading.Event()
        self._lock_fh: TextIO | None = None
        # processes of its own next to the roles (not forked: they run server threads)
        self.services: list[Supervised] = []
        self._beaten = 0.0  # when the node heartbeat was last written (monotonic)
        self._state_checked = 0.0  # when Redis was last seen holding the job's state (monotonic)

    # -- start-up ------------------------------------------------------------------------

    def _take_lock(self) -> None:
        """The job's lock on this node. Held by a sidecar that has exited (the pid in the
        file is dead), it is held by what its children left for a moment (they inherit
        its descriptor, and die with it): waited for up to LOCK_WAIT_S, not refused."""
        self.job.make_run_path()
        self._lock_fh = open(lock_path(self.job), "a+")
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(self._lock_fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                self._lock_fh.seek(0)
                holder = self._lock_fh.read().strip()
                if (holder.isdigit() and _alive(int(holder))) or time.monotonic() > deadline:
                    raise OverlordError(
                        f"a sidecar for job {self.job.name!r} already runs on this node (lock {lock_path(self.job)}, "
                        f"pid {holder or '?'}); stop it first or use another Job.name"
                    ) from None
                time.sleep(0.05)
        self._lock_fh.seek(0)
        self._lock_fh.truncate()
        self._lock_fh.write(str(os.getpid()))
        self._lock_fh.flush()

    def _start_store(self) -> str:
        if self.job.redis_url:
            return self.job.redis_url
        self.redis = EmbeddedRedis(self.run_dir).start()
        return self.redis.url

    def _publish(self, layout: Layout, job: Job | None = None) -> None:
        """Publish the job (`job`: the one joined, in a rewind), its layout and this node,
        after forgetting the last run's plans, metadata and errors (a resume keeps the
        checkpoints; a rewind also the trainers' positions: overlord.sidecar.rewind)."""
        r, job = self.r, job or self.job
        keep = rewind.kept(
            self.keys, resume=self.resume, rewinding=self.rewinding, autoscale=self.job.autoscale is not None
        )
        stale = [
            k
            for k in r.scan_iter(match=self.keys.pattern, count=1000)
            if rewind.forgets(k, keep, self.keys, rewinding=self.rewinding)
        ]
        if stale:
            r.delete(*stale)
        asked = rewind.asked_positions(r.hgetall(self.keys.rewind)) if self.rewinding else {}
        if self.resume or self.rewinding:
            resume.check_layout(job, r, self.keys, layout)
        self.roles.run = os.urandom(8).hex().encode()  # a node that misses this publish learns of it
        pipe = r.pipeline(transaction=True)
        pipe.set(self.keys.run, self.roles.run)
        pipe.set(self.keys.job_config, job.to_json())
        pipe.set(self.keys.layout, layout.to_json())
        pipe.set(self.keys.ckpt_layout, json.dumps(resume.streams_of(layout)))
        pipe.hset(self.keys.nodes, job.node, encode_record(self.membership.offer()))
        if job.multi_node and (self.resume or self.rewinding):
            # a sidecar joining now waits for positions too; a rewound run starts from the
            # positions of the trainers that asked for it (the others tell theirs later)
            pipe.hset(
                self.keys.resume,
                mapping={RESUME_AWAITING: 1, **{position_field(k): encode_position(at) for k, at in asked.items()}},
            )
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

    def _forget_beat(self) -> None:
        """On the way out: drop this node's heartbeat now, not at its TTL, so a sidecar
        that starts the job again (a resume) at once does not take it for a live node."""
        key = self.keys.heartbeat("sidecar", self.job.node)
        try:
            raw = self.r.get(key)
            if raw is not None and json.loads(raw).get("pid") == os.getpid():
                self.r.delete(key)
        except (redis.RedisError, AttributeError):
            pass  # Redis away (or never reached): the heartbeat lapses at its TTL

    def _create_rings(self, layout: Layout) -> None:
        for loader in range(layout.loaders):
            for dp in range(self.job.mesh.dp):
                self.rings.append(Ring.create(sample_ring(self.job, loader, dp), self.job.sample_ring_bytes))
        for rank in self.job.ranks_of_node(self.job.node):
            ring = Ring.create(client_ring(self.job, rank), self.job.batch.ring_bytes)
            self.rings.append(ring)
            self.client_rings[rank] = ring

    def _serve(self, name: str, start: Callable[[], subprocess.Popen], log_name: str, port: int) -> None:
        hint = port_hint(port)
        if hint:
            log.warning("%s: %s", name, hint)
        self.services.append(Supervised(name, start, self.run_dir / log_name))

    def _layout(self) -> Layout:
        """Size the loaders (autoscale) and lay the job out."""
        partitioning = None
        if self.job.autoscale is not None:
            self.job, partitioning = autoscale(self.job, self.r, self.keys, resume=self.resume)
        return Layout.plan(self.job, partitioning)

    def start(self) -> None:
        """Take the lock, start or reach the job's Redis, publish the job (or join it),
        create the rings and start the roles (or, for a resume, wait for the trainers'
        positions first)."""
        log_context(self.job.name, self.job.node)
        check_sources(self.job)  # before anything starts: a wrong path is the commonest mistake
        check_transforms(self.job)  # a transform that does not import is named now, not at the first batch
        if self.job.redis_url:
            check_redis(self.job.redis_url)
        self._take_lock()
        # under the lock: this node's segments a previous PID namespace made are dead too
        removed = cleanup_stale(self.job.name, node=self.job.node if self.job.multi_node else None)
        for table in self.run_dir.glob("inflight-*.bin"):  # in-flight tables of a previous run's loaders
            table.unlink(missing_ok=True)
        if removed:
            log.info("removed %d shared-memory segment(s) left by dead owners: %s", len(removed), removed)
        url = self._start_store()
        # short: the watch loop goes on without Redis; its roles and trainers are the ones
        # that wait up to Job.redis_outage_s. An embedded server that died is started again
        # by whichever command finds it gone (`_revive_redis`), while the roles start too
        self.r = connect(
            url,
            ride_through_s=1.0,
            setting="the sidecar's retry before its loop goes on",
            name="sidecar",
            known=True,
            revive=self._revive_redis,
        )
        self.url = url
        self.roles.use(self.r, url)
        begun = self._begin()
        if begun is None:
            return
        preload(remote=self.job.multi_node)
        if self.job.flight_port:
            token = job_token(self.job, create=True, r=self.r)
            self._serve(
                "the Flight endpoint",
                lambda: start_server_process(self.job, token, self.run_dir),
                "flight.log",
                self.job.flight_port,
            )
        if self.job.metrics_port:
            self._serve(
                "the metrics endpoint",
                lambda: start_metrics_process(self.job, self.run_dir, url),
                "metrics.log",
                self.job.metrics_port,
            )
        self._start_roles(*begun)
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
        layout = begun[0]
        log.info(
            "sidecar for job %r on node %r: %d stream(s) in %d loader process(es), %d DP group(s), redis %s",
            self.job.name,
            self.job.node,
            len(layout.streams),
            layout.loaders,
            self.job.mesh.dp,
            "embedded" if self.redis else "external",
        )

    def _begin(self) -> tuple[Layout, dict[str, str] | None] | None:
        """Publish the job (or join it), create the rings and, for a resume, wait for the
        trainers' positions. Returns the layout and placement the roles start from, or
        None when a resume found nothing left to deliver (the trainers' iteration ends)."""
        if self.job.multi_node:
            if (
                not self.rewinding
                and rewind.under_way(self.r, self.keys)
                and rewind.published(self.r, self.keys) is None
                and self._live_nodes() - {self.job.node}
            ):
                # started during a rewind (a lost node back): take part in it; with no other
                # node live it is the stale rewind of a stopped job, forgotten at publish
                self.rewinding = True
            if self.rewinding:
                self._beaten = 0.0
                rewind.await_stopped(self.job, self.r, self.keys, self._live_nodes, self._beat)
            self._beaten = 0.0  # the beat at the end of boot is written whenever it last was
            joined, layout, placement = self.membership.boot(
                self.r, self._layout, self._publish, self._beat, rewinding=self.rewinding
            )
            self.job = joined or self.job
            self.resume = self._resuming(joined is not None)
        else:
            layout, placement = self._layout(), None
        check_shm(self.job, layout.loaders)
        (self.run_dir / "job.json").write_text(self.job.to_json())
        if placement is None:
            self._publish(layout)
        self._create_rings(layout)
        # what a trainer that loads a state finds here (overlord.sidecar.mode)
        self._runs += 1
        mode.write(self.job, resume=self.resume, decided=False, spawned=mode.spawned_here(), run=self._runs)
        self.rewinding = False
        if self.resume and resume.await_positions(self.job, self.r, self.keys, run=self._runs, beat=self._beat):
            resume.end_at_once(self.job, self.r, self.keys, list(self.client_rings.values()))
            return None
        return layout, placement

    def _resuming(self, joined: bool) -> bool:
        """Several nodes, after boot: whether this sidecar waits for the trainers'
        positions. The run it published, or a rewound one, does when resumed; one it
        joined does while that run waits for them (`awaiting`), whatever --resume said."""
        if self.rewinding:
            return True
        if not joined:
            return self.resume
        awaiting = bool(self.r.hexists(self.keys.resume, RESUME_AWAITING))
        if self.resume and not awaiting and not self.rejoining:
            log.warning(
                "node %r joins the running job %r (--resume has nothing to wait for)", self.job.node, self.job.name
            )
        return awaiting

    def _live_nodes(self) -> set[str]:
        return live_nodes(self.r, self.keys, self.job.node_ids)

    def _start_roles(self, layout: Layout, placement: dict[str, str] | None) -> None:
        self.r.connection_pool.disconnect()  # children open their own connections
        self.roles.spawn("planner", 0)  # on several nodes: one per node, one leads
        if placement is not None:
            self._beat()
            self.membership.follow(self.r, placement)
        else:
            for i in range(layout.loaders):
                self.roles.spawn("loader", i)
            for i in layout.shadowed:
                self.roles.spawn("shadow", i)
            for i in range(layout.constructor_hosts):
                self.roles.spawn("constructor", i)

    def _rewind_asked(self) -> bool:
        """Several nodes: whether trainers asked the job to go back (checked every CHECK_S)."""
        now = time.monotonic()
        if not self.job.multi_node or now - self._rewind_checked < rewind.CHECK_S:
            return False
        self._rewind_checked = now
        return rewind.under_way(self.r, self.keys)

    def _rewind(self) -> None:
        """Stop every role and drop the rings, then resume in place from the trainers'
        positions, as every other node's sidecar does (overlord.sidecar.rewind). The
        Flight and metrics endpoints run on: they open rings by name per request."""
        log.warning(
            "trainers of job %r loaded an earlier state: stopping every role on node %r and resuming from it",
            self.job.name,
            self.job.node,
        )
        self._drop_run()
        self.rewinding = True
        begun = self._begin()
        if begun is not None:
            self._start_roles(*begun)

    def _rejoin(self, why: str) -> None:
        """The job was published again without this node (`why`, membership.Republished):
        its run is over. A trainer still reading one of its rings gets the error (the
        batches it would read next belong to a run the job left); every role stops, the
        rings go, and the sidecar joins the job as it runs now, waiting for the trainers'
        positions while that run does. With no other node live any more it publishes the
        job as a resume (the checkpoints kept), never as a fresh start."""
        message = (
            f"{why}: node {self.job.node!r} left that run's batches undelivered on its rings and joins the job "
            "again; restart the trainers of this node from their saved state"
        )
        log.warning("%s; stopping every role here and joining the job again", why)
        for ring in [*self.client_rings.values(), *self.membership.fostered_rings()]:
            if ring.consumer_pid and _alive(ring.consumer_pid):
                ring.set_error(message)
        self._drop_run()
        self.rejoining, self.resume = True, True
        try:
            begun = self._begin()
            if begun is not None:
                self._start_roles(*begun)
        except redis.RedisError:
            self.roles.run = None  # cut short: the watch loop's next placement read rejoins again
            raise
        finally:
            self.rejoining = False

    def _drop_run(self) -> None:
        """Stop every role and drop every ring of this node's run (a rewind, a rejoin)."""
        self.roles.stop()
        for ring in [*self.rings, *self.membership.made]:
            ring.close()
        unlink_all(self.job.name, self.job.node)
        self.rings, self.client_rings = [], {}
        self.roles = Roles(self.job, self.keys, self.run_dir)
        self.roles.use(self.r, self.url)
        self.membership = Membership(self.job, self.keys, self.roles)

    # -- watching ------------------------------------------------------------------------

    def _clients_gone(self) -> bool:
        """True once every client that attached has exited (and at least one attached)."""
        seen = [ring.consumer_pid for ring in self.client_rings.values() if ring.consumer_pid]
        return bool(seen) and not any(_alive(pid) for pid in seen)

    def _drained(self) -> bool:
        """Every client ring is read to the end, or its trainer attached and exited."""
        return all(
            ring.pending() == 0 or (ring.consumer_pid and not _alive(ring.consumer_pid))
            for ring in [*self.client_rings.values(), *self.membership.fostered_rings()]
        )

    # -- recovery ------------------------------------------------------------------------

    def _revive_redis(self) -> bool:
        """Start the embedded redis-server again if it died; True if it had. Called by the
        watch loop and by the sidecar's client on a failed command (`connect(revive=)`), so
        a server killed while the sidecar starts its roles is back before the client's
        retry runs out, not only once the loop watches."""
        if self.redis is None or self.redis.proc is None or self.redis.proc.poll() is None:
            return False  # external, being started again, or alive
        log.warning(
            "the embedded redis-server (pid %s) died; starting it again from its append-only file",
            self.redis.proc.pid,
        )
        self.redis.proc = None
        self.redis.start()
        return True

    def watch(self) -> int:
        """Supervise until the job ends, a role fails, or a stop is requested; 0 on success."""
        started = time.monotonic()
        finished: float | None = None
        while not self.stop.wait(POLL_S):
            self._revive_redis()
            now = time.monotonic()
            for service in self.services:
                service.keep_up(now)
            self._beat()
            codes = self.roles.codes()
            lost = self._lost_state(failing=any(c not in (None, 0) for c in codes.values()))
            if lost is not None:
                return self._fail(lost)
            self.membership.forget_superseded(codes)
            try:
                if self._rewind_asked():
                    try:
                        self._rewind()
                    except OverlordError as exc:
                        return self._fail(str(exc))
                    started, finished = time.monotonic(), None
                    continue
                if self.job.multi_node:
                    self.membership.retire(codes)
                    try:
                        self.membership.follow(self.r)
                    except Republished as exc:
                        try:
                            self._rejoin(str(exc))
                        except OverlordError as error:
                            return self._fail(str(error))
                        started, finished = time.monotonic(), None
                        continue
                    message = self.membership.remote_failure(self.r)
                    if message is not None:
                        return self._fail(message)
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                log.warning("Redis unreachable while following the placement (%s); retrying", exc)
                continue
            killed = [n for n, c in codes.items() if c is not None and c != 0 and self.roles.restartable(n, c)]
            again = self.roles.dying_again(killed, codes)
            if again is not None:
                return self._fail(again)
            try:
                for name in killed:
                    self.roles.restart(name)
                    codes.pop(name)
                self.roles.follow_promotions()
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                log.warning("Redis unreachable while recovering a role (%s); retrying", exc)
                continue
            failed = [(n, c) for n, c in codes.items() if c not in (None, 0)]
            if failed:
                return self._fail(self.roles.failure_message(*failed[0]))
            if not self.roles.awaiting and all(c == 0 for c in codes.values()):
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
        for ring in [*self.client_rings.values(), *self.membership.fostered_rings()]:
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
        for service in self.services:
            if service.proc.poll() is None:
                service.proc.terminate()
        for service in self.services:
            try:
                service.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                service.proc.kill()
        self.roles.stop()
        for ring in [*self.rings, *self.membership.made]:
            ring.close()
        unlink_all(self.job.name, self.job.node)
        if self.job.multi_node:
            self._forget_beat()
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
