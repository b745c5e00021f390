"""The Lightning part of ``lit-roidata``: ``fit``, ``validate``, ``test``, ``predict``.

:class:`RoIDataCLI` is Lightning's ``LightningCLI`` with the data module and the model
selectable by class path; it uses only LightningCLI's documented override points
(``instantiate_trainer``, ``before_<subcommand>``, ``after_fit``, ``setup_parser``) and
public attributes of the Trainer and callbacks. Imported by :mod:`lit_roidata.cli` only
when a training subcommand runs (it imports Lightning).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import logging
import os
import re
import sys
import warnings
from typing import Any, Optional

import jsonargparse
import yaml
from jsonargparse import ActionConfigFile, DefaultHelpFormatter
from pytorch_lightning.cli import LightningArgumentParser, LightningCLI

from lit_roidata._lightning import (LIGHTNING, PL, bind, isinstance_any, lightning_attr,
                                    namespace_of, source_class)
from lit_roidata.commands import EXIT_STATUS, TRAINING, tools_help

__all__ = ["RoIDataCLI", "cli_main", "translate_class_path"]

log = logging.getLogger("lit_roidata.cli")

_RESUME_ENV = "LIT_ROIDATA_RESUME_FROM"
#: Lightning's warnings about the resume choice the CLI made itself (``fit`` is always
#: given the checkpoint it resumes from, or ``None`` where nothing would be found).
_SILENCED_WARNINGS = (r"`\.fit\(ckpt_path=None\)` was called without a model",
                      r'\.fit\(ckpt_path="last"\) is set, but there is no last checkpoint')
_LIGHTNING_MODE = "lit_roidata_lightning"


class _HelpFormatter(DefaultHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Keep the epilogs laid out as written."""


class _RoIDataParserMixin:
    """LightningCLI's parser whose ``--help`` also lists :class:`~lit_roidata.RoIDataModule`'s
    options (jsonargparse's subclass mode shows only ``--data``)."""

    def format_help(self) -> str:
        """jsonargparse's help, plus the data module's options on a parser with ``--data``."""
        text = super().format_help()  # type: ignore[misc]
        # (only a parser with the data module in subclass mode has --data.help)
        return text + "\n" + _data_options_help() if "--data.help" in text else text

    def error(self, message: str, *args: Any, **kwargs: Any) -> Any:
        """jsonargparse's error, with the nested name of a data option given flat."""
        return super().error(_renamed_hint(message), *args, **kwargs)  # type: ignore[misc]


@functools.cache
def _parser_class(namespace: str) -> type:
    """:class:`_RoIDataParserMixin` on ``namespace``'s ``LightningArgumentParser`` (its
    checks of callbacks and modules are against that namespace's classes)."""
    base = lightning_attr(namespace, "cli.LightningArgumentParser")
    return type("RoIDataParser", (_RoIDataParserMixin, base), {"__module__": __name__})


def _renamed_hint(message: str) -> str:
    """Append "data.<flat> is now data.<group>.<key>" for each flat option of earlier
    releases named in ``message``."""
    from lit_roidata.options import MOVED_OPTIONS as moved

    # "Option 'x'" / "key 'x'" (newer jsonargparse), "NestedArg(key='x'" (4.39)
    found = re.findall(r"(?:Option|key) ?=?'(\w+)'", str(message))
    hints = [f"data.{k} is now data.{'.'.join(moved[k])}" for k in dict.fromkeys(found)
             if k in moved]
    if not hints:
        return message
    return f"{message}\n  The data module's options are grouped: " + "; ".join(hints) + \
        " (docs/getting_started.md, 'Data module options')"


def _data_options_help() -> str:
    """The option groups of :class:`~lit_roidata.RoIDataModule` as jsonargparse prints them."""
    from lit_roidata.datamodule import RoIDataModule

    parser = LightningArgumentParser(prog="lit-roidata")
    parser.add_class_arguments(RoIDataModule, "data", fail_untyped=False, sub_configs=True)
    text = parser.format_help()
    # Drop the usage line and the "options: -h" block: keep the option groups.
    start = text.find("\n\n", text.find("-h, --help"))
    groups = text[start:].strip("\n") if start >= 0 else text
    return ("data module options (lit_roidata.RoIDataModule; lit_roidata.DemoRoIDataModule "
            "adds --data.demo_root\nand --data.demo_size; `--data.help CLASS` shows another "
            "data module's):\n\n" + groups + "\n")


