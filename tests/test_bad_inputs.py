"""Every bad input is refused before work starts: one `error:` line naming the value, exit 2,
no traceback, nothing written (the README's promise), across the apps, the launcher and the API;
and every bad file, signal or launch that can only show once work started ends in one line with
its documented exit status, nothing half-written, and the next run resumes (RUN_CASES,
LAUNCHED_CASES), or, where a user expects it, works.

The app cases run through tests/bad_input_runner.py: one process per app imports it once and
forks a child per case, so each case sees fresh flags and a fresh TensorFlow runtime for a
fraction of a process start; the runs of RUN_CASES follow their app's refusals in its runner.
Placeholders in the arguments: FIXTURES (files this module writes: a corrupt image folder,
broken COCO files, a fake run, ...), HOME (the cases' home directory), WORK (the runs' model
dirs).
"""

import json
import os
import re
import shutil
import sys
import types

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import ROOT, finish, save_spy_saved_model, start_python, write_zero_png
from PIL import Image

import tfmp
from tfmp import optim, run_dir
from tfmp.distribute import strategies as distribute
from tfmp.errors import UsageError
from tfmp.input import decoding
from tfmp.training.reporting import Reporter

TF_CONFIG_INDEX_3 = '{"cluster": {"worker": ["localhost:1"]}, "task": {"type": "worker", "index": 3}}'
TF_CONFIG_TWO_WORKERS = (
    '{"cluster": {"worker": ["localhost:1", "localhost:2"]}, "task": {"type": "worker", "index": 0}}'
)

