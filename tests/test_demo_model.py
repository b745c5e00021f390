"""DemoFastRCNN: Detectron losses on blobs (synthetic and real), inference by hand, contract."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from lit_roidata.boxes import bbox_transform_targets
from lit_roidata.demo.model import DemoFastRCNN, smooth_l1_loss

C = 3  # background + 2 classes


# Tiny tensors: one intra-op thread is several times faster on a shared 2-core box.
pytestmark = pytest.mark.usefixtures("one_thread")


def _synthetic_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """Two 64x96 images, one red square (class 1) and one blue square (class 2)."""
    rng = np.random.default_rng(seed)
    data = np.full((2, 3, 64, 96), -20.0, np.float32)
    gts = np.array([[10, 12, 41, 43], [50, 20, 81, 51]], np.float32)
    data[0, 2, 12:44, 10:42] = 100.0
    data[1, 0, 20:52, 50:82] = 100.0
    rois, labels, targets = [], [], []
    for b, gt in enumerate(gts):
        fg = gt + rng.normal(0, 2.5, size=(8, 4)).astype(np.float32)
        bg = np.sort(rng.uniform(0, 60, size=(24, 4)).astype(np.float32).reshape(24, 2, 2), 1)
        bg = bg.transpose(0, 2, 1).reshape(24, 4)
        boxes = np.concatenate([fg, bg])
        lab = np.r_[np.full(8, b + 1), np.zeros(24)].astype(np.int32)
        t = np.zeros((32, 4 * C), np.float32)
        t[:8, 4 * (b + 1):4 * (b + 2)] = bbox_transform_targets(fg, np.repeat(gt[None], 8, 0),
                                                                (10.0, 10.0, 5.0, 5.0))
        rois.append(np.c_[np.full(32, b, np.float32), boxes])
        labels.append(lab)
        targets.append(t)
    t = np.concatenate(targets)
    w = (t != 0).astype(np.float32)
    return {"data": torch.from_numpy(data), "rois": torch.from_numpy(np.concatenate(rois)),
            "labels_int32": torch.from_numpy(np.concatenate(labels)),
            "bbox_targets": torch.from_numpy(t), "bbox_inside_weights": torch.from_numpy(w),
            "bbox_outside_weights": torch.from_numpy(w), "_meta": {"image_ids": [1, 2]}}


def _train(model: DemoFastRCNN, batch: dict, steps: int) -> list[float]:
    opt = model.configure_optimizers()["optimizer"]
    losses = []
    for _ in range(steps):
        out = model.compute_losses(batch)
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
        losses.append(float(out["loss"].detach()))
    return losses


def test_loss_decreases_on_synthetic_blobs() -> None:
    torch.manual_seed(0)
    model = DemoFastRCNN(num_classes=C, lr=2e-3, optimizer="adamw", backbone_width=8,
                         head_dim=64)
    batch = _synthetic_batch()
    first = model.compute_losses(batch)
    assert first["loss_cls"].item() == pytest.approx(np.log(C), rel=0.05)  # uniform at init
    losses = _train(model, batch, 25)
    assert np.mean(losses[-3:]) < 0.5 * np.mean(losses[:3])
    assert model.compute_losses(batch)["accuracy_cls"] > 0.9


def test_smooth_l1_matches_detectron_by_hand() -> None:
    pred = torch.tensor([[0.5, 3.0, 0.0, 0.0]])
    target = torch.zeros(1, 4)
    inside = torch.tensor([[1.0, 1.0, 0.0, 1.0]])
    outside = torch.tensor([[1.0, 2.0, 1.0, 1.0]])
    # 0.5*0.5^2 + 2*(3 - 0.5) = 0.125 + 5; divided by N = 1
    assert smooth_l1_loss(pred, target, inside, outside).item() == pytest.approx(5.125)
    assert smooth_l1_loss(pred.repeat(4, 1), target.repeat(4, 1), inside.repeat(4, 1),
                          outside.repeat(4, 1)).item() == pytest.approx(5.125)


def test_uint8_data_is_normalised_like_float() -> None:
    torch.manual_seed(0)
    model = DemoFastRCNN(num_classes=C, backbone_width=8, head_dim=32).eval()
    img = torch.randint(0, 255, (1, 3, 32, 48), dtype=torch.uint8)
    rois = torch.tensor([[0.0, 2, 2, 20, 20]])
    means = torch.tensor(model.hparams.pixel_means).view(1, 3, 1, 1)
    a = model(img, rois)[0]
    b = model(img.float() - means, rois)[0]
    torch.testing.assert_close(a, b)


def test_errors_name_the_problem() -> None:
    model = DemoFastRCNN(num_classes=5, backbone_width=8, head_dim=32)
    batch = _synthetic_batch()
    with pytest.raises(ValueError, match="num_classes"):
        model.compute_losses(batch)  # targets have 4*3 columns, the head 4*5
    with pytest.raises(KeyError, match="labels_int32"):
        model.compute_losses({k: v for k, v in batch.items() if k != "labels_int32"})
    with pytest.raises(ValueError, match="num_classes"):
        DemoFastRCNN(num_classes=1)


def test_detect_by_hand() -> None:
    """Zero deltas and a class-2 bias: detections are the proposals / scale, clipped, NMS'd."""
    model = DemoFastRCNN(num_classes=C, backbone_width=8, head_dim=32).eval()
    with torch.no_grad():
        model.bbox_pred.weight.zero_()
        model.bbox_pred.bias.zero_()
        model.cls_score.weight.zero_()
        model.cls_score.bias.copy_(torch.tensor([0.0, 0.0, 5.0]))
    # image 0 is 20x60 at scale 2: [20,20,59,39] / 2 = [10,10,29.5,19.5], y2 clipped to 19
    rois = torch.tensor([[0, 20.0, 20.0, 59.0, 39.0],     # image 0, scale 2
                         [0, 21.0, 20.0, 59.0, 39.0],     # duplicate: removed by NMS
                         [0, 100.0, 0.0, 139.0, 30.0],    # beyond the 60-px width: clipped
                         [1, 0.0, 0.0, 9.0, 9.0]])        # image 1, scale 1
    batch = {"data": torch.zeros(2, 3, 40, 140), "rois": rois,
             "_meta": {"image_ids": [7, 8], "im_scales": [2.0, 1.0], "datasets": ["d", "d"],
                       "heights": [20, 30], "widths": [60, 30]}}
    d0, d1 = model.validation_step(batch, 0)["detections"]
    assert (d0["image_id"], d0["dataset"], d1["image_id"]) == (7, "d", 8)
    p = np.exp(5) / (np.exp(5) + 2)
    np.testing.assert_allclose(d0["scores"], [p, p], rtol=1e-5)
    np.testing.assert_array_equal(d0["labels"], [2, 2])
    np.testing.assert_allclose(np.sort(d0["boxes"], axis=0),
                               np.sort([[10, 10, 29.5, 19], [50, 0, 59, 15]], axis=0), atol=1e-4)
    np.testing.assert_allclose(d1["boxes"], [[0, 0, 9, 9]], atol=1e-4)


