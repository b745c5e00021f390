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
from pytorch_lightning.cli import LightningArgumentParser, LightningCLI

from lit_roidata._lightning import PL, bind, lightning_attr

__all__ = ["TOOLS", "RoIDataCLI", "main", "run_tool", "translate_class_path"]

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
    "convert-proposals": ("lit_roidata.tools.convert_proposals:main",
                          "proposal pickle -> columnar .npz (loads without unpickling)"),
    "cache": ("lit_roidata.tools.cache:main",
              "roidb caches: ls (sizes, datasets, last used), clean, verify (checksums)"),
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


class _RoIDataParserMixin:
    """LightningCLI's parser whose ``--help`` also lists the data module's options
    (mixed into each namespace's ``LightningArgumentParser`` by :func:`_parser_class`).

    In subclass mode (``data: class_path: ...``) jsonargparse shows only ``--data`` and
    ``--data.help CLASS``; a user reading ``lit-roidata fit --help`` would find none of
    the data options. This parser appends :class:`~lit_roidata.RoIDataModule`'s
    (``--data.loader.num_workers``, ...), which also apply to its subclasses.
    """

    def format_help(self) -> str:
        """jsonargparse's help, plus the data module's options on a parser with ``--data``."""
        text = super().format_help()
        if not any(getattr(a, "dest", None) == "data" for a in self._actions):
            return text
        return text + "\n" + _data_options_help()

    def error(self, message: str, *args: Any, **kwargs: Any) -> Any:
        """jsonargparse's error, with the nested name of a data option given flat."""
        return super().error(_renamed_hint(message), *args, **kwargs)  # type: ignore[misc]


_PARSER_CLASSES: dict[str, type] = {}


def _parser_class(namespace: str) -> type:
    """:class:`_RoIDataParserMixin` on ``namespace``'s ``LightningArgumentParser`` (its
    checks of callbacks and modules are against that namespace's classes)."""
    if namespace not in _PARSER_CLASSES:
        base = lightning_attr(namespace, "cli.LightningArgumentParser")
        _PARSER_CLASSES[namespace] = type("RoIDataParser", (_RoIDataParserMixin, base),
                                          {"__module__": __name__})
    return _PARSER_CLASSES[namespace]


