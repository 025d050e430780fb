"""A Source Loader's running totals (`Profile`): samples prepared, seconds spent reading
and transforming them, prepared bytes, and the peak memory of its file-access state
(open files' footers and the Arrow row groups of its shuffle window). Loader processes
journal them in Redis every `JOURNAL_EVERY_S`:

    overlord:{job}:profile   hash  <stream> -> JSON {samples, seconds, out_bytes, state_bytes, updated}

The autoscaler reads them as costs (overlord.autoscale.profile).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

JOURNAL_EVERY_S = 5.0


@dataclass(slots=True)
class Profile:
    """Running totals of one stream (source partition)."""

    samples: int = 0
    seconds: float = 0.0
    out_bytes: int = 0
    state_bytes: int = 0  # peak

    def record(self, seconds: float, nbytes: int) -> None:
        self.samples += 1
        self.seconds += seconds
        self.out_bytes += nbytes

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "updated": time.time()})

    @classmethod
    def from_json(cls, raw: str | bytes) -> Profile:
        d = json.loads(raw)
        return cls(samples=d["samples"], seconds=d["seconds"], out_bytes=d["out_bytes"], state_bytes=d["state_bytes"])
