"""``RoIDataModule``: Detectron's training-data pipeline as a LightningDataModule.

This is the only place that knows the config's shape (docs/architecture.md, "Configuration"): it
turns its ``__init__`` arguments (grouped in :mod:`lit_roidata.options`, which
LightningCLI exposes as nested options such as ``--data.loader.num_workers``) into a
Detectron config, a dataset catalog, the cached combined roidb, Detectron's batch
sampler and the workers' dataset, and hands Lightning the stateful train loader.

Lifecycle (Lightning's contract, ``datamodule.rst``):

* ``prepare_data`` (once per node): register the datasets (the demo subclass generates
  its data here), build the roidb
  caches (train and evaluation). It sets no state; a shared filesystem cache is built
  once under the roidb builder's file lock.
* ``setup`` (every process): open the caches read-only (memory-mapped, milliseconds).
* ``train_dataloader``: :class:`~lit_roidata.sampler.RoIBatchSampler` over the roidb
  with this process's rank and world size (``TRAIN.IMS_PER_BATCH`` is per rank, as
  Detectron's per-GPU minibatch, Detectron semantics: multi-gpu and weights), workers building blobs
  (:class:`~lit_roidata.dataset.RoIBlockDataset`), wrapped in the checkpointable
  :class:`~lit_roidata.loader.StatefulRoIDataLoader`.
* ``val_dataloader`` / ``test_dataloader``: every evaluation image exactly once, in
  roidb order, unflipped, split across ranks without padding
  (:class:`~lit_roidata.loader.EvalLoader`).
* ``on_after_batch_transfer``: uint8 images become Detectron's float blob (BGR minus
  ``PIXEL_MEANS``) on the device, 4× less host→device traffic than float32
  (:func:`~lit_roidata.minibatch.device.finish_batch`).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Literal, Mapping, Optional

import pytorch_lightning as pl
import torch

from lit_roidata.config import DetectronConfig, load_detectron_cfg
from lit_roidata.loader import StatefulRoIDataLoader
from lit_roidata.minibatch.device import finish_batch
from lit_roidata.minibatch.model_type import MODEL_TYPES
from lit_roidata.options import (
    DEPRECATED_FLAT_ARGS,
    AugmentOptions,
    DatasetOptions,
    LoaderOptions,
    OutputOptions,
    SamplingOptions,
    SourceOptions,
    as_options,
    to_plain,
)

__all__ = ["RoIDataModule", "ModelType"]

log = logging.getLogger(__name__)

#: ``fast_rcnn``, ``faster_rcnn``, ``mask_rcnn``, ``keypoint_rcnn``, ``rpn_only``,
#: ``retinanet``, ``*_proposals`` and ``*_fpn`` variants (:mod:`.minibatch.model_type`).
ModelType = Literal[MODEL_TYPES]  # type: ignore[valid-type]


class RoIDataModule(pl.LightningDataModule):
    """Detectron's combined roidb, batch sampler and minibatch blobs for Lightning.

    This class is for ``pytorch_lightning``; ``lit_roidata.lightning.RoIDataModule`` is the
    same class for ``lightning.pytorch`` (``import lightning as L``).

    The config is assembled in this order, later entries winning: Detectron's
    defaults, the Detectron YAML file ``detectron_config``, the flags of
    ``model_type``, then ``overrides``, then the options below that name a Detectron
    key (``loader.ims_per_batch``, ``sampling.aspect_grouping``), when set. Dataset
    lists left empty fall back to the config's ``TRAIN.DATASETS`` / ``TEST.DATASETS``
    (so a Detectron YAML file works unchanged).

    The other arguments come in groups (:mod:`lit_roidata.options`), each a dataclass or
    a dict of its fields; on the command line they are nested options
    (``--data.loader.num_workers 4``). The flat names of earlier releases
    (``num_workers=4``) still work for one release, with a ``DeprecationWarning``.
    :class:`~lit_roidata.demo.DemoRoIDataModule` adds the generated demo data.

    Example::

        dm = RoIDataModule(detectron_config="fast_rcnn_R-50-FPN_1x.yaml",
                           datasets={"train": ["coco_2014_train"],
                                     "train_proposal_files": ["rpn_proposals_train.npz"]},
                           sources={"data_root": "/data"}, loader={"num_workers": 4})
        trainer.fit(model, datamodule=dm)

    Args:
        detectron_config: path of a Detectron YAML config (e.g.
            ``e2e_mask_rcnn_R-50-FPN_1x.yaml``) read over Detectron's defaults.
        overrides: Detectron keys to set, dotted or nested, e.g.
            ``{"TRAIN.SCALES": [800], "TRAIN.MAX_SIZE": 1333}``.
        model_type: shortcut for the MODEL/RPN/FPN/RETINANET flags that select the
            blob family; ``None`` keeps the config's flags.
        datasets: the datasets and proposal files of each split
            (:class:`~lit_roidata.options.DatasetOptions`).
        sources: data root, catalog, roidb cache, image checks and the bad-image policy
            (:class:`~lit_roidata.options.SourceOptions`).
        loader: workers, images per batch, pinning and prefetching
            (:class:`~lit_roidata.options.LoaderOptions`).
        output: the batch format (:class:`~lit_roidata.options.OutputOptions`).
        sampling: seed, RNG mode, aspect grouping, endless stream and resume checks
            (:class:`~lit_roidata.options.SamplingOptions`).
        augment: an albumentations pipeline for the training images, or ``None``
            (Detectron's blobs exactly; :class:`~lit_roidata.options.AugmentOptions`).

    Raises:
        TypeError: an unknown keyword or option (naming the valid ones).
        ValueError: an option out of range, or an option and ``overrides`` setting the
            same Detectron key to different values.
    """

    def __init__(
        self,
        detectron_config: Optional[str] = None,
        overrides: Optional[dict[str, Any]] = None,
        model_type: Optional[ModelType] = None,
        datasets: DatasetOptions = DatasetOptions(),
        sources: SourceOptions = SourceOptions(),
        loader: LoaderOptions = LoaderOptions(),
        output: OutputOptions = OutputOptions(),
        sampling: SamplingOptions = SamplingOptions(),
        augment: Optional[AugmentOptions] = None,
        **deprecated: Any,
    ) -> None:
        super().__init__()
        groups = _merge_deprecated(dict(datasets=datasets, sources=sources, loader=loader,
                                        output=output, sampling=sampling), deprecated,
                                   type(self).__name__)
        self.datasets: DatasetOptions = as_options(DatasetOptions, groups["datasets"], "datasets")
        self.sources: SourceOptions = as_options(SourceOptions, groups["sources"], "sources")
        self.loader: LoaderOptions = as_options(LoaderOptions, groups["loader"], "loader")
        self.output: OutputOptions = as_options(OutputOptions, groups["output"], "output")
        self.sampling: SamplingOptions = as_options(SamplingOptions, groups["sampling"],
                                                    "sampling")
        self.augment: Optional[AugmentOptions] = (
            None if augment is None else as_options(AugmentOptions, augment, "augment"))
        self.detectron_config = detectron_config
        self.overrides = dict(overrides) if overrides else None
        self.model_type = model_type
        self.save_hyperparameters(to_plain(dict(
            detectron_config=detectron_config, overrides=self.overrides, model_type=model_type,
            datasets=self.datasets, sources=self.sources, loader=self.loader,
            output=self.output, sampling=self.sampling, augment=self.augment)))
        self._check_options()
        self.cfg: DetectronConfig = self._build_cfg()
        s = self.sampling.seed
        self.seed: int = int(self.cfg.RNG_SEED if s is None else s)
        self.train_roidb: Any = None
        self.val_roidb: Any = None
        self.test_roidb: Any = None
        self._catalog: Any = None
        self._demo: Any = None
        self._demo_options: Optional[dict[str, Any]] = groups.get("demo")
        self._train_loader: Any = None
        self._skipped: Counter[str] = Counter()
        self._restored_phase: dict[str, Any] = {}
        self._carry_from: Any = None
        self._skip_records: list[dict[str, Any]] = []  # bad files found, not yet reported
        self._run_skips: Counter[str] = Counter()
        self._run_skip_files: dict[str, dict[str, Any]] = {}
        self.last_skip_report: dict[str, Any] = {"counts": {}, "files": []}
        self._ledger: Any = None
        self._ledger_state: Optional[Mapping[str, Any]] = None

    def _check_options(self) -> None:
        """Range checks of the options (before anything is built)."""
        ld, src = self.loader, self.sources
        if ld.num_workers < 0:
            raise ValueError(f"loader.num_workers={ld.num_workers}; use 0 (main process) "
                             "or more")
        if ld.eval_ims_per_batch < 1:
            raise ValueError(f"loader.eval_ims_per_batch={ld.eval_ims_per_batch}; need at "
                             "least 1")
        if ld.ims_per_batch is not None and ld.ims_per_batch < 1:
            raise ValueError(f"loader.ims_per_batch={ld.ims_per_batch}; need at least 1 "
                             "(or null: TRAIN.IMS_PER_BATCH of the Detectron config)")
        if ld.prefetch_factor is not None and ld.prefetch_factor < 1:
            raise ValueError(f"loader.prefetch_factor={ld.prefetch_factor}; need at least 1 "
                             "(or null: PyTorch's default)")
        if ld.persistent_workers and src.on_bad_image == "skip":
            raise ValueError("loader.persistent_workers=true with sources.on_bad_image=skip: "
                             "each epoch's workers must be new to skip the bad images found "
                             "in the previous epoch; drop one of the two")
        if not 0 <= src.bad_image_reserve < 1:
            raise ValueError(f"sources.bad_image_reserve={src.bad_image_reserve}; use a "
                             "fraction of a pass in [0, 1), e.g. 0.01")

    # ------------------------------------------------------------------ config
    def _build_cfg(self) -> DetectronConfig:
        """Detectron's defaults, ``detectron_config``, ``model_type``, ``overrides``,
        then the options that name a Detectron key (the one place they are resolved);
        merged in this order, inferred, then frozen."""
        flags = None
        if self.model_type is not None:
            from lit_roidata.minibatch.model_type import flags_for_model_type

            flags = flags_for_model_type(self.model_type)
        given = _flat_keys(self.overrides or {})
        keyed = {"TRAIN.IMS_PER_BATCH": ("loader.ims_per_batch", self.loader.ims_per_batch),
                 "TRAIN.ASPECT_GROUPING": ("sampling.aspect_grouping",
                                           self.sampling.aspect_grouping)}
        merged: dict[str, Any] = {}
        for key, (option, value) in keyed.items():
            if value is None:
                continue
            if key in given and given[key] != value:
                raise ValueError(f"{option}={value!r} and overrides {key}={given[key]!r} "
                                 f"disagree; set one of them (null {option} takes "
                                 f"{key} from the Detectron config)")
            merged[key] = value
        return load_detectron_cfg(self.detectron_config, flags, dict(self.overrides or {}),
                                  merged or None)

    def _datasets(self, split: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Dataset names and proposal files of ``split`` after the fallbacks."""
        self.catalog()  # registers the demo datasets, if any
        ds, cfg = self.datasets, self.cfg
        if split == "test" and ds.test is None:
            split = "val"
        names = getattr(ds, split)
        props = getattr(ds, f"{split}_proposal_files")
        if not names:
            if split == "train":
                names, props = cfg.TRAIN.DATASETS, props or cfg.TRAIN.PROPOSAL_FILES
            else:
                names = cfg.TEST.DATASETS
                props = props or cfg.TEST.PROPOSAL_FILES
        if not names and self._demo is not None:
            demo = self._demo
            if split == "train":
                names, props = demo.train_datasets, props or demo.train_proposal_files
            else:
                names, props = demo.val_datasets, props or demo.val_proposal_files
        names, props = tuple(names or ()), tuple(props or ())
        if props and len(props) != len(names):
            raise ValueError(
                f"data.datasets.{split}_proposal_files has {len(props)} file(s) for "
                f"{len(names)} dataset(s) {list(names)}; give one proposal file per dataset "
                f"or none")
        return names, props

    def catalog(self) -> Any:
        """This module's dataset catalog (built once per process).

        A copy of the process-wide :data:`lit_roidata.catalog.DatasetCatalog` (so
        datasets registered from Python are seen), with the built-in names resolved
        under ``sources.data_root``, the datasets of the ``sources.dataset_catalog`` YAML
        file, and those :meth:`register_datasets` adds (the demo's, in
        :class:`~lit_roidata.demo.DemoRoIDataModule`).
        """
        if self._catalog is None:
            from lit_roidata.catalog import DatasetCatalog

            cat = DatasetCatalog.copy()
            if self.sources.data_root is not None:
                cat.set_data_root(self.sources.data_root)
            if self.sources.dataset_catalog is not None:
                cat.load_yaml(self.sources.dataset_catalog, overwrite=True)
            self.register_datasets(cat)
            self._catalog = cat
        return self._catalog

    def register_datasets(self, catalog: Any) -> None:
        """Hook: register more datasets in this module's ``catalog`` (called once per
        process, when the catalog is built; the base class adds none)."""
        demo = self._demo_options  # the deprecated RoIDataModule(demo_root=...)
        if demo is not None and demo.get("demo_root") is not None:
            from lit_roidata.demo import register_demo_datasets

            self._demo = register_demo_datasets(demo["demo_root"], catalog,
                                                num_images=demo.get("demo_size"))

    def _roidb_kwargs(self) -> dict[str, Any]:
        src = self.sources
        return dict(cache_dir=src.cache_dir, trust_pickle=src.trust_pickle,
                    category_policy=src.category_policy, check_images=src.check_images)

    # --------------------------------------------------------------- lifecycle
    def prepare_data(self) -> None:
        """Register the datasets (the demo subclass generates its data here) and build
        the roidb caches.

        Runs once per node; sets no state (the roidbs are dropped, only the cache
        files stay). Every process opens them again in :meth:`setup`.
        """
        from lit_roidata.roidb import combined_roidb_for_training, roidb_for_evaluation
        from lit_roidata.roidb.build import check_training_config

        # Generates the demo data if asked (file-locked, idempotent); every process
        # builds the same catalog again in setup().
        catalog = self.catalog()
        kw = self._roidb_kwargs()
        names, props = self._datasets("train")
        if names:
            check_training_config(self.cfg, list(props), list(names))  # before any build
            combined_roidb_for_training(list(names), list(props), self.cfg, catalog=catalog,
                                        **kw)
        for split in ("val", "test"):
            names, props = self._datasets(split)
            if names:
                roidb_for_evaluation(list(names), self.cfg, proposal_files=list(props),
                                     catalog=catalog, **kw)

    def setup(self, stage: Optional[str] = None) -> None:
        """Open the cached roidbs read-only for ``stage`` (every process)."""
        from lit_roidata.roidb import combined_roidb_for_training, roidb_for_evaluation
        from lit_roidata.roidb.build import check_training_config

        catalog = self.catalog()
        kw = self._roidb_kwargs()
        if stage in (None, "fit") and self.train_roidb is None:
            names, props = self._datasets("train")
            if not names:
                raise ValueError("no training datasets: set data.datasets.train (or "
                                 "TRAIN.DATASETS in the Detectron config, or use "
                                 "lit_roidata.DemoRoIDataModule for the demo data)")
            check_training_config(self.cfg, list(props), list(names))  # before any build
            self.train_roidb = combined_roidb_for_training(
                list(names), list(props), self.cfg, catalog=catalog, **kw)
        if stage in (None, "fit", "validate") and self.val_roidb is None:
            names, props = self._datasets("val")
            if names:
                self.val_roidb = roidb_for_evaluation(
                    list(names), self.cfg, proposal_files=list(props), catalog=catalog, **kw)
        if stage in (None, "test") and self.test_roidb is None:
            names, props = self._datasets("test")
            if names:
                self.test_roidb = roidb_for_evaluation(
                    list(names), self.cfg, proposal_files=list(props), catalog=catalog, **kw)

    # ------------------------------------------------------------ dataloaders
    def _rank_world(self) -> tuple[int, int]:
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return 0, 1
        return int(trainer.global_rank), int(trainer.world_size)

    def make_sampler(self, roidb: Any = None, *, shuffle: bool = True,
                     ims_per_batch: Optional[int] = None, rank: Optional[int] = None,
                     world_size: Optional[int] = None) -> Any:
        """Detectron's batch sampler over ``roidb`` (default: the training roidb).

        Args:
            shuffle: ``False`` gives Detectron's ``RoIDataLoaderSimple`` identity order.
            ims_per_batch: images per partial minibatch (default ``TRAIN.IMS_PER_BATCH``).
            rank, world_size: default: from the trainer (0 and 1 without one).
        """
        from lit_roidata.sampler import RoIBatchSampler

        roidb = self.train_roidb if roidb is None else roidb
        r, w = self._rank_world()
        kw = dict(aspect_grouping=bool(self.cfg.TRAIN.ASPECT_GROUPING) and shuffle,
                  shuffle=shuffle, seed=self.seed, rank=r if rank is None else rank,
                  world_size=w if world_size is None else world_size,
                  infinite=bool(self.sampling.infinite))
        mb = int(self.cfg.TRAIN.IMS_PER_BATCH if ims_per_batch is None else ims_per_batch)
        sampler = RoIBatchSampler(roidb.widths, roidb.heights, mb, **kw)
        if self.sources.on_bad_image == "skip":
            # Hold back the reserve that replaces bad images (lit_roidata.skip).
            from lit_roidata.skip import holdback_blocks

            hb = holdback_blocks(sampler.blocks_per_pass,
                                 float(self.sources.bad_image_reserve),
                                 1 if kw["infinite"] else int(kw["world_size"]), mb)
            if hb:
                sampler = RoIBatchSampler(roidb.widths, roidb.heights, mb, holdback=hb, **kw)
        return sampler

    def make_dataset(self, roidb: Any = None, sampler: Any = None, *,
                     pixel_format: Optional[str] = None, cfg: Optional[DetectronConfig] = None
                     ) -> Any:
        """The workers' :class:`~lit_roidata.dataset.RoIBlockDataset` over ``roidb``.

        Args:
            sampler: the batch sampler whose ``replacement_block`` replaces an invalid
                keypoint minibatch; with ``on_bad_image="skip"`` the dataset also gets a
                :class:`~lit_roidata.skip.BadImageLedger` over it.
            pixel_format, cfg: override this module's settings (the tools use them).
        """
        from lit_roidata.dataset import RoIBlockDataset

        out = self.output
        roidb = self.train_roidb if roidb is None else roidb
        cfg = self.cfg if cfg is None else cfg
        ledger = None
        if self.sources.on_bad_image == "skip" and sampler is not None:
            from lit_roidata.skip import BadImageLedger

            ledger = BadImageLedger(sampler, roidb)
        return RoIBlockDataset(
            roidb, cfg, ledger=ledger,
            output_format=out.output_format,
            pixel_format=out.pixel_format if pixel_format is None else pixel_format,
            rng_mode=self.sampling.rng_mode, on_bad_image=self.sources.on_bad_image,
            replacement=None if sampler is None else sampler.replacement_block,
            augment=self.make_augmentation(cfg),
            fix_rpn_quirks=bool(out.fix_rpn_quirks), mask_format=out.mask_format,
            target_format="detectron" if out.target_format == "detectron" else "compact")

    def make_augmentation(self, cfg: Optional[DetectronConfig] = None) -> Any:
        """The :class:`~lit_roidata.minibatch.augment.Augmentation` of ``augment``
        (``None`` without one): YAML transform specs become albumentations transforms."""
        if self.augment is None:
            return None
        from lit_roidata.minibatch.augment import Augmentation

        transforms = [_albumentations_transform(t) for t in self.augment.transforms]
        return Augmentation(transforms, self.cfg if cfg is None else cfg,
                            min_visibility=float(self.augment.min_visibility))

    def train_dataloader(self) -> Any:
        """The checkpointable train loader (this rank's partial minibatches)."""
        if self.train_roidb is None:
            self.setup("fit")
        sampler = self.make_sampler()
        dataset = self.make_dataset(sampler=sampler)
        if self._ledger is not None:  # a reloaded loader keeps what the run learnt
            self._ledger_state = self._ledger.state_dict()
        self._ledger = dataset.ledger
        if self._ledger is not None and self._ledger_state is not None:
            self._ledger.load_state_dict(self._ledger_state)
        self._train_dataset = dataset
        dataset.defer_repair = True  # every repair in _on_train_batch, in stream order
        self._first_batch = True
        ld = self.loader
        nw = int(ld.num_workers)
        previous = self._train_loader
        trainer = getattr(self, "trainer", None)
        combined = getattr(getattr(trainer, "fit_loop", None), "_combined_loader", None)
        if combined is None or all(dl is not previous for dl in combined.flattened):
            previous = None  # not a reload of the loader the running fit uses
        self._train_loader = StatefulRoIDataLoader(
            dataset, sampler, num_workers=nw, pin_memory=bool(ld.pin_memory),
            persistent_workers=bool(ld.persistent_workers) and nw > 0,
            prefetch_factor=None if nw == 0 else ld.prefetch_factor,
            strict_resume=bool(self.sampling.strict_resume), inflight=self._batches_in_flight, on_batch=self._on_train_batch,
            on_restore=self._align_loops, shm_pool=bool(getattr(ld, "shm_pool", True)))
        if previous is not None:
            # reload_dataloaders_every_n_epochs: the new loader continues the stream
            # where the old one stopped (in infinite mode it would restart at pass 0).
            self._carry_from = self._train_loader
            try:
                self._train_loader.load_state_dict(previous.state_dict(), strict=False)
            finally:
                self._carry_from = None
        # Workers are started anew every epoch unless loader.persistent_workers (refused
        # with on_bad_image="skip"): each epoch's workers see the bad images exchanged at
        # the end of the previous epoch.
        self._add_report_callback()
        return self._train_loader

    # ------------------------------------------------------------ skip policy
    def _add_report_callback(self) -> None:
        """Register :class:`~lit_roidata.skip.BadImageReport` (epoch-end exchange and
        report) with the trainer, once."""
        from lit_roidata._lightning import PL, bind, isinstance_any, namespace_of
        from lit_roidata.skip import BadImageReport

        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return
        if not any(isinstance_any(cb, BadImageReport) and cb.datamodule is self
                   for cb in trainer.callbacks):
            # First: an epoch-end checkpoint (ModelCheckpoint runs last) must hold the
            # state after the exchange, or a resume from it would replace differently.
            # The callback of the trainer's Lightning namespace (lit_roidata.lightning).
            report = bind(BadImageReport, namespace_of(trainer) or PL)
            trainer.callbacks.insert(0, report(self))

    def _on_train_batch(self, batch: Any) -> Any:
        """Main process, stream order, before the device transfer: finish blocks with a
        newly found bad image and count every skip (any ``output_format``)."""
        dataset = getattr(self, "_train_dataset", None)
        if getattr(self, "_first_batch", False) and self._ledger is not None:
            self._first_batch = False
            loader = self._train_loader
            if loader is not None:  # where this (maybe resumed) stream starts
                self._ledger.resumed_at(*loader.batch_sampler.normalize(*loader._pos))
        if dataset is not None:
            batch = dataset.repair(batch)
        meta = batch.get("_meta") if isinstance(batch, dict) else getattr(batch, "meta", None)
        if isinstance(meta, Mapping):
            self._count_skips(meta)
        return batch

    def _count_skips(self, meta: Mapping[str, Any]) -> None:
        for item in meta.get("skipped") or ():
            if item.get("again"):  # a file already reported (an original and its flip)
                self._skipped["read_again"] += 1
                continue
            self._skipped[str(item.get("reason", "bad_image"))] += 1
            rec = {k: item.get(k) for k in ("reason", "path", "image_id", "dataset",
                                              "message", "index")}
            rec.update(pass_index=meta.get("pass_index"), block_index=meta.get("block_index"))
            self._skip_records.append(rec)
            if self._ledger is not None and rec["index"] is not None:
                self._ledger.mark_bad(int(rec["index"]), rec)
        for sub in meta.get("substitutes") or ():
            if sub.get("why") in ("known_bad", "reserve_exhausted"):
                self._skipped[str(sub["why"])] += 1
        if meta.get("num_invalid_replaced"):
            self._skipped["invalid_minibatch"] += int(meta["num_invalid_replaced"])

    def exchange_bad_images(self) -> dict[str, Any]:
        """Merge the bad images found on every rank and report the epoch's skips.

        Called by :class:`~lit_roidata.skip.BadImageReport` in ``on_train_epoch_end``
        (every rank at the same step): under DDP one ``all_gather_object`` of the new
        records; never called while a batch is fetched. The merged bad images are
        replaced before reading from the next pass that has not started, on every rank.
        Rank 0 logs every skipped file with its reason.

        Returns:
            ``{"counts": {kind: n}, "files": [record, ...]}`` of this epoch, all ranks.
        """
        mine = {"counts": dict(self._skipped), "files": list(self._skip_records)}
        self._skipped, self._skip_records = Counter(), []
        parts = [mine]
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            parts = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(parts, mine)
        from lit_roidata.skip import merge_skip_reports

        counts, files = merge_skip_reports(parts)
        ledger = self._ledger
        if ledger is not None:
            for rec in (r for part in parts for r in part["files"]):
                if rec.get("index") is not None:
                    ledger.mark_bad(int(rec["index"]), rec)
            loader = self._train_loader
            pos = loader._pos if loader is not None else (0, 0)
            p, c = loader.batch_sampler.normalize(*pos) if loader is not None else pos
            ledger.freeze(p if c == 0 else p + 1)
        report = {"counts": dict(sorted(counts.items())), "files": list(files.values())}
        self.last_skip_report = report
        self._run_skips.update(counts)
        for path, rec in files.items():
            self._run_skip_files.setdefault(path, rec)
        if counts and self._rank_world()[0] == 0:
            from lit_roidata.skip import summarize

            log.warning("%s", summarize(report["files"], report["counts"],
                                        f"data: skip report of the epoch (on_bad_image="
                                        f"{self.sources.on_bad_image})"))
        return report

    def log_run_skips(self) -> dict[str, Any]:
        """Log (rank 0) and return every skip of the run so far (no collective)."""
        report = {"counts": dict(sorted(self._run_skips.items())),
                  "files": list(self._run_skip_files.values())}
        if report["counts"] and self._rank_world()[0] == 0:
            from lit_roidata.skip import summarize

            log.warning("%s", summarize(report["files"], report["counts"],
                                        "data: skip report of the whole run"))
        return report

    def _batches_in_flight(self) -> int:
        """Batches handed to the training loop but not trained on (0 or 1).

        An interrupt (Ctrl-C, an exception) after the loader handed a batch out and
        before the step finished leaves one; Lightning will not replay it, so the
        checkpoint written then (``OnExceptionCheckpoint``) must put the stream back
        before it (:func:`lit_roidata.resume.batches_in_flight`).
        """
        from lit_roidata.resume import batches_in_flight

        loader = self._train_loader
        if loader is None:
            return 0
        return batches_in_flight(getattr(self, "trainer", None), loader.consumed_batches)

    def _align_loops(self, loader: Any, state: Mapping[str, Any]) -> None:
        """Make Lightning's restored loop counters agree with the restored stream."""
        from lit_roidata.resume import align_fit_loop

        trainer = getattr(self, "trainer", None)
        # Only while Lightning restores a checkpoint (not when a reloaded loader takes
        # over the previous one's position).
        if trainer is not None and loader is not self._carry_from and trainer.fit_loop.restarting:
            align_fit_loop(trainer, loader, self._restored_phase)

    def _eval_loader(self, roidb: Any, split: str) -> Any:
        from lit_roidata.loader import EvalLoader

        if roidb is None:
            return []
        rank, world = self._rank_world()
        with_rois = bool(self._datasets(split)[1])
        ld = self.loader
        return EvalLoader(roidb, self.cfg, rank=rank, world_size=world,
                          ims_per_batch=int(ld.eval_ims_per_batch),
                          pixel_format=self.output.pixel_format, with_rois=with_rois,
                          num_workers=int(ld.num_workers), pin_memory=bool(ld.pin_memory),
                          persistent_workers=bool(ld.persistent_workers),
                          prefetch_factor=ld.prefetch_factor)

    def val_dataloader(self) -> Any:
        """Every validation image once, in roidb order, unflipped, sharded by rank."""
        if self.val_roidb is None:
            self.setup("validate")
        return self._eval_loader(self.val_roidb, "val")

    def test_dataloader(self) -> Any:
        """Every test image once, in roidb order, unflipped, sharded by rank."""
        if self.test_roidb is None:
            self.setup("test")
        return self._eval_loader(self.test_roidb, "test")

    def predict_dataloader(self) -> Any:
        """The test images (every one once, in order): ``test_dataloader``'s batches."""
        return self.test_dataloader()

    # ------------------------------------------------------------------- device
    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Finish the worker's compact blobs on the device (uint8 ``data`` -> Detectron's
        float blob, compact targets and masks -> Detectron's blobs;
        :func:`~lit_roidata.minibatch.device.finish_batch`). Skips are counted before the
        transfer, when the loader hands the batch out."""
        return finish_batch(batch, self.cfg,
                            expand_compact_targets=self.output.target_format != "compact_raw")

    def transfer_batch_to_device(self, batch: Any, device: torch.device,
                                 dataloader_idx: int) -> Any:
        """Lightning's transfer, keeping ``TorchvisionBatch.meta`` (a plain transfer
        rebuilds the tuple without it)."""
        from lit_roidata.minibatch.torchvision_format import TorchvisionBatch

        moved = super().transfer_batch_to_device(batch, device, dataloader_idx)
        if isinstance(batch, TorchvisionBatch) and getattr(moved, "meta", None) is None:
            moved = TorchvisionBatch(tuple(moved), batch.meta)
        return moved

    def report_skips(self) -> dict[str, int]:
        """Report (rank 0 logs) the skips since the last report, by kind; see
        :meth:`exchange_bad_images` (this is its ``counts``). Under DDP call it only where
        every rank calls it at the same step (an epoch hook): it runs a collective."""
        return dict(self.exchange_bad_images()["counts"])

    def teardown(self, stage: str) -> None:
        """Report skips of an unfinished pass; drop the loader (its workers exit)."""
        if stage == "fit":
            if self._skipped and self._rank_world()[0] == 0:
                log.warning("data: replaced blocks in the last (unfinished) pass, by "
                            "reason: %s", dict(sorted(self._skipped.items())))
            self._train_loader = None

    # -------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """The stream seed, the loop phase, pending skip counts and records, and the known
        bad images (:meth:`lit_roidata.skip.BadImageLedger.state_dict`) (the loader position
        is saved by the fit loop from the train loader,
        :class:`~lit_roidata.loader.StatefulRoIDataLoader`)."""
        from lit_roidata.resume import save_phase

        ledger = self._ledger.state_dict() if self._ledger is not None else self._ledger_state
        return {"seed": self.seed, "skipped": dict(self._skipped),
                "phase": save_phase(getattr(self, "trainer", None)),
                "skip_records": [dict(r) for r in self._skip_records],
                "bad_images": None if ledger is None else dict(ledger)}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the pending skip counts and the known bad images; a different seed is
        refused by the sampler."""
        self._skipped = Counter(state_dict.get("skipped", {}))
        self._restored_phase = dict(state_dict.get("phase") or {})
        self._skip_records = [dict(r) for r in state_dict.get("skip_records", [])]
        self._ledger_state = state_dict.get("bad_images")
        if self._ledger is not None and self._ledger_state is not None:
            self._ledger.load_state_dict(self._ledger_state)


