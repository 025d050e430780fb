"""`overlord handoff` and `overlord reshard`: ask the job's Planner for a live change.

A request is one HSET (of the `handoff` or the `reshard` hash); the Planner takes it at
its next step boundary (handoff.py, reshard.py) and logs the outcome in the `handoffs`
or `reshards` stream, which this waits on (bounded) to say what happened.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import redis

from overlord.store import Keys
from overlord.store.schema import log_entries, planner_done


def request_handoff(r: redis.Redis, keys: Keys, stream: str, loader: int, timeout_s: float) -> tuple[int, str]:
    """Request it and wait for the Planner's answer.

    Returns:
        (exit code, message): 0 taken (the step it takes effect at, or served there
        already), 1 refused (why, or the job planned its last step: nothing is asked),
        2 no answer within `timeout_s` (the request stays: the Planner takes it when it
        next plans) or the request vanished unanswered.
    """

    def answer(entry: dict[str, str]) -> tuple[int, str] | None:
        if entry["stream"] != stream:
            return None
        if entry["to"] == "-1":
            return 1, f"handoff of {stream} refused: {entry['reason'].removeprefix('refused: ')}"
        return 0, f"stream {stream}: loader process {entry['from']} -> {entry['to']} from step {entry['step']}"

    return _request(r, keys, keys.handoff, stream, str(loader), keys.handoffs, timeout_s, answer)


def request_reshard(
    r: redis.Redis, keys: Keys, source: str, partitions: int, timeout_s: float, at_step: int | None = None
) -> tuple[int, str]:
    """Ask for `source` to be read by `partitions` streams (from `at_step` on, or the next
    step boundary: a run that gives each reshard its step plans the same) and wait for
    the Planner's answer.

    Returns:
        (exit code, message) as `request_handoff`.
    """

    def answer(entry: dict[str, str]) -> tuple[int, str] | None:
        if entry["source"] != source or entry["reason"].startswith("autoscaler:"):  # not this request's
            return None
        if entry["to"] == "-1":
            return 1, f"reshard of {source} refused: {entry['reason'].removeprefix('refused: ')}"
        if not entry["streams"]:
            return 0, f"source {source}: read by {entry['to']} stream(s) already"
        return (
            0,
            f"source {source}: {entry['from']} -> {entry['to']} streams from step {entry['step']} ({entry['streams']})",
        )

    value = str(partitions) if at_step is None else f"{partitions}@{at_step}"
    return _request(r, keys, keys.reshard, source, value, keys.reshards, timeout_s, answer)


def _request(
    r: redis.Redis,
    keys: Keys,
    requests: str,
    field: str,
    value: str,
    log: str,
    timeout_s: float,
    answer: Callable[[dict[str, str]], tuple[int, str] | None],
) -> tuple[int, str]:
    """HSET `field` of the `requests` hash and wait for the entry of the `log` stream that
    `answer` takes for its answer (see `request_handoff` for what it returns); nothing
    once the job planned its last step (no Planner would take it)."""
    if planner_done(r, keys):
        return 1, (
            f"job {keys.job!r} planned its last step: no Planner takes requests any more (`overlord status` "
            "says so); make it while the job runs"
        )
    last = r.xrevrange(log, count=1)
    after = last[0][0] if last else b"0-0"
    r.hset(requests, field, value)
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        # the Planner logs and deletes a request in one write: once it is gone, what the
        # log holds after `after` is the whole answer
        taken = r.hget(requests, field) is None
        reply = r.xread({log: after}, block=None if taken else max(1, int(min(left, 1.0) * 1000)), count=1000)
        for _, entries in reply or []:
            after = entries[-1][0]
            for entry in log_entries(entries):
                if (said := answer(entry)) is not None:
                    return said
        if taken:  # gone without an answer: a job starting afresh clears its keys
            return 2, "the request was removed unanswered (the job started afresh?); request it again"
    return 2, _unanswered(requests, timeout_s)


def _unanswered(key: str, timeout_s: float) -> str:
    return (
        f"no answer from the Planner in {timeout_s:g}s (is the job running? `overlord status`); the request "
        f"stays in {key} and is taken at the Planner's next step"
    )
