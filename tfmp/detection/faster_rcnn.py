"""Faster R-CNN with an FPN (Ren et al. 2015; Lin et al. 2017) as pure Keras builders.

    model = build_detector("faster_rcnn_tiny", 128, num_classes=6, dtype="mixed_bfloat16")
    model.compile(optimizer, loss=rcnn_losses.FasterRCNNLoss("focal"))
    outputs = model({"images": images, "gt_boxes": boxes, "gt_classes": classes})
    outputs["boxes"], outputs["scores"], outputs["classes"], outputs["valid_detections"]

The graph: backbone (C3-C5) -> FPN -> RPN (a shared 3x3 conv, then objectness and 4 deltas
per anchor on every level) -> proposals (`proposals.Proposals`: per-level top-k, decode, one
NMS per image) -> [training: ROI sampling with the ground truth added] -> ROIAlign
(`roi_align.ROIAlign`, 7x7 from the level chosen by box size) -> box head (two fully connected
layers, then background + K class logits and 4 deltas per class) -> final per-class NMS.

Training needs the ground truth inside the step (to sample ROIs), so the model's inputs are a
dict of the images and the padded ground truth (`gt_boxes` [B, M, 4] xyxy pixels, `gt_classes`
[B, M] int32, -1 for padding; M any); inference ignores the ground truth (pass one row of -1).
`FasterRCNN.compute_loss` (what tfmp's engine and Keras' `fit` call) computes the four losses
of `tfmp.detection.rcnn_losses` from the model's inputs and outputs, so the one engine trains
it like any compiled model, on any strategy.

Precision: the convolutions and the box head's hidden layers compute in the policy's dtype;
every box-related step (RPN outputs, anchors, decoding, NMS, ROI coordinates and sampling,
the head's last layers, the losses) is float32 whatever the policy. Outputs (all float32 but
the int32 `classes`/`valid_detections`): `rpn_scores` [B, A], `rpn_deltas` [B, A, 4], `rois`
[B, R, 4] and `roi_weights` [B, R] (sampled ROIs when training, proposals otherwise),
`roi_classes` [B, R, K + 1], `roi_deltas` [B, R, 4 K], and the detections `boxes` [B, D, 4],
`scores` [B, D], `classes` [B, D], `valid_detections` [B] (zeros in training mode: no NMS).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import keras
import tensorflow as tf

from tfmp.detection import boxes, proposals
from tfmp.detection.retinanet import conv, feature_pyramid, resnet50_backbone, tiny_backbone
from tfmp.detection.roi_align import ROIAlign
from tfmp.errors import UsageError, unknown
from tfmp.models import check_dtype_policy
from tfmp.models.cnn import image_input

DETECTION_NMS_IOU, DETECTION_SCORE_THRESHOLD, MAX_DETECTIONS = 0.5, 0.05, 100


@keras.saving.register_keras_serializable(package="tfmp")
class Detections(keras.layers.Layer):
    """Final detections: softmax scores per class, class-specific boxes decoded from the ROIs,
    per-class NMS (`tf.image.combined_non_max_suppression`), all float32. No NMS when training."""

    def __init__(self, image_size, num_classes, max_detections, score_threshold, iou_threshold, **kwargs):
        kwargs["dtype"] = "float32"
        kwargs["trainable"] = False
        super().__init__(**kwargs)
        self.image_size, self.num_classes, self.max_detections = image_size, num_classes, max_detections
        self.score_threshold, self.iou_threshold = score_threshold, iou_threshold

    def call(self, inputs, training=None):
        rois, weights, logits, deltas = inputs
        batch = tf.shape(rois)[0]
        if training:
            zeros = tf.zeros([batch, self.max_detections])
            return {
                "boxes": tf.zeros([batch, self.max_detections, 4]),
                "scores": zeros,
                "classes": tf.cast(zeros, tf.int32),
                "valid_detections": tf.zeros([batch], tf.int32),
            }
        scores = tf.nn.softmax(tf.cast(logits, tf.float32), axis=-1)[..., 1:] * weights[..., None]
        per_class = tf.reshape(tf.cast(deltas, tf.float32), [batch, -1, self.num_classes, 4])
        anchors = tf.repeat(tf.cast(rois, tf.float32)[:, :, None, :], self.num_classes, axis=2)
        decoded = tf.clip_by_value(boxes.decode(anchors, per_class), 0.0, float(self.image_size))
        found, found_scores, found_classes, count = tf.image.combined_non_max_suppression(
            decoded,
            scores,
            max_output_size_per_class=self.max_detections,
            max_total_size=self.max_detections,
            iou_threshold=self.iou_threshold,
            score_threshold=self.score_threshold,
            clip_boxes=False,
        )
        return {
            "boxes": found,
            "scores": found_scores,
            "classes": tf.cast(found_classes, tf.int32),
            "valid_detections": tf.cast(count, tf.int32),
        }

    def compute_output_spec(self, inputs, training=None):
        batch, count = inputs[0].shape[0], self.max_detections
        return {
            "boxes": keras.KerasTensor((batch, count, 4), "float32"),
            "scores": keras.KerasTensor((batch, count), "float32"),
            "classes": keras.KerasTensor((batch, count), "int32"),
            "valid_detections": keras.KerasTensor((batch,), "int32"),
        }

    def get_config(self):
        return {
            **super().get_config(),
            "image_size": self.image_size,
            "num_classes": self.num_classes,
            "max_detections": self.max_detections,
            "score_threshold": self.score_threshold,
            "iou_threshold": self.iou_threshold,
        }


@keras.saving.register_keras_serializable(package="tfmp")
class FasterRCNN(keras.Model):
    """A functional Faster R-CNN whose `compile(optimizer, loss=FasterRCNNLoss(...))` keeps the
    loss object and whose `compute_loss` applies it to the step's inputs and outputs."""

    def compile(self, optimizer="adam", loss=None, **kwargs):
        self.rcnn_loss = loss
        super().compile(optimizer=optimizer, **kwargs)

    def anchor_config(self) -> tuple[int, boxes.AnchorConfig]:
        """(image size, anchor config) of the RPN, from its proposals layer."""
        layer = self.get_layer(f"{self.name}_proposals")
        return layer.image_size, layer.config

    # What `compiled_forward` hands to XLA (the engine's run card and docs quote it).
    XLA_PARTS = (
        "backbone, FPN, RPN head and box head compiled per replica; proposals, ROI sampling, "
        "ROIAlign and NMS run outside XLA"
    )

    def compiled_forward(self, jit_compile: bool = True):
        """The engine's forward pass under `--xla=on`: `fn(inputs, training) -> outputs`.

        The whole model cannot be one XLA cluster: proposals and ROI sampling have
        data-dependent top-k/NMS, and CropAndResize and NMS have no XLA kernel. So the model
        runs as three sub-models sharing its layers (and variables): images -> RPN outputs and
        the ROI features (static shapes: compiled), -> proposals, sampled ROIs and ROIAlign (not
        compiled), pooled ROIs -> box head (static shapes: compiled); then the detections layer.
        The gradient of each compiled part is compiled with it. `jit_compile=False` runs the
        same split uncompiled (tests compare it with one call of the model)."""
        name, outputs = self.name, self.output
        images, gt_boxes, gt_classes = (self.input[key] for key in ("images", "gt_boxes", "gt_classes"))
        roi_align = self.get_layer(f"{name}_roi_align")
        _, *features = roi_align.input
        rpn = [outputs["rpn_scores"], outputs["rpn_deltas"]]
        sampled = [outputs["rois"], outputs["roi_weights"], roi_align.output]
        dense = keras.Model(images, [*rpn, *features], name=f"{name}_xla_dense")
        rois = keras.Model([*rpn, *features, gt_boxes, gt_classes], sampled, name=f"{name}_rois")
        head = keras.Model(
            roi_align.output, [outputs["roi_classes"], outputs["roi_deltas"]], name=f"{name}_xla_head"
        )
        detections = self.get_layer(f"{name}_detections")
        compiled = lambda model: tf.function(model, jit_compile=True) if jit_compile else model  # noqa: E731
        dense_call, head_call = compiled(dense), compiled(head)

        def forward(inputs, training=False):
            scores, deltas, *levels = dense_call(inputs["images"], training=training)
            truth = [inputs["gt_boxes"], inputs["gt_classes"]]
            sampled, weights, pooled = rois([scores, deltas, *levels, *truth], training=training)
            logits, roi_deltas = head_call(pooled, training=training)
            found = detections([sampled, weights, logits, roi_deltas], training=training)
            return {
                "rpn_scores": scores,
                "rpn_deltas": deltas,
                "rois": sampled,
                "roi_weights": weights,
                "roi_classes": logits,
                "roi_deltas": roi_deltas,
                **found,
            }

        return forward

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        if getattr(self, "rcnn_loss", None) is None:
            raise UsageError(f"model {self.name!r} needs compile(optimizer, loss=FasterRCNNLoss(...))")
        if self.losses:
            raise UsageError(
                f"model {self.name!r} has regularisation losses; use the optimizer's weight decay"
            )
        anchors = boxes.generate_anchors(*self.anchor_config())
        return self.rcnn_loss(x, y_pred, anchors)


