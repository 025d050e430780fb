"""`Source`: one data source, and the checks of its paths."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from overlord.config._checks import check_name
from overlord.errors import ConfigError

FORMATS = ("hf", "jsonl", "parquet")  # readers in overlord/loader/formats.py
ON_ERROR = ("raise", "skip")


@dataclass(frozen=True, kw_only=True, slots=True)
class Source:
    """One data source: a set of files read by its Source Loader(s).

    Attributes:
        name: unique name; appears in sample keys, Redis keys, logs and metrics.
        paths: files or glob patterns (expanded and sorted at load time): local paths, or
            URIs of a pyarrow.fs filesystem (s3://bucket/data/train-*.parquet, gs://,
            hdfs://, file://) configured by the URI's query
            (?endpoint_override=host:port&scheme=http&region=...) or the standard
            environment (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
            AWS_DEFAULT_REGION); see overlord/loader/storage.py. For format "hf", local
            Hugging Face datasets: a directory ds.save_to_disk wrote, one split of a saved
            DatasetDict or of a dataset in the HF cache as "<directory>/<split>", or
            Arrow files (ds.cache_files); not a datasets.Dataset object.
        format: "parquet" (row groups are the files' own), "jsonl" (one JSON object per
            line, plain or .gz/.zst/.bz2; 1,024 lines make a row group, and a compressed
            file is one row group, read whole) or "hf" (Hugging Face datasets' Arrow
            files, memory-mapped; a record batch is a row group). See
            overlord/loader/formats.py and overlord/loader/hf.py.
        transform: sample transform as "module:callable" (see overlord.transforms); with
            transform_args, the callable is a factory that builds the transform.
        transform_args: keyword arguments of the transform factory `transform` names,
            e.g. {tokenizer: /models/llama/tokenizer.json} for
            overlord.transforms_hf:Tokenize; a factory with a context_length parameter gets
            BatchSpec.context_length unless given here. None: `transform` is the transform.
        weight: mixing weight (relative; weights of a job need not sum to 1).
        columns: columns to read; None reads every column.
        shuffle_window: rows shuffled together inside the source's order (bounded memory).
        partitions: how many Source Loaders split this source's row groups.
        on_error: "raise" stops the job on a bad row; "skip" drops it and counts it.
        transform_timeout_s: the per-sample deadline of the transform: a sample whose
            transform runs longer fails the job with a SourceReadError naming source,
            file and row (a hang is never skipped: it depends on the machine, not the
            file). None: half of Job.timeout_s (30 s by default), so the sample is named
            before a Planner or trainer wait gives up; an explicit value must be below
            Job.timeout_s.
        difficulty: a numeric column to read the source easy-to-hard by (a curriculum):
            each epoch visits row groups in ascending order of that column's Parquet
            statistics (midpoint of min and max) instead of a random permutation, still
            shuffling inside the window. None: random row-group order.
        decode: a second transform "module:callable" the Data Constructor applies to each
            sample (dict of arrays in, dict of arrays out) before packing, so a heavy
            decode runs there and compressed bytes travel instead of pixels
            (transformation reordering), e.g. transform image_text_deferred with decode
            overlord.transforms:decode_image. None: the transform does everything.
        shadow: keep a Shadow Loader (hot standby) for the loader process(es) hosting
            this source, so that losing one does not stall the trainers while the
            files are read again; on several nodes it runs on a node other than its
            loader's and takes over a dead or cut-off node's loader (costs the memory
            of a second read buffer).
        buffer_bytes: byte cap of each of this source's read buffers (one per loader
            partition); None: Job.buffer_bytes. A source of large samples (images) may
            want more room, one read rarely less.
    """

    name: str
    paths: tuple[str, ...]
    format: str = "parquet"
    transform: str = "overlord.transforms:text"
    transform_args: dict[str, Any] | None = None
    weight: float = 1.0
    columns: tuple[str, ...] | None = None
    shuffle_window: int = 256
    partitions: int = 1
    on_error: str = "raise"
    transform_timeout_s: float | None = None
    difficulty: str | None = None
    decode: str | None = None
    shadow: bool = False
    buffer_bytes: int | None = None

    def __post_init__(self) -> None:
        check_name("Source.name", self.name)
        where = f"source {self.name!r}"
        _refuse_datasets_object(where, self.paths)
        if isinstance(self.paths, str):
            object.__setattr__(self, "paths", (self.paths,))
        else:
            object.__setattr__(self, "paths", tuple(str(p) for p in self.paths))
        if not self.paths:
            raise ConfigError(f"{where}: Source.paths is empty; give at least one file or glob")
        if self.format not in FORMATS:
            raise ConfigError(f"{where}: Source.format={self.format!r}; supported: {FORMATS}")
        if not isinstance(self.transform, str) or ":" not in self.transform:
            raise ConfigError(
                f"{where}: Source.transform={self.transform!r} must be 'module:callable', "
                "e.g. 'overlord.transforms:text'"
            )
        if self.transform_args is not None:
            if not isinstance(self.transform_args, Mapping) or not all(isinstance(k, str) for k in self.transform_args):
                raise ConfigError(
                    f"{where}: Source.transform_args={self.transform_args!r} must be a mapping of argument names "
                    f"to values (the keyword arguments of the factory {self.transform!r}), or null"
                )
            try:
                object.__setattr__(self, "transform_args", json.loads(json.dumps(dict(self.transform_args))))
            except (TypeError, ValueError) as exc:
                raise ConfigError(
                    f"{where}: Source.transform_args must be plain data (it crosses processes as JSON): {exc}"
                ) from None
        if not isinstance(self.weight, (int, float)) or not math.isfinite(self.weight) or self.weight < 0:
            raise ConfigError(f"{where}: Source.weight={self.weight!r} must be a finite number >= 0")
        if self.buffer_bytes is not None and (
            isinstance(self.buffer_bytes, bool) or not isinstance(self.buffer_bytes, int) or self.buffer_bytes < 1
        ):
            raise ConfigError(f"{where}: Source.buffer_bytes={self.buffer_bytes!r} must be an int >= 1, or null")
        if self.columns is not None:
            object.__setattr__(self, "columns", tuple(self.columns))
        if not isinstance(self.shuffle_window, int) or self.shuffle_window < 1:
            raise ConfigError(f"{where}: Source.shuffle_window={self.shuffle_window!r} must be an int >= 1")
        if not isinstance(self.partitions, int) or self.partitions < 1:
            raise ConfigError(f"{where}: Source.partitions={self.partitions!r} must be an int >= 1")
        if self.on_error not in ON_ERROR:
            raise ConfigError(f"{where}: Source.on_error={self.on_error!r}; use one of {ON_ERROR}")
        if self.transform_timeout_s is not None and not (
            isinstance(self.transform_timeout_s, (int, float)) and 0 < self.transform_timeout_s < math.inf
        ):
            raise ConfigError(
                f"{where}: Source.transform_timeout_s={self.transform_timeout_s!r} must be a number of "
                "seconds > 0, or null (half of Job.timeout_s)"
            )

    def files(self) -> list[str]:
        """Expand `paths` (globs, local or URIs) into the source's files: each pattern's
        matches sorted, patterns in order.

        Raises:
            SourceReadError: a path or glob matches no file, or cannot be listed.
        """
        # cycle: overlord.loader imports overlord.config; deferred too: loader.formats brings pyarrow (~0.3 s)
        from overlord.loader.formats import locations

        return [loc.uri for loc in locations(self.name, self.format, self.paths)]


def _refuse_datasets_object(where: str, paths: object) -> None:
    """A `datasets.Dataset` (or DatasetDict) given as Source.paths: say how to give its files."""
    for value in (paths, *(paths if isinstance(paths, (list, tuple)) else ())):
        kind = type(value)
        if kind.__module__.split(".")[0] != "datasets":
            continue
        name = f"datasets.{kind.__name__}"
        files = getattr(value, "cache_files", None)
        if isinstance(files, dict):  # a DatasetDict: files per split
            split = next(iter(files), "train")
            raise ConfigError(
                f"{where}: Source.paths is a {name} object; a Source reads files, in every loader process. "
                f"Save it, ds.save_to_disk('/data/x'), and give one split: Source(format='hf', "
                f"paths=('/data/x/{split}',)); a source per split to read several"
            )
        listed = [f.get("filename") for f in files or () if isinstance(f, dict)]
        cached = (
            (
                f"; or give the Arrow files it was loaded from, ds.cache_files ({listed[:2]}{' ...' if len(listed) > 2 else ''}): "
                "every row of those files, more than the dataset's after a select, filter or shard"
            )
            if listed
            else " (it is in memory: it has no files yet)"
        )
        raise ConfigError(
            f"{where}: Source.paths is a {name} object; a Source reads files, in every loader process. Save it "
            "and give the directory: ds.save_to_disk('/data/x') with Source(format='hf', paths=('/data/x',)), "
            f"exactly its rows{cached}"
        )
