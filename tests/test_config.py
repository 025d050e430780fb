"""Invalid configs fail at construction, naming the field and the fix."""

import json

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


def test_a_json_job_file_is_read_as_json(tmp_path):
    # json.dumps writes a small float with an exponent (1e-05), which YAML 1.1 (PyYAML)
    # reads as a string: the job a sidecar wrote as JSON failed to load in its trainers.
    # Every trainer reads the file: as JSON, 10 ms and 0.9 MiB for 300 sources, against
    # PyYAML's 510 ms and 8.9 MiB
    job = Job(name="j", sources=(src(weight=1e-05), src(name="code", weight=2.5e-07)))
    path = tmp_path / "job.json"
    path.write_text(job.to_json())
    assert "e-05" in path.read_text()
    assert Job.from_file(path) == job
    path.write_text("{name: j, sources: [{name: web, paths: ['/data/web/*.parquet']}]}")  # YAML, not JSON
    assert Job.from_file(path) == Job(name="j", sources=(src(),))
    path.write_text('{"name": "j", "sources": [')
    with pytest.raises(ConfigError, match="not valid YAML/JSON"):
        Job.from_file(path)


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


# -- the typed sections: Mixing and Autoscale -------------------------------------------


def _two_sources(**overrides) -> Job:
    return Job(
        name="sections",
        sources=(Source(name="web", paths=("/dev/null",)), Source(name="code", paths=("/dev/null",))),
        **overrides,
    )


def test_mixing_and_autoscale_given_as_dicts_become_their_sections_and_round_trip():
    from overlord.config import Autoscale, Mixing

    job = _two_sources(
        mixing={"kind": "piecewise", "points": [[0, {"web": 1}], [100, {"code": 1}]], "unit": "substep"},
        autoscale={"cpus": 4, "online": False},
    )
    assert job.mixing == Mixing(kind="piecewise", points=((0, {"web": 1}), (100, {"code": 1})), unit="substep")
    assert job.autoscale == Autoscale(cpus=4, online=False)
    assert job.autoscale.budget_fields() == {"cpus": 4}
    assert Job.from_dict(json.loads(job.to_json())) == job  # what role processes read back


def test_a_yaml_mixing_and_autoscale_load_unchanged(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(
        "name: y\nsources:\n  - {name: web, paths: [/dev/null]}\n  - {name: code, paths: [/dev/null]}\n"
        "mixing: {kind: warmup, start: {web: 1}, end: {code: 1}, steps: 50}\nautoscale: {}\n"
    )
    job = Job.from_file(path)
    assert (job.mixing.kind, job.mixing.steps, job.mixing.begin) == ("warmup", 50, 0)
    assert job.autoscale is not None and job.autoscale.online and job.autoscale.budget_fields() == {}


@pytest.mark.parametrize(
    ("mixing", "autoscale", "says"),
    [
        ({"kind": "warmup", "start": {"web": 1}, "end": {"code": 1}}, None, "needs steps"),
        ({"kind": "constant", "weights": {"web": 1}, "temperature": 2}, None, "unknown key(s) ['temperature']"),
        ({"kind": "zigzag"}, None, "mixing.kind='zigzag'"),
        ({"kind": "dynamic", "unit": "hour"}, None, "mixing.unit='hour'"),
        ({"kind": "constant", "weights": {"books": 1}}, None, "unknown source(s) ['books']"),
        (None, {"cpu": 4}, "unknown key(s) ['cpu']"),
        (None, {"cpus": -1}, "autoscale.cpus=-1"),
        (None, {"online": "yes"}, "autoscale.online='yes'"),
    ],
)
def test_a_section_with_a_wrong_key_or_value_is_refused_naming_it(mixing, autoscale, says):
    with pytest.raises(ConfigError) as err:
        _two_sources(mixing=mixing, autoscale=autoscale)
    assert says in str(err.value)


def test_autoscale_offers_every_budget_field():
    import dataclasses

    from overlord.autoscale.partition import Budget
    from overlord.config import Autoscale

    assert {f.name for f in dataclasses.fields(Budget)} <= {f.name for f in dataclasses.fields(Autoscale)}