def _rpn_head(pyramid, levels, anchors_per_location, width, name, dtype):
    """Shared 3x3 conv + relu, then float32 1x1 objectness and deltas; [B, A], [B, A, 4]."""
    init = keras.initializers.RandomNormal(stddev=0.01)
    hidden = conv(width, 3, f"{name}_rpn_conv", dtype, None, activation="relu", kernel_initializer=init)
    objectness = conv(
        anchors_per_location, 1, f"{name}_rpn_objectness_conv", "float32", None, kernel_initializer=init
    )
    deltas = conv(
        4 * anchors_per_location, 1, f"{name}_rpn_deltas_conv", "float32", None, kernel_initializer=init
    )
    scores, boxes_ = [], []
    for level, features in zip(levels, pyramid):
        shared = hidden(features)
        scores.append(
            keras.layers.Reshape((-1,), dtype="float32", name=f"{name}_rpn_scores_p{level}")(
                objectness(shared)
            )
        )
        boxes_.append(
            keras.layers.Reshape((-1, 4), dtype="float32", name=f"{name}_rpn_deltas_p{level}")(deltas(shared))
        )
    concat = lambda parts, kind: keras.layers.Concatenate(axis=1, dtype="float32", name=f"{name}_{kind}")(
        parts
    )  # noqa: E731
    return concat(scores, "rpn_scores"), concat(boxes_, "rpn_deltas")


