"""The Planner's placement of units on nodes (pure functions)."""

from overlord import BatchSpec, Job, Mesh, Source
from overlord.planner.placement import homes, place
from overlord.sidecar.layout import Layout


def _job(**kw) -> Job:
    args = dict(name="p", sources=(Source(name="a", paths=("x",), partitions=2), Source(name="b", paths=("y",))),
                mesh=Mesh(dp=6), batch=BatchSpec(global_batch=12), nodes=("n0", "n1", "n2"), node="n1",
                redis_url="redis://h:6379/0", flight_port=8815, loader_processes=3)
    return Job(**{**args, **kw})


def test_constructors_live_with_their_dp_groups_and_loaders_are_spread():
    job = _job()
    layout = Layout.plan(job)
    assert layout.constructor_of == [0, 0, 1, 1, 2, 2]  # ranks 0-1 on n0, 2-3 on n1, 4-5 on n2
    assert homes(job, layout) == {"loader0": "n0", "loader1": "n1", "loader2": "n2",
                                  "constructor0": "n0", "constructor1": "n1", "constructor2": "n2"}
    assert job.ranks_of_node("n2") == [4, 5] and job.node_of_rank(3) == "n1"


def test_a_dead_node_s_units_go_to_the_least_loaded_live_node_and_come_home():
    job = _job()
    home = homes(job, Layout.plan(job))
    everyone = {"n0", "n1", "n2"}
    moved = place(home, home, live={"n0", "n2"}, registered=everyone)
    assert moved["loader1"] != "n1" and moved["constructor1"] != "n1"
    assert {moved["loader1"], moved["constructor1"]} == {"n0", "n2"}  # spread, not piled on one node
    assert {u: n for u, n in moved.items() if home[u] != "n1"} == {u: n for u, n in home.items() if n != "n1"}
    # stable while n1 stays down, even if the load would now favour another node
    assert place(home, moved, live={"n0", "n2"}, registered=everyone) == moved
    assert place(home, moved, live=everyone, registered=everyone) == home  # back home


def test_a_node_that_never_registered_keeps_its_units_and_cpus_weigh_the_choice():
    job = _job()
    home = homes(job, Layout.plan(job))
    assert place(home, home, live={"n0"}, registered={"n0"}) == home  # n1, n2 still starting
    moved = place(home, home, live={"n0", "n2"}, registered={"n0", "n1", "n2"}, cpus={"n0": 64, "n2": 2})
    assert moved["loader1"] == moved["constructor1"] == "n0"
    assert place(home, home, live=set(), registered={"n0"}) == home  # nobody to move to


def test_a_job_on_several_nodes_says_what_it_needs():
    import pytest

    from overlord.errors import ConfigError

    with pytest.raises(ConfigError, match="redis_url"):
        _job(redis_url=None)
    with pytest.raises(ConfigError, match="not one of Job.nodes"):
        _job(node="n9")
    with pytest.raises(ConfigError, match="split evenly"):
        _job(mesh=Mesh(dp=4), batch=BatchSpec(global_batch=8))
    assert _job(node="").node == "n0"
