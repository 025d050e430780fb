"""The job-wide loader state and the length of a finite job (overlord.torch.state), and
the DataLoader's state calls that need no sidecar: load before the first batch in any
order, the last state wins, a state at the end gives an empty loader."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from overlord.config import BatchSpec, Job, Mesh, Source
from overlord.errors import ConfigError
from overlord.torch import DataLoader
from overlord.torch import state as states


@pytest.fixture
def files(tmp_path):
    """Two sources of 100 and 61 rows (Parquet, several row groups)."""
    out = {}
    for name, n in (("web", 100), ("code", 61)):
        path = tmp_path / f"{name}.parquet"
        pq.write_table(pa.table({"text": [f"{name} {i}" for i in range(n)]}), path, row_group_size=16)
        out[name] = str(path)
    return out


def job_of(files, tmp_path, **kw):
    args = dict(
        name="st",
        sources=tuple(Source(name=n, paths=(p,)) for n, p in files.items()),
        mesh=Mesh(dp=2),
        batch=BatchSpec(global_batch=16, micro_batches=2),
        run_dir=str(tmp_path / "run"),
        epochs=1,
    )
    args.update(kw)
    return Job(**args)


def loader(job, rank=0):
    return DataLoader(job, rank=rank, world_size=job.mesh.world_size, spawn_sidecar=False)


def test_state_of_one_rank_resumes_every_rank(files, tmp_path):
    job = job_of(files, tmp_path)
    saved = states.make(job, 0, states.Position(5, 1, 12))
    assert saved["batches"] == 12 and saved["world_size"] == 2 and saved["format"] == 2
    for rank in (0, 1):
        got = states.load(job, rank, saved)
        assert (got.last, got.batches) == ((5, 1), 12)
        assert got.next(2) == (6, 0)


def test_per_rank_states_of_the_first_format_still_load(files, tmp_path):
    job = job_of(files, tmp_path)
    old = {"job": "st", "rank": 0, "batches": 11, "step": 5, "microbatch": 0, "mesh": [2, 1, 1, 1], "micro_batches": 2}
    for rank in (0, 1):  # Lightning kept rank 0's: it resumes rank 1 too
        assert states.load(job, rank, old).next(2) == (5, 1)


def test_merge_keeps_ranks_at_other_positions_exact(files, tmp_path):
    job = job_of(files, tmp_path)
    merged = states.merge(
        [states.make(job, 0, states.Position(5, 0, 11)), states.make(job, 1, states.Position(5, 1, 12))]
    )
    assert states.load(job, 0, merged).last == (5, 0)
    assert states.load(job, 1, merged).last == (5, 1)


def test_other_job_or_a_mid_step_state_of_another_mesh_is_refused(files, tmp_path):
    job = job_of(files, tmp_path)
    with pytest.raises(ConfigError, match="the state is of job 'other', not 'st'"):
        states.load(job, 0, {"job": "other", "step": 1, "microbatch": 0, "batches": 3})
    narrow = {
        "job": "st",
        "rank": 1,
        "batches": 3,
        "step": 1,
        "microbatch": 0,
        "mesh": [4, 1, 1, 1],
        "micro_batches": 2,
    }
    with pytest.raises(ConfigError, match="needs a state taken at a step boundary"):
        states.load(job, 0, narrow)
    assert states.load(job, 0, {**narrow, "microbatch": 1}).next(2) == (2, 0)


@pytest.mark.parametrize(
    "drop_last, epochs, steps",
    [
        (False, 1, 10),  # 161 samples = 10 x 16 + 1; 1 < dp x micro_batches = 4: dropped
        (True, 1, 10),
        (False, 5, 51),  # 805 = 50 x 16 + 5: a partial step that gives each of the 4 micro-batches one
        (True, 5, 50),
    ],
)
def test_length_counts_the_steps_of_a_finite_job(files, tmp_path, drop_last, epochs, steps):
    job = job_of(files, tmp_path, epochs=epochs, batch=BatchSpec(global_batch=16, micro_batches=2, drop_last=drop_last))
    assert states.length(job) == steps * 2


def test_length_keeps_a_partial_step_that_fills_every_micro_batch(files, tmp_path):
    job = job_of(files, tmp_path, batch=BatchSpec(global_batch=32, micro_batches=2))  # 161 = 5 x 32 + 1
    assert states.length(job, {"web": 100, "code": 68}) == 6 * 2  # 168 = 5 x 32 + 8 >= 4: kept
    assert states.length(job, {"web": 100, "code": 62}) == 5 * 2  # 162 = 5 x 32 + 2: dropped


def test_jobs_without_a_known_length_raise_type_error(files, tmp_path):
    with pytest.raises(TypeError, match="runs forever"):
        states.length(job_of(files, tmp_path, epochs=None))
    with pytest.raises(TypeError, match="Job.mixing"):
        states.length(job_of(files, tmp_path, mixing={"kind": "dynamic"}))


def test_len_is_the_whole_job_and_remaining_what_this_rank_still_gets(files, tmp_path):
    job = job_of(files, tmp_path)  # 10 steps x 2 micro-batches (161 samples)
    lo = loader(job, rank=1)
    assert (len(lo), lo.remaining) == (20, 20)
    lo.load_state_dict(states.make(job, 0, states.Position(3, 1, 8)))  # rank 0's state, rank 1 loads it
    assert (len(lo), lo.remaining) == (20, 12)  # len() as torch's: the epoch's, not shrunk by a resume
    with pytest.raises(TypeError, match="runs forever"):
        len(loader(job_of(files, tmp_path, epochs=None)))


def test_iter_then_load_any_number_of_times_and_the_last_wins(files, tmp_path):
    job = job_of(files, tmp_path)
    lo = loader(job)
    assert iter(lo) is lo  # attaches nothing yet: Lightning checks iterability first
    lo.load_state_dict(states.make(job, 0, states.Position(7, 1, 16)))
    lo.load_state_dict(states.make(job, 0, states.Position(2, 0, 5)))
    assert lo.state_dict()["batches"] == 5 and lo._sidecar.resume_at == (2, 1) and lo.remaining == 15
    lo.load_state_dict(states.make(job, 0, states.Position()))  # a fresh start's state
    assert lo._sidecar.resume_at is None and lo.remaining == 20


def test_a_state_after_the_last_batch_ends_at_once(files, tmp_path):
    job = job_of(files, tmp_path)
    lo = loader(job)
    lo.load_state_dict(states.make(job, 0, states.Position(9, 1, 20, end=True)))
    assert len(lo) == 0 and lo.remaining == 0
    assert list(lo) == []  # no sidecar runs, none is spawned, nothing waited for
    assert lo.state_dict()["end"] is True and lo.state_dict()["batches"] == 20


def test_a_file_len_cannot_count_is_named(files, tmp_path):
    from overlord.errors import SourceReadError

    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet at all")
    job = job_of({**files, "broken": str(bad)}, tmp_path)
    with pytest.raises(SourceReadError, match=r"source 'broken' file '.*bad.parquet' for len\(\)"):
        states.length(job)
