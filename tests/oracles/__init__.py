"""Test oracles: frozen copies of earlier implementations, and a port of Detectron's roidb.

When a hot path is rewritten for speed, the implementation it replaced is copied here
unchanged and the ``test_*_equivalence`` / ``test_roidb_numtext`` tests compare the two
bit for bit on many generated inputs. The earlier code was itself checked against
Detectron's, so equality with it means the rewrite keeps Detectron's semantics.

Do not edit these modules to follow a change in the package: a deliberate change of
behaviour is a change of the test's expectation, and belongs in the test, with a reason.

* ``anchors``, ``rpn``: RPN labelling on full inside masks (before inside rectangles);
* ``coco``, ``decode``: the COCO table built from Python number objects (before the
  raw-text number parse);
* ``proposals``: the proposal merge on dense proposal/gt blocks;
* ``roidb_blob``: the roidb blob with a ``json`` header;
* ``minibatch``: Fast R-CNN sampling, FPN level assignment and the torchvision masks
  before they were vectorised;
* ``reference``: not a frozen copy but a per-entry port of Detectron's roidb code
  (pycocotools, list of dicts), the oracle of ``test_roidb_equivalence`` and the baseline
  of ``benchmarks/roidb_build.py``; it shares no code with the builder it checks
  (``test_reference_oracle``).
"""
