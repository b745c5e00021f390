"""A core install (no extras) imports and runs; each optional feature names its extra.

The optional libraries are hidden for real in a fresh interpreter (a meta-path finder
that refuses to import them), so no import of them at module level can slip through.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lit_roidata._optional import MissingOptionalDependency, require

_BLOCK = textwrap.dedent("""
    import sys

    class _Blocker:
        hidden = ("albumentations", "matplotlib", "pymemcache", "lightning", "faster_coco_eval",
                  "s3fs", "gcsfs")

        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in self.hidden:
                raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)")
            return None

    sys.meta_path.insert(0, _Blocker())

    import importlib.metadata as _md  # "not installed" also means no distribution metadata

    def _hide(real):
        def wrapper(name, *a, **k):
            if name.lower() in _Blocker.hidden:
                raise _md.PackageNotFoundError(name)
            return real(name, *a, **k)
        return wrapper

    _md.version, _md.distribution = _hide(_md.version), _hide(_md.distribution)
""")


def _run(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, LIT_ROIDATA_CACHE=str(tmp_path / "cache"))
    code = _BLOCK + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_core_works_without_the_extras(tmp_path: Path) -> None:
    """Import, roidb build (with proposals) and a minibatch work with no extra installed."""
    r = _run(tmp_path, f"""
        import lit_roidata
        from lit_roidata import DemoRoIDataModule
        from lit_roidata.minibatch import get_minibatch_blob_names

        dm = DemoRoIDataModule(demo_root={str(tmp_path / 'demo')!r},
                           sources={{"cache_dir": {str(tmp_path / 'c')!r}}},
                           model_type="fast_rcnn", loader={{"num_workers": 0}},
                           demo_size={{"demo_train_a": 3, "demo_train_b": 2, "demo_val": 1}},
                           overrides={{"MODEL.NUM_CLASSES": 5, "TRAIN.SCALES": [96],
                                      "TRAIN.MAX_SIZE": 128}})
        dm.prepare_data()
        dm.setup("fit")
        blobs = dm.make_dataset().__getitems__(next(iter(dm.make_sampler())))
        assert "rois" in blobs and "labels_int32" in blobs, sorted(blobs)
        assert len(dm.train_roidb) > 0
        for m in ("albumentations", "matplotlib", "pymemcache", "lightning", "faster_coco_eval"):
            assert m not in sys.modules, m
        print("CORE-OK")
    """)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "CORE-OK" in r.stdout


@pytest.mark.parametrize("use, extra", [
    ("from lit_roidata.minibatch.augment import Augmentation\n"
     "from lit_roidata.config import get_cfg\n"
     "Augmentation([], get_cfg())", "augment"),
    ("from lit_roidata.tools.inspect import plot_histograms\n"
     "plot_histograms(None, None, {}, 'x.png')", "viz"),
    ("from lit_roidata.exchange import BlobExchange\n"
     "BlobExchange(backend='memcached', address='127.0.0.1:1', run_id='r')", "memcached"),
    ("from lit_roidata.lightning import RoIDataModule", "lightning"),
    ("from lit_roidata.callbacks import LVISEvaluator\n"
     "LVISEvaluator()", "lvis"),
    ("from lit_roidata.cli import main\n"
     "main(['fit', '--help'], namespace='lightning.pytorch')", "lightning"),
    ("from lit_roidata.storage import read_bytes\nread_bytes('s3://b/x.jpg')", "s3"),
    ("from lit_roidata.storage import read_bytes\nread_bytes('gs://b/x.jpg')", "gcs"),
])
@pytest.mark.slow
def test_a_missing_extra_is_named(tmp_path: Path, use: str, extra: str) -> None:
    """Using the feature raises an ImportError subclass naming the extra to install."""
    r = _run(tmp_path, f"""
        from lit_roidata._optional import MissingOptionalDependency
        try:
{textwrap.indent(use, ' ' * 12)}
        except MissingOptionalDependency as exc:
            assert isinstance(exc, ImportError)
            print("MESSAGE:", exc)
        else:
            raise SystemExit("no error")
    """)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f'pip install "lit_roidata[{extra}]"' in r.stdout, r.stdout


def test_require_returns_the_module_or_names_the_extra() -> None:
    assert require("json", "x", "y").__name__ == "json"
    with pytest.raises(MissingOptionalDependency,
                       match=r'frobnicating needs .*nope_no_such_mod.*lit_roidata\[viz\]'):
        require("nope_no_such_mod.sub", "viz", "frobnicating")
