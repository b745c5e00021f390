"""Random draws for minibatches: per-block generators, and Detectron's legacy call order.

Every random draw of a minibatch (scale index, RoI sampling, anchor sampling) goes
through the helpers below, with a generator passed in explicitly (design principle 6:
workers are stateless). Two kinds of generator are accepted:

* ``numpy.random.Generator`` (the default): made by :func:`block_rng` from
  ``(seed, pass_index, block_index)``, so a block is rebuilt bit-for-bit on any worker,
  rank or after a resume.
* ``numpy.random.RandomState`` (``rng="detectron"``): the legacy API Detectron's global
  ``np.random`` uses. The helpers then call exactly the RandomState methods Detectron
  calls (``randint``, ``choice``), in Detectron's order, so seeding it like Detectron's
  ``np.random.seed(cfg.RNG_SEED)`` reproduces Detectron's draws.
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
        raise ValueError(
            f"block_rng needs non-negative integers, got seed={seed}, "
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
    if high is None:
        low, high = 0, low
    return rng.integers(low, high, size=size)


def choice(rng: RNG, a: Any, size: Any = None, replace: bool = True) -> Any:
    """``choice`` for either generator kind (Detectron calls ``npr.choice``)."""
    return rng.choice(a, size=size, replace=replace)
