"""Rank and world from where launchers put them (overlord.torch.launch)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from overlord.config import Job, Mesh, Source
from overlord.errors import ConfigError
from overlord.torch.launch import Launch, check_world, detect


def rank_of(env, **kw):
    return detect(env=env, group=None, **kw).rank


def test_torchrun_sets_rank_and_world():
    got = detect(env={"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, group=None)
    assert (got.rank, got.world_size) == (3, 4)
    assert "RANK=3" in got.how


def test_lightning_launcher_sets_local_rank_and_world_only():
    # Lightning's _SubprocessScriptLauncher: the child has LOCAL_RANK=1 WORLD_SIZE=2 and no RANK
    got = detect(env={"LOCAL_RANK": "1", "WORLD_SIZE": "2"}, group=None)
    assert (got.rank, got.world_size) == (1, 2)
    assert rank_of({"LOCAL_RANK": "1", "WORLD_SIZE": "2", "NODE_RANK": "0"}) == 1


def test_node_rank_times_local_world_plus_local_rank():
    assert rank_of({"NODE_RANK": "2", "LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "3", "WORLD_SIZE": "16"}) == 11


def test_nothing_set_is_rank_zero_of_the_mesh():
    got = detect(env={}, group=None)
    assert (got.rank, got.world_size) == (0, None)


def test_process_group_comes_first_and_must_agree_with_the_environment():
    group = Launch(1, 2, "torch.distributed")
    assert detect(env={}, group=group).rank == 1
    assert detect(env={"RANK": "1", "WORLD_SIZE": "2"}, group=group).rank == 1
    with pytest.raises(ConfigError, match=r"torch.distributed says rank 1 of 2 .* rank 0 of 2 \(RANK=0 WORLD_SIZE=2\)"):
        detect(env={"RANK": "0", "WORLD_SIZE": "2"}, group=group)


def test_disagreeing_variables_are_named():
    env = {"RANK": "5", "NODE_RANK": "1", "LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "2", "WORLD_SIZE": "8"}
    with pytest.raises(ConfigError, match=r"RANK=5 but NODE_RANK=1 LOCAL_WORLD_SIZE=4 LOCAL_RANK=2 .* makes rank 6"):
        detect(env=env, group=None)
    with pytest.raises(ConfigError, match="LOCAL_RANK=4 is not below LOCAL_WORLD_SIZE=4"):
        detect(env={"LOCAL_RANK": "4", "LOCAL_WORLD_SIZE": "4"}, group=None)
    with pytest.raises(ConfigError, match=r"\$RANK='one' is not an integer"):
        detect(env={"RANK": "one"}, group=None)


def test_a_second_node_without_its_layout_is_refused():
    with pytest.raises(ConfigError, match="NODE_RANK and LOCAL_WORLD_SIZE, or RANK"):
        detect(env={"NODE_RANK": "1", "LOCAL_RANK": "0", "WORLD_SIZE": "4"}, group=None)


def test_explicit_arguments_override_everything():
    got = detect(3, 4, env={"RANK": "0", "WORLD_SIZE": "2"}, group=Launch(0, 2, "torch.distributed"))
    assert (got.rank, got.world_size) == (3, 4)
    assert got.how == "argument rank=3 argument world_size=4"


def test_world_must_match_the_mesh(tmp_path):
    job = Job(name="j", sources=(Source(name="s", paths=(str(tmp_path / "x.parquet"),)),), mesh=Mesh(dp=2))
    check_world(job, Launch(1, 2, "RANK=1 WORLD_SIZE=2"))
    with pytest.raises(ConfigError, match=r"world size is 3 \(RANK=1 WORLD_SIZE=3\) .* = 2 ranks; set Job.mesh"):
        check_world(job, Launch(1, 3, "RANK=1 WORLD_SIZE=3"))


def test_a_real_process_group_is_read_first(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        got = detect(env={})
        assert (got.rank, got.world_size, got.how) == (0, 1, "torch.distributed (the initialized process group)")
        with pytest.raises(ConfigError, match=r"torch.distributed says rank 0 of 1 .* rank 1 of 2"):
            detect(env={"LOCAL_RANK": "1", "WORLD_SIZE": "2"})
    finally:
        dist.destroy_process_group()
