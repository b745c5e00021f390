"""What importing a part of the package brings in: the exchange library no demo code, the
callbacks index no callback module, and the index names every callback of the package."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

from package_support import package_classes


def test_the_exchange_library_imports_no_demo_code() -> None:
    code = ("import sys, lit_roidata.exchange, lit_roidata.exchange.callback, "
            "lit_roidata.exchange.embedded\n"
            "bad = sorted(m for m in sys.modules if m.startswith('lit_roidata.demo'))\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_callbacks_index_names_every_callback_of_the_package_without_warning() -> None:
    """``lit_roidata.callbacks`` lists every Lightning callback the package defines (a new
    one must be added there), each the very class of its defining module."""
    import pytorch_lightning as pl

    import lit_roidata.callbacks as cbs

    found = package_classes(lambda cls: issubclass(cls, pl.Callback))
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