# (app, arguments, environment, what the one `error:` line must contain)
APP_CASES = [
    # Names and choices.
    ("classify", ["--model=resnet9"], {}, "unknown model 'resnet9'; choose one of:"),
    ("classify", ["--dataset=imagenet"], {}, "imagenet"),
    ("classify", ["--precision=float8"], {}, "float8"),
    ("classify", ["--optimizer=adagrad"], {}, "unknown optimizer 'adagrad'"),
    ("classify", ["--lr_decay=step"], {}, "unknown learning-rate decay 'step'"),
    ("classify", ["--lr_scaling=cubic"], {}, "cubic"),
    ("classify", ["--xla=maybe"], {}, "unknown --xla value 'maybe'"),
    ("classify", ["--allreduce_dtype=half"], {}, "unknown --allreduce_dtype value 'half'"),
    ("classify", ["--allreduce_dtype=float16"], {}, "float16 under the float32 policy, without loss scaling"),
    (
        "classify",
        ["--allreduce_dtype=float16", "--precision=mixed_float16", "--loss_scale=none"],
        {},
        "use bfloat16 (float32's range), or turn its loss scaling back on (--loss_scale=auto, dynamic or a number)",
    ),
    ("classify", ["--allreduce_bucket_bytes=-1"], {}, "--allreduce_bucket_bytes=-1 must be 0"),
    ("classify", ["--label_smoothing=1.5"], {}, "--label_smoothing=1.5 must be in [0, 1)"),
    # Recipes and their pieces (tfmp.models.recipes).
    ("classify", ["--recipe=deit3"], {}, "unknown --recipe 'deit3'; choose one of: auto, cnn, deit, none"),
    (
        "classify",
        ["--mixup_alpha=-0.2"],
        {},
        "--mixup_alpha=-0.2 must be a finite number >= 0 (0 turns it off; DeiT: mixup 0.8, cutmix 1.0)",
    ),
    ("classify", ["--cutmix_alpha=nan"], {}, "--cutmix_alpha=nan must be a finite number >= 0"),
    (
        "classify",
        ["--model=vit_tiny", "--stochastic_depth=1.0"],
        {},
        "--stochastic_depth=1.0 must be in [0, 1)",
    ),
    (
        "classify",
        ["--stochastic_depth=0.1"],
        {},
        "--stochastic_depth=0.1: model 'seed_cnn' has no residual branches to drop; use it with vit_b16, vit_tiny",
    ),
    ("classify", ["--warmup_epochs=-1"], {}, "--warmup_epochs=-1.0 must be 0 (no warmup)"),
    (
        "classify",
        ["--randaugment_ops=2", "--randaugment_magnitude=12"],
        {},
        "--randaugment_magnitude=12.0 must be in [0, 10], e.g. 9 (DeiT)",
    ),
    (
        "classify",
        ["--randaugment_ops=-1"],
        {},
        "--randaugment_ops=-1 must be an integer in [0, 14] ops per image (0: off), e.g. 2",
    ),
    (
        "detect",
        ["--mixup_alpha=0.8"],
        {},
        "--mixup_alpha=0.8: DetectionTask's loss takes no mixed soft labels",
    ),
    ("classify", ["--strategy=tpu"], {}, "unknown strategy 'tpu'"),
    ("classify", ["--prune_sparsity=0.5", "--prune_schedule=cubic"], {}, "cubic"),
    ("classify", ["--no_such_flag=1"], {}, "no_such_flag"),
    ("classify", ["oops"], {}, "unexpected arguments ['oops']"),
    ("classify", ["--steps=abc"], {}, "--steps=abc"),
    ("classify", ["--flagfile=/no/such/flags.cfg"], {}, "--flagfile=/no/such/flags.cfg: no such file"),
    # Impossible combinations.
    ("classify", ["--mixed", "--precision=float32"], {}, "--mixed conflicts with --precision=float32"),
    ("classify", ["--loss_scale=1024"], {}, "--loss_scale"),
    ("classify", ["--loss_scale=banana", "--precision=mixed_float16"], {}, "--loss_scale='banana'"),
    (
        "classify",
        ["--strategy=mirrored", "--cpu_replicas=3", "--global_batch_size=64"],
        {},
        "global batch 64 is not divisible by 3 replicas",
    ),
    (
        "classify",
        ["--pipeline_stages=2", "--strategy=mirrored"],
        {},
        "--pipeline_stages=2 with --strategy=mirrored",
    ),
    ("classify", ["--pipeline_stages=2", "--micro_batches=0"], {}, "--micro_batches=0"),
    # Two-dimensional parallelism (a pipeline on every worker): refused before waiting for peers.
    (
        "classify",
        ["--pipeline_stages=2", "--cpu_replicas=2"],
        {},
        "--cpu_replicas=2 with --pipeline_stages=2",
    ),
    ("classify", ["--pipeline_stages=1000"], {}, "--pipeline_stages=1000 is more than the"),
    (
        "classify",
        ["--pipeline_stages=2", "--micro_batches=3", "--global_batch_size=64"],
        {"TF_CONFIG": TF_CONFIG_TWO_WORKERS},
        "--micro_batches=3 does not divide the per-worker batch 32 (global batch 64 over 2 workers)",
    ),
    ("classify", [], {"TF_CONFIG": TF_CONFIG_INDEX_3}, "TF_CONFIG task index 3 is out of range for 1 worker"),
    ("classify", [], {"TF_CONFIG": '{"cluster": '}, "TF_CONFIG"),
    ("classify", ["--strategy=mirrored"], {"TF_CONFIG": TF_CONFIG_INDEX_3}, "TF_CONFIG"),
    # Numbers out of range (NaN and infinity included).
    ("classify", ["--cpu_replicas=1000"], {}, "--cpu_replicas=1000 is more than"),
    ("classify", ["--cpu_replicas=-1"], {}, "--cpu_replicas=-1 must be 0"),
    ("classify", ["--learning_rate=inf"], {}, "learning rate inf must be a positive finite number"),
    ("classify", ["--learning_rate=nan"], {}, "learning rate nan must be a positive finite number"),
    ("classify", ["--learning_rate=-0.1"], {}, "learning rate -0.1 must be a positive finite number"),
    ("classify", ["--weight_decay=-1"], {}, "weight decay -1.0 must be 0"),
    ("classify", ["--weight_decay=nan"], {}, "weight decay nan must be 0"),
    ("classify", ["--checkpoint_every=-5"], {}, "--checkpoint_every=-5 must be 0"),
    ("classify", ["--steps_per_epoch=-1"], {}, "--steps_per_epoch=-1 must be 0"),
    ("classify", ["--startup_timeout=-1"], {}, "--startup_timeout=-1.0 must be a positive number of seconds"),
    ("classify", ["--startup_timeout=nan"], {}, "--startup_timeout=nan must be a positive number of seconds"),
    ("classify", ["--heartbeat_timeout=0.5"], {}, "--heartbeat_timeout=0.5 must be at least 1 second"),
    ("classify", ["--global_batch_size=0"], {}, "--global_batch_size=0 must be positive"),
    ("classify", ["--steps=-3"], {}, "--steps=-3 must be positive"),
    ("classify", ["--epochs=0"], {}, "--epochs=0 must be positive"),
    ("classify", ["--keep_checkpoints=0"], {}, "--keep_checkpoints=0 must be positive"),
    ("classify", ["--log_every=0"], {}, "--log_every=0 must be positive"),
    ("classify", ["--steps_per_execution=0"], {}, "--steps_per_execution=0 must be positive"),
    ("classify", ["--warmup_steps=-1"], {}, "--warmup_steps=-1 must be 0"),
    ("classify", ["--seed=-1"], {}, "--seed=-1 must be from 0 to 2**32 - 1"),
    ("classify", ["--image_size=0"], {}, "--image_size=0 must be a positive number of pixels"),
    (
        "classify",
        ["--model=vit_tiny", "--image_size=30"],
        {},
        "model 'vit_tiny' cuts images into 4x4 patches, and 30x30 is not a multiple of 4; use images of "
        "28x28 or 32x32 (--image_size=28 or 32 in the apps)",
    ),
    ("classify", ["--model=vit_b16", "--image_size=40"], {}, "use images of 32x32 or 48x48"),
    ("classify", ["--reference_batch_size=0"], {}, "--reference_batch_size=0 must be positive"),
    ("classify", ["--intra_op_threads=-1"], {}, "--intra_op_threads=-1 must be 0"),
    ("classify", ["--prune_sparsity=1.5"], {}, "prune sparsity 1.5 must be in [0, 1)"),
    ("classify", ["--pipeline_stages=-1"], {}, "--pipeline_stages=-1 must be 0"),
    ("classify", ["--diagnose_precision", "--diagnose_steps=0"], {}, "--diagnose_steps=0"),
    # Paths and data.
    ("classify", ["--model_dir=FIXTURES/a_file"], {}, "is a file"),
    ("classify", ["--model_dir=/proc/tfmp-run"], {}, "--model_dir=/proc/tfmp-run: cannot write in /proc"),
    ("classify", ["--model_dir=FIXTURES/dangling/run"], {}, "dangling is a symlink to FIXTURES/no-such-dir"),
    ("classify", ["--model_dir=FIXTURES/looping"], {}, "FIXTURES/looping is a symlink loop"),
    ("classify", ["--dataset=folder:FIXTURES/missing"], {}, "does not exist"),
    ("classify", ["--dataset=folder:FIXTURES/corrupt_folder"], {}, "bad.jpg"),
    (  # a name that is not UTF-8: shown with its bytes escaped
        "classify",
        ["--dataset=folder:FIXTURES/bytes_folder"],
        {},
        "1 file(s) are not readable images, first FIXTURES/bytes_folder/square/\\xff\\xfe_bad.png (starts with",
    ),
    (  # what TensorFlow's decoder cannot read is refused before the run, not mid-run
        "classify",
        ["--dataset=folder:FIXTURES/bmp_folder"],
        {},
        "first FIXTURES/bmp_folder/square/one_bit.bmp (a 1-bit BMP: TensorFlow's decoder reads 8, 24 and 32-bit",
    ),
    (
        "classify",
        ["--dataset=folder:FIXTURES/bomb_folder"],
        {},
        "bomb_folder/square/bomb.png is a 0.4 MB PNG of 20000x20000 = 400,000,000 pixels",
    ),
    ("classify", ["--dataset=tfds:mnist", "--data_dir=FIXTURES/empty"], {}, "mnist"),
    ("mnist", ["--model=nope"], {}, "unknown model 'nope'"),
    ("mnist", ["--strategy=mirrored", "--cpu_replicas=3", "--global_batch_size=100"], {}, "global batch 100"),
    # Detection.
    ("detect", ["--model=yolo9"], {}, "unknown detector 'yolo9'; choose one of: faster_rcnn_resnet50_fpn,"),
    (
        "detect",
        ["--predict=FIXTURES/a.png", "--model_dir=FIXTURES/missing"],
        {},
        "is not a tfmp run directory",
    ),
    ("detect", ["--dataset=coco:/nonexistent"], {}, "COCO dataset path '/nonexistent' does not exist"),
    ("detect", ["--dataset=coco:FIXTURES/coco_no_file_name.json"], {}, "file_name"),
    ("detect", ["--dataset=coco:FIXTURES/coco_images_not_a_list.json"], {}, "images"),
    ("detect", ["--max_detections=-1"], {}, "--max_detections=-1 must be a positive number of boxes"),
    (
        "detect",
        ["--model_dir=FIXTURES/run", "--predict=FIXTURES/a.png", "--output_dir=FIXTURES/a_file"],
        {},
        "--output_dir=FIXTURES/a_file is a file",
    ),
    ("detect", ["--score_threshold=1.5"], {}, "--score_threshold=1.5 must be a score from 0 to 1"),
    ("detect", ["--rcnn_class_loss=hinge"], {}, "rcnn_class_loss"),
    ("detect", ["--model_dir=~/run", "--steps=nan"], {}, "--steps=nan"),
    # Export and predict.
    ("export", [], {}, "--model_dir is required"),
    ("export", ["--model_dir=FIXTURES/missing"], {}, "does not exist"),
    ("export", ["--model_dir=FIXTURES/a_file"], {}, "is not a directory"),
    ("export", ["--model_dir=FIXTURES/run", "--precision=float8"], {}, "float8"),
    ("export", ["--model_dir=FIXTURES/run", "--formats=onnx"], {}, "onnx"),
    ("export", ["--model_dir=FIXTURES/run", "--output_dir=/proc/tfmp-export"], {}, "cannot write in /proc"),
    ("export", ["--model_dir=FIXTURES/run", "--output_dir=FIXTURES/a_file"], {}, "is a file"),
    ("export", ["--model_dir=FIXTURES/run", "--eval_batches=0"], {}, "eval_batches=0"),
    ("export", ["--model_dir=FIXTURES/broken_run"], {}, "is not a complete .keras file"),
    ("predict", ["FIXTURES/a.png"], {}, "--model is required"),
    ("predict", ["--model=FIXTURES/run"], {}, "no images given"),
    (
        "predict",
        ["--model=FIXTURES/missing", "FIXTURES/a.png"],
        {},
        "--model=FIXTURES/missing does not exist",
    ),
    ("predict", ["--model=FIXTURES/run", "--batch_size=0", "FIXTURES/a.png"], {}, "--batch_size=0 must be"),
    ("predict", ["--model=FIXTURES/run", "--batch_size=-1", "FIXTURES/a.png"], {}, "--batch_size=-1 must be"),
    ("predict", ["--model=FIXTURES/run", "--top_k=0", "FIXTURES/a.png"], {}, "--top_k=0 must be >= 1"),
    ("predict", ["--model=FIXTURES/run", "FIXTURES/"], {}, "is a directory"),
    ("predict", ["--model=FIXTURES/run", "FIXTURES/missing.png"], {}, "FIXTURES/missing.png': no such file"),
    ("predict", ["--model=FIXTURES/run", "FIXTURES/a_file"], {}, "not a decodable image"),
    ("predict", ["--model=FIXTURES/truncated.keras", "FIXTURES/a.png"], {}, "is not a complete .keras file"),
    # Untrusted files: a SavedModel is a program (this one writes a file), a bomb, a bad export.json.
    (
        "predict",
        ["--model=FIXTURES/spy_saved_model", "FIXTURES/a.png"],
        {},
        "SavedModel FIXTURES/spy_saved_model was not written by apps.export",
    ),
    (
        "predict",
        ["--model=FIXTURES/run", "FIXTURES/bomb.png"],
        {},
        "FIXTURES/bomb.png' is a 0.4 MB PNG of 20000x",
    ),
    (
        "predict",
        ["--model=FIXTURES/run", "--max_image_pixels=-1", "FIXTURES/a.png"],
        {},
        "--max_image_pixels=-1",
    ),
    (
        "predict",
        ["--model=FIXTURES/bad_json_export", "FIXTURES/a.png"],
        {},
        "export.json is not readable JSON",
    ),
    ("predict", ["--model=FIXTURES/unknown_kind_export", "FIXTURES/a.png"], {}, "names kind 'segmenter'"),
    (
        "predict",
        ["--model=FIXTURES/int8_export", "FIXTURES/a.png"],
        {},
        'int8_export/export.json: precision must be one of float32, float16, bfloat16, mixed, not "int8"',
    ),
    (
        "predict",
        ["--model=FIXTURES/reshaped_export", "FIXTURES/a.png"],
        {},
        "its export.json says images of [32, 32, 3], but the model takes [16, 16, 3]; export the run again",
    ),
    (
        "predict",
        ["--model=FIXTURES/run", "--score_threshold=2", "FIXTURES/a.png"],
        {},
        "--score_threshold=2.0",
    ),
    # The bench (checks that need no TensorFlow cell process).
    ("bench", ["--min_repeat_seconds=nan"], {}, "--min_repeat_seconds=nan must be 0 or a positive number"),
    ("bench", ["--peak_min_call_seconds=0"], {}, "--peak_min_call_seconds=0.0 must be a positive number"),
    ("bench", ["--replicas=0"], {}, "--replicas value 0 must be >= 1"),
    ("bench", ["--repeats=0"], {}, "--repeats=0 must be >= 1"),
    ("bench", ["--xla=maybe"], {}, "--xla value 'maybe' must be off or on"),
    ("bench", ["--output_dir=FIXTURES/a_file"], {}, "--output_dir=FIXTURES/a_file is a file"),
    ("bench", ["--mode=train", "--data=imagenet"], {}, "imagenet"),
]

