"""The Planner's placement of units on nodes (pure functions)."""

from overlord import BatchSpec, Job, Mesh, Source
from overlord.runtime.layout import Layout
from overlord.runtime.placement import Use, homes, place, relieve


def _job(**kw) -> Job:
    args = dict(
        name="p",
        sources=(Source(name="a", paths=("x",), partitions=2), Source(name="b", paths=("y",))),
        mesh=Mesh(dp=6),
        batch=BatchSpec(global_batch=12),
        nodes=("n0", "n1", "n2"),
        node="n1",
        redis_url="redis://h:6379/0",
        flight_port=8815,
        loader_processes=3,
    )
    return Job(**{**args, **kw})


def test_constructors_live_with_their_dp_groups_and_loaders_are_spread():
    job = _job()
    layout = Layout.plan(job)
    assert layout.constructor_of == [0, 0, 1, 1, 2, 2]  # ranks 0-1 on n0, 2-3 on n1, 4-5 on n2
    assert homes(job, layout) == {
        "loader0": "n0",
        "loader1": "n1",
        "loader2": "n2",
        "constructor0": "n0",
        "constructor1": "n1",
        "constructor2": "n2",
    }
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


def test_a_node_over_its_budget_hands_a_loader_to_a_node_with_room_and_takes_it_back_later():
    from overlord.runtime.placement import Use, pressure, relieve

    job = _job()
    home = homes(job, Layout.plan(job))
    everyone = {"n0", "n1", "n2"}
    budget = {"n0": Use(cpus=1.0, mb=4096), "n1": Use(cpus=4.0, mb=4096), "n2": Use(cpus=2.0, mb=4096)}
    use = {"loader0": Use(cpus=1.6, mb=300), "loader1": Use(cpus=0.5, mb=300), "loader2": Use(cpus=0.4, mb=300)}
    assert pressure("n0", home, use, budget) == 1.6
    # over, but not for long enough: nothing moves
    assert relieve(home, home, home, everyone, use, budget, over=set()) == (home, {})
    placed, why = relieve(home, home, home, everyone, use, budget, over={"n0"})
    assert placed == {**home, "loader0": "n1"}  # n1 has room for 1.6 (to 0.525); n2 would be 1.0
    assert why == {"loader0": "n0 over budget (1.60)"}
    # it stays away while n0 would be over again with it...
    assert relieve(home, placed, home, everyone, use, budget, over=set())[0] == placed
    # ...and goes home once its demand fits there with room to spare
    calmer = {**use, "loader0": Use(cpus=0.7, mb=300)}
    assert relieve(home, placed, home, everyone, calmer, budget, over=set())[0] == home


def test_no_node_takes_a_loader_it_cannot_hold_and_memory_counts_too():
    from overlord.runtime.placement import Use, relieve

    job = _job()
    home = homes(job, Layout.plan(job))
    everyone = {"n0", "n1", "n2"}
    budget = {n: Use(cpus=1.0, mb=1000) for n in everyone}
    busy = {"loader0": Use(cpus=1.5), "loader1": Use(cpus=0.8), "loader2": Use(cpus=0.9)}
    assert relieve(home, home, home, everyone, busy, budget, over={"n0"}) == (home, {})  # nobody has 1.5 spare
    fat = {"loader0": Use(mb=900), "constructor0": Use(mb=400), "loader1": Use(mb=100)}
    placed, why = relieve(home, home, home, everyone, fat, budget, over={"n0"})
    assert placed["loader0"] == "n2" and placed["constructor0"] == "n0"  # constructors stay by their trainers
    assert "n0 over budget (1.30)" in why["loader0"]
    # a dead node's loader fostered elsewhere goes home when its node is back, if it fits
    down = place(home, home, live={"n0", "n2"}, registered=everyone)
    assert relieve(place(home, down, everyone, everyone), down, home, everyone, {}, budget, set())[0] == home


