"""``TorchvisionDetector``: torchvision's detection models trained on this package's batches.

Trains on the data module's ``output_format="torchvision"`` batches and evaluates on its
evaluation blobs, with no second resize, Detectron's (or torchvision's) normalisation,
detections mapped back to original-image coordinates (Detectron's ``+1`` boxes) and
Detectron's solver; docs/models.md describes each point.
"""

from __future__ import annotations

import logging
import os
import pickle
from typing import Any, Literal, Mapping, Optional, Sequence

import numpy as np
import pytorch_lightning as pl
import torch
from torch import nn
from torchvision.models import get_model_builder, get_model_weights, get_weight
from torchvision.models.detection import FasterRCNN, KeypointRCNN, MaskRCNN, RetinaNet
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor
from torchvision.models.detection.mask_rcnn import MaskRCNNPredictor
from torchvision.models.detection.retinanet import RetinaNetClassificationHead
from torchvision.models.detection.roi_heads import paste_masks_in_image
from torchvision.models.detection.rpn import RPNHead
from torchvision.models.detection.transform import GeneralizedRCNNTransform
from torchvision.ops import misc as misc_nn_ops
from torchvision.ops.feature_pyramid_network import LastLevelP6P7

from lit_roidata.evaluation import mask_rle
from lit_roidata.minibatch.device import paste_target_masks

__all__ = ["ARCHS", "TorchvisionDetector", "detectron_solver_kwargs"]

log = logging.getLogger(__name__)

#: arch → (torchvision builder, family). ``fastrcnn_resnet50_fpn`` is Faster R-CNN's FPN
#: backbone and RoI heads fed with the loader's precomputed proposals (no RPN).
ARCHS: dict[str, tuple[str, str]] = {
    **{a: (a, "rcnn") for a in ("fasterrcnn_resnet50_fpn", "fasterrcnn_mobilenet_v3_large_fpn",
                                "maskrcnn_resnet50_fpn", "keypointrcnn_resnet50_fpn")},
    "retinanet_resnet50_fpn": ("retinanet_resnet50_fpn", "retinanet"),
    "fastrcnn_resnet50_fpn": ("fasterrcnn_resnet50_fpn", "fast"),
}

DETECTRON_PIXEL_MEANS = (102.9801, 115.9465, 122.7717)
_IMAGENET_MEAN, _IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def detectron_solver_kwargs(cfg: Any) -> dict[str, Any]:
    """:class:`TorchvisionDetector` keyword arguments from a Detectron config's ``SOLVER``
    (and ``MODEL.NUM_CLASSES``, ``TEST`` thresholds, ``PIXEL_MEANS``).

    Example::

        cfg = load_detectron_cfg("configs/detectron/e2e_mask_rcnn_R-50-FPN_1x.yaml")
        model = TorchvisionDetector("maskrcnn_resnet50_fpn", **detectron_solver_kwargs(cfg))
    """
    s, t = cfg.SOLVER, cfg.TEST
    if str(s.get("LR_POLICY", "steps_with_decay")) not in ("steps_with_decay", "step"):
        raise ValueError(f"SOLVER.LR_POLICY={s['LR_POLICY']!r} is not supported; "
                         f"TorchvisionDetector implements steps_with_decay (and step)")
    steps = [int(x) for x in s.get("STEPS") or ()]
    if str(s.get("LR_POLICY")) == "step" and not steps:
        steps = list(range(int(s["STEP_SIZE"]), int(s["MAX_ITER"]), int(s["STEP_SIZE"])))
    return {
        "num_classes": int(cfg.MODEL.NUM_CLASSES), "lr": float(s["BASE_LR"]),
        "momentum": float(s["MOMENTUM"]), "weight_decay": float(s["WEIGHT_DECAY"]),
        "lr_steps": [x for x in steps if x > 0], "gamma": float(s["GAMMA"]),
        "warmup_iters": int(s["WARM_UP_ITERS"]), "warmup_factor": float(s["WARM_UP_FACTOR"]),
        "warmup_method": str(s["WARM_UP_METHOD"]),
        "bias_lr_factor": 2.0 if s.get("BIAS_DOUBLE_LR", True) else 1.0,
        "bias_weight_decay": bool(s.get("BIAS_WEIGHT_DECAY", False)),
        "score_thresh": float(t.get("SCORE_THRESH", 0.05)), "nms_thresh": float(t.get("NMS", 0.5)),
        "detections_per_img": int(t.get("DETECTIONS_PER_IM", 100)),
        "pixel_means": tuple(float(v) for v in cfg.PIXEL_MEANS)}


