"""What `import overlord.torch` loads into every trainer rank: none of the sidecar's heavy
dependencies (the data path of a job on one node is its ring; redis-py, 6 MiB of a
process, loads only when the rank talks to Redis)."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("redis", "pyarrow", "PIL", "tokenizers", "overlord.loader", "overlord.planner", "overlord.store.client")

# one interpreter for both checks (each import of torch costs seconds of the quick tier)
CODE = f"""
import json, sys
import overlord.torch
loaded = [m for m in {HEAVY!r} if m in sys.modules]
from overlord import store
assert callable(store.connect) and store.redact("redis://u:pw@h:1/0") == "redis://***@h:1/0"
from overlord.store import EmbeddedRedis, redis_server_binary, outage_within
try:
    store.nothing
except AttributeError as exc:
    assert "nothing" in str(exc)
else:
    raise SystemExit("an unknown name resolved")
print(json.dumps({{"loaded": loaded, "redis_on_use": "redis" in sys.modules}}))
"""


def test_the_trainer_side_loads_none_of_the_sidecars_dependencies_and_the_stores_names_load_on_use():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"loaded": [], "redis_on_use": True}
