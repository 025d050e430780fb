"""Typed job configuration: `Job` and its parts `Source`, `Mesh`, `BatchSpec`, `Mixing`,
`Autoscale`.

A job is declared in Python (the trainer) or YAML/JSON (the sidecar) and validated on
construction, so a bad field fails at start with a message that names the field and says
what to change. Configs cross process boundaries as JSON (`Job.to_dict` /
`Job.from_dict`), never as pickles.
"""

from overlord.config.job import Job
from overlord.config.mesh import BatchSpec, Mesh
from overlord.config.sections import Autoscale, Mixing
from overlord.config.source import FORMATS, ON_ERROR, Source
from overlord.config.urls import split_redis_password

__all__ = [
    "FORMATS",
    "ON_ERROR",
    "Autoscale",
    "BatchSpec",
    "Job",
    "Mesh",
    "Mixing",
    "Source",
    "split_redis_password",
]
