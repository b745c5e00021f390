"""``RoIDataModule``: Detectron's training-data pipeline as a LightningDataModule.

Only the Lightning face: grouped options (:mod:`lit_roidata.options`) become a frozen
Detectron config and a catalog; ``prepare_data`` builds the roidb caches, ``setup`` opens
them, the loaders come from :mod:`lit_roidata.loader` (the train loader owns the stream
position) and ``on_after_batch_transfer`` finishes compact blobs on the device.
"""

from __future__ import annotations

import logging
from typing import Any, Literal, Mapping, Optional, Sequence

import pytorch_lightning as pl
import torch

from lit_roidata.config import DetectronConfig
from lit_roidata.loader import build_eval_loader, build_train_dataset, build_train_loader
from lit_roidata.loader import build_train_sampler
from lit_roidata.minibatch.device import finish_batch
from lit_roidata.minibatch.model_type import MODEL_TYPES
from lit_roidata.options import (AugmentOptions, DatasetOptions, LoaderOptions, OutputOptions,
                                 SamplingOptions, SourceOptions, as_options, detectron_cfg,
                                 refuse_unknown, to_plain)

__all__ = ["RoIDataModule", "ModelType"]

log = logging.getLogger(__name__)

#: ``fast_rcnn``, ``faster_rcnn``, ``mask_rcnn``, ``keypoint_rcnn``, ``rpn_only``,
#: ``retinanet``, ``*_proposals`` and ``*_fpn`` variants (:mod:`.minibatch.model_type`).
ModelType = Literal[MODEL_TYPES]  # type: ignore[valid-type]

