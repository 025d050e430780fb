"""Typed job configuration: `Job`, `Source`, `Mesh`, `BatchSpec`.

A job is declared in Python (the trainer) or YAML/JSON (the sidecar) and validated on
construction, so a bad field fails at start with a message that names the field and says
what to change. Configs cross process boundaries as JSON (`Job.to_dict` /
`Job.from_dict`), never as pickles.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode

from overlord.errors import ConfigError

_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,48}$")
FORMATS = ("hf", "jsonl", "parquet")  # readers in overlord/loader/formats.py
ON_ERROR = ("raise", "skip")


def _check_name(kind: str, value: str) -> None:
    if not isinstance(value, str) or not _NAME_RE.match(value):
        raise ConfigError(
            f"{kind} {value!r} is not a valid name; use 1-48 characters from "
            "letters, digits, '_' and '-' (it appears in Redis keys and shm names)"
        )


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
            files are read again (costs the memory of a second read buffer).
    """

    name: str
    paths: tuple[str, ...]
    format: str = "parquet"
    transform: str = "overlord.transforms:text"
    transform_args: dict | None = None
    weight: float = 1.0
    columns: tuple[str, ...] | None = None
    shuffle_window: int = 256
    partitions: int = 1
    on_error: str = "raise"
    transform_timeout_s: float | None = None
    difficulty: str | None = None
    decode: str | None = None
    shadow: bool = False

    def __post_init__(self) -> None:
        _check_name("Source.name", self.name)
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
        from overlord.loader.formats import locations  # pyarrow is heavy for a config module

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


