"""The apps as a user runs them: real processes, real flags, exit codes, files on disk."""

import glob
import json
import os

import pytest
from conftest import ROOT, run_python, write_image_folder

pytestmark = pytest.mark.slow  # each test starts TensorFlow in a new process

MOCK_TFDS = """
import sys, tensorflow_datasets as tfds
from apps import cli, {app}
with tfds.testing.mock_data(num_examples=64):
    cli.run({app}.main)
"""


def _summary(output):
    lines = [line for line in output.splitlines() if line.startswith("tfmp summary:")]
    assert lines, output[-3000:]
    return lines[-1]


def test_classify_builtin_default_with_mixed(tmp_path):
    result = run_python(["-m", "apps.classify", "--mixed", "--steps=6", f"--model_dir={tmp_path}"])
    assert result.returncode == 0, result.stderr[-3000:]
    summary = _summary(result.stdout)
    assert "precision mixed_" in summary and "6 steps" in summary
    assert (tmp_path / "model.keras").exists() and (tmp_path / "flags.txt").exists()
    assert "--precision=mixed" in (tmp_path / "flags.txt").read_text()
    # TensorFlow's own INFO lines (checkpoint sharding, collectives) stay out of an app's output.
    assert "Sharding callback" not in result.stdout + result.stderr
    assert "functional_saver" not in result.stdout + result.stderr


def test_mnist_builtin_default_is_mirrored_over_all_cores(tmp_path):
    result = run_python(["-m", "apps.mnist", "--steps=4", "--steps_per_epoch=2", f"--model_dir={tmp_path}"])
    assert result.returncode == 0, result.stderr[-3000:]
    card = json.load(open(tmp_path / "run_card.json"))
    assert card["strategy"].startswith("MirroredStrategy")
    assert card["replicas"].startswith(f"{os.cpu_count()} ")
    evals = [json.loads(line) for line in open(tmp_path / "metrics.jsonl") if '"eval"' in line]
    assert [r["step"] for r in evals] == [2, 4]  # validation after every epoch


@pytest.mark.parametrize(
    "app, dataset, extra",
    [
        ("classify", "tfds:cifar10", ["--model=seed_cnn", "--strategy=mirrored", "--cpu_replicas=2"]),
        ("mnist", "tfds:mnist", []),
    ],
)
def test_apps_on_mocked_tfds(tmp_path, app, dataset, extra):
    result = run_python(
        [
            "-c",
            MOCK_TFDS.format(app=app),
            f"--dataset={dataset}",
            "--steps=4",
            "--global_batch_size=16",
            "--precision=mixed_bfloat16",
            f"--model_dir={tmp_path}",
            *extra,
        ]
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "4 steps" in _summary(result.stdout)
    card = json.load(open(tmp_path / "run_card.json"))
    assert card["dataset"].startswith(dataset)


@pytest.mark.slow
def test_vit_b16_config_and_its_deit_recipe_run_a_few_steps_on_a_cpu(tmp_path):
    """configs/vit_b16_imagenet_8gpu.cfg with DeiT's recipe (RandAugment, Mixup/CutMix, stochastic
    depth, weight decay without norms/biases/tokens), on a 30-image folder at 16x16 (one patch +
    the class token) and a CPU's batch, in float32: it builds and trains. With the config's
    float16 (emulated on CPUs without AVX512-FP16) and 32x32 images, the run, its eval of the
    2,000 shapes included, took 254 s on the AVX2 EPYC; at 16x16 on the built-in shapes 164 s on
    the family-25 EPYC, 83 s with this folder's 3 eval images (about 20 s of that was the summary's
    gzip of 330 MB of weights, which only pruned runs compute now); policies are
    tests/test_matrix.py's."""
    folder = write_image_folder(tmp_path / "images", 10)  # 27 train, 3 eval images
    result = run_python(
        [
            "-m",
            "apps.classify",
            "--flagfile=configs/vit_b16_imagenet_8gpu.cfg",
            f"--dataset=folder:{folder}",
            "--image_size=16",
            "--precision=float32",
            "--global_batch_size=8",
            "--steps=2",
            "--xla=off",  # XLA's compile of 12 blocks costs more than the 2 steps on a CPU
            "--steps_per_execution=1",
            f"--model_dir={tmp_path / 'run'}",
        ]
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 steps (2 applied)" in _summary(result.stdout)
    card = json.load(open(tmp_path / "run" / "run_card.json"))
    assert card["recipe"].startswith("deit: ") and "mixup_alpha=0.8 (recipe)" in card["recipe values"]
    assert "(none on normalization scales and offsets, biases, embeddings, tokens)" in card["weight decay"]
    assert card["dataset"].startswith("folder:")


# User errors (bad flags, combinations, TF_CONFIG): tests/test_bad_inputs.py's table.


def test_every_config_parses_with_its_app():
    by_app = {}
    for path in sorted(glob.glob(os.path.join(ROOT, "configs", "*.cfg"))):
        header = open(path).read()
        assert "# Command: python -m apps." in header, path
        app = header.split("# Command: python -m apps.")[1].split()[0]
        by_app.setdefault(app, []).append(path)
    assert {"classify", "mnist", "bench"} <= set(by_app)
    # One process per set of flags: apps.mnist defines none of its own (it only changes
    # apps.common's defaults, as apps.classify does), so their configs parse in one process.
    by_app["classify"] += by_app.pop("mnist")
    for app, paths in by_app.items():
        imports = "classify, mnist" if app == "classify" else app
        checks = [f"from apps import {imports}; from absl import flags"] + [
            f"flags.FLAGS(['x', '--flagfile={path}']); print('{os.path.basename(path)}', 'ok')"
            for path in paths
        ]
        result = run_python(["-c", "\n".join(checks)])
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.count(" ok") == len(paths)
