"""The framework examples end to end: PyTorch Lightning (its own launcher starts rank 1
with LOCAL_RANK=1, WORLD_SIZE=2 and no RANK) and Hugging Face Accelerate (under
torchrun), two ranks, gloo on CPU, a real sidecar.

For each framework: an uninterrupted run of 8 steps; a run that checkpoints every 3
steps through the framework's own mechanism (Lightning's ModelCheckpoint, Accelerate's
save_state) and stops after step 5; then a resume from that checkpoint (ckpt_path,
load_state), which holds one loader state, rank 0's. A step is one micro-batch of the
loader's two, so the checkpoint is taken mid-step. Each rank must train on exactly the
batches of the uninterrupted run, in order: steps 0..4, then 3..7 again, with the same
losses (model and optimizer restored). Lightning fetches batch i+1 before it trains on
batch i; with 256 KiB rings (three batches) and 64 KiB rings (one: the held batch is
copied out) every batch still holds, at the end of its step, the bytes it had when the
loader yielded it.

Every run stops its sidecar and leaves no shared-memory segment behind.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from overlord.shm import list_segments, unlink_all

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]
STEPS, CKPT_EVERY, STOP_AFTER = 8, 3, 5


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("corpus")  # the first run writes the demo corpus here


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cmd: list[str], out: Path, timeout_s: float = 180) -> str:
    """Run an example; returns its output. Fails on a non-zero exit, a timeout (the
    whole process group is killed: Lightning's rank 1, the sidecar) or a shared-memory
    segment left behind."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_PORT=str(_free_port()), PYTHONUNBUFFERED="1")
    env.pop("RANK", None), env.pop("LOCAL_RANK", None), env.pop("WORLD_SIZE", None)
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        output += f"\n== killed after {timeout_s:g}s"
    finally:
        job = json.loads((out / "job.json").read_text())["name"] if (out / "job.json").exists() else None
        left = list_segments(job) if job else []
        if job:
            unlink_all(job)
    logs = "".join(f"\n== {p}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(out.rglob("*.log")))
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{output[-12000:]}{logs}"
    assert not left, f"shared-memory segments left behind: {left}"
    assert "no shared-memory segment left" in output, output[-6000:]
    return output


def lightning(out: Path, data: Path, record: Path, *args: str) -> str:
    """Lightning's own launcher: this process is rank 0, it starts rank 1."""
    pytest.importorskip("lightning", reason="PyTorch Lightning is a test extra: pip install -e '.[test]'")
    return run(
        [
            sys.executable,
            str(ROOT / "examples" / "lightning_train.py"),
            "--devices",
            "2",
            "--out",
            str(out),
            "--data",
            str(data),
            "--record",
            str(record),
            "--steps",
            str(STEPS),
            *args,
        ],
        out,
    )


def accelerate(out: Path, data: Path, record: Path, *args: str) -> str:
    pytest.importorskip("accelerate", reason="Hugging Face Accelerate is a test extra: pip install -e '.[test]'")
    return run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(_free_port()),
            str(ROOT / "examples" / "accelerate_train.py"),
            "--out",
            str(out),
            "--data",
            str(data),
            "--record",
            str(record),
            "--steps",
            str(STEPS),
            *args,
        ],
        out,
    )


def records(prefix: Path) -> dict[int, list[dict]]:
    return {
        r: [json.loads(line) for line in Path(f"{prefix}.rank{r}.jsonl").read_text().splitlines()] for r in range(2)
    }


def assert_resumed_exactly(whole: dict[int, list[dict]], cut: dict[int, list[dict]]) -> None:
    """`cut` trained steps 0..4, then (resumed from the checkpoint after step 3) 3..7."""
    for r in range(2):
        assert len(whole[r]) == STEPS, (r, whole[r])
        expected = whole[r][:STOP_AFTER] + whole[r][CKPT_EVERY:]
        got = [x["digest"] for x in cut[r]]
        want = [x["digest"] for x in expected]
        assert got == want, (
            f"rank {r} trained on other batches than the uninterrupted run: at positions "
            f"{[i for i, (a, b) in enumerate(zip(got, want)) if a != b]} (of {len(want)}; got {len(got)}); "
            f"a resumed batch equal to the uninterrupted run's batch k: "
            f"{[next((k for k, w in enumerate(whole[r]) if w['digest'] == g), None) for g in got]}"
        )
        assert [x["loss"] for x in cut[r]] == pytest.approx([x["loss"] for x in expected], rel=1e-5)
        assert all(x["intact"] for x in whole[r] + cut[r]), [x for x in whole[r] + cut[r] if not x["intact"]]
    assert {x["digest"] for x in whole[0]}.isdisjoint(x["digest"] for x in whole[1])  # ranks read different data


@pytest.fixture(scope="module")
def lightning_whole(tmp_path_factory, data) -> dict[int, list[dict]]:
    """The uninterrupted Lightning run (256 KiB rings: Lightning holds two batches, the ring three)."""
    tmp = tmp_path_factory.mktemp("lightning")
    out = lightning(tmp / "whole", data, tmp / "whole.rec", "--ring-kib", "256")
    assert "rank 0: 0 batches changed" in out and "rank 1: 0 batches changed" in out, out[-6000:]
    # zero-copy: the ring leases all Lightning holds
    assert re.findall(r"yielded them, (\d+) copied", out) == ["0", "0"], out[-6000:]
    return records(tmp / "whole.rec")


