"""``DemoFastRCNN``: a small Fast R-CNN that consumes this package's Detectron blobs, with
Detectron's losses and test path (docs/demo.md)."""

from __future__ import annotations

import functools
import math
from typing import Any, Literal, Mapping, Optional, Sequence

import numpy as np
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torchvision.ops import batched_nms, nms, roi_align

from lit_roidata.config import get_cfg
from lit_roidata.boxes import bbox_transform_inv, bbox_transform_inv_torch, clip_boxes
from lit_roidata.models.detector import DETECTRON_PIXEL_MEANS, detectron_lr_multiplier

__all__ = ["DemoFastRCNN", "fast_rcnn_losses", "smooth_l1_loss"]

#: Detectron clamps dw, dh before exp() so a wild prediction cannot overflow.
BBOX_XFORM_CLIP = math.log(1000.0 / 16.0)
_PLUS_ONE = torch.tensor([0.0, 0.0, 1.0, 1.0])


def smooth_l1_loss(pred: torch.Tensor, target: torch.Tensor, inside_w: torch.Tensor,
                   outside_w: torch.Tensor, *, beta: float = 1.0,
                   normalizer: float | None = None) -> torch.Tensor:
    """Detectron's ``SmoothL1Loss`` op: ``sum(out * huber(in * (pred - target))) / N`` on
    ``(N, 4C)`` tensors; ``beta``: the quadratic part's end; ``normalizer``: ``N`` by default.
    """
    diff = inside_w * (pred - target)
    ad = diff.abs()
    loss = torch.where(ad < beta, 0.5 * diff * diff / beta, ad - 0.5 * beta)
    n = pred.shape[0] if normalizer is None else normalizer
    return (outside_w * loss).sum() / max(n, 1)


