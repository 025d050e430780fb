"""Fixtures for shared-memory tests: a unique job per test, and child processes.

Every test gets its own job name; the fixture fails the test if any /dev/shm segment of
that job is left behind (then removes it, so one failure does not leak into others).
Child processes run small `python -c` scripts and get only names and ints in argv.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from overlord.shm import list_segments, unlink_all

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def job() -> str:
    name = f"t{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield name
    left = list_segments(name)
    unlink_all(name)
    assert not left, f"test left shared-memory segments behind: {left}"


class Child:
    """A `python -c` child; `ready()` waits for the line it prints when set up."""

    def __init__(self, script: str, args: tuple) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(script), *map(str, args)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.pid = self.proc.pid

    def ready(self) -> None:
        line = self.proc.stdout.readline().strip()
        if line != "ready":
            self.proc.kill()
            _, err = self.proc.communicate(timeout=10)
            raise AssertionError(f"child did not get ready (said {line!r}); stderr:\n{err}")

    def finish(self, timeout: float = 30) -> str:
        """Wait for a clean exit; return its stdout (fails with its stderr otherwise)."""
        out, err = self.proc.communicate(timeout=timeout)
        assert self.proc.returncode == 0, f"child exited {self.proc.returncode}; stderr:\n{err}"
        return out


@pytest.fixture
def spawn():
    children: list[Child] = []

    def _spawn(script: str, *args: object) -> Child:
        child = Child(script, args)
        children.append(child)
        return child

    yield _spawn
    for c in children:
        if c.proc.poll() is None:
            c.proc.kill()
        c.proc.communicate(timeout=10)
