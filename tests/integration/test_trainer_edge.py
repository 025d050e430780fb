"""The trainer edge (issue 16, items 2-6): rank detection from any launcher's variables,
one job-wide state any rank saves and every rank loads, any call order a framework uses,
a new DataLoader in the same process going back to an earlier state, a resume after the
last batch, and len(). Real sidecars, real trainer processes (edge_trainer.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from overlord import BatchSpec, Mesh
from overlord.sidecar.sidecar import sidecar_running

pytestmark = pytest.mark.timeout(300)

TRAINER = Path(__file__).parent / "edge_trainer.py"
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK")
JOB = dict(
    seed=21, mesh=Mesh(dp=2), batch=BatchSpec(global_batch=16, micro_batches=2, context_length=512, ring_bytes=1 << 20)
)
FINITE = dict(
    epochs=1,
    seed=3,
    mesh=Mesh(dp=2),
    batch=BatchSpec(global_batch=32, micro_batches=2, context_length=512, ring_bytes=1 << 20),
)


def start(c, name: str, phases: list[dict], **env: int) -> tuple[subprocess.Popen, Path]:
    out = c.workdir / f"{name}.json"
    base = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    proc = subprocess.Popen(
        [sys.executable, str(TRAINER), str(c.config), str(out), json.dumps(phases)],
        env={**base, **{k: str(v) for k, v in env.items()}},
    )
    return proc, out


def finish(c, runs: dict, timeout: float = 150) -> dict:
    deadline = time.monotonic() + timeout
    for proc, _ in runs.values():
        try:
            proc.wait(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError(f"a trainer did not finish within {timeout}s\n{c.log()}") from None
    return {k: json.loads(out.read_text())["phases"] for k, (_, out) in runs.items()}


def wait_for(cond, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def spawned_sidecar_gone(c) -> None:
    wait_for(lambda: not sidecar_running(c.job), "the spawned sidecar did not exit after its trainers", 60)


def reference(cluster, batches: int, **job) -> dict[int, dict]:
    ref = cluster(**job)
    ref.start_sidecar()
    runs = {r: start(ref, f"ref{r}", [{"batches": batches, "spawn": False}], RANK=r, WORLD_SIZE=2) for r in range(2)}
    got = {r: phases[0] for r, phases in finish(ref, runs).items()}
    assert ref.stop() == 0
    return got


@pytest.mark.slow  # make test-slow (CI runs it): keeps make test under 6 minutes on 2 cores
def test_lightning_launcher_variables_give_each_process_its_own_rank(cluster):
    """Lightning's launcher sets LOCAL_RANK=1 WORLD_SIZE=2 and no RANK: before, both
    processes took rank 0 and the second died with RingError."""
    expected = reference(cluster, 10, **JOB)
    c = cluster(**JOB)
    c.start_sidecar()
    runs = {r: start(c, f"l{r}", [{"batches": 10, "spawn": False}], LOCAL_RANK=r, WORLD_SIZE=2) for r in range(2)}
    got = finish(c, runs)
    for r in range(2):
        assert got[r][0]["end"] == "limit", got[r][0]["end"]
        assert got[r][0]["rank"] == r
        assert got[r][0]["digests"] == expected[r]["digests"]
    assert c.stop() == 0


@pytest.mark.slow  # make test-slow (CI runs it): keeps make test under 6 minutes on 2 cores
def test_two_processes_claiming_one_rank_get_an_error_naming_both_pids(cluster, tmp_path):
    c = cluster(**JOB)
    c.start_sidecar()
    held = tmp_path / "held.json"
    first = start(
        c, "first", [{"batches": 2, "spawn": False, "hold_s": 8, "save_at": {"1": str(held)}}], RANK=0, WORLD_SIZE=2
    )
    wait_for(held.exists, f"rank 0's first trainer got no batch\n{c.log()}")
    second = start(c, "second", [{"batches": 2, "spawn": False}], NODE_RANK=0, LOCAL_RANK=0, WORLD_SIZE=2)
    got = finish(c, {"first": first, "second": second})
    end = got["second"][0]["end"]
    assert end.startswith("ConfigError: rank 0 of job"), end
    assert f"(pid {first[0].pid})" in end and f"this process (pid {second[0].pid})" in end, end
    assert "NODE_RANK=0 LOCAL_RANK=0 WORLD_SIZE=2" in end, end  # how this one got its rank
    assert got["first"][0]["end"] == "limit"
    assert c.stop() == 0


@pytest.mark.slow  # make test-slow (CI runs it): keeps make test under 6 minutes on 2 cores
def test_rank_zeros_state_resumes_every_rank_in_any_call_order(cluster, tmp_path):
    """Frameworks keep rank 0's state only: rank 1 loading it resumed at batch 0 or was
    refused ('state is for ... rank 0'). iter() before load_state_dict() was refused,
    and so was a second load_state_dict()."""
    expected = reference(cluster, 30, **JOB)
    c = cluster(**JOB)
    c.start_sidecar()
    s0, s1, early = (tmp_path / f"{n}.json" for n in ("s0", "s1", "early"))
    runs = {
        0: start(
            c,
            "a0",
            [{"batches": 11, "spawn": False, "save_at": {"4": str(early), "11": str(s0)}}],
            RANK=0,
            WORLD_SIZE=2,
        ),
        1: start(c, "a1", [{"batches": 11, "spawn": False, "save_at": {"11": str(s1)}}], RANK=1, WORLD_SIZE=2),
    }
    first = {r: p[0] for r, p in finish(c, runs).items()}
    assert c.stop() == 0
    state = json.loads(s0.read_text())
    assert (state["rank"], state["batches"], state["world_size"]) == (0, 11, 2)

    c.start_sidecar(resume=True)
    runs = {
        0: start(c, "b0", [{"load": [str(s0)], "batches": 19, "spawn": False}], RANK=0, WORLD_SIZE=2),
        # Lightning's order: iter() first; then a load, and another: the last wins
        1: start(
            c,
            "b1",
            [{"iter_first": True, "load": [str(early), str(s0)], "batches": 19, "spawn": False}],
            RANK=1,
            WORLD_SIZE=2,
        ),
    }
    second = {r: p[0] for r, p in finish(c, runs).items()}
    for r in range(2):
        assert second[r]["end"] == "limit", f"rank {r}: {second[r]['end']}\n{c.log()}"
        assert first[r]["digests"] + second[r]["digests"] == expected[r]["digests"], f"rank {r}"
        assert first[r]["keys"] + second[r]["keys"] == expected[r]["keys"]
    assert c.stop() == 0


@pytest.mark.slow  # make test-slow (CI runs it): keeps make test under 6 minutes on 2 cores
def test_a_new_loader_in_the_same_process_goes_back_to_an_earlier_state(cluster, tmp_path):
    """Before, a second DataLoader that loaded an earlier state, its spawned sidecar still
    running, silently got the batches after the first loader's (here: batch 20 on)."""
    c = cluster(
        seed=8,
        mesh=Mesh(dp=1),
        batch=BatchSpec(global_batch=8, micro_batches=2, context_length=512, ring_bytes=1 << 20),
    )
    s6, s15 = tmp_path / "s6.json", tmp_path / "s15.json"
    runs = {
        0: start(
            c,
            "p",
            [
                {"batches": 20, "save_at": {"6": str(s6), "15": str(s15)}},
                {"iter_first": True, "load": [str(s15), str(s6)], "batches": 14},  # back to batch 6: the last load wins
                {"load": [str(s15)], "batches": 5},  # and again, to batch 15
            ],
            RANK=0,
            WORLD_SIZE=1,
        )
    }
    one, two, three = finish(c, runs)[0]
    assert [p["end"] for p in (one, two, three)] == ["limit"] * 3, [p["end"] for p in (one, two, three)]
    assert two["digests"] == one["digests"][6:20] and two["keys"] == one["keys"][6:20]
    assert three["digests"] == one["digests"][15:20]
    assert two["steps"][0] == [3, 0] and three["steps"][0] == [7, 1]
    spawned_sidecar_gone(c)


