"""Mixing schedules and the ClientPlaceTree."""

import numpy as np
import pytest

from overlord.config import Mesh
from overlord.errors import ConfigError
from overlord.plan.schedule import from_config
from overlord.plan.tree import ClientPlaceTree

SOURCES = ["web", "code", "images"]


def test_default_is_the_constant_source_weights():
    s = from_config(None, SOURCES, [0.5, 0.3, 0.2])
    assert list(s.weights(0)) == list(s.weights(10_000)) == [0.5, 0.3, 0.2]


def test_piecewise_switches_at_its_steps():
    s = from_config(
        {"kind": "piecewise", "points": [[0, {"web": 1}], [100, {"web": 1, "images": 1}]]}, SOURCES, [1, 1, 1]
    )
    assert list(s.weights(99)) == [1, 0, 0] and list(s.weights(100)) == [1, 0, 1]


def test_warmup_interpolates_then_holds():
    s = from_config({"kind": "warmup", "start": {"web": 1}, "end": {"images": 1}, "steps": 10}, SOURCES, [1, 1, 1])
    assert np.allclose(s.weights(0), [1, 0, 0]) and np.allclose(s.weights(5), [0.5, 0, 0.5])
    assert np.allclose(s.weights(50), [0, 0, 1])


@pytest.mark.parametrize(
    "mixing, words",
    [
        ({"kind": "sometimes"}, "mixing.kind"),
        ({"kind": "piecewise", "points": [[5, {"web": 1}]]}, "start at step 0"),
        ({"kind": "constant", "weights": {"wbe": 1}}, "unknown source"),
        ({"kind": "constant", "weights": {"web": 0}}, "not all 0"),
        ({"kind": "warmup", "start": {"web": 1}, "end": {"web": 1}, "steps": 0}, "mixing.steps"),
    ],
)
def test_bad_schedules_name_the_field(mixing, words):
    with pytest.raises(ConfigError, match=words):
        from_config(mixing, SOURCES, [1, 1, 1])


def test_tree_levels_and_consumers():
    tree = ClientPlaceTree(Mesh(dp=2, cp=2, tp=2))
    assert tree.buckets("DP") == 2 and tree.buckets("CP") == 4 and tree.buckets("WORLD") == 8
    assert tree.ranks("DP", 1) == [4, 5, 6, 7]
    assert tree.ranks("CP", 1) == [2, 3]  # dp 0, cp 1, both tp ranks
    assert tree.ranks("WORLD", 5) == [5]
    assert all(tree.needs_bytes(r) for r in range(8))
    tree.broadcast_at("TP")
    assert [tree.needs_bytes(r) for r in range(4)] == [True, False, True, False]
    with pytest.raises(ConfigError):
        tree.buckets("PP")
    # middle pipeline stages get only packing metadata
    assert [ClientPlaceTree(Mesh(pp=3)).needs_bytes(r) for r in range(3)] == [True, False, True]


def test_dynamic_schedule_follows_reported_losses_and_checkpoints_its_weights():
    s = from_config({"kind": "dynamic", "every": 10}, SOURCES, [1.0, 1.0, 1.0])
    assert s.due(0) and list(s.weights(0)) == [1, 1, 1]
    s.observe(0, {"loss/web": 1.0, "loss/code": 1.0, "loss/images": 3.0})
    w = s.weights(5)
    assert w[2] > w[0] == w[1] and not s.due(0) and not s.due(5) and s.due(10)
    assert s.state() == {"weights": list(w), "updated": 0}
    s.observe(10, {})  # nothing reported: the base weights
    assert list(s.weights(10)) == [1, 1, 1]


def test_dynamic_schedule_errors_name_the_field():
    with pytest.raises(ConfigError, match="mixing.fn"):
        from_config({"kind": "dynamic", "fn": "no.such.module:fn"}, SOURCES, [1, 1, 1])
    s = from_config({"kind": "dynamic", "fn": "builtins:len"}, SOURCES, [1, 1, 1])
    with pytest.raises(ConfigError, match="dynamic mixing function 'len' raised at step 0"):
        s.observe(0, {})
    s = from_config({"kind": "dynamic", "fn": "overlord.plan.schedule:Constant"}, SOURCES, [1, 1, 1])
    with pytest.raises(ConfigError, match="dynamic mixing function"):
        s.observe(0, {})


def test_mixing_unit_is_validated():
    from overlord.plan.schedule import mixing_unit

    assert mixing_unit(None) == "step" and mixing_unit({"kind": "dynamic", "unit": "substep"}) == "substep"
    with pytest.raises(ConfigError, match="mixing.unit='minute'"):
        mixing_unit({"kind": "dynamic", "unit": "minute"})
    with pytest.raises(ConfigError, match="mixing of kind 'warmup' needs start, end, steps"):
        mixing_unit({"kind": "warmup", "unit": "substep"})
