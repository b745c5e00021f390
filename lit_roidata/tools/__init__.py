"""Data tools of ``lit-roidata``: ``inspect``, ``dump-blobs``, ``bench``, ``make-demo-data``,
``convert-proposals``, ``cache``.

Each module has a ``main(argv) -> int``; :mod:`lit_roidata.cli` dispatches to them. The
tools that look at the data read the ``data:`` section of the same YAML file
``lit-roidata fit`` reads (other sections are ignored), so ``lit-roidata inspect --config
configs/demo.yaml`` looks at exactly the data the training run sees; they build the data
module, so they import torch and Lightning. ``cache``, ``convert-proposals`` and
``make-demo-data`` import neither (``tests/test_cli.py`` checks the first two).
"""