@pytest.mark.slow  # make test-slow (CI runs it): keeps make test under 6 minutes on 2 cores
def test_every_rank_going_back_in_its_own_process_restarts_the_spawned_sidecar_once(cluster, tmp_path):
    """Two rank processes (as under torchrun or Lightning's DDP), each making a new
    DataLoader that loads rank 0's earlier state while its first one still holds its
    ring: the last rank to ask stops the spawned sidecar, one --resume sidecar follows,
    and both ranks get the batches after the state again, byte-identical."""
    c = cluster(**JOB)
    s4 = tmp_path / "s4.json"
    runs = {
        r: start(
            c,
            f"p{r}",
            [{"batches": 10, "save_at": {"4": str(s4)} if r == 0 else {}}, {"load": [str(s4)], "batches": 6}],
            RANK=r,
            WORLD_SIZE=2,
        )
        for r in range(2)
    }
    got = finish(c, runs)
    for r in range(2):
        one, two = got[r]
        assert (one["end"], two["end"]) == ("limit", "limit"), f"rank {r}: {two['end']}\n{c.log()}"
        assert two["digests"] == one["digests"][4:10], f"rank {r}"
    spawned_sidecar_gone(c)


@pytest.mark.slow  # make test-slow: ~20 s
def test_going_back_while_another_rank_still_reads_is_refused_in_bounded_time(cluster, tmp_path):
    """Only rank 0 loads an earlier state while rank 1 keeps training: the spawned sidecar
    is not stopped under rank 1; rank 0 gets, within its timeout, an error naming rank 1
    and its pid, and rank 1's batches are those of an undisturbed run."""
    expected = reference(cluster, 10, **JOB)
    c = cluster(**JOB)
    s2 = tmp_path / "s2.json"
    runs = {
        0: start(
            c,
            "p0",
            [{"batches": 6, "save_at": {"2": str(s2)}}, {"load": [str(s2)], "batches": 4, "timeout": 4}],
            RANK=0,
            WORLD_SIZE=2,
        ),
        1: start(c, "p1", [{"batches": 10, "hold_s": 15}], RANK=1, WORLD_SIZE=2),
    }
    got = finish(c, runs)
    end = got[0][1]["end"]
    assert end.startswith("ConfigError: rank 0 of job") and "within 4s" in end, end
    assert f"rank 1 (pid {runs[1][0].pid}) still read from it" in end, end
    assert got[0][1]["digests"] == []
    assert got[1][0]["end"] == "limit" and got[1][0]["digests"] == expected[1]["digests"]
    spawned_sidecar_gone(c)