def _merge_deprecated(groups: dict[str, Any], flat: Mapping[str, Any], owner: str
                      ) -> dict[str, Any]:
    """Fold the flat keywords of earlier releases into their groups, warning once each.

    Returns the groups as dicts where a flat keyword changed them (``"demo"`` holds a
    deprecated ``demo_root``/``demo_size``). Raises ``TypeError`` for an unknown keyword
    and for a value given both flat and nested.
    """
    import dataclasses
    import warnings

    out = dict(groups)
    for name, value in flat.items():
        if name in ("demo_root", "demo_size"):
            warnings.warn(f"{owner}({name}=...) is deprecated; use "
                          f"lit_roidata.DemoRoIDataModule({name}=...)",
                          DeprecationWarning, stacklevel=3)
            out.setdefault("demo", {})[name] = value
            continue
        if name not in DEPRECATED_FLAT_ARGS:
            valid = ["detectron_config", "overrides", "model_type", "datasets", "sources",
                     "loader", "output", "sampling", "augment"]
            raise TypeError(f"{owner}: unexpected keyword argument {name!r}; the arguments "
                            f"are {valid} (options are grouped, e.g. loader.num_workers)")
        group, key = DEPRECATED_FLAT_ARGS[name]
        warnings.warn(f"{owner}({name}=...) is deprecated; use {group}.{key} "
                      f"({group}={{{key!r}: ...}}, --data.{group}.{key} on the command line)",
                      DeprecationWarning, stacklevel=3)
        current = out[group]
        fields = (dataclasses.asdict(current) if dataclasses.is_dataclass(current)
                  else dict(current or {}))
        default = getattr(as_options(_GROUP_TYPES[group], None, group), key)
        if key in fields and fields[key] != default and fields[key] != value:
            raise TypeError(f"{owner}: {name}={value!r} and {group}.{key}="
                            f"{fields[key]!r} disagree; give only {group}.{key}")
        fields[key] = value
        out[group] = fields
    return out


