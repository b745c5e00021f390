"""The single COCO keypoint-name list and Detectron's flip map derived from it."""

from lit_roidata.demo import shapes
from lit_roidata.roidb.info import COCO_KEYPOINT_FLIP_MAP, COCO_KEYPOINT_NAMES, keypoint_flip_map


def test_flip_map_is_detectrons_literal_map():
    # Detectron's datasets/keypoints.py, written out by hand (order included).
    detectron = {"left_eye": "right_eye", "left_ear": "right_ear",
                 "left_shoulder": "right_shoulder", "left_elbow": "right_elbow",
                 "left_wrist": "right_wrist", "left_hip": "right_hip",
                 "left_knee": "right_knee", "left_ankle": "right_ankle"}
    assert list(COCO_KEYPOINT_FLIP_MAP.items()) == list(detectron.items())
    assert keypoint_flip_map(COCO_KEYPOINT_NAMES) == detectron


def test_names_are_coco_and_defined_once():
    assert len(COCO_KEYPOINT_NAMES) == 17 and COCO_KEYPOINT_NAMES[0] == "nose"
    assert COCO_KEYPOINT_NAMES[-1] == "right_ankle"
    assert shapes.COCO_KEYPOINT_NAMES is COCO_KEYPOINT_NAMES  # re-exported, not redefined
