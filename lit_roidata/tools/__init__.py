"""Data tools of ``lit-roidata`` (each module has a ``main(argv) -> int``, dispatched by
:mod:`lit_roidata.cli`); those that look at the data read the ``data:`` section of the
training YAML file. See docs/cli.md.
"""