_GROUP_TYPES: dict[str, type] = {"datasets": DatasetOptions, "sources": SourceOptions,
                                 "loader": LoaderOptions, "output": OutputOptions,
                                 "sampling": SamplingOptions}


def _flat_keys(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"TRAIN": {"SCALES": ...}, "TEST.SCALE": ...}`` -> dotted keys and values."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flat_keys(v, key + "."))
        else:
            out[key] = v
    return out


def _albumentations_transform(spec: Any) -> Any:
    """An albumentations transform from an instance or a ``{class_path, init_args}``
    dict (a bare class name is looked up in ``albumentations``)."""
    if not isinstance(spec, Mapping):
        return spec
    import importlib

    from lit_roidata._optional import require

    A = require("albumentations", "augment", "augmentation (augment.transforms)")
    if "class_path" not in spec:
        raise ValueError(f"augment.transforms: {dict(spec)!r} needs a class_path, e.g. "
                         "{class_path: RandomBrightnessContrast, init_args: {p: 0.5}}")
    path = str(spec["class_path"])
    unknown = sorted(set(spec) - {"class_path", "init_args"})
    if unknown:
        raise ValueError(f"augment.transforms: {path}: unknown keys {unknown}; use "
                         "class_path and init_args")
    if "." in path:
        module, name = path.rsplit(".", 1)
        cls = getattr(importlib.import_module(module), name, None)
    else:
        cls = getattr(A, path, None)
    if cls is None:
        raise ValueError(f"augment.transforms: no albumentations transform {path!r}")
    args = dict(spec.get("init_args") or {})
    if "transforms" in args:  # OneOf, SomeOf, Sequential: nested specs
        args["transforms"] = [_albumentations_transform(t) for t in args["transforms"]]
    return cls(**args)


#: Names that moved out of this module (it holds only the DataModule), for one release.
_MOVED = {"EvalDataset": "lit_roidata.dataset", "EvalLoader": "lit_roidata.loader",
          "fork_safe_opencv": "lit_roidata.loader"}


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        import importlib
        import warnings

        warnings.warn(f"lit_roidata.datamodule.{name} is deprecated; import it from "
                      f"{_MOVED[name]}", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
