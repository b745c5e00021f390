"""Shared argument handling of the data tools: the ``data:`` section of a CLI config."""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

from jsonargparse import ActionConfigFile, ArgumentParser

from lit_roidata._lightning import NAMESPACES, available, isinstance_any, lightning_attr

__all__ = ["tool_parser", "data_module_from"]

# Top-level keys of a LightningCLI config that the tools accept and ignore.
_IGNORED: dict[str, Any] = {
    **dict.fromkeys(("trainer", "model", "optimizer", "lr_scheduler"), Optional[dict]),
    "seed_everything": Optional[Union[bool, int]], "ckpt_path": Optional[str]}


def tool_parser(prog: str, description: str) -> ArgumentParser:
    """A parser with ``--config`` and ``--data`` (class path + ``--data.*`` options)."""
    parser = ArgumentParser(prog=f"lit-roidata {prog}", description=description, exit_on_error=True)
    parser.add_argument("-c", "--config", action=ActionConfigFile,
                        help="a lit-roidata YAML config (its data: section is used)")
    # LightningDataModule of both namespaces (when ``lightning`` is installed): a config
    # may name lit_roidata.RoIDataModule or lit_roidata.lightning.RoIDataModule.
    bases = tuple(lightning_attr(ns, "LightningDataModule") for ns in NAMESPACES if available(ns))
    parser.add_subclass_arguments(bases, "data", required=True,
                                  help="the data module (class_path + init_args)")
    for key, hint in _IGNORED.items():
        parser.add_argument(f"--{key}", type=hint, default=None, help="(ignored by the tools)")
    return parser


def data_module_from(parser: ArgumentParser, argv: Sequence[str]) -> tuple[Any, Any]:
    """Parse ``argv``; return ``(namespace, RoIDataModule instance)``.

    Raises:
        SystemExit: bad arguments (jsonargparse's message), or a data module that is
            not a :class:`lit_roidata.RoIDataModule`.
    """
    from lit_roidata.datamodule import RoIDataModule

    cfg = parser.parse_args(list(argv))
    dm = (getattr(parser, "instantiate", None) or parser.instantiate_classes)(cfg).data
    if not isinstance_any(dm, RoIDataModule):
        parser.error(f"data: the tools need a lit_roidata.RoIDataModule, got "
                     f"{type(dm).__name__}")
    return cfg, dm
