"""``filter_for_training`` over whole columns (Detectron semantics: filtering)."""

from __future__ import annotations

from collections import Counter

import numpy as np

__all__ = ["segment_any", "trainable_images", "filter_entries"]


def segment_any(flags: np.ndarray, off: np.ndarray) -> np.ndarray:
    """Per segment ``off[i]:off[i+1]``: is any flag set (empty segments give False)."""
    flags = np.asarray(flags, bool)
    off = np.asarray(off, np.int64)
    out = np.zeros(off.size - 1, bool)
    nonempty = np.flatnonzero(off[1:] > off[:-1])
    if nonempty.size:
        # a reduceat over the non-empty segments' starts (each runs to the next one's
        # start, which is its own end); no int64 prefix sum over the whole column
        lo = int(off[nonempty[0]])
        out[nonempty] = np.logical_or.reduceat(flags[lo:int(off[nonempty[-1] + 1])],
                                               off[nonempty] - lo)
    return out


def _candidate(mo: np.ndarray, fg_thresh: float, bg_hi: float, bg_lo: float) -> np.ndarray:
    return (mo >= fg_thresh) | ((mo < bg_hi) & (mo >= bg_lo))


def trainable_images(*, gt_off: np.ndarray, gt_is_crowd: np.ndarray, prop_off: np.ndarray,
                     prop_max_overlaps: np.ndarray, fg_thresh: float, bg_thresh_hi: float,
                     bg_thresh_lo: float) -> np.ndarray:
    """Per image: has at least one fg or bg candidate row (Detectron semantics: filtering)."""
    gt_mo = np.where(np.asarray(gt_is_crowd, bool), np.float32(-1), np.float32(1))
    ok = segment_any(_candidate(gt_mo, fg_thresh, bg_thresh_hi, bg_thresh_lo), gt_off)
    if prop_max_overlaps.size:
        mo = np.asarray(prop_max_overlaps)
        ok |= segment_any(_candidate(mo, fg_thresh, bg_thresh_hi, bg_thresh_lo), prop_off)
    return ok


def filter_entries(entry_img: np.ndarray, img_ok: np.ndarray, img_has_vis_kp: np.ndarray,
                   *, keypoints_on: bool) -> tuple[np.ndarray, Counter]:
    """Keep-mask over entries and the number dropped per reason.

    Returns:
        ``keep`` (bool per entry) and e.g. ``{"no_fg_or_bg_candidate": 12,
        "no_visible_keypoints": 3}`` (entries, flipped copies included).
    """
    ok = img_ok[entry_img]
    dropped = Counter(no_fg_or_bg_candidate=int((~ok).sum()))
    if keypoints_on:
        vis = img_has_vis_kp[entry_img]
        dropped["no_visible_keypoints"] = int((ok & ~vis).sum())
        ok = ok & vis
    return ok, dropped
