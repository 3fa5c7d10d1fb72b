"""Export a trained run for serving: SavedModel, TFLite and .keras, float32 or half precision.

    python -m apps.export --model_dir=runs/seed_cnn-shapes-... --precision=bfloat16
    python -m apps.export --model_dir=RUN --formats=tflite --precision=float16 --output_dir=/tmp/out

Writes OUTPUT_DIR/PRECISION/ (OUTPUT_DIR defaults to RUN/export): `saved_model/` (float32 images
in, float32 probabilities out, computing in PRECISION), `model.tflite` (float16 weights unless
PRECISION is float32), `model.keras`, and `export.json` (preprocessing, class names, the
table printed at the end: size and max |difference| against the trained Keras model on eval
batches of the run's dataset, and `saved_model_sha256`: the SHA-256 of saved_model.pb, which
apps.predict checks before it runs the SavedModel, a program). Bad input exits 2 with one line
and writes nothing.

A detector run (apps.detect) exports a SavedModel returning float32 boxes and scores, int32
classes and valid_detections after NMS (--score_threshold, --max_detections, --iou_threshold),
and a .tflite with the raw logits and box deltas (NMS is no TFLite builtin; export.json holds the
anchors to decode them); its table compares logits and box deltas, and the detections (F1).
A Faster R-CNN run exports the same SavedModel (its own NMS inside) and .keras, but no .tflite
(ROIAlign's CropAndResize and NMS are no TFLite builtins): the default --formats skip it with a
note, --formats=tflite is refused.
"""

import json

from absl import flags, logging

from apps import cli
from tfmp.errors import UsageError
from tfmp.serving import export

FLAGS = flags.FLAGS
flags.DEFINE_string("model_dir", None, "Training run dir holding model.keras and flags.txt.")
flags.DEFINE_list(
    "formats",
    list(export.FORMATS),
    f"Any of {', '.join(export.FORMATS)} (default: every one the model's kind writes).",
)
flags.DEFINE_string("precision", "float32", f"Compute precision: {', '.join(export.PRECISIONS)}.")
flags.DEFINE_string("output_dir", None, "Parent of the PRECISION/ export dir (default: MODEL_DIR/export).")
flags.DEFINE_integer("eval_batches", 2, "Eval batches the outputs are compared on.")
flags.DEFINE_integer("batch_size", 32, "Size of those batches.")
flags.DEFINE_float(
    "score_threshold",
    None,
    "Detectors: lowest score the SavedModel returns (default 0.05; Faster R-CNN: its own).",
)
flags.DEFINE_float(
    "iou_threshold", None, "Detectors: NMS IoU threshold (default 0.5; fixed in a Faster R-CNN)."
)
flags.DEFINE_integer(
    "max_detections", None, "Detectors: detections per image after NMS (default 100; Faster R-CNN: its own)."
)
flags.DEFINE_bool("json", False, "Print the report as one JSON line instead of the table.")


def main(argv):
    del argv
    if not FLAGS.model_dir:
        raise UsageError("--model_dir is required: the training run to export")
    logging.set_verbosity(logging.WARNING)  # TensorFlow's saver chatter; the table is the output
    report = export.export_run(
        FLAGS.model_dir,
        FLAGS.formats if FLAGS["formats"].present else None,  # None: what the model's kind writes
        FLAGS.precision,
        FLAGS.output_dir,
        eval_batches=FLAGS.eval_batches,
        batch_size=FLAGS.batch_size,
        options={
            "score_threshold": FLAGS.score_threshold,
            "iou_threshold": FLAGS.iou_threshold,
            "max_detections": FLAGS.max_detections,
        },
    )
    if FLAGS.json:
        print(json.dumps(report))
        return
    print(
        f"exported {report['directory']} ({report['kind']}, {report['precision']} -> layer policy "
        f"{report['layer_policy']}, {report['batch_norms_folded']} batch norms folded; "
        f"compared on {report['compared_with']})"
    )
    for name, reason in report.get("skipped_formats", {}).items():
        print(f"note: no {name}: {report.get('model') or report['kind']} {reason}")
    print(export.format_table(report["artifacts"], report["kind"]))


if __name__ == "__main__":
    cli.run(main)
