"""Object detection as a tfmp task: what `python -m apps.detect` trains, through the same
plan, engine and loop as classification: `tfmp.training.run.train_and_evaluate(config, TASK)`,
`TASK` being a `tfmp.training.task.Task`.

The detector (`tfmp.detection.retinanet`) is compiled with the focal and box losses, whose
normaliser is the positive-anchor count of the *global* batch; anchors are matched in the input
pipeline, so the replica step is static-shaped and XLA-compilable. Evaluation gathers every
eval image's raw outputs from all replicas and workers (`Engine.predict`), decodes them
(float32, TensorFlow's combined NMS) and scores COCO metrics with pycocotools; padded rows are
dropped and each image counts once.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from tfmp.classification import data as classification_data
from tfmp.detection import boxes, data, evaluation, losses, retinanet
from tfmp.training import fitting

DECODE_BATCH = 64  # eval rows decoded per NMS call


def compile_detector(model: keras.Model, optimizer, strategy, num_anchors: int) -> keras.Model:
    """Compiles a RetinaNet with tfmp's focal + Huber losses and builds them for its labels."""
    with strategy.scope():
        model.compile(optimizer=optimizer, loss={"classes": losses.ClassLoss(), "boxes": losses.BoxLoss()})
    size = model.input_shape[1]
    spec = (
        tf.TensorSpec((None, size, size, 3), tf.float32),
        {
            "classes": tf.TensorSpec((None, num_anchors), tf.int32),
            "boxes": tf.TensorSpec((None, num_anchors, 5), tf.float32),
        },
    )
    fitting.build_for_data(model, strategy, spec)
    return model


def decode(outputs: dict, anchors, image_size: int, score_threshold: float, max_detections: int) -> dict:
    """Float32 detections of a batch of raw outputs (NumPy or tensors), in chunks."""
    parts = []
    rows = len(outputs["classes"])
    for start in range(0, rows, DECODE_BATCH):
        chunk = {key: value[start : start + DECODE_BATCH] for key, value in outputs.items()}
        parts.append(
            boxes.decode_detections(
                chunk,
                anchors,
                score_threshold=score_threshold,
                max_detections=max_detections,
                image_size=image_size,
            )
        )
    return {key: np.concatenate([part[key].numpy() for part in parts]) for key in parts[0]}


class DetectionTask:
    models = retinanet.DETECTORS
    model_kind = "detector"
    unit = "images"

    def describe(self, config) -> data.DetectionInfo:
        return data.describe(
            config.data.dataset, image_size=config.data.image_size, data_dir=config.data.data_dir
        )

    @staticmethod
    def anchors(config, plan):
        return boxes.generate_anchors(plan.info.image_size, retinanet.anchor_config(config.model))

    def build_model(self, config, plan) -> keras.Model:
        with plan.strategy.scope():
            return retinanet.build_detector(
                config.model, plan.info.image_size, plan.info.num_classes, dtype=plan.policy
            )

    def compile(self, model, optimizer, plan) -> keras.Model:
        num_anchors = int(
            boxes.generate_anchors(plan.info.image_size, retinanet.anchor_config(model.name)).shape[0]
        )
        return compile_detector(model, optimizer, plan.strategy, num_anchors)

    def inputs(self, config, plan, engine, start_step: int):
        """One endless training stream positioned at `start_step`, and COCO evaluation."""
        shard_policies = []
        strategy, anchors, size = plan.strategy, self.anchors(config, plan), plan.info.image_size

        def train_input(input_context):
            skip = start_step * config.data.global_batch_size // input_context.num_input_pipelines
            dataset, policy = data.load(
                config.data.dataset,
                "train",
                config.data.global_batch_size,
                anchors=anchors,
                image_size=size,
                data_dir=config.data.data_dir,
                input_context=input_context,
                augment=config.data.augment,
                seed=config.seed,
                skip_examples=skip,
            )
            shard_policies.append(policy)
            return classification_data.with_threads(dataset, config.data.data_threads)

        def eval_input(input_context):
            dataset = data.load(
                config.data.dataset,
                "eval",
                config.data.global_batch_size,
                anchors=anchors,
                image_size=size,
                data_dir=config.data.data_dir,
                input_context=input_context,
            )[0]
            # Only images and ground truth travel to the gather: the anchor targets stay behind.
            return dataset.map(lambda image, labels, truth: (image, truth))

        train_iterator = iter(strategy.distribute_datasets_from_function(train_input))
        eval_dataset = strategy.distribute_datasets_from_function(eval_input) if config.evaluate else None

        def evaluate():
            outputs, (_, truth) = engine.predict(eval_dataset)
            evaluator = evaluation.CocoEvaluator(max_detections=config.detection.max_detections)
            evaluator.update(
                truth,
                decode(
                    outputs, anchors, size, config.detection.score_threshold, config.detection.max_detections
                ),
            )
            return {**evaluator.result(), "images": float(evaluator.num_images)}

        return (
            (lambda epoch, steps_done: train_iterator),
            (evaluate if eval_dataset else None),
            shard_policies,
        )

    def card(self, config, plan, model) -> dict:
        info = plan.info
        return {
            "dataset": f"{config.data.dataset} {info.image_size}x{info.image_size}, {info.num_classes} classes, "
            f"{info.train_examples} train / {info.eval_examples} eval",
            "head dtype": "float32",
            "output dtype": ", ".join(f"{name} {tensor.dtype}" for name, tensor in model.output.items()),
            "loss": "focal (alpha 0.25, gamma 2) + Huber on box deltas, over the global positive-anchor count",
            "anchors": f"{int(self.anchors(config, plan).shape[0]):,} (levels "
            f"{retinanet.anchor_config(config.model).levels}, 3 scales x 3 ratios)",
        }

    def headline(self, last_eval: dict) -> tuple[dict, str]:
        fields = {f"eval_{name}": last_eval.get(name) for name in evaluation.METRIC_NAMES}
        if last_eval.get("mAP") is None:
            return fields, "eval mAP n/a"
        return fields, (
            f"eval mAP {last_eval['mAP']:.3f}, AP50 {last_eval['AP50']:.3f}, "
            f"AP75 {last_eval['AP75']:.3f} on {int(last_eval['images'])} images"
        )


TASK = DetectionTask()
