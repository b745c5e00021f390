"""A full disk during a cache build or a proposal column write: a named error (the folder,
the bytes needed, the bytes free, what to do), on a real small file system, and nothing
partial is ever opened later."""

from __future__ import annotations

import errno
import os
import re
import shutil
import subprocess
import tempfile

import numpy as np
import pytest

from lit_roidata.config import get_cfg
from lit_roidata.roidb import combined_roidb_for_training
from lit_roidata.roidb.cache import DiskFullError, write_arrays
from lit_roidata.roidb.proposals import ProposalColumns, read_proposal_file
from roidb_fixtures import make_coco, make_proposals, write_dataset


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs (a real ENOSPC; mounting needs root or CAP_SYS_ADMIN)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command here: cannot make a small file system")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a 2 MiB tmpfs here (needs root): {r.stderr.strip()}")
    try:
        yield str(mnt)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _needed_free(msg: str) -> tuple[int, int]:
    m = re.search(r"needs at least (\d+) bytes .* and (-?\d+) bytes .* are free", msg)
    assert m, msg
    return int(m.group(1)), int(m.group(2))


def test_cache_build_on_a_full_disk_names_folder_and_bytes(tmp_path, small_disk):
    data = make_coco(5, n_images=150, max_anns=4)
    cat = write_dataset(str(tmp_path), "d", data, images=False)
    pfile = make_proposals(1, data, str(tmp_path / "p.pkl"), per_image=1500)
    cache = os.path.join(small_disk, "cache")
    with pytest.raises(DiskFullError) as info:
        combined_roidb_for_training("d", [pfile], get_cfg(), cache, catalog=cat,
                                    check_images=False, trust_pickle=True, progress=False)
    err = info.value
    assert isinstance(err, OSError) and err.errno == errno.ENOSPC
    msg = str(err)
    print(msg)
    assert cache in msg and "sources.cache_dir" in msg and "Free space" in msg
    needed, free = _needed_free(msg)
    assert needed > 1 << 20 and 0 <= free <= 2 << 20
    # nothing partial is left, so nothing partial can be opened later
    assert not [f for f in os.listdir(cache) if f.startswith(("roidb-", ".tmp-"))
                and not f.endswith(".lock")]
    big = str(tmp_path / "cache")
    db = combined_roidb_for_training("d", [pfile], get_cfg(), big, catalog=cat,
                                     check_images=False, trust_pickle=True, progress=False)
    size = sum(os.path.getsize(os.path.join(db.path, f)) for f in os.listdir(db.path))
    assert size > 2 << 20 and needed <= size  # the estimate never exceeds the real need


def test_array_writer_on_a_full_disk(small_disk):
    arr = np.arange(3 << 18, dtype=np.int32)  # 3 MiB
    with pytest.raises(DiskFullError) as info:
        write_arrays(small_disk, {"a": arr})
    assert small_disk in str(info.value)
    needed, _ = _needed_free(str(info.value))
    assert needed > 2 << 20


def test_proposal_columns_on_a_full_disk(small_disk):
    for persistent in (False, True):
        cols = ProposalColumns(small_disk, persistent=persistent)
        n = 100_000  # 16 + 4 + 4 + 4 bytes a row: 2.8 MB
        with pytest.raises(DiskFullError, match=re.escape(small_disk)):
            try:
                cols.append(np.ones((n, 4), np.float32), np.ones(n, np.float32),
                            np.ones(n, np.int32), np.zeros(n, np.int32))
                cols.finish()
            finally:
                cols.close()
        for f in os.listdir(small_disk):
            os.unlink(os.path.join(small_disk, f))


def test_proposal_staging_on_a_full_scratch_disk(tmp_path, small_disk, monkeypatch):
    """A proposal pickle staged beyond its memory budget goes to a scratch file in the
    temporary folder: a full one is named as such (with TMPDIR as the fix)."""
    data = make_coco(5, n_images=150, max_anns=4)
    pfile = make_proposals(1, data, str(tmp_path / "p.pkl"), per_image=1500)
    monkeypatch.setattr(tempfile, "tempdir", small_disk)
    monkeypatch.setenv("LIT_ROIDATA_PROPOSAL_STAGING_BYTES", "0")
    with pytest.raises(DiskFullError, match="TMPDIR") as info:
        read_proposal_file(pfile, trust_pickle=True)
    assert f"scratch folder {small_disk}" in str(info.value)