def _renamed_hint(message: str) -> str:
    """Append "data.<flat> is now data.<group>.<key>" for each flat option of earlier
    releases named in ``message``."""
    import re

    from lit_roidata.options import DEPRECATED_FLAT_ARGS

    # "Option 'x'" / "key 'x'" (newer jsonargparse), "NestedArg(key='x'" (4.39)
    found = re.findall(r"(?:Option|key) ?=?'(\w+)'", str(message))
    hints = [f"data.{k} is now data.{'.'.join(DEPRECATED_FLAT_ARGS[k])}" for k in
             dict.fromkeys(found) if k in DEPRECATED_FLAT_ARGS]
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

    The base classes are Lightning's own, so any LightningModule (the demo model or
    yours) and any data module (:class:`lit_roidata.RoIDataModule` or a subclass) can
    be named with ``class_path`` in the YAML file. The written ``config.yaml`` is
    overwritten on a re-run in the same log directory (a resume), not refused.
    ``lit_roidata.lightning.RoIDataCLI`` is the same CLI for ``lightning.pytorch``.
    """

    def __init__(self, args: Any = None, run: bool = True, **kwargs: Any) -> None:
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        from lit_roidata._lightning import namespace_of

        kwargs.setdefault("parser_class", _parser_class(namespace_of(self) or PL))
        kwargs.setdefault("parser_kwargs", {"epilog": _tools_epilog(),
                                            "formatter_class": _HelpFormatter})
        super().__init__(lightning_attr(self, "LightningModule"),
                         lightning_attr(self, "LightningDataModule"), subclass_mode_model=True,
                         subclass_mode_data=True, args=args, run=run, **kwargs)

    def setup_parser(self, add_subcommands: bool, main_kwargs: dict[str, Any],
                     subparser_kwargs: dict[str, Any]) -> None:
        """LightningCLI's parser; for ``lightning.pytorch`` the YAML files' class paths of
        the other namespace are translated (:func:`translate_class_path`), so the same
        config files serve both."""
        super().setup_parser(add_subcommands, main_kwargs, subparser_kwargs)
        from lit_roidata._lightning import LIGHTNING, namespace_of

        if namespace_of(self) == LIGHTNING and self.parser.parser_mode == "yaml":
            self.parser.parser_mode = _lightning_parser_mode()  # reaches the subcommands

    def before_fit(self) -> None:
        """Choose the checkpoint to resume from, say which (and its step), or say that
        training starts fresh.

        * ``--ckpt_path last``: the newest of the interrupted-run checkpoint and the
          ``last.ckpt`` files of every ``ModelCheckpoint`` (also in earlier logger
          versions, where Lightning does not look);
        * ``--ckpt_path fresh``: start from scratch; an interrupted-run checkpoint is
          moved aside to ``<name>.ckpt.stale``;
        * no ``--ckpt_path`` with ``OnExceptionCheckpoint`` configured: resume the
          interrupted run if its checkpoint was written by an interrupted ``fit`` (so
          re-running the same command after Ctrl-C continues exactly). A checkpoint
          written by another subcommand's crash is moved aside, not resumed.

        Under DDP the decision is made once (rank 0) and handed to the other processes
        through the environment (``LIT_ROIDATA_RESUME_FROM``).
        """
        _use_step_progress_bar(self.trainer)
        decided = os.environ.get(_RESUME_ENV)
        if decided is not None:
            if not decided:
                _no_implicit_last(self.trainer)
            self._set_ckpt_path(decided or None)
            return
        ckpt = self._get(self.config_init, "ckpt_path")
        on_exc = lightning_attr(self.trainer, "callbacks.OnExceptionCheckpoint")
        ft = [cb for cb in self.trainer.callbacks if isinstance(cb, on_exc)]
        for pattern in _SILENCED_WARNINGS:
            warnings.filterwarnings("ignore", message=pattern)
        if ckpt in (None, "last"):
            # Never resume (nor let Lightning resume, which treats ckpt_path=None as "last"
            # when OnExceptionCheckpoint is configured) from another subcommand's crash.
            for cb in ft:
                if os.path.isfile(cb.ckpt_path) and _interrupted_fit_step(cb.ckpt_path) is None:
                    _move_aside(cb.ckpt_path, "it was not written by an interrupted `fit`")
        if ckpt == "fresh":
            for cb in ft:
                _move_aside(cb.ckpt_path, "--ckpt_path fresh")
            log.warning("starting a fresh run (--ckpt_path fresh)")
            path = None
        elif ckpt == "last":
            found = [p for p in (cb.ckpt_path for cb in ft) if os.path.isfile(p)]
            found += _last_checkpoints(self.trainer)
            path = max(found, key=os.path.getmtime) if found else None
            if path is None:
                log.warning("--ckpt_path last: no last checkpoint found (looked for %s); "
                            "training starts from scratch", ", ".join(_last_patterns(self.trainer)
                                                                     ) or "none configured")
            else:
                log.warning("resuming from %s (global step %s; --ckpt_path last)", path,
                            _step_of(path))
        elif ckpt is not None:
            log.warning("resuming from %s (global step %s)", ckpt, _step_of(str(ckpt)))
            path = str(ckpt)
        else:
            path = None
            for cb in ft:
                if not os.path.isfile(cb.ckpt_path):
                    continue
                step = _interrupted_fit_step(cb.ckpt_path)
                path = cb.ckpt_path
                log.warning("resuming the interrupted run from %s at global step %d "
                            "(OnExceptionCheckpoint). To start fresh instead, pass "
                            "--ckpt_path fresh; to choose a checkpoint, --ckpt_path PATH",
                            path, step)
                break
            if path is None and ft:
                log.info("no interrupted-run checkpoint at %s: starting fresh",
                         ", ".join(cb.ckpt_path for cb in ft))
        if path is None:
            _no_implicit_last(self.trainer)
        os.environ[_RESUME_ENV] = path or ""
        self._set_ckpt_path(path)

    def after_fit(self) -> None:
        """Forget the resume decision handed to the DDP processes."""
        os.environ.pop(_RESUME_ENV, None)

    def _set_ckpt_path(self, path: Optional[str]) -> None:
        self.config_init[self.subcommand]["ckpt_path"] = path

    def _not_fit(self) -> None:
        """``validate``/``test``/``predict`` never write an interrupted-run checkpoint:
        a crash there must not make the next ``fit`` resume (another experiment)."""
        _use_step_progress_bar(self.trainer)
        on_exc = lightning_attr(self.trainer, "callbacks.OnExceptionCheckpoint")
        kept = [cb for cb in self.trainer.callbacks if not isinstance(cb, on_exc)]
        if len(kept) != len(self.trainer.callbacks):
            self.trainer.callbacks = kept

    before_validate = before_test = _not_fit

    def before_predict(self) -> None:
        """As ``validate``/``test`` (no interrupted-run checkpoint), and write the
        detections as COCO results json: add a
        :class:`~lit_roidata.models.COCOPredictionWriter` (``<default_root_dir>/predictions``)
        unless the config already has a prediction writer."""
        from lit_roidata._lightning import namespace_of
        from lit_roidata.models.predict import COCOPredictionWriter

        self._not_fit()
        writer = lightning_attr(self.trainer, "callbacks.BasePredictionWriter")
        if not any(isinstance(cb, writer) for cb in self.trainer.callbacks):
            self.trainer.callbacks.append(
                bind(COCOPredictionWriter, namespace_of(self.trainer) or PL)())


_RESUME_ENV = "LIT_ROIDATA_RESUME_FROM"
#: Lightning's warnings about the resume choice the CLI made itself (checked against
#: Lightning's text by tests/test_lightning_internals.py).
_SILENCED_WARNINGS = (r"`\.fit\(ckpt_path=None\)` was called without a model",
                      r'\.fit\(ckpt_path="last"\) is set, but there is no last checkpoint')
_LIGHTNING_MODE = "lit_roidata_lightning"


def translate_class_path(path: str, namespace: str) -> str:
    """The class path of ``path``'s class in ``namespace``: ``pytorch_lightning.X`` <->
    ``lightning.pytorch.X``; a lit_roidata Lightning class (``lit_roidata.RoIDataModule``,
    ``lit_roidata.demo.DemoFastRCNN``) -> its binding (``lit_roidata.lightning.X``).
    Anything else (your own classes) is returned unchanged."""
    from lit_roidata._lightning import LIGHTNING, bind, namespace_of, source_class

    other = {PL: LIGHTNING, LIGHTNING: PL}[namespace]
    if path.startswith(other + "."):
        return namespace + path[len(other):]
    if not path.startswith("lit_roidata."):
        return path
    import importlib

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


def _lightning_parser_mode() -> str:
    """A jsonargparse parser mode: YAML with the class paths translated to
    ``lightning.pytorch`` (:func:`translate_class_path`), registered once."""
    import jsonargparse
    import yaml

    from lit_roidata._lightning import LIGHTNING

    if _LIGHTNING_MODE not in _modes_registered:
        yaml_loader = jsonargparse.get_loader("yaml")
        jsonargparse.set_loader(
            _LIGHTNING_MODE, lambda text: _translate_class_paths(yaml_loader(text), LIGHTNING),
            exceptions=(yaml.YAMLError,))
        _modes_registered.add(_LIGHTNING_MODE)
    return _LIGHTNING_MODE


_modes_registered: set[str] = set()


def _use_step_progress_bar(trainer: Any) -> None:
    """Swap Lightning's own progress bars for the step-counting ones (same settings)."""
    from lit_roidata._lightning import namespace_of
    from lit_roidata.progress import StepProgressBar, StepTQDMProgressBar

    ns = namespace_of(trainer) or PL
    swap = {lightning_attr(ns, "callbacks.RichProgressBar"): bind(StepProgressBar, ns),
            lightning_attr(ns, "callbacks.TQDMProgressBar"): bind(StepTQDMProgressBar, ns)}
    for cb in trainer.callbacks:
        if type(cb) in swap:
            cb.__class__ = swap[type(cb)]


