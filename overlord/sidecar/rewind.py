"""A rewind of a job on several nodes: its trainers went back to an earlier state while
the nodes' sidecars kept serving later steps.

That is what happens when a node is lost with its trainers: torchrun (elastic) stops
every other worker and starts all of them again, each loading its last saved state,
while the surviving nodes' sidecars (and the lost node's, started again by systemd)
run on. The job then goes back to the trainers' state: every node's sidecar resumes in
place, as `overlord sidecar --resume` would, from the planner checkpoint of the
earliest rank's step (overlord.sidecar.resume).

    trainer r loads a state, its node's sidecar serves   -> `rewind` asked:<r>, `resume` position:<r>
    every sidecar sees `rewind`                          -> stops every role it runs, drops its rings,
                                                            `rewind` stopped:<node>
    every live node stopped (the barrier)                -> the first sidecar under the boot lock
                                                            publishes the job again (`rewind` published)
    the others                                           -> join it, waiting for positions
    every rank's position (`resume`)                     -> one sidecar decides the step; `rewind` goes

The barrier is the fence: nothing of the run that went too far writes after the job
is published again, because every role of every live node has exited by then. A node
whose sidecar heartbeat lapsed is not waited for: lost, its roles died with it; cut
off, they live on. Every publish writes a new `run` token, so such a node's sidecar,
back in reach, sees the job went on without it (overlord.sidecar.membership
`Republished`) and joins the rewound run, and its Planner cannot take the lease of a
run not its own (overlord.runtime.lease). The `fence` counter is kept across the
publish, so a Planner lease taken afterwards never reuses a token of the run before.
A sidecar that starts during a rewind (a lost node back) takes part in it from its
boot; one that starts after it joins the resumed run.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

from overlord.config import Job
from overlord.errors import OverlordError
from overlord.store import Keys
from overlord.store.schema import (
    ASKED,
    asked_field,
    encode_position,
    encode_rewind,
    position_field,
    rewind_published,
    stopped_field,
    stopped_nodes,
)

if TYPE_CHECKING:  # annotations only: a trainer on one node never loads redis-py
    import redis

log = logging.getLogger("overlord.sidecar")

CHECK_S = 0.2  # how often a serving sidecar looks for a rewind (one EXISTS)
POLL_S = 0.05

# what boot does (`boot_action`)
REPUBLISH = "republish"  # publish the job again, as it was laid out, for the rewound run
JOIN = "join"  # join the job other live nodes run (or a rewound run being resumed)
START = "start"  # start the job: lay it out and publish it (fresh, or `--resume`)


def ask(r: redis.Redis, keys: Keys, rank: int, pid: int, at: tuple[int, int]) -> None:
    """Trainer `rank` (process `pid`) loaded a state that resumes at (step, micro-batch)
    `at`, before what its node's sidecar serves: ask for a rewind, with its position."""
    pipe = r.pipeline(transaction=True)
    pipe.hset(keys.rewind, asked_field(rank), encode_rewind(pid, at))
    pipe.hset(keys.resume, position_field(rank), encode_position(at))
    pipe.execute()


def under_way(r: redis.Redis, keys: Keys) -> bool:
    """Whether a rewind was asked and its step is not decided yet."""
    return bool(r.exists(keys.rewind))


def published(r: redis.Redis, keys: Keys) -> str | None:
    """The node whose sidecar published the rewound run; None while none did."""
    return rewind_published(r.hgetall(keys.rewind))


def asked_positions(rewind: Mapping[bytes, bytes]) -> dict[int, list[int]]:
    """rank -> [step, micro-batch] of every trainer that asked for the rewind, from a
    `rewind` HGETALL (pure): the positions a rewound run starts with."""
    return {int(_field(k)[len(ASKED) :]): json.loads(v)["at"] for k, v in rewind.items() if _field(k).startswith(ASKED)}


def _field(k: bytes | str) -> str:
    return k.decode() if isinstance(k, bytes) else k


