"""Invalid configs fail at construction, naming the field and the fix."""

import pytest

from overlord.config import BatchSpec, Job, Mesh, Source
from overlord.errors import ConfigError


def src(**kw):
    args = dict(name="web", paths=("/data/web/*.parquet",))
    args.update(kw)
    return Source(**args)


def test_valid_job_round_trips_through_json_and_yaml(tmp_path):
    job = Job(
        name="j", sources=(src(), src(name="code", weight=2.0)), mesh=Mesh(dp=2, tp=2), batch=BatchSpec(global_batch=8)
    )
    assert Job.from_dict(job.to_dict()) == job
    path = tmp_path / "job.yaml"
    path.write_text(
        "name: j\nsources:\n  - {name: web, paths: ['/data/web/*.parquet']}\n"
        "  - {name: code, paths: ['/data/web/*.parquet'], weight: 2.0}\n"
        "mesh: {dp: 2, tp: 2}\nbatch: {global_batch: 8}\n"
    )
    assert Job.from_file(path) == job


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda: src(weight=-1), "Source.weight"),
        (lambda: src(transform="nocolon"), "module:callable"),
        (lambda: src(on_error="ignore"), "on_error"),
        (lambda: Job(name="j", sources=(src(weight=0),)), "sum to 0"),
        (lambda: Job(name="j", sources=(src(), src())), "duplicate"),
        (lambda: Job(name="j", sources=(src(),), mesh=Mesh(dp=3), batch=BatchSpec(global_batch=8)), "divisible"),
        (lambda: Job(name="bad name!", sources=(src(),)), "Job.name"),
        (lambda: Mesh(tp=0), "Mesh.tp"),
        (lambda: BatchSpec(micro_batches=0), "micro_batches"),
        (lambda: Job(name="j", sources=(src(),), redis_url="http://x"), "redis_url"),
        (lambda: Job.from_dict({"name": "j", "sources": [{"name": "a", "paths": ["x"], "wieght": 1}]}), "wieght"),
        (lambda: Job.from_dict({"name": "j", "sources": [], "bogus": 1}), "bogus"),
    ],
)
def test_invalid_config_names_the_field(make, words):
    with pytest.raises(ConfigError, match=words):
        make()


def test_mesh_not_matching_world_size():
    job = Job(name="j", sources=(src(),), mesh=Mesh(dp=2, tp=2))
    with pytest.raises(ConfigError, match="WORLD_SIZE=3"):
        job.check_world(3)


def test_mesh_coordinates_tp_fastest():
    mesh = Mesh(dp=2, pp=1, cp=2, tp=2)
    assert mesh.coords(0) == {"dp": 0, "pp": 0, "cp": 0, "tp": 0}
    assert mesh.coords(1)["tp"] == 1 and mesh.coords(2)["cp"] == 1 and mesh.coords(4)["dp"] == 1
    assert mesh.ranks_of_dp(1) == [4, 5, 6, 7]


def test_more_micro_batches_than_a_rank_gets_samples_is_refused():
    """global_batch 8 over dp 2 gives each rank 4 samples a step: 8 micro-batches would
    deliver empty ones (issue 16/17: 96 empty micro-batches were delivered)."""
    with pytest.raises(
        ConfigError, match=r"micro_batches=8: micro-batches would be empty; raise global_batch to at least 16"
    ):
        Job(name="j", sources=(src(),), mesh=Mesh(dp=2), batch=BatchSpec(global_batch=8, micro_batches=8))
    Job(name="j", sources=(src(),), mesh=Mesh(dp=2), batch=BatchSpec(global_batch=8, micro_batches=4))