# python -m tfmp.launch ARGS: (arguments, environment, the error line's text)
LAUNCH_CASES = [
    (["--workers=-1", "--", "python", "-c", "pass"], {}, "--workers=-1 must be >= 0"),
    (["--workers=2", "--", "/no/such/command"], {}, "worker command '/no/such/command' is not an executable"),
    (["--workers=2", "--devices_per_worker=0", "--", "python"], {}, "--devices_per_worker=0 must be >= 1"),
    (["--workers=2", "--startup_timeout=-5", "--", "python"], {}, "--startup_timeout=-5 must be >= 1"),
    (["--workers=2", "--max_restarts=-1", "--", "python"], {}, "--max_restarts=-1 must be >= 0"),
    (["--workers=2"], {}, "give the worker command after --"),
    (["--workers=2", "--"], {}, "the worker command after -- is empty"),
    (["--workers=x", "--", "python"], {}, "argument --workers: invalid int value: 'x'"),
    (["--workers=2", "--hosts=a:1", "--", "python"], {}, "--workers starts local workers"),
    (["--hosts=a:1,b:2", "--task_index=5", "--", "python"], {}, "--task_index=5 is out of range for 2 hosts"),
    (["--hosts=a:1,b:2", "--", "python"], {}, "--hosts needs --task_index"),
    (["--", "python"], {"TF_CONFIG": ""}, "nothing to launch"),
    (["--", "python"], {"TF_CONFIG": '{"cluster": '}, "TF_CONFIG"),
    (["--workers=2", "--network=open", "--", "python"], {}, "argument --network: invalid choice: 'open'"),
    (["--hosts=a:1,b:2", "--task_index=0", "--network=private", "--", "python"], {}, "for --workers groups"),
    (
        ["--workers=1000", "--", "python", "-c", "pass"],
        {},
        "--workers=1000 is more than this host can run: ",
    ),
    (
        ["--workers=2", "--max_workers_per_core=0", "--", "python"],
        {},
        "--max_workers_per_core=0 must be >= 1",
    ),
    (["--workers=2", "--task_index=1", "--", "python"], {}, "--task_index=1 is for --hosts"),
]

