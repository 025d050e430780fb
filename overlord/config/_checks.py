"""Checks every config class shares: names that go into Redis keys and shm names,
and plain data (YAML/JSON) with no unknown key."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from overlord.errors import ConfigError

_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,48}$")


def check_name(kind: str, value: str) -> None:
    if not isinstance(value, str) or not _NAME_RE.match(value):
        raise ConfigError(
            f"{kind} {value!r} is not a valid name; use 1-48 characters from "
            "letters, digits, '_' and '-' (it appears in Redis keys and shm names)"
        )


def checked_keys(cls: type, data: Any, where: str) -> dict[str, Any]:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown} for {cls.__name__}; known keys: {sorted(known)}")
    return dict(data)