def _box_head(pooled, num_classes, width, roi_size, channels, name, dtype):
    """Flatten each 7x7 ROI, two fully connected layers (policy dtype), float32 outputs."""
    x = keras.layers.Reshape((-1, roi_size * roi_size * channels), dtype=dtype, name=f"{name}_head_flatten")(
        pooled
    )
    for index in (1, 2):
        x = keras.layers.Dense(width, activation="relu", dtype=dtype, name=f"{name}_head_fc{index}")(x)
    logits = keras.layers.Dense(
        num_classes + 1,
        dtype="float32",
        name=f"{name}_head_classes",
        kernel_initializer=keras.initializers.RandomNormal(stddev=0.01),
    )(x)
    deltas = keras.layers.Dense(
        4 * num_classes,
        dtype="float32",
        name=f"{name}_head_deltas",
        kernel_initializer=keras.initializers.RandomNormal(stddev=0.001),
    )(x)
    return logits, deltas


def _check(image_size, num_classes, levels, roi_levels, name):
    if not isinstance(image_size, int) or isinstance(image_size, bool) or image_size < 32 or image_size % 32:
        raise UsageError(f"detector {name!r} needs image_size a multiple of 32 (>= 32), got {image_size!r}")
    if not isinstance(num_classes, int) or num_classes < 1:
        raise UsageError(f"detector {name!r} needs num_classes >= 1, got {num_classes!r}")
    if not levels or levels != tuple(range(3, 3 + len(levels))) or levels[-1] > 7:
        raise UsageError(
            f"bad FPN levels {levels!r} for {name!r}; use consecutive levels from 3 up to at most 7"
        )
    if not roi_levels or not set(roi_levels) <= set(levels) or max(roi_levels) > 5:
        raise UsageError(f"bad ROI levels {roi_levels!r} for {name!r}; use FPN levels among 3, 4, 5")


