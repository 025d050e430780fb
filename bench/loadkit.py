"""Machinery the loader benchmarks share (bench/memory.py, bench/peers.py).

- Trainer processes: `Trainer` spawns ``python <script> --trainer <json>`` in its own
  session (so a kill takes its DataLoader workers too) and reads the JSON events it
  prints; `emit` and `command` are the trainer's side of that protocol (events on stdout,
  commands such as ``go``/``stop`` on stdin, every wait bounded).
- The colocated status quo: `colocated_dataset` is the ``IterableDataset`` in which every
  DataLoader worker opens every source and keeps a per-source shuffle buffer
  (`SourceReader`); `pad_collate` pads token ids and concatenates image patches.
- Measurement from ``/proc``: `pss_snapshot` (the PSS of trainers and of everything under
  them), `cpu_seconds` (user + system CPU of a set of processes).

Nothing here imports torch at module level: the harness side never needs it.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from overlord.procmem import pss_bytes, pss_of, tree_pids

MIB = 1 << 20
_TICKS = os.sysconf("SC_CLK_TCK")

# Trainer side: runs in the spawned trainer processes and their DataLoader workers.


class SourceReader:
    """One source as one worker sees it: every file open, a bounded shuffle buffer.

    Workers shard by (rank, worker): by row group when the source has at least as many
    row groups as there are shards, else by row (every worker reads each row group and
    keeps its rows; that is what streaming loaders do when shards do not divide).
    """

    def __init__(self, files: Sequence[str], shard: int, n_shards: int, window: int, rng: np.random.Generator):
        self._rng, self._window = rng, window
        import pyarrow.parquet as pq  # deferred: an Overlord trainer (same scripts) never reads a file

        self._files = [pq.ParquetFile(f) for f in files]  # the per-worker file state
        units, first = [], 0  # (file, row group, index of its first row in the source)
        for fi, pf in enumerate(self._files):
            for rg in range(pf.metadata.num_row_groups):
                units.append((fi, rg, first))
                first += pf.metadata.row_group(rg).num_rows
        self._stride = None if len(units) >= n_shards else (shard, n_shards)
        self._units = units if self._stride else units[shard::n_shards]
        self.rows = (
            max(0, -(-(first - shard) // n_shards))
            if self._stride
            else sum(self._files[fi].metadata.row_group(rg).num_rows for fi, rg, _ in self._units)
        )
        self._order: list = []
        self._buf: list = []

    def _read(self, unit) -> None:
        fi, rg, first = unit
        table = self._files[fi].read_row_group(rg)
        if self._stride:
            shard, n = self._stride
            table = table.take(np.arange((shard - first) % n, table.num_rows, n))
        self._buf.extend(table.to_pylist())

    def next_row(self) -> dict:
        while len(self._buf) < self._window:
            if not self._order:
                if self._buf:
                    break  # epoch's units all read: drain the buffer before the next one
                self._order = [self._units[i] for i in self._rng.permutation(len(self._units))]
            self._read(self._order.pop())
        i = int(self._rng.integers(len(self._buf)))
        self._buf[i], self._buf[-1] = self._buf[-1], self._buf[i]
        return self._buf.pop()


def colocated_dataset(
    files: Sequence[Sequence[str]],
    transforms: Sequence[Callable[[dict], dict]],
    *,
    rank: int,
    ranks: int,
    window: int,
    seed: int,
):
    """The colocated baseline's ``IterableDataset``: one dataset over all sources per rank.

    Every worker opens every source (`SourceReader`), picks sources uniformly among those
    with rows for its shard with its own RNG, and applies the source's transform. Each
    sample carries ``_worker`` (the worker id) and ``_touched`` (sources the worker has
    read so far) so a trainer can tell when every worker has reached steady state.

    Args:
        files: Each source's Parquet files, in source order.
        transforms: Each source's transform (built before the workers fork).
        rank: This trainer's rank.
        ranks: Trainer processes.
        window: Rows in each per-source shuffle buffer.
        seed: RNG seed of source picks and shuffles.
    """
    # deferred: the harness side never imports torch; only trainers build the dataset
    import torch.utils.data as tud

    class ColocatedDataset(tud.IterableDataset):
        def __iter__(self):
            info = tud.get_worker_info()
            wid, workers = (info.id, info.num_workers) if info else (0, 1)
            shard, n_shards = rank * workers + wid, ranks * workers
            rng = np.random.default_rng([seed, shard])
            readers = [SourceReader(f, shard, n_shards, window, rng) for f in files]
            weights = np.array([1.0 if r.rows else 0.0 for r in readers])
            if not weights.any():
                raise ValueError(f"shard {shard} of {n_shards} has no rows in any source")
            weights /= weights.sum()
            touched = weights == 0  # a source with no rows for this shard is done
            while True:
                for k in rng.choice(len(readers), size=1024, p=weights).tolist():
                    sample = transforms[k](readers[k].next_row())
                    touched[k] = True
                    sample["_worker"], sample["_touched"] = wid, int(touched.sum())
                    yield sample

    return ColocatedDataset()


def pad_collate(samples: list[dict]) -> dict:
    """Pads input_ids to the longest in the batch; concatenates image patches."""
    # deferred: the harness side never imports torch; only trainers collate
    import torch

    lengths = np.array([len(s["input_ids"]) for s in samples], dtype=np.int64)
    ids = np.zeros((len(samples), int(lengths.max())), dtype=np.int32)
    for row, s in enumerate(samples):
        ids[row, : len(s["input_ids"])] = s["input_ids"]
    batch = {"input_ids": torch.from_numpy(ids), "lengths": torch.from_numpy(lengths)}
    images = [s for s in samples if "pixel_values" in s]
    if images:
        for key in ("pixel_values", "image_grid"):
            batch[key] = torch.from_numpy(np.concatenate([s[key] for s in images]))
    if "_worker" in samples[-1]:
        batch["_worker"] = samples[-1]["_worker"]
        batch["_touched"] = max(s["_touched"] for s in samples)
    return batch


def emit(event: str, **fields) -> None:
    """Prints one JSON event line for the harness."""
    print(json.dumps({"event": event, **fields}), flush=True)


_stdin_pending = b""


def command(timeout: float) -> str:
    """Next line from the harness, read from fd 0 unbuffered so select() sees every line.

    Raises:
        TimeoutError: No line within `timeout` seconds.
        SystemExit: The harness closed stdin.
    """
    global _stdin_pending
    deadline = time.monotonic() + timeout
    while b"\n" not in _stdin_pending:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([0], [], [], left)[0]:
            raise TimeoutError(f"trainer waited {timeout:.0f} s for the harness")
        data = os.read(0, 4096)
        if not data:
            raise SystemExit("harness closed stdin")
        _stdin_pending += data
    line, _stdin_pending = _stdin_pending.split(b"\n", 1)
    return line.decode().strip()


# Harness side.


class Trainer:
    """A spawned trainer process (``python script --trainer <cfg>``) and the JSON events it prints."""

    def __init__(self, script: str, rank: int, cfg: dict, env: dict | None = None):
        self.rank = rank
        self.spawned = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, script, "--trainer", json.dumps({**cfg, "rank": rank})],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,
            env=env,
        )
        self._pending = b""
        self.seen: dict[str, dict] = {}  # the last event of each kind

    def send(self, line: str) -> None:
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def events(self) -> list[dict]:
        """Reads what is available (call when select says so); EOF is an error."""
        data = os.read(self.proc.stdout.fileno(), 1 << 16)
        if not data:
            rc = self.proc.wait(timeout=10)
            raise RuntimeError(f"trainer rank {self.rank} exited (rc={rc}); see its stderr above")
        *lines, self._pending = (self._pending + data).split(b"\n")
        return [json.loads(line) for line in lines if line.startswith(b"{")]

    def kill(self) -> None:
        """SIGTERM then SIGKILL the trainer's process group (it and its workers).

        The group is signalled even when the trainer has exited: a loader's workers can
        outlive their trainer (LitData's did, after its clean exit).
        """
        for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break  # nobody left in the group
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline:
                if self.proc.poll() is not None and not _group_alive(self.proc.pid):
                    break
                time.sleep(0.05)
            else:
                continue
            break
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:  # a write to a dead trainer's stdin was still buffered
                pass


def _group_alive(pgid: int) -> bool:
    """Whether any process is left in process group `pgid`."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def await_event(trainers: Sequence[Trainer], event: str, deadline: float, tick=None) -> dict[int, dict]:
    """Waits until every trainer printed ``event``; calls ``tick()`` about once a second.

    Events other than ``event`` that arrive meanwhile are kept in each trainer's
    ``seen`` dict (the last of each kind), so a quick trainer's earlier events are not lost.

    Raises:
        TimeoutError: ``deadline`` (monotonic) passed first.
        RuntimeError: A trainer exited.
    """
    got: dict[int, dict] = {}
    for t in trainers:
        if event in t.seen:
            got[t.rank] = t.seen[event]
    by_fd = {t.proc.stdout.fileno(): t for t in trainers}
    next_tick = time.monotonic()
    while len(got) < len(trainers):
        left = deadline - time.monotonic()
        if left <= 0:
            missing = sorted(t.rank for t in trainers if t.rank not in got)
            raise TimeoutError(f"ranks {missing} did not report {event!r} in time")
        wait = min(left, 1.0, max(next_tick - time.monotonic(), 0.0)) if tick else min(left, 1.0)
        ready, _, _ = select.select(list(by_fd), [], [], wait)
        for fd in ready:
            trainer = by_fd[fd]
            for ev in trainer.events():
                trainer.seen[ev.get("event")] = ev
                if ev.get("event") == event:
                    got[trainer.rank] = ev
        if tick and time.monotonic() >= next_tick:
            tick()
            next_tick = time.monotonic() + 1.0
    return got


def pss_snapshot(trainers: Iterable[Trainer]) -> tuple[int, int, int]:
    """``(PSS of the trainers' descendants, PSS of the trainers, descendant count)`` in bytes."""
    workers = trainer = count = 0
    for t in trainers:
        kids = tree_pids(t.proc.pid)[1:]
        workers += pss_of(kids)
        trainer += pss_bytes(t.proc.pid)
        count += len(kids)
    return workers, trainer, count


def cpu_seconds(pids: Iterable[int]) -> float:
    """User + system CPU seconds of `pids` (``/proc/<pid>/stat``); gone processes count 0."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / _TICKS


__all__ = sorted(
    [
        "MIB",
        "SourceReader",
        "Trainer",
        "await_event",
        "colocated_dataset",
        "command",
        "cpu_seconds",
        "emit",
        "pad_collate",
        "pss_snapshot",
    ]
)
