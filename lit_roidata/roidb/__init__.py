"""The combined roidb: COCO / LVIS datasets + proposal files → a columnar, cached ``RoIDB``."""

from lit_roidata.roidb.build import (CATEGORY_POLICIES, combined_roidb_for_training,
                                     roidb_for_evaluation)
from lit_roidata.roidb.info import DatasetInfo, RoIDBInputError
from lit_roidata.roidb.columnar import ENTRY_FIELDS, LVIS_ENTRY_FIELDS, RoIDB, RoIEntry

__all__ = ["combined_roidb_for_training", "roidb_for_evaluation", "RoIDB", "RoIEntry",
           "DatasetInfo", "RoIDBInputError", "ENTRY_FIELDS", "LVIS_ENTRY_FIELDS",
           "CATEGORY_POLICIES"]