class RoIDataModule(pl.LightningDataModule):
    """Detectron's combined roidb, batch sampler and minibatch blobs for Lightning.

    For ``pytorch_lightning``; ``lit_roidata.lightning.RoIDataModule`` is the same class
    for ``lightning.pytorch``. The config: Detectron's defaults, ``detectron_config``,
    ``model_type``'s flags, ``overrides``, then the options that name a Detectron key
    (:func:`~lit_roidata.options.detectron_cfg`). Empty dataset lists fall back to the
    config's ``TRAIN.DATASETS`` / ``TEST.DATASETS``. The option groups
    (:mod:`lit_roidata.options`) are dataclasses or dicts of their fields.

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
            (:class:`~lit_roidata.options.SourceOptions`). With
            ``on_bad_image="skip"`` the trainer needs the
            :class:`~lit_roidata.callbacks.BadImageReport` callback.
        loader: workers, images per batch, pinning and prefetching
            (:class:`~lit_roidata.options.LoaderOptions`).
        output: the batch format (:class:`~lit_roidata.options.OutputOptions`).
        sampling: seed, RNG mode, aspect grouping, endless stream and resume checks
            (:class:`~lit_roidata.options.SamplingOptions`).
        augment: an albumentations pipeline for the training images, or ``None``
            (Detectron's blobs exactly; :class:`~lit_roidata.options.AugmentOptions`).

    Raises:
        TypeError: an unknown keyword or option (naming the valid ones; a flat option
            name such as ``num_workers`` names its nested key).
        ValueError: an option out of range, or an option and ``overrides`` setting the
            same Detectron key to different values.
    """

    def __init__(self, detectron_config: Optional[str] = None,
                 overrides: Optional[dict[str, Any]] = None, model_type: Optional[ModelType] = None,
                 datasets: DatasetOptions = DatasetOptions(),
                 sources: SourceOptions = SourceOptions(), loader: LoaderOptions = LoaderOptions(),
                 output: OutputOptions = OutputOptions(),
                 sampling: SamplingOptions = SamplingOptions(),
                 augment: Optional[AugmentOptions] = None, **unknown: Any) -> None:
        super().__init__()
        refuse_unknown(type(self).__name__, unknown)
        self.datasets: DatasetOptions = as_options(DatasetOptions, datasets, "datasets")
        self.sources: SourceOptions = as_options(SourceOptions, sources, "sources")
        self.loader: LoaderOptions = as_options(LoaderOptions, loader, "loader")
        self.output: OutputOptions = as_options(OutputOptions, output, "output")
        self.sampling: SamplingOptions = as_options(SamplingOptions, sampling, "sampling")
        self.augment: Optional[AugmentOptions] = (
            None if augment is None else as_options(AugmentOptions, augment, "augment"))
        self.detectron_config, self.model_type = detectron_config, model_type
        self.overrides = dict(overrides) if overrides else None
        self.save_hyperparameters(to_plain(dict(
            detectron_config=detectron_config, overrides=self.overrides, model_type=model_type,
            datasets=self.datasets, sources=self.sources, loader=self.loader,
            output=self.output, sampling=self.sampling, augment=self.augment)))
        self.cfg: DetectronConfig = detectron_cfg(detectron_config, model_type, self.overrides,
                                                  self.loader, self.sampling)
        s = self.sampling.seed
        self.seed: int = int(self.cfg.RNG_SEED if s is None else s)
        self.train_roidb: Any = None
        self.val_roidb: Any = None
        self.test_roidb: Any = None
        self._catalog: Any = None
        self._train_loader: Any = None  # the loader of the running fit (a reload continues it)
        self._restored_stream: Any = None  # the train loader's state from a checkpoint

    # ------------------------------------------------------------------ datasets
    def _datasets(self, split: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Dataset names and proposal files of ``split`` after the fallbacks: the
        options, the Detectron config, then :meth:`default_datasets`."""
        self.catalog()  # registers this module's datasets, if any
        ds, section = self.datasets, self.cfg.TRAIN if split == "train" else self.cfg.TEST
        if split == "test" and ds.test is None:
            split = "val"
        names, props = getattr(ds, split), getattr(ds, f"{split}_proposal_files")
        if not names:
            names, props = section.DATASETS, props or section.PROPOSAL_FILES
        if not names:
            names, default_props = self.default_datasets(split)
            props = props or default_props
        names, props = tuple(names or ()), tuple(props or ())
        if props and len(props) != len(names):
            raise ValueError(
                f"data.datasets.{split}_proposal_files has {len(props)} file(s) for "
                f"{len(names)} dataset(s) {list(names)}; give one proposal file per dataset "
                f"or none")
        return names, props

    def default_datasets(self, split: str) -> tuple[Sequence[str], Sequence[str]]:
        """Hook: dataset names and proposal files of ``split`` (``"train"`` or ``"val"``)
        when neither the options nor the Detectron config name any (none here)."""
        return (), ()

    def catalog(self) -> Any:
        """This module's dataset catalog (built once per process): a copy of the
        process-wide :data:`lit_roidata.catalog.DatasetCatalog` with the built-in names
        under ``sources.data_root``, the ``sources.dataset_catalog`` YAML file, and what
        :meth:`register_datasets` adds."""
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
        """Hook: register more datasets in ``catalog`` (once per process; none here)."""

    def _open(self, split: str) -> Any:
        """The cached roidb of ``split`` (built if missing), or None without datasets."""
        from lit_roidata.roidb import combined_roidb_for_training, roidb_for_evaluation
        from lit_roidata.roidb.build import check_training_config

        names, props = self._datasets(split)
        if not names:
            return None
        src = self.sources
        kw = dict(cache_dir=src.cache_dir, trust_pickle=src.trust_pickle, catalog=self.catalog(),
                  category_policy=src.category_policy, check_images=src.check_images)
        if split != "train":
            return roidb_for_evaluation(list(names), self.cfg, proposal_files=list(props), **kw)
        check_training_config(self.cfg, list(props), list(names))  # before any build
        return combined_roidb_for_training(list(names), list(props), self.cfg, **kw)

    # --------------------------------------------------------------- lifecycle
    def prepare_data(self) -> None:
        """Register the datasets and build the roidb caches (once per node; no state:
        every process opens the caches in :meth:`setup`)."""
        for split in ("train", "val", "test"):
            self._open(split)

    def setup(self, stage: Optional[str] = None) -> None:
        """Open the cached roidbs read-only for ``stage`` (every process)."""
        if stage in (None, "fit"):
            # a new fit: its first loader starts afresh (a checkpoint's is restored after setup)
            self._train_loader = self._restored_stream = None
            if self.train_roidb is None:
                self.train_roidb = self._open("train")
                if self.train_roidb is None:
                    raise ValueError("no training datasets: set data.datasets.train (or "
                                     "TRAIN.DATASETS in the Detectron config, or use "
                                     "lit_roidata.DemoRoIDataModule for the demo data)")
        if stage in (None, "fit", "validate") and self.val_roidb is None:
            self.val_roidb = self._open("val")
        if stage in (None, "test", "predict") and self.test_roidb is None:
            self.test_roidb = self._open("test")

    # ------------------------------------------------------------ dataloaders
    def _rank_world(self) -> tuple[int, int]:
        t = self.trainer
        return (0, 1) if t is None else (int(t.global_rank), int(t.world_size))

    def make_sampler(self, roidb: Any = None, **kw: Any) -> Any:
        """:func:`~lit_roidata.loader.build_train_sampler` with this module's options
        (``roidb`` defaults to the training roidb; ``kw`` overrides, e.g. ``rank``)."""
        rank, world = self._rank_world()
        reserve = self.sources.bad_image_reserve if self.sources.on_bad_image == "skip" else 0
        kw = {"seed": self.seed, "rank": rank, "world_size": world,
              "infinite": bool(self.sampling.infinite), "bad_image_reserve": float(reserve), **kw}
        return build_train_sampler(self.cfg, self.train_roidb if roidb is None else roidb, **kw)

    def make_dataset(self, roidb: Any = None, sampler: Any = None, **kw: Any) -> Any:
        """:func:`~lit_roidata.loader.build_train_dataset` with this module's options
        (``kw`` overrides, e.g. ``pixel_format``)."""
        out = self.output
        kw = {"output_format": out.output_format, "pixel_format": out.pixel_format,
              "rng_mode": self.sampling.rng_mode, "augment": self.make_augmentation(),
              "fix_rpn_quirks": bool(out.fix_rpn_quirks), "mask_format": out.mask_format,
              "target_format": "detectron" if out.target_format == "detectron" else "compact",
              **kw}
        return build_train_dataset(self.cfg, self.train_roidb if roidb is None else roidb,
                                   sampler, on_bad_image=self.sources.on_bad_image, **kw)

    def make_augmentation(self) -> Any:
        """The training images' :class:`~lit_roidata.minibatch.augment.Augmentation`
        (None without ``augment``)."""
        return None if self.augment is None else self.augment.pipeline(self.cfg)

    def train_dataloader(self) -> Any:
        """This rank's checkpointable train loader. Called again in the same fit
        (``reload_dataloaders_every_n_epochs``), the new loader continues the stream
        where the previous one is (with its skip state)."""
        if self.train_roidb is None:
            self.setup("fit")
        from lit_roidata.loader_callbacks import check_trainer_for_loader, fit_epochs_to_passes

        trainer = self.trainer
        sampler = self.make_sampler()
        check_trainer_for_loader(trainer, sampler, self.sources.on_bad_image == "skip")
        ld = self.loader
        loader = build_train_loader(
            self.cfg, self.train_roidb, sampler=sampler, dataset=self.make_dataset(sampler=sampler),
            on_bad_image=self.sources.on_bad_image, num_workers=int(ld.num_workers),
            pin_memory=self.pin_memory(), persistent_workers=bool(ld.persistent_workers),
            prefetch_factor=ld.prefetch_factor, shm_pool=bool(ld.shm_pool),
            read_ahead=int(ld.read_ahead), strict_resume=bool(self.sampling.strict_resume),
            epoch_length=self.sampling.epoch_length,
            optimizer_steps=None if trainer is None else (lambda: trainer.global_step))
        previous, self._train_loader = self._train_loader, loader
        if previous is not None:
            loader.load_state_dict(previous.state_dict())
            previous.close()
        elif self._restored_stream is not None:  # before Lightning asks for len()
            loader.load_state_dict(self._restored_stream)
            self._restored_stream = None
            fit_epochs_to_passes(trainer, loader)
        return loader

    def pin_memory(self) -> bool:
        """``loader.pin_memory``, or when unset whether the trainer's device is a CUDA GPU."""
        if self.loader.pin_memory is not None:
            return bool(self.loader.pin_memory)
        trainer = self.trainer
        return trainer is not None and trainer.strategy.root_device.type == "cuda"

    def _eval_loader(self, split: str, stage: str) -> Any:
        if getattr(self, f"{split}_roidb") is None:
            self.setup(stage)
        rank, world = self._rank_world()
        ld = self.loader
        return build_eval_loader(
            self.cfg, getattr(self, f"{split}_roidb"), rank=rank, world_size=world,
            ims_per_batch=int(ld.eval_ims_per_batch), pixel_format=self.output.pixel_format,
            with_rois=bool(self._datasets(split)[1]), num_workers=int(ld.num_workers),
            pin_memory=self.pin_memory(), persistent_workers=bool(ld.persistent_workers),
            prefetch_factor=ld.prefetch_factor)

    def val_dataloader(self) -> Any:
        """Every validation image once, in roidb order, unflipped, sharded by rank."""
        return self._eval_loader("val", "validate")

    def test_dataloader(self) -> Any:
        """Every test image once, in roidb order, unflipped, sharded by rank."""
        return self._eval_loader("test", "test")

    def predict_dataloader(self) -> Any:
        """The test images (every one once, in order): ``test_dataloader``'s batches."""
        return self.test_dataloader()

    # ------------------------------------------------------------------- device
    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Finish the worker's compact blobs on the device
        (:func:`~lit_roidata.minibatch.device.finish_batch`)."""
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

    def teardown(self, stage: str) -> None:
        """Stop the train loader's workers at the end of ``fit``."""
        if stage == "fit" and self._train_loader is not None:
            self._train_loader.close()
            self._train_loader = None

    # -------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """The stream seed, ``trainer_fn`` (``"fit"``, ...: what was running) and the train
        loader's state (position, skip policy), so that a resumed train loader is at its
        position before Lightning asks for its length."""
        fn = None if self.trainer is None else self.trainer.state.fn
        state = {"seed": self.seed, "trainer_fn": getattr(fn, "value", fn)}
        if self._train_loader is not None:
            state["train_loader"] = self._train_loader.state_dict()
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Keep the train loader's state for the next train loader; warn when the
        checkpoint's seed differs (the loader refuses its position)."""
        if state_dict.get("seed", self.seed) != self.seed:
            log.warning("data: the checkpoint's stream seed is %s, this module's %s",
                        state_dict["seed"], self.seed)
        self._restored_stream = state_dict.get("train_loader")

