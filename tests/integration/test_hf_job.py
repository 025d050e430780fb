"""A real job over Hugging Face data: a save_to_disk directory and a split of the HF cache
(format: hf), tokenized by a tokenizer trained here (overlord.transforms_hf:Tokenize),
through a sidecar and two trainer ranks: every row arrives exactly once, as its text's
ids between BOS and EOS, truncated to context_length; and a missing tokenizer.json
is refused at sidecar start, naming the source, the file and the fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from dataclasses import replace

import datasets
import pytest
from harness import Cluster
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from overlord.config import BatchSpec, Job, Mesh, Source
from overlord.shm import list_segments, unlink_all

pytestmark = pytest.mark.timeout(180)

datasets.disable_progress_bars()
WORDS = "the quick brown fox jumps over a lazy dog while every sample arrives exactly once".split()


def text(i: int) -> str:
    return " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(3 + i % 11)) + f" {i}"


@pytest.fixture
def hf_job(tmp_path):
    """Two HF sources and a BPE tokenizer trained on their text, as a job config."""
    saved = {"text": [text(i) for i in range(120)]}
    datasets.Dataset.from_dict(saved).save_to_disk(str(tmp_path / "wiki"), num_shards=2)
    lines = tmp_path / "books.jsonl"
    books = [text(1000 + i) for i in range(80)]
    lines.write_text("".join(json.dumps({"text": t, "n": i}) + "\n" for i, t in enumerate(books)))
    ds = datasets.load_dataset(
        "json", data_files={"train": str(lines)}, cache_dir=str(tmp_path / "cache"), split="train"
    )
    cache_dir = os.path.dirname(ds.cache_files[0]["filename"])

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        saved["text"] + books,
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=["<pad>", "<s>", "</s>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tok.save(str(tmp_path / "tokenizer.json"))

    tokenize = dict(
        transform="overlord.transforms_hf:Tokenize", transform_args={"tokenizer": str(tmp_path / "tokenizer.json")}
    )
    job = Job(
        name=f"t{uuid.uuid4().hex[:8]}",
        sources=(
            Source(
                name="wiki", format="hf", paths=(str(tmp_path / "wiki"),), weight=0.6, shuffle_window=32, **tokenize
            ),
            Source(
                name="books",
                format="hf",
                paths=(os.path.join(cache_dir, "train"),),
                weight=0.4,
                shuffle_window=32,
                **tokenize,
            ),
        ),
        mesh=Mesh(dp=2),
        batch=BatchSpec(global_batch=8, micro_batches=1, context_length=12, packing=False, ring_bytes=1 << 20),
        seed=7,
        epochs=1,
        run_dir=str(tmp_path / "run"),
        timeout_s=20.0,
        sample_ring_bytes=1 << 20,
        buffer_samples=64,
    )
    texts = {
        f"wiki:{f}:{r}": t
        for f, part in enumerate((saved["text"][:60], saved["text"][60:]))
        for r, t in enumerate(part)
    }
    texts |= {f"books:0:{r}": t for r, t in enumerate(books)}
    made: list[Cluster] = []

    def cluster(job: Job = job) -> Cluster:
        workdir = tmp_path / f"work{len(made)}"
        workdir.mkdir()
        made.append(Cluster(job, workdir))
        return made[-1]

    yield cluster, texts, Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    for c in made:
        try:
            c.stop()
        finally:
            c.kill_all()
            left = list_segments(c.job.name)
            unlink_all(c.job.name)
        assert not left, f"shared-memory segments left behind: {left}"


def test_hf_sources_tokenized_arrive_exactly_once_as_their_text(hf_job):
    make, texts, tok = hf_job
    cluster = make()
    assert [os.path.basename(p) for p in Source.files(cluster.job.sources[0])] == [
        "data-00000-of-00002.arrow",
        "data-00001-of-00002.arrow",
    ]
    cluster.start_sidecar()
    trainer = os.path.join(os.path.dirname(__file__), "tokens_trainer.py")
    world = cluster.job.mesh.world_size
    procs = [
        subprocess.Popen(
            [sys.executable, trainer, str(cluster.config), str(cluster.out(r))],
            env=dict(os.environ, RANK=str(r), WORLD_SIZE=str(world)),
        )
        for r in range(world)
    ]
    for proc in procs:
        assert proc.wait(timeout=150) == 0, cluster.log()
    results = [json.loads(cluster.out(r).read_text()) for r in range(world)]
    assert [r["end"] for r in results] == ["stop"] * world, cluster.log()
    samples = [s for r in results for s in r["samples"]]
    assert sorted(k for k, _ in samples) == sorted(texts), "every row of both sources exactly once"
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    cut = 0
    for key, ids in samples:
        assert ids[0] == bos and ids[-1] == eos and len(ids) <= 12, (key, ids)
        decoded = tok.decode(ids[1:-1])
        assert texts[key].startswith(decoded), (key, decoded, texts[key])
        cut += decoded != texts[key]
    assert 0 < cut < len(samples), "long rows were cut at context_length, short ones kept whole"
    assert cluster.stop() == 0


def test_a_missing_tokenizer_is_refused_at_start_naming_source_file_and_fix(hf_job, tmp_path):
    """The sidecar builds every transform before it starts anything (issue 17): a missing
    tokenizer.json is its exit status and message, not an error at the first batch."""
    make, _, _ = hf_job
    job = make().job
    missing = str(tmp_path / "gone" / "tokenizer.json")
    broken = replace(
        job,
        name=f"t{uuid.uuid4().hex[:8]}",
        run_dir=str(tmp_path / "run-broken"),
        sources=tuple(
            replace(s, transform_args={"tokenizer": missing}) if s.name == "books" else s for s in job.sources
        ),
    )
    cluster = make(broken)
    run = subprocess.run(
        [sys.executable, "-m", "overlord.cli", "sidecar", "--config", str(cluster.config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2, run.stderr
    assert (
        f"StartupError: source 'books': transform Tokenize: tokenizer file '{missing}' does not exist; "
        "set transform_args.tokenizer to a tokenizer.json" in run.stderr
    ), run.stderr
