"""keras-hub's ViT and BERT backbones trained through `tfmp.fit`, Keras' layers vs fused (issue 33):
the live peak of a warm step, float32 vs mixed_bfloat16, and the accuracy each reaches.

    python -m tfmp.bench.hub_transformers '{"mode": "memory", "models": ["hub_bert"], "batches": [32, 128]}'
    python -m tfmp.bench.hub_transformers '{"mode": "accuracy", "models": ["hub_vit", "hub_bert"]}'

Each cell (model, precision, fused, batch) runs in a fresh process (`{"cell": {...}}` as the
argument) and prints one `BENCH_RESULT {json}` line; the parent prints a table. Needs keras-hub.

The models, built from keras-hub's constructors (no weights downloaded) in the precision's policy,
each with a float32 softmax head, compiled with the bench's SGD (0.01, momentum 0.9) to measure
memory and with Adam (1e-3) to measure accuracy:
* `hub_vit`: `tfmp.bench.keras_models.hub_vit` (ViTBackbone patch 4, 4 layers, width 128,
  4 heads, MLP 512; 65 tokens) on the built-in `shapes` data at 32x32 (`apps.bench
  --models=hub_vit` measures the same model's Engine step);
* `hub_bert`: BertBackbone, 4 layers, width 128, 4 heads, intermediate 512 (4x), 64 tokens,
  `dropout` (default keras-hub's 0.1: its attention then stays on Keras' explicit path, already
  half precision, and `fuse_normalization` leaves it alone and says so; 0: fused too),
  vocabulary `vocabulary` (default 1,000); its pooled [CLS] output -> the head. Data: a synthetic token task drawn once
  from seed 0: token 0 is [CLS], each sequence holds one of 4 marker tokens (1-4) at a random
  position among random filler tokens (5 and up), the last 0-15 positions are padding
  (padding_mask 0); the label is the marker's class. Bag-of-words learnable, through attention.

Memory ("mode": "memory"): `warmup` steps of `tfmp.fit`, then TensorFlow's allocator statistics
reset (`tfmp.bench.live_memory`, as `tfmp.bench.cell` after its warm-up) and `steps` more; the
cell's live peak is the largest device's allocator peak after them (`live_memory.peak_mb`): weights,
optimizer slots and what one step holds at once. `TF_CPU_ALLOCATOR_USE_BFC=true` (set here, as
`tfmp.bench.runner` does) keeps that statistic on CPU. The data (a few batches) are in memory
before the reset. Accuracy ("mode": "accuracy"): `train_steps` steps at `batch`, then the
accuracy on the held-out split (`shapes`' eval split; for BERT 1,024 sequences drawn from seed 1);
the training set is at most EPOCH_BATCHES batches (shapes' first ones; BERT's drawn from seed 0) seen in
turn, shuffled each epoch by tfmp.fit's seed 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")  # before TensorFlow starts: see above

import keras  # noqa: E402
import numpy as np  # noqa: E402

from tfmp.bench import keras_models, live_memory, runner  # noqa: E402
from tfmp.bench.matrix import RESULT_PREFIX  # noqa: E402
from tfmp.classification import data  # noqa: E402
from tfmp.precision.fused_norm import fuse_normalization  # noqa: E402
from tfmp.training import fitting  # noqa: E402

TOKENS, MARKERS, MAX_PADDING = 64, 4, 15
EPOCH_BATCHES = 50  # accuracy mode: the training set is this many batches, seen once an epoch
HUB_BERT = {"num_layers": 4, "num_heads": 4, "hidden_dim": 128, "intermediate_dim": 512}
DEFAULTS = {
    "mode": "memory",
    "models": ["hub_vit", "hub_bert"],
    "precisions": ["float32", "mixed_bfloat16"],
    "fused": [False, True],
    "batches": [64],
    "vocabulary": 1000,
    "dropout": 0.1,
    "warmup": 2,
    "steps": 2,
    "train_steps": 300,
}


def hub_bert(
    num_classes: int, vocabulary: int, dropout: float, dtype=None, name: str = "hub_bert"
) -> keras.Model:
    """keras-hub's BertBackbone (HUB_BERT, TOKENS) -> pooled [CLS] output -> float32 softmax."""
    backbone = keras_models.keras_hub_module().models.BertBackbone(
        vocabulary_size=vocabulary,
        max_sequence_length=TOKENS,
        dropout=dropout,
        dtype=dtype,
        name=f"{name}_backbone",
        **HUB_BERT,
    )
    inputs = {key: keras.Input((TOKENS,), dtype="int32", name=key) for key in backbone.input}
    pooled = backbone(inputs)["pooled_output"]
    outputs = keras.layers.Dense(num_classes, activation="softmax", dtype="float32", name=f"{name}_probs")(
        pooled
    )
    return keras.Model(inputs, outputs, name=name)


