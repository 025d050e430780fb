"""Fixtures for integration tests: a real corpus, real sidecars, real trainer processes.

Every process is started with a timeout on its wait, and every test checks that no
shared-memory segment of its job is left behind.
"""

from __future__ import annotations

import pytest
from harness import Cluster, make_job  # noqa: F401 - fixtures below, and tests, use them

from overlord.config import Job
from overlord.demo.corpus import generate_corpus
from overlord.shm import list_segments, unlink_all


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> dict[str, list[str]]:
    return generate_corpus(
        tmp_path_factory.mktemp("corpus"),
        seed=5,
        text_sources=3,
        image_sources=1,
        rows_per_source=240,
        files_per_source=2,
        row_group_size=32,
        max_image_side=96,
    )


@pytest.fixture(scope="session")
def corpus_keys(corpus) -> set[str]:
    """The key of every row of the corpus: what one epoch must deliver exactly once."""
    import pyarrow.parquet as pq

    keys = set()
    for name, files in corpus.items():
        for f, path in enumerate(sorted(files)):
            keys |= {f"{name}:{f}:{row}" for row in range(pq.ParquetFile(path).metadata.num_rows)}
    return keys


@pytest.fixture
def cluster(corpus, tmp_path):
    made: list[Cluster] = []

    def factory(job: Job | None = None, **overrides) -> Cluster:
        """A cluster for a new job built from `overrides`, or for `job` as given."""
        job = job or make_job(corpus, tmp_path / f"run{len(made)}", **overrides)
        workdir = tmp_path / f"work{len(made)}"
        workdir.mkdir()
        made.append(Cluster(job, workdir))
        return made[-1]

    yield factory
    for c in made:
        try:
            c.stop()
        finally:
            c.kill_all()
            left = list_segments(c.job.name)
            unlink_all(c.job.name)
        assert not left, f"shared-memory segments left behind: {left}"
