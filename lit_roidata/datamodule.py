"""``RoIDataModule``: Detectron's training-data pipeline as a LightningDataModule.

This is the only place that knows the config's shape (style guide §2): it turns its
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
  Detectron's per-GPU minibatch, spec §7.4), workers building blobs
  (:class:`~lit_roidata.dataset.RoIBlockDataset`), wrapped in the checkpointable
  :class:`~lit_roidata.loader.StatefulRoIDataLoader`.
* ``val_dataloader`` / ``test_dataloader``: every evaluation image exactly once, in
  roidb order, unflipped, split across ranks without padding (see :mod:`.evalset`).
* ``on_after_batch_transfer``: uint8 images become Detectron's float blob (BGR minus
  ``PIXEL_MEANS``) on the device, 4× less host→device traffic than float32.
"""

from __future__ import annotations

import logging
from typing import Any, Literal, Mapping, Optional, Sequence

import pytorch_lightning as pl
import torch

from lit_roidata.config import DetectronConfig, load_detectron_cfg

__all__ = ["RoIDataModule", "ModelType"]

log = logging.getLogger(__name__)

ModelType = Literal["fast_rcnn", "faster_rcnn", "mask_rcnn", "keypoint_rcnn", "rpn_only",
                    "retinanet"]


class RoIDataModule(pl.LightningDataModule):
    """Detectron's combined roidb, batch sampler and minibatch blobs for Lightning.

    The config is assembled in this order, later entries winning: Detectron's
    defaults, the Detectron YAML file ``detectron_config``, the flags of
    ``model_type``, then ``overrides``. Dataset lists left empty fall back to the
    config's ``TRAIN.DATASETS`` / ``TEST.DATASETS`` (so a Detectron YAML file works
    unchanged), and, with ``demo_root``, to the demo datasets.

    Example::

        dm = RoIDataModule(train_datasets=["coco_2014_train"],
                           train_proposal_files=["rpn_proposals_train.pkl"],
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
        on_bad_image: ``"error"`` stops on an unreadable image naming it;
            ``"skip"`` replaces its block deterministically and counts it (reported
            at the end of each epoch).
        cache_dir: folder for the roidb caches (default: the roidb builder's).
        data_root: root under which the built-in COCO catalog names resolve
            (``<data_root>/coco/...``).
        demo_root: folder of the synthetic demo data; when set, ``prepare_data``
            generates it if missing and every process registers its datasets.
        infinite: Detectron's endless block stream (train with ``max_steps``) instead
            of epochs of ``len(loader)`` batches.
        fix_rpn_quirks: correct Detectron's RPN label quirks Q2/Q3 (spec §9).
        eval_ims_per_batch: images per validation/test batch (Detectron tests one).
        pin_memory: pin host memory of batches (faster copies to a GPU).
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
        on_bad_image: Literal["error", "skip"] = "error",
        cache_dir: Optional[str] = None,
        data_root: Optional[str] = None,
        demo_root: Optional[str] = None,
        infinite: bool = False,
        fix_rpn_quirks: bool = False,
        eval_ims_per_batch: int = 1,
        pin_memory: bool = False,
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
        self._skipped: dict[str, int] = {}

    # ------------------------------------------------------------------ config
    def _build_cfg(self) -> DetectronConfig:
        hp = self.hparams
        cfg = load_detectron_cfg(hp.detectron_config)
        if hp.model_type is not None:
            from lit_roidata.minibatch.model_type import flags_for_model_type

            cfg.merge_from_dict(flags_for_model_type(hp.model_type))
        if hp.overrides:
            cfg.merge_from_dict(dict(hp.overrides))
        return cfg

    def _datasets(self, split: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Dataset names and proposal files of ``split`` after the fallbacks."""
        hp, cfg = self.hparams, self.cfg
        if split == "test" and hp.test_datasets is None:
            split = "val"
            names, props = hp.val_datasets, hp.val_proposal_files
        else:
            names = getattr(hp, f"{split}_datasets")
            props = getattr(hp, f"{split}_proposal_files")
        if split == "test" and props is None and not names:
            props = hp.val_proposal_files
        section = cfg.TRAIN if split == "train" else None
        if not names:
            if split == "train":
                names, props = section.DATASETS, props or section.PROPOSAL_FILES
            else:
                names = cfg.TEST.get("DATASETS", ())
                props = props or cfg.TEST.get("PROPOSAL_FILES", ())
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
        """The dataset catalog: built-in names under ``data_root`` plus the demo's."""
        if self._catalog is None:
            from lit_roidata import catalog as catalog_mod

            cat = catalog_mod.DatasetCatalog
            if self.hparams.data_root is not None:
                cat = catalog_mod.builtin_catalog(self.hparams.data_root)
            if self.hparams.demo_root is not None:
                from lit_roidata.demo import register_demo_datasets

                self._demo = register_demo_datasets(self.hparams.demo_root, cat)
                cat = self._demo.catalog if self._demo.catalog is not None else cat
            self._catalog = cat
        return self._catalog

    # --------------------------------------------------------------- lifecycle
    def prepare_data(self) -> None:
        """Generate the demo data (if ``demo_root``) and build the roidb caches.

        Runs once per node; sets no state (the roidbs are dropped, only the cache
        files stay). Every process opens them again in :meth:`setup`.
        """
        from lit_roidata.roidb import combined_roidb_for_training, roidb_for_evaluation

        if self.hparams.demo_root is not None:
            from lit_roidata.demo import ensure_demo_data

            ensure_demo_data(self.hparams.demo_root)
        catalog = self.catalog()  # identical in every process: setup() builds it too
        names, props = self._datasets("train")
        if names:
            combined_roidb_for_training(list(names), list(props), self.cfg,
                                        cache_dir=self.hparams.cache_dir, catalog=catalog)
        for split in ("val", "test"):
            names, props = self._datasets(split)
            if names:
                roidb_for_evaluation(list(names), self.cfg, cache_dir=self.hparams.cache_dir,
                                     proposal_files=list(props), catalog=catalog)

    def setup(self, stage: Optional[str] = None) -> None:
        """Open the cached roidbs read-only for ``stage`` (every process)."""
        from lit_roidata.roidb import combined_roidb_for_training, roidb_for_evaluation

        catalog = self.catalog()
        cache_dir = self.hparams.cache_dir
        if stage in (None, "fit") and self.train_roidb is None:
            names, props = self._datasets("train")
            if not names:
                raise ValueError("no training datasets: set data.train_datasets (or "
                                 "TRAIN.DATASETS in the Detectron config, or demo_root)")
            self.train_roidb = combined_roidb_for_training(
                list(names), list(props), self.cfg, cache_dir=cache_dir, catalog=catalog)
        if stage in (None, "fit", "validate") and self.val_roidb is None:
            names, props = self._datasets("val")
            if names:
                self.val_roidb = roidb_for_evaluation(
                    list(names), self.cfg, cache_dir=cache_dir, proposal_files=list(props),
                    catalog=catalog)
        if stage in (None, "test") and self.test_roidb is None:
            names, props = self._datasets("test")
            if names:
                self.test_roidb = roidb_for_evaluation(
                    list(names), self.cfg, cache_dir=cache_dir, proposal_files=list(props),
                    catalog=catalog)
