"""Where a trainer's rank and world size come from: wherever its launcher put them.

Launchers disagree on what they set:

    torchrun, Accelerate, DeepSpeed   RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE
    Lightning's own DDP launcher      LOCAL_RANK, WORLD_SIZE, NODE_RANK (its children; no RANK)
    SLURM via Lightning               SLURM_PROCID ... (Lightning sets the process group)
    any of them, once DDP is up       torch.distributed.get_rank() / get_world_size()

so the rank is read, in this order of trust:

1. explicit arguments (`DataLoader(rank=..., world_size=...)`) override everything;
2. an initialized `torch.distributed` process group;
3. RANK (with WORLD_SIZE);
4. NODE_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK; on one node, LOCAL_RANK alone (with
   WORLD_SIZE, as Lightning's launcher sets them: LOCAL_RANK=1 WORLD_SIZE=2 is rank 1);
5. rank 0 of the job's mesh.

Every source that is present is checked against the one used: a process group and
RANK that disagree, or RANK and NODE_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK, raise
ConfigError naming the variables and their values (two ranks that silently read the
same ring would train on the same batches). Explicit arguments are not checked: they
are how a script says "I know better".
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch.distributed as dist

from overlord.config import Job
from overlord.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Launch:
    """This process's rank and world size, and where they were read (for messages)."""

    rank: int
    world_size: int | None  # None: nothing said; the job's mesh decides
    how: str  # e.g. "RANK=1 WORLD_SIZE=2", "torch.distributed", "argument rank=1"


def _int(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name)
    if value is None or value.strip() == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"${name}={value!r} is not an integer; the launcher set it wrong or unset it") from None


def _said(env: Mapping[str, str], *names: str) -> str:
    return " ".join(f"{n}={env[n]}" for n in names if env.get(n, "").strip() != "")


def _from_local(env: Mapping[str, str]) -> tuple[int | None, str]:
    """The rank LOCAL_RANK (with NODE_RANK, LOCAL_WORLD_SIZE) makes, or None where they
    cannot say (a node other than the first without LOCAL_WORLD_SIZE; several nodes
    without NODE_RANK); and the variables it read."""
    local, local_world, node = _int(env, "LOCAL_RANK"), _int(env, "LOCAL_WORLD_SIZE"), _int(env, "NODE_RANK")
    world = _int(env, "WORLD_SIZE")
    how = _said(env, "NODE_RANK", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "WORLD_SIZE")
    if local is None:
        return None, how
    if local_world is not None and not 0 <= local < local_world:
        raise ConfigError(
            f"LOCAL_RANK={local} is not below LOCAL_WORLD_SIZE={local_world}; the launcher set them wrong"
        )
    if node is not None and local_world is not None:
        return node * local_world + local, how
    one_node = node == 0 or (node is None and (local_world is None or world is None or local_world >= world))
    return (local, how) if one_node else (None, how)


def _from_env(env: Mapping[str, str]) -> Launch | None:
    """The rank the environment names, or None; raises when its variables disagree."""
    rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    derived, how = _from_local(env)
    if rank is not None:
        if derived is not None and derived != rank:
            raise ConfigError(
                f"the launcher's variables disagree on this process's rank: RANK={rank} but {how} "
                f"makes rank {derived}; fix the launch (or pass DataLoader(rank=...))"
            )
        return Launch(rank, world, _said(env, "RANK", "WORLD_SIZE"))
    if derived is not None:
        return Launch(derived, world, how)
    if _int(env, "LOCAL_RANK") is not None:
        raise ConfigError(
            f"cannot tell this process's rank from {how}: on several nodes LOCAL_RANK needs NODE_RANK and "
            "LOCAL_WORLD_SIZE, or RANK; set them, or pass DataLoader(rank=..., world_size=...)"
        )
    return None


def _from_process_group() -> Launch | None:
    if dist.is_available() and dist.is_initialized():
        return Launch(dist.get_rank(), dist.get_world_size(), "torch.distributed (the initialized process group)")
    return None


def detect(
    rank: int | None = None,
    world_size: int | None = None,
    *,
    env: Mapping[str, str] | None = None,
    group: Launch | None | bool = True,
) -> Launch:
    """This process's rank and world size (see the module docstring for the order).

    Args:
        rank, world_size: explicit values; each overrides what was detected.
        env: the environment to read (default: os.environ).
        group: the process group's answer; True reads torch.distributed (tests pass one).

    Raises:
        ConfigError: the sources that are present disagree, or a value is not an integer.
    """
    env = os.environ if env is None else env
    from_group = _from_process_group() if group is True else (group or None)
    from_env = _from_env(env)
    if from_group is not None and from_env is not None:
        if from_group.rank != from_env.rank or (
            from_env.world_size is not None and from_env.world_size != from_group.world_size
        ):
            raise ConfigError(
                f"torch.distributed says rank {from_group.rank} of {from_group.world_size} but the environment says "
                f"rank {from_env.rank} of {from_env.world_size} ({from_env.how}); the process group was set up "
                "with other values than the launcher's: fix one (or pass DataLoader(rank=..., world_size=...))"
            )
    found = from_group or from_env or Launch(0, None, "default (no launcher variables, no process group)")
    if rank is None and world_size is None:
        return found
    how = " ".join(f"argument {n}={v}" for n, v in (("rank", rank), ("world_size", world_size)) if v is not None)
    return Launch(
        found.rank if rank is None else int(rank),
        found.world_size if world_size is None else int(world_size),
        how if rank is not None else f"{how}, rank from {found.how}",
    )


def check_world(job: Job, launch: Launch) -> None:
    """The launcher's world size against the job's mesh.

    Raises:
        ConfigError: they differ.
    """
    world_size, how = launch.world_size, launch.how
    if world_size is not None and world_size != job.mesh.world_size:
        m = job.mesh
        raise ConfigError(
            f"the launcher's world size is {world_size} ({how}) but job {job.name!r} has a mesh of "
            f"dp={m.dp} x pp={m.pp} x cp={m.cp} x tp={m.tp} = {m.world_size} ranks; set Job.mesh to match the launch"
        )
