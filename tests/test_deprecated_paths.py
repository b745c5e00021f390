"""Old import paths kept for one release after the layout sweep: each still gives the same
object, with a DeprecationWarning naming the new path."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest


def _fresh_import(module: str) -> tuple[object, list[warnings.WarningMessage]]:
    sys.modules.pop(module, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mod = importlib.import_module(module)
    return mod, [w for w in caught if issubclass(w.category, DeprecationWarning)]


def test_exchange_demo_model_is_a_deprecated_alias_of_the_demo_model() -> None:
    from lit_roidata.demo import RPNExchangeDemo
    from lit_roidata.demo.rpn_exchange_model import RPNExchangeDemo as direct

    mod, caught = _fresh_import("lit_roidata.exchange.demo_model")
    assert mod.RPNExchangeDemo is RPNExchangeDemo is direct
    assert len(caught) == 1, caught
    assert "lit_roidata.demo.RPNExchangeDemo" in str(caught[0].message)
    assert caught[0].filename != mod.__file__  # points at the importer, not the shim


def test_old_yaml_class_path_still_resolves() -> None:
    """A config naming ``lit_roidata.exchange.demo_model.RPNExchangeDemo`` gets the class."""
    from jsonargparse.typing import import_object

    from lit_roidata.demo import RPNExchangeDemo

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert import_object("lit_roidata.exchange.demo_model.RPNExchangeDemo") is RPNExchangeDemo
    assert import_object("lit_roidata.demo.RPNExchangeDemo") is RPNExchangeDemo


def test_old_yaml_class_path_translates_to_the_lightning_binding() -> None:
    pytest.importorskip("lightning")
    from lit_roidata._lightning import LIGHTNING
    from lit_roidata.cli import translate_class_path

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert (translate_class_path("lit_roidata.exchange.demo_model.RPNExchangeDemo", LIGHTNING)
                == "lit_roidata.lightning.RPNExchangeDemo")


def test_the_exchange_library_imports_no_demo_code() -> None:
    code = ("import sys, lit_roidata.exchange, lit_roidata.exchange.callback, "
            "lit_roidata.exchange.embedded\n"
            "bad = sorted(m for m in sys.modules if m.startswith('lit_roidata.demo'))\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)
