"""A DP x CP x TP = 2x2x2 mesh of trainer processes fed by a running sidecar."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from overlord import BatchSpec, Mesh
from overlord.constructor.parallel import cp_merge
from overlord.plan.cost import transformer_cost

pytestmark = pytest.mark.timeout(240)
BATCHES = 6  # micro-batches each rank records


@pytest.mark.slow  # make test-slow (CI runs it): keeps make test under 6 minutes on 2 cores
def test_2x2x2_mesh_gets_cp_slices_tp_markers_and_balanced_steps(cluster, tmp_path):
    mesh = Mesh(dp=2, cp=2, tp=2)
    c = cluster(
        mesh=mesh,
        batch=BatchSpec(global_batch=32, micro_batches=2, context_length=1024, ring_bytes=2 << 20),
        strategy="tests.integration.strategies:balanced_broadcast_tp",
    )
    c.start_sidecar()
    metas, arrays = _run_trainers(c, tmp_path / "arrays")

    for dp in range(2):
        ranks = mesh.ranks_of_dp(dp)  # [cp0tp0, cp0tp1, cp1tp0, cp1tp1]
        # every rank of the group saw the same micro-batches (same samples)
        assert len({json.dumps([m["keys"] for m in metas[r]]) for r in ranks}) == 1
        for i in range(BATCHES):
            cp0, tp1_of_cp0, cp1, tp1_of_cp1 = (arrays[(r, i)] for r in ranks)
            # TP rank 1 receives only the broadcast marker, shaped like TP rank 0's data
            for marker, data in ((tp1_of_cp0, cp0), (tp1_of_cp1, cp1)):
                assert int(marker["broadcast_from_tp0"]) == 1 and "input_ids" not in marker
                assert list(marker["shape.input_ids"]) == list(data["input_ids"].shape)
            # the two CP slices are equal halves that reassemble every document in order
            assert cp0["input_ids"].size == cp1["input_ids"].size
            assert int(cp0["cp_rank"]) == 0 and int(cp1["cp_rank"]) == 1
            whole = cp_merge([cp0, cp1], 2)
            ids, lengths = whole["input_ids"].reshape(-1), whole["doc_lengths"]
            starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
            originals = [ids[s : s + n] for s, n in zip(starts, lengths)]
            assert len(originals) == len(metas[ranks[0]][i]["keys"])
            for doc in originals:  # a document: tokens then its padding to a multiple of 2*cp
                real = doc[doc != 0]
                assert real[0] == 1 and real[-1] == 2  # bos ... eos, nothing lost or reordered
                assert np.all(doc[len(real) :] == 0) and len(doc) % 4 == 0

    # balanced: per step, the two DP groups carry nearly the same attention cost
    imbalance = []
    for i in range(0, BATCHES, 2):  # micro-batches 2k, 2k+1 form step k
        costs = []
        for dp in range(2):
            rank = mesh.ranks_of_dp(dp)[0]
            tokens = np.concatenate([_doc_tokens(arrays[(rank, j)]) for j in (i, i + 1)])
            costs.append(float(transformer_cost(tokens).sum()))
        imbalance.append(max(costs) / np.mean(costs))
    print("DP imbalance per step", imbalance)
    assert np.median(imbalance) < 1.1, imbalance
    assert c.stop() == 0


def _run_trainers(c, out: Path) -> tuple[dict, dict]:
    """Run every rank of the job as a trainer process that saves its first micro-batches."""
    out.mkdir()
    world = c.job.mesh.world_size
    procs = [
        subprocess.Popen(
            [sys.executable, str(Path(__file__).parent / "array_trainer.py"), str(c.config), str(out), str(BATCHES)],
            env=dict(os.environ, RANK=str(r), WORLD_SIZE=str(world)),
        )
        for r in range(world)
    ]
    assert [p.wait(timeout=180) for p in procs] == [0] * world, c.log()
    metas = {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(world)}
    arrays = {(r, i): dict(np.load(out / f"rank{r}-{i}.npz")) for r in range(world) for i in range(BATCHES)}
    return metas, arrays


def _doc_tokens(cp_slice: dict) -> np.ndarray:
    """Unpadded document lengths of a micro-batch, from a CP slice's global cu_seqlens."""
    return np.diff(cp_slice["cu_seqlens_global"]).astype(np.int64)


@pytest.mark.slow  # make test-slow (CI runs it): keeps make test under 6 minutes on 2 cores
def test_vlm_encoder_world_delivers_each_image_to_one_encoder_rank(cluster, corpus, tmp_path):
    from dataclasses import replace

    mesh = Mesh(dp=2, tp=2)
    base = cluster()
    sources = tuple(replace(s, weight=1.0 if s.name == "images" else 0.2) for s in base.job.sources)
    c = cluster(
        mesh=mesh,
        sources=sources,
        strategy="overlord.plan.strategies:vlm_encoder_world",
        batch=BatchSpec(global_batch=16, micro_batches=2, context_length=1024, ring_bytes=4 << 20),
    )
    c.start_sidecar()
    metas, arrays = _run_trainers(c, tmp_path / "vlm")
    for first in range(0, BATCHES, 2):  # micro-batch 0 of each step carries the step's encoder work
        encoded = []
        for r in range(4):
            a = arrays[(r, first)]
            assert "pixel_values" not in a  # backbone micro-batches carry no pixels
            grid, dest = a["encoder_image_grid"], a["encoder_dest"]
            assert len(grid) == len(dest) and a["encoder_pixel_values"].shape[0] == int((grid[:, 0] * grid[:, 1]).sum())
            for row, (bucket, mb, doc, image) in zip(grid, dest):
                owner = mesh.ranks_of_dp(int(bucket))[0]
                key = metas[owner][first + int(mb)]["keys"][int(doc)]
                backbone = arrays[(owner, first + int(mb))]
                assert key.startswith("images:")
                assert list(backbone["image_grid"][list(backbone["image_doc"]).index(int(doc)) + int(image)]) == list(
                    row
                )
                encoded.append(key)
        in_step = {
            k
            for dp in range(2)
            for i in (first, first + 1)
            for k in metas[mesh.ranks_of_dp(dp)[0]][i]["keys"]
            if k.startswith("images:")
        }
        assert sorted(encoded) == sorted(in_step), "every image of the step is encoded exactly once"
    assert c.stop() == 0
