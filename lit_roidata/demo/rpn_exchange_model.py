"""``RPNExchangeDemo``: a tiny FPN-RPN for the teacher/student exchange example, the
smallest model that produces and consumes the fork's per-level RPN outputs (docs/exchange.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import pytorch_lightning as pl
import torch
from torch import nn

from lit_roidata.minibatch.anchors import get_field_of_anchors
from lit_roidata.demo.model import BBOX_XFORM_CLIP, data_cfg, rpn_proposals, smooth_l1_loss

__all__ = ["RPNExchangeDemo"]


class RPNExchangeDemo(pl.LightningModule):
    """A tiny FPN-RPN that publishes / consumes per-level RPN outputs (the fork's use).

    ``training_step`` returns ``rpn_cls_probs_fpn<l>`` / ``rpn_bbox_pred_fpn<l>`` (detached,
    for :class:`~lit_roidata.exchange.callback.BlobExchangeCallback`) next to Detectron's
    RPN loss; a ``"student"`` adds a distillation term against ``self.peer_outputs``
    weighted like the fork's consumer op (docs/exchange.md).

    Args:
        role: ``"teacher"`` (publishes) or ``"student"`` (also learns from the peer).
        levels: first and last FPN level.
        num_anchors: anchors per location (``len(FPN.RPN_ASPECT_RATIOS)``).
        width: channels of the toy backbone.
        lr: SGD learning rate.
        distill_weight: weight of the distillation term.
    """

    def __init__(self, role: Literal["teacher", "student"] = "teacher",
                 levels: tuple[int, int] = (2, 6), num_anchors: int = 3, width: int = 16,
                 lr: float = 0.01, distill_weight: float = 1.0) -> None:
        super().__init__()
        self.save_hyperparameters()
        lo, hi = levels
        self.levels = list(range(lo, hi + 1))
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, stride=2, padding=1), nn.ReLU(),
                                  nn.Conv2d(width, width, 3, stride=2, padding=1), nn.ReLU())
        self.downs = nn.ModuleList(nn.Conv2d(width, width, 3, stride=2, padding=1)
                                   for _ in range(lo, hi))
        self.cls = nn.Conv2d(width, num_anchors, 1)
        self.bbox = nn.Conv2d(width, 4 * num_anchors, 1)
        self.peer_outputs: dict[str, torch.Tensor] | None = None

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-level RPN probabilities and box deltas (logits kept for the loss)."""
        feat = self.stem(images.float() / 255.0 if images.dtype == torch.uint8 else images.float())
        for _ in range(2, self.levels[0]):
            feat = nn.functional.max_pool2d(feat, 2, ceil_mode=True)
        out: dict[str, torch.Tensor] = {}
        for i, lvl in enumerate(self.levels):
            if i:
                feat = torch.relu(self.downs[i - 1](feat))
            out[f"rpn_cls_logits_fpn{lvl}"] = logits = self.cls(feat)
            out[f"rpn_cls_probs_fpn{lvl}"] = torch.sigmoid(logits)
            out[f"rpn_bbox_pred_fpn{lvl}"] = self.bbox(feat)
        return out

    def _rpn_loss(self, out: dict[str, torch.Tensor], batch: Mapping[str, Any]) -> torch.Tensor:
        loss = out[f"rpn_cls_logits_fpn{self.levels[0]}"].sum() * 0.0
        for lvl in self.levels:
            key = f"rpn_labels_int32_wide_fpn{lvl}"
            if key not in batch:
                continue
            logits, deltas = out[f"rpn_cls_logits_fpn{lvl}"], out[f"rpn_bbox_pred_fpn{lvl}"]
            h, w = logits.shape[-2:]
            labels = batch[key][..., :h, :w].to(logits.device)
            hh, ww = labels.shape[-2:]
            logits, deltas = logits[..., :hh, :ww], deltas[..., :hh, :ww]
            if (valid := labels >= 0).any():
                loss = loss + nn.functional.binary_cross_entropy_with_logits(
                    logits[valid], labels[valid].float())
            tgt, w_in, w_out = (batch[f"rpn_bbox_{k}_wide_fpn{lvl}"][..., :hh, :ww].to(deltas)
                                for k in ("targets", "inside_weights", "outside_weights"))
            loss = loss + smooth_l1_loss(deltas, tgt, w_in, w_out, beta=1.0 / 9.0)
        return loss

    def _distill_loss(self, out: dict[str, torch.Tensor]) -> torch.Tensor | None:
        if not (peer := self.peer_outputs):
            return None
        terms = []
        for name, target in peer.items():
            if (pred := out[name]).shape != target.shape:
                raise ValueError(f"peer blob {name!r} has shape {tuple(target.shape)}, this "
                                 f"model's is {tuple(pred.shape)}: different images or models")
            # the fork's outside weight 1/(C*H*W), averaged over the images
            terms.append(smooth_l1_loss(pred, target.to(pred), 1.0, 1.0,
                                        normalizer=target[0].numel() * pred.shape[0]))
        return sum(terms[1:], terms[0])

    def training_step(self, batch: Mapping[str, Any], batch_idx: int) -> dict[str, Any]:
        out = self(batch["data"])
        loss, n = self._rpn_loss(out, batch), len(batch["data"])
        distill = self._distill_loss(out) if self.hparams.role == "student" else None
        if distill is not None:
            self.log("loss_distill", distill, prog_bar=True, batch_size=n)
            loss = loss + self.hparams.distill_weight * distill
        self.log("loss", loss, prog_bar=True, batch_size=n)
        published = {k: v.detach() for k, v in out.items() if not k.startswith("rpn_cls_logits")}
        return {"loss": loss, **published}

    def _test_cfg(self) -> Any:
        """The data module's Detectron config (anchors, ``TEST.RPN_*``), else defaults."""
        return data_cfg(getattr(self, "_trainer", None), {
            "FPN.FPN_ON": True, "FPN.MULTILEVEL_RPN": True,
            "FPN.RPN_MIN_LEVEL": self.levels[0], "FPN.RPN_MAX_LEVEL": self.levels[-1]})

    @torch.no_grad()
    def proposals(self, out: Mapping[str, torch.Tensor], im_info: Any, cfg: Any
                  ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Detectron's RPN-only test path per image: ``(boxes (R, 4), scores (R,))`` in
        the scaled input frame (``GenerateProposals`` per level on the loader's anchors, then
        ``CollectAndDistributeFpnRpnProposals``; docs/exchange.md lists the steps)."""
        test, k_min = cfg.TEST, cfg.FPN.RPN_MIN_LEVEL
        post = int(test["RPN_POST_NMS_TOP_N"])
        kwargs = dict(pre=int(test["RPN_PRE_NMS_TOP_N"]), post=post,
                      nms_thresh=float(test["RPN_NMS_THRESH"]),
                      min_size=float(test["RPN_MIN_SIZE"]), centred_inside=True,
                      clip=float(getattr(cfg, "BBOX_XFORM_CLIP", BBOX_XFORM_CLIP)))
        info = torch.as_tensor(im_info, dtype=torch.float32).reshape(-1, 3).tolist()
        per_image: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in info]
        for lvl in self.levels:
            probs, deltas = out[f"rpn_cls_probs_fpn{lvl}"], out[f"rpn_bbox_pred_fpn{lvl}"]
            _, a, hf, wf = probs.shape
            field = get_field_of_anchors(
                2.0 ** lvl, (cfg.FPN.RPN_ANCHOR_START_SIZE * 2.0 ** (lvl - k_min),),
                cfg.FPN.RPN_ASPECT_RATIOS, coarsest_stride=cfg.FPN.COARSEST_STRIDE,
                max_size=max(hf, wf) * 2 ** lvl)
            if field.num_cell_anchors != a:
                raise ValueError(f"FPN level {lvl}: the model predicts {a} anchors per "
                                 f"location but FPN.RPN_ASPECT_RATIOS gives "
                                 f"{field.num_cell_anchors}; set num_anchors accordingly")
            f = field.field_size
            crop = field.field_of_anchors.reshape(f, f, a, 4)[:hf, :wf]  # read-only, shared
            anchors = torch.tensor(crop.reshape(-1, 4), device=probs.device)
            for i, found in enumerate(rpn_proposals(anchors, probs, deltas, info, **kwargs)):
                per_image[i].append(found)
        result = []
        for parts in per_image:
            boxes, scores = (torch.cat(col) for col in zip(*parts))
            top = scores.argsort(descending=True)[:int(post * cfg.FPN.RPN_COLLECT_SCALE)]
            result.append((boxes[top], scores[top]))
        return result

    def predict_step(self, batch: Mapping[str, Any], batch_idx: int,
                     dataloader_idx: int = 0) -> list[dict[str, Any]]:
        """Class-agnostic RPN proposals per image, as Detectron tests an RPN-only model.

        Returns the per-image dicts of :mod:`lit_roidata.evaluation` flagged
        ``proposals: True`` (boxes in original-image pixels, scores = objectness, no
        labels); :class:`~lit_roidata.models.COCOPredictionWriter` writes them with
        ``category_id`` 1, to be evaluated as proposals (``useCats = 0``).
        """
        meta, dets = batch["_meta"], []
        found = self.proposals(self(batch["data"]), batch["im_info"], self._test_cfg())
        for b, (boxes, scores) in enumerate(found):
            boxes = boxes / float(meta["im_scales"][b])
            h, w = int(meta["heights"][b]), int(meta["widths"][b])
            boxes[:, 0::2] = boxes[:, 0::2].clamp(0, w - 1)
            boxes[:, 1::2] = boxes[:, 1::2].clamp(0, h - 1)
            dets.append({"image_id": int(meta["image_ids"][b]),
                         "dataset": str(meta["datasets"][b]), "boxes": boxes.cpu().numpy(),
                         "scores": scores.cpu().numpy(), "proposals": True})
        return dets

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
