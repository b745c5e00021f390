"""``lit-roidata``: LightningCLI for training, plus the data tools.

Two kinds of subcommand share one entry point:

* ``fit``, ``validate``, ``test``, ``predict``: Lightning's own CLI (``LightningCLI``)
  with the model and the data module both selectable by class path (subclass mode),
  so ``--config configs/demo.yaml`` and ``--print_config`` work as in any Lightning
  project;
* ``inspect``, ``dump-blobs``, ``bench``, ``make-demo-data``: tools that read the same
  YAML file (its ``data:`` section) and look at the data without training.

The tools are dispatched *before* LightningCLI builds its parser: LightningCLI's
subcommands are Trainer methods, and bolting other commands onto its parser would make
``--print_config`` and the ``fit`` help harder to read. ``lit-roidata --help`` lists
both kinds.

Example::

    lit-roidata fit --config configs/demo.yaml
    lit-roidata fit --config configs/demo.yaml --trainer.devices 2 --trainer.strategy ddp
    lit-roidata inspect --config configs/demo.yaml --out inspect_out
    lit-roidata dump-blobs --config configs/demo.yaml --num 4 --out blobs/
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from typing import Any, Callable, Optional, Sequence

from jsonargparse import DefaultHelpFormatter
from pytorch_lightning import LightningDataModule, LightningModule
from pytorch_lightning.callbacks import OnExceptionCheckpoint
from pytorch_lightning.cli import LightningCLI

__all__ = ["TOOLS", "RoIDataCLI", "main", "run_tool"]

#: Tool subcommand → ``"module:function"`` taking ``argv`` (list of str) → exit code.
TOOLS: dict[str, tuple[str, str]] = {
    "inspect": ("lit_roidata.tools.inspect:main",
                "roidb statistics table, minibatch pictures and histograms (PNG)"),
    "dump-blobs": ("lit_roidata.tools.dump_blobs:main",
                   "Detectron's blob dump: identity order, one image per batch, .npz files"),
    "bench": ("lit_roidata.tools.bench:main",
              "train loader images/s and per-batch latency percentiles on your data"),
    "make-demo-data": ("lit_roidata.tools.make_demo_data:main",
                       "generate the synthetic demo datasets (shapes, proposals, keypoints)"),
}

log = logging.getLogger(__name__)


def _tools_epilog() -> str:
    lines = ["data tools (run `lit-roidata TOOL --help`):"]
    lines += [f"  {name:<15} {help_}" for name, (_, help_) in TOOLS.items()]
    return "\n".join(lines) + "\n"


def _load(target: str) -> Callable[[list[str]], int]:
    import importlib

    module_name, func = target.split(":")
    return getattr(importlib.import_module(module_name), func)


def run_tool(name: str, argv: Sequence[str]) -> int:
    """Run the tool subcommand ``name`` with its own arguments ``argv``; return its code."""
    if name not in TOOLS:
        raise ValueError(f"unknown tool {name!r}; choose one of {sorted(TOOLS)}")
    return int(_load(TOOLS[name][0])(list(argv)) or 0)


class _HelpFormatter(DefaultHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Keep the tools list in the epilog laid out as written."""


class RoIDataCLI(LightningCLI):
    """LightningCLI with the data module and the model selectable by class path.

    The base classes are Lightning's own, so any LightningModule (the demo model or
    yours) and any data module (:class:`lit_roidata.RoIDataModule` or a subclass) can
    be named with ``class_path`` in the YAML file. The written ``config.yaml`` is
    overwritten on a re-run in the same log directory (a resume), not refused.
    """

    def __init__(self, args: Any = None, run: bool = True, **kwargs: Any) -> None:
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault("parser_kwargs", {"epilog": _tools_epilog(),
                                            "formatter_class": _HelpFormatter})
        super().__init__(LightningModule, LightningDataModule, subclass_mode_model=True,
                         subclass_mode_data=True, args=args, run=run, **kwargs)

    def before_fit(self) -> None:
        """Say which checkpoint an ``OnExceptionCheckpoint`` run resumes from.

        With that callback configured and no ``--ckpt_path``, Lightning resumes from the
        interrupted run's checkpoint if there is one (so re-running the same command
        after Ctrl-C continues exactly) and otherwise warns twice that it found none. We
        log the decision once instead of those warnings.
        """
        if self._get(self.config_init, "ckpt_path") is not None:
            return
        ft = [cb for cb in self.trainer.callbacks if isinstance(cb, OnExceptionCheckpoint)]
        if not ft:
            return
        found = [cb.ckpt_path for cb in ft if os.path.isfile(cb.ckpt_path)]
        if found:
            log.warning("resuming from the interrupted run's checkpoint %s "
                        "(OnExceptionCheckpoint); pass --ckpt_path to choose another", found[0])
        else:
            log.info("no interrupted-run checkpoint at %s: starting fresh",
                     ", ".join(cb.ckpt_path for cb in ft))
        for pattern in (r"`\.fit\(ckpt_path=None\)` was called without a model",
                        r'\.fit\(ckpt_path="last"\) is set, but there is no last checkpoint'):
            warnings.filterwarnings("ignore", message=pattern)


    def before_predict(self) -> None:
        """Write the detections as COCO results json: add a
        :class:`~lit_roidata.models.COCOPredictionWriter` (``<default_root_dir>/predictions``)
        unless the config already has a prediction writer."""
        from pytorch_lightning.callbacks import BasePredictionWriter

        from lit_roidata.models.predict import COCOPredictionWriter

        if not any(isinstance(cb, BasePredictionWriter) for cb in self.trainer.callbacks):
            self.trainer.callbacks.append(COCOPredictionWriter())


def cli_main(args: Optional[list[str]] = None, run: bool = True) -> Any:
    """Build and run the Lightning part of ``lit-roidata`` (returns the CLI object)."""
    return RoIDataCLI(args=args, run=run)


def _configure_logging() -> None:
    """Show this package's INFO messages (roidb build report, skip reports) on stderr.

    Only when the application has not configured logging itself (no handler on the root
    logger): an embedding program (or pytest's log capture) keeps control of the output.
    """
    logger = logging.getLogger("lit_roidata")
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry point of ``lit-roidata`` (``[project.scripts]`` in pyproject)."""
    args = list(sys.argv[1:] if argv is None else argv)
    _configure_logging()
    if args and args[0] in TOOLS:
        return run_tool(args[0], args[1:])
    # ``None`` lets LightningCLI read sys.argv itself (it warns when given both).
    cli_main(None if argv is None else args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
