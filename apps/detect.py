"""Train a RetinaNet or Faster R-CNN detector with mixed precision, or draw its detections on images.

    python -m apps.detect --mixed                         # built-in shapes scenes, offline, a few minutes
    python -m apps.detect --model=faster_rcnn_tiny --mixed [--rcnn_class_loss=softmax]
    python -m apps.detect --strategy=mirrored --cpu_replicas=2
    python -m tfmp.launch --workers=2 -- python -m apps.detect
    python -m apps.detect --flagfile=configs/retinanet_resnet50_coco_8gpu.cfg --data_dir=...
    python -m apps.detect --model_dir=RUN --predict=img1.jpg,img2.png [--score_threshold=0.3]
    python -m apps.detect --precision=mixed_float16 --diagnose_precision  # precision doctor, no training

Training evaluates COCO metrics (pycocotools) after every epoch and ends with one line:
`tfmp summary: eval mAP ..., AP50 ..., images/s, precision, replicas, model dir`. `--predict`
prints one JSON line per image and writes IMAGE.detections.png next to it (or in --output_dir).
"""

import json

from absl import flags

from apps import cli, common
from tfmp import run_dir
from tfmp.detection import DEFAULTS, data, faster_rcnn, rcnn_task, retinanet
from tfmp.detection import predict as detection_predict
from tfmp.detection.task import TASK
from tfmp.errors import UsageError, unknown
from tfmp.input import image_files

FLAGS = flags.FLAGS
# Both detector families: --model picks the family's task (RetinaNet's or Faster R-CNN's).
DETECTORS = {**retinanet.DETECTORS, **faster_rcnn.DETECTORS}
for _name in (
    "model",
    "dataset",
    "image_size",
    "augment",
    "global_batch_size",
    "optimizer",
    "learning_rate",
    "warmup_steps",
    "lr_decay",
    "steps",
):
    FLAGS.set_default(_name, DEFAULTS[_name])
FLAGS.set_default("log_every", 100)
# The shared flags' help names the classifiers and image datasets; --help here names detection's.
FLAGS["model"].help = f"Detector: {', '.join(DETECTORS)}."
FLAGS["dataset"].help = f"Detection dataset: {' | '.join(data.CHOICES)}."
flags.DEFINE_list(
    "predict", [], "Image files to detect objects in with the trained --model_dir (no training)."
)
flags.DEFINE_float(
    "score_threshold", None, "Lowest score kept: default 0.05 for COCO eval, 0.3 for --predict."
)
flags.DEFINE_integer("max_detections", DEFAULTS["max_detections"], "Detections kept per image after NMS.")
flags.DEFINE_string("output_dir", None, "--predict: where the PNGs go (default: next to each image).")
flags.DEFINE_enum(
    "rcnn_class_loss", "focal", ["focal", "softmax"], "Faster R-CNN: the second stage's classification loss."
)
flags.DEFINE_integer(
    "pre_nms_top_k", None, "Faster R-CNN: RPN proposals per level before NMS (default: the model's; 2000)."
)
flags.DEFINE_integer(
    "post_nms_top_k", None, "Faster R-CNN: proposals per image after NMS (default: the model's; 1000)."
)


def main(argv):
    del argv
    if FLAGS.predict:
        if not FLAGS.model_dir:
            raise UsageError("--predict needs --model_dir=RUN, the directory of a trained apps.detect run")
        threshold = 0.3 if FLAGS.score_threshold is None else FLAGS.score_threshold
        if FLAGS.output_dir:
            run_dir.writable_dir(FLAGS.output_dir, "--output_dir")
        for record in detection_predict.predict_files(
            FLAGS.model_dir,
            FLAGS.predict,
            threshold,
            FLAGS.max_detections,
            FLAGS.output_dir,
            image_files.pixel_limit(FLAGS.max_image_pixels),
        ):
            print(json.dumps(record), flush=True)
        return
    if FLAGS.model not in DETECTORS:  # each task knows its own family only
        raise unknown("detector", FLAGS.model, DETECTORS)
    threshold = DEFAULTS["score_threshold"] if FLAGS.score_threshold is None else FLAGS.score_threshold
    overrides = {"score_threshold": threshold, "max_detections": FLAGS.max_detections}
    if not FLAGS["warmup_steps"].present and 0 < FLAGS.steps < DEFAULTS["steps"]:
        # The default warmup is a tenth of the default run: a shorter --steps (a smoke test)
        # keeps that fraction instead of failing on a warmup longer than the run.
        overrides["warmup_steps"] = DEFAULTS["warmup_steps"] * FLAGS.steps // DEFAULTS["steps"]
    config = common.config_from_flags(**overrides)
    task = TASK
    if FLAGS.model in faster_rcnn.DETECTORS:
        task = rcnn_task.FasterRCNNTask(FLAGS.rcnn_class_loss, FLAGS.pre_nms_top_k, FLAGS.post_nms_top_k)
    common.train_or_diagnose("detect", config, task)


if __name__ == "__main__":
    cli.run(main)