def test_going_back_on_a_sidecar_no_loader_spawned_is_refused_with_what_to_do(cluster, tmp_path):
    c = cluster(
        seed=8,
        mesh=Mesh(dp=1),
        batch=BatchSpec(global_batch=8, micro_batches=2, context_length=512, ring_bytes=1 << 20),
    )
    c.start_sidecar()
    s3 = tmp_path / "s3.json"
    runs = {
        0: start(
            c,
            "p",
            [
                {"batches": 8, "spawn": False, "save_at": {"3": str(s3)}},
                {"load": [str(s3)], "batches": 4, "spawn": False},
            ],
            RANK=0,
            WORLD_SIZE=1,
        )
    }
    one, two = finish(c, runs)[0]
    assert one["end"] == "limit"
    assert two["digests"] == [], "batches other than those after the state were delivered"
    assert two["end"].startswith("ConfigError: rank 0 of job"), two["end"]
    assert "cannot go back" in two["end"] and "--resume" in two["end"], two["end"]
    assert c.stop() == 0


@pytest.mark.slow  # make test-slow (CI runs it): keeps make test under 6 minutes on 2 cores
def test_len_and_a_resume_at_the_end_of_a_finite_job(cluster, tmp_path):
    """len() raised TypeError for every job; a state saved after the last batch hung
    (or, with the sidecar's fix, still needed a sidecar started for nothing). len() is
    the whole job's micro-batches for the rank, `remaining` what is left after a state."""
    c = cluster(**FINITE)
    mid = {r: tmp_path / f"mid{r}.json" for r in range(2)}
    end = {r: tmp_path / f"end{r}.json" for r in range(2)}
    runs = {r: start(c, f"a{r}", [{"save_at": {"10": str(mid[r])}}], RANK=r, WORLD_SIZE=2) for r in range(2)}
    first = {r: p[0] for r, p in finish(c, runs).items()}
    for r in range(2):
        rec = first[r]
        assert rec["end"] == "stop", rec["end"]
        assert rec["len"] == len(rec["digests"]) > 10, (rec["len"], len(rec["digests"]))
        assert rec["state"]["end"] is True
        end[r].write_text(json.dumps(rec["state"]))
    spawned_sidecar_gone(c)

    # rank 0's mid-job state on both ranks (a spawned --resume sidecar), then, in the same
    # processes, the end state: nothing left, at once
    runs = {
        r: start(c, f"b{r}", [{"load": [str(mid[0])]}, {"load": [str(end[0])]}], RANK=r, WORLD_SIZE=2) for r in range(2)
    }
    second = finish(c, runs)
    for r in range(2):
        resumed, ended = second[r]
        assert resumed["end"] == "stop", resumed["end"]
        assert resumed["len"] == len(first[r]["digests"])  # the whole job's, as torch's len() is the epoch's
        assert resumed["remaining"] == len(first[r]["digests"]) - 10 == len(resumed["digests"])
        assert resumed["digests"] == first[r]["digests"][10:]
        assert (ended["len"], ended["remaining"]) == (0, 0) and ended["digests"] == [] and ended["end"] == "stop"
    spawned_sidecar_gone(c)

    # a fresh process with only the end state starts no sidecar and waits for nothing
    runs = {0: start(c, "c0", [{"load": [str(end[0])]}], RANK=0, WORLD_SIZE=2)}
    (only,) = finish(c, runs, timeout=60)[0]
    assert only["len"] == 0 and only["digests"] == [] and only["end"] == "stop", only
    assert only["stop_s"] < 5, only["stop_s"]  # no sidecar to wait on: the first next() ends it
    assert not sidecar_running(c.job)