# python -m tfmp.launch ARGS that starts workers (stand-ins: no TensorFlow), or prints its help:
# (arguments, exit status, the text of the one `error:` line, which is the last line; or None: none)
USAGE_ERROR_WORKER = "import sys; print('error: --steps=-5 must be positive', file=sys.stderr); sys.exit(2)"
LAUNCHED_CASES = [
    (["--help"], 0, None),
    (
        ["--workers=2", "--", sys.executable, "-c", USAGE_ERROR_WORKER],
        2,
        "--steps=-5 must be positive (workers 0, 1)",
    ),
    (  # a worker that cannot start: its interpreter lacks a module
        ["--workers=2", "--", sys.executable, "-c", "import tfmp_is_not_here"],
        1,
        "exited with 1 without an error line (its last line: ModuleNotFoundError: No module named "
        "'tfmp_is_not_here'): is tfmp installed for",
    ),
]


# Runs that start and must end in one line, or finish where a user expects them to (WORK: their
# model dirs), one after the other on one model dir: the damaged PNG stops the first (seed 1: in
# step 5's batch, after the checkpoint of step 3 and the record of step 4); without it the second
# resumes, trains to the end and is sent SIGTERM while it writes model.keras; the third writes it.
ODD_RUN = [
    *("--dataset=folder:FIXTURES/odd_folder", "--image_size=8", "--model=mnist_mlp", "--global_batch_size=4"),
    *("--steps=8", "--checkpoint_every=3", "--log_every=1", "--seed=1", "--model_dir=WORK/odd"),
]


