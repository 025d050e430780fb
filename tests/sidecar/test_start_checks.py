"""Start-up refusals of issue 17, over real files and real processes: transforms that do
not import or build, and jobs that can never yield, are named by `overlord check` and
make `overlord sidecar` exit 2 before it starts anything, each naming the source."""

from __future__ import annotations

import re
import subprocess
import sys
import uuid

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from overlord.config import BatchSpec, Job, Mesh, Source
from overlord.errors import StartupError
from overlord.shm import list_segments
from overlord.sidecar.checks import check_sources, check_transforms, run_checks, source_rows, yield_problem

BROKEN = {
    "nomodule": (
        "tests.integration.no_such_module:text",
        None,
        r"module 'tests.integration.no_such_module' cannot be imported",
    ),
    "raising": (
        "tests.integration.raising_transform:text",
        None,
        r"importing 'tests.integration.raising_transform' failed: RuntimeError\('this transform module is "
        r"broken at import'\); fix that module",
    ),
    "noattr": (
        "tests.integration.bad_transforms:no_such_transform",
        None,
        r"'tests.integration.bad_transforms' has no attribute 'no_such_transform'",
    ),
    "factory": (
        "tests.integration.bad_transforms:failing_factory",
        {"tokenizer": "/nowhere/tok.json"},
        r"with Source.transform_args \{'tokenizer': '/nowhere/tok.json'\} failed to build its transform: "
        r"FileNotFoundError: tokenizer file '/nowhere/tok.json' does not exist",
    ),
}


def parquet(path, rows: int) -> str:
    pq.write_table(
        pa.table({"text": [f"row {i}" for i in range(rows)]}, schema=pa.schema([("text", pa.string())])), path
    )
    return str(path)


def job(tmp_path, sources, **kw) -> Job:
    return Job(
        name=f"t{uuid.uuid4().hex[:8]}",
        sources=tuple(sources),
        mesh=Mesh(dp=1),
        run_dir=str(tmp_path / "run"),
        batch=BatchSpec(global_batch=8, context_length=256, ring_bytes=1 << 20),
        **kw,
    )


