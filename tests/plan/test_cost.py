"""Cost models: the documented FLOP formulas, vectorised, and the registry."""

import numpy as np
import pytest

from overlord.errors import ConfigError, PlanError
from overlord.plan.cost import COSTS, encoder_cost, get_cost, token_cost, transformer_cost


def test_transformer_cost_formula():
    h, L = 4096, np.array([0, 1, 100, 4096])
    want = 24 * h * h * L + 4 * h * L.astype(float) ** 2
    got = transformer_cost(L)
    assert got.dtype == np.float64 and np.array_equal(got, want)
    assert np.array_equal(transformer_cost(L, hidden=8, layers=3), 3 * (24 * 64 * L + 32 * L.astype(float) ** 2))
    assert transformer_cost(7).shape == ()


def test_attention_makes_one_long_document_dearer_than_many_short():
    # Same tokens, one document vs 16: the quadratic term is per document.
    one = transformer_cost(16384)
    many = transformer_cost(np.full(16, 1024)).sum()
    assert one > many
    assert one - many == pytest.approx(4 * 4096 * (16384**2 - 16 * 1024**2))


def test_encoder_cost_is_quadratic_in_patches_per_image():
    p = np.array([[0, 16], [256, 4096]])
    got = encoder_cost(p)
    assert got.shape == (2, 2) and got[0, 0] == 0
    assert np.array_equal(got, 24 * 1024**2 * p + 4 * 1024 * p.astype(float) ** 2)


def test_registry():
    assert set(COSTS) == {"tokens", "attention", "patches"}
    assert get_cost("attention") is transformer_cost and get_cost("patches") is encoder_cost
    tokens = np.array([3, 5], dtype=np.int32)
    assert get_cost("tokens")(tokens).tolist() == [3.0, 5.0] and token_cost(tokens).dtype == np.float64
    with pytest.raises(ConfigError, match=r"'flops'.*attention, patches, tokens"):
        get_cost("flops")


@pytest.mark.parametrize("fn", [transformer_cost, encoder_cost, token_cost])
def test_bad_metadata_raises(fn):
    with pytest.raises(PlanError, match="finite and >= 0"):
        fn(np.array([1, -2]))
    with pytest.raises(PlanError):
        fn(np.array([np.nan]))
