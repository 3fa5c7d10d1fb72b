"""Object detection for tfmp: RetinaNet and Faster R-CNN, their data, losses, COCO metrics and drawings.

Modules (the model builders are `tfmp.detection.retinanet` and `tfmp.detection.faster_rcnn`):

* `boxes`        anchors, IoU, delta encoding, the per-example anchor matcher, decoding + NMS (float32)
* `targets`      anchor matching on the device, batched over the replica's images (RetinaNet, the RPN)
* `proposals`    Faster R-CNN's RPN targets, proposals (decode + per-image NMS), ROI sampling (float32)
* `roi_align`    ROIAlign over the FPN levels (`tf.image.crop_and_resize`, float32)
* `shapes`       the built-in drawn scenes (several coloured shapes per image)
* `data`         dataset specs (`shapes`, `coco:PATH`, `tfds:voc/2007`, `tfds:coco/2017`),
                 augmentation, padded batches; `sources` reads COCO JSON and TFDS
* `losses`       RetinaNet's focal and Huber losses over the global positive-anchor count
* `rcnn_losses`  Faster R-CNN's RPN and second-stage losses, every normaliser global
* `task`, `rcnn_task`  each detector as a tfmp task (what `apps.detect` trains)
* `evaluation`   COCO mAP with pycocotools
* `predict`, `visualize`  detections for image files, drawn into PNG files

A whole training run with plain Keras (what `apps.detect` does with its engine)::

    from tfmp.detection import DEFAULTS, boxes, data, evaluation, losses
    from tfmp.detection.retinanet import anchor_config, build_detector

    size = DEFAULTS["image_size"]
    anchors = boxes.generate_anchors(size, anchor_config(DEFAULTS["model"]))
    train, _ = data.load("shapes", "train", 16, anchors=anchors, image_size=size, augment=True)
    model = build_detector(DEFAULTS["model"], size, 6, dtype="mixed_bfloat16")
    model.compile("adam", loss={"classes": losses.ClassLoss(), "boxes": losses.BoxLoss()})
    model.fit(train, steps_per_epoch=600)
    evaluator = evaluation.CocoEvaluator()
    for images, _, truth in data.load("shapes", "eval", 50, anchors=anchors, image_size=size)[0]:
        evaluator.update(truth, boxes.decode_detections(model(images), anchors, image_size=size))
    print(evaluator.result())
"""

# What `python -m apps.detect --mixed` should default to. Plain `model.fit` with these settings
# under mixed_bfloat16, on 2 CPU cores shared with other jobs (load ~5), trained in 218 s and
# reached mAP@[.5:.95] 0.784, AP50 0.963, AP75 0.876 on the 500 `shapes` eval images (1000
# steps: mAP 0.84, AP50 0.99 in ~6 min). Linear warmup, then cosine decay to 0.
DEFAULTS = {
    "model": "retinanet_tiny",
    "dataset": "shapes",
    "image_size": 128,
    "augment": True,
    "global_batch_size": 16,
    "optimizer": "adam",
    "learning_rate": 0.002,
    "warmup_steps": 60,
    "lr_decay": "cosine",
    "steps": 600,
    "score_threshold": 0.05,  # for COCO eval; 0.5 reads better in --predict pictures
    "max_detections": 100,
}
