"""``DemoRoIDataModule``: :class:`~lit_roidata.RoIDataModule` on the generated demo data."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from lit_roidata.datamodule import RoIDataModule

__all__ = ["DemoRoIDataModule"]


class DemoRoIDataModule(RoIDataModule):
    """:class:`~lit_roidata.RoIDataModule` over the synthetic demo datasets.

    ``prepare_data`` generates the demo data under ``demo_root`` if it is missing
    (file-locked, idempotent: two training sets, a validation set, proposal files,
    crowd regions and person keypoints; see docs/demo.md), and every process registers
    its dataset names. Dataset lists left empty (``datasets.*`` and the Detectron
    config's ``TRAIN.DATASETS`` / ``TEST.DATASETS``) become the demo's:
    ``[demo_train_a, demo_train_b]`` for training and ``[demo_val]`` for evaluation,
    with their proposal files. Every other argument is :class:`RoIDataModule`'s.

    Example::

        dm = DemoRoIDataModule(demo_root="demo_data", model_type="fast_rcnn",
                               overrides={"MODEL.NUM_CLASSES": 5}, loader={"num_workers": 0})

    Args:
        demo_root: folder of the demo data (created on first use).
        demo_size: images per demo dataset, e.g. ``{"demo_train_a": 40}`` (default
            200 / 100 / 60 for ``demo_train_a`` / ``demo_train_b`` / ``demo_val``).
        **kwargs: :class:`RoIDataModule`'s arguments.
    """

    def __init__(self, demo_root: str = "demo_data", demo_size: Optional[dict[str, int]] = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.demo_root, self.demo_size = str(demo_root), dict(demo_size) if demo_size else None
        self.save_hyperparameters(dict(self.hparams, demo_root=self.demo_root,
                                       demo_size=self.demo_size))

    def register_datasets(self, catalog: Any) -> None:
        """Generate the demo data if missing and register its names in ``catalog``."""
        from lit_roidata.demo.data import register_demo_datasets

        self._demo = register_demo_datasets(self.demo_root, catalog, num_images=self.demo_size)

    def default_datasets(self, split: str) -> tuple[Sequence[str], Sequence[str]]:
        """The demo's datasets and proposal files (training or validation)."""
        d = self._demo
        return ((d.train_datasets, d.train_proposal_files) if split == "train"
                else (d.val_datasets, d.val_proposal_files))