def marker_tokens(examples: int, vocabulary: int, seed: int):
    """(BERT's inputs, labels) of the marker task (module docstring)."""
    rng = np.random.default_rng(seed)
    token_ids = rng.integers(MARKERS + 1, vocabulary, (examples, TOKENS)).astype(np.int32)
    lengths = TOKENS - rng.integers(0, MAX_PADDING + 1, examples)
    labels = rng.integers(0, MARKERS, examples).astype(np.int32)
    padding_mask = (np.arange(TOKENS)[None, :] < lengths[:, None]).astype(np.int32)
    for row in range(examples):
        token_ids[row, rng.integers(1, lengths[row])] = labels[row] + 1
    token_ids[:, 0] = 0  # [CLS]
    inputs = {
        "token_ids": token_ids * padding_mask,
        "segment_ids": np.zeros_like(token_ids),
        "padding_mask": padding_mask,
    }
    return inputs, labels


class _LivePeak(keras.callbacks.Callback):
    """Resets the allocator's statistics before step `warmup` (0-based) of the fit."""

    def __init__(self, warmup: int):
        super().__init__()
        self.warmup = warmup

    def on_train_batch_begin(self, batch, logs=None):
        if batch == self.warmup:
            live_memory.reset()


def _build(cell: dict):
    """(compiled model, its `fuse_normalization` report or None, vocabulary or image shape)."""
    keras.utils.set_random_seed(0)
    if cell["model"] == "hub_vit":
        model = keras_models.hub_vit(
            (32, 32, 3), data.describe("shapes", image_size=32).num_classes, cell["precision"]
        )
    else:
        model = hub_bert(MARKERS, cell["vocabulary"], cell.get("dropout", 0.1), cell["precision"])
    report = fuse_normalization(model) if cell["fused"] else None
    # Memory: the bench's SGD with momentum (one slot). Accuracy: Adam (1e-3), as transformers are
    # trained; with SGD (0.01) the BERT task stayed at chance (0.245) after 150 steps.
    memory = cell["mode"] == "memory"
    optimizer = keras.optimizers.SGD(0.01, momentum=0.9) if memory else keras.optimizers.Adam(1e-3)
    model.compile(optimizer, "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model, report


def _train_data(cell: dict, examples: int):
    if cell["model"] == "hub_bert":
        return marker_tokens(examples, cell["vocabulary"], seed=0)
    dataset = data.load("shapes", "train", cell["batch"], image_size=32)[0].take(examples // cell["batch"])
    images, labels = zip(*dataset.as_numpy_iterator())
    return np.concatenate(images), np.concatenate(labels)


def _held_out_accuracy(cell: dict, model) -> float:
    if cell["model"] == "hub_bert":
        inputs, labels = marker_tokens(1024, cell["vocabulary"], seed=1)
        return float(np.mean(np.argmax(model.predict(inputs, batch_size=256, verbose=0), -1) == labels))
    correct = total = 0
    for images, labels in data.load("shapes", "eval", 256, image_size=32, training=False)[0]:
        keep = labels.numpy() >= 0  # the eval stream's padding rows
        predictions = np.argmax(model(images, training=False), -1)
        correct, total = correct + int(np.sum((predictions == labels.numpy())[keep])), total + int(keep.sum())
    return correct / total


def measure(cell: dict) -> dict:
    """One cell in this process (module docstring)."""
    model, report = _build(cell)
    if cell["mode"] == "memory":  # one epoch of warmup + steps batches
        epochs, batches, callbacks = 1, cell["warmup"] + cell["steps"], [_LivePeak(cell["warmup"])]
    else:  # train_steps steps (rounded up to whole epochs) over epochs of at most EPOCH_BATCHES batches
        batches = min(EPOCH_BATCHES, cell["train_steps"])
        epochs, callbacks = -(-cell["train_steps"] // batches), []
    x, y = _train_data(cell, cell["batch"] * batches)
    history = fitting.fit(
        model, x, y, batch_size=cell["batch"], epochs=epochs, callbacks=callbacks, verbose=0
    )
    result = {**cell, "fused_layers": len(report.fused) if report else 0, "loss": history.history["loss"][-1]}
    result["left_alone"] = [list(item) for item in report.left_alone] if report else []
    if cell["mode"] == "memory":
        result["peak_memory_mb"] = live_memory.peak_mb()
        result["variables_mb"] = live_memory.variables_mb(model, model.optimizer)
    else:
        result["accuracy"] = _held_out_accuracy(cell, model)
    return result


def _cells(settings: dict) -> list[dict]:
    shared = {
        key: settings[key] for key in ("mode", "vocabulary", "dropout", "warmup", "steps", "train_steps")
    }
    return [
        {**shared, "model": model, "precision": precision, "fused": fused, "batch": batch}
        for model in settings["models"]
        for batch in settings["batches"]
        for fused in settings["fused"]
        for precision in settings["precisions"]
    ]


def _run(cell: dict) -> dict:
    command = [sys.executable, "-m", "tfmp.bench.hub_transformers", json.dumps({"cell": cell})]
    output = subprocess.run(command, capture_output=True, text=True, check=False)
    result = runner.parse_result(output.stdout)  # the bench cells' own result line
    if output.returncode != 0 or result is None:
        raise RuntimeError(f"cell {cell} failed ({output.returncode}): {output.stderr[-2000:]}")
    return result


def table(results: list[dict]) -> str:
    """Markdown: one row per (model, batch, layers), float32 and mixed_bfloat16 side by side."""
    value = "peak_memory_mb" if results[0]["mode"] == "memory" else "accuracy"
    rows = {}
    for result in results:
        key = (result["model"], result["batch"], "fused" if result["fused"] else "Keras'")
        rows.setdefault(key, {})[result["precision"]] = result
    columns = f"float32 {value} | mixed_bfloat16 {value} | mixed / float32 | weights+slots MiB"
    header = f"| model | batch | layers | {columns} |"
    lines = [header, "|---|---:|---|---:|---:|---:|---:|"]
    for (model, batch, layers), cells in rows.items():
        single, mixed = cells.get("float32", {}).get(value), cells.get("mixed_bfloat16", {}).get(value)
        ratio = f"{mixed / single:.2f}" if single and mixed and value == "peak_memory_mb" else ""
        weights = next(iter(cells.values())).get("variables_mb", float("nan"))
        lines.append(
            f"| {model} | {batch} | {layers} | {_cell(single)} | {_cell(mixed)} | {ratio} | {weights:.1f} |"
        )
    return "\n".join(lines)


def _cell(number: float | None) -> str:
    """A table cell: blank where that precision was not measured (a `precisions` list of one)."""
    return "" if number is None else f"{number:.3f}"


def main(argument: str) -> None:
    settings = json.loads(argument)
    if "cell" in settings:
        print(RESULT_PREFIX + json.dumps(measure(settings["cell"])), flush=True)
        return
    settings = {**DEFAULTS, **settings}
    results = []
    for cell in _cells(settings):
        results.append(_run(cell))
        print(json.dumps(results[-1]), flush=True)
    print(table(results))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "{}")