def _records(run):
    return [json.loads(line) for line in (run / run_dir.METRICS_FILE).read_text().splitlines()]


def _model_not_written(result, work, fixtures):
    names = [os.path.basename(path) for path in result["written"]]  # what this run left
    assert run_dir.MODEL_FILE not in names and run_dir.LOCK_FILE not in names, names
    assert not [name for name in names if name.startswith(run_dir.TEMPORARY_PREFIX)], names
    assert any(name.startswith("ckpt-8") for name in names), names  # what the resume writes it from


def _trained_every_file_but_the_damaged_one(result, work, fixtures):
    run = work / "odd"  # WebP files (one RGBA, named .png) and names that are not UTF-8 trained too
    assert "3 classes, 30 train / 3 eval" in json.loads((run / run_dir.RUN_CARD_FILE).read_text())["dataset"]
    assert [record["step"] for record in _records(run) if record["split"] == "train"] == list(range(1, 9))
    run_dir.check_keras_file(str(run / run_dir.MODEL_FILE))
    assert not (run / run_dir.LOCK_FILE).exists()


def _predicted_both(result, work, fixtures):
    records = [json.loads(line) for line in result["stdout"].splitlines()]
    assert [record["image"] for record in records] == [
        f"{fixtures}/\udcff\udcfe_ok.png",
        f"{fixtures}/rgba.webp",
    ]
    assert all(len(record["top_k"]) == 3 for record in records)


# (app, arguments, extra (remove: files to delete first; sigterm_after: see bad_input_runner.py),
#  exit status, the text of the one line it ends on (None: it succeeds), what else must hold)
RUN_CASES = [
    (
        "classify",
        ODD_RUN,
        {},
        6,
        "odd_folder/square/damaged.png does not decode (Invalid PNG data, size ",
        None,
    ),
    (
        "classify",
        ODD_RUN,
        {"remove": ["FIXTURES/odd_folder/square/damaged.png"], "sigterm_after": "keras:Model.save"},
        42,
        "preempted: SIGTERM while WORK/odd/model.keras was written: it was not (no half-written file is left)",
        _model_not_written,
    ),
    ("classify", ODD_RUN, {}, 0, None, _trained_every_file_but_the_damaged_one),
    (
        "predict",
        ["--model=FIXTURES/run", "FIXTURES/\udcff\udcfe_ok.png", "FIXTURES/rgba.webp"],
        {},
        0,
        None,
        _predicted_both,
    ),
]


