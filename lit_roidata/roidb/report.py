"""Build report (what was kept and dropped, by reason) and rich progress/summary output."""

from __future__ import annotations

import io
import logging
import sys
from contextlib import contextmanager
from typing import Any, Iterator, Optional

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

__all__ = ["BuildProgress", "summary_text", "log_report"]

logger = logging.getLogger("lit_roidata.roidb")


class BuildProgress:
    """Rich progress bars, one per dataset / proposal file; a no-op when disabled.

    Args:
        enabled: show bars (default: only when stderr is a terminal).
    """

    def __init__(self, enabled: Optional[bool] = None) -> None:
        self._progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), console=Console(stderr=True), transient=False,
            disable=not (sys.stderr.isatty() if enabled is None else enabled))

    @contextmanager
    def task(self, description: str, total: int) -> Iterator[Any]:
        """A bar; the yielded callable advances it by ``n``."""
        tid = self._progress.add_task(description, total=max(int(total), 1))
        try:
            yield lambda n=1: self._progress.advance(tid, n)
        finally:
            self._progress.update(tid, completed=max(int(total), 1))

    def __enter__(self) -> "BuildProgress":
        self._progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._progress.stop()


def summary_text(report: dict, *, width: int = 120, top_classes: int = 20) -> str:
    """The summary table (per dataset) and class histogram, rendered as text."""
    buf = io.StringIO()
    console = Console(file=buf, width=width, force_terminal=False, color_system=None)
    t = Table(title="roidb build summary")
    for col in ("dataset", "images", "gt boxes", "crowd", "proposals", "dropped (by reason)",
                "segms"):
        t.add_column(col, justify="left" if col in ("dataset", "dropped (by reason)") else "right")
    def nonzero(counts: dict) -> str:
        return ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()) if v) or "-"

    for d in report.get("datasets", []):
        props = d.get("proposals", {})
        t.add_row(d["name"], *(str(d.get(k, 0)) for k in ("images", "gt_boxes", "gt_crowd")),
                  str(props.get("proposals_kept", "-")) if props else "-",
                  nonzero(d.get("dropped", {})), nonzero(d.get("segms", {})))
    console.print(t)
    if ent := report.get("entries", {}):
        drops = {k: v for k, v in ent.get("dropped", {}).items() if v}
        console.print(f"entries: {ent.get('before_filter', 0)} -> {ent.get('after_filter', 0)} "
                      f"after filter_for_training" + (f" (dropped {drops})" if drops else "")
                      if ent.get("filtered", True) else
                      f"entries: {ent.get('after_filter', 0)} (evaluation: no flip, no filter)")
    for d in report.get("datasets", []):
        if not (hist := d.get("class_histogram")):
            continue
        h = Table(title=f"{d['name']}: gt class histogram (non-crowd, final entries)",
                  title_justify="left")
        h.add_column("class")
        h.add_column("instances", justify="right")
        items = sorted(hist.items(), key=lambda kv: -kv[1])
        for name, n in items[:top_classes]:
            h.add_row(name, str(n))
        if len(items) > top_classes:
            h.add_row(f"... {len(items) - top_classes} more", str(sum(v for _, v in
                                                                    items[top_classes:])))
        h.add_row("total", str(sum(hist.values())))
        console.print(h)
    return buf.getvalue()


def log_report(report: dict) -> None:
    """Log the summary once (INFO); not rendered at all when INFO is not logged."""
    if logger.isEnabledFor(logging.INFO):
        logger.info("\n%s", summary_text(report))
