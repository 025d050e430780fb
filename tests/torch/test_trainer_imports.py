"""What `import overlord.torch` loads into every trainer rank: none of the sidecar's heavy
dependencies (the data path of a job on one node is its ring; redis-py, 6 MiB of a
process, loads only when the rank talks to Redis)."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("redis", "pyarrow", "PIL", "tokenizers", "overlord.loader", "overlord.planner", "overlord.store.client")


def test_importing_the_trainer_side_loads_none_of_the_sidecars_dependencies():
    code = f"import json, sys\nimport overlord.torch\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_the_stores_names_still_resolve_on_use():
    code = (
        "import sys\nfrom overlord import store\nassert 'redis' not in sys.modules\n"
        "assert callable(store.connect) and store.redact('redis://u:pw@h:1/0') == 'redis://***@h:1/0'\n"
        "assert 'redis' in sys.modules\n"
        "from overlord.store import EmbeddedRedis, redis_server_binary, outage_within\n"
        "try:\n    store.nothing\nexcept AttributeError as exc:\n    assert 'nothing' in str(exc)\n"
        "else:\n    raise SystemExit('an unknown name resolved')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
