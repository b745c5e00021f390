"""lit_roidata.lightning: the same classes bound to ``lightning.pytorch``.

The bindings are made, not copied (lit_roidata._lightning.bind): these tests check that a
bound class is a real class of its namespace with the same code, arguments and
documentation, that shared code never reaches into the other namespace, and that a whole
``import lightning as L`` run (data module, model, every callback, validate, resume)
works.
"""

from __future__ import annotations

import functools
import inspect
import pickle
import types
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
from pytorch_lightning.utilities import rank_zero_only

from lit_roidata import DemoRoIDataModule, RoIDataModule
from lit_roidata._lightning import (LIGHTNING, PL, _functions, _ns_of_module, bind,
                                    isinstance_any, namespace_of, source_class,
                                    unbound_super_calls)

from conftest import LIGHTNING_NAMESPACES
from datamodule_support import TINY_MODEL, dm_kwargs, shared_root
from package_support import package_classes

L = pytest.importorskip("lightning")
import lit_roidata.lightning as lit_l  # noqa: E402  (needs `lightning`)


@pytest.fixture(scope="module")
def root(tmp_path_factory: Any) -> Path:
    return shared_root(tmp_path_factory)


def foreign_references(cls: type) -> list[str]:
    """Names of the other Lightning namespace that the code of ``cls`` (its own methods,
    what decorators wrap, and the lit_roidata functions they call, transitively) uses
    directly. Shared code must look Lightning classes up through ``lightning_attr``,
    never import them."""
    namespace = namespace_of(cls)
    found: list[str] = []
    seen: set[int] = set()

    def foreign(name: str) -> bool:
        ns = _ns_of_module(name)
        return ns is not None and ns != namespace

    def walk_code(code: types.CodeType, glb: dict[str, Any], where: str) -> None:
        for name in code.co_names:
            if foreign(name):
                found.append(f"{where}: imports {name}")
            value = glb.get(name)
            if isinstance(value, types.ModuleType) and foreign(value.__name__):
                found.append(f"{where}: uses module {value.__name__} as {name!r}")
            elif isinstance(value, type) and foreign(value.__module__):
                found.append(f"{where}: uses {value.__module__}.{value.__qualname__}")
            elif isinstance(value, types.FunctionType):
                walk_function(value)
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                walk_code(const, glb, where)

    def walk_function(f: types.FunctionType) -> None:
        if id(f) not in seen and f.__module__.split(".")[0] == "lit_roidata":
            seen.add(id(f))
            walk_code(f.__code__, f.__globals__, f"{f.__module__}.{f.__qualname__}")

    for k in cls.__mro__:
        if source_class(k).__module__.split(".")[0] == "lit_roidata":
            for value in vars(k).values():
                for f in _functions(value):
                    walk_function(f)
    return found


def test_every_lightning_class_of_the_package_has_a_binding() -> None:
    """A new Lightning-derived class in lit_roidata must be listed in
    lit_roidata.lightning.CLASSES (else ``import lightning as L`` users cannot name it)."""
    found = {name: f"{module}:{name}"
             for name, module in package_classes(lambda cls: namespace_of(cls) == PL).items()}
    assert found and found == {k: lit_l.CLASSES[k] for k in found}, (
        "add these to lit_roidata.lightning.CLASSES: "
        f"{ {k: v for k, v in found.items() if lit_l.CLASSES.get(k) != v} }")
    assert set(found) == set(lit_l.CLASSES)


@pytest.mark.parametrize("name", sorted(lit_l.CLASSES))
def test_every_binding_is_the_same_class_in_lightning_pytorch(name: str) -> None:
    bound = getattr(lit_l, name)
    src = lit_l._source(name)
    assert namespace_of(src) == PL and namespace_of(bound) == LIGHTNING
    assert source_class(bound) is src and bind(src, LIGHTNING) is bound
    assert bind(bound, PL) is src and bind(bound, LIGHTNING) is bound
    assert bound.__module__ == "lit_roidata.lightning" and bound.__name__ == src.__name__
    assert bound.__doc__ == src.__doc__
    assert (list(inspect.signature(bound.__init__).parameters)
            == list(inspect.signature(src.__init__).parameters))
    if "__init__" in vars(src):  # ours: the very same signature (LightningCLI reads it)
        assert inspect.signature(bound.__init__) == inspect.signature(src.__init__)
    # Not a copy: the same code objects, in a class of the other namespace.
    for key, value in vars(src).items():
        if inspect.isfunction(value):
            assert vars(bound)[key].__code__ is value.__code__, key
    assert not any(namespace_of(k) == PL and k.__module__.startswith("pytorch_lightning")
                   for k in bound.__mro__), bound.__mro__
    # Importable by its class path (LightningCLI, pickle, checkpoints' hyper-parameters).
    assert pickle.loads(pickle.dumps(bound)) is bound
    # Shared code looks Lightning classes up in the namespace of what it works on.
    assert foreign_references(bound) == []
    assert foreign_references(src) == []