def _no_implicit_last(trainer: Any) -> None:
    """Start fresh although ``OnExceptionCheckpoint`` is configured.

    Lightning turns ``fit(ckpt_path=None)`` into ``"last"`` when that callback is
    present, and ``"last"`` also takes ``ModelCheckpoint``'s ``last.ckpt`` (with a fixed
    ``dirpath``: the previous, maybe finished, run). The CLI has decided not to resume,
    so hide those from that lookup (``ModelCheckpoint._find_last_checkpoints``, checked by
    tests/test_cli_lifecycle.py).
    """
    ModelCheckpoint = lightning_attr(trainer, "callbacks.ModelCheckpoint")
    for cb in trainer.callbacks:
        if isinstance(cb, ModelCheckpoint):
            assert hasattr(cb, "_find_last_checkpoints"), "Lightning API changed"
            cb._find_last_checkpoints = _none_found


def _none_found(trainer: Any) -> set:
    """``ModelCheckpoint._find_last_checkpoints`` replacement: nothing (picklable)."""
    return set()


def _load_meta(path: str) -> dict[str, Any]:
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - an unreadable file is "not resumable"
        return {}


def _step_of(path: str) -> Any:
    return _load_meta(path).get("global_step", "?") if os.path.isfile(path) else "?"


def _interrupted_fit_step(path: str) -> Optional[int]:
    """The global step of an interrupted ``fit`` checkpoint, or ``None`` when the file was
    written by another subcommand (or is unreadable)."""
    ckpt = _load_meta(path)
    if "loops" not in ckpt or "fit_loop" not in (ckpt.get("loops") or {}):
        return None
    phases = [v["phase"] for v in ckpt.values() if isinstance(v, dict)
              and isinstance(v.get("phase"), dict) and v["phase"]]
    if phases and any(str(p.get("fn")) != "fit" for p in phases):
        return None
    return int(ckpt.get("global_step", 0))


