"""Which checkpoint ``lit-roidata fit`` resumes from, decided from files and public attributes
(docs/cli.md); checkpoints are read without torch and without running pickled code.
"""

from __future__ import annotations

import collections
import glob
import logging
import os
import pickle
import zipfile
from typing import Any, Optional

__all__ = ["ResumeChoiceError", "checkpoint_meta", "checkpoint_step", "is_interrupted_fit",
           "interrupted_checkpoints", "last_checkpoints", "choose_fit_checkpoint"]

log = logging.getLogger(__name__)

class ResumeChoiceError(ValueError):
    """``fit`` was not told which checkpoint to use where Lightning would pick one itself."""


class _Opaque:
    """Stands for any pickled object other than plain values (tensors, classes, ...)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __call__(self, *args: Any, **kwargs: Any) -> "_Opaque":
        return _Opaque(*args)

    def _ignore(self, *args: Any) -> None:
        """Unpickling's state and item restores: nothing is kept."""

    __setstate__ = __setitem__ = append = extend = _ignore


class _MetaUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        return _Opaque  # nothing the file names is imported or run

    def persistent_load(self, pid: Any) -> Any:
        return None  # tensor storages are not read


def checkpoint_meta(path: str) -> dict[str, Any]:
    """The top-level dict of the checkpoint file ``path`` (torch's zip format) with its plain
    values (``global_step``, ``epoch``, strings, nested dicts) and every other object as an
    opaque placeholder; ``{}`` when the file is missing or not a readable checkpoint."""
    try:
        with zipfile.ZipFile(path) as zf:
            name = next(n for n in zf.namelist() if n.endswith("/data.pkl") or n == "data.pkl")
            with zf.open(name) as fh:
                meta = _MetaUnpickler(fh).load()
    except (OSError, StopIteration, zipfile.BadZipFile, pickle.UnpicklingError, EOFError,
            ValueError, TypeError, AttributeError, IndexError, KeyError):
        return {}
    return meta if isinstance(meta, dict) else {}


def _plain(value: Any) -> Any:
    return value.args[0] if isinstance(value, _Opaque) and value.args else value


def checkpoint_step(path: str) -> Optional[int]:
    """The ``global_step`` saved in the checkpoint ``path``, or ``None`` if unreadable."""
    step = _plain(checkpoint_meta(path).get("global_step"))
    return int(step) if isinstance(step, int) else None


def is_interrupted_fit(path: str) -> bool:
    """Whether ``path`` was written by an interrupted ``fit``: a top-level entry (the data
    module's state) has ``trainer_fn == "fit"``. A file without that entry (another data
    module) counts as one: ``lit-roidata`` lets only ``fit`` write interrupted-run files
    (``validate``/``test``/``predict`` run without ``OnExceptionCheckpoint``)."""
    if not (meta := checkpoint_meta(path)):  # unreadable
        return False
    fns = [_plain(v["trainer_fn"]) for v in meta.values()
           if isinstance(v, dict) and "trainer_fn" in v]
    return not fns or any(str(getattr(f, "value", f)) == "fit" for f in fns)


def _callbacks(trainer: Any, dotted: str) -> list[Any]:
    """The trainer's callbacks of Lightning's class ``dotted``, or ``GracefulStop``'s."""
    from lit_roidata._lightning import isinstance_any, lightning_attr
    from lit_roidata.loader_callbacks import GracefulStop

    cls = GracefulStop if dotted == "GracefulStop" else lightning_attr(trainer, dotted)
    return [cb for cb in trainer.callbacks if isinstance_any(cb, cls)]


def interrupted_checkpoints(trainer: Any) -> list[str]:
    """Where an interrupted ``fit`` of ``trainer`` writes its checkpoint (existing or not):
    each ``OnExceptionCheckpoint.ckpt_path`` (a crash, a second Ctrl-C) and each
    GracefulStop's (``resolve_ckpt_path``: a first Ctrl-C or SIGTERM)."""
    on_exc = _callbacks(trainer, "callbacks.OnExceptionCheckpoint")
    paths = [os.fspath(cb.ckpt_path) for cb in on_exc]
    paths += [os.fspath(cb.resolve_ckpt_path(trainer))
              for cb in _callbacks(trainer, "GracefulStop")]
    return list(dict.fromkeys(paths))