# ----------------------------------------------------------- real blobs from demo data
@pytest.fixture(scope="module")
def real(demo_roidb) -> dict:
    return demo_roidb({"demo_train_a": 8, "demo_train_b": 4, "demo_val": 4},
                      {"MODEL.NUM_CLASSES": 5, "TRAIN.SCALES": (160,), "TRAIN.MAX_SIZE": 256,
                       "TRAIN.BATCH_SIZE_PER_IM": 32, "TEST.SCALE": 160, "TEST.MAX_SIZE": 256})


def test_trains_on_real_minibatch_blobs(real: dict) -> None:
    from lit_roidata.minibatch import get_minibatch

    cfg, roidb = real["cfg"], real["train"]
    blobs, valid = get_minibatch([roidb[0], roidb[3]], cfg, np.random.default_rng(0))
    assert valid
    batch = {k: torch.from_numpy(np.asarray(v)) for k, v in blobs.items()}
    assert batch["bbox_targets"].shape[1] == 4 * 5
    torch.manual_seed(0)
    model = DemoFastRCNN(num_classes=5, lr=2e-3, optimizer="adamw", backbone_width=8,
                         head_dim=64)
    losses = _train(model, batch, 15)
    assert np.isfinite(losses).all()
    assert np.mean(losses[-3:]) < 0.7 * np.mean(losses[:3])


def test_validation_output_feeds_coco_evaluator(real: dict) -> None:
    from lit_roidata.dataset import EvalDataset
    from lit_roidata.evaluation import COCOEvaluator

    cfg, val = real["cfg"], real["val"]
    ds = EvalDataset(val, cfg, pixel_format="detectron", with_rois=True)
    model = DemoFastRCNN(num_classes=5, backbone_width=8, head_dim=32, score_thresh=0.0).eval()
    dets = []
    for i in range(0, len(val), 2):
        dets += model.validation_step(ds.__getitems__(list(range(i, min(i + 2, len(val))))),
                                      i)["detections"]
    assert [d["image_id"] for d in dets] == [int(x) for x in val.ids]
    for d, entry in zip(dets, val):
        assert d["dataset"] == "demo_val" and len(d["boxes"]) <= 100
        assert d["boxes"].shape[1] == 4 and len(d["boxes"]) == len(d["scores"]) == len(d["labels"])
        assert (d["boxes"][:, 2] <= entry["width"] - 1).all()
        assert (d["boxes"][:, 3] <= entry["height"] - 1).all()
        assert set(d["labels"].tolist()) <= {1, 2, 3, 4}
    ann = real["catalog"].get("demo_val").annotation_file
    ev = COCOEvaluator(annotation_files={"demo_val": ann}, print_summary=False)
    m = ev.evaluate(dets, trainer=None)
    assert 0.0 <= m["val/bbox_AP"] <= 1.0 and "val/bbox_AP50" in m


def test_cpu_threads_set_in_setup() -> None:
    from types import SimpleNamespace

    model = DemoFastRCNN(num_classes=C, backbone_width=8, head_dim=32, cpu_threads=2)
    model._trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu")))
    model.setup("fit")
    assert torch.get_num_threads() == 2
    model.hparams.cpu_threads = None
    torch.set_num_threads(1)
    model.setup("fit")
    assert torch.get_num_threads() == 1