def _write_fixtures(fixtures) -> None:
    """The files the cases point at: written once, and checked unchanged after every case."""
    fixtures.mkdir(parents=True)
    (fixtures / "a_file").write_text("not a directory, not an image\n")
    (fixtures / "dangling").symlink_to("no-such-dir")  # as --model_dir: refused before the model is built
    (fixtures / "looping").symlink_to("looping")
    (fixtures / "empty").mkdir()
    rng = np.random.default_rng(0)
    Image.fromarray((rng.random((16, 16, 3)) * 255).astype(np.uint8)).save(fixtures / "a.png")
    for name in ("circle", "square"):  # every 10th file of a class is held out for eval
        (fixtures / "corrupt_folder" / name).mkdir(parents=True)
        for index in range(10):
            Image.fromarray((rng.random((8, 8, 3)) * 255).astype(np.uint8)).save(
                fixtures / "corrupt_folder" / name / f"{index}.png"
            )
    (fixtures / "corrupt_folder" / "square" / "bad.jpg").write_text("<html>404</html>")
    categories = [{"id": 1, "name": "thing"}]
    coco = {"no_file_name": {"images": [{"id": 1, "width": 8, "height": 8}], "annotations": []}}
    coco["images_not_a_list"] = {"images": {"id": 1}, "annotations": []}
    for name, content in coco.items():
        (fixtures / f"coco_{name}.json").write_text(json.dumps({**content, "categories": categories}))
    # A finished run of a tiny classifier, and one whose model.keras was cut short.
    images = keras.Input((16, 16, 3))
    model = keras.Model(images, keras.layers.Dense(3, "softmax")(keras.layers.Flatten()(images)))
    for run in ("run", "broken_run"):
        (fixtures / run).mkdir()
        (fixtures / run / run_dir.FLAGS_FILE).write_text(
            "--model=seed_cnn\n--dataset=shapes\n--image_size=16\n"
        )
        model.save(fixtures / run / run_dir.MODEL_FILE)
    whole = (fixtures / "run" / run_dir.MODEL_FILE).read_bytes()
    (fixtures / "broken_run" / run_dir.MODEL_FILE).write_bytes(whole[: len(whole) // 2])
    (fixtures / "truncated.keras").write_bytes(whole[: len(whole) // 2])
    # Untrusted files: a SavedModel that would write into FIXTURES if it ran, a PNG bomb (also in
    # a class folder), export dirs with a broken and an unknown-kind export.json.
    save_spy_saved_model(fixtures / "spy_saved_model", fixtures / "spy_ran.txt", size=16)
    write_zero_png(fixtures / "bomb.png", 20000, 20000)
    shutil.copytree(fixtures / "corrupt_folder", fixtures / "bomb_folder")
    os.remove(fixtures / "bomb_folder" / "square" / "bad.jpg")
    write_zero_png(fixtures / "bomb_folder" / "square" / "bomb.png", 20000, 20000)
    exports = {"bad_json_export": '{"kind": ', "unknown_kind_export": '{"kind": "segmenter"}'}
    for name, precision, shape in (
        ("int8_export", "int8", [16, 16, 3]),
        ("reshaped_export", "float32", [32, 32, 3]),
    ):
        edited = {"kind": "classifier", "precision": precision, "preprocessing": {"image_shape": shape}}
        exports[name] = json.dumps(edited)  # an export.json edited by hand: the model is 16x16x3
    for name, text in exports.items():
        (fixtures / name).mkdir()
        (fixtures / name / run_dir.EXPORT_METADATA_FILE).write_text(text)
        (fixtures / name / run_dir.MODEL_FILE).write_bytes(whole)
    _write_odd_files(fixtures, rng)


def _image(path, rng, channels=3, size=8, **save):
    """A random image at `path` (bytes or str: a name need not be UTF-8), in the format `save` says."""
    pixels = (rng.random((size, size, channels)) * 255).astype(np.uint8)
    Image.fromarray(pixels, "RGBA" if channels == 4 else "RGB").save(os.fsdecode(path), **save)


def _write_odd_files(fixtures, rng) -> None:
    """Names that are not UTF-8, WebP files (an RGBA one named .png), a PNG damaged in its middle,
    a BMP TensorFlow cannot decode."""
    folder = os.fsencode(fixtures / "odd_folder")
    for name in (b"circle", b"square", b"\xff\xfe_class"):
        os.makedirs(os.path.join(folder, name))
        for index in range(10):
            _image(os.path.join(folder, name, b"%d.png" % index), rng)
    square = os.path.join(folder, b"square")
    _image(os.path.join(square, b"\xff\xfe_name.png"), rng)
    _image(os.path.join(square, b"z.png"), rng, channels=4, format="WEBP")
    _image(os.path.join(square, b"w.webp"), rng)
    damaged = os.path.join(square, b"damaged.png")  # its ends whole: it passes the check before the run
    _image(damaged, rng, size=64)
    with open(damaged, "r+b") as file:
        file.seek(os.path.getsize(damaged) // 2)
        file.write(bytes(200))
    _image(os.path.join(os.fsencode(fixtures), b"\xff\xfe_ok.png"), rng, size=16)
    _image(fixtures / "rgba.webp", rng, channels=4, size=16)
    shutil.copytree(fixtures / "bomb_folder", fixtures / "bytes_folder")
    os.remove(fixtures / "bytes_folder" / "square" / "bomb.png")
    with open(
        os.path.join(os.fsencode(fixtures / "bytes_folder" / "square"), b"\xff\xfe_bad.png"), "w"
    ) as file:
        file.write("<html>404</html>")
    shutil.copytree(fixtures / "bomb_folder", fixtures / "bmp_folder")
    os.remove(fixtures / "bmp_folder" / "square" / "bomb.png")
    Image.new("1", (8, 8)).save(fixtures / "bmp_folder" / "square" / "one_bit.bmp")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every app case (one runner process per app) and every launcher case, started at once."""
    base = tmp_path_factory.mktemp("bad_inputs")
    tree, logs = base / "tree", base / "logs"
    # WORK inside the classify runner's tree: `written` lists what each run wrote there.
    fixtures, home, work = tree / "fixtures", tree / "home", tree / "classify" / "work"
    _write_fixtures(fixtures)
    for folder in (home, logs):
        folder.mkdir()

    def placed(text):
        return text.replace("FIXTURES", str(fixtures)).replace("WORK", str(work))

    by_app, started = {}, []
    for index, (app, args, env, _) in enumerate(APP_CASES):
        case = {"args": [placed(arg) for arg in args], "env": {"HOME": str(home), **env}}
        by_app.setdefault(app, []).append((("app", index), case))
    for index, (app, args, extra, *_) in enumerate(RUN_CASES):  # after their app's refusals
        case = {"args": [placed(arg) for arg in args], "env": {"HOME": str(home)}, **extra}
        case["remove"] = [placed(path) for path in extra.get("remove", [])]
        by_app.setdefault(app, []).append((("run", index), case))
    for app, cases in by_app.items():
        spec = {"app": app, "tree": str(tree / app), "logs": str(logs), "cases": [case for _, case in cases]}
        (tree / app).mkdir()
        (base / f"{app}.json").write_text(json.dumps(spec))
        runner = start_python(
            [
                os.path.join(ROOT, "tests", "bad_input_runner.py"),
                str(base / f"{app}.json"),
                str(base / f"{app}.results.json"),
            ]
        )
        started.append((app, cases, runner))
    launched = [start_python(["-m", "tfmp.launch", *args], env=env) for args, env, _ in LAUNCH_CASES]
    with_workers = [start_python(["-m", "tfmp.launch", *args]) for args, *_ in LAUNCHED_CASES]
    results = {}
    for app, cases, runner in started:
        finished = finish(runner)
        assert finished.returncode == 0, finished.stderr[-3000:]
        found = json.loads((base / f"{app}.results.json").read_text())
        results.update({key: result for (key, _), result in zip(cases, found)})
    launches = [finish(process) for process in launched]
    return types.SimpleNamespace(
        apps=results,
        launches=launches,
        launched=[finish(process) for process in with_workers],
        fixtures=str(fixtures),
        work=work,
    )


def _assert_one_error_line(returncode, stderr, message):
    assert returncode == 2, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    range(len(APP_CASES)),
    ids=[f"{app}:{' '.join(args) or 'no flags'}" for app, args, *_ in APP_CASES],
)
def test_app_refuses_with_one_line_and_writes_nothing(runs, case):
    result = runs.apps[("app", case)]
    message = APP_CASES[case][3].replace("FIXTURES", runs.fixtures)
    _assert_one_error_line(result["returncode"], result["stderr"], message)
    assert not result["written"], result["written"]


@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(LAUNCH_CASES)), ids=[" ".join(args) for args, *_ in LAUNCH_CASES])
def test_launcher_refuses_with_one_line(runs, case):
    result = runs.launches[case]
    _assert_one_error_line(result.returncode, result.stderr, LAUNCH_CASES[case][2])
    assert "[launch]" not in result.stdout  # no worker was started


@pytest.mark.slow
@pytest.mark.parametrize(
    "case", range(len(LAUNCHED_CASES)), ids=[" ".join(args) for args, *_ in LAUNCHED_CASES]
)
def test_a_launched_group_ends_on_one_error_line(runs, case):
    """What the workers said (or that one could not start) is the launcher's last line, once."""
    result = runs.launched[case]
    _, code, message = LAUNCHED_CASES[case]
    assert result.returncode == code, result.stdout[-3000:] + result.stderr[-3000:]
    said = [
        line
        for line in (result.stdout + result.stderr).splitlines()
        if re.match(r"(\[worker \d+\] )?error:", line)
    ]
    if message is None:
        assert result.stdout.startswith("usage: python -m tfmp.launch") and not result.stderr and not said
        return
    last = result.stderr.strip().splitlines()[-1]
    assert said == [last] and last.startswith("error: ") and message in last, result.stdout + result.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    range(len(RUN_CASES)),
    ids=[f"{app}:{' '.join(args)}:{extra or ''}" for app, args, extra, *_ in RUN_CASES],
)
def test_a_run_ends_in_one_line_or_works(runs, case):
    """A fault mid-run (a damaged file, SIGTERM while model.keras is written) is one line with its
    exit status and nothing half-written, and the next run resumes; odd but valid input works."""
    result = runs.apps[("run", case)]
    _, _, _, code, message, check = RUN_CASES[case]
    output = result["stdout"][-3000:] + result["stderr"][-3000:]
    assert result["returncode"] == code and "Traceback" not in result["stderr"], output
    if message is None:
        assert not re.search(r"^(error|preempted|interrupted):", result["stderr"], re.MULTILINE), output
    else:
        lines = result["stderr"].strip().splitlines()
        message = message.replace("WORK", str(runs.work))
        assert len(lines) == 1 and re.match(r"(error|preempted): ", lines[0]) and message in lines[0], output
    assert all(f"{path}/".startswith(f"{runs.work}/") for path in result["written"]), result["written"]
    if check is not None:
        check(result, runs.work, runs.fixtures)


# The Python API: a UsageError naming the value, raised before anything is written.
def _tiny_model(classes=3):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(classes)])
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _tiny_data(labels):
    features = np.zeros((len(labels), 4), np.float32)
    return tf.data.Dataset.from_tensor_slices((features, np.asarray(labels))).batch(2)


API_CASES = [
    (lambda tmp: distribute.get_strategy("tpu"), "unknown strategy 'tpu'"),
    (lambda tmp: optim.schedule(float("inf"), 10), "learning rate inf"),
    (lambda tmp: optim.build("adam", 1e-3, float("nan")), "weight decay nan"),
    (lambda tmp: run_dir.writable_dir(str(tmp / "a_file")), "is a file"),
    (lambda tmp: run_dir.writable_dir(str(tmp / "dangling")), "dangling is a symlink to"),
    (lambda tmp: run_dir.read_flags(str(tmp), required=True), "is not a tfmp run directory"),
    (lambda tmp: run_dir.check_keras_file(str(tmp / "a_file")), "is not a complete .keras file"),
    (lambda tmp: tfmp.fit(_tiny_model(), _tiny_data([0, 1]), model_dir=str(tmp / "a_file")), "a_file"),
    (lambda tmp: tfmp.fit(_tiny_model(), _tiny_data([0, 7]), model_dir=str(tmp / "run")), "7"),
    (lambda tmp: tfmp.fit(_tiny_model(), _tiny_data([0, 1]), epochs=0, model_dir=str(tmp / "run")), "epochs"),
    (
        lambda tmp: tfmp.fit(
            _tiny_model(), _tiny_data([0, 1]), class_weight={"a": 1.0}, model_dir=str(tmp / "run")
        ),
        "class_weight keys must be class ids 0, 1, ...; got ['a']",
    ),
    (
        lambda tmp: tfmp.fit(
            _tiny_model(), _tiny_data([0, 1]), class_weight={0: "x"}, model_dir=str(tmp / "run")
        ),
        "class_weight values must be finite numbers; got ['x']",
    ),
]


@pytest.mark.parametrize("case", range(len(API_CASES)))
def test_api_refuses_before_writing(tmp_path, case):
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "dangling").symlink_to("missing")
    call, message = API_CASES[case]
    with pytest.raises(UsageError) as raised:
        call(tmp_path)
    assert message in str(raised.value) and "\n" not in str(raised.value)
    assert sorted(os.listdir(tmp_path)) == ["a_file", "dangling"]


def test_a_resume_drops_the_metrics_records_past_its_checkpoint(tmp_path):
    """metrics.jsonl of a run killed at step 8 after the checkpoint of step 5 (and a record cut
    short): the resume from step 5 logs steps 6... again, so the file's steps never go back."""
    metrics = tmp_path / run_dir.METRICS_FILE
    killed = "".join(json.dumps({"step": step, "split": "train"}) + "\n" for step in range(1, 9))
    metrics.write_text(killed + '{"step": 9, "spl')
    reporter = Reporter(str(tmp_path), verbose=False, start_step=5)
    reporter.scalars(6, "train", {"loss": 1.0})
    reporter.close()
    assert [record["step"] for record in _records(tmp_path)] == [1, 2, 3, 4, 5, 6]
    reporter = Reporter(
        str(tmp_path), verbose=False
    )  # no start step given (tfmp.fit): from the first record on
    reporter.scalars(3, "train", {"loss": 1.0})
    reporter.close()
    assert [record["step"] for record in _records(tmp_path)] == [1, 2, 3]


def test_the_file_a_decode_error_came_from_is_named(tmp_path):
    """TensorFlow's error names the op, not the file: the run finds the file among its dataset's
    (by the size a PNG's error gives, first) and says what is wrong with it in its one line."""
    rng = np.random.default_rng(0)
    for name in ("a.png", "b.png", "gone.png"):
        _image(tmp_path / name, rng)
    _image(tmp_path / "damaged.png", rng, size=64)
    with open(tmp_path / "damaged.png", "r+b") as file:
        file.seek(os.path.getsize(tmp_path / "damaged.png") // 2)
        file.write(bytes(200))
    paths = [str(tmp_path / name) for name in ("a.png", "b.png", "damaged.png", "gone.png")]

    def decoded(paths):
        return list(
            tf.data.Dataset.from_tensor_slices(paths).map(lambda path: decoding.decode(tf.io.read_file(path)))
        )

    with pytest.raises(tf.errors.InvalidArgumentError) as raised:
        decoded(paths)
    path, reason = decoding.failing_file(paths, raised.value)
    assert path == paths[2] and reason.startswith("Invalid PNG data, size ")
    assert "damaged.png does not decode (Invalid PNG data" in decoding.stopped_by("folder:x", path, reason)
    os.remove(paths[3])
    with pytest.raises(tf.errors.NotFoundError) as raised:
        decoded(paths[3:])
    path, reason = decoding.failing_file(paths[:2] + paths[3:], raised.value)
    assert path == paths[3] and "gone.png disappeared while the run read it" in decoding.stopped_by(
        "d", path, reason
    )
    assert decoding.failing_file(paths[:2], tf.errors.InvalidArgumentError(None, None, "no file's")) is None
