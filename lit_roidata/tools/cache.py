"""``lit-roidata cache``: list, clean and verify the roidb caches (docs/cli.md).

``clean`` never removes a cache in use or being built (it is listed as kept); ``--all``
also removes leftovers of interrupted builds and the input fingerprint memo. ``verify``
exits with status 1 if any cache is damaged.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import time
from typing import Any, Optional, Sequence

from lit_roidata.roidb.cache import LAST_USED, MANIFEST, CacheError, default_cache_dir, in_use
from lit_roidata.roidb.cache import remove_cache, validate_cache, verify_checksums

__all__ = ["main", "list_caches", "clean_caches"]


def _size(path: str) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(dirpath, f))
    return total


def _mtime(path: str) -> Optional[float]:
    try:
        return os.path.getmtime(path)
    except OSError:
        return None


def _building(path: str) -> bool:
    """Whether a builder holds the lock of the cache at ``path``."""
    from filelock import FileLock, Timeout

    if not os.path.exists(path + ".lock"):
        return False
    lock = FileLock(path + ".lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        return True
    lock.release()
    return False


def list_caches(root: str) -> list[dict[str, Any]]:
    """One dict per ``roidb-*`` directory under ``root``: key, path, bytes, state (``ok``,
    ``in use``, ``damaged``), datasets, entries, mode, built, last_used."""
    out: list[dict[str, Any]] = []
    for name in sorted(os.listdir(root) if os.path.isdir(root) else ()):
        path = os.path.join(root, name)
        if not (name.startswith("roidb-") and os.path.isdir(path)):
            continue
        rec: dict[str, Any] = {"key": name[len("roidb-"):], "path": path, "bytes": _size(path)}
        try:
            m = validate_cache(path)
            rec.update(state="ok", datasets=[d["name"] for d in m.get("datasets", [])],
                       entries=int(m.get("report", {}).get("entries", {}).get("after_filter", 0)),
                       mode=m.get("options", {}).get("mode", "?"))
        except CacheError as exc:
            rec.update(state="damaged", error=str(exc), datasets=[], entries=0, mode="?")
        rec["built"] = _mtime(os.path.join(path, MANIFEST))
        used = _mtime(os.path.join(path, LAST_USED))
        rec["last_used"] = rec["built"] if used is None else used
        rec["state"] = "in use" if in_use(path) else rec["state"]
        out.append(rec)
    return out


def clean_caches(root: str, *, all_: bool = False, older_than_days: Optional[float] = None,
                 keys: Sequence[str] = (), dry_run: bool = False) -> tuple[list, list]:
    """Remove the chosen caches; returns ``(removed, kept)`` as ``(key, reason)`` lists.

    Raises:
        ValueError: no selection given (nothing is removed by default).
    """
    if not (all_ or older_than_days is not None or keys):
        raise ValueError("choose what to remove: --all, --older-than DAYS or --key KEY")
    now = time.time()
    removed, kept = [], []
    for rec in list_caches(root):
        chosen = all_ or any(rec["key"].startswith(k) for k in keys) or (
            older_than_days is not None and rec["last_used"] is not None
            and now - rec["last_used"] > older_than_days * 86400)
        if not chosen:
            continue
        busy = "in use" if rec["state"] == "in use" else _building(rec["path"]) and "being built"
        if busy:
            kept.append((rec["key"], busy))
            continue
        if not dry_run:
            remove_cache(rec["path"])
            with contextlib.suppress(OSError):
                os.unlink(rec["path"] + ".lock")
        removed.append((rec["key"], f"{rec['bytes'] / 2**20:.1f} MiB"))
    if all_ and not dry_run and os.path.isdir(root):
        for name in os.listdir(root):  # leftovers of interrupted builds, fingerprint memo
            p = os.path.join(root, name)
            if name == ".fingerprints" or (name.startswith((".tmp-", ".trash-"))
                                           and now - os.path.getmtime(p) > 3600):
                shutil.rmtree(p, ignore_errors=True)
    return removed, kept


def _when(t: Optional[float]) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M", time.localtime(t))


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``lit-roidata cache``; returns the exit status."""
    p = argparse.ArgumentParser(prog="lit-roidata cache",
                                description="list, clean and verify the roidb caches")
    p.add_argument("--cache-dir", default=None,
                   help="cache root (default $LIT_ROIDATA_CACHE or ~/.cache/lit_roidata)")
    sub = p.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("ls", help="list caches: size, datasets, entries, last used, state")
    ls.add_argument("--json", action="store_true", help="print JSON instead of a table")
    cl = sub.add_parser("clean", help="remove caches (never one in use)")
    cl.add_argument("--all", action="store_true", dest="all_", help="every cache")
    cl.add_argument("--older-than", type=float, default=None, metavar="DAYS",
                    help="caches not used for DAYS days")
    cl.add_argument("--key", action="append", default=[], help="a cache key (or prefix)")
    cl.add_argument("--dry-run", action="store_true", help="only show what would go")
    ve = sub.add_parser("verify", help="checksum every array of every cache")
    ve.add_argument("--key", action="append", default=[], help="only these keys (prefixes)")
    args = p.parse_args(list(argv) if argv is not None else None)
    root = os.path.abspath(args.cache_dir or default_cache_dir())
    from rich.console import Console
    from rich.table import Table

    con = Console()
    if args.cmd == "verify":
        bad = 0
        for r in list_caches(root):
            if args.key and not any(r["key"].startswith(k) for k in args.key):
                continue
            try:
                verify_checksums(r["path"])
                con.print(f"ok      roidb-{r['key']}")
            except CacheError as exc:
                bad += 1
                con.print(f"DAMAGED roidb-{r['key']}: {exc}", markup=False, highlight=False)
        if bad:
            con.print(f"{bad} damaged cache(s): remove them (lit-roidata cache clean --key KEY) or "
                      f"let the next run rebuild them")
        return 1 if bad else 0
    if args.cmd == "ls" and args.json:
        print(json.dumps(list_caches(root), indent=1))
    elif args.cmd == "ls":
        recs, t = list_caches(root), Table(title=f"roidb caches in {root}")
        for col in ("key", "MiB", "datasets", "mode", "entries", "built", "last used", "state"):
            t.add_column(col, justify="right" if col in ("MiB", "entries") else "left",
                         no_wrap=col in ("key", "state"))
        for r in recs:  # a key prefix is enough for `clean --key` / `verify --key`
            t.add_row(r["key"][:12], f"{r['bytes'] / 2**20:.1f}", ", ".join(r["datasets"]) or "-",
                      r["mode"], str(r["entries"]), _when(r["built"]), _when(r["last_used"]),
                      r["state"])
        con.print(t)
        con.print(f"{len(recs)} cache(s), {sum(r['bytes'] for r in recs) / 2**20:.1f} MiB")
    else:  # clean
        try:
            removed, kept = clean_caches(root, all_=args.all_, older_than_days=args.older_than,
                                         keys=args.key, dry_run=args.dry_run)
        except ValueError as exc:
            p.error(str(exc))
        verb = "would remove" if args.dry_run else "removed"
        for key, size in removed:
            con.print(f"{verb} roidb-{key} ({size})")
        for key, why in kept:
            con.print(f"kept roidb-{key} ({why})")
        con.print(f"{verb} {len(removed)} cache(s), kept {len(kept)}")
    return 0
