"""Random draws for minibatches, with an explicit generator: a ``numpy.random.Generator``
per block (:func:`block_rng`, rebuilt bit-for-bit anywhere), or a ``RandomState`` called
exactly as Detectron calls its global ``np.random`` (``rng="detectron"``).
"""

from __future__ import annotations

from typing import Any, Union

import numpy as np

__all__ = ["RNG", "block_rng", "detectron_rng", "randint", "choice"]

RNG = Union[np.random.Generator, np.random.RandomState]

# Domain separator so block streams never coincide with other uses of the same seed.
_BLOCK_DOMAIN = 0x6C726F69  # "lroi"


def block_rng(seed: int, pass_index: int, block_index: int) -> np.random.Generator:
    """The generator for block ``block_index`` of pass ``pass_index`` of stream ``seed``.

    A pure function of its arguments: the same triple gives the same draws in any
    process. ``block_index`` counts blocks of the global stream within the pass.
    """
    if min(seed, pass_index, block_index) < 0:
        raise ValueError(f"block_rng needs non-negative integers, got seed={seed}, "
                         f"pass_index={pass_index}, block_index={block_index}")
    ss = np.random.SeedSequence([_BLOCK_DOMAIN, int(seed), int(pass_index), int(block_index)])
    return np.random.Generator(np.random.PCG64(ss))


def detectron_rng(seed: int) -> np.random.RandomState:
    """A legacy RandomState seeded as Detectron's ``np.random.seed(RNG_SEED)``."""
    return np.random.RandomState(seed)


def randint(rng: RNG, low: int, high: int | None = None, size: Any = None) -> Any:
    """``RandomState.randint`` semantics (``high`` exclusive) for either generator kind."""
    if isinstance(rng, np.random.RandomState):
        return rng.randint(low, high, size=size)
    return rng.integers(0, low, size=size) if high is None else rng.integers(low, high, size=size)


def choice(rng: RNG, a: Any, size: Any = None, replace: bool = True) -> Any:
    """``choice`` for either generator kind (Detectron calls ``npr.choice``)."""
    return rng.choice(a, size=size, replace=replace)
