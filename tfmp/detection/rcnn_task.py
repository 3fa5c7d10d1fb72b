"""Faster R-CNN as a tfmp task: what `python -m apps.detect --model=faster_rcnn_tiny` trains,
through the same plan, engine and loop as RetinaNet (`train_and_evaluate(config, task=TASK)`).

How it plugs into the one engine: the model's inputs are the images AND the padded ground
truth (`{"images", "gt_boxes", "gt_classes"}`, elements `(inputs,)` with no separate labels),
because the second stage samples its ROIs from the proposals and the ground truth inside the
forward pass. The engine calls `model.compute_loss` as for any compiled model;
`faster_rcnn.FasterRCNN.compute_loss` matches anchors and ROIs on the device and returns the
four losses of `tfmp.detection.rcnn_losses`, each over a global-batch count (`global_sum`).
Evaluation gathers the model's own float32 detections (per-class NMS inside the model) from
every replica and worker (`Engine.predict`) and scores COCO metrics with pycocotools.

XLA (`--xla=on`): proposals and ROI sampling have data-dependent shapes, and ROIAlign
(`CropAndResize`) and NMS (`CombinedNonMaxSuppression`) have no XLA kernels, so the engine
compiles only the static-shaped parts (`FasterRCNN.compiled_forward`): the backbone, FPN and
RPN head, and the box head, each with its gradient.
"""

from __future__ import annotations

import dataclasses

import keras
import tensorflow as tf

from tfmp.detection import boxes, faster_rcnn, proposals, rcnn_losses
from tfmp.detection.task import DetectionTask
from tfmp.training import fit_data


def model_inputs(images, truth: dict) -> dict:
    """The model's inputs from `tfmp.detection.data` ground truth (classes -1 where not valid)."""
    classes = tf.where(truth["box_valid"], tf.cast(truth["classes"], tf.int32), -1)
    return {"images": images, "gt_boxes": truth["boxes"], "gt_classes": classes}


def model_elements(dataset: tf.data.Dataset, with_truth: bool = False) -> tf.data.Dataset:
    """`data.load` batches (image, truth) as the engine's elements: `(inputs,)` to train on,
    `(inputs, truth)` to evaluate (the truth travels along to the COCO evaluator)."""
    if with_truth:
        return dataset.map(lambda images, truth: (model_inputs(images, truth), truth))
    return dataset.map(lambda images, truth: (model_inputs(images, truth),))


@dataclasses.dataclass(frozen=True)
class FasterRCNNTask(DetectionTask):
    """`class_loss` "focal" | "softmax" (second stage); top-k counts None = the model's defaults."""

    class_loss: str = "focal"
    pre_nms_top_k: int | None = None
    post_nms_top_k: int | None = None

    models = faster_rcnn.DETECTORS

    def build_model(self, config, plan) -> keras.Model:
        rcnn_losses.FasterRCNNLoss(self.class_loss)  # an unknown name fails before anything is built
        options = {
            "score_threshold": config.detection.score_threshold,
            "max_detections": config.detection.max_detections,
        }
        for name in ("pre_nms_top_k", "post_nms_top_k"):
            if getattr(self, name) is not None:
                options[name] = getattr(self, name)
        with plan.strategy.scope():
            return faster_rcnn.build_detector(
                config.model, plan.info.image_size, plan.info.num_classes, dtype=plan.policy, **options
            )

    def compile(self, model, optimizer, plan) -> keras.Model:
        with plan.strategy.scope():
            # auto_scale_loss=False: the optimizer has the run's loss scaling (see compile_detector).
            model.compile(
                optimizer=optimizer, loss=rcnn_losses.FasterRCNNLoss(self.class_loss), auto_scale_loss=False
            )
        size = plan.info.image_size
        spec = (
            {
                "images": tf.TensorSpec((None, size, size, 3), tf.float32),
                "gt_boxes": tf.TensorSpec((None, plan.info.max_boxes, 4), tf.float32),
                "gt_classes": tf.TensorSpec((None, plan.info.max_boxes), tf.int32),
            },
        )
        fit_data.build_for_data(model, plan.strategy, spec)
        return model

    def elements(self, dataset: tf.data.Dataset, training: bool) -> tf.data.Dataset:
        return model_elements(dataset, with_truth=not training)

    def detections(self, outputs: dict, config, plan) -> dict:
        """The model's own float32 detections (per-class NMS inside the model)."""
        return {key: outputs[key] for key in ("boxes", "scores", "classes", "valid_detections")}

    def card(self, config, plan, model) -> dict:
        info = plan.info
        size, anchors = model.anchor_config()
        proposals_layer = model.get_layer(f"{model.name}_proposals")
        sampler = model.get_layer(f"{model.name}_sample_rois")
        return {
            "dataset": f"{config.data.dataset} {info.image_size}x{info.image_size}, {info.num_classes} classes, "
            f"{info.train_examples} train / {info.eval_examples} eval",
            "head dtype": "float32 (RPN outputs, proposals, ROIAlign, box head outputs, NMS)",
            "output dtype": ", ".join(f"{name} {tensor.dtype}" for name, tensor in model.output.items()),
            "loss": f"RPN BCE + Huber over the global sampled-anchor count; 2nd stage {self.class_loss} + "
            "Huber over the global sampled-ROI count",
            "anchors": f"{int(boxes.generate_anchors(size, anchors).shape[0]):,} (levels {anchors.levels}, "
            f"{len(anchors.scales)} scale(s) x {len(anchors.ratios)} ratios)",
            "proposals": f"pre-NMS top {proposals_layer.pre_nms_top_k} per level, post-NMS top "
            f"{proposals_layer.post_nms_top_k} per image (NMS IoU {proposals.PROPOSAL_NMS_IOU}); "
            f"{sampler.rois_per_image} ROIs per image in training",
        }


TASK = FasterRCNNTask()
