"""DemoFasterRCNN: RPN losses on real RPN blobs, in-network proposals by hand, contract."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lit_roidata.demo.faster import DemoFasterRCNN


# Tiny tensors: one intra-op thread is several times faster on a shared 2-core box.
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def rpn_data(demo_roidb) -> dict:
    return demo_roidb({"demo_train_a": 6, "demo_train_b": 2, "demo_val": 3},
                      {"MODEL.NUM_CLASSES": 5, "MODEL.FASTER_RCNN": True,
                       "TRAIN.SCALES": (160,), "TRAIN.MAX_SIZE": 256,
                       "TRAIN.BATCH_SIZE_PER_IM": 32, "RPN.STRIDE": 8,
                       "RPN.SIZES": (32, 64, 128), "RPN.ASPECT_RATIOS": (0.5, 1, 2),
                       "TEST.SCALE": 160, "TEST.MAX_SIZE": 256}, proposals=False)


def _model(cfg, **kw) -> DemoFasterRCNN:
    torch.manual_seed(0)
    m = DemoFasterRCNN(num_classes=5, backbone_width=8, head_dim=64, **kw)
    m._trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu")),
                                 datamodule=SimpleNamespace(cfg=cfg), global_step=0,
                                 global_rank=0)
    m.setup("fit")
    torch.set_num_threads(1)
    return m


def test_end_to_end_losses_decrease_on_real_rpn_blobs(rpn_data: dict) -> None:
    from lit_roidata.minibatch import get_minibatch

    cfg, roidb = rpn_data["cfg"], rpn_data["train"]
    blobs, valid = get_minibatch([roidb[0], roidb[1]], cfg, np.random.default_rng(0))
    batch = {k: torch.from_numpy(np.asarray(v)) for k, v in blobs.items()}
    model = _model(cfg, lr=3e-3, optimizer="adamw")
    opt = model.configure_optimizers()["optimizer"]
    first = None
    for _ in range(15):
        out = model.compute_losses(batch)
        first = first or {k: float(v.detach()) for k, v in out.items()}
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
    assert first["loss_rpn_cls"] == pytest.approx(np.log(2), rel=0.05)  # sigmoid at 0
    last = model.compute_losses(batch)
    assert float(last["loss_rpn_cls"]) < 0.8 * first["loss_rpn_cls"]
    assert float(last["loss"]) < first["loss"]


def test_proposals_by_hand(rpn_data: dict) -> None:
    model = _model(rpn_data["cfg"], rpn_nms_thresh=0.7)
    a = len(model.cell_anchors)
    logits = torch.full((1, a, 2, 3), -5.0)
    logits[0, 4, 1, 2] = 5.0  # cell anchor 4 (ratio 1, size 64) at y=1, x=2
    deltas = torch.zeros(1, 4 * a, 2, 3)
    rois = model.proposals(logits, deltas, torch.tensor([[20.0, 40.0, 1.0]]), training=False)
    expected = model.cell_anchors[4] + torch.tensor([16.0, 8.0, 16.0, 8.0])
    expected[0::2] = expected[0::2].clamp(0, 39)
    expected[1::2] = expected[1::2].clamp(0, 19)
    # the top proposal is that anchor, clipped to the 20x40 image; all rows are image 0
    torch.testing.assert_close(rois[0, 1:], expected)
    assert (rois[:, 0] == 0).all() and len(rois) <= model.hparams.test_post_nms_top_n


def test_detect_contract_and_config_check(rpn_data: dict) -> None:
    from lit_roidata.dataset import EvalDataset

    cfg, val = rpn_data["cfg"], rpn_data["val"]
    model = _model(cfg, score_thresh=0.0).eval()
    batch = EvalDataset(val, cfg, pixel_format="detectron").__getitems__([0, 1])
    dets = model.validation_step(batch, 0)["detections"]
    assert [d["image_id"] for d in dets] == [int(i) for i in val.ids[:2]]
    for d, entry in zip(dets, (val[0], val[1])):
        assert len(d["boxes"]) == len(d["scores"]) == len(d["labels"]) > 0
        assert (d["boxes"][:, 2] <= entry["width"] - 1).all()
    other = cfg.clone()
    other.merge_from_dict({"RPN.STRIDE": 16})
    with pytest.raises(ValueError, match="RPN.STRIDE is 16"):
        _model(other)
