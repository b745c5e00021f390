"""Test oracles, not for training.

:mod:`lit_roidata.testing.reference` is a plain per-entry port of Detectron's roidb code
(pycocotools ``COCO``, Python loops, list of dicts). The test suite checks the columnar
builder against it field by field, and ``benchmarks/roidb_build.py`` times it as the
baseline. It is slow and memory-hungry by design; it computes its own IoU, regression
targets, proposal reading and RLE flipping, so it does not share code with what it checks.
"""