def fast_rcnn_losses(cls_logits: torch.Tensor, bbox_pred: torch.Tensor,
                     blobs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detectron's Fast R-CNN head losses from Detectron semantics: Fast R-CNN targets blobs.

    Returns:
        ``loss_cls`` (mean softmax cross-entropy), ``loss_bbox`` (smooth L1, inside and
        outside weights, divided by the number of RoIs) and ``accuracy_cls``.
    """
    labels = blobs["labels_int32"].long()
    return {"loss_cls": F.cross_entropy(cls_logits, labels),
            "loss_bbox": smooth_l1_loss(bbox_pred, blobs["bbox_targets"],
                                        blobs["bbox_inside_weights"],
                                        blobs["bbox_outside_weights"]),
            "accuracy_cls": (cls_logits.argmax(1) == labels).float().mean().detach()}


def rpn_proposals(anchors: torch.Tensor, probs: torch.Tensor, deltas: torch.Tensor,
                  im_info: Sequence[Sequence[float]], *, pre: int, post: int, nms_thresh: float,
                  min_size: float, clip: float, centred_inside: bool = False
                  ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Detectron's ``GenerateProposals`` on one level: per image ``(boxes, scores)``.

    ``probs`` ``(N, A, H, W)``, ``deltas`` ``(N, 4A, H, W)``, ``anchors`` enumerated (y, x,
    a), ``im_info`` rows ``(h, w, scale)``; ``centred_inside`` also drops boxes centred
    outside the image."""
    n, a, hf, wf = probs.shape
    scores = probs.permute(0, 2, 3, 1).reshape(n, -1).float()
    d = deltas.view(n, a, 4, hf, wf).permute(0, 3, 4, 1, 2).reshape(n, -1, 4).float()
    out = []
    for i, (h, w, s) in enumerate(im_info):
        order = scores[i].argsort(descending=True)[:pre]
        boxes = bbox_transform_inv_torch(anchors[order], d[i, order], clip=clip)
        boxes[:, 0::2] = boxes[:, 0::2].clamp(0, w - 1)
        boxes[:, 1::2] = boxes[:, 1::2].clamp(0, h - 1)
        bw, bh = boxes[:, 2] - boxes[:, 0] + 1, boxes[:, 3] - boxes[:, 1] + 1
        keep = (bw >= max(min_size * s, 1.0)) & (bh >= max(min_size * s, 1.0))
        if centred_inside:
            keep &= (boxes[:, 0] + bw / 2 < w) & (boxes[:, 1] + bh / 2 < h)
        boxes, sc = boxes[keep], scores[i, order][keep]
        # +1 on x2, y2: torchvision's NMS measures areas without Detectron's +1.
        keep = nms(boxes + _PLUS_ONE.to(boxes), sc, nms_thresh)[:post]
        out.append((boxes[keep], sc[keep]))
    return out


def data_cfg(trainer: Optional[pl.Trainer], defaults: Mapping[str, Any]) -> Any:
    """The Detectron config of ``trainer``'s data module, else the default config with
    ``defaults`` merged."""
    if (cfg := getattr(getattr(trainer, "datamodule", None), "cfg", None)) is None:
        cfg = get_cfg()
        cfg.merge_from_dict(dict(defaults))
    return cfg


def _conv(cin: int, cout: int, stride: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False),
                         nn.GroupNorm(min(8, cout // 4), cout), nn.ReLU(inplace=True))


class DemoFastRCNN(pl.LightningModule):
    """A small Fast R-CNN (conv body, RoIAlign, 2-layer MLP head) on Detectron blobs.

    Trains on the Fast R-CNN blobs (``data``, ``rois``, ``labels_int32``, ``bbox_*``);
    ``validation_step`` returns ``{"detections": [...]}`` for
    :class:`lit_roidata.evaluation.COCOEvaluator`.

    Args:
        num_classes: classes including background (``MODEL.NUM_CLASSES``).
        lr: base learning rate (``SOLVER.BASE_LR``).
        optimizer: ``"sgd"`` (momentum 0.9, as Detectron) or ``"adamw"``.
        weight_decay: L2 weight decay (``SOLVER.WEIGHT_DECAY``).
        warmup_iters: linear warm-up steps starting at ``warmup_factor · lr``.
        warmup_factor: first warm-up multiplier (``SOLVER.WARMUP.WARMUP_FACTOR``).
        lr_steps: steps at which the lr is multiplied by ``gamma`` (``SOLVER.STEPS``).
        gamma: step decay factor.
        backbone_width: channels of the first conv stage (doubled twice).
        head_dim: width of the two fully connected layers (``FAST_RCNN.MLP_HEAD_DIM``).
        roi_resolution: RoIAlign output size (``FAST_RCNN.ROI_XFORM_RESOLUTION``).
        sampling_ratio: RoIAlign samples per bin (``FAST_RCNN.ROI_XFORM_SAMPLING_RATIO``).
        bbox_reg_weights: ``MODEL.BBOX_REG_WEIGHTS`` used to decode box deltas.
        cls_agnostic_bbox_reg: one box regressor for all foreground classes (2 columns).
        score_thresh: ``TEST.SCORE_THRESH``.
        nms_thresh: ``TEST.NMS``.
        detections_per_im: ``TEST.DETECTIONS_PER_IM``.
        pixel_means: BGR means, used only if ``data`` arrives as uint8.
        cpu_threads: intra-op threads (``torch.set_num_threads``) set in ``setup`` when
            the model runs on the CPU; ``None`` keeps PyTorch's choice. This model's
            tensors are tiny, and the loader's workers share the cores: with one thread
            the demo trains about 3x faster on 2 cores than with two.
    """

    def __init__(self, num_classes: int = 5, lr: float = 0.01,
                 optimizer: Literal["sgd", "adamw"] = "sgd", weight_decay: float = 1e-4,
                 warmup_iters: int = 50, warmup_factor: float = 1.0 / 3.0,
                 lr_steps: Sequence[int] = (), gamma: float = 0.1, backbone_width: int = 16,
                 head_dim: int = 256, roi_resolution: int = 7, sampling_ratio: int = 2,
                 bbox_reg_weights: tuple[float, float, float, float] = (10.0, 10.0, 5.0, 5.0),
                 cls_agnostic_bbox_reg: bool = False, score_thresh: float = 0.05,
                 nms_thresh: float = 0.5, detections_per_im: int = 100,
                 pixel_means: tuple[float, float, float] = DETECTRON_PIXEL_MEANS,
                 cpu_threads: Optional[int] = 1) -> None:
        super().__init__()
        if num_classes < 2:
            raise ValueError(f"num_classes={num_classes}: need background plus >= 1 class "
                             f"(MODEL.NUM_CLASSES counts the background)")
        self.save_hyperparameters()
        w = backbone_width
        # Stride 8: the demo's objects are 20-110 px, so 7x7 bins stay meaningful.
        chans = (3, w, w, 2 * w, 2 * w, 4 * w, 4 * w)  # stride 2 then 1 per stage
        self.body = nn.Sequential(*(_conv(chans[i], chans[i + 1], 2 - i % 2) for i in range(6)))
        self.spatial_scale = 1.0 / 8.0
        self.fc6 = nn.Linear(4 * w * roi_resolution ** 2, head_dim)
        self.fc7 = nn.Linear(head_dim, head_dim)
        self.cls_score = nn.Linear(head_dim, num_classes)
        self.bbox_pred = nn.Linear(head_dim, 4 * (2 if cls_agnostic_bbox_reg else num_classes))
        for layer, std in ((self.cls_score, 0.01), (self.bbox_pred, 0.001)):
            nn.init.normal_(layer.weight, std=std)
            nn.init.zeros_(layer.bias)
        self.register_buffer("pixel_means", torch.tensor(pixel_means, dtype=torch.float32),
                             persistent=False)

    def setup(self, stage: str) -> None:
        threads = self.hparams.cpu_threads
        if threads is not None and self.trainer.strategy.root_device.type == "cpu":
            torch.set_num_threads(max(1, int(threads)))

    def _image_blob(self, data: Any) -> torch.Tensor:
        x = torch.as_tensor(data, device=self.device)
        if x.dtype == torch.uint8:  # NCHW BGR uint8: normalise as Detectron does
            x = x.float() - self.pixel_means.view(1, 3, 1, 1)
        # Inputs are BGR minus means (about +-128); scale them to unit order for the
        # normalised conv body. Does not change what the data pipeline delivers.
        return x.float() / 64.0

    def features(self, data: Any) -> torch.Tensor:
        """The conv body's stride-8 feature map of the image blob."""
        return self.body(self._image_blob(data))

    def forward(self, data: Any, rois: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Class logits ``(R, num_classes)`` and box deltas ``(R, 4C)`` for ``rois`` (R, 5)."""
        return self.box_head(self.features(data), rois)

    def box_head(self, feats: torch.Tensor, rois: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """RoIAlign + MLP head on ``feats`` for ``rois`` ``(R, 5)`` in the scaled frame."""
        r = torch.as_tensor(rois, device=self.device, dtype=torch.float32).reshape(-1, 5)
        pooled = roi_align(feats, r, output_size=self.hparams.roi_resolution,
                           spatial_scale=self.spatial_scale,
                           sampling_ratio=self.hparams.sampling_ratio, aligned=False)
        h = F.relu(self.fc7(F.relu(self.fc6(pooled.flatten(1)))))
        return self.cls_score(h), self.bbox_pred(h)

    def compute_losses(self, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """Forward a training batch of Fast R-CNN blobs and return Detectron's losses."""
        names = ("labels_int32", "bbox_targets", "bbox_inside_weights", "bbox_outside_weights")
        if missing := [k for k in ("data", "rois", *names) if k not in batch]:
            raise KeyError(f"DemoFastRCNN needs the Fast R-CNN blobs (Detectron semantics: blob "
                           f"names); the batch lacks {missing} (has {sorted(batch)}). Use the "
                           f"Detectron output format with MODEL.FASTER_RCNN False and proposal "
                           f"files.")
        cls_logits, bbox_pred = self(batch["data"], batch["rois"])
        blobs = {k: torch.as_tensor(batch[k], device=self.device).float() for k in names}
        if blobs["bbox_targets"].shape != bbox_pred.shape:
            raise ValueError(f"bbox_targets has shape {tuple(blobs['bbox_targets'].shape)} but "
                             f"the head predicts {tuple(bbox_pred.shape)}: set model.num_classes "
                             f"to MODEL.NUM_CLASSES of the data ({self.hparams.num_classes} now)")
        out = fast_rcnn_losses(cls_logits, bbox_pred, blobs)
        out["loss"] = out["loss_cls"] + out["loss_bbox"]
        return out

    def training_step(self, batch: Mapping[str, Any], batch_idx: int) -> torch.Tensor:
        out, n = self.compute_losses(batch), int(np.shape(batch["data"])[0])
        self.log("train/loss", out["loss"], prog_bar=True, batch_size=n)
        self.log_dict({f"train/{k}": v for k, v in out.items() if k != "loss"}, batch_size=n)
        return out["loss"]

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        extra = {"momentum": 0.9} if hp.optimizer == "sgd" else {}  # as Detectron
        opt = (torch.optim.SGD if extra else torch.optim.AdamW)(
            self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay, **extra)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, functools.partial(
            detectron_lr_multiplier, steps=tuple(hp.lr_steps), gamma=hp.gamma,
            warmup_iters=hp.warmup_iters, warmup_factor=hp.warmup_factor))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    @torch.no_grad()
    def detect(self, batch: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Detections per image in original-image coordinates (Detectron's test path).

        Returns:
            One dict per image: ``image_id``, ``dataset``, ``boxes`` (k, 4) float32
            x1,y1,x2,y2 (+1 convention), ``scores`` (k,), ``labels`` (k,) contiguous ids.
        """
        return self.detections_for(self.features(batch["data"]), batch["rois"], batch["_meta"])

    @torch.no_grad()
    def detections_for(self, feats: torch.Tensor, rois: Any,
                       meta: Mapping[str, Any]) -> list[dict[str, Any]]:
        """:meth:`detect` on computed features and given RoIs (scaled frame, (R, 5))."""
        cls_logits, bbox_pred = self.box_head(feats, rois)
        probs = F.softmax(cls_logits.float(), dim=1).cpu().numpy()
        deltas = bbox_pred.float().cpu().numpy()
        rois = torch.as_tensor(rois).reshape(-1, 5).cpu().numpy()
        hp, C = self.hparams, self.hparams.num_classes
        if hp.cls_agnostic_bbox_reg:
            deltas = np.tile(deltas[:, 4:8], (1, C))
        deltas = deltas.reshape(-1, C, 4).copy()
        deltas[:, :, 2:] = np.minimum(deltas[:, :, 2:], BBOX_XFORM_CLIP)
        results = []
        for b, image_id in enumerate(meta["image_ids"]):
            sel, H, W = rois[:, 0] == b, int(meta["heights"][b]), int(meta["widths"][b])
            boxes = rois[sel, 1:5] / float(meta["im_scales"][b])
            pred = bbox_transform_inv(np.repeat(boxes, C, 0), deltas[sel].reshape(-1, 4),
                                      hp.bbox_reg_weights)
            pred = clip_boxes(pred, H, W).reshape(len(boxes), C, 4)
            rows, cls = np.nonzero(probs[sel][:, 1:] > hp.score_thresh)
            cls = cls + 1
            boxes = torch.from_numpy(pred[rows, cls].astype(np.float32))
            scores = torch.from_numpy(probs[sel][rows, cls].astype(np.float32))
            labels = torch.from_numpy(cls.astype(np.int64))
            # +1 on x2, y2: torchvision's NMS measures areas without Detectron's +1.
            keep = batched_nms(boxes + _PLUS_ONE, scores, labels, hp.nms_thresh)
            keep = keep[: hp.detections_per_im]
            results.append({"image_id": int(image_id), "dataset": str(meta["datasets"][b]),
                            "boxes": boxes[keep].numpy(), "scores": scores[keep].numpy(),
                            "labels": labels[keep].numpy()})
        return results

    def validation_step(self, batch: Mapping[str, Any], batch_idx: int) -> dict[str, Any]:
        """``{"detections": detect(batch)}`` for the evaluators (also the ``test_step``)."""
        return {"detections": self.detect(batch)}

    test_step = validation_step

    def predict_step(self, batch: Mapping[str, Any], batch_idx: int,
                     dataloader_idx: int = 0) -> list[dict[str, Any]]:
        """Detections of an evaluation batch (:meth:`detect`); ``lit-roidata predict``
        writes them as COCO results (:class:`lit_roidata.models.COCOPredictionWriter`)."""
        return self.detect(batch)
