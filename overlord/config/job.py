"""`Job`: a job's sources, mesh, batch and the settings of its roles."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from overlord.config._checks import check_name, checked_keys
from overlord.config.mesh import BatchSpec, Mesh
from overlord.config.sections import Autoscale, Mixing
from overlord.config.source import Source
from overlord.config.urls import split_redis_password
from overlord.errors import ConfigError


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
        redis_url: external Redis (redis://, rediss://, unix://, or
            redis+sentinel://host:port,host:port,.../<service> for a primary behind Redis
            Sentinel); None starts an embedded one.
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
        buffer_bytes: byte cap of each Source Loader's read buffer (per loader partition;
            Source.buffer_bytes overrides it per source). Within it a buffer holds 1.5 times
            what the Planner can draw from the stream before its loader refills: the
            stream's share of a step (global_batch x weight share / partitions) x
            (plan_ahead + refill steps), plus three standard deviations of that draw, x
            its mean sample bytes; at least two steps' draw (overlord.runtime.readbuffer).
        buffer_samples: an explicit sample cap on each read buffer, over buffer_bytes;
            None (default): bytes only. Kept for configs written before buffer_bytes.
        sample_ring_bytes: capacity of each ring from a loader process to a Data Constructor; /dev/shm holds up to about three times its peak fill.
        plan_ahead: how many steps the Planner may plan past what the slowest trainer consumed
            (and past the slowest Data Constructor): a metric reported at step t shapes the plan
            of step t + plan_ahead + 1 at the latest, whatever the ring sizes. It plans in turns:
            once the trainers leave room for max(1, plan_ahead // 2) steps, it plans them and
            publishes them together (one script, one durability wait).
        timeout_s: longest wait anywhere before an error is raised.
        redis_outage_s: how long roles and trainers wait for an unreachable Redis (gone,
            frozen, failing over) before they fail with an error naming it; the trainers
            keep consuming what their rings hold meanwhile. The default covers a Sentinel
            failover.
        flight_port: serve the trainers' micro-batches over Arrow Flight on this TCP port
            (overlord.remote), for trainers without a sidecar on their node; requests
            carry the job's token ($OVERLORD_FLIGHT_TOKEN, or the run directory's
            flight.token). None: no remote path. Choose a port below the kernel's
            range for outgoing connections (net.ipv4.ip_local_port_range, 32768-60999
            by default): any connection on the host can take a port inside it first.
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
        strategy: the orchestration strategy, "module:function" (overlord.plan.strategies).
        mixing: a mixing schedule (`Mixing`; a dict of its fields in YAML or Python);
            None uses the source weights.
        autoscale: size the Source Loaders to the sources' profiled costs at start
            (`Autoscale`; a dict of its fields in YAML or Python, {} for the defaults).
            It sets each source's partitions and which loader process hosts them,
            overriding `Source.partitions` and `loader_processes`. None (default): the
            configured partitions, spread round robin.
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
    buffer_bytes: int = 64 << 20  # 64 MiB per loader partition
    buffer_samples: int | None = None
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
    strategy: str = "overlord.plan.strategies:balanced"
    mixing: Mixing | None = None
    autoscale: Autoscale | None = None

    def __post_init__(self) -> None:
        check_name("Job.name", self.name)
        object.__setattr__(self, "nodes", tuple(self.nodes))
        if not self.node:
            object.__setattr__(
                self, "node", os.environ.get("OVERLORD_NODE") or (self.nodes[0] if self.nodes else "node0")
            )
        check_name("Job.node", self.node)
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
            object.__setattr__(self, "autoscale", Autoscale.of(self.autoscale))
        if self.epochs is not None and (not isinstance(self.epochs, int) or self.epochs < 1):
            raise ConfigError(f"Job.epochs={self.epochs!r} must be None (forever) or an int >= 1")
        if self.redis_url is not None and not self.redis_url.startswith(
            ("redis://", "rediss://", "unix://", "redis+sentinel://")
        ):
            raise ConfigError(
                f"Job.redis_url={self.redis_url!r} must start with redis://, rediss://, unix:// or redis+sentinel://, "
                "or be null to start an embedded redis-server"
            )
        if not isinstance(self.strategy, str) or ":" not in self.strategy:
            raise ConfigError(f"Job.strategy={self.strategy!r} must be 'module:function'")
        if self.mixing is not None:
            object.__setattr__(self, "mixing", Mixing.of(self.mixing))
            from overlord.plan.schedule import from_config  # cycle: overlord.plan.schedule imports overlord.config

            from_config(self.mixing, [s.name for s in self.sources], [s.weight for s in self.sources])
        if self.loader_processes is not None and self.loader_processes < 1:
            raise ConfigError(f"Job.loader_processes={self.loader_processes!r} must be >= 1 or null")
        if self.sample_ring_bytes < 1 << 16:
            raise ConfigError(f"Job.sample_ring_bytes={self.sample_ring_bytes} is below 64 KiB; raise it")
        if (self.buffer_samples is not None and self.buffer_samples < 1) or self.plan_ahead < 1 or self.timeout_s <= 0:
            raise ConfigError("Job.buffer_samples, Job.plan_ahead and Job.timeout_s must be positive")
        if isinstance(self.buffer_bytes, bool) or not isinstance(self.buffer_bytes, int) or self.buffer_bytes < 1:
            raise ConfigError(f"Job.buffer_bytes={self.buffer_bytes!r} must be an int >= 1 (bytes per read buffer)")
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
            check_name("Job.nodes[]", n)
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
        data = dict(checked_keys(cls, data, "job"))
        try:
            data["sources"] = tuple(
                Source(**checked_keys(Source, s, f"sources[{i}]")) for i, s in enumerate(data.get("sources") or ())
            )
            if "mesh" in data:
                data["mesh"] = Mesh(**checked_keys(Mesh, data["mesh"] or {}, "mesh"))
            if "batch" in data:
                data["batch"] = BatchSpec(**checked_keys(BatchSpec, data["batch"] or {}, "batch"))
            return cls(**data)
        except TypeError as exc:  # a missing required field
            raise ConfigError(f"job config: {exc}") from None

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Job:
        """Load a job from a YAML or JSON file.

        A file that is JSON is read as JSON. Every trainer reads the job's file, and PyYAML's
        pure-Python loader took 510 ms and left 8.9 MiB in the process's heap for a job
        of 300 sources (165 KB of JSON), against 10 ms and 0.9 MiB; YAML is read with
        libyaml's loader where PyYAML has it (64 ms, 5.2 MiB), else PyYAML's own.
        """
        text = Path(path).read_text()
        data = _json_or_none(text)
        if data is None:
            import yaml  # deferred: PyYAML (~20 ms), for YAML files only: `import overlord` skips it

            try:
                data = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # a safe loader either way
            except yaml.YAMLError as exc:
                raise ConfigError(f"{path}: not valid YAML/JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping with 'name' and 'sources'")
        if "job" in data and len(data) == 1:
            data = data["job"]
        return cls.from_dict(data)


def _json_or_none(text: str) -> Any:
    """`text` parsed as JSON if it is a JSON object, else None (then it is YAML's to read)."""
    if not text.lstrip().startswith("{"):
        return None
    try:
        return json.loads(text)
    except ValueError:  # a YAML flow mapping, or a broken file: YAML says which
        return None
