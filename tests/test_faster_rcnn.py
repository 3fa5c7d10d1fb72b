"""Tests for Faster R-CNN: tfmp.detection.roi_align, .proposals, .rcnn_losses, .faster_rcnn.

ROIAlign against a NumPy reference, proposals and sampling, the model under every policy
(float32 boxes), 2 replicas equal to one device, the strategy x precision x XLA cells.
"""

import math
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import identical_detection_cells, run_python
from PIL import Image

from tfmp import precision
from tfmp.detection import boxes, data, faster_rcnn, proposals, rcnn_losses, rcnn_task, roi_align
from tfmp.serving import artifacts
from tfmp.training.engine import Engine

SIZE, CLASSES = 64, 6
POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")
FLOAT32_PARTS = (
    "_rpn_objectness_conv",
    "_rpn_deltas",
    "_rpn_scores",
    "_proposals",
    "_sample_rois",
    "_roi_align",
    "_head_classes",
    "_head_deltas",
    "_detections",
)


# ----------------------------------------------------------------------------- ROIAlign
def _bilinear(feature, y, x):
    """Detectron2's ROIAlign sample: 0 beyond one cell outside the map, else clamped bilinear."""
    height, width, _ = feature.shape
    if y < -1.0 or y > height or x < -1.0 or x > width:
        return np.zeros(feature.shape[-1])
    y, x = min(max(y, 0.0), height - 1), min(max(x, 0.0), width - 1)
    y0, x0 = int(math.floor(y)), int(math.floor(x))
    y1, x1 = min(y0 + 1, height - 1), min(x0 + 1, width - 1)
    dy, dx = y - y0, x - x0
    return (
        feature[y0, x0] * (1 - dy) * (1 - dx)
        + feature[y0, x1] * (1 - dy) * dx
        + feature[y1, x0] * dy * (1 - dx)
        + feature[y1, x1] * dy * dx
    )


def _reference_roi_align(feature, box, stride, output_size, sampling_ratio):
    """Aligned ROIAlign of one xyxy pixel box on one map [H, W, C], written out point by point."""
    x1, y1, x2, y2 = (value / stride - 0.5 for value in box)
    bin_h, bin_w = (y2 - y1) / output_size, (x2 - x1) / output_size
    out = np.zeros((output_size, output_size, feature.shape[-1]))
    for row in range(output_size):
        for col in range(output_size):
            samples = [
                _bilinear(
                    feature,
                    y1 + row * bin_h + (i + 0.5) * bin_h / sampling_ratio,
                    x1 + col * bin_w + (j + 0.5) * bin_w / sampling_ratio,
                )
                for i in range(sampling_ratio)
                for j in range(sampling_ratio)
            ]
            out[row, col] = np.mean(samples, axis=0)
    return out


