"""torch.utils.data.DataLoader's keyword arguments, given to the drop-in (overlord.torch.compat
and DataLoader.__init__): each takes effect, is refused naming the Job field, or is
warned about once; never a bare TypeError. No sidecar starts: nothing is iterated."""

from __future__ import annotations

import warnings

import pytest

from overlord.config import BatchSpec, Job, Mesh, Source
from overlord.errors import ConfigError
from overlord.torch import DataLoader, compat


@pytest.fixture
def job(tmp_path):
    return Job(
        name="compat",
        sources=(Source(name="web", paths=(str(tmp_path / "web.parquet"),), shuffle_window=64),),
        mesh=Mesh(dp=2),
        batch=BatchSpec(global_batch=16, micro_batches=2),
        run_dir=str(tmp_path / "run"),
    )


def make(job, *args, **kwargs):
    return DataLoader(job, *args, rank=0, world_size=2, spawn_sidecar=False, **kwargs)


def test_arguments_that_agree_with_the_job_take_effect(job):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # none of these warns
        loader = make(
            job,
            batch_size=4,
            shuffle=True,
            drop_last=False,
            num_workers=0,
            pin_memory=False,
            timeout=7,
            sampler=None,
            collate_fn=None,
            persistent_workers=False,
            in_order=True,
        )
    assert loader.timeout_s == 7.0
    assert make(job, None, True).timeout_s == job.timeout_s  # torch's positional batch_size, shuffle


@pytest.mark.parametrize(
    "name, value, field",
    [
        ("batch_size", 8, "BatchSpec.global_batch=32"),
        ("drop_last", True, "BatchSpec.drop_last=True"),
        ("sampler", object(), "Source.weight or Job.mixing"),
        ("batch_sampler", [[0, 1]], "BatchSpec.micro_batches"),
        ("collate_fn", lambda xs: xs, "BatchSpec.packing"),
        ("worker_init_fn", lambda w: None, "Source.transform"),
    ],
)
def test_arguments_that_contradict_or_cannot_take_effect_are_refused(job, name, value, field):
    with pytest.raises(ConfigError, match=f"{name}=.*{field.replace('.', '[.]')}"):
        make(job, **{name: value})


def test_shuffle_when_no_source_shuffles_is_refused(tmp_path):
    job = Job(name="c", sources=(Source(name="s", paths=("x.parquet",), shuffle_window=1),))
    with pytest.raises(ConfigError, match="shuffle=True but no source .* set Source.shuffle_window"):
        DataLoader(job, shuffle=True, rank=0, world_size=1, spawn_sidecar=False)


def test_tuning_of_torch_workers_is_warned_about_once(job):
    compat._warned.clear()
    with pytest.warns(UserWarning) as got:
        make(
            job,
            num_workers=8,
            prefetch_factor=4,
            persistent_workers=True,
            generator=object(),
            multiprocessing_context="spawn",
            pin_memory_device="cuda:1",
            in_order=False,
            shuffle=False,
        )
    said = "\n".join(str(w.message) for w in got)
    for name, field in [
        ("num_workers=8", "Job.loader_processes"),
        ("prefetch_factor=4", "BatchSpec.ring_bytes"),
        ("generator=", "Job.seed"),
        ("shuffle=False", "shuffle_window=1"),
        ("persistent_workers=True", "persist"),
        ("multiprocessing_context='spawn'", "worker"),
        ("pin_memory_device='cuda:1'", "pin_memory=True"),
        ("in_order=False", "(step, micro-batch)"),
    ]:
        assert name in said and field in said, (name, said)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make(job, num_workers=8, prefetch_factor=4)  # once per process


def test_a_dataset_unknown_keywords_and_extra_positionals_are_config_errors(job):
    class Squares:
        def __getitem__(self, i):
            return i * i

        def __len__(self):
            return 10

    with pytest.raises(ConfigError, match="not a .*Squares: describe the data as Job.sources"):
        DataLoader(Squares(), batch_size=4)
    with pytest.raises(ConfigError, match=r"unexpected keyword argument\(s\) \['batchsize'\]"):
        make(job, batchsize=4)
    with pytest.raises(ConfigError, match="positional arguments"):
        make(job, *([None] * 13))
    with pytest.raises(ConfigError, match="timeout=3 and timeout_s=5 disagree"):
        DataLoader(job, timeout=3, timeout_s=5, rank=0, world_size=2, spawn_sidecar=False)
