"""The training examples end to end: torchrun, two ranks, gloo on CPU, a real sidecar.

Train -> checkpoint -> stop -> resume reads the bytes of an uninterrupted run, also for
the steps redone after the checkpoint, and the losses follow them; every run stops its
sidecar and leaves no shared-memory segment behind.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from overlord.shm import list_segments, unlink_all

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]  # make test-slow


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("corpus")  # the first example run writes the demo corpus here


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script: str, out: Path, data: Path, *args: str) -> str:
    """Run an example on two ranks; returns its output. Fails on a non-zero exit or a
    shared-memory segment left behind."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(_free_port()),
        str(ROOT / "examples" / script),
        "--out",
        str(out),
        "--data",
        str(data),
        "--log-every",
        "1",
        *args,
    ]
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, capture_output=True, text=True, timeout=150, env=dict(os.environ, OMP_NUM_THREADS="1")
        )
    finally:
        job = json.loads((out / "job.json").read_text())["name"] if (out / "job.json").exists() else None
        left = list_segments(job) if job else []
        if job:
            unlink_all(job)
    logs = "".join(f"\n== {p}\n{p.read_text()[-3000:]}" for p in sorted(out.rglob("*.log")))
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr[-6000:]}{logs}"
    assert not left, f"shared-memory segments left behind: {left}"
    assert "no shared-memory segment left" in proc.stdout, proc.stdout
    return proc.stdout


def records(prefix: Path) -> dict[int, list[dict]]:
    return {
        r: [json.loads(line) for line in Path(f"{prefix}.rank{r}.jsonl").read_text().splitlines()] for r in range(2)
    }


def test_gpt_resumed_from_a_checkpoint_reads_the_batches_of_an_uninterrupted_run(tmp_path, data):
    steps = ["--steps", "8"]
    torchrun(
        "train_gpt.py", tmp_path / "whole", data, *steps, "--ckpt-every", "0", "--record", str(tmp_path / "whole.rec")
    )
    # preempted after step 5; the last checkpoint is at step 3, so steps 3 and 4 are done again
    out = tmp_path / "cut"
    first = torchrun(
        "train_gpt.py",
        out,
        data,
        *steps,
        "--ckpt-every",
        "3",
        "--stop-after",
        "5",
        "--record",
        str(tmp_path / "cut.rec"),
    )
    assert "stopping after step 5" in first
    second = torchrun(
        "train_gpt.py", out, data, *steps, "--ckpt-every", "3", "--resume", "--record", str(tmp_path / "cut.rec")
    )
    assert "steps 3..7 (resumed)" in second

    whole, cut = records(tmp_path / "whole.rec"), records(tmp_path / "cut.rec")
    positions = [(s, mb) for s in range(8) for mb in range(2)]
    for r in range(2):
        assert [(x["step"], x["microbatch"]) for x in whole[r]] == positions
        # the first run's records (steps 0..4), then the resumed run's (steps 3..7)
        assert [(x["step"], x["microbatch"]) for x in cut[r]] == positions[:10] + positions[6:]
        expected = whole[r][:10] + whole[r][6:]
        assert [x["digest"] for x in cut[r]] == [x["digest"] for x in expected]
        # same bytes, and the model and optimizer restored: the same losses (CPU kernels, one thread)
        assert [x["loss"] for x in cut[r]] == pytest.approx([x["loss"] for x in expected], rel=1e-6)
    assert {x["digest"] for x in whole[0]}.isdisjoint(x["digest"] for x in whole[1])  # ranks read different data
    first_loss = sum(x["loss"] for r in whole for x in whole[r][:2]) / 4
    last_loss = sum(x["loss"] for r in whole for x in whole[r][-2:]) / 4
    assert last_loss < first_loss - 0.1, (first_loss, last_loss)  # it learns

    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    assert ckpt["step"] == 6 and [s["rank"] for s in ckpt["loader"]] == [0, 1]
    assert all((s["step"], s["microbatch"]) == (5, 1) for s in ckpt["loader"])


def test_vlm_trains_on_images_and_text_and_checkpoints(tmp_path, data):
    out = tmp_path / "vlm"
    torchrun("train_vlm.py", out, data, "--steps", "4", "--ckpt-every", "2", "--record", str(tmp_path / "vlm.rec"))
    rec = records(tmp_path / "vlm.rec")
    for r in range(2):
        assert [(x["step"], x["microbatch"]) for x in rec[r]] == [(s, mb) for s in range(4) for mb in range(2)]
        assert all(math.isfinite(x["loss"]) for x in rec[r])
    assert sum(x["images"] for r in rec for x in rec[r]) > 0  # the image encoder saw images
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    assert ckpt["step"] == 4 and any(k.startswith("encoder.") for k in ckpt["model"])
    assert all((s["step"], s["microbatch"]) == (3, 1) for s in ckpt["loader"])
