"""Generate ``docs/api.md`` from the public API's signatures and docstrings.

``python -m lit_roidata.tools.api_docs`` rewrites ``docs/api.md``;
``python -m lit_roidata.tools.api_docs --check`` exits with status 1 if the file is out of
date (``tests/test_api_docs.py`` runs the same comparison). For every public module below
the page lists each public class and function with its signature and the first paragraph
of its docstring, and each class's public methods with the first line of theirs.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

__all__ = ["MODULES", "render", "main"]

# The public names listed of some modules (others: the module's ``__all__``).
_NAMES: dict[str, Optional[list[str]]] = {
    "datamodule": ["RoIDataModule"],
    "options": ["DatasetOptions", "SourceOptions", "LoaderOptions", "OutputOptions",
                "SamplingOptions", "AugmentOptions", "as_options"],
    "lightning": ["cli_main", "main"], "callbacks": [],
    "minibatch.model_type": ["flags_for_model_type", "blob_family"],
    "tools.dump_blobs": ["dump_blobs"], "tools.bench": ["bench_loader"]}
#: Modules documented, in page order, with their public names (``None``: the module's
#: ``__all__``). Only classes and functions are listed.
MODULES: list[tuple[str, Optional[list[str]]]] = [
    (f"lit_roidata.{m}", _NAMES.get(m)) for m in (
        "datamodule options cli resume lightning config catalog roidb roidb.proposal_files "
        "roidb.repeat_factors sampler loader dataset minibatch minibatch.device "
        "minibatch.model_type skip progress evaluation lvis_evaluation callbacks broadcast "
        "weights exchange demo tools.dump_blobs tools.bench").split()]

_HEADER = """# API reference

Generated from the docstrings by `python -m lit_roidata.tools.api_docs` (do not edit by
hand; `tests/test_api_docs.py` fails when this page is out of date). Public names of each
part with the first paragraph of their docstrings; the pages linked from
[index.md](index.md) explain how they fit together.
"""

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _first_paragraph(obj: Any) -> str:
    return (inspect.getdoc(obj) or "").strip().split("\n\n")[0].strip()


def _paragraph_lines(obj: Any) -> list[str]:
    para = _first_paragraph(obj)
    return [para, ""] if para else []


class _Elided:
    def __repr__(self) -> str:
        return "..."


def _inherited_init(cls: type) -> Optional[type]:
    """The third-party class whose Python ``__init__`` ``cls`` inherits, if any."""
    for base in cls.__mro__:
        if (init := vars(base).get("__init__")) is not None:
            inherited = inspect.isfunction(init) and not base.__module__.startswith("lit_roidata")
            return base if inherited else None
    return None


def _signature(obj: Any) -> str:
    """``inspect.signature`` text; long default values (third-party objects) shown as ``...``.

    A class that inherits a third-party ``__init__`` shows ``(...)``: the arguments (and
    their defaults) are the other library's and change with its installed version.
    """
    if inspect.isclass(obj) and _inherited_init(obj) is not None:
        return "(...)"
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return "(...)"
    params = [p.replace(default=_Elided())
              if p.default is not p.empty and len(repr(p.default)) > 40 else p
              for p in sig.parameters.values()]
    return _ADDRESS.sub("", str(sig.replace(parameters=params)))


def _entry(name: str, obj: Any) -> list[str]:
    kind = "class" if inspect.isclass(obj) else "def"
    lines = [f"### `{kind} {name}{_signature(obj)}`", "", *_paragraph_lines(obj)]
    if inspect.isclass(obj) and (base := _inherited_init(obj)) is not None:
        lines += [f"Takes the arguments of `{base.__module__}.{base.__qualname__}`.", ""]
    if inspect.isclass(obj):
        members = ((n, getattr(m, "__func__", m)) for n, m in sorted(vars(obj).items()))
        for mname, meth in members:  # __func__: staticmethod / classmethod
            if mname.startswith("_") or not inspect.isfunction(meth):
                continue
            first = _first_paragraph(meth).split("\n")[0]
            lines.append(f"- `{mname}{_signature(meth)}`" + (f": {first}" if first else ""))
        if lines[-1] != "":
            lines.append("")
    return lines


def render() -> str:
    """The text of ``docs/api.md`` for the code as it is now."""
    lines = [_HEADER]
    for modname, names in MODULES:
        mod = importlib.import_module(modname)
        names = list(names if names is not None else getattr(mod, "__all__", []))
        lines += [f"## `{modname}`", "", *_paragraph_lines(mod)]
        for name in names:
            obj = getattr(mod, name)
            if inspect.isclass(obj) or inspect.isfunction(obj):
                lines += _entry(name, obj)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Write (or with ``--check`` compare) ``docs/api.md``; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m lit_roidata.tools.api_docs",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[2] / "docs"
                                             / "api.md"), help="the page to write")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if the page differs from the generated text")
    args = parser.parse_args(argv)
    text, out = render(), Path(args.out)
    if not args.check:
        out.write_text(text, encoding="utf-8")
    elif not out.is_file() or out.read_text(encoding="utf-8") != text:
        print(f"{out} is out of date; run python -m lit_roidata.tools.api_docs", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
