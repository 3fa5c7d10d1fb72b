"""Tests for tfmp.detection.retinanet, tfmp.detection.losses and .visualize.

The model under every policy (float32 outputs, layer names), the losses' global positive-anchor
normaliser under MirroredStrategy on the two logical CPUs (conftest), float16 logits, a
compiled fit step, and drawing to PNG. Tiny 64 px models; the file runs in about a minute.
"""

import functools
import math

import keras
import numpy as np
import pytest
import rounding
import tensorflow as tf
from PIL import Image

from tfmp import compat
from tfmp.detection import boxes, data, losses, visualize
from tfmp.detection.retinanet import DETECTORS, anchor_config, build_detector
from tfmp.errors import UsageError

SIZE, CLASSES = 64, 6
POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")
FLOAT32_HEAD = ("_classes_output", "_boxes_output", "_classes", "_boxes")


@functools.cache
def tiny(policy):
    return build_detector("retinanet_tiny", SIZE, CLASSES, dtype=policy)


@functools.cache
def batch(size=4):
    """One eval batch of `shapes` scenes with their anchor targets (uneven positive counts)."""
    anchors = boxes.generate_anchors(SIZE, anchor_config("retinanet_tiny"))
    dataset, _ = data.load("shapes", "eval", size, anchors=anchors, image_size=SIZE)
    images, labels, _ = next(iter(dataset))
    return images, labels


@pytest.mark.parametrize("policy", POLICIES)
def test_outputs_are_float32_under_every_policy_and_layers_carry_the_name(policy):
    model = tiny(policy)
    outputs = model(batch()[0])
    anchors = boxes.generate_anchors(SIZE, anchor_config("retinanet_tiny"))
    assert outputs["classes"].dtype == tf.float32 and outputs["boxes"].dtype == tf.float32
    assert outputs["classes"].shape == (4, anchors.shape[0], CLASSES)
    assert outputs["boxes"].shape == (4, anchors.shape[0], 4)
    assert all(weight.dtype == "float32" for weight in model.weights)
    assert model.dtype_policy.name == policy
    for layer in model.layers:
        assert layer.name.startswith("retinanet_tiny_")
        if isinstance(layer, keras.layers.InputLayer):
            continue
        head = layer.name.endswith(FLOAT32_HEAD) or "_reshape_p" in layer.name
        assert layer.dtype_policy.name == ("float32" if head else policy), layer.name
    found = boxes.decode_detections(model.predict(batch()[0], verbose=0), anchors, image_size=SIZE)
    assert found["boxes"].dtype == tf.float32 and found["scores"].dtype == tf.float32


def test_class_prior_and_shared_subnets():
    model = tiny("float32")
    bias = model.get_layer("retinanet_tiny_classes_output").bias.numpy()
    np.testing.assert_allclose(1 / (1 + np.exp(-bias)), 0.01, rtol=1e-5)
    # One set of subnet weights for P3-P5: the conv layers are called once per level.
    for name in ("retinanet_tiny_classes_conv1", "retinanet_tiny_boxes_output"):
        assert len(compat.calls_in(model, model.get_layer(name))) == 3, name


def test_resnet50_detector_has_p3_to_p7_and_the_papers_size():
    model = build_detector("retinanet_resnet50", 128, 80, dtype="mixed_float16")
    config = anchor_config("retinanet_resnet50")
    assert config.levels == (3, 4, 5, 6, 7) and config.anchors_per_location == 9
    assert model.output["classes"].shape[1] == boxes.generate_anchors(128, config).shape[0]
    assert 37e6 < model.count_params() < 39e6  # the paper's ~38M with 80 classes


def test_bad_detector_requests_are_usage_errors():
    assert sorted(DETECTORS) == ["retinanet_resnet50", "retinanet_tiny"]
    with pytest.raises(UsageError, match="unknown detector 'yolo'; choose one of"):
        build_detector("yolo", SIZE, CLASSES)
    with pytest.raises(UsageError, match="multiple of 32"):
        build_detector("retinanet_tiny", 100, CLASSES)
    with pytest.raises(UsageError, match="does not take option"):
        build_detector("retinanet_tiny", SIZE, CLASSES, depth=3)
    with pytest.raises(UsageError, match="dtype policy"):
        build_detector("retinanet_tiny", SIZE, CLASSES, dtype="float8")


def _loss(labels, outputs):
    return losses.ClassLoss()(labels["classes"], outputs["classes"]) + losses.BoxLoss()(
        labels["boxes"], outputs["boxes"]
    )


