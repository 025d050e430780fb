"""Every error Overlord raises derives from `OverlordError`.

Messages name the thing, the values and the fix. A failure in a child role reaches
the trainer with its origin (role, node, pid) attached as a note.
"""

from __future__ import annotations


class OverlordError(Exception):
    """Root of every Overlord error."""


class ConfigError(OverlordError, ValueError):
    """A job configuration field is invalid; the message names the field."""


class SourceReadError(OverlordError):
    """A source's file could not be read, or a row could not be transformed."""


class SchemaError(SourceReadError):
    """A source's file lacks a declared column or has an unexpected type."""


class RingError(OverlordError):
    """Base for shared-memory ring failures."""


class RingTimeout(RingError, TimeoutError):
    """A ring wait ran past its timeout."""


class RingFullError(RingError):
    """A record is larger than the whole ring; it can never fit."""


class RingClosed(RingError):
    """The producer closed the ring and every record has been read."""


class PeerDied(RingError):
    """The process on the other side of a ring exited."""


class RemoteRoleError(OverlordError):
    """A role on the sidecar side failed; the message carries its origin and cause."""


class BatchFormatError(OverlordError):
    """A record in a ring does not decode as a batch (bounds or header check failed)."""


class StoreError(OverlordError):
    """Redis (the control path) is unreachable or misconfigured."""


class StartupError(OverlordError):
    """The host lacks what a sidecar needs (shared memory, Redis, sources); the message
    says what to change."""


class PlanError(OverlordError):
    """The Planner could not build a plan (e.g. a source stopped reporting samples)."""


__all__ = sorted(
    [
        "BatchFormatError",
        "ConfigError",
        "OverlordError",
        "PeerDied",
        "PlanError",
        "RemoteRoleError",
        "RingClosed",
        "RingError",
        "RingFullError",
        "RingTimeout",
        "SchemaError",
        "SourceReadError",
        "StoreError",
    ]
)
