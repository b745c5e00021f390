"""One implementation, two Lightning namespaces.

lit_roidata's classes are written against ``pytorch_lightning``; :func:`bind` makes the
same class, with the same method code, on ``lightning.pytorch``'s bases. Each method's
zero-argument ``super()`` cell is rebound (plain methods, ``staticmethod`` /
``classmethod`` / ``property``, ``functools.wraps`` decorators); anything else holding one
makes :func:`bind` raise ``TypeError`` (:func:`unbound_super_calls`).
"""

from __future__ import annotations

import builtins
import functools
import gc
import importlib.util
import threading
import types
from typing import Any, Iterator, Optional, TypeVar

from lit_roidata._optional import require

__all__ = ["PL", "LIGHTNING", "NAMESPACES", "bind", "namespace_of", "lightning_attr",
           "import_namespace", "available", "isinstance_any", "source_class", "unbound_super_calls",
           "bound_classes"]

#: The two namespaces, by the module name of their ``Trainer``'s package.
PL = "pytorch_lightning"
LIGHTNING = "lightning.pytorch"
NAMESPACES = (PL, LIGHTNING)

# Module-name prefixes of each namespace (the trainer package and its fabric package).
_PREFIXES = {PL: ("pytorch_lightning", "lightning_fabric"),
             LIGHTNING: ("lightning.pytorch", "lightning.fabric")}
_BOUND_MODULE = {LIGHTNING: "lit_roidata.lightning"}
_SOURCE_ATTR = "__lit_roidata_source__"
_cache: dict[tuple[type, str], type] = {}
_lock = threading.RLock()

T = TypeVar("T", bound=type)


def bound_classes(namespace: str) -> list[type]:
    """The classes :func:`bind` has made for ``namespace`` so far."""
    with _lock:
        return [cls for (_, ns), cls in _cache.items() if ns == namespace]


def _ns_of_module(module: str) -> Optional[str]:
    return next((ns for ns, prefixes in _PREFIXES.items()
                 if any(module == p or module.startswith(p + ".") for p in prefixes)), None)


def namespace_of(obj: Any) -> Optional[str]:
    """:data:`PL` or :data:`LIGHTNING`: the namespace whose classes ``obj`` (a class or an
    instance, e.g. a Trainer or a callback) derives from; ``None`` if neither."""
    cls = obj if isinstance(obj, type) else type(obj)
    found = (_ns_of_module(getattr(k, "__module__", "") or "") for k in cls.__mro__)
    return next((ns for ns in found if ns is not None), None)


def import_namespace(namespace: str) -> types.ModuleType:
    """The module ``pytorch_lightning`` or ``lightning.pytorch``; the second needs the
    ``lightning`` package (the ``[lightning]`` extra), with an error that says so."""
    if namespace == PL:
        return importlib.import_module(PL)
    if namespace == LIGHTNING:
        return require(LIGHTNING, "lightning",
                       "the `lightning` namespace (lit_roidata.lightning, `import lightning as L`)")
    raise ValueError(f"unknown Lightning namespace {namespace!r}; use one of {NAMESPACES}")


def available(namespace: str) -> bool:
    """Whether ``namespace``'s package is installed (without importing it)."""
    try:
        return importlib.util.find_spec(namespace.split(".")[0]) is not None
    except ImportError:  # an import hook that hides the package
        return False


def lightning_attr(namespace_or_obj: Any, dotted: str) -> Any:
    """``<namespace>.<dotted>``, e.g. ``lightning_attr(trainer, "callbacks.ModelCheckpoint")``
    is the ``ModelCheckpoint`` class of the namespace ``trainer`` comes from (a namespace
    name or an object of either namespace; objects of neither mean ``pytorch_lightning``)."""
    ns = (namespace_or_obj if isinstance(namespace_or_obj, str)
          else namespace_of(namespace_or_obj) or PL)
    module_path, _, name = ("." + dotted).rpartition(".")
    root = import_namespace(ns)
    return getattr(importlib.import_module(ns + module_path) if module_path else root, name)


