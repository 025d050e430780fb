"""Overlord: a distributed data loader for multi-source foundation-model training.

The job is declared with `Job`, `Source`, `Mesh` and `BatchSpec`; trainers read it
through `overlord.torch.DataLoader`; each node runs `overlord sidecar`.
"""

from overlord.config import BatchSpec, Job, Mesh, Source
from overlord.errors import (
    ConfigError,
    OverlordError,
    RemoteRoleError,
    RingFullError,
    SchemaError,
    SourceReadError,
)

__all__ = [
    "BatchSpec",
    "ConfigError",
    "Job",
    "Mesh",
    "OverlordError",
    "RemoteRoleError",
    "RingFullError",
    "SchemaError",
    "Source",
    "SourceReadError",
]
__version__ = "0.1.0"
