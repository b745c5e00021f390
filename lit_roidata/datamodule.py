"""``RoIDataModule``: Detectron's training-data pipeline as a LightningDataModule.

This is the only place that knows the config's shape (docs/architecture.md, "Configuration"): it
turns its
``__init__`` arguments (which LightningCLI exposes as ``--data.init_args.*``) into a
Detectron config, a dataset catalog, the cached combined roidb, Detectron's batch
sampler and the workers' dataset, and hands Lightning the stateful train loader.

Lifecycle (Lightning's contract, ``datamodule.rst``):

* ``prepare_data`` (once per node): generate the demo data if asked, build the roidb
  caches (train and evaluation). It sets no state; a shared filesystem cache is built
  once under the roidb builder's file lock.
* ``setup`` (every process): open the caches read-only (memory-mapped, milliseconds).
* ``train_dataloader``: :class:`~lit_roidata.sampler.RoIBatchSampler` over the roidb
  with this process's rank and world size (``TRAIN.IMS_PER_BATCH`` is per rank, as
  Detectron's per-GPU minibatch, Detectron semantics: multi-gpu and weights), workers building blobs
  (:class:`~lit_roidata.dataset.RoIBlockDataset`), wrapped in the checkpointable
  :class:`~lit_roidata.loader.StatefulRoIDataLoader`.
* ``val_dataloader`` / ``test_dataloader``: every evaluation image exactly once, in
  roidb order, unflipped, split across ranks without padding (:class:`EvalLoader`).
* ``on_after_batch_transfer``: uint8 images become Detectron's float blob (BGR minus
  ``PIXEL_MEANS``) on the device, 4× less host→device traffic than float32.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Literal, Mapping, Optional, Sequence

import numpy as np
import pytorch_lightning as pl
import torch

from lit_roidata.config import DetectronConfig, load_detectron_cfg
from lit_roidata.loader import StatefulRoIDataLoader
from lit_roidata.minibatch.device import finalize_on_device
from lit_roidata.minibatch.fpn import add_multilevel_rois, rois_blob
from lit_roidata.minibatch.model_type import MODEL_TYPES

__all__ = ["RoIDataModule", "ModelType", "EvalDataset", "EvalLoader", "fork_safe_opencv"]

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
    ``model_type``, then ``overrides``. Dataset lists left empty fall back to the
    config's ``TRAIN.DATASETS`` / ``TEST.DATASETS`` (so a Detectron YAML file works
    unchanged), and, with ``demo_root``, to the demo datasets.

    Example::

        dm = RoIDataModule(train_datasets=["coco_2014_train"],
                           train_proposal_files=["rpn_proposals_train.npz"],
                           detectron_config="fast_rcnn_R-50-FPN_1x.yaml",
                           data_root="/data")
        trainer.fit(model, datamodule=dm)

    Args:
        train_datasets: catalog names of the training datasets, concatenated in this
            order (Detectron's ``TRAIN.DATASETS``).
        train_proposal_files: one proposal file per training dataset (Fast R-CNN from
            precomputed proposals), or empty (``TRAIN.PROPOSAL_FILES``).
        val_datasets: datasets for ``val_dataloader`` (default ``TEST.DATASETS``).
        val_proposal_files: their proposal files (default ``TEST.PROPOSAL_FILES``);
            ``TEST.PROPOSAL_LIMIT`` proposals per image are kept.
        test_datasets: datasets for ``test_dataloader``; default: the validation ones.
        test_proposal_files: their proposal files; default: the validation ones.
        detectron_config: path of a Detectron YAML config (e.g.
            ``e2e_mask_rcnn_R-50-FPN_1x.yaml``) read over Detectron's defaults.
        overrides: Detectron keys to set, dotted or nested, e.g.
            ``{"TRAIN.SCALES": [800], "TRAIN.IMS_PER_BATCH": 2}``.
        model_type: shortcut for the MODEL/RPN/FPN/RETINANET flags that select the
            blob family; ``None`` keeps the config's flags.
        num_workers: DataLoader worker processes building minibatches.
        pixel_format: ``"uint8"`` keeps images uint8 (BGR, NCHW, zero padding) up to
            the device and normalises there; ``"detectron"`` gives Detectron's float32
            blob (BGR minus ``PIXEL_MEANS``) from the workers.
        output_format: ``"detectron"`` (dict of Detectron's blobs) or
            ``"torchvision"`` (list of images, list of target dicts).
        seed: seed of the sampler stream and of every per-block draw; default
            ``RNG_SEED`` of the config. Must be equal on every rank.
        rng_mode: ``"block"`` (one generator per block: reproducible anywhere) or
            ``"detectron"`` (NumPy RandomState in Detectron's call order).
        on_bad_image: ``"raise"`` stops on an unreadable image naming it;
            ``"skip"`` replaces only that image (its partners stay), deterministically,
            from images the pass holds back; the bad file is never read again once
            every rank knows it (exchanged at each epoch end, kept in checkpoints), and
            every skipped file is reported with its reason at the end of each epoch.
            Every good image of a pass is delivered exactly once (docs/minibatch.md).
        bad_image_reserve: with ``on_bad_image="skip"``, the fraction of each pass's
            blocks held back as replacements for bad images (at least 16 images, at
            most a quarter of a pass; 0: none, every replacement a counted repeat).
        cache_dir: folder for the roidb caches (default: the roidb builder's).
        data_root: root under which the built-in COCO catalog names resolve
            (``<data_root>/coco/...``).
        dataset_catalog: YAML file registering your own datasets by name (see
            :meth:`lit_roidata.catalog.Catalog.load_yaml`).
        demo_root: folder of the synthetic demo data; when set, ``prepare_data``
            generates it if missing and every process registers its datasets.
        demo_size: images per demo dataset, e.g. ``{"demo_train_a": 40}`` (default
            200 / 100 / 60 for ``demo_train_a`` / ``demo_train_b`` / ``demo_val``).
        infinite: Detectron's endless block stream (train with ``max_steps``) instead
            of epochs of ``len(loader)`` batches.
        fix_rpn_quirks: correct Detectron's RPN label quirks Q2/Q3
            (docs/detectron_quirks.md).
        eval_ims_per_batch: images per validation/test batch (Detectron tests one).
        pin_memory: pin host memory of batches (faster copies to a GPU).
        mask_format: ``"compact"`` (default) ships one ``M x M`` mask per mask RoI from
            the workers and expands it to Detectron's class-specific ``masks_int32`` on
            the device in :meth:`on_after_batch_transfer` (identical blob, ~NUM_CLASSES
            times less worker memory and copying); ``"detectron"`` builds the expanded
            blob in the workers, as Detectron does.
        target_format: ``"compact"`` (default) ships only the sampled RPN anchors
            (their labels, regression targets and weights) and RetinaNet's non-zero
            class labels from the workers, and expands them to Detectron's dense blobs
            on the device in :meth:`on_after_batch_transfer` (identical blobs, a few KB
            instead of ~45 MB per FPN batch); ``"detectron"`` builds the dense blobs in
            the workers; ``"compact_raw"`` ships the compact form and leaves it
            unexpanded, for a model whose loss reads the sampled anchors directly
            (docs/rpn_retinanet.md describes the blobs).
        trust_pickle: read proposal files that are pickles (``.pkl``). Unpickling runs
            any code the file names, so they are refused unless this is set (with a
            warning when used); ``lit-roidata convert-proposals in.pkl out.npz``
            converts one once into the ``.npz`` format, which needs no trust.
    """

    def __init__(
        self,
        train_datasets: Optional[list[str]] = None,
        train_proposal_files: Optional[list[str]] = None,
        val_datasets: Optional[list[str]] = None,
        val_proposal_files: Optional[list[str]] = None,
        test_datasets: Optional[list[str]] = None,
        test_proposal_files: Optional[list[str]] = None,
        detectron_config: Optional[str] = None,
        overrides: Optional[dict[str, Any]] = None,
        model_type: Optional[ModelType] = None,
        num_workers: int = 2,
        pixel_format: Literal["uint8", "detectron"] = "uint8",
        output_format: Literal["detectron", "torchvision"] = "detectron",
        seed: Optional[int] = None,
        rng_mode: Literal["block", "detectron"] = "block",
        on_bad_image: Literal["raise", "skip"] = "raise",
        cache_dir: Optional[str] = None,
        data_root: Optional[str] = None,
        dataset_catalog: Optional[str] = None,
        demo_root: Optional[str] = None,
        demo_size: Optional[dict[str, int]] = None,
        infinite: bool = False,
        fix_rpn_quirks: bool = False,
        eval_ims_per_batch: int = 1,
        pin_memory: bool = False,
        mask_format: Literal["compact", "detectron"] = "compact",
        target_format: Literal["compact", "detectron", "compact_raw"] = "compact",
        bad_image_reserve: float = 0.01,
        trust_pickle: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if num_workers < 0:
            raise ValueError(f"num_workers={num_workers}; use 0 (main process) or more")
        if eval_ims_per_batch < 1:
            raise ValueError(f"eval_ims_per_batch={eval_ims_per_batch}; need at least 1")
        self.cfg: DetectronConfig = self._build_cfg()
        self.seed: int = int(self.cfg.RNG_SEED if seed is None else seed)
        self.train_roidb: Any = None
        self.val_roidb: Any = None
        self.test_roidb: Any = None
        self._catalog: Any = None
        self._demo: Any = None
        self._train_loader: Any = None
        self._skipped: Counter[str] = Counter()
        self._restored_phase: dict[str, Any] = {}
        self._carry_from: Any = None
        if not 0 <= bad_image_reserve < 1:
            raise ValueError(f"bad_image_reserve={bad_image_reserve}; use a fraction of a "
                             "pass in [0, 1), e.g. 0.01")
        self._skip_records: list[dict[str, Any]] = []  # bad files found, not yet reported
        self._run_skips: Counter[str] = Counter()
        self._run_skip_files: dict[str, dict[str, Any]] = {}
        self.last_skip_report: dict[str, Any] = {"counts": {}, "files": []}
        self._ledger: Any = None
        self._ledger_state: Optional[Mapping[str, Any]] = None

    # ------------------------------------------------------------------ config
    def _build_cfg(self) -> DetectronConfig:
        hp = self.hparams
        flags = None
        if hp.model_type is not None:
            from lit_roidata.minibatch.model_type import flags_for_model_type

            flags = flags_for_model_type(hp.model_type)
        # merged in this order, inferred, then frozen
        return load_detectron_cfg(hp.detectron_config, flags, dict(hp.overrides or {}))

    def _datasets(self, split: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Dataset names and proposal files of ``split`` after the fallbacks."""
        self.catalog()  # registers the demo datasets, if any
        hp, cfg = self.hparams, self.cfg
        if split == "test" and hp.test_datasets is None:
            split = "val"
        names = getattr(hp, f"{split}_datasets")
        props = getattr(hp, f"{split}_proposal_files")
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
                f"data.{split}_proposal_files has {len(props)} file(s) for {len(names)} "
                f"dataset(s) {list(names)}; give one proposal file per dataset or none")
        return names, props

    def catalog(self) -> Any:
        """This module's dataset catalog (built once per process).

        A copy of the process-wide :data:`lit_roidata.catalog.DatasetCatalog` (so
        datasets registered from Python are seen), with the built-in names resolved
        under ``data_root``, the datasets of the ``dataset_catalog`` YAML file, and
        the demo datasets when ``demo_root`` is set.
        """
        if self._catalog is None:
            from lit_roidata.catalog import DatasetCatalog

            cat = DatasetCatalog.copy()
            if self.hparams.data_root is not None:
                cat.set_data_root(self.hparams.data_root)
            if self.hparams.dataset_catalog is not None:
                cat.load_yaml(self.hparams.dataset_catalog, overwrite=True)
            if self.hparams.demo_root is not None:
                from lit_roidata.demo import register_demo_datasets

                self._demo = register_demo_datasets(self.hparams.demo_root, cat,
                                                    num_images=self.hparams.demo_size)
            self._catalog = cat
        return self._catalog

    # --------------------------------------------------------------- lifecycle
    def prepare_data(self) -> None:
        """Generate the demo data (if ``demo_root``) and build the roidb caches.

        Runs once per node; sets no state (the roidbs are dropped, only the cache
        files stay). Every process opens them again in :meth:`setup`.
        """
        from lit_roidata.roidb import combined_roidb_for_training, roidb_for_evaluation
        from lit_roidata.roidb.build import check_training_config

        # Generates the demo data if asked (file-locked, idempotent); every process
        # builds the same catalog again in setup().
        catalog = self.catalog()
        names, props = self._datasets("train")
        if names:
            check_training_config(self.cfg, list(props), list(names))  # before any build
            combined_roidb_for_training(list(names), list(props), self.cfg,
                                        cache_dir=self.hparams.cache_dir, catalog=catalog,
                                        trust_pickle=self.hparams.trust_pickle)
        for split in ("val", "test"):
            names, props = self._datasets(split)
            if names:
                roidb_for_evaluation(list(names), self.cfg, cache_dir=self.hparams.cache_dir,
                                     proposal_files=list(props), catalog=catalog,
                                     trust_pickle=self.hparams.trust_pickle)

    def setup(self, stage: Optional[str] = None) -> None:
        """Open the cached roidbs read-only for ``stage`` (every process)."""
        from lit_roidata.roidb import combined_roidb_for_training, roidb_for_evaluation
        from lit_roidata.roidb.build import check_training_config

        catalog = self.catalog()
        cache_dir = self.hparams.cache_dir
        if stage in (None, "fit") and self.train_roidb is None:
            names, props = self._datasets("train")
            if not names:
                raise ValueError("no training datasets: set data.train_datasets (or "
                                 "TRAIN.DATASETS in the Detectron config, or demo_root)")
            check_training_config(self.cfg, list(props), list(names))  # before any build
            self.train_roidb = combined_roidb_for_training(
                list(names), list(props), self.cfg, cache_dir=cache_dir, catalog=catalog,
                trust_pickle=self.hparams.trust_pickle)
        if stage in (None, "fit", "validate") and self.val_roidb is None:
            names, props = self._datasets("val")
            if names:
                self.val_roidb = roidb_for_evaluation(
                    list(names), self.cfg, cache_dir=cache_dir, proposal_files=list(props),
                    catalog=catalog, trust_pickle=self.hparams.trust_pickle)
        if stage in (None, "test") and self.test_roidb is None:
            names, props = self._datasets("test")
            if names:
                self.test_roidb = roidb_for_evaluation(
                    list(names), self.cfg, cache_dir=cache_dir, proposal_files=list(props),
                    catalog=catalog, trust_pickle=self.hparams.trust_pickle)

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
                  infinite=bool(self.hparams.infinite))
        mb = int(self.cfg.TRAIN.IMS_PER_BATCH if ims_per_batch is None else ims_per_batch)
        sampler = RoIBatchSampler(roidb.widths, roidb.heights, mb, **kw)
        if self.hparams.on_bad_image == "skip":
            # Hold back the reserve that replaces bad images (lit_roidata.skip).
            from lit_roidata.skip import holdback_blocks

            hb = holdback_blocks(sampler.blocks_per_pass,
                                 float(getattr(self.hparams, "bad_image_reserve", 0.01)),
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

        hp = self.hparams
        roidb = self.train_roidb if roidb is None else roidb
        ledger = None
        if hp.on_bad_image == "skip" and sampler is not None:
            from lit_roidata.skip import BadImageLedger

            ledger = BadImageLedger(sampler, roidb)
        return RoIBlockDataset(
            roidb, self.cfg if cfg is None else cfg, ledger=ledger,
            output_format=hp.output_format,
            pixel_format=hp.pixel_format if pixel_format is None else pixel_format,
            rng_mode=hp.rng_mode, on_bad_image=hp.on_bad_image,
            replacement=None if sampler is None else sampler.replacement_block,
            fix_rpn_quirks=bool(hp.fix_rpn_quirks),
            mask_format=str(getattr(hp, "mask_format", "compact")),
            target_format="detectron" if getattr(hp, "target_format", "compact") == "detectron"
            else "compact")

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
        nw = int(self.hparams.num_workers)
        if nw > 0:
            fork_safe_opencv()
        previous = self._train_loader
        trainer = getattr(self, "trainer", None)
        combined = getattr(getattr(trainer, "fit_loop", None), "_combined_loader", None)
        if combined is None or all(dl is not previous for dl in combined.flattened):
            previous = None  # not a reload of the loader the running fit uses
        self._train_loader = StatefulRoIDataLoader(
            dataset, sampler, num_workers=nw, pin_memory=bool(self.hparams.pin_memory),
            persistent_workers=False, prefetch_factor=None if nw == 0 else 2,
            inflight=self._batches_in_flight, on_batch=self._on_train_batch,
            on_restore=self._align_loops)
        if previous is not None:
            # reload_dataloaders_every_n_epochs: the new loader continues the stream
            # where the old one stopped (in infinite mode it would restart at pass 0).
            self._carry_from = self._train_loader
            try:
                self._train_loader.load_state_dict(previous.state_dict(), strict=False)
            finally:
                self._carry_from = None
        # Workers are started anew every epoch (persistent_workers=False): each epoch's
        # workers see the bad images exchanged at the end of the previous epoch.
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
        counts: Counter[str] = Counter()
        files: dict[str, dict[str, Any]] = {}
        for part in parts:
            counts.update(part["counts"])
            for rec in part["files"]:  # one record per file (no path: kept apart)
                key = rec.get("path")
                files.setdefault(str(key) if key is not None else f"<no path {len(files)}>",
                                 rec)
        # One count per file: a file two ranks found in the same epoch (an image and its
        # flipped copy) counts once by its reason, the second find as read_again.
        found = Counter(str(r.get("reason")) for part in parts for r in part["files"])
        counts.subtract(found)
        counts.update(Counter(str(r.get("reason")) for r in files.values()))
        counts["read_again"] += sum(found.values()) - len(files)
        counts = Counter({k: v for k, v in counts.items() if v > 0})
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
                                        f"{self.hparams.on_bad_image})"))
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
        if roidb is None:
            return []
        rank, world = self._rank_world()
        with_rois = bool(self._datasets(split)[1])
        if self.hparams.num_workers > 0:
            fork_safe_opencv()
        return EvalLoader(roidb, self.cfg, rank=rank, world_size=world,
                          ims_per_batch=int(self.hparams.eval_ims_per_batch),
                          pixel_format=self.hparams.pixel_format, with_rois=with_rois,
                          num_workers=int(self.hparams.num_workers),
                          pin_memory=bool(self.hparams.pin_memory))

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
        float blob, compact masks -> ``masks_int32``; :func:`finalize_on_device`). Skips
        are counted before the transfer, when the loader hands the batch out."""
        if isinstance(batch, dict):
            # uint8 pixels -> Detectron's float blob; compact masks (mask_format="compact")
            # -> Detectron's class-specific masks_int32.
            finalize_on_device(batch, self.cfg.PIXEL_MEANS, int(self.cfg.MODEL.NUM_CLASSES),
                               image_sizes=_image_sizes(batch) if "data" in batch else None,
                               expand_compact_targets=getattr(self.hparams, "target_format",
                                                              "compact") != "compact_raw")
        return batch

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


def fork_safe_opencv() -> None:
    """Stop OpenCV's thread pool in this process before DataLoader workers fork.

    A worker forked while the parent's pool exists inherits its locks but not its
    threads, and its first call that uses the pool (or ``cv2.setNumThreads``) can wait
    forever.
    The parent's pool is started by any earlier multi-threaded OpenCV call (demo data
    generation, ``num_workers=0`` loading, the tools), so it is shut down here; the main
    process then runs OpenCV single-threaded, which costs nothing when workers decode.
    """
    import cv2

    if cv2.getNumThreads() != 1:
        cv2.setNumThreads(1)


def _image_sizes(batch: Mapping[str, Any]) -> Any:
    """``(n, 2)`` unpadded ``(h, w)`` of the images in ``batch["data"]``."""
    meta = batch.get("_meta") or {}
    if "image_sizes" in meta:
        return meta["image_sizes"]
    if "im_info" in batch:
        return batch["im_info"]
    n, _, h, w = batch["data"].shape
    return [[h, w]] * n


class EvalDataset(torch.utils.data.Dataset):
    """Evaluation batches: test-scale images, scaled proposals and what maps back to COCO.

    Detectron tests one unflipped image at ``TEST.SCALE`` / ``TEST.MAX_SIZE`` and feeds
    the first ``TEST.PROPOSAL_LIMIT`` proposals scaled to the input (its
    ``_get_rois_blob``). ``__getitems__(indices)`` returns ``data``, ``im_info``
    (``[round(H·s), round(W·s), s]``), ``rois`` (``(R, 5)``: batch index, scaled box;
    only with proposal files), FPN ``rois_fpn<l>`` / ``rois_idx_restore_int32`` when
    ``FPN.MULTILEVEL_ROIS`` is on, and ``_meta`` (``image_ids``, ``im_scales``,
    ``datasets``, ``heights``, ``widths``, ``image_sizes``, ``indices``).
    """

    def __init__(self, roidb: Any, cfg: DetectronConfig, *, pixel_format: str = "uint8",
                 with_rois: bool = False) -> None:
        self.roidb = roidb
        self.with_rois = bool(with_rois)
        self.pixel_format = pixel_format
        self.cfg = load_detectron_cfg(cfg, {"TRAIN.SCALES": (int(cfg.TEST.SCALE),),
                                            "TRAIN.MAX_SIZE": int(cfg.TEST.MAX_SIZE)})
        self.limit = int(cfg.TEST.PROPOSAL_LIMIT)

    def __len__(self) -> int:
        return len(self.roidb)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.__getitems__([index])

    def __getitems__(self, indices: Sequence[int]) -> dict[str, Any]:
        from lit_roidata.minibatch.image import build_image_blob

        entries = [self.roidb[int(i)] for i in indices]
        # One scale, so the generator draws nothing that matters.
        ib = build_image_blob(entries, self.cfg, np.random.default_rng(0),
                              pixel_format=self.pixel_format)
        out: dict[str, Any] = {"data": torch.from_numpy(ib.data),
                               "im_info": torch.from_numpy(ib.im_info)}
        rois = self._rois(entries, ib.im_scales)
        if rois is not None:
            blobs: dict[str, Any] = {"rois": rois}
            if self.cfg.FPN.FPN_ON and self.cfg.FPN.MULTILEVEL_ROIS:
                add_multilevel_rois(blobs, self.cfg, prefixes=("rois",))
            out.update({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in blobs.items()})
        out["_meta"] = {
            "image_ids": [int(e["id"]) for e in entries],
            "im_scales": [float(s) for s in ib.im_scales],
            "datasets": [self.roidb.dataset_of(int(i)) for i in indices],
            "heights": [int(e["height"]) for e in entries],
            "widths": [int(e["width"]) for e in entries],
            "image_sizes": torch.from_numpy(ib.image_sizes),
            "indices": [int(i) for i in indices],
        }
        return out

    def _rois(self, entries: Sequence[Mapping[str, Any]], scales: Sequence[float]
              ) -> Optional[np.ndarray]:
        """Proposal rows (``gt_classes == 0``), first ``TEST.PROPOSAL_LIMIT``, scaled."""
        if not self.with_rois:
            return None
        parts = [np.zeros((0, 5), np.float32)]
        for b, (entry, s) in enumerate(zip(entries, scales)):
            props = np.asarray(entry["boxes"], np.float32)[np.asarray(entry["gt_classes"]) == 0]
            if self.limit > 0:
                props = props[: self.limit]
            parts.append(rois_blob(props * np.float32(s), b))
        return np.concatenate(parts)


class EvalLoader:
    """This rank's evaluation batches: a contiguous shard of the roidb, in order.

    Shards differ by at most one image (no padding, no duplicates: COCO AP counts every
    image once). Like :class:`~lit_roidata.loader.StatefulRoIDataLoader` it wraps the
    ``DataLoader`` so Lightning never swaps in a ``DistributedSampler``, which would
    pad the shards with repeated images.
    """

    def __init__(self, roidb: Any, cfg: DetectronConfig, *, rank: int = 0, world_size: int = 1,
                 ims_per_batch: int = 1, pixel_format: str = "uint8", num_workers: int = 0,
                 pin_memory: bool = False, with_rois: bool = False) -> None:
        from lit_roidata.loader import passthrough_collate

        shard = np.array_split(np.arange(len(roidb)), world_size)[rank]
        self.batches = [shard[i:i + ims_per_batch].tolist()
                        for i in range(0, len(shard), ims_per_batch)]
        self.dataset = EvalDataset(roidb, cfg, pixel_format=pixel_format, with_rois=with_rois)
        self.num_workers = min(int(num_workers), len(self.batches))
        # A private generator: creating the iterator draws the workers' base seed, which
        # would otherwise come from (and advance) the global torch RNG, so a validation
        # would change the training that follows it.
        self._loader = torch.utils.data.DataLoader(
            self.dataset, batch_sampler=self.batches, collate_fn=passthrough_collate,
            num_workers=self.num_workers, pin_memory=pin_memory,
            generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Any:
        return iter(self._loader)
