"""Wire format of the blob exchange: explicit dtype/shape/byte order, no pickle (Detectron
semantics: cross-process exchange)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from lit_roidata.exchange import WireFormatError
from lit_roidata.exchange import wire
from lit_roidata.exchange.wire import SUPPORTED_DTYPES, decode, encode

NUMPY_DTYPES = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64",
                "uint64", "float16", "float32", "float64", "complex64", "complex128"]
shapes = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5)


@st.composite
def arrays(draw):
    dtype = np.dtype(draw(st.sampled_from(NUMPY_DTYPES)))
    if dtype.itemsize > 1 and draw(st.booleans()):
        dtype = dtype.newbyteorder(">")  # big-endian input must come back equal
    arr = draw(hnp.arrays(dtype, shapes))
    if arr.ndim >= 1 and arr.shape[0] > 1 and draw(st.booleans()):
        arr = arr[::2]  # non-contiguous view
    return arr


def _roundtrip(tensors, meta=None, **kw):
    return decode(bytearray(encode(tensors, meta).tobytes()), **kw)


@settings(deadline=None, max_examples=50)
@given(st.dictionaries(st.text(min_size=1, max_size=8), arrays(), max_size=4),
       st.dictionaries(st.text(max_size=5), st.integers(-2**40, 2**40) | st.floats(
           allow_nan=False, allow_infinity=False) | st.booleans() | st.lists(st.integers(0, 9), max_size=3),
           max_size=3))
def test_numpy_roundtrip_preserves_dtype_shape_values(tensors, meta):
    msg = _roundtrip(tensors, meta)
    assert list(msg.tensors) == list(tensors)
    for name, arr in tensors.items():
        got = msg.tensors[name]
        assert got.shape == arr.shape
        assert got.dtype == arr.dtype.newbyteorder("=")
        assert got.dtype.isnative
        np.testing.assert_array_equal(got, arr)
    assert msg.meta == meta


TORCH_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn,
                torch.float8_e5m2]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@settings(deadline=None, max_examples=40)
@given(st.sampled_from(TORCH_DTYPES), shapes, st.booleans())
def test_torch_roundtrip_including_bfloat16_and_float8(dtype, shape, as_torch):
    src = (torch.randn(shape) * 4).to(dtype)
    got = _roundtrip({"t": src}, as_torch=as_torch).tensors["t"]
    torch_only = dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)
    if as_torch or torch_only:
        assert isinstance(got, torch.Tensor) and got.dtype == dtype
        assert torch.equal(_bytes(got), _bytes(src))  # bit-exact
    else:
        assert isinstance(got, np.ndarray)
        np.testing.assert_array_equal(got, src.numpy())
    assert tuple(got.shape) == tuple(shape)


def test_decoded_arrays_are_writable_and_tensors_do_not_warn():
    msg = _roundtrip({"a": np.arange(6, dtype=np.float32).reshape(2, 3)})
    msg.tensors["a"][0, 0] = 7.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns on non-writable NumPy arrays
        t = torch.from_numpy(msg.tensors["a"])
    assert t[0, 0] == 7.0


def test_zero_d_and_empty_and_gpu_detach_semantics():
    src = {"scalar": np.float32(2.5), "empty": np.zeros((0, 4), np.int64),
           "grad": torch.ones(3, requires_grad=True)}
    msg = _roundtrip(src, {"step": 3})
    assert msg.tensors["scalar"].shape == () and msg.tensors["scalar"] == 2.5
    assert msg.tensors["empty"].shape == (0, 4) and msg.tensors["empty"].dtype == np.int64
    np.testing.assert_array_equal(msg.tensors["grad"], np.ones(3, np.float32))


@settings(deadline=None, max_examples=50)
@given(st.data())
def test_any_single_byte_corruption_is_detected(data):
    buf = bytearray(encode({"x": np.arange(10, dtype=np.int32), "b": np.ones(3, bool)},
                           {"step": 1, "image_ids": [4, 5]}).tobytes())
    pos = data.draw(st.integers(0, len(buf) - 1))
    flip = data.draw(st.integers(1, 255))
    buf[pos] ^= flip
    with pytest.raises(WireFormatError, match="corrupt exchange message"):
        decode(buf)


def test_truncated_or_extended_payload_is_rejected():
    raw = encode({"x": np.arange(100)}).tobytes()
    for bad in (raw[:10], raw[:-1], raw + b"\0"):
        with pytest.raises(WireFormatError):
            decode(bytearray(bad), where=" on channel 'c', seq 4")


def test_unsupported_inputs_name_the_tensor():
    with pytest.raises(WireFormatError, match="'names'.*dtype"):
        encode({"names": np.array(["a", "b"])})
    with pytest.raises(WireFormatError, match="'obj'"):
        encode({"obj": np.array([object()], dtype=object)})
    with pytest.raises(WireFormatError, match="JSON"):
        encode({"x": np.zeros(1)}, {"bad": object()})
    with pytest.raises(WireFormatError, match="'scales\\[1\\]' is inf"):
        encode({}, {"scales": [1.0, float("inf")]})
    with pytest.raises(WireFormatError, match="non-empty strings"):
        encode({3: np.zeros(1)})


def test_meta_accepts_numpy_and_torch_values():
    msg = _roundtrip({}, {"scales": np.array([1.5, 2.0]), "ids": torch.tensor([1, 2]),
                          "step": np.int64(7), "flipped": (True, False)})
    assert msg.meta == {"scales": [1.5, 2.0], "ids": [1, 2], "step": 7,
                        "flipped": [True, False]}


def test_pickle_is_never_used():
    raw = encode({"x": np.arange(3)}, {"k": "v"}).tobytes()
    assert raw.startswith(b"LRXW")
    assert b"\x80\x04" not in raw[:64] and b"numpy" not in raw
    assert set(SUPPORTED_DTYPES) >= {"bool", "bfloat16", "float16", "int64"}


def test_hmac_flag_roundtrip_and_tampering():
    from lit_roidata.exchange import MessageAuthError

    key = b"k" * 32
    arr = np.arange(100, dtype=np.float32)
    raw = bytearray(wire.encode({"a": arr}, {"m": 1}, {"seq": 3}, key=key).tobytes())
    assert wire._PREFIX.unpack_from(raw)[2] == wire.FLAG_HMAC
    msg = wire.decode(raw, key=key)
    np.testing.assert_array_equal(msg.tensors["a"], arr)
    assert msg.envelope == {"seq": 3} and wire.read_envelope(raw, key=key) == {"seq": 3}
    for pos in (0, 7, 30, len(raw) - 40, len(raw) - 1):  # prefix, header, data, tag
        bad = bytearray(raw)
        bad[pos] ^= 0x01
        with pytest.raises(WireFormatError):  # MessageAuthError or a bad prefix
            wire.decode(bad, key=key)
    with pytest.raises(MessageAuthError, match="does not match"):
        wire.decode(raw, key=b"x" * 32)
    with pytest.raises(MessageAuthError, match="no secret"):
        wire.decode(raw)
    plain = wire.encode({"a": arr}).tobytes()
    with pytest.raises(MessageAuthError, match="unauthenticated"):
        wire.decode(plain, key=key)
    unknown = bytearray(raw)
    unknown[6] |= 0x02  # an undefined flag bit
    with pytest.raises(WireFormatError, match="unknown flags"):
        wire.decode(unknown, key=key)
