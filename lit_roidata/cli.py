"""``lit-roidata``: LightningCLI for training, plus the data tools.

``fit``, ``validate``, ``test``, ``predict`` are Lightning's CLI
(:class:`~lit_roidata.trainer_cli.RoIDataCLI`); ``inspect``, ``dump-blobs``, ``bench``,
``make-demo-data``, ``convert-proposals`` and ``cache`` are dispatched before it. This
module imports neither torch nor Lightning, so ``--help`` and the cache tools start at
once (docs/cli.md)::

    lit-roidata fit --config configs/demo.yaml
    lit-roidata cache ls
"""

from __future__ import annotations

import importlib
import logging
import sys
from typing import Any, Optional, Sequence

from lit_roidata._lightning import LIGHTNING, PL, import_namespace
from lit_roidata._optional import lazy_getattr
from lit_roidata.commands import EXIT_STATUS, TOOLS, TRAINING, tools_help

# RoIDataCLI, cli_main, translate_class_path: loaded on first use (module __getattr__).
__all__ = ["TOOLS", "TRAINING", "RoIDataCLI", "cli_main", "main", "run_tool",  # noqa: F822
           "translate_class_path", "exit_status", "top_level_help", "tools_help"]

# The LightningCLI part imports Lightning: only when it is used.
__getattr__ = lazy_getattr(__name__, dict.fromkeys(
    ("RoIDataCLI", "cli_main", "translate_class_path"), "lit_roidata.trainer_cli"))


def run_tool(name: str, argv: Sequence[str]) -> int:
    """Run the tool subcommand ``name`` with its own arguments ``argv``; return its code."""
    if name not in TOOLS:
        raise ValueError(f"unknown tool {name!r}; choose one of {sorted(TOOLS)}")
    module_name, func = TOOLS[name][0].split(":")
    return int(getattr(importlib.import_module(module_name), func)(list(argv)) or 0)


def _prog(namespace: str) -> str:
    return "lit-roidata" if namespace == PL else "python -m lit_roidata.lightning"


def top_level_help(namespace: str = PL) -> str:
    """``lit-roidata --help`` (written here: building LightningCLI's parser imports Lightning)."""
    prog = _prog(namespace)
    lines = [f"usage: {prog} [-h] {{{','.join([*TRAINING, *TOOLS])}}} ...", "",
             "Detectron's training-data pipeline for PyTorch Lightning"
             + (" (lightning.pytorch namespace)." if namespace != PL else "."), "",
             "options:", "  -h, --help          show this help message and exit", "",
             f"training (Lightning's LightningCLI; `{prog} SUBCOMMAND --help` lists every "
             "option):"]
    lines += [f"  {name:<18} {help_}" for name, help_ in TRAINING.items()]
    return "\n".join(lines) + "\n\n" + tools_help() + "\n" + EXIT_STATUS


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
        rank = max((int(getattr(m.rank_zero_only, "rank", 0) or 0) for ns in (PL, LIGHTNING)
                    if (m := sys.modules.get(f"{ns}.utilities.rank_zero")) is not None), default=0)
        if getattr(record, "rank_specific", False):
            record.msg = f"[rank {rank}] {record.msg}"
            return True
        return rank == 0


def exit_status(cli: Any) -> int:
    """0, or ``128 + signum`` when a callback of ``cli.trainer`` stopped the run on a signal
    (:class:`~lit_roidata.callbacks.GracefulStop`'s public ``stopped_by_signal``)."""
    for cb in getattr(getattr(cli, "trainer", None), "callbacks", None) or ():
        if signum := getattr(cb, "stopped_by_signal", None):
            return 128 + int(signum)
    return 0


def main(argv: Optional[Sequence[str]] = None, namespace: str = PL) -> int:
    """Console entry point of ``lit-roidata`` (``[project.scripts]`` in pyproject);
    ``python -m lit_roidata.lightning`` passes ``namespace="lightning.pytorch"``.

    Returns the exit status (:data:`EXIT_STATUS`): ``128 + N`` after ``fit`` stopped
    gracefully on signal ``N``.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    _configure_logging()
    if args and args[0] in TOOLS:
        return run_tool(args[0], args[1:])
    if not args or args[0] in ("-h", "--help"):
        text = top_level_help(namespace)
        if args:
            print(text, end="")
            return 0
        print(text.split("\n")[0] + f"\n{_prog(namespace)}: error: choose a subcommand "
              f"(--help lists them)", file=sys.stderr)
        return 2
    if namespace == LIGHTNING:  # before pytorch_lightning (Lightning 2.4, docs/cli.md)
        import_namespace(LIGHTNING)  # or an error naming the [lightning] extra
    from lit_roidata.trainer_cli import cli_main as run

    # ``None`` lets LightningCLI read sys.argv itself (it warns when given both).
    return exit_status(run(None if argv is None else args, namespace=namespace))


if __name__ == "__main__":
    sys.exit(main())