def test_roi_align_matches_numpy_reference_at_fractional_boxes_on_the_level_chosen_by_size():
    rng = np.random.default_rng(0)
    levels = (3, 4)
    pyramid = [rng.normal(size=(2, 64 // 2**level, 64 // 2**level, 3)).astype(np.float32) for level in levels]
    # Fractional coordinates, tiny and large boxes, boxes over the border (beyond one cell too).
    rois = np.array(
        [
            [[3.3, 5.7, 20.9, 17.2], [10.25, 1.5, 60.75, 62.1], [-9.0, -3.3, 12.4, 7.7]],
            [[0.0, 0.0, 64.0, 64.0], [40.6, 33.3, 41.9, 35.0], [50.2, 44.4, 75.5, 70.1]],
        ],
        np.float32,
    )
    canonical_size, canonical_level = 32.0, 4
    got = roi_align.roi_align(
        [tf.constant(p) for p in pyramid],
        tf.constant(rois),
        levels,
        output_size=4,
        sampling_ratio=2,
        canonical_size=canonical_size,
        canonical_level=canonical_level,
    ).numpy()
    assert got.shape == (2, 3, 4, 4, 3) and got.dtype == np.float32
    chosen = roi_align.assign_levels(rois, levels, canonical_size, canonical_level).numpy()
    assert set(chosen.ravel()) == {3, 4}  # both levels used
    for image in range(2):
        for index in range(3):
            box, level = rois[image, index], int(chosen[image, index])
            size = math.sqrt((box[2] - box[0]) * (box[3] - box[1]))
            expected_level = min(max(math.floor(canonical_level + math.log2(size / canonical_size)), 3), 4)
            assert level == expected_level
            feature = pyramid[levels.index(level)][image].astype(np.float64)
            expected = _reference_roi_align(feature, box, 2.0**level, 4, 2)
            # float32 interpolation of O(1) values: a few float32 epsilons.
            np.testing.assert_allclose(got[image, index], expected, atol=20 * np.finfo(np.float32).eps)


def test_roi_align_layer_is_float32_under_mixed_policies():
    layer = roi_align.ROIAlign((3,), output_size=2, name="pool")
    features = tf.cast(tf.random.stateless_uniform([1, 8, 8, 4], [1, 2]), tf.bfloat16)
    pooled = layer([tf.constant([[[8.0, 8.0, 40.0, 40.0]]]), features])
    assert layer.dtype_policy.name == "float32" and pooled.dtype == tf.float32
    assert pooled.shape == (1, 1, 2, 2, 4)


# ----------------------------------------------------------------------------- proposals
def _truth(rows=4, size=SIZE):
    """Padded ground truth of `rows` shapes scenes (uneven box counts)."""
    images, truth = next(iter(data.load("shapes", "eval", rows, image_size=size)[0]))
    inputs = rcnn_task.model_inputs(images, truth)
    return images, inputs["gt_boxes"], inputs["gt_classes"]


def test_rpn_targets_sample_at_most_half_positive_and_do_not_depend_on_the_batch():
    anchors = boxes.generate_anchors(SIZE, boxes.AnchorConfig(levels=(3, 4, 5)))
    _, gt_boxes, gt_classes = _truth()
    labels, targets = proposals.rpn_targets(anchors, gt_boxes, gt_classes, samples=32)
    sampled = tf.reduce_sum(tf.cast(labels >= 0, tf.int32), axis=-1).numpy()
    positive = tf.reduce_sum(tf.cast(labels > 0, tf.int32), axis=-1).numpy()
    assert (sampled == 32).all() and (positive >= 1).all() and (positive <= 16).all()
    assert targets.dtype == tf.float32
    # Image 2 alone samples exactly what it samples inside the batch (keys from its own boxes).
    alone, _ = proposals.rpn_targets(anchors, gt_boxes[2:3], gt_classes[2:3], samples=32)
    np.testing.assert_array_equal(alone[0].numpy(), labels[2].numpy())


def test_sampled_rois_include_the_ground_truth_and_keep_the_positive_fraction():
    _, gt_boxes, gt_classes = _truth()
    # Proposals that overlap nothing: the only foreground candidates are the added boxes.
    far = tf.tile(tf.constant([[[0.0, 0.0, 3.0, 3.0]]]), [4, 10, 1])
    rois, weights = proposals.sample_rois(far, tf.ones([4, 10], tf.bool), gt_boxes, gt_classes, 8, 0.5)
    classes, _ = proposals.roi_targets(rois, gt_boxes, gt_classes)
    real = tf.reduce_sum(tf.cast(gt_classes >= 0, tf.int32), axis=-1).numpy()
    foreground = tf.reduce_sum(tf.cast(classes > 0, tf.float32) * weights, axis=-1).numpy()
    np.testing.assert_array_equal(foreground, np.minimum(real, 4))
    np.testing.assert_array_equal(weights.numpy().sum(-1), 8)
    # Fewer candidates than ROIs asked for: the rest is padding of weight 0.
    rois, weights = proposals.sample_rois(far[:, :2], tf.ones([4, 2], tf.bool), gt_boxes, gt_classes, 16, 0.5)
    assert rois.shape == (4, 16, 4)
    np.testing.assert_array_equal(weights.numpy().sum(-1), np.minimum(real, 8) + 2)


# ----------------------------------------------------------------------------- the model
@pytest.mark.parametrize("policy", POLICIES)
def test_every_box_related_layer_and_output_is_float32_under_every_policy(policy):
    model = faster_rcnn.build_detector("faster_rcnn_tiny", SIZE, CLASSES, dtype=policy)
    images, gt_boxes, gt_classes = _truth(2)
    inputs = {"images": images, "gt_boxes": gt_boxes, "gt_classes": gt_classes}
    for training in (True, False):
        outputs = model(inputs, training=training)
        for key, value in outputs.items():
            assert value.dtype == (tf.int32 if key in ("classes", "valid_detections") else tf.float32), key
    assert 0 < int(outputs["valid_detections"][0]) <= 100  # untrained softmax: ~1/7 per class
    found = faster_rcnn.detect(model, images, score_threshold=0.1, max_detections=5)
    count = found["valid_detections"].numpy()
    assert (count >= 1).all() and (count <= 5).all() and found["boxes"].dtype == tf.float32
    for row, kept in enumerate(count):
        assert (found["scores"][row, :kept].numpy() >= 0.1).all()
        assert (found["scores"][row, kept:].numpy() == 0).all()
        assert (found["boxes"][row, :kept].numpy() >= 0).all() and (found["boxes"].numpy() <= SIZE).all()
    assert all(weight.dtype == "float32" for weight in model.weights)
    for layer in model.layers:
        assert layer.name.startswith("faster_rcnn_tiny_"), layer.name
        if isinstance(layer, keras.layers.InputLayer):
            continue
        boxes_layer = any(part in layer.name for part in FLOAT32_PARTS)
        assert layer.dtype_policy.name == ("float32" if boxes_layer else policy), layer.name


# ----------------------------------------------------------------------------- the one engine
BATCH = 4


def _engine(strategy, policy="float32", class_loss="focal", learning_rate=0.01, xla=False):
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = faster_rcnn.build_detector("faster_rcnn_tiny", SIZE, CLASSES, dtype=policy)
        optimizer = precision.wrap_optimizer(
            keras.optimizers.SGD(learning_rate, momentum=0.9), policy, initial_scale=1024.0
        )
        model.compile(optimizer=optimizer, loss=rcnn_losses.FasterRCNNLoss(class_loss))
    return Engine(strategy, model, optimizer, xla=xla)


def _batches(strategy):
    def dataset_fn(context):
        dataset = data.load("shapes", "train", BATCH, image_size=SIZE, input_context=context, augment=True)[0]
        return rcnn_task.model_elements(dataset)

    return iter(strategy.distribute_datasets_from_function(dataset_fn))


def _replica_values(model):
    return [[v.numpy() for v in getattr(w.value, "values", [w.value])] for w in model.trainable_weights]


# XLA compiles per replica device, so a mirrored cell covers what the default strategy's would;
# each XLA cell costs 15-60 s of compiling, hence one step and no default-strategy XLA. Every
# precision with XLA trains identically on 2 launched workers (the shared group, in this file's
# multi-worker cells test), so in-process one mirrored XLA cell suffices: float16's, whose loss
# scaler's skip and all-reduced verdict compile into the step. Slow-marked: it is most of
# `-m "not slow"`'s time otherwise.
CELLS = [(name, policy, False) for name in ("default", "mirrored") for policy in POLICIES] + [
    pytest.param("mirrored", "mixed_float16", True, marks=pytest.mark.slow)
]


@pytest.mark.parametrize("strategy_name, policy, xla", CELLS)
def test_every_strategy_precision_and_xla_cell_trains_with_identical_replicas(
    mirrored, strategy_name, policy, xla
):
    strategy = mirrored if strategy_name == "mirrored" else tf.distribute.get_strategy()
    engine = _engine(strategy, policy, class_loss="softmax" if policy == "float32" else "focal", xla=xla)
    result = engine.train(_batches(strategy), 1 if xla else 2)
    if xla:  # what the run card's "xla" row says is compiled
        assert engine.xla_parts.startswith("backbone, FPN, RPN head and box head compiled per replica")
    assert np.isfinite(result.metrics["loss"]) and result.nonfinite_steps == 0
    for weight, copies in zip(engine.model.trainable_weights, _replica_values(engine.model)):
        assert weight.dtype == "float32"
        for copy in copies[1:]:
            np.testing.assert_array_equal(copy, copies[0])  # replicas identical


def _one_step(strategy):
    """(loss, update of every trainable weight as one vector) of one SGD step from the seed."""
    engine = _engine(strategy)
    before = np.concatenate([weight.numpy().ravel() for weight in engine.model.trainable_weights])
    loss = engine.train(_batches(strategy), 1).metrics["loss"]
    after = np.concatenate([weight.numpy().ravel() for weight in engine.model.trainable_weights])
    return loss, after - before


def test_two_replicas_equal_one_device_proposals_sampling_and_global_normalisers(mirrored):
    """One SGD step on 2 replicas computes one device's loss and moves the weights as it does.

    The loss: each image's forward pass (proposals, sampled ROIs) is the same in a batch of 4
    as in two of 2, and the four losses are sums of non-negative terms over global counts, so
    two summation orders differ by at most (terms x float32 eps) of the loss; a per-replica
    normaliser or proposal budget would change it by about the replica count.
    The update, as one vector: on CPU the backward passes of ROIAlign (CropAndResize) and the
    gathers accumulate in thread order, so even two runs on one device differ (measured up to
    1.7e-3 of the update's norm), and GroupNorm's backward cancels large terms, which makes
    that difference no bound from epsilon can cover element by element. A wrong normaliser
    moves the update by >= 50% (a factor of 2 on some loss); 5% separates the two by 10x
    both ways. One step only: later steps start from weights that already differ.
    """
    one_device_loss, one_device_update = _one_step(tf.distribute.OneDeviceStrategy("/cpu:0"))
    replicas_loss, replicas_update = _one_step(mirrored)
    summed_terms = BATCH * SIZE * SIZE  # more than any of the four losses sums
    assert abs(replicas_loss - one_device_loss) <= summed_terms * np.finfo(np.float32).eps * one_device_loss
    difference = np.linalg.norm(replicas_update - one_device_update) / np.linalg.norm(one_device_update)
    assert difference <= 0.05, f"2-replica update differs from one device's by {difference:.2e} of its norm"


def test_compiled_forward_is_the_model_split_at_its_static_parts():
    """`--xla=on` runs the model as compiled dense part -> proposals/ROIAlign -> compiled head.
    Uncompiled, that split computes exactly the model's call; compiled, the RPN outputs (all
    the proposals depend on) differ only by XLA's float32 re-association (fused convolutions),
    bounded by eps x the convolutions' summed terms x the outputs' scale."""
    keras.utils.set_random_seed(0)
    model = faster_rcnn.build_detector("faster_rcnn_tiny", SIZE, CLASSES, dtype="float32")
    elements = rcnn_task.model_elements(data.load("shapes", "eval", BATCH, image_size=SIZE)[0])
    inputs = next(iter(elements))[0]
    expected = model(inputs, training=False)
    split = model.compiled_forward(jit_compile=False)(inputs, training=False)
    assert sorted(split) == sorted(expected)
    for key in expected:
        np.testing.assert_array_equal(np.asarray(split[key]), np.asarray(expected[key]), err_msg=key)
    compiled = tf.function(model.compiled_forward())(inputs, training=False)
    summed_terms = 3 * 3 * 64 * 8  # 3x3 convolutions of up to 64 channels, about 8 layers deep
    for key in ("rpn_scores", "rpn_deltas"):
        scale = np.abs(np.asarray(expected[key])).max()
        bound = summed_terms * np.finfo(np.float32).eps * scale
        np.testing.assert_allclose(np.asarray(compiled[key]), np.asarray(expected[key]), rtol=0, atol=bound)


# ----------------------------------------------------------------------------- apps.detect
@pytest.mark.slow
def test_multi_worker_cells_train_every_precision_and_xla_identically(launched_workers):
    """2 workers (conftest's shared launched group, tests/mwms_detect_worker.py) x every
    precision x XLA off/on, one step each: every model and optimizer variable ends identical on
    both workers, and with XLA the static-shaped parts are the compiled ones."""
    cells = identical_detection_cells(launched_workers, "faster_rcnn", POLICIES)
    for (_, xla), workers in cells.items():
        for record in workers.values() if xla else ():
            assert record["xla_parts"].startswith("backbone, FPN, RPN head and box head compiled"), record


@pytest.mark.slow
def test_app_on_two_launched_workers_trains_mixed_identically_then_exports_and_predicts(tmp_path):
    """apps.detect trains Faster R-CNN --mixed under `tfmp.launch --workers=2` (the one app run
    of Faster R-CNN: one process is the same app code with another strategy, and the in-process
    cells above train every strategy): identical weights on both workers, every eval image once;
    then apps.export and apps.predict's detector kind on the export and on the run dir."""
    run = tmp_path / "run"
    result = run_python(
        ["-m", "tfmp.launch", "--workers=2", "--", sys.executable, "-m", "apps.detect"]
        + ["--model=faster_rcnn_tiny", "--mixed", "--steps=4", "--steps_per_epoch=4", "--warmup_steps=0"]
        + ["--rcnn_class_loss=softmax", "--pre_nms_top_k=100", "--post_nms_top_k=50"]
        # Eval batches of 16 and 10 detections per image: the 500 eval images in 32 gathering
        # steps instead of 125, and a COCO evaluation of 5,000 detections, not 50,000 (72 s -> 48 s).
        + ["--global_batch_size=16", "--max_detections=10"]
        + [f"--image_size={SIZE}", f"--model_dir={run}"]
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summaries = [line for line in result.stdout.splitlines() if "tfmp summary:" in line]
    assert len(summaries) == 2 and "2 replica(s) on 2 worker(s)" in summaries[0]
    digests = {line.split("weights ")[-1].split(",")[0] for line in summaries}
    assert len(digests) == 1  # identical weights on both workers
    assert "on 500 images" in summaries[0]  # every eval image once, across both workers
    assert "eval mAP" in summaries[0] and "precision mixed_" in summaries[0]
    assert "2nd stage softmax" in result.stdout and "post-NMS top 50 per image" in result.stdout
    picture = tmp_path / "scene.png"
    Image.fromarray((np.random.default_rng(0).random((80, 100, 3)) * 255).astype(np.uint8)).save(picture)
    # apps.export with its default formats: SavedModel and .keras, TFLite left out with a note.
    exported = run_python(["-m", "apps.export", f"--model_dir={run}", "--eval_batches=1", "--batch_size=4"])
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert "note: no tflite: faster_rcnn_tiny needs CropAndResize and NMS" in exported.stdout
    assert "two_stage_detector" in exported.stdout and "detection agreement (F1)" in exported.stdout
    export_dir = run / "export" / "float32"
    assert sorted(path.name for path in export_dir.iterdir()) == ["export.json", "model.keras", "saved_model"]
    # apps.predict on the export dir and on the run dir. A run dir goes through the detection
    # predict mode, `tfmp.detection.predict.predict_files`: what `apps.detect --predict` prints
    # (that flag's handling: test_detect_app's RetinaNet app test).
    for model, score_threshold in ((export_dir, 0.05), (run, 0.0)):
        kind = artifacts.kind_of(str(model))
        settings = {"score_threshold": score_threshold, "output_dir": str(tmp_path / kind / model.name)}
        (drawn,) = artifacts.KINDS[kind].predict_files(str(model), [str(picture)], settings)
        assert kind == "two_stage_detector" and Image.open(drawn["png"]).size == (100, 80)  # the original's
    # `drawn` is now the run's record, which has the predict mode's dtypes.
    assert drawn["boxes_dtype"] == "float32" and drawn["scores_dtype"] == "float32"
    # 4 steps teach the background class first: few or no scores reach the model's 0.05 yet.
    for found in drawn["detections"]:
        assert len(found["box"]) == 4 and found["score"] >= 0.05 and found["name"]
