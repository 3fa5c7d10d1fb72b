"""COCO detection metrics with pycocotools' reference COCOeval, from numpy arrays.

    evaluator = evaluation.CocoEvaluator()
    for images, labels, truth in eval_dataset:                   # tfmp.detection.data elements
        detections = boxes.decode_detections(model(images), anchors, image_size=size)
        evaluator.update(truth, detections)
    metrics = evaluator.result()    # {"mAP": ..., "AP50": ..., "AP75": ..., "AP_small": ...}

Or in one call, `coco_metrics(ground_truth, detections)` with one dict per image. Boxes are
xyxy pixels; classes 0..K-1 (pycocotools gets ids 1..K). `update` drops padding rows
(`truth["valid"]` False), ground-truth rows of class -1 and detections past
`valid_detections`, and multiplies boxes by `truth["scale"]`, so boxes and COCO's
small/medium/large areas are in the original image's pixels. Metrics are -1 where COCOeval
has nothing to average (e.g. no large objects), 0.0 for all when there are no detections.
pycocotools' progress prints are silenced.
"""

from __future__ import annotations

import contextlib
import io

import numpy as np
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

# COCOeval.stats[0:6], in its order.
METRIC_NAMES = ("mAP", "AP50", "AP75", "AP_small", "AP_medium", "AP_large")


def _xywh(boxes):
    boxes = np.asarray(boxes, np.float64).reshape(-1, 4)
    return np.concatenate([boxes[:, :2], boxes[:, 2:] - boxes[:, :2]], axis=1)


def coco_metrics(
    ground_truth: list[dict], detections: list[dict], max_detections: int = 100
) -> dict[str, float]:
    """COCO bbox metrics (`METRIC_NAMES`) of a list of images.

    `ground_truth[i]` = {"boxes": [n, 4] xyxy, "classes": [n]} and `detections[i]` =
    {"boxes": [d, 4] xyxy, "scores": [d], "classes": [d]} for the same image i.
    """
    if len(ground_truth) != len(detections):
        raise ValueError(
            f"{len(ground_truth)} ground-truth images but {len(detections)} "
            "detection images; pass one entry per image to both"
        )
    images, annotations, results, class_ids = [], [], [], set()
    for image_id, (truth, found) in enumerate(zip(ground_truth, detections), start=1):
        images.append({"id": image_id})
        for box, class_id in zip(_xywh(truth["boxes"]), np.asarray(truth["classes"]).reshape(-1)):
            annotations.append(
                {
                    "id": len(annotations) + 1,
                    "image_id": image_id,
                    "category_id": int(class_id) + 1,
                    "bbox": box.tolist(),
                    "area": float(box[2] * box[3]),
                    "iscrowd": 0,
                }
            )
            class_ids.add(int(class_id) + 1)
        boxes = _xywh(found["boxes"])
        scores = np.asarray(found["scores"], np.float64).reshape(-1, 1)
        classes = np.asarray(found["classes"]).reshape(-1, 1).astype(np.float64) + 1
        class_ids.update(int(c) for c in classes.reshape(-1))
        results.append(np.concatenate([np.full_like(scores, image_id), boxes, scores, classes], 1))
    results = np.concatenate(results) if results else np.zeros([0, 7])
    if not len(results):
        return dict.fromkeys(METRIC_NAMES, 0.0)
    with contextlib.redirect_stdout(io.StringIO()):
        truth_api = COCO()
        truth_api.dataset = {
            "images": images,
            "annotations": annotations,
            "categories": [{"id": c} for c in sorted(class_ids)],
        }
        truth_api.createIndex()
        evaluator = COCOeval(truth_api, truth_api.loadRes(results), "bbox")
        evaluator.params.maxDets = [1, 10, max_detections]
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
    return {name: float(value) for name, value in zip(METRIC_NAMES, evaluator.stats[:6])}


class CocoEvaluator:
    """Accumulates batches of eval ground truth and decoded detections; `result()` scores them."""

    def __init__(self, max_detections: int = 100):
        self.max_detections = max_detections
        self.reset()

    def reset(self):
        self._truth, self._found, self._ids = [], [], set()

    def update(self, truth: dict, detections: dict) -> None:
        """`truth` as `tfmp.detection.data` eval elements carry it, `detections` as
        `boxes.decode_detections` returns them (tensors or numpy, batched)."""
        truth = {key: np.asarray(value) for key, value in truth.items()}
        detections = {key: np.asarray(value) for key, value in detections.items()}
        for row in range(truth["valid"].shape[0]):
            if not truth["valid"][row]:
                continue
            image_id = int(truth["image_id"][row])
            if image_id in self._ids:
                raise ValueError(
                    f"image {image_id} was evaluated twice; each eval image must "
                    "reach the evaluator exactly once"
                )
            self._ids.add(image_id)
            scale = float(truth["scale"][row])
            keep = truth["classes"][row] >= 0
            self._truth.append(
                {"boxes": truth["boxes"][row][keep] * scale, "classes": truth["classes"][row][keep]}
            )
            count = int(detections["valid_detections"][row])
            self._found.append(
                {
                    "boxes": detections["boxes"][row][:count] * scale,
                    "scores": detections["scores"][row][:count],
                    "classes": detections["classes"][row][:count],
                }
            )

    @property
    def num_images(self) -> int:
        return len(self._truth)

    def result(self) -> dict[str, float]:
        return coco_metrics(self._truth, self._found, self.max_detections)