def test_lightning_batches_keep_their_bytes_while_lightning_holds_them(lightning_whole):
    for r in range(2):
        assert [x["batch"] for x in lightning_whole[r]] == list(range(STEPS))
        changed = [x["batch"] for x in lightning_whole[r] if not x["intact"]]
        assert not changed, f"rank {r}: batches {changed} changed between the loader's yield and the end of their step"


def test_lightning_holding_more_than_the_ring_can_lease_gets_copies_with_the_same_bytes(
    tmp_path, data, lightning_whole
):
    """A 64 KiB ring holds one of these ~40 KiB batches while Lightning holds two: the
    second is copied out of the ring, never overwritten, and the job does not stall."""
    out = lightning(tmp_path / "small", data, tmp_path / "small.rec", "--ring-kib", "64")
    copied = [int(n) for n in re.findall(r"yielded them, (\d+) copied", out)]
    assert "rank 0: 0 batches changed" in out and "rank 1: 0 batches changed" in out, out[-6000:]
    assert len(copied) == 2 and all(copied), out[-6000:]  # the copy path ran on both ranks
    small = records(tmp_path / "small.rec")
    for r in range(2):
        assert [x["digest"] for x in small[r]] == [x["digest"] for x in lightning_whole[r]]
        assert all(x["intact"] for x in small[r])


def test_lightning_resumes_from_modelcheckpoint_with_the_batches_of_an_uninterrupted_run(
    tmp_path, data, lightning_whole
):
    out, rec = tmp_path / "cut", tmp_path / "cut.rec"
    lightning(out, data, rec, "--ring-kib", "256", "--ckpt-every", str(CKPT_EVERY), "--stop-after", str(STOP_AFTER))
    ckpt = torch.load(out / "checkpoints" / f"step={CKPT_EVERY}.ckpt", map_location="cpu", weights_only=False)
    # one loader state, rank 0's, kept by the DataModule; none in Lightning's combined_loader
    assert "loader" in ckpt["DemoData"] and "combined_loader" not in ckpt["loops"]["fit_loop"]["state_dict"]
    second = lightning(out, data, rec, "--ring-kib", "256", "--ckpt-every", str(CKPT_EVERY), "--resume")
    assert f"resuming from step={CKPT_EVERY}.ckpt" in second
    assert_resumed_exactly(lightning_whole, records(rec))


def test_lightning_given_the_dataloader_itself_resumes_a_finite_job_exactly(tmp_path, data):
    """The DataLoader handed to Lightning as it is: Lightning calls iter() on it before
    load_state_dict(), saves rank 0's state in loops.fit_loop.state_dict.combined_loader and loads it
    on every rank; a finite job has a len(), so Lightning prefetches nothing and stops
    at the job's end. len() must not shrink after load_state_dict(): Lightning adds the
    batches done before the checkpoint to what it counts (like torch's DataLoader, whose
    len() is the epoch's)."""
    job = ["--plain", "--epochs", "1", "--sources", "books", "--steps", "0"]
    whole = lightning(tmp_path / "whole", data, tmp_path / "whole.rec", *job)
    out, rec = tmp_path / "cut", tmp_path / "cut.rec"
    lightning(out, data, rec, *job, "--ckpt-every", str(CKPT_EVERY), "--stop-after", str(STOP_AFTER))
    ckpt = torch.load(out / "checkpoints" / f"step={CKPT_EVERY}.ckpt", map_location="cpu", weights_only=False)
    assert len(ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"]) == 1  # rank 0's
    second = lightning(out, data, rec, *job, "--ckpt-every", str(CKPT_EVERY), "--resume")
    assert f"resuming from step={CKPT_EVERY}.ckpt" in second

    full, cut = records(tmp_path / "whole.rec"), records(rec)
    n = len(full[0])
    assert n > STOP_AFTER + 2 and len(full[1]) == n, (len(full[0]), len(full[1]))
    assert f"batches in this epoch: {n}\n" in whole, "len() of the finite job's DataLoader"
    for r in range(2):
        want = full[r][:STOP_AFTER] + full[r][CKPT_EVERY:]
        got = [x["digest"] for x in cut[r]]
        assert got == [x["digest"] for x in want], (
            f"rank {r}: the resumed run trained on {len(got) - STOP_AFTER} batches, the uninterrupted run's "
            f"{[next((k for k, w in enumerate(full[r]) if w['digest'] == g), None) for g in got[STOP_AFTER:]]}; "
            f"expected {list(range(CKPT_EVERY, n))}"
        )
        assert all(x["intact"] for x in full[r] + cut[r])


def test_accelerate_resumes_from_save_state_with_the_batches_of_an_uninterrupted_run(tmp_path, data):
    accelerate(tmp_path / "whole", data, tmp_path / "whole.rec")
    out, rec = tmp_path / "cut", tmp_path / "cut.rec"
    first = accelerate(out, data, rec, "--ckpt-every", str(CKPT_EVERY), "--stop-after", str(STOP_AFTER))
    assert f"stopping after step {STOP_AFTER}" in first
    # save_state wrote the registered loader's state once, from rank 0
    assert sorted(p.name for p in (out / "checkpoint").glob("custom_checkpoint_*.pkl")) == [
        "custom_checkpoint_0.pkl",
        "custom_checkpoint_1.pkl",
    ]  # the loader, the step counter
    second = accelerate(out, data, rec, "--ckpt-every", str(CKPT_EVERY), "--resume")
    assert f"steps {CKPT_EVERY}..{STEPS - 1} (resumed)" in second
    assert_resumed_exactly(records(tmp_path / "whole.rec"), records(rec))
