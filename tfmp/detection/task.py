"""Object detection as a tfmp task: what `python -m apps.detect` trains, through the same
plan, engine and loop as classification: `tfmp.training.run.train_and_evaluate(config, TASK)`,
`TASK` being a `tfmp.training.task.Task`.

The detector (`tfmp.detection.retinanet`) is compiled with the focal and box losses, whose
normaliser is the positive-anchor count of the *global* batch. The input pipeline hands over
padded ground truth; the losses match the anchors of each replica's whole batch inside the step
(`tfmp.detection.targets`), static-shaped. Evaluation gathers every
eval image's raw outputs from all replicas and workers (`Engine.predict`), decodes them
(float32, TensorFlow's combined NMS) and scores COCO metrics with pycocotools; padded rows are
dropped and each image counts once.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from tfmp.detection import boxes, data, evaluation, losses, retinanet, targets
from tfmp.input import stream
from tfmp.training import fit_data

DECODE_BATCH = 64  # eval rows decoded per NMS call


def compile_detector(
    model: keras.Model, optimizer, strategy, num_anchors: int | None = None, *, matcher=None, max_boxes=None
) -> keras.Model:
    """Compiles a RetinaNet with tfmp's focal + Huber losses and builds them for its labels:
    per-anchor labels of `num_anchors` anchors, or with a `targets.AnchorMatcher` the packed
    ground truth of `max_boxes` rows (`losses.ground_truth_labels`), matched in the step."""
    with strategy.scope():
        # The optimizer has the run's loss scaling (precision.wrap_optimizer); Keras'
        # auto_scale_loss would wrap it again and clear a fixed --loss_scale.
        model.compile(
            optimizer=optimizer,
            loss={"classes": losses.ClassLoss(matcher=matcher), "boxes": losses.BoxLoss(matcher=matcher)},
            auto_scale_loss=False,
        )
    size = model.input_shape[1]
    if matcher is not None:
        truth = tf.TensorSpec((None, max_boxes, 6), tf.float32)
        labels = {"classes": truth, "boxes": truth}
    else:
        labels = {
            "classes": tf.TensorSpec((None, num_anchors), tf.int32),
            "boxes": tf.TensorSpec((None, num_anchors, 5), tf.float32),
        }
    spec = (tf.TensorSpec((None, size, size, 3), tf.float32), labels)
    fit_data.build_for_data(model, strategy, spec)
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
            config.data.dataset,
            image_size=config.data.image_size,
            data_dir=config.data.data_dir,
            max_image_pixels=config.data.max_image_pixels,
        )

    @staticmethod
    def anchors(config, plan):
        return boxes.generate_anchors(plan.info.image_size, retinanet.anchor_config(config.model))

    def build_model(self, config, plan) -> keras.Model:
        with plan.model_strategy.scope():
            return retinanet.build_detector(
                config.model, plan.info.image_size, plan.info.num_classes, dtype=plan.policy
            )

    def compile(self, model, optimizer, plan) -> keras.Model:
        matcher = targets.AnchorMatcher(plan.info.image_size, retinanet.anchor_config(model.name))
        return compile_detector(
            model, optimizer, plan.strategy, matcher=matcher, max_boxes=plan.info.max_boxes
        )

    def load(self, config, plan, split: str, input_context=None, **training_options):
        """`data.load` of `split` as the run's flags ask: ((images, padded truth) batches, shard
        policy); `training_options` (augment, seed, skip_examples) for the training stream."""
        return data.load(
            config.data.dataset,
            split,
            config.data.global_batch_size,
            image_size=plan.info.image_size,
            data_dir=config.data.data_dir,
            input_context=input_context,
            cache=config.data.cache,
            **training_options,
        )

    def elements(self, dataset: tf.data.Dataset, training: bool) -> tf.data.Dataset:
        """`load`'s (images, truth) batches as the engine's elements: (images, labels the losses
        take) to train on, (images, truth) to evaluate (the truth travels to the evaluator)."""
        if training:
            return dataset.map(lambda image, truth: (image, losses.ground_truth_labels(truth)))
        return dataset

    def detections(self, outputs: dict, config, plan) -> dict:
        """Float32 detections (boxes, scores, classes, valid_detections) of gathered outputs."""
        return decode(
            outputs,
            self.anchors(config, plan),
            plan.info.image_size,
            config.detection.score_threshold,
            config.detection.max_detections,
        )

    def train_dataset(self, config, plan, input_context=None, skip_examples: int = 0):
        """(endless stream of the engine's training elements, shard policy); global batches
        without `input_context`, per-replica batches of this pipeline's shard with one. Anchors
        (and Faster R-CNN's ROIs) are matched in the step, not here."""
        dataset, policy = self.load(
            config,
            plan,
            "train",
            input_context,
            augment=config.data.augment,
            seed=config.seed,
            skip_examples=skip_examples,
        )
        return self.elements(dataset, training=True), policy

    def inputs(self, config, plan, engine, start_step: int):
        """One endless training stream positioned at `start_step`, and COCO evaluation."""
        shard_policies = []
        strategy = plan.strategy

        def train_input(input_context):
            skip = start_step * config.data.global_batch_size // input_context.num_input_pipelines
            dataset, policy = self.train_dataset(config, plan, input_context, skip)
            shard_policies.append(policy)
            return stream.with_threads(dataset, config.data.data_threads)

        def eval_input(input_context):
            return self.elements(self.load(config, plan, "eval", input_context)[0], training=False)

        train_iterator = iter(strategy.distribute_datasets_from_function(train_input))
        eval_dataset = strategy.distribute_datasets_from_function(eval_input) if config.evaluate else None

        def evaluate():
            outputs, (_, truth) = engine.predict(eval_dataset)
            evaluator = evaluation.CocoEvaluator(max_detections=config.detection.max_detections)
            evaluator.update(truth, self.detections(outputs, config, plan))
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
