"""What a sidecar loads before it forks its roles (overlord.sidecar.spawn.preload).

Each case runs in a fresh interpreter: what a process imported cannot be unloaded."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_PROBE = """
import sys
sys.path.insert(0, {repo!r})
import overlord.remote
import overlord.sidecar.sidecar
from overlord.remote import job_token
from overlord.sidecar.spawn import preload
preload(remote=sys.argv[1] == "remote")
import overlord.sidecar.role, overlord.planner.process, overlord.loader.process, overlord.constructor.process
mapped = any("libarrow_flight" in line for line in open("/proc/self/maps"))
print("pyarrow.flight" in sys.modules, mapped)
"""


def _loaded(kind: str) -> str:
    code = _PROBE.format(repo=str(REPO))
    return subprocess.run(
        [sys.executable, "-c", code, kind], capture_output=True, text=True, timeout=120, check=True
    ).stdout.strip()


def test_a_job_on_one_node_never_loads_flight():
    # gRPC and Arrow's Flight libraries cost a sidecar ~8 MiB of PSS, their relocated
    # pages private to it; a job on one node neither serves nor reads over Flight
    assert _loaded("local") == "False False"


def test_a_job_on_several_nodes_preloads_flight_for_its_roles():
    # its Data Constructors bridge samples over Flight: loaded once, before the fork,
    # so the roles share its pages
    assert _loaded("remote") == "True True"
