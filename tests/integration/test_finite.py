"""Finite jobs end cleanly (issue 16, items 6 and 7), with real processes: no step with
an empty micro-batch, `last` on the last batch of every rank, drop_last both ways, and a
resume from a state saved after the last batch ends at once."""

from __future__ import annotations

import pytest
from harness import assert_delivered
from meta_trainer import results, start

from overlord import BatchSpec, Mesh

pytestmark = pytest.mark.timeout(240)

CORPUS_ROWS = 960  # conftest's corpus: 4 sources x 240 rows


def run(c, tmp_path, tag="", **args):
    c.start_sidecar()
    outs = {r: tmp_path / f"{c.job.name}-{tag}{r}.json" for r in range(c.job.mesh.world_size)}
    procs = {r: start(c, r, outs[r], **{k: str(v).format(rank=r) for k, v in args.items()}) for r in outs}
    return results(procs, outs)


def check_ranks(got: dict, steps: int, micro_batches: int, log) -> None:
    for rank, rec in got.items():
        assert rec["end"] == "stop", f"rank {rank}: {rec['end']}\n{log()}"
        positions = [(b["step"], b["mb"]) for b in rec["batches"]]
        assert positions == [(s, m) for s in range(steps) for m in range(micro_batches)], (rank, positions[-4:])
        assert all(b["keys"] for b in rec["batches"]), f"rank {rank} got an empty micro-batch"
        assert [b["last"] for b in rec["batches"]] == [False] * (len(positions) - 1) + [True]


def test_a_job_of_whole_steps_ends_on_its_last_full_step(cluster, corpus_keys, tmp_path):
    # 960 samples = 30 steps of 32: the 31st, empty step of issue 16 item 7 must not exist
    c = cluster(
        epochs=1,
        mesh=Mesh(dp=2),
        batch=BatchSpec(global_batch=32, micro_batches=2, context_length=512, ring_bytes=1 << 20),
    )
    got = run(c, tmp_path)
    check_ranks(got, 30, 2, c.log)
    assert sum(len(b["keys"]) for rec in got.values() for b in rec["batches"] if b["step"] == 29) == 32
    results_like = {r: {"keys": [b["keys"] for b in rec["batches"]]} for r, rec in got.items()}
    assert_delivered(results_like, corpus_keys, log=c.log)
    assert c.stop() == 0


# 960 = 53 x 18 + 6: what happens to the 6 left over depends on drop_last and on how many
# micro-batches (2 DP groups x micro_batches) they must fill
@pytest.mark.parametrize(
    "drop_last, micro_batches, steps, dropped",
    [
        # the never-empty micro-batch case stays quick; the other two (6 s each) run in
        # the slow tier, which CI runs too: make test keeps under 6 minutes on 2 cores
        pytest.param(
            False, 2, 54, 0, marks=pytest.mark.slow
        ),  # 6 samples fill 2 x 2 micro-batches: a partial last step
        (False, 4, 53, 6),  # 6 cannot fill 2 x 4: dropped, never an empty micro-batch
        pytest.param(True, 2, 53, 6, marks=pytest.mark.slow),  # drop_last: the partial step is dropped
    ],
)
def test_drop_last_both_ways_and_a_remainder_too_small_to_fill_the_micro_batches(
    cluster, corpus_keys, tmp_path, drop_last, micro_batches, steps, dropped
):
    c = cluster(
        epochs=1,
        mesh=Mesh(dp=2),
        batch=BatchSpec(
            global_batch=18, micro_batches=micro_batches, context_length=512, ring_bytes=1 << 20, drop_last=drop_last
        ),
    )
    got = run(c, tmp_path)
    check_ranks(got, steps, micro_batches, c.log)
    keys = [k for rec in got.values() for b in rec["batches"] for k in b["keys"]]
    assert len(keys) == len(set(keys)) == CORPUS_ROWS - dropped and set(keys) <= corpus_keys
    last_step = sum(len(b["keys"]) for rec in got.values() for b in rec["batches"] if b["step"] == steps - 1)
    assert last_step == (6 if steps == 54 else 18)
    assert f"{dropped} sample(s) left over" in c.log() if dropped else "left over" not in c.log()
    assert c.stop() == 0


@pytest.mark.slow  # make test-slow (CI runs it): keeps make test under 6 minutes on 2 cores
def test_a_resume_after_the_last_batch_ends_at_once(cluster, tmp_path):
    c = cluster(
        epochs=1,
        seed=3,
        mesh=Mesh(dp=2),
        batch=BatchSpec(global_batch=32, micro_batches=2, context_length=512, ring_bytes=1 << 20),
    )
    first = run(c, tmp_path, "a", save_state=str(tmp_path / "end{rank}.json"))
    check_ranks(first, 30, 2, c.log)
    assert c.stop() == 0

    c.start_sidecar(resume=True)
    outs = {r: tmp_path / f"b{r}.json" for r in range(2)}
    procs = {r: start(c, r, outs[r], load_state=tmp_path / f"end{r}.json") for r in range(2)}
    again = results(procs, outs, timeout=60)  # well under the trainers' 20 s job timeout x 3
    for rank, rec in again.items():
        assert rec["end"] == "stop" and rec["batches"] == [], (
            f"rank {rank}: {rec['end']} {rec['batches'][:1]}\n{c.log()}"
        )
    assert "after its last step" in c.log()
    assert c.stop() == 0


@pytest.mark.slow  # make test-slow (CI runs it): keeps make test under 6 minutes on 2 cores
def test_a_resume_where_one_rank_is_at_the_end_and_one_a_step_before(cluster, tmp_path):
    c = cluster(
        epochs=1,
        seed=3,
        mesh=Mesh(dp=2),
        batch=BatchSpec(global_batch=32, micro_batches=2, context_length=512, ring_bytes=1 << 20),
    )
    c.start_sidecar()
    outs = {r: tmp_path / f"a{r}.json" for r in range(2)}
    states = {r: tmp_path / f"s{r}.json" for r in range(2)}
    procs = {
        0: start(c, 0, outs[0], save_state=states[0]),
        1: start(c, 1, outs[1], save_state=states[1], batches=58),
    }  # rank 1 stops before step 29
    first = results(procs, outs)
    assert first[0]["end"] == "stop" and first[1]["end"] == "limit"
    assert c.stop() == 0

    c.start_sidecar(resume=True)
    outs = {r: tmp_path / f"b{r}.json" for r in range(2)}
    procs = {r: start(c, r, outs[r], load_state=states[r]) for r in range(2)}
    again = results(procs, outs, timeout=90)
    assert again[0]["end"] == "stop" and again[0]["batches"] == [], again[0]
    assert again[1]["end"] == "stop", again[1]["end"]
    assert [(b["step"], b["mb"], b["last"]) for b in again[1]["batches"]] == [(29, 0, False), (29, 1, True)]
    assert c.stop() == 0
