"""The keyword arguments scripts pass to `torch.utils.data.DataLoader`, for the drop-in.

A script moved to `overlord.torch.DataLoader` often keeps its old call
(`DataLoader(ds, batch_size=8, shuffle=True, num_workers=4, pin_memory=True, ...)`).
Each of torch's arguments here does one of three things, never a bare TypeError:

    takes effect      pin_memory (a DataLoader argument of its own), timeout (-> timeout_s),
                      and arguments that agree with the job: batch_size equal to the job's
                      samples per micro-batch, drop_last equal to BatchSpec.drop_last,
                      shuffle=True when the sources shuffle, in_order=True, and the
                      values that mean "not used" (None, 0, False)
    refused           a dataset as the first argument, sampler, batch_sampler, collate_fn,
    (ConfigError)     worker_init_fn, and batch_size, drop_last or shuffle=True that
                      contradict the job: the job decides these, so a script that asks
                      for something else would silently get other batches
    warned, once      num_workers > 0, prefetch_factor, persistent_workers=True,
    per process       multiprocessing_context, generator, pin_memory_device, in_order=False,
                      shuffle=False while the sources shuffle: they tune torch's worker
                      processes, which the trainer no longer has (the sidecar's roles load)

Every message names the Job field to set instead.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from overlord.config import Job
from overlord.errors import ConfigError

# torch.utils.data.DataLoader's parameters after `dataset`, in its positional order
TORCH_ORDER = (
    "batch_size",
    "shuffle",
    "sampler",
    "batch_sampler",
    "num_workers",
    "collate_fn",
    "pin_memory",
    "drop_last",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
)
TORCH_KEYWORDS = frozenset(TORCH_ORDER) | {"prefetch_factor", "persistent_workers", "pin_memory_device", "in_order"}

_REFUSED = {
    "sampler": "the Planner chooses every rank's samples (Source.weight or Job.mixing, in an order fixed by "
    "Job.seed), and each rank already gets only its own micro-batches: drop sampler "
    "(no DistributedSampler either)",
    "batch_sampler": "micro-batches are built by the job: set BatchSpec.global_batch and BatchSpec.micro_batches, "
    "and drop batch_sampler",
    "collate_fn": "micro-batches are packed or padded by the Data Constructor (BatchSpec.packing, "
    "BatchSpec.context_length) and samples made by Source.transform: move collate_fn's work there",
    "worker_init_fn": "the trainer runs no loader workers; per-sample setup belongs in Source.transform, "
    "which runs in the Source Loaders",
}
_WARNED = {
    "num_workers": "the Source Loaders in the sidecar read and transform samples; their processes are "
    "Job.loader_processes (or Job.autoscale)",
    "prefetch_factor": "how far loading runs ahead is bounded by the client ring, BatchSpec.ring_bytes",
    "persistent_workers": "the sidecar's roles persist for the whole job already",
    "multiprocessing_context": "the trainer starts no loader worker processes",
    "generator": "the order of samples is a pure function of Job.seed (and the epoch and partition)",
    "pin_memory_device": "pin_memory=True pins for the current CUDA device",
    "in_order": "micro-batches always arrive in (step, micro-batch) order",
    "shuffle": "each source shuffles within Source.shuffle_window rows; set shuffle_window=1 on every source "
    "for file order",
}
_warned: set[str] = set()  # names warned about in this process


def _warn_once(name: str, value: Any) -> None:
    if name in _warned:
        return
    _warned.add(name)
    warnings.warn(f"overlord.torch.DataLoader ignores torch's {name}={value!r}: {_WARNED[name]}", stacklevel=4)


def refuse_dataset(job: Any) -> None:
    """A first argument that is not a Job or a config path: most likely a dataset."""
    if isinstance(job, (Job, str, os.PathLike)):
        return
    raise ConfigError(
        f"overlord.torch.DataLoader takes a Job (or the path of its YAML/JSON config) as its first argument, "
        f"not a {type(job).__module__}.{type(job).__qualname__}: describe the data as Job.sources (files and a "
        "Source.transform) and pass the job"
    )


def positional(args: tuple[Any, ...]) -> dict[str, Any]:
    """torch's positional arguments after the dataset, as keywords."""
    if len(args) > len(TORCH_ORDER):
        raise ConfigError(
            f"overlord.torch.DataLoader got {len(args) + 1} positional arguments; torch's DataLoader "
            f"takes at most {len(TORCH_ORDER) + 1}: pass the job, then keywords"
        )
    return dict(zip(TORCH_ORDER, args))


