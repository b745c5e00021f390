"""The uint8 blob built by resizing each RGB channel straight into its BGR plane
(``image._build_uint8_planes``, the default loader's path) against main's path (BGR
image, 3-channel resize, ``cv2.split`` into the blob), pixel for pixel."""

from __future__ import annotations

import cv2
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_roidata.minibatch.decode import decode_bgr, decode_rgb, load_image, load_image_rgb
from lit_roidata.minibatch.image import build_image_blob, im_list_to_blob, scale_image
from test_minibatch_helpers import small_cfg


def _main_blob(entries, cfg, rng, loader, alloc=None):
    """main's uint8 path, written out: scale draws, BGR images, resize, split."""
    inds = np.asarray(rng.randint(0, len(cfg.TRAIN.SCALES), size=len(entries))
                      if isinstance(rng, np.random.RandomState)
                      else rng.integers(0, len(cfg.TRAIN.SCALES), size=len(entries)))
    ims, scales = [], []
    for i, e in enumerate(entries):
        im, s = scale_image(loader(e), cfg.TRAIN.SCALES[int(inds[i])], cfg.TRAIN.MAX_SIZE,
                            pixel_format="uint8", pixel_means=cfg.PIXEL_MEANS)
        ims.append(im)
        scales.append(s)
    return im_list_to_blob(ims, fpn_on=cfg.FPN.FPN_ON, coarsest_stride=cfg.FPN.COARSEST_STRIDE,
                           alloc=alloc), scales, [im.shape[:2] for im in ims]


def _image(draw, h, w):
    kind = draw(st.sampled_from(["noise", "smooth", "flat", "edges"]))
    seed = draw(st.integers(0, 2**31 - 1))
    r = np.random.default_rng(seed)
    if kind == "noise":
        return r.integers(0, 256, (h, w, 3), dtype=np.uint8)
    if kind == "flat":
        return np.full((h, w, 3), r.integers(0, 256, 3), np.uint8)
    if kind == "edges":
        im = np.zeros((h, w, 3), np.uint8)
        im[:, w // 2:] = 255
        im[h // 3:, :, 1] = 7
        return im
    small = r.integers(0, 256, (max(h // 7, 1), max(w // 7, 1), 3), dtype=np.uint8)
    return cv2.resize(small, (w, h), interpolation=cv2.INTER_CUBIC)


@st.composite
def _batches(draw):
    n = draw(st.integers(1, 3))
    sizes = [(draw(st.integers(1, 160)), draw(st.integers(1, 160))) for _ in range(n)]
    ims = [_image(draw, h, w) for h, w in sizes]
    # targets from far below to far above the image: downscale (2x exactly too), upscale
    scales = tuple(draw(st.lists(st.sampled_from([1, 2, 7, 16, 31, 32, 64, 77, 100, 160, 199,
                                                   320, 333, 500]), min_size=1, max_size=4)))
    return (ims, scales, draw(st.sampled_from([50, 160, 333, 1000])), draw(st.booleans()),
            draw(st.sampled_from([1, 8, 32])), draw(st.booleans()), draw(st.integers(0, 999)))


@settings(deadline=None, max_examples=200)
@given(_batches())
def test_planes_equal_mains_blob(batch):
    ims, scales, max_size, fpn, stride, legacy, seed = batch
    cfg = small_cfg(**{"TRAIN.SCALES": scales, "TRAIN.MAX_SIZE": max_size,
                       "FPN.FPN_ON": fpn, "FPN.COARSEST_STRIDE": stride})
    entries = [dict(image=f"/x/{i}.jpg", id=i, width=im.shape[1], height=im.shape[0],
                    flipped=False) for i, im in enumerate(ims)]

    def bgr(e):
        return ims[e["id"]]

    def rgb(e):
        return np.ascontiguousarray(ims[e["id"]][:, :, ::-1])
    rgb.channel_order = "rgb"

    mk = np.random.RandomState if legacy else np.random.default_rng
    try:
        ref, ref_scales, ref_sizes = _main_blob(entries, cfg, mk(seed), bgr)
    except cv2.error:  # a side rounds to 0 pixels: OpenCV refuses, in both paths
        with pytest.raises(cv2.error):
            build_image_blob(entries, cfg, mk(seed), pixel_format="uint8", loader=rgb)
        return
    got = build_image_blob(entries, cfg, mk(seed), pixel_format="uint8", loader=rgb)
    assert got.data.dtype == ref.dtype and got.data.shape == ref.shape
    np.testing.assert_array_equal(got.data, ref)
    assert got.im_scales == ref_scales
    assert [tuple(s) for s in got.image_sizes.tolist()] == [tuple(s) for s in ref_sizes]
    # main's public path with a BGR loader gives the same batch (and image metadata)
    old = build_image_blob(entries, cfg, mk(seed), pixel_format="uint8", loader=bgr)
    np.testing.assert_array_equal(got.data, old.data)
    np.testing.assert_array_equal(got.image_sizes, old.image_sizes)
    np.testing.assert_array_equal(got.im_info, old.im_info)


@pytest.mark.parametrize("ext", ["jpg", "png", "bmp"])
@pytest.mark.parametrize("flipped", [False, True])
def test_files_default_loader_equals_mains(tmp_path, ext, flipped):
    r = np.random.default_rng(5)
    entries = []
    for i, (h, w) in enumerate([(480, 640), (333, 500), (37, 1200)]):
        small = r.integers(0, 256, (h // 5, w // 5, 3), dtype=np.uint8)
        p = tmp_path / f"{i}.{ext}"
        cv2.imwrite(str(p), cv2.resize(small, (w, h), interpolation=cv2.INTER_CUBIC))
        entries.append(dict(image=str(p), id=i, width=w, height=h, flipped=flipped))
    np.testing.assert_array_equal(load_image_rgb(entries[0]), load_image(entries[0])[:, :, ::-1])
    data = open(entries[1]["image"], "rb").read()
    np.testing.assert_array_equal(decode_rgb(data), decode_bgr(data)[:, :, ::-1])
    cfg = small_cfg(**{"TRAIN.SCALES": (600, 800), "TRAIN.MAX_SIZE": 1333, "FPN.FPN_ON": True,
                       "FPN.COARSEST_STRIDE": 32})
    calls = []

    def alloc(shape, dtype):
        calls.append(shape)
        return np.zeros(shape, dtype)

    got = build_image_blob(entries, cfg, np.random.default_rng(1), pixel_format="uint8",
                           alloc=alloc)
    ref, scales, _ = _main_blob(entries, cfg, np.random.default_rng(1), load_image)
    assert calls == [ref.shape]
    np.testing.assert_array_equal(got.data, ref)
    assert got.im_scales == scales


def test_resize_writes_into_a_strided_plane():
    src = np.random.default_rng(0).integers(0, 256, (97, 131), dtype=np.uint8)
    blob = np.zeros((3, 200, 256), np.uint8)
    s = 1.5
    h, w = round(97 * s), round(131 * s)
    dst = blob[1, :h, :w]
    out = cv2.resize(src, None, dst, fx=s, fy=s, interpolation=cv2.INTER_LINEAR)
    assert np.shares_memory(out, dst) and out.shape == (h, w)
    np.testing.assert_array_equal(
        dst, cv2.resize(src, None, None, fx=s, fy=s, interpolation=cv2.INTER_LINEAR))