def faster_rcnn(
    image_size: int,
    num_classes: int,
    dtype: str | None = None,
    name: str = "faster_rcnn",
    *,
    backbone: str = "tiny",
    levels: tuple[int, ...] = (3, 4, 5, 6, 7),
    roi_levels: tuple[int, ...] = (3, 4, 5),
    anchors: boxes.AnchorConfig = boxes.AnchorConfig(scales=(1.0,)),
    fpn_width: int = 256,
    head_width: int = 1024,
    roi_size: int = 7,
    canonical_size: float = 224.0,
    pre_nms_top_k: int = proposals.PRE_NMS_TOP_K,
    post_nms_top_k: int = proposals.POST_NMS_TOP_K,
    rois_per_image: int = proposals.ROIS_PER_IMAGE,
    max_detections: int = MAX_DETECTIONS,
    score_threshold: float = DETECTION_SCORE_THRESHOLD,
) -> FasterRCNN:
    """Faster R-CNN for square `image_size` images (module docstring); `backbone` "tiny" or
    "resnet50"; RPN on `levels`, ROIAlign from `roi_levels` (`canonical_size` px boxes pool
    from level 4); top-k counts per image (pre-NMS: per level). Layers `{name}_...`."""
    levels, roi_levels = tuple(levels), tuple(roi_levels)
    _check(image_size, num_classes, levels, roi_levels, name)
    for label, value in (("pre_nms_top_k", pre_nms_top_k), ("post_nms_top_k", post_nms_top_k)):
        if not isinstance(value, int) or value < 1:
            raise UsageError(f"--{label}={value!r} must be a positive integer")
    if backbone == "tiny":
        images, features = tiny_backbone(image_input((image_size, image_size, 3), name), name, dtype, None)
    elif backbone == "resnet50":
        images, features = resnet50_backbone(image_size, name, dtype, 0.0)
    else:
        raise unknown("detector backbone", backbone, ("tiny", "resnet50"))
    gt_boxes = keras.Input((None, 4), name=f"{name}_gt_boxes")
    gt_classes = keras.Input((None,), dtype="int32", name=f"{name}_gt_classes")
    pyramid = feature_pyramid(features, levels, fpn_width, name, dtype, None)
    anchors = dataclasses.replace(anchors, levels=levels)
    rpn_scores, rpn_deltas = _rpn_head(pyramid, levels, anchors.anchors_per_location, fpn_width, name, dtype)
    found = proposals.Proposals(
        image_size,
        levels,
        anchors.scales,
        anchors.ratios,
        anchors.size,
        pre_nms_top_k,
        post_nms_top_k,
        name=f"{name}_proposals",
    )([rpn_scores, rpn_deltas])
    sampled = proposals.SampleROIs(rois_per_image, name=f"{name}_sample_rois")(
        [found["rois"], found["valid"], gt_boxes, gt_classes]
    )
    pooled = ROIAlign(roi_levels, roi_size, canonical_size=canonical_size, name=f"{name}_roi_align")(
        [sampled["rois"], *(pyramid[levels.index(level)] for level in roi_levels)]
    )
    logits, deltas = _box_head(pooled, num_classes, head_width, roi_size, fpn_width, name, dtype)
    detections = Detections(
        image_size, num_classes, max_detections, score_threshold, DETECTION_NMS_IOU, name=f"{name}_detections"
    )([sampled["rois"], sampled["weights"], logits, deltas])
    outputs = {
        "rpn_scores": rpn_scores,
        "rpn_deltas": rpn_deltas,
        "rois": sampled["rois"],
        "roi_weights": sampled["weights"],
        "roi_classes": logits,
        "roi_deltas": deltas,
        **detections,
    }
    inputs = {"images": images, "gt_boxes": gt_boxes, "gt_classes": gt_classes}
    with warnings.catch_warnings():
        # Keras asks dict keys to equal the input names; tfmp names every layer f"{name}_...".
        warnings.filterwarnings("ignore", message="When providing `inputs` as a dict")
        model = FasterRCNN(inputs, outputs, name=name)
    if dtype is not None:
        model.dtype_policy = dtype  # as tfmp.models.cnn.functional_model: keeps loss scaling automatic
    return model