def test_super_and_save_hyperparameters_run_in_the_bound_class() -> None:
    """Zero-argument super() of the bound methods reaches lightning.pytorch's bases, and
    save_hyperparameters (which reads the __class__ of __init__'s frame) records them."""
    dm = lit_l.DemoRoIDataModule(**dm_kwargs(Path("/nonexistent"), seed=7))
    assert isinstance(dm, L.LightningDataModule) and dm.hparams.sampling["seed"] == 7
    assert dict(dm.hparams) == dict(DemoRoIDataModule(**dm_kwargs(Path("/nonexistent"),
                                                                   seed=7)).hparams)
    model = lit_l.DemoFasterRCNN(**TINY_MODEL)  # a subclass: both levels bound
    assert isinstance(model, L.LightningModule) and isinstance(model, lit_l.DemoFastRCNN)
    assert model.hparams.num_classes == TINY_MODEL["num_classes"]
    assert isinstance_any(model, RoIDataModule) is False
    assert isinstance_any(dm, RoIDataModule) and isinstance_any(RoIDataModule(), lit_l.RoIDataModule)


@pytest.mark.parametrize("name", sorted(lit_l.CLASSES))
def test_zero_argument_super_of_every_bound_method_is_rebound(name: str) -> None:
    """No method of a binding (nor of its bound bases) keeps a super() that starts from
    the pytorch_lightning class: such a call fails only when it runs."""
    bound = getattr(lit_l, name)
    for k in bound.__mro__:
        if k.__module__ == "lit_roidata.lightning":
            assert unbound_super_calls(k) == []
    # The check has teeth: the same class with the methods as written (cells unrewritten)
    # is reported wherever the source calls super().
    src = lit_l._source(name)
    body = {k: v for k, v in vars(src).items() if k not in ("__dict__", "__weakref__")}
    naive = types.new_class(src.__name__, bound.__bases__, exec_body=lambda ns: ns.update(body))
    setattr(naive, "__lit_roidata_source__", src)
    if any("__class__" in f.__code__.co_freevars for f in body.values() if inspect.isfunction(f)):
        assert unbound_super_calls(naive)


def _super_chain(fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)
    return wrapper


class _SuperThroughWrappers(pl.Callback):
    """Methods wrapped by ``functools.wraps`` decorators (``@rank_zero_only``) that call
    super(): the wrapper's closure holds the function whose cell bind must rebind."""

    @rank_zero_only
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "rank zero": True}

    @_super_chain
    @rank_zero_only
    def twice(self) -> dict[str, Any]:
        return {**super().state_dict(), "twice": True}

    @property
    def state_key(self) -> str:
        return "synthetic " + super().state_key

    @classmethod
    def start(cls) -> type:
        return super().__thisclass__  # type: ignore[attr-defined]  # where super() starts


@pytest.mark.parametrize("namespace", LIGHTNING_NAMESPACES)
def test_super_through_functools_wraps_decorators(namespace: str) -> None:
    rank_zero_only.rank = getattr(rank_zero_only, "rank", 0)
    cls = bind(_SuperThroughWrappers, namespace)
    obj = cls()
    assert namespace_of(obj) == namespace
    assert obj.state_dict() == {"rank zero": True} and obj.twice() == {"twice": True}
    assert obj.state_key == "synthetic _SuperThroughWrappers" and cls.start() is cls
    assert unbound_super_calls(cls) == []
    # The wrappers are made again, not shared: the source class keeps its own cells.
    assert obj.state_dict.__wrapped__.__code__ is _SuperThroughWrappers.state_dict.__wrapped__.__code__
    assert _SuperThroughWrappers().state_dict() == {"rank zero": True}
    assert _SuperThroughWrappers.start() is _SuperThroughWrappers


