"""RetinaNet builders at their earlier import path; they live in `tfmp.detection.retinanet`."""

from tfmp.detection.retinanet import anchor_config, build_detector  # noqa: F401