class RoIDataCLI(LightningCLI):
    """LightningCLI with the data module and the model selectable by class path.

    Any LightningModule and any data module can be named with ``class_path``; the written
    ``config.yaml`` is overwritten on a re-run (a resume). ``lit_roidata.lightning.RoIDataCLI``
    is the same CLI for ``lightning.pytorch``.
    """

    def __init__(self, args: Any = None, run: bool = True, **kwargs: Any) -> None:
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        help_kw = {"epilog": tools_help() + "\n" + EXIT_STATUS, "formatter_class": _HelpFormatter}
        kwargs.setdefault("parser_kwargs", {**help_kw, **{cmd: dict(help_kw) for cmd in TRAINING}})
        super().__init__(lightning_attr(self, "LightningModule"),
                         lightning_attr(self, "LightningDataModule"), subclass_mode_model=True,
                         subclass_mode_data=True, args=args, run=run, **kwargs)

    def init_parser(self, **kwargs: Any) -> Any:
        """LightningCLI's parser, whose ``--help`` also lists the data module's options."""
        ns = namespace_of(self) or PL
        kwargs.setdefault("dump_header", [f"{ns}=={lightning_attr(ns, '__version__')}"])
        parser = _parser_class(ns)(**kwargs)
        parser.add_argument("-c", "--config", action=ActionConfigFile,
                            help="Path to a configuration file in json or yaml format.")
        return parser

    def setup_parser(self, add_subcommands: bool, main_kwargs: dict[str, Any],
                     subparser_kwargs: dict[str, Any]) -> None:
        """LightningCLI's parser; for ``lightning.pytorch`` the YAML files' class paths are
        translated (:func:`translate_class_path`)."""
        super().setup_parser(add_subcommands, main_kwargs, subparser_kwargs)
        if namespace_of(self) == LIGHTNING and self.parser.parser_mode == "yaml":
            self.parser.parser_mode = _lightning_parser_mode()  # reaches the subcommands

    def subcommand_config(self) -> Any:
        """This subcommand's part of ``config_init`` (all of it without subcommands)."""
        return self.config_init[self.subcommand] if self.subcommand else self.config_init

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        """LightningCLI's Trainer, plus :class:`~lit_roidata.progress.StepTQDMProgressBar`
        (unless bars are off or one is configured) and ``BadImageReport`` (when the data
        module skips bad images) where the config has none of their kind."""
        from lit_roidata.loader_callbacks import BadImageReport
        from lit_roidata.progress import StepTQDMProgressBar

        ns = namespace_of(self) or PL
        config = {**(self.subcommand_config().get("trainer") or {}), **kwargs}
        callbacks = config.get("callbacks")
        callbacks = [] if callbacks is None else list(callbacks) if isinstance(
            callbacks, (list, tuple)) else [callbacks]
        if (getattr(getattr(self.datamodule, "sources", None), "on_bad_image", None) == "skip"
                and not any(isinstance_any(cb, BadImageReport) for cb in callbacks)):
            callbacks.insert(0, bind(BadImageReport, ns)())
        bar = lightning_attr(ns, "callbacks.ProgressBar")
        if (config.get("enable_progress_bar") is not False and not config.get("barebones")
                and not any(isinstance(cb, bar) for cb in callbacks)):
            callbacks.append(bind(StepTQDMProgressBar, ns)())
        return super().instantiate_trainer(**{**kwargs, "callbacks": callbacks})

    def before_fit(self) -> None:
        """Resume from the checkpoint :func:`~lit_roidata.resume.choose_fit_checkpoint` picks,
        decided once under DDP (rank 0) and handed on in ``LIT_ROIDATA_RESUME_FROM``."""
        from lit_roidata.resume import ResumeChoiceError, choose_fit_checkpoint

        for pattern in _SILENCED_WARNINGS:
            warnings.filterwarnings("ignore", message=pattern)
        if (decided := os.environ.get(_RESUME_ENV)) is None:
            try:
                asked = self.subcommand_config().get("ckpt_path")
                decided = choose_fit_checkpoint(self.trainer, asked)
            except ResumeChoiceError as exc:
                print(f"lit-roidata fit: error: {exc}", file=sys.stderr)
                raise SystemExit(2) from None
            os.environ[_RESUME_ENV] = decided = decided or ""
        self.subcommand_config()["ckpt_path"] = decided or None

    def after_fit(self) -> None:
        """Forget the resume decision handed to the DDP processes."""
        os.environ.pop(_RESUME_ENV, None)

    def before_validate(self) -> None:
        """Run without ``OnExceptionCheckpoint`` (also ``test`` and ``predict``): their
        crashes must not leave or delete an interrupted run's checkpoint."""
        on_exc = lightning_attr(self.trainer, "callbacks.OnExceptionCheckpoint")
        self.trainer.callbacks = [cb for cb in self.trainer.callbacks if not isinstance(cb, on_exc)]

    before_test = before_validate

    def before_predict(self) -> None:
        """As ``validate``/``test``, plus a :class:`~lit_roidata.models.COCOPredictionWriter`
        unless the config has a prediction writer."""
        from lit_roidata.models.predict import COCOPredictionWriter

        self.before_validate()
        writer = lightning_attr(self.trainer, "callbacks.BasePredictionWriter")
        if not any(isinstance(cb, writer) for cb in self.trainer.callbacks):
            self.trainer.callbacks.append(
                bind(COCOPredictionWriter, namespace_of(self.trainer) or PL)())