def test_two_replicas_give_the_single_device_gradient_of_the_global_batch(mirrored, monkeypatch):
    images, labels = batch()
    positives = tf.reduce_sum(tf.cast(labels["classes"] >= 0, tf.int32), axis=1).numpy()
    assert positives[:2].sum() != positives[2:].sum()  # replicas see different positive counts
    single = tiny("float32")
    with tf.GradientTape() as tape:
        loss = _loss(labels, single(images, training=False))
    expected = tape.gradient(loss, single.trainable_variables)
    with mirrored.scope():
        replicated = build_detector("retinanet_tiny", SIZE, CLASSES, dtype="float32")
    replicated.set_weights(single.get_weights())

    def halves(context):
        index = context.replica_id_in_sync_group
        return (
            images[2 * index : 2 * index + 2],
            tf.nest.map_structure(lambda t: t[2 * index : 2 * index + 2], labels),
        )

    def step(replica_images, replica_labels):
        with tf.GradientTape() as tape:
            replica_loss = _loss(replica_labels, replicated(replica_images, training=False))
        return replica_loss, tape.gradient(replica_loss, replicated.trainable_variables)

    per_replica = mirrored.experimental_distribute_values_from_function(halves)
    replica_losses, gradients = tf.function(lambda: mirrored.run(step, args=per_replica))()
    total = mirrored.reduce(tf.distribute.ReduceOp.SUM, replica_losses, axis=None)
    np.testing.assert_allclose(total, loss, rtol=1e-5)
    for got, want in zip(gradients, expected):
        got = mirrored.reduce(tf.distribute.ReduceOp.SUM, got, axis=None)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4)
    # Control: normalising by each replica's own positive count would not match.
    monkeypatch.setattr(losses, "global_sum", lambda value: value)
    local_losses, _ = tf.function(lambda: mirrored.run(step, args=per_replica))()
    local_total = mirrored.reduce(tf.distribute.ReduceOp.SUM, local_losses, axis=None)
    assert abs(float(local_total) - float(loss)) > 1e-3 * abs(float(loss))


def test_losses_are_finite_float32_on_float16_logits_and_skip_ignored_anchors():
    _, labels = batch()
    shape = labels["classes"].shape + (CLASSES,)
    logits = tf.cast(tf.random.stateless_uniform(shape, [1, 2], -6e4, 6e4), tf.float16)
    class_loss = losses.ClassLoss()(labels["classes"], logits)
    box_loss = losses.BoxLoss()(
        labels["boxes"], tf.cast(tf.fill(labels["boxes"].shape[:2] + (4,), 6e4), tf.float16)
    )
    assert class_loss.dtype == tf.float32 and math.isfinite(float(class_loss))
    assert box_loss.dtype == tf.float32 and math.isfinite(float(box_loss))
    ignored = tf.fill(labels["classes"].shape, boxes.IGNORE)
    assert float(losses.ClassLoss()(ignored, logits)) == 0.0
    config = losses.ClassLoss(gamma=1.5).get_config()
    assert keras.losses.deserialize(keras.losses.serialize(losses.ClassLoss(gamma=1.5))).gamma == 1.5
    assert config["reduction"] == "sum"


def test_compiled_model_trains_with_fit_under_mixed_float16():
    images, labels = batch()
    model = build_detector("retinanet_tiny", SIZE, CLASSES, dtype="mixed_float16")
    model.compile(
        keras.optimizers.SGD(0.01, momentum=0.9),
        loss={"classes": losses.ClassLoss(), "boxes": losses.BoxLoss()},
    )
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    history = model.fit(images, labels, batch_size=2, epochs=2, verbose=0).history
    assert all(math.isfinite(value) for value in history["loss"])
    assert all(weight.dtype == "float32" for weight in model.weights)


def test_drawn_detections_are_a_png_with_coloured_boxes(tmp_path):
    image = np.full([40, 60, 3], 0.5, np.float32)
    path = visualize.draw_detections(
        image,
        [[5, 12, 30, 35]],
        [2],
        [0.87],
        ["circle", "square", "triangle"],
        str(tmp_path / "a/b.png"),
        scale=2,
    )
    picture = np.asarray(Image.open(path))
    assert picture.shape == (80, 120, 3)
    assert tuple(picture[50, 10]) == visualize.class_colour(2)  # the box's left edge
    assert tuple(picture[79, 119]) == (128, 128, 128)  # untouched
    with pytest.raises(UsageError, match="shape"):
        visualize.render(np.zeros([4, 4]), [], [])


def test_plain_fit_on_two_replicas_ends_with_the_single_device_weights(mirrored):
    """Keras' own `fit` (no tfmp engine) of the compiled detector: one step on 2 replicas moves
    the weights as one device does, within float32 rounding of the gradient sums
    (tests/rounding.py); the losses' global positive count makes that so."""
    images, labels = batch()
    dataset = tf.data.Dataset.from_tensors((images, labels))

    def train(strategy):
        with strategy.scope():
            keras.utils.set_random_seed(1)
            model = build_detector("retinanet_tiny", SIZE, CLASSES, dtype="float32")
            model.compile(
                keras.optimizers.SGD(0.1), loss={"classes": losses.ClassLoss(), "boxes": losses.BoxLoss()}
            )
        start = model.get_weights()
        model.fit(dataset, epochs=1, verbose=0)
        return start, model.get_weights()

    start, one_device = train(tf.distribute.get_strategy())
    _, replicated = train(mirrored)
    rounding.assert_same_update(start, one_device, replicated, len(images) * SIZE * SIZE)