def detectron_lr_multiplier(it: int, steps: Sequence[int], gamma: float, warmup_iters: int,
                            warmup_factor: float, warmup_method: str = "linear") -> float:
    """Detectron's ``steps_with_decay`` (0 steps ignored) × warm-up factor at ``it``."""
    mult = gamma ** sum(it >= s for s in steps if s > 0)
    if it < warmup_iters:
        alpha = 0.0 if warmup_method == "constant" else it / warmup_iters
        mult *= warmup_factor * (1 - alpha) + alpha
    return mult


def _no_resize_transform(size_divisible: int = 32) -> nn.Module:
    """torchvision's ``GeneralizedRCNNTransform`` with identity normalise, resize and
    postprocess: batches (pads) the images, nothing else."""
    class _KeepSize(GeneralizedRCNNTransform):
        def normalize(self, image: torch.Tensor) -> torch.Tensor:
            return image

        def resize(self, image: torch.Tensor, target: Optional[dict] = None) -> tuple:
            return image, target

        def postprocess(self, result: list, image_shapes: list, original_image_sizes: list) -> list:
            return result

    return _KeepSize(min_size=1, max_size=1 << 30, image_mean=[0.0, 0.0, 0.0],
                     image_std=[1.0, 1.0, 1.0], size_divisible=size_divisible)


def _weight_enum(builder_name: str, name: str, backbone: Optional[str]) -> Any:
    """A torchvision weight enum from a name such as ``COCO_V1``, ``DEFAULT`` or
    ``FasterRCNN_ResNet50_FPN_Weights.COCO_V1`` (no download happens here)."""
    if "." in name:
        return get_weight(name)
    enum = get_model_weights(get_model_builder(backbone or builder_name))
    try:
        return enum[name]
    except KeyError:
        raise ValueError(f"unknown torchvision weights {name!r} for {builder_name}"
                         f"{' backbone ' + backbone if backbone else ''}; choose one of "
                         f"{[w.name for w in enum]} or give a local .pth/.ckpt path") from None


def _is_path(w: Optional[str]) -> bool:
    return w is not None and (os.sep in w or w.endswith((".pth", ".pt", ".ckpt", ".pkl"))
                              or os.path.exists(w))


