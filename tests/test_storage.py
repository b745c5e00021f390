"""Images and annotation files from object storage, against a real S3-API server (moto's
server mode on 127.0.0.1): the roidb and blobs equal the local disk's, one GET per image,
the cache keyed by the object's ETag, and every fault (404, 403, a truncated object, a
timeout, a server restart mid-pass) a named error, a counted skip or a retried read."""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from s3_server import SECRET, LatencyProxy, S3Server, moto_available, s3_server  # noqa: F401

pytestmark = pytest.mark.skipif(not moto_available(), reason="needs moto[server] and s3fs")

BUCKET = "lit-roidata-test"
N_IMAGES = 8


@pytest.fixture(scope="module")
def data(s3_server, tmp_path_factory):  # noqa: F811
    """The demo's ``demo_train_a`` (8 images) on disk and in the bucket; the AWS
    environment pointing at the server through a proxy that counts requests."""
    from lit_roidata import storage
    from lit_roidata.demo.data import ensure_demo_data

    root = tmp_path_factory.mktemp("s3demo")
    info = ensure_demo_data(root, num_images={"demo_train_a": N_IMAGES, "demo_train_b": 1,
                                              "demo_val": 1})["demo_train_a"]
    img_dir = Path(info["image_dir"])
    files = {f"imgs/{p.relative_to(img_dir).as_posix()}": p.read_bytes()
             for p in img_dir.rglob("*") if p.is_file()}
    files["ann/train.json"] = Path(info["annotation_file"]).read_bytes()
    s3_server.upload(BUCKET, files)
    proxy = LatencyProxy(s3_server.port)
    saved = {k: os.environ.get(k) for k in s3_server.env()}
    os.environ.update(s3_server.env(proxy.url))
    storage._FS.clear()  # noqa: SLF001 - a client of this server
    yield {"info": info, "files": files, "proxy": proxy, "server": s3_server, "root": root}
    proxy.close()
    storage._FS.clear()  # noqa: SLF001
    for k, v in saved.items():
        os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def _roidb(data, name, image_dir, annotation_file, cache, **kw):
    from lit_roidata.catalog import Catalog
    from lit_roidata.config import get_cfg
    from lit_roidata.roidb import combined_roidb_for_training

    cat = Catalog(builtins=False)
    cat.register(name, image_dir, annotation_file)
    from lit_roidata.demo.data import DEMO_CATEGORIES

    cfg = get_cfg()
    cfg.merge_from_dict({"MODEL.NUM_CLASSES": len(DEMO_CATEGORIES) + 1})
    return cfg, combined_roidb_for_training([name], [], cfg, cache_dir=str(cache), catalog=cat,
                                            **kw)


def _remote(data, tmp_path, **kw):
    return _roidb(data, "s3_a", f"s3://{BUCKET}/imgs", f"s3://{BUCKET}/ann/train.json",
                  tmp_path / "cache", **kw)


def _pass(cfg, roidb, **kw):
    from lit_roidata.loader import build_train_loader

    loader = build_train_loader(cfg, roidb, seed=3, **kw)
    loader.planned = len(loader)
    return loader, [b for b in loader]


