"""What a benchmark cell trains: for a model name, the compiled model, its optimizer, the
`dataset_fn(input_context)` of its training data and its image shape; and a step's model FLOPs.

    model, optimizer, dataset_fn, image_shape = setup_for(cell["model"])(cell, strategy, policy)
    flops = flops_per_step(cell, model)

Classifiers (`tfmp.models.MODELS`, and the plain Keras models of `tfmp.bench.keras_models`) train
on the cell's "data" ("builtin": `digits` for the MNIST-shaped models, `shapes` otherwise). A
cell with "fused_norm": true has `tfmp.precision.fuse_normalization` run on its model (its
normalization and MultiHeadAttention layers) right after it is built, before compile and
the Engine trace it (false, the default: the model as built). Detectors (`tfmp.detection.retinanet.DETECTORS`,
`tfmp.detection.faster_rcnn.DETECTORS`) train on the built-in detection `shapes`: the pipeline
draws the scenes and pads the ground truth, anchors (and Faster R-CNN's ROIs) are matched on
the device inside the step; "synthetic" repeats one such batch from memory. Every model starts
from seed 0 with SGD (0.01, momentum 0.9), wrapped for the policy as the apps wrap it.
"""

from __future__ import annotations

import math

import keras

from tfmp import models, precision
from tfmp.bench import keras_models
from tfmp.classification import data
from tfmp.classification.task import compile_classifier
from tfmp.detection import data as detection_data
from tfmp.detection import faster_rcnn, losses, rcnn_losses, rcnn_task, retinanet, targets
from tfmp.detection.task import compile_detector
from tfmp.training import fit_data

MNIST_SHAPED = ("mnist_mlp", "lenet")


def is_detector(name: str) -> bool:
    return name in retinanet.DETECTORS or name in faster_rcnn.DETECTORS


def dataset_spec(cell: dict) -> str:
    if is_detector(cell["model"]):
        return "shapes"  # the detection flavour (boxes), see _shapes_dataset_fn
    if cell["data"] == "builtin":
        return "digits" if cell["model"] in MNIST_SHAPED else "shapes"
    return cell["data"]


def _image_size(cell: dict, spec: str):
    return None if spec == "digits" or cell["model"] in MNIST_SHAPED else cell.get("image_size")


def _optimizer(policy: str):
    return precision.wrap_optimizer(keras.optimizers.SGD(0.01, momentum=0.9), policy, "auto")


def _build_classifier(name: str, image_shape, num_classes: int, policy: str):
    if name in keras_models.MODELS:
        return keras_models.build(name, image_shape, num_classes, dtype=policy)
    return models.build(name, image_shape, num_classes, dtype=policy)


def classifier_setup(cell: dict, strategy, policy: str):
    """(compiled classifier, optimizer, dataset_fn(input_context), image shape)."""
    spec = dataset_spec(cell)
    image_size = _image_size(cell, spec)
    info = data.describe(spec, image_size=image_size, verify=False)  # a bench times, it does not vet data
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = _build_classifier(cell["model"], info.image_shape, info.num_classes, policy)
        optimizer = _optimizer(policy)
    _fuse_if_asked(cell, model)
    compile_classifier(model, optimizer, strategy)

    def dataset_fn(context):
        return data.load(
            spec,
            "train",
            cell["global_batch_size"],
            image_size=image_size,
            input_context=context,
            cache=cell.get("cache", False),
        )[0]

    return model, optimizer, dataset_fn, info.image_shape


def _shapes_dataset_fn(cell: dict, to_elements):
    """dataset_fn(input_context) of the built-in detection `shapes` at the cell's image size and
    batch, its (image, truth) batches mapped by `to_elements` into the model's elements."""

    def dataset_fn(context, synthetic=cell["data"] == "synthetic"):
        dataset = detection_data.load(
            "shapes",
            "train",
            cell["global_batch_size"],
            image_size=cell["image_size"],
            input_context=context,
        )[0]
        dataset = to_elements(dataset)
        # Synthetic reference: one real batch (drawn once) repeated, so the input pipeline's
        # cost drops out and the step (anchors matched in it) is the same work.
        return dataset.take(1).cache().repeat() if synthetic else dataset

    return dataset_fn


