"""Object detection for tfmp: anchors and matching, data, losses, COCO evaluation, drawing."""