@dataclass(frozen=True, kw_only=True, slots=True)
class Mesh:
    """The trainer's device mesh. Rank order is dp-major, tp fastest (Megatron's).

    Attributes:
        dp: data-parallel groups; each gets its own share of every step's samples,
            built by one Data Constructor. BatchSpec.global_batch must be a multiple of it.
        pp: pipeline stages of a group: the first stage receives the inputs, the last the
            labels and loss mask, middle stages only the packing metadata.
        cp: context-parallel ranks of a group: each receives a zigzag slice (chunks r and
            2*cp-1-r) of every document.
        tp: tensor-parallel ranks of a group: they receive the same micro-batch, or, with
            a strategy's broadcast_at("TP"), tp rank 0 the bytes and the others a marker
            with the shapes.
    """

    dp: int = 1
    pp: int = 1
    cp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for axis in ("dp", "pp", "cp", "tp"):
            value = getattr(self, axis)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"Mesh.{axis}={value!r} must be an int >= 1")

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    def coords(self, rank: int) -> dict[str, int]:
        """Mesh coordinates of a global rank: {"dp", "pp", "cp", "tp"}."""
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank} is outside the mesh (world size {self.world_size})")
        tp = rank % self.tp
        cp = (rank // self.tp) % self.cp
        pp = (rank // (self.tp * self.cp)) % self.pp
        dp = rank // (self.tp * self.cp * self.pp)
        return {"dp": dp, "pp": pp, "cp": cp, "tp": tp}

    def ranks_of_dp(self, dp: int) -> list[int]:
        """Global ranks that consume data-parallel group `dp`'s batches."""
        per = self.pp * self.cp * self.tp
        return list(range(dp * per, (dp + 1) * per))


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchSpec:
    """What one step delivers.

    Attributes:
        global_batch: samples per step across all data-parallel groups.
        micro_batches: micro-batches per step per data-parallel group.
        context_length: tokens per packed row (and the truncation length).
        packing: pack several documents per row (cu_seqlens) instead of one padded row each.
        ring_bytes: capacity of each client's shared-memory ring.
        drop_last: drop a final partial step at the end of the last epoch.
        vocab_size: the model's vocabulary size: every token id a transform returns
            (input_ids, labels) must lie in [0, vocab_size), else the row is a bad row
            (see Source.on_error). None: token ids are only checked to be >= 0.
    """

    global_batch: int = 32
    micro_batches: int = 1
    context_length: int = 2048
    packing: bool = True
    ring_bytes: int = 16 << 20
    drop_last: bool = False
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        for name in ("global_batch", "micro_batches", "context_length", "ring_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"BatchSpec.{name}={value!r} must be an int >= 1")
        if self.vocab_size is not None and (
            not isinstance(self.vocab_size, int) or isinstance(self.vocab_size, bool) or self.vocab_size < 1
        ):
            raise ConfigError(
                f"BatchSpec.vocab_size={self.vocab_size!r} must be an int >= 1 (the model's vocabulary size), or null"
            )
        if self.ring_bytes < 1 << 16:
            raise ConfigError(f"BatchSpec.ring_bytes={self.ring_bytes} is below 64 KiB; raise it")


@dataclass(frozen=True, kw_only=True, slots=True)
class Job:
    """A training job's data: its sources, the trainer mesh, the batch and the runtime.

    Attributes:
        name: job name; the Redis key prefix and shm names carry it.
        sources: the data sources (names unique).
        mesh: trainer mesh; its world size must match the trainer's WORLD_SIZE.
        batch: what each step delivers.
        seed: job seed; with the step it fixes every batch's bytes.
        epochs: stop after this many passes over every source; None runs forever.
        redis_url: external Redis (redis://, rediss://, unix://); None starts an embedded one.
            Its password never leaves the process that was given it: stored configs
            (`to_dict`/`to_json`: job.json in the run directory, the Redis job key,
            spawned-job.json) hold the URL without it, and processes take it from
            $OVERLORD_REDIS_PASSWORD, or from the file $OVERLORD_REDIS_PASSWORD_FILE
            names (readable by its owner only, mode 0600). Put it in the URL of a config
            file only you can read (`rediss://user:pw@host:6379/0`), or leave it out
            (`rediss://user@host:6379/0`) and set one of those variables; the sidecar
            hands it to its roles and servers in their environment, never in argv or a
            file.
        run_dir: where the sidecar keeps its socket, logs and embedded Redis data.
        loader_processes: processes hosting Source Loaders (the CPU budget); None picks.
        buffer_samples: bound of each Source Loader's read buffer, in samples.
        sample_ring_bytes: capacity of each ring from a loader process to a Data Constructor.
        plan_ahead: how many steps the Planner may plan past what the slowest trainer consumed
            (and past the slowest Data Constructor): a metric reported at step t shapes the plan
            of step t + plan_ahead + 1 at the latest, whatever the ring sizes.
        timeout_s: longest wait anywhere before an error is raised.
        redis_outage_s: how long roles and trainers wait for an unreachable Redis (gone,
            frozen, failing over) before they fail with an error naming it; the trainers
            keep consuming what their rings hold meanwhile. The default covers a Sentinel
            failover.
        flight_port: serve the trainers' micro-batches over Arrow Flight on this TCP port
            (overlord.remote), for trainers without a sidecar on their node; requests
            carry the job's token ($OVERLORD_FLIGHT_TOKEN, or the run directory's
            flight.token). None: no remote path.
        metrics_port: serve Prometheus metrics on this TCP port (`/metrics`, on
            `metrics_host`), from a process of the sidecar's own; a sidecar's
            `--metrics-port` sets it per node. None: no endpoint. With
            $OVERLORD_METRICS_TOKEN set (in the sidecar's environment) a request must
            carry `Authorization: Bearer <token>`, or it gets 401.
        metrics_host: the address `/metrics` listens on; a sidecar's `--metrics-host`
            sets it per node. None: 127.0.0.1 (this host only) for a job on one node,
            0.0.0.0 for a job on several nodes (a Prometheus elsewhere scrapes each).
        flight_cert, flight_key: PEM certificate chain and private key: the Flight
            endpoint then speaks TLS only (grpc+tls://). Readers verify the server against
            $OVERLORD_FLIGHT_CA, else against flight_cert itself (a self-signed one).
        max_restarts: how many times the sidecar restarts one role that crashed (killed,
            not failed with an error) before it gives up and fails the job.
        node: this node's id (shm names, membership). Unset: $OVERLORD_NODE, else the
            first of `nodes`, else "node0"; a sidecar's `--node` overrides it, so every
            node can share one config file.
        nodes: the job's node ids in node-rank order, for a job on several nodes
            (torchrun's --nnodes/--node_rank): node i hosts the trainer ranks
            [i*W/N, (i+1)*W/N). Every sidecar and trainer derives from it where each
            rank lives and, with the live membership, where each role runs. Needs an
            external `redis_url` every node reaches and a `flight_port`. Empty: one node.
        strategy: the orchestration strategy, "module:function" (overlord.planner.strategies).
        mixing: a mixing schedule (overlord.planner.schedule); None uses the source weights.
        autoscale: size the Source Loaders to the sources' profiled costs at start
            (overlord.autoscale): a dict of `Budget` fields (cpus, memory_mb, limits);
            {} takes the defaults. It sets each source's partitions and which loader
            process hosts them, overriding `Source.partitions` and `loader_processes`.
            Extra keys: profile_samples (short profile of unjournaled sources), online
            (default true: the Planner scales transform threads with the mixture),
            max_threads (per partition, default 4), scale_interval (steps, default 8).
            None (default): the configured partitions, spread round robin.
    """

    name: str
    sources: tuple[Source, ...]
    mesh: Mesh = field(default_factory=Mesh)
    batch: BatchSpec = field(default_factory=BatchSpec)
    seed: int = 0
    epochs: int | None = None
    redis_url: str | None = None
    run_dir: str | None = None
    loader_processes: int | None = None
    buffer_samples: int = 512
    sample_ring_bytes: int = 8 << 20
    plan_ahead: int = 4
    timeout_s: float = 60.0
    redis_outage_s: float = 60.0
    max_restarts: int = 10
    flight_port: int | None = None
    flight_cert: str | None = None
    flight_key: str | None = None
    metrics_port: int | None = None
    metrics_host: str | None = None
    node: str = ""
    nodes: tuple[str, ...] = ()
    strategy: str = "overlord.planner.strategies:balanced"
    mixing: dict | None = None
    autoscale: dict | None = None

    def __post_init__(self) -> None:
        _check_name("Job.name", self.name)
        object.__setattr__(self, "nodes", tuple(self.nodes))
        if not self.node:
            object.__setattr__(
                self, "node", os.environ.get("OVERLORD_NODE") or (self.nodes[0] if self.nodes else "node0")
            )
        _check_name("Job.node", self.node)
        self._check_nodes()
        object.__setattr__(self, "sources", tuple(self.sources))
        if not self.sources:
            raise ConfigError("Job.sources is empty; declare at least one Source")
        names = [s.name for s in self.sources]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ConfigError(f"Job.sources has duplicate names {dupes}; source names must be unique")
        if sum(s.weight for s in self.sources) <= 0:
            raise ConfigError("Job.sources weights sum to 0; give at least one source a weight > 0")
        if self.batch.global_batch % self.mesh.dp:
            raise ConfigError(
                f"BatchSpec.global_batch={self.batch.global_batch} is not divisible by "
                f"Mesh.dp={self.mesh.dp}; make it a multiple of dp"
            )
        if self.batch.global_batch // self.mesh.dp < self.batch.micro_batches:
            raise ConfigError(
                f"BatchSpec.global_batch={self.batch.global_batch} gives each of the Mesh.dp={self.mesh.dp} "
                f"data-parallel ranks {self.batch.global_batch // self.mesh.dp} sample(s) a step, fewer than its "
                f"BatchSpec.micro_batches={self.batch.micro_batches}: micro-batches would be empty; raise "
                f"global_batch to at least {self.mesh.dp * self.batch.micro_batches} or lower micro_batches"
            )
        if (self.flight_cert is None) != (self.flight_key is None):
            raise ConfigError("Job.flight_cert and Job.flight_key go together: give both for TLS, or neither")
        if self.autoscale is not None:
            from overlord.autoscale.partition import Budget

            extras = {"profile_samples", "online", "max_threads", "scale_interval"}
            unknown = sorted(set(self.autoscale) - set(Budget.__dataclass_fields__) - extras)
            if unknown:
                raise ConfigError(
                    f"Job.autoscale has unknown key(s) {unknown}; use fields of overlord.autoscale.Budget "
                    f"({sorted(Budget.__dataclass_fields__)}) or {sorted(extras)}"
                )
        if self.epochs is not None and (not isinstance(self.epochs, int) or self.epochs < 1):
            raise ConfigError(f"Job.epochs={self.epochs!r} must be None (forever) or an int >= 1")
        if self.redis_url is not None and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(
                f"Job.redis_url={self.redis_url!r} must start with redis://, rediss:// or unix://, "
                "or be null to start an embedded redis-server"
            )
        if not isinstance(self.strategy, str) or ":" not in self.strategy:
            raise ConfigError(f"Job.strategy={self.strategy!r} must be 'module:function'")
        if self.mixing is not None:
            from overlord.planner.schedule import from_config, mixing_unit

            from_config(self.mixing, [s.name for s in self.sources], [s.weight for s in self.sources])
            mixing_unit(self.mixing)
        if self.loader_processes is not None and self.loader_processes < 1:
            raise ConfigError(f"Job.loader_processes={self.loader_processes!r} must be >= 1 or null")
        if self.sample_ring_bytes < 1 << 16:
            raise ConfigError(f"Job.sample_ring_bytes={self.sample_ring_bytes} is below 64 KiB; raise it")
        if self.buffer_samples < 1 or self.plan_ahead < 1 or self.timeout_s <= 0:
            raise ConfigError("Job.buffer_samples, Job.plan_ahead and Job.timeout_s must be positive")
        slow = [
            s.name
            for s in self.sources
            if s.transform_timeout_s is not None and s.transform_timeout_s >= self.timeout_s
        ]
        if slow:
            raise ConfigError(
                f"Source.transform_timeout_s of source(s) {slow} is not below Job.timeout_s={self.timeout_s:g}: a hung "
                "transform would be reported as a stalled loader before its sample is named; raise Job.timeout_s "
                "or lower transform_timeout_s"
            )
        if self.redis_outage_s <= 0:
            raise ConfigError(
                f"Job.redis_outage_s={self.redis_outage_s} must be positive (seconds to wait for an "
                "unreachable Redis); 60 covers a Sentinel failover"
            )

    def transform_deadline(self, source: Source) -> float:
        """The per-sample transform deadline of `source`, in seconds (Source.transform_timeout_s)."""
        return source.transform_timeout_s if source.transform_timeout_s is not None else self.timeout_s / 2

    def _check_nodes(self) -> None:
        if not self.nodes:
            return
        for n in self.nodes:
            _check_name("Job.nodes[]", n)
        if len(set(self.nodes)) != len(self.nodes):
            raise ConfigError(f"Job.nodes={list(self.nodes)} repeats a node id; node ids must be unique")
        if self.node not in self.nodes:
            raise ConfigError(
                f"Job.node={self.node!r} is not one of Job.nodes={list(self.nodes)}; start each sidecar with "
                "--node <one of them> (or $OVERLORD_NODE)"
            )
        if self.mesh.world_size % len(self.nodes):
            raise ConfigError(
                f"the mesh's {self.mesh.world_size} ranks do not split evenly over {len(self.nodes)} nodes "
                f"(Job.nodes); every node hosts the same number of trainer ranks"
            )
        if len(self.nodes) > 1 and any(s.shadow for s in self.sources):
            raise ConfigError(
                "Source.shadow runs on one node only for now; on several nodes a dead node's loaders "
                "are restarted on another node instead (drop shadow: true)"
            )
        if len(self.nodes) > 1 and (self.redis_url is None or self.flight_port is None):
            raise ConfigError(
                f"a job on {len(self.nodes)} nodes needs one Redis every node reaches (Job.redis_url) and an "
                "Arrow Flight port for the data between nodes (Job.flight_port); set both"
            )

    # -- nodes -------------------------------------------------------------------------

    @property
    def node_ids(self) -> tuple[str, ...]:
        """The job's nodes (just this one for a single-node job)."""
        return self.nodes or (self.node,)

    @property
    def multi_node(self) -> bool:
        return len(self.node_ids) > 1

    def ranks_of_node(self, node: str) -> list[int]:
        """Global trainer ranks hosted by `node` (contiguous blocks, as torchrun places them)."""
        per = self.mesh.world_size // len(self.node_ids)
        i = self.node_ids.index(node)
        return list(range(i * per, (i + 1) * per))

    def node_of_rank(self, rank: int) -> str:
        return self.node_ids[rank // (self.mesh.world_size // len(self.node_ids))]

    def on_node(self, node: str) -> Job:
        """This job as seen by the sidecar or trainer of `node`."""
        return dataclasses.replace(self, node=node)

    # -- where things live -------------------------------------------------------------

    @property
    def run_path(self) -> Path:
        """The job's run directory (socket, logs, embedded Redis data)."""
        if self.run_dir:
            # several nodes may share a machine (tests) or a network file system
            return Path(self.run_dir) / self.node if self.multi_node else Path(self.run_dir)
        base = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/overlord-{os.getuid()}"
        path = Path(base) / self.name
        return path / self.node if self.multi_node else path

    def make_run_path(self) -> Path:
        """Create the run directory (and a default parent) private to this user (0700)."""
        path = self.run_path
        if not self.run_dir:
            base = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/overlord-{os.getuid()}"
            Path(base).mkdir(mode=0o700, exist_ok=True)
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(path, 0o700)
        return path

    def check_world(self, world_size: int) -> None:
        """Refuse a trainer world that does not match the mesh."""
        if world_size != self.mesh.world_size:
            raise ConfigError(
                f"trainer WORLD_SIZE={world_size} does not match the mesh "
                f"dp*pp*cp*tp={self.mesh.dp}*{self.mesh.pp}*{self.mesh.cp}*{self.mesh.tp}"
                f"={self.mesh.world_size}; fix Job.mesh"
            )

    # -- (de)serialisation -------------------------------------------------------------

    def __repr__(self) -> str:
        """The fields, `redis_url` without its password (a repr lands in logs and tracebacks)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if self.redis_url is not None:
            values["redis_url"] = split_redis_password(self.redis_url)[0]
        return "Job(" + ", ".join(f"{name}={value!r}" for name, value in values.items()) + ")"

    def to_dict(self) -> dict[str, Any]:
        """The job as plain data, `redis_url` without its password (what is stored)."""
        data = dataclasses.asdict(self)
        if self.redis_url is not None:
            data["redis_url"] = split_redis_password(self.redis_url)[0]
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Job:
        """Build a Job from plain data (YAML/JSON), refusing unknown keys by name."""
        data = dict(_checked_keys(cls, data, "job"))
        try:
            data["sources"] = tuple(
                Source(**_checked_keys(Source, s, f"sources[{i}]")) for i, s in enumerate(data.get("sources") or ())
            )
            if "mesh" in data:
                data["mesh"] = Mesh(**_checked_keys(Mesh, data["mesh"] or {}, "mesh"))
            if "batch" in data:
                data["batch"] = BatchSpec(**_checked_keys(BatchSpec, data["batch"] or {}, "batch"))
            return cls(**data)
        except TypeError as exc:  # a missing required field
            raise ConfigError(f"job config: {exc}") from None

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> Job:
        """Load a job from a YAML or JSON file."""
        import yaml

        text = Path(path).read_text()
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML/JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping with 'name' and 'sources'")
        if "job" in data and len(data) == 1:
            data = data["job"]
        return cls.from_dict(data)


def split_redis_password(url: str) -> tuple[str, str | None]:
    """`url` without its password, and the password (None when it names none).

    The password is the userinfo's (`scheme://user:pw@host`, `scheme://:pw@host`; the
    user stays: `scheme://user@host`, `scheme://@host`) or redis-py's `password=` query
    parameter; percent-escapes in it are decoded.
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url, None
    password = None
    base, q, query = rest.partition("?")
    if q:
        params = parse_qsl(query, keep_blank_values=True)
        for key, value in params:
            if key == "password":
                password = value
        query = urlencode([(k, v) for k, v in params if k != "password"])
    if "@" in base:
        userinfo, host = base.rsplit("@", 1)  # the last @: a password may hold one
        user, colon, secret = userinfo.partition(":")
        if colon:
            password = unquote(secret)
        base = f"{user}@{host}"
    return f"{scheme}://{base}" + (f"?{query}" if query else ""), password


def _checked_keys(cls: type, data: Any, where: str) -> dict[str, Any]:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown} for {cls.__name__}; known keys: {sorted(known)}")
    return dict(data)
