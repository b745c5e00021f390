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


MOVED_FROM_CALLBACKS = {
    "LoadReport": "lit_roidata.weights",
    "WeightsShapeError": "lit_roidata.weights",
    "load_weights_file": "lit_roidata.weights",
    "load_weights_into": "lit_roidata.weights",
    "ReplicaMismatchError": "lit_roidata.broadcast",
    "broadcast_module": "lit_roidata.broadcast",
    "verify_replicas": "lit_roidata.broadcast",
}


@pytest.mark.parametrize("name", sorted(MOVED_FROM_CALLBACKS))
def test_weights_and_broadcast_helpers_via_callbacks_are_deprecated(name: str) -> None:
    import lit_roidata.callbacks as cbs

    new = getattr(importlib.import_module(MOVED_FROM_CALLBACKS[name]), name)
    with pytest.warns(DeprecationWarning, match=rf"{MOVED_FROM_CALLBACKS[name]}\.{name}") as rec:
        assert getattr(cbs, name) is new
    assert rec[0].filename == __file__  # the warning points at the user's line
    assert name not in cbs.__all__


def test_callbacks_index_names_every_callback_of_the_package_without_warning() -> None:
    """``lit_roidata.callbacks`` lists every Lightning callback the package defines (a new
    one must be added there), each the very class of its defining module."""
    import pkgutil

    import pytorch_lightning as pl

    import lit_roidata
    import lit_roidata.callbacks as cbs

    found = {}
    for info in pkgutil.walk_packages(lit_roidata.__path__, "lit_roidata."):
        if info.name.endswith("__main__") or info.name.startswith("lit_roidata.lightning"):
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                module = importlib.import_module(info.name)
        except ImportError:  # an optional dependency (its extra is not installed)
            continue
        for obj in vars(module).values():
            if (isinstance(obj, type) and obj.__module__ == info.name
                    and issubclass(obj, pl.Callback)):
                found[obj.__name__] = info.name
    assert found == cbs.CALLBACKS
    assert set(cbs.__all__) == set(found)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name, module in found.items():
            assert getattr(cbs, name) is getattr(importlib.import_module(module), name)
        from lit_roidata.callbacks import BroadcastParameters  # users' YAML class path
        from lit_roidata.broadcast import BroadcastParameters as defined
    assert BroadcastParameters is defined


def test_importing_the_callbacks_index_imports_no_callback_module() -> None:
    code = ("import sys, lit_roidata.callbacks\n"
            "heavy = [m for m in ('lit_roidata.broadcast', 'lit_roidata.evaluation', "
            "'lit_roidata.models.predict', 'lit_roidata.exchange.callback', "
            "'pytorch_lightning') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    subprocess.run([sys.executable, "-c", code], check=True)