def samples_per_micro_batch(job: Job) -> int:
    """What a micro-batch holds on average: global_batch / (DP groups x micro_batches)."""
    return job.batch.global_batch // (job.mesh.dp * job.batch.micro_batches)


def apply(job: Job, torch_kwargs: dict[str, Any], *, timeout_s: float | None) -> float | None:
    """Check torch's keyword arguments against the job; warn once about ignored ones.

    Args:
        job: the job the DataLoader serves.
        torch_kwargs: the keyword arguments the DataLoader did not take itself.
        timeout_s: the DataLoader's own timeout_s argument.

    Returns:
        The timeout_s to use (torch's `timeout` when given and > 0).

    Raises:
        ConfigError: an argument contradicts the job, cannot take effect, or is unknown.
    """
    unknown = sorted(set(torch_kwargs) - TORCH_KEYWORDS)
    if unknown:
        raise ConfigError(
            f"overlord.torch.DataLoader got unexpected keyword argument(s) {unknown}; it takes job, rank, world_size, "
            "timeout_s, copy, pin_memory, spawn_sidecar, remote, and ignores or checks torch's "
            f"{sorted(TORCH_KEYWORDS)}"
        )
    for name, value in torch_kwargs.items():
        if name in _REFUSED and value is not None:
            raise ConfigError(f"overlord.torch.DataLoader cannot take torch's {name}={value!r}: {_REFUSED[name]}")
    bs = torch_kwargs.get("batch_size")
    if bs is not None and bs != samples_per_micro_batch(job):
        mesh, b = job.mesh, job.batch
        raise ConfigError(
            f"batch_size={bs!r} but job {job.name!r} gives each rank micro-batches of "
            f"BatchSpec.global_batch={b.global_batch} / (dp={mesh.dp} x micro_batches={b.micro_batches}) = "
            f"{samples_per_micro_batch(job)} samples; set BatchSpec.global_batch="
            f"{bs * mesh.dp * b.micro_batches if isinstance(bs, int) else 'N x dp x micro_batches'} "
            "(or BatchSpec.micro_batches), or drop batch_size"
        )
    drop_last = torch_kwargs.get("drop_last")
    if drop_last is not None and bool(drop_last) != job.batch.drop_last:
        raise ConfigError(
            f"drop_last={drop_last!r} but job {job.name!r} has BatchSpec.drop_last={job.batch.drop_last}; "
            f"set BatchSpec.drop_last={bool(drop_last)} in the job (it decides the last step for every rank), "
            "or drop the argument"
        )
    shuffle = torch_kwargs.get("shuffle")
    shuffling = any(s.shuffle_window > 1 for s in job.sources)
    if shuffle and not shuffling:
        raise ConfigError(
            f"shuffle=True but no source of job {job.name!r} shuffles (every Source.shuffle_window "
            "<= 1); set Source.shuffle_window (rows shuffled together) on the sources"
        )
    if shuffle is not None and not shuffle and shuffling:
        _warn_once("shuffle", shuffle)
    quiet = {
        "num_workers": 0,
        "prefetch_factor": None,
        "persistent_workers": False,
        "multiprocessing_context": None,
        "generator": None,
        "pin_memory_device": "",
        "in_order": True,
    }
    for name, default in quiet.items():
        value = torch_kwargs.get(name, default)
        if value is not None and value != default:
            _warn_once(name, value)
    timeout = torch_kwargs.get("timeout")
    if timeout:
        if timeout_s is not None and float(timeout) != float(timeout_s):
            raise ConfigError(f"timeout={timeout!r} and timeout_s={timeout_s!r} disagree; pass one (timeout_s)")
        return float(timeout)
    return timeout_s
