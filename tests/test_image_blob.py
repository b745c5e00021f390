"""Image blob (Detectron semantics: image blob; tested invariants): decoding, scaling, padding,
pixel formats."""

from __future__ import annotations

import math

import cv2
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from PIL import Image

from lit_roidata.minibatch import BadImageError, get_image_blob, normalize_on_device
from lit_roidata.minibatch.decode import load_image, load_image_rgb
from lit_roidata.minibatch.image import build_image_blob, get_target_scale
from test_minibatch_helpers import small_cfg, write_image

MEANS = np.array([102.9801, 115.9465, 122.7717])


def _entry(path, w, h, **kw):
    e = dict(image=str(path), id=7, width=w, height=h, flipped=False, dataset="demo_ds")
    e.update(kw)
    return e


def _rgb(h=48, w=64, seed=0):
    r = np.random.default_rng(seed)
    small = r.integers(0, 256, (h // 8, w // 8, 3), dtype=np.uint8)
    return cv2.resize(small, (w, h), interpolation=cv2.INTER_CUBIC)


# ----------------------------------------------------------------------------- decoding
def test_decode_jpeg_matches_opencv(tmp_path):
    p = tmp_path / "a.jpg"
    cv2.imwrite(str(p), _rgb(), [cv2.IMWRITE_JPEG_QUALITY, 95])
    got = load_image(_entry(p, 64, 48))
    ref = cv2.imread(str(p))
    assert got.dtype == np.uint8 and got.shape == (48, 64, 3) and got.flags.c_contiguous
    assert np.array_equal(got, ref)  # Detectron's reader, bit for bit


def _save_pil(rgb, fmt, **kw):
    def save(p):
        Image.fromarray(rgb).convert(fmt).save(p, **kw) if fmt else Image.fromarray(rgb).save(p, **kw)
    return save


def _exif(o):
    def save(p):
        im = Image.fromarray(np.ascontiguousarray(_rgb()[:, :, ::-1]))
        ex = im.getexif()
        ex[0x0112] = o
        im.save(p, exif=ex, quality=95)
    return save


_RGB = np.ascontiguousarray(_rgb()[:, :, ::-1])
_EDGE_CASES = {  # name -> writer: every way Detectron's cv2.imread converts to 3 BGR channels
    "exif_6.jpg": _exif(6), "exif_3.jpg": _exif(3), "exif_8.jpg": _exif(8),
    "exif_2.jpg": _exif(2),
    "gray.jpg": _save_pil(_RGB, "L", quality=95), "gray.png": _save_pil(_RGB, "L"),
    "gray_alpha.png": _save_pil(_RGB, "LA"),
    "cmyk.jpg": _save_pil(_RGB, "CMYK", quality=95),
    "palette.png": _save_pil(_RGB, "P"), "palette_t.png": _save_pil(_RGB, "P", transparency=0),
    "palette.gif": _save_pil(_RGB, "P"),
    "rgba.png": _save_pil(_RGB, "RGBA"),
    "progressive.jpg": _save_pil(_RGB, None, quality=90, progressive=True),
    "s444.jpg": _save_pil(_RGB, None, quality=90, subsampling=0),
    "rgb.webp": _save_pil(_RGB, None, quality=80),
    "rgb.tif": _save_pil(_RGB, None),
    "gray16.png": lambda p: cv2.imwrite(str(p), _RGB[:, :, 0].astype(np.uint16) * 257 + 3),
    "rgb16.png": lambda p: cv2.imwrite(str(p), _RGB.astype(np.uint16) * 257 + 5),
}


@pytest.mark.parametrize("name", sorted(_EDGE_CASES))
def test_decode_edge_cases_equal_cv2_imread(tmp_path, name):
    p = tmp_path / name
    _EDGE_CASES[name](p)
    ref = cv2.imread(str(p))  # Detectron: BGR, IMREAD_COLOR
    if ref is None:
        pytest.skip(f"this OpenCV build cannot read {name}")
    h, w = ref.shape[:2]
    got = load_image(_entry(p, w, h))
    assert got.flags.c_contiguous and got.dtype == np.uint8
    np.testing.assert_array_equal(got, ref)
    np.testing.assert_array_equal(load_image_rgb(_entry(p, w, h)), ref[:, :, ::-1])
    if name in ("exif_6.jpg", "exif_8.jpg"):  # the orientation is applied: a quarter turn
        assert got.shape[:2] == _RGB.shape[1::-1]


@settings(deadline=None, max_examples=40)
@given(h=st.integers(1, 90), w=st.integers(1, 90), seed=st.integers(0, 2**16),
       fmt=st.sampled_from(["jpg", "png", "bmp", "webp"]), quality=st.integers(30, 100),
       flipped=st.booleans())
def test_decode_equals_cv2_imread_property(tmp_path_factory, h, w, seed, fmt, quality, flipped):
    im = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    p = tmp_path_factory.mktemp("d") / f"x.{fmt}"
    params = {"jpg": [cv2.IMWRITE_JPEG_QUALITY, quality],
              "webp": [cv2.IMWRITE_WEBP_QUALITY, quality]}.get(fmt, [])
    assert cv2.imwrite(str(p), im, params)
    ref = cv2.imread(str(p))
    got = load_image(_entry(p, w, h, flipped=flipped))
    np.testing.assert_array_equal(got, ref[:, ::-1] if flipped else ref)


@settings(deadline=None, max_examples=30)
@given(cut=st.floats(0.0, 0.999), seed=st.integers(0, 2**16),
       progressive=st.booleans())
def test_truncated_jpeg_is_an_error_property(tmp_path_factory, cut, seed, progressive):
    p = tmp_path_factory.mktemp("t") / "x.jpg"
    Image.fromarray(_rgb(48, 64, seed)).save(p, quality=90, progressive=progressive)
    data = p.read_bytes()
    p.write_bytes(data[:int(len(data) * cut)])
    with pytest.raises(BadImageError) as info:
        load_image(_entry(p, 64, 48))
    assert info.value.reason in ("undecodable", "missing")


def test_decoding_uses_no_deprecated_torchvision_decoder(tmp_path):
    import warnings

    p = tmp_path / "a.jpg"
    cv2.imwrite(str(p), _rgb())
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        load_image(_entry(p, 64, 48))
        load_image_rgb(_entry(p, 64, 48))


def test_decode_png_exact_and_alpha_dropped(tmp_path):
    im = _rgb()
    p = tmp_path / "a.png"
    rgba = np.dstack([im[:, :, ::-1], np.full(im.shape[:2], 17, np.uint8)])
    Image.fromarray(rgba, "RGBA").save(p)
    assert np.array_equal(load_image(_entry(p, 64, 48)), im)


@pytest.mark.parametrize("ext", ["jpg", "png"])
def test_decode_grayscale_gives_three_equal_channels(tmp_path, ext):
    p = tmp_path / f"g.{ext}"
    Image.fromarray(_rgb()[:, :, 0]).convert("L").save(p)
    got = load_image(_entry(p, 64, 48))
    assert got.shape == (48, 64, 3)
    assert np.array_equal(got[:, :, 0], got[:, :, 1]) and np.array_equal(got[:, :, 1], got[:, :, 2])


def test_decode_cmyk_jpeg(tmp_path):
    p = tmp_path / "c.jpg"
    rgb = _rgb()[:, :, ::-1]
    Image.fromarray(np.ascontiguousarray(rgb)).convert("CMYK").save(p, quality=95)
    got = load_image(_entry(p, 64, 48))
    assert got.shape == (48, 64, 3)
    assert np.abs(got[:, :, ::-1].astype(int) - rgb).mean() < 4
    np.testing.assert_array_equal(got, cv2.imread(str(p)))


def test_decode_exif_rotation_applied(tmp_path):
    rgb = np.ascontiguousarray(_rgb()[:, :, ::-1])
    p = tmp_path / "e.jpg"
    im = Image.fromarray(rgb)
    exif = im.getexif()
    exif[0x0112] = 6  # rotate 90 CW on display
    im.save(p, exif=exif, quality=95)
    got = load_image(_entry(p, 48, 64))  # annotation in display orientation
    want = np.rot90(rgb, k=-1)
    assert got.shape == (64, 48, 3)
    assert np.abs(got[:, :, ::-1].astype(int) - want).mean() < 3
    with pytest.raises(BadImageError, match="swapped.*EXIF"):
        load_image(_entry(p, 64, 48))


def test_decode_16bit_png_and_bmp_fallback(tmp_path):
    g16 = (_rgb()[:, :, 0].astype(np.uint16) * 257)
    p = tmp_path / "g16.png"
    cv2.imwrite(str(p), g16)
    got = load_image(_entry(p, 64, 48))
    assert np.array_equal(got[:, :, 0], (g16 >> 8).astype(np.uint8))
    b = tmp_path / "x.bmp"
    cv2.imwrite(str(b), _rgb())
    assert np.array_equal(load_image(_entry(b, 64, 48)), _rgb())


def test_flipped_entry_mirrors_columns(tmp_path):
    p = tmp_path / "a.png"
    im = write_image(p, 64, 48)
    assert np.array_equal(load_image(_entry(p, 64, 48, flipped=True)), im[:, ::-1])


@pytest.mark.parametrize("case", ["missing", "truncated", "garbage", "size"])
def test_bad_images_name_path_id_dataset(tmp_path, case):
    p = tmp_path / "bad.jpg"
    if case != "missing":
        cv2.imwrite(str(p), _rgb())
    if case == "truncated":
        p.write_bytes(p.read_bytes()[:300])
    if case == "garbage":
        p.write_bytes(b"not an image at all")
    w = 65 if case == "size" else 64
    with pytest.raises(BadImageError) as info:
        load_image(_entry(p, w, 48))
    msg = str(info.value)
    assert str(p) in msg and "image id 7" in msg and "demo_ds" in msg and "Fix:" in msg
    assert info.value.reason == {"missing": "missing", "truncated": "undecodable",
                                 "garbage": "undecodable", "size": "size_mismatch"}[case]


# ----------------------------------------------------------------------------- scaling
def test_target_scale_hand_cases():
    assert get_target_scale(480, 640, 800, 1333) == 800 / 480
    # 800/375*1000 = 2133 > 1333: the longer side is capped instead
    assert get_target_scale(375, 1000, 800, 1333) == 1333 / 1000
    # round(800/600*1000) = 1333 is not > 1333: shorter side wins
    assert get_target_scale(600, 1000, 800, 1333) == 800 / 600


def test_detectron_format_is_opencv_float_pipeline(tmp_path):
    p = tmp_path / "a.png"
    im = write_image(p, 64, 48)
    cfg = small_cfg(**{"TRAIN.SCALES": (40,)})
    blob, scales = get_image_blob([_entry(p, 64, 48)], cfg, np.random.RandomState(0))
    ref = im.astype(np.float32)
    ref -= MEANS.reshape(1, 1, 3)
    ref = cv2.resize(ref, None, None, fx=40 / 48, fy=40 / 48, interpolation=cv2.INTER_LINEAR)
    assert scales == [40 / 48]
    assert blob.dtype == np.float32 and blob.shape == (1, 3, 40, 53)
    assert np.array_equal(blob[0], ref.transpose(2, 0, 1))


def test_uint8_resize_within_one_grey_level_of_float(tmp_path):
    p = tmp_path / "a.png"
    write_image(p, 640, 480, seed=3)
    cfg = small_cfg(**{"TRAIN.SCALES": (800,), "TRAIN.MAX_SIZE": 1333})
    e = [_entry(p, 640, 480)]
    f = build_image_blob(e, cfg, np.random.default_rng(0), pixel_format="detectron").data
    u = build_image_blob(e, cfg, np.random.default_rng(0), pixel_format="uint8")
    assert u.data.dtype == np.uint8
    dev = normalize_on_device(torch.from_numpy(u.data), u.image_sizes, cfg.PIXEL_MEANS).numpy()
    diff = np.abs(dev - f)
    assert diff.mean() < 0.5 and diff.max() <= 1.0 + 1e-3


@settings(deadline=None, max_examples=30)
@given(st.lists(st.tuples(st.integers(8, 90), st.integers(8, 90)), min_size=1, max_size=3),
       st.lists(st.integers(10, 80), min_size=1, max_size=3), st.integers(20, 120),
       st.booleans(), st.sampled_from([8, 32]), st.integers(0, 2**31 - 1))
def test_blob_shape_scale_padding_im_info(sizes, scales, max_size, fpn, stride, seed):
    """Detectron semantics: tested invariants for any image sizes, scales, MAX_SIZE and FPN
    padding."""
    cfg = small_cfg(**{"TRAIN.SCALES": tuple(scales), "TRAIN.MAX_SIZE": max_size,
                       "FPN.FPN_ON": fpn, "FPN.COARSEST_STRIDE": stride})
    ims = {i: np.full((h, w, 3), 200, np.uint8) for i, (w, h) in enumerate(sizes)}
    entries = [dict(image=f"/x/{i}.jpg", id=i, width=w, height=h, flipped=False)
               for i, (w, h) in enumerate(sizes)]
    for fmt in ("uint8", "detectron"):
        b = build_image_blob(entries, cfg, np.random.default_rng(seed), pixel_format=fmt,
                             loader=lambda e: ims[e["id"]])
        n, c, H, W = b.data.shape
        assert (n, c) == (len(sizes), 3)
        if fpn:
            assert H % stride == 0 and W % stride == 0
        for i, (w, h) in enumerate(sizes):
            s = b.im_scales[i]
            assert round(max(h, w) * s) <= max_size
            assert (round(min(h, w) * s) in scales
                    or abs(round(max(h, w) * s) - max_size) <= 1)
            hh, ww = b.image_sizes[i]
            assert (hh, ww) == (round(h * s), round(w * s))
            assert np.allclose(b.im_info[i], [round(h * s), round(w * s), s])
            assert not b.data[i, :, hh:, :].any() and not b.data[i, :, :, ww:].any()
            inside = b.data[i, :, :hh, :ww]
            if fmt == "uint8":
                assert (inside == 200).all()
        assert H == max(int(x) for x in b.image_sizes[:, 0]) if not fpn else \
            H == int(math.ceil(b.image_sizes[:, 0].max() / stride) * stride)


def test_scale_draws_follow_randomstate_order():
    cfg = small_cfg(**{"TRAIN.SCALES": (20, 30, 40, 50)})
    entries = [dict(image="", id=i, width=60, height=50, flipped=False) for i in range(3)]
    b = build_image_blob(entries, cfg, np.random.RandomState(11), pixel_format="uint8",
                         loader=lambda e: np.zeros((50, 60, 3), np.uint8))
    inds = np.random.RandomState(11).randint(0, 4, size=3)
    assert [round(s * 50) for s in b.im_scales] == [cfg.TRAIN.SCALES[i] for i in inds]


# ----------------------------------------------------------------------------- on device
def test_normalize_on_device_exact_lut_and_padding():
    r = np.random.default_rng(0)
    data = r.integers(0, 256, (2, 3, 16, 20), dtype=np.uint8)
    sizes = np.array([[16, 13], [9, 20]])
    data[0, :, :, 13:] = 0
    data[1, :, 9:, :] = 0
    out = normalize_on_device(torch.from_numpy(data), sizes, MEANS).numpy()
    ref = (data.astype(np.float64) - MEANS.reshape(1, 3, 1, 1)).astype(np.float32)
    ref[0, :, :, 13:] = 0
    ref[1, :, 9:, :] = 0
    assert out.dtype == np.float32 and np.array_equal(out, ref)
    im_info = np.array([[16, 13, 1.0], [9, 20, 1.0]], np.float32)
    assert np.array_equal(normalize_on_device(torch.from_numpy(data), torch.from_numpy(im_info),
                                              MEANS).numpy(), ref)
    fast = normalize_on_device(torch.from_numpy(data), sizes, MEANS, exact=False).numpy()
    assert np.abs(fast - ref).max() < 1e-4
    with pytest.raises(ValueError):
        normalize_on_device(torch.from_numpy(data).float(), sizes, MEANS)


@settings(deadline=None, max_examples=40)
@given(st.integers(1, 3), st.integers(1, 40), st.integers(1, 40), st.booleans(),
       st.integers(0, 2**31 - 1))
def test_normalize_on_device_cpu_path_matches_float64_reference(n, H, W, strided, seed):
    """The CPU path (a table lookup per image plane, padding zeroed) gives Detectron's
    ``float32(float64(v) - mean)`` for every value, any sizes (full, partial, larger
    than the canvas), and non-contiguous input."""
    r = np.random.default_rng(seed)
    full = r.integers(0, 256, (n, 3, H, 2 * W if strided else W), dtype=np.uint8)
    data = torch.from_numpy(full)[..., ::2] if strided else torch.from_numpy(full)
    sizes = np.stack([r.integers(0, H + 3, n), r.integers(0, W + 3, n)], 1)
    out = normalize_on_device(data, sizes, MEANS).numpy()
    ref = (data.numpy().astype(np.float64) - MEANS.reshape(1, 3, 1, 1)).astype(np.float32)
    for i, (h, w) in enumerate(sizes):
        ref[i, :, h:, :] = 0
        ref[i, :, :, w:] = 0
    assert out.dtype == np.float32 and out.shape == (n, 3, H, W)
    assert np.array_equal(out, ref)