class TorchvisionDetector(pl.LightningModule):
    """A torchvision detector (Faster / Mask / Keypoint R-CNN, RetinaNet, Fast R-CNN from
    proposals) trained on the data module's torchvision-format batches.

    Use with ``RoIDataModule(output_format="torchvision", model_type=...)`` (the model type
    of each arch: docs/models.md), e.g. ``configs/demo_faster_rcnn_mobilenet.yaml``.
    ``validation_step`` / ``test_step`` / ``predict_step`` return the detections of
    :mod:`lit_roidata.evaluation`.

    Args:
        arch: one of :data:`ARCHS`.
        num_classes: classes including the background (``MODEL.NUM_CLASSES``).
        weights: ``None`` (random init, no download), a local ``.pth`` / ``.ckpt`` state
            dict (of this module or of the torchvision model), or a torchvision weight name
            (``"COCO_V1"``, ``"DEFAULT"``, or ``"MaskRCNN_ResNet50_FPN_Weights.COCO_V1"``;
            torchvision downloads it unless cached). Heads whose shape differs (another
            class count) are re-initialised, with a warning.
        weights_backbone: the same for the backbone alone (e.g. ``"IMAGENET1K_V1"``).
        backbone: the ResNet of the FPN backbone (``resnet18``, ``resnet34``, ``resnet50``,
            ``resnet101``) for the ResNet archs; default the arch's ResNet-50. A smaller
            one makes CPU runs on small data fast (the demo configs use ``resnet18``).
        trainable_backbone_layers: torchvision's option (only with pretrained weights).
        num_keypoints: keypoints per instance for ``keypointrcnn_resnet50_fpn``.
        normalize: ``"detectron"``, ``"torchvision"`` or ``"auto"`` (see the module doc).
        pixel_means: BGR means of the Detectron blob (``PIXEL_MEANS``).
        lr, momentum, weight_decay: ``SOLVER.BASE_LR``, ``MOMENTUM``, ``WEIGHT_DECAY``.
        lr_steps, gamma: ``SOLVER.STEPS`` (iterations; 0 entries ignored) and ``GAMMA``.
        warmup_iters, warmup_factor, warmup_method: ``SOLVER.WARM_UP_ITERS``,
            ``WARM_UP_FACTOR``, ``WARM_UP_METHOD`` (``"linear"`` or ``"constant"``).
        bias_lr_factor: lr multiplier of biases (2 = ``SOLVER.BIAS_DOUBLE_LR``).
        bias_weight_decay: apply weight decay to biases (``SOLVER.BIAS_WEIGHT_DECAY``).
        score_thresh, nms_thresh, detections_per_img: ``TEST.SCORE_THRESH``, ``TEST.NMS``,
            ``TEST.DETECTIONS_PER_IM``.
        mask_thresh: binarisation threshold of pasted mask probabilities.
        anchor_sizes: anchor sizes in input pixels, one per FPN level (Detectron's
            ``FPN.RPN_ANCHOR_START_SIZE`` doubled per level; default torchvision's
            32..512); aspect ratios 0.5, 1, 2; RetinaNet adds its 3 octave scales.
            Smaller anchors suit small images (the demo configs).
        detector_kwargs: further keyword arguments of the torchvision builder (e.g.
            ``rpn_pre_nms_top_n_train``, ``box_batch_size_per_image``, anchor settings).
        cpu_threads: intra-op threads set in ``setup`` when on the CPU; ``None`` keeps
            PyTorch's choice.
    """

    def __init__(self, arch: str = "fasterrcnn_resnet50_fpn", num_classes: int = 81,
                 weights: Optional[str] = None, weights_backbone: Optional[str] = None,
                 backbone: Optional[str] = None, trainable_backbone_layers: Optional[int] = None,
                 num_keypoints: int = 17,
                 normalize: Literal["auto", "detectron", "torchvision"] = "auto",
                 pixel_means: tuple[float, float, float] = DETECTRON_PIXEL_MEANS,
                 lr: float = 0.02, momentum: float = 0.9, weight_decay: float = 1e-4,
                 lr_steps: Sequence[int] = (), gamma: float = 0.1, warmup_iters: int = 500,
                 warmup_factor: float = 1.0 / 3.0,
                 warmup_method: Literal["linear", "constant"] = "linear",
                 bias_lr_factor: float = 2.0, bias_weight_decay: bool = False,
                 score_thresh: float = 0.05, nms_thresh: float = 0.5,
                 detections_per_img: int = 100, mask_thresh: float = 0.5,
                 anchor_sizes: Optional[Sequence[float]] = None,
                 detector_kwargs: Optional[dict[str, Any]] = None,
                 cpu_threads: Optional[int] = None) -> None:
        super().__init__()
        if arch not in ARCHS:
            raise ValueError(f"arch={arch!r} is not supported; choose one of {sorted(ARCHS)}")
        if num_classes < 2:
            raise ValueError(f"num_classes={num_classes}: need background plus >= 1 class "
                             f"(MODEL.NUM_CLASSES counts the background)")
        if warmup_method not in ("linear", "constant"):
            raise ValueError(f"warmup_method={warmup_method!r}; choose linear or constant")
        tv_weights = weights is not None and not _is_path(weights)
        tv_backbone = weights_backbone is not None and not _is_path(weights_backbone)
        if backbone is not None:
            if "mobilenet" in arch:
                raise ValueError(f"backbone={backbone!r} applies to the ResNet archs, not {arch}")
            if backbone not in ("resnet18", "resnet34", "resnet50", "resnet101"):
                raise ValueError(f"backbone={backbone!r}; choose resnet18, resnet34, resnet50 "
                                 f"or resnet101")
            if tv_weights and backbone != "resnet50":
                raise ValueError(f"torchvision weights {weights!r} are for ResNet-50; with "
                                 f"backbone={backbone!r} use weights_backbone instead")
        self.save_hyperparameters()
        self.family = ARCHS[arch][1]
        self.normalize_mode = normalize if normalize != "auto" else (
            "torchvision" if (tv_weights or tv_backbone) else "detectron")
        self.net = self._build(tv_weights, tv_backbone)
        self.register_buffer("_means", torch.tensor(pixel_means, dtype=torch.float32).view(3, 1, 1),
                             persistent=False)
        if weights is not None and not tv_weights:
            self.load_weights(weights)
        if weights_backbone is not None and not tv_backbone:
            self.load_weights(weights_backbone, prefix="backbone.body.")

    def _build(self, tv_weights: bool, tv_backbone: bool) -> nn.Module:
        hp, builder_name = self.hparams, ARCHS[self.hparams.arch][0]
        kwargs: dict[str, Any] = dict(hp.detector_kwargs or {})
        for key in ("score_thresh", "nms_thresh", "detections_per_img"):  # box_*: R-CNN's names
            kwargs.setdefault(("" if self.family == "retinanet" else "box_") + key, hp[key])
        if hp.arch.startswith("keypointrcnn"):
            kwargs.setdefault("num_keypoints", hp.num_keypoints)
        body = hp.backbone or ("mobilenet_v3_large" if "mobilenet" in builder_name else "resnet50")
        wb = _weight_enum(builder_name, hp.weights_backbone, body) if tv_backbone else None
        if hp.backbone is not None and not tv_weights:
            net = self._build_custom(body, wb, kwargs)
        else:
            kwargs["weights_backbone"] = wb
            if hp.trainable_backbone_layers is not None:
                kwargs["trainable_backbone_layers"] = hp.trainable_backbone_layers
            builder = get_model_builder(builder_name)
            if tv_weights:
                net = builder(weights=_weight_enum(builder_name, hp.weights, None), **kwargs)
                self._reset_heads(net)
            else:
                net = builder(weights=None, num_classes=hp.num_classes, **kwargs)
        # Keep-size transform, the anchors of ``anchor_sizes``, no RPN for ``fast``.
        net.transform = _no_resize_transform()
        if self.family == "fast":
            net.rpn = None  # proposals come from the loader; no unused RPN parameters
        elif hp.anchor_sizes is not None:
            gen = self._anchor_generator([float(a) for a in hp.anchor_sizes])
            n = gen.num_anchors_per_location()[0]
            owner = net if self.family == "retinanet" else net.rpn
            if n != owner.anchor_generator.num_anchors_per_location()[0]:
                if owner is net:
                    raise ValueError("anchor_sizes must keep RetinaNet's 9 anchors per place")
                net.rpn.head = RPNHead(net.rpn.head.cls_logits.in_channels, n)
            owner.anchor_generator = gen
        return net

    def _anchor_generator(self, sizes: list[float]) -> nn.Module:
        if "mobilenet" in self.hparams.arch:  # one set of sizes on each of its 3 maps
            per = (tuple(sizes),) * 3
        elif self.family == "retinanet":
            per = tuple((s, s * 2 ** (1 / 3), s * 2 ** (2 / 3)) for s in sizes)
        else:
            per = tuple((s,) for s in sizes)
        return AnchorGenerator(per, ((0.5, 1.0, 2.0),) * len(per))

    def _build_custom(self, body: str, weights_backbone: Any, kwargs: dict[str, Any]
                      ) -> nn.Module:
        """torchvision's construction of the arch with another ResNet in the FPN backbone."""
        from torchvision.models.detection.backbone_utils import _resnet_fpn_extractor

        hp, trained = self.hparams, weights_backbone is not None
        norm = misc_nn_ops.FrozenBatchNorm2d if trained else nn.BatchNorm2d
        layers = hp.trainable_backbone_layers
        layers = (3 if trained else 5) if layers is None else int(layers)
        resnet = get_model_builder(body)(weights=weights_backbone, norm_layer=norm)
        if self.family == "retinanet":
            bb = _resnet_fpn_extractor(resnet, layers, returned_layers=[2, 3, 4],
                                       extra_blocks=LastLevelP6P7(256, 256))
            return RetinaNet(bb, hp.num_classes, **kwargs)
        cls = {"maskrcnn": MaskRCNN, "keypointrcnn": KeypointRCNN}.get(
            hp.arch.split("_")[0], FasterRCNN)
        return cls(_resnet_fpn_extractor(resnet, layers), num_classes=hp.num_classes, **kwargs)

    def _reset_heads(self, net: nn.Module) -> None:
        """Replace class-count dependent heads of pretrained weights for ``num_classes``."""
        c = self.hparams.num_classes
        if self.family == "retinanet":
            if (head := net.head.classification_head).num_classes != c:
                log.warning("re-initialising RetinaNet's classification head for %d classes "
                            "(the weights have %d)", c, head.num_classes)
                net.head.classification_head = RetinaNetClassificationHead(
                    head.cls_logits.in_channels, head.num_anchors, c)
            return
        if (pred := net.roi_heads.box_predictor).cls_score.out_features != c:
            log.warning("re-initialising the box predictor for %d classes (the weights have "
                        "%d)", c, pred.cls_score.out_features)
            net.roi_heads.box_predictor = FastRCNNPredictor(pred.cls_score.in_features, c)
        mp = getattr(net.roi_heads, "mask_predictor", None)
        if mp is not None and mp.mask_fcn_logits.out_channels != c:
            net.roi_heads.mask_predictor = MaskRCNNPredictor(mp.conv5_mask.in_channels,
                                                             mp.conv5_mask.out_channels, c)

    def load_weights(self, path: str, prefix: str = "") -> None:
        """Load a local state dict (``.pth``/``.pt`` of the torchvision model or of this
        module, or a Lightning ``.ckpt``) into the network; keys under ``prefix`` only.

        Tensors whose shape differs (another class count) are skipped with a warning;
        missing and unexpected keys are logged.
        """
        if not os.path.isfile(path):
            raise FileNotFoundError(f"weights file {path} does not exist; give a local "
                                    f".pth/.ckpt path or a torchvision weight name")
        try:  # tensors only: a full unpickle would run any code the file names
            state = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            raise ValueError(
                f"{path}: torch.load(weights_only=True) refused the weights file "
                f"({str(exc).splitlines()[0]}); it holds objects besides tensors, and "
                f"unpickling those runs code. Load it once in a trusted session and save "
                f"its tensors: torch.save(state_dict, 'weights.pth')") from None
        if isinstance(state, Mapping) and "state_dict" in state:
            state = state["state_dict"]
        if not isinstance(state, Mapping):
            raise ValueError(f"{path}: expected a state dict (or a checkpoint with "
                             f"'state_dict'), got {type(state).__name__}")
        state = {(k[4:] if k.startswith("net.") else k): v for k, v in state.items()}
        if prefix and not any(k.startswith(prefix) for k in state):
            state = {prefix + k: v for k, v in state.items()}  # a bare backbone state dict
        own, state = self.net.state_dict(), {k: v for k, v in state.items() if k.startswith(prefix)}
        skipped = [k for k, v in state.items() if k in own and own[k].shape != v.shape]
        keep = {k: v for k, v in state.items() if k not in skipped}
        missing, unexpected = self.net.load_state_dict(keep, strict=False)
        missing = [k for k in missing if k.startswith(prefix)]
        if skipped:
            log.warning("%s: %d tensors with another shape were not loaded (e.g. %s): "
                        "re-initialised", path, len(skipped), skipped[:3])
        if missing or unexpected:
            log.warning("%s: %d missing and %d unexpected keys (e.g. %s / %s)", path,
                        len(missing), len(unexpected), missing[:3], unexpected[:3])
        log.info("loaded %d tensors from %s", len(keep), path)

    def setup(self, stage: str) -> None:
        """Take ``PIXEL_MEANS`` from the data module's config (it normalises the
        evaluation blobs with them); set the CPU threads."""
        cfg = getattr(getattr(getattr(self, "_trainer", None), "datamodule", None), "cfg", None)
        means = getattr(cfg, "PIXEL_MEANS", None)
        if means is not None and [*map(float, means)] != [*map(float, self.hparams.pixel_means)]:
            log.warning("using the data module's PIXEL_MEANS %s instead of pixel_means %s",
                        tuple(means), tuple(self.hparams.pixel_means))
            self._means = torch.tensor(tuple(means), dtype=torch.float32,
                                       device=self._means.device).view(3, 1, 1)
        if self.hparams.cpu_threads and self.device.type == "cpu":
            torch.set_num_threads(int(self.hparams.cpu_threads))

    def _prepare(self, img: torch.Tensor, *, rgb_uint8: bool) -> torch.Tensor:
        """One image in the network's input space (see ``normalize``)."""
        x, means = img.float(), self._means.to(img.device)
        if img.dtype == torch.uint8:
            bgr = x.flip(0) if rgb_uint8 else x
            if self.normalize_mode == "detectron":
                return bgr - means
            rgb = bgr.flip(0) / 255.0
        elif self.normalize_mode == "detectron":  # Detectron's blob: BGR minus PIXEL_MEANS
            return x
        else:
            rgb = (x + means).flip(0) / 255.0
        mean, std = (rgb.new_tensor(v).view(3, 1, 1) for v in (_IMAGENET_MEAN, _IMAGENET_STD))
        return (rgb - mean) / std

    def _train_inputs(self, batch: Any) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
        if isinstance(batch, Mapping):
            raise TypeError("TorchvisionDetector trains on the torchvision format: set "
                            "data.output_format: torchvision (got a Detectron blob dict with "
                            f"{sorted(k for k in batch if not k.startswith('_'))[:6]}...)")
        images, targets = paste_target_masks(batch)[:2]  # compact masks not pasted yet
        ims, tgts = [self._prepare(torch.as_tensor(im), rgb_uint8=True) for im in images], []

        def tensor(x: Any) -> torch.Tensor:  # plain tensors (not tv_tensors) on our device
            return torch.as_tensor(x).as_subclass(torch.Tensor).to(self.device)

        for t in targets:
            d: dict[str, Any] = {"boxes": tensor(t["boxes"]).float().reshape(-1, 4),
                                 "labels": tensor(t["labels"]).long()}
            for arch, key, flag in (("maskrcnn", "masks", "mask_rcnn_fpn (MODEL.MASK_ON)"), (
                    "keypointrcnn", "keypoints", "keypoint_rcnn_fpn (MODEL.KEYPOINTS_ON)")):
                if self.hparams.arch.startswith(arch):
                    if key not in t:
                        raise KeyError(f"{arch} needs target {key}: use model_type {flag} in "
                                       f"the data module")
                    d[key] = tensor(t[key]).float() if key == "keypoints" else tensor(t[key])
            if self.family == "fast":
                p = t.get("proposals")
                p = torch.zeros((0, 4)) if p is None else p
                d["proposals"] = tensor(p).float().reshape(-1, 4)
            tgts.append(d)
        return ims, tgts

    def forward_losses(self, images: list[torch.Tensor], targets: list[dict[str, Any]]
                       ) -> dict[str, torch.Tensor]:
        """torchvision's loss dict for prepared images and targets (training mode)."""
        if self.family != "fast":
            return self.net(images, targets)
        return self._fast_heads(images, [t.pop("proposals") for t in targets], targets)[1]

    def _fast_heads(self, images: list[torch.Tensor], proposals: list[torch.Tensor],
                    targets: Optional[list[dict[str, Any]]] = None) -> tuple[list, dict]:
        """``fast``: backbone and RoI heads on the given proposals (no RPN)."""
        il, tg = self.net.transform(images, targets)
        return self.net.roi_heads(self.net.backbone(il.tensors), proposals, il.image_sizes, tg)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, targets = self._train_inputs(batch)
        losses = self.forward_losses(images, targets)
        loss = sum(losses.values())
        self.log("train/loss", loss, prog_bar=True, batch_size=len(images))
        self.log_dict({f"train/{k}": v for k, v in losses.items()}, batch_size=len(images))
        return loss

    def configure_optimizers(self) -> Any:
        """Detectron's SGD (bias lr and decay rules) and per-iteration step schedule."""
        hp, weights, biases = self.hparams, [], []
        for name, p in self.named_parameters():
            if p.requires_grad:
                (biases if name.endswith(".bias") else weights).append(p)
        groups = [{"params": weights, "lr": hp.lr, "weight_decay": hp.weight_decay}]
        if biases:
            groups.append({"params": biases, "lr": hp.lr * hp.bias_lr_factor,
                           "weight_decay": hp.weight_decay if hp.bias_weight_decay else 0.0})
        opt = torch.optim.SGD(groups, lr=hp.lr, momentum=hp.momentum)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, self.lr_multiplier)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def lr_multiplier(self, it: int) -> float:
        """Detectron's ``steps_with_decay`` × warm-up factor at iteration ``it``."""
        hp = self.hparams
        return detectron_lr_multiplier(it, hp.lr_steps, hp.gamma, hp.warmup_iters,
                                       hp.warmup_factor, hp.warmup_method)

    def _eval_inputs(self, batch: Any) -> tuple[list[torch.Tensor], Mapping[str, Any]]:
        if not isinstance(batch, Mapping) or "_meta" not in batch:
            raise TypeError("evaluation batches are the data module's evaluation blobs "
                            "(a dict with 'data' and '_meta')")
        meta, data = batch["_meta"], batch["data"]
        sizes = torch.as_tensor(meta["image_sizes"]).reshape(-1, 2).tolist()
        return [self._prepare(data[i, :, : int(h), : int(w)], rgb_uint8=False)
                for i, (h, w) in enumerate(sizes)], meta

    @torch.no_grad()
    def detect(self, batch: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Detections per image in original-image coordinates.

        Returns:
            One dict per image: ``image_id``, ``dataset``, ``boxes`` ``(k, 4)`` x1, y1,
            x2, y2 with Detectron's inclusive convention, ``scores``, ``labels``
            (contiguous ids), and ``masks`` (k RLE dicts) / ``keypoints`` ``(k, K, 3)``
            (x, y, score) for Mask / Keypoint R-CNN.
        """
        images, meta = self._eval_inputs(batch)
        raw = self._detect_fast(images, batch) if self.family == "fast" else self.net(images)
        return [self._to_original(r, meta, i) for i, r in enumerate(raw)]

    def _detect_fast(self, images: list[torch.Tensor], batch: Mapping[str, Any]) -> list[dict]:
        if "rois" not in batch:
            raise KeyError("fastrcnn_resnet50_fpn needs proposals at test time: give the "
                           "data module val/test proposal files")
        rois = torch.as_tensor(batch["rois"]).float().reshape(-1, 5).to(self.device)
        proposals = []
        for b, s in enumerate(float(s) for s in batch["_meta"]["im_scales"][:len(images)]):
            r = rois[rois[:, 0] == b, 1:]  # Detectron inclusive boxes × s -> continuous edges
            proposals.append(r + r.new_tensor([0.0, 0.0, s, s]))
        return self._fast_heads(images, proposals)[0]

    def _to_original(self, r: Mapping[str, torch.Tensor], meta: Mapping[str, Any], i: int
                     ) -> dict[str, Any]:
        s, H, W = float(meta["im_scales"][i]), int(meta["heights"][i]), int(meta["widths"][i])
        boxes = r["boxes"].float() / s  # continuous edges in the original image
        boxes[:, 0::2] = boxes[:, 0::2].clamp(0, W)
        boxes[:, 1::2] = boxes[:, 1::2].clamp(0, H)
        out: dict[str, Any] = {
            "image_id": int(meta["image_ids"][i]), "dataset": str(meta["datasets"][i]),
            "boxes": (boxes - boxes.new_tensor([0.0, 0.0, 1.0, 1.0])).cpu().numpy(),
            "scores": r["scores"].float().cpu().numpy(), "labels": r["labels"].long().cpu().numpy()}
        if "masks" in r:
            out["masks"] = self._mask_rles(r["masks"], boxes, H, W)
        if "keypoints" in r:
            kp = r["keypoints"].float().clone()
            kp[..., :2] = kp[..., :2] / s - 0.5  # pixel centre (x + 0.5)·s -> pixel index
            if "keypoints_scores" in r:
                kp[..., 2] = r["keypoints_scores"].float()
            out["keypoints"] = kp.cpu().numpy()
        return out

    def _mask_rles(self, probs: torch.Tensor, boxes: torch.Tensor, H: int, W: int) -> list:
        if len(boxes) == 0:
            return []
        full = paste_masks_in_image(probs, boxes, (H, W))[:, 0] > self.hparams.mask_thresh
        return [mask_rle(m) for m in full.cpu().numpy().astype(np.uint8)]

    def validation_step(self, batch: Mapping[str, Any], batch_idx: int) -> dict[str, Any]:
        """``{"detections": detect(batch)}`` for the evaluators (also the ``test_step``)."""
        return {"detections": self.detect(batch)}

    test_step = validation_step

    def predict_step(self, batch: Mapping[str, Any], batch_idx: int,
                     dataloader_idx: int = 0) -> list[dict[str, Any]]:
        return self.detect(batch)
