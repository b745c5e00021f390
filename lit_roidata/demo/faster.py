"""``DemoFasterRCNN``: the demo detector trained end to end from the loader's RPN targets.

As in Detectron, the loader's wide RPN blobs are cropped to the feature map, proposals are
generated in the network and the second-stage blobs come from
:func:`lit_roidata.minibatch.proposal_labels`; body, RoI head, losses and inference are
:class:`DemoFastRCNN`'s.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from lit_roidata.minibatch import proposal_labels
from lit_roidata.minibatch.anchors import generate_anchors
from lit_roidata.demo.model import (BBOX_XFORM_CLIP, DemoFastRCNN, data_cfg, fast_rcnn_losses,
                                    rpn_proposals, smooth_l1_loss)

__all__ = ["DemoFasterRCNN"]

_STRIDE = 8  # the demo body's stride, so RPN.STRIDE must be 8


class DemoFasterRCNN(DemoFastRCNN):
    """End-to-end Faster R-CNN on the demo body: RPN targets in, detections out.

    Data config: ``model_type: faster_rcnn`` with ``RPN.STRIDE: 8`` and ``RPN.SIZES`` /
    ``RPN.ASPECT_RATIOS`` equal to ``rpn_sizes`` / ``rpn_aspect_ratios`` (checked in
    ``setup`` against the data module's config), and no proposal files.

    Args:
        rpn_sizes: anchor sizes in input pixels (``RPN.SIZES``).
        rpn_aspect_ratios: anchor ratios h/w (``RPN.ASPECT_RATIOS``).
        pre_nms_top_n / post_nms_top_n: proposals per image before/after NMS, training
            (``TRAIN.RPN_PRE/POST_NMS_TOP_N``).
        test_pre_nms_top_n / test_post_nms_top_n: the same at test time.
        rpn_nms_thresh: ``RPN_NMS_THRESH``.
        rpn_min_size: ``RPN_MIN_SIZE`` in original-image pixels.
        sample_seed: seed of the second-stage RoI sampling (with rank and step).
        **kwargs: :class:`DemoFastRCNN`'s arguments (``num_classes``, ``lr``, ...).
    """

    def __init__(self, rpn_sizes: Sequence[float] = (32.0, 64.0, 128.0),
                 rpn_aspect_ratios: Sequence[float] = (0.5, 1.0, 2.0),
                 pre_nms_top_n: int = 2000, post_nms_top_n: int = 300,
                 test_pre_nms_top_n: int = 1000, test_post_nms_top_n: int = 150,
                 rpn_nms_thresh: float = 0.7, rpn_min_size: float = 0.0,
                 sample_seed: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.save_hyperparameters()
        cell = generate_anchors(stride=_STRIDE, sizes=tuple(rpn_sizes),
                                aspect_ratios=tuple(rpn_aspect_ratios))
        self.register_buffer("cell_anchors", torch.tensor(cell, dtype=torch.float32),
                             persistent=False)
        a, dim = len(cell), 4 * self.hparams.backbone_width
        self.rpn_conv = nn.Conv2d(dim, dim, 3, 1, 1)
        self.rpn_cls = nn.Conv2d(dim, a, 1)
        self.rpn_bbox = nn.Conv2d(dim, 4 * a, 1)
        for m in (self.rpn_conv, self.rpn_cls, self.rpn_bbox):
            nn.init.normal_(m.weight, std=0.01)
            nn.init.zeros_(m.bias)
        self._cfg: Any = None

    def setup(self, stage: str) -> None:
        super().setup(stage)
        self._cfg = self._data_cfg()

    def _data_cfg(self) -> Any:
        """The data module's Detectron config (checked), else defaults with our values."""
        hp = self.hparams

        def anchors(stride: Any, sizes: Sequence, ratios: Sequence) -> dict[str, Any]:
            return {"RPN.STRIDE": stride, "RPN.SIZES": tuple(map(float, sizes)),
                    "RPN.ASPECT_RATIOS": tuple(map(float, ratios))}

        want = anchors(_STRIDE, hp.rpn_sizes, hp.rpn_aspect_ratios)
        cfg = data_cfg(getattr(self, "_trainer", None), {
            "MODEL.NUM_CLASSES": hp.num_classes,
            "MODEL.BBOX_REG_WEIGHTS": tuple(hp.bbox_reg_weights), **want})
        have = anchors(cfg.RPN.STRIDE, cfg.RPN.SIZES, cfg.RPN.ASPECT_RATIOS)
        bad = [f"{k} is {have[k]} in the data config but the model needs {v}"
               for k, v in want.items() if have[k] != v]
        if bad:
            raise ValueError("the data's RPN anchors do not match DemoFasterRCNN: "
                             + ", ".join(bad) + "; set data.overrides accordingly")
        return cfg

    def rpn(self, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Objectness logits ``(N, A, H, W)`` and deltas ``(N, 4A, H, W)``."""
        h = F.relu(self.rpn_conv(feats))
        return self.rpn_cls(h), self.rpn_bbox(h)

    def _anchors(self, hf: int, wf: int) -> torch.Tensor:
        """``(hf*wf*A, 4)`` anchors, enumerated (y, x, a) like the field of anchors."""
        yy, xx = torch.meshgrid(*(torch.arange(n, device=self.device, dtype=torch.float32) * _STRIDE
                                  for n in (hf, wf)), indexing="ij")
        shifts = torch.stack([xx, yy, xx, yy], -1).reshape(-1, 1, 4)
        return (shifts + self.cell_anchors.view(1, -1, 4)).reshape(-1, 4)

    @torch.no_grad()
    def proposals(self, logits: torch.Tensor, deltas: torch.Tensor, im_info: Any, *,
                  training: bool) -> torch.Tensor:
        """Detectron's ``GenerateProposals`` per image: ``(R, 5)`` rois in the input frame."""
        hp = self.hparams
        pre = hp.pre_nms_top_n if training else hp.test_pre_nms_top_n
        post = hp.post_nms_top_n if training else hp.test_post_nms_top_n
        info = torch.as_tensor(im_info, dtype=torch.float32).reshape(-1, 3).tolist()
        found = rpn_proposals(self._anchors(*logits.shape[2:]), logits.sigmoid(), deltas, info,
                              pre=pre, post=post, nms_thresh=hp.rpn_nms_thresh,
                              min_size=hp.rpn_min_size, clip=BBOX_XFORM_CLIP)
        out = [torch.cat([b.new_full((len(b), 1), float(i)), b], 1)
               for i, (b, _) in enumerate(found)]
        return torch.cat(out) if out else logits.new_zeros((0, 5))

    def rpn_losses(self, logits: torch.Tensor, deltas: torch.Tensor,
                   batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """Sigmoid CE over non-ignored anchors and smooth L1 (beta 1/9) / images (Detectron
        semantics: RPN targets)."""
        n, _, hf, wf = logits.shape
        names = ("rpn_labels_int32_wide", "rpn_bbox_targets_wide",
                 "rpn_bbox_inside_weights_wide", "rpn_bbox_outside_weights_wide")
        if missing := [k for k in names + ("im_info", "roidb") if k not in batch]:
            raise KeyError(f"DemoFasterRCNN needs the single-level RPN blobs (Detectron semantics"
                           f": blob names); the batch lacks {missing}. Use model_type faster_rcnn "
                           f"with FPN off.")
        field = int(np.shape(batch[names[0]])[-1])
        if hf > field or wf > field:
            raise ValueError(f"feature map {hf}x{wf} exceeds the {field}x{field} field of "
                             f"anchors: TRAIN.MAX_SIZE is smaller than the images")
        # SpatialNarrowAs: the wide blobs cropped to the feature map
        wide = [torch.as_tensor(batch[k], device=self.device).float()[:, :, :hf, :wf]
                for k in names]
        labels, valid = wide[0], wide[0] >= 0
        loss_cls = F.binary_cross_entropy_with_logits(
            logits[valid], labels[valid].float(), reduction="sum") / valid.sum().clamp(min=1)
        loss_bbox = smooth_l1_loss(deltas, *wide[1:], beta=1.0 / 9.0, normalizer=n)
        return {"loss_rpn_cls": loss_cls, "loss_rpn_bbox": loss_bbox}

    def compute_losses(self, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """RPN losses, in-network proposals, second-stage labels and Fast R-CNN losses."""
        feats = self.features(batch["data"])
        logits, deltas = self.rpn(feats)
        out = self.rpn_losses(logits, deltas, batch)
        rois = self.proposals(logits.detach(), deltas.detach(), batch["im_info"], training=True)
        cfg = self._cfg if self._cfg is not None else self._data_cfg()
        step = int(getattr(getattr(self, "_trainer", None), "global_step", 0) or 0)
        rank = int(getattr(getattr(self, "_trainer", None), "global_rank", 0) or 0)
        rng = np.random.default_rng([self.hparams.sample_seed, rank, step])
        im_scales = torch.as_tensor(batch["im_info"]).reshape(-1, 3)[:, 2].cpu()
        blobs = proposal_labels(rois, batch["roidb"], im_scales, cfg, rng)
        cls_logits, bbox_pred = self.box_head(feats, blobs["rois"])
        out.update(fast_rcnn_losses(cls_logits, bbox_pred, {k: v.float() if k != "labels_int32"
                                                             else v for k, v in blobs.items()}))
        out["loss"] = (out["loss_rpn_cls"] + out["loss_rpn_bbox"] + out["loss_cls"]
                       + out["loss_bbox"])
        return out

    @torch.no_grad()
    def detect(self, batch: Mapping[str, Any]) -> list[dict[str, Any]]:
        """RPN proposals (test settings), then :meth:`DemoFastRCNN.detections_for`."""
        feats = self.features(batch["data"])
        logits, deltas = self.rpn(feats)
        rois = self.proposals(logits, deltas, batch["im_info"], training=False)
        return self.detections_for(feats, rois, batch["_meta"])
