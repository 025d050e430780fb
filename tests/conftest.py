"""Fixtures shared by the unit tests: `r`, a client of a real redis-server of its own."""

from __future__ import annotations

import pytest

from overlord.store import EmbeddedRedis, connect


@pytest.fixture
def r(tmp_path):
    server = EmbeddedRedis(tmp_path / "run").start()
    try:
        yield connect(server.url)
    finally:
        server.stop()
