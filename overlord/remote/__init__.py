"""The remote data path over Arrow Flight (see flight.py)."""

from overlord.remote.flight import BatchServer, RemoteReader, job_token, serve

__all__ = [
    "BatchServer",
    "RemoteReader",
    "job_token",
    "serve",
]