def translate_class_path(path: str, namespace: str) -> str:
    """The class path of ``path``'s class in ``namespace``: ``pytorch_lightning.X`` <->
    ``lightning.pytorch.X``; a lit_roidata Lightning class (``lit_roidata.RoIDataModule``,
    ``lit_roidata.demo.DemoFastRCNN``) -> its binding (``lit_roidata.lightning.X``).
    Anything else (your own classes) is returned unchanged."""
    other = {PL: LIGHTNING, LIGHTNING: PL}[namespace]
    if path.startswith(other + "."):
        return namespace + path[len(other):]
    if not path.startswith("lit_roidata."):
        return path
    module, _, name = path.rpartition(".")
    try:
        obj = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return path
    if (not isinstance(obj, type) or namespace_of(obj) in (None, namespace)
            or not source_class(obj).__module__.startswith("lit_roidata.")):
        return path
    bound = bind(obj, namespace)
    return f"{bound.__module__}.{bound.__qualname__}"


def _translate_class_paths(value: Any, namespace: str) -> Any:
    if isinstance(value, dict):
        out = {k: _translate_class_paths(v, namespace) for k, v in value.items()}
        if isinstance(out.get("class_path"), str):
            out["class_path"] = translate_class_path(out["class_path"], namespace)
        return out
    if isinstance(value, list):
        return [_translate_class_paths(v, namespace) for v in value]
    return value


@functools.cache
def _lightning_parser_mode() -> str:
    """A jsonargparse parser mode: YAML with the class paths translated to
    ``lightning.pytorch`` (:func:`translate_class_path`), registered once."""
    yaml_loader = jsonargparse.get_loader("yaml")
    jsonargparse.set_loader(
        _LIGHTNING_MODE, lambda text: _translate_class_paths(yaml_loader(text), LIGHTNING),
        exceptions=(yaml.YAMLError,))
    return _LIGHTNING_MODE


def cli_main(args: Optional[list[str]] = None, run: bool = True, namespace: str = PL) -> Any:
    """Build and run the Lightning part of ``lit-roidata`` (returns the CLI object);
    ``namespace="lightning.pytorch"`` uses that namespace's LightningCLI and Trainer."""
    try:
        return bind(RoIDataCLI, namespace)(args=args, run=run)
    finally:
        if int(os.environ.get("LOCAL_RANK", "0") or 0) == 0:
            os.environ.pop(_RESUME_ENV, None)