@pytest.mark.slow  # make test-slow (CI runs it): keeps make test under 6 minutes on 2 cores
def test_lightning_checkpoints_with_the_loader_resume_exactly(cluster, tmp_path):
    """The DataLoader passed straight to Lightning 2.6 (a finite job, so it has len() and
    Lightning's fetcher does not prefetch): ModelCheckpoint's state (on_train_batch_end,
    from fit_loop's combined_loader) resumes at exactly the next batch, within Lightning's
    same epoch. Lightning calls iter() before load_state_dict() (its iterable check)."""
    script = Path(__file__).parent / "lightning_edge.py"
    c = cluster(
        epochs=1,
        seed=4,
        mesh=Mesh(dp=1),
        batch=BatchSpec(global_batch=64, micro_batches=2, context_length=512, ring_bytes=1 << 20),
    )

    def fit(name: str, max_steps: int, every: int, resume: Path | None = None) -> list[dict]:
        out = tmp_path / f"{name}.jsonl"
        args = [str(c.config), str(out), str(tmp_path / f"ckpt-{name}"), str(max_steps), str(every)]
        base = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
        proc = subprocess.run(
            [sys.executable, str(script), *args, *([str(resume)] if resume else [])],
            env=base,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert proc.returncode == 0, proc.stderr[-4000:] + c.log()
        spawned_sidecar_gone(c)
        return [json.loads(line) for line in out.read_text().splitlines()]

    whole = fit("whole", 30, 1000)
    assert len(whole) == 30  # 960 samples / 64 = 15 steps x 2 micro-batches
    cut = fit("cut", 7, 3)
    assert [r["digest"] for r in cut] == [r["digest"] for r in whole[:7]]
    resumed = fit("resumed", 30, 1000, resume=tmp_path / "ckpt-cut" / "step=6.ckpt")
    assert [r["digest"] for r in resumed] == [r["digest"] for r in whole[6:]]
    # len() is the whole job's, so Lightning's epoch (its restored count + what follows)
    # ends with the job: a len() that shrank ended it 6 batches early (lost with max_epochs=1)
    assert [(r["epoch"], r["batch_idx"]) for r in resumed] == [(0, i) for i in range(6, 30)]
