"""A Data Constructor host process: one thread per Data Constructor it hosts.

Packing is numpy work that releases the GIL for its copies, so one process can host
the constructors of several DP groups; the first failure stops the others and is
raised with its DP group named.
"""

from __future__ import annotations

import logging
import threading

from overlord.constructor.constructor import DataConstructor
from overlord.constructor.marks import Superseded
from overlord.errors import OverlordError
from overlord.plan.waiting import SharedPlans
from overlord.remote.bridge import Bridge, Directory
from overlord.remote.endpoint import job_token
from overlord.runtime.flow import Stopped
from overlord.store import connect

log = logging.getLogger("overlord.constructor")


def run_constructors(ctx) -> None:
    hosted = [dp for dp, host in enumerate(ctx.layout.constructor_of) if host == ctx.index]
    failures: list[tuple[int, BaseException]] = []
    bridges: dict[int, dict[int, Bridge]] = {dp: {} for dp in hosted}
    if ctx.job.multi_node:  # loaders on other nodes reach these constructors over Flight
        directory = Directory(ctx.r, ctx.keys, ctx.stop)
        token = job_token(ctx.job, r=ctx.r)
        bridges = {
            dp: {
                k: Bridge(ctx.job, ctx.r, ctx.keys, k, dp, directory, ctx.stop, token)
                for k in range(ctx.layout.loaders)
            }
            for dp in hosted
        }

    plans = SharedPlans(len(hosted))  # every group builds every step: its plan read once for all

    def superseded() -> None:
        # the placement moves a host's groups together: one taken over, all of them were
        # (while this node was out of Redis's reach); the sidecar starts a new host if
        # the unit is placed here again
        ctx.superseded = True
        ctx.stop.set()

    def one(dp: int) -> None:
        try:
            # a Redis client of its own: blocking reads of one must not delay another
            r = connect(
                ctx.redis_url, ride_through_s=ctx.job.redis_outage_s, name=f"constructor{ctx.index}.dp{dp}", known=True
            )
            DataConstructor(
                ctx.job,
                ctx.layout,
                dp,
                r,
                ctx.keys,
                ctx.stop,
                ctx.beat,
                restarted=ctx.attempt > 0,
                bridges=bridges[dp],
                plans=plans,
                on_superseded=superseded,
            ).run()
        except Stopped:
            pass
        except Superseded as exc:
            log.warning("%s; this host stops", exc)
            superseded()
        except BaseException as exc:  # noqa: BLE001 - reported below with its DP group
            failures.append((dp, exc))
            ctx.stop.set()

    threads = [threading.Thread(target=one, args=(dp,), name=f"constructor-{dp}", daemon=True) for dp in hosted]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        dp, exc = failures[0]
        raise OverlordError(f"DataConstructor dp={dp}: {type(exc).__name__}: {exc}") from exc