def _same_blobs(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert set(x) == set(y)
        for k in x:
            if k != "_meta":
                assert torch.equal(x[k], y[k]), k


def test_roidb_and_blobs_equal_local_disk_one_get_per_image(data, tmp_path):
    info, proxy = data["info"], data["proxy"]
    cfg, local = _roidb(data, "local_a", info["image_dir"], info["annotation_file"],
                        tmp_path / "lc")
    _, remote = _remote(data, tmp_path)
    assert len(remote) == len(local) == 2 * N_IMAGES  # with the flipped copies
    for i in range(len(local)):
        assert remote[i]["image"] == local[i]["image"].replace(
            info["image_dir"], f"s3://{BUCKET}/imgs")
        assert (remote[i]["boxes"] == local[i]["boxes"]).all()
    _, want = _pass(cfg, local, num_workers=0)
    for workers, ahead in ((0, 0), (2, 2)):
        proxy.counts.clear()
        _, got = _pass(cfg, remote, num_workers=workers, read_ahead=ahead)
        _same_blobs(want, got)
        # one GET per image read, no HEAD; with workers, the stream goes on into the next
        # pass: at most the blocks in flight (2 per worker) and read ahead (2 per worker)
        extra = 0 if workers == 0 else workers * (2 + ahead) * 2
        assert set(proxy.counts) == {"GET"}
        assert len(remote) <= proxy.counts["GET"] <= len(remote) + extra


def test_cache_keyed_by_etag(data, tmp_path):
    proxy, server = data["proxy"], data["server"]
    _, first = _remote(data, tmp_path)
    proxy.counts.clear()
    _, again = _remote(data, tmp_path)
    assert again.path == first.path
    assert proxy.counts.get("GET", 0) == 0  # warm: a HEAD, nothing downloaded
    ann = data["files"]["ann/train.json"]
    server.upload(BUCKET, {"ann/train.json": ann + b"\n"})  # a changed object
    try:
        _, changed = _remote(data, tmp_path)
        assert changed.path != first.path and len(changed) == len(first)
        assert len(os.listdir(tmp_path / "cache" / ".remote")) == 2
    finally:
        server.upload(BUCKET, {"ann/train.json": ann})


def test_missing_and_truncated_objects_named_then_skipped(data, tmp_path):
    from lit_roidata.minibatch.decode import BadImageError, load_image

    server, files = data["server"], data["files"]
    cfg, remote = _remote(data, tmp_path)
    keys = sorted(k for k in files if k.startswith("imgs/"))
    gone, cut = keys[1], keys[4]
    client = server.client()
    client.delete_object(Bucket=BUCKET, Key=gone)
    server.upload(BUCKET, {cut: files[cut][: len(files[cut]) // 2]})
    try:
        from lit_roidata.roidb.info import RoIDBInputError

        with pytest.raises(RoIDBInputError, match=Path(gone).name):  # check_images lists
            _remote(data, tmp_path / "fresh")
        entry = next(remote[i] for i in range(len(remote)) if remote[i]["image"].endswith(gone))
        with pytest.raises(BadImageError, match=f"s3://{BUCKET}/{gone}") as exc:
            load_image(entry)
        assert exc.value.reason == "missing"
        loader, batches = _pass(cfg, remote, num_workers=2, read_ahead=2, on_bad_image="skip")
        counts = loader.skip_policy.exchange(loader.position)["counts"]
        assert counts.get("missing") == 1 and counts.get("undecodable") == 1
        assert len(batches) == loader.planned  # every block delivered
    finally:
        server.upload(BUCKET, {gone: files[gone], cut: files[cut]})


def test_access_denied_names_the_url_and_hides_the_secret(data, tmp_path, monkeypatch):
    from lit_roidata import storage
    from lit_roidata.minibatch.decode import BadImageError, load_image

    # credentials checked after the two set-up requests: a real 403 (unknown access key)
    server = S3Server({"INITIAL_NO_AUTH_ACTION_COUNT": "2"}).start()
    try:
        server.upload(BUCKET, {"a.jpg": data["files"][sorted(data["files"])[0]]})
        monkeypatch.setattr(storage, "RETRY_SECONDS", 2.0)
        monkeypatch.setattr(storage, "_FS", {})
        for k, v in server.env().items():
            monkeypatch.setenv(k, v)
        entry = {"image": f"s3://{BUCKET}/a.jpg", "id": 1, "height": 1, "width": 1}
        with pytest.raises(BadImageError) as exc:
            load_image(entry)
        text = str(exc.value) + str(exc.value.__cause__)
        assert f"s3://{BUCKET}/a.jpg" in text and "denied" in text  # (not retried)
        assert SECRET not in text and exc.value.reason == "unreadable"
    finally:
        server.stop()


def test_secrets_in_urls_never_shown(data):
    from lit_roidata import storage
    from lit_roidata.minibatch.decode import BadImageError, load_image

    url = f"http://user:{SECRET}@127.0.0.1:{data['proxy'].port}/{BUCKET}/x.jpg?X-Amz-Signature=s1g"
    with pytest.raises(BadImageError) as exc:
        load_image({"image": url, "id": 7, "height": 1, "width": 1})
    text = f"{exc.value} {exc.value.path} {exc.value.__cause__}"
    assert SECRET not in text and "s1g" not in text and "127.0.0.1" in text
    assert storage.redact(f"see s3://k:{SECRET}@b/x?sig=1 ok") == "see s3://***@b/x?*** ok"


def test_transfer_cut_short_is_retried_then_named(data, monkeypatch):
    from lit_roidata import storage

    key = sorted(data["files"])[-1]
    cut = LatencyProxy(data["server"].port, cut=len(data["files"][key]) // 2)
    try:
        monkeypatch.setattr(storage, "RETRY_SECONDS", 1.0)
        monkeypatch.setattr(storage, "_FS", {})
        monkeypatch.setenv("AWS_ENDPOINT_URL", cut.url)
        with pytest.raises(storage.StorageError, match=f"cannot read s3://{BUCKET}/{key}"):
            storage.read_bytes(f"s3://{BUCKET}/{key}")
        assert cut.counts["GET"] > 1  # retried
    finally:
        cut.close()


def test_timeout_is_a_named_error_not_a_hang(data, monkeypatch):
    from lit_roidata import storage

    slow = LatencyProxy(data["server"].port, delay=3.0)
    try:
        monkeypatch.setattr(storage, "RETRY_SECONDS", 1.0)
        monkeypatch.setattr(storage, "_FS", {})
        monkeypatch.setenv("AWS_ENDPOINT_URL", slow.url)
        monkeypatch.setitem(storage.DEFAULTS, "s3", {**storage.DEFAULTS["s3"], "config_kwargs": {
            "read_timeout": 0.5, "connect_timeout": 0.5, "retries": {"max_attempts": 1}}})
        t0 = time.monotonic()
        with pytest.raises(storage.StorageError, match=f"cannot read s3://{BUCKET}/imgs"):
            storage.read_bytes(f"s3://{BUCKET}/{sorted(data['files'])[-1]}")
        assert time.monotonic() - t0 < 30  # read_timeout 0.5 s, 1 s of retries: no hang
    finally:
        slow.close()


def test_server_restart_mid_pass_loses_nothing(data, tmp_path):
    info, proxy, server = data["info"], data["proxy"], data["server"]
    cfg, local = _roidb(data, "local_a", info["image_dir"], info["annotation_file"],
                        tmp_path / "lc")
    _, remote = _remote(data, tmp_path)
    _, want = _pass(cfg, local, num_workers=0)
    from lit_roidata.loader import build_train_loader

    loader = build_train_loader(cfg, remote, seed=3, num_workers=2, read_ahead=2)
    got = []
    for batch in loader:
        got.append(batch)
        if len(got) == 3:  # the server goes away while the workers read ahead
            # new requests wait in the proxy until the objects are back (moto keeps them in
            # memory); those in flight fail and are retried
            proxy.open.clear()
            server.restart()
            server.upload(BUCKET, data["files"])
            proxy.open.set()
    _same_blobs(want, got)


def test_block_source_attaches_the_same_workers_next_blocks():
    import pickle

    from lit_roidata.loader import StatefulRoIDataLoader, _AheadBlock  # noqa: PLC2701
    from lit_roidata.sampler import RoIBatchSampler

    class Data(torch.utils.data.Dataset):
        roidb = range(40)

        def __getitems__(self, block):
            return block

    def blocks(read_ahead, workers):
        sampler = RoIBatchSampler(np.full(40, 640), np.full(40, 480), 2, seed=5)
        loader = StatefulRoIDataLoader(Data(), sampler, read_ahead=read_ahead)
        loader._source.ahead = (read_ahead, workers)  # noqa: SLF001 - round robin over 3
        return list(itertools.islice(loader._source, 60))  # noqa: SLF001 - runs on

    plain = blocks(0, 3)
    ahead = blocks(2, 3)
    assert [list(b) for b in ahead] == [list(b) for b in plain]
    for k, blk in enumerate(ahead[:50]):
        assert isinstance(blk, _AheadBlock)
        assert blk.ahead == [i for b in plain[k + 3:k + 7:3] for i in b]
        back = pickle.loads(pickle.dumps(blk))
        assert back == blk and back.ahead == blk.ahead and repr(back) == repr(plain[k])


def test_read_ahead_bounded_and_exact(data):
    from lit_roidata import storage

    keys = sorted(k for k in data["files"] if k.startswith("imgs/"))
    urls = [f"s3://{BUCKET}/{k}" for k in keys]
    ra = storage.ReadAhead(threads=2)
    proxy = data["proxy"]
    proxy.counts.clear()
    windows = [urls[i:i + 3] for i in range(0, len(urls), 2)]
    for k, window in enumerate(windows):
        ra.prefetch(window + ["/a/local/file.jpg"])
        named = set(window) | set(windows[k - 1] if k else ())
        assert set(ra.pending) <= named  # at most the last two windows held
        for u in window[:2]:
            assert ra.get(u) == data["files"][u.split("/", 3)[3]]
    assert proxy.counts == {"GET": len(urls)}  # each object fetched once
