"""The image paths the roidb stores are ``os.path.join(image_dir, image_prefix + file_name)``."""

from __future__ import annotations

import os

from hypothesis import given, settings
from hypothesis import strategies as st

from lit_roidata.catalog import DatasetSpec
from lit_roidata.roidb.build import _image_paths

part = st.text(st.sampled_from("ab/._-é漢 "), max_size=6)


@settings(deadline=None, max_examples=200)
@given(image_dir=st.sampled_from(["", "/data/coco", "/data/coco/", "rel/dir", "/"]),
       prefix=st.sampled_from(["", "COCO_train2014_", "sub/", "/abs/"]),
       names=st.lists(part, max_size=8))
def test_image_paths_match_os_path_join(image_dir, prefix, names):
    spec = DatasetSpec("x", image_dir, "ann.json", image_prefix=prefix)
    want = [os.path.join(image_dir, prefix + n).encode("utf-8") for n in names]
    assert _image_paths(spec, names) == want
