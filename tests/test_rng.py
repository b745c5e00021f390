"""Per-block generators and the Detectron-compatible draw helpers."""

import numpy as np
import pytest

from lit_roidata.rng import block_rng, choice, detectron_rng, randint


def test_block_rng_is_a_pure_function_of_its_triple():
    a = block_rng(3, 1, 7).integers(0, 1 << 30, size=8)
    b = block_rng(3, 1, 7).integers(0, 1 << 30, size=8)
    np.testing.assert_array_equal(a, b)
    for other in [(4, 1, 7), (3, 2, 7), (3, 1, 8)]:
        assert not np.array_equal(a, block_rng(*other).integers(0, 1 << 30, size=8))


def test_block_rng_rejects_negative_inputs():
    with pytest.raises(ValueError, match="non-negative"):
        block_rng(-1, 0, 0)


def test_detectron_mode_follows_numpy_legacy_calls():
    # Detectron: np.random.seed(3); np.random.randint(0, high=len(SCALES), size=n)
    ref = np.random.RandomState(3)
    expect_scales = ref.randint(0, high=3, size=2)
    expect_choice = ref.choice(np.arange(10), size=4, replace=False)
    rng = detectron_rng(3)
    np.testing.assert_array_equal(randint(rng, 0, 3, size=2), expect_scales)
    np.testing.assert_array_equal(choice(rng, np.arange(10), size=4, replace=False), expect_choice)


def test_generator_randint_has_exclusive_high():
    draws = randint(block_rng(0, 0, 0), 0, 2, size=1000)
    assert set(np.unique(draws)) == {0, 1}
    assert randint(block_rng(0, 0, 0), 5).shape == ()