def test_a_loader_no_node_can_hold_still_leaves_a_starved_node_for_the_roomiest_and_does_not_bounce():
    from overlord.runtime.placement import Use, relieve

    job = _job()
    home = homes(job, Layout.plan(job))
    everyone = {"n0", "n1", "n2"}
    # the CI case: n0 offers its loaders 0.05 CPUs, the others 3.25; the scaler projects
    # 4.3 CPUs for the costly loader, more than any node offers
    budget = {"n0": Use(cpus=0.05), "n1": Use(cpus=3.25), "n2": Use(cpus=3.25)}
    use = {"loader0": Use(cpus=4.3), "loader1": Use(cpus=4.3), "loader2": Use(cpus=0.3)}
    placed, why = relieve(home, home, home, everyone, use, budget, over={"n0"})
    assert placed == {**home, "loader0": "n2"}  # 86 -> 1.42 on n2 (n1 would be 2.65)
    assert why == {"loader0": "n0 over budget (86.00)"}
    # n2 is over budget now, but no move halves anyone's pressure: nothing moves on
    assert relieve(home, placed, home, everyone, use, budget, over={"n0", "n1", "n2"}) == (placed, {})
    # two equal nodes and a loader too big for either: it stays put
    even = {"n0": Use(cpus=1.0), "n1": Use(cpus=1.0), "n2": Use(cpus=1.0)}
    big = {"loader0": Use(cpus=1.5), "loader1": Use(cpus=0.1), "loader2": Use(cpus=0.1)}
    assert relieve(home, home, home, everyone, big, even, over={"n0"}) == (home, {})


def _shadowed_job(**kw) -> Job:
    sources = (Source(name="a", paths=("x",), partitions=2, shadow=True), Source(name="b", paths=("y",)))
    return _job(sources=sources, **kw)


def test_each_shadow_lives_on_a_node_other_than_its_loader_s():
    job = _shadowed_job()
    layout = Layout.plan(job)
    assert layout.shadowed == [0, 1]  # source a's two partitions, in loader processes 0 and 1
    home = homes(job, layout)
    assert {u: n for u, n in home.items() if u.startswith("shadow")} == {"shadow0": "n1", "shadow1": "n2"}
    everyone = {"n0", "n1", "n2"}
    assert place(home, {}, live=everyone, registered=everyone) == home
    assert place(home, home, live={"n0"}, registered={"n0"}) == home  # n1, n2 still starting
    one_node = _shadowed_job(nodes=("n0",), node="n0", mesh=Mesh(dp=2))
    assert not any(u.startswith("shadow") for u in homes(one_node, Layout.plan(one_node)))  # its sidecar runs them


def test_a_dead_node_s_loader_waits_for_its_promoted_shadow_and_then_stays():
    job = _shadowed_job()
    home = homes(job, Layout.plan(job))
    everyone, without_n1 = {"n0", "n1", "n2"}, {"n0", "n2"}
    # n1 died; shadow1 beats on n2: loader1 is not restarted cold elsewhere, the promotion moves it
    waiting = place(home, home, live=without_n1, registered=everyone, standby={"shadow1"})
    assert waiting["loader1"] == "n1" and waiting["constructor1"] != "n1"
    assert waiting["shadow0"] != "n1" and waiting["shadow0"] != waiting["loader0"]  # n0's shadow leaves n1
    # the promotion wrote loader1 -> n2 and took shadow1 off: its new shadow goes to n0, not beside it
    promoted = {**waiting, "loader1": "n2"}
    del promoted["shadow1"]
    after = place(home, promoted, live=without_n1, registered=everyone)
    assert after["loader1"] == "n2" and after["shadow1"] == "n0"
    # n1 back: loader1 stays where it runs hot (no cold trip home); the shadows keep their nodes
    back = place(home, after, live=everyone, registered=everyone)
    assert back["loader1"] == "n2" and back["constructor1"] == "n1"
    assert back["shadow1"] == "n0" and back["shadow0"] == after["shadow0"]


def test_a_loader_whose_shadow_is_gone_too_restarts_elsewhere_and_a_lone_node_runs_no_shadow():
    job = _shadowed_job(nodes=("n0", "n1"), mesh=Mesh(dp=2))
    home = homes(job, Layout.plan(job))
    assert home["shadow0"] == "n1" and home["shadow1"] == "n0"
    both = {"n0", "n1"}
    moved = place(home, home, live={"n0"}, registered=both)  # no shadow of loader1 beats
    assert moved["loader1"] == "n0" and moved["loader0"] == "n0"
    assert "shadow0" not in moved and "shadow1" not in moved  # no node other than theirs is live
    back = place(home, moved, live=both, registered=both)
    assert back["loader1"] == "n0" and back["shadow0"] == back["shadow1"] == "n1"


def test_a_loader_moved_for_capacity_takes_its_shadow_off_its_new_node():
    job = _shadowed_job(nodes=("n0", "n1"), mesh=Mesh(dp=2), loader_processes=2)
    home = homes(job, Layout.plan(job))
    both = {"n0", "n1"}
    use = {"loader0": Use(cpus=4)}
    budget = {"n0": Use(cpus=1), "n1": Use(cpus=8)}
    placed, why = relieve(home, home, home, both, use, budget, over={"n0"})
    assert placed["loader0"] == "n1" and "loader0" in why
    assert placed["shadow0"] == "n0"  # it swaps with its loader: never both on one node
