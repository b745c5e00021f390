"""Deprecated: moved to :mod:`lit_roidata.demo.rpn_exchange_model`.

``lit_roidata.exchange.demo_model.RPNExchangeDemo`` (e.g. a ``model.class_path`` in a
config file) still works for one release, with a ``DeprecationWarning``; write
``lit_roidata.demo.RPNExchangeDemo`` instead.
"""

from __future__ import annotations

import warnings

from lit_roidata.demo.rpn_exchange_model import RPNExchangeDemo

__all__ = ["RPNExchangeDemo"]

warnings.warn("lit_roidata.exchange.demo_model is deprecated and will be removed in the next "
              "release; use lit_roidata.demo.RPNExchangeDemo (module "
              "lit_roidata.demo.rpn_exchange_model) instead, e.g. in a config's class_path",
              DeprecationWarning, stacklevel=2)