def _retinanet_elements(dataset):
    return dataset.map(lambda image, truth: (image, losses.ground_truth_labels(truth)))


def retinanet_setup(cell: dict, strategy, policy: str):
    """(compiled RetinaNet, optimizer, dataset_fn(input_context), image shape) on `shapes`."""
    size = cell["image_size"]
    info = detection_data.describe("shapes", image_size=size)
    matcher = targets.AnchorMatcher(size, retinanet.anchor_config(cell["model"]))
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = retinanet.build_detector(cell["model"], size, info.num_classes, dtype=policy)
        optimizer = _optimizer(policy)
    _fuse_if_asked(cell, model)
    compile_detector(model, optimizer, strategy, matcher=matcher, max_boxes=info.max_boxes)
    return model, optimizer, _shapes_dataset_fn(cell, _retinanet_elements), (size, size, 3)


def faster_rcnn_setup(cell: dict, strategy, policy: str):
    """(compiled Faster R-CNN, optimizer, dataset_fn(input_context), image shape) on `shapes`,
    compiled as `rcnn_task.FasterRCNNTask` compiles it (its loss, built for
    `rcnn_task.model_elements`: `(inputs,)` with the padded ground truth among the inputs)."""
    size = cell["image_size"]
    info = detection_data.describe("shapes", image_size=size)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = faster_rcnn.build_detector(cell["model"], size, info.num_classes, dtype=policy)
        optimizer = _optimizer(policy)
    _fuse_if_asked(cell, model)
    with strategy.scope():
        model.compile(optimizer=optimizer, loss=rcnn_losses.FasterRCNNLoss(rcnn_task.TASK.class_loss))
    dataset_fn = _shapes_dataset_fn(cell, rcnn_task.model_elements)
    fit_data.build_for_data(model, strategy, dataset_fn(None).element_spec)
    return model, optimizer, dataset_fn, (size, size, 3)


def _fuse_if_asked(cell: dict, model) -> None:
    if cell.get("fused_norm", False):
        # In place and before anything traces the model: compile's build and the Engine's step.
        precision.fuse_normalization(model)


def setup_for(name: str):
    """The setup function of model `name`: (cell, strategy, policy) -> (compiled model,
    optimizer, dataset_fn(input_context), image shape)."""
    if name in faster_rcnn.DETECTORS:
        return faster_rcnn_setup
    return retinanet_setup if name in retinanet.DETECTORS else classifier_setup


def flops_per_step(cell: dict, model) -> int:
    """Model FLOPs of one step (`tfmp.models.count_flops`), forward x 3 when training."""
    training = cell["mode"] == "train"
    if cell["model"] in faster_rcnn.DETECTORS:
        forward = _faster_rcnn_flops(model, training) * cell["global_batch_size"]
    else:
        forward = models.count_flops(model, cell["global_batch_size"])
    return forward * (3 if training else 1)


def _faster_rcnn_flops(model, training: bool) -> int:
    """Forward FLOPs of one image: `count_flops` of the fixed-shape part (backbone, FPN, RPN),
    plus the box head's dense layers once per ROI. The graph leaves the ROI count open (so
    `count_flops` cannot count the head): the sampled ROIs in training, the proposals otherwise."""
    rpn_outputs = [model.get_layer(f"{model.name}_{kind}").output for kind in ("rpn_scores", "rpn_deltas")]
    fixed = models.count_flops(keras.Model(model.input["images"], rpn_outputs))
    if training:
        rois = model.get_layer(f"{model.name}_sample_rois").rois_per_image
    else:
        rois = model.get_layer(f"{model.name}_proposals").post_nms_top_k
    head = [layer for layer in model.layers if layer.name.startswith(f"{model.name}_head_")]
    per_roi = sum(
        2 * math.prod(layer.kernel.shape) for layer in head if isinstance(layer, keras.layers.Dense)
    )
    return fixed + rois * per_roi
