"""The subcommands of ``lit-roidata`` and their help texts (no torch, no Lightning).

Shared by :mod:`lit_roidata.cli` (dispatch, ``--help``) and :mod:`lit_roidata.trainer_cli`
(the training subcommands' epilog), so neither imports the other for them.
"""

from __future__ import annotations

__all__ = ["TRAINING", "TOOLS", "EXIT_STATUS", "tools_help"]

#: Training subcommand -> one line of help (LightningCLI's; ``SUBCOMMAND --help`` has more).
TRAINING: dict[str, str] = {
    "fit": "train (and validate) the model; re-running it resumes an interrupted run",
    "validate": "one evaluation pass over the validation set (COCO AP)",
    "test": "one evaluation pass over the test set",
    "predict": "run the model on the test images; writes COCO results json",
}

_TOOL_HELP = {
    "inspect": "roidb statistics table, minibatch pictures and histograms (PNG)",
    "dump-blobs": "Detectron's blob dump: identity order, one image per batch, .npz files",
    "bench": "train loader images/s and per-batch latency percentiles on your data",
    "make-demo-data": "generate the synthetic demo datasets (shapes, proposals, keypoints)",
    "convert-proposals": "proposal pickle -> columnar .npz (loads without unpickling)",
    "cache": "roidb caches: ls (sizes, datasets, last used), clean, verify (checksums)",
}
#: Tool subcommand → (``"module:function"`` taking ``argv`` → exit code, one line of help);
#: ``x-y`` runs ``lit_roidata.tools.x_y:main``.
TOOLS: dict[str, tuple[str, str]] = {
    name: (f"lit_roidata.tools.{name.replace('-', '_')}:main", help_)
    for name, help_ in _TOOL_HELP.items()}

#: Printed by ``--help`` and after each training subcommand's ``--help``.
EXIT_STATUS = """exit status:
  0       done
  1       an error, or a run aborted by a second Ctrl-C
  2       bad arguments
  128+N   `fit` stopped gracefully on signal N (130: Ctrl-C, 143: SIGTERM) after writing
          its interrupted-run checkpoint; the same command resumes it
"""


def tools_help() -> str:
    """The data tools with their one-line help (also the training subcommands' epilog)."""
    return "\n".join(["data tools (run `lit-roidata TOOL --help`):",
                      *(f"  {name:<18} {help_}" for name, help_ in _TOOL_HELP.items())]) + "\n"
