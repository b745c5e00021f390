"""Device check (CUDA): the parts of the pipeline that run on the model's device.

1. ``normalize_on_device`` on CUDA equals the Detectron float blob built on the CPU.
2. ``proposal_labels`` with CUDA tensors equals the NumPy path (same seed).
3. Host->device copy of a uint8 blob vs the float32 Detectron blob (pinned memory),
   with ratio; plus normalisation cost on the device.
4. The demo Fast R-CNN fits a few dozen steps on the GPU through ``RoIDataModule``
   (uint8 pixels normalised in ``on_after_batch_transfer``); loss finite, stream exact.
5. Compact RPN (FPN and single level) and RetinaNet targets expanded on the device
   (``finalize_on_device``) equal the dense blobs built on the CPU, byte for byte, and
   the expansion's time per batch at e2e Mask R-CNN FPN settings (800x1333, 2 images).
6. The torchvision output's compact masks (``mask_format="compact"``) pasted on the
   device (``paste_mask_crops``) equal the full masks built on the CPU, bit for bit; the
   bytes of both and the paste's time per batch of 16 images at 800 px.

Run: ``python benchmarks/gpu_check.py`` (skips cleanly without CUDA).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import numpy as np
import torch


def _timeit(fn, n=20):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n


def main() -> int:
    if not torch.cuda.is_available() and not os.environ.get("GPU_CHECK_ON_CPU"):
        print("no CUDA device: nothing to check")
        return 0
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cpu":  # dry run of the script's logic
        torch.cuda.synchronize = lambda *a: None
    print("device:", torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu", "torch", torch.__version__)
    from lit_roidata.catalog import Catalog
    from lit_roidata.config import get_cfg
    from lit_roidata.demo.data import ensure_demo_data, register_demo_datasets
    from lit_roidata.minibatch import get_image_blob, proposal_labels
    from lit_roidata.minibatch.device import normalize_on_device
    from lit_roidata.rng import block_rng
    from lit_roidata.roidb import combined_roidb_for_training

    root = tempfile.mkdtemp()
    ensure_demo_data(os.path.join(root, "demo"))
    catalog = Catalog()
    register_demo_datasets(os.path.join(root, "demo"), catalog)
    cfg = get_cfg()
    cfg.merge_from_dict({"MODEL.NUM_CLASSES": 5, "MODEL.MASK_ON": True, "FPN.FPN_ON": True,
                         "FPN.MULTILEVEL_ROIS": True, "MRCNN.RESOLUTION": 28,
                         "TRAIN.SCALES": (800,), "TRAIN.MAX_SIZE": 1333,
                         "TRAIN.BATCH_SIZE_PER_IM": 512})
    roidb = combined_roidb_for_training(["demo_train_a"], [], cfg,
                                        cache_dir=os.path.join(root, "cache"), catalog=catalog)
    entries = [roidb[i] for i in range(2)]

    # 1. normalize_on_device == detectron float blob
    from lit_roidata.minibatch.image import build_image_blob
    u8 = build_image_blob(entries, cfg, block_rng(3, 0, 0), pixel_format="uint8")
    blob_f, scales_f = get_image_blob(entries, cfg, block_rng(3, 0, 0))
    got = normalize_on_device(torch.as_tensor(u8.data).to(dev), u8.image_sizes, cfg.PIXEL_MEANS)
    ref = torch.as_tensor(np.asarray(blob_f))
    diff = (got.cpu() - ref).abs()
    print(f"[1] normalize_on_device on {dev} vs CPU detectron blob: shape {tuple(got.shape)} "
          f"mean|diff| {diff.mean():.4f} max|diff| {diff.max():.4f} (uint8 vs float resize: "
          "<= 1 grey level on average expected)")
    ok1 = tuple(got.shape) == tuple(ref.shape) and float(diff.mean()) <= 1.0

    # 2. proposal_labels on CUDA == NumPy path
    g = torch.Generator().manual_seed(0)
    rois = []
    for i, (e, s) in enumerate(zip(entries, scales_f)):
        gt = torch.as_tensor(np.asarray(e["boxes"])[:4]) * s
        jit = gt.repeat(200, 1) + torch.randn(gt.shape[0] * 200, 4, generator=g) * 8
        x1 = torch.minimum(jit[:, 0], jit[:, 2])
        x2 = torch.maximum(jit[:, 0], jit[:, 2]) + 2
        y1 = torch.minimum(jit[:, 1], jit[:, 3])
        y2 = torch.maximum(jit[:, 1], jit[:, 3]) + 2
        rois.append(torch.stack([torch.full_like(x1, i), x1, y1, x2, y2], 1))
    rois = torch.cat(rois).float()
    cpu_blobs = proposal_labels(rois.numpy(), entries, scales_f, cfg, block_rng(3, 0, 1))
    t0 = time.perf_counter()
    gpu_blobs = proposal_labels(rois.to(dev), entries, scales_f, cfg, block_rng(3, 0, 1))
    torch.cuda.synchronize()
    t_gpu = time.perf_counter() - t0
    mism = [k for k in cpu_blobs if not np.array_equal(np.asarray(cpu_blobs[k]),
                                                       gpu_blobs[k].cpu().numpy())]
    devs = {str(v.device) for v in gpu_blobs.values()}
    print(f"[2] proposal_labels: {rois.shape[0]} rois, {len(cpu_blobs)} blobs, devices {devs}, "
          f"mismatching blobs: {mism or 'none'} ({t_gpu * 1e3:.1f} ms incl. first call)")
    ok2 = not mism and devs == {str(rois.to(dev).device)}

    # 3. H2D: uint8 vs float32 blob (2 x 3 x 800 x 1344)
    u8 = torch.randint(0, 255, (2, 3, 800, 1344), dtype=torch.uint8)
    f32 = u8.float()
    if dev.type == "cuda":
        u8, f32 = u8.pin_memory(), f32.pin_memory()
    t_u8 = _timeit(lambda: u8.to(dev, non_blocking=True))
    t_f32 = _timeit(lambda: f32.to(dev, non_blocking=True))
    sizes = [(800, 1333), (750, 1344)]
    gu8 = u8.to(dev)
    t_norm = _timeit(lambda: normalize_on_device(gu8, sizes, cfg.PIXEL_MEANS))
    print(f"[3] H2D per minibatch: uint8 {t_u8 * 1e3:.3f} ms, float32 {t_f32 * 1e3:.3f} ms "
          f"(ratio {t_f32 / t_u8:.2f}x); normalize_on_device {t_norm * 1e3:.3f} ms")

    # 4. demo fit on the GPU through the data module
    import pytorch_lightning as pl
    from lit_roidata import DemoRoIDataModule
    from lit_roidata.demo import DemoFastRCNN

    run = os.path.join(root, "run")
    dm = DemoRoIDataModule(demo_root=os.path.join(root, "demo"),
                       sources={"cache_dir": os.path.join(root, "c2")}, model_type="fast_rcnn",
                       loader={"num_workers": 4, "pin_memory": dev.type == "cuda"},
                       sampling={"infinite": True},
                       overrides={"MODEL.NUM_CLASSES": 5, "TRAIN.SCALES": [224, 256, 288],
                                  "TRAIN.MAX_SIZE": 480, "TEST.SCALE": 256,
                                  "TEST.MAX_SIZE": 480})
    model = DemoFastRCNN(num_classes=5, lr=0.02)
    losses = []

    class Track(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            losses.append(float(loss))
            if batch_idx == 0:
                print("    first batch on", batch["data"].device, batch["data"].dtype)

    trainer = pl.Trainer(accelerator="gpu" if dev.type == "cuda" else "cpu", devices=1, max_steps=int(os.environ.get("GPU_CHECK_STEPS", 60)), logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=run,
                         callbacks=[Track()])
    t0 = time.perf_counter()
    trainer.fit(model, dm)
    dt = time.perf_counter() - t0
    print(f"[4] demo fit on GPU: {len(losses)} steps in {dt:.1f} s, loss {losses[0]:.3f} -> "
          f"{np.mean(losses[-10:]):.3f}")
    ok4 = len(losses) == trainer.max_steps and all(np.isfinite(losses))
    ok5 = check_compact_targets(dev, roidb)
    ok6 = check_compact_masks(dev, roidb, cfg)
    ok = ok1 and ok2 and ok4 and ok5 and ok6
    print("GPU CHECK", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


def check_compact_targets(dev: torch.device, roidb) -> bool:
    """[5] compact targets expanded on ``dev`` == dense CPU blobs; expansion time."""
    from lit_roidata.config import get_cfg
    from lit_roidata.minibatch.core import build_minibatch
    from lit_roidata.minibatch.device import expand_targets
    from lit_roidata.minibatch.model_type import flags_for_model_type

    ok = True
    entries = [roidb[0], roidb[1]]
    for model_type, extra in (("mask_rcnn_fpn", {}), ("faster_rcnn", {}),
                              ("retinanet", {"FPN.RPN_MIN_LEVEL": 3, "FPN.RPN_MAX_LEVEL": 7,
                                             "FPN.COARSEST_STRIDE": 128})):
        cfg = get_cfg()
        cfg.merge_from_dict(flags_for_model_type(model_type))
        cfg.merge_from_dict({"MODEL.NUM_CLASSES": 81, "TRAIN.SCALES": (800,),
                             "TRAIN.MAX_SIZE": 1333, **extra})
        for mode, make_rng in (("block", lambda: np.random.default_rng(5)),
                               ("detectron", lambda: np.random.RandomState(5))):
            dense = build_minibatch(entries, cfg, make_rng(), pixel_format="uint8").blobs
            compact = build_minibatch(entries, cfg, make_rng(), pixel_format="uint8",
                                      compact_targets=True).blobs
            small = {k: torch.as_tensor(v).to(dev) for k, v in compact.items()
                     if k not in ("data", "roidb", "im_info")}
            dense_bytes = sum(np.asarray(v).nbytes for k, v in dense.items()
                              if k not in ("data", "roidb", "im_info"))
            sent = sum(t.numel() * t.element_size() for t in small.values())
            out = expand_targets(dict(small))
            torch.cuda.synchronize()
            mism = [k for k, v in out.items()
                    if v.device.type != dev.type
                    or v.cpu().numpy().tobytes() != np.asarray(dense[k]).tobytes()
                    or v.cpu().numpy().dtype != np.asarray(dense[k]).dtype]
            missing = [k for k in dense if k not in ("data", "roidb", "im_info") and k not in out]
            t = _timeit(lambda: expand_targets(dict(small)), n=10)
            print(f"[5] {model_type:14s} ({mode:9s}): {len(out)} blobs expanded on {dev}, "
                  f"{sent / 1024:.1f} KB sent instead of {dense_bytes / 2**20:.1f} MiB; "
                  f"mismatching: {mism or missing or 'none'}; expand {t * 1e3:.2f} ms/batch")
            ok = ok and not mism and not missing
    return ok


def check_compact_masks(dev: torch.device, roidb, cfg) -> bool:
    """[6] torchvision masks pasted on ``dev`` from compact crops == full CPU masks; time."""
    from lit_roidata.minibatch.device import paste_mask_crops
    from lit_roidata.minibatch.torchvision_format import build_torchvision_batch

    entries = [roidb[i % len(roidb)] for i in range(16)]
    _, full = build_torchvision_batch(entries, cfg, np.random.default_rng(5))
    ims, tgts = build_torchvision_batch(entries, cfg, np.random.default_rng(5), compact_masks=True)
    moved = [(t["mask_crops"].to(dev), t["mask_boxes"].to(dev), im.shape[-2:])
             for im, t in zip(ims, tgts)]
    out = [paste_mask_crops(*m) for m in moved]
    ok = all(o.device.type == dev.type and torch.equal(o.cpu(), f["masks"].as_subclass(
        torch.Tensor)) for o, f in zip(out, full))
    sent = sum(b.numel() + 16 * len(x) for b, x, _ in moved)
    t = _timeit(lambda: [paste_mask_crops(*m) for m in moved], n=10)
    print(f"[6] torchvision masks, 16 images: {sent / 2**20:.2f} MiB of crops instead of "
          f"{sum(f['masks'].numel() for f in full) / 2**20:.1f} MiB, pasted on {dev}: "
          f"{'identical' if ok else 'MISMATCH'}; paste {t * 1e3:.2f} ms/batch")
    return ok


if __name__ == "__main__":
    sys.exit(main())
