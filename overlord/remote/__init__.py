"""The remote data path over Arrow Flight (see flight.py).

`BatchServer`, `RemoteReader` and `serve` load pyarrow.flight when first named here
(overlord.remote.endpoint says why); `job_token` does not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from overlord.remote.endpoint import job_token

if TYPE_CHECKING:
    from overlord.remote.flight import BatchServer, RemoteReader, serve

__all__ = [
    "BatchServer",
    "RemoteReader",
    "job_token",
    "serve",
]


def __getattr__(name: str) -> Any:
    if name in ("BatchServer", "RemoteReader", "serve"):
        from overlord.remote import flight  # deferred: see the module docstring

        return getattr(flight, name)
    raise AttributeError(f"module 'overlord.remote' has no attribute {name!r}")
