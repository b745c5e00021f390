"""lit_roidata uses only Lightning's documented API (issue: public API only).

A scan of the package's source for the Lightning internals a plugin must not touch: the
loops and their progress counters, connectors, underscored members of the Trainer, of
callbacks and of progress bars, replaced methods on Lightning objects and class swaps.
Each finding names the file, the line and what it touches.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lit_roidata"

#: Attribute names that only exist inside Lightning's loops, connectors and callbacks.
PRIVATE_NAMES = {
    "fit_loop", "epoch_loop", "val_loop", "validate_loop", "test_loop", "predict_loop",
    "batch_progress", "epoch_progress", "scheduler_progress", "optim_progress",
    "_batches_that_stepped", "_combined_loader", "_data_connector", "_checkpoint_connector",
    "_logger_connector", "_callback_connector", "_signal_connector", "_accelerator_connector",
    "_find_last_checkpoints", "_train_progress_bar", "_val_progress_bar", "_update",
    "_initialize_train_progress_bar_id", "_should_update", "_last_global_step_saved",
    "_restarting", "restarting", "_results", "_active_loop",
}
#: Receivers whose underscored members are Lightning's private state.
LIGHTNING_RECEIVERS = re.compile(r"(^|_)(trainer|callback|cb|bar|progress_bar|checkpoint_callback"
                                 r"|strategy|logger|pl_module|lightning_module)$")


def _findings() -> list[str]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        rel = path.relative_to(PACKAGE.parent)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                if node.attr in PRIVATE_NAMES:
                    out.append(f"{rel}:{node.lineno}: .{node.attr}")
                recv = node.value
                name = (recv.attr if isinstance(recv, ast.Attribute)
                        else recv.id if isinstance(recv, ast.Name) else "")
                if (node.attr.startswith("_") and not node.attr.startswith("__")
                        and LIGHTNING_RECEIVERS.search(name)):
                    out.append(f"{rel}:{node.lineno}: {name}.{node.attr}")
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    if isinstance(t, ast.Attribute) and t.attr == "__class__":
                        out.append(f"{rel}:{node.lineno}: assigns __class__")
    return out


def test_no_lightning_internals_in_the_package() -> None:
    found = _findings()
    assert not found, "Lightning internals used:\n" + "\n".join(found)


def test_the_scan_finds_what_it_looks_for(tmp_path: Path, monkeypatch) -> None:
    """The scan is not vacuous: each pattern it forbids is found in a planted file."""
    bad = tmp_path / "lit_roidata"
    bad.mkdir()
    (bad / "m.py").write_text(
        "def f(trainer, cb, bar, loader):\n"
        "    trainer.fit_loop.epoch_loop.batch_progress.total.ready = 1\n"
        "    trainer._checkpoint_connector.restore()\n"
        "    cb._find_last_checkpoints = None\n"
        "    bar._update(1, 2)\n"
        "    bar.__class__ = object\n"
        "    return trainer.fit_loop._combined_loader\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", bad)
    found = "\n".join(_findings())
    for what in (".fit_loop", ".epoch_loop", ".batch_progress", "trainer._checkpoint_connector",
                 "._find_last_checkpoints", "bar._update", "assigns __class__",
                 "._combined_loader"):
        assert what in found, what