def source_class(cls: type) -> type:
    """The class as written (the ``pytorch_lightning`` one) for a bound class; ``cls``
    itself otherwise."""
    return cls.__dict__.get(_SOURCE_ATTR, cls)


def isinstance_any(obj: Any, cls: type) -> bool:
    """``isinstance(obj, cls)`` in either namespace: true also for the other binding of
    ``cls`` (and its subclasses)."""
    src = source_class(cls)
    return any(source_class(k) is src for k in type(obj).__mro__)


def _translate(base: type, namespace: str) -> type:
    """The class of ``namespace`` with the same module path and name as Lightning's
    ``base`` (e.g. ``pytorch_lightning.callbacks.progress.rich_progress.RichProgressBar``
    -> ``lightning.pytorch.callbacks.progress.rich_progress.RichProgressBar``)."""
    mod = base.__module__
    for old, new in zip(_PREFIXES[_ns_of_module(mod) or PL], _PREFIXES[namespace]):
        if mod == old or mod.startswith(old + "."):
            import_namespace(namespace)
            module = importlib.import_module(new + mod[len(old):])
            return functools.reduce(getattr, base.__qualname__.split("."), module)
    raise AssertionError(base)  # pragma: no cover - _ns_of_module matched a prefix


def _rebind(value: Any, old: type, new: type, memo: dict[int, Any]) -> Any:
    """``value`` (a class attribute) with every function whose ``__class__`` cell holds
    ``old`` (zero-argument ``super()``) made again with that cell holding ``new``; the
    same object when nothing in it changes. Reaches functions, the functions their
    closures and ``__dict__`` hold (``functools.wraps`` decorators: the wrapped function and
    ``__wrapped__``), staticmethod, classmethod and property."""
    if id(value) in memo:
        return memo[id(value)]
    memo[id(value)] = value  # a closure that reaches itself stays as it is
    out = value
    if isinstance(value, types.FunctionType):
        cells = []
        for name, cell in zip(value.__code__.co_freevars, value.__closure__ or ()):
            try:
                content = cell.cell_contents
            except ValueError:  # an empty cell
                cells.append(cell)
                continue
            content_new = (new if name == "__class__" and content is old
                           else _rebind(content, old, new, memo))
            cells.append(cell if content_new is content else types.CellType(content_new))
        extra = {k: _rebind(v, old, new, memo) for k, v in value.__dict__.items()}
        if any(a is not b for a, b in zip(cells, value.__closure__ or ())) or any(
                extra[k] is not v for k, v in value.__dict__.items()):
            out = types.FunctionType(value.__code__, value.__globals__, value.__name__,
                                     value.__defaults__, tuple(cells))
            kw = value.__kwdefaults__
            out.__kwdefaults__ = None if kw is None else dict(kw)
            out.__dict__.update(extra)
            for attr in ("__qualname__", "__doc__", "__module__", "__annotations__"):
                setattr(out, attr, getattr(value, attr))
    elif isinstance(value, (staticmethod, classmethod)):
        if (func := _rebind(value.__func__, old, new, memo)) is not value.__func__:
            out = type(value)(func)
    elif isinstance(value, property):
        funcs = [_rebind(f, old, new, memo) for f in (value.fget, value.fset, value.fdel)]
        if any(a is not b for a, b in zip(funcs, (value.fget, value.fset, value.fdel))):
            out = type(value)(*funcs, value.__doc__)
    memo[id(value)] = out
    return out


def _functions(value: Any) -> Iterator[types.FunctionType]:
    """Every function reachable from ``value`` through any object (closures, descriptors,
    wrappers, their attributes), but not through a module, a class or a module's
    globals."""
    seen: set[int] = set()
    stack = [value]
    while stack:
        obj = stack.pop()
        if (id(obj) in seen or isinstance(obj, (type, types.ModuleType, types.CodeType))
                or obj is vars(builtins)):
            continue
        seen.add(id(obj))
        if isinstance(obj, types.FunctionType):
            yield obj
            stack.extend([obj.__closure__, obj.__defaults__, obj.__kwdefaults__, obj.__dict__])
        elif not (isinstance(obj, dict) and "__builtins__" in obj):  # not a module's globals
            stack.extend(gc.get_referents(obj))