# KEYS: `rewind`; ARGV: the node's stopped field, the time. Written only while the rewind
# is under way: its hash goes once its step is decided.
_MARK_STOPPED = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
"""


def mark_stopped(r: redis.Redis, keys: Keys, node: str) -> bool:
    """Note that `node`'s sidecar stopped its roles for the rewind under way. False, and
    nothing written, when the rewind was decided already (its hash is gone): a node that
    reaches the barrier late (its link was cut while the others went through) joins the
    rewound run. Written anyway, its mark alone made a new rewind no trainer asked for:
    every sidecar stopped for it and waited for positions that no rank sent again."""
    return bool(r.eval(_MARK_STOPPED, 1, keys.rewind, stopped_field(node), f"{time.time():.3f}"))


def pending(live: Iterable[str], stopped: Iterable[str]) -> list[str]:
    """The live nodes whose sidecar has not stopped its roles yet (pure)."""
    return sorted(set(live) - set(stopped))


def boot_action(*, rewinding: bool, under_way: bool, published: str | None, others_live: bool, stored: bool) -> str:
    """What a sidecar of a job on several nodes does under the boot lock (pure).

    Args:
        rewinding: this sidecar takes part in a rewind (it passed the barrier).
        under_way: the rewind is not decided yet (its `rewind` hash exists): once it
            is, the rewound run already runs, and a sidecar late to the barrier joins it.
        published: the node that published the rewound run already, if any.
        others_live: another node's sidecar heartbeat is alive.
        stored: Redis holds the job's config and layout.
    """
    if rewinding and under_way and published is None and stored:
        return REPUBLISH
    if others_live and stored:
        return JOIN
    return START


def await_stopped(job: Job, r: redis.Redis, keys: Keys, live: Callable[[], set[str]], beat: Callable[[], None]) -> None:
    """The barrier: wait until every live node's sidecar (`live()`: the nodes whose
    sidecar heartbeat is alive) stopped its roles for the rewind (or one published the
    rewound run, or its step was decided).

    Raises:
        OverlordError: a live node's sidecar did not stop its roles within Job.timeout_s.
    """
    mark_stopped(r, keys, job.node)
    deadline = time.monotonic() + job.timeout_s
    while True:
        beat()  # this node stays live while it waits
        state = r.hgetall(keys.rewind)
        if not state or rewind_published(state) is not None:
            return
        waiting = pending(live(), stopped_nodes(state))
        if not waiting:
            return
        if time.monotonic() > deadline:
            raise OverlordError(
                f"rewinding job {job.name!r}: the sidecar(s) of node(s) {waiting} still beat but did not stop their "
                f"roles within {job.timeout_s:g}s; see their logs (`overlord status` on any node)"
            )
        time.sleep(POLL_S)


def kept(keys: Keys, *, resume: bool, rewinding: bool, autoscale: bool) -> set[bytes]:
    """The job's keys a sidecar keeps when it publishes a run (every other key of the
    job is forgotten): a resume keeps the checkpoints; a rewind also keeps the rewind
    itself (other nodes are part of it, and its asks are the trainers' positions: the
    `resume` hash starts again from them, `asked_positions`), the fence counter (a
    lease token is never reused) and the Flight token (the nodes' Flight endpoints run
    on through it). Pure."""
    keep = {keys.profile, keys.boot}  # cost profiles outlive a run; the boot lock is this sidecar's now
    if autoscale:
        keep.add(keys.autoscale)  # written just before, from the journal or the stored one
    if resume or rewinding:
        keep |= {keys.ckpt, keys.ckpt_delta, keys.ckpt_layout}
    if rewinding:
        keep |= {keys.rewind, keys.fence, keys.flight_token}
    return {k.encode() for k in keep}


def forgets(key: bytes, keep: set[bytes], keys: Keys, *, rewinding: bool) -> bool:
    """Whether publishing forgets `key`: not kept, and in a rewind not the heartbeat of
    a sidecar (the other nodes' sidecars live on through it). Pure."""
    if key in keep:
        return False
    return not (rewinding and key.startswith(keys.heartbeat("sidecar", "").encode()))