def _move_aside(path: str, why: str) -> None:
    if os.path.isfile(path):
        os.replace(path, path + ".stale")
        log.warning("not resuming from %s (%s): moved it to %s", path, why, path + ".stale")


def _last_patterns(trainer: Any) -> list[str]:
    ModelCheckpoint = lightning_attr(trainer, "callbacks.ModelCheckpoint")
    pats = []
    for cb in trainer.callbacks:
        if not isinstance(cb, ModelCheckpoint):
            continue
        name = f"{cb.CHECKPOINT_NAME_LAST}*{cb.FILE_EXTENSION}"
        if cb.dirpath is not None:
            pats.append(os.path.join(str(cb.dirpath), name))
        elif trainer.loggers:
            lg = trainer.loggers[0]
            base = os.path.join(str(lg.save_dir or trainer.default_root_dir), str(lg.name or ""))
            pats.append(os.path.join(base, "*", "checkpoints", name))
        else:
            pats.append(os.path.join(str(trainer.default_root_dir), "checkpoints", name))
    return pats


def _last_checkpoints(trainer: Any) -> list[str]:
    """``last*.ckpt`` of every ModelCheckpoint, in its dirpath or (dirpath unset) in
    every version folder of the first logger."""
    import glob

    return [p for pat in _last_patterns(trainer) for p in glob.glob(pat) if os.path.isfile(p)]



def cli_main(args: Optional[list[str]] = None, run: bool = True, namespace: str = PL) -> Any:
    """Build and run the Lightning part of ``lit-roidata`` (returns the CLI object);
    ``namespace="lightning.pytorch"`` uses that namespace's LightningCLI and Trainer."""
    try:
        return bind(RoIDataCLI, namespace)(args=args, run=run)
    finally:
        if int(os.environ.get("LOCAL_RANK", "0") or 0) == 0:
            os.environ.pop(_RESUME_ENV, None)


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
        handler.addFilter(_RankZeroFilter())


class _RankZeroFilter(logging.Filter):
    """Under DDP, print a message once (global rank 0) unless it is rank-specific
    (``log.warning(..., extra={"rank_specific": True})``); those are prefixed with the rank."""

    def filter(self, record: logging.LogRecord) -> bool:
        # The rank is set by the strategy of the namespace in use; the other namespace's
        # (if imported) keeps the one it read from the environment: the same, or 0.
        rank = 0
        for ns in ("pytorch_lightning", "lightning.pytorch"):
            module = sys.modules.get(f"{ns}.utilities.rank_zero")
            if module is not None:
                rank = max(rank, int(getattr(module.rank_zero_only, "rank", 0) or 0))
        if getattr(record, "rank_specific", False):
            record.msg = f"[rank {rank}] {record.msg}"
            return True
        return rank == 0


def main(argv: Optional[Sequence[str]] = None, namespace: str = PL) -> int:
    """Console entry point of ``lit-roidata`` (``[project.scripts]`` in pyproject);
    ``python -m lit_roidata.lightning`` passes ``namespace="lightning.pytorch"``."""
    args = list(sys.argv[1:] if argv is None else argv)
    _configure_logging()
    if args and args[0] in TOOLS:
        return run_tool(args[0], args[1:])
    # ``None`` lets LightningCLI read sys.argv itself (it warns when given both).
    cli_main(None if argv is None else args, namespace=namespace)
    return 0


if __name__ == "__main__":
    sys.exit(main())