def unbound_super_calls(cls: type) -> list[str]:
    """The functions in ``cls``'s own attributes whose zero-argument ``super()`` starts
    from a class that ``cls`` does not derive from, although :func:`source_class` does
    (a binding whose ``super()`` fails when called); empty when there are none."""
    src = source_class(cls)
    found = []
    for name, value in vars(cls).items():
        for f in _functions(value):
            cells = dict(zip(f.__code__.co_freevars, f.__closure__ or ()))
            try:
                owner = cells["__class__"].cell_contents
            except (KeyError, ValueError):
                continue
            if isinstance(owner, type) and issubclass(src, owner) and not issubclass(cls, owner):
                found.append(f"{cls.__qualname__}.{name} ({type(value).__name__}): super() in "
                             f"{f.__qualname__} starts from "
                             f"{owner.__module__}.{owner.__qualname__}")
    return found


def _bind_base(base: type, namespace: str) -> type:
    ns = namespace_of(base)
    if ns is None or ns == namespace:
        return base
    if _ns_of_module(base.__module__) is not None:
        return _translate(base, namespace)
    if source_class(base).__module__.split(".")[0] == "lit_roidata":
        return bind(base, namespace)
    raise TypeError(f"cannot bind {base.__module__}.{base.__qualname__} to {namespace}: it "
                    "is not a lit_roidata class; derive your class from the "
                    f"{namespace} binding of the lit_roidata class instead")


def bind(cls: T, namespace: str) -> T:
    """``cls`` (a lit_roidata class derived from Lightning classes) for ``namespace``.

    Returns ``cls`` when it already is of that namespace, the class as written when asked
    for ``pytorch_lightning``, and otherwise (once per class; the same object on every
    call) a class with the same name, code, docstring and ``__init__`` signature whose
    Lightning bases (and lit_roidata bases, recursively) are those of ``namespace``.
    Bound classes live in :mod:`lit_roidata.lightning`, so class paths (LightningCLI),
    pickling and checkpoints' hyper-parameters name them there.
    """
    if namespace not in NAMESPACES:
        raise ValueError(f"unknown Lightning namespace {namespace!r}; use one of {NAMESPACES}")
    src = source_class(cls)
    if namespace_of(src) is None:
        raise TypeError(f"{src.__qualname__} does not derive from a Lightning class")
    if namespace_of(src) == namespace:
        return src  # type: ignore[return-value]
    with _lock:
        key = (src, namespace)
        if key in _cache:
            return _cache[key]  # type: ignore[return-value]
        bases = tuple(_bind_base(b, namespace) for b in src.__bases__)
        body = {k: v for k, v in src.__dict__.items() if k not in ("__dict__", "__weakref__")}
        slots = body.get("__slots__", ())
        for name in ([slots] if isinstance(slots, str) else slots):
            body.pop(name, None)  # member descriptors are made again from __slots__
        new = types.new_class(src.__name__, bases, exec_body=lambda ns: ns.update(body))
        memo: dict[int, Any] = {}
        for k, v in list(new.__dict__.items()):
            if (rebound := _rebind(v, src, new, memo)) is not v:
                setattr(new, k, rebound)
        new.__module__, new.__qualname__ = _BOUND_MODULE[namespace], src.__qualname__
        setattr(new, _SOURCE_ATTR, src)
        if unbound := unbound_super_calls(new):
            raise TypeError(f"cannot bind {src.__module__}.{src.__qualname__} to {namespace}: "
                            + "; ".join(unbound) + ". bind rebinds plain functions, "
                            "staticmethod, classmethod, property and functools.wraps "
                            "decorators; write the method as one of those")
        _cache[key] = new
        return new  # type: ignore[return-value]