def _last_dirs(trainer: Any, all_versions: bool) -> list[str]:
    """The folders of the ``ModelCheckpoint``s' ``last*.ckpt``: ``dirpath``, else the first
    logger's ``save_dir/name/version/checkpoints`` (Lightning's rule; ``all_versions``:
    every version folder), else ``<default_root_dir>/checkpoints``."""
    dirs: list[str] = []
    for cb in _callbacks(trainer, "callbacks.ModelCheckpoint"):
        if cb.dirpath is not None:
            dirs.append(os.fspath(cb.dirpath))
        elif trainer.loggers:
            lg = trainer.loggers[0]
            base = os.path.join(str(lg.save_dir or trainer.default_root_dir), str(lg.name))
            if all_versions:
                dirs += sorted(glob.glob(os.path.join(glob.escape(base), "*", "checkpoints")))
            else:
                v = lg.version
                dirs.append(os.path.join(base, v if isinstance(v, str) else f"version_{v}",
                                         "checkpoints"))
        else:
            dirs.append(os.path.join(str(trainer.default_root_dir), "checkpoints"))
    return list(dict.fromkeys(dirs))


def last_checkpoints(trainer: Any, all_versions: bool = False) -> list[str]:
    """The ``last*.ckpt`` files (``CHECKPOINT_NAME_LAST``, ``FILE_EXTENSION``) of every
    ``ModelCheckpoint`` of ``trainer``: those Lightning's ``"last"`` finds, or with
    ``all_versions`` also those of the earlier logger versions."""
    if not (cbs := _callbacks(trainer, "callbacks.ModelCheckpoint")):
        return []
    pattern = f"{cbs[0].CHECKPOINT_NAME_LAST}*{cbs[0].FILE_EXTENSION}"
    return sorted({p for d in _last_dirs(trainer, all_versions)
                   for p in glob.glob(os.path.join(glob.escape(d), pattern)) if os.path.isfile(p)})


def _step_text(path: str) -> str:
    return "?" if (step := checkpoint_step(path)) is None else str(step)


def _move_aside(path: str, why: str) -> None:
    if os.path.lexists(path):
        os.replace(path, path + ".stale")
        log.warning("not resuming from %s (%s): moved it to %s", path, why, path + ".stale")


def choose_fit_checkpoint(trainer: Any, ckpt_path: Optional[str]) -> Optional[str]:
    """The checkpoint ``fit`` resumes from (``None``: start fresh) for ``ckpt_path`` PATH,
    ``"fresh"``, ``"last"`` or ``None``, logged with its step (the rules: docs/cli.md).

    Raises:
        ResumeChoiceError: ``ckpt_path`` is ``None``, there is no interrupted run, and
            Lightning would still resume an earlier run's ``last*.ckpt``.
    """
    if ckpt_path not in (None, "last", "fresh"):
        log.warning("resuming from %s (global step %s)", ckpt_path, _step_text(str(ckpt_path)))
        return str(ckpt_path)
    interrupted = [p for p in interrupted_checkpoints(trainer) if os.path.isfile(p)]
    if ckpt_path == "fresh":
        for p in interrupted + last_checkpoints(trainer):
            _move_aside(p, "--ckpt_path fresh")
        log.warning("starting a fresh run (--ckpt_path fresh)")
        return None
    resumable = [p for p in interrupted if is_interrupted_fit(p)]
    for p in [p for p in interrupted if p not in resumable]:
        _move_aside(p, "it was not written by an interrupted `fit`")
    if ckpt_path == "last":
        found = resumable + last_checkpoints(trainer, all_versions=True)
        if not found:  # Lightning's own "last" looks in fewer places: it finds nothing either
            log.warning("--ckpt_path last: no checkpoint found (looked for %s and last*.ckpt "
                        "of the ModelCheckpoints in %s); training starts from scratch",
                        ", ".join(interrupted_checkpoints(trainer)) or "no interrupted run",
                        ", ".join(_last_dirs(trainer, False)) or "no ModelCheckpoint")
            return None
        path = max(found, key=os.path.getmtime)
        log.warning("resuming from %s (global step %s; --ckpt_path last)", path, _step_text(path))
        return path
    if resumable:
        path = max(resumable, key=os.path.getmtime)
        log.warning("resuming the interrupted run from %s at global step %s. To start fresh "
                    "instead, pass --ckpt_path fresh; to choose a checkpoint, --ckpt_path PATH",
                    path, _step_text(path))
        return path
    if _callbacks(trainer, "callbacks.OnExceptionCheckpoint"):
        if earlier := last_checkpoints(trainer):
            raise ResumeChoiceError(
                f"{earlier[0]} (global step {_step_text(earlier[0])}) is the last checkpoint of an "
                "earlier run, and with OnExceptionCheckpoint configured Lightning resumes from it "
                "when no checkpoint is given. Pass --ckpt_path last to continue that run, or "
                f"--ckpt_path fresh to start over (it is moved to {os.path.basename(earlier[0])}"
                ".stale), or give the ModelCheckpoint another dirpath (trainer.callbacks in the "
                "config)")
        log.info("no interrupted-run checkpoint at %s: starting fresh",
                 ", ".join(interrupted_checkpoints(trainer)))
    return None