def run_cli(tmp_path, j: Job, command: str) -> subprocess.CompletedProcess:
    config = tmp_path / f"{j.name}.json"
    config.write_text(j.to_json())
    done = subprocess.run(
        [sys.executable, "-m", "overlord.cli", command, "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert not list_segments(j.name), "a refused sidecar creates no shared memory"
    return done


@pytest.fixture
def good(tmp_path):
    return parquet(tmp_path / "good.parquet", 20)


def test_each_broken_transform_is_named_with_its_source(tmp_path, good):
    for name, (spec, args, message) in BROKEN.items():
        j = job(
            tmp_path,
            [Source(name="good", paths=(good,)), Source(name=name, paths=(good,), transform=spec, transform_args=args)],
        )
        with pytest.raises(StartupError, match=rf"^source '{name}': transform spec '{spec}'.*{message}"):
            check_transforms(j)
    check_transforms(job(tmp_path, [Source(name="good", paths=(good,))]))  # a good one passes
    with pytest.raises(
        StartupError,
        match=r"^source 'deferred': transform spec 'tests.integration.bad_transforms:nope'"
        r".*has no attribute 'nope'",
    ):
        check_transforms(
            job(tmp_path, [Source(name="deferred", paths=(good,), decode="tests.integration.bad_transforms:nope")])
        )


def test_check_and_sidecar_name_every_broken_transform_and_its_source(tmp_path, good):
    sources = [
        Source(name=name, paths=(good,), transform=spec, transform_args=args)
        for name, (spec, args, _) in BROKEN.items()
    ]
    j = job(tmp_path, [Source(name="good", paths=(good,)), *sources])
    check = run_cli(tmp_path, j, "check")
    assert check.returncode == 1, check.stdout + check.stderr
    line = next(ln for ln in check.stdout.splitlines() if ln.startswith("FAIL transforms: "))
    sidecar = run_cli(tmp_path, j, "sidecar")
    assert sidecar.returncode == 2, sidecar.stderr
    assert "StartupError: source 'nomodule'" in sidecar.stderr, sidecar.stderr
    for name, (spec, _, message) in BROKEN.items():
        for out in (line, sidecar.stderr):
            assert re.search(rf"source '{name}': transform spec '{spec}'.*{message}", out), out
    assert "source 'good'" not in line
    assert "ok   sources" in check.stdout


def test_source_rows_stops_at_the_first_file_with_rows(tmp_path):
    empty, full = parquet(tmp_path / "a.parquet", 0), parquet(tmp_path / "b.parquet", 5)
    (tmp_path / "c.jsonl").write_text("\n  \n")
    assert source_rows(Source(name="s", paths=(empty, full))) == (5, [empty, full], [])
    assert source_rows(Source(name="s", paths=(str(tmp_path / "c.jsonl"),), format="jsonl")) == (
        0,
        [str(tmp_path / "c.jsonl")],
        [],
    )


def test_yield_problem_refuses_what_can_never_yield(tmp_path, good):
    empty = parquet(tmp_path / "empty.parquet", 0)
    sources = [Source(name="web", paths=(good,)), Source(name="books", paths=(empty,))]
    files = {"books": ([empty], [])}
    error, warning = yield_problem(job(tmp_path, sources), files)
    assert (
        warning is None
        and error.startswith("job ")
        and (
            f"source 'books' has 0 rows in its file(s) '{empty}'; with epochs: null it can never yield a sample"
            in error
        )
    )
    assert "remove it from Job.sources" in error
    error, warning = yield_problem(job(tmp_path, sources, epochs=2), files)
    assert (
        error is None and "source 'books' has 0 rows" in warning and "yields nothing in the job's 2 epoch(s)" in warning
    )
    error, _ = yield_problem(job(tmp_path, sources[1:], epochs=1), files)
    assert "has no data at all: source 'books' has 0 rows" in error and "could never yield a batch" in error
    (tmp_path / "random.parquet").write_bytes(b"PAR1 not parquet PAR1")
    source = Source(name="books", paths=(empty, str(tmp_path / "random.parquet")), on_error="skip")
    rows, seen, unreadable = source_rows(source)
    assert (rows, seen) == (0, [empty, str(tmp_path / "random.parquet")]) and len(unreadable) == 1
    error, _ = yield_problem(job(tmp_path, [source], epochs=1), {"books": (seen, unreadable)})
    assert re.search(r"source 'books' has 0 rows in its file\(s\) .* \(unreadable: '.*random.parquet': .*\)", error), (
        error
    )
    assert yield_problem(job(tmp_path, sources), {}) == (None, None)


@pytest.mark.parametrize("case", ["empty jsonl alone", "no data at all", "empty next to a good source, epochs null"])
def test_a_job_that_can_never_yield_is_refused_by_check_and_sidecar(tmp_path, good, case):
    jsonl = tmp_path / "only.jsonl"
    jsonl.write_text("")
    empty = parquet(tmp_path / "empty.parquet", 0)
    sources, epochs, words = {
        "empty jsonl alone": (
            [Source(name="web", paths=(str(jsonl),), format="jsonl")],
            1,
            [f"has no data at all: source 'web' has 0 rows in its file(s) '{jsonl}'"],
        ),
        "no data at all": (
            [Source(name="web", paths=(empty,)), Source(name="code", paths=(str(jsonl),), format="jsonl")],
            None,
            [
                "has no data at all",
                f"source 'web' has 0 rows in its file(s) '{empty}'",
                f"source 'code' has 0 rows in its file(s) '{jsonl}'",
            ],
        ),
        "empty next to a good source, epochs null": (
            [Source(name="web", paths=(good,)), Source(name="books", paths=(empty,))],
            None,
            [f"source 'books' has 0 rows in its file(s) '{empty}'; with epochs: null it can never yield"],
        ),
    }[case]
    j = job(tmp_path, sources, epochs=epochs)
    with pytest.raises(StartupError) as info:
        check_sources(j)
    assert all(w in str(info.value) for w in words), str(info.value)
    assert dict(run_checks(j, 1, None))["sources"] == str(info.value)
    if case == "empty jsonl alone":  # and through the processes (one case: each costs an interpreter start)
        check = run_cli(tmp_path, j, "check")
        assert check.returncode == 1 and f"FAIL sources: {info.value}" in check.stdout, check.stdout
        sidecar = run_cli(tmp_path, j, "sidecar")
        assert sidecar.returncode == 2 and f"StartupError: {info.value}" in sidecar.stderr, sidecar.stderr


def test_an_empty_source_beside_a_good_one_in_a_finite_job_is_only_warned(tmp_path, good, caplog):
    empty = parquet(tmp_path / "empty.parquet", 0)
    check_sources(job(tmp_path, [Source(name="web", paths=(good,)), Source(name="books", paths=(empty,))], epochs=1))
    assert "source 'books' has 0 rows" in caplog.text