DETECTORS = {
    # `python -m apps.detect --model=faster_rcnn_tiny --mixed` (the detection DEFAULTS: 600 steps of
    # 16 images, adam 0.002, cosine) on 2 shared CPU cores (load ~10): mAP 0.855, AP50 0.998,
    # AP75 0.957 in 312 s; float32 in the same setup: mAP 0.860, AP50 0.998, 337 s (load ~10-14).
    # 128 px shapes scenes (objects 26-64 px): P3-P5 with RetinaNet-tiny's 3 scales x 3 ratios
    # of 32 px at P3, 64-wide FPN, a 256-wide box head, fewer proposals and ROIs per image.
    "faster_rcnn_tiny": functools.partial(
        faster_rcnn,
        backbone="tiny",
        levels=(3, 4, 5),
        roi_levels=(3, 4, 5),
        anchors=boxes.AnchorConfig(levels=(3, 4, 5)),
        fpn_width=64,
        head_width=256,
        canonical_size=64.0,
        pre_nms_top_k=600,
        post_nms_top_k=150,
        rois_per_image=64,
    ),
    # The FPN paper's sizes: 256-wide FPN, 1024-wide head, one 32-512 px anchor scale per level
    # (P3-P7 here: tfmp's ResNet-50 gives C3-C5), 3 ratios, 2000/1000 proposals, 512 ROIs.
    "faster_rcnn_resnet50_fpn": functools.partial(
        faster_rcnn,
        backbone="resnet50",
        levels=(3, 4, 5, 6, 7),
        roi_levels=(3, 4, 5),
        anchors=boxes.AnchorConfig(levels=(3, 4, 5, 6, 7), scales=(1.0,)),
        fpn_width=256,
        head_width=1024,
    ),
}
MODEL_OPTIONS = ("pre_nms_top_k", "post_nms_top_k", "rois_per_image", "max_detections", "score_threshold")


def build_detector(
    name: str, image_size: int, num_classes: int, dtype: str | None = None, **options
) -> FasterRCNN:
    """Builds registered Faster R-CNN `name` (layers `f"{name}_..."`); `options` among
    `MODEL_OPTIONS` override its registry defaults (an unknown one is a UsageError)."""
    if name not in DETECTORS:
        raise unknown("detector", name, DETECTORS)
    check_dtype_policy(dtype)
    rejected = sorted(set(options) - set(MODEL_OPTIONS))
    if rejected:
        raise UsageError(
            f"detector {name!r} does not take option(s) {', '.join(rejected)}; its options: {', '.join(MODEL_OPTIONS)}"
        )
    return DETECTORS[name](image_size, num_classes, dtype=dtype, name=name, **options)


def detect(model: keras.Model, images, score_threshold: float, max_detections: int) -> dict:
    """Float32 detections of a trained Faster R-CNN for images [B, S, S, 3], as
    `boxes.decode_detections` returns them: the model's own NMS output, cut to the detections
    scoring at least `score_threshold` (they come best first) and to `max_detections`."""
    images = tf.convert_to_tensor(images, tf.float32)
    batch = tf.shape(images)[0]
    no_truth = {"gt_boxes": tf.zeros([batch, 1, 4]), "gt_classes": tf.fill([batch, 1], -1)}
    outputs = model({"images": images, **no_truth}, training=False)
    return select_detections(outputs, score_threshold, max_detections)


def select_detections(outputs: dict, score_threshold: float, max_detections: int) -> dict:
    """The model's NMS output (`outputs`: its "boxes", "scores", "classes", "valid_detections")
    cut to the detections scoring at least `score_threshold` and to the first `max_detections`
    (rows past each image's count are 0). Equal to NMS run with those settings: greedy NMS keeps
    a box because of higher-scoring ones only, so a higher threshold drops no box above it."""
    keep = min(max_detections, int(outputs["scores"].shape[1]))
    scores = outputs["scores"][:, :keep]
    above = tf.reduce_sum(tf.cast(scores >= score_threshold, tf.int32), axis=-1)
    count = tf.minimum(tf.cast(outputs["valid_detections"], tf.int32), above)
    kept = tf.range(keep)[None, :] < count[:, None]
    return {
        "boxes": tf.where(kept[..., None], outputs["boxes"][:, :keep], 0.0),
        "scores": tf.where(kept, scores, 0.0),
        "classes": tf.where(kept, tf.cast(outputs["classes"][:, :keep], tf.int32), 0),
        "valid_detections": count,
    }
