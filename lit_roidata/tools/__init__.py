"""Data tools of ``lit-roidata``: ``inspect``, ``dump-blobs``, ``bench``, ``make-demo-data``.

Each module has a ``main(argv) -> int``; :mod:`lit_roidata.cli` dispatches to them. The
tools read the ``data:`` section of the same YAML file ``lit-roidata fit`` reads (other
sections are ignored), so ``lit-roidata inspect --config configs/demo.yaml`` looks at
exactly the data the training run sees.
"""