def test_bind_refuses_super_it_cannot_rebind() -> None:
    """What holds a super() call bind cannot rewrite fails at bind time, naming it."""

    class Cached(pl.Callback):
        @functools.cached_property
        def cached(self) -> dict[str, Any]:
            return super().state_dict()

    class Partial(pl.Callback):
        def _save(self, extra: str) -> dict[str, Any]:
            return {**super().state_dict(), extra: True}

        save = functools.partialmethod(_save, "extra")

    class Memo(pl.Callback):
        @functools.lru_cache(maxsize=None)
        def memo(self) -> dict[str, Any]:
            return super().state_dict()

    for cls, attr in ((Cached, "cached"), (Partial, "save"), (Memo, "memo")):
        with pytest.raises(TypeError, match=rf"cannot bind .*{cls.__name__}.{attr} .*super\(\)"):
            bind(cls, LIGHTNING)


def test_subclassing_and_binding_errors() -> None:
    import pytorch_lightning as pl

    class Mine(RoIDataModule):
        pass

    with pytest.raises(TypeError, match="derive your class from the lightning.pytorch binding"):
        bind(type("Sub", (Mine,), {"__module__": "user_code"}), LIGHTNING)
    with pytest.raises(TypeError, match="does not derive from a Lightning class"):
        bind(dict, LIGHTNING)
    with pytest.raises(ValueError, match="unknown Lightning namespace"):
        bind(RoIDataModule, "lightning")
    assert bind(pl.Callback, PL) is pl.Callback

    class MyData(lit_l.DemoRoIDataModule):  # users subclass the binding of their namespace
        def __init__(self, **kw: Any) -> None:
            super().__init__(**kw)
            self.mine = True

    dm = MyData(**dm_kwargs(Path("/nonexistent")))
    assert dm.mine and isinstance(dm, L.LightningDataModule) and dm.hparams.loader["num_workers"] == 0


class _Seen:
    def __init__(self) -> None:
        self.callbacks: list[Any] = []

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.callbacks = list(trainer.callbacks)


def test_fit_validate_resume_with_every_callback(root: Path, tmp_path: Path,
                                                 lightning_ns: Any) -> None:
    """A run in each namespace with its bindings: the data module (skip policy, with the
    BadImageReport and GracefulStop of the trainer's namespace), the demo model,
    COCOEvaluator, the step progress bar, ModelCheckpoint; then validate; then resume from
    last.ckpt."""
    from lit_roidata.demo import DemoFastRCNN
    from lit_roidata.evaluation import COCOEvaluator
    from lit_roidata.loader_callbacks import BadImageReport, GracefulStop
    from lit_roidata.progress import StepTQDMProgressBar

    ns = lightning_ns
    seen = ns.callback(_Seen)()

    def trainer(steps: int) -> Any:
        return ns.Trainer(
            accelerator="cpu", max_steps=steps, max_epochs=-1, logger=False,
            enable_model_summary=False, default_root_dir=str(tmp_path),
            limit_val_batches=3, val_check_interval=3, check_val_every_n_epoch=None,
            num_sanity_val_steps=0,
            callbacks=[ns.lit(COCOEvaluator)(), ns.lit(StepTQDMProgressBar)(), seen,
                       ns.lit(BadImageReport)(), ns.lit(GracefulStop)(),
                       ns.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ck"),
                                                    save_last=True)])

    kw = dm_kwargs(root, on_bad_image="skip", infinite=True)
    first = trainer(3)
    first.fit(ns.lit(DemoFastRCNN)(**TINY_MODEL), datamodule=ns.lit(DemoRoIDataModule)(**kw))
    assert first.global_step == 3 and "val/bbox_AP" in first.callback_metrics
    reports = [c for c in seen.callbacks if isinstance_any(c, BadImageReport)]
    assert len(reports) == 1 and namespace_of(reports[0]) == ns.name, seen.callbacks
    assert all(namespace_of(c) == ns.name for c in seen.callbacks)
    metrics = first.validate(datamodule=ns.lit(DemoRoIDataModule)(**kw), ckpt_path="last",
                             verbose=False)
    assert "val/bbox_AP" in metrics[0]
    resumed = trainer(6)
    resumed.fit(ns.lit(DemoFastRCNN)(**TINY_MODEL), datamodule=ns.lit(DemoRoIDataModule)(**kw),
                ckpt_path=str(tmp_path / "ck" / "last.ckpt"))
    assert resumed.global_step == 6
    dm = resumed.datamodule
    assert dm.hparams.sources["on_bad_image"] == "skip"
